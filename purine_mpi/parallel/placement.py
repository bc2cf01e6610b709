"""Put a graph on a GPU: set every op's and blob's location device.

``place_on_device(graph, device)`` rewrites a (rank-local, composed) graph in
place so that it runs on GPU ``device``:

- every op and blob moves to the device, except the ``iter`` scalar blob,
  which the trainer writes every iteration. The data reader (``DataReader``)
  goes onto the device's copy thread ``"h2d"`` with device outputs: its
  prefetch thread stages each batch in one of two page-locked buffers and
  the op only queues the asynchronous copy from the ready one
  (``ops/data.py``);
- an edge from a host blob to a device op becomes a ``Copy`` op on the copy
  thread ``"h2d"`` (its own CUDA stream) into a device twin ``<blob>@gpu<d>``,
  and the host blob is marked ``pinned`` so the workspace page-locks it and
  the copy runs asynchronously; a device blob read by a host op gets a
  ``"d2h"`` copy the same way;
- the iteration is not copied: its device twin ``iter@gpu<d>`` is written by
  an ``IterationCounter`` op (``ops/iteration.py``) from a counter that
  stays on the device and moves on by one each iteration, so the iteration
  holds no host-to-device copy (a CUDA graph cannot capture one through
  CuPy). From it the learning-rate op evaluates the lr policy, the dropout
  ops key their masks and the Adam/AdamW updates take their bias-correction
  step (cuda/adam.cu reads it), on the device: a whole iteration, the
  updates included, is one captured graph.

The workspace then allocates the device blobs as CuPy arrays and
``make_dispatcher`` picks the CUDA-stream dispatcher. ``configure_device``
does all of it from the job (keys ``device``, ``backend``, ``tf32``), for
the trainer::

    device = configure_device(job, train_graph)        # -1: CPU, nothing changed
    ...
    place_on_device(test_graph, device)                   # same GPU for evaluation
"""
import dataclasses
import os

from ..base.errors import ConfigError

#: op types that run on the host whatever the device
HOST_OP_TYPES = ("LossScaleUpdate", "AdamStep")  # fp16's decisions (ops/loss_scale.py)
#: op types that go onto the copy thread (they stage and copy host data themselves)
STAGING_OP_TYPES = ("DataReader",)
#: blob kinds that stay host scalars (the trainer writes them directly)
HOST_BLOB_KINDS = ("iter",)
#: threads (streams) of the inserted copies
H2D_THREAD, D2H_THREAD = "h2d", "d2h"

