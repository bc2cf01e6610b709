"""Scheme sharded with pipeline stages (``parallel.scheme: sharded``,
``parallel.shard: 1 | 2``, ``parallel.stages``; parallel/schemes/sharded.py):
R replicas x p stages as scheme hybrid lays them out, each stage's gradient
buckets reduce-scattered over its R ranks, the solver over the rank's shard
and the weights allgathered. 4 ranks = 2 replicas x 2 stages train as plain
hybrid does bit for bit (a + b either way), each rank holds ZeRO's share of
its own stage's model state, the checkpoints are hybrid's (whole blobs) and
resume under data parallelism on 1 rank. Stage 3 with stages: each stage's
ranks hold their shard of its weights too, gathered once per iteration for
every micro-batch of the stage, and train as hybrid does bit for bit."""
import re

import numpy as np
import pytest

from purine_mpi.comm.verify import comm_signature, compare_signatures
from purine_mpi.parallel.sharding import PARAM_GATHERED_KIND, WORKING_SET_ATTR
from purine_mpi.runtime.footprint import model_state_bytes
from purine_mpi.runtime.memory_plan import plan_memory
from purine_mpi.tools.graph import compose_for
from tests.conftest import make_job, run_cli_here, write_config_file
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


def _hybrid_ref(train_once, solver):
    """Plain hybrid's 10 steps on 2 replicas x 2 stages, a checkpoint at 5
    (which changes no bit of the run), trained once a session: the
    reference of test_sharded_stages_train_as_hybrid and the uninterrupted
    run and iteration-5 checkpoint of
    test_checkpoint_resumes_under_data_on_one_rank."""
    cfg = _staged("hybrid", solver)
    cfg["checkpoint"] = {"interval": 5, "keep": 0}
    return train_once(4, cfg)


def _sharded_run(train_once, solver, shard):
    """Scheme sharded's 10 steps at ``shard`` on 2 replicas x 2 stages, a
    checkpoint at 5 as _hybrid_ref's, trained once a session: the run of
    test_sharded_stages_train_as_hybrid, and (AdamW, shard 1) the
    iteration-5 checkpoint test_checkpoint_resumes_under_data_on_one_rank
    resumes (the lr is fixed: 5 steps of a 10-step run are a 5-step run's;
    before, that test trained the 5 steps in a launch of its own)."""
    cfg = _staged("sharded", solver, shard=shard)
    cfg["checkpoint"] = {"interval": 5, "keep": 0}
    return train_once(4, cfg)


@pytest.mark.mpi
@pytest.mark.parametrize("solver", ["sgd", "adamw"])
def test_sharded_stages_train_as_hybrid(tmp_path, train_once, solver):
    """10 steps (SGD with momentum, AdamW) at shard 1 and 2 on 2 replicas x
    2 stages: every weight and the gathered optimizer state equal plain
    hybrid's bit for bit (the 2-rank reduce-scatter sums a + b as the
    allreduce does); the start-up block says it; the model state each rank
    holds follows ZeRO's formula over its own stage's parameters (train's
    start-up line on rank 0, the offline graphs plan counts on every rank)."""
    ref, _ = _hybrid_ref(train_once, solver)
    want = _params(ref / "latest.h5")
    per_element = 8 if solver == "adamw" else 4
    for shard in (1, 2):
        cfg = _staged("sharded", solver, shard=shard)
        out, text = _sharded_run(train_once, solver, shard)
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
def test_checkpoint_resumes_under_data_on_one_rank(tmp_path, train_once):
    """A 2 x 2 sharded checkpoint (iteration 5, AdamW) is hybrid's file:
    continued on 1 rank under scheme data with the same global batch it
    gives the losses of hybrid's checkpoint continued so, bit for bit; and
    continued under sharded stages (each rank loads its shard of its
    stage's whole moments) to iteration 10 it ends where an uninterrupted
    hybrid run does. (Hybrid's checkpoint and uninterrupted run are
    _hybrid_ref's, the sharded checkpoint _sharded_run's.)"""
    sh = _sharded_run(train_once, "adamw", 1)[0] / "ckpt_5.h5"
    full, _ = _hybrid_ref(train_once, "adamw")
    one = _job("data", "adamw", iters=8)
    one["data"]["train"]["batch_size"] = 16
    runs = []
    for name, ckpt in (("from_sh", sh), ("from_hy", full / "ckpt_5.h5")):
        out, text = _train(tmp_path, name, 1, one, "--resume", ckpt)
        assert "resumed from" in text
        runs.append(_losses(out))
    assert sorted(runs[0]) == [6, 7, 8] and runs[0] == runs[1]
    more, _ = _train(tmp_path, "more", 4, _staged("sharded"), "--resume", sh)
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
    res = run_cli_here("graph", path, "--np", "4", "--rank", "3")
    assert res.returncode == 0, res.stderr
    assert "rank 3 holds shard 1 of 2 of every bucket's optimizer state of this stage" \
        in res.stdout
    assert "sharded buckets (shard 1 of 2, over ranks [1, 3]" in res.stdout
    res = run_cli_here("plan", path, "--np", "4")
    assert res.returncode == 0, res.stderr
    assert "[sharded: 2 replicas x 2 stages, 4 ranks]" in res.stdout
    for rank in range(4):
        ms = _bytes(_staged("sharded"), 4, rank)
        assert (f"({ms['weights']} + {ms['gradients']} + {ms['optimizer_state']} bytes held"
                in res.stdout), rank


