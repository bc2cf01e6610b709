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

- A 2-D product ``(M, K) @ (K, N)`` of fewer than ``SPLIT_MIN_WORK``
  multiply-adds is one ``np.matmul`` call, made before any other Python
  work (no plan, no thread count).
- A larger one is cut (``plan``) into at most ``MAX_PIECES`` pieces of at
  least ``PIECE_MIN_WORK`` multiply-adds (and ``INNER_MIN`` of K), their
  widths multiples of ``ALIGN``: along M when M is at least ``2 * ALIGN`` (the pieces' bits are
  the pieces' calls', which are not always one whole call's: a
  ``(640, 300) @ (300, 40)`` cut at rows 240 and 480 differs from one call
  in its last bits, so even one thread runs the cuts); else, for the
  short wide products of weight gradients (``dy (O, N*L) @ cols``), along
  K when K >= N: the first piece's product goes straight to out, each
  other's to a scratch matrix, and out adds them in their order (one
  thread: one scratch matrix, added as soon as it is made; several: one
  per piece after the first, added after the last; the same additions,
  so the same bits, which are also those of the stack summed by
  ``np.add.reduce`` that this replaced); else along N. Cutting N into
  narrow pieces ran such a product 1.5-1.9x slower on one thread;
  cutting K cost about nothing. The K cut's scratch is the calling
  thread's, kept and grown to the largest asked for (``_scratch``);
  ``plan`` counts it in the host scratch row from each kernel's
  ``host_scratch`` (``scratch_shape``, at ``planned_threads``).
- A batched product (``(B, ..., M, K) @ (..., K, N)``) is already one
  BLAS call per matrix in NumPy, so each matrix's bits are those of its own
  call however the batch is grouped: one thread makes it one ``np.matmul``
  call; several share its leading batch axis (a batch of 1 is its next
  axis, or a 2-D product, cut as above).

Cost at one thread against plain ``np.matmul`` (``benchmarks/hostgemm_cost.py``,
cifar10_quick's products; docs/running.md has the figures): whole
iterations, medians of runs on a loaded machine, 0.87x before the in-place
K sum and the one-call paths and 0.97x after, with runs of the same code
scattering by more than that. Fewer, larger pieces (``PIECE_MIN_WORK =
1 << 23``: 3 row pieces instead of 7) measured 0.95-0.96x, so the
constants stay.

The thread that calls ``matmul`` computes pieces too and takes back those
no pool thread has started; the pool's threads (``threads - 1`` of them,
started by the first product that needs them) never call ``matmul``
themselves, so concurrent callers (the dispatcher's lanes) cannot
deadlock. NumPy releases the GIL around BLAS. Other arrays (CuPy) go
straight to ``xp.matmul``.
"""
import contextlib
import queue
import threading
import weakref

import numpy as np

from ..base import threads as _threads
from .registry import spans

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
#: the ranks on this host ``planned_threads`` counts for (``planned_for``:
#: ``plan --np N``'s offline ranks); None: the launcher's (the environment's)
PLANNED_RANKS = None

#: the flat slot of this module's scratch in ``plan``'s Holds
#: (ops/im2col.gemm_holds; no im2col buffer has this name)
SCRATCH_SLOT = "hostgemm"

_LOCAL = threading.local()
#: every live thread's scratch cache (``held_bytes``), registered weakly
_ALL = weakref.WeakSet()
_ALL_LOCK = threading.Lock()


class ThreadCache(dict):
    """A thread's cache of reused arrays (a dict that a WeakSet can hold:
    by identity): this module's scratch, ops/im2col.py's buffers."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__


def threads():
    """The threads ``matmul`` uses: ``THREADS``, else the rank's decision."""
    if THREADS is not None:
        return max(1, int(THREADS))
    decision = _threads.DECISION or _threads.apply()
    return decision[0]


def one_thread():
    """Whether a host product runs on its calling thread alone: one thread
    here (``threads``) and BLAS held to one (base/threads.py ``BLAS_ONE``:
    not where the user set ``OPENBLAS_NUM_THREADS`` above 1, or NumPy loaded
    its BLAS first). Only then is the calling thread's CPU time the op's
    (runtime/executors.py records it as ``args.cpu_us``)."""
    return threads() == 1 and bool(_threads.BLAS_ONE)


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
                return axis, spans(size, width)
    return 0, [slice(0, m)]


