"""A sharded save, streamed (parallel/schemes/sharded.py
``checkpoint_sections``), against the join it replaces: stages 1, 2 and 3,
AdamW and SGD with momentum, 4 steps of test_sharded's residual MLP (small
buckets, so shards cut weights apart). Before each save every rank's raw
parts -- the blobs holding its weights (``held_weights``: stage 3's shards)
and its shard of each bucket's flat solver state -- are gathered pickled to
rank 0 (the old save's gather), which joins them here in rank order and cuts
them into each parameter's shape; the file the streamed save writes must
hold exactly those datasets, bit for bit, in that order (/params: the
weights held whole, then stage 3's buckets; /solver: bucket by bucket),
each with its Fletcher-32 checksum, and loads (its /state sha256). Stage 3's
last save is first tried by rank 0 alone: the stall watchdog names the
first bucket's gather.

    mpiexec -n N python tests/mpi_scripts/sharded_save.py OUT_DIR
"""
import pathlib
import sys

import h5py
import numpy as np

from common import check_dataset, datasets, ok, world

import pytest  # noqa: E402  (MonkeyPatch)

from purine_mpi.base.backend import to_numpy  # noqa: E402
from purine_mpi.job.checkpoint_file import load_checkpoint  # noqa: E402
from purine_mpi.job.config import validate_config  # noqa: E402
from purine_mpi.parallel.schemes import scheme_of  # noqa: E402
from purine_mpi.train import checkpoints  # noqa: E402
from purine_mpi.train.trainer import run_training  # noqa: E402
from tests.test_sharded import _job  # noqa: E402

w = world()
root = pathlib.Path(sys.argv[1])
saves = []


def joined(graphs, parts):
    """The old save's file sections from every rank's raw parts: (params,
    solver) as ordered lists of (dataset path, array)."""
    plan = graphs.composition.shard_plan
    shards = {e["weight_shard"] for e in plan if "weight_shard" in e}
    params = [(k, parts[0]["held"][k]) for k in parts[0]["weights"] if k not in shards]
    solver = []

    def cut(entry, blob):
        whole = np.concatenate([part["held"][blob].ravel() for part in parts])
        for p, off in zip(entry["params"], entry["offsets"]):
            shape = graphs.graph.blobs[p].shape
            yield p, whole[off:off + int(np.prod(shape))].reshape(shape)

    for entry in plan:
        if "weight_shard" in entry:
            params += list(cut(entry, entry["weight_shard"]))
    for entry in plan:
        prefix = f"{entry['weights']}.shard."
        cuts = [(flat[len(prefix):], dict(cut(entry, flat))) for flat in entry["states"]]
        solver += [(f"{p}/{state}", c[p]) for p in entry["params"] for state, c in cuts]
    return params, solver


def stall_check(loop):
    """Rank 0 alone saves through a world of its own (a Dup, stall timeout
    0.5 s): the first bucket's gather stalls, and the watchdog names it.
    The other ranks then post their side of that one gather."""
    from purine_mpi.base.errors import StallError
    from purine_mpi.comm.ops import shard_range
    from purine_mpi.comm.world import World
    sub = World(w.comm)
    sub.stall_timeout = 0.5
    entry = loop.graphs.composition.shard_plan[0]
    if w.rank == 0:
        params, _ = scheme_of(loop.job).checkpoint_sections(loop.graphs, loop.ws, sub, None)
        try:
            list(params.items())
            raise AssertionError("rank 0 alone: the save did not stall")
        except StallError as e:
            assert f"the checkpoint's gather of the weights of bucket {entry['weights']} " \
                   "(Igatherv) stalled" in str(e) and "parallel.stall_timeout" in str(e), e
    w.comm.Barrier()
    if w.rank != 0:
        total = loop.graphs.graph.blobs[entry["weights"]].size
        counts = [4 * (hi - lo) for lo, hi in (shard_range(total, w.size, r)
                                                for r in range(w.size))]
        sub.gatherv(to_numpy(loop.ws[entry["weight_shard"]]), None, counts, 0)


def save(self, loop, iteration, path=None):
    graphs = loop.graphs
    if loop.job.parallel.shard == 3 and iteration == loop.job.solver.max_iter:
        stall_check(loop)
    weights = scheme_of(loop.job).held_weights(graphs)
    held = weights + [s for e in graphs.composition.shard_plan for s in e["states"]]
    parts = w.gather_object({"held": {b: to_numpy(loop.ws[b]).copy() for b in held},
                             "weights": weights}, 0)
    original(self, loop, iteration, path)
    if w.rank == 0:
        saves.append((loop.out_dir, iteration, joined(graphs, parts)))


original = checkpoints.Checkpoints.save
patch = pytest.MonkeyPatch()
patch.setattr(checkpoints.Checkpoints, "save", save)
for stage in (1, 2, 3):
    for solver in ("adamw", "sgd"):
        raw = _job("sharded", solver, iters=4, shard=stage)
        raw["solver"].update(display=0)
        raw["checkpoint"] = {"interval": 2, "keep": 0}
        raw["data"].pop("test")
        rc = run_training(validate_config(raw, check_files=False),
                          str(root / f"s{stage}_{solver}"))
        assert rc in (0, None), rc
patch.undo()

if w.rank == 0:
    assert len(saves) == 12, len(saves)
    for out, iteration, (params, solver) in saves:
        path = pathlib.Path(out) / f"ckpt_{iteration}.h5"
        with h5py.File(path, "r") as f:
            for section, want in (("params", params), ("solver", solver)):
                got = list(datasets(f[section]))
                assert [k for k, _ in got] == [k for k, _ in want], (path, section)
                for (k, dset), (_, value) in zip(got, want):
                    check_dataset(path, section, k, dset, value)
        assert params and solver, path
        load_checkpoint(path)  # the /state digest, the checksums
ok(f"sharded_save n={w.size}")
