"""A cancel of a job whose peer is frozen ends it promptly (docs/failures.md,
"A cancel while a peer is frozen").

Before: rank 1 stopped (SIGSTOP) during training, a SIGTERM to ``mpiexec``
(or to the live rank; SLURM's scancel) was recorded, but rank 0 went on
waiting in the stalled op for the whole ``parallel.stall_timeout`` (300 s by
default; SLURM's SIGKILL comes 30 s after its SIGTERM), then ended 1 with
"stalled". Now the wait ends ``Cancel.cancel_grace()`` after the
notice (5 s, or twice the longest wait on peers the rank saw end, where
that is more: a slow but healthy peer is waited for, and its job stops with
the stop's checkpoint): one line saying which op stalled and that no checkpoint was written
(one needs every rank), the last complete one's iteration, exit 143.

The stall timeout here is 120 s: the job must end well before it (60 s is
allowed, for a loaded 2-core machine); the stop lands wherever rank 0 is
(graph communication, the stop agreement, a checkpoint's gather).

The launched ranks run with a least grace of GRACE (2 s, not 5:
PURINE_TEST_CANCEL_GRACE, tests/mpi_scripts/short_grace.py), and each
healthy peer's wait is longer than it (a slow iteration 4 s against 2, 8
against 5 before; rank 0's test pass 4 s, 10 before): the same cases on
either side of the grace, about 40 s less of CI."""
import os
import signal
import subprocess
import time

import h5py
import pytest

from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env, small_net_config, write_config_file
from tests.test_signals import _rank_pids, kill_ranks

STALL_TIMEOUT = 120
ENDS_WITHIN = 60
#: the cancel's least grace in the launched ranks (Cancel.CANCEL_GRACE: 5 s)
GRACE = 2.0
SCRIPTS = os.path.join(REPO, "tests", "mpi_scripts")


def _env(**more):
    """cli_env() with the ranks' least grace GRACE, and ``more``."""
    env = cli_env()
    env.update(PURINE_TEST_CANCEL_GRACE=str(GRACE), **more)
    return env


