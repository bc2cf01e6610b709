"""A minimal PyTorch GPT with the structure of a purine_mpi GPT job (the
PyTorch side of ``cpu_speed.py`` for ``jobs/gpt_*.yaml``, and a reference
learning curve).

``torch_gpt(config)`` reads the job's net: the embedding's width and
vocabulary, the position embedding's length, the attention layers (their
count, heads, bias), the gelu form and the dropout ratio, and builds
nanoGPT's model (pre-norm blocks, c_attn/c_proj layouts, a tied lm_head).
``adamw(model, solver)`` is the job's AdamW (no decay on biases and layer
norms, as nanoGPT and the jobs' ``decay_mult: 0``), ``lr_at(solver, it)``
its warm-up + cosine rate.

    python benchmarks/gpt_torch.py jobs/gpt_tiny.yaml --data data/email.h5 --iters 500
        trains it on a ``data text`` file, one thread, and prints the validation
        loss every ``--eval-interval`` iterations (JSON lines)
"""
import argparse
import json
import math
import os
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def dims(config):
    """The GPT's sizes from a job config's net."""
    net = config["net"]
    by_type = {}
    for layer in net:
        by_type.setdefault(layer["type"], []).append(layer)
    wte, wpe = by_type["embedding"][0], by_type["position_embedding"][0]
    attn = by_type["attention"]
    drops = [d.get("ratio", 0.5) for d in by_type.get("dropout", [])]
    return {"vocab": int(wte["input_dim"]), "width": int(wte["num_output"]),
            "length": int(wpe["max_length"]), "layers": len(attn),
            "heads": int(attn[0]["num_heads"]), "bias": bool(attn[0].get("bias_term", True)),
            "gelu": by_type["gelu"][0].get("approximate", "none"),
            "dropout": float(drops[0]) if drops else 0.0}


def torch_gpt(config):
    import torch.nn as nn
    import torch.nn.functional as F
    d = dims(config)
    C, H = d["width"], d["heads"]

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(C, 3 * C, bias=d["bias"])
            self.c_proj = nn.Linear(C, C, bias=d["bias"])
            self.drop = nn.Dropout(d["dropout"])

        def forward(self, x):
            N, T, _ = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)
            q, k, v = (t.view(N, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=d["dropout"] if self.training else 0)
            return self.drop(self.c_proj(y.transpose(1, 2).reshape(N, T, C)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(C), Attention(), nn.LayerNorm(C)
            self.c_fc, self.c_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
            self.gelu = nn.GELU(approximate=d["gelu"])
            self.drop = nn.Dropout(d["dropout"])

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.drop(self.c_proj(self.gelu(self.c_fc(self.ln_2(x)))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(d["vocab"], C), nn.Embedding(d["length"], C)
            self.drop = nn.Dropout(d["dropout"])
            self.h = nn.ModuleList(Block() for _ in range(d["layers"]))
            self.ln_f = nn.LayerNorm(C)
            self.lm_head = nn.Linear(C, d["vocab"], bias=False)
            self.lm_head.weight = self.wte.weight  # tied
            for name, p in self.named_parameters():  # nanoGPT's initialisation
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * d["layers"]))
                elif p.dim() == 2:
                    nn.init.normal_(p, 0.0, 0.02)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)

        def forward(self, idx, targets):
            T = idx.shape[1]
            x = self.drop(self.wte(idx) + self.wpe.weight[:T])
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return GPT()


def adamw(model, solver, fused=False):
    """AdamW with the job's betas and eps; decay on the 2-D weights only
    (``fused``: PyTorch's fused CUDA kernel, as nanoGPT on a GPU)."""
    import torch
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": solver.get("weight_decay", 0)},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=solver["base_lr"], betas=(solver.get("momentum", 0.9),
                                                          solver.get("momentum2", 0.999)),
                             eps=solver.get("delta", 1e-8), **({"fused": True} if fused else {}))


def lr_at(solver, it):
    """The job's rate at iteration ``it``: cosine from base_lr to min_lr over
    max_iter, times the warm-up ramp (it + 1) / warmup_iters."""
    base, low, total = solver["base_lr"], solver.get("min_lr", 0.0), solver["max_iter"]
    rate = low + (base - low) * (1 + math.cos(math.pi * min(it, total) / total)) / 2
    warm = solver.get("warmup_iters", 0)
    return rate * min(1.0, (it + 1) / warm) if warm else rate


