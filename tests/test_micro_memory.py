"""The micro-batch memory plan (parallel/micro_memory.py): under 1F1B stage
s of p allocates the activations of min(p − s, M) micro-batches, not M
(gradient accumulation on one stage: 1), the copies that share a buffer
are ordered by control edges, a plan the schedule cannot honour is refused
(a cycle, not a race), and training is bitwise the same as without it."""
import re

import numpy as np
import pytest

from purine_mpi.base.errors import GraphError
from purine_mpi.tools.graph import compose_for
from purine_mpi.job.config import resolve_config
from purine_mpi.parallel.micro_memory import (activation_bytes, copy_index, live_slots,
                                              plan_micro_batch_memory, shareable_roots)
from purine_mpi.runtime.workspace import Workspace
from tests.conftest import make_job
from tests.mpi_scripts.launch import run_mpi
from tests.test_micro_batches import STAGES, _config


def _slice(np_, rank, **parallel):
    return compose_for(make_job(_config(**parallel)), np_, rank)


def _per_copy_bytes(graph):
    """Bytes of one copy's shareable blobs (copy 0 always owns its buffers)."""
    return sum(graph.blobs[n].nbytes for n in shareable_roots(graph)[0])


def test_live_slots():
    assert [live_slots("1f1b", 2, s, 4) for s in (0, 1)] == [2, 1]
    assert [live_slots("1f1b", 4, s, 2) for s in range(4)] == [2, 2, 2, 1]
    assert live_slots("1f1b", 1, 0, 4) == 1  # gradient accumulation
    assert live_slots("gpipe", 2, 0, 4) == 4


@pytest.mark.parametrize("np_,parallel,slots", [
    (2, {"scheme": "pipeline", "stages": STAGES}, [2, 1]),
    (4, {"scheme": "hybrid", "stages": STAGES}, [2, 1, 2, 1]),
    (1, {"scheme": "data"}, [1]),
    (2, {"scheme": "data"}, [1, 1]),
])
def test_workspace_allocates_live_micro_batches_only(np_, parallel, slots):
    """Real allocation: 1F1B's workspace is smaller than GPipe's by exactly
    (M − L) copies of the activations, L = p − s (the trace's live peak)."""
    m = 4
    for rank in range(np_):
        one = _slice(np_, rank, micro_batches=m, schedule="1f1b", **parallel)
        gp = _slice(np_, rank, micro_batches=m, schedule="gpipe", **parallel)
        per_copy = _per_copy_bytes(gp)
        assert per_copy > 0 and _per_copy_bytes(one) == per_copy
        assert activation_bytes(gp) == m * per_copy
        assert activation_bytes(one) == slots[rank] * per_copy
        assert one.memory_plan["saved_bytes"] == (m - slots[rank]) * per_copy
        assert gp.memory_plan["shared"] == []
        ws_one, ws_gp = Workspace(one), Workspace(gp)
        assert ws_gp.allocated_bytes - ws_one.allocated_bytes == (m - slots[rank]) * per_copy
        assert activation_bytes(one, ws_one) == activation_bytes(one)
        assert activation_bytes(gp, ws_gp) == activation_bytes(gp)
        # copy k's blobs view copy k mod L's buffers; weights are never shared
        for name in one.memory_plan["shared"]:
            k = copy_index(name)
            root = one.storage_root(name)
            assert k >= slots[rank] and copy_index(root) == k % slots[rank]
            assert root in one.blobs and one.blobs[root].alias_of is None
            assert ws_one.storage(name) is ws_one.storage(root)
        assert not any(b.alias_of and copy_index(b.alias_of) is not None
                       for b in one.blobs.values() if b.kind in ("param", "state"))


def test_losses_and_weight_gradients_keep_their_own_buffers():
    g = _slice(1, 0, scheme="data", micro_batches=4)
    kept = [n for n in g.blobs if copy_index(n) is not None and n not in g.memory_plan["shared"]
            and copy_index(n) > 0 and g.blobs[n].alias_of is None]
    assert any(n.startswith("loss@") for n in kept)
    assert any("weight" in n for n in kept)  # per-copy weight gradients, summed at the end
    shared = g.memory_plan["shared"]
    assert not any(n.startswith("loss@") or "weight" in n or "bias" in n for n in shared)


def test_copy_waits_for_the_previous_copy_in_its_slot():
    """Stage 1 (one slot): the Recv of copy k writes the buffer only after
    every op of copy k − 1 that touches it (its backward) has finished."""
    g = _slice(2, 1, scheme="pipeline", stages=STAGES, micro_batches=4, schedule="1f1b")
    deps = g.dependencies()
    recv = g.ops["pool1@mb2.recv"]
    assert g.blobs["pool1@mb2"].alias_of == "pool1@mb0"  # the buffer of copy 2 mod 1
    readers = [op.name for op in g.ops.values() if "pool1@mb1" in op.inputs]
    assert readers and any(".bwd." in r for r in readers)
    assert set(readers) <= set(recv.control_inputs)
    assert set(readers) <= deps[recv.name]


