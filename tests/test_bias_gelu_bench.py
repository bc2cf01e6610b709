"""benchmarks/bias_gelu_gpu.py on the emulated device (small shapes: the
script's logic, its JSON, the old and new kernels' bitwise agreement) and
its refusal without CuPy (exit 2, a line that says why)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.emulated_gpu.fixtures import emulated  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bias_gelu_gpu  # noqa: E402


def test_the_benchmark_times_old_and_new_and_they_agree(emulated, capsys,  # noqa: F811
                                                         tmp_path):
    assert bias_gelu_gpu.main(["--rows", "3", "--width", "16", "--reps", "1",
                               "--rounds", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    per_element = {"bias_bits_48": 6 * 48, "bias_bits_16": 6 * 16, "bias_bits_64": 6 * 64,
                   "gelu_forward_bits": 4 * 64, "gelu_backward_bdy_bx_copy": 10 * 64,
                   "sum_rows_16": 4 * 16, "sum_rows_64": 4 * 64, "sum_rows_bits_48": 2 * 48,
                   "gelu_backward_bias_grad": 10 * 64}
    assert set(report["kernels"]) == set(per_element)
    assert report["rounds"] == 2
    for name, row in report["kernels"].items():
        assert row["bytes"] == 3 * per_element[name]
        assert row["bitwise_equal"] is True, name
        for side in ("old", "new"):
            assert len(row[side]["ms_rounds"]) == 2
            assert row[side]["ms"] > 0 and row[side]["fraction_of_bound"] >= 0
    step = report["ms_per_gpt2_step"]
    assert set(step) == {"bias_bits", "gelu_forward_bits", "gelu_backward_bdy_bx_copy",
                         "gelu_backward_bias_grad"}
    bias = report["kernels"]
    assert step["bias_bits"]["old"] == pytest.approx(
        12 * bias["bias_bits_48"]["old"]["ms"] + 24 * bias["bias_bits_16"]["old"]["ms"]
        + 12 * bias["bias_bits_64"]["old"]["ms"], abs=2e-3)
    assert all(v["new"] > 0 and v["bound"] >= 0 for v in step.values())
    # what gpu_session.sh's summary.txt says of it (the one file read first
    # after a GPU session): every pair's speedup and bitwise agreement, the
    # step's old and new ms
    import gpu_session_summary
    path = tmp_path / "bias_gelu_gpu.json"
    path.write_text(json.dumps(report))
    said = " ".join(gpu_session_summary.json_lines(path))
    assert "all_bitwise_equal=true" in said, said
    for name in per_element:
        assert f"{name}_speedup=" in said and f"{name}_bitwise_equal=true" in said, said
    for group in step:
        assert f"{group}_old_ms=" in said and f"{group}_new_ms=" in said, said


def test_without_cupy_it_refuses():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = ("import sys; sys.modules['cupy'] = None; sys.argv[1:] = []; "
            "sys.path.insert(0, 'benchmarks'); import bias_gelu_gpu; "
            "sys.exit(bias_gelu_gpu.main([]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "needs CuPy and a GPU" in done.stderr and "Traceback" not in done.stderr
