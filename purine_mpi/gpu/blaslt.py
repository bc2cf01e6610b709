"""A fully connected layer's bias and ReLU in the cuBLASLt epilogue, through
cuBLASLt's own binding ``nvmath.bindings.cublasLt`` (nvmath-python, the
``gpu`` extra), ``y`` the product's output D: nothing allocated, so it runs
inside a CUDA-graph capture too.

``fc_forward(x, w, y, bias, relu)`` computes ``y = relu(x @ w^T + bias)``
(``x``: (M, K), ``w``: (O, K), ``y``: (M, O), ``bias``: (O,) or None; float32
or float64) as one ``cublasLtMatmul`` whose epilogue adds the bias and
applies the ReLU (``CUBLASLT_EPILOGUE_RELU_BIAS``, ``BIAS`` or ``RELU``).
cuBLASLt is column-major and broadcasts the bias along D's rows (one value
per row), so the product is taken transposed: ``y^T = w @ x^T``, D = ``y``
seen column-major ((O, M), ld = y's row stride), A = ``w`` seen column-major
((K, O), ld = w's row stride) with ``TRANSA`` T, B = ``x`` seen column-major
((K, M), ld = x's row stride) with ``TRANSB`` N; C = D with beta 0 (not
read). float32 computes in ``CUBLAS_COMPUTE_32F`` -- ``_FAST_TF32`` where
the float32 products may use TF32 (gpu/blas ``_tf32``, as the cuBLAS
path's math mode) -- float64 in ``COMPUTE_64F``.

``fc_forward_bits(x_bits, w_bits, y_bits, bias_bits)`` is the bf16 case
(precision bf16, bits storage): bfloat16 A and B (uint16 bits), D the
bfloat16 bits of ``y``, ``CUBLAS_COMPUTE_32F`` with float32 scale, epilogue
``BIAS`` with a **bfloat16** bias (``CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE``
``CUDA_R_16BF``): cuBLAS's ``cublasLtMatmul()`` datatype table takes no
float32 bias with a bfloat16 D, so ops/fc.py rounds the float32 bias to
bfloat16 (to nearest even, one small kernel) first. The float32
accumulator plus the widened bias is rounded once into D. That is PyTorch
autocast's linear (the bias cast to bf16 too), not the default path's
float32 bias (GemmEx into float32 scratch, ``bias_bits``): docs/gpu.md,
"Precision".

A plan -- the matmul descriptor (compute and scale type, transposes,
epilogue, bias pointer and type), the four matrix layouts, a preference
(the workspace and the operands' pointer alignments) and the heuristic's
first algorithm -- is made once per (device, shapes, leading dimensions,
dtype, epilogue, TF32, alignments, bias address) at the first product of
it (eagerly: a segment's first iteration runs eagerly before it is
captured, runtime/cuda_graph.py), then each product is one
``cublasLtMatmul`` on the current stream. The workspace is the cuBLAS
handle's of that stream (gpu/blas.py: ``PURINE_CUBLAS_WORKSPACE_MB``,
default 32 MiB, made before any capture by ``blas.reserve``; the
preference's ``MAX_WORKSPACE_BYTES`` is that size): cuBLAS and cuBLASLt
calls on one stream run in its order, so they share it safely, and a
captured product bakes that stream's (scope's) workspace in as a captured
GemmEx does. The cuBLASLt handle is one per device, made outside any
capture. Descriptors and the heuristic are host calls only (PyTorch runs
the heuristic at each call, captured or not), so a plan missed inside a
capture -- a blob at a new address -- is made there too; a handle is not.

It is opt-in: ``PURINE_FC_EPILOGUE=cublaslt``. What keeps the default path
(the call returns False; ops/fc.py then issues its cuBLAS product and the
``bias_act`` kernel, or GemmEx + ``bias_bits``):

- ``PURINE_FC_EPILOGUE`` is ``kernel`` (the default);
- ``nvmath.bindings.cublasLt`` does not import: said once (``lt_note()``),
  and a bf16 op's scratch is then planned for the default path
  (``available``);
- no nvmath cuBLAS handle for the stream (CuPy's cuBLAS: gpu/blas.py), or
  no cuBLASLt handle yet on a capturing stream;
- the heuristic returns no algorithm, or cuBLASLt refuses the descriptors
  or the call: said once, and that plan keeps the default path for good;
- a leaky ReLU (cuBLASLt's epilogue has no slope), or a dtype other than
  float32/float64 (``fc_forward``).

Layer: gpu (imports: nothing at import time; CuPy and nvmath are imported
when a product is made).
"""
import threading

