"""Issue 46 §2, "the newcomer's frictions": what a first user trips on.

- 2: a ``--set`` typo names ``--set`` (not the file) and offers "did you
  mean", also for another framework's name of a key (``learning_rate``);
  a mistyped command gets "did you mean" too.
- 3: the threads line's numbers add up; more ranks than cores on a host
  get a warning.
- 4: ``plot`` draws a step rate as steps, gives the accuracy axis a
  sensible least span and the loss a log axis when it spans decades.
- 5: ``bench`` with a missing data file says how to make it.
- 6: the console script calls itself ``purine-mpi`` in its usage.
- 7: a finished run marks its folder's lock free.
- 9: a mistyped ``--weights`` folder names the closest existing one.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

from purine_mpi.base import threads

from .conftest import (REPO, cli_env, run_cli_args, run_cli_here, small_net_config,
                       write_config_file)


def assert_exit_2(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ------------------------------------------------------------- item 2
def test_item2_a_set_typo_names_set_and_the_key_it_meant(digits_h5, tmp_path):
    cfg = write_config_file(tmp_path, small_net_config(digits_h5))
    line = assert_exit_2(run_cli_here("train", cfg, "--set", "solver.learning_rate=0.1",
                                      "--out", tmp_path / "run"),
                         "--set solver.learning_rate=0.1:", "did you mean 'base_lr'?")
    assert str(cfg) not in line, line  # the file is not at fault
    # a typo in the file itself still names the file
    from purine_mpi.job.config import resolve_config
    from purine_mpi.base.errors import ConfigError
    raw = small_net_config(digits_h5)
    raw["solver"]["lr"] = 0.1
    with pytest.raises(ConfigError) as exc:
        resolve_config(raw, "job.yaml")
    assert str(exc.value).startswith("job.yaml: key 'solver.lr'")
    assert "did you mean 'base_lr'?" in str(exc.value)
    # a bad value given by --set, and a mistyped section made by --set
    with pytest.raises(ConfigError) as exc:
        resolve_config(small_net_config(digits_h5), "job.yaml", ["solver.base_lr=abc"])
    assert str(exc.value).startswith("--set solver.base_lr=abc: key 'solver.base_lr'")
    with pytest.raises(ConfigError) as exc:
        resolve_config(small_net_config(digits_h5), "job.yaml", ["solvr.base_lr=1"])
    assert str(exc.value).startswith("--set solvr.base_lr=1: key 'solvr'")
    assert "did you mean 'solver'?" in str(exc.value)


def test_item2_a_mistyped_command_gets_did_you_mean():
    res = run_cli_here("trian", "jobs/digits_lenet.yaml")
    assert res.returncode == 2
    assert "invalid choice: 'trian'" in res.stderr and "did you mean 'train'?" in res.stderr, \
        res.stderr


# ------------------------------------------------------------- item 3
def test_item3_the_threads_reason_adds_up():
    n, why = threads.decide({}, cores=2, busy=2.0)
    assert n == 1, why
    numbers = re.fullmatch(r"(\d+) usable cores - (\d+) busy with other processes "
                           r"\(([\d.]+) measured\) = (\d+) free; 1 is the least", why)
    assert numbers, why
    cores, busy, _, free = (float(x) for x in numbers.groups())
    assert cores - busy == free
    n, why = threads.decide({"MPI_LOCALNRANKS": "2"}, cores=16, busy=4.2)
    assert (n, why) == (6, "16 usable cores - 4 busy with other processes (4.2 measured) = "
                           "12 free / 2 ranks on this host (MPI_LOCALNRANKS)")


def test_item3_more_ranks_than_cores_warns(monkeypatch):
    monkeypatch.setattr(threads, "DECISION", None)
    monkeypatch.setattr(threads, "BUSY", None)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    environ = {"MPI_LOCALNRANKS": "3"}
    monkeypatch.setattr(threads, "busy_elsewhere", lambda ranks: None)
    line = threads.describe(environ)
    assert line.startswith("1 per rank (2 usable cores / 3 ranks on this host"), line
    assert "warning: 3 ranks on this host, which has 2 usable cores" in line, line
    monkeypatch.setattr(threads, "DECISION", None)
    assert "warning" not in threads.describe({"MPI_LOCALNRANKS": "2"})


# ------------------------------------------------------------- item 4
def _rows():
    """A step schedule (0.1, then 0.01 from iteration 30), a loss that falls
    over three decades, and test accuracy between 0.978 and 0.9805."""
    rows = []
    for it in range(0, 60, 5):
        rows.append({"phase": "train", "iter": it, "loss": 2.3 * 10 ** (-it / 20),
                     "lr": 0.1 if it < 30 else 0.01, "images_per_s": 1000.0})
    for it, acc in ((20, 0.9805), (40, 0.978), (60, 0.98)):
        rows.append({"phase": "test", "iter": it, "accuracy": acc, "loss": 0.05})
    return rows


def test_item4_plot_panels_do_not_mislead(tmp_path):
    pytest.importorskip("matplotlib")
    from purine_mpi.tools.plot import ACCURACY_SPAN, draw
    fig = draw([("run", _rows())])
    loss, acc, lr, _ = fig.axes[:4]
    assert all(line.get_drawstyle() == "steps-pre" for line in lr.get_lines())
    smooth = [{"phase": "train", "iter": i, "loss": 1.0, "lr": 0.1 / (1 + i)} for i in range(5)]
    assert draw([("run", smooth)]).axes[2].get_lines()[0].get_drawstyle() == "default"
    bottom, top = acc.get_ylim()
    assert top - bottom >= ACCURACY_SPAN and 0 <= bottom <= 0.978 and 0.9805 <= top <= 1
    assert loss.get_yscale() == "log"
    assert draw([("run", _rows())], "linear").axes[0].get_yscale() == "linear"
    # accuracy spread over most of [0, 1] gets all of it; a flat loss stays linear
    wide = [{"phase": "test", "iter": i, "accuracy": a, "loss": 1.0 + i / 100}
            for i, a in ((0, 0.1), (10, 0.9))]
    fig = draw([("run", wide)])
    assert fig.axes[1].get_ylim() == (0.0, 1.0)
    assert fig.axes[0].get_yscale() == "linear"


def test_item4_plot_loss_scale_option(tmp_path):
    pytest.importorskip("matplotlib")
    import json
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    res = run_cli_args("plot", metrics, "--out", tmp_path / "c.png", "--loss-scale", "linear")
    assert res.returncode == 0, res.stderr
    res = run_cli_here("plot", metrics, "--out", tmp_path / "c.png", "--loss-scale", "lg")
    assert res.returncode == 2 and "did you mean 'log'?" in res.stderr, res.stderr


# ------------------------------------------------------------- item 5
def test_item5_bench_says_how_to_make_a_missing_data_file(tmp_path):
    shutil.copy(os.path.join(REPO, "jobs", "digits_lenet.yaml"), tmp_path)
    res = run_cli_args("bench", "digits_lenet.yaml", "--iters", "1", cwd=tmp_path)
    assert_exit_2(res, "data file 'data/digits.h5' not found",
                  "make it with 'python -m purine_mpi data digits --out data/digits.h5'")


# ------------------------------------------------------------- item 6
def test_item6_the_console_script_calls_itself_by_its_name():
    from purine_mpi.cli_args import program_name
    assert program_name("/venv/bin/purine-mpi") == "purine-mpi"
    assert program_name("/x/purine_mpi/__main__.py") == "python -m purine_mpi"
    script = shutil.which("purine-mpi", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the purine-mpi script is not installed")
    res = subprocess.run([script, "--help"], env=cli_env(), capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: purine-mpi "), res.stdout[:200]
    assert "python -m purine_mpi [-h]" not in res.stdout
    res = subprocess.run([script, "trian"], env=cli_env(), capture_output=True, text=True,
                         timeout=60)
    assert "purine-mpi: error:" in res.stderr, res.stderr
    res = run_cli_args("--help")
    assert res.stdout.startswith("usage: python -m purine_mpi "), res.stdout[:200]


# ------------------------------------------------------------- items 7, 9
@pytest.fixture(scope="module")
def small_run(digits_h5, tmp_path_factory):
    d = tmp_path_factory.mktemp("newcomer")
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=4, display=0, test_interval=0)
    path = write_config_file(d, cfg)
    res = run_cli_args("train", path, "--out", d / "runs" / "mine")
    assert res.returncode == 0, res.stderr
    return d, path


def test_item7_a_finished_run_marks_its_lock_free(small_run):
    d, _ = small_run
    text = (d / "runs" / "mine" / ".purine.lock").read_text()
    assert re.fullmatch(r"free: pid \d+ on \S+, started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d, ended "
                        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\n", text), text


def test_item7_a_killed_runs_lock_is_still_stale(tmp_path):
    """A run killed with SIGKILL cannot mark its lock free: its file keeps
    'pid ...', and the next run takes the folder all the same."""
    out = tmp_path / "run"
    out.mkdir()
    code = ("import os, sys; from purine_mpi.job.rundir import lock_run_dir; "
            f"lock_run_dir({str(out)!r}); print('locked', flush=True); "
            "os.kill(os.getpid(), 9)")
    res = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == -9 and "locked" in res.stdout, res.stderr
    assert (out / ".purine.lock").read_text().startswith("pid ")
    from purine_mpi.job import rundir
    try:
        rundir.lock_run_dir(str(out))  # the dead run's lock went with it
    finally:
        rundir.release_run_dirs()
    assert (out / ".purine.lock").read_text().startswith(f"free: pid {os.getpid()} ")


def test_item9_a_mistyped_weights_folder_names_the_closest(small_run):
    d, cfg = small_run
    res = run_cli_args("test", cfg, "--weights", "runs/mien", cwd=d)
    assert_exit_2(res, "--weights runs/mien: no such run folder or checkpoint",
                  "did you mean 'runs/mine'?")
    res = run_cli_args("test", cfg, "--weights", "runs/mine/latst.h5", cwd=d)
    assert_exit_2(res, "no such run folder or checkpoint", "did you mean 'runs/mine/latest.h5'?")


def test_item9_weights_of_runs_name_take_its_newest_numbered_run(tmp_path):
    """``train`` without --out writes runs/<name>/<N>; ``--weights
    runs/<name>`` (as the job headers' generate line and docs/transformers.md's
    export hf give it) takes the newest numbered run that has a latest.h5,
    as ``plot runs/<name>`` takes the newest with metrics; a folder with
    neither is still exit 2."""
    from purine_mpi.base.errors import UserError
    from purine_mpi.cli import _weights_file
    base = tmp_path / "runs" / "gpt_small"
    for n, done in ((1, True), (2, True), (10, True), (11, False)):
        (base / str(n)).mkdir(parents=True)
        if done:
            (base / str(n) / "latest.h5").write_bytes(b"")
    assert _weights_file(str(base)) == os.path.join(str(base), "10", "latest.h5")
    assert _weights_file(str(base / "2")) == os.path.join(str(base / "2"), "latest.h5")
    with pytest.raises(UserError, match="a folder without latest.h5, nor numbered run"):
        _weights_file(str(base / "11"))
