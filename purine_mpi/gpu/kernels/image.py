"""im2col/col2im, pooling and LRN (cuda/im2col.cu, pooling.cu, lrn.cu)."""
import numpy as np

from .. import import_cupy
from . import base as _base
from .base import (_check_pool_args, _finish, _input, _int, _output, _outs, _same_as,
                   conv_output_size, pool_output_size)


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
    _base._launch("im2col", "im2col", x.dtype, n * c * oh * ow,
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
    _base._launch("im2col", "col2im", cols.dtype, n * c * h * w,
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
    _base._launch("pooling", func, x.dtype, n * c * oh * ow, args)
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
    _base._launch("pooling", "maxpool_backward", dy.dtype, n * c * h * w,
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
    _base._launch("pooling", "avepool_backward", dy.dtype, n * c * h * w,
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
    _base._launch("lrn", "lrn_forward", x.dtype, x.size,
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
    _base._launch("lrn", "lrn_backward", x.dtype, x.size,
            (x, y, scale, dy, _int(channels), _int(spatial), _int(pre_pad), t(-beta),
             t(2.0 * alpha * beta / local_size), dx))
    return _finish(dx, target)
