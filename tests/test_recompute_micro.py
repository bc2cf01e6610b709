"""Activation recompute with micro-batches (issue 44, item 1; the
``recompute`` pass runs on one micro-batch's graph, parallel/micro_batch.py
then copies it, recompute copies included, once per micro-batch): with
``parallel.micro_batches`` 2 the weights after a few AdamW steps with
dropout on are bitwise those without recompute at the same micro-batches,
on 1 rank and on 2 ranks (schemes data and sharded): each micro-batch
copy replays its own masks (copy k's ``DropoutReplay`` reads copy k's
packed bits; a counter-based copy draws ``<stream>@mb<k>``, its original
copy's stream). The memory plan sees the shorter lifetimes, and
``recompute_layers`` apply to every copy."""
import os

import numpy as np
import pytest

from tests.conftest import run_mpi_cli, train_here
from tests.test_recompute import ATTENTION, TINY, _assert_bitwise, _params, _sets

#: AdamW steps: a mask replayed from another copy differs from the first step
ITERS = 3


def _train(email_h5, out, mode, ranks=1, extra=(), fused=False):
    sets = _sets(email_h5, iters=ITERS, fused=fused) + [
        "--set", "parallel.micro_batches=2", "--set", f"recompute={mode}"]
    sets += [a for s in extra for a in ("--set", s)]
    if ranks == 1:
        from purine_mpi.job.config import load_config
        train_here(load_config(TINY, overrides=sets[1::2]), out)
    else:
        res = run_mpi_cli(ranks, "train", TINY, *sets, "--out", out, timeout=600)
        assert res.returncode == 0, res.stderr
    return _params(os.path.join(out, "latest.h5"))


@pytest.mark.parametrize("fused", [False, True])
def test_recompute_with_micro_batches_is_bitwise_on_one_rank(email_h5, tmp_path, fused):
    """full, selective and full on cut units (``recompute_layers``), with 2
    micro-batches, give the weights of no recompute at 2 micro-batches, bit
    for bit (dropout 0.1 on attention and the residual stream; the raw
    attention sub-graph, and the fused op whose copy unpacks its own
    copy's packed mask)."""
    base = _train(email_h5, str(tmp_path / "none"), "none", fused=fused)
    modes = [("full", ()), ("full", ("recompute_layers=[h*_ln1,h*_ln2,h*_gelu,h1_*]",))]
    if not fused:
        modes.append(("selective", ()))
    for i, (mode, extra) in enumerate(modes):
        _assert_bitwise(base, _train(email_h5, str(tmp_path / f"{mode}{i}"), mode, extra=extra,
                                     fused=fused), f"{mode} {extra}")


def test_each_copy_replays_its_own_masks(email_h5, tmp_path, monkeypatch):
    """The check above can fail: were copy 1's replay to read copy 0's
    packed masks, the weights would differ."""
    from purine_mpi.parallel.schemes import steps
    real = steps.replicate_micro_batches

    def crossed(graph, grads, m, **options):
        copies = real(graph, grads, m, **options)
        for op in graph.ops.values():
            if op.op_type == "DropoutReplay" and op.name.endswith("@mb1"):
                op.inputs[1] = op.inputs[1].replace("@mb1", "@mb0")
        return copies
    monkeypatch.setattr(steps, "replicate_micro_batches", crossed)
    base = _train(email_h5, str(tmp_path / "none"), "none")
    wrong = _train(email_h5, str(tmp_path / "full"), "full")
    assert any(not np.array_equal(base[k], wrong[k]) for k in base)


def _graph(email_h5, mode, micro_batches, *extra):
    """gpt_tiny's composed graph on 1 rank (parallel/compose.py), its own
    128-token sequences at batch 16."""
    from purine_mpi.job.config import load_config
    from purine_mpi.job.job import job_of
    from purine_mpi.tools.graph import compose_for
    sets = _sets(email_h5)[1::2] + ["data.train.batch_size=16", "data.train.sequence_length=128",
                                    f"parallel.micro_batches={micro_batches}",
                                    f"recompute={mode}", *extra]
    return compose_for(job_of(load_config(TINY, overrides=sets)), 1, 0)


