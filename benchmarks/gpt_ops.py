"""Where a gpt_tiny training step goes on one CPU thread, op type by op
type: purine_mpi's kernels against PyTorch's for the same work, and against
another checkout's (``--baseline``), in interleaved rounds.

    .venv/bin/python benchmarks/gpt_ops.py [--rounds 3] [--reps 7] [--baseline DIR]
        [--config jobs/gpt_tiny.yaml]

Each round runs one worker process per side (taking turns at going first).
purine_mpi's worker builds the job's trainer (``bench``'s synthetic
config: the token file is read), runs two steps, then times every host
kernel of the training graph alone (``kernel.run`` on the step's own
blobs) and whole training steps; PyTorch's times the aten calls of
``gpt_torch.py``'s model for the same shapes (addmm / mm for the fc
layers and their gradients, scaled_dot_product_attention and its
backward, gelu, native_layer_norm, cross_entropy, embedding, the
residual adds and the sums of their gradients, AdamW's step,
clip_grad_norm_) and whole ``gpt_torch.step`` iterations. Times are
CPU time (``time.process_time``: the time the process is descheduled by
its neighbours on a shared machine does not count), the fastest of
``--reps`` runs after one warm-up, summed per op type; a round's figure per
side, the median over the rounds printed. Prints one JSON object: per
group of op types each side's ms per step and ``torch_over_this`` (above 1
this checkout is faster), the sums, and ``step_ms`` (whole steps: the
kernels plus the dispatcher, the data and Python between them).
"""
import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: the op types of purine_mpi's graph (and the names PyTorch's worker
#: files its calls under) in the groups the table prints
GROUPS = {
    "matmul (fc and their gradients)": ("InnerProduct", "InnerProductGradData",
                                        "InnerProductGradWeight", "InnerProductGradBias"),
    "attention": ("Attention",),
    "attention gradient": ("AttentionGrad",),
    "gelu": ("Gelu",),
    "gelu gradient": ("GeluGrad",),
    "layer norm": ("LayerNorm",),
    "layer norm gradient": ("LayerNormGrad",),
    "loss and its gradient": ("SoftmaxLoss", "SoftmaxLossGrad"),
    "embeddings and their gradients": ("Embedding", "EmbeddingGrad", "PositionEmbedding",
                                       "PositionEmbeddingGrad"),
    "residual adds and their gradients": ("Eltwise", "EltwiseGrad", "Sum"),
    "AdamW": ("AdamWUpdate",),
    "gradient clipping": ("ClipScale", "GradNormSq"),
}


