"""Host matrix products whose bits do not depend on the thread count.

OpenBLAS's threaded GEMM hands each thread a part of the output, and which
micro-kernel (the full tiles or the edge ones, which round differently)
computes an element depends on where those parts start: the same product
gives other bits with 2 threads than with 1 (NumPy's OpenBLAS 0.3.31,
Haswell kernels: ``(512, 144) @ (144, 32)`` differs in 2,756 of 16,384
elements; ``benchmarks/thread_bits.py`` runs every op). So BLAS runs one
thread (``base/threads.py`` exports ``OPENBLAS_NUM_THREADS=1``) and the
rank's threads (``PURINE_THREADS``) are this module's: ``matmul`` cuts a
product into pieces that depend on the shapes only, each piece one
single-threaded BLAS call, and runs them on its pool. Any number of threads
then gives the bits one thread gives.

- A 2-D product ``(M, K) @ (K, N)`` of at least ``SPLIT_MIN_WORK``
  multiply-adds is cut (``plan``) into at most ``MAX_PIECES`` pieces of at
  least ``PIECE_MIN_WORK`` multiply-adds (and ``INNER_MIN`` of K), their
  widths multiples of ``ALIGN``: along M when M is at least ``2 * ALIGN`` (the pieces' bits are
  the pieces' calls', which are not always one whole call's: a
  ``(640, 300) @ (300, 40)`` cut at rows 240 and 480 differs from one call
  in its last bits, so even one thread runs the cuts); else, for the
  short wide products of weight gradients (``dy (O, N*L) @ cols``), along
  K when K >= N: each piece's product goes to a scratch stack and the
  stack is summed in its order (``np.add.reduce`` over its first axis adds
  the pieces one after the other); else along N. Cutting N into narrow
  pieces ran such a product 1.5-1.9x slower on one thread; cutting K cost
  about nothing. A smaller product is one call.
- A batched product (``(B, ..., M, K) @ (..., K, N)``) is already one
  BLAS call per matrix in NumPy, so its leading batch axis is shared among
  the threads: each matrix's bits are those of its own call however the
  batch is grouped (a batch of 1 is its next axis, or a 2-D product).

The thread that calls ``matmul`` computes pieces too and takes back those
no pool thread has started; the pool's threads (``threads - 1`` of them,
started by the first product that needs them) never call ``matmul``
themselves, so concurrent callers (the dispatcher's lanes) cannot
deadlock. NumPy releases the GIL around BLAS. Other arrays (CuPy) go
straight to ``xp.matmul``.
"""
import queue
import threading

import numpy as np

from ..base import threads as _threads

#: products below this many multiply-adds are one BLAS call
SPLIT_MIN_WORK = 1 << 22
#: the least multiply-adds of one piece
PIECE_MIN_WORK = 1 << 21
#: the least inner size of one piece of a cut along K (each piece writes
#: and the sum reads an (M, N) partial product)
INNER_MIN = 512
#: the most pieces one 2-D product is cut into
MAX_PIECES = 8
#: piece widths are multiples of this (the kernels' tile sizes divide it)
ALIGN = 48
#: the rank's compute threads for ``matmul``; None: ``base/threads.py``'s
#: decision (tests set it)
THREADS = None

_LOCAL = threading.local()


def threads():
    """The threads ``matmul`` uses: ``THREADS``, else the rank's decision."""
    if THREADS is not None:
        return max(1, int(THREADS))
    decision = _threads.DECISION or _threads.apply()
    return decision[0]


