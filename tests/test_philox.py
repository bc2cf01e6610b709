"""Philox4x32-10 and the dropout masks drawn from it.

- the NumPy generator (purine_mpi/base/philox.py) and the CUDA one (cuda/philox.cuh,
  run here compiled for the host, and on a real GPU when there is one)
  against Random123's published known-answer vectors;
- the CPU and (emulated) GPU Dropout ops draw the same masks, bit for bit;
- the masks' statistics, and their dependence on seed, op, iteration only;
- the dropout op keeps no generator state (nothing to checkpoint);
- the chunked host draw against the whole-array draw it replaced (kept in
  benchmarks/philox_speed.py), bit for bit, and its memory: a chunk's.
"""
import os
import sys
import tracemalloc

import numpy as np
import pytest

from purine_mpi.base import philox
from purine_mpi.graph.core import Op
from purine_mpi.gpu import kernels
from purine_mpi.ops.catalog import get_kernel_class
from tests.conftest import REPO

# Random123 tests/kat_vectors (github.com/DEShawResearch/random123): name,
# rounds, counter (4 words), key (2 words), expected output (4 words).
KAT = """
philox4x32 7 00000000 00000000 00000000 00000000 00000000 00000000   5f6fb709 0d893f64 4f121f81 4f730a48
philox4x32 7 ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff   5207ddc2 45165e59 4d8ee751 8c52f662
philox4x32 7 243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0   4dfccaba 190a87f0 c47362ba b6b5242a
philox4x32 10 00000000 00000000 00000000 00000000 00000000 00000000   6627e8d5 e169c58d bc57ac4c 9b00dbd8
philox4x32 10 ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff   408f276d 41c83b0e a20bc7c6 6d5451fd
philox4x32 10 243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0   d16cfe09 94fdcceb 5001e420 24126ea1
"""


def _kat():
    for line in KAT.strip().splitlines():
        words = line.split()
        rounds = int(words[1])
        values = [int(w, 16) for w in words[2:]]
        yield rounds, values[:4], values[4:6], values[6:]


KAT_CASES = list(_kat())


@pytest.mark.parametrize("case", KAT_CASES, ids=[f"r{c[0]}-{i}" for i, c in enumerate(KAT_CASES)])
def test_numpy_philox_known_answers(case):
    rounds, counter, key, expected = case
    got = philox.philox4x32(counter, key, rounds)
    assert [int(v) for v in got] == expected


@pytest.mark.parametrize("case", KAT_CASES, ids=[f"r{c[0]}-{i}" for i, c in enumerate(KAT_CASES)])
def test_cuda_philox_known_answers(backend, case):  # noqa: F811
    rounds, counter, key, expected = case
    words = backend.to_host(kernels.philox_words(counter, key, 1, rounds))
    assert [int(v) for v in words] == expected


def test_cuda_philox_stream_matches_numpy(backend):  # noqa: F811
    """Many consecutive counters (the grid-stride loop, a counter-word carry)."""
    counter, key = (0xFFFFFFF0, 5, 6, 7), (0x12345678, 0x9ABCDEF0)
    got = backend.to_host(kernels.philox_words(counter, key, 37))
    blocks = (np.arange(37, dtype=np.uint64) + counter[0]).astype(np.uint32)
    want = philox.philox4x32((blocks,) + counter[1:], key).T.reshape(-1)
    np.testing.assert_array_equal(got, want)


def test_vectorised_stream_equals_one_counter_at_a_time():
    bits = philox.random_bits(10, 3, 4, 5, (1 << 40) + 9)
    for i in range(10):
        one = philox.philox4x32((i // 4, 5, 9, 1 << 8), (3, 4))
        assert bits[i] == one[i % 4]


def test_keep_threshold():
    assert philox.keep_threshold(0.0) == 0
    assert philox.keep_threshold(0.5) == 1 << 31
    assert philox.keep_threshold(0.25) == 1 << 30
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="ratio"):
            philox.keep_threshold(bad)


@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.8])
def test_mask_statistics(ratio):
    """Keep rate 1 - ratio within 5 sigma; neighbours (and words of one
    block) uncorrelated; the words uniform (chi-square over 16 bins)."""
    n = 200_000
    keep = philox.keep_mask((n,), ratio, 1, 2, 3, 4).astype(np.float64)
    p = 1.0 - ratio
    sigma = np.sqrt(p * (1 - p) / n)
    assert abs(keep.mean() - p) < 5 * sigma
    for lag in (1, 2, 4):
        c = np.corrcoef(keep[:-lag], keep[lag:])[0, 1]
        assert abs(c) < 5 / np.sqrt(n), (lag, c)
    bits = philox.random_bits(n, 1, 2, 3, 4)
    counts = np.bincount(bits >> np.uint32(28), minlength=16)
    chi2 = float(((counts - n / 16) ** 2 / (n / 16)).sum())
    assert chi2 < 50.0  # 15 degrees of freedom: P(chi2 > 50) ~ 1e-5
    assert philox.keep_mask((1000,), 0.0, 1, 2, 3, 4).all()


