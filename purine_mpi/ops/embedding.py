"""Token and position embeddings (a GPT's input layers).

Embedding ("Embedding", inputs [ids, w], output [y])::

    y[i..., :] = w[ids[i...], :]          ids: integers of any shape S,
                                           w: (V, C), y: S + (C,)

Gradient (w only; ids are data)::

    dw[v, :] = sum over the positions i with ids[i] == v of dy[i, :]
               ("EmbeddingGrad", [dy, ids] -> [dw], attr input_dim = V)

a scatter-add: on the CPU the rows of dy sorted by token (a stable sort),
each run summed in order; on a GPU two raw kernels (cuda/reduce.cu
``embedding_order``: the positions counting-sorted by (token, position)
into the op's scratch, 2 n + 2 V int32; ``embedding_grad``: a block per
row of dw adds its token's rows of dy in increasing position, or writes
zeros), no atomics (1- and 2-byte ids: an int32 copy in the scratch too).
Both are deterministic (the same order every time, on every rank), unlike
atomic adds; the GPU adds each token's rows in position order (np.add.at's
bits), the CPU's ``reduceat`` pairwise past a few rows, so the two may
differ in the last bits for a token repeated more than 8 times. The table can be shared with an
output projection (the ``fc`` layer's ``tie_weight``): the gradient builder
then sums the two uses' contributions.

PositionEmbedding ("PositionEmbedding", inputs [x, w], output [y])::

    y[n, t, :] = x[n, t, :] + w[t, :]     x: (N, T, C), w: (L, C), T <= L

Gradients: dx = dy (a "Copy"); dw[t] = sum_n dy[n, t] for t < T, 0 beyond
("PositionEmbeddingGrad", [dy] -> [dw], attr max_length = L).

An out-of-range token id raises a ValueError on the CPU (the op names it).
The op does not check on a GPU (that would cost a device-to-host read each
iteration: CuPy's take reads a wrapped row and the gradient drops it), but
ids that come from the data reach it through the data op, which checks
each batch on the host before its transfer with the same message
(``check_ids``; ops/data.py, attr ``id_limit``, set by job/replica.py for
the data an embedding reads), CPU or GPU: the run stops (exit 1) on both.
"""
import numpy as np

from ..base.backend import get_xp
from ..base.errors import ShapeError
from ..gpu.raw import KERNEL_DTYPES, raw_kernels, sum_scratch
from .registry import OpKernel, gradient, register


def check_ids(ids, vocab):
    """ValueError naming the first id of the host array ``ids`` outside
    [0, ``vocab``) (device arrays are not read)."""
    xp = get_xp(ids)
    if xp is np and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        bad = ids[(ids < 0) | (ids >= vocab)].ravel()[0]
        raise ValueError(f"token id {int(bad)} is outside [0, {vocab}) for an embedding of "
                         f"{vocab} rows")


@register
class Embedding(OpKernel):
    """y = w[ids]: one row of the table per token; see the module docstring."""

    op_type = "Embedding"

    @classmethod
    def infer(cls, attrs, ins):
        (ids_shape, ids_dtype), (w_shape, w_dtype) = ins
        if np.dtype(ids_dtype).kind not in "iu":
            raise ShapeError(f"Embedding needs integer token ids, got {np.dtype(ids_dtype).name}")
        if len(w_shape) != 2:
            raise ShapeError(f"Embedding weight must be (input_dim, num_output), got "
                             f"{list(w_shape)}")
        return [(tuple(ids_shape) + (w_shape[1],), w_dtype)]

    def run(self, ins, outs):
        ids, w = ins
        check_ids(ids, w.shape[0])
        xp = get_xp(w)
        # NumPy's mode "raise" buffers ``out`` (a temporary of y's size); the
        # ids are checked above, so "wrap" takes the same rows without it
        mode = {"mode": "wrap"} if xp is np else {}
        xp.take(w, ids.reshape(-1), axis=0, out=outs[0].reshape(-1, w.shape[1]), **mode)


