"""The dispatcher's scheduling core run in simulated time.

Each simulated rank is the real scheduling core (``runtime/scheduler``:
``Schedule``'s ready counts, per-lane ready queues and deferred tail,
``PostingOrder``'s collectives in ``seq`` order) over a *virtual clock*
executor (``VirtualClock``) that charges each op its duration instead of
running it: compute ops on worker lanes (one op at a time per lane, the
ready op with the best ``priority`` first, as the dispatcher's worker
threads take them), collectives posted strictly in ``seq`` order and run
one after another on the rank's link, each coupled across the simulated
ranks of its communicator (below), and point-to-point ops posted as
soon as they are ready: a Send and the Recv it matches (same source,
destination, tag and iteration) transfer from when both are posted and the
sender's outgoing and the receiver's incoming side of the link are free. An
op whose peer is not simulated (a parameter server) takes its own
``seconds`` on that peer's side of the link (its outgoing or incoming
side, one per peer: transfers to two servers run at once). So the predictor cannot drift from the
dispatcher's rule: it is the same code.

Iterations follow ``Dispatcher.run``: iteration i+1 starts when i's
ops are done but for its deferred *tail* (``RankGraph.tail``), the tail of
i-1 is done and every collective of i is posted; a next-iteration op waits
for the tail ops that list it in ``RankGraph.cross`` (runtime/tail.py).
Without a tail an iteration starts when the last one has finished.

A collective cannot finish on any rank before every rank of its
communicator has posted it. The simulated ranks that hold collectives of
one communicator (``SimOp.group``: the ranks of its attr ``group``; None:
the world) run them together: MPI matches a communicator's collectives by
call order, so a rank's k-th collective on it in an iteration is every
member's k-th; it reaches the rank's link when posted and the rank's last
collective is done, and starts on every member when the last member's has
reached it (the latest of those times), taking the slowest member's
transfer time: each member's ends at max over members of its post time +
the transfer time (``_Ranks.arrive``). So a rank that reaches a collective
early waits for the slower one, and the slower phases of different ranks
add up; before, each rank ran its collectives on its own clock, a lower
bound. Collectives of other communicators (a pipeline stage's replicas
apart from another stage's) do not wait for each other; the order of the
collectives stays the fixed, rank-independent ``seq`` order.

A transfer's CPU (``SimOp.cpu``: the wall time it takes from the compute on
a host without a free core, and the dispatcher's cost of posting, testing
and completing a comm op) delays the next compute op to start on the
rank; a collective that starts while a lane computes takes
``busy_seconds`` (the link's rate while computing) when given.

What the model leaves out: contention among ranks for a shared switch or
bisection, or for the cores of a shared host, stragglers among the ranks
not simulated (an unsimulated rank of a collective is taken to post it
when the simulated rank of its class does), and the topology of the
network.
"""
import heapq
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from ...runtime.scheduler import PostingOrder, Schedule

KINDS = ("compute", "collective", "send", "recv")


def group_key(op):
    """A collective's communicator: its ranks, sorted (None: the world)."""
    return None if op.group is None else tuple(sorted(op.group))


class SimulationStalled(RuntimeError):
    """A simulated rank never finished an iteration: its ops wait for each
    other across ranks (the composed graphs would stall when run)."""


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
    #: collectives: the world ranks of its communicator (attr ``group``), or
    #: None for every rank: the simulated ranks among them run it together
    group: tuple = None


@dataclass
class RankGraph:
    rank: int
    ops: dict                       # name -> SimOp
    tail: frozenset = frozenset()   # deferred ops (parallel.defer_update)
    cross: dict = field(default_factory=dict)  # tail op -> next-iteration ops waiting
    #: compute op -> (its priced seconds before a node's contention factor,
    #: the factor's class, the seconds added after it): where the rank
    #: shares a node (``model.Template.rank_graph``'s ``node``), for
    #: ``concurrent.contended`` to price the op again
    priced: dict = field(default_factory=dict)

    def __post_init__(self):
        for op in self.ops.values():
            if op.kind not in KINDS:
                raise ValueError(f"op {op.name}: unknown kind {op.kind!r}")
        #: the collectives in their posting order (``seq``)
        self.collectives = sorted((op for op in self.ops.values() if op.kind == "collective"),
                                  key=lambda op: (op.seq, op.name))


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


