"""Peak device memory (issue 35 item 8): gpu/memory.PeakMemory keeps the
most bytes in use at once in CuPy's pool, per device, read after each
allocation, and gives the allocator back; ``bench --json`` reports it as
``device_peak_bytes`` (with the captures' private pools added), and
benchmarks/gpu_throughput.py holds it against PyTorch's
``max_memory_allocated`` for the same step."""
import importlib.util
import json
import pathlib
import types

import pytest

from purine_mpi.gpu.memory import PeakMemory, start_peak_memory
from purine_mpi.tools.bench import device_memory

REPO = pathlib.Path(__file__).resolve().parent.parent


class _Pool:
    """CuPy's pool as PeakMemory sees it: malloc on the current device, bytes
    in use per device (a block is in use until its pointer is freed)."""

    def __init__(self, cuda):
        self.cuda, self.used = cuda, {}

    def malloc(self, size):
        device = self.cuda.device
        self.used[device] = self.used.get(device, 0) + size
        return types.SimpleNamespace(device_id=device, size=size)

    def free(self, memory):
        self.used[memory.device_id] -= memory.size

    def used_bytes(self):
        return self.used.get(self.cuda.device, 0)


def _fake_cupy():
    cuda = types.SimpleNamespace(device=0)
    pool = _Pool(cuda)
    cuda.allocator = pool.malloc
    cuda.get_allocator = lambda: cuda.allocator
    cuda.set_allocator = lambda fn: setattr(cuda, "allocator", fn)
    cuda.runtime = types.SimpleNamespace(getDevice=lambda: cuda.device)
    return types.SimpleNamespace(cuda=cuda, get_default_memory_pool=lambda: pool), pool


def test_peak_is_the_most_in_use_at_once_per_device_and_the_allocator_comes_back():
    cupy, pool = _fake_cupy()
    first = pool.malloc(64)                 # in use before tracking starts: counted
    peak = PeakMemory(cupy)
    assert cupy.cuda.get_allocator() == peak.malloc
    alloc = cupy.cuda.get_allocator()
    a, b = alloc(100), alloc(200)           # 364 in use
    pool.free(b)
    alloc(50)                               # 214: below the peak
    pool.free(first)
    cupy.cuda.device = 1
    alloc(30)
    assert peak.peak() == {0: 364, 1: 30}
    assert a.size == 100
    peak.close()
    assert cupy.cuda.get_allocator() == pool.malloc
    cupy.cuda.get_allocator()(1000)         # after close: not seen
    alloc(1000)                             # nor through a kept reference
    assert peak.peak() == {0: 364, 1: 30}


def test_own_peak_counts_the_bytes_an_earlier_run_let_go_and_this_one_reused():
    """``own_peak``: the most in use beyond what was in use when tracking
    began, that least lowered by what is let go meanwhile: 300 held before
    and let go, then 350 allocated reads 350 (peak less in use at start:
    50); let go while the run holds 20 of its own it reads 330, short by
    those 20 at most (a lower bound, never below the plain difference); with
    nothing let go it is the peak less what was in use at start."""
    cupy, pool = _fake_cupy()
    earlier = pool.malloc(300)
    peak = PeakMemory(cupy)
    alloc = cupy.cuda.get_allocator()
    pool.free(earlier)                      # the earlier run's, let go
    alloc(20)
    alloc(330)                              # 350 in use, all this run's
    assert peak.peak() == {0: 350} and peak.own_peak() == {0: 350}
    cupy1, pool1 = _fake_cupy()
    earlier = pool1.malloc(300)
    during = PeakMemory(cupy1)
    cupy1.cuda.get_allocator()(20)          # 320 in use: 20 beyond the 300
    pool1.free(earlier)
    cupy1.cuda.get_allocator()(330)         # 350, all this run's
    assert during.peak() == {0: 350} and during.own_peak() == {0: 330}
    cupy2, pool2 = _fake_cupy()
    pool2.malloc(300)
    kept = PeakMemory(cupy2)
    a = cupy2.cuda.get_allocator()(100)
    pool2.free(a)
    cupy2.cuda.get_allocator()(60)
    assert kept.peak() == {0: 400} and kept.own_peak() == {0: 100}


