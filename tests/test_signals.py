"""SIGUSR1 (SLURM's pre-time-limit warning) or SIGTERM to any one rank stops
every rank at the same iteration with a checkpoint; the run resumes from it."""
import json
import os
import signal
import subprocess
import time

import h5py
import pytest

from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env, small_net_config, write_config_file



def kill_ranks(proc, pids):
    """SIGKILL every rank process and the launcher (a test's clean-up)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def sigstop_and_wait(proc, pid, timeout, trial, who):
    """Freeze ``pid`` (``who``, e.g. "rank 1") with SIGSTOP, then wait at
    most ``timeout`` seconds for the job to end: (stdout, stderr, seconds
    from the stop to the end); fails the test, naming the trial, when the
    job still runs."""
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"trial {trial}: {who} stopped, the job still runs {timeout} s later")
    return stdout, stderr, time.monotonic() - stopped


def finish_ranks(proc, pids, timeout):
    """The launcher's (stdout, stderr) within ``timeout`` seconds; every
    rank and the launcher are killed afterwards, however it ended."""
    try:
        return proc.communicate(timeout=timeout)
    finally:
        kill_ranks(proc, pids)


def _rank_pids(marker, program="purine_mpi"):
    """PIDs of the python ranks whose command line contains ``marker`` (and
    ``program``: the module, or a test script that runs it)."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if marker.encode() in b" ".join(cmd) and program.encode() in b" ".join(cmd) \
                and not os.path.basename(cmd[0]).startswith(b"mpiexec") \
                and b"hydra" not in cmd[0]:
            pids.append(int(pid))
    return pids


def _wait_for_metrics(out, deadline):
    path = os.path.join(out, "metrics.jsonl")
    while time.time() < deadline:
        if os.path.exists(path) and os.path.getsize(path) > 0:
            return
        time.sleep(0.05)
    raise AssertionError("training never logged a line")


