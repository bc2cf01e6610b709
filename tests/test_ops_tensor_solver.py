"""Tensor plumbing ops (Concat, Slice, Split, Eltwise, Reshape, Flatten,
Scale) against PyTorch, and the solver ops: learning-rate policies in closed
form and SGDUpdate against torch.optim.SGD."""
import math

import numpy as np
import pytest
import torch

from purine_mpi.base.errors import ConfigError, ShapeError
from purine_mpi.graph import Graph
import purine_mpi.ops.catalog  # noqa: F401  (register every kernel family)
from purine_mpi.ops.lr_policy import learning_rate
from purine_mpi.runtime.dispatcher import SerialDispatcher
from tests.opcheck import close, numeric_grad, run_op, torch_grads

RNG = np.random.default_rng(2)


def randn(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)




# ------------------------------------------------------- Concat / Slice / Split
@pytest.mark.parametrize("axis", [1, 0, -1])
def test_concat_matches_torch_cat(axis):
    shapes = {1: [(2, 1, 3), (2, 4, 3)], 0: [(1, 2, 3), (3, 2, 3)], -1: [(2, 2, 1), (2, 2, 2)]}
    a, b = (randn(*s) for s in shapes[axis])
    c = randn(*shapes[axis][0])
    outs, grads = run_op("Concat", {"axis": axis}, {"a": a, "b": b, "c": c}, wrt=["a", "b"])
    y, (da, db, _) = torch_grads(lambda *t: torch.cat(t, dim=axis), [a, b, c],
                                 outs["_loss_weights"])
    close(outs[0], y)
    close(grads["a"], da)
    close(grads["b"], db)
    assert "c" not in grads


def test_concat_numeric_grad_and_shape_error():
    a, b = randn(2, 2, dtype=np.float64), randn(2, 3, dtype=np.float64)
    w = randn(2, 5, dtype=np.float64)
    _, grads = run_op("Concat", {}, {"a": a, "b": b}, wrt=["b"], loss_weights=[w])
    close(grads["b"], numeric_grad("Concat", {}, {"a": a, "b": b}, "b", w), rtol=1e-6)
    with pytest.raises(ShapeError, match="equal in every other axis"):
        run_op("Concat", {"axis": 1}, {"a": randn(2, 2), "b": randn(3, 2)})


def test_slice_matches_torch_split_with_a_missing_gradient():
    x = randn(2, 6, 2)
    w0 = randn(2, 1, 2)
    outs, grads = run_op("Slice", {"axis": 1, "slice_point": [1, 4]}, {"x": x}, wrt=["x"],
                         loss_weights=[w0, None, randn(2, 2, 2)])
    parts = torch.split(torch.tensor(x), [1, 3, 2], dim=1)
    for k in range(3):
        close(outs[k], parts[k].numpy())
    expect = np.concatenate([w0, np.zeros((2, 3, 2)), outs["_loss_weights"][2]], axis=1)
    close(grads["x"], expect)
    outs, _ = run_op("Slice", {"n_outputs": 2}, {"x": x})
    close(outs[1], x[:, 3:])


@pytest.mark.parametrize("weights", ["both", "one"])
def test_split_copies_and_sums_gradients(weights):
    x = randn(3, 4)
    w = [randn(3, 4), randn(3, 4) if weights == "both" else None]
    outs, grads = run_op("Split", {"n_outputs": 2}, {"x": x}, wrt=["x"], loss_weights=w)
    close(outs[0], x)
    close(outs[1], x)
    close(grads["x"], w[0] + (w[1] if w[1] is not None else 0))


# ---------------------------------------------------------------- Eltwise
@pytest.mark.parametrize("attrs,fn", [
    ({}, lambda a, b, c: a + b + c),
    ({"operation": "sum", "coeff": [1.0, -2.0, 0.5]}, lambda a, b, c: a - 2 * b + 0.5 * c),
    ({"operation": "prod"}, lambda a, b, c: a * b * c),
    ({"operation": "max"}, lambda a, b, c: torch.maximum(torch.maximum(a, b), c)),
])
def test_eltwise_matches_torch(attrs, fn):
    xs = [randn(2, 3, 4) for _ in range(3)]
    inputs = dict(zip("abc", xs))
    outs, grads = run_op("Eltwise", attrs, inputs, wrt=list("abc"))
    y, dxs = torch_grads(fn, xs, outs["_loss_weights"])
    close(outs[0], y)
    for name, dx in zip("abc", dxs):
        close(grads[name], dx)


