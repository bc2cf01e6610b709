"""Every byte a rank's workspaces hold, known before its first iteration:
``plan JOB.yaml --np N`` prints it for each rank, and ``train`` checks it
against the memory there is before it allocates anything big.

The figures are not a second model of the run. ``workspace_plans`` makes
the memory plans (runtime/memory_plan.py) that the trainer then lays its
workspaces out by (train/trainer.py passes them on), and ``footprint``
walks the storage roots as ``Workspace`` allocates them: a planned root
is a view into its device's arena, every other root an array of its own
(``_root_nbytes``, the arena's own rule, on the host; 256-byte aligned in
a GPU's arena, ``plan_device_memory``). So the host total is the trainer's
``Workspace.allocated_bytes`` to the byte (tests/test_plan.py checks it).

Each root is counted in one row: its kind says which (a gradient bucket
is where the gradients live, so it counts as gradients):

- ``weights``: parameters (kinds ``param``, ``param_buffer``: running
  statistics too);
- ``gradients``: kinds ``grad`` and ``bucket`` that keep their own memory
  (accumulated ones, buckets; a gradient written and read in one iteration
  is planned into the arena, and ``peak`` says how much of it is live there);
- ``optimizer_state``: state the solver's update ops read (momentum, Adam's
  two moments);
- ``activations``: the arena of the transient blobs (its size; ``peak``:
  the bytes live at once and the op where they peak), and, with
  ``memory_plan: false``, the transient blobs one buffer each;
- ``data_batch``: the blobs the data readers fill;
- ``data_pool`` (host): what the data readers hold besides their output
  blobs (``data_pool_bytes``);
- ``comm_buffers``: pipeline Send/Recv buffers that keep their own memory;
- ``windows``: this rank's part of the one-sided transport's windows,
  the training graph's and the test graph's (a pipeline's test graph
  has windows of its own: both allocated at start-up, held to the end);
- ``mpi_transport`` (host): MPI's shared-memory cells of the other ranks
  of its node, as it reads their messages (comm/mpi_transport.py; set by
  tools/plan.set_transport, which knows the node);
- ``kept``: everything else that persists (losses, metrics, lr, the
  iteration counter, a device loss watch).

Beside the rows, ``save`` (``plan``'s "checkpoint save" row): the host
bytes a checkpoint save holds beyond them while it runs, the scheme's
figure (``Scheme.save_bytes``: rank 0's receive buffers and joins, a GPU
rank's host copies of its part). The save runs between iterations, when
no kernel runs: ``save_total`` is the rows less the kernel temporaries
plus it, and ``host_total`` (the host's need) the larger of that and the
rows' sum (``loop_total``).

``load`` (``plan``'s "start-up load" row): the host bytes the weights'
fill and load hold before the first iteration beyond the rows written by
then (the first fill of the largest parameter, an ``--init`` file's
weights, a ``--resume`` checkpoint and the optimizer state it sets:
tools/plan.load_bytes); ``load_total`` is those rows (``STARTUP_ROWS``)
plus it, and ``host_total`` the largest of the three totals.

Two more host rows, what the CPU kernels hold besides the blobs (the
host ops of the training graph and the test graph, ``host_kernel_bytes``):

- ``host_scratch``: the buffers the convolution and pooling kernels keep in
  their worker thread's caches (ops/im2col.py: padded copies, im2col
  columns, GEMM outputs), from each op's ``OpKernel.host_scratch``, the
  Holds its ``run`` takes: per dispatcher lane (one worker thread per
  ``thread`` value of the ops) each distinct buffer once and each growing
  flat buffer at its largest (``im2col.held_by``), the lanes added, and
  the process's shared read-only arrays once (``im2col.shared``:
  attention's causal mask, one per length and dtype); the
  test graph's dispatcher has worker threads of its own, whose caches are
  held beside the training graph's (with the serial dispatcher every
  kernel runs on the calling thread: one lane, one set of caches);
- ``kernel_temporaries``: the new arrays a host kernel makes while it runs
  (``host_temporaries``: those it takes from ``OpKernel.temporaries`` --
  attention's scores, GELU's and layer norm's intermediates -- and its
  NumPy expression temporaries -- a ReLU gradient's mask, the loss's
  per-position arrays, a dropout draw's keep-mask and chunk buffers),
  freed when it ends: the largest op's per lane, the
  lanes added (they may run at once), of the graph whose sum is larger
  (the training and test graphs never run at once).

On a GPU three more rows (``device_extras``), from the same functions
the run uses:

- ``scratch``: the kernels' scratch slots (runtime/workspace.scratch_plan
  on each op's ``OpKernel.scratch_specs``, the sizes its ``setup``
  reserves, with the streams ``stream_keys`` and, with ``cuda_graph``, the
  segments ``plan_segments`` give: ``planned_lanes``); a cuDNN plan's
  workspace is the tuner cache's entry when there is one, else the cap
  ``gpu.workspace_limit``;
- ``cublas_workspaces``: one cuBLAS handle workspace (gpu/blas) per
  stream and capture scope, as gpu/blas makes them: each stream whose ops
  run products eagerly (the first iteration runs every segment eagerly),
  and per CUDA-graph segment one capture stream per stream of its ops
  that run products (``CudaRuntime.prepare_capture``; the capture's origin
  stream only forks and joins them, and a stream of copies alone -- the
  batch's upload -- calls no cuBLAS, so neither has one);
- ``capture_pools``: what captures allocate in their private pools: 0, as
  every kernel reserves its memory before a capture (an allocation inside
  one is refused: tests/test_gpu_no_alloc.py).

The test graph's scratch and segments are not counted (a test pass in the
same process adds its own slots and captures).
"""
import mmap
from dataclasses import dataclass, field

import numpy as np

from ..base.progress_bar import human_bytes
from ..graph.core import WORKING_SET_ATTR
from .factory import dispatcher_kind, memory_plans
from .memory_plan import _root_nbytes, batch_blobs
from .workspace import window_blobs

#: the rows of a footprint, in the order they print
ROWS = ("weights", "gradients", "optimizer_state", "activations", "data_batch",
        "comm_buffers", "windows", "mpi_transport", "kept", "data_pool", "host_scratch",
        "kernel_temporaries", "scratch", "cublas_workspaces",
        "capture_pools")

