"""Device buffers and MPI: detect CUDA-aware MPI, else stage through pinned
host memory.

The MPI libraries on PyPI (MPICH, Open MPI) are not CUDA-aware, so a CuPy
buffer handed to them would be read as a host pointer and crash. Detection
asks the loaded MPI library itself (``MPIX_Query_cuda_support``, exported by
MPICH and Open MPI); ``PURINE_MPI_CUDA_AWARE=0|1`` overrides it.
"""
import ctypes
import functools

import numpy as np

from ..base import env
from ..base.backend import get_xp


@functools.lru_cache(maxsize=1)
def cuda_aware():
    """True when the running MPI library moves CUDA device memory directly."""
    given = env.get("PURINE_MPI_CUDA_AWARE")  # EnvError when not a flag
    if given is not None:
        return given
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
    the device when ``copy_in``). ``copy_back()`` writes the mirror back.

    The GPU dispatcher stages asynchronously instead (no synchronous
    ``get``/``set``): it queues ``copy_out_async()`` (a device-to-host
    ``cudaMemcpyAsync``) on a copy stream after the events of the bucket's
    writers, posts MPI once the event recorded after that copy has fired
    (``buffer(copy_in=True)`` then hands out the mirror without copying
    again), and ``copy_back_async()`` queues the host-to-device copy on the
    comm stream, where consumers wait on the event recorded after it. The
    mirror is allocated once, here."""

    def __init__(self, array):
        self.array = array
        self.staged = is_device_array(array) and not cuda_aware()
        self.host = None
        self._copied_out = False
        if self.staged:
            from ..gpu.streams import pinned_empty
            self.host = pinned_empty(array.shape, array.dtype)
            self.host[...] = 0

    def buffer(self, copy_in):
        if not self.staged:
            return self.array
        if copy_in:
            if self._copied_out:  # copy_out_async ran (its event fired)
                self._copied_out = False
            else:
                self.array.get(out=self.host)  # synchronous: on the host after
        return self.host

    def copy_out_async(self):
        """Queue the device-to-host copy into the mirror on the current
        stream (the caller records an event after it and waits for that
        event before MPI reads the mirror)."""
        if self.staged:
            from ..gpu.streams import copy_to_host_async
            copy_to_host_async(self.host, self.array)
            self._copied_out = True

    def copy_back(self):
        if self.staged:
            self.array.set(self.host)

    def copy_back_async(self):
        """Queue the host-to-device copy of the mirror on the current stream."""
        if self.staged:
            from ..gpu.streams import copy_to_device_async
            copy_to_device_async(self.array, self.host)