@pytest.mark.mpi
@pytest.mark.parametrize("sig,status", [(signal.SIGUSR1, 0), (signal.SIGTERM, 143)])
def test_signal_to_one_rank_stops_all_with_checkpoint(tmp_path, digits_h5, sig, status):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=100000, display=5, test_interval=0)
    cfg["checkpoint"] = {"interval": 0, "keep": 2}
    path = write_config_file(tmp_path, cfg)
    out = str(tmp_path / f"run-{sig.name}")
    cmd = [MPIEXEC, "-n", "2", PYTHON, "-m", "purine_mpi", "train", path, "--out", out]
    proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_metrics(out, time.time() + 60)
        pids = _rank_pids(out)
        assert len(pids) == 2, pids
        os.kill(max(pids), sig)  # one rank only
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == status, stderr
    assert "stopping at iter" in stdout
    with h5py.File(os.path.join(out, "latest.h5"), "r") as f:
        stopped_at = int(f.attrs["iteration"])
        assert 0 < stopped_at < 100000
        assert f.attrs["world_size"] == 2
    # resume continues from there and finishes
    res = subprocess.run(cmd + ["--resume", "auto", "--iters", str(stopped_at + 5)], cwd=REPO,
                         env=cli_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    with h5py.File(os.path.join(out, "latest.h5"), "r") as f:
        assert int(f.attrs["iteration"]) == stopped_at + 5
    iters = [json.loads(line)["iter"] for line in open(os.path.join(out, "metrics.jsonl"))
             if json.loads(line)["phase"] == "train"]
    assert iters == sorted(set(iters))  # no iteration logged twice


def _catches(pid, sig):
    """Whether process ``pid`` has a handler installed for ``sig``."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (sig - 1) & 1)


def test_notice_during_start_up_stops_after_the_first_iteration(tmp_path, digits_h5):
    """SLURM may send the preemption notice while a (requeued) step is still
    starting: at the first moment ``train`` catches SIGUSR1, the notice stops
    it cleanly after one iteration with a checkpoint."""
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=100000, display=0, test_interval=0)
    path = write_config_file(tmp_path, cfg)
    out = str(tmp_path / "early")
    proc = _start_train(path, out)
    try:
        deadline = time.time() + 30
        while not _catches(proc.pid, signal.SIGUSR1):
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGUSR1)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert "stopping at iter 1 on SIGUSR1" in stdout, stdout
    with h5py.File(os.path.join(out, "latest.h5"), "r") as f:
        assert int(f.attrs["iteration"]) == 1


def test_train_catches_a_notice_before_the_trainer_exists(monkeypatch, tmp_path, digits_h5):
    """``train`` installs its handlers before the slow imports and the graph
    build: a notice that arrives then is kept for the trainer's agreement."""
    import purine_mpi.train.trainer as trainer_module
    from purine_mpi.cli import main
    from purine_mpi.runtime.stop import StopSignal
    seen = {}

    def fake_run_training(config, out_dir, **kw):
        os.kill(os.getpid(), signal.SIGUSR1)
        seen["early"] = StopSignal.early
        return 0

    monkeypatch.setattr(trainer_module, "run_training", fake_run_training)
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    signal.signal(signal.SIGUSR1, lambda *a: seen.setdefault("not caught by train", True))
    try:
        path = write_config_file(tmp_path, small_net_config(digits_h5))
        assert main(["train", path, "--out", str(tmp_path / "o")]) == 0
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        StopSignal.early = None
    assert seen == {"early": "SIGUSR1"}


def _start_train(path, out):
    """``python -m purine_mpi train PATH --out OUT`` in the background, its
    output piped."""
    return subprocess.Popen([PYTHON, "-m", "purine_mpi", "train", path, "--out", out], cwd=REPO,
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _long_run(tmp_path, digits_h5, name):
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=100000, display=5, test_interval=0)
    cfg["checkpoint"] = {"interval": 0, "keep": 2}
    return write_config_file(tmp_path, cfg), str(tmp_path / name)


def test_ctrl_c_stops_with_a_checkpoint(tmp_path, digits_h5):
    """Issue 21, case 11: Ctrl-C checkpoints like SIGTERM (exit 130) and says
    how to resume; nothing is lost."""
    path, out = _long_run(tmp_path, digits_h5, "int")
    proc = _start_train(path, out)
    try:
        _wait_for_metrics(out, time.time() + 60)
        os.kill(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "--resume auto" in stderr + stdout, stderr
    assert stderr.count("interrupted") == 1, stderr
    with h5py.File(os.path.join(out, "latest.h5"), "r") as f:
        assert 0 < int(f.attrs["iteration"]) < 100000


@pytest.mark.mpi
def test_ctrl_c_under_mpiexec_stops_every_rank_with_one_checkpoint(tmp_path, digits_h5):
    """The terminal sends Ctrl-C to mpiexec and the ranks: every rank stops at
    the same iteration, one checkpoint, one message."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    path, out = _long_run(tmp_path, digits_h5, "int2")
    proc = subprocess.Popen([MPIEXEC, "-n", "2", PYTHON, "-m", "purine_mpi", "train", path,
                             "--out", out], cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_metrics(out, time.time() + 60)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the whole group
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, (proc.returncode, stderr)
    assert stdout.count("stopping at iter") == 1 and "--resume auto" in stdout, stdout
    assert "Traceback" not in stderr and stderr.count("interrupted") == 1, stderr
    with h5py.File(os.path.join(out, "latest.h5"), "r") as f:
        assert 0 < int(f.attrs["iteration"]) < 100000 and f.attrs["world_size"] == 2


def test_broken_pipe_stops_with_a_checkpoint_and_is_not_success(tmp_path, digits_h5):
    """``train ... | head -n 1``: the run stops with a checkpoint, exit 141."""
    path, out = _long_run(tmp_path, digits_h5, "pipe")
    proc = _start_train(path, out)
    try:
        _wait_for_metrics(out, time.time() + 60)
        proc.stdout.readline()
        proc.stdout.close()  # as `head -n 1` does
        stderr = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 141, (proc.returncode, stderr)
    assert "Traceback" not in stderr and "broken pipe" in stderr and "--resume auto" in stderr
    with h5py.File(os.path.join(out, "latest.h5"), "r") as f:
        assert 0 < int(f.attrs["iteration"]) < 100000
