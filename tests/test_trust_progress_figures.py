"""The figures of the train rows and progress lines against NumPy: a row's
``lr`` is the rate the last iteration applied (recovered from two
consecutive checkpoints under plain SGD, Δw = −lr·g, g the NumPy gradient
of that iteration's global batch) across warm-up, cosine and step
boundaries and after a resume from an earlier checkpoint; a row's ``loss``
is the mean over its iterations of the global batch's NumPy loss, with
micro-batches and in a pipeline; the time-based progress lines of a
pipeline never show a loss rank 0 does not hold.

Before the fix a pipeline's time-based lines (``solver.display_seconds``)
showed rank 0's own sum of losses as that iteration's loss: rank 0, the
first stage, holds no loss blob (``loss 0.0000``) or a part of the
objective (here an aux head's: ``loss 0.6090``, the whole being about 2.9).
"""
import json
import re

import h5py
import numpy as np
import pytest

from tests.conftest import run_cli_args, run_mpi_cli, write_config_file

B = 16  # the batch of every replica; shuffle off: iteration i reads samples [i·B, (i+1)·B)
MLP = [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1", "num_output": 16},
       {"type": "relu", "name": "relu1", "bottom": "fc1", "top": "fc1"},
       {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2", "num_output": 10},
       {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"], "top": "loss"}]
#: an aux head on the first stage: rank 0 holds a part of the objective
AUX = [{"type": "fc", "name": "aux", "bottom": "data", "top": "aux", "num_output": 10},
       {"type": "softmax_loss", "name": "aux_loss", "bottom": ["aux", "label"],
        "top": "aux_loss", "loss_weight": 0.25}]
AUX_WEIGHT = 0.25
ALIVE = re.compile(r"^iter +(\d+)/\d+  (?:loss (\d+\.\d{4})(?: \(iter (\d+)\))?  )?[\d,]+ img/s")


def _config(digits_h5, net, solver, parallel, max_iter):
    return {"name": "figures", "seed": 3,
            "data": {"train": {"source": "hdf5", "path": digits_h5, "split": "train",
                               "batch_size": B, "shuffle": False}},
            "net": net, "parallel": parallel,
            "solver": dict({"momentum": 0.0, "weight_decay": 0.0, "max_iter": max_iter,
                            "test_interval": 0}, **solver),
            "checkpoint": {"interval": 1, "keep": 100}}


def _rows(out):
    with open(out / "metrics.jsonl") as f:
        return {r["iter"]: r for r in map(json.loads, f) if r["phase"] == "train"}


def _cross_entropy(z, y):
    """(mean cross-entropy in float64, d mean / d z) of logits ``z``."""
    z = z - z.max(axis=1, keepdims=True)
    prob = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    loss = float(-np.log(prob[np.arange(len(y)), y]).mean())
    prob[np.arange(len(y)), y] -= 1.0
    return loss, prob / len(y)


def _numpy(digits_h5, before, after, it, replicas=1):
    """(loss, applied lr) of iteration ``it`` (counted from 1): the float64
    objective of its global batch under ``before``'s weights (the mean
    cross-entropy, plus AUX_WEIGHT times the aux head's where the net has
    one), and the lr that moved the last fc layer's weight from ``before``
    to ``after`` (least squares of Δw = −lr·g)."""
    with h5py.File(digits_h5, "r") as f:
        x, y = f["train/data"][()], f["train/label"][()]
    n = replicas * B
    idx = np.arange((it - 1) * n, it * n) % len(y)
    h = x[idx].reshape(n, -1).astype(np.float64)

    def p(path, layer, k):
        with h5py.File(path, "r") as f:
            return f[f"params/{layer}/{k}"][()].astype(np.float64)
    with h5py.File(before, "r") as f:
        layers = set(f["params"])
    last, aux = ("fc2" if "fc2" in layers else "fc1"), 0.0
    if "aux" in layers:
        aux = AUX_WEIGHT * _cross_entropy(h @ p(before, "aux", "weight").T
                                          + p(before, "aux", "bias"), y[idx])[0]
    if last == "fc2":
        h = np.maximum(h @ p(before, "fc1", "weight").T + p(before, "fc1", "bias"), 0.0)
    w = p(before, last, "weight")
    loss, dz = _cross_entropy(h @ w.T + p(before, last, "bias"), y[idx])
    loss += aux
    g = dz.T @ h
    dw = p(after, last, "weight") - w
    return loss, float(-(dw * g).sum() / (g * g).sum())


@pytest.mark.mpi
def test_pipeline_rows_and_lines_against_numpy(digits_h5, tmp_path):
    """2 stages (an aux head of loss_weight 0.25 on the first: rank 0 holds
    that part of the objective), 2 micro-batches, warm-up 3 then cosine, a
    row every 3 iterations, a time-based line after each other iteration:
    each row's lr is the one its last iteration applied; the rows of whole
    windows (6, 8) hold the mean of their iterations' NumPy objectives; a
    time-based line shows the last row's loss with its iteration, or none
    before the first row."""
    cfg = _config(digits_h5, MLP + AUX,
                  {"base_lr": 0.05, "lr_policy": "cosine", "warmup_iters": 3, "display": 3,
                   "display_seconds": 1e-6},
                  {"scheme": "pipeline", "micro_batches": 2,
                   "stages": {"fc1": 0, "relu1": 0, "aux": 0, "aux_loss": 0, "fc2": 1,
                              "loss": 1}}, 8)
    out = tmp_path / "run"
    res = run_mpi_cli(2, "train", write_config_file(tmp_path, cfg), "--out", out)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = _rows(out)
    assert sorted(rows) == [3, 6, 8]
    figures = {i: _numpy(digits_h5, out / f"ckpt_{i - 1}.h5", out / f"ckpt_{i}.h5", i)
               for i in range(2, 9)}
    for i, row in rows.items():
        assert row["lr"] == pytest.approx(figures[i][1], rel=1e-4), \
            f"row {i}: lr {row['lr']} is not the applied {figures[i][1]:.6g}"
    for i, window in ((6, (4, 5, 6)), (8, (7, 8))):
        mean = float(np.mean([figures[k][0] for k in window]))
        assert rows[i]["loss"] == pytest.approx(mean, rel=1e-5), \
            f"row {i}: loss {rows[i]['loss']} is not the NumPy mean {mean:.6f} of {window}"
    alive = [m for m in map(ALIVE.match, res.stdout.splitlines()) if m and "  lr " not in
             m.string]
    assert alive, res.stdout
    for m in alive:
        it, loss, of = int(m.group(1)), m.group(2), m.group(3)
        shown = max((k for k in rows if k < it), default=None)
        if shown is None:
            assert loss is None, f"line before any row shows a loss: {m.string!r}"
        else:
            assert loss is not None and of is not None and int(of) == shown, m.string
            assert float(loss) == pytest.approx(rows[shown]["loss"], abs=6e-5), \
                f"{m.string!r} is not row {shown}'s loss {rows[shown]['loss']}"


def test_lr_rows_after_a_resume_from_an_earlier_checkpoint(digits_h5, tmp_path):
    """One fc layer, 2 micro-batches, warm-up 2 then step (gamma 0.5 every
    3): trained to 6, resumed from ckpt_2 and trained to 6 again; every row
    of the resumed file from 3 on holds the applied lr and the NumPy loss."""
    net = [MLP[0], dict(MLP[3], bottom=["fc1", "label"])]
    net[0] = dict(net[0], num_output=10)
    cfg = _config(digits_h5, net, {"base_lr": 0.5, "lr_policy": "step", "stepsize": 3,
                                   "gamma": 0.5, "warmup_iters": 2, "display": 1},
                  {"micro_batches": 2}, 6)
    path, out = write_config_file(tmp_path, cfg), tmp_path / "run"
    for more in ((), ("--resume", out / "ckpt_2.h5")):
        res = run_cli_args("train", path, "--out", out, *more)
        assert res.returncode == 0, res.stderr[-2000:]
    rows = _rows(out)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    lrs = []
    for i in range(3, 7):
        loss, lr = _numpy(digits_h5, out / f"ckpt_{i - 1}.h5", out / f"ckpt_{i}.h5", i)
        assert rows[i]["lr"] == pytest.approx(lr, rel=1e-4), \
            f"row {i}: lr {rows[i]['lr']} is not the applied {lr:.6g}"
        assert rows[i]["loss"] == pytest.approx(loss, rel=1e-5), \
            f"row {i}: loss {rows[i]['loss']} is not the NumPy {loss:.6f}"
        lrs.append(lr)
    assert lrs == pytest.approx([0.5, 0.25, 0.25, 0.25], rel=1e-4)  # the step at 3 applies at 4


@pytest.mark.parametrize("mean", ["global", "shard"])
def test_ignore_label_under_micro_batches(digits_h5, tmp_path, mean):
    """As docs/config.md ("Schedules") says: with an ``ignore_label`` the
    loss of 4 micro-batches and the gradient the update applies (plain SGD:
    Δw = −lr·g) are, by default (``ignore_label_mean: global``), the whole
    batch's PyTorch ``CrossEntropyLoss(ignore_index=3)``, as without
    micro-batches; with ``shard`` the mean of the micro-batches' own means
    (here 2 of 16 samples ignored, in 2 of the 4 micro-batches: the two
    differ). Before the global normaliser the default gave the mean of the
    means (row loss 2.2026797 for the whole batch's 2.2045174)."""
    import torch
    lr = 0.5
    net = [dict(MLP[0], num_output=10), dict(MLP[3], bottom=["fc1", "label"], ignore_label=3)]
    cfg = _config(digits_h5, net, {"base_lr": lr, "lr_policy": "fixed", "display": 1},
                  {"micro_batches": 4, "ignore_label_mean": mean}, 3)
    out = tmp_path / "run"
    res = run_cli_args("train", write_config_file(tmp_path, cfg), "--out", out)
    assert res.returncode == 0, res.stderr[-2000:]
    with h5py.File(digits_h5, "r") as f:
        x = torch.tensor(f["train/data"][2 * B:3 * B].reshape(B, -1), dtype=torch.float64)
        y = torch.tensor(f["train/label"][2 * B:3 * B].astype(np.int64))
    params = []
    for name in ("ckpt_2.h5", "ckpt_3.h5"):
        with h5py.File(out / name, "r") as f:
            params.append({k: torch.tensor(f[f"params/fc1/{k}"][()], dtype=torch.float64)
                           for k in ("weight", "bias")})
    from tests.test_trust_shard_conventions import shards_and_whole
    shards, whole = shards_and_whole(params[0]["weight"], params[0]["bias"], x, y, B)
    assert abs(shards[0] - whole[0]) > 1e-3  # the case tells the two apart
    want = whole if mean == "global" else shards
    assert _rows(out)[3]["loss"] == pytest.approx(want[0], rel=1e-5)
    applied = -(params[1]["weight"] - params[0]["weight"]).numpy() / lr
    np.testing.assert_allclose(applied, want[1], rtol=0, atol=1e-6)
