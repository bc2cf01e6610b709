"""Session 70's trust hunt: what a user of the CLI met, each test failing
on the code before its fix (the assertion named in each docstring)."""
import os

import numpy as np
import pytest

from tests.conftest import REPO, run_cli_args, run_cli_here

JOBS = os.path.join(REPO, "jobs")


def test_resume_of_a_checkpoint_without_run_id_is_refused_from_its_metadata(tmp_path,
                                                                            monkeypatch):
    """``train --out R --resume OTHER.h5`` (a checkpoint with no ``run_id``:
    written by an older purine_mpi or another tool) into a folder holding a
    run: refused ("holds another run") from the file's metadata alone.
    Before, the refusal first read the whole file (``load_checkpoint``: every
    array, GBs for a large model) to say what was wrong with it, then refused
    all the same (this test's ``_read_section`` guard raised)."""
    from purine_mpi.base.errors import UserError
    from purine_mpi.job import checkpoint_file
    from purine_mpi.job.checkpoint_file import save_checkpoint
    from purine_mpi.job.rundir import choose_run_dir
    from purine_mpi.job.run_checkpoints import save_run_checkpoint
    run = tmp_path / "run"
    save_run_checkpoint(str(run), 5, keep=2, params={"w": np.ones(3, np.float32)},
                        run_id="mine")
    other = tmp_path / "other.h5"
    save_checkpoint(str(other), {"w": np.ones(3, np.float32)}, iteration=7)
    before = sorted(os.listdir(run))

    def no_array_read(*args, **kw):
        raise AssertionError("an array of the checkpoint was read")
    monkeypatch.setattr(checkpoint_file, "_read_section", no_array_read)
    with pytest.raises(UserError) as got:
        choose_run_dir("j", out=str(run), resume=str(other))
    assert "holds another run" in str(got.value) and "run unknown" in str(got.value), got.value
    assert sorted(os.listdir(run)) == before
    bad = tmp_path / "foreign.h5"  # what is wrong with a foreign file: still said
    import h5py
    with h5py.File(bad, "w") as f:
        f.attrs["format"] = "other"
    with pytest.raises(UserError) as got:
        choose_run_dir("j", out=str(run), resume=str(bad))
    assert "is not a purine_mpi checkpoint" in str(got.value), got.value


@pytest.mark.parametrize("command", [
    ("plan", os.path.join(JOBS, "digits_lenet.yaml"), "--np", "2", "--choose",
     "--calibration"),
    ("predict", "--calibrate")], ids=["plan-choose-calibration", "predict-calibrate"])
def test_a_folder_that_cannot_be_made_names_the_option_given(command, tmp_path):
    """``plan --choose --calibration FILE/x.json`` or ``predict --calibrate
    FILE/x.json`` (a file where the folder would be): the one line tells to
    give another of the option the path came from. Before, ``make_folder``
    said "give another --out" whatever the option (this test's endswith),
    and these commands have no --out for that file."""
    (tmp_path / "file").write_text("x")
    run = run_cli_here if command[0] == "plan" else run_cli_args  # predict starts MPI
    res = run(*command, str(tmp_path / "file" / "x.json"))
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {tmp_path / 'file'}: cannot make this folder"), line
    assert line.endswith(f"give another {command[-1]}"), line


def test_write_helpers_name_the_option_given(tmp_path):
    """``check_writable``/``make_parent`` with an option: each of their lines
    (a file in the way, a name too long) names it."""
    from purine_mpi.base.errors import UserError
    from purine_mpi.base.runfiles import check_writable, make_parent
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError) as got:
        make_parent(str(tmp_path / "file" / "x.json"), "--calibration")
    assert str(got.value).endswith("give another --calibration"), got.value
    with pytest.raises(UserError) as got:
        check_writable(str(tmp_path / ("n" * 300 + ".json")), "--calibrate")
    assert str(got.value).endswith("give a shorter --calibrate"), got.value


@pytest.mark.parametrize("entry", ["1", "-1"])
def test_a_set_of_one_entry_of_a_list_is_blamed_on_its_set(entry, digits_h5):
    """``--set net.9.bottom.1=nosuch`` (an entry of a list the file has): the
    refusal of that list (``net[9].bottom``, judged whole when the graph is
    built) names the ``--set``. Before, the key written (``net.9.bottom.1``)
    was not found to be inside the key refused, and the line named the
    file's line of the layer (``error: ...digits_lenet.yaml:21: key
    'net[9].bottom': ... 'nosuch' ...``: this test's startswith)."""
    res = run_cli_here("plan", os.path.join(JOBS, "digits_lenet.yaml"), "--np", "1",
                       "--set", f"data.train.path={digits_h5}", "--set",
                       f"data.test.path={digits_h5}", "--set", f"net.9.bottom.{entry}=nosuch")
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: --set net.9.bottom.{entry}=nosuch: key 'net[9].bottom'"), \
        line
    assert "'nosuch'" in line


