"""The memory plan on a GPU (runtime/memory_plan.py, ``device=d``).

Without a GPU, on the emulated device of tests/emulated_gpu (CuPy
arrays emulated on the host, the cuda/*.cu kernels compiled with g++, the
CUDA runtime simulated with streams run in random interleavings that
respect only the recorded events, captures that refuse what CuPy refuses):

- the device plans of every job and of random graphs placed on a device
  are sound: no two transient roots share bytes unless the graph orders
  them (checked from the plan and the schedule, and by plain ancestor sets);
- the arena lays the persistent roots out first, one after the other, and
  the planned ones after them at their planned offsets;
- ``train`` with the plan equals ``train`` without it, bitwise, eager and
  replaying CUDA graphs, for a net of every kind of layer, with the planned
  bytes filled with garbage before the first iteration (a kernel that read
  bytes it did not write would show it: the grad seed's ``Constant``, filled
  once on a GPU, did).
"""
import glob
import os

import numpy as np
import pytest

from purine_mpi.base.backend import to_numpy
from purine_mpi.parallel.placement import prepare_for_device
from purine_mpi.graph.core import Location
from purine_mpi.job.config import load_config, validate_config
from purine_mpi.job.replica import build_train_graph
from purine_mpi.runtime.memory_plan import batch_blobs, check_plan, device_plans, plan_memory
from purine_mpi.runtime.workspace import ARENA_ALIGN, plan_device_memory
from tests.conftest import cuda_cupy_or_skip, make_job
from tests.emulated_gpu import emulated_trainer_env, tiny_raw
from tests.test_memory_plan import _random_graph, _schedule_conflicts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every job but the one reading a CIFAR-10 file (its shapes come from the
# file; its net is cifar10_quick's)
JOBS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "jobs", "*.yaml"))
              if not p.endswith("_hdf5.yaml"))


def _assert_sound_on_device(graph, plan, device):
    assert plan.device == device and plan.align == ARENA_ALIGN
    assert _schedule_conflicts(graph, plan) == []
    assert check_plan(graph, plan) == []
    for root, off in plan.offsets.items():
        assert graph.blobs[root].location.device == device, root
        assert off % ARENA_ALIGN == 0 and off + plan.sizes[root] <= plan.total_bytes
    for a, b in plan.edges:  # control edges join ops of one stream of the device
        oa, ob = graph.ops[a], graph.ops[b]
        assert (oa.location, str(oa.thread)) == (ob.location, str(ob.thread))
        assert oa.location.device == device


def _assert_arena_layout(graph, plans):
    """plan_device_memory: persistent roots first, disjoint; the planned
    roots at base + their planned offset; the arena ends with the plan."""
    layout = plan_device_memory(graph, plans=plans)
    for device, (total, offsets) in layout.items():
        plan = plans[device]
        own = sorted((off, off + graph.blobs[r].nbytes) for r, off in offsets.items()
                     if r not in plan.offsets)
        base = -(-own[-1][1] // ARENA_ALIGN) * ARENA_ALIGN if own else 0
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(own, own[1:]))
        for root, off in plan.offsets.items():
            assert offsets[root] == base + off
        assert total == base + plan.total_bytes
        unplanned = plan_device_memory(graph)[device][0]
        assert total < unplanned


