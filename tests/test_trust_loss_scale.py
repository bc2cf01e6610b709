"""fp16's dynamic loss scaling against PyTorch's own rule: the update op
(ops/loss_scale.py ``LossScaleUpdate``) step by step against
``torch._amp_update_scale_``, the function ``torch.amp.GradScaler.update``
calls (the scale in float32, the growth tracker), over random sequences of
overflowing and clean steps, with the checkpointed state (scale, good
steps, skipped steps) carried across a save and load in the middle.

Found: a growth that float32 cannot hold made the scale inf, where torch
keeps the old scale (``if isfinite(new_scale)``) and restarts the count.
An inf scale makes the seed, so every gradient, inf or NaN: every later
step is skipped and backs off inf to inf, so the run stops learning for
good. On the code before: ``AssertionError: step 1: scale inf, torch's
1.7014118e+38`` (init_scale 2^127, growth_interval 1).
"""
import types

import numpy as np
import pytest
import torch

from purine_mpi.ops.loss_scale import LossScaleUpdate

CASES = {  # name -> (init_scale, growth_factor, backoff_factor, growth_interval, p(overflow))
    "defaults_fast": (65536.0, 2.0, 0.5, 3, 0.3),
    "odd_factors": (1000.0, 3.0, 0.3, 2, 0.4),
    "every_step": (8.0, 1.5, 0.25, 1, 0.5),
    "at_the_float32_top": (2.0 ** 127, 2.0, 0.5, 1, 0.1),
}


def _op(init, growth, backoff, interval):
    attrs = {"init_scale": init, "growth_factor": growth, "backoff_factor": backoff,
             "growth_interval": interval}
    kernel = LossScaleUpdate(types.SimpleNamespace(attrs=attrs, op_type="LossScaleUpdate"))
    outs = [np.zeros(1, np.float32), np.zeros(1, np.int64), np.zeros(1, np.int64),
            np.zeros(1, np.float32)]
    kernel.outs = outs
    kernel.setup(None, outs)
    return kernel, outs


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_update_is_torch_s_amp_update_scale_step_by_step(name):
    init, growth, backoff, interval, p = CASES[name]
    rng = np.random.default_rng(sorted(CASES).index(name))
    flags = rng.random(300) < p
    kernel, outs = _op(init, growth, backoff, interval)
    scale = torch.full((1,), init, dtype=torch.float32)
    tracker = torch.zeros(1, dtype=torch.int32)
    skipped = 0
    for step, found in enumerate(flags, 1):
        flag = np.array([1.0 if found else 0.0], np.float32)
        kernel.run([flag] + outs[:3], outs)  # in place: the @new blobs alias the old
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(found)]), growth,
                                 backoff, interval)
        skipped += int(found)
        ours = kernel.state_dict()
        assert ours["scale"] == scale.item(), \
            f"step {step}: scale {ours['scale']:.8g}, torch's {scale.item():.8g}"
        assert ours["good_steps"] == tracker.item(), step
        assert ours["skipped_steps"] == skipped and outs[3][0] == float(found), step
        assert np.isfinite(outs[0][0]), step
        if step == 150:  # a checkpoint's state loads into a new op (a resume)
            kernel, outs = _op(init, growth, backoff, interval)
            kernel.load_state_dict(ours)
            assert kernel.state_dict() == ours
