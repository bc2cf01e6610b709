"""Data parallelism and micro-batches against 1 rank × the global batch,
pinned against PyTorch as docs/config.md ("Sample order") states them.

- A ``softmax_loss`` with an ``ignore_label`` over S shards (ranks ×
  micro-batches): by default (``parallel.ignore_label_mean: global``) the
  train row's loss and the update's gradient are
  ``CrossEntropyLoss(ignore_index)`` over the global batch, as 1 rank
  gives (each shard's sum over the global count, the data reader's
  normaliser); with ``shard``, the mean of the shards' means (PyTorch
  DDP's plain average).
- A ``batch_norm``'s running statistics under 2 ranks: the saved mean is
  1 rank's (PyTorch's BatchNorm2d over the global batch), the saved variance
  the mean of the ranks' own running variances (each PyTorch's unbiased
  running_var of its shard), which lacks the spread of the ranks' batch means.
- A test pass's loss and accuracy with an ``ignore_label`` on 2 ranks × 2
  micro-batches: the split's figures over its counted positions, not a mean
  of the rank batches' own.

Shuffle off: iteration i reads the global batch [(i−1)·G, i·G) of digits'
train split.
"""
import json

import h5py
import numpy as np
import pytest
import torch

from tests.conftest import run_mpi_cli, write_config_file

G = 16  # the global batch


