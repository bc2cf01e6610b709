"""A resume with another solver type: Adam's moments start from zero, and
so does its step count (torch: a fresh optimizer's state has step 0).

Resumed at iteration 10 from an SGD checkpoint, the first Adam update is
closed form: with m = v = 0 before it, ``m / (1 - b1) = g`` and
``sqrt(v / (1 - b2)) = |g|``, so every weight moves by ``lr * g / (|g| +
delta)``, i.e. by lr. Before the fix Adam took the global iteration as its
step (s = 11): the first update moved the weights by 0.48 lr here, and by
up to 3.2 lr (b2 0.999) once s is large. The step's origin is kept in the
checkpoint (``adam_step0``): resumed again, Adam goes on as the run that
was not stopped."""
import numpy as np
import pytest

from purine_mpi.gpu import kernels
from purine_mpi.graph.core import Op
from purine_mpi.ops.catalog import get_kernel_class
from tests.conftest import checkpoint_arrays, run_cli_args, tiny_fc_config, write_config_file

LR = 0.01


def _train(path, out, *args):
    res = run_cli_args("train", path, "--out", out, *args)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_adam_resumed_from_sgd_counts_its_steps_from_the_resume(tmp_path):
    cfg = tiny_fc_config()
    cfg["solver"].update(max_iter=12, base_lr=LR, momentum=0.9, display=0)
    cfg["checkpoint"] = {"interval": 0, "keep": 10}
    path = write_config_file(tmp_path, cfg)
    straight, split = tmp_path / "straight", tmp_path / "split"
    _train(path, straight, "--iters", "10")
    _train(path, split, "--iters", "10")
    adam = ["--set", "solver.type=adam"]
    text = _train(path, straight, "--resume", "auto", *adam)  # 10 -> 12
    assert "holds no 'm, v' solver state" in text, text
    _train(path, split, "--resume", "auto", "--iters", "11", *adam)  # 10 -> 11 -> 12
    before, first = (checkpoint_arrays(split / f"ckpt_{i}.h5") for i in (10, 11))
    for key in ("params/fc/weight", "params/fc/bias"):
        moved = np.abs(first[key] - before[key])
        np.testing.assert_allclose(moved, LR, rtol=1e-3, err_msg=(
            f"{key}: the first Adam step after the resume moved the weights by "
            f"{moved.min():.4g} .. {moved.max():.4g}, a fresh Adam's first step moves each by "
            f"lr = {LR}"))
    _train(path, split, "--resume", "auto", *adam)
    a, b = checkpoint_arrays(straight / "ckpt_12.h5"), checkpoint_arrays(split / "ckpt_12.h5")
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(b[key], a[key], err_msg=(
            f"{key}: resumed again at 11, Adam's run differs from the one resumed once"))


@pytest.mark.parametrize("on_device", [True, False])
def test_adam_kernels_take_the_step_from_step0(backend, on_device):
    """cuda/adam.cu (single and multi-tensor, the iteration a number or the
    device blob) and the CPU op: iteration 7 with step0 5 is iteration 2
    (step 3) bit for bit, and not iteration 7."""
    rng = np.random.default_rng(5)
    w, g, m = (rng.standard_normal(6).astype(np.float32) for _ in range(3))
    v = np.abs(rng.standard_normal(6)).astype(np.float32)

    def gpu(it, step0, multi=False):
        dev = [backend.to_device(a.copy()) for a in (w, m, v)]
        grad = backend.to_device(g)
        it = backend.to_device(np.array([it], np.int64)) if on_device else it
        if multi:
            table = kernels.MultiTensorTable([grad], [0], [1.0], [0.0], np.float32,
                                             factor_dtype=np.float64)
            kernels.adam_multi(*dev, table, 0.1, it, step0=step0)
        else:
            kernels.adam_update(*dev[:1], grad, *dev[1:], 0.1, it, step0=step0)
        return [backend.to_host(a) for a in dev]

    def cpu(it, step0):
        out = [a.copy() for a in (w, m, v)]
        attrs = {"step0": step0} if step0 else {}
        get_kernel_class("AdamUpdate")(Op("u", "AdamUpdate", [], [], attrs)).run(
            [out[0], g, out[1], out[2], np.asarray(0.1, np.float32), np.asarray(it)], out)
        return out

    for run in (gpu, lambda it, step0: gpu(it, step0, True), cpu):
        got, same, global_step = run(7, 5), run(2, 0), run(7, 0)
        np.testing.assert_array_equal(got[0], same[0])
        assert not np.array_equal(got[0], global_step[0])


def test_on_the_device_with_skipped_fp16_steps(host_build_dir, monkeypatch, tmp_path):
    """The emulated GPU (cuda/adam.cu reading the device iteration) under
    fp16's loss scaling, whose overflowed SGD steps before the resume are
    skipped: Adam's step blob is iteration - skipped, so its origin is the
    resume's iteration less those skips, and the first Adam step after the
    resume is again a fresh Adam's first (every weight moves by lr)."""
    from purine_mpi.job.checkpoint_file import load_checkpoint
    from purine_mpi.train.trainer import Trainer, run_and_report
    from tests.conftest import FakeWorld, make_job
    from tests.emulated_gpu import emulated_trainer_env
    emulated_trainer_env(monkeypatch, host_build_dir)
    cfg = tiny_fc_config()
    cfg["solver"].update(max_iter=10, base_lr=LR, momentum=0.9, display=1)
    cfg.update(device=0, precision="fp16", cuda_graph=False,
               loss_scale={"init_scale": 2.0 ** 24},
               checkpoint={"interval": 0, "keep": 5})
    out = tmp_path / "run"

    def train(resume=None, **solver):
        job = make_job(dict(cfg, solver=dict(cfg["solver"], **solver)))
        t = Trainer(job, str(out), world=FakeWorld(), log=lambda line: None, resume=resume)
        assert run_and_report(t, FakeWorld()) == 0

    train()
    skipped = load_checkpoint(str(out / "ckpt_10.h5")).state["ranks"]["0"][
        "loss_scale.update"]["state"]["skipped_steps"]
    assert 0 < skipped < 10, skipped  # some SGD steps overflowed, later ones applied
    train(resume="auto", type="adamw", max_iter=11)
    before, first = (checkpoint_arrays(out / f"ckpt_{i}.h5") for i in (10, 11))
    for key in ("params/fc/weight", "params/fc/bias"):
        np.testing.assert_allclose(np.abs(first[key] - before[key]), LR, rtol=1e-3,
                                   err_msg=key)
