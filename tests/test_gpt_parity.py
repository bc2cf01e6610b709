"""Parity of our GPT with a minimal PyTorch GPT of the same structure
(tests/gpt_oracle.py): the same initial weights give the same loss and
gradients, and after 10 AdamW steps (warm-up and cosine decay) every
parameter is within 1e-5 relative; float32, dropout off.

"Relative" is per parameter: ||ours - torch|| / ||torch||. One slice is
compared otherwise: the k third of each attention's ``qkv_bias``. Its
gradient is zero in exact arithmetic (adding a constant to every key adds
the same q.b to a whole row of scores, which the softmax ignores), so both
frameworks' gradients there are rounding noise (~1e-11 against ~1e-2 for
the q and v parts), and Adam, dividing by that noise's own root mean
square, turns it into steps of up to about lr * 1e-3 whose signs no two
implementations share. It must stay that small on both sides, and its
gradient at the first step must be (nearly) zero on both sides."""
import numpy as np
import pytest
import torch

from tests.gpt_oracle import build_ours, gpt_net, step_ours, torch_adamw, torch_gpt_from_net

SOLVER = {"type": "adamw", "base_lr": 3e-3, "momentum": 0.9, "momentum2": 0.95,
          "delta": 1e-8, "weight_decay": 0.1, "lr_policy": "cosine", "warmup_iters": 3,
          "max_iter": 10, "min_lr": 3e-4}
BATCH, SEQ, VOCAB, WIDTH = 4, 8, 32, 16


def batches(n, seed=5):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        toks = rng.integers(0, VOCAB, (BATCH, SEQ + 1))
        out.append((toks[:, :-1].astype(np.int32), toks[:, 1:].astype(np.int32)))
    return out


def rel(a, b):
    """||a - b|| / ||b|| (||a|| when b is zero)."""
    scale = float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) / scale if scale else float(np.linalg.norm(a))


def split_k_bias(name, value, width):
    """(the value without the k third of a qkv_bias, that third or None)."""
    if not name.endswith("/qkv_bias"):
        return value, None
    return np.r_[value[:width], value[2 * width:]], value[width:2 * width]


@pytest.mark.parametrize("fused,approximate", [(True, "none"), (False, "tanh")])
def test_gpt_matches_torch_after_10_adamw_steps(fused, approximate):
    torch.manual_seed(0)
    net = gpt_net(vocab=VOCAB, width=WIDTH, heads=2, blocks=2, max_length=12, fused=fused,
                  approximate=approximate)
    d, grads, (loss_name,) = build_ours(net, SOLVER, BATCH, SEQ, seed=3)
    params = {b.name: d.workspace[b.name].copy() for b in d.graph.params()}
    model, names = torch_gpt_from_net(net, params)
    assert set(names) == set(params)  # every parameter of ours has its torch twin
    state = dict(model.named_parameters())
    opt, sched = torch_adamw(model, SOLVER)
    for it, (x, y) in enumerate(batches(10)):
        step_ours(d, x, y, it)
        opt.zero_grad()
        _, loss = model(torch.tensor(x, dtype=torch.int64), torch.tensor(y, dtype=torch.int64))
        loss.backward()
        assert abs(float(d.workspace[loss_name]) - loss.item()) <= 1e-5 * loss.item(), it
        if it == 0:
            for ours, theirs in names.items():
                a, ka = split_k_bias(ours, d.workspace[grads[ours]], WIDTH)
                b, kb = split_k_bias(ours, state[theirs].grad.numpy(), WIDTH)
                assert rel(a, b) < 1e-5, ours
                if ka is not None:
                    assert max(np.abs(ka).max(), np.abs(kb).max()) < 1e-7 * np.abs(b).max()
        opt.step()
        sched.step()
    worst = {}
    for ours, theirs in names.items():
        a, ka = split_k_bias(ours, d.workspace[ours], WIDTH)
        b, kb = split_k_bias(ours, state[theirs].detach().numpy(), WIDTH)
        worst[ours] = rel(a, b)
        if ka is not None:
            assert max(np.abs(ka).max(), np.abs(kb).max()) < 1e-2 * np.abs(b).max(), ours
    assert max(worst.values()) < 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    # the steps moved every parameter (a parity of frozen weights proves nothing)
    assert all(rel(d.workspace[p], v) > 1e-4 for p, v in params.items())
