"""``parallel.reduce_scatter: false`` (DeepSpeed's
``zero_optimization.reduce_scatter: false``; issue 43): scheme sharded sums
each gradient bucket whole by the allreduce data parallelism posts for it
(MPI_Iallreduce in place on the bucket, same dtype and buckets) and each
rank keeps its shard's range, so the weights are data parallelism's bit for
bit at any rank count; the bytes and costs reported are an allreduce's; the
memory is the stage's; the window transport is taken (its windows carry the
weights, not the sums: the two-sided run's bits); other schemes note
that the key has no effect. NCCL: tests/test_sharded_nccl.py; the
predictor: tests/test_scaling.py."""
import json
import re

import numpy as np
import pytest

from purine_mpi.comm.ops import collective_bytes
from purine_mpi.parallel.compose import settings_without_effect
from purine_mpi.runtime.footprint import model_state_bytes
from purine_mpi.runtime.memory_plan import plan_memory
from purine_mpi.tools.graph import compose_for, shard_lines
from tests.conftest import make_job, run_mpi_cli, write_config_file
from tests.test_micro_batches import _params
from tests.test_sharded import _job, _same, _train


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_stage_is_data_parallel_bit_for_bit(tmp_path, n):
    """n ranks, 5 AdamW steps of the residual MLP in 8 buckets: stages 1,
    2 and 3 with ``reduce_scatter: false`` write data parallelism's weights
    and AdamW moments bit for bit (on 4 ranks the reduce-scatter's sums
    differ from the allreduce's in MPICH: test_sharded_more.py prints
    ``bitwise False`` there for every stage)."""
    data = _params(_train(tmp_path, "data", n, _job("data", "adamw", iters=5))[0] / "latest.h5")
    for stage in (1, 2, 3):
        cfg = _job("sharded", "adamw", iters=5, shard=stage, reduce_scatter=False)
        folder, text = _train(tmp_path, f"s{stage}", n, cfg)
        _same(data, _params(folder / "latest.h5"))
        # the start-up block says what is posted
        assert "gradients summed by data parallelism's allreduce, each rank keeping its " \
            "shard's range (parallel.reduce_scatter: false)" in text, text
        assert "reduce-scatter" not in text.split("scheme", 1)[1].split("\n", 1)[0], text


