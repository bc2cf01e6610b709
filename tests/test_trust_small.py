"""Trust leftovers of the parameter-server paths and of ``predict`` (session 65).

(1) ``predict --out PATH`` where PATH cannot be written ran the whole
evaluation before failing, and on several ranks failed as rank 0's own
``error: rank 0: ...`` and an abort of the job. Now rank 0 checks the path
up front, before the weights are loaded, and every rank takes its verdict:
one line, exit 2.

(2) A parameter-server run stopped at ``--iters 0`` writes a checkpoint
without momenta (the servers never sent theirs). Resuming it said it "holds
no 'momentum' solver state for solver type 'sgd'", which reads as if
another solver wrote it; the note now says it was written before any update.

(3) A ``.caffemodel`` ``--init`` holding a NaN, in a parameter-server run
with two servers: each server checked only the parameters it owns, so the
ranks did not agree on the error (``error: rank R: ...`` lines and an
abort). Now every rank checks every parameter: one message, exit 3 on every
rank.
"""
import h5py
import numpy as np
import pytest

from tests.conftest import run_mpi_cli, small_net_config, write_config_file
from tests.test_caffemodel import blob, layer, string
from tests.test_trust_ps import PS, _each_rank_status, one_rank_run  # noqa: F401 (a fixture)


@pytest.mark.mpi
@pytest.mark.parametrize("where", ["/proc/purine_out.h5", "/proc/purine_dir/out.h5"])
def test_predict_on_two_ranks_checks_its_out_before_evaluating(tmp_path, digits_h5,
                                                                one_rank_run, where):
    """(1) Before: the weights loaded, the whole test split evaluated, then
    ``error: rank 0: /proc/purine_out.h5: cannot be written there ...`` and
    an abort. Now one line by rank 0, before anything is loaded, exit 2 on
    every rank."""
    job = write_config_file(tmp_path, small_net_config(digits_h5))
    res, status = _each_rank_status(tmp_path, 2, "predict", job, "--weights", one_rank_run,
                                    "--out", where)
    assert "loaded" not in res.stderr + res.stdout, res.stderr  # nothing evaluated
    errors = [line for line in res.stderr.splitlines() if line.startswith("error")]
    folder = "/proc/purine_dir"
    assert errors == [f"error: {where}: cannot be written there (No such file or directory); "
                      "give another --out" if where == "/proc/purine_out.h5" else
                      f"error: {folder}: cannot make this folder (No such file or directory); "
                      "give another --out"], res.stderr
    assert status == {0: 2, 1: 2}, (status, res.stderr)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["sync_ps", "async"])
def test_resuming_a_ps_checkpoint_of_no_update_says_so(tmp_path, digits_h5, mode):
    """(2) A 3-rank parameter-server run (2 workers, 1 server) at --iters
    0 writes no momenta; resumed on 2 data-parallel ranks, the note said the
    file 'holds no 'momentum' solver state for solver type 'sgd'' (as if
    another solver wrote it). Now it says no update was made."""
    cfg = small_net_config(digits_h5)
    cfg["parallel"] = dict(PS, mode=mode, max_staleness=int(mode == "async"))
    ps = write_config_file(tmp_path, cfg, "ps.yaml")
    first = run_mpi_cli(3, "train", ps, "--out", tmp_path / "a", "--iters", "0", timeout=120)
    assert first.returncode == 0, first.stderr
    ckpt = tmp_path / "a" / "latest.h5"
    with h5py.File(ckpt, "r") as f:
        assert int(f.attrs["iteration"]) == 0 and len(f["solver"]) == 0
    dp = write_config_file(tmp_path, small_net_config(digits_h5), "dp.yaml")
    res = run_mpi_cli(2, "train", dp, "--out", tmp_path / "b", "--resume", ckpt,
                      "--iters", "1")
    assert res.returncode == 0, res.stderr
    notes = [line for line in (res.stdout + res.stderr).splitlines() if "solver state" in line]
    assert notes == [f"note: {ckpt} was written at iteration 0, before any update, and holds "
                     "no 'momentum' solver state; that state starts from zero, as it would "
                     "have in the run that wrote it"], res.stdout + res.stderr


