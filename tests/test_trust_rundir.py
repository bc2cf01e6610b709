"""Issue 32 ("Trust"), the run-folder writing cases: a run writes only
regular files it created in a folder it holds (case 1), ``--force`` deletes
by content (case 2), an output never replaces a checkpoint or an input
(case 3), a run-folder set-up error ends every rank at once with exit 2
(case 9), and a full disk is one line with no temporary file left and no
row cut short (case 17)."""
import errno
import os
import subprocess

import h5py
import numpy as np
import pytest

from purine_mpi.base.errors import UserError
from tests.conftest import run_cli_args, run_cli_here, run_mpi_cli, write_config_file
from tests.test_cli import assert_user_error
from tests.test_train import small_net_config


def _job(tmp_path, digits_h5, iters=4, interval=2, channels=4):
    cfg = small_net_config(digits_h5)
    cfg["net"][0]["num_output"] = channels  # 64: checkpoints of ~90 KiB
    cfg["name"] = "trust"
    cfg["solver"].update({"max_iter": iters, "display": 1, "test_interval": 0})
    cfg["checkpoint"] = {"interval": interval, "keep": 2}
    return write_config_file(tmp_path, cfg)


def _victim(tmp_path, name="victim.txt"):
    path = tmp_path / name
    path.write_text("another user's file\n")
    return path


def test_case1_symlinked_run_files_are_refused_and_never_written_through(tmp_path, digits_h5):
    """Case 1: .purine.lock, train.log, a trace (plain train --out) and
    config.yaml, metrics.jsonl (--resume auto) planted as links to files
    elsewhere: exit 2 naming the link; the targets are untouched."""
    cfg = _job(tmp_path, digits_h5)
    victim = _victim(tmp_path)
    for name in (".purine.lock", "train.log", "trace.rank0.json"):
        out = tmp_path / f"fresh{name.replace('.', '_')}"
        out.mkdir()
        os.symlink(victim, out / name)
        res = run_cli_args("train", cfg, "--out", out, "--profile")
        assert_user_error(res, out / name, "symbolic link")
        assert victim.read_text() == "another user's file\n", name
    out = tmp_path / "run"
    assert run_cli_args("train", cfg, "--out", out).returncode == 0
    for name in ("config.yaml", "metrics.jsonl"):
        saved = (out / name).read_bytes()
        (out / name).unlink()
        os.symlink(victim, out / name)
        res = run_cli_args("train", cfg, "--out", out, "--resume", "auto", "--iters", 6)
        assert_user_error(res, out / name, "symbolic link")
        assert victim.read_text() == "another user's file\n", name
        (out / name).unlink()
        (out / name).write_bytes(saved)
    # a run folder's tb/ is never a link to a folder elsewhere either
    from purine_mpi.job.tensorboard import TensorBoardLog
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, out / "tb")
    pytest.importorskip("tensorboardX")
    with pytest.raises(UserError, match="symbolic link"):
        TensorBoardLog(str(out / "tb"))
    assert os.listdir(elsewhere) == []


def test_case2_force_deletes_only_what_a_run_of_ours_wrote(tmp_path, digits_h5):
    """Case 2: --force in a folder that never held a run deletes nothing (a
    user's config.yaml and tb/ stay; exit 2 naming them); in a run's folder
    a file of a run's name that is not ours (a ckpt_5.h5 of text) stops it
    before anything is deleted; a run's own files still go."""
    cfg = _job(tmp_path, digits_h5)
    mine = tmp_path / "mine"
    (mine / "tb").mkdir(parents=True)
    (mine / "config.yaml").write_text("my: notes\n")
    (mine / "tb" / "notes.txt").write_text("keep me\n")
    res = run_cli_args("train", cfg, "--out", mine, "--force")
    assert_user_error(res, "config.yaml", "tb", "nothing was deleted")
    assert (mine / "config.yaml").read_text() == "my: notes\n"
    assert (mine / "tb" / "notes.txt").read_text() == "keep me\n"

    out = tmp_path / "run"
    assert run_cli_args("train", cfg, "--out", out).returncode == 0
    (out / "ckpt_5.h5").write_text("not a checkpoint\n")
    before = sorted(os.listdir(out))
    res = run_cli_args("train", cfg, "--out", out, "--force")
    assert_user_error(res, "ckpt_5.h5", "nothing was deleted")
    assert sorted(os.listdir(out)) == before
    (out / "ckpt_5.h5").unlink()
    res = run_cli_args("train", cfg, "--out", out, "--force")
    assert res.returncode == 0, res.stderr
    assert "deleted the previous run's files" in res.stdout


