"""Sharded training, ZeRO stage 1 (``parallel.scheme: sharded``,
``parallel.shard: 1``; parallel/schemes/sharded.py): trains as plain data
parallelism does (bitwise on 2 ranks, within 1e-5 / 2e-6 relative on 3),
holds 1/N of its optimizer state per rank, writes whole checkpoints that
resume under data parallelism and on any number of ranks (and takes any
checkpoint), and refuses what is not built with exit 2 naming the key."""
import json
import re

import numpy as np
import pytest

from purine_mpi.runtime.footprint import model_state_bytes
from purine_mpi.tools.graph import compose_for
from tests.conftest import (make_job, run_cli_args, run_cli_here, run_mpi_cli, train_here,
                            write_config_file)
from tests.test_cli import assert_user_error
from tests.test_micro_batches import _params
from tests.test_tensor_parallel import _config



def _same(a, b, rtol=0.0):
    """Every blob of b equals a's, bit for bit with ``rtol`` 0, else within
    ``rtol`` of a's largest magnitude; a holds solver state."""
    assert sorted(a) == sorted(b) and any(k.startswith("solver/") for k in a)
    for k in a:
        if rtol == 0:
            assert np.array_equal(a[k], b[k]), k
        else:
            scale = max(float(np.abs(a[k]).max()), 1e-30)
            assert float(np.abs(a[k] - b[k]).max()) <= rtol * scale, k

def _job(scheme, solver="adamw", iters=30, **parallel):
    """The residual MLP of test_tensor_parallel, small buckets (8 of them,
    so shards cut weights apart), 30 steps."""
    cfg = _config(scheme=scheme, iters=iters, solver=solver)
    if solver == "sgd":
        cfg["solver"]["momentum"] = 0.9
    cfg["parallel"] = dict({"scheme": scheme, "bucket_mb": 0.0001, "first_bucket_mb": 0.00005},
                           **parallel)
    if scheme == "sharded":
        cfg["parallel"].setdefault("shard", 1)
    return cfg