@pytest.mark.mpi
def test_bf16_buckets_on_4_ranks_are_data_parallels_bit_for_bit(tmp_path):
    """``grad_dtype: bf16``: the bucket's bfloat16 copy is all-reduced with
    data parallelism's bfloat16 sum, the shard widened from its range:
    stage 2 on 4 ranks writes data parallelism's bf16 run bit for bit."""
    data = _params(_train(tmp_path, "data", 4, _job("data", "adamw", iters=5,
                                                    grad_dtype="bf16"))[0] / "latest.h5")
    cfg = _job("sharded", "adamw", iters=5, shard=2, reduce_scatter=False, grad_dtype="bf16")
    _same(data, _params(_train(tmp_path, "s2", 4, cfg)[0] / "latest.h5"))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_collective_posted_is_data_parallels_allreduce(stage):
    """Composed for 3 ranks: every reduce-scatter carries ``allreduce``;
    the bytes counted as allreduced are data parallelism's (its buckets,
    whole), none reduce-scattered; the allgathers and the memory (held,
    and live at once) are the default's; ``graph --np`` says what is posted."""
    data = compose_for(make_job(_job("data", "adamw", split_params=False)), 3, 0)
    default = compose_for(make_job(_job("sharded", "adamw", shard=stage)), 3, 0)
    graph = compose_for(make_job(_job("sharded", "adamw", shard=stage,
                                      reduce_scatter=False)), 3, 0)
    ops = [op for op in graph.ops.values() if op.op_type == "ReduceScatter"]
    assert len(ops) == 8 and all(op.attrs.get("allreduce") is True for op in ops)
    assert not any(op.attrs.get("allreduce") for op in default.ops.values())
    moved, base, dp = collective_bytes(graph), collective_bytes(default), collective_bytes(data)
    assert moved["Allreduce"] == dp["Allreduce"] == base["ReduceScatter"] > 0
    assert "ReduceScatter" not in moved and moved["Allgather"] == base["Allgather"]
    sizes = sorted(sum(graph.blobs[b].size for b in op.inputs) for op in ops)
    assert sizes == sorted(sum(data.blobs[b].size for b in op.inputs)
                           for op in data.ops.values() if op.op_type == "Allreduce")
    assert model_state_bytes(graph, plan_memory(graph)) == \
        model_state_bytes(default, plan_memory(default))
    text = "\n".join(shard_lines(make_job(_job("sharded", shard=stage, reduce_scatter=False)),
                                 graph))
    assert text.count("all-reduced whole (parallel.reduce_scatter: false") == 8, text
    assert "reduce-scattered by" not in text


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_the_one_sided_transport_is_the_two_sided_runs_bit_for_bit(tmp_path, n):
    """Stage 3 with ``transport: one_sided`` (one node: each bucket's
    weights in one shared window) and ``reduce_scatter: false``: the windows
    carry the weights, the gradient sums stay MPI's allreduce, so the run
    writes the two-sided run's weights and moments bit for bit. Before, the
    config was refused (exit 2, ``key 'parallel.reduce_scatter' ... with
    parallel.transport one_sided is refused``), as if the sums went through
    data parallelism's window."""
    runs = {}
    for transport in ("two_sided", "one_sided"):
        cfg = _job("sharded", "adamw", iters=3, shard=3, transport=transport,
                   reduce_scatter=False)
        folder, text = _train(tmp_path, transport, n, cfg)
        runs[transport] = _params(folder / "latest.h5")
    assert "one shared copy per node" in text and "parallel.transport: one_sided" in text, text
    assert "gradients summed by data parallelism's allreduce" in text, text
    _same(runs["two_sided"], runs["one_sided"])


def test_other_schemes_note_that_it_has_no_effect():
    """Under scheme data the key is noted as having no effect (as
    ``prefetch``); under sharded it is not; its default is never noted."""
    notes = settings_without_effect(make_job(_job("data", reduce_scatter=False)), 2)
    assert any(re.match(r"note: parallel\.reduce_scatter applies to scheme sharded only; "
                        r"scheme data ignores it", n) for n in notes), notes
    for cfg in (_job("sharded", reduce_scatter=False), _job("data")):
        assert not any("reduce_scatter" in n for n in settings_without_effect(make_job(cfg), 2))


@pytest.mark.mpi
def test_bench_counts_the_bytes_allreduced(tmp_path):
    """``bench --json`` on 2 ranks: the bucket bytes are allreduced (data
    parallelism's figure), none reduce-scattered."""
    path = write_config_file(tmp_path, _job("sharded", shard=2, reduce_scatter=False))
    res = run_mpi_cli(2, "bench", path, "--iters", "1", "--warmup", "1", "--json", timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    grads = model_state_bytes(compose_for(make_job(_job("data")), 2, 0))["weights"]
    assert got["bytes_allreduced_per_iter"] == got["bytes_allgathered_per_iter"] == grads
    assert got["bytes_reduce_scattered_per_iter"] == 0


@pytest.mark.slow
@pytest.mark.mpi
def test_stages_on_4_replicas_are_hybrids_bit_for_bit(tmp_path):
    """With ``parallel.stages`` each stage's buckets are summed by hybrid's
    allreduce on the stage's sub-communicator: 4 replicas x 2 stages (8
    ranks), stage 2, 5 AdamW steps, hybrid's weights and moments bit for bit
    (the default's reduce-scatter differed by 1.5e-7 relative here)."""
    from tests.test_sharded_stages import _staged
    hybrid = _params(_train(tmp_path, "hybrid", 8, _staged("hybrid", iters=5))[0] / "latest.h5")
    cfg = _staged("sharded", iters=5, shard=2, reduce_scatter=False)
    _same(hybrid, _params(_train(tmp_path, "s2", 8, cfg)[0] / "latest.h5"))
