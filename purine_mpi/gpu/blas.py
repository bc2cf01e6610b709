"""Matrix products straight through cuBLAS, on the arrays the ops already
have: no CuPy ``matmul`` dispatch, no transposed copies, no temporaries.

``gemm(a, b, c)`` computes, in row-major terms and batched over a leading
axis, ``c[i] = alpha * op(a[i]) @ op(b[i]) + beta * c[i]`` with ``op`` a
transpose when ``trans_a``/``trans_b`` is set. Each operand is a 2-D matrix
or a 3-D batch of them whose rows are contiguous (last stride one element)
with any row stride (the leading dimension) and any batch stride -- 0
broadcasts one matrix over the batch, e.g. a convolution's weight over the
samples. So a grouped convolution's per-group slices and a weight's
transpose are described, never copied:

    gemm(w2d, cols3d, y3d)                       # y[n] = W @ cols[n]
    gemm(w2d, dy3d, dcols3d, trans_a=True)       # dcols[n] = W^T @ dy[n]
    gemm(dy3d, cols3d, part3d, trans_b=True)     # part[n] = dy[n] @ cols[n]^T

cuBLAS is column-major: a row-major matrix with row stride ``ld`` is the
column-major transpose with the same ``ld``, so ``C = op(A) op(B)`` is
computed as ``C^T = op(B)^T op(A)^T``, the operands swapped. One call of
``{s,d}gemmStridedBatched`` (``{s,d}gemm`` for a single product) on CuPy's
cuBLAS handle, which CuPy binds to the current stream. The scalars are host
values (cuBLAS's default pointer mode).
"""
import numpy as np

from . import import_cupy
from .raw import data_ptr

#: cuBLAS operation codes (cublasOperation_t)
OP_N, OP_T = 0, 1


def _matrix(x, what):
    """(rows, cols, ld, batch, batch_stride) of a 2-D or 3-D operand, in elements."""
    if x.ndim not in (2, 3):
        raise ValueError(f"gemm: {what} must be 2-D or 3-D, got shape {tuple(x.shape)}")
    item = x.itemsize
    if any(s % item for s in x.strides):
        raise ValueError(f"gemm: {what} has strides {tuple(x.strides)} that are not whole "
                         "elements")
    strides = [s // item for s in x.strides]
    rows, cols = int(x.shape[-2]), int(x.shape[-1])
    if cols > 1 and strides[-1] != 1:
        raise ValueError(f"gemm: the rows of {what} must be contiguous, got strides "
                         f"{tuple(x.strides)}")
    ld = strides[-2] if rows > 1 else cols
    ld = max(ld, cols, 1)
    if x.ndim == 2:
        return rows, cols, ld, 1, 0
    batch = int(x.shape[0])
    return rows, cols, ld, batch, (strides[0] if batch > 1 else 0)


def gemm(a, b, c, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
    """``c = alpha * op(a) @ op(b) + beta * c`` through cuBLAS (see the module
    docstring); ``c`` is written in place and returned."""
    cupy = import_cupy()
    dtype = np.dtype(c.dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"gemm: float32 or float64 only, got {dtype}")
    if np.dtype(a.dtype) != dtype or np.dtype(b.dtype) != dtype:
        raise TypeError(f"gemm: operands of {a.dtype} and {b.dtype} for a {dtype} result")
    ar, ac, lda, a_batch, a_stride = _matrix(a, "a")
    br, bc, ldb, b_batch, b_stride = _matrix(b, "b")
    m, n, ldc, c_batch, c_stride = _matrix(c, "c")
    k = ar if trans_a else ac
    if (ac if trans_a else ar) != m or (br if trans_b else bc) != n or \
            (bc if trans_b else br) != k:
        raise ValueError(f"gemm: op(a) {(m, k) if not trans_a else (ac, ar)} @ op(b) "
                         f"{(br, bc) if not trans_b else (bc, br)} does not give c "
                         f"{(m, n)}")
    batch = c_batch
    for what, count in (("a", a_batch), ("b", b_batch)):
        if count not in (1, batch):
            raise ValueError(f"gemm: {what} has a batch of {count}, c of {batch}")
    if c_batch > 1 and c_stride < m * ldc:
        raise ValueError("gemm: the matrices of c overlap")
    if m == 0 or n == 0 or batch == 0:
        return c
    cublas = cupy.cuda.cublas
    handle = cupy.cuda.device.get_cublas_handle()
    host_mode = getattr(cublas, "CUBLAS_POINTER_MODE_HOST", None)
    if host_mode is not None:  # alpha and beta are host values
        cublas.setPointerMode(handle, host_mode)
    scalars = np.array([alpha, beta], dtype=dtype)   # host pointer mode
    alpha_ptr, beta_ptr = scalars.ctypes.data, scalars.ctypes.data + dtype.itemsize
    op_a, op_b = (OP_T if trans_a else OP_N), (OP_T if trans_b else OP_N)
    single = dtype == np.dtype(np.float32)
    pa, pb, pc = data_ptr(a), data_ptr(b), data_ptr(c)
    if batch == 1:
        call = cublas.sgemm if single else cublas.dgemm
        call(handle, op_b, op_a, n, m, k, alpha_ptr, pb, ldb, pa, lda, beta_ptr, pc, ldc)
    else:
        call = cublas.sgemmStridedBatched if single else cublas.dgemmStridedBatched
        call(handle, op_b, op_a, n, m, k, alpha_ptr, pb, ldb, b_stride, pa, lda, a_stride,
             beta_ptr, pc, ldc, c_stride, batch)
    return c
