"""The from_logits loss kernels on logits stored as bfloat16 bits
(cuda/softmax_loss.cu ``softmax_loss_forward_bits_f32``,
``softmax_loss_grad_bits_f32``, ``softmax_loss_grad_bx_f32``) against the
path they replace, bit for bit: the bits widened into float32
(``from_bf16_bits``) placed at the same element offset from the vector grid,
``softmax_loss_forward_vec`` in place, ``softmax_loss_backward_vec`` in place
and ``to_bf16_bits`` of dx. The bits kernels read 4 values a thread where
the float kernels read a float4, so a row at the same offset is split over
the threads alike and summed in the same order: the same loss and dx bits
(the float path's partition follows the float32 copy's alignment; the test
places that copy at the bits' offset mod 4). Also the loss against a
float64 reference (a tolerance that fails on a wrong row), on adversarial
rows (huge, tiny, -inf entries, one finite class, all equal, NaN, +inf,
exp overflowing float32, ignored / padding / out-of-range labels), C odd and
not a multiple of 4, bases 0..3 elements off the grid, in place, dx off
x's grid (the scalar write), and grids smaller than the rows (the emulated
device runs 2 blocks of 3 threads whatever the launch asks: every test
strides; on a GPU the wrap-around test caps the grid)."""
import numpy as np
import pytest

from purine_mpi.base.precision import from_bf16_bits, to_bf16_bits, wire_scratch
from purine_mpi.gpu import kernels

IGNORE, PAD = -1, -2


