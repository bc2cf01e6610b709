"""``plan --choose`` stopped by a signal (issue 44): its calibration's
``train`` child (tools/choose.py ``_traced_run``: one rank, in a session of
its own) ends with it, and the child's run folder (``.calibration-*``
beside the calibration file) is removed. Before, a SIGTERM (``timeout``'s)
ended the parent by its default action, no clean-up: the child
(subprocess.run) trained on until its next line hit the closed pipe, and
its folder stayed in the user's tree (the SIGTERM case failed on the
folder's assertion, ``['.calibration-<key>-<pid>']``; the Ctrl-C case
passed: subprocess.run kills its child on KeyboardInterrupt)."""
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env

#: wide enough that the calibration's 8 iterations outlast the test's look
#: for the child (2048 x 2048 products at batch 256: about 0.3 s each here)
NET = """name: choose_signal_net
seed: 3
data:
  train: {source: synthetic, shape: [1, 32, 32], classes: 10, num_samples: 1024, batch_size: 256}
net:
  - {type: fc, name: fc1, bottom: data, top: fc1, num_output: 2048}
  - {type: relu, name: relu1, bottom: fc1, top: fc1}
  - {type: fc, name: fc2, bottom: fc1, top: fc2, num_output: 2048}
  - {type: relu, name: relu2, bottom: fc2, top: fc2}
  - {type: fc, name: fc3, bottom: fc2, top: fc3, num_output: 10}
  - {type: softmax_loss, name: loss, bottom: [fc3, label], top: loss}
solver: {type: sgd, base_lr: 0.01, momentum: 0.9, max_iter: 100, display: 1000}
parallel: {scheme: data}
"""


