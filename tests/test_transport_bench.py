"""benchmarks/transport.py on tiny sizes: the JSON it prints (messages by
Send/Recv, Put into a window and a store into a shared window; the sum by
Allreduce against a shared-window reduction), each with the data checked at
the receiver. The timings themselves are measured by running it, never
asserted here (the machine is shared).
"""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import MPIEXEC, REPO, cli_env


def run_bench(*args):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "transport.py"),
                          *args], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_transport_bench_json_shape_on_tiny_sizes():
    res = run_bench("--sizes-kib", "4,64", "--reps", "2", "--best-of", "2",
                    "--reduce-mib", "0.0625")
    assert [r["bytes"] for r in res["messages"]] == [4096, 65536]
    for row in res["messages"]:
        assert row["correct"] is True, row
        for m in ("send_recv", "put", "shared"):
            assert row[f"{m}_ms"] > 0
        assert row["speedup_put"] == pytest.approx(row["send_recv_ms"] / row["put_ms"], rel=0.05)
        assert row["speedup_shared"] == pytest.approx(
            row["send_recv_ms"] / row["shared_ms"], rel=0.05)
    (red,) = res["reduce"]
    assert red["bytes"] == 65536 and red["correct"] is True
    faster = min(("allreduce", "shared_copy_out"), key=lambda m: red[f"{m}_ms"])
    assert red["winner"] == faster
    assert "jobs" not in res  # whole jobs only with --jobs


def test_wide_boundary_pipeline_config_is_a_valid_two_stage_job(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import transport
    finally:
        sys.path.pop(0)
    from purine_mpi.job.config import load_job
    job = load_job(transport.wide_pipeline_config(str(tmp_path / "wide.yaml"), 5))
    assert job.parallel.scheme == "pipeline"
    fc1 = next(layer for layer in job.net if layer["name"] == "fc1")
    assert fc1["num_output"] == 1024 and set(job.parallel.stages.values()) == {0, 1}
