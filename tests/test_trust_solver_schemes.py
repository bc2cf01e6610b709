"""Trust audit: what the solver does under each parallel scheme, against one
rank of the same global batch.

A pipeline stage that holds no parameter (the loss alone, which
``parallel.stages`` or an automatic cut can make) under
``solver.clip_gradients``: its share of the global norm is a zero placed on
its own rank (before: ``GradNormSq`` refused zero gradients, exit 1 at
start-up, and the op was placed on rank 0's host, so partitioning dropped
the stage's Allreduce); and its progress line's rate comes from the
solver's policy (before: ``KeyError: 'lr'`` on that rank after iteration
1). Scheme sharded with such a stage (the loss alone, or the relu that reads
the data) trains as one rank, its checkpoints resuming either way (before:
exit 2; past that refusal shard 3 failed at start-up on ``min()`` of nothing
and shard 1 and 2 trained, then stalled at the end: the stage's ranks, with
no bucket, skipped the save's gathers the other stage's ranks posted).
And a guard of what the audit found right: per-parameter ``lr_mult`` / ``decay_mult`` (biases and norms
at decay_mult 0) with AdamW's decoupled decay and a clip that acts, under
sharded stage 1 (one flat bucket mixes parameters of several multipliers)
and tensor parallelism (split weights and biases, a row-split layer's
bias and the layer norm held whole on every shard), train as one rank."""
import json

import numpy as np
import pytest

from purine_mpi.tools.graph import compose_for, composed
from tests.conftest import make_job, run_mpi_cli, train_here, write_config_file
from tests.test_micro_batches import _params

#: every layer with weights on stage 0, the loss alone on stage 1
LOSS_ALONE = {"fc0": 0, "ln": 0, "fc1": 0, "act": 0, "fc2": 0, "res": 0, "out": 0, "loss": 1}


def _mults(lr, decay):
    return [{"lr_mult": lr[0], "decay_mult": decay[0]}, {"lr_mult": lr[1], "decay_mult": decay[1]}]


def _config(parallel=None, batch=8, clip=0.5, iters=4):
    """A residual MLP block with a layer norm on synthetic data, every
    parameter with its own multipliers (biases and the norm at decay_mult
    0), AdamW with weight decay, a step schedule and a clip that acts (on
    one rank, the first step's norm is above 0.5)."""
    net = [
        {"type": "fc", "name": "fc0", "bottom": "data", "top": "x", "num_output": 8,
         "param": _mults((2, 3), (0.5, 0))},
        {"type": "layer_norm", "name": "ln", "bottom": "x", "top": "xn",
         "param": _mults((0.5, 4), (0, 0))},
        {"type": "fc", "name": "fc1", "bottom": "xn", "top": "h", "num_output": 16,
         "param": _mults((1, 0.5), (2, 0))},
        {"type": "relu", "name": "act", "bottom": "h", "top": "h"},
        {"type": "fc", "name": "fc2", "bottom": "h", "top": "m", "num_output": 8,
         "param": _mults((1.5, 2), (1, 0))},
        {"type": "eltwise", "name": "res", "bottom": ["xn", "m"], "top": "y"},
        {"type": "fc", "name": "out", "bottom": "y", "top": "logits", "num_output": 5,
         "param": _mults((0.25, 1), (3, 0))},
        {"type": "softmax_loss", "name": "loss", "bottom": ["logits", "label"], "top": "loss"},
    ]
    solver = {"type": "adamw", "base_lr": 0.01, "delta": 1e-4, "weight_decay": 0.1,
              "lr_policy": "step", "stepsize": 2, "gamma": 0.5, "max_iter": iters,
              "display": 1, "test_interval": 0}
    if clip:
        solver["clip_gradients"] = clip
    return {"name": "solver_schemes", "seed": 5,
            "data": {"train": {"source": "synthetic", "shape": [6], "classes": 5,
                               "batch_size": batch}},
            "net": net, "solver": solver, "checkpoint": {"interval": iters},
            "parallel": parallel or {}}


