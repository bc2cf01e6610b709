"""The column sums of a tall matrix (cuda/reduce.cu ``sum_rows``: tiles of
32 columns x ranges of rows, a block per (tile, range), then
``bias_grad_finish`` adding each column's partial sums in range order): a
fully connected layer's bias gradient, a layer norm's dg and db, the im2col
weight gradient's per-sample partial products, on the host-compiled
kernels (g++, tests/emulated_gpu/host_kernels.py) and on a GPU when there
is one. Against NumPy in float64, and bit for bit against a model of the
order the kernels promise (which a wrong range order, a missing range or
a different tree fails)."""
import ctypes

import numpy as np
import pytest

from purine_mpi.gpu import kernel_source, kernels
from purine_mpi.gpu.kernels.base import _REDUCE_THREADS
from purine_mpi.gpu.kernels.elementwise import SUM_ROWS_TILE, bias_grad_splits
from tests.emulated_gpu.fixtures import backend  # noqa: F401
from tests.emulated_gpu.host_kernels import _EMU_THREADS, host_cupy

SHAPES = [
    (1, 5),          # one row
    (7, 1),          # one column
    (1000, 40),      # 7 row ranges of 142-143 rows; 2 tiles, the second 8 columns wide
    (16384, 3),      # tall and narrow: 12 ranges
    (3, 70),         # fewer rows than a block's row lanes, 3 tiles
    (0, 4),          # no rows: zeros (or out unchanged when accumulating)
]


def model(x, threads, out=None):
    """The column sums of ``x`` (rows, cols) float64 in the kernels' order:
    each range's rows split over the block's row lanes (row lane r: rows
    first + r, first + r + depth, ..., added in order), a tree over the row
    lanes (pairs at distance 1, 2, 4, ...), then the ranges' sums in order
    after ``out`` (accumulating) or from 0."""
    rows, cols = x.shape
    splits = bias_grad_splits(rows, cols, 1)
    lanes = min(threads, SUM_ROWS_TILE)
    depth = threads // lanes
    result = np.empty(cols)
    for c in range(cols):
        parts = []
        for s in range(splits):
            first, last = s * rows // splits, (s + 1) * rows // splits
            sums = []
            for r in range(depth):
                acc = 0.0
                for i in range(first + r, last, depth):
                    acc += float(x[i, c])
                sums.append(acc)
            stride = 1
            while stride < depth:
                for r in range(0, depth, 2 * stride):
                    if r + stride < depth:
                        sums[r] += sums[r + stride]
                stride *= 2
            parts.append(sums[0])
        total = 0.0 if out is None else float(out[c])
        if out is None and splits == 1:
            total = parts[0]
        else:
            for p in parts:
                total += p
        result[c] = total
    return result


def _spread(rng, shape):
    """float64 values over 16 decades: their sums' bits depend on the order."""
    return rng.standard_normal(shape) * 10.0 ** rng.integers(-8, 8, size=shape)


