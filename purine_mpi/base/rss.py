"""This process's resident memory (Linux): ``rss_bytes`` now
(/proc/self/statm's resident pages), ``peak_rss_bytes`` its high-water mark
(getrusage's ``ru_maxrss``, kibibytes on Linux). ``train`` reads the first
after MPI's initialisation, before any graph is built (the baseline), and
the second at the end of the run: the difference is what ``plan``'s host
total predicts (docs/running.md, "Will it fit?")."""
import os
import resource


def rss_bytes():
    """Resident bytes of this process now, None where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_bytes():
    """The most bytes this process has had resident (ru_maxrss, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


#: glibc's M_MMAP_THRESHOLD set at start-up (``fix_mmap_threshold``): its
#: default, 128 KiB, but fixed
MMAP_THRESHOLD = 128 << 10
#: the environment variable that sets it (bytes; 0: leave glibc's dynamic one)
MMAP_THRESHOLD_ENV = "PURINE_MMAP_THRESHOLD"
_M_MMAP_THRESHOLD = -3


def fix_mmap_threshold(environ=os.environ):
    """Fix glibc's mmap threshold (``mallopt(M_MMAP_THRESHOLD)``) so that
    every allocation of at least ``MMAP_THRESHOLD`` bytes is its own mapping,
    given back to the system when it is freed. glibc's threshold is dynamic
    otherwise: freeing a mapped block raises it to that block's size (up to
    32 MiB), and later allocations below it come from the heap, which keeps
    their pages after the free: a host kernel's temporaries stayed resident
    after each op, so the peak depended on the order in which sizes came
    (docs/running.md, "Will it fit?"). Fixed, the resident bytes are the live
    ones, what ``plan`` counts. Returns the threshold set, None where this is
    not glibc or ``PURINE_MMAP_THRESHOLD=0``."""
    import ctypes
    import platform
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        nbytes = int(environ.get(MMAP_THRESHOLD_ENV, MMAP_THRESHOLD))
    except ValueError:
        nbytes = MMAP_THRESHOLD
    if nbytes <= 0:
        return None
    try:
        ok = ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(nbytes))
    except (OSError, AttributeError):
        return None
    return nbytes if ok == 1 else None
