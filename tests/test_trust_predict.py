"""Trust audit of ``predict CONFIG --weights W --out preds.h5``: every
per-sample row it writes against a NumPy (float64) forward of the same
checkpoint, under the launches a user predicts with (one rank with
micro-batches, scheme data on 2 ranks, scheme tensor on 2 ranks, ZeRO-3
over 2 replicas x 2 tensor shards).

Found: under ``parallel.scheme: tensor`` a ``--blob`` that the split
divides over the shards (an MLP's hidden activation between its split fc
layers, an attention's q/k/v projection, its scores) was written as tensor
shard 0's part alone, with no word: ``/outputs/h`` of a (360, 32) hidden
layer came out (360, 16), its first 16 columns, and the q/k/v projection
``(N, T, 3C)`` came out ``(N, T, 3C/2)``, shard 0's q, k and v heads
side by side. On the code before: ``AssertionError`` on the shapes,
``(360, 16) != (360, 32)`` and ``(N, 8, 24) != (N, 8, 48)``. Now rank 0
joins the shards of each replica's tensor group (tools/predict.py
``tensor_splits``: along the axis where the shard's shape differs from the
unsplit test graph's, q, k and v as three blocks).
"""
import json

import h5py
import numpy as np
import pytest

from tests.conftest import run_cli_args, run_mpi_cli, train_here, write_config_file

HIDDEN = 32