@pytest.mark.parametrize("change,np_,key,words", [
    ({"shard": 3, "backend": "nccl"}, 4, "parallel.backend", "parallel.stages"),
    ({"backend": "nccl"}, 4, "parallel.backend", "parallel.stages"),
    ({"stages": {k: 0 for k in STAGES}}, 4, "parallel.stages", "at least 2 stages"),
    ({"stages": {k: v for k, v in STAGES.items() if k != "act"}}, 4, "parallel.stages", "act"),
    ({}, 3, "parallel.stages", "not a multiple"),
])
def test_what_is_not_built_exits_2(tmp_path, change, np_, key, words):
    cfg = _staged("sharded", "sgd")
    cfg["parallel"].update(change)
    res = run_cli_here("graph", write_config_file(tmp_path, cfg), "--np", str(np_))
    assert_user_error(res, key, words)


def test_one_rank_notes_the_stages(tmp_path):
    """On one rank the net runs unsplit, and the start-up notes say so."""
    from purine_mpi.parallel.compose import settings_without_effect
    notes = settings_without_effect(make_job(_staged("sharded")), 1)
    assert any("parallel.scheme sharded has no effect on 1 rank: the 2 stages" in n
               for n in notes), notes
    assert not any("stages" in n and "ignores it" in n for n in notes), notes


def test_one_replica_notes_that_sharding_divides_nothing():
    """As many ranks as stages are one replica: no other rank shares a
    stage's state, so it runs as scheme pipeline; the start-up notes say so
    (not at 4 ranks)."""
    from purine_mpi.parallel.compose import settings_without_effect
    job = make_job(_staged("sharded"))
    notes = settings_without_effect(job, 2)
    assert ("note: parallel.scheme sharded has no effect with 1 replica: the 2 ranks are its 2 "
            "stages, whose model state no other rank shares, so it runs as scheme pipeline "
            "(each rank holds its stage's whole; start mpiexec -n 4 or more to shard it)"
            in notes), notes
    assert not any("1 replica" in n for n in settings_without_effect(job, 4))


