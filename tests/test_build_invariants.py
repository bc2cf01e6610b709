"""Issue 44 ("answer in seconds"): building a graph of many micro-batches
must not grow quadratically, and the faster build must give the same
graph. ``Graph._dependencies`` finds its write-after-read edges with one
topological sweep (each op's upstream alias writers as bits) instead of a
search from each alias writer; these tests compare it with the search kept
here as the reference, on micro-batched graphs of a pipeline (1f1b, gpipe)
and of data parallelism (the running sums are views of the gradient): the
same dependencies, the same op order and control edges, blobs and memory
plan. Also on random graphs of views of views (overlapping slices written
in place, read through other views; with and without a topological order)
and on each scheme with micro-batches (tensor shards x stages, recompute,
ZeRO 1-3, a parameter-server worker, a GPT on the GPU path in bf16, a
``graph:`` list config)."""
from collections import defaultdict

import pytest

from purine_mpi.graph import core
from purine_mpi.graph.core import Graph
from purine_mpi.job.config import resolve_config
from purine_mpi.runtime.memory_plan import plan_memory
from purine_mpi.tools.graph import compose_for
from tests.conftest import make_job
from tests.test_micro_batches import STAGES, _config


def _reference_dependencies(graph):
    """``Graph._dependencies`` as a plain search: data edges, control
    inputs, and for each op writing a view, every reader of an overlapping
    blob on the same storage that is not downstream of the op (a search of
    the data and control edges from the op)."""
    prod, cons = graph.producers(), graph.consumers()
    deps = {n: set(op.control_inputs) for n, op in graph.ops.items()}
    for op in graph.ops.values():
        for b in op.inputs:
            deps[op.name] |= {p.name for p in prod.get(b, ()) if p.name != op.name}
    succ = defaultdict(set)
    for n, d in deps.items():
        for p in d:
            succ[p].add(n)

    def downstream(start):
        seen, stack = set(), [start]
        while stack:
            for s in succ[stack.pop()]:
                if s not in seen:
                    seen.add(s)
                    stack.append(s)
        return seen

    def extent(b):
        blob = graph.blobs[b]
        if blob.shape is None:
            return None
        off = 0
        while graph.blobs[b].alias_of is not None:
            off += graph.blobs[b].offset
            b = graph.blobs[b].alias_of
        return off, blob.size

    war = defaultdict(set)
    for op in graph.ops.values():
        after = downstream(op.name)
        for out in op.outputs:
            if graph.blobs[out].alias_of is None:
                continue
            root = graph.storage_root(out)
            for other in graph.blobs:
                if other == out or graph.storage_root(other) != root:
                    continue
                ea, eb = extent(other), extent(out)
                if ea is not None and eb is not None and \
                        not (ea[0] < eb[0] + eb[1] and eb[0] < ea[0] + ea[1]):
                    continue
                for reader in cons.get(other, ()):
                    if reader.name != op.name and reader.name not in after:
                        war[op.name].add(reader.name)
    for n, extra in war.items():
        deps[n] |= extra
    return deps


CASES = [("pipeline", "1f1b", 2, 0), ("pipeline", "1f1b", 2, 1), ("pipeline", "gpipe", 2, 0),
         ("pipeline", "gpipe", 2, 1), ("data", "1f1b", 1, 0), ("data", "gpipe", 2, 1)]


def _compose(scheme, schedule, np_, rank):
    par = {"scheme": scheme, "micro_batches": 4, "schedule": schedule}
    if scheme == "pipeline":
        par["stages"] = STAGES
    return compose_for(make_job(resolve_config(_config(**par))), np_, rank)


def _snapshot(graph):
    plan = plan_memory(graph)
    return ([(n, op.op_type, op.inputs, op.outputs, op.control_inputs, op.thread)
             for n, op in graph.ops.items()],
            [(n, b.shape, b.alias_of, b.offset, b.kind) for n, b in graph.blobs.items()],
            [op.name for op in graph.topo_order()],
            (plan.order, plan.offsets, plan.sizes, plan.total_bytes, plan.edges,
             plan.persistent))


@pytest.mark.parametrize("scheme,schedule,np_,rank", CASES)
def test_dependencies_match_the_search(scheme, schedule, np_, rank):
    graph = _compose(scheme, schedule, np_, rank)
    assert sum("@mb3" in n for n in graph.ops) > 5
    views = [op for op in graph.ops.values()
             if any(graph.blobs[b].alias_of is not None for b in op.outputs)]
    assert views  # the write-after-read edges are exercised
    assert graph.dependencies() == _reference_dependencies(graph)


