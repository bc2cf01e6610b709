"""A stop notice that comes just as ``finalize_mpi`` catches the notices
again is answered (comm/world.py): the wakeup fd the watcher reads is set
before the handlers are put in place. Before, the handlers came first, and a
notice in the few microseconds until ``set_wakeup_fd`` ran the no-op handler
alone: it was lost, and the rank waited on in MPI_Finalize for a peer that
never came. The notice is sent here from inside ``signal.signal`` itself, just
as the handler of SIGTERM is put in place; MPI_Finalize is a stand-in that
waits 20 s (no launcher, no MPI: a fake ``mpi4py.MPI`` of two ranks)."""
import os
import subprocess
import sys
import time

from tests.conftest import REPO

SCRIPT = r"""
import os, signal, sys, time, types
mpi = types.ModuleType("mpi4py.MPI")  # no __file__: MPI_Finalize is the module's own
mpi.Is_initialized = lambda: True
mpi.Is_finalized = lambda: False
mpi.COMM_WORLD = types.SimpleNamespace(Get_size=lambda: 2)
mpi.Finalize = lambda: time.sleep(20.0)  # a peer that never finalizes
sys.modules["mpi4py.MPI"] = mpi
from purine_mpi.comm import world
real = signal.signal

def signal_then_notice(signum, handler):
    old = real(signum, handler)
    if signum == signal.SIGTERM and callable(handler):
        os.kill(os.getpid(), signal.SIGTERM)  # the notice, the moment it is caught
    return old

signal.signal = signal_then_notice
for n in (signal.SIGTERM, signal.SIGHUP):
    real(n, signal.SIG_IGN)  # as ignore_late_notices leaves them
print("finalize returned", world.finalize_mpi(7, grace_s=0.3), flush=True)
"""


def test_a_notice_as_finalize_mpi_catches_the_notices_is_answered():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    took = time.monotonic() - t0
    # before: the notice was lost, the stand-in MPI_Finalize ran its 20 s and returned (0)
    assert res.returncode == 7, (res.returncode, res.stdout, res.stderr[-1500:])
    assert "finalize returned" not in res.stdout, res.stdout
    assert took < 10, took