@pytest.mark.parametrize("transport", ["one_sided", "auto", "two_sided"])
def test_one_replica_takes_the_transport_as_pipeline(transport):
    """Stages on one replica (2 ranks) run as scheme pipeline whatever
    parallel.transport says: at every ZeRO stage each rank's graph, its
    transport rows and the notes on transport are the pipeline's with the
    same transport (one_sided: the stage transfers through windows; before:
    one_sided exited 2 at shard 1 and 2 and at 3 with stages). On 4 ranks
    (2 replicas) one_sided is taken at every shard
    (test_several_replicas_one_sided_trains_as_hybrid,
    test_stage3_one_sided_puts_each_stage_in_windows; with tensor
    parallelism too: test_sharded3_tensor_windows)."""
    from purine_mpi.graph.seed_yaml import dump
    from purine_mpi.parallel.compose import settings_without_effect
    from purine_mpi.tools.graph import composed
    pipe = make_job(_staged("pipeline", transport=transport))
    want = [composed(pipe, 2, rank) for rank in (0, 1)]
    assert any(op.op_type in ("Put", "WaitWrite") for op in want[1][0].ops.values()) == \
        (transport != "two_sided")
    for shard in (1, 2, 3):
        job = make_job(_staged("sharded", shard=shard, transport=transport))
        for rank in (0, 1):
            g, comp = composed(job, 2, rank)
            assert dump(g) == dump(want[rank][0]), (shard, rank)
            assert comp.transport == want[rank][1].transport, (shard, rank)
        assert not any("transport" in n for n in settings_without_effect(job, 2))
    # grad_dtype: bf16 is accepted with one_sided as under pipeline (nothing reduced)
    job = make_job(_staged("sharded", transport=transport, grad_dtype="bf16"))
    assert any(n.startswith("note: parallel.grad_dtype") and "no effect" in n
               for n in settings_without_effect(job, 2))


@pytest.mark.mpi
def test_one_replica_one_sided_trains_as_pipeline(tmp_path, train_once):
    """2 ranks, 2 stages (one replica), 10 steps of AdamW with
    ``transport: one_sided``: scheme sharded trains through the shared
    windows (its start-up block says it runs as scheme pipeline, its
    transport row one-sided) and ends with every weight and the optimizer
    state of scheme pipeline with one_sided and with two_sided, bit for bit
    (before: exit 2, "transport one_sided with shard 1 ... is refused")."""
    runs = {}
    for scheme, transport in (("pipeline", "two_sided"), ("pipeline", "one_sided")):
        runs[scheme, transport], _ = train_once(2, _staged(scheme, transport=transport))
    out, text = _train(tmp_path, "s", 2, _staged("sharded", transport="one_sided"))
    assert "sharded with 1 replica: runs as scheme pipeline: 2 stages" in text
    assert "activations and gradients: one-sided, shared windows" in text
    assert "ZeRO" not in text
    mine = _params(out / "latest.h5")
    for ref in runs.values():
        _same(_params(ref / "latest.h5"), mine)


def test_several_replicas_take_one_sided_as_auto_on_one_node():
    """2 replicas x 2 stages at shard 1 and 2, ranks of one node: one_sided
    composes every rank's graph as auto does (the stage transfers through
    shared windows, the reduce-scatters and gathers on each stage's ranks);
    its transport row says so. (Before: exit 2 naming parallel.transport.)"""
    from purine_mpi.graph.seed_yaml import dump
    from purine_mpi.tools.graph import composed
    for shard in (1, 2):
        for rank in range(4):
            want = composed(make_job(_staged("sharded", shard=shard, transport="auto")), 4, rank)
            g, comp = composed(make_job(_staged("sharded", shard=shard,
                                                transport="one_sided")), 4, rank)
            assert dump(g) == dump(want[0]), (shard, rank)
            assert any(op.op_type == "Put" for op in g.ops.values())
            assert any(op.op_type == "ReduceScatter" for op in g.ops.values())
            assert [row[:2] for row in comp.transport] == [
                ("activations and gradients", "one-sided, shared windows")], comp.transport


