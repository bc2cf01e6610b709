"""This process's resident memory (Linux): ``rss_bytes`` now
(/proc/self/statm's resident pages), ``peak_rss_bytes`` its high-water mark
(/proc/self/status's ``VmHWM``; getrusage's ``ru_maxrss`` only where /proc
is missing, as it survives execve). ``train`` reads the first after MPI's
initialisation and ``preload_deferred_imports``, before any graph is built
(the baseline), and the second at the end of the run: the difference is
what ``plan``'s host total predicts (docs/running.md, "Will it fit?")."""
import importlib
import os
import resource
import sys

#: the libraries a run imports only when it first needs them (h5py: the data
#: files and checkpoints; numpy.random: the data order, initialisers and
#: dropout, with its extension modules and ``secrets``; numpy.ma), imported
#: before the baseline so that their code and module objects are part of it
#: whichever job runs: they are not bytes ``plan`` counts
DEFERRED_IMPORTS = ("h5py", "numpy.random", "numpy.ma")


def preload_deferred_imports():
    """Import ``DEFERRED_IMPORTS`` (``train``, before its baseline)."""
    for name in DEFERRED_IMPORTS:
        importlib.import_module(name)


def warm_up_libraries():
    """Run, once, on a few KiB, the library code a run executes whatever its
    job (``train``, before its baseline, after ``preload_deferred_imports``):
    the pages of code a process first executes are resident from then on,
    file pages shared with every process that maps the library, not bytes
    ``plan`` counts; run here they are in the baseline, not above it
    (docs/running.md, "Will it fit?"). What runs: NumPy's float32 and
    float64 elementwise loops, reductions, casts, copies and indexing; a
    float32 matrix product (OpenBLAS's sgemm); numpy.random's Generator
    (the data order, the fillers, dropout's draws); libyaml's emitter (the
    run's config text); and an HDF5 file in memory, written and read back
    (h5py: data files and checkpoints). Each array is freed on return, the
    largest 64 KiB, below glibc's mmap threshold; HDF5 frees a larger block
    of its own when the file closes, which raises glibc's dynamic threshold
    (here to between 512 KiB and 1 MiB: a 512 KiB array then comes from the
    heap), as a run's first HDF5 file does (a text split, a checkpoint) and
    its first freed temporary of that size. Returns nothing; an error of a
    library here is raised (the run would meet it anyway)."""
    import numpy as np
    n = 4096
    for dtype in (np.float32, np.float64):
        a = np.linspace(-2, 2, n, dtype=dtype)
        b = np.linspace(1, 3, n, dtype=dtype)
        c = np.empty_like(a)
        for f in (np.add, np.subtract, np.multiply, np.divide, np.maximum, np.minimum,
                  np.power, np.greater, np.less, np.equal):
            f(b, a, out=np.empty(n, np.bool_) if f in (np.greater, np.less, np.equal) else c)
        for f in (np.exp, np.log1p, np.tanh, np.sqrt, np.abs, np.negative, np.square,
                  np.reciprocal, np.isfinite, np.sign):
            f(b)
        m = a.reshape(64, 64)
        for red in (np.sum, np.mean, np.max, np.min, np.argmax, np.var):
            red(m), red(m, axis=0), red(m, axis=-1, keepdims=True)
        np.where(a > 0, a, 0 * a)
        np.dot(m, m.T), m @ m, np.ascontiguousarray(m.T)
        a.astype(np.float16), a.astype(np.int32), a.astype(np.int64), (a > 0).astype(dtype)
        np.concatenate([a, b]), np.take(a, np.arange(0, n, 7)), np.cumsum(a)
        np.clip(a, -1, 1), np.copyto(c, a), a[::2].copy(), np.pad(m, 1)
        np.einsum("ij,jk->ik", m, m), np.outer(a[:8], b[:8])
        np.copysign(a, b), np.maximum.accumulate(a), np.add.reduce(m, axis=0)
        np.take_along_axis(m, np.argmax(m, axis=1)[:, None], 1), np.count_nonzero(a > 0)
        np.put_along_axis(m.copy(), np.argsort(m, axis=1)[:, :1], 0, 1), a[a > 0], np.flatnonzero(a)
        np.add.at(c, np.arange(0, n, 3), 1), np.broadcast_to(b[:64], (64, 64)) * m
        a.reshape(4, 8, 8, 16).transpose(0, 2, 1, 3).copy(), m[:, ::-1] + m[::2].sum(0)
        np.diff(a), np.unique(np.rint(a)), np.searchsorted(b, a), np.stack([a, b])
    for itype in (np.uint8, np.int8, np.uint16, np.uint32, np.int32, np.uint64, np.int64):
        x = np.arange(n, dtype=itype)
        y = x * x + x
        (x ^ y, x & y, x | y, x >> 3, x << 1, x // 3, np.divmod(x, 7), x.astype(np.float32),
         x.astype(np.float64), np.minimum(x, y), (x > y).sum(), x.sum(), np.bincount(x[:64] & 63))
    bits = np.packbits(np.arange(n) % 3 == 0)
    np.unpackbits(bits), np.unpackbits(bits).view(np.bool_), np.frombuffer(bits.tobytes(), np.uint8)
    rng = np.random.default_rng([1, 2])
    rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n)
    rng.random(n, dtype=np.float32), rng.permutation(n), rng.integers(0, 2**31, n)
    rng.uniform(-1, 1, n), rng.bit_generator.random_raw(16)
    import yaml
    yaml.dump({"a": [1, 2.5, "x", True, None, {"b": [3, 4]}]},
              Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False,
              default_flow_style=None)
    import io

    import h5py
    with h5py.File(io.BytesIO(), "w") as f:
        f.attrs["a"] = "x"
        f.create_dataset("g/x", data=np.arange(256, dtype=np.float32), chunks=(64,))
        f.create_dataset("y", data=np.arange(16, dtype=np.int64))
        f["g/x"][:], f["y"][3:7], dict(f.attrs)


