"""parallel.backend nccl on the emulated GPU (issue 35 item 6): n ranks x
batch B, each on its own emulated GPU with the emulated NCCL
(tests/emulated_gpu/nccl.py, which really reduces across the ranks), the
buckets reduced by NcclAllreduce ops on one stream inside the captured
iteration, train like one CPU rank with batch n*B, the ranks' weights equal
bitwise, and each rank reduced the same buckets in the same (seq) order,
each once per iteration, on the nccl stream.

    mpiexec -n K python tests/mpi_scripts/nccl_equiv.py BUILD_DIR [shared]

``shared``: every rank on GPU 0, which NCCL refuses (the script then
checks that the refusal is said, on every rank). ``stall``: the last rank
stops before its second iteration (``stall-replay``: its third, the first
replayed from the captured graph); the others' NCCL watchdog must name the
stalled bucket within parallel.stall_timeout (2 s here) and end the job.
"""
import time
import os
import pathlib
import sys

import numpy as np

from common import assert_like_one_rank_with_batch, mlp_config, ok, world

import pytest  # noqa: E402  (MonkeyPatch: the emulated CuPy for this process)

from purine_mpi.base.errors import UserError  # noqa: E402
from purine_mpi.comm.nccl import choose_backend  # noqa: E402
from purine_mpi.parallel.placement import prepare_for_device  # noqa: E402
from purine_mpi.parallel.nccl_backend import use_nccl  # noqa: E402
from purine_mpi.job.replica import build_train_graph  # noqa: E402
from purine_mpi.parallel.data_parallel import compose_data_parallel  # noqa: E402
from purine_mpi.runtime.factory import make_dispatcher  # noqa: E402
from tests import emulated_gpu as emu  # noqa: E402
from tests.emulated_gpu import nccl as emu_nccl  # noqa: E402

ITERS = 3
w = world()
n, r = w.size, w.rank
B = 3
shared = sys.argv[2:] == ["shared"]
# stall: the peer stops before an eager iteration (1); stall-replay: before
# the first replayed one (2), so the stalled reduction is inside the graph
stall = {"stall": 1, "stall-replay": 2}.get((sys.argv[2:] or [""])[0])
build = sys.argv[1]  # shared by the ranks: each kernel built once (host_kernels.py)
os.makedirs(build, exist_ok=True)
patch = pytest.MonkeyPatch()
fake = emu.use_emulated_cupy(patch, pathlib.Path(build))
emu_nccl.use_emulated_nccl(patch, fake, device=0 if shared else r)

if shared:   # two ranks on one GPU: auto falls back to MPI, nccl is refused
    backend, why = choose_backend("auto", w, 0)
    assert backend == "mpi" and "share one GPU" in why, why
    try:
        choose_backend("nccl", w, 0)
        raise AssertionError("parallel.backend: nccl accepted two ranks on one GPU")
    except UserError as exc:
        assert "NCCL needs a GPU per rank" in str(exc), exc
    try:   # the library itself refuses it too
        uid = w.comm.bcast(emu_nccl.get_unique_id() if r == 0 else None)
        emu_nccl.NcclCommunicator(n, uid, r)
        raise AssertionError("the emulated NCCL accepted two ranks on one GPU")
    except emu_nccl.NcclError as exc:
        assert "Duplicate GPU detected" in str(exc), exc
    patch.undo()
    ok(f"nccl_shared n={n}")
    sys.exit(0)

backend, why = choose_backend("auto", w, 0)
assert backend == "nccl", why
cfg = mlp_config(batch=B)
graph, grads = build_train_graph(cfg, r, n)
plan = compose_data_parallel(graph, grads, n, r, bucket_mb=0.0002, first_bucket_mb=0.00005,
                             world=w)
prepare_for_device(graph, 0)
names = use_nccl(graph)
graph.infer_shapes().validate()
assert len(names) == len(plan) >= 2 and not any(
    op.op_type == "Allreduce" for op in graph.ops.values())
rt = emu.SimulatedRuntime(r, poll_steps=(0, 2))
d = make_dispatcher(graph, runtime=rt, seed=3, cuda_graph=True, stall_timeout=60.0,
                    log=lambda m: None)
emu.init_params(d.workspace, graph, 3)
w.stall_timeout = 60.0 if stall is None else 2.0   # what the trainer sets from parallel.stall_timeout
for it in range(ITERS):
    if stall and it == stall and r == n - 1:
        time.sleep(60)   # a stalled peer: the others' watchdog ends the job first
    d.workspace["iter"][...] = it
    d.run(it)
assert stall is None, "the NCCL watchdog did not end the job"
report = d.capture_report()
# no comm op left: the whole iteration, NCCL included, is one captured graph
assert report["captured"] == report["segments"] == 1 and report["failed"] == {}, report
assert report["launches_per_iter"] == 1 and report["eager_ops_per_iter"] == 0, report
# each bucket once per iteration, in seq order, on the one nccl stream
sizes = [sum(graph.blobs[b].size for b in graph.ops[name].outputs) for name in names]
calls = [c for c in emu_nccl.CALLS if c[0] == r]
assert [c[1] for c in calls] == sizes * ITERS, (calls, sizes)
# eager on the nccl stream, then replayed from the capture's nccl stream (the
# last iteration is a replay: the reductions ran again, inside the graph)
streams = [c[3] for c in calls]
assert streams == [(0, "nccl")] * (len(sizes) * (ITERS - 1)) + \
    [(0, "capture:nccl")] * len(sizes), streams
kernels = [d.kernels[name] for name in names]
assert all(int(k.done_host[0]) == k.launched == ITERS for k in kernels)   # the watchdog's view
params = sorted(p.name for p in graph.params())
mine = {p: np.array(d.workspace[p]) for p in params}
d.close()
patch.undo()

assert_like_one_rank_with_batch(w, mine, params, n * B, ITERS)
ok(f"nccl_equiv n={n} buckets={len(plan)}")
