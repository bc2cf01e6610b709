"""Tensor parallelism (``parallel.scheme: tensor``, parallel/tensor_parallel.py):
Megatron's split of an MLP block found in the net (columns, then rows),
one allreduce per block forward and one backward, composable with data
parallelism; a 2-way run trains like 1 rank (within 1e-5: weights and the
loss of every iteration), checkpoints hold whole blobs and load on another
layout, and bad degrees exit 2 naming the key."""
import json

import numpy as np
import pytest

from purine_mpi.base.errors import UserError
from purine_mpi.tools.graph import compose_for, render_graph
from tests.conftest import (make_job, run_cli_args, run_cli_here, run_mpi_cli, train_here,
                            write_config_file)
from tests.test_cli import assert_user_error
from tests.test_micro_batches import _params
from tests.gpt_nets import gpt_config, text_h5


def _config(scheme="tensor", degree=2, iters=4, batch=8, hidden=16, solver="adamw"):
    """A residual MLP block (fc0 -> [fc1 -> relu -> fc2] + fc0) under a
    classifier, on synthetic data: the block input needs a gradient, so
    the backward allreduce is there."""
    return {
        "name": "tp", "seed": 5,
        "data": {"train": {"source": "synthetic", "shape": [6], "classes": 5,
                           "batch_size": batch},
                 "test": {"source": "synthetic", "shape": [6], "classes": 5,
                          "batch_size": 16, "num_samples": 64, "shuffle": False}},
        "net": [
            {"type": "fc", "name": "fc0", "bottom": "data", "top": "x", "num_output": 8},
            {"type": "fc", "name": "fc1", "bottom": "x", "top": "h", "num_output": hidden},
            {"type": "relu", "name": "act", "bottom": "h", "top": "h"},
            {"type": "fc", "name": "fc2", "bottom": "h", "top": "m", "num_output": 8},
            {"type": "eltwise", "name": "res", "bottom": ["x", "m"], "top": "y"},
            {"type": "fc", "name": "out", "bottom": "y", "top": "logits", "num_output": 5},
            {"type": "softmax_loss", "name": "loss", "bottom": ["logits", "label"],
             "top": "loss"},
        ],
        "solver": {"type": solver, "base_lr": 0.01, "max_iter": iters, "display": 1,
                   "test_interval": 0, "weight_decay": 0.01},
        "checkpoint": {"interval": 0},
        "parallel": {"scheme": scheme, "tensor_parallel": degree},
    }


def _block_config(**kw):
    """A pre-norm transformer MLP block on (N, T, C) = (batch, 4, 8) float
    data: layer_norm -> fc (axis -1, 4C) -> gelu (tanh) -> fc (axis -1, C)
    -> residual sum, then a classifier over the flattened sequence."""
    cfg = _config(**kw)
    for phase in ("train", "test"):
        cfg["data"][phase]["shape"] = [4, 8]
    cfg["net"] = [
        {"type": "layer_norm", "name": "ln", "bottom": "data", "top": "x"},
        {"type": "fc", "name": "c_fc", "bottom": "x", "top": "h", "num_output": 32, "axis": -1},
        {"type": "gelu", "name": "gelu", "bottom": "h", "top": "h", "approximate": "tanh"},
        {"type": "fc", "name": "c_proj", "bottom": "h", "top": "m", "num_output": 8,
         "axis": -1},
        {"type": "eltwise", "name": "res", "bottom": ["data", "m"], "top": "y"},
        {"type": "fc", "name": "out", "bottom": "y", "top": "logits", "num_output": 5},
        {"type": "softmax_loss", "name": "loss", "bottom": ["logits", "label"], "top": "loss"},
    ]
    return cfg


def _losses(run_dir):
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r["loss"] for r in rows if r.get("phase", "train") == "train" and "loss" in r]


