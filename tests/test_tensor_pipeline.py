"""Tensor parallelism within pipeline stages (``scheme: pipeline`` with
``parallel.stages`` and ``parallel.tensor_parallel``; parallel/schemes/
pipeline.py): one replica of p stages x t tensor shards, rank = stage * t +
shard. Each stage's layers are split across its t ranks as scheme tensor
splits a net (column/row fc pairs, attention by heads, the activations
allreduced in the stage's group), shard k of a stage sends to shard k of
the next. On 4 ranks (2 stages x 2 shards) a 2-block GPT and a residual MLP
train as 1 rank does (SGD, AdamW, 2 micro-batches under 1F1B with
clipping), the checkpoints hold whole blobs (a 4-rank checkpoint resumes
on 1 rank with the same losses, and back; a stage ending at a row-split
fc with one micro-batch, which stalled, trains as 1 rank too, and every
rank's collectives in seq order make no cycle with the transfers), the start-up block and
``graph --np 4`` say what each rank holds, and what is not built (a GPU,
scheme tensor with stages, a world that is not whole replicas) exits 2
naming the keys.

Replicas of it (``scheme: hybrid`` with both keys, Megatron-LM's 3-D
layout): 8 ranks = 2 replicas x 2 stages x 2 shards train a one-block GPT
(SGD, 2 micro-batches, clipping) and the MLP (AdamW, clipping) as 1 rank
on the global batch, and the 8-rank checkpoint resumes on 1 rank. The
same layout under ``scheme: sharded`` (ZeRO over each (stage, shard)'s
replicas, Megatron's distributed optimizer): stage 1 and stage 3 (with
micro-batches) train as the same 1-rank twins within 1e-5, their
checkpoints resume on 1 rank, each rank holds hybrid's model state / R.

The 4- and 8-rank runs are few (each costs ~5-30 s on 2 cores): one module
fixture per layout trains each configuration once, the tests assert over
its outputs."""
import h5py
import numpy as np
import pytest

from purine_mpi.base.errors import UserError
from purine_mpi.runtime.footprint import model_state_bytes
from purine_mpi.tools.graph import compose_for, composed
from tests.conftest import (make_job, run_cli_args, run_cli_here, run_mpi_cli, train_here,
                            write_config_file)
from tests.gpt_nets import block_stages, gpt_config, text_h5
from tests.test_checkpoint_stream import written_order
from tests.test_cli import assert_user_error
from tests.test_micro_batches import _params
from tests.test_sharded_stages import STAGES
from tests.test_tensor_parallel import _close, _config, _losses, close_in_norm

ITERS = 5
#: AdamW over 5 steps with clipping that acts (as gpt_tiny's solver)
ADAMW = {"type": "adamw", "base_lr": 5e-3, "momentum": 0.9, "momentum2": 0.99,
         "weight_decay": 0.1, "clip_gradients": 0.5}


def _tp_pp(stages, **more):
    return {"scheme": "pipeline", "stages": stages, "tensor_parallel": 2, **more}


def _gpt(tokens, parallel=None, layers=2, **solver):
    cfg = gpt_config(tokens, layers=layers, solver="sgd", iters=ITERS, parallel=parallel)
    cfg["solver"].update(solver)
    return cfg


def _mlp(parallel=None, iters=ITERS, **solver):
    """The residual MLP of the tensor tests (fc1 -> relu -> fc2 split), cut
    by STAGES between fc1 and fc2: the column-split activation crosses."""
    cfg = _config(scheme="data", iters=iters, solver="adamw")
    cfg["solver"].update(ADAMW, **solver)
    cfg["parallel"] = parallel or {}
    cfg["checkpoint"] = {"interval": 3}
    return cfg


