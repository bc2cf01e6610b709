"""Dropout (Philox masks), activations (ReLU, GELU), the reductions, layer norm and the
low-precision rounding (cuda/dropout.cu, activation.cu, reduce.cu,
layernorm.cu, precision.cu).
"""
import numpy as np

from .. import data_ptr, dtype_suffix, get_function, import_cupy
from . import base as _base
from .base import (_BLOCK, _MAX_BLOCKS, _REDUCE_THREADS, _finish, _input, _int, _iteration,
                   _output, _outs, _same_as)


# --------------------------------------------------------------- dropout ---



def dropout_forward(x, iteration, ratio, key0, key1, ctr1=0, out=None):
    """Inverted dropout with a Philox mask drawn on the device -> ``(y, mask)``.

    Element i is kept iff Philox word i of the stream
    ``((i // 4, ctr1, iter lo, iter hi), (key0, key1))`` is >= floor(ratio 2^32)
    (:mod:`purine_mpi.base.philox`, which draws the same words on the CPU);
    mask = 1 or 0 (x's dtype), y = (x * mask) / (1 - ratio). ``iteration`` is
    a number or the one-element int64 iteration blob on the device."""
    from ...base.philox import keep_threshold
    cupy = import_cupy()
    threshold = keep_threshold(ratio)
    x = _input(cupy, x, "dropout_forward: x")
    y_out, mask_out = _outs(out, 2)
    y, y_target = _output(cupy, y_out, x.shape, x.dtype, "dropout_forward (y)")
    mask, mask_target = _output(cupy, mask_out, x.shape, x.dtype, "dropout_forward (mask)")
    it_value, it_ptr, has_it_ptr = _iteration(cupy, iteration)
    t = x.dtype.type
    u32 = np.uint32
    _base._launch("dropout", "dropout_forward", x.dtype, -(-x.size // 4),
            (np.int64(x.size), x, it_value, it_ptr, has_it_ptr, u32(key0), u32(key1),
             u32(int(ctr1) & 0xFFFFFFFF), u32(threshold), t(1.0 / (1.0 - float(ratio))), y,
             mask))
    return _finish(y, y_target), _finish(mask, mask_target)


def dropout_apply(x, iteration, ratio, key0, key1, ctr1=0, out=None, copy=None):
    """``dropout_forward``'s y without the mask: the same Philox draw, y = (x
    * mask) / (1 - ratio), nothing else written. Given Dropout's dy for x, y
    is its dx (the mask drawn again, not kept: the bits the forward drew).
    ``copy`` (uint16, C-contiguous, x's size, no input's bytes; x and a
    C-contiguous ``out`` float32): also the bits of the bfloat16 nearest
    each y, in the same pass (``dropout_apply_copy_f32``:
    ``to_bf16_bits_device`` of y bit for bit)."""
    from ...base.philox import keep_threshold
    cupy = import_cupy()
    threshold = keep_threshold(ratio)
    x = _input(cupy, x, "dropout_apply: x")
    if copy is not None:
        _check_copy("dropout_apply", "x", x, out, copy)
    y, target = _output(cupy, out, x.shape, x.dtype, "dropout_apply")
    it_value, it_ptr, has_it_ptr = _iteration(cupy, iteration)
    u32 = np.uint32
    args = (np.int64(x.size), x, it_value, it_ptr, has_it_ptr, u32(key0), u32(key1),
            u32(int(ctr1) & 0xFFFFFFFF), u32(threshold),
            x.dtype.type(1.0 / (1.0 - float(ratio))), y)
    if copy is not None:
        _base._launch("dropout", "dropout_apply_copy_f32", None, -(-x.size // 4),
                      args + (copy,))
    else:
        _base._launch("dropout", "dropout_apply", x.dtype, -(-x.size // 4), args)
    return _finish(y, target)


def dropout_backward(dy, mask, ratio, out=None, copy=None):
    """dx = (dy * mask) / (1 - ratio), one kernel. ``copy`` (uint16,
    C-contiguous, dy's size, no input's bytes; dy, mask and a C-contiguous
    ``out`` float32): also the bits of the bfloat16 nearest each dx, in the
    same pass (``dropout_backward_copy_f32``: ``to_bf16_bits_device`` of dx
    bit for bit)."""
    def check_mask(cupy, dy):
        checked = _input(cupy, mask, "dropout_backward: mask")
        _same_as("dropout_backward", "dy", dy, mask=checked)
        return checked
    return _dropout_grad("dropout_backward", dy, check_mask, ratio, out, copy)


def _dropout_grad(kernel, dy, check_mask, ratio, out, copy):
    """dx = (dy * mask) / (1 - ratio) through ``kernel`` (``dropout_backward``
    or ``dropout_backward_packed``, also the wrapper's name in its errors;
    ``kernel``_copy_f32 with ``copy``): ``check_mask(cupy, dy)`` -> the mask
    operand, checked against dy."""
    cupy = import_cupy()
    if not 0.0 <= float(ratio) < 1.0:
        raise ValueError(f"{kernel}: ratio must be in [0, 1), got {ratio}")
    dy = _input(cupy, dy, f"{kernel}: dy")
    mask = check_mask(cupy, dy)
    if copy is not None:
        _check_copy(kernel, "dy", dy, out, copy)
    dx, target = _output(cupy, out, dy.shape, dy.dtype, kernel)
    scale = dy.dtype.type(1.0 / (1.0 - float(ratio)))
    if copy is not None:
        _base._launch("dropout", f"{kernel}_copy_f32", None, dy.size, (dy, mask, scale, dx, copy))
    else:
        _base._launch("dropout", kernel, dy.dtype, dy.size, (dy, mask, scale, dx))
    return _finish(dx, target)


def _packed_bits(cupy, bits, size, what):
    """A C-contiguous uint8 CuPy array of ceil(size / 8) bytes: the packed
    mask of ``size`` elements (np.packbits' big bit order)."""
    if not isinstance(bits, cupy.ndarray):
        raise TypeError(f"{what}: expected a CuPy array, got {type(bits).__name__}")
    if np.dtype(bits.dtype) != np.dtype(np.uint8) or bits.size != -(-int(size) // 8) or \
            not bits.flags.c_contiguous:
        raise ValueError(f"{what}: the packed mask of {size} elements is a C-contiguous uint8 "
                         f"array of {-(-int(size) // 8)} bytes, got {bits.dtype} of shape "
                         f"{tuple(bits.shape)}")
    return bits


def dropout_forward_packed(x, iteration, ratio, key0, key1, ctr1=0, out=None):
    """``dropout_forward`` with the mask written bit-packed -> ``(y, bits)``:
    y as ``dropout_forward``'s, bit for bit, and ``bits`` (uint8, ceil(n /
    8) bytes, C-contiguous) np.packbits of its keep-mask, in one kernel
    (``dropout_forward_packed``: one thread per byte), no float mask made.
    ``out``: (y, bits); y may be x."""
    from ...base.philox import keep_threshold
    cupy = import_cupy()
    threshold = keep_threshold(ratio)
    x = _input(cupy, x, "dropout_forward_packed: x")
    y_out, bits = _outs(out, 2)
    y, y_target = _output(cupy, y_out, x.shape, x.dtype, "dropout_forward_packed (y)")
    nbytes = -(-x.size // 8)
    if bits is None:
        bits = cupy.empty((nbytes,), dtype=np.uint8)
    bits = _packed_bits(cupy, bits, x.size, "dropout_forward_packed (bits)")
    it_value, it_ptr, has_it_ptr = _iteration(cupy, iteration)
    u32 = np.uint32
    _base._launch("dropout", "dropout_forward_packed", x.dtype, nbytes,
                  (np.int64(x.size), x, it_value, it_ptr, has_it_ptr, u32(key0), u32(key1),
                   u32(int(ctr1) & 0xFFFFFFFF), u32(threshold),
                   x.dtype.type(1.0 / (1.0 - float(ratio))), y, bits))
    return _finish(y, y_target), bits


def dropout_backward_packed(dy, bits, ratio, out=None, copy=None):
    """dx = (dy * bit_i) / (1 - ratio), the mask read straight from its
    packed bits (uint8, ceil(n / 8) bytes, np.packbits' big bit order): one
    kernel, no unpacked mask (``dropout_backward`` of the unpacked mask,
    bit for bit). ``copy`` as ``dropout_backward``'s
    (``dropout_backward_packed_copy_f32``). ``out`` may be dy."""
    return _dropout_grad("dropout_backward_packed", dy,
                         lambda cupy, dy: _packed_bits(cupy, bits, dy.size,
                                                       "dropout_backward_packed: bits"),
                         ratio, out, copy)


def philox_words(counter, key, blocks=1, rounds=10):
    """Philox4x32-``rounds`` of the counters ``(counter[0] + b, counter[1],
    counter[2], counter[3])``, b < ``blocks``, under ``key``: a uint32 CuPy
    array of 4 * blocks words (block-major), as :func:`purine_mpi.base.philox.philox4x32`."""
    cupy = import_cupy()
    out = cupy.empty((4 * int(blocks),), dtype=np.uint32)
    u32 = [np.uint32(int(c) & 0xFFFFFFFF) for c in tuple(counter) + tuple(key)]
    if int(blocks) > 0:
        kernel = get_function("dropout", "philox_words", None)
        grid = min((int(blocks) + _BLOCK - 1) // _BLOCK, _MAX_BLOCKS)
        kernel((grid,), (_BLOCK,), (np.int64(blocks), *u32, _int(rounds), out))
    return out


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
    _base._launch("activation", "relu_forward", x.dtype, x.size,
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
    _base._launch("activation", "relu_backward", dy.dtype, dy.size,
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
    _base._launch("activation", "bias_act", y.dtype, y.size,
            (y, bias_arg, has_bias, np.int64(channels), np.int64(inner), _int(bool(relu)),
             *_slope(y.dtype, negative_slope)))
    return y


#: the elements a thread of the ``_vec`` kernels owns (cuda/activation.cu:
#: 16-byte loads and stores), and the base alignment they need in bytes
VEC_ELEMENTS, VEC_ALIGN = 8, 16


def _vec_ok(vec, *arrays):
    """Whether a ``_vec`` kernel may take ``arrays``: ``vec`` true and every
    base 16-byte aligned (a view's base may not be)."""
    return bool(vec) and all(data_ptr(a) % VEC_ALIGN == 0 for a in arrays)


def _launch_vec(func, total, args):
    """cuda/activation.cu's ``func`` (a ``_vec`` entry point) over ``total``
    elements: a grid of one thread per chunk of ``VEC_ELEMENTS`` (grid-stride
    past ``_MAX_BLOCKS`` blocks; at least one thread per tail element)."""
    chunks = max(total // VEC_ELEMENTS, total % VEC_ELEMENTS, 1)
    blocks = min(-(-chunks // _BLOCK), _MAX_BLOCKS)
    _base._launch_blocks("activation", func, None, blocks, _BLOCK, (np.int64(total), *args))


def bias_bits(src, bias, out, vec=True):
    """``out`` (uint16, C-contiguous, ``src``'s shape) = the bfloat16 bits
    of the float32 ``src`` (rows, C) plus ``bias`` (C,) along its last axis,
    one kernel (cuda/activation.cu ``bias_bits_f32``): the bits of
    ``bias_act(src, bias)`` then ``round_in_place`` -- one rounding, after
    the bias (a fully connected output stored as bits, from its float32
    product in scratch). ``vec`` (default): ``bias_bits_vec_f32``, 8
    elements a thread, where C is a multiple of 8 and every base 16-byte
    aligned (the same bits); False, or else, the one-element kernel."""
    cupy = import_cupy()
    _bits_array(src, np.float32, "bias_bits: src")
    _bits_array(out, np.uint16, "bias_bits: out")
    if src.ndim != 2 or tuple(out.shape) != tuple(src.shape):
        raise ValueError(f"bias_bits: a (rows, C) src and out of its shape, got "
                         f"{tuple(src.shape)} and {tuple(out.shape)}")
    bias = _input(cupy, bias, "bias_bits: bias")
    if bias.size != src.shape[1] or np.dtype(bias.dtype) != np.dtype(np.float32):
        raise ValueError(f"bias_bits: bias has shape {tuple(bias.shape)} {bias.dtype}, "
                         f"expected ({src.shape[1]},) float32")
    args = (src, bias, np.int64(src.shape[1]), out)
    if src.shape[1] % VEC_ELEMENTS == 0 and _vec_ok(vec, src, bias, out):
        _launch_vec("bias_bits_vec_f32", src.size, args)
    else:
        _base._launch("activation", "bias_bits_f32", None, src.size, args)
    return out


def add_bits(a, b, out):
    """``out`` = float32 ``a`` + the bfloat16 values whose bits are ``b``
    (uint16, widened exactly), one kernel (cuda/activation.cu
    ``add_bits_f32``): a residual add of a term stored as bits, the float32
    sum of the same values bit for bit. All C-contiguous, one size; ``out``
    may be ``a``."""
    import_cupy()
    _bits_array(a, np.float32, "add_bits: a")
    _bits_array(b, np.uint16, "add_bits: b")
    _bits_array(out, np.float32, "add_bits: out")
    if not a.size == b.size == out.size:
        raise ValueError(f"add_bits: sizes {a.size}, {b.size} and {out.size} differ")
    _base._launch("activation", "add_bits_f32", None, a.size, (a, b, out))
    return out


def add_copy(a, b, out, copy):
    """``out`` = float32 ``a`` + ``b`` and ``copy`` (uint16) = the bits of
    the bfloat16 nearest each sum, one kernel (cuda/activation.cu
    ``add_copy_f32``): a gradient sum that products read as bits too, the
    float32 addition and ``to_bf16_bits_device`` of it bit for bit. All
    C-contiguous, one size; ``out`` may be ``a`` or ``b``, ``copy`` is
    neither."""
    import_cupy()
    for what, x, dtype in (("a", a, np.float32), ("b", b, np.float32),
                           ("out", out, np.float32), ("copy", copy, np.uint16)):
        _bits_array(x, dtype, f"add_copy: {what}")
    if not a.size == b.size == out.size == copy.size:
        raise ValueError(f"add_copy: sizes {a.size}, {b.size}, {out.size} and {copy.size} "
                         f"differ")
    _base._launch("activation", "add_copy_f32", None, a.size, (a, b, out, copy))
    return out


#: the ``round`` argument of cuda/activation.cu's GELU kernels: the low type
#: their float32 output is rounded to in the same pass (precision.cuh)
ROUND_MODES = {None: 0, "bfloat16": 1, "float16": 2}


def _gelu_args(what, approximate, round_to, dtype):
    """(tanh_form, round) of a GELU launch, checked."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"{what}: approximate must be none or tanh, got {approximate!r}")
    if round_to not in ROUND_MODES:
        raise ValueError(f"{what}: round_to must be None, bfloat16 or float16, "
                         f"got {round_to!r}")
    if round_to is not None and np.dtype(dtype) != np.dtype(np.float32):
        raise TypeError(f"{what}: round_to rounds a float32 output, got {np.dtype(dtype)}")
    return _int(approximate == "tanh"), _int(ROUND_MODES[round_to])


def _is_bits(x):
    """Whether array ``x`` holds bfloat16 bits (uint16: a blob stored as bits)."""
    return np.dtype(x.dtype) == np.dtype(np.uint16)


def _bits_x(x, what, like=None):
    """A bfloat16-bits ``x`` checked (C-contiguous uint16; ``like``'s shape)."""
    _bits_array(x, np.uint16, what)
    if like is not None and tuple(x.shape) != tuple(like.shape):
        raise ValueError(f"{what}: shape {tuple(x.shape)}, expected {tuple(like.shape)}")
    return x


def gelu_forward(x, approximate="none", out=None, round_to=None):
    """y = x Phi(x) (``approximate`` none) or x (1 + tanh(sqrt(2/pi) (x +
    0.044715 x^3))) / 2 (tanh), one kernel, no scratch (cuda/activation.cu);
    ``out`` may be ``x`` (in place). ``round_to`` (bfloat16, float16; float32
    only): y rounded to that type in the same pass, the bits of
    ``round_in_place`` after an unrounded run. ``x`` may be bfloat16 bits
    (uint16, C-contiguous; bf16 storage): widened exactly in the kernel
    (``gelu_forward_bx_f32``), ``out`` a float32 array of x's shape, the
    float32 ``x``'s y bit for bit."""
    cupy = import_cupy()
    if _is_bits(x):
        args = _gelu_args("gelu_forward", approximate, round_to, np.float32)
        if out is None:
            raise ValueError("gelu_forward: a bits x takes a float32 out")
        _bits_array(out, np.float32, "gelu_forward: out")
        _bits_x(x, "gelu_forward: x", like=out)
        _base._launch("activation", "gelu_forward_bx_f32", None, x.size, (x, *args, out))
        return out
    x = _input(cupy, x, "gelu_forward: x")
    args = _gelu_args("gelu_forward", approximate, round_to, x.dtype)
    y, target = _output(cupy, out, x.shape, x.dtype, "gelu_forward")
    _base._launch("activation", "gelu_forward", x.dtype, x.size, (x, *args, y))
    return _finish(y, target)


def gelu_forward_bits(x, approximate, out, vec=True):
    """``out`` (uint16, x's shape, C-contiguous) = the bfloat16 bits of
    ``gelu_forward(x, approximate)`` for float32 ``x``, one kernel
    (cuda/activation.cu ``gelu_forward_bits_f32``): the bits of the float32
    run followed by ``to_bf16_bits_device``, in the same pass. ``x`` may be
    bfloat16 bits (``gelu_forward_bx_bits_f32``: widened exactly; ``out``
    may be ``x``; ``vec`` (default): ``gelu_forward_bx_bits_vec_f32``, 8
    elements a thread, where both bases are 16-byte aligned, the same
    bits)."""
    cupy = import_cupy()
    if _is_bits(x):
        tanh_form, _ = _gelu_args("gelu_forward_bits", approximate, None, np.float32)
        _bits_array(out, np.uint16, "gelu_forward_bits")
        _bits_x(x, "gelu_forward_bits: x", like=out)
        if _vec_ok(vec, x, out):
            _launch_vec("gelu_forward_bx_bits_vec_f32", x.size, (x, tanh_form, out))
        else:
            _base._launch("activation", "gelu_forward_bx_bits_f32", None, x.size,
                          (x, tanh_form, out))
        return out
    x = _input(cupy, x, "gelu_forward_bits: x")
    tanh_form, _ = _gelu_args("gelu_forward_bits", approximate, None, x.dtype)
    if np.dtype(x.dtype) != np.dtype(np.float32):
        raise TypeError(f"gelu_forward_bits: a float32 x, got {x.dtype}")
    _bits_array(out, np.uint16, "gelu_forward_bits")
    if out.shape != x.shape:
        raise ValueError(f"gelu_forward_bits: out has shape {tuple(out.shape)}, expected "
                         f"{tuple(x.shape)}")
    _base._launch("activation", "gelu_forward_bits_f32", None, x.size, (x, tanh_form, out))
    return out


def gelu_backward(dy, x, approximate="none", out=None, round_to=None, copy=None, vec=True):
    """dx = dy * dGELU/dx at ``x`` (``approximate`` as ``gelu_forward``), one
    kernel, no scratch; ``out`` may be ``dy`` (in place); ``round_to`` as
    ``gelu_forward``'s. ``x`` may be bfloat16 bits (uint16, C-contiguous, dy's
    shape; dy float32): widened exactly in the kernel (``gelu_backward_bx_f32``),
    the float32 ``x``'s dx bit for bit. ``dy`` may be bfloat16 bits too (a
    data gradient stored as bits; ``x`` float32 or bits, ``out`` a float32
    array of dy's shape, not ``dy``): widened exactly in the kernel
    (``gelu_backward_bdy_f32``, ``gelu_backward_bdy_bx_f32``), the float32
    ``dy``'s dx bit for bit. ``copy`` (uint16, C-contiguous, dy's shape;
    ``out`` a float32 array): also the bits of the bfloat16 nearest each
    float32 dx, in the same pass (the ``_copy`` entry points:
    ``to_bf16_bits_device`` of ``out`` bit for bit); ``out`` may be a float32
    ``dy``, ``copy`` a ``dy`` or ``x`` of bits (in place: each element is
    read before it is written). ``vec`` (default): with a bits ``dy`` or a ``copy``, the
    ``_vec`` entry point of that kernel (8 elements a thread) where every
    base is 16-byte aligned: the same bits."""
    cupy = import_cupy()
    if copy is not None or _is_bits(dy):
        return _gelu_backward_f32(cupy, dy, x, approximate, out, round_to, copy, vec)
    if _is_bits(x):
        dy = _input(cupy, dy, "gelu_backward: dy")
        if np.dtype(dy.dtype) != np.dtype(np.float32):
            raise TypeError(f"gelu_backward: a bits x takes a float32 dy, got {dy.dtype}")
        _bits_x(x, "gelu_backward: x", like=dy)
        args = _gelu_args("gelu_backward", approximate, round_to, dy.dtype)
        dx, target = _output(cupy, out, dy.shape, dy.dtype, "gelu_backward")
        _base._launch("activation", "gelu_backward_bx_f32", None, dy.size, (dy, x, *args, dx))
        return _finish(dx, target)
    dy = _input(cupy, dy, "gelu_backward: dy")
    x = _input(cupy, x, "gelu_backward: x")
    _same_as("gelu_backward", "dy", dy, x=x)
    args = _gelu_args("gelu_backward", approximate, round_to, dy.dtype)
    dx, target = _output(cupy, out, dy.shape, dy.dtype, "gelu_backward")
    _base._launch("activation", "gelu_backward", dy.dtype, dy.size, (dy, x, *args, dx))
    return _finish(dx, target)


def _gelu_backward_f32(cupy, dy, x, approximate, out, round_to, copy, vec=True):
    """``gelu_backward`` into a float32 ``out`` given, of a bits ``dy`` or
    with a bits ``copy`` of dx (or both): dy and x each float32 or bits of
    out's shape, one ``gelu_backward[_bdy][_bx][_copy]_f32`` launch."""
    taker = "a copy" if copy is not None else "a bits dy"
    if out is None:
        raise ValueError(f"gelu_backward: {taker} takes a float32 out")
    _bits_array(out, np.float32, "gelu_backward: out")
    if copy is not None:
        _bits_x(copy, "gelu_backward: copy", like=out)
    operands = []
    for what, a in (("dy", dy), ("x", x)):
        if _is_bits(a):
            operands.append(_bits_x(a, f"gelu_backward: {what}", like=out))
            continue
        a = _input(cupy, a, f"gelu_backward: {what}")
        if np.dtype(a.dtype) != np.dtype(np.float32) or tuple(a.shape) != tuple(out.shape):
            raise TypeError(f"gelu_backward: {taker} takes a float32 or bits {what} of out's "
                            f"shape, got {a.dtype} {tuple(a.shape)}")
        operands.append(a)
    func = "gelu_backward" + "_bdy" * _is_bits(dy) + "_bx" * _is_bits(x) + \
        "_copy" * (copy is not None)
    args = _gelu_args("gelu_backward", approximate, round_to, np.float32)
    extra = (copy,) if copy is not None else ()
    if _vec_ok(vec, *operands, out, *extra):
        _launch_vec(func + "_vec_f32", out.size, (*operands, *args, out, *extra))
    else:
        _base._launch("activation", func + "_f32", None, out.size,
                      (*operands, *args, out, *extra))
    return out


def gelu_backward_bias_grad(dy, x, approximate, out, db, round_to=None, copy=None,
                            partial=None, fused=True):
    """``gelu_backward`` of a (rows, cols) ``dy`` and ``x`` into the float32
    ``out`` (and ``copy``), and ``db`` (float32, cols) = the column sums of
    that dx -- the bias gradient of the fully connected layer whose output
    GELU read (``sum_rows(out, db)``'s bits). ``fused`` (default) with cols
    a multiple of 4 and every base aligned (``out`` 16 bytes, bits operands
    8, float32 ones 16): one pass, cuda/activation.cu
    ``gelu_backward[_bdy][_bx][_copy]_colsum_f32`` (blocks of tiles of
    columns x ranges of rows, the splits ``sum_rows`` takes for the shape,
    each column's dx added in double in row order and a fixed tree: the
    sums of ``sum_rows_vec_f32`` bit for bit), then, with more than one
    range, ``bias_grad_finish``; else ``gelu_backward`` then ``sum_rows``.
    dx is ``gelu_backward``'s bit for bit either way, db ``sum_rows``'s.
    ``partial``: scratch of ``bias_grad_scratch(out.shape)`` (None: a new
    device array). dy, x as ``gelu_backward``'s; ``out`` may be ``dy``."""
    cupy = import_cupy()
    if out is None or out.ndim != 2:
        raise ValueError("gelu_backward_bias_grad: a 2-D float32 out (rows, cols) is needed")
    _bits_array(out, np.float32, "gelu_backward_bias_grad: out")
    rows, cols = int(out.shape[0]), int(out.shape[1])
    if not isinstance(db, cupy.ndarray) or db.size != cols or \
            np.dtype(db.dtype) != np.dtype(np.float32) or not db.flags.c_contiguous:
        raise ValueError(f"gelu_backward_bias_grad: db must be a C-contiguous float32 CuPy "
                         f"array of {cols} elements")
    if copy is not None:
        _bits_x(copy, "gelu_backward_bias_grad: copy", like=out)
    operands = []
    for what, a in (("dy", dy), ("x", x)):
        if _is_bits(a):
            operands.append(_bits_x(a, f"gelu_backward_bias_grad: {what}", like=out))
            continue
        a = _input(cupy, a, f"gelu_backward_bias_grad: {what}")
        if np.dtype(a.dtype) != np.dtype(np.float32) or tuple(a.shape) != tuple(out.shape):
            raise TypeError(f"gelu_backward_bias_grad: a float32 or bits {what} of out's "
                            f"shape, got {a.dtype} {tuple(a.shape)}")
        operands.append(a)
    aligned = all(data_ptr(a) % (8 if _is_bits(a) else 16) == 0
                  for a in (*operands, out, *((copy,) if copy is not None else ())))
    if not (fused and cols % 4 == 0 and aligned and rows > 0 and cols > 0):
        gelu_backward(operands[0], operands[1], approximate, out=out, round_to=round_to,
                      copy=copy)
        if cols:
            _column_sum(out, db, False, partial, "gelu_backward_bias_grad")
        return out, db
    splits = bias_grad_splits(rows, cols, 1)
    partial = _partial(partial, out.shape, "gelu_backward_bias_grad")
    func = "gelu_backward" + "_bdy" * _is_bits(operands[0]) + "_bx" * _is_bits(operands[1]) + \
        "_copy" * (copy is not None) + "_colsum_f32"
    args = _gelu_args("gelu_backward_bias_grad", approximate, round_to, np.float32)
    blocks = min(-(-cols // (4 * SUM_ROWS_TILE)) * splits, _MAX_BLOCKS)
    extra = (copy,) if copy is not None else ()
    _base._launch_blocks("activation", func, None, blocks, _REDUCE_THREADS,
                         (np.int64(cols), *operands, np.int64(rows), np.int64(splits), *args,
                          out, *extra, partial, db))
    if splits > 1:
        _base._launch("reduce", "bias_grad_finish", db.dtype, cols,
                      (np.int64(splits), _int(0), partial, db))
    return out, db


# ------------------------------------------------------------- reductions ---

def _per_channel(dy, out, what):
    """A per-channel reduction's operands: dy (N, C, ...) checked, (N, C, the
    rest's size), and the (C,) output buffer with the array to copy it into."""
    cupy = import_cupy()
    dy = _input(cupy, dy, f"{what}: dy")
    if dy.ndim < 2:
        raise ValueError(f"{what}: expected (N, C, ...), got shape {tuple(dy.shape)}")
    n, channels = int(dy.shape[0]), int(dy.shape[1])
    inner = int(np.prod(dy.shape[2:], dtype=np.int64))
    db, target = _output(cupy, out, (channels,), dy.dtype, what)
    return dy, n, channels, inner, db, target


def channel_sum(dy, out=None):
    """Sum of ``dy`` (N, C, ...) over every axis but 1 -> (C,) in one
    deterministic kernel (cuda/reduce.cu: one block per channel, a
    fixed-order tree, double accumulation): a batch norm's sums. A column
    sum of a tall (N, C) matrix takes ``sum_rows`` (a block per channel
    reads a column, a stride of C apart)."""
    dy, n, channels, inner, db, target = _per_channel(dy, out, "channel_sum")
    if channels > 0:
        _base._launch_blocks("reduce", "channel_sum", dy.dtype, min(channels, _MAX_BLOCKS),
                       _REDUCE_THREADS, (np.int64(channels), dy, np.int64(n), np.int64(inner),
                                         db))
    return _finish(db, target)


#: a bias gradient's target number of (channel, split) blocks -- (tile,
#: split) blocks for a column sum -- and the fewest elements one block sums
#: (cuda/reduce.cu ``bias_grad``, ``sum_rows``)
BIAS_GRAD_BLOCKS, BIAS_GRAD_MIN_ELEMENTS = 1024, 4096
#: the columns one block of ``sum_rows`` owns (PURINE_SUM_ROWS_TILE of cuda/reduce.cu)
SUM_ROWS_TILE = 32


def bias_grad_splits(n, channels, inner):
    """Into how many consecutive sample ranges ``bias_grad`` cuts each
    channel: about ``BIAS_GRAD_BLOCKS`` blocks in all, none summing fewer
    than ``BIAS_GRAD_MIN_ELEMENTS`` elements, at most one range per sample.
    With ``inner`` 1 (a column sum, ``sum_rows``) a block owns a tile of
    ``SUM_ROWS_TILE`` columns, not a channel: the blocks are tiles x
    ranges. A function of the shape alone, so the sums' order (and bits)
    are the same on every GPU."""
    n, channels, inner = int(n), int(channels), int(inner)
    if channels <= 0 or n <= 0:
        return 1
    if inner == 1:
        tiles = -(-channels // SUM_ROWS_TILE)
        return max(1, min(n, BIAS_GRAD_BLOCKS // tiles,
                          n * min(channels, SUM_ROWS_TILE) // BIAS_GRAD_MIN_ELEMENTS))
    return max(1, min(n, BIAS_GRAD_BLOCKS // channels,
                      (n * inner) // BIAS_GRAD_MIN_ELEMENTS))


def bias_grad_scratch(shape):
    """The (shape, dtype) of the scratch ``bias_grad`` takes for a dy of
    ``shape`` (the ops reserve it in their setup); with a 2-D ``shape``
    (rows, cols), that of ``sum_rows``."""
    n, channels = int(shape[0]), int(shape[1])
    inner = int(np.prod(shape[2:], dtype=np.int64))
    return ((max(1, channels * bias_grad_splits(n, channels, inner)),), np.float64)


def _partial(partial, shape, what):
    """The partial sums' array for a dy of ``shape``: ``partial`` checked,
    or (None) a new device array."""
    want, dtype = bias_grad_scratch(shape)
    if partial is None:
        return import_cupy().empty(want, dtype=dtype)
    if partial.dtype != dtype or partial.size < want[0] or not partial.flags.c_contiguous:
        raise ValueError(f"{what}: partial must be a contiguous float64 array of at least "
                         f"{want[0]} elements, got {partial.size} {partial.dtype}")
    return partial


def bias_grad(dy, out=None, partial=None):
    """A bias gradient, ``dy`` summed over every axis but 1 -> (C,), in
    deterministic kernels with coalesced loads. A convolution's dy (N, C,
    spatial...): cuda/reduce.cu's ``bias_grad``, each channel cut into
    ``bias_grad_splits`` sample ranges, one block per (channel, range),
    double accumulation and fixed-order trees, then (with more than one
    range) ``bias_grad_finish`` adding each channel's partial sums in order.
    A fully connected layer's dy (N, C) (or a 1x1 output): ``sum_rows``, one
    block per (tile of columns, range of rows), then the same finish.
    ``partial`` (an array of ``bias_grad_scratch(dy.shape)``, e.g. the op's
    scratch) holds the partial sums; without it, a new device array."""
    dy, n, channels, inner, db, target = _per_channel(dy, out, "bias_grad")
    if channels == 0:
        return _finish(db, target)
    if inner == 1:
        _column_sum(dy.reshape(n, channels), db, False, partial, "bias_grad")
        return _finish(db, target)
    splits = bias_grad_splits(n, channels, inner)
    partial = _partial(partial, dy.shape, "bias_grad")
    _base._launch_blocks("reduce", "bias_grad", dy.dtype, min(channels * splits, _MAX_BLOCKS),
                         _REDUCE_THREADS, (np.int64(channels), dy, np.int64(n), np.int64(inner),
                                           np.int64(splits), partial, db))
    if splits > 1:
        _base._launch("reduce", "bias_grad_finish", dy.dtype, channels,
                      (np.int64(splits), _int(0), partial, db))
    return _finish(db, target)


def _column_sum(x, out, accumulate, partial, what, vec=True):
    """out (+)= the column sums of ``x`` (rows, cols), both C-contiguous:
    cuda/reduce.cu's ``sum_rows`` on (tile, row range) blocks, then with
    more than one range ``bias_grad_finish`` (``partial``: the scratch, or
    None for a new array). ``vec``: a float32 or bits ``x`` of cols a
    multiple of 4, its base 16-byte (bits: 8-byte) aligned, takes
    ``sum_rows_(bits_)vec_f32`` (four columns a thread, the same sums)."""
    rows, cols = int(x.shape[0]), int(x.shape[1])
    if cols == 0:
        return
    splits = bias_grad_splits(rows, cols, 1)
    partial = _partial(partial, x.shape, what)
    bits = _is_bits(x)   # bfloat16 bits into float32: the plain entry point
    if vec and cols % 4 == 0 and (bits or np.dtype(x.dtype) == np.dtype(np.float32)) \
            and data_ptr(x) % (8 if bits else 16) == 0:
        blocks = min(-(-cols // (4 * SUM_ROWS_TILE)) * splits, _MAX_BLOCKS)
        func, dtype = ("sum_rows_bits_vec_f32" if bits else "sum_rows_vec_f32"), None
    else:
        blocks = min(-(-cols // SUM_ROWS_TILE) * splits, _MAX_BLOCKS)
        func, dtype = ("sum_rows_bits_f32", None) if bits else ("sum_rows", x.dtype)
    _base._launch_blocks("reduce", func, dtype, blocks, _REDUCE_THREADS,
                         (np.int64(cols), x, np.int64(rows), np.int64(splits),
                          _int(bool(accumulate)), partial, out))
    if splits > 1:
        _base._launch("reduce", "bias_grad_finish", out.dtype, cols,
                      (np.int64(splits), _int(bool(accumulate)), partial, out))


def sum_rows(x, out, accumulate=False, partial=None, vec=True):
    """out[j] (+)= sum_i x[i, j] for a C-contiguous 2-D ``x`` (rows, cols)
    into a C-contiguous ``out`` of cols elements, in deterministic kernels
    (cuda/reduce.cu ``sum_rows``: tiles of columns x ranges of rows, then
    ``bias_grad_finish``); ``partial``: scratch of
    ``bias_grad_scratch(x.shape)`` (None: a new device array). ``x`` may be
    bfloat16 bits (uint16, C-contiguous; bf16 storage), ``out`` float32:
    widened exactly in the kernel (``sum_rows_bits_f32``), the float32
    ``x``'s sums bit for bit. ``vec`` (default): the ``_vec`` kernels
    (four columns a thread, one wide load) where ``_column_sum`` allows,
    the same sums in the same order: the same bits."""
    cupy = import_cupy()
    if _is_bits(x):
        _bits_array(x, np.uint16, "sum_rows: x")
        if x.ndim != 2:
            raise ValueError(f"sum_rows: expected 2 dimensions, got shape {x.shape}")
        want = np.dtype(np.float32)
    else:
        x = _input(cupy, x, "sum_rows: x", ndim=2)
        want = x.dtype
    cols = int(x.shape[1])
    if not isinstance(out, cupy.ndarray) or out.size != cols or out.dtype != want \
            or not out.flags.c_contiguous:
        raise ValueError(f"sum_rows: out must be a C-contiguous {want} CuPy array of "
                         f"{cols} elements")
    _column_sum(x, out, accumulate, partial, "sum_rows", vec)
    return out


#: the threads of a block of ``embedding_order`` (n^2 comparisons: smaller
#: blocks spread n = 16,384 positions over 128 SMs rather than 64)
EMBED_ORDER_THREADS = 128


def embedding_grad_scratch(n, vocab):
    """The scratch ``embedding_grad`` takes: (shape, dtype) of the positions
    in (token, position) order and their tokens (n int32 each), and each
    token's first and end rank in that order (vocab int32 each)."""
    return [((int(n),), np.int32)] * 2 + [((int(vocab),), np.int32)] * 2


def embedding_grad(dy, ids, out, scratch):
    """An embedding's weight gradient in two deterministic kernels
    (cuda/reduce.cu ``embedding_order``, ``embedding_grad``): ``out`` (V,
    C), C-contiguous, gets out[v] = the sum of the rows dy[p] (dy: (n, C))
    with ids[p] == v, added in increasing p (np.add.at's order and bits;
    the host op's reduceat sums pairwise past a few rows), zero for the
    tokens that do not occur. ``ids`` (n,): int32 or int64 (uint32/uint64
    read as their signed twins), already checked to lie in [0, V);
    ``scratch``: the int32 arrays of ``embedding_grad_scratch(n, V)``
    (a sort of the positions by token); nothing is allocated."""
    cupy = import_cupy()
    dy = _input(cupy, dy, "embedding_grad: dy", ndim=2)
    n, width = int(dy.shape[0]), int(dy.shape[1])
    if not isinstance(out, cupy.ndarray) or out.ndim != 2 or out.shape[1] != width \
            or out.dtype != dy.dtype or not out.flags.c_contiguous:
        raise ValueError(f"embedding_grad: out must be a C-contiguous {dy.dtype} CuPy array "
                         f"of shape (V, {width})")
    ids = cupy.ascontiguousarray(ids.reshape(-1))
    kind, size = np.dtype(ids.dtype).kind, np.dtype(ids.dtype).itemsize
    if kind not in "iu" or size not in (4, 8) or ids.size != n:
        raise ValueError(f"embedding_grad: ids must be {n} int32 or int64 token ids, got "
                         f"{ids.size} {ids.dtype}")
    if kind == "u":
        ids = ids.view(np.int32 if size == 4 else np.int64)
    vocab = int(out.shape[0])
    if vocab == 0:
        return out
    if max(n, vocab) >= 2 ** 31:
        raise ValueError(f"embedding_grad: {n} ids into {vocab} rows; the sort holds "
                         f"positions and tokens as int32 (below 2^31)")
    scratch = tuple(scratch)
    wants = embedding_grad_scratch(n, vocab)
    if len(scratch) != len(wants) or any(
            not isinstance(a, cupy.ndarray) or tuple(a.shape) != shape or a.dtype != dtype
            or not a.flags.c_contiguous for a, (shape, dtype) in zip(scratch, wants)):
        raise ValueError(f"embedding_grad: scratch must be C-contiguous int32 arrays of "
                         f"{[w[0] for w in wants]} elements (embedding_grad_scratch)")
    order, tokens, first, end = scratch
    if n:
        _base._launch_blocks("reduce", "embedding_order_i32" if size == 4 else
                             "embedding_order", None,
                             min(-(-n // EMBED_ORDER_THREADS), _MAX_BLOCKS),
                             EMBED_ORDER_THREADS,
                             (np.int64(n), ids, order, tokens, first, end))
    # a thread per column (up to 1,024): a frequent token's row is one chain
    # of adds per column, so all its columns' loads are in flight at once
    threads = min(1024, max(32, -(-width // 32) * 32))
    _base._launch_blocks("reduce", "embedding_grad", dy.dtype, min(vocab, _MAX_BLOCKS),
                         threads, (np.int64(vocab), np.int64(width), np.int64(n),
                                   order, tokens, first, end, dy, out))
    return out


# ------------------------------------------------------------ layer norm ---

def _ln_rows(cupy, what, x, **arrays):
    """x (..., C) as (rows, C) and the arrays named in ``arrays`` checked:
    C-contiguous CuPy arrays of x's dtype with the given element counts
    (they are written in place, never through a copy)."""
    x = _input(cupy, x, f"{what}: x")
    if x.ndim < 1:
        raise ValueError(f"{what}: x must have a last axis, got shape {tuple(x.shape)}")
    cols = int(x.shape[-1])
    rows = int(x.size // cols) if cols else 0
    for name, (array, size) in arrays.items():
        if not isinstance(array, cupy.ndarray) or array.size != size or \
                array.dtype != x.dtype or not array.flags.c_contiguous:
            raise ValueError(f"{what}: {name} must be a C-contiguous {x.dtype} CuPy array of "
                             f"{size} elements")
    return x, rows, cols


def _ln_blocks(rows):
    """The layer-norm kernels' grid: a warp per row, _REDUCE_THREADS / 32
    rows a block (PURINE_LN_THREADS of cuda/layernorm.cu), grid-stride
    beyond _MAX_BLOCKS blocks."""
    per_block = _REDUCE_THREADS // 32
    return min(-(-rows // per_block), _MAX_BLOCKS)


def layernorm_forward(x, g, b, eps, y, mean, rstd):
    """Layer norm over the last axis of ``x`` (..., C) in one kernel
    (cuda/layernorm.cu): ``y`` = (x - mean) * rstd * g + b, and the rows'
    ``mean`` and ``rstd`` = 1 / sqrt(var + eps) (x.shape[:-1]), written in
    place; ``y`` may be ``x``. A warp per row, sums in double in a fixed
    order (lanes, then a shuffle butterfly). A uint16
    ``y`` (float32 ``x``) gets the bfloat16 bits of y (bf16 storage), the
    bits of the float32 run followed by ``to_bf16_bits_device``."""
    cupy = import_cupy()
    n = int(np.prod(x.shape[:-1], dtype=np.int64)) if x.ndim else 0
    c = int(x.shape[-1]) if x.ndim else 0
    bits = np.dtype(y.dtype) == np.dtype(np.uint16)
    if bits:   # y as bfloat16 bits (``layernorm_forward_bits_f32``): float32 x only
        if np.dtype(x.dtype) != np.dtype(np.float32):
            raise TypeError(f"layernorm_forward: bfloat16 bits y from a float32 x, got {x.dtype}")
        _bits_array(y, np.uint16, "layernorm_forward: y")
        if y.size != x.size:
            raise ValueError(f"layernorm_forward: y has {y.size} elements, x {x.size}")
    x, rows, cols = _ln_rows(cupy, "layernorm_forward", x, g=(g, c), b=(b, c),
                             mean=(mean, n), rstd=(rstd, n), **({} if bits else {"y": (y, x.size)}))
    if rows and cols:
        _base._launch_blocks("layernorm", "layernorm_forward_bits_f32" if bits
                             else "layernorm_forward", None if bits else x.dtype,
                             _ln_blocks(rows), _REDUCE_THREADS,
                             (np.int64(rows), np.int64(cols), x, g, b, np.float64(eps), y, mean,
                              rstd))
    return y


def layernorm_backward(dy, x, g, mean, rstd, dx=None, dyxhat=None, copy=None):
    """Layer norm's input gradient in one kernel (cuda/layernorm.cu): into
    ``dx`` (x's shape; may be ``dy`` or ``x``), and into ``dyxhat`` dy *
    xhat, whose column sums are the weight gradient; either may be None.
    ``dy`` may be bfloat16 bits (uint16, C-contiguous, x's size; x and the
    rest float32; dx not ``dy``): widened exactly in the kernel
    (``layernorm_backward_bdy_f32``), the float32 ``dy``'s results.
    ``copy`` (uint16, C-contiguous, x's size, no input's bytes but a bits
    ``dy``'s: each element of dy is read before its copy is written; x
    float32, ``dx`` given): also the bits of the bfloat16 nearest each float32 dx,
    in the same pass (``layernorm_backward_copy_f32``,
    ``layernorm_backward_bdy_copy_f32``: ``to_bf16_bits_device`` of dx bit
    for bit)."""
    cupy = import_cupy()
    if copy is not None:
        if dx is None or np.dtype(x.dtype) != np.dtype(np.float32):
            raise ValueError(f"layernorm_backward: a copy takes a float32 x and dx, got x "
                             f"{x.dtype} and dx {None if dx is None else dx.dtype}")
        _bits_array(copy, np.uint16, "layernorm_backward: copy")
        if copy.size != x.size or any(copy is a for a in (x, g, mean, rstd)):
            raise ValueError(f"layernorm_backward: copy must be x's {x.size} elements on no "
                             f"input's bytes but a bits dy's, got {copy.size}")
    n = int(np.prod(x.shape[:-1], dtype=np.int64)) if x.ndim else 0
    c = int(x.shape[-1]) if x.ndim else 0
    outs = {name: (a, x.size) for name, a in (("dx", dx), ("dyxhat", dyxhat)) if a is not None}
    bits = _is_bits(dy)
    if bits:
        _bits_array(dy, np.uint16, "layernorm_backward: dy")
        if dy.size != x.size or np.dtype(x.dtype) != np.dtype(np.float32):
            raise ValueError(f"layernorm_backward: a bits dy of x's {x.size} elements and a "
                             f"float32 x, got {dy.size} and {x.dtype}")
    else:
        outs["dy"] = (dy, x.size)
    x, rows, cols = _ln_rows(cupy, "layernorm_backward", x, g=(g, c), mean=(mean, n),
                             rstd=(rstd, n), **outs)
    if rows and cols and copy is not None:
        _base._launch_blocks("layernorm", "layernorm_backward" + "_bdy" * bits + "_copy_f32",
                             None, _ln_blocks(rows), _REDUCE_THREADS,
                             (np.int64(rows), np.int64(cols), dy, x, g, mean, rstd, dx,
                              x if dyxhat is None else dyxhat, _int(dyxhat is not None), copy))
    elif rows and cols and (dx is not None or dyxhat is not None):
        _base._launch_blocks("layernorm", "layernorm_backward_bdy_f32" if bits
                             else "layernorm_backward", None if bits else x.dtype,
                             _ln_blocks(rows), _REDUCE_THREADS,
                             (np.int64(rows), np.int64(cols), dy, x, g, mean, rstd,
                              x if dx is None else dx, _int(dx is not None),
                              x if dyxhat is None else dyxhat, _int(dyxhat is not None)))
    return dx, dyxhat


#: cuda/layernorm.cu's layernorm_backward_..._colsum_f32: the most 128-column
#: chunks a lane holds (PURINE_LN_SUM_CHUNKS) and the rows a warp takes
#: (PURINE_LN_SUM_ROWS), which size the grid
LN_SUM_CHUNKS, LN_SUM_ROWS = 6, 4


def layernorm_sums_ok(shape, dtype):
    """Whether ``layernorm_backward_sums`` takes an x of ``shape`` and
    ``dtype``: float32, the width a multiple of 4 and at most 128
    ``LN_SUM_CHUNKS`` (768: GPT-2 124M's; a lane's sums are registers),
    at least one row."""
    if np.dtype(dtype) != np.dtype(np.float32) or not len(shape):
        return False
    cols = int(shape[-1])
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    return rows > 0 and 0 < cols <= 128 * LN_SUM_CHUNKS and cols % 4 == 0


def layernorm_sums_blocks(rows):
    """The jobs of ``layernorm_backward_sums`` (its grid: one block a job):
    ``LN_SUM_ROWS`` rows a warp of _REDUCE_THREADS / 32 warps a block, at
    most _MAX_BLOCKS (then a job takes more rows). A function of the rows
    alone, passed to the kernel: each job's rows, so the partial sums'
    order, depend on the shape alone, not on the grid that runs them."""
    per_block = (_REDUCE_THREADS // 32) * LN_SUM_ROWS
    return max(1, min(-(-int(rows) // per_block), _MAX_BLOCKS))


def layernorm_sums_scratch(shape):
    """The (shape, dtype) of ``layernorm_backward_sums``' partial sums for an
    x of ``shape``: db's then dg's, a double per column per block."""
    cols = int(shape[-1])
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    return ((2 * cols * layernorm_sums_blocks(rows),), np.float64)


def layernorm_backward_sums(dy, x, g, mean, rstd, dx, dg, db, copy=None, partial=None):
    """``layernorm_backward``'s dx (and ``copy``) of a float32 x (width a
    multiple of 4, at most 768: ``layernorm_sums_ok``) and the weight and
    bias gradients ``dg`` = the column sums of dy * xhat and ``db`` = those
    of dy (float32, x's width), without dy * xhat in memory:
    cuda/layernorm.cu ``layernorm_backward[_bdy][_copy]_colsum_f32`` (the
    _vec path's dx bit for bit; each block's partial column sums, its
    warps' float32 sums of their rows added in warp order in double) then
    reduce.cu's ``bias_grad_finish_f32`` adding each column's block sums in
    block order, for db and for dg (the second stage): no atomics, the same
    bits every run. ``dx`` may be None (no dx; then no ``copy``).
    ``partial``: scratch of ``layernorm_sums_scratch(x.shape)`` (None: a new
    device array)."""
    cupy = import_cupy()
    if not layernorm_sums_ok(x.shape, x.dtype):
        raise ValueError(f"layernorm_backward_sums: a float32 x of width a multiple of 4 and "
                         f"at most {128 * LN_SUM_CHUNKS}, got {x.dtype} {tuple(x.shape)}")
    if copy is not None:
        if dx is None:
            raise ValueError("layernorm_backward_sums: a copy takes a dx")
        _bits_array(copy, np.uint16, "layernorm_backward_sums: copy")
        if copy.size != x.size or any(copy is a for a in (x, g, mean, rstd)):
            raise ValueError(f"layernorm_backward_sums: copy must be x's {x.size} elements on "
                             f"no input's bytes but a bits dy's, got {copy.size}")
    n = int(np.prod(x.shape[:-1], dtype=np.int64))
    c = int(x.shape[-1])
    outs = {name: (a, c) for name, a in (("dg", dg), ("db", db))}
    if dx is not None:
        outs["dx"] = (dx, x.size)
    bits = _is_bits(dy)
    if bits:
        _bits_array(dy, np.uint16, "layernorm_backward_sums: dy")
        if dy.size != x.size:
            raise ValueError(f"layernorm_backward_sums: a bits dy of x's {x.size} elements, "
                             f"got {dy.size}")
    else:
        outs["dy"] = (dy, x.size)
    x, rows, cols = _ln_rows(cupy, "layernorm_backward_sums", x, g=(g, c), mean=(mean, n),
                             rstd=(rstd, n), **outs)
    blocks = layernorm_sums_blocks(rows)
    (want,), dtype = layernorm_sums_scratch(x.shape)
    if partial is None:
        partial = cupy.empty(want, dtype=dtype)
    elif partial.dtype != dtype or partial.size < want or not partial.flags.c_contiguous:
        raise ValueError(f"layernorm_backward_sums: partial must be a contiguous float64 array "
                         f"of at least {want} elements, got {partial.size} {partial.dtype}")
    func = "layernorm_backward" + "_bdy" * bits + "_copy" * (copy is not None) + "_colsum_f32"
    if copy is not None:
        args = (dx, copy, np.int64(blocks), partial)
    else:
        args = (x if dx is None else dx, _int(dx is not None), np.int64(blocks), partial)
    _base._launch_blocks("layernorm", func, None, blocks, _REDUCE_THREADS,
                         (np.int64(rows), np.int64(cols), dy, x, g, mean, rstd, *args))
    half = cols * blocks
    for q, out in enumerate((db, dg)):
        _base._launch("reduce", "bias_grad_finish", out.dtype, cols,
                      (np.int64(blocks), _int(0), partial[q * half:(q + 1) * half], out))
    return dx, dg, db


# -------------------------------------------------------------- rounding ---

#: the entry point of cuda/precision.cu for each dtype name
_ROUND = {"bfloat16": "round_bf16", "float16": "round_fp16"}


def _bits_array(x, dtype, what):
    """``x``, checked: a C-contiguous array of ``dtype`` (the kernels read
    and write it in place, through a view of its bits: a copy would not be
    written back)."""
    if np.dtype(x.dtype) != np.dtype(dtype):
        raise TypeError(f"{what}: a {np.dtype(dtype).name} array, got {x.dtype}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{what}: a C-contiguous array, got strides {x.strides}")
    return x


def _check_copy(what, name, x, out, copy):
    """A dropout kernel's ``copy`` (the bfloat16 bits of each float32 result
    written in the same pass), checked: ``x`` (the input called ``name``)
    float32, ``out`` given, float32 and C-contiguous, ``copy`` uint16,
    C-contiguous, of x's size."""
    if out is None or np.dtype(x.dtype) != np.dtype(np.float32):
        raise ValueError(f"{what}: a copy takes a float32 {name} and out, got {name} "
                         f"{x.dtype} and out {None if out is None else out.dtype}")
    _bits_array(out, np.float32, f"{what}: out")
    _bits_array(copy, np.uint16, f"{what}: copy")
    if copy.size != x.size:
        raise ValueError(f"{what}: copy has {copy.size} elements, {name} {x.size}")


def _round_launch(what, src, dst, dtype):
    """Launch round_bf16/round_fp16 (n, src, dst) of cuda/precision.cu: a
    grid of 256-thread blocks, one thread per 4 values (16-byte loads where
    both arrays are 16-byte aligned; the kernel checks), grid-stride."""
    if dtype not in _ROUND:
        raise ValueError(f"{what}: bfloat16 or float16, got {dtype!r}")
    quads = (src.size + 3) // 4
    if quads:
        _base._launch_blocks("precision", _ROUND[dtype], None,
                             min((quads + _BLOCK - 1) // _BLOCK, _MAX_BLOCKS),
                             _BLOCK, (np.int64(src.size), src.view(np.uint32),
                                      dst.view(np.uint32)))


def round_in_place(x, dtype):
    """Round the float32 CuPy array ``x`` in place to the nearest ``dtype``
    (``bfloat16`` or ``float16``) value, one kernel over its bits and no
    scratch: the bits base/precision.round_to gives (cuda/precision.cu).
    ``x`` must be C-contiguous (a copy would not be in place)."""
    import_cupy()
    _bits_array(x, np.float32, "round_in_place")
    _round_launch("round_in_place", x, x, dtype)
    return x


def round_copy(src, dst, dtype):
    """``dst`` = float32 ``src`` rounded to the nearest ``dtype``
    (``bfloat16`` or ``float16``) value, ``src`` unchanged (the Cast op's
    copy): one kernel that reads ``src`` once and writes ``dst`` once, the
    bits of ``round_in_place`` on a copy. Both C-contiguous float32 CuPy
    arrays of one size; ``dst`` may be ``src``'s own bytes (in place)."""
    import_cupy()
    _bits_array(src, np.float32, "round_copy")
    _bits_array(dst, np.float32, "round_copy")
    if dst.size != src.size:
        raise ValueError(f"round_copy: {src.size} values into {dst.size}")
    _round_launch("round_copy", src, dst, dtype)
    return dst


#: what the elements of a float32 array and of its bfloat16 bits are called
_BITS_WORDS = {np.dtype(np.float32): "values", np.dtype(np.uint16): "bits"}


def _bits_pair(what, src, src_dtype, dst, dst_dtype):
    """``src`` and ``dst`` checked for a conversion between float32 and its
    bfloat16 bits: each C-contiguous of its dtype, the same size."""
    import_cupy()
    _bits_array(src, src_dtype, what)
    _bits_array(dst, dst_dtype, what)
    if dst.size != src.size:
        raise ValueError(f"{what}: {src.size} {_BITS_WORDS[np.dtype(src_dtype)]} into "
                         f"{dst.size} {_BITS_WORDS[np.dtype(dst_dtype)]}")


def _wire_launch(func, n, arrays):
    """Launch ``func`` (n, float32 or bits, bits or float32) of
    cuda/precision.cu: one thread per 4 values (16-byte float32 and 8-byte
    bits accesses where aligned; the kernel checks), grid-stride."""
    quads = (n + 3) // 4
    if quads:
        _base._launch_blocks("precision", func, None,
                             min((quads + _BLOCK - 1) // _BLOCK, _MAX_BLOCKS), _BLOCK,
                             (np.int64(n),) + tuple(arrays))


def to_bf16_bits_device(x, out):
    """``out`` (uint16 CuPy array of ``x``'s size) = the bits of the
    bfloat16 nearest each float32 of ``x`` (``x`` unchanged): one kernel
    over the whole array, no scratch, nothing allocated -- the bits
    base/precision.to_bf16_bits gives (cuda/precision.cu)."""
    _bits_pair("to_bf16_bits_device", x, np.float32, out, np.uint16)
    _wire_launch("to_bf16_bits", x.size, (x.view(np.uint32), out))
    return out


def from_bf16_bits_device(bits, x):
    """``x`` (float32 CuPy array of ``bits``' size) = the bfloat16 values
    whose bits are ``bits`` (uint16), widened exactly: one kernel, nothing
    allocated (base/precision.from_bf16_bits; cuda/precision.cu)."""
    _bits_pair("from_bf16_bits_device", bits, np.uint16, x, np.float32)
    _wire_launch("from_bf16_bits", x.size, (bits, x.view(np.uint32)))
    return x
