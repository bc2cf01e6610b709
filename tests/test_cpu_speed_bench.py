"""benchmarks/cpu_speed.py end to end, tiny: one pair of one-iteration runs
of cifar10_quick without a warm-up, purine_mpi against PyTorch CPU. The
benchmark prints the issue's figures as JSON (images/s and their ratio,
each side's peak RSS); the figures themselves are measured by running it,
never asserted here.
"""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytest.importorskip("torch")


def test_cpu_speed_prints_speed_and_peak_rss_of_both_sides():
    out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "cpu_speed.py"),
                          "--config", "jobs/cifar10_quick.yaml", "--pairs", "1",
                          "--iters", "1", "--warmup", "0"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    fig = res["jobs/cifar10_quick.yaml"]
    ours, torch = fig["purine_mpi_images_per_s"]["median"], fig["pytorch_images_per_s"]["median"]
    assert ours > 0 and torch > 0
    assert fig["ratio"]["pairs"] == [pytest.approx(ours / torch, abs=1e-3)]
    for side in ("purine_mpi", "pytorch"):
        rss = fig[f"{side}_max_rss_mib"]
        # a whole Python process with NumPy (and torch): tens of MiB at least
        assert 30 < rss["median"] < 4096 and rss["range"] == [rss["median"]] * 2, rss