def _train(tmp_path, name, n, cfg, *more):
    """``train`` on ``n`` ranks (one: in this process, conftest.train_here;
    ``more``: ``--resume``, CKPT): (the params of latest.h5, its train rows'
    (iter, lr))."""
    out = tmp_path / name
    if n == 1:
        train_here(cfg, out, resume=more[1] if more else None)
    else:
        res = run_mpi_cli(n, "train", write_config_file(tmp_path, cfg, f"{name}.yaml"),
                          "--out", out, *more)
        assert res.returncode == 0, res.stdout + res.stderr
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return _params(out / "latest.h5"), [(r["iter"], r["lr"]) for r in rows
                                        if r.get("phase") == "train"]


def _close(got, ref):
    assert sorted(got) == sorted(ref) and ref
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.fixture(scope="module")
def one_rank_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("one_rank")


@pytest.fixture(scope="module")
def one_rank(one_rank_dir):
    """The one-rank reference of the global batch of 8 (its checkpoint at
    each iteration too, one_rank_dir / "one" / "ckpt_1.h5" ...: a save
    changes no bit of the run), and the same without the clip (so a test
    can tell that the clip acted)."""
    cfg = _config()
    cfg["checkpoint"] = {"interval": 1, "keep": 0}
    return (_train(one_rank_dir, "one", 1, cfg),
            _train(one_rank_dir, "noclip", 1, _config(clip=None)))


@pytest.mark.parametrize("scheme,n", [("pipeline", 2), ("hybrid", 4)])
def test_clip_on_a_stage_without_parameters_is_its_ranks_zero(scheme, n):
    """Offline: the stage holding the loss alone adds a zero to the norm
    (a Constant, no GradNormSq of nothing) on its own rank, and its
    Allreduce is in its graph with the replica's ranks."""
    job = make_job(_config({"scheme": scheme, "stages": LOSS_ALONE}))
    for rank in range(n):
        g = compose_for(job, n, rank)
        norm, total = g.ops["clip.norm"], g.ops["clip.sum"]
        stage = rank % 2
        assert norm.op_type == ("Constant" if stage == 1 else "GradNormSq")
        assert norm.location.rank == total.location.rank == rank
        assert total.attrs["group"] == [rank - stage, rank - stage + 1]


@pytest.mark.mpi
@pytest.mark.parametrize("clip", [0.5, None], ids=["clipped", "unclipped"])
def test_pipeline_stage_without_parameters_trains_as_one_rank(tmp_path, one_rank, clip):
    """2 stages, the second the loss alone, clipped or not: the weights and
    Adam's moments after 4 steps are one rank's (1e-5), the clip acted, and
    every train row's rate is one rank's (the step schedule halves it at
    2; unclipped, the loss's rank once failed to show it)."""
    (clipped, ref_lr), (unclipped, _) = one_rank
    assert not np.allclose(unclipped["params/fc1/weight"], clipped["params/fc1/weight"],
                           rtol=1e-4)
    got, lr = _train(tmp_path, "pipe", 2, _config({"scheme": "pipeline", "stages": LOSS_ALONE},
                                                  clip=clip))
    _close(got, clipped if clip else unclipped)
    assert lr == ref_lr and [v for _, v in lr] == pytest.approx([0.01, 0.01, 0.005, 0.005])


def _relu_first(parallel=None, batch=8, iters=4):
    """``_config`` behind a relu of the data (``pre``: no parameter), with
    a test split: under ``RELU_FIRST`` the stage that reads the data holds
    no parameter, and the end's test pass reads stage 3's gathered weights."""
    cfg = _config(parallel, batch=batch, iters=iters)
    cfg["net"] = [{"type": "relu", "name": "pre", "bottom": "data", "top": "pre"}] + [
        dict(layer, bottom="pre") if layer["name"] == "fc0" else layer for layer in cfg["net"]]
    cfg["data"]["test"] = {"source": "synthetic", "shape": [6], "classes": 5, "batch_size": 8,
                           "num_samples": 32, "shuffle": False}
    return cfg


