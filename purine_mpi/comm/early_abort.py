"""A rank that dies before MPI is up must still end the job.

Under MPICH's Hydra, a rank that exits before ``MPI_Init`` (an import that
fails on one node, a bug at start-up) leaves the other ranks blocked in
``MPI_Init`` for ever: the launcher waits for the missing rank to join, and
does not end the job for a plain non-zero exit (measured: ``mpiexec -n 3``
with rank 0 raising ImportError before ``from mpi4py import MPI`` was still
running after 60 s). The command line (``purine_mpi/cli.py``, behind both
``python -m purine_mpi`` and the ``purine-mpi`` script) therefore installs
this module's ``sys.excepthook`` before its other imports, under a launcher
with more than one rank: an uncaught exception prints its traceback, then the
rank initialises MPI itself (the others are waiting for it there) and calls
``MPI_Abort``, which ends every rank with status 1. Once the world exists,
``comm/world.install_abort_handler`` replaces this hook with the full one.
"""
import os
import signal
import sys
import threading
import traceback

from .launcher import launched_rank, launched_size, size_untold


def _handle(exc_type, exc, tb):
    if issubclass(exc_type, KeyboardInterrupt):  # Ctrl-C before the command ran (an import)
        interrupted()
    if _stalled(exc_type) and not _debug():  # a peer that never came to a start-up
        # collective (comm/world.py: the world's duplicates): the op, one line
        # (a traceback only with --debug, as the world's own hook does)
        text = f"error: {exc}; ending every rank (MPI_Abort)\n"
    else:  # a bug, or an import that failed: its traceback
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        text += (f"error: rank {launched_rank()}: {exc_type.__name__} before the job started; "
                 "ending every rank (MPI_Abort)\n")
    try:
        sys.stdout.flush()
    except Exception:
        pass
    try:
        os.write(2, text.encode(errors="replace"))  # one write: the ranks' lines never mix
    except OSError:
        pass
    abort(1)


def _stalled(exc_type):
    """Whether ``exc_type`` is a StallError (a collective a peer never came to)."""
    try:
        from ..base.errors import StallError
    except BaseException:  # the failing import may be this one
        return False
    return issubclass(exc_type, StallError)


def _debug():
    """--debug (PURINE_DEBUG on; a bad value counts as on, as in comm/world.py)."""
    try:
        from ..base import env
    except BaseException:
        return True
    try:
        return bool(env.get("PURINE_DEBUG"))
    except Exception:
        return True


def abort(code):
    """Initialise MPI if needed and abort the whole job with ``code``; exits
    this process with ``code`` where MPI cannot be had."""
    try:
        from .mpi_init import _abort_job, import_mpi
        MPI = import_mpi()
        if not MPI.Is_finalized():
            _abort_job(MPI, code)
    except BaseException:
        pass
    os._exit(code)


#: the exit status of a job a Ctrl-C (SIGINT) ended before its run began
INTERRUPTED = 128 + int(signal.SIGINT)


def several_launched(environ=os.environ):
    """Whether a launcher started this process as one of several ranks (or
    did not say how many: ``mpiexec -pmi-port``)."""
    return launched_size(environ) >= 2 or size_untold(environ)


def interrupted():
    """End every rank of the job after a Ctrl-C (SIGINT: Python's
    KeyboardInterrupt) that came to this rank before the run's own handler
    took it (runtime/stop.py: from the trainer on), with the status 130 and
    one line. Never returns.

    Why: a rank that simply exits before MPI_Init leaves its peers blocked
    in MPI_Init for ever (Hydra ends the job for a rank that dies after it
    connected to the launcher only), and one that exits after it, while a
    peer is still on its way to a start-up collective, leaves that peer
    waiting there until its stall timeout. Measured with ``kill -INT`` to
    rank 0 alone of ``mpiexec -n 2 ... train``, rank 1 slow to start: rank 0
    said "interrupted" and ended 130, and the job ran on until killed.

    So the rank initialises MPI itself (the peers that came wait for it
    there): MPI_Init is watched as for any notice (comm/mpi_init.py), so a
    peer that never comes ends this rank 2 s on with its own line and 130
    (the launcher then kills the rest); MPI up, ``MPI_Abort(130)`` ends
    every rank at once. A second Ctrl-C meanwhile changes nothing."""
    if threading.current_thread() is threading.main_thread():
        try:  # callable: MPI_Init is watched for it; a second Ctrl-C is no exception here
            signal.signal(signal.SIGINT, lambda *_: None)
        except (ValueError, OSError):
            pass
    # only then the flush, which can wait (a full pipe to the launcher): a
    # second Ctrl-C there -- mpiexec passes the terminal's on, so one press
    # comes twice -- raised a KeyboardInterrupt out of this function, and
    # out of the excepthook that called it: the rank ended 1 without ending
    # the job
    from .mpi_init import _abort_job, _flush, notice_received
    _flush()
    notice_received(signal.SIGINT)  # the watch's grace runs from now
    try:
        from .mpi_init import import_mpi
        MPI = import_mpi()
        up = not MPI.Is_finalized()
    except BaseException:
        MPI, up = None, False
    line = (f"error: rank {launched_rank()}: interrupted (SIGINT) before the run began; "
            f"ending every rank, exit status {INTERRUPTED}\n")
    try:
        os.write(2, line.encode())
    except OSError:
        pass
    try:  # train.log's last line (rank 0), and the run folder's lock released: a
        # folder this run made that holds that lock alone (a Ctrl-C during
        # parallel.scheme auto's choice) removed, as a single rank's 130 does
        from ..base import logfile
        logfile.end_run(INTERRUPTED)
    except BaseException:
        pass
    if up:
        _abort_job(MPI, INTERRUPTED)
    os._exit(INTERRUPTED)


def install(environ=os.environ):
    """Installs the hook under a launcher with several ranks (or one that
    does not say how many: ``mpiexec -pmi-port``, where a job of one rank
    ends 1 through MPI_Abort as it would without), unless a hook other than
    Python's own is in place already; returns whether it did."""
    if not several_launched(environ):
        return False
    if sys.excepthook is not sys.__excepthook__:
        return False
    sys.excepthook = _handle
    return True
