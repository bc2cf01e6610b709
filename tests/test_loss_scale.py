"""fp16's dynamic loss scaling (graph/loss_scale.py, ops/loss_scale.py,
train/loss_scale.py): the config keys, the pass's graph, training on the
emulated device against fp32, an injected overflow skipping exactly one
step, the scale's growth, and resume."""
import json

import numpy as np
import pytest

from purine_mpi.base.errors import ConfigError
from purine_mpi.job.config import validate_config
from tests.test_precision import _raw


def test_loss_scale_keys_follow_grad_scaler_and_fp16_is_accepted_on_a_gpu():
    out = validate_config(_raw(device=0, precision="fp16"))
    assert out["precision"] == "fp16"
    assert out["loss_scale"] == {"init_scale": 65536.0, "growth_factor": 2.0,
                                 "backoff_factor": 0.5, "growth_interval": 2000}
    with pytest.raises(ConfigError, match="backoff_factor"):
        validate_config(_raw(device=0, precision="fp16", loss_scale={"backoff_factor": 1.5}))
    with pytest.raises(ConfigError, match="loss_scale.init"):
        validate_config(_raw(device=0, precision="fp16", loss_scale={"init": 8.0}))
    with pytest.raises(ConfigError, match="scheme pipeline"):
        validate_config(_raw(device=0, precision="fp16",
                             parallel={"scheme": "pipeline", "stages": {"fc": 0, "loss": 1}}))


def test_loss_scale_keys_have_no_effect_under_bf16_and_say_so():
    from purine_mpi.job.job import job_of, precision_notes
    notes = precision_notes(job_of(validate_config(
        _raw(device=0, precision="bf16", loss_scale={"init_scale": 1024.0}))))
    assert len(notes) == 1 and "loss_scale.init_scale has no effect" in notes[0] \
        and "bf16" in notes[0]
    assert precision_notes(job_of(validate_config(
        _raw(device=0, precision="fp16", loss_scale={"init_scale": 1024.0})))) == []


def test_the_pass_scales_the_seed_unscales_before_clipping_and_skips_the_updates():
    from purine_mpi.graph.loss_scale import FLAG, SCALE, add_loss_scale
    from purine_mpi.graph.clip import add_clip, update_ops
    from purine_mpi.job.job import job_of
    from purine_mpi.job.replica import build_train_graph
    raw = _raw(device=0, precision="fp16", solver={"type": "adamw"})
    job = job_of(validate_config(raw))
    graph, _ = build_train_graph(job, 0, 1)
    add_clip(add_loss_scale(graph, job.loss_scale, group=[0, 1], seq=7), 1.0).validate()
    ops = graph.ops
    seeds = [op for op in ops.values() if op.op_type == "Scaled" and SCALE in op.inputs]
    assert [op.outputs for op in seeds] == [["loss.grad"]]
    assert ops["loss.grad_seed"].outputs == ["loss.grad.weight"]
    assert ops["loss_scale.any"].attrs == {"seq": 7, "group": [0, 1], "reduce": "max"}
    assert ops["loss_scale.any"].inputs == [FLAG]
    assert ops["loss_scale.update"].inputs[0] == f"{FLAG}.all"
    for u in update_ops(graph):
        assert u.attrs["skip_if"] == "loss_scale.skip"
        assert u.control_inputs == ["loss_scale.update"]
        assert u.inputs[1].endswith("@unscale@clip") and u.inputs[-1] == "loss_scale.adam_iter"
    assert {b: graph.blobs[b].kind for b in (SCALE, "loss_scale.good_steps",
                                             "loss_scale.skipped")} == dict.fromkeys(
        (SCALE, "loss_scale.good_steps", "loss_scale.skipped"), "state")


# ------------------------------------------------ the trainer, emulated
def _train(tmp_path, name, precision, iters, resume=None, interval=0, loss_scale=None):
    from tests.conftest import FakeWorld, make_job
    from tests.gpt_nets import gpt_config, text_h5
    from purine_mpi.train.trainer import Trainer, run_and_report
    raw = gpt_config(text_h5(tmp_path), layers=2, width=16, heads=2, length=8, batch=4,
                     iters=iters)
    raw.update(device=0, precision=precision, cuda_graph=False)
    if loss_scale is not None:
        raw["loss_scale"] = loss_scale
    raw["data"].pop("test")
    raw["solver"].update(base_lr=0.01, test_interval=0)
    raw["checkpoint"] = {"interval": interval, "keep": 0}
    out = tmp_path / name
    lines = []
    t = Trainer(make_job(validate_config(raw, check_files=False)), str(out), world=FakeWorld(),
                log=lines.append, resume=resume)
    assert run_and_report(t, FakeWorld()) == 0
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    return t, out, {r["iter"]: r for r in rows if r["phase"] == "train"}, lines


