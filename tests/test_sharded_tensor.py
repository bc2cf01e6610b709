"""Scheme sharded with tensor parallelism (``parallel.scheme: sharded``,
``parallel.shard: 1 | 2`` (stage 3: test_sharded3_tensor.py), ``parallel.tensor_parallel: t``;
parallel/schemes/sharded.py): R replicas x t shards as scheme tensor lays
them out (rank = replica * t + shard), the net split as scheme tensor splits
it, each tensor shard's gradient buckets reduce-scattered over its R
replicas, the solver over the rank's ZeRO shard and the weights allgathered.
On 2 replicas x 2-way tensor (4 ranks) and 1 replica x 2-way (2 ranks) a
tiny GPT trains as scheme tensor does bit for bit (the 2-rank reduce-scatter
adds a + b as tensor's allreduce does; one rank adds nothing), each rank
holds tensor's optimizer state / R, the checkpoints are scheme tensor's
(whole blobs) and resume under data parallelism on 1 rank."""
import re

import numpy as np
import pytest

from purine_mpi.runtime.footprint import model_state_bytes
from purine_mpi.tools.graph import compose_for
from tests.conftest import make_job, run_cli_here, write_config_file
from tests.gpt_nets import gpt_config, text_h5
from tests.test_cli import assert_user_error
from tests.test_micro_batches import _params
from tests.test_sharded import _losses, _model_state, _same, _train
from tests.test_sharded_stages import _bytes


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """The token file, at one path a session (test_sharded3_tensor and
    test_grad_dtype_schemes take this fixture too): their configs are the
    same text, so train_once trains scheme tensor's references once."""
    where = tmp_path_factory.getbasetemp() / "gpt_tokens"
    where.mkdir(exist_ok=True)
    return text_h5(where)


def _gpt(tokens, scheme, solver="adamw", iters=10, clip=None, **parallel):
    """The 2-block GPT of test_tensor_parallel (attention and MLP split by
    tensor), 2-way tensor parallel, small buckets (several per rank, so the
    ZeRO shards cut weights apart)."""
    cfg = gpt_config(tokens, solver=solver, iters=iters, parallel=dict(
        {"scheme": scheme, "tensor_parallel": 2, "bucket_mb": 0.02,
         "first_bucket_mb": 0.01}, **parallel))
    if solver == "sgd":
        cfg["solver"]["momentum"] = 0.9
    if scheme == "sharded":
        cfg["parallel"].setdefault("shard", 1)
    if clip is not None:
        cfg["solver"]["clip_gradients"] = clip
    return cfg


def _tensor_ref(train_once, tokens, n, solver, clip=None):
    """Scheme tensor's 10 steps on ``n`` ranks, a test pass and a
    checkpoint at 5 and 10 (which change no bit of the run), trained once a
    session: the reference of test_sharded_tensor_trains_as_tensor, the
    unclipped and (``clip``) clipped runs of test_clipping_as_tensor,
    tensor's iteration-5 checkpoint of
    test_checkpoint_is_tensors_and_resumes_under_data_on_one_rank, and
    test_sharded3_tensor's and test_grad_dtype_schemes' scheme-tensor runs."""
    cfg = _gpt(tokens, "tensor", solver, clip=clip)
    cfg["solver"]["test_interval"] = 5
    cfg["checkpoint"] = {"interval": 5, "keep": 0}
    return train_once(n, cfg)


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory, tokens):
    """``get(n, solver, shard)`` -> (run folder, output): sharded x tensor's
    10 steps on ``n`` ranks (collectives checked, a checkpoint at 5, which
    changes no bit of the run), trained once for the tests that read it:
    test_sharded_tensor_trains_as_tensor's runs, the 2 x 2-way AdamW one at
    shard 1 also test_checkpoint_is_tensors_and_resumes_under_data_on_one_rank's
    iteration-5 checkpoint."""
    done = {}

    def get(n, solver, shard):
        if (n, solver, shard) not in done:
            cfg = _gpt(tokens, "sharded", solver, shard=shard, check_collectives=True)
            cfg["checkpoint"] = {"interval": 5, "keep": 0}
            done[n, solver, shard] = _train(tmp_path_factory.mktemp(f"shtp_{n}_{solver}"),
                                            f"shard{shard}", n, cfg)
        return done[n, solver, shard]
    return get