@pytest.mark.mpi
@pytest.mark.parametrize("shard,per_host", [(2, "1"), (3, "1"), (3, None)])
def test_several_replicas_one_sided_trains_as_hybrid(tmp_path, train_once, monkeypatch, shard,
                                                     per_host):
    """2 replicas x 2 stages at shard 2 with ``transport: one_sided``, each
    rank a host of its own (``PURINE_RANKS_PER_HOST=1``: the stage transfers
    through RMA windows, Rput and Fetch_and_op), 10 steps of AdamW: every
    weight and the gathered optimizer state equal plain hybrid's
    (_hybrid_ref, shared windows) bit for bit; the transport row says RMA
    windows. At shard 3 the same, each stage's weights in windows over
    its ranks: each rank's shard in its RMA window, the gathers Rgets (a
    host per rank), or one shared region per bucket read in place (one
    node). (Before: exit 2, "one_sided with parallel.stages on 2 replicas
    ... is refused"; shard 3 until this test's second and third cases.)"""
    ref, _ = _hybrid_ref(train_once, "adamw")
    if per_host:
        monkeypatch.setenv("PURINE_RANKS_PER_HOST", per_host)
    out, text = _train(tmp_path, "rma", 4, _staged("sharded", shard=shard,
                                                   transport="one_sided"))
    assert f"sharded (ZeRO stage {shard}): 2 replicas x 2 stages" in text
    assert ("activations and gradients: one-sided, RMA windows" in text) == bool(per_host)
    if shard == 3:
        how = "RMA Get of the owners' shards" if per_host else "one shared copy per node"
        for group in ("[0, 2]", "[1, 3]"):  # rank 0's block names both stages' windows
            assert re.search(f"weights: {how}.*stage ranks {re.escape(group)} on", text), text
    _same(_params(ref / "latest.h5"), _params(out / "latest.h5"))


def check_stage3_windows(g, comp, group, rank, per_host):
    """Rank ``rank``'s stage-3 buckets (``comp.shard_plan``, graph ``g``) in
    windows over ``group``: no Allgather left, two WindowSyncs a bucket on
    ``group``; a host per rank (``per_host``): each rank's shard its own
    region ``z3/<weights>@<rank>``, read by GetShards; one node: the weights
    the region of ``group[0]``, their shard a view of it. Returns the
    GetShards ops."""
    ops = list(g.ops.values())
    assert comp.shard_plan and not any(op.op_type == "Allgather" for op in ops)
    syncs = [op for op in ops if op.op_type == "WindowSync"]
    assert len(syncs) == 2 * len(comp.shard_plan)
    assert all(op.attrs["group"] == group for op in syncs), rank
    gets = [op for op in ops if op.op_type == "GetShards"]
    for entry in comp.shard_plan:
        w = entry["weights"]
        if per_host:
            assert entry["windows"] == [f"z3/{w}@{r}" for r in group]
            assert g.blobs[entry["weight_shard"]].attrs["window"] == f"z3/{w}@{rank}"
        else:
            assert entry["window"] == g.blobs[w].attrs["window"] == f"z3/{w}@{group[0]}"
            assert g.blobs[entry["weight_shard"]].alias_of == w
    assert bool(gets) == bool(per_host)
    return gets


@pytest.mark.parametrize("per_host", [None, "1"])
def test_stage3_one_sided_puts_each_stage_in_windows(monkeypatch, per_host):
    """Offline, 2 replicas x 2 stages at shard 3 with ``transport:
    one_sided``: no Allgather is left; each bucket's WindowSyncs barrier
    on its stage's ranks; on one node each bucket's weights are one
    shared region owned by the stage's first rank (the weight shard a
    view of it), a host per rank: each rank's shard is its own RMA
    region and the gathers GetShards of the stage's ranks' regions in
    replica order; the composition keeps the stage transfers' windows
    beside (two placements, the rank's window bytes their sum). Before:
    exit 2 naming parallel.transport."""
    from purine_mpi.runtime.footprint import window_bytes
    from purine_mpi.tools.graph import composed
    if per_host:
        monkeypatch.setenv("PURINE_RANKS_PER_HOST", per_host)
    job = make_job(_staged("sharded", "sgd", shard=3, transport="one_sided"))
    for rank in range(4):
        g, comp = composed(job, 4, rank)
        group = [rank % 2, rank % 2 + 2]
        gets = check_stage3_windows(g, comp, group, rank, per_host)
        assert {tuple(op.attrs["regions"]) for op in gets} == (
            {tuple(e["windows"]) for e in comp.shard_plan} if per_host else set()), rank
        assert [row[0] for row in comp.transport] == ["activations and gradients", "weights"]
        assert isinstance(comp.window_placement, list) and len(comp.window_placement) == 2
        (stage_layout, _), (weight_layout, _) = comp.window_placement
        assert set(weight_layout.regions) == (
            {f"z3/{e['weights']}@{r}" for e in comp.shard_plan for r in group} if per_host
            else {f"z3/{e['weights']}@{group[0]}" for e in comp.shard_plan})
        parts = [window_bytes(type(comp)(None, None, window_placement=p), rank)
                 for p in comp.window_placement]
        assert window_bytes(comp, rank) == sum(parts) and parts[1] == (
            sum(r.nbytes + (-r.nbytes % 64) for r in weight_layout.regions.values()
                if r.owner == rank))


