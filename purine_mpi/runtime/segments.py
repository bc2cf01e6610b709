"""Where a CUDA-graph iteration is cut: which GPU ops can be captured
(``capture_blocker``), the order the comm ops can be posted in
(``stage_order``), and the cut into segments, each captured as one graph
(``plan_segments``). Pure functions of the graph and the schedule, used by
``runtime/cuda_graph.GraphExecutor``; imports only the stream naming of
``runtime/cuda_runtime``.
"""
import dataclasses
import heapq
from collections import defaultdict
from dataclasses import dataclass, field

from .cuda_runtime import stream_thread_name

#: captures kept per segment (one per distinct set of arrays); then eager
MAX_CAPTURES = 4


@dataclass(eq=False)
class Segment:
    """A maximal run of capturable GPU ops: one scheduling unit, one graph."""

    name: str
    device: int
    members: list  # op names, in a topological order
    outputs: list  # blobs its ops write
    #: member -> members it depends on that run on another stream
    inner_waits: dict = field(default_factory=dict)
    #: member -> whether a member on another stream depends on it
    inner_event: dict = field(default_factory=dict)
    op_type: str = "CudaGraph"
    accumulate: bool = False
    #: signature of the arrays -> _Capture
    captures: dict = field(default_factory=dict)
    #: why it runs eagerly for good (a failed capture), or None
    failed: object = None
    #: the (k.ins, k.outs) lists of its kernels (their arrays: the signature)
    arg_lists: list = field(default_factory=list)

    @property
    def key(self):
        """The stream its graph is launched on."""
        return (self.device, self.name)

    @property
    def thread(self):
        """The host worker that launches it (and its trace row)."""
        return stream_thread_name(self.device, "graph")

    def describe(self):
        first, last = self.members[0], self.members[-1]
        span = f"'{first}'" if len(self.members) == 1 else f"'{first}' .. '{last}'"
        return f"{self.name} ({len(self.members)} ops, {span})"


@dataclass
class _Capture:
    graph: object
    pool: object  # the memory pool of its temporaries
    arrays: list  # the arrays it was captured on (kept alive: their ids key it)


def _as_held(blob, device_arrays):
    """``blob`` as the kernel holds it: on the host when device blobs are
    host arrays (``device_arrays`` False: a simulated device)."""
    if device_arrays or blob.location.device < 0:
        return blob
    return dataclasses.replace(blob, location=dataclasses.replace(blob.location, device=-1))


def capture_blocker(graph, op, kernel, device_arrays=True):
    """Why GPU op ``op`` (with kernel instance ``kernel``) cannot be
    captured into a CUDA graph, or None when it can. A kernel says
    ``capturable = True`` when its host state moves in ``before_iteration``
    (run every iteration, also with a replay), not in ``run``; its answer is
    ``kernel.capturable_on(input blobs, output blobs)`` (static: the same
    before set-up, in ``plan``, as in the executor; ``device_arrays``
    False, a simulated device holding device blobs in host arrays, hands
    it those blobs as host blobs)."""
    if op.accumulate:
        return "adds into a blob that other ops write too"
    if getattr(kernel, "rng", None) is not None:  # a generator kept on the host
        return "draws random numbers on the host"
    ask = getattr(kernel, "capturable_on", None)
    capturable = (ask([_as_held(graph.blobs[b], device_arrays) for b in op.inputs],
                      [_as_held(graph.blobs[b], device_arrays) for b in op.outputs])
                  if ask is not None else getattr(kernel, "capturable", None))
    if capturable is False:
        return getattr(kernel, "capture_note", None) or "its kernel cannot be captured"
    if getattr(kernel, "stateful", False) and capturable is not True:
        return "keeps host-side state that changes every run"

    def on_host(b):
        return graph.blobs[graph.storage_root(b)].location.device < 0

    host_in = [b for b in op.inputs if on_host(b)]
    host_out = [b for b in op.outputs if on_host(b)]
    if op.op_type == "Copy" and (host_in or host_out):   # device to device: a kernel
        if host_out:
            return "copies to host memory (the host reads it at once)"
        unpinned = [b for b in host_in
                    if not graph.blobs[graph.storage_root(b)].attrs.get("pinned")]
        if unpinned:
            return f"copies from pageable host memory ('{unpinned[0]}')"
        if any(graph.blobs[b].dtype != graph.blobs[o].dtype
               for b, o in zip(op.inputs, op.outputs)):
            return "converts the dtype on the host while copying"
        if not getattr(kernel, "async_copy", False):  # CuPy's ndarray.set: refused in a capture
            return ("copies with CuPy's ndarray.set, which CuPy refuses inside a capture (not "
                    "the cudaMemcpyAsync copy)")
        return None
    if host_in:
        return (f"reads the host blob '{host_in[0]}' (a replay would keep the value it had "
                "when captured)")
    if host_out:
        return f"writes the host blob '{host_out[0]}'"
    return None