@pytest.mark.mpi
@pytest.mark.parametrize("n,solver", [(4, "adamw"), (4, "sgd"), (2, "adamw"),
                                      pytest.param(2, "sgd", marks=pytest.mark.slow)])
def test_sharded_tensor_trains_as_tensor(tokens, train_once, sharded_runs, n, solver):
    """10 steps (AdamW; SGD with momentum) at shard 1 and 2: every weight
    and the gathered optimizer state equal scheme tensor's on the same
    layout bit for bit; the start-up block says what each rank holds, and
    its bytes are rank 0's composed graph's; on 2 ranks (one replica) it
    runs as scheme tensor and its block says so. (Scheme tensor's run is
    _tensor_ref's, shared with the clipping and checkpoint tests; the 2 x
    2-way AdamW run at shard 1, sharded_runs', with the checkpoint test.)"""
    ref, _ = _tensor_ref(train_once, tokens, n, solver)
    want = _params(ref / "latest.h5")
    replicas = n // 2
    for shard in (1, 2):
        out, text = sharded_runs(n, solver, shard)
        assert "b0_attn (heads, 4 -> 2 per rank" in text
        _same(want, _params(out / "latest.h5"))
        if replicas == 1:
            assert "sharded with 1 replica: runs as scheme tensor: 1 replica x 2-way" in text
            assert "ZeRO" not in text and "reduce-scattered" not in text
            continue
        assert f"sharded (ZeRO stage {shard}): 2 replicas x 2-way tensor parallel" in text
        assert ("each tensor shard's gradients reduce-scattered over its 2 ranks (this "
                "rank's: 0, 2)") in text
        cfg = _gpt(tokens, "sharded", solver, shard=shard, check_collectives=True)
        assert _model_state(text) == tuple(
            _bytes(cfg, n, 0)[k] for k in ("weights", "gradients", "optimizer_state"))


@pytest.mark.parametrize("n", [4])
@pytest.mark.parametrize("solver", ["adamw", "sgd"])
def test_held_model_state_is_tensors_over_r(tokens, n, solver):
    """(One replica, 2 ranks, runs as scheme tensor:
    test_settings_effect.test_sharded_with_one_replica_composes_as_the_plain_scheme.)
    From each rank's composed graph (offline): the weights held are
    scheme tensor's (its shard of the split weights, the whole of the
    others), the optimizer state tensor's / R (within one element per
    bucket), and from stage 2 the gradients too; each rank's reduce-scatters
    and gathers go to its tensor shard's replicas, its activations'
    allreduces to its tensor group."""
    replicas = n // 2
    per_element = 8 if solver == "adamw" else 4
    plain_of = [_bytes(_gpt(tokens, "tensor", solver), n, rank) for rank in range(n)]
    for shard in (1, 2):
        for rank in range(n):
            plain = plain_of[rank]
            g = compose_for(make_job(_gpt(tokens, "sharded", solver, shard=shard)), n, rank)
            held = model_state_bytes(g)
            buckets = sum(op.op_type == "ReduceScatter" for op in g.ops.values())
            assert buckets > 1
            assert held["weights"] == plain["weights"]
            assert abs(held["optimizer_state"] - plain["optimizer_state"] / replicas) <= \
                per_element * buckets * (replicas - 1), (rank, held, plain)
            if replicas > 1:
                assert held["optimizer_state"] < plain["optimizer_state"]
            grads = plain["gradients"] / (replicas if shard == 2 else 1)
            assert abs(held["gradients"] - grads) <= 4 * buckets * (replicas - 1)
            groups = {(op.op_type, tuple(op.attrs["group"])) for op in g.ops.values()
                      if op.op_type in ("ReduceScatter", "Allgather", "Allreduce")}
            mine = tuple(range(rank % 2, n, 2))
            group = tuple(range(rank - rank % 2, rank - rank % 2 + 2))
            assert groups == {("ReduceScatter", mine), ("Allgather", mine),
                              ("Allreduce", group)}, rank


