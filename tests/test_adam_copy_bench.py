"""benchmarks/adam_copy_gpu.py on the emulated device (a small GPT: the
script's logic, its JSON, the two paths' agreement bit for bit) and its
refusal without CuPy (exit 2, a line that says why)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.emulated_gpu.fixtures import emulated  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import adam_copy_gpu  # noqa: E402


def test_the_benchmark_times_both_paths_and_they_agree(emulated, capsys):  # noqa: F811
    assert adam_copy_gpu.main(["--layers", "2", "--width", "8", "--vocab", "40",
                               "--context", "6", "--reps", "1", "--rounds", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    params = adam_copy_gpu.gpt2_params(2, 8, 40, 6)
    elements = sum(int(np.prod(s)) for _, s, _ in params)
    assert report["parameters"] == elements and report["rounds"] == 2
    bits = sum(int(np.prod(s)) for _, s, k in params if k == "bits")
    floats = sum(int(np.prod(s)) for _, s, k in params if k == "float")
    assert bits == 40 * 8 + 2 * (3 + 1 + 4 + 4) * 8 * 8 and floats == 2 * (3 + 1 + 4 + 1) * 8
    paths = report["paths"]
    # the path before: the update, then a Cast per copy (the embedding/head's,
    # per block 4 weights' and 4 biases')
    assert paths["update_then_casts"]["launches"] == 1 + 1 + 2 * 8
    assert paths["update_writes_copies"]["launches"] == 1
    assert paths["update_then_casts"]["bytes"] == 28 * elements + 4 * (bits + floats) + \
        2 * bits + 4 * floats
    assert paths["update_writes_copies"]["bytes"] == 28 * elements + 2 * bits + 4 * floats
    for row in paths.values():
        assert len(row["ms_rounds"]) == 2
    assert report["agreement"] == {"weights_bitwise_equal": True, "copies_bitwise_equal": True,
                                   "copies": 1 + 2 * 8}


def test_without_cupy_it_refuses():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = ("import sys; sys.modules['cupy'] = None; sys.argv[1:] = []; "
            "sys.path.insert(0, 'benchmarks'); import adam_copy_gpu; "
            "sys.exit(adam_copy_gpu.main([]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "needs CuPy and a GPU" in done.stderr and "Traceback" not in done.stderr
