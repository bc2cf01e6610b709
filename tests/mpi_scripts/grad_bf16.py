"""``parallel.grad_dtype: bf16`` (issue 45): gradient buckets reduced in
bfloat16 across the ranks, the float32 master weights, local gradients and
update kept.

    mpiexec -n K python tests/mpi_scripts/grad_bf16.py ops
    mpiexec -n K python tests/mpi_scripts/grad_bf16.py nccl BUILD_DIR

ops   the MPI kernels (comm/ops.py Allreduce, ReduceScatter with attr
      ``wire_dtype: bfloat16``) through the real dispatcher, against NumPy
      references built with ml_dtypes: (1) gradients whose bfloat16 sums are
      exact (small integers times powers of two): the result equals the
      float32 sum bitwise, a flat bucket in place and separate blobs, sizes
      K does not divide, the mean; (2) random gradients: every element is
      one of the values the reduction can give -- each rank's gradient
      rounded to bfloat16, then added pairwise in one of the orders a
      commutative reduction may take, each sum rounded to bfloat16 (2 ranks:
      one order; 3: three) -- so within one bfloat16 ulp per add of the
      exact sum of the rounded gradients, and bfloat16-valued (the cast is
      on); the op's ``nbytes`` and ``collective_bytes`` count 2 bytes an
      element.
nccl  the same buckets on the emulated GPU through the emulated NCCL
      (tests/emulated_gpu/nccl.py: ncclBfloat16 summed as NCCL does, each
      step widened, added and rounded): data parallelism's NcclAllreduce and
      ZeRO stage 1's NcclReduceScatter, captured, move uint16 (bfloat16)
      buffers of the buckets' sizes (converted by the device kernels
      to_bf16_bits / from_bf16_bits of cuda/precision.cu), and train as the CPU/MPI bfloat16 run of
      the same graph (within the rounding a different summation order of a
      gradient may flip: see the bound below); the ranks agree bitwise.
"""
import itertools
import os
import pathlib
import sys

import ml_dtypes
import numpy as np

from common import mlp_config, ok, world

from purine_mpi.base.backend import to_numpy
from purine_mpi.comm.ops import collective_bytes, shard_range
from purine_mpi.graph import Graph
from purine_mpi.runtime.factory import make_dispatcher

mode = sys.argv[1]
w = world()
n, r = w.size, w.rank
BF16 = "bfloat16"


