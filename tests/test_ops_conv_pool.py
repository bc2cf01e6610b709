"""Conv and Pool against PyTorch (values and gradients, edge cases of stride,
pad, group, dilation and ceil_mode), plus float64 finite-difference checks."""
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from purine_mpi.base.errors import ShapeError
from purine_mpi.ops.catalog import get_kernel_class
from purine_mpi.ops import conv as conv_module
from purine_mpi.ops import pool as pool_module
from tests.opcheck import close, numeric_grad, run_op, torch_grads

RNG = np.random.default_rng(2)


def randn(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)




# ------------------------------------------------------------------- conv
CONV_CASES = [
    # x shape, w shape, attrs, bias
    ((2, 3, 7, 8), (4, 3, 3, 3), {"pad": 1}, True),
    ((2, 3, 9, 7), (5, 3, 3, 2), {"stride": [2, 1], "pad": [1, 0]}, False),
    ((2, 4, 9, 9), (6, 2, 3, 3), {"group": 2, "dilation": 2, "pad": 2}, True),
    ((3, 6, 5, 5), (6, 1, 1, 1), {"group": 6}, True),               # depthwise 1x1
    ((1, 2, 8, 6), (3, 2, 3, 3), {"stride": 3, "pad": 2, "dilation": [1, 2]}, True),
    ((2, 3, 5, 5), (2, 3, 5, 5), {}, True),                          # kernel = input
    ((2, 4, 7, 6), (6, 2, 3, 2), {"group": 2, "pad": [2, 0], "dilation": [2, 1]}, False),
    ((2, 3, 6, 6), (4, 3, 1, 1), {"pad": 1}, True),   # pad past the kernel: col2im dx
]


@pytest.mark.parametrize("x_shape,w_shape,attrs,bias", CONV_CASES)
def test_conv_matches_torch(x_shape, w_shape, attrs, bias):
    x, w, b = randn(*x_shape), randn(*w_shape), randn(w_shape[0])
    inputs = {"x": x, "w": w, "b": b} if bias else {"x": x, "w": w}
    outs, grads = run_op("Conv", attrs, inputs, wrt=list(inputs))

    def fn(xt, wt, *bt):
        return F.conv2d(xt, wt, bt[0] if bt else None, stride=attrs.get("stride", 1),
                        padding=attrs.get("pad", 0), dilation=attrs.get("dilation", 1),
                        groups=attrs.get("group", 1))
    y, expect = torch_grads(fn, list(inputs.values()), outs["_loss_weights"])
    close(outs[0], y)
    for name, g in zip(inputs, expect):
        close(grads[name], g)


@pytest.mark.parametrize("x_shape,w_shape,attrs,bias", [
    ((2, 32, 6, 6), (8, 32, 3, 3), {"pad": 1}, True),         # K = 288: one weight-grad GEMM
    ((3, 64, 5, 4), (6, 32, 3, 3), {"group": 2, "pad": 1}, False),  # per group, K = 288
    ((2, 4, 5, 5), (6, 2, 1, 1), {"group": 2}, True),          # 1x1 at stride 1: plain GEMMs
    ((2, 3, 4, 4), (5, 3, 1, 1), {"dilation": 2}, False),
    ((2, 3, 5, 5), (5, 3, 1, 1), {"stride": 2}, True),          # 1x1 strided: im2col
])
def test_conv_gemm_paths_match_torch(x_shape, w_shape, attrs, bias):
    """The CPU paths the cases above do not reach: the weight gradient as one
    GEMM over the batch (WGRAD_GEMM_MIN_K rows and more) and 1x1 convs
    without im2col."""
    test_conv_matches_torch(x_shape, w_shape, attrs, bias)


def test_conv_weight_grad_one_gemm_matches_per_sample(monkeypatch):
    x, w = randn(3, 32, 6, 5, dtype=np.float64), randn(4, 16, 3, 3, dtype=np.float64)
    attrs = {"pad": 1, "group": 2}
    _, batched = run_op("Conv", attrs, {"x": x, "w": w}, wrt=["w"])
    monkeypatch.setattr(conv_module, "COL_CHUNK_BYTES", 1)  # one sample per chunk
    _, chunked = run_op("Conv", attrs, {"x": x, "w": w}, wrt=["w"])
    monkeypatch.setattr(conv_module, "WGRAD_GEMM_MIN_K", 1 << 30)  # per-sample GEMMs
    _, per_sample = run_op("Conv", attrs, {"x": x, "w": w}, wrt=["w"])
    np.testing.assert_allclose(batched["w"], per_sample["w"], rtol=1e-12)
    np.testing.assert_allclose(chunked["w"], per_sample["w"], rtol=1e-12)