@pytest.mark.parametrize("job", JOBS)
def test_device_plans_of_every_job_are_sound(job, digits_h5, tmp_path):
    # the digits and GPT jobs read their shapes from the file (a fresh clone has no data/)
    sets = [f"data.{p}.path={digits_h5}" for p in ("train", "test")] \
        if job.startswith("digits") else []
    if job.startswith("gpt"):
        from tests.gpt_nets import text_h5
        tokens = text_h5(tmp_path)
        sets = [f"data.{p}.path={tokens}" for p in ("train", "test")]
    config = load_config(os.path.join(ROOT, "jobs", job), overrides=sets, check_files=False)
    graph, _ = build_train_graph(make_job(config))
    prepare_for_device(graph, 0)
    plans = device_plans(graph, keep=batch_blobs(graph), order_ops=True)
    assert list(plans) == [0]
    plan = plans[0]
    _assert_sound_on_device(graph, plan, 0)
    assert plan.offsets and plan.total_bytes < plan.unplanned_bytes
    if job in ("cifar10_quick.yaml", "nin_cifar10.yaml"):  # the target
        assert plan.total_bytes <= plan.unplanned_bytes / 2
    # what the host or the next iteration reads keeps its own bytes
    params = {graph.storage_root(p.name) for p in graph.params()}
    assert params <= set(plan.persistent)
    assert {graph.storage_root(b) for b in batch_blobs(graph)} <= set(plan.persistent)
    # the host plan of a GPU graph plans no device blob, and the reverse
    host = plan_memory(graph, keep=batch_blobs(graph))
    assert not set(host.offsets) & set(plan.offsets)
    _assert_arena_layout(graph, plans)


@pytest.mark.parametrize("seed", range(8))
def test_random_graphs_on_a_device_plan_soundly(seed):
    g, sinks = _random_graph(seed, threads=3)
    for item in list(g.ops.values()) + list(g.blobs.values()):
        item.location = Location(item.location.rank, 1, item.location.ip)
    plan = plan_memory(g, keep=sinks, order_ops=seed % 2 == 0, device=1)
    _assert_sound_on_device(g, plan, 1)
    assert plan.offsets and set(sinks) <= set(plan.persistent)
    assert plan_memory(g, keep=sinks, device=0).offsets == {}  # nothing on device 0
    assert plan_memory(g, keep=sinks).offsets == {}            # nor on the host
    _assert_arena_layout(g, {1: plan})


def _every_kind_raw(cuda_graph):
    """A small net with a layer of every kind the GPU runs, and a test phase."""
    raw = tiny_raw(device=0, cuda_graph=cuda_graph)
    w = {"weight_filler": {"type": "gaussian", "std": 0.2}}
    raw["net"] = [
        dict(type="conv", name="conv1", bottom="data", top="conv1", num_output=4, kernel=3,
             pad=1, **w),
        dict(type="batch_norm", name="bn1", bottom="conv1", top="bn1"),
        dict(type="relu", name="relu1", bottom="bn1", top="bn1"),
        dict(type="conv", name="conv2a", bottom="bn1", top="conv2a", num_output=3, kernel=1,
             **w),
        dict(type="conv", name="conv2b", bottom="bn1", top="conv2b", num_output=3, kernel=3,
             pad=1, **w),
        dict(type="concat", name="cat1", bottom=["conv2a", "conv2b"], top="cat1"),
        dict(type="eltwise", name="sum1", bottom=["conv2a", "conv2b"], top="sum1"),
        dict(type="concat", name="cat2", bottom=["cat1", "sum1"], top="cat2"),
        dict(type="tanh", name="tanh1", bottom="cat2", top="tanh1"),
        dict(type="pool", name="pool1", bottom="tanh1", top="pool1", pool="max", kernel=2,
             stride=2),
        dict(type="lrn", name="norm1", bottom="pool1", top="norm1", local_size=3,
             alpha=0.01, beta=0.75),
        dict(type="sigmoid", name="sig1", bottom="norm1", top="sig1"),
        dict(type="pool", name="pool2", bottom="sig1", top="pool2", pool="ave", kernel=2,
             stride=2),
        dict(type="dropout", name="drop", bottom="pool2", top="pool2", ratio=0.3),
        dict(type="fc", name="fc1", bottom="pool2", top="fc1", num_output=6, **w),
        dict(type="softmax", name="sm1", bottom="fc1", top="sm1"),
        dict(type="fc", name="fc2", bottom="sm1", top="fc2", num_output=5, **w),
        dict(type="softmax_loss", name="loss", bottom=["fc2", "label"], top="loss"),
        dict(type="accuracy", name="acc", bottom=["fc2", "label"], top="acc", phase="test"),
    ]
    raw["data"]["test"] = dict(raw["data"]["train"], num_samples=20, shuffle=False)
    raw["solver"].update(max_iter=5, test_interval=2, display=1)
    return raw


