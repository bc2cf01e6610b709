"""Parameter servers: the last K ranks serve, the others train.

    mpiexec -n N python tests/mpi_scripts/param_server.py sync_ps K
    mpiexec -n N python tests/mpi_scripts/param_server.py async K STALENESS [TRANSPORT]

sync_ps: after 3 iterations the workers' parameters equal a one-process
run with batch W*B (W = N-K workers), like synchronous data parallelism.
async: the loop ends (no hang), every worker's last pulled weights equal
the servers' final weights for staleness 0 (everyone waits for the whole
round), and the servers never let a worker run more than STALENESS pushes
ahead of the slowest. TRANSPORT (parallel.transport, default auto): with
one_sided the servers say they ran over windows, with two_sided over
Send/Recv.
"""
import sys

import numpy as np

from common import assert_close, mlp_config, ok, run, world

from purine_mpi.job.replica import build_train_graph
from purine_mpi.parallel.param_server import compose_param_server, ps_layout
from purine_mpi.train.ps_server import run_server

mode = sys.argv[1]
K = int(sys.argv[2])
staleness = int(sys.argv[3]) if len(sys.argv) > 3 else 0
transport = sys.argv[4] if len(sys.argv) > 4 else "auto"
w = world()
layout = ps_layout(w.size, K)
W = len(layout["workers"])
B, ITERS = 3, 4
cfg = mlp_config(batch=B, parallel={"mode": mode, "ps_ranks": K, "max_staleness": staleness,
                                    "transport": transport},
                 solver={"max_iter": ITERS})

if w.rank in layout["workers"]:
    graph, grads = build_train_graph(cfg, w.rank, W)
    compose_param_server(graph, grads, cfg, w)
    assert not any(op.op_type == "SGDUpdate" for op in graph.ops.values())
    d = run(graph, ITERS)
    result = {b.name: d.workspace[b.name].copy() for b in graph.blobs.values()
              if b.kind == "param" and b.alias_of is None}
    assert np.isfinite(d.workspace["loss"]).all()
    d.close()
    stats = None
else:
    out = run_server(cfg, w)
    result, stats = out["params"], out["stats"]

everyone = w.comm.allgather((w.rank in layout["workers"], result, stats))
server_params = {}
for is_worker, res, st in everyone:
    if not is_worker:
        server_params.update(res)
        if transport != "auto":
            assert st["transport"].startswith(
                "one-sided" if transport == "one_sided" else "two-sided"), st
        if mode == "async":
            assert st["pushes"] == W * ITERS * sum(1 for _ in res), st
            assert st["max_lead"] <= staleness, st
worker_results = [res for is_worker, res, _ in everyone if is_worker]
params = sorted(worker_results[0])
assert sorted(server_params) == params, (sorted(server_params), params)

if mode == "sync_ps" or staleness == 0:
    for res in worker_results:      # every worker holds the servers' final weights
        for p in params:
            assert np.array_equal(res[p], server_params[p]), p
if (mode == "sync_ps" or W == 1 and staleness == 0) and w.rank == 0:
    # sync_ps is synchronous SGD; so is async with one worker and staleness 0
    ref_graph, _ = build_train_graph(mlp_config(batch=W * B, solver={"max_iter": ITERS}), 0, 1)
    ref = run(ref_graph, ITERS)
    for p in params:
        assert_close(worker_results[0][p], ref.workspace[p], p, rtol=2e-5, atol=2e-6)
    ref.close()
ok(f"param_server {mode} n={w.size} K={K} s={staleness}")
