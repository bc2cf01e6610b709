"""A tiny GPT under the existing schemes (issue 37): pipeline stages cut
between blocks, with (N, T, C) activations at the boundary and the
embedding table tied to the LM head across the stages; micro-batches under
1F1B; data parallelism and parameter servers; each run with ``mpiexec``
against one rank.

The tied table lives on the stage of its first layer (``wte``); the head's
stage receives it (Send/Recv) and sends its share of the gradient back,
where the gradient builder's Sum adds both uses before the one update (the
update waits for the Send's read: a write-after-read edge), so a 2-stage
pipeline is bitwise equal to 1 rank."""
import numpy as np
import pytest

from purine_mpi.tools.graph import compose_for
from tests.conftest import make_job, run_mpi_cli, train_here, write_config_file
from tests.test_micro_batches import _params
from tests.gpt_nets import block_stages, gpt_config, text_h5


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return text_h5(tmp_path_factory.mktemp("pipe_tokens"))


def _pipeline(micro=1):
    return {"scheme": "pipeline", "stages": block_stages(), "micro_batches": micro}


def _train(tmp_path, name, n, cfg):
    out = tmp_path / name
    if n == 1:  # the one-rank reference, in this process (conftest.train_here)
        return _params(train_here(cfg, out) / "latest.h5")
    res = run_mpi_cli(n, "train", write_config_file(tmp_path, cfg, f"{name}.yaml"), "--out", out)
    assert res.returncode == 0, res.stdout + res.stderr
    return _params(out / "latest.h5")


def test_stage_slices_carry_the_tied_weight_and_its_gradient(tokens):
    # two-sided, so the crossings are Send/Recv pairs (one-sided puts the same
    # blobs into windows: tests/test_rma_pipeline.py)
    job = make_job(gpt_config(tokens, parallel={**_pipeline(), "transport": "two_sided"}))
    s0, s1 = (compose_for(job, 2, r) for r in range(2))
    sends0 = {op.inputs[0] for op in s0.ops.values() if op.op_type == "Send"}
    recvs1 = {op.outputs[0] for op in s1.ops.values() if op.op_type == "Recv"}
    # the tied table and block 0's (N, T, C) output cross forward
    assert {"wte/weight", "x1"} <= sends0 and {"wte/weight", "x1"} <= recvs1
    assert s1.blobs["x1"].shape == (4, 8, 16) and s1.blobs["wte/weight"].kind == "data"
    # the head's share of the table's gradient goes back and is summed with
    # the embedding's on stage 0, which alone updates the table
    back = {op.inputs[0] for op in s1.ops.values() if op.op_type == "Send"}
    assert back == {"wte/weight.grad@lm_head", "x1.grad"}
    assert "wte/weight.update" in s0.ops and "wte/weight.update" not in s1.ops
    total = s0.ops["wte/weight.grad_sum"]
    assert total.op_type == "Sum" and "wte/weight.grad@lm_head" in total.inputs


def test_two_stage_pipeline_is_bitwise_one_rank(tmp_path, tokens):
    one = _train(tmp_path, "one", 1, gpt_config(tokens))
    two = _train(tmp_path, "two", 2, gpt_config(tokens, parallel=_pipeline()))
    assert sorted(one) == sorted(two) and one
    for name in one:
        assert np.array_equal(one[name], two[name]), name


@pytest.mark.slow
def test_two_stage_1f1b_is_bitwise_one_rank_with_micro_batches(tmp_path, tokens):
    """4 micro-batches under 1F1B on 2 stages = 1 rank accumulating the
    same 4 micro-batches, bit for bit."""
    one = _train(tmp_path, "one", 1, gpt_config(tokens, parallel={"micro_batches": 4}))
    two = _train(tmp_path, "two", 2, gpt_config(tokens, parallel=_pipeline(4)))
    for name in one:
        assert np.array_equal(one[name], two[name]), name


def _close(a, b):
    assert sorted(a) == sorted(b) and a
    for name in a:
        if name.startswith("params"):
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_data_parallel_and_parameter_servers_on_a_gpt(tmp_path, tokens):
    """2 ranks x batch 4 (allreduce) and 2 workers x batch 4 with one
    parameter server (mode sync_ps) each train like 1 rank with batch 8."""
    one = _train(tmp_path, "one", 1, gpt_config(tokens, batch=8, solver="sgd"))
    _close(one, _train(tmp_path, "dp", 2, gpt_config(tokens, solver="sgd")))
    _close(one, _train(tmp_path, "ps", 3, gpt_config(tokens, solver="sgd",
                                                      parallel={"mode": "sync_ps"})))
