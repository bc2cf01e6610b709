"""CUDA-graph capture on a simulated device that refuses what CuPy refuses.

The CUDA-graph path once passed CI and never captured on a real GPU: the
simulated CuPy let cuBLAS calls and host-to-device copies into a capture,
CuPy 14.2 on an H100 refused both. So:

1. Each refusal of real CuPy inside a stream capture, with its exception and
   message (tests/emulated_gpu/capture.py lists them, from CuPy's sources and the
   H100), is proved on the emulated device: the op's host code runs at
   capture, as on a GPU, and the refused call raises there. So does our own
   rule, no allocation in a capture. What a capture allows is recorded, not
   run, and a replay reads the memory as it is then.
2. cifar10_quick, NIN (dropout on) and GoogLeNet (inception branches on
   several streams; marked slow), placed and fused as the trainer does,
   capture whole under those rules: one graph launch per steady-state
   iteration, no GPU op launched eagerly, no host synchronisation between
   read-backs, and the same losses and weights, bit for bit, as the eager
   stream dispatcher.

Resume with captures on is in tests/test_cuda_graph.py
(test_trainer_with_cuda_graphs_on_the_emulated_gpu).
"""

import numpy as np
import pytest

from purine_mpi.gpu import kernels
from purine_mpi.parallel.placement import add_loss_watch, prepare_for_device
from purine_mpi.gpu.streams import copy_to_device_async, pinned_empty
from purine_mpi.job.replica import build_train_graph, loss_blobs
from purine_mpi.runtime.factory import make_dispatcher
from tests.emulated_gpu import capture as sim_capture
from tests.conftest import make_job
from tests.emulated_gpu import (DeviceArray, SimulatedRuntime, init_params, net_config,
                                on_device)


def _host_buffer(values):
    return np.array(values, dtype=np.float32)


def _pinned(values):
    buf = pinned_empty((len(values),), np.float32)
    buf[...] = values
    return buf


# (name, what the op's host code does, exception, CuPy's message)
REFUSED = [
    ("ndarray.set", lambda f, x, rt, s: x.set(_host_buffer([1, 2, 3])),
     RuntimeError, sim_capture.H2D_REFUSED),
    ("setitem of a host array", lambda f, x, rt, s: x.__setitem__(Ellipsis, _host_buffer([1, 2, 3])),
     RuntimeError, sim_capture.H2D_REFUSED),
    ("ndarray.get", lambda f, x, rt, s: x.get(), RuntimeError, sim_capture.D2H_REFUSED),
    ("cupy.asnumpy", lambda f, x, rt, s: f.asnumpy(x), RuntimeError, sim_capture.D2H_REFUSED),
    ("float()", lambda f, x, rt, s: float(x[0]), RuntimeError, sim_capture.D2H_REFUSED),
    ("item()", lambda f, x, rt, s: x[1].item(), RuntimeError, sim_capture.D2H_REFUSED),
    ("stream.synchronize", lambda f, x, rt, s: rt.sync_stream(s),
     sim_capture.CUDARuntimeError, sim_capture.SYNC_REFUSED),
    ("synchronize all streams", lambda f, x, rt, s: rt.sync_streams(),
     sim_capture.CUDARuntimeError, sim_capture.SYNC_REFUSED),
    ("cudaDeviceSynchronize", lambda f, x, rt, s: f.cuda.runtime.deviceSynchronize(),
     sim_capture.CUDARuntimeError, sim_capture.SYNC_REFUSED),
    ("cupy.empty", lambda f, x, rt, s: f.empty((3,), np.float32),
     RuntimeError, sim_capture.ALLOC_REFUSED),
    ("cupy.zeros_like", lambda f, x, rt, s: f.zeros_like(x), RuntimeError,
     sim_capture.ALLOC_REFUSED),
    ("a ufunc without out=", lambda f, x, rt, s: x * 2, RuntimeError, sim_capture.ALLOC_REFUSED),
    ("a reduction", lambda f, x, rt, s: x.sum(), RuntimeError, sim_capture.ALLOC_REFUSED),
    ("astype to another dtype", lambda f, x, rt, s: x.astype(np.float64), RuntimeError,
     sim_capture.ALLOC_REFUSED),
    ("ndarray.copy", lambda f, x, rt, s: x.copy(), RuntimeError, sim_capture.ALLOC_REFUSED),
    ("pinned host memory", lambda f, x, rt, s: pinned_empty((3,), np.float32), RuntimeError,
     sim_capture.ALLOC_REFUSED),
    ("cudaMemcpyAsync from pageable memory",
     lambda f, x, rt, s: copy_to_device_async(x, _host_buffer([1, 2, 3])),
     sim_capture.CUDARuntimeError, sim_capture.PAGEABLE_REFUSED),
]


