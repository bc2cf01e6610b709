"""What a run says and records: the start-up block (runlog.py), the first
iteration's time, the metrics log and config.yaml of the run folder, the
elapsed training time, rank 0's log lines and the trace. A part of
``Trainer`` (mixed in)."""
import os
import time

import numpy as np

from ..io.config import dump_config
from ..io.metrics import MetricsLog
from .collectives import world_gather


class ReportingMixin:
    def _trace_epoch(self):
        """Rank 0's clock at start (seconds since the Unix epoch), so every
        rank's trace counts time from the same instant and the ranks' traces
        line up (the stages of a pipeline are seen computing at once)."""
        t = np.array([time.time() if self.rank == 0 else 0.0])
        return float(self.world.allreduce(t, "sum", "the trace clock")[0]) \
            if self.size > 1 else float(t[0])

    def report_startup(self):
        """The start-up block on rank 0 (runlog.py). Collective over the
        trainer's world: every rank's host and device are gathered."""
        from ..runlog import rank_info, startup_lines
        infos = world_gather(self.world, rank_info(self), "the start-up report")
        if self.rank == 0:
            for line in startup_lines(self, dict(enumerate(infos)),
                                      time.perf_counter() - self._t_created):
                self.log(line)

    def _report_first_iteration(self, seconds):
        """One line after this process's first iteration: it is slow, and
        the first display line may be far away."""
        gpu = ", CUDA kernel compilation" if self.device >= 0 else ""
        self._say(f"first iteration done in {seconds:.2f} s (includes one-time start-up: "
                  f"first memory allocations, the first data batch{gpu})")

    def _open_metrics(self):
        """Rank 0: config.yaml, and the metrics log (io/metrics.py) that goes
        on from the checkpoint's rows and time when resuming. A resumed run
        replaces the folder's config.yaml with its first checkpoint (save)."""
        if self.rank != 0:
            return None
        os.makedirs(self.out_dir, exist_ok=True)
        if not self.start_iter:
            self._write_config()
        log = MetricsLog(self.out_dir, self.start_iter, self.elapsed0, self.tensorboard)
        self.elapsed0 = log.elapsed0  # never below a kept row's time
        self._metrics = log  # save() makes a resumed run's rows the file (MetricsLog.commit)
        return log

    def _write_config(self):
        with open(os.path.join(self.out_dir, "config.yaml"), "w") as f:
            f.write(dump_config(self.job))

    def elapsed(self, now=None):
        """Training time in seconds, over this run and those it resumed."""
        if self._t_start is None:
            return self.elapsed0
        return self.elapsed0 + (time.perf_counter() if now is None else now) - self._t_start

    @staticmethod
    def _write(metrics, rec):
        if metrics is not None:
            metrics.write(rec)

    def _say(self, msg):
        if self.rank == 0:
            self.log(msg)

    def write_trace(self):
        if self.profiler is None:
            return None
        return self.profiler.close()
