"""The cuDNN frontend path of the convolution ops (purine_mpi/gpu/cudnn.py).

Without a GPU the path is checked for its plumbing, against a stand-in for
the ``cudnn`` frontend module that records the graph calls and executes
them with NumPy on the (host) addresses of the variant pack: which array
goes to which tensor, the fused bias/ReLU epilogue, the workspace taken from
the op's scratch, the deterministic / no-TF32 plan filters, the fallback to
im2col (said once) when a graph has no plan or the module is missing. The
numbers cuDNN itself computes are checked on a real GPU (marked ``gpu``:
every direction against the CPU, fused and not), when the frontend is
installed.
"""
import json
import os
import sys
import types

import numpy as np
import pytest

import purine_mpi.base.backend as backend
import purine_mpi.gpu as gpu
from purine_mpi.gpu import cudnn as gpu_cudnn
from purine_mpi.gpu import cudnn_tune as tune
from purine_mpi.graph.core import Op
from purine_mpi.ops.catalog import get_kernel_class
from tests.emulated_gpu import DeviceArray, emulated_cupy, run_kernel
from tests.emulated_gpu import use_emulated_nvmath
from tests.emulated_gpu.cudnn import ENGINES, GPU_CLOCK as _GPU_CLOCK, FakeCudnn


class _Event:
    """``cupy.cuda.Event(block=False, disable_timing=False, interprocess=False)``
    on the simulated GPU's clock."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.disable_timing, self.ms = disable_timing, None

    def record(self, stream=None):
        self.ms = _GPU_CLOCK["ms"]

    def synchronize(self):
        pass


def _elapsed(start, end):
    """``cupy.cuda.get_elapsed_time(start_event, end_event)``: milliseconds;
    CUDA refuses events not recorded or made with disable_timing."""
    if start.ms is None or end.ms is None or start.disable_timing or end.disable_timing:
        raise RuntimeError("cudaErrorInvalidResourceHandle")
    return end.ms - start.ms


GPU_NAME = "NVIDIA Simulated GPU"


@pytest.fixture
def device(host_build_dir, monkeypatch, tmp_path):
    gpu.clear_kernel_cache()
    gpu_cudnn.reset()
    tune.reset()
    monkeypatch.setenv("PURINE_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("PURINE_CUDNN_BENCHMARK", "PURINE_CUDNN_DETERMINISTIC"):
        monkeypatch.delenv(name, raising=False)
    fake = emulated_cupy(host_build_dir)
    fake.cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=1234)
    fake.cuda.Event = _Event
    fake.cuda.get_elapsed_time = _elapsed
    fake.cuda.runtime.getDeviceProperties = lambda dev: {"name": GPU_NAME.encode()}
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(backend, "_cupy", fake)
    use_emulated_nvmath(monkeypatch)
    monkeypatch.delenv("PURINE_CONV", raising=False)
    yield fake
    gpu_cudnn.reset()
    tune.reset()
    gpu.clear_kernel_cache()


def _dev(a):
    return np.array(a).view(DeviceArray)


def _rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _conv_ops(attrs, x, w, b=None):
    """Conv, ConvGradData, ConvGradWeight on the device -> (y, dx, dw), and
    the same on the CPU."""
    ins = [x, w] + ([b] if b is not None else [])
    y_cpu = run_kernel("Conv", attrs, ins)[0]
    dy = _rand(y_cpu.shape, 9)
    dx_cpu = run_kernel("ConvGradData", dict(attrs, x_shape=list(x.shape)), [dy, w])[0]
    dw_cpu = run_kernel("ConvGradWeight", dict(attrs, w_shape=list(w.shape)), [dy, x])[0]
    y = run_kernel("Conv", attrs, ins, _dev)[0]
    dx = run_kernel("ConvGradData", dict(attrs, x_shape=list(x.shape)), [dy, w], _dev)[0]
    dw = run_kernel("ConvGradWeight", dict(attrs, w_shape=list(w.shape)), [dy, x], _dev)[0]
    return (y, dx, dw), (y_cpu, dx_cpu, dw_cpu)


def _check(got, want):
    for g, c in zip(got, want):
        np.testing.assert_allclose(g, c, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_conv_ops_run_their_cudnn_graphs(device, monkeypatch, fused):
    fake = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    x, w, b = _rand((2, 3, 7, 6), 0), _rand((4, 3, 3, 3), 1), _rand((4,), 2)
    attrs = {"stride": 2, "pad": 1}
    if fused:
        attrs.update(relu=True, negative_slope=0.1)
    got, want = _conv_ops(attrs, x, w, b)
    _check(got, want)
    kinds = [[k for k, _ in g.ops] for g in fake.graphs]
    assert kinds == [["conv_fprop", "bias"] + (["relu"] if fused else []),
                     ["conv_dgrad"], ["conv_wgrad"]]
    for g in fake.graphs:
        assert g.calls == ["validate", "build_operation_graph",
                           ("create_execution_plans", ("A", "FALLBACK")), "check_support",
                           ("build_plans", "ALL")]
        assert g.notes == ["NONDETERMINISTIC", "TENSOR_CORE"]  # deterministic, no TF32
    # each direction: its 4 deterministic float32 plans that build timed (the
    # 5th does not build: skipped), each run once more against the first's
    # result (the accuracy check sets eng6 aside), then one run on the
    # fastest accurate one, on CuPy's current stream, with the workspace
    # from the op's scratch
    timed = 4 * (1 + tune.REPS) + 4
    assert len(fake.executed) == 3 * (timed + 1) and set(fake.streams) == {1234}
    for g in fake.graphs:
        runs = [i for gg, _, i in fake.executed if gg is g]
        assert sorted(set(runs[:timed])) == [0, 1, 2, 4] and runs[timed:] == [1]
    assert tune.stats()["inaccurate"] == 3
    conv = fake.graphs[0].ops[0][1]
    assert conv["padding"] == [1, 1] and conv["stride"] == [2, 2]
    assert conv["x"].dim == [2, 3, 7, 6] and conv["x"].stride == [126, 42, 6, 1]


def _chosen(fake):
    """Plan name each graph ran last (its run, after any timing)."""
    return [g.plans[[i for gg, _, i in fake.executed if gg is g][-1]][0] for g in fake.graphs]


def test_fastest_plan_is_chosen_and_its_workspace_reserved(device, monkeypatch):
    """The heuristic's first plan (eng0) is the slowest; the FFT + filter-flip
    engine (eng1) is the fastest deterministic float32 plan that builds."""
    fake = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    x, w = _rand((2, 3, 6, 6), 0), _rand((4, 3, 3, 3), 1)
    kernel = get_kernel_class("Conv")(Op("c", "Conv", [], [], {"pad": 1}))
    y_cpu = run_kernel("Conv", {"pad": 1}, [x, w])[0]
    y = _dev(np.full(y_cpu.shape, np.nan, np.float32))
    before = y.copy()
    kernel.setup([_dev(x), _dev(w)], [y])
    np.testing.assert_array_equal(y, before)   # timing wrote temporaries, not the blob
    assert kernel._plan.index == 1 and kernel._plan.workspace_bytes == ENGINES[1][2]
    kernel.run([_dev(x), _dev(w)], [y])
    np.testing.assert_allclose(y, y_cpu, rtol=2e-5, atol=2e-5)
    assert _chosen(fake) == ["eng1_fft_flip_filter"]
    assert tune.stats()["timed"] == 1 and tune.stats()["cached"] == 0


def test_an_inaccurate_plan_is_set_aside_however_fast(device, monkeypatch):
    """Without TF32 a plan whose result is off the others' by more than
    ACCURACY_TOL is never kept: here the fastest (eng6, 5e-3 off, as an
    H200's Winograd-style weight-gradient engine was), and, when the odd one
    is the first (the reference), the majority still decides. With TF32 on
    nothing is checked (TF32 itself is off by about 1e-3)."""
    x, w = _rand((2, 3, 6, 6), 0), _rand((4, 3, 3, 3), 1)
    y_cpu = run_kernel("Conv", {"pad": 1}, [x, w])[0]
    cases = [(ENGINES, False, "eng1_fft_flip_filter"),
             ([("bad_first", 1.0, 0, (), True, 5e-3), ("good", 2.0, 0, (), True),
               ("good_slow", 3.0, 0, (), True)], False, "good"),
             (ENGINES, True, "eng5_tensor_core")]
    for engines, tf32, want in cases:
        fake = FakeCudnn(engines=engines)
        monkeypatch.setitem(sys.modules, "cudnn", fake)
        gpu_cudnn.reset()
        tune.reset()
        monkeypatch.setattr(gpu, "tf32_enabled", lambda: tf32)
        kernel = get_kernel_class("Conv")(Op("c", "Conv", [], [], {"pad": 1}))
        y = _dev(np.zeros(y_cpu.shape, np.float32))
        kernel.setup([_dev(x), _dev(w)], [y])
        kernel.run([_dev(x), _dev(w)], [y])
        assert _chosen(fake) == [want], (engines, tf32)
        if not tf32:
            np.testing.assert_allclose(y, y_cpu, rtol=2e-5, atol=2e-5)
            assert tune.stats()["inaccurate"] == 1
            assert "1 inaccurate plan(s) set aside" in tune.summary()
        else:
            assert tune.stats()["inaccurate"] == 0


def test_the_accuracy_check_does_not_read_the_ops_zero_buffers(device, monkeypatch):
    """In a training job an op is set up before any data flows: its input
    buffers hold zeros, on which every plan agrees. The accuracy check runs
    the plans on inputs of its own (seeded, varied), so the fast inaccurate
    plan is still set aside -- on an H200 the weight gradient of
    cifar10_quick's conv2 took eng17_k25=0, 6.2e-3 off, when the check read
    the zeros -- and the op's buffers are left as they were."""
    fake = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    x, w = _rand((2, 3, 6, 6), 0), _rand((4, 3, 3, 3), 1)
    kernel = get_kernel_class("Conv")(Op("c", "Conv", [], [], {"pad": 1}))
    zeros = [_dev(np.zeros(x.shape, np.float32)), _dev(np.zeros(w.shape, np.float32))]
    kernel.setup(zeros, [_dev(np.zeros((2, 4, 6, 6), np.float32))])
    assert all(not np.asarray(z).any() for z in zeros)
    assert _chosen_at_setup(fake, kernel) == "eng1_fft_flip_filter"
    assert tune.stats()["inaccurate"] == 1
    y = _dev(np.zeros((2, 4, 6, 6), np.float32))
    kernel.run([_dev(x), _dev(w)], [y])
    np.testing.assert_allclose(y, run_kernel("Conv", {"pad": 1}, [x, w])[0],
                               rtol=2e-5, atol=2e-5)


def _chosen_at_setup(fake, kernel):
    return fake.graphs[0].plans[kernel._plan.index][0]


def test_plans_that_disagree_with_no_majority_are_said(device, monkeypatch):
    """Three plans, each off the others: no majority to tell the odd ones
    by, so the fastest is kept and the start-up row says so."""
    engines = [("off_5e-3", 1.0, 0, (), True, 5e-3), ("off_1e-2", 2.0, 0, (), True, 1e-2),
               ("exact", 3.0, 0, (), True)]
    fake = FakeCudnn(engines=engines)
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    x, w = _rand((2, 3, 6, 6), 0), _rand((4, 3, 3, 3), 1)
    kernel = get_kernel_class("Conv")(Op("c", "Conv", [], [], {"pad": 1}))
    kernel.setup([_dev(x), _dev(w)], [_dev(np.zeros((2, 4, 6, 6), np.float32))])
    assert fake.graphs[0].plans[kernel._plan.index][0] == "off_5e-3"
    assert tune.stats()["undecided"] == 1 and tune.stats()["inaccurate"] == 0
    assert "1 convolution(s) whose plans disagree with no majority" in tune.summary()


def test_the_plan_survey_shows_each_plans_deviation(device, monkeypatch):
    """benchmarks/cudnn_plans.py, the survey that found the H200's inaccurate
    engine, on the emulated cuDNN: every plan that builds with its deviation
    from the float64 reference; the set-up's choice is an accurate one."""
    import importlib.util
    fake = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    spec = importlib.util.spec_from_file_location(
        "cudnn_plans", os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks",
                                    "cudnn_plans.py"))
    survey = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(survey)
    x_shape, w_shape, attrs = survey.parse_case("2,3,6,6:4,3,3:1")
    rows = survey.direction_rows(device, x_shape, w_shape, attrs)
    assert [r["op"] for r in rows] == ["Conv", "ConvGradData", "ConvGradWeight"]
    for row in rows:
        deviation = {p["name"]: p["deviation"] for p in row["plans"]}
        assert set(deviation) == {"eng0_implicit_gemm", "eng1_fft_flip_filter", "eng2_winograd",
                                  "eng6_winograd_nonfused"}, row
        assert 1e-3 < deviation["eng6_winograd_nonfused"] < 1e-2
        assert max(v for k, v in deviation.items() if k != "eng6_winograd_nonfused") < 1e-5
        assert row["chosen_name"] == "eng1_fft_flip_filter"
    with pytest.raises(SystemExit, match="expected N,C,H,W"):
        survey.parse_case("2,3,6:4")


