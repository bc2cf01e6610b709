"""Many iterations on more ranks than cores never hang, and stay exact.

    mpiexec -n 3 python tests/mpi_scripts/no_hang.py ITERS BUSY_POLL_S

Data parallelism with six or more buckets over a small MLP, the weight
gradients on a second worker thread; after every iteration the posting
order is re-decided (``adopt_ready_order``: rank 0 decides, broadcast) --
and rank 0 here "observes" a random permutation, so the order of the
collectives changes from one iteration to the next, while
PURINE_COMM_DELAY (the test sets it) moves the posts around in time. A stall (a post no peer matches) surfaces as a
StallError within ``stall_timeout`` seconds, not as a hang. The ranks'
parameters must be bitwise equal to each other and equal (to float
tolerance) to one rank with the whole batch.
"""
import sys

import numpy as np

from common import assert_like_one_rank, init_params, mlp_config, ok, world

from purine_mpi.job.replica import build_train_graph
from purine_mpi.parallel.data_parallel import adopt_ready_order, compose_data_parallel
from purine_mpi.runtime.factory import make_dispatcher

iters = int(sys.argv[1])
busy_poll = float(sys.argv[2])
w = world()
n, r = w.size, w.rank
if n < 2:  # one rank composes no bucket and posts no collective: nothing to order
    sys.exit("no_hang.py needs 2 or more ranks (mpiexec -n 3 ...)")
B = 2
solver = {"max_iter": iters, "stepsize": 10 ** 6}

graph, grads = build_train_graph(mlp_config(batch=B, hidden=(7, 6, 5), solver=solver), r, n)
plan = compose_data_parallel(graph, grads, n, r, bucket_mb=1, first_bucket_mb=1,
                             min_buckets=6, check_collectives=True, world=w)
graph.infer_shapes().validate()
assert len(plan) >= 6, plan
for op in graph.ops.values():
    if "grad_weight" in op.name or "grad_bias" in op.name:
        op.thread = 1
d = make_dispatcher(graph, "event", rank=r, stall_timeout=20.0, seed=3, busy_poll=busy_poll)
init_params(graph, d.workspace, 3)
if r == 0:
    rng = np.random.default_rng(7)
    d.comm_ready_order = lambda: list(rng.permutation(d.comm_order()))
orders = []
for it in range(iters):
    d.workspace["iter"][...] = it
    d.run(it)
    orders.append(tuple(adopt_ready_order(d, w)))
    assert tuple(d.comm_order()) == orders[-1]
# every rank posted one sequence of collectives, iteration by iteration
assert all(o == orders for o in w.comm.allgather(orders)), "posting orders differ between ranks"
params = sorted(b.name for b in graph.blobs.values() if b.kind == "param" and b.alias_of is None)
mine = {p: d.workspace[p].copy() for p in params}
d.close()

ref_graph, _ = build_train_graph(mlp_config(batch=n * B, hidden=(7, 6, 5), solver=solver), 0, 1)
ref = make_dispatcher(ref_graph, "event", seed=3)
init_params(ref_graph, ref.workspace, 3)
for it in range(iters):
    ref.workspace["iter"][...] = it
    ref.run(it)
assert_like_one_rank(w, mine, ref.workspace, params, rtol=5e-5, atol=5e-6)
ref.close()
ok(f"no_hang n={n} iters={iters} posting orders seen={len(set(orders))}")
