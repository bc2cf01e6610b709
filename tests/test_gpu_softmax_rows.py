"""The one-block-per-position softmax kernels (cuda/softmax_loss.cu
``softmax_loss_forward_rows``, ``softmax_forward_rows``,
``softmax_backward_rows``, ``accuracy_forward_rows``: rows of many classes,
GPT's loss over 50304 classes, the attention softmax's rows) against
float64 NumPy references, on the emulated device (blocks of 3 fibers, so
every thread's online (max, sum) and the block's trees are exercised) and
on a GPU when there is one (256 threads a block).

In place (prob is x, y is x, dx is dy) the block must read everything it
needs of a row -- x[label] too -- before any thread writes it: a kernel
that read x[label] after the writing pass gets the probability back and a
wrong loss here (labels owned by thread 0, which the emulator runs first
after a barrier). A causal attention row (-inf beyond its position, so
whole threads see only -inf) would give NaN without the online sum's
guard against exp(-inf + inf)."""
import numpy as np
import pytest

from purine_mpi.gpu import kernels
from tests.emulated_gpu.helpers import compare

IGNORE, PAD = -1, -2


def _softmax64(x):
    """(prob, log(sum exp(x - max)), max) over axis 1 of (N, C), in float64."""
    x = x.astype(np.float64)
    largest = x.max(axis=1, keepdims=True)
    e = np.exp(x - largest)
    total = e.sum(axis=1, keepdims=True)
    return e / total, np.log(total[:, 0]), largest[:, 0]


def _logits(rng, n, channels, dtype):
    """Normal logits; row 1 spans 2e4 (one class at +1e4, one at -1e4:
    exp of the unshifted ones overflows float64 too)."""
    x = 3 * rng.standard_normal((n, channels))
    x[1, 7] = 1e4
    x[1, 11] = -1e4
    return x.astype(dtype)


def _close(got, want, dtype, what):
    tol = 1e-12 if dtype == np.float64 else 2e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 0.1, err_msg=what)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("channels,n", [(300, 6), (1000, 6), (50304, 3)])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("kernel", ["softmax_loss_forward_vec", "softmax_loss_forward_rows"])