def test_the_splits_fill_the_gpu_and_depend_on_the_shape_alone():
    """GPT-2 124M's (16384, C) dys: about BIAS_GRAD_BLOCKS (tile, range)
    blocks, >= 7 per SM of an H200's 132 (one wave of 256-thread blocks),
    each range >= 128 rows; a short wide matrix is one range."""
    got = {c: bias_grad_splits(16384, c, 1) for c in (768, 2304, 3072)}
    assert got == {768: 42, 2304: 14, 3072: 10}
    for c, s in got.items():
        assert 7 * 132 <= -(-c // SUM_ROWS_TILE) * s <= 1024
    assert bias_grad_splits(16, 1024 * 768, 1) == 1     # a position embedding's dw
    assert bias_grad_splits(16384, 3, 1) == 12          # rows * 3 // 4096
    assert bias_grad_splits(1, 5, 1) == 1 and bias_grad_splits(0, 4, 1) == 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_sum_rows_matches_numpy_in_float64(backend, shape, dtype):  # noqa: F811
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(dtype)
    start = rng.standard_normal(shape[1]).astype(dtype)
    want = x.astype(np.float64).sum(axis=0)
    for accumulate in (False, True):
        out = backend.to_device(start.copy())
        kernels.sum_rows(backend.to_device(x), out, accumulate=accumulate)
        got = backend.to_host(out)
        expect = want + start.astype(np.float64) if accumulate else want
        if dtype == np.float32:   # summed in double, rounded once: exact here
            np.testing.assert_array_equal(got, expect.astype(np.float32))
        else:
            np.testing.assert_allclose(got, expect, rtol=1e-13, atol=1e-13)
        # again into the same buffer, reset: the same bits
        again = backend.to_device(start.copy())
        kernels.sum_rows(backend.to_device(x), again, accumulate=accumulate)
        assert backend.to_host(again).tobytes() == got.tobytes()


@pytest.mark.parametrize("shape", [(1000, 40), (16384, 3), (3, 70), (7, 1)])
def test_sum_rows_has_the_bits_of_its_order(backend, shape):  # noqa: F811
    """float64 values over 16 decades, so any other order gives other bits;
    the given scratch is used (a range's partial sums land in it)."""
    rng = np.random.default_rng(len(shape) + shape[0])
    x = _spread(rng, shape)
    start = _spread(rng, shape[1])
    threads = _REDUCE_THREADS if backend.name == "cupy" else _EMU_THREADS
    (size,), _ = kernels.bias_grad_scratch(shape)
    for accumulate in (False, True):
        out = backend.to_device(start.copy())
        partial = backend.to_device(np.full(size, np.nan))
        kernels.sum_rows(backend.to_device(x), out, accumulate=accumulate, partial=partial)
        want = model(x, threads, start if accumulate else None)
        np.testing.assert_array_equal(backend.to_host(out), want)
        assert np.isnan(backend.to_host(partial)).all() == (bias_grad_splits(*shape, 1) == 1)


def test_whole_blocks_of_256_threads_have_the_bits_of_the_model(host_build_dir):
    """The emulated device runs every block with 3 threads (one row lane);
    here the host-compiled kernel runs blocks of the GPU's 256 threads (32
    columns x 8 row lanes: the tree over the row lanes), on 3 blocks (the
    grid-stride loop over the (tile, range) jobs)."""
    cupy = host_cupy(host_build_dir)
    reduce = cupy.RawModule(code=kernel_source("reduce"))
    sum_rows, finish = reduce.get_function("sum_rows_f64"), reduce.get_function(
        "bias_grad_finish_f64")
    if sum_rows._fiber_grid is None:
        pytest.skip("the emulator runs blocks as fibers only where <ucontext.h> is")
    rng = np.random.default_rng(7)
    for shape in [(1000, 40), (2053, 3), (5, 33)]:
        x, start = _spread(rng, shape), _spread(rng, shape[1])
        rows, cols = shape
        splits = bias_grad_splits(rows, cols, 1)
        for accumulate in (0, 1):
            out, partial = start.copy(), np.zeros(kernels.bias_grad_scratch(shape)[0])
            args = (np.int64(cols), x, np.int64(rows), np.int64(splits), np.int32(accumulate),
                    partial, out)
            c_args = [sum_rows._convert(i, a, p) for i, (a, p) in
                      enumerate(zip(args, sum_rows.params))]
            sum_rows._fiber_grid(ctypes.c_uint(3), ctypes.c_uint(_REDUCE_THREADS), *c_args)
            if splits > 1:
                finish((1,), (1,), (np.int64(cols), np.int64(splits), np.int32(accumulate),
                                    partial, out))
            want = model(x, _REDUCE_THREADS, start if accumulate else None)
            np.testing.assert_array_equal(out, want)


F32 = np.float32


def _layer_norm_grad_inputs(rng):
    x = rng.standard_normal((2, 3000, 40)).astype(F32)
    mean = x.mean(axis=-1)
    rstd = 1.0 / np.sqrt(x.var(axis=-1) + 1e-5)
    return [rng.standard_normal(x.shape).astype(F32), x, rng.standard_normal(40).astype(F32),
            mean.astype(F32), rstd.astype(F32)]


@pytest.mark.parametrize("op_type,attrs,make,launched", [
    ("InnerProductGradBias", {},
     lambda rng: [rng.standard_normal((2, 3000, 40)).astype(F32)],
     ["sum_rows_vec_f32", "bias_grad_finish"]),
    ("LayerNormGrad", {"outputs": ["dg", "db"]}, _layer_norm_grad_inputs,
     # db's column sums of dy first, then the backward kernel, then dg's
     # (a bits copy of dx may take dy's bytes: the sums read dy before it;
     # float32, 40 columns, aligned: the vectorised column sums)
     ["sum_rows_vec_f32", "bias_grad_finish", "layernorm_backward", "sum_rows_vec_f32",
      "bias_grad_finish"]),
    ("PositionEmbeddingGrad", {"max_length": 5},
     lambda rng: [rng.standard_normal((3000, 4, 10)).astype(F32)],
     ["sum_rows_vec_f32", "bias_grad_finish"]),
])
def test_the_ops_sum_columns_in_their_reserved_scratch(host_build_dir, monkeypatch, op_type,
                                                        attrs, make, launched):
    """A fully connected layer's bias gradient, a layer norm's dg and db, a
    position embedding's gradient, 6000 (3000) rows of 40 columns: several
    row ranges, so the tiled column sum and the finish, their partial sums
    in the scratch the op reserved at setup -- a steady run allocates
    nothing (a CUDA-graph capture must not) and gives the first run's
    bits -- and NumPy's sums (the ops' CPU branch) within float32 rounding."""
    from purine_mpi.graph.core import Op
    from purine_mpi.gpu.raw import op_scratch
    from purine_mpi.gpu.scratch import Scratch
    from purine_mpi.ops.catalog import get_kernel_class
    from tests.emulated_gpu import Allocations, run_kernel, use_emulated_cupy
    inputs = make(np.random.default_rng(2))
    cpu = run_kernel(op_type, attrs, inputs)
    use_emulated_cupy(monkeypatch, host_build_dir)
    import cupy
    calls = []
    real = kernels.base._launch_blocks, kernels.base._launch
    monkeypatch.setattr(kernels.base, "_launch_blocks",
                        lambda *a: (calls.append(a[1]), real[0](*a))[1])
    monkeypatch.setattr(kernels.base, "_launch", lambda *a: (calls.append(a[1]), real[1](*a))[1])
    cls = get_kernel_class(op_type)
    kernel = cls(Op("probe", op_type, [], [], dict(attrs)))
    ins = [cupy.asarray(a) for a in inputs]
    outs = [cupy.asarray(np.full(shape, np.nan, dtype))
            for shape, dtype in cls.infer(attrs, [(a.shape, str(a.dtype)) for a in inputs])]
    kernel.setup(ins, outs)
    partial = kernels.bias_grad_scratch((6000, 40) if op_type != "PositionEmbeddingGrad"
                                        else (3000, 40))
    assert partial in kernel.scratch_specs(ins, outs)
    assert op_scratch(kernel, 0).reserved >= Scratch._layout(kernel.scratch_specs(ins, outs))[1]
    kernel.run(ins, outs)    # the first run allocates the reserved scratch (gpu/scratch.py)
    first = [cupy.asnumpy(o).copy() for o in outs]
    calls.clear()
    Allocations.log, Allocations.counting = [], True
    try:
        kernel.run(ins, outs)
    finally:
        Allocations.counting = False
    assert Allocations.log == []
    assert calls == launched
    for c, f, g in zip(cpu, first, outs):
        np.testing.assert_array_equal(cupy.asnumpy(g), f)
        np.testing.assert_allclose(f, c, rtol=2e-5, atol=2e-5)
