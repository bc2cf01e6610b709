"""Scheme sharded with pipeline stages (``parallel.scheme: sharded``,
``parallel.shard: 1 | 2``, ``parallel.stages``; parallel/schemes/sharded.py):
R replicas x p stages as scheme hybrid lays them out, each stage's gradient
buckets reduce-scattered over its R ranks, the solver over the rank's shard
and the weights allgathered. 4 ranks = 2 replicas x 2 stages train as plain
hybrid does bit for bit (a + b either way), each rank holds ZeRO's share of
its own stage's model state, the checkpoints are hybrid's (whole blobs) and
resume under data parallelism on 1 rank; stage 3 with stages is refused."""
import re

import pytest

from purine_mpi.runtime.footprint import model_state_bytes
from purine_mpi.tools.graph import compose_for
from tests.conftest import make_job, run_cli_args, write_config_file
from tests.test_cli import assert_user_error
from tests.test_micro_batches import _params
from tests.test_sharded import _job, _losses, _model_state, _same, _train

#: the residual MLP of test_sharded cut in two stages (the residual crosses)
STAGES = {"fc0": 0, "fc1": 0, "act": 0, "fc2": 1, "res": 1, "out": 1, "loss": 1}


def _staged(scheme, solver="adamw", iters=10, **parallel):
    return _job(scheme, solver, iters=iters, stages=dict(STAGES), **parallel)


def _bytes(cfg, n, rank):
    return model_state_bytes(compose_for(make_job(cfg), n, rank))


def _zero_bounds(plain, sharded, shard, replicas, buckets, per_element):
    """ZeRO's formula for one stage's parameters over its ``replicas``:
    the optimizer state (and from stage 2 the gradients) 1/R of the stage's
    (a bucket's shard holds ceil(n / R) elements or fewer: within one
    element per bucket of n / R), the weights (and at stage 1 the
    gradients) whole."""
    assert sharded["weights"] == plain["weights"]
    assert abs(sharded["optimizer_state"] - plain["optimizer_state"] / replicas) <= \
        per_element * buckets
    if shard == 1:  # the gradient shard is the bucket's range: no bytes of its own
        assert sharded["gradients"] == plain["gradients"]
    else:
        assert abs(sharded["gradients"] - plain["gradients"] / replicas) <= 4 * buckets


@pytest.mark.mpi
@pytest.mark.parametrize("solver", ["sgd", "adamw"])
def test_sharded_stages_train_as_hybrid(tmp_path, solver):
    """10 steps (SGD with momentum, AdamW) at shard 1 and 2 on 2 replicas x
    2 stages: every weight and the gathered optimizer state equal plain
    hybrid's bit for bit (the 2-rank reduce-scatter sums a + b as the
    allreduce does); the start-up block says it; the model state each rank
    holds follows ZeRO's formula over its own stage's parameters (train's
    start-up line on rank 0, the offline graphs plan counts on every rank)."""
    ref, _ = _train(tmp_path, "hybrid", 4, _staged("hybrid", solver))
    want = _params(ref / "latest.h5")
    per_element = 8 if solver == "adamw" else 4
    for shard in (1, 2):
        cfg = _staged("sharded", solver, shard=shard)
        out, text = _train(tmp_path, f"shard{shard}", 4, cfg)
        assert f"sharded (ZeRO stage {shard}): 2 replicas x 2 stages" in text
        assert "reduce-scattered over its 2 ranks (this rank's: 0, 2)" in text
        assert "stage 1      ranks 1, 3: 4 layers" in text
        _same(want, _params(out / "latest.h5"))
        buckets = int(re.search(r"in (\d+) buckets", text).group(1))
        held = dict(zip(("weights", "gradients", "optimizer_state"), _model_state(text)))
        _zero_bounds(_bytes(_staged("hybrid", solver), 4, 0), held, shard, 2, buckets,
                     per_element)
        for rank in range(4):
            g = compose_for(make_job(cfg), 4, rank)
            n = sum(op.op_type == "ReduceScatter" for op in g.ops.values())
            _zero_bounds(_bytes(_staged("hybrid", solver), 4, rank),
                         model_state_bytes(g), shard, 2, n, per_element)


@pytest.mark.mpi
def test_checkpoint_resumes_under_data_on_one_rank(tmp_path):
    """A 2 x 2 sharded checkpoint (iteration 5, AdamW) is hybrid's file:
    continued on 1 rank under scheme data with the same global batch it
    gives the losses of hybrid's checkpoint continued so, bit for bit; and
    continued under sharded stages (each rank loads its shard of its
    stage's whole moments) it ends where an uninterrupted hybrid run does."""
    sh, _ = _train(tmp_path, "sh", 4, _staged("sharded", iters=5))
    hy, _ = _train(tmp_path, "hy", 4, _staged("hybrid", iters=5))
    one = _job("data", "adamw", iters=8)
    one["data"]["train"]["batch_size"] = 16
    runs = []
    for name, ckpt in (("from_sh", sh), ("from_hy", hy)):
        out, text = _train(tmp_path, name, 1, one, "--resume", ckpt / "latest.h5")
        assert "resumed from" in text
        runs.append(_losses(out))
    assert sorted(runs[0]) == [6, 7, 8] and runs[0] == runs[1]
    full, _ = _train(tmp_path, "full", 4, _staged("hybrid", iters=8))
    more, _ = _train(tmp_path, "more", 4, _staged("sharded", iters=8), "--resume",
                     sh / "latest.h5")
    _same(_params(full / "latest.h5"), _params(more / "latest.h5"))


