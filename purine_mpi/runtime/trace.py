"""Chrome traces (docs/formats.md, "Traces"): collected in memory, or
streamed to a file (``train --profile``).

``Profiler`` collects a dispatcher's trace events in memory (``bench``,
the tests); ``TraceFile`` is a ``Profiler`` that writes its events to
``trace.rank<R>.json`` as they come, in chunks, instead of keeping every
event of the run in memory; with a window (``--profile-iters A:B``) it keeps
only iterations ``A <= iter < B``. The file is Chrome's JSON object format
(``{"traceEvents": [...], "displayTimeUnit": "ms"}``), complete after
``close()``; Perfetto and ``chrome://tracing`` open it. Metadata events name
the process (``rank R``) and each thread the first time it appears: worker
threads by number, ``comm`` (the MPI progress thread), CUDA streams
(``gpu<d>:<thread>``), the copy streams ``h2d``/``d2h`` and the replays of
captured CUDA graphs (``gpu<d>:graph``, one event per segment); ops of a
thread that overlap without nesting (comm ops in flight at once) go on more
rows of it, ``<tid>.<k>`` (``TraceFile._lane``: Perfetto drops a complete
event that partly overlaps another of its row). The trainer
gives every rank the same time origin (rank 0's start), so the ranks'
files share one time axis: their ``traceEvents`` concatenated are one
trace of the job (a pipeline's stages are seen computing at once).
"""
import json
import os
import socket
import threading
import time

from ..base.errors import UserError
from ..base.runfiles import make_parent, open_run_fd, write_all


#: the role of a parameter server's trace (``process_labels``)
SERVER_ROLE = "parameter server"


class Profiler:
    """Collects Chrome trace events (docs/formats.md, "Traces")."""

    def __init__(self, rank=0, epoch=None):
        """``epoch``: the instant (seconds since the Unix epoch) that trace
        time 0 stands for; several ranks given the same one (the trainer
        passes rank 0's start) get traces on one time axis. Default: now."""
        self.rank = rank
        self.events = []
        self.t0 = time.perf_counter()
        if epoch is not None:
            self.t0 -= time.time() - float(epoch)
        self._lock = threading.Lock()

    def record(self, op, category, t_start, t_end, iteration, tid, extra=None):
        args = {"iter": iteration, "op_type": op.op_type}
        for key, value in (extra or {}).items():
            if key == "ready_s":  # a perf_counter time: on the trace's clock
                args["ready_ts"] = round((value - self.t0) * 1e6, 1)
            else:
                args[key] = value
        ev = {"name": op.name, "cat": category, "ph": "X",
              "ts": (t_start - self.t0) * 1e6, "dur": (t_end - t_start) * 1e6,
              "pid": self.rank, "tid": str(tid), "args": args}
        with self._lock:
            self.events.append(ev)


def parse_window(text):
    """``"A:B"`` -> (A, B) with 0 <= A < B (iterations A..B-1); either side
    may be left out (``":50"``, ``"100:"``). A UserError otherwise."""
    parts = str(text).split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        start = int(parts[0]) if parts[0].strip() else 0
        stop = int(parts[1]) if parts[1].strip() else None
    except ValueError:
        raise UserError(f"--profile-iters: expected A:B (trace iterations A to B-1, e.g. "
                        f"100:110), got {text!r}") from None
    if start < 0 or (stop is not None and stop <= start):
        raise UserError(f"--profile-iters: expected 0 <= A < B, got {text!r}")
    return start, stop


def thread_label(tid):
    tid = str(tid)
    base, _, lane = tid.rpartition(".")
    if base and lane.isdigit():  # TraceFile._lane: a row of ops overlapping those of ``base``
        return f"{thread_label(base)} {lane}"
    if tid.isdigit():
        return f"worker thread {tid}"
    if tid == "comm":
        return "MPI progress (comm)"
    if tid in ("h2d", "d2h"):
        return f"copy stream {tid}"
    if tid.startswith("gpu") and tid.endswith(":graph"):
        return f"CUDA graph replays {tid[:-6]}"
    if tid.startswith("gpu"):
        return f"CUDA stream {tid}"
    return tid


#: recent events a row keeps to place the next ones (``TraceFile._lane``)
_LANE_SPANS = 32


