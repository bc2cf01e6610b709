"""Review of the merge of 'small' (session 66).

A run refused at start-up by the ``--profile-iters`` window or a watched
metric (``checkpoint.best`` / ``solver.early_stop`` naming no test figure)
writes nothing into its run folder.

Before: those checks ran in their services' ``on_start``, after Progress
had written ``config.yaml`` and an empty ``metrics.jsonl`` (or
``metrics.jsonl.resumed.<pid>``) and after the trace file had been opened:
a refused ``--resume`` truncated the folder's earlier ``trace.rank0.json``
to an empty trace (lost), and a refused fresh run left a new numbered run
folder. Now they are ``check_start`` hooks (train/loop.py), emitted before
any ``on_start``, the trace file is made in ``on_start``, and a fresh run's
window is checked before its run folder is made (cli.cmd_train).
"""
import os

from tests.conftest import run_cli_args, small_net_config, write_config_file

#: what a refused run may change: its log (appended) and the folder's lock
_MAY_CHANGE = ("train.log", ".purine.lock")


def _snapshot(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))
            if name not in _MAY_CHANGE and (folder / name).is_file()}


def _config(digits_h5, tmp_path, **checkpoint):
    cfg = small_net_config(digits_h5, solver={
        "base_lr": 0.05, "max_iter": 4, "display": 2, "test_interval": 0})
    cfg["checkpoint"] = {"interval": 0, "keep": 3, "folder": str(tmp_path / "runs"),
                         **checkpoint}
    return write_config_file(tmp_path, cfg)


def test_a_refused_resume_leaves_the_run_folder_as_it_was(digits_h5, tmp_path):
    cfg = _config(digits_h5, tmp_path)
    run = tmp_path / "run"
    res = run_cli_args("train", cfg, "--out", run, "--profile-iters", "1:3")
    assert res.returncode == 0, res.stderr
    before = _snapshot(run)
    assert {"config.yaml", "metrics.jsonl", "trace.rank0.json", "latest.h5"} <= set(before)
    assert len(before["trace.rank0.json"]) > 200  # the ops of iterations 1 and 2
    # a window before the resumed iterations (4, 5): refused
    res = run_cli_args("train", cfg, "--out", run, "--resume", "auto", "--iters", "6",
                       "--profile-iters", "1:3")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "traces none of the iterations this run trains (4 to 5)" in res.stderr
    # before: trace.rank0.json was an empty trace and metrics.jsonl.resumed.<pid> new
    assert _snapshot(run) == before, sorted(_snapshot(run))
    # a watched metric that is no test figure: refused, the folder as it was
    res = run_cli_args("train", cfg, "--out", run, "--resume", "auto", "--iters", "6",
                       "--profile-iters", "4:6", "--set", "checkpoint.best.metric=acc")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "checkpoint.best.metric" in res.stderr and "not a test figure" in res.stderr
    assert _snapshot(run) == before, sorted(_snapshot(run))


def test_a_refused_fresh_run_writes_no_run_file(digits_h5, tmp_path):
    cfg = _config(digits_h5, tmp_path)
    runs = tmp_path / "runs"  # checkpoint.folder: its numbered runs
    # the window past max_iter 4: exit 2 before the numbered folder is made
    res = run_cli_args("train", cfg, "--profile-iters", "5:8")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "traces none of the iterations this run trains (0 to 3)" in res.stderr
    assert not runs.exists() or not os.listdir(runs), os.listdir(runs)  # before: runs/tiny/1
    # a watched metric found only once the graphs are built: no run file
    # (config.yaml, metrics.jsonl, trace.rank0.json before), and no folder
    # either now (its train.log and lock were left: test_trust_cfg67)
    out = tmp_path / "fresh"
    res = run_cli_args("train", cfg, "--out", out, "--profile",
                       "--set", "solver.early_stop.metric=acc")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "solver.early_stop.metric" in res.stderr and "not a test figure" in res.stderr
    assert not out.exists(), sorted(os.listdir(out))


def test_first_iteration_nan_on_one_rank_blames_the_weights_on_rank_0(digits_h5, tmp_path):
    """Two ranks of data parallelism, initial weights whose loss overflows
    only on rank 1's batch (rank 0's is all zeros). Before: rank 0 looked
    at its own (finite) loss and said "the training diverged ... Lower
    solver.base_lr", the message of a rate; now the ranks agree on the
    diverged iteration and rank 0 blames the initial weights, exit 3."""
    import h5py
    import numpy as np

    from tests.conftest import run_mpi_cli
    data = tmp_path / "half.h5"
    data.write_bytes(open(digits_h5, "rb").read())
    with h5py.File(data, "r+") as f:  # batches 0, 2, 4, ... of 16: zeros
        d = f["train/data"]
        a = d[...]
        a[(np.arange(len(a)) // 16) % 2 == 0] = 0
        d[...] = a
    cfg = small_net_config(str(data), solver={"base_lr": 0.05, "max_iter": 2, "display": 0,
                                              "test_interval": 0})
    cfg["data"]["train"]["shuffle"] = False
    cfg = write_config_file(tmp_path, cfg)
    res = run_cli_args("train", cfg, "--out", tmp_path / "a")
    assert res.returncode == 0, res.stderr
    weights = tmp_path / "big.h5"
    weights.write_bytes((tmp_path / "a" / "latest.h5").read_bytes())
    with h5py.File(weights, "r+") as f:  # zero input: finite logits; else they overflow
        f["params/conv1/bias"][...] = 0
        w = f["params/fc1/weight"]
        w[...] = np.where(np.arange(w.size).reshape(w.shape) % 2, 3e38, -3e38)
    res = run_mpi_cli(2, "train", cfg, "--init", weights, "--out", tmp_path / "b")
    assert res.returncode == 3, res.stdout + res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr  # rank 0's alone
    assert "at the first iteration of the run (iteration 1), before any update" in errors[0] \
        and f"from --init {weights}" in errors[0], errors[0]