def _waits_it_adds(graph):
    """The control edges (a -> b) between ops that are not point-to-point
    transfers where ``a`` waits for a point-to-point transfer (a stage's
    Recv or window wait) that ``b`` would not wait for without the edge:
    such an edge may close a cycle through the other stage's rank. Not an
    edge into a stage-3 gather whose readers all wait for those transfers
    already (its prefetch edge delays the gather alone)."""
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
            if need - reachable(b.name, rest) and not (
                    b.op_type == "Allgather" and "group" in b.attrs and
                    all(need <= reachable(r, deps) for r in deps if b.name in deps[r])):
                bad.append((a, b.name))
    return bad


@pytest.mark.parametrize("transport,shard", [("two_sided", 2), ("auto", 2), ("two_sided", 3),
                                             ("auto", 3)])
def test_no_edge_waits_for_the_other_stage(transport, shard):
    """Stage 2 bounds the live gradient buckets by edges from a reduce-
    scatter to a later bucket's writers, and the memory plan orders
    lifetimes apart by edges between compute ops: neither may make an op
    wait for a transfer from the other stage it did not wait for (the
    residual's gradient crosses the stages twice; such an edge deadlocked
    the 4 ranks). Nor may stage 3's prefetch edges (a gather waits for an
    earlier unit's first reader)."""
    from purine_mpi.runtime.factory import memory_plans
    from purine_mpi.runtime.memory_plan import batch_blobs
    for rank in range(4):
        g = compose_for(make_job(_staged("sharded", "sgd", shard=shard, transport=transport)),
                        4, rank)
        assert _waits_it_adds(g) == [], rank
        memory_plans(g, keep=batch_blobs(g), order_ops=True)  # its edges, on g
        assert _waits_it_adds(g) == [], rank


# ---- stage 3 with stages: each stage's weights sharded over its replicas too

def _stage3(scheme, solver, n, tmp_path, name, clip=None, micro_batches=2, **parallel):
    """Train ``scheme`` (hybrid, or sharded at stage 3) on ``n`` ranks, 10
    steps in ``micro_batches``, a test pass at 5 and 10; (run dir, text)."""
    par = dict(parallel, micro_batches=micro_batches)
    if scheme == "sharded":
        par.update(shard=3, check_collectives=True)
    cfg = _staged(scheme, solver, **par)
    cfg["solver"]["test_interval"] = 5
    if clip is not None:
        cfg["solver"]["clip_gradients"] = clip
    return _train(tmp_path, name, n, cfg)


def _test_losses(text):
    return re.findall(r"test @ iter \d+: loss (\S+)", text)


@pytest.mark.mpi
@pytest.mark.parametrize("n,solver,schedule,m", [(4, "adamw", "1f1b", 4), (4, "sgd", "gpipe", 2),
                                                 (2, "adamw", "1f1b", 2)])
