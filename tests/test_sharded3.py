"""ZeRO stage 3 of ``parallel.scheme: sharded`` (``parallel.shard: 3``;
parallel/sharding.compose_zero3): each rank holds its shard of the
weights, gradients and optimizer state (16Ψ/N under AdamW), each bucket's
weights gathered into transient buffers before its forward and backward
readers, at most ``prefetch + 1`` of them live per pass; trains as plain
data parallelism does; its checkpoints are whole and reshard."""
import json
import re

import numpy as np
import pytest

from purine_mpi.comm.verify import comm_signature, compare_signatures
from purine_mpi.ops.updates import UPDATE_OP_TYPES
from purine_mpi.parallel.sharding import PARAM_GATHERED_KIND, WORKING_SET_ATTR
from purine_mpi.runtime.footprint import model_state_bytes
from purine_mpi.runtime.memory_plan import check_plan, plan_memory
from purine_mpi.tools.graph import compose_for
from tests.conftest import make_job
from tests.test_micro_batches import _params
from tests.test_sharded import _job, _losses, _model_state, _same, _train, data_ckpt_10
from tests.test_sharded23 import _big, _psi


def _gathered(g):
    """{root: "forward" | "backward"} of the full weight buffers of ``g``."""
    return {name: "backward" if b.kind == PARAM_GATHERED_KIND else "forward"
            for name, b in g.blobs.items()
            if b.alias_of is None and b.attrs.get(WORKING_SET_ATTR) == "weights"}


@pytest.mark.parametrize("n", [2, 3])
def test_stage3_holds_16_psi_over_n(n):
    """Held bytes per rank (AdamW, float32: 4 weight + 4 gradient + 8
    moments per weight, each 1/N) within 5% of 16Ψ/N on every rank; the
    gathered weights and the gradient buckets are the working set,
    transient in the plan (not persistent), and peak = held + working."""
    psi = _psi(compose_for(make_job(_big("none")), 1, 0))
    for rank in range(n):
        g = compose_for(make_job(_big("sharded", shard=3)), n, rank)
        plan = plan_memory(g)
        assert check_plan(g, plan) == []
        held = model_state_bytes(g, plan)
        want = 16.0 * psi / n
        assert abs(held["held"] - want) <= 0.05 * want, (n, rank, held, want)
        assert held["weights"] * n == pytest.approx(4 * psi, rel=0.05)
        full = _gathered(g)
        assert set(full.values()) == {"forward", "backward"}
        for root in full:
            assert root in plan.offsets and root not in plan.persistent, root
        shards = [b for b in g.blobs if re.fullmatch(r"weight_bucket\d+\.shard", b)]
        assert shards and all(s in plan.persistent for s in shards)
        assert 0 < held["working"] and held["peak"] == held["held"] + held["working"]


