"""The bi-graph: validation messages, pruning, and write-after-read ordering."""
import random

import pytest

from purine_mpi.base.errors import GraphError, ShapeError, UserError
from purine_mpi.graph import Graph
from purine_mpi.job.replica import build_train_graph
from tests.conftest import make_job

S = (2, 3)


def leaf(g, name, shape=S):
    g.add_blob(name, shape)
    return name


# ----------------------------------------------------------------- validation
def test_unknown_op_type_names_op_and_type():
    g = Graph()
    leaf(g, "x")
    g.add_op("mystery", "NoSuchOpType", ["x"], ["y"])
    with pytest.raises(GraphError) as info:
        g.validate()
    msg = str(info.value)
    assert "mystery" in msg and "NoSuchOpType" in msg
    assert "Relu" in msg  # lists the known types so the user can fix the typo
    assert isinstance(info.value, UserError)  # exit status 2 from the CLI


def test_dangling_input_names_op_and_blob():
    g = Graph()
    leaf(g, "x")
    g.add_op("add", "Sum", ["x", "ghost"], ["y"])
    with pytest.raises(GraphError) as info:
        g.validate()
    msg = str(info.value)
    assert "add" in msg and "ghost" in msg and "dangling" in msg


def test_source_blob_with_declared_size_is_not_dangling():
    g = Graph()
    leaf(g, "x")
    g.add_op("r", "Relu", ["x"], ["y"])
    g.validate()
    g.infer_shapes()
    assert g.blobs["y"].shape == S


def test_double_writer_without_accumulate_is_an_error():
    g = Graph()
    leaf(g, "a")
    leaf(g, "b")
    g.add_op("w1", "Copy", ["a"], ["y"])
    g.add_op("w2", "Copy", ["b"], ["y"])
    with pytest.raises(GraphError) as info:
        g.validate()
    msg = str(info.value)
    assert "'y'" in msg and "w1" in msg and "w2" in msg and "accumulate" in msg


def test_double_writer_with_accumulate_on_one_only_is_an_error():
    g = Graph()
    leaf(g, "a")
    leaf(g, "b")
    g.add_op("w1", "Copy", ["a"], ["y"], accumulate=True)
    g.add_op("w2", "Copy", ["b"], ["y"])
    with pytest.raises(GraphError, match="accumulate"):
        g.validate()


def test_double_writer_with_accumulate_on_all_is_allowed():
    g = Graph()
    leaf(g, "a")
    leaf(g, "b")
    g.add_op("w1", "Copy", ["a"], ["y"], accumulate=True)
    g.add_op("w2", "Copy", ["b"], ["y"], accumulate=True)
    g.add_op("r", "Relu", ["y"], ["z"])
    g.validate()
    g.infer_shapes()
    deps = g.dependencies()
    assert deps["r"] == {"w1", "w2"}  # a reader waits for every accumulating writer


def test_cycle_names_the_ops_on_it():
    g = Graph()
    leaf(g, "src")
    g.add_op("before", "Relu", ["src"], ["s"])
    g.add_op("loop_a", "Sum", ["s", "x"], ["y"])
    g.add_op("loop_b", "Relu", ["y"], ["x"])
    # many ops downstream of the cycle, named so they sort before the cycle ops
    prev = "y"
    for i in range(12):
        g.add_op(f"after{i:02d}", "Relu", [prev], [f"d{i}"])
        prev = f"d{i}"
    with pytest.raises(GraphError) as info:
        g.validate()
    msg = str(info.value)
    assert "cycle" in msg
    assert "loop_a" in msg and "loop_b" in msg
    assert "before" not in msg  # upstream ops are not on the cycle
    assert "after00" not in msg  # nor are the ops downstream of it


def test_self_cycle_through_control_inputs():
    g = Graph()
    leaf(g, "x")
    g.add_op("p", "Relu", ["x"], ["y"], control_inputs=["q"])
    g.add_op("q", "Relu", ["y"], ["z"])
    with pytest.raises(GraphError) as info:
        g.topo_order()
    assert "p" in str(info.value) and "q" in str(info.value)


