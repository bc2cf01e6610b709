"""CUDA kernel wrappers (purine_mpi.gpu.kernels) against NumPy references.

Three layers, each needing less hardware than the last:
1. tests/gpu_reference.py against PyTorch (CPU): the references are right.
2. the wrappers against the references on two backends:
   - "cupy": real CuPy on a GPU (skipped without CuPy and a CUDA device);
   - "host": the same .cu sources compiled as host C++ with g++ and a few
     stand-ins for CUDA built-ins, launched through a NumPy-backed stand-in
     for CuPy. Each launch runs as a serial loop over a small (block, thread)
     grid, and every argument is checked against the kernel's C signature,
     so wrong argument order, count or scalar type fails here as it would
     corrupt memory on a GPU. This checks the kernels' arithmetic and the
     wrappers' launch code on any machine with g++.
3. GPU-only helpers (streams, events, pinned memory), skipped without a GPU.
"""
import importlib
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import purine_mpi.gpu as gpu
from purine_mpi.gpu import kernels
from tests import gpu_reference as ref
from tests.emulated_gpu import capture as sim_capture
from tests.emulated_gpu import use_emulated_nvmath
from tests.conftest import cuda_cupy_or_skip as _gpu_cupy

IM2COL_CASES = [  # N, C, H, W, kh, kw, sh, sw, ph, pw, dh, dw
    (2, 3, 7, 6, 3, 3, 1, 1, 1, 1, 1, 1),
    (1, 2, 8, 9, 3, 2, 2, 3, 1, 0, 1, 1),
    (2, 2, 9, 8, 3, 3, 2, 1, 2, 1, 2, 3),
    (1, 1, 5, 5, 1, 1, 1, 1, 0, 0, 1, 1),
]
POOL_CASES = [  # N, C, H, W, kh, kw, sh, sw, ph, pw, ceil_mode
    (2, 3, 7, 7, 3, 3, 2, 2, 1, 1, True),
    (2, 3, 7, 7, 3, 3, 2, 2, 1, 1, False),
    (1, 2, 6, 8, 2, 2, 2, 2, 0, 0, False),
    (1, 2, 8, 7, 3, 2, 3, 2, 1, 0, True),
    (1, 1, 5, 6, 1, 1, 3, 3, 0, 0, True),  # stride > kernel: ceil clip at pad 0
]
LRN_CASES = [  # shape, local_size, alpha, beta, k
    ((2, 7, 3, 4), 5, 0.5, 0.75, 2.0),
    ((1, 4, 2, 2), 3, 1e-4, 0.75, 1.0),
    ((2, 3, 1, 1), 7, 0.3, 0.6, 1.5),    # window wider than the channels
]
SOFTMAX_CASES = [  # logits shape, ignore_label
    ((4, 5), None),
    ((6, 5), 2),
    ((2, 3, 2, 3), None),
    ((2, 4, 3, 2), -1),
]


def _rng(seed=0):
    return np.random.default_rng(seed)


def _labels(rng, shape, classes, ignore_label):
    labels = rng.integers(0, classes, size=shape)
    if ignore_label is not None:
        labels.reshape(-1)[::3] = ignore_label  # every third position ignored
    return labels


def _t(array, grad=False):
    return torch.tensor(array, requires_grad=grad)


# ------------------------------------------- 1. references against torch ---

