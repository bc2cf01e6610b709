"""When an op kernel takes its GPU branch.

Op kernels keep one ``xp`` code path for NumPy and CuPy, and switch to the
raw CUDA kernels of :mod:`purine_mpi.gpu.kernels` only where CuPy has no
efficient equivalent (im2col/col2im, pooling, LRN, fused softmax-loss, fused
SGD update)::

    xp = get_xp(x)
    k = raw_kernels(xp, x, w)
    if k is not None:            # CuPy arrays of float32/float64
        k.im2col(x, ...)
    else:                        # the NumPy (and generic xp) path, unchanged
        ...

Importing this module needs only NumPy.
"""
import numpy as np

from ..base.precision import value_dtype
from . import data_ptr  # noqa: F401  (raw.data_ptr, as before)

#: dtypes the ``cuda/*.cu`` entry points exist for (``<func>_f32``, ``<func>_f64``)
KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def raw_kernels(xp, *arrays):
    """:mod:`purine_mpi.gpu.kernels` when ``xp`` is not NumPy (the arrays live
    on a GPU) and every array is float32 or float64; else None, and the
    caller runs its generic ``xp`` code (e.g. float16 on a GPU)."""
    if xp is np:
        return None
    if any(np.dtype(a.dtype) not in KERNEL_DTYPES for a in arrays):
        return None
    from . import kernels
    return kernels


def float_kernels(xp, *arrays):
    """``raw_kernels`` for ``arrays`` but those stored as bfloat16 bits
    (uint16, base/precision.is_bits): the kernels that take bits read them
    themselves (the ``_bx``/``_bdy`` and bits entry points)."""
    from ..base.precision import is_bits
    return raw_kernels(xp, *(a for a in arrays if not is_bits(a)))


def widen(x, out):
    """``x``'s float32 values: ``x`` as it is, or where it is stored as
    bfloat16 bits widened (exactly) into the float32 ``out`` of its size --
    on the host by base/precision.from_bf16_bits, on a GPU by the
    ``from_bf16_bits_device`` kernel (over a C-contiguous copy of a strided
    ``x``). Returns what holds the values."""
    from ..base.backend import get_xp
    from ..base.precision import from_bf16_bits, is_bits
    if not is_bits(x):
        return x
    xp = get_xp(x)
    if xp is np:
        return from_bf16_bits(x, out)
    from .kernels import from_bf16_bits_device
    from_bf16_bits_device(xp.ascontiguousarray(x).reshape(-1), out.reshape(-1))
    return out


def narrow(x, out, host_scratch):
    """Round ``x``'s float32 values to nearest even into the bfloat16 bits
    ``out`` of its size, ``widen``'s inverse: on the host by
    base/precision.to_bf16_bits through the scratch ``host_scratch()``
    returns (called there alone), on a GPU by the ``to_bf16_bits_device``
    kernel (no scratch)."""
    from ..base.backend import get_xp
    from ..base.precision import to_bf16_bits
    if get_xp(out) is np:
        to_bf16_bits(x, out, host_scratch())
        return
    from .kernels import to_bf16_bits_device
    to_bf16_bits_device(x.reshape(-1), out.reshape(-1))


def sum_scratch(shape, dtype):
    """The scratch specs (``OpKernel.scratch_specs``) of the deterministic
    bias-gradient and column-sum kernels (``kernels.bias_grad``,
    ``kernels.sum_rows``) for an input of ``shape`` (N, C, ...) and
    ``dtype``: their float64 partial sums, or [] for a dtype without the
    kernels (the generic path)."""
    if np.dtype(dtype) not in KERNEL_DTYPES:
        return []
    from .kernels import bias_grad_scratch
    return [bias_grad_scratch(shape)]


def last_axis_rows(shape):
    """``shape`` as (rows, its last axis): the 2-D view whose column sums
    (``kernels.sum_rows``) are a sum over every axis but the last."""
    return (int(np.prod(shape[:-1], dtype=np.int64)), int(shape[-1]))


def column_scratch(x):
    """The scratch specs of the column sums of ``x``'s ``last_axis_rows``
    view on a GPU (a fully connected layer's bias gradient, a layer norm's
    dg and db): those of its values' dtype (float32's for bfloat16 bits,
    which the sums widen: ``sum_rows_bits_f32``)."""
    return sum_scratch(last_axis_rows(x.shape), value_dtype(x))


def same_buffer(a, b):
    """True when ``a`` and ``b`` view exactly the same elements."""
    return (a is b or (tuple(a.shape) == tuple(b.shape) and tuple(a.strides) == tuple(b.strides)
                       and np.dtype(a.dtype) == np.dtype(b.dtype)
                       and data_ptr(a) == data_ptr(b)))


def carry(srcs, dsts):
    """``dst[...] = src`` for each pair of ``srcs`` and ``dsts`` (an
    output that holds its input, updated or as it is), except where the two
    view the same elements (the memory plan put the output on its input:
    nothing to copy)."""
    for src, dst in zip(srcs, dsts):
        if not same_buffer(src, dst):
            dst[...] = src


def op_scratch(kernel, device):
    """The scratch buffer (``runtime.workspace.Scratch``) of ``kernel``'s op
    on GPU ``device``: shared through the dispatcher's workspace with the ops
    the graph orders around it, or the kernel's own when it runs alone."""
    ws = getattr(kernel, "workspace", None)
    if ws is not None and hasattr(ws, "scratch_for"):
        return ws.scratch_for(kernel.op.name, device)
    own = getattr(kernel, "_own_scratch", None)
    if own is None:
        from .scratch import Scratch
        own = kernel._own_scratch = Scratch(device)
    return own


def array_device(array):
    """The GPU id of a CuPy array (0 for an emulated one)."""
    device = getattr(array, "device", None)
    return int(getattr(device, "id", 0) or 0)