import numpy as np

from ..base import env
from . import SaidOnce, import_cupy
from .raw import data_ptr

_lock = threading.Lock()
_state = {"checked": False, "lt": None, "reason": None}
_handles = {}   # device -> cuBLASLt handle
_plans = {}     # key -> _Plan
_refused = {}   # key -> the reason (that product keeps the default path)
_retired = []   # plans refused after they were made: another thread may be inside a
                # cublasLtMatmul with their descriptors, so they are destroyed at reset()

#: the types of each kind of product: (A/B, C/D and bias, compute, scale)
_TYPES = {"float32": ("CUDA_R_32F", "CUDA_R_32F", "COMPUTE_32F", "CUDA_R_32F"),
          "float64": ("CUDA_R_64F", "CUDA_R_64F", "COMPUTE_64F", "CUDA_R_64F"),
          "bfloat16": ("CUDA_R_16BF", "CUDA_R_16BF", "COMPUTE_32F", "CUDA_R_32F")}
#: the scalars' dtype of each kind (the scale type's)
_SCALARS = {"float32": np.float32, "float64": np.float64, "bfloat16": np.float32}


def _binding():
    """(``nvmath.bindings.cublasLt``, ``nvmath.bindings.cublas``,
    ``nvmath.CudaDataType``), or None (the reason is kept for the note)."""
    if not _state["checked"]:
        with _lock:
            if not _state["checked"]:
                try:
                    import nvmath
                    from nvmath.bindings import cublas, cublasLt
                    cublasLt.matmul, cublasLt.Epilogue   # noqa: B018 (a broken install)
                    found = (cublasLt, cublas, nvmath.CudaDataType)
                except Exception as exc:
                    found = None
                    _state["reason"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                _state.update(checked=True, lt=found)
    return _state["lt"]


def opted_in():
    """Whether ``PURINE_FC_EPILOGUE`` asks for the cuBLASLt epilogue."""
    return env.get("PURINE_FC_EPILOGUE") == "cublaslt"


def available():
    """Whether nvmath's cuBLASLt binding imports (checked once): an op's
    scratch plan under the opt-in asks it (ops/fc.py ``_lt_bits``), so that
    it counts what the run takes where the binding is missing."""
    return _binding() is not None


def say_if_missing():
    """Say once, where the binding does not import, that the layers keep
    their kernels (``lt_note``)."""
    if _binding() is None:
        _say_once("missing", lt_note())


def lt_note():
    """The line that says fully connected layers do not use the cuBLASLt
    epilogue and why, or None when nvmath's cuBLASLt binding imports."""
    if _binding() is not None:
        return None
    return ("purine_mpi: fully connected layers add their bias and ReLU in a kernel of their "
            "own: nvmath-python's nvmath.bindings.cublasLt (the cuBLASLt epilogue) is missing; "
            f"install nvmath-python (pip install 'purine_mpi[gpu]') [{_state['reason']}]")


_say_once = SaidOnce()


class _Plan:
    """One product's descriptors, layouts, heuristic result (its algorithm
    at offset ``algo_at``) and host scalars, kept alive together."""

    __slots__ = ("desc", "a", "b", "d", "results", "algo_at", "scalars", "workspace", "lt")

    def destroy(self):
        """Destroy what was made (a plan whose making failed half-way too)."""
        lt = self.lt
        for layout in (self.a, self.b, self.d):
            if layout is not None:
                lt.matrix_layout_destroy(layout)
        if self.desc is not None:
            lt.matmul_desc_destroy(self.desc)


def reset():
    """Destroy the plans and handles and check the binding again (tests)."""
    with _lock:
        found = _state["lt"]
        for plan in [*_plans.values(), *_retired]:
            try:
                plan.destroy()
            except Exception:
                pass
        if found is not None:
            for handle in _handles.values():
                try:
                    found[0].destroy(handle)
                except Exception:
                    pass
        _plans.clear()
        _retired.clear()
        _handles.clear()
        _refused.clear()
        _state.update(checked=False, lt=None, reason=None)
        _say_once.clear()


def plan_count():
    """How many products are planned (cached)."""
    return len(_plans)


def refused():
    """{plan key without the bias address: reason} of the products that keep
    the default path."""
    return dict(_refused)


def _alignment(ptr):
    """The largest power of two up to 256 dividing the address ``ptr``: the
    preference's MIN_ALIGNMENT (cuBLASLt assumes 256 bytes unless told)."""
    ptr = int(ptr)
    return 256 if ptr % 256 == 0 else ptr & -ptr


def _ld(a):
    """The row stride (elements) of a 2-D array whose rows are contiguous and
    do not overlap: cuBLASLt's column-major ld (``ld >= rows`` of the
    layout, the array's columns) -- a stride below the width (a broadcast
    row: 0) has none, and the width in its place would read the memory
    after the first row as the other rows."""
    rows, cols = int(a.shape[0]), int(a.shape[1])
    if cols > 1 and a.strides[1] != a.itemsize:
        raise ValueError(f"cuBLASLt: the rows of an operand must be contiguous, got strides "
                         f"{tuple(a.strides)}")
    if rows <= 1:
        return max(cols, 1)
    stride = int(a.strides[0])
    if stride % a.itemsize or stride // a.itemsize < cols:
        raise ValueError(f"cuBLASLt: the rows of an operand of shape {tuple(a.shape)} overlap "
                         f"or are not whole elements apart (strides {tuple(a.strides)})")
    return max(stride // a.itemsize, 1)


def _check_shapes(x, w, y, bias):
    """(M, K, O) of ``y = x @ w^T + bias``: x (M, K), w (O, K), y (M, O), the
    bias (O,) and packed (cuBLASLt's BIAS epilogue reads O consecutive
    values); ValueError otherwise (cuBLASLt would take a wider w's first K
    columns, or write past a smaller y, without a word)."""
    if x.ndim != 2 or w.ndim != 2 or y.ndim != 2:
        raise ValueError(f"cuBLASLt fc: 2-D x, w and y, got shapes {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, {tuple(y.shape)}")
    m, k, o = int(x.shape[0]), int(x.shape[1]), int(w.shape[0])
    if int(w.shape[1]) != k or tuple(y.shape) != (m, o):
        raise ValueError(f"cuBLASLt fc: x {tuple(x.shape)} @ w^T of w {tuple(w.shape)} does "
                         f"not give y {tuple(y.shape)}")
    if bias is not None and (tuple(bias.shape) != (o,) or
                             (o > 1 and bias.strides[0] != bias.itemsize)):
        raise ValueError(f"cuBLASLt fc: the bias must be {o} packed values, got shape "
                         f"{tuple(bias.shape)}, strides {tuple(bias.strides)}")
    return m, k, o


def _set(setter, lt_dtype, obj, attr, value):
    """One attribute through its buffer, of the binding's own dtype for it."""
    buf = np.array([value], dtype=lt_dtype(attr))
    setter(obj, attr, buf.ctypes.data, buf.itemsize)


def _lt_handle(lt, cupy, device, stream):
    """This device's cuBLASLt handle, made now unless the stream is capturing
    (None then: cublasLtCreate is no call for a capture)."""
    handle = _handles.get(device)
    if handle is not None:
        return handle
    from .blas import _is_capturing
    if _is_capturing(stream):
        return None
    with _lock:
        if device not in _handles:
            _handles[device] = lt.create()
        return _handles[device]


def _make_plan(found, handle, kind, m, k, o, lds, bias_ptr, epilogue, tf32, aligns,
               workspace):
    """Descriptors, layouts, preference and the heuristic's first algorithm of
    ``y^T = w @ x^T`` (the module docstring); raises the binding's error or
    RuntimeError("no algorithm") where cuBLASLt has none."""
    lt, cublas, types = found
    ab, dc, compute, scale = _TYPES[kind]
    compute = cublas.ComputeType["COMPUTE_32F_FAST_TF32" if tf32 else compute]
    ldx, ldw, ldy = lds
    Attr, Pref = lt.MatmulDescAttribute, lt.MatmulPreferenceAttribute
    plan = _Plan()
    plan.lt, plan.workspace = lt, workspace
    plan.a = plan.b = plan.d = plan.desc = None
    pref = None
    try:
        plan.desc = lt.matmul_desc_create(int(compute), int(types[scale]))
        dset = lt.matmul_desc_set_attribute
        dtype_of = lt.get_matmul_desc_attribute_dtype
        _set(dset, dtype_of, plan.desc, Attr.TRANSA, int(cublas.Operation.T))
        _set(dset, dtype_of, plan.desc, Attr.TRANSB, int(cublas.Operation.N))
        _set(dset, dtype_of, plan.desc, Attr.EPILOGUE, int(lt.Epilogue[epilogue]))
        if bias_ptr is not None:
            _set(dset, dtype_of, plan.desc, Attr.BIAS_POINTER, int(bias_ptr))
            _set(dset, dtype_of, plan.desc, Attr.BIAS_DATA_TYPE, int(types[dc]))
        plan.a = lt.matrix_layout_create(int(types[ab]), k, o, ldw)   # w, (K, O) col-major
        plan.b = lt.matrix_layout_create(int(types[ab]), k, m, ldx)   # x, (K, M) col-major
        plan.d = lt.matrix_layout_create(int(types[dc]), o, m, ldy)   # y, (O, M) col-major
        pref = lt.matmul_preference_create()
        pset, pdtype = lt.matmul_preference_set_attribute, lt.get_matmul_preference_attribute_dtype
        _set(pset, pdtype, pref, Pref.MAX_WORKSPACE_BYTES, int(workspace[1]))
        for name, align in zip(("A", "B", "C", "D"), aligns):
            _set(pset, pdtype, pref, Pref[f"MIN_ALIGNMENT_{name}_BYTES"], int(align))
        plan.results = lt.MatmulHeuristicResult(1)
        count = np.zeros(1, dtype=np.int32)
        lt.matmul_algo_get_heuristic(handle, plan.desc, plan.a, plan.b, plan.d, plan.d, pref, 1,
                                     plan.results.ptr, count.ctypes.data)
        if int(count[0]) < 1:
            raise RuntimeError("the heuristic returned no algorithm")
        state = int(np.asarray(plan.results.state).reshape(-1)[0])
        if state != 0:   # CUBLAS_STATUS_SUCCESS: else its other fields are not valid
            raise RuntimeError(f"the heuristic's algorithm has state {state}")
        need = int(np.asarray(plan.results.workspace_size).reshape(-1)[0])
        if need > int(workspace[1]):
            raise RuntimeError(f"the algorithm wants {need} bytes of workspace, the stream has "
                               f"{int(workspace[1])}")
        plan.algo_at = int(lt.matmul_heuristic_result_dtype.fields["algo"][1])
        plan.scalars = np.array([1.0, 0.0], dtype=_SCALARS[kind])   # alpha 1, beta 0
        return plan
    except BaseException:
        plan.destroy()
        raise
    finally:
        if pref is not None:
            lt.matmul_preference_destroy(pref)


def _refuse(key, exc):
    with _lock:
        _refused[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    _say_once("refused", "purine_mpi: fully connected layers add their bias and ReLU in a "
              f"kernel of their own: cuBLASLt refused the epilogue ({_refused[key]})")


def _product(kind, x, w, y, bias, epilogue):
    """One cuBLASLt product ``y^T = w @ x^T`` with ``epilogue`` on the current
    stream; False where it does not apply or is refused (the module
    docstring)."""
    found = _binding()
    if found is None:
        _say_once("missing", lt_note())
        return False
    cupy = import_cupy()
    from . import blas
    stream = cupy.cuda.get_current_stream()
    _, entry = blas._stream_handle(cupy)   # this stream's cuBLAS handle and workspace
    if entry is None:
        return False
    device = int(cupy.cuda.runtime.getDevice())
    handle = _lt_handle(found[0], cupy, device, stream)
    if handle is None:
        return False
    m, k, o = _check_shapes(x, w, y, bias)
    if m == 0 or o == 0:
        return True
    ws_ptr = data_ptr(entry.workspace) if entry.workspace is not None else 0
    ws_bytes = int(getattr(entry.workspace, "nbytes", 0) or 0)
    tf32 = kind == "float32" and blas._tf32()
    px, pw, py = data_ptr(x), data_ptr(w), data_ptr(y)
    pb = None if bias is None else data_ptr(bias)
    lds = (_ld(x), _ld(w), _ld(y))
    aligns = tuple(_alignment(p) for p in (pw, px, py, py))
    shape_key = (device, kind, m, k, o, *lds, epilogue, tf32, aligns, ws_bytes)
    key = shape_key + (pb,)   # a refusal holds whatever the bias's address
    if shape_key in _refused:
        return False
    plan = _plans.get(key)
    lt = found[0]
    try:
        if plan is None:
            with _lock:
                plan = _plans.get(key)
                if plan is None:
                    plan = _make_plan(found, handle, kind, m, k, o, lds, pb, epilogue,
                                      tf32, aligns, (ws_ptr, ws_bytes))
                    _plans[key] = plan
        alpha = plan.scalars.ctypes.data
        beta = alpha + plan.scalars.itemsize
        lt.matmul(handle, plan.desc, alpha, pw, plan.a, px, plan.b, beta, py, plan.d, py,
                  plan.d, plan.results.ptr + plan.algo_at, ws_ptr, ws_bytes, int(stream.ptr))
    except Exception as exc:   # cuBLASLt refuses this product: the default path, for good
        with _lock:   # kept, not destroyed: another stream's thread may be using it
            stale = _plans.pop(key, None)
            if stale is not None:
                _retired.append(stale)
        _refuse(shape_key, exc)
        return False
    return True


def fc_forward(x, w, y, bias, relu, negative_slope=0.0):
    """``y = relu(x @ w^T + bias)`` (float32 or float64) through one cuBLASLt
    product with its epilogue; False when it does not apply (the module
    docstring) and the caller computes it as before."""
    if bias is None and not relu:
        return False
    if not opted_in():
        return False
    dtype = np.dtype(y.dtype)
    if negative_slope != 0.0 or dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        return False
    if any(np.dtype(a.dtype) != dtype for a in (x, w, *(() if bias is None else (bias,)))):
        return False
    epilogue = ("RELU_BIAS" if bias is not None else "RELU") if relu else "BIAS"
    return _product(dtype.name, x, w, y, bias, epilogue)


def fc_forward_bits(x, w, y, bias):
    """``y = round_bf16(x @ w^T + bias)`` for the uint16 bits of bfloat16
    ``x`` (M, K), ``w`` (O, K) and ``bias`` (O,), ``y`` (M, O) the bits of
    the result: one cuBLASLt product, epilogue BIAS with the bfloat16 bias
    (the module docstring); False where it does not apply or is refused."""
    if not opted_in():
        return False
    bits = np.dtype(np.uint16)
    if any(np.dtype(a.dtype) != bits for a in (x, w, y, bias)):
        raise TypeError(f"fc_forward_bits: uint16 bits of bfloat16 values, got "
                        f"{[str(a.dtype) for a in (x, w, y, bias)]}")
    return _product("bfloat16", x, w, y, bias, "BIAS")
