"""Issue 36, items 1, 2 and 12: a progress line at least every
``solver.display_seconds``; train.log holds every error and ends with how the
run ended; resumed runs (elapsed goes on, a synthetic source's leftover path
gets a note, "already finished" without rank-change notes first)."""
import json
import os
import re
import shutil

import h5py
import pytest

from tests.conftest import (run_cli_args, run_mpi_cli, small_net_config, tiny_fc_config,
                      write_config_file)

#: a progress line made by the clock: rank 0's loss of that iteration (issue 46: a
#: line without it looked cut), no lr
ALIVE = re.compile(r"^iter +(\d+)/(\d+)  loss \d+\.\d{4}  [\d,]+ img/s  "
                   r"elapsed \d+:\d\d(:\d\d)?  eta \d+:\d\d(:\d\d)?$")
ENDED = re.compile(r"^run ended: (.+) \(exit (\d+)\)$")


def _log_lines(out):
    with open(os.path.join(str(out), "train.log")) as f:
        return f.read().splitlines()


def _train(tmp_path, cfg, *more, ranks=1, made=False):
    """``train`` into ``tmp_path/run``; ``made``: a folder there already (a
    fresh one that a start-up refusal leaves empty but for its log is
    removed, job/rundir.release_run_dirs: the log of such a refusal is
    read in a folder that was there)."""
    path = write_config_file(tmp_path, cfg)
    out = tmp_path / "run"
    if made:
        out.mkdir()
    args = ("train", path, "--out", out, *more)
    res = run_mpi_cli(ranks, *args) if ranks > 1 else run_cli_args(*args)
    return res, out, path


def test_case1_progress_line_every_display_seconds(digits_h5, tmp_path):
    """Case 1: with display beyond max_iter and display_seconds tiny, lines
    come from the clock before the display line, each with the loss of its
    iteration (issue 46), in train.log too; metrics.jsonl keeps its display
    rows only."""
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=300, display=1000, display_seconds=0.01)
    res, out, _ = _train(tmp_path, cfg)
    assert res.returncode == 0, res.stderr
    alive = [m for m in map(ALIVE.match, res.stdout.splitlines()) if m]
    assert alive, res.stdout
    assert all(int(m.group(2)) == 300 and int(m.group(1)) < 300 for m in alive)
    assert [ln for ln in _log_lines(out) if ALIVE.match(ln)], "train.log misses the lines"
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(ln) for ln in f if ln.strip()]
    assert [r["iter"] for r in rows if r.get("phase") == "train"] == [300]


def _diverge_config(digits_h5):
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(base_lr=1e4, max_iter=60)
    return cfg


def test_case2_divergence_in_train_log_one_rank(digits_h5, tmp_path):
    """Case 2: a diverging run's exit-3 message and its end in train.log (1 rank)."""
    res, out, _ = _train(tmp_path, _diverge_config(digits_h5))
    assert res.returncode == 3, res.stderr
    lines = _log_lines(out)
    assert any(ln.startswith("error: the training diverged") for ln in lines), lines
    m = ENDED.match(lines[-1])
    assert m and m.group(1).startswith("diverged at iteration ") and m.group(2) == "3", lines[-1]


def test_case2_divergence_in_train_log_two_ranks(digits_h5, tmp_path):
    """Case 2: the same on 2 ranks: the message once, the last line says exit 3."""
    res, out, _ = _train(tmp_path, _diverge_config(digits_h5), ranks=2)
    assert res.returncode == 3, res.stderr
    lines = _log_lines(out)
    assert sum(ln.startswith("error: the training diverged") for ln in lines) == 1, lines
    m = ENDED.match(lines[-1])
    assert m and m.group(1).startswith("diverged at iteration ") and m.group(2) == "3", lines[-1]


def test_case2_user_error_after_run_folder(digits_h5, tmp_path):
    """Case 2: a user error once the run folder's log is open (--init of a
    file that is no checkpoint): the error, then ``run ended: user error (exit 2)``."""
    res, out, _ = _train(tmp_path, small_net_config(digits_h5), "--init", digits_h5,
                         made=True)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = _log_lines(out)
    assert lines[-2].startswith("error: ") and "/params" in lines[-2], lines
    assert lines[-1] == "run ended: user error (exit 2)", lines


def test_case2_user_error_two_ranks(digits_h5, tmp_path):
    """Case 2: the same user error on 2 ranks reaches train.log once."""
    res, out, _ = _train(tmp_path, small_net_config(digits_h5), "--init", digits_h5, ranks=2,
                         made=True)
    assert res.returncode == 2, res.stderr
    lines = _log_lines(out)
    assert sum(ln.startswith("error: ") for ln in lines) == 1, lines
    assert lines[-1] == "run ended: user error (exit 2)", lines


@pytest.fixture(scope="module")
def finished(digits_h5, tmp_path_factory):
    """The small digits net trained to its end (iteration 20) on one rank:
    (its run folder, its config file). Read only; a test that resumes
    copies the folder."""
    res, out, path = _train(tmp_path_factory.mktemp("finished"), small_net_config(digits_h5))
    assert res.returncode == 0, res.stderr
    return out, path


def test_case2_normal_end_line(finished):
    """Case 2: a run that finishes ends its log with the iteration and exit 0."""
    out, _ = finished
    lines = _log_lines(out)
    assert lines[-1] == "run ended: finished at iteration 20 (exit 0)", lines
    assert lines[-2].startswith("final {"), lines


def test_case12_elapsed_continues_on_resume(digits_h5, tmp_path):
    """Case 12: the displayed elapsed goes on from the checkpoint's
    ``elapsed`` (set here to 2 h 1 min 40 s) instead of restarting at 0."""
    cfg = small_net_config(digits_h5, checkpoint={"interval": 10, "keep": 3})
    res, out, path = _train(tmp_path, cfg)
    assert res.returncode == 0, res.stderr
    with h5py.File(out / "latest.h5", "r+") as f:
        f.attrs["elapsed"] = 7300.0
    res = run_cli_args("train", path, "--out", out, "--resume", "auto", "--iters", "30")
    assert res.returncode == 0, res.stderr
    shown = re.findall(r"^iter 30/30  loss .* elapsed (\d+):(\d\d):(\d\d)  eta", res.stdout,
                       re.M)
    assert shown, res.stdout
    h, m, s = map(int, shown[0])
    assert h * 3600 + m * 60 + s >= 7300


def test_case12_synthetic_source_with_path_gets_a_note(tmp_path):
    """Case 12: ``source: synthetic`` with a leftover ``path``: a start-up
    note naming the key (the run goes on: not an error)."""
    cfg = tiny_fc_config()
    cfg["data"]["train"].update(source="synthetic", path="leftover.h5")
    res, out, _ = _train(tmp_path, cfg)
    assert res.returncode == 0, res.stderr
    notes = [ln for ln in res.stdout.splitlines() if ln.startswith("note: data.train.path")]
    assert len(notes) == 1 and "'leftover.h5'" in notes[0] and "synthetic" in notes[0], \
        res.stdout
    assert notes[0] in _log_lines(out)


def test_case12_already_finished_comes_first(finished, tmp_path):
    """Case 12: a finished 1-rank run resumed on 2 ranks says "already
    finished" with no rank-change note before it."""
    out, path = tmp_path / "run", finished[1]
    shutil.copytree(finished[0], out, symlinks=True)
    res = run_mpi_cli(2, "train", path, "--out", out, "--resume", "auto")
    assert res.returncode == 0, res.stderr
    text = res.stdout + res.stderr
    assert "already finished at iteration 20" in text, text
    assert "note:" not in text.split("already finished")[0], text
