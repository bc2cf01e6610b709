"""Imports every op family so each registers its kernels and gradient rules."""
import importlib
import pkgutil

from .. import ops as _pkg

for _m in pkgutil.iter_modules(_pkg.__path__):
    if not _m.name.startswith("_") and _m.name != "registry":
        importlib.import_module(f"{_pkg.__name__}.{_m.name}")

# communication kernels live with the MPI code (they import mpi4py lazily)
importlib.import_module("purine_mpi.comm.ops")
