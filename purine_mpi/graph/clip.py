"""Gradient clipping as graph (``solver.clip_gradients``): a pass over a
rank's composed training graph, after the gradients are reduced.

    updates u_1 .. u_n read gradients g_i with grad_scale s_i
    clip.norm   GradNormSq [g_i: lr_mult_i > 0] -> clip.sumsq = sum_i s_i^2 ||g_i||^2
    clip.sum    Allreduce  clip.sumsq -> clip.sumsq.all      (``group`` only)
    g_i.clip    ClipScale  [g_i, sumsq] -> g_i@clip          (alias of g_i)
    u_i         reads g_i@clip instead of g_i

So the norm is that of the gradients the updates apply (averaged over the
data-parallel ranks and the micro-batches, before weight decay), as Caffe's
``ClipGradients`` sees them after its reduction; a frozen parameter
(``lr_mult`` 0) counts not, as in Caffe (no gradient computed for it) and
torch (``clip_grad_norm_`` skips a parameter without ``grad``). Where each rank holds all
parameters (one rank, scheme data or none, a parameter server holding all),
the norm is local. Where a rank holds part of them (the stages of a
pipeline or of a hybrid replica), ``group`` names the ranks that hold the
rest and one Allreduce of the single squared norm (``seq`` after the
graph's other comm ops) makes it global; a stage that holds no parameter
(the loss alone) takes part with a zero (``clip.norm`` a Constant, on its
own rank's host). Imports the graph and the solver table (the graph layer).
"""
from ..ops.updates import SOLVER_UPDATES, frozen

CLIP_OPS = ("GradNormSq", "ClipScale")


def update_ops(graph):
    """The update ops of ``graph`` (one per learnable parameter or chunk), in graph order."""
    types = {op_type for op_type, _ in SOLVER_UPDATES.values()}
    return [op for op in graph.ops.values() if op.op_type in types]


def add_clip(graph, clip, group=None, seq=None, thread=0):
    """Clip ``graph``'s gradients to the global L2 norm ``clip`` in place
    (see the module docstring). ``group``: the ranks whose norms add up to
    the global one (None: this rank's is); ``seq``: the Allreduce's. Returns
    the graph."""
    updates = update_ops(graph)
    if not updates and group is None:
        return graph
    grads = [op.inputs[1] for op in updates]
    # a frozen parameter (lr_mult 0) counts not: Caffe computes no gradient
    # for it, torch's clip_grad_norm_ sees none (requires_grad False)
    counted = [op for op in updates if not frozen(op.attrs)]
    norm_grads = [op.inputs[1] for op in counted]
    scales = [float(op.attrs.get("grad_scale", 1.0)) for op in counted]
    location = graph.blobs[grads[0]].location if grads else None
    if location is None:  # a stage without parameters still adds its zero, on its rank's host
        from .core import Location
        here = next((op.location for op in graph.ops.values() if op.location is not None), None)
        location = Location(here.rank, -1, here.ip) if here is not None else Location()
    graph.add_blob("clip.sumsq", (1,), "float64", location, kind="grad")
    if norm_grads:
        graph.add_blob("clip.partial", None, "float64", location, kind="grad")
        graph.add_op("clip.norm", "GradNormSq", norm_grads, ["clip.sumsq", "clip.partial"],
                     {"scales": scales}, location=location, thread=thread)
    else:  # a stage without (trainable) parameters, the loss alone: its share is 0
        graph.add_op("clip.norm", "Constant", [], ["clip.sumsq"],
                     {"shape": [1], "value": 0.0, "dtype": "float64"}, location=location,
                     thread=thread)
    total = "clip.sumsq"
    if group is not None and len(group) > 1:
        total = "clip.sumsq.all"
        graph.add_blob(total, (1,), "float64", location, kind="grad")
        graph.add_op("clip.sum", "Allreduce", ["clip.sumsq"], [total],
                     group_attrs(graph, group, seq), location=location, thread=thread)
    for op, grad in zip(updates, grads):
        reroute_grad(graph, op, grad, "clip", "ClipScale", [grad, total], {"clip": float(clip)})
    return graph.infer_shapes()


def reroute_grad(graph, update, grad, suffix, op_type, inputs, attrs=None):
    """Make ``update`` read ``grad@suffix`` instead of its gradient ``grad``:
    an alias of ``grad`` that a new op ``grad.suffix`` (``op_type`` of
    ``inputs``, ``attrs``) writes, where the gradient lives, on the
    update's thread (ClipScale, loss scaling's Unscale)."""
    blob = graph.blobs[grad]
    alias = f"{grad}@{suffix}"
    graph.add_blob(alias, blob.shape, blob.dtype, blob.location, kind="grad", alias_of=grad)
    graph.add_op(f"{grad}.{suffix}", op_type, inputs, [alias], attrs, location=blob.location,
                 thread=update.thread)
    update.inputs[1] = alias


def group_attrs(graph, group, seq=None):
    """The attrs of an Allreduce of one value among the ranks ``group``:
    its ``seq`` (None: after the graph's other comm ops) and the group."""
    return {"seq": int(seq if seq is not None else _next_seq(graph)),
            "group": sorted(int(r) for r in group)}


def _next_seq(graph):
    seqs = [int(op.attrs["seq"]) for op in graph.ops.values() if "seq" in op.attrs]
    return max(seqs) + 1 if seqs else 0


#: the blobs ``add_clip`` makes for the norm
NORM_BLOBS = ("clip.sumsq", "clip.partial", "clip.sumsq.all")


def remove_clip(graph):
    """Undo ``add_clip`` in place on a graph that carries its clip ops (a
    ``graph:`` config that ``graph --format yaml`` wrote of a job with
    ``solver.clip_gradients``): the updates read the gradients again, and
    the clip ops and their blobs go. Returns the threshold they clipped to
    (None: the graph clips nothing), which the job's composition clips to
    again, after the gradients' reduction, as a net's. Kept, they clipped
    each rank's own gradients before the reduction on several ranks, and
    a second clip made their blobs twice."""
    clips = [op for op in graph.ops.values() if op.op_type in CLIP_OPS[1:]]
    if not clips:
        return None
    clip = float(clips[0].attrs["clip"])
    back = {}
    for op in clips:
        back.update(zip(op.outputs, op.inputs[:len(op.outputs)]))
    gone = {op.name for op in clips} | {
        op.name for op in graph.ops.values()
        if op.outputs and set(op.outputs) <= set(NORM_BLOBS)}
    for name in gone:
        graph.remove_op(name)
    for blob in list(back) + [b for b in NORM_BLOBS if b in graph.blobs]:
        del graph.blobs[blob]
    for op in graph.ops.values():
        op.inputs = [back.get(b, b) for b in op.inputs]
        op.control_inputs = [c for c in op.control_inputs if c not in gone]
    return clip
