"""Pricing an op from a traced op of another size (tools/scaling/work.py,
tools/choose.py ``_Scaled``): ``plan --choose`` times every candidate's ops
from one trace of the whole batch on one rank.

The net has a wide fully connected layer (a 1,536 x 1,536 weight, 9 MiB,
against 16 x 1,536 activations, 96 KiB), so an op of a micro-batch priced
by all the bytes it touches would cost nearly the whole batch's time; by
its work (FLOPs, or the batch's bytes) it costs 1/M of it."""
import pytest

from purine_mpi.job.config import load_job
from purine_mpi.tools.choose import CALIBRATION_SETS, _Scaled
from purine_mpi.tools.graph import compose_for
from purine_mpi.tools.scaling.trace_reader import Durations
from purine_mpi.tools.scaling.work import op_work, weight_blobs

BATCH = 16
NET = f"""name: work_net
seed: 3
data:
  train: {{source: synthetic, shape: [1, 8, 8], classes: 10, num_samples: 64,
           batch_size: {BATCH}}}
net:
  - {{type: fc, name: fc1, bottom: data, top: fc1, num_output: 1536}}
  - {{type: relu, name: relu1, bottom: fc1, top: fc1}}
  - {{type: fc, name: fc2, bottom: fc1, top: fc2, num_output: 1536}}
  - {{type: relu, name: relu2, bottom: fc2, top: fc2}}
  - {{type: fc, name: fc3, bottom: fc2, top: fc3, num_output: 10}}
  - {{type: softmax_loss, name: loss, bottom: [fc3, label], top: loss}}
solver: {{type: sgd, base_lr: 0.01, momentum: 0.9, max_iter: 10}}
"""
STAGES = "parallel.stages={fc1: 0, relu1: 0, fc2: 1, relu2: 1, fc3: 1, loss: 1}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("work") / "net.yaml"
    path.write_text(NET)
    traced = compose_for(load_job(path, CALIBRATION_SETS, check_files=False), 1, 0)
    # every traced op took 1 s: a candidate's op costs its share of the work
    durations = Durations({0: {name: 1.0 for name in traced.ops}})
    return path, traced, durations


def _scaled(setup, sets, n, rank):
    path, traced, durations = setup
    graph = compose_for(load_job(path, sets, check_files=False), n, rank)
    return graph, _Scaled(durations, traced, graph)


@pytest.mark.parametrize("m", [2, 4, 8])
def test_an_op_of_a_micro_batch_costs_its_share_of_the_batch(setup, m):
    graph, scaled = _scaled(setup, ("parallel.scheme=pipeline", STAGES,
                                    f"parallel.micro_batches={m}"), 2, 1)
    for op in ("fc2.fwd", "fc2.bwd.inner_product_grad_data",
               "fc2.bwd.inner_product_grad_weight", "relu2.fwd", "relu2.bwd.relu_grad"):
        for k in range(m):
            assert scaled.lookup(f"{op}@mb{k}") == pytest.approx(1.0 / m), (op, k)
    # the update runs once per iteration on the whole weight
    assert scaled.lookup("fc2/weight.update") == pytest.approx(1.0)


def test_a_matrix_product_counts_flops_and_other_ops_the_batchs_bytes(setup):
    graph, _ = _scaled(setup, ("parallel.scheme=pipeline", STAGES,
                               "parallel.micro_batches=2"), 2, 1)
    weights = weight_blobs(graph)
    assert {"fc2/weight", "fc2/weight.grad@mb0", "fc2/weight.momentum"} <= weights
    assert not {"fc2@mb0", "fc2.grad@mb0", "fc1@mb0"} & weights
    rows = BATCH // 2
    assert op_work(graph, "fc2.fwd@mb0") == ("flops", 2 * rows * 1536 * 1536)
    assert op_work(graph, "fc2.bwd.inner_product_grad_weight@mb0") == (
        "flops", 2 * 1536 * 1536 * rows)
    # ReLU in place or not: its input and output, 4 bytes a float, no weight
    unit, nbytes = op_work(graph, "relu2.fwd@mb0")
    assert unit == "bytes" and nbytes in (rows * 1536 * 4, 2 * rows * 1536 * 4)
    assert op_work(graph, "fc2/weight.update")[0] == "all bytes"


def test_the_row_chunks_of_a_weight_gradient_sum_to_the_whole(setup):
    graph, scaled = _scaled(setup, ("parallel.scheme=data",), 2, 0)
    chunks = [n for n in graph.ops if n.startswith("fc2.bwd.inner_product_grad_weight[")]
    assert len(chunks) > 1  # cut into the buckets' rows
    assert sum(scaled.lookup(n) for n in chunks) == pytest.approx(1.0)
