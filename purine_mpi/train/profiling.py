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
        if profile:
            self.profiler = TraceFile(os.path.join(out_dir, f"trace.rank{world.rank}.json"),
                                      world.rank, profile if isinstance(profile, tuple) else None,
                                      epoch=trace_epoch(world))

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
