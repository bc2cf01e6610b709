"""What a CUDA stream capture allows, on the simulated device.

The simulated device of the tests (``tests/emulated_gpu``: NumPy
arrays standing for CuPy arrays, the ``cuda/*.cu`` kernels compiled for the
host, streams run by ``SimulatedRuntime``) must refuse inside a capture
exactly what real CuPy refuses, with the same exceptions and messages, or
capture code passes here and fails on the first real GPU (it did: CuPy
14.2 on an H100). Measured there, and read in CuPy's sources
(``cupy/cuda/memory.pyx``, ``cupy/_core/core.pyx``,
``cupy_backends/cuda/libs/cublas.pyx``):

- every call of CuPy's own cuBLAS binding (``cupy.cuda.cublas.*``, which
  calls ``setStream`` first) raises ``NotImplementedError`` (CUBLAS_REFUSED);
- ``ndarray.set`` and every host-to-device copy through CuPy raise
  ``RuntimeError`` (H2D_REFUSED), also from page-locked memory;
- ``ndarray.get``, ``cupy.asnumpy``, ``float(x)``, ``x.item()`` (device to
  host) raise ``RuntimeError`` (D2H_REFUSED);
- synchronising a capturing stream, an event recorded in a capture, or the
  device raises ``CUDARuntimeError`` (cudaErrorStreamCaptureUnsupported).

And one rule of ours, stricter than CuPy (whose relaxed capture mode lets
its memory pool grow: modelled with ``HOUSE_RULE`` off, from the private
pool of ``CudaRuntime.capture_memory``): **no allocation during a capture**. A temporary
allocated while captured is freed when the Python object dies, the pool
hands it to the next allocation, and every replay of the graph keeps writing
it; so the ops write only into their planned outputs and scratch, and the
simulated device raises ALLOC_REFUSED for any allocation in a capture.

What a capture does allow is recorded, not run: a raw kernel launch (its
scalar arguments frozen at capture time, its arrays read at replay), an
elementwise operation into an existing array, a device-to-device copy,
cuBLAS through NVIDIA's own bindings (``nvmath.bindings.cublas``) on a
handle with a workspace of its own, a cuDNN frontend graph, and a
``cudaMemcpyAsync`` from page-locked host memory (which copies what the
buffer holds at replay time).

The simulated device calls ``device_work(fn, stream)`` for each piece of
device work. ``SimulatedRuntime.launch`` runs an op's host code at once, as
CUDA does, with the stream's ``recorder`` set: the device work is appended
to it, and becomes the node of a capture, or the work the stream runs when
the simulated device gets to it. So scalars are taken at launch (frozen in
a graph) and memory is read when the work runs.
"""
import contextlib
import itertools
import threading

CUBLAS_REFUSED = "calling cuBLAS API during stream capture is currently unsupported"
H2D_REFUSED = "the current stream is capturing, so H2D transfers are disallowed"
D2H_REFUSED = "the current stream is capturing, so D2H transfers are disallowed"
SYNC_REFUSED = ("cudaErrorStreamCaptureUnsupported: operation not permitted when stream "
                "is capturing")
ALLOC_REFUSED = ("allocation during a stream capture (the simulated device's rule: a "
                 "temporary freed after the capture is reused while replays still write it)")
PAGEABLE_REFUSED = ("cudaErrorStreamCaptureUnsupported: a cudaMemcpyAsync from pageable "
                    "host memory cannot be captured")


class CUDARuntimeError(RuntimeError):
    """Stands for ``cupy_backends.cuda.api.runtime.CUDARuntimeError``."""


_local = threading.local()
_streams = {}                  # ptr -> stream
_ptrs = itertools.count(0x1000)
_lock = threading.Lock()


class _DefaultStream:
    """CuPy's default (legacy NULL) stream on the emulated device: never captures."""

    key, ptr, capture, recorder = "default", 0, None, None

    def is_capturing(self):
        return False

    def synchronize(self):
        pass


DEFAULT_STREAM = _DefaultStream()


def register_stream(stream):
    """A fresh ``ptr`` (cudaStream_t) for a simulated stream."""
    with _lock:
        ptr = next(_ptrs)
        _streams[ptr] = stream
    return ptr


def stream_of(ptr):
    """The simulated stream whose ``ptr`` this is (None: the default stream)."""
    return _streams.get(int(ptr))


def current_stream():
    """CuPy's current stream on this thread (None: the default stream)."""
    return getattr(_local, "stream", None)


@contextlib.contextmanager
def current(stream):
    """``with stream:`` -- make ``stream`` current on this thread."""
    before = getattr(_local, "stream", None)
    _local.stream = stream
    try:
        yield stream
    finally:
        _local.stream = before


def push_allocator(allocator):
    """``cupy.cuda.using_allocator``: this thread's allocator from now on."""
    _local.allocators = getattr(_local, "allocators", []) + [allocator]


def pop_allocator():
    _local.allocators.pop()


def set_current(stream):
    """Make ``stream`` current on this thread (``Stream.__enter__``)."""
    _local.stream = stream


def is_capturing(stream=None):
    """Whether ``stream`` (default: the current stream) is capturing."""
    stream = current_stream() if stream is None else stream
    return stream is not None and getattr(stream, "capture", None) is not None


def any_capture_open():
    """Whether any simulated stream is capturing (a device-wide sync is refused)."""
    with _lock:
        streams = list(_streams.values())
    return any(getattr(s, "capture", None) is not None for s in streams)


def refuse_if_capturing(exc_type, message, stream=None):
    if is_capturing(stream):
        raise exc_type(message)


#: our rule, stricter than CuPy (see above): no allocation in a capture at
#: all. Off (a test), the stand-in does what CuPy 14.2 allows: in relaxed
#: capture mode an allocation comes from the thread's private pool
#: (``cupy.cuda.using_allocator(pool.malloc)``, ``CudaRuntime.capture_memory``)
HOUSE_RULE = {"no_capture_allocation": True}


def refuse_allocation(what, nbytes=0):
    """An allocation on the current stream while it captures: refused (our
    rule), or with the rule off taken from the private pool CuPy allocates
    from under ``using_allocator`` (refused without one)."""
    if not is_capturing():
        return
    allocators = getattr(_local, "allocators", [])
    if not HOUSE_RULE["no_capture_allocation"] and allocators and allocators[-1] is not None:
        allocators[-1](int(nbytes))   # the private pool's malloc: kept for the graph
        return
    raise RuntimeError(f"{ALLOC_REFUSED}: {what}")


def device_work(fn, stream=None):
    """Device work ``fn`` queued on ``stream`` (default: the current one):
    recorded into the launch whose host code runs on that stream now (the
    node of a capture, or work the stream runs later), else run at once."""
    stream = current_stream() if stream is None else stream
    recorder = getattr(stream, "recorder", None)
    if recorder is not None:
        recorder.append(fn)
        return
    if is_capturing(stream):
        raise RuntimeError(f"device work queued on the capturing stream {stream.key} outside "
                           "the launch being recorded there")
    fn()


def recording():
    """Whether this thread runs an op's host code whose device work is
    being recorded (the simulated runtime logs the op when that work runs)."""
    return getattr(current_stream(), "recorder", None) is not None
