"""The host Philox draw's speed: purine_mpi/base/philox.py's keep_mask (the
chunked draw) against the reference, the vectorised draw it replaced (this
file's ``reference_*``: the whole array at once, ~8 full-size uint64/uint32
temporaries a round; tests/test_philox.py checks the two bit for bit).

    .venv/bin/python benchmarks/philox_speed.py [--sizes 2097152 8388608]
        [--split 32,2,128,128] [--rounds 3] [--chunk BLOCKS]
        [--train-pairs N --config jobs/gpt_tiny.yaml --set KEY=VALUE ...]

Cases: a 1-D keep_mask of each of ``--sizes`` elements, and a
tensor-parallel shard's (``--split``: the shard's shape, heads axis 1 of 2
parts, part 1 -- the fused attention's (N, H, T, T) mask of gpt_tiny, batch
32, under 2-way tensor parallelism). ``--chunk`` sets the new draw's chunk
(philox.CHUNK, blocks) to compare sizes. Rounds interleave the two sides (their
order alternating); prints one JSON object: per case, each side's ns an
element (the best and every round: the machine may be shared) and the ratio
old / new of the best and of each round's pair.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from purine_mpi.base import philox  # noqa: E402

_U32 = np.uint32
_MASK32 = np.uint64(0xFFFFFFFF)


def _mulhilo(multiplier, x):
    product = np.uint64(multiplier) * x.astype(np.uint64)
    return (product >> np.uint64(32)).astype(_U32), (product & _MASK32).astype(_U32)


def reference_philox4x32(counter, key, rounds=philox.ROUNDS):
    """The replaced philox4x32 (whole arrays, a copy per operation)."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=_U32) for c in counter)
    c0, c1, c2, c3 = np.broadcast_arrays(c0, c1, c2, c3)
    k0, k1 = _U32(int(key[0]) & 0xFFFFFFFF), _U32(int(key[1]) & 0xFFFFFFFF)
    with np.errstate(over="ignore"):
        for r in range(rounds):
            if r > 0:
                k0 = _U32((int(k0) + philox.W0) & 0xFFFFFFFF)
                k1 = _U32((int(k1) + philox.W1) & 0xFFFFFFFF)
            hi0, lo0 = _mulhilo(philox.M0, c0)
            hi1, lo1 = _mulhilo(philox.M1, c2)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return np.stack([np.asarray(c, dtype=_U32) for c in (c0, c1, c2, c3)])


