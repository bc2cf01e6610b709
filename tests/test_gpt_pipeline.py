"""A transformer block under the existing schemes (issue 37): pipeline
stages cut between blocks with (N, T, C) activations at the boundary and a
weight tied across the stages (an embedding-like input projection shared
with the output head), micro-batches under 1F1B, data parallelism and
parameter servers, each run with ``mpiexec`` against one rank.

The tied weight lives on the stage of its first layer; the head on the
other stage receives it (Send/Recv) and sends its gradient contribution
back, where the gradient builder's Sum adds both uses before the one
update: a 2-stage pipeline is bitwise equal to 1 rank."""
import h5py
import numpy as np
import pytest

from purine_mpi.tools.graph import compose_for
from tests.conftest import make_job, run_cli_args, run_mpi_cli, write_config_file

STAGES = {"emb": 0, "ln1": 0, "c_fc": 0, "gelu": 0, "c_proj": 1, "res": 1, "lnf": 1,
          "head": 1, "out": 1, "loss": 1}


def _config(parallel=None, batch=8, solver="adamw", iters=5):
    """A pre-norm block on (batch, 4, 8) float sequences: an input
    projection ``emb`` whose weight the head reuses (tie_weight), layer_norm,
    an MLP (fc axis -1, gelu, fc axis -1), the residual, a final layer_norm,
    the tied head and a classifier."""
    return {
        "name": "gptpipe", "seed": 3,
        "data": {"train": {"source": "synthetic", "shape": [4, 8], "classes": 5,
                           "batch_size": batch}},
        "net": [
            {"type": "fc", "name": "emb", "bottom": "data", "top": "x", "num_output": 8,
             "axis": -1, "bias_term": False},
            {"type": "layer_norm", "name": "ln1", "bottom": "x", "top": "h"},
            {"type": "fc", "name": "c_fc", "bottom": "h", "top": "u", "num_output": 32,
             "axis": -1},
            {"type": "gelu", "name": "gelu", "bottom": "u", "top": "u"},
            {"type": "fc", "name": "c_proj", "bottom": "u", "top": "m", "num_output": 8,
             "axis": -1},
            {"type": "eltwise", "name": "res", "bottom": ["x", "m"], "top": "y"},
            {"type": "layer_norm", "name": "lnf", "bottom": "y", "top": "z"},
            {"type": "fc", "name": "head", "bottom": "z", "top": "w", "num_output": 8,
             "axis": -1, "tie_weight": "emb", "bias_term": False},
            {"type": "fc", "name": "out", "bottom": "w", "top": "logits", "num_output": 5},
            {"type": "softmax_loss", "name": "loss", "bottom": ["logits", "label"],
             "top": "loss"},
        ],
        "solver": {"type": solver, "base_lr": 0.01, "max_iter": iters, "display": 1,
                   "test_interval": 0},
        "parallel": parallel or {},
    }


def _pipeline(micro=1):
    return {"scheme": "pipeline", "stages": dict(STAGES), "micro_batches": micro}


def _params(path):
    with h5py.File(path, "r") as f:
        out = {}
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) and name.startswith(("params", "solver"))
                     else None)
        return out


def _train(tmp_path, name, n, cfg):
    path = write_config_file(tmp_path, cfg, f"{name}.yaml")
    out = tmp_path / name
    res = run_mpi_cli(n, "train", path, "--out", out) if n > 1 else \
        run_cli_args("train", path, "--out", out)
    assert res.returncode == 0, res.stdout + res.stderr
    return _params(out / "latest.h5")


def test_stage_slices_carry_the_tied_weight_and_its_gradient():
    job = make_job(_config(_pipeline()))
    s0, s1 = (compose_for(job, 2, r) for r in range(2))
    sends0 = {op.inputs[0] for op in s0.ops.values() if op.op_type == "Send"}
    recvs1 = {op.outputs[0] for op in s1.ops.values() if op.op_type == "Recv"}
    # the tied weight and the 3-D activations cross forward
    assert {"emb/weight", "x", "u@gelu"} <= sends0
    assert "emb/weight" in recvs1 and s1.blobs["emb/weight"].kind == "data"
    assert len(s1.blobs["x"].shape) == 3
    # the head's share of the weight's gradient goes back and is summed
    # with the input projection's on stage 0, which alone updates it
    back = {op.inputs[0] for op in s1.ops.values() if op.op_type == "Send"}
    assert "emb/weight.grad@head" in back
    assert "emb/weight.update" in s0.ops and "emb/weight.update" not in s1.ops
    total = s0.ops["emb/weight.grad_sum"]
    assert total.op_type == "Sum" and len(total.inputs) == 2


def test_two_stage_pipeline_is_bitwise_one_rank(tmp_path):
    one = _train(tmp_path, "one", 1, _config())
    two = _train(tmp_path, "two", 2, _config(_pipeline()))
    assert sorted(one) == sorted(two) and one
    for name in one:
        assert np.array_equal(one[name], two[name]), name


@pytest.mark.slow
def test_two_stage_1f1b_is_bitwise_one_rank_with_micro_batches(tmp_path):
    """4 micro-batches under 1F1B on 2 stages = 1 rank accumulating the
    same 4 micro-batches, bit for bit."""
    one = _train(tmp_path, "one", 1, _config({"micro_batches": 4}))
    two = _train(tmp_path, "two", 2, _config(_pipeline(4)))
    for name in one:
        assert np.array_equal(one[name], two[name]), name


def _close(a, b):
    assert sorted(a) == sorted(b) and a
    for name in a:
        if name.startswith("params"):
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_data_parallel_and_parameter_servers_on_a_block(tmp_path):
    """2 ranks x batch 8 (allreduce) and 2 workers x batch 8 with one
    parameter server (mode sync_ps) each train like 1 rank with batch 16."""
    sgd = dict(solver="sgd")
    one = _train(tmp_path, "one", 1, _config(batch=16, **sgd))
    _close(one, _train(tmp_path, "dp", 2, _config(**sgd)))
    _close(one, _train(tmp_path, "ps", 3, _config({"mode": "sync_ps"}, **sgd)))
