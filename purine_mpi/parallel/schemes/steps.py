"""The steps the schemes compose with (parallel/schemes/): micro-batch
copies and their accumulation, a staged scheme's slice of the graph, the
hybrid's allreduce of each stage, fp16's loss scaling and gradient clipping
on the reduced gradients. Each returns or completes a ``Composition`` (base.py)."""
import numpy as np

from ...base.errors import ConfigError
from ..micro_batch import add_schedule, replicate_micro_batches
from .base import Composition, scheme_of


def _layout(job, world):
    return scheme_of(job).layout(job, world)


def micro_copies(graph, grads, job, in_place=False):
    """The micro-batch copies of ``graph`` (parallel.micro_batches), or None;
    ``in_place``: the running sums add into the gradients the update reads
    (micro_batch.replicate_micro_batches)."""
    micro = job.parallel.micro_batches
    return replicate_micro_batches(graph, grads, micro, in_place=in_place) \
        if micro > 1 else None


def split_before_copies(graph, grads, job):
    """With micro-batches and ``parallel.split_params``: each large fully
    connected weight split into row chunks (data_parallel.split_large_params,
    the chunks one batch gets from compose_data_parallel: the same cap,
    from the same gradients) before the micro-batch copies are made, so
    each copy's gradient op writes row chunks and each chunk is summed over
    the copies, reduced and updated on its own. Split after the copies, the
    gradient is written by its last running sum, not by the weight-gradient
    op the split needs: the whole gradient went to one bucket, its
    allreduce could not start chunk by chunk and its update made a
    whole-gradient temporary. The sums add the same elements in the same
    order, so the results are those of the whole gradient where each
    chunk's product gives the whole product's rows bit for bit: on the
    host, where ops/hostgemm.py cuts the whole product along its rows (the
    chunks then end where its pieces do and run its calls) or not at all
    (``_row_bounds``; a cut along the inner size would add other partial
    sums); a weight where it would not stays whole, and so does every
    weight on a GPU (cuBLAS picks its algorithm by the shapes: not
    checked). Returns the ``{param: grad}`` map (a chunk's key is
    ``p[a:b]``)."""
    par = job.parallel
    from ..placement import asks_for_gpu
    if par.micro_batches == 1 or not par.split_params or asks_for_gpu(job):
        return grads
    from ..data_parallel import bucket_cap, split_large_params
    cap = bucket_cap(graph, grads, par.bucket_mb, par.min_buckets)
    return split_large_params(graph, grads, cap,
                              accept=lambda op, bounds: _row_bounds(graph, op, bounds))


def split_stages_before_copies(graph, grads, job):
    """``split_before_copies`` for scheme hybrid: each stage's gradients
    apart, at the cap of that stage's own (``allreduce_stage`` buckets a
    stage's slice, and splits it at one micro-batch, by the gradients in
    the slice); a parameter goes with its layer's stage
    (``parallel.stages``). With tensor shards the graph is this rank's
    shard already (tensor_parallel.split_for): a split weight's chunks are
    rows of its shard, views of the shard's blob (the checkpoint joins the
    shards from the whole blob as before; the clip's norm counts a chunk by
    its storage root, the shard: tensor_parallel.count_whole_once), its
    weight-gradient op the shard's product (``_row_bounds`` on its shapes)."""
    from ..model_parallel import layer_of
    stage_of = job.stage_map
    groups = {}
    for p, g in grads.items():
        groups.setdefault(stage_of.get(layer_of(p, list(stage_of))), {})[p] = g
    out = {}
    for part in groups.values():
        out.update(split_before_copies(graph, part, job))
    return out


#: the fewest rows of a chunk of a weight whose host product is one BLAS
#: call (``_row_bounds``): fewer rows took other BLAS paths than the same
#: rows of the whole call (1 row: OpenBLAS's matrix-vector product)
CHUNK_MIN_ROWS = 8


