"""Session 69's review of the trust69 merge: what its changes missed, each
test failing on the code before its fix (the assertion named in each
docstring)."""
import os
import subprocess

import pytest

from tests.conftest import PYTHON, REPO, cli_env


def _end(out, status, log=False, extra=None):
    """A run folder ``out`` chosen and locked as ``train`` does (made by
    this process where it was missing), its train.log opened where ``log``,
    a file ``extra`` written there, then the run ended with ``status``
    (``end_run``: train.log's last line, the lock released)."""
    from purine_mpi.base import logfile
    from purine_mpi.job import rundir
    try:
        rundir.choose_run_dir("j", out=str(out), lock=rundir.lock_run_dir)
        if log:
            logfile.open_run_log(str(out))
        if extra:
            (out / extra).write_text("mine\n")
        logfile.end_run(status)
    finally:
        rundir.release_run_dirs()
        logfile.close_run_log()
        logfile.new_run()


def test_a_signal_after_the_log_opened_keeps_the_folder_and_its_log(tmp_path):
    """A run stopped by a signal once its train.log was open (SIGTERM during
    the graph build or the data's load: a batch job's time limit) keeps the
    folder it made and that log, whose last line is the folder's only
    record of why the run ended. Before, every status over 128 removed the
    folder with its train.log (this test's first ``exists``)."""
    out = tmp_path / "made" / "run"
    _end(out, 143, log=True)
    assert out.is_dir(), "the run folder and its train.log were removed"
    last = (out / "train.log").read_text().strip().splitlines()[-1]
    assert last == "run ended: stopped by SIGTERM (exit 143)", last
    out2 = tmp_path / "made2" / "run"
    _end(out2, 130, log=True)
    assert (out2 / "train.log").read_text().strip().endswith("(exit 130)")


def test_what_a_run_that_never_began_removes_and_what_it_keeps(tmp_path):
    """What trust69 removes, and only that: a folder this process made
    holding its lock alone after a signal (``parallel.scheme: auto``'s
    calibration stopped), or its lock and train.log after a refusal (2),
    with the parents made for it; never a folder that was there, one with
    any other file, nor after a bug's 1 or a status that is no signal's.
    Before, any status over 128 counted as a signal's (``kept255``)."""
    gone = tmp_path / "a" / "b" / "run"
    _end(gone, 143)
    assert not (tmp_path / "a").exists()
    refused = tmp_path / "refused"
    _end(refused, 2, log=True)
    assert not refused.exists()
    there = tmp_path / "there"
    there.mkdir()
    _end(there, 143)
    _end(there, 2, log=True)
    assert sorted(os.listdir(there)) == [".purine.lock", "train.log"]
    other = tmp_path / "other"
    _end(other, 143, extra="notes.txt")
    assert (other / "notes.txt").read_text() == "mine\n"
    for status in (1, 3, 255):
        kept = tmp_path / f"kept{status}"
        _end(kept, status)
        assert kept.is_dir(), status
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    _end(tmp_path / "link", 143)  # an --out that is a link to a folder that was there
    assert (tmp_path / "link").is_symlink() and real.is_dir()


