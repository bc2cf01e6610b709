"""What every kernel family shares: the entry-point table, output sizes,
argument checks and the launch helpers (a grid-stride launch over N items,
or an explicit grid). Imports only NumPy and ``purine_mpi.gpu`` (the loader);
the families import this module and nothing else of the package.
"""
import numpy as np

from .. import dtype_suffix, get_function

#: the extern "C" entry points of each cuda/<file>.cu (each exists as
#: <name>_f32 and <name>_f64); tests/test_cuda_compile.py checks them.
ENTRY_POINTS = {
    "im2col": ("im2col", "col2im"),
    "pooling": ("maxpool_forward", "maxpool_backward",
                "avepool_forward", "avepool_backward"),
    "lrn": ("lrn_forward", "lrn_backward"),
    "softmax_loss": ("softmax_loss_forward", "softmax_loss_backward", "softmax_loss_mean",
                     "softmax_loss_count", "softmax_forward", "softmax_backward",
                     "accuracy_forward", "accuracy_mean", "softmax_loss_forward_rows",
                     "softmax_forward_rows", "softmax_backward_rows", "accuracy_forward_rows",
                     "softmax_loss_forward_vec", "softmax_loss_backward_vec"),
    "sgd": ("sgd_momentum", "sgd_momentum_multi"),
    "adam": ("adam_update", "adam_multi"),
    "adaptive": ("adaptive_update",),
    "dropout": ("dropout_forward", "dropout_apply", "dropout_backward", "dropout_forward_packed",
                "dropout_backward_packed"),
    "activation": ("relu_forward", "relu_backward", "bias_act", "gelu_forward",
                   "gelu_backward"),
    "reduce": ("channel_sum", "sum_rows", "bias_grad", "bias_grad_finish", "embedding_grad"),
    "layernorm": ("layernorm_forward", "layernorm_backward"),
    "loss_watch": ("loss_watch",),
    "clip": ("grad_sumsq", "grad_sumsq_multi", "clip_total", "clip_scale",
             "clip_scale_multi"),
}
#: entry points that exist once, without a dtype suffix
PLAIN_ENTRY_POINTS = {
    # float32 or bfloat16 bits (bx: x as bits) in, bfloat16 bits or float32 out
    "activation": ("gelu_forward_bits_f32", "gelu_forward_bx_f32", "gelu_forward_bx_bits_f32",
                   "gelu_backward_bx_f32", "gelu_backward_bdy_f32", "gelu_backward_bdy_bx_f32",
                   "gelu_backward_copy_f32", "gelu_backward_bx_copy_f32",
                   "gelu_backward_bdy_copy_f32", "gelu_backward_bdy_bx_copy_f32",
                   "bias_bits_f32", "add_bits_f32", "add_copy_f32",
                   # the vectorised ones (8 elements a thread), beside the old
                   "bias_bits_vec_f32", "gelu_forward_bx_bits_vec_f32",
                   "gelu_backward_vec_f32", "gelu_backward_copy_vec_f32",
                   "gelu_backward_bx_vec_f32", "gelu_backward_bx_copy_vec_f32",
                   "gelu_backward_bdy_vec_f32", "gelu_backward_bdy_copy_vec_f32",
                   "gelu_backward_bdy_bx_vec_f32", "gelu_backward_bdy_bx_copy_vec_f32",
                   # dx and the column sums of dx (an fc bias gradient) in one pass
                   "gelu_backward_colsum_f32", "gelu_backward_copy_colsum_f32",
                   "gelu_backward_bx_colsum_f32", "gelu_backward_bx_copy_colsum_f32",
                   "gelu_backward_bdy_colsum_f32", "gelu_backward_bdy_copy_colsum_f32",
                   "gelu_backward_bdy_bx_colsum_f32", "gelu_backward_bdy_bx_copy_colsum_f32"),
    "layernorm": ("layernorm_forward_bits_f32", "layernorm_backward_bdy_f32",
                  "layernorm_backward_copy_f32", "layernorm_backward_bdy_copy_f32",
                  # dx and the partial column sums of dy and dy * xhat (db, dg)
                  "layernorm_backward_colsum_f32", "layernorm_backward_copy_colsum_f32",
                  "layernorm_backward_bdy_colsum_f32", "layernorm_backward_bdy_copy_colsum_f32"),
    "dropout": ("philox_words", "dropout_apply_copy_f32", "dropout_backward_copy_f32",
                "dropout_backward_packed_copy_f32"),
    "lr_policy": ("learning_rate", "iteration_next"),
    "precision": ("round_bf16", "round_fp16",
                  "to_bf16_bits", "from_bf16_bits"),
    "reduce": ("embedding_order", "embedding_order_i32", "sum_rows_bits_f32",
               "sum_rows_vec_f32", "sum_rows_bits_vec_f32"),
    # the from_logits loss on bfloat16 bits logits (dx as bits, or float32)
    "softmax_loss": ("softmax_loss_forward_bits_f32", "softmax_loss_grad_bits_f32",
                     "softmax_loss_grad_bx_f32"),
}

_BLOCK = 256
_MAX_BLOCKS = 65535   # kernels use grid-stride loops, so any grid covers all
_REDUCE_THREADS = 256  # PURINE_REDUCE_THREADS of cuda/reduce.cu (PURINE_CLIP_THREADS,
#                       PURINE_LN_THREADS of cuda/layernorm.cu, PURINE_SOFTMAX_THREADS)


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