def test_stage3_with_stages_trains_as_hybrid(tmp_path, n, solver, schedule, m):
    """10 steps in 4 micro-batches under 1F1B and 2 under GPipe on 2
    replicas x 2 stages (4 ranks), in 2 under 1F1B on 1 replica x 2 stages
    (2 ranks: each stage's one shard is the whole), the test passes through
    the weights gathered over each stage's ranks: every weight and the
    gathered optimizer state equal plain hybrid's bit for bit (the 2-rank
    reduce-scatter adds a + b as hybrid's allreduce does; one rank adds
    nothing), the same test losses, and the collectives agree across each
    stage's ranks (check_collectives). Under 1F1B the backward of the
    stages that interleave (both at M = 4, stage 1 at M = 2) reads the
    forward's gathered buffer (test_stage3_1f1b_backward_reads_the_forward_
    buffer); rank 0's start-up line says so at M = 4. The start-up block's
    bytes are rank 0's composed graph's. On 2 ranks (one replica) it runs
    as scheme pipeline (hybrid on one replica: the pipeline's graph) and
    its block says so."""
    ref, ref_text = _stage3("hybrid", solver, n, tmp_path, "hybrid", micro_batches=m,
                            schedule=schedule)
    out, text = _stage3("sharded", solver, n, tmp_path, "s3", micro_batches=m,
                        schedule=schedule)
    _same(_params(ref / "latest.h5"), _params(out / "latest.h5"))
    assert len(_test_losses(ref_text)) == 2 and _test_losses(text) == _test_losses(ref_text)
    if n == 2:
        assert "sharded with 1 replica: runs as scheme pipeline: 2 stages" in text
        assert "ZeRO" not in text and "gathered" not in text
        return
    assert "sharded (ZeRO stage 3): 2 replicas x 2 stages" in text
    assert f"each gathered once per iteration and read by all {m} micro-batches" in text
    assert ("gathered once for both (1F1B interleaves" in text) == (schedule == "1f1b" and m > 2)
    cfg = _staged("sharded", solver, shard=3, micro_batches=m, schedule=schedule)
    assert _model_state(text) == tuple(
        _bytes(cfg, n, 0)[k] for k in ("weights", "gradients", "optimizer_state"))


@pytest.mark.mpi
def test_stage3_with_stages_clips_as_hybrid(tmp_path):
    """SGD with momentum clipped to a global norm of 0.05 (far below the
    gradients': the clip acts, the weights differ from the unclipped
    run's): the norm from every rank's shards of every stage (one
    allreduce over the world) clips as hybrid's norm over a replica's
    stages does, bit for bit. That the clip acts is shown on one rank of
    the same global batch (16), in this process: its clipped weights
    differ from its unclipped ones (the same gradients' norm as the 2 x 2
    runs', up to rounding; before, a third 4-rank launch trained hybrid
    unclipped for it)."""
    ref, _ = _stage3("hybrid", "sgd", 4, tmp_path, "hybrid", clip=0.05)
    out, _ = _stage3("sharded", "sgd", 4, tmp_path, "s3", clip=0.05)
    want = _params(ref / "latest.h5")
    _same(want, _params(out / "latest.h5"))
    one = {}
    for clip in (0.05, None):
        cfg = _job("data", "sgd", iters=10)
        cfg["data"]["train"]["batch_size"] = 16
        if clip is not None:
            cfg["solver"]["clip_gradients"] = clip
        one[clip] = _params(_train(tmp_path, f"one_{clip}", 1, cfg)[0] / "latest.h5")
    assert sorted(one[0.05]) == sorted(one[None])
    assert any(not np.allclose(one[0.05][k], one[None][k], rtol=1e-3) for k in one[None]
               if k.startswith("params/"))


@pytest.mark.mpi
def test_stage3_with_stages_checkpoint_resumes_elsewhere(tmp_path):
    """Hybrid's checkpoint of iteration 4 (AdamW, 2 micro-batches)
    continued under stage 3 with stages (2 x 2) to 8 ends where an
    uninterrupted hybrid run does, and the checkpoint stage 3 writes at
    its end is hybrid's file: the same whole blobs (weights and optimizer
    state), bit for bit, as hybrid's; continued on 1 rank under scheme
    data with the same global batch it gives the losses of hybrid's
    checkpoint continued so. (Two 4-rank launches: before, a third trained
    stage 3 from scratch for 5 iterations to write the checkpoint compared
    and resumed; stage 3 from scratch is the test of
    test_stage3_with_stages_trains_as_hybrid.)"""
    full_cfg = _staged("hybrid", iters=8, micro_batches=2)
    full_cfg["checkpoint"] = {"interval": 4, "keep": 0}
    full, _ = _train(tmp_path, "full", 4, full_cfg)
    more, text = _train(tmp_path, "more", 4, _staged("sharded", iters=8, shard=3,
                                                     micro_batches=2),
                        "--resume", full / "ckpt_4.h5")
    assert "sharded (ZeRO stage 3): 2 replicas x 2 stages" in text
    sh, hy = more / "latest.h5", full / "latest.h5"
    _same(_params(hy), _params(sh))
    one = _job("data", "adamw", iters=10)
    one["data"]["train"]["batch_size"] = 16
    runs = []
    for name, ckpt in (("from_sh", sh), ("from_hy", hy)):
        out, text = _train(tmp_path, name, 1, one, "--resume", ckpt)
        assert "resumed from" in text
        runs.append(_losses(out))
    assert sorted(runs[0]) == [9, 10] and runs[0] == runs[1]


