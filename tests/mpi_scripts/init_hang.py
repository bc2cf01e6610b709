"""A rank in MPI_Init whose peer never starts MPI (hung or slow before it),
as ``train`` starts (cli.py: ``StopSignal.install_early``, then the world,
whose first use initialises MPI). argv[1]: a file rank 0 writes its pid to,
(whole: renamed into place) just before it initialises MPI; rank 1 sleeps
before importing mpi4py (argv[2]: seconds, default 300), so rank 0 waits in
MPI_Init until a stop notice ends it (comm/mpi_init.py). argv[3] ``early``
(optional): rank 0 gets the notice before it initialises MPI (recorded by
the early handler), as a rank whose peer still imports."""
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from purine_mpi.comm.launcher import launched_rank  # noqa: E402
from purine_mpi.runtime.stop import StopSignal  # noqa: E402

StopSignal.install_early()
if launched_rank() == 1:
    time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 300.0)
else:
    if sys.argv[3:] == ["early"]:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert StopSignal.early == "SIGTERM", StopSignal.early
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
from purine_mpi.comm.mpi_init import import_mpi  # noqa: E402

MPI = import_mpi()
MPI.COMM_WORLD.Barrier()
print(f"rank {MPI.COMM_WORLD.Get_rank()}: MPI up, early notice {StopSignal.early}", flush=True)
sys.exit(StopSignal.exit_status(StopSignal.early))