def _mlp(digits_h5):
    """fc1 -> relu -> dropout -> fc2 -> batch norm in place on fc2 (so
    ``fc2``'s newest version is the norm's output) -> loss: a pair scheme
    tensor splits (fc1 by columns, fc2 by rows), a dropout that is off in
    testing and running statistics the test phase uses."""
    net = [{"type": "fc", "name": "fc1", "bottom": "data", "top": "h", "num_output": HIDDEN},
           {"type": "relu", "name": "relu1", "bottom": "h", "top": "h"},
           {"type": "dropout", "name": "drop", "bottom": "h", "top": "h", "ratio": 0.3},
           {"type": "fc", "name": "fc2", "bottom": "h", "top": "fc2", "num_output": 10},
           {"type": "batch_norm", "name": "bn", "bottom": "fc2", "top": "fc2"},
           {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"], "top": "loss"},
           {"type": "accuracy", "name": "acc", "bottom": ["fc2", "label"], "top": "acc",
            "phase": "test"}]
    return {"name": "pred", "seed": 4,
            "data": {"train": {"source": "hdf5", "path": digits_h5, "split": "train",
                               "batch_size": 16, "shuffle": True},
                     # 360 test samples: no batch here divides them (the last one padded)
                     "test": {"source": "hdf5", "path": digits_h5, "split": "test",
                              "batch_size": 50, "shuffle": True}},
            "net": net,
            "solver": {"base_lr": 0.1, "momentum": 0.9, "max_iter": 8, "display": 4,
                       "test_interval": 0},
            "checkpoint": {"interval": 0}}


def _params(ckpt):
    out = {}
    with h5py.File(ckpt, "r") as f:
        f["params"].visititems(lambda k, v: out.__setitem__(k, v[()].astype(np.float64))
                               if isinstance(v, h5py.Dataset) else None)
    return out


def _numpy_mlp(digits_h5, ckpt):
    """(h after the relu, fc2 after the batch norm, labels) of the whole test
    split in file order, float64; the test phase's dropout is the identity."""
    p = _params(ckpt)
    with h5py.File(digits_h5, "r") as f:
        x, y = f["test/data"][()].astype(np.float64), f["test/label"][()]
    h = np.maximum(x.reshape(len(x), -1) @ p["fc1/weight"].T + p["fc1/bias"], 0.0)
    z = h @ p["fc2/weight"].T + p["fc2/bias"]
    z = (z - p["bn/running_mean"]) / np.sqrt(p["bn/running_var"] + 1e-5) * p["bn/weight"] \
        + p["bn/bias"]
    return h, z, y


@pytest.fixture(scope="module")
def mlp_run(digits_h5, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pred")
    cfg = write_config_file(tmp, _mlp(digits_h5))
    out = train_here(cfg, tmp / "run")
    return cfg, str(out / "latest.h5")


LAUNCHES = {  # name -> (ranks, --set overrides)
    "one_rank_micro": (1, ["parallel.micro_batches=2"]),
    "data2": (2, ["parallel.scheme=data"]),
    "tensor2": (2, ["parallel.scheme=tensor", "parallel.tensor_parallel=2"]),
    # ZeRO-3 over 2 replicas x 2 tensor shards: the weight shards gathered, then joined
    "sharded3_tensor2": (4, ["parallel.scheme=sharded", "parallel.shard=3",
                             "parallel.tensor_parallel=2"]),
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_predictions_are_a_numpy_forward_of_the_checkpoint(digits_h5, mlp_run, tmp_path, name):
    """Each row of /outputs/fc2 (the scores the loss reads: the batch norm's
    output) and of /outputs/h (the hidden layer after the relu, split by
    columns under scheme tensor) is sample i's NumPy forward; /label and
    /index are the file's; the split's shuffle is off in predict."""
    cfg, ckpt = mlp_run
    ranks, sets = LAUNCHES[name]
    out = tmp_path / "preds.h5"
    args = ["predict", cfg, "--weights", ckpt, "--out", out, "--blob", "fc2", "--blob", "h"]
    for s in sets:
        args += ["--set", s]
    res = run_mpi_cli(ranks, *args) if ranks > 1 else run_cli_args(*args)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1])["samples"] == 360
    h, z, y = _numpy_mlp(digits_h5, ckpt)
    with h5py.File(out, "r") as f:
        got_h, got_z = f["outputs/h"][()], f["outputs/fc2"][()]
        np.testing.assert_array_equal(f["label"][()], y)
        np.testing.assert_array_equal(f["index"][()], np.arange(360))
    assert got_h.shape == h.shape and got_z.shape == z.shape, (got_h.shape, got_z.shape)
    np.testing.assert_allclose(got_h, h, rtol=1e-5, atol=1e-5 * np.abs(h).max())
    np.testing.assert_allclose(got_z, z, rtol=1e-5, atol=1e-5 * np.abs(z).max())
    if name == "tensor2":  # a blob of the split alone (a shard's partial sum): refused
        args[args.index("h")] = "fc2.tp_partial"
        res = run_mpi_cli(ranks, *args)
        assert res.returncode == 2 and "blob fc2.tp_partial is not the net's" in res.stderr \
            and "Traceback" not in res.stderr, res.stderr


def _layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


@pytest.mark.mpi
@pytest.mark.parametrize("fused", [True, False])
def test_a_tensor_split_attention_s_blobs_are_written_whole(tmp_path, fused):
    """A tiny GPT (1 block, 4 heads, width 16) predicted under scheme
    tensor on 2 ranks: the q/k/v projection (three blocks of heads; each
    shard holds its heads of each) equals NumPy's from the checkpoint, and
    the attention's context, the MLP's hidden layer (after its GELU, in
    place), its scores and probabilities (unfused) and the logits equal a
    one-rank predict's of the same checkpoint, which splits nothing."""
    import yaml

    from tests.gpt_nets import gpt_config, text_h5
    cfg = gpt_config(text_h5(tmp_path), layers=1, width=16, heads=4, length=8, batch=4,
                     iters=3, fused=fused)
    cfg["solver"]["test_iter"] = None
    cfg["data"]["test"]["batch_size"] = 8
    path = write_config_file(tmp_path, cfg)
    train_here(path, tmp_path / "run")
    ckpt = str(tmp_path / "run" / "latest.h5")
    blobs = ["data", "b0_attn.qkv", "b0_attn.ctx", "b0_u", "logits"]
    if not fused:
        blobs += ["b0_attn.scores", "b0_attn.probs"]
    args = ["predict", path, "--weights", ckpt]
    for b in blobs:
        args += ["--blob", b]
    one = run_cli_args(*args, "--out", tmp_path / "one.h5")
    assert one.returncode == 0, one.stderr
    two = run_mpi_cli(2, *args, "--out", tmp_path / "two.h5", "--set", "parallel.scheme=tensor",
                      "--set", "parallel.tensor_parallel=2")
    assert two.returncode == 0, two.stderr
    with h5py.File(tmp_path / "one.h5", "r") as a, h5py.File(tmp_path / "two.h5", "r") as b:
        ref = {k: a["outputs"][k][()] for k in blobs}
        got = {k: b["outputs"][k][()] for k in blobs}
    for k in blobs:
        assert got[k].shape == ref[k].shape, (k, got[k].shape, ref[k].shape)
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5,
                                   atol=1e-5 * np.nanmax(np.abs(ref[k][np.isfinite(ref[k])])),
                                   err_msg=k)
    p = _params(ckpt)
    tokens = got["data"].astype(np.int64)
    x0 = p["wte/weight"][tokens] + p["wpe/weight"][:tokens.shape[1]]
    h1 = _layer_norm(x0, p["b0_ln1/weight"], p["b0_ln1/bias"])
    qkv = h1 @ p["b0_attn/qkv_weight"].T + p["b0_attn/qkv_bias"]
    np.testing.assert_allclose(got["b0_attn.qkv"], qkv, rtol=1e-5,
                               atol=1e-5 * np.abs(qkv).max())
