"""The solver on the device: the fused and multi-tensor SGD updates, the
fused Adam/AdamW update and the other adaptive solvers', the lr policy, the
iteration counter and gradient clipping (cuda/sgd.cu, adam.cu, adaptive.cu,
lr_policy.cu, clip.cu).
"""
import numpy as np

from .. import data_ptr, dtype_suffix, import_cupy
from . import base as _base
from .base import _input, _int, _iteration, _same_as


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
    _base._launch("sgd", "sgd_momentum", w.dtype, w.size,
            (w, g, v, lr_value, lr_ptr, has_lr_ptr, t(momentum), t(weight_decay),
             t(grad_scale)))


_UNREAD = {}


def _unread_int64(cupy):
    """A one-element int64 device array the kernel is given but never reads
    (the pointer of a host iteration), made once, so no call allocates."""
    array = _UNREAD.get(id(cupy))
    if array is None:
        array = _UNREAD[id(cupy)] = cupy.empty((1,), dtype=np.int64)
    return array


#: cuda/adam.cu's copy modes: (the copy's dtype, the precision) -> mode
_COPY_MODES = {(np.dtype(np.float32), "bfloat16"): 1, (np.dtype(np.float32), "float16"): 2,
               (np.dtype(np.uint16), "bfloat16"): 3}


def copy_mode(copy, precision, like):
    """cuda/adam.cu's mode of a weight's low-precision copy ``copy`` of
    ``precision`` (``bfloat16`` or ``float16``) for the float32 weights
    ``like``: 1 (bfloat16 values in float32 storage), 2 (float16 values in
    float32 storage) or 3 (bfloat16 bits, uint16); 0 without a copy."""
    if copy is None:
        return 0
    mode = _COPY_MODES.get((np.dtype(copy.dtype), str(precision)))
    if mode is None or np.dtype(like.dtype) != np.dtype(np.float32):
        raise ValueError(f"adam: a {precision} copy of {np.dtype(copy.dtype)} storage for "
                         f"{np.dtype(like.dtype)} weights (float32 weights and a float32 "
                         "copy, or bfloat16 bits as uint16)")
    if not copy.flags.c_contiguous or int(copy.size) != int(like.size):
        raise ValueError(f"adam: the {precision} copy must be C-contiguous with the weight's "
                         f"{int(like.size)} elements, got {int(copy.size)}")
    return mode


_UNREAD16 = {}


def _unread_uint16(cupy):
    """A one-element uint16 device array the kernel is given but never
    writes (no copy of that kind), made once."""
    array = _UNREAD16.get(id(cupy))
    if array is None:
        array = _UNREAD16[id(cupy)] = cupy.empty((1,), dtype=np.uint16)
    return array


