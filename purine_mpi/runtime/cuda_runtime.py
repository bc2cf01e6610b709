"""The CUDA calls of the stream executors, on top of CuPy (``CudaRuntime``),
the asynchronous host<->device ``Copy`` kernel they swap in, and which
stream an op runs on (``stream_keys``, ``with_stream_threads``). Everything
the dispatchers do to a device goes through a runtime object, so their event
bookkeeping and capture logic are tested against a simulated device
(tests/emulated_gpu ``SimulatedRuntime``). CuPy is imported on first
use; imports: NumPy, ``gpu`` (the loader, streams, cuBLAS), ``ops.registry``.
"""
import dataclasses

import numpy as np

from ..base.errors import GraphError
from ..graph.core import Graph
from ..ops.catalog import get_kernel_class
from ..ops.registry import OpKernel

#: the stream a device's communication ops queue their device work on
COMM_STREAM = "comm"


def op_device(graph, op):
    """The GPU an op runs on: its location's device, else the device its
    blobs live on (-1: a host op). An op touching two GPUs is an error."""
    if op.location.device is not None and op.location.device >= 0:
        return op.location.device
    devices = {graph.blobs[graph.storage_root(b)].location.device for b in op.inputs + op.outputs}
    devices = sorted(d for d in devices if d is not None and d >= 0)
    if len(devices) > 1:
        raise GraphError(f"op '{op.name}' ({op.op_type}) reads or writes blobs on GPUs "
                         f"{devices}; an op runs on one device: insert a Copy between them")
    return devices[0] if devices else -1


def stream_thread_name(device, thread):
    """The worker-thread (and trace ``tid``) name of a GPU stream."""
    return f"gpu{device}:{thread}"


def stream_keys(graph):
    """{op name: its stream (device, thread), or None for a host op}: a
    device's comm ops queue their device work on its ``comm`` stream."""
    keys = {}
    for op in graph.ops.values():
        device = op_device(graph, op)
        if device < 0:
            keys[op.name] = None
        elif get_kernel_class(op.op_type, op.name).category == "comm":
            keys[op.name] = (device, COMM_STREAM)
        else:
            keys[op.name] = (device, op.thread)
    return keys


def with_stream_threads(graph, keys):
    """A view of ``graph`` whose GPU compute ops carry their stream's name
    as ``thread`` (one host worker per stream); blobs are shared."""
    g = Graph(graph.name)
    g.blobs = graph.blobs
    for name, op in graph.ops.items():
        key = keys[name]
        if key is not None and key[1] != COMM_STREAM:
            op = dataclasses.replace(op, thread=stream_thread_name(*key))
        g.ops[name] = op
    return g


