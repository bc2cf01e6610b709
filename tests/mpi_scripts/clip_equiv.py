"""solver.clip_gradients across ranks: the norm is that of the reduced
gradients, so n ranks clip exactly as one rank does.

    mpiexec -n 2 python tests/mpi_scripts/clip_equiv.py data|pipeline
    mpiexec -n 4 python tests/mpi_scripts/clip_equiv.py hybrid

``data``: sync data parallelism, n ranks x batch B against one process of
batch n*B with the same clip (each rank's norm is local: it holds every
reduced gradient). ``pipeline``: the MLP's layers on n stages; each stage
holds some parameters and one Allreduce of the squared norm over the
stages makes it global; against the unpartitioned graph on one process.
``hybrid`` (4 ranks): 2 replicas x 2 stages, each stage's gradients
allreduced over the replicas, then the norm over the replica's stages.
The clip is a third of the first step's unclipped norm, so it acts; the
parameters after 3 iterations must match the reference and differ from a
run without clipping.
"""
import sys

import numpy as np

from common import assert_close, mlp_config, ok, run, world

from purine_mpi.job.replica import build_train_graph
from purine_mpi.parallel.compose import compose, data_window

kind = sys.argv[1] if len(sys.argv) > 1 else "data"
w = world()
n, r = w.size, w.rank
B, ITERS = 3, 3
HIDDEN = (6, 5)
SOLVER = {"momentum": 0.9, "weight_decay": 0.001}


class _Self:
    size, rank = 1, 0


def config(clip, batch, parallel=None):
    return mlp_config(batch=batch, hidden=HIDDEN, solver=dict(SOLVER, clip_gradients=clip),
                      parallel=parallel)


def params_of(graph, d):
    return {b.name: d.workspace[b.name].copy() for b in graph.blobs.values()
            if b.kind == "param" and b.alias_of is None}


def reference(clip, batch):
    cfg = config(clip, batch)
    graph, grads = build_train_graph(cfg, 0, 1)
    graph = compose(graph, grads, cfg, _Self())
    d = run(graph, ITERS)
    out = params_of(graph, d)
    d.close()
    return out


# the unclipped first step's norm, from one process (lr 0.1: g = step / lr)
probe_cfg = mlp_config(batch=n * B, hidden=HIDDEN, solver={"momentum": 0.0, "weight_decay": 0.0,
                                                          "max_iter": 1})
probe, _ = build_train_graph(probe_cfg, 0, 1)
d = run(probe, 0)
before = params_of(probe, d)
d.close()
d = run(probe, 1)
step = params_of(probe, d)
d.close()
norm = float(np.sqrt(sum(((before[p] - step[p]) / 0.1).astype(np.float64).__pow__(2).sum()
                         for p in before)))
clip = norm / 3

if kind == "data":
    cfg = config(clip, B)
    graph, grads = build_train_graph(cfg, r, n)
    local = compose(graph, grads, cfg, w)
    assert not any(op.op_type == "Allreduce" and op.name == "clip.sum"
                   for op in local.ops.values()), "data parallel needs no norm allreduce"
    d = run(local, ITERS)
    mine = params_of(local, d)
    d.close()
    owned = mine
else:
    layers = ["fc1", "relu1", "fc2", "relu2", "out", "loss"]
    p = n if kind == "pipeline" else 2
    stages = {layer: i * p // len(layers) for i, layer in enumerate(layers)}
    replicas = n // p
    cfg = config(clip, n * B // replicas, {"scheme": kind, "stages": stages})
    replica, _ = data_window(cfg, w)
    graph, grads = build_train_graph(cfg, replica, replicas)
    local = compose(graph, grads, cfg, w)
    group = [replica * p + s for s in range(p)]
    assert "clip.sum" in local.ops and local.ops["clip.sum"].attrs["group"] == group
    d = run(local, ITERS)
    mine = params_of(local, d)
    d.close()
    owned = {}
    for part in w.comm.allgather(mine):
        for name, value in part.items():  # the replicas of a stage hold the same values
            assert name not in owned or np.array_equal(owned[name], value), name
            owned[name] = value

want = reference(clip, n * B)
plain = reference(None, n * B)
assert sorted(owned) == sorted(want), (sorted(owned), sorted(want))
for p in want:
    assert_close(owned[p], want[p], p, rtol=2e-5, atol=2e-6)
assert any(not np.allclose(want[p], plain[p], rtol=1e-4, atol=1e-5) for p in want), \
    "the clip did not act"
ok(f"clip_equiv {kind} n={n} clip={clip:.4g}")
