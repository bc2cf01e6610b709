"""Data parallelism on the emulated GPU with a non-CUDA-aware MPI (issue
#25): n ranks x batch B, each on its own simulated device (the emulated
CuPy of tests/emulated_gpu, the CUDA kernels compiled for the host,
the iteration captured into CUDA graphs), their buckets staged through
page-locked host mirrors by asynchronous copies, train like one CPU rank
with batch n*B (up to float summation order), and the ranks' parameters
are bitwise identical to each other.

    mpiexec -n K python tests/mpi_scripts/dp_equiv_gpu.py BUILD_DIR

``BUILD_DIR``: where the ranks compile the kernels (one folder, each kernel built once).
Run with PURINE_COMM_DELAY set, the posts and completions move in time.
"""
import os
import pathlib
import sys

import numpy as np

from common import assert_like_one_rank, mlp_config, ok, run, world

import pytest  # noqa: E402  (MonkeyPatch: the emulated CuPy for this process)

from purine_mpi.comm import device as comm_device  # noqa: E402
from purine_mpi.parallel.placement import prepare_for_device  # noqa: E402
from purine_mpi.job.replica import build_train_graph  # noqa: E402
from purine_mpi.parallel.data_parallel import compose_data_parallel  # noqa: E402
from purine_mpi.runtime.factory import make_dispatcher  # noqa: E402
from tests import emulated_gpu as emu  # noqa: E402

os.environ["PURINE_MPI_CUDA_AWARE"] = "0"  # the mpich wheel's: host staging
comm_device.cuda_aware.cache_clear()
ITERS = 3
w = world()
n, r = w.size, w.rank
B = 3
build = sys.argv[1]  # shared by the ranks: each kernel built once (host_kernels.py)
os.makedirs(build, exist_ok=True)
patch = pytest.MonkeyPatch()
emu.use_emulated_cupy(patch, pathlib.Path(build))

cfg = mlp_config(batch=B)
graph, grads = build_train_graph(cfg, r, n)
plan = compose_data_parallel(graph, grads, n, r, bucket_mb=0.0002, first_bucket_mb=0.00005,
                             world=w)
prepare_for_device(graph, 0)
graph.infer_shapes().validate()
rt = emu.SimulatedRuntime(r, poll_steps=(0, 2))
d = make_dispatcher(graph, runtime=rt, seed=3, cuda_graph=True, stall_timeout=60.0,
                    log=lambda m: None)
emu.init_params(d.workspace, graph, 3)  # the params are views of one buffer here
emu.SYNC_COPIES.clear()
for it in range(ITERS):
    d.workspace["iter"][...] = it
    d.run(it)
assert emu.SYNC_COPIES == [], emu.SYNC_COPIES  # no synchronous get/set
allreduces = [k for k in d.kernels.values() if k.op.op_type == "Allreduce"]
assert len(allreduces) == len(plan) >= 2 and all(
    k.async_staging and all(st.staged for st in k.stages) for k in allreduces)
report = d.capture_report()
assert report["captured"] == report["segments"] > 0, report
params = sorted(p.name for p in graph.params())  # views of the fused update's buffer
assert len(params) == 6, params
mine = {p: np.array(d.workspace[p]) for p in params}
d.close()
patch.undo()

ref_graph, _ = build_train_graph(mlp_config(batch=n * B), 0, 1)
ref = run(ref_graph, ITERS)
assert_like_one_rank(w, mine, ref.workspace, params, rtol=2e-5, atol=2e-6)
ref.close()
ok(f"dp_equiv_gpu n={n} buckets={len(plan)}")