def _config(digits_h5, net, solver, parallel, max_iter, batch=G // 2):
    return {"name": "shards", "seed": 3,
            "data": {"train": {"source": "hdf5", "path": digits_h5, "split": "train",
                               "batch_size": batch, "shuffle": False}},
            "net": net, "parallel": parallel,
            "solver": dict({"lr_policy": "fixed", "momentum": 0.0, "weight_decay": 0.0,
                            "max_iter": max_iter, "test_interval": 0, "display": 1}, **solver),
            "checkpoint": {"interval": 1, "keep": 100}}


def _train(tmp_path, cfg):
    out = tmp_path / "run"
    res = run_mpi_cli(2, "train", write_config_file(tmp_path, cfg), "--out", out)
    assert res.returncode == 0, res.stderr[-2000:]
    return out


def _params(path, layer):
    with h5py.File(path, "r") as f:
        return {k: torch.tensor(f[f"params/{layer}/{k}"][()], dtype=torch.float64)
                for k in f[f"params/{layer}"]}


#: the 4 shards of 4 of the global batch: 2 ranks × 2 micro-batches, or a
#: pipeline of 2 stages (the loss on the second) × 4 micro-batches
LAYOUTS = {"data": ({"scheme": "data", "micro_batches": 2}, G // 2),
           "pipeline": ({"scheme": "pipeline", "stages": {"fc1": 0, "loss": 1},
                         "micro_batches": 4}, G)}


def shards_and_whole(weight, bias, x, y, n, shard=4, ignore=3):
    """PyTorch's (loss, d loss / d weight) of an fc layer's cross-entropy
    with ``ignore_index`` over the first ``n`` samples of ``x``, ``y``: the
    mean of the means of shards of ``shard`` samples, and the whole batch's
    mean (the two conventions of ``parallel.ignore_label_mean``)."""
    ce = torch.nn.CrossEntropyLoss(ignore_index=ignore)

    def loss_and_grad(parts):
        w = weight.clone().requires_grad_(True)
        z = x @ w.T + bias
        loss = sum(ce(z[p], y[p]) for p in parts) / len(parts)
        loss.backward()
        return float(loss.detach()), w.grad.numpy()
    return (loss_and_grad([slice(k, k + shard) for k in range(0, n, shard)]),
            loss_and_grad([slice(0, n)]))


@pytest.mark.mpi
@pytest.mark.parametrize("layout, mean", [("data", "global"), ("data", "shard"),
                                          ("pipeline", "global")])
def test_ignore_label_over_ranks_and_micro_batches(digits_h5, tmp_path, layout, mean):
    """2 ranks × 2 micro-batches (4 shards of 4), or a 2-stage pipeline × 4,
    one fc layer, plain SGD:
    at iteration 3 (2 of 16 samples ignored, in different shards) the row's
    loss and the gradient the update applied (Δw = −lr·g) are the global
    batch's CrossEntropyLoss(ignore_index=3) (``global``, the default), or
    the mean of the 4 shards' (``shard``). Before the data reader's global
    count the default gave the shards' mean (row loss 2.239136 for the
    global batch's 2.241457)."""
    lr = 0.5
    net = [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1", "num_output": 10},
           {"type": "softmax_loss", "name": "loss", "bottom": ["fc1", "label"], "top": "loss",
            "ignore_label": 3}]
    parallel, batch = LAYOUTS[layout]
    out = _train(tmp_path, _config(digits_h5, net, {"base_lr": lr},
                                   dict(parallel, ignore_label_mean=mean), 3, batch))
    with h5py.File(digits_h5, "r") as f:
        x = torch.tensor(f["train/data"][2 * G:3 * G].reshape(G, -1), dtype=torch.float64)
        y = torch.tensor(f["train/label"][2 * G:3 * G].astype(np.int64))
    before, after = _params(out / "ckpt_2.h5", "fc1"), _params(out / "ckpt_3.h5", "fc1")
    shards, whole = shards_and_whole(before["weight"], before["bias"], x, y, G)
    assert abs(shards[0] - whole[0]) > 1e-3  # the case tells the two apart
    with open(out / "metrics.jsonl") as f:
        row = {r["iter"]: r for r in map(json.loads, f) if r["phase"] == "train"}[3]
    want = whole if mean == "global" else shards
    assert row["loss"] == pytest.approx(want[0], rel=1e-5), \
        f"row loss {row['loss']} is not the {mean} figure {want[0]:.6f}"
    applied = -(after["weight"] - before["weight"]).numpy() / lr
    np.testing.assert_allclose(applied, want[1], rtol=0, atol=1e-6)


@pytest.mark.mpi
def test_batch_norm_running_statistics_of_two_ranks_against_pytorch(digits_h5, tmp_path):
    """lr 0 (the batch norm's input stays that of the saved weights), 3
    iterations on 2 ranks × 8: the saved running mean is PyTorch's
    BatchNorm2d over the global batches of 16, the saved running variance
    the mean of two BatchNorm2d's, each fed its rank's 8 samples."""
    net = [{"type": "conv", "name": "c1", "bottom": "data", "top": "c1", "num_output": 4,
            "kernel": 3},
           {"type": "batch_norm", "name": "bn", "bottom": "c1", "top": "bn", "momentum": 0.1},
           {"type": "fc", "name": "fc", "bottom": "bn", "top": "fc", "num_output": 10},
           {"type": "softmax_loss", "name": "loss", "bottom": ["fc", "label"], "top": "loss"}]
    out = _train(tmp_path, _config(digits_h5, net, {"base_lr": 0.0}, {"scheme": "data"}, 3))
    conv = _params(out / "latest.h5", "c1")
    saved = _params(out / "latest.h5", "bn")
    whole = torch.nn.BatchNorm2d(4, momentum=0.1).double()
    ranks = [torch.nn.BatchNorm2d(4, momentum=0.1).double() for _ in range(2)]
    with h5py.File(digits_h5, "r") as f, torch.no_grad():
        for i in range(3):
            z = torch.nn.functional.conv2d(
                torch.tensor(f["train/data"][i * G:(i + 1) * G], dtype=torch.float64),
                conv["weight"], conv["bias"])
            whole(z)
            for r, bn in enumerate(ranks):
                bn(z[r * G // 2:(r + 1) * G // 2])
    np.testing.assert_allclose(saved["running_mean"], whole.running_mean, rtol=1e-5, atol=1e-7)
    ranks_var = (ranks[0].running_var + ranks[1].running_var) / 2
    np.testing.assert_allclose(saved["running_var"], ranks_var, rtol=1e-6)
    # the case tells the two apart: 1 rank × 16 keeps another variance
    assert float((saved["running_var"] - whole.running_var).abs().max()) > 1e-5


@pytest.mark.mpi
def test_test_pass_figures_with_ignore_label_are_the_split_s_over_counted_positions(
        digits_h5, tmp_path):
    """2 ranks × 2 micro-batches, a one-pass test of digits' 360 test samples
    in global batches of 16 (45 rank batches of 8, the last global batch half
    padding): the test row's loss and accuracy, both with ``ignore_label: 3``,
    are NumPy's over the split's counted positions on the saved weights
    (CrossEntropyLoss(ignore_index) over the whole split; the right ones over
    the counted), not the mean of the rank batches' own figures (each batch
    ignores its own number of 3s). Each rank's batch figure is weighted by
    its counted positions (train/evaluation.py, CountedPositions); the test
    graph has no micro-batch copies (the update's shards), so the figure is
    that of 1 rank × the split."""
    net = [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1", "num_output": 10},
           {"type": "softmax_loss", "name": "loss", "bottom": ["fc1", "label"], "top": "loss",
            "ignore_label": 3},
           {"type": "accuracy", "name": "acc", "bottom": ["fc1", "label"], "top": "acc",
            "phase": "test", "ignore_label": 3}]
    cfg = _config(digits_h5, net, {"base_lr": 0.5, "test_interval": 1, "test_iter": None},
                  {"scheme": "data", "micro_batches": 2}, 1)
    cfg["data"]["test"] = {"source": "hdf5", "path": digits_h5, "split": "test",
                           "batch_size": G // 2}
    out = _train(tmp_path, cfg)
    with h5py.File(digits_h5, "r") as f:
        n = len(f["test/label"])
        x = torch.tensor(f["test/data"][()].reshape(n, -1), dtype=torch.float64)
        y = torch.tensor(f["test/label"][()].astype(np.int64))
    p = _params(out / "latest.h5", "fc1")
    shards, whole = shards_and_whole(p["weight"], p["bias"], x, y, n, shard=G // 2)
    kept = (y != 3).numpy()
    right = ((x @ p["weight"].T + p["bias"]).argmax(dim=1) == y).numpy()
    accuracy = right[kept].mean()
    batch_means = np.mean([right[k:k + G // 2][kept[k:k + G // 2]].mean()
                           for k in range(0, n, G // 2)])
    # the case tells the two apart
    assert n % G and abs(accuracy - batch_means) > 1e-4 and abs(shards[0] - whole[0]) > 1e-4
    with open(out / "metrics.jsonl") as f:
        (row,) = [r for r in map(json.loads, f) if r["phase"] == "test"]
    assert row["samples"] == n
    assert row["accuracy"] == pytest.approx(accuracy, rel=1e-6), \
        f"test accuracy {row['accuracy']} is not the split's {accuracy:.6f} " \
        f"(the batches' mean {batch_means:.6f})"
    assert row["loss"] == pytest.approx(whole[0], rel=1e-5), \
        f"test loss {row['loss']} is not the split's {whole[0]:.6f} " \
        f"(the batches' mean {shards[0]:.6f})"
