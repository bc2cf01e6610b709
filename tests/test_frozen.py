"""Frozen parameters (``lr_mult: 0``): their update changes nothing, the
weight and the solver state stay bit for bit whatever the gradient holds
(torch.optim leaves a parameter without ``grad`` alone, weight decay
included), and under fp16 an inf in a frozen gradient skips no step
(torch's GradScaler sees no gradient there): ops/updates.py's ``frozen``,
graph/loss_scale.py."""
import json

import numpy as np
import pytest

from purine_mpi.graph.core import Op
from purine_mpi.job.config import validate_config
from purine_mpi.ops.catalog import get_kernel_class
from purine_mpi.ops.updates import SOLVER_UPDATES

SHARED = {"momentum": 0.9, "momentum2": 0.99, "delta": 1e-8, "rms_decay": 0.9,
          "weight_decay": 0.1, "grad_scale": 0.5}


def _bad_grad(rng, shape):
    g = rng.standard_normal(shape).astype(np.float32)
    g.reshape(-1)[:2] = [np.inf, np.nan]
    return g


@pytest.mark.parametrize("solver", sorted(SOLVER_UPDATES))
def test_a_frozen_update_keeps_weight_and_state_bitwise_whatever_its_gradient(solver):
    """Each solver's update op at lr_mult 0 (decay_mult 1, weight decay set,
    states not zero): an inf/nan gradient leaves weight and states bitwise."""
    op_type, states = SOLVER_UPDATES[solver]
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    held = [w] + [np.abs(rng.standard_normal((3, 4))).astype(np.float32) for _ in states]
    before = [a.copy() for a in held]
    extra = [np.asarray(0.1, np.float32)] + (
        [np.asarray(5, np.int64)] if op_type in ("AdamUpdate", "AdamWUpdate") else [])
    kernel = get_kernel_class(op_type)(Op("u", op_type, [], [],
                                          dict(SHARED, lr_mult=0.0, decay_mult=1.0)))
    for _ in range(2):
        kernel.run([held[0], _bad_grad(rng, (3, 4))] + held[1:] + extra, held)
    for a, b in zip(held, before):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("op_type", ["MultiSGDUpdate", "MultiAdamUpdate"])
def test_a_multi_tensor_update_leaves_its_frozen_views_alone(op_type):
    """The fused update (CPU path) with a frozen parameter between two
    moving ones: the frozen views stay bitwise under an inf/nan gradient,
    the others move and stay finite."""
    rng = np.random.default_rng(1)
    shapes, offsets = [(3, 4), (5,), (2, 3)], [0, 64, 128]
    nflat = 2 if op_type == "MultiSGDUpdate" else 3
    scalars = [np.asarray(0.1, np.float32)] + ([np.asarray(4, np.int64)] if nflat == 3 else [])
    attrs = dict(SHARED, decoupled=True, sizes=[12, 5, 6], offsets=offsets,
                 lr_mults=[1.0, 0.0, 2.0], decay_mults=[1.0, 1.0, 0.0], params=["a", "b", "c"])
    flat = [np.abs(rng.standard_normal(192)).astype(np.float32) for _ in range(nflat)]
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads[1] = _bad_grad(rng, shapes[1])
    multi = get_kernel_class(op_type)(Op("u", op_type, [], [], attrs))
    out = [b.copy() for b in flat]
    multi.setup(out + scalars + grads, out)
    multi.run(out + scalars + grads, out)
    for buf, old in zip(out, flat):
        np.testing.assert_array_equal(buf[64:69].view(np.uint32), old[64:69].view(np.uint32))
        assert np.isfinite(buf).all()
        assert (buf[0:12] != old[0:12]).all() and (buf[128:134] != old[128:134]).all()


def _net():
    return [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1", "num_output": 5,
             "param": [{"lr_mult": 0}, {"lr_mult": 0}],
             "weight_filler": {"type": "constant", "value": 0.25}},
            {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2", "num_output": 3},
            {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"]}]


@pytest.mark.parametrize("device,precision,solver", [
    (-1, "fp32", "sgd"), (-1, "fp32", "adamw"), (0, "fp16", "sgd"), (0, "fp16", "adamw")])
def test_a_frozen_fc_stays_bitwise_and_its_overflow_skips_no_step(
        host_build_dir, monkeypatch, tmp_path, device, precision, solver):
    """fc1 frozen (weight constant 0.25, weight decay 0.1), fc2 learning,
    4 steps: fc1's weight is 0.25 bitwise and its solver state zero, fc2
    moves. On the emulated device in fp16 an inf injected into fc1's weight
    gradient (the first update's, PURINE_FP16_INJECT_INF) on step 2 skips
    no step: fc2 learns on every one and the scale never backs off."""
    from tests.conftest import FakeWorld, make_job
    from purine_mpi.graph.clip import update_ops
    from purine_mpi.job.job import job_of
    from purine_mpi.job.replica import build_train_graph
    from purine_mpi.train.trainer import Trainer, run_and_report
    from tests.test_precision import _raw
    raw = _raw(device=device, precision=precision, net=_net(),
               solver={"type": solver, "base_lr": 0.05, "momentum": 0.9, "weight_decay": 0.1,
                       "max_iter": 4, "test_interval": 0, "display": 1})
    if device >= 0:
        from tests.emulated_gpu import emulated_trainer_env
        emulated_trainer_env(monkeypatch, host_build_dir)
        raw.update(cuda_graph=False, loss_scale={"init_scale": 256.0})
        monkeypatch.setenv("PURINE_FP16_INJECT_INF", "2")
        graph, _ = build_train_graph(job_of(validate_config(raw, check_files=False)), 0, 1)
        assert update_ops(graph)[0].inputs[1] == "fc1/weight.grad"  # where the inf goes
    raw["checkpoint"] = {"interval": 0, "keep": 0}
    out, lines = tmp_path / "run", []
    t = Trainer(make_job(validate_config(raw, check_files=False)), str(out), world=FakeWorld(),
                log=lines.append)
    start = np.array(t.train.workspace.arrays["fc2/weight"], copy=True)
    assert run_and_report(t, FakeWorld()) == 0
    arrays = t.train.workspace.arrays
    w = np.asarray(arrays["fc1/weight"])
    np.testing.assert_array_equal(w.view(np.uint32), np.full_like(w, 0.25).view(np.uint32))
    for state in SOLVER_UPDATES[solver][1]:
        assert not np.asarray(arrays[f"fc1/weight.{state}"]).any(), state
    assert np.isfinite(np.asarray(arrays["fc2/weight"])).all()
    assert (np.asarray(arrays["fc2/weight"]) != start).all()
    if device >= 0:  # fused: one multi-tensor update of fc1's and fc2's parameters
        multi = [op for op in t.train.workspace.graph.ops.values()
                 if op.op_type.startswith("Multi")]
        assert [op.attrs["lr_mults"] for op in multi] == [[0.0, 0.0, 1.0, 1.0]]
        rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if r["phase"] == "train"]
        assert [r["skipped_steps"] for r in rows] == [0] * 4, rows
        assert [r["loss_scale"] for r in rows] == [256.0] * 4
        assert not any("step skipped" in line for line in lines)
