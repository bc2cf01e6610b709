"""From a trace folder and a rank count N to the predicted iteration.

For each N the graph a rank would run is composed offline, as ``graph --np
N`` does (``graph.inspect.compose_for``), and turned into the simulator's
``RankGraph``: compute ops take their traced median durations, comm ops
their cost on the link model (``link.py``):

- data parallel (``mode: sync``): each bucket's Allreduce over the N
  replicas; one rank is simulated (the replicas are symmetric; so are a
  tensor group's shards but for shard 0's bias adds: rank 0);
- the prediction is the slowest simulated rank's (a synchronous iteration
  ends when its slowest rank does); the sharded scheme's replicas differ
  (a replica's shards give it its own update ops: ``replica_classes``),
  so one replica of each class is simulated beside replica 0, at most
  1 + sum over buckets of (2 k_b + 2) classes whatever N;
- a collective's bytes are counted at its wire dtype (``comm.ops.moved_bytes``,
  as bench counts them): ``parallel.grad_dtype: bf16`` halves a bucket's;
- sharded (``scheme: sharded``): each bucket's ReduceScatter and Allgather
  over their ``shards`` ranks (``Link.reduce_scatter``, ``Link.allgather``:
  (N-1)/N of the bucket each on a ring, against the allreduce's 2(N-1)/N),
  replica 0 and one replica of each other class simulated; their graphs
  are composed for every N (the shards' sizes and the updates on them
  follow N);
- pipeline / hybrid: every stage of one replica is simulated, its Send and
  Recv matched by tag (α + B/β each), a hybrid stage's buckets allreduced
  over the replicas;
- parameter servers (``mode: sync_ps``/``async``): one worker is simulated;
  a push of B bytes to a server shard shares that server's link with the
  other workers' pushes (α + W·B/β for W workers), and the pull waits for
  the push, the server's sum of the W gradients ((W-1)·B at the host's
  add rate, ``copy_cost``) and its update of that shard (its traced
  ``.update``), and shares the link alike (u + (W-1)·B·c + α + W·B/β);
  each server is its own link (transfers to two servers run at once:
  simulate.py); async is priced as sync_ps (the staleness that lets a
  worker run ahead is not modelled);
- scheme sharded: a bucket's ReduceScatter and the weights' Allgather,
  each (N-1)·α + (N-1)/N·B/β over the replicas (half a ring allreduce);
  with ``parallel.reduce_scatter: false`` the ReduceScatter (attr
  ``allreduce``) posts the bucket's allreduce and costs one;
- scheme sharded, stage 3 with windows: a ``WindowSync`` (one shared copy
  per node; or across hosts around the Gets) is a barrier, ⌈log2 N⌉·α; a
  ``GetShards`` (the gather across hosts) α_put + (N-1)/N·B/β_put, its
  Gets posted at once, no owner taking part;
- one-sided transfers (``parallel.transport``: Put/WaitWrite, Get) cost
  α_put + B/β_put (``Link.put``: the window's figures from ``predict
  --calibrate``), a Put matched with its WaitWrite by window region; the
  receiver posts nothing and spends no CPU on matching; a Release (a notify
  word) costs α_put, a WaitFree nothing.

What the traced iterations took beyond the simulation of the traced rank
count with its traced communication (``dispatch_overhead``; each
collective the least of the traced ranks' medians, ``Durations.
least_rank``: the last rank to post it waited least) is the
dispatcher's own cost per op, which each compute op takes (the busiest
thread's measured idle between two of its ops inside an iteration:
trace_reader.dispatch_gap), and a cost per iteration for the rest (the
trainer's loop; one op, ``ITERATION_OP``, first on the busiest lane):
M micro-batches pay the first for each of their M times as many ops, the
second once. Each comm op pays the cost per op too (``rank_graph``'s
``comm_overhead``): the thread that readies it posts, tests and completes
it between its compute ops, so its transfer starts that much later and
the rank's next compute op starts that much later (``SimOp.cpu``); the
fit counts it (a cost per op that would simulate the traced run past its
traced iteration is lowered until it meets it). Before, comm ops paid
none: a ZeRO rank running fewer or smaller ops than one rank came out
more than 100 % efficient.

Ranks sharing a node (node.py, ``--ranks-per-node``): where the link file
holds ``predict --calibrate``'s measurements of ranks sharing a host, a
compute op takes its traced time times its class's measured ratio at the
ranks on a node over the ratio at the trace's, the dispatcher's costs the
``dispatch`` ratio's, and each collective the measured wait beyond α; a
link without them changes nothing.

The simulated ranks' collectives are coupled (simulate.py): one starts on
every simulated rank of its communicator when the last of them has
reached it, so the slowest rank's phases make every rank wait.

Gradient clipping's norm (``clip.norm``, READS_SCALE_TYPES) keeps its name
at every rank count, but under ZeRO it reads the rank's shards: it takes
its traced time at the elements it reads over those it read in the traced
run (``traced_reads``: the traced rank count's graphs composed again).

An op on a gradient that the rank count renames (``w.grad.sum.clip`` on N
ranks, ``w.grad.clip`` on one: trace_reader.sum_alias) takes the traced
time of its other name; an op on a ZeRO shard of a gradient, named after
the shard's bounds that the rank count sets (``w.grad.shard[a:b].clip``),
its elements' share of the traced ops on the same gradient's shards, or of
the op on the whole gradient (``w.grad.clip``: trace_reader.Durations.
lookup). A compute op absent from the trace otherwise (a
row chunk of a split weight, a shard's update, a copy into a bucket) is
estimated: a chunk takes its
rows' share of the whole op, a shard's update its elements' share (an
update op's fixed cost per call, ``fixed_costs``, paid once, not shared:
``Durations.lookup``'s ``fixed``); a Copy
or a Sum (a micro-batch's gradient sum) its bytes written at the host's
measured add rate (``link.reduce_cost_per_byte``); other ops count as 0.
All of these are reported as ``untraced``.
"""
import copy
import time

