"""Issue 36, items 3, 4 and 5: commands without a distributed meaning run on
rank 0 under mpiexec (cli.py, ``rank0_only``); the start-up block's thread
line notices cores other processes keep busy (base/threads.py); options that
agree with each other (cli_args.py: ``--init-skip`` one value each or a
comma list, the subcommand's usage on its errors, test/predict/export no
longer suggest train's ``--init-skip``)."""
import re
import subprocess

import h5py
import numpy as np
import pytest

from purine_mpi import cli
from purine_mpi.base import threads
from tests.conftest import MPIEXEC, REPO, cli_env, run_cli_args, run_cli_here, \
    small_net_config, write_config_file
from tests.mpi_scripts.launch import _flavour


def _mpi(n, *args, cwd=REPO, timeout=120, launcher_args=()):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    if launcher_args and "hydra" not in _flavour(MPIEXEC):
        pytest.skip("-pmi-port is an option of MPICH's mpiexec (Hydra)")
    return subprocess.run([MPIEXEC, "-n", str(n), *launcher_args, "python", "-m", "purine_mpi",
                           *map(str, args)], cwd=cwd, env=cli_env(), capture_output=True,
                          text=True, timeout=timeout)


# --------------------------------------------------------------- item 3
@pytest.mark.parametrize("argv, alone", [
    (["data", "digits", "--out", "x.h5"], True),
    (["inspect", "x.h5"], True),
    (["graph", "c.yaml", "--np", "4", "--rank", "3"], True),
    (["plot", "runs/a"], True),
    (["export", "onnx", "c.yaml", "--weights", "w.h5", "--out", "m.onnx"], True),
    (["convert", "caffe", "n.prototxt", "--out", "j.yaml"], True),
    (["predict", "runs/a/1", "--np", "2,4"], True),
    (["predict", "--calibrate", "link.json"], False),   # measures links: every rank
    (["predict", "c.yaml", "--weights", "w.h5", "--out", "p.h5"], False),
    (["bench", "c.yaml"], False),                        # times the composed graph
    (["train", "c.yaml"], False),
    (["test", "c.yaml", "--weights", "w.h5"], False),
])
def test_case3_which_commands_run_on_rank0_alone(argv, alone):
    """Case 3: the commands without a distributed meaning, and only those."""
    assert cli.rank0_only(cli.build_parser().parse_args(argv)) is alone


@pytest.mark.parametrize("launcher_args", [[], ["-pmi-port"]])
def test_case3_data_writes_once_under_mpiexec(tmp_path, launcher_args):
    """Case 3: ``mpiexec -n 2 ... data digits`` writes the file once and says
    so once; every rank exits 0. ``-pmi-port`` tells the ranks no size (no
    PMI_SIZE): MPI's world says it (cli.py, ``several_ranks``); before, each
    rank ran the command alone and wrote the file, said twice."""
    res = _mpi(2, "data", "digits", "--out", tmp_path / "d.h5", launcher_args=launcher_args)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("wrote") == 1, res.stdout
    with h5py.File(tmp_path / "d.h5", "r") as f:
        assert f["train/data"].shape[0] > 0


def test_case3_inspect_and_graph_print_once(tmp_path, digits_h5):
    """Case 3: inspect and graph answer once; graph --np 2 --rank 1 still
    shows rank 1's slice."""
    res = _mpi(2, "inspect", digits_h5)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count(f"file {digits_h5}") == 1, res.stdout
    cfg = write_config_file(tmp_path, small_net_config(digits_h5))
    res = _mpi(2, "graph", cfg, "--np", "2", "--rank", "1")
    assert res.returncode == 0, res.stderr
    alone = run_cli_here("graph", cfg, "--np", "2", "--rank", "1")
    assert alone.returncode == 0, alone.stderr
    assert res.stdout == alone.stdout


@pytest.mark.parametrize("launcher_args", [[], ["-pmi-port"]])
def test_case3_rank0_error_status_reaches_every_rank(tmp_path, launcher_args):
    """Case 3: rank 0's user error is said once, and the job exits with its
    status (2) on every rank."""
    res = _mpi(2, "inspect", tmp_path / "missing.h5", launcher_args=launcher_args)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert res.stderr.count("error:") == 1 and "missing.h5" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


# --------------------------------------------------------------- item 4
def test_case4_busy_cores_lower_the_default_count():
    """Case 4: with one of 2 cores busy elsewhere, the default is 1 thread,
    and the reason says so; an idle host keeps cores / ranks."""
    assert threads.decide({}, cores=2, busy=0.1) == (2, "2 usable cores")
    n, why = threads.decide({}, cores=2, busy=1.0)
    assert n == 1 and why == ("2 usable cores - 1 busy with other processes (1.0 measured) = "
                              "1 free"), why
    n, why = threads.decide({"MPI_LOCALNRANKS": "2"}, cores=16, busy=4.2)
    assert n == 6 and why == ("16 usable cores - 4 busy with other processes (4.2 measured) = "
                              "12 free / 2 ranks on this host (MPI_LOCALNRANKS)"), why
    # a count the user chose stands
    assert threads.decide({"PURINE_THREADS": "2"}, cores=2, busy=1.0) == (2, "PURINE_THREADS")


