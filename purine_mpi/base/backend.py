"""Array-module selection: NumPy on the CPU, CuPy on a GPU location.

Kernels use ``xp = get_xp(array)`` and one code path for both libraries.
CuPy is optional: importing this module never requires it.
"""
import numpy as np

try:  # CuPy is an optional extra (``pip install purine_mpi[gpu]``)
    import cupy as _cupy
except Exception:  # pragma: no cover - depends on the machine
    _cupy = None


def cupy_available():
    """True when CuPy imports and at least one CUDA device is visible."""
    if _cupy is None:
        return False
    try:
        return _cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def get_xp(array=None):
    """The array module (numpy or cupy) that owns ``array``."""
    if _cupy is not None and array is not None and isinstance(array, _cupy.ndarray):
        return _cupy
    return np


def xp_for_device(device):
    """Array module for a location's device: -1 (or None) is the CPU."""
    if device is None or device < 0:
        return np
    if not cupy_available():
        from .errors import UserError
        raise UserError(f"a location asks for GPU device {device}, but CuPy with a "
                        "CUDA device is not available; install purine_mpi[gpu] or use device: -1")
    return _cupy


def to_numpy(array):
    """A NumPy copy/view of a NumPy or CuPy array."""
    if _cupy is not None and isinstance(array, _cupy.ndarray):
        return _cupy.asnumpy(array)
    return np.asarray(array)


def all_finite(array):
    """Whether every element of ``array`` (NumPy or CuPy) is finite: no NaN,
    no inf. A host float array is judged by its largest and smallest
    elements (a NaN propagates through both reductions; an inf is one of
    them), so no array-sized temporary is held: ``isfinite(a).all()``
    holds a byte an element, the largest weight's at the check before each
    checkpoint (4 MiB for a 4096 x 1024 fc layer), above what ``plan``
    counts between iterations (docs/running.md, "Will it fit?")."""
    xp = get_xp(array)
    if xp is not np or array.dtype.kind != "f":
        return bool(xp.isfinite(array).all())
    return array.size == 0 or bool(np.isfinite(array.max()) and np.isfinite(array.min()))
