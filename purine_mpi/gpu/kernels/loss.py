"""The fused softmax loss and the loss watch (cuda/softmax_loss.cu, loss_watch.cu)."""
import numpy as np

from .. import data_ptr, dtype_suffix, import_cupy
from . import base as _base
from .base import (_MAX_BLOCKS, _REDUCE_THREADS, _finish, _input, _int, _output, _outs,
                   _scalar_or_device)


# ---------------------------------------------------------- softmax loss ---

#: from this many classes on, a position of a (N, C) array (inner 1) is a
#: block's work (the ``<func>_rows`` kernels of cuda/softmax_loss.cu: its
#: _REDUCE_THREADS threads read the row coalesced, every thread at least
#: one class); below it, or where positions interleave (inner > 1: adjacent
#: threads read adjacent positions, coalesced already), a thread's
ROW_BLOCK_CLASSES = _REDUCE_THREADS


def _rows(channels, inner):
    """Whether a position is a block's work: (N, C) rows of at least
    ROW_BLOCK_CLASSES classes."""
    return inner == 1 and channels >= ROW_BLOCK_CLASSES


def _per_position(func, dtype, channels, inner, positions, args, rows_func=None):
    """Launch kernel ``func`` of cuda/softmax_loss.cu over ``positions``
    positions of ``channels`` classes (``args`` after the count): one block a
    position (``rows_func``, by default its ``_rows`` twin, same arguments)
    for rows of at least ROW_BLOCK_CLASSES classes, else one thread a
    position."""
    if _rows(channels, inner) and positions > 0:
        _base._launch_blocks("softmax_loss", rows_func or f"{func}_rows", dtype,
                             min(positions, _MAX_BLOCKS), _REDUCE_THREADS,
                             (np.int64(positions),) + tuple(args))
    else:
        _base._launch("softmax_loss", func, dtype, positions, args)


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


def _skipped(ignore_label, pad_label):
    """The kernels' (ignore_label, has_ignore, pad_label, has_pad): a
    position whose label is either is not counted (``pad_label``: a test
    graph's padding, job/replica.py ``mark_padding``)."""
    return _ignore(ignore_label) + _ignore(pad_label)


def _class_layout(cupy, a, labels, func, arg, what):
    """(a, labels, N, C, positions per sample) of an (N, C, ...) array and its
    one-label-per-position labels, checked."""
    a = _input(cupy, a, f"{func}: {arg}")
    if a.ndim < 2:
        raise ValueError(f"{func}: expected (N, C, ...) {what}, got shape {tuple(a.shape)}")
    n, channels = a.shape[0], a.shape[1]
    inner = int(np.prod(a.shape[2:], dtype=np.int64))
    return a, _labels(cupy, labels, n * inner, func), n, channels, inner


def softmax_loss_forward(x, labels, ignore_label=None, out=None, pad_label=None,
                         rows_kernel="softmax_loss_forward_vec"):
    """Fused softmax over axis 1 and cross-entropy -> ``(prob, loss, valid)``.

    ``x`` is (N, C, ...), ``labels`` holds one class per position (N, ...).
    prob has x's shape; loss and valid have shape (N, ...) (x without axis 1):
    loss = log(sum(exp(x - max))) - (x[label] - max) (-log prob[label],
    exact however small prob[label] is, as the CPU op), valid = 1, both 0 where
    label == ignore_label or pad_label. The batch-mean loss is
    sum(loss) / sum(valid). ``rows_kernel``: the kernel for (N, C) rows of
    at least ROW_BLOCK_CLASSES classes (cuda/softmax_loss.cu)."""
    cupy = import_cupy()
    x, labels, n, channels, inner = _class_layout(cupy, x, labels, "softmax_loss_forward",
                                                  "x", "logits")
    prob_out, loss_out, valid_out = _outs(out, 3)
    pos_shape = (n,) + tuple(x.shape[2:])
    prob, prob_t = _output(cupy, prob_out, x.shape, x.dtype, "softmax_loss_forward (prob)")
    loss, loss_t = _output(cupy, loss_out, pos_shape, x.dtype, "softmax_loss_forward (loss)")
    valid, valid_t = _output(cupy, valid_out, pos_shape, x.dtype,
                             "softmax_loss_forward (valid)")
    # rows of many classes: the vectorized kernel (``rows_kernel``
    # "softmax_loss_forward_rows": the one before it, for
    # benchmarks/loss_kernel_gpu.py)
    _per_position("softmax_loss_forward", x.dtype, channels, inner, n * inner,
                  (x, labels, _int(channels), _int(inner), *_skipped(ignore_label, pad_label),
                   prob, loss, valid), rows_func=rows_kernel)
    return _finish(prob, prob_t), _finish(loss, loss_t), _finish(valid, valid_t)


