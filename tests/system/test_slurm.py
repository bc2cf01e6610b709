"""System test: a one-node SLURM cluster runs jobs/digits_lenet.sbatch with
two ranks through ``srun --mpi=pmi2`` (the recipe in shared/recipes).

Slow (starts slurmctld/slurmd); skipped when SLURM is not installed or we are
not root. CI installs Debian's slurm-wlm in .ci/run. The cluster is the
test's own: ports free when it starts (never fixed ones, which a SLURM of
the machine may hold), every file under the test's temporary folder (but
slurmd's spool, see ``short_spool``), and nothing left running or written
when it ends (a test checks)."""
import contextlib
import json
import random
import re
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

CONF = """ClusterName=purinetest
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
AuthInfo=cred_expire=10
CredType=cred/none
StateSaveLocation={d}/state
SlurmdSpoolDir={spool}
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmctldPort={port}
SlurmdPort={port2}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MailProg=/bin/true
FirstJobId={first_job}
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def free_port():
    """A TCP port of 127.0.0.1 that nothing listens on now (the kernel's pick
    for port 0): never a fixed one, which a SLURM of the machine's own, or
    a second test run, may hold."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _daemons(conf):
    """{pid: command line} of the processes started with our slurm.conf
    (``-f CONF`` on their command line)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if str(conf).encode() in argv:
            found[int(entry)] = b" ".join(argv).decode(errors="replace")
    return found


def _stop(pids, timeout=30):
    """SIGTERM ``pids``, wait for them to end, SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait
        while time.time() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        if not any(_alive(p) for p in pids):
            return


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"  # a zombie has ended
    except OSError:
        return False


# slurmd listens for each job step on a unix socket in its spool folder,
# "<node>_<job>.<step>" (localhost_59999999.4294967291: 30 characters), and a
# socket's path holds at most 107 bytes (sun_path). Under pytest-xdist the
# test's folder alone is ~80 (/tmp/pytest-of-root/pytest-223/popen-gw1/
# test_sbatch_two_ranks_trains_d0/slurm/spool): every launch failed
# (PENDING, launch_failed_requeued_held) and the job never ran.
SOCKET_NAME = "/localhost_59999999.4294967291"
SUN_PATH_MAX = 107


def short_spool():
    """A fresh folder for slurmd's spool whose step sockets' paths fit in
    ``sun_path`` wherever the test's own folder is (the caller removes it)."""
    spool = tempfile.mkdtemp(prefix="purine-slurmd-")
    if len(spool + SOCKET_NAME) > SUN_PATH_MAX:
        os.rmdir(spool)
        spool = tempfile.mkdtemp(prefix="ps-", dir="/tmp")
    assert len(spool + SOCKET_NAME) <= SUN_PATH_MAX, spool
    return spool


@contextlib.contextmanager
def one_node_cluster(d):
    """A throw-away one-node SLURM cluster whose every file is under the
    folder ``d`` (made here, removed at the end) but slurmd's spool (a short
    folder of its own, ``short_spool``, removed too): slurmctld and slurmd on
    ports free at start-up, started with ``-f d/slurm.conf``. Yields the
    environment that reaches it (SLURM_CONF). At the end every process
    started with that configuration is stopped (and waited for) and ``d``
    is deleted."""
    if not (shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("sbatch")):
        pytest.skip("SLURM (Debian slurm-wlm) is not installed")
    if os.geteuid() != 0:
        pytest.skip("the throw-away SLURM cluster runs its daemons as root")
    d = Path(d)
    conf = d / "slurm.conf"
    spool = short_spool()
    try:
        for attempt in range(3):  # a port taken between our pick and the daemon's bind
            shutil.rmtree(d, ignore_errors=True)
            (d / "state").mkdir(parents=True)
            shutil.rmtree(spool, ignore_errors=True)
            os.mkdir(spool)
            # job ids that no earlier cluster on this machine used: MPICH names a
            # job's shared memory after its PMI kvs ("<job>.<step>"), and a segment
            # left behind by a killed job 1 made the next cluster's job 1 hang in
            # MPI_Init (seen after killing a test run)
            first_job = random.SystemRandom().randrange(1000, 60_000_000)
            conf.write_text(CONF.format(d=d, spool=spool, cpus=max(2, os.cpu_count() or 2),
                                        port=free_port(),
                                        port2=free_port(), first_job=first_job))
            env = dict(os.environ, SLURM_CONF=str(conf))
            subprocess.run(["slurmctld", "-f", str(conf)], env=env, check=True)
            subprocess.run(["slurmd", "-f", str(conf), "-N", "localhost"], env=env, check=True)
            deadline = time.time() + 30
            while time.time() < deadline:
                out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                     text=True).stdout.strip()
                if out.startswith("idle"):
                    break
                time.sleep(0.2)
            else:
                log = (d / "slurmctld.log").read_text()[-2000:] \
                    if (d / "slurmctld.log").exists() else ""
                _stop(list(_daemons(conf)))
                if attempt < 2 and "Address already in use" in log:
                    continue
                pytest.fail("SLURM node never became idle: " + log)
            break
        yield env
    finally:
        _stop(list(_daemons(conf)))
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(spool, ignore_errors=True)