FP16_TRACKS_FP32 = 2e-2  # relative, per iteration (float16 has 3 more mantissa bits than bf16)


def test_fp16_trains_tracks_fp32_grows_the_scale_and_resumes_it(host_build_dir, monkeypatch,
                                                               tmp_path):
    """A tiny GPT in fp16 on the emulated device: its losses track fp32's;
    with growth_interval 5 the scale doubles every 5 good steps (no step
    skipped at a moderate scale); the checkpoint holds the scale and the
    counter, a resumed fp16 run goes on from them, and a bf16 run resuming
    the same checkpoint ignores them."""
    from tests.emulated_gpu import emulated_trainer_env
    emulated_trainer_env(monkeypatch, host_build_dir)
    settings = {"init_scale": 256.0, "growth_interval": 5}
    t16, out16, fp16, _ = _train(tmp_path, "fp16", "fp16", 12, interval=6, loss_scale=settings)
    _, _, fp32, _ = _train(tmp_path, "fp32", "fp32", 12)
    assert sorted(fp16) == sorted(fp32) == list(range(1, 13))
    np.testing.assert_allclose([fp16[i]["loss"] for i in fp16], [fp32[i]["loss"] for i in fp16],
                               rtol=FP16_TRACKS_FP32)
    assert [fp16[i]["loss"] for i in fp16] != [fp32[i]["loss"] for i in fp16]
    assert "loss_scale" not in fp32[1]
    assert [fp16[i]["skipped_steps"] for i in fp16] == [0] * 12
    assert [fp16[i]["loss_scale"] for i in fp16] == [256.0] * 4 + [512.0] * 5 + [1024.0] * 3
    # resume at 6: scale 512, one good step counted -> 4 more good steps to grow
    _, _, resumed, _ = _train(tmp_path, "resumed", "fp16", 12, resume=str(out16 / "ckpt_6.h5"),
                              loss_scale=settings)
    assert [resumed[i]["loss_scale"] for i in range(7, 13)] == [512.0] * 3 + [1024.0] * 3
    for i in range(7, 13):
        assert resumed[i]["loss"] == fp16[i]["loss"], i
    t_bf, _, bf16, _ = _train(tmp_path, "to_bf16", "bf16", 12, resume=str(out16 / "ckpt_6.h5"))
    assert sorted(bf16) == list(range(7, 13)) and "loss_scale" not in bf16[7]
    assert "loss_scale" not in t_bf.train.workspace.arrays


def test_an_overflow_at_a_huge_scale_skips_steps_and_backs_off(host_build_dir, monkeypatch,
                                                               tmp_path):
    """An init_scale that overflows float16 (the seed times 2^40): the
    first step is flagged already (its flag read back after this step's
    check, not the last one's), and the steps are skipped, each halving the
    scale, until the gradients fit; each skip is one log line and counted
    in metrics.jsonl; the weights stay finite and the run learns."""
    from tests.emulated_gpu import emulated_trainer_env
    emulated_trainer_env(monkeypatch, host_build_dir)
    iters, init = 36, 40
    _, _, rows, lines = _train(tmp_path, "huge", "fp16", iters,
                               loss_scale={"init_scale": 2.0 ** init})
    skipped = [rows[i]["skipped_steps"] for i in range(1, iters + 1)]
    # metrics.jsonl writes 7 significant digits
    assert skipped[0] == 1 and rows[1]["loss_scale"] == pytest.approx(2.0 ** (init - 1), rel=1e-6)
    # the first step applied: the skips before it are steps 1, 2, ... in a row
    first = next(i for i in range(1, iters + 1) if skipped[i - 1] != i)
    assert 1 < first < iters - 8, skipped  # the prefix of skips ends, with room to learn
    assert all(b - a in (0, 1) for a, b in zip(skipped, skipped[1:])), skipped
    for i in rows:  # growth_interval 2000: the scale only halves
        assert rows[i]["loss_scale"] == pytest.approx(
            2.0 ** (init - rows[i]["skipped_steps"]), rel=1e-6), i
    assert sum("step skipped on every rank" in line for line in lines) == skipped[-1]
    losses = [rows[i]["loss"] for i in range(1, iters + 1)]
    assert np.isfinite(losses).all()
    assert np.mean(losses[-4:]) < losses[first - 1] - 0.3, losses