def test_masks_depend_on_seed_op_and_iteration_only():
    base = philox.keep_mask((4096,), 0.5, *philox.dropout_keys(7, "drop.fwd"), 3)
    again = philox.keep_mask((4096,), 0.5, *philox.dropout_keys(7, "drop.fwd"), 3)
    np.testing.assert_array_equal(base, again)
    for other in (philox.keep_mask((4096,), 0.5, *philox.dropout_keys(8, "drop.fwd"), 3),
                  philox.keep_mask((4096,), 0.5, *philox.dropout_keys(7, "drop2.fwd"), 3),
                  philox.keep_mask((4096,), 0.5, *philox.dropout_keys(7, "drop.fwd"), 4),
                  philox.keep_mask((4096,), 0.5, *philox.dropout_keys(7 + (1 << 32),
                                                                      "drop.fwd"), 3)):
        agree = (other == base).mean()
        assert 0.45 < agree < 0.55  # independent streams agree half the time
    # a mask is a prefix of a longer one: the shape does not change the stream
    longer = philox.keep_mask((5000,), 0.5, *philox.dropout_keys(7, "drop.fwd"), 3)
    np.testing.assert_array_equal(longer[:4096], base)


def _dropout_kernel(name="drop.fwd", ratio=0.3, seed=None):
    attrs = {"ratio": ratio} if seed is None else {"ratio": ratio, "seed": seed}
    return get_kernel_class("Dropout")(Op(name, "Dropout", [], [], attrs))


def test_dropout_op_takes_the_runtime_seed_and_keeps_no_generator():
    from purine_mpi.runtime.dispatcher import SerialDispatcher
    from purine_mpi.graph import Graph
    g = Graph("drop")
    g.add_blob("x", (6, 5))
    g.add_blob("iter", (), "int64", kind="iter")
    g.add_op("d", "Dropout", ["x", "iter"], ["y", "m"], {"ratio": 0.5})
    g.infer_shapes()
    d = SerialDispatcher(g, seed=1234)
    k = d.kernels["d"]
    assert k.rng is None  # nothing for a checkpoint to save
    assert k.keys == philox.dropout_keys(1234, "d")
    d.workspace.set("x", np.ones((6, 5), np.float32))
    d.workspace["iter"][...] = 5
    d.run(5)
    keep = philox.keep_mask((6, 5), 0.5, *philox.dropout_keys(1234, "d"), 5)
    np.testing.assert_array_equal(d.workspace["m"], keep.astype(np.float32))
    np.testing.assert_array_equal(d.workspace["y"], keep * np.float32(2.0))
    # without a runtime the seed attr is used
    assert _dropout_kernel("d", seed=99).keys == philox.dropout_keys(99, "d")


def test_dropout_needs_the_iteration_input():
    from purine_mpi.base.errors import ShapeError
    cls = get_kernel_class("Dropout")
    with pytest.raises(ShapeError, match=r"\[x, iter\]"):
        cls.infer({"ratio": 0.5}, [((3, 4), "float32")])
    with pytest.raises(ShapeError, match="iteration"):
        cls.infer({"ratio": 0.5}, [((3, 4), "float32"), ((2,), "int64")])
    assert cls.infer({"ratio": 0.5, "phase": "test"}, [((3, 4), "float32")]) == \
        [((3, 4), "float32")]


# ------------------------------------------- the chunked draw against the reference
# benchmarks/philox_speed.py keeps the draw the chunked one replaced (the whole
# array at once) as its reference: the two must give the same words everywhere.
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from philox_speed import (reference_keep_mask, reference_philox4x32,  # noqa: E402
                          reference_random_bits)


def _random_stream(rng):
    """Keys, counter word 1 and an iteration (often >= 2^32, some near 2^64)."""
    key0, key1, ctr1 = (int(v) for v in rng.integers(0, 1 << 32, 3, dtype=np.uint64))
    iteration = int(rng.choice([rng.integers(0, 1 << 20), rng.integers(1 << 32, 1 << 63),
                                (1 << 64) - 1 - int(rng.integers(0, 9))]))
    return key0, key1, ctr1, iteration


def test_philox4x32_equals_the_reference():
    rng = np.random.default_rng(5)
    for n in (1, 3, 1000):
        counter = rng.integers(0, 1 << 32, (4, n), dtype=np.uint64).astype(np.uint32)
        key = [int(k) for k in rng.integers(0, 1 << 32, 2, dtype=np.uint64)]
        for rounds in (0, 1, 7, 10):
            np.testing.assert_array_equal(philox.philox4x32(counter, key, rounds),
                                          reference_philox4x32(counter, key, rounds))
    # scalars broadcast against arrays, as the stream's counters are
    blocks = np.arange(10, dtype=np.uint32)
    np.testing.assert_array_equal(philox.philox4x32((blocks, 5, 6, 7), (8, 9)),
                                  reference_philox4x32((blocks, 5, 6, 7), (8, 9)))


