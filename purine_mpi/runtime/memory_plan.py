"""The memory plan: blobs whose lifetimes never meet share bytes of one
arena, planned once from the static graph before the first iteration, on
the host and on every GPU alike.

    plan = plan_memory(graph, keep=("loss",))        # the host's MemoryPlan
    gpu0 = plan_memory(graph, keep=("loss",), device=0)   # GPU 0's
    Workspace(graph, plan=plan, device_plans={0: gpu0})   # lays the blobs out
    format_plan(graph, plan)                         # ``graph --memory``

Which blobs are planned. The unit is a storage root with the blobs that
view it (its *group*), on one device (-1: the CPU). A root keeps memory of
its own for the whole run -- it is *persistent* -- when its value must
survive the iteration or is read from outside the graph:

- a blob of the group is a parameter, solver state, learning rate,
  iteration counter or gradient bucket (kinds ``param``, ``param_buffer``,
  ``state``, ``lr``, ``iter``, ``bucket``), a loss or a metric (the trainer
  reads them after the iteration), or is named in ``keep`` (what else the
  host reads: the loss watch, the test graph's outputs);
- nothing in the graph writes it (the host fills it, or it is read as
  initialised), or an op writes it with ``accumulate`` (the dispatcher
  zeroes those before the iteration, outside the schedule);
- an op reads bytes of it that no op among its ancestors writes (it reads
  the value of the previous iteration: weights, momenta and running
  statistics read before their ``@new`` update);
- an op of the deferred tail touches it (``runtime/tail.py``: with
  ``parallel.defer_update`` those run on into the next iteration), or an
  op whose kernel keeps state in its outputs (``keeps_outputs``) writes it.

Every other root is *transient*: it is written and read within one
iteration. Its lifetime runs from its first writer to its last reader in
the schedule; two transient roots may share bytes only if the graph orders
them -- every op touching one is an ancestor (through data, write-after-read
and control edges) of every op writing the other -- so no dispatcher, on
any number of threads, ever runs an op of one while an op of the other
reads or writes the bytes (the rule ``Workspace.scratch_for`` applies to
scratch). The iterations themselves run one after the other (the deferred
tail touches only persistent memory), so a transient value never needs to
outlive its iteration.

With ``order_ops`` (the trainer's plan) it may also make an order the
graph leaves open: a layer's weight gradient reads an activation that
nothing further down the data-gradient chain waits for, so that activation
could never share with the gradients below it. Where every op of one unit
not yet before the other's first writers precedes them in the schedule and
runs on their thread (compute ops of the planned device: no
communication, nothing of the deferred tail), the plan adds control edges from those ops to the writers.
Each edge goes forward in the schedule, so no cycle can form and the order
the dispatchers derive stays the same (the ops of one thread run one at a
time anyway); ``graph --memory`` counts them.

In place: an op whose kernel declares it (``in_place``, or for its attrs
``in_place_of``: ReLU, dropout and
their gradients, element-wise; the softmax loss's probabilities over the
logits and its gradient over the probabilities; the precision pass's
``Cast``, whose low-precision copy of a blob dead after it takes the
blob's bytes; a gradient's bits copy over a dy stored as bits; a
gradient sum with its bits copy over a term) writes
its output over its input's bytes when it is the last op to touch the
input (every other op touching it is its ancestor) and both are
transient roots of one size; ReLU's gradient reads the ReLU's output, so a
convolution's pre-activation dies at the ReLU.

Offsets are assigned by greedy interval colouring: the units (a root, with
the roots computed in place over it) in some order each take the lowest
aligned offset (``HOST_ALIGN`` bytes on the host, ``ARENA_ALIGN`` on a GPU)
where they overlap no unit already placed that
they may not share with (the lowest such offset, or the tightest gap);
three orders (largest first, first used first, longest lived first) times
the two placements are tried and the smallest arena kept (fewest edges,
then the first, on a tie; each given up once it must lose to the best so
far: ``_structured_best``). The units live
at once at the peak of the schedule (each aligned) are a lower bound no
placement goes below; where the best is above it, more orders, until one
reaches it (``_best_colouring``): the units live at the peak first,
longest lived first; "squeaky wheel" orders (the units that end above the
peak moved to the front, the rest kept) from the best; by breadth (the
most bytes live at a position of the unit's lifetime, most first:
TFLite's greedy by breadth) and squeaky orders from it; last a dynamic
first fit (at each step the unit that goes lowest, longest lived first:
Sekiyama et al.'s best fit, ``_dynamic_order``). A colouring
replaces the best only with fewer bytes, or as many with fewer control
edges, so no plan grows; where the six colourings reach the peak (the
transformers, NIN) nothing more is coloured. Which units may not share
is found once for all the colourings (``_interference``): lifetimes that
overlap in the schedule, an interval query, and of the others only the
neighbours in the schedule, tested on windows of their bit sets; so the
cost grows with the micro-batch copies, not their square. The results are
bit-identical to one buffer per blob: every kernel writes the whole of its
outputs before reading them, so a buffer's earlier contents never reach a
result (as between iterations, which reuse every buffer already).

On a GPU the same rule holds for the CUDA-stream dispatcher, eager or
replaying captured graphs: it keeps every edge of the graph on the device
(an op waits on the events of its predecessors on other streams, and a
stream runs its own work in order), so an op that is an ancestor of another
has finished on the device before the other starts -- the rule
``Workspace.scratch_for`` relies on for scratch. The iterations of one
device follow each other there too (each one's streams wait on the events
that end the last). The persistent roots of a device take the front of
its arena, one after the other, and the planned ones the rest
(``workspace.plan_device_memory``). With ``order_ops`` a device's plan may
add control edges between the compute ops of one of its streams, as the
host's does between those of one thread: a stream runs its work in order
anyway. ``memory_plan: false`` gives every root
its own bytes of the arena, on the host and the devices alike.
"""
import heapq
import random
from array import array
from itertools import repeat
from dataclasses import dataclass, field

import numpy as np

from ..base.shared_answers import SharedAnswers
from ..graph.core import PERSISTENT_KINDS  # noqa: F401  (blob kinds kept across iterations)
from ..graph.core import WORKING_SET_ATTR, ancestor_bits

#: byte alignment of the offsets in the host arena (a cache line, the widest SIMD load)
HOST_ALIGN = 64