def fastest_ms(fn, reps):
    """The fastest of ``reps`` runs of ``fn`` after one warm-up, CPU ms."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return 1000 * best


def ours(config, reps):
    from purine_mpi.job.config import load_job
    from purine_mpi.tools.bench import synthetic_config
    from purine_mpi.train.trainer import Trainer
    job = synthetic_config(load_job(config)).with_training(max_iter=1000)
    trainer = Trainer(job, out_dir="/nonexistent-gpt-ops", profile=False, log=lambda m: None)
    try:
        steps = iter(range(1000))
        for _ in range(2):
            trainer.step(next(steps))
        step_ms = fastest_ms(lambda: trainer.step(next(steps)), reps)
        d = trainer.train
        d.drain()
        by = collections.defaultdict(float)
        for op in d.order:
            k = d.kernels[op.name]
            if k.category != "comm":
                by[op.op_type] += fastest_ms(lambda: k.run(k.ins, k.outs), reps)
    finally:
        trainer.close()
    return {"ops": dict(by), "step_ms": step_ms}


def pytorch(config, reps):
    import numpy as np
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, HERE)
    from gpt_torch import adamw, batches, dims, step, torch_gpt
    from purine_mpi.job.config import load_config
    torch.set_num_threads(1)
    cfg = load_config(config, check_files=False)
    solver, spec = cfg["solver"], cfg["data"]["train"]
    d = dims(cfg)
    N, T, C, H, V = spec["batch_size"], spec["sequence_length"], d["width"], d["heads"], \
        d["vocab"]
    M = N * T
    gen = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=gen)
    by = collections.defaultdict(float)
    fcs = [(C, 3 * C, d["bias"]), (C, C, d["bias"]), (C, 4 * C, True), (4 * C, C, True)] \
        * d["layers"] + [(C, V, False)]
    for K, O, bias in fcs:
        x, w, b, dy = r(M, K), r(O, K), r(O), r(M, O)
        by["InnerProduct"] += fastest_ms(
            (lambda: torch.addmm(b, x, w.t())) if bias else (lambda: x.mm(w.t())), reps)
        by["InnerProductGradData"] += fastest_ms(lambda: dy.mm(w), reps)
        by["InnerProductGradWeight"] += fastest_ms(lambda: dy.t().mm(x), reps)
        if bias:
            by["InnerProductGradBias"] += fastest_ms(lambda: dy.sum(0), reps)
    for _ in range(d["layers"]):
        qkv, dctx = r(N, T, 3 * C).requires_grad_(), r(N, T, C)

        def attention():
            q, k, v = (t.view(N, T, H, C // H).transpose(1, 2) for t in qkv.split(C, dim=2))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(
                1, 2).reshape(N, T, C)
        by["Attention"] += fastest_ms(attention, reps)
        ctx = attention()
        by["AttentionGrad"] += fastest_ms(
            lambda: torch.autograd.grad(ctx, qkv, dctx, retain_graph=True), reps)
        x, dy = r(N, T, 4 * C), r(N, T, 4 * C)
        by["Gelu"] += fastest_ms(lambda: torch.ops.aten.gelu(x, approximate=d["gelu"]), reps)
        by["GeluGrad"] += fastest_ms(
            lambda: torch.ops.aten.gelu_backward(dy, x, approximate=d["gelu"]), reps)
        a, b = r(N, T, C), r(N, T, C)   # a block's two residual adds, and two gradient sums
        by["Eltwise"] += 4 * fastest_ms(lambda: a + b, reps)
    for _ in range(2 * d["layers"] + 1):
        x, w, b, dy = r(N, T, C), r(C), r(C), r(N, T, C)
        by["LayerNorm"] += fastest_ms(
            lambda: torch.ops.aten.native_layer_norm(x, [C], w, b, 1e-5), reps)
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, [C], w, b, 1e-5)
        by["LayerNormGrad"] += fastest_ms(lambda: torch.ops.aten.native_layer_norm_backward(
            dy, x, [C], mean, rstd, w, b, [True, True, True]), reps)
    logits, labels = r(M, V).requires_grad_(), torch.randint(0, V, (M,), generator=gen)
    by["SoftmaxLoss"] += fastest_ms(lambda: F.cross_entropy(logits, labels), reps)
    loss = F.cross_entropy(logits, labels)
    by["SoftmaxLossGrad"] += fastest_ms(
        lambda: torch.autograd.grad(loss, logits, retain_graph=True), reps)
    wte, ids = r(V, C).requires_grad_(), torch.randint(0, V, (N, T), generator=gen)
    by["Embedding"] += fastest_ms(lambda: F.embedding(ids, wte), reps)
    emb = F.embedding(ids, wte)
    by["EmbeddingGrad"] += fastest_ms(
        lambda: torch.autograd.grad(emb, wte, r(N, T, C), retain_graph=True), reps)
    model = torch_gpt(cfg)
    opt = adamw(model, solver)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    by["AdamWUpdate"] += fastest_ms(opt.step, reps)
    by["ClipScale"] += fastest_ms(
        lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), reps)
    tokens = np.random.default_rng(0).integers(0, V, 1 << 16).astype(np.uint8)
    data = batches(tokens, T, N, 0)
    its = iter(range(1000))
    step_ms = fastest_ms(lambda: step(torch, model, opt, solver, next(its), data), reps)
    return {"ops": dict(by), "step_ms": step_ms}


def _run_worker(root, args, side):
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "PURINE_THREADS"):
        env[var] = "1"
    env["PYTHONPATH"] = root
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", side, "--reps", str(args.reps),
           "--config", os.path.abspath(args.config)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=root, timeout=1800)
    if out.returncode:
        sys.exit(f"{side} worker in {root} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "jobs", "gpt_tiny.yaml"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--baseline", help="a checkout of another purine_mpi version to time too")
    p.add_argument("--worker", choices=["ours", "torch"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        fn = ours if args.worker == "ours" else pytorch
        print(json.dumps(fn(args.config, args.reps)))
        return
    sides = [("this", ROOT, "ours"), ("torch", ROOT, "torch")]
    if args.baseline:
        sides.append(("baseline", os.path.abspath(args.baseline), "ours"))
    rounds = []
    for i in range(args.rounds):   # rotate who goes first
        order = sides[i % len(sides):] + sides[:i % len(sides)]
        rounds.append({label: _run_worker(root, args, side) for label, root, side in order})

    def median(label, types):
        return round(statistics.median(sum(r[label]["ops"].get(t, 0.0) for t in types)
                                       for r in rounds), 2)
    every = [t for types in GROUPS.values() for t in types]
    groups = {}
    for name, types in list(GROUPS.items()) + [("sum of the kernels", every)]:
        entry = {f"{label}_ms": median(label, types) for label, _, _ in sides}
        entry["torch_over_this"] = round(entry["torch_ms"] / entry["this_ms"], 2) \
            if entry["this_ms"] else None
        groups[name] = entry
    others = sorted({t for r in rounds for t in r["this"]["ops"]} - set(every))
    step = {label: round(statistics.median(r[label]["step_ms"] for r in rounds), 1)
            for label, _, _ in sides}
    print(json.dumps({"config": os.path.relpath(args.config, ROOT), "rounds": args.rounds,
                      "reps": args.reps, "threads": 1, "baseline": args.baseline,
                      "load_average": list(os.getloadavg()), "groups": groups,
                      "other_op_types_ms": {t: median("this", [t]) for t in others},
                      "step_ms": step,
                      "step_torch_over_this": round(step["torch"] / step["this"], 3)}))


if __name__ == "__main__":
    main()