class VirtualClock:
    """The executor of one simulated rank: the scheduling core hands it the
    ready ops, and it charges each one its duration on a virtual clock
    (a lane, the link, or a matched Send/Recv pair) instead of running it.
    ``finish(t, rank, it, name)`` is called back with the time an op ends."""

    def __init__(self, graph, finish):
        self.g, self.finish = graph, finish
        ops = graph.ops
        comm = [n for n, op in ops.items() if op.kind != "compute"]
        self.schedule = Schedule(list(ops), {n: op.deps for n, op in ops.items()},
                                 {n: op.lane for n, op in ops.items()},
                                 {n: op.priority for n, op in ops.items()},
                                 comm, graph.tail, graph.cross)
        p2p = [n for n in comm if ops[n].kind != "collective"]
        self.posting = PostingOrder([op.name for op in graph.collectives] + p2p, p2p)
        self.started_it = -1
        self.lanes = []            # lanes in the order they first had a ready op
        self.lane_busy = {}        # lane -> when its op ends
        self.link_free = 0.0       # collectives run one after another
        self.link_queue = []       # posted collectives not started: (iteration, name, posted)
        self.link_held = False     # the head of link_queue waits for the other ranks
        self.arrivals = defaultdict(int)  # (iteration, communicator) -> collectives reached
        self.out_free = 0.0
        self.in_free = 0.0
        self.remote_free = {}      # ("out" | "in", unsimulated peer) -> when that side is free
        self.iteration_end = {}    # iteration -> when its last op finished
        self.debt = 0.0            # transfer CPU not yet taken from a compute op
        self.start_of = {}         # (iteration, name) -> when it started

    # ------------------------------------------------ the scheduling core
    def start_iteration(self, t, peers):
        self.started_it += 1
        self.posting.reset()
        self.route(self.schedule.start(self.started_it), t, peers)

    def run_returned(self):
        """``Dispatcher._run_done`` for the newest started iteration."""
        return self.schedule.head_done() and self.posting.all_posted()

    def complete(self, it, name, t, peers):
        """The op ``name`` of iteration ``it`` ended at ``t``: a span."""
        op = self.g.ops[name]
        span = (self.start_of.pop((it, name)), t, it, name,
                op.lane if op.kind == "compute" else op.kind)
        core = self.schedule
        carried = name in core.carry
        ready, milestone = core.complete(name)
        if (milestone if carried else core.head_left == 0 and core.tail_done()):
            self.iteration_end[it] = t
        self.route(ready, t, peers)
        return span

    def route(self, names, t, peers):
        """Ready ops: compute to its lane's queue, comm ops to the poster."""
        core = self.schedule
        for name in names:
            if not core.is_comm[name]:
                lane = core.push(name)
                if lane not in self.lane_busy:
                    self.lane_busy[lane] = 0.0
                    self.lanes.append(lane)
                continue
            self.posting.mark_ready(name, t)
            self.posting.post_ready(lambda n: self.post(n, t, peers))

    # --------------------------------------------------- the virtual clock
    def next_collective(self, peers):
        """The link is free for the next posted collective: it reaches the
        link when posted and the last one is done, and waits there for the
        other simulated ranks of its communicator."""
        if self.link_held or not self.link_queue:
            return
        it, name, posted = self.link_queue.pop(0)
        group = group_key(self.g.ops[name])
        # MPI matches a communicator's collectives by call order: the k-th
        # this rank posts on it in an iteration is every member's k-th
        k = self.arrivals[it, group]
        self.arrivals[it, group] += 1
        self.link_held = True
        peers.arrive((it, group, k), self.g.rank, name, max(posted, self.link_free))

    def run_collective(self, it, name, begin, seconds):
        """Start collective ``name`` at ``begin`` for ``seconds`` (the
        slowest member's transfer) on this rank."""
        op = self.g.ops[name]
        self.link_free = begin + seconds
        self.link_held = False
        self.debt += op.cpu
        self.charge(it, name, begin, seconds)

    def transfer_seconds(self, name, begin):
        """A collective's seconds on this rank when it starts at ``begin``:
        its ``busy_seconds`` while a lane computes."""
        op = self.g.ops[name]
        computing = any(end > begin for end in self.lane_busy.values())
        return op.busy_seconds if computing and op.busy_seconds is not None else op.seconds

    def charge(self, it, name, begin, seconds):
        self.start_of[(it, name)] = begin
        self.finish(begin + seconds, self.g.rank, it, name)

    def dispatch(self, t):
        """Each idle lane takes its best ready op."""
        for lane in self.lanes:
            if self.schedule.ready[lane] and self.lane_busy[lane] <= t:
                name = self.schedule.pop(lane)
                # the CPU the transfers posted so far took delays this op
                end = self.lane_busy[lane] = t + self.g.ops[name].seconds + self.debt
                self.debt = 0.0
                # the op ends at the very time its lane is free: t + (end - t)
                # can round below ``end`` (3% of ops with a debt), and then the
                # lane was still busy at the op's end, its next op waited for
                # an event that never came ("never ran": a pipeline under a
                # measured calibration)
                self.start_of[(self.schedule.label(name), name)] = t
                self.finish(end, self.g.rank, self.schedule.label(name), name)

    def post(self, name, t, peers):
        op, it = self.g.ops[name], self.schedule.label(name)
        if op.kind == "collective":
            # the rank's link takes its collectives one after another, in
            # posting order; one starts once every simulated rank of its
            # communicator has reached it (``_Ranks.arrive``)
            self.link_queue.append((it, name, t))
            self.next_collective(peers)
        elif op.peer not in peers.ranks:  # the other side is not simulated
            # (a parameter server): the transfer runs on that peer's link,
            # which the op's seconds price (shared with the other workers);
            # transfers to two servers run at once
            side = ("out" if op.kind == "send" else "in", op.peer)
            begin = max(t, self.remote_free.get(side, 0.0))
            self.remote_free[side] = begin + op.seconds
            self.debt += op.cpu
            self.charge(it, name, begin, op.seconds)
        else:
            peers.match(self.g.rank, it, op, t)
        return 0