# ------------------------------------------------------------ composition
def test_split_found_and_composed_offline():
    job = make_job(_config())
    slices = [compose_for(job, 2, r) for r in range(2)]
    for rank, g in enumerate(slices):
        blobs = g.blobs
        assert blobs["fc1/weight"].shape == (8, 6 + 2) and blobs["fc1/bias"].shape == (8,)
        assert blobs["fc2/weight"].shape == (8, 8) and blobs["fc2/bias"].shape == (8,)
        assert blobs["fc0/weight"].shape == (8, 6) and blobs["out/weight"].shape == (5, 8)
        assert blobs["h"].shape == (8, 8) and blobs["fc1/weight.m"].shape == (8, 8)
        assert blobs["fc1/weight"].attrs["tensor_split"] == {
            "axis": 0, "parts": 2, "index": rank, "shape": [16, 8], "blocks": 1}
        assert blobs["fc2/weight"].attrs["tensor_split"]["axis"] == 1
        reduces = [op for op in g.topo_order() if op.op_type == "Allreduce"]
        # one forward (after the row split) and one backward (block input)
        assert [op.name for op in reduces] == ["fc2.tp_sum", "fc1.tp_grad_sum"]
        assert [op.attrs["seq"] for op in reduces] == [0, 1]
        assert all(op.attrs["group"] == [0, 1] for op in reduces)
        assert reduces[1].outputs[0].startswith("x.grad")
        # the row layer's bias is added by shard 0 only
        assert len(g.ops["fc2.fwd"].inputs) == (3 if rank == 0 else 2)
    text = render_graph(job, 2, 1)
    assert "fc1 (columns, 16 -> 8 per rank) -> act -> fc2 (rows, one allreduce)" in text
    assert "rank 1 = replica 0, shard 1" in text


def test_tensor_times_data_groups():
    """4 ranks = 2 replicas x 2 shards: the split allreduces run in each
    tensor group, the gradient buckets over the ranks of one shard."""
    job = make_job(_config())
    for rank in range(4):
        g = compose_for(job, 4, rank)
        replica, shard = divmod(rank, 2)
        tp = {tuple(op.attrs["group"]) for op in g.ops.values() if ".tp_" in op.name}
        dp = {tuple(op.attrs["group"]) for op in g.ops.values()
              if op.op_type == "Allreduce" and ".tp_" not in op.name}
        assert tp == {(2 * replica, 2 * replica + 1)}
        assert dp == {(shard, shard + 2)}
        readers = [(op.attrs["rank"], op.attrs["world_size"]) for op in g.ops.values()
                   if op.op_type == "DataReader"]
        assert readers == [(replica, 2)]


@pytest.mark.parametrize("degree,why", [(3, "not divisible by the tensor-parallel degree 3"),
                                        (4, "is not a multiple of 4")])
def test_bad_degree_is_a_user_error(degree, why):
    job = make_job(_config(degree=degree))
    with pytest.raises(UserError, match="parallel.tensor_parallel") as e:
        compose_for(job, 6 if degree == 3 else 2, 0)
    assert why in str(e.value)


def test_nothing_to_split_is_a_user_error():
    cfg = _config()
    cfg["net"] = [cfg["net"][0], {"type": "fc", "name": "out", "bottom": "x", "top": "logits",
                                  "num_output": 5}, cfg["net"][-1]]
    with pytest.raises(UserError, match="found no layers to split"):
        compose_for(make_job(cfg), 2, 0)


# ------------------------------------------------------------ mpiexec runs
def _train(tmp_path, name, n, cfg, *extra):
    """(run folder, the command's CompletedProcess); a one-rank reference
    (no ``extra``) trains in this process (conftest.train_here): (folder,
    None)."""
    path = write_config_file(tmp_path, cfg, f"{name}.yaml")
    out = tmp_path / name
    if n == 1 and not extra:
        return train_here(cfg, out), None
    args = ("train", path, "--out", out, *extra)
    res = run_mpi_cli(n, *args) if n > 1 else run_cli_args(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    return out, res


def _close(a, b, rtol=1e-5, atol=1e-6):
    assert sorted(a) == sorted(b) and a
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=atol, err_msg=name)


def close_in_norm(one, two, rtol=1e-5):
    """Each weight of ``two`` within ``rtol`` of ``one``'s norm; the k third
    of a ``qkv_bias`` (its gradient is 0: AdamW follows rounding noise
    there) is checked to stay near 0 on both sides instead."""
    assert sorted(one) == sorted(two) and one
    for name in one:
        a, b = one[name], two[name]
        if name.endswith("qkv_bias"):
            a, b = a.reshape(3, -1), b.reshape(3, -1)
            assert np.abs(a[1]).max() < 1e-5 and np.abs(b[1]).max() < 1e-5, name
            a, b = a[[0, 2]], b[[0, 2]]
        assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(a), name