def test_conv_chunked_batch_matches_one_chunk(monkeypatch):
    x, w, b = randn(3, 2, 6, 6), randn(4, 2, 3, 3), randn(4)
    inputs = {"x": x, "w": w, "b": b}
    whole, whole_grads = run_op("Conv", {"pad": 1, "stride": 2}, inputs, wrt=["x", "w"])
    monkeypatch.setattr(conv_module, "COL_CHUNK_BYTES", 1)  # one sample per chunk
    chunked, chunked_grads = run_op("Conv", {"pad": 1, "stride": 2}, inputs, wrt=["x", "w"])
    close(chunked[0], whole[0])
    for name in ("x", "w"):
        close(chunked_grads[name], whole_grads[name])


@pytest.mark.parametrize("attrs,w_shape", [
    ({"pad": 2}, (4, 3, 5, 5)),
    ({"group": 3, "pad": [1, 0], "dilation": [2, 1]}, (6, 1, 3, 2)),
])
def test_conv_data_grad_as_conv_matches_col2im(monkeypatch, attrs, w_shape):
    """The CPU's stride-1 input gradient (the forward conv of dy with the
    flipped kernel) equals the col2im one, in float64 to rounding."""
    inputs = {"x": randn(3, 3, 7, 6, dtype=np.float64), "w": randn(*w_shape, dtype=np.float64)}
    geo = conv_module._geometry(attrs, inputs["x"].shape, w_shape)
    assert conv_module._transposed_geometry(geo) is not None
    _, fast = run_op("Conv", attrs, inputs, wrt=["x"])
    monkeypatch.setattr(conv_module, "_transposed_geometry", lambda geo: None)
    _, col2im = run_op("Conv", attrs, inputs, wrt=["x"])
    np.testing.assert_allclose(fast["x"], col2im["x"], rtol=1e-12, atol=1e-12)