def test_case4_startup_line_names_purine_threads(monkeypatch):
    """Case 4: a user's count of more threads than the free cores gets the
    note naming PURINE_THREADS=1 in the start-up block's thread line."""
    monkeypatch.setattr(threads, "DECISION", (2, "PURINE_THREADS"))
    monkeypatch.setattr(threads, "BUSY", 1.0)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    line = threads.describe({"PURINE_THREADS": "2"})
    assert line.startswith("2 per rank (PURINE_THREADS); the cores are shared: 1.0 of 2 busy")
    assert "PURINE_THREADS=1" in line
    monkeypatch.setattr(threads, "BUSY", 0.2)  # noise: no note
    assert threads.describe({"PURINE_THREADS": "2"}) == "2 per rank (PURINE_THREADS)"
    assert threads.busy_note(1, 1, 2, 1.5) is None  # 1 thread: nothing to give up


def test_one_thread_per_rank_samples_no_load(monkeypatch):
    """One thread per rank has nothing to give up (busy_note), so the
    start-up line does not spend busy_elsewhere's 0.1 s sample on it; a
    count above one still measures."""
    calls = []
    monkeypatch.setattr(threads, "busy_elsewhere", lambda ranks: calls.append(ranks) or 1.0)
    monkeypatch.setattr(threads, "BUSY", None)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "DECISION", (1, "OMP_NUM_THREADS"))
    assert threads.describe({"OMP_NUM_THREADS": "1"}) == "1 per rank (OMP_NUM_THREADS)"
    assert calls == []
    monkeypatch.setattr(threads, "DECISION", (2, "PURINE_THREADS"))
    assert "the cores are shared: 1.0 of 2 busy" in threads.describe({"PURINE_THREADS": "2"})
    assert calls == [1]


def test_case4_busy_elsewhere_leaves_out_this_job(monkeypatch):
    """Case 4: the measured load (injected /proc/stat figures) less this
    process's own CPU and one core per other rank of the job."""
    samples = iter([(100, 200), (100 + 30, 200 + 40)])  # 2 cores, 75 % busy: 1.5 cores
    monkeypatch.setattr(threads, "_cpu_times", lambda cpus: next(samples))
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    own = iter([10.0, 10.0])
    monkeypatch.setattr(threads, "_own_cpu", lambda: next(own))
    assert threads.busy_elsewhere(1, seconds=0.01) == pytest.approx(1.5)
    samples = iter([(100, 200), (100 + 30, 200 + 40)])
    own = iter([10.0, 10.0])
    assert threads.busy_elsewhere(2, seconds=0.01) == pytest.approx(0.5)


# --------------------------------------------------------------- item 5
def test_case5_init_skip_does_not_swallow_the_config():
    """Case 5: ``--init-skip LAYER`` before the config takes one value."""
    args = cli.build_parser().parse_args(["train", "--init", "W.h5", "--init-skip", "fc2",
                                          "jobs/digits_lenet.yaml"])
    assert args.config == "jobs/digits_lenet.yaml" and args.init_skip == ["fc2"]


def test_case5_init_skip_repeats_and_takes_comma_lists():
    """Case 5: ``--init-skip fc2 --init-skip fc3,fc4`` names three layers."""
    args = cli.build_parser().parse_args(["train", "c.yaml", "--init", "W.h5", "--init-skip",
                                          "fc2", "--init-skip", "fc3,fc4"])
    assert args.init_skip == ["fc2", "fc3", "fc4"]


def test_case5_unknown_option_shows_the_subcommands_usage(capsys):
    """Case 5: ``test ... --init-skip`` is refused with test's usage, not the
    top-level one."""
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["test", "c.yaml", "--weights", "w.h5", "--init-skip",
                                       "fc2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m purine_mpi test "), err
    assert "unrecognized arguments: --init-skip fc2" in err, err


def test_case5_usage_error_once_under_mpiexec():
    """Case 5: under mpiexec -n 2 an unknown option gets one usage (the
    subcommand's) and one error line, and every rank exits 2."""
    res = _mpi(2, "inspect", "x.h5", "--bogus")
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("usage:") == 1, res.stderr
    assert res.stderr.startswith("usage: python -m purine_mpi inspect "), res.stderr
    assert res.stderr.count("unrecognized arguments: --bogus") == 1, res.stderr


def test_case5_test_with_foreign_weights_does_not_suggest_init_skip(tmp_path, digits_h5):
    """Case 5: ``test`` with weights that lack the net's layers says what is
    missing and that the weights belong to another net, not --init-skip
    (which test does not take: a fresh layer makes no test figure)."""
    weights = tmp_path / "w.h5"
    with h5py.File(weights, "w") as f:
        f["params/other/weight"] = np.zeros((2, 2), np.float32)
    cfg = write_config_file(tmp_path, small_net_config(digits_h5))
    res = run_cli_args("test", cfg, "--weights", weights)
    assert res.returncode == 2, res.stderr
    err = res.stderr.strip()
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert "--init-skip" not in err, err
    assert re.search(r"lacks \d+ parameter\(s\) of this net: conv1/weight", err), err
    assert "the weights belong to another net; give the config they were trained with" in err
