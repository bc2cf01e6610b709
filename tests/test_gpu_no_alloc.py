"""No device allocation in a steady-state training iteration: every op
writes into its planned outputs and its planned scratch (Workspace.scratch_for).

- emulated device (any machine): the emulated CuPy arrays log every array
  that gets fresh memory (tests/emulated_gpu, ``Allocations``): a
  ufunc result without ``out=``, a copy, a NumPy function's new array, an
  ``empty``/``zeros``/``asarray``. Three nets (the tiny test net, and
  jobs/cifar10_quick.yaml and jobs/nin_cifar10.yaml at batch 2) run placed
  and fused on the simulated stream runtime; the third iteration allocates
  nothing. This sees what our code allocates, not what CuPy does inside.
- real GPU (marked ``gpu``): every allocation from CuPy's memory pool, on
  every thread (a process-wide allocator that counts), during a steady-state
  iteration of cifar10_quick and NIN at batch 16, with and without CUDA
  graphs: zero.
"""

import numpy as np
import pytest

from purine_mpi.parallel.placement import prepare_for_device
from purine_mpi.job.replica import build_train_graph
from purine_mpi.runtime.factory import make_dispatcher
from tests.conftest import cuda_cupy_or_skip, make_job
from tests.emulated_gpu import Allocations, SimulatedRuntime, init_params, net_config

NETS = ["tiny", "cifar10_quick", "nin_cifar10"]


@pytest.fixture
def emulated(emulated):
    """The shared fixture's (tests/emulated_gpu/fixtures.py), allocation
    counting off after the test."""
    yield emulated
    Allocations.counting = False


def _counted_iteration(d, iterations=3):
    """Allocations logged during the last of ``iterations`` iterations."""
    for it in range(iterations):
        d.workspace["iter"][...] = it
        Allocations.log = []
        Allocations.counting = it == iterations - 1
        try:
            d.run(it)
        finally:
            Allocations.counting = False
    return list(Allocations.log)


@pytest.mark.parametrize("net", NETS)
def test_steady_state_iteration_allocates_nothing_on_the_emulated_device(emulated, net):
    graph, _ = build_train_graph(make_job(net_config(net, 2)))
    prepare_for_device(graph, 0)
    d = make_dispatcher(graph, runtime=SimulatedRuntime(2), seed=1, cuda_graph=False)
    try:
        init_params(d.workspace, graph, 3)
        log = _counted_iteration(d)
        assert log == [], f"{net}: device allocations in a steady-state iteration: {log}"
        assert np.isfinite(float(d.workspace["loss"]))
        # the scratch (im2col columns, GEMM partials, loss terms) was planned
        assert sum(d.workspace.scratch_bytes.values()) > 0
    finally:
        d.close()


@pytest.mark.parametrize("storage", ["1", "0"])
def test_a_bf16_gpt_steady_iteration_allocates_nothing(emulated, monkeypatch, storage):
    """The 2-block test GPT in bf16, placed and fused, with bits storage
    (``PURINE_BF16_STORAGE=1``: the products' operands as bits, GELU's
    gradient, the residual gradients' sums and ln_f's gradient writing
    their float32 output's bits beside it, ``fold_copies``) and without: the third
    iteration allocates nothing on the emulated device."""
    from tests.emulated_gpu.helpers import fill
    from tests.gpt_oracle import gpt_graph, gpt_net
    from tests.test_precision import SOLVER
    monkeypatch.setenv("PURINE_BF16_STORAGE", storage)
    net = gpt_net(vocab=16, width=16, heads=2, blocks=2, max_length=8, approximate="tanh")
    graph, _, _ = gpt_graph(net, dict(SOLVER, max_iter=3), 2, 8)
    prepare_for_device(graph, 0, precision="bf16")
    copies = {op.op_type for op in graph.ops.values() if op.attrs.get("bits_copy")}
    assert copies == ({"GeluGrad", "Sum", "LayerNormGrad"} if storage == "1" else set())
    d = make_dispatcher(graph, runtime=SimulatedRuntime(1), seed=1, cuda_graph=False)
    tokens = np.random.default_rng(3).integers(0, 16, (2, 9))
    try:
        for p in graph.params():
            d.workspace.set(p.name, fill(p, 1))
        d.workspace.set("data", tokens[:, :-1].astype(np.int32))
        d.workspace.set("label", tokens[:, 1:].astype(np.int32))
        log = _counted_iteration(d)
        assert log == [], f"device allocations in a steady-state iteration: {log}"
        assert np.isfinite(float(d.workspace["loss"]))
    finally:
        d.close()


