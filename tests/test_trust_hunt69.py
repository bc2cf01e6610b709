"""Session 69's trust hunt: what a user of the CLI met, each test failing
on the code before its fix (the assertion named in each docstring)."""
import os

import pytest

from tests.conftest import REPO, run_cli_here

JOBS = os.path.join(REPO, "jobs")


@pytest.mark.parametrize("value", ["0", "2.5", "two"])
def test_plan_and_predict_refuse_a_bad_ranks_per_node_alike(value, tmp_path):
    """``--ranks-per-node`` is read in one place (tools/scaling/node.
    parse_ranks_per_node) for ``plan`` and ``predict``: the same one line
    and exit 2 from both. Before, plan's argparse ``type=int`` gave a usage
    error for 2.5 and plan's own check said "give a number of ranks >= 1"
    for 0, predict "expected a whole number >= 1, got '0'" (this test's
    equality of the two lines)."""
    plan = run_cli_here("plan", os.path.join(JOBS, "digits_lenet.yaml"), "--np", "2",
                        "--ranks-per-node", value)
    predict = run_cli_here("predict", str(tmp_path), "--np", "2", "--ranks-per-node", value)
    want = f"error: --ranks-per-node {value}: expected a whole number >= 1"
    assert plan.returncode == 2 and predict.returncode == 2, (plan.stderr, predict.stderr)
    assert plan.stderr.strip().splitlines()[-1] == want, plan.stderr
    assert predict.stderr.strip().splitlines()[-1] == want, predict.stderr


def test_make_parent_makes_the_folder_of_a_file_or_says_why_not(tmp_path):
    """``base/runfiles.make_parent``: the one helper the output writers call
    (checkpoints, traces, data files, predict, convert, export onnx, plot,
    the calibration cache) before writing a file: its folder made, as the
    system finds it (``link/..``: beside the link's target), or one line
    naming that folder (exit 2) where a file is in the way."""
    from purine_mpi.base.errors import UserError
    from purine_mpi.base.runfiles import make_parent
    assert make_parent(str(tmp_path / "a" / "b" / "f.h5")) == str(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "target" / "in").mkdir(parents=True)
    os.symlink(tmp_path / "target" / "in", tmp_path / "link")
    make_parent(str(tmp_path / "link" / ".." / "new" / "f.h5"))
    assert (tmp_path / "target" / "new").is_dir() and not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError) as got:
        make_parent(str(tmp_path / "file" / "f.h5"))
    assert str(tmp_path / "file") in str(got.value) and got.value.exit_code == 2


def test_resume_of_what_is_no_checkpoint_into_its_run_folder_says_so(tmp_path):
    """``train --out R --resume R`` (the run folder, not a checkpoint in it:
    generate's --weights takes a folder, --resume does not) or ``--resume``
    a file that is no checkpoint (a data file), into an --out that holds a
    run: the one line says what is wrong with the file given, as it does
    into another --out ("is a directory, not an HDF5 file"). Before, the
    guard against resuming another run answered first: "--out R holds
    another run (...) than --resume R (run unknown)", and told the user to
    --force away the run they meant to continue (this test's first match)."""
    import h5py
    import numpy as np

    from purine_mpi.base.errors import UserError
    from purine_mpi.job.rundir import choose_run_dir
    from purine_mpi.job.run_checkpoints import save_run_checkpoint
    run = tmp_path / "run"
    save_run_checkpoint(str(run), 5, keep=2, params={"w": np.ones(3, np.float32)},
                        run_id="mine")
    before = sorted(os.listdir(run))
    with pytest.raises(UserError) as got:
        choose_run_dir("j", out=str(run), resume=str(run))
    assert "is a directory, not an HDF5 file" in str(got.value), got.value
    assert "another run" not in str(got.value)
    data = tmp_path / "data.h5"
    with h5py.File(data, "w") as f:
        f["train/data"] = np.zeros((2, 3), np.float32)
    with pytest.raises(UserError) as got:
        choose_run_dir("j", out=str(run), resume=str(data))
    assert "is not a purine_mpi checkpoint" in str(got.value), got.value
    assert sorted(os.listdir(run)) == before  # nothing written, nothing deleted


def test_a_negative_set_index_is_blamed_on_its_set():
    """``--set net.-1.num_output=3`` (a negative index counts from the end
    of the file's list, as ``apply_override`` takes it) refused on the key
    it wrote, ``net[10].num_output``: the line names the ``--set``. Before,
    the blame compared ``net.-1`` with ``net.10`` literally and named the
    file's line of the layer, which holds no num_output (``error:
    digits_lenet.yaml:22: key 'net[10].num_output': ...``)."""
    res = run_cli_here("plan", os.path.join(JOBS, "digits_lenet.yaml"), "--np", "1",
                       "--set", "net.-1.num_output=3")
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("error: --set net.-1.num_output=3: key 'net[10].num_output'"), line


def test_save_link_makes_its_folder_and_never_writes_through_a_link(tmp_path):
    """``predict --calibrate LINK.json`` writes through ``save_link`` as the
    other outputs write: its folder made, the file replaced whole (a link
    planted at LINK.json replaced, its target untouched). Before, a plain
    ``open(path, "w")``: FileNotFoundError for a missing folder (a
    traceback and exit 1 after the whole calibration) and a write through
    the link into its target (this test's ``victim`` assertion)."""
    import json

    from purine_mpi.tools.scaling.link import Link, save_link
    link = Link(2e-5, 1.25e8, 0.0, "test")
    path = tmp_path / "new" / "deeper" / "link.json"
    save_link(str(path), link)
    assert json.loads(path.read_text())["format"] == "purine_mpi.link"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    os.symlink(victim, tmp_path / "planted.json")
    save_link(str(tmp_path / "planted.json"), link)
    assert victim.read_text() == "keep"
    assert not os.path.islink(tmp_path / "planted.json")
    assert json.loads((tmp_path / "planted.json").read_text())["beta_bytes_per_s"] == 1.25e8


def test_calibrate_refuses_an_unwritable_link_file_before_measuring(tmp_path):
    """``mpiexec -n 2 predict --calibrate FILE/x.json`` (a file where its
    folder would be): one line naming it, exit 2 on every rank, before the
    measurements (seconds). Before: the whole calibration, then rank 0's
    ``NotADirectoryError`` traceback and an MPI_Abort, exit 1 (this test's
    ``returncode == 2``)."""
    import subprocess

    from tests.conftest import MPIEXEC, PYTHON, cli_env
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    (tmp_path / "afile").write_text("x")
    res = subprocess.run([MPIEXEC, "-n", "2", PYTHON, "-m", "purine_mpi", "predict",
                          "--calibrate", str(tmp_path / "afile" / "x.json")], cwd=REPO,
                         env=cli_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and str(tmp_path / "afile") in res.stderr, res.stderr