def _row_bounds(graph, op, bounds):
    """The row chunks of weight-gradient op ``op`` (dy^T @ x, one
    micro-batch's; ``bounds``: the split's, by the bucket cap) whose host
    products give the whole product's rows bit for bit, or None (the
    weight stays whole):

    - the whole product cut by ops/hostgemm.plan along its rows: the bounds
      moved to the nearest bounds of its pieces, so each chunk's product is
      the whole's BLAS calls for its rows (InnerProductGradWeight's
      ``row_pieces``); None when that leaves one chunk. A chunk's own
      ``plan`` would cut it elsewhere, and a call of a few rows takes another
      BLAS path (OpenBLAS's small-matrix kernels) than the same rows inside
      a larger one: other bits (hostgemm.row_pieces);
    - the whole product not cut (one BLAS call): the bounds as they are
      (each chunk's product, smaller, is one call too), where every chunk
      has ``CHUNK_MIN_ROWS`` rows (a 1-row product is a matrix-vector one
      in OpenBLAS: other bits). A float32 gradient of 1 MiB or more (the
      split's least) under ``SPLIT_MIN_WORK`` multiply-adds has an inner
      size under 16; each row is then the same few multiply-adds in the
      whole call and in a chunk's (measured, not by construction:
      tests/test_split_params.py);
    - the whole product cut along its inner size or its columns: None (a
      chunk's cut would add other partial sums, or none)."""
    from ...ops.hostgemm import plan
    shape = graph.blobs[op.inputs[1]].shape
    axis = int(op.attrs.get("axis", 1))
    inner = int(np.prod(shape[:axis], dtype=np.int64))   # the micro-batch's rows
    cols = int(np.prod(shape[axis:], dtype=np.int64))
    rows = bounds[-1]
    cut, pieces = plan(rows, cols, inner)
    if cut != 0:
        return None
    if len(pieces) == 1:
        chunks = list(zip(bounds, bounds[1:]))
        return bounds if all(len(plan(b - a, cols, inner)[1]) == 1 and b - a >= CHUNK_MIN_ROWS
                             for a, b in chunks) else None
    ends = [s.start for s in pieces] + [rows]
    moved = sorted({min(ends, key=lambda e: (abs(e - t), e)) for t in bounds})
    return moved if len(moved) > 2 else None


def accumulate(graph, grads, job, in_place=False):
    """One stage: the micro-batch copies, their gradients accumulated
    (``in_place``: as ``micro_copies``)."""
    copies = micro_copies(graph, grads, job, in_place)
    if copies:
        par = job.parallel
        add_schedule(graph, copies, par.micro_batches, par.schedule, lambda op: 0, 1)


def loss_scaled(comp, job, world, group=None):
    """fp16's dynamic loss scaling (graph/loss_scale.py) on a composition's
    reduced gradients, before clipping; ``group``: the ranks that skip a
    step together (their overflow flags allreduced), None: this rank."""
    if job.precision != "fp16":
        return comp
    from ...base import env
    from ...graph.loss_scale import add_loss_scale
    inject = env.get("PURINE_FP16_INJECT_INF")  # developers, tests: (step, rank or None)
    rank = getattr(world, "rank", 0)
    at = inject[0] - 1 if inject and inject[1] in (None, rank) else None
    comp.graph = add_loss_scale(comp.graph, job.loss_scale, group=group, inject=at).validate()
    return comp


def clipped(comp, job, world):
    """``solver.clip_gradients`` (graph/clip.py) on a composition's reduced
    gradients: over a tensor group, a replica's stages (with tensor shards:
    every rank of the replica, a replicated weight counted on shard 0 of its
    stage's group only), or this rank."""
    clip = job.solver.clip_gradients
    if clip is None:
        return comp
    from ...graph.clip import add_clip
    lay, local = comp.layout, comp.graph
    if lay.tensor > 1 and not lay.staged:
        from ..tensor_parallel import add_tensor_clip
        comp.graph = add_tensor_clip(local, clip, lay).validate()
    elif not lay.staged:
        comp.graph = add_clip(local, clip).validate()
    else:
        # a replica's stages hold its parameters between them: their norms add up
        split = getattr(world, "split_groups", None)
        if split is not None and lay.replicas > 1:
            split([lay.replica_ranks(r) for r in range(lay.replicas)])
        if lay.tensor > 1:
            from ..tensor_parallel import add_tensor_clip
            comp.graph = add_tensor_clip(local, clip, lay, lay.replica_ranks()).validate()
        else:
            comp.graph = add_clip(local, clip, group=lay.replica_ranks()).validate()
    return comp


