"""The building blocks of sharded training (issue 43, docs/parallel.md
"Sharding building blocks"): the ReduceScatter and Allgather ops
(comm/ops.py), a bucket's flat weight buffer and the solver over one shard
(parallel/sharding.py). The collectives run under ``mpiexec`` on 2, 3 and
4 ranks (tests/mpi_scripts/shard_ops.py checks its closed forms and
equivalences on every rank)."""
import re
from types import SimpleNamespace

import numpy as np
import pytest

import purine_mpi.ops.catalog  # noqa: F401  (registers every op)
from purine_mpi.base.errors import GraphError, ShapeError
from purine_mpi.comm.ops import collective_bytes, shard_counts, shard_range
from purine_mpi.comm.verify import comm_signature
from purine_mpi.graph import Graph
from purine_mpi.graph.solver_graph import add_solver
from purine_mpi.parallel.sharding import (add_shard_solver, compose_zero1,
                                          flatten_bucket_params)
from purine_mpi.runtime.factory import make_dispatcher
from purine_mpi.runtime.workspace import Workspace
from purine_mpi.tools.bench_transport import transport_figures
from tests.mpi_scripts.launch import run_mpi


@pytest.mark.parametrize("total", [0, 1, 5, 12, 13, 1001])
@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7])
def test_shard_layout_tiles_the_buffer_in_rank_order(total, shards):
    chunk = -(-total // shards)
    counts, displs = shard_counts(total, shards)
    assert sum(counts) == total
    pos = 0
    for r in range(shards):
        a, b = shard_range(total, shards, r)
        assert (a, b) == (min(total, r * chunk), min(total, (r + 1) * chunk))
        assert a == pos == displs[r] and b - a == counts[r] and b - a <= chunk
        pos = b


def _solver(kind):
    return SimpleNamespace(type=kind, base_lr=0.1, lr_policy="fixed", momentum=0.9,
                           momentum2=0.999, delta=1e-8, weight_decay=0.01)


def _net(kind="adamw", shapes=((4, 3), (3,), (5,))):
    g = Graph("t")
    grads = {}
    for i, shape in enumerate(shapes):
        g.add_blob(f"p{i}", shape, kind="param")
        g.add_blob(f"g{i}", shape, kind="grad")
        grads[f"p{i}"] = f"g{i}"
    add_solver(g, grads, _solver(kind))
    return g.infer_shapes(), grads


def test_flat_weight_buffer_views_alias_it():
    g, _ = _net()
    flatten_bucket_params(g, "w", ["p0", "p1", "p2"], [0, 12, 15])
    g.infer_shapes().validate()
    assert g.blobs["w"].shape == (20,) and g.blobs["w"].kind == "param_buffer"
    # checkpoints still see each weight by its name (Graph.params)
    assert sorted(b.name for b in g.params()) == ["p0", "p1", "p2"]
    ws = Workspace(g)
    flat = ws.storage("w")
    for name, off in (("p0", 0), ("p1", 12), ("p2", 15)):
        assert np.shares_memory(ws[name], flat)
        ws[name][...] = np.arange(ws[name].size).reshape(ws[name].shape) + off
    assert np.array_equal(flat, np.arange(20))  # each view at its offset, nothing between
    assert np.shares_memory(ws["p1@new"], flat)  # the update's alias follows


def test_flat_weight_buffer_refuses_views_and_mixed_dtypes():
    g, _ = _net()
    g.add_blob("v", (3,), kind="param", alias_of="p0")
    with pytest.raises(GraphError, match="'v' is a view of 'p0'"):
        flatten_bucket_params(g, "w", ["v"], [0])
    g.blobs["p2"].dtype = "float64"
    with pytest.raises(GraphError, match="share dtype"):
        flatten_bucket_params(g, "w", ["p1", "p2"], [0, 3])


@pytest.mark.parametrize("kind,states", [("sgd", 1), ("adamw", 2)])
@pytest.mark.parametrize("shard", [0, 1, 2])
def test_shard_solver_holds_state_for_its_shard_only(kind, states, shard):
    g, _ = _net(kind)
    flatten_bucket_params(g, "w", ["p0", "p1", "p2"], [0, 12, 15])
    lo, hi = shard_range(20, 3, shard)  # 7 elements each but the last (6)
    g.add_blob("gs", (hi - lo,), kind="grad")
    out = add_shard_solver(g, "w", ["p0", "p1", "p2"], [0, 12, 15], "gs", 3, shard)
    assert len(out["states"]) == states
    for s in out["states"]:
        assert g.blobs[s].shape == (hi - lo,) and g.blobs[s].alias_of is None
    # no full-size state is left; every update reads a part of the shard
    full = [b for b in g.blobs.values() if b.kind == "state" and b.alias_of is None]
    assert sorted(b.name for b in full) == sorted(out["states"])
    ws = Workspace(g.infer_shapes().validate())
    held = sum(ws.storage(s).nbytes for s in out["states"])
    assert held == states * (hi - lo) * 4
    # the parts tile the shard, with each weight's multipliers and 1/N
    parts = sorted((g.blobs[x].offset, g.blobs[x].size) for x in out["grads"])
    assert parts[0][0] == 0 and sum(n for _, n in parts) == hi - lo
    for name in out["ops"]:
        op = g.ops[name]
        assert op.attrs["grad_scale"] == pytest.approx(1 / 3)


def test_allgather_and_reduce_scatter_check_their_shapes():
    g = Graph("t")
    g.add_blob("x", (3,))
    g.add_op("ag", "Allgather", ["x"], ["y"], {"seq": 0, "shards": 2, "shard": 1,
                                              "shapes": [[9]]})
    with pytest.raises(ShapeError, match="shard 1 of 2 of 9 elements holds 4, the inputs hold 3"):
        g.infer_shapes()
    g.ops["ag"].attrs["shapes"] = [[6]]
    g.infer_shapes()
    assert g.blobs["y"].shape == (6,)
    g.add_blob("a", (5,), dtype="float64")
    g.add_op("rs", "ReduceScatter", ["a"], ["s0", "s1"],
             {"seq": 1, "shards": 2, "shard": 0, "shapes": [[2], [2]]})
    with pytest.raises(ShapeError, match="holds 3"):
        g.infer_shapes()
    g.ops["rs"].attrs["shapes"] = [[2], [1]]
    g.infer_shapes()
    assert g.blobs["s1"].dtype == "float64"
    # the collectives check compares what every rank agrees on: the whole bucket
    sig = {e["kind"]: e["count"] for e in comm_signature(g)}
    assert sig == {"Allgather": 6, "ReduceScatter": 5}
    assert collective_bytes(g) == {"Allgather": 24, "ReduceScatter": 40}
    # bench --json's bytes_two_sided_per_iter counts them as it counts an Allreduce
    graphs = SimpleNamespace(graph=g, composition=SimpleNamespace(transport=None))  # RankGraphs
    figures = transport_figures(object(), graphs, 1, {})
    assert figures["transport"] == "two_sided" and figures["bytes_two_sided_per_iter"] == 64


def test_a_graph_built_for_other_ranks_is_refused():
    g = Graph("t")
    g.add_blob("a", (4,))
    g.add_op("rs", "ReduceScatter", ["a"], ["s"], {"seq": 0, "shards": 2, "shard": 1})
    g.infer_shapes()
    with pytest.raises(GraphError, match="built as shard 1 of 2, but runs as rank 0 of 1"):
        make_dispatcher(g, "event", stall_timeout=10.0)  # the kernels' setup


def test_zero1_on_one_rank_updates_like_the_plain_solver():
    """One rank: the composition's ops run through the dispatcher and give
    the plain solver's weights bit for bit (the MPI tests below do 2-4)."""
    results = []
    for sharded in (False, True):
        g, grads = _net("adamw")
        if sharded:
            plan = compose_zero1(g, grads, 1, 0, bucket_mb=0.00003, first_bucket_mb=0.00001)
            assert len(plan) >= 2
            g.infer_shapes().validate()
        d = make_dispatcher(g, "event", stall_timeout=10.0)
        ws = d.workspace
        for i in range(3):
            ws.set(f"p{i}", np.linspace(-1, 1, ws[f"p{i}"].size).reshape(ws[f"p{i}"].shape))
        for it in range(3):
            ws["iter"][...] = it
            for i in range(3):
                ws.set(f"g{i}", np.cos(np.arange(ws[f"g{i}"].size) + it + i)
                       .reshape(ws[f"g{i}"].shape))
            d.run(it)
        d.drain()
        results.append([np.array(ws[f"p{i}"]) for i in range(3)])
        d.close()
    for a, b in zip(*results):
        assert np.array_equal(a, b)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3, 4])
