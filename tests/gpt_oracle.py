"""A minimal PyTorch GPT (nanoGPT's structure) as the oracle of our GPT nets.

``gpt_net(...)`` writes a GPT as a job's ``net:`` list (docs/transformers.md's
block: pre-norm, attention and MLP residuals, a final layer norm and an LM
head tied to the token embedding, the token-level softmax loss).
``torch_gpt_from_net(net, params)`` builds the PyTorch model of any net of
that shape (a job's own, layer names as its author chose) and copies our
parameters in; it returns the model and ``{our param: torch parameter name}``
so a test compares weights and gradients one by one. ``run_ours`` trains our
net's graph (build_net, the gradient builder, the solver ops) on given token
batches with the serial dispatcher.

Used by tests/test_gpt_parity.py and by the other GPT tests (data, tensor
and pipeline parallelism, ONNX export)."""
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

GPT_NORMAL = {"type": "gaussian", "std": 0.02}


def gpt_net(vocab=32, width=16, heads=2, blocks=2, max_length=16, dropout=0.0, fused=True,
            approximate="none", eps=1e-5):
    """Our GPT as a net list: bottoms ``data`` (N, T) tokens and ``label``
    (N, T) next tokens; top ``loss`` in nats per token."""
    net = [{"type": "embedding", "name": "wte", "bottom": "data", "top": "tok",
            "input_dim": vocab, "num_output": width},
           {"type": "position_embedding", "name": "wpe", "bottom": "tok", "top": "x0",
            "max_length": max_length}]
    x = "x0"
    for i in range(blocks):
        p = f"h{i}"
        net += [
            {"type": "layer_norm", "name": f"{p}_ln1", "bottom": x, "top": f"{p}_n1", "eps": eps},
            {"type": "attention", "name": f"{p}_attn", "bottom": f"{p}_n1", "top": f"{p}_a",
             "num_heads": heads, "attn_dropout": dropout, "resid_dropout": dropout,
             "fused": fused},
            {"type": "eltwise", "name": f"{p}_res1", "bottom": [x, f"{p}_a"], "top": f"{p}_x1"},
            {"type": "layer_norm", "name": f"{p}_ln2", "bottom": f"{p}_x1", "top": f"{p}_n2",
             "eps": eps},
            {"type": "fc", "name": f"{p}_fc", "bottom": f"{p}_n2", "top": f"{p}_m", "axis": -1,
             "num_output": 4 * width, "weight_filler": GPT_NORMAL},
            {"type": "gelu", "name": f"{p}_gelu", "bottom": f"{p}_m", "top": f"{p}_m",
             "approximate": approximate},
            {"type": "fc", "name": f"{p}_proj", "bottom": f"{p}_m", "top": f"{p}_mo",
             "axis": -1, "num_output": width, "weight_filler": GPT_NORMAL}]
        if dropout:
            net.append({"type": "dropout", "name": f"{p}_drop", "bottom": f"{p}_mo",
                        "top": f"{p}_mo", "ratio": dropout})
        net.append({"type": "eltwise", "name": f"{p}_res2", "bottom": [f"{p}_x1", f"{p}_mo"],
                    "top": f"{p}_x"})
        x = f"{p}_x"
    net += [{"type": "layer_norm", "name": "ln_f", "bottom": x, "top": "xf", "eps": eps},
            {"type": "fc", "name": "lm_head", "bottom": "xf", "top": "logits", "axis": -1,
             "num_output": vocab, "bias_term": False, "tie_weight": "wte"},
            {"type": "softmax_loss", "name": "loss", "bottom": ["logits", "label"], "axis": -1}]
    return net


class Attention(nn.Module):
    def __init__(self, width, heads, attn_dropout, resid_dropout, bias, causal):
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width, bias=bias)
        self.c_proj = nn.Linear(width, width, bias=bias)
        self.heads, self.causal = heads, causal
        self.attn_dropout, self.resid_dropout = attn_dropout, nn.Dropout(resid_dropout)

    def forward(self, x):
        n, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(n, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal,
            dropout_p=self.attn_dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(n, t, c)))


