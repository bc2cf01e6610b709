"""The vectorized loss kernels (cuda/softmax_loss.cu
``softmax_loss_forward_vec``, ``softmax_loss_backward_vec``: (N, C) rows
of many classes, four floats a thread where a row's base is 16-byte
aligned, a float sum per thread rescaled once per chunk of four) against
float64 NumPy references and against the kernels before them
(``softmax_loss_forward_rows``, the one-thread-per-element
``softmax_loss_backward``, kept for benchmarks/loss_kernel_gpu.py), on
adversarial rows: huge and tiny logits, -inf entries, a row of one finite
class, all-equal, a NaN, a +inf, ignored / padding / out-of-range labels,
C not a multiple of 4, bases off the 16-byte grid (x and prob misaligned
alike: a scalar head; differently: the scalar path), in place. On the
emulated device (blocks of 3 fibers: every thread's chunks, the head and
the tail) and on a GPU when there is one (256 threads a block)."""
import numpy as np
import pytest

from purine_mpi.gpu import kernels

IGNORE, PAD = -1, -2


def _adversarial(rng, channels, dtype):
    """12 rows and their labels."""
    x = 3 * rng.standard_normal((12, channels))
    x[1, 7], x[1, 11] = 1e4, -1e4                # exp of the unshifted overflows
    x[2] = 1e-30 * rng.standard_normal(channels)  # tiny: all but equal
    x[3, ::5] = -np.inf                          # -inf entries (the label's: loss inf)
    x[4, :] = -np.inf
    x[4, channels - 2] = 0.5                     # one finite class (in the tail)
    x[5, :] = 2.25                               # all equal
    x[6, channels // 2] = np.nan                 # NaN: loss and prob NaN
    x[7, 3] = np.inf                             # +inf: NaN as the old kernel
    x[8] = 80 + 5 * rng.standard_normal(channels)  # exp(x) overflows float32
    labels = np.array([0, 7, channels - 1, 5, channels - 2, 3, 1, 3, channels - 3,
                       channels + 5, IGNORE, PAD])
    return x.astype(dtype), labels


def _reference(x, labels):
    """prob, loss, valid in float64 (NaN rows as NaN)."""
    x = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        largest = x.max(axis=1, keepdims=True)
        e = np.exp(x - largest)
        total = e.sum(axis=1, keepdims=True)
        prob = e / total
        log_sum = np.log(total[:, 0])
    loss, valid = np.zeros(len(x)), np.zeros(len(x))
    for i, label in enumerate(labels):
        if label in (IGNORE, PAD):
            continue
        valid[i] = 1
        with np.errstate(invalid="ignore"):
            loss[i] = (log_sum[i] - (x[i, label] - largest[i, 0])
                       if 0 <= label < x.shape[1] else np.nan)
    return prob, loss, valid


def _close(got, want, dtype, what):
    tol = 1e-12 if dtype == np.float64 else 2e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 0.1, err_msg=what)


def _placed(device, x, offset):
    """x on the device starting ``offset`` elements into a larger buffer
    (offset 1: 4 bytes off the 16-byte grid for float32)."""
    flat = np.zeros(x.size + offset, x.dtype)
    flat[offset:] = x.ravel()
    return device.to_device(flat)[offset:].reshape(x.shape)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("channels", [256, 300, 1027])
