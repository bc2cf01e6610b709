"""InnerProduct, LRN and BatchNorm against PyTorch (values and gradients),
plus float64 finite-difference checks of each family's gradient."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from purine_mpi.base.errors import ShapeError
from purine_mpi.graph import Graph
from purine_mpi.graph.grad import build_backward
from purine_mpi.ops.batchnorm import BatchNorm
from tests.opcheck import close, numeric_grad, run_op, torch_grads

RNG = np.random.default_rng(3)


def randn(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)




# ----------------------------------------------------------- inner product
@pytest.mark.parametrize("x_shape,axis,bias", [
    ((4, 6), 1, True), ((3, 2, 2, 2), 1, True), ((3, 2, 5), 2, False)])
def test_inner_product_matches_torch(x_shape, axis, bias):
    x = randn(*x_shape)
    K = int(np.prod(x_shape[axis:]))
    inputs = {"x": x, "w": randn(7, K)}
    if bias:
        inputs["b"] = randn(7)
    outs, grads = run_op("InnerProduct", {"axis": axis}, inputs, wrt=list(inputs))
    assert outs[0].shape == x_shape[:axis] + (7,)

    def fn(xt, wt, *bt):
        return F.linear(xt.flatten(axis), wt, bt[0] if bt else None)
    y, expect = torch_grads(fn, list(inputs.values()), outs["_loss_weights"])
    close(outs[0], y)
    for name, g in zip(inputs, expect):
        assert grads[name].shape == inputs[name].shape
        close(grads[name], g)


def test_inner_product_numeric_grad():
    inputs = {"x": randn(3, 2, 2, dtype=np.float64), "w": randn(4, 4, dtype=np.float64),
              "b": randn(4, dtype=np.float64)}
    weight = randn(3, 4, dtype=np.float64)
    _, grads = run_op("InnerProduct", {}, inputs, wrt=list(inputs), loss_weights=[weight])
    for name in inputs:
        close(grads[name], numeric_grad("InnerProduct", {}, inputs, name, weight),
              rtol=1e-6, atol=1e-8)


def test_inner_product_shape_error():
    with pytest.raises(ShapeError, match=r"\(num_output, 8\)"):
        run_op("InnerProduct", {}, {"x": randn(2, 2, 4), "w": randn(3, 6)})


# --------------------------------------------------------------------- LRN
@pytest.mark.parametrize("shape,attrs", [
    ((2, 7, 3, 3), {"local_size": 5, "alpha": 0.5, "beta": 0.75, "k": 2.0}),
    ((2, 4, 3, 2), {"local_size": 3, "alpha": 1.0, "beta": 0.5, "k": 1.0}),
    ((3, 8, 2, 2), {}),                                      # Caffe's defaults
    ((2, 2, 3, 3), {"local_size": 7, "alpha": 0.3}),          # window wider than C
])
def test_lrn_matches_torch(shape, attrs):
    x = randn(*shape) * 2
    outs, grads = run_op("LRN", attrs, {"x": x}, wrt=["x"])
    size, alpha, beta, k = (attrs.get("local_size", 5), attrs.get("alpha", 1e-4),
                            attrs.get("beta", 0.75), attrs.get("k", 1.0))
    y, (dx,) = torch_grads(lambda t: F.local_response_norm(t, size, alpha, beta, k), [x],
                           outs["_loss_weights"][0])
    close(outs[0], y)
    close(grads["x"], dx)
    close(outs[1], (torch.tensor(x) / torch.tensor(y)).numpy() ** (1 / beta), rtol=1e-3)


def test_lrn_numeric_grad():
    x, weight = randn(2, 5, 2, 2, dtype=np.float64), randn(2, 5, 2, 2, dtype=np.float64)
    attrs = {"local_size": 3, "alpha": 0.8, "beta": 0.75, "k": 1.5}
    _, grads = run_op("LRN", attrs, {"x": x}, wrt=["x"], loss_weights=[weight, None])
    close(grads["x"], numeric_grad("LRN", attrs, {"x": x}, "x", [weight, None]),
          rtol=1e-6, atol=1e-8)


def test_lrn_rejects_even_size():
    with pytest.raises(ShapeError, match="odd"):
        run_op("LRN", {"local_size": 4}, {"x": randn(1, 4, 2, 2)})


# --------------------------------------------------------------- BatchNorm
def bn_inputs(shape, dtype=np.float32):
    C = shape[1]
    return {"x": randn(*shape, dtype=dtype) * 2 + 1, "gamma": randn(C, dtype=dtype),
            "beta": randn(C, dtype=dtype), "running_mean": randn(C, dtype=dtype),
            "running_var": RNG.uniform(0.5, 2, C).astype(dtype)}


@pytest.mark.parametrize("shape", [(4, 3, 5, 2), (6, 5)])
def test_batchnorm_train_matches_torch(shape):
    inputs = bn_inputs(shape)
    attrs = {"eps": 1e-3, "momentum": 0.2, "phase": "train"}
    outs, grads = run_op("BatchNorm", attrs, inputs, wrt=["x", "gamma", "beta"])
    rm, rv = torch.tensor(inputs["running_mean"]), torch.tensor(inputs["running_var"])
    y, (dx, dgamma, dbeta) = torch_grads(
        lambda x, g, b: F.batch_norm(x, rm, rv, g, b, training=True, momentum=0.2, eps=1e-3),
        [inputs["x"], inputs["gamma"], inputs["beta"]], outs["_loss_weights"][0])
    close(outs[0], y)
    close(grads["x"], dx)
    close(grads["gamma"], dgamma)
    close(grads["beta"], dbeta)
    close(outs[3], rm.numpy())   # torch updated its running stats in place
    close(outs[4], rv.numpy())
    axes = (0,) + tuple(range(2, len(shape)))
    close(outs[1], inputs["x"].mean(axis=axes))
    close(outs[2], 1 / np.sqrt(inputs["x"].var(axis=axes) + 1e-3))


def test_batchnorm_test_phase_matches_torch():
    inputs = bn_inputs((3, 4, 2, 3))
    outs, grads = run_op("BatchNorm", {"phase": "test"}, inputs, wrt=["x", "gamma", "beta"])
    assert len([k for k in outs if k != "_loss_weights"]) == 1
    rm, rv = torch.tensor(inputs["running_mean"]), torch.tensor(inputs["running_var"])
    y, (dx, dgamma, dbeta) = torch_grads(
        lambda x, g, b: F.batch_norm(x, rm, rv, g, b, training=False),
        [inputs["x"], inputs["gamma"], inputs["beta"]], outs["_loss_weights"])
    close(outs[0], y)
    close(grads["x"], dx)
    close(grads["gamma"], dgamma)
    close(grads["beta"], dbeta)


def test_batchnorm_updates_aliased_running_stats_in_place():
    """running_mean@new shares storage with running_mean: the kernel must read
    the old values before it writes the new ones."""
    inputs = bn_inputs((5, 3, 2, 2))
    x, gamma, beta = inputs["x"], inputs["gamma"], inputs["beta"]
    rm, rv = inputs["running_mean"].copy(), inputs["running_var"].copy()
    outs = [np.empty_like(x), np.empty(3, np.float32), np.empty(3, np.float32), rm, rv]

    class FakeOp:
        attrs = {"momentum": 0.3}
    BatchNorm(FakeOp()).run([x, gamma, beta, rm, rv], outs)
    expect_m = 0.7 * inputs["running_mean"] + 0.3 * x.mean(axis=(0, 2, 3))
    expect_v = 0.7 * inputs["running_var"] + 0.3 * x.var(axis=(0, 2, 3), ddof=1)
    close(rm, expect_m)
    close(rv, expect_v)


def test_batchnorm_gradient_only_for_what_needs_it():
    g = Graph()
    for name, value in bn_inputs((4, 3)).items():
        g.add_blob(name, value.shape, kind="param" if name == "x" else "data")
    g.add_op("bn.fwd", "BatchNorm", ["x", "gamma", "beta", "running_mean", "running_var"],
             ["y", "mean", "invstd", "rm_new", "rv_new"])
    g.infer_shapes()
    grads = build_backward(g, {"y": 1.0})
    assert set(grads) == {"x"}
    (op,) = [op for op in g.ops.values() if op.op_type == "BatchNormGrad"]
    assert op.attrs["grads"] == ["x"] and len(op.outputs) == 1
    g.infer_shapes()


@pytest.mark.parametrize("phase", ["train", "test"])
def test_batchnorm_numeric_grad(phase):
    inputs = bn_inputs((3, 2, 2, 2), np.float64)
    weight = randn(3, 2, 2, 2, dtype=np.float64)
    lw = [weight] + ([None] * 4 if phase == "train" else [])
    attrs = {"phase": phase}
    _, grads = run_op("BatchNorm", attrs, inputs, wrt=["x", "gamma", "beta"], loss_weights=lw)
    for name in ("x", "gamma", "beta"):
        close(grads[name], numeric_grad("BatchNorm", attrs, inputs, name, lw),
              rtol=1e-6, atol=1e-8)


def test_batchnorm_shape_errors():
    inputs = bn_inputs((2, 3, 2, 2))
    inputs["gamma"] = randn(4)
    with pytest.raises(ShapeError, match="gamma must have shape"):
        run_op("BatchNorm", {}, inputs)
    with pytest.raises(ShapeError, match="phase"):
        run_op("BatchNorm", {"phase": "eval"}, bn_inputs((2, 3)))
