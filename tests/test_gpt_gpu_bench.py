"""benchmarks/gpt_gpu.py (issue 45's bf16 GPT speed harness) and
gpu_throughput.py's ``--precision bf16`` without a GPU: the CPU dry runs
build and step every side at a tiny size and print the real JSON keys with
null figures; the GPU run refuses to report CPU numbers."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_GPU = os.path.join(REPO, "benchmarks", "gpt_gpu.py")
THROUGHPUT = os.path.join(REPO, "benchmarks", "gpu_throughput.py")


def _run(*args):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=600)


def test_gpt_gpu_dry_run_steps_ours_and_pytorch_side_by_side():
    pytest.importorskip("torch")
    res = _run(GPT_GPU, "--dry-run", "--config", "jobs/gpt_tiny.yaml")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["benchmark"] == "gpt_gpu" and out["dry_run"] is True
    assert out["peak_flops_per_s"] is None and out["cut_short"] is None
    # one FLOPs figure for every side: PaLM's closed form of the job
    assert out["model_flops_per_token"] > 0 and "6N + 12*L*H*Q*T" in out["closed_form"]
    sides = out["sides"]
    assert list(sides) == ["purine", "torch_eager"]   # torch.compile: GPU runs only
    for side in sides.values():
        assert side["tokens_per_s"] > 0 and side["mfu"] is None
        assert side["model_flops_per_token"] == out["model_flops_per_token"]
        assert side["peak_memory_bytes"] is None   # no device: no device memory
        assert side["attention_note"]
    # ours: the Attention ops' spans from our trace; PyTorch's kernels need CUPTI
    assert sides["purine"]["attention_ms_per_iter"] > 0
    assert sides["torch_eager"]["attention_ms_per_iter"] is None
    assert "not measured" in sides["torch_eager"]["attention_note"]
    assert out["purine_vs_torch_eager"] > 0


def test_gpt_gpu_without_a_gpu_says_it_needs_one():
    pytest.importorskip("torch")
    res = _run(GPT_GPU, "--config", "jobs/gpt_tiny.yaml")
    assert res.returncode == 1 and not res.stdout
    assert "gpt_gpu: needs CuPy" in res.stderr


def test_gpu_throughput_bf16_dry_run_runs_pytorch_channels_last_autocast():
    pytest.importorskip("torch")
    res = _run(THROUGHPUT, "--dry-run", "--precision", "bf16", "--configs",
               "jobs/cifar10_quick.yaml", "--batches", "2")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["precision"] == "bf16" and out["dry_run"] is True
    (entry,) = out["results"]
    assert entry["dry_run_torch_loss"] > 0 and entry["dry_run_purine_loss"] > 0


def test_gpu_throughput_bf16_graph_inputs_keep_the_pinned_channels_last_layout():
    """The whole-step CUDA graph's input buffers take their pinned host
    tensors' strides: bf16's channels-last images copied into an NCHW buffer
    went through a pageable contiguous temporary, which a capture refuses
    (bench_bf16.json of 2026-11-29: torch_graph_error "Cannot copy between
    CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is
    pinned")."""
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("gpu_throughput_graph", THROUGHPUT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    config = bench.load(os.path.join(REPO, "jobs", "cifar10_quick.yaml"), 2)
    for precision, channels_last in (("bf16", True), ("fp32", False)):
        *_, x_host, y_host = bench._torch_setup(dict(config, precision=precision), None, False)
        assert x_host.is_contiguous(memory_format=torch.channels_last) == channels_last
        assert x_host.is_contiguous() != channels_last
        static_x, static_y = bench.static_inputs(torch, torch.device("cpu"), x_host, y_host)
        for host, static in ((x_host, static_x), (y_host, static_y)):
            assert static.shape == host.shape and static.dtype == host.dtype
            assert static.stride() == host.stride()   # one memcpy, no temporary


def test_gpu_session_gpt_stage_runs_both_bf16_benchmarks():
    text = open(os.path.join(REPO, "benchmarks", "gpu_session.sh")).read()
    stage = text.split("\n  gpt)", 1)[1].split(";;", 1)[0]
    assert "gpu_throughput.py" in stage and "--precision bf16" in stage
    assert "benchmarks/gpt_gpu.py" in stage and "--budget-s" in stage