class _Ranks:
    """The simulated ranks, the clock's pending events and the Send/Recv
    pairs waiting for their match."""

    def __init__(self, graphs):
        self.events, self.counter = [], 0
        self.ranks = {g.rank: VirtualClock(g, self.push) for g in graphs}
        self.pending_p2p = {}  # (src, dst, tag, it) -> (rank, name, posted time)
        # (iteration, communicator, k) -> {rank: (op name, when it reached the link)}
        self.pending_collectives = defaultdict(dict)
        #: communicator (``group_key``) -> the simulated ranks that post
        #: collectives on it: those whose graphs hold one
        self.communicators = defaultdict(list)
        for g in graphs:
            for key in sorted({group_key(op) for op in g.collectives}, key=str):
                self.communicators[key].append(g.rank)

    def members(self, group):
        """The simulated ranks of a communicator (``group_key``)."""
        return self.communicators.get(group, [])

    def arrive(self, key, rank, name, begin):
        """Rank ``rank`` reached collective ``key`` on its link at ``begin``.
        When every simulated member has, it starts on each at the latest of
        their times (no rank's collective completes before every rank has
        posted it) and takes the slowest member's transfer time: each
        ends at max over members of its post time + the transfer time."""
        waiting = self.pending_collectives[key]
        waiting[rank] = (name, begin)
        members = self.members(key[1])
        if any(m not in waiting for m in members):
            return
        del self.pending_collectives[key]
        start = max(b for _, b in waiting.values())
        seconds = max(self.ranks[m].transfer_seconds(waiting[m][0], start) for m in members)
        it = key[0]
        for m in members:
            self.ranks[m].run_collective(it, waiting[m][0], start, seconds)
        for m in members:
            self.ranks[m].next_collective(self)

    def push(self, t, rank, it, name):
        self.counter += 1
        heapq.heappush(self.events, (t, self.counter, "done", (rank, it, name)))

    def match(self, r, it, op, t):
        src, dst = (r, op.peer) if op.kind == "send" else (op.peer, r)
        key = (src, dst, op.tag, it)
        other = self.pending_p2p.pop(key, None)
        if other is None:
            self.pending_p2p[key] = (r, op.name, t)
            return
        ranks = self.ranks
        _, o_name, o_t = other
        send_name, recv_name = (op.name, o_name) if op.kind == "send" else (o_name, op.name)
        seconds = ranks[src].g.ops[send_name].seconds
        begin = max(t, o_t, ranks[src].out_free, ranks[dst].in_free)
        ranks[src].out_free = ranks[dst].in_free = begin + seconds
        for rr, nn in ((src, send_name), (dst, recv_name)):
            ranks[rr].debt += ranks[rr].g.ops[nn].cpu
        for rr, nn in ((src, send_name), (dst, recv_name)):
            ranks[rr].charge(it, nn, begin, seconds)


def simulate(graphs, iterations=6):
    """Run ``iterations`` iterations of the RankGraphs at once; a SimResult."""
    sim = _Ranks(graphs)
    ranks, events = sim.ranks, sim.events
    spans = defaultdict(list)

    def advance(t):
        """Start the next iteration of every rank whose run returned, then
        fill the idle lanes; repeat until nothing changes at this time."""
        changed = True
        while changed:
            changed = False
            for rk in ranks.values():
                if rk.started_it + 1 < iterations and rk.run_returned():
                    rk.start_iteration(t, sim)
                    changed = True
        for rk in ranks.values():
            rk.dispatch(t)

    for rk in ranks.values():
        rk.start_iteration(0.0, sim)
    advance(0.0)
    while events:
        t = events[0][0]
        if not math.isfinite(t):  # a NaN time never equals itself: the loop below would spin
            _, _, _, (r, it, name) = events[0]
            raise SimulationStalled(f"simulation of rank {r} reached time {t} at op {name!r} "
                                    f"in iteration {it} (an op or link figure not finite)")
        while events and events[0][0] == t:
            _, _, kind, (r, it, name) = heapq.heappop(events)
            spans[r].append(ranks[r].complete(it, name, t, sim))
        advance(t)
    for r, rk in ranks.items():
        if len(rk.iteration_end) < iterations:
            stuck = sorted(rk.schedule.waiting())[:5]
            first = min(set(range(iterations)) - set(rk.iteration_end))
            held = sorted(f"{w[r][0]} (waiting for rank(s) "
                          f"{', '.join(str(m) for m in sim.members(key[1]) if m not in w)})"
                          for key, w in sim.pending_collectives.items() if r in w)
            raise SimulationStalled(
                f"simulation of rank {r} stalled in iteration {first}: {', '.join(stuck)} "
                "never ran (a Send or Recv without its match, or a dependency cycle"
                + (f"; collective {', '.join(held[:3])} never posted by the other ranks of "
                   "its communicator" if held else "") + ")")
    return SimResult({r: [rk.iteration_end[i] for i in range(iterations)]
                      for r, rk in ranks.items()}, dict(spans))
