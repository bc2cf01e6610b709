"""Static memory for a graph: every blob gets its array once, before the first
iteration, and keeps it. On the host, with a memory plan
(``runtime/memory_plan.py``; the trainer makes one unless the config says
``memory_plan: false``) the blobs written and read within one iteration are
views into one arena, at offsets planned so that blobs the graph does not
order apart never share a byte; the rest (and every blob without a plan)
get arrays of their own. Alias blobs are views into their storage root, so a
gradient bucket is one flat allocation whose per-parameter views the gradient
ops write in place (no packing copy for communication).

On a GPU the memory is planned from the graph: the storage roots of each
device are laid out (256-byte aligned) in one arena, allocated once from
CuPy's memory pool (``plan_device_memory``), so blobs never fragment the pool
and the footprint is known before the first iteration. With a device's
memory plan (``memory_plan.plan_memory(graph, device=d)``) the roots that
persist take the front of the arena and the transient ones share the rest
at their planned offsets; without one every root has bytes of its own. The
test workspace's planned roots reuse the training workspace's planned region
of each device when it is large enough (``device_arenas``), as on the host:
the test pass runs only while no training work is in flight
(train/evaluation.py). What kernels need
beyond their outputs (im2col columns, GEMM partials, a library's workspace)
is *scratch* (``Workspace.scratch_for``): slots shared by every op the
stream order or the graph serialises (one slot per stream that runs
scratch-using ops concurrently, sized by the largest of its ops), reserved
in the kernels' ``setup`` and allocated in the first iteration, so a
steady-state iteration allocates nothing on the device;
CuPy's ``CUPY_GPU_MEMORY_LIMIT`` caps the pool. Host blobs that feed host-to-device
copies (``attrs['pinned']``, set by ``place_on_device``) are page-locked, so
those copies run asynchronously.
"""
import numpy as np

from ..base.backend import cupy_available, get_xp, xp_for_device
from ..base.errors import GraphError
# ARENA_ALIGN: the alignment of blob offsets in a device arena (cudaMalloc's own)
from ..gpu.scratch import ARENA_ALIGN, Scratch


def plan_device_memory(graph, skip=(), plans=None):
    """{device: (total_bytes, {root blob: byte offset})} for the storage roots
    of every GPU device (blobs named in ``skip`` are owned elsewhere).
    ``plans``: {device: MemoryPlan} (``memory_plan.plan_memory``): a
    device's planned roots share bytes at their planned offsets, after its
    other roots, which are laid out one after the other; a device without a
    plan lays out all its roots so."""
    plans = plans or {}
    layout = {}
    for name, blob in graph.blobs.items():
        if blob.alias_of is not None or name in skip or blob.location.device < 0:
            continue
        if blob.shape is None:
            raise GraphError(f"blob '{name}' has no shape; run shape inference first")
        device = blob.location.device
        total, offsets = layout.setdefault(device, [0, {}])
        plan = plans.get(device)
        if plan is not None and name in plan.offsets:
            continue
        nbytes = _elements(blob) * np.dtype(blob.dtype).itemsize
        offsets[name] = total
        layout[device][0] = total + -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN
    for device, plan in plans.items():
        if device in layout and plan.offsets:
            base, offsets = layout[device]
            offsets.update((root, base + off) for root, off in plan.offsets.items())
            layout[device][0] = base + plan.total_bytes
    return {d: (total, offsets) for d, (total, offsets) in layout.items()}


def window_arrays(graph):
    """{blob: its window region's array} for the blobs a remote rank writes
    or that this rank computes into a peer's region on its node
    (``attrs['window']``, parallel/one_sided.py): they live in window memory
    allocated at start-up (comm/windows.py), not in the arena. A blob that
    views another or is viewed, or lives on a GPU, keeps memory of its own
    (its WaitWrite then copies the region into it), unless it says
    ``attrs['window_views']`` (the parameter servers' weights: their views
    view the region)."""
    from ..comm.windows import find_windows
    out = {}
    for b in _window_candidates(graph):
        win = find_windows(b.attrs["window"])
        view = None if win is None else win.view(b.attrs["window"])  # the owner's, or a
        if view is not None:                                          # peer's on one node
            out[b.name] = view
    return out