def _bits(x):
    """float32 ``x`` rounded to bfloat16 bits (uint16)."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty(x.shape, np.uint16)
    to_bf16_bits(x, out, wire_scratch(x.size))
    return out


def _adversarial(rng, channels):
    """12 rows of bits and their labels."""
    x = 3 * rng.standard_normal((12, channels))
    x[1, 7], x[1, 11] = 1e4, -1e4
    x[2] = 1e-30 * rng.standard_normal(channels)
    x[3, ::5] = -np.inf
    x[4, :] = -np.inf
    x[4, channels - 2] = 0.5
    x[5, :] = 2.25
    x[6, channels // 2] = np.nan
    x[7, 3] = np.inf
    x[8] = 80 + 5 * rng.standard_normal(channels)
    labels = np.array([0, 7, channels - 1, 5, channels - 2, 3, 1, 3, channels - 3,
                       channels + 5, IGNORE, PAD])
    return _bits(x), labels


def _placed(device, a, offset):
    """``a`` on the device ``offset`` elements into a larger buffer (its
    first element ``offset`` elements past the vector grid: 16 bytes of
    float32, 8 of bits)."""
    flat = np.zeros(a.size + offset, a.dtype)
    flat[offset:] = a.ravel()
    return device.to_device(flat)[offset:].reshape(a.shape)


def _old_forward(device, bits, lab, offset):
    """The path before: widen into float32 at ``offset``, the vec kernel in place."""
    xb = _placed(device, bits, offset)
    wide = _placed(device, np.zeros(bits.shape, np.float32), offset)
    kernels.from_bf16_bits_device(xb.reshape(-1), wide.reshape(-1))
    _, loss, valid = kernels.softmax_loss_forward(wide, lab, IGNORE, out=(wide, None, None),
                                                  pad_label=PAD)
    return np.array(device.to_host(loss)), np.array(device.to_host(valid))


def _old_grad(device, bits, lab, offset, grad_kw, as_bits=True):
    """widen, forward in place, backward in place, round into bits."""
    xb = _placed(device, bits, offset)
    wide = _placed(device, np.zeros(bits.shape, np.float32), offset)
    kernels.from_bf16_bits_device(xb.reshape(-1), wide.reshape(-1))
    kernels.softmax_loss_forward(wide, lab, grad_kw.get("ignore_label"),
                                 out=(wide, None, None), pad_label=grad_kw.get("pad_label"))
    kernels.softmax_loss_backward(wide, lab, out=wide, **grad_kw)
    if not as_bits:
        return np.array(device.to_host(wide))
    kernels.to_bf16_bits_device(wide.reshape(-1), xb.reshape(-1))
    return np.array(device.to_host(xb))


def _float64_loss(bits, labels):
    x = from_bf16_bits(bits, np.empty(bits.shape, np.float32)).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        largest = x.max(axis=1, keepdims=True)
        log_sum = np.log(np.exp(x - largest).sum(axis=1))
    loss = np.zeros(len(x))
    for i, label in enumerate(labels):
        if label in (IGNORE, PAD):
            continue
        with np.errstate(invalid="ignore"):
            loss[i] = (log_sum[i] - (x[i, label] - largest[i, 0])
                       if 0 <= label < x.shape[1] else np.nan)
    return loss


@pytest.mark.parametrize("channels", [256, 301, 1027, 5002])
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_forward_bits_is_the_widened_path_bit_for_bit(device, channels, offset):
    rng = np.random.default_rng(channels + offset)
    bits, labels = _adversarial(rng, channels)
    lab = device.to_device(labels)
    device.launched.clear()
    loss, valid = kernels.softmax_loss_forward_bits(_placed(device, bits, offset), lab, IGNORE,
                                                    pad_label=PAD)
    assert device.launched == ["softmax_loss_forward_bits_f32"]
    loss, valid = np.array(device.to_host(loss)), np.array(device.to_host(valid))
    old_loss, old_valid = _old_forward(device, bits, lab, offset)
    np.testing.assert_array_equal(loss.view(np.uint32), old_loss.view(np.uint32))
    np.testing.assert_array_equal(valid, old_valid)
    np.testing.assert_array_equal(valid, [1] * 10 + [0, 0])
    want = _float64_loss(bits, labels)
    assert np.isnan(loss).tolist() == [False] * 6 + [True, True, False, True, False, False]
    np.testing.assert_allclose(loss, want, rtol=2e-5, atol=2e-6)


def _grad_kw(device, scale, plain):
    """``_device_backward``'s two forms: ``plain`` (1 / positions, no
    ignored label) or a count on the device with the ignore and pad labels."""
    top = device.to_device(np.array([0.7], np.float32)) if scale == "device" else 0.7
    if plain:
        return {"scale": top, "scale_factor": 1.0 / 12}
    return {"scale": top, "ignore_label": IGNORE, "pad_label": PAD,
            "count": device.to_device(np.array([9.0], np.float32))}


@pytest.mark.parametrize("channels", [256, 301, 1027])
@pytest.mark.parametrize("offset", [0, 1, 3])
@pytest.mark.parametrize("scale", ["number", "device"])
@pytest.mark.parametrize("plain", [True, False])
def test_grad_bits_is_the_widened_path_bit_for_bit(device, channels, offset, scale, plain):
    """dx in place over x (the op's layout) and into another bits array,
    as bits and as float32: the bits of the three kernels and the rounding."""
    rng = np.random.default_rng(10 * channels + offset)
    bits, labels = _adversarial(rng, channels)
    lab = device.to_device(labels)
    kw = _grad_kw(device, scale, plain)
    want = _old_grad(device, bits, lab, offset, kw)
    xb = _placed(device, bits, offset)
    device.launched.clear()
    got = kernels.softmax_loss_grad_bits(xb, lab, out=xb, **kw)
    assert device.launched == ["softmax_loss_grad_bits_f32"]
    np.testing.assert_array_equal(np.array(device.to_host(got)), want)
    other = kernels.softmax_loss_grad_bits(_placed(device, bits, offset), lab, **kw)
    np.testing.assert_array_equal(np.array(device.to_host(other)), want)
    # float32 dx (bits logits, a float32 gradient): the float path's dx itself
    want32 = _old_grad(device, bits, lab, offset, kw, as_bits=False)
    out = _placed(device, np.zeros(bits.shape, np.float32), offset)
    device.launched.clear()
    got32 = kernels.softmax_loss_grad_bits(_placed(device, bits, offset), lab, out=out, **kw)
    assert device.launched == ["softmax_loss_grad_bx_f32"]
    np.testing.assert_array_equal(np.array(device.to_host(got32)).view(np.uint32),
                                  want32.view(np.uint32))
    # a finite row against float64: dx = 0.7 / count * (softmax - onehot)
    x = from_bf16_bits(bits, np.empty(bits.shape, np.float32)).astype(np.float64)
    e = np.exp(x[0] - x[0].max())
    ref = e / e.sum()
    ref[labels[0]] -= 1
    ref *= 0.7 / (12 if plain else 9)
    np.testing.assert_allclose(want32[0], ref, rtol=1e-5, atol=1e-9)
    if not plain:   # ignored and padding rows: 0
        assert not want32[10:].any()


@pytest.mark.parametrize("offsets", [(0, 1), (1, 2), (3, 0)])
def test_grad_bits_with_dx_off_xs_grid(device, offsets):
    """dx at another offset than x: one element a thread for the writes,
    the reduction still x's partition: the same bits."""
    channels = 301
    rng = np.random.default_rng(sum(offsets))
    bits, labels = _adversarial(rng, channels)
    lab = device.to_device(labels)
    kw = _grad_kw(device, "number", False)
    want = _old_grad(device, bits, lab, offsets[0], kw)
    out = _placed(device, np.zeros(bits.shape, np.uint16), offsets[1])
    got = kernels.softmax_loss_grad_bits(_placed(device, bits, offsets[0]), lab, out=out, **kw)
    np.testing.assert_array_equal(np.array(device.to_host(got)), want)
    want32 = _old_grad(device, bits, lab, offsets[0], kw, as_bits=False)
    out32 = _placed(device, np.zeros(bits.shape, np.float32), offsets[1])
    got32 = kernels.softmax_loss_grad_bits(_placed(device, bits, offsets[0]), lab, out=out32,
                                           **kw)
    np.testing.assert_array_equal(np.array(device.to_host(got32)).view(np.uint32),
                                  want32.view(np.uint32))


@pytest.mark.parametrize("grid", [1, 2, 5])
def test_the_bits_kernels_on_a_grid_smaller_than_the_rows(device, monkeypatch, grid):
    from purine_mpi.gpu.kernels import loss as loss_kernels
    channels = 1027
    rng = np.random.default_rng(grid)
    bits, labels = _adversarial(rng, channels)
    lab = device.to_device(labels)
    kw = _grad_kw(device, "number", False)

    def run():
        loss, valid = kernels.softmax_loss_forward_bits(device.to_device(bits), lab, IGNORE,
                                                        pad_label=PAD)
        dx = kernels.softmax_loss_grad_bits(device.to_device(bits), lab, **kw)
        return [np.array(device.to_host(a)) for a in (loss, valid, dx)]

    full = run()
    monkeypatch.setattr(loss_kernels, "_MAX_BLOCKS", grid)
    capped = run()
    for what, a, b in zip(("loss", "valid", "dx"), capped, full):
        np.testing.assert_array_equal(a, b, err_msg=what)
    np.testing.assert_array_equal(capped[0].view(np.uint32),
                                  _old_forward(device, bits, lab, 0)[0].view(np.uint32))
    np.testing.assert_array_equal(capped[2], _old_grad(device, bits, lab, 0, kw))


def test_bad_inputs_are_named(device):
    lab = device.to_device(np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="uint16"):
        kernels.softmax_loss_forward_bits(device.to_device(np.zeros((3, 300), np.float32)), lab)
    with pytest.raises(ValueError, match="one label per position"):
        kernels.softmax_loss_forward_bits(device.to_device(np.zeros((4, 300), np.uint16)), lab)
    with pytest.raises(ValueError, match="uint16 .* or float32"):
        kernels.softmax_loss_grad_bits(device.to_device(np.zeros((3, 300), np.uint16)), lab,
                                       out=device.to_device(np.zeros((3, 300), np.float64)))


@pytest.mark.parametrize("from_logits,channels", [(False, 300), (True, 40), (True, 300)])
def test_the_device_gradient_divides_by_the_normaliser_without_an_ignore_label(
        device, from_logits, channels):
    """A loss with a normaliser input (a 0-d blob) and no ``ignore_label``:
    loss = sum(nll) / normaliser, so dx = dloss * (prob - onehot) /
    normaliser on the device as on the host -- not / positions (15 here,
    the normaliser 11: every element 15/11 too small). The probability
    path, the ``from_logits`` chunk path (40 classes) and the bits kernels
    (300 classes, logits stored as bits)."""
    from tests.test_bf16_storage import _loss_kernels, _loss_run, _numpy_bits
    rng = np.random.default_rng(channels)
    x = rng.standard_normal((3, 5, channels)).astype(np.float32)
    if from_logits:
        x = from_bf16_bits(_numpy_bits(x), np.empty(x.shape, np.float32))
    label = rng.integers(0, channels, (3, 5)).astype(np.int32)
    logits = _numpy_bits(x) if from_logits else x
    kernels_of = (lambda: _loss_kernels(from_logits, norm=11.0, axis=-1))
    host_loss, host_dx = _loss_run(np.array, np.asarray, kernels_of(), logits, label, 0.75,
                                   np.float32)
    loss, dx = _loss_run(device.to_device, lambda a: np.asarray(device.to_host(a)),
                         kernels_of(), logits, label, 0.75, np.float32)
    if from_logits and channels >= 256:
        assert "softmax_loss_grad_bx_f32" in device.launched
    # float64: 0.75 / 11 * (softmax - onehot)
    w = x.reshape(-1, channels).astype(np.float64)
    p = np.exp(w - w.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(15), label.reshape(-1)] -= 1
    want = (0.75 / 11 * p).reshape(x.shape)
    np.testing.assert_allclose(host_dx, want, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(dx, want, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(loss, host_loss, rtol=1e-6)