def row_pieces(m, n, k, lo, hi):
    """The BLAS calls of rows ``lo..hi`` of a 2-D product (m, k) @ (k, n)
    that the whole product makes, as slices relative to ``lo``: ``plan``'s
    row pieces, when it cuts the whole along its rows and ``lo`` and ``hi``
    are bounds of its pieces; else None. A product of those rows alone
    (``matmul_rows``) is then the whole's calls on the same operands, so
    its bits are the whole's rows' at any thread count. Its own ``plan``
    could cut it elsewhere: a (100, 512) @ (512, 300) cut at row 96 runs
    a 4-row call, whose BLAS path (OpenBLAS's small-matrix kernels) rounds
    other than the same rows inside a 96-row call (1,096 of 30,000
    elements differ)."""
    if m * n * k < SPLIT_MIN_WORK:
        return None
    axis, cuts = plan(m, n, k)
    if axis != 0 or len(cuts) < 2:
        return None
    bounds = [s.start for s in cuts] + [m]
    if lo not in bounds or hi not in bounds or lo >= hi:
        return None
    return [slice(s.start - lo, s.stop - lo) for s in cuts if lo <= s.start and s.stop <= hi]


def matmul_rows(a, b, out, pieces):
    """``out[...] = a @ b`` of 2-D host arrays as one single-threaded BLAS
    call per row slice of ``pieces`` (``row_pieces``), on ``threads()``
    threads: no scratch."""
    jobs = [(a[s], b, out[s]) for s in pieces]
    count = threads()
    if count == 1 or len(jobs) == 1:
        for x, y, o in jobs:
            np.matmul(x, y, out=o)
    else:
        _run(jobs, count)
    return out


