"""Dropout inside the fused attention op (issue 45): the ``Attention`` op
and its gradient take ``attn_dropout`` on the probabilities, drawing the
mask the raw sub-graph's ``Dropout`` op draws (the Philox stream keyed by
the run seed and ``<layer>.attn_drop``, counted by element and iteration)
and applying it as that op does, the gradient drawing it again.

On the CPU: the fused and the raw paths bit for bit (ctx, dqkv, three AdamW
steps of a 2-block GPT), finite differences at a fixed iteration, the mask
per iteration and per layer and its dropped fraction, the memory plan (no
(N, H, T, T) blob), full recompute bit for bit. On the emulated device:
the cuBLAS path (the Dropout op's own kernel) bit for bit against the raw
path, and cuDNN's SDPA with dropout (the emulated frontend, its masks the
emulator's) against a float64 reference with the same mask, per-op seeds,
offsets per iteration, replayed in a CUDA graph. A real GPU: marked ``gpu``."""

import numpy as np
import pytest

from purine_mpi.base.philox import dropout_keys, keep_mask
from purine_mpi.graph.core import Op
from purine_mpi.ops.catalog import get_kernel_class
from tests.gpt_oracle import build_ours, gpt_graph, gpt_net, step_ours
from tests.opcheck import central_differences

RATIO = 0.25


def _kernels(heads, ratio=RATIO, stream="l.attn_drop", seed=5, causal=True, **extra):
    """The fused forward and gradient kernels with dropout (no dispatcher:
    the run seed is the ``seed`` attr)."""
    attrs = dict(num_heads=heads, causal=causal, dropout=ratio, stream=stream, seed=seed,
                 **extra)
    fwd = get_kernel_class("Attention")(Op("l.attn", "Attention", [], [], dict(attrs)))
    bwd = get_kernel_class("AttentionGrad")(Op("l.attn_grad", "AttentionGrad", [], [],
                                               dict(attrs)))
    return fwd, bwd


