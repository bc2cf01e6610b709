"""ZeRO stages 2 and 3 of ``parallel.scheme: sharded`` (``parallel.shard:
2|3``; parallel/sharding.compose_zero1): the same training as plain data
parallelism, the model state ZeRO's formulas give per rank, the full
buckets transient in the memory plan."""
import re

import numpy as np
import pytest

from purine_mpi.runtime.footprint import model_state_bytes
from purine_mpi.runtime.memory_plan import check_plan, plan_memory
from purine_mpi.tools.graph import compose_for
from tests.conftest import make_job
from tests.test_micro_batches import _params
from tests.test_sharded import _job, _model_state, _same, _train
from tests.test_tensor_parallel import _config


def _big(scheme, solver="adamw", **parallel):
    """The residual MLP with a 512-wide hidden layer (8,813 weights), 4 KiB
    buckets: big enough that a shard's rounding (one element per bucket)
    stays far below 1% of the model state."""
    cfg = _config(scheme=scheme, hidden=512, solver=solver)
    cfg["parallel"] = dict({"scheme": scheme, "bucket_mb": 0.004, "first_bucket_mb": 0.002},
                           **parallel)
    return cfg


def _psi(graph):
    """Ψ: the weights of the net (the parameters' own storage, once each)."""
    return sum(b.size for b in graph.blobs.values() if b.kind == "param" and b.alias_of is None)


#: ZeRO's bytes per rank for Ψ float32 weights on N ranks under AdamW (4
#: weight, 4 gradient, 8 moments per weight): stage 1 8Ψ + 8Ψ/N (its
#: gradient shard is the bucket's own range, reduced in place), stage 2
#: 4Ψ + 12Ψ/N (docs/parallel.md, "Sharded").
FORMULAS = {"data": lambda n: 16.0, 1: lambda n: 8 + 8.0 / n, 2: lambda n: 4 + 12.0 / n}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_held_model_state_matches_zero_formulas(n):
    """Held bytes per rank (every rank) from the composed graph and the
    memory plan, against FORMULAS·Ψ within 5%; the stage-2 gradient
    buckets are the working set: planned, not held, and peak = held +
    working."""
    psi = _psi(compose_for(make_job(_big("none")), 1, 0))
    assert psi > 8000
    for rank in range(n):
        for stage in ("data", 1, 2):
            cfg = _big("data") if stage == "data" else _big("sharded", shard=stage)
            g = compose_for(make_job(cfg), n, rank)
            plan = plan_memory(g)
            held = model_state_bytes(g, plan)
            want = FORMULAS[stage](n) * psi
            assert abs(held["held"] - want) <= 0.05 * want, (n, rank, stage, held, want)
            assert held["peak"] == held["held"] + held["working"]
            if stage == 2:
                buckets = [r for r in plan.offsets if re.fullmatch(r"grad_bucket\d+", r)]
                assert buckets and not [r for r in plan.persistent if
                                        re.fullmatch(r"grad_bucket\d+", r)]
                assert 0 < held["working"] <= 4 * psi + 64 * len(buckets)
            else:
                assert held["working"] == 0
            if stage == 1:  # the gradients: the buckets alone, no shard of their own
                assert held["gradients"] == 4 * psi, (n, rank, held)


def test_stage2_bucket_dies_at_its_reduce_scatter():
    """Each stage-2 gradient bucket is a transient root of the plan whose
    last reader is its ReduceScatter (its lifetime ends there), the plan is
    sound (no two unordered roots share bytes), and the micro-batches'
    sums write into the bucket before it (adding in place: copy 0's
    gradients and the running sums are views of it, read by the sums)."""
    for extra in ({}, {"micro_batches": 2}):
        g = compose_for(make_job(_job("sharded", "adamw", shard=2, **extra)), 3, 1)
        plan = plan_memory(g, order_ops=True)
        assert check_plan(g, plan) == []
        cons = g.consumers()
        rs = {op.attrs["bucket"]: op.name for op in g.ops.values()
              if op.op_type == "ReduceScatter"}
        assert rs
        for bucket, op in rs.items():
            assert bucket in plan.offsets, bucket
            readers = {c.name for b in g.blobs if g.storage_root(b) == bucket
                       for c in cons.get(b, ())}
            sums = {n for n in readers if ".micro_sum" in n} if extra else set()
            assert readers - sums == {op}, (bucket, readers)
            assert plan.order[plan.lifetimes[bucket][1]] == op
        if extra:
            sums = [op for op in g.ops.values() if op.name.endswith(".micro_sum")]
            assert sums and all(g.storage_root(op.outputs[0]) in rs for op in sums)


