"""NumPy-like wrappers around the raw CUDA kernels in ``cuda/*.cu``.

Ops call these when ``get_xp(x) is cupy``; the CPU path stays in NumPy.
Inputs are CuPy arrays of float32 or float64 (the output dtype follows the
input). Each wrapper allocates its outputs, or writes into ``out=`` (an array,
or a tuple for several outputs, ``None`` entries allocated) so a kernel can
fill a preallocated blob in place; a non-contiguous ``out`` is filled through
a temporary. Kernels launch on CuPy's current stream, so the dispatcher's
``with stream:`` decides where they run. Formulas and Caffe references are in
each ``.cu`` file's header; tests/gpu_reference.py has a NumPy version of each.

Short names follow the issue and Caffe: kh/kw kernel height/width, sh/sw
stride, ph/pw zero padding, dh/dw dilation.

CuPy is imported on first call; importing this module needs only NumPy.
"""
import numpy as np

from . import dtype_suffix, get_function, import_cupy

#: the extern "C" entry points of each cuda/<file>.cu (each exists as
#: <name>_f32 and <name>_f64); tests/test_cuda_compile.py checks them.
ENTRY_POINTS = {
    "im2col": ("im2col", "col2im"),
    "pooling": ("maxpool_forward", "maxpool_backward",
                "avepool_forward", "avepool_backward"),
    "lrn": ("lrn_forward", "lrn_backward"),
    "softmax_loss": ("softmax_loss_forward", "softmax_loss_backward", "softmax_loss_mean",
                     "softmax_loss_count"),
    "sgd": ("sgd_momentum", "sgd_momentum_multi"),
    "dropout": ("dropout_forward", "dropout_backward"),
    "activation": ("relu_forward", "relu_backward", "bias_act"),
    "reduce": ("channel_sum", "sum_rows"),
    "loss_watch": ("loss_watch",),
}
#: entry points that exist once, without a dtype suffix
PLAIN_ENTRY_POINTS = {
    "dropout": ("philox_words",),
    "lr_policy": ("learning_rate",),
}

_BLOCK = 256
_MAX_BLOCKS = 65535   # kernels use grid-stride loops, so any grid covers all
_REDUCE_THREADS = 256  # PURINE_REDUCE_THREADS of cuda/reduce.cu


# ----------------------------------------------------------------- sizes ---

def conv_output_size(size, kernel, stride=1, pad=0, dilation=1):
    """Output length of a convolution / im2col along one axis (floor)."""
    extent = dilation * (kernel - 1) + 1
    return (size + 2 * pad - extent) // stride + 1


def pool_output_size(size, kernel, stride=1, pad=0, ceil_mode=False):
    """Output length of pooling along one axis.

    floor((size + 2 pad - kernel) / stride) + 1, or with ``ceil_mode`` the
    ceiling (Caffe's rounding), dropping a last window that would start in
    the padding (as Caffe and PyTorch do; PyTorch's rule, which also applies
    with pad 0, is used so no window is ever empty)."""
    span = size + 2 * pad - kernel
    if not ceil_mode:
        return span // stride + 1
    out = -(-span // stride) + 1
    if (out - 1) * stride >= size + pad:
        out -= 1
    return out


# --------------------------------------------------------------- helpers ---

def _input(cupy, array, what, ndim=None):
    """A C-contiguous float32/float64 CuPy array (dtype checked early)."""
    if not isinstance(array, cupy.ndarray):
        raise TypeError(f"{what}: expected a CuPy array, got {type(array).__name__}")
    dtype_suffix(array.dtype)
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"{what}: expected {ndim} dimensions, got shape {array.shape}")
    return cupy.ascontiguousarray(array)


def _output(cupy, out, shape, dtype, what):
    """(buffer the kernel writes, array to copy it into afterwards or None)."""
    shape = tuple(int(s) for s in shape)
    if out is None:
        return cupy.empty(shape, dtype=dtype), None
    if tuple(out.shape) != shape or np.dtype(out.dtype) != np.dtype(dtype):
        raise ValueError(f"{what}: out has shape {tuple(out.shape)} and dtype "
                         f"{out.dtype}, expected {shape} and {np.dtype(dtype)}")
    if out.flags.c_contiguous:
        return out, None
    return cupy.empty(shape, dtype=dtype), out


def _same_as(what, ref_name, ref, **arrays):
    """Every array of ``arrays`` has ``ref``'s shape and dtype."""
    for name, array in arrays.items():
        if array.shape != ref.shape or array.dtype != ref.dtype:
            raise ValueError(f"{what}: {name} has shape {tuple(array.shape)} {array.dtype}, "
                             f"expected {ref_name}'s {tuple(ref.shape)} {ref.dtype}")


def _finish(buffer, target):
    if target is None:
        return buffer
    target[...] = buffer
    return target


def _outs(out, count):
    if out is None:
        return (None,) * count
    out = tuple(out)
    if len(out) != count:
        raise ValueError(f"out must hold {count} arrays (None to allocate), got {len(out)}")
    return out


