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


@pytest.mark.xfail(strict=True, reason="open: on the emulated device the first step of a "
                   "2^40 scale is not flagged (its weights go non-finite), later ones are")
def test_an_overflow_at_a_huge_scale_skips_steps_and_backs_off(host_build_dir, monkeypatch,
                                                               tmp_path):
    """An init_scale that overflows float16 (the seed times 2^40): the
    first steps are skipped, each halving the scale, until the gradients
    fit; each skip is one log line and counted in metrics.jsonl; then the
    run learns."""
    from tests.emulated_gpu import emulated_trainer_env
    emulated_trainer_env(monkeypatch, host_build_dir)
    _, _, rows, lines = _train(tmp_path, "huge", "fp16", 16,
                               loss_scale={"init_scale": 2.0 ** 40})
    skipped = rows[16]["skipped_steps"]
    assert skipped >= 1 and rows[16]["loss_scale"] == 2.0 ** (40 - skipped)
    assert [rows[i]["skipped_steps"] for i in range(1, skipped + 1)] == list(
        range(1, skipped + 1))
    assert sum("step skipped on every rank" in line for line in lines) == skipped
    assert rows[16]["loss"] < rows[skipped + 1]["loss"]
