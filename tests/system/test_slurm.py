"""System test: a one-node SLURM cluster runs jobs/digits_lenet.sbatch with
two ranks through ``srun --mpi=pmi2`` (the recipe in shared/recipes).

Slow (starts slurmctld/slurmd); skipped when SLURM is not installed or we are
not root. CI installs Debian's slurm-wlm in .ci/run."""
import json
import os
import shutil
import subprocess
import sys
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
CredType=cred/none
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
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
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture
def slurm_cluster(tmp_path):
    if not (shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("sbatch")):
        pytest.skip("SLURM (Debian slurm-wlm) is not installed")
    if os.geteuid() != 0:
        pytest.skip("the throw-away SLURM cluster runs its daemons as root")
    d = tmp_path / "slurm"
    for sub in ("state", "spool"):
        (d / sub).mkdir(parents=True)
    conf = d / "slurm.conf"
    conf.write_text(CONF.format(d=d, cpus=max(2, os.cpu_count() or 2), port=16817, port2=16818))
    env = dict(os.environ, SLURM_CONF=str(conf))
    subprocess.run(["slurmctld"], env=env, check=True)
    subprocess.run(["slurmd", "-N", "localhost"], env=env, check=True)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                 text=True).stdout.strip()
            if out.startswith("idle"):
                break
            time.sleep(0.2)
        else:
            pytest.fail("SLURM node never became idle: " + (d / "slurmctld.log").read_text()[-2000:])
        yield env, d
    finally:
        for pid_file in ("slurmd.pid", "slurmctld.pid"):
            p = d / pid_file
            if p.exists():
                try:
                    os.kill(int(p.read_text().strip()), 15)
                except (ProcessLookupError, ValueError):
                    pass


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
    deadline = time.time() + 240
    while time.time() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job_id], env=env, capture_output=True, text=True)
        if not q.stdout.strip():
            break
        time.sleep(0.5)
    else:
        subprocess.run(["scancel", job_id], env=env)
        pytest.fail("the SLURM job did not finish in 240 s")
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