def _count_timing(fake):
    return sum(1 for g, _, _ in fake.executed)


def test_second_process_reads_the_cache_and_does_not_retime(device, monkeypatch, tmp_path):
    x, w, b = _rand((2, 3, 7, 6), 0), _rand((4, 3, 3, 3), 1), _rand((4,), 2)
    attrs = {"stride": 2, "pad": 1, "relu": True}
    first = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", first)
    _check(*_conv_ops(attrs, x, w, b))
    assert tune.stats()["timed"] == 3 and tune.stats()["cached"] == 0
    path = tune.cache_path(GPU_NAME, first.version)
    assert str(tmp_path / "cache") in path
    doc = json.loads(open(path).read())
    assert doc["gpu"] == GPU_NAME and doc["cudnn"] == first.version and len(doc["plans"]) == 3
    assert {e["name"] for e in doc["plans"].values()} == {"eng1_fft_flip_filter"}
    # a new process: nothing in memory, the cache on disk
    gpu_cudnn.reset()
    tune.reset()
    second = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", second)
    _check(*_conv_ops(attrs, x, w, b))
    assert tune.stats()["timed"] == 0 and tune.stats()["cached"] == 3
    assert [i for _, _, i in second.executed] == [1, 1, 1]   # one run each, nothing timed
    for g in second.graphs:
        assert ("build_plans", "ALL") not in g.calls and ("build_plan_at_index", 1) in g.calls
    line = tune.summary()
    assert line.startswith("0 plans timed") and "3 from the cache" in line


