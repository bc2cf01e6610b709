"""A cancel (SIGTERM, Ctrl-C, SIGHUP, SIGQUIT) ending a wait on a stalled
peer: the state every waiting place reads (``comm/world.py``'s waits, the
dispatcher's progress loop) and the StopSignal's handler (runtime/stop.py)
records. Kept in the base layer, below both, so that the waits and the
errors of ``base/errors.py`` read it without importing the runtime."""
import contextlib
import time

from .errors import StoppedWhileStalled


class Cancel:
    """Class state only (one process, one run at a time: ``reset``)."""
    #: the notices that cancel a job (scancel, ``kill``, a closed terminal,
    #: Ctrl-C): one of them ends a wait on a stalled peer early
    #: (``cancelled_wait``); not SIGUSR1 or SIGUSR2 (a warning before the
    #: time limit, whose SIGTERM follows) nor a closed stdout
    CANCELS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    #: the least seconds a wait that a cancel found blocked still waits for
    #: its peers (a healthy peer that got the notice too comes once it ends
    #: the step it is in: ``cancel_grace``)
    CANCEL_GRACE = 5.0
    #: the grace is at least this many times the longest wait on peers
    #: (or step of the graph) this rank has seen end in the run
    #: (``longest_wait``): a healthy peer that keeps it waiting that long at
    #: every iteration (a slower node, a pipeline stage behind a long
    #: forward, rank 0's test pass or checkpoint write) is not taken for a
    #: stopped one
    CANCEL_GRACE_FACTOR = 2.0
    #: seconds of the longest wait on peers this process saw end once the
    #: run's iterations began (``note_wait``; the start-up's waits, a peer's
    #: imports or data loading, do not count)
    longest_wait = 0.0
    #: whether waits are counted yet (the first stop agreement, or the
    #: first graph iteration, sets it)
    measuring = False
    #: (name, time.monotonic()) of the first cancel this process got
    cancelled = None
    #: > 0 while this rank waits for work rank 0 does alone, a checkpoint's
    #: write or scheme none's test pass (``waiting_for_rank0``): exempt
    #: from the cancel, whose own stop may be what rank 0 writes
    exempt = 0
    #: the iteration of the last checkpoint this process saw complete
    #: (written or resumed from; train/checkpoints.py), None before any
    last_checkpoint = None


    @classmethod
    def note_wait(cls, seconds):
        """A wait on peers (or a step of the graph) of ``seconds`` ended:
        the longest lengthens the cancel's grace (``cancel_grace``)."""
        if cls.measuring and seconds > cls.longest_wait:
            cls.longest_wait = seconds

    @classmethod
    def cancel_grace(cls):
        """Seconds a wait must be, and the cancel must be, before the cancel
        ends the wait: ``CANCEL_GRACE`` (5 s), or ``CANCEL_GRACE_FACTOR``
        (2) times the longest wait this rank saw end in the run where that
        is more. A healthy peer at a notice ends the step it is in, then
        comes: it keeps this rank waiting no longer than it did before, as
        long again is the margin for a loaded node. (Where that is more
        than ``parallel.stall_timeout``, the stall timeout ends the wait
        first, as without a cancel.)"""
        return max(cls.CANCEL_GRACE, cls.CANCEL_GRACE_FACTOR * cls.longest_wait)

    @classmethod
    @contextlib.contextmanager
    def waiting_for_rank0(cls):
        """While in it, a cancel ends no wait of this rank (``cancelled_wait``):
        the ranks other than 0 while rank 0 works alone -- a checkpoint's
        streamed sections (a sharded save gathers each bucket as rank 0's
        write of the last one ends: a slow file system kept them waiting
        more than the grace, and the cancel that asked for this checkpoint
        ended the job without it), scheme none's test pass (rank 0 reads the
        whole split alone: a first pass longer than the grace after a
        notice ended the job without the stop's checkpoint). A peer that
        stops then still ends the job at the stall timeout."""
        cls.exempt += 1
        try:
            yield
        finally:
            cls.exempt -= 1

    @classmethod
    def cancelled_wait(cls, started):
        """The cancel's name (SIGTERM, ...) when a wait on peers begun at
        ``started`` (time.monotonic()) should end now: a cancel came, and
        both it and the wait are ``cancel_grace()`` seconds old -- a peer
        that has not come by then is stopped or wedged, and the stall
        timeout (300 s by default) would outlast SLURM's KillWait (30 s).
        None otherwise."""
        got = cls.cancelled
        if got is None or cls.exempt or time.monotonic() - max(started, got[1]) < cls.cancel_grace():
            return None
        return got[0]

    @classmethod
    def got(cls, name):
        """A signal ``name`` arrived: the first cancel among them is kept
        with its time."""
        if name in cls.CANCELS and cls.cancelled is None:
            cls.cancelled = (name, time.monotonic())

    @classmethod
    def reset(cls, keep=False):
        """A run begins (``StopSignal.new_run``): an earlier run's longest
        wait, last checkpoint and exemptions go; its cancel too unless
        ``keep`` (a notice that came before this run's trainer existed)."""
        cls.longest_wait = 0.0
        cls.measuring = False
        cls.last_checkpoint = None
        cls.exempt = 0
        if not keep:
            cls.cancelled = None


def stopped_while_stalled(rank, signal_name, what, waited, who):
    """The StoppedWhileStalled of rank ``rank``: ``what`` (an op, a
    collective) waited ``waited`` seconds for ``who`` when ``signal_name``
    came."""
    last = Cancel.last_checkpoint
    kept = (f"the last complete one is that of iteration {last}" if last is not None
            else "the run has none before it")
    return StoppedWhileStalled(
        f"rank {rank}: stopped by {signal_name} while {what} was stalled ({waited:.0f} s; "
        f"{who}): no checkpoint written (one needs every rank); {kept}", signal_name)
