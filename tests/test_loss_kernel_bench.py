"""benchmarks/loss_kernel_gpu.py on the emulated device (small rows: the
script's logic, its JSON, the old and new kernels' agreement) and its
refusal without CuPy (exit 2, a line that says why)."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.emulated_gpu.fixtures import emulated  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import loss_kernel_gpu  # noqa: E402


def test_the_benchmark_times_old_and_new_and_they_agree(emulated, capsys):  # noqa: F811
    assert loss_kernel_gpu.main(["--rows", "5", "--classes", "1030", "--reps", "1",
                                 "--rounds", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["kernels"]) == {"softmax_loss_forward_rows", "softmax_loss_forward_vec",
                                      "softmax_loss_backward", "softmax_loss_backward_vec"}
    assert report["rounds"] == 2
    for name, row in report["kernels"].items():
        assert len(row["ms_rounds"]) == 2
        assert row["bytes"] == (12 if "forward" in name else 8) * 5 * 1030
    bits = report["bits"]
    assert set(bits["kernels"]) == {"widen_forward_vec", "softmax_loss_forward_bits_f32",
                                    "widen_grad_vec_round", "softmax_loss_grad_bits_f32"}
    per = {"widen_forward_vec": 18, "softmax_loss_forward_bits_f32": 2,
           "widen_grad_vec_round": 32, "softmax_loss_grad_bits_f32": 6}
    for name, row in bits["kernels"].items():
        assert len(row["ms_rounds"]) == 2 and row["bytes"] == per[name] * 5 * 1030
    assert bits["agreement"] == {"loss_bitwise_equal": True, "dx_bitwise_equal": True,
                                 "rows_checked": 5}
    agreement = report["agreement"]
    assert agreement["dx_bitwise_equal"] is True
    assert 0 <= agreement["prob_max_abs_diff"] < 1e-6
    assert 0 <= agreement["loss_max_abs_diff"] < 1e-4


def test_without_cupy_it_refuses():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # a cupy that cannot be imported, first on the path
    code = ("import sys; sys.modules['cupy'] = None; sys.argv[1:] = []; "
            "sys.path.insert(0, 'benchmarks'); import loss_kernel_gpu; "
            "sys.exit(loss_kernel_gpu.main([]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "needs CuPy and a GPU" in done.stderr and "Traceback" not in done.stderr
