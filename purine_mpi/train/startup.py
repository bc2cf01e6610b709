"""The start-up report (a loop service): the start-up block on rank 0
(train/runlog.py: hosts, devices, threads, the net, the layout, memory, the
set-up time), gathered from every rank before the first iteration, and one
line after this process's first iteration, which is slow.
"""
import time

from .collectives import world_gather
from .loop import Service


class StartupReport(Service):
    def __init__(self, created):
        self.created = created  # perf_counter() when the trainer began to build

    def on_start(self, loop):
        """Collective over the loop's world: every rank's host and device."""
        from .runlog import rank_info, startup_lines
        infos = world_gather(loop.world, rank_info(loop), "the start-up report")
        if loop.world.rank == 0:
            for line in startup_lines(loop, dict(enumerate(infos)),
                                      time.perf_counter() - self.created):
                loop.log(line)

    def after_step(self, loop, done):
        if done == loop.state.start_iter + 1:
            gpu = ", CUDA kernel compilation" if loop.graphs.device >= 0 else ""
            loop.say(f"first iteration done in {time.perf_counter() - loop.state.t_start:.2f} s "
                     "(includes one-time start-up: first memory allocations, the first data "
                     f"batch{gpu})")
