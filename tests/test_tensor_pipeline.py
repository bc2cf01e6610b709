"""Tensor parallelism within pipeline stages (``scheme: pipeline`` with
``parallel.stages`` and ``parallel.tensor_parallel``; parallel/schemes/
pipeline.py): one replica of p stages x t tensor shards, rank = stage * t +
shard. Each stage's layers are split across its t ranks as scheme tensor
splits a net (column/row fc pairs, attention by heads, the activations
allreduced in the stage's group), shard k of a stage sends to shard k of
the next. On 4 ranks (2 stages x 2 shards) a 2-block GPT and a residual MLP
train as 1 rank does (SGD, AdamW, 2 micro-batches under 1F1B with
clipping), the checkpoints hold whole blobs (a 4-rank checkpoint resumes
on 1 rank with the same losses, and back), the start-up block and
``graph --np 4`` say what each rank holds, and what is not built (several
replicas, a GPU, the other schemes' spellings) exits 2 naming the keys.

The 4-rank runs are few (each costs ~10 s on 2 cores): one module fixture
trains each configuration once, the tests assert over its outputs."""
import numpy as np
import pytest

from purine_mpi.base.errors import UserError
from purine_mpi.tools.graph import compose_for, composed
from tests.conftest import make_job, run_cli_args, run_mpi_cli, write_config_file
from tests.gpt_nets import block_stages, gpt_config, text_h5
from tests.test_cli import assert_user_error
from tests.test_micro_batches import _params
from tests.test_sharded_stages import STAGES
from tests.test_tensor_parallel import _close, _config, _losses

ITERS = 5
#: AdamW over 5 steps with clipping that acts (as gpt_tiny's solver)
ADAMW = {"type": "adamw", "base_lr": 5e-3, "momentum": 0.9, "momentum2": 0.99,
         "weight_decay": 0.1, "clip_gradients": 0.5}


def _tp_pp(stages, **more):
    return {"scheme": "pipeline", "stages": stages, "tensor_parallel": 2, **more}


def _gpt(tokens, parallel=None, **solver):
    cfg = gpt_config(tokens, solver="sgd", iters=ITERS, parallel=parallel)
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
    }
    out = {}

    def train(name, n, cfg, *extra):
        path = write_config_file(tmp, cfg, f"{name}.yaml")
        args = ("train", path, "--out", tmp / name, *extra)
        res = run_mpi_cli(n, *args, timeout=600) if n > 1 else run_cli_args(*args)
        assert res.returncode == 0, res.stdout + res.stderr
        out[name] = (tmp / name, res.stdout + res.stderr)

    for name, cfg in jobs.items():
        train(name, 4, cfg)
        train(f"{name}_one", 1, _one_rank_twin(cfg))
    # the 4-rank run's checkpoint of iteration 3 continued on 1 rank, and
    # the 1-rank run's on 4 ranks
    train("mlp_resumed_one", 1, _mlp(), "--resume", out["mlp_adamw"][0] / "ckpt_3.h5")
    train("mlp_resumed_four", 4, jobs["mlp_adamw"], "--resume",
          out["mlp_adamw_one"][0] / "ckpt_3.h5")
    return out


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
    a, b = _weights(one), _weights(four)
    assert sorted(a) == sorted(b) and a
    for name in a:
        x, y = a[name], b[name]
        if name.endswith("qkv_bias"):
            x, y = x.reshape(3, -1), y.reshape(3, -1)
            assert np.abs(x[1]).max() < 1e-5 and np.abs(y[1]).max() < 1e-5, name
            x, y = x[[0, 2]], y[[0, 2]]
        assert np.linalg.norm(x - y) <= 1e-5 * np.linalg.norm(x), name


@pytest.mark.mpi
def test_mlp_adamw_cut_inside_a_split_pair_trains_as_one_rank(runs):
    """The stages cut between fc1 (columns) and fc2 (rows): shard k of stage
    0 sends its columns of the hidden activation to shard k of stage 1."""
    four, one = runs["mlp_adamw"][0], runs["mlp_adamw_one"][0]
    _close(_params(one / "latest.h5"), _params(four / "latest.h5"))
    np.testing.assert_allclose(_losses(one), _losses(four), rtol=1e-5)


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
    res = run_cli_args("graph", path, "--np", "4", "--rank", "3")
    assert res.returncode == 0, res.stderr
    assert "rank 3 = stage 1, tensor shard 1 of 2; transfers with ranks [1, 3]" in res.stdout
    assert "tensor-parallel split over ranks [2, 3] (rank 3 = replica 0, stage 1, shard 1)" \
        in res.stdout
    assert "stage 0 (ranks 0-1): b0_attn (heads, 4 -> 2 per rank" in res.stdout


def test_micro_batch_allreduces_post_in_schedule_order(tokens):
    """The copies of a tensor allreduce share the whole graph's seq; the
    slice numbers them in its (1F1B) topological order, so the posting
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
@pytest.mark.parametrize("parallel,key", [
    ({"scheme": "hybrid"}, "parallel.tensor_parallel"),
    ({"scheme": "tensor"}, "parallel.stages"),
])
def test_other_spellings_exit_2(tmp_path, parallel, key):
    """Scheme hybrid with tensor_parallel and scheme tensor with stages
    (before: each ran, ignoring the other key) exit 2 pointing at scheme
    pipeline."""
    cfg = _mlp(dict(_tp_pp(dict(STAGES)), **parallel))
    res = run_cli_args("train", write_config_file(tmp_path, cfg), "--out", tmp_path / "r")
    assert_user_error(res, key, f"scheme {parallel['scheme']} with {key} is refused",
                      "use scheme: pipeline")


@pytest.mark.parametrize("world", [2, 8])
def test_a_world_other_than_stages_times_shards_is_a_user_error(world):
    """One replica of 2 stages x 2 shards is 4 ranks: 8 (two replicas) is
    not built, 2 is too few; the error names both keys."""
    with pytest.raises(UserError, match="keys 'parallel.stages', 'parallel.tensor_parallel'"
                                        ".*start 4 ranks"):
        compose_for(make_job(_mlp(_tp_pp(dict(STAGES)))), world, 0)


def test_a_gpu_is_refused():
    cfg = _mlp(_tp_pp(dict(STAGES)))
    cfg["device"] = 0
    with pytest.raises(UserError, match="key 'parallel.tensor_parallel': scheme pipeline with "
                                        "tensor parallelism runs on the CPU"):
        compose_for(make_job(cfg), 4, 0)