def _one_rank_twin(cfg):
    """The same job on 1 rank (micro-batches kept)."""
    par = cfg["parallel"]
    return dict(cfg, parallel={k: v for k, v in par.items() if k == "micro_batches"})


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return text_h5(tmp_path_factory.mktemp("tp_pp_tokens"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokens):
    """Each configuration trained once on 4 ranks (2 stages x 2 shards)
    and on 1 rank: {name: (run folder, stdout + stderr)}."""
    tmp = tmp_path_factory.mktemp("tp_pp_runs")
    jobs = {
        "gpt_sgd": _gpt(tokens, _tp_pp(block_stages())),
        # 2 micro-batches under 1F1B (the default), clipping, AdamW
        "gpt_micro": dict(_gpt(tokens, _tp_pp(block_stages(), micro_batches=2)),
                          solver=dict(gpt_config(tokens)["solver"], max_iter=ITERS,
                                      **ADAMW)),
        "mlp_adamw": _mlp(_tp_pp(dict(STAGES), transport="two_sided")),
        # stage 0 ends at a row split, one micro-batch, windows (a stall before)
        "headed": _headed(_tp_pp(dict(HEADED), stall_timeout=60)),
    }
    out = {}
    train = _trainer(tmp, out, timeout=600)

    for name, cfg in jobs.items():
        train(name, 4, cfg)
        train(f"{name}_one", 1, _one_rank_twin(cfg))
    # the 4-rank run's checkpoint of iteration 3 continued on 1 rank, and
    # the 1-rank run's on 4 ranks
    train("mlp_resumed_one", 1, _mlp(), "--resume", out["mlp_adamw"][0] / "ckpt_3.h5")
    train("mlp_resumed_four", 4, jobs["mlp_adamw"], "--resume",
          out["mlp_adamw_one"][0] / "ckpt_3.h5")
    return out


def _trainer(tmp, out, timeout):
    """``train(name, ranks, config, *extra args)``: one run in ``tmp/name``,
    under mpiexec above one rank; ``out[name]`` = (its folder, its output).
    A one-rank reference (no ``extra``) trains in this process
    (conftest.train_here): (its folder, None); so does a one-rank resume
    (``extra``: ``--resume CKPT`` alone): (its folder, the run's lines)."""
    def train(name, n, cfg, *extra):
        if n == 1 and not extra:
            out[name] = (train_here(cfg, tmp / name), None)
            return
        path = write_config_file(tmp, cfg, f"{name}.yaml")
        if n == 1 and len(extra) == 2 and extra[0] == "--resume":
            lines = []
            out[name] = (train_here(path, tmp / name, resume=extra[1], lines=lines),
                         "\n".join(lines))
            return
        args = ("train", path, "--out", tmp / name, *extra)
        res = run_mpi_cli(n, *args, timeout=timeout) if n > 1 else run_cli_args(*args)
        assert res.returncode == 0, res.stdout + res.stderr
        out[name] = (tmp / name, res.stdout + res.stderr)
    return train


def _weights(run):
    return {k: v for k, v in _params(run / "latest.h5").items() if k.startswith("params")}


# ------------------------------------------------------------ 4 ranks vs 1
@pytest.mark.mpi
def test_gpt_sgd_trains_as_one_rank(runs):
    four, one = runs["gpt_sgd"][0], runs["gpt_sgd_one"][0]
    _close(_params(one / "latest.h5"), _params(four / "latest.h5"))  # weights and momenta
    assert len(_losses(four)) == ITERS
    np.testing.assert_allclose(_losses(one), _losses(four), rtol=1e-5)


@pytest.mark.mpi
def test_gpt_adamw_micro_batches_and_clipping_train_as_one_rank(runs):
    """2 micro-batches under 1F1B with a clip that acts: every weight within
    1e-5 (norm-relative) but the k third of each qkv_bias, whose gradient
    is 0 in exact arithmetic (Adam follows rounding noise there, below 1e-5
    in absolute terms on both sides; test_tensor_parallel's gpt_tiny test)."""
    four, one = runs["gpt_micro"][0], runs["gpt_micro_one"][0]
    np.testing.assert_allclose(_losses(one), _losses(four), rtol=1e-5)
    close_in_norm(_weights(one), _weights(four))


@pytest.mark.mpi
def test_a_stage_ending_at_a_row_split_trains_as_one_rank(runs):
    """One micro-batch, stage 0 ending at m2b's allreduce (before: a stall
    on rank 0, 'm2b.tp_sum' posted after 'm2a.tp_grad_sum')."""
    four, one = runs["headed"][0], runs["headed_one"][0]
    _close(_params(one / "latest.h5"), _params(four / "latest.h5"))  # weights and momenta
    assert len(_losses(four)) == ITERS
    np.testing.assert_allclose(_losses(one), _losses(four), rtol=1e-5)


@pytest.mark.mpi
def test_mlp_adamw_cut_inside_a_split_pair_trains_as_one_rank(runs):
    """The stages cut between fc1 (columns) and fc2 (rows): shard k of stage
    0 sends its columns of the hidden activation to shard k of stage 1."""
    four, one = runs["mlp_adamw"][0], runs["mlp_adamw_one"][0]
    _close(_params(one / "latest.h5"), _params(four / "latest.h5"))
    np.testing.assert_allclose(_losses(one), _losses(four), rtol=1e-5)


@pytest.mark.mpi
def test_the_streamed_checkpoint_is_the_one_rank_files_datasets_in_order(runs):
    """The save streams each parameter's shards to rank 0 as its turn comes
    (parallel/schemes/base.py ``streamed_join``): the 4-rank file holds the
    1-rank twin's datasets (weights and AdamW state), written in its order
    (the values: the tests above)."""
    for name in ("gpt_micro", "mlp_adamw"):
        with h5py.File(runs[name][0] / "latest.h5") as four, \
                h5py.File(runs[f"{name}_one"][0] / "latest.h5") as one:
            assert written_order(four) == written_order(one), name


@pytest.mark.mpi
def test_checkpoints_resume_across_layouts(runs):
    """The 4-rank checkpoint of iteration 3 holds whole blobs: on 1 rank it
    gives iterations 4 and 5 the 1-rank run's losses (1e-6 relative); the
    1-rank checkpoint split on 4 ranks ends at the 1-rank run's weights."""
    ref = _losses(runs["mlp_adamw_one"][0])
    resumed = _losses(runs["mlp_resumed_one"][0])
    assert "resumed from" in runs["mlp_resumed_one"][1]
    assert len(resumed) == 2
    np.testing.assert_allclose(resumed, ref[3:], rtol=1e-6)
    _close(_params(runs["mlp_adamw_one"][0] / "latest.h5"),
           _params(runs["mlp_resumed_four"][0] / "latest.h5"))


@pytest.mark.mpi
def test_start_up_block_says_what_each_rank_holds(runs):
    text = runs["gpt_sgd"][1]
    assert "pipeline: 2 stages x 2-way tensor parallel (rank = stage x 2 + shard)" in text
    assert "stage 0      ranks 0-1: 10 layers" in text
    assert "stage 1      ranks 2-3: 11 layers" in text
    assert "stage 1 (ranks 2-3): b1_fc (columns, 64 -> 32 per rank) -> b1_gelu -> b1_proj" \
        in text


# ------------------------------------------------------------ offline
def test_each_rank_holds_its_stage_shard_offline(tokens, tmp_path):
    """Rank = stage * 2 + shard: the split allreduces stay in the stage's
    tensor group, the transfers go to the same shard of the other stage,
    the layers of the other stage are absent; graph --np 4 says it."""
    job = make_job(_gpt(tokens, _tp_pp(block_stages(), transport="two_sided")))
    for rank in range(4):
        g, comp = composed(job, 4, rank)
        stage, shard = divmod(rank, 2)
        lay = comp.layout
        assert (lay.stage, lay.shard, lay.replicas) == (stage, shard, 1)
        mine, other = f"b{stage}_attn", f"b{1 - stage}_attn"
        assert g.blobs[f"{mine}/qkv_weight"].shape == (24, 16)
        assert g.blobs[f"{mine}/qkv_weight"].attrs["tensor_split"]["index"] == shard
        assert f"{other}/qkv_weight" not in g.blobs
        groups = {tuple(op.attrs["group"]) for op in g.ops.values()
                  if op.op_type == "Allreduce"}
        assert groups == {(2 * stage, 2 * stage + 1)}
        peers = {op.attrs["peer"] for op in g.ops.values() if op.op_type in ("Send", "Recv")}
        assert peers == {2 * (1 - stage) + shard}
    path = write_config_file(tmp_path, _gpt(tokens, _tp_pp(block_stages())), "g.yaml")
    res = run_cli_here("graph", path, "--np", "4", "--rank", "3")
    assert res.returncode == 0, res.stderr
    assert "rank 3 = stage 1, tensor shard 1 of 2; transfers with ranks [1, 3]" in res.stdout
    assert "tensor-parallel split over ranks [2, 3] (rank 3 = replica 0, stage 1, shard 1)" \
        in res.stdout
    assert "stage 0 (ranks 0-1): b0_attn (heads, 4 -> 2 per rank" in res.stdout


def test_micro_batch_allreduces_post_in_schedule_order(tokens):
    """The copies of a tensor allreduce share the whole graph's seq; the
    slice numbers them in its (1F1B schedule's) emission order, so the posting
    order (by seq) never puts a later micro-batch's forward allreduce
    before an earlier one's backward allreduce that it waits for."""
    job = make_job(_gpt(tokens, _tp_pp(block_stages(), micro_batches=2)))
    for rank in (2, 3):
        g = compose_for(job, 4, rank)
        topo = [op.name for op in g.topo_order() if op.op_type == "Allreduce"
                and op.attrs["group"] == [2, 3]]
        posted = sorted(topo, key=lambda n: g.ops[n].attrs["seq"])
        assert posted == topo and len(topo) == 8   # 2 pairs x fwd/bwd x 2 copies
        # 1F1B on the last stage: copy 0's backward before copy 1's forward
        assert topo.index("b1_attn.qkv.tp_grad_sum@mb0") < topo.index("b1_attn.proj.tp_sum@mb1")


def _headed(parallel=None, iters=ITERS):
    """Two MLP pairs (m1a columns -> relu -> m1b rows, m2a -> relu -> m2b)
    under a classifier head, each fc's top named after it: cut by
    ``HEADED`` stage 0 ends at m2b's allreduce (a row split: Megatron's
    g), whose sum stage 1 receives, and m2a's backward allreduce (f) waits
    for stage 1's gradient."""
    net = [{"type": "fc", "name": "m1a", "bottom": "data", "top": "m1a", "num_output": 16},
           {"type": "relu", "name": "r1", "bottom": "m1a", "top": "m1a"},
           {"type": "fc", "name": "m1b", "bottom": "m1a", "top": "m1b", "num_output": 8},
           {"type": "fc", "name": "m2a", "bottom": "m1b", "top": "m2a", "num_output": 16},
           {"type": "relu", "name": "r2", "bottom": "m2a", "top": "m2a"},
           {"type": "fc", "name": "m2b", "bottom": "m2a", "top": "m2b", "num_output": 8},
           {"type": "fc", "name": "head", "bottom": "m2b", "top": "head", "num_output": 5},
           {"type": "softmax_loss", "name": "loss", "bottom": ["head", "label"],
            "top": "loss"}]
    return {"name": "headed", "seed": 5,
            "data": {"train": {"source": "synthetic", "shape": [6], "classes": 5,
                               "batch_size": 8}},
            "net": net,
            "solver": {"type": "sgd", "base_lr": 0.05, "momentum": 0.9, "max_iter": iters,
                       "display": 1, "test_interval": 0},
            "checkpoint": {"interval": 0}, "parallel": parallel or {}}


HEADED = {"m1a": 0, "r1": 0, "m1b": 0, "m2a": 0, "r2": 0, "m2b": 0, "head": 1, "loss": 1}


def cross_rank_cycle(slices):
    """One iteration of every rank's slice (``slices``, by rank) as one
    graph: each rank's dependencies, its collectives chained in ``seq``
    order (as they are posted), each collective one node for its whole
    group, each Put / Send before the WaitWrite / Recv it matches (same
    ``seq``, peers swapped). Returns the ops on or behind a cycle (the
    ranks would stall), else []."""
    from purine_mpi.ops.catalog import get_kernel_class

    def node(r, op):
        if op.op_type in ("Allreduce", "ReduceScatter", "Allgather", "Broadcast"):
            return ("all", tuple(op.attrs.get("group", range(len(slices)))), op.name)
        return (r, op.name)

    edges = set()
    ends = {}   # (receiving rank, seq, sending rank): the op that waits for the data
    for r, g in enumerate(slices):
        for n, before in g.dependencies().items():
            edges.update((node(r, g.ops[p]), node(r, g.ops[n])) for p in before)
        ordered = sorted((op for op in g.ops.values() if "seq" in op.attrs
                          and get_kernel_class(op.op_type).seq_ordered),
                         key=lambda op: op.attrs["seq"])
        edges.update((node(r, a), node(r, b)) for a, b in zip(ordered, ordered[1:]))
        for op in g.ops.values():
            if op.op_type in ("WaitWrite", "Recv"):
                ends[(r, op.attrs["seq"], op.attrs["peer"])] = node(r, op)
    for r, g in enumerate(slices):
        for op in g.ops.values():
            if op.op_type in ("Put", "Send"):
                edges.add((node(r, op), ends[(op.attrs["peer"], op.attrs["seq"], r)]))
    nodes = {n for e in edges for n in e} | {node(r, op) for r, g in enumerate(slices)
                                             for op in g.ops.values()}
    left = {n: 0 for n in nodes}
    for _, b in edges:
        left[b] += 1
    ready = [n for n, k in left.items() if k == 0]
    while ready:
        n = ready.pop()
        for a, b in edges:
            if a == n:
                left[b] -= 1
                if left[b] == 0:
                    ready.append(b)
    return sorted(str(n) for n, k in left.items() if k > 0)


@pytest.mark.parametrize("micro, transport", [(1, "auto"), (1, "two_sided"), (2, "auto")])
def test_a_stage_ending_at_a_row_split_posts_its_allreduce_first(micro, transport):
    """Stage 0 ends at m2b's allreduce, whose sum stage 1 receives; m2a's
    backward allreduce waits for stage 1's gradient. Numbered in the
    slice's topological order, one micro-batch with windows put m2a's
    before m2b's (the gradient's wait has no inputs: ready from the start,
    it pulled the backward ahead), and the ranks stalled (``bench``: rank 0
    waiting on 'm2b.grad.wait', 'm2b.tp_sum' posted after
    'm2a.tp_grad_sum'). Every rank's slice, its collectives in seq order,
    the transfers matched: no cycle."""
    job = make_job(_headed(_tp_pp(dict(HEADED), micro_batches=micro, transport=transport)))
    slices = [compose_for(job, 4, r) for r in range(4)]
    assert cross_rank_cycle(slices) == []
    seq = {n: op.attrs["seq"] for n, op in slices[0].ops.items() if op.op_type == "Allreduce"
           and op.attrs["group"] == [0, 1]}
    tag = "@mb0" if micro > 1 else ""
    assert seq[f"m2b.tp_sum{tag}"] < seq[f"m2a.tp_grad_sum{tag}"]


@pytest.mark.parametrize("shard", [2, 3])
def test_3d_sharded_stage_ending_at_a_row_split_posts_its_allreduce_first(shard):
    """The same cut under scheme sharded (8 ranks = 2 replicas x 2 stages
    x 2 shards, offline): ``sequence_collectives`` puts each allreduce
    before the first op that waits for it in emission order; appended last
    by the split, m2b's came after m2a's backward one (a cycle with both
    transports) until the split emits each allreduce after its partial."""
    job = make_job(_headed({"scheme": "sharded", "shard": shard, "stages": dict(HEADED),
                            "tensor_parallel": 2, "transport": "two_sided"}))
    assert cross_rank_cycle([compose_for(job, 8, r) for r in range(8)]) == []


def test_clipping_adds_every_rank_and_counts_replicated_weights_once():
    """The clip's sum of squares is allreduced over all 4 ranks; shard 1 of
    a stage counts only its split weights (a replicated one: scale 0)."""
    job = make_job(_mlp(_tp_pp(dict(STAGES))))
    for rank in range(4):
        g = compose_for(job, 4, rank)
        assert g.ops["clip.sum"].attrs["group"] == [0, 1, 2, 3]
        norm = g.ops["clip.norm"]
        scales = dict(zip(norm.inputs, norm.attrs["scales"]))
        whole = [k for k in scales if k.startswith(("fc0/", "out/", "fc2/bias"))]
        assert whole and all((scales[k] == 0.0) == (rank % 2 == 1) for k in whole)
        split = [k for k in scales if k.startswith(("fc1/", "fc2/weight"))]
        assert split and all(scales[k] != 0.0 for k in split)


# ------------------------------------------------------------ refusals
def test_scheme_tensor_with_stages_exits_2(tmp_path):
    """Scheme tensor with stages (before: it ran, ignoring the stages) exits
    2 pointing at schemes pipeline and hybrid."""
    key = "parallel.stages"
    cfg = _mlp(dict(_tp_pp(dict(STAGES)), scheme="tensor"))
    res = run_cli_here("train", write_config_file(tmp_path, cfg), "--out", tmp_path / "r")
    assert_user_error(res, key, f"scheme tensor with {key} is refused",
                      "use scheme: pipeline or hybrid")


@pytest.mark.parametrize("world,words", [
    (2, "does not fit it; start 4 ranks"),
    (8, "is several replicas of it: use scheme: hybrid .* start 4 ranks"),
])
def test_a_world_other_than_stages_times_shards_is_a_user_error(world, words):
    """Scheme pipeline is one replica of 2 stages x 2 shards, 4 ranks: 8
    (two replicas) is scheme hybrid's, 2 is too few; the error names both
    keys."""
    with pytest.raises(UserError, match="keys 'parallel.stages', 'parallel.tensor_parallel'"
                                        f".*world size {world} {words}"):
        compose_for(make_job(_mlp(_tp_pp(dict(STAGES)))), world, 0)


@pytest.mark.parametrize("scheme", ["pipeline", "hybrid"])
def test_a_gpu_is_refused(scheme):
    cfg = _mlp(dict(_tp_pp(dict(STAGES)), scheme=scheme))
    cfg["device"] = 0
    with pytest.raises(UserError, match="key 'parallel.tensor_parallel': scheme pipeline with "
                                        "tensor parallelism runs on the CPU"):
        compose_for(make_job(cfg), 4 if scheme == "pipeline" else 8, 0)


# ------------------------------------------------------------ 3-D: R replicas x p x t
def _three_d(stages, **more):
    return dict(_tp_pp(stages, **more), scheme="hybrid")


def _global_twin(cfg, replicas=2):
    """The same job on 1 rank with the global batch (R x the per-rank batch)."""
    twin = dict(cfg, parallel={}, data=dict(cfg["data"]))
    twin["data"]["train"] = dict(cfg["data"]["train"])
    twin["data"]["train"]["batch_size"] *= replicas
    return twin


@pytest.fixture(scope="module")
def runs3d(tmp_path_factory, tokens):
    """Each 3-D configuration (2 replicas x 2 stages x 2 shards) trained
    once on 8 ranks, and its 1-rank twin on the global batch: {name: (run
    folder, stdout + stderr)}. Each 8-rank run costs ~30 s on 2 cores."""
    tmp = tmp_path_factory.mktemp("tp_pp_3d")
    jobs = {
        # SGD with a clip, 2 micro-batches under 1F1B: each replica's copies
        # and its buckets
        "gpt_sgd": _gpt(tokens, _three_d(block_stages(1), micro_batches=2), layers=1,
                        base_lr=0.05, clip_gradients=0.5),
        # AdamW with a clip, the stages cut inside a split pair
        "mlp_adamw": _mlp(_three_d(dict(STAGES), transport="two_sided")),
    }
    out = {}
    train = _trainer(tmp, out, timeout=900)

    for name, cfg in jobs.items():
        train(name, 8, cfg)
        train(f"{name}_one", 1, _global_twin(cfg))
        # without the clip: it acts (the twin's weights differ)
        train(f"{name}_unclipped_one", 1, dict(_global_twin(cfg), solver=dict(
            cfg["solver"], clip_gradients=None)))
    # the 8-rank run's checkpoint of iteration 3 continued on 1 rank
    train("mlp_resumed_one", 1, _global_twin(jobs["mlp_adamw"]), "--resume",
          out["mlp_adamw"][0] / "ckpt_3.h5")
    # scheme sharded on the same layout (Megatron's distributed optimizer:
    # each (stage, shard)'s 2 replicas shard its buckets): the twins above
    # are theirs too, the global batch's 1-rank runs
    for name, (cfg, twin) in _ZERO.items():
        train(name, 8, cfg(tokens))
        if name.startswith("mlp"):
            train(f"{name}_resumed_one", 1, _global_twin(jobs[twin]), "--resume",
                  out[name][0] / "ckpt_3.h5")
    return out


def _zero3d(stages, shard, **more):
    return dict(_three_d(stages, **more), scheme="sharded", shard=shard)


#: {run: (its config from the tokens, the hybrid run whose 1-rank twin it trains as)}
_ZERO = {
    # AdamW with a clip that acts, the stages cut inside a split pair
    "mlp_zero1": (lambda tokens: _mlp(_zero3d(dict(STAGES), 1, transport="two_sided")),
                  "mlp_adamw"),
    # the weights sharded too, 2 micro-batches under 1F1B (each bucket
    # gathered once per iteration, the tensor allreduces among the gathers)
    "mlp_zero3": (lambda tokens: _mlp(_zero3d(dict(STAGES), 3, transport="two_sided",
                                              micro_batches=2, schedule="1f1b")), "mlp_adamw"),
    # attention split by heads, SGD with a clip, 2 micro-batches
    "gpt_zero3": (lambda tokens: _gpt(tokens, _zero3d(block_stages(1), 3, micro_batches=2),
                                      layers=1, base_lr=0.05, clip_gradients=0.5), "gpt_sgd"),
}


def _clip_acts(runs3d, name):
    """The 1-rank twin without the clip ends elsewhere: the clip acted."""
    a = _weights(runs3d[f"{name}_one"][0])
    b = _weights(runs3d[f"{name}_unclipped_one"][0])
    assert max(np.abs(a[k] - b[k]).max() for k in a) > 1e-3


@pytest.mark.mpi
def test_3d_gpt_sgd_micro_batches_clipping_trains_as_one_rank_on_the_global_batch(runs3d):
    """8 ranks = 2 replicas x (2 stages x 2 shards), batch 4 per replica, 2
    micro-batches, SGD with a clip that acts (its norm over one replica's 4
    ranks after the replicas' average): the losses and every weight as 1
    rank on batch 8 within 1e-5 (the sums go in another order: not bitwise)."""
    eight, one = runs3d["gpt_sgd"][0], runs3d["gpt_sgd_one"][0]
    assert len(_losses(eight)) == ITERS
    np.testing.assert_allclose(_losses(one), _losses(eight), rtol=1e-5)
    _close(_params(one / "latest.h5"), _params(eight / "latest.h5"))
    _clip_acts(runs3d, "gpt_sgd")


@pytest.mark.mpi
def test_3d_mlp_adamw_with_clipping_trains_as_one_rank_on_the_global_batch(runs3d):
    """AdamW with clip_gradients 0.5 (it acts), the stages cut inside a split
    pair: as 1 rank on the global batch within 1e-5."""
    eight, one = runs3d["mlp_adamw"][0], runs3d["mlp_adamw_one"][0]
    np.testing.assert_allclose(_losses(one), _losses(eight), rtol=1e-5)
    _close(_params(one / "latest.h5"), _params(eight / "latest.h5"))
    _clip_acts(runs3d, "mlp_adamw")


@pytest.mark.mpi
def test_3d_checkpoint_resumes_on_one_rank(runs3d):
    """The 8-rank checkpoint of iteration 3 holds whole blobs (replica 0's
    shards joined): on 1 rank with the global batch it gives iterations 4
    and 5 the 1-rank run's losses (1e-6 relative)."""
    ref = _losses(runs3d["mlp_adamw_one"][0])
    resumed = _losses(runs3d["mlp_resumed_one"][0])
    assert "resumed from" in runs3d["mlp_resumed_one"][1]
    assert len(resumed) == 2
    np.testing.assert_allclose(resumed, ref[3:], rtol=1e-6)


@pytest.mark.mpi
def test_3d_start_up_block_says_what_each_rank_holds(runs3d):
    text = runs3d["gpt_sgd"][1]
    assert ("hybrid: 2 replicas x 2 stages x 2-way tensor parallel (rank = (replica x 2 + "
            "stage) x 2 + shard)") in text
    assert "each (stage, shard)'s gradients allreduced over its 2 ranks" in text
    assert "batch          4 per pipeline x 2 pipelines = 8 global" in text
    # the embeddings' lookups count no FLOPs (job/stage_cut.py: matrix products only)
    assert "stage 0        ranks 0-1, 4-5: 2 layers (wte..wpe), 0.0% of the FLOPs" in text
    assert "stage 1        ranks 2-3, 6-7: 11 layers" in text
    assert "stage 1 (ranks 2-3, 6-7): b0_fc (columns, 64 -> 32 per rank)" in text


def test_3d_each_rank_holds_its_position_offline(tmp_path):
    """Rank = (replica * 2 + stage) * 2 + shard: the split allreduces stay in
    the replica's stage group, the buckets go over the 2 ranks of the same
    (stage, shard), the clip's sum over the replica's 4 ranks, a replicated
    weight counted on shard 0 only; each replica reads its half of the data
    (shard r of 2); graph --np 8 says it."""
    job = make_job(_mlp(_three_d(dict(STAGES), transport="two_sided")))
    for rank in range(8):
        g, comp = composed(job, 8, rank)
        lay = comp.layout
        replica, rest = divmod(rank, 4)
        stage, shard = divmod(rest, 2)
        assert (lay.replica, lay.stage, lay.shard, lay.replicas) == (replica, stage, shard, 2)
        tensor = (4 * replica + 2 * stage, 4 * replica + 2 * stage + 1)
        position = (2 * stage + shard, 4 + 2 * stage + shard)
        groups = {tuple(op.attrs["group"]) for op in g.ops.values()
                  if op.op_type == "Allreduce"}
        assert groups == {tensor, position, tuple(range(4 * replica, 4 * replica + 4))}
        assert comp.bucket_plan and all(b["group"] == list(position) for b in comp.bucket_plan)
        assert g.ops["clip.sum"].attrs["group"] == list(range(4 * replica, 4 * replica + 4))
        norm = g.ops["clip.norm"]
        scales = dict(zip(norm.inputs, norm.attrs["scales"]))
        whole = [k for k in scales if k.startswith(("fc0/", "out/", "fc2/bias"))]
        assert whole and all((scales[k] == 0.0) == (shard == 1) for k in whole)
        peers = {op.attrs["peer"] for op in g.ops.values() if op.op_type in ("Send", "Recv")}
        assert peers == {4 * replica + 2 * (1 - stage) + shard}
        readers = {(int(op.attrs["rank"]), int(op.attrs["world_size"]))
                   for op in g.ops.values() if op.op_type == "DataReader"}
        assert readers == ({(replica, 2)} if stage == 0 else set())
    path = write_config_file(tmp_path, _mlp(_three_d(dict(STAGES))), "g.yaml")
    res = run_cli_here("graph", path, "--np", "8", "--rank", "7")
    assert res.returncode == 0, res.stderr
    assert ("rank = (replica * 2 + stage) * 2 + shard; rank 7 = replica 1, stage 1, tensor "
            "shard 1 of 2; transfers with ranks [5, 7]") in res.stdout
    assert "gradients allreduced over ranks [3, 7] (this stage, this shard)" in res.stdout


def test_3d_buckets_in_bf16(tmp_path):
    """parallel.grad_dtype: bf16 rounds the replicas' buckets (not the
    tensor groups' activations) to bfloat16, as hybrid does."""
    job = make_job(_mlp(_three_d(dict(STAGES), grad_dtype="bf16")))
    g, comp = composed(job, 8, 5)
    wire = {op.attrs.get("wire_dtype") for op in g.ops.values()
            if op.op_type == "Allreduce" and op.attrs["group"] == [1, 5]}
    assert wire == {job.parallel.wire_dtype()} and None not in wire
    tensor = {op.attrs.get("wire_dtype") for op in g.ops.values()
              if op.op_type == "Allreduce" and op.attrs["group"] == [4, 5]}
    assert tensor == {None}


def test_3d_one_replica_is_scheme_pipeline(tokens):
    """Scheme hybrid with tensor_parallel on p·t ranks is one replica: the
    same graphs as scheme pipeline with tensor_parallel (no bucket)."""
    cfg = _gpt(tokens, _tp_pp(block_stages(1)), layers=1)
    for rank in range(4):
        a = compose_for(make_job(cfg), 4, rank)
        b = compose_for(make_job(dict(cfg, parallel=_three_d(block_stages(1)))), 4, rank)
        assert sorted(a.ops) == sorted(b.ops)
        assert {n: op.attrs.get("group") for n, op in a.ops.items()} == \
            {n: op.attrs.get("group") for n, op in b.ops.items()}


@pytest.mark.parametrize("world", [4 * 3 - 2, 6])
def test_3d_a_world_not_a_multiple_of_stages_times_shards_is_a_user_error(world):
    """2 stages x 2 shards: 10 or 6 ranks are not whole replicas."""
    with pytest.raises(UserError, match="keys 'parallel.stages', 'parallel.tensor_parallel': "
                                        f"scheme hybrid .* world size {world} is not a "
                                        "multiple of 4"):
        compose_for(make_job(_mlp(_three_d(dict(STAGES)))), world, 0)


# -------------------------------------- 3-D with ZeRO: scheme sharded, stages, tensor
@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(_ZERO))
def test_3d_sharded_trains_as_one_rank_on_the_global_batch(runs3d, name):
    """8 ranks = 2 replicas x 2 stages x 2 tensor shards under scheme
    sharded (ZeRO stage 1: the optimizer state of each (stage, shard)
    halved over its 2 replicas; stage 3: its weights and gradients too):
    the losses, every weight and the saved optimizer state (AdamW's
    moments, SGD's momenta: joined whole) as the 1-rank twin on the global
    batch within 1e-5, as the hybrid runs; the start-up block says it."""
    stage = int(name[-1])
    eight, text = runs3d[name]
    one = runs3d[f"{_ZERO[name][1]}_one"][0]
    np.testing.assert_allclose(_losses(one), _losses(eight), rtol=1e-5)
    _close(_params(one / "latest.h5"), _params(eight / "latest.h5"))
    assert (f"sharded (ZeRO stage {stage}): 2 replicas x 2 stages x 2-way tensor parallel "
            "(rank = (replica x 2 + stage) x 2 + shard;") in text
    assert ("each (stage, tensor shard)'s gradients reduce-scattered over its 2 ranks (this "
            "rank's: 0, 4)") in text
    assert "of every bucket of its stage and tensor shard" in text


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["mlp_zero1", "mlp_zero3"])
def test_3d_sharded_checkpoint_resumes_on_one_rank(runs3d, name):
    """The sharded 8-rank checkpoint of iteration 3 (each position's shards
    joined, then the tensor shards, streamed to rank 0) holds the whole
    weights and AdamW moments: continued on 1 rank it gives the twin's
    last losses."""
    ref = _losses(runs3d["mlp_adamw_one"][0])
    resumed, text = runs3d[f"{name}_resumed_one"]
    assert "resumed from" in text
    np.testing.assert_allclose(_losses(resumed), ref[3:], rtol=1e-6)


