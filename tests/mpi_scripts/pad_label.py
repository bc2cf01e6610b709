"""The padding of a one-pass test on 2 ranks (tests/test_pad_label.py):
data parallelism on the CPU, then on emulated GPUs (one per rank); the
test pass of 20 samples is one batch of 2 x 8 and one padded one; every
rank's figures are NumPy's over the real samples, for a loss ignoring one
class and for two losses ignoring different ones.

    mpiexec -n 2 python tests/mpi_scripts/pad_label.py BUILD_DIR

``BUILD_DIR``: where each rank compiles the kernels (a folder per rank).
"""
import sys
import tempfile

from common import emulated_gpu_rank, ok

from purine_mpi.job.config import validate_config  # noqa: E402
from purine_mpi.train.trainer import Trainer  # noqa: E402
from tests.conftest import make_job  # noqa: E402
from tests.test_pad_label import CASES, check_figures, pad_raw, reference  # noqa: E402

w, patch = emulated_gpu_rank(sys.argv[1])
for device in (-1, 0):
    for ignores in CASES:
        raw = pad_raw(device, ignores)
        raw["parallel"] = {"scheme": "data"}
        job = make_job(validate_config(raw, check_files=False))
        with tempfile.TemporaryDirectory() as out:
            t = Trainer(job, out, world=w, log=lambda line: None)
            check_figures(t.evaluate(), reference(job, t, ignores, ranks=w.size))
            assert t.graphs.test_pad == -1
        w.comm.Barrier()
patch.undo()
ok("pad_label")
