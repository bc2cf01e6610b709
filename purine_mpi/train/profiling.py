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
        """The trace file is made (truncated) here, after every check_start:
        a refused --resume leaves the folder's earlier trace as it was."""
        if self.profiler is not None:
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