def test_a_cupy_without_allocator_hooks_gives_no_tracker():
    assert start_peak_memory(types.SimpleNamespace(cuda=types.SimpleNamespace())) is None


def test_bench_json_peak_adds_the_capture_pools_and_covers_only_gpus():
    ws = types.SimpleNamespace(device_bytes={0: 10}, device_plans={}, scratch_bytes={0: 2})
    report = {"capture_pool_bytes": {"0": 5}}
    out = device_memory(ws, peaks={0: 40, 3: 9}, report=report)
    assert out["device_peak_bytes"] == {"0": 45}
    assert device_memory(ws)["device_peak_bytes"] == {}      # no tracker: nothing claimed
    cpu = types.SimpleNamespace(device_bytes={}, device_plans={}, scratch_bytes={})
    assert device_memory(cpu, peaks={})["device_peak_bytes"] == {}


def _throughput(monkeypatch, purine, torch_out):
    spec = importlib.util.spec_from_file_location(
        "gpu_throughput_peak", REPO / "benchmarks" / "gpu_throughput.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    fake_cupy = types.SimpleNamespace(__version__="fake", cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceProperties=lambda d: {"name": b"sim"})))
    monkeypatch.setattr(bench, "require_gpu", lambda device, need_torch: fake_cupy)
    monkeypatch.setattr(bench, "bench_purine", purine)
    monkeypatch.setattr(bench, "bench_torch", lambda *a, **k: dict(torch_out))
    monkeypatch.setattr(bench, "bench_torch_graph", lambda *a, **k: dict(torch_out))
    return bench


def test_gpu_throughput_holds_the_peak_against_torch_max_memory_allocated(monkeypatch, capsys):
    def purine(config, device, iters, warmup, tf32, cuda_graph=False, profile_iters=0):
        out = {"seconds": 1.0, "first_loss": 2.3, "last_loss": 2.2, "device_arena_bytes": 1,
               "streams": 3, "device_pool_bytes": 900,
               "device_peak_bytes": 300 if cuda_graph else 400}
        if cuda_graph:
            out["capture"] = {"segments": 1, "captured_ops": 4, "captured": 1, "failed": {},
                              "eager_gpu_ops": {}}
        return out

    torch_out = {"seconds": 2.0, "first_loss": 2.3, "last_loss": 2.2,
                 "max_memory_allocated": 600, "max_memory_reserved": 800}
    bench = _throughput(monkeypatch, purine, torch_out)
    monkeypatch.setattr("purine_mpi.gpu.cudnn.frontend", lambda: None)
    pytest.importorskip("torch")   # the versions block names it
    assert bench.main(["--iters", "10", "--batch", "4", "--no-compile", "--profile-iters", "0",
                       "--configs", str(REPO / "jobs" / "cifar10_quick.yaml")]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["results"]
    assert entry["purine_device_peak_bytes"] == 300            # the default mode's: graph
    assert entry["purine_eager_device_peak_bytes"] == 400
    assert entry["torch_eager_max_memory_allocated"] == 600
    assert entry["purine_vs_torch_peak_memory"] == 0.5
    assert entry["purine_vs_torch_memory"] == 1.5              # the pool's holding, as before


def test_gpu_throughput_without_a_gpu_says_it_needs_one():
    import subprocess
    import sys
    from tests.conftest import cli_env
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_throughput.py"),
                          "--iters", "1"], capture_output=True, text=True, env=cli_env(),
                         timeout=120)
    assert res.returncode == 1 and "needs CuPy and a CUDA device" in res.stderr
    assert res.stdout == "" and "Traceback" not in res.stderr