@pytest.mark.mpi
@pytest.mark.parametrize("step", [3])
def test_an_overflow_on_one_rank_skips_that_step_on_both(host_build_dir, tmp_path, step):
    """2 ranks (mpiexec), data parallelism, each on its own emulated GPU in
    fp16 with AdamW; PURINE_FP16_INJECT_INF makes one gradient of step
    ``step`` inf on rank 1 alone: both ranks skip exactly that step
    (weights, AdamW moments and step count bitwise unchanged), the scale is
    halved, metrics.jsonl counts one skipped step, and the run goes on
    finite (tests/mpi_scripts/loss_scale_skip.py)."""
    from tests.gpt_nets import text_h5
    from tests.mpi_scripts.launch import run_mpi
    proc, _ = run_mpi("loss_scale_skip.py", 2, host_build_dir, text_h5(tmp_path),
                      tmp_path / "run", timeout=600,
                      env={"PURINE_FP16_INJECT_INF": f"{step}:1", "PURINE_COMM_DELAY": "2:7"})
    assert proc.stdout.count(f"OK loss_scale_skip step={step} rank=1") == 2, \
        proc.stdout + proc.stderr
    log = (tmp_path / "run" / "train.log").read_text()
    assert log.count("step skipped on every rank") == 1 and f"iter {step}: an inf/nan" in log


def _composed_ops(raw, bypass=False, monkeypatch=None):
    """The op list (name, type, inputs, outputs, attrs) of ``raw``'s
    composed training graph placed on GPU 0 (its precision applied); with
    ``bypass`` the loss-scaling step of the schemes does nothing."""
    from purine_mpi.job.job import job_of
    from purine_mpi.job.replica import build_train_graph
    from purine_mpi.parallel.compose import scheme_of
    from purine_mpi.parallel.placement import prepare_for_device
    from purine_mpi.parallel.schemes import steps
    from tests.conftest import FakeWorld
    if bypass:
        monkeypatch.setattr(steps, "loss_scaled", lambda comp, job, world, group=None: comp)
    job = job_of(validate_config(raw))
    graph, grads = build_train_graph(job, 0, 1)
    graph = scheme_of(job).compose(graph, grads, job, FakeWorld()).graph
    prepare_for_device(graph, 0, precision=job.precision)
    if bypass:
        monkeypatch.undo()
    return [(n, op.op_type, list(op.inputs), list(op.outputs), sorted(op.attrs.items(), key=str),
             list(op.control_inputs)) for n, op in graph.ops.items()]


@pytest.mark.parametrize("scheme", ["none", "data"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_other_precisions_get_no_loss_scale_op(monkeypatch, precision, scheme):
    """fp32 and bf16 graphs are the graphs without the loss-scaling step,
    op for op (so their runs are bitwise what they were), even with
    loss_scale keys and PURINE_FP16_INJECT_INF set; fp16's differs by the
    loss-scaling ops alone."""
    from purine_mpi.graph.loss_scale import LOSS_SCALE_OPS
    raw = _raw(device=0, precision=precision, solver={"type": "adamw"},
               parallel={"scheme": scheme}, loss_scale={"init_scale": 8.0})
    without = _composed_ops(raw, bypass=True, monkeypatch=monkeypatch)
    monkeypatch.setenv("PURINE_FP16_INJECT_INF", "1")
    assert _composed_ops(raw) == without
    assert not [op for op in without if op[1] in LOSS_SCALE_OPS + ("InjectInf",)
                or "loss_scale" in op[0]]
    fp16 = _composed_ops(dict(raw, precision="fp16"))
    added = {op[1] for op in fp16} - {op[1] for op in without}
    assert set(LOSS_SCALE_OPS) | {"InjectInf"} <= added <= set(LOSS_SCALE_OPS) | {
        "InjectInf", "Scaled", "Copy", "Cast"}, added