def test_unknown_control_input_is_reported():
    g = Graph()
    leaf(g, "x")
    g.add_op("p", "Relu", ["x"], ["y"], control_inputs=["nobody"])
    with pytest.raises(GraphError, match="nobody"):
        g.topo_order()


def test_shape_mismatch_names_op_and_blobs():
    g = Graph()
    leaf(g, "left", (2, 3))
    leaf(g, "right", (3, 2))
    g.add_op("adder", "Sum", ["left", "right"], ["out"])
    with pytest.raises(ShapeError) as info:
        g.infer_shapes()
    msg = str(info.value)
    assert "adder" in msg and "left" in msg and "right" in msg
    assert "[2, 3]" in msg and "[3, 2]" in msg


def test_declared_output_shape_that_disagrees_names_op_and_blob():
    g = Graph()
    leaf(g, "x", (2, 3))
    g.add_blob("y", (4, 4))
    g.add_op("act", "Relu", ["x"], ["y"])
    with pytest.raises(ShapeError) as info:
        g.infer_shapes()
    msg = str(info.value)
    assert "act" in msg and "'y'" in msg and "[2, 3]" in msg and "[4, 4]" in msg


def test_duplicate_names_are_errors():
    g = Graph()
    leaf(g, "x")
    with pytest.raises(GraphError, match="'x'"):
        g.add_blob("x", S)
    g.add_op("r", "Relu", ["x"], ["y"])
    with pytest.raises(GraphError, match="'r'"):
        g.add_op("r", "Relu", ["x"], ["z"])


# -------------------------------------------------------------------- pruning
def _ancestors(graph, sinks):
    """Independent reference: ops reachable backwards from ``sinks`` through
    data edges (blob -> its writers -> their inputs)."""
    writers = {}
    for op in graph.ops.values():
        for b in op.outputs:
            writers.setdefault(b, []).append(op.name)
    keep, stack = set(), []
    for s in sinks:
        stack.extend([s] if s in graph.ops else writers.get(s, []))
    while stack:
        n = stack.pop()
        if n in keep:
            continue
        keep.add(n)
        for b in graph.ops[n].inputs:
            stack.extend(writers.get(b, []))
    return keep


def _random_graph(rng, n_ops=25):
    g = Graph("rand")
    avail = [leaf(g, f"in{i}") for i in range(3)]
    for i in range(n_ops):
        kind = rng.choice(["Relu", "Tanh", "Copy", "Sum"])
        k = rng.randint(2, 3) if kind == "Sum" else 1
        ins = rng.sample(avail, min(k, len(avail)))
        out = f"b{i}"
        g.add_op(f"op{i}", kind, ins, [out])
        avail.append(out)
    g.infer_shapes().validate()
    return g


def test_prune_keeps_exactly_what_sinks_need():
    g = Graph()
    g.add_op("a", "Constant", [], ["A"], {"shape": list(S), "value": 1.0})
    g.add_op("b", "Relu", ["A"], ["B"])
    g.add_op("c", "Tanh", ["A"], ["C"])
    g.add_op("d", "Sum", ["B", "C"], ["D"])
    g.add_op("e", "Copy", ["C"], ["E"])
    g.add_op("f", "Relu", ["E"], ["F"])
    g.add_op("u", "Constant", [], ["U"], {"shape": list(S), "value": 2.0})
    g.add_op("v", "Relu", ["U"], ["V"])
    g.infer_shapes().validate()
    p = g.prune(["D"])
    assert set(p.ops) == {"a", "b", "c", "d"}
    assert set(p.blobs) == {"A", "B", "C", "D"}
    p = g.prune(["F"])
    assert set(p.ops) == {"a", "c", "e", "f"}
    assert set(p.blobs) == {"A", "C", "E", "F"}
    p = g.prune(["f", "V"])  # an op name works as a sink too
    assert set(p.ops) == {"a", "c", "e", "f", "u", "v"}
    # the pruned graph is a working graph in the original emission order
    assert list(p.ops) == [n for n in g.ops if n in p.ops]
    p.validate()
    with pytest.raises(GraphError, match="nowhere"):
        g.prune(["nowhere"])


