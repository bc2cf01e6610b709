"""Layer normalisation over the last axis (a transformer's LayerNorm).

Forward ("LayerNorm", inputs [x, g, b], outputs [y, mean, rstd])::

    mu   = mean(x, last axis)                    x: (..., C), g, b: (C,)
    var  = mean((x - mu)^2, last axis)           (biased, as PyTorch)
    rstd = 1 / sqrt(var + eps)                   mean, rstd: x.shape[:-1]
    y    = (x - mu) * rstd * g + b

Gradient ("LayerNormGrad", [dy, x, g, mean, rstd] -> the requested ones of
[dx, dg, db], attr ``outputs``), with xhat = (x - mu) * rstd, dxhat = dy * g::

    dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
    dg = sum over the leading axes of dy * xhat
    db = sum over the leading axes of dy

On a GPU, in float32 and float64, each direction is one kernel
(cuda/layernorm.cu: a block per row, the row's sums in double in a fixed
order) and dg, db the deterministic column sums of dy * xhat (the backward
kernel writes it to the op's scratch) and of dy (cuda/reduce.cu
``sum_rows``: tiles of columns x ranges of rows, then a finishing kernel
adding each column's partial sums in order): 1 launch forward, at most 5
backward. Other dtypes (float16) take the generic path:
the reduction kernel for the means and sums, the rest element-wise CuPy
into the blobs and the op's scratch. Either way the scratch is reserved at
setup: nothing allocates, and a CUDA graph captures it.

y stored as bfloat16 bits (attr ``bits_out: [0]``, bf16 storage:
parallel/precision.store_bits, where every reader takes bits): the forward
writes the bits of the bfloat16 nearest each float32 y -- on a GPU in the
same kernel (``layernorm_forward_bits_f32``), on the host through a float32
chunk -- the bits a float32 y and a Cast to bits give.
"""
import numpy as np

from ..base.backend import get_xp
from ..base.errors import ShapeError
from ..base.precision import BITS, is_bits, to_bf16_bits, value_dtype, wire_scratch
from ..gpu.raw import KERNEL_DTYPES, column_scratch, float_kernels, last_axis_rows, raw_kernels
from .registry import OpKernel, gradient, register, spans


def row_mean(xp, k, x, out):
    """out[...] = mean of x over its last axis (out: x.shape[:-1], or with a
    trailing 1). On a GPU (``k``, the raw kernels) one deterministic
    reduction kernel (channel_sum of the (1, rows, C) view), never CuPy's
    reductions, which a CUDA-graph capture must not hold."""
    if k is None:
        xp.mean(x, axis=-1, out=out.reshape(x.shape[:-1]))
        return
    k.channel_sum(x.reshape(1, -1, x.shape[-1]), out=out.reshape(-1))
    out *= 1.0 / x.shape[-1]


def column_sum(xp, k, x, out, partial=None):
    """out (C,) = x summed over every axis but the last: on a GPU the
    deterministic column-sum kernels (``sum_rows``; ``partial``: their
    scratch, ``column_scratch``)."""
    rows = x.reshape(last_axis_rows(x.shape))
    if k is None:
        xp.sum(rows, axis=0, out=out)
        return
    k.sum_rows(rows, out, partial=partial)


#: the host path normalises this many bytes of rows at a time (at least one
#: row), so its temporaries are a chunk's, not new (rows, C) arrays each run
#: (which glibc maps and the kernel zeroes afresh once its dynamic mmap
#: threshold is below their size) streamed through the cache pass after
#: pass. Every row's values are what the whole array gives (the means run
#: along rows, einsum's row by row); the gradient's column sums (dg, db)
#: are einsum's over the whole arrays
HOST_CHUNK_BYTES = 1 << 18


