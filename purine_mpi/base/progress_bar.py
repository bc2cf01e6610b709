"""Progress of long loops: test passes, data conversion.

    with progress(total, "test", unit="samples", log=print) as bar:
        for ...:
            bar.update(n)

Where stderr is a terminal and tqdm is installed (``pip install
'purine_mpi[progress]'``), a tqdm bar on stderr that clears itself when the
loop ends. Otherwise -- a batch log, a pipe, or no tqdm -- plain lines
through ``log``, at most one every ``PURINE_PROGRESS_SECONDS`` seconds
(default 10) and none at all for a loop that ends sooner, so short loops
leave the log as it was::

    test 2,560/10,000 samples (26%, 1,234 samples/s, eta 0:06)

``enabled=False`` (every rank but 0) gives a bar that does nothing.
"""
import sys
import time

from . import env

#: seconds between two plain progress lines (environment variable)
INTERVAL_VAR = "PURINE_PROGRESS_SECONDS"
DEFAULT_INTERVAL = 10.0


def interval_seconds():
    """The plain lines' interval: PURINE_PROGRESS_SECONDS, else 10 s."""
    return env.get(INTERVAL_VAR, default=DEFAULT_INTERVAL)  # EnvError unless seconds >= 0


def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def progress(total, desc, unit="samples", log=None, enabled=True, stream=None):
    """A progress reporter for ``total`` units (see the module docstring).
    ``stream``: where a bar goes (default sys.stderr); a bar only where it
    is a terminal."""
    if not enabled or total <= 0:
        return _Nothing()
    stream = sys.stderr if stream is None else stream
    tqdm = _tqdm() if _isatty(stream) else None
    if tqdm is not None:
        return _Bar(tqdm, total, desc, unit, stream)
    return Lines(total, desc, unit, log or (lambda msg: print(msg, flush=True)))


def _isatty(stream):
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a file
        return False


class _Reporter:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def update(self, n=1):
        raise NotImplementedError

    def close(self):
        pass


class _Nothing(_Reporter):
    def update(self, n=1):
        pass


class _Bar(_Reporter):
    """tqdm on a terminal."""

    def __init__(self, tqdm, total, desc, unit, stream):
        self.bar = tqdm(total=total, desc=desc, unit=f" {unit}", unit_scale=False,
                        leave=False, file=stream, dynamic_ncols=True)

    def update(self, n=1):
        self.bar.update(n)

    def close(self):
        self.bar.close()


class Lines(_Reporter):
    """Plain lines for batch logs: one at most every ``interval`` seconds,
    the first only once ``interval`` has passed."""

    def __init__(self, total, desc, unit, log, interval=None, clock=time.monotonic):
        self.total, self.desc, self.unit, self.log = int(total), desc, unit, log
        self.interval = interval_seconds() if interval is None else float(interval)
        self.clock = clock
        self.t0 = self.last = clock()
        self.done = 0

    def update(self, n=1):
        self.done += int(n)
        now = self.clock()
        if now - self.last >= self.interval:
            self.last = now
            self.log(self.line(now))

    def line(self, now):
        elapsed = max(now - self.t0, 1e-9)
        rate = self.done / elapsed
        pct = 100.0 * self.done / self.total
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        return (f"{self.desc} {self.done:,}/{self.total:,} {self.unit} ({pct:.0f}%, "
                f"{rate:,.0f} {self.unit}/s, eta {hms(eta)})")


def hms(seconds):
    """``m:ss`` or ``h:mm:ss``."""
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def human_bytes(n):
    """``1.6 MiB``, ``512 B``; ``n/a`` for None."""
    if n is None:
        return "n/a"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"


#: the units a size may name (``parse_size``): K/M/G/T and KiB/MiB/GiB/TiB
#: are powers of 1024, KB/MB/GB/TB powers of 1000
SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10 ** 3, "m": 1 << 20,
              "mib": 1 << 20, "mb": 10 ** 6, "g": 1 << 30, "gib": 1 << 30, "gb": 10 ** 9,
              "t": 1 << 40, "tib": 1 << 40, "tb": 10 ** 12}


def parse_size(text):
    """``80GiB``, ``512MiB``, ``24G`` (binary), ``16GB`` (decimal), ``1000``
    (bytes): a positive byte count, or None when ``text`` is no size."""
    import re
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in SIZE_UNITS:
        return None
    nbytes = int(float(m.group(1)) * SIZE_UNITS[unit])
    # a fraction of a byte (0.5B, 0.0001K) floors to 0: no positive count
    return nbytes if nbytes >= 1 else None