from ...base.errors import UserError
from ...comm.ops import moved_bytes, posted_type, shard_range
from .concurrent import contended
from .simulate import RankGraph, SimOp, simulate
from .trace_reader import shard_rows_key, split_chunk, split_shard, sum_alias

#: the point-to-point comm ops: two-sided, and one-sided (comm/rma_ops.py,
#: comm/rma_pull.py: a Put matched with its WaitWrite by window region)
_POINT_TO_POINT = ("Send", "Recv", "Put", "WaitWrite", "Get", "Publish")

#: the collectives that move half an allreduce's bytes: op type -> Link method
_HALVES = {"ReduceScatter": "reduce_scatter", "Allgather": "allgather"}

#: the untraced compute ops priced at their bytes written times the host's
#: measured add rate (``copy_cost``: ``link.reduce_cost_per_byte``)
HOST_RATE_TYPES = ("Copy", "Sum")

#: the compute ops named alike at every rank count whose work follows the
#: rank count: gradient clipping's norm (``clip.norm``, graph/clip.py) reads
#: the rank's gradients, under ZeRO its shards (1/N of them)
READS_SCALE_TYPES = ("GradNormSq",)

#: simulated iterations per prediction (the first is a warm-up)
ITERATIONS = 6

#: the simulated op that stands for a rank's cost per iteration (``Template.
#: rank_graph``'s ``per_iteration``: what the traced iteration took beyond its
#: ops and the dispatcher's gaps between them), first on the busiest lane
ITERATION_OP = "(iteration)"


def scaled_reads(graph):
    """{op name: elements it reads} of ``graph``'s ops of READS_SCALE_TYPES."""
    return {name: sum(graph.blobs[b].size for b in op.inputs
                      if graph.blobs[b].shape is not None)
            for name, op in graph.ops.items() if op.op_type in READS_SCALE_TYPES}


def traced_graphs(job, durations):
    """{traced rank: its graph composed at the traced rank count}; {} where
    the job does not compose so (another scheme's ranks)."""
    from ..graph import compose_for
    n = len(durations.per_rank)
    try:
        return {r: compose_for(job, n, r) for r in durations.per_rank if r < n}
    except UserError:
        return {}


def traced_reads(job, durations, graphs=None):
    """{traced rank: ``scaled_reads`` of its graph at the traced rank count}
    (the work the traced times of those ops were for); {} where the job
    does not compose at that count as traced (another scheme's ranks).
    ``graphs``: ``traced_graphs``' where the caller has them."""
    graphs = traced_graphs(job, durations) if graphs is None else graphs
    return {r: scaled_reads(g) for r, g in graphs.items()}


def fixed_costs(durations, graphs):
    """{op type: its fixed seconds per call} of the update ops (kernel
    category ``update``: an update, a clipping, an unscale, whose work is
    its first input's elements), fitted from the traced ops of
    that type (``graphs``: ``traced_graphs``), each a point (elements of its
    first input, traced median): the intercept of the least-squares line
    through them, at least 0 and at most the least of their times; a type
    with fewer than two sizes or a falling line has none. A chunk or shard
    of an op priced by its share of a traced op pays it once, not its share
    (``Durations.lookup``'s ``fixed``): an update of 10 elements costs the
    call, not 10/32,768 of a 32,768-element update."""
    from ...ops.registry import get_kernel_class
    points = {}
    for r, g in graphs.items():
        traced = durations.per_rank.get(r, {})
        for name, op in g.ops.items():
            if name not in traced or not op.inputs or g.blobs[op.inputs[0]].shape is None \
                    or get_kernel_class(op.op_type, name).category != "update":
                continue
            points.setdefault(op.op_type, []).append((g.blobs[op.inputs[0]].size, traced[name]))
    out = {}
    for kind, pts in points.items():
        xs = [x for x, _ in pts]
        if len(set(xs)) < 2:
            continue
        mx, my = sum(xs) / len(pts), sum(t for _, t in pts) / len(pts)
        slope = sum((x - mx) * (t - my) for x, t in pts) / sum((x - mx) ** 2 for x in xs)
        if slope < 0:
            continue
        out[kind] = min(max(0.0, my - slope * mx), min(t for _, t in pts))
    return out


def trace_prices(job, durations, graphs=None):
    """(``traced_reads``, ``fixed_costs``) of a trace of ``job``: what
    ``Template.rank_graph`` prices clip.norm and a chunk's or shard's
    update by (``reads``, ``fixed``), for ``predict`` and ``plan --choose``
    alike (one rule: tools/choose.Predictor passes them too). ``graphs``:
    ``traced_graphs``' where the caller has them."""
    graphs = traced_graphs(job, durations) if graphs is None else graphs
    return traced_reads(job, durations, graphs), fixed_costs(durations, graphs)