def _reference_block_words(blocks, elements, key0, key1, ctr1, iteration):
    if -(-int(elements) // 4) > (1 << 32):
        raise ValueError("a Philox dropout stream holds at most 2^34 elements")
    iteration = int(iteration) % (1 << 64)
    return reference_philox4x32((blocks.astype(_U32), ctr1, iteration & 0xFFFFFFFF,
                                 iteration >> 32), (key0, key1))


def reference_random_bits(count, key0, key1, ctr1, iteration, start=0):
    """The replaced random_bits."""
    count, start = int(count), int(start)
    first, end = start // 4, -(-(start + count) // 4)
    words = _reference_block_words(np.arange(first, end, dtype=np.uint64), start + count,
                                   key0, key1, ctr1, iteration)
    skip = start - 4 * first
    return words.T.reshape(-1)[skip:skip + count]


def reference_keep_mask(shape, ratio, key0, key1, ctr1, iteration, split=None):
    """The replaced keep_mask (every word of the array drawn at once)."""
    threshold = _U32(philox.keep_threshold(ratio))
    shape = tuple(int(s) for s in shape)
    if not split or int(split["parts"]) == 1:
        count = int(np.prod(shape, dtype=np.int64))
        return (reference_random_bits(count, key0, key1, ctr1, iteration)
                >= threshold).reshape(shape)
    axis, parts, index = (int(split[k]) for k in ("axis", "parts", "index"))
    axis = axis + len(shape) if axis < 0 else axis
    runs = int(np.prod(shape[:axis], dtype=np.int64))
    run = int(np.prod(shape[axis:], dtype=np.int64))
    starts = (np.arange(runs, dtype=np.uint64) * parts + index) * run
    skips = (starts % 4).astype(np.int64)
    blocks = -(-(run + int(skips.max(initial=0))) // 4)
    first = starts // 4
    words = _reference_block_words(
        (first[:, None] + np.arange(blocks, dtype=np.uint64)).reshape(-1),
        runs * parts * run, key0, key1, ctr1, iteration)
    words = words.T.reshape(runs, 4 * blocks)
    keep = np.empty((runs, run), dtype=bool)
    for skip in np.unique(skips):
        rows = skips == skip
        keep[rows] = words[rows, skip:skip + run] >= threshold
    return keep.reshape(shape)


def _time(fn, args):
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def train_pairs(config, overrides, pairs):
    """Per-pair step times of ``config``, the reference draw and the chunked
    one alternating (the order too), in one process."""
    from purine_mpi.job.config import load_job
    from purine_mpi.ops import dropout
    from purine_mpi.tools.bench import synthetic_config
    from purine_mpi.train.trainer import Trainer
    job = synthetic_config(load_job(config, overrides, None, check_files=False))
    trainer = Trainer(job.with_training(max_iter=3 + 2 * pairs), out_dir="/nonexistent",
                      profile=False, log=lambda m: None)
    sides = {"old": reference_keep_mask, "new": philox.keep_mask}
    ms = {"old": [], "new": []}
    try:
        for it in range(3):
            trainer.step(it)
        for p in range(pairs):
            for side in (("old", "new") if p % 2 == 0 else ("new", "old")):
                dropout.keep_mask = sides[side]
                it += 1
                t0 = time.perf_counter()
                trainer.step(it)
                trainer.train.drain()
                ms[side].append((time.perf_counter() - t0) * 1e3)
    finally:
        dropout.keep_mask = philox.keep_mask
        trainer.close()
    ratios = [n / o for o, n in zip(ms["old"], ms["new"])]
    return {"config": config, "overrides": overrides,
            "old_step_ms": [round(v, 1) for v in ms["old"]],
            "new_step_ms": [round(v, 1) for v in ms["new"]],
            "new_over_old_pairs": [round(r, 3) for r in ratios],
            "new_over_old_median": round(statistics.median(ratios), 3)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2 << 20, 8 << 20])
    p.add_argument("--split", default="32,2,128,128",
                   help="a shard's shape (comma-separated), split on axis 1 in 2 parts")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chunk", type=int, default=philox.CHUNK)
    p.add_argument("--train-pairs", type=int, default=0)
    p.add_argument("--config", default=os.path.join(ROOT, "jobs", "gpt_tiny.yaml"))
    p.add_argument("--set", dest="overrides", action="append",
                   default=["net.3.attn_dropout=0.1", "net.11.attn_dropout=0.1"])
    args = p.parse_args()
    philox.CHUNK = args.chunk
    keys = philox.dropout_keys(1, "h0_attn.attn_drop")
    cases = [(f"keep_mask_{n}", ((n,), 0.1, *keys, 7), {}) for n in args.sizes]
    shard = tuple(int(s) for s in args.split.split(","))
    cases.append((f"keep_mask_split_{'x'.join(map(str, shard))}_of_2",
                  (shard, 0.1, *keys, 7), {"axis": 1, "parts": 2, "index": 1}))
    out = {"chunk_blocks": philox.CHUNK, "rounds": args.rounds, "cases": {}}
    for name, call, split in cases:
        n = int(np.prod(call[0]))
        sides = {"old": reference_keep_mask, "new": philox.keep_mask}
        assert np.array_equal(sides["old"](*call, split), sides["new"](*call, split)), name
        ns = {"old": [], "new": []}
        for r in range(args.rounds):
            for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                ns[side].append(_time(sides[side], call + (split,)) / n * 1e9)
        best = {side: min(v) for side, v in ns.items()}
        out["cases"][name] = {
            "elements": n,
            "old_ns_per_element": {"best": round(best["old"], 2),
                                   "rounds": [round(v, 2) for v in ns["old"]]},
            "new_ns_per_element": {"best": round(best["new"], 2),
                                   "rounds": [round(v, 2) for v in ns["new"]]},
            "ratio_old_over_new": {"best": round(best["old"] / best["new"], 2),
                                   "pairs": [round(a / b, 2)
                                             for a, b in zip(ns["old"], ns["new"])]},
        }
    if args.train_pairs:
        out["train"] = train_pairs(args.config, args.overrides, args.train_pairs)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
