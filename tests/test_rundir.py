"""Runs are never clobbered: numbered run folders, --resume auto picks the
newest, an --out holding another run needs --resume or --force, a run locks
its folder, and checkpoint rotation deletes only its own run's files."""
import os
import subprocess
import time

import numpy as np
import pytest

from purine_mpi.base.errors import UserError
from purine_mpi.job.checkpoint_file import load_checkpoint
from purine_mpi.job.run_checkpoints import save_run_checkpoint
from purine_mpi.job.rundir import choose_run_dir, lock_run_dir
from tests.conftest import PYTHON, REPO, cli_env, run_cli_args, write_config_file
from tests.test_train import small_net_config


def _job(tmp_path, digits_h5, iters=6):
    cfg = small_net_config(digits_h5)
    cfg["name"] = "job"
    cfg["solver"].update({"max_iter": iters, "display": 0, "test_interval": 0})
    cfg["checkpoint"] = {"interval": 3, "keep": 1}
    return write_config_file(tmp_path, cfg)


def test_each_run_gets_a_numbered_folder_and_resume_auto_takes_the_newest(tmp_path, digits_h5):
    cfg = _job(tmp_path, digits_h5)
    for _ in range(2):
        res = run_cli_args("train", cfg, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
    runs = tmp_path / "runs" / "job"
    assert sorted(os.listdir(runs)) == ["1", "2"]
    for n in ("1", "2"):  # both runs kept whole
        assert (runs / n / "metrics.jsonl").exists() and (runs / n / "latest.h5").exists()
    first = (runs / "1" / "latest.h5").stat().st_mtime_ns
    res = run_cli_args("train", cfg, "--resume", "auto", "--iters", 9, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(runs)) == ["1", "2"]  # continued run 2, made no new folder
    assert load_checkpoint(runs / "2" / "latest.h5").iteration == 9
    assert (runs / "1" / "latest.h5").stat().st_mtime_ns == first


def test_explicit_out_holding_a_run_needs_resume_or_force(tmp_path, digits_h5):
    cfg = _job(tmp_path, digits_h5)
    out = tmp_path / "out"
    assert run_cli_args("train", cfg, "--out", out).returncode == 0
    before = (out / "metrics.jsonl").read_text()
    res = run_cli_args("train", cfg, "--out", out)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--resume" in res.stderr and "--force" in res.stderr and str(out) in res.stderr
    assert (out / "metrics.jsonl").read_text() == before  # nothing touched
    res = run_cli_args("train", cfg, "--out", out, "--force")
    assert res.returncode == 0, res.stderr
    assert "deleted the previous run's files" in res.stdout + res.stderr


def test_a_second_run_into_a_locked_folder_exits_2_naming_the_first(tmp_path, digits_h5):
    cfg = _job(tmp_path, digits_h5)
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [PYTHON, "-c", "import sys, time; from purine_mpi.job.rundir import lock_run_dir; "
                       "lock_run_dir(sys.argv[1]); print('locked', flush=True); time.sleep(60)",
         str(out)], cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        res = run_cli_args("train", cfg, "--out", out, "--resume", "auto")
        assert res.returncode == 2 and "Traceback" not in res.stderr
        assert "in use by another run" in res.stderr and f"pid {holder.pid}" in res.stderr
        assert not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    assert run_cli_args("train", cfg, "--out", out, "--resume", "auto").returncode == 0


def test_lock_is_exclusive_within_a_process_family(tmp_path):
    lock_run_dir(str(tmp_path))
    res = subprocess.run([PYTHON, "-c", "import sys; from purine_mpi.job.rundir import "
                          "lock_run_dir; lock_run_dir(sys.argv[1])", str(tmp_path)],
                         cwd=REPO, env=cli_env(), capture_output=True, text=True)
    assert res.returncode != 0 and "in use by another run" in res.stderr


def test_rotation_deletes_only_its_own_runs_checkpoints(tmp_path):
    params = {"w": np.ones(3, np.float32)}
    for it in (1, 2):
        save_run_checkpoint(str(tmp_path), it, keep=1, params=params, run_id="other")
    for it in (10, 20, 30):
        save_run_checkpoint(str(tmp_path), it, keep=1, params=params, run_id="mine")
    left = sorted(os.listdir(tmp_path))
    assert left == ["ckpt_2.h5", "ckpt_30.h5", "latest.h5"]


def test_choose_run_dir_rules(tmp_path):
    root = str(tmp_path / "runs")
    a, _ = choose_run_dir("j", runs_root=root)
    b, _ = choose_run_dir("j", runs_root=root)
    assert (os.path.basename(a), os.path.basename(b)) == ("1", "2")
    # --resume auto with nothing to resume: a fresh numbered folder
    c, _ = choose_run_dir("j", resume="auto", runs_root=root)
    assert os.path.basename(c) == "3"
    open(os.path.join(b, "metrics.jsonl"), "w").close()
    d, _ = choose_run_dir("j", resume="auto", runs_root=root)
    assert d == b  # the newest folder that holds a run
    with pytest.raises(UserError, match="--force"):
        choose_run_dir("j", out=b)


def _hold_lock(out):
    """A process holding ``out``'s run lock, as a running run does."""
    holder = subprocess.Popen(
        [PYTHON, "-c", "import sys, time; from purine_mpi.job.rundir import lock_run_dir; "
                       "lock_run_dir(sys.argv[1]); print('locked', flush=True); time.sleep(60)",
         str(out)], cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_force_into_a_running_runs_folder_deletes_nothing(tmp_path, digits_h5):
    """Issue 21, case 1: the lock is taken before --force deletes."""
    cfg = _job(tmp_path, digits_h5)
    out = tmp_path / "out"
    assert run_cli_args("train", cfg, "--out", out).returncode == 0
    before = {n: (out / n).read_bytes() for n in os.listdir(out) if n != ".purine.lock"}
    assert "metrics.jsonl" in before and "config.yaml" in before and "latest.h5" in before
    holder = _hold_lock(out)  # the first run is still running
    try:
        res = run_cli_args("train", cfg, "--out", out, "--force")
        assert res.returncode == 2 and "Traceback" not in res.stderr
        assert "in use by another run" in res.stderr and f"pid {holder.pid}" in res.stderr
        assert "deleted" not in res.stdout + res.stderr
        after = {n: (out / n).read_bytes() for n in os.listdir(out) if n != ".purine.lock"}
        assert after == before  # every file of the running run is still there, unchanged
    finally:
        holder.kill()
        holder.wait()


def test_resume_of_another_runs_checkpoint_into_a_runs_folder_is_refused(tmp_path, digits_h5):
    """Issue 21, case 2: --resume FILE continues the folder's run, or exit 2."""
    cfg = _job(tmp_path, digits_h5)
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        assert run_cli_args("train", cfg, "--out", out).returncode == 0
    before = {n: (a / n).read_bytes() for n in ("metrics.jsonl", "latest.h5", "ckpt_6.h5")}
    res = run_cli_args("train", cfg, "--out", a, "--iters", 9, "--resume", b / "latest.h5")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert str(a) in res.stderr and str(b / "latest.h5") in res.stderr
    assert "another run" in res.stderr and "--force" in res.stderr
    assert {n: (a / n).read_bytes() for n in before} == before
    # the folder's own run continues: its checkpoint, or a copy of it elsewhere
    copy = tmp_path / "copy.h5"
    copy.write_bytes(before["latest.h5"])
    res = run_cli_args("train", cfg, "--out", a, "--iters", 9, "--resume", copy)
    assert res.returncode == 0, res.stderr
    assert load_checkpoint(a / "latest.h5").iteration == 9
    res = run_cli_args("train", cfg, "--out", a, "--iters", 12, "--resume", a / "ckpt_9.h5")
    assert res.returncode == 0, res.stderr
    # --force: the folder's files go, the other run goes on there from its checkpoint
    res = run_cli_args("train", cfg, "--out", a, "--iters", 9, "--resume", b / "latest.h5",
                       "--force")
    assert res.returncode == 0, res.stderr
    ck = load_checkpoint(a / "latest.h5")
    assert ck.iteration == 9
    assert ck.attrs["run_id"] == load_checkpoint(b / "latest.h5").attrs["run_id"]
    assert not (a / "ckpt_12.h5").exists()


def test_choose_run_dir_locks_before_it_looks(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    seen = []

    def lock(folder):
        seen.append(os.listdir(folder))
        raise UserError("locked")
    with pytest.raises(UserError, match="locked"):
        choose_run_dir("j", out=str(out), force=True, lock=lock)
    assert seen == [["metrics.jsonl"]] and (out / "metrics.jsonl").exists()