@pytest.mark.parametrize("damage", ["corrupt", "other_gpu", "other_version", "stale_entry",
                                    "bad_index"])
def test_a_damaged_or_foreign_cache_is_retimed_and_rewritten(device, monkeypatch, damage):
    x, w = _rand((2, 3, 6, 6), 0), _rand((4, 3, 3, 3), 1)
    monkeypatch.setitem(sys.modules, "cudnn", FakeCudnn())
    _check(*_conv_ops({"pad": 1}, x, w))
    path = tune.cache_path(GPU_NAME, 91900)
    doc = json.loads(open(path).read())
    if damage == "corrupt":
        open(path, "w").write('{"format": 1, "gpu": "NVIDIA Sim')
    else:
        if damage == "other_gpu":
            doc["gpu"] = "NVIDIA Other GPU"
        elif damage == "other_version":
            doc["cudnn"] = 90100
        else:
            for entry in doc["plans"].values():
                if damage == "stale_entry":
                    entry["name"] = "eng9_gone"   # this index is another plan now
                else:
                    entry["index"] = 3            # the plan that does not build
                    entry["name"] = "eng4_no_build"
        open(path, "w").write(json.dumps(doc))
    gpu_cudnn.reset()
    tune.reset()
    fresh = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fresh)
    _check(*_conv_ops({"pad": 1}, x, w))
    assert tune.stats()["timed"] == 3 and tune.stats()["cached"] == 0
    assert _chosen(fresh) == ["eng1_fft_flip_filter"] * 3
    rewritten = json.loads(open(path).read())
    assert rewritten["gpu"] == GPU_NAME and rewritten["cudnn"] == 91900
    assert {e["name"] for e in rewritten["plans"].values()} == {"eng1_fft_flip_filter"}
    if damage in ("corrupt", "other_gpu", "other_version"):
        assert "ignored and rewritten" in tune.summary()


