"""Activations, softmax, softmax loss, accuracy and dropout against PyTorch,
plus float64 finite-difference checks of each family's gradient."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from purine_mpi.graph import Graph
from purine_mpi.graph.grad import build_backward
from purine_mpi.base.errors import ShapeError
from tests.opcheck import close, numeric_grad, run_op

RNG = np.random.default_rng(1)


def randn(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)



def torch_value_and_grad(fn, x, weight):
    """fn(x) and d sum(fn(x) * weight) / dx with torch."""
    xt = torch.tensor(x, requires_grad=True)
    y = fn(xt)
    (y * torch.tensor(weight)).sum().backward()
    return y.detach().numpy(), xt.grad.numpy()


# ------------------------------------------------------------ activations
@pytest.mark.parametrize("op_type,attrs,torch_fn", [
    ("Relu", {}, F.relu),
    ("Relu", {"negative_slope": 0.1}, lambda t: F.leaky_relu(t, 0.1)),
    ("Sigmoid", {}, torch.sigmoid),
    ("Tanh", {}, torch.tanh),
])
def test_activation_matches_torch(op_type, attrs, torch_fn):
    x = randn(3, 4, 5) * 3
    outs, grads = run_op(op_type, attrs, {"x": x}, wrt=["x"])
    y, dx = torch_value_and_grad(torch_fn, x, outs["_loss_weights"])
    close(outs[0], y)
    close(grads["x"], dx)


def test_sigmoid_extreme_inputs_do_not_overflow():
    x = np.array([-1000.0, -50.0, 0.0, 50.0, 1000.0], dtype=np.float32)
    with np.errstate(all="raise"):
        outs, _ = run_op("Sigmoid", {}, {"x": x})
    close(outs[0], torch.sigmoid(torch.tensor(x)).numpy())


@pytest.mark.parametrize("op_type,attrs", [
    ("Relu", {"negative_slope": 0.2}), ("Sigmoid", {}), ("Tanh", {})])
def test_activation_numeric_grad(op_type, attrs):
    x = randn(2, 3, dtype=np.float64)
    x[np.abs(x) < 1e-3] = 0.5  # keep away from ReLU's kink
    w = randn(2, 3, dtype=np.float64)
    _, grads = run_op(op_type, attrs, {"x": x}, wrt=["x"], loss_weights=[w])
    close(grads["x"], numeric_grad(op_type, attrs, {"x": x}, "x", w), rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------- softmax
@pytest.mark.parametrize("shape,axis", [((4, 5), 1), ((2, 3, 2, 2), 1), ((2, 3, 4), -1)])
def test_softmax_matches_torch(shape, axis):
    x = randn(*shape) * 2
    outs, grads = run_op("Softmax", {"axis": axis}, {"x": x}, wrt=["x"])
    y, dx = torch_value_and_grad(lambda t: F.softmax(t, dim=axis), x, outs["_loss_weights"])
    close(outs[0], y)
    close(grads["x"], dx)


def test_softmax_numeric_grad():
    x, w = randn(3, 4, dtype=np.float64), randn(3, 4, dtype=np.float64)
    _, grads = run_op("Softmax", {}, {"x": x}, wrt=["x"], loss_weights=[w])
    close(grads["x"], numeric_grad("Softmax", {}, {"x": x}, "x", w), rtol=1e-6, atol=1e-8)


def torch_ce(x, label, **kw):
    xt = torch.tensor(x, requires_grad=True)
    loss = F.cross_entropy(xt, torch.tensor(label, dtype=torch.int64), **kw)
    loss.backward()
    return loss.item(), xt.grad.numpy()


@pytest.mark.parametrize("case", ["plain", "ignore", "spatial", "spatial_ignore", "float_label"])
def test_softmax_loss_matches_torch_cross_entropy(case):
    spatial = case.startswith("spatial")
    x = randn(4, 5, 3, 2) * 2 if spatial else randn(6, 5) * 2
    label = RNG.integers(0, 5, size=(4, 3, 2) if spatial else (6,))
    attrs, kw = {}, {}
    if "ignore" in case:
        label.flat[::3] = 255
        attrs, kw = {"ignore_label": 255}, {"ignore_index": 255}
    feed = label.astype(np.float32) if case == "float_label" else label
    outs, grads = run_op("SoftmaxLoss", attrs, {"x": x, "label": feed}, wrt=["x"],
                         loss_weights=[np.float32(1.0), None])
    loss, dx = torch_ce(x, label, **kw)
    assert outs[0].shape == ()
    close(outs[0], loss)
    close(outs[1], F.softmax(torch.tensor(x), dim=1).numpy())
    close(grads["x"], dx)


@pytest.mark.parametrize("axis", [1, -1])
def test_softmax_loss_with_a_normaliser_divides_the_sum_by_it(axis):
    """A third input (the data reader's global count over the shards,
    ops/data.py ``count_label``) replaces the shard's own count: loss and
    gradient are PyTorch's summed CrossEntropyLoss(ignore_index) over it,
    (N, C) scores and the (N, T, V) logits of the text losses alike."""
    x = randn(4, 3, 5) * 2
    label = RNG.integers(0, 5, size=(4, 3)) if axis == -1 else RNG.integers(0, 3, size=(4, 5))
    label.flat[::4] = 2
    norm = np.float64(13.0 / 3)
    attrs = {"ignore_label": 2} if axis == 1 else {"ignore_label": 2, "axis": 2}
    outs, grads = run_op("SoftmaxLoss", attrs, {"x": x, "label": label, "norm": norm},
                         wrt=["x"], loss_weights=[np.float32(1.0), None])
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    logits = xt if axis == 1 else xt.permute(0, 2, 1)
    loss = F.cross_entropy(logits, torch.tensor(label), ignore_index=2, reduction="sum") / norm
    loss.backward()
    close(outs[0], loss.item())
    close(grads["x"], xt.grad.numpy())


def test_softmax_loss_scales_by_loss_weight_and_ignores_all():
    x, label = randn(3, 4), np.array([1, 2, 3])
    outs, grads = run_op("SoftmaxLoss", {}, {"x": x, "label": label}, wrt=["x"],
                         loss_weights=[np.float32(2.5), None])
    close(grads["x"], 2.5 * torch_ce(x, label)[1])
    outs, grads = run_op("SoftmaxLoss", {"ignore_label": -1},
                         {"x": x, "label": np.full(3, -1)}, wrt=["x"],
                         loss_weights=[np.float32(1.0), None])
    assert outs[0] == 0.0 and not grads["x"].any()


def test_softmax_loss_gradient_never_targets_label():
    g = Graph()
    g.add_blob("x", (3, 4), kind="param")
    g.add_blob("label", (3,), "float32", kind="param")
    g.add_op("loss.fwd", "SoftmaxLoss", ["x", "label"], ["loss", "prob"])
    g.infer_shapes()
    grads = build_backward(g, {"loss": 1.0})
    assert set(grads) == {"x"}
    assert not any("label.grad" in b for op in g.ops.values() for b in op.outputs)


def test_softmax_loss_numeric_grad():
    x, label = randn(3, 4, 2, dtype=np.float64), RNG.integers(0, 4, size=(3, 2))
    w = [np.float64(0.7), None]
    _, grads = run_op("SoftmaxLoss", {}, {"x": x, "label": label}, wrt=["x"], loss_weights=w)
    num = numeric_grad("SoftmaxLoss", {}, {"x": x, "label": label}, "x", w)
    close(grads["x"], num, rtol=1e-6, atol=1e-8)


def test_softmax_loss_bad_label():
    with pytest.raises(ShapeError, match="one label per position"):
        run_op("SoftmaxLoss", {}, {"x": randn(3, 4), "label": np.zeros(4)})
    with pytest.raises(Exception, match="outside"):
        run_op("SoftmaxLoss", {}, {"x": randn(3, 4), "label": np.array([0, 4, 1])})


@pytest.mark.parametrize("top_k", [1, 3])
def test_accuracy_matches_topk(top_k):
    x, label = randn(20, 6), RNG.integers(0, 6, size=20)
    outs, _ = run_op("Accuracy", {"top_k": top_k}, {"x": x, "label": label})
    expect = (torch.topk(torch.tensor(x), top_k, dim=1).indices.numpy()
              == label[:, None]).any(axis=1).mean()
    assert outs[0].shape == () and outs[0] == pytest.approx(expect)


def test_accuracy_spatial_with_ignore():
    x, label = randn(2, 3, 2, 2), RNG.integers(0, 3, size=(2, 2, 2))
    label[0, 0, 0] = -1
    outs, _ = run_op("Accuracy", {"ignore_label": -1}, {"x": x, "label": label})
    hit = (x.argmax(axis=1) == label)[label != -1]
    assert outs[0] == pytest.approx(hit.mean())


def test_accuracy_counts_non_finite_scores_as_wrong():
    """A diverged net (NaN or inf scores) must not look perfect."""
    x, label = randn(8, 4), np.arange(8) % 4
    x[label == 0, 0] += 100.0  # rows with label 0 are right
    x[0] = np.nan                      # label 0, all NaN
    x[4, 0] = np.inf                   # label 0, true score inf
    x[1, 3] = np.nan                   # label 1: one NaN score elsewhere
    outs, _ = run_op("Accuracy", {}, {"x": x, "label": label})
    finite = np.isfinite(x).all(axis=1)
    expect = ((x.argmax(axis=1) == label) & finite).mean()
    assert outs[0] == pytest.approx(expect)
    outs, _ = run_op("Accuracy", {}, {"x": np.full((5, 3), np.nan), "label": np.zeros(5)})
    assert outs[0] == 0.0


# ---------------------------------------------------------------- dropout
def _it(value=0):
    return np.asarray(value, np.int64)


def test_dropout_train_matches_mask_and_torch_scaling():
    x = randn(50, 40)
    outs, grads = run_op("Dropout", {"ratio": 0.3}, {"x": x, "iter": _it()}, wrt=["x"])
    y, mask = outs[0], outs[1]
    assert set(np.unique(mask)) <= {0.0, 1.0}
    assert abs(mask.mean() - 0.7) < 0.05
    # the same mask fed to torch's formula (inverted dropout)
    close(y, (torch.tensor(x) * torch.tensor(mask) / 0.7).numpy())
    close(grads["x"], outs["_loss_weights"][0] * mask / 0.7)
    again, _ = run_op("Dropout", {"ratio": 0.3}, {"x": x, "iter": _it()})
    assert np.array_equal(again[1], mask)  # same seed and iteration, same mask
    later, _ = run_op("Dropout", {"ratio": 0.3}, {"x": x, "iter": _it(1)})
    assert not np.array_equal(later[1], mask)  # the next iteration draws anew
    other_seed, _ = run_op("Dropout", {"ratio": 0.3}, {"x": x, "iter": _it()}, rng_seed=1)
    assert not np.array_equal(other_seed[1], mask)


def test_dropout_test_phase_is_identity():
    x = randn(4, 5)
    outs, grads = run_op("Dropout", {"ratio": 0.5, "phase": "test"}, {"x": x}, wrt=["x"])
    assert len([k for k in outs if k != "_loss_weights"]) == 1
    close(outs[0], x)
    close(grads["x"], outs["_loss_weights"])


def test_dropout_numeric_grad():
    x, w = randn(4, 6, dtype=np.float64), randn(4, 6, dtype=np.float64)
    inputs = {"x": x, "iter": _it(3)}
    _, grads = run_op("Dropout", {"ratio": 0.5}, inputs, wrt=["x"], loss_weights=[w, None])
    # the mask depends only on seed, op and iteration, so central differences see one mask
    num = numeric_grad("Dropout", {"ratio": 0.5}, inputs, "x", [w, None])
    close(grads["x"], num, rtol=1e-6, atol=1e-8)


def test_dropout_rejects_bad_ratio():
    with pytest.raises(ShapeError, match="ratio"):
        run_op("Dropout", {"ratio": 1.0}, {"x": randn(2, 2), "iter": _it()})
