"""The reported figures of data parallelism on the emulated GPU
(tests/test_trust_gpu_emulated.py): 2 ranks, each on its own emulated
device (captured iterations, buckets staged through the host: a
non-CUDA-aware MPI), train ``reporting_raw``'s job into OUT/gpu, then the
same ranks train it on the CPU into OUT/cpu; the test compares the two run
folders and the two ``final`` lines (rank 0 prints them in that order).

    mpiexec -n 2 python tests/mpi_scripts/trust_gpu_dp.py BUILD_DIR OUT

``BUILD_DIR``: where each rank compiles the kernels (a folder per rank).
"""
import pathlib
import sys

from common import emulated_gpu_rank, ok

from purine_mpi.job.config import validate_config  # noqa: E402
from purine_mpi.train.trainer import run_training  # noqa: E402
from tests import emulated_gpu as emu  # noqa: E402

w, patch = emulated_gpu_rank(sys.argv[1])
out = pathlib.Path(sys.argv[2])
for name, device in (("gpu", 0), ("cpu", -1)):
    raw = emu.reporting_raw(device, cuda_graph=device >= 0)
    raw["parallel"] = {"scheme": "data"}
    rc = run_training(validate_config(raw, check_files=False), str(out / name))
    assert rc in (0, None), (name, rc)
    w.comm.Barrier()
patch.undo()
ok("trust_gpu_dp")
