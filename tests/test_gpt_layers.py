"""The transformer layers' ops (embedding, position embedding, layer norm,
GELU, fc over the last axis, the token-level softmax loss, attention)
against PyTorch, with float64 finite-difference checks of their gradients,
and the layers built from a job's net."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from purine_mpi.base.errors import ShapeError
from tests.opcheck import close, numeric_grad, run_op, torch_grads

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
