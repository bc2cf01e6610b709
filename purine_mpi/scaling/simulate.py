"""The event dispatcher's rule replayed in simulated time.

Each simulated rank has a graph of ``SimOp``s: compute ops on worker lanes
(one op at a time per lane, the ready op with the best ``priority`` first,
as ``runtime/dispatcher.py`` orders its per-thread heaps), collectives
posted strictly in ``seq`` order and run one after another on the rank's
link, and point-to-point ops posted as soon as they are ready: a Send and
the Recv it matches (same source, destination, tag and iteration) transfer
from when both are posted and the sender's outgoing and the receiver's
incoming side of the link are free. An op whose peer is not simulated (a
parameter server) takes its own ``seconds`` on this rank's side.

Iterations follow ``EventDispatcher.run``: iteration i+1 starts when i's
ops are done but for its deferred *tail* (``RankGraph.tail``), the tail of
i-1 is done and every collective of i is posted; a next-iteration op waits
for the tail ops that list it in ``RankGraph.cross`` (runtime/tail.py).
Without a tail an iteration starts when the last one has finished.

A transfer's CPU (``SimOp.cpu``: the wall time it takes from the compute on
a host without a free core) delays the next compute op to start on the
rank; a collective that starts while a lane computes takes
``busy_seconds`` (the link's rate while computing) when given.

What the model leaves out: the time to post an op and to test requests,
contention among ranks for a shared switch or bisection, stragglers (every
rank of a collective is assumed to post it when this one does: the
replicas are symmetric), and the topology of the network.

Layer: services (docs/DESIGN.md); may import the foundation, devices, data,
ops, graph, job, composition and dispatch layers below it, and its own.
"""
import heapq
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

KINDS = ("compute", "collective", "send", "recv")


@dataclass
class SimOp:
    """One op of one rank: its lane (worker thread; ignored for comm ops),
    duration, predecessors (names on the same rank) and, for comm ops, the
    kind, ``seq`` (collectives), ``peer`` and ``tag`` (point-to-point)."""

    name: str
    seconds: float
    deps: tuple = ()
    lane: str = "0"
    kind: str = "compute"
    seq: int = 0
    peer: int = None
    tag: int = None
    priority: tuple = (0,)
    nbytes: int = 0
    busy_seconds: float = None  # collectives: the duration when it starts while a lane computes
    cpu: float = 0.0            # comm ops: wall seconds the transfer takes from the compute


@dataclass
class RankGraph:
    rank: int
    ops: dict                       # name -> SimOp
    tail: frozenset = frozenset()   # deferred ops (parallel.defer_update)
    cross: dict = field(default_factory=dict)  # tail op -> next-iteration ops waiting

    def __post_init__(self):
        succ = defaultdict(list)
        for op in self.ops.values():
            if op.kind not in KINDS:
                raise ValueError(f"op {op.name}: unknown kind {op.kind!r}")
            for d in op.deps:
                succ[d].append(op.name)
        self.succ = {n: tuple(succ[n]) for n in self.ops}
        self.collectives = sorted((op for op in self.ops.values() if op.kind == "collective"),
                                  key=lambda op: (op.seq, op.name))
        self.head = [n for n in self.ops if n not in self.tail]


@dataclass
class SimResult:
    """Per rank: the finish time of every iteration, and the (start, end,
    iteration, op name, lane) of every op run."""

    iteration_end: dict    # rank -> [seconds]
    spans: dict            # rank -> [(start, end, iteration, name, lane)]

    def period(self, skip=1):
        """Steady-state seconds per iteration: the median gap between the
        ends of consecutive iterations (the slowest rank's), after ``skip``."""
        ends = [max(v[i] for v in self.iteration_end.values())
                for i in range(len(next(iter(self.iteration_end.values()))))]
        gaps = [b - a for a, b in zip(ends[skip:], ends[skip + 1:])] or [ends[-1]]
        return statistics.median(gaps)


class _Rank:
    def __init__(self, graph):
        self.g = graph
        self.left = {}        # (it, name) -> predecessors not done
        self.done = set()     # (it, name)
        self.started_it = -1
        self.lane_heap = defaultdict(list)
        self.lane_busy = {}
        self.coll_ready = set()   # (it, name) ready collectives
        self.coll_next = 0        # index into the global posting order
        self.coll_order = []      # [(it, name)], iterations as they start
        self.link_free = 0.0      # collectives run one after another
        self.out_free = 0.0
        self.in_free = 0.0
        self.head_left = {}
        self.tail_left = {}
        self.iteration_end = {}    # iteration -> when its last op finished
        self.debt = 0.0            # transfer CPU not yet taken from a compute op