@pytest.mark.parametrize("layout", ["aligned", "x_off", "both_off_in_place"])
def test_forward_vec_is_the_reference_and_the_old_kernel(device, dtype, channels, layout):
    rng = np.random.default_rng(channels)
    x, labels = _adversarial(rng, channels, dtype)
    prob_want, loss_want, valid_want = _reference(x, labels)
    lab = device.to_device(labels)
    got = {}
    for kernel in ("softmax_loss_forward_vec", "softmax_loss_forward_rows"):
        xd = _placed(device, x, 0 if layout == "aligned" else 1)
        out = (xd, None, None) if layout == "both_off_in_place" else None
        device.launched.clear()
        prob, loss, valid = kernels.softmax_loss_forward(xd, lab, IGNORE, out=out,
                                                         pad_label=PAD, rows_kernel=kernel)
        assert device.launched == [kernel]
        got[kernel] = [np.array(device.to_host(a)) for a in (prob, loss, valid)]
    prob, loss, valid = got["softmax_loss_forward_vec"]
    finite = np.isfinite(prob_want).all(axis=1)
    assert finite.sum() == 10
    _close(prob[finite], prob_want[finite], dtype, "prob")
    _close(loss, loss_want, dtype, "loss")       # NaN where the reference's is
    np.testing.assert_array_equal(valid, valid_want)
    assert np.isnan(prob[~finite]).all()
    assert np.isnan(loss).tolist() == [False] * 6 + [True, True, False, True, False, False]
    # the old kernel (double sum per element) agrees as closely
    old_prob, old_loss, old_valid = got["softmax_loss_forward_rows"]
    _close(prob[finite], old_prob[finite], dtype, "prob: new against old")
    _close(loss, old_loss, dtype, "loss: new against old")
    np.testing.assert_array_equal(valid, old_valid)
    # a second run of the same placement: the same bits (fixed partition,
    # fixed-order trees; the partition follows x's and prob's alignment)
    xd = _placed(device, x, 0 if layout == "aligned" else 1)
    again = kernels.softmax_loss_forward(xd, lab, IGNORE, pad_label=PAD,
                                         out=(xd, None, None) if layout == "both_off_in_place"
                                         else None)
    for a, b in zip((prob, loss, valid), again):
        np.testing.assert_array_equal(a, np.array(device.to_host(b)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("channels", [256, 300, 1027, 5000])
@pytest.mark.parametrize("layout", ["aligned", "prob_off", "both_off_in_place"])
@pytest.mark.parametrize("scale", ["number", "device"])
def test_backward_vec_is_the_old_kernel_bit_for_bit(device, dtype, channels, layout, scale):
    """dx = scale / count * (prob - onehot), 0 at ignored and padding
    positions: the same float operations as the one-thread kernel, so the
    same bits; and the float64 reference."""
    rng = np.random.default_rng(channels + 1)
    n = 7
    prob = rng.random((n, channels)).astype(dtype)
    labels = np.array([0, channels - 1, 3, IGNORE, PAD, channels + 2, channels // 2])
    lab = device.to_device(labels)
    count = device.to_device(np.array([3.0], dtype))
    top = device.to_device(np.array([0.7], dtype)) if scale == "device" else 0.7
    got = {}
    for kernel in ("softmax_loss_backward_vec", None):
        p = _placed(device, prob, 0 if layout == "aligned" else 1)
        out = p if layout == "both_off_in_place" else None
        dx = kernels.softmax_loss_backward(p, lab, top, IGNORE, out=out, count=count,
                                           scale_factor=0.5, pad_label=PAD, rows_kernel=kernel)
        got[kernel] = np.array(device.to_host(dx))
    np.testing.assert_array_equal(got["softmax_loss_backward_vec"].view(np.uint8),
                                  got[None].view(np.uint8))
    onehot = np.zeros((n, channels))
    for i, label in enumerate(labels):
        if 0 <= label < channels:
            onehot[i, label] = 1
    want = 0.7 * 0.5 / 3.0 * (prob.astype(np.float64) - onehot)
    want[3:5] = 0
    _close(got[None], want, dtype, "dx")


def test_which_backward_kernel(device):
    """The vectorized backward for (N, C) rows of at least the block's
    size; one thread an element below it or with inner > 1 (unchanged)."""
    launched = []
    for shape in ((3, 256), (3, 255), (2, 300, 3)):
        p = device.to_device(np.full(shape, 0.25, np.float32))
        lab = device.to_device(np.zeros((shape[0],) + shape[2:], np.int64))
        device.launched.clear()
        kernels.softmax_loss_backward(p, lab)
        launched += device.launched
        x = device.to_device(np.zeros(shape, np.float32))
        device.launched.clear()
        kernels.softmax_loss_forward(x, lab)
        launched += device.launched
    assert launched == ["softmax_loss_backward_vec", "softmax_loss_forward_vec",
                        "softmax_loss_backward", "softmax_loss_forward",
                        "softmax_loss_backward", "softmax_loss_forward"]


@pytest.mark.parametrize("channels", [300, 1027])
def test_the_loss_ops_take_the_vec_kernels_and_match_the_cpu_op(device, channels):
    """SoftmaxLoss and SoftmaxLossGrad on GPT's layout ((batch, tokens,
    vocabulary), axis -1) with the adversarial finite rows and an ignored
    position: the GPU branch (the vec kernels) against the CPU op."""
    from tests.emulated_gpu.helpers import compare
    rng = np.random.default_rng(channels + 2)
    x, labels = _adversarial(rng, channels, np.float32)
    keep = [0, 1, 2, 3, 4, 5, 8, 10]            # no NaN, no +inf, no bad label
    x, labels = x[keep], labels[keep]
    labels[3] = 6                                # a finite class of the -inf row
    x, labels = x.reshape(2, 4, channels), labels.reshape(2, 4)
    attrs = {"axis": -1, "ignore_label": IGNORE}
    (loss, prob), _ = compare(device, "SoftmaxLoss", attrs, [x, labels],
                              ["softmax_loss_forward_vec", "softmax_loss_mean"], np.float32)
    assert np.isfinite(loss)
    compare(device, "SoftmaxLossGrad", attrs, [np.asarray(0.7, np.float32), prob, labels],
            ["softmax_loss_count", "softmax_loss_backward_vec"], np.float32, host_inputs=(0,))


@pytest.mark.parametrize("grid", [1, 2, 5, 11])
@pytest.mark.parametrize("channels", [300, 1027])
def test_the_vec_kernels_on_a_grid_smaller_than_the_work(device, monkeypatch, grid, channels):
    """The grid-stride loops of both vec kernels, as on GPT's logits (16384
    rows x 13 tiles a row: more tiles than the 65,535 blocks of a launch):
    the grid capped at ``grid`` blocks (fewer than a row's tiles, and more
    than one row's but not a multiple of them), the same bits as the full
    grid's and as the kernels before them. On a GPU (256 threads a block)
    the other tests launch the full grid; the emulated device runs 2 blocks
    whatever the launch asks, so there every test strides."""
    from purine_mpi.gpu.kernels import loss as loss_kernels
    rng = np.random.default_rng(channels + grid)
    x, labels = _adversarial(rng, channels, np.float32)
    prob = rng.random((7, channels)).astype(np.float32)
    blabels = np.array([0, channels - 1, 3, IGNORE, PAD, channels + 2, channels // 2])
    lab, blab = device.to_device(labels), device.to_device(blabels)

    def run():
        f = kernels.softmax_loss_forward(device.to_device(x), lab, IGNORE, pad_label=PAD)
        b = kernels.softmax_loss_backward(device.to_device(prob), blab, 0.7, IGNORE,
                                          scale_factor=0.5, pad_label=PAD)
        return [np.array(device.to_host(a)) for a in (*f, b)]

    def old():
        f = kernels.softmax_loss_forward(device.to_device(x), lab, IGNORE, pad_label=PAD,
                                         rows_kernel="softmax_loss_forward_rows")
        b = kernels.softmax_loss_backward(device.to_device(prob), blab, 0.7, IGNORE,
                                          scale_factor=0.5, pad_label=PAD, rows_kernel=None)
        return [np.array(device.to_host(a)) for a in (*f, b)]

    full, before = run(), old()
    monkeypatch.setattr(loss_kernels, "_MAX_BLOCKS", grid)
    capped = run()
    for what, a, b in zip(("prob", "loss", "valid", "dx"), capped, full):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=what)
    np.testing.assert_array_equal(capped[3].view(np.uint32), before[3].view(np.uint32))
    _close(capped[0], before[0], np.float32, "prob")
