"""The stop agreement: how a signal (SLURM's preemption notice, scancel) or a
diverged loss on any rank ends every rank at the same iteration.

Kept free of heavy imports so that ``train`` installs its handlers before
NumPy and MPI load (``StopSignal.install_early``).
"""
import os
import signal
import sys
import threading
import time

from ..base.cancel import Cancel
from ..base.errors import write_line  # noqa: F401  (this module's callers import it here)


class StopSignal:
    """SIGUSR1 (e.g. SLURM's ``--signal=USR1@60`` before the time limit),
    SIGUSR2 (the other common ``--signal`` choice), SIGTERM, SIGHUP (a closed
    terminal or ssh session), SIGQUIT (Ctrl-\\) or SIGINT (Ctrl-C) asks the
    run to stop: every rank finishes the iteration, they agree on it (a MAX
    reduction, the same collective on every rank each iteration, polled
    under the stall watchdog), a checkpoint is written, and the job ends
    cleanly. A closed stdout (``train ... | head``) stops the run the same
    way (``SIGPIPE``, see ``print_or_stop``). The same agreement carries a
    non-finite loss or weight seen on any rank (DIVERGED), which wins over a
    signal. A second Ctrl-C a second or more after the first interrupts at
    once, without the checkpoint (``interrupt_now``)."""

    #: the stop requests, weakest first (the agreement keeps the strongest)
    SIGNALS = ("SIGUSR1", "SIGTERM", "SIGPIPE", "SIGINT", "SIGUSR2", "SIGHUP", "SIGQUIT")
    CAUGHT = ("SIGUSR1", "SIGTERM", "SIGINT", "SIGUSR2", "SIGHUP", "SIGQUIT")  # not SIGPIPE:
    # it comes as a BrokenPipeError
    DIVERGED = len(SIGNALS) + 1
    #: the exit status after a stop with a checkpoint (SIGUSR1: finish
    #: cleanly); the others 128 + the signal's number, as the shell reports
    #: a process the signal ended, though this one wrote its checkpoint
    EXIT_STATUS = {"SIGUSR1": 0, "SIGTERM": 143, "SIGPIPE": 141, "SIGINT": 130,
                   "SIGUSR2": 140, "SIGHUP": 129, "SIGQUIT": 131}
    #: the exit status of a second Ctrl-C: at once, without a checkpoint
    INTERRUPTED = 130
    #: a signal that arrived before the trainer existed (install_early)
    early = None
    #: the newest StopSignal of this process (``request`` sets its name)
    current = None
    #: called (no arguments) by ``interrupt_now`` before the process ends:
    #: e.g. removing a checkpoint's half-written temp file (train/checkpoints.py)
    cleanups = []

    def __init__(self):
        self.name = StopSignal.early
        self._first_int = None
        StopSignal.current = self
        if threading.current_thread() is threading.main_thread():
            for sig in self.CAUGHT:
                signal.signal(getattr(signal, sig), self._handle)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if name == "SIGINT":
            # mpiexec passes the terminal's Ctrl-C on: the same press may come twice
            now = time.monotonic()
            if self._first_int is not None and now - self._first_int >= 1.0:
                self.interrupt_now()
            self._first_int = self._first_int or now
        self.name = max(filter(None, (self.name, name)), key=self.SIGNALS.index)
        Cancel.got(name)

    @classmethod
    def new_run(cls):
        """A run begins in this process (``run_training``): forget what an
        earlier run of the process left in the class -- its cancel, its
        longest wait, its last checkpoint. Without this a second run of the
        Python API after a Ctrl-C took its first wait of 5 s or more on a
        healthy peer for a frozen one (exit 130, no checkpoint). A cancel
        recorded before this run's trainer existed (``install_early``:
        ``early``) is this run's and stays."""
        Cancel.reset(keep=cls.early in Cancel.CANCELS)

    @classmethod
    def interrupt_now(cls):
        """End this process at once (a second Ctrl-C): one line, the
        cleanups, exit 130. Raising KeyboardInterrupt instead would unwind
        through the checkpoint's HDF5 writes, where an exception in a
        destructor is printed as a traceback and dropped -- the interrupt
        was lost."""
        from ..comm.launcher import launched_rank
        from ..comm.mpi_init import _flush
        _flush()  # quietly: a closed pipe, a stream in use by the interrupted code
        if launched_rank() == 0:
            write_line("interrupted again: stopping now without waiting for the checkpoint "
                          "(latest.h5 stays the last complete one)")
        for cleanup in list(cls.cleanups):
            try:
                cleanup()
            except Exception:
                pass
        os._exit(cls.INTERRUPTED)

    @classmethod
    def request(cls, name):
        """Ask the current run to stop as on signal ``name`` (before a
        trainer exists: recorded like an early signal)."""
        if cls.current is not None:
            cls.current.name = cls.current.name or name
        else:
            cls.early = cls.early or name

    @classmethod
    def ignore_late_notices(cls):
        """Once ``train`` has ended (its last checkpoint written, its status
        known), ignore the stop signals but Ctrl-C: a notice that comes
        again then (a launcher or batch system repeating SIGTERM to every
        rank) has nothing left to stop. Python's shutdown puts back the
        default action of the signals it caught, and mpi4py's MPI_Finalize
        runs after that, waiting for the other ranks: a notice in that
        window killed the rank, and the job, its checkpoint written, ended
        15 with MPICH's "YOUR APPLICATION TERMINATED" banner instead of the
        stop's 143 (tests/test_trust_kill.py). Ctrl-C keeps its default
        action there, and SIGKILL always ends a rank. ``train`` then
        finalizes MPI itself (comm/world.py, ``finalize_mpi``), where a
        notice ends a rank that MPI_Finalize holds for more than 2 s."""
        if threading.current_thread() is threading.main_thread():
            for sig in cls.CAUGHT:
                if sig != "SIGINT":
                    signal.signal(getattr(signal, sig), signal.SIG_IGN)

    @classmethod
    def exit_status(cls, name):
        return cls.EXIT_STATUS.get(name, 0)

    @classmethod
    def install_early(cls):
        """Record the stop signals but Ctrl-C (SIGUSR1, SIGTERM, ...) from
        the first moment of ``train`` on: a notice that arrives while the
        graph is still being built (a job step just started) then stops the
        run after its first iteration, instead of killing the rank with the
        default action. A notice while MPI_Init waits for a peer that never
        starts MPI ends the rank 2 s later (comm/mpi_init.py), as Python
        code cannot run there."""
        from ..comm.mpi_init import notice_received

        def record(signum, frame):
            name = signal.Signals(signum).name
            cls.early = max(filter(None, (cls.early, name)), key=cls.SIGNALS.index)
            Cancel.got(name)
            notice_received(signum)  # a rank whose MPI_Init then waits for a peer ends
        if threading.current_thread() is threading.main_thread():
            for sig in cls.CAUGHT:  # Ctrl-C: interrupted at once, nothing to lose
                if sig != "SIGINT":
                    signal.signal(getattr(signal, sig), record)

    def agree(self, world, diverged=False):
        """The code every rank agrees on after an iteration: 0 (go on), 1 +
        the index in SIGNALS of the strongest signal any rank got, or
        DIVERGED. Collective on ``world``; every rank then has that name."""
        Cancel.measuring = True  # the run's iterations began: waits count
        code = self.DIVERGED if diverged else (
            self.SIGNALS.index(self.name) + 1 if self.name else 0)
        if world.size > 1:
            import numpy as np
            code = int(world.allreduce(np.array([code], np.int64), "max",
                                       "the stop agreement (allreduce)")[0])
        if code and code != self.DIVERGED:
            self.name = self.SIGNALS[code - 1]  # the same exit status on every rank
        return code


def print_or_stop(msg):
    """Print a line to stdout. When stdout is a closed pipe (``train ... |
    head``), stdout goes to /dev/null from then on and the run stops as on
    SIGTERM, with a checkpoint (exit status 141), instead of dying on the
    next line or going on unseen."""
    try:
        print(msg, flush=True)
    except BrokenPipeError:
        stdout_to_devnull()
        StopSignal.request("SIGPIPE")


def print_err(msg):
    """Print a line to stderr in one write (``write_line``); when stderr is a
    closed pipe too (``train ... 2>&1 | head``), it goes to /dev/null from
    then on: the line is lost, the exit status stands (a BrokenPipeError
    here ended the run with 1)."""
    try:
        write_line(msg, quiet=False)
    except OSError:
        _to_devnull(2, sys.stderr)


def stdout_to_devnull():
    """Point file descriptor 1 at /dev/null, so later writes and the flush
    at exit do not fail again."""
    _to_devnull(1, sys.stdout)


def _to_devnull(fileno, stream):
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, fileno)
        os.close(fd)
    except OSError:
        pass
    try:  # what the stream still holds would fail again at exit
        stream.flush()
    except (OSError, ValueError):
        pass