@pytest.fixture
def slurm_cluster(tmp_path):
    with one_node_cluster(tmp_path / "slurm") as env:
        yield env, tmp_path / "slurm"


def test_two_clusters_at_once_take_free_ports_and_leave_nothing_behind(tmp_path):
    """Two throw-away clusters side by side (two test runs on one machine, or
    a SLURM of the user's own on its usual ports) both come up, each on
    ports free at its start; at the end neither leaves a daemon, a file
    beside its folder, or a network namespace."""
    before_ns = subprocess.run(["ip", "netns", "list"], capture_output=True,
                               text=True).stdout if shutil.which("ip") else ""
    parents = [tmp_path / "a", tmp_path / "b"]
    for parent in parents:
        parent.mkdir()
    started, spools = {}, []
    with one_node_cluster(parents[0] / "slurm") as env_a, \
            one_node_cluster(parents[1] / "slurm") as env_b:
        ports = set()
        for env, parent in ((env_a, parents[0]), (env_b, parents[1])):
            conf = parent / "slurm" / "slurm.conf"
            ports |= set(re.findall(r"^Slurm(?:ctld|d)Port=(\d+)$", conf.read_text(), re.M))
            daemons = _daemons(conf)
            assert any("slurmctld" in c for c in daemons.values()), daemons
            assert any("slurmd" in c.split()[0] for c in daemons.values()), daemons
            started[conf] = daemons
            spool = re.search(r"^SlurmdSpoolDir=(.+)$", conf.read_text(), re.M).group(1)
            spools.append(spool)
            assert len(spool + SOCKET_NAME) <= SUN_PATH_MAX, spool
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                 text=True)
            assert out.stdout.strip().startswith("idle"), out.stderr
        assert len(ports) == 4, ports
    for conf, daemons in started.items():
        assert not [p for p in daemons if _alive(p)], daemons
        assert _daemons(conf) == {}
    for parent in parents:
        assert os.listdir(parent) == [], os.listdir(parent)
    assert len(set(spools)) == 2 and not any(os.path.exists(s) for s in spools), spools
    after_ns = subprocess.run(["ip", "netns", "list"], capture_output=True,
                              text=True).stdout if shutil.which("ip") else ""
    assert after_ns == before_ns


def test_sbatch_two_ranks_trains_digits(slurm_cluster, tmp_path):
    env, d = slurm_cluster
    work = tmp_path / "work"
    (work / "jobs").mkdir(parents=True)
    shutil.copy(REPO / "jobs" / "digits_lenet.yaml", work / "jobs")
    shutil.copy(REPO / "jobs" / "digits_lenet.sbatch", work / "jobs")
    env = dict(env, PURINE_PYTHON=sys.executable, PATH=os.path.dirname(sys.executable) + ":" +
               env.get("PATH", ""))
    job = subprocess.run(["sbatch", "--parsable", "--chdir", str(work), "jobs/digits_lenet.sbatch",
                          "--iters", "300", "--set", "solver.test_interval=0"],
                         env=env, capture_output=True, text=True, check=True)
    job_id = job.stdout.strip().split(";")[0]
    state = _wait_for_job(env, job_id, 240)
    assert state == "COMPLETED", state
    log = (work / f"purine-digits-{job_id}.out").read_text()
    records = [json.loads(line) for line in
               (work / "runs" / "digits_lenet_slurm" / "metrics.jsonl").read_text().splitlines()]
    tests = [r for r in records if r["phase"] == "test"]
    assert tests, log
    assert tests[-1]["accuracy"] >= 0.95, log
    ck = work / "runs" / "digits_lenet_slurm" / "latest.h5"
    import h5py
    with h5py.File(ck, "r") as f:
        assert f.attrs["world_size"] == 2
        assert f.attrs["iteration"] == 300


_FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                 "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def _job(env, job_id):
    """The job's ``scontrol show job`` fields, or None once SLURM has forgotten it.
    A transient failure of the controller (busy under load) is retried, never
    mistaken for a finished job."""
    for _ in range(20):
        q = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env,
                           capture_output=True, text=True)
        if q.returncode == 0 and "JobState=" in q.stdout:
            return dict(re.findall(r"(\w+)=(\S*)", q.stdout))
        if "Invalid job id" in q.stderr:
            return None
        time.sleep(0.5)
    raise AssertionError(f"scontrol show job {job_id} keeps failing: {q.stderr}")


