"""A rank waiting in MPI_Init for a peer that never starts MPI (hung or slow
before it) ends on a stop notice (SIGTERM: Slurm's, a user's ``kill PID``)
2 s later with the status 143 and one line (comm/mpi_init.py). Before:
mpi4py initialised MPI inside its import, holding the interpreter, so the
Python handler ``train`` installs early (runtime/stop.py) never ran and only
SIGKILL ended the rank. Also: MPI's functions not found through ctypes
(``libmpi_function``) fall back to mpi4py's own, at start and at the end."""
import ctypes
import os
import signal
import subprocess
import sys
import time

import pytest

from purine_mpi.comm import mpi_init
from tests.mpi_scripts.launch import HERE, ROOT, mpiexec_args, run_mpi

pytestmark = pytest.mark.mpi

STOPPED = "stopped by SIGTERM while MPI was starting"


def _start(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    pid = tmp_path / "rank0.pid"
    proc = subprocess.Popen(mpiexec_args(2) + [sys.executable, os.path.join(
        HERE, "init_hang.py"), str(pid)] + [str(a) for a in args], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True)
    return proc, pid


def _wait(proc, timeout, what):
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{what}\n{out[-1500:]}\n{err[-1500:]}")
    return proc.communicate()


def test_sigterm_ends_a_rank_waiting_in_mpi_init_for_a_peer(tmp_path):
    proc, pid_file = _start(tmp_path, 300)  # rank 1 sleeps before MPI
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail("rank 0 never reached MPI_Init")
            time.sleep(0.05)
        time.sleep(1.0)  # inside MPI_Init: rank 1 never comes
        assert proc.poll() is None, "the job ended though rank 1 never started MPI"
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
        sent = time.monotonic()
        out, err = _wait(proc, 20, "rank 0, in MPI_Init, still runs 20 s after SIGTERM")
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # rank 0's 143; Hydra ORs in rank 1's 9 (killed by the launcher): 143
    assert proc.returncode == 143, (proc.returncode, out[-1500:], err[-1500:])
    assert 1.5 < took < 10, took  # the grace (2 s), then at once
    assert f"error: rank 0: {STOPPED}" in err, err[-1500:]
    assert "Traceback" not in err, err[-1500:]


@pytest.mark.parametrize("peer_sleep,status", [(300, 143), (0.3, 143)])
def test_a_notice_before_mpi_init(tmp_path, peer_sleep, status):
    """Rank 0 records a SIGTERM before MPI starts. Its peer never comes:
    MPI_Init ends it 2 s on. Its peer comes in time: MPI starts, the notice
    stands recorded (the run would stop after its first iteration), no line."""
    proc, _ = _start(tmp_path, peer_sleep, "early")
    t0 = time.monotonic()
    out, err = _wait(proc, 30, "rank 0, its SIGTERM recorded, still in MPI_Init after 30 s")
    assert proc.returncode == status, (proc.returncode, out[-1500:], err[-1500:])
    if peer_sleep > 10:
        assert STOPPED in err and time.monotonic() - t0 < 20, err[-1500:]
    else:
        assert "rank 0: MPI up, early notice SIGTERM" in out, out
        assert "rank 1: MPI up, early notice None" in out, out
        assert STOPPED not in err, err[-1500:]


def test_mpi_functions_not_found_through_ctypes_fall_back_to_mpi4py():
    """Before: ``finalize_mpi`` looked MPI_Finalize up with ctypes only, and
    a successful train ended with an AttributeError's traceback."""
    proc, _ = run_mpi("hidden_mpi_symbols.py", 2, timeout=60)
    assert proc.stdout.count("finalized without ctypes") == 2, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-1500:]


def test_libmpi_function_none_where_the_lookup_fails(monkeypatch):
    class Module:
        __file__ = "/nonexistent/mpi4py/MPI.so"
    assert mpi_init.libmpi_function(Module, "MPI_Finalize") is None  # no such file

    class NoSymbols:
        def __init__(self, *args, **kwargs):
            pass

        def __getattr__(self, name):
            raise AttributeError(name)
    monkeypatch.setattr(ctypes, "CDLL", NoSymbols)
    assert mpi_init.libmpi_function(Module, "MPI_Init_thread") is None


_RACE = r"""
import os, signal, sys, time
from purine_mpi.comm import mpi_init
mpi_init.INIT_GRACE_S = 0.5
mpi_init._flush = lambda: time.sleep(3.0)  # the watcher held up as it ends the rank (a full pipe)
signal.signal(signal.SIGUSR2, lambda *a: None)  # a stop notice's Python handler
stop = mpi_init._watched({int(signal.SIGUSR2)})
os.kill(os.getpid(), signal.SIGUSR2)
time.sleep(0.9)  # "MPI_Init" returns 0.4 s after the grace: the watcher is ending the rank
stop()
print("went on", flush=True)  # a rank with MPI up, running its job
time.sleep(4.0)
sys.exit(0)
"""


def test_mpi_init_returning_as_the_grace_ends_never_lets_the_rank_go_on():
    """The watcher and the end of MPI_Init settle the rank's fate once:
    before, ``stop()`` waited 1 s for a watcher already ending the rank and
    then let the main thread go on -- to be ended (140) in the middle of
    its run when the watcher's flush came back."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _RACE], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=60)
    assert proc.returncode == 128 + signal.SIGUSR2, (proc.returncode, proc.stderr[-1500:])
    assert "went on" not in proc.stdout, "the rank went on and was ended in its run"


def test_mpi4py_errors_policy_unknown_keeps_exceptions():
    """mpi4py warns about an MPI4PY_RC_ERRORS it does not know and keeps
    'exception' (MPI.ERRORS_RETURN on COMM_WORLD and COMM_SELF); MPI_Init
    through ctypes must set the same. Before: such a value left MPI's own
    ERRORS_ARE_FATAL, and an MPI error aborted the rank instead of raising."""
    code = ("from purine_mpi.comm.mpi_init import import_mpi\n"
            "MPI = import_mpi()\n"
            "print(all(c.Get_errhandler() == MPI.ERRORS_RETURN "
            "for c in (MPI.COMM_WORLD, MPI.COMM_SELF)))\n")
    for value, expected in (("bogus", "True"), ("exception", "True"), ("fatal", "False")):
        env = dict(os.environ, MPI4PY_RC_ERRORS=value,
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                              text=True, env=env, cwd=ROOT, timeout=60)
        assert proc.returncode == 0, proc.stderr[-1500:]
        assert proc.stdout.split() == [expected], (value, proc.stdout, proc.stderr[-1500:])
