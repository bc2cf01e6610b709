"""Trust audit: every test row a run writes is the figures of the model it
saved at that iteration, recomputed in NumPy (float64) from the checkpoint
of the same iteration (``ckpt_<iter>.h5``, ``best_<iter>.h5``) over exactly
the test samples docs/config.md ("Sample order") says the pass reads.

The net exercises what a test pass must get right beyond a plain MLP
(tests/test_trust_eval_schemes.py): a batch norm (the test uses its running
statistics, set to the replicas' mean before the pass and the save), a
dropout (off in testing), a loss with an ``ignore_label`` and a
``loss_weight``, an accuracy with the same ``ignore_label`` and a top-3
accuracy without one, and a test batch that no global batch divides (the
last batch padded) or a ``test_iter`` that wraps around the split. A tiny
GPT's val row (data 2, tensor 2) is PyTorch's token-level mean on its
checkpoint. Deliberate mutations these tests caught: no running-statistics
mean (data3, tensor2x2), a figure with an ``ignore_label`` weighted by the
batch's samples instead of its counted positions (every case), ZeRO-3's
test graph without the gathered weights (sharded3: the uniform loss).

Found: with parameter servers in mode sync_ps, ``checkpoint.best`` wrote a
best file at a test pass, and rank 0 took the servers' momenta for it only
at the checkpoint interval: at a checkpoint iteration (and at the end, where
the last pass is often the best) the run's own checkpoint then waited for a
second transfer the servers never sent, and the job ended in the stall
timeout (exit 1: "the server state (momenta) from rank 2 stalled"); a best
file between the intervals held no momenta (a resume from it restarted
them from zero, silently); with ``test_initialization`` the pass at
iteration 0 waited for a transfer before any iteration. Now the servers
send their state after every test pass of a run with ``checkpoint.best``
too, rank 0 takes it once an iteration, and a best file holds the servers'
momenta of its iteration. And ``predict`` under ZeRO-3 wrote the scores of
a test graph whose weights were never gathered from the shards (1.4 from
NumPy's on the weights it was given; ``test`` gathered them): now predict
gives the test graph its weights as a test pass does.
"""
import json

import h5py
import numpy as np
import pytest

from tests.conftest import checkpoint_arrays, run_mpi_cli, train_here, write_config_file

IGNORE, WEIGHT, EPS = 3, 0.5, 1e-5


def _net(bn_first):
    """fc-bn-relu-dropout-fc, or (``bn_first``: a tensor split needs two fc
    layers joined by element-wise ones) fc-bn-relu-fc-relu-dropout-fc."""
    head = [{"type": "fc", "name": "fc0", "bottom": "data", "top": "h", "num_output": 16},
            {"type": "batch_norm", "name": "bn", "bottom": "h", "top": "h"},
            {"type": "relu", "name": "relu0", "bottom": "h", "top": "h"}]
    if bn_first:
        head.append({"type": "fc", "name": "fc1", "bottom": "h", "top": "h", "num_output": 16})
        head.append({"type": "relu", "name": "relu1", "bottom": "h", "top": "h"})
    return head + [
        {"type": "dropout", "name": "drop", "bottom": "h", "top": "h", "ratio": 0.5},
        {"type": "fc", "name": "fc2", "bottom": "h", "top": "fc2", "num_output": 10},
        {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"], "top": "loss",
         "ignore_label": IGNORE, "loss_weight": WEIGHT},
        {"type": "accuracy", "name": "acc", "bottom": ["fc2", "label"], "top": "acc",
         "phase": "test", "ignore_label": IGNORE},
        {"type": "accuracy", "name": "acc3", "bottom": ["fc2", "label"], "top": "acc3",
         "phase": "test", "top_k": 3}]


def _config(digits_h5, parallel, test_batch=50, test_iter=None, bn_first=False, **solver):
    net = _net(bn_first)
    if parallel.get("stages") is True:  # the layers up to fc2 on stage 0, the rest on 1
        names = [layer["name"] for layer in net]
        parallel = dict(parallel, stages={n: int(i >= names.index("fc2"))
                                          for i, n in enumerate(names)})
    return {"name": "oracle", "seed": 4,
            "data": {"train": {"source": "hdf5", "path": digits_h5, "split": "train",
                               "batch_size": 16, "shuffle": True},
                     "test": {"source": "hdf5", "path": digits_h5, "split": "test",
                              "batch_size": test_batch, "shuffle": False}},
            "net": net,
            "solver": dict({"base_lr": 0.1, "momentum": 0.9, "max_iter": 4, "display": 2,
                            "test_interval": 2, "test_iter": test_iter}, **solver),
            "checkpoint": {"interval": 2, "keep": 5},
            "parallel": parallel}


