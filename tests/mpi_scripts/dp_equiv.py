"""Synchronous data parallelism: n ranks x batch B train exactly like one
rank with batch n*B (the sample order of docs/config.md), up to float
summation order.

    mpiexec -n K python tests/mpi_scripts/dp_equiv.py [bucket_mb] [check] [split] [defer]

With ``split`` the hidden layers are wider and every weight gradient over
twice the bucket size is split into row chunks (``split_large_params``,
whatever its size), each reduced and updated on its own. With ``defer`` the
composed graph runs with its tail deferred (``parallel.defer_update``: the
last allreduces and updates overlap the next iteration), and must give
bitwise the parameters of a run without; with PURINE_COMM_DELAY set (and
several ranks: on one, an allreduce completes as it is posted), some
iteration must also have returned with its tail still running.

Every rank composes the same graph (gradients in buckets, one Allreduce per
bucket, SGDUpdate with grad_scale 1/n), trains 3 iterations, and compares
its parameters with a one-process run of batch n*B made on every rank
(COMM_SELF; that graph has no comm ops). The ranks' parameters must also be
bitwise identical to each other (everyone applies the same reduced sum).
"""
import os
import sys

import numpy as np

from common import assert_like_one_rank, mlp_config, ok, run, world

from purine_mpi.job.replica import build_train_graph
from purine_mpi.parallel.data_parallel import SPLIT_MIN_BYTES, compose_data_parallel

bucket_mb = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0002
check = "check" in sys.argv[2:]
split = "split" in sys.argv[2:]
defer = "defer" in sys.argv[2:]
ITERS = 5 if defer else 3
hidden = (16, 12) if split else (6, 5)
w = world()
n, r = w.size, w.rank
B = 3

cfg = mlp_config(batch=B, hidden=hidden)
graph, grads = build_train_graph(cfg, r, n)
plan = compose_data_parallel(graph, grads, n, r, bucket_mb=bucket_mb,
                             first_bucket_mb=bucket_mb / 4, check_collectives=check, world=w,
                             split_min_bytes=0 if split else SPLIT_MIN_BYTES)
graph.infer_shapes().validate()
assert plan and plan[0]["params"][0].startswith("out/"), plan[0]  # top layer first
chunks = [p for b in plan for p in b["params"] if "[" in p]
assert bool(chunks) == split, chunks
deferred = []
d = run(graph, ITERS, defer=defer, deferred=deferred)
params = sorted(b.name for b in graph.blobs.values() if b.kind == "param" and b.alias_of is None)
mine = {p: d.workspace[p].copy() for p in params}
d.close()
if defer:
    assert d.schedule.tail, "nothing to defer in a data-parallel graph"
    plain = run(graph, ITERS)
    for p in params:
        assert np.array_equal(plain.workspace[p], mine[p]), f"{p}: deferred tail changed it"
    plain.close()
    if n > 1 and os.environ.get("PURINE_COMM_DELAY"):
        assert any(deferred), f"no iteration returned with its tail running: {deferred}"

ref_cfg = mlp_config(batch=n * B, hidden=hidden)
ref_graph, _ = build_train_graph(ref_cfg, 0, 1)
ref = run(ref_graph, ITERS)
assert_like_one_rank(w, mine, ref.workspace, params, rtol=2e-5, atol=2e-6)
ref.close()
ok(f"dp_equiv n={n} buckets={len(plan)} chunks={len(chunks)} deferred={deferred}")
