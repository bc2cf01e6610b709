"""An op's work: what its time scales with, to price an op from a traced op
of another size (``plan --choose``: a micro-batch ``X@mbK`` from the whole
batch's ``X``, a row chunk, a tensor-parallel shard; tools/choose.py).

- a matrix product (InnerProduct, Conv, attention and their gradients:
  ``tools/flops.op_flops`` counts it): its FLOPs;
- any other op: the bytes of the blobs it reads and writes that hold the
  batch (activations and their gradients), not the weights' (parameters,
  their gradients, the solver's state; nor a scalar's: the learning rate,
  a loss): a ReLU of B/M samples moves 1/M of the bytes;
- an op that touches none of those (an update, a sum of weight gradients):
  all its bytes (a shard's update: its elements' share).

Counting the weights' bytes as work would price a micro-batch of a wide
layer (a 4 MiB weight against 128 KiB of activations) at nearly the whole
batch's time, and M micro-batches at M times the batch.
"""
from ..flops import op_flops

#: blob kinds that hold a weight or the solver's state, not the batch
#: (graph/core.PERSISTENT_KINDS, and the fused and sharded views of them:
#: parallel/fuse.py, parallel/sharding.py)
WEIGHT_KINDS = frozenset(("param", "param_buffer", "state", "state_buffer", "lr", "iter",
                          "bucket", "param_shard", "param_gathered", "param_copy"))

#: element-wise op types whose time follows the bytes they write, by kind:
#: an op of a candidate that the trace does not hold (a micro-batch's
#: gradient sum ``<grad>.micro_sum``, a staging copy, a replica's clipping
#: of its summed gradient ``<grad>.sum.clip``) is priced at the seconds per
#: byte of the traced ops of its kind (``plan --choose``: tools/choose.py
#: ``elementwise_rates``)
ELEMENTWISE_KINDS = {"Sum": "sum", "Eltwise": "sum", "Copy": "copy", "Cast": "copy",
                     "ClipScale": "clip"}


def weight_blobs(graph):
    """The blobs of ``graph`` that hold weights, their gradients or the
    solver's state: kinds ``WEIGHT_KINDS`` (the blob's or its storage's),
    and a gradient named after a weight (``<weight>.grad...``: a micro-
    batch's ``@mbK``, a row chunk's ``[a:b]``, a shard's ``.shard[a:b]``)."""
    from ...graph.grad import grad_name
    weights = {n for n, b in graph.blobs.items()
               if b.kind in WEIGHT_KINDS or graph.blobs[graph.storage_root(n)].kind in WEIGHT_KINDS}
    prefixes = tuple(grad_name(n) for n in weights if graph.blobs[n].kind in
                     ("param", "param_shard", "param_gathered"))
    return weights | {n for n in graph.blobs if prefixes and n.startswith(prefixes)}


def op_work(graph, name, weights=None):
    """``(unit, amount)`` of op ``name``: ("flops", n) for a matrix product,
    ("bytes", n) of its batch blobs otherwise, ("all bytes", n) when it
    touches no batch blob (module docstring). ``weights``: ``weight_blobs
    (graph)``, computed when not given."""
    op = graph.ops[name]
    blobs = [b for b in dict.fromkeys(list(op.inputs) + list(op.outputs))
             if b in graph.blobs and graph.blobs[b].shape is not None]
    if len(blobs) == len(set(op.inputs) | set(op.outputs)):
        flops = op_flops(op, lambda b: graph.blobs[b].shape)
        if flops > 0:
            return "flops", flops
    if weights is None:
        weights = weight_blobs(graph)
    batch = sum(graph.blobs[b].nbytes for b in blobs
                if b not in weights and len(graph.blobs[b].shape) > 0)
    if batch > 0:
        return "bytes", batch
    return "all bytes", sum(graph.blobs[b].nbytes for b in blobs)



def affine_fit(t_big, w_big, t_small, w_small):
    """``(fixed, rate)`` of the op cost t(w) = fixed + rate * w through two
    measured points, the op's time ``t_big`` at work ``w_big`` (the job's
    batch) and ``t_small`` at ``w_small`` (a smaller batch): ``fixed`` is
    the cost per call that does not shrink with the work (Python and NumPy
    call overhead, a small product's lower FLOP rate), clamped to [0,
    min(t_small, t_big)] (a noisy small trace: not below the proportional
    rule, nor above either time); ``rate`` then makes t(w_big) = t_big
    exactly, so the job's own ops keep their measured times. None where the
    work is equal (an update: nothing to fit) or not positive."""
    if w_big <= 0 or w_small <= 0 or w_big == w_small:
        return None
    fixed = (t_small * w_big - t_big * w_small) / (w_big - w_small)
    fixed = min(max(fixed, 0.0), t_small, t_big)
    return fixed, (t_big - fixed) / w_big
