"""Trust audit: the tools stand for the run ``train`` makes.

On several ranks a parameter-server ``parallel.mode`` starts the servers
whatever ``parallel.scheme`` names (train/trainer.run_training asks the
mode; scheme none's class is registered for those modes and answers
``servers`` False). ``graph --np``, ``plan`` (and train's own memory
check, the same figures) and the scaling model asked that class: under
scheme none with mode sync_ps or async they showed a rank's graph without
servers (each rank its own replica, its own SGD updates) and counted rank
0's checkpoint save as 0 B, where the run is the servers' (the same run
as scheme data with that mode: its start-up block, its bytes).
"""
import pytest

from tests.conftest import make_job

CFG = {"name": "run_scheme", "seed": 3,
       "data": {"train": {"source": "synthetic", "shape": [6], "classes": 5,
                          "batch_size": 8}},
       "net": [{"type": "fc", "name": "fc1", "bottom": "data", "top": "out",
                "num_output": 5},
               {"type": "softmax_loss", "name": "loss", "bottom": ["out", "label"],
                "top": "loss"}],
       "solver": {"type": "sgd", "base_lr": 0.1, "momentum": 0.9, "max_iter": 2,
                  "display": 1, "test_interval": 0}}


def _job(scheme, mode):
    return make_job(dict(CFG, parallel={"scheme": scheme, "mode": mode}))


def _ops(graph):
    return sorted((name, op.op_type) for name, op in graph.ops.items())


@pytest.mark.parametrize("mode", ["sync_ps", "async"])
def test_graph_plan_and_scaling_of_scheme_none_with_servers_are_the_servers(mode):
    """3 ranks (2 workers, 1 server): scheme none's worker graph, server
    graph, rank 0's save bytes and the scaling model's scenario are scheme
    data's under the same mode. Before: rank 0's graph had its own
    ``SGDUpdate`` ops and no push or pull (op lists differ), its save 0 B
    (5,160 under data), and the scaling scenario no servers."""
    from purine_mpi.tools.graph import compose_for
    from purine_mpi.tools.plan import offline_footprints
    from purine_mpi.tools.scaling.model import Scenario
    none, data = _job("none", mode), _job("data", mode)
    for rank in (0, 2):
        assert _ops(compose_for(none, 3, rank)) == _ops(compose_for(data, 3, rank)), rank
    saves = [{r: fp.save for r, fp in offline_footprints(job, 3, [0, 1])[0].items()}
             for job in (none, data)]
    assert saves[0] == saves[1] and saves[1][0] > 0, saves
    assert Scenario(none, 3).ps and Scenario(none, 3).workers == 2
    # one rank: no servers, scheme none's own replica (nothing changes there)
    assert not Scenario(none, 1).ps
    assert not any(op.op_type in ("Put", "Get", "Send", "Recv")
                   for op in compose_for(none, 1, 0).ops.values())
