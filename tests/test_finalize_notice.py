"""A rank waiting in MPI_Finalize for a peer that never finalizes ends on a
stop notice (SIGTERM: Slurm's before its SIGKILL, a user's ``kill PID``)
with its run's status, its files as written (comm/world.py,
``finalize_mpi``). Before: the notices were ignored from the end of
``train`` on and mpi4py's MPI_Finalize ran where no Python code runs, so
such a rank ended only by SIGKILL or Ctrl-C."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.mpi_scripts.launch import HERE, ROOT, mpiexec_args

pytestmark = pytest.mark.mpi


def _pid(path, deadline, what):
    """The pid written to ``path`` (whole: renamed into place)."""
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                return int(f.read())
        time.sleep(0.05)
    pytest.fail(f"{what}: {path} never appeared")


def _catches_sigterm(pid, deadline):
    """Wait until ``pid`` has a handler of SIGTERM (Linux: SigCgt in
    /proc/PID/status); elsewhere return at once."""
    status = f"/proc/{pid}/status"
    if not os.path.exists(status):
        return
    bit = 1 << (int(signal.SIGTERM) - 1)
    while time.monotonic() < deadline:
        with open(status) as f:
            caught = [line.split()[1] for line in f if line.startswith("SigCgt:")]
        if caught and int(caught[0], 16) & bit:
            return
        time.sleep(0.02)
    pytest.fail(f"rank 0 (pid {pid}) never caught SIGTERM again for MPI_Finalize")


@pytest.mark.parametrize("where", ["finalize", "window"])
def test_sigterm_ends_a_rank_hanging_in_mpi_finalize_with_its_status(tmp_path, where):
    """``window``: the rank waits in a finalize hook's MPI_Win_free (a
    collective) instead. Before, the hooks ran before the notices were
    watched: the SIGTERM was ignored, the job ran until the test's kill."""
    written = tmp_path / "ckpt.bin"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen(mpiexec_args(2) + [sys.executable, os.path.join(
        HERE, "finalize_hang.py"), str(written), where], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        rank0 = _pid(f"{written}.pid", deadline, "rank 0 reaching MPI_Finalize")
        # the pid is written while SIGTERM is ignored (ignore_late_notices):
        # a notice sent before finalize_mpi catches it again is lost, so
        # wait for that (the 1 s sleep alone leaves that to the scheduler)
        _catches_sigterm(rank0, deadline)
        time.sleep(1.0)  # inside MPI_Finalize: rank 1 never comes
        assert proc.poll() is None, "the job ended though rank 1 never finalized"
        os.kill(rank0, signal.SIGTERM)
        sent = time.monotonic()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("rank 0, in MPI_Finalize, still runs 20 s after SIGTERM")
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    # rank 0's 143 (the stop's status); Hydra's status ORs in rank 1's 9
    # (the launcher then kills the rank that never finalized): 143 | 9 == 143
    assert proc.returncode == 143, (proc.returncode, stdout[-1500:], stderr[-1500:])
    assert took < 10, took
    assert written.read_bytes() == b"written before MPI_Finalize\n" * 1000
