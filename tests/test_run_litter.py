"""What a killed or starved run leaves in its folder (session 71's failure
hunt): the temporary files of killed writers are removed by the next run
there, whatever file they were for, and a full disk (or ``ulimit -f``)
while a resumed run sets up its metrics is one line naming the file, with
``metrics.jsonl`` as it was and no temporary file left."""
import json
import os
import subprocess
import sys

from purine_mpi.job.run_checkpoints import remove_stale_temp_files

from .conftest import REPO, cli_env, run_cli_args

DEAD = 999999999  # above any pid_max: no process has it


def test_every_kind_of_killed_writers_file_is_removed(tmp_path):
    """A resumed run killed (kill -9, the OOM killer, a node's crash)
    before its first checkpoint left ``metrics.jsonl.resumed.<pid>`` (a copy
    of the rows) for good, one more per such resume, and a kill during the
    write of memory.json its ``memory.json.tmp.<pid>``: only the
    checkpoints' ``*.h5.tmp.<pid>`` were removed. A live writer's files and
    files that are not ours stay."""
    dead = [f"metrics.jsonl.resumed.{DEAD}", f"memory.json.tmp.{DEAD}",
            f"calibration.json.tmp.{DEAD}", f"metrics.jsonl.tmp.{DEAD}",
            f"ckpt_40.h5.tmp.{DEAD}", f"latest.h5.tmp.{DEAD}"]
    live = [f"metrics.jsonl.resumed.{os.getppid()}", f"memory.json.tmp.{os.getppid()}"]
    other = [f"notes.txt.tmp.{DEAD}", f"metrics.jsonl.resumed.{DEAD}.bak", "metrics.jsonl"]
    for name in dead + live + other:
        (tmp_path / name).write_text("partial\n")
    removed = remove_stale_temp_files(str(tmp_path))
    assert sorted(removed) == sorted(str(tmp_path / n) for n in dead)
    assert sorted(os.listdir(tmp_path)) == sorted(live + other)


def test_the_next_run_in_the_folder_removes_a_killed_resumes_metrics(small_run, tmp_path):
    """End to end: a resume in a folder holding a killed resumed run's
    ``metrics.jsonl.resumed.<pid>`` and a killed calibration's folder
    removes them and says so."""
    out = tmp_path / "run"
    out.mkdir()
    for name in ("ckpt_10.h5", "config.yaml", "metrics.jsonl"):
        (out / name).write_bytes((small_run["out"] / name).read_bytes())
    litter = out / f"metrics.jsonl.resumed.{DEAD}"
    litter.write_text((small_run["out"] / "metrics.jsonl").read_text())
    calibration = out / f".calibration-851ea4b52b62cb31-{DEAD}-small"  # a killed auto's
    calibration.mkdir()
    (calibration / ".purine.lock").write_text(f"pid {DEAD} on host\n")
    res = run_cli_args("train", small_run["path"], "--out", out, "--resume",
                       out / "ckpt_10.h5", "--iters", "11")
    assert res.returncode == 0, res.stderr
    assert not litter.exists() and not calibration.exists()
    assert f"removed {litter}" in res.stdout and f"removed {calibration}" in res.stdout
    assert [n for n in os.listdir(out) if ".resumed." in n or ".tmp." in n] == []


def _rows(n_before, after):
    rows = [{"phase": "train", "iter": i, "loss": 1.0 / i, "lr": 0.05, "images_per_s": 1.0,
             "time": 0.01 * i, "timestamp": 1.0} for i in range(1, n_before + 1)]
    rows += [dict(rows[-1], iter=i) for i in after]
    return "".join(json.dumps(r) + "\n" for r in rows)