def test_block_on_sequences_split_offline():
    """(N, T, C) activations: the fc over the last axis splits; the
    layer norm and the residual stay whole."""
    g = compose_for(make_job(_block_config()), 2, 1)
    assert g.blobs["h"].shape == (8, 4, 16) and g.blobs["y"].shape == (8, 4, 8)
    assert g.blobs["c_proj/weight"].shape == (8, 16) and g.blobs["ln/weight"].shape == (8,)
    assert sorted(op.name for op in g.ops.values() if ".tp_" in op.name) == \
        ["c_fc.tp_grad_sum", "c_proj.tp_sum"]


def test_two_way_tensor_parallel_equals_one_rank(tmp_path):
    """Weights (and AdamW moments) after 4 iterations and the loss of each
    iteration within 1e-5; the checkpoint of the 2-way run holds whole
    blobs, which `test --weights` reads on 1 rank and on 2 ranks alike."""
    one, _ = _train(tmp_path, "one", 1, _config(scheme="data"))
    two, res = _train(tmp_path, "two", 2, _config())
    assert "fc1 (columns, 16 -> 8 per rank)" in res.stdout + res.stderr
    _close(_params(one / "latest.h5"), _params(two / "latest.h5"))
    np.testing.assert_allclose(_losses(one), _losses(two), rtol=1e-5)
    assert len(_losses(two)) == 4
    cfg = write_config_file(tmp_path, _config(), "test.yaml")
    got = []
    for n in (1, 2):
        args = ("test", cfg, "--weights", two / "latest.h5")
        res = run_mpi_cli(n, *args) if n > 1 else run_cli_args(*args)
        assert res.returncode == 0, res.stdout + res.stderr
        got.append([line for line in res.stdout.splitlines() if "loss" in line])
    assert got[0] and got[0] == got[1]


def test_two_way_block_on_sequences_equals_one_rank(tmp_path):
    one, _ = _train(tmp_path, "one", 1, _block_config(scheme="data"))
    two, _ = _train(tmp_path, "two", 2, _block_config())
    _close(_params(one / "latest.h5"), _params(two / "latest.h5"))
    np.testing.assert_allclose(_losses(one), _losses(two), rtol=1e-5)


@pytest.mark.slow
def test_two_by_two_tensor_and_data(tmp_path):
    """A 2-block GPT on 4 ranks, 2 TP x 2 DP (batch B per replica, the
    collectives checked per group at start-up), equals 1 rank with 2B."""
    tokens = text_h5(tmp_path)
    one, _ = _train(tmp_path, "one", 1, gpt_config(tokens, batch=8, solver="sgd"))
    four, _ = _train(tmp_path, "four", 4, gpt_config(tokens, solver="sgd", parallel={
        "scheme": "tensor", "tensor_parallel": 2, "check_collectives": True}))
    _close(_params(one / "latest.h5"), _params(four / "latest.h5"))
    np.testing.assert_allclose(_losses(one), _losses(four), rtol=1e-5)


# ------------------------------------------------------------ a tiny GPT
@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return text_h5(tmp_path_factory.mktemp("tp_tokens"))


@pytest.mark.parametrize("fused", [True, False])
def test_gpt_attention_split_by_heads_offline(tokens, fused):
    """q, k and v keep this shard's heads (rows h·D.. of each of the three
    blocks of qkv_weight), every attention op sees H/t heads, the output
    projection keeps the matching columns; the tied embedding and head,
    the layer norms and the position table stay whole."""
    cfg = gpt_config(tokens, fused=fused, parallel={"scheme": "tensor", "tensor_parallel": 2})
    for rank in range(2):
        g = compose_for(make_job(cfg), 2, rank)
        b = g.blobs
        assert b["b0_attn/qkv_weight"].shape == (24, 16) and b["b0_attn/qkv_bias"].shape == (24,)
        assert b["b0_attn/qkv_weight"].attrs["tensor_split"]["blocks"] == 3
        assert b["b0_attn/proj_weight"].shape == (16, 8) and b["b0_attn/proj_bias"].shape == (16,)
        assert b["wte/weight"].shape == (256, 16) and b["wpe/weight"].shape == (8, 16)
        heads = {op.attrs["num_heads"] for op in g.ops.values() if "num_heads" in op.attrs}
        assert heads == {2}
        names = [op.name for op in g.topo_order() if op.op_type == "Allreduce"]
        # per block: attention and MLP, each one allreduce forward and one backward
        fwd = [n for n in names if n.endswith(".tp_sum")]
        bwd = [n for n in names if n.endswith(".tp_grad_sum")]
        assert fwd == ["b0_attn.proj.tp_sum", "b0_proj.tp_sum", "b1_attn.proj.tp_sum",
                       "b1_proj.tp_sum"]
        assert bwd == ["b1_fc.tp_grad_sum", "b1_attn.qkv.tp_grad_sum", "b0_fc.tp_grad_sum",
                       "b0_attn.qkv.tp_grad_sum"]