def _solver_arrays(path):
    out = {}
    with h5py.File(path, "r") as f:
        f["solver"].visititems(lambda name, obj: out.__setitem__(name, obj[()])
                               if isinstance(obj, h5py.Dataset) else None)
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["sync_ps", "async"])
def test_a_ps_checkpoint_before_any_update_keeps_the_resumed_momenta(tmp_path, digits_h5,
                                                                     mode):
    """(2) past iteration 0: a parameter-server run resumed at iteration 2
    from a checkpoint with momenta and saved at 2 before any update
    (--iters 2, another --out): the servers send their state only after an
    update, so the file held no momenta (``len(f["solver"]) == 0``) and its
    resume started them from zero, with the note "holds no 'momentum'
    solver state for solver type 'sgd'". Now rank 0 takes them from the
    checkpoint resumed: the same momenta, bit for bit."""
    cfg = small_net_config(digits_h5)
    cfg["parallel"] = dict(PS, mode=mode, max_staleness=int(mode == "async"))
    ps = write_config_file(tmp_path, cfg, "ps.yaml")
    first = run_mpi_cli(3, "train", ps, "--out", tmp_path / "a", "--iters", "2", timeout=120)
    assert first.returncode == 0, first.stderr
    again = run_mpi_cli(3, "train", ps, "--out", tmp_path / "b", "--resume",
                        tmp_path / "a" / "latest.h5", "--iters", "2", timeout=120)
    assert again.returncode == 0, again.stderr
    before, after = (_solver_arrays(tmp_path / r / "latest.h5") for r in ("a", "b"))
    assert before and sorted(after) == sorted(before), (sorted(before), sorted(after))
    for name, value in before.items():
        assert np.array_equal(after[name], value), name


@pytest.mark.mpi
def test_a_caffemodel_init_with_nan_on_two_servers_is_one_message(tmp_path):
    """(3) --init MODEL.caffemodel whose 'out' weight holds a NaN, 3 ranks
    with ps_ranks 2 (1 worker, 2 servers): before, the server that does not
    own 'out/weight' took the file, the others refused it, and the job
    ended with 'error: rank R: ...' lines and an abort. Now every rank
    finds it: one message by rank 0, exit 3."""
    from purine_mpi.job.config import dump_config
    from tests.mpi_scripts.common import mlp_config
    cfg = mlp_config(solver={"base_lr": 0.0, "max_iter": 1},
                     parallel={"mode": "sync_ps", "ps_ranks": 2, "stall_timeout": 30})
    path = tmp_path / "mlp.yaml"
    path.write_text(dump_config(cfg))
    rng = np.random.default_rng(7)
    shapes = {"fc1": (6, 8), "fc2": (5, 6), "out": (3, 5)}
    w = {f"{n}/{k}": rng.standard_normal(s if k == "weight" else s[:1]).astype(np.float32)
         for n, s in shapes.items() for k in ("weight", "bias")}
    w["out/weight"][1, 2] = np.nan
    model = string(1, "mlp") + b"".join(
        layer(n, "InnerProduct", [], [], [blob(w[f"{n}/weight"]), blob(w[f"{n}/bias"])])
        for n in shapes)
    init = tmp_path / "w.caffemodel"
    init.write_bytes(model)
    # the launcher's status (not each rank's through a shell around it:
    # Hydra then killed a rank ending by MPI_Finalize in about 1 run of 3)
    res = run_mpi_cli(3, "train", path, "--out", tmp_path / "run", "--init", init)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error")]
    assert errors == [f"error: weights file '{init}' holds non-finite values (NaN or inf) in "
                      "blob 'out/weight' (1 of 15); no result computed from it would mean "
                      "anything. Use an earlier checkpoint (a run that hit NaN keeps its last "
                      "finite one as latest.h5)"], res.stderr
    assert res.returncode == 3, (res.returncode, res.stderr)