@pytest.mark.parametrize("chunk", [1, 3, 7, None])
def test_chunked_draw_equals_the_reference(monkeypatch, chunk):
    """random_bits and keep_mask (unsplit and tensor-parallel shards: runs
    longer than a chunk, and chunks of whole runs) give the reference's
    words over odd sizes, starts, splits and iterations >= 2^32; a chunk
    of 1, 3 and 7 blocks puts chunk edges everywhere, the default one is
    crossed by the larger cases."""
    if chunk is not None:
        monkeypatch.setattr(philox, "CHUNK", chunk)
    rng = np.random.default_rng(chunk or 0)
    big, paths = 4 * philox.CHUNK, set()
    for _ in range(12):
        stream = _random_stream(rng)
        count = int(rng.integers(0, 3 * big))
        start = int(rng.choice([rng.integers(0, 9), rng.integers(0, 1 << 33)]))
        np.testing.assert_array_equal(philox.random_bits(count, *stream, start=start),
                                      reference_random_bits(count, *stream, start=start))
        ratio = float(rng.choice([0.0, 0.1, 0.5, rng.random() * 0.999]))
        shape = tuple(int(s) for s in rng.integers(1, 12, int(rng.integers(1, 4))))
        grow = max(1, 3 * big // int(np.prod(shape)))   # about 3 chunks at most
        shape = shape[:-1] + (shape[-1] * int(rng.integers(1, 1 + grow)),)
        np.testing.assert_array_equal(philox.keep_mask(shape, ratio, *stream),
                                      reference_keep_mask(shape, ratio, *stream))
        for axis in range(-len(shape), len(shape)):
            parts = int(rng.integers(1, 6))
            split = {"axis": axis, "parts": parts, "index": int(rng.integers(0, parts))}
            np.testing.assert_array_equal(philox.keep_mask(shape, ratio, *stream, split),
                                          reference_keep_mask(shape, ratio, *stream, split),
                                          err_msg=f"{shape} {split}")
            paths.add(philox._plan(shape, split)[6])
    assert paths == {False, True}   # chunks of whole runs, and runs drawn as ranges


@pytest.mark.parametrize("shape, split", [
    ((0,), None), ((0, 4), {"axis": 1, "parts": 2, "index": 1}),
    ((3, 0, 2), {"axis": 1, "parts": 2, "index": 0}), ((4, 0), {"axis": 0, "parts": 2, "index": 1}),
    ((5, 1), {"axis": -1, "parts": 3, "index": 2})])
def test_empty_and_one_word_runs_equal_the_reference(shape, split):
    """Shapes with an empty axis (runs of no element) and runs of one."""
    got = philox.keep_mask(shape, 0.3, 1, 2, 3, 1 << 33, split)
    assert got.shape == shape and got.dtype == bool
    np.testing.assert_array_equal(got, reference_keep_mask(shape, 0.3, 1, 2, 3, 1 << 33, split))


def test_halves_follow_the_byte_order():
    """The 32-bit halves of a uint64 are its words in memory order on either
    byte order (the low word second on a big-endian array), and the rounds
    on big-endian buffers give Random123's answers."""
    values = [0x0123456789ABCDEF, 0xFFFFFFFF00000001]
    for order in ("<", ">", "="):
        a = np.array(values, dtype=np.dtype(np.uint64).newbyteorder(order))
        hi, lo = philox.halves(a)
        assert [int(v) for v in hi] == [v >> 32 for v in values], order
        assert [int(v) for v in lo] == [v & 0xFFFFFFFF for v in values], order
    big = np.dtype(np.uint64).newbyteorder(">")
    for rounds, counter, key, expected in KAT_CASES:
        x0, x2, p0, p1, q0, q1 = (np.zeros(1, big) for _ in range(6))
        for buffer, word in ((x0, 0), (p1, 1), (x2, 2), (p0, 3)):
            buffer[0] = counter[word]
        got = philox._rounds(x0, x2, p0, p1, q0, q1, key, rounds)
        assert [int(w[0]) for w in got] == expected


def test_keep_mask_holds_a_chunk_not_the_words():
    """keep_mask compares each chunk's words as they come: besides its
    result it holds a chunk's buffers (under 2 MiB), whatever the size; the
    whole-array draw held ~14 bytes an element (56 MiB for 4 Mi elements)."""
    n = 4 << 20
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        keep = philox.keep_mask((n,), 0.1, 1, 2, 3, 4)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert keep.nbytes == n
    assert peak - before - keep.nbytes < 2 << 20, peak - before


def test_speed_benchmark_prints_both_sides():
    """benchmarks/philox_speed.py end to end, tiny: each case's ns an element
    of both sides in every round and their ratios (figures not asserted)."""
    import json
    import subprocess
    out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "philox_speed.py"),
                          "--sizes", "1001", "--split", "2,3,5,7", "--rounds", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    cases = json.loads(out.stdout)["cases"]
    assert sorted(cases) == ["keep_mask_1001", "keep_mask_split_2x3x5x7_of_2"]
    for case in cases.values():
        old, new = case["old_ns_per_element"], case["new_ns_per_element"]
        assert len(old["rounds"]) == len(new["rounds"]) == 2
        assert case["ratio_old_over_new"]["pairs"] == [
            pytest.approx(a / b, rel=0.05) for a, b in zip(old["rounds"], new["rounds"])]