def test_the_plan_sees_each_copys_shorter_lifetimes(email_h5):
    """At 2 micro-batches the trainer's plan (order_ops) is sound and the
    activations' peak falls under full recompute by more than half, under
    selective by the (N, H, T, T) tensors; every copy has its recompute
    copies, and ``recompute_layers`` restrict them in each copy."""
    from purine_mpi.graph.recompute import SUFFIX
    from purine_mpi.runtime.memory_plan import batch_blobs, check_plan, peak_live, plan_memory
    peak = {}
    for mode in ("none", "full", "selective"):
        g = _graph(email_h5, mode, 2)
        plan = plan_memory(g, keep=batch_blobs(g), order_ops=True)
        assert check_plan(g, plan) == []
        peak[mode] = peak_live(g, plan)[2]["activations"]
        copies = [n for n in g.ops if SUFFIX in n]
        for k in (0, 1):
            assert bool([n for n in copies if n.endswith(f"@mb{k}")]) == (mode != "none")
        # the backward of copy k reads copy k's recomputed blobs only
        for n in copies:
            k = n[-1]
            assert all(b.endswith(f"@mb{k}") or "@mb" not in b for b in g.ops[n].inputs), n
    assert peak["full"] <= 0.5 * peak["none"], peak
    assert peak["selective"] < peak["none"], peak
    g = _graph(email_h5, "full", 2, "recompute_layers=[h1_*]")
    copies = [n for n in g.ops if SUFFIX in n]
    assert copies and all(n.startswith("h1_") for n in copies), copies
    assert {n[-1] for n in copies} == {"0", "1"}


@pytest.mark.mpi
@pytest.mark.parametrize("scheme", ["data", "sharded"])
def test_recompute_with_micro_batches_is_bitwise_on_two_ranks(email_h5, tmp_path, scheme):
    """The same on 2 ranks (mpiexec), schemes data and sharded (ZeRO 1),
    2 micro-batches a rank, dropout on."""
    extra = (f"parallel.scheme={scheme}",)
    base = _train(email_h5, str(tmp_path / "none"), "none", ranks=2, extra=extra)
    _assert_bitwise(base, _train(email_h5, str(tmp_path / "full"), "full", ranks=2, extra=extra),
                    f"full, {scheme}")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recompute_with_micro_batches_on_the_emulated_device(
        host_build_dir, monkeypatch, tmp_path, precision):
    """The trainer on the emulated device (CUDA graphs), a 2-block GPT with
    attention and residual dropout 0.2, 2 micro-batches, 4 iterations: full
    recompute (every layer, and the layer norms and GELU alone) gives the
    losses and weights of no recompute bit for bit. There placement drops
    the fused op's packed mask: each micro-batch copy of the op's
    recompute copy draws its own copy's stream (``<stream>@mb<k>``) at the
    forward's iteration. A run with recompute resumed from the checkpoint
    of a run without it ends on the same weights (checkpoints hold no
    recompute or micro-batch blob)."""
    import json

    from purine_mpi.base.backend import to_numpy
    from purine_mpi.graph.recompute import SUFFIX
    from purine_mpi.job.config import validate_config
    from purine_mpi.train.trainer import Trainer, run_and_report
    from tests.conftest import FakeWorld, make_job
    from tests.emulated_gpu import emulated_trainer_env
    from tests.gpt_nets import gpt_config, text_h5
    emulated_trainer_env(monkeypatch, host_build_dir)

    def train(name, recompute=None, resume=None):
        raw = gpt_config(text_h5(tmp_path), layers=2, width=16, heads=2, length=8, batch=4,
                         iters=4, parallel={"micro_batches": 2})
        for layer in raw["net"]:
            if layer["type"] == "attention":
                layer.update(attn_dropout=0.2, resid_dropout=0.2)
        raw.update(device=0, precision=precision, cuda_graph=True)
        if recompute:
            raw.update(recompute="full", recompute_layers=recompute)
        raw["data"].pop("test")
        raw["checkpoint"] = {"interval": 2, "keep": 0}
        out = tmp_path / name
        t = Trainer(make_job(validate_config(raw, check_files=False)), str(out),
                    world=FakeWorld(), log=lambda line: None, resume=resume)
        graph = t.graphs.graph
        if recompute == ["*"]:   # the fused op's copies draw their own copy's stream
            drawn = {op.name: op.attrs.get("stream") for op in graph.ops.values()
                     if op.op_type == "Attention" and SUFFIX in op.name}
            assert len(drawn) == 4 and all(not graph.ops[n].attrs.get("replay_mask")
                                           for n in drawn), drawn
            for n, stream in drawn.items():
                assert stream and stream.endswith(n[-4:]), (n, stream)   # @mb<k>
        assert run_and_report(t, FakeWorld()) == 0
        rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in rows if r["phase"] == "train"]
        return losses, {p: np.array(to_numpy(t.train.workspace[p])) for p in t.graphs.params}

    base = train("none")
    assert len(base[0]) == 4
    for name, layers in (("full", ["*"]), ("cut", ["b*_ln1", "b*_ln2", "b*_gelu"])):
        got = train(name, layers)
        assert got[0] == base[0], name
        _assert_bitwise(base[1], got[1], name)
    resumed = train("resumed", ["*"], resume=str(tmp_path / "none" / "ckpt_2.h5"))
    _assert_bitwise(base[1], resumed[1], "resumed")


