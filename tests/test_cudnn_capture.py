"""cuDNN inside the emulated capture (issue 35, item 3).

A whole net on the cuDNN path (the emulated frontend of
tests/emulated_gpu/cudnn.py: executions are device work on the handle's
stream, recorded into a capture and reading their inputs at each replay;
plan building refused during a capture) is captured into one graph per
iteration and replays bitwise like eager over several iterations. The
plans were timed (autotuned) in the eager warm-up, before the capture: a
plan built or timed inside it would have failed the capture.
"""
import sys

import numpy as np
import pytest

import purine_mpi.gpu as gpu
from purine_mpi.gpu import cudnn as gpu_cudnn
from purine_mpi.gpu import cudnn_tune as tune
from purine_mpi.job.replica import build_train_graph, loss_blobs
from purine_mpi.parallel.placement import add_loss_watch, prepare_for_device
from purine_mpi.runtime.factory import make_dispatcher
from tests.conftest import make_job
from tests.emulated_gpu import SimulatedRuntime, init_params, net_config, use_emulated_cupy
from tests.emulated_gpu.cudnn import BUILD_REFUSED, FakeCudnn


@pytest.fixture
def emulated_cudnn(monkeypatch, host_build_dir, tmp_path):
    fake_cupy = use_emulated_cupy(monkeypatch, host_build_dir)
    fake_cupy.cuda.runtime.getDeviceProperties = lambda dev: {"name": b"NVIDIA Emulated GPU"}
    fake = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    monkeypatch.setenv("PURINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PURINE_CONV", "cudnn")
    for name in ("PURINE_CUDNN_BENCHMARK", "PURINE_CUDNN_DETERMINISTIC"):
        monkeypatch.delenv(name, raising=False)
    gpu_cudnn.reset()
    tune.reset()
    yield fake
    gpu_cudnn.reset()
    tune.reset()
    gpu.clear_kernel_cache()


def _net_dispatcher(config, cuda_graph, seed=2):
    graph, _ = build_train_graph(make_job(config))
    prepare_for_device(graph, 0)
    losses = list(loss_blobs(graph))
    watch = add_loss_watch(graph, losses, [1.0] * len(losses), 0)
    rt = SimulatedRuntime(seed)
    d = make_dispatcher(graph, runtime=rt, seed=3, cuda_graph=cuda_graph, log=lambda m: None)
    init_params(d.workspace, graph, 5)
    d.workspace[watch][...] = 0.0
    return d, rt, graph, watch


@pytest.mark.parametrize("net", ["cifar10_quick", "nin_cifar10"])
def test_a_net_on_the_cudnn_path_captures_whole_and_replays_bitwise_like_eager(
        emulated_cudnn, net):
    iters = 5
    config = net_config(net, 2)
    eager, _, graph, watch = _net_dispatcher(config, cuda_graph=False)
    try:
        for it in range(iters):
            eager.run(it)
        want = {b: np.array(eager.workspace[b]) for b in [p.name for p in graph.params()] +
                [watch]}
    finally:
        eager.close()
    tuned = [g for g in emulated_cudnn.graphs if ("build_plans", "ALL") in g.calls]
    assert tuned, "the plans were not timed"
    d, rt, graph, watch = _net_dispatcher(config, cuda_graph=True)
    replayed = []
    try:
        for it in range(iters):
            start, executed = len(rt.calls), len(emulated_cudnn.executed)
            d.run(it, sync=False)
            d.drain()
            calls = [c[0] for c in rt.calls[start:]]
            if it >= 2:   # steady state: the one graph, nothing launched eagerly
                assert calls.count("launch_graph") == 1 and "launch" not in calls, calls
                replayed.append(len(emulated_cudnn.executed) - executed)
        report = d.capture_report()
        got = {b: np.array(d.workspace[b]) for b in want}
    finally:
        d.close()
    assert report["segments"] == 1 and report["failed"] == {} and \
        report["eager_gpu_ops"] == {}, report
    # cuDNN ran inside the replays: every convolution of the net, each iteration
    convs = {n for n, op in graph.ops.items()
             if op.op_type in ("Conv", "ConvGradData", "ConvGradWeight")}
    assert convs and convs <= set(rt.graphs[-1].names())
    assert replayed and min(replayed) >= len(convs), (replayed, len(convs))
    for name, value in want.items():
        assert value.tobytes() == got[name].tobytes(), name


def test_building_a_plan_inside_a_capture_is_refused(emulated_cudnn):
    """What the real frontend cannot do during a capture (allocate, sync)."""
    rt = SimulatedRuntime(0)
    origin = rt.stream(0, "capture")
    g = emulated_cudnn.pygraph(io_data_type=None, intermediate_data_type=None,
                               compute_data_type=None, handle=emulated_cudnn.create_handle())
    rt.begin_capture(0, origin)
    with pytest.raises(RuntimeError, match=BUILD_REFUSED.split(" (")[0]):
        rt.launch(0, origin, lambda: g.build_plans(), "build")
    rt.abort_capture(0, origin)
