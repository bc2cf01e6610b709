"""``SimulatedRuntime``: the project's own ``CudaRuntime`` on the emulated
device, plus what the stand-in ``cupy`` cannot express:

- the log of what the dispatcher asked for (``calls``) and of the op whose
  device work runs (``log``, in the device's order);
- the device's knobs: the seed of its interleaving, how many steps a poll
  lets it make (``poll_steps``: a real GPU progresses on its own while the
  host polls; the emulated one only when asked), polls that see no
  progress (``stalled_polls``);
- ``faithful=False``: a graph on plain host arrays (no emulated CuPy), whose
  kernels are queued whole (the host code runs when the stream gets to it).

Every CUDA call itself (streams, events, capture, replay, device sync, the
cuBLAS handles before a capture, the capture's memory pool) is
``CudaRuntime``'s, made on the stand-in ``cupy.cuda``.
"""
import sys
import types

from purine_mpi.gpu.streams import StreamPool
from purine_mpi.runtime.cuda_runtime import CudaRuntime

from . import capture
from .arrays import NoDevice
from .device import EmulatedDevice, SimEvent, SimStream, set_active_device


def cuda_namespace(namespace=None):
    """Fill ``namespace`` (a stand-in ``cupy.cuda``) with the simulated
    device's ``Stream``, ``Event``, ``Device``, ``get_elapsed_time``,
    ``get_current_stream``, ``MemoryPool`` and ``using_allocator``."""
    from .device import active_device
    cuda = namespace if namespace is not None else types.SimpleNamespace()
    cuda.Stream = SimStream
    cuda.Event = SimEvent
    cuda.Device = NoDevice
    cuda.get_elapsed_time = lambda start, end: (end.time - start.time) * 1e3
    cuda.get_current_stream = lambda: (capture.current_stream()
                                       or active_device().null_stream())
    cuda.MemoryPool = MemoryPool
    cuda.using_allocator = using_allocator
    return cuda


class MemoryPool:
    """``cupy.cuda.MemoryPool``: a private pool (what a capture's temporaries
    come from under CuPy's relaxed capture mode)."""

    def __init__(self, allocator=None):
        self.blocks = []

    def malloc(self, nbytes):
        self.blocks.append(nbytes)
        return nbytes

    def used_bytes(self):
        return sum(self.blocks)

    def total_bytes(self):
        return sum(self.blocks)


class using_allocator:  # noqa: N801  (CuPy's name)
    """``cupy.cuda.using_allocator(malloc)``: the allocator of this thread
    while the block runs."""

    def __init__(self, allocator=None):
        self.allocator = allocator

    def __enter__(self):
        capture.push_allocator(self.allocator)
        return self

    def __exit__(self, *exc):
        capture.pop_allocator()
        return False


class SimulatedRuntime(CudaRuntime):
    """``CudaRuntime`` on a fresh simulated device, or on ``device`` (an
    ``EmulatedDevice`` another runtime made: one GPU that several
    dispatchers of a process share, as a trainer's training and test
    graphs do); made the active one. Its streams must live on that device:
    the stand-in ``cupy.cuda.Stream`` makes a stream on the device active
    when it is made, and a stream on another device would not run when
    this runtime synchronises (``stream`` refuses it)."""

    def __init__(self, seed=0, poll_steps=(0, 3), stalled_polls=0, faithful=None,
                 device=None):
        faithful = getattr(sys.modules.get("cupy"), "_emulated", False) \
            if faithful is None else faithful
        self.device = device if device is not None else EmulatedDevice(seed, faithful)
        set_active_device(self.device)
        super().__init__()
        if not faithful:   # (an empty pool is falsy: set here, not passed)
            self.pool = _HostStreams(self.device)
        if not faithful:   # no emulated CuPy: the device's own cupy.cuda
            self._cupy = types.SimpleNamespace(cuda=cuda_namespace())
        self.faithful = faithful
        self.device_arrays = faithful   # without the emulated CuPy: NumPy arrays
        self.poll_steps = poll_steps
        self.stalled_polls = stalled_polls
        self.rng = self.device.rng
        self.calls = self.device.calls
        self.log = self.device.log
        self.graphs = self.device.graphs

    @property
    def lock(self):
        return self.device.lock

    @property
    def streams(self):
        return {s.key: s for s in self.device.streams}

    def stream(self, device, thread):
        stream = super().stream(device, thread)
        if stream.device is not self.device:
            raise RuntimeError(
                f"stream {(device, thread)} was made on another simulated device than "
                "its runtime's (a second SimulatedRuntime made the active device in "
                "between): give the runtimes of one GPU one device (device=)")
        stream.key = (device, thread)
        return stream

    def launch(self, device, stream, fn, name=None):
        self.calls.append(("capture_launch", stream.key, name) if stream.capture is not None
                          else ("launch", stream.key))
        if not self.faithful:  # host arrays: the kernel runs when the stream gets to it
            return stream.submit(fn, name)   # log_kernels logs it when it runs
        stream.launch_name = name
        try:
            return super().launch(device, stream, fn, name)
        finally:
            stream.launch_name = None

    def call(self, device, stream, fn):
        self.calls.append(("call", stream.key))
        return super().call(device, stream, fn)

    def record(self, device, stream, timing=False):
        event = super().record(device, stream, timing)
        self.calls.append(("capture_record", stream.key, event) if event.capture is not None
                          else ("record", stream.key, event))
        return event

    def wait(self, stream, event):
        captured = event.capture is not None
        super().wait(stream, event)
        self.calls.append(("capture_wait" if captured else "wait", stream.key, event))

    def query(self, event):
        steps = self.rng.randint(*self.poll_steps)
        if self.stalled_polls > 0:
            self.stalled_polls -= 1
            steps = 0
        if event.capture is None:
            for _ in range(steps):
                if not self.device.step(strict=False):
                    break
        done = super().query(event)
        self.calls.append(("query", event, done))
        return done

    def sync_event(self, event):
        self.calls.append(("sync_event", event))
        super().sync_event(event)

    def sync_devices(self, devices):
        self.calls.append(("sync_devices",))
        super().sync_devices(devices)

    def sync_stream(self, stream):
        """``stream.synchronize()``: until its queued work has run."""
        stream.synchronize()

    def sync_streams(self):
        self.calls.append(("sync_streams",))
        self.device.synchronize()

    def host_write(self, devices, fn):
        self.calls.append(("host_write",))
        super().host_write(devices, fn)

    def prepare_capture(self, device, streams, **scope):
        if self.faithful:  # host arrays make no products through cuBLAS
            super().prepare_capture(device, streams, **scope)

    def launch_graph(self, device, graph, stream):
        super().launch_graph(device, graph, stream)
        self.calls.append(("launch_graph", stream.key, graph))

    def elapsed_ms(self, start, end):
        return (end.time - start.time) * 1e3


class _HostStreams(StreamPool):
    """The stream pool of a runtime on plain host arrays (no emulated CuPy
    to make its streams through)."""

    def __init__(self, device):
        super().__init__()
        self._device = device

    def get(self, device, thread=0):
        key = (int(device), thread)
        with self._lock:
            if key not in self._streams:
                self._streams[key] = SimStream(device=self._device, key=key)
            return self._streams[key]

    def synchronize(self):
        self._device.drain()
