"""benchmarks/layernorm_kernel_gpu.py on the emulated device (small rows,
an odd row count and a width of four's multiples: the script's logic, its
JSON, the old block-per-row and the new warp-per-row kernels' agreement --
bit for bit on the host, where only the double sums' order differs and the
statistics round to float32 once) and its refusal without CuPy (exit 2, a
line that says why)."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.emulated_gpu.fixtures import emulated  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import layernorm_kernel_gpu  # noqa: E402


def test_the_benchmark_times_old_and_new_and_they_agree(emulated, capsys):  # noqa: F811
    assert layernorm_kernel_gpu.main(["--rows", "5", "--cols", "96", "--reps", "1",
                                      "--rounds", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    f, b = layernorm_kernel_gpu.FORWARD, layernorm_kernel_gpu.BACKWARD
    s = layernorm_kernel_gpu.SUMS
    assert set(report["kernels"]) == {f"{k}:{side}" for k in (f, b, s)
                                      for side in ("old", "new")}
    assert report["rounds"] == 2
    assert report["grids"] == {"old": 5, "new": 1}
    for name, row in report["kernels"].items():
        assert len(row["ms_rounds"]) == 2
        per = 6 if name.startswith(f) else 10 if name.startswith(s) else 14
        assert row["bytes"] == per * 5 * 96 + 8 * 5
        assert row["gb_per_s"] > 0 and row["fraction_of_bound"] >= 0
    assert report["backward_with_sums_old_bytes"] == 20 * 5 * 96 + 8 * 5
    assert report["backward_with_sums_speedup"] > 0
    for output, agreement in report["agreement"].items():
        if output in ("sums_dg", "sums_db"):   # the same sums in another order
            assert agreement["max_abs_diff"] < 1e-3, output
            continue
        assert agreement == {"elements_differing": 0, "max_abs_diff": 0.0}, output


def test_without_cupy_it_refuses():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = ("import sys; sys.modules['cupy'] = None; sys.argv[1:] = []; "
            "sys.path.insert(0, 'benchmarks'); import layernorm_kernel_gpu; "
            "sys.exit(layernorm_kernel_gpu.main([]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "needs CuPy and a GPU" in done.stderr and "Traceback" not in done.stderr