#: environment variables that hold a process's rank on its node
LOCAL_RANK_VARS = ("PURINE_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                   "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


def _on(location, device):
    return dataclasses.replace(location, device=int(device))


def place_on_device(graph, device, copy_thread=H2D_THREAD):
    """Place ``graph`` on GPU ``device`` in place (see the module docstring)
    and return it; ``device < 0`` leaves it unchanged. Returns the graph."""
    device = int(device)
    if device < 0:
        return graph
    host_ops = {n for n, op in graph.ops.items() if op.op_type in HOST_OP_TYPES}
    host_blobs = {b for n in host_ops for b in graph.ops[n].outputs}
    host_blobs |= {n for n, b in graph.blobs.items() if b.kind in HOST_BLOB_KINDS}
    # a host op's inputs that nothing produces (e.g. ``iter``) stay with it
    producers = graph.producers()
    host_blobs |= {b for n in host_ops for b in graph.ops[n].inputs if not producers.get(b)}
    for name, op in graph.ops.items():
        if name not in host_ops:
            op.location = _on(op.location, device)
            if op.op_type in STAGING_OP_TYPES:
                op.thread = copy_thread
    for name, blob in graph.blobs.items():
        if name not in host_blobs:
            blob.location = _on(blob.location, device)
    # an alias lives where its storage lives
    for name, blob in graph.blobs.items():
        if blob.alias_of is not None:
            blob.location = graph.blobs[graph.storage_root(name)].location

    copies = {}  # (blob, direction) -> twin blob name
    for name in list(graph.ops):
        op = graph.ops[name]
        op_dev = op.location.device
        for i, b in enumerate(op.inputs):
            blob_dev = graph.blobs[b].location.device
            if (blob_dev >= 0) == (op_dev >= 0):
                continue
            if op_dev >= 0:  # host blob -> device op
                op.inputs[i] = _twin(graph, copies, b, device, "h2d", copy_thread)
            else:  # device blob -> host op
                op.inputs[i] = _twin(graph, copies, b, device, "d2h", D2H_THREAD)
    graph.infer_shapes()
    return graph


def _twin(graph, copies, name, device, direction, thread):
    """The copy of blob ``name`` on the other side, made once per blob."""
    key = (name, direction)
    if key in copies:
        return copies[key]
    src = graph.blobs[name]
    if direction == "h2d" and src.kind in HOST_BLOB_KINDS:
        copies[key] = _iteration_counter(graph, name, device, thread)
        return copies[key]
    suffix = f"@gpu{device}" if direction == "h2d" else "@host"
    twin = graph.free_name(name + suffix)
    location = _on(src.location, device if direction == "h2d" else -1)
    graph.add_blob(twin, src.shape, src.dtype, location, kind="data",
                   attrs={"copy_of": name})
    # the host side of a copy is page-locked, so the copy is asynchronous
    (src if direction == "h2d" else graph.blobs[twin]).attrs["pinned"] = True
    graph.add_op(graph.free_name(f"{name}.{direction}"), "Copy", [name], [twin],
                 location=_on(src.location, device), thread=thread)
    copies[key] = twin
    return twin


def _iteration_counter(graph, name, device, thread):
    """The device twin of the host iteration blob ``name``: written by an
    ``IterationCounter`` op (ops/iteration.py) from a device counter, not
    copied from the host every iteration. Returns the twin's name."""
    src = graph.blobs[name]
    twin = graph.free_name(f"{name}@gpu{device}")
    counter = graph.free_name(f"{name}.counter@gpu{device}")
    location = _on(src.location, device)
    graph.add_blob(twin, src.shape, src.dtype, location, kind="data",
                   attrs={"copy_of": name})
    graph.add_blob(counter, src.shape, src.dtype, location, kind="state")
    graph.add_op(graph.free_name(f"{name}.count"), "IterationCounter", [], [twin, counter],
                 location=location, thread=thread)
    return twin


def graph_devices(graph):
    """The GPU devices a graph's ops and blobs are placed on (sorted)."""
    devices = {op.location.device for op in graph.ops.values()}
    devices |= {b.location.device for b in graph.blobs.values()}
    return sorted(d for d in devices if d is not None and d >= 0)


def local_rank():
    """This process's rank among the ranks of its node (0 when unknown)."""
    for var in LOCAL_RANK_VARS:
        value = os.environ.get(var)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


def asks_for_gpu(job):
    """Whether ``job`` runs on GPUs (keys ``device`` >= 0, or ``backend:
    cupy``): what ``select_device`` decides before it looks at the machine,
    for what is composed before placement (parallel.transport's windows)."""
    return job.device >= 0 or (job.backend or "auto") == "cupy"


def select_device(job, rank_on_node=None):
    """The GPU this rank uses from a job (job/job.py), or -1
    for the CPU.

    ``device: D`` (>= 0) asks for GPUs; a rank uses ``D + its rank on the
    node``, modulo the node's GPU count, so several ranks per node spread
    over the GPUs. ``backend: cupy`` without a device means device 0;
    ``backend: numpy`` with a device is a contradiction."""
    path, device, backend = job.path, job.device, job.backend or "auto"
    if backend == "numpy":
        if device >= 0:
            raise ConfigError(path, "device", f"device {device} asks for a GPU but "
                              "'backend: numpy' runs on the CPU; set device: -1 or backend: cupy")
        return -1
    if backend == "cupy" and device < 0:
        device = 0
    if device < 0:
        return -1
    from ..base.backend import cupy_available
    if not cupy_available():
        raise ConfigError(path, "device", f"device {device} asks for a GPU, but CuPy with "
                          "a CUDA device is not available here; install purine_mpi[gpu] (a "
                          "cupy-cudaXXx wheel matching the driver) or set device: -1")
    import cupy
    count = cupy.cuda.runtime.getDeviceCount()
    rank_on_node = local_rank() if rank_on_node is None else int(rank_on_node)
    return (device + rank_on_node) % count


def configure_device(job, graph, rank_on_node=None, train=True):
    """Select this rank's GPU from ``job``, apply ``tf32`` (``precision``), place
    ``graph`` there and fuse it for the device (``parallel/fuse.py``: ReLUs into
    their producers, the SGD updates into one for a ``train`` graph). Returns
    the device (-1: the CPU, graph unchanged); a UserError when the job asks
    for a GPU this machine does not have."""
    device = select_device(job, rank_on_node)
    if device >= 0:
        from ..gpu import set_tf32
        from ..gpu.cudnn_tune import set_workspace_limit
        set_tf32(job.tf32)
        set_workspace_limit(job.gpu.workspace_limit)
        import cupy
        cupy.cuda.Device(device).use()  # CuPy's default device for this process
        prepare_for_device(graph, device, train=train, precision=job.precision)
    return device


def prepare_for_device(graph, device, train=True, precision="fp32"):
    """``place_on_device``, then (``device >= 0``) the precision pass
    (``parallel/precision.py``: the GEMMs, convolutions and attention in
    bf16/fp16 for such a ``precision``) and the fusions of
    ``parallel/fuse.py`` (the SGD one for a training graph), then, in
    training, the weight casts folded into the Adam updates
    (``precision.fold_weight_casts``). Returns the graph."""
    place_on_device(graph, device)
    if int(device) >= 0:
        from .fuse import fuse_for_device
        from .precision import apply_precision, fold_weight_casts
        redraw_attention_masks(graph)
        redraw_dropout_masks(graph)
        apply_precision(graph, precision)
        fuse_for_device(graph, train=train)
        if train and fold_weight_casts(graph):
            graph.infer_shapes().validate()
    return graph


def redraw_dropout_masks(graph):
    """On a GPU a training ``Dropout`` whose mask only ``DropoutGrad`` reads
    keeps no mask: the forward writes y alone (attr ``redraw_mask``) and
    its gradient becomes ``DropoutRedrawGrad`` [dy, iter], which draws the
    mask again from the forward's Philox stream and iteration in the same
    kernel as the product (ops/dropout.py): the same bits, and no mask of
    x's size and dtype (NIN's drop1 at batch 128: 12.6 MB) held from the
    forward to the backward. A bit-packed mask (activation recompute's) or
    a tensor-parallel shard's is left as it is. Returns the ops changed."""
    from ..ops.dropout import redraw_grad_attrs
    cons = graph.consumers()
    changed = []
    for op in list(graph.ops.values()):
        if op.op_type != "Dropout" or len(op.outputs) != 2 or \
                op.attrs.get("phase", "train") != "train" or \
                op.attrs.get("packed_mask") or op.attrs.get("mask_split"):
            continue
        mask = op.outputs[1]
        readers = cons.get(mask, ())
        if not all(r.op_type == "DropoutGrad" and r.inputs[1:] == [mask] and
                   not r.attrs.get("packed_mask") and r.inputs[0] != mask for r in readers):
            continue
        op.outputs.pop()
        op.attrs["redraw_mask"] = True
        changed.append(op.name)
        for r in readers:
            r.op_type = "DropoutRedrawGrad"
            r.inputs = [r.inputs[0], op.inputs[1]]
            r.attrs = redraw_grad_attrs(op)
            changed.append(r.name)
        del graph.blobs[mask]
    if changed:
        graph.infer_shapes()
    return changed


def redraw_attention_masks(graph):
    """On a GPU the fused ``Attention`` ops with dropout keep no mask: drop
    each one's bit-packed mask output (attr ``packed_mask``, the host path:
    ops/attention.py) and its readers' input (``AttentionGrad``, and a
    recompute copy, attr ``replay_mask``), so the gradient (and the copy)
    redraws the mask from the same Philox stream and iteration (one device
    kernel; no (N, H, T, T)/8 bytes kept from the forward to the backward).
    Returns the names of the ops changed."""
    cons = graph.consumers()
    changed = []
    for op in list(graph.ops.values()):
        if op.op_type != "Attention" or not op.attrs.pop("packed_mask", False):
            continue
        bits = op.outputs.pop()
        changed.append(op.name)
        for reader in cons.get(bits, ()):
            reader.inputs = [b for b in reader.inputs if b != bits]
            reader.attrs.pop("packed_mask", None)
            reader.attrs.pop("replay_mask", None)
            changed.append(reader.name)
        del graph.blobs[bits]
    if changed:
        graph.infer_shapes()
    return changed


#: the blob (and op) of the loss watch (ops/watch.py) in a GPU training graph
LOSS_WATCH = "loss_watch"


def add_loss_watch(graph, losses, shares, device):
    """Add the ``LossWatch`` op (``purine_mpi/ops/watch.py``) to a training
    graph placed on GPU ``device``: it reads ``losses`` (with their
    ``shares``) and the device iteration blob and keeps the display window's
    loss sum and the first non-finite iteration on the device, so the
    trainer reads the loss back only at its intervals. It runs on the stream
    of the first loss's producer. Returns the watch blob's name."""
    iter_dev = next((n for n, b in graph.blobs.items() if b.attrs.get("copy_of") == "iter"
                     and b.location.device == int(device)), None)
    if iter_dev is None:
        iter_dev = _twin(graph, {}, "iter", device, "h2d", H2D_THREAD)
    producer = graph.producers().get(losses[0]) or []
    thread = producer[0].thread if producer else 0
    where = dataclasses.replace(graph.blobs[losses[0]].location, device=int(device))
    name = graph.free_name(LOSS_WATCH)
    graph.add_blob(name, (2,), "float64", where, kind="state")
    graph.add_op(name, "LossWatch", list(losses) + [iter_dev], [name],
                 {"shares": [float(s) for s in shares]}, location=where, thread=thread)
    graph.infer_shapes()
    return name
