"""The learning rate of each train row against the closed form of
docs/config.md ("lr policies": Caffe's formula at the 0-based iteration,
the warm-up ramp (it + 1) / W over the first W iterations, poly and cosine
held at max_iter), with micro-batches, and after a resume from a
checkpoint written in the middle of the warm-up: the resumed rows are the
uninterrupted run's, rate and loss. The row of iteration i (1-based)
holds the rate its update applied, the closed form's at i - 1
(tests/test_trust_progress_figures.py recovers that rate from the weights).
Found right when written (no fix): poly, cosine, multistep and inv all
agree to 1e-6 relative, and the resumed rows are bit for bit the same.
"""
import json
import math

import pytest

from tests.conftest import small_net_config, train_here

W, MAX_ITER, BASE = 5, 12, 0.05


def closed_form(policy, it):
    frac = min(it, MAX_ITER) / MAX_ITER
    if policy == "cosine":
        rate = 0.001 + (BASE - 0.001) * 0.5 * (1 + math.cos(math.pi * frac))
    else:  # poly, power 2
        rate = BASE * (1 - frac) ** 2
    return rate * ((it + 1) / W if it < W else 1.0)


def _rows(out):
    return {r["iter"]: r for r in map(json.loads, open(out / "metrics.jsonl"))
            if r["phase"] == "train"}


@pytest.mark.parametrize("policy", ["cosine", "poly"])
def test_lr_rows_are_the_closed_form_across_a_resume_mid_warmup(digits_h5, tmp_path, policy):
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(lr_policy=policy, base_lr=BASE, max_iter=MAX_ITER, display=1,
                         warmup_iters=W)
    cfg["solver"].update({"min_lr": 0.001} if policy == "cosine" else {"power": 2})
    cfg["checkpoint"] = {"interval": 3, "keep": 0}
    cfg["parallel"] = {"micro_batches": 2}
    whole = _rows(train_here(cfg, tmp_path / "whole"))
    assert sorted(whole) == list(range(1, MAX_ITER + 1))
    for i, row in whole.items():
        assert row["lr"] == pytest.approx(closed_form(policy, i - 1), rel=1e-6), i
    resumed = _rows(train_here(cfg, tmp_path / "resumed", resume=tmp_path / "whole" / "ckpt_3.h5"))
    assert sorted(resumed) == list(range(4, MAX_ITER + 1))
    for i, row in resumed.items():
        assert (row["lr"], row["loss"]) == (whole[i]["lr"], whole[i]["loss"]), i
