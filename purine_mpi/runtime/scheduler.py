"""The scheduling core: the one rule every dispatcher and the scaling
simulator follow, written once.

``Schedule`` holds the rule's state and nothing else (no threads, no
clock, no MPI): the caller serialises its calls (a dispatcher under its
lock; the simulator is single-threaded).

- *Ready counts from the bi-graph*: a unit (an op, or a CUDA-graph segment)
  is ready once every unit it depends on has finished; ``start`` begins an
  iteration and ``complete`` marks a unit done, each returning the units
  that became ready.
- *Ready queues*: ready compute units wait in one heap per *lane* (a worker
  thread, a CUDA stream's host worker, a simulated lane), best ``priority``
  first: units that feed a communication op come first (a layer's weight
  gradient before its data gradient, so a bucket's allreduce is posted as
  early as possible), then topological position (``ready_priority``).
- *The deferred tail* (``runtime/tail.py``): with a tail, ``start`` begins
  the next iteration while the last one's tail ops still run (the *carry*);
  the next iteration's units that touch what a carried op touches wait for
  it (``cross``). At most two iterations are in flight.
- *Collectives in ``seq`` order* (``PostingOrder``): ordered comm ops are
  posted strictly in their build-time order, the same on every rank (MPI
  matches collectives by call order); point-to-point ops as soon as ready.

What runs a ready unit is the executor's (docs/DESIGN.md, "The scheduler
and its executors"): the dispatchers' worker threads, CUDA streams and
captured segments (``runtime/dispatcher.py``, ``streams_dispatcher.py``,
``cuda_graph.py``), the serial twin's calling thread (``runtime/executors.py``)
and the scaling predictor's virtual clock (``tools/scaling/simulate.py``).
"""
import collections
import heapq


def ready_priority(units, feeds_comm):
    """{unit: its rank among ready units} (smaller first): those in
    ``feeds_comm`` (whose outputs a comm op reads) first, then position in
    ``units`` (a topological order)."""
    return {n: (n not in feeds_comm, i) for i, n in enumerate(units)}


def feeds_comm(graph, units, comm):
    """The names of ``units`` (objects with ``name`` and ``outputs``) whose
    outputs a comm op of ``graph`` (names in ``comm``) reads."""
    consumers = graph.consumers()
    return {u.name for u in units for b in u.outputs
            if any(c.name in comm for c in consumers.get(b, ()))}


def twin_posting_order(order, deps, comm_order):
    """The serial twin's order of the comm ops (``executors.Inline``):
    ``comm_order`` (the posting order: ``seq``) wherever it is a
    topological order of the graph, and else each comm op moved up to the
    first comm op (in ``comm_order``) that waits for it, directly or not.
    ``seq`` is a topological order of a slice's Send/Recv and collectives
    (the twin then posts exactly in ``seq`` order: matched pairs and
    collectives never deadlock), but not of the one-sided protocol's ops,
    which pair across iterations (parallel/one_sided.py): a WaitFree, an
    iteration's first wait, has a ``seq`` after the Puts its region's writer
    feeds, a Release one before the collectives behind the updates that
    read its blob last. ``order``: the op names in a topological order of
    ``deps`` ({name: predecessor names}) in which the ordered comm ops
    (collectives) keep ``comm_order``, with the edges that chain them."""
    index = {c: i for i, c in enumerate(comm_order)}
    succ = collections.defaultdict(list)
    for n, d in deps.items():
        for p in d:
            succ[p].append(n)
    first = {}  # the first comm op, in comm_order, that n leads to (itself included)
    for n in reversed(order):
        first[n] = min([index.get(n, len(index))] + [first[s] for s in succ[n]])
    position = {n: i for i, n in enumerate(order)}
    return sorted(comm_order, key=lambda c: (first[c], position[c]))


def twin_order(graph, comm_order, ordered):
    """The serial twin's fixed order of ``graph``'s ops (names): a
    topological order in which the comm ops come in ``twin_posting_order``.
    ``comm_order``: the comm ops in posting order; ``ordered``: those of
    them posted strictly in that order (collectives, ``seq_ordered``)."""
    deps = {n: set(d) for n, d in graph.dependencies().items()}
    for before, after in zip(ordered, ordered[1:]):
        deps[after].add(before)
    chain = twin_posting_order([op.name for op in graph.topo_order(deps)], deps, comm_order)
    for before, after in zip(chain, chain[1:]):
        deps[after].add(before)
    return [op.name for op in graph.topo_order(deps)]


