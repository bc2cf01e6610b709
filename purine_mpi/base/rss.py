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