@pytest.mark.parametrize("shard", [1, 3])
def test_3d_sharded_model_state_is_the_3d_layouts_over_r(tmp_path, shard):
    """From each rank's composed graph (offline) and ``plan --np 8``: the
    model state a rank holds is ZeRO's formula over its (stage, shard)'s
    2 replicas, against the unsharded 3-D layout (scheme hybrid) of the
    same rank: stage 1 the optimizer state halved (within one element per
    bucket), stage 3 the weights and gradients too; the buckets go over
    the rank's position's replicas, the activations' allreduces over its
    tensor group."""
    sharded = _mlp(_zero3d(dict(STAGES), shard, transport="two_sided"))
    plain = _mlp(_three_d(dict(STAGES), transport="two_sided"))
    held = {}
    for rank in range(8):
        g, comp = composed(make_job(sharded), 8, rank)
        lay = comp.layout
        base = model_state_bytes(composed(make_job(plain), 8, rank)[0])
        mine = held[rank] = model_state_bytes(g)
        buckets = len(comp.shard_plan)
        assert buckets > 1
        assert all(e["group"] == lay.stage_ranks() == [rank % 4, rank % 4 + 4]
                   for e in comp.shard_plan)
        assert abs(mine["optimizer_state"] - base["optimizer_state"] / 2) <= 8 * buckets
        for k in ("weights", "gradients"):
            if shard == 1:
                assert mine[k] == base[k], (rank, k)
            else:
                assert abs(mine[k] - base[k] / 2) <= 4 * buckets, (rank, k, mine, base)
        tensor = {tuple(op.attrs["group"]) for op in g.ops.values()
                  if op.op_type == "Allreduce" and op.name != "clip.sum"}
        assert tensor == {tuple(lay.tensor_ranks())}
    res = run_cli_here("plan", write_config_file(tmp_path, sharded, "s.yaml"), "--np", "8")
    assert res.returncode == 0, res.stderr
    assert "[sharded: 2 replicas x 2 stages x 2-way tensor, 8 ranks]" in res.stdout
    for rank, ms in held.items():
        assert (f"({ms['weights']} + {ms['gradients']} + {ms['optimizer_state']} bytes held"
                in res.stdout), rank
    res = run_cli_here("graph", tmp_path / "s.yaml", "--np", "8", "--rank", "7")
    assert res.returncode == 0, res.stderr
    what = "optimizer state" if shard == 1 else "weights, gradients and optimizer state"
    assert ("rank 7 = replica 1, stage 1, tensor shard 1 of 2; transfers with ranks [5, 7]"
            in res.stdout)
    assert (f"sharded (ZeRO): rank 7 holds shard 1 of 2 of every bucket's {what} of this "
            "stage and tensor shard, reduce-scattered and gathered over ranks [3, 7] (this "
            "stage's replicas of this tensor shard)") in res.stdout