def test_prune_random_graphs_against_reference():
    rng = random.Random(7)
    for _ in range(20):
        g = _random_graph(rng)
        blobs = [b for b in g.blobs if not b.startswith("in")]
        sinks = rng.sample(blobs, rng.randint(1, 3))
        p = g.prune(sinks)
        expect = _ancestors(g, sinks)
        assert set(p.ops) == expect
        used = {b for n in expect for b in g.ops[n].inputs + g.ops[n].outputs}
        assert set(p.blobs) == used | set(sinks)
        p.validate()


def test_prune_follows_control_inputs():
    g = Graph()
    leaf(g, "x")
    g.add_op("side", "Relu", ["x"], ["s"])
    g.add_op("main", "Tanh", ["x"], ["m"], control_inputs=["side"])
    g.add_op("other", "Copy", ["x"], ["o"], control_inputs=["side"])
    g.infer_shapes()
    p = g.prune(["m"])
    assert set(p.ops) == {"side", "main"}
    assert p.ops["main"].control_inputs == ["side"]


# ------------------------------------------------------- write-after-read
def _alias_graph(reader_downstream=False):
    """w (state) is read by two ops on other threads; ``upd`` writes w@new."""
    g = Graph()
    g.add_blob("w", S, kind="param")
    g.add_blob("w@new", S, kind="param", alias_of="w")
    leaf(g, "x")
    g.add_op("read1", "Sum", ["w", "x"], ["y1"], thread=1)
    g.add_op("read2", "Tanh", ["w"], ["y2"], thread=2)
    g.add_op("upd", "Scale", ["x"], ["w@new"], {"scale": 2.0}, thread=3)
    if reader_downstream:
        # reads the updated storage through w@new's result: must not get a
        # write-after-read edge (that would make a cycle)
        g.add_op("after", "Sum", ["w@new", "w"], ["z"], thread=1)
    return g.infer_shapes()


def test_alias_writer_waits_for_every_reader():
    g = _alias_graph()
    deps = g.dependencies()
    assert {"read1", "read2"} <= deps["upd"]
    order = [op.name for op in g.topo_order()]
    assert order.index("upd") > max(order.index("read1"), order.index("read2"))


def test_reader_downstream_of_alias_writer_gets_no_war_edge():
    g = _alias_graph(reader_downstream=True)
    g.validate()
    deps = g.dependencies()
    assert "after" not in deps["upd"]
    assert "upd" in deps["after"]


def test_non_overlapping_alias_gets_no_war_edge():
    g = Graph()
    g.add_blob("buf", (8,))
    g.add_blob("lo", (4,), alias_of="buf", offset=0)
    g.add_blob("hi", (4,), alias_of="buf", offset=4)
    g.add_blob("hi@new", (4,), alias_of="buf", offset=4)
    g.add_op("read_lo", "Relu", ["lo"], ["a"])
    g.add_op("read_hi", "Relu", ["hi"], ["b"])
    g.add_op("write_hi", "Scale", ["a"], ["hi@new"], {"scale": 1.0})
    g.infer_shapes()
    deps = g.dependencies()
    assert "read_hi" in deps["write_hi"]  # overlaps
    assert deps["write_hi"] == {"read_lo", "read_hi"}  # read_lo only as data edge (a)
    g2 = Graph()
    g2.add_blob("buf", (8,))
    g2.add_blob("lo", (4,), alias_of="buf", offset=0)
    g2.add_blob("hi@new", (4,), alias_of="buf", offset=4)
    g2.add_blob("x", (4,))
    g2.add_op("read_lo", "Relu", ["lo"], ["a"])
    g2.add_op("write_hi", "Scale", ["x"], ["hi@new"], {"scale": 1.0})
    g2.infer_shapes()
    assert g2.dependencies()["write_hi"] == set()  # disjoint ranges: no edge