def test_conv_numeric_grad():
    inputs = {"x": randn(2, 2, 5, 4, dtype=np.float64), "w": randn(4, 1, 3, 2, dtype=np.float64),
              "b": randn(4, dtype=np.float64)}
    attrs = {"group": 2, "stride": [2, 1], "pad": 1, "dilation": [1, 2]}
    weight = randn(2, 4, 3, 4, dtype=np.float64)
    _, grads = run_op("Conv", attrs, inputs, wrt=list(inputs), loss_weights=[weight])
    for name in inputs:
        close(grads[name], numeric_grad("Conv", attrs, inputs, name, weight),
              rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("x_shape,w_shape,attrs,match", [
    ((1, 3, 5, 5), (4, 2, 3, 3), {"group": 2}, "group"),
    ((1, 4, 5, 5), (4, 3, 3, 3), {}, "input channels"),
    ((1, 3, 2, 2), (4, 3, 3, 3), {}, "does not fit"),
    ((3, 5, 5), (4, 3, 3, 3), {}, "4-D"),
])
def test_conv_shape_errors(x_shape, w_shape, attrs, match):
    with pytest.raises(ShapeError, match=match):
        run_op("Conv", attrs, {"x": randn(*x_shape), "w": randn(*w_shape)})


# ------------------------------------------------------------------- pool
POOL_CASES = [
    # x shape, kernel, stride, pad, ceil_mode
    ((2, 3, 7, 8), 3, 2, 1, False),
    ((2, 3, 7, 8), 3, 2, 1, True),
    ((2, 2, 6, 6), 3, 2, 1, True),        # last window clipped at H + pad
    ((2, 2, 5, 5), 2, 2, 0, True),        # last window clipped at H, no pad
    ((2, 2, 6, 6), 2, 2, 0, False),
    ((1, 2, 9, 7), [3, 2], [2, 3], [1, 1], True),
    ((2, 2, 6, 5), 3, 1, 1, False),       # overlapping windows
    ((1, 2, 10, 10), 3, 3, 1, True),
]


def torch_pool(kind, kernel, stride, pad, ceil_mode):
    if kind == "max":
        return lambda t: F.max_pool2d(t, kernel, stride, pad, ceil_mode=ceil_mode)
    return lambda t: F.avg_pool2d(t, kernel, stride, pad, ceil_mode=ceil_mode,
                                  count_include_pad=True)


@pytest.mark.parametrize("kind", ["max", "ave"])
@pytest.mark.parametrize("x_shape,kernel,stride,pad,ceil_mode", POOL_CASES)
def test_pool_matches_torch(kind, x_shape, kernel, stride, pad, ceil_mode):
    x = randn(*x_shape)
    attrs = {"pool": kind, "kernel": kernel, "stride": stride, "pad": pad, "ceil_mode": ceil_mode}
    outs, grads = run_op("Pool", attrs, {"x": x}, wrt=["x"])
    y, (dx,) = torch_grads(torch_pool(kind, kernel, stride, pad, ceil_mode), [x],
                           outs["_loss_weights"])
    assert outs[0].shape == y.shape
    close(outs[0], y)
    close(grads["x"], dx)
    if kind == "max":  # the mask is torch's return_indices: h*W + w in the plane
        assert outs[1].dtype == np.int32 and len([k for k in outs if k != "_loss_weights"]) == 2
        _, indices = F.max_pool2d(torch.tensor(x), kernel, stride, pad, ceil_mode=ceil_mode,
                                  return_indices=True)
        np.testing.assert_array_equal(outs[1], indices.numpy())


@pytest.mark.parametrize("x_shape,kernel,stride,pad,ceil_mode", POOL_CASES + [
    ((3, 2, 16, 16), 3, 2, 0, True), ((2, 1, 8, 32), 2, 2, 0, False)])
def test_ave_pool_dense_gemm_equals_slice_adds(monkeypatch, x_shape, kernel, stride, pad,
                                               ceil_mode):
    """CPU average pooling of small planes as one GEMM with the dense pooling
    matrix equals the strided slice-adds (DENSE_MAX_PLANE 0), forward and
    backward, in float64; the slice-add path still matches torch in float32."""
    assert x_shape[2] * x_shape[3] <= pool_module.DENSE_MAX_PLANE
    attrs = {"pool": "ave", "kernel": kernel, "stride": stride, "pad": pad,
             "ceil_mode": ceil_mode}
    x = randn(*x_shape, dtype=np.float64)
    dense_out, dense = run_op("Pool", attrs, {"x": x}, wrt=["x"])
    monkeypatch.setattr(pool_module, "DENSE_MAX_PLANE", 0)
    geo = pool_module._geometry(attrs, x_shape)
    assert pool_module._dense_matrix(np, geo, np.float64) is None
    ref_out, ref = run_op("Pool", attrs, {"x": x}, wrt=["x"])
    np.testing.assert_allclose(dense_out[0], ref_out[0], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dense["x"], ref["x"], rtol=1e-12, atol=1e-14)
    x32 = x.astype(np.float32)
    outs, grads = run_op("Pool", attrs, {"x": x32}, wrt=["x"])
    y, (dx,) = torch_grads(torch_pool("ave", kernel, stride, pad, ceil_mode), [x32],
                           outs["_loss_weights"])
    close(outs[0], y)
    close(grads["x"], dx)


def test_ave_pool_dense_only_on_small_planes():
    """Planes above DENSE_MAX_PLANE keep the slice-adds (the GEMM's wasted
    flops grow with the plane)."""
    attrs = {"pool": "ave", "kernel": 3, "stride": 2}
    side = int(pool_module.DENSE_MAX_PLANE ** 0.5) + 1
    assert pool_module._dense_matrix(np, pool_module._geometry(attrs, (1, 1, side, side)),
                                     np.float32) is None
    mat = pool_module._dense_matrix(np, pool_module._geometry(attrs, (1, 1, 5, 5)), np.float32)
    assert mat.shape == (4, 25) and np.allclose(mat.sum(axis=1), 1.0)


@pytest.mark.parametrize("kind", ["max", "ave"])
def test_global_pool_matches_torch(kind):
    x = randn(2, 3, 5, 4)
    outs, grads = run_op("Pool", {"pool": kind, "global": True}, {"x": x}, wrt=["x"])
    y, (dx,) = torch_grads(torch_pool(kind, (5, 4), 1, 0, False), [x], outs["_loss_weights"])
    close(outs[0], y)
    close(grads["x"], dx)
    if kind == "max":
        np.testing.assert_array_equal(outs[1], x.reshape(2, 3, 20).argmax(2)[..., None, None])


def test_max_pool_ties_go_to_the_first_maximum():
    x = np.ones((1, 1, 4, 4), np.float32)
    outs, grads = run_op("Pool", {"pool": "max", "kernel": 2, "stride": 1}, {"x": x}, wrt=["x"],
                         loss_weights=[np.ones((1, 1, 3, 3), np.float32), None])
    np.testing.assert_array_equal(outs[1][0, 0], [[0, 1, 2], [4, 5, 6], [8, 9, 10]])
    _, (dx,) = torch_grads(torch_pool("max", 2, 1, 0, False), [x], np.ones((1, 1, 3, 3)))
    close(grads["x"], dx)


@pytest.mark.parametrize("kind", ["max", "ave"])
@pytest.mark.parametrize("pad,ceil_mode", [(1, True), (0, True), (0, False)])
def test_pool_chunks_give_the_same_bits(monkeypatch, kind, pad, ceil_mode):
    """Forward and backward pooling a sample at a time (the smallest chunk,
    each padded in the one reused buffer) and the whole batch at once agree
    bit for bit, overlaps and ceil mode included."""
    x = randn(5, 3, 11, 9)
    attrs = {"pool": kind, "kernel": 3, "stride": 2, "pad": pad, "ceil_mode": ceil_mode}
    results = []
    for chunk in (1, 1 << 40):
        monkeypatch.setattr(pool_module, "_CHUNK_BYTES", chunk)
        outs, grads = run_op("Pool", attrs, {"x": x}, wrt=["x"])
        results.append([outs[k] for k in outs if k != "_loss_weights"] + [grads["x"]])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["max", "ave"])
