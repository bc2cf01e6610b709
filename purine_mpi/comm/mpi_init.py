"""Where MPI is initialised (``import_mpi``: mpi4py calls MPI_Init_thread when
``mpi4py.MPI`` is first imported), and what happens when that fails.

MPI_Init does not return an error: MPICH prints its error stack and calls
``exit()`` with an MPI error code, of which the shell sees the low byte --
any status at all (``ulimit -n 12`` gave 143, the status of a run stopped by
SIGTERM with a checkpoint). A C exit handler armed around the import turns
that exit into one line and the status ``MPI_INIT_FAILED`` (70), and is
taken out of libc's list as soon as MPI is up (``__cxa_finalize`` on its own
handle), so a normal exit never calls into a finished interpreter.

The MPI library's environment (comm/launcher.py, ``MPI_ENV_DEFAULTS``: UCX
must not take SIGHUP) is exported here too, before the library loads.
"""
import ctypes
import os
import sys

from ..base.errors import MPI_INIT_FAILED
from .launcher import launched_rank, launched_size, set_mpi_environment

_armed = False
_guard = None  # the ctypes callback: kept alive while libc holds it


def _init_failed_message():
    rank = f"rank {launched_rank()}: " if launched_size() > 1 else ""
    return (f"error: {rank}MPI failed to initialise (MPI_Init aborted; the MPI library's own "
            "message above says why, e.g. too many open files: raise 'ulimit -n', or a "
            f"network the MPI library cannot use); exit status {MPI_INIT_FAILED}")


def _on_exit(arg):
    if _armed:  # MPI_Init is calling exit(): replace its status by ours
        try:
            sys.stdout.flush()
        except Exception:
            pass
        data = (_init_failed_message() + "\n").encode()
        try:
            os.write(2, data)
        except OSError:
            pass
        os._exit(MPI_INIT_FAILED)


def _arm():
    """Register the exit handler; returns its handle (None where libc has
    no ``__cxa_atexit``/``__cxa_finalize``: MPI's own status then stands)."""
    global _armed, _guard
    try:
        libc = ctypes.CDLL(None)
        register, finalize = libc.__cxa_atexit, libc.__cxa_finalize
    except (OSError, AttributeError):
        return None
    _guard = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_on_exit)
    handle = ctypes.create_string_buffer(1)  # a unique address: the handler's "DSO"
    if register(_guard, None, ctypes.cast(handle, ctypes.c_void_p)) != 0:
        return None
    _armed = True
    return finalize, handle


def _disarm(armed):
    global _armed
    _armed = False
    if armed is not None:
        finalize, handle = armed
        finalize(ctypes.cast(handle, ctypes.c_void_p))  # runs it (a no-op now), removes it


def import_mpi():
    """``mpi4py.MPI``, initialising MPI on the first call: a failure of
    MPI_Init ends the process with one line and the status 70."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        return mpi
    set_mpi_environment()
    armed = _arm()
    try:
        from mpi4py import MPI
    finally:
        _disarm(armed)
    return MPI
