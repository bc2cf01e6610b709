"""Token and position embeddings (a GPT's input layers).

Embedding ("Embedding", inputs [ids, w], output [y])::

    y[i..., :] = w[ids[i...], :]          ids: integers of any shape S,
                                           w: (V, C), y: S + (C,)

Gradient (w only; ids are data)::

    dw[v, :] = sum over the positions i with ids[i] == v of dy[i, :]
               ("EmbeddingGrad", [dy, ids] -> [dw], attr input_dim = V)

a scatter-add, each token's rows of dy added one at a time in increasing
position (np.add.at's order, so its bits, on the CPU and on a GPU alike:
a checkpoint or a test compares the two bit for bit). On the CPU the
positions stably sorted by token, then the tokens at most 32 times in the
batch added together one occurrence rank per pass (a gather, an add and a
scatter each), a more frequent one in chunks of 256 of its rows reduced
over the rows (NumPy adds row after row along axis 0; a table of width 1
runs np.add.at, whose 1-D loop is fast); faster than np.add.at's 2-D loop
and than the former ``reduceat`` (which summed pairwise past a few rows,
so other bits than the GPU's for a token repeated more than 8 times):
benchmarks/embedding_grad_host.py. On a GPU two raw kernels (cuda/reduce.cu
``embedding_order``: the positions counting-sorted by (token, position)
into the op's scratch, 2 n + 2 V int32; ``embedding_grad``: a block per
row of dw adds its token's rows of dy in increasing position, or writes
zeros), no atomics (1- and 2-byte ids: an int32 copy in the scratch too).
Both are deterministic (the same order every time, on every rank), unlike
atomic adds. The table can be shared with an
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
        if dw.shape[1] == 1:   # NumPy's reduce would add a chunk pairwise (_add_run)
            np.add.at(dw[:, 0], flat, rows[:, 0])
            return
        if not flat.size:
            return
        order = np.argsort(flat, kind="stable")
        tokens = flat[order]
        starts = np.flatnonzero(np.r_[True, tokens[1:] != tokens[:-1]])
        counts = np.diff(np.r_[starts, tokens.size])
        scratch = self.temporaries(dw, *self.host_temporaries(ins, outs)[3:])[0]
        light = counts <= HOST_RANKS
        _add_by_rank(dw, rows, order, tokens, starts[light], counts[light], scratch)
        for first, count in zip(starts[~light].tolist(), counts[~light].tolist()):
            _add_run(dw[tokens[first]], rows, order[first:first + count], scratch[0])

    def host_temporaries(self, ins, outs):
        """The host run's sort (order and the sorted tokens: int64 per
        token; the run starts, one per distinct token, at most dw's rows)
        and two blocks of rows (``_add_by_rank``'s gathered rows and dw's
        rows, ``_add_run``'s chunk): min(n, max(V, HOST_CHUNK + 1)) rows of
        dw's width each."""
        dy, ids = ins
        n, (vocab, width) = ids.size, outs[0].shape
        distinct = min(n, vocab)
        block = min(n, max(vocab, HOST_CHUNK + 1))
        return [((n,), np.int64)] * 2 + [((distinct,), np.int64),
                                         ((2, block, width), dy.dtype)]


#: the host path's split: a token at most this many times is added by
#: ``_add_by_rank`` (one pass per occurrence rank, all such tokens
#: together), a more frequent one by ``_add_run`` (its rows in chunks of
#: HOST_CHUNK): the fastest split on gpt_tiny's and gpt_small's shapes
#: (benchmarks/embedding_grad_host.py)
HOST_RANKS = 32
HOST_CHUNK = 256


def _add_by_rank(dw, rows, order, tokens, starts, counts, scratch):
    """dw[t] += dy's rows of token t, one at a time in position order
    (np.add.at's additions, so its bits) for the tokens whose runs of the
    sorted ``tokens`` begin at ``starts`` (``counts`` long): pass k adds
    every such token's k-th occurrence with one gather, add and scatter
    (a token at most once a pass), so as many passes as the longest run.
    (``take``'s mode "wrap": "raise" would buffer ``out``; the indices are
    the sort's positions and tokens, and dw[t] = raises for a token past V.)"""
    if not starts.size:
        return
    by = np.argsort(-counts, kind="stable")   # longest first: pass k's tokens a prefix
    starts, counts = starts[by], counts[by]
    token = tokens[starts]
    live = np.searchsorted(-counts, -np.arange(counts[0]), side="left")  # counts > k
    got, have = scratch[0], scratch[1]
    for k, m in enumerate(live.tolist()):
        t = token[:m]
        np.take(rows, order[starts[:m] + k], axis=0, out=got[:m], mode="wrap")
        np.take(dw, t, axis=0, out=have[:m], mode="wrap")
        np.add(have[:m], got[:m], out=got[:m])
        dw[t] = got[:m]


def _add_run(row, rows, positions, block):
    """row += rows[positions] one at a time, in the order given (np.add.at's
    bits): a chunk of rows gathered under the running sum, then reduced
    over the rows (axis 0 of a C-order block at least 2 wide: NumPy's reduce
    adds row after row there, its pairwise summation being along the
    contiguous axis only, which a width of 1 makes axis 0: the op runs
    np.add.at then; tests/test_embedding_host.py holds both to its bits)."""
    chunk = block.shape[0] - 1
    for i in range(0, positions.size, chunk):
        take = positions[i:i + chunk]
        block[0] = row
        np.take(rows, take, axis=0, out=block[1:1 + take.size], mode="wrap")
        np.add.reduce(block[:1 + take.size], axis=0, out=row)


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