def test_pool_numeric_grad(kind):
    x = RNG.permutation(2 * 2 * 5 * 5).reshape(2, 2, 5, 5) / 10.0  # distinct: no max ties
    attrs = {"pool": kind, "kernel": 3, "stride": 2, "pad": 1, "ceil_mode": True}
    weight = randn(2, 2, 3, 3, dtype=np.float64)
    lw = [weight, None] if kind == "max" else [weight]
    _, grads = run_op("Pool", attrs, {"x": x}, wrt=["x"], loss_weights=lw)
    close(grads["x"], numeric_grad("Pool", attrs, {"x": x}, "x", lw), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("attrs,match", [
    ({"pool": "max", "kernel": 2, "pad": 2}, "pad < kernel"),
    ({"pool": "stochastic", "kernel": 2}, "'max' or 'ave'"),
    ({"pool": "max"}, "kernel"),
])
def test_pool_bad_attrs(attrs, match):
    with pytest.raises(ShapeError, match=match):
        run_op("Pool", attrs, {"x": randn(1, 1, 4, 4)})


@pytest.mark.parametrize("kernel,stride,size", [(3, 2, 9), (4, 3, 9), (2, 2, 9), (12, 1, 13)])
def test_max_pool_ties_nan_and_large_windows_match_torch(kernel, stride, size):
    # few distinct values: many ties (the first maximum wins, as in PyTorch);
    # a NaN propagates and the mask points at it; kernel 12 (144 > 127 slots)
    # takes the argmax path instead of the int8 rank
    x = RNG.integers(0, 3, (2, 3, size, size)).astype(np.float32)
    x[0, 0, 1, 1] = np.nan
    outs, grads = run_op("Pool", {"pool": "max", "kernel": kernel, "stride": stride},
                         {"x": x}, wrt=["x"])
    y_t, i_t = F.max_pool2d(torch.tensor(x), kernel, stride, return_indices=True)
    np.testing.assert_array_equal(outs[0], y_t.numpy())  # NaN == NaN here
    np.testing.assert_array_equal(outs[1], i_t.numpy())


@pytest.mark.parametrize("kernel,stride,pad,ceil_mode", [(3, 2, 0, True), (3, 1, 1, False),
                                                         (2, 2, 0, False)])
def test_max_pool_grad_scatter_matches_a_loop(kernel, stride, pad, ceil_mode):
    """The max-pool gradient (one add.at scatter per chunk) against a Python
    loop adding every dy at its argmax in the outputs' order, in float64: the
    same sums in the same order, so the same bits; many ties and overlapping
    windows, so inputs collect several dy."""
    x = RNG.integers(0, 3, (3, 2, 9, 8)).astype(np.float64)
    attrs = {"pool": "max", "kernel": kernel, "stride": stride, "pad": pad,
             "ceil_mode": ceil_mode}
    outs, _ = run_op("Pool", attrs, {"x": x})
    mask = outs[1]
    dy = randn(*mask.shape, dtype=np.float64)
    dx = np.empty_like(x)
    kernel_cls = get_kernel_class("PoolGrad")
    op = types.SimpleNamespace(name="g", attrs=dict(attrs, x_shape=list(x.shape)),
                               op_type="PoolGrad")
    kernel_cls(op).run([dy, mask], [dx])
    expect = np.zeros_like(x)
    for n, c, i, j in np.ndindex(*mask.shape):
        h, w = divmod(int(mask[n, c, i, j]), x.shape[3])
        expect[n, c, h, w] += dy[n, c, i, j]
    np.testing.assert_array_equal(dx, expect)