class Block(nn.Module):
    def __init__(self, width, heads, eps, attn, mlp, approximate, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width, eps=eps[0])
        self.attn = Attention(width, heads, **attn)
        self.ln_2 = nn.LayerNorm(width, eps=eps[1])
        self.c_fc = nn.Linear(width, mlp[0], bias=mlp[1])
        self.c_proj = nn.Linear(mlp[0], width, bias=mlp[2])
        self.approximate, self.dropout = approximate, nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        h = F.gelu(self.c_fc(self.ln_2(x)), approximate=self.approximate)
        return x + self.dropout(self.c_proj(h))


class TorchGPT(nn.Module):
    """nanoGPT's GPT: wte + wpe, pre-norm blocks, ln_f, lm_head tied to wte."""

    def __init__(self, vocab, width, max_length, blocks, ln_f_eps, tied, head_bias):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(max_length, width)
        self.h = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(width, eps=ln_f_eps)
        self.lm_head = nn.Linear(width, vocab, bias=head_bias)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       targets.reshape(-1))


def _of_type(net, *types):
    return [e for e in net if e["type"] in types]


def torch_gpt_from_net(net, params=None):
    """The PyTorch GPT of ``net`` (our layer entries: one embedding, one
    position_embedding, per block layer_norm, attention, layer_norm and two
    fc, then a final layer_norm and the LM-head fc) with ``params`` ({our
    param name: array}) copied in. Returns (model, {our param: torch
    parameter name}); a tied head maps to the embedding's one parameter."""
    (wte,), (wpe,) = _of_type(net, "embedding", "embed"), _of_type(net, "position_embedding")
    attns = _of_type(net, "attention", "self_attention")
    norms = _of_type(net, "layer_norm", "layernorm")
    fcs = _of_type(net, "fc", "inner_product", "innerproduct")
    gelus = _of_type(net, "gelu")
    drops = _of_type(net, "dropout")
    head = fcs[-1]
    if len(norms) != 2 * len(attns) + 1 or len(fcs) != 2 * len(attns) + 1:
        raise ValueError("not a GPT of the expected shape (per block: layer_norm, attention, "
                         "layer_norm, fc, fc; then layer_norm and the head fc)")
    width = wte["num_output"]
    names = {f"{wte['name']}/weight": "wte.weight", f"{wpe['name']}/weight": "wpe.weight"}
    blocks = []
    for i, at in enumerate(attns):
        ln1, ln2, fc1, fc2 = norms[2 * i], norms[2 * i + 1], fcs[2 * i], fcs[2 * i + 1]
        bias = at.get("bias_term", True)
        blocks.append(Block(
            width, at["num_heads"], (ln1.get("eps", 1e-5), ln2.get("eps", 1e-5)),
            dict(attn_dropout=at.get("attn_dropout", 0.0),
                 resid_dropout=at.get("resid_dropout", 0.0), bias=bias,
                 causal=at.get("causal", True)),
            (fc1["num_output"], fc1.get("bias_term", True), fc2.get("bias_term", True)),
            gelus[i].get("approximate", "none") if i < len(gelus) else "none",
            drops[i].get("ratio", 0.5) if i < len(drops) else 0.0))
        p = f"h.{i}."
        names.update({f"{ln1['name']}/weight": p + "ln_1.weight",
                      f"{ln1['name']}/bias": p + "ln_1.bias",
                      f"{at['name']}/qkv_weight": p + "attn.c_attn.weight",
                      f"{at['name']}/proj_weight": p + "attn.c_proj.weight",
                      f"{ln2['name']}/weight": p + "ln_2.weight",
                      f"{ln2['name']}/bias": p + "ln_2.bias",
                      f"{fc1['name']}/weight": p + "c_fc.weight",
                      f"{fc2['name']}/weight": p + "c_proj.weight"})
        if bias:
            names.update({f"{at['name']}/qkv_bias": p + "attn.c_attn.bias",
                          f"{at['name']}/proj_bias": p + "attn.c_proj.bias"})
        for fc, tname in ((fc1, "c_fc"), (fc2, "c_proj")):
            if fc.get("bias_term", True):
                names[f"{fc['name']}/bias"] = p + f"{tname}.bias"
    ln_f = norms[-1]
    names.update({f"{ln_f['name']}/weight": "ln_f.weight", f"{ln_f['name']}/bias": "ln_f.bias"})
    tied = head.get("tie_weight") == wte["name"]
    if not tied:
        names[f"{head['name']}/weight"] = "lm_head.weight"
    if head.get("bias_term", True):
        names[f"{head['name']}/bias"] = "lm_head.bias"
    model = TorchGPT(wte["input_dim"], width, wpe["max_length"], blocks,
                     ln_f.get("eps", 1e-5), tied, head.get("bias_term", True))
    if params is not None:
        state = dict(model.named_parameters())
        with torch.no_grad():
            for ours, theirs in names.items():
                state[theirs].copy_(torch.from_numpy(np.asarray(params[ours])))
    return model, names


