"""A reported loss is the objective the solver minimises: the sum of the
loss layers times their ``loss_weight`` (docs/formats.md, the ``loss`` of the
train and test rows; Caffe's ``Net::ForwardBackward``), on the train rows,
the test rows and the ``final`` line, with and without micro-batches.

The references: a NumPy evaluation of the saved checkpoint on the whole test
split, and two runs whose updates are equal (``loss_weight`` 0.5 at twice the
learning rate; a second head of ``loss_weight`` 0, which adds no gradient).
Before the fix the figures were the unweighted sum of the loss blobs: the
test loss 2.1146 where the objective was 1.0573, a head of weight 0 added
its whole loss (about 2.3) to every row.
"""
import h5py
import numpy as np
import pytest

from tests.conftest import final_figures, run_cli_args, write_config_file


def _config(digits_h5, weight=1.0, base_lr=0.05, aux=None, micro=1):
    """One fc layer on the digits (a closed-form test loss); ``aux``: the
    ``loss_weight`` of a second fc head and loss, or None for none."""
    net = [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1", "num_output": 10},
           {"type": "softmax_loss", "name": "loss", "bottom": ["fc1", "label"], "top": "loss",
            "loss_weight": weight},
           {"type": "accuracy", "name": "acc", "bottom": ["fc1", "label"], "top": "acc",
            "phase": "test"}]
    if aux is not None:
        net += [{"type": "fc", "name": "aux_fc", "bottom": "data", "top": "aux_fc",
                 "num_output": 10},
                {"type": "softmax_loss", "name": "aux_loss", "bottom": ["aux_fc", "label"],
                 "top": "aux_loss", "loss_weight": aux}]
    return {"name": "lw", "seed": 3,
            "data": {"train": {"source": "hdf5", "path": digits_h5, "split": "train",
                               "batch_size": 16, "shuffle": True},
                     "test": {"source": "hdf5", "path": digits_h5, "split": "test",
                              "batch_size": 60, "shuffle": False}},
            "net": net,
            "parallel": {"micro_batches": micro},
            "solver": {"base_lr": base_lr, "momentum": 0.9, "lr_policy": "fixed", "max_iter": 6,
                       "display": 2, "test_interval": 3},
            "checkpoint": {"interval": 0}}


def _train(tmp_path, name, cfg):
    out = tmp_path / name
    res = run_cli_args("train", write_config_file(tmp_path, cfg, f"{name}.yaml"), "--out", out)
    assert res.returncode == 0, res.stdout + res.stderr
    import json
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return out, rows, final_figures(res)


def _numpy_test(digits_h5, ckpt):
    """(mean cross-entropy in nats, accuracy) of the checkpoint's fc1 over
    the whole test split, in float64."""
    with h5py.File(ckpt, "r") as f:
        w, b = f["params/fc1/weight"][()], f["params/fc1/bias"][()]
    with h5py.File(digits_h5, "r") as f:
        x, y = f["test/data"][()], f["test/label"][()]
    z = x.reshape(len(x), -1).astype(np.float64) @ w.T.astype(np.float64) + b
    z -= z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean()), float((z.argmax(axis=1) == y).mean())


def test_test_loss_is_loss_weight_times_a_numpy_evaluation(digits_h5, tmp_path):
    """The test row and the ``final`` line of a net whose one loss has
    ``loss_weight: 0.5``: loss = 0.5 x the NumPy cross-entropy of the saved
    weights over the 360 test samples; the accuracy is the NumPy one."""
    out, rows, final = _train(tmp_path, "half", _config(digits_h5, weight=0.5, base_lr=0.1))
    ce, acc = _numpy_test(digits_h5, out / "latest.h5")
    test = [r for r in rows if r["phase"] == "test"][-1]
    assert test["samples"] == final["samples"] == 360
    for where, figures in (("metrics.jsonl", test), ("final", final)):
        assert figures["loss"] == pytest.approx(0.5 * ce, rel=1e-5), \
            f"{where}: test loss {figures['loss']} is not loss_weight x cross-entropy " \
            f"0.5 x {ce:.6f} = {0.5 * ce:.6f}"
        assert figures["accuracy"] == pytest.approx(acc, abs=1e-6), where


@pytest.mark.parametrize("micro", [1, 2])
def test_train_rows_are_the_weighted_objective(digits_h5, tmp_path, micro):
    """loss_weight 0.5 at base_lr 0.1 makes the updates of loss_weight 1 at
    base_lr 0.05 (the same weights, checked): every train and test row
    reports half the loss of the weight-1 run."""
    half_out, half, _ = _train(tmp_path, "half", _config(digits_h5, 0.5, 0.1, micro=micro))
    one_out, one, _ = _train(tmp_path, "one", _config(digits_h5, 1.0, 0.05, micro=micro))
    with h5py.File(half_out / "latest.h5", "r") as a, h5py.File(one_out / "latest.h5", "r") as b:
        np.testing.assert_allclose(a["params/fc1/weight"][()], b["params/fc1/weight"][()],
                                   rtol=1e-6, atol=1e-7)
    assert [(r["phase"], r["iter"]) for r in half] == [(r["phase"], r["iter"]) for r in one]
    assert len(half) == 5  # train at 2, 4, 6; test at 3 and 6
    for a, b in zip(half, one):
        assert a["loss"] == pytest.approx(0.5 * b["loss"], rel=1e-5), \
            f"{a['phase']} @ {a['iter']}: loss {a['loss']} with loss_weight 0.5, " \
            f"expected 0.5 x {b['loss']} (the loss_weight 1 run)"


def test_a_head_of_loss_weight_zero_adds_nothing_to_the_reported_loss(digits_h5, tmp_path):
    """A second head with ``loss_weight: 0`` (monitored, not trained on)
    changes no gradient: the train rows, the test rows and the final line
    are those of the net without it."""
    _, plain, plain_final = _train(tmp_path, "plain", _config(digits_h5))
    _, heads, heads_final = _train(tmp_path, "heads", _config(digits_h5, aux=0.0))
    assert [(r["phase"], r["iter"]) for r in heads] == [(r["phase"], r["iter"]) for r in plain]
    for a, b in zip(heads, plain):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), \
            f"{a['phase']} @ {a['iter']}: loss {a['loss']} with a loss_weight 0 head, " \
            f"expected {b['loss']} (the net without it)"
    assert heads_final["loss"] == pytest.approx(plain_final["loss"], rel=1e-6)
