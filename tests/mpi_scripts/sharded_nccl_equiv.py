"""scheme sharded on GPUs through NCCL (issue 43): ZeRO stage 1 or 3 on n
ranks, each on its own emulated GPU with the emulated NCCL
(tests/emulated_gpu/nccl.py: reduceScatter and allGather really sum and
gather across the ranks), the bucket collectives turned into
NcclReduceScatter / NcclAllgather on one nccl stream (use_nccl), against
the CPU/MPI sharded run of the same graph (ReduceScatter / Allgather).

    mpiexec -n K python tests/mpi_scripts/sharded_nccl_equiv.py BUILD_DIR STAGE [real] [frozen]
        [allreduce]

Checked on every rank: the whole iteration, NCCL included, is one captured
graph (one launch per iteration, no eager op); each collective runs once per
iteration in seq order with NCCL's equal chunks (``ceil(total / K)``); the
steady eager iteration and the replayed one allocate nothing on the device
(the emulated allocation log, as tests/test_gpu_no_alloc.py); the weights
after ITERS steps equal the CPU/MPI sharded run's within float tolerance
(the emulated device's kernels round as NumPy on the CPU up to summation
order: the difference is printed, bitwise or not), and the ranks' weights
are bitwise equal. ``real``: on a real GPU with CuPy's NCCL (no emulation;
K GPUs, one per rank): the same checks but the allocation log and CALLS.
``frozen``: fc2 (between two learning layers) at ``lr_mult: 0``; at stage
3 its weights sharded in units of their own (sharding.frozen_units),
gathered by NcclAllgather alike, and bit for bit their start after the
steps on both runs. ``allreduce`` (``parallel.reduce_scatter: false``):
both runs compose with ``allreduce``; each NcclReduceScatter posts one
ncclAllReduce of its whole bucket (no padded copies), and the weights
equal bit for bit those of data parallelism on the same emulated NCCL
(NcclAllreduce of the same buckets), which trains here too.
"""
import os
import pathlib
import sys

import numpy as np

from common import mlp_config, ok, world

import pytest  # noqa: E402  (MonkeyPatch: the emulated CuPy for this process)

from purine_mpi.base.backend import to_numpy  # noqa: E402
from purine_mpi.comm.ops import shard_range  # noqa: E402
from purine_mpi.job.replica import build_train_graph  # noqa: E402
from purine_mpi.parallel.nccl_backend import use_nccl  # noqa: E402
from purine_mpi.parallel.placement import prepare_for_device  # noqa: E402
from purine_mpi.parallel.sharding import compose_zero1  # noqa: E402
from purine_mpi.runtime.factory import make_dispatcher  # noqa: E402

ITERS = 4
w = world()
n, r = w.size, w.rank
stage = int(sys.argv[2])
real = "real" in sys.argv[3:]
frozen = ("fc2",) if "frozen" in sys.argv[3:] else ()
allreduce = "allreduce" in sys.argv[3:]
cfg = mlp_config(batch=3, hidden=(7, 5), frozen=frozen)  # buckets N does not divide: padded
SETTINGS = dict(bucket_mb=0.0002, first_bucket_mb=0.00005, min_buckets=2)


def sharded_graph():
    graph, grads = build_train_graph(cfg, r, n)
    plan = compose_zero1(graph, grads, n, r, stage=stage, allreduce=allreduce, **SETTINGS)
    return graph, plan


def load(d, graph, plan, weights):
    """The whole ``weights`` into the workspace: each bucket's flat weight
    buffer (stage 1) or this rank's shard of it (stage 3)."""
    for entry in plan:
        whole = np.zeros(graph.blobs[entry["weights"]].size, np.float32)
        for p, off in zip(entry["params"], entry["offsets"]):
            whole[off:off + weights[p].size] = weights[p].ravel()
        if "weight_shard" in entry:
            lo, hi = entry["shard"]
            d.workspace.set(entry["weight_shard"], whole[lo:hi])
        else:
            d.workspace.set(entry["weights"], whole)


def held(d, graph, plan):
    """The whole weights after training (stage 3: every rank's shards joined)."""
    out = {}
    for entry in plan:
        if "weight_shard" in entry:
            whole = np.concatenate(w.comm.allgather(to_numpy(d.workspace[entry["weight_shard"]])))
        else:
            whole = to_numpy(d.workspace[entry["weights"]]).ravel()
        for p, off in zip(entry["params"], entry["offsets"]):
            shape = graph.blobs[p].shape
            out[p] = whole[off:off + int(np.prod(shape))].reshape(shape).copy()
    return out


# the same starting weights on every rank and in both runs
ref_graph, ref_plan = sharded_graph()
rng = np.random.default_rng(11)
weights = {p: (0.3 * rng.standard_normal(ref_graph.blobs[p].shape)).astype(np.float32)
           for entry in ref_plan for p in entry["params"]}
assert [p for e in ref_plan if e.get("frozen") for p in e["params"]] == (
    ["fc2/weight", "fc2/bias"] if frozen and stage == 3 else []), ref_plan
assert len(ref_plan) >= 2 and (n == 1 or any(
    (hi - lo) * n != ref_graph.blobs[e["weights"]].size
    for e in ref_plan for lo, hi in [e["shard"]])), "no bucket needs NCCL's padding"

# the CPU/MPI sharded run
ref = make_dispatcher(ref_graph, "event", rank=r, seed=3, stall_timeout=60.0)
load(ref, ref_graph, ref_plan, weights)
for it in range(ITERS):
    ref.workspace["iter"][...] = it
    ref.run(it)
ref.drain()
expected = held(ref, ref_graph, ref_plan)
ref.close()

