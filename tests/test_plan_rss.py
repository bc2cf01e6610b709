"""``plan``'s host figures against what the run holds: the data pool row is
the readers' own bytes, and train's OUT/memory.json (the measured resident
bytes above the baseline) is at least the predicted host total on every
rank (docs/running.md, "Will it fit?", has the table and the gap)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from purine_mpi.data.sources import make_source, resident_bytes
from purine_mpi.data.text import TextSource

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import rss_vs_plan  # noqa: E402


def test_resident_bytes_are_what_the_sources_hold(tmp_path):
    spec = {"source": "synthetic", "shape": [3, 32, 32], "classes": 10, "num_samples": 700}
    src = make_source(spec, 0)
    assert resident_bytes(spec) == (None, src.pool.nbytes + src.labels.nbytes)
    path = rss_vs_plan.text_data(str(tmp_path))
    text = {"source": "text", "path": path, "split": "train", "sequence_length": 64}
    t = TextSource(text)
    assert resident_bytes(text) == (None, t.tokens.nbytes + t._offsets.nbytes)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found")
@pytest.mark.parametrize("job", ["cifar10_quick", "gpt_tiny"])
def test_predicted_host_total_is_held(job, tmp_path):
    """Under mpiexec -n 2 (scheme data) every counted byte is resident: the
    measured peak above the baseline is at least plan's host total."""
    res = rss_vs_plan.measure(job, "data", str(tmp_path), iters=3)
    assert "error" not in res, res
    assert len(res["measured"]) == 2
    for p, m, b in zip(res["predicted"], res["measured"], res["baseline"]):
        assert b > 0 and p > 0
        assert m >= p, (job, p, m)
    assert json.loads(json.dumps(res["plan"]))["ranks"][0]["host"]["data_pool"] > 0
