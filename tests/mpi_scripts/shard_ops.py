"""The sharding building blocks (comm/ops.py ReduceScatter and Allgather,
parallel/sharding.py) at any number of ranks, through the real dispatcher.

    mpiexec -n K python tests/mpi_scripts/shard_ops.py ops|equiv|stall

ops    ReduceScatter and Allgather against closed forms: sizes divisible and
       not divisible by K (and smaller than K: empty shards), float32 and
       float64, inputs that tile one flat bucket (no packing copy) and
       separate blobs (packed), a ReduceScatter in place (its output the
       rank's range of the bucket: MPI_IN_PLACE, then the shard moved from
       the bucket's start to its range), the mean (``average``), an
       Allgather in place and from a blob of its own. Integer-valued data: every sum is
       exact, so results are compared with ==.
equiv  ZeRO stage 1 (parallel/sharding.compose_zero1: reduce-scatter, the
       solver on the shard, allgather) against data parallelism
       (compose_data_parallel: allreduce, the full update), SGD with
       momentum and AdamW, 6 steps of random gradients: the weights are
       bitwise equal when the sums are (2 ranks: a + b either way; any
       number of ranks: gradients whose sums are exact), else within 1e-6
       of the parameter's scale, max |difference| / max |weight| (3 and 4
       ranks: MPICH's allreduce and reduce-scatter add the ranks' values in
       different orders). The optimizer state a rank
       holds is its shard's size, counted from the workspace's arrays. The
       sharded graph runs on a memory-planned workspace, as the trainer's.
stall  rank 1 stops itself (SIGSTOP) before its reduce-scatter; rank 0's
       watchdog (stall timeout 1 s) names the op.
"""
import os
import signal
import sys
import time
from types import SimpleNamespace

import numpy as np

from common import ok, world

from purine_mpi.comm.ops import is_collective, shard_range
from purine_mpi.graph import Graph
from purine_mpi.graph.solver_graph import add_solver
from purine_mpi.parallel.data_parallel import compose_data_parallel, make_bucket
from purine_mpi.parallel.sharding import compose_zero1
from purine_mpi.runtime.factory import make_dispatcher
from purine_mpi.runtime.memory_plan import plan_memory
from purine_mpi.runtime.workspace import Workspace

mode = sys.argv[1] if len(sys.argv) > 1 else "ops"
w = world()
n, r = w.size, w.rank


def ints(rank, size, i):
    """Integer-valued data of rank ``rank`` for blob i (exact sums)."""
    return (np.arange(size) % 7 + 1) * (rank + 1) + i