def test_device_memory_for_a_cpu_job_says_it_checks_nothing(tmp_path, digits_h5):
    """``--device-memory`` on a job that runs on the CPU (device -1) was
    taken and ignored in silence: a user who meant to check a GPU budget
    read "fits" from the host's check alone. plan, plan --choose's inputs
    and train now say so in one note; a GPU job takes no note."""
    from tests.conftest import run_cli_args, run_cli_here
    job = write_config_file(tmp_path, small_net_config(digits_h5))
    note = ("note: --device-memory 1GiB checks nothing: the job runs on the CPU (device: -1; "
            "--host-memory is the limit that applies)")
    res = run_cli_here("plan", job, "--device-memory", "1GiB")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines().count(note) == 1, res.stderr
    gpu = run_cli_here("plan", job, "--device-memory", "80GiB", "--set", "device=0")
    assert "checks nothing" not in gpu.stderr, gpu.stderr
    run = run_cli_args("train", job, "--device-memory", "1GiB", "--iters", "1",
                       "--out", tmp_path / "run")
    assert run.returncode == 0, run.stderr
    assert (run.stdout + run.stderr).splitlines().count(note) == 1, (run.stdout, run.stderr)


def test_data_does_not_replace_a_file_that_is_not_hdf5(tmp_path):
    """``data digits --out notes.txt`` replaced the user's text file with a
    data file in silence. A file that is not HDF5 is refused now (exit 2,
    the file unchanged); an HDF5 data file is remade as before."""
    from tests.conftest import run_cli_here
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    res = run_cli_here("data", "digits", "--out", notes)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert res.stderr.strip() == (f"error: --out {notes} exists and is not an HDF5 file: "
                                  "writing the data there would replace it; give another --out, "
                                  "or --force to replace it"), res.stderr
    assert notes.read_text() == "my notes\n"
    data = tmp_path / "digits.h5"
    for _ in range(2):
        again = run_cli_here("data", "digits", "--out", data)
        assert again.returncode == 0, again.stderr


def test_predict_that_fails_later_leaves_no_folder_of_its_check(tmp_path, digits_h5,
                                                                 one_rank_run):
    """(1) The up-front check of --out makes its folders to try a file
    there; a predict that then fails (a blob the test phase does not
    compute) left them behind, empty: ``new/sub/`` after exit 2. Now the
    check removes the folders it made (the write makes them again)."""
    from tests.conftest import run_cli_args
    job = write_config_file(tmp_path, small_net_config(digits_h5))
    res = run_cli_args("predict", job, "--weights", one_rank_run, "--out",
                       tmp_path / "new" / "sub" / "p.h5", "--blob", "nosuch")
    assert res.returncode == 2 and "nosuch" in res.stderr, res.stderr
    assert not (tmp_path / "new").exists()


def test_check_writable_leaves_nothing_on_ctrl_c(tmp_path, monkeypatch):
    """(1) Ctrl-C between the check's temporary file and its removal left
    the file (``p.h5.tmp.<pid>``) and the folder made for it; now both go."""
    import builtins
    import os
    from purine_mpi.base import runfiles

    def interrupted(*args, **kwargs):
        builtins.open(*args, **kwargs).close()
        raise KeyboardInterrupt
    monkeypatch.setattr(runfiles, "open", interrupted, raising=False)
    out = tmp_path / "made" / "p.h5"
    with pytest.raises(KeyboardInterrupt):
        runfiles.check_writable(str(out))
    assert os.listdir(tmp_path) == []