def _colouring_weight(key, answer):
    """About the bytes a kept colouring holds with its key: each unit's
    two bit sets over the schedule (``touch``, ``before``: a schedule of n
    ops, n / 8 bytes each; the key keeps them after the plan's units go)
    and ~200 bytes of tuples, each offset ~100, each edge its bit set."""
    offsets, _, edges = answer
    units = sum(200 + (v[1][0].bit_length() + abs(v[1][1]).bit_length()) // 8 + 8 * len(v[2])
                for v in key[2])
    return units + 100 * len(offsets) + sum(100 + src.bit_length() // 8 for src, _, _ in edges)


#: the most bytes the colourings ``shared_colourings`` keeps hold together
#: (besides their count): the key of GPT-2 124M's host plan at 32
#: micro-batches holds ~46,000 units' bit sets over ~19,000 ops
SHARED_COLOURINGS_BYTES = 512 << 20
#: the best colourings ``shared_colourings`` keeps, by ``_colouring_key``
SHARED_COLOURINGS = SharedAnswers(32, SHARED_COLOURINGS_BYTES, _colouring_weight)


@dataclass
class MemoryPlan:
    """The layout of a graph's transient blobs of one device in one arena."""

    #: the device planned (-1: the host)
    device: int = -1
    #: the byte alignment of the offsets
    align: int = HOST_ALIGN
    #: bytes of the arena
    total_bytes: int = 0
    #: {storage root: byte offset in the arena}
    offsets: dict = field(default_factory=dict)
    #: {storage root: bytes}
    sizes: dict = field(default_factory=dict)
    #: {storage root: (first, last)}: positions of its first and last op in the schedule
    lifetimes: dict = field(default_factory=dict)
    #: {storage root: why it keeps its own memory}, the host roots not planned
    persistent: dict = field(default_factory=dict)
    #: {persistent root: bytes}
    persistent_sizes: dict = field(default_factory=dict)
    #: the schedule the positions refer to (op names)
    order: list = field(default_factory=list)
    #: {output root: (input root, op)}: an op writing its output over its
    #: input's bytes (in place)
    in_place: dict = field(default_factory=dict)
    #: control edges (op, later op) the plan added to order lifetimes apart
    edges: list = field(default_factory=list)

    @property
    def planned_bytes(self):
        """Bytes the planned blobs take: the arena."""
        return self.total_bytes

    @property
    def unplanned_bytes(self):
        """Bytes the same blobs would take with one buffer each."""
        return sum(self.sizes.values())

    @property
    def persistent_bytes(self):
        return sum(self.persistent_sizes.values())

    @property
    def title(self):
        """"memory plan", with ", GPU d" on a device: what reports call it."""
        return "memory plan" + ("" if self.device < 0 else f", GPU {self.device}")


def batch_blobs(graph):
    """The blobs the data readers fill. The trainer keeps them out of the
    plan, so the batch of the last iteration stays readable (they are small
    beside the activations)."""
    return [b for op in graph.ops.values() if op.op_type == "DataReader" for b in op.outputs]


def _aligned(nbytes, align=HOST_ALIGN):
    return -(-max(int(nbytes), 1) // align) * align


def _root_nbytes(blob):
    count = max(blob.size, 1) if blob.shape else 1
    return count * np.dtype(blob.dtype).itemsize


def _tail_ops(graph, deps):
    """The ops ``deferred_tail`` may run on into the next iteration (the
    classes' ``category`` and ``seq_ordered`` are what it reads); none
    where ``graph.deferrable`` is False (tensor parallelism never defers)."""
    if not graph.deferrable:
        return frozenset()
    from ..ops.catalog import get_kernel_class
    from .tail import deferred_tail
    classes = {n: get_kernel_class(op.op_type, n) for n, op in graph.ops.items()}
    return deferred_tail(graph, classes, deps)[0]


def plan_memory(graph, keep=(), skip=(), order_ops=False, device=-1):
    """The :class:`MemoryPlan` of ``graph``'s blobs on ``device`` (-1: the
    host; see the module docstring). ``keep``: blob names the host reads
    besides the graph's losses and metrics (their roots persist); ``skip``:
    blobs owned elsewhere (a workspace's ``shared`` arrays), neither planned
    nor kept. ``order_ops``: the plan may add control edges between compute
    ops of one thread of ``device`` (a CUDA stream on a GPU), each from an
    op to one later in the schedule, to order two blobs' lifetimes apart
    (in place on ``graph``: the trainer's plan)."""
    from ..gpu.scratch import ARENA_ALIGN
    from ..ops.catalog import get_kernel_class
    device = int(device)
    deps = graph.dependencies()
    order = [op.name for op in graph.topo_order(deps)]
    pos, anc = ancestor_bits(order, deps)  # ancestors as bit sets over schedule positions
    prod, cons = graph.producers(), graph.consumers()
    root_of = graph.storage_roots()
    groups = {}
    for b in graph.blobs:
        groups.setdefault(root_of[b], []).append(b)
    keep = set(keep)
    skip = set(skip)
    tail = _tail_ops(graph, deps)
    plan = MemoryPlan(device=device, align=ARENA_ALIGN if device >= 0 else HOST_ALIGN,
                      order=order)
    cand = {}
    for root, names in groups.items():
        rb = graph.blobs[root]
        if rb.location.device != device or root in skip or rb.attrs.get("pinned") or \
                any(n in skip for n in names):
            continue
        if rb.shape is None:
            continue
        why = _persistent_reason(graph, names, keep, prod, cons, anc, pos, tail,
                                 get_kernel_class)
        if why is not None:
            plan.persistent[root] = why
            plan.persistent_sizes[root] = _root_nbytes(rb)
            continue
        touch = wmask = 0
        writers = []
        for n in names:
            for op in prod.get(n, ()):
                touch |= 1 << pos[op.name]
                wmask |= 1 << pos[op.name]
                writers.append(op.name)
            for op in cons.get(n, ()):
                touch |= 1 << pos[op.name]
        before_writers = -1  # all bits: AND over the writers' ancestors
        for w in writers:
            before_writers &= anc[w]
        first = min(pos[w] for w in writers)
        last = touch.bit_length() - 1
        cand[root] = (touch, before_writers, first, last, _root_nbytes(rb), wmask)
    units = _in_place_units(graph, cand, order, pos, anc, get_kernel_class, plan)
    link = None
    if order_ops:
        # ops that may get a control edge: compute ops, by (location, thread);
        # "waits": the point-to-point transfers (Send/Recv, window ops) each
        # one waits for, which the edge's target must
        # already wait for (``_colour``)
        from ..comm.ops import is_point_to_point
        link = {"key": {}, "mask": {}, "waits": {}}
        p2p = 0
        for n in order:
            if is_point_to_point(graph.ops[n]):
                p2p |= 1 << pos[n]
        for n in order:
            op = graph.ops[n]
            if get_kernel_class(op.op_type, n).category == "comm" or n in tail or \
                    op.location.device != device:
                continue
            k = (op.location, str(op.thread))
            link["key"][n] = k
            link["mask"][k] = link["mask"].get(k, 0) | (1 << pos[n])
            if anc[n] & p2p:
                link["waits"][pos[n]] = anc[n] & p2p
        for u, unit in units.items():
            keys = {link["key"].get(order[i]) for i in _bits(cand[unit[5][0]][5])}
            unit_keys = keys.pop() if len(keys) == 1 else None
            units[u] = unit + (unit_keys, cand[unit[5][0]][5])
    # within shared_colourings, the colouring of a plan of the same content
    offsets, plan.total_bytes, edges = SHARED_COLOURINGS.answer(
        lambda: _colouring_key(units, len(order), link, plan.align),
        lambda: _best_colouring(units, len(order), link, plan.align))
    for src, shift, dst in edges:
        for i in _bits(src):
            a = order[i + shift]
            for j in dst:
                w = graph.ops[order[j]]
                if a not in w.control_inputs:
                    w.control_inputs.append(a)
                    plan.edges.append((a, order[j]))
    for unit, members in ((u, units[u][5]) for u in units):
        for root in members:
            plan.offsets[root] = offsets[unit]
            plan.sizes[root] = cand[root][4]
            plan.lifetimes[root] = (cand[root][2], cand[root][3])
    return plan


def _best_colouring(units, n_ops, link, align):
    """The colouring of ``units`` the plan takes: of three orders, first
    fit and best fit each, the fewest bytes, then the fewest edges
    (``_colour``'s ({unit: offset}, total, edges)). Where the fewest bytes
    are more than the units live at once at their peak (``_live_peak``,
    each aligned: no colouring takes fewer), more orders, each kept only
    where it takes fewer bytes (or as many with fewer edges), until one
    reaches the peak:

    - the units live at the peak first, longest lived first, then the
      others so (a unit born after the peak, placed before a shorter one
      live at it, may take the bytes the peak's units would have packed
      into: GPT-2 at two micro-batches, the final layer norm's dx born as
      the logits die);
    - "squeaky wheel" orders: up to ``SQUEAKS`` times (stopping after
      ``SQUEAK_PATIENCE`` in a row that take no fewer bytes), from the best
      colouring so far and then from the last one tried, the units that
      end above the peak moved to the front of its order, the others'
      order kept (cifar10_quick on a GPU reaches its peak at the first);
    - by breadth (TFLite's "greedy by breadth"): the units by the most
      bytes live at any position of their lifetime, most first (those of
      the peak, then those of the next highest position, ...), each
      position's largest first (``_breadth``: benchmarks/
      cifar10_quick_wide.yaml, GoogLeNet at two micro-batches), then
      squeaky orders from it (gpt_tiny in bf16 on a GPU at two
      micro-batches, 723,456 bytes above its peak with the orders before;
      cifar10_quick on the host);
    - the dynamic first fit (``_dynamic_order``): at each step the unit
      that goes lowest beside those placed, longest lived first, there
      (cifar10_quick at 2 and 4 micro-batches of 100, and on a GPU at 2 of
      50; GoogLeNet; NIN with ``recompute: full``), given up where it would
      not take fewer bytes or past its bound of searches.

    Where the six reach the peak already (most plans: the transformers,
    NIN) nothing more is coloured, so the plan and its time stay; and
    once one colouring reaches the peak with no edges, none after it is
    coloured: no colouring takes fewer bytes or edges, and a tie keeps the
    first (the plan is the one all six would pick). Where they add edges
    (a trainer's host plan with ``order_ops``: GPT-2 124M's at 32
    micro-batches, all six at its peak with 15,675 to 275,380 edges), each
    is given up once it must lose to the best so far (``_structured_best``)."""
    pairs = _interference(units, n_ops, link)
    peak, at = _live_peak(units, n_ops, align)
    best = last = None

    def longest(u):
        return units[u][2] - units[u][3], -units[u][4], u

    def colour(order):
        nonlocal best, last
        if best is not None and best[1] <= peak and not best[2]:
            return   # no colouring takes fewer bytes or edges: the first such stays best
        last = None
        for best_fit in (False, True):
            offsets, total, edges = _colour(units, order, pairs, best_fit, align)
            if last is None or (total, len(edges)) < (last[1], len(last[2])):
                last = (offsets, total, edges, order)
            if total <= peak and not edges:
                break    # as above: best fit could only tie, and a tie keeps the first
        if best is None or (last[1], len(last[2])) < (best[1], len(best[2])):
            best = last

    def squeak(start):
        nonlocal last
        last, stale = start, 0
        for _ in range(SQUEAKS):
            if best[1] <= peak or stale == SQUEAK_PATIENCE:
                return
            offsets, _, _, order = last
            high = [u for u in order if offsets[u] + _aligned(units[u][4], align) > peak]
            moved = set(high)
            was = best
            colour(high + [u for u in order if u not in moved])
            stale = 0 if best is not was else stale + 1

    structured = [sorted(units, key=key) for key in (
        lambda u: (-units[u][4], units[u][2], u),     # largest first
        lambda u: (units[u][2], -units[u][4], u),     # first used first
        longest)]                                     # longest first
    best = _structured_best(units, structured, pairs, align, peak)
    if best[1] > peak:   # the units live at the peak first
        colour(sorted(units, key=lambda u: (not units[u][2] <= at <= units[u][3],) + longest(u)))
    squeak(best)
    if best[1] > peak:   # by breadth
        wide = _breadth(units, n_ops, align)
        colour(sorted(units, key=lambda u: wide[u] + (-units[u][4], units[u][2], u)))
        squeak(last)
    if best[1] > peak:   # dynamic: at each step the unit that goes lowest, longest lived first
        order = _dynamic_order(units, pairs, align, longest, best[1])
        if order is not None:
            colour(order)
    if best[1] > peak and len(units) <= SHUFFLED_UNITS:   # seeded shuffles: few units
        rng, order = random.Random(0), sorted(units)
        for _ in range(min(SHUFFLES, SHUFFLED_PLACEMENTS // max(len(units), 1))):
            if best[1] <= peak:
                break
            rng.shuffle(order)
            colour(list(order))
    return best[:3]


def _structured_best(units, orders, pairs, align, peak):
    """Of ``orders``' colourings, each by first fit then best fit (the
    sequence s = 0 .. 5), the one of the fewest bytes, then the fewest
    edges, then the first in that sequence: (offsets, total, edges, order).
    They are coloured in ``STRUCTURED_TRIES``' order, each given the best
    so far as its bound (``_colour``'s ``stop``): one that must lose (more
    bytes than it; at the live peak, as many edges and later in the
    sequence, or more edges) is given up as soon as its bytes or edges
    pass the bound, and where the best is at the peak with no edges none
    later in the sequence is coloured (a tie keeps the first). The answer
    is that of colouring all six in the sequence (tests/
    test_colouring_bound.py pins it against that): GPT-2 124M's host plan
    at 32 micro-batches, all six at its peak with 15,675 to 275,380 edges,
    gives up the five after the first part way (3.3 s to 2.3 s)."""
    best = seq = None
    for o in STRUCTURED_TRIES:
        for best_fit in (False, True):
            s = 2 * o + best_fit
            stop = None
            if best is not None:
                total, n_edges = best[1], len(best[2])
                if total <= peak:   # no colouring takes fewer bytes
                    if not n_edges and s > seq:
                        continue
                    stop = (total, n_edges - (s > seq))
                else:
                    stop = (total, None)
            got = _colour(units, orders[o], pairs, best_fit, align, stop=stop)
            if got is not None and (best is None or (got[1], len(got[2]), s) <
                                    (best[1], len(best[2]), seq)):
                best, seq = (*got, orders[o]), s
    return best


#: the order ``_structured_best`` colours the three structured orders in
#: (largest first, first used first, longest first): the first used
#: first's colourings first, the fewest edges at the live peak on the
#: transformers' host plans, so the bound they set gives up the largest
#: first's early (GPT-2 124M at 32 micro-batches: 275,380 edges by first fit)
STRUCTURED_TRIES = (1, 2, 0)


#: the most "squeaky wheel" orders ``_best_colouring`` colours in a row above the
#: live peak, and how many of them in a row may leave the best as it was
SQUEAKS = 8
SQUEAK_PATIENCE = 3

#: a plan of at most ``SHUFFLED_UNITS`` units still above its live peak
#: after the orders above tries up to ``SHUFFLES`` orders shuffled by a
#: seeded generator (deterministic: the same plan on every rank and run),
#: each kept only where it takes fewer bytes, until one reaches the peak.
#: First fit in the right order reaches the optimum (place the units of an
#: optimal packing by offset: none lands higher), and on few units a few
#: random orders find one the structured orders miss: digits_lenet's host
#: plan, 18,432 bytes above its peak of 396,096 after all of them, reaches
#: it at the 40th shuffle (a MILP of its 21 units confirms the peak is
#: feasible). At most ``SHUFFLED_PLACEMENTS`` units placed in all (each
#: order coloured by first and best fit: ~0.4 s where no shuffle reaches
#: the peak, cifar10_quick_wide's 31 units under ZeRO-3)
SHUFFLED_UNITS = 256
SHUFFLES = 200
SHUFFLED_PLACEMENTS = 6400

#: ``_dynamic_order`` gives up after this many offset searches per unit (on
#: the jobs it ends after 5 to 70; one search costs about what placing the
#: unit costs in ``_colour``, so the bound is about the time of this many
#: colourings)
DYNAMIC_SEARCHES = 128


def _dynamic_order(units, pairs, align, tie, limit=None):
    """The order of a dynamic first fit (Sekiyama et al., "Profile-guided
    memory optimization for deep neural networks", 2018: the best fit that
    places whichever block goes lowest): at each step, of the units not yet
    placed, the one whose lowest offset beside those placed (``_fit``, the
    units it may share no byte with: ``_hard``) is the lowest, ties by
    ``tie`` (a key of the unit), placed there. ``_colour`` with first fit
    places the units of this order where it did (each at its lowest
    offset), and adds the control edges. A unit's lowest offset only grows
    as units are placed, so a heap keeps each unit's last one found and
    searches again only the unit at its top (lazily): it is placed where its
    offset is still the one found. None after ``DYNAMIC_SEARCHES`` searches
    per unit (planning time stays bounded; deterministic: no clock), or
    as soon as a unit ends above ``limit`` bytes (the best arena so far:
    this order would not take fewer)."""
    names = list(pairs.index)
    n = len(names)
    size = np.array([_aligned(units[u][4], align) for u in names], dtype=np.int64)
    hard = _hard_sets(pairs)
    placed = np.zeros(n, dtype=bool)
    off_of = np.zeros(n, dtype=np.int64)
    end_of = np.zeros(n, dtype=np.int64)
    heap = [(0, tie(u), i) for i, u in enumerate(names)]
    heapq.heapify(heap)
    order = []
    for _ in range(DYNAMIC_SEARCHES * n):
        if not heap:
            return order
        found, key, i = heap[0]
        busy = hard[i][placed[hard[i]]]
        offset = _fit(off_of[busy], end_of[busy], size[i])
        if offset > found:
            heapq.heapreplace(heap, (offset, key, i))
            continue
        if limit is not None and offset + size[i] > limit:
            return None
        heapq.heappop(heap)
        placed[i], off_of[i], end_of[i] = True, offset, offset + size[i]
        order.append(names[i])
    return order if not heap else None


def _breadth(units, n_ops, align):
    """{unit: (-bytes, position)}: the most bytes of ``units`` (each
    aligned) live at one position of the unit's lifetime and the first
    position where they are, by a sparse table of range maxima over the
    schedule (a query costs the same for any lifetime: the long lifetimes
    of M micro-batch copies cost no more)."""
    live = np.zeros(n_ops + 1, dtype=np.int64)
    for u in units.values():
        live[u[2]] += _aligned(u[4], align)
        live[u[3] + 1] -= _aligned(u[4], align)
    live = np.cumsum(live[:-1])
    # table[k][i]: the position of the maximum of live[i:i + 2**k], the first if several
    table = [np.arange(n_ops, dtype=np.int64)]
    k = 1
    while (1 << k) <= n_ops:
        prev, half = table[-1], 1 << (k - 1)
        a, b = prev[:n_ops - (1 << k) + 1], prev[half:half + n_ops - (1 << k) + 1]
        table.append(np.where(live[b] > live[a], b, a))
        k += 1
    names = list(units)
    first = np.array([units[u][2] for u in names], dtype=np.int64)
    last = np.array([units[u][3] for u in names], dtype=np.int64)
    out = {}
    for i, u in enumerate(names):
        level = int(last[i] - first[i] + 1).bit_length() - 1
        row = table[level]
        a, b = row[first[i]], row[last[i] - (1 << level) + 1]
        j = b if live[b] > live[a] else a
        out[u] = (-int(live[j]), int(j))
    return out


def _live_peak(units, n_ops, align):
    """(bytes, schedule position): the most bytes of ``units`` (each
    aligned) live at once, from each unit's first to its last op, and the
    first position where that falls; (0, 0) for none."""
    live = np.zeros(n_ops + 1, dtype=np.int64)
    for u in units.values():
        live[u[2]] += _aligned(u[4], align)
        live[u[3] + 1] -= _aligned(u[4], align)
    if not units:
        return 0, 0
    live = np.cumsum(live[:-1])
    at = int(np.argmax(live))
    return int(live[at]), at


def _colouring_key(units, n_ops, link, align):
    """Everything ``_interference`` and ``_colour`` read, as values: the
    units in their order (names, bit sets, positions, sizes, members), the
    schedule's length, the alignment and, with ``link``, each unit's thread
    (numbered by first appearance: two ranks' threads differ only in the
    rank of their location), the ops of each of those threads, its writers
    and the point-to-point waits. Equal keys give equal colourings: the
    answer of one plan is another's, its offsets by unit name and its edges
    by schedule position."""
    if link is None:
        return (n_ops, align, tuple((u, v[:5], tuple(v[5])) for u, v in units.items()))
    threads = {}
    for v in units.values():
        if v[6] is not None and v[6] not in threads:
            threads[v[6]] = len(threads)
    return (n_ops, align, tuple((u, v[:5], tuple(v[5]), threads.get(v[6]), v[7])
                                for u, v in units.items()),
            tuple(link["mask"][k] for k in threads), tuple(sorted(link["waits"].items())))


def shared_colourings():
    """Within it, a memory plan whose units, schedule and threads are
    those of a plan made before (``_colouring_key``: another rank's
    composition of the same net, the test graph of another setting) takes
    that plan's colouring, the last ``SHARED_COLOURINGS.size`` kept (``plan
    --choose``). Kept only while it is open, as ``shared_dependencies``."""
    return SHARED_COLOURINGS.opened()


def device_plans(graph, keep=(), skip=(), order_ops=False):
    """{GPU device: its :func:`plan_memory`} for every device ``graph``
    has blobs on (empty for a CPU graph)."""
    devices = sorted({b.location.device for b in graph.blobs.values() if b.location.device >= 0})
    return {d: plan_memory(graph, keep=keep, skip=skip, order_ops=order_ops, device=d)
            for d in devices}


def _bits(mask):
    """Positions of the set bits of ``mask``."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _windows(units, n_ops, link=None):
    """{unit: (z, last, lo, touch, before, thread)}: each unit's bit sets cut
    to the part of the schedule where the tests of ``_interference`` can
    find anything, so that a test costs the span of the units it compares,
    not the whole schedule (the bit sets of M micro-batch copies are M
    times as long).

    ``last`` is the unit's last op in the schedule, ``z`` the first position
    in the schedule that holds an op touching some unit and not an ancestor
    of all the unit's writers (ancestors come before an op in the schedule,
    so every unit-touching op before ``z`` is one; ``z`` is at most the
    unit's first writer). A unit p whose ``last`` is below u's ``z`` is
    therefore ordered before u (p's ops are all ancestors of u's writers).

    ``touch`` is the unit's ops from ``lo``, its first (bit i: position
    lo + i); ``before`` the ancestors of all its writers from ``z`` to its
    first writer (bit i: position z + i): the ops of p that are not
    ancestors of all u's writers are p's ops from ``z`` on less u's
    ``before`` (none below ``z`` is, every one from the first writer on
    is). ``thread`` (with ``link``): the positions of the ops of the
    unit's thread from ``z`` to its first writer, as ``before``; None
    where its writers run on more than one thread or cannot take edges."""
    full = (1 << n_ops) - 1
    touched = 0
    for unit in units.values():
        touched |= unit[0]
    out = {}
    for u, unit in units.items():
        touch, before, first = unit[0], unit[1], unit[2]
        y = (before & full) | (full & ~touched)
        z = (~y & (y + 1)).bit_length() - 1
        lo = (touch & -touch).bit_length() - 1
        width = (1 << (first - z)) - 1
        key = unit[6] if link is not None else None
        thread = None if key is None else (link["mask"][key] >> z) & width
        out[u] = (z, touch.bit_length() - 1, lo, touch >> lo, (before >> z) & width, thread)
    return out


def _not_before(touch, lo, z, before):
    """The ops of a unit (``touch`` from position ``lo``) that are not
    ancestors of all another unit's writers (its ``_windows`` ``z`` and
    ``before``), as a bit set from position ``z``."""
    t = touch << (lo - z) if lo >= z else touch >> (z - lo)
    return t & ~before


@dataclass
class _Pairs:
    """Which units may not share bytes (``_interference``), by index."""

    index: dict        # {unit: i}
    windows: list      # [_windows of unit i]
    first: object      # np.int64 arrays by i: the units' lifetimes
    last: object
    by_first: object   # by_first, first_sorted, last_by_first: the units
    first_sorted: object   # whose lifetimes are at most ``span`` long, by first op
    last_by_first: object
    span: int
    long: object       # the other units' indices
    ptr: object        # the pairs of disjoint lifetimes not ordered, CSR:
    other: object      # unit i's are other[ptr[i]:ptr[i + 1]], and
    soft: object       # soft[...]: control edges may order them
    writers: list      # [positions of unit i's writers]: where edges go
    hard: list = None  # [_hard(self, i)], made once for all colourings (``_hard_sets``)
    soft_of: list = None   # [unit i's soft pairs' indices]
    hard_lists: list = None   # [hard[i] as a list of ints where it has at most FIT_IN_PYTHON, else None]


def _interference(units, n_ops, link=None):
    """The pairs of units whose bytes may not meet, once for the six
    colourings. Two units whose lifetimes overlap in the schedule are
    never ordered (each has an op at or after the other's first writer,
    which no ancestor of that writer is) and control edges cannot order
    them either (the ops to move are not all before the writer): an
    interval-overlap query on the lifetimes. Of two units with disjoint
    lifetimes, p ending before u's first writer, the graph orders p before
    u when every op of p is an ancestor of all u's writers (tested on the
    ``_windows``: only the p ending at or after u's ``z`` need it); if not,
    with ``link`` (``order_ops``), control edges may: when those ops of p
    all run on u's thread. The cost: the pairs of neighbouring units, not
    of all units (M micro-batch copies run one after another: M times the
    pairs of one copy and its neighbours, not M squared)."""
    names = list(units)
    reach = _windows(units, n_ops, link)
    win = [reach[u] for u in names]
    first = np.array([units[u][2] for u in names], dtype=np.int64)
    last = np.array([w[1] for w in win], dtype=np.int64)
    length = last - first
    # short: up to the 95th percentile, which the lifetimes of one copy set
    span = int(np.percentile(length, 95)) if len(names) else 0
    short = np.flatnonzero(length <= span)
    by_first = short[np.argsort(first[short], kind="stable")]
    # the disjoint pairs: for each u, the p whose last op is in [z of u, first of u)
    by_last = np.argsort(last, kind="stable")
    last_sorted = last[by_last]
    z = np.array([w[0] for w in win], dtype=np.int64)
    lo_at = np.searchsorted(last_sorted, z, "left")
    hi_at = np.searchsorted(last_sorted, first, "left")
    pi, pj, ps = array("l"), array("l"), array("b")   # each pair once
    p2p = bool(link is not None and link["waits"])   # else _waits is 0 for any ops
    for i, w in enumerate(win):
        zi, _, _, _, before, thread = w
        if lo_at[i] >= hi_at[i]:
            continue
        outside = ~before    # _not_before inlined: ~2 million pairs at 32 micro-batches
        off_thread = None if thread is None else ~thread   # once per unit, not per pair
        found = len(pj)
        for j in by_last[lo_at[i]:hi_at[i]].tolist():
            wj = win[j]
            lj = wj[2]
            late = (wj[3] << (lj - zi) if lj >= zi else wj[3] >> (zi - lj)) & outside
            if late:
                pj.append(j)
                # control edges may order them when the late ops run on u's
                # thread and wait for no point-to-point transfer u's writers
                # do not already wait for (a Recv behind them may wait, on
                # another rank, for a Send behind the writers: a pipeline's
                # stage would wait for itself)
                ps.append(thread is not None and not late & off_thread and
                          not (p2p and _waits(link, late << zi) & ~units[names[i]][1]))
        pi.extend(repeat(i, len(pj) - found))
    mine = np.frombuffer(pi, dtype=np.int64) if pi else np.zeros(0, np.int64)
    theirs = np.frombuffer(pj, dtype=np.int64) if pj else np.zeros(0, np.int64)
    soft = np.frombuffer(ps, dtype=np.int8).astype(bool) if ps else np.zeros(0, bool)
    by_unit = np.argsort(np.concatenate((mine, theirs)), kind="stable")
    ptr = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum(np.bincount(np.concatenate((mine, theirs)), minlength=len(names)), out=ptr[1:])
    other = np.concatenate((theirs, mine))[by_unit]
    soft = np.concatenate((soft, soft))[by_unit]
    return _Pairs(index={u: i for i, u in enumerate(names)}, windows=win, first=first,
                  last=last, by_first=by_first, first_sorted=first[by_first],
                  last_by_first=last[by_first], span=span,
                  long=np.flatnonzero(length > span), ptr=ptr, other=other, soft=soft,
                  writers=[list(_bits(units[u][7])) if link is not None else [] for u in names])


def _colour(units, order, pairs, best_fit=False, align=HOST_ALIGN, stop=None):
    """Greedy interval colouring: each unit, in ``order``, at an aligned
    offset where it overlaps no unit placed before it that it may not share
    with (``pairs``, ``_interference``): the lowest such offset, or with
    ``best_fit`` the smallest free gap that holds it (the end, if none
    does). Two units may share when the graph orders one before the other,
    or -- with ``link`` (``order_ops``) -- when control edges can: the ops
    of one not yet before the other's first writers all precede them in
    the schedule, run on their thread and wait for no point-to-point
    transfer the writers do not already wait for (they get the edges when
    their bytes meet).
    Returns ({unit: offset}, total bytes, [(source ops, shift, target ops)]:
    the edges to add, from the ops of the bit set shifted by ``shift``
    positions to the target positions). ``stop``: (bytes, edges or None):
    None as soon as the total passes those bytes or the edges that many
    (the colouring would lose to one that has them: ``_structured_best``)."""
    most_bytes, most_edges = stop if stop is not None else (None, None)
    offsets, total, edges = {}, 0, []
    n = len(pairs.index)
    where = np.full(n, -1, dtype=np.int64)      # placement index, -1: not yet placed
    off_of = np.zeros(n, dtype=np.int64)
    end_of = np.zeros(n, dtype=np.int64)
    placed = [None] * n     # (offset, end) of each unit placed, for _fit_blocks
    win, first, last = pairs.windows, pairs.first, pairs.last
    hard, soft_of = _hard_sets(pairs), pairs.soft_of
    hard_lists = pairs.hard_lists
    for k, unit in enumerate(order):
        i = pairs.index[unit]
        size = _aligned(units[unit][4], align)
        f = first[i]
        busy = hard_lists[i]
        if busy is not None:   # _fit's Python walk, without the arrays
            offset = _fit_blocks([placed[j] for j in busy if placed[j] is not None], size,
                                 best_fit)
        else:
            busy = hard[i]
            busy = busy[where[busy] >= 0]
            offset = _fit(off_of[busy], end_of[busy], size, best_fit)
        other = soft_of[i]
        if len(other):   # most units have none: no arrays to make
            other = other[where[other] >= 0]
            meet = other[(off_of[other] < offset + size) & (offset < end_of[other])]
            meet = meet[np.argsort(where[meet], kind="stable")].tolist() if len(meet) else ()
        else:
            meet = ()
        for j in meet:
            (zi, _, lo, touch, before, _), (zj, _, lj, tj, bj, _) = win[i], win[j]
            if last[j] < f:  # j before i: j's ops into i's writers
                edges.append((_not_before(tj, lj, zi, before), zi, pairs.writers[i]))
            else:
                edges.append((_not_before(touch, lo, zj, bj), zj, pairs.writers[j]))
        where[i], off_of[i], end_of[i] = k, offset, offset + size
        placed[i] = (offset, offset + size)
        offsets[unit] = offset
        total = max(total, offset + size)
        if stop is not None and (total > most_bytes or
                                 (most_edges is not None and len(edges) > most_edges)):
            return None
    return offsets, total, edges


def _hard_sets(pairs):
    """``pairs.hard`` and ``pairs.soft_of``: each unit's ``_hard`` units and
    the units control edges may order apart from it (index arrays), made
    once for every colouring of the plan (the same arrays each would make)."""
    if pairs.hard is None:
        pairs.hard = [_hard(pairs, i) for i in range(len(pairs.index))]
        pairs.soft_of = [pairs.other[pairs.ptr[i]:pairs.ptr[i + 1]][
            pairs.soft[pairs.ptr[i]:pairs.ptr[i + 1]]] for i in range(len(pairs.index))]
        pairs.hard_lists = [h.tolist() if len(h) <= FIT_IN_PYTHON else None for h in pairs.hard]
    return pairs.hard


def _hard(pairs, i):
    """The units unit ``i`` may share no byte with however they are placed
    (index array, ``i`` itself among them): those whose lifetimes overlap
    its own (the short units by first op, then the long ones) and those the
    graph does not order apart from it and control edges cannot."""
    f, l_ = pairs.first[i], pairs.last[i]
    a = np.searchsorted(pairs.first_sorted, f - pairs.span, "left")
    b = np.searchsorted(pairs.first_sorted, l_, "right")
    near = pairs.by_first[a:b][pairs.last_by_first[a:b] >= f]
    other = pairs.other[pairs.ptr[i]:pairs.ptr[i + 1]]
    soft = pairs.soft[pairs.ptr[i]:pairs.ptr[i + 1]]
    busy = (near, other[~soft])
    if len(pairs.long):
        long = pairs.long
        busy += (long[(pairs.first[long] <= l_) & (pairs.last[long] >= f)],)
    return np.concatenate(busy)


def _fit(off, end, size, best_fit=False):
    """The offset a unit of ``size`` bytes takes beside blocks [off, end)
    (arrays): the lowest gap that holds it, or with ``best_fit`` the
    smallest (the lowest of those), else the end of the highest block."""
    n = len(off)
    if not n:
        return 0
    if len(off) <= FIT_IN_PYTHON:
        return _fit_blocks(list(zip(off.tolist(), end.tolist())), size, best_fit)
    s = np.lexsort((end, off))
    run = np.maximum.accumulate(end[s])
    at = np.empty(n, dtype=np.int64)   # the end of the blocks below each block
    at[0] = 0
    at[1:] = run[:-1]
    gaps = off[s] - at
    fits = np.flatnonzero(gaps >= size)
    if not len(fits):
        return int(run[-1])
    if best_fit:   # the smallest gap that holds it, the lowest of a tie
        return int(at[fits[np.argmin(gaps[fits])]])
    return int(at[fits[0]])


#: ``_fit`` on at most this many blocks walks them in Python (``_fit_blocks``):
#: the same offset, without NumPy's cost a call on a few tens of blocks (a
#: plan places each unit beside the few it overlaps, in up to hundreds of
#: orders)
FIT_IN_PYTHON = 64


def _fit_blocks(blocks, size, best_fit):
    """``_fit`` of a list of (offset, end): the blocks by offset then end,
    each gap the block's offset less the highest end before it (0 before
    the first); the first gap that holds ``size``, or with ``best_fit`` the
    first of the smallest such, else the highest end."""
    run, best, at = 0, None, None
    for o, e in sorted(blocks):
        gap = o - run
        if gap >= size:
            if not best_fit:
                return run
            if best is None or gap < best:
                best, at = gap, run
        if e > run:
            run = e
    return run if at is None else at


def _waits(link, ops):
    """The point-to-point transfers the ops of bit set ``ops`` wait for
    (bit set; 0 without any in the graph)."""
    waits = link["waits"]
    out = 0
    if waits:
        for i in _bits(ops):
            out |= waits.get(i, 0)
    return out


def _in_place_units(graph, cand, order, pos, anc, kernel_class, plan):
    """Planned roots grouped into units that take the same bytes: an op
    whose kernel may write output o over input i (``in_place``: the
    element-wise activations, dropout and their gradients) gets its output
    on its input's bytes when the input is a transient root (no views) of
    the same size that this op is the last to touch (every other op
    touching it is an ancestor of the op) and the output is a transient
    root written by this op alone. Returns {unit: (touch, before_writers,
    first, last, nbytes, [roots])}; records plan.in_place {output: (input,
    op)}."""
    units = {r: (c[0], c[1], c[2], c[3], c[4], [r]) for r, c in cand.items()}
    unit_of = {r: r for r in cand}
    viewed = {graph.blobs[b].alias_of for b in graph.blobs if graph.blobs[b].alias_of}
    prod = graph.producers()
    for name in order:
        op = graph.ops[name]
        pairs = _in_place_pairs(kernel_class(op.op_type, name), op)
        for i, o in pairs:
            if i >= len(op.inputs) or o >= len(op.outputs):
                continue
            x, y = op.inputs[i], op.outputs[o]
            if x not in cand or y not in cand or x in viewed or y in viewed or \
                    unit_of[y] != y or len(units[y][5]) != 1 or \
                    op.inputs.count(x) != 1 or x in op.outputs or \
                    [w.name for w in prod.get(y, ())] != [name] or \
                    cand[x][4] != cand[y][4]:
                continue
            u = unit_of[x]
            touch, before, first, last, nbytes, members = units[u]
            others = touch & ~(1 << pos[name])
            if others & ~anc[name]:
                continue  # x is read after this op, or by an op it does not wait for
            ty = cand[y][0]
            units[u] = (touch | ty, before, first, max(last, cand[y][3]), nbytes, members + [y])
            del units[y]
            unit_of[y] = u
            plan.in_place[y] = (x, name)
    return units


def _in_place_pairs(cls, op):
    """The (input, output) pairs kernel class ``cls`` may compute in place
    for graph op ``op`` (``in_place_of`` its attrs; a class without it:
    its ``in_place``)."""
    of = getattr(cls, "in_place_of", None)
    return of(op.attrs) if of is not None else getattr(cls, "in_place", ())


def _persistent_reason(graph, names, keep, prod, cons, anc, pos, tail, kernel_class):
    """Why the storage of ``names`` (one root's group) must keep its own
    memory, or None when it is transient."""
    blobs = [graph.blobs[n] for n in names]
    # a full bucket a ZeRO stage gathers (parallel/sharding.WORKING_SET_ATTR)
    # is transient though the weights are views of it by their own kind
    working = any(WORKING_SET_ATTR in b.attrs for b in blobs)
    for b in blobs:
        if b.kind in PERSISTENT_KINDS and not working:
            return f"kind {b.kind} ({b.name})"
        if "loss_weight" in b.attrs:
            return f"a loss ({b.name})"
        if b.attrs.get("metric"):
            return f"a metric ({b.name})"
        if b.name in keep:
            return f"read by the host ({b.name})"
    writers = [op for n in names for op in prod.get(n, ())]
    if not writers:
        return "no op writes it"
    for op in writers:
        if op.accumulate:
            return f"accumulated by {op.name}"
        if getattr(kernel_class(op.op_type, op.name), "keeps_outputs", False):
            return f"{op.name} keeps state in it"
    for n in names:
        for op in list(prod.get(n, ())) + list(cons.get(n, ())):
            if op.name in tail:
                return f"the deferred tail touches it ({op.name})"
    # every read must see bytes written earlier in the same iteration: the
    # writers among the reader's ancestors cover what it reads (a later
    # writer of the same bytes -- a micro-batch copy sharing the buffer --
    # does not matter; without an earlier one the value is last iteration's)
    spans = {n: (graph._abs_offset(n), graph.blobs[n].size) for n in names}
    writes = [(spans[m][0], spans[m][0] + spans[m][1], w) for m in names
              for w in prod.get(m, ())]
    for n in names:
        start, size = spans[n]
        for r in cons.get(n, ()):
            before = [(s, e, w) for s, e, w in writes if w.name != r.name
                      and (anc[r.name] >> pos[w.name]) & 1 and s < start + size and start < e]
            if not _covers(start, start + size, before):
                return f"{r.name} reads {n} before this iteration writes it"
    return None


def _covers(start, end, spans):
    at = start
    for s, e, _ in sorted(spans, key=lambda t: t[0]):
        if s > at:
            return False
        at = max(at, e)
        if at >= end:
            return True
    return at >= end


def check_plan(graph, plan):
    """The pairs of planned roots that share bytes though the graph does
    not order them (empty for a sound plan): the test's independent check,
    by plain ancestor sets rather than the planner's bit sets."""
    deps = graph.dependencies()
    ancestors = {}
    for op in graph.topo_order(deps):
        a = set()
        for p in deps[op.name]:
            a |= ancestors[p] | {p}
        ancestors[op.name] = a
    prod, cons = graph.producers(), graph.consumers()
    touch, writes = {}, {}
    for b in graph.blobs:
        r = graph.storage_root(b)
        if r in plan.offsets:
            touch.setdefault(r, set()).update(o.name for o in prod.get(b, ()))
            touch[r].update(o.name for o in cons.get(b, ()))
            writes.setdefault(r, set()).update(o.name for o in prod.get(b, ()))

    def before(a, b):  # every op of a precedes every writer of b
        return all(t in ancestors[w] for w in writes[b] for t in touch[a])

    def in_place(a, b):  # b computed over a by an op that is the last to touch a
        x, op = plan.in_place.get(b, (None, None))
        return x == a and writes[b] == {op} and \
            all(t == op or t in ancestors[op] for t in touch[a])

    bad = []
    roots = sorted(plan.offsets)
    for i, a in enumerate(roots):
        a0, a1 = plan.offsets[a], plan.offsets[a] + plan.sizes[a]
        for b in roots[i + 1:]:
            b0, b1 = plan.offsets[b], plan.offsets[b] + plan.sizes[b]
            if a0 < b1 and b0 < a1 and not (before(a, b) or before(b, a) or
                                            in_place(a, b) or in_place(b, a)):
                bad.append((a, b))
    return bad


def peak_live(graph, plan):
    """Where the plan's live bytes peak: (schedule position, op name,
    {"activations": bytes, "gradients": bytes}) of the planned roots live
    there (a root computed in place over another counts once; gradients:
    roots of kind ``grad``). The arena is at least the peak; the activations
    at the peak are what recompute (graph/recompute.py) shortens."""
    units = {}  # base root -> (first, last, bytes, kind of its first root)
    for r in plan.lifetimes:
        base = r
        while base in plan.in_place:
            base = plan.in_place[base][0]
        first, last = plan.lifetimes[r]
        f, l, size, kind = units.get(base, (first, last, plan.sizes[base],
                                            graph.blobs[base].kind))
        units[base] = (min(f, first), max(l, last), size, kind)
    events = {}
    for first, last, size, _ in units.values():
        events[first] = events.get(first, 0) + size
        events[last + 1] = events.get(last + 1, 0) - size
    live, best, at = 0, -1, 0
    for position in sorted(events):
        live += events[position]
        if live > best and position < len(plan.order):
            best, at = live, position
    split = {"activations": 0, "gradients": 0}
    for first, last, size, kind in units.values():
        if first <= at <= last:
            split["gradients" if kind == "grad" else "activations"] += size
    return at, plan.order[at] if plan.order else None, split


def format_plan(graph, plan):
    """Lines of ``graph --memory``: each planned root with its offset, size
    and lifetime (schedule positions of its first and last op), then the
    persistent roots and the totals."""
    from ..base.progress_bar import human_bytes
    lines = [f"{plan.title}: {len(plan.offsets)} transient blob(s) in a "
             f"{plan.total_bytes:,}-byte arena ({human_bytes(plan.total_bytes)}; one buffer "
             f"each: {plan.unplanned_bytes:,} bytes, {human_bytes(plan.unplanned_bytes)}); "
             f"{len(plan.persistent)} persistent blob(s), {plan.persistent_bytes:,} bytes; "
             f"{len(plan.in_place)} computed in place; {len(plan.edges)} control edge(s) "
             f"added"]
    if not plan.offsets and not plan.persistent:
        return lines
    width = max(len(r) for r in list(plan.offsets) + list(plan.persistent))
    order = plan.order
    lines.append(f"  {'blob':<{width}}  {'offset':>12}  {'bytes':>12}  lifetime (schedule "
                 f"positions: first writer .. last reader)")
    for root in sorted(plan.offsets, key=lambda r: (plan.offsets[r], plan.lifetimes[r])):
        first, last = plan.lifetimes[root]
        lines.append(f"  {root:<{width}}  {plan.offsets[root]:>12,}  {plan.sizes[root]:>12,}  "
                     f"{first}..{last} ({order[first]} .. {order[last]})")
    for root in sorted(plan.persistent):
        lines.append(f"  {root:<{width}}  {'own':>12}  {plan.persistent_sizes[root]:>12,}  "
                     f"persistent: {plan.persistent[root]}")
    return lines