def test_graph_np_shows_the_stage_groups(tmp_path):
    """Each rank's ReduceScatter and Allgather ops go to its stage's ranks,
    posted in the same order (seq) by the ranks of a stage; graph --np says
    so in its header and its bucket lines."""
    cfg = make_job(_staged("sharded"))
    seqs = {}
    for rank in range(4):
        g = compose_for(cfg, 4, rank)
        coll = sorted((op.attrs["seq"], op.op_type, tuple(op.attrs["group"]))
                      for op in g.ops.values() if op.op_type in ("ReduceScatter", "Allgather"))
        assert coll and {c[2] for c in coll} == {(rank % 2, 2 + rank % 2)}
        assert all(op.attrs["shard"] == rank // 2 and op.attrs["shards"] == 2
                   for op in g.ops.values() if op.op_type in ("ReduceScatter", "Allgather"))
        # every bucket's reduce-scatter before any gather
        assert max(s for s, t, _ in coll if t == "ReduceScatter") < \
            min(s for s, t, _ in coll if t == "Allgather")
        seqs.setdefault(rank % 2, []).append(coll)
    for stage, lists in seqs.items():
        assert lists[0] == lists[1], stage
    path = write_config_file(tmp_path, _staged("sharded"), "s.yaml")
    res = run_cli_args("graph", path, "--np", "4", "--rank", "3")
    assert res.returncode == 0, res.stderr
    assert "rank 3 holds shard 1 of 2 of every bucket's optimizer state of this stage" \
        in res.stdout
    assert "sharded buckets (shard 1 of 2, over ranks [1, 3]" in res.stdout
    res = run_cli_args("plan", path, "--np", "4")
    assert res.returncode == 0, res.stderr
    assert "[sharded: 2 replicas x 2 stages, 4 ranks]" in res.stdout
    for rank in range(4):
        ms = _bytes(_staged("sharded"), 4, rank)
        assert (f"({ms['weights']} + {ms['gradients']} + {ms['optimizer_state']} bytes held"
                in res.stdout), rank


@pytest.mark.parametrize("change,np_,key,words", [
    ({"shard": 3}, 4, "parallel.shard", "parallel.stages"),
    ({"backend": "nccl"}, 4, "parallel.backend", "parallel.stages"),
    ({"stages": {k: 0 for k in STAGES}}, 4, "parallel.stages", "at least 2 stages"),
    ({"stages": {k: v for k, v in STAGES.items() if k != "act"}}, 4, "parallel.stages", "act"),
    ({}, 3, "parallel.stages", "not a multiple"),
])
def test_what_is_not_built_exits_2(tmp_path, change, np_, key, words):
    cfg = _staged("sharded", "sgd")
    cfg["parallel"].update(change)
    res = run_cli_args("graph", write_config_file(tmp_path, cfg), "--np", str(np_))
    assert_user_error(res, key, words)


def test_one_rank_notes_the_stages(tmp_path):
    """On one rank the net runs unsplit, and the start-up notes say so."""
    from purine_mpi.parallel.compose import settings_without_effect
    notes = settings_without_effect(make_job(_staged("sharded")), 1)
    assert any("parallel.scheme sharded has no effect on 1 rank: the 2 stages" in n
               for n in notes), notes
    assert not any("stages" in n and "ignores it" in n for n in notes), notes


def _waits_it_adds(graph):
    """The control edges (a -> b) between ops that are not point-to-point
    transfers where ``a`` waits for a point-to-point transfer (a stage's
    Recv or window wait) that ``b`` would not wait for without the edge:
    such an edge may close a cycle through the other stage's rank."""
    from purine_mpi.comm.ops import is_point_to_point
    from purine_mpi.graph.core import reachable
    deps = graph.dependencies()
    bad = []
    for b in graph.ops.values():
        for a in b.control_inputs:
            if is_point_to_point(graph.ops[a]) or is_point_to_point(b):
                continue
            need = {d for d in reachable(a, deps) if is_point_to_point(graph.ops[d])}
            rest = dict(deps, **{b.name: [d for d in deps[b.name] if d != a]})
            if need - reachable(b.name, rest):
                bad.append((a, b.name))
    return bad


@pytest.mark.parametrize("transport", ["two_sided", "auto"])
def test_no_edge_waits_for_the_other_stage(transport):
    """Stage 2 bounds the live gradient buckets by edges from a reduce-
    scatter to a later bucket's writers, and the memory plan orders
    lifetimes apart by edges between compute ops: neither may make an op
    wait for a transfer from the other stage it did not wait for (the
    residual's gradient crosses the stages twice; such an edge deadlocked
    the 4 ranks)."""
    from purine_mpi.runtime.factory import memory_plans
    from purine_mpi.runtime.memory_plan import batch_blobs
    for rank in range(4):
        g = compose_for(make_job(_staged("sharded", "sgd", shard=2, transport=transport)), 4,
                        rank)
        assert _waits_it_adds(g) == [], rank
        memory_plans(g, keep=batch_blobs(g), order_ops=True)  # its edges, on g
        assert _waits_it_adds(g) == [], rank