def test_reduce_scatter_and_allgather_closed_form(n):
    proc, _ = run_mpi("shard_ops.py", n, "ops", timeout=240)
    assert proc.stdout.count("OK shard_ops ops") == n, proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3, 4])
def test_zero1_equals_data_parallel(n):
    """reduce-scatter -> shard update -> allgather gives plain data
    parallelism's weights (SGD momentum and AdamW): bitwise where the sums
    are the same, else within 1e-6 of each weight's scale; each rank's
    optimizer state is its shard's size."""
    proc, _ = run_mpi("shard_ops.py", n, "equiv", timeout=400)
    assert proc.stdout.count("OK shard_ops equiv") == n, proc.stdout
    # rank 0's lines (another rank's output may land inside one: mpiexec
    # forwards the ranks' streams in chunks)
    lines = re.findall(r"rank 0 (\w+ \w+ (?:random|exact)): (bitwise|max rel [^;]+);",
                       proc.stdout)
    assert len(lines) == 8, proc.stdout
    if n == 2:
        assert all(how == "bitwise" for _, how in lines), lines
    assert all(how == "bitwise" for what, how in lines if what.endswith("exact")), lines
    print(lines)


@pytest.mark.mpi
def test_stall_watchdog_names_a_reduce_scatter():
    proc, seconds = run_mpi("shard_ops.py", 2, "stall", timeout=60, expect_ok=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "finished, which it should not" not in out
    assert "rank 0: communication stalled for more than 1 s" in out, out
    assert "op 'rs' (ReduceScatter, Ireduce_scatter grad_bucket0 3.9 KB seq 0)" in out, out
    assert seconds < 20, f"stall report took {seconds:.1f} s"
