"""A fully connected layer's bias and ReLU in the cuBLASLt epilogue, through
nvmath-python's ``nvmath.linalg.advanced.Matmul`` (the ``gpu`` extra).

``fc_forward(x, w, y, bias, relu)`` computes ``y = relu(x @ w^T + bias)``
(``x``: (M, K), ``w``: (O, K), ``y``: (M, O), ``bias``: (O,) or None) as one
cuBLASLt product whose epilogue adds the bias and applies the ReLU
(``MatmulEpilog.RELU_BIAS``, ``BIAS`` or ``RELU``). cuBLASLt broadcasts the
bias along the result's rows, so the product is taken transposed:
``y^T = w @ x^T`` (a = ``w``, b = ``x^T``, a view), and the bias is one
value per row of ``y^T``.

The plans are cached per (device, stream, operand addresses, shapes, dtype,
epilogue): ``Matmul(...)`` and ``.plan(epilog=..., epilog_inputs=...)`` run
once, at the first product of a shape (cold), and each later product only
``.execute(stream=...)`` (warm). A blob keeps its address for the life of a
workspace, so a plan reads the right memory at each execute.

It is opt-in: ``PURINE_FC_EPILOGUE=cublaslt``. The default (``kernel``)
keeps the cuBLAS product and the ``bias_act`` kernel, because nvmath-python
1.0's ``Matmul.execute`` takes no output buffer: every call allocates its
result from CuPy's pool and the layer copies it into ``y``. On an H200
(2026-11-25) that was two pool allocations in each steady cifar10_quick
iteration (``tests/test_gpu_no_alloc.py``), which our rule forbids, and a
copy of ``y`` in place of the kernel it saves. The epilogue can become
the default through cuBLASLt's own binding (``nvmath.bindings.cublasLt``,
with ``y`` as its output), which needs neither.

What stays as it was (``fc_forward`` returns False; ops/fc.py then issues
its cuBLAS product and the ``bias_act`` kernel):

- ``PURINE_FC_EPILOGUE`` is ``kernel`` (the default);
- nvmath-python's advanced API is missing: said once (``lt_note()``);
- the stream is capturing a CUDA graph: ``Matmul.execute`` allocates its
  result (and any auxiliary output) on every call -- nvmath-python 1.0 takes
  no output buffer -- so it cannot run inside a capture that replays; the
  captured layer keeps gemm + ``bias_act`` (both capturable), said once;
- a leaky ReLU (cuBLASLt's epilogue has no slope), or a dtype other than
  float32/float64.

Eagerly the epilogue replaces the ``bias_act`` kernel by a copy of the
product's result into ``y`` (the allocation comes from CuPy's pool).

Layer: gpu (imports: nothing at import time; CuPy and nvmath are imported
when a product is made).
"""
import threading

import numpy as np

from ..base import env
from . import SaidOnce, import_cupy
from .blas import _is_capturing
from .raw import data_ptr

_lock = threading.Lock()
_state = {"checked": False, "advanced": None, "reason": None}
_plans = {}    # key -> a planned Matmul


def _advanced():
    """``nvmath.linalg.advanced``, or None (the reason is kept for the note)."""
    if not _state["checked"]:
        with _lock:
            if not _state["checked"]:
                try:
                    from nvmath.linalg import advanced
                    advanced.Matmul, advanced.MatmulEpilog   # noqa: B018 (a broken install)
                except Exception as exc:
                    advanced = None
                    _state["reason"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                _state.update(checked=True, advanced=advanced)
    return _state["advanced"]


def lt_note():
    """The line that says fully connected layers do not use the cuBLASLt
    epilogue and why, or None when nvmath's advanced API imports."""
    if _advanced() is not None:
        return None
    return ("purine_mpi: fully connected layers add their bias and ReLU in a kernel of their "
            "own: nvmath-python's nvmath.linalg.advanced (the cuBLASLt epilogue) is missing; "
            f"install nvmath-python (pip install 'purine_mpi[gpu]') [{_state['reason']}]")


CAPTURE_NOTE = ("purine_mpi: fully connected layers inside a CUDA-graph capture keep cuBLAS + "
                "their bias/ReLU kernel: nvmath's Matmul.execute allocates its result at each "
                "call (nvmath-python takes no output buffer), which a captured graph cannot")


_say_once = SaidOnce()


def reset():
    """Forget the plans and the import check (tests)."""
    with _lock:
        for mm in _plans.values():
            try:
                mm.free()
            except Exception:
                pass
        _plans.clear()
        _state.update(checked=False, advanced=None, reason=None, refused=False)
        _say_once.clear()


def plan_count():
    """How many products are planned (cached)."""
    return len(_plans)


def _epilog(advanced, bias, relu):
    names = advanced.MatmulEpilog
    if relu:
        return names.RELU_BIAS if bias is not None else names.RELU
    return names.BIAS


def fc_forward(x, w, y, bias, relu, negative_slope=0.0):
    """``y = relu(x @ w^T + bias)`` through one cuBLASLt product with its
    epilogue; False when it does not apply (see the module docstring) and
    the caller computes it as before."""
    if bias is None and not relu:
        return False
    if env.get("PURINE_FC_EPILOGUE") != "cublaslt":
        return False
    dtype = np.dtype(y.dtype)
    if negative_slope != 0.0 or dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        return False
    advanced = _advanced()
    if advanced is None:
        _say_once("missing", lt_note())
        return False
    cupy = import_cupy()
    stream = cupy.cuda.get_current_stream()
    if _is_capturing(stream):
        _say_once("capture", CAPTURE_NOTE)
        return False
    device = int(cupy.cuda.runtime.getDevice())
    key = (device, int(stream.ptr), data_ptr(x), data_ptr(w),
           None if bias is None else data_ptr(bias), tuple(x.shape), tuple(w.shape), dtype.str,
           bool(relu))
    if _state.get("refused"):
        return False
    mm = _plans.get(key)
    try:
        if mm is None:   # cold: plan now (never inside a capture: checked above)
            mm = advanced.Matmul(w, x.T, stream=stream)
            inputs = None if bias is None else {"bias": bias}
            mm.plan(epilog=_epilog(advanced, bias, relu), epilog_inputs=inputs, stream=stream)
            mm = _plans.setdefault(key, mm)
        result = mm.execute(stream=stream)   # y^T, (O, M), column order with a bias: y's layout
    except Exception as exc:   # the library refuses these operands: the kernels, for good
        _state["refused"] = True
        _say_once("refused", "purine_mpi: fully connected layers add their bias and ReLU in a "
                  "kernel of their own: nvmath's cuBLASLt epilogue refused "
                  f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
        return False
    if isinstance(result, tuple):
        result = result[0]
    y[...] = result.T
    return True
