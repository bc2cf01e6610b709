"""Folded weight copies on 2 emulated GPUs: schemes data, tensor and
pipeline (bf16 tiny GPT, 3 steps, captured iterations), each trained with
PURINE_FOLD_WEIGHT_CASTS=1 and =0 into OUT/<scheme>-<fold>; the test
compares the checkpoints bit for bit.

    mpiexec -n 2 python tests/mpi_scripts/fold_schemes_gpu.py BUILD_DIR OUT SCHEME...
"""
import os
import pathlib
import sys

from common import emulated_gpu_rank, ok

from purine_mpi.job.config import validate_config  # noqa: E402
from purine_mpi.train.trainer import run_training  # noqa: E402
from tests.gpt_nets import block_stages, gpt_config, text_h5  # noqa: E402

w, patch = emulated_gpu_rank(sys.argv[1])
out = pathlib.Path(sys.argv[2])
data = out / "data"
if w.rank == 0:
    data.mkdir(parents=True, exist_ok=True)
    text_h5(data)
w.comm.Barrier()
PARALLEL = {"data": {"scheme": "data"}, "tensor": {"scheme": "tensor", "tensor_parallel": 2},
            "pipeline": {"scheme": "pipeline", "stages": block_stages(2), "micro_batches": 2}}
for scheme in sys.argv[3:]:
    for fold in ("1", "0"):
        os.environ["PURINE_FOLD_WEIGHT_CASTS"] = fold
        raw = gpt_config(text_h5(data), layers=2, width=16, heads=2, length=8, batch=4, iters=3,
                         parallel=dict(PARALLEL[scheme]))
        raw.update(device=0, precision="bf16", cuda_graph=True)
        raw["data"].pop("test")
        raw["solver"].update(base_lr=0.01, test_interval=0)
        raw["checkpoint"] = {"interval": 3, "keep": 0}
        rc = run_training(validate_config(raw, check_files=False), str(out / f"{scheme}-{fold}"))
        assert rc in (0, None), (scheme, fold, rc)
        w.comm.Barrier()
patch.undo()
ok("fold_schemes_gpu")
