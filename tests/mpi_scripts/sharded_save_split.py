"""Scheme sharded's save with pipeline stages or tensor shards, streamed a
parameter at a time (parallel/schemes/sharded.py ``checkpoint_sections``:
``streamed_join`` with ``_join_plan``), against the join it replaces, on 4
ranks: 2 replicas x 2 stages (the residual MLP of test_sharded_stages) at
ZeRO stages 1 and 3 (3: 2 micro-batches under 1F1B), and 2 replicas x
2-way tensor (the GPT of test_sharded_tensor) at stage 3, AdamW, 2 steps.
Before the save every rank's part (``checkpoint_parts``) is gathered
pickled to rank 0 (the old save's gather), which joins them with
``join_checkpoint``; the file the streamed save writes must hold exactly
those datasets, bit for bit and in that order (as a walk of the file
lists them: a group's datasets together), each with its Fletcher-32
checksum, and load.

    mpiexec -n 4 python tests/mpi_scripts/sharded_save_split.py OUT_DIR
"""
import pathlib
import sys

import h5py

from common import check_dataset, datasets, ok, world

import pytest  # noqa: E402  (MonkeyPatch)

from purine_mpi.job.checkpoint_file import load_checkpoint  # noqa: E402
from purine_mpi.job.config import validate_config  # noqa: E402
from purine_mpi.parallel.schemes import scheme_of  # noqa: E402
from purine_mpi.train import checkpoints  # noqa: E402
from purine_mpi.train.trainer import run_training  # noqa: E402
from tests.gpt_nets import text_h5  # noqa: E402
from tests.test_sharded_stages import _staged  # noqa: E402
from tests.test_sharded_tensor import _gpt  # noqa: E402

w = world()
root = pathlib.Path(sys.argv[1])
saves = []


def walked(keys):
    """The order ``datasets`` lists the datasets of a section written in
    the order of ``keys`` (each group of a path keeps its creation order:
    ``b/bias`` written after ``c/w`` is listed after ``b/w``)."""
    tree = {}
    for k in keys:
        *parents, leaf = k.split("/")
        node = tree
        for g in parents:
            node = node.setdefault(g, {})
        node[leaf] = None

    def flat(node, at):
        for k, v in node.items():
            yield from flat(v, f"{at}{k}/") if isinstance(v, dict) else [f"{at}{k}"]
    return list(flat(tree, ""))


def save(self, loop, iteration, path=None):
    scheme = scheme_of(loop.job)
    part = scheme.checkpoint_parts(loop.graphs, loop.ws, lambda: self._held(loop))
    parts = w.gather_object(part, 0)
    original(self, loop, iteration, path)
    if w.rank == 0:
        params, solver = scheme.join_checkpoint(loop.graphs, parts)
        saves.append((loop.out_dir, iteration, list(params.items()),
                      [(f"{p}/{x}", v) for p, states in solver.items()
                       for x, v in states.items()]))


tokens = text_h5(root) if w.rank == 0 else None
tokens = w.comm.bcast(tokens, 0)
cases = {"stages_s1": _staged("sharded", iters=2, shard=1),
         "stages_s3": _staged("sharded", iters=2, shard=3, micro_batches=2),
         "tensor_s3": _gpt(tokens, "sharded", iters=2, shard=3)}
original = checkpoints.Checkpoints.save
patch = pytest.MonkeyPatch()
patch.setattr(checkpoints.Checkpoints, "save", save)
for name, raw in cases.items():
    raw["solver"].update(display=0, test_interval=0)
    raw["checkpoint"] = {"interval": 2, "keep": 0}
    raw["data"].pop("test", None)
    rc = run_training(validate_config(raw, check_files=False), str(root / name))
    assert rc in (0, None), (name, rc)
patch.undo()

if w.rank == 0:
    assert len(saves) == len(cases), len(saves)
    for out, iteration, params, solver in saves:
        path = pathlib.Path(out) / f"ckpt_{iteration}.h5"
        with h5py.File(path, "r") as f:
            for section, want in (("params", params), ("solver", solver)):
                got = list(datasets(f[section]))
                assert [k for k, _ in got] == walked([k for k, _ in want]), (path, section)
                want = dict(want)
                for k, dset in got:
                    check_dataset(path, section, k, dset, want[k])
        assert params and solver, path
        load_checkpoint(path)  # the /state digest, the checksums
ok(f"sharded_save_split n={w.size}")
