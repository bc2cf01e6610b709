"""Our abort paths leave nothing of the MPI library's in /dev/shm.

    mpiexec -n 2 python tests/mpi_scripts/shm_abort.py MODE

Every rank prints ``SHM <names>``: the /dev/shm segments it maps (MPICH's
``mpich_shm_*``, the test checks they are gone when the job has ended),
then, a moment later: ``one``: rank 1 has a user error the others do not
(report_user_error: MPI_Abort); ``plain``: rank 1 raises RuntimeError (the
abort handler: MPI_Abort); ``interrupt``: every rank is interrupted at once
(a second Ctrl-C: os._exit); ``all``: a user error on every rank (MPI_Finalize).
"""
import json
import os
import sys
import time

from common import world

from purine_mpi.base.errors import UserError
from purine_mpi.comm.mpi_init import MPI_SHM_PREFIXES
from purine_mpi.comm.world import report_user_error
from purine_mpi.runtime.stop import StopSignal
import purine_mpi.train.checkpoints  # noqa: F401,E402  (registers train's cleanups, as train has)

mode = sys.argv[1]
w = world()
with open("/proc/self/maps") as f:
    paths = [line.split(None, 5)[-1] for line in f.read().splitlines()]
names = sorted({os.path.basename(p) for p in paths if p.startswith("/dev/shm/")
                and os.path.basename(p).startswith(MPI_SHM_PREFIXES)})
os.write(1, ("SHM " + json.dumps(names) + "\n").encode())  # one write: ranks' lines never mix
w.comm.Barrier()
time.sleep(0.5)
if mode == "interrupt":
    StopSignal.interrupt_now()
if mode == "plain" and w.rank == 1:
    raise RuntimeError("plain failure on purpose")
if mode == "all" or w.rank == 1:
    report_user_error(UserError("bad input on purpose"))
time.sleep(60)  # rank 0 of 'one' and 'plain': until the abort ends it