def test_softmax_loss_rows(device, channels, n, dtype, in_place, kernel):
    """The loss's kernel (the vectorized one) and the one before it (kept
    for benchmarks/loss_kernel_gpu.py)."""
    rng = np.random.default_rng(channels)
    x = _logits(rng, n, channels, dtype)
    # labels owned by thread 0 of the emulator's 3-thread blocks (c % 3 ==
    # 0), the +1e4 class (owned by thread 1), a bad one, an ignored, a padding
    labels = np.array([0, 7, 3 * (channels // 3) - 3, channels + 5, IGNORE, PAD]
                      if n == 6 else [channels - 3, 7, channels])
    prob_want, log_sum, largest = _softmax64(x)
    loss_want = np.zeros(n)
    valid_want = np.zeros(n)
    for i, label in enumerate(labels):
        if label in (IGNORE, PAD):
            continue
        valid_want[i] = 1
        loss_want[i] = (log_sum[i] - (float(x[i, label]) - largest[i])
                        if 0 <= label < channels else np.nan)
    xd = device.to_device(x)
    device.launched.clear()
    prob, loss, valid = kernels.softmax_loss_forward(
        xd, device.to_device(labels), IGNORE, out=(xd, None, None) if in_place else None,
        pad_label=PAD, rows_kernel=kernel)
    assert device.launched == [kernel]
    if in_place:
        assert prob is xd
    _close(device.to_host(prob), prob_want, dtype, "prob")
    _close(device.to_host(loss), loss_want, dtype, "loss")
    np.testing.assert_array_equal(device.to_host(valid), valid_want)
    assert np.isnan(device.to_host(loss)).sum() == 1     # only the bad label
    if not in_place:   # a second run: the same bits (fixed-order trees, no atomics)
        again = kernels.softmax_loss_forward(xd, device.to_device(labels), IGNORE,
                                             pad_label=PAD, rows_kernel=kernel)
        for a, b in zip((prob, loss, valid), again):
            np.testing.assert_array_equal(device.to_host(a), device.to_host(b))


def _causal(rng, n, channels, dtype):
    """Attention-like rows: row i has -inf from class i * 7 + 1 on (row 0:
    one finite class, so two of the emulator's three threads see only
    -inf), the last row 2e4 apart."""
    x = 10 * rng.standard_normal((n, channels))
    for i in range(n - 1):
        x[i, i * 7 + 1:] = -np.inf
    x[-1, 5], x[-1, 9] = 1e4, -1e4
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("channels", [300, 1000])
@pytest.mark.parametrize("in_place", [False, True])
def test_softmax_and_its_gradient_rows(device, channels, dtype, in_place):
    rng = np.random.default_rng(channels + 1)
    x = _causal(rng, 4, channels, dtype)
    y_want = _softmax64(x)[0]
    xd = device.to_device(x)
    device.launched.clear()
    y = kernels.softmax_forward(xd, out=xd if in_place else None)
    _close(device.to_host(y), y_want, dtype, "y")
    dy = rng.standard_normal(x.shape).astype(dtype)
    y_in = y_want.astype(dtype)
    y64 = y_in.astype(np.float64)
    dy64 = dy.astype(np.float64)
    dx_want = y64 * (dy64 - (dy64 * y64).sum(axis=1, keepdims=True))
    dyd = device.to_device(dy)
    dx = kernels.softmax_backward(dyd, device.to_device(y_in), out=dyd if in_place else None)
    assert device.launched == ["softmax_forward_rows", "softmax_backward_rows"]
    _close(device.to_host(dx), dx_want, dtype, "dx")


@pytest.mark.parametrize("shape,kernel", [((4, 255), "softmax_forward"),
                                          ((2, 300, 2), "softmax_forward"),
                                          ((4, 256), "softmax_forward_rows")])
def test_which_kernel(device, shape, kernel):
    """Below the block's size, or with positions interleaved (inner > 1:
    one thread a position reads coalesced already), one thread a position."""
    x = np.random.default_rng(0).standard_normal(shape)
    device.launched.clear()
    y = kernels.softmax_forward(device.to_device(x))
    assert device.launched == [kernel]
    e = np.exp(x - x.max(axis=1, keepdims=True))
    _close(device.to_host(y), e / e.sum(axis=1, keepdims=True), np.float64, kernel)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("top_k", [1, 5])
def test_accuracy_rows_is_the_cpus(device, dtype, top_k):
    """The Accuracy op over 300 classes against the CPU op: ties with the
    true class, a NaN position, an infinite score, ignored positions."""
    rng = np.random.default_rng(top_k)
    x = np.round(rng.standard_normal((8, 300)), 1).astype(dtype)
    label = rng.integers(0, 300, 8)
    label[:3] = np.argsort(-x[:3], axis=1)[:, 2]      # third best: right from top 3
    x[3, :] = np.nan
    x[4, 17] = np.inf
    x[5, :] = x[5, label[5]]                          # every class ties
    x[6, label[6]] = 10                               # the best
    kernels_used = ["accuracy_forward_rows", "accuracy_mean"]
    (cpu,), _ = compare(device, "Accuracy", {"top_k": top_k}, [x, label], kernels_used,
                        dtype)
    assert 0.0 < float(cpu) < 1.0
    ignored = label.copy()
    ignored[:2] = -1
    compare(device, "Accuracy", {"top_k": top_k, "ignore_label": -1}, [x, ignored],
            kernels_used, dtype)


def test_accuracy_rows_bad_label_is_nan(device):
    x = device.to_device(np.zeros((3, 300), np.float32))
    out = device.to_device(np.zeros(1, np.float32))
    device.launched.clear()
    kernels.accuracy(x, device.to_device(np.array([0, 300, 2])), out)
    assert device.launched == ["accuracy_forward_rows", "accuracy_mean"]
    assert np.isnan(device.to_host(out)).all()


def test_softmax_loss_op_takes_the_rows_kernel(device):
    """GPT's layout, (batch, tokens, vocabulary) over axis -1: the op's GPU
    branch against its CPU branch."""
    rng = np.random.default_rng(3)
    x = (4 * rng.standard_normal((2, 3, 400))).astype(np.float32)
    label = rng.integers(0, 400, (2, 3))
    compare(device, "SoftmaxLoss", {"axis": -1}, [x, label],
            ["softmax_loss_forward_vec", "softmax_loss_mean"], np.float32)


@pytest.mark.parametrize("channels", [12, 300])
@pytest.mark.parametrize("on_device", [False, True])
def test_the_loss_ops_in_place_give_the_bits_of_separate_outputs(device, channels, on_device):
    """SoftmaxLoss with prob over x and SoftmaxLossGrad with dx over prob
    (their ``in_place``: the memory plan may put them there) give the bits
    they give into separate outputs: on the host and on the device, through
    the one-thread kernel (12 classes) and the one-block one (300), with an
    ignored and a padding position."""
    from purine_mpi.graph.core import Op
    from purine_mpi.ops.registry import make_kernel
    rng = np.random.default_rng(channels)
    n = 6
    x = _logits(rng, n, channels, np.float32)
    labels = np.array([0, 3, channels - 1, 2, IGNORE, PAD], np.int32)
    attrs = {"ignore_label": IGNORE, "pad_label": PAD}
    put = device.to_device if on_device else np.array
    get = device.to_host if on_device else np.asarray

    def run(in_place):
        fwd = make_kernel(Op("loss", "SoftmaxLoss", ["x", "label"], ["loss", "prob"], attrs))
        bwd = make_kernel(Op("loss.bwd", "SoftmaxLossGrad", ["dloss", "prob", "label"], ["dx"],
                             attrs))
        xd, lab = put(x), put(labels)
        loss = put(np.zeros((), np.float32))
        prob = xd if in_place else put(np.full(x.shape, np.nan, np.float32))
        fwd.setup([xd, lab], [loss, prob])
        device.launched.clear()
        fwd.run([xd, lab], [loss, prob])
        assert (device.launched[:1] == ["softmax_loss_forward" + (
            "_vec" if channels >= 256 else "")]) == on_device, device.launched
        got = {"loss": np.array(get(loss)), "prob": np.array(get(prob))}
        dloss = put(np.full((), 0.5, np.float32))
        dx = prob if in_place else put(np.full(x.shape, np.nan, np.float32))
        bwd.setup([dloss, prob, lab], [dx])
        bwd.run([dloss, prob, lab], [dx])
        got["dx"] = np.array(get(dx))
        return got
    separate, over = run(False), run(True)
    for k in ("loss", "prob", "dx"):
        np.testing.assert_array_equal(over[k].view(np.uint32), separate[k].view(np.uint32),
                                      err_msg=k)
    assert np.isfinite(separate["loss"]) and separate["dx"][4:].max() == 0
