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
``{s,d}gemmStridedBatched`` (``{s,d}gemm`` for a single product), on CuPy's
current stream. The scalars are host values (cuBLAS's host pointer mode):
read when the call is made, so a captured product keeps the alpha and beta
of its capture and reads its operands at each replay.

``gemm_ex(a_bits, b_bits, c, "bfloat16")`` is the same product of low
values given as their uint16 bits (``cublasGemmEx``: bfloat16 or float16
operands, a float32 result, float32 compute, on the tensor cores at the
low type's rate); ``gemm_low`` makes the bits of a bf16 op's float32
operands in its scratch and calls it, or ``gemm`` where it cannot
(``low_products``, ``PURINE_BF16_GEMM``; a refusal is said once).

Which cuBLAS binding (``blas_backend()``):

- ``"nvmath"``: NVIDIA's ``nvmath-python`` low-level bindings
  (``nvmath.bindings.cublas``, in the ``gpu`` extra). These calls can be
  captured in a CUDA graph. Each (device, stream) gets a cuBLAS handle of its
  own, bound to that stream once and given a workspace of its own
  (``PURINE_CUBLAS_WORKSPACE_MB``, default 32 MiB as cuBLAS recommends for
  Hopper), so cuBLAS never allocates inside a capture. ``reserve(stream)``
  makes them ahead of a capture; a product on a capturing stream without
  one is an error, not an allocation inside the capture. A captured
  product bakes its handle's workspace into the graph, and two graphs
  replayed at once must not share one (cuBLAS, "Results reproducibility"):
  so under ``workspace_scope(key)`` (a capture whose graph replays on the
  stream ``key``) the handles are those of that scope, one workspace per
  replay stream.
- ``"cupy"``: CuPy's own cuBLAS (``cupy.cuda.cublas``), when nvmath-python
  does not import. It works eagerly, but refuses every call during a stream
  capture (``NotImplementedError``), so a CUDA-graph segment holding a
  product runs eagerly; ``blas_note()`` is the line that says so (printed
  once, at the first such product).

Nothing here imports CuPy or nvmath at import time.
"""
import sys
import threading

import numpy as np

from . import SaidOnce, import_cupy
from .raw import data_ptr

#: cuBLAS operation codes (cublasOperation_t: CUBLAS_OP_N, CUBLAS_OP_T)
OP_N, OP_T = 0, 1
#: cublasMath_t's CUBLAS_TF32_TENSOR_OP_MATH (CuPy's binding takes the number)
CUBLAS_TF32_TENSOR_OP_MATH = 3
#: each handle's workspace, MiB, unless PURINE_CUBLAS_WORKSPACE_MB says otherwise
DEFAULT_WORKSPACE_MB = 32

_lock = threading.RLock()
_state = {"checked": False, "cublas": None, "reason": None, "noted": False}
_handles = {}   # (device, stream ptr, scope) -> _Handle
#: [(handle key, workspace bytes)] of every handle made since the process
#: began, released or not (``made_since``, ``made_totals``: what a run made,
#: also where its close released them since)
_made_log = []
_scope = threading.local()   # .key: the replay stream of the graph being captured
_products = threading.local()   # .tf32: this thread's products' TF32 (None: the process's)


class workspace_scope:  # noqa: N801  (a context manager, used as a function)
    """Within the block (on this thread), products and ``reserve`` use the
    handles and workspaces of ``key`` -- the stream the graph captured here
    replays on -- not those of the capture stream alone, so graphs replayed
    concurrently on different streams never share a cuBLAS workspace."""

    def __init__(self, key):
        self.key = key

    def __enter__(self):
        self.before = getattr(_scope, "key", None)
        _scope.key = self.key
        return self

    def __exit__(self, *exc):
        _scope.key = self.before
        return False


class tf32_products:  # noqa: N801  (a context manager, used as a function)
    """Within the block (on this thread), the float32 products may use
    TensorFloat-32 (``enabled``) or not, whatever ``tf32_enabled()`` says
    for the process: ops/registry.make_kernel wraps the run of an op marked
    bf16/fp16 in it, whose operands are bfloat16/float16 values and so
    exact in TF32 (tensor cores, float32 accumulation: no product changes).
    The handle's math mode is set at the call (``gemm``), on the handle of
    the stream the product goes to: each stream's handle is its own, so
    two streams never race for one math mode."""

    def __init__(self, enabled=True):
        self.enabled = enabled

    def __enter__(self):
        self.before = getattr(_products, "tf32", None)
        _products.tf32 = self.enabled
        return self

    def __exit__(self, *exc):
        _products.tf32 = self.before
        return False


class _Handle:
    """One nvmath cuBLAS handle, bound to one stream, with its workspace
    (a CuPy array kept alive as long as the handle)."""

    __slots__ = ("handle", "workspace", "stream_ptr", "tf32")

    def __init__(self, handle, workspace, stream_ptr, tf32):
        self.handle, self.workspace = handle, workspace
        self.stream_ptr, self.tf32 = stream_ptr, tf32


def _nvmath():
    """``nvmath.bindings.cublas``, or None (the reason is kept for the note)."""
    if _state["checked"]:
        return _state["cublas"]
    with _lock:
        if not _state["checked"]:
            cublas, reason = None, None
            try:
                from nvmath.bindings import cublas
            except Exception as exc:  # ImportError, or a broken install
                cublas = None
                reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
            _state.update(checked=True, cublas=cublas, reason=reason)
    return _state["cublas"]


def blas_backend():
    """Which binding ``gemm`` calls: "nvmath" (capturable) or "cupy"."""
    return "cupy" if _nvmath() is None else "nvmath"


def blas_note():
    """One line saying that the products cannot be captured and how to fix
    it, or None when they go through nvmath-python."""
    if _nvmath() is not None:
        return None
    return ("purine_mpi: matrix products go through CuPy's cuBLAS, which refuses CUDA-graph "
            "capture: segments holding them run eagerly; install nvmath-python (pip install "
            f"'purine_mpi[gpu]') [{_state['reason']}]")


def reset():
    """Destroy the handles made so far and check for nvmath again (tests,
    or before a process gives its devices up)."""
    with _lock:
        cublas = _state["cublas"]
        for entry in _handles.values():
            try:
                cublas.destroy(entry.handle)
            except Exception:
                pass
        _handles.clear()
        _state.update(checked=False, cublas=None, reason=None, noted=False, ex_refused=None)
        _say_once.clear()


def release_streams(ptrs):
    """Destroy the handles bound to the streams whose pointers ``ptrs``
    lists (under every scope) and drop their workspaces: a closed
    dispatcher's streams (runtime/streams_dispatcher.StreamExecutor.close),
    whose handles would otherwise keep ``PURINE_CUBLAS_WORKSPACE_MB`` of
    device memory each for the life of the process. Call it with those
    streams idle and no graph that captured their products to replay.
    Returns the workspace bytes released."""
    ptrs = {int(p) for p in ptrs}
    freed = 0
    with _lock:
        cublas = _state["cublas"]
        for key in [k for k, e in _handles.items() if e.stream_ptr in ptrs]:
            entry = _handles.pop(key)
            freed += int(getattr(entry.workspace, "nbytes", 0))
            if cublas is not None:
                try:
                    cublas.destroy(entry.handle)
                except Exception:   # a driver already torn down: nothing to keep
                    pass
    return freed


def made_mark():
    """A mark of the handles made so far, for ``made_since``."""
    with _lock:
        return len(_made_log)


def made_since(mark, device=None):
    """{(device, stream ptr, scope): workspace bytes} of the handles made
    since ``made_mark()`` returned ``mark`` (on ``device``; None: every
    device), released since or not: what a run made, which its close
    released (``release_streams``)."""
    with _lock:
        return {key: n for key, n in _made_log[mark:] if device is None or key[0] == device}


def made_totals(device):
    """(handles, workspace bytes) made on ``device`` since the process
    began, released or not: the difference over a run is what it made
    (benchmarks/gpt_gpu.py's ``device_memory``)."""
    with _lock:
        made = [n for key, n in _made_log if key[0] == device]
        return len(made), int(sum(made))


def made_handles(device=None):
    """The cuBLAS handles made so far (on ``device``; None: every device):
    {(device, stream ptr, scope): bytes of its workspace}, what
    runtime/footprint.cublas_handles plans before launch."""
    with _lock:
        return {key: int(getattr(entry.workspace, "nbytes", 0))
                for key, entry in _handles.items() if device is None or key[0] == device}


def workspace_bytes():
    """Each handle's workspace in bytes (``PURINE_CUBLAS_WORKSPACE_MB``, MiB)."""
    from ..base import env
    mib = env.get("PURINE_CUBLAS_WORKSPACE_MB", default=DEFAULT_WORKSPACE_MB)
    return int(mib * (1 << 20))


def _is_capturing(stream):
    probe = getattr(stream, "is_capturing", None)
    if probe is None:
        return False
    try:
        return bool(probe())
    except Exception:  # a query the driver refuses: let cuBLAS's own call decide
        return False


def _tf32():
    """Whether this thread's float32 products may use TF32: as ``tf32_products``
    says on this thread, else the process's ``tf32_enabled()``."""
    scoped = getattr(_products, "tf32", None)
    if scoped is not None:
        return bool(scoped)
    from . import tf32_enabled
    return tf32_enabled()


def _math_mode(cublas, tf32):
    return cublas.Math.TF32_TENSOR_OP_MATH if tf32 else cublas.Math.DEFAULT_MATH


class _NoCublas(Exception):
    """nvmath-python imports but cannot make a first cuBLAS handle (no
    libcublas it can load): the products take CuPy's cuBLAS."""


def _create(cublas, cupy, device, stream_ptr):
    """A handle bound to ``stream_ptr`` with a workspace of its own. The
    order matters: ``cublasSetStream`` resets a handle's workspace to
    cuBLAS's default pool, so the stream is set first, the workspace after."""
    try:
        handle = cublas.create()
    except Exception as exc:
        if _handles:
            raise
        raise _NoCublas(f"nvmath-python cannot create a cuBLAS handle: {type(exc).__name__}: "
                        f"{exc}".splitlines()[0]) from exc
    try:
        nbytes = workspace_bytes()
        workspace = cupy.empty((nbytes,), dtype=np.uint8) if nbytes else None
        cublas.set_stream(handle, stream_ptr)
        cublas.set_workspace(handle, data_ptr(workspace) if nbytes else 0, nbytes)
        cublas.set_pointer_mode(handle, cublas.PointerMode.HOST)
        tf32 = _tf32()
        cublas.set_math_mode(handle, _math_mode(cublas, tf32))
    except BaseException:
        cublas.destroy(handle)
        raise
    entry = _Handle(handle, workspace, stream_ptr, tf32)
    _handles[(device, stream_ptr, getattr(_scope, "key", None))] = entry
    _made_log.append(((device, stream_ptr, getattr(_scope, "key", None)), int(nbytes)))
    return entry


def reserve(stream, device=None):
    """Make the cuBLAS handle and workspace of ``stream`` (a CuPy stream) on
    ``device`` (default: the current one) now, so that products captured on
    that stream later allocate nothing. Call it before ``begin_capture``,
    for every stream of the capture. A no-op without nvmath-python (CuPy's
    cuBLAS cannot be captured anyway); returns the handle, or None."""
    cublas = _nvmath()
    if cublas is None:
        return None
    cupy = import_cupy()
    ptr = int(stream.ptr)
    if device is None:
        entry = _handle(cublas, cupy, int(cupy.cuda.runtime.getDevice()), stream, ptr)
    else:
        with cupy.cuda.Device(device):
            entry = _handle(cublas, cupy, int(device), stream, ptr)
    return None if entry is None else entry.handle


def _handle(cublas, cupy, device, stream, ptr):
    key = (device, ptr, getattr(_scope, "key", None))
    entry = _handles.get(key)
    if entry is not None:
        return entry
    with _lock:
        entry = _handles.get(key)
        if entry is not None:
            return entry
        if _state["cublas"] is None:   # the first handle failed meanwhile
            return None
        if _is_capturing(stream):
            raise RuntimeError(
                f"gemm: stream {ptr:#x} of device {device} is capturing a CUDA graph and has "
                "no cuBLAS handle yet; making one now would allocate its workspace inside "
                "the capture. Call purine_mpi.gpu.blas.reserve(stream) for every stream of "
                "a capture before begin_capture")
        try:
            return _create(cublas, cupy, device, ptr)
        except _NoCublas as exc:   # from now on CuPy's cuBLAS, said once
            _state.update(cublas=None, reason=str(exc))
            return None


def _note_cupy_once():
    with _lock:
        if _state["noted"]:
            return
        _state["noted"] = True
    print(blas_note(), file=sys.stderr, flush=True)


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
    if rows > 1 and strides[-2] < max(cols, 1):
        # overlapping rows (a broadcast row: stride 0): the width as ld
        # would read the memory after the first row as the other rows
        raise ValueError(f"gemm: the rows of {what} (shape {tuple(x.shape)}) overlap: "
                         f"strides {tuple(x.strides)}")
    ld = max(strides[-2] if rows > 1 else cols, cols, 1)
    if x.ndim == 2:
        return rows, cols, ld, 1, 0
    batch = int(x.shape[0])
    return rows, cols, ld, batch, (strides[0] if batch > 1 else 0)


def _shapes(a, b, c, trans_a, trans_b):
    """(m, n, k, batch, (lda, a stride), (ldb, b stride), (ldc, c stride)) of
    ``c = op(a) @ op(b)``, in elements, checked (``gemm``, ``gemm_ex``)."""
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
    return m, n, k, batch, (lda, a_stride), (ldb, b_stride), (ldc, c_stride)


def _stream_handle(cupy):
    """(nvmath's cublas, this stream's handle entry), or (None, None): CuPy's."""
    cublas, entry = _nvmath(), None
    if cublas is not None:
        stream = cupy.cuda.get_current_stream()
        entry = _handle(cublas, cupy, int(cupy.cuda.runtime.getDevice()), stream,
                        int(stream.ptr))
    return (cublas, entry) if entry is not None else (None, None)


def gemm(a, b, c, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
    """``c = alpha * op(a) @ op(b) + beta * c`` through cuBLAS (see the module
    docstring); ``c`` is written in place and returned."""
    cupy = import_cupy()
    dtype = np.dtype(c.dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"gemm: float32 or float64 only, got {dtype}")
    if np.dtype(a.dtype) != dtype or np.dtype(b.dtype) != dtype:
        raise TypeError(f"gemm: operands of {a.dtype} and {b.dtype} for a {dtype} result")
    m, n, k, batch, (lda, a_stride), (ldb, b_stride), (ldc, c_stride) = _shapes(
        a, b, c, trans_a, trans_b)
    if m == 0 or n == 0 or batch == 0:
        return c
    scalars = np.array([alpha, beta], dtype=dtype)   # host pointer mode: read at the call
    alpha_ptr, beta_ptr = scalars.ctypes.data, scalars.ctypes.data + dtype.itemsize
    op_a, op_b = (OP_T if trans_a else OP_N), (OP_T if trans_b else OP_N)
    single = dtype == np.dtype(np.float32)
    pa, pb, pc = data_ptr(a), data_ptr(b), data_ptr(c)
    cublas, entry = _stream_handle(cupy)
    if entry is not None:   # nvmath: this stream's own handle (capturable)
        handle = entry.handle
        if single:
            tf32 = _tf32()
            if tf32 != entry.tf32:
                cublas.set_math_mode(handle, _math_mode(cublas, tf32))
                entry.tf32 = tf32
        calls = ((cublas.sgemm, cublas.dgemm),
                 (cublas.sgemm_strided_batched, cublas.dgemm_strided_batched))
        _issue(calls, single, handle, (op_b, op_a, n, m, k), (alpha_ptr, beta_ptr),
               (pb, ldb, b_stride), (pa, lda, a_stride), (pc, ldc, c_stride), batch)
        return c
    _note_cupy_once()
    cublas = cupy.cuda.cublas   # CuPy's binding: binds its handle to the current stream
    handle = cupy.cuda.device.get_cublas_handle()
    host_mode = getattr(cublas, "CUBLAS_POINTER_MODE_HOST", None)
    if host_mode is not None:  # alpha and beta are host values
        cublas.setPointerMode(handle, host_mode)
    calls = ((cublas.sgemm, cublas.dgemm),
             (cublas.sgemmStridedBatched, cublas.dgemmStridedBatched))
    # CuPy's handle is shared by CuPy's own products: TF32 for this call only
    before = cublas.getMathMode(handle) if single and _tf32() else None
    if before is not None:
        cublas.setMathMode(handle, CUBLAS_TF32_TENSOR_OP_MATH)
    try:
        _issue(calls, single, handle, (op_b, op_a, n, m, k), (alpha_ptr, beta_ptr),
               (pb, ldb, b_stride), (pa, lda, a_stride), (pc, ldc, c_stride), batch)
    finally:
        if before is not None:
            cublas.setMathMode(handle, before)
    return c


#: the low-precision types ``gemm_ex`` multiplies, their values' bits held in
#: uint16 arrays: the name of each one's ``cudaDataType``
LOW_TYPES = {"bfloat16": "CUDA_R_16BF", "float16": "CUDA_R_16F"}


class GemmExRefused(Exception):
    """``gemm_ex`` cannot run: the binding names no GemmEx types (an old
    CuPy), or cuBLAS refused the call (its status in the message)."""


def _ex_codes(cupy, cublas, low, result="CUDA_R_32F"):
    """(operand type, result type, compute type, algorithm) of a GemmEx of
    ``low`` operands into ``result`` (float32, or ``low`` itself: a result
    of bits), as the binding itself numbers them:
    nvmath's ``nvmath.CudaDataType``, ``cublas.ComputeType.COMPUTE_32F``,
    ``cublas.GemmAlgo.DEFAULT``; CuPy's ``cupy.cuda.runtime.CUDA_R_*``,
    ``cupy.cuda.cublas.CUBLAS_COMPUTE_32F``, ``CUBLAS_GEMM_DEFAULT``."""
    try:
        if cublas is not None:
            import nvmath
            types = nvmath.CudaDataType
            return (int(types[LOW_TYPES[low]]), int(types[result]),
                    int(cublas.ComputeType.COMPUTE_32F), int(cublas.GemmAlgo.DEFAULT))
        runtime, binding = cupy.cuda.runtime, cupy.cuda.cublas
        return (int(getattr(runtime, LOW_TYPES[low])), int(getattr(runtime, result)),
                int(binding.CUBLAS_COMPUTE_32F), int(binding.CUBLAS_GEMM_DEFAULT))
    except (ImportError, AttributeError, KeyError) as exc:
        raise GemmExRefused(f"the cuBLAS binding names no GemmEx type ({type(exc).__name__}: "
                            f"{exc})") from exc


def gemm_ex(a, b, c, low, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
    """``c = alpha * op(a) @ op(b) + beta * c`` as ``gemm`` does, ``a`` and
    ``b`` the uint16 bits of ``low`` values (``LOW_TYPES``: bfloat16 or
    float16), ``c`` float32: one ``cublasGemmEx`` (``GemmStridedBatchedEx``
    for a batch) with operands of ``CUDA_R_16BF`` (``CUDA_R_16F``), a
    ``CUDA_R_32F`` result and ``CUBLAS_COMPUTE_32F``: tensor cores at the
    low type's rate, each product exact in float32 (8 x 8 (11 x 11)
    significant bits fit in 24), float32 accumulation -- what TF32 gives
    the same values widened to float32, up to cuBLAS's summation order.
    ``c`` is written in place and returned; ``GemmExRefused`` when the
    binding has no such call or cuBLAS refuses it."""
    cupy = import_cupy()
    if low not in LOW_TYPES:
        raise ValueError(f"gemm_ex: operands of {', '.join(LOW_TYPES)}, got {low!r}")
    bits_out = np.dtype(c.dtype) == np.dtype(np.uint16)
    if not bits_out and np.dtype(c.dtype) != np.dtype(np.float32):
        raise TypeError(f"gemm_ex: a float32 result (or bfloat16 bits) only, got {c.dtype}")
    if bits_out and (low != "bfloat16" or alpha != 1.0 or beta != 0.0):
        raise TypeError(f"gemm_ex: a result of bits is for bfloat16 operands, alpha 1 and beta "
                        f"0, got {low}, {alpha} and {beta}")
    if np.dtype(a.dtype) != np.dtype(np.uint16) or np.dtype(b.dtype) != np.dtype(np.uint16):
        raise TypeError(f"gemm_ex: the operands are the uint16 bits of {low} values, got "
                        f"{a.dtype} and {b.dtype}")
    m, n, k, batch, (lda, a_stride), (ldb, b_stride), (ldc, c_stride) = _shapes(
        a, b, c, trans_a, trans_b)
    if m == 0 or n == 0 or batch == 0:
        return c
    scalars = np.array([alpha, beta], dtype=np.float32)   # COMPUTE_32F: float scalars
    alpha_ptr, beta_ptr = scalars.ctypes.data, scalars.ctypes.data + 4
    op_a, op_b = (OP_T if trans_a else OP_N), (OP_T if trans_b else OP_N)
    pa, pb, pc = data_ptr(a), data_ptr(b), data_ptr(c)
    cublas, entry = _stream_handle(cupy)
    low_type, c_type, compute, algo = _ex_codes(cupy, cublas, low,
                                                LOW_TYPES[low] if bits_out else "CUDA_R_32F")
    if entry is not None:   # nvmath: this stream's own handle (capturable)
        handle, names, errors = entry.handle, ("gemm_ex", "gemm_strided_batched_ex"), \
            getattr(cublas, "cuBLASError", ())
    else:
        _note_cupy_once()
        cublas = cupy.cuda.cublas
        handle, names, errors = cupy.cuda.device.get_cublas_handle(), \
            ("gemmEx", "gemmStridedBatchedEx"), getattr(cublas, "CUBLASError", ())
        host_mode = getattr(cublas, "CUBLAS_POINTER_MODE_HOST", None)
        if host_mode is not None:
            cublas.setPointerMode(handle, host_mode)
    one, many = (getattr(cublas, name, None) for name in names)
    if one is None or many is None:
        raise GemmExRefused(f"the cuBLAS binding has no {names[0]}")
    try:
        if batch == 1:
            one(handle, op_b, op_a, n, m, k, alpha_ptr, pb, low_type, ldb, pa, low_type, lda,
                beta_ptr, pc, c_type, ldc, compute, algo)
        else:
            many(handle, op_b, op_a, n, m, k, alpha_ptr, pb, low_type, ldb, b_stride, pa,
                 low_type, lda, a_stride, beta_ptr, pc, c_type, ldc, c_stride, batch, compute,
                 algo)
    except errors as exc:   # the library's status (e.g. NOT_SUPPORTED), not a capture refusal
        raise GemmExRefused(f"cuBLAS refused GemmEx of {low} ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
    return c


_say_once = SaidOnce()


def low_products(low):
    """Whether ``gemm_low`` multiplies ``low`` values as ``low`` (``gemm_ex``):
    bfloat16 -- whose bits one kernel makes (``gpu.kernels.
    to_bf16_bits_device``; float16 has none yet, so its products stay on
    TF32) -- with ``PURINE_BF16_GEMM`` on (the default) and GemmEx not
    refused in this process."""
    from ..base import env
    return (low == "bfloat16" and bool(env.get("PURINE_BF16_GEMM"))
            and not _state.get("ex_refused"))


def gemm_low(a, b, c, low, bits, trans_a=False, trans_b=False):
    """``c = op(a) @ op(b)`` for ``a`` and ``b`` holding ``low`` values (a
    low-precision op's rounded inputs), each float32 or already the uint16
    bits of bfloat16 values (bf16 storage: parallel/precision.store_bits):
    where ``low_products``, each float32 operand's bits go into the next
    array of ``bits`` (C-contiguous uint16 arrays of its shape, in operand
    order: the op's scratch, reserved in its setup; none for a bits
    operand) and one ``gemm_ex`` multiplies them; else -- or when GemmEx is
    refused, said once, and from then on -- ``gemm`` on the float32
    operands, a bits one widened exactly into the next float32 array of
    ``bits`` (or, on the call that finds GemmEx refused, a new one). ``a``
    and ``b`` must be C-contiguous. ``c`` float32, or (bfloat16) the uint16
    bits of the result's rounding: GemmEx writes them (a ``CUDA_R_16BF``
    result); the float32 path multiplies into the next float32 array of
    ``bits`` (or a new one) and rounds it into ``c`` (one
    ``to_bf16_bits``): the same bits."""
    from ..base.precision import is_bits
    scratch = list(bits)
    if low_products(low):
        from .kernels import to_bf16_bits_device
        ops = [x if is_bits(x) else to_bf16_bits_device(x, scratch.pop(0)) for x in (a, b)]
        try:
            return gemm_ex(ops[0], ops[1], c, low, trans_a=trans_a, trans_b=trans_b)
        except GemmExRefused as exc:
            _state["ex_refused"] = str(exc)
            _say_once("ex_refused", f"purine_mpi: {low} matrix products run on TF32 tensor "
                      f"cores (float32 storage), not as {low} GemmEx: {exc}")
        scratch = []
    cupy = import_cupy()
    if is_bits(a) or is_bits(b):
        from .kernels import from_bf16_bits_device
        wide = []
        for x in (a, b):
            if is_bits(x):
                out = scratch.pop(0) if scratch else cupy.empty(x.shape, np.float32)
                x = from_bf16_bits_device(x.reshape(-1), out.reshape(-1)).reshape(x.shape)
            wide.append(x)
        a, b = wide
    if not is_bits(c):
        return gemm(a, b, c, trans_a=trans_a, trans_b=trans_b)
    from .kernels import to_bf16_bits_device   # the float32 result, then its bits
    wide = scratch.pop(0) if scratch else cupy.empty(c.shape, np.float32)
    gemm(a, b, wide, trans_a=trans_a, trans_b=trans_b)
    to_bf16_bits_device(wide.reshape(-1), c.reshape(-1))
    return c


def _issue(calls, single, handle, shape, scalars, b, a, c, batch):
    """One cuBLAS product, column-major (C^T = op(B)^T op(A)^T): the plain
    call for a single matrix, the strided-batched one for a batch.
    ``calls``: ((sgemm, dgemm), (sgemm batched, dgemm batched)) of a binding;
    ``b``, ``a``, ``c``: (pointer, leading dimension, batch stride)."""
    (one_f32, one_f64), (many_f32, many_f64) = calls
    alpha, beta = scalars
    if batch == 1:
        (one_f32 if single else one_f64)(handle, *shape, alpha, b[0], b[1], a[0], a[1], beta,
                                          c[0], c[1])
    else:
        (many_f32 if single else many_f64)(handle, *shape, alpha, *b, *a, beta, *c, batch)