@pytest.mark.parametrize("scheme,schedule,np_,rank", CASES)
def test_build_is_the_references(monkeypatch, scheme, schedule, np_, rank):
    """The whole composition (micro-batch copies, schedule edges, every
    pass that asks for an order) and the memory plan, with the reference
    dependencies instead: the same graph, order, edges and plan."""
    fast = _snapshot(_compose(scheme, schedule, np_, rank))
    assert not core.SHARED_DEPENDENCIES.is_open  # no answer kept from the fast build
    monkeypatch.setattr(Graph, "_dependencies", _reference_dependencies)
    reference = _snapshot(_compose(scheme, schedule, np_, rank))
    assert fast[0] == reference[0]
    assert fast[1] == reference[1]
    assert fast[2] == reference[2]
    assert fast[3] == reference[3]


def test_cycle_and_unknown_control_input_fall_back_to_the_search():
    """Without a topological order (a cycle, a control input naming no op)
    the sweep gives up and the per-writer search answers as before."""
    assert core._upstream_bits({"a": {"b"}, "b": {"a"}}, ["a"]) is None
    assert core._upstream_bits({"a": {"ghost"}}, ["a"]) is None
    g = Graph("t")
    g.add_blob("w", shape=(4,), kind="param")
    g.add_blob("w@new", shape=(4,), kind="param", alias_of="w")
    g.add_op("read", "Copy", ["w"], ["x"])
    g.add_op("upd", "Copy", ["x"], ["w@new"])
    g.ops["read"].control_inputs.append("upd")   # a cycle: read <-> upd
    assert g.dependencies() == _reference_dependencies(g)
    with pytest.raises(core.GraphError, match="cycle"):
        g.topo_order()


def test_upstream_bits_are_the_searches():
    # a diamond with a tail: s1 -> a, b -> c; s2 -> c
    deps = {"s1": set(), "a": {"s1"}, "b": {"s1"}, "c": {"a", "b", "s2"}, "s2": set(),
            "d": {"c"}}
    bit, up = core._upstream_bits(deps, ["s1", "s2", "c"])
    succ = defaultdict(list)
    for n, d in deps.items():
        for p in d:
            succ[p].append(n)
    for s in ("s1", "s2", "c"):
        assert {n for n in deps if up[n] >> bit[s] & 1} == core.reachable(s, succ)


def _random_graph(seed):
    """A random DAG of ops over a few storages, each holding views and views
    of views (``alias_of`` chains, overlapping or not, some of unknown
    shape), written in place and read through other views; random control
    inputs forward in the op order."""
    import random
    rnd = random.Random(seed)
    g = Graph(f"r{seed}")
    blobs = []
    for s in range(rnd.randint(1, 3)):
        root = f"s{s}"
        g.add_blob(root, shape=(16,), kind="param")
        blobs.append(root)
        for v in range(rnd.randint(1, 5)):
            parent = rnd.choice([b for b in blobs if g.storage_root(b) == root])
            size = (g.blobs[parent].size or 16) if g.blobs[parent].shape else 16
            n = rnd.randint(1, max(1, size))
            off = rnd.randint(0, max(0, size - n))
            name = f"{root}.v{v}"
            shape = None if rnd.random() < 0.1 else (n,)
            g.add_blob(name, shape=shape, kind="param", alias_of=parent, offset=off)
            blobs.append(name)
    ops = []
    for i in range(rnd.randint(3, 14)):
        ins = rnd.sample(blobs, rnd.randint(0, min(3, len(blobs))))
        out = rnd.choice(blobs + [f"x{i}"] * 2)
        if out not in g.blobs:
            g.add_blob(out, shape=(4,))
            blobs.append(out)
        name = f"op{i}"
        g.add_op(name, "Copy", ins, [out])
        if ops and rnd.random() < 0.3:
            g.ops[name].control_inputs.append(rnd.choice(ops))
        ops.append(name)
    return g


@pytest.mark.parametrize("seed", range(300))
def test_random_views_of_views_match_the_search(seed):
    """Writers of views of views (overlapping slices of one storage, a view
    of unknown shape), readers through other views, the root read and
    written, control edges: the sweep's dependencies are the search's."""
    g = _random_graph(seed)
    assert g.dependencies() == _reference_dependencies(g)


