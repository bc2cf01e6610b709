"""A rank in MPI_Finalize whose peer never finalizes, as ``train`` ends a
run (cli.py: the late notices ignored, then ``comm.world.finalize_mpi``
with the run's status). argv[1]: a file rank 0 writes before it finalizes
(a checkpoint's stand-in), then its pid to ``<argv[1]>.pid``, and
finalizes with the status 143 (a stop on SIGTERM); rank 1 sleeps instead
of finalizing, so rank 0 waits in MPI_Finalize for ever
unless a notice ends it. argv[2] ``window`` (optional): both ranks hold an
RMA window that a finalize hook frees (as comm/windows.py's ``free_all``:
a pipeline's or parameter server's windows), so rank 0 waits in the
collective MPI_Win_free, before MPI_Finalize."""
import os
import sys
import time

from common import world  # (sys.path: the repository)
from purine_mpi.comm.world import FINALIZE_HOOKS, finalize_mpi
from purine_mpi.runtime.stop import StopSignal

w = world()
if sys.argv[2:] == ["window"]:
    from mpi4py import MPI
    window = MPI.Win.Allocate(64, comm=MPI.COMM_WORLD)
    FINALIZE_HOOKS.append(window.Free)
w.barrier()  # both ranks are up
if w.rank == 1:
    time.sleep(300)  # the launcher's SIGKILL ends it (or the test's clean-up)
    sys.exit(5)
with open(sys.argv[1], "wb") as f:
    f.write(b"written before MPI_Finalize\n" * 1000)
StopSignal.ignore_late_notices()
with open(sys.argv[1] + ".pid.tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[1] + ".pid.tmp", sys.argv[1] + ".pid")  # whole, or not there
finalize_mpi(143)
sys.exit(143)