def test_case3_outputs_never_replace_a_checkpoint_or_an_input(tmp_path, digits_h5):
    """Case 3: predict --out and export onnx --out naming the --weights
    file, another checkpoint or the data file: exit 2 naming it, unchanged."""
    cfg = _job(tmp_path, digits_h5)
    out = tmp_path / "run"
    assert run_cli_args("train", cfg, "--out", out).returncode == 0
    weights, other = out / "latest.h5", out / "ckpt_2.h5"
    data = tmp_path / "data.h5"
    data.write_bytes(open(digits_h5, "rb").read())
    cfg2 = write_config_file(tmp_path, small_net_config(str(data)), "cfg2.yaml")
    saved = {p: p.read_bytes() for p in (weights, other, data)}
    for target, needle in ((weights, "--weights"), (other, "checkpoint"), (data, "data.train.path")):
        res = run_cli_args("predict", cfg2, "--weights", weights, "--out", target)
        assert_user_error(res, f"--out {target}", needle)
        res = run_cli_here("export", "onnx", cfg2, "--weights", weights, "--out", target)
        assert_user_error(res, f"--out {target}", needle)
    assert {p: p.read_bytes() for p in saved} == saved


def test_case9_a_run_folder_set_up_error_ends_every_rank_at_once(tmp_path, digits_h5):
    """Case 9: --out under a regular file on 2 ranks: exit 2 in seconds (not
    the 300 s stall), the folder named once, no traceback."""
    cfg = _job(tmp_path, digits_h5)
    blocker = tmp_path / "a_file"
    blocker.write_text("x\n")
    try:
        res = run_mpi_cli(2, "train", cfg, "--out", blocker / "run", timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the ranks waited for rank 0's run folder instead of ending")
    text = assert_user_error(res, blocker / "run")
    assert text.count("error:") == 1, text


def _enospc_for(folder, monkeypatch):
    """Make os.write fail with ENOSPC for files under ``folder``."""
    real = os.write

    def write(fd, data):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.startswith(str(folder)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)
    monkeypatch.setattr(os, "write", write)


def test_case17_full_disk_is_one_line_and_leaves_nothing_cut(tmp_path, monkeypatch):
    """Case 17 (injected ENOSPC, no mount needed): a checkpoint that cannot
    be written raises one UserError naming it and 'no space left on
    device', leaves no *.h5.tmp.<pid> and the old file as it was; a metrics
    row that cannot be written leaves the file ending with a whole line."""
    from purine_mpi.job.checkpoint_file import load_checkpoint, save_checkpoint
    from purine_mpi.job.metrics import MetricsLog
    folder = tmp_path / "full"
    folder.mkdir()
    path = folder / "best.h5"
    save_checkpoint(path, {"w": np.ones(4, np.float32)}, iteration=1)
    log = MetricsLog(str(folder))
    log.write({"phase": "train", "iter": 1, "loss": 1.0})
    _enospc_for(folder, monkeypatch)
    with pytest.raises(UserError) as err:
        save_checkpoint(path, {"w": np.zeros(100_000, np.float32)}, iteration=2)
    assert str(err.value).startswith(f"{path}: no space left on device")
    assert "\n" not in str(err.value)
    assert sorted(os.listdir(folder)) == ["best.h5", "metrics.jsonl"]
    assert load_checkpoint(path).iteration == 1
    with pytest.raises(UserError, match="metrics.jsonl: no space left on device"):
        log.write({"phase": "train", "iter": 2, "loss": 0.5})
    monkeypatch.undo()
    log.close()
    text = (folder / "metrics.jsonl").read_text()
    assert text.endswith("\n") and len(text.splitlines()) == 1


def test_case17_full_disk_on_a_tiny_tmpfs(tmp_path, digits_h5):
    """Case 17 end to end (needs root to mount a tmpfs; skipped otherwise):
    exit 2 with one line naming the checkpoint, no temporary file left,
    metrics.jsonl ends with a whole line."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=120k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs (needs root)")
    try:
        cfg = _job(tmp_path, digits_h5, iters=30, interval=2, channels=64)
        out = mnt / "run"
        res = run_cli_args("train", cfg, "--out", out)
        text = assert_user_error(res, "no space left on device")
        assert text.startswith(f"error: {out}/"), text
        assert "HDF5" not in text and "Slist" not in text
        assert not [n for n in os.listdir(out) if ".tmp." in n], os.listdir(out)
        metrics = (out / "metrics.jsonl").read_text()
        assert metrics.endswith("\n")
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_force_reads_a_planted_config_yaml_with_the_bounded_reader(tmp_path):
    """--force reads a folder's config.yaml with the one strict YAML reader
    (job/yamlread.py), as every other YAML the program reads: an alias bomb
    there is not a config of ours (PyYAML's own loader accepted it: it shares
    the nodes instead of expanding them, and the file counted as ours)."""
    import time
    from purine_mpi.job.rundir_force import _is_config
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    lines += ["name: x", "seed: 1", "solver: *a9", "parallel: {}", "checkpoint: {}", "net: []"]
    path = tmp_path / "config.yaml"
    path.write_text("\n".join(lines) + "\n")
    t0 = time.perf_counter()
    assert _is_config(str(path)) is False
    assert time.perf_counter() - t0 < 5