def test_plan_choose_prices_each_copys_recomputed_ops(tmp_path):
    """``plan --choose`` prices a candidate's ops from the calibration's
    trace (one rank, no recompute, no micro-batches): with micro-batches a
    recompute copy is ``<op>@recompute[#1]@mb<k>``, priced as its traced
    original at half the work (the proportional rule, 2 micro-batches),
    none left untraced. Before, the ``@mb<k>`` was stripped and the
    ``@recompute`` kept: untraced, priced at nothing."""
    import yaml

    from purine_mpi.job.config import load_job
    from purine_mpi.tools.scaling.trace_reader import Durations
    from purine_mpi.tools.choose import CALIBRATION_SETS, _Scaled
    from purine_mpi.tools.graph import compose_for
    from tests.gpt_nets import gpt_config, text_h5
    cfg = gpt_config(text_h5(tmp_path), layers=2, fused=False)
    for layer in cfg["net"]:
        if layer["type"] == "attention":
            layer["attn_dropout"] = 0.1
    path = tmp_path / "gpt.yaml"
    path.write_text(yaml.safe_dump(cfg))
    traced = compose_for(load_job(path, CALIBRATION_SETS, check_files=False), 1, 0)
    durations = Durations({0: {name: 1.0 for name in traced.ops}})
    graph = compose_for(load_job(path, ("recompute=full", "parallel.micro_batches=2"),
                                 check_files=False), 1, 0)
    copies = [n for n in graph.ops if "@recompute" in n]
    assert any("#" in n for n in copies) and {n[-4:] for n in copies} == {"@mb0", "@mb1"}
    scaled = _Scaled(durations, traced, graph)
    for name in copies:
        original = name.split("@recompute")[0]
        seconds = scaled.lookup(name)
        assert seconds is not None and seconds > 0, name
        if graph.ops[name].op_type == traced.ops[original].op_type:
            assert seconds == pytest.approx(0.5), name


def test_sharded_with_stages_is_refused_as_a_pipeline(email_h5):
    """Scheme sharded with ``parallel.stages`` runs as a pipeline (or
    hybrid): recompute is refused there as under scheme pipeline, with the
    stages as a count and as a map of two stages, with micro-batches or
    without (once accepted: a GraphError at start-up, the copies' control
    edges crossing the stages' ranks)."""
    from purine_mpi.base.errors import ConfigError
    from purine_mpi.job.config import load_config
    sets = _sets(email_h5)[1::2] + ["recompute=full", "parallel.scheme=sharded"]
    names = [layer["name"] for layer in load_config(TINY, overrides=sets)["net"]]
    two = {n: int(i >= len(names) // 2) for i, n in enumerate(names)}
    for stages in ("2", str(two)):
        for m in (1, 2):
            with pytest.raises(ConfigError, match="sharded with parallel.stages"):
                load_config(TINY, overrides=sets + [f"parallel.stages={stages}",
                                                    f"parallel.micro_batches={m}"])
