"""Traces (a loop service): with ``--profile`` every rank streams a Chrome
trace to ``OUT/trace.rank<R>.json`` (runtime/trace.py; a ``(start, stop)``
window of ``--profile-iters A:B`` keeps those iterations), its clock
counted from rank 0's start so the ranks' traces line up; the file is
closed when the loop ends.
"""
import os
import time

import numpy as np

from ..runtime.trace import TraceFile
from .loop import Service


class Traces(Service):
    """``epoch``: the time origin when the caller agreed on it already (a
    parameter-server run: over every rank, servers too, ``trace_epoch`` of
    the global world); else ``trace_epoch(world)``. ``rank``: the trace's
    rank (the global rank; default ``world.rank``); ``role``: TraceFile's."""

    def __init__(self, profile, out_dir, world, epoch=None, rank=None, role=None):
        self.profiler = None  # the dispatchers record into it
        self.window = profile if isinstance(profile, tuple) else None
        if profile:
            rank = world.rank if rank is None else rank
            self.profiler = TraceFile(os.path.join(out_dir, f"trace.rank{rank}.json"),
                                      rank, profile if isinstance(profile, tuple) else None,
                                      epoch=trace_epoch(world) if epoch is None else epoch,
                                      open_now=False, role=role)

    def on_start(self, loop):
        """The trace file is made here, after every check_start: a refused
        --resume leaves the folder's earlier trace as it was. An earlier
        trace of the folder (a killed or stopped run that this one resumes)
        is kept under another name (``keep_earlier_trace``), said in the log."""
        if self.profiler is not None:
            kept = keep_earlier_trace(self.profiler.path, loop.state.start_iter)
            if kept and loop.world.rank == 0:
                every = " (every rank's likewise)" if loop.world.size > 1 else ""
                loop.say(f"note: the earlier trace {os.path.basename(kept[0])} is kept as "
                         f"{os.path.basename(kept[1])}{every}; this run's trace is "
                         f"{os.path.basename(self.profiler.path)}")
            self.profiler.open()

    def check_start(self, loop):
        """A ``--profile-iters`` window outside the iterations this run
        trains would leave an empty trace, exit 0: exit 2 before the first
        iteration instead (every rank alike: the same window and range)."""
        if self.window is not None:
            check_window(self.window, loop.state.start_iter, loop.job.solver.max_iter)

    def on_close(self, loop):
        if self.profiler is not None:
            self.profiler.close()


def keep_earlier_trace(path, start_iter):
    """Rename an earlier trace at ``path`` (``trace.rank<R>.json`` of a run
    this one resumes at iteration ``start_iter``) to
    ``trace.rank<R>.before<start_iter>.json`` (``-2``, ``-3``, ... where
    that is taken: a second resume at the same iteration), so that the new
    run's trace does not overwrite it; ``predict TRACE_DIR`` reads only the
    ``trace.rank<R>.json`` files, this run's. Returns (old, new) paths, or
    None where there was no earlier trace (a link or anything but a regular
    file is left to the trace's own refusal, base/runfiles.py)."""
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    stem = path[:-len(".json")] if path.endswith(".json") else path
    new, k = f"{stem}.before{int(start_iter)}.json", 1
    while os.path.lexists(new):
        k += 1
        new = f"{stem}.before{int(start_iter)}-{k}.json"
    os.rename(path, new)
    return path, new


def check_window(window, first, end):
    """A UserError (exit 2) when the ``--profile-iters`` ``window`` (start,
    stop) holds none of the iterations ``first`` .. ``end - 1`` a run trains."""
    start, stop = window
    if start >= end or (stop is not None and stop <= first):
        from ..base.errors import UserError
        trains = f"{first} to {end - 1}" if end > first else "none"
        raise UserError(f"--profile-iters {start}:{'' if stop is None else stop} traces "
                        f"none of the iterations this run trains ({trains}): the trace "
                        "would hold no op; give a window inside them")


def trace_epoch(world):
    """Rank 0's clock at start (seconds since the Unix epoch), so every
    rank's trace counts time from the same instant and the ranks' traces
    line up (the stages of a pipeline are seen computing at once)."""
    t = np.array([time.time() if world.rank == 0 else 0.0])
    return float(world.allreduce(t, "sum", "the trace clock")[0]) if world.size > 1 \
        else float(t[0])
