"""Peak device memory: the most bytes in use at once in CuPy's memory pool.

CuPy's pool keeps what it once allocated (``total_bytes``), which says how
much the process holds, not how much it used at once. ``PeakMemory`` puts an
allocator in front of the default pool (``cupy.cuda.set_allocator``) that,
after each allocation, reads the pool's bytes in use on that device; the
largest reading is the peak, since memory in use only grows at an
allocation. This is what PyTorch's ``torch.cuda.max_memory_allocated``
measures for its caching allocator, so the two compare (benchmarks/
gpu_throughput.py). Memory that a CUDA graph capture takes from a private
pool (runtime/cuda_graph.py) bypasses the default allocator: the caller adds
what those pools hold (``capture_report()["capture_pool_bytes"]``).

Each allocation then passes through one Python call: nothing in a steady
iteration allocates (docs/gpu.md), so only set-up pays for it. ``close()``
puts the previous allocator back.

Layer: gpu (imports: nothing at import time; CuPy is handed in).
"""
import threading


class PeakMemory:
    """Track the peak of the bytes in use in ``cupy``'s default memory pool
    per device, from now until ``close()``; ``peak()`` -> {device: bytes}."""

    def __init__(self, cupy):
        self._cupy = cupy
        self._pool = cupy.get_default_memory_pool()
        self._lock = threading.Lock()
        self._peak = {}
        self._previous = cupy.cuda.get_allocator()
        device = int(cupy.cuda.runtime.getDevice())
        self._peak[device] = int(self._pool.used_bytes())   # what is in use already
        cupy.cuda.set_allocator(self.malloc)

    def malloc(self, size):
        """The pool's ``malloc``, noting the bytes then in use on its device
        (the current one: the pool allocates there)."""
        memory = self._pool.malloc(size)
        used = int(self._pool.used_bytes())
        device = int(getattr(memory, "device_id", 0))
        with self._lock:
            if self._previous is not None and used > self._peak.get(device, 0):
                self._peak[device] = used
        return memory

    def peak(self):
        """{device: the most bytes in use at once in the default pool}."""
        with self._lock:
            return dict(self._peak)

    def close(self):
        """Give the allocator back (to what it was before)."""
        if self._previous is not None:
            self._cupy.cuda.set_allocator(self._previous)
            self._previous = None


def start_peak_memory(cupy):
    """A :class:`PeakMemory` on ``cupy``, or None when this CuPy cannot swap
    its allocator (``cupy.cuda.set_allocator`` / ``get_allocator`` missing)."""
    cuda = getattr(cupy, "cuda", None)
    if not (hasattr(cuda, "set_allocator") and hasattr(cuda, "get_allocator")):
        return None
    return PeakMemory(cupy)
