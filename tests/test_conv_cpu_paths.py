"""The CPU convolution's fast paths against independent references: the
channels-last columns (``im2col_rows``) against a NumPy loop over ``np.pad``,
the forward / weight / data gradients on those rows against PyTorch and
against the (n, C, kh, kw, OH, OW) im2col path in float64, one weight
gradient GEMM over the whole batch against one per chunk, 1x1 convs as plain
GEMMs, and the per-thread reused buffers (a border filled once stays right
when geometries, fills and threads alternate)."""
import threading

import numpy as np
import pytest
import torch.nn.functional as F

from purine_mpi.ops import conv as conv_module
from purine_mpi.ops import hostgemm
from purine_mpi.ops import im2col as im2col_module
from tests.opcheck import close, run_op, torch_grads

RNG = np.random.default_rng(23)


def randn(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def torch_conv(attrs):
    def fn(xt, wt, *bt):
        return F.conv2d(xt, wt, bt[0] if bt else None, stride=attrs.get("stride", 1),
                        padding=attrs.get("pad", 0), dilation=attrs.get("dilation", 1),
                        groups=attrs.get("group", 1))
    return fn


def check_against_torch(x_shape, w_shape, attrs, bias=True, dtype=np.float32):
    x, w, b = randn(*x_shape, dtype=dtype), randn(*w_shape, dtype=dtype), randn(w_shape[0],
                                                                                dtype=dtype)
    inputs = {"x": x, "w": w, "b": b} if bias else {"x": x, "w": w}
    outs, grads = run_op("Conv", attrs, inputs, wrt=list(inputs))
    y, expect = torch_grads(torch_conv(attrs), list(inputs.values()), outs["_loss_weights"])
    close(outs[0], y)
    for name, g in zip(inputs, expect):
        close(grads[name], g)


# the rows path: one group of at least ROWS_MIN_C input channels
ROWS_CASES = [
    ((3, 16, 9, 7), (5, 16, 3, 3), {"stride": 2, "pad": 2}),                 # strided: col2im dx
    ((2, 16, 6, 10), (4, 16, 5, 3), {"pad": [2, 1]}),                       # non-square, stride 1
    ((2, 20, 8, 7), (6, 20, 3, 2), {"dilation": [2, 1], "pad": [2, 0]}),    # dilated
    ((2, 16, 5, 5), (3, 16, 2, 2), {"stride": [1, 2]}),                    # no pad, mixed stride
    ((1, 17, 4, 4), (2, 17, 3, 3), {"pad": 1}),                             # odd channels
]


@pytest.mark.parametrize("x_shape,w_shape,attrs", ROWS_CASES)
def test_rows_path_matches_torch(x_shape, w_shape, attrs):
    geo = conv_module._geometry(attrs, x_shape, w_shape)
    assert conv_module._by_rows(geo) and not conv_module._pointwise(geo)
    check_against_torch(x_shape, w_shape, attrs)


@pytest.mark.parametrize("x_shape,w_shape,attrs", ROWS_CASES)
def test_rows_path_equals_im2col_path(monkeypatch, x_shape, w_shape, attrs):
    """float64: the channels-last rows and the (C, kh, kw)-ordered im2col
    give the same forward and gradients to rounding."""
    inputs = {"x": randn(*x_shape, dtype=np.float64), "w": randn(*w_shape, dtype=np.float64)}
    fast_out, fast = run_op("Conv", attrs, inputs, wrt=["x", "w"])
    monkeypatch.setattr(conv_module, "ROWS_MIN_C", 1 << 30)
    ref_out, ref = run_op("Conv", attrs, inputs, wrt=["x", "w"])
    np.testing.assert_allclose(fast_out[0], ref_out[0], rtol=1e-12, atol=1e-12)
    for name in ("x", "w"):
        np.testing.assert_allclose(fast[name], ref[name], rtol=1e-12, atol=1e-12)


def test_weight_grad_one_gemm_over_the_batch_equals_chunks(monkeypatch):
    """The rows path's weight gradient as one GEMM over the whole batch
    (a chunk limit above the batch's columns) and one per sample agree."""
    x, w = randn(4, 16, 7, 6, dtype=np.float64), randn(3, 16, 3, 3, dtype=np.float64)
    attrs = {"pad": 2, "stride": [2, 1]}
    monkeypatch.setattr(conv_module, "COL_CHUNK_BYTES", 1 << 40)
    geo = conv_module._geometry(attrs, x.shape, w.shape)
    assert len(conv_module._chunks(np, geo, 8)) == 1
    _, whole = run_op("Conv", attrs, {"x": x, "w": w}, wrt=["w"])
    monkeypatch.setattr(conv_module, "COL_CHUNK_BYTES", 1)
    assert len(conv_module._chunks(np, geo, 8)) == 4
    _, per_sample = run_op("Conv", attrs, {"x": x, "w": w}, wrt=["w"])
    np.testing.assert_allclose(whole["w"], per_sample["w"], rtol=1e-12)
    # and against the closed form: dw[o, c, p, q] = sum_{n,i,j} dy * xpad[...]
    loss_w = randn(4, 3, geo["OH"], geo["OW"], dtype=np.float64)
    _, grads = run_op("Conv", attrs, {"x": x, "w": w}, wrt=["w"], loss_weights=[loss_w])
    xpad = np.pad(x, ((0, 0), (0, 0), (2, 2), (2, 2)))
    ref = np.zeros_like(w)
    for p in range(3):
        for q in range(3):
            win = xpad[:, :, p:p + 2 * (geo["OH"] - 1) + 1:2, q:q + geo["OW"]]
            ref[:, :, p, q] = np.einsum("noij,ncij->oc", loss_w, win)
    np.testing.assert_allclose(grads["w"], ref, rtol=1e-10, atol=1e-12)


def reference_rows(x, geo):
    """im2col_rows by a loop over an np.pad copy: row (n, i, j), column (p, q, c)."""
    ph, pw = geo["ph"], geo["pw"]
    xpad = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    rows = []
    for n in range(x.shape[0]):
        for i in range(geo["OH"]):
            for j in range(geo["OW"]):
                win = [xpad[n, :, i * geo["sh"] + p * geo["dh"], j * geo["sw"] + q * geo["dw"]]
                       for p in range(geo["kh"]) for q in range(geo["kw"])]
                rows.append(np.concatenate(win))
    return np.array(rows)


@pytest.mark.parametrize("attrs,w_shape", [
    ({"pad": 2}, (1, 3, 5, 5)),
    ({"pad": [1, 2], "stride": [2, 3], "dilation": [2, 1]}, (1, 3, 3, 2)),
    ({}, (1, 3, 2, 3)),
])
def test_im2col_rows_writes_the_padding_itself(attrs, w_shape):
    """The padded columns straight from the reused channels-last buffer equal
    the columns of an np.pad copy, also after a call with other values (the
    border filled once stays zero) and after another geometry of the same
    padded size."""
    for x_shape in ((2, 3, 6, 7), (2, 3, 6, 7), (2, 3, 5, 5)):
        geo = conv_module._geometry(attrs, x_shape, w_shape)
        x = randn(*x_shape)
        rows = im2col_module.im2col_rows(np, x, geo, capacity=2)
        np.testing.assert_array_equal(rows, reference_rows(x, geo))
    # same padded extent (8) from H=6/pad 1 and H=4/pad 2: separate buffers
    for h, pad in ((6, 1), (4, 2), (6, 1)):
        geo = conv_module._geometry({"pad": pad}, (1, 3, h, h), (1, 3, 3, 3))
        x = randn(1, 3, h, h)
        np.testing.assert_array_equal(im2col_module.im2col_rows(np, x, geo, capacity=1),
                                      reference_rows(x, geo))


@pytest.mark.parametrize("x_shape,w_shape", [((3, 16, 5, 4), (8, 16, 1, 1)),
                                             ((2, 6, 3, 7), (4, 3, 1, 1))])
def test_pointwise_convs_are_plain_gemms(monkeypatch, x_shape, w_shape):
    """1x1 stride-1 convs never copy columns, and match PyTorch."""
    attrs = {"group": x_shape[1] // w_shape[1]}

    def no_columns(*args, **kwargs):
        raise AssertionError("a 1x1 conv copied columns")
    for module, name in ((conv_module, "im2col"), (conv_module, "im2col_batch"),
                         (im2col_module, "im2col_rows")):
        monkeypatch.setattr(module, name, no_columns)
    check_against_torch(x_shape, w_shape, attrs)


def test_reused_buffers_across_pool_fills_and_conv_geometries():
    """Max pooling (border -inf) and average pooling (border 0) of the same
    padded geometry, and convs whose padded buffers have the same size,
    alternate in one thread and still match PyTorch."""
    x = randn(2, 3, 7, 7)
    for _ in range(2):
        for kind in ("max", "ave"):
            attrs = {"pool": kind, "kernel": 3, "stride": 2, "pad": 1}
            outs, _ = run_op("Pool", attrs, {"x": x})
            fn = F.max_pool2d if kind == "max" else F.avg_pool2d
            y, _ = torch_grads(lambda t: fn(t, 3, 2, 1), [x], outs["_loss_weights"])
            close(outs[0], y)
        check_against_torch((2, 16, 6, 6), (3, 16, 3, 3), {"pad": 1})
        check_against_torch((2, 16, 4, 4), (3, 16, 3, 3), {"pad": 2})


def test_threads_get_their_own_buffers():
    """Two threads running different convs at once, many times: each result
    is the one a lone run gives (no buffer is shared between threads)."""
    cases = [((2, 16, 6, 6), (4, 16, 3, 3), {"pad": 1}),
             ((2, 16, 6, 6), (4, 16, 3, 3), {"pad": 2, "stride": 2})]
    inputs = [{"x": randn(*xs), "w": randn(*ws)} for xs, ws, _ in cases]
    alone = [run_op("Conv", a, i, wrt=["x", "w"]) for (_, _, a), i in zip(cases, inputs)]
    failures = []

    def worker(k):
        for _ in range(15):
            outs, grads = run_op("Conv", cases[k][2], inputs[k], wrt=["x", "w"])
            ok = np.array_equal(outs[0], alone[k][0][0]) and all(
                np.array_equal(grads[n], alone[k][1][n]) for n in ("x", "w"))
            if not ok:
                failures.append(k)
    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


@pytest.mark.parametrize("x_shape,w_shape,attrs", [
    ((3, 3, 7, 6), (4, 3, 3, 3), {"pad": 1}),                 # (C, kh, kw) columns
    ((3, 16, 6, 5), (5, 16, 3, 3), {"pad": 1, "stride": 2}),  # channels-last rows
    ((3, 4, 5, 5), (6, 2, 3, 3), {"group": 2, "pad": 1}),     # groups
    ((3, 4, 5, 5), (6, 4, 1, 1), {}),                         # 1x1: a plain GEMM
])
@pytest.mark.parametrize("per_chunk", [1, 2, 3])
def test_conv_bias_added_chunk_by_chunk(monkeypatch, x_shape, w_shape, attrs, per_chunk):
    """The CPU forward adds the bias to each chunk of the batch (on the rows
    path within the copy into y's layout): y(x, w, b) == y(x, w) + b in
    float64, with 1, 2 (a batch of 3: an odd last chunk) and 3 samples a chunk."""
    x, w, b = (randn(*x_shape, dtype=np.float64), randn(*w_shape, dtype=np.float64),
               randn(w_shape[0], dtype=np.float64))
    geo = conv_module._geometry(attrs, x_shape, w_shape)
    per_sample = geo["C"] * geo["kh"] * geo["kw"] * geo["OH"] * geo["OW"] * x.itemsize
    monkeypatch.setattr(conv_module, "COL_CHUNK_BYTES", per_chunk * per_sample)
    assert len(conv_module._chunks(np, geo, x.itemsize)) == -(-3 // per_chunk)
    with_b, _ = run_op("Conv", attrs, {"x": x, "w": w, "b": b})
    without, _ = run_op("Conv", attrs, {"x": x, "w": w})
    np.testing.assert_allclose(with_b[0], without[0] + b.reshape(1, -1, 1, 1), rtol=1e-12,
                               atol=1e-12)


def test_held_bytes_counts_every_threads_buffers():
    """im2col.held_bytes sums the buffers of every live thread (the
    measurement behind the host-scratch figures of docs/running.md)."""
    import threading

    import numpy as np

    from purine_mpi.ops import im2col
    before = im2col.held_bytes()
    done, release = threading.Event(), threading.Event()

    def work():
        im2col.buffer(np, "held_test", (1000,), np.float32)
        im2col.scratch(np, "held_test_flat", (500,), np.float64)
        done.set()
        release.wait(10)

    t = threading.Thread(target=work)
    t.start()
    done.wait(10)
    try:
        assert im2col.held_bytes() - before == 4000 + 4000
    finally:
        release.set()
        t.join()


# (x shape, w shape, attrs): the rows path, the (C, kh, kw) columns with
# padding and groups, a strided conv (col2im data gradient with padding), a
# 1x1 conv, a small-K weight gradient (per sample) and a large-K one
HOLD_CASES = [
    ((3, 16, 9, 7), (5, 16, 3, 3), {"stride": 2, "pad": 2}),
    ((4, 4, 8, 8), (6, 2, 3, 3), {"pad": 1, "group": 2}),
    ((3, 3, 11, 9), (4, 3, 5, 5), {"stride": 2, "pad": 2}),
    ((2, 8, 5, 5), (4, 8, 1, 1), {}),
    ((5, 3, 8, 8), (4, 3, 3, 3), {"pad": 1}),
    ((2, 12, 8, 8), (4, 12, 5, 5), {"pad": 2}),
]

POOL_CASES = [
    ((3, 4, 9, 9), {"pool": "max", "kernel": 3, "stride": 2, "ceil_mode": True}),
    ((2, 3, 8, 8), {"pool": "max", "kernel": 2, "stride": 2}),
    ((3, 4, 20, 20), {"pool": "ave", "kernel": 3, "stride": 2, "pad": 1}),  # not dense
    ((3, 4, 7, 7), {"pool": "ave", "kernel": 3, "stride": 2}),             # dense GEMM
]


def _held_after(kernel, ins, outs):
    """Bytes a fresh thread's im2col caches and host products' scratch
    (ops/hostgemm.py) hold after ``kernel.run``, and the process's shared
    arrays the run made (``im2col.shared``, from an empty table: average
    pooling's dense matrix)."""
    got = []

    def work():
        kernel.run(ins, outs)
        got.append(sum(a.nbytes for name in ("buffers", "flat")
                       for a in im2col_module._cache(name).values())
                   + sum(a.nbytes for a in im2col_module._SHARED.values())
                   + sum(a.nbytes for a in getattr(hostgemm._LOCAL, "flat", {}).values()))
    saved, im2col_module._SHARED = im2col_module._SHARED, {}
    try:
        t = threading.Thread(target=work)
        t.start()
        t.join()
    finally:
        im2col_module._SHARED = saved
    return got[0]


def _kernel(op_type, attrs):
    from types import SimpleNamespace

    from purine_mpi.ops.registry import get_kernel_class
    return get_kernel_class(op_type)(SimpleNamespace(attrs=attrs, name=op_type))


@pytest.mark.parametrize("chunk", [None, 2000])
@pytest.mark.parametrize("x_shape,w_shape,attrs", HOLD_CASES)
def test_host_scratch_is_what_the_conv_kernels_hold(x_shape, w_shape, attrs, chunk,
                                                   monkeypatch):
    """Each direction's ``host_scratch`` (plan's host scratch row) is the
    bytes its CPU run leaves in its thread's buffers, with one chunk and with
    several (a small ``COL_CHUNK_BYTES``)."""
    if chunk is not None:
        monkeypatch.setattr(conv_module, "COL_CHUNK_BYTES", chunk)
    geo = conv_module._geometry(attrs, x_shape, w_shape)
    x, w = randn(*x_shape), randn(*w_shape)
    y = np.empty((geo["N"], geo["O"], geo["OH"], geo["OW"]), np.float32)
    dy = randn(*y.shape)
    runs = [("Conv", attrs, [x, w, randn(w_shape[0])], [y]),
            ("ConvGradData", dict(attrs, x_shape=list(x_shape)), [dy, w], [np.empty_like(x)]),
            ("ConvGradWeight", dict(attrs, w_shape=list(w_shape)), [dy, x],
             [np.empty_like(w)]),
            ("ConvGradBias", attrs, [dy], [np.empty(w_shape[0], np.float32)])]
    for op_type, a, ins, outs in runs:
        k = _kernel(op_type, a)
        want = im2col_module.held_by(k.host_scratch(ins, outs))
        assert _held_after(k, ins, outs) == want, op_type


@pytest.mark.parametrize("x_shape,attrs", POOL_CASES)
def test_host_scratch_is_what_the_pool_kernels_hold(x_shape, attrs):
    from purine_mpi.ops.pool import _geometry
    geo = _geometry(attrs, x_shape)
    x = randn(*x_shape)
    y = np.empty((geo["N"], geo["C"], geo["OH"], geo["OW"]), np.float32)
    outs = [y] + ([np.empty(y.shape, np.int32)] if geo["kind"] == "max" else [])
    k = _kernel("Pool", attrs)
    assert _held_after(k, [x], outs) == im2col_module.held_by(k.host_scratch([x], outs))
    grad = _kernel("PoolGrad", dict(attrs, x_shape=list(x_shape)))
    ins = [randn(*y.shape)] + outs[1:]
    dx = [np.empty_like(x)]
    assert _held_after(grad, ins, dx) == im2col_module.held_by(grad.host_scratch(ins, dx))
