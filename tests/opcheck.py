"""Run one op through the real gradient builder and serial runtime.

Used by the op tests: values and gradients of a single op, plus a
central-difference numerical gradient for the finite-difference checks."""
import numpy as np

from purine_mpi.graph import Graph
from purine_mpi.graph.grad import build_backward
from purine_mpi.runtime.dispatcher import SerialDispatcher


def _build(op_type, attrs, inputs, wrt, loss_weights, seed):
    g = Graph("opcheck")
    for name, value in inputs.items():
        g.add_blob(name, value.shape, value.dtype, kind="param" if name in wrt else "data")
    n_out = len(_infer_outputs(op_type, attrs, inputs))
    outs = [f"out{k}" for k in range(n_out)]
    g.add_op("op.fwd", op_type, list(inputs), outs, attrs)
    g.infer_shapes()
    rng = np.random.default_rng(seed)
    if loss_weights is None:
        loss_weights = [None] * n_out
        y0 = g.blobs["out0"]
        loss_weights[0] = rng.standard_normal(y0.shape).astype(y0.dtype)
    loss_terms = []
    for k, w in enumerate(loss_weights):
        if w is None:
            continue
        w = np.asarray(w, dtype=g.blobs[outs[k]].dtype)
        g.add_blob(f"lw{k}", w.shape, w.dtype)
        g.add_op(f"loss{k}.fwd", "WeightedSum", [outs[k], f"lw{k}"], [f"loss{k}"])
        loss_terms.append((k, f"loss{k}", w))
    g.infer_shapes()
    grads = build_backward(g, {name: 1.0 for _, name, _ in loss_terms}, params=list(wrt)) \
        if wrt else {}
    g.infer_shapes()
    return g, outs, loss_terms, grads, loss_weights


def _infer_outputs(op_type, attrs, inputs):
    from purine_mpi.ops.catalog import get_kernel_class
    return get_kernel_class(op_type).infer(attrs, [(v.shape, str(v.dtype)) for v in inputs.values()])


def run_op(op_type, attrs, inputs, wrt=(), loss_weights=None, seed=0, rng_seed=0):
    """Forward values and gradients (w.r.t. ``wrt``) of ``sum_k sum(out_k * w_k)``."""
    inputs = {k: np.asarray(v) for k, v in inputs.items()}
    g, outs, loss_terms, grads, loss_weights = _build(op_type, attrs, inputs, wrt,
                                                      loss_weights, seed)
    d = SerialDispatcher(g, seed=rng_seed)
    for name, value in inputs.items():
        d.workspace.set(name, value)
    for k, _, w in loss_terms:
        d.workspace.set(f"lw{k}", w)
    d.run()
    result = {k: d.workspace[o].copy() for k, o in enumerate(outs)}
    result["_loss_weights"] = loss_weights[0] if len(loss_weights) == 1 else loss_weights
    return result, {p: d.workspace[gname].copy() for p, gname in grads.items()}


def central_differences(loss, x, eps=1e-6):
    """d loss / d x by central differences, element by element (``loss``: a
    function of an array like ``x`` returning a scalar)."""
    num = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[i] += eps
        down[i] -= eps
        num[i] = (loss(up) - loss(down)) / (2 * eps)
    return num


def numeric_grad(op_type, attrs, inputs, wrt_name, loss_weights, eps=1e-6, rng_seed=0):
    """Central differences of the same loss with respect to one input."""
    inputs = {k: np.array(v, copy=True) for k, v in inputs.items()}
    if not isinstance(loss_weights, (list, tuple)):
        loss_weights = [loss_weights]

    def loss():
        outs, _ = run_op(op_type, attrs, inputs, (), loss_weights, rng_seed=rng_seed)
        return sum(float(np.sum(outs[k] * w)) for k, w in enumerate(loss_weights)
                   if w is not None)

    x = inputs[wrt_name]
    grad = np.zeros_like(x, dtype=np.float64)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        up = loss()
        x[i] = old - eps
        down = loss()
        x[i] = old
        grad[i] = (up - down) / (2 * eps)
    return grad


def close(a, b, rtol=1e-4, atol=1e-5):
    """float32 comparison; the absolute tolerance scales with b's magnitude."""
    b = np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * max(1.0, float(np.abs(b).max())))


def torch_grads(fn, arrays, weight):
    """fn(*tensors) with PyTorch, and the gradients of sum(fn(...) * weight)
    w.r.t. each array (``weight`` may be run_op's list: its first is used)."""
    import torch
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    y = fn(*ts)
    if isinstance(weight, list):
        weight = weight[0]
    (y * torch.tensor(weight)).sum().backward()
    return y.detach().numpy(), [t.grad.numpy() for t in ts]