def test_check_writable_takes_a_path_left_by_a_killed_write(tmp_path, monkeypatch):
    """(1) A killed predict leaves ``P.tmp.<pid>``; a later one with the
    same process id (a container's) raised FileExistsError from the check
    (a traceback, an abort under MPI) where the write itself removes it and
    goes on. Now the check does as the write: the path is taken, nothing
    left; an existing output (replaced by the write), a relative path and a
    link to a file are taken too, untouched."""
    import os
    from purine_mpi.base.runfiles import check_writable, temp_name
    out = tmp_path / "p.h5"
    (tmp_path / os.path.basename(temp_name(out))).write_bytes(b"left by a killed write")
    check_writable(str(out))
    assert os.listdir(tmp_path) == []
    out.write_bytes(b"old")
    os.symlink(out, tmp_path / "link.h5")
    check_writable(str(tmp_path / "link.h5"))
    monkeypatch.chdir(tmp_path)
    check_writable("rel/p.h5")
    assert sorted(os.listdir(tmp_path)) == ["link.h5", "p.h5"] and out.read_bytes() == b"old"


def test_rank0_decides_gives_every_rank_rank_0s_value_or_error():
    """``comm.world.rank0_decides`` (predict's --out check, parallel.scheme
    auto, the run folder): rank 0 alone decides; one allgather (named, under
    the wait given, the world's own timeout back after it, also when it
    fails) gives every rank its value or the same UserError. ``decide``
    has one shape: it returns the value or raises a UserError, whose exit
    status every rank takes (before, an error was a message or a (message,
    status) tuple, whichever the caller wrote)."""
    from purine_mpi.base.errors import StallError, UserError
    from purine_mpi.comm.world import rank0_decides

    class World:
        def __init__(self, rank, answer=None, stall=False):
            self.rank, self.size, self.stall_timeout = rank, 2, 300.0
            self.answer, self.stall, self.calls = answer, stall, []

        def allgather_object(self, obj, what):
            self.calls.append((obj, what, self.stall_timeout))
            if self.stall:
                raise StallError(what)
            return [self.answer if self.rank else obj, None]

    def never():
        raise AssertionError("only rank 0 decides")
    zero, one = World(0), World(1, answer=("sets", None))
    assert rank0_decides(zero, lambda: "sets", "the choice", 3600.0) == "sets"
    assert rank0_decides(one, never, "the choice", 3600.0) == "sets"
    assert zero.calls == [(("sets", None), "the choice", 3600.0)]
    assert one.calls == [(None, "the choice", 3600.0)] and one.stall_timeout == 300.0
    one = World(1, answer=(None, ("out: cannot be written there", 2)))
    with pytest.raises(UserError, match="^out: cannot be written there$"):
        rank0_decides(one, never, "the check")
    assert one.calls == [(None, "the check", 300.0)]
    stalled = World(1, stall=True)
    with pytest.raises(StallError):
        rank0_decides(stalled, never, "the choice", 3600.0)
    assert stalled.stall_timeout == 300.0
    single = World(0)
    single.size = 1

    def refuse():
        raise UserError("no")
    with pytest.raises(UserError, match="^no$"):
        rank0_decides(single, refuse, "the check")
    assert single.calls == []

    def stopped():  # a calibration stopped by SIGTERM: 143 on every rank, not 2
        exc = UserError("stopped")
        exc.exit_code = 143
        raise exc
    zero = World(0)
    with pytest.raises(UserError, match="^stopped$") as got:
        rank0_decides(zero, stopped, "the choice")
    assert got.value.exit_code == 143
    assert zero.calls == [((None, ("stopped", 143)), "the choice", 300.0)]


def _longest_name(folder, suffix=".h5"):
    """A file name in ``folder`` of the most bytes its file system takes."""
    import os
    return "p" * (os.pathconf(folder, "PC_NAME_MAX") - len(suffix)) + suffix