def _probe_loss_graph():
    """WeightedSum, the tests' probe loss: sum(x * w) through xp, a product
    and a reduction into new arrays (no raw kernel) -- an op that allocates."""
    from purine_mpi.graph import Graph
    from purine_mpi.graph.core import Location
    g = Graph("probe")
    g.add_blob("x", (4, 5), location=Location(0, 0))
    g.add_blob("w", (4, 5), location=Location(0, 0))
    g.add_blob("iter", (), "int64", kind="iter")
    g.add_op("probe", "WeightedSum", ["x", "w"], ["loss"], location=Location(0, 0))
    g.infer_shapes()
    return g


def test_the_emulated_count_sees_temporaries(emulated):
    """The check can fail: an op that computes with temporaries is caught."""
    d = make_dispatcher(_probe_loss_graph(), runtime=SimulatedRuntime(0), cuda_graph=False)
    try:
        d.workspace.set("x", np.arange(20.0, dtype=np.float32).reshape(4, 5))
        d.workspace.set("w", np.ones((4, 5), np.float32))
        log = _counted_iteration(d)
        assert log and {what for what, _, _ in log} >= {"multiply.__call__"}
    finally:
        d.close()


def test_a_capture_that_fails_names_the_op_and_runs_eagerly(emulated):
    """The same op with CUDA graphs on: its capture fails on the first new
    array, the note and the capture report name the op (so the user knows
    which op keeps the step from being one graph), and the iterations run
    eagerly with the right values."""
    notes = []
    d = make_dispatcher(_probe_loss_graph(), runtime=SimulatedRuntime(0), cuda_graph=True,
                        log=notes.append)
    try:
        x = np.arange(20.0, dtype=np.float32).reshape(4, 5)
        d.workspace.set("w", np.full((4, 5), 0.5, np.float32))
        for it in range(3):
            d.workspace.set("x", x + it)
            d.run(it)
            assert float(d.workspace["loss"]) == 0.5 * float((x + it).sum())
        report = d.capture_report()
    finally:
        d.close()
    assert report["captured"] == 0 and report["eager_ops_per_iter"] == 1
    (why,) = report["failed"].values()
    assert why.startswith("op 'probe' (WeightedSum): RuntimeError: ") and "without out=" in why, \
        why
    assert any("could not capture" in n and "op 'probe' (WeightedSum)" in n for n in notes), notes


def test_scratch_is_shared_only_by_ordered_ops():
    """Workspace.scratch_for: an op reuses the buffer of an ancestor, never
    that of an op it may run concurrently with."""
    from purine_mpi.graph import Graph
    from purine_mpi.runtime.workspace import Workspace
    g = Graph("branches")
    g.add_blob("x", (3,))
    g.add_op("a", "Scale", ["x"], ["a"], {"scale": 2.0})
    g.add_op("b1", "Scale", ["a"], ["b1"], {"scale": 2.0})
    g.add_op("b2", "Scale", ["a"], ["b2"], {"scale": 2.0})
    g.add_op("c", "Sum", ["b1", "b2"], ["c"])
    g.infer_shapes()
    ws = Workspace(g)
    for name in ("a", "b1", "b2", "c"):   # the setups, in a topological order
        ws.scratch_for(name, 0)
    sa = ws.scratch_slot("a", 0)
    sb1 = ws.scratch_slot("b1", 0)
    sb2 = ws.scratch_slot("b2", 0)
    sc = ws.scratch_slot("c", 0)
    assert sb1 is sa          # a runs before b1
    assert sb2 is not sb1     # b1 and b2 may run at once
    assert sc in (sb1, sb2)   # both run before c
    assert ws.scratch_slot("b1", 0) is sb1


# ---------------------------------------------------------------- real GPU

def _gpu_allocations(cupy, d, iterations=4):
    """Pool allocations (any thread) during the last of ``iterations``."""
    pool = cupy.get_default_memory_pool()
    sizes = []

    def counting(size):
        sizes.append(size)
        return pool.malloc(size)

    for it in range(iterations):
        d.workspace["iter"][...] = it
        last = it == iterations - 1
        if last:
            cupy.cuda.Device().synchronize()
            cupy.cuda.set_allocator(counting)
        try:
            d.run(it)
        finally:
            if last:
                cupy.cuda.set_allocator(pool.malloc)
    return sizes


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "cuda_graph"])
@pytest.mark.parametrize("net", ["cifar10_quick", "nin_cifar10"])
def test_steady_state_iteration_allocates_nothing_on_the_gpu(net, cuda_graph):
    cupy = cuda_cupy_or_skip()
    graph, _ = build_train_graph(make_job(net_config(net, 16)))
    prepare_for_device(graph, 0)
    d = make_dispatcher(graph, seed=1, cuda_graph=cuda_graph)
    try:
        init_params(d.workspace, graph, 3)
        sizes = _gpu_allocations(cupy, d)
        assert sizes == [], f"{net}: {len(sizes)} device allocations ({sum(sizes)} bytes)"
        assert np.isfinite(float(d.workspace["loss"]))
    finally:
        d.close()
