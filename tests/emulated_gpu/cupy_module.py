"""The stand-in for the ``cupy`` module: the host-compiled raw kernels
(``host_kernels.py``), ``DeviceArray`` arithmetic, pinned memory,
``cudaMemcpyAsync`` and CuPy's rules inside a stream capture."""
import ctypes
import sys
import types

import numpy as np

import purine_mpi.base.backend as backend
import purine_mpi.gpu as gpu

from . import capture
from .arrays import Allocations, DeviceArray, NoDevice, plain
from .device import active_device
from .host_kernels import host_cupy, keep_kernels_in, use_emulated_nvmath
from .runtime import cuda_namespace


def emulated_cupy(build_dir):
    """A stand-in for the cupy module: host-compiled raw kernels, NumPy
    arithmetic on DeviceArray (any other attribute is NumPy's), and CuPy's
    rules inside a stream capture (``tests/capture.py``)."""
    fake = host_cupy(build_dir)
    fake._emulated = True  # SimulatedRuntime records captures faithfully for it

    def on_device(array):
        return np.asarray(array).view(DeviceArray)

    def allocated(what, array, source=None):
        # a host array brought to the device is a new device array too
        if source is None or not isinstance(source, DeviceArray) or \
                not np.may_share_memory(array, plain(source)):
            capture.refuse_allocation(what, array.nbytes)
            Allocations.note(what, array)
        return on_device(array)

    def asnumpy(a, stream=None, out=None):
        if isinstance(a, DeviceArray):
            return a.get(stream=stream, out=out)
        return np.asarray(a) if out is None else np.copyto(out, a) or out

    def memcpy_async(dst, src, size, kind, stream_ptr):
        """cudaMemcpyAsync on raw addresses: in a capture, from page-locked
        memory only; it copies what ``src`` holds when it runs -- except
        from pageable host memory, which the driver stages before the call
        returns (the source may be reused at once)."""
        stream = capture.stream_of(stream_ptr)
        to_device = kind == fake.cuda.runtime.memcpyHostToDevice
        pinned = pinned_range(src if to_device else dst, size)
        if capture.is_capturing(stream) and not pinned:
            stream.capture.invalidate("a cudaMemcpyAsync from pageable memory")
            raise capture.CUDARuntimeError(capture.PAGEABLE_REFUSED)
        MEMCPY_LOG.append((kind, getattr(stream, "key", "default")))
        if to_device and not pinned:
            staged = ctypes.create_string_buffer(ctypes.string_at(src, size), size)
            capture.device_work(lambda: ctypes.memmove(dst, staged, size), stream)
        else:
            capture.device_work(lambda: ctypes.memmove(dst, src, size), stream)

    def stream_synchronize(stream_ptr):
        """cudaStreamSynchronize: refused on a capturing stream (which
        invalidates the capture), as ``SimStream.synchronize``."""
        stream = capture.stream_of(stream_ptr)
        if stream is None:     # the default stream
            stream = active_device().null_stream()
        stream.synchronize()

    def device_synchronize():
        if capture.any_capture_open():
            raise capture.CUDARuntimeError(capture.SYNC_REFUSED)

    fake.ndarray = DeviceArray
    fake.empty = lambda shape, dtype=float: allocated("empty", np.empty(shape, dtype))
    fake.zeros = lambda shape, dtype=float: allocated("zeros", np.zeros(shape, dtype))
    fake.empty_like = lambda a, dtype=None: allocated("empty_like",
                                                      np.empty_like(plain(a), dtype))
    fake.zeros_like = lambda a, dtype=None: allocated("zeros_like",
                                                      np.zeros_like(plain(a), dtype))
    fake.ascontiguousarray = lambda a, dtype=None: allocated(
        "ascontiguousarray", np.ascontiguousarray(plain(a), dtype), a)
    fake.asarray = lambda a, dtype=None: allocated("asarray", np.asarray(plain(a), dtype), a)
    fake.asnumpy = asnumpy
    # CuPy's take has no mode: an index outside the axis wraps around, as
    # NumPy's mode "wrap" (NumPy's default raises, which no GPU does)
    fake.take = lambda a, indices, axis=None, out=None: np.take(a, indices, axis=axis, out=out,
                                                              mode="wrap")
    # CuPy's pool (bench --json reports what it holds)
    # (free_all_blocks: nothing to give back, the emulated pool caches no block)
    # the pool's malloc hands out what ``Allocations.note`` counted already
    pool = types.SimpleNamespace(
        total_bytes=lambda: Allocations.total_bytes, used_bytes=lambda: Allocations.in_use,
        free_all_blocks=lambda: None,
        malloc=lambda size: types.SimpleNamespace(device_id=0, size=size))   # one device
    fake.get_default_memory_pool = lambda: pool
    # what the workspace needs: a device context, a device count, pinned memory
    fake.cuda.Device = NoDevice
    # CuPy's allocator hook (gpu/memory.PeakMemory: ``device_peak_bytes``)
    fake.cuda.get_allocator = lambda: Allocations.allocator or pool.malloc
    fake.cuda.set_allocator = lambda fn=None: setattr(
        Allocations, "allocator", None if fn is pool.malloc else fn)
    cuda_namespace(fake.cuda)   # Stream, Event, ...; the default stream is the device's
    runtime = fake.cuda.runtime
    runtime.getDeviceCount = lambda: 1
    runtime.getDeviceProperties = lambda device: {"name": b"Emulated GPU", "major": 9, "minor": 0}
    runtime.memcpyHostToDevice, runtime.memcpyDeviceToHost = 1, 2
    runtime.memcpyAsync = memcpy_async
    runtime.deviceSynchronize = device_synchronize
    runtime.streamSynchronize = stream_synchronize
    runtime.streamIsCapturing = lambda ptr: (capture.stream_of(ptr)
                                             or capture.DEFAULT_STREAM).is_capturing()
    runtime.CUDARuntimeError = capture.CUDARuntimeError
    fake.cuda.alloc_pinned_memory = alloc_pinned
    fake.__getattr__ = lambda name: getattr(np, name)  # PEP 562
    return fake


_pinned_buffers = []  # (start, end) of the page-locked allocations
#: (kind, stream key) of every cudaMemcpyAsync queued on the emulated device
MEMCPY_LOG = []


def alloc_pinned(nbytes):
    """``cupy.cuda.alloc_pinned_memory``: a host buffer known to be page-locked."""
    if capture.is_capturing():   # cudaHostAlloc: never inside a capture
        raise RuntimeError(f"{capture.ALLOC_REFUSED}: pinned host memory")
    buffer = bytearray(max(int(nbytes), 1))
    start = ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))
    _pinned_buffers.append((start, start + len(buffer), buffer))
    return buffer


def pinned_range(address, size):
    return any(lo <= address and address + size <= hi for lo, hi, _ in _pinned_buffers)


def use_emulated_cupy(monkeypatch, build_dir, nvmath=True):
    """Make ``emulated_cupy(build_dir)`` the CuPy that purine_mpi imports (for
    this test), with an empty raw-kernel cache; returns it. The matrix
    products go through the emulated nvmath cuBLAS (capturable), or with
    ``nvmath=False`` through the emulated CuPy cuBLAS (which refuses a
    capture)."""
    gpu.clear_kernel_cache()
    keep_kernels_in(monkeypatch, build_dir)
    fake = emulated_cupy(build_dir)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(backend, "_cupy", fake)
    use_emulated_nvmath(monkeypatch, enabled=nvmath)
    return fake