def test_eltwise_max_ties_go_to_the_first_input():
    a = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    b = np.array([1.0, 5.0, 3.0], dtype=np.float32)
    c = np.array([0.0, 5.0, 3.0], dtype=np.float32)
    w = np.ones(3, dtype=np.float32)
    _, grads = run_op("Eltwise", {"operation": "max"}, {"a": a, "b": b, "c": c},
                      wrt=list("abc"), loss_weights=[w])
    assert grads["a"].tolist() == [1, 0, 1]
    assert grads["b"].tolist() == [0, 1, 0]
    assert grads["c"].tolist() == [0, 0, 0]


def test_eltwise_prod_with_zero_and_numeric_grad():
    a, b = randn(3, 2, dtype=np.float64), randn(3, 2, dtype=np.float64)
    a[0, 0] = 0.0  # d(ab)/db = a must stay exact (no division by b)
    w = randn(3, 2, dtype=np.float64)
    attrs = {"operation": "prod"}
    _, grads = run_op("Eltwise", attrs, {"a": a, "b": b}, wrt=["a", "b"], loss_weights=[w])
    close(grads["b"], numeric_grad("Eltwise", attrs, {"a": a, "b": b}, "b", w), rtol=1e-6)
    close(grads["a"], w * b)


# ------------------------------------------------- Reshape, Flatten, Scale
@pytest.mark.parametrize("spec,expect", [([0, -1], (2, 12)), ([-1, 0, 2], (4, 3, 2)),
                                         ([4, 6], (4, 6))])
def test_reshape_caffe_convention(spec, expect):
    x = randn(2, 3, 4)
    outs, grads = run_op("Reshape", {"shape": spec}, {"x": x}, wrt=["x"])
    assert outs[0].shape == expect
    close(outs[0], x.reshape(expect))
    close(grads["x"], outs["_loss_weights"].reshape(x.shape))


def test_reshape_errors():
    with pytest.raises(ShapeError, match="cannot"):
        run_op("Reshape", {"shape": [5, -1]}, {"x": randn(2, 3)})
    with pytest.raises(ShapeError, match="at most one"):
        run_op("Reshape", {"shape": [-1, -1]}, {"x": randn(2, 3)})


def test_flatten_and_scale():
    x = randn(2, 3, 2, 2)
    outs, grads = run_op("Flatten", {}, {"x": x}, wrt=["x"])
    close(outs[0], torch.flatten(torch.tensor(x), 1).numpy())
    close(grads["x"], outs["_loss_weights"].reshape(x.shape))
    outs, grads = run_op("Scale", {"scale": -0.5}, {"x": x}, wrt=["x"])
    close(outs[0], -0.5 * x)
    close(grads["x"], -0.5 * outs["_loss_weights"])


# ------------------------------------------------------------ LearningRate
BASE = {"base_lr": 0.1}


@pytest.mark.parametrize("attrs,it,expect", [
    ({"lr_policy": "fixed"}, 77, 0.1),
    ({"lr_policy": "step", "gamma": 0.5, "stepsize": 10}, 25, 0.1 * 0.25),
    ({"lr_policy": "step", "gamma": 0.5, "stepsize": 10}, 9, 0.1),
    ({"lr_policy": "exp", "gamma": 0.9}, 3, 0.1 * 0.9 ** 3),
    ({"lr_policy": "inv", "gamma": 1e-2, "power": 0.75}, 40, 0.1 * 1.4 ** -0.75),
    ({"lr_policy": "multistep", "gamma": 0.1, "stepvalues": [5, 8]}, 4, 0.1),
    ({"lr_policy": "multistep", "gamma": 0.1, "stepvalues": [5, 8]}, 5, 0.1 * 0.1),
    ({"lr_policy": "multistep", "gamma": 0.1, "stepvalues": [5, 8]}, 100, 0.1 * 0.01),
    ({"lr_policy": "poly", "power": 2.0, "max_iter": 100}, 25, 0.1 * 0.75 ** 2),
    ({"lr_policy": "poly", "power": 0.5, "max_iter": 100}, 150, 0.0),
    ({"lr_policy": "sigmoid", "gamma": 0.1, "stepsize": 10}, 20, 0.1 / (1 + math.exp(-1))),
    ({"lr_policy": "cosine", "max_iter": 100}, 50, 0.05),
    ({"lr_policy": "cosine", "max_iter": 100, "min_lr": 0.01}, 100, 0.01),
    ({"lr_policy": "cosine", "max_iter": 100, "min_lr": 0.01}, 0, 0.1),
    ({"lr_policy": "fixed", "warmup_iters": 4}, 0, 0.025),
    ({"lr_policy": "fixed", "warmup_iters": 4}, 3, 0.1),
    ({"lr_policy": "fixed", "warmup_iters": 4, "warmup_start_factor": 0.5}, 1, 0.1 * 0.75),
    ({"lr_policy": "step", "gamma": 0.1, "stepsize": 2, "warmup_iters": 4}, 2, 0.01 * 0.75),
])
def test_learning_rate_policies(attrs, it, expect):
    assert learning_rate({**BASE, **attrs}, it) == pytest.approx(expect, rel=1e-12, abs=1e-15)