def _reachable_back(deps, start):
    seen, stack = set(), [start]
    while stack:
        for p in deps[stack.pop()]:
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def test_sgd_update_runs_after_every_reader_of_its_param():
    raw = {
        "name": "war",
        "data": {"train": {"source": "synthetic", "shape": [2, 6, 6], "classes": 5,
                           "batch_size": 4}},
        "net": [
            {"type": "conv", "name": "conv1", "bottom": "data", "top": "conv1",
             "num_output": 3, "kernel": 3},
            {"type": "relu", "name": "relu1", "bottom": "conv1", "top": "conv1"},
            {"type": "fc", "name": "fc1", "bottom": "conv1", "top": "fc1", "num_output": 6},
            {"type": "tanh", "name": "t", "bottom": "fc1", "top": "fc1"},
            {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2", "num_output": 5},
            {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"],
             "top": "loss"},
        ],
        "solver": {"base_lr": 0.1, "max_iter": 1},
    }
    g, grads = build_train_graph(make_job(raw))
    deps = g.dependencies()
    order = [op.name for op in g.topo_order()]
    updates = [op for op in g.ops.values() if op.op_type == "SGDUpdate"]
    assert {op.inputs[0] for op in updates} == {"conv1/weight", "conv1/bias", "fc1/weight",
                                                "fc1/bias", "fc2/weight", "fc2/bias"}
    checked = 0
    for upd in updates:
        param = upd.inputs[0]
        before = _reachable_back(deps, upd.name)
        readers = [op.name for op in g.ops.values()
                   if op.name != upd.name and param in op.inputs]
        # the forward op and the data-gradient op (for fc2, fc1, conv1 weights) read it
        assert readers, param
        for r in readers:
            assert r in before, f"{upd.name} may run before {r} reads {param}"
            assert order.index(r) < order.index(upd.name)
            checked += 1
    assert checked >= 8


# ------------------------------------------------------------ seed format
def test_seed_yaml_round_trip_is_exact():
    import yaml

    from purine_mpi.graph import seed_yaml
    from purine_mpi.graph.core import Location
    g = _alias_graph(reader_downstream=True)
    g.add_op("acc1", "Copy", ["x"], ["sum"], accumulate=True, thread="io",
             location=Location(rank=1, device=0))
    g.add_op("acc2", "Copy", ["y2"], ["sum"], accumulate=True, control_inputs=["read1"])
    g.blobs["w"].attrs["filler"] = {"type": "gaussian", "std": 0.5}
    g.infer_shapes().validate()
    text = yaml.safe_dump(seed_yaml.dump(g))
    back = seed_yaml.load(yaml.safe_load(text), "<test>", g.name)
    assert list(back.blobs) == list(g.blobs) and list(back.ops) == list(g.ops)
    for name, blob in g.blobs.items():
        assert back.blobs[name] == blob, name
    for name, op in g.ops.items():
        assert back.ops[name] == op, name
    assert back.dependencies() == g.dependencies()


def test_dependencies_follow_every_edit_in_place():
    """``dependencies`` keeps its last answer for an unchanged graph: every
    edit in place of a field it reads (an op's inputs, outputs, control
    inputs; a blob's alias, offset, shape; an op or blob added, removed or
    replaced) gives the answer a fresh computation gives, and a caller
    changing the answer's sets changes nothing the next call returns."""
    from purine_mpi.graph.core import Op

    g = Graph()
    g.add_blob("buf", (8,))
    g.add_blob("lo", (4,), alias_of="buf", offset=0)
    g.add_blob("hi", (4,), alias_of="buf", offset=4)
    g.add_blob("hi@new", (4,), alias_of="buf", offset=4)
    g.add_blob("x", (4,))
    g.add_op("read_lo", "Relu", ["lo"], ["a"])
    g.add_op("read_hi", "Relu", ["hi"], ["b"])
    g.add_op("write_hi", "Scale", ["x"], ["hi@new"], {"scale": 1.0})
    g.add_op("other", "Relu", ["x"], ["c"])

    def check(changed=True):
        before = check.last
        got = g.dependencies()
        assert got == g._dependencies()
        assert (got != before) == changed, (before, got)
        for deps in got.values():
            deps.add("bogus")  # the caller's copy only
        check.last = g.dependencies()
        assert check.last == g._dependencies()
    check.last = g.dependencies()
    assert check.last["write_hi"] == {"read_hi"}
    check(changed=False)
    g.blobs["hi@new"].offset = 0  # now over lo, off hi
    check()
    g.blobs["hi@new"].shape = (8,)  # over both
    check()
    g.blobs["hi@new"].alias_of = None  # its own storage: no write-after-read
    check()
    g.blobs["hi@new"].alias_of = "buf"
    check()
    g.blobs["hi@new"].shape = (4,)
    g.blobs["hi@new"].offset = 4
    check()
    g.ops["other"].inputs.append("a")
    check()
    g.ops["other"].outputs[0] = "x"  # other now writes write_hi's input
    check()
    g.ops["read_hi"].control_inputs.append("other")
    check()
    g.ops["other"] = Op("other", "Relu", ["x"], ["c"])  # replaced by a fresh op
    check()
    g.remove_op("read_hi")
    check()
    g.add_op("read_hi", "Relu", ["hi"], ["b"])
    check()
    g.blobs["hi"] = g.blobs["hi"].copy(offset=0)  # a blob replaced: hi over lo
    check()
    g.blobs["hi@new"].shape = [2]  # [4, 6), a list
    g.blobs["lo"].offset, g.blobs["lo"].shape = 6, (2,)  # lo: [6, 8)
    check(changed=False)  # (no overlap before or after)
    g.blobs["hi@new"].shape[0] = 3  # the list edited in place: [4, 7), over lo
    check()
    g.blobs["hi"].shape = (5,)  # hi: [0, 5), over hi@new
    check()
    g.add_blob("y", (2,), alias_of="buf", offset=0)
    g.ops["read_lo"].inputs[0] = "y"  # read_lo now reads [0, 2): off hi@new
    check()


def test_shared_dependencies_answer_a_graph_of_the_same_content(monkeypatch):
    """Within ``shared_dependencies`` (``plan --choose``) a graph of the
    content of one asked of before -- a copy, another setting's composition
    of the same net -- takes that graph's answer, not a computation; an edit
    is computed again; outside it, each graph computes its own and nothing
    is kept past the block (a run holds no answer beyond its graphs')."""
    from purine_mpi.graph import core

    def graph():
        g = Graph()
        g.add_blob("buf", (8,))
        g.add_blob("hi", (4,), alias_of="buf", offset=4)
        g.add_blob("hi@new", (4,), alias_of="buf", offset=4)
        g.add_op("read_hi", "Relu", ["hi"], ["b"])
        g.add_op("write_hi", "Scale", ["b"], ["hi@new"], {"scale": 1.0})
        g.add_op("other", "Relu", ["hi"], ["c"])
        return g

    computed = []
    real = Graph._dependencies
    monkeypatch.setattr(Graph, "_dependencies",
                        lambda self: computed.append(self) or real(self))
    a = graph()
    want = a.dependencies()
    assert want["write_hi"] == {"read_hi", "other"}  # write-after-read
    assert graph().dependencies() == want and len(computed) == 2  # outside: each its own
    computed.clear()
    with core.shared_dependencies():
        b, c = graph(), a.copy()
        assert b.dependencies() == want and c.dependencies() == want
        assert computed == [b]  # c (a copy) took b's answer
        c.ops["other"].inputs[0] = "b"  # now downstream of read_hi: no edge
        got = c.dependencies()
        assert got == real(c) and got["write_hi"] == {"read_hi"} and computed[-1] is c
        for deps in got.values():
            deps.add("bogus")  # the caller's copy only
        assert graph().dependencies() == want and len(computed) == 2  # b's, still kept
    assert not core.SHARED_DEPENDENCIES.is_open
    graph().dependencies()
    assert len(computed) == 3