def test_heads_not_divisible_is_a_user_error(tokens):
    cfg = gpt_config(tokens, heads=2, parallel={"scheme": "tensor", "tensor_parallel": 4})
    with pytest.raises(UserError, match="attention layer 'b0_attn' has num_heads 2, not "
                                        "divisible by the tensor-parallel degree 4"):
        compose_for(make_job(cfg), 4, 0)


@pytest.mark.parametrize("fused", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_two_way_gpt_equals_one_rank(tmp_path, tokens, fused):
    """A 2-block GPT (tied embedding and head) 2-way tensor parallel: the
    loss of every iteration and every weight after 4 iterations within 1e-5
    of 1 rank. SGD with momentum: under Adam the k part of qkv_bias, whose
    gradient is 0 in exact arithmetic (softmax ignores a shift of every key
    by one vector), moves by ±lr on the sign of rounding noise."""
    sgd = {"solver": "sgd"}
    one, _ = _train(tmp_path, "one", 1, gpt_config(tokens, fused=fused, **sgd))
    two, _ = _train(tmp_path, "two", 2, gpt_config(
        tokens, fused=fused, parallel={"scheme": "tensor", "tensor_parallel": 2}, **sgd))
    _close(_params(one / "latest.h5"), _params(two / "latest.h5"))
    np.testing.assert_allclose(_losses(one), _losses(two), rtol=1e-5)


@pytest.mark.slow
def test_resume_across_layouts(tmp_path):
    """2 iterations 2-way tensor parallel, resumed on 1 rank for 2 more (and
    the other way round) = 4 iterations on 1 rank: the checkpoint's whole
    weights and momenta are split on load and joined on save."""
    cfg = dict(_config(scheme="data", solver="sgd"), checkpoint={"interval": 2})
    ref, _ = _train(tmp_path, "ref", 1, cfg)
    tp = dict(cfg, parallel={"scheme": "tensor", "tensor_parallel": 2})
    for first, then, name in ((tp, cfg, "a"), (cfg, tp, "b")):
        start, _ = _train(tmp_path, f"{name}0", 2 if first is tp else 1,
                          dict(first, solver=dict(first["solver"], max_iter=2)))
        end, res = _train(tmp_path, f"{name}1", 2 if then is tp else 1, then,
                          "--resume", start / "ckpt_2.h5")
        assert "resumed from" in res.stdout + res.stderr
        _close(_params(ref / "latest.h5"), _params(end / "latest.h5"))


def test_clipping_counts_each_weight_once(tmp_path):
    """solver.clip_gradients under 2-way tensor parallelism (a clip that
    acts every iteration): the global norm adds the shards of the split
    weights and each replicated weight once, as on 1 rank."""
    def clipped(cfg):
        return dict(cfg, solver=dict(cfg["solver"], type="sgd", clip_gradients=0.05))
    one, _ = _train(tmp_path, "one", 1, clipped(_config(scheme="data")))
    two, _ = _train(tmp_path, "two", 2, clipped(_config()))
    _close(_params(one / "latest.h5"), _params(two / "latest.h5"))
    g = compose_for(make_job(clipped(_config())), 2, 1)
    assert g.ops["clip.sum"].attrs["group"] == [0, 1]
    assert 0.0 in g.ops["clip.norm"].attrs["scales"]


def test_dropout_of_replicated_activations_agrees(tmp_path, tokens):
    """The ranks of a tensor group draw one random stream (that of rank 0
    of a 1-rank run): with attention's resid_dropout and a dropout layer on
    the residual stream, 2-way tensor parallel still equals 1 rank."""
    def with_dropout(cfg):
        for layer in cfg["net"]:
            if layer["type"] == "attention":
                layer["resid_dropout"] = 0.2
        cfg["net"].insert(-3, {"type": "dropout", "name": "drop_f", "bottom": "x2",
                               "top": "x2", "dropout_ratio": 0.2})
        return cfg
    one, _ = _train(tmp_path, "one", 1, with_dropout(gpt_config(tokens, solver="sgd")))
    two, _ = _train(tmp_path, "two", 2, with_dropout(gpt_config(
        tokens, solver="sgd", parallel={"scheme": "tensor", "tensor_parallel": 2})))
    _close(_params(one / "latest.h5"), _params(two / "latest.h5"))


@pytest.mark.parametrize("parallel,key,words", [
    ({"micro_batches": 2}, "parallel.micro_batches", "scheme tensor takes no micro-batches"),
    ({"mode": "async"}, "parallel.mode", "scheme tensor runs with mode: sync"),
])
def test_bad_combinations_exit_2(tmp_path, parallel, key, words):
    cfg = _config(solver="sgd")
    cfg["parallel"].update(parallel)
    res = run_cli_here("train", write_config_file(tmp_path, cfg), "--out", tmp_path / "r")
    assert_user_error(res, key, words)


def test_world_not_a_multiple_exits_2_on_every_rank(tmp_path):
    res = run_mpi_cli(3, "train", write_config_file(tmp_path, _config()), "--out", tmp_path / "r")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "parallel.tensor_parallel" in res.stderr and "world size 3 is not a multiple of 2" \
        in res.stderr and "Traceback" not in res.stderr


def test_two_way_gpt_with_gpt_tiny_solver(tmp_path, tokens):
    """gpt_tiny's solver (AdamW, warm-up and cosine decay, clipping at 1.0)
    for 6 iterations, 2-way tensor parallel against 1 rank: the loss of each
    iteration within 1e-5 and every parameter within 1e-5 (norm-relative),
    but the k third of each qkv_bias: its gradient is 0 in exact arithmetic,
    so Adam follows rounding noise there, which stays below 1e-5 in absolute
    terms on both sides."""
    solver = {"type": "adamw", "base_lr": 5e-3, "momentum": 0.9, "momentum2": 0.99,
              "weight_decay": 0.1, "lr_policy": "cosine", "min_lr": 5e-4, "warmup_iters": 2,
              "max_iter": 6, "clip_gradients": 1.0, "display": 1, "test_interval": 0}
    runs = []
    for n, parallel in ((1, None), (2, {"scheme": "tensor", "tensor_parallel": 2})):
        cfg = dict(gpt_config(tokens, parallel=parallel), solver=solver)
        runs.append(_train(tmp_path, f"r{n}", n, cfg)[0])
    np.testing.assert_allclose(_losses(runs[0]), _losses(runs[1]), rtol=1e-5)
    close_in_norm(*(_params(r / "latest.h5") for r in runs))


def test_an_activation_read_elsewhere_is_not_split():
    """The hidden activation of an MLP that another layer also reads (here
    an attention layer) stays whole: only the attention is split."""
    from purine_mpi.job.replica import build_train_graph
    from purine_mpi.parallel.tensor_parallel import find_splits
    cfg = _block_config()
    cfg["net"][3:5] = [
        {"type": "fc", "name": "c_proj", "bottom": "h", "top": "m", "num_output": 32,
         "axis": -1},
        {"type": "attention", "name": "attn", "bottom": "h", "top": "a", "num_heads": 2},
        {"type": "eltwise", "name": "res", "bottom": ["m", "a"], "top": "y"}]
    graph, _ = build_train_graph(make_job(cfg), 0, 1)
    assert [(p["column"], p["row"]) for p in find_splits(graph)] == \
        [("attn.qkv", "attn.proj")]


# ------------------------------------------------ attention dropout by heads
def _with_attn_dropout(cfg, ratio=0.2):
    for layer in cfg["net"]:
        if layer["type"] == "attention":
            layer["attn_dropout"] = ratio
    return cfg


@pytest.mark.parametrize("fused", [True, False])
def test_attention_dropout_split_by_heads_agrees(tmp_path, tokens, fused):
    """attn_dropout on a layer split by heads: each shard draws its heads'
    part of the unsplit layer's mask (attr mask_split, counted at the
    element's index in the whole (N, H, T, T) array), so 2-way tensor
    parallel trains as 1 rank does, within the tolerance of the other
    dropout test (before: every shard drew the mask of its local array,
    the same on both shards and not the 1-rank run's)."""
    sgd = {"solver": "sgd", "fused": fused}
    one, _ = _train(tmp_path, "one", 1, _with_attn_dropout(gpt_config(tokens, **sgd)))
    two, _ = _train(tmp_path, "two", 2, _with_attn_dropout(gpt_config(
        tokens, parallel={"scheme": "tensor", "tensor_parallel": 2}, **sgd)))
    _close(_params(one / "latest.h5"), _params(two / "latest.h5"))
    np.testing.assert_allclose(_losses(one), _losses(two), rtol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_attention_dropout_ops_get_their_heads_offline(tokens, fused):
    """The split marks the ops that draw the probabilities' mask (the fused
    op and its gradient, or the raw path's Dropout) with their shard, and
    nothing else (the resid_dropout of the whole output stays unmarked)."""
    cfg = _with_attn_dropout(gpt_config(tokens, fused=fused, parallel={
        "scheme": "tensor", "tensor_parallel": 2}))
    cfg["net"][3]["resid_dropout"] = 0.1
    for rank in range(2):
        g = compose_for(make_job(cfg), 2, rank)
        marked = sorted((op.op_type, op.name.split(".")[0]) for op in g.ops.values()
                        if "mask_split" in op.attrs)
        want = ["Attention", "AttentionGrad"] if fused else ["Dropout"]
        assert marked == sorted((t, b) for t in want for b in ("b0_attn", "b1_attn"))
        assert all(op.attrs["mask_split"] == {"axis": 1, "parts": 2, "index": rank}
                   for op in g.ops.values() if "mask_split" in op.attrs)


def test_attention_dropout_on_a_gpu_is_refused(tokens):
    """The device kernels count a shard's local elements: a GPU with
    attention dropout split by heads exits 2 naming the layer's key."""
    cfg = _with_attn_dropout(gpt_config(tokens, parallel={
        "scheme": "tensor", "tensor_parallel": 2}))
    cfg["device"] = 0
    with pytest.raises(UserError, match=r"key 'net\[3\]\.attn_dropout': layer 'b0_attn': "
                                        "attention dropout split by heads"):
        compose_for(make_job(cfg), 2, 0)
    cfg = _with_attn_dropout(cfg, 0.0)   # no attention dropout: composed as before
    compose_for(make_job(cfg), 2, 0)


# ------------------------------------------- dropout of a split MLP activation
def _with_mlp_dropout(cfg, ratio=0.2):
    """A dropout layer on the hidden activation between the MLP's split fc
    layers (after its relu or gelu): (N, O) in ``_config``, (N, T, O) in
    ``_block_config``."""
    at = next(i for i, layer in enumerate(cfg["net"]) if layer["type"] in ("relu", "gelu"))
    cfg["net"].insert(at + 1, {"type": "dropout", "name": "drop_h", "bottom": "h",
                               "top": "h", "ratio": ratio})
    return cfg


# (N, O) with O/t = 5 (its shards' rows off the 4-word Philox blocks), and a
# GPT-shaped (N, T, 4C) block
MLP_NETS = {"2d": lambda **kw: _config(hidden=10, **kw), "sequences": _block_config}


@pytest.mark.parametrize("net", sorted(MLP_NETS))
def test_mlp_dropout_ops_get_their_columns_offline(net):
    """The split marks the Dropout of the column-split activation with its
    shard on the activation's last axis, and its gradient reads that op's
    mask; a dropout layer of a whole activation stays unmarked."""
    cfg = _with_mlp_dropout(MLP_NETS[net](solver="sgd"))
    cfg["net"].insert(-2, {"type": "dropout", "name": "drop_y", "bottom": "y", "top": "y",
                           "ratio": 0.1})
    for rank in range(2):
        g = compose_for(make_job(cfg), 2, rank)
        marked = {op.name: op.attrs["mask_split"] for op in g.ops.values()
                  if "mask_split" in op.attrs}
        drop = g.ops["drop_h.fwd"]
        axis = len(g.blobs[drop.inputs[0]].shape) - 1
        assert marked == {"drop_h.fwd": {"axis": axis, "parts": 2, "index": rank}}
        grad = next(op for op in g.ops.values() if op.op_type == "DropoutGrad"
                    and op.name.startswith("drop_h."))
        assert grad.inputs[1] == drop.outputs[1]


@pytest.mark.parametrize("net", sorted(MLP_NETS))
def test_a_column_shards_dropout_is_the_unsplit_ones_slice(net):
    """The Dropout op of each shard's composed graph (its attrs: the split's
    mask_split) draws the unsplit op's mask on its columns [k·O/t,
    (k+1)·O/t) of the last axis, and its gradient (DropoutGrad on that
    mask) is the unsplit gradient's slice; both shards drew the mask of
    their local array before, the same on each."""
    from purine_mpi.graph.core import Op
    from purine_mpi.job.replica import build_train_graph
    from purine_mpi.ops.catalog import get_kernel_class
    cfg = _with_mlp_dropout(MLP_NETS[net](solver="sgd"))
    whole_graph, _ = build_train_graph(make_job(cfg), 0, 1)
    it = np.array(3, np.int64)

    def run(op, x, dy):
        fwd = get_kernel_class("Dropout")(Op(op.name, "Dropout", [], [],
                                             dict(op.attrs, seed=11)))
        y, mask = np.empty_like(x), np.empty_like(x)
        fwd.run([x, it], [y, mask])
        dx = np.empty_like(dy)
        get_kernel_class("DropoutGrad")(Op("g", "DropoutGrad", [], [], {
            "ratio": op.attrs["ratio"]})).run([dy, mask], [dx])
        return mask, y, dx

    op = whole_graph.ops["drop_h.fwd"]
    shape = whole_graph.blobs[op.inputs[0]].shape
    rng = np.random.default_rng(0)
    x, dy = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    whole = run(op, x, dy)
    cols = shape[-1] // 2
    masks = []
    for k in range(2):
        shard = compose_for(make_job(dict(cfg, parallel={"scheme": "tensor",
                                                         "tensor_parallel": 2})), 2, k)
        part = np.s_[..., k * cols:(k + 1) * cols]
        got = run(shard.ops["drop_h.fwd"], np.ascontiguousarray(x[part]),
                  np.ascontiguousarray(dy[part]))
        for a, b in zip(got, whole):
            assert np.array_equal(a, b[part])
        masks.append(got[0])
    assert not np.array_equal(masks[0], masks[1])


@pytest.mark.parametrize("net", sorted(MLP_NETS))
def test_mlp_dropout_split_by_columns_agrees(tmp_path, net):
    """A dropout layer between the column-split fc and the row-split fc:
    each shard draws its columns of the unsplit mask, so 2-way tensor
    parallel trains as 1 rank does (SGD, 4 iterations: every weight and
    the loss of every iteration within 1e-5; before: both shards drew the
    mask of their local (N, O/t) array, and the weights differed from 1
    rank's by far more)."""
    cfg = _with_mlp_dropout(MLP_NETS[net](solver="sgd"))
    one, _ = _train(tmp_path, "one", 1, dict(cfg, parallel={"scheme": "data"}))
    two, res = _train(tmp_path, "two", 2, cfg)
    assert "drop_h" in res.stdout + res.stderr   # the split goes through the dropout
    _close(_params(one / "latest.h5"), _params(two / "latest.h5"))
    np.testing.assert_allclose(_losses(one), _losses(two), rtol=1e-5)


def test_mlp_dropout_on_a_gpu_is_refused():
    """The device kernels count a shard's local elements: a GPU with a
    dropout layer on a column-split activation exits 2 naming its ratio."""
    cfg = _with_mlp_dropout(_block_config(solver="sgd"))
    cfg["device"] = 0
    with pytest.raises(UserError, match=r"key 'net\[3\]\.ratio': layer 'drop_h': dropout of "
                                        "the activation of 'c_fc' split by columns"):
        compose_for(make_job(cfg), 2, 0)
    cfg["net"][3]["ratio"] = 0.0   # no dropout: composed as before
    compose_for(make_job(cfg), 2, 0)
