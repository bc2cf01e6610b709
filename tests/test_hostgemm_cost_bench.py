"""benchmarks/hostgemm_cost.py end to end, tiny: one pair of each timing at
1 and 2 threads. It records the products of one cifar10_quick iteration by
wrapping the call sites' ``matmul``; the figures themselves are measured by
running it, never asserted here."""
import json
import os
import subprocess
import sys

from tests.conftest import REPO


def test_hostgemm_cost_records_an_iterations_products_and_times_both_sides():
    out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "hostgemm_cost.py"),
                          "--threads", "1", "2", "--pairs", "1", "--reps", "1",
                          "--iter-pairs", "1", "--iters", "1", "--only", "(1280, 800)"],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads(out.stdout)
    for n in ("1", "2"):
        assert res[n]["threads"] == int(n)
        shapes = {s["product"]: s for s in res[n]["shapes"]}
        # conv2's rows (5 samples of 256 positions, 800 = 32 * 5 * 5) against
        # its weights, a transposed view: one per chunk of samples
        rows = shapes["(1280, 800) @ (800, 32)T"]
        assert rows["calls_per_iter"] >= 20 and rows["cut"].startswith("M x")
        assert rows["multiply_adds"] == 1280 * 800 * 32
        assert all(s["ratio_wall"] > 0 and s["ratio_cpu"] > 0 for s in shapes.values())
        it = res[n]["iteration"]
        assert it["hostgemm_ms_wall"] > 0 and it["numpy_ms_wall"] > 0
        assert it["pair_ratios_wall"] == [it["ratio_wall"]]