def window_blobs(graph):
    """The names of the blobs of ``graph`` that live in window memory, not
    in the arena (``window_arrays``'). Where none of this process's windows
    is allocated (``plan``'s offline build, without MPI) those the windows
    would hold with every rank on one node, as ``footprint.window_bytes``
    places them: every region is then shared, so every blob
    ``window_arrays`` would consider (the same figure ``train`` counts)."""
    from ..comm.windows import live_windows
    if live_windows():
        return list(window_arrays(graph))
    return [b.name for b in _window_candidates(graph)]


def _window_candidates(graph):
    """The blobs marked ``attrs['window']`` that keep no memory of their own."""
    marked = [b for b in graph.blobs.values() if b.attrs.get("window")]
    if not marked:
        return []
    viewed = {b.alias_of for b in graph.blobs.values() if b.alias_of is not None}
    return [b for b in marked if not (b.alias_of is not None or b.location.device >= 0 or
                                      (b.name in viewed and not b.attrs.get("window_views")))]


def _elements(blob):
    return max(blob.size, 1) if blob.shape else 1


def _aligned_zeros(nbytes):
    """A zeroed uint8 host array of ``nbytes`` whose start is aligned to
    ``memory_plan.HOST_ALIGN`` bytes (the planned offsets are multiples of it)."""
    from .memory_plan import HOST_ALIGN
    raw = np.zeros(int(nbytes) + HOST_ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % HOST_ALIGN
    return raw[start:start + int(nbytes)]


def slot_for(name, slots, lanes, ancestors):
    """The index in ``slots`` (lists of op names) of the scratch slot op
    ``name`` joins, None: a slot of its own. It joins the first slot whose
    every op runs on its stream (``lanes``: {op: stream}; a stream runs its
    work one after the other) or is ordered with it by the graph
    (``ancestors(op)``: the ops that run before ``op``). The workspace binds
    its slots so (``Workspace.scratch_for``), and ``scratch_plan`` plans
    them before anything is allocated."""
    lane = lanes.get(name)
    before = ancestors(name)
    for i, ops in enumerate(slots):
        if all((lane is not None and lanes.get(u) == lane) or u in before
               or name in ancestors(u) for u in ops):
            return i
    return None


def ancestors_in(deps, cache, name):
    """The ops that run before ``name`` by ``deps`` ({op: its direct
    predecessors}, ``Graph.dependencies``), memoised in ``cache``."""
    found = cache.get(name)
    if found is None:
        found, stack = set(), list(deps.get(name, ()))
        while stack:
            p = stack.pop()
            if p in found:
                continue
            found.add(p)
            cached = cache.get(p)
            if cached is not None:
                found |= cached
            else:
                stack.extend(deps.get(p, ()))
        cache[name] = found
    return found


def scratch_plan(needs, lanes, ancestors):
    """[(bytes, [ops])] of one device's scratch slots, planned as the
    workspace binds them: ``needs`` {op: bytes it reserves}, in the order
    the ops are set up (a topological order), ``lanes`` and ``ancestors``
    as for ``slot_for``. A slot is as large as its largest reservation."""
    slots = []
    for name, nbytes in needs.items():
        i = slot_for(name, [ops for _, ops in slots], lanes, ancestors)
        if i is None:
            slots.append([0, []])
        slot = slots[-1 if i is None else i]
        slot[0] = max(slot[0], int(nbytes))
        slot[1].append(name)
    return [(n, ops) for n, ops in slots]


class Workspace:
    """Arrays for all blobs of a graph, plus kernel instances."""

    def __init__(self, graph, shared=None, plan=None, arena=None, device_plans=None,
                 room=None):
        """``shared`` maps blob names to arrays owned elsewhere (the test
        graph reads the train graph's parameters without copying them).
        ``plan``: a host memory plan (``runtime/memory_plan.py``): its
        transient blobs are views into one arena at the planned offsets;
        None gives every host blob a buffer of its own. ``arena``: another
        workspace whose host arena this one may reuse when it is large
        enough (the test graph runs only while the train graph does not),
        and on each GPU the planned region of its device arena likewise
        (``device_arenas``; the arena keeps the rest of the roots).
        ``device_plans``: {GPU device: its memory plan}, laid out in that
        device's arena (``plan_device_memory``). ``room``: {device (-1: the
        host): bytes} that device's planned region holds at least (the test
        workspace's, so that it always reuses this one's: the two regions
        are one, as large as the larger, not the sum)."""
        self.graph = graph
        #: counts the writes from outside (``set``, ``weights_changed``):
        #: a dispatcher makes its weight copies again when it changed
        #: (parallel/precision.fold_weight_casts)
        self.weights_version = 0
        self.arrays = {**window_arrays(graph), **dict(shared or {})}
        # a blob owned elsewhere that other blobs view: they view its memory
        self._flat = {b.alias_of: self.arrays[b.alias_of].reshape(-1)
                      for b in graph.blobs.values()
                      if b.alias_of in self.arrays and self.arrays[b.alias_of].flags.c_contiguous}
        self.allocated_bytes = 0
        self.plan = plan
        #: {GPU device: its memory plan} (empty without plans)
        self.device_plans = dict(device_plans or {})
        room = dict(room or {})
        #: the host arena of the planned blobs (None without a plan)
        self.host_arena = None
        if plan is not None and plan.total_bytes:
            other = getattr(arena, "host_arena", None)
            if other is not None and other.nbytes >= plan.total_bytes:
                self.host_arena = other
            else:
                nbytes = max(plan.total_bytes, int(room.get(-1, 0)))
                self.host_arena = _aligned_zeros(nbytes)
                self.allocated_bytes += nbytes
        #: bytes of each GPU device's arena (what this workspace allocated there)
        self.device_bytes = {}
        #: {GPU device: the planned region of its arena} (the transient
        #: blobs' bytes): a view into this workspace's arena, or into
        #: ``arena``'s when that one's is large enough
        self.device_arenas = {}
        self._arena = {}
        self._offsets = {}         # GPU root -> (the array it is a slice of, byte offset)
        self._scratch_slots = {}   # device -> [[Scratch, [its ops]], ...]
        self._scratch_of = {}      # op -> its _OpScratch
        self._slot_of = {}         # op -> its slot's Scratch (once bound)
        #: {op: the stream it runs on} (``set_scratch_lanes``), None: unknown
        self.scratch_lanes = None
        self._deps = None
        self._ancestor_cache = {}
        plans = plan_device_memory(graph, skip=self.arrays, plans=self.device_plans)
        reuse = getattr(arena, "device_arenas", {})
        for device, (total, offsets) in sorted(plans.items()):
            self._allocate_arena(device, total, offsets, reuse.get(device),
                                 int(room.get(device, 0)))
        for name in graph.blobs:
            self._ensure(name)

    def _allocate_arena(self, device, total, offsets, other=None, room=0):
        """GPU ``device``'s arena of ``total`` bytes (``plan_device_memory``'s
        layout: the unplanned roots, then the planned region). Where
        ``other`` (another workspace's planned region there) holds this
        one's planned region, the planned roots are views into it and the
        arena holds the other roots alone. A planned region of its own is
        at least ``room`` bytes (``__init__``)."""
        plan = self.device_plans.get(device)
        planned = plan.total_bytes if plan is not None and plan.offsets else 0
        base = total - planned
        shared = planned and other is not None and other.nbytes >= planned
        if planned and not shared:
            planned = max(planned, room)
        own = base if shared else base + planned
        cupy = xp_for_device(device)  # a UserError when there is no GPU
        with cupy.cuda.Device(device):
            arena = self._arena[device] = cupy.zeros(max(own, 1), dtype=np.uint8)
        if planned:
            region = self.device_arenas[device] = other if shared else \
                arena[base:base + planned]
        for root, start in offsets.items():
            if planned and root in plan.offsets:
                self._offsets[root] = (region, start - base)
            else:
                self._offsets[root] = (arena, start)
        self.device_bytes[device] = own
        self.allocated_bytes += own

    def _ensure(self, name):
        if name in self.arrays:
            return self.arrays[name]
        blob = self.graph.blobs[name]
        if blob.shape is None:
            raise GraphError(f"blob '{name}' has no shape; run shape inference first")
        if blob.alias_of is None:
            if blob.location.device >= 0:
                flat = self._from_arena(name, blob)
            elif self.plan is not None and name in self.plan.offsets:
                start = self.plan.offsets[name]
                raw = self.host_arena[start:start + _elements(blob) * np.dtype(blob.dtype).itemsize]
                flat = raw.view(blob.dtype)
            elif blob.attrs.get("pinned") and cupy_available():
                flat = self._pinned(blob)
            else:
                xp = xp_for_device(blob.location.device)
                flat = xp.zeros(max(blob.size, 1) if blob.shape else 1, dtype=blob.dtype)
                self.allocated_bytes += flat.nbytes
            self._flat[name] = flat
            arr = flat[:blob.size].reshape(blob.shape)
        else:
            root = self.graph.storage_root(name)
            self._ensure(root)
            flat = self._flat[root]
            off = self.graph._abs_offset(name)
            if np.dtype(blob.dtype) != flat.dtype:
                raise GraphError(f"alias blob '{name}' ({blob.dtype}) views '{root}' ({flat.dtype})")
            if off + blob.size > flat.size:
                raise GraphError(f"alias blob '{name}' (offset {off}, size {blob.size}) runs past "
                                 f"the end of '{root}' (size {flat.size})")
            arr = flat[off:off + blob.size].reshape(blob.shape)
        self.arrays[name] = arr
        return arr

    def _from_arena(self, name, blob):
        """The flat array of a GPU storage root: its slice of the arena."""
        count = _elements(blob)
        dtype = np.dtype(blob.dtype)
        arena, start = self._offsets[name]
        raw = arena[start:start + count * dtype.itemsize]
        return raw.view(dtype)

    def _pinned(self, blob):
        """A zeroed page-locked host array (the source of an async copy)."""
        from ..gpu.streams import pinned_empty
        flat = pinned_empty((_elements(blob),), blob.dtype)
        flat[...] = 0
        self.allocated_bytes += flat.nbytes
        return flat

    def __getitem__(self, name):
        return self.arrays[name]

    def scratch_for(self, op_name, device):
        """The scratch (``reserve``/``take``, like :class:`gpu.scratch.Scratch`)
        op ``op_name`` uses on GPU ``device``: a view of one shared slot.

        An op's reservation is kept; the slots are bound at the first
        ``take`` (the first iteration, after the dispatcher's executor has
        said which stream runs each op, ``set_scratch_lanes``), every op set
        up by then at once, in the order they were set up: an op joins a
        slot when each op already there runs on the same stream (a stream
        runs its work one after the other, whether or not the graph orders
        it) or is ordered with it by the graph (a path of data,
        write-after-read or control edges). So the slots are at most one per
        stream that runs scratch-using ops concurrently, each sized by the
        largest reservation among its ops; without lanes only the graph's
        order shares a slot."""
        device = int(device)
        scratch = self._scratch_of.get(op_name)
        if scratch is None:
            scratch = self._scratch_of[op_name] = _OpScratch(self, op_name, device)
        return scratch

    def set_scratch_lanes(self, lanes):
        """{op: the stream it runs on (any hashable), or None}: the
        executor's streams (a CUDA-graph segment replays on a stream of its
        own: its ops' lanes name it). When they differ from those the slots
        were bound with, the slots are bound again at the next ``take``
        (the old buffers go with the captures that held them)."""
        lanes = {n: lane for n, lane in (lanes or {}).items() if lane is not None} or None
        if lanes == self.scratch_lanes:
            return
        self.scratch_lanes = lanes
        if self._slot_of:
            self._scratch_slots = {}
            self._slot_of = {}

    def scratch_slot(self, op_name, device):
        """The shared :class:`gpu.scratch.Scratch` of ``op_name``'s slot
        (binds the slots of ``device`` first, see ``scratch_for``)."""
        self.scratch_for(op_name, device)
        slot = self._slot_of.get(op_name)
        if slot is None:
            self._bind(int(device))
            slot = self._slot_of[op_name]
        return slot

    def _bind(self, device):
        if self._deps is None:
            self._deps = self.graph.dependencies()
        lanes = self.scratch_lanes or {}
        slots = self._scratch_slots.setdefault(device, [])
        for name, op_scratch in self._scratch_of.items():
            if op_scratch.device != device or name in self._slot_of:
                continue
            i = slot_for(name, [s[1] for s in slots], lanes, self._ancestors)
            if i is None:
                slots.append([Scratch(device), []])
            slot = slots[-1 if i is None else i]
            slot[1].append(name)
            if op_scratch.reserved:
                slot[0].reserve(((op_scratch.reserved,), np.uint8))
            self._slot_of[name] = slot[0]

    def scratch_slots(self):
        """{device: [(bytes reserved, [its ops])]} of the slots (bound now)."""
        for device in sorted({s.device for s in self._scratch_of.values()}):
            self._bind(device)
        return {d: [(s[0].reserved, list(s[1])) for s in slots]
                for d, slots in sorted(self._scratch_slots.items())}

    def _ancestors(self, name):
        return ancestors_in(self._deps, self._ancestor_cache, name)

    @property
    def scratch_bytes(self):
        """{device: bytes} of the scratch buffers allocated so far."""
        total = {}
        for device, slots in self._scratch_slots.items():
            total[device] = sum(s[0].nbytes for s in slots)
        return total

    def storage(self, name):
        """The flat 1-D array that holds ``name``'s storage root (a root
        owned elsewhere that no blob views, e.g. a one-sided window's region
        an Allreduce writes: its own array, flat)."""
        root = self.graph.storage_root(name)
        flat = self._flat.get(root)
        return self.arrays[root].reshape(-1) if flat is None else flat

    def weights_changed(self):
        """Say that weights were written from outside the graph (not through
        ``set``): the next run makes the low-precision weight copies its
        updates keep again (parallel/precision.refresh_weight_copies)."""
        self.weights_version += 1

    def set(self, name, value):
        """Copy ``value`` into blob ``name`` (shape-checked; then
        ``weights_changed``)."""
        self.weights_version += 1
        arr = self.arrays[name]
        value = np.asarray(value) if not hasattr(value, "__cuda_array_interface__") else value
        if tuple(value.shape) != tuple(arr.shape):
            raise GraphError(f"cannot load blob '{name}': shape {list(value.shape)} given, "
                             f"the graph has {list(arr.shape)}")
        xp = get_xp(arr)
        if xp is not np and not hasattr(value, "__cuda_array_interface__"):
            # CuPy cannot assign a host array element-wise: copy it over first
            with arr.device:
                value = xp.asarray(value, dtype=arr.dtype)
        arr[...] = value


class _OpScratch:
    """One op's handle on its shared scratch slot (``Workspace.scratch_for``):
    ``reserve`` is kept for the slot's size, ``take`` binds the slots and
    takes from the op's."""

    def __init__(self, workspace, op_name, device):
        self._ws, self.op_name, self.device = workspace, op_name, int(device)
        self.reserved = 0

    def reserve(self, *specs):
        self.reserved = max(self.reserved, Scratch._layout(specs)[1])
        slot = self._ws._slot_of.get(self.op_name)
        if slot is not None:
            slot.reserve(*specs)

    def take(self, *specs):
        return self._ws.scratch_slot(self.op_name, self.device).take(*specs)

    @property
    def nbytes(self):
        slot = self._ws._slot_of.get(self.op_name)
        return 0 if slot is None else slot.nbytes