@pytest.mark.parametrize("prefetch", [1, 2])
def test_stage2_live_buckets_bounded_by_prefetch(prefetch):
    """Each writer of gradient bucket k + 1 + prefetch waits for bucket k's
    reduce-scatter, so at most prefetch + 1 full buckets are live at once
    in the memory plan's schedule (all 8 were), and the arena is smaller
    than with every bucket live (the plan without the edges); on every
    rank the collectives' signatures agree and the graph has no cycle;
    with micro-batches (every bucket accumulates across them) the edges
    that would close a cycle are left out."""
    from purine_mpi.comm.verify import comm_signature, compare_signatures
    signatures = []
    for rank in range(3):
        g = compose_for(make_job(_job("sharded", "adamw", shard=2, prefetch=prefetch)), 3, rank)
        plan = plan_memory(g)
        spans = [plan.lifetimes[r] for r in plan.lifetimes if re.fullmatch(r"grad_bucket\d+", r)]
        assert len(spans) == 8
        worst = max(sum(1 for a, b in spans if a <= at <= b) for at in range(len(plan.order)))
        assert worst == prefetch + 1, worst
        rs = {op.name for op in g.ops.values() if op.op_type == "ReduceScatter"}
        waiting = [op for op in g.ops.values() if rs & set(op.control_inputs)]
        assert waiting
        for op in waiting:
            op.control_inputs = [c for c in op.control_inputs if c not in rs]
        assert plan_memory(g).total_bytes > plan.total_bytes
        signatures.append(comm_signature(compose_for(make_job(
            _job("sharded", "adamw", shard=2, prefetch=prefetch)), 3, rank)))
    assert compare_signatures(signatures) == []
    g = compose_for(make_job(_job("sharded", "adamw", shard=2, micro_batches=2)), 3, 0)
    g.topo_order()


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("solver,rtol", [("adamw", 1e-5), ("sgd", 2e-6)])
def test_stage2_trains_as_data_parallel(tmp_path, train_once, n, solver, rtol):
    """30 steps: weights and optimizer state equal data parallelism's bit
    for bit on 2 ranks (the reduce-scatter's a + b is the allreduce's); on
    3 ranks within ``rtol`` of each blob's largest magnitude (MPICH may add
    3 ranks' values in another order in reduce-scatter than in
    allreduce). The start-up line: the gradients held are 1/N of the
    buckets (up to an element per bucket), the peak adds the buckets."""
    data, _ = train_once(n, _job("data", solver))  # test_sharded's reference too
    shard, text = _train(tmp_path, "sharded", n, _job("sharded", solver, shard=2))
    assert "sharded (ZeRO stage 2)" in text
    a, b = _params(data / "latest.h5"), _params(shard / "latest.h5")
    _same(a, b, 0.0 if n == 2 else rtol)
    weights, grads, _ = _model_state(text)
    buckets = int(re.search(r"reduce-scattered in (\d+) buckets", text).group(1))
    assert weights / n <= grads <= weights / n + 4 * buckets
    peak, working = map(int, re.search(r"peak (\d+) bytes with the transient buckets' (\d+)",
                                       text).groups())
    assert peak == sum(_model_state(text)) + working and working > 0


@pytest.mark.mpi
def test_stage2_micro_batches_and_clipping_as_data_parallel(tmp_path, train_once):
    """3 ranks, 20 steps: micro-batches summed into the transient bucket
    before its reduce-scatter (AdamW), and clip_gradients on the gradient
    shards (SGD, a clip acting every step): within 2e-6 of data
    parallelism."""
    for name, extra, solver in (("mb", {"micro_batches": 2}, "adamw"), ("clip", {}, "sgd")):
        runs = []
        for scheme, par in (("data", {}), ("sharded", {"shard": 2})):
            cfg = _job(scheme, solver, iters=20, **extra, **par)
            if name == "clip":
                cfg["solver"]["clip_gradients"] = 0.05
            out = train_once(3, cfg)[0] if scheme == "data" else \
                _train(tmp_path, f"{name}_{scheme}", 3, cfg)[0]  # data: test_sharded's too
            runs.append(_params(out / "latest.h5"))
        for k in runs[0]:
            scale = float(np.abs(runs[0][k]).max())
            assert float(np.abs(runs[0][k] - runs[1][k]).max()) <= 2e-6 * scale, (name, k)


@pytest.mark.parametrize("change,key,words", [
    ({"parallel": {"shard": 2, "transport": "one_sided"}}, "parallel.transport", "one_sided"),
    ({"parallel": {"shard": 2, "backend": "nccl"}}, "parallel.backend", "nccl"),
    ({"parallel": {"shard": 2, "tensor_parallel": 2, "micro_batches": 2}},
     "parallel.micro_batches", "tensor_parallel takes no micro-batches"),
    ({"parallel": {"shard": 2, "stages": {"fc0": 0}}}, "parallel.stages", "have no stage"),
    ({"parallel": {"shard": 2}, "device": 0}, "parallel.backend", "through NCCL"),
])
def test_stage2_refusals_exit_2(tmp_path, change, key, words):
    from tests.conftest import run_cli_args, write_config_file
    from tests.test_cli import assert_user_error
    cfg = _job("sharded", "sgd")
    for section, value in change.items():
        if section == "parallel":
            cfg["parallel"].update(value)
        else:
            cfg[section] = value
    res = run_cli_args("train", write_config_file(tmp_path, cfg), "--out", tmp_path / "r")
    assert_user_error(res, key, words)