def test_a_set_entry_of_a_checked_list_is_blamed_on_the_file_only_where_it_is_at_fault():
    """Where the config is checked before the graph (``solver.stepvalues``,
    an increasing list): ``--set solver.stepvalues.2=100`` under the file's
    [300, 600, 800] names the --set (before: the file, this test's first
    startswith); under the file's own [600, 300, 800] the file stays named,
    as the config without the --set is refused on the same key."""
    import yaml

    from purine_mpi.base.errors import UserError
    from purine_mpi.job.config import resolve_config
    with open(os.path.join(JOBS, "digits_lenet.yaml"), encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    raw["solver"].update(lr_policy="multistep", stepvalues=[300, 600, 800])
    with pytest.raises(UserError) as got:
        resolve_config(raw, "f.yaml", ["solver.stepvalues.2=100"], check_files=False)
    assert str(got.value).startswith("--set solver.stepvalues.2=100: key 'solver.stepvalues'"), \
        got.value
    raw["solver"]["stepvalues"] = [600, 300, 800]
    with pytest.raises(UserError) as got:
        resolve_config(raw, "f.yaml", ["solver.stepvalues.2=850"], check_files=False)
    assert str(got.value).startswith("f.yaml: key 'solver.stepvalues'"), got.value


def test_scheme_auto_given_to_plan_names_the_set_or_the_line(digits_h5):
    """``plan --np 2 --set parallel.scheme=auto`` (a command that needs the
    scheme itself): the refusal names the ``--set`` that wrote ``auto``.
    Before, a plain UserError naming the file (``jobs/digits_lenet.yaml:
    key 'parallel.scheme': auto is chosen ...``), which holds ``data``, and
    without the line where the file gives it (this test's startswith)."""
    res = run_cli_here("plan", os.path.join(JOBS, "digits_lenet.yaml"), "--np", "2",
                       "--set", f"data.train.path={digits_h5}", "--set",
                       f"data.test.path={digits_h5}", "--set", "parallel.scheme=auto")
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("error: --set parallel.scheme=auto: key 'parallel.scheme': auto is "
                           "chosen by train at start-up"), line


def test_bench_of_a_diverging_config_reports_no_figure(digits_h5):
    """``bench --json`` of a config whose loss goes NaN (``solver.base_lr``
    1e30): exit 3 (a diverged run) and one line saying so, no JSON. Before,
    the figures of the NaN arithmetic were printed as the config's speed,
    exit 0 (this test's returncode): with --real-data about 14,000 images/s
    against 2,800 to 3,700 for the finite run on the test VM, and an MFU to
    match."""
    res = run_cli_args("bench", os.path.join(JOBS, "digits_lenet.yaml"), "--iters", "2",
                       "--warmup", "1", "--json", "--set", "solver.base_lr=1e30",
                       # the data's shapes (a checkout has no data/digits.h5)
                       "--set", f"data.train.path={digits_h5}",
                       "--set", f"data.test.path={digits_h5}")
    assert res.returncode == 3, (res.stdout[:300], res.stderr)
    assert res.stdout.strip() == "", res.stdout[:300]
    line = res.stderr.strip().splitlines()[-1]
    # what diverged, named (trust71: before, "the loss or the weights hold NaN or inf")
    assert line.startswith("error: bench: digits_lenet diverged: the loss of the last iteration "
                           "is NaN or inf and 'conv1/weight' holds NaN or inf after the 3 "
                           "iterations"), line
    assert "solver.base_lr 1e+30" in line


def test_data_text_from_a_device_says_it_is_no_file():
    """``data text --from /dev/null`` (or a pipe): one line saying it is not
    a regular file. Before: "--from /dev/null not found", of a path that is
    there (this test's assertion)."""
    res = run_cli_here("data", "text", "--from", "/dev/null", "--out", "/nonexistent/x.h5")
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        "error: data text: --from /dev/null is not a regular file (expected a UTF-8 text file "
        "or a folder of them)"), res.stderr


def test_plan_choose_never_writes_its_calibration_over_another_file(tmp_path, digits_h5):
    """``plan --choose --calibration FILE`` where FILE is the user's (a
    config, a data file, JSON of another program): one line, exit 2, the
    file as it was. Before, the calibration ran and its JSON was renamed
    over the file (the config replaced: this test's file comparison), as
    over a stale cache. A calibration of ours (another job's) is still
    replaced: that is the cache."""
    config = tmp_path / "job.yaml"
    config.write_text(open(os.path.join(JOBS, "digits_lenet.yaml"), encoding="utf-8").read())
    before = config.read_bytes()
    res = run_cli_here("plan", str(config), "--np", "2", "--set",
                       f"data.train.path={digits_h5}", "--set", f"data.test.path={digits_h5}",
                       "--choose", "--calibration", str(config))
    assert config.read_bytes() == before, "the config was replaced"
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: --calibration {config} exists and is not a JSON object: writing the "
        "calibration there would replace it; give another --calibration, or remove the file "
        "first"), res.stderr


