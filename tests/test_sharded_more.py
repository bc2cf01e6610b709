"""ZeRO stage 3 with micro-batches (each bucket's weights gathered once per
iteration and held across the micro-batches), the sharded stages against
data parallelism on 4 ranks, and stage 3's faults (a killed rank, a stopped
one) under the fault harness of tests/test_rma_faults.py."""
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from purine_mpi.runtime.footprint import model_state_bytes
from purine_mpi.runtime.memory_plan import plan_memory
from purine_mpi.tools.graph import compose_for
from tests.conftest import make_job
from tests.test_micro_batches import _params
from tests.test_sharded import _job, _same, _train
from tests.test_sharded3 import _gathered


def test_stage3_micro_batches_gather_once_and_hold_the_weights():
    """Stage 3 with 2 and 4 micro-batches (once refused): one Allgather per
    full buffer and iteration; the gathered
    weights stay live across the micro-batches, so the working set is the
    whole weights (4 bytes a weight, the cost of gathering once) against a
    prefetch window's without micro-batches; the held model state is the
    same."""
    def composed(micro):
        g = compose_for(make_job(_job("sharded", "adamw", shard=3, micro_batches=micro)), 2, 0)
        return g, model_state_bytes(g, plan_memory(g))

    one, held = composed(1)
    whole = model_state_bytes(compose_for(make_job(_job("data", "adamw")), 2, 0))["weights"]
    assert held["working"] < whole
    for micro in (2, 4):
        g, got = composed(micro)
        gathers = sorted(op.outputs[0] for op in g.ops.values() if op.op_type == "Allgather")
        assert gathers == sorted(_gathered(g)), micro  # one gather per buffer
        assert got["held"] == held["held"] and got["working"] == whole, (micro, got)
        g.topo_order()


@pytest.mark.mpi
@pytest.mark.parametrize("solver", ["adamw", "sgd"])
def test_stage3_micro_batches_as_data_parallel(tmp_path, solver):
    """2 ranks, 2 micro-batches, 10 steps: stage 3 writes data parallelism's
    weights and optimizer state bit for bit (the micro-batches' gradients
    are summed into the transient bucket before its reduce-scatter, in the
    order data parallelism sums them)."""
    runs = []
    for scheme, par in (("data", {}), ("sharded", {"shard": 3, "check_collectives": True})):
        cfg = _job(scheme, solver, iters=10, micro_batches=2, **par)
        runs.append(_params(_train(tmp_path, scheme, 2, cfg)[0] / "latest.h5"))
    _same(*runs)


@pytest.mark.slow
@pytest.mark.mpi
def test_every_stage_as_data_parallel_on_4_ranks(tmp_path):
    """4 ranks, 10 AdamW steps: stages 1, 2 and 3 within 1e-5 of each blob's
    largest magnitude of data parallelism's weights and moments (MPICH may
    add 4 ranks' values in another order in reduce-scatter than in
    allreduce: none of the three matched bit for bit in this net; the
    test prints which do)."""
    runs = {}
    for name, scheme, par in (("data", "data", {}), ("s1", "sharded", {"shard": 1}),
                              ("s2", "sharded", {"shard": 2}), ("s3", "sharded", {"shard": 3})):
        cfg = _job(scheme, "adamw", iters=10, **par)
        runs[name] = _params(_train(tmp_path, name, 4, cfg)[0] / "latest.h5")
    for name in ("s1", "s2", "s3"):
        _same(runs["data"], runs[name], rtol=1e-5)
        bitwise = all(np.array_equal(v, runs[name][k]) for k, v in runs["data"].items())
        print(f"4 ranks, {name}: bitwise {bitwise}")


def _start_stage3(tmp_path, digits_h5, name, stall_timeout, batch=16):
    """A 2-rank stage-3 run of the small digits net, returned once it
    trains: (proc, out, {rank: pid})."""
    from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env, small_net_config, \
        write_config_file
    from tests.test_ps_stop import _rank_of
    from tests.test_signals import _rank_pids, _wait_for_metrics
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    data = small_net_config(digits_h5)
    data["solver"].update(max_iter=100000, display=5, test_interval=0)
    data["data"]["train"]["batch_size"] = batch
    data["checkpoint"] = {"interval": 0, "keep": 2}
    data["parallel"] = {"scheme": "sharded", "shard": 3, "stall_timeout": stall_timeout,
                        "bucket_mb": 0.001, "first_bucket_mb": 0.0005}
    cfg, out = write_config_file(tmp_path, data, f"{name}.yaml"), str(tmp_path / name)
    proc = subprocess.Popen([MPIEXEC, "-n", "2", PYTHON, "-m", "purine_mpi", "train", cfg,
                             "--out", out], cwd=REPO, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_metrics(out, time.time() + 120)
    time.sleep(0.2)  # mid-run: gathers and reduce-scatters in flight
    ranks = {_rank_of(pid): pid for pid in _rank_pids(out)}
    assert sorted(ranks) == [0, 1], ranks
    return proc, out, ranks


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("victim", [0, 1])
def test_stage3_kill_9_ends_every_rank_promptly(tmp_path, digits_h5, victim):
    """kill -9 of one rank of a stage-3 run: every rank ends within a few
    seconds (the launcher sees the death), long before the 30 s watchdog."""
    from tests.test_signals import _rank_pids, finish_ranks
    proc, out, ranks = _start_stage3(tmp_path, digits_h5, "kill", 30)
    killed = time.monotonic()
    os.kill(ranks[victim], signal.SIGKILL)
    finish_ranks(proc, ranks.values(), 30)
    took = time.monotonic() - killed
    print(f"stage 3: kill -9 of rank {victim}: the job ended {took:.2f} s later")
    assert proc.returncode not in (0, None)
    assert took < 5
    assert not _rank_pids(out), "a rank outlived the job"


@pytest.mark.slow
@pytest.mark.mpi
def test_stage3_sigstop_watchdog_names_a_sharded_collective(tmp_path, digits_h5):
    """SIGSTOP of rank 1 of a stage-3 run: rank 0's watchdog ends the job
    naming the ReduceScatter or Allgather it waits in (a trial that freezes
    the rank between iterations names the stop agreement instead, and is
    tried again, up to 8 times; a large batch makes the iterations long
    beside the agreement)."""
    from tests.test_signals import finish_ranks
    for trial in range(8):
        proc, _out, ranks = _start_stage3(tmp_path, digits_h5, f"t{trial}", 2, batch=512)
        os.kill(ranks[1], signal.SIGSTOP)
        _, stderr = finish_ranks(proc, ranks.values(), 30)
        assert proc.returncode not in (0, None)
        assert "stalled for more than 2 s" in stderr, stderr[-3000:]
        if re.search(r"\((ReduceScatter|Allgather)\b", stderr):
            break
    assert re.search(r"op '[^']+' \((ReduceScatter|Allgather), I(reduce_scatter|allgatherv)",
                     stderr), stderr[-3000:]
