"""The deferred tail (runtime/tail.py, ``parallel.defer_update``): which ops
of a data-parallel iteration may finish while the next one starts, and which
ops of the next one wait for them. That N ranks still train bit-identically
with the tail deferred, under random comm delays, is checked under mpiexec
(tests/test_mpi_parallel.py, dp_equiv.py ... defer; test_mpi_train.py)."""
import pytest

from purine_mpi.ops.catalog import make_kernel
from purine_mpi.job.replica import build_train_graph
from purine_mpi.parallel.data_parallel import compose_data_parallel
from purine_mpi.runtime.tail import deferred_tail
from tests.conftest import make_job
from tests.mpi_scripts.common import mlp_config


def _tail(solver=None, split=False, n=2):
    cfg = mlp_config(batch=4, solver=solver, hidden=(640,) if split else (6, 5),
                     **(dict(shape=(1, 32, 32), classes=10) if split else {}))
    graph, grads = build_train_graph(make_job(cfg), 0, n)
    if n > 1:
        compose_data_parallel(graph, grads, n, 0, bucket_mb=1 if split else 0.0002,
                              first_bucket_mb=0.25 if split else 0.00005, split_params=split)
    graph.infer_shapes().validate()
    kernels = {name: make_kernel(op) for name, op in graph.ops.items()}
    tail, cross = deferred_tail(graph, kernels)
    return graph, tail, cross


@pytest.mark.parametrize("split", [False, True])
def test_the_tail_is_the_allreduces_and_the_updates_behind_them(split):
    graph, tail, cross = _tail(split=split)
    types = {name: op.op_type for name, op in graph.ops.items()}
    allreduce = {n for n, t in types.items() if t == "Allreduce"}
    updates = {n for n in graph.ops if ".update" in n}
    assert allreduce and updates
    assert tail == allreduce | updates
    assert "solver.lr" not in tail  # it reads `iter`, written from outside between runs
    # the forward reads each weight: it waits for that weight's update
    for name, op in graph.ops.items():
        if ".fwd" not in name:
            continue
        for w in (b for b in op.inputs if graph.blobs[b].kind == "param"):
            writers = [u for u in updates if any(graph.storage_root(o) == w
                                                 for o in graph.ops[u].outputs)]
            assert writers, (name, w)
            assert all(name in cross[u] for u in writers), (name, w)
    # every tail op waits for its own last instance, and its producers for it
    deps = graph.dependencies()
    for t in tail:
        assert t in cross[t]
        assert set(deps[t]) <= set(cross[t])
    # the first layer's forward does not wait for the last layer's update
    top = [u for u in updates if u.startswith("out/")]
    first_fwd = next(n for n in graph.ops if n.endswith(".fwd") and n.startswith("fc1"))
    assert top and all(first_fwd not in cross[u] for u in top)


def test_split_chunks_wait_only_for_their_own_rows():
    graph, tail, cross = _tail(split=True)
    a = "fc1/weight.update[0:160]"
    assert a in tail
    # the next iteration's gradient of other rows does not wait for this chunk's update
    assert "fc1.bwd.inner_product_grad_weight[0:160]" in cross[a]
    assert "fc1.bwd.inner_product_grad_weight[480:640]" not in cross[a]


def test_nothing_is_deferred_where_an_update_reads_the_iteration():
    _, tail, cross = _tail(solver={"type": "adam"})  # Adam's bias correction reads `iter`
    assert tail == frozenset() and cross == {}


def test_one_rank_has_no_tail():
    _, tail, _ = _tail(n=1)
    assert tail == frozenset()


def test_defer_update_is_a_documented_config_key():
    from purine_mpi.job.schema import PARALLEL_DEFAULTS
    assert PARALLEL_DEFAULTS["defer_update"] is True
    import os
    from tests.conftest import REPO
    with open(os.path.join(REPO, "docs", "config.md")) as f:
        assert "| `defer_update` | true/false | `true` |" in f.read()


@pytest.mark.parametrize("parallel,solver,shown", [
    ({}, None, True),
    ({"defer_update": False}, None, False),
    ({}, {"type": "adam"}, False)])
def test_graph_command_prints_the_tail(tmp_path, capsys, parallel, solver, shown):
    from purine_mpi.cli import main
    from purine_mpi.job.config import dump_config
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(mlp_config(batch=4, solver=solver, parallel=parallel)))
    assert main(["graph", str(path), "--np", "2"]) in (0, None)
    out = capsys.readouterr().out
    assert ("deferred tail (parallel.defer_update):" in out) == shown
    if shown:
        line = next(x for x in out.splitlines() if x.startswith("deferred tail"))
        assert "(first: fc1.fwd)" in line, line
