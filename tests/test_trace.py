"""``--profile`` writes a Chrome trace per rank (docs/formats.md, "Traces") and
``bench --json`` reports the keys of docs/formats.md, comm_overlap included,
under MPI."""
import json
import os

import pytest

from tests.conftest import REPO, run_mpi_cli
from tests.test_mpi_train import _digits_config

pytestmark = pytest.mark.mpi
CATEGORIES = {"compute", "comm", "copy", "io", "update"}


def _mpi(n, *args):
    res = run_mpi_cli(n, *args)
    assert res.returncode == 0, res.stderr
    return res


def test_profile_writes_a_chrome_trace_per_rank(tmp_path, digits_h5):
    cfg = _digits_config(tmp_path, digits_h5, 16, "t.yaml", max_iter=6)
    _mpi(2, "train", cfg, "--out", tmp_path / "run", "--profile",
         "--set", "parallel.bucket_mb=0.01", "--set", "parallel.first_bucket_mb=0.005")
    for rank in (0, 1):
        with open(tmp_path / "run" / f"trace.rank{rank}.json") as f:
            events = json.load(f)["traceEvents"]
        meta = [e for e in events if e["ph"] == "M"]
        events = [e for e in events if e["ph"] != "M"]
        assert events
        # metadata names the rank's process and every thread that has events
        assert any(e["name"] == "process_name" and e["pid"] == rank
                   and e["args"]["name"].startswith(f"rank {rank} ") for e in meta)
        named = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
        assert {e["tid"] for e in events} == set(named)
        assert named["comm"].startswith("MPI progress") and named["0"] == "worker thread 0"
        for e in events:
            assert e["ph"] == "X" and e["pid"] == rank and e["cat"] in CATEGORIES
            assert e["dur"] >= 0 and e["ts"] >= 0 and isinstance(e["tid"], str)
            assert set(e["args"]) >= {"iter", "op_type"}
        iters = {e["args"]["iter"] for e in events}
        assert iters == set(range(6))
        comm = [e for e in events if e["cat"] == "comm"]
        # several buckets, each reduced once per iteration, from post to completion
        assert {e["args"]["op_type"] for e in comm} == {"Allreduce"}
        assert len(comm) == 6 * len({e["name"] for e in comm}) and len({e["name"] for e in comm}) > 1
        names = {e["name"] for e in events}
        assert "conv1.fwd" in names and "data" in names
        assert any(e["cat"] == "update" for e in events) and any(e["cat"] == "io" for e in events)


def test_bench_json_under_two_ranks(tmp_path):
    res = _mpi(2, "bench", os.path.join(REPO, "jobs", "cifar10_quick.yaml"), "--iters", "3",
               "--warmup", "1", "--json", "--set", "data.train.batch_size=8",
               "--set", "parallel.bucket_mb=0.05", "--set", "parallel.first_bucket_mb=0.02")
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 only
    out = json.loads(lines[0])
    assert {"config", "world_size", "iters", "images_per_s", "iter_ms_median", "comm_overlap",
            "peak_mem_bytes", "backend"} <= set(out)
    assert out["world_size"] == 2 and out["iters"] == 3 and out["backend"] == "numpy"
    assert 0.0 <= out["comm_overlap"] <= 1.0 and out["images_per_s"] > 0
    # data parallel: two replicas, each its batch of 8
    assert out["images_per_s"] == pytest.approx(2 * 8 / (out["iter_ms_median"] / 1000), rel=1e-2)


def test_bench_images_per_s_of_a_pipeline_counts_its_batch_once(tmp_path, digits_h5):
    """A 2-stage pipeline is one replica: both ranks work on the same batch,
    so images/s is the batch over the iteration, not twice that (bench gave
    twice that until 2026-11-26)."""
    from tests.test_rma_pipeline import _config as pipeline_config
    cfg = pipeline_config(tmp_path, digits_h5)
    res = _mpi(2, "bench", cfg, "--iters", "3", "--warmup", "1", "--json")
    out = json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][0])
    assert out["world_size"] == 2
    batch = out["batch_per_rank"]
    assert out["images_per_s"] == pytest.approx(batch / (out["iter_ms_median"] / 1000), rel=1e-2)
