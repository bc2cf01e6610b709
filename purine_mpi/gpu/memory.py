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

``own_peak()`` is the most in use at once beyond what was in use before the
tracker started, for a run that shares the process with earlier ones: the
bytes in use beyond the least in use seen just before an allocation so far.
What earlier runs hold only shrinks, and is never more than all in use, so
that least reading bounds it from above at every later moment: a lower
bound of the run's own peak, exact unless earlier memory is let go while
the run holds some of its own (then short by at most what it held at the
least reading). The plain ``peak() - in use at start`` understated a run
whose allocations reused bytes an earlier run let go while it ran (its
leftovers collected then) by all those bytes.

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
        #: {device: the least bytes in use seen just before an allocation (at
        #: first: what was in use when tracking began)}; {device: the most in
        #: use beyond that least}
        self._low, self._own = {}, {}
        self._previous = cupy.cuda.get_allocator()
        device = int(cupy.cuda.runtime.getDevice())
        self._peak[device] = self._low[device] = int(self._pool.used_bytes())   # in use already
        self._own[device] = 0
        cupy.cuda.set_allocator(self.malloc)

    def malloc(self, size):
        """The pool's ``malloc``, noting the bytes then in use on its device
        (the current one: the pool allocates there), and before it."""
        before = int(self._pool.used_bytes())
        memory = self._pool.malloc(size)
        used = int(self._pool.used_bytes())
        device = int(getattr(memory, "device_id", 0))
        with self._lock:
            if self._previous is not None:
                if used > self._peak.get(device, 0):
                    self._peak[device] = used
                low = self._low[device] = min(self._low.get(device, before), before)
                self._own[device] = max(self._own.get(device, 0), used - low)
        return memory

    def peak(self):
        """{device: the most bytes in use at once in the default pool}."""
        with self._lock:
            return dict(self._peak)

    def own_peak(self):
        """{device: the most bytes in use at once beyond what was in use
        before tracking began, or what of it was let go since (the module's
        docstring)}: the run's own peak, when earlier runs of the process
        still hold memory."""
        with self._lock:
            return dict(self._own)

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