@pytest.mark.parametrize("prefetch,solver", [(1, "adamw"), (2, "adamw"), (1, "sgd")])
def test_stage3_live_full_buffers_bounded_by_prefetch(prefetch, solver):
    """From the memory plan's lifetimes: at no op are more than prefetch+1
    units' forward buffers live, nor more than prefetch+1 backward ones;
    the collectives' seq is the same on every rank and passes
    comm/verify's comparison of the ranks' signatures; a shard's gathers
    come before the updates that write it in place."""
    seqs, signatures = [], []
    for rank in range(3):
        g = compose_for(make_job(_job("sharded", solver, shard=3, prefetch=prefetch)), 3, rank)
        plan = plan_memory(g)
        full = _gathered(g)
        assert sum(1 for v in full.values() if v == "forward") >= 2 * (prefetch + 1)
        for which in ("forward", "backward"):
            assert not [r for r, v in full.items() if v == which and r in plan.persistent]
            spans = [plan.lifetimes[r] for r, v in full.items() if v == which]
            worst = max(sum(1 for a, b in spans if a <= at <= b) for at in range(len(plan.order)))
            assert 1 <= worst <= prefetch + 1, (which, worst)
        gathers = [op for op in g.ops.values() if op.op_type == "Allgather"]
        waiting = [op for op in gathers if any(g.ops[c].op_type != "Allgather"
                                               for c in op.control_inputs)]
        assert len(waiting) >= len(gathers) - 2 * prefetch  # the prefetch edges
        signatures.append(comm_signature(g))
        seqs.append(sorted((op.attrs["seq"], op.name) for op in g.ops.values()
                           if op.op_type in ("Allgather", "ReduceScatter")))
        at = {o: i for i, o in enumerate(plan.order)}
        for shard in (b for b in g.blobs if re.fullmatch(r"weight_bucket\d+\.shard", b)):
            readers = [op.name for op in g.ops.values() if shard in op.inputs]
            updates = [op.name for op in g.ops.values() if op.op_type in UPDATE_OP_TYPES and
                       g.storage_root(op.outputs[0]) == shard]
            assert {g.ops[r].op_type for r in readers} == {"Allgather"}, shard
            assert max(at[r] for r in readers) < min(at[u] for u in updates or [len(at)])
    assert seqs[0] == seqs[1] == seqs[2]
    assert compare_signatures(signatures) == []


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("solver,rtol", [("adamw", 1e-5), ("sgd", 2e-6)])
def test_stage3_trains_as_data_parallel(tmp_path, n, solver, rtol):
    """20 steps (a test pass at 10 and 20, through the gathered test
    weights): weights and optimizer state equal data parallelism's bit for
    bit on 2 ranks, within ``rtol`` of each blob's largest magnitude on 3;
    the same test losses. The start-up line: weights held are 1/N (up to
    an element per bucket), the peak adds the working set."""
    runs, texts = [], []
    for scheme, par in (("data", {}), ("sharded", {"shard": 3, "check_collectives": True})):
        cfg = _job(scheme, solver, iters=20, **par)
        cfg["solver"]["test_interval"] = 10
        out, text = _train(tmp_path, scheme, n, cfg)
        runs.append(out)
        texts.append(text)
    assert "sharded (ZeRO stage 3)" in texts[1]
    a, b = _params(runs[0] / "latest.h5"), _params(runs[1] / "latest.h5")
    _same(a, b, 0.0 if n == 2 else rtol)
    tests = [re.findall(r"test @ iter \d+: loss (\S+)", t) for t in texts]
    assert len(tests[0]) == 2 and tests[0] == tests[1] if n == 2 else \
        np.allclose(np.array(tests[0], float), np.array(tests[1], float), rtol=1e-4)
    weights, grads, _ = _model_state(texts[1])
    data_weights = model_state_bytes(compose_for(make_job(_job("data", solver)), n, 0))["weights"]
    buckets = int(re.search(r"reduce-scattered in (\d+) buckets", texts[1]).group(1))
    assert data_weights / n <= weights <= data_weights / n + 4 * buckets
    assert data_weights / n <= grads <= data_weights / n + 4 * buckets
    peak, working = map(int, re.search(r"peak (\d+) bytes with the transient buckets' (\d+)",
                                       texts[1]).groups())
    assert working > 0 and peak == sum(_model_state(texts[1])) + working
    # memory.json holds rank 0's start-up figures beside its resident bytes
    # (benchmarks/sharded.py --rss sets the one against the other)
    ranks = json.loads((runs[1] / "memory.json").read_text())["ranks"]
    assert [r["rank"] for r in ranks] == list(range(n))
    assert ranks[0]["model_state"] == {
        "weights": weights, "gradients": grads, "optimizer_state": _model_state(texts[1])[2],
        "held": sum(_model_state(texts[1])), "working": working, "peak": peak}
    assert all(r["model_state"]["held"] <= data_weights * 4 / n + 16 * buckets for r in ranks)
    # the high-water mark after the last iteration, before the end's checkpoint
    assert all(r["baseline_rss_bytes"] < r["loop_peak_rss_bytes"] <= r["peak_rss_bytes"]
               for r in ranks)


@pytest.mark.mpi
def test_stage3_checkpoints_are_whole_and_reshard(tmp_path, train_once):
    """A 3-rank stage-3 checkpoint at iteration 10 resumes on 2 ranks under
    stage 3 and stage 1 and on 1 rank (same global batch, 24): the losses
    of iterations 11-20 equal an uninterrupted 3-rank stage-3 run's within
    1e-6. A data-parallel checkpoint starts a 2-rank stage-3 run whose
    weights match data parallelism's resumed the same way. (The iteration-10
    checkpoints are those the uninterrupted 20-step runs write: one 3-rank
    stage-3 run is both the checkpoint and the reference; the data-parallel
    one is test_sharded's, trained once.)"""
    cfg = _job("sharded", "adamw", iters=20, shard=3)
    cfg["checkpoint"] = {"interval": 10, "keep": 0}
    ref, _ = _train(tmp_path, "ref", 3, cfg)
    ckpt, want = ref / "ckpt_10.h5", _losses(ref)
    for name, n, cfg in (("s3", 2, _job("sharded", "adamw", iters=20, shard=3)),
                         ("s1", 2, _job("sharded", "adamw", iters=20, shard=1)),
                         ("one", 1, _job("data", "adamw", iters=20))):
        cfg["data"]["train"]["batch_size"] = 24 // n
        out, text = _train(tmp_path, name, n, cfg, "--resume", ckpt)
        assert "resumed from" in text
        got = _losses(out)
        assert sorted(got) == list(range(11, 21))
        for it, loss in got.items():
            assert loss == pytest.approx(want[it], rel=1e-6), (name, it)
    data_half = data_ckpt_10(train_once)  # test_sharded's too
    runs = [_params(_train(tmp_path, f"from_data_{s}", 2, _job(s, "adamw", iters=20, **par),
                           "--resume", data_half)[0] / "latest.h5")
            for s, par in (("data", {}), ("sharded", {"shard": 3}))]
    for k in runs[0]:
        assert np.array_equal(runs[0][k], runs[1][k]), k
    _, text = _train(tmp_path, "init", 2, _job("sharded", "adamw", iters=2, shard=3), "--init",
                     ckpt)
    assert "loaded 8 blobs from" in text