def adam_update(w, g, m, v, lr, iteration, beta1=0.9, beta2=0.999, delta=1e-8,
                grad_scale=1.0, weight_decay=0.0, decoupled=False, lr_mult=1.0, step0=0,
                copy=None, precision="bfloat16"):
    """In place, Adam (``decoupled=False``: the weight decay is L2 added to
    the gradient) or AdamW (``decoupled=True``: ``w *= 1 - rate *
    weight_decay`` first), step ``iteration - step0 + 1`` (``step0``: the
    iteration the moments started at), rate = lr * lr_mult, in
    one kernel that allocates nothing (cuda/adam.cu; ops/updates.py
    AdamUpdate gives the formulas).

    ``w``, ``m`` and ``v`` must be C-contiguous; ``lr`` is a number or a
    one-element CuPy array, ``iteration`` a number or the one-element int64
    iteration blob on the device: the kernel reads either itself.

    ``copy``: the weight's low-precision copy (``precision``: bfloat16 or
    float16; a float32 array of its values, or for bfloat16 a uint16 array
    of its bits), written in the same pass from the new weights: the bits
    of a Cast's rounding of them (parallel/precision.fold_weight_casts)."""
    cupy = import_cupy()
    for name, array in (("w", w), ("m", m), ("v", v)):
        if not isinstance(array, cupy.ndarray) or not array.flags.c_contiguous:
            raise ValueError(f"adam_update: {name} must be a C-contiguous "
                             "CuPy array (it is updated in place)")
    mode = copy_mode(copy, precision, w)
    copy32 = (copy if mode in (1, 2) else w).view(np.uint32)   # w: never written
    copy16 = copy if mode == 3 else _unread_uint16(cupy)
    dtype_suffix(w.dtype)
    g = _input(cupy, g, "adam_update: g")
    _same_as("adam_update", "w", w, g=g, m=m, v=v)
    t = w.dtype.type
    if isinstance(lr, cupy.ndarray):
        _, lr_ptr, has_lr_ptr = _lr_arg(cupy, lr, lr_mult, w, "adam_update")
        lr_value = np.float64(lr_mult)
    else:
        lr_value, lr_ptr, has_lr_ptr = np.float64(float(lr) * float(lr_mult)), w, _int(0)
    it_value, it_ptr, has_it_ptr = _adam_iteration(cupy, iteration, step0)
    _base._launch("adam", "adam_update", w.dtype, w.size,
                  (w, g, m, v, lr_value, lr_ptr, has_lr_ptr, it_value, it_ptr, has_it_ptr,
                   np.float64(beta1), np.float64(beta2), t(delta), t(grad_scale),
                   np.float64(weight_decay), _int(bool(decoupled)),
                   copy32.reshape(-1), copy16.reshape(-1), _int(mode)))


