"""cuda/layernorm.cu's warp-per-row kernels (every entry point: float32,
float64, y as bfloat16 bits, dy as bits, dx with its bits copy) on the
host-compiled kernels (``backend`` "host") and, marked ``gpu``, on CuPy.

Two references, independent of the kernels:

- the kernels' own float32 formula in NumPy with the row statistics from
  exactly rounded sums (``math.fsum``): the kernels change only the order of
  their double sums (lanes, then a warp butterfly; before, a 256-thread
  shared-memory tree), so on the host (no FMA contraction) their results are
  these bit for bit in float32 -- the bits the block-per-row kernels gave
  (in float64 the statistics keep the double sums' last bits, which depend
  on the order: tolerance only);
- float64 NumPy (and PyTorch CPU's ``layer_norm`` for y), with a tolerance
  of a few float32 ulps of the row's scale, which a wrong mean, rstd, lane
  stride or tail would exceed by orders of magnitude.

Shapes: odd widths (1, 3, 7, 130: the scalar path), multiples of four (8,
64, 768: the 16-byte path), row counts that are not multiples of the
block's warps (the emulated block is two warps; a GPU's eight), an offset
view (x not 16-byte aligned: the scalar path on a width of four)."""
import math

import numpy as np
import pytest

from purine_mpi.gpu import kernels

F32, F64 = np.float32, np.float64
SHAPES = [(1, 1), (3, 3), (5, 7), (2, 8), (7, 64), (3, 130), (5, 768)]


def _data(rows, cols, dtype, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * 2.0 + 3.0).astype(dtype)
    g = (1.0 + 0.5 * rng.standard_normal(cols)).astype(dtype)
    b = rng.standard_normal(cols).astype(dtype)
    dy = rng.standard_normal((rows, cols)).astype(dtype)
    return x, g, b, dy