def _fused(qkv, dctx, heads, it, **kw):
    fwd, bwd = _kernels(heads, **kw)
    n, t, c3 = qkv.shape
    ctx = np.full((n, t, c3 // 3), np.nan, qkv.dtype)
    it = np.array(it, np.int64)
    fwd.setup([qkv, it], [ctx])
    fwd.run([qkv, it], [ctx])
    dqkv = np.full_like(qkv, np.nan)
    bwd.setup([dctx, qkv, it], [dqkv])
    bwd.run([dctx, qkv, it], [dqkv])
    return ctx, dqkv


def _attention_graph(path, qkv, heads, ratio, it, seed):
    """ctx and dqkv of one attention through the real gradient builder and
    a dispatcher seeded ``seed``: the fused op with dropout, or the raw
    sub-graph with a Dropout op named as the layer names it."""
    from purine_mpi.graph import Graph
    from purine_mpi.graph.grad import build_backward
    from purine_mpi.runtime.dispatcher import SerialDispatcher
    g = Graph("attn")
    g.add_blob("qkv", qkv.shape, qkv.dtype, kind="param")
    g.add_blob("iter", (), "int64", kind="iter")
    attrs = {"num_heads": heads, "causal": True}
    if path == "fused":
        g.add_op("l.attn", "Attention", ["qkv", "iter"], ["ctx"],
                 dict(attrs, dropout=ratio, stream="l.attn_drop"))
    else:
        g.add_op("l.scores", "AttentionScores", ["qkv"], ["s"], attrs)
        g.add_op("l.softmax", "Softmax", ["s"], ["p"], {"axis": 3})
        g.add_op("l.attn_drop", "Dropout", ["p", "iter"], ["pd", "mask"],
                 {"ratio": ratio, "phase": "train"})
        g.add_op("l.context", "AttentionContext", ["pd", "qkv"], ["ctx"], attrs)
    g.infer_shapes()
    lw = np.random.default_rng(2).standard_normal(g.blobs["ctx"].shape).astype(qkv.dtype)
    g.add_blob("lw", lw.shape, lw.dtype)
    g.add_op("loss.fwd", "WeightedSum", ["ctx", "lw"], ["loss"])
    g.infer_shapes()
    grads = build_backward(g, {"loss": 1.0}, params=["qkv"])
    g.infer_shapes()
    d = SerialDispatcher(g, seed=seed)
    d.workspace.set("qkv", qkv)
    d.workspace.set("lw", lw)
    d.workspace.set("iter", np.int64(it))
    d.run(it)
    return d.workspace["ctx"].copy(), d.workspace[grads["qkv"]].copy(), g


def _qkv(n, t, c, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal((n, t, 3 * c)).astype(dtype)


# ------------------------------------------------------------ (a) bitwise
@pytest.mark.parametrize("it", [0, 3])
def test_fused_dropout_is_the_raw_sub_graph_bit_for_bit(it):
    """ctx and dqkv of the fused op with dropout are the raw sub-graph's
    (AttentionScores, Softmax, Dropout, AttentionContext) bit for bit: the
    same mask (the Dropout op's stream, same seed, same iteration) applied
    by the same products in the same order."""
    qkv = _qkv(2, 9, 8)
    fused_ctx, fused_dqkv, g = _attention_graph("fused", qkv, 2, RATIO, it, seed=11)
    raw_ctx, raw_dqkv, _ = _attention_graph("raw", qkv, 2, RATIO, it, seed=11)
    assert np.array_equal(fused_ctx, raw_ctx)
    assert np.array_equal(fused_dqkv, raw_dqkv)
    (grad,) = [op for op in g.ops.values() if op.op_type == "AttentionGrad"]
    assert grad.inputs[-1] == "iter" and grad.attrs["stream"] == "l.attn_drop" and \
        grad.attrs["dropout"] == RATIO
    # not the op without dropout: the mask is applied
    no_drop = _fused(qkv, np.ones((2, 9, 8), np.float32), 2, it, ratio=0.0)[0]
    assert not np.array_equal(fused_ctx, no_drop)


def test_a_gpt_trains_bit_for_bit_fused_or_raw_with_attention_dropout():
    """Three AdamW steps of a 2-block GPT with attn_dropout (and the other
    dropouts): the fused layer (one Attention op, no Dropout op on the
    probabilities) and the raw sub-graph give the same losses and weights,
    bit for bit."""
    solver = {"type": "adamw", "base_lr": 1e-2, "weight_decay": 0.1, "max_iter": 3}
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 16, (3, 2, 7))
    out = {}
    for fused in (True, False):
        net = gpt_net(vocab=16, width=8, heads=2, blocks=2, max_length=6, dropout=0.2,
                      fused=fused)
        d, _, _ = build_ours(net, solver, 2, 6, seed=3)
        types = [op.op_type for op in d.graph.ops.values()]
        if fused:
            assert "AttentionScores" not in types and types.count("Attention") == 2
            assert all(op.attrs["dropout"] == 0.2 for op in d.graph.ops.values()
                       if op.op_type in ("Attention", "AttentionGrad"))
        else:
            assert "Attention" not in types
        losses = []
        for it in range(3):
            step_ours(d, toks[it, :, :-1], toks[it, :, 1:], it)
            losses.append(d.workspace["loss"].copy())
        out[fused] = (losses, {p.name: d.workspace[p.name].copy() for p in d.graph.params()})
    assert all(np.array_equal(a, b) for a, b in zip(out[True][0], out[False][0]))
    assert sorted(out[True][1]) == sorted(out[False][1])
    differ = [k for k in out[True][1] if not np.array_equal(out[True][1][k], out[False][1][k])]
    assert not differ, differ


#: the 2-block fused GPT with attention (and residual) dropout of these tests
GPT = dict(vocab=16, width=8, heads=2, blocks=2, max_length=6, dropout=0.2)


def _layers(net):
    """(name, type, bottoms) of a net's layers: graph/recompute.py's ``layers``."""
    return [(n["name"], n["type"], n["bottom"] if isinstance(n["bottom"], list)
             else [n["bottom"]]) for n in net]


def _full_recompute(g):
    """``recompute: full`` on the GPT's graph (every layer)."""
    from purine_mpi.graph.recompute import add_recompute
    assert add_recompute(g, "full", _layers(gpt_net(**GPT)))["units"]


def _attention_draws(monkeypatch, graph_pass=None, iters=2):
    """Train the 2-block fused GPT with attn_dropout (seed 3) for ``iters``
    steps, ``graph_pass`` applied to its graph first, counting the host
    Philox draws of each attention layer's stream (base/philox.py's
    ``open_stream``, which every host draw calls once, by its key: the
    stream's op id). Returns (draws per layer, the graph, the weights)."""
    from purine_mpi.base import philox
    from purine_mpi.layers.fillers import fill
    from purine_mpi.runtime.dispatcher import SerialDispatcher
    streams = {philox.op_id(f"h{i}_attn.attn_drop"): f"h{i}_attn" for i in range(2)}
    draws = {name: 0 for name in streams.values()}
    real = philox.open_stream

    def counted(key0, *rest):
        if key0 in streams:
            draws[streams[key0]] += 1
        return real(key0, *rest)
    monkeypatch.setattr(philox, "open_stream", counted)
    solver = {"type": "adamw", "base_lr": 1e-2, "weight_decay": 0.1, "max_iter": iters}
    g, _, _ = gpt_graph(gpt_net(**GPT), solver, 2, 6)
    assert sorted(op.name.split(".")[0] for op in g.ops.values()
                  if op.op_type == "Attention") == sorted(draws)
    if graph_pass is not None:
        graph_pass(g)
    d = SerialDispatcher(g, seed=3)
    for b in g.params():
        d.workspace.set(b.name, fill(b, 3))
    for b in g.blobs.values():
        if b.kind == "state" and b.alias_of is None:
            d.workspace.set(b.name, np.zeros(b.shape, b.dtype))
    toks = np.random.default_rng(0).integers(0, 16, (iters, 2, 7))
    for it in range(iters):
        step_ours(d, toks[it, :, :-1], toks[it, :, 1:], it)
    return draws, g, {p.name: d.workspace[p.name].copy() for p in g.params()}


def test_the_gradient_unpacks_the_forwards_mask_without_a_second_draw(monkeypatch):
    """On the host the fused op keeps its keep-mask bit-packed (uint8,
    ceil(N H T T / 8) bytes, the forward's second output) and AttentionGrad
    unpacks it: one Philox draw of the layer's stream an iteration (the
    forward's), none in the gradient. Placement on a GPU
    (``redraw_attention_masks``) drops the packed mask and the gradient
    redraws (two draws) -- the same weights, bit for bit."""
    draws, g, packed = _attention_draws(monkeypatch)
    assert draws == {"h0_attn": 2, "h1_attn": 2}, draws   # forward only, 2 iterations
    for op in g.ops.values():
        if op.op_type == "Attention":
            bits = g.blobs[op.outputs[1]]
            assert bits.dtype == "uint8" and bits.shape == (-(-(2 * 2 * 6 * 6) // 8),)
            (grad,) = [c for c in g.ops.values() if c.op_type == "AttentionGrad"
                       and c.inputs[1] == op.inputs[0]]
            assert grad.inputs[2] == op.outputs[1] and grad.inputs[-1] == "iter"
    from purine_mpi.parallel.placement import redraw_attention_masks
    draws, g, redrawn = _attention_draws(monkeypatch, redraw_attention_masks)
    assert draws == {"h0_attn": 4, "h1_attn": 4}, draws
    assert not any(b.dtype == "uint8" for b in g.blobs.values())
    assert all(np.array_equal(packed[k], redrawn[k]) for k in packed)


def test_full_recompute_draws_the_mask_once_a_layer_a_step(monkeypatch):
    """Under full recompute the copy of the fused op draws nothing on the
    host: it unpacks the original's packed mask (attr ``replay_mask``), as
    the gradient does, so one Philox draw a layer an iteration, the
    forward's (before: 2, the copy redrew the mask and packed it again),
    and the weights are those without recompute, bit for bit. On a GPU
    (``redraw_attention_masks`` after the recompute pass) the copy and
    the gradient redraw, as before: 3 draws a layer an iteration, the
    same weights."""
    _, _, plain = _attention_draws(monkeypatch)
    draws, g, full = _attention_draws(monkeypatch, _full_recompute)
    assert draws == {"h0_attn": 2, "h1_attn": 2}, draws   # forward only, 2 iterations
    copies = [op for op in g.ops.values() if op.op_type == "Attention" and op.attrs.get(
        "replay_mask")]
    assert len(copies) == 2 and all("packed_mask" not in op.attrs for op in copies)
    assert all(np.array_equal(plain[k], full[k]) for k in plain)
    from purine_mpi.parallel.placement import redraw_attention_masks

    def on_a_gpu(graph):
        _full_recompute(graph)
        redraw_attention_masks(graph)
    draws, g, redrawn = _attention_draws(monkeypatch, on_a_gpu)
    assert draws == {"h0_attn": 6, "h1_attn": 6}, draws
    # the residual Dropouts' packed masks (recompute's) stay; no attention's
    assert not any(b.dtype == "uint8" and "packed_of" not in b.attrs for b in g.blobs.values())
    assert not any(op.attrs.get("replay_mask") or op.attrs.get("packed_mask")
                   for op in g.ops.values() if op.op_type.startswith("Attention"))
    assert all(np.array_equal(plain[k], redrawn[k]) for k in plain)


# ------------------------------------------------- (b) finite differences
def test_fused_dropout_gradient_matches_finite_differences():
    """At a fixed iteration the mask is fixed: the loss sum(ctx * w) is
    smooth in qkv and AttentionGrad is its gradient (float64, central
    differences)."""
    heads, it = 2, 4
    qkv = _qkv(1, 5, 4, seed=1, dtype=np.float64)
    w = np.random.default_rng(3).standard_normal((1, 5, 4))
    ctx, dqkv = _fused(qkv, w, heads, it, ratio=0.4)
    assert np.abs(dqkv).max() > 0.1
    plain_ctx, plain_dqkv = _fused(qkv, w, heads, it, ratio=0.0)
    assert not np.allclose(ctx, plain_ctx) and not np.allclose(dqkv, plain_dqkv)
    num = central_differences(lambda x: np.sum(_fused(x, w, heads, it, ratio=0.4)[0] * w), qkv)
    np.testing.assert_allclose(dqkv, num, rtol=1e-6, atol=1e-8)


# ------------------------------------------------------------ (c) the mask
def _mask_of(it, stream, seed=5, n=4, t=64, ratio=RATIO):
    """The fused op's mask, read off its output: q = k = 0 (every
    probability 1/T, no causal mask), v the identity (D = T), so
    ctx[n, i, j] = mask[n, 0, i, j] / T / (1 - ratio)."""
    qkv = np.zeros((n, t, 3 * t), np.float32)
    qkv[:, :, 2 * t:] = np.eye(t, dtype=np.float32)
    ctx = _fused(qkv, np.zeros((n, t, t), np.float32), 1, it, ratio=ratio, stream=stream,
                 seed=seed, causal=False)[0]
    kept = ctx != 0
    np.testing.assert_allclose(ctx[kept], np.float32(1 / t) * np.float32(1 / (1 - ratio)),
                               rtol=1e-6)
    return kept.reshape(n, 1, t, t)


def test_the_mask_is_the_dropout_ops_stream_per_iteration_and_layer():
    """The mask is keep_mask of the stream (run seed, the raw path's
    Dropout op's name) at the iteration; it changes with the iteration and
    with the layer (stream) and the run seed; about ``ratio`` is dropped."""
    a0 = _mask_of(0, "h0_attn.attn_drop")
    assert np.array_equal(a0, keep_mask(a0.shape, RATIO, *dropout_keys(5, "h0_attn.attn_drop"),
                                        0))
    for other in (_mask_of(1, "h0_attn.attn_drop"), _mask_of(0, "h1_attn.attn_drop"),
                  _mask_of(0, "h0_attn.attn_drop", seed=6)):
        assert not np.array_equal(a0, other)
        assert 0.6 < np.mean(a0 == other) < 0.7   # independent: 0.75² + 0.25²
    for ratio in (0.1, 0.5):
        dropped = 1 - _mask_of(2, "x.attn_drop", ratio=ratio).mean()
        assert abs(dropped - ratio) < 4 * np.sqrt(ratio * (1 - ratio) / a0.size), dropped


def test_the_gradient_redraws_the_forwards_mask():
    """The gradient's mask is the forward's (its dv = P'^T dO reads the
    forward's dropped probabilities): dv of an identity v with dO = 1
    has the kept probabilities' column sums; another iteration another."""
    t = 32
    qkv = np.zeros((2, t, 3 * t), np.float32)
    qkv[:, :, 2 * t:] = np.eye(t, dtype=np.float32)
    do = np.ones((2, t, t), np.float32)
    ctx, dqkv = _fused(qkv, do, 1, 7, causal=False)
    dv = dqkv[:, :, 2 * t:]
    np.testing.assert_allclose(dv, np.broadcast_to(ctx.sum(axis=1)[:, :, None], dv.shape),
                               rtol=1e-5)
    _, other = _fused(qkv, do, 1, 8, causal=False)
    assert not np.array_equal(dv, other[:, :, 2 * t:])


def test_the_fused_op_refuses_dropout_without_the_iteration():
    from purine_mpi.base.errors import ShapeError
    cls = get_kernel_class("Attention")
    qkv = ((2, 4, 24), "float32")
    with pytest.raises(ShapeError, match="iteration"):
        cls.infer({"num_heads": 2, "dropout": 0.1}, [qkv])
    with pytest.raises(ShapeError, match="iteration"):
        cls.infer({"num_heads": 2, "dropout": 0.1}, [qkv, ((2,), "float32")])
    assert cls.infer({"num_heads": 2, "dropout": 0.1}, [qkv, ((), "int64")])[0][0] == (2, 4, 8)
    with pytest.raises(ShapeError, match=r"\[0, 1\)"):
        cls.infer({"num_heads": 2, "dropout": 1.0}, [qkv, ((), "int64")])


# ------------------------------------------------------- (d) memory plan
def _plan(fused, batch=4, seq=32):
    from purine_mpi.runtime.memory_plan import batch_blobs, check_plan, peak_live, plan_memory
    net = gpt_net(vocab=16, width=32, heads=4, blocks=2, max_length=seq, dropout=0.1,
                  fused=fused)
    g, _, _ = gpt_graph(net, {"type": "adamw", "base_lr": 1e-3, "max_iter": 1}, batch, seq)
    plan = plan_memory(g, keep=batch_blobs(g), order_ops=True)
    assert check_plan(g, plan) == []
    square = sorted(b.name for b in g.blobs.values() if b.shape is not None
                    and tuple(b.shape) == (batch, 4, seq, seq))
    return square, peak_live(g, plan)[2]["activations"], plan.planned_bytes


def test_the_fused_layer_with_dropout_keeps_no_square_blob():
    """With attn_dropout the fused layer has no (N, H, T, T) blob (no
    probabilities, mask or dropped probabilities) and a smaller peak of
    activations and arena than the raw sub-graph, by at least the
    probabilities, the float mask and the dropped probabilities of one
    layer."""
    fused_square, fused_peak, fused_arena = _plan(True)
    raw_square, raw_peak, raw_arena = _plan(False)
    assert fused_square == []
    assert any("probs" in b for b in raw_square) and any("attn_drop_mask" in b
                                                         for b in raw_square), raw_square
    one = 4 * 4 * 32 * 32 * 4   # a float32 (N, H, T, T)
    assert fused_peak <= raw_peak - 3 * one, (fused_peak, raw_peak)
    assert fused_arena < raw_arena


# -------------------------------------------------------- (f) recompute
def test_full_recompute_copies_the_fused_op_on_its_stream():
    """Full recompute copies a fused Attention op with dropout: the copy
    reads the original's packed mask (attr ``replay_mask``, [qkv, bits,
    iter] -> [ctx]: no mask of its own) and the gradient reads the
    original's too; the copy keeps the original's stream (attr ``stream``,
    which a GPU's redraw draws); the weights after 3 AdamW steps are
    bitwise those without recompute."""
    from purine_mpi.graph.recompute import SUFFIX, add_recompute
    from purine_mpi.layers.fillers import fill
    from purine_mpi.runtime.dispatcher import SerialDispatcher
    solver = {"type": "adamw", "base_lr": 1e-2, "weight_decay": 0.1, "max_iter": 3}
    net = gpt_net(**GPT)
    toks = np.random.default_rng(0).integers(0, 16, (3, 2, 7))
    params = {}
    for mode in ("none", "full"):
        g, _, _ = gpt_graph(net, solver, 2, 6)
        if mode == "full":
            summary = add_recompute(g, "full", _layers(net))
            copies = [op for op in g.ops.values() if op.op_type == "Attention"
                      and op.name.endswith(SUFFIX)]
            assert summary["units"] and len(copies) == 2, summary
            assert all(op.attrs["stream"] == op.name.split(".")[0] + ".attn_drop"
                       for op in copies)
            for copy in copies:
                original = g.ops[copy.name[:-len(SUFFIX)]]
                bits = original.outputs[-1]
                assert original.attrs["packed_mask"] and bits in summary["packed"]
                assert copy.inputs[1:] == [bits, "iter"] and len(copy.outputs) == 1
                (grad,) = [c for c in g.ops.values() if c.op_type == "AttentionGrad"
                           and bits in c.inputs]
                assert grad.inputs[2] == bits
            assert not any(b.dtype == "uint8" and SUFFIX in n for n, b in g.blobs.items())
        d = SerialDispatcher(g, seed=3)
        for b in g.params():   # as tests/gpt_oracle.build_ours
            d.workspace.set(b.name, fill(b, 3))
        for b in g.blobs.values():
            if b.kind == "state" and b.alias_of is None:
                d.workspace.set(b.name, np.zeros(b.shape, b.dtype))
        for it in range(3):
            step_ours(d, toks[it, :, :-1], toks[it, :, 1:], it)
        params[mode] = {p.name: d.workspace[p.name].copy() for p in g.params()}
    differ = [k for k in params["none"] if not np.array_equal(params["none"][k],
                                                                params["full"][k])]
    assert not differ, differ


def test_full_recompute_plans_the_packed_mask_across_the_boundary():
    """The memory plan under full recompute holds each fused layer's packed
    mask (uint8, ceil(N H T T / 8) bytes) from the forward op to its
    gradient, past the copy, and no (N, H, T, T) blob nor a second packed
    mask; the activation peak is below that without recompute."""
    from purine_mpi.graph.recompute import SUFFIX
    from purine_mpi.runtime.memory_plan import batch_blobs, check_plan, peak_live, plan_memory
    batch, seq, heads = 4, 32, 4
    peak = {}
    for mode in ("none", "full"):
        net = gpt_net(vocab=16, width=32, heads=heads, blocks=2, max_length=seq, dropout=0.1)
        g, _, _ = gpt_graph(net, {"type": "adamw", "base_lr": 1e-3, "max_iter": 1}, batch, seq)
        if mode == "full":
            from purine_mpi.graph.recompute import add_recompute
            add_recompute(g, "full", _layers(net))
        plan = plan_memory(g, keep=batch_blobs(g), order_ops=True)
        assert check_plan(g, plan) == []
        peak[mode] = peak_live(g, plan)[2]["activations"]
        assert not [n for n, b in g.blobs.items() if b.shape is not None
                    and tuple(b.shape) == (batch, heads, seq, seq)]
        if mode == "none":
            continue
        at = {n: i for i, n in enumerate(plan.order)}
        masks = [b for b in g.blobs.values() if b.name.endswith("attn_mask.bits")]
        assert len(masks) == 2 and not any(SUFFIX in b.name for b in masks)
        for bits in masks:
            assert bits.dtype == "uint8" and bits.shape == (-(-batch * heads * seq * seq // 8),)
            (writer,) = [op for op in g.ops.values() if bits.name in op.outputs]
            readers = {op.op_type: op for op in g.ops.values() if bits.name in op.inputs}
            assert sorted(readers) == ["Attention", "AttentionGrad"], readers
            assert readers["Attention"].name == writer.name + SUFFIX
            root = g.storage_root(bits.name)
            first, last = plan.lifetimes[root]
            assert plan.sizes[root] >= bits.nbytes
            assert first <= at[writer.name] < at[readers["Attention"].name] <= \
                at[readers["AttentionGrad"].name] <= last, (bits.name, first, last)
    assert peak["full"] < peak["none"], peak


# ------------------------------------------------- (e) the emulated device
def _emulated_losses(monkeypatch, host_build_dir, precision, fused, sdpa_on=True, iters=3,
                     cuda_graph=False, dropout=0.2, recompute="none"):
    """Losses of the 2-block GPT with attention dropout on the emulated
    device (tests/test_precision.py's runner), with the emulated cuDNN;
    the graph rewritten for ``recompute`` before its placement."""
    from purine_mpi.gpu import sdpa
    from purine_mpi.graph.recompute import add_recompute
    from tests.test_sdpa import emulate_cudnn
    import tests.test_precision as tp
    fake = emulate_cudnn(monkeypatch, sdpa_on)
    net_orig, graph_orig = tp.gpt_net, tp.gpt_graph
    monkeypatch.setattr(tp, "gpt_net", lambda **kw: net_orig(**dict(kw, width=16, heads=2,
                                                                    dropout=dropout,
                                                                    fused=fused)))

    def graph(net, *args):
        g, grads, losses = graph_orig(net, *args)
        add_recompute(g, recompute, _layers(net))
        fake.graph = g
        return g, grads, losses
    monkeypatch.setattr(tp, "gpt_graph", graph)
    toks = np.random.default_rng(3).integers(0, 16, (iters, 2, 9))
    _, losses, _ = tp._ours_on_the_emulated_device(monkeypatch, host_build_dir, precision,
                                                   toks, iters, cuda_graph=cuda_graph)
    monkeypatch.setattr(tp, "gpt_net", net_orig)
    monkeypatch.setattr(tp, "gpt_graph", graph_orig)
    sdpa.reset()
    return losses, fake


def test_the_cublas_path_applies_the_dropout_kernel_bit_for_bit(host_build_dir, monkeypatch):
    """fp32 on the emulated device (cuBLAS + the softmax and dropout raw
    kernels): the fused layer with attention dropout gives the raw
    sub-graph's losses bit for bit (the Dropout op's own Philox kernel,
    cuda/dropout.cu, on the probabilities in the op's scratch)."""
    net = gpt_net(vocab=16, width=16, heads=2, blocks=2, max_length=8, dropout=0.2)
    g, _, _ = gpt_graph(net, {"type": "adamw", "base_lr": 1e-3, "max_iter": 1}, 2, 8)
    assert sorted(op.attrs.get("dropout") for op in g.ops.values()
                  if op.op_type.startswith("Attention")) == [0.2] * 4
    fused, _ = _emulated_losses(monkeypatch, host_build_dir, "fp32", True)
    raw, _ = _emulated_losses(monkeypatch, host_build_dir, "fp32", False)
    assert fused == raw
    plain, _ = _emulated_losses(monkeypatch, host_build_dir, "fp32", True, dropout=0.0)
    assert plain != fused


def test_full_recompute_on_the_emulated_device_redraws_as_before(host_build_dir,
                                                                 monkeypatch):
    """fp32 on the emulated device under full recompute: placement
    (``redraw_attention_masks``) drops the kept packed mask and the copy's
    ``replay_mask``, so the copy and the gradient draw the mask on the
    device (the Dropout op's kernel), and the losses are those without
    recompute, bit for bit."""
    plain, _ = _emulated_losses(monkeypatch, host_build_dir, "fp32", True)
    full, fake = _emulated_losses(monkeypatch, host_build_dir, "fp32", True, recompute="full")
    attention = [op for op in fake.graph.ops.values() if op.op_type.startswith("Attention")]
    assert len(attention) == 6 and sum("@recompute" in op.name for op in attention) == 2
    assert not any(op.attrs.get(k) for op in attention for k in ("packed_mask", "replay_mask"))
    assert all(fake.graph.blobs[b].dtype != "uint8" for op in attention for b in op.inputs)
    assert full == plain


def _torch_dropped(qkv, heads, mask, dctx):
    """ctx and dqkv of softmax(q k^T / sqrt(D)) * mask then v, causal, in
    float64 (torch autograd), ``mask`` (N, H, T, T) already scaled."""
    import torch
    n, t, c3 = qkv.shape
    d = c3 // 3 // heads
    x = torch.tensor(qkv, dtype=torch.float64, requires_grad=True)
    q, k, v = (x.reshape(n, t, 3, heads, d)[:, :, i].transpose(1, 2) for i in range(3))
    s = q @ k.transpose(-1, -2) / np.sqrt(d)
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, dim=-1) * torch.tensor(mask, dtype=torch.float64)
    ctx = (p @ v).transpose(1, 2).reshape(n, t, heads * d)
    ctx.backward(torch.tensor(dctx, dtype=torch.float64))
    return ctx.detach().numpy(), x.grad.numpy()


def test_the_emulated_sdpa_takes_dropout_with_per_op_seeds_and_offsets(host_build_dir,
                                                                        monkeypatch):
    """bf16 ops marked ``sdpa`` with dropout on the emulated device: the
    plans are built with the ratio (the graphs' ``dropout`` argument), each
    op hands its own seed (from the run seed and its stream) and the offset
    iteration * N H T T; forward and backward draw one mask (the emulator's
    bits, keyed by seed and offset: a stand-in for cuDNN's) and match a
    float64 reference with that mask within bf16's tolerance; another
    iteration or another layer of the same shape draws another mask."""
    pytest.importorskip("torch")
    from purine_mpi.gpu import sdpa
    from tests.emulated_gpu import DeviceArray, use_emulated_cupy
    from tests.emulated_gpu.cudnn import dropout_mask
    from tests.test_sdpa import BF16_TOL, _bf16, emulate_cudnn
    use_emulated_cupy(monkeypatch, host_build_dir)
    fake = emulate_cudnn(monkeypatch)
    n, t, heads, d = 2, 7, 2, 8
    qkv = _bf16(np.random.default_rng(0).standard_normal((n, t, 3 * heads * d)))
    dctx = _bf16(np.random.default_rng(1).standard_normal((n, t, heads * d)))
    dev = lambda a: np.array(a).view(DeviceArray)  # noqa: E731

    def run(stream, it):
        fwd, bwd = _kernels(heads, stream=stream, seed=9, sdpa=True,
                            compute_dtype="bfloat16")
        x, i = dev(qkv.astype(np.float32)), dev(np.array(it, np.int64))
        ctx, stats = dev(np.zeros((n, t, heads * d), np.float32)), \
            dev(np.zeros((n, heads, t, 1), np.float32))
        fwd.setup([x, i], [ctx, stats])
        assert fwd._sdpa is not None and fwd._sdpa.ratio == RATIO
        fwd.run([x, i], [ctx, stats])
        dqkv = dev(np.zeros(qkv.shape, np.float32))
        ins = [dev(dctx.astype(np.float32)), x, ctx, stats, i]
        bwd.setup(ins, [dqkv])
        assert bwd._sdpa is fwd._sdpa   # one shape: the plans are shared
        bwd.run(ins, [dqkv])
        seed = int(np.asarray(fwd._sdpa_rng[0])[0])
        assert seed == sdpa.dropout_seed(*dropout_keys(9, stream))
        assert int(np.asarray(fwd._sdpa_rng[1])[0]) == it * n * heads * t * t
        mask = dropout_mask((n, heads, t, t), RATIO, seed, it * n * heads * t * t)
        return np.asarray(ctx).copy(), np.asarray(dqkv).copy(), mask

    ctx, dqkv, mask = run("a.attn_drop", 3)
    assert 0 < (mask == 0).mean() < 0.5
    want_ctx, want_dqkv = _torch_dropped(qkv, heads, mask, dctx)
    for got, want, what in ((ctx, want_ctx, "ctx"), (dqkv, want_dqkv, "dqkv")):
        err = float(np.abs(got - want).max()) / float(np.abs(want).max())
        assert err < BF16_TOL, f"{what}: {err:.3g} of the largest value"
    # the mask matters: the reference without it is far
    plain_ctx, _ = _torch_dropped(qkv, heads, np.ones_like(mask), dctx)
    assert float(np.abs(ctx - plain_ctx).max()) > 10 * BF16_TOL * float(np.abs(plain_ctx).max())
    (_, fkw), (_, bkw) = fake.graphs[0].ops[0], fake.graphs[1].ops[0]
    assert fkw["dropout"][0] == RATIO and bkw["dropout"][0] == RATIO
    for other in (run("a.attn_drop", 4), run("b.attn_drop", 3)):
        assert not np.array_equal(other[2], mask) and not np.array_equal(other[0], ctx)
    assert len([g for g in fake.graphs]) == 2   # built once for the three ops' pairs


def test_a_bf16_gpt_with_attention_dropout_runs_sdpa_and_replays_in_a_cuda_graph(
        host_build_dir, monkeypatch, capsys):
    """The bf16 GPT with attention dropout takes cuDNN's SDPA with dropout
    (one pair of plans, both blocks, every iteration) and the
    whole-iteration CUDA graph replays it with the iteration (the offsets
    written on the device): the eager losses, bit for bit."""
    eager, fake = _emulated_losses(monkeypatch, host_build_dir, "bf16", True, iters=3)
    assert [g.ops[0][0] for g in fake.graphs] == ["sdpa", "sdpa_backward"]
    assert all(g.ops[0][1]["dropout"] is not None for g in fake.graphs)
    assert len(fake.executed) == 3 * 2 * 2
    assert "fused attention (SDPA" in capsys.readouterr().err
    graphed, fake = _emulated_losses(monkeypatch, host_build_dir, "bf16", True, iters=3,
                                     cuda_graph=True)
    assert fake.executed and graphed == eager
    assert all(np.isfinite(eager))


@pytest.mark.gpu
def test_fused_attention_dropout_on_a_gpu_is_the_raw_path():
    """Runs on a GPU only: fp32 (cuBLAS + raw kernels) fused with dropout
    against the raw sub-graph's ops, the masks the Dropout op's kernel's."""
    from tests.conftest import cuda_cupy_or_skip
    cupy = cuda_cupy_or_skip()
    qkv = _qkv(2, 64, 32)
    dctx = np.random.default_rng(4).standard_normal((2, 64, 32)).astype(np.float32)
    it = np.array(5, np.int64)
    fwd, bwd = _kernels(4)
    x, i = cupy.asarray(qkv), cupy.asarray(it)
    ctx = cupy.full((2, 64, 32), np.nan, np.float32)
    fwd.setup([x, i], [ctx])
    fwd.run([x, i], [ctx])
    dqkv = cupy.full(qkv.shape, np.nan, np.float32)
    bwd.setup([cupy.asarray(dctx), x, i], [dqkv])
    bwd.run([cupy.asarray(dctx), x, i], [dqkv])
    cupy.cuda.get_current_stream().synchronize()
    want_ctx, want_dqkv = _fused(qkv, dctx, 4, 5)
    np.testing.assert_allclose(cupy.asnumpy(ctx), want_ctx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(cupy.asnumpy(dqkv), want_dqkv, rtol=1e-4, atol=1e-5)


def test_micro_batch_copies_draw_their_own_masks():
    """Copy k of the fused op (and its gradient) draws ``<stream>@mb<k>``,
    the stream copy k of the raw path's Dropout op draws: each
    micro-batch its own mask, as on the raw path."""
    from purine_mpi.parallel.micro_batch import replicate_micro_batches
    net = gpt_net(vocab=16, width=8, heads=2, blocks=1, max_length=6, dropout=0.2)
    g, grads, _ = gpt_graph(net, {"type": "adamw", "base_lr": 1e-3, "max_iter": 1}, 2, 6)
    replicate_micro_batches(g, grads, 2)
    streams = sorted((op.op_type, op.attrs["stream"]) for op in g.ops.values()
                     if op.op_type in ("Attention", "AttentionGrad"))
    assert streams == [(t, f"h0_attn.attn_drop@mb{k}") for t in ("Attention", "AttentionGrad")
                       for k in (0, 1)], streams


# ------------------------------------------- a tensor-parallel shard of heads
def _head_shard(qkv, heads, parts, index):
    """The columns of qkv (N, T, 3C) that hold heads index·H/parts.. of
    each of q, k and v (the split of parallel/tensor_parallel.py)."""
    n, t, c3 = qkv.shape
    c = c3 // 3
    w = c // parts
    return np.concatenate([qkv[:, :, b * c + index * w:b * c + (index + 1) * w]
                           for b in range(3)], axis=2)


@pytest.mark.parametrize("t", [5, 8])
def test_a_head_shards_mask_is_the_unsplit_masks_slice(t):
    """With attr mask_split {axis 1, parts, index} (set by scheme tensor's
    split) each op draws its heads' part of the unsplit op's mask, the
    element counted at its index in the whole (N, H, T, T) array: the
    Dropout op's mask, the fused op's packed mask and the gradient's redraw
    (its dqkv) are the unsplit ones' slices; T = 5 puts the shards' runs
    off the 4-word Philox blocks. Without the attr two shards draw alike."""
    from purine_mpi.ops.dropout import unpack_mask
    n, heads, d, parts, it = 3, 4, 2, 2, 6
    qkv = _qkv(n, t, heads * d, seed=3)
    dctx = np.random.default_rng(4).standard_normal((n, t, heads * d)).astype(np.float32)
    it_blob = np.array(it, np.int64)

    def dropout_mask(x, **attrs):
        k = get_kernel_class("Dropout")(Op("l.attn_drop", "Dropout", [], [], dict(
            ratio=RATIO, phase="train", seed=5, **attrs)))
        y, mask = np.empty_like(x), np.empty_like(x)
        k.run([x, it_blob], [y, mask])
        return mask

    def fused(q, do, h, **attrs):
        """The forward's packed mask, unpacked, and the gradient's dqkv
        (redrawing the mask: no packed_mask)."""
        fwd, _ = _kernels(h, packed_mask=True, **attrs)
        _, bwd = _kernels(h, **attrs)
        ctx = np.empty((n, t, q.shape[2] // 3), np.float32)
        bits = np.empty((-(-n * h * t * t // 8),), np.uint8)
        fwd.setup([q, it_blob], [ctx, bits])
        fwd.run([q, it_blob], [ctx, bits])
        dq = np.empty_like(q)
        bwd.setup([do, q, it_blob], [dq])
        bwd.run([do, q, it_blob], [dq])
        return unpack_mask(bits, (n, h, t, t), np.float32), dq

    p = np.random.default_rng(1).random((n, heads, t, t)).astype(np.float32)
    whole = dropout_mask(p)
    whole_fused, whole_dq = fused(qkv, dctx, heads)
    assert np.array_equal(whole, whole_fused)
    h = heads // parts
    got = []
    for index in range(parts):
        split = {"axis": 1, "parts": parts, "index": index}
        heads_of = slice(index * h, (index + 1) * h)
        mask = dropout_mask(np.ascontiguousarray(p[:, heads_of]), mask_split=split)
        assert np.array_equal(mask, whole[:, heads_of])
        shard = _head_shard(qkv, heads, parts, index)
        do = np.ascontiguousarray(dctx[:, :, index * h * d:(index + 1) * h * d])
        fused_mask, dq = fused(shard, do, h, mask_split=split)
        assert np.array_equal(fused_mask, whole[:, heads_of])
        np.testing.assert_allclose(dq, _head_shard(whole_dq, heads, parts, index),
                                   rtol=1e-5, atol=1e-6)
        got.append(dropout_mask(np.ascontiguousarray(p[:, heads_of])))
    # without the attr: each shard draws its local array's mask, the same
    # on both, not the unsplit heads' of shard 1
    assert np.array_equal(got[0], got[1]) and not np.array_equal(got[1], whole[:, h:])
