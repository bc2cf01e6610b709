"""parallel.check_collectives finds ranks whose communication differs.

    mpiexec -n K python tests/mpi_scripts/seq_mismatch.py

1. Same config everywhere: the check passes.
2. The last rank composes with another bucket size (as if it had read
   another config): every rank raises a UserError naming the first
   collective that differs and the ranks involved.
3. A Send/Recv pair whose sizes disagree is reported too.
4. World.check_consistent names the rank whose config text differs.
"""
from common import mlp_config, ok, world

from purine_mpi.comm.verify import check_collectives
from purine_mpi.base.errors import UserError
from purine_mpi.graph import Graph
from purine_mpi.job.replica import build_train_graph
from purine_mpi.parallel.data_parallel import compose_data_parallel

w = world()
n, r = w.size, w.rank
assert n >= 2, "run with at least 2 ranks"


def composed(bucket_mb):
    g, grads = build_train_graph(mlp_config(), r, n)
    compose_data_parallel(g, grads, n, r, bucket_mb=bucket_mb, first_bucket_mb=0.0001,
                          min_buckets=1)
    return g


check_collectives(composed(0.0002), w)                     # 1. consistent

try:                                                         # 2. bucket sizes differ
    check_collectives(composed(0.0002 if r < n - 1 else 4), w)
    raise AssertionError("mismatched collectives were not detected")
except UserError as e:
    msg = str(e)
    assert "collective #1 differs" in msg and f"rank {n - 1} posts Allreduce" in msg, msg
    assert "grad_bucket1.allreduce" in msg, msg
    if r == 0:
        print("detected:", msg, flush=True)

g = Graph("p2p")                                             # 3. send/recv sizes
if r == 0:
    g.add_op("make", "Constant", [], ["x"], {"value": 1.0, "shape": [4]})
    g.add_op("x.send", "Send", ["x"], [], {"seq": 0, "peer": 1, "tag": 7})
elif r == 1:
    g.add_op("x.recv", "Recv", [], ["x"], {"seq": 0, "peer": 0, "tag": 7, "shape": [5]})
g.infer_shapes()
try:
    check_collectives(g, w)
    raise AssertionError("mismatched send/recv was not detected")
except UserError as e:
    assert "rank 0 sends Send of 4 float32" in str(e) and "receives Recv of 5" in str(e), str(e)

try:                                                         # 4. config text
    w.check_consistent("config A" if r != 1 else "config B", "configuration")
    raise AssertionError("differing configs were not detected")
except UserError as e:
    assert "rank 1's configuration differs from rank 0's" in str(e), str(e)
w.check_consistent("same text", "configuration")
ok(f"seq_mismatch n={n}")