@pytest.mark.parametrize("case", IM2COL_CASES)
def test_reference_im2col_col2im_match_torch(case):
    n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw = case
    x = _rng().standard_normal((n, c, h, w))
    geometry = dict(kernel_size=(kh, kw), dilation=(dh, dw), padding=(ph, pw), stride=(sh, sw))
    cols = ref.im2col(x, kh, kw, sh, sw, ph, pw, dh, dw)
    np.testing.assert_allclose(cols, F.unfold(_t(x), **geometry).numpy(), rtol=0, atol=0)
    image = ref.col2im(cols, x.shape, kh, kw, sh, sw, ph, pw, dh, dw)
    expected = F.fold(_t(cols), output_size=(h, w), **geometry).numpy()
    np.testing.assert_allclose(image, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", POOL_CASES)
def test_reference_pooling_matches_torch(case):
    n, c, h, w, kh, kw, sh, sw, ph, pw, ceil_mode = case
    x = _rng().standard_normal((n, c, h, w))
    args = (kh, kw, sh, sw, ph, pw)
    geometry = dict(kernel_size=(kh, kw), stride=(sh, sw), padding=(ph, pw), ceil_mode=ceil_mode)

    xt = _t(x, grad=True)
    yt, indices = F.max_pool2d(xt, return_indices=True, **geometry)
    dy = _rng(1).standard_normal(yt.shape)
    yt.backward(_t(dy))
    y, mask = ref.maxpool_forward(x, *args, ceil_mode=ceil_mode)
    np.testing.assert_array_equal(y, yt.detach().numpy())
    np.testing.assert_array_equal(mask, indices.numpy())
    assert mask.dtype == np.int32
    np.testing.assert_allclose(ref.maxpool_backward(dy, mask, x.shape), xt.grad.numpy(),
                               rtol=1e-12, atol=1e-12)

    xt = _t(x, grad=True)
    yt = F.avg_pool2d(xt, count_include_pad=True, **geometry)
    yt.backward(_t(dy))
    np.testing.assert_allclose(ref.avepool_forward(x, *args, ceil_mode=ceil_mode),
                               yt.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ref.avepool_backward(dy, x.shape, *args), xt.grad.numpy(),
                               rtol=1e-12, atol=1e-12)


def test_pool_output_size_matches_torch():
    x = torch.zeros(1, 1, 12, 1, dtype=torch.float64)
    for size in range(1, 13):
        for kernel in range(1, 5):
            for stride in range(1, 5):
                for pad in range(kernel // 2 + 1):
                    for ceil_mode in (False, True):
                        expected = ref.pool_out_size(size, kernel, stride, pad, ceil_mode)
                        got = kernels.pool_output_size(size, kernel, stride, pad, ceil_mode)
                        assert got == expected
                        if expected < 1:
                            continue
                        y = F.max_pool2d(x[:, :, :size], (kernel, 1), (stride, 1), (pad, 0),
                                         ceil_mode=ceil_mode)
                        assert y.shape[2] == expected, (size, kernel, stride, pad, ceil_mode)


@pytest.mark.parametrize("case", LRN_CASES)
def test_reference_lrn_matches_torch(case):
    shape, size, alpha, beta, k = case
    x = _rng().standard_normal(shape)
    xt = _t(x, grad=True)
    yt = F.local_response_norm(xt, size, alpha=alpha, beta=beta, k=k)
    dy = _rng(1).standard_normal(shape)
    yt.backward(_t(dy))
    y, scale = ref.lrn_forward(x, size, alpha, beta, k)
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(x * scale ** -beta, y, rtol=1e-12)
    dx = ref.lrn_backward(x, y, scale, dy, size, alpha, beta)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", SOFTMAX_CASES)
def test_reference_softmax_loss_matches_torch(case):
    shape, ignore_label = case
    rng = _rng()
    x = 3 * rng.standard_normal(shape)
    labels = _labels(rng, (shape[0],) + shape[2:], shape[1], ignore_label)
    ignore_index = -100 if ignore_label is None else ignore_label
    xt = _t(x, grad=True)
    per_position = F.cross_entropy(xt, torch.tensor(labels), reduction="none",
                                   ignore_index=ignore_index)
    F.cross_entropy(xt, torch.tensor(labels), ignore_index=ignore_index).backward()

    prob, loss, valid = ref.softmax_loss_forward(x, labels, ignore_label)
    np.testing.assert_allclose(prob, F.softmax(_t(x), dim=1).numpy(), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(loss, per_position.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(valid, (labels != ignore_index).astype(float))
    # Batch mean over valid positions (Caffe's VALID normalization).
    dx = ref.softmax_loss_backward(prob, labels, 1.0 / valid.sum(), ignore_label)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-10, atol=1e-14)


def test_reference_sgd_momentum_matches_torch():
    rng = _rng()
    w = rng.standard_normal((4, 3))
    grads = [rng.standard_normal((4, 3)) for _ in range(3)]
    wt = _t(w.copy(), grad=True)
    optimizer = torch.optim.SGD([wt], lr=0.1, momentum=0.9, weight_decay=0.01)
    v = np.zeros_like(w)
    for g in grads:
        wt.grad = _t(g)
        optimizer.step()
        ref.sgd_momentum_update(w, g, v, lr=0.1, momentum=0.9, weight_decay=0.01)
    # With a constant lr, Caffe's v equals lr times torch's momentum buffer.
    np.testing.assert_allclose(w, wt.detach().numpy(), rtol=1e-12, atol=1e-12)


# ---------------------------------------- 2b. wrappers against references ---

DTYPES = [np.float32, np.float64]


def _close(got, expected, dtype):
    tight = dtype == np.float64
    np.testing.assert_allclose(got, expected, rtol=1e-12 if tight else 2e-5,
                               atol=1e-12 if tight else 2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", IM2COL_CASES)
def test_im2col_col2im(backend, case, dtype):
    n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw = case
    geometry = (kh, kw, sh, sw, ph, pw, dh, dw)
    x = _rng().standard_normal((n, c, h, w)).astype(dtype)
    cols = kernels.im2col(backend.to_device(x), *geometry)
    expected = ref.im2col(x, *geometry)
    assert cols.dtype == dtype
    _close(backend.to_host(cols), expected, dtype)
    image = kernels.col2im(backend.to_device(expected), x.shape, *geometry)
    _close(backend.to_host(image), ref.col2im(expected, x.shape, *geometry), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", POOL_CASES)
def test_pooling(backend, case, dtype):
    n, c, h, w, kh, kw, sh, sw, ph, pw, ceil_mode = case
    args = (kh, kw, sh, sw, ph, pw)
    x = _rng().standard_normal((n, c, h, w)).astype(dtype)
    y, mask = kernels.maxpool_forward(backend.to_device(x), *args, ceil_mode=ceil_mode)
    y_ref, mask_ref = ref.maxpool_forward(x, *args, ceil_mode=ceil_mode)
    np.testing.assert_array_equal(backend.to_host(y), y_ref)
    np.testing.assert_array_equal(backend.to_host(mask), mask_ref)
    assert mask.dtype == np.int32
    dy = _rng(1).standard_normal(y_ref.shape).astype(dtype)
    dx = kernels.maxpool_backward(backend.to_device(dy), mask, x.shape, *args)
    _close(backend.to_host(dx), ref.maxpool_backward(dy, mask_ref, x.shape), dtype)

    y = kernels.avepool_forward(backend.to_device(x), *args, ceil_mode=ceil_mode)
    _close(backend.to_host(y), ref.avepool_forward(x, *args, ceil_mode=ceil_mode), dtype)
    dx = kernels.avepool_backward(backend.to_device(dy), x.shape, *args)
    _close(backend.to_host(dx), ref.avepool_backward(dy, x.shape, *args), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", LRN_CASES)
def test_lrn(backend, case, dtype):
    shape, size, alpha, beta, k = case
    x = _rng().standard_normal(shape).astype(dtype)
    dy = _rng(1).standard_normal(shape).astype(dtype)
    y, scale = kernels.lrn_forward(backend.to_device(x), size, alpha, beta, k)
    y_ref, scale_ref = ref.lrn_forward(x, size, alpha, beta, k)
    _close(backend.to_host(y), y_ref, dtype)
    _close(backend.to_host(scale), scale_ref, dtype)
    dx = kernels.lrn_backward(*(backend.to_device(a) for a in (x, y_ref, scale_ref, dy)),
                              size, alpha, beta)
    _close(backend.to_host(dx), ref.lrn_backward(x, y_ref, scale_ref, dy, size, alpha, beta),
           dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SOFTMAX_CASES)
def test_softmax_loss(backend, case, dtype):
    shape, ignore_label = case
    rng = _rng()
    x = (3 * rng.standard_normal(shape)).astype(dtype)
    labels = _labels(rng, (shape[0],) + shape[2:], shape[1], ignore_label)
    prob, loss, valid = kernels.softmax_loss_forward(
        backend.to_device(x), backend.to_device(labels), ignore_label)
    expected = ref.softmax_loss_forward(x, labels, ignore_label)
    for got, want in zip((prob, loss, valid), expected):
        assert got.shape == want.shape and got.dtype == dtype
        _close(backend.to_host(got), want, dtype)
    scale = 1.0 / expected[2].sum()
    dx_ref = ref.softmax_loss_backward(expected[0], labels, scale, ignore_label)
    for scale_arg in (scale, backend.to_device(np.array([scale], dtype))):
        dx = kernels.softmax_loss_backward(backend.to_device(expected[0]),
                                           backend.to_device(labels), scale_arg, ignore_label)
        _close(backend.to_host(dx), dx_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 7), (2, 5, 3, 2), (3, 1, 4)])
@pytest.mark.parametrize("in_place", [False, True])
def test_softmax_alone_and_its_gradient(backend, shape, dtype, in_place):
    """The Softmax op's kernels against NumPy: softmax over axis 1
    (max-shifted: logits of +-80 do not overflow float32's exp) and
    dx = y * (dy - sum_c dy * y); with ``in_place`` the output is the input."""
    rng = _rng()
    x = (30 * rng.standard_normal(shape)).astype(dtype)
    y_ref = ref.softmax_forward(x)
    xd = backend.to_device(x)
    y = kernels.softmax_forward(xd, out=xd if in_place else None)
    assert y.shape == x.shape and y.dtype == dtype
    _close(backend.to_host(y), y_ref, dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    dx_ref = ref.softmax_backward(dy, y_ref)
    dyd = backend.to_device(dy)
    dx = kernels.softmax_backward(dyd, backend.to_device(y_ref),
                                  out=dyd if in_place else None)
    _close(backend.to_host(dx), dx_ref, dtype)
    with pytest.raises(ValueError, match="differ"):
        kernels.softmax_backward(backend.to_device(dy[:1]), backend.to_device(y_ref))


def test_softmax_loss_bad_label_gives_nan(backend):
    x = np.zeros((2, 3))
    _, loss, _ = kernels.softmax_loss_forward(backend.to_device(x),
                                              backend.to_device(np.array([1, 7])))
    loss = backend.to_host(loss)
    assert np.isfinite(loss[0]) and np.isnan(loss[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_sgd_momentum_update_in_place(backend, dtype):
    rng = _rng()
    w = rng.standard_normal((5, 7)).astype(dtype)
    v = np.zeros_like(w)
    w_dev, v_dev = backend.to_device(w), backend.to_device(v)
    lr_blob = backend.to_device(np.array([0.05], dtype))
    for step in range(3):
        g = rng.standard_normal(w.shape).astype(dtype)
        lr = 0.05 if step % 2 else lr_blob  # a number, or a learning-rate blob
        kernels.sgd_momentum_update(w_dev, backend.to_device(g), v_dev, lr, momentum=0.9,
                                    weight_decay=5e-4, grad_scale=0.5)
        ref.sgd_momentum_update(w, g, v, 0.05, momentum=0.9, weight_decay=5e-4,
                                grad_scale=0.5)
    _close(backend.to_host(w_dev), w, dtype)
    _close(backend.to_host(v_dev), v, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_forward_backward(backend, dtype):
    """The device draws the CPU's Philox mask (bit for bit), with the
    iteration as a number or as a device blob."""
    from purine_mpi.base.philox import keep_mask
    x = _rng().standard_normal((3, 4, 5)).astype(dtype)   # 60: not a multiple of 4 blocks
    for it in (0, 7, backend.to_device(np.array(7, np.int64))):
        y, mask = kernels.dropout_forward(backend.to_device(x), it, 0.3, 11, 22, 33)
        keep = keep_mask(x.shape, 0.3, 11, 22, 33, 7 if not isinstance(it, int) else it)
        y_ref, mask_ref = ref.dropout_forward(x, keep, 0.3)
        np.testing.assert_array_equal(backend.to_host(mask), mask_ref)
        np.testing.assert_array_equal(backend.to_host(y), y_ref)
        assert mask.dtype == dtype
    dy = _rng(1).standard_normal(x.shape).astype(dtype)
    dx = kernels.dropout_backward(backend.to_device(dy), mask, 0.3)
    np.testing.assert_array_equal(backend.to_host(dx), ref.dropout_forward(dy, keep, 0.3)[0])


def test_out_arguments(backend):
    x = _rng().standard_normal((1, 2, 4, 4))
    y = backend.to_device(np.empty((1, 2, 2, 2)))
    mask = backend.to_device(np.empty((1, 2, 2, 2), np.int32))
    got_y, got_mask = kernels.maxpool_forward(backend.to_device(x), 2, 2, 2, 2, out=(y, mask))
    assert got_y is y and got_mask is mask                 # filled in place
    y_ref, _ = ref.maxpool_forward(x, 2, 2, 2, 2)
    np.testing.assert_array_equal(backend.to_host(y), y_ref)
    # A non-contiguous out (a view into a bigger buffer) is filled too.
    buffer = backend.to_device(np.zeros((1, 2, 2, 4)))
    view = buffer[:, :, :, ::2]
    kernels.avepool_forward(backend.to_device(x), 2, 2, 2, 2, out=view)
    np.testing.assert_allclose(backend.to_host(buffer)[:, :, :, ::2],
                               ref.avepool_forward(x, 2, 2, 2, 2))
    assert not backend.to_host(buffer)[:, :, :, 1::2].any()
    # Non-contiguous inputs are fine.
    x_transposed = backend.to_device(np.ascontiguousarray(x.transpose(0, 1, 3, 2)))
    y = kernels.avepool_forward(x_transposed.transpose(0, 1, 3, 2), 2, 2, 2, 2)
    np.testing.assert_allclose(backend.to_host(y), ref.avepool_forward(x, 2, 2, 2, 2))


def test_errors_a_user_can_act_on(backend):
    x = backend.to_device(np.zeros((1, 2, 4, 4)))
    with pytest.raises(TypeError, match="float32 and float64"):
        kernels.im2col(backend.to_device(np.zeros((1, 1, 3, 3), np.float16)), 3, 3)
    with pytest.raises(ValueError, match="local_size must be odd"):
        kernels.lrn_forward(x, 4)
    with pytest.raises(ValueError, match="smaller than the kernel"):
        kernels.maxpool_forward(x, 2, 2, 2, 2, 2, 2)
    with pytest.raises(ValueError, match="expected"):
        kernels.im2col(x, 3, 3, out=backend.to_device(np.zeros((1, 1, 1))))
    with pytest.raises(ValueError, match="ratio"):
        kernels.dropout_forward(x, 0, 1.0, 0, 0)
    with pytest.raises(ValueError, match="one label per position"):
        kernels.softmax_loss_forward(backend.to_device(np.zeros((2, 3))),
                                     backend.to_device(np.zeros(3, np.int32)))


# ------------------------------------------------ loader and misc (any CPU) ---

def test_kernel_source_points_errors_at_the_file():
    text = gpu.kernel_source("pooling")
    first = text.splitlines()[0]
    assert first == f'#line 1 "{(gpu.CUDA_DIR / "pooling.cu").resolve()}"'
    assert text.endswith((gpu.CUDA_DIR / "pooling.cu").read_text())
    with pytest.raises(Exception, match="PURINE_CUDA_DIR"):
        gpu.kernel_source("no_such_kernel")


def test_set_tf32_sets_cupy_variable(monkeypatch):
    monkeypatch.delenv("CUPY_TF32", raising=False)
    gpu.set_tf32(True)
    assert gpu.tf32_enabled()
    gpu.set_tf32(False)
    assert not gpu.tf32_enabled()


def test_streams_import_without_cupy():
    from purine_mpi.gpu import streams
    pool = streams.StreamPool()
    assert len(pool) == 0
    try:
        import cupy  # noqa: F401
    except ImportError:
        from purine_mpi.base.errors import UserError
        with pytest.raises(UserError, match="CuPy"):
            pool.get(0)


# ------------------------------------------------------- 3. GPU-only helpers ---

@pytest.mark.gpu
def test_streams_events_and_pinned_memory_on_gpu():
    cupy = _gpu_cupy()
    from purine_mpi.gpu import streams
    pool = streams.StreamPool()
    first, second = pool.get(0, "compute"), pool.get(0, "comm")
    assert pool.get(0, "compute") is first and first is not second
    staging = streams.pinned_empty((4, 3), np.float32)
    assert staging.shape == (4, 3) and staging.dtype == np.float32
    staging[...] = np.arange(12).reshape(4, 3)
    with first:
        a = cupy.asarray(staging) * 2
    done = streams.record_event(first)
    streams.wait_event(second, done)
    with second:
        b = a + 1
    second.synchronize()
    assert streams.event_done(done)
    np.testing.assert_array_equal(cupy.asnumpy(b), np.arange(12).reshape(4, 3) * 2 + 1)
    pool.synchronize()


@pytest.mark.gpu
def test_tf32_matmul_on_gpu():
    cupy = _gpu_cupy()
    a = cupy.asarray(_rng().standard_normal((64, 64)).astype(np.float32))
    exact = cupy.asnumpy(a).astype(np.float64) @ cupy.asnumpy(a).astype(np.float64)
    try:
        gpu.set_tf32(True)
        np.testing.assert_allclose(cupy.asnumpy(a @ a), exact, rtol=0, atol=0.1)
    finally:
        gpu.set_tf32(False)
    np.testing.assert_allclose(cupy.asnumpy(a @ a), exact, rtol=0, atol=1e-3)


# ------------------------------------------------------------------ cuBLAS ---

GEMM_CASES = [  # a shape, b shape, trans_a, trans_b, batch slicing
    ((5, 7), (7, 3), False, False),
    ((7, 5), (7, 3), True, False),
    ((5, 7), (3, 7), False, True),
    ((7, 5), (3, 7), True, True),
    ((4, 5, 7), (4, 7, 3), False, False),
    ((5, 7), (4, 7, 3), False, False),        # a broadcast over the batch (stride 0)
    ((4, 7, 5), (3, 7), True, True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GEMM_CASES)
def test_gemm_matches_numpy(backend, case, dtype):
    from purine_mpi.gpu.blas import gemm
    a_shape, b_shape, ta, tb = case
    rng = _rng()
    a = rng.standard_normal(a_shape).astype(dtype)
    b = rng.standard_normal(b_shape).astype(dtype)
    op_a = np.swapaxes(a, -1, -2) if ta else a
    op_b = np.swapaxes(b, -1, -2) if tb else b
    want = np.matmul(op_a, op_b)
    c0 = rng.standard_normal(want.shape).astype(dtype)
    for alpha, beta in ((1.0, 0.0), (0.5, 2.0)):
        c = backend.to_device(c0.copy())
        gemm(backend.to_device(a), backend.to_device(b), c, ta, tb, alpha, beta)
        _close(backend.to_host(c), alpha * want + beta * c0, dtype)


def test_gemm_on_strided_slices(backend):
    """Group slices of a grouped convolution: strided batches, row strides
    wider than the rows, written in place into a slice of c."""
    from purine_mpi.gpu.blas import gemm
    rng = _rng()
    w = rng.standard_normal((2, 3, 4))            # (G, O/G, K)
    cols = rng.standard_normal((5, 2, 4, 6))      # (n, G, K, L)
    y = np.zeros((5, 2, 3, 6))
    dev_w, dev_cols, dev_y = (backend.to_device(v) for v in (w, cols, y))
    for g in range(2):
        gemm(dev_w[g], dev_cols[:, g], dev_y[:, g])
    _close(backend.to_host(dev_y), np.einsum("gok,ngkl->ngol", w, cols), np.float64)
    wide = backend.to_device(rng.standard_normal((3, 10)))   # row stride 10, 4 columns used
    out = backend.to_device(np.zeros((3, 3)))
    gemm(wide[:, 2:6], dev_w[0], out, trans_b=True)
    _close(backend.to_host(out), backend.to_host(wide)[:, 2:6] @ w[0].T, np.float64)
    with pytest.raises(ValueError, match="contiguous"):
        gemm(dev_w[0][:, ::2], dev_cols[0, 0][:2], out)
    with pytest.raises(ValueError, match="does not give"):
        gemm(dev_w[0], dev_w[0], out)
    # overlapping rows (a broadcast row or column: stride 0) are refused; the
    # width as ld read the memory after the first row as the other rows
    # (before: no error, a wrong product)
    xp = importlib.import_module("cupy") if backend.name == "cupy" else np
    row = xp.broadcast_to(backend.to_device(rng.standard_normal((1, 4))), (3, 4))
    col = xp.broadcast_to(backend.to_device(rng.standard_normal((3, 1))), (3, 4))[:, :1]
    for bad, other in ((row, dev_cols[0, 0]), (xp.broadcast_to(col[:1], (3, 1)),
                                              backend.to_device(np.ones((1, 6))))):
        with pytest.raises(ValueError, match="overlap"):
            gemm(bad, other, backend.to_device(np.zeros((3, 6))))


# ------------------------------------- cuBLAS bindings and stream capture ---

class _Stream:
    """A simulated CuPy stream for sim_capture: ``capturing()`` opens a
    capture whose recorded device work lands in the list it yields."""

    def __init__(self, key):
        self.key, self.capture, self.recorder = key, None, None
        self.ptr = sim_capture.register_stream(self)

    def is_capturing(self):
        return self.capture is not None

    def capturing(self):
        import contextlib

        @contextlib.contextmanager
        def opened():
            self.capture, self.recorder = object(), []
            try:
                yield self.recorder
            finally:
                self.capture, self.recorder = None, None
        return opened()


def _gemm_operands(case, dtype, seed=0):
    a_shape, b_shape, ta, tb = case
    rng = _rng(seed)
    a = rng.standard_normal(a_shape).astype(dtype)
    b = rng.standard_normal(b_shape).astype(dtype)
    want = np.matmul(np.swapaxes(a, -1, -2) if ta else a, np.swapaxes(b, -1, -2) if tb else b)
    return a, b, rng.standard_normal(want.shape).astype(dtype), want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GEMM_CASES)
def test_gemm_through_cupys_cublas_without_nvmath(host_device, monkeypatch, case, dtype,
                                                  capsys):
    """No nvmath-python: CuPy's cuBLAS does the products (the same numbers),
    and one line on stderr says that they cannot be captured and why."""
    from purine_mpi.gpu import blas
    use_emulated_nvmath(monkeypatch, enabled=False)
    assert blas.blas_backend() == "cupy"
    assert "nvmath-python" in blas.blas_note() and "purine_mpi[gpu]" in blas.blas_note()
    assert blas.reserve(_Stream("s")) is None      # nothing to reserve
    a, b, c0, want = _gemm_operands(case, dtype)
    for alpha, beta in ((1.0, 0.0), (0.5, 2.0)):
        c = c0.copy()
        blas.gemm(a, b, c, case[2], case[3], alpha, beta)
        _close(c, alpha * want + beta * c0, dtype)
    assert capsys.readouterr().err.count("refuses CUDA-graph capture") == 1


def test_cupys_cublas_refuses_a_capturing_stream(host_device, monkeypatch):
    """As CuPy's setStream: NotImplementedError with CuPy's message, C untouched."""
    from purine_mpi.gpu import blas
    use_emulated_nvmath(monkeypatch, enabled=False)
    a, b, c0, want = _gemm_operands(GEMM_CASES[4], np.float32)
    c = c0.copy()
    stream = _Stream("capturing")
    with sim_capture.current(stream), stream.capturing() as recorded:
        with pytest.raises(NotImplementedError, match=sim_capture.CUBLAS_REFUSED):
            blas.gemm(a, b, c)
    assert recorded == [] and np.array_equal(c, c0)
    with sim_capture.current(stream):   # the capture ended: runs at once
        blas.gemm(a, b, c)
    _close(c, want, np.float32)


def test_nvmath_handles_one_per_stream_with_their_own_workspace(host_device, monkeypatch):
    from purine_mpi.gpu import blas
    cublas = use_emulated_nvmath(monkeypatch)
    monkeypatch.setenv("PURINE_CUBLAS_WORKSPACE_MB", "2")
    assert blas.blas_backend() == "nvmath" and blas.blas_note() is None
    a, b, c, want = _gemm_operands(GEMM_CASES[0], np.float64)
    first, second = _Stream("first"), _Stream("second")
    for stream in (first, second, first, None):
        with sim_capture.current(stream):
            blas.gemm(a, b, c)
    _close(c, want, np.float64)
    assert len(cublas.handles) == 3     # first, second and the default stream
    streams = sorted(h["stream"] for h in cublas.handles.values())
    assert streams == sorted([first.ptr, second.ptr, 0])
    for h in cublas.handles.values():   # set_stream first: it resets the workspace
        assert h["workspace"] is not None and h["workspace"][1] == 2 << 20
        assert h["pointer_mode"] == int(cublas.PointerMode.HOST)
    assert blas.reserve(first) in cublas.handles        # the same handle again
    assert len(cublas.handles) == 3
    monkeypatch.setenv("PURINE_CUBLAS_WORKSPACE_MB", "lots")
    from purine_mpi.base.errors import UserError
    with pytest.raises(UserError, match="PURINE_CUBLAS_WORKSPACE_MB"):
        blas.workspace_bytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvmath_gemm_in_a_capture_is_recorded_and_replays(host_device, monkeypatch, dtype):
    """A product on a capturing stream (handle reserved before) is recorded,
    not run; each replay computes it from the operands' values at that time,
    with the alpha and beta of the capture (host pointer mode)."""
    from purine_mpi.gpu import blas
    use_emulated_nvmath(monkeypatch)
    stream = _Stream("capture")
    assert blas.reserve(stream) is not None
    for case in (GEMM_CASES[1], GEMM_CASES[5]):    # one product, a broadcast batch
        a, b, c0, _ = _gemm_operands(case, dtype)
        c = c0.copy()
        with sim_capture.current(stream), stream.capturing() as recorded:
            blas.gemm(a, b, c, case[2], case[3], alpha=0.5, beta=2.0)
        assert len(recorded) == 1 and np.array_equal(c, c0)    # recorded, not run
        for seed in (1, 2):   # new operand values before each replay
            new_a, new_b, new_c, want = _gemm_operands(case, dtype, seed)
            a[...], b[...], c[...] = new_a, new_b, new_c
            recorded[0]()
            _close(c, 0.5 * want + 2.0 * new_c, dtype)


def test_capture_without_reserve_is_a_clear_error(host_device, monkeypatch):
    from purine_mpi.gpu import blas
    cublas = use_emulated_nvmath(monkeypatch)
    a, b, c0, _ = _gemm_operands(GEMM_CASES[0], np.float32)
    c = c0.copy()
    stream = _Stream("unreserved")
    with sim_capture.current(stream), stream.capturing() as recorded:
        with pytest.raises(RuntimeError, match=r"blas.reserve\(stream\)"):
            blas.gemm(a, b, c)
    assert recorded == [] and np.array_equal(c, c0) and cublas.handles == {}
    sim_capture.refuse_allocation("nothing else was allocated")   # the capture has ended


def test_emulated_cublas_handle_without_workspace_refuses_a_capture(monkeypatch):
    """The emulation's own check: cublasSetStream drops the workspace, and a
    capture then would make cuBLAS allocate."""
    cublas = use_emulated_nvmath(monkeypatch)
    stream = _Stream("s")
    handle = cublas.create()
    cublas.set_workspace(handle, 1, 1 << 20)
    cublas.set_stream(handle, stream.ptr)     # resets the workspace, as cuBLAS does
    assert cublas.handles[handle]["workspace"] is None
    a, b, c = (np.ones((2, 2), np.float32) for _ in range(3))
    scalars = np.array([1.0, 0.0], np.float32)
    args = (0, 0, 2, 2, 2, scalars.ctypes.data, a.ctypes.data, 2, b.ctypes.data, 2,
            scalars.ctypes.data + 4, c.ctypes.data, 2)
    with stream.capturing():
        with pytest.raises(cublas.cuBLASError, match="allocate"):
            cublas.sgemm(handle, *args)
    cublas.sgemm(handle, *args)
    np.testing.assert_array_equal(c, np.full((2, 2), 2, np.float32))


def test_blas_imports_neither_cupy_nor_nvmath():
    code = ("import sys; import purine_mpi.gpu.blas as b; "
            "assert 'cupy' not in sys.modules and 'nvmath' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_nvmath_without_a_loadable_cublas_falls_back_to_cupy(host_device, monkeypatch, capsys):
    """nvmath-python imports but its first handle fails (no libcublas it can
    load): the products take CuPy's cuBLAS, and the line says why."""
    from purine_mpi.gpu import blas
    cublas = use_emulated_nvmath(monkeypatch)

    def no_library():
        raise RuntimeError("libcublas.so not found")

    monkeypatch.setattr(cublas, "create", no_library)
    a, b, c, want = _gemm_operands(GEMM_CASES[4], np.float32)
    blas.gemm(a, b, c)
    _close(c, want, np.float32)
    assert blas.blas_backend() == "cupy" and "libcublas.so not found" in blas.blas_note()
    assert blas.reserve(_Stream("s")) is None
    assert capsys.readouterr().err.count("refuses CUDA-graph capture") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_captures_and_replays_on_a_gpu(dtype):
    """On a real GPU with nvmath-python: a product (one, and a batch with a
    broadcast operand) captured on a reserved stream replays with the
    operands of each replay; without reserve the capture is refused with
    our error; CuPy's own cuBLAS refuses any capture (what the emulation
    assumes)."""
    cupy = _gpu_cupy()
    from purine_mpi.gpu import blas
    if blas.blas_backend() != "nvmath":
        pytest.skip(blas.blas_note())
    stream = cupy.cuda.Stream(non_blocking=True)
    assert blas.reserve(stream) is not None
    for case in (GEMM_CASES[1], GEMM_CASES[5]):
        a0, b0, c0, _ = _gemm_operands(case, dtype)
        with stream:
            a, b, c = cupy.asarray(a0), cupy.asarray(b0), cupy.asarray(c0)
            stream.synchronize()
            stream.begin_capture()
            try:
                blas.gemm(a, b, c, case[2], case[3], alpha=0.5, beta=2.0)
            finally:
                graph = stream.end_capture()
            np.testing.assert_array_equal(cupy.asnumpy(c), c0)   # captured, not run
            for seed in (1, 2):
                new_a, new_b, new_c, want = _gemm_operands(case, dtype, seed)
                a[...], b[...], c[...] = (cupy.asarray(v) for v in (new_a, new_b, new_c))
                graph.launch(stream)
                stream.synchronize()
                _close(cupy.asnumpy(c), 0.5 * want + 2.0 * new_c, dtype)
    fresh = cupy.cuda.Stream(non_blocking=True)
    with fresh:
        a, b = cupy.ones((4, 4), dtype), cupy.ones((4, 4), dtype)
        c = cupy.zeros((4, 4), dtype)
        handle = cupy.cuda.device.get_cublas_handle()   # made before the capture
        one = np.ones(1, dtype)
        call = cupy.cuda.cublas.sgemm if dtype == np.float32 else cupy.cuda.cublas.dgemm
        fresh.synchronize()
        fresh.begin_capture()
        try:
            with pytest.raises(RuntimeError, match=r"blas.reserve\(stream\)"):
                blas.gemm(a, b, c)
            with pytest.raises(NotImplementedError, match=sim_capture.CUBLAS_REFUSED):
                call(handle, 0, 0, 4, 4, 4, one.ctypes.data, a.data.ptr, 4, b.data.ptr, 4,
                     one.ctypes.data, c.data.ptr, 4)
        finally:
            fresh.end_capture()