#: row labels as printed (``plan``'s table, train's start-up ``planned`` row)
LABELS = {"weights": "weights", "gradients": "gradients", "optimizer_state": "optimizer state",
          "activations": "activations", "data_batch": "data batch",
          "comm_buffers": "comm buffers", "windows": "windows",
          "mpi_transport": "MPI transport buffers", "kept": "other kept blobs",
          "data_pool": "data pool", "host_scratch": "host scratch",
          "kernel_temporaries": "kernel temporaries",
          "scratch": "scratch slots", "cublas_workspaces": "cuBLAS workspaces",
          "capture_pools": "capture pools"}

#: the host rows resident before the first iteration (``Footprint.load_total``)
STARTUP_ROWS = ("weights", "data_batch", "comm_buffers", "windows", "kept", "data_pool")


@dataclass
class WorkspacePlans:
    """The memory plans of a rank's two workspaces (training and test),
    made once: the trainer lays the workspaces out by them, the estimate
    counts them. ``host`` is None with ``memory_plan: false``."""

    keep: list
    host: object = None
    devices: dict = field(default_factory=dict)
    test_keep: list = field(default_factory=list)
    test_skip: list = field(default_factory=list)
    test_host: object = None
    test_devices: dict = field(default_factory=dict)


def shared_params(graphs):
    """The parameters the test graph reads from the training workspace
    (the trainer hands it those arrays rather than copies): not the views
    of a bucket a ZeRO stage gathers for the training graph alone
    (graph/core.WORKING_SET_ATTR: the test graph holds its own,
    Scheme.give_test_weights fills them)."""
    tg, g = graphs.test_graph, graphs.graph
    return [p for p in tg.blobs if p in g.blobs and g.blobs[p].kind == "param" and
            WORKING_SET_ATTR not in g.blobs[g.storage_root(p)].attrs]


def workspace_plans(graphs, planned=True, test_reads=None):
    """The plans of ``graphs`` (parallel/rank_graphs.RankGraphs) as the
    trainer lays them out: ``planned`` is the job's ``memory_plan``;
    ``test_reads(test_graph)``: the blobs the host reads after a test
    iteration besides its losses and metrics (``predict --blob``): they keep
    memory of their own, as a transient blob's is another's by then."""
    g = graphs.graph
    out = WorkspacePlans(keep=([graphs.watch] if graphs.watch else []) + batch_blobs(g))
    if planned:
        out.host, out.devices = memory_plans(g, keep=out.keep, skip=window_blobs(g))
    tg = graphs.test_graph
    if tg is not None:
        # the counted positions a test pass reads after each batch (train/evaluation.py)
        counts = [c[0] for c in graphs.test_counts if c and c[0] is not None]
        out.test_keep = list(graphs.test_names) + batch_blobs(tg) + counts + \
            list(test_reads(tg) if test_reads else ())
        out.test_skip = window_blobs(tg) + shared_params(graphs)
        if planned:
            out.test_host, out.test_devices = memory_plans(tg, keep=out.test_keep,
                                                           skip=out.test_skip)
    return out


@dataclass
class Footprint:
    """What one rank holds: {row: bytes} on the host and on each GPU."""

    rank: int
    device: int
    host: dict
    devices: dict
    #: the transient blobs at their peak: {"where", "op", "position", "ops",
    #: "live_bytes", "arena_bytes", "gradients_bytes"} (None: nothing planned)
    peak: object = None
    #: what the rows leave out, in words
    notes: list = field(default_factory=list)
    #: {weights, gradients, optimizer_state: bytes}: ``model_state_bytes`` of
    #: the training graph, the figures of train's start-up ``model state`` line
    #: (a gradient a memory plan places in the arena counts here whole, and
    #: in the rows as part of the activations)
    model_state: dict = field(default_factory=dict)
    #: {device: ``device_extras``}: the plan behind its scratch and cuBLAS
    #: rows (slots, each op's scratch and its note, the handles)
    extras: dict = field(default_factory=dict)
    #: the host bytes a checkpoint save holds beyond the rows while it runs
    #: (``Scheme.save_bytes``: rank 0's receive buffers and joins, a GPU
    #: rank's host copies of its part)
    save: int = 0
    #: the host bytes the start-up load holds beyond the rows before the
    #: first iteration (``plan.load_bytes``: the first fill of the largest
    #: parameter, an ``--init`` file's weights, a ``--resume`` checkpoint)
    load: int = 0
    #: the rows held while ``load`` is (``load_total``): ``STARTUP_ROWS``; a
    #: parameter server's, which reads the files before it allocates its
    #: arrays, the windows alone (``plan.set_load``)
    load_rows: tuple = STARTUP_ROWS
    #: a parameter server's first fill (with the optimizer state a resume
    #: sets), which runs once its arrays are allocated: on ``STARTUP_ROWS``
    #: (0 elsewhere: in ``load``)
    fill: int = 0
    #: the rows held while ``fill`` is: ``STARTUP_ROWS``; an async
    #: parameter server's without the comm buffers (its loop allocates them
    #: once the fill is done: ``ServerRank.footprint``)
    fill_rows: tuple = STARTUP_ROWS
    #: the rows besides the kernel temporaries that are let go before every
    #: save (``save_total``): an async parameter server whose state rank 0
    #: never asks for mid-run saves once its loop returned, its receive and
    #: reply buffers freed (``ServerRank.footprint``)
    save_frees: tuple = ()
    #: the part of the ``kept`` row that the loop's services keep from a
    #: save or a test pass on (``Scheme.held_bytes``: async rank 0's copy of
    #: the servers' momenta), not yet made before the first iteration, so
    #: not in ``load_total``
    held: int = 0
    #: the pages of other ranks' shared-window regions this rank accesses
    #: (``peer_window_bytes``): in its resident bytes too, not in its rows
    #: (their owner's ``windows`` row counts them, once for the node)
    peer_windows: int = 0

    @property
    def loop_total(self):
        """The host bytes held during an iteration: every row."""
        return sum(self.host.values())

    @property
    def save_total(self):
        """The host bytes held while a save runs: it runs between
        iterations (train/checkpoints.py, after the dispatcher drained), when
        no kernel runs, so without the kernel temporaries; every other row
        stays allocated (the arenas, the caches), and the save's own bytes;
        less the rows ``save_frees`` names (let go before any save)."""
        return self.loop_total - sum(self.host.get(k, 0) for k in
                                     ("kernel_temporaries",) + tuple(self.save_frees)) + self.save

    @property
    def load_total(self):
        """The host bytes held while the weights are filled and loaded,
        before the first iteration: the rows written by then
        (``STARTUP_ROWS``: the weights, the data readers' and the kept
        blobs, the transport's buffers) and the load's bytes. No op has run:
        the gradients, the optimizer state (a resume's load counts it), the
        arena and the kernels' buffers are zeros from the system, not
        resident until an iteration writes them. A parameter server's
        load of files (``load_rows``) and its fill, on its rows
        (``fill_rows``), apart. The kept bytes the loop's services make
        later (``held``) are not held yet."""
        def rows(names):
            return sum(self.host.get(k, 0) for k in names) - \
                (self.held if "kept" in names else 0)
        return max(rows(self.load_rows) + self.load, rows(self.fill_rows) + self.fill)

    @property
    def host_total(self):
        """The most host bytes held at once: the iteration's, the save's or
        the start-up load's."""
        return max(self.loop_total, self.save_total, self.load_total)

    def device_total(self, device):
        return sum(self.devices.get(device, {}).values())

    def rows_text(self, device=-1):
        """``weights 1.0 MiB, activations 512.0 KiB, ...``: the non-zero rows
        of the host (``device`` -1) or a GPU, the largest first (``plan``'s
        refusal, train's start-up ``planned`` row)."""
        rows = self.host if device < 0 else self.devices.get(device, {})
        return ", ".join(f"{LABELS[k]} {human_bytes(v)}" for k, v in
                         sorted(rows.items(), key=lambda kv: -kv[1]) if v)

    def as_dict(self):
        return {"rank": self.rank, "device": self.device,
                "host": {**{k: int(self.host.get(k, 0)) for k in ROWS},
                         "checkpoint_save": int(self.save),
                         "startup_load": int(self.load),
                         "loop_total": int(self.loop_total),
                         "save_total": int(self.save_total),
                         "load_total": int(self.load_total),
                         "total": int(self.host_total),
                         "peer_window_pages": int(self.peer_windows)},
                "devices": {str(d): {**{k: int(rows.get(k, 0)) for k in ROWS},
                                     "total": int(self.device_total(d))}
                            for d, rows in sorted(self.devices.items())},
                "model_state": {k: int(v) for k, v in self.model_state.items()},
                "peak": self.peak, "notes": list(self.notes)}


