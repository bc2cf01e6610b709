"""Device scratch planned like host memory (issue 44 item 2): the ops of one
CUDA stream share one scratch slot (the stream runs them one after the
other) even where the graph does not order them; only ops on streams that
may run at once get slots of their own (``Workspace.scratch_for``,
``set_scratch_lanes``). Counted on the emulated device: before, one slot
per convolution the graph does not order (cifar10_quick's and NIN's
backward: data and weight gradients of a layer run unordered); now one per
stream, its size the largest reservation among its ops."""
import numpy as np
import pytest

from purine_mpi.graph import Graph
from purine_mpi.runtime.workspace import Workspace
from tests.conftest import make_job
from tests.emulated_gpu import SimulatedRuntime, net_config, use_emulated_cupy


def _branches():
    g = Graph("branches")
    g.add_blob("x", (3,))
    g.add_op("a", "Scale", ["x"], ["a"], {"scale": 2.0})
    for name in ("b1", "b2", "b3"):
        g.add_op(name, "Scale", ["a"], [name], {"scale": 2.0})
    g.infer_shapes()
    return g


def test_ops_of_one_stream_share_a_slot_sized_by_the_largest():
    ws = Workspace(_branches())
    for name, nbytes in (("a", 256), ("b1", 4096), ("b2", 1024), ("b3", 512)):
        ws.scratch_for(name, 0).reserve(((nbytes,), np.uint8))
    # b1, b2, b3 are unordered: without streams, three slots
    assert [len(ops) for _, ops in ws.scratch_slots()[0]] == [2, 1, 1]
    # b1 and b2 on one stream, b3 on another: two slots
    ws.set_scratch_lanes({"a": (0, "s0"), "b1": (0, "s0"), "b2": (0, "s0"), "b3": (0, "s1")})
    slots = ws.scratch_slots()[0]
    assert slots == [(4096, ["a", "b1", "b2"]), (512, ["b3"])]
    assert ws.scratch_slot("b2", 0) is ws.scratch_slot("a", 0)
    assert ws.scratch_slot("b3", 0) is not ws.scratch_slot("b1", 0)
    # one stream for all: one slot, the largest reservation
    ws.set_scratch_lanes(dict.fromkeys("a b1 b2 b3".split(), (0, "s0")))
    assert ws.scratch_slots()[0] == [(4096, ["a", "b1", "b2", "b3"])]


def test_a_slot_is_shared_across_streams_only_where_the_graph_orders():
    ws = Workspace(_branches())
    for name in ("a", "b1", "b2", "b3"):
        ws.scratch_for(name, 0).reserve(((256,), np.uint8))
    # a on s1 runs before every b: the b's of s0 may join it, but b3 of s1
    # may not join b1 and b2 of s0
    ws.set_scratch_lanes({"a": (0, "s1"), "b1": (0, "s0"), "b2": (0, "s0"), "b3": (0, "s1")})
    assert [ops for _, ops in ws.scratch_slots()[0]] == [["a", "b1", "b2"], ["b3"]]


@pytest.mark.parametrize("net", ["cifar10_quick", "nin_cifar10"])
@pytest.mark.parametrize("cuda_graph", [True, False])
def test_the_nets_take_one_slot_per_stream(net, cuda_graph, monkeypatch, host_build_dir):
    """The trainer's graph and workspace on the emulated device (im2col
    path: its columns are the scratch): one slot per stream of
    scratch-using ops (one here), as large as the largest; before, one per
    convolution the graph does not order, more bytes in all."""
    use_emulated_cupy(monkeypatch, host_build_dir)
    monkeypatch.setenv("PURINE_CONV", "im2col")
    from purine_mpi.job.replica import build_train_graph
    from purine_mpi.parallel.placement import prepare_for_device
    from purine_mpi.runtime.factory import make_dispatcher, planned_workspace
    from purine_mpi.runtime.memory_plan import batch_blobs
    graph, _ = build_train_graph(make_job(net_config(net, 8)))
    prepare_for_device(graph, 0)
    ws = planned_workspace(graph, keep=batch_blobs(graph))
    d = make_dispatcher(graph, runtime=SimulatedRuntime(1), workspace=ws,
                        cuda_graph=cuda_graph)
    try:
        after = ws.scratch_slots()[0]
        lanes = ws.scratch_lanes
        users = [n for _, ops in after for n in ops]
        reserved = {n: ws.scratch_for(n, 0).reserved for n in users}
        assert len(after) == len({lanes[n] for n in users if reserved[n]}) == 1
        assert after[0][0] == max(reserved.values())
        ws.set_scratch_lanes(None)                      # the graph's order alone
        before = ws.scratch_slots()[0]
        convs = [n for n in users if graph.ops[n].op_type.startswith("Conv")]
        assert len(before) > len(after) and len(before) >= 3
        assert sum(b for b, _ in before) > after[0][0]
        # each slot of the order-only rule holds ops the graph orders pairwise
        for _, ops in before:
            for i, u in enumerate(ops):
                assert all(u in ws._ancestors(v) for v in ops[i + 1:])
        assert len(convs) >= 6
        d.run(0)   # the scratch is taken (and sized) as bound
        assert sum(ws.scratch_bytes.values()) == sum(b for b, _ in before if b)
    finally:
        d.close()


@pytest.mark.parametrize("lanes", [
    None,
    {"a": (0, "s0"), "b1": (0, "s0"), "b2": (0, "s0"), "b3": (0, "s1")},
    {"a": (0, "s1"), "b1": (0, "s0"), "b2": (0, "s0"), "b3": (0, "s1")}])
def test_the_static_plan_binds_the_slots_as_the_workspace_does(lanes):
    """``scratch_plan`` (what ``plan`` counts before anything is allocated)
    and the workspace's binding share ``slot_for``: same slots, same sizes."""
    from purine_mpi.runtime.workspace import ancestors_in, scratch_plan
    g = _branches()
    needs = {"a": 256, "b1": 4096, "b2": 1024, "b3": 512}
    ws = Workspace(g)
    for name, nbytes in needs.items():
        ws.scratch_for(name, 0).reserve(((nbytes,), np.uint8))
    ws.set_scratch_lanes(lanes)
    deps, cache = g.dependencies(), {}
    planned = scratch_plan(needs, lanes or {}, lambda n: ancestors_in(deps, cache, n))
    assert planned == ws.scratch_slots()[0]
    assert len(planned) == (3 if lanes is None else 2)
