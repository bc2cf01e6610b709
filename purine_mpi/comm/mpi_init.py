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

MPI_Init waits for every rank of the job to reach its own (MPICH: a PMI
barrier), so a rank whose peer never comes (hung or slow before MPI) waits
there for ever. mpi4py initialises MPI inside its module's import, holding
the interpreter: a stop notice caught by a Python handler (``train``'s early
handler, runtime/stop.py) was never answered, and only SIGKILL ended the
rank. So mpi4py is imported with ``rc.initialize`` off and MPI_Init_thread
is called here through ctypes, which lets go of the interpreter, with the
level mpi4py would have asked for (``rc.threads``, ``rc.thread_level``) and
its error handlers set after (``rc.errors``); mpi4py still finalizes MPI at
exit (``rc.finalize`` on where it was left to mpi4py). A thread of ours,
woken by the signal's byte on Python's wakeup fd, ends a rank whose
MPI_Init has not returned ``INIT_GRACE_S`` after a notice (``NOTICES``
with a Python handler; one recorded before, ``notice_received``) with the
status 128 + the signal's number; a notice during an MPI_Init that returns
in time is answered by its handler after, as before. Where MPI_Init_thread
cannot be found in mpi4py's extension (``libmpi_function``), mpi4py's own
``MPI.Init_thread`` initialises MPI, without that watch.
"""
import ctypes
import os
import signal
import sys
import threading

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


#: the stop notices a rank in MPI_Init answers where a Python handler
#: catches them (SIGINT too: Python's KeyboardInterrupt, which cannot come
#: before MPI_Init returns either)
NOTICES = ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGINT")
#: seconds MPI_Init may go on after a notice (every rank started: it
#: returns in milliseconds, and the handler then answers the notice)
INIT_GRACE_S = 2.0
#: the numbers of the notices a Python handler recorded before MPI started
_received = []


def notice_received(signum):
    """A stop notice's Python handler got ``signum`` before MPI started
    (``StopSignal.install_early``): MPI_Init, should it wait longer than
    ``INIT_GRACE_S``, ends the rank as on a notice during it."""
    _received.append(int(signum))


def libmpi_function(MPI, name):
    """The MPI library's function ``name`` as mpi4py's extension links it,
    called through ctypes (which lets go of the interpreter), or None where
    it cannot be found so (MPI linked into the extension with hidden
    symbols, another mpi4py build): the caller then uses mpi4py's own."""
    try:
        function = getattr(ctypes.CDLL(MPI.__file__), name)
    except (OSError, AttributeError, TypeError):
        return None
    function.restype = ctypes.c_int
    return function


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _stopped_in_init(signum):
    """End this rank, whose MPI_Init still waits ``INIT_GRACE_S`` after the
    stop notice ``signum``: one line, the status 128 + ``signum``."""
    _flush()
    name = signal.Signals(signum).name
    rank = f"rank {launched_rank()}: " if launched_size() > 1 else ""
    line = (f"error: {rank}stopped by {name} while MPI was starting: MPI_Init still waited "
            f"for the other ranks {INIT_GRACE_S:g} s after it (a rank that never started MPI: "
            "hung or slow before it); nothing was written\n")
    try:
        os.write(2, line.encode())
    except OSError:
        pass
    remove_mpi_shm()
    os._exit(128 + signum)


def watch_notices(numbers, grace_s, end, status, name, first=None):
    """Python's wakeup fd on a pipe, read by a thread (``name``) that ends
    the rank when the call it watches (MPI_Init, MPI_Finalize: the caller
    runs it between this and ``stop()``) has not returned ``grace_s`` after
    one of the signal ``numbers``: ``end(signum)`` ends the process.
    ``first``: a notice recorded before, whose grace runs from now. Returns
    ``stop(settle=None)``, called once the watched call returned: it ends the
    watch (``settle``, where given, runs before the wakeup fd is restored),
    or, where the watcher is already ending the rank, ends it too with
    ``status(signum)`` after its MPI shared memory is removed. Returns None
    where no pipe or thread can be had (``ulimit -n`` at its end): the call
    then goes on unwatched."""
    try:
        read, write = os.pipe()
    except OSError:
        return None
    os.set_blocking(write, False)
    old_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)  # a byte per signal
    done = threading.Event()
    # taken once, by whichever comes first: stop() (the call returned: the
    # rank goes on) or the watcher at the grace's end (the rank ends). A
    # call that returns just as the grace ends then never lets the main
    # thread go on while the watcher ends the rank (it may be held up: a full
    # stdout pipe), which ended a running train at a random place
    settled = threading.Lock()
    notice = []

    def watch():
        while not done.is_set():
            try:
                got = os.read(read, 64)
            except OSError:
                return
            if not got:  # the write end closed: the watch is over
                return
            hit = [n for n in got if n in numbers]
            if hit:
                notice.append(hit[0])
                if not done.wait(grace_s) and settled.acquire(blocking=False):
                    end(hit[0])

    watcher = threading.Thread(target=watch, name=name, daemon=True)
    try:
        watcher.start()
    except RuntimeError:  # no thread to be had: the call as before, unwatched
        signal.set_wakeup_fd(old_fd)
        os.close(write)
        os.close(read)
        return None
    if first is not None:
        os.write(write, bytes([first]))

    def stop(settle=None):
        if not settled.acquire(blocking=False):  # the watcher is ending the rank
            watcher.join(grace_s)
            remove_mpi_shm()
            os._exit(status(notice[0]))
        done.set()
        if settle is not None:
            settle()
        signal.set_wakeup_fd(old_fd)
        os.close(write)
        watcher.join(1.0)
        if not watcher.is_alive():
            os.close(read)
    return stop


