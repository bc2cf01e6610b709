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
