"""Ranks sharing a node, priced by what runs at once (docs/scaling.md,
"Ranks sharing a node").

``predict --calibrate`` measures ``compute_ratio[k]``: an op's time while
k ranks of one host compute at once over its time alone (node.py). The
rule before priced every compute op of a rank at the ratio of all the
node's ranks, c_N = min(N, K), whether or not the others computed while it
ran: right for data parallelism, whose replicas compute in step, but a
pipeline's stage computes while the other stage waits for its activations
(its bubble), and a tensor shard while the other waits in an allreduce,
so the rule priced their ops at a contention they mostly do not meet (on
2 ranks of one host, pipeline and tensor settings predicted 1.7-2.9x
slower than they ran, data parallel not).

``contended``: where the trace ran alone on its node (its op times hold
no contention: ``plan --choose``'s one-rank calibration) and a node holds
two simulated ranks, the ranks are simulated without contention, then
each compute op is priced again by the number of its node's ranks
computing while it runs (itself and each other rank with a compute op in
that time; a rank of the node not simulated, a replica, as the simulated
rank at its place in replica 0 computes: a pipeline's stage as that
stage, a tensor shard as the op's own rank, busy when it is): its time
alone over its mean speed, 1 / ratio[j] in the time j ranks compute
(processor sharing), and simulated again; twice, each from the last
one's times, the second damped (``reprice``). Otherwise (one simulated rank a node: data parallelism's or tensor
parallelism's replicas, which compute in step, mirrors only; a trace of
several ranks of a node, whose op times hold the contention they ran
under) the rule before applies: ``node.factors`` of c_N.
"""
import numpy as np

from .simulate import simulate

#: the rounds of pricing and simulating again, each from the last one's
#: times, the second on damped (``reprice``)
ROUNDS = 2