patch = pytest.MonkeyPatch()
if not real:
    from tests import emulated_gpu as emu
    from tests.emulated_gpu import Allocations, nccl as emu_nccl
    build = sys.argv[1]  # shared by the ranks: each kernel built once (host_kernels.py)
    os.makedirs(build, exist_ok=True)
    fake = emu.use_emulated_cupy(patch, pathlib.Path(build))
    emu_nccl.use_emulated_nccl(patch, fake, device=r)
graph, plan = sharded_graph()
prepare_for_device(graph, 0)
names = use_nccl(graph)
graph.infer_shapes().validate()
kinds = {graph.ops[x].op_type for x in names}
assert kinds == {"NcclReduceScatter", "NcclAllgather"}, kinds
assert not any(op.op_type in ("ReduceScatter", "Allgather", "Allreduce")
               for op in graph.ops.values())
d = make_dispatcher(graph, runtime=None if real else emu.SimulatedRuntime(r, poll_steps=(0, 2)),
                    seed=3, cuda_graph=True, stall_timeout=60.0, log=lambda m: None)
load(d, graph, plan, weights)
w.stall_timeout = 60.0
allocated = {}
for it in range(ITERS):
    d.workspace["iter"][...] = it
    if not real:
        Allocations.log, Allocations.counting = [], it >= 1
    try:
        d.run(it)
    finally:
        if not real:
            Allocations.counting = False
            allocated[it] = list(Allocations.log)
report = d.capture_report()
assert report["captured"] == report["segments"] == 1 and report["failed"] == {}, report
assert report["launches_per_iter"] == 1 and report["eager_ops_per_iter"] == 0, report
if not real:
    # iteration 0 sets up (the padded buffers); every later one allocates nothing
    assert all(v == [] for v in allocated.values()), allocated
    expect = []
    for x in names:
        op = graph.ops[x]
        blobs = op.inputs if op.op_type == "NcclReduceScatter" else op.outputs
        total = sum(graph.blobs[b].size for b in blobs)
        if op.op_type == "NcclReduceScatter" and allreduce:  # the whole bucket, as data's
            expect.append(("allReduce", total))
            continue
        expect.append(({"NcclReduceScatter": "reduceScatter"}.get(op.op_type, "allGather"),
                       -(-total // n)))
    calls = [(c[4], c[1]) for c in emu_nccl.CALLS if c[0] == r]
    assert calls == expect * ITERS, (calls, expect)
    streams = {c[3] for c in emu_nccl.CALLS[-len(names):]}
    assert streams == {(0, "capture:nccl")}, streams   # the last iteration: a replay
# stage 1: the gradient shard is the bucket's range, so NCCL reduces in
# place (recvbuff = sendbuff + rank * chunk) wherever N divides the bucket
# (no padded copies); stage 3's shard is a blob of its own
shard_ops = [d.kernels[x] for x in names if graph.ops[x].op_type == "NcclReduceScatter"]
if allreduce:  # the bucket summed in place; stage 1's shard is its range: no copy
    assert all(k.allreduce and not hasattr(k, "send_buf") for k in shard_ops)
    assert [k.in_place for k in shard_ops] == [stage == 1] * len(shard_ops)
else:
    assert [k.in_place for k in shard_ops] == [stage == 1 and k.total % n == 0
                                               for k in shard_ops], \
        [(k.total, k.in_place, k.send_pad, k.recv_pad) for k in shard_ops]
    assert stage != 1 or any(k.in_place for k in shard_ops), "no bucket N divides"
mine = held(d, graph, plan)
d.close()
if allreduce:  # data parallelism on the same NCCL: the same sums, so the same bits
    from purine_mpi.parallel.data_parallel import compose_data_parallel
    dgraph, dgrads = build_train_graph(cfg, r, n)
    compose_data_parallel(dgraph, dgrads, n, r, split_params=False, **SETTINGS)
    prepare_for_device(dgraph, 0)
    assert {dgraph.ops[x].op_type for x in use_nccl(dgraph)} == {"NcclAllreduce"}
    dgraph.infer_shapes().validate()
    dd = make_dispatcher(dgraph, runtime=emu.SimulatedRuntime(r, poll_steps=(0, 2)), seed=3,
                         cuda_graph=True, stall_timeout=60.0, log=lambda m: None)
    for p in weights:
        dd.workspace.set(p, weights[p])
    for it in range(ITERS):
        dd.workspace["iter"][...] = it
        dd.run(it)
    dd.drain()
    for p in weights:
        assert np.array_equal(to_numpy(dd.workspace[p]), mine[p]), \
            (p, float(np.max(np.abs(to_numpy(dd.workspace[p]) - mine[p]))))
    dd.close()
patch.undo()

worst, bitwise = 0.0, True
for p, want in expected.items():
    got = mine[p]
    bitwise &= np.array_equal(got, want)
    assert np.allclose(got, want, rtol=2e-5, atol=2e-6), (p, np.max(np.abs(got - want)))
    worst = max(worst, float(np.max(np.abs(got - want))))
for p in (p for p in weights if p.split("/")[0] in frozen):
    assert np.array_equal(mine[p], weights[p]) and np.array_equal(expected[p], weights[p]), p
for other in w.comm.allgather(mine):
    for p in mine:
        assert np.array_equal(other[p], mine[p]), f"{p} differs between ranks"
ok(f"sharded_nccl_equiv stage={stage} n={n}{' frozen' if frozen else ''}"
   f"{' allreduce' if allreduce else ''} "
   f"buckets={len(plan)} collectives={len(names)} "
   f"bitwise={bitwise} max_abs_diff={worst:.3g}")
