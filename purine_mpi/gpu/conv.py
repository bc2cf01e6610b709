"""Convolution on a GPU by im2col + cuBLAS, with no temporaries.

The fallback when cuDNN is not used (``gpu/cudnn.py``), and the reference
the cuDNN path is tested against. Per chunk of the batch (chunks keep the
column buffer under ``COL_CHUNK_BYTES_GPU``; one chunk for the usual sizes):

    forward   cols = im2col(x)                       (raw kernel, into scratch)
              y[n, g] = W[g] @ cols[n, g]            (one strided-batched GEMM per group)
    data      dcols[n, g] = W[g]^T @ dy[n, g]        (idem, W transposed by cuBLAS)
              dx = col2im(dcols)                     (raw kernel)
    weight    part[n, g] = dy[n, g] @ cols[n, g]^T   (idem, cols transposed by cuBLAS)
              dW = sum_n part[n]                     (the column-sum kernels)

A 1x1, stride-1, unpadded convolution (NIN's cccp layers) uses its input as
the columns and writes dx directly. The column and partial buffers come
from the op's scratch (``Workspace.scratch_for``), reserved in ``setup``;
nothing is copied or transposed by CuPy, nothing is allocated per iteration.
Shapes follow ops/conv.py's geometry dict (N, C, H, W, O, kh, kw, sh, sw, ph,
pw, dh, dw, G, OH, OW).
"""
import numpy as np

from . import kernels
from .blas import gemm

#: bound on the scratch one chunk of the batch takes
COL_CHUNK_BYTES_GPU = 256 << 20


def pointwise(geo):
    """A 1x1 conv with stride 1, no padding: the input is its own columns."""
    return (geo["kh"] == geo["kw"] == 1 and geo["sh"] == geo["sw"] == 1
            and geo["ph"] == geo["pw"] == 0)


def _sizes(geo):
    G = geo["G"]
    kg = geo["C"] // G * geo["kh"] * geo["kw"]          # K of one group
    return G, geo["O"] // G, kg, geo["OH"] * geo["OW"]


def _per_sample(geo, which):
    """Scratch elements one sample takes: (columns, partial products)."""
    G, og, kg, L = _sizes(geo)
    cols = 0 if pointwise(geo) else G * kg * L
    if which == "data":
        return cols, 0
    return cols, (G * og * kg if which == "weight" else 0)


def chunk(geo, which, itemsize):
    """Samples per chunk for ``which`` in forward / data / weight."""
    cols, part = _per_sample(geo, which)
    per = (cols + part) * itemsize
    if per == 0:
        return geo["N"]
    return max(1, min(geo["N"], COL_CHUNK_BYTES_GPU // per))


def _batches(geo, which, itemsize):
    """(start, stop) of each chunk of samples for ``which`` (see ``chunk``)."""
    step = chunk(geo, which, itemsize)
    return [(start, min(start + step, geo["N"])) for start in range(0, geo["N"], step)]


def _specs(geo, which, dtype, n):
    cols, part = _per_sample(geo, which)
    specs = []
    if cols:
        specs.append(((n, cols), dtype))
    if part:   # the partial products, and the float64 partial sums of their column sum
        specs += [((n, part), dtype), kernels.bias_grad_scratch((n, part))]
    return specs


def scratch_specs(geo, which, dtype):
    """The (shape, dtype) of the scratch ``which`` (forward / data / weight)
    takes: the columns (and partial products) of one chunk of the batch."""
    dtype = np.dtype(dtype)
    return _specs(geo, which, dtype, chunk(geo, which, dtype.itemsize))


def reserve(scratch, geo, which, dtype):
    """Reserve the scratch of ``which`` (forward / data / weight)."""
    specs = scratch_specs(geo, which, dtype)
    if specs:
        scratch.reserve(*specs)


def _columns(x, geo, out):
    G, _, kg, L = _sizes(geo)
    n = x.shape[0]
    if pointwise(geo):
        return x.reshape(n, G, kg, L)
    kernels.im2col(x, geo["kh"], geo["kw"], geo["sh"], geo["sw"], geo["ph"], geo["pw"],
                   geo["dh"], geo["dw"], out=out.reshape(n, G * kg, L))
    return out.reshape(n, G, kg, L)


def forward(x, w, y, geo, scratch):
    """y = conv(x, w), no bias (the caller's epilogue adds it)."""
    G, og, kg, L = _sizes(geo)
    wmat = w.reshape(G, og, kg)
    y4 = y.reshape(geo["N"], G, og, L)
    for start, stop in _batches(geo, "forward", x.itemsize):
        buffers = scratch.take(*_specs(geo, "forward", x.dtype, stop - start))
        cols = _columns(x[start:stop], geo, buffers[0] if buffers else None)
        for g in range(G):
            gemm(wmat[g], cols[:, g], y4[start:stop, g])
    return y


def backward_data(dy, w, dx, geo, scratch):
    """dx = conv^T(dy, w)."""
    G, og, kg, L = _sizes(geo)
    wmat = w.reshape(G, og, kg)
    N = geo["N"]
    dy4 = dy.reshape(N, G, og, L)
    for start, stop in _batches(geo, "data", dy.itemsize):
        n = stop - start
        if pointwise(geo):
            dx4 = dx.reshape(N, G, kg, L)
            for g in range(G):
                gemm(wmat[g], dy4[start:stop, g], dx4[start:stop, g], trans_a=True)
            continue
        (dcols,) = scratch.take(*_specs(geo, "data", dy.dtype, n))
        d4 = dcols.reshape(n, G, kg, L)
        for g in range(G):
            gemm(wmat[g], dy4[start:stop, g], d4[:, g], trans_a=True)
        kernels.col2im(dcols.reshape(n, G * kg, L), (n,) + tuple(dx.shape[1:]), geo["kh"],
                       geo["kw"], geo["sh"], geo["sw"], geo["ph"], geo["pw"], geo["dh"],
                       geo["dw"], out=dx[start:stop])
    return dx


def backward_weight(dy, x, dw, geo, scratch):
    """dw = sum over samples of dy[n] @ cols(x[n])^T."""
    G, og, kg, L = _sizes(geo)
    N = geo["N"]
    dy4 = dy.reshape(N, G, og, L)
    for start, stop in _batches(geo, "weight", x.itemsize):
        n = stop - start
        buffers = scratch.take(*_specs(geo, "weight", x.dtype, n))
        cols = _columns(x[start:stop], geo, buffers[0] if len(buffers) == 3 else None)
        part = buffers[-2].reshape(n, G, og, kg)
        for g in range(G):
            gemm(dy4[start:stop, g], cols[:, g], part[:, g], trans_b=True)
        kernels.sum_rows(part.reshape(n, G * og * kg), dw.reshape(-1), accumulate=start > 0,
                         partial=buffers[-1])
    return dw
