"""Windows are freed on every way out (comm/windows.py), and the MPI library
says nothing: argv[1] is

- ``normal``: the script ends (atexit frees them, before MPI_Finalize);
- ``error_all``: every rank hits the same user error (report_user_error:
  rank 0 prints it, every rank frees its windows and finalizes, exit 2);
- ``error_one``: rank 1 alone hits a user error (it aborts the job, exit 2;
  the library reclaims the windows with the processes).

Each rank prints ``FREED rank R`` once its windows are gone (a check that
runs after the module's own exit hooks)."""
import atexit
import sys


def check_freed():
    from purine_mpi.comm.windows import live_windows
    if not live_windows() and wins.freed:
        print(f"FREED rank {w.rank}", flush=True)


atexit.register(check_freed)  # before windows.py registers free_all: runs after it

import numpy as np  # noqa: E402

from common import world  # noqa: E402  (sys.path: the repository)
from purine_mpi.base.errors import UserError  # noqa: E402
from purine_mpi.comm import world as world_mod  # noqa: E402
from purine_mpi.comm.windows import WindowLayout, Windows  # noqa: E402

w = world()
mode = sys.argv[1]
layout = WindowLayout()
for r in range(w.size):
    layout.add(f"x{r}", r, (1000,), "float32", peers=[(r + 1) % w.size])
    layout.add_word(f"w{r}", r, peers=[(r + 1) % w.size])
wins = Windows.allocate(w, layout)
wins.put(f"x{(w.rank - 1) % w.size}", np.ones(1000, np.float32))
wins.notify(f"w{(w.rank - 1) % w.size}")
wins.wait_notified(f"w{w.rank}", 1, timeout=30)
world_mod.FINALIZE_HOOKS.append(check_freed)
if mode == "error_all" or (mode == "error_one" and w.rank == 1):
    world_mod.report_user_error(UserError(f"a user error on purpose ({mode})"))
    sys.exit(2)
print(f"DONE rank {w.rank}", flush=True)