def _bf16_bits(v):
    """float32 -> bfloat16 bits, to nearest, ties to even (finite values)."""
    u = np.asarray(v, F32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _widen(bits):
    return (bits.astype(np.uint32) << 16).view(F32)


def _formula_forward(x, g, b, eps):
    """The kernel's arithmetic in x's dtype, statistics exactly summed."""
    t = x.dtype.type
    rows, cols = x.shape
    y, mean, rstd = np.empty_like(x), np.empty(rows, x.dtype), np.empty(rows, x.dtype)
    for r in range(rows):
        mu = t(math.fsum(x[r].astype(F64)) / cols)
        d = (x[r] - mu).astype(F64)
        rs = t(1.0 / math.sqrt(math.fsum(d * d) / cols + eps))
        y[r] = ((x[r] - mu) * rs) * g + b
        mean[r], rstd[r] = mu, rs
    return y, mean, rstd


def _formula_backward(dy, x, g, mean, rstd):
    t = x.dtype.type
    rows, cols = x.shape
    dx, dyxhat = np.empty_like(x), np.empty_like(x)
    for r in range(rows):
        xhat = (x[r] - mean[r]) * rstd[r]
        dxhat = dy[r] * g
        a = t(math.fsum(dxhat.astype(F64)) / cols)
        k = t(math.fsum(dxhat.astype(F64) * xhat.astype(F64)) / cols)
        dx[r] = ((dxhat - xhat * k) - a) * rstd[r]
        dyxhat[r] = dy[r] * xhat
    return dx, dyxhat


def _truth_forward(x, g, b, eps):
    x = x.astype(F64)
    mu = x.mean(axis=1, keepdims=True)
    rs = 1.0 / np.sqrt(((x - mu) ** 2).mean(axis=1, keepdims=True) + eps)
    return (x - mu) * rs * g.astype(F64) + b.astype(F64), mu[:, 0], rs[:, 0]


def _truth_backward(dy, x, g, eps):
    x, dy, g = x.astype(F64), dy.astype(F64), g.astype(F64)
    mu = x.mean(axis=1, keepdims=True)
    rs = 1.0 / np.sqrt(((x - mu) ** 2).mean(axis=1, keepdims=True) + eps)
    xhat, dxhat = (x - mu) * rs, dy * g
    dx = (dxhat - xhat * (dxhat * xhat).mean(axis=1, keepdims=True)
          - dxhat.mean(axis=1, keepdims=True)) * rs
    return dx, dy * xhat


def _close(got, truth, dtype, ulps, what):
    """Within ``ulps`` of dtype's epsilon times each row's largest |truth|."""
    scale = np.maximum(np.abs(truth).max(axis=-1, keepdims=True), 1e-30)
    err = (np.abs(got.astype(F64) - truth) / scale).max()
    assert err <= ulps * np.finfo(dtype).eps, (what, err / np.finfo(dtype).eps)


def _exact(backend, got, want, what):
    """float32 on the host (g++ -O1, no FMA): the NumPy formula's bits (the
    double sums round to float32 once; float64 keeps their last bits, which
    depend on the order: only the tolerance there)."""
    if backend.name == "host" and np.asarray(want).dtype == F32:
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                      np.asarray(want).view(np.uint8), err_msg=what)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_forward_and_backward_against_the_formula_and_float64(backend, dtype, rows, cols):
    eps = 1e-5
    x, g, b, dy = _data(rows, cols, dtype, rows * 1000 + cols)
    d, h = backend.to_device, backend.to_host
    y, mean, rstd = d(np.zeros_like(x)), d(np.zeros(rows, dtype)), d(np.zeros(rows, dtype))
    kernels.layernorm_forward(d(x), d(g), d(b), eps, y, mean, rstd)
    fy, fmean, frstd = _formula_forward(x, g, b, eps)
    for got, want, what in ((y, fy, "y"), (mean, fmean, "mean"), (rstd, frstd, "rstd")):
        _exact(backend, h(got), want, what)
    ty, tmean, trstd = _truth_forward(x, g, b, eps)
    _close(h(y), ty, dtype, 8, "y")
    # float32: the statistics rounded once from double sums; float64: the
    # sums' own rounding (any order: ~sqrt(cols) ulps, bounded by cols)
    stat_ulps = (2, 4) if dtype == F32 else (32, 32)
    _close(h(mean)[:, None], tmean[:, None], dtype, stat_ulps[0], "mean")
    _close(h(rstd)[:, None], trstd[:, None], dtype, stat_ulps[1], "rstd")
    if dtype == F32:   # PyTorch CPU as an oracle of y
        torch = pytest.importorskip("torch")
        ref = torch.nn.functional.layer_norm(torch.from_numpy(x.astype(F64)), (cols,),
                                             torch.from_numpy(g.astype(F64)),
                                             torch.from_numpy(b.astype(F64)), eps).numpy()
        _close(h(y), ref, dtype, 8, "y against torch")
    dx, dyxhat = d(np.zeros_like(x)), d(np.zeros_like(x))
    kernels.layernorm_backward(d(dy), d(x), d(g), mean, rstd, dx=dx, dyxhat=dyxhat)
    fdx, fdyxhat = _formula_backward(dy, x, g, h(mean), h(rstd))
    _exact(backend, h(dx), fdx, "dx")
    _exact(backend, h(dyxhat), fdyxhat, "dyxhat")
    tdx, tdyxhat = _truth_backward(dy, x, g, eps)
    # dx cancels (its row sums vanish): measured against dy * g * rstd's scale
    scale = np.abs(dy.astype(F64) * g * trstd[:, None]).max(axis=1, keepdims=True)
    err = (np.abs(h(dx).astype(F64) - tdx) / scale).max()
    assert err <= 16 * np.finfo(dtype).eps, ("dx", err / np.finfo(dtype).eps)
    _close(h(dyxhat), tdyxhat, dtype, 8, "dyxhat")
    # dx alone (no dyxhat), and in place over dy: the same bits
    dyin = d(dy)
    kernels.layernorm_backward(dyin, d(x), d(g), mean, rstd, dx=dyin)
    np.testing.assert_array_equal(h(dyin), h(dx))


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_bits_entry_points_against_the_float32_ones(backend, rows, cols):
    """y as bfloat16 bits is the float32 y rounded; a bits dy gives the
    widened dy's dx; the copy is dx's bfloat16 bits (every variant on the
    vectorised and the scalar path)."""
    eps = 1e-5
    x, g, b, dy = _data(rows, cols, F32, 7 * rows + cols)
    d, h = backend.to_device, backend.to_host
    y, mean, rstd = d(np.zeros_like(x)), d(np.zeros(rows, F32)), d(np.zeros(rows, F32))
    kernels.layernorm_forward(d(x), d(g), d(b), eps, y, mean, rstd)
    ybits = d(np.zeros(x.shape, np.uint16))
    m2, r2 = d(np.zeros(rows, F32)), d(np.zeros(rows, F32))
    kernels.layernorm_forward(d(x), d(g), d(b), eps, ybits, m2, r2)
    np.testing.assert_array_equal(h(ybits), _bf16_bits(h(y)))
    np.testing.assert_array_equal(h(m2), h(mean))
    dyb = _bf16_bits(dy)
    dx32, p32 = d(np.zeros_like(x)), d(np.zeros_like(x))
    kernels.layernorm_backward(d(_widen(dyb)), d(x), d(g), mean, rstd, dx=dx32, dyxhat=p32)
    dx, p = d(np.zeros_like(x)), d(np.zeros_like(x))
    kernels.layernorm_backward(d(dyb), d(x), d(g), mean, rstd, dx=dx, dyxhat=p)
    np.testing.assert_array_equal(h(dx), h(dx32))
    np.testing.assert_array_equal(h(p), h(p32))
    for bits_dy in (False, True):
        dxc, copy = d(np.zeros_like(x)), d(np.zeros(x.shape, np.uint16))
        kernels.layernorm_backward(d(dyb) if bits_dy else d(_widen(dyb)), d(x), d(g), mean,
                                   rstd, dx=dxc, copy=copy)
        np.testing.assert_array_equal(h(dxc), h(dx32))
        np.testing.assert_array_equal(h(copy), _bf16_bits(h(dx32)))
    # the copy over the bits dy's own bytes (the memory plan's place for it)
    dyin, dxc = d(dyb.copy()), d(np.zeros_like(x))
    kernels.layernorm_backward(dyin, d(x), d(g), mean, rstd, dx=dxc, copy=dyin)
    np.testing.assert_array_equal(h(dyin), _bf16_bits(h(dx32)))


