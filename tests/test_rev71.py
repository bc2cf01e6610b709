"""Review of session 71's merges (plan-z3, trust71-cast), by running them."""
import os
import subprocess

import pytest

from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env

SCRIPT = os.path.join(REPO, "tests", "mpi_scripts", "bench_one_rank_diverged.py")


@pytest.mark.mpi
@pytest.mark.parametrize("n,sets,bad", [
    (2, ("parallel.scheme=sharded", "parallel.shard=3"), "1"),
    (2, ("parallel.scheme=tensor", "parallel.tensor_parallel=2"), "1"),
    (2, ("parallel.scheme=pipeline", "parallel.stages=2"), "0"),
    (3, ("parallel.mode=sync_ps",), "1"),
])
def test_bench_with_one_rank_diverged_ends_on_every_rank_naming_it(n, sets, bad, digits_h5):
    """trust71's divergence line gathers each rank's first non-finite blob
    once the allreduce says some rank diverged: with a NaN on one rank only
    (sharded stage 3, tensor 2-way, pipeline 2 stages, parameter servers),
    every rank takes that gather -- exit 3 on all, in time, one line naming
    the blob and its rank -- not the diverged rank waiting in a gather the
    finite ones never post."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    env = dict(cli_env(), PURINE_TEST_DIVERGED_RANKS=bad)
    cmd = [MPIEXEC, "-n", str(n), PYTHON, SCRIPT, "bench",
           os.path.join(REPO, "jobs", "digits_lenet.yaml"), "--iters", "2", "--warmup", "1",
           "--set", f"data.train.path={digits_h5}", "--set", f"data.test.path={digits_h5}"]
    for s in sets:
        cmd += ["--set", s]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 3, (res.stdout[-300:], res.stderr[-2000:])
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr
    assert errors[0].startswith(f"error: bench: digits_lenet diverged: 'injected_on_rank_{bad}'"
                                f" on rank {bad} holds NaN or inf after the 3 iterations"), errors