def planned_figures(fp):
    """OUT/memory.json's ``planned`` (train/trainer.write_memory, a
    server's figures): the host rows of the footprint train's start-up
    check counted (``plan``'s JSON ``host`` object for this rank: its rows,
    ``loop_total``, ``save_total``, ``load_total`` and ``total``, the need
    ``above_baseline_bytes`` is set against), None without a check
    (``--no-memory-check``)."""
    return None if fp is None else fp.as_dict()["host"]


def _groups(graph):
    groups = {}
    for b in graph.blobs:
        groups.setdefault(graph.storage_root(b), []).append(b)
    return groups


def _row_of(graph, names, batch, update_reads, comm_blobs, planned):
    kinds = {graph.blobs[n].kind for n in names}
    if kinds & {"param", "param_buffer", "param_copy"}:   # with the weights' bf16 copies
        return "weights"
    if kinds & {"grad", "bucket"}:
        return "gradients"
    if "state" in kinds and update_reads.intersection(names):
        return "optimizer_state"
    if batch.intersection(names):
        return "data_batch"
    if comm_blobs.intersection(names):
        return "comm_buffers"
    return "activations" if planned else "kept"


def _reads(graph):
    """(blobs the solver's update ops read, blobs of Send/Recv ops)."""
    from ..ops.catalog import get_kernel_class
    update, comm = set(), set()
    for op in graph.ops.values():
        if get_kernel_class(op.op_type, op.name).category == "update":
            update.update(op.inputs)
        if op.op_type in ("Send", "Recv"):
            comm.update(op.inputs + op.outputs)
    return update, comm


