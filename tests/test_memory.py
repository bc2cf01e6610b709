"""Flat memory (issue 12): a long run of a tiny net must not grow. A thread
per iteration in the data prefetch grew the native heap by ~300 bytes per
iteration once MPI was initialised, and the display window kept every loss
when display was off."""
import json
import subprocess

import pytest

from .conftest import PYTHON, REPO, cli_env

SCRIPT = r"""
import json, os, sys, threading, time
from purine_mpi.job.config import resolve_job
from purine_mpi.train.collectives import get_world
from purine_mpi.train.trainer import Trainer

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

job = resolve_job({
    "name": "mem",
    "data": {"train": {"source": "synthetic", "shape": [1, 4, 4], "classes": 3,
                       "batch_size": 2, "num_samples": 64}},
    "net": [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1", "num_output": 3},
            {"type": "softmax_loss", "name": "loss", "bottom": ["fc1", "label"],
             "top": "loss"}],
    "solver": {"base_lr": 0.01, "max_iter": 20000, "display": 0, "test_interval": 0},
    "checkpoint": {"interval": 0, "keep": 1}}, check_files=False)
trainer = Trainer(job, sys.argv[1], world=get_world())  # MPI initialised, as under `train`
samples = []
def sample():
    while True:
        samples.append((int(trainer.ws["iter"]), rss()))
        time.sleep(0.05)
threading.Thread(target=sample, daemon=True).start()
trainer.run()  # its end (evaluation, checkpoint: h5py loads) is not sampled below
print(json.dumps(samples))
"""


@pytest.mark.slow
def test_rss_stays_flat_over_20k_iterations(tmp_path):
    res = subprocess.run([PYTHON, "-c", SCRIPT, str(tmp_path / "run")], cwd=REPO,
                         env=cli_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    samples = json.loads(res.stdout.splitlines()[-1])
    during = [(it, rss) for it, rss in samples if 2000 <= it < 19900]  # after warm-up
    assert during[-1][0] > 15000, samples
    growth = max(rss for _, rss in during) - during[0][1]
    assert growth < 2 << 20, (f"RSS grew {growth} bytes from iteration {during[0][0]} to "
                              f"{during[-1][0]}")
