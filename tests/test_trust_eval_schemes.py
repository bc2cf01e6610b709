"""The test figures a run reports are those of the model it saved: under
every scheme the ``final`` line and the last test row of metrics.jsonl equal
a NumPy evaluation of ``latest.h5``'s weights over the whole test split
(360 samples, which no global test batch here divides: the last batch is
padded), every sample counted once, the loss times its ``loss_weight``.

The reference is NumPy (a two-layer MLP in float64). Before the fix, under
``parallel.mode: async`` (max_staleness > 0) each worker evaluated its shard
with its own last-pulled weights, and latest.h5 held rank 0's copy rather
than the servers' final weights, so the figures described none of them.
"""
import json

import h5py
import numpy as np
import pytest

from tests.conftest import final_figures, run_cli_args, run_mpi_cli, write_config_file

#: the reported loss is the objective: loss_weight x the cross-entropy
#: (tests/test_trust_loss_weight.py), under every scheme's composition
LOSS_WEIGHT = 0.5
STAGES = {"fc1": 0, "relu1": 0, "fc2": 1, "loss": 1, "acc": 1}
#: name -> (ranks, parallel section)
SCHEMES = {
    "none": (1, {}),
    "data3": (3, {"scheme": "data"}),
    "pipeline_micro": (2, {"scheme": "pipeline", "stages": STAGES, "micro_batches": 2}),
    "tensor": (2, {"scheme": "tensor", "tensor_parallel": 2}),
    "sharded3": (2, {"scheme": "sharded", "shard": 3}),
    "sync_ps": (3, {"scheme": "data", "mode": "sync_ps", "ps_ranks": 1}),
    "async": (3, {"scheme": "data", "mode": "async", "ps_ranks": 1, "max_staleness": 2}),
}


def _config(digits_h5, parallel):
    return {"name": "ev", "seed": 4,
            "data": {"train": {"source": "hdf5", "path": digits_h5, "split": "train",
                               "batch_size": 16, "shuffle": True},
                     "test": {"source": "hdf5", "path": digits_h5, "split": "test",
                              "batch_size": 50, "shuffle": False}},
            "net": [{"type": "fc", "name": "fc1", "bottom": "data", "top": "h",
                     "num_output": 32},
                    {"type": "relu", "name": "relu1", "bottom": "h", "top": "h"},
                    {"type": "fc", "name": "fc2", "bottom": "h", "top": "fc2",
                     "num_output": 10},
                    {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"],
                     "top": "loss", "loss_weight": LOSS_WEIGHT},
                    {"type": "accuracy", "name": "acc", "bottom": ["fc2", "label"],
                     "top": "acc", "phase": "test"}],
            "solver": {"base_lr": 0.1, "momentum": 0.9, "max_iter": 12, "display": 4,
                       "test_interval": 0},
            "checkpoint": {"interval": 0},
            "parallel": parallel}


def numpy_figures(digits_h5, ckpt):
    """(LOSS_WEIGHT x mean cross-entropy, accuracy, samples) of the
    checkpoint's MLP over the whole test split, in float64."""
    with h5py.File(ckpt, "r") as f:
        w1, b1, w2, b2 = (f[f"params/{n}"][()].astype(np.float64) for n in
                          ("fc1/weight", "fc1/bias", "fc2/weight", "fc2/bias"))
    with h5py.File(digits_h5, "r") as f:
        x, y = f["test/data"][()], f["test/label"][()]
    h = np.maximum(x.reshape(len(x), -1).astype(np.float64) @ w1.T + b1, 0.0)
    z = h @ w2.T + b2
    z -= z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return LOSS_WEIGHT * float(-logp[np.arange(len(y)), y].mean()), \
        float((z.argmax(axis=1) == y).mean()), len(y)


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_reported_test_figures_are_the_saved_models(digits_h5, tmp_path, name):
    ranks, parallel = SCHEMES[name]
    path = write_config_file(tmp_path, _config(digits_h5, parallel))
    out = tmp_path / "run"
    args = ("train", path, "--out", out)
    res = run_mpi_cli(ranks, *args) if ranks > 1 else run_cli_args(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    loss, accuracy, samples = numpy_figures(digits_h5, out / "latest.h5")
    row = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r["phase"] == "test"][-1]
    for where, got in (("final", final_figures(res)), ("metrics.jsonl", row)):
        assert got["samples"] == samples, (name, where, got)
        assert got["loss"] == pytest.approx(loss, rel=1e-5), \
            f"{name}: {where} test loss {got['loss']}, NumPy on latest.h5 {loss:.7f}"
        assert got["accuracy"] == pytest.approx(accuracy, abs=1e-6), \
            f"{name}: {where} accuracy {got['accuracy']}, NumPy on latest.h5 {accuracy:.7f}"


@pytest.mark.mpi
def test_an_async_checkpoint_between_the_ends_holds_the_servers_state(digits_h5, tmp_path):
    """An async run's checkpoint at its interval holds the servers' momenta
    (before, none: a resume from it started every momentum from zero,
    silently) and weights of the same moment, and a resume from it ends with
    figures of the model it saved."""
    cfg = _config(digits_h5, SCHEMES["async"][1])
    cfg["checkpoint"] = {"interval": 6, "keep": 5}
    path = write_config_file(tmp_path, cfg)
    out = tmp_path / "run"
    res = run_mpi_cli(3, "train", path, "--out", out)
    assert res.returncode == 0, res.stdout + res.stderr
    with h5py.File(out / "ckpt_6.h5", "r") as f:
        solver = {n: f[f"solver/{n}/momentum"][()] for n in
                  ("fc1/weight", "fc1/bias", "fc2/weight", "fc2/bias")
                  if f"solver/{n}/momentum" in f}
    assert sorted(solver) == ["fc1/bias", "fc1/weight", "fc2/bias", "fc2/weight"], \
        f"ckpt_6.h5 of an async run holds momenta of {sorted(solver)} only"
    assert all(np.abs(m).max() > 0 for m in solver.values())
    again = tmp_path / "again"
    res = run_mpi_cli(3, "train", path, "--out", again, "--resume", out / "ckpt_6.h5")
    assert res.returncode == 0, res.stdout + res.stderr
    loss, accuracy, _ = numpy_figures(digits_h5, again / "latest.h5")
    final = final_figures(res)
    assert final["loss"] == pytest.approx(loss, rel=1e-5)
    assert final["accuracy"] == pytest.approx(accuracy, abs=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["sync_ps", "async"])
def test_early_stopping_with_parameter_servers_is_refused(digits_h5, tmp_path, mode):
    """solver.early_stop with parameter servers exits 2 naming the key, before
    anything runs. Before: the workers stopped after a test pass and printed
    a ``final`` line with ``early_stop``, while the servers, which take no
    part in test passes, waited for the next gradients until the stall
    timeout ended the job with exit 1 (after 300 s by default)."""
    parallel = dict(SCHEMES[mode][1], stall_timeout=10)
    cfg = _config(digits_h5, parallel)
    cfg["solver"].update(max_iter=40, test_interval=4,
                         early_stop={"metric": "accuracy", "patience": 1, "min_delta": 1})
    res = run_mpi_cli(3, "train", write_config_file(tmp_path, cfg), "--out", tmp_path / "run",
                      timeout=120)
    assert res.returncode == 2, f"exit {res.returncode}: {res.stdout[-600:]} {res.stderr[-600:]}"
    assert "solver.early_stop" in res.stderr and mode in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "final " not in res.stdout
