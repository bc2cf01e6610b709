"""``plan``'s fast paths (issue 44: plan gpt2_124m --np 8 in seconds) give
the figures the slow ones gave: the topological order kept per graph
(graph/core.Graph.topo_order), the host kernels' scratch asked once per
alike op (runtime/footprint.host_kernel_bytes), the colourings stopped at
the live peak (runtime/memory_plan._best_colouring).

The pinned figures were recorded from ``plan --json`` of commit c52f663,
before these paths (the same commands on gpt_small's data, pipeline,
ZeRO and tensor compositions); the figures that depend on the machine
(host scratch and kernel temporaries: the thread count; MPI transport
buffers; the node's MemAvailable) are left out. One composition is also
planned again in the test with the order cache and the kernel memo off
(the old paths), every figure compared."""
import json
import os

import pytest

from purine_mpi.graph import core
from purine_mpi.graph.core import shared_dependencies
from purine_mpi.job.config import load_job
from purine_mpi.runtime import footprint
from purine_mpi.runtime.memory_plan import shared_colourings
from purine_mpi.tools.plan import MemoryLimits, run_plan
from tests.conftest import REPO

KEYS = ("weights", "gradients", "optimizer_state", "activations", "data_batch", "kept",
        "windows", "comm_buffers")

#: (sets, ranks, {rank: (KEYS' bytes, peak live bytes, arena bytes)}), from c52f663
CASES = [
    (("parallel.micro_batches=4",), 2,
     {0: ((43376640, 43376656, 86753280, 725090304, 262144, 36, 0, 0), 725090304, 725090304)}),
    (("parallel.scheme=pipeline", "parallel.stages=2", "parallel.micro_batches=4"), 2,
     {0: ((22083072, 0, 44166144, 1588724224, 98304, 8, 51906752, 0), 1588721152, 1588724224),
      1: ((21293568, 4, 42587136, 825223680, 0, 24, 126748992, 0), 825223680, 825223680)}),
    (("parallel.scheme=sharded", "parallel.shard=2"), 4,
     {r: ((43376640, 4, 21688320, 2892109056, 262144, 24, 0, 0), 2892108288, 2892109056)
      for r in range(4)}),
    (("parallel.scheme=tensor",), 2,
     {0: ((43376640, 43376644, 86753280, 2889744384, 262144, 24, 0, 0), 2889744384,
          2889744384)}),
    (("parallel.scheme=sharded", "parallel.shard=3", "parallel.micro_batches=2"), 2,
     {r: ((65064960, 8, 43376640, 1531820544, 262144, 28, 0, 0), 1531817472, 1531820544)
      for r in range(2)}),
]


def _plan(email_h5, sets, size):
    job = load_job(os.path.join(REPO, "jobs", "gpt_small.yaml"),
                   [*sets, f"data.train.path={email_h5}", f"data.test.path={email_h5}"], None,
                   check_files=False)
    with shared_dependencies(), shared_colourings():   # as cmd_plan plans
        text, _ = run_plan(job, size, MemoryLimits(), as_json=True)
    return json.loads(text) if isinstance(text, str) else text


def _figures(out):
    return {r["rank"]: (tuple(r["host"][k] for k in KEYS), r["peak"].get("live_bytes"),
                        r["peak"].get("arena_bytes")) for r in out["ranks"]}


@pytest.mark.parametrize("sets,size,expected", CASES,
                         ids=["data-mb4", "pipeline-2", "zero2-4", "tensor-2", "zero3-mb2"])
def test_figures_are_the_old_codes(email_h5, sets, size, expected):
    assert _figures(_plan(email_h5, sets, size)) == expected


class _Forget(dict):
    """A dict that keeps nothing: Graph.topo_order sorts every time."""

    def __setitem__(self, key, value):
        pass


def _machine_free(x):
    if isinstance(x, dict):
        return {k: _machine_free(v) for k, v in x.items()
                if k not in ("limit_bytes", "limit_from", "fits")}
    if isinstance(x, list):
        return [_machine_free(v) for v in x]
    return x


def test_every_figure_as_without_the_order_cache_and_kernel_memo(email_h5, monkeypatch):
    sets, size = ("parallel.scheme=pipeline", "parallel.stages=2",
                  "parallel.micro_batches=4"), 2
    fast = _plan(email_h5, sets, size)
    sorts = []
    kahn = core._kahn
    monkeypatch.setattr(core, "_kahn", lambda ops, deps: sorts.append(1) or kahn(ops, deps))
    fast_sorts = len(sorts)
    monkeypatch.setattr(core, "_LAST_ORDER", _Forget())
    monkeypatch.setattr(footprint, "_kernel_key", lambda graph, op: None)
    slow = _plan(email_h5, sets, size)
    assert fast_sorts == 0 and len(sorts) > 0
    assert _machine_free(fast) == _machine_free(slow)


