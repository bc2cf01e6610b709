"""The solver on the device: the lr policy evaluated from the iteration blob
(cuda/lr_policy.cu) against the host formula, for every policy, on the
host-compiled kernel (and a real GPU when there is one)."""
import numpy as np
import pytest

from purine_mpi.gpu import kernels
from purine_mpi.graph.core import Op
from purine_mpi.ops.catalog import get_kernel_class
from purine_mpi.ops.lr_policy import LR_POLICIES, LR_POLICY_CODES, learning_rate, lr_policy_args

POLICY_ATTRS = {
    "fixed": {},
    "step": {"gamma": 0.5, "stepsize": 7},
    "multistep": {"gamma": 0.3, "stepvalues": [3, 11, 40]},
    "exp": {"gamma": 0.97},
    "inv": {"gamma": 1e-2, "power": 0.75},
    "sigmoid": {"gamma": -0.2, "stepsize": 20},
    "poly": {"power": 1.7, "max_iter": 50},
    "cosine": {"max_iter": 50, "min_lr": 1e-3},
}
ITERATIONS = [0, 1, 2, 3, 6, 7, 8, 10, 11, 13, 20, 39, 40, 49, 50, 51, 77, 1000, (1 << 33) + 5]


def test_every_policy_is_covered():
    assert set(POLICY_ATTRS) == set(LR_POLICIES) == set(LR_POLICY_CODES)


def _device_rate(backend, attrs, iteration, device_iter):  # noqa: F811
    args = lr_policy_args(attrs)
    args["steps"] = backend.to_device(np.asarray(args["steps"] or [0], np.int64))
    out = backend.to_device(np.full((), np.nan, np.float32))
    it = backend.to_device(np.asarray(iteration, np.int64)) if device_iter else iteration
    kernels.learning_rate(it, out, **args)
    return backend.to_host(out)


@pytest.mark.parametrize("warmup", [0, 5])
@pytest.mark.parametrize("policy", sorted(POLICY_ATTRS))
def test_lr_policy_on_the_device_matches_the_host_formula(backend, policy, warmup):  # noqa: F811
    """The float32 lr equals the host formula rounded to float32: bit for bit
    on the host-compiled kernel (same libm), to one float32 ulp on a GPU
    (CUDA's pow/exp/cos are within 2 ulp in double), where a denormal result
    may also come out flushed to zero (step at 1000 iterations: 1.8e-44)."""
    attrs = {"base_lr": 0.1, "lr_policy": policy, **POLICY_ATTRS[policy]}
    if warmup:
        attrs.update(warmup_iters=warmup, warmup_start_factor=0.2)
    want = np.array([np.float32(learning_rate(attrs, it)) for it in ITERATIONS])
    got = np.array([_device_rate(backend, attrs, it, device_iter=k % 2 == 0)
                    for k, it in enumerate(ITERATIONS)])
    if backend.name == "host":
        np.testing.assert_array_equal(got, want)
    else:
        flushed = (got == 0) & (np.abs(want) < np.finfo(np.float32).tiny)
        np.testing.assert_allclose(got, np.where(flushed, np.float32(0), want),
                                   rtol=2 ** -22, atol=0)
    assert len(set(want.tolist())) > (1 if policy != "fixed" or warmup else 0)


def test_lr_op_on_emulated_device_reads_the_iteration_blob(monkeypatch, host_build_dir):
    """The LearningRate op with device blobs: its setup uploads the policy's
    constants once; each run reads the iteration from the device blob."""
    import purine_mpi.gpu as gpu
    from tests.emulated_gpu import DeviceArray, use_emulated_cupy
    use_emulated_cupy(monkeypatch, host_build_dir)
    attrs = {"base_lr": 0.1, "lr_policy": "multistep", "gamma": 0.1, "stepvalues": [2, 4]}
    k = get_kernel_class("LearningRate")(Op("lr", "LearningRate", [], [], attrs))
    it = np.zeros((), np.int64).view(DeviceArray)
    lr = np.zeros((), np.float32).view(DeviceArray)
    k.setup([it], [lr])
    try:
        for i in range(6):
            it[...] = i
            k.run([it], [lr])
            assert float(lr) == np.float32(learning_rate(attrs, i))
    finally:
        gpu.clear_kernel_cache()


