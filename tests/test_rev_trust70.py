"""Review of session 70's trust hunt (merge cfdec5d): what its changes got
wrong, each test failing on the merged code (the assertion named in each
docstring)."""
import os

import pytest

from tests.conftest import REPO, run_mpi_cli

JOBS = os.path.join(REPO, "jobs")


@pytest.mark.parametrize("mode", ["sync_ps", "async"])
def test_bench_of_a_diverging_parameter_server_run_says_it_once(mode, digits_h5):
    """``mpiexec -n 3 bench`` of a parameter-server run whose loss goes NaN:
    exit 3 with one line by rank 0, as every other scheme's run. The merged
    check decided among the workers only: the server returned its figures
    and ended 0, so the workers' agreement on the error found no server
    there and each worker printed ``error: rank R: bench: ...`` and aborted
    the job (this test's count of the error lines: 2)."""
    res = run_mpi_cli(3, "bench", os.path.join(JOBS, "digits_lenet.yaml"), "--iters", "2",
                      "--warmup", "1", "--json", "--set", "solver.base_lr=1e30",
                      "--set", f"parallel.mode={mode}",
                      "--set", f"data.train.path={digits_h5}",
                      "--set", f"data.test.path={digits_h5}")
    assert res.returncode == 3, (res.stdout[:300], res.stderr)
    assert res.stdout.strip() == "", res.stdout[:300]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr
    assert errors[0].startswith("error: bench: digits_lenet diverged: the loss or the weights "
                                "hold NaN or inf"), errors
