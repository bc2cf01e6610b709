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
    def __init__(self, profile, out_dir, world):
        self.profiler = None  # the dispatchers record into it
        self.window = profile if isinstance(profile, tuple) else None
        if profile:
            self.profiler = TraceFile(os.path.join(out_dir, f"trace.rank{world.rank}.json"),
                                      world.rank, profile if isinstance(profile, tuple) else None,
                                      epoch=trace_epoch(world))

    def on_start(self, loop):
        """A ``--profile-iters`` window outside the iterations this run
        trains would leave an empty trace, exit 0: exit 2 before the first
        iteration instead (every rank alike: the same window and range)."""
        if self.window is None:
            return
        first, end = loop.state.start_iter, loop.job.solver.max_iter
        start, stop = self.window
        if start >= end or (stop is not None and stop <= first):
            from ..base.errors import UserError
            trains = f"{first} to {end - 1}" if end > first else "none"
            raise UserError(f"--profile-iters {start}:{'' if stop is None else stop} traces "
                            f"none of the iterations this run trains ({trains}): the trace "
                            "would hold no op; give a window inside them")

    def on_close(self, loop):
        if self.profiler is not None:
            self.profiler.close()


def trace_epoch(world):
    """Rank 0's clock at start (seconds since the Unix epoch), so every
    rank's trace counts time from the same instant and the ranks' traces
    line up (the stages of a pipeline are seen computing at once)."""
    t = np.array([time.time() if world.rank == 0 else 0.0])
    return float(world.allreduce(t, "sum", "the trace clock")[0]) if world.size > 1 \
        else float(t[0])