def _adam_iteration(cupy, iteration, step0):
    """(value, pointer, flag) of cuda/adam.cu's step ``iteration - step0 +
    1``: the kernel adds the value to the device iteration it reads."""
    if isinstance(iteration, cupy.ndarray):
        _, it_ptr, has_it_ptr = _iteration(cupy, iteration)
        return np.int64(-int(step0)), it_ptr, has_it_ptr
    return np.int64(int(iteration) - int(step0)), _unread_int64(cupy), _int(0)


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
    (weight_decay * decay_mult), kept in ``factor_dtype`` (default the
    weights' dtype; float64 for :func:`adam_multi`, whose rate is a double);
    ``copies``: per parameter its low-precision copy or None (
    :func:`adam_multi` writes it from the new weights, ``precision``:
    bfloat16 or float16; :func:`copy_mode`); their arrays are kept alive
    here too."""

    def __init__(self, grads, offsets, lr_mults, decays, dtype, factor_dtype=None,
                 copies=None, precision="bfloat16"):
        cupy = import_cupy()
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
        factor_dtype = dtype if factor_dtype is None else np.dtype(factor_dtype)
        self.lr_mults = cupy.asarray(np.asarray(lr_mults, factor_dtype))
        self.decays = cupy.asarray(np.asarray(decays, factor_dtype))
        self.factor_dtype = factor_dtype
        self.dtype = dtype
        copies = [None] * len(grads) if copies is None else list(copies)
        if len(copies) != len(grads):
            raise ValueError("MultiTensorTable: one copy (or None) per gradient")
        modes = [copy_mode(c, precision, g) for c, g in zip(copies, grads)]
        self.copies = copies
        self.copy_modes_host = modes
        self.copy_pointers = cupy.asarray(np.asarray(
            [data_ptr(c) if c is not None else 0 for c in copies], np.uint64))
        self.copy_modes = cupy.asarray(np.asarray(modes, np.int32))


def _check_flat(cupy, what, table, factor_dtype, **flat):
    """The flat buffers of a multi-tensor update: C-contiguous CuPy arrays
    of the table's dtype, long enough for every parameter's view."""
    if table.factor_dtype != np.dtype(factor_dtype):
        raise ValueError(f"{what}: the table's factors are {table.factor_dtype}, the kernel "
                         f"takes {np.dtype(factor_dtype)}")
    for name, array in flat.items():
        if not isinstance(array, cupy.ndarray) or not array.flags.c_contiguous or \
                array.dtype != table.dtype:
            raise ValueError(f"{what}: {name} must be a C-contiguous "
                             f"{table.dtype} CuPy array (it is updated in place)")
    end = max(o + n for o, n in zip(table.offsets_host, table.sizes))
    if any(a.size < end for a in flat.values()):
        raise ValueError(f"{what}: the flat buffers hold "
                         f"{' and '.join(str(a.size) for a in flat.values())} elements, the "
                         f"parameters reach {end}")


def sgd_momentum_multi(w, v, table, lr, momentum=0.9, grad_scale=1.0):
    """:func:`sgd_momentum_update` of every parameter in ``table`` (a
    :class:`MultiTensorTable`) in one kernel, in place on the flat weight
    and momentum buffers ``w`` and ``v`` (1-D, C-contiguous)."""
    cupy = import_cupy()
    _check_flat(cupy, "sgd_momentum_multi", table, table.dtype, w=w, v=v)
    t = w.dtype.type
    lr_value, lr_ptr, has_lr_ptr = _lr_arg(cupy, lr, 1.0, w, "sgd_momentum_multi")
    _base._launch("sgd", "sgd_momentum_multi", w.dtype, table.total,
            (w, v, table.pointers, table.starts, table.offsets, table.lr_mults,
             table.decays, _int(table.segments), lr_value, lr_ptr, has_lr_ptr,
             t(momentum), t(grad_scale)))


def adam_multi(w, m, v, table, lr, iteration, beta1=0.9, beta2=0.999, delta=1e-8,
               grad_scale=1.0, decoupled=False, step0=0):
    """:func:`adam_update` of every parameter in ``table`` (a
    :class:`MultiTensorTable` with float64 factors: each parameter's
    lr_mult and weight_decay * decay_mult) in one kernel, in place on the
    flat weight and moment buffers ``w``, ``m`` and ``v`` (1-D,
    C-contiguous): bit for bit the single-parameter kernel's result.
    ``lr``, ``iteration`` and ``step0`` as for :func:`adam_update` (without lr_mult).
    The table's copies (``MultiTensorTable(copies=...)``) are written in the
    same pass, as :func:`adam_update`'s ``copy``."""
    cupy = import_cupy()
    _check_flat(cupy, "adam_multi", table, np.float64, w=w, m=m, v=v)
    t = w.dtype.type
    if isinstance(lr, cupy.ndarray):
        _, lr_ptr, has_lr_ptr = _lr_arg(cupy, lr, 1.0, w, "adam_multi")
        lr_value = np.float64(0.0)
    else:
        lr_value, lr_ptr, has_lr_ptr = np.float64(float(lr)), w, _int(0)
    it_value, it_ptr, has_it_ptr = _adam_iteration(cupy, iteration, step0)
    _base._launch("adam", "adam_multi", w.dtype, table.total,
                  (w, m, v, table.pointers, table.starts, table.offsets, table.lr_mults,
                   table.decays, _int(table.segments), lr_value, lr_ptr, has_lr_ptr,
                   it_value, it_ptr, has_it_ptr, np.float64(beta1), np.float64(beta2),
                   t(delta), t(grad_scale), _int(bool(decoupled)), table.copy_pointers,
                   table.copy_modes))


# --------------------------------------------------------- learning rate ---

def learning_rate(iteration, out, policy, base, gamma=0.0, power=0.0, stepsize=0.0,
                  max_iter=0.0, min_lr=0.0, steps=None, warmup=0, warmup_start=0.0):
    """Evaluate an lr policy on the device into ``out`` (a one-element
    float32 CuPy array), one thread (cuda/lr_policy.cu). ``iteration`` is a
    number or the one-element int64 iteration blob on the device; ``steps``
    an int64 CuPy array of multistep values (or None). The arguments come
    from :func:`purine_mpi.ops.updates.lr_policy_args`."""
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
    _base._launch_blocks("lr_policy", "learning_rate", None, 1, 1,
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
    _base._launch_blocks("lr_policy", "iteration_next", None, 1, 1, (counter, iteration))


# ------------------------------------------------------ gradient clipping ---

def grad_sumsq(g, partial, scale2=1.0):
    """partial[s] = scale2 * (sum of g**2 over slot s), s < partial.size: the
    squared L2 norm of ``g`` (times ``scale2``) in ``partial.size`` float64
    partial sums, all on the device (cuda/clip.cu)."""
    cupy = import_cupy()
    g = _input(cupy, g, "grad_sumsq: g")
    if not isinstance(partial, cupy.ndarray) or partial.dtype != np.float64 \
            or not partial.flags.c_contiguous or partial.size < 1:
        raise ValueError("grad_sumsq: partial must be a contiguous float64 CuPy array")
    _base._launch_blocks("clip", "grad_sumsq", g.dtype, partial.size, _base._REDUCE_THREADS,
                         (np.int64(g.size), g, np.float64(scale2), _int(partial.size),
                          partial))


class _GradTable:
    """A fixed list of gradients (C-contiguous CuPy arrays of one dtype)
    whose addresses a multi-tensor kernel's device table holds: checked,
    kept alive, and :meth:`holds` tells whether arrays are still them."""

    def __init__(self, what, grads):
        cupy = import_cupy()
        if not grads:
            raise ValueError(f"{what}: no gradients")
        dtype = np.dtype(grads[0].dtype)
        dtype_suffix(dtype)
        for g in grads:
            if not isinstance(g, cupy.ndarray) or not g.flags.c_contiguous or g.dtype != dtype:
                raise ValueError(f"{what}: every gradient must be a C-contiguous {dtype} "
                                 f"CuPy array")
        self.dtype, self.count = dtype, len(grads)
        self.grads = list(grads)   # kept alive: the table holds their addresses
        self.pointers_host = [data_ptr(g) for g in grads]

    def holds(self, grads):
        """Whether ``grads`` are the arrays the table was built for (the same
        addresses, sizes and dtype, in the same order)."""
        return len(grads) == self.count and all(
            data_ptr(g) == p and g.size == t.size and g.dtype == self.dtype
            and g.flags.c_contiguous
            for g, p, t in zip(grads, self.pointers_host, self.grads))


class SumsqTable(_GradTable):
    """The device table of :func:`grad_sumsq_multi` for a fixed list of
    gradients (C-contiguous CuPy arrays of one dtype, each with its
    ``scale2``), built once (GradNormSq's setup): their pointers, sizes,
    scale2 and row of the partial sums, largest gradient first (its long
    stripes start first; the rows keep the list's order)."""

    def __init__(self, grads, scale2s, slots):
        cupy = import_cupy()
        if len(grads) != len(scale2s):
            raise ValueError("SumsqTable: gradients and one scale2 each")
        super().__init__("SumsqTable", grads)
        self.slots = int(slots)
        rows = sorted(range(len(grads)), key=lambda i: (-int(grads[i].size), i))
        self.pointers = cupy.asarray(np.asarray([self.pointers_host[i] for i in rows],
                                                np.uint64))
        self.sizes = cupy.asarray(np.asarray([grads[i].size for i in rows], np.int64))
        self.scale2 = cupy.asarray(np.asarray([float(scale2s[i]) for i in rows], np.float64))
        self.rows = cupy.asarray(np.asarray(rows, np.int64))


def grad_sumsq_multi(table, partial):
    """:func:`grad_sumsq` of every gradient of ``table`` (a
    :class:`SumsqTable`) in one launch: gradient i's ``table.slots``
    partial sums in partial[i * slots : (i + 1) * slots], bit for bit those
    of one :func:`grad_sumsq` per gradient (cuda/clip.cu)."""
    cupy = import_cupy()
    if not isinstance(partial, cupy.ndarray) or partial.dtype != np.float64 \
            or not partial.flags.c_contiguous or partial.size != table.count * table.slots:
        raise ValueError(f"grad_sumsq_multi: partial must be a contiguous float64 CuPy array "
                         f"of {table.count * table.slots} elements")
    _base._launch_blocks("clip", "grad_sumsq_multi", table.dtype,
                         min(table.count * table.slots, _base._MAX_BLOCKS),
                         _base._REDUCE_THREADS,
                         (table.pointers, table.sizes, table.scale2, table.rows,
                          _int(table.count), _int(table.slots), partial))


#: the kinds of cuda/adaptive.cu's ``adaptive_update``
ADAPTIVE_KINDS = {"nesterov": 0, "adagrad": 1, "rmsprop": 2, "adadelta": 3}


def adaptive_update(kind, w, g, states, lr, a=0.0, delta=1e-8, grad_scale=1.0,
                    weight_decay=0.0, lr_mult=1.0):
    """In place, the Nesterov, AdaGrad, RMSProp or AdaDelta update
    (``kind``; ``a`` is the momentum or rms_decay, ``states`` the solver's
    state arrays: one, or two for AdaDelta) in one kernel that allocates
    nothing (cuda/adaptive.cu; ops/updates.py gives the formulas). ``w`` and
    the states must be C-contiguous; ``lr`` is a number or a one-element
    CuPy array (the learning-rate blob, read by the kernel)."""
    cupy = import_cupy()
    if kind not in ADAPTIVE_KINDS:
        raise ValueError(f"adaptive_update: kind must be one of {sorted(ADAPTIVE_KINDS)}, "
                         f"got {kind!r}")
    want = 2 if kind == "adadelta" else 1
    if len(states) != want:
        raise ValueError(f"adaptive_update: {kind} keeps {want} state array(s), "
                         f"got {len(states)}")
    for name, array in [("w", w)] + [(f"state {i}", s) for i, s in enumerate(states)]:
        if not isinstance(array, cupy.ndarray) or not array.flags.c_contiguous:
            raise ValueError(f"adaptive_update: {name} must be a C-contiguous "
                             "CuPy array (it is updated in place)")
    dtype_suffix(w.dtype)
    g = _input(cupy, g, "adaptive_update: g")
    _same_as("adaptive_update", "w", w, g=g, **{f"state{i}": s for i, s in enumerate(states)})
    t = w.dtype.type
    lr_value, lr_ptr, has_lr_ptr = _lr_arg(cupy, lr, lr_mult, w, "adaptive_update")
    s1, s2 = states[0], states[-1]
    _base._launch("adaptive", "adaptive_update", w.dtype, w.size,
                  (_int(ADAPTIVE_KINDS[kind]), w, g, s1, s2, lr_value, lr_ptr, has_lr_ptr,
                   t(grad_scale), t(weight_decay), t(a), t(delta)))


#: float64 partial sums per array of ``all_finite``
_FINITE_SLOTS = 64


def all_finite(arrays):
    """Whether every element of ``arrays`` (float32 CuPy arrays on the
    current device, C-contiguous) is finite, in one read-back: each array's
    squares summed in float64 partial sums on the device (``grad_sumsq``: a
    NaN or an infinity makes its sum non-finite, and float32 squares cannot
    overflow float64). No CuPy reduction, which compiles at first use (2-3 s
    each on an H200, per dtype and rank) and reads back once per array."""
    cupy = import_cupy()
    arrays = [a for a in arrays if a.size]
    if not arrays:
        return True
    for a in arrays:
        if not isinstance(a, cupy.ndarray) or a.dtype != np.float32 or not a.flags.c_contiguous:
            raise ValueError("all_finite: C-contiguous float32 CuPy arrays only")
    partial = cupy.empty((len(arrays) * _FINITE_SLOTS,), dtype=np.float64)
    for i, a in enumerate(arrays):
        grad_sumsq(a, partial[i * _FINITE_SLOTS:(i + 1) * _FINITE_SLOTS])
    return bool(np.isfinite(cupy.asnumpy(partial)).all())


def clip_total(partial, out, dtype=np.float32):
    """out[0] = the sum of ``partial`` (float64, one device thread, in order)."""
    cupy = import_cupy()
    for name, array in (("partial", partial), ("out", out)):
        if not isinstance(array, cupy.ndarray) or array.dtype != np.float64 \
                or not array.flags.c_contiguous:
            raise ValueError(f"clip_total: {name} must be a contiguous float64 CuPy array")
    _base._launch_blocks("clip", "clip_total", np.dtype(dtype), 1, 1,
                         (partial, np.int64(partial.size), out))


def _clip_sumsq(cupy, sumsq, what):
    if not isinstance(sumsq, cupy.ndarray) or sumsq.dtype != np.float64 or sumsq.size != 1:
        raise ValueError(f"{what}: sumsq must be a one-element float64 CuPy array")
    return cupy.ascontiguousarray(sumsq.reshape(1))


def clip_scale(g, sumsq, clip):
    """In place: g *= clip / sqrt(sumsq[0]) when that norm exceeds ``clip``
    (``sumsq`` a one-element float64 device array, read by the kernel)."""
    cupy = import_cupy()
    if not isinstance(g, cupy.ndarray) or not g.flags.c_contiguous:
        raise ValueError("clip_scale: g must be a C-contiguous CuPy array (scaled in place)")
    dtype_suffix(g.dtype)
    _base._launch("clip", "clip_scale", g.dtype, g.size,
                  (g, _clip_sumsq(cupy, sumsq, "clip_scale"), np.float64(clip)))


#: elements per item of ``clip_scale_multi``: a block of 256 threads,
#: PURINE_CLIP_BATCH (16) loads in flight each (cuda/clip.cu)
CLIP_SCALE_CHUNK = 4096


class ClipScaleTable(_GradTable):
    """The device table of :func:`clip_scale_multi` for a fixed list of
    gradients (C-contiguous CuPy arrays of one dtype), built once
    (ClipScale's setup): their pointers, sizes and the first item of each
    (items of ``chunk`` elements; an empty gradient has none)."""

    def __init__(self, grads, chunk=CLIP_SCALE_CHUNK):
        cupy = import_cupy()
        super().__init__("ClipScaleTable", grads)
        self.chunk = int(chunk)
        if self.chunk < 1:
            raise ValueError(f"ClipScaleTable: chunk must be >= 1, got {chunk}")
        counts = [-(-int(g.size) // self.chunk) for g in grads]
        self.items = int(sum(counts))
        firsts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.pointers = cupy.asarray(np.asarray(self.pointers_host, np.uint64))
        self.sizes = cupy.asarray(np.asarray([g.size for g in grads], np.int64))
        self.firsts = cupy.asarray(firsts)


def clip_scale_multi(table, sumsq, clip):
    """:func:`clip_scale` of every gradient of ``table`` (a
    :class:`ClipScaleTable`) in one launch: bit for bit one
    :func:`clip_scale` per gradient (cuda/clip.cu)."""
    cupy = import_cupy()
    sumsq = _clip_sumsq(cupy, sumsq, "clip_scale_multi")
    if table.items == 0:
        return
    _base._launch_blocks("clip", "clip_scale_multi", table.dtype,
                         min(table.items, _base._MAX_BLOCKS), _base._BLOCK,
                         (table.pointers, table.sizes, table.firsts, _int(table.count),
                          np.int64(table.items), np.int64(table.chunk), sumsq,
                          np.float64(clip)))