def matmul(xp, a, b, out=None):
    """``out[...] = a @ b`` (NumPy's matmul broadcasting), returns out: on
    the host cut as the module docstring says, its bits independent of the
    thread count."""
    if xp is not np or a.ndim < 2 or b.ndim < 2:  # CuPy; a vector: gemv or dot, one call
        return xp.matmul(a, b, out=out)
    if a.ndim == 2 and b.ndim == 2:
        if a.shape[0] * a.shape[1] * b.shape[1] < SPLIT_MIN_WORK:  # one call, as plan says
            return np.matmul(a, b, out=out)
        if out is None:
            out = np.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a, b))
        _product(a, b, out, threads())
        return out
    if out is None:
        shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
        out = np.empty(shape, dtype=np.result_type(a, b))
    count = threads()
    if out.shape[0] == 1:  # the matrices of the next axis, or one 2-D product
        matmul(np, _part(a, out, 0), _part(b, out, 0), out[0])
    elif count == 1:  # one BLAS call per matrix, as the parts below make them
        np.matmul(a, b, out=out)
    else:
        size = -(-out.shape[0] // count)
        _run([(_part(a, out, slice(s, s + size)), _part(b, out, slice(s, s + size)),
               out[s:s + size]) for s in range(0, out.shape[0], size)], count)
    return out


def _product(a, b, out, count):
    """A 2-D product of at least ``SPLIT_MIN_WORK`` cut by ``plan``, on
    ``count`` threads. A cut along K: the first piece's product goes to out
    (through a scratch array when out is a view BLAS cannot write), each
    other's to its own scratch matrix, and out adds them in their order; one
    thread adds each as soon as it is made (one scratch matrix, still in
    cache), several add them after the last: the same sums either way."""
    axis, cuts = plan(out.shape[0], out.shape[1], a.shape[1])
    if axis == 0:
        jobs = [(a[s], b, out[s]) for s in cuts]
    elif axis == 1:
        jobs = [(a, b[:, s], out[:, s]) for s in cuts]
    elif count == 1:
        first = out if _blasable(out) else _scratch(out.shape, out.dtype)
        np.matmul(a[:, cuts[0]], b[cuts[0]], out=first)
        if first is not out:
            out[...] = first
        part = first if first is not out else _scratch(out.shape, out.dtype)
        for s in cuts[1:]:
            np.matmul(a[:, s], b[s], out=part)
            np.add(out, part, out=out)
        return
    else:
        blas = _blasable(out)
        stack = _scratch((_kept(cuts, count, blas),) + out.shape, out.dtype)
        first, rest = (out, stack) if blas else (stack[0], stack[1:])
        _run([(a[:, cuts[0]], b[cuts[0]], first)]
             + [(a[:, s], b[s], part) for s, part in zip(cuts[1:], rest)], count)
        if first is not out:
            out[...] = first
        for part in rest:
            np.add(out, part, out=out)
        return
    if count == 1 or len(jobs) == 1:
        for x, y, o in jobs:
            np.matmul(x, y, out=o)
    else:
        _run(jobs, count)


def _kept(cuts, count, blasable):
    """The (M, N) matrices of ``_scratch`` a cut along K into ``cuts`` takes
    on ``count`` threads: one thread one (each piece's product in turn, or
    the first's when out is a view BLAS cannot write); several one per
    piece after the first, and the first's too when out is such a view."""
    return 1 if count == 1 else len(cuts) - (1 if blasable else 0)


def scratch_shape(a_shape, b_shape, count, blasable=True):
    """The shape of the array ``matmul(np, a, b, out)`` takes from this
    thread's scratch (``_scratch``) for ``a`` and ``b`` of these shapes on
    ``count`` threads (``blasable``: out a C-contiguous array, or a view
    BLAS writes as it is), None when it takes none: a 2-D product cut along
    K (``plan``), alone or as the one matrix of a batch of 1 (``matmul``'s
    leading axis of 1). ``plan``'s host scratch row counts it per dispatcher
    lane, at its largest (ops/im2col.gemm_holds), as ``_scratch`` keeps it."""
    a_shape, b_shape = tuple(int(d) for d in a_shape), tuple(int(d) for d in b_shape)
    if len(a_shape) < 2 or len(b_shape) < 2:
        return None
    if len(a_shape) == 2 and len(b_shape) == 2:
        (m, k), n = a_shape, b_shape[1]
        if m * k * n < SPLIT_MIN_WORK:
            return None
        axis, cuts = plan(m, n, k)
        if axis != 2:
            return None
        count = max(1, int(count))
        return (m, n) if count == 1 else (_kept(cuts, count, blasable), m, n)
    ndim = len(np.broadcast_shapes(a_shape[:-2], b_shape[:-2])) + 2
    if np.broadcast_shapes(a_shape[:-2], b_shape[:-2])[0] != 1:
        return None   # one np.matmul, or its batch shared out: a BLAS call per matrix
    return scratch_shape(*(s if len(s) < ndim else s[1:] for s in (a_shape, b_shape)),
                         count, blasable)


def planned_threads():
    """The thread count ``plan`` counts the scratch for: ``THREADS`` when
    set, else the most the run may pick (base/threads.most: the user's
    count, else the usable cores over this host's ranks, which the load at
    the run's start-up can only lower; the ranks those of ``PLANNED_RANKS``
    when set). Only whether it is 1 changes the bytes (``_kept``): one
    matrix, else one per piece after the first; the most is the larger."""
    if THREADS is not None:
        return max(1, int(THREADS))
    return _threads.most(local_ranks=PLANNED_RANKS)


@contextlib.contextmanager
def planned_for(local_ranks):
    """``planned_threads`` counts for ``local_ranks`` ranks on this host
    (``PLANNED_RANKS``) inside the block: ``plan --np N`` run outside
    mpiexec builds each rank as one of the ranks of its node, with the
    threads the run's ``base/threads.decide`` gives each of them there, not
    as one process that has the host to itself."""
    global PLANNED_RANKS
    before, PLANNED_RANKS = PLANNED_RANKS, local_ranks
    try:
        yield
    finally:
        PLANNED_RANKS = before


def _blasable(o):
    """Whether NumPy's matmul hands the 2-D ``o`` to BLAS as it is (rows of
    unit-stride elements), as it does a fresh array."""
    item = o.itemsize
    return o.strides[1] == item and o.strides[0] % item == 0 and o.strides[0] >= o.shape[1] * item


def _scratch(shape, dtype):
    """This thread's reused array of ``shape`` (the front of a flat buffer
    that grows to the largest asked for; content undefined)."""
    size = int(np.prod(shape))
    cache = getattr(_LOCAL, "flat", None)
    if cache is None:
        cache = _LOCAL.flat = ThreadCache()
        with _ALL_LOCK:
            _ALL.add(cache)
    key = np.dtype(dtype).str
    flat = cache.get(key)
    if flat is None or flat.size < size:
        flat = cache[key] = np.empty(size, dtype=dtype)
    return flat[:size].reshape(shape)


def held_bytes():
    """Bytes of every live thread's scratch (``_scratch``: a K-cut product's
    pieces) held now: in ``plan``'s host scratch row, each kernel's products
    stated by its ``host_scratch`` (``scratch_shape``, at
    ``planned_threads``)."""
    with _ALL_LOCK:
        caches = list(_ALL)
    return sum(a.nbytes for c in caches for a in list(c.values()))


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
        # the operands and the result go with the product: a worker holds
        # its last task while it waits for the next, and a task the caller
        # took back stays in the queue until a worker drops it (a chunked
        # 1x1 ConvGradWeight's product stayed alive through the next
        # chunk's: 1 MiB above the temporaries plan counts, with 2 threads)
        self.job = None
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