def stage_order(order, deps, comm_order, unordered=()):
    """The comm ops in the order they can be posted, for ``plan_segments``:
    by when their inputs are complete (the topological position of their
    last producer), except that an ordered one (a collective, posted in
    ``seq`` order: ``comm_order``) is never before the ordered ones posted
    before it; ``unordered`` ops (point-to-point) go as soon as ready."""
    position = {n: i for i, n in enumerate(order)}
    free = set(unordered)
    when, latest = {}, -1
    for c in comm_order:
        ready = max((position[p] for p in deps[c]), default=-1)
        if c in free:
            when[c] = ready
        else:
            latest = max(latest, ready)
            when[c] = latest
    index = {c: i for i, c in enumerate(comm_order)}
    return sorted(comm_order, key=lambda c: (when[c], index[c]))


def plan_segments(order, deps, keys, comm_order, blockers):
    """Cut the capturable GPU ops into segments.

    ``order``: op names in a topological order; ``deps``: {op: predecessor
    ops}; ``keys``: {op: (device, stream thread), or None for a host op};
    ``comm_order``: the comm ops in posting order; ``blockers``: {GPU op:
    why it cannot be captured} for those that cannot.

    Each capturable op gets ``(epoch, device, stage)``: *epoch* counts the
    cuts on the longest path to it (an op that is not captured, or a change
    of device); *stage* is the posting position of the first comm op that
    depends on it (past the last one when none does). Both only grow along
    a path, so ops with the same triple form a segment that no path leaves
    and re-enters: contracted into single units, the graph stays acyclic.
    A bucket's producers share the stage of its allreduce, and ops that only
    later buckets need have a later stage: the segment ends where the
    bucket is complete.

    Returns ``(segments, unit)``: the segments as lists of op names (in
    ``order``), in a topological order of the contracted graph, and
    {op: index of its segment}."""
    comm = set(comm_order)
    capturable = {n: keys.get(n) is not None and n not in comm and n not in blockers
                  for n in order}
    succ = defaultdict(list)
    for n in order:
        for p in deps[n]:
            succ[p].append(n)
    epoch = {}
    for n in order:
        e = 0
        for p in deps[n]:
            cut = not capturable[p] or (capturable[n] and keys[p][0] != keys[n][0])
            e = max(e, epoch[p] + cut)
        epoch[n] = e
    # an op that reads nothing (a constant, the loss gradient's seed) goes
    # as late as its consumers allow: with them, not in a segment of its own
    for n in order:
        if capturable[n] and not deps[n] and succ[n]:
            epoch[n] = max(0, min(epoch[s] - (capturable[s] and keys[s][0] != keys[n][0])
                                  for s in succ[n]))
    post = {c: i for i, c in enumerate(comm_order)}
    last = len(comm_order)
    stage = {}
    for n in reversed(order):
        s = post.get(n, last)
        for t in succ[n]:
            s = min(s, stage[t])
        stage[n] = s
    groups = {}
    for n in order:
        if capturable[n]:
            groups.setdefault((epoch[n], keys[n][0], stage[n]), []).append(n)
    members = list(groups.values())
    unit = {n: i for i, ms in enumerate(members) for n in ms}
    # a topological order of the contracted graph (ties: first member position)
    position = {n: i for i, n in enumerate(order)}
    node_of = {n: ("s", unit[n]) if n in unit else ("o", n) for n in order}
    ndeps, nsucc = defaultdict(set), defaultdict(set)
    for n in order:
        for p in deps[n]:
            a, b = node_of[p], node_of[n]
            if a != b:
                ndeps[b].add(a)
                nsucc[a].add(b)
    first = {}
    for n in order:
        first.setdefault(node_of[n], position[n])
    left = {v: len(ndeps[v]) for v in first}
    ready = [(first[v], v) for v, k in left.items() if k == 0]
    heapq.heapify(ready)
    seen = []
    while ready:
        _, v = heapq.heappop(ready)
        if v[0] == "s":
            seen.append(v[1])
        for w in nsucc[v]:
            left[w] -= 1
            if left[w] == 0:
                heapq.heappush(ready, (first[w], w))
    if sum(left.values()):
        raise AssertionError("plan_segments: the contracted graph has a cycle")
    renumber = {old: new for new, old in enumerate(seen)}
    return [members[i] for i in seen], {n: renumber[i] for n, i in unit.items()}
