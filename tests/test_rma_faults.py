"""Faults over windows (issue 34): the parameter servers' one-sided epochs
end promptly when a worker or the server dies (kill -9), a frozen rank
(SIGSTOP) makes the stall watchdog name the window op its peer waits in,
and SIGTERM frees the windows on every rank (``PURINE_DEBUG_WINDOWS=1``:
each rank's free says so) for the pipeline and the parameter servers."""
import os
import re
import signal
import subprocess
import time

import pytest

from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env, small_net_config, write_config_file
from tests.test_ps_stop import _rank_of
from tests.test_rma_pipeline import _config as _pipeline_config
from tests.test_signals import _rank_pids, _wait_for_metrics, finish_ranks

pytestmark = pytest.mark.mpi
#: the ops a rank waits in over the parameter servers' windows
WINDOW_OPS = ("(WaitWrite, WaitWrite", "(Get, Get", "(Put, Put", "(WaitFree, WaitFree",
              "(Publish, Publish")


def _start(tmp_path, digits_h5, mode, stall_timeout=30, env=None, name="run", batch=16):
    """A 3-rank PS run over shared windows (workers 0 and 1, server 2) or,
    ``mode`` "pipeline", a 2-stage pipeline over them; returns once it
    trains: (proc, out, {rank: pid})."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    out = str(tmp_path / name)
    if mode == "pipeline":
        cfg, n = _pipeline_config(tmp_path, digits_h5, iters=100000, transport="one_sided",
                                  stall_timeout=stall_timeout), 2
    else:
        data = small_net_config(digits_h5)
        data["solver"].update(max_iter=100000, display=5, test_interval=0)
        data["data"]["train"]["batch_size"] = batch
        data["checkpoint"] = {"interval": 0, "keep": 2}
        data["parallel"] = {"scheme": "data", "mode": mode, "ps_ranks": 1, "max_staleness": 1,
                            "stall_timeout": stall_timeout, "transport": "one_sided"}
        cfg, n = write_config_file(tmp_path, data, f"{name}.yaml"), 3
    proc = subprocess.Popen([MPIEXEC, "-n", str(n), PYTHON, "-m", "purine_mpi", "train", cfg,
                             "--out", out], cwd=REPO, env={**cli_env(), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_metrics(out, time.time() + 60)
    time.sleep(0.2)  # mid-run: puts, gets and waits in flight
    ranks = {_rank_of(pid): pid for pid in _rank_pids(out)}
    assert sorted(ranks) == list(range(n)), ranks
    return proc, out, ranks


@pytest.mark.parametrize("mode,victim", [("sync_ps", 1), ("sync_ps", 2), ("async", 0),
                                         ("async", 2)],
                         ids=["sync_ps-worker", "sync_ps-server", "async-worker", "async-server"])
def test_kill_9_ends_every_rank_promptly(tmp_path, digits_h5, mode, victim):
    """kill -9 of a worker or of the server mid-epoch: every rank ends at
    once (the launcher sees the death), long before the 30 s watchdog."""
    proc, out, ranks = _start(tmp_path, digits_h5, mode)
    killed = time.monotonic()
    os.kill(ranks[victim], signal.SIGKILL)
    finish_ranks(proc, ranks.values(), 30)
    took = time.monotonic() - killed
    print(f"{mode}: kill -9 of rank {victim}: the job ended {took:.2f} s later")
    assert proc.returncode not in (0, None)
    assert took < 5  # under 1 s on a quiet machine
    assert not _rank_pids(out), "a rank outlived the job"


@pytest.mark.parametrize("mode,victim", [("sync_ps", 1), ("sync_ps", 2), ("async", 2)],
                         ids=["sync_ps-worker", "sync_ps-server", "async-server"])
def test_sigstop_watchdog_names_the_window_op(tmp_path, digits_h5, mode, victim):
    """SIGSTOP of a worker or of the server: a peer's watchdog ends the job
    naming the window op it waits in and its region ``ps/...`` (a trial
    that freezes a rank between iterations names the stop agreement
    instead, and is tried again, up to 8 times; a large batch makes the
    iterations long beside the agreement)."""
    for trial in range(8):
        proc, _out, ranks = _start(tmp_path, digits_h5, mode, stall_timeout=2,
                                   name=f"t{trial}", batch=512)
        os.kill(ranks[victim], signal.SIGSTOP)
        _, stderr = finish_ranks(proc, ranks.values(), 30)
        assert proc.returncode not in (0, None)
        assert "stalled for more than 2 s" in stderr, stderr[-3000:]
        if any(w in stderr for w in WINDOW_OPS):
            break
    assert any(w in stderr for w in WINDOW_OPS), stderr[-3000:]
    assert re.search(r"window shared region ps/\S+", stderr), stderr[-3000:]


@pytest.mark.parametrize("mode", ["pipeline", "sync_ps", "async"])
def test_sigterm_frees_the_windows_on_every_rank(tmp_path, digits_h5, mode):
    """SIGTERM to rank 1 mid-epoch: every rank stops with a checkpoint
    (exit 143) and frees its windows on the way out, and the MPI library
    says nothing."""
    proc, out, ranks = _start(tmp_path, digits_h5, mode, env={"PURINE_DEBUG_WINDOWS": "1"})
    os.kill(ranks[1], signal.SIGTERM)
    stdout, stderr = finish_ranks(proc, ranks.values(), 60)
    assert proc.returncode == 143, stderr[-3000:]
    assert "stopping at iter" in stdout and os.path.exists(os.path.join(out, "latest.h5"))
    freed = re.findall(r"^rank (\d+): windows freed \(shared\)$", stderr, re.M)
    assert sorted(set(map(int, freed))) == sorted(ranks), stderr[-3000:]
    assert "warning" not in stderr.lower() and "leak" not in stderr.lower(), stderr[-3000:]
