"""``runtime/footprint.coexisting_bytes`` on a constructed graph of many
buffers in a few chains (a deep net's ZeRO buckets at a small
``parallel.bucket_mb``): ``--buffers`` float32 buffers ``b<i>``, each
written by one op and read by another, b<i>'s writer after b<i-k>'s reader
(``--chains`` k disjoint chains), the sizes 1 + (7919 i mod 13) elements.
Prints one JSON object: the figure, the closed form for disjoint chains (the
largest of each chain, summed), and the seconds.

    .venv/bin/python benchmarks/coexisting_speed.py [--buffers 2100] [--chains 3]

Measured 2026-11-30 (shared 2-core machine): 2,100 buffers in 3 chains
0.53 s; the branch-and-bound search it replaced took 1.05 s at 150, 11.1 s
at 300, 178.7 s at 600 (the same figure, 156 bytes, each time).
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: the repository's purine_mpi and tests
    sys.path.insert(0, ROOT)

from purine_mpi.runtime.footprint import coexisting_bytes  # noqa: E402
from tests.test_coexisting import chain_graph  # noqa: E402  (the graph the test checks)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--buffers", type=int, default=2100)
    ap.add_argument("--chains", type=int, default=3)
    a = ap.parse_args()
    sizes = [1 + (i * 7919) % 13 for i in range(a.buffers)]
    g, names = chain_graph(sizes, a.chains)
    t = time.perf_counter()
    got = coexisting_bytes(g, names)
    s = time.perf_counter() - t
    print(json.dumps({"buffers": a.buffers, "chains": a.chains, "bytes": got,
                      "closed_form": 4 * sum(max(sizes[c::a.chains]) for c in range(a.chains)),
                      "seconds": round(s, 3)}))


if __name__ == "__main__":
    main()