@register
class EmbeddingGrad(OpKernel):
    """[dy, ids] -> [dw]: dw[v] = sum of dy's rows whose token is v (attr
    input_dim: the table's rows)."""

    op_type = "EmbeddingGrad"

    def scratch_specs(self, ins, outs):
        """The raw path's (float32/64 tables): the kernels' sort of the
        positions by token (gpu/kernels.embedding_grad_scratch: 2 n + 2 V
        int32), and an int32 copy of 1- and 2-byte ids (int32/int64 ids
        are read as they are)."""
        if np.dtype(outs[0].dtype) not in KERNEL_DTYPES:
            return []
        from ..gpu.kernels import embedding_grad_scratch
        sort = embedding_grad_scratch(ins[1].size, outs[0].shape[0])
        if np.dtype(ins[1].dtype).itemsize >= 4:
            return sort
        return sort + [((ins[1].size,), np.int32)]

    def setup(self, ins, outs):
        if raw_kernels(get_xp(outs[0]), outs[0]) is not None:
            self.reserve_temporaries(outs[0], *self.scratch_specs(ins, outs))

    @classmethod
    def infer(cls, attrs, ins):
        (dy_shape, dtype), _ = ins
        return [((int(attrs["input_dim"]), dy_shape[-1]), dtype)]

    def run(self, ins, outs):
        dy, ids = ins
        dw = outs[0]
        xp = get_xp(dw)
        rows = dy.reshape(-1, dw.shape[1])
        flat = ids.reshape(-1)
        k = raw_kernels(xp, dw)
        if k is not None:  # two kernels: the positions sorted by token, then dw's rows
            scratch = self.temporaries(dw, *self.scratch_specs(ins, outs))
            if len(scratch) > 4:
                wide = scratch[4]
                wide[...] = flat
                flat = wide
            k.embedding_grad(rows, flat, dw, scratch[:4])
            return
        dw[...] = 0
        order = np.argsort(flat, kind="stable")
        tokens = flat[order]
        if not tokens.size:
            return
        starts = np.flatnonzero(np.r_[True, tokens[1:] != tokens[:-1]])
        dw[tokens[starts]] = np.add.reduceat(rows[order], starts, axis=0)

    def host_temporaries(self, ins, outs):
        """The host run's sort (order and the sorted tokens: int64 per
        token; the boundaries, one per distinct token, at most dw's rows) and
        dy's rows in token order, and ``reduceat``'s sums (a row per distinct
        token: at most dw's size)."""
        dy, ids = ins
        n, width = ids.size, outs[0].shape[1]
        distinct = min(n, outs[0].shape[0])
        return [((n,), np.int64)] * 2 + [((distinct,), np.int64), (dy.shape, dy.dtype),
                                         ((distinct, width), dy.dtype)]


@gradient("Embedding")
def _embedding_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    ids, w = op.inputs
    if dy is not None and g.needs_grad(w):
        g.emit("EmbeddingGrad", [dy, ids], [g.grad_blob(w)],
               {"input_dim": int(g.graph.blobs[w].shape[0])})


@register
class PositionEmbedding(OpKernel):
    """y = x + w[:T] (broadcast over the batch); see the module docstring."""

    op_type = "PositionEmbedding"
    in_place = ((0, 0),)

    @classmethod
    def infer(cls, attrs, ins):
        (x_shape, x_dtype), (w_shape, _) = ins
        if len(x_shape) != 3:
            raise ShapeError(f"PositionEmbedding needs an (N, T, C) input, got {list(x_shape)}")
        if len(w_shape) != 2 or w_shape[1] != x_shape[2] or w_shape[0] < x_shape[1]:
            raise ShapeError(f"PositionEmbedding: a table of shape {list(w_shape)} cannot serve "
                             f"an input of shape {list(x_shape)} (needs (L >= {x_shape[1]}, "
                             f"{x_shape[2]}))")
        return [(tuple(x_shape), x_dtype)]

    def run(self, ins, outs):
        x, w = ins
        get_xp(x).add(x, w[:x.shape[1]], out=outs[0])


@register
class PositionEmbeddingGrad(OpKernel):
    """[dy] -> [dw]: dw[t] = sum_n dy[n, t] for t < T, 0 beyond (attr max_length)."""

    op_type = "PositionEmbeddingGrad"

    @classmethod
    def infer(cls, attrs, ins):
        (dy_shape, dtype), = ins
        return [((int(attrs["max_length"]), dy_shape[-1]), dtype)]

    def scratch_specs(self, ins, outs):
        """The partial sums of the column sum's row ranges (float32/64)."""
        shape = ins[0].shape
        return sum_scratch((shape[0], int(np.prod(shape[1:], dtype=np.int64))), ins[0].dtype)

    def setup(self, ins, outs):
        if raw_kernels(get_xp(ins[0]), ins[0], outs[0]) is not None:
            self.reserve_temporaries(ins[0], *self.scratch_specs(ins, outs))

    def run(self, ins, outs):
        dy, dw = ins[0], outs[0]
        xp = get_xp(dy)
        t = dy.shape[1]
        k = raw_kernels(xp, dy, dw)
        if k is not None:  # deterministic column-sum kernels, capturable
            (partial,) = self.temporaries(dy, *self.scratch_specs(ins, outs))
            k.sum_rows(dy.reshape(dy.shape[0], -1), dw[:t].reshape(-1), partial=partial)
        else:
            xp.sum(dy, axis=0, out=dw[:t])
        dw[t:] = 0


@gradient("PositionEmbedding")
def _position_embedding_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    x, w = op.inputs
    if dy is None:
        return
    if g.needs_grad(x):
        g.emit("Copy", [dy], [g.grad_blob(x)])
    if g.needs_grad(w):
        g.emit("PositionEmbeddingGrad", [dy], [g.grad_blob(w)],
               {"max_length": int(g.graph.blobs[w].shape[0])})