@pytest.mark.parametrize("n", [4])
@pytest.mark.parametrize("solver", ["adamw", "sgd"])
def test_stage3_with_stages_holds_the_stage_share_over_r(tmp_path, n, solver):
    """From each rank's composed graph (graphs plan's count): weights,
    gradients and optimizer state held are hybrid's (the stage's whole
    share) / R, within one element per bucket (1 replica, 2 ranks, runs as
    scheme pipeline: test_settings_effect.test_sharded_with_one_replica_
    composes_as_the_plain_scheme); the
    gathered weights are transient in the memory plan. Each bucket is
    gathered at most once per pass whatever the micro-batches (no more
    gathers than with one; fewer where 1F1B interleaves the passes: test_
    stage3_1f1b_backward_reads_the_forward_buffer), every forward gather
    posted before any backward gather or reduce-scatter (seq: a
    reduce-scatter behind a receive posted ahead of a forward gather
    deadlocks the stages), and the stage's ranks post the
    same collectives on the stage's ranks; graph --np says what the rank
    holds."""
    replicas = n // 2
    per_element = 8 if solver == "adamw" else 4
    signatures = []
    for rank in range(n):
        plain = _bytes(_staged("hybrid", solver, micro_batches=2), n, rank)
        g = compose_for(make_job(_staged("sharded", solver, shard=3, micro_batches=2)), n, rank)
        held = model_state_bytes(g)
        buckets = sum(op.op_type == "ReduceScatter" for op in g.ops.values())
        for key, each in (("weights", 4), ("gradients", 4), ("optimizer_state", per_element)):
            assert abs(held[key] - plain[key] / replicas) <= each * buckets * (replicas - 1), \
                (rank, key, held, plain)
        plan = plan_memory(g)
        full = [b for b, blob in g.blobs.items() if blob.alias_of is None and
                blob.attrs.get(WORKING_SET_ATTR) == "weights"]
        assert full and not [b for b in full if b in plan.persistent]
        one = compose_for(make_job(_staged("sharded", solver, shard=3)), n, rank)
        count = [sum(op.op_type == "Allgather" for op in x.ops.values()) for x in (g, one)]
        assert buckets <= count[0] <= count[1] <= 2 * buckets, (rank, count)
        coll = [op for op in g.ops.values() if op.op_type in ("Allgather", "ReduceScatter")]
        forward = [op.attrs["seq"] for op in coll if op.op_type == "Allgather" and
                   g.blobs[op.outputs[0]].kind != PARAM_GATHERED_KIND]
        later = [op.attrs["seq"] for op in coll if op.attrs["seq"] not in forward]
        assert forward and later and max(forward) < min(later), rank
        assert {tuple(op.attrs["group"]) for op in coll} == {tuple(range(rank % 2, n, 2))}
        signatures.append(comm_signature(g))
    assert compare_signatures(signatures) == []  # world order: each stage's group agrees
    path = write_config_file(tmp_path, _staged("sharded", solver, shard=3), "s.yaml")
    res = run_cli_here("graph", path, "--np", str(n), "--rank", str(n - 1))
    assert res.returncode == 0, res.stderr
    assert (f"holds shard {replicas - 1} of {replicas} of every bucket's weights, gradients "
            "and optimizer state of this stage") in res.stdout


def _interleaves(stage, m, schedule):
    """Whether stage ``stage`` of 2 runs a forward after a backward in
    ``schedule``'s order of its ``m`` micro-batches (micro_batch.stage_order)."""
    from purine_mpi.parallel.micro_batch import stage_order
    kinds = [kind for kind, _ in stage_order(stage, 2, m, schedule)]
    return "B" in kinds and "F" in kinds[kinds.index("B"):]


