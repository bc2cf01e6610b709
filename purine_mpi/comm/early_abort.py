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
import sys
import traceback

from .launcher import launched_rank, launched_size, size_untold


def _handle(exc_type, exc, tb):
    if issubclass(exc_type, KeyboardInterrupt):
        return sys.__excepthook__(exc_type, exc, tb)
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


def abort(code):
    """Initialise MPI if needed and abort the whole job with ``code``; exits
    this process with ``code`` where MPI cannot be had."""
    try:
        from .mpi_init import import_mpi
        MPI = import_mpi()
        if not MPI.Is_finalized():
            try:
                from .world import _abort_job
            except BaseException:  # the failing import may be world's own
                MPI.COMM_WORLD.Abort(code)
            else:
                _abort_job(MPI, code)
    except BaseException:
        pass
    os._exit(code)


def install(environ=os.environ):
    """Installs the hook under a launcher with several ranks (or one that
    does not say how many: ``mpiexec -pmi-port``, where a job of one rank
    ends 1 through MPI_Abort as it would without), unless a hook other than
    Python's own is in place already; returns whether it did."""
    if launched_size(environ) < 2 and not size_untold(environ):
        return False
    if sys.excepthook is not sys.__excepthook__:
        return False
    sys.excepthook = _handle
    return True