#: the relu of the data alone on stage 0, every layer with weights on stage 1
RELU_FIRST = {"pre": 0, **{k: 1 for k in LOSS_ALONE}}


def _test_loss(out):
    return [r["loss"] for r in map(json.loads, open(out / "metrics.jsonl"))
            if r.get("phase") == "test"]


@pytest.mark.parametrize("stages,shard", [(LOSS_ALONE, 1), (RELU_FIRST, 3)],
                         ids=["loss_alone-shard1", "relu_first-shard3"])
def test_sharded_stage_without_parameters_composes(stages, shard):
    """Offline, 2 replicas x 2 stages: the stage holding no parameter has
    no bucket and no collective of the plan (its clip Allreduce over every
    rank only), the other stage's ranks reduce-scatter and gather over
    their 2 ranks in the same seq order, and every rank's Composition says
    the run shards (what a save's and a test pass's collectives follow,
    on every rank alike)."""
    make = _relu_first if stages is RELU_FIRST else _config
    job = make_job(make({"scheme": "sharded", "shard": shard, "stages": stages}, batch=4))
    empty = 1 if stages is LOSS_ALONE else 0
    seqs = []
    for rank in range(4):
        comp = composed(job, 4, rank)[1]
        coll = sorted((op.attrs["seq"], op.op_type, op.attrs["group"])
                      for op in comp.graph.ops.values()
                      if op.op_type in ("ReduceScatter", "Allgather", "Allreduce"))
        assert comp.shard == shard
        if rank % 2 == empty:
            assert not comp.shard_plan and [c[1:] for c in coll] == [
                ("Allreduce", [0, 1, 2, 3])]
        else:
            assert comp.shard_plan and {tuple(c[2]) for c in coll if c[1] != "Allreduce"} \
                == {(rank % 2, 2 + rank % 2)}
            seqs.append(coll)
    assert seqs[0] == seqs[1]


@pytest.mark.mpi
@pytest.mark.parametrize("stages,shard", [(LOSS_ALONE, 2), (RELU_FIRST, 3)],
                         ids=["loss_alone-shard2", "relu_first-shard3"])
def test_sharded_stage_without_parameters_trains_as_one_rank(tmp_path, one_rank, stages,
                                                              shard):
    """Scheme sharded on 2 replicas x 2 stages, one stage without
    parameters (the loss alone; the relu reading the data), clipped, a
    batch of 4 per replica: the weights and Adam's moments after 4 steps,
    and the end's test loss, are one rank's at a batch of 8 (1e-5). Before,
    refused with exit 2; past the refusal the stage's ranks skipped the
    save's gathers and every rank stalled."""
    make = _relu_first if stages is RELU_FIRST else _config
    ref = _train(tmp_path, "one", 1, make())[0] if stages is RELU_FIRST else one_rank[0][0]
    got, _ = _train(tmp_path, "sharded", 4,
                    make({"scheme": "sharded", "shard": shard, "stages": stages}, batch=4))
    _close(got, ref)
    if stages is RELU_FIRST:  # rank 0, whose start-up block it is, holds no parameter
        want = _test_loss(tmp_path / "one")
        assert want and _test_loss(tmp_path / "sharded") == pytest.approx(want, rel=1e-5)
        assert "stage 0 (this rank's) holds no parameter: no bucket" in \
            (tmp_path / "sharded" / "train.log").read_text()