def lr_at(solver, it):
    """Our learning rate at iteration ``it`` (docs/solvers.md): the cosine
    policy times the linear warm-up (the other policies are not needed)."""
    base, lo = solver["base_lr"], solver.get("min_lr", 0.0)
    policy = solver.get("lr_policy", "fixed")
    rate = base
    if policy == "cosine":
        t = min(it, solver["max_iter"])
        rate = lo + (base - lo) * (1 + math.cos(math.pi * t / solver["max_iter"])) / 2
    w = solver.get("warmup_iters", 0)
    return rate * (it + 1) / w if it < w else rate


def torch_adamw(model, solver):
    """torch.optim.AdamW with our solver's keys, and a scheduler giving
    ``lr_at`` (step k of the optimizer runs at our iteration k's rate)."""
    opt = torch.optim.AdamW(model.parameters(), lr=solver["base_lr"],
                            betas=(solver.get("momentum", 0.9), solver.get("momentum2", 0.999)),
                            eps=solver.get("delta", 1e-8),
                            weight_decay=solver.get("weight_decay", 0.0))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_at(solver, k) / solver["base_lr"])
    return opt, sched


def gpt_graph(net, solver, batch, seq, phase="train"):
    """Our training graph of ``net`` (its forward, gradient and ``solver``
    ops, a job's solver mapping) over (batch, seq) int32 blobs ``data`` and
    ``label``. Returns (graph, {param: gradient blob}, {loss: weight})."""
    from purine_mpi.graph import Graph
    from purine_mpi.graph.grad import build_backward
    from purine_mpi.graph.solver_graph import add_solver
    from purine_mpi.job.replica import loss_blobs
    from purine_mpi.layers import build_net
    from tests.conftest import make_job
    job = make_job({"data": {"train": {"source": "synthetic", "shape": [1], "classes": 2,
                                       "batch_size": batch}},
                    "net": [], "solver": solver}, check_files=False)
    g = Graph("gpt")
    g.add_blob("data", (batch, seq), "int32", kind="data")
    g.add_blob("label", (batch, seq), "int32", kind="data")
    build_net(net, phase, (g, "<net>"))
    g.infer_shapes()
    losses = loss_blobs(g)
    grads = build_backward(g, losses)
    add_solver(g, grads, job.solver)
    g.infer_shapes().validate()
    return g, grads, losses


def build_ours(net, solver, batch, seq, seed=0, phase="train", plan=False):
    """Our training graph of ``net`` for (batch, seq) int32 token blobs and
    ``solver`` (a job's solver mapping), with its serial dispatcher, the
    parameters initialised from ``seed`` as the trainer does. ``plan``: lay
    the blobs out by the trainer's static memory plan (its arena filled with
    junk first), else one buffer per blob. Returns (dispatcher, {param:
    gradient blob}, loss blob names)."""
    from purine_mpi.layers.fillers import fill
    from purine_mpi.runtime.dispatcher import SerialDispatcher
    g, grads, losses = gpt_graph(net, solver, batch, seq, phase)
    workspace = None
    if plan:
        from purine_mpi.runtime.memory_plan import batch_blobs, plan_memory
        from purine_mpi.runtime.workspace import Workspace
        workspace = Workspace(g, plan=plan_memory(g, keep=batch_blobs(g), order_ops=True))
        workspace.host_arena[...] = 255  # stale bytes must never reach a result
    d = SerialDispatcher(g, seed=seed, workspace=workspace)
    for b in g.params():
        d.workspace.set(b.name, fill(b, seed))
    for b in g.blobs.values():
        if b.kind == "state" and b.alias_of is None:
            d.workspace.set(b.name, np.zeros(b.shape, b.dtype))
    return d, grads, list(losses)


def step_ours(d, tokens, labels, it):
    """One training iteration of ``build_ours``'s dispatcher."""
    d.workspace.set("data", np.asarray(tokens, np.int32))
    d.workspace.set("label", np.asarray(labels, np.int32))
    d.workspace.set("iter", np.int64(it))
    d.run(it)
