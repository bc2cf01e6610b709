"""Parameter-server mode stops like data-parallel mode (issue 12). With 3
ranks (workers 0 and 1, server 2) in ``async`` and ``sync_ps`` mode: SIGTERM
or SIGUSR1 to a worker, to the server or to ``mpiexec`` stops every rank at
one iteration with one checkpoint that holds the server's momenta, and the
job exits 143 (TERM) or 0 (USR1); SIGKILL or SIGSTOP of a rank ends the job
with a failure status within the stall timeout. Every case under 60 s.

The signal cases run with a 5 s stall timeout (a stop agreement and a
checkpoint on a loaded 2-core machine stay well inside it); a dead or
frozen rank, whose case waits the whole timeout out, with 2 s, as
test_stall.py's 14 SIGSTOPs of 2 and 3 ranks do."""
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np
import pytest

from tests.conftest import PYTHON, REPO, cli_env, small_net_config, write_config_file
from tests.test_signals import MPIEXEC, _rank_pids, _wait_for_metrics, finish_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
STALL_TIMEOUT = 5
FROZEN_STALL_TIMEOUT = 2
TARGETS = {"worker": 1, "server": 2, "launcher": None}
EXPECT = {signal.SIGTERM: 143, signal.SIGUSR1: 0}


def _rank_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env.get(b"PMI_RANK", env.get(b"OMPI_COMM_WORLD_RANK", b"-1")))


def _start(tmp_path, digits_h5, mode, name, stall_timeout=STALL_TIMEOUT):
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=100000, display=5, test_interval=0)
    cfg["checkpoint"] = {"interval": 0, "keep": 2}
    cfg["parallel"] = {"scheme": "data", "mode": mode, "ps_ranks": 1, "max_staleness": 1,
                       "stall_timeout": stall_timeout}
    path = write_config_file(tmp_path, cfg, f"{name}.yaml")
    out = str(tmp_path / name)
    cmd = [MPIEXEC, "-n", "3", PYTHON, "-m", "purine_mpi", "train", path, "--out", out]
    proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_for_metrics(out, time.time() + 50)
    ranks = {_rank_of(pid): pid for pid in _rank_pids(out)}
    assert sorted(ranks) == [0, 1, 2], ranks
    return proc, out, ranks, cmd


#: the cases of test_signal_stops_every_rank_with_one_checkpoint, in the
#: order signalled runs them
SIGNALLED = [(sig, target, mode) for sig in (signal.SIGTERM, signal.SIGUSR1)
             for target in sorted(TARGETS) for mode in ("async", "sync_ps")]


def _stopped(proc, ranks, sent, timeout):
    """(exit status, or None where the job still ran ``timeout`` s after
    the signal; stdout; stderr; seconds from the signal to the end); every
    rank and the launcher are killed afterwards."""
    try:
        stdout, stderr = finish_ranks(proc, ranks.values(), timeout)
    except subprocess.TimeoutExpired:
        return None, "", "", time.monotonic() - sent
    return proc.returncode, stdout, stderr, time.monotonic() - sent