def numpy_figures(digits_h5, net, ckpt, reads=None):
    """The test figures of ``ckpt``'s weights over the test samples
    ``reads`` (default: the split once), in float64: the loss (its
    loss_weight times the mean cross-entropy over the samples whose label
    is not IGNORE), the accuracy over those, the top-3 accuracy over all."""
    with h5py.File(ckpt, "r") as f:
        p = {}
        f["params"].visititems(lambda k, v: p.__setitem__(k, v[()].astype(np.float64))
                               if isinstance(v, h5py.Dataset) else None)
    with h5py.File(digits_h5, "r") as f:
        x, y = f["test/data"][()], f["test/label"][()]
    if reads is not None:
        x, y = x[reads], y[reads]
    h = x.reshape(len(y), -1).astype(np.float64)
    for layer in net:
        kind, name = layer["type"], layer["name"]
        if kind == "fc":
            h = h @ p[f"{name}/weight"].T + p[f"{name}/bias"]
        elif kind == "batch_norm":  # the running statistics, PyTorch's eval()
            h = (h - p[f"{name}/running_mean"]) / np.sqrt(p[f"{name}/running_var"] + EPS) \
                * p[f"{name}/weight"] + p[f"{name}/bias"]
        elif kind == "relu":
            h = np.maximum(h, 0.0)  # dropout: the identity in testing
        if name == "fc2":
            break
    top = h.max(axis=1)
    nll = np.log(np.exp(h - top[:, None]).sum(axis=1)) + top - h[np.arange(len(y)), y]
    kept = y != IGNORE
    above = (h > h[np.arange(len(y)), y][:, None]).sum(axis=1)  # classes scored higher
    return {"loss": WEIGHT * nll[kept].mean(), "acc": (h.argmax(axis=1) == y)[kept].mean(),
            "acc3": (above < 3).mean(), "samples": len(y)}


def _train(tmp_path, ranks, cfg):
    out = tmp_path / "run"
    res = run_mpi_cli(ranks, "train", write_config_file(tmp_path, cfg), "--out", out,
                      timeout=120)
    assert res.returncode == 0, f"exit {res.returncode}: {res.stdout[-800:]} {res.stderr[-1500:]}"
    rows = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r["phase"] == "test"]
    return out, rows


def _check_row(digits_h5, cfg, row, ckpt, reads=None, where=""):
    want = numpy_figures(digits_h5, cfg["net"], ckpt, reads)
    assert row["samples"] == want["samples"], (where, row)
    for key in ("loss", "acc", "acc3"):
        assert row[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), \
            f"{where} iter {row['iter']}: test {key} {row[key]}, NumPy on " \
            f"{ckpt.name} {want[key]:.7f}"