def _train(tmp_path, raw, planned, out, whole_capture=False):
    from purine_mpi.train.trainer import Trainer
    from tests.conftest import FakeWorld
    config = validate_config(dict(raw, memory_plan=planned), check_files=False)
    trainer = Trainer(make_job(config), str(tmp_path / out), world=FakeWorld(), log=lambda m: None)
    try:
        plans = {}
        for ws in (trainer.ws, trainer.test.workspace):
            assert set(ws.device_plans) == ({0} if planned else set())
            for plan in ws.device_plans.values():
                plans.setdefault(ws is trainer.ws, plan)
                for root in plan.offsets:  # stale bytes must never reach a result
                    ws.storage(root).view(np.uint8)[...] = 255
        trainer.run()
        params = {p: np.array(to_numpy(trainer.ws[p])) for p in trainer.graphs.params}
        arena = dict(trainer.ws.device_bytes)
        if whole_capture:  # the planned graphs captured, nothing fell back; only
            for d in (trainer.train, trainer.test):  # Accuracy reads on the host
                report = d.capture_report()
                assert report["captured"] == report["segments"] >= 1, report
                assert report["failed"] == {}, report
                assert set(report["eager_gpu_ops"]) <= {"acc.fwd"}, report
            assert trainer.train.capture_report()["launches_per_iter"] == 1
    finally:
        trainer.close()
    rows = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
    return params, rows, arena, plans


@pytest.mark.parametrize("net,cuda_graph,every_order", [
    ("every_kind", False, False), ("every_kind", True, False), ("tiny", True, False),
    ("every_kind", True, True)])
def test_training_with_the_device_plan_is_bitwise_without_it(
        host_build_dir, monkeypatch, tmp_path, net, cuda_graph, every_order):
    """The net of every kind of layer (batch norm, eltwise, concat, LRN,
    tanh, sigmoid, both poolings, dropout, softmax), eager and with CUDA graphs: the
    training iteration captured whole, one launch, as is the tiny net of the
    CUDA-graph tests; the test graph but its Accuracy. ``every_order``: the
    live peak taken a byte lower, so every order of the colouring runs
    (memory_plan._best_colouring: the squeaks, by breadth, the dynamic
    first fits) and the best of them, with its control edges, is the plan."""
    import json

    import purine_mpi.gpu as gpu
    import purine_mpi.runtime.memory_plan as memory_plan
    emulated_trainer_env(monkeypatch, host_build_dir)
    dynamic = []
    if every_order:
        peak, order = memory_plan._live_peak, memory_plan._dynamic_order
        monkeypatch.setattr(memory_plan, "_live_peak", lambda *a: (peak(*a)[0] - 1, peak(*a)[1]))
        monkeypatch.setattr(memory_plan, "_dynamic_order",
                            lambda *a: dynamic.append(1) or order(*a))
    if net == "tiny":
        raw = tiny_raw(device=0, cuda_graph=True)
        raw["data"]["test"] = dict(raw["data"]["train"], num_samples=20, shuffle=False)
        raw["solver"].update(max_iter=5, test_interval=2, display=1)
    else:
        raw = _every_kind_raw(cuda_graph)
    try:
        base = _train(tmp_path, raw, False, "one_buffer_each", whole_capture=cuda_graph)
        planned = _train(tmp_path, raw, True, "planned", whole_capture=cuda_graph)
    finally:
        gpu.clear_kernel_cache()
    for name, value in base[0].items():
        assert planned[0][name].tobytes() == value.tobytes(), name

    def figures(rows):
        drop = ("time", "timestamp", "images_per_s")
        return [{k: v for k, v in json.loads(r).items() if k not in drop} for r in rows]
    assert figures(planned[1]) == figures(base[1])
    assert any(json.loads(r).get("phase") == "test" for r in planned[1])
    # the plan shrank the arena, and the train and test graphs both had one
    assert planned[2][0] < base[2][0]
    train_plan, test_plan = planned[3][True], planned[3][False]
    assert train_plan.total_bytes < train_plan.unplanned_bytes
    assert train_plan.in_place or net == "tiny"   # the tiny net's ReLU is fused in its conv
    assert test_plan.offsets
    assert bool(dynamic) == every_order