def test_graph_text_states_the_plan():
    from purine_mpi.tools.graph import render_graph
    cfg = resolve_config(_config(scheme="pipeline", stages=STAGES, micro_batches=4))
    text = render_graph(make_job(cfg), 2, 0)
    g = _slice(2, 0, scheme="pipeline", stages=STAGES, micro_batches=4)
    assert (f"memory plan: micro-batch activations in 2 slot(s), {len(g.memory_plan['shared'])} "
            f"blob(s) reuse an earlier copy's buffer, {activation_bytes(g)} bytes allocated, "
            f"{g.memory_plan['saved_bytes']} saved") in text
    assert "memory plan" not in render_graph(make_job(_config(scheme="data")), 1, 0)


def test_a_plan_the_schedule_cannot_honour_is_refused():
    """GPipe runs forward 1 before backward 0: sharing one buffer would make
    the forward wait for the backward after it; the plan says so instead of
    racing."""
    g = _slice(1, 0, scheme="data", micro_batches=4, schedule="gpipe")
    with pytest.raises(GraphError, match="wait on itself.*cycle"):
        plan_micro_batch_memory(g, 1)


@pytest.mark.mpi
@pytest.mark.parametrize("n,scheme,micro,schedule", [
    (1, "data", 4, "1f1b"),
    (2, "data", 4, "1f1b"),      # the deferred update: read after drain()
    (2, "pipeline", 4, "1f1b"),
    (2, "pipeline", 4, "gpipe"),
    (3, "pipeline3", 4, "1f1b"),
    (4, "hybrid", 4, "1f1b"),
])
def test_training_is_bitwise_the_same_without_the_plan(n, scheme, micro, schedule):
    """Losses, weights and momenta after each of 4 iterations, with the plan
    and without it (mpi_scripts/memory_plan_equiv.py)."""
    proc, _ = run_mpi("memory_plan_equiv.py", n, scheme, micro, schedule, 4, timeout=120)
    # the ranks' lines may interleave on the shared stdout
    lines = re.findall(r"OK memory_plan shared (\d+) act \d+/\d+ alloc \d+/\d+ rank (\d+)",
                       proc.stdout)
    assert sorted(int(r) for _, r in lines) == list(range(n)), proc.stdout + proc.stderr
    shared = [int(s) for s, _ in lines]
    if schedule == "gpipe":
        assert shared == [0] * n
    else:
        assert all(s > 0 for s in shared), lines


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_plan_on_the_emulated_gpu_is_bitwise_the_same(tmp_path, monkeypatch, host_build_dir,
                                                      cuda_graph):
    """Gradient accumulation (M = 4, one slot) placed and fused on GPU 0
    (emulated CuPy, simulated streams; tests/test_cuda_graph.py), dropout
    and LRN included: the planned blobs live in the device arena and in the
    pinned host blobs of the data copies, and the stream dispatcher (eager
    or replaying captured graphs) trains bitwise like without the plan."""
    import purine_mpi.parallel.compose as compose
    from purine_mpi.job.config import validate_config
    from purine_mpi.train.trainer import Trainer
    from tests.emulated_gpu import emulated_gpu_env
    from tests.emulated_gpu import tiny_raw
    emulated_gpu_env(monkeypatch, host_build_dir)
    raw = tiny_raw(device=0, cuda_graph=cuda_graph)
    raw["parallel"] = {"scheme": "data", "micro_batches": 4, "schedule": "1f1b"}

    def train(whole_graph_plan=False):
        # the micro-batch plan alone (``memory_plan: false`` turns off the
        # whole-graph plan of the host and the GPU arena, which would pack
        # the same transient blobs again), then both together
        config = validate_config(dict(raw, memory_plan=whole_graph_plan), check_files=False)
        t = Trainer(make_job(config), str(tmp_path / "unused"), log=lambda m: None)
        try:
            losses = []
            for it in range(4):
                t.step(it)
                t.train.drain()  # on a GPU a step returns unsynchronised: wait to read
                losses.append([float(t.ws[b]) for b in t.graphs.losses])
            g = t.graphs
            return (losses, {p: np.array(t.ws[p]) for p in g.params}, g.memory_plan,
                    t.ws.allocated_bytes, g.graph)
        finally:
            t.close()

    got, both = train(), train(whole_graph_plan=True)
    monkeypatch.setattr(compose, "plan_memory", lambda *a, **k: None)
    ref = train()
    assert both[3] < got[3] and both[0] == ref[0]
    for name, value in ref[1].items():
        np.testing.assert_array_equal(both[1][name], value, err_msg=name)
    plan, graph = got[2], got[4]
    assert ref[2] is None and plan["slots"] == 1 and plan["shared"]
    assert any(graph.blobs[n].location.device == 0 for n in plan["shared"])
    # the device arena rounds each blob up to ARENA_ALIGN bytes
    from purine_mpi.runtime.workspace import ARENA_ALIGN
    saved = sum(-(-graph.blobs[n].nbytes // ARENA_ALIGN) * ARENA_ALIGN
                if graph.blobs[n].location.device >= 0 else graph.blobs[n].nbytes
                for n in plan["shared"])
    assert ref[3] - got[3] == saved > 0
    assert got[0] == ref[0]
    for name, value in ref[1].items():
        np.testing.assert_array_equal(got[1][name], value, err_msg=name)