@pytest.mark.mpi
def test_tensor_stages_with_a_stage_without_parameters_clip_as_one_rank(tmp_path, one_rank):
    """2 stages x 2 tensor shards, the loss alone on stage 1, clipped: the
    loss's second tensor shard had no norm to rescale (``KeyError:
    'scales'`` at start-up, before; on every scheme with both keys):
    pipeline on 4 ranks trains as one rank (1e-5), and sharded's 8 ranks
    compose offline, each (stage, tensor shard) position's replicas
    posting the same collectives in the same order."""
    (ref, _), _ = one_rank
    got, _ = _train(tmp_path, "pipe", 4, _config({"scheme": "pipeline", "stages": LOSS_ALONE,
                                                  "tensor_parallel": 2}))
    _close(got, ref)
    job = make_job(_config({"scheme": "sharded", "shard": 2, "stages": LOSS_ALONE,
                            "tensor_parallel": 2}, batch=4))
    coll = [sorted((op.attrs["seq"], op.op_type, op.attrs["group"])
                   for op in compose_for(job, 8, rank).ops.values()
                   if op.op_type in ("ReduceScatter", "Allgather", "Allreduce"))
            for rank in range(8)]
    assert all([c[:2] for c in coll[r]] == [c[:2] for c in coll[r + 4]] for r in range(4))
    assert coll[2] == coll[3] == [(coll[2][0][0], "Allreduce", list(range(8)))]
    assert sum(c[1] == "ReduceScatter" for c in coll[0]) > 0


@pytest.mark.mpi
def test_sharded_stage_without_parameters_checkpoints_resume_on_one_rank(tmp_path, one_rank,
                                                                         one_rank_dir):
    """One rank's checkpoint at iteration 1 (the one_rank fixture's run's)
    continues under that layout (each stage's ranks load their shards; the
    loss's none), saving its streamed split checkpoint (shard 3: weight
    shards joined) at iteration 2, which continues on 1 rank: both end
    where 4 uninterrupted steps on one rank do (1e-5). (One 4-rank launch
    writes the checkpoint the one-rank resume reads and resumes itself;
    before, a second one trained 2 steps to write it.)"""
    par = {"scheme": "sharded", "shard": 3, "stages": LOSS_ALONE}
    (ref, _), _ = one_rank
    cfg = _config(par, batch=4)
    cfg["checkpoint"] = {"interval": 2, "keep": 0}
    got, _ = _train(tmp_path, "to_4", 4, cfg, "--resume", one_rank_dir / "one" / "ckpt_1.h5")
    _close(got, ref)
    saved = tmp_path / "to_4" / "ckpt_2.h5"
    assert saved.exists()
    got, _ = _train(tmp_path, "to_1", 1, _config(), "--resume", saved)
    _close(got, ref)


@pytest.mark.mpi
@pytest.mark.parametrize("parallel", [{"scheme": "sharded", "shard": 1},
                                      {"scheme": "tensor", "tensor_parallel": 2}],
                         ids=["sharded1", "tensor2"])
def test_multipliers_decay_and_clip_train_as_one_rank(tmp_path, one_rank, parallel):
    """Per-parameter multipliers, AdamW's decoupled decay and the clip on 2
    ranks: sharded stage 1 at a batch of 4 each (each bucket element with
    its parameter's multipliers), tensor at 8 (fc1/fc2 split, fc2's bias and
    the layer norm whole on both shards, counted once in the norm): one
    rank's weights and moments within 1e-5."""
    (ref, _), _ = one_rank
    got, _ = _train(tmp_path, "two", 2, _config(parallel, batch=8 if "tensor_parallel"
                                                 in parallel else 4))
    _close(got, ref)


def test_a_rank_without_the_lr_blob_shows_the_policys_rate():
    """The progress row's rate on a rank without the ``lr`` blob is what
    the LearningRate op writes there, in its float32, at each iteration
    (rows name iterations 1-based: row 3 trained at iteration 2)."""
    from types import SimpleNamespace

    from purine_mpi.graph.core import Op
    from purine_mpi.graph.solver_graph import lr_attrs
    from purine_mpi.ops.catalog import make_kernel
    from purine_mpi.train.progress import shown_lr
    job = make_job(_config())
    op = make_kernel(Op("solver.lr", "LearningRate", ["iter"], ["lr"], lr_attrs(job.solver)))
    loop = SimpleNamespace(ws=SimpleNamespace(arrays={}), job=job)
    for it in range(5):
        out = np.zeros((), np.float32)
        op.run([np.array(it, np.int64)], [out])
        assert shown_lr(loop, it + 1) == float(out)
    assert [shown_lr(loop, k) for k in (1, 2, 3)] == [float(np.float32(v))
                                                      for v in (0.01, 0.01, 0.005)]
