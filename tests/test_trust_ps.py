"""Trust fixes of the parameter-server paths and of a few commands (session 65).

(1) A parameter-server run whose last test pass is non-finite: the workers
exit 3 (trainer.run_and_report), and before, the server ranks exited 0, so
the launcher's status was 3 only where it took the workers'. Every rank now
ends with the same status, agreed in one collective of the whole world.
"""
import os
import subprocess

import pytest

from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env, write_config_file
from tests.test_trust_mpi_resume import _outlier_h5, _overflow_config


def _each_rank_status(tmp_path, n, *args, timeout=180):
    """``mpiexec -n N python -m purine_mpi ARGS``, each rank's own exit status
    written by a shell around it: (CompletedProcess, {rank: status})."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    marks = tmp_path / "status"
    marks.mkdir()
    script = (f'"{PYTHON}" -m purine_mpi "$@"; s=$?; '
              f'echo $s > "{marks}/rank.${{PMI_RANK:-$OMPI_COMM_WORLD_RANK}}"; exit $s')
    res = subprocess.run([MPIEXEC, "-n", str(n), "sh", "-c", script, "sh", *map(str, args)],
                         cwd=REPO, env=cli_env(), capture_output=True, text=True,
                         timeout=timeout)
    status = {int(p.name.split(".")[1]): int(p.read_text()) for p in marks.iterdir()}
    return res, status


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["sync_ps", "async"])
def test_every_rank_of_a_ps_run_exits_3_on_a_non_finite_last_test_pass(tmp_path, mode):
    data = tmp_path / "d.h5"
    _outlier_h5(data)
    cfg = _overflow_config(data)
    cfg["parallel"] = {"scheme": "data", "mode": mode, "ps_ranks": 1, "stall_timeout": 30}
    job = write_config_file(tmp_path, cfg)
    out = tmp_path / "run"
    res, status = _each_rank_status(tmp_path, 3, "train", job, "--out", out)
    assert "error: the test pass at iteration 4 gave non-finite figures" in res.stderr, \
        res.stderr
    assert status == {0: 3, 1: 3, 2: 3}, (status, res.stdout, res.stderr)
    assert res.returncode == 3, res.returncode
