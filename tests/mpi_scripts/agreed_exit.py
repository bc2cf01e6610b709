"""How a job ends when its ranks end with threads of theirs running (a
parameter-server run's workers: prefetch and dispatcher threads), where no
rank may call MPI_Finalize and every rank ends by ``os._exit``. argv[1]:

- ``all``: every rank hits the same user error (report_user_error: the ranks
  agree, rank 0 prints it); the ranks then leave one after another, 0.3 s
  apart (as on a loaded machine): the job must end with 2, not with
  Hydra's 9 for ranks it killed once the first had gone;
- ``dies``: rank 1 ends by ``os._exit(5)`` with no agreement (a crash)
  while the others wait in a barrier: the launcher must still end the job
  at once.

Each rank has an idle thread of ours running."""
import os
import sys
import threading

from common import world  # (sys.path: the repository)
from purine_mpi.base.errors import UserError
from purine_mpi.comm import world as world_mod

w = world()
mode = sys.argv[1]
idle = threading.Event()
threading.Thread(target=idle.wait, name="idle-of-ours", daemon=True).start()

leave = world_mod._exit_unfinalized


def staggered(code):
    import time
    time.sleep(0.3 * w.rank)
    leave(code)


world_mod._exit_unfinalized = staggered
if mode == "all":
    world_mod.report_user_error(UserError("a user error on every rank, on purpose"))
    sys.exit(7)  # never: report_user_error ends a rank of several
if mode == "dies" and w.rank == 1:
    os._exit(5)
w.barrier()  # the others wait here for rank 1, which never comes
print(f"DONE rank {w.rank}", flush=True)