def _micro(top=None, **parallel):
    cfg = _config(**parallel)
    cfg.update(top or {})
    return cfg


_SGD = {"solver": {"type": "sgd", "base_lr": 0.05, "momentum": 0.9, "max_iter": 6,
                   "display": 3, "test_interval": 0}}


def _gpt(path, top=None, **parallel):
    from tests.gpt_oracle import gpt_net
    return {"name": "gptmb", "seed": 1,
            "data": {"train": {"source": "text", "path": path, "batch_size": 8,
                               "sequence_length": 8}},
            "net": gpt_net(vocab=256, width=16, heads=2, blocks=2, max_length=8),
            "solver": {"type": "adamw", "base_lr": 1e-3, "max_iter": 3},
            "parallel": parallel, **(top or {})}


def _graph_list(path):
    """A ``graph:`` list config (``graph --format yaml`` of 4 micro-batches of
    data parallelism: the running sums and updates' ``alias_of`` views)."""
    import yaml
    from purine_mpi.tools.graph import render_graph
    cfg = _micro(scheme="data", micro_batches=4)
    doc = yaml.safe_load(render_graph(make_job(resolve_config(cfg)), fmt="yaml"))
    assert any(e.get("alias_of") for e in doc["graph"])
    return {"name": "listed", "graph": doc["graph"], "solver": cfg["solver"],
            "parallel": {"scheme": "data"}}


#: (name, config of the text file's path, world size, rank): micro-batches
#: with tensor shards x stages, recompute, ZeRO 1-3 (uneven on 3 ranks, with
#: stages), a parameter-server worker, the GPU path (device passes: fused
#: updates, bf16 casts) of a GPT, a graph: list config
CONFIG_CASES = [
    ("tensor_stages", lambda p: _micro(scheme="hybrid", stages=STAGES, tensor_parallel=2,
                                       micro_batches=4), 8, 5),
    ("recompute_full", lambda p: _micro({"recompute": "full"}, scheme="data",
                                        micro_batches=4), 2, 1),
    ("recompute_selective", lambda p: _micro({"recompute": "selective"}, scheme="data",
                                             micro_batches=4), 2, 1),
    ("zero1", lambda p: _micro(scheme="sharded", shard=1, micro_batches=4), 3, 2),
    ("zero2", lambda p: _micro(scheme="sharded", shard=2, micro_batches=4), 3, 2),
    ("zero3", lambda p: _micro(scheme="sharded", shard=3, micro_batches=4), 3, 1),
    ("zero3_stages", lambda p: _micro(scheme="sharded", shard=3, stages=STAGES,
                                      micro_batches=4), 4, 3),
    ("sync_ps", lambda p: _micro(_SGD, scheme="data", mode="sync_ps", ps_ranks=1,
                                 micro_batches=4), 3, 1),
    ("gpt_gpu_bf16", lambda p: _gpt(p, {"device": 0, "precision": "bf16"}, scheme="data",
                                    micro_batches=4), 2, 1),
    ("gpt_gpu_bf16_zero3", lambda p: _gpt(p, {"device": 0, "precision": "bf16",
                                              "recompute": "selective"},
                                          scheme="sharded", shard=3, micro_batches=4,
                                          backend="nccl"), 3, 2),
    ("graph_list", lambda p: _graph_list(p), 2, 1),
]


@pytest.fixture(scope="module")
def text_path(tmp_path_factory):
    from tests.gpt_nets import text_h5
    return str(text_h5(tmp_path_factory.mktemp("text")))


def _compose_config(make, path, np_, rank):
    return compose_for(make_job(resolve_config(make(path), check_files=False)), np_, rank)


@pytest.mark.parametrize("name,make,np_,rank", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_schemes_dependencies_match_the_search(monkeypatch, text_path, name, make, np_, rank):
    """Each scheme's micro-batched composition: the sweep's dependencies are
    the search's, and the whole build with the search instead (every pass
    that asks for an order, the memory plan) gives the same graph."""
    graph = _compose_config(make, text_path, np_, rank)
    assert any(graph.blobs[b].alias_of is not None for op in graph.ops.values()
               for b in op.outputs)
    assert graph.dependencies() == _reference_dependencies(graph)
    fast = _snapshot(graph)
    monkeypatch.setattr(Graph, "_dependencies", _reference_dependencies)
    reference = _snapshot(_compose_config(make, text_path, np_, rank))
    for a, b in zip(fast, reference):
        assert a == b