def rss_bytes():
    """Resident bytes of this process now, None where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_bytes():
    """The most bytes this process has had resident: /proc/self/status's
    ``VmHWM``, the high-water mark of its own memory, which execve starts
    anew. getrusage's ``ru_maxrss`` is the fallback where /proc is missing
    (kibibytes on Linux, bytes on macOS): Linux keeps it across execve, and
    a child that Python's subprocess starts with vfork executes in its
    parent's memory, so a ``train`` started from a pytest worker that had
    reached 1 GB reported that gigabyte as its own peak (memory.json: 898
    MiB above the baseline against plan's 230.5). VmHWM is the larger of
    the mark the kernel records (only when memory is unmapped) and the
    resident count now, which lags by a few pages (per-CPU counters): read
    twice, it went down by 12 KiB between the loop's end and the run's
    (memory.json's ``loop_peak_rss_bytes`` above ``peak_rss_bytes``), so
    the figure returned is the largest this process has read."""
    global _peak_seen
    peak = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = peak if sys.platform == "darwin" else peak * 1024
    _peak_seen = max(_peak_seen, peak)
    return _peak_seen


#: the largest figure peak_rss_bytes has returned in this process
_peak_seen = 0


def mapped_resident_bytes(array):
    """The bytes of the pages under ``array``'s memory (a contiguous NumPy
    array) that are present in this process's page table now (Linux's
    /proc/self/pagemap, bit 63 of each page's entry: readable without
    privileges), whole pages; None where /proc is missing. A page of shared
    memory another process wrote counts here only once this process has
    touched it: these are the bytes of the range that this process's
    resident count (``rss_bytes``) holds."""
    import numpy as np
    if array.nbytes == 0:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    start = array.__array_interface__["data"][0]
    first, last = start // page, (start + array.nbytes - 1) // page
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            entries = np.frombuffer(f.read((last - first + 1) * 8), np.uint64)
    except (OSError, ValueError):
        return None
    if len(entries) != last - first + 1:
        return None
    return int(np.count_nonzero(entries >> np.uint64(63))) * page


_M_MMAP_THRESHOLD = -3


def fix_mmap_threshold(environ=None):
    """Fix glibc's mmap threshold (``mallopt(M_MMAP_THRESHOLD)``) at
    ``PURINE_MMAP_THRESHOLD`` bytes, so that every allocation at least that
    large is its own mapping, given back to the system when it is freed.
    glibc's threshold is dynamic otherwise: freeing a mapped block raises it
    to that block's size (up to 32 MiB), and later allocations below it come
    from the heap, which keeps their pages after the free: a host kernel's
    temporaries stay resident after the op, so the peak depends on the order
    in which sizes came (docs/running.md, "Will it fit?"). Fixed, the
    resident bytes are the live ones, what ``plan`` counts. Off by default
    (0): fixed at glibc's default, 128 KiB, cifar10_quick's iteration ran
    about 35% slower (every large temporary a fresh mapping, faulted in
    anew). Returns the threshold set, None where nothing was set (not glibc,
    0, or a value the variable does not take: the CLI's check says so)."""
    return _mallopt(_M_MMAP_THRESHOLD, "PURINE_MMAP_THRESHOLD", environ)


def _mallopt(param, variable, environ):
    """``mallopt(param, value)`` of glibc, the value the integer variable
    ``variable`` holds; returns it, or None where nothing was set (not
    glibc, 0, a value the variable does not take, mallopt refused)."""
    import ctypes
    import platform

    from .env import EnvError, get
    try:
        value = get(variable, environ)
    except EnvError:
        return None
    if not value or platform.libc_ver()[0] != "glibc":
        return None
    try:
        ok = ctypes.CDLL(None).mallopt(param, ctypes.c_int(min(value, 2**31 - 1)))
    except (OSError, AttributeError):
        return None
    return value if ok == 1 else None


_M_ARENA_MAX = -8


def limit_malloc_arenas(environ=None):
    """Cap glibc's malloc arenas (``mallopt(M_ARENA_MAX)``) at
    ``PURINE_MALLOC_ARENAS`` (default 1), before any worker thread starts.
    glibc gives each thread that allocates while another holds the main
    arena an arena of its own (up to 8 per core), and the temporaries a
    worker thread frees stay in its arena, reused by no other thread: with
    one arena every thread's freed bytes serve the next allocation, so less
    is kept resident beyond what ``plan`` counts (docs/running.md, "Will it
    fit?"; not slower there). 0 leaves glibc's default; so does
    ``MALLOC_ARENA_MAX`` in the environment (glibc's own variable: the
    user's setting wins). Returns the cap set, None where nothing was set
    (not glibc, 0, the user's ``MALLOC_ARENA_MAX``, or a value the variable
    does not take: the CLI's check says so)."""
    env = os.environ if environ is None else environ
    if "MALLOC_ARENA_MAX" in env:
        return None
    return _mallopt(_M_ARENA_MAX, "PURINE_MALLOC_ARENAS", environ)