def softmax_loss_backward(prob, labels, scale=1.0, ignore_label=None, out=None, count=None,
                          scale_factor=1.0, pad_label=None,
                          rows_kernel="softmax_loss_backward_vec"):
    """Gradient of the summed loss times ``scale * scale_factor / count``:
    dx = scale * scale_factor / count * (prob - onehot), 0 at ignored
    positions (label ``ignore_label`` or ``pad_label``). ``scale`` is a
    number or a one-element CuPy array (e.g. the top gradient;
    ``scale_factor`` a number, e.g. 1 / positions), ``count``
    None or a one-element CuPy array (the valid count of
    :func:`softmax_loss_count`): both stay on the device. ``rows_kernel``:
    the kernel for (N, C) rows of at least ROW_BLOCK_CLASSES classes (None:
    the one-thread-per-element kernel, as for the other layouts)."""
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
    args = (prob, labels, _int(channels), _int(inner), *_skipped(ignore_label, pad_label),
            scale_value, scale_ptr, has_scale_ptr, count_ptr, has_count, dx)
    if _rows(channels, inner) and rows_kernel is not None and prob.size > 0:
        # (N, C) rows of many classes: a block a tile of 4 * _REDUCE_THREADS
        # classes of a row, four a thread (``rows_kernel`` None: one thread
        # an element, the kernel before it, for benchmarks/loss_kernel_gpu.py)
        tiles = n * (-(-channels // (4 * _REDUCE_THREADS)))
        _base._launch_blocks("softmax_loss", rows_kernel, prob.dtype, min(tiles, _MAX_BLOCKS),
                             _REDUCE_THREADS, (np.int64(prob.size),) + args)
    else:
        _base._launch("softmax_loss", "softmax_loss_backward", prob.dtype, prob.size, args)
    return _finish(dx, target)


def _bits_rows(cupy, x, labels, func):
    """(x, labels, N, C) of (N, C) logits stored as bfloat16 bits (uint16),
    checked."""
    if not isinstance(x, cupy.ndarray) or x.dtype != np.uint16 or x.ndim != 2 \
            or not x.flags.c_contiguous:
        raise ValueError(f"{func}: x must be a C-contiguous (N, C) uint16 CuPy array "
                         f"(bfloat16 bits), got {getattr(x, 'dtype', type(x))} "
                         f"{tuple(getattr(x, 'shape', ()))}")
    n, channels = int(x.shape[0]), int(x.shape[1])
    return x, _labels(cupy, labels, n, func), n, channels


def softmax_loss_forward_bits(x, labels, ignore_label=None, out=None, pad_label=None):
    """The from_logits loss's per-position ``(loss, valid)`` (float32, (N,))
    of (N, C) logits stored as bfloat16 bits: :func:`softmax_loss_forward`'s
    loss and valid, with no probabilities, reading the bits themselves (one
    kernel, one block a row; cuda/softmax_loss.cu
    ``softmax_loss_forward_bits_f32``): the bits of widening x into float32
    and running ``softmax_loss_forward_vec``."""
    cupy = import_cupy()
    x, labels, n, channels = _bits_rows(cupy, x, labels, "softmax_loss_forward_bits")
    loss_out, valid_out = _outs(out, 2)
    f32 = np.dtype(np.float32)
    loss, loss_t = _output(cupy, loss_out, (n,), f32, "softmax_loss_forward_bits (loss)")
    valid, valid_t = _output(cupy, valid_out, (n,), f32, "softmax_loss_forward_bits (valid)")
    if n:
        _base._launch_blocks("softmax_loss", "softmax_loss_forward_bits_f32", None,
                             min(n, _MAX_BLOCKS), _REDUCE_THREADS,
                             (np.int64(n), x, labels, _int(channels),
                              *_skipped(ignore_label, pad_label), loss, valid))
    return _finish(loss, loss_t), _finish(valid, valid_t)


def softmax_loss_grad_bits(x, labels, scale=1.0, ignore_label=None, out=None, count=None,
                           scale_factor=1.0, pad_label=None):
    """dx of the from_logits loss from (N, C) logits stored as bfloat16
    bits, with the probabilities computed again in registers:
    :func:`softmax_loss_backward`'s dx = scale * scale_factor / count *
    (prob - onehot) (same arguments), written as bfloat16 bits (``out``
    uint16, the default; rounded to nearest even) or float32 (``out``
    float32). One kernel, one block a row (cuda/softmax_loss.cu
    ``softmax_loss_grad_bits_f32`` / ``softmax_loss_grad_bx_f32``); ``out``
    may be ``x``. The bits of widening x, ``softmax_loss_forward_vec``,
    ``softmax_loss_backward_vec`` and (bits) ``to_bf16_bits``."""
    cupy = import_cupy()
    x, labels, n, channels = _bits_rows(cupy, x, labels, "softmax_loss_grad_bits")
    dtype = np.dtype(np.uint16) if out is None else np.dtype(out.dtype)
    if dtype not in (np.dtype(np.uint16), np.dtype(np.float32)):
        raise ValueError(f"softmax_loss_grad_bits: out must be uint16 (bfloat16 bits) or "
                         f"float32, got {dtype}")
    dx, target = _output(cupy, out, x.shape, dtype, "softmax_loss_grad_bits")
    f32 = np.dtype(np.float32)
    # a float pointer the kernel does not read where a flag says so (nothing
    # allocated): the labels' bytes
    probe = labels.view(np.float32)
    scale_value, scale_ptr, has_scale_ptr = _scalar_or_device(
        cupy, scale, f32, probe, "softmax_loss_grad_bits: scale", scale_factor)
    if count is None:
        count_ptr, has_count = scale_ptr, _int(0)
    else:
        _, count_ptr, has_count = _scalar_or_device(cupy, count, f32, probe,
                                                    "softmax_loss_grad_bits: count")
    func = "softmax_loss_grad_bits_f32" if dtype == np.uint16 else "softmax_loss_grad_bx_f32"
    if n:
        _base._launch_blocks("softmax_loss", func, None, min(n, _MAX_BLOCKS), _REDUCE_THREADS,
                             (np.int64(n), x, labels, _int(channels),
                              *_skipped(ignore_label, pad_label), scale_value, scale_ptr,
                              has_scale_ptr, count_ptr, has_count, dx))
    return _finish(dx, target)


def _planes(cupy, a, func, arg):
    """(a, N, C, positions per sample) of an (N, C, ...) array, checked."""
    a = _input(cupy, a, f"{func}: {arg}")
    if a.ndim < 2:
        raise ValueError(f"{func}: expected (N, C, ...) {arg}, got shape {tuple(a.shape)}")
    return a, int(a.shape[0]), int(a.shape[1]), int(np.prod(a.shape[2:], dtype=np.int64))


def softmax_forward(x, out=None):
    """Softmax over axis 1 of an (N, C, ...) array (max-shifted), one thread
    per position (one block for rows of many classes); ``out`` may be ``x``."""
    cupy = import_cupy()
    x, n, channels, inner = _planes(cupy, x, "softmax_forward", "x")
    y, target = _output(cupy, out, x.shape, x.dtype, "softmax_forward")
    _per_position("softmax_forward", x.dtype, channels, inner, n * inner,
                  (x, _int(channels), _int(inner), y))
    return _finish(y, target)


def softmax_backward(dy, y, out=None):
    """dx = y * (dy - sum over axis 1 of dy * y) for (N, C, ...) arrays, one
    thread per position (one block for rows of many classes); ``out`` may be
    ``dy``."""
    cupy = import_cupy()
    y, n, channels, inner = _planes(cupy, y, "softmax_backward", "y")
    dy = _input(cupy, dy, "softmax_backward: dy")
    if tuple(dy.shape) != tuple(y.shape) or dy.dtype != y.dtype:
        raise ValueError(f"softmax_backward: dy {tuple(dy.shape)} {dy.dtype} and y "
                         f"{tuple(y.shape)} {y.dtype} differ")
    dx, target = _output(cupy, out, y.shape, y.dtype, "softmax_backward")
    _per_position("softmax_backward", y.dtype, channels, inner, n * inner,
                  (dy, y, _int(channels), _int(inner), dx))
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
    _base._launch_blocks("softmax_loss", "softmax_loss_mean", loss.dtype, 1, _REDUCE_THREADS,
                   (np.int64(loss.size), loss, valid, out_flat,
                    out_flat if count is None else count.reshape(1), _int(count is not None)))
    return out


def accuracy(x, labels, out, top_k=1, ignore_label=None, buffers=None, pad_label=None):
    """Top-``top_k`` accuracy over axis 1 on the device, into the
    one-element array ``out`` (x's dtype): the fraction of counted positions
    (label neither ``ignore_label`` nor ``pad_label``)
    whose label is among the top_k scores (a tie counts against it; a
    position with a non-finite score is wrong); 0 without a counted
    position, NaN with a label outside [0, C) (cuda/softmax_loss.cu
    ``accuracy_forward`` then ``accuracy_mean``: no host read, no atomics).
    ``buffers``: two arrays of one element per position, x's dtype (scratch);
    without them, new ones."""
    cupy = import_cupy()
    x, labels, n, channels, inner = _class_layout(cupy, x, labels, "accuracy", "x", "scores")
    total = n * inner
    if not isinstance(out, cupy.ndarray) or out.size != 1 or out.dtype != x.dtype:
        raise ValueError(f"accuracy: out must be a one-element {x.dtype} CuPy array")
    if int(top_k) < 1:
        raise ValueError(f"accuracy: top_k must be >= 1, got {top_k}")
    if buffers is None:
        buffers = (cupy.empty((total,), dtype=x.dtype), cupy.empty((total,), dtype=x.dtype))
    correct, valid = (b.reshape(-1) for b in buffers)
    if correct.size != total or valid.size != total:
        raise ValueError(f"accuracy: buffers of {total} elements needed")
    _per_position("accuracy_forward", x.dtype, channels, inner, total,
                  (x, labels, _int(channels), _int(inner), *_skipped(ignore_label, pad_label),
                   _int(top_k), correct, valid))
    _base._launch_blocks("softmax_loss", "accuracy_mean", x.dtype, 1, _REDUCE_THREADS,
                         (np.int64(total), correct, valid, out.reshape(1)))
    return out


def softmax_loss_count(labels, ignore_label, out, pad_label=None, floor=1):
    """out = max(number of labels that are neither ``ignore_label`` nor
    ``pad_label`` (each None: none), ``floor``), one block on the device:
    floor 1 for a loss's normaliser, 0 for the count itself."""
    cupy = import_cupy()
    labels = _labels(cupy, labels, labels.size, "softmax_loss_count")
    if not isinstance(out, cupy.ndarray) or out.size != 1:
        raise ValueError("softmax_loss_count: out must be a one-element CuPy array")
    _base._launch_blocks("softmax_loss", "softmax_loss_count", out.dtype, 1, _REDUCE_THREADS,
                   (np.int64(labels.size), labels, *_skipped(ignore_label, pad_label),
                    out.reshape(1), _int(floor)))
    return out


# ------------------------------------------------------------ loss watch ---

class LossTable:
    """The device table of :func:`loss_watch` for a fixed set of loss blobs
    (one-element arrays of one dtype): their device pointers and each one's
    share of the displayed loss. Built once (in the op's setup)."""

    def __init__(self, losses, shares):
        cupy = import_cupy()
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
    _base._launch_blocks("loss_watch", "loss_watch", table.dtype, 1, 1,
                   (table.pointers, table.shares, _int(table.count), iteration, out))