def _wait_for_job(env, job_id, timeout, min_restarts=0):
    """Wait until the job reaches a final state and return it. A final state
    counts only once the job has been restarted ``min_restarts`` times.

    A requeued job waits in PENDING (reason BeginTime) for the credential
    lifetime before it may start again. The test cluster sets that to 10 s
    (``AuthInfo=cred_expire=10``; SLURM's default is 120 s). Releasing it
    sooner (``scontrol update StartTime=now``) races the node, which still
    holds the first start's revoked credential: "Killing non-startable batch
    job: Job credential revoked", state FAILED."""
    deadline = time.time() + timeout
    state, seen = None, []
    try:
        while time.time() < deadline:
            job = _job(env, job_id)
            if job is None:
                return state
            state = job["JobState"]
            step = (state, job.get("Reason"), job.get("Restarts"))
            if not seen or seen[-1] != step:
                seen.append(step)
            if state in _FINAL_STATES and int(job.get("Restarts", 0)) >= min_restarts:
                return state
            time.sleep(0.5)
        pytest.fail(f"SLURM job {job_id} did not finish in {timeout} s (state {state}; "
                    f"seen {seen})")
    finally:
        if state not in _FINAL_STATES:
            subprocess.run(["scancel", job_id], env=env)


def test_preempted_job_requeues_and_matches_uninterrupted_run(slurm_cluster, tmp_path):
    """A preemption notice mid-run (``scancel --signal=USR1 --batch``, what
    ``--signal=B:USR1@90`` sends before the time limit): the ranks checkpoint
    at a common iteration, the job requeues itself, the second start resumes
    from the checkpoint and finishes at iteration N, and its final weights
    equal an uninterrupted ``mpiexec -n 2`` run's bit for bit."""
    import h5py
    import numpy as np
    env, d = slurm_cluster
    work = tmp_path / "work"
    (work / "jobs").mkdir(parents=True)
    shutil.copy(REPO / "jobs" / "digits_lenet.yaml", work / "jobs")
    shutil.copy(REPO / "jobs" / "digits_lenet.sbatch", work / "jobs")
    env = dict(env, PURINE_PYTHON=sys.executable, PATH=os.path.dirname(sys.executable) + ":" +
               env.get("PATH", ""))
    iters = 600
    args = ["--iters", str(iters), "--set", "solver.display=10", "--set", "solver.test_interval=0"]
    job = subprocess.run(["sbatch", "--parsable", "--chdir", str(work), "jobs/digits_lenet.sbatch",
                          *args], env=env, capture_output=True, text=True, check=True)
    job_id = job.stdout.strip().split(";")[0]
    out = work / "runs" / "digits_lenet_slurm"
    log = work / f"purine-digits-{job_id}.out"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # preempt once it is well under way
            lines = (out / "metrics.jsonl").read_text().splitlines() \
                if (out / "metrics.jsonl").exists() else []
            if lines and json.loads(lines[-1])["iter"] >= 50:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the job never got going: " + (log.read_text() if log.exists() else ""))
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=env, check=True)
    except BaseException:
        subprocess.run(["scancel", job_id], env=env)
        raise
    state = _wait_for_job(env, job_id, 400, min_restarts=1)
    assert state == "COMPLETED", f"{state}: " + log.read_text()
    text = log.read_text()
    assert "SLURM_RESTART_COUNT=0" in text and "SLURM_RESTART_COUNT=1" in text, text
    assert "SLURM_RESTART_COUNT=2" not in text, text  # the finished run did not requeue
    stopped = [int(m) for m in re.findall(r"stopping at iter (\d+) on SIGUSR1", text)]
    assert len(stopped) == 1 and 50 <= stopped[0] < iters, text
    assert f"requeueing job {job_id}" in text
    with h5py.File(out / "latest.h5", "r") as f:
        assert f.attrs["iteration"] == iters
        resumed = {k: f["params"][k][...] for k in _param_names(f)}
    # the same run, uninterrupted
    ref = tmp_path / "ref"
    res = subprocess.run([shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or
                          "mpiexec", "-n", "2", sys.executable, "-m", "purine_mpi", "train",
                          "jobs/digits_lenet.yaml", "--out", str(ref), *args], cwd=work,
                         env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    with h5py.File(ref / "latest.h5", "r") as f:
        assert sorted(_param_names(f)) == sorted(resumed)
        for k in resumed:
            np.testing.assert_array_equal(f["params"][k][...], resumed[k], err_msg=k)


def _param_names(f):
    names = []
    f["params"].visititems(lambda n, o: names.append(n) if hasattr(o, "shape") else None)
    return names