# --- ops: closed forms --------------------------------------------------------
def check_ops(dtype, sizes, tiled, average, in_place=False):
    g = Graph("rs")
    names = []
    for i, size in enumerate(sizes):
        g.add_blob(f"g{i}", (size,), dtype, kind="grad")
        names.append(f"g{i}")
    if tiled:  # views of one flat bucket, as data parallelism lays them out
        make_bucket(g, "bucket", {"dtype": dtype, "location": g.blobs["g0"].location,
                                  "params": names}, {x: x for x in names}, {})
    total = sum(sizes)
    lo, hi = shard_range(total, n, r)
    if in_place:  # the shard is the bucket's range [lo, hi), as stage 1 lays it out
        g.add_blob("s", (hi - lo,), dtype, kind="grad", alias_of="bucket", offset=lo)
    g.add_op("rs", "ReduceScatter", names, ["s"],
             {"seq": 0, "shards": n, "shard": r, "average": average})
    # Allgather from a blob of its own (x) and in place (the shard of y's buffer)
    g.add_blob("x", (hi - lo,), dtype)
    g.add_op("ag", "Allgather", ["x"], ["y"], {"seq": 1, "shards": n, "shard": r,
                                              "shapes": [[total]]})
    g.add_blob("z", (total,), dtype, kind="bucket")
    g.add_blob("z_mine", (hi - lo,), dtype, alias_of="z", offset=lo)
    g.add_blob("z@new", (total,), dtype, alias_of="z")
    g.add_op("agz", "Allgather", ["z_mine"], ["z@new"],
             {"seq": 2, "shards": n, "shard": r, "shapes": [[total]]})
    g.infer_shapes().validate()
    assert g.blobs["s"].shape == (hi - lo,), g.blobs["s"].shape
    d = make_dispatcher(g, "event", rank=r, stall_timeout=60.0)
    ws = d.workspace
    for i, size in enumerate(sizes):
        ws.set(f"g{i}", ints(r, size, i).astype(dtype))
    ws.set("x", (np.arange(lo, hi) + 0.5).astype(dtype))
    ws["z"][...] = -1
    ws["z_mine"][...] = np.arange(lo, hi) * 2.0
    d.run(0)
    d.drain()
    expect = np.concatenate([sum(ints(q, size, i) for q in range(n))
                             for i, size in enumerate(sizes)]).astype(dtype)
    if average:
        expect *= 1.0 / n  # as the op scales: b *= 1/size
    s = ws["s"]
    assert s.dtype == np.dtype(dtype) and np.array_equal(s, expect[lo:hi]), (s, expect[lo:hi])
    if in_place:  # the result lies in the bucket's range: no buffer of the op's own
        assert np.array_equal(ws.storage("bucket")[lo:hi], expect[lo:hi])
    assert np.array_equal(ws["y"], np.arange(total) + 0.5), ws["y"]
    assert np.array_equal(ws["z"], np.arange(total) * 2.0), ws["z"]
    k = d.kernels
    # separate blobs are packed into a buffer of the op's own (one blob is its own run)
    assert k["rs"].send.copies == (not tiled and len(sizes) > 1), (tiled, sizes)
    assert k["rs"].in_place == (in_place and hi > lo), (in_place, lo, hi)
    assert k["agz"].in_place and (not k["ag"].in_place or hi == lo)
    # a blob of its own (stage 3's weight shard) is sent from where it lies:
    # no copy of it held per gather
    assert k["ag"].in_place or (not k["ag"].send.copies and
                                np.shares_memory(k["ag"].send.buffer, ws.storage("x")))
    assert k["rs"].nbytes == total * np.dtype(dtype).itemsize == k["ag"].nbytes
    d.close()


if mode == "ops":
    for dtype in ("float32", "float64"):
        for sizes in ([12 * n], [5, 3 * n + 1], [1], [n + 1, 2]):
            for tiled in (True, False):
                check_ops(dtype, sizes, tiled, average=False)
            check_ops(dtype, sizes, True, average=False, in_place=True)
        check_ops(dtype, [3, 2 * n + 1], True, average=True)
        check_ops(dtype, [3, 2 * n + 1], True, average=True, in_place=True)
    ok(f"shard_ops ops n={n}")


# --- equiv: ZeRO stage 1 against data parallelism -----------------------------
SHAPES = [(30, 7), (7,), (13, 5), (5,), (50,), (3,)]


def build(solver_type, dtype, sharded):
    g = Graph("zero1" if sharded else "dp")
    grads = {}
    for i, shape in enumerate(SHAPES):
        b = g.add_blob(f"p{i}", shape, dtype, kind="param")
        if len(shape) == 1:  # a bias: its own multipliers, as layers give them
            b.attrs.update(lr_mult=2.0, decay_mult=0.0)
        g.add_blob(f"g{i}", shape, dtype, kind="grad")
        grads[f"p{i}"] = f"g{i}"
    solver = SimpleNamespace(type=solver_type, base_lr=0.05, lr_policy="fixed", momentum=0.9,
                             momentum2=0.999, delta=1e-8, weight_decay=0.01)
    add_solver(g, grads, solver)
    g.infer_shapes()
    kw = dict(bucket_mb=0.0005, first_bucket_mb=0.0002)
    plan = compose_zero1(g, grads, n, r, **kw) if sharded else \
        compose_data_parallel(g, grads, n, r, split_params=False, **kw)
    g.infer_shapes().validate()
    return g, plan


