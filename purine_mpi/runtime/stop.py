"""The stop agreement: how a signal (SLURM's preemption notice, scancel) or a
diverged loss on any rank ends every rank at the same iteration.

Kept free of heavy imports so that ``train`` installs its handlers before
NumPy and MPI load (``StopSignal.install_early``)."""
import signal
import threading


class StopSignal:
    """SIGUSR1 (e.g. SLURM's ``--signal=USR1@60`` before the time limit) or
    SIGTERM asks the run to stop: every rank finishes the iteration, they
    agree on it (a MAX reduction, the same collective on every rank each
    iteration, polled under the stall watchdog), a checkpoint is written, and
    the job ends cleanly. The same agreement carries a non-finite loss or
    weight seen on any rank (DIVERGED), which wins over a signal."""

    SIGNALS = ("SIGUSR1", "SIGTERM")
    DIVERGED = len(SIGNALS) + 1

    #: a signal that arrived before the trainer existed (install_early)
    early = None

    def __init__(self):
        self.name = StopSignal.early
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                signal.signal(getattr(signal, sig), self._handle)

    def _handle(self, signum, frame):
        self.name = signal.Signals(signum).name

    @classmethod
    def install_early(cls):
        """Record SIGUSR1/SIGTERM from the first moment of ``train`` on: a
        notice that arrives while the graph is still being built (a job
        step just started) then stops the run after its first iteration,
        instead of killing the rank with the default action."""
        def record(signum, frame):
            cls.early = signal.Signals(signum).name
        if threading.current_thread() is threading.main_thread():
            for sig in cls.SIGNALS:
                signal.signal(getattr(signal, sig), record)

    def agree(self, world, diverged=False):
        """The code every rank agrees on after an iteration: 0 (go on), 1
        (SIGUSR1), 2 (SIGTERM) or DIVERGED. Collective on ``world``."""
        code = self.DIVERGED if diverged else (
            self.SIGNALS.index(self.name) + 1 if self.name else 0)
        if world.size > 1:
            import numpy as np
            code = int(world.allreduce(np.array([code], np.int64), "max",
                                       "the stop agreement (allreduce)")[0])
        if code and code != self.DIVERGED and self.name is None:
            self.name = self.SIGNALS[code - 1]
        return code
