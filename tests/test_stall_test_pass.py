"""A peer that stops responding during a test pass ends the job at
``parallel.stall_timeout``, as during training (session 71's failure hunt).
The test pass's dispatcher was made without the config's timeout, so it
had the dispatcher's default, 300 s: under the schemes whose test graph
communicates (pipeline stages, tensor shards, tensor x pipeline, stage-3
gathers) a rank frozen with SIGSTOP at a test pass left its peers waiting
5 minutes where the config said 20 s (measured: gpt_tiny, ``mpiexec -n 4``,
``scheme: pipeline`` with ``stages: 2`` and ``tensor_parallel: 2``,
``stall_timeout: 20``: still waiting 150 s on, in evaluation.py's
``dispatcher.run``). tests/test_stall.py freezes ranks of data-parallel
runs, whose test pass has no communication in its graph."""
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import (MPIEXEC, REPO, FakeWorld, cli_env, make_job, small_net_config,
                            write_config_file)

STALL_TIMEOUT = 2.0

#: rank 0 (stage 0) freezes itself in its first test pass, before the
#: pass's second batch: rank 1 (stage 1) waits in its test graph for the
#: activations rank 0 never sends (before the first batch it would wait in
#: the evaluation's own collectives, outside the graph, which always had
#: the config's timeout)
_FREEZE_IN_TEST = """
import os, runpy, signal, sys
import purine_mpi.train.evaluation as ev
orig = ev.Evaluation.evaluate
def evaluate(self, loop, *a, **kw):
    if os.environ.get("PMI_RANK") == "0" and not getattr(loop.test, "frozen_hook", False):
        run, calls = loop.test.run, []
        def frozen_run(*a, **kw):
            calls.append(1)
            if len(calls) == 2:
                print("frozen in the test pass", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            return run(*a, **kw)
        loop.test.run, loop.test.frozen_hook = frozen_run, True
    return orig(self, loop, *a, **kw)
ev.Evaluation.evaluate = evaluate
sys.argv = ["purine_mpi"] + sys.argv[1:]
runpy.run_module("purine_mpi", run_name="__main__", alter_sys=True)
"""


def _config(digits_h5, **parallel):
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=8, display=4, test_interval=4)
    cfg["parallel"] = dict(stall_timeout=STALL_TIMEOUT, **parallel)
    return cfg


def test_the_test_dispatcher_has_the_configs_stall_timeout(digits_h5, tmp_path):
    from purine_mpi.train.trainer import Trainer
    job = make_job(_config(digits_h5))
    trainer = Trainer(job, str(tmp_path / "run"), world=FakeWorld(), log=lambda line: None)
    try:
        assert trainer.train.stall_timeout == STALL_TIMEOUT
        assert trainer.test is not None and trainer.test.stall_timeout == STALL_TIMEOUT
    finally:
        trainer.close()


@pytest.mark.mpi
def test_a_rank_frozen_at_a_pipeline_test_pass_ends_the_job(digits_h5, tmp_path):
    """2 stages, rank 0 frozen in its first test pass: the job ends (rank
    1's stall watchdog names the stalled transfer, MPI_Abort) at the
    config's 2 s, where it said `rank 1: communication stalled for more than
    300 s; still waiting on: op 'conv2.wait' (WaitWrite ...)` 5 minutes on.
    The wait allowed is generous (150 s, for a loaded machine)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    path = write_config_file(tmp_path, _config(digits_h5, scheme="pipeline", stages=2))
    wrapper = tmp_path / "freeze.py"
    wrapper.write_text(_FREEZE_IN_TEST)
    out = tmp_path / "run"
    proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, str(wrapper), "train", path,
                             "--out", str(out)], cwd=REPO, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks, the frozen one too
        stdout, stderr = proc.communicate()
        pytest.fail("the job still waited 150 s after rank 0 froze in its test pass "
                    f"(stall_timeout {STALL_TIMEOUT:g} s):\n{stdout[-2000:]}\n{stderr[-2000:]}")
    assert "frozen in the test pass" in stdout, stdout + stderr
    assert proc.returncode != 0, stdout + stderr
    assert f"stalled for more than {STALL_TIMEOUT:g} s" in stdout + stderr, stdout + stderr