def _launch(source, func, dtype, total, args):
    """Run kernel <func>_<dtype> of cuda/<source>.cu over ``total`` items."""
    if total <= 0:
        return
    kernel = get_function(source, func, dtype)
    blocks = min((total + _BLOCK - 1) // _BLOCK, _MAX_BLOCKS)
    kernel((blocks,), (_BLOCK,), (np.int64(total),) + tuple(args))


def _launch_blocks(source, func, dtype, blocks, threads, args):
    """Run kernel <func>_<dtype> (or <func> for dtype None) of cuda/<source>.cu
    on an explicit grid (kernels whose blocks cooperate, single-thread ones)."""
    kernel = get_function(source, func, dtype)
    kernel((int(blocks),), (int(threads),), tuple(args))


def _int(value):
    return np.int32(int(value))


def _scalar_or_device(cupy, value, dtype, dummy, what, factor=1.0):
    """(host factor, device pointer, flag) for a scalar (times ``factor``)
    that may live on the device: a Python number gives (value * factor,
    dummy, 0); a one-element CuPy array gives (factor, array, 1) and the
    kernel reads it, with no host round trip."""
    if isinstance(value, cupy.ndarray):
        if value.size != 1:
            raise ValueError(f"{what} must be a scalar or a one-element array, "
                             f"got shape {tuple(value.shape)}")
        array = cupy.ascontiguousarray(value.astype(dtype, copy=False).reshape(1))
        return dtype.type(factor), array, _int(1)
    return dtype.type(float(value) * float(factor)), dummy, _int(0)


def _check_pool_args(what, kh, kw, sh, sw, ph, pw):
    if min(kh, kw, sh, sw) < 1 or min(ph, pw) < 0:
        raise ValueError(f"{what}: kernel and stride must be >= 1 and padding >= 0, "
                         f"got kernel ({kh}, {kw}), stride ({sh}, {sw}), pad ({ph}, {pw})")
    if ph >= kh or pw >= kw:
        raise ValueError(f"{what}: padding ({ph}, {pw}) must be smaller than the "
                         f"kernel ({kh}, {kw}) (as in Caffe)")


# ---------------------------------------------------------------- im2col ---

def im2col(x, kh, kw, sh=1, sw=1, ph=0, pw=0, dh=1, dw=1, out=None):
    """Unfold ``x`` (N, C, H, W) into columns (N, C*kh*kw, OH*OW).

    Row ``c*kh*kw + i*kw + j`` holds ``x[n, c, oh*sh - ph + i*dh, ow*sw - pw + j*dw]``
    (0 in the padding), as ``torch.nn.functional.unfold``."""
    cupy = import_cupy()
    x = _input(cupy, x, "im2col: x", ndim=4)
    n, c, h, w = x.shape
    oh = conv_output_size(h, kh, sh, ph, dh)
    ow = conv_output_size(w, kw, sw, pw, dw)
    if oh < 1 or ow < 1:
        raise ValueError(f"im2col: a ({kh}, {kw}) kernel with dilation ({dh}, {dw}) "
                         f"does not fit the padded {h}x{w} input")
    cols, target = _output(cupy, out, (n, c * kh * kw, oh * ow), x.dtype, "im2col")
    _launch("im2col", "im2col", x.dtype, n * c * oh * ow,
            (x, _int(h), _int(w), _int(kh), _int(kw), _int(sh), _int(sw),
             _int(ph), _int(pw), _int(dh), _int(dw), _int(oh), _int(ow), cols))
    return _finish(cols, target)


def col2im(cols, x_shape, kh, kw, sh=1, sw=1, ph=0, pw=0, dh=1, dw=1, out=None):
    """Adjoint of :func:`im2col`: sum columns (N, C*kh*kw, OH*OW) back into an
    image of shape ``x_shape`` (N, C, H, W), as ``torch.nn.functional.fold``."""
    cupy = import_cupy()
    n, c, h, w = (int(s) for s in x_shape)
    oh = conv_output_size(h, kh, sh, ph, dh)
    ow = conv_output_size(w, kw, sw, pw, dw)
    cols = _input(cupy, cols, "col2im: cols")
    if tuple(cols.shape) != (n, c * kh * kw, oh * ow):
        raise ValueError(f"col2im: cols has shape {tuple(cols.shape)}, expected "
                         f"{(n, c * kh * kw, oh * ow)} for image shape {tuple(x_shape)}")
    x, target = _output(cupy, out, (n, c, h, w), cols.dtype, "col2im")
    _launch("im2col", "col2im", cols.dtype, n * c * h * w,
            (cols, _int(h), _int(w), _int(kh), _int(kw), _int(sh), _int(sw),
             _int(ph), _int(pw), _int(dh), _int(dw), _int(oh), _int(ow), x))
    return _finish(x, target)


# --------------------------------------------------------------- pooling ---

def _pool_forward(func, x, kh, kw, sh, sw, ph, pw, ceil_mode, outs):
    cupy = import_cupy()
    _check_pool_args(func, kh, kw, sh, sw, ph, pw)
    x = _input(cupy, x, f"{func}: x", ndim=4)
    n, c, h, w = x.shape
    oh = pool_output_size(h, kh, sh, ph, ceil_mode)
    ow = pool_output_size(w, kw, sw, pw, ceil_mode)
    if oh < 1 or ow < 1:
        raise ValueError(f"{func}: a ({kh}, {kw}) window does not fit the padded "
                         f"{h}x{w} input")
    shape = (n, c, oh, ow)
    y, y_target = _output(cupy, outs[0], shape, x.dtype, f"{func} (y)")
    args = [x, _int(h), _int(w), _int(oh), _int(ow), _int(kh), _int(kw),
            _int(sh), _int(sw), _int(ph), _int(pw), y]
    if func == "maxpool_forward":
        mask, mask_target = _output(cupy, outs[1], shape, np.int32, f"{func} (mask)")
        args.append(mask)
    _launch("pooling", func, x.dtype, n * c * oh * ow, args)
    if func == "maxpool_forward":
        return _finish(y, y_target), _finish(mask, mask_target)
    return _finish(y, y_target)


def maxpool_forward(x, kh, kw, sh=1, sw=1, ph=0, pw=0, ceil_mode=False, out=None):
    """Max pooling of ``x`` (N, C, H, W) -> ``(y, mask)``.

    ``mask`` (int32, shape of y) is the argmax as a flat index ``h*W + w``
    within the (n, c) plane (the first maximum; as PyTorch's
    ``return_indices``); pass it to :func:`maxpool_backward`."""
    return _pool_forward("maxpool_forward", x, kh, kw, sh, sw, ph, pw, ceil_mode,
                         _outs(out, 2))


def maxpool_backward(dy, mask, x_shape, kh, kw, sh=1, sw=1, ph=0, pw=0, out=None):
    """Gradient of max pooling: dx (``x_shape``) gets each ``dy`` at its argmax."""
    cupy = import_cupy()
    _check_pool_args("maxpool_backward", kh, kw, sh, sw, ph, pw)
    dy = _input(cupy, dy, "maxpool_backward: dy", ndim=4)
    if not isinstance(mask, cupy.ndarray) or tuple(mask.shape) != tuple(dy.shape):
        raise ValueError(f"maxpool_backward: mask must be a CuPy array of dy's shape "
                         f"{tuple(dy.shape)}")
    mask = cupy.ascontiguousarray(mask.astype(np.int32, copy=False))
    n, c, h, w = (int(s) for s in x_shape)
    oh, ow = dy.shape[2], dy.shape[3]
    dx, target = _output(cupy, out, (n, c, h, w), dy.dtype, "maxpool_backward")
    _launch("pooling", "maxpool_backward", dy.dtype, n * c * h * w,
            (dy, mask, _int(h), _int(w), _int(oh), _int(ow), _int(kh), _int(kw),
             _int(sh), _int(sw), _int(ph), _int(pw), dx))
    return _finish(dx, target)


def avepool_forward(x, kh, kw, sh=1, sw=1, ph=0, pw=0, ceil_mode=False, out=None):
    """Average pooling of ``x`` (N, C, H, W); each window's sum is divided by
    its size clipped to the padded input (Caffe; PyTorch count_include_pad)."""
    return _pool_forward("avepool_forward", x, kh, kw, sh, sw, ph, pw, ceil_mode,
                         (out,))


def avepool_backward(dy, x_shape, kh, kw, sh=1, sw=1, ph=0, pw=0, out=None):
    """Gradient of average pooling: each ``dy`` spread over its window / size."""
    cupy = import_cupy()
    _check_pool_args("avepool_backward", kh, kw, sh, sw, ph, pw)
    dy = _input(cupy, dy, "avepool_backward: dy", ndim=4)
    n, c, h, w = (int(s) for s in x_shape)
    oh, ow = dy.shape[2], dy.shape[3]
    dx, target = _output(cupy, out, (n, c, h, w), dy.dtype, "avepool_backward")
    _launch("pooling", "avepool_backward", dy.dtype, n * c * h * w,
            (dy, _int(h), _int(w), _int(oh), _int(ow), _int(kh), _int(kw),
             _int(sh), _int(sw), _int(ph), _int(pw), dx))
    return _finish(dx, target)


# ------------------------------------------------------------------- LRN ---

def _lrn_geometry(x, local_size, what):
    if x.ndim < 2:
        raise ValueError(f"{what}: expected (N, C, ...) input, got shape {tuple(x.shape)}")
    if local_size < 1 or local_size % 2 != 1:
        raise ValueError(f"{what}: local_size must be odd (as in Caffe), got {local_size}")
    channels = x.shape[1]
    spatial = int(np.prod(x.shape[2:], dtype=np.int64))
    return channels, spatial, (local_size - 1) // 2


def lrn_forward(x, local_size=5, alpha=1e-4, beta=0.75, k=1.0, out=None):
    """LRN across channels -> ``(y, scale)``.

    scale = k + alpha/local_size * (sum of x^2 over the local_size channels
    centred on c); y = x * scale^-beta. ``scale`` feeds :func:`lrn_backward`."""
    cupy = import_cupy()
    x = _input(cupy, x, "lrn_forward: x")
    channels, spatial, pre_pad = _lrn_geometry(x, local_size, "lrn_forward")
    y_out, scale_out = _outs(out, 2)
    y, y_target = _output(cupy, y_out, x.shape, x.dtype, "lrn_forward (y)")
    scale, scale_target = _output(cupy, scale_out, x.shape, x.dtype, "lrn_forward (scale)")
    t = x.dtype.type
    _launch("lrn", "lrn_forward", x.dtype, x.size,
            (x, _int(channels), _int(spatial), _int(pre_pad), t(alpha / local_size),
             t(k), t(-beta), scale, y))
    return _finish(y, y_target), _finish(scale, scale_target)


def lrn_backward(x, y, scale, dy, local_size=5, alpha=1e-4, beta=0.75, out=None):
    """Gradient of :func:`lrn_forward` (Caffe's formula):
    dx = dy * scale^-beta - 2 alpha beta / local_size * x * sum_window(dy * y / scale)."""
    cupy = import_cupy()
    x = _input(cupy, x, "lrn_backward: x")
    y = _input(cupy, y, "lrn_backward: y")
    scale = _input(cupy, scale, "lrn_backward: scale")
    dy = _input(cupy, dy, "lrn_backward: dy")
    _same_as("lrn_backward", "x", x, y=y, scale=scale, dy=dy)
    channels, spatial, pre_pad = _lrn_geometry(x, local_size, "lrn_backward")
    dx, target = _output(cupy, out, x.shape, x.dtype, "lrn_backward")
    t = x.dtype.type
    _launch("lrn", "lrn_backward", x.dtype, x.size,
            (x, y, scale, dy, _int(channels), _int(spatial), _int(pre_pad), t(-beta),
             t(2.0 * alpha * beta / local_size), dx))
    return _finish(dx, target)


# ---------------------------------------------------------- softmax loss ---

def _labels(cupy, labels, positions, what):
    if not isinstance(labels, cupy.ndarray) or labels.size != positions:
        shape = getattr(labels, "shape", None)
        raise ValueError(f"{what}: labels must be a CuPy array with one label per "
                         f"position ({positions}), got shape {shape}")
    # int64 as the data reader makes them (no conversion); float labels (as
    # Caffe stores them) are truncated, as Caffe does
    return cupy.ascontiguousarray(labels.astype(np.int64, copy=False))


def _ignore(ignore_label):
    if ignore_label is None:
        return _int(0), _int(0)
    return _int(ignore_label), _int(1)


def _class_layout(cupy, a, labels, func, arg, what):
    """(a, labels, N, C, positions per sample) of an (N, C, ...) array and its
    one-label-per-position labels, checked."""
    a = _input(cupy, a, f"{func}: {arg}")
    if a.ndim < 2:
        raise ValueError(f"{func}: expected (N, C, ...) {what}, got shape {tuple(a.shape)}")
    n, channels = a.shape[0], a.shape[1]
    inner = int(np.prod(a.shape[2:], dtype=np.int64))
    return a, _labels(cupy, labels, n * inner, func), n, channels, inner


def softmax_loss_forward(x, labels, ignore_label=None, out=None):
    """Fused softmax over axis 1 and cross-entropy -> ``(prob, loss, valid)``.

    ``x`` is (N, C, ...), ``labels`` holds one class per position (N, ...).
    prob has x's shape; loss and valid have shape (N, ...) (x without axis 1):
    loss = -log(max(prob[label], FLT_MIN)), valid = 1, both 0 where
    label == ignore_label. The batch-mean loss is sum(loss) / sum(valid)."""
    cupy = import_cupy()
    x, labels, n, channels, inner = _class_layout(cupy, x, labels, "softmax_loss_forward",
                                                  "x", "logits")
    prob_out, loss_out, valid_out = _outs(out, 3)
    pos_shape = (n,) + tuple(x.shape[2:])
    prob, prob_t = _output(cupy, prob_out, x.shape, x.dtype, "softmax_loss_forward (prob)")
    loss, loss_t = _output(cupy, loss_out, pos_shape, x.dtype, "softmax_loss_forward (loss)")
    valid, valid_t = _output(cupy, valid_out, pos_shape, x.dtype,
                             "softmax_loss_forward (valid)")
    ignore_value, has_ignore = _ignore(ignore_label)
    _launch("softmax_loss", "softmax_loss_forward", x.dtype, n * inner,
            (x, labels, _int(channels), _int(inner), ignore_value, has_ignore,
             prob, loss, valid))
    return _finish(prob, prob_t), _finish(loss, loss_t), _finish(valid, valid_t)


def softmax_loss_backward(prob, labels, scale=1.0, ignore_label=None, out=None, count=None,
                          scale_factor=1.0):
    """Gradient of the summed loss times ``scale * scale_factor / count``:
    dx = scale * scale_factor / count * (prob - onehot), 0 at ignored
    positions. ``scale`` is a number or a one-element CuPy array (e.g. the
    top gradient; ``scale_factor`` a number, e.g. 1 / positions), ``count``
    None or a one-element CuPy array (the valid count of
    :func:`softmax_loss_count`): both stay on the device."""
    cupy = import_cupy()
    prob, labels, n, channels, inner = _class_layout(cupy, prob, labels,
                                                     "softmax_loss_backward", "prob", "prob")
    dx, target = _output(cupy, out, prob.shape, prob.dtype, "softmax_loss_backward")
    scale_value, scale_ptr, has_scale_ptr = _scalar_or_device(
        cupy, scale, prob.dtype, prob, "softmax_loss_backward: scale", scale_factor)
    if count is None:
        count_ptr, has_count = prob, _int(0)
    else:
        _, count_ptr, has_count = _scalar_or_device(cupy, count, prob.dtype, prob,
                                                    "softmax_loss_backward: count")
    ignore_value, has_ignore = _ignore(ignore_label)
    _launch("softmax_loss", "softmax_loss_backward", prob.dtype, prob.size,
            (prob, labels, _int(channels), _int(inner), ignore_value, has_ignore,
             scale_value, scale_ptr, has_scale_ptr, count_ptr, has_count, dx))
    return _finish(dx, target)


def softmax_loss_mean(loss, valid, out, count=None):
    """out = sum(loss) / max(sum(valid), 1) on the device, one block (and,
    with ``count``, that normaliser too): one-element CuPy arrays."""
    cupy = import_cupy()
    loss = _input(cupy, loss, "softmax_loss_mean: loss")
    valid = _input(cupy, valid, "softmax_loss_mean: valid")
    for name, array in (("out", out), ("count", count)):
        if array is not None and (not isinstance(array, cupy.ndarray) or array.size != 1
                                  or array.dtype != loss.dtype):
            raise ValueError(f"softmax_loss_mean: {name} must be a one-element {loss.dtype} "
                             "CuPy array")
    out_flat = out.reshape(1)
    _launch_blocks("softmax_loss", "softmax_loss_mean", loss.dtype, 1, _REDUCE_THREADS,
                   (np.int64(loss.size), loss, valid, out_flat,
                    out_flat if count is None else count.reshape(1), _int(count is not None)))
    return out


def softmax_loss_count(labels, ignore_label, out):
    """out = max(number of labels != ignore_label, 1), one block on the device."""
    cupy = import_cupy()
    labels = _labels(cupy, labels, labels.size, "softmax_loss_count")
    if not isinstance(out, cupy.ndarray) or out.size != 1:
        raise ValueError("softmax_loss_count: out must be a one-element CuPy array")
    _launch_blocks("softmax_loss", "softmax_loss_count", out.dtype, 1, _REDUCE_THREADS,
                   (np.int64(labels.size), labels, _int(ignore_label), out.reshape(1)))
    return out


# ------------------------------------------------------------ SGD update ---

def sgd_momentum_update(w, g, v, lr, momentum=0.9, weight_decay=0.0, grad_scale=1.0,
                        lr_mult=1.0):
    """In place: v = momentum*v + rate*(grad_scale*g + weight_decay*w); w -= v,
    rate = lr * lr_mult.

    ``w`` and ``v`` must be C-contiguous (they are updated where they are);
    ``lr`` is a number or a one-element CuPy array (a learning-rate blob, read
    by the kernel and multiplied there by ``lr_mult``: no temporary)."""
    cupy = import_cupy()
    for name, array in (("w", w), ("v", v)):
        if not isinstance(array, cupy.ndarray) or not array.flags.c_contiguous:
            raise ValueError(f"sgd_momentum_update: {name} must be a C-contiguous "
                             "CuPy array (it is updated in place)")
    dtype_suffix(w.dtype)
    g = _input(cupy, g, "sgd_momentum_update: g")
    _same_as("sgd_momentum_update", "w", w, g=g, v=v)
    t = w.dtype.type
    lr_value, lr_ptr, has_lr_ptr = _lr_arg(cupy, lr, lr_mult, w, "sgd_momentum_update")
    _launch("sgd", "sgd_momentum", w.dtype, w.size,
            (w, g, v, lr_value, lr_ptr, has_lr_ptr, t(momentum), t(weight_decay),
             t(grad_scale)))


def _lr_arg(cupy, lr, lr_mult, like, what):
    """(value, pointer, flag) of a learning rate times ``lr_mult``: a device
    blob is read by the kernel (value = lr_mult), a number is folded in."""
    t = like.dtype.type
    if isinstance(lr, cupy.ndarray):
        if lr.size != 1:
            raise ValueError(f"{what}: lr must be a scalar or a one-element array, "
                             f"got shape {tuple(lr.shape)}")
        if np.dtype(lr.dtype) != np.dtype(like.dtype):
            lr = lr.astype(like.dtype)  # a float32 lr blob for float64 weights
        return t(lr_mult), cupy.ascontiguousarray(lr.reshape(1)), _int(1)
    return t(float(lr) * float(lr_mult)), like, _int(0)


class MultiTensorTable:
    """The device tables of :func:`sgd_momentum_multi` for a fixed set of
    parameters: built once (e.g. in an op's setup), reused every iteration.

    ``grads``: the gradient arrays (C-contiguous, any addresses, kept alive
    here); ``offsets``: each parameter's element offset in the flat buffers;
    ``lr_mults``/``decays``: per-parameter rate multiplier and weight decay
    (weight_decay * decay_mult)."""

    def __init__(self, grads, offsets, lr_mults, decays, dtype):
        cupy = import_cupy()
        from .raw import data_ptr
        dtype = np.dtype(dtype)
        dtype_suffix(dtype)
        if not len(grads) == len(offsets) == len(lr_mults) == len(decays) or not grads:
            raise ValueError("MultiTensorTable: one offset, lr_mult and decay per gradient")
        for g in grads:
            if not isinstance(g, cupy.ndarray) or not g.flags.c_contiguous or g.dtype != dtype:
                raise ValueError(f"MultiTensorTable: every gradient must be a C-contiguous "
                                 f"{dtype} CuPy array")
        sizes = [int(g.size) for g in grads]
        self.grads = list(grads)
        self.sizes = sizes
        self.total = int(sum(sizes))
        self.segments = len(grads)
        self.offsets_host = [int(o) for o in offsets]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.starts = cupy.asarray(starts)
        self.offsets = cupy.asarray(np.asarray(self.offsets_host, np.int64))
        self.pointers = cupy.asarray(np.asarray([data_ptr(g) for g in grads], np.uint64))
        self.lr_mults = cupy.asarray(np.asarray(lr_mults, dtype))
        self.decays = cupy.asarray(np.asarray(decays, dtype))
        self.dtype = dtype


def sgd_momentum_multi(w, v, table, lr, momentum=0.9, grad_scale=1.0):
    """:func:`sgd_momentum_update` of every parameter in ``table`` (a
    :class:`MultiTensorTable`) in one kernel, in place on the flat weight
    and momentum buffers ``w`` and ``v`` (1-D, C-contiguous)."""
    cupy = import_cupy()
    for name, array in (("w", w), ("v", v)):
        if not isinstance(array, cupy.ndarray) or not array.flags.c_contiguous or \
                array.dtype != table.dtype:
            raise ValueError(f"sgd_momentum_multi: {name} must be a C-contiguous "
                             f"{table.dtype} CuPy array (it is updated in place)")
    end = max(o + n for o, n in zip(table.offsets_host, table.sizes))
    if w.size < end or v.size < end:
        raise ValueError(f"sgd_momentum_multi: the flat buffers hold {w.size} and {v.size} "
                         f"elements, the parameters reach {end}")
    t = w.dtype.type
    lr_value, lr_ptr, has_lr_ptr = _lr_arg(cupy, lr, 1.0, w, "sgd_momentum_multi")
    _launch("sgd", "sgd_momentum_multi", w.dtype, table.total,
            (w, v, table.pointers, table.starts, table.offsets, table.lr_mults,
             table.decays, _int(table.segments), lr_value, lr_ptr, has_lr_ptr,
             t(momentum), t(grad_scale)))


# --------------------------------------------------------------- dropout ---

def _iteration(cupy, iteration):
    """(value, device pointer, flag) of an iteration: a number, or a
    one-element int64 CuPy array (the iteration blob on the device), which
    the kernel reads itself (no host round trip)."""
    if isinstance(iteration, cupy.ndarray):
        if iteration.size != 1 or np.dtype(iteration.dtype) != np.dtype(np.int64):
            raise ValueError(f"the iteration must be a one-element int64 array, got "
                             f"{iteration.dtype} of shape {tuple(iteration.shape)}")
        return np.int64(0), cupy.ascontiguousarray(iteration.reshape(1)), _int(1)
    value = int(iteration)
    if not -(1 << 63) <= value < (1 << 63):
        raise ValueError(f"iteration {value} does not fit 64 bits")
    return np.int64(value), cupy.empty((1,), dtype=np.int64), _int(0)  # unread


def dropout_forward(x, iteration, ratio, key0, key1, ctr1=0, out=None):
    """Inverted dropout with a Philox mask drawn on the device -> ``(y, mask)``.

    Element i is kept iff Philox word i of the stream
    ``((i // 4, ctr1, iter lo, iter hi), (key0, key1))`` is >= floor(ratio 2^32)
    (:mod:`purine_mpi.philox`, which draws the same words on the CPU);
    mask = 1 or 0 (x's dtype), y = (x * mask) / (1 - ratio). ``iteration`` is
    a number or the one-element int64 iteration blob on the device."""
    from ..philox import keep_threshold
    cupy = import_cupy()
    threshold = keep_threshold(ratio)
    x = _input(cupy, x, "dropout_forward: x")
    y_out, mask_out = _outs(out, 2)
    y, y_target = _output(cupy, y_out, x.shape, x.dtype, "dropout_forward (y)")
    mask, mask_target = _output(cupy, mask_out, x.shape, x.dtype, "dropout_forward (mask)")
    it_value, it_ptr, has_it_ptr = _iteration(cupy, iteration)
    t = x.dtype.type
    u32 = np.uint32
    _launch("dropout", "dropout_forward", x.dtype, -(-x.size // 4),
            (np.int64(x.size), x, it_value, it_ptr, has_it_ptr, u32(key0), u32(key1),
             u32(int(ctr1) & 0xFFFFFFFF), u32(threshold), t(1.0 / (1.0 - float(ratio))), y,
             mask))
    return _finish(y, y_target), _finish(mask, mask_target)


def dropout_backward(dy, mask, ratio, out=None):
    """dx = (dy * mask) / (1 - ratio), one kernel."""
    cupy = import_cupy()
    if not 0.0 <= float(ratio) < 1.0:
        raise ValueError(f"dropout_backward: ratio must be in [0, 1), got {ratio}")
    dy = _input(cupy, dy, "dropout_backward: dy")
    mask = _input(cupy, mask, "dropout_backward: mask")
    _same_as("dropout_backward", "dy", dy, mask=mask)
    dx, target = _output(cupy, out, dy.shape, dy.dtype, "dropout_backward")
    _launch("dropout", "dropout_backward", dy.dtype, dy.size,
            (dy, mask, dy.dtype.type(1.0 / (1.0 - float(ratio))), dx))
    return _finish(dx, target)


def philox_words(counter, key, blocks=1, rounds=10):
    """Philox4x32-``rounds`` of the counters ``(counter[0] + b, counter[1],
    counter[2], counter[3])``, b < ``blocks``, under ``key``: a uint32 CuPy
    array of 4 * blocks words (block-major), as :func:`purine_mpi.philox.philox4x32`."""
    cupy = import_cupy()
    out = cupy.empty((4 * int(blocks),), dtype=np.uint32)
    u32 = [np.uint32(int(c) & 0xFFFFFFFF) for c in tuple(counter) + tuple(key)]
    if int(blocks) > 0:
        kernel = get_function("dropout", "philox_words", None)
        grid = min((int(blocks) + _BLOCK - 1) // _BLOCK, _MAX_BLOCKS)
        kernel((grid,), (_BLOCK,), (np.int64(blocks), *u32, _int(rounds), out))
    return out


# --------------------------------------------------------- learning rate ---

def learning_rate(iteration, out, policy, base, gamma=0.0, power=0.0, stepsize=0.0,
                  max_iter=0.0, min_lr=0.0, steps=None, warmup=0, warmup_start=0.0):
    """Evaluate an lr policy on the device into ``out`` (a one-element
    float32 CuPy array), one thread (cuda/lr_policy.cu). ``iteration`` is a
    number or the one-element int64 iteration blob on the device; ``steps``
    an int64 CuPy array of multistep values (or None). The arguments come
    from :func:`purine_mpi.ops.solver.lr_policy_args`."""
    cupy = import_cupy()
    if not isinstance(out, cupy.ndarray) or out.size != 1 or \
            np.dtype(out.dtype) != np.dtype(np.float32) or not out.flags.c_contiguous:
        raise ValueError("learning_rate: out must be a one-element float32 CuPy array")
    it_value, it_ptr, has_it_ptr = _iteration(cupy, iteration)
    if steps is None:
        steps = cupy.asarray(np.zeros(1, np.int64))
        n_steps = 0
    else:
        n_steps = int(steps.size)
    f64 = np.float64
    _launch_blocks("lr_policy", "learning_rate", None, 1, 1,
                   (it_value, it_ptr, has_it_ptr, _int(policy), f64(base), f64(gamma),
                    f64(power), f64(stepsize), f64(max_iter), f64(min_lr), steps,
                    _int(n_steps), np.int64(warmup), f64(warmup_start), out))


def iteration_next(counter, iteration):
    """``iteration = counter; counter += 1`` on the device, one thread
    (cuda/lr_policy.cu): the device iteration counter of
    :class:`purine_mpi.ops.iteration.IterationCounter`. Both are one-element
    int64 CuPy arrays."""
    cupy = import_cupy()
    for what, a in (("counter", counter), ("iteration", iteration)):
        if not isinstance(a, cupy.ndarray) or a.size != 1 or \
                np.dtype(a.dtype) != np.dtype(np.int64):
            raise ValueError(f"iteration_next: {what} must be a one-element int64 CuPy array")
    _launch_blocks("lr_policy", "iteration_next", None, 1, 1, (counter, iteration))


# ------------------------------------------------------------ loss watch ---

class LossTable:
    """The device table of :func:`loss_watch` for a fixed set of loss blobs
    (one-element arrays of one dtype): their device pointers and each one's
    share of the displayed loss. Built once (in the op's setup)."""

    def __init__(self, losses, shares):
        cupy = import_cupy()
        from .raw import data_ptr
        if not losses or len(losses) != len(shares):
            raise ValueError("LossTable: one share per loss, at least one loss")
        dtypes = {np.dtype(a.dtype) for a in losses}
        if len(dtypes) != 1 or any(not isinstance(a, cupy.ndarray) or a.size != 1
                                   for a in losses):
            raise ValueError("LossTable: the losses must be one-element CuPy arrays of "
                             f"one dtype, got dtypes {sorted(map(str, dtypes))}")
        self.losses = list(losses)  # kept alive: the table holds their addresses
        self.dtype = dtypes.pop()
        dtype_suffix(self.dtype)
        self.pointers = cupy.asarray(np.asarray([data_ptr(a) for a in losses], np.uint64))
        self.shares = cupy.asarray(np.asarray(shares, np.float64))
        self.count = len(losses)


def loss_watch(table, iteration, out):
    """One iteration of the loss watch (cuda/loss_watch.cu): add this
    iteration's loss (the shares' weighted sum of ``table``'s losses, in
    double) to ``out[0]`` and, when it is not finite and ``out[1]`` is 0,
    set ``out[1]`` to the iteration + 1. ``iteration`` is the one-element
    int64 iteration blob on the device; ``out`` two float64 on the device."""
    cupy = import_cupy()
    if not isinstance(out, cupy.ndarray) or out.size != 2 or \
            np.dtype(out.dtype) != np.dtype(np.float64) or not out.flags.c_contiguous:
        raise ValueError("loss_watch: out must be a two-element float64 CuPy array")
    if not isinstance(iteration, cupy.ndarray) or iteration.size != 1 or \
            np.dtype(iteration.dtype) != np.dtype(np.int64):
        raise ValueError("loss_watch: the iteration must be the one-element int64 "
                         "iteration blob on the device")
    _launch_blocks("loss_watch", "loss_watch", table.dtype, 1, 1,
                   (table.pointers, table.shares, _int(table.count), iteration, out))


# ----------------------------------------------------------- activations ---

def _slope(dtype, negative_slope):
    slope = float(negative_slope or 0.0)
    return dtype.type(slope), _int(slope != 0.0)


def relu_forward(x, negative_slope=0.0, out=None):
    """y = x > 0 ? x : negative_slope * x (with slope 0: NumPy's maximum(x, 0),
    NaN and -0 kept), one kernel; ``out`` may be ``x`` (in place)."""
    cupy = import_cupy()
    x = _input(cupy, x, "relu_forward: x")
    y, target = _output(cupy, out, x.shape, x.dtype, "relu_forward")
    _launch("activation", "relu_forward", x.dtype, x.size,
            (x, *_slope(x.dtype, negative_slope), y))
    return _finish(y, target)


def relu_backward(dy, x, negative_slope=0.0, out=None):
    """dx = dy * (x > 0) (slope 0) or where(x > 0, dy, slope * dy), one kernel.
    ``x`` is the ReLU's input, or its output (same sign test for slope >= 0)."""
    cupy = import_cupy()
    dy = _input(cupy, dy, "relu_backward: dy")
    x = _input(cupy, x, "relu_backward: x")
    _same_as("relu_backward", "dy", dy, x=x)
    dx, target = _output(cupy, out, dy.shape, dy.dtype, "relu_backward")
    _launch("activation", "relu_backward", dy.dtype, dy.size,
            (dy, x, *_slope(dy.dtype, negative_slope), dx))
    return _finish(dx, target)


def bias_act(y, bias=None, relu=False, negative_slope=0.0):
    """In place on ``y`` (N, C, ...), C-contiguous: y = act(y + bias[c]) with
    act the identity or (``relu``) the leaky ReLU: a layer's epilogue in one
    kernel. ``bias`` (C,) may be None (activation only)."""
    cupy = import_cupy()
    if not isinstance(y, cupy.ndarray) or not y.flags.c_contiguous or y.ndim < 2:
        raise ValueError("bias_act: y must be a C-contiguous (N, C, ...) CuPy array "
                         "(it is updated in place)")
    dtype_suffix(y.dtype)
    channels = int(y.shape[1])
    inner = int(np.prod(y.shape[2:], dtype=np.int64))
    if bias is None:
        bias_arg, has_bias = y, _int(0)
    else:
        bias_arg = _input(cupy, bias, "bias_act: bias")
        if bias_arg.size != channels or bias_arg.dtype != y.dtype:
            raise ValueError(f"bias_act: bias has shape {tuple(bias_arg.shape)} "
                             f"{bias_arg.dtype}, expected ({channels},) {y.dtype}")
        has_bias = _int(1)
    _launch("activation", "bias_act", y.dtype, y.size,
            (y, bias_arg, has_bias, np.int64(channels), np.int64(inner), _int(bool(relu)),
             *_slope(y.dtype, negative_slope)))
    return y


# ------------------------------------------------------------- reductions ---

def channel_sum(dy, out=None):
    """Sum of ``dy`` (N, C, ...) over every axis but 1 -> (C,): a bias
    gradient in one deterministic kernel (cuda/reduce.cu: one block per
    channel, a fixed-order tree, double accumulation)."""
    cupy = import_cupy()
    dy = _input(cupy, dy, "channel_sum: dy")
    if dy.ndim < 2:
        raise ValueError(f"channel_sum: expected (N, C, ...), got shape {tuple(dy.shape)}")
    n, channels = int(dy.shape[0]), int(dy.shape[1])
    inner = int(np.prod(dy.shape[2:], dtype=np.int64))
    db, target = _output(cupy, out, (channels,), dy.dtype, "channel_sum")
    if channels > 0:
        _launch_blocks("reduce", "channel_sum", dy.dtype, min(channels, _MAX_BLOCKS),
                       _REDUCE_THREADS, (np.int64(channels), dy, np.int64(n), np.int64(inner),
                                         db))
    return _finish(db, target)


def sum_rows(x, out, accumulate=False):
    """out[j] (+)= sum_i x[i, j] for a C-contiguous 2-D ``x`` (rows, cols)
    into a C-contiguous ``out`` of cols elements, one deterministic kernel."""
    cupy = import_cupy()
    x = _input(cupy, x, "sum_rows: x", ndim=2)
    rows, cols = int(x.shape[0]), int(x.shape[1])
    if not isinstance(out, cupy.ndarray) or out.size != cols or out.dtype != x.dtype \
            or not out.flags.c_contiguous:
        raise ValueError(f"sum_rows: out must be a C-contiguous {x.dtype} CuPy array of "
                         f"{cols} elements")
    _launch("reduce", "sum_rows", x.dtype, cols,
            (x, np.int64(rows), _int(bool(accumulate)), out))
    return out
