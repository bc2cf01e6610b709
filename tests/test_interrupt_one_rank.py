"""Ctrl-C (SIGINT) sent to ONE rank of ``mpiexec -n 2 ... train`` (``kill
-INT PID``, not the process group) while its peer is slow to come ends the
whole job within seconds with the status 130 and one line, leaving none of
the MPI library's /dev/shm segments (comm/early_abort.py, ``interrupted``).

Before: a Ctrl-C before the run's own handler (Python's KeyboardInterrupt)
ended the interrupted rank alone, "interrupted", 130: before MPI_Init, its
peer then waited in MPI_Init for ever (Hydra ends a job only for a rank that
died after connecting to it); after it, rank 0 was held in a blocking
MPI_Comm_dup of the world's start-up, where no signal was answered at all.
Rank 1 is delayed by a wrapper (``sys.argv``: what to delay, seconds)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env, tiny_fc_config, write_config_file

#: rank 1 sleeps before anything (``start``) or once MPI is up (``after_init``);
#: rank 0 writes its pid (whole: renamed into place) as its train command
#: begins (``command``: it then sleeps, as a rank still importing) or once
#: its MPI_Init returned (``init``)
WRAPPER = r"""
import os, sys, time
where, seconds, pid_file, when = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
rank = os.environ.get("PMI_RANK", os.environ.get("PMI_ID"))

def write_pid():
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(pid_file + ".tmp", pid_file)

if rank == "1" and where == "start":
    time.sleep(seconds)
from purine_mpi.comm import mpi_init
init = mpi_init.import_mpi

def import_mpi():
    mpi = init()
    if rank == "0" and when == "init":
        write_pid()
    return mpi

mpi_init.import_mpi = import_mpi  # before comm.world imports it
from purine_mpi import cli
train = cli.COMMANDS["train"]

def delayed_train(args):
    if rank == "0" and when == "command":
        write_pid()
        time.sleep(30)  # still importing, building: a Ctrl-C is a KeyboardInterrupt here
    return train(args)

cli.COMMANDS["train"] = delayed_train
if rank == "1" and where == "after_init":
    import_mpi()
    time.sleep(seconds)
sys.exit(cli.main(sys.argv[5:]))
"""


def _shm_of(pid):
    """The MPI library's /dev/shm segments process ``pid`` maps."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split(None, 5)[5].strip() for line in f
                    if "/dev/shm/mpich_shm_" in line and len(line.split(None, 5)) == 6}
    except OSError:
        return set()


