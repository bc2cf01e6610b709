"""fp16's skipped step across ranks (graph/loss_scale.py): 2 ranks of data
parallelism, each on its own emulated GPU (tests/emulated_gpu), train a tiny
GPT in fp16 with AdamW; ``PURINE_FP16_INJECT_INF=STEP:RANK`` (set by the
test) puts an inf into one gradient of step STEP on rank RANK alone. Every
rank must skip exactly that step: the checkpoints before and after it hold
bitwise the same weights and AdamW moments and the same Adam step count
(iteration - skipped steps), the scale is halved, metrics.jsonl counts one
skipped step from STEP on, and the run goes on finite after it.

    mpiexec -n 2 python tests/mpi_scripts/loss_scale_skip.py BUILD_DIR TOKENS_H5 OUT_DIR

``BUILD_DIR``: where the ranks compile the kernels (one folder, each kernel built once);
``TOKENS_H5``: tests/gpt_nets.text_h5's file; ``OUT_DIR``: the run folder.
"""
import json
import os
import pathlib
import sys

import numpy as np

from common import ok, world

import pytest  # noqa: E402  (MonkeyPatch: the emulated CuPy for this process)

from purine_mpi.base import env  # noqa: E402
from purine_mpi.comm import device as comm_device  # noqa: E402
from purine_mpi.job.checkpoint_file import load_checkpoint  # noqa: E402
from purine_mpi.job.config import validate_config  # noqa: E402
from purine_mpi.train.trainer import run_training  # noqa: E402
from tests import emulated_gpu as emu  # noqa: E402
from tests.conftest import checkpoint_arrays  # noqa: E402
from tests.gpt_nets import gpt_config  # noqa: E402

ITERS = 7
SCALE = 1024.0
os.environ["PURINE_MPI_CUDA_AWARE"] = "0"  # the mpich wheel's: host staging
comm_device.cuda_aware.cache_clear()
step, bad_rank = env.get("PURINE_FP16_INJECT_INF")
assert 1 < step < ITERS and bad_rank is not None, (step, bad_rank)
w = world()
r = w.rank
build = pathlib.Path(sys.argv[1])  # shared by the ranks: each kernel built once
build.mkdir(parents=True, exist_ok=True)
out = pathlib.Path(sys.argv[3])
patch = pytest.MonkeyPatch()
emu.emulated_trainer_env(patch, build)

raw = gpt_config(sys.argv[2], layers=1, width=16, heads=2, length=8, batch=2, iters=ITERS,
                 parallel={"scheme": "data"})
raw.update(device=0, precision="fp16", cuda_graph=False, loss_scale={"init_scale": SCALE})
raw["data"].pop("test")
raw["solver"].update(base_lr=0.01, test_interval=0)
raw["checkpoint"] = {"interval": 1, "keep": 0}
rc = run_training(validate_config(raw, check_files=False), str(out))
assert rc in (0, None), rc
w.comm.Barrier()
patch.undo()

# every rank reads the run's files (rank 0 wrote them) and checks the same
rows = {}
for line in (out / "metrics.jsonl").read_text().splitlines():
    row = json.loads(line)
    if row["phase"] == "train":
        rows[row["iter"]] = row
assert sorted(rows) == list(range(1, ITERS + 1)), sorted(rows)
skipped = [rows[i]["skipped_steps"] for i in sorted(rows)]
assert skipped == [0] * (step - 1) + [1] * (ITERS - step + 1), (step, skipped)
scales = [rows[i]["loss_scale"] for i in sorted(rows)]
assert scales == [SCALE] * (step - 1) + [SCALE / 2] * (ITERS - step + 1), scales
assert all(np.isfinite(rows[i]["loss"]) for i in rows), rows
before, after = (checkpoint_arrays(out / f"ckpt_{i}.h5") for i in (step - 1, step))
assert sorted(before) == sorted(after) and any(k.startswith("solver/") for k in before)
moments = [k for k in before if k.startswith("solver/")]
for k in before:  # weights and AdamW moments: the skipped step changed none
    assert before[k].dtype == after[k].dtype and before[k].tobytes() == after[k].tobytes(), k
last = checkpoint_arrays(out / f"ckpt_{ITERS}.h5")
assert all(np.isfinite(v).all() for v in last.values())
assert any(last[k].tobytes() != after[k].tobytes() for k in after)  # training went on


def scale_state(path):
    """(iteration, scale, good steps, skipped steps) of a checkpoint: the
    LossScaleUpdate op's state, the same on each rank."""
    ck = load_checkpoint(str(path))
    ranks = ck.state["ranks"]
    assert sorted(ranks) == [str(q) for q in range(w.size)], (path, sorted(ranks))
    states = {tuple(ranks[q]["loss_scale.update"]["state"][n]
                    for n in ("scale", "good_steps", "skipped_steps")) for q in ranks}
    assert len(states) == 1, states
    scale, good, skipped = states.pop()
    return int(ck.attrs["iteration"]), float(scale), int(good), int(skipped)


(it0, s0, _, k0), (it1, s1, g1, k1) = (scale_state(out / f"ckpt_{i}.h5")
                                       for i in (step - 1, step))
assert (k0, k1, g1) == (0, 1, 0) and s1 == s0 / 2 == SCALE / 2, (s0, s1, k0, k1, g1)
assert it0 - k0 == it1 - k1, (it0, k0, it1, k1)  # Adam's step count: unmoved
ok(f"loss_scale_skip step={step} rank={bad_rank} moments={len(moments)}")
