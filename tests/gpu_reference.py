"""NumPy references for the CUDA kernels in cuda/*.cu (Caffe's CPU semantics).

Each function mirrors one wrapper of purine_mpi.gpu.kernels, written as
plainly as possible (loops over window positions, not clever indexing) after
Caffe's CPU code. tests/test_gpu_kernels.py checks these against PyTorch on
the CPU, and the CUDA kernels against these (on a GPU, and on the CPU by
compiling the kernels as host C++).
"""
import numpy as np


def _out_size(size, kernel, stride, pad, dilation=1):
    return (size + 2 * pad - (dilation * (kernel - 1) + 1)) // stride + 1


def pool_out_size(size, kernel, stride, pad, ceil_mode):
    """Floor, or Caffe's ceil rounding minus a last window starting in the
    padding (PyTorch's rule, which also applies with pad 0)."""
    if not ceil_mode:
        return (size + 2 * pad - kernel) // stride + 1
    out = int(np.ceil((size + 2 * pad - kernel) / stride)) + 1
    if (out - 1) * stride >= size + pad:
        out -= 1
    return out


# ---------------------------------------------------------------- im2col ---

def im2col(x, kh, kw, sh=1, sw=1, ph=0, pw=0, dh=1, dw=1):
    """(N, C, H, W) -> (N, C*kh*kw, OH*OW); row c*kh*kw + i*kw + j."""
    n, c, h, w = x.shape
    oh, ow = _out_size(h, kh, sh, ph, dh), _out_size(w, kw, sw, pw, dw)
    padded = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    cols = np.empty((n, c, kh, kw, oh, ow), x.dtype)
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dh, i * dh + sh * (oh - 1) + 1, sh)
            columns = slice(j * dw, j * dw + sw * (ow - 1) + 1, sw)
            cols[:, :, i, j] = padded[:, :, rows, columns]
    return cols.reshape(n, c * kh * kw, oh * ow)


def col2im(cols, x_shape, kh, kw, sh=1, sw=1, ph=0, pw=0, dh=1, dw=1):
    """Adjoint of im2col: scatter-add the columns into a zero image."""
    n, c, h, w = x_shape
    oh, ow = _out_size(h, kh, sh, ph, dh), _out_size(w, kw, sw, pw, dw)
    cols = cols.reshape(n, c, kh, kw, oh, ow)
    padded = np.zeros((n, c, h + 2 * ph, w + 2 * pw), cols.dtype)
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dh, i * dh + sh * (oh - 1) + 1, sh)
            columns = slice(j * dw, j * dw + sw * (ow - 1) + 1, sw)
            padded[:, :, rows, columns] += cols[:, :, i, j]
    return padded[:, :, ph:ph + h, pw:pw + w].copy()


# --------------------------------------------------------------- pooling ---

def _windows(h, w, kh, kw, sh, sw, ph, pw, ceil_mode):
    """Yield (oh, ow, clipped rows, clipped cols, pool_size) per output."""
    oh_count = pool_out_size(h, kh, sh, ph, ceil_mode)
    ow_count = pool_out_size(w, kw, sw, pw, ceil_mode)
    for oh in range(oh_count):
        for ow in range(ow_count):
            hstart, wstart = oh * sh - ph, ow * sw - pw
            # AVE divisor: window clipped to the padded input (Caffe).
            hend, wend = min(hstart + kh, h + ph), min(wstart + kw, w + pw)
            pool_size = (hend - hstart) * (wend - wstart)
            rows = (max(hstart, 0), min(hend, h))
            cols = (max(wstart, 0), min(wend, w))
            yield oh, ow, rows, cols, pool_size