#: name -> (ranks, parallel, config keywords, test positions per pass)
CASES = {
    # 3 replicas: their running statistics averaged; 2 passes of 3 x 50
    # positions for 360 samples, the last padded
    "data3": (3, {"scheme": "data"}, {}, None),
    # a pipeline's micro-batches, test batch 7 read 60 times: the split
    # wraps (420 reads, the first 60 samples twice), the batch norm on stage 0
    "pipeline_micro_wrap": (2, {"scheme": "pipeline", "stages": True, "micro_batches": 2},
                            {"test_batch": 7, "test_iter": 60}, 420),
    # two tensor shards (the batch norm before the split pair), 2 replicas
    "tensor2x2": (4, {"scheme": "tensor", "tensor_parallel": 2}, {"bn_first": True}, None),
    # ZeRO-3: each rank's weight shards gathered for the test graph (a
    # pass on the shards alone reports the uniform loss, 0.5 ln 10)
    "sharded3": (2, {"scheme": "sharded", "shard": 3}, {}, None),
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_test_row_is_numpy_on_the_checkpoint_of_its_iteration(digits_h5, tmp_path,
                                                                   name):
    ranks, parallel, keys, reads = CASES[name]
    cfg = _config(digits_h5, parallel, **keys)
    out, rows = _train(tmp_path, ranks, cfg)
    assert [r["iter"] for r in rows] == [2, 4], rows
    reads = None if reads is None else np.arange(reads) % 360
    for row in rows:
        _check_row(digits_h5, cfg, row, out / f"ckpt_{row['iter']}.h5", reads, name)


@pytest.mark.mpi
def test_sync_ps_best_checkpoints_hold_the_servers_state(digits_h5, tmp_path):
    """sync_ps (2 workers, a server), checkpoint.best keeping the 2 best
    passes by loss, test passes at 0 (test_initialization), 3, 6 and 8,
    checkpoints at 4 and 8: the run ends (before: exit 1 in the stall
    timeout), the best files are the rows' 2 best, each one's figures are
    NumPy's on it, and each holds the servers' momenta of its iteration
    (best_8.h5 those of ckpt_8.h5; before: best_6.h5 held none)."""
    cfg = _config(digits_h5, {"scheme": "data", "mode": "sync_ps", "ps_ranks": 1,
                              "stall_timeout": 10},
                  max_iter=8, test_interval=3, test_initialization=True)
    cfg["checkpoint"] = {"interval": 4, "keep": 5, "best": {"metric": "loss", "keep": 2}}
    out, rows = _train(tmp_path, 3, cfg)
    assert [r["iter"] for r in rows] == [0, 3, 6, 8], rows
    best = sorted(r["iter"] for r in sorted(rows, key=lambda r: (r["loss"], r["iter"]))[:2])
    on_disk = sorted(int(p.name[5:-3]) for p in out.glob("best_*.h5"))
    assert on_disk == best, (on_disk, rows)
    learnable = {"fc0/weight", "fc0/bias", "bn/weight", "bn/bias", "fc2/weight", "fc2/bias"}
    for it in on_disk:
        row = next(r for r in rows if r["iter"] == it)
        _check_row(digits_h5, cfg, row, out / f"best_{it}.h5", where="sync_ps best")
        saved = checkpoint_arrays(out / f"best_{it}.h5")
        momenta = {k[len("solver/"):-len("/momentum")] for k in saved
                   if k.endswith("/momentum")}
        assert momenta == learnable, f"best_{it}.h5 holds the momenta of {sorted(momenta)}"
        assert all(np.abs(saved[f"solver/{p}/momentum"]).max() > 0 for p in learnable)
    assert 8 in on_disk, rows  # the loss falls here: the last pass is among the best
    final, last = checkpoint_arrays(out / "ckpt_8.h5"), checkpoint_arrays(out / "best_8.h5")
    assert sorted(final) == sorted(last)
    for k in final:
        np.testing.assert_array_equal(last[k], final[k], err_msg=k)


def _torch_val(cfg, ckpt, ignore):
    """A GPT's val figures in PyTorch (tests/gpt_oracle.py, float64) on
    ``ckpt``'s weights over every window of the val split once: the mean
    cross-entropy over the tokens whose label is not ``ignore``, the
    next-token accuracy over all tokens."""
    import torch

    from purine_mpi.data.sources import make_source
    from tests.gpt_oracle import torch_gpt_from_net
    x, y = (np.asarray(a, np.int64) for a in make_source(cfg["data"]["test"]).gather(
        np.arange(make_source(cfg["data"]["test"]).n_samples)))
    with h5py.File(ckpt, "r") as f:
        params = {}
        f["params"].visititems(lambda k, v: params.__setitem__(k, v[()])
                               if isinstance(v, h5py.Dataset) else None)
    model, _ = torch_gpt_from_net(cfg["net"], params)
    model = model.double().eval()
    with torch.no_grad():
        logits, _ = model(torch.from_numpy(x))
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.from_numpy(y).flatten(),
                                                reduction="none").numpy()
    kept = y.ravel() != ignore
    right = logits.argmax(-1).numpy() == y
    return {"loss": nll[kept].mean(), "accuracy": right.mean(), "samples": len(y)}


@pytest.mark.mpi
@pytest.mark.parametrize("parallel", [{"scheme": "data"},
                                      {"scheme": "tensor", "tensor_parallel": 2}],
                         ids=["data2", "tensor2"])