def rb(x):
    """x rounded to bfloat16 (ml_dtypes: round to nearest, ties to even), as float32."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def exact(rank, size, i):
    """Rank ``rank``'s gradient i: small integers times powers of two, so
    every partial sum over up to 3 ranks is a bfloat16 number."""
    k = np.arange(size)
    return (((k % 7 + 1) * (rank + 1) + i) * 2.0 ** (k % 5 - 2)).astype(np.float32)


def random(rank, size, i):
    rng = np.random.default_rng([17, rank, i])
    return (rng.standard_normal(size) * np.exp(rng.uniform(-4, 4, size))).astype(np.float32)


def graph_of(sizes, tiled, scatter, average):
    """Gradients g_i reduced into s (ReduceScatter: this rank's shard) or
    s_i (Allreduce), in bfloat16; ``tiled``: views of one flat bucket."""
    g = Graph("bf16")
    total, names = sum(sizes), [f"g{i}" for i in range(len(sizes))]
    if tiled:
        g.add_blob("bucket", (total,), "float32", kind="bucket")
    off = 0
    for x, size in zip(names, sizes):
        g.add_blob(x, (size,), "float32", kind="grad",
                   **({"alias_of": "bucket", "offset": off} if tiled else {}))
        if not scatter:
            g.add_blob(f"{x}.sum", (size,), "float32", kind="grad",
                       **({"alias_of": "bucket", "offset": off} if tiled else {}))
        off += size
    attrs = {"seq": 0, "bucket": "bucket", "wire_dtype": BF16, "average": average}
    if scatter:
        g.add_op("rs", "ReduceScatter", names, ["s"], dict(attrs, shards=n, shard=r))
    else:
        g.add_op("ar", "Allreduce", names, [f"{x}.sum" for x in names], attrs)
    return g.infer_shapes().validate()


def reduce(sizes, tiled, scatter, average, values):
    g = graph_of(sizes, tiled, scatter, average)
    d = make_dispatcher(g, "event", rank=r, stall_timeout=60.0)
    for i, size in enumerate(sizes):
        d.workspace.set(f"g{i}", values(r, size, i))
    d.run(0)
    d.drain()
    total = sum(sizes)
    lo, hi = shard_range(total, n, r) if scatter else (0, total)
    got = np.array(d.workspace["s"]) if scatter else np.concatenate(
        [np.array(d.workspace[f"g{i}.sum"]) for i in range(len(sizes))])
    kernel = d.kernels["rs" if scatter else "ar"]
    assert kernel.nbytes == 2 * total, (kernel.nbytes, total)   # bfloat16 on the wire
    assert collective_bytes(g) == {"ReduceScatter" if scatter else "Allreduce": 2 * total}
    d.close()
    return got, lo, hi


def orders(parts):
    """Every value a commutative pairwise bfloat16 reduction of ``parts``
    (each rank's rounded gradient) can give, elementwise: the sums of each
    ordering, each step rounded to bfloat16."""
    out = set()
    for perm in itertools.permutations(range(len(parts))):
        acc = parts[perm[0]]
        for q in perm[1:]:
            acc = rb(acc + parts[q])
        out.add(acc.tobytes())
    return [np.frombuffer(b, np.float32) for b in out]


def check_ops():
    for scatter in (False, True):
        for sizes in ([12 * n], [5, 3 * n + 1], [1], [n + 1, 2]):
            for tiled in (True, False):
                # (1) exact sums: bitwise the float32 sum
                got, lo, hi = reduce(sizes, tiled, scatter, False, exact)
                want = np.concatenate([sum(exact(q, s, i) for q in range(n))
                                       for i, s in enumerate(sizes)])[lo:hi]
                assert np.array_equal(got, want), (scatter, sizes, tiled, got, want)
        # the mean: widened, then scaled (b *= 1/size) as in float32
        got, lo, hi = reduce([3, 2 * n + 1], True, scatter, True, exact)
        want = np.concatenate([sum(exact(q, s, i) for q in range(n))
                               for i, s in enumerate([3, 2 * n + 1])])
        want *= 1.0 / n
        assert np.array_equal(got, want[lo:hi]), (got, want[lo:hi])
        # (2) random gradients: one of the reduction's orders, elementwise
        sizes = [40000, 777]
        got, lo, hi = reduce(sizes, True, scatter, False, random)
        parts = [np.concatenate([rb(random(q, s, i)) for i, s in enumerate(sizes)])[lo:hi]
                 for q in range(n)]
        candidates = orders(parts)
        assert np.all(np.any([got == c for c in candidates], axis=0)), \
            "an element is none of the bfloat16 reduction's orders"
        exact_sum = np.sum([p.astype(np.float64) for p in parts], axis=0)
        scale = np.sum([np.abs(p).astype(np.float64) for p in parts], axis=0)
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(scale, 1e-30))) - 7)
        assert np.all(np.abs(got - exact_sum) <= (n - 1) * ulp), "beyond one ulp per add"
        assert np.all(got.view(np.uint32) & 0xFFFF == 0), "not bfloat16 values"
        fp32 = np.sum([np.concatenate([random(q, s, i) for i, s in enumerate(sizes)])[lo:hi]
                       for q in range(n)], axis=0, dtype=np.float32)
        assert not np.array_equal(got, fp32)
    ok(f"grad_bf16 ops n={n}")


# --- nccl: the emulated device ------------------------------------------------
ITERS = 3
SETTINGS = dict(bucket_mb=0.0002, first_bucket_mb=0.00005, min_buckets=2)
cfg = mlp_config(batch=3, hidden=(7, 5))


def composed(scheme):
    from purine_mpi.job.replica import build_train_graph
    from purine_mpi.parallel.data_parallel import compose_data_parallel
    from purine_mpi.parallel.sharding import compose_zero1
    graph, grads = build_train_graph(cfg, r, n)
    if scheme == "data":
        plan = compose_data_parallel(graph, grads, n, r, wire_dtype=BF16, **SETTINGS)
    else:
        plan = compose_zero1(graph, grads, n, r, stage=1, wire_dtype=BF16, **SETTINGS)
    return graph.infer_shapes().validate(), plan


def train(d, graph, weights):
    for p, v in weights.items():
        d.workspace.set(p, v)
    for it in range(ITERS):
        d.workspace["iter"][...] = it
        d.run(it)
    d.drain()
    return {p: to_numpy(d.workspace[p]).copy() for p in weights}


def check_nccl(build_dir):
    import pytest
    from purine_mpi.gpu import kernels
    from purine_mpi.parallel.nccl_backend import use_nccl
    from purine_mpi.parallel.placement import prepare_for_device
    from tests import emulated_gpu as emu
    from tests.emulated_gpu import nccl as emu_nccl
    for scheme in ("data", "sharded"):
        ref_graph, _ = composed(scheme)
        rng = np.random.default_rng(11)
        params = sorted(b.name for b in ref_graph.params())
        weights = {p: (0.3 * rng.standard_normal(ref_graph.blobs[p].shape)).astype(np.float32)
                   for p in params}
        ref = make_dispatcher(ref_graph, "event", rank=r, seed=3, stall_timeout=60.0)
        expected = train(ref, ref_graph, weights)
        ref.close()
        patch = pytest.MonkeyPatch()
        build = build_dir  # every rank and scheme: each kernel built once (host_kernels.py)
        os.makedirs(build, exist_ok=True)
        fake = emu.use_emulated_cupy(patch, pathlib.Path(build))
        launched = []   # the wire: one kernel each way
        for how in ("_launch", "_launch_blocks"):
            patch.setattr(kernels.base, how,
                          lambda source, func, *args, launch=getattr(kernels.base, how): (
                              launched.append(func), launch(source, func, *args)))
        emu_nccl.use_emulated_nccl(patch, fake, device=r)
        graph, _ = composed(scheme)
        prepare_for_device(graph, 0)
        names = use_nccl(graph)
        graph.infer_shapes().validate()
        d = make_dispatcher(graph, runtime=emu.SimulatedRuntime(r, poll_steps=(0, 2)), seed=3,
                            cuda_graph=True, stall_timeout=60.0, log=lambda m: None)
        w.stall_timeout = 60.0
        mine = train(d, graph, weights)
        report = d.capture_report()
        assert launched.count("to_bf16_bits") and launched.count("from_bf16_bits"), launched
        assert report["captured"] == report["segments"] == 1 and report["failed"] == {}, report
        reducing = [x for x in names if graph.ops[x].op_type in ("NcclAllreduce",
                                                                  "NcclReduceScatter")]
        assert reducing and all(graph.ops[x].attrs["wire_dtype"] == BF16 for x in reducing)
        counts = [sum(graph.blobs[b].size for b in graph.ops[x].inputs) for x in reducing]
        counts = [c if graph.ops[x].op_type == "NcclAllreduce" else -(-c // n)
                  for c, x in zip(counts, reducing)]
        calls = [(c[1], c[2]) for c in emu_nccl.CALLS if c[0] == r and c[4] != "allGather"]
        assert calls == [(c, "uint16") for c in counts] * ITERS, (calls, counts)
        d.close()
        patch.undo()
        # the CPU's and the emulated device's kernels may add a gradient in
        # other orders (float32 rounding): an element whose float32 sum lands
        # on the other side of a bfloat16 tie differs by one bfloat16 ulp of
        # the gradient, lr 0.1 x 2^-8 relative; measured: see the OK line
        worst = max(float(np.max(np.abs(mine[p] - expected[p]))) for p in params)
        bitwise = all(np.array_equal(mine[p], expected[p]) for p in params)
        for p in params:
            assert np.allclose(mine[p], expected[p], rtol=1e-3, atol=1e-4), \
                (p, np.max(np.abs(mine[p] - expected[p])))
        for other in w.comm.allgather(mine):
            assert all(np.array_equal(other[p], mine[p]) for p in params)
        ok(f"grad_bf16 nccl {scheme} n={n} collectives={len(reducing)} bitwise={bitwise} "
           f"max_abs_diff={worst:.3g}")


if mode == "ops":
    check_ops()
elif mode == "nccl":
    check_nccl(sys.argv[2])
else:
    raise SystemExit(f"unknown mode {mode}")