def _watched(numbers):
    """The stop notices ``numbers`` watched around MPI_Init
    (``watch_notices``): the rank ends when MPI_Init has not returned
    ``INIT_GRACE_S`` after one (``_stopped_in_init``); returns ``stop()``,
    or None where no pipe can be had (``ulimit -n`` at its end: MPI_Init
    then fails, with its own message and the status 70, see above)."""
    first = next((n for n in _received if n in numbers), None)  # recorded before
    return watch_notices(numbers, INIT_GRACE_S, _stopped_in_init, lambda signum: 128 + signum,
                         "init-notices", first)


def _notices():
    """The numbers of ``NOTICES`` a Python handler catches now."""
    numbers = set()
    for name in NOTICES:
        n = getattr(signal, name, None)
        if n is not None and callable(signal.getsignal(n)):
            numbers.add(int(n))
    return numbers


def _initialize(MPI):
    """MPI_Init_thread (or MPI_Init) as mpi4py's import would have called
    it (its ``rc`` read there: the environment's MPI4PY_RC_* set in it), with
    the interpreter let go, the stop notices watched; then mpi4py's error
    handlers on COMM_SELF and COMM_WORLD (mpi4py's ``initialize``)."""
    from mpi4py import rc
    threads = getattr(rc, "threads", True) in (True, "yes")
    levels = {"single": MPI.THREAD_SINGLE, "funneled": MPI.THREAD_FUNNELED,
              "serialized": MPI.THREAD_SERIALIZED, "multiple": MPI.THREAD_MULTIPLE}
    required = levels.get(getattr(rc, "thread_level", "multiple"), MPI.THREAD_MULTIPLE)
    init = libmpi_function(MPI, "MPI_Init_thread" if threads else "MPI_Init")
    if init is None:  # mpi4py's own: holds the interpreter (no watch)
        if threads:
            MPI.Init_thread(required)
        else:
            MPI.Init()
        return
    numbers = _notices() if threading.current_thread() is threading.main_thread() else set()
    stop = _watched(numbers) if numbers else None
    try:
        if threads:
            provided = ctypes.c_int(0)
            ierr = init(None, None, ctypes.c_int(required), ctypes.byref(provided))
        else:
            ierr = init(None, None)
    finally:
        if stop is not None:
            stop()
    if ierr != 0:  # as mpi4py's import reports it
        raise RuntimeError(f"{'MPI_Init_thread' if threads else 'MPI_Init'}() failed "
                           f"[error code: {ierr}]")
    errors = getattr(rc, "errors", "exception")
    if errors != "default":  # 'default': the library's own
        # another value: mpi4py warns (in its import, above) and keeps 'exception'
        handler = {"fatal": MPI.ERRORS_ARE_FATAL,
                   "abort": getattr(MPI, "ERRORS_ABORT", MPI.ERRORS_ARE_FATAL)}.get(
                       errors, MPI.ERRORS_RETURN)
        for comm in (MPI.COMM_SELF, MPI.COMM_WORLD):
            comm.Set_errhandler(handler)


def import_mpi():
    """``mpi4py.MPI``, initialising MPI on the first call: a failure of
    MPI_Init ends the process with one line and the status 70; a stop
    notice ends a rank whose MPI_Init waits for a peer (see above)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        return mpi
    # not imported yet, or imported and never initialised: an exception (a
    # Ctrl-C) between the import below and MPI_Init left it so, and
    # early_abort.interrupted, which comes here next, then called
    # MPI_Abort on an MPI never started: its peers waited in MPI_Init for ever
    set_mpi_environment()
    import mpi4py
    rc = mpi4py.rc
    saved = rc.initialize, rc.finalize
    rc.initialize = False  # MPI_Init is ours (below)
    if rc.finalize is None:  # mpi4py's default: it finalizes what it initialised
        rc.finalize = True
    armed = _arm()
    try:
        try:
            from mpi4py import MPI
        finally:
            rc.initialize, rc.finalize = saved
        if not MPI.Is_initialized():  # (MPI4PY_RC_INITIALIZE=1 in the environment: mpi4py's)
            _initialize(MPI)
    finally:
        _disarm(armed)
    return MPI


#: the names the MPI library gives its shared-memory segments in /dev/shm
#: (MPICH: mpich_shm_<hex>_<n>, one per node and job, 2-4 MiB)
MPI_SHM_PREFIXES = ("mpich_shm_",)


def remove_mpi_shm():
    """Unlink the MPI library's /dev/shm segments this process maps (read
    from /proc/self/maps: this job's, never another's), for a rank that ends
    without MPI_Finalize -- MPI_Abort, ``os._exit`` -- where MPICH removes
    its segment in MPI_Finalize only and it stayed in /dev/shm for good. The
    ranks of the node map the same segment; their mappings stay valid, only
    the name goes. A segment of another node is that node's ranks'."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        fields = line.split(None, 5)
        path = fields[5] if len(fields) == 6 else ""
        if path.startswith("/dev/shm/") and os.path.basename(path).startswith(MPI_SHM_PREFIXES) \
                and not path.endswith(" (deleted)"):
            try:
                os.unlink(path)
            except OSError:  # another rank of the node was first
                pass


def _abort_job(MPI, code):
    """MPI_Abort of the whole job with ``code``, MPICH's own "Abort(N) on
    node R" line silenced (our message says it all) and its /dev/shm segment
    removed first (MPI_Abort leaves it). Here, not in world.py, so that
    early_abort (which world's hook calls) reaches it without importing
    world: no import circle (tests/test_layers.py)."""
    _silence_stderr()
    remove_mpi_shm()
    MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def _silence_stderr():
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
    except OSError:
        pass
