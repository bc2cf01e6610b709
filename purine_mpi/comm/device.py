"""Device buffers and MPI: detect CUDA-aware MPI, else stage through pinned
host memory.

The MPI libraries on PyPI (MPICH, Open MPI) are not CUDA-aware, so a CuPy
buffer handed to them would be read as a host pointer and crash. Detection
asks the loaded MPI library itself (``MPIX_Query_cuda_support``, exported by
MPICH and Open MPI); ``PURINE_MPI_CUDA_AWARE=0|1`` overrides it.

Layer: ops (docs/DESIGN.md); may import the foundation, devices and data
layers below it, and its own.
"""
import ctypes
import functools
import os

import numpy as np

from ..backend import get_xp


@functools.lru_cache(maxsize=1)
def cuda_aware():
    """True when the running MPI library moves CUDA device memory directly."""
    env = os.environ.get("PURINE_MPI_CUDA_AWARE")
    if env is not None:
        return env.strip().lower() in ("1", "true", "yes")
    try:
        from mpi4py import MPI  # noqa: F401  (loads libmpi)
        libs = {line.split()[-1] for line in open("/proc/self/maps")
                if "libmpi" in line and line.split()[-1].startswith("/")}
        for path in sorted(libs):
            lib = ctypes.CDLL(path)
            if hasattr(lib, "MPIX_Query_cuda_support"):
                return bool(lib.MPIX_Query_cuda_support())
    except Exception:
        pass
    return False


def is_device_array(array):
    return get_xp(array) is not np


class HostStage:
    """A pinned host mirror of a device buffer, used around MPI calls.

    ``buffer(array)`` returns what MPI may touch: the array itself when it is
    a host array or MPI is CUDA-aware, else the pinned mirror (filled from
    the device when ``copy_in``). ``copy_back()`` writes the mirror back."""

    def __init__(self, array):
        self.array = array
        self.staged = is_device_array(array) and not cuda_aware()
        self.host = None
        if self.staged:
            import cupyx
            self.host = cupyx.zeros_pinned(array.shape, dtype=array.dtype)

    def buffer(self, copy_in):
        if not self.staged:
            return self.array
        if copy_in:
            self.array.get(out=self.host)  # synchronous: the data is on the host after
        return self.host

    def copy_back(self):
        if self.staged:
            self.array.set(self.host)