def test_refuse_other_json_tells_ours_from_the_rest(tmp_path):
    """``refuse_other_json``: a missing or empty file and one of ours pass;
    JSON of another kind, text that is not JSON and binary data are refused
    with what they hold."""
    from purine_mpi.base.errors import UserError
    from purine_mpi.job.outputs import refuse_other_json

    def ours(d):
        return isinstance(d, dict) and d.get("format") == "purine_mpi.link"
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "link.json").write_text('{"format": "purine_mpi.link"}')
    for name in ("missing.json", "empty.json", "link.json"):
        refuse_other_json(str(tmp_path / name), "--calibrate", "the link model", ours)
    (tmp_path / "other.json").write_text('{"format": "x"}')
    (tmp_path / "broken.json").write_text('{"format": ')
    (tmp_path / "data.bin").write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(100))
    for name, held in (("other.json", "holds JSON of another kind"),
                       ("broken.json", "is not JSON"), ("data.bin", "is not a JSON object")):
        with pytest.raises(UserError) as got:
            refuse_other_json(str(tmp_path / name), "--calibrate", "the link model", ours)
        assert f"--calibrate {tmp_path / name} exists and {held}" in str(got.value)


def test_predict_calibrate_never_writes_its_link_over_another_file(tmp_path):
    """``predict --calibrate job.yaml`` (a file of the user's given where the
    link model goes): one line, exit 2, before any measurement. Before, the
    link model was renamed over the config after the measurements."""
    config = tmp_path / "job.yaml"
    config.write_text("name: x\n")
    res = run_cli_args("predict", "--calibrate", str(config))
    assert config.read_text() == "name: x\n"
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: --calibrate {config} exists and is not a JSON object: writing the link model "
        "there would replace it; give another --calibrate, or remove the file first"), res.stderr


def test_a_device_memory_that_does_not_parse_is_its_one_line():
    """``plan --device-memory 10XB`` of a CPU job: the refusal of the size
    alone. Before, a note first said "--device-memory 10XB checks nothing:
    the job runs on the CPU" of a value then refused (this test's count of
    lines)."""
    res = run_cli_here("plan", os.path.join(JOBS, "digits_lenet.yaml"), "--np", "2",
                       "--device-memory", "10XB")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: --device-memory 10XB: expected a size"), lines


def test_inspect_diff_of_equal_values_in_two_dtypes_names_the_dtypes(tmp_path):
    """``inspect A.h5 --diff B.h5`` where one dataset holds the same values
    as float32 in A and float64 in B (another model's export, a converted
    file): equal in value (as test_trust_rinsp68 has int64 against uint64),
    its two dtypes named. Before: ``equal``, 0 and 0, no word of the dtypes
    (this test's ``dtypes``), of files a resume tells apart (a dtype
    mismatch is refused)."""
    import json

    from purine_mpi.job.checkpoint_file import save_checkpoint
    save_checkpoint(str(tmp_path / "a.h5"), {"w": np.arange(4, dtype=np.float32)})
    save_checkpoint(str(tmp_path / "b.h5"), {"w": np.arange(4, dtype=np.float64)})
    res = run_cli_here("inspect", str(tmp_path / "a.h5"), "--diff", str(tmp_path / "b.h5"),
                       "--json")
    assert res.returncode == 0, res.stderr
    row = next(r for r in json.loads(res.stdout)["diff"]["datasets"] if r["name"] == "/params/w")
    assert row["status"] == "equal" and row["equal"] is True, row
    assert row["dtypes"] == ["float32", "float64"] and row["max_abs_diff"] == 0.0, row
    text = run_cli_here("inspect", str(tmp_path / "a.h5"), "--diff", str(tmp_path / "b.h5"))
    assert "(dtypes differ: float32 vs float64)" in text.stdout, text.stdout


def test_a_scheme_refused_at_build_names_the_set_that_gave_its_key():
    """``plan --np 3 --set parallel.scheme=tensor --set
    parallel.tensor_parallel=2`` (3 ranks, not a multiple of 2): the refusal
    names the ``--set`` that wrote ``parallel.tensor_parallel``. Before, a
    UserError formatted by hand as ``{job.path}: key '...'`` named the file
    (``jobs/digits_lenet.yaml: key 'parallel.tensor_parallel'``), which
    holds no such key, and without a line where the file has one (this
    test's startswith); the same for the other refusals of a key written so
    (pipeline stages, parameter-server modes, one_sided transport, export
    onnx, generate, predict --split, device)."""
    res = run_cli_here("plan", os.path.join(JOBS, "digits_lenet.yaml"), "--np", "3", "--set",
                       "parallel.scheme=tensor", "--set", "parallel.tensor_parallel=2")
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("error: --set parallel.tensor_parallel=2: key "
                           "'parallel.tensor_parallel': scheme tensor runs replicas x 2 ranks"), \
        line
