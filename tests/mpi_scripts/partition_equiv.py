"""A training graph cut into pipeline stages on n ranks computes exactly what
the unpartitioned graph computes on one.

    mpiexec -n K python tests/mpi_scripts/partition_equiv.py [event|serial]

The MLP's layers go to ranks in contiguous stages (data and the learning
rate on rank 0, the loss on the last rank); partition() inserts Send/Recv
for activations, gradients, labels and the learning rate. After 3 SGD
iterations every parameter (gathered from the rank that owns it) and the
loss equal those of the one-process run of the same graph.
"""
import sys

import numpy as np

from common import assert_close, mlp_config, ok, run, world

from purine_mpi.job.replica import build_train_graph
from purine_mpi.parallel.model_parallel import compose_partitioned, place_layers

kind = sys.argv[1] if len(sys.argv) > 1 else "event"
w = world()
n, r = w.size, w.rank
cfg = mlp_config(batch=5, hidden=(6, 5, 4))
layers = ["fc1", "relu1", "fc2", "relu2", "fc3", "relu3", "out", "loss"]
stage = {layer: i * n // len(layers) for i, layer in enumerate(layers)}

graph, grads = build_train_graph(cfg)
reference = graph.copy()
place_layers(graph, stage)
local = compose_partitioned(graph, w)
if n > 1:
    assert any(op.op_type == "Send" for op in local.ops.values())
d = run(local, 3, kind=kind)
mine = {b.name: d.workspace[b.name].copy() for b in local.blobs.values()
        if b.kind == "param" and b.alias_of is None}
if "loss" in local.blobs and local.producers().get("loss"):
    mine["loss"] = d.workspace["loss"].copy()
d.close()
gathered = w.comm.gather(mine, root=0)
if r == 0:
    owned = {}
    for part in gathered:
        for k, v in part.items():
            assert k not in owned, f"{k} owned by two ranks"
            owned[k] = v
    ref = run(reference, 3)
    params = [b.name for b in reference.blobs.values() if b.kind == "param"
              and b.alias_of is None]
    assert sorted(params + ["loss"]) == sorted(owned), (sorted(owned), params)
    for k in params + ["loss"]:
        assert_close(owned[k], ref.workspace[k], k, rtol=1e-6, atol=1e-7)
    assert np.isfinite(owned["loss"]).all()
    ref.close()
ok(f"partition n={n} {kind}")