def plan(m, n, k):
    """(axis, [slices]) of a 2-D product (m, k) @ (k, n): the side it is cut
    along (0: the rows m, 1: the columns n, 2: the inner size k) and the
    pieces; one slice of the rows when it is not cut. Shapes only: the rows
    when there are ``2 * ALIGN``, else K when K >= N, else (or when K is too
    short to cut) the columns."""
    work = m * n * k
    if work >= SPLIT_MIN_WORK:
        sides = [(0, m)] if m >= 2 * ALIGN else [(2, k), (1, n)] if k >= n else [(1, n)]
        for axis, size in sides:
            count = min(MAX_PIECES, work // PIECE_MIN_WORK,
                        size // (INNER_MIN if axis == 2 else ALIGN))
            if count >= 2:
                width = -(-size // count)
                width = -(-width // ALIGN) * ALIGN
                return axis, [slice(s, min(s + width, size)) for s in range(0, size, width)]
    return 0, [slice(0, m)]


def matmul(xp, a, b, out=None):
    """``out[...] = a @ b`` (NumPy's matmul broadcasting), returns out: on
    the host cut as the module docstring says, its bits independent of the
    thread count."""
    if xp is not np or a.ndim < 2 or b.ndim < 2:  # CuPy; a vector: gemv or dot, one call
        return xp.matmul(a, b, out=out)
    if out is None:
        shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
        out = np.empty(shape, dtype=np.result_type(a, b))
    count = threads()
    jobs, stack, target = _jobs(a, b, out, count)
    if count == 1 or len(jobs) == 1:
        for x, y, o in jobs:
            np.matmul(x, y, out=o)
    else:
        _run(jobs, count)
    if stack is not None:  # the inner size's pieces, added in their order
        np.add.reduce(stack, axis=0, out=target)
    return out


def _jobs(a, b, out, count):
    """([(a part, b part, out part)], stack, target): a 2-D product cut by
    ``plan`` (``stack``: where the pieces of an inner-size cut go, else
    None; ``target``: the 2-D array they add up into); a batched one's
    leading batch axis in ``count`` consecutive parts."""
    if out.ndim == 2:
        axis, cuts = plan(out.shape[0], out.shape[1], a.shape[-1])
        if axis == 0:
            return [(a[s], b, out[s]) for s in cuts], None, out
        if axis == 1:
            return [(a, b[:, s], out[:, s]) for s in cuts], None, out
        stack = _scratch((len(cuts),) + out.shape, out.dtype)
        return [(a[:, s], b[s], stack[i]) for i, s in enumerate(cuts)], stack, out
    batch = out.shape[0]
    if batch == 1:  # the matrices of the next axis, or one 2-D product
        return _jobs(_part(a, out, 0), _part(b, out, 0), out[0], count)
    size = -(-batch // count)
    return [(_part(a, out, slice(s, s + size)), _part(b, out, slice(s, s + size)),
             out[s:s + size]) for s in range(0, batch, size)], None, out


def _scratch(shape, dtype):
    """This thread's reused array of ``shape`` (the front of a flat buffer
    that grows to the largest asked for; content undefined)."""
    size = int(np.prod(shape))
    cache = getattr(_LOCAL, "flat", None)
    if cache is None:
        cache = _LOCAL.flat = {}
    key = np.dtype(dtype).str
    flat = cache.get(key)
    if flat is None or flat.size < size:
        flat = cache[key] = np.empty(size, dtype=dtype)
    return flat[:size].reshape(shape)


def _part(x, out, index):
    """x's part for out[index] (an int or a slice of out's leading axis):
    indexed where x has that axis, as it is where x broadcasts along it."""
    if x.ndim < out.ndim:
        return x
    if x.shape[0] == 1:
        return x[0] if isinstance(index, int) else x
    return x[index]


class _Task:
    """One part of a product: claimed by whichever thread starts it first."""

    __slots__ = ("job", "claimed", "done", "error")

    def __init__(self, job):
        self.job = job
        self.claimed = False
        self.done = threading.Event()
        self.error = None

    def claim(self):
        with _LOCK:
            if self.claimed:
                return False
            self.claimed = True
            return True

    def run(self):
        try:
            x, y, o = self.job
            np.matmul(x, y, out=o)
        except BaseException as exc:  # raised by the caller
            self.error = exc
        self.done.set()


_LOCK = threading.Lock()
_QUEUE = queue.SimpleQueue()
_WORKERS = []


def _worker():
    while True:
        task = _QUEUE.get()
        if task.claim():
            task.run()


def _run(jobs, count):
    """Runs the jobs on this thread and the pool (``count`` threads in all);
    this thread takes back the parts no worker has started, so a busy pool
    (another lane's product) only costs parallelism. The first error is
    raised here."""
    with _LOCK:
        while len(_WORKERS) < count - 1:
            w = threading.Thread(target=_worker, daemon=True,
                                 name=f"purine-gemm-{len(_WORKERS)}")
            _WORKERS.append(w)
            w.start()
    tasks = [_Task(j) for j in jobs]
    for t in tasks[1:]:
        _QUEUE.put(t)
    for t in tasks:
        if t.claim():
            t.run()
    for t in tasks:
        t.done.wait()
        if t.error is not None:
            raise t.error