def test_learning_rate_op_and_config_errors():
    attrs = {**BASE, "lr_policy": "step", "gamma": 0.1, "stepsize": 3}
    outs, _ = run_op("LearningRate", attrs, {"iter": np.array(7, dtype=np.int64)})
    assert outs[0].shape == () and outs[0].dtype == np.float32
    assert outs[0] == np.float32(0.1 * 0.01)
    with pytest.raises(ConfigError, match="stepsize"):
        learning_rate({**BASE, "lr_policy": "step", "gamma": 0.1}, 0)
    with pytest.raises(ConfigError, match="unknown lr_policy"):
        run_op("LearningRate", {**BASE, "lr_policy": "linear"},
               {"iter": np.array(0, dtype=np.int64)})


# --------------------------------------------------------------- SGDUpdate
def sgd_graph(shape, attrs):
    g = Graph("sgd")
    g.add_blob("w", shape, kind="param")
    g.add_blob("grad", shape, kind="grad")
    g.add_blob("mom", shape, kind="state")
    g.add_blob("lr", (), kind="lr")
    g.add_blob("w@new", shape, alias_of="w")
    g.add_blob("mom@new", shape, alias_of="mom")
    g.add_op("w.update", "SGDUpdate", ["w", "grad", "mom", "lr"], ["w@new", "mom@new"], attrs)
    g.infer_shapes()
    return SerialDispatcher(g)


def test_sgd_update_matches_torch_sgd_over_steps():
    shape, lr, mu, wd = (3, 4), 0.05, 0.9, 0.01
    w0 = randn(*shape)
    d = sgd_graph(shape, {"momentum": mu, "weight_decay": wd})
    d.workspace.set("w", w0)
    d.workspace.set("lr", np.float32(lr))
    wt = torch.tensor(w0, requires_grad=True)
    opt = torch.optim.SGD([wt], lr=lr, momentum=mu, weight_decay=wd)
    for _ in range(4):
        g = randn(*shape)
        d.workspace.set("grad", g)
        d.run()
        wt.grad = torch.tensor(g)
        opt.step()
    close(d.workspace["w"], wt.detach().numpy(), rtol=1e-5, atol=1e-6)
    close(d.workspace["w@new"], d.workspace["w"])  # one storage
    close(d.workspace["mom"], lr * opt.state[wt]["momentum_buffer"].numpy(), rtol=1e-5)


def test_sgd_update_multipliers_closed_form():
    shape = (5,)
    w, g, v = randn(*shape), randn(*shape), randn(*shape)
    attrs = {"momentum": 0.5, "weight_decay": 0.1, "lr_mult": 2.0, "decay_mult": 0.0,
             "grad_scale": 0.25}
    d = sgd_graph(shape, attrs)
    for name, value in (("w", w), ("grad", g), ("mom", v), ("lr", np.float32(0.2))):
        d.workspace.set(name, value)
    d.run()
    v_new = 0.5 * v + 0.2 * 2.0 * (0.25 * g)  # decay_mult 0: no weight decay
    close(d.workspace["mom"], v_new)
    close(d.workspace["w"], w - v_new)


def test_sgd_update_shape_error():
    g = Graph("bad")
    for name, shape in (("w", (2, 3)), ("grad", (3, 2)), ("mom", (2, 3)), ("lr", ())):
        g.add_blob(name, shape)
    g.add_op("u", "SGDUpdate", ["w", "grad", "mom", "lr"], ["w2", "m2"])
    with pytest.raises(ShapeError, match="one shape"):
        g.infer_shapes()