def _train(tmp_path, name, n, cfg, *extra):
    """(run folder, the command's output); a one-rank reference (no
    ``extra``) trains in this process (conftest.train_here): (folder,
    None); so does a one-rank resume (``extra``: ``--resume CKPT`` alone):
    (folder, the run's lines: "resumed from ..." and the rest; the
    ``--resume`` option itself is the command's, tests/test_cli.py,
    tests/test_misuse.py)."""
    path = write_config_file(tmp_path, cfg, f"{name}.yaml")
    out = tmp_path / name
    if n == 1 and not extra:
        return train_here(cfg, out), None
    if n == 1 and len(extra) == 2 and extra[0] == "--resume":
        lines = []
        train_here(path, out, resume=extra[1], lines=lines)
        return out, "\n".join(lines)
    args = ("train", path, "--out", out, *extra)
    res = run_mpi_cli(n, *args, timeout=300) if n > 1 else run_cli_args(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    return out, res.stdout + res.stderr


def _losses(run_dir):
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return {r["iter"]: r["loss"] for r in rows if r.get("phase") == "train" and "loss" in r}


def _model_state(text):
    """The start-up block's bytes: (weights, gradients, optimizer state)."""
    m = re.search(r"model state .*\((\d+) \+ (\d+) \+ (\d+) bytes held[;)]", text)
    assert m, text
    return tuple(int(x) for x in m.groups())


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("solver,rtol", [("adamw", 1e-5), ("sgd", 2e-6)])
def test_sharded_trains_as_data_parallel(tmp_path, train_once, n, solver, rtol):
    """30 steps: weights and the (gathered) optimizer state equal data
    parallelism's bit for bit on 2 ranks (a + b either way); on 3 within
    ``rtol`` of each blob's largest magnitude (MPICH sums 3 ranks in
    another order in reduce-scatter than in allreduce). Each rank holds
    1/N of data parallelism's optimizer state (the start-up line, from the
    graph's blobs), and the weights and gradients whole (no more)."""
    data, _ = train_once(n, _job("data", solver))  # test_sharded23's reference too
    shard, text = _sharded_30(train_once, n, solver)
    assert "sharded (ZeRO stage 1)" in text
    a, b = _params(data / "latest.h5"), _params(shard / "latest.h5")
    _same(a, b, 0.0 if n == 2 else rtol)
    weights, grads, state = _model_state(text)
    plain = model_state_bytes(compose_for(make_job(_job("data", solver)), n, 0))
    buckets = int(re.search(r"reduce-scattered in (\d+) buckets", text).group(1))
    per_element = 8 if solver == "adamw" else 4
    assert weights == plain["weights"]
    # the gradient shard is the bucket's range (reduced in place): no bytes of its own
    assert grads == plain["gradients"]
    # rank 0's shard of a bucket is ceil(n / N) elements: at most one more each
    assert plain["optimizer_state"] / n <= state <= \
        plain["optimizer_state"] / n + per_element * buckets


@pytest.mark.mpi
def test_micro_batches_and_clipping_as_data_parallel(tmp_path, train_once):
    """Micro-batches accumulate before the reduce-scatter (bitwise on 3
    ranks here); clip_gradients' global norm is one allreduce of the
    shards' sums of squares (a clip acting every step; within 2e-6)."""
    for name, extra, solver in (("mb", {"micro_batches": 2}, "adamw"), ("clip", {}, "sgd")):
        runs = []
        for scheme in ("data", "sharded"):
            cfg = _job(scheme, solver, iters=20, **extra)
            if name == "clip":
                cfg["solver"]["clip_gradients"] = 0.05
            out = train_once(3, cfg)[0] if scheme == "data" else \
                _train(tmp_path, f"{name}_{scheme}", 3, cfg)[0]  # data: test_sharded23's too
            runs.append(_params(out / "latest.h5"))
        for k in runs[0]:
            scale = float(np.abs(runs[0][k]).max())
            assert float(np.abs(runs[0][k] - runs[1][k]).max()) <= 2e-6 * scale, (name, k)
    g = compose_for(make_job(dict(_job("sharded", "sgd"), solver=dict(
        _job("sharded", "sgd")["solver"], clip_gradients=0.05))), 3, 1)
    seqs = {op.op_type: [] for op in g.ops.values() if "seq" in op.attrs}
    for op in g.ops.values():
        if "seq" in op.attrs:
            seqs[op.op_type].append(op.attrs["seq"])
    # the norm's allreduce between the reduce-scatters and the gathers
    assert max(seqs["ReduceScatter"]) < min(seqs["Allreduce"]) < min(seqs["Allgather"])
    assert g.ops["clip.sum"].attrs["group"] == [0, 1, 2]


def _sharded_30(train_once, n, solver):
    """Scheme sharded's 30 steps (stage 1) on ``n`` ranks, a checkpoint
    every 10 (which changes no bit of the run), trained once a session: the
    run of test_sharded_trains_as_data_parallel, and (AdamW, 2 ranks) the
    sharded checkpoint at 10 of test_checkpoints_are_whole_and_reshard (the
    lr is fixed: 10 steps of a 30-step run are a 10-step run's; before, that
    test trained the 10 steps in a launch of its own)."""
    cfg = _job("sharded", solver)
    cfg["checkpoint"] = {"interval": 10, "keep": 0}
    return train_once(n, cfg)


def _data_20(train_once):
    """Scheme data's 20 AdamW steps on 2 ranks, a checkpoint at 10 (which
    changes no bit of the run), trained once a session: the uninterrupted
    run and the data-parallel checkpoint of
    test_checkpoints_are_whole_and_reshard, that checkpoint
    test_sharded3's too."""
    cfg = _job("data", "adamw", iters=20)
    cfg["checkpoint"] = {"interval": 10, "keep": 0}
    return train_once(2, cfg)


def data_ckpt_10(train_once):
    """_data_20's iteration-10 checkpoint: a data-parallel checkpoint."""
    return _data_20(train_once)[0] / "ckpt_10.h5"


@pytest.mark.mpi
def test_checkpoints_are_whole_and_reshard(tmp_path, train_once):
    """A 2-rank sharded checkpoint at iteration 10 resumes under scheme
    data on 2 ranks and on 1 rank (same global batch): the losses of
    iterations 11-20 equal an uninterrupted 2-rank run's within 1e-6. A
    data-parallel checkpoint starts a 3-rank sharded run whose weights
    match data parallelism's resumed on 3 ranks (each rank's shard of the
    whole moments was loaded). (The uninterrupted run and the data-parallel
    checkpoint at 10 are one run, _data_20's; the sharded checkpoint at 10
    is _sharded_30's.)"""
    ref, _ = _data_20(train_once)
    ckpt = _sharded_30(train_once, 2, "adamw")[0] / "ckpt_10.h5"
    want = _losses(ref)
    for name, n, cfg in (("data2", 2, _job("data", "adamw", iters=20)),
                         ("one", 1, _job("data", "adamw", iters=20))):
        if n == 1:
            cfg["data"]["train"]["batch_size"] = 16
        out, text = _train(tmp_path, name, n, cfg, "--resume", ckpt)
        assert "resumed from" in text
        got = _losses(out)
        assert sorted(got) == list(range(11, 21))
        for it, loss in got.items():
            assert loss == pytest.approx(want[it], rel=1e-6), (name, it)
    data_half = data_ckpt_10(train_once)  # test_sharded3's too
    runs = [_params(_train(tmp_path, f"from_data_{s}", 3, _job(s, "adamw", iters=20),
                           "--resume", data_half)[0] / "latest.h5")
            for s in ("data", "sharded")]
    for k in runs[0]:
        scale = max(float(np.abs(runs[0][k]).max()), 1e-30)
        assert float(np.abs(runs[0][k] - runs[1][k]).max()) <= 1e-5 * scale, k
    # --init: any weights file starts a sharded run
    _, text = _train(tmp_path, "init", 2, _job("sharded", "adamw", iters=2), "--init", ckpt)
    assert "loaded 8 blobs from" in text


@pytest.mark.parametrize("change,key,words", [
    ({"parallel": {"shard": 4}}, "parallel.shard", "1, 2 and 3"),
    ({"parallel": {"transport": "one_sided"}}, "parallel.transport", "one_sided"),
    ({"parallel": {"backend": "nccl"}}, "parallel.backend", "nccl"),
    ({"parallel": {"mode": "sync_ps"}}, "parallel.mode", "parameter servers"),
    ({"parallel": {"stages": {"fc0": 0}}}, "parallel.stages", "have no stage"),
    ({"device": 0}, "parallel.backend", "runs its collectives through NCCL"),
    ({"parallel": {"shard": 3, "transport": "one_sided", "backend": "nccl"}},
     "parallel.transport", "one_sided with backend nccl"),
    ({"parallel": {"backend": "nccl"}, "solver": {"clip_gradients": 1.0}},
     "solver.clip_gradients", "backend nccl"),
])
def test_what_is_not_built_exits_2(tmp_path, change, key, words):
    cfg = _job("sharded", "sgd")
    for section, value in change.items():
        if section in ("parallel", "solver"):
            cfg[section].update(value)
        else:
            cfg[section] = value
    res = run_cli_args("train", write_config_file(tmp_path, cfg), "--out", tmp_path / "r")
    assert_user_error(res, key, words)


def test_graph_np_composes_each_rank(tmp_path):
    path = write_config_file(tmp_path, _job("sharded"), "s.yaml")
    res = run_cli_here("graph", path, "--np", "3", "--rank", "2")
    assert res.returncode == 0, res.stderr
    assert "rank 2 holds shard 2 of 3" in res.stdout
    assert "ReduceScatter" in res.stdout and "Allgather" in res.stdout


@pytest.mark.parametrize("extra", [{}, {"micro_batches": 2}, {"clip": 0.05}])
def test_stage1_gradient_shard_is_the_buckets_range(extra):
    """Stage 1 reduce-scatters in place: each ReduceScatter's outputs are
    views of its bucket's range [lo, hi) (no storage of their own, so the
    memory plan and the model state count no shard bytes), and after it
    only the bucket's range is read (MPI_IN_PLACE leaves the rest
    undefined): by the shard updates and clip_gradients' norm."""
    from purine_mpi.comm.ops import shard_range
    extra = dict(extra)
    clip = extra.pop("clip", None)
    for n, rank in ((2, 1), (3, 2)):
        cfg = _job("sharded", "adamw", **extra)
        if clip is not None:
            cfg["solver"]["clip_gradients"] = clip
        g = compose_for(make_job(cfg), n, rank)
        order = {op.name: i for i, op in enumerate(g.topo_order())}
        rs = [op for op in g.ops.values() if op.op_type == "ReduceScatter"]
        assert len(rs) == 8
        for op in rs:
            bucket = op.attrs["bucket"]
            total = g.blobs[bucket].size
            lo, hi = shard_range(total, n, rank)
            assert op.outputs and all(g.storage_root(o) == bucket for o in op.outputs)
            assert g.blobs[f"{bucket}.shard"].alias_of == bucket
            spans = sorted((g._abs_offset(o), g.blobs[o].size) for o in op.outputs)
            assert spans[0][0] == lo and sum(s for _, s in spans) == hi - lo
            after = [c for c in g.ops.values() if order[c.name] > order[op.name]]
            readers = {c.name for c in after for b in c.inputs
                       if g.storage_root(b) == bucket}
            assert readers, bucket
            for c in after:
                for b in c.inputs:
                    if g.storage_root(b) == bucket:
                        at = g._abs_offset(b)
                        assert lo <= at and at + g.blobs[b].size <= hi, (c.name, b)
            if clip is not None:
                assert "clip.norm" in readers
        data = _job("data", "adamw", **extra)
        data["solver"] = cfg["solver"]
        assert model_state_bytes(g)["gradients"] == \
            model_state_bytes(compose_for(make_job(data), n, rank))["gradients"]


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_streamed_save_equals_the_join_of_every_ranks_parts(tmp_path, n):
    """The save streams each bucket's shards to rank 0 (one Igatherv per
    bucket and blob) as it writes: on 2 and 3 ranks, stages 1, 2 and 3,
    AdamW and SGD with momentum, every checkpoint holds the datasets the
    join of every rank's raw parts gives, bit for bit and in its order, each
    with its Fletcher-32 checksum (tests/mpi_scripts/sharded_save.py)."""
    from tests.mpi_scripts.launch import run_mpi
    proc, _ = run_mpi("sharded_save.py", n, tmp_path, timeout=600)
    assert proc.stdout.count(f"OK sharded_save n={n} rank") == n, proc.stdout + proc.stderr