def _metrics_log_under_limit(folder, start_iter, limit):
    """``MetricsLog(folder, start_iter)`` in a process whose file-size limit
    (``ulimit -f``; a full disk is the same ``disk_error``) is ``limit``
    bytes: the CompletedProcess, what it raised printed."""
    import resource

    code = ("import sys\n"
            "from purine_mpi.base.errors import UserError\n"
            "from purine_mpi.job.metrics import MetricsLog\n"
            "try:\n"
            "    MetricsLog(sys.argv[1], int(sys.argv[2])).close()\n"
            "    print('opened')\n"
            "except UserError as e:\n"
            "    print('UserError:', e)\n")

    def preexec():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return subprocess.run([sys.executable, "-c", code, str(folder), str(start_iter)], cwd=REPO,
                          env=cli_env(), capture_output=True, text=True, timeout=120,
                          preexec_fn=preexec)


def test_a_full_disk_at_a_resumes_metrics_is_one_line_and_leaves_nothing(tmp_path):
    """Rows after the checkpoint (a killed run's): the resumed run copies
    the rows up to it to ``metrics.jsonl.resumed.<pid>``. A write that fails
    there was ``rank 0: OSError: [Errno 28] No space left on device``
    (exit 1, measured on a full 2 MB tmpfs under ``mpiexec -n 2``) and left
    the empty copy in the folder; now one line naming the file (exit 2 from
    ``train``), the copy removed, metrics.jsonl as it was."""
    text = _rows(200, after=[201, 202])
    (tmp_path / "metrics.jsonl").write_text(text)
    res = _metrics_log_under_limit(tmp_path, 200, 4096)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("UserError: "), res.stdout + res.stderr
    assert "metrics.jsonl.resumed." in res.stdout and "file too large" in res.stdout
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]
    assert (tmp_path / "metrics.jsonl").read_text() == text


def test_a_full_disk_when_dropping_a_cut_line_loses_no_row(tmp_path):
    """No row after the checkpoint, but a line cut short by a kill: the
    file was truncated and written again in place, so a write that failed
    left it short of its rows (cut at the limit: rows lost); now it is
    rewritten through a temporary name, so it stays whole or is replaced
    whole, and a file with nothing to drop is not rewritten at all."""
    whole = _rows(200, after=[])
    (tmp_path / "metrics.jsonl").write_text(whole + '{"phase": "train", "it')
    res = _metrics_log_under_limit(tmp_path, 200, 4096)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("UserError: "), res.stdout + res.stderr
    assert "metrics.jsonl" in res.stdout and "file too large" in res.stdout
    assert (tmp_path / "metrics.jsonl").read_text() == whole + '{"phase": "train", "it'
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]
    # without the limit the cut line goes, the rows stay
    res = _metrics_log_under_limit(tmp_path, 200, -1)
    assert res.stdout.strip() == "opened", res.stdout + res.stderr
    assert (tmp_path / "metrics.jsonl").read_text() == whole
    # nothing to drop: not rewritten (the same inode, under a limit below its size)
    inode = os.stat(tmp_path / "metrics.jsonl").st_ino
    res = _metrics_log_under_limit(tmp_path, 200, 4096)
    assert res.stdout.strip() == "opened", res.stdout + res.stderr
    assert os.stat(tmp_path / "metrics.jsonl").st_ino == inode
    assert (tmp_path / "metrics.jsonl").read_text() == whole


def test_a_run_folder_whose_lock_cannot_be_written_is_one_line_and_removed(tmp_path):
    """A full disk (here ``ulimit -f``: the same ``disk_error``) when the
    run writes its lock's text: the error named the folder
    (`runs/tiny: no space left on device`, measured on a full 2 MB tmpfs
    under ``mpiexec -n 2``) and each try left a numbered folder holding an
    empty ``.purine.lock`` (runs/tiny/1, runs/tiny/2, ...), where any other
    start-up refusal removes the folder it made. Now one line naming the
    lock file, and at the run's end (exit 2) the folders made for it
    removed. Rank 0's set-up of the folder in a process of its own (under
    ``ulimit -f`` MPI_Init itself fails: UCX's shared-memory FIFO)."""
    import resource

    code = ("from purine_mpi.base import logfile\n"
            "from purine_mpi.base.errors import UserError\n"
            "from purine_mpi.job.rundir import _set_up\n"
            "try:\n"
            "    _set_up('tiny', None, None, False, 'runs')\n"
            "    print('set up')\n"
            "except UserError as e:\n"
            "    print('UserError:', e)\n"
            "    logfile.end_run(2)\n")

    def preexec():
        resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))
    for _ in range(2):
        res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=cli_env(),
                             capture_output=True, text=True, timeout=120, preexec_fn=preexec)
        assert res.returncode == 0, res.stderr
        assert res.stdout.startswith("UserError: "), res.stdout + res.stderr
        assert os.path.join("runs", "tiny", "1", ".purine.lock") in res.stdout
        assert "file too large" in res.stdout and len(res.stdout.splitlines()) == 1
        assert os.listdir(tmp_path) == []