@pytest.mark.mpi
def test_checkpoint_is_tensors_and_resumes_under_data_on_one_rank(tmp_path, tokens,
                                                                  train_once, sharded_runs):
    """A 2 x 2-way sharded checkpoint (iteration 5, AdamW) is scheme
    tensor's file, the same whole blobs bit for bit; continued on 1 rank
    under scheme data with the same global batch it gives the losses of
    tensor's checkpoint continued so, bit for bit. (Both iteration-5
    checkpoints are the ones their shared 10-step runs write: _tensor_ref's
    and sharded_runs'.)"""
    sh = sharded_runs(4, "adamw", 1)[0] / "ckpt_5.h5"
    te = _tensor_ref(train_once, tokens, 4, "adamw")[0] / "ckpt_5.h5"
    _same(_params(te), _params(sh))
    one = gpt_config(tokens, iters=8, batch=8)
    runs = []
    for name, ckpt in (("from_sh", sh), ("from_te", te)):
        out, text = _train(tmp_path, name, 1, one, "--resume", ckpt)
        assert "resumed from" in text
        runs.append(_losses(out))
    assert sorted(runs[0]) == [6, 7, 8] and runs[0] == runs[1]


@pytest.mark.mpi
@pytest.mark.slow
def test_checkpoint_resumes_under_sharded_tensor(tmp_path, tokens):
    """Resumed on 2 ranks (1 replica x 2-way) from a 1-rank data checkpoint
    (each rank takes its tensor shard of the whole weights and moments, then
    its ZeRO shard of those), the run ends where scheme tensor resumed from
    the same file does, bit for bit."""
    start, _ = _train(tmp_path, "start", 1, gpt_config(tokens, iters=2))
    ends = []
    for scheme in ("tensor", "sharded"):
        out, text = _train(tmp_path, scheme, 2, _gpt(tokens, scheme, iters=4), "--resume",
                           start / "latest.h5")
        assert "resumed from" in text
        ends.append(_params(out / "latest.h5"))
    _same(*ends)


@pytest.mark.mpi
def test_clipping_as_tensor(tmp_path, tokens, train_once):
    """SGD with momentum clipped to a global norm of 0.05 (the clip acts:
    the weights differ from the unclipped run's) on 2 replicas x 2-way: the
    norm over every rank's ZeRO shards of its tensor shard's gradients (a
    whole weight counted on tensor shard 0 only; one allreduce over the
    world) clips as scheme tensor's norm over its tensor group does, bit
    for bit: the squares are summed in another order (per ZeRO shard, then
    over the world, against per tensor rank, then over the group), but in
    float64 (ops/clip.py), which moves the norm by ~1e-16, below the
    float32 clip factor's rounding."""
    plain, _ = _tensor_ref(train_once, tokens, 4, "sgd")
    ref, _ = _tensor_ref(train_once, tokens, 4, "sgd", clip=0.05)
    out, _ = _train(tmp_path, "sharded", 4, _gpt(tokens, "sharded", "sgd", clip=0.05))
    want = _params(ref / "latest.h5")
    _same(want, _params(out / "latest.h5"))
    unclipped = _params(plain / "latest.h5")
    assert any(not np.allclose(want[k], unclipped[k], rtol=1e-3) for k in want)


