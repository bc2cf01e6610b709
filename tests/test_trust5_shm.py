"""Issue 42, doubt on /dev/shm: where our own abort path ends a job -- a
user error on one rank after MPI_Init, an uncaught exception, the stall
watchdog, a second Ctrl-C -- nothing of the MPI library's stays in
/dev/shm. MPICH removes its node segment (``mpich_shm_<hex>_<n>``, 2-4 MiB)
in MPI_Finalize only; MPI_Abort and ``os._exit`` left it for good, until
comm/world.py's ``remove_mpi_shm`` unlinked it first. The job's own
segments are told from other jobs' (the machine is shared) by reading the
ranks' memory maps while the job runs."""
import json
import os
import signal
import subprocess
import time

import pytest

from purine_mpi.comm.mpi_init import MPI_SHM_PREFIXES

from tests.conftest import PYTHON, REPO, cli_env, small_net_config, write_config_file
from tests.test_signals import MPIEXEC, _rank_pids, _wait_for_metrics, finish_ranks

pytestmark = pytest.mark.mpi
SCRIPT = os.path.join(REPO, "tests", "mpi_scripts", "shm_abort.py")


def _mapped(pids):
    """The MPI library's /dev/shm segments the processes ``pids`` map (their
    names, also of those already unlinked)."""
    names = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f.read().splitlines():
                    fields = line.split(None, 5)
                    if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                        # a train's World unlinks its segment once every rank
                        # mapped it (comm/world.py): "(deleted)", still the job's
                        name = os.path.basename(fields[5]).replace(" (deleted)", "")
                        if name.startswith(MPI_SHM_PREFIXES):
                            names.add(name)
        except OSError:
            pass
    return names


def _left(names):
    return sorted(n for n in names if os.path.exists(os.path.join("/dev/shm", n)))


@pytest.mark.parametrize("mode, status", [("one", 2), ("plain", 1), ("interrupt", 130),
                                          ("all", 2)])
def test_an_abort_leaves_nothing_in_dev_shm(mode, status):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    res = subprocess.run([MPIEXEC, "-n", "2", PYTHON, SCRIPT, mode], cwd=REPO, env=cli_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == status, res.stderr[-2000:]
    names = set()
    for line in res.stdout.splitlines():
        if line.startswith("SHM "):
            names |= set(json.loads(line[4:]))
    assert names, res.stdout  # the job had its segment (else this proves nothing)
    time.sleep(0.5)  # the launcher has reaped every rank
    assert _left(names) == [], f"{mode}: left in /dev/shm: {_left(names)}"


@pytest.mark.slow
def test_the_stall_watchdog_leaves_nothing_in_dev_shm(tmp_path, digits_h5):
    """A rank stopped with SIGSTOP: the other's watchdog aborts the job."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=100000, display=5, test_interval=0)
    cfg["checkpoint"] = {"interval": 0, "keep": 2}
    cfg["parallel"] = {"stall_timeout": 2}
    out = str(tmp_path / "run")
    proc = subprocess.Popen([MPIEXEC, "-n", "2", PYTHON, "-m", "purine_mpi", "train",
                             write_config_file(tmp_path, cfg), "--out", out], cwd=REPO,
                            env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    pids = []
    try:
        _wait_for_metrics(out, time.time() + 90)
        pids = sorted(_rank_pids(out))
        names = _mapped(pids)
        assert len(pids) == 2 and names, (pids, names)
        os.kill(pids[1], signal.SIGSTOP)
    finally:
        _, stderr = finish_ranks(proc, pids, 30)
    assert proc.returncode not in (0, None) and "stalled" in stderr, stderr[-2000:]
    time.sleep(0.5)
    assert _left(names) == [], f"left in /dev/shm: {_left(names)}"