def test_a_gpt_val_row_is_torch_on_the_checkpoint(tmp_path, parallel):
    """A tiny GPT (byte tokens, windows of 8) on 2 ranks, the loss ignoring
    the newline byte, val batches of 5 (the split's last batch padded): the
    val row's loss is PyTorch's token-level mean over the counted tokens of
    every val window, its accuracy over all tokens, ``tokens`` the windows
    times 8."""
    from tests.gpt_nets import gpt_config, text_h5
    newline = 10
    cfg = gpt_config(text_h5(tmp_path), layers=1, width=16, heads=4, length=8, batch=4,
                     iters=2, parallel=parallel)
    cfg["net"][-1]["ignore_label"] = newline
    cfg["net"].append({"type": "accuracy", "name": "acc", "bottom": ["logits", "label"],
                       "top": "acc", "axis": -1, "phase": "test"})
    cfg["data"]["test"]["batch_size"] = 5
    cfg["solver"].update(test_interval=2, test_iter=None, test_initialization=False)
    cfg["checkpoint"] = {"interval": 2}
    out, rows = _train(tmp_path, 2, cfg)
    (row,) = rows
    want = _torch_val(cfg, out / "ckpt_2.h5", newline)
    assert row["samples"] == want["samples"] and row["tokens"] == 8 * want["samples"], row
    for key in ("loss", "accuracy"):
        assert row[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), \
            f"val {key} {row[key]}, PyTorch on ckpt_2.h5 {want[key]:.7f}"


def _numpy_scores(digits_h5, net, ckpt):
    """fc2's scores of ``ckpt``'s weights for every test sample (float64)."""
    with h5py.File(ckpt, "r") as f:
        p = {}
        f["params"].visititems(lambda k, v: p.__setitem__(k, v[()].astype(np.float64))
                               if isinstance(v, h5py.Dataset) else None)
    with h5py.File(digits_h5, "r") as f:
        x = f["test/data"][()]
    h = x.reshape(len(x), -1).astype(np.float64)
    for layer in net:
        kind, name = layer["type"], layer["name"]
        if kind == "fc":
            h = h @ p[f"{name}/weight"].T + p[f"{name}/bias"]
        elif kind == "batch_norm":
            h = (h - p[f"{name}/running_mean"]) / np.sqrt(p[f"{name}/running_var"] + EPS) \
                * p[f"{name}/weight"] + p[f"{name}/bias"]
        elif kind == "relu":
            h = np.maximum(h, 0.0)
        if name == "fc2":
            return h


@pytest.mark.mpi
def test_predict_under_zero3_writes_the_saved_models_scores(digits_h5, tmp_path):
    """``predict`` on 2 ranks under ZeRO-3 (scheme sharded, shard 3): the
    scores of the weights it was given, NumPy's on that file, as ``test``
    under the same scheme evaluates them. Before, predict ran the test
    graph without gathering the weight shards, on weights that were not the
    file's (scores off by 1.4)."""
    cfg = _config(digits_h5, {})
    weights = train_here(cfg, tmp_path / "run") / "latest.h5"
    cfg["parallel"] = {"scheme": "sharded", "shard": 3}
    res = run_mpi_cli(2, "predict", write_config_file(tmp_path, cfg, "zero3.yaml"),
                      "--weights", weights, "--out", tmp_path / "p.h5")
    assert res.returncode == 0, res.stdout[-500:] + res.stderr[-1500:]
    with h5py.File(tmp_path / "p.h5", "r") as f:
        scores = f["outputs/fc2"][()]
    want = _numpy_scores(digits_h5, cfg["net"], weights)
    err = float(np.abs(scores - want).max())
    assert scores.shape == want.shape and err < 1e-4, \
        f"predict's scores under ZeRO-3 are {err:.3g} from NumPy's on {weights.name}"
    # a pipeline is refused for what it is (before: rank 0's stage, which
    # holds no loss, said "the test phase has no loss layer")
    cfg["parallel"] = {"scheme": "pipeline", "stages": True}
    pipe = write_config_file(tmp_path, _config(digits_h5, cfg["parallel"]), "pipe.yaml")
    res = run_mpi_cli(2, "predict", pipe, "--weights", weights, "--out", tmp_path / "pipe.h5")
    assert res.returncode == 2 and "not a pipeline or hybrid scheme" in res.stderr, res.stderr