@pytest.mark.gpu
def test_every_kind_net_captures_whole_on_a_real_gpu(tmp_path):
    """Real CuPy: the every-kind net's training iteration is one captured
    graph (batch norm, eltwise, LRN, sigmoid, tanh, poolings, dropout and
    softmax included), its test graph all but Accuracy, and it trains like eager
    stream dispatch, with the memory plan on."""
    cuda_cupy_or_skip()
    eager = _train(tmp_path, _every_kind_raw(False), True, "eager")
    captured = _train(tmp_path, _every_kind_raw(True), True, "captured", whole_capture=True)
    for name, value in eager[0].items():
        np.testing.assert_allclose(captured[0][name], value, rtol=1e-5, atol=1e-6,
                                   err_msg=name)


@pytest.mark.parametrize("micro", [1, 2])
def test_a_bf16_gpt_is_laid_out_in_its_live_peak(micro, monkeypatch, host_build_dir, tmp_path):
    """jobs/gpt_tiny.yaml in bf16 (bits storage) on GPU 0, as ``plan``
    builds it (benchmarks/bf16_traffic.job_graph), at 1 and 2
    micro-batches: its device arena is the planned bytes live at their
    peak (runtime/footprint.arena_peak), with the orders of the colouring
    tried where the three orders' best is above that peak
    (memory_plan._best_colouring). The three alone laid the one
    micro-batch out 1 MiB above (50,595,328 bytes against 49,546,752: the
    last block's residual gradient born as the logits die took bytes the
    peak's units would have packed into), and with the peak-first order
    the two micro-batches 723,456 bytes above (27,542,016 against
    26,818,560; the orders by breadth and the squeaks reach it). The plan
    is sound and no larger than the three orders'."""
    import importlib.util

    import purine_mpi.runtime.memory_plan as memory_plan
    from purine_mpi.runtime.footprint import arena_peak
    from tests.emulated_gpu.helpers import emulated_gpu_env
    from tests.gpt_nets import text_h5
    emulated_gpu_env(monkeypatch, host_build_dir)
    spec = importlib.util.spec_from_file_location(
        "bf16_traffic", os.path.join(ROOT, "benchmarks", "bf16_traffic.py"))
    bt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bt)
    data = text_h5(tmp_path)
    sets = [f"data.train.path={data}", f"data.test.path={data}",
            f"parallel.micro_batches={micro}"]

    def plan(four):
        with monkeypatch.context() as m:
            if not four:
                m.setattr(memory_plan, "_live_peak", lambda units, n_ops, align: (1 << 62, 0),
                          raising=False)
            g = bt.job_graph(os.path.join(ROOT, "jobs", "gpt_tiny.yaml"), sets, "bf16", "1")
            return g, plan_memory(g, keep=batch_blobs(g), order_ops=True, device=0)

    (g, now), (g3, three) = plan(True), plan(False)
    peak = arena_peak(g, now)
    assert now.total_bytes == peak["live_bytes"], (now.total_bytes, peak)
    assert now.total_bytes <= three.total_bytes, (now.total_bytes, three.total_bytes)
    assert three.total_bytes >= arena_peak(g3, three)["live_bytes"]
    _assert_sound_on_device(g, now, 0)
