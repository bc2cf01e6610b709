"""Fault audit of multi-rank training (session 66, trustkill): faults of
scheme x role that tests/test_signals.py, test_ps_stop.py, test_rma_faults.py,
test_stall.py and test_sharded_more.py leave out.

A stop notice that comes again once the stop's checkpoint is written (a
launcher or a batch system that repeats SIGTERM to every rank, as scancel
after a --signal notice does) must not kill a rank on its way out: the job
ends with the stop's status (143), not MPICH's "YOUR APPLICATION TERMINATED
... (signal 15)" and 15. Before: Python's shutdown puts back the default
action of the signals it caught, and MPI_Finalize (mpi4py's, at exit) runs
after that, so a notice in that window killed the rank."""
import os
import signal
import subprocess
import time

import h5py
import pytest

from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env, small_net_config, write_config_file
from tests.test_signals import _rank_pids, _wait_for_metrics, kill_ranks

pytestmark = [pytest.mark.mpi]


def _two_ranks_training(tmp_path, digits_h5, **sections):
    """A long 2-rank run of the small net (``sections`` replace its config
    sections) under mpiexec, started and past its first metrics row:
    (mpiexec's Popen, the run folder, the ranks' pids)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=100000, display=5, test_interval=0)
    cfg.update(sections)
    path = write_config_file(tmp_path, cfg)
    out = str(tmp_path / "run")
    cmd = [MPIEXEC, "-n", "2", PYTHON, "-m", "purine_mpi", "train", path, "--out", out]
    proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        _wait_for_metrics(out, time.time() + 60)
        pids = _rank_pids(out)
        assert len(pids) == 2, pids
    except BaseException:
        kill_ranks(proc, pids)
        raise
    return proc, out, pids


def test_term_repeated_to_every_rank_after_the_stop_ends_143(tmp_path, digits_h5):
    proc, out, pids = _two_ranks_training(
        tmp_path, digits_h5, checkpoint={"interval": 0, "keep": 2},
        parallel={"scheme": "sharded", "shard": 3, "stall_timeout": 10})
    try:
        os.kill(max(pids), signal.SIGTERM)  # the notice, to one rank
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # then again and again, to every rank, until the job ends
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        kill_ranks(proc, pids)
    assert "stopping at iter" in stdout, stderr[-2000:]
    assert "TERMINATED" not in stdout, stdout[-600:]
    assert proc.returncode == 143, (proc.returncode, stderr[-2000:])
    with h5py.File(os.path.join(out, "latest.h5"), "r") as f:
        assert int(f.attrs["iteration"]) > 0


def test_resume_auto_takes_the_complete_checkpoint_newer_than_latest(tmp_path, digits_h5):
    """A rank killed between the rename of ckpt_<iter>.h5 and that of
    latest.h5 (seen under kill -9 of 2-rank data and 3-rank sync_ps runs,
    2 kills of about 60) left a complete checkpoint newer than latest.h5.
    Before: --resume auto took latest.h5, redid the iterations between and
    deleted the newer file as a replaced continuation ("resumed from
    .../latest.h5 at iteration 2")."""
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=4, display=1)
    cfg["checkpoint"] = {"interval": 2, "keep": 0}
    path = write_config_file(tmp_path, cfg)
    out = str(tmp_path / "run")
    cmd = [PYTHON, "-m", "purine_mpi", "train", path, "--out", out]
    res = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    latest = os.path.join(out, "latest.h5")
    os.remove(latest)  # as the writer left it: latest.h5 still ckpt_2.h5
    os.link(os.path.join(out, "ckpt_2.h5"), latest)
    with open(os.path.join(out, "ckpt_4.h5"), "rb") as f:
        written = f.read()
    res = subprocess.run(cmd + ["--resume", "auto", "--iters", "6"], cwd=REPO, env=cli_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "at iteration 4" in res.stdout, res.stdout[-2000:]
    assert "complete and newer than latest.h5 (iteration 2)" in res.stdout + res.stderr
    with open(os.path.join(out, "ckpt_4.h5"), "rb") as f:
        assert f.read() == written  # kept as it was, not written again
    with h5py.File(latest, "r") as f:
        assert int(f.attrs["iteration"]) == 6


def _mpich_segments(pid):
    """The /dev/shm/mpich_shm_* files process ``pid`` maps (their names)."""
    with open(f"/proc/{pid}/maps") as f:
        paths = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
    return {p.replace(" (deleted)", "") for p in paths if p.startswith("/dev/shm/mpich_shm_")}


def test_kill_9_of_a_rank_leaves_nothing_in_dev_shm(tmp_path, digits_h5):
    """kill -9 of one rank (Hydra then kills the others with SIGKILL: no
    code of ours runs) left the job's MPICH segment /dev/shm/mpich_shm_*
    (2-4 MiB) for good, one a killed job and node. Now its name goes once
    every rank has mapped it (World's first collective)."""
    proc, out, pids = _two_ranks_training(tmp_path, digits_h5)
    try:
        segments = set().union(*(_mpich_segments(pid) for pid in pids))
        os.kill(max(pids), signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        kill_ranks(proc, pids)
    assert proc.returncode != 0
    assert segments, "the ranks map no MPICH segment: nothing to check"
    assert not [p for p in segments if os.path.exists(p)]


def test_resume_auto_never_takes_back_a_replaced_continuation(tmp_path):
    """A run resumed on purpose from an earlier checkpoint (``--resume
    ckpt_1000.h5``) and killed after its first checkpoint became latest.h5
    but before the rotation deleted the continuation it replaced
    (save_run_checkpoint: write, link latest.h5, rotate) leaves that
    continuation's ckpt_2000/3000.h5, of the same run and newer in
    iteration than latest.h5 (1500), but written before it. --resume auto
    must continue from latest.h5, not bring the replaced continuation back."""
    import numpy as np
    from purine_mpi.job.checkpoint_file import save_checkpoint
    from purine_mpi.job.run_checkpoints import find_resumable, save_run_checkpoint, write_latest
    out = str(tmp_path)
    params = {"w": np.arange(4, dtype=np.float32)}
    for it in (1000, 2000, 3000):
        save_run_checkpoint(out, it, keep=0, params=params, run_id="r1")
    time.sleep(0.05)  # the resumed run writes later (file times of a coarse file system)
    path = os.path.join(out, "ckpt_1500.h5")
    save_checkpoint(path, params, iteration=1500, run_id="r1")
    write_latest(out, path)  # killed here, before rotate_checkpoints
    found, ck = find_resumable(out)
    assert ck.iteration == 1500, found