def priced_by_trace(graph, name):
    """Whether ``Template.rank_graph``'s own rule prices op ``name`` of
    ``graph`` from its traced time (``Durations.lookup`` with ``fixed``,
    then ``reads``): an op of READS_SCALE_TYPES (its traced time at the
    elements it reads), an update-category op on a row chunk or ZeRO shard
    (its type's fixed cost once plus its elements' share). A Durations-like
    source that prices other ops by their work (``plan --choose``'s
    ``_Scaled``) leaves these to it: the same op is then priced by one rule
    in ``predict`` and in ``plan --choose``."""
    from ...ops.registry import get_kernel_class
    op = graph.ops[name]
    if op.op_type in READS_SCALE_TYPES:
        return True
    if split_shard(name) is None and split_chunk(name)[0] is None:
        return False
    return get_kernel_class(op.op_type, name).category == "update"


def compute_lanes(ops):
    """{lane: how many of the simulated ``ops`` (SimOp) compute on it}."""
    lanes = {}
    for op in ops:
        if op.kind == "compute":
            lanes[op.lane] = lanes.get(op.lane, 0) + 1
    return lanes


class Scenario:
    """The ranks to simulate at N ranks and what an iteration processes."""

    def __init__(self, job, n):
        from ..graph import _OfflineWorld
        from ...parallel.compose import defer_update_applies, layout_of
        from ...parallel.schemes import run_scheme_of
        self.n = n
        par = job.parallel
        lay = layout_of(job, _OfflineWorld(0, n))
        self.staged = lay.staged
        self.ps = n > 1 and not lay.staged and run_scheme_of(job, n).servers
        if self.ps:
            self.servers = par.ps_ranks
            self.workers = n - self.servers
            if self.workers < 1:
                raise UserError(f"{n} ranks leave no worker beside the {self.servers} "
                                "parameter server(s) (parallel.ps_ranks)")
            self.ranks, self.replicas, self.defer = [0], self.workers, False
        else:
            self.replicas = lay.replicas
            # one replica's ranks: a pipeline's stages (and their tensor
            # shards); else rank 0: a tensor group's shards run the same ops,
            # shard 0 adding the row-split layers' biases (tensor_split.
            # SHARD0_BIAS_ATTR), the others not: shard 0 is the slowest
            self.ranks = lay.replica_ranks(0) if lay.staged else [0]
            self.defer = defer_update_applies(job, lay.replicas, lay.staged)
        #: ranks in one replica: replica q's rank of replica 0's rank r is r + q * per
        self.per = 1 if self.ps else lay.stages * lay.tensor
        self.images = job.global_batch(self.replicas)
        self.key = ("dp",) if (not self.ps and not self.staged and n > 1) else (n,)

    def class_ranks(self, graphs, traced=()):
        """The ranks of the other replicas to simulate beside ``self.ranks``
        (whose composed graphs ``graphs`` gives: {rank: Graph}): one replica
        of each class (``replica_classes``), each with all its ranks.
        ``traced``: the ranks the trace holds, each priced by its own
        medians (``Durations.lookup``): a replica holding one is a class of
        its own, and a traced rank at a place ``self.ranks`` does not
        simulate (a tensor shard other than 0) is simulated alone."""
        if self.ps:  # the workers are alike; rank 0 stands for them
            return []
        traced = sorted(r for r in traced if 0 < r < self.n)
        reps = replica_classes(graphs, self.replicas, {r // self.per for r in traced})
        ranks = [r + q * self.per for q in reps for r in self.ranks]
        covered = set(self.ranks) | set(ranks)
        return ranks + [r for r in traced if r not in covered]


def replica_classes(graphs, replicas, traced=()):
    """The replicas other than 0 whose graphs may run other compute ops
    than replica 0's: one replica of each class. Replicas differ only where
    a ZeRO scheme shards a bucket over them (``parallel.scheme: sharded``;
    data parallelism, parameter-server workers and tensor or pipeline
    replicas run the same ops on every replica): replica q holds elements
    ``shard_range(n, R, q)`` of each bucket of n elements, and runs an
    update (and a clipping, an unscale) on each weight its range overlaps,
    sized to the overlap. A replica's class is, for each ReduceScatter of
    ``graphs`` (replica 0's ranks: a stage or tensor position's buckets),
    the weights its range overlaps and the overlaps' sizes: replicas of one
    class run the same ops on ranges of equal size, priced alike
    (``Durations.lookup``). Classes change only where a range meets a
    weight's bounds or the bucket's end, so there are at most
    1 + sum over buckets of (2 k_b + 2) classes (k_b weights in bucket b),
    min(R, that), plus one for each traced replica (``traced``: priced by
    its own medians): bounded by the model and the trace, not the rank
    count; finding them costs O(R * weights) arithmetic."""
    layouts = []
    for g in graphs.values():
        for op in g.ops.values():
            if op.op_type != "ReduceScatter" or int(op.attrs.get("shards") or 0) < 2:
                continue
            bucket = op.attrs.get("bucket")
            total = g.blobs[bucket].size if bucket in g.blobs else None
            spans, at = [], 0
            for name in op.inputs:
                blob = g.blobs[name]
                off = blob.offset if blob.alias_of == bucket else at
                spans.append((name, int(off or 0), blob.size))
                at = max(at, int(off or 0) + blob.size)
            layouts.append((total if total is not None else at, int(op.attrs["shards"]), spans))
    def signature(q):
        out = []
        for total, shards, spans in layouts:
            lo, hi = shard_range(total, shards, q) if q < shards else (0, 0)
            out.append(tuple((name, min(hi, off + size) - max(lo, off))
                             for name, off, size in spans
                             if min(hi, off + size) > max(lo, off)))
        return tuple(out)

    # a traced replica is priced by its own medians, the others by every
    # traced rank's (Durations.lookup): a class of its own each
    seen, reps = {(signature(0), 0)}, []
    for q in range(1, replicas if layouts else 1):
        sig = (signature(q), q if q in traced else None)
        if sig not in seen:
            seen.add(sig)
            reps.append(q)
    return sorted(set(reps) | {q for q in traced if 0 < q < replicas})


def _nbytes(graph, names):
    return sum(graph.blobs[b].nbytes for b in names if graph.blobs[b].shape is not None)


class Template:
    """A composed rank graph, its dependencies, priorities and deferred
    tail: what does not change with the link."""

    def __init__(self, job, scenario, rank, graph=None):
        """``graph``: the rank's composed graph (``compose_for``'s), when
        the caller has it already (``plan --choose``: the memory plan's);
        composed here otherwise. It is read, not changed."""
        from ..graph import compose_for
        from ...ops.catalog import make_kernel
        from ...runtime.scheduler import feeds_comm, ready_priority
        from ...runtime.tail import deferred_tail
        if graph is None:
            graph = compose_for(job, scenario.n, rank)
        self.graph, self.rank = graph, rank
        #: the traced rank whose medians price the ops (``Durations.lookup``):
        #: its own; at N = 1 each traced rank's in turn (``predict_one``)
        self.prices = rank
        self.kernels = {n: make_kernel(op) for n, op in graph.ops.items()}
        self.deps = graph.dependencies()
        order = graph.topo_order(self.deps)
        comm = {n for n, k in self.kernels.items() if k.category == "comm"}
        # the dispatcher's ready order (runtime/scheduler)
        self.priority = ready_priority([op.name for op in order], feeds_comm(graph, order, comm))
        self.comm = comm
        self.reads = scaled_reads(graph)
        self._gemm = None  # ``gemm``, found when first asked
        self.tail, self.cross = (deferred_tail(graph, self.kernels, self.deps)
                                 if scenario.defer else (frozenset(), {}))
        self.rows = {}
        for name, op in graph.ops.items():
            shard = split_shard(name)
            if shard is not None and shard[0] in graph.blobs:
                # an op on a gradient's shard: the whole gradient's elements
                self.rows[shard[0] + shard[3]] = graph.blobs[shard[0]].size
                continue
            base, _, b = split_chunk(name)
            if base is None:
                continue
            whole = _shard_param(graph, op)
            # a row chunk counts rows of the weight; a shard update
            # (sharded scheme) elements of it: its share of the whole update
            self.rows[base] = max(self.rows.get(base, 0),
                                  b if whole is None else graph.blobs[whole].size)

    @property
    def gemm(self):
        """The compute ops with FLOPs (matrix products): class ``gemm`` of
        the node correction (node.py), the others ``elementwise``."""
        if self._gemm is None:
            self._gemm = _flop_ops(self.graph, set(self.graph.ops) - self.comm)
        return self._gemm

    def rank_graph(self, durations, link, algorithm, scenario, copy_cost, no_comm=False,
                   overhead=0.0, traced_comm=False, per_iteration=0.0, comm_overhead=0.0,
                   reads=None, fixed=None, node=None):
        """(RankGraph, {op name: seconds} of the comm ops, [untraced op names]).
        ``overhead``: seconds added to every compute op (the dispatcher's own
        cost per op); ``per_iteration``: seconds the busiest lane spends once
        an iteration, before its ops (``ITERATION_OP``: the trainer's loop,
        ``dispatch_overhead``); ``traced_comm``: comm ops take their traced
        durations; ``comm_overhead``: the dispatcher's own cost per comm
        op (``overhead``, ``dispatch_overhead``'s fit): it delays the op's
        transfer and takes CPU from the rank's next compute op; ``reads``:
        ``traced_reads``, an op of READS_SCALE_TYPES then takes its traced
        time at the elements it reads here (the norm of a ZeRO rank's
        shards, half as many at twice the ranks); ``fixed``:
        ``fixed_costs``, a chunk or shard priced by its share of a traced op
        then pays its type's fixed cost once (``Durations.lookup``);
        ``node``: a ``node.NodeScale`` (ranks sharing a node): a compute
        op's time (not ``overhead``, which the caller scales) times its
        class's factor, a collective priced by the link plus the measured
        wait per collective, a traced one (``traced_comm``) plus the
        measured hand-off to its worker; None: none of these."""
        g = self.graph
        ops, comm_s, untraced, priced = {}, {}, [], {}
        for name, op in g.ops.items():
            deps = tuple(sorted(self.deps[name]))
            if name in self.comm:
                sim = self._comm_op(op, deps, durations, link, algorithm, scenario,
                                    copy_cost)
                # the least over the traced ranks: the time the last rank to
                # post it took (the others' also waited for that rank, which
                # the slowest simulated rank's compute stands for)
                traced = durations.least_rank(name) if traced_comm else None
                if traced is not None:
                    sim.seconds, sim.busy_seconds, sim.cpu = traced, None, 0.0
                if sim.kind == "collective" and op.attrs.get("group"):
                    sim.group = tuple(int(r) for r in op.attrs["group"])
                if node is not None and sim.kind == "collective":
                    # seen done and its worker woken that much later (node.py);
                    # a traced span holds all of it but the worker's wake-up
                    extra = node.wait if traced is None else node.handoff
                    sim.seconds += extra
                    if sim.busy_seconds is not None:
                        sim.busy_seconds += extra
                comm_s[name] = sim.seconds  # the transfer, as the link model gives it
                # the dispatcher's cost per op: the thread that readies a
                # comm op posts it (and tests and completes it) between its
                # compute ops, so the post waits for it and the rank's next
                # compute op pays it (the transfer's CPU, ``SimOp.cpu``)
                sim.seconds += comm_overhead
                sim.cpu += comm_overhead
                if sim.busy_seconds is not None:
                    sim.busy_seconds += comm_overhead
                if no_comm:
                    sim.seconds, sim.busy_seconds, sim.cpu = 0.0, None, 0.0
            else:
                rows = self.rows.get(shard_rows_key(name))
                seconds = durations.lookup(name, self.prices, rows, fixed[op.op_type]) \
                    if fixed and op.op_type in fixed else durations.lookup(name, self.prices, rows)
                alias = sum_alias(name) if seconds is None else None
                if alias:  # the op on the gradient, traced at another rank count
                    seconds = durations.lookup(alias, self.prices)
                if seconds is not None and name in self.reads and reads:
                    seconds *= self._reads_share(name, reads)
                if seconds is None:
                    untraced.append(name)
                    seconds = (_nbytes(g, op.outputs) * copy_cost
                               if op.op_type in HOST_RATE_TYPES else 0.0)
                cls = "gemm" if name in self.gemm else "elementwise"
                if node is not None:
                    priced[name] = (seconds, cls, overhead)
                    seconds *= node.factors[cls]
                sim = SimOp(name, seconds + overhead, deps, lane=str(op.thread))
            sim.priority = self.priority[name]
            ops[name] = sim
        if per_iteration > 0:
            lanes = compute_lanes(ops.values())
            if lanes:
                busiest = max(lanes, key=lambda k: (lanes[k], k))
                ops[ITERATION_OP] = SimOp(ITERATION_OP, per_iteration, (), lane=busiest,
                                          priority=(False, -1))
        return RankGraph(self.rank, ops, self.tail, self.cross, priced), comm_s, untraced

    def _reads_share(self, name, reads):
        """This graph's elements read by op ``name`` over the traced ones
        (``reads``: ``traced_reads``; the pricing rank's, else the median
        over the traced ranks that ran it); 1 where not known."""
        mine = reads.get(self.prices, {}).get(name)
        if not mine:
            known = sorted(r[name] for r in reads.values() if r.get(name))
            mine = known[len(known) // 2] if known else None
        return self.reads[name] / mine if mine else 1.0

    def _comm_op(self, op, deps, durations, link, algorithm, scenario, copy_cost=0.0):
        g = self.graph
        # a collective's bytes at its wire dtype (a bucket reduced in
        # bfloat16, parallel.grad_dtype: bf16, moves 2 bytes an element)
        if posted_type(op) in ("Allreduce", "WindowAllreduce"):
            # (a ReduceScatter with attr allreduce, parallel.reduce_scatter:
            # false, posts data parallelism's allreduce of its bucket)
            nbytes = moved_bytes(g, op)
            group = len(op.attrs.get("group") or ()) or int(op.attrs.get("shards") or 0) \
                or scenario.replicas
            return SimOp(op.name, link.allreduce(group, nbytes, algorithm), deps,
                         kind="collective", seq=int(op.attrs.get("seq", 0)), nbytes=nbytes,
                         busy_seconds=link.busy().allreduce(group, nbytes, algorithm),
                         cpu=link.collective_cpu(self._members(op, group, scenario), nbytes,
                                                 algorithm))
        if op.op_type in _HALVES:
            nbytes = moved_bytes(g, op)  # the whole bucket, as bench counts it
            group = int(op.attrs.get("shards") or scenario.replicas)
            cost = getattr(link, _HALVES[op.op_type])
            return SimOp(op.name, cost(group, nbytes, algorithm), deps, kind="collective",
                         seq=int(op.attrs.get("seq", 0)), nbytes=nbytes,
                         busy_seconds=getattr(link.busy(), _HALVES[op.op_type])(
                             group, nbytes, algorithm),
                         cpu=link.collective_cpu(self._members(op, group, scenario), nbytes,
                                                 algorithm, halves=1))
        if op.op_type == "WindowSync":
            # ZeRO stage 3's window barrier (one shared copy per node, or
            # the RMA windows across hosts): a barrier in the collectives' order
            group = scenario.replicas
            return SimOp(op.name, link.barrier(group), deps, kind="collective",
                         seq=int(op.attrs.get("seq", 0)), nbytes=0,
                         busy_seconds=link.busy().barrier(group))
        if op.op_type == "GetShards":
            # stage 3 across hosts: the other owners' shards read by Gets
            # posted at once; no owner takes part, so nothing to match
            nbytes = _nbytes(g, op.outputs)
            shards = int(op.attrs.get("shards") or scenario.replicas)
            # each Get from an owner on this rank's node: one copy (link.one_sided_cpu)
            owners = [int(r.rsplit("@", 1)[1]) for r in op.attrs.get("regions") or ()
                      if r.rsplit("@", 1)[-1].isdigit()]
            if len(owners) != shards:
                owners = self._members(op, shards, scenario)
            cpu = sum(link.one_sided_cpu("Get", self.rank, r, nbytes / shards)
                      for r in owners if r != self.rank)
            return SimOp(op.name, link.get_shards(shards, nbytes), deps, lane=str(op.thread),
                         nbytes=int((shards - 1) * nbytes // shards), cpu=cpu)
        if op.op_type in ("Release", "WaitFree"):
            # a notify word raised (α_put) and a wait for one: no data moves;
            # the wait for the consumer's release of the last iteration's
            # region is left out (the Put/WaitWrite pair orders the stages)
            seconds = link.put(0) if op.op_type == "Release" else 0.0
            return SimOp(op.name, seconds, deps, lane=str(op.thread))
        if op.op_type not in _POINT_TO_POINT:
            raise UserError(f"predict: no cost model for communication op {op.name} "
                            f"({op.op_type})")
        send = op.op_type in ("Send", "Put", "Publish")
        one_sided = op.op_type not in ("Send", "Recv")
        nbytes = _nbytes(g, op.inputs if send else op.outputs)
        # one-sided: the window's rates, no receive posted, no matching
        seconds = link.put(nbytes) if one_sided else link.p2p(nbytes)
        if scenario.ps:  # every worker pushes to and pulls from each server shard
            seconds = (link.put(scenario.workers * nbytes) if one_sided else
                       link.alpha + scenario.workers * nbytes / link.beta)
            if not send and op.name.endswith(".pull"):
                param = op.name[:-len(".pull")]
                push = f"{param}.push"
                if push in g.ops:
                    deps = tuple(sorted(set(deps) | {push}))
                seconds += durations.lookup(f"{param}.update", self.prices) or 0.0
                # the server's Sum of the W gradients before it (sync_ps:
                # param_server.build_server_graph): W - 1 adds of B bytes at
                # the host's measured add rate
                seconds += (scenario.workers - 1) * nbytes * copy_cost
        tag = op.attrs["region"] if one_sided else int(op.attrs.get("tag", 0))
        peer = int(op.attrs["peer"])
        # a send's copies where its peer shares this rank's node (none
        # across nodes: RDMA); one-sided, one copy (link.one_sided_cpu),
        # none where the blob is the region (one node: computed into the
        # consumer's region, read in place: comm/rma_ops.py's zero copy)
        if not one_sided:
            cpu = link.send_cpu(self.rank, peer, nbytes) if send else 0.0
        elif link.local_ranks is not None and _in_region(
                g, (op.inputs if send else op.outputs)[0], op.attrs.get("region")):
            cpu = 0.0
        else:
            cpu = link.one_sided_cpu(op.op_type, self.rank, peer, nbytes)
        return SimOp(op.name, seconds, deps, kind="send" if send else "recv",
                     peer=peer, tag=tag, nbytes=nbytes, cpu=cpu)

    def _members(self, op, group, scenario):
        """The ranks of ``op``'s collective of ``group`` ranks: its attr
        ``group``, else this rank's place in each of ``group`` replicas
        (replica q's rank of replica 0's rank r is r + q * per)."""
        given = op.attrs.get("group")
        if given and len(given) == group:
            return tuple(int(r) for r in given)
        per = max(1, int(getattr(scenario, "per", 1) or 1))
        first = self.rank % per
        return tuple(first + q * per for q in range(int(group)))


def _in_region(graph, blob, region):
    """Whether ``blob`` is window ``region``'s memory (its own or its
    storage root's ``attrs['window']``: parallel/one_sided.py and
    ps_windows.py place it there on one node), so a Put, Get or Publish of
    it copies nothing."""
    return region is not None and any(
        graph.blobs[b].attrs.get("window") == region
        for b in (blob, graph.storage_root(blob)))


def _flop_ops(graph, names):
    """The ops of ``names`` whose work is FLOPs (``work.op_work``)."""
    from .work import op_work, weight_blobs
    weights = weight_blobs(graph)
    return frozenset(n for n in names if op_work(graph, n, weights)[0] == "flops")


def _shard_param(graph, op):
    """The weight whose shard ``op`` updates (its first input a view of kind
    ``param_shard``, named ``<weight>.shard[a:b]``: parallel/sharding.py),
    or None."""
    from ...parallel.sharding import PARAM_SHARD_KIND
    if not op.inputs or graph.blobs[op.inputs[0]].kind != PARAM_SHARD_KIND:
        return None
    param = op.inputs[0].rsplit(".shard[", 1)[0]
    return param if param in graph.blobs else None


def _templates(job, scenario, cache, traced=()):
    """The rank graphs of ``scenario``, composed once per key: one data-
    parallel graph serves every N unless its collectives are cut by the
    rank count (ReduceScatter, Allgather: attr ``shards``), which is then
    composed for each N. ``scenario.ranks`` first, then those of
    ``Scenario.class_ranks`` (``traced``: the traced ranks)."""
    key = scenario.key
    if key == ("dp",) and cache.get("per_n"):
        key = (scenario.n,)
    if key not in cache:
        cache[key] = [Template(job, scenario, r) for r in scenario.ranks]
        if key == ("dp",) and any("shards" in op.attrs for t in cache[key]
                                  for name, op in t.graph.ops.items() if name in t.comm):
            cache["per_n"] = True
            cache[(scenario.n,)] = cache.pop(key)
            key = (scenario.n,)
    # the other replicas' classes (a ZeRO shard's extra updates, a traced
    # rank's own medians): the slowest rank ends the iteration
    base, extra = cache[key], []
    for r in scenario.class_ranks({t.rank: t.graph for t in cache[key]}, traced):
        if (key, r) not in cache:
            cache[key, r] = Template(job, scenario, r)
        extra.append(cache[key, r])
    return base + extra


def dispatch_overhead(job, durations, link, algorithm, copy_cost, cache, node=None):
    """(seconds per compute op, seconds per iteration): what the traced run
    spent beyond its ops' durations, the traced iteration less the simulated
    one at the traced rank count with the traced communication, split into
    the dispatcher's cost per op and a cost per iteration. The cost per op
    is the busiest thread's measured idle between two of its ops inside an
    iteration (``durations.gaps``: trace_reader.dispatch_gap), at most the
    whole remainder over that lane's ops; the rest of the remainder is per
    iteration (the trainer's loop between iterations, and on a loaded
    machine the ops' medians summing to less than the median iteration):
    M micro-batches run M times the ops, so they pay the first M times and
    the second once. Without measured gaps (a constructed trace, an older
    calibration file) the whole remainder is per op, spread over the ops of
    the busiest lane. (0, 0) when the trace has no iteration time or the
    simulation is not faster. ``node``: the ``node.NodeScale`` of the traced
    rank count (ranks sharing a node): each traced collective then also
    takes its measured ``handoff`` (the worker's wake-up after the test
    that saw it done, outside its traced span), which is not the cost of
    every op."""
    traced = [v for v in durations.iter_seconds.values() if v]
    if not traced:
        return 0.0, 0.0
    try:
        scenario = Scenario(job, len(durations.per_rank))
        templates = _templates(job, scenario, cache, durations.per_rank)
    except UserError:  # traced on ranks the scheme reads otherwise: no correction
        return 0.0, 0.0

    def period(overhead, per_iteration=0.0):
        # a comm op pays the cost per op as a compute op does (rank_graph's
        # comm_overhead): the traced gaps hold the posting of comm ops too
        graphs = [t.rank_graph(durations, link, algorithm, scenario, copy_cost,
                               overhead=overhead, traced_comm=True,
                               per_iteration=per_iteration, comm_overhead=overhead,
                               node=node)[0]
                  for t in templates]
        return simulate(graphs, ITERATIONS).period(), graphs

    target = sorted(traced)[len(traced) // 2]
    bare, graphs = period(0.0)
    lane = max(compute_lanes(graphs[0].ops.values()).values(), default=0)
    if not lane or target <= bare:
        return 0.0, 0.0
    # the comm ops' cost per op lands on the compute lanes too
    ops = lane + sum(1 for op in graphs[0].ops.values() if op.kind != "compute")
    overhead = (target - bare) / ops
    gaps = sorted(durations.gaps.values())
    if gaps:
        overhead = min(overhead, gaps[len(gaps) // 2])
        simulated, _ = period(overhead)
        for _ in range(3):  # past the traced iteration: the cost per op that meets it
            if simulated <= target * (1 + 1e-6):
                break
            overhead *= (target - bare) / (simulated - bare)
            simulated, _ = period(overhead)
        per_iteration = max(0.0, target - simulated)
        if per_iteration > 0:  # it need not lengthen the iteration by all of itself
            simulated, _ = period(overhead, per_iteration)
            per_iteration = max(0.0, per_iteration + target - simulated)
        return overhead, per_iteration
    for _ in range(2):  # the busiest lane need not be the whole critical path
        simulated, _ = period(overhead)
        overhead = max(0.0, overhead + (target - simulated) / ops)
    return overhead, 0.0


def predict_one(job, n, durations, link, algorithm, copy_cost, cache, overhead=0.0,
                per_iteration=0.0, comm_overhead=0.0, reads=None, fixed=None, node=None):
    """The prediction at ``n`` ranks: a dict of seconds and counts
    (``reads``: ``traced_reads``; ``fixed``: ``fixed_costs``; ``node``: the
    ``node.NodeScale`` at ``n``, which also scales the dispatcher's costs
    ``overhead``, ``per_iteration`` and ``comm_overhead`` by its
    ``dispatch`` factor; None: no correction)."""
    if node is not None:
        overhead, per_iteration, comm_overhead = node.dispatch(overhead, per_iteration,
                                                               comm_overhead)
    scenario = Scenario(job, n)
    templates = _templates(job, scenario, cache, durations.per_rank)
    built = [t.rank_graph(durations, link, algorithm, scenario, copy_cost, overhead=overhead,
                          per_iteration=per_iteration, comm_overhead=comm_overhead,
                          reads=reads, fixed=fixed, node=node)
             for t in templates]
    # ranks sharing a node: each op at the contention of the ranks computing
    # while it runs, where the trace ran alone on its node (concurrent.py)
    result = contended([b[0] for b in built], node, n, ITERATIONS, scenario.per)
    period = result.period()
    # the rank whose iterations end last (rank 0 where several tie): the
    # coupled collectives give every rank the same period, the slowest
    # rank's, and the slowest ends its iterations last
    ends = result.iteration_end
    slowest = max(sorted(ends), key=lambda r: ends[r][-1])
    bare = [t.rank_graph(durations, link, algorithm, scenario, copy_cost, no_comm=True,
                         overhead=overhead, per_iteration=per_iteration, reads=reads,
                         fixed=fixed, node=node)[0]
            for t in templates]
    compute = contended(bare, node, n, ITERATIONS, scenario.per).period()
    if n == 1:
        # the reference of the efficiency: at N > 1 each traced rank is
        # simulated with its own medians (class_ranks) and may be the
        # slowest, so one rank is too: the slowest of the traced ranks'
        # pricings of the one rank's graph (else a traced rank's slower
        # medians read as a scaling loss, on an infinitely fast link too)
        for r in sorted(durations.per_rank):
            if r == templates[0].prices:
                continue
            alt = copy.copy(templates[0])
            alt.prices = r
            g = alt.rank_graph(durations, link, algorithm, scenario, copy_cost,
                               overhead=overhead, per_iteration=per_iteration,
                               comm_overhead=comm_overhead, reads=reads, fixed=fixed,
                               node=node)[0]
            period = max(period, simulate([g], ITERATIONS).period())
            g = alt.rank_graph(durations, link, algorithm, scenario, copy_cost, no_comm=True,
                               overhead=overhead, per_iteration=per_iteration, reads=reads,
                               fixed=fixed, node=node)[0]
            compute = max(compute, simulate([g], ITERATIONS).period())
    graph0, comm0, _ = built[0]
    return {"np": n, "iter_s": period, "compute_s": compute, "comm_s": sum(comm0.values()),
            "exposed_comm_s": max(0.0, period - compute), "images": scenario.images,
            "replicas": scenario.replicas, "simulated_ranks": len(templates),
            "slowest_rank": slowest,
            "comm_ops": len(comm0),
            "comm_bytes": sum(graph0.ops[name].nbytes for name in comm0),
            "untraced": sorted({u for b in built for u in b[2]}),
            "compute_ops": len(graph0.ops) - len(comm0), "node": node}


def check_traces_match(job, one, durations=None):
    """A UserError when most compute ops of the job's graph on one rank
    (``one``: ``predict_one``'s row at N = 1) are not in the traces: the
    traces are another job's (a folder's trace.rank<R>.json beside another
    run's config.yaml), whose prediction would be the untraced ops' guesses
    (0 s for most) plus the traced iteration time spread as overhead. A
    trace of this job misses at most the ops the rank count adds or renames
    (a multi-rank run's clipping of the summed gradients), well under half.
    A trace of this job on a GPU with CUDA graphs (``cuda_graph: true``, the
    default) times each graph replay, not the ops in it (``durations.
    replayed``): refused naming that, with the setting to trace it eagerly
    (before, those ops read as missing: "not of job" for the job's own trace)."""
    total, missing = one.get("compute_ops", 0), one["untraced"]
    # a GPU run's trace with CUDA graphs times each replay, not the ops in
    # it (trace_reader.replayed_ops): the job's own trace, with no op times
    inside = sorted(set(missing) & getattr(durations, "replayed", set()))
    if inside:
        shown = ", ".join(inside[:5]) + (", ..." if len(inside) > 5 else "")
        raise UserError(f"predict: the traces time the CUDA graph replays of job {job.name!r}, "
                        f"not their ops: {len(inside)} of the {total} compute ops of its graph on "
                        f"one rank ran only inside a replayed graph ({shown}); trace the run "
                        "with eager dispatch (train --profile-iters A:B --set "
                        "cuda_graph=false --out FOLDER)")
    if total and 2 * len(missing) > total:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise UserError(f"predict: the traces are not of job {job.name!r}: {len(missing)} of "
                        f"the {total} compute ops of its graph on one rank are not in them "
                        f"({shown}); give the run folder the traces and its config.yaml "
                        "were written to together (train --profile-iters A:B --out FOLDER)")


def predict_table(job, durations, nps, link, algorithm="auto", ranks_per_node=None):
    """Predictions for each N of ``nps`` (and N = 1, the reference), as a
    dict: {"rows": [...], "one_rank": {...}, "seconds": wall time taken,
    "ranks_per_node": K}. ``ranks_per_node``: ranks sharing a node
    (``--ranks-per-node``; None: the link's calibration's, else 1); where
    ``link.node`` holds measurements of that (node.py), each N's compute
    and collectives are corrected by them; none otherwise."""
    from .link import reduce_cost_per_byte
    from .node import scales
    traced_n = len(durations.per_rank)
    ranks_per_node, scale = scales(link, traced_n, ranks_per_node)
    t0 = time.perf_counter()
    copy_cost = reduce_cost_per_byte()
    cache = {}
    overhead, per_iteration = dispatch_overhead(job, durations, link, algorithm, copy_cost,
                                                cache, scale(traced_n))
    comm_overhead = overhead  # every comm op pays the dispatcher's cost per op too
    reads, fixed = trace_prices(job, durations)
    one = predict_one(job, 1, durations, link, algorithm, copy_cost, cache, overhead,
                      per_iteration, comm_overhead, reads, fixed, scale(1))
    check_traces_match(job, one, durations)
    ips1 = one["images"] / one["iter_s"] if one["iter_s"] > 0 else None
    rows = []
    for n in nps:
        try:
            row = predict_one(job, n, durations, link, algorithm, copy_cost, cache, overhead,
                              per_iteration, comm_overhead, reads, fixed, scale(n))
        except UserError as exc:  # N does not fit the scheme (a pipeline's stages)
            rows.append({"np": n, "error": str(exc)})
            continue
        ips = row["images"] / row["iter_s"] if row["iter_s"] > 0 else None
        row["images_per_s"] = ips
        row["efficiency"] = (ips / (n * ips1)) if ips and ips1 else None
        rows.append(row)
    one["images_per_s"] = ips1
    return {"rows": rows, "one_rank": one, "overhead_s": overhead,
            "per_iteration_s": per_iteration, "ranks_per_node": ranks_per_node,
            "seconds": time.perf_counter() - t0}