@pytest.mark.parametrize("name, host_code, exc, message", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_capture_refuses_what_cupy_refuses(emulated, name, host_code, exc, message):
    rt = SimulatedRuntime(0)
    assert rt.faithful  # the emulated CuPy is in place: captures run host code
    x = on_device([1.0, 2.0, 3.0])
    origin = rt.stream(0, "capture")
    rt.begin_capture(0, origin)
    with pytest.raises(exc) as info:
        rt.launch(0, origin, lambda: host_code(emulated, x, rt, origin), name)
    assert message in str(info.value)
    rt.abort_capture(0, origin)
    np.testing.assert_array_equal(np.asarray(x), [1.0, 2.0, 3.0])  # nothing ran
    # outside a capture the same call is allowed (the device is idle)
    if name not in ("cudaMemcpyAsync from pageable memory",):
        rt.launch(0, rt.stream(0, "eager"), lambda: host_code(emulated, x, rt, origin), name)
        rt.sync_streams()


def test_cupys_own_cublas_refuses_a_capture_and_nvmath_is_recorded(emulated, monkeypatch):
    """The products: through CuPy's cuBLAS binding a capture fails (its
    setStream check); through nvmath's, on a reserved stream, it is recorded."""
    from purine_mpi.gpu import blas
    from tests.emulated_gpu import use_emulated_nvmath
    a, b = on_device(np.ones((2, 3))), on_device(np.ones((3, 2)))
    c = on_device(np.zeros((2, 2)))
    for nvmath in (False, True):
        use_emulated_nvmath(monkeypatch, enabled=nvmath)
        rt = SimulatedRuntime(0)
        origin = rt.stream(0, "capture")
        rt.prepare_capture(0, [origin])
        rt.begin_capture(0, origin)
        if not nvmath:
            with pytest.raises(NotImplementedError, match=sim_capture.CUBLAS_REFUSED):
                rt.launch(0, origin, lambda: blas.gemm(a, b, c), "fc")
            rt.abort_capture(0, origin)
            continue
        rt.launch(0, origin, lambda: blas.gemm(a, b, c), "fc")
        graph = rt.end_capture(0, origin)
        assert np.asarray(c).sum() == 0  # recorded, not run
        np.asarray(a)[...] = 2.0          # the replay reads the operands then
        graph.launch(rt.stream(0, "replay"))
        rt.sync_streams()
        np.testing.assert_array_equal(np.asarray(c), np.full((2, 2), 6.0))  # 2 x 3 terms


def test_what_a_capture_allows_is_recorded_and_read_at_replay(emulated):
    """A raw kernel (scalars frozen at capture), an elementwise operation
    into an existing array, a device copy, and a cudaMemcpyAsync from
    page-locked memory: none runs at capture; each replay reads the memory
    as it is then."""
    rt = SimulatedRuntime(0)
    staging = _pinned([1.0, 2.0, 3.0])
    x, y = on_device([0.0, 0.0, 0.0]), on_device([0.0, 0.0, 0.0])
    counter, iteration = (np.zeros(1, np.int64).view(DeviceArray) for _ in range(2))
    counter[...] = 5
    scale = 3.0

    def host_code():
        copy_to_device_async(x, staging)         # H2D from page-locked memory
        np.multiply(x, scale, out=y)             # elementwise into y (scale frozen)
        y[...] += x                              # y = 4 x
        kernels.iteration_next(counter, iteration)

    origin = rt.stream(0, "capture")
    rt.begin_capture(0, origin)
    rt.launch(0, origin, host_code, "probe")
    graph = rt.end_capture(0, origin)
    assert not np.asarray(x).any() and not np.asarray(y).any() and counter.get()[0] == 5
    for k in range(2):
        staging[...] = [10.0 * (k + 1), 0.0, -1.0]
        scale = 100.0  # the captured multiply keeps 3
        graph.launch(rt.stream(0, "replay"))
        rt.sync_streams()
        np.testing.assert_array_equal(np.asarray(x), staging)
        np.testing.assert_array_equal(np.asarray(y), 4 * staging)
        assert iteration.get()[0] == 5 + k and counter.get()[0] == 6 + k


def test_a_direct_cupy_style_capture_records_the_work_of_its_with_block(emulated):
    """CuPy's own order, ``with stream: begin_capture(); work; end_capture()``
    (no runtime in between): the work queued before ``begin_capture`` in the
    same block runs eagerly once, the work between the two calls is the
    graph, and each replay runs it again on the memory as it is then."""
    stream = emulated.cuda.Stream(non_blocking=True)
    x, y = on_device([1.0, 2.0]), on_device([0.0, 0.0])
    with stream:
        y[...] += x                  # before the capture: runs once
        stream.begin_capture()
        np.multiply(x, 3.0, out=y)   # captured
        y[...] += x                  # captured: y = 4 x
        graph = stream.end_capture()
    stream.synchronize()
    assert len(graph.nodes) >= 1
    np.testing.assert_array_equal(np.asarray(y), [1.0, 2.0])  # only the eager part ran
    for k in range(2):
        x[...] = [k + 5.0, -1.0]
        graph.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(np.asarray(y), [4 * (k + 5.0), -4.0])


def _net_dispatcher(net, cuda_graph, batch=2):
    config = net_config(net, batch)
    # a synthetic source makes one center per class: googlenet's 1000 of
    # 3x224x224 are 600 MB and seconds of random numbers for its 4 samples
    # (both dispatchers); 10 classes label them as well
    config["data"]["train"]["classes"] = min(config["data"]["train"]["classes"], 10)
    graph, _ = build_train_graph(make_job(config))
    prepare_for_device(graph, 0)  # placed and fused, as the trainer does
    losses = list(loss_blobs(graph))
    watch = add_loss_watch(graph, losses, [1.0] * len(losses), 0)
    rt = SimulatedRuntime(2)
    d = make_dispatcher(graph, runtime=rt, seed=3, cuda_graph=cuda_graph, log=lambda m: None)
    init_params(d.workspace, graph, 5)
    d.workspace[watch][...] = 0.0
    return d, rt, graph, watch





@pytest.mark.parametrize("net", ["cifar10_quick", "nin_cifar10",
                                 pytest.param("googlenet", marks=pytest.mark.slow)])
def test_a_net_captures_whole_one_launch_per_iteration_bitwise_like_eager(emulated, net):
    iters = 6
    batch = 1 if net == "googlenet" else 2  # 224x224 inputs, 357 ops
    eager, rt0, graph, watch = _net_dispatcher(net, cuda_graph=False, batch=batch)
    try:
        for it in range(iters):
            eager.run(it)
        want = {b: np.array(eager.workspace[b]) for b in [p.name for p in graph.params()] +
                [watch]}
    finally:
        eager.close()
    d, rt, graph, watch = _net_dispatcher(net, cuda_graph=True, batch=batch)
    counts, syncs = [], []
    try:
        for it in range(iters):
            start = len(rt.calls)
            d.run(it, sync=False)  # the trainer's step on a GPU
            calls = [c[0] for c in rt.calls[start:]]
            counts.append(d.capture_report()["launches_per_iter"])
            syncs.append(sum(c in ("sync_devices", "sync_streams") for c in calls))
            if it >= 2:  # steady state: the one graph, nothing launched eagerly
                assert calls.count("launch_graph") == 1 and "launch" not in calls, calls
        d.drain()
        report = d.capture_report()
        got = {b: np.array(d.workspace[b]) for b in want}
    finally:
        d.close()
    # two captures, one per staging buffer of the data reader; then replays
    assert report["segments"] == 1 and report["failed"] == {} and \
        report["eager_gpu_ops"] == {}
    assert counts[2:] == [1] * (iters - 2) and report["eager_ops_per_iter"] == 0
    # no host synchronisation between read-backs, once the captures are made
    # (the iteration after one starts synchronised: the host may have written)
    assert syncs[3:] == [0] * (iters - 3)
    assert len(rt.graphs) == 2 and [g.launches for g in rt.graphs] == [2, 2]
    if net == "nin_cifar10":
        assert {"drop1.fwd", "drop2.fwd"} <= set(rt.graphs[0].names())
    # the window's loss sum (every iteration's loss) and every weight, bitwise
    for name, value in want.items():
        assert value.tobytes() == got[name].tobytes(), name


def test_relaxed_mode_allocates_from_the_private_pool(emulated, monkeypatch):
    """What CuPy 14.2 allows, modelled with our stricter rule off: in
    relaxed capture mode a temporary comes from the private pool that
    ``CudaRuntime.capture_memory`` makes current, and the graph recomputes
    it at each replay. (Our rule, on everywhere else: no allocation in a
    capture at all.)"""
    monkeypatch.setitem(sim_capture.HOUSE_RULE, "no_capture_allocation", False)
    rt = SimulatedRuntime(0)
    x, y = on_device([1.0, 2.0, 3.0]), on_device([0.0, 0.0, 0.0])
    origin = rt.stream(0, "capture")
    allocator, pool = rt.capture_memory(0)
    with allocator:
        rt.begin_capture(0, origin)
        rt.launch(0, origin, lambda: np.add(x * 2, 1, out=y), "temporary")
        graph = rt.end_capture(0, origin)
    assert len(pool.blocks) == 1   # x * 2, from the private pool
    with pytest.raises(RuntimeError, match="allocation during a stream capture"):
        rt.begin_capture(0, origin)   # without the private pool: refused
        try:
            rt.launch(0, origin, lambda: np.add(x * 2, 1, out=y), "temporary")
        finally:
            rt.abort_capture(0, origin)
    for scale in (1.0, 5.0):
        values = np.array([1.0, 2.0, 3.0], np.float32) * scale
        np.asarray(x)[...] = values
        rt.launch_graph(0, graph, origin)
        rt.sync_streams()
        np.testing.assert_array_equal(np.asarray(y), 2 * values + 1)