class CudaRuntime:
    """The CUDA calls the stream dispatcher makes, on top of CuPy.

    ``launch``/``call`` run ``fn`` on the host with ``stream`` as CuPy's
    current stream (so the CuPy work in it is queued there); ``launch`` is
    for op kernels, ``call`` for host work that may queue device work (comm
    ops). Events record the work queued so far on a stream."""

    #: whether the kernels hold CuPy arrays for device blobs (a simulated
    #: device of the tests hands them NumPy arrays: False), what
    #: ``segments.capture_blocker`` tells the kernels' ``capturable_on``
    device_arrays = True

    def __init__(self, pool=None):
        from ..gpu.streams import StreamPool
        self.pool = pool or StreamPool()
        self._cupy = None

    @property
    def cupy(self):
        if self._cupy is None:
            from ..gpu import import_cupy
            self._cupy = import_cupy()
        return self._cupy

    def stream(self, device, thread):
        return self.pool.get(device, thread)

    def launch(self, device, stream, fn, name=None):
        """Queue op ``name``'s kernels (``fn``) on ``stream``."""
        with self.cupy.cuda.Device(device), stream:
            return fn()

    def call(self, device, stream, fn):
        """Run host work ``fn`` that may queue device work on ``stream``."""
        with self.cupy.cuda.Device(device), stream:
            return fn()

    def record(self, device, stream, timing=False):
        cuda = self.cupy.cuda
        with cuda.Device(device):
            event = cuda.Event(disable_timing=not timing)
            event.record(stream)
        return event

    def wait(self, stream, event):
        stream.wait_event(event)

    def query(self, event):
        return bool(event.done)

    def sync_event(self, event):
        event.synchronize()

    def sync_devices(self, devices):
        for d in devices:
            self.cupy.cuda.Device(d).synchronize()

    def sync_streams(self):
        self.pool.synchronize()

    def elapsed_ms(self, start, end):
        return self.cupy.cuda.get_elapsed_time(start, end)

    def swaps_copies(self):
        """Host<->device Copy ops use the asynchronous pinned-memory path."""
        return True

    def host_write(self, devices, fn):
        """Run ``fn`` (host writes into device arrays, queued by CuPy on the
        default stream) with ``devices`` idle before and after."""
        self.sync_devices(devices)
        fn()
        self.sync_devices(devices)

    def prepare_capture(self, device, streams, scope=None):
        """Before a capture on ``streams`` of a graph that will replay on
        stream ``scope``: what the captured work needs that must not be
        created inside it (a cuBLAS handle and workspace for each stream,
        ``gpu/blas.reserve``, those of ``scope``: see ``capture_scope``)."""
        from ..gpu import blas
        with self.cupy.cuda.Device(device), blas.workspace_scope(scope):
            for stream in streams:
                blas.reserve(stream)

    def capture_scope(self, scope):
        """A context manager for the launches of a capture whose graph
        replays on stream ``scope``: its products use that scope's cuBLAS
        workspaces, so graphs replaying at once on different streams never
        share one (``gpu/blas.workspace_scope``)."""
        from ..gpu import blas
        return blas.workspace_scope(scope)

    # ------------------------------------------------ stream capture (CUDA graphs)
    # CuPy's API (cupy/cuda/stream.pyx, graph.pyx): ``Stream.begin_capture(mode)``
    # (default relaxed mode, which lets the memory pool grow by cudaMalloc
    # during a capture), ``Stream.end_capture() -> cupy.cuda.Graph`` (already
    # instantiated), ``Graph.launch(stream)``. Another stream joins a capture by
    # waiting on an event recorded on a capturing stream, and must be joined
    # back into the origin stream before ``end_capture``.

    def begin_capture(self, device, stream):
        with self.cupy.cuda.Device(device):
            stream.begin_capture()

    def end_capture(self, device, stream):
        with self.cupy.cuda.Device(device):
            return stream.end_capture()

    def abort_capture(self, device, stream):
        """Leave capture mode after a failed capture (its graph is dropped),
        so that ``stream`` can run the segment eagerly. Any CUDA error
        inside a capture *invalidates* it: ``is_capturing`` then raises
        (CuPy's ``streamIsCapturing``), yet the capture stays open on its
        streams until ``cudaStreamEndCapture`` ends it, which reports the
        invalidation as an error of its own. So the capture is ended unless
        the stream says plainly that it is not capturing, and the error of
        ending an invalidated capture is the expected one."""
        with self.cupy.cuda.Device(device):
            try:
                capturing = stream.is_capturing()
            except Exception:  # cudaErrorStreamCaptureInvalidated: still to be ended
                capturing = True
            if capturing:
                try:
                    stream.end_capture()
                except Exception:  # ending an invalidated capture raises; it has ended
                    pass

    def launch_graph(self, device, graph, stream):
        with self.cupy.cuda.Device(device):
            graph.launch(stream)

    def capture_memory(self, device):
        """A context manager under which CuPy allocates from a memory pool of
        its own, and that pool: what kernels allocate while they are captured
        (temporaries) stays reserved for the graph's replays, so no other work
        ever reuses it; keep the pool as long as the graph."""
        cuda = self.cupy.cuda
        with cuda.Device(device):
            pool = cuda.MemoryPool()
        return cuda.using_allocator(pool.malloc), pool


class HostDeviceCopy(OpKernel):
    """``Copy`` between host and device memory on the current stream.
    Swapped in by the stream dispatcher for Copy ops that cross sides.

    Host to device, same dtype, both contiguous: one ``cudaMemcpyAsync``
    (``gpu/streams.copy_to_device_async``): truly asynchronous from pinned
    memory, and capturable into a CUDA graph from pinned memory (it copies
    what the buffer holds at each replay). Not CuPy's ``ndarray.set``,
    which CuPy refuses inside any capture. With a dtype conversion or a
    strided side, CuPy's own copy (not capturable: ``capture_blocker`` says
    so). Device to host, the same: one ``cudaMemcpyAsync``
    (``copy_to_host_async``) queued on the copy's stream, which waits for the
    producer's event; the host op that reads the copy synchronises on the
    event recorded after it (streams_dispatcher.py), so it reads this
    iteration's value. (CuPy's blocking ``get`` read, on the simulated
    device, the memory as it was when the copy was launched: fp16's
    overflow flag one iteration late.) With a conversion or a strided side,
    ``cupy.asnumpy``."""

    op_type = "Copy"
    category = "copy"
    #: host -> device copies go through cudaMemcpyAsync (segments.capture_blocker)
    async_copy = True

    @classmethod
    def infer(cls, attrs, ins):
        return [ins[0]]

    def run(self, ins, outs):
        from ..gpu import import_cupy
        from ..gpu.streams import copy_to_device_async, copy_to_host_async
        cupy = import_cupy()
        src, dst = ins[0], outs[0]
        stream = cupy.cuda.get_current_stream()
        direct = src.flags.c_contiguous and dst.flags.c_contiguous and src.dtype == dst.dtype
        if isinstance(dst, cupy.ndarray):  # host -> device
            if direct:
                copy_to_device_async(dst, np.asarray(src))
            else:
                dst[...] = cupy.asarray(np.asarray(src, dtype=dst.dtype))
        elif direct:  # device -> host: queued after the producers' events; the
            # host op reading dst waits for the event recorded after it
            copy_to_host_async(dst, src)
        else:
            dst[...] = cupy.asnumpy(src, stream=stream)
