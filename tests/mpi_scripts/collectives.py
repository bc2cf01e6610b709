"""Closed-form results of graph communication ops at any number of ranks.

    mpiexec -n K python tests/mpi_scripts/collectives.py [event|serial]

1. Bucketed Allreduce: rank r makes g_i = r + i (i = 0..4, two dtypes, one
   large enough to need several buckets); after the graph's Allreduce ops,
   g_i.sum = sum_r (r + i) = n(n-1)/2 + n*i, in place in the bucket.
2. Send/Recv ring through partition(): x_r = r + 1 made on rank r is copied
   on rank (r+1) % n; the copy equals r + 1, on the rank that holds it.
"""
import sys

import numpy as np

from common import ok, run, world

from purine_mpi.graph import Graph, Location
from purine_mpi.parallel.partition import partition
from purine_mpi.parallel.data_parallel import compose_data_parallel

kind = sys.argv[1] if len(sys.argv) > 1 else "event"
w = world()
n, r = w.size, w.rank

# --- 1. bucketed allreduce -------------------------------------------------
g = Graph("allreduce")
shapes = [(3,), (2, 5), (40000,), (7,), (1,)]
dtypes = ["float32", "float32", "float32", "float64", "float32"]
grads = {}
for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
    g.add_op(f"make{i}", "Constant", [], [f"g{i}"],
             {"value": float(r + i), "shape": list(shape), "dtype": dtype})
    grads[f"p{i}"] = f"g{i}"
g.infer_shapes()
plan = compose_data_parallel(g, grads, n, r, bucket_mb=0.1, first_bucket_mb=0.0001)
g.infer_shapes().validate()
assert len(plan) >= 3, plan
assert [b["seq"] for b in plan] == list(range(len(plan)))
d = run(g, 2, kind=kind)
ws = d.workspace
for i in range(len(shapes)):
    expect = n * (n - 1) / 2 + n * i
    got = ws[f"g{i}.sum"]
    assert got.dtype == np.dtype(dtypes[i]), (got.dtype, dtypes[i])
    assert np.all(got == expect), (i, got.ravel()[:4], expect)
    # in place: the sum lives in the bucket that the gradient op wrote
    assert np.shares_memory(got, ws.storage(f"g{i}")), i
d.close()

# --- 2. send/recv ring through partition -----------------------------------
glob = Graph("ring")
for src in range(n):
    dst = (src + 1) % n
    glob.add_blob(f"x{src}", (5,), location=Location(src))
    glob.add_op(f"make{src}", "Constant", [], [f"x{src}"],
                {"value": float(src + 1), "shape": [5]}, location=Location(src))
    glob.add_op(f"copy{src}", "Copy", [f"x{src}"], [f"y{src}"], location=Location(dst))
glob.infer_shapes()
local = partition(glob, r, hosts=w)
local.infer_shapes().validate()
sends = [op for op in local.ops.values() if op.op_type == "Send"]
recvs = [op for op in local.ops.values() if op.op_type == "Recv"]
assert len(sends) == len(recvs) == (1 if n > 1 else 0), (sends, recvs)
d = run(local, 3, kind=kind)
src = (r - 1) % n
assert np.all(d.workspace[f"y{src}"] == src + 1), d.workspace[f"y{src}"]
d.close()
ok(f"collectives n={n} {kind}")
