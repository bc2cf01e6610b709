"""EmbeddingGrad's GPU branch: two raw kernels (cuda/reduce.cu
``embedding_order``: the positions sorted by (token, position) into the
op's scratch; ``embedding_grad``: a block per row of dw adds its token's
rows of dy in position order), against NumPy's ``np.add.at`` (sequential,
in position order: the same bits in float32 and float64) and the op's host
path (the same bits), on the emulated device (2 blocks of 3 threads: the grid-strides and
the width split are exercised) and on a real GPU when there is one. Two
launches, no cuBLAS, the sort's scratch reserved at setup (and stale sort
scratch from another batch, or garbage, changes nothing), nothing
allocated."""
import numpy as np
import pytest

from purine_mpi.graph.core import Op
from purine_mpi.ops.catalog import get_kernel_class
from tests.emulated_gpu.fixtures import device  # noqa: F401
from tests.emulated_gpu.helpers import run_kernel

WIDTH = 7   # not a multiple of the emulated block (3 threads) nor of a GPU's (256)


def _ids(vocab, n, pattern, dtype, seed):
    rng = np.random.default_rng(seed)
    if pattern == "skew":   # one token at every position: a tile's first row (32), or V-1
        return np.full(n, min(32, vocab - 1), dtype=dtype)
    if pattern == "hot":   # one token at 9 positions of 10 (a run past a stage of 256), 0, V-1
        ids = np.where(rng.random(n) < 0.9, vocab // 2, rng.integers(0, vocab, n))
        ids[0], ids[-1] = 0, vocab - 1
        return ids.astype(dtype)
    ids = rng.integers(0, min(vocab, max(2, n // 3)), n)   # repeats
    ids[rng.permutation(n)[:n // 4]] = rng.integers(0, vocab, n // 4)
    ids[0] = vocab - 1
    ids[n // 2] = 0
    if n > 2:
        ids[-1] = vocab - 1
    return ids.astype(dtype)


def _kernel(vocab):
    return get_kernel_class("EmbeddingGrad")(Op("probe", "EmbeddingGrad", [], [],
                                                 {"input_dim": vocab}))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("pattern", ["random", "skew", "hot"])
@pytest.mark.parametrize("n", [1, 37, 300])
@pytest.mark.parametrize("vocab", [7, 100, 1000])
def test_embedding_grad_kernel_matches_add_at(device, vocab, n, pattern, dtype):  # noqa: F811
    dy = np.random.default_rng(n).standard_normal((n, WIDTH)).astype(dtype)
    for seed, id_dtype in enumerate((np.int64, np.int32)):
        ids = _ids(vocab, n, pattern, id_dtype, seed)
        want = np.zeros((vocab, WIDTH), dtype)
        np.add.at(want, ids, dy)   # dw[ids[p]] += dy[p], p in order
        exact = np.zeros((vocab, WIDTH))
        np.add.at(exact, ids, dy.astype(np.float64))
        device.launched.clear()
        (got,) = run_kernel("EmbeddingGrad", {"input_dim": vocab}, [dy, ids], device.to_device)
        assert device.launched == ["embedding_order" if id_dtype is np.int64
                                   else "embedding_order_i32", "embedding_grad"]
        # the same additions in the same order: the same bits (float32 too)
        np.testing.assert_array_equal(got, want, err_msg=f"{id_dtype.__name__} ids")
        tol = 1e-13 if dtype == np.float64 else 1e-5
        np.testing.assert_allclose(got, exact, rtol=tol, atol=tol)
        # the host path adds in position order too (tests/test_embedding_host.py):
        # the same bits, a token at 9 positions of 10 included
        (host,) = run_kernel("EmbeddingGrad", {"input_dim": vocab}, [dy, ids])
        np.testing.assert_array_equal(host, got, err_msg=f"host, {id_dtype.__name__} ids")


@pytest.mark.parametrize("id_dtype", [np.int64, np.int32, np.uint32, np.uint8])
def test_embedding_grad_allocates_nothing_and_uses_no_scratch(device, id_dtype):  # noqa: F811
    """No one-hot: the sort's scratch (2 n + 2 V int32; an int32 copy of
    1-byte ids too), no cuBLAS (no per-stream handle), and a steady run
    allocates nothing on the device."""
    if device.name != "emulated":
        pytest.skip("the allocation log is the emulated device's")
    from tests.emulated_gpu import Allocations
    vocab, n = 100, 40
    dy = np.random.default_rng(2).standard_normal((4, n // 4, WIDTH)).astype(np.float32)
    ids = _ids(vocab, n, "random", id_dtype, 3).reshape(4, n // 4)
    want = np.zeros((vocab, WIDTH), np.float32)
    np.add.at(want, ids.ravel().astype(np.int64), dy.reshape(n, WIDTH))
    kernel = _kernel(vocab)
    ins = [device.to_device(dy), device.to_device(ids)]
    outs = [device.to_device(np.full((vocab, WIDTH), np.nan, np.float32))]
    specs = kernel.scratch_specs(ins, outs)
    sort = [((n,), np.int32)] * 2 + [((vocab,), np.int32)] * 2
    assert specs == (sort if np.dtype(id_dtype).itemsize >= 4 else sort + [((n,), np.int32)])
    assert not kernel.runs_products(ins, outs)
    kernel.setup(ins, outs)
    kernel.run(ins, outs)
    device.launched.clear()
    Allocations.counting, Allocations.log = True, []
    try:
        kernel.run(ins, outs)
    finally:
        Allocations.counting = False
    assert Allocations.log == []
    assert len(device.launched) == 2
    np.testing.assert_array_equal(device.to_host(outs[0]), want)


def test_embedding_grad_ignores_stale_or_garbage_sort_scratch(device):  # noqa: F811
    """The sort's first/end tables are not cleared between runs: a row
    whose token occurred in an earlier batch (or whose scratch holds any
    number) but not in this one is zero, each run np.add.at's bits."""
    vocab, n = 50, 40
    kernel = _kernel(vocab)
    rng = np.random.default_rng(5)
    dy = rng.standard_normal((n, WIDTH)).astype(np.float32)
    ins = [device.to_device(dy), device.to_device(np.zeros(n, np.int32))]
    outs = [device.to_device(np.full((vocab, WIDTH), np.nan, np.float32))]
    kernel.setup(ins, outs)
    scratch = kernel.temporaries(outs[0], *kernel.scratch_specs(ins, outs))
    for a in scratch:   # garbage, valid-looking ranks included
        a[...] = device.to_device(rng.integers(-3, n + 3, a.size).astype(np.int32))
    batches = [rng.integers(0, vocab, n), rng.integers(0, vocab // 5, n),
               np.full(n, 7), rng.integers(vocab // 2, vocab, n)]
    for ids in batches:
        ids = ids.astype(np.int32)
        ins[1] = device.to_device(ids)
        kernel.run(ins, outs)
        want = np.zeros((vocab, WIDTH), np.float32)
        np.add.at(want, ids, dy)
        np.testing.assert_array_equal(device.to_host(outs[0]), want)
