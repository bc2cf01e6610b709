"""EmbeddingGrad's host path adds each token's rows of dy one at a time in
increasing position: np.add.at's bits exactly (the GPU kernels' too:
tests/test_gpu_embedding_grad.py compares them bit for bit), across its
two ways (tokens at most HOST_RANKS times: one pass per occurrence rank;
more: chunks of HOST_CHUNK rows reduced over axis 0) and their
boundaries, a table of width 1 (np.add.at itself), one token at 9
positions of 10, negative zeros, and float16/32/64. The former sort +
``np.add.reduceat`` summed pairwise past a few rows: other bits."""
from types import SimpleNamespace

import numpy as np
import pytest

from purine_mpi.ops import catalog  # noqa: F401 (registers the kernels)
from purine_mpi.ops import embedding
from purine_mpi.ops.registry import get_kernel_class


def _run(dy, ids, vocab):
    k = get_kernel_class("EmbeddingGrad")(SimpleNamespace(attrs={"input_dim": vocab}, name="e"))
    dw = np.full((vocab, dy.shape[-1]), np.nan, dy.dtype)
    k.run([dy, ids], [dw])
    return dw


def _add_at(dy, ids, vocab):
    want = np.zeros((vocab, dy.shape[-1]), dy.dtype)
    np.add.at(want, ids.reshape(-1), dy.reshape(-1, dy.shape[-1]))
    return want


def _same_bits(got, want):
    assert got.dtype == want.dtype
    bad = np.flatnonzero(got.view(np.uint8) != want.view(np.uint8))
    assert not bad.size, (f"{bad.size} bytes differ from np.add.at's", got.ravel()[:4],
                          want.ravel()[:4])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("width", [1, 2, 7, 40])
def test_host_grad_is_add_at_bits_with_heavy_repeats(dtype, width):
    rng = np.random.default_rng(width)
    vocab, n = 50, 3000
    # one token at 9 positions of 10 (chunks of HOST_CHUNK, a short last one)
    ids = np.where(rng.random(n) < 0.9, 17, rng.integers(0, vocab, n))
    dy = rng.standard_normal((n, width)).astype(dtype)
    dy[np.flatnonzero(ids == 17)[:3]] = -0.0   # a run from negative zeros: +0.0 as np.add.at's
    for id_dtype in (np.int64, np.int32, np.uint8):
        _same_bits(_run(dy, ids.astype(id_dtype), vocab), _add_at(dy, ids, vocab))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_host_grad_is_add_at_bits_at_the_split_boundaries(dtype):
    """Tokens exactly HOST_RANKS and HOST_RANKS + 1 times (the two ways),
    HOST_CHUNK (+1) and twice that (the chunks' ends), once, not at all,
    shuffled, in a (N, T) batch."""
    r, c = embedding.HOST_RANKS, embedding.HOST_CHUNK
    counts = {0: r, 1: r + 1, 2: c, 3: c + 1, 4: 2 * c, 5: 2 * c + 1, 6: 1, 8: r - 1}
    rng = np.random.default_rng(3)
    ids = rng.permutation(np.repeat(list(counts), list(counts.values())))
    ids = np.r_[ids, [9] * (-ids.size % 4)].reshape(4, -1)
    dy = rng.standard_normal(ids.shape + (5,)).astype(dtype)
    got = _run(dy, ids, 10)
    _same_bits(got, _add_at(dy, ids, 10))
    assert not got[7].any()


def test_the_former_reduceat_path_had_other_bits():
    """What the test above tells apart: np.add.reduceat over the sorted
    rows (the former host path) is not np.add.at past a few repeats."""
    rng = np.random.default_rng(0)
    ids = np.where(rng.random(2000) < 0.9, 3, rng.integers(0, 8, 2000))
    dy = rng.standard_normal((2000, 16)).astype(np.float32)
    order = np.argsort(ids, kind="stable")
    tokens = ids[order]
    starts = np.flatnonzero(np.r_[True, tokens[1:] != tokens[:-1]])
    former = np.zeros((8, 16), np.float32)
    former[tokens[starts]] = np.add.reduceat(dy[order], starts, axis=0)
    assert not np.array_equal(former, _add_at(dy, ids, 8))


def test_host_grad_takes_each_token_its_way(monkeypatch):
    """Timing-free: on gpt_small's token count a token 90 % of the batch
    goes to the chunked way once (ceil(count / chunk) reduces), the others
    together, at most HOST_RANKS passes; np.add.at's bits."""
    calls = {"rank": [], "run": []}
    by_rank, run = embedding._add_by_rank, embedding._add_run
    monkeypatch.setattr(embedding, "_add_by_rank", lambda *a: (
        calls["rank"].append(a[5].copy()), by_rank(*a))[1])
    monkeypatch.setattr(embedding, "_add_run", lambda *a: (
        calls["run"].append(a[2].size), run(*a))[1])
    rng = np.random.default_rng(1)
    vocab, n = 256, 64 * 256
    ids = np.where(rng.random(n) < 0.9, 32, rng.integers(0, vocab, n))
    dy = rng.standard_normal((n, 3)).astype(np.float32)
    _same_bits(_run(dy, ids, vocab), _add_at(dy, ids, vocab))
    assert calls["run"] == [int((ids == 32).sum())]
    (counts,) = calls["rank"]
    assert counts.size == np.unique(ids[ids != 32]).size
    assert counts.max() <= embedding.HOST_RANKS