@pytest.mark.parametrize("shard", [1, 2])
def test_clip_norm_counts_each_weight_once(tokens, shard):
    """Offline: the clip's allreduce of the squared norms is over every
    rank, between the last reduce-scatter and the first gather; on tensor
    shard 1 the whole (replicated) weights' shards count 0, the split
    weights' their scale; on tensor shard 0 every one counts."""
    cfg = make_job(_gpt(tokens, "sharded", "sgd", clip=0.05, shard=shard))
    for rank in range(4):
        g = compose_for(cfg, 4, rank)
        assert g.ops["clip.sum"].attrs["group"] == [0, 1, 2, 3]
        seq = g.ops["clip.sum"].attrs["seq"]
        rs = [op.attrs["seq"] for op in g.ops.values() if op.op_type == "ReduceScatter"]
        ag = [op.attrs["seq"] for op in g.ops.values() if op.op_type == "Allgather"]
        assert max(rs) < seq < min(ag)
        assert_clip_scales(g, rank)


def assert_clip_scales(g, rank):
    """Rank ``rank`` of 2 x 2-way's clip norm: every split weight's square
    counts half (the tensor shards' sums are added), a whole weight's only
    on tensor shard 0 (0 on shard 1, not counted twice)."""
    from purine_mpi.parallel.tensor_parallel import split_of
    norm = g.ops["clip.norm"]
    params = [b for b, blob in g.blobs.items() if blob.kind == "param"]
    split = {p for p in params if split_of(g.blobs[p])}
    assert split and len(split) < len(params)
    scales = {}
    for gr, scale in zip(norm.inputs, norm.attrs["scales"]):  # <param>.grad.shard[a:b]
        scales.setdefault(gr.split(".grad.shard[")[0] in split, set()).add(scale)
    assert scales == {True: {0.5}, False: {0.0 if rank % 2 else 0.5}}, rank


def test_graph_np_and_plan_say_what_each_rank_holds(tmp_path, tokens):
    path = write_config_file(tmp_path, _gpt(tokens, "sharded"), "s.yaml")
    res = run_cli_here("graph", path, "--np", "4", "--rank", "3")
    assert res.returncode == 0, res.stderr
    assert ("rank 3 = replica 1, tensor shard 1; sharded (ZeRO): rank 3 holds shard 1 of 2 of "
            "every bucket's optimizer state of its tensor shard, reduce-scattered and gathered "
            "over ranks [1, 3]") in res.stdout
    assert "tensor-parallel split over ranks [2, 3] (rank 3 = replica 1, shard 1)" \
        in res.stdout
    assert "sharded buckets (shard 1 of 2, over ranks [1, 3]" in res.stdout
    res = run_cli_here("plan", path, "--np", "4")
    assert res.returncode == 0, res.stderr
    assert "[sharded: 2 replicas x 2-way tensor, 4 ranks]" in res.stdout
    for rank in range(4):
        ms = _bytes(_gpt(tokens, "sharded"), 4, rank)
        assert (f"({ms['weights']} + {ms['gradients']} + {ms['optimizer_state']} bytes held"
                in res.stdout), rank


def test_one_rank_notes_the_tensor_split(tokens):
    from purine_mpi.parallel.compose import settings_without_effect
    notes = settings_without_effect(make_job(_gpt(tokens, "sharded")), 1)
    assert any("parallel.scheme sharded has no effect on 1 rank: the net runs unsplit" in n
               for n in notes), notes
    assert not any("tensor_parallel" in n for n in notes), notes
    assert not any("tensor_parallel" in n
                   for n in settings_without_effect(make_job(_gpt(tokens, "sharded")), 4))