def test_check_writable_names_an_out_whose_temporary_name_is_too_long(tmp_path):
    """(1) An --out whose name fits the file system but whose temporary
    name (``.tmp.<pid>`` added) does not: the check raised the OSError
    (ENAMETOOLONG, a traceback); now one line naming the path and why."""
    import os
    from purine_mpi.base.errors import UserError
    from purine_mpi.base.runfiles import check_writable, temp_name
    out = str(tmp_path / _longest_name(tmp_path))
    with pytest.raises(UserError) as err:
        check_writable(out)
    tmp, limit = os.path.basename(temp_name(out)), os.pathconf(tmp_path, "PC_NAME_MAX")
    assert str(err.value) == (
        f"{out}: the name is too long: its write goes through the temporary file '{tmp}' "
        f"({len(tmp)} bytes) and this file system takes names of at most {limit} bytes (the "
        f"name itself has {limit}); give a shorter --out"), str(err.value)
    with pytest.raises(UserError, match="the name is too long: File name too long; give a "
                                        "shorter --out"):
        check_writable(out + "x")  # the name itself too long
    with pytest.raises(UserError, match="the name is too long: File name too long; give a "
                                        "shorter --out"):
        check_writable(os.path.join(out + "x", "p.h5"))  # a folder's
    assert os.listdir(tmp_path) == []


def test_check_writable_names_a_temporary_path_past_the_path_limit(tmp_path):
    """(1) An --out whose path fits the system's limit on a whole path
    (4095 bytes) but whose temporary path (``.tmp.<pid>`` added) does not,
    its name short: the line said the temporary file's name ('p.h5.tmp.<pid>'
    (14 bytes)) passed the 255-byte limit on names, which it does not (the
    assertion on 'paths of at most' failed: '... at most 255 bytes (the name
    itself has 4)'). Now it names the path's limit."""
    import os
    from purine_mpi.base.errors import UserError
    from purine_mpi.base.runfiles import check_writable, temp_name
    path_max = os.pathconf(tmp_path, "PC_PATH_MAX")
    folder = str(tmp_path)
    while len(os.fsencode(folder)) < path_max - 8:   # "/p.h5" makes it path_max - 3 bytes
        folder = os.path.join(folder, "a" * min(200, path_max - 9 - len(os.fsencode(folder))))
    os.makedirs(folder)
    out = os.path.join(folder, "p.h5")
    assert len(os.fsencode(out)) < path_max <= len(os.fsencode(temp_name(out)))
    with pytest.raises(UserError) as err:
        check_writable(out)
    assert str(err.value) == (
        f"{out}: the name is too long: its write goes through the temporary file "
        f"'{os.path.basename(temp_name(out))}' beside it, a path of "
        f"{len(os.fsencode(temp_name(out)))} bytes, and this system takes paths of at most "
        f"{path_max - 1} bytes (the path itself has {len(os.fsencode(out))}); give a shorter "
        "--out"), str(err.value)[-300:]
    assert os.listdir(folder) == []


def test_predict_names_an_out_too_long_in_one_line(tmp_path, digits_h5, one_rank_run):
    """(1) The same through ``predict``: exit 2, one line, no traceback."""
    from tests.conftest import run_cli_args
    job = write_config_file(tmp_path, small_net_config(digits_h5))
    out = tmp_path / _longest_name(tmp_path)
    res = run_cli_args("predict", job, "--weights", one_rank_run, "--out", out)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {out}: the name is too long: its write goes through the "
                           "temporary file") and last.endswith("; give a shorter --out"), last


def test_an_iteration_0_checkpoint_of_another_solver_is_named_as_such(tmp_path, digits_h5):
    """An iteration-0 checkpoint holding Adam's state, resumed under SGD:
    "for solver type 'sgd'", not the no-update note (which read the
    checkpoint's solver state after the resume had let it go, so any
    iteration-0 file looked like one written before any update)."""
    from tests.conftest import run_cli_args
    job = write_config_file(tmp_path, small_net_config(digits_h5))
    first = run_cli_args("train", job, "--set", "solver.type=adam", "--iters", "0",
                         "--out", tmp_path / "a")
    assert first.returncode == 0, first.stderr
    res = run_cli_args("train", job, "--resume", tmp_path / "a" / "latest.h5", "--iters", "1",
                       "--out", tmp_path / "b")
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    assert "holds no 'momentum' solver state for solver type 'sgd'" in out, out
    assert "before any update" not in out, out
