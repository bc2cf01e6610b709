"""The transformer layers' ops (embedding, position embedding, layer norm,
GELU, fc over the last axis, the token-level softmax loss, attention)
against PyTorch, with float64 finite-difference checks of their gradients,
and the layers built from a job's net."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from purine_mpi.base.errors import ShapeError
from tests.opcheck import central_differences, close, numeric_grad, run_op, torch_grads

RNG = np.random.default_rng(37)


def randn(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def fd_close(grad, num):
    close(grad, num, rtol=1e-6, atol=1e-8)


# -------------------------------------------------------------- embedding
def test_embedding_matches_torch_and_scatter_adds():
    ids = np.array([[1, 3, 3, 0], [3, 1, 4, 3]], dtype=np.int32)  # repeats: the add matters
    w = randn(6, 5)
    outs, grads = run_op("Embedding", {}, {"ids": ids, "w": w}, wrt=["w"])
    y, (dw,) = torch_grads(lambda t: F.embedding(torch.tensor(ids, dtype=torch.int64), t),
                           [w], outs["_loss_weights"])
    close(outs[0], y)
    close(grads["w"], dw)
    assert not grads["w"][[2, 5]].any()  # tokens never seen get no gradient


def test_embedding_numeric_grad():
    ids = np.array([[2, 0, 2], [1, 2, 0]], dtype=np.int64)
    w, lw = randn(4, 3, dtype=np.float64), randn(2, 3, 3, dtype=np.float64)
    _, grads = run_op("Embedding", {}, {"ids": ids, "w": w}, wrt=["w"], loss_weights=[lw])
    fd_close(grads["w"], numeric_grad("Embedding", {}, {"ids": ids, "w": w}, "w", lw))


def test_embedding_rejects_out_of_range_and_float_ids():
    with pytest.raises(Exception, match="token id 7 is outside"):
        run_op("Embedding", {}, {"ids": np.array([[1, 7]], np.int32), "w": randn(4, 2)})
    with pytest.raises(ShapeError, match="integer token ids"):
        run_op("Embedding", {}, {"ids": np.zeros((1, 2), np.float32), "w": randn(4, 2)})


def test_position_embedding_matches_torch():
    x, w = randn(2, 3, 4), randn(5, 4)
    outs, grads = run_op("PositionEmbedding", {}, {"x": x, "w": w}, wrt=["x", "w"])
    y, (dx, dw) = torch_grads(lambda a, b: a + b[:3], [x, w], outs["_loss_weights"])
    close(outs[0], y)
    close(grads["x"], dx)
    close(grads["w"], dw)
    assert not grads["w"][3:].any()


def test_position_embedding_numeric_grad():
    x, w, lw = randn(2, 2, 3, dtype=np.float64), randn(3, 3, dtype=np.float64), \
        randn(2, 2, 3, dtype=np.float64)
    _, grads = run_op("PositionEmbedding", {}, {"x": x, "w": w}, wrt=["x", "w"],
                      loss_weights=[lw])
    for name in ("x", "w"):
        fd_close(grads[name], numeric_grad("PositionEmbedding", {}, {"x": x, "w": w}, name, lw))


def test_position_embedding_needs_a_long_enough_table():
    with pytest.raises(ShapeError, match="cannot serve"):
        run_op("PositionEmbedding", {}, {"x": randn(1, 4, 2), "w": randn(3, 2)})


# -------------------------------------------------------------- layer norm
def test_layer_norm_matches_torch():
    x, g, b = randn(2, 3, 8) * 3 + 1, randn(8), randn(8)
    outs, grads = run_op("LayerNorm", {"eps": 1e-5}, {"x": x, "g": g, "b": b},
                         wrt=["x", "g", "b"])
    y, (dx, dg, db) = torch_grads(lambda a, w, c: F.layer_norm(a, (8,), w, c, 1e-5), [x, g, b],
                                  outs["_loss_weights"])
    close(outs[0], y)
    for ours, ref in ((grads["x"], dx), (grads["g"], dg), (grads["b"], db)):
        close(ours, ref)


@pytest.mark.parametrize("wrt", [("x", "g", "b"), ("x",), ("g",)])
def test_layer_norm_numeric_grad(wrt):
    x, g, b = randn(2, 2, 5, dtype=np.float64), randn(5, dtype=np.float64), \
        randn(5, dtype=np.float64)
    lw = randn(2, 2, 5, dtype=np.float64)
    ins = {"x": x, "g": g, "b": b}
    _, grads = run_op("LayerNorm", {"eps": 1e-5}, ins, wrt=list(wrt), loss_weights=[lw])
    assert set(grads) == set(wrt)
    for name in wrt:
        fd_close(grads[name], numeric_grad("LayerNorm", {"eps": 1e-5}, ins, name, [lw]))


# ------------------------------------------------------------------- gelu
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_matches_torch(approximate):
    x = randn(3, 4, 5) * 3
    outs, grads = run_op("Gelu", {"approximate": approximate}, {"x": x}, wrt=["x"])
    y, (dx,) = torch_grads(lambda t: F.gelu(t, approximate=approximate), [x],
                           outs["_loss_weights"])
    close(outs[0], y)
    close(grads["x"], dx)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_numeric_grad(approximate):
    x, lw = randn(3, 5, dtype=np.float64) * 2, randn(3, 5, dtype=np.float64)
    attrs = {"approximate": approximate}
    _, grads = run_op("Gelu", attrs, {"x": x}, wrt=["x"], loss_weights=[lw])
    fd_close(grads["x"], numeric_grad("Gelu", attrs, {"x": x}, "x", lw))


def test_gelu_without_scipy_uses_math_erf(monkeypatch):
    import sys
    x = randn(4, 6) * 3
    monkeypatch.setitem(sys.modules, "scipy.special", None)  # import fails
    outs, _ = run_op("Gelu", {}, {"x": x})
    close(outs[0], F.gelu(torch.tensor(x)).numpy())


# ------------------------------------------------- fc over the last axis
def test_inner_product_over_the_last_axis_matches_torch():
    x, w, b = randn(2, 3, 4), randn(5, 4), randn(5)
    outs, grads = run_op("InnerProduct", {"axis": 2}, {"x": x, "w": w, "b": b},
                         wrt=["x", "w", "b"])
    y, (dx, dw, db) = torch_grads(F.linear, [x, w, b], outs["_loss_weights"])
    assert outs[0].shape == (2, 3, 5)
    close(outs[0], y)
    for ours, ref in ((grads["x"], dx), (grads["w"], dw), (grads["b"], db)):
        close(ours, ref)


def test_inner_product_over_the_last_axis_numeric_grad():
    ins = {"x": randn(2, 3, 4, dtype=np.float64), "w": randn(2, 4, dtype=np.float64)}
    lw = randn(2, 3, 2, dtype=np.float64)
    _, grads = run_op("InnerProduct", {"axis": 2}, ins, wrt=["x", "w"], loss_weights=[lw])
    for name in ("x", "w"):
        fd_close(grads[name], numeric_grad("InnerProduct", {"axis": 2}, ins, name, lw))


def net_graph(net, n=2, t=4, vocab=7, phase="train"):
    """The forward graph of ``net`` over int32 token blobs data and label
    (n, t), as the text source gives them."""
    from purine_mpi.graph import Graph
    from purine_mpi.layers import build_net
    g = Graph("gpt")
    g.add_blob("data", (n, t), "int32", kind="data")
    g.add_blob("label", (n, t), "int32", kind="data")
    build_net(net, phase, (g, "job.yaml"))
    return g.infer_shapes()


def test_fc_layer_axis_and_tied_weight():
    from purine_mpi.graph.grad import build_backward
    net = [{"type": "embedding", "name": "wte", "bottom": "data", "top": "x", "input_dim": 7,
            "num_output": 3},
           {"type": "fc", "name": "head", "bottom": "x", "top": "logits", "axis": -1,
            "num_output": 7, "bias_term": False, "tie_weight": "wte"},
           {"type": "softmax_loss", "name": "loss", "bottom": ["logits", "label"], "axis": -1}]
    g = net_graph(net)
    assert g.blobs["logits"].shape == (2, 4, 7)
    assert sorted(b.name for b in g.params()) == ["wte/weight"]  # one table, two uses
    grads = build_backward(g, {"loss": 1.0})
    producers = g.producers()[grads["wte/weight"]]
    assert [p.op_type for p in producers] == ["Sum"]  # the embedding's and the head's


@pytest.mark.parametrize("entry,message", [
    ({"tie_weight": "nope"}, "no earlier layer named 'nope'"),
    ({"tie_weight": "wte", "num_output": 5}, "needs \\[5, 3\\]"),
    ({"axis": 3}, "expected an axis in 1..2"),
])
def test_fc_layer_bad_axis_or_tie_exits_2(entry, message):
    from purine_mpi.base.errors import ConfigError
    fc = dict({"type": "fc", "name": "head", "bottom": "x", "axis": -1, "num_output": 7}, **entry)
    net = [{"type": "embedding", "name": "wte", "bottom": "data", "top": "x", "input_dim": 7,
            "num_output": 3}, fc]
    with pytest.raises(ConfigError, match=message) as err:
        net_graph(net)
    assert "net[1]" in str(err.value) and "job.yaml" in str(err.value)


# --------------------------------------------------- token-level softmax loss
def test_token_level_softmax_loss_matches_torch_in_nats_per_token():
    x = randn(2, 5, 7) * 4
    label = RNG.integers(0, 7, (2, 5)).astype(np.int32)
    label[1, 3] = 6
    for attrs, kw in (({"axis": -1}, {}), ({"axis": 2, "ignore_label": 6}, {"ignore_index": 6})):
        outs, grads = run_op("SoftmaxLoss", attrs, {"x": x, "label": label}, wrt=["x"],
                             loss_weights=[np.float32(1.0)])
        xt = torch.tensor(x, requires_grad=True)
        ref = F.cross_entropy(xt.reshape(-1, 7), torch.tensor(label.reshape(-1)).long(), **kw)
        ref.backward()
        close(outs[0], ref.item())
        close(grads["x"], xt.grad.numpy())


def test_token_level_softmax_loss_numeric_grad():
    x = randn(2, 3, 4, dtype=np.float64)
    ins = {"x": x, "label": RNG.integers(0, 4, (2, 3)).astype(np.int32)}
    _, grads = run_op("SoftmaxLoss", {"axis": -1}, ins, wrt=["x"], loss_weights=[1.0])
    fd_close(grads["x"], numeric_grad("SoftmaxLoss", {"axis": -1}, ins, "x", [1.0]))


# -------------------------------------------------------------- attention
def torch_attention(qkv, heads, causal=True):
    """The reference: PyTorch's scaled_dot_product_attention on nanoGPT's layout."""
    n, t, c3 = qkv.shape
    q, k, v = qkv.split(c3 // 3, dim=2)
    q, k, v = (z.reshape(n, t, heads, -1).transpose(1, 2) for z in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return o.transpose(1, 2).reshape(n, t, c3 // 3)


def run_attention(path, qkv, heads, causal=True, loss_weights=None):
    """ctx and dqkv through the fused op or the raw sub-graph (ops chained
    in one graph through the real gradient builder)."""
    from purine_mpi.graph import Graph
    from purine_mpi.graph.grad import build_backward
    from purine_mpi.runtime.dispatcher import SerialDispatcher
    g = Graph("attn")
    g.add_blob("qkv", qkv.shape, qkv.dtype, kind="param")
    attrs = {"num_heads": heads, "causal": causal}
    if path == "fused":
        g.add_op("a.fwd", "Attention", ["qkv"], ["ctx"], attrs)
    else:
        g.add_op("s.fwd", "AttentionScores", ["qkv"], ["s"], attrs)
        g.add_op("p.fwd", "Softmax", ["s"], ["p"], {"axis": 3})
        g.add_op("c.fwd", "AttentionContext", ["p", "qkv"], ["ctx"], attrs)
    g.infer_shapes()
    lw = loss_weights if loss_weights is not None else \
        RNG.standard_normal(g.blobs["ctx"].shape).astype(qkv.dtype)
    g.add_blob("lw", lw.shape, lw.dtype)
    g.add_op("loss.fwd", "WeightedSum", ["ctx", "lw"], ["loss"])
    g.infer_shapes()
    grads = build_backward(g, {"loss": 1.0}, params=["qkv"])
    g.infer_shapes()
    d = SerialDispatcher(g)
    d.workspace.set("qkv", qkv)
    d.workspace.set("lw", lw)
    d.run()
    return d.workspace["ctx"].copy(), d.workspace[grads["qkv"]].copy(), lw


@pytest.mark.parametrize("path", ["fused", "raw"])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_matches_torch(path, causal):
    qkv = randn(2, 5, 3 * 8)
    ctx, dqkv, lw = run_attention(path, qkv, heads=2, causal=causal)
    y, (ref,) = torch_grads(lambda t: torch_attention(t, 2, causal), [qkv], lw)
    close(ctx, y)
    close(dqkv, ref)


@pytest.mark.parametrize("path", ["fused", "raw"])
def test_attention_numeric_grad(path):
    qkv = randn(1, 4, 3 * 4, dtype=np.float64)
    lw = randn(1, 4, 4, dtype=np.float64)
    _, dqkv, _ = run_attention(path, qkv, heads=2, loss_weights=lw)
    num = central_differences(lambda x: np.sum(run_attention(path, x, 2, loss_weights=lw)[0] * lw),
                              qkv)
    fd_close(dqkv, num)


@pytest.mark.parametrize("path", ["fused", "raw"])
def test_attention_long_rows_with_large_logits_stay_finite(path):
    """Rows of 2048 positions with logits in the thousands: the
    max-subtracted softmax neither overflows nor loses the answer. The data
    come from a generator of the test's own: at such logits the float32
    context's error against the float64 reference is the inputs'
    conditioning (PyTorch's float32 SDPA has the same error to 3 digits on
    16 seeds, 0.2-0.8 of the tolerance; one draw of the module's shared
    generator, which depends on the tests run before, reached 1.2)."""
    t, c = 2048, 8
    qkv = np.random.default_rng(0).standard_normal((1, t, 3 * c)).astype(np.float32)
    qkv[:, :, :2 * c] *= 30  # q . k / sqrt(8) up to a few thousand
    with np.errstate(over="raise", invalid="raise"):
        ctx, dqkv, lw = run_attention(path, qkv, heads=1)
    assert np.isfinite(ctx).all() and np.isfinite(dqkv).all()
    y, (ref,) = torch_grads(lambda z: torch_attention(z.double(), 1).float(), [qkv], lw)
    close(ctx, y, rtol=1e-3, atol=1e-4)
    close(dqkv, ref, rtol=1e-3, atol=1e-4)


# ------------------------------------------------------------ memory plan
@pytest.mark.parametrize("fused", [True, False])
def test_gpt_trains_bitwise_with_the_memory_plan(fused):
    """The static memory plan covers the GPT's ops: sound, smaller than one
    buffer per blob, with the new element-wise ops computed in place where
    their input dies there, and 3 AdamW steps bitwise equal to unplanned."""
    from purine_mpi.runtime.memory_plan import check_plan
    from tests.gpt_oracle import build_ours, gpt_net, step_ours
    net = gpt_net(vocab=16, width=8, heads=2, blocks=2, max_length=6, fused=fused)
    solver = {"type": "adamw", "base_lr": 1e-2, "weight_decay": 0.1, "max_iter": 3}
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 16, (3, 2, 7))
    runs = []
    for plan in (False, True):
        d, _, _ = build_ours(net, solver, 2, 6, seed=1, plan=plan)
        for it in range(3):
            step_ours(d, toks[it, :, :-1], toks[it, :, 1:], it)
        runs.append({b.name: d.workspace[b.name].copy() for b in d.graph.params()})
    for name in runs[0]:
        assert np.array_equal(runs[0][name], runs[1][name]), name
    g, plan = d.graph, d.workspace.plan
    assert check_plan(g, plan) == [] and plan.total_bytes < plan.unplanned_bytes
    in_place = {g.ops[op].op_type for _, op in plan.in_place.values()}
    assert {"PositionEmbedding", "GeluGrad"} <= in_place, in_place


# ------------------------------------------------------------ checkpoints
def test_transformer_params_in_checkpoints_inspect_and_init(tmp_path):
    """train writes the new layers' params (one tied table), `inspect` lists
    them with their shapes, `--init` loads them all (and names a mismatch)."""
    from purine_mpi.job.checkpoint_file import load_params
    from tests.conftest import run_cli_args, run_cli_here, train_here, write_config_file
    cfg = {"data": {"train": {"source": "synthetic", "shape": [1], "classes": 4,
                              "batch_size": 4}},
           "solver": {"type": "adamw", "base_lr": 0.01, "max_iter": 2},
           "net": [{"type": "embedding", "name": "wte", "bottom": "label", "top": "tok",
                    "input_dim": 4, "num_output": 16},
                   {"type": "reshape", "name": "seq", "bottom": "tok", "shape": [0, 4, 4]},
                   {"type": "position_embedding", "name": "wpe", "bottom": "seq",
                    "max_length": 6},
                   {"type": "layer_norm", "name": "ln", "bottom": "wpe"},
                   {"type": "attention", "name": "attn", "bottom": "ln", "num_heads": 2},
                   {"type": "gelu", "name": "act", "bottom": "attn", "top": "attn",
                    "approximate": "tanh"},
                   {"type": "fc", "name": "head", "bottom": "attn", "num_output": 4,
                    "bias_term": False, "tie_weight": "wte"},
                   {"type": "softmax_loss", "name": "loss", "bottom": ["head", "label"]}]}
    path = write_config_file(tmp_path, cfg)
    ckpt = train_here(path, tmp_path / "run") / "latest.h5"
    params = load_params(str(ckpt))
    shapes = {k: list(v.shape) for k, v in params.items()}
    assert shapes == {"wte/weight": [4, 16], "wpe/weight": [6, 4], "ln/weight": [4],
                      "ln/bias": [4], "attn/qkv_weight": [12, 4], "attn/qkv_bias": [12],
                      "attn/proj_weight": [4, 4], "attn/proj_bias": [4]}
    shown = run_cli_here("inspect", ckpt)
    assert shown.returncode == 0, shown.stderr
    for name in shapes:
        assert name in shown.stdout
    init = run_cli_args("train", path, "--out", tmp_path / "ft", "--init", ckpt)
    assert init.returncode == 0 and f"loaded {len(shapes)} blobs" in init.stdout, init.stdout
    cfg["net"][2]["max_length"] = 5
    bad = run_cli_args("train", write_config_file(tmp_path, cfg, "bad.yaml"), "--out",
                       tmp_path / "bad", "--init", ckpt)
    assert bad.returncode == 2 and "wpe/weight" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("layer,message", [
    ({"type": "embedding", "name": "wte", "bottom": "data", "input_dim": 4, "num_output": 8},
     "key 'net[0].bottom': layer 'wte': embedding needs integer token ids, 'data' holds "
     "float32"),
    ({"type": "attention", "name": "attn", "bottom": "data", "num_heads": 4},
     "key 'net[0].num_heads': layer 'attn': num_heads 4 must divide the width 6"),
    ({"type": "position_embedding", "name": "wpe", "bottom": "data", "max_length": 3},
     "key 'net[0].max_length': layer 'wpe': sequences of 4 tokens need max_length >= 4"),
    ({"type": "attention", "name": "attn", "bottom": "data", "num_heads": 2,
      "attn_dropout": 1.0}, "key 'net[0].attn_dropout': layer 'attn' (attention): expected "
                            "a number in [0, 1) (finite), got 1.0"),
])
def test_transformer_layer_misuse_exits_2_naming_file_and_key(tmp_path, layer, message):
    from tests.conftest import run_cli_args, write_config_file
    cfg = {"data": {"train": {"source": "synthetic", "shape": [4, 6], "classes": 4,
                              "batch_size": 2}},
           "net": [layer, {"type": "fc", "name": "head", "bottom": layer["name"],
                           "num_output": 4},
                   {"type": "softmax_loss", "name": "loss", "bottom": ["head", "label"]}]}
    res = run_cli_args("train", write_config_file(tmp_path, cfg), "--out", tmp_path / "r")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "cfg.yaml" in res.stderr and message in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_next_token_accuracy_over_the_last_axis():
    net = [{"type": "embedding", "name": "wte", "bottom": "data", "top": "x", "input_dim": 7,
            "num_output": 7},
           {"type": "accuracy", "name": "acc", "bottom": ["x", "label"], "axis": -1},
           {"type": "accuracy", "name": "acc2", "bottom": ["x", "label"], "axis": 2,
            "top_k": 2}]
    g = net_graph(net, phase="test")
    assert g.ops["acc.fwd"].attrs["axis"] == 2 and g.blobs["acc"].attrs["metric"]
    logits = randn(2, 4, 7)
    label = RNG.integers(0, 7, (2, 4)).astype(np.int32)
    outs, _ = run_op("Accuracy", {"axis": 2}, {"x": logits, "label": label})
    assert outs[0] == pytest.approx(np.mean(logits.argmax(-1) == label))
    outs, _ = run_op("Accuracy", {"axis": 2, "top_k": 2}, {"x": logits, "label": label})
    top2 = np.argsort(-logits, axis=-1)[..., :2]
    assert outs[0] == pytest.approx(np.mean((top2 == label[..., None]).any(-1)))