def test_nondeterministic_plans_compete_only_when_allowed(device, monkeypatch):
    x, w = _rand((2, 3, 6, 6), 0), _rand((4, 3, 3, 3), 1)
    monkeypatch.setenv("PURINE_CUDNN_DETERMINISTIC", "0")
    fake = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    _check(*_conv_ops({"pad": 1}, x, w))
    assert all(g.notes == ["TENSOR_CORE"] for g in fake.graphs)
    assert _chosen(fake) == ["eng3_atomics"] * 3
    # the deterministic choice is another cache key: timed again, not read
    gpu_cudnn.reset()
    tune.reset()
    monkeypatch.setenv("PURINE_CUDNN_DETERMINISTIC", "1")
    fake = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    _check(*_conv_ops({"pad": 1}, x, w))
    assert tune.stats()["timed"] == 3 and _chosen(fake) == ["eng1_fft_flip_filter"] * 3


def test_benchmark_off_takes_the_heuristics_first_plan(device, monkeypatch):
    monkeypatch.setenv("PURINE_CUDNN_BENCHMARK", "0")
    fake = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    x, w = _rand((2, 3, 6, 6), 0), _rand((4, 3, 3, 3), 1)
    _check(*_conv_ops({"pad": 1}, x, w))
    assert [i for _, _, i in fake.executed] == [0, 0, 0]   # no timing runs
    assert all(g.calls[-1] == ("build_plans", "HEURISTICS_CHOICE") for g in fake.graphs)
    assert not os.path.exists(tune.cache_path(GPU_NAME, 91900))
    assert "untimed" in tune.summary()