def _rank_of(pid):
    """The MPI rank the launcher gave process ``pid`` (PMI_RANK)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env[b"PMI_RANK"])


def _wait_for_checkpoint(out, deadline):
    """Wait until the run wrote its first periodic checkpoint (latest.h5)."""
    path = os.path.join(out, "latest.h5")
    while time.time() < deadline:
        if os.path.exists(path):
            return
        time.sleep(0.05)
    raise AssertionError("the run never wrote a checkpoint")


@pytest.mark.mpi
@pytest.mark.parametrize("target", ["mpiexec", "rank 0"])
def test_sigterm_with_a_frozen_peer_ends_promptly_with_143(tmp_path, digits_h5, target):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=1000000, display=5, test_interval=0)
    cfg["checkpoint"] = {"interval": 20, "keep": 2}
    cfg["parallel"] = {"stall_timeout": STALL_TIMEOUT}
    path = write_config_file(tmp_path, cfg)
    out = str(tmp_path / "run")
    proc = subprocess.Popen([MPIEXEC, "-n", "2", PYTHON, os.path.join(SCRIPTS, "short_grace.py"),
                             "train", path, "--out", out], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        _wait_for_checkpoint(out, time.time() + 90)
        pids = _rank_pids(out, "short_grace.py")
        assert len(pids) == 2, pids
        ranks = {_rank_of(p): p for p in pids}
        os.kill(ranks[1], signal.SIGSTOP)
        time.sleep(1.0)  # rank 0 now waits on it
        os.kill(proc.pid if target == "mpiexec" else ranks[0], signal.SIGTERM)
        sent = time.monotonic()
        try:
            stdout, stderr = proc.communicate(timeout=ENDS_WITHIN)
        except subprocess.TimeoutExpired:
            pytest.fail(f"SIGTERM to {target}, rank 1 frozen: the job still runs "
                        f"{ENDS_WITHIN} s later (stall timeout {STALL_TIMEOUT} s)")
        took = time.monotonic() - sent
    finally:
        kill_ranks(proc, pids)
    print(f"frozen peer, SIGTERM to {target}: the job ended {took:.1f} s after it")
    assert took < ENDS_WITHIN
    assert proc.returncode == 143, stderr
    lines = [ln for ln in stderr.splitlines() if "stopped by SIGTERM while" in ln]
    assert lines, stderr
    line = lines[0]
    assert line.startswith("rank 0: stopped by SIGTERM while "), line
    assert "no checkpoint written (one needs every rank)" in line, line
    assert "the last complete one is that of iteration " in line, line
    last = int(line.rsplit("iteration ", 1)[1].split()[0])
    assert last > 0 and last % 20 == 0, line
    if "stop agreement" in line:  # a collective outside the graph: the peer named
        assert "waiting for rank 1" in line, line
    assert "stalled for more than" not in stderr  # not the stall timeout's end
    log = open(os.path.join(out, "train.log")).read()
    assert "run ended: stopped by SIGTERM on rank 0 (exit 143)" in log, log


SLOW_S = 4.0


def _slow_marks(path, rank):
    """(pid, time) of each sleep rank ``rank`` began (tests/mpi_scripts/slow_rank.py)."""
    if not os.path.exists(path):
        return []
    rows = [ln.split() for ln in open(path).read().splitlines()]
    return [(int(r[0]), float(r[2])) for r in rows if len(r) == 3 and int(r[1]) == rank]


@pytest.mark.mpi
def test_sigterm_with_a_slow_healthy_peer_stops_with_a_checkpoint(tmp_path, digits_h5):
    """Rank 1 is slow, not frozen: each of its iterations takes 8 s more
    than rank 0's (SLOW_S), so rank 0 waits 4 s in the iteration's communication
    every time. A SIGTERM to ``mpiexec`` just as rank 1 begins an iteration
    leaves rank 0 waiting some 4 s more, past the least grace (GRACE, 2 s): before,
    rank 0 took rank 1 for a stopped peer and ended 143 WITHOUT the stop's
    checkpoint; now the grace is twice the longest wait rank 0 saw end (an
    earlier iteration's, 4 s), so the job stops at the iteration boundary as
    docs/failures.md promises for SIGTERM: exit 143, latest.h5 at the
    iteration it stopped."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=1000000, display=1, test_interval=0)
    cfg["checkpoint"] = {"interval": 0, "keep": 2}
    cfg["parallel"] = {"stall_timeout": STALL_TIMEOUT}
    path = write_config_file(tmp_path, cfg)
    out = str(tmp_path / "run")
    mark = str(tmp_path / "slow.marks")
    env = _env(PURINE_TEST_SLOW_S=str(SLOW_S), PURINE_TEST_SLOW_MARK=mark)
    script = os.path.join(SCRIPTS, "slow_rank.py")
    proc = subprocess.Popen([MPIEXEC, "-n", "2", PYTHON, script, "train", path, "--out", out],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.time() + 120
        # rank 1's third sleep: rank 0 saw the second iteration's 4 s wait end
        # (the first one's may be shorter: rank 0's start-up may end later)
        while len(_slow_marks(mark, 1)) < 3 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert len(_slow_marks(mark, 1)) >= 3, (proc.poll(), open(mark).read()
                                                 if os.path.exists(mark) else "no marks")
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        late = time.time() - _slow_marks(mark, 1)[-1][1]
        try:
            stdout, stderr = proc.communicate(timeout=STALL_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"SIGTERM, rank 1 slow: the job still runs {STALL_TIMEOUT} s later")
        took = time.monotonic() - sent
    finally:
        kill_ranks(proc, [pid for r in (0, 1) for pid, _ in _slow_marks(mark, r)])
    print(f"slow peer: SIGTERM {late:.1f} s into rank 1's {SLOW_S:g} s sleep; "
          f"the job ended {took:.1f} s after it")
    assert proc.returncode == 143, stderr
    assert "stopped by SIGTERM while" not in stderr, stderr  # not taken for a frozen peer
    assert "stopping at iter" in stdout, (stdout, stderr)
    stopped = int(stdout.split("stopping at iter ", 1)[1].split()[0])
    with h5py.File(os.path.join(out, "latest.h5"), "r") as f:
        assert int(f.attrs["iteration"]) == stopped > 0
        assert f.attrs["world_size"] == 2
    log = open(os.path.join(out, "train.log")).read()
    assert "stopped by SIGTERM while" not in log, log


def test_the_grace_grows_with_the_longest_wait_seen(monkeypatch):
    """``cancel_grace``: CANCEL_GRACE until a wait longer than half of it
    ends, then CANCEL_GRACE_FACTOR times the longest; waits before the
    run's iterations (start-up: a peer's imports, data loading) do not count."""
    from purine_mpi.base.cancel import Cancel
    monkeypatch.setattr(Cancel, "longest_wait", 0.0)
    monkeypatch.setattr(Cancel, "measuring", False)
    Cancel.note_wait(60.0)  # the start-up
    assert Cancel.cancel_grace() == Cancel.CANCEL_GRACE
    monkeypatch.setattr(Cancel, "measuring", True)
    Cancel.note_wait(1.0)
    assert Cancel.cancel_grace() == Cancel.CANCEL_GRACE
    Cancel.note_wait(8.0)
    Cancel.note_wait(3.0)  # a shorter one later changes nothing
    assert Cancel.cancel_grace() == 8.0 * Cancel.CANCEL_GRACE_FACTOR
    now = time.monotonic()
    monkeypatch.setattr(Cancel, "cancelled", ("SIGTERM", now - 100))
    assert Cancel.cancelled_wait(now - 10) is None  # 10 s: a slow peer's wait, not over
    assert Cancel.cancelled_wait(now - 17) == "SIGTERM"


def _world(rank, size):
    """A World's naming part, without MPI: rank ``rank`` of ``size``."""
    from types import SimpleNamespace
    from purine_mpi.comm.world import World
    w = SimpleNamespace(rank=rank, size=size, comm=object())
    w._world_ranks = lambda comm=None: World._world_ranks(w, comm)
    w.missing_peer = lambda comm=None, verb="stopped responding": \
        World.missing_peer(w, comm, verb)
    return w


def test_a_collective_stall_names_the_missing_peer_where_mpi_can_tell():
    """Before, a collective outside the graph said "a peer rank stopped
    responding" whatever the world: with one peer, it is that rank; with
    more, MPI's request does not say which, and the message says so."""
    assert _world(0, 2).missing_peer() == "rank 1 stopped responding"
    assert _world(1, 2).missing_peer(verb="waiting for") == "waiting for rank 0"
    three = _world(1, 3).missing_peer()
    assert three == ("a peer rank (one of ranks 0,2; MPI's nonblocking collective does not "
                     "say which) stopped responding")


def test_a_wait_ends_on_a_cancel_after_the_grace_not_before(monkeypatch):
    """``cancelled_wait``: nothing without a cancel, nor with SIGUSR1 (a
    warning: finish cleanly); a cancel ends a wait once both are
    CANCEL_GRACE seconds old."""
    from purine_mpi.base.cancel import Cancel
    now = time.monotonic()
    monkeypatch.setattr(Cancel, "longest_wait", 0.0)  # no wait seen: the least grace
    monkeypatch.setattr(Cancel, "cancelled", None)
    assert Cancel.cancelled_wait(now - 100) is None
    monkeypatch.setattr(Cancel, "cancelled", ("SIGTERM", now - 1))  # too young
    assert Cancel.cancelled_wait(now - 100) is None
    monkeypatch.setattr(Cancel, "cancelled", ("SIGTERM", now - 100))
    assert Cancel.cancelled_wait(now - 1) is None  # a wait just begun: its peers may come
    assert Cancel.cancelled_wait(now - Cancel.CANCEL_GRACE - 1) == "SIGTERM"
    assert "SIGUSR1" not in Cancel.CANCELS


def test_the_cancel_is_recorded_by_the_handlers(monkeypatch):
    from purine_mpi.base.cancel import Cancel
    from purine_mpi.runtime.stop import StopSignal
    monkeypatch.setattr(Cancel, "cancelled", None)
    monkeypatch.setattr(StopSignal, "current", None)
    stop = StopSignal.__new__(StopSignal)  # no handlers installed
    stop.name, stop._first_int = None, None
    stop._handle(signal.SIGUSR1, None)
    assert Cancel.cancelled is None
    stop._handle(signal.SIGTERM, None)
    assert Cancel.cancelled[0] == "SIGTERM"
    assert stop.name == "SIGTERM"


@pytest.mark.mpi
def test_a_frozen_peer_is_named_in_a_collective_of_three_ranks():
    """3 ranks, rank 1 frozen before a barrier: ranks 0 and 2, stalled,
    tell each other so, and each names rank 1 (before: "a peer rank stopped
    responding" without a number)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    from tests.mpi_scripts.launch import run_mpi
    proc, took = run_mpi("frozen_peer.py", 3, expect_ok=False, timeout=90)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if "the frozen peer's barrier stalled" in ln]
    assert lines, proc.stderr
    for line in lines:  # whichever of ranks 0 and 2 got to say it before the abort
        rank = int(line.split(":")[0].split()[1])
        assert rank in (0, 2), line
        other = 2 - rank
        assert line.endswith(f"rank 1 stopped responding (rank {other} said it waits too)"), line


@pytest.mark.mpi
def test_a_cancel_of_an_earlier_run_in_the_process_does_not_end_the_next(tmp_path, digits_h5):
    """The cancel's state is class-level (``Cancel.cancelled``,
    ``longest_wait``, ``measuring``): a second ``run_training`` in one
    process (the Python API after a Ctrl-C stopped the first run) found the
    first run's cancel and took any wait of the grace or more -- here rank 1's
    slow first iteration, 3 s against the least grace GRACE, 2 s (7 s
    against 5 before) -- for a frozen peer: exit 130, no checkpoint,
    a healthy job. Now each run starts with none of it (a notice that came
    before this run's trainer existed is kept)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=3, display=1, test_interval=0)
    cfg["parallel"] = {"stall_timeout": STALL_TIMEOUT}
    path = write_config_file(tmp_path, cfg)
    out = str(tmp_path / "run")
    env = _env(PURINE_TEST_SLOW_S="3")
    script = os.path.join(SCRIPTS, "second_run.py")
    res = subprocess.run([MPIEXEC, "-n", "2", PYTHON, script, "train", path, "--out", out],
                         cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=STALL_TIMEOUT)
    assert "stopped by SIGINT while" not in res.stderr, res.stderr
    assert res.returncode == 0, res.stderr
    with h5py.File(os.path.join(out, "latest.h5"), "r") as f:
        assert int(f.attrs["iteration"]) == 3


def test_each_run_starts_with_no_cancel_state(monkeypatch):
    """``StopSignal.new_run``: the previous run's cancel, longest wait and
    last checkpoint go; a cancel recorded before this run's trainer existed
    (``install_early``'s handler: ``early``) stays."""
    from purine_mpi.base.cancel import Cancel
    from purine_mpi.runtime.stop import StopSignal
    for key, value in (("cancelled", ("SIGTERM", 1.0)), ("longest_wait", 50.0),
                       ("measuring", True), ("last_checkpoint", 7), ("early", None)):
        monkeypatch.setattr(StopSignal if key == "early" else Cancel, key, value)
    StopSignal.new_run()
    assert (Cancel.cancelled, Cancel.longest_wait, Cancel.measuring,
            Cancel.last_checkpoint) == (None, 0.0, False, None)
    assert Cancel.cancel_grace() == Cancel.CANCEL_GRACE
    monkeypatch.setattr(StopSignal, "early", "SIGTERM")
    monkeypatch.setattr(Cancel, "cancelled", ("SIGTERM", 2.0))
    StopSignal.new_run()
    assert Cancel.cancelled == ("SIGTERM", 2.0)


@pytest.mark.mpi
def test_sigterm_with_a_slow_checkpoint_write_keeps_the_stops_checkpoint(tmp_path, digits_h5):
    """Sharded stage 3: the stop's checkpoint is streamed to rank 0 bucket
    by bucket as rank 0 writes it, so the other ranks wait in each next
    bucket's gather while rank 0 writes the last one. Rank 0 writes slowly
    here (3 s an item, a slow file system) and the run had no checkpoint
    before: the cancel that asked for this checkpoint took rank 1's wait for
    a frozen peer the grace (GRACE, 2 s) on and ended the job 143 WITHOUT
    the checkpoint. The
    ranks waiting on rank 0's write are exempt from the cancel (as at the
    barrier after it): 143 with latest.h5 at the stop's iteration."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=1000000, display=1, test_interval=0)
    cfg["checkpoint"] = {"interval": 0, "keep": 2}
    cfg["parallel"] = {"scheme": "sharded", "shard": 3, "stall_timeout": STALL_TIMEOUT}
    # a 2 MB weight: rank 1's part of a gather waits for rank 0 (a small one
    # is sent eagerly, its request complete at once)
    cfg["net"][3:4] = [{"type": "fc", "name": "fc0", "bottom": "pool1", "top": "fc0",
                        "num_output": 2048},
                       {"type": "fc", "name": "fc1", "bottom": "fc0", "top": "fc1",
                        "num_output": 10}]
    path = write_config_file(tmp_path, cfg)
    out = str(tmp_path / "run")
    env = _env(PURINE_TEST_SLOW_S="3")
    script = os.path.join(SCRIPTS, "slow_write.py")
    proc = subprocess.Popen([MPIEXEC, "-n", "2", PYTHON, script, "train", path, "--out", out],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        metrics = os.path.join(out, "metrics.jsonl")
        deadline = time.time() + 120
        while not (os.path.exists(metrics) and os.path.getsize(metrics)) and \
                proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=STALL_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "stopped by SIGTERM while" not in stderr, stderr
    assert proc.returncode == 143, stderr
    stopped = int(stdout.split("stopping at iter ", 1)[1].split()[0])
    with h5py.File(os.path.join(out, "latest.h5"), "r") as f:
        assert int(f.attrs["iteration"]) == stopped > 0


@pytest.mark.mpi
def test_sigterm_in_scheme_nones_first_test_pass_keeps_the_stops_checkpoint(tmp_path, digits_h5):
    """Scheme none: rank 0 runs each test pass alone while rank 1 waits for
    its figures. A SIGTERM during the run's first pass, 4 s long here (a
    long test split), left rank 1 waiting past the grace (GRACE, 2 s): it took rank
    0 for a frozen peer and ended the job 143 WITHOUT the stop's checkpoint.
    Rank 1's wait for rank 0's pass is exempt from the cancel: the job stops
    at the iteration's end with its checkpoint."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=1000000, display=1, test_interval=30)
    cfg["checkpoint"] = {"interval": 0, "keep": 2}
    cfg["parallel"] = {"scheme": "none", "stall_timeout": STALL_TIMEOUT}
    path = write_config_file(tmp_path, cfg)
    out = str(tmp_path / "run")
    mark = str(tmp_path / "pass.mark")
    env = _env(PURINE_TEST_SLOW_S="4", PURINE_TEST_SLOW_MARK=mark)
    script = os.path.join(SCRIPTS, "slow_test_pass.py")
    proc = subprocess.Popen([MPIEXEC, "-n", "2", PYTHON, script, "train", path, "--out", out],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.time() + 120
        while not os.path.exists(mark) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None and os.path.exists(mark), proc.communicate()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=STALL_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "stopped by SIGTERM while" not in stderr, stderr
    assert proc.returncode == 143, stderr
    stopped = int(stdout.split("stopping at iter ", 1)[1].split()[0])
    with h5py.File(os.path.join(out, "latest.h5"), "r") as f:
        assert int(f.attrs["iteration"]) == stopped > 0
