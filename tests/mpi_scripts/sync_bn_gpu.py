"""A ``batch_norm`` with ``sync: true`` on 2 emulated GPUs
(tests/test_sync_batch_norm.py): 2 ranks, each on its own emulated device
(the iteration captured; the float64 sums and the buckets staged through the
host: a non-CUDA-aware MPI), train ``tiny_raw``'s data with a 3×3 conv into
the synchronised batch norm into OUT/gpu, then through the emulated NCCL
(``parallel.backend: nccl``: the sums' Allreduce an NcclAllreduce of
float64, chained with the buckets' on the nccl stream) into OUT/nccl, then
the same ranks train it on the CPU into OUT/cpu; the test compares the
checkpoints.

    mpiexec -n 2 python tests/mpi_scripts/sync_bn_gpu.py BUILD_DIR OUT
"""
import pathlib
import sys

from common import emulated_gpu_rank, ok

from purine_mpi.job.config import validate_config  # noqa: E402
from purine_mpi.train.trainer import run_training  # noqa: E402
from tests import emulated_gpu as emu  # noqa: E402
from tests.emulated_gpu import nccl as emu_nccl  # noqa: E402

w, patch = emulated_gpu_rank(sys.argv[1])
emu_nccl.use_emulated_nccl(patch, sys.modules["cupy"], device=w.rank)
out = pathlib.Path(sys.argv[2])
for name, device, backend in (("gpu", 0, "mpi"), ("nccl", 0, "nccl"), ("cpu", -1, "mpi")):
    raw = emu.tiny_raw(device=device, cuda_graph=device >= 0)
    raw["net"] = [
        {"type": "conv", "name": "c1", "bottom": "data", "top": "c1", "num_output": 4,
         "kernel": 3, "bias_term": False, "weight_filler": {"type": "gaussian", "std": 0.1}},
        {"type": "batch_norm", "name": "bn", "bottom": "c1", "top": "bn", "sync": True},
        {"type": "relu", "name": "relu", "bottom": "bn", "top": "bn"},
        {"type": "fc", "name": "fc", "bottom": "bn", "top": "fc", "num_output": 5},
        {"type": "softmax_loss", "name": "loss", "bottom": ["fc", "label"], "top": "loss"}]
    raw["solver"].update(max_iter=3, display=1)
    raw["checkpoint"] = {"interval": 3}
    raw["parallel"] = {"scheme": "data", "backend": backend}
    rc = run_training(validate_config(raw, check_files=False), str(out / name))
    assert rc in (0, None), (name, rc)
    w.comm.Barrier()
patch.undo()
ok("sync_bn_gpu")
