"""Issue 35: two host threads launching onto one stream of the emulated
device at once (the CUDA-graph dispatcher's ``gpu<d>:graph`` worker runs a
segment's eager warm-up on the ops' streams while the ``gpu<d>:<stream>``
workers launch the eager ops there). Each thread's launch is its own: its
kernels run in stream order, after the work queued before them, and are
logged under its own op's name (the emulator once kept one launch per
stream: the second thread's kernels went into the first's launch, and those
after its end ran at once on the host, before the stream's queued work)."""
import threading

import numpy as np

from tests.emulated_gpu import DeviceArray, SimulatedRuntime, use_emulated_cupy


def test_two_threads_launching_onto_one_stream_keep_stream_order(host_build_dir, monkeypatch):
    use_emulated_cupy(monkeypatch, host_build_dir)
    rt = SimulatedRuntime(0)
    stream = rt.stream(0, 0)
    x, y, z, w = (np.zeros(4).view(DeviceArray) for _ in range(4))
    # queued on the stream, not run yet: x = 5
    rt.launch(0, stream, lambda: np.add(x, 5.0, out=x), "set_x")
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()

    def op_a():   # y = x + 1, still recording while B launches
        np.add(x, 1.0, out=y)
        a_in.set()
        assert b_in.wait(10)

    def op_b():   # z = x * 2; then, once A's launch has ended, w = x + 3
        assert a_in.wait(10)
        np.multiply(x, 2.0, out=z)
        b_in.set()
        assert a_done.wait(10)
        np.add(x, 3.0, out=w)

    def launch_a():
        rt.launch(0, stream, op_a, "op_a")
        a_done.set()

    threads = [threading.Thread(target=launch_a),
               threading.Thread(target=lambda: rt.launch(0, stream, op_b, "op_b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    rt.sync_streams()
    np.testing.assert_array_equal(np.asarray(y), 6.0)
    np.testing.assert_array_equal(np.asarray(z), 10.0)
    np.testing.assert_array_equal(np.asarray(w), 8.0)   # read x after set_x ran
    assert sorted(rt.log) == ["op_a", "op_b", "set_x"] and rt.log[0] == "set_x"


def _adamw_run(config, device, iters, read_back, seed=1):
    """``iters`` AdamW iterations of ``config`` on the CPU (-1) or captured
    on the emulated GPU 0; the parameters read back after each iteration
    (``read_back``) or only at the end."""
    from purine_mpi.job.replica import build_train_graph
    from purine_mpi.parallel.placement import place_on_device
    from purine_mpi.runtime.dispatcher import SerialDispatcher
    from purine_mpi.runtime.factory import make_dispatcher
    from tests.conftest import make_job
    from tests.emulated_gpu import init_params
    graph, _ = build_train_graph(make_job(config))
    if device < 0:
        d = SerialDispatcher(graph, seed=3)
    else:
        place_on_device(graph, device)
        d = make_dispatcher(graph, runtime=SimulatedRuntime(seed), seed=3, cuda_graph=True)
    try:
        init_params(d.workspace, graph, 5)
        losses, seen = [], []
        for it in range(iters):
            d.workspace["iter"][...] = it
            d.run(it)
            losses.append(float(d.workspace["loss"]))
            if read_back or it == iters - 1:
                seen.append({p.name: np.array(d.workspace[p.name]) for p in graph.params()})
        report = d.executor.report() if device >= 0 else None
        return losses, seen, report
    finally:
        d.close()


def test_eager_adamw_updates_between_captured_segments_match_the_cpu(host_build_dir, monkeypatch):
    """A small net captured whole, but for its AdamW updates, made eager here
    as any op that cannot be captured (they once were: they read the host
    'iter'; now they read the device iteration and are captured), so they
    run between the captured segments, reading and writing what the
    segments read and write, with the parameters read back after every
    iteration: the CPU's losses and parameters at each iteration. (One
    segment here: this net passed with the emulator of before too; the GPT
    of tests/test_gpt_gpu.py, then cut in two segments, did not.)"""
    from purine_mpi.job.config import validate_config
    from purine_mpi.ops.catalog import get_kernel_class
    from tests.emulated_gpu import tiny_raw
    monkeypatch.setattr(get_kernel_class("AdamWUpdate"), "capturable", False, raising=False)
    raw = tiny_raw(device=0, cuda_graph=True)
    raw["solver"] = {"type": "adamw", "base_lr": 0.01, "momentum": 0.9, "momentum2": 0.99,
                     "weight_decay": 1e-2, "max_iter": 10}
    config = validate_config(raw, check_files=False)
    cpu_losses, cpu_seen, _ = _adamw_run(config, -1, 3, True)
    use_emulated_cupy(monkeypatch, host_build_dir)
    for seed in (1,):
        losses, seen, report = _adamw_run(config, 0, 3, True, seed)
        assert report["captured"] == report["segments"] > 0 and not report["failed"], report
        assert any("update" in n for n in report["eager_gpu_ops"]), report["eager_gpu_ops"]
        np.testing.assert_allclose(losses, cpu_losses, rtol=1e-5)
        for it, (got, want) in enumerate(zip(seen, cpu_seen)):
            for name, value in want.items():
                np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=2e-5,
                                           err_msg=f"{name}, iteration {it}, seed {seed}")