@pytest.mark.parametrize("parent", ["a file", "a dangling link"])
def test_docgen_write_under_a_bad_folder_is_one_line(tmp_path, parent):
    """``python -m purine_mpi.tools.docgen --write --path P`` whose folder
    cannot be made (a file there, a link to a missing folder): one line
    naming it and exit 2, as every other writer of trust69's
    ``make_parent``. Before, make_parent's UserError went up uncaught: a
    traceback and exit 1 (this test's ``returncode == 2``)."""
    there = tmp_path / "there"
    if parent == "a file":
        there.write_text("x")
    else:
        os.symlink(tmp_path / "missing" / "deeper", there)
    res = subprocess.run([PYTHON, "-m", "purine_mpi.tools.docgen", "--write", "--path",
                          str(there / "sub" / "config.md")], cwd=REPO, env=cli_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, \
        res.stderr
    assert res.stderr.startswith(f"error: {there}"), res.stderr
    assert not (tmp_path / "missing").exists()


def test_docgen_write_never_writes_through_a_link(tmp_path):
    """docgen's ``--write`` replaces the file whole (base/runfiles'
    ``write_text_replacing``): a link planted at --path is replaced, its
    target untouched. Before, ``open(path, "w")`` wrote through the link
    (this test's ``victim`` assertion)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    path = tmp_path / "config.md"
    os.symlink(victim, path)
    res = subprocess.run([PYTHON, "-m", "purine_mpi.tools.docgen", "--write", "--path",
                          str(path)], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert victim.read_text() == "keep"
    assert not path.is_symlink() and path.read_text().startswith("<!-- Generated")


def _refused_the_folder(res, folder):
    """``res`` ended with exit 2 and one line naming ``folder``, no traceback."""
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"error: {folder} is a folder, but the output is one file: give the file's path"], \
        res.stderr


def test_calibrate_refuses_a_folder_as_its_link_file_before_measuring(tmp_path):
    """``mpiexec -n 2 predict --calibrate DIR`` (an existing folder): one
    line naming it and exit 2 on every rank, before the measurements, as
    ``predict --out DIR`` is refused. Before, trust69's up-front check
    (``check_writable``) let a folder pass, the whole calibration ran, and
    the rename over the folder ended rank 0 with ``IsADirectoryError``'s
    traceback and an MPI_Abort, exit 1 (this test's ``returncode == 2``)."""
    from tests.conftest import MPIEXEC
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    folder = tmp_path / "links"
    folder.mkdir()
    res = subprocess.run([MPIEXEC, "-n", "2", PYTHON, "-m", "purine_mpi", "predict",
                          "--calibrate", str(folder)], cwd=REPO, env=cli_env(),
                         capture_output=True, text=True, timeout=120)
    _refused_the_folder(res, folder)
    assert os.listdir(folder) == []


TINY = """name: tiny
seed: 3
data:
  train: {source: synthetic, shape: [1, 4, 4], classes: 3, num_samples: 64, batch_size: 16}
net:
  - {type: fc, name: fc1, bottom: data, top: fc1, num_output: 3}
  - {type: softmax_loss, name: loss, bottom: [fc1, label], top: loss}
solver: {type: sgd, base_lr: 0.01, max_iter: 4}
parallel: {scheme: data}
"""


def test_choose_refuses_a_folder_as_its_calibration_file_before_measuring(tmp_path):
    """``plan --choose --calibration DIR`` (an existing folder): one line
    naming it, exit 2, before the calibration's runs (the calibration
    cache, a writer of trust69's ``make_parent``, checked as predict's
    --out is). Before, both traced runs ran, then the rename over the folder
    ended ``plan`` with ``IsADirectoryError``'s traceback, exit 1 (this
    test's ``returncode == 2``)."""
    job = tmp_path / "job.yaml"
    job.write_text(TINY)
    folder = tmp_path / "cal"
    folder.mkdir()
    res = subprocess.run([PYTHON, "-m", "purine_mpi", "plan", str(job), "--np", "2",
                          "--choose", "--calibration", str(folder)], cwd=REPO, env=cli_env(),
                         capture_output=True, text=True, timeout=300)
    _refused_the_folder(res, folder)
    assert os.listdir(folder) == [] and sorted(os.listdir(tmp_path)) == ["cal", "job.yaml"]


def test_plot_never_writes_through_a_link_planted_at_its_out(tmp_path):
    """``plot RUN --out P.png`` where P.png is a link a user (or anyone who
    can write the folder) planted: the link is replaced by the image, its
    target untouched, as every writer of base/runfiles writes (by a rename
    over the name, never half-written). Before, ``fig.savefig(out)`` wrote
    the PNG through the link into its target (this test's ``victim``
    assertion)."""
    import json
    pytest.importorskip("matplotlib")
    from purine_mpi.tools.plot import plot_runs
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"phase": "train", "iter": i, "loss": 2.0 / i, "lr": 0.01, "images_per_s": 100.0,
             "time": 0.01 * i, "timestamp": 1.0e9 + i} for i in range(1, 5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    out = tmp_path / "curves.png"
    os.symlink(victim, out)
    plot_runs([str(run)], str(out))
    assert victim.read_bytes() == b"keep", victim.read_bytes()[:8]
    assert not out.is_symlink() and out.read_bytes()[:4] == b"\x89PNG"
    plot_runs([str(run)], str(tmp_path / "curves"))  # no extension: matplotlib's png
    assert (tmp_path / "curves").read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]


def test_an_earlier_runs_outcome_is_not_the_next_runs(tmp_path):
    """An in-process run whose loop recorded its outcome but whose log was
    never written (a rank other than 0, or no log) left that outcome to the
    next run of the process: a later run stopped by SIGTERM ended its log
    with "finished at iteration 1 (exit 143)". Before: that last line."""
    from purine_mpi.base import logfile
    logfile.new_run()
    logfile.set_outcome({"iter": 1}, 1)
    _end(tmp_path / "run", 143, log=True)
    last = (tmp_path / "run" / "train.log").read_text().strip().splitlines()[-1]
    assert last == "run ended: stopped by SIGTERM (exit 143)", last
