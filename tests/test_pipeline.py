"""Pipeline (model) parallelism: the digits net cut across ranks by layer
trains bit-identically to one rank; ``graph --np`` shows each slice."""
import os
import subprocess

import h5py
import numpy as np
import pytest
import yaml

from tests.conftest import (MPIEXEC, PYTHON, REPO, cli_env, run_cli_args, run_cli_here,
                            write_config_file)



def _config(digits_h5, tmp_path, iters=60):
    with open(os.path.join(REPO, "jobs", "digits_pipeline.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg["data"]["train"]["path"] = cfg["data"]["test"]["path"] = digits_h5
    cfg["solver"].update(max_iter=iters, display=10, test_interval=0)
    return write_config_file(tmp_path, cfg)


def _params(path):
    with h5py.File(path, "r") as f:
        out = {}
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) and not name.startswith("state") else None)
        return out


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_pipeline_matches_one_rank(tmp_path, digits_h5, ranks):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    cfg = _config(digits_h5, tmp_path)
    if ranks == 3:  # conv1 | fc1 | fc2 + loss
        data = yaml.safe_load(open(cfg))
        data["parallel"]["stages"].update(fc2=2, loss=2, accuracy=2)
        cfg = write_config_file(tmp_path, data, "cfg3.yaml")
    one = run_cli_args("train", cfg, "--out", tmp_path / "one")
    assert one.returncode == 0, one.stderr
    res = subprocess.run([MPIEXEC, "-n", str(ranks), PYTHON, "-m", "purine_mpi", "train", cfg,
                          "--out", tmp_path / "many"], cwd=REPO, env=cli_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    a, b = _params(tmp_path / "one" / "latest.h5"), _params(tmp_path / "many" / "latest.h5")
    assert sorted(a) == sorted(b) and len(a) == 12  # 6 params + 6 momenta, from every stage
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    # the logged losses agree as well (the loss lives on the last stage only)
    assert one.stdout.splitlines()[-1] == res.stdout.splitlines()[-1]


def test_graph_shows_each_stage(tmp_path, digits_h5):
    cfg = _config(digits_h5, tmp_path)
    r0 = run_cli_here("graph", cfg, "--np", "2", "--rank", "0")
    r1 = run_cli_here("graph", cfg, "--np", "2", "--rank", "1")
    assert r0.returncode == 0 and r1.returncode == 0, r0.stderr + r1.stderr
    assert "conv1.fwd" in r0.stdout and "fc1.fwd" not in r0.stdout
    assert "fc1.fwd" in r1.stdout and "conv1.fwd" not in r1.stdout
    # parallel.transport auto: one node, so one-sided puts into shared windows
    assert " Put " in r0.stdout and " WaitWrite " in r1.stdout
    assert " Send " not in r0.stdout and " Recv " not in r1.stdout
    r0 = run_cli_here("graph", cfg, "--np", "2", "--rank", "0", "--set",
                      "parallel.transport=two_sided")
    assert r0.returncode == 0 and " Send " in r0.stdout and " Recv " in r0.stdout, r0.stderr


def test_bad_stage_is_a_config_error(tmp_path, digits_h5):
    cfg = yaml.safe_load(open(_config(digits_h5, tmp_path)))
    cfg["parallel"]["stages"]["nosuchlayer"] = 1
    res = run_cli_here("graph", write_config_file(tmp_path, cfg), "--np", "2")
    assert res.returncode == 2 and "nosuchlayer" in res.stderr and "Traceback" not in res.stderr