@pytest.mark.parametrize("change,key,words", [
    ({"device": 0}, "parallel.stages", "runs on the CPU"),
    ({"backend": "nccl"}, "parallel.backend", "parallel.stages"),
    ({"recompute": "full"}, "recompute", "does not combine"),
])
def test_3d_sharded_what_is_not_built_exits_2(tmp_path, change, key, words):
    """The refusals of sharded x stages and TP x PP stand on the 3-D layout."""
    cfg = _mlp(_zero3d(dict(STAGES), 3), clip_gradients=None)  # nccl refuses a clip first
    change = dict(change)
    for top in ("recompute", "device"):
        if top in change:
            cfg[top] = change.pop(top)
    cfg["parallel"].update(change)
    res = run_cli_here("graph", write_config_file(tmp_path, cfg), "--np", "8")
    assert_user_error(res, key, words)


@pytest.mark.parametrize("shard", [2, 3])
def test_3d_sharded_collectives_post_in_the_schedules_order(tokens, shard):
    """Stages 2 and 3 number the buckets' reduce-scatters and gathers among
    the tensor groups' allreduces: the allreduces keep the 1F1B order
    pipeline gives them (stage 0 holds a block, whose forward and backward
    allreduces interleave: F0 F1 B0 F2 B1 ..., not the emission order's F0
    B0 F1 B1), and no collective is posted before one it waits for."""
    from purine_mpi.graph.core import reachable
    job = make_job(_gpt(tokens, _zero3d(block_stages(), shard, micro_batches=4,
                                        schedule="1f1b")))
    for rank in (0, 3):
        g = compose_for(job, 8, rank)
        group = [rank - rank % 2, rank - rank % 2 + 1]
        topo = [op.name for op in g.topo_order() if op.op_type == "Allreduce"
                and op.attrs["group"] == group]
        assert topo == sorted(topo, key=lambda n: g.ops[n].attrs["seq"]), rank
        seq = {n: op.attrs["seq"] for n, op in g.ops.items()
               if op.op_type in ("Allreduce", "ReduceScatter", "Allgather")}
        deps = g.dependencies()
        assert not [(n, m) for n in seq for m in reachable(n, deps) & set(seq)
                    if seq[m] > seq[n]], rank