def compose_stages(graph, job, world, copies=None):
    """This rank's slice of a graph whose layers ``parallel.stages`` places
    on stages ({layer name: stage}); unlisted layers follow their input.
    ``copies``: the micro-batch copies (replicate_micro_batches), ordered on
    each stage by ``parallel.schedule``. The graph is cut by stage; its
    Send/Recv go to the ranks of this rank's replica (``Layout``). Returns
    the Composition."""
    from ..model_parallel import compose_partitioned, layer_of, place_layers
    from ..data_parallel import place_on_rank
    lay = _layout(job, world)
    stages = job.stage_map
    unknown = sorted(set(stages) - set(job.layer_names))
    if unknown:
        raise ConfigError(job.path, "parallel.stages", f"no layer named "
                          f"{', '.join(unknown)} in the net")
    # a phase lacks some layers (accuracy is test-only, dropout masks train-only)
    present = {k: v for k, v in stages.items() if any(layer_of(op, [k]) for op in graph.ops)}
    place_layers(graph, present)
    if copies:
        add_schedule(graph, copies, job.parallel.micro_batches, job.parallel.schedule,
                     lambda op: op.location.rank, lay.stages)
    local = compose_partitioned(graph, size=lay.stages, rank=lay.stage)
    # stage t of this replica is rank replica * p + t (a Send's name ends in
    # its destination rank, ``<blob>.send@r<rank>``)
    renamed = {}
    for op in local.ops.values():
        if op.op_type in ("Send", "Recv"):
            op.attrs["peer"] = lay.rank(lay.replica, int(op.attrs["peer"]))
        if op.op_type == "Send":
            renamed[op.name] = f"{op.name.rsplit('@r', 1)[0]}@r{op.attrs['peer']}"
            op.name = renamed[op.name]
    if renamed:
        local.ops = {op.name: op for op in local.ops.values()}
        for op in local.ops.values():
            op.control_inputs = [renamed.get(c, c) for c in op.control_inputs]
    for blob in local.blobs.values():
        if "received_from" in blob.attrs:
            blob.attrs["received_from"] = lay.rank(lay.replica, blob.attrs["received_from"])
    place_on_rank(local, world.rank)
    from ..one_sided import to_windows  # parallel.transport: Put/WaitWrite into windows
    windows, transport, placed = to_windows(local, job, world)
    return Composition(local, lay, transport=transport, windows=windows, window_placement=placed)


def allreduce_stage(comp, grads, par, world):
    """Hybrid: sum this stage's gradient buckets over the replicas that hold
    the same stage (and with tensor shards the same shard: ranks
    ``lay.stage_ranks()``, one sub-communicator per position made at
    start-up, ``lay.shard_groups()``), in bfloat16 with ``parallel.grad_dtype: bf16``; ``seq``
    numbers follow the slice's Send/Recv, the same on every rank of the
    stage."""
    from ..data_parallel import compose_data_parallel, place_on_rank
    local, lay = comp.graph, comp.layout
    group = lay.stage_ranks()
    plan = compose_data_parallel(local, grads, lay.replicas, lay.replica,
                                 check_collectives=False, wire_dtype=par.wire_dtype(),
                                 **par.bucket_settings())
    place_on_rank(local, world.rank)
    for b in plan:
        local.ops[b["op"]].attrs["group"] = list(group)
        b["group"] = list(group)
    comp.bucket_plan = plan
    local.infer_shapes().validate()
    split = getattr(world, "split_groups", None)
    if split is not None:  # a live MPI world (graph --np composes offline)
        split(lay.shard_groups())
    if par.check_collectives:
        from ...comm.verify import check_collectives
        check_collectives(local, world)
    return comp