def _graph_rows(graph, keep, skip, host_plan, device_plans):
    """({row: bytes} of the host, {device: {row: bytes}}) of the roots a
    ``Workspace(graph, shared=skip, plan=host_plan, device_plans=...)``
    gives arrays of their own; the planned arenas (the host's, each GPU
    arena's planned region) are left to the caller (``_arenas``: the test
    workspace may reuse the training workspace's)."""
    from ..gpu.scratch import ARENA_ALIGN
    skip = set(skip)
    batch = set(batch_blobs(graph))
    update, comm = _reads(graph)
    would = (host_plan, device_plans)
    if host_plan is None:  # memory_plan: false: which roots a plan would call transient
        would = memory_plans(graph, keep=keep, skip=list(skip), order_ops=False)
    host, devices = {}, {}
    for root, names in _groups(graph).items():
        blob = graph.blobs[root]
        if root in skip or blob.shape is None:
            continue
        device = blob.location.device
        plan = host_plan if device < 0 else device_plans.get(device)
        if plan is not None and root in plan.offsets:
            continue  # a view into the arena
        plan = would[0] if device < 0 else would[1].get(device)
        row = _row_of(graph, names, batch, update, comm,
                      plan is not None and root in plan.offsets)
        if device < 0:
            host[row] = host.get(row, 0) + _root_nbytes(blob)
        else:
            rows = devices.setdefault(device, {})
            rows[row] = rows.get(row, 0) + -(-_root_nbytes(blob) // ARENA_ALIGN) * ARENA_ALIGN
    return host, devices


def test_room(plans):
    """{device (-1: the host): bytes} of the test workspace's planned
    arenas (``WorkspacePlans``): the room the training workspace's own
    arenas make for them (``Workspace``'s ``room``), so that the test pass,
    which never runs with a training iteration, reuses them and the two
    take the larger's bytes, not their sum."""
    return _arenas(plans.test_host, plans.test_devices)


def _arenas(host_plan, device_plans):
    """{device (-1: the host): bytes of its planned arena} of a workspace
    laid out by these plans (a GPU arena's planned region, after its other
    roots: ``plan_device_memory``)."""
    out = {-1: host_plan.total_bytes} if host_plan is not None else {}
    out.update((d, p.total_bytes) for d, p in device_plans.items() if p.offsets)
    return out


def live_spans(plan):
    """{unit blob: (first, last) schedule position} of ``plan``'s blobs, a
    blob computed in place over another counted with it (one unit)."""
    def unit(r):
        while r in plan.in_place:
            r = plan.in_place[r][0]
        return r
    span = {}
    for r, (a, b) in plan.lifetimes.items():
        u = unit(r)
        lo, hi = span.get(u, (a, b))
        span[u] = (min(lo, a), max(hi, b))
    return span


def live_bytes(plan, span=None):
    """The bytes of ``plan``'s blobs live at each position of its schedule
    (``live_spans``: a blob in place over another shares its bytes)."""
    span = live_spans(plan) if span is None else span
    diff = [0] * (len(plan.order) + 1)
    for u, (a, b) in span.items():
        diff[a] += plan.sizes[u]
        diff[b + 1] -= plan.sizes[u]
    live, out = 0, []
    for d in diff[:-1]:
        live += d
        out.append(live)
    return out


def arena_peak(graph, plan):
    """The planned blobs at their peak: the most bytes live at once in the
    schedule (a blob computed in place over another shares its bytes) and
    the op where that falls. None when nothing is planned."""
    if plan is None or not plan.offsets:
        return None
    span = live_spans(plan)
    best, at = -1, 0
    for i, live in enumerate(live_bytes(plan, span)):
        if live > best:
            best, at = live, i
    grads = sum(plan.sizes[u] for u, (a, b) in span.items()
                if a <= at <= b and graph.blobs[u].kind in ("grad", "bucket"))
    return {"where": "host" if plan.device < 0 else f"GPU {plan.device}",
            "op": plan.order[at], "position": at, "ops": len(plan.order),
            "live_bytes": int(best), "arena_bytes": int(plan.total_bytes),
            "gradients_bytes": int(grads)}


def window_bytes(composition, rank):
    """Bytes of the one-sided transport's windows that ``rank`` holds (its
    segments of the window layout, ``comm/window_layout.py``, as the
    scheme's Composition places them; a list of placements: windows
    allocated apart, scheme sharded's stage transfers and stage-3 weights
    with stages), 0 without."""
    total = 0
    for _, sizes in _placed(composition):
        total += sum(n for (_, owner), n in sizes.items() if owner == rank)
    return total


def _placed(composition):
    """(layout, its segments' sizes ``layout.place`` gives) for each window
    placement of ``composition`` (one, or a list), each placed as it is
    yielded (its regions' offsets then are this placement's); none without
    a window."""
    placed = getattr(composition, "window_placement", None)
    if placed is None:
        return
    for layout, node_of in placed if isinstance(placed, list) else [placed]:
        yield layout, layout.place(node_of or {r: 0 for r in _layout_ranks(layout)})


def peer_window_bytes(composition, rank, page=None):
    """The pages of other ranks' shared-window regions (and notify words)
    that ``rank`` accesses (it is among their peers): whole pages of each
    owner's segment (``page`` bytes, the system's by default; a segment
    starts on a page: ``alloc_shared_noncontig``, comm/windows.py), each
    page once. Counted on their owner (its ``windows`` row: the node holds
    them once), they are in this rank's resident bytes as well once it has
    stored into or loaded from them (memory.json's ``peer_window_bytes``),
    so they are a figure beside the rows (``Footprint.peer_windows``), not
    one of them. 0 without a shared window."""
    page = page or mmap.PAGESIZE
    total = 0
    for layout, _ in _placed(composition):
        spans = {}
        for group in (layout.words, layout.regions):
            for r in group.values():
                if r.where == "shared" and r.owner != rank and rank in r.peers and r.nbytes:
                    spans.setdefault(r.owner, []).append(
                        (r.offset // page, -(-(r.offset + r.nbytes) // page)))
        for runs in spans.values():   # the pages of each owner's segment, each once
            end = 0
            for a, b in sorted(runs):
                total += max(0, b - max(a, end)) * page
                end = max(end, b)
    return total


def _layout_ranks(layout):
    ranks = set()
    for group in (layout.words, layout.regions):
        for r in group.values():
            ranks.add(r.owner)
            ranks.update(getattr(r, "peers", ()) or ())
    return ranks


def data_pool_bytes(graphs):
    """Host bytes the data readers of ``graphs`` hold besides their output
    blobs (ops/data.py): each source's resident data (data/sources.
    resident_bytes) and the reader's epoch order (data/sources.order_bytes:
    a shuffled source's permutation of its samples, one epoch's), once per
    ``source_key`` -- readers of one spec and seed share both
    (data/sources.shared_source: the M micro-batch copies of a replica's
    reader hold one synthetic pool, not M; an HDF5 split in memory is
    shared by every reader of the same file and split; an LMDB reader's
    order is its own) -- and the one batch each reader's prefetch thread
    gathers ahead (``DataReader._start``: one request in flight, the
    prepared data and labels kept until ``run`` copies them into the
    outputs; M copies of B/M rows: one batch)."""
    from ..data.sources import order_bytes, resident_bytes, shares_source, source_key
    shared, total = {}, 0
    for graph in graphs:
        for op in graph.ops.values():
            if op.op_type != "DataReader":
                continue
            spec = op.attrs["source"]
            key, held = resident_bytes(spec)
            order = order_bytes(spec)
            if shares_source(spec):
                # one look at the files: a racy one is not hashed to group its readers
                reader = ("reader", source_key(spec, int(op.attrs.get("seed", 0)), digest=False))
                if key is None:
                    key = reader
                shared[("order",) + reader] = order
            else:
                total += order
            if key is None:
                total += held
            else:
                shared[key] = held
            total += sum(_root_nbytes(graph.blobs[b]) for b in op.outputs)
    return total + sum(shared.values())


def footprint(graphs, plans, rank=0, cuda_graph=True, dispatcher=None, save=0, held=0):
    """The :class:`Footprint` of a rank's ``graphs`` laid out by ``plans``
    (``workspace_plans``): the training workspace, then the test workspace,
    which reuses the training workspace's arena of the host and of each GPU
    (the planned region) when that one holds it; on a GPU
    the scratch, cuBLAS workspaces and capture pools (``device_extras``;
    ``cuda_graph``: the job's). ``dispatcher``: the kind ``train`` is given
    (factory.dispatcher_kind: the serial one runs every kernel on one
    thread, ``host_kernel_bytes``). ``save``: the host bytes a checkpoint
    save adds (``Scheme.save_bytes``), counted where the save holds more
    than an iteration (``Footprint.host_total``). ``held``: host bytes the
    loop's services keep besides the workspaces (``Scheme.held_bytes``),
    counted in the ``kept`` row. The start-up load's bytes (``load``) are
    the caller's to set (tools/plan.load_bytes)."""
    g = graphs.graph
    host, devices = _graph_rows(g, plans.keep, window_blobs(g), plans.host,
                                plans.devices)

    def add(device, row, n):
        rows = host if device < 0 else devices.setdefault(device, {})
        rows[row] = rows.get(row, 0) + n
    arenas = _arenas(plans.host, plans.devices)
    for d, n in arenas.items():
        add(d, "activations", n)
    tg = graphs.test_graph
    if tg is not None:
        th, td = _graph_rows(tg, plans.test_keep, plans.test_skip, plans.test_host,
                             plans.test_devices)
        for row, n in th.items():
            add(-1, row, n)
        for d, rows in td.items():
            for row, n in rows.items():
                add(d, row, n)
        # the test workspace reuses the training one's arena, which is as
        # large as the larger of the two where it has one (``test_room``)
        for d, n in test_room(plans).items():
            if n > arenas.get(d, 0):
                add(d, "activations", n - arenas.get(d, 0))
    if held:
        host["kept"] = host.get("kept", 0) + int(held)
    host["windows"] = window_bytes(graphs.composition, rank) + \
        window_bytes(getattr(graphs, "test_composition", None), rank)
    peers = peer_window_bytes(graphs.composition, rank) + \
        peer_window_bytes(getattr(graphs, "test_composition", None), rank)
    host["data_pool"] = data_pool_bytes([g] + ([tg] if tg is not None else []))
    kernel_bytes = host_kernel_bytes(g, tg, serial=dispatcher_kind(dispatcher) == "serial")
    host["host_scratch"] = kernel_bytes["host_scratch"]
    host["kernel_temporaries"] = kernel_bytes["kernel_temporaries"]
    peak = arena_peak(g, plans.host)
    for d, plan in sorted(plans.devices.items()):
        device_peak = arena_peak(g, plan)
        if device_peak is not None and (peak is None or graphs.device >= 0):
            peak = device_peak
    notes, extras = [], {}
    for d in sorted(devices):
        extra = extras[d] = device_extras(g, d, cuda_graph)
        devices[d].update({k: extra[k] for k in ("scratch", "cublas_workspaces",
                                                  "capture_pools")})
        capped = [n for n, (_, note) in extra["ops"].items() if "cap" in (note or "")]
        if capped:
            notes.append(f"GPU {d}: {len(capped)} cuDNN convolution(s) not in the tuner's "
                         "cache: their workspace counted at the cap gpu.workspace_limit")
    notes.extend(recompute_notes(g, plans))
    return Footprint(rank=rank, device=int(graphs.device), host=host, devices=devices,
                     peak=peak, notes=notes,
                     model_state=model_state_bytes(g, [plans.host, *plans.devices.values()]),
                     extras=extras, save=int(save), held=int(held or 0),
                     peer_windows=int(peers))


def recompute_notes(graph, plans):
    """``plan``'s lines on activation recompute (graph/recompute.py) for a
    graph built with it: what it recomputes and leaves as it is
    (``describe_recompute``), and for each arena of the activations (the
    GPUs' where the graph has planned blobs there, else the host's) whether
    recompute can reach its peak: the activations kept from the forward live there, and
    how many of their bytes the op at the peak reads or writes itself (no
    recompute lowers those: a small CNN's peak in the backward of its first
    layer, its widest gradient beside the mask its pooling keeps)."""
    from ..base.progress_bar import human_bytes
    from ..graph.recompute import describe_recompute, forward_ops
    line = describe_recompute(graph)
    if line is None:
        return []
    notes = [f"recompute {line}"]
    forward = forward_ops(graph)
    # the arenas that hold the activations: the GPUs' where the graph has any
    arenas = [p for p in plans.devices.values() if p is not None and p.offsets] or \
        [plans.host]
    for plan in arenas:
        if plan is None or not plan.offsets:
            continue
        peak = arena_peak(graph, plan)
        at, op = peak["position"], graph.ops[peak["op"]]
        touched = {graph.storage_root(b) for b in op.inputs + op.outputs}
        kept = here = 0
        for u, (a, b) in live_spans(plan).items():
            if a <= at <= b and plan.order[a] in forward and \
                    plan.order[at] not in forward and graph.blobs[u].kind != "grad":
                kept += plan.sizes[u]
                here += plan.sizes[u] if u in touched else 0
        if plan.order[at] in forward:
            why = "in the forward: recompute does not shorten what the forward holds"
        elif kept == here:
            why = ("recompute cannot lower this peak: " + (
                f"the activations kept from the forward there ({human_bytes(kept)}) are all "
                "read by that op itself" if kept else "no activation kept from the forward "
                "lives there"))
        else:
            why = (f"{human_bytes(kept - here)} of activations kept from the forward live "
                   "there besides what that op reads" + (
                       "" if graph.recompute.get("setting") != "full" or not
                       graph.recompute.get("no_gain") else
                       " (full recompute cuts a net without residual adds into units of "
                       "one layer, and a layer's unit cannot drop what the next layer reads)"))
        notes.append(f"recompute and the {peak['where']} peak (op '{peak['op']}', "
                     f"{human_bytes(peak['live_bytes'])} live): {why}")
    return notes


#: the rows of the model state (ZeRO's sense: what a sharding scheme divides)
MODEL_STATE_ROWS = ("weights", "gradients", "optimizer_state")


def model_state_roots(graph, working=False):
    """{storage root: row} of the model state ``graph`` holds on its rank
    (``model_state_bytes``' rows); with ``working`` also the full buckets a
    ZeRO stage makes transient (WORKING_SET_ATTR: stage 2's gradient
    buckets before their reduce-scatter, stage 3's gathered weights: the
    forward's buffer and the backward's ``<weights>.bwd``), each in the row
    its attribute names. (Before 2026-11-30 a root was placed by its kinds
    alone, and stage 3's backward buffers, of kind ``param_gathered``, were
    in no row: gpt_tiny on 2 ranks left 1.7 MB of gathered weights out of
    the working set.)"""
    update, _ = _reads(graph)
    out = {}
    for root, names in _groups(graph).items():
        blob = graph.blobs[root]
        if blob.shape is None:
            continue
        marks = [graph.blobs[n].attrs[WORKING_SET_ATTR] for n in names
                 if WORKING_SET_ATTR in graph.blobs[n].attrs]
        transient = bool(marks)
        if transient and not working:
            continue
        kinds, read = {graph.blobs[n].kind for n in names}, update.intersection(names)
        if transient and marks[0] in MODEL_STATE_ROWS:
            out[root] = marks[0]
        elif kinds & {"param", "param_buffer", "param_copy"}:
            out[root] = "weights"
        elif "bucket" in kinds or ("grad" in kinds and (read or transient)):
            out[root] = "gradients"
        elif "state" in kinds and read:
            out[root] = "optimizer_state"
    return out


def held_nbytes(blob):
    """The bytes of root ``blob`` its rank holds: a shared window's region
    that says ``attrs['window_held']`` (stage 3's weights on one node,
    parallel/zero3_windows.py: the whole region on its owner, 0 on the
    ranks that read it in place), else the whole blob."""
    held = blob.attrs.get("window_held")
    return _root_nbytes(blob) if held is None else int(held)


def model_state_bytes(graph, plan=None):
    """{row: bytes} of the model state ``graph`` holds on its rank, ZeRO's
    sense: the storage roots of the weights (kinds ``param``,
    ``param_buffer``), of the parameters' gradients (buckets, and the
    gradient roots the update ops read: not the activations' gradients) and
    of the optimizer state (what the updates read), each counted whole
    whether or not a memory plan places it in the arena (what the scheme
    makes the rank hold, not when it is live).

    Besides the rows: ``held`` (their sum), ``working`` and ``peak``. The
    working set is the full buckets a ZeRO stage makes transient
    (graph/core.WORKING_SET_ATTR: stage 2's gradient buckets before their
    reduce-scatter, stage 3's gathered weights, the forward's and the
    backward's buffers): with ``plan`` (the rank's memory plans: a
    MemoryPlan, or a list of them, the host's and each GPU's, None where
    there is none) the most of their bytes that can be live at once in any
    order the graph allows (``coexisting_bytes``: the dispatcher runs a
    bucket's reduce-scatter or a prefetched gather beside the compute, so
    a run holds more of them at once than the plan's one schedule shows);
    without one (``memory_plan: false``), or for such a blob no plan
    places, the bytes of every one (each then has memory of its own).
    ``peak`` is ``held + working``. (Before 2026-11-30 ``plan`` and
    ``train``'s start-up check passed no plan, so their ``working`` summed
    every full bucket, and the backward's gathered buffers were left out:
    gpt_small on 2 ranks at stage 3 86.8 MB for the 16.8 MB that can be
    live at once.)"""
    plans = [plan] if plan is None or hasattr(plan, "lifetimes") else list(plan)
    plans = [p for p in plans if p is not None]
    out = dict.fromkeys(MODEL_STATE_ROWS, 0)
    held = model_state_roots(graph)
    for root, row in held.items():
        out[row] += held_nbytes(graph.blobs[root])
    placed, working = {}, 0  # {id(plan): the transient roots it places}
    for root in model_state_roots(graph, working=True):
        if root in held:
            continue
        where = next((i for i, p in enumerate(plans) if root in p.lifetimes), None)
        if where is None:
            working += _root_nbytes(graph.blobs[root])
        else:
            placed.setdefault(where, []).append(root)
    for roots in placed.values():
        working += coexisting_bytes(graph, roots)
    out["held"] = sum(out[row] for row in MODEL_STATE_ROWS)
    out["working"] = working
    out["peak"] = out["held"] + out["working"]
    return out


def coexisting_bytes(graph, roots):
    """The most bytes of the storage ``roots`` that can be live at once in
    any order ``graph``'s dependencies (its control edges, a memory plan's
    included) allow: the heaviest set of roots no two of which are ordered
    apart, root A before root B when every op that reads or writes A is an
    ancestor of every op that writes B (a bound: roots pairwise unordered
    may still never all be live together). The dispatcher runs the
    communication ops beside the compute, so the run's order is not the
    memory plan's schedule: gpt_tiny at stage 3 on 2 ranks (batch 8) had
    1.32 MB of full buckets live at once in a traced run where the plan's
    schedule has at most 1.06 MB, and this bound says 1.52 MB
    (tests/test_plan_zero3.py).

    "Before" is a partial order (A before B before C: every op touching A
    is an ancestor of B's writers, which touch B, so of C's writers), and
    the heaviest set of unordered roots is its heaviest antichain: the
    total bytes less a maximum flow (``_heaviest_antichain``), polynomial.
    (Before 2026-11-30 a branch-and-bound search for the heaviest clique
    of unordered pairs, exponential in the worst case: buffers in 3 chains
    took 1.05 s at 150, 11.1 s at 300, 179 s at 600 (2,100 not run to its
    end); now 2,100 take about half a second, benchmarks/
    coexisting_speed.py, tests/test_coexisting.py.)"""
    roots = list(dict.fromkeys(roots))
    if len(roots) < 2:
        return sum(_root_nbytes(graph.blobs[r]) for r in roots)
    size = [_root_nbytes(graph.blobs[r]) for r in roots]
    return _heaviest_antichain(size, _before_matrix(graph, roots))


def _before_matrix(graph, roots):
    """The order ``coexisting_bytes`` takes among ``roots`` (a list without
    repeats): a bool matrix, [a, b] True where root ``roots[a]`` comes
    before ``roots[b]``: ``roots[b]`` has a writer, and every op that
    reads or writes ``roots[a]`` is an ancestor of each of them (in
    ``graph.dependencies()``). Each op's descendants among the roots'
    writers as a bit set (one pass in reverse topological order); a root's
    ``after``: the writers that come after every op touching it."""
    deps = graph.dependencies()
    order = [op.name for op in graph.topo_order(deps)]
    root_of, wanted = {}, set(roots)
    for root, names in _groups(graph).items():
        if root in wanted:
            root_of.update(dict.fromkeys(names, root))
    index = {r: i for i, r in enumerate(roots)}
    touched, writers = [set() for _ in roots], [set() for _ in roots]
    for op in graph.ops.values():
        for r in {root_of[b] for b in op.outputs if b in root_of}:
            writers[index[r]].add(op.name)
            touched[index[r]].add(op.name)
        for r in {root_of[b] for b in op.inputs if b in root_of}:
            touched[index[r]].add(op.name)
    wpos = {w: j for j, w in enumerate(sorted(set().union(*writers)))}
    below = {n: [] for n in order}  # each op's direct successors
    for n in order:
        for p in deps[n]:
            below[p].append(n)
    desc = {}  # op: bits of the writers (``wpos``) strictly after it
    for n in reversed(order):
        d = 0
        for s in below[n]:
            d |= desc[s]
            if s in wpos:
                d |= 1 << wpos[s]
        desc[n] = d
    full = (1 << len(wpos)) - 1
    n_roots, n_w = len(roots), max(len(wpos), 1)
    after = np.zeros((n_roots, (n_w + 7) // 8), dtype=np.uint8)
    for a, ops in enumerate(touched):
        d = full
        for t in ops:
            d &= desc[t]
        after[a] = np.frombuffer(d.to_bytes(after.shape[1], "little"), dtype=np.uint8)
    after = np.unpackbits(after, axis=1, count=n_w, bitorder="little").astype(bool)
    before = np.zeros((n_roots, n_roots), dtype=bool)
    for b, ws in enumerate(writers):
        if ws:
            before[:, b] = after[:, [wpos[w] for w in ws]].all(axis=1)
    return before


def _heaviest_antichain(size, before):
    """The most total ``size`` (a list of ints) of a set of elements no two
    of which are ordered by ``before`` (a bool matrix, [a, b]: a before b;
    a strict partial order: transitive, never [a, a]). By Dilworth's
    theorem in its weighted form, the total less a maximum flow: from a
    source into each element's "out" node (capacity its size), along the
    order's covering pairs from an element's "out" node into the next
    one's "in" node, from each "in" node through its own "out" node
    (unbounded: a chain passes an element on) and into the sink (capacity
    its size). A flow path from a's out node to b's in node pairs a with
    an element b after it, in one chain; the pairs' total is the most the
    chains' cover saves (each element covered ``size`` times), which the
    heaviest antichain's weight equals."""
    n = len(size)
    # the elements in an order that extends ``before`` (more predecessors
    # later: each comes after fewer than what it precedes), its rows as bits
    perm = np.argsort(before.sum(axis=0), kind="stable")
    before = before[np.ix_(perm, perm)]
    size = [size[i] for i in perm]
    packed = np.packbits(before, axis=1, bitorder="little")
    succ = [int.from_bytes(row.tobytes(), "little") for row in packed]
    total = sum(size)
    inf = total + 1
    src, sink = 2 * n, 2 * n + 1
    edges = []  # (from, to, capacity); element v: out node 2v, in node 2v + 1
    for v in range(n):
        edges.append((src, 2 * v, size[v]))
        edges.append((2 * v + 1, 2 * v, inf))
        edges.append((2 * v + 1, sink, size[v]))
        rest = succ[v]
        while rest:  # the covers of v: the least left of what follows it
            u = (rest & -rest).bit_length() - 1
            edges.append((2 * v, 2 * u + 1, inf))
            rest &= ~succ[u] & ~(1 << u)
    return total - _max_flow(2 * n + 2, edges, src, sink)


def _max_flow(n_nodes, edges, src, sink):
    """The maximum flow from ``src`` to ``sink`` over ``edges`` ((from, to,
    capacity) of nodes 0 .. n_nodes - 1): Dinic's algorithm, its searches
    with explicit stacks (a path may pass thousands of nodes)."""
    head = [[] for _ in range(n_nodes)]
    to, cap = [], []
    for u, v, c in edges:
        head[u].append(len(to))
        to.append(v)
        cap.append(c)
        head[v].append(len(to))
        to.append(u)
        cap.append(0)
    flow = 0
    while True:
        level = [-1] * n_nodes
        level[src] = 0
        queue = [src]
        for u in queue:
            for e in head[u]:
                if cap[e] and level[to[e]] < 0:
                    level[to[e]] = level[u] + 1
                    queue.append(to[e])
        if level[sink] < 0:
            return flow
        nxt = [0] * n_nodes
        path, u = [], src  # path: the edges from src to u
        while True:
            if u == sink:
                f = min(cap[e] for e in path)
                flow += f
                cut = None
                for i, e in enumerate(path):
                    cap[e] -= f
                    cap[e ^ 1] += f
                    if cut is None and not cap[e]:
                        cut = i
                del path[cut:]  # back to the tail of the first edge it saturated
                u = to[path[-1]] if path else src
                continue
            adj, i = head[u], nxt[u]
            while i < len(adj) and not (cap[adj[i]] and level[to[adj[i]]] == level[u] + 1):
                i += 1
            nxt[u] = i
            if i < len(adj):
                path.append(adj[i])
                u = to[adj[i]]
            elif u == src:
                break
            else:  # a dead end: no path to the sink through u this phase
                level[u] = -1
                path.pop()
                u = to[path[-1]] if path else src


def model_state_peak(graph, plans):
    """The most model-state bytes live at once on the rank, and where:
    {row: bytes, "total": bytes, "op": the op where they peak (None when no
    model-state root is planned)}. A root with its own memory (not in any
    of ``plans``, the rank's memory plans: MemoryPlan or None each) counts
    all the time; one a plan places in its arena (a gradient written and
    read in one iteration; gathered weights freed after their last reader)
    only from its first to its last op in that plan's schedule. Several
    plans (the host's, each GPU's) add their own peaks."""
    rows = model_state_roots(graph, working=True)
    out = dict.fromkeys(MODEL_STATE_ROWS, 0)
    planned = {}
    for plan in plans:
        if plan is not None:
            for root in plan.offsets:
                planned[root] = plan
    for root, row in rows.items():
        if root not in planned:
            out[row] += _root_nbytes(graph.blobs[root])
    op = None
    for plan in {id(p): p for p in planned.values()}.values():
        diff = [[0] * len(MODEL_STATE_ROWS) for _ in range(len(plan.order) + 1)]
        for root, row in rows.items():
            if planned.get(root) is not plan or root not in plan.lifetimes:
                continue
            base = root
            while base in plan.in_place:  # computed over another root: its bytes
                base = plan.in_place[base][0]
            a, b = plan.lifetimes[root]
            i = MODEL_STATE_ROWS.index(row)
            diff[a][i] += plan.sizes[base]
            diff[b + 1][i] -= plan.sizes[base]
        live, best, at = [0] * len(MODEL_STATE_ROWS), None, None
        for pos, d in enumerate(diff[:-1]):
            live = [x + y for x, y in zip(live, d)]
            if best is None or sum(live) > sum(best):
                best, at = list(live), pos
        if best is not None and sum(best) > 0:
            for row, n in zip(MODEL_STATE_ROWS, best):
                out[row] += n
            op = plan.order[at]
    out["total"] = sum(out[row] for row in MODEL_STATE_ROWS)
    out["op"] = op
    return out


def _stand_in(blob):
    """An array of the blob's shape and dtype holding no memory (what
    ``OpKernel.scratch_specs`` reads: shape, dtype, size, ndim)."""
    return np.broadcast_to(np.zeros((), dtype=blob.dtype), tuple(blob.shape))


def _frozen(value):
    """``value`` (an op's attrs) as a hashable value that tells apart what
    differs, types included (1, 1.0 and True are equal keys in a dict);
    TypeError where a part is neither a container nor hashable."""
    if isinstance(value, dict):
        return ("dict", tuple((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(_frozen(v) for v in value))
    hash(value)
    return (type(value).__name__, value)


def _kernel_key(graph, op):
    """What a host kernel's ``host_scratch`` and ``host_temporaries`` are
    computed from (its op's type, attrs, accumulate flag, location and the
    shapes and dtypes of its blobs: ``_stand_in``'s), or None where the
    attrs cannot be a key (then asked of the kernel itself)."""
    try:
        attrs = _frozen(op.attrs)
    except TypeError:
        return None
    return (op.op_type, attrs, op.accumulate, op.location,
            tuple((tuple(graph.blobs[b].shape), graph.blobs[b].dtype) for b in op.inputs),
            tuple((tuple(graph.blobs[b].shape), graph.blobs[b].dtype) for b in op.outputs))


def host_kernel_bytes(graph, test_graph=None, serial=False):
    """What the CPU kernels of ``graph``'s host ops (and ``test_graph``'s)
    hold besides the blobs (the module docstring's ``host_scratch`` and
    ``kernel_temporaries``): {"host_scratch": bytes, "kernel_temporaries":
    bytes, "temporaries_ops": {lane: the op whose temporaries are the
    lane's largest}}. The test graph runs under a dispatcher of its own:
    the event dispatcher's worker threads are its own too, so its kernels'
    buffers are held beside the training graph's (lanes "test THREAD");
    with the serial dispatcher (``serial``) every op of both runs on the
    calling thread (lane "main") and shares its caches. The temporaries
    are the larger graph's: the two never run at once."""
    from ..ops.catalog import get_kernel_class
    from ..ops.registry import specs_nbytes
    from ..ops.im2col import held_by
    from .cuda_runtime import op_device
    from .executors import INLINE_LANE
    holds, by_graph, shared = {}, [], []
    # ops alike (a micro-batch's copies of one op: the same type, attrs
    # and input and output shapes) hold alike: asked of their kernel once
    alike = {}
    for prefix, g in (("", graph), ("test ", test_graph)):
        if g is None:
            continue
        temps = {}
        for op in g.ops.values():
            if op_device(g, op) >= 0 or any(g.blobs[b].shape is None
                                            for b in op.inputs + op.outputs):
                continue
            key = _kernel_key(g, op)
            got = None if key is None else alike.get(key)
            if got is None:
                k = get_kernel_class(op.op_type, op.name)(op)
                ins = [_stand_in(g.blobs[b]) for b in op.inputs]
                outs = [_stand_in(g.blobs[b]) for b in op.outputs]
                got = (k.host_scratch(ins, outs), specs_nbytes(k.host_temporaries(ins, outs)))
                if key is not None:
                    alike[key] = got
            lane = INLINE_LANE if serial else f"{prefix}{op.thread}"
            for h in got[0]:   # a shared Hold: once in the process
                (shared if h.shared else holds.setdefault(lane, [])).append(h)
            t = got[1]
            if t > temps.get(lane, (0, None))[0]:
                temps[lane] = (t, op.name)
        by_graph.append(temps)
    temps = max(by_graph, key=lambda t: sum(n for n, _ in t.values()), default={})
    return {"host_scratch": sum(held_by(h) for h in holds.values()) + held_by(shared),
            "kernel_temporaries": sum(t for t, _ in temps.values()),
            "temporaries_ops": {lane: name for lane, (_, name) in temps.items()}}


def device_extras(graph, device, cuda_graph=True):
    """What GPU ``device`` holds beyond the blobs, planned before anything
    is allocated: {"scratch": bytes of the scratch slots, "slots": [(bytes,
    [ops])], "ops": {op: (its scratch bytes, where the size comes from)},
    "cublas_workspaces": bytes, "cublas_handles": [(stream, scope)],
    "products": [ops that call cuBLAS],
    "segments": [(name, [ops])] (every device's CUDA graphs), "streams": {op:
    (device, thread)} (``stream_keys``),
    "capture_pools": bytes} (see the module docstring)."""
    from ..gpu.blas import workspace_bytes
    from ..gpu.scratch import Scratch
    from .cuda_graph import planned_lanes
    from .cuda_runtime import stream_keys
    from .workspace import ancestors_in, scratch_plan
    deps = graph.dependencies()
    kernels, lanes, segments = planned_lanes(graph, cuda_graph, deps)
    needs, ops, products = {}, {}, set()
    for name in [op.name for op in graph.topo_order(deps)]:
        k = kernels.get(name)
        if k is None or lanes.get(name, (None,))[0] != device:
            continue
        op = graph.ops[name]
        ins = [_stand_in(graph.blobs[b]) for b in op.inputs]
        outs = [_stand_in(graph.blobs[b]) for b in op.outputs]
        specs = k.scratch_specs(ins, outs)
        if specs:
            needs[name] = Scratch._layout(specs)[1]
            ops[name] = (needs[name], k.scratch_note(ins, outs))
        if k.runs_products(ins, outs):
            products.add(name)
    cache = {}
    slots = scratch_plan(needs, lanes, lambda n: ancestors_in(deps, cache, n))
    streams = stream_keys(graph)
    handles = cublas_handles(streams, segments, products, device)
    return {"scratch": sum(b for b, _ in slots), "slots": slots, "ops": ops,
            "cublas_workspaces": len(handles) * workspace_bytes(),
            "cublas_handles": handles, "products": sorted(products), "segments": segments,
            "streams": streams, "capture_pools": 0}


def cublas_handles(streams, segments, products, device):
    """The (stream, scope) of each cuBLAS handle gpu/blas makes on
    ``device``: ``streams`` {op: (device, thread)} (``stream_keys``),
    ``segments`` [(name, [ops])] of its CUDA graphs, ``products`` the ops
    that call cuBLAS. The first iteration runs every op eagerly on its
    stream (scope None: one handle per stream with products); each
    segment's capture then reserves one capture stream per stream of its
    ops that run products (not its origin, which runs none, nor a stream of
    copies alone), in the scope of its replay stream."""
    from .cuda_graph import CAPTURE_STREAM
    handles = sorted({(streams[n], None) for n in products if streams[n][0] == device},
                     key=str)
    for name, members in segments:
        if not members or streams[members[0]][0] != device:
            continue
        scope = (device, name)
        for thread in dict.fromkeys(streams[n][1] for n in members if n in products):
            handles.append(((device, f"{CAPTURE_STREAM}:{thread}"), scope))
    return handles