class TraceFile(Profiler):
    """A Profiler that streams to ``path`` (see the module docstring).

    ``window``: (start, stop) iterations to keep, stop None for no end;
    None keeps all. ``chunk``: events buffered before a write. ``role``:
    what the rank is, where it is not a replica of the net (``SERVER_ROLE``:
    a parameter server), in its ``process_name`` and a ``process_labels``
    metadata event."""

    def __init__(self, path, rank=0, window=None, chunk=2048, epoch=None, open_now=True,
                 role=None):
        super().__init__(rank, epoch)
        self.path, self.window, self.chunk = path, window, int(chunk)
        self.written = 0
        self._threads = set()
        self._lanes = {}  # tid: [(recent (start, end) spans, their last end)] per row
        self._last_row = (None, 0)  # the last op recorded and the index of its row
        self._io_lock = threading.Lock()
        self._fd, self._first = None, True
        if open_now:
            self.open()
        what = f"rank {rank}" + (f", {role}" if role else "")
        self._meta({"name": "process_name", "ph": "M", "pid": rank, "tid": "0",
                    "args": {"name": f"{what} ({socket.gethostname()}, pid {os.getpid()})"}})
        if role:  # a parameter server's: predict leaves its trace out
            self._meta({"name": "process_labels", "ph": "M", "pid": rank, "tid": "0",
                        "args": {"labels": role}})
        self._meta({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": "0",
                    "args": {"sort_index": rank}})

    def open(self):
        """Create (truncate) the file and write its head. ``open_now=False``
        leaves it to the caller (train's Traces, once the start-up checks
        passed: a refused run truncates no earlier trace of its folder)."""
        with self._io_lock:
            if self._fd is not None:
                return
            make_parent(self.path)  # link/.. as the system reads it
            self._fd = open_run_fd(self.path)  # never through a link (base/runfiles.py)
            self._write('{"displayTimeUnit": "ms", "traceEvents": [\n')

    def _meta(self, event):
        self.events.append(event)

    def _lane(self, tid, start, end, first=0):
        """The row of an event on thread ``tid``: ``tid`` itself where the
        event nests with, or keeps clear of, every recent event of that row;
        else the first row ``<tid>.<k>`` (k = 2, 3, ...) where it does. Ops
        in flight at once (a comm thread's allreduces of several buckets)
        overlap without nesting, and Perfetto drops a complete event that
        partly overlaps another of its row. Returns the row's index (0:
        ``tid``); ``first``: the index to try first. Called under ``_lock``."""
        lanes = self._lanes.setdefault(tid, [])
        order = list(range(len(lanes)))
        if 0 < first < len(lanes):
            order.insert(0, order.pop(first))
        for k in order:
            spans, last_end = lanes[k]
            if start >= last_end:  # after all of the row: the common case
                break
            if all(b <= start or end <= a or (a <= start and end <= b) or
                   (start <= a and b <= end) for a, b in reversed(spans)):
                break
        else:
            k = len(lanes)
            lanes.append(([], end))
        spans, last_end = lanes[k]
        spans.append((start, end))
        if len(spans) > 2 * _LANE_SPANS:  # the oldest ones are long done
            del spans[:_LANE_SPANS]
        lanes[k] = (spans, max(last_end, end))
        return k

    def wants(self, iteration):
        if self.window is None:
            return True
        start, stop = self.window
        return iteration >= start and (stop is None or iteration < stop)

    def record(self, op, category, t_start, t_end, iteration, tid, *more, **kw):
        if not self.wants(iteration):
            return
        tid = str(tid)
        with self._lock:
            # a one-sided op's parts (``<op>:<kind>``, recorded right after
            # it) go on their op's row where they nest there
            last, row = self._last_row
            part = last is not None and op.name.startswith(f"{last}:")
            k = self._lane(tid, t_start, t_end, row if part else 0)
            if not part:
                self._last_row = op.name, k
        tid = tid if k == 0 else f"{tid}.{k + 1}"
        if tid not in self._threads:
            with self._lock:
                if tid not in self._threads:
                    self._threads.add(tid)
                    self.events.append({"name": "thread_name", "ph": "M", "pid": self.rank,
                                        "tid": tid, "args": {"name": thread_label(tid)}})
        super().record(op, category, t_start, t_end, iteration, tid, *more, **kw)
        if len(self.events) >= self.chunk:
            self.flush()

    def flush(self):
        with self._lock:
            events, self.events = self.events, []
        if not events:
            return
        with self._io_lock:
            if self._fd is None:
                return
            text = ",\n".join(json.dumps(e, allow_nan=False) for e in events)
            self._write(text if self._first else ",\n" + text)
            self._first = False
            self.written += len(events)

    def _write(self, text):
        """Append ``text`` whole or not at all (``write_all``: a full disk or
        the file-size limit cuts the file back to its last whole chunk and is
        one line naming it), so the file always reads with ``]}`` added."""
        write_all(self._fd, text.encode(), self.path)

    def close(self):
        """Write what is buffered and end the JSON; returns the path."""
        try:
            self.flush()
        finally:
            with self._io_lock:
                if self._fd is not None:
                    fd, self._fd = self._fd, None
                    try:  # after a failed chunk too: the events before it, a whole file
                        write_all(fd, b"\n]}\n", self.path)
                    finally:
                        os.close(fd)
        return self.path


def merge_intervals(intervals):
    """Union of (start, end) intervals, as sorted, disjoint [start, end] lists."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out