def train(solver_type, dtype, sharded, exact, steps=6):
    g, plan = build(solver_type, dtype, sharded)
    # the sharded graph's memory as the trainer plans it (runtime/memory_plan.py)
    ws = Workspace(g, plan=plan_memory(g)) if sharded else None
    d = make_dispatcher(g, "event", rank=r, stall_timeout=60.0, workspace=ws)
    ws = d.workspace
    for i, shape in enumerate(SHAPES):  # the same start on every rank
        ws.set(f"p{i}", np.random.default_rng([7, i]).standard_normal(shape).astype(dtype))
    for it in range(steps):
        ws["iter"][...] = it
        for i, shape in enumerate(SHAPES):
            x = np.random.default_rng([r, it, i]).standard_normal(shape)
            if exact:  # multiples of 2^-8 under 16: every sum over ranks is exact
                x = np.round(x * 256) / 256
            ws.set(f"g{i}", x.astype(dtype))
        d.run(it)
    d.drain()
    weights = {f"p{i}": np.array(ws[f"p{i}"]) for i in range(len(SHAPES))}
    roots = {g.storage_root(b) for b, blob in g.blobs.items() if blob.kind == "state"}
    state_bytes = sum(ws.storage(b).nbytes for b in roots)
    kinds = sorted({op.op_type for op in g.ops.values() if is_collective(op)})
    d.close()
    return weights, state_bytes, plan, kinds


if mode == "equiv":
    total = sum(int(np.prod(s)) for s in SHAPES)
    for solver_type, n_states in (("sgd", 1), ("adamw", 2)):
        for dtype in ("float32", "float64"):
            for exact in (False, True):
                dp, dp_state, _, dp_kinds = train(solver_type, dtype, False, exact)
                z1, z1_state, plan, z1_kinds = train(solver_type, dtype, True, exact)
                assert dp_kinds == ["Allreduce"] and z1_kinds == ["Allgather", "ReduceScatter"]
                assert len(plan) >= 3, plan
                item = np.dtype(dtype).itemsize
                shard_elems = sum(b - a for a, b in (e["shard"] for e in plan))
                assert dp_state == n_states * total * item, (dp_state, total)
                assert z1_state == n_states * shard_elems * item, (z1_state, shard_elems)
                assert sum(shard_range(e["bytes"] // item, n, q)[1] -
                           shard_range(e["bytes"] // item, n, q)[0]
                           for e in plan for q in range(n)) == total
                bitwise = n <= 2 or exact
                worst = 0.0
                for p in dp:
                    if bitwise:
                        assert np.array_equal(dp[p], z1[p]), (solver_type, dtype, p,
                                                              np.abs(dp[p] - z1[p]).max())
                    # relative to the parameter's scale: max |difference| / max |weight|
                    rel = float(np.abs(dp[p] - z1[p]).max() / np.abs(dp[p]).max())
                    assert rel <= 1e-6, (solver_type, dtype, p, rel)
                    worst = max(worst, rel)
                if r == 0:  # one writer: the lines never interleave
                    print(f"rank {r} {solver_type} {dtype} {'exact' if exact else 'random'}: "
                          f"{'bitwise' if bitwise else f'max rel {worst:.1e}'}; state "
                          f"bytes {z1_state} of {dp_state}", flush=True)
    ok(f"shard_ops equiv n={n}")


# --- stall: the watchdog names a ReduceScatter --------------------------------
if mode == "stall":
    if r == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # the launcher ends us when rank 0 aborts
        time.sleep(60)
        raise SystemExit(0)
    g = Graph("stall")
    g.add_blob("g", (1000,), kind="grad")
    g.add_op("rs", "ReduceScatter", ["g"], ["s"], {"seq": 0, "shards": n, "shard": r,
                                                   "bucket": "grad_bucket0"})
    g.infer_shapes()
    d = make_dispatcher(g, "event", rank=r, stall_timeout=1.0)
    d.run(0)
    print("rank 0 finished, which it should not", flush=True)
