"""The one-sided ops' two release protocols (comm/rma_ops.py) on 2 ranks,
through their kernels: rank 0 puts x = k into rank 1's region, rank 1 waits
for each write and checks it; ``released_by`` "wait" (the WaitWrite
releases when it runs) and "release" (a Release op after the use, and
with it a zero-copy producer's WaitFree). argv[1]: "shared" or "rma"
(PURINE_RANKS_PER_HOST=1 for the latter). Each write must arrive whole and
in order: y == k after the k-th WaitWrite, over ROUNDS rounds."""
import sys

import numpy as np

from common import ok, world  # noqa: F401  (sys.path: the repository)
from purine_mpi.comm.windows import WindowLayout, Windows
from purine_mpi.graph.core import Op
from purine_mpi.ops.catalog import make_kernel

ROUNDS = 6
w = world()
assert w.size == 2
layout = WindowLayout()
for by in ("wait", "release"):
    layout.add(f"y.{by}", 1, (64,), "float32", peers=[0])
    layout.add_word(f"y.{by}.written", 1, writer=0)
    layout.add_word(f"y.{by}.free", 0, writer=1 if by == "release" else None, peers=[1])
wins = Windows.allocate(w, layout)


def finish(pending):
    while pending is not None and not pending.test():
        pass
    if pending is not None:
        pending.finish()


for by in ("wait", "release"):
    attrs = {"seq": 0, "peer": 1 - w.rank, "region": f"y.{by}", "written": f"y.{by}.written",
             "free": f"y.{by}.free", "released_by": by, "shape": [64], "dtype": "float32"}
    if w.rank == 0:
        put = make_kernel(Op("x.put@r1", "Put", ["x"], [], dict(attrs)))
        gate = make_kernel(Op("x.free@r1", "WaitFree", [], [], dict(attrs)))
        x = np.zeros(64, np.float32)
        put.setup([x], [])
        gate.setup([], [])
        for k in range(1, ROUNDS + 1):
            finish(gate.run([], []))  # (the producer may overwrite x's region now)
            x[...] = k
            finish(put.run([x], []))
        assert put.bytes_put + put.bytes_copied == ROUNDS * x.nbytes, (put.bytes_put,
                                                                      put.bytes_copied)
    else:
        wait = make_kernel(Op("x.wait", "WaitWrite", [], ["x"], dict(attrs)))
        release = make_kernel(Op("x.release", "Release", ["x"], [], dict(attrs)))
        y = wins.local(f"y.{by}")
        wait.setup([], [y])
        release.setup([y], [])
        assert not wait.copy  # y is the region itself
        for k in range(1, ROUNDS + 1):
            finish(wait.run([], [y]))
            assert np.all(y == k), (by, k, y[:4])
            if by == "release":
                finish(release.run([y], []))
w.barrier()
ok(f"rma_protocol {sys.argv[1]}")