def test_an_unwritable_cache_still_chooses_by_timing(device, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("PURINE_CACHE_DIR", str(blocker))
    fake = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    x, w = _rand((2, 3, 6, 6), 0), _rand((4, 3, 3, 3), 1)
    _check(*_conv_ops({"pad": 1}, x, w))
    assert _chosen(fake) == ["eng1_fft_flip_filter"] * 3


def test_unfused_plan_when_the_epilogue_has_none(device, monkeypatch, capsys):
    """No plan with the bias and ReLU fused: cuDNN convolves, bias_act follows."""
    fake = FakeCudnn(unsupported={"bias"})
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    x, w, b = _rand((2, 3, 5, 5), 0), _rand((4, 3, 3, 3), 1), _rand((4,), 2)
    got, want = _conv_ops({"pad": 1, "relu": True}, x, w, b)
    _check(got, want)
    assert [[k for k, _ in g.ops] for g in fake.graphs][:2] == [["conv_fprop", "bias", "relu"],
                                                               ["conv_fprop"]]
    assert capsys.readouterr().err == ""   # the plain plan worked: nothing to say


def test_no_plan_falls_back_to_im2col_and_says_so_once(device, monkeypatch, capsys):
    fake = FakeCudnn(unsupported={"conv_fprop", "conv_dgrad", "conv_wgrad"})
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    x, w = _rand((2, 3, 5, 5), 0), _rand((4, 3, 3, 3), 1)
    for _ in range(2):
        got, want = _conv_ops({"pad": 1}, x, w)
        _check(got, want)
    assert not fake.executed
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 3 and all("im2col + cuBLAS" in line and "no cuDNN plan" in line
                                   for line in lines)


def test_without_the_frontend_one_line_and_im2col(device, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cudnn", None)   # import cudnn -> ImportError
    x, w = _rand((2, 3, 5, 5), 0), _rand((4, 3, 3, 3), 1)
    got, want = _conv_ops({"pad": 1}, x, w)
    _check(got, want)
    got, want = _conv_ops({"pad": 1}, x, w)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "im2col + cuBLAS, not cuDNN (no cuDNN frontend" in err[0]
    assert "nvidia-cudnn-frontend" in err[0]
    assert "Traceback" not in err[0]


def test_purine_conv_im2col_keeps_cudnn_off(device, monkeypatch, capsys):
    fake = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    monkeypatch.setenv("PURINE_CONV", "im2col")
    x, w = _rand((2, 3, 5, 5), 0), _rand((4, 3, 3, 3), 1)
    _check(*_conv_ops({"pad": 1}, x, w))
    assert not fake.graphs and "PURINE_CONV=im2col" in capsys.readouterr().err


def test_grouped_and_double_convolutions_take_im2col(device, monkeypatch):
    fake = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    x, w = _rand((2, 4, 5, 5), 0), _rand((4, 2, 3, 3), 1)
    _check(*_conv_ops({"pad": 1, "group": 2}, x, w))
    x64, w64 = x.astype(np.float64), _rand((4, 4, 3, 3), 1).astype(np.float64)
    y = run_kernel("Conv", {"pad": 1}, [x64, w64], _dev)[0]
    np.testing.assert_allclose(y, run_kernel("Conv", {"pad": 1}, [x64, w64])[0], rtol=1e-12)
    assert not fake.graphs


# ---------------------------------------------------------------- real GPU

@pytest.mark.gpu
@pytest.mark.parametrize("attrs", [{"pad": 2}, {"stride": 2, "pad": 1, "relu": True},
                                   {"kernel_1x1": True}])
def test_cudnn_conv_matches_the_cpu_on_a_gpu(attrs):
    from tests.conftest import cuda_cupy_or_skip
    cupy = cuda_cupy_or_skip()
    pytest.importorskip("cudnn")
    gpu_cudnn.reset()
    if gpu_cudnn.frontend() is None:
        pytest.skip(f"cuDNN frontend unusable: {gpu_cudnn.fallback_reason()}")
    attrs = dict(attrs)
    k = 1 if attrs.pop("kernel_1x1", False) else 5
    x, w, b = _rand((8, 16, 12, 12), 0), _rand((32, 16, k, k), 1), _rand((32,), 2)
    ins = [x, w, b]
    y_cpu = run_kernel("Conv", attrs, ins)[0]
    kernel = get_kernel_class("Conv")(Op("c", "Conv", [], [], dict(attrs)))
    dev = [cupy.asarray(a) for a in ins]
    y = cupy.full(y_cpu.shape, np.nan, np.float32)
    kernel.setup(dev, [y])
    assert kernel._plan is not None, "no cuDNN plan for a plain float32 convolution"
    kernel.run(dev, [y])
    np.testing.assert_allclose(cupy.asnumpy(y), y_cpu, rtol=1e-4, atol=1e-4)
    dy = _rand(y_cpu.shape, 3)
    for op_type, extra, args in (("ConvGradData", {"x_shape": list(x.shape)}, [dy, w]),
                                 ("ConvGradWeight", {"w_shape": list(w.shape)}, [dy, x])):
        attrs_g = {key: v for key, v in attrs.items() if key != "relu"}
        want = run_kernel(op_type, dict(attrs_g, **extra), args)[0]
        kern = get_kernel_class(op_type)(Op("g", op_type, [], [], dict(attrs_g, **extra)))
        dargs = [cupy.asarray(a) for a in args]
        out = cupy.full(want.shape, np.nan, np.float32)
        kern.setup(dargs, [out])
        assert kern._plan is not None
        kern.run(dargs, [out])
        np.testing.assert_allclose(cupy.asnumpy(out), want, rtol=1e-4,
                                   atol=1e-4 * max(1.0, float(np.abs(want).max())))


@pytest.mark.gpu
def test_plans_timed_then_read_from_the_cache_on_a_gpu(monkeypatch, tmp_path):
    """The real frontend: every direction's plans timed on the op's buffers,
    the fastest kept and equal to the CPU; a second set-up (a new process's
    state) reads all three from the cache, re-times nothing, and agrees."""
    from tests.conftest import cuda_cupy_or_skip
    cupy = cuda_cupy_or_skip()
    pytest.importorskip("cudnn")
    monkeypatch.setenv("PURINE_CACHE_DIR", str(tmp_path))
    for name in ("PURINE_CUDNN_BENCHMARK", "PURINE_CUDNN_DETERMINISTIC", "PURINE_CONV"):
        monkeypatch.delenv(name, raising=False)
    x, w = _rand((16, 32, 16, 16), 0), _rand((32, 32, 5, 5), 1)
    attrs = {"pad": 2}
    y_cpu = run_kernel("Conv", attrs, [x, w])[0]
    dy = _rand(y_cpu.shape, 3)
    cases = [("Conv", attrs, [x, w], y_cpu),
             ("ConvGradData", dict(attrs, x_shape=list(x.shape)), [dy, w],
              run_kernel("ConvGradData", dict(attrs, x_shape=list(x.shape)), [dy, w])[0]),
             ("ConvGradWeight", dict(attrs, w_shape=list(w.shape)), [dy, x],
              run_kernel("ConvGradWeight", dict(attrs, w_shape=list(w.shape)), [dy, x])[0])]
    chosen = []
    for round_ in ("cold", "warm"):
        gpu_cudnn.reset()
        tune.reset()
        if gpu_cudnn.frontend() is None:
            pytest.skip(f"cuDNN frontend unusable: {gpu_cudnn.fallback_reason()}")
        indices = []
        for op_type, op_attrs, args, want in cases:
            kern = get_kernel_class(op_type)(Op("g", op_type, [], [], dict(op_attrs)))
            dargs = [cupy.asarray(a) for a in args]
            out = cupy.full(want.shape, np.nan, np.float32)
            kern.setup(dargs, [out])
            assert kern._plan is not None and kern._plan.index is not None
            indices.append(kern._plan.index)
            kern.run(dargs, [out])
            np.testing.assert_allclose(cupy.asnumpy(out), want, rtol=1e-4,
                                       atol=1e-4 * max(1.0, float(np.abs(want).max())))
        chosen.append(indices)
        s = tune.stats()
        assert (s["timed"], s["cached"]) == ((3, 0) if round_ == "cold" else (0, 3)), s
    assert chosen[0] == chosen[1]


@pytest.mark.parametrize("limit,chosen,given_up", [
    (1 << 20, "eng1_fft_flip_filter", 0.0),   # the fastest fits
    (4096, "eng2_winograd", 1.0),             # eng1 (8192) does not: 3 ms, not 2
    (2048, "eng2_winograd", 1.0),             # at the cap fits
    (1500, "eng0_implicit_gemm", 3.0),
    (100, "eng0_implicit_gemm", 3.0)])        # none fits: the smallest, said once
def test_the_workspace_cap_picks_the_fastest_plan_that_fits(device, monkeypatch, capsys,
                                                            limit, chosen, given_up):
    """gpu.workspace_limit: the fastest kept plan whose workspace fits the
    cap, never one above it while one below exists; the start-up line gives
    the chosen workspace and the time given up against the fastest."""
    fake = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    tune.set_workspace_limit(limit)
    try:
        x, w = _rand((2, 3, 6, 6), 0), _rand((4, 3, 3, 3), 1)
        for name in ("c1", "c2"):
            kernel = get_kernel_class("Conv")(Op(name, "Conv", [], [], {"pad": 1}))
            y = _dev(np.zeros((2, 4, 6, 6), np.float32))
            kernel.setup([_dev(x), _dev(w)], [y])
            kernel.run([_dev(x), _dev(w)], [y])
            plan = kernel._plan
            assert plan.graph.plans[plan.index][0] == chosen
            fits = [e for e in ENGINES[:3] if e[2] <= limit]
            assert plan.workspace_bytes <= limit or not fits
            assert plan.workspace_bytes == dict((e[0], e[2]) for e in ENGINES)[chosen]
        s = tune.stats()
        assert (s["timed"], s["cached"]) == (1, 1)   # the second from the cache, same cap
        assert s["workspace_max"] == plan.workspace_bytes
        assert s["ms_given_up"] == pytest.approx(2 * given_up)
        line = tune.summary()
        assert "gpu.workspace_limit" in line
        assert ("slower than the fastest by" in line) == (given_up > 0)
        err = capsys.readouterr().err
        assert err.count("fits gpu.workspace_limit") == (0 if fits else 1)
        assert ("no plan under the cap" in line) == (not fits)
    finally:
        tune.set_workspace_limit(None)


def test_a_cached_choice_is_not_reused_under_another_cap(device, monkeypatch):
    fake = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    x, w = _rand((2, 3, 6, 6), 0), _rand((4, 3, 3, 3), 1)
    try:
        for limit, name in ((1 << 20, "eng1_fft_flip_filter"), (4096, "eng2_winograd")):
            tune.set_workspace_limit(limit)
            kernel = get_kernel_class("Conv")(Op("c", "Conv", [], [], {"pad": 1}))
            kernel.setup([_dev(x), _dev(w)], [_dev(np.zeros((2, 4, 6, 6), np.float32))])
            assert kernel._plan.graph.plans[kernel._plan.index][0] == name
        assert tune.stats()["timed"] == 2
    finally:
        tune.set_workspace_limit(None)


def test_reset_forgets_the_workspace_cap(monkeypatch):
    """``tune.reset()`` puts the default cap back: a job's
    ``gpu.workspace_limit`` (set by configure_device) does not leak into the
    next test in the process, nor into the plan keys it makes."""
    geo = dict(N=2, C=3, H=8, W=8, O=4, kh=3, kw=3, sh=1, sw=1, ph=1, pw=1, dh=1, dw=1, G=1)
    default_key = tune.plan_key("fprop", geo, np.float32, False, False, 0.0, True, False)
    tune.set_workspace_limit(1 << 20)
    assert tune.workspace_limit() == 1 << 20
    assert tune.plan_key("fprop", geo, np.float32, False, False, 0.0, True, False) != default_key
    tune.reset()
    assert tune.workspace_limit() == tune.DEFAULT_WORKSPACE_LIMIT
    assert tune.plan_key("fprop", geo, np.float32, False, False, 0.0, True, False) == default_key


def test_a_bf16_convolution_runs_a_tf32_plan_held_to_the_accuracy_filter(device, monkeypatch):
    """A Conv marked bf16 (``compute_dtype``) may take TF32 plans with the
    process's tf32 off: its plans are timed on copies of its inputs rounded
    to bfloat16 (here its buffers are plain float32), where the tensor-core
    plan (eng5, the fastest that builds, deterministic) computes the exact
    products and passes the ACCURACY_TOL filter, which still sets the
    inaccurate eng6 aside. On bf16 inputs its result is the fp32 plan's, bit
    for bit (the emulated TF32 engine reads its operands in TF32). An fp32
    Conv of the same process keeps no tensor cores (key tf320)."""
    from purine_mpi.base.precision import round_to, scratch_spec
    monkeypatch.setattr(gpu, "tf32_enabled", lambda: False)
    x, w = _rand((2, 3, 6, 6), 0), _rand((4, 3, 3, 3), 1)
    xb, wb = x.copy(), w.copy()
    for a in (xb, wb):
        round_to(a, "bfloat16", np.empty(*scratch_spec(a.shape, "bfloat16")))
    ys = {}
    for dtype in ("bfloat16", None):
        fake = FakeCudnn()
        monkeypatch.setitem(sys.modules, "cudnn", fake)
        gpu_cudnn.reset()
        tune.reset()
        attrs = {"pad": 1, **({"compute_dtype": dtype} if dtype else {})}
        kernel = get_kernel_class("Conv")(Op("c", "Conv", [], [], attrs))
        y = _dev(np.zeros((2, 4, 6, 6), np.float32))
        kernel.setup([_dev(x), _dev(w)], [y])   # timed on x, w (not bf16-valued)
        fake.math.clear()
        kernel.run([_dev(xb), _dev(wb)], [y])
        ys[dtype] = np.array(y)
        assert fake.graphs[0].notes == ["NONDETERMINISTIC"] + ([] if dtype else ["TENSOR_CORE"])
        assert _chosen(fake) == ["eng5_tensor_core" if dtype else "eng1_fft_flip_filter"]
        assert [tc for _, tc in fake.math] == [bool(dtype)]
        assert tune.stats()["inaccurate"] == 1   # eng6
        key = tune.plan_key("fprop", kernel._direction([x, w], [y])[1], np.float32, False,
                            False, 0.0, True, bool(dtype), dtype)
        assert key in json.loads(open(tune.cache_path(GPU_NAME, 91900)).read())["plans"]
    np.testing.assert_array_equal(ys["bfloat16"], ys[None])