def test_one_replica_notes_that_sharding_divides_nothing(tokens):
    """2 ranks of a 2-way tensor split are one replica: no other rank
    shares a tensor shard's state, so it runs as scheme tensor: the
    start-up notes say so (and that shard and the bucket keys have no
    effect); 4 ranks (2 replicas) say nothing of it."""
    from purine_mpi.parallel.compose import settings_without_effect
    job = make_job(_gpt(tokens, "sharded", shard=2))
    notes = settings_without_effect(job, 2)
    assert notes[0].startswith("note: parallel.bucket_mb, parallel.first_bucket_mb shape "
                               "allreduce buckets") and notes[0].endswith(
        "the 2 ranks are one replica (2 tensor shards), whose gradients no other rank shares: "
        "it runs as scheme tensor, with no bucket, so they have no effect"), notes
    assert ["note: parallel.shard shapes how each replica's model state is sharded; the 2 "
            "ranks are one replica (2 tensor shards), which runs as scheme tensor: nothing is "
            "sharded, so it has no effect",
            "note: parallel.scheme sharded has no effect with 1 replica: the 2 ranks are its 2 "
            "tensor shards, whose model state no other rank shares, so it runs as scheme tensor "
            "(each rank holds its tensor shard's whole; start mpiexec -n 4 or more to shard "
            "it)"] == notes[1:], notes
    assert not any("1 replica" in n for n in settings_without_effect(job, 4))


@pytest.mark.parametrize("shard", [1, 3])
@pytest.mark.parametrize("change,np_,key,words", [
    ({"backend": "nccl"}, 4, "parallel.backend", "parallel.tensor_parallel"),
    # stage 3 takes one_sided (test_sharded3_tensor_windows), 1 and 2 without stages not
    ({"transport": "one_sided", "shard": 2}, 4, "parallel.transport",
     "one_sided with shard 2"),
    ({"micro_batches": 2}, 4, "parallel.micro_batches",
     "scheme sharded with parallel.tensor_parallel takes no micro-batches"),
    ({"mode": "sync_ps"}, 4, "parallel.mode", "parameter servers"),
    ({}, 3, "parallel.tensor_parallel", "scheme sharded runs replicas x 2 ranks"),
    ({"recompute": "full"}, 4, "recompute", "does not combine"),
    ({"device": 0}, 4, "parallel.tensor_parallel", "runs on the CPU"),
])
def test_what_is_not_built_exits_2(tmp_path, tokens, change, np_, key, words, shard):
    """The same refusals at every ZeRO stage (1; 3, which gathers the
    weights too)."""
    cfg = _gpt(tokens, "sharded", "sgd", shard=shard)
    change = dict(change)
    for top in ("recompute", "device"):
        if top in change:
            cfg[top] = change.pop(top)
    cfg["parallel"].update(change)
    res = run_cli_here("graph", write_config_file(tmp_path, cfg), "--np", str(np_))
    assert_user_error(res, key, words)
    assert re.search(r"key '[a-z_.]+'", res.stderr)


@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("shard", [1, 2])
def test_no_collective_is_posted_before_one_it_waits_for(tokens, shard, clip):
    """The collectives are posted in ``seq`` order: none may wait for one
    of a later ``seq`` (at stage 2 a bucket's writers wait for an earlier
    bucket's reduce-scatter, and a tensor allreduce waits for those
    writers: numbered after the tensor's allreduces, that reduce-scatter
    deadlocked the 2 ranks of 1 replica x 2-way); and each group's ranks
    post the same collectives in the same order (check_collectives'
    signature); with the clip's allreduce too."""
    from purine_mpi.comm.verify import comm_signature, compare_signatures
    from purine_mpi.graph.core import reachable
    cfg = make_job(_gpt(tokens, "sharded", "adamw", shard=shard, clip=clip))
    signatures = []
    for rank in range(4):
        g = compose_for(cfg, 4, rank)
        deps = g.dependencies()
        coll = {n: op.attrs["seq"] for n, op in g.ops.items()
                if op.op_type in ("ReduceScatter", "Allgather", "Allreduce")}
        late = [(a, b) for a in coll for b in reachable(a, deps) & set(coll)
                if coll[b] > coll[a]]
        assert late == [], (rank, late[:3])
        assert len(set(coll.values())) == len(coll)
        signatures.append(comm_signature(g))
    assert compare_signatures(signatures) == []