def test_a_config_yaml_that_cannot_be_written_is_not_left(digits_h5, tmp_path):
    """A fresh run's config.yaml on a full disk (``ulimit -f`` here): the
    error names it, and the empty file it made is removed (it stayed:
    measured with 4 KB free on a 2 MB tmpfs under ``mpiexec -n 2``, a
    folder of ``.purine.lock``, ``train.log`` and an empty config.yaml,
    which a retry into the same ``--out`` refused as "holds another run's
    files"). In a process of its own: under ``ulimit -f`` MPI_Init fails."""
    import resource

    from .conftest import small_net_config, write_config_file

    cfg = write_config_file(tmp_path, small_net_config(digits_h5))
    out = tmp_path / "run"
    out.mkdir()
    code = ("import sys, types\n"
            "from purine_mpi.base.errors import UserError\n"
            "from purine_mpi.job.config import load_job\n"
            "from purine_mpi.train.progress import write_config\n"
            "job = load_job(sys.argv[1])\n"
            "try:\n"
            "    write_config(types.SimpleNamespace(out_dir=sys.argv[2], job=job))\n"
            "    print('written')\n"
            "except UserError as e:\n"
            "    print('UserError:', e)\n")

    def preexec():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
    res = subprocess.run([sys.executable, "-c", code, cfg, str(out)], cwd=REPO, env=cli_env(),
                         capture_output=True, text=True, timeout=120, preexec_fn=preexec)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("UserError: "), res.stdout + res.stderr
    assert "config.yaml" in res.stdout and "file too large" in res.stdout
    assert os.listdir(out) == []


def test_a_killed_calibrations_folder_is_removed_and_a_live_one_kept(tmp_path):
    """``parallel.scheme: auto`` calibrates in one-rank runs whose folders
    (``.calibration-<key>-<pid>``, ``-small``) lie in the run folder; a rank
    killed with kill -9 while one ran left it there for good (measured:
    gpt_tiny under ``mpiexec -n 2``, rank 0 killed 1.5 s after
    "calibration:", the `-small` run's folder with its config, metrics,
    trace and log stayed through the next runs). Now the next run there
    removes it; one whose process lives, or whose run still holds its lock,
    stays, as does anything else."""
    import fcntl

    from purine_mpi.job.run_checkpoints import remove_stale_calibration_folders

    def calibration(name, lock_text="pid 1 on host"):
        d = tmp_path / name
        d.mkdir()
        (d / ".purine.lock").write_text(lock_text)
        (d / "config.yaml").write_text("name: x\n")
        return d

    dead = [calibration(f".calibration-851ea4b52b62cb31-{DEAD}-small"),
            calibration(f".calibration-00ff-{DEAD}")]
    (dead[1] / ".purine.lock").unlink()  # killed before its run took the lock
    alive = calibration(f".calibration-00ff-{os.getppid()}")
    held = calibration(f".calibration-abcd-{DEAD - 1}")
    other = calibration(f".calibration-notes-{DEAD}")
    fd = os.open(held / ".purine.lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a run still going on there
        removed = remove_stale_calibration_folders(str(tmp_path))
    finally:
        os.close(fd)
    assert sorted(removed) == sorted(str(d) for d in dead)
    assert sorted(os.listdir(tmp_path)) == sorted(d.name for d in (alive, held, other))