@pytest.fixture(scope="module")
def signalled(tmp_path_factory, digits_h5):
    """{(signal, target, mode): (_stopped's figures, run folder, command)}
    of every case of test_signal_stops_every_rank_with_one_checkpoint: each
    case's 3-rank job signalled once it logged its first line, then waited
    for (at most 30 s from its own signal). Each case's job starts while
    the one before stops (the stop agreement, the checkpoint), two jobs at
    a time, each with its own run folder, ranks and launcher, as
    dead_or_frozen runs its cases; the test of each case reads its
    checkpoint and (a worker's SIGTERM) resumes it."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    tmp = tmp_path_factory.mktemp("signalled")
    results, waiting = {}, None
    with ThreadPoolExecutor(max_workers=2) as waiters:
        for case in SIGNALLED:
            sig, target, mode = case
            proc, out, ranks, cmd = _start(tmp, digits_h5, mode, f"{sig.name}-{target}-{mode}")
            try:
                os.kill(proc.pid if TARGETS[target] is None else ranks[TARGETS[target]], sig)
            finally:
                future = waiters.submit(_stopped, proc, ranks, time.monotonic(), 30)
            if waiting is not None:
                results[waiting[0]] = (waiting[1].result(),) + waiting[2:]
            waiting = (case, future, out, cmd)
        results[waiting[0]] = (waiting[1].result(),) + waiting[2:]
    return results


@pytest.mark.parametrize("mode", ["async", "sync_ps"])
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["TERM", "USR1"])
def test_signal_stops_every_rank_with_one_checkpoint(signalled, mode, target, sig):
    (returncode, stdout, stderr, took), out, cmd = signalled[sig, target, mode]
    print(f"{mode} {sig.name} to {target}: exit {returncode} in {took:.2f} s")
    assert returncode is not None, f"{sig.name} to the {target}: the job still ran 30 s later"
    assert returncode == EXPECT[sig], stderr[-3000:]
    assert f"stopping at iter" in stdout and "Traceback" not in stderr, stderr[-3000:]
    with h5py.File(os.path.join(out, "latest.h5"), "r") as f:
        stopped_at = int(f.attrs["iteration"])
        # the momenta live on the server: the checkpoint has them, and they moved
        momenta = {k: f["solver"][k]["momentum"][...] for k in ("conv1/weight", "fc1/weight")}
    assert all(np.abs(m).sum() > 0 for m in momenta.values())
    if target == "worker" and sig == signal.SIGTERM:  # the stop resumes and finishes
        res = subprocess.run(cmd + ["--resume", "auto", "--iters", str(stopped_at + 5)],
                             cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr[-3000:]
        with h5py.File(os.path.join(out, "latest.h5"), "r") as f:
            assert int(f.attrs["iteration"]) == stopped_at + 5


#: the cases of test_dead_or_frozen_rank_ends_the_job, in the order
#: dead_or_frozen runs them
DEAD_OR_FROZEN = [(sig, target, mode) for sig in (signal.SIGKILL, signal.SIGSTOP)
                  for target in ("worker", "server") for mode in ("async", "sync_ps")]


def _finish(proc, ranks, sent):
    """(exit status, or None where the job still ran FROZEN_STALL_TIMEOUT
    + 5 s after the signal; stderr; seconds from the signal to the end);
    every rank and the launcher are killed afterwards."""
    try:
        _, stderr = finish_ranks(proc, ranks.values(), FROZEN_STALL_TIMEOUT + 5)
    except subprocess.TimeoutExpired:
        return None, "", time.monotonic() - sent
    return proc.returncode, stderr, time.monotonic() - sent


@pytest.fixture(scope="module")
def dead_or_frozen(tmp_path_factory, digits_h5):
    """{(signal, target, mode): _finish's figures} of every case of
    test_dead_or_frozen_rank_ends_the_job: each case's 3-rank job killed or
    frozen in one rank, then waited for (at most the stall timeout + 5 s
    from its own signal). Each case's job starts while the one before,
    its rank dead or stopped, waits out its end (a frozen rank: the 2 s
    stall timeout, the others polling), two jobs at a time, each with its
    own run folder, ranks and launcher, as test_stall.py's trials run;
    what each case checks is unchanged (before: one case after the
    other, each start-up behind the previous end)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    tmp = tmp_path_factory.mktemp("dead_or_frozen")
    results, waiting = {}, None
    with ThreadPoolExecutor(max_workers=2) as waiters:
        for case in DEAD_OR_FROZEN:
            sig, target, mode = case
            proc, _, ranks, _ = _start(tmp, digits_h5, mode, f"{sig.name}-{target}-{mode}",
                                       FROZEN_STALL_TIMEOUT)
            try:
                os.kill(ranks[TARGETS[target]], sig)
            finally:
                future = waiters.submit(_finish, proc, ranks, time.monotonic())
            if waiting is not None:
                results[waiting[0]] = waiting[1].result()
            waiting = (case, future)
        results[waiting[0]] = waiting[1].result()
    return results


@pytest.mark.parametrize("mode", ["async", "sync_ps"])
@pytest.mark.parametrize("target", ["worker", "server"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["KILL", "STOP"])
def test_dead_or_frozen_rank_ends_the_job(dead_or_frozen, mode, target, sig):
    returncode, stderr, took = dead_or_frozen[sig, target, mode]
    print(f"{mode} {sig.name} to {target}: exit {returncode} in {took:.2f} s")
    assert returncode is not None, \
        f"{sig.name} to the {target}: the job still ran {FROZEN_STALL_TIMEOUT + 5} s later"
    assert returncode != 0
    if sig == signal.SIGSTOP:
        assert "stalled" in stderr or "no push" in stderr, stderr[-3000:]