def simulate(graphs, iterations=6):
    """Run ``iterations`` iterations of the RankGraphs at once; a SimResult."""
    ranks = {g.rank: _Rank(g) for g in graphs}
    events, counter = [], [0]
    spans = defaultdict(list)
    pending_p2p = {}      # (src, dst, tag, it) -> (rank, name, posted time)
    start_of = {}

    def push(t, kind, payload):
        counter[0] += 1
        heapq.heappush(events, (t, counter[0], kind, payload))

    def ready(r, it, name, t):
        rk = ranks[r]
        op = rk.g.ops[name]
        if op.kind == "compute":
            heapq.heappush(rk.lane_heap[op.lane], (op.priority, it, name))
        elif op.kind == "collective":
            rk.coll_ready.add((it, name))
            post_collectives(r, t)
        else:
            post_p2p(r, it, op, t)

    def post_collectives(r, t):
        rk = ranks[r]
        while rk.coll_next < len(rk.coll_order) and rk.coll_order[rk.coll_next] in rk.coll_ready:
            it, name = rk.coll_order[rk.coll_next]
            rk.coll_next += 1
            op = rk.g.ops[name]
            begin = max(t, rk.link_free)
            computing = any(end > begin for end in rk.lane_busy.values())
            seconds = op.busy_seconds if computing and op.busy_seconds is not None else op.seconds
            rk.link_free = begin + seconds
            rk.debt += op.cpu
            start_of[(r, it, name)] = begin
            push(rk.link_free, "done", (r, it, name))

    def post_p2p(r, it, op, t):
        rk = ranks[r]
        if op.peer not in ranks:  # the other side is not simulated: this side's time
            side = "out_free" if op.kind == "send" else "in_free"
            begin = max(t, getattr(rk, side))
            setattr(rk, side, begin + op.seconds)
            rk.debt += op.cpu
            start_of[(r, it, op.name)] = begin
            push(begin + op.seconds, "done", (r, it, op.name))
            return
        src, dst = (r, op.peer) if op.kind == "send" else (op.peer, r)
        key = (src, dst, op.tag, it)
        other = pending_p2p.pop(key, None)
        if other is None:
            pending_p2p[key] = (r, op.name, t)
            return
        o_rank, o_name, o_t = other
        send_name, recv_name = (op.name, o_name) if op.kind == "send" else (o_name, op.name)
        seconds = ranks[src].g.ops[send_name].seconds
        begin = max(t, o_t, ranks[src].out_free, ranks[dst].in_free)
        ranks[src].out_free = ranks[dst].in_free = begin + seconds
        for rr in (src, dst):
            ranks[rr].debt += ranks[rr].g.ops[send_name if rr == src else recv_name].cpu
        for rr, nn in ((src, send_name), (dst, recv_name)):
            start_of[(rr, it, nn)] = begin
            push(begin + seconds, "done", (rr, it, nn))

    def start_iteration(r, t):
        rk = ranks[r]
        it = rk.started_it + 1
        rk.started_it = it
        g = rk.g
        left = {n: len(op.deps) for n, op in g.ops.items()}
        for t_op in g.tail:  # the last iteration's tail ops still running
            if it > 0 and (it - 1, t_op) not in rk.done:
                for w in g.cross.get(t_op, ()):
                    left[w] += 1
        for n, k in left.items():
            rk.left[(it, n)] = k
        rk.head_left[it] = len(g.head)
        rk.tail_left[it] = len(g.tail)
        rk.coll_order.extend((it, op.name) for op in g.collectives)
        for n, k in left.items():
            if k == 0:
                ready(r, it, n, t)

    def run_returned(r):
        """EventDispatcher._run_done for the newest started iteration."""
        rk = ranks[r]
        it = rk.started_it
        posted = rk.coll_next >= len(rk.coll_order)
        carry = it > 0 and rk.tail_left[it - 1] > 0
        return rk.head_left[it] == 0 and not carry and posted

    def complete(r, it, name, t):
        rk = ranks[r]
        g = rk.g
        rk.done.add((it, name))
        op = g.ops[name]
        spans[r].append((start_of.pop((r, it, name)), t, it, name,
                         op.lane if op.kind == "compute" else op.kind))
        if name in g.tail:
            rk.tail_left[it] -= 1
            if it < rk.started_it:  # a tail op of the last iteration: release its waiters
                for w in g.cross.get(name, ()):
                    dec(r, it + 1, w, t)
        else:
            rk.head_left[it] -= 1
        for s in g.succ[name]:
            dec(r, it, s, t)
        if rk.head_left[it] == 0 and rk.tail_left[it] == 0:
            rk.iteration_end[it] = t

    def dec(r, it, name, t):
        rk = ranks[r]
        rk.left[(it, name)] -= 1
        if rk.left[(it, name)] == 0:
            ready(r, it, name, t)

    def dispatch(t):
        for r, rk in ranks.items():
            for lane, heap in rk.lane_heap.items():
                if heap and rk.lane_busy.get(lane, 0.0) <= t:
                    _, it, name = heapq.heappop(heap)
                    # the CPU the transfers posted so far took delays this op
                    rk.lane_busy[lane] = t + rk.g.ops[name].seconds + rk.debt
                    rk.debt = 0.0
                    start_of[(r, it, name)] = t
                    push(rk.lane_busy[lane], "done", (r, it, name))

    def advance(t):
        """Start the next iteration of every rank whose run returned, then
        fill the idle lanes; repeat until nothing changes at this time."""
        changed = True
        while changed:
            changed = False
            for r, rk in ranks.items():
                if rk.started_it + 1 < iterations and run_returned(r):
                    start_iteration(r, t)
                    changed = True
        dispatch(t)

    for r in ranks:
        start_iteration(r, 0.0)
    advance(0.0)
    while events:
        t = events[0][0]
        while events and events[0][0] == t:
            _, _, kind, (r, it, name) = heapq.heappop(events)
            complete(r, it, name, t)
        advance(t)
    for r, rk in ranks.items():
        if len(rk.iteration_end) < iterations:
            stuck = sorted(n for (i, n), k in rk.left.items() if k > 0)[:5]
            raise RuntimeError(f"simulation of rank {r} stalled in iteration "
                               f"{min(set(range(iterations)) - set(rk.iteration_end))}: {', '.join(stuck)} never ran "
                               "(a Send or Recv without its match, or a dependency cycle)")
    return SimResult({r: [rk.iteration_end[i] for i in range(iterations)]
                      for r, rk in ranks.items()}, dict(spans))
