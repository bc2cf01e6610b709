"""Synchronous data parallelism: n ranks x batch B train exactly like one
rank with batch n*B (the sample order of docs/config.md), up to float
summation order.

    mpiexec -n K python tests/mpi_scripts/dp_equiv.py [bucket_mb] [check]

Every rank composes the same graph (gradients in buckets, one Allreduce per
bucket, SGDUpdate with grad_scale 1/n), trains 3 iterations, and compares
its parameters with a one-process run of batch n*B made on every rank
(COMM_SELF; that graph has no comm ops). The ranks' parameters must also be
bitwise identical to each other (everyone applies the same reduced sum).
"""
import sys

import numpy as np

from common import assert_close, mlp_config, ok, run, world

from purine_mpi.model import build_train_graph
from purine_mpi.parallel.data_parallel import compose_data_parallel

bucket_mb = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0002
check = len(sys.argv) > 2 and sys.argv[2] == "check"
w = world()
n, r = w.size, w.rank
B = 3

cfg = mlp_config(batch=B)
graph, grads = build_train_graph(cfg, r, n)
plan = compose_data_parallel(graph, grads, n, r, bucket_mb=bucket_mb,
                             first_bucket_mb=bucket_mb / 4, check_collectives=check, world=w)
graph.infer_shapes().validate()
assert plan and plan[0]["params"][0].startswith("out/"), plan[0]  # top layer first
d = run(graph, 3)
params = sorted(b.name for b in graph.blobs.values() if b.kind == "param" and b.alias_of is None)
mine = {p: d.workspace[p].copy() for p in params}
d.close()

ref_cfg = mlp_config(batch=n * B)
ref_graph, _ = build_train_graph(ref_cfg, 0, 1)
ref = run(ref_graph, 3)
for p in params:
    assert_close(mine[p], ref.workspace[p], p, rtol=2e-5, atol=2e-6)
ref.close()
everyone = w.comm.allgather(mine)
for other in everyone:
    for p in params:
        assert np.array_equal(other[p], mine[p]), f"{p} differs between ranks"
ok(f"dp_equiv n={n} buckets={len(plan)}")
