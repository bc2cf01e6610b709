"""EmbeddingGrad's host path against np.add.at (its bits) and the former
sort + ``np.add.reduceat`` (pairwise past a few rows: other bits), on
gpt_tiny's and gpt_small's shapes (jobs/gpt_tiny.yaml: 256 tokens, width
128, 32 x 128 positions; jobs/gpt_small.yaml: 256, 384, 64 x 256), for
token ids uniform, Zipf-like (a byte text's skew) and one token at 9
positions of 10, and a GPT-2-sized vocabulary (50257) uniform.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python \\
        benchmarks/embedding_grad_host.py [--reps 7]

Prints one JSON object: per shape and ids, each way's fastest of --reps
runs (wall ms, after a warm-up; the three interleaved run by run, so
load falls on each alike), the op's time over each other way's, and
whether each gives np.add.at's bits. Compare the ratios, not the ms
across runs (a shared machine).
"""
import argparse
import json
import time
from types import SimpleNamespace

import numpy as np

from purine_mpi.ops import catalog  # noqa: F401 (registers the kernels)
from purine_mpi.ops.registry import get_kernel_class

SHAPES = {"gpt_tiny": (256, 128, 32 * 128), "gpt_small": (256, 384, 64 * 256)}


def former(dw, rows, flat):
    """The op's host path before it summed in position order."""
    dw[...] = 0
    order = np.argsort(flat, kind="stable")
    tokens = flat[order]
    starts = np.flatnonzero(np.r_[True, tokens[1:] != tokens[:-1]])
    dw[tokens[starts]] = np.add.reduceat(rows[order], starts, axis=0)


def add_at(dw, rows, flat):
    dw[...] = 0
    np.add.at(dw, flat, rows)


def ids_of(kind, vocab, n, rng):
    if kind == "zipf":
        p = 1.0 / np.arange(1, vocab + 1)
        return rng.choice(vocab, n, p=p / p.sum())
    if kind == "hot":
        return np.where(rng.random(n) < 0.9, vocab // 2, rng.integers(0, vocab, n))
    return rng.integers(0, vocab, n)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    out = {"numpy": np.__version__}
    for name, (vocab, width, n) in SHAPES.items():
        rows = rng.standard_normal((n, width)).astype(np.float32)
        for kind, v in (("uniform", vocab), ("zipf", vocab), ("hot", vocab),
                        ("uniform_v50257", 50257)):
            flat = ids_of(kind, v, n, rng)
            op = get_kernel_class("EmbeddingGrad")(
                SimpleNamespace(attrs={"input_dim": v}, name="wte.bwd"))
            ways = {"op": lambda dw: op.run([rows, flat], [dw]),
                    "add_at": lambda dw: add_at(dw, rows, flat),
                    "former": lambda dw: former(dw, rows, flat)}
            want = np.zeros((v, width), np.float32)
            np.add.at(want, flat, rows)
            dws = {w: np.empty((v, width), np.float32) for w in ways}
            best = dict.fromkeys(ways, float("inf"))
            for rep in range(args.reps + 1):   # the first a warm-up
                for w, fn in ways.items():
                    t = time.perf_counter()
                    fn(dws[w])
                    if rep:
                        best[w] = min(best[w], time.perf_counter() - t)
            out[f"{name}/{kind}"] = {
                "max_repeats": int(np.bincount(flat).max()),
                "ms": {w: round(1000 * b, 3) for w, b in best.items()},
                "op_over": {w: round(best["op"] / best[w], 3) for w in ways if w != "op"},
                "add_at_bits": {w: bool(np.array_equal(dws[w], want)) for w in ways}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
