"""A peer frozen before a collective outside the graph (tests/test_stall_cancel.py):
rank 1 stops itself (SIGSTOP) before a barrier that the others wait in under
a 3 s stall timeout; each of them must name rank 1 when it gives up."""
import os
import signal

from common import world  # (sys.path: the repository)

w = world()
w.stall_timeout = 3.0
w.barrier("the start-up barrier")  # every rank is up
if w.rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # frozen; the launcher kills it once a peer aborts
w.barrier("the frozen peer's barrier")
print(f"DONE rank {w.rank}", flush=True)
