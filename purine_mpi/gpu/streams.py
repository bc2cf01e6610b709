"""CUDA streams, events and pinned host buffers for the GPU dispatcher.

A graph location names a device and a *thread*; on a GPU the thread is a CUDA
stream, so ops on different threads of one device can overlap (compute with
copies, one layer's backward with another's gradient all-reduce). The
dispatcher keeps one :class:`StreamPool`; before running an op it waits, on
the op's stream, for the events recorded after the ops that wrote the op's
inputs on other streams::

    pool = StreamPool()
    stream = pool.get(device=0, thread=1)
    for event in events_of_inputs_on_other_streams:
        wait_event(stream, event)
    with stream:                      # CuPy launches go to this stream
        kernel.run(ins, outs)
    done = record_event(stream)       # consumers wait on this

All CuPy imports happen inside the functions, so this module imports on a
machine without CuPy.
"""
import threading

import numpy as np


class StreamPool:
    """One non-blocking ``cupy.cuda.Stream`` per (device, thread), created on
    first use. Non-blocking streams do not synchronize with the legacy default
    stream, so only the explicit events order work between streams."""

    def __init__(self):
        self._streams = {}
        self._lock = threading.Lock()

    def get(self, device, thread=0):
        """The stream for ``thread`` on GPU ``device`` (created on that device)."""
        key = (int(device), thread)
        with self._lock:
            stream = self._streams.get(key)
            if stream is None:
                from . import import_cupy
                cupy = import_cupy()
                with cupy.cuda.Device(int(device)):
                    stream = cupy.cuda.Stream(non_blocking=True)
                self._streams[key] = stream
            return stream

    def synchronize(self):
        """Wait until every stream's queued work is done (end of an iteration,
        before a checkpoint or a host read of results)."""
        with self._lock:
            streams = list(self._streams.items())
        for (device, _), stream in streams:
            from . import import_cupy
            with import_cupy().cuda.Device(device):
                stream.synchronize()

    def items(self):
        """((device, thread), stream) pairs created so far."""
        with self._lock:
            return list(self._streams.items())

    def __len__(self):
        with self._lock:
            return len(self._streams)


def record_event(stream):
    """Record an event on ``stream`` after the work queued so far; other
    streams (or the host, with ``event.synchronize()``) can wait for it.
    Timing is disabled: such events are cheaper to record and wait on."""
    from . import import_cupy
    cupy = import_cupy()
    event = cupy.cuda.Event(disable_timing=True)
    event.record(stream)
    return event


def wait_event(stream, event):
    """Make work queued on ``stream`` from now on wait for ``event``; returns
    at once (the host does not block)."""
    stream.wait_event(event)


def event_done(event):
    """True when the work before ``event`` has finished (non-blocking poll,
    for a progress loop that must not stall)."""
    return bool(event.done)


def pinned_empty(shape, dtype=np.float32):
    """An uninitialized NumPy array in page-locked (pinned) host memory.

    Copies between pinned memory and the GPU run asynchronously on a stream
    and at full bus speed, so staging buffers (host<->device copies, MPI
    send/receive buffers of a non-CUDA-aware MPI) should be pinned."""
    from . import import_cupy
    cupy = import_cupy()
    try:
        import cupyx
        return cupyx.empty_pinned(shape, dtype=dtype)
    except (ImportError, AttributeError):
        dtype = np.dtype(dtype)
        shape = (shape,) if np.isscalar(shape) else tuple(shape)
        count = int(np.prod(shape, dtype=np.int64))
        memory = cupy.cuda.alloc_pinned_memory(count * dtype.itemsize)
        return np.frombuffer(memory, dtype, count).reshape(shape)


def copy_to_device_async(dst, src):
    """Queue ``dst[...] = src`` (``src`` a C-contiguous page-locked NumPy
    array of ``dst``'s dtype and size) as one ``cudaMemcpyAsync`` on the
    current stream. Unlike CuPy's ``ndarray.set`` it may be captured into a
    CUDA graph; the captured copy reads what ``src`` holds when it runs."""
    from . import data_ptr
    _memcpy_async("copy_to_device_async", dst, src, data_ptr(dst), src.ctypes.data,
                  "memcpyHostToDevice")


def copy_to_host_async(dst, src):
    """Queue ``dst[...] = src`` (``dst`` a C-contiguous page-locked NumPy
    array of device array ``src``'s dtype and size) as one
    ``cudaMemcpyAsync`` device-to-host on the current stream: the host
    does not wait (unlike CuPy's ``ndarray.get``); an event recorded after
    it says when ``dst`` holds the data."""
    from . import data_ptr
    _memcpy_async("copy_to_host_async", dst, src, dst.ctypes.data, data_ptr(src),
                  "memcpyDeviceToHost")


def _memcpy_async(what, dst, src, dst_ptr, src_ptr, kind):
    """One ``cudaMemcpyAsync`` of ``src`` into ``dst`` (same dtype and size,
    both contiguous) on the current stream; ``kind`` names CuPy's constant."""
    from . import import_cupy
    cupy = import_cupy()
    if not (dst.flags.c_contiguous and src.flags.c_contiguous) or \
            np.dtype(dst.dtype) != np.dtype(src.dtype) or dst.nbytes != src.nbytes:
        raise ValueError(f"{what}: a contiguous {src.dtype} source of {src.nbytes} bytes "
                         f"into a contiguous {dst.dtype} destination of {dst.nbytes} bytes")
    runtime = cupy.cuda.runtime
    runtime.memcpyAsync(dst_ptr, src_ptr, src.nbytes, getattr(runtime, kind),
                        cupy.cuda.get_current_stream().ptr)