def maxpool_forward(x, kh, kw, sh=1, sw=1, ph=0, pw=0, ceil_mode=False):
    """-> (y, mask): mask = flat index h*W + w of the first maximum, int32."""
    n, c, h, w = x.shape
    oh_count = pool_out_size(h, kh, sh, ph, ceil_mode)
    ow_count = pool_out_size(w, kw, sw, pw, ceil_mode)
    y = np.empty((n, c, oh_count, ow_count), x.dtype)
    mask = np.empty((n, c, oh_count, ow_count), np.int32)
    for oh, ow, (h0, h1), (w0, w1), _ in _windows(h, w, kh, kw, sh, sw, ph, pw, ceil_mode):
        window = x[:, :, h0:h1, w0:w1].reshape(n, c, -1)
        local = window.argmax(axis=2)                   # first maximum
        y[:, :, oh, ow] = np.take_along_axis(window, local[..., None], 2)[..., 0]
        mask[:, :, oh, ow] = (h0 + local // (w1 - w0)) * w + (w0 + local % (w1 - w0))
    return y, mask


def maxpool_backward(dy, mask, x_shape):
    """dx gets each dy added at its argmax."""
    n, c, h, w = x_shape
    dx = np.zeros((n * c, h * w), dy.dtype)
    planes = np.repeat(np.arange(n * c), dy.shape[2] * dy.shape[3])
    np.add.at(dx, (planes, mask.reshape(-1)), dy.reshape(-1))
    return dx.reshape(x_shape)


def avepool_forward(x, kh, kw, sh=1, sw=1, ph=0, pw=0, ceil_mode=False):
    n, c, h, w = x.shape
    y = np.empty((n, c, pool_out_size(h, kh, sh, ph, ceil_mode),
                  pool_out_size(w, kw, sw, pw, ceil_mode)), x.dtype)
    for oh, ow, (h0, h1), (w0, w1), size in _windows(h, w, kh, kw, sh, sw, ph, pw, ceil_mode):
        y[:, :, oh, ow] = x[:, :, h0:h1, w0:w1].sum(axis=(2, 3)) / size
    return y


def avepool_backward(dy, x_shape, kh, kw, sh=1, sw=1, ph=0, pw=0):
    n, c, h, w = x_shape
    dx = np.zeros(x_shape, dy.dtype)
    # The output count comes from dy, whichever rounding made it.
    for oh in range(dy.shape[2]):
        for ow in range(dy.shape[3]):
            hstart, wstart = oh * sh - ph, ow * sw - pw
            hend, wend = min(hstart + kh, h + ph), min(wstart + kw, w + pw)
            size = (hend - hstart) * (wend - wstart)
            rows = slice(max(hstart, 0), min(hend, h))
            cols = slice(max(wstart, 0), min(wend, w))
            dx[:, :, rows, cols] += dy[:, :, oh, ow, None, None] / size
    return dx


# ------------------------------------------------------------------- LRN ---

def _channel_window_sum(values, local_size):
    """sum over c' in [c - pre, c + pre] (clipped) along axis 1, odd size."""
    pre = (local_size - 1) // 2
    channels = values.shape[1]
    out = np.zeros_like(values)
    for c in range(channels):
        out[:, c] = values[:, max(c - pre, 0):min(c + pre, channels - 1) + 1].sum(axis=1)
    return out


def lrn_forward(x, local_size=5, alpha=1e-4, beta=0.75, k=1.0):
    """-> (y, scale); scale = k + alpha/n * window sum of x^2, y = x scale^-beta."""
    scale = k + alpha / local_size * _channel_window_sum(x * x, local_size)
    scale = scale.astype(x.dtype)
    return (x * scale ** -beta).astype(x.dtype), scale


def lrn_backward(x, y, scale, dy, local_size=5, alpha=1e-4, beta=0.75):
    """Caffe: dx = dy scale^-beta - 2 alpha beta / n * x * window sum(dy y / scale)."""
    ratio = _channel_window_sum(dy * y / scale, local_size)
    dx = dy * scale ** -beta - 2.0 * alpha * beta / local_size * x * ratio
    return dx.astype(x.dtype)


# ---------------------------------------------------------- softmax loss ---

def softmax_forward(x):
    """Softmax over axis 1, in float64, cast back."""
    wide = x.astype(np.float64)
    e = np.exp(wide - wide.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(x.dtype)


def softmax_backward(dy, y):
    """dx = y * (dy - sum over axis 1 of dy * y), in float64, cast back."""
    dy64, y64 = dy.astype(np.float64), y.astype(np.float64)
    return (y64 * (dy64 - (dy64 * y64).sum(axis=1, keepdims=True))).astype(y.dtype)


def softmax_loss_forward(x, labels, ignore_label=None):
    """-> (prob, loss, valid); softmax over axis 1, per-position loss
    log(sum(exp(shifted))) - shifted[label], exact (torch's cross_entropy,
    the CPU op; not Caffe's -log(max(prob, FLT_MIN)), which caps it at 87.3)."""
    n, channels = x.shape[:2]
    logits = x.reshape(n, channels, -1)
    shifted = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    prob = e / e.sum(axis=1, keepdims=True)
    labels = labels.reshape(n, -1).astype(np.int64)
    loss = np.zeros(labels.shape, x.dtype)
    valid = np.zeros(labels.shape, x.dtype)
    for b in range(n):
        for s in range(labels.shape[1]):
            label = labels[b, s]
            if ignore_label is not None and label == ignore_label:
                continue
            valid[b, s] = 1
            if 0 <= label < channels:
                loss[b, s] = np.log(e[b, :, s].sum()) - shifted[b, label, s]
            else:
                loss[b, s] = np.nan
    pos_shape = (n,) + x.shape[2:]
    return (prob.reshape(x.shape).astype(x.dtype), loss.reshape(pos_shape),
            valid.reshape(pos_shape))


def softmax_loss_backward(prob, labels, scale=1.0, ignore_label=None):
    """dx = scale * (prob - onehot(label)), 0 at ignored positions."""
    n, channels = prob.shape[:2]
    dx = prob.reshape(n, channels, -1).copy()
    labels = labels.reshape(n, -1).astype(np.int64)
    for b in range(n):
        for s in range(labels.shape[1]):
            label = labels[b, s]
            if ignore_label is not None and label == ignore_label:
                dx[b, :, s] = 0
            elif 0 <= label < channels:
                dx[b, label, s] -= 1
    return (scale * dx).astype(prob.dtype).reshape(prob.shape)


# ------------------------------------------------------- SGD and dropout ---

def sgd_momentum_update(w, g, v, lr, momentum=0.9, weight_decay=0.0, grad_scale=1.0):
    """In place, Caffe's order: v = mu v + lr (grad_scale g + wd w); w -= v."""
    v[...] = momentum * v + lr * (grad_scale * g + weight_decay * w)
    w -= v


def dropout_forward(x, keep, ratio):
    """Inverted dropout with a given boolean keep-mask -> (y, mask)."""
    mask = keep.astype(x.dtype)
    return (x * mask) * x.dtype.type(1.0 / (1.0 - ratio)), mask


# ------------------------------------------------ the GPU's float32 bits ---

def nan_positions(a):
    """Where ``a`` (float, or bfloat16 bits as uint16) holds a NaN."""
    a = np.asarray(a)
    if a.dtype == np.uint16:
        return ((a & 0x7F80) == 0x7F80) & ((a & 0x7F) != 0)
    return np.isnan(a)


def same_bits_any_nan(a, b):
    """The same bits, a NaN anywhere one is in the other (its payload and
    sign aside: inf * 0 or NaN + x is 0xFFC00000 or the operand's NaN on
    x86, the canonical 0x7FFFFFFF in a GPU's float32 arithmetic)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    nan = nan_positions(a)
    if not np.array_equal(nan, nan_positions(b)):
        return False
    return np.array_equal(a.view(f"u{a.dtype.itemsize}")[~nan],
                          b.view(f"u{b.dtype.itemsize}")[~nan])