class Schedule:
    """Ready counts, ready queues and the deferred tail of one rank's units.

    ``units``: names in a topological order; ``deps``: {name: predecessor
    names}; ``lane``: {compute unit: its lane}; ``priority``: {unit: sort
    key}; ``comm``: the names of comm ops (they go to a ``PostingOrder``,
    not to a lane); ``tail``, ``cross``: as ``runtime/tail.deferred_tail``
    gives them (empty: an iteration ends with every unit done)."""

    def __init__(self, units, deps, lane, priority, comm=(), tail=frozenset(), cross=None):
        self.units = list(units)
        self.deps = deps
        self.ndeps = {n: len(d) for n, d in deps.items()}
        succ = collections.defaultdict(list)
        for n, d in deps.items():
            for p in d:
                succ[p].append(n)
        self.succ = {n: tuple(succ[n]) for n in self.units}
        self.sources = [n for n in self.units if self.ndeps[n] == 0]
        self.tail, self.cross = frozenset(tail), dict(cross or {})
        self.head_total = sum(1 for n in self.units if n not in self.tail)
        comm = set(comm)
        self.is_comm = {n: n in comm for n in self.units}
        self.lane, self.priority = lane, priority
        #: lane -> heap of (priority, iteration, name)
        self.ready = {t: [] for t in sorted({lane[n] for n in self.units if n not in comm})}
        self.iteration = self.carry_iteration = 0
        self.left = {}         # this iteration: predecessors not done
        self.left_prev = {}    # the carried ops' own successors' counts
        self.carry = set()     # the last iteration's tail ops still to finish
        self.tail_todo = set()  # this iteration's tail ops not finished yet
        self.head_left = 0     # this iteration's other units not finished yet

    # -------------------------------------------------------------- rule
    def start(self, iteration):
        """Begin ``iteration``: what is left of the last one's tail carries
        on, and this one's units that touch what it touches wait for it.
        Returns the units ready now."""
        self.carry = carry = set(self.tail_todo)
        self.left_prev = {n: self.left[n] for n in carry}
        self.carry_iteration, self.iteration = self.iteration, iteration
        left = dict(self.ndeps)
        for t in carry:
            for s in self.cross[t]:
                left[s] += 1
        self.left = left
        self.head_left = self.head_total
        self.tail_todo = set(self.tail)
        return [n for n in self.sources if left[n] == 0]

    def complete(self, name):
        """``name`` finished: (the units it made ready, whether a count the
        caller may wait on -- the head, the tail, the carry -- reached 0)."""
        ready = []
        if name in self.carry:  # the last iteration's deferred tail
            self.carry.discard(name)
            self._release(self.left_prev, self.succ[name], ready)
            self._release(self.left, self.cross[name], ready)  # this iteration's, waiting
            return ready, not self.carry
        if name in self.tail:
            self.tail_todo.discard(name)
            milestone = not self.tail_todo
        else:
            self.head_left -= 1
            milestone = self.head_left == 0
        self._release(self.left, self.succ[name], ready)
        return ready, milestone

    @staticmethod
    def _release(left, names, ready):
        for s in names:
            left[s] -= 1
            if left[s] == 0:
                ready.append(s)

    def label(self, name):
        """The iteration a running unit belongs to."""
        return self.carry_iteration if name in self.carry else self.iteration

    def head_done(self):
        """This iteration's units but its tail are done, and the last
        iteration's tail too (a dispatcher's ``run`` may return once its
        collectives are all posted as well)."""
        return self.head_left == 0 and not self.carry

    def tail_done(self):
        return not self.tail_todo

    def waiting(self):
        """The units still waiting for a predecessor."""
        return [n for n, k in list(self.left.items()) + list(self.left_prev.items()) if k > 0]

    # ------------------------------------------------------ ready queues
    def push(self, name):
        """Queue a ready compute unit on its lane; returns the lane."""
        lane = self.lane[name]
        heapq.heappush(self.ready[lane], (self.priority[name], self.label(name), name))
        return lane

    def pop(self, lane):
        """The lane's best ready unit, or None."""
        heap = self.ready[lane]
        return heapq.heappop(heap)[-1] if heap else None


class PostingOrder:
    """The order comm ops are posted in: *ordered* ops (collectives) strictly
    in ``order``, *unordered* ones (point-to-point: matched by peer and tag)
    as soon as they are ready. ``ready_at``: {name: when it became ready},
    ``next``: the index of the next ordered op to post."""

    def __init__(self, order, unordered=()):
        self.unordered = frozenset(unordered)
        self.order = []
        self.set_order(order)
        self.reset()

    def set_order(self, order):
        self.order = list(order)
        self.chain = [n for n in self.order if n not in self.unordered]

    def reset(self):
        """A new iteration: nothing ready, nothing posted."""
        self.next = 0
        self.ready_at = {}
        self.free = collections.deque()  # ready unordered ops not yet posted

    def mark_ready(self, name, when):
        self.ready_at[name] = when
        if name in self.unordered:
            self.free.append(name)

    def all_posted(self):
        return self.next == len(self.chain) and not self.free

    def postable(self):
        """A ready op waits to be posted (a cheap check)."""
        return bool(self.free) or (self.next < len(self.chain)
                                   and self.chain[self.next] in self.ready_at)

    def post_ready(self, post, is_open=None):
        """Post (``post(name)``, returning a count) what is ready and may go:
        unordered ops first, then the ordered ones up to the first that is
        not ready or whose gate (``is_open(name)``) is closed. An op leaves
        the ready set only once posted. Returns the sum of the counts."""
        done = 0
        for _ in range(len(self.free)):
            name = self.free[0]
            if is_open is None or is_open(name):
                done += post(name)
                self.free.popleft()
            else:
                self.free.rotate(-1)
        chain = self.chain
        while self.next < len(chain) and chain[self.next] in self.ready_at \
                and (is_open is None or is_open(chain[self.next])):
            done += post(chain[self.next])
            self.next += 1
        return done