@pytest.mark.mpi
@pytest.mark.parametrize("where,seconds,when,line", [
    # rank 0 interrupted before MPI_Init, rank 1 never comes: MPI_Init's
    # watch ends rank 0 2 s on, the launcher the rest
    ("start", 300, "command", "rank 0: stopped by SIGINT while MPI was starting"),
    # rank 1 comes a moment later: MPI up, MPI_Abort(130) ends every rank
    ("start", 1.0, "command", "rank 0: interrupted (SIGINT) before the run began"),
    # rank 0 waits in the world's first collective for rank 1 (MPI up, slow)
    ("after_init", 300, "init", "rank 0: interrupted (SIGINT) before the run began"),
])
def test_ctrl_c_to_one_rank_while_its_peer_is_slow_ends_the_job(tmp_path, where, seconds, when,
                                                                line):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER)
    pid_file = tmp_path / "rank0.pid"
    cfg = tiny_fc_config()
    cfg["solver"]["max_iter"] = 100000  # a run would go on: only the interrupt ends it
    proc = subprocess.Popen(
        [MPIEXEC, "-n", "2", PYTHON, str(wrapper), where, str(seconds), str(pid_file), when,
         "train", str(write_config_file(tmp_path, cfg)), "--out", str(tmp_path / "o")],
        cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail("rank 0 never wrote its pid")
            time.sleep(0.02)
        pid = int(pid_file.read_text())
        time.sleep(0.5 if when == "command" else 1.0)  # in its sleep / in the collective
        shm = _shm_of(pid)
        # past MPI_Init, rank 0 maps its node's segment (with MPICH's shared memory)
        assert shm or when != "init" or not os.path.exists("/proc/self/maps"), "no segment"
        assert proc.poll() is None, "the job ended before the interrupt"
        os.kill(pid, signal.SIGINT)  # rank 0 alone
        sent = time.monotonic()
        try:
            stdout, stderr = proc.communicate(timeout=12)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(f"the job still ran 12 s after rank 0's SIGINT: {stderr[-1500:]}")
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, (proc.returncode, stdout[-1500:], stderr[-1500:])
    assert took < 8, took
    errors = [x for x in stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and line in errors[0], stderr[-1500:]
    assert "Traceback" not in stderr, stderr[-1500:]
    assert not [p for p in shm if os.path.exists(p)], shm  # the ranks' segment removed


def test_a_duplicate_whose_peer_never_comes_times_out_instead_of_hanging():
    """The world's start-up duplicates are polled (comm/world.py,
    ``_dup_polled``): one that never completes gives None after its
    timeout (World names it in a StallError), where ``Dup`` blocked for
    ever, answering no signal."""
    from purine_mpi.comm import world

    class Pending:
        def Test(self):
            return False

    class Comm:
        def Idup(self):
            return "the duplicate", Pending()

        def Dup(self):
            raise AssertionError("the blocking MPI_Comm_dup")

    t0 = time.monotonic()
    assert world._dup_polled(Comm(), 0.2) is None
    assert 0.15 < time.monotonic() - t0 < 5
    done = type("Done", (), {"Test": lambda self: True})()
    assert world._dup_polled(type("C", (), {"Idup": lambda self: ("dup", done)})(), 1) == "dup"


#: ``interrupted`` with a second Ctrl-C arriving during its flush (mpiexec
#: passes the terminal's Ctrl-C on: one press comes twice, ms apart); no MPI
SECOND_PRESS = r"""
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python's own, even in a
# test run whose parent ignores SIGINT
from purine_mpi.comm import early_abort, mpi_init

def flush_as_the_second_press_comes():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # Python code runs: a handler answers here

def no_mpi():
    raise RuntimeError("no MPI here")

mpi_init._flush = flush_as_the_second_press_comes
mpi_init.import_mpi = no_mpi
early_abort.interrupted()
"""


def test_a_second_ctrl_c_while_interrupted_flushes_changes_nothing():
    """The SIGINT handler is replaced before the flush (which can wait on a
    full pipe). Before, a second Ctrl-C there raised KeyboardInterrupt out
    of ``interrupted`` (and out of the excepthook that called it): the rank
    ended by the signal, without ending the job."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", SECOND_PRESS], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 130, (res.returncode, res.stderr[-1500:])
    assert "interrupted (SIGINT) before the run began" in res.stderr, res.stderr[-1500:]
    assert "Traceback" not in res.stderr, res.stderr[-1500:]


def test_a_ctrl_c_that_reaches_the_worlds_excepthook_ends_the_job_with_130(monkeypatch):
    """A KeyboardInterrupt outside ``cli._run``'s handling (the second of one
    press, raised while _run took the first) reaches the world's excepthook
    (comm/world.py, ``install_abort_handler``) in a run of several ranks: it
    ends the job as the first does (``early_abort.interrupted``: 130).
    Before, the hook took it for a failure: "rank 0: KeyboardInterrupt" and
    MPI_Abort(1)."""
    import threading
    from purine_mpi.comm import early_abort, world as world_mod
    ended = []

    class Interrupted(BaseException):
        pass

    def interrupted():
        ended.append(130)
        raise Interrupted  # never returns, as the real one

    class World:
        rank, size = 0, 2

        def abort(self, code):
            ended.append(code)

    monkeypatch.setattr(early_abort, "interrupted", interrupted)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    handle = world_mod.install_abort_handler(World())
    try:
        handle(KeyboardInterrupt, KeyboardInterrupt(), None)
    except Interrupted:
        pass
    assert ended == [130], ended


#: the start-up hook (comm/early_abort.py) given the world's StallError, its
#: abort a plain exit (no MPI here)
STALLED_AT_START = r"""
import os, sys
from purine_mpi.comm import early_abort
from purine_mpi.base.errors import StallError
early_abort.abort = os._exit
try:
    raise StallError("rank 0: the duplicate (MPI_Comm_idup) of MPI_COMM_WORLD stalled for "
                     "more than 300 s at start-up: a peer rank never came")
except StallError:
    early_abort._handle(*sys.exc_info())
"""


@pytest.mark.parametrize("debug", [False, True])
def test_a_start_up_stall_is_one_line_naming_the_op(debug):
    """A start-up duplicate a peer never came to (comm/world.py) reaches the
    start-up hook as a StallError: one line naming the op, the traceback
    only with --debug (as the world's own hook). Before, its ~15 lines of
    traceback, then "StallError before the job started"."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("PURINE_DEBUG", None)
    if debug:
        env["PURINE_DEBUG"] = "1"
    res = subprocess.run([sys.executable, "-c", STALLED_AT_START], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, (res.returncode, res.stderr[-1500:])
    lines = res.stderr.splitlines()
    if debug:
        assert "Traceback" in res.stderr, res.stderr[-1500:]
    else:
        assert lines == ["error: rank 0: the duplicate (MPI_Comm_idup) of MPI_COMM_WORLD stalled "
                         "for more than 300 s at start-up: a peer rank never came; ending every "
                         "rank (MPI_Abort)"], res.stderr[-1500:]


#: mpi4py.MPI imported, MPI never initialised: where a Ctrl-C between
#: import_mpi's import and its MPI_Init leaves it
IMPORTED_NOT_STARTED = r"""
import mpi4py
mpi4py.rc.initialize = False
from mpi4py import MPI
assert not MPI.Is_initialized()
from purine_mpi.comm.mpi_init import import_mpi
print("initialised", import_mpi().Is_initialized(), flush=True)
if MPI.Is_initialized() and not MPI.Is_finalized():
    MPI.Finalize()
"""


def test_import_mpi_initialises_an_mpi_imported_but_never_started():
    """``import_mpi`` initialises MPI where mpi4py.MPI is imported but MPI
    never started (comm/mpi_init.py). ``early_abort.interrupted`` calls it
    right after a Ctrl-C that may have come between the two; before, it
    returned the module as it was, and MPI_Abort was called on an MPI never
    started, leaving the peers in MPI_Init for ever."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA"))}
    env["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", IMPORTED_NOT_STARTED], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, (res.returncode, res.stderr[-1500:])
    assert "initialised True" in res.stdout, (res.stdout, res.stderr[-1500:])
