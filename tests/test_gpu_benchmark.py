"""benchmarks/gpu_throughput.py without a GPU: the CPU dry run builds and
runs every net of both frameworks and prints the report's keys; with the
timed runs stubbed, every entry carries the issue's keys for each config and
batch size, and the busy fraction and kernel count come from the profile."""
import importlib.util
import json
import pathlib
import subprocess
import sys
import types

import pytest

from tests.conftest import REPO, cli_env

SCRIPT = pathlib.Path(REPO) / "benchmarks" / "gpu_throughput.py"
KEYS = {"config", "batch", "purine_images_per_s", "torch_eager_images_per_s",
        "torch_graph_images_per_s", "torch_compile_images_per_s", "purine_gpu_busy",
        "purine_kernels_per_iter", "blas", "cuda_graph"}


def _module():
    spec = importlib.util.spec_from_file_location("gpu_throughput_dry", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_dry_run_on_the_cpu():
    res = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--batches", "2", "3",
                          "--iters", "1"], cwd=REPO, env=cli_env(), capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["dry_run"] is True and "no figures" in report["device"]
    entries = report["results"]
    assert [(e["config"], e["batch"]) for e in entries] == [
        ("cifar10_quick", 2), ("cifar10_quick", 3), ("nin_cifar10", 2), ("nin_cifar10", 3)]
    for e in entries:
        assert KEYS <= set(e)
        assert all(e[k] is None for k in KEYS - {"config", "batch"})   # nothing measured
        assert 1.5 < e["dry_run_purine_loss"] < 3.5 and 1.5 < e["dry_run_torch_loss"] < 3.5


def test_without_a_gpu_one_line_and_status_1():
    res = subprocess.run([sys.executable, str(SCRIPT), "--iters", "1"], cwd=REPO,
                         env=cli_env(), capture_output=True, text=True, timeout=120)
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "CuPy" in res.stderr and "Traceback" not in res.stderr


def test_report_keys_with_stubbed_runs(monkeypatch, capsys):
    bench = _module()
    fake_cupy = types.SimpleNamespace(__version__="fake", cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceProperties=lambda d: {"name": b"sim"})))
    monkeypatch.setattr(bench, "require_gpu", lambda device, need_torch: fake_cupy)
    purine_calls, torch_calls = [], []

    def fake_purine(config, device, iters, warmup, tf32, cuda_graph=False, profile_iters=0):
        purine_calls.append((config["data"]["train"]["batch_size"], cuda_graph, profile_iters))
        out = {"seconds": 1.0 if cuda_graph else 2.0, "first_loss": 2.3, "last_loss": 2.2,
               "device_arena_bytes": 1, "scratch_bytes": 2, "streams": 3, "blas": "nvmath"}
        if cuda_graph:
            out["capture"] = {"segments": 1, "captured_ops": 40, "captured": 1, "failed": {},
                              "eager_gpu_ops": {}, "launches_per_iter": 1,
                              "eager_ops_per_iter": 0}
        if profile_iters:
            out["kernels"] = {"kernels_per_iter": 37.0, "kernel_ms_per_iter": 25.0,
                              "top_kernels": [["bias_grad_f32", 1.5, 3.0]]}
        return out

    def fake_torch(config, device, iters, warmup, tf32, compile_model=False, profile_iters=0):
        torch_calls.append(("compile" if compile_model else "eager", profile_iters))
        out = {"seconds": 4.0 if compile_model else 5.0, "first_loss": 2.3, "last_loss": 2.2}
        if profile_iters:
            out["kernels"] = {"kernels_per_iter": 30.0, "kernel_ms_per_iter": 20.0,
                              "top_kernels": [["reduce_kernel", 0.5, 3.0]]}
        return out

    def fake_torch_graph(config, device, iters, warmup, tf32):
        torch_calls.append(("graph", 0))
        raise RuntimeError("capture failed here")

    monkeypatch.setattr(bench, "bench_purine", fake_purine)
    monkeypatch.setattr(bench, "bench_torch", fake_torch)
    monkeypatch.setattr(bench, "bench_torch_graph", fake_torch_graph)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(
        __version__="fake", backends=types.SimpleNamespace(cudnn=types.SimpleNamespace(
            version=lambda: 91900))))
    assert bench.main(["--iters", "10", "--profile-iters", "3", "--configs",
                       str(SCRIPT.parent.parent / "jobs" / "cifar10_quick.yaml")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["batches"] == [128, 512]
    entries = report["results"]
    assert [(e["config"], e["batch"]) for e in entries] == [("cifar10_quick", 128),
                                                           ("cifar10_quick", 512)]
    # eager then graph per batch; only the headline mode (graph) is profiled
    assert purine_calls == [(128, False, 0), (128, True, 3), (512, False, 0), (512, True, 3)]
    e = entries[0]
    assert KEYS <= set(e)
    assert e["purine_images_per_s"] == 128.0 * 10 / 1.0 and e["purine_mode"] == "graph"
    assert e["purine_eager_images_per_s"] == 128.0 * 10 / 2.0
    assert e["torch_eager_images_per_s"] == 256.0 and e["torch_compile_images_per_s"] == 320.0
    assert e["torch_graph_images_per_s"] is None and "capture failed" in e["torch_graph_error"]
    assert e["purine_kernels_per_iter"] == 37.0
    assert e["purine_gpu_busy"] == 0.25   # 25 ms of kernels in a 100 ms iteration
    assert e["torch_eager_kernel_ms_per_iter"] == 20.0
    assert e["purine_top_kernels"] == [["bias_grad_f32", 1.5, 3.0]]
    assert e["torch_eager_top_kernels"] == [["reduce_kernel", 0.5, 3.0]]
    assert e["purine_vs_torch_eager"] == 5.0
    # the cuBLAS binding and the whole capture report, per row
    assert e["blas"] == "nvmath"
    assert e["cuda_graph"] == {"segments": 1, "captured_ops": 40, "captured": 1, "failed": {},
                               "eager_gpu_ops": {}, "launches_per_iter": 1,
                               "eager_ops_per_iter": 0}
    assert report["versions"]["purine_blas"] in ("nvmath", "cupy")


def test_gpu_session_script_is_valid_bash_and_refuses_bad_modes(tmp_path):
    """benchmarks/gpu_session.sh: the one script a GPU machine runs (it cannot
    run here): valid bash, and a bad argument is a usage error."""
    script = SCRIPT.parent / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    res = subprocess.run(["bash", str(script), "everything"], capture_output=True, text=True,
                         env=dict(cli_env(), OUT=str(tmp_path)))
    assert res.returncode == 2 and "usage" in res.stderr
    text = script.read_text()
    assert "pytest -m gpu" in text and "benchmarks/gpu_throughput.py" in text
    # it fetches (and so carries) nvmath-python with what it needs, and MPI:
    # pinned in one file (tests/test_gpu_session.py checks fetch takes exactly those)
    fetched = (SCRIPT.parent / "gpu_wheels.txt").read_text()
    for name in ("nvmath-python", "cuda-bindings", "cuda-core", "cuda-pathfinder",
                 "nvidia-cudnn-frontend", "mpich", "mpi4py"):
        assert f"\n{name}==" in fetched, name
    # installed into the interpreter's own site-packages: with --target mpi4py
    # does not find mpich's libmpi and every rank runs alone
    install = [line for line in text.splitlines() if "pip install" in line and
               not line.lstrip().startswith("#")]
    assert install and not any("--target" in line for line in install)