def batches(tokens, length, batch, seed):
    """Random windows of length + 1 tokens (nanoGPT's get_batch)."""
    import torch
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(tokens) - length - 1, batch)
        w = np.stack([tokens[s:s + length + 1] for s in starts]).astype(np.int64)
        yield torch.from_numpy(w[:, :-1]), torch.from_numpy(w[:, 1:])


def step(torch, model, opt, solver, it, data):
    """One training iteration: the schedule's lr, forward, backward, the
    clipping, AdamW's step (as purine_mpi's solver does it)."""
    for group in opt.param_groups:
        group["lr"] = lr_at(solver, it)
    x, y = next(data)
    loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if solver.get("clip_gradients"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), solver["clip_gradients"])
    opt.step()
    return loss


def val_loss(model, tokens, length, batch):
    """Mean loss over the disjoint windows of the validation tokens (the text
    source's test pass)."""
    import torch
    n = (len(tokens) - length - 1) // length + 1
    starts = np.arange(n) * length
    total = 0.0
    model.eval()
    with torch.no_grad():
        for i in range(0, n, batch):
            s = starts[i:i + batch]
            w = np.stack([tokens[a:a + length + 1] for a in s]).astype(np.int64)
            total += float(model(torch.from_numpy(w[:, :-1]), torch.from_numpy(w[:, 1:]))) * len(s)
    model.train()
    return total / n


def torch_bench(config, iters, warmup, queue=None):
    """PyTorch doing the job's training steps (same model, AdamW with the
    rate schedule, clipping, random windows of random tokens), one thread:
    {iter_ms_median, tokens_per_s, images_per_s, max_rss_bytes}."""
    import statistics

    import torch
    from scaling_ddp import peak_rss_bytes
    torch.set_num_threads(1)
    torch.manual_seed(0)
    solver, spec = config["solver"], config["data"]["train"]
    model = torch_gpt(config)
    opt = adamw(model, solver)
    tokens = np.random.default_rng(0).integers(0, dims(config)["vocab"], 1 << 16)
    data = batches(tokens.astype(np.uint8), spec["sequence_length"], spec["batch_size"], 0)
    times = []
    for it in range(warmup + iters):  # timed as `bench` times purine_mpi's
        if it == warmup:
            t_prev = time.perf_counter()
        step(torch, model, opt, solver, it, data)
        if it >= warmup:
            now = time.perf_counter()
            times.append(now - t_prev)
            t_prev = now
    med = statistics.median(times)
    batch = spec["batch_size"]
    result = {"iter_ms_median": round(1000 * med, 3), "images_per_s": round(batch / med, 2),
              "tokens_per_s": round(batch * spec["sequence_length"] / med, 2),
              "max_rss_bytes": peak_rss_bytes()}
    if queue is not None:
        queue.put(result)
    return result


def pytorch_process(config, iters, warmup):
    """``torch_bench`` in a fresh process (its own peak RSS, import included)."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=torch_bench, args=(config, iters, warmup, queue))
    proc.start()
    result = queue.get(timeout=1800)
    proc.join()
    return result


def main():
    import h5py
    import torch
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("--data", required=True)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import yaml
    with open(args.config) as f:
        config = yaml.safe_load(f)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    solver = config["solver"]
    iters = args.iters or solver["max_iter"]
    spec = config["data"]["train"]
    with h5py.File(args.data, "r") as f:
        train, val = f["train/tokens"][...], f["val/tokens"][...]
    model = torch_gpt(config)
    opt = adamw(model, solver)
    data = batches(train, spec["sequence_length"], spec["batch_size"], args.seed)
    t0 = time.perf_counter()
    for it in range(iters + 1):
        if it % args.eval_interval == 0:
            print(json.dumps({"iter": it, "val_loss": round(val_loss(
                model, val, spec["sequence_length"], 64), 4),
                "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
        if it == iters:
            break
        step(torch, model, opt, solver, it, data)


if __name__ == "__main__":
    main()