def test_an_unaligned_view_takes_the_scalar_path_with_the_same_bits(backend):
    """x one element into a buffer (not 16-byte aligned) on a width of 64:
    the kernel reads it one element at a time, the same results."""
    eps = 1e-5
    x, g, b, _ = _data(6, 64, F32, 3)
    d, h = backend.to_device, backend.to_host
    y, mean, rstd = d(np.zeros_like(x)), d(np.zeros(6, F32)), d(np.zeros(6, F32))
    kernels.layernorm_forward(d(x), d(g), d(b), eps, y, mean, rstd)
    buf = d(np.concatenate([np.zeros(1, F32), x.ravel()]))
    xo = buf[1:].reshape(x.shape)
    yo, mo, ro = d(np.zeros_like(x)), d(np.zeros(6, F32)), d(np.zeros(6, F32))
    kernels.layernorm_forward(xo, d(g), d(b), eps, yo, mo, ro)
    np.testing.assert_array_equal(h(yo), h(y))
    np.testing.assert_array_equal(h(ro), h(rstd))


@pytest.mark.parametrize("rows,cols", [(5, 7), (7, 64), (3, 768)])
def test_in_place_over_x_and_dyxhat_alone(backend, rows, cols):
    """y over x (forward), dx over x (backward), and the backward with
    dyxhat only (``has_dx`` 0: no warp sums, every warp alike): the bits of
    the out-of-place runs, on the scalar and the vectorised path, row
    counts that leave the last warps of the grid without a row."""
    eps = 1e-5
    x, g, b, dy = _data(rows, cols, F32, 11 * rows + cols)
    d, h = backend.to_device, backend.to_host
    y, mean, rstd = d(np.zeros_like(x)), d(np.zeros(rows, F32)), d(np.zeros(rows, F32))
    kernels.layernorm_forward(d(x), d(g), d(b), eps, y, mean, rstd)
    xin, m2, r2 = d(x.copy()), d(np.zeros(rows, F32)), d(np.zeros(rows, F32))
    kernels.layernorm_forward(xin, d(g), d(b), eps, xin, m2, r2)
    np.testing.assert_array_equal(h(xin), h(y))
    np.testing.assert_array_equal(h(m2), h(mean))
    np.testing.assert_array_equal(h(r2), h(rstd))
    dx, p = d(np.zeros_like(x)), d(np.zeros_like(x))
    kernels.layernorm_backward(d(dy), d(x), d(g), mean, rstd, dx=dx, dyxhat=p)
    xin = d(x.copy())
    kernels.layernorm_backward(d(dy), xin, d(g), mean, rstd, dx=xin)
    np.testing.assert_array_equal(h(xin), h(dx))
    p2 = d(np.full(x.shape, np.nan, F32))
    kernels.layernorm_backward(d(dy), d(x), d(g), mean, rstd, dyxhat=p2)
    np.testing.assert_array_equal(h(p2), h(p))