def applies(graphs, node, n):
    """Whether ``contended`` prices by what runs at once: a node
    correction of a trace alone on its node, at least 2 ranks on a node,
    and a node holding two simulated ranks (else every rank's node-mates
    are mirrors, below: the rule before)."""
    if node is None or not node.by_busy or node.traced_on_node != 1 \
            or node.ranks_on_node < 2:
        return False
    nodes = [g.rank // node.ranks_on_node for g in graphs]
    return len(set(nodes)) < len(nodes)


def node_mates(graphs, rank, k, n, per=None):
    """(the simulated ranks sharing ``rank``'s node of ``k`` ranks, the
    simulated rank each of its node's ranks not simulated computes as):
    ranks 0..k-1 one node, k..2k-1 the next (mpiexec's blocks), the last
    node holding what is left of ``n``. A rank not simulated is a replica of
    a simulated one (``Scenario``: replica q's rank of replica 0's rank r is
    r + q * ``per``): it computes as rank ``u % per`` does where that rank is
    simulated (a pipeline's stage: the same stage of replica 0), else (a
    tensor shard other than 0, which computes in step with shard 0; ``per``
    None) as ``rank`` itself: busy when it is."""
    first = rank // k * k
    size = min(k, n - first)
    simulated = {g.rank for g in graphs}
    mates = [g for g in graphs if g.rank != rank and g.rank // k == rank // k]
    mirrors = []
    for u in range(first, first + size):
        if u in simulated:
            continue
        like = u % per if per else rank
        mirrors.append(like if like in simulated else rank)
    return mates, mirrors


def busy_intervals(graph, spans):
    """The merged [start, end) times in which ``graph``'s rank runs a
    compute op (any lane), from its spans (``SimResult.spans``)."""
    got = sorted((s, e) for s, e, _, name, _ in spans
                 if e > s and graph.ops.get(name) is not None
                 and graph.ops[name].kind == "compute")
    merged = []
    for s, e in got:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def busy_before(intervals):
    """t -> the time before ``t`` inside the merged ``intervals`` (of
    arrays of times t)."""
    if not intervals:
        return lambda t: np.zeros_like(t)
    iv = np.asarray(intervals, dtype=float)
    starts, lens = iv[:, 0], iv[:, 1] - iv[:, 0]
    cum = np.concatenate(([0.0], np.cumsum(lens)))

    def before(t):
        i = np.searchsorted(starts, t, side="right") - 1
        k = np.maximum(i, 0)
        inside = cum[k] + np.minimum(t - starts[k], lens[k])
        return np.where(i >= 0, inside, 0.0)
    return before


def busy_shares(graph, spans, mates):
    """{compute op: {j: share of its time in which j ranks of its node
    compute, itself included}} over every simulated iteration, ``mates``
    the merged busy intervals of each other rank of its node. With one
    other rank this is exact; with more, each mate's overlap is taken as
    independent of the others' (the shares of j from their products)."""
    rows = [(s, e, name) for s, e, _, name, _ in spans
            if e > s and name in graph.priced and graph.ops[name].kind == "compute"]
    if not rows:
        return {}
    names = sorted({name for _, _, name in rows})
    index = {name: i for i, name in enumerate(names)}
    s = np.array([r[0] for r in rows])
    e = np.array([r[1] for r in rows])
    of = np.array([index[r[2]] for r in rows])
    dur = e - s
    dist = np.zeros((len(rows), len(mates) + 2))
    dist[:, 1] = 1.0  # j = 1: the op's own rank
    for m in mates:
        before = busy_before(m)
        p = np.clip((before(e) - before(s)) / dur, 0.0, 1.0)[:, None]
        nxt = dist * (1 - p)
        nxt[:, 1:] += dist[:, :-1] * p
        dist = nxt
    acc = np.zeros((len(names), dist.shape[1]))
    np.add.at(acc, of, dist * dur[:, None])
    time = np.zeros(len(names))
    np.add.at(time, of, dur)
    return {name: {j: float(acc[i, j] / time[i]) for j in range(1, dist.shape[1])
                   if acc[i, j] > 0}
            for i, name in enumerate(names)}


def reprice(graph, shares, node, damp=False):
    """Each priced compute op of ``graph`` at its node factor over its
    shares of the time in which j ranks of its node compute at once
    (``shares``; an op not in them: j = 1, alone): the op runs at
    1 / ``node.by_busy[j]`` of its speed alone in each, so its time is its
    time alone over the time-weighted mean of those speeds (the harmonic
    mean of the factors: a rank computing beside one that stops half-way
    computes at full speed for the rest, as processor sharing). ``damp``:
    the mean of that time and the op's present one (a longer op overlaps
    less of its mates' work, which makes it shorter again: the rounds
    alternate about the answer, damped they approach it from one side)."""
    for name, (seconds, cls, added) in graph.priced.items():
        dist = shares.get(name, {1: 1.0})
        speed = sum(w / node.by_busy[min(j, node.ranks_on_node)][cls] for j, w in dist.items())
        new = seconds / speed + added
        op = graph.ops[name]
        op.seconds = (op.seconds + new) / 2 if damp else new


def contended(graphs, node, n, iterations, per=None):
    """The SimResult of ``graphs`` (RankGraphs of ``n`` ranks, priced with
    ``node``'s factors of c_N: ``model.Template.rank_graph``), each compute
    op priced by the ranks of its node computing while it runs where
    ``applies``; else simply simulated. ``per``: the ranks of one replica
    (``Scenario.per``: which simulated rank a rank not simulated computes
    as, ``node_mates``). The graphs' ops are priced again in place."""
    if not applies(graphs, node, n):
        return simulate(graphs, iterations)
    k = node.ranks_on_node
    for g in graphs:  # first without contention: each op as it ran alone
        reprice(g, {}, node)
    result = simulate(graphs, iterations)
    for i in range(ROUNDS):
        busy = {g.rank: busy_intervals(g, result.spans.get(g.rank, ())) for g in graphs}
        for g in graphs:
            mates, mirrors = node_mates(graphs, g.rank, k, n, per)
            intervals = [busy[m.rank] for m in mates] + [busy[r] for r in mirrors]
            reprice(g, busy_shares(g, result.spans.get(g.rank, ()), intervals), node,
                    damp=i > 0)
        result = simulate(graphs, iterations)
    return result