def _children(pid):
    """The PIDs whose parent is ``pid`` (/proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, read after its ')'
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry))
    return out


def _alive(pid):
    """Whether ``pid`` runs (a zombie, ended but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_choose_ends_its_calibration_child(tmp_path, sig):
    job = tmp_path / "job.yaml"
    job.write_text(NET)
    cal = tmp_path / "cal" / "calibration.json"
    status, err = _signal_the_calibration(
        [PYTHON, "-m", "purine_mpi", "plan", str(job), "--np", "2", "--choose",
         "--calibration", str(cal)], sig, "plan --choose",
        lambda pid: (_children(pid) or [None])[0], seen_within=60, ends_within=30,
        ready=_child_folder_in(cal.parent))
    # the parent ends as the signal asks: SIGTERM its default (-15, the
    # shell's 143), Ctrl-C the CLI's "interrupted" and 130
    if sig == signal.SIGTERM:
        assert status == -signal.SIGTERM, (status, err)
    else:
        assert status == 130 and "interrupted" in err, (status, err)
    # the child's run folder is gone, and no calibration file was written
    assert not cal.exists()
    left = [p.name for p in cal.parent.iterdir()] if cal.parent.exists() else []
    assert not [p for p in left if p.startswith(".calibration-")], left


def _descendants(pid):
    """Every PID under ``pid`` (children, theirs, ...: /proc)."""
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def _calibration_child(pid):
    """The PID of the calibration's ``train`` under ``pid`` (its command
    line has ``--profile-iters``), or None."""
    for p in _descendants(pid):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if b"--profile-iters" in f.read():
                    return p
        except OSError:
            pass
    return None


def _child_folder_in(folder):
    """A function: whether the calibration child has set up its run folder
    (``.calibration-*``, locked) in ``folder``: the child under way, its
    imports done and a folder of its own there for the parent to remove."""
    def ready():
        return folder.is_dir() and any(
            p.name.startswith(".calibration-") and (p / ".purine.lock").exists()
            for p in folder.iterdir())
    return ready


def _signal_the_calibration(argv, sig, what, find, seen_within, ends_within, preexec_fn=None,
                            ready=None):
    """``argv`` started, ``sig`` sent to it once ``find(its pid)`` names
    its calibration child (within ``seen_within`` s) and ``ready()`` says
    the child set up its run folder (the same time more), and 0.5 s on:
    (its status, its stderr) once it has ended (``ends_within`` s) and the
    child is gone (5 s given; asserted, ``what`` naming the parent). Before
    ``ready``, the signal came 0.5 s after the child was seen, in its
    launcher's ``execv`` or its imports: no calibration folder yet, so
    the assertions on it could not fail."""
    proc = subprocess.Popen(argv, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    try:
        child, deadline = None, time.monotonic() + seen_within
        while child is None and time.monotonic() < deadline and proc.poll() is None:
            child = find(proc.pid)
            time.sleep(0.05)
        assert child is not None, "the calibration's train child was never seen"
        deadline = time.monotonic() + seen_within
        while ready is not None and not ready() and time.monotonic() < deadline \
                and proc.poll() is None:
            time.sleep(0.05)
        assert ready is None or ready(), "the calibration child never set up its run folder"
        time.sleep(0.5)  # the child under way (its graph build, its iterations)
        assert _alive(child), "the calibration ended before the signal: make NET larger"
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=ends_within)
        ended = time.monotonic() + 5
        while _alive(child) and time.monotonic() < ended:
            time.sleep(0.05)
        assert not _alive(child), f"the calibration child {child} outlived {what}"
        return proc.returncode, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _signal_the_auto_choice(tmp_path, launch, sig, preexec_fn=None):
    """``train`` of NET under ``parallel.scheme: auto`` started by
    ``launch`` (the command before ``python -m purine_mpi``), ``sig`` sent
    to that process while the calibration's child runs: (its status, its
    stderr), once the child is gone and with no ``.calibration-*`` folder
    left in the run folder (asserted)."""
    job = tmp_path / "job.yaml"
    job.write_text(NET.replace("parallel: {scheme: data}", "parallel: {scheme: auto}"))
    out = tmp_path / "run"
    status, err = _signal_the_calibration(
        [*launch, PYTHON, "-m", "purine_mpi", "train", str(job), "--out", str(out),
         "--iters", "20"], sig, launch[0] if launch else "train", _calibration_child,
        seen_within=90, ends_within=60, preexec_fn=preexec_fn, ready=_child_folder_in(out))
    left = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert not [p for p in left if p.startswith(".calibration-")], left
    return status, err


def test_ctrl_c_under_mpiexec_ends_the_auto_choice_cleanly(tmp_path):
    """``parallel.scheme: auto`` under ``mpiexec -n 2`` (rank 0 calibrates,
    rank 1 waits for its choice), Ctrl-C to mpiexec (which passes SIGINT
    to every rank): 130, the calibration child gone when mpiexec returns,
    no ``.calibration-*`` folder left in the run folder. Before, rank 1
    aborted the job at once (``interrupted``, MPI_Abort) and rank 0 was
    killed within its child's grace: mpiexec returned 130 while the child
    still ran (this test's "outlived mpiexec" assertion), and the folder
    stayed: ``['.calibration-<key>-<pid>', '.purine.lock']``)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")

    def ctrl_c_only():  # a background job's SIGINT may be ignored: Ctrl-C reaches mpiexec
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    status, err = _signal_the_auto_choice(tmp_path, [MPIEXEC, "-n", "2"], signal.SIGINT,
                                          ctrl_c_only)
    assert status == 130, (status, err)
    assert "interrupted (SIGINT)" in err, err
    # the run folder made for the run that never began is removed, as one
    # rank's Ctrl-C (or SIGTERM) removes it. Before, rank 0's ``interrupted``
    # ended the job by MPI_Abort with no ``end_run``: the folder stayed,
    # holding its lock alone (``assert not ... ['.purine.lock']``)
    out = tmp_path / "run"
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_sigterm_during_the_auto_choice_ends_train_with_143(tmp_path):
    """``train`` under ``parallel.scheme: auto``, one rank, SIGTERM while
    its calibration child runs (a batch system's stop before the run
    began): the child ended and its folder removed, and ``train`` ends with
    143 as a SIGTERM anywhere else in ``train`` does. Before, the choice's
    UserError ended it with 2, a config error's status, and the line said
    "plan --choose:" inside ``train`` (this test: ``assert 2 == 143``).
    The run folder ``train`` made for the run that never began is removed,
    as a refused run's is (job/rundir.release_run_dirs). Before, it stayed
    holding its ``.purine.lock`` alone (``assert not ... ['.purine.lock']``)."""
    status, err = _signal_the_auto_choice(tmp_path, [], signal.SIGTERM)
    assert status == 143, (status, err)
    assert "stopped by SIGTERM" in err and "plan --choose:" not in err, err
    assert "Traceback" not in err, err
    out = tmp_path / "run"
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_a_child_killed_after_its_grace_leaves_no_shared_memory(monkeypatch):
    """``_end_group``: a calibration child still running after its grace is
    killed (SIGKILL), and the files under /dev/shm it mapped are removed
    (MPICH's singleton ``train`` keeps its ``mpich_shm_*`` segment named
    until MPI_Finalize, which SIGKILL never reaches), but not one another
    process maps too. Before, the segment stayed: ``plan --choose`` of a
    net whose iteration outlasts the 3 s grace, SIGTERM: /dev/shm/
    mpich_shm_21e9_0 (1 MiB) left (this test: its file still there)."""
    import mmap
    from purine_mpi.tools import choose
    shm = "/dev/shm/"
    if not os.path.isdir(shm):
        pytest.skip("no /dev/shm")
    monkeypatch.setattr(choose, "CHILD_GRACE_S", 0.3)
    own = f"{shm}purine_test_own_{os.getpid()}"
    shared = f"{shm}purine_test_shared_{os.getpid()}"
    code = ("import mmap, os, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"  # a stop slower than the grace
            "maps = []\n"
            "for name in sys.argv[1:]:\n"
            "    fd = os.open(name, os.O_CREAT | os.O_RDWR, 0o600)\n"
            "    os.ftruncate(fd, 4096)\n"
            "    maps.append(mmap.mmap(fd, 4096))\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([PYTHON, "-c", code, own, shared], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    held = None
    try:
        assert proc.stdout.readline().strip() == "ready"
        fd = os.open(shared, os.O_RDWR)  # this process maps it too: it must stay
        held = mmap.mmap(fd, 4096)
        os.close(fd)
        choose._end_group(proc, False)
        assert proc.returncode == -signal.SIGKILL
        assert not os.path.exists(own), "the killed child's shared memory stayed"
        assert os.path.exists(shared), "a file another process maps was removed"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if held is not None:
            held.close()
        for name in (own, shared):
            if os.path.exists(name):
                os.unlink(name)


def test_a_signal_as_the_child_starts_still_ends_it(monkeypatch):
    """``_run_child``: a SIGTERM whose handler runs after the child was
    started but before ``_run_child`` holds it (inside ``Popen``, or between
    its return and the assignment) is passed on to the child's group once
    it is held, and the group ended. Before, the handler raised at once,
    the Popen object was lost with it, and the child ran on, outside the
    group ``_end_group`` ends (this test: the child still alive)."""
    from purine_mpi.tools import choose
    monkeypatch.setattr(choose, "CHILD_GRACE_S", 0.5)
    real, started = subprocess.Popen, []

    def popen(*args, **kwargs):
        proc = real(*args, **kwargs)
        started.append(proc)
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before this returns
        for _ in range(1000):
            pass
        return proc
    monkeypatch.setattr(choose.subprocess, "Popen", popen)
    try:
        with pytest.raises(choose._Forwarded) as got:
            choose._run_child([PYTHON, "-c", "import time; time.sleep(60)"], dict(os.environ))
        assert got.value.signum == signal.SIGTERM
        assert len(started) == 1
        child = started[0]
        deadline = time.monotonic() + 5
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.poll() is not None, "the child started as the signal came ran on"
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def test_the_calibration_child_dies_with_a_killed_parent(tmp_path):
    """``plan --choose`` killed outright (SIGKILL: ``kill -9``, the OOM
    killer, mpiexec's second Ctrl-C on ``parallel.scheme: auto``'s rank 0)
    can pass nothing on: the child, in a session of its own, is ended by
    the kernel at once (SIGKILL, Linux's parent-death signal: ``_run_child``),
    writing nothing more; its folder stays (nothing is left to remove it).
    Before, the orphan ran on until its next line met the closed pipe, then
    stopped as on SIGTERM, with a checkpoint: this test's net, ``ckpt_1.h5``
    and ``latest.h5`` (50 MB) in the folder left (the assertion on the
    ``.h5`` files); mpiexec's double Ctrl-C on rank 0's auto choice of a
    6144-wide net: 353 MB in OUT/.calibration-*."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc")
    job = tmp_path / "job.yaml"
    job.write_text(NET)
    cal = tmp_path / "cal" / "calibration.json"
    proc = subprocess.Popen([PYTHON, "-m", "purine_mpi", "plan", str(job), "--np", "2",
                             "--choose", "--calibration", str(cal)],
                            cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    child = None
    try:
        deadline = time.monotonic() + 60
        while child is None and time.monotonic() < deadline and proc.poll() is None:
            child = _calibration_child(proc.pid)
            time.sleep(0.02)
        assert child is not None, "the calibration's train child was never seen"
        time.sleep(0.5)
        assert _alive(child), "the calibration ended before the kill: make NET larger"
        proc.kill()
        proc.wait()
        ended = time.monotonic() + 5
        while _alive(child) and time.monotonic() < ended:
            time.sleep(0.05)
        assert not _alive(child), f"the calibration child {child} outlived its killed parent"
        written = [p.name for p in cal.parent.glob(".calibration-*/*.h5")]
        assert not written, written
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
