"""Windows (comm/windows.py) on K ranks: every rank owns a region and a
notify word; each rank puts into its right neighbour's region, notifies it,
waits for its own left neighbour's write, gets from the left neighbour,
accumulates into rank 0; every value is a closed form of rank and size.

argv[1]: "shared" (one node: a shared window) or "rma" (each rank its own
emulated host via PURINE_RANKS_PER_HOST=1: an RMA window). argv[2]: rounds."""
import sys

import numpy as np

from common import ok, world  # noqa: F401  (sys.path: the repository)
from purine_mpi.comm.windows import WindowLayout, Windows, live_windows, free_all

w = world()
kind, rounds = sys.argv[1], int(sys.argv[2])
n, me = w.size, w.rank
right, left = (me + 1) % n, (me - 1) % n
layout = WindowLayout()
for r in range(n):
    layout.add(f"act{r}", r, (3, 5), "float32", peers=[(r - 1) % n, (r + 1) % n])
    layout.add_word(f"written{r}", r, peers=[(r - 1) % n])
    layout.add_word(f"free{r}", r, peers=[(r + 1) % n])
layout.add("sum", 0, (7,), "float64", peers=range(n))
wins = Windows.allocate(w, layout)
assert live_windows() == [wins]
expected_where = "shared" if kind == "shared" else ("rma" if n > 1 else "shared")
assert wins.where(f"act{right}") == expected_where, (wins.where(f"act{right}"), kind)
assert wins.local(f"act{me}").shape == (3, 5)
assert (wins.view(f"act{right}") is not None) == (expected_where == "shared")

for k in range(1, rounds + 1):
    # may we write into right's region? it says so on our word free{me}
    wins.wait_notified(f"free{me}", k - 1, timeout=30, what="free")
    src = np.full((3, 5), 100.0 * k + me, np.float32) + np.arange(15, dtype=np.float32).reshape(3, 5)
    wins.put(f"act{right}", src)
    wins.notify(f"written{right}")
    wins.wait_notified(f"written{me}", k, timeout=30, what="written")
    got = wins.local(f"act{me}").copy()
    want = np.full((3, 5), 100.0 * k + left, np.float32) + np.arange(15, dtype=np.float32).reshape(3, 5)
    assert np.array_equal(got, want), (k, got, want)
    # read back what we wrote into right's region, one-sided
    back = np.empty((3, 5), np.float32)
    wins.get(f"act{right}", back)
    assert np.array_equal(back, src), (back, src)
    wins.notify(f"free{left}")  # left may write into our region again
    w.barrier()  # every rank read round k before the next accumulate round starts

for k in range(rounds):
    wins.accumulate("sum", np.arange(7, dtype=np.float64) * (me + 1))
w.barrier()
if me == 0:
    total = wins.local("sum")
    assert np.array_equal(total, np.arange(7) * rounds * n * (n + 1) / 2), total
assert wins.notified(f"written{me}") == rounds
c = wins.counters()
if expected_where == "rma":
    assert c["bytes_put"] == rounds * 60 and c["bytes_copied"] == 0, c
    assert c["bytes_got"] == rounds * 60 and c["bytes_accumulated"] == rounds * 56, c
else:
    assert c["bytes_put"] == 0 and c["bytes_copied"] == 2 * rounds * 60, c
free_all()
assert live_windows() == [] and wins.freed
wins.free()  # a second free is a no-op
ok(f"rma_windows {kind}")
