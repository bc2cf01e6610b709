"""Habits users bring from Caffe and Lightning: the best-k checkpoints by a
test figure, early stopping, a test pass before training, and the run
folder's train.log."""
import json
import re

import h5py
import pytest

from tests.conftest import run_cli_args, run_mpi_cli


def _sets(digits_h5, *extra):
    sets = [f"data.train.path={digits_h5}", f"data.test.path={digits_h5}",
            "solver.test_interval=100", *extra]
    return [a for s in sets for a in ("--set", s)]


def _tests(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["iter"], r["accuracy"]) for r in rows if r["phase"] == "test"]


def test_the_best_k_checkpoints_follow_the_test_accuracy(tmp_path, digits_h5):
    out = tmp_path / "run"
    res = run_cli_args("train", "jobs/digits_lenet.yaml", "--out", out, "--iters", "500",
                       *_sets(digits_h5, "checkpoint.best={metric: accuracy, keep: 2}"))
    assert res.returncode == 0, res.stderr
    tests = _tests(out)
    ranked = sorted(tests, key=lambda t: (-t[1], t[0]))[:2]
    kept = sorted(int(p.name[5:-3]) for p in out.glob("best_*.h5"))
    assert kept == sorted(it for it, _ in ranked), (tests, kept)
    for it in kept:  # each is a whole checkpoint of that iteration
        with h5py.File(out / f"best_{it}.h5", "r") as f:
            assert int(f.attrs["iteration"]) == it and "params" in f


def test_early_stop_ends_the_run_with_a_checkpoint(tmp_path, digits_h5):
    out = tmp_path / "run"
    # min_delta 1: no test pass can improve on the first by more than that
    res = run_cli_args("train", "jobs/digits_lenet.yaml", "--out", out, "--iters", "900",
                       *_sets(digits_h5, "solver.early_stop={metric: accuracy, patience: 2, "
                                         "min_delta: 1}"))
    assert res.returncode == 0, res.stderr
    assert [it for it, _ in _tests(out)] == [100, 200, 300]
    assert "early stop at iteration 300: accuracy has not improved by more than 1" in res.stdout
    final = json.loads(res.stdout.split("final ", 1)[1].splitlines()[0])
    assert final["early_stop"] == 300
    with h5py.File(out / "latest.h5", "r") as f:
        assert int(f.attrs["iteration"]) == 300


def test_a_bad_watch_metric_is_named(tmp_path, digits_h5):
    res = run_cli_args("train", "jobs/digits_lenet.yaml", "--out", tmp_path / "r", "--iters",
                       "100", *_sets(digits_h5, "checkpoint.best={metric: top5}"))
    assert res.returncode == 2 and "checkpoint.best.metric" in res.stderr and "top5" in res.stderr
    res = run_cli_args("train", "jobs/digits_lenet.yaml", "--out", tmp_path / "r2", "--iters",
                       "100", *_sets(digits_h5, "solver.early_stop={patience: 0}"))
    assert res.returncode == 2 and "solver.early_stop" in res.stderr


def test_test_initialization_evaluates_before_the_first_iteration(tmp_path, digits_h5):
    out = tmp_path / "run"
    res = run_cli_args("train", "jobs/digits_lenet.yaml", "--out", out, "--iters", "100",
                       *_sets(digits_h5, "solver.test_initialization=true"))
    assert res.returncode == 0, res.stderr
    tests = _tests(out)
    assert [it for it, _ in tests] == [0, 100] and tests[0][1] < 0.5  # untrained: chance


@pytest.mark.mpi
def test_train_log_holds_the_terminal_lines_across_resumes_and_rank_errors(tmp_path,
                                                                            digits_h5):
    out = tmp_path / "run"
    first = run_mpi_cli(2, "train", "jobs/digits_lenet.yaml", "--out", out, "--iters", "100",
                        *_sets(digits_h5))
    assert first.returncode == 0, first.stderr
    log = (out / "train.log").read_text()
    for line in first.stdout.splitlines():
        if line.strip():
            assert line in log, line  # every line rank 0 printed
    second = run_mpi_cli(2, "train", "jobs/digits_lenet.yaml", "--out", out, "--iters", "200",
                         "--resume", "auto", *_sets(digits_h5))
    assert second.returncode == 0, second.stderr
    log2 = (out / "train.log").read_text()
    assert log2.startswith(log) and "resumed from" in log2 and log2.count("--- ") == 2
    # an error after the run folder exists is in the log too
    bad = run_cli_args("train", "jobs/digits_lenet.yaml", "--out", out, "--iters", "300",
                       "--resume", str(out / "nonesuch.h5"), *_sets(digits_h5))
    assert bad.returncode == 2
    assert re.search(r"error.*nonesuch\.h5", (out / "train.log").read_text())


def test_a_log_alone_does_not_hold_the_folder(tmp_path, digits_h5):
    out = tmp_path / "run"
    out.mkdir()  # a folder that was there: a fresh one the refusal made is removed (rundir.py)
    bad = run_cli_args("train", "jobs/digits_lenet.yaml", "--out", out, "--iters", "10",
                       "--init", str(tmp_path / "nonesuch.h5"), *_sets(digits_h5))
    assert bad.returncode == 2 and (out / "train.log").exists()
    good = run_cli_args("train", "jobs/digits_lenet.yaml", "--out", out, "--iters", "10",
                        *_sets(digits_h5))
    assert good.returncode == 0, good.stderr
    assert "nonesuch" in (out / "train.log").read_text()  # the failed attempt stays in the log