def test_topo_order_kept_while_the_graph_stays_and_redone_after_an_edit():
    g = core.Graph()
    g.add_blob("x", shape=(2,))
    g.add_op("a", "Copy", ["x"], ["y"])
    g.add_op("b", "Copy", ["y"], ["z"])
    first = [op.name for op in g.topo_order()]
    assert first == ["a", "b"]
    assert [op.name for op in g.topo_order(g.dependencies())] == first
    # an edit that reverses the order: a now reads what b writes
    g.ops["a"].inputs = ["z"]
    g.ops["b"].inputs = ["x"]
    assert [op.name for op in g.topo_order()] == ["b", "a"]
    # dependencies given that differ from the graph's: sorted by them
    assert [op.name for op in g.topo_order({"a": set(), "b": set()})] == ["a", "b"]
    g.ops["a"].control_inputs = ["b"]
    g.ops["b"].control_inputs = ["a"]
    with pytest.raises(core.GraphError, match="cycle"):
        g.topo_order()


def test_digits_lenet_host_plan_reaches_its_live_peak(digits_h5):
    """digits_lenet's host arena held 18,432 bytes above its blobs' live
    peak, each aligned (414,528 of 396,096) after every structured order; a packing at
    the peak exists (a MILP of its 21 units finds one; the peak is a lower
    bound of any), and the seeded shuffles find it."""
    job = load_job(os.path.join(REPO, "jobs", "digits_lenet.yaml"),
                   [f"data.train.path={digits_h5}", f"data.test.path={digits_h5}"], None,
                   check_files=False)
    with shared_dependencies(), shared_colourings():
        text, _ = run_plan(job, 1, MemoryLimits(), as_json=True)
    out = json.loads(text) if isinstance(text, str) else text
    peak = out["ranks"][0]["peak"]
    # the blobs' bytes live at the peak, and each rounded up to the host
    # arena's alignment (64 bytes: 24 bytes more), which no packing beats
    assert peak["live_bytes"] == 396072
    assert peak["arena_bytes"] == 396096   # was 414,528


def test_shared_answers_bounded_by_bytes():
    """base/shared_answers: the older answers go while those kept weigh
    more than max_bytes; the newest stays even alone over it; closing
    forgets all."""
    from purine_mpi.base.shared_answers import SharedAnswers
    kept = SharedAnswers(8, max_bytes=100, weigh=lambda key, answer: answer)
    with kept.opened():
        for k, w in (("a", 40), ("b", 40), ("c", 40)):
            assert kept.answer(lambda: k, lambda: w) == w
        assert list(kept._kept) == ["b", "c"] and kept.kept_bytes == 80
        calls = []
        assert kept.answer(lambda: "b", lambda: calls.append(1) or 0) == 40 and not calls
        assert kept.answer(lambda: "big", lambda: 500) == 500
        assert list(kept._kept) == ["big"] and kept.kept_bytes == 500
    assert not kept.is_open and kept.kept_bytes == 0


def test_the_weights_of_kept_answers_grow_with_the_graph(email_h5):
    """The estimates the byte bounds apply (graph/core._dependencies_weight,
    runtime/memory_plan._colouring_weight) are of the graphs' size: more
    micro-batches weigh more, each within the bounds at gpt_small's size."""
    from purine_mpi.runtime import memory_plan
    from purine_mpi.tools.graph import compose_for
    weights = []
    for m in (1, 4):
        job = load_job(os.path.join(REPO, "jobs", "gpt_small.yaml"),
                       [f"parallel.micro_batches={m}", f"data.train.path={email_h5}",
                        f"data.test.path={email_h5}"], None, check_files=False)
        g = compose_for(job, 1, 0)
        deps = g.dependencies()
        w = core._dependencies_weight(g._dependency_inputs(), deps)
        seen = []
        with shared_colourings():
            real = memory_plan.SHARED_COLOURINGS.answer
            memory_plan.SHARED_COLOURINGS.answer = \
                lambda key, compute: seen.append(key()) or real(lambda: seen[-1], compute)
            try:
                plan = memory_plan.plan_memory(g)
            finally:
                del memory_plan.SHARED_COLOURINGS.answer
        c = memory_plan._colouring_weight(seen[0], (plan.offsets, plan.total_bytes, []))
        weights.append((w, c))
    assert weights[0][0] < weights[1][0] < core.SHARED_DEPENDENCIES_BYTES
    assert weights[0][1] < weights[1][1] < memory_plan.SHARED_COLOURINGS_BYTES