def host_rows(x):
    """The slices of the rows of ``x`` (..., C), flattened, a host chunk
    (``HOST_CHUNK_BYTES``) at a time, and the chunk's row count."""
    c = int(x.shape[-1])
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    per = max(1, min(rows, HOST_CHUNK_BYTES // max(1, c * np.dtype(x.dtype).itemsize)))
    return spans(rows, per), per


@register
class LayerNorm(OpKernel):
    """y = (x - mean) / sqrt(var + eps) * g + b over the last axis (attr
    ``eps``, default 1e-5); see the module docstring."""

    op_type = "LayerNorm"

    def host_temporaries(self, ins, outs):
        if is_bits(outs[0]):   # a chunk's float32 y and to_bf16_bits's scratch
            per = host_rows(ins[0])[1]
            return [((per, ins[0].shape[-1]), np.float32),
                    (wire_scratch(per * ins[0].shape[-1]).shape, np.uint32)]
        return []   # the host path writes y, mean and rstd only (``_normalise_host``)

    def scratch_specs(self, ins, outs):
        return [] if _fused(ins[0]) else [(ins[0].shape, ins[0].dtype)]   # the squares

    @classmethod
    def bits_outputs(cls, attrs):
        return (0,)

    def setup(self, ins, outs):
        self.reserve_temporaries(ins[0], *self.scratch_specs(ins, outs))

    @classmethod
    def infer(cls, attrs, ins):
        (xs, xd), (gs, _), (bs, _) = ins
        if not xs or tuple(gs) != (xs[-1],) or tuple(bs) != (xs[-1],):
            raise ShapeError(f"LayerNorm: weight {list(gs)} and bias {list(bs)} must both be "
                             f"[{xs[-1] if xs else '?'}] for an input of shape {list(xs)}")
        y = BITS if 0 in attrs.get("bits_out", ()) else xd
        return [(tuple(xs), y), (tuple(xs[:-1]), xd), (tuple(xs[:-1]), xd)]

    def run(self, ins, outs):
        x, g, b = ins
        y, mean, rstd = outs
        xp = get_xp(x)
        k = raw_kernels(xp, x, g, b)
        if k is not None:
            k.layernorm_forward(x, g, b, float(self.attrs.get("eps", 1e-5)), y, mean, rstd)
            return
        eps = float(self.attrs.get("eps", 1e-5))
        if xp is not np:   # a dtype without a fused kernel: whole arrays
            if is_bits(y):
                raise TypeError(f"LayerNorm: bfloat16 bits y from a float32 x, got {x.dtype}")
            (sq,) = self.temporaries(x, *self.scratch_specs(ins, outs))
            _normalise(xp, k, x, g, b, eps, y, mean, rstd, sq)
            return
        c = x.shape[-1]
        x2, y2, mean1, rstd1 = x.reshape(-1, c), y.reshape(-1, c), mean.reshape(-1), \
            rstd.reshape(-1)
        wide = self.temporaries(x, *self.host_temporaries(ins, outs)) if is_bits(y) else None
        for s in host_rows(x)[0]:
            if wide is None:
                _normalise_host(x2[s], g, b, eps, y2[s], mean1[s], rstd1[s])
                continue
            chunk = wide[0][:s.stop - s.start]
            _normalise_host(x2[s], g, b, eps, chunk, mean1[s], rstd1[s])
            to_bf16_bits(chunk, y2[s], wide[1])


def _normalise(xp, k, x, g, b, eps, y, mean, rstd, sq):
    """y = (x - mean) * rstd * g + b, x's row means and 1 / sqrt(var + eps)
    written to ``mean`` and ``rstd``; ``sq``: a temporary of x's shape."""
    row_mean(xp, k, x, mean)
    xp.subtract(x, mean[..., None], out=y)
    xp.multiply(y, y, out=sq)
    row_mean(xp, k, sq, rstd)
    rstd += eps
    xp.sqrt(rstd, out=rstd)
    xp.divide(1, rstd, out=rstd)
    y *= rstd[..., None]
    y *= g
    y += b


def _normalise_host(x, g, b, eps, y, mean, rstd):
    """``_normalise`` of host rows x (m, C) into y, mean and rstd (m,) with
    no temporary: the row sums are einsum's (row by row, ~3x NumPy's
    pairwise ``mean`` along 128-element rows; other bits than it, the same
    for a row wherever it lies: the pieces give the whole array's), the
    variance one einsum of y with itself (no squares array)."""
    c = x.shape[-1]
    np.einsum("ij->i", x, out=mean)
    mean /= c
    np.subtract(x, mean[:, None], out=y)
    np.einsum("ij,ij->i", y, y, out=rstd)
    rstd /= c
    rstd += eps
    np.sqrt(rstd, out=rstd)
    np.divide(1, rstd, out=rstd)
    y *= rstd[:, None]
    y *= g
    y += b


def _fused(x):
    """Whether a GPU runs the op as cuda/layernorm.cu's kernels (the dtypes
    of ``raw_kernels``)."""
    return np.dtype(x.dtype) in KERNEL_DTYPES


def _grad_specs(x):
    """xhat, dxhat and two row means of the generic path (a device dtype
    without a fused kernel)."""
    row = (x.shape[:-1] + (1,), x.dtype)
    return (x.shape, x.dtype), (x.shape, x.dtype), row, row


@register
class LayerNormGrad(OpKernel):
    """[dy, x, g, mean, rstd] -> the gradients named in attr ``outputs``
    (a subset of dx, dg, db, in that order).

    dy may be stored as bfloat16 bits (``bits_inputs``: a data gradient of
    bf16 values the fc products write so, bf16 storage; x float32): the
    gradients are float32, on a GPU dy widened exactly in the kernels
    (``layernorm_backward_bdy_f32``, db's column sums ``sum_rows_bits_f32``),
    on the host into a float32 copy first (``host_temporaries``): the
    float32 dy's gradients bit for bit.

    With attr ``bits_copy`` (the index of dx among the outputs; bf16
    storage, parallel/precision.fold_copies: a dx read as float32 -- the
    final layer norm's, by the last residual sum and the projection's bias
    gradient -- and, as bits, by the products) a last output, dx's
    bfloat16 bits (uint16: the bits a Cast of dx wrote): on a GPU in the
    backward kernel's pass (``layernorm_backward_copy_f32``,
    ``layernorm_backward_bdy_copy_f32``), on the host ``to_bf16_bits`` of
    each chunk of rows as it is done: no Cast, no second read of dx. The
    copy may take the bytes of a dy stored as bits (``in_place_of``: 2
    bytes an element each; a float32 dy is twice the copy, so the memory
    plan never pairs them): each element of dy is read before its copy is
    written (on a GPU db's column sums of dy run before the backward
    kernel, on the host dy is widened into a float32 temporary first);
    where dy dies at this op the plan puts the copy there, as the Cast's
    copy came after dy died (the final layer norm's dy: the head's data
    gradient).

    With attr ``column_sums: true`` (parallel/fuse.fold_layernorm_sums,
    opted in by ``PURINE_LN_SUMS=1``), dg and db both wanted and a float32
    x of width a multiple of 4 up to 768 on a GPU: one backward kernel
    that also writes each block's partial column sums of dy and dy * xhat,
    and a finishing kernel for each (``kernels.layernorm_backward_sums``):
    no dy * xhat array (x's size) in the scratch, dy not read again for db;
    dx as before bit for bit, dg and db the same sums in another order."""

    op_type = "LayerNormGrad"

    @classmethod
    def in_place_of(cls, attrs):
        # dx's bits copy (the output after the gradients) over a bits dy
        return ((0, len(attrs["outputs"])),) if attrs.get("bits_copy") else ()

    @classmethod
    def bits_inputs(cls, attrs):
        return (0,)

    @classmethod
    def bits_copies(cls, attrs):
        wanted = list(attrs.get("outputs", ()))
        return (wanted.index("dx"),) if "dx" in wanted else ()

    def host_temporaries(self, ins, outs):
        """``_grad_host``'s: a chunk's dxhat and two row means (``host_rows``)
        with dx; the whole xhat without dx but with dg (with dx it is made
        in dx's bytes); a float32 copy of a dy stored as bits; for dx's bits
        copy (``bits_copy``) to_bf16_bits's scratch (last)."""
        x, wanted = ins[1], self.attrs["outputs"]
        rows = host_rows(x)[1]
        whole = [(x.shape, x.dtype)] if "dg" in wanted and "dx" not in wanted else []
        part = [((rows, x.shape[-1]), x.dtype), ((rows,), x.dtype), ((rows,), x.dtype)] \
            if "dx" in wanted else []
        wide = [(tuple(ins[0].shape), np.float32)] if is_bits(ins[0]) else []
        copy = [(wire_scratch(rows * x.shape[-1]).shape, np.uint32)] \
            if len(outs) > len(wanted) else []
        return part + whole + wide + copy

    def _sums_in_pass(self, x):
        """Whether the GPU path is ``layernorm_backward_sums`` (attr
        ``column_sums``, dg and db wanted, a shape it takes)."""
        from ..gpu.kernels.elementwise import layernorm_sums_ok
        wanted = self.attrs["outputs"]
        return bool(self.attrs.get("column_sums")) and "dg" in wanted and "db" in wanted and \
            layernorm_sums_ok(tuple(x.shape), x.dtype)

    def scratch_specs(self, ins, outs):
        if not _fused(ins[1]):
            return list(_grad_specs(ins[1]))     # the generic path's
        if self._sums_in_pass(ins[1]):   # the blocks' partial sums of db and dg
            from ..gpu.kernels.elementwise import layernorm_sums_scratch
            return [layernorm_sums_scratch(tuple(ins[1].shape))]
        # the fused kernel's dy * xhat, for dg's column sums; the column
        # sums' partial sums (one array: db's are done when dg's start)
        wanted = self.attrs["outputs"]
        product = [(ins[1].shape, ins[1].dtype)] if "dg" in wanted else []
        return product + (column_scratch(ins[1]) if {"dg", "db"} & set(wanted) else [])

    def setup(self, ins, outs):
        self.reserve_temporaries(ins[1], *self.scratch_specs(ins, outs))

    @classmethod
    def infer(cls, attrs, ins):
        (dys, dyd), (xs, _), (gs, _), _, _ = ins
        shapes = {"dx": tuple(xs), "dg": tuple(gs), "db": tuple(gs)}
        dtype = value_dtype(dyd)   # a bits dy: float32 gradients
        wanted = list(attrs["outputs"])
        copy = list(attrs.get("bits_copy", ()))
        if copy and (copy != list(cls.bits_copies(attrs)) or np.dtype(dtype) != np.float32):
            raise ShapeError(f"LayerNormGrad: bits_copy takes [{wanted.index('dx')}] (dx among "
                             f"{wanted}) of a float32 dx, got {copy} ({np.dtype(dtype).name})"
                             if "dx" in wanted else
                             f"LayerNormGrad: bits_copy takes a dx among the outputs, got "
                             f"{copy} of {wanted}")
        return [(shapes[o], dtype) for o in wanted] + [(tuple(xs), BITS)] * len(copy)

    def run(self, ins, outs):
        dy, x, g, mean, rstd = ins
        xp = get_xp(dy)
        wanted = self.attrs["outputs"]
        got = dict(zip(wanted, outs))
        copy = outs[len(wanted)] if len(outs) > len(wanted) else None
        if copy is not None and np.dtype(x.dtype) != np.dtype(np.float32):
            raise TypeError(f"LayerNormGrad '{self.op.name}': dx's bits copy takes a float32 "
                            f"x and dx, got {x.dtype}")
        k = float_kernels(xp, *ins)
        if is_bits(dy) and (k is None or np.dtype(x.dtype) != np.dtype(np.float32)):
            if xp is not np:
                raise TypeError(f"LayerNormGrad '{self.op.name}': a dy stored as bits takes a "
                                f"float32 x, got {x.dtype}")
            temps = self.temporaries(x, *self.host_temporaries(ins, outs))
            bits = temps[-1] if copy is not None else None
            temps = temps[:-1] if copy is not None else temps
            from ..base.precision import from_bf16_bits
            _grad_host(from_bf16_bits(dy, temps[-1]), x, g, mean, rstd, got, temps[:-1],
                       copy, bits)
            return
        if k is not None and self._sums_in_pass(x):
            (partial,) = self.temporaries(x, *self.scratch_specs(ins, outs))
            k.layernorm_backward_sums(dy, x, g, mean, rstd, got.get("dx"), got["dg"], got["db"],
                                      copy=copy, partial=partial)
            return
        if k is not None:
            temps = self.temporaries(x, *self.scratch_specs(ins, outs))
            dyxhat = temps[0] if "dg" in got else None
            if "db" in got:   # first: dx's bits copy may take a bits dy's bytes
                column_sum(xp, k, dy, got["db"], temps[-1])
            k.layernorm_backward(dy, x, g, mean, rstd, dx=got.get("dx"), dyxhat=dyxhat,
                                 copy=copy)
            if "dg" in got:
                column_sum(xp, k, dyxhat, got["dg"], temps[-1])
            return
        if xp is np:
            temps = self.temporaries(x, *self.host_temporaries(ins, outs))
            if copy is None:
                _grad_host(dy, x, g, mean, rstd, got, temps)
            else:
                _grad_host(dy, x, g, mean, rstd, got, temps[:-1], copy, temps[-1])
            return
        if "db" in got:
            column_sum(xp, k, dy, got["db"])
        # a dtype without a fused kernel: whole arrays
        xhat, dxhat, a, c = self.temporaries(x, *self.scratch_specs(ins, outs))
        _xhat(xp, x, mean, rstd, xhat)
        if "dg" in got:
            xp.multiply(dy, xhat, out=dxhat)
            column_sum(xp, k, dxhat, got["dg"])
        if "dx" in got:
            _dx(xp, k, dy, g, rstd, xhat, got["dx"], dxhat, a, c)


def _grad_host(dy, x, g, mean, rstd, got, temps, copy=None, bits=None):
    """LayerNormGrad on the host: xhat once, a chunk (``host_rows``) at a
    time, into dx's bytes (without dx: the whole temporary ``temps[-1]``),
    dg = the column sums of dy * xhat and db those of dy (einsum over the
    whole arrays: one order whatever the chunks), then dx made over xhat in
    place, the row means einsum's (``_normalise_host``), mean(dxhat * xhat)
    one einsum of the two (no product array). ``temps``: dxhat (a chunk's)
    and the chunk's two row means with dx, then the whole xhat without dx.
    ``copy`` (uint16, x's size; ``bits``: to_bf16_bits's scratch): dx's
    bfloat16 bits too, each chunk's as its dx is done."""
    n = x.shape[-1]
    dy2, x2, mean1, rstd1 = dy.reshape(-1, n), x.reshape(-1, n), mean.reshape(-1), \
        rstd.reshape(-1)
    chunks, _ = host_rows(x)
    if "db" in got:
        np.einsum("ij->j", dy2, out=got["db"])
    if "dg" not in got and "dx" not in got:
        return
    xhat = (got["dx"] if "dx" in got else temps[-1]).reshape(-1, n)
    for s in chunks:
        _xhat(np, x2[s], mean1[s], rstd1[s], xhat[s])
    if "dg" in got:
        np.einsum("ij,ij->j", dy2, xhat, out=got["dg"])
    if "dx" not in got:
        return
    dxhat, a, c = temps[:3]
    for s in chunks:   # dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
        m = s.stop - s.start
        d, am, cm, dx = dxhat[:m], a[:m], c[:m], xhat[s]
        np.multiply(dy2[s], g, out=d)
        np.einsum("ij->i", d, out=am)
        am /= n
        np.einsum("ij,ij->i", d, dx, out=cm)
        cm /= n
        dx *= cm[:, None]
        np.subtract(d, dx, out=dx)
        dx -= am[:, None]
        dx *= rstd1[s][:, None]
        if copy is not None:
            to_bf16_bits(dx, copy.reshape(-1, n)[s], bits)


def _xhat(xp, x, mean, rstd, out):
    """out = (x - mean) * rstd, the normalised rows."""
    xp.subtract(x, mean[..., None], out=out)
    out *= rstd[..., None]


def _dx(xp, k, dy, g, rstd, xhat, dx, dxhat, a, c):
    """dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat =
    dy * g: temporaries dxhat (x's shape), a and c (x.shape[:-1] + (1,))."""
    xp.multiply(dy, g, out=dxhat)
    row_mean(xp, k, dxhat, a)
    xp.multiply(dxhat, xhat, out=dx)
    row_mean(xp, k, dx, c)
    xp.multiply(xhat, c, out=dx)
    xp.subtract(dxhat, dx, out=dx)
    dx -= a
    dx *= rstd[..., None]


@gradient("LayerNorm")
def _layer_norm_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    if dy is None:
        return
    x, w, b = op.inputs
    wanted = [(name, blob) for name, blob in (("dx", x), ("dg", w), ("db", b))
              if g.needs_grad(blob)]
    if wanted:
        g.emit("LayerNormGrad", [dy, x, w, op.outputs[1], op.outputs[2]],
               [g.grad_blob(blob) for _, blob in wanted],
               {"outputs": [name for name, _ in wanted]})