# ------------------------------------------------------ multi-tensor SGD ---

def _params(rng, shapes, dtype):
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def _flat(dtype, *per_param):
    """(offsets, total, flat buffers): each list of per-parameter arrays laid
    out in one buffer as parallel/fuse.py does (views 64 elements apart)."""
    offsets, total = [], 0
    for a in per_param[0]:
        offsets.append(total)
        total += -(-a.size // 64) * 64
    flat = [np.zeros(total, dtype) for _ in per_param]
    for arrays, buf in zip(per_param, flat):
        for a, off in zip(arrays, offsets):
            buf[off:off + a.size] = a.reshape(-1)
    return offsets, total, flat


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_multi_tensor_sgd_equals_one_update_per_parameter(backend, dtype):  # noqa: F811
    """One kernel over flat weight/momentum buffers (parameters at aligned
    offsets, gradients anywhere) == sgd_momentum per parameter, bit for bit,
    with per-parameter lr_mult and decay_mult and the lr on the device."""
    rng = np.random.default_rng(0)
    shapes = [(4, 3, 3, 3), (4,), (7, 5), (1,), (130,)]
    lr_mults, decay_mults = [1.0, 2.0, 1.0, 0.5, 3.0], [1.0, 0.0, 1.0, 2.0, 0.25]
    weights = _params(rng, shapes, dtype)
    momenta = [np.abs(a) for a in _params(rng, shapes, dtype)]
    offsets, total, (flat_w, flat_v) = _flat(dtype, weights, momenta)
    dev_w, dev_v = backend.to_device(flat_w), backend.to_device(flat_v)
    singles = [(backend.to_device(w), backend.to_device(v)) for w, v in zip(weights, momenta)]
    lr = backend.to_device(np.array(0.05, np.float32))
    wd = 5e-3
    for step in range(3):
        grads = [backend.to_device(g) for g in _params(rng, shapes, dtype)]
        table = kernels.MultiTensorTable(grads, offsets, lr_mults,
                                         [wd * m for m in decay_mults], dtype)
        kernels.sgd_momentum_multi(dev_w, dev_v, table, lr, momentum=0.9, grad_scale=0.5)
        for (w, v), g, lm, dm in zip(singles, grads, lr_mults, decay_mults):
            kernels.sgd_momentum_update(w, g, v, lr, momentum=0.9, weight_decay=wd * dm,
                                        grad_scale=0.5, lr_mult=lm)
    got_w, got_v = backend.to_host(dev_w), backend.to_host(dev_v)
    for (w, v), off in zip(singles, offsets):
        w, v = backend.to_host(w).reshape(-1), backend.to_host(v).reshape(-1)
        np.testing.assert_array_equal(got_w[off:off + w.size], w)
        np.testing.assert_array_equal(got_v[off:off + v.size], v)
    padding = np.ones(total, bool)
    for w, off in zip(weights, offsets):
        padding[off:off + w.size] = False
    assert not got_w[padding].any() and not got_v[padding].any()  # untouched


def test_multi_sgd_op_on_the_cpu_equals_sgd_update_ops():
    """MultiSGDUpdate's CPU path is SGDUpdate's arithmetic per parameter."""
    rng = np.random.default_rng(1)
    shapes, offsets = [(3, 4), (5,)], [0, 64]
    lr = np.asarray(0.1, np.float32)
    attrs = {"momentum": 0.9, "weight_decay": 1e-2, "grad_scale": 0.5,
             "sizes": [12, 5], "offsets": offsets, "lr_mults": [1.0, 2.0],
             "decay_mults": [1.0, 0.0], "params": ["a", "b"]}
    flat_w = rng.standard_normal(128).astype(np.float32)
    flat_v = rng.standard_normal(128).astype(np.float32)
    grads = _params(rng, shapes, np.float32)
    multi = get_kernel_class("MultiSGDUpdate")(Op("u", "MultiSGDUpdate", [], [], attrs))
    w, v = flat_w.copy(), flat_v.copy()
    multi.setup([w, v, lr] + grads, [w, v])
    multi.run([w, v, lr] + grads, [w, v])
    for k, (g, off) in enumerate(zip(grads, offsets)):
        single = {"momentum": 0.9, "weight_decay": 1e-2, "grad_scale": 0.5,
                  "lr_mult": attrs["lr_mults"][k], "decay_mult": attrs["decay_mults"][k]}
        sw = flat_w[off:off + g.size].reshape(g.shape).copy()
        sv = flat_v[off:off + g.size].reshape(g.shape).copy()
        get_kernel_class("SGDUpdate")(Op("s", "SGDUpdate", [], [], single)).run(
            [sw, g, sv, lr], [sw, sv])
        np.testing.assert_array_equal(w[off:off + g.size], sw.reshape(-1))
        np.testing.assert_array_equal(v[off:off + g.size], sv.reshape(-1))
    np.testing.assert_array_equal(w[12:64], flat_w[12:64])


# ----------------------------------------------------- multi-tensor Adam ---

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("on_device", [True, False])
def test_multi_tensor_adam_equals_one_update_per_parameter(backend, dtype, decoupled,  # noqa: F811
                                                          on_device):
    """adam_multi over flat weight/moment buffers == adam_update per
    parameter, bit for bit, with per-parameter lr_mult and decay_mult, the
    lr and iteration as device blobs or as numbers; the padding between
    the parameters' views untouched."""
    rng = np.random.default_rng(2)
    shapes = [(4, 3, 3, 3), (4,), (7, 5), (1,), (130,)]
    lr_mults, decay_mults = [1.0, 2.0, 1.0, 0.5, 3.0], [1.0, 0.0, 1.0, 2.0, 0.25]
    weights = _params(rng, shapes, dtype)
    firsts = _params(rng, shapes, dtype)
    seconds = [np.abs(a) for a in _params(rng, shapes, dtype)]
    offsets, total, flat = _flat(dtype, weights, firsts, seconds)
    dev = [backend.to_device(b) for b in flat]
    singles = [[backend.to_device(a) for a in arrays]
               for arrays in zip(weights, firsts, seconds)]
    wd = 0.1
    for step in range(3):
        lr = backend.to_device(np.array(0.01 * (step + 1), np.float32)) if on_device \
            else 0.01 * (step + 1)
        it = backend.to_device(np.array([step + 4], np.int64)) if on_device else step + 4
        grads = [backend.to_device(g) for g in _params(rng, shapes, dtype)]
        table = kernels.MultiTensorTable(grads, offsets, lr_mults,
                                         [wd * m for m in decay_mults], dtype,
                                         factor_dtype=np.float64)
        kw = dict(beta1=0.9, beta2=0.95, delta=1e-8, grad_scale=0.5)
        kernels.adam_multi(*dev, table, lr, it, decoupled=decoupled, **kw)
        for (w, m, v), g, lm, dm in zip(singles, grads, lr_mults, decay_mults):
            kernels.adam_update(w, g, m, v, lr, it, weight_decay=wd * dm,
                                decoupled=decoupled, lr_mult=lm, **kw)
    got = [backend.to_host(b) for b in dev]
    for arrays, off in zip(singles, offsets):
        for buf, a in zip(got, arrays):
            a = backend.to_host(a).reshape(-1)
            np.testing.assert_array_equal(buf[off:off + a.size], a)
    padding = np.ones(total, bool)
    for w, off in zip(weights, offsets):
        padding[off:off + w.size] = False
    assert not any(buf[padding].any() for buf in got)  # untouched


@pytest.mark.parametrize("op_type", ["AdamUpdate", "AdamWUpdate"])
def test_multi_adam_op_on_the_cpu_equals_adam_update_ops(op_type):
    """MultiAdamUpdate's CPU path is the single op's arithmetic per parameter."""
    rng = np.random.default_rng(3)
    shapes, offsets = [(3, 4), (5,)], [0, 64]
    lr, it = np.asarray(0.1, np.float32), np.asarray(6, np.int64)
    shared = {"momentum": 0.9, "momentum2": 0.95, "delta": 1e-8, "weight_decay": 1e-2,
              "grad_scale": 0.5}
    attrs = dict(shared, decoupled=op_type == "AdamWUpdate", sizes=[12, 5], offsets=offsets,
                 lr_mults=[1.0, 2.0], decay_mults=[1.0, 0.0], params=["a", "b"])
    flat = [rng.standard_normal(128).astype(np.float32) for _ in range(2)] + \
        [np.abs(rng.standard_normal(128)).astype(np.float32)]
    grads = _params(rng, shapes, np.float32)
    multi = get_kernel_class("MultiAdamUpdate")(Op("u", "MultiAdamUpdate", [], [], attrs))
    out = [b.copy() for b in flat]
    multi.setup(out + [lr, it] + grads, out)
    multi.run(out + [lr, it] + grads, out)
    for k, (g, off) in enumerate(zip(grads, offsets)):
        single = dict(shared, lr_mult=attrs["lr_mults"][k], decay_mult=attrs["decay_mults"][k])
        views = [b[off:off + g.size].reshape(g.shape).copy() for b in flat]
        get_kernel_class(op_type)(Op("s", op_type, [], [], single)).run(
            [views[0], g, views[1], views[2], lr, it], views)
        for buf, view in zip(out, views):
            np.testing.assert_array_equal(buf[off:off + g.size], view.reshape(-1))
    for buf, old in zip(out, flat):
        np.testing.assert_array_equal(buf[12:64], old[12:64])


def test_the_fuse_pass_makes_one_adam_update_per_setting():
    """AdamW updates of one device, lr, iteration and settings become one
    MultiAdamUpdate whose weights and moments are views of solver.params,
    solver.m and solver.v; an update with other betas stays apart."""
    from purine_mpi.graph import Graph
    from purine_mpi.graph.core import Location
    from purine_mpi.parallel.fuse import fuse_updates
    g = Graph("n")
    loc = Location(0, 0)
    g.add_blob("lr", (1,), "float32", loc, kind="lr")
    g.add_blob("it", (1,), "int64", loc, kind="iter")
    for name, shape, betas in (("a", (3, 4), 0.95), ("b", (5,), 0.95), ("c", (2,), 0.99)):
        g.add_blob(name, shape, "float32", loc, kind="param")
        g.add_blob(f"{name}.grad", shape, "float32", loc, kind="grad")
        for st in ("m", "v"):
            g.add_blob(f"{name}/{st}", shape, "float32", loc, kind="state")
        for b in (name, f"{name}/m", f"{name}/v"):
            g.add_blob(f"{b}@new", shape, "float32", loc, kind=g.blobs[b].kind, alias_of=b)
        g.add_op(f"{name}.update", "AdamWUpdate",
                 [name, f"{name}.grad", f"{name}/m", f"{name}/v", "lr", "it"],
                 [f"{name}@new", f"{name}/m@new", f"{name}/v@new"],
                 {"momentum": 0.9, "momentum2": betas, "weight_decay": 0.1,
                  "lr_mult": 1.0, "decay_mult": 0.0 if name == "b" else 1.0}, location=loc)
    (made,) = fuse_updates(g)
    op = g.ops[made]
    assert op.op_type == "MultiAdamUpdate" and op.attrs["decoupled"] is True
    assert op.inputs[:5] == ["solver.params", "solver.m", "solver.v", "lr", "it"]
    assert op.inputs[5:] == ["a.grad", "b.grad"] and op.attrs["decay_mults"] == [1.0, 0.0]
    assert [g.blobs[n].alias_of for n in ("a", "a/m", "b/v")] == \
        ["solver.params", "solver.m", "solver.v"]
    assert g.blobs["b"].offset == 64 and "c.update" in g.ops   # other betas: not fused
    g.infer_shapes().validate()


# ------------------------------------------------------------- fusions ---

def _relu_net(extra_reader=False, slope=0.0, producer="Conv"):
    from purine_mpi.graph import Graph
    from purine_mpi.graph.grad import build_backward
    g = Graph("n")
    g.add_blob("x", (2, 3, 5, 5))
    g.add_blob("w", (4, 3, 3, 3), kind="param")
    g.add_blob("b", (4,), kind="param")
    if producer == "Conv":
        g.add_op("conv.fwd", "Conv", ["x", "w", "b"], ["c"], {"pad": 1})
    else:
        g.add_op("conv.fwd", "Pool", ["x"], ["c", "c.mask"], {"pool": "max", "kernel": 1})
    g.add_op("relu.fwd", "Relu", ["c"], ["r"], {"negative_slope": slope})
    if extra_reader:
        g.add_op("peek.fwd", "Scale", ["c"], ["peek"], {"scale": 2.0})
    g.add_blob("lw", (2, 4 if producer == "Conv" else 3, 5, 5))
    g.add_op("loss.fwd", "WeightedSum", ["r", "lw"], ["loss"])
    g.infer_shapes()
    build_backward(g, {"loss": 1.0}, params=["w", "b"] if producer == "Conv" else [])
    return g.infer_shapes()


def test_relu_fuses_only_where_exact():
    from purine_mpi.parallel.fuse import fuse_relu
    g = _relu_net()
    assert fuse_relu(g) == ["relu.fwd"]
    conv = g.ops["conv.fwd"]
    assert conv.outputs == ["r"] and conv.attrs["relu"] is True and "c" not in g.blobs
    (grad,) = [op for op in g.ops.values() if op.op_type == "ReluGrad"]
    assert grad.inputs[1] == "r"
    g.validate()
    for kwargs in ({"extra_reader": True}, {"slope": -0.5}, {"producer": "Pool"}):
        assert fuse_relu(_relu_net(**kwargs)) == [], kwargs
    assert fuse_relu(_relu_net(slope=0.1)) == ["relu.fwd"]


def test_fused_relu_graph_computes_the_same_on_the_cpu():
    """A fused graph run on the CPU: same loss and gradients, bit for bit."""
    from purine_mpi.parallel.fuse import fuse_relu
    from purine_mpi.runtime.dispatcher import SerialDispatcher
    rng = np.random.default_rng(2)
    values = {"x": rng.standard_normal((2, 3, 5, 5)), "w": rng.standard_normal((4, 3, 3, 3)),
              "b": rng.standard_normal(4), "lw": rng.standard_normal((2, 4, 5, 5))}
    results = []
    for fuse in (False, True):
        g = _relu_net(slope=0.1)
        if fuse:
            fuse_relu(g)
        d = SerialDispatcher(g)
        for k, v in values.items():
            d.workspace.set(k, v.astype(np.float32))
        d.run()
        results.append({k: np.array(d.workspace[k]) for k in ("loss", "r", "w.grad", "b.grad",
                                                             "x.grad") if k in d.workspace.arrays})
    for k, v in results[0].items():
        assert results[1][k].tobytes() == v.tobytes(), k


def test_constant_rate_and_constants_are_written_once_on_the_device(monkeypatch,
                                                                     host_build_dir):
    """A fixed lr without warm-up and a Constant (the loss gradient's seed)
    are written in the first iteration only; a scheduled lr every time."""
    import purine_mpi.gpu as gpu
    from tests.emulated_gpu import DeviceArray, use_emulated_cupy
    use_emulated_cupy(monkeypatch, host_build_dir)
    launched = []
    real = kernels.base._launch_blocks
    monkeypatch.setattr(kernels.base, "_launch_blocks",
                        lambda s, f, *a: (launched.append(f), real(s, f, *a))[1])
    it = np.zeros((), np.int64).view(DeviceArray)
    try:
        for attrs, expect in (({"base_lr": 0.1}, 1),
                              ({"base_lr": 0.1, "warmup_iters": 3}, 4),
                              ({"base_lr": 0.1, "lr_policy": "step", "gamma": 0.5,
                                "stepsize": 2}, 4)):
            launched.clear()
            k = get_kernel_class("LearningRate")(Op("lr", "LearningRate", [], [], attrs))
            lr = np.zeros((), np.float32).view(DeviceArray)
            k.setup([it], [lr])
            for i in range(4):
                it[...] = i
                k.run([it], [lr])
                assert float(lr) == np.float32(learning_rate(attrs, i))
            assert launched.count("learning_rate") == expect, attrs
        const = get_kernel_class("Constant")(Op("c", "Constant", [], [],
                                                {"shape": [], "value": 1.0}))
        y = np.zeros((), np.float32).view(DeviceArray)
        const.run([], [y])
        y[...] = 5.0   # only the op writes it; a second run must not launch a fill
        const.run([], [y])
        assert float(y) == 5.0
        host = np.zeros((), np.float32)
        const.run([], [host])
        assert float(host) == 1.0   # on the CPU: every time (a cheap store)
    finally:
        gpu.clear_kernel_cache()


def test_the_fusions_keep_the_waits_on_the_ops_they_remove():
    """An op that waits for a ReLU or a ReluGrad the device fusions remove
    (activation recompute's copies wait for the backward op before theirs)
    waits for the op it was fused into, and that op for what the removed
    one waited for: the graph stays valid (before, 'depends on unknown op')."""
    from purine_mpi.parallel.fuse import fuse_dgrad_relu, fuse_relu
    g = _relu_net()
    g.add_op("other.fwd", "Scale", ["x"], ["o"], {"scale": 2.0})
    g.add_op("late.fwd", "Scale", ["x"], ["late"], {"scale": 3.0},
             control_inputs=["relu.fwd"])
    g.ops["relu.fwd"].control_inputs.append("other.fwd")
    assert fuse_relu(g) == ["relu.fwd"]
    assert g.ops["late.fwd"].control_inputs == ["conv.fwd"]
    assert "other.fwd" in g.ops["conv.fwd"].control_inputs
    g.infer_shapes().validate()
    # a ReluGrad fused into the ConvGradData writing its gradient input
    from purine_mpi.graph import Graph
    from purine_mpi.graph.grad import build_backward
    g = Graph("n")
    g.add_blob("x", (2, 3, 5, 5))
    for i, c in ((1, 3), (2, 4)):
        g.add_blob(f"w{i}", (4, c, 3, 3), kind="param")
        g.add_blob(f"b{i}", (4,), kind="param")
    g.add_op("conv1.fwd", "Conv", ["x", "w1", "b1"], ["c1"], {"pad": 1})
    g.add_op("relu1.fwd", "Relu", ["c1"], ["r1"])
    g.add_op("conv2.fwd", "Conv", ["r1", "w2", "b2"], ["c2"], {"pad": 1})
    g.add_blob("lw", (2, 4, 5, 5))
    g.add_op("loss.fwd", "WeightedSum", ["c2", "lw"], ["loss"])
    g.infer_shapes()
    build_backward(g, {"loss": 1.0}, params=["w1", "b1", "w2", "b2"])
    (relu_grad,) = [op for op in g.ops.values() if op.op_type == "ReluGrad"]
    (dgrad,) = [op for op in g.ops.values() if op.op_type == "ConvGradData"]
    g.add_op("late.fwd", "Scale", ["x"], ["late"], {"scale": 3.0},
             control_inputs=[relu_grad.name])
    g.add_op("other.fwd", "Scale", ["x"], ["o"], {"scale": 2.0})
    relu_grad.control_inputs.append("other.fwd")
    g.infer_shapes()
    assert fuse_dgrad_relu(g) == [relu_grad.name]
    assert g.ops["late.fwd"].control_inputs == [dgrad.name]
    assert "other.fwd" in g.ops[dgrad.name].control_inputs
    g.infer_shapes().validate()