@pytest.mark.parametrize("schedule,m", [("1f1b", 2), ("1f1b", 4), ("gpipe", 2), ("1f1b", 1)])
def test_stage3_1f1b_backward_reads_the_forward_buffer(monkeypatch, schedule, m):
    """On 2 replicas x 2 stages, where the schedule runs a stage's forward
    after one of its backwards (1F1B: stage 1 at M = 2, F0 B0 F1 B1; both
    stages at M = 4), the forward gather's buffer is still live when the
    backward readers run: the backward reads it (no backward gather, no
    second copy of the weights), so the stage posts one allgather per
    bucket and moves fewer bytes, and its planned arena and peak are no
    higher than with the two gathers (``_interleaved`` off: today's
    graph). GPipe, M = 1 and stage 0 at M = 2 (F0 F1 B0 B1) keep the two
    gathers: the same graph. Either way the forward gathers come before
    every reduce-scatter in ``seq``, no edge beyond the schedule's makes an
    op wait for a transfer from the other stage (``_waits_it_adds``: the
    same as with two gathers), and each stage's ranks post the same
    collectives."""
    from purine_mpi.comm.ops import collective_bytes
    from purine_mpi.parallel import sharding
    from purine_mpi.runtime.factory import memory_plans
    from purine_mpi.runtime.memory_plan import batch_blobs, peak_live
    cfg = make_job(_staged("sharded", "adamw", shard=3, micro_batches=m, schedule=schedule))
    shared, signatures = [], []
    for rank in range(4):
        g = compose_for(cfg, 4, rank)
        with monkeypatch.context() as mp:  # the two gathers of every bucket
            mp.setattr(sharding, "_interleaved", lambda *a: False)
            two = compose_for(cfg, 4, rank)
        interleaves = _interleaves(rank % 2, m, schedule)
        if interleaves:
            shared.append(rank)
        count = [sum(op.op_type == "Allgather" for op in x.ops.values()) for x in (g, two)]
        moved = [collective_bytes(x)["Allgather"] for x in (g, two)]
        buckets = sum(op.op_type == "ReduceScatter" for op in g.ops.values())
        gathered = [b for b, blob in g.blobs.items() if blob.kind == PARAM_GATHERED_KIND]
        if interleaves:  # every bucket gathered once: fewer gathers, fewer bytes
            assert count[0] == buckets < count[1] and moved[0] < moved[1], (rank, count, moved)
            assert gathered == [], rank
        else:  # today's graph
            assert count[0] == count[1] and moved[0] == moved[1] and gathered, (rank, count)
            assert sorted(g.ops) == sorted(two.ops) and sorted(g.blobs) == sorted(two.blobs)
        coll = [op for op in g.ops.values() if op.op_type in ("Allgather", "ReduceScatter")]
        forward = [op.attrs["seq"] for op in coll if op.op_type == "Allgather" and
                   g.blobs[op.outputs[0]].kind != PARAM_GATHERED_KIND]
        assert max(forward) < min(op.attrs["seq"] for op in coll
                                  if op.op_type == "ReduceScatter"), rank
        signatures.append(comm_signature(g))
        # the schedule's own edges between micro-batches aside, none new: none
        # from a gather (to the backward readers it now has), before or after
        # the memory plan's edges
        waits = [set(_waits_it_adds(x)) for x in (g, two)]
        plans = [memory_plans(x, keep=batch_blobs(x), order_ops=True)[0] for x in (g, two)]
        for x, before in zip((g, two), waits):
            after = set(_waits_it_adds(x))
            assert not (after - before) and not [a for a, _ in after if "allgather" in a]
        assert not (waits[0] - waits[1]), rank
        full = [b for b, blob in g.blobs.items() if blob.alias_of is None and
                blob.attrs.get(WORKING_SET_ATTR) == "weights"]
        assert full and not [b for b in full if b in plans[0].persistent], rank
        assert plans[0].total_bytes <= plans[1].total_bytes, rank
        peaks = [sum(peak_live(x, p)[2].values()) for x, p in zip((g, two), plans)]
        assert peaks[0] <= peaks[1], (rank, peaks)
    assert compare_signatures(signatures) == []
    assert shared == {("1f1b", 2): [1, 3], ("1f1b", 4): [0, 1, 2, 3]}.get((schedule, m), [])
