"""The GPU backend: op GPU branches, device placement, memory planning and the
CUDA-stream dispatcher.

What runs without a GPU (and so on every machine):
1. Every op's GPU branch against its NumPy path on an *emulated device*: a
   NumPy subclass stands for CuPy arrays (so ``get_xp`` picks the GPU branch)
   and the raw kernels are the real cuda/*.cu sources compiled for the host
   with g++ (tests/test_gpu_kernels.py's stand-in, which checks every launch
   argument against the kernel's C signature).
2. The stream dispatcher's event bookkeeping against a *simulated device*:
   streams are queues run in a random interleaving that respects only the
   recorded events and waits, so a missing ``wait_event`` or host sync shows
   as an op running before its producer (checked against the graph's
   dependencies) and as results that differ from the serial dispatcher.
3. Placement, memory planning, config and dispatcher selection.

What needs CuPy and a CUDA device (marked ``gpu``, skipped otherwise): the
same op tests on real CuPy, every op's outputs and gradients through a placed
graph against the NumPy backend, and cifar10_quick trained on the GPU against
the CPU.
"""
import contextlib
import copy
import random
import types

import numpy as np
import pytest

import purine_mpi.base.backend as backend
import purine_mpi.gpu as gpu
from purine_mpi.base.errors import ConfigError, UserError
from purine_mpi.graph import Graph
from purine_mpi.graph.core import Location, Op
from purine_mpi.gpu import kernels
from purine_mpi.parallel.placement import place_on_device, prepare_for_device, select_device
from purine_mpi.job.config import validate_config
from purine_mpi.job.replica import build_train_graph
from purine_mpi.ops.catalog import get_kernel_class
from purine_mpi.ops.registry import OpKernel, Pending, register
from purine_mpi.runtime.dispatcher import EventDispatcher, SerialDispatcher
from purine_mpi.runtime.factory import make_dispatcher
from purine_mpi.runtime.streams_dispatcher import StreamDispatcher
from purine_mpi.runtime.trace import Profiler
from purine_mpi.runtime.workspace import ARENA_ALIGN, Workspace, plan_device_memory
from tests.emulated_gpu import (DeviceArray, SimulatedRuntime, check_order, compare,
                                cpu_workspace, emulated_trainer_env, init_params, log_kernels,
                                run_graph_on_gpu, run_kernel, tiny_config, tiny_raw,
                                train_simulated, use_emulated_cupy)
from tests.conftest import cuda_cupy_or_skip as _gpu_cupy, make_job


def _rand(shape, dtype, seed=0, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(dtype)


CONV_CASES = [  # x shape, (out, kh, kw), attrs
    ((2, 4, 7, 6), (6, 3, 3), {"stride": 2, "pad": 1, "group": 2}),
    ((2, 3, 6, 7), (5, 3, 2), {"stride": [1, 2], "pad": [2, 0], "dilation": 2}),
    ((2, 6, 5, 4), (4, 1, 1), {}),                       # 1x1: no im2col on the GPU
    ((3, 2, 5, 5), (3, 5, 5), {"pad": 2}),
]


def _conv_paths(device):
    """The convolution paths to test on ``device``: im2col everywhere, and
    cuDNN on a real GPU (the emulated device has no cuDNN of its own;
    tests/test_cudnn_path.py emulates it)."""
    return ["im2col", "cudnn"] if device.name == "cupy" else ["im2col"]


@contextlib.contextmanager
def _forced_conv(monkeypatch, conv):
    """``PURINE_CONV=conv`` for the ops made inside; yields whether cuDNN can
    take a convolution (its frontend loads and the mode allows it)."""
    from purine_mpi.gpu import cudnn as gpu_cudnn
    monkeypatch.setenv("PURINE_CONV", conv)
    gpu_cudnn.reset()
    try:
        yield gpu_cudnn.frontend() is not None
    finally:
        monkeypatch.delenv("PURINE_CONV")
        gpu_cudnn.reset()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", CONV_CASES)
def test_conv_gpu_branch(device, case, dtype, monkeypatch):
    """Each direction on each path (``PURINE_CONV``) against the CPU, and the
    kernels of the path the op actually took: cuDNN's graph, or im2col /
    col2im (none for a 1x1). Forced to cuDNN, a float32 ungrouped forward
    must take it when the frontend is installed (the float64 and grouped
    ones cannot)."""
    x_shape, (o, kh, kw), attrs = case
    group = attrs.get("group", 1)
    x = _rand(x_shape, dtype)
    w = _rand((o, x_shape[1] // group, kh, kw), dtype, 1)
    b = _rand((o,), dtype, 2)
    pointwise = kh == kw == 1
    for conv in _conv_paths(device):
        with _forced_conv(monkeypatch, conv) as cudnn_loads:
            eligible = conv == "cudnn" and cudnn_loads and dtype == np.float32 and group == 1
            (y,), _ = compare(device, "Conv", attrs, [x, w, b], [], dtype)
            assert ("cudnn" in device.launched) == eligible, (conv, device.launched)
            _check_conv_path(device, pointwise, "im2col")
            dy = _rand(y.shape, dtype, 3)
            compare(device, "ConvGradData", dict(attrs, x_shape=list(x_shape)), [dy, w], [],
                     dtype)
            _check_conv_path(device, pointwise, "col2im", may_take_cudnn=eligible)
            compare(device, "ConvGradWeight", dict(attrs, w_shape=list(w.shape)), [dy, x], [],
                     dtype)
            _check_conv_path(device, pointwise, "im2col", may_take_cudnn=eligible)


def _check_conv_path(device, pointwise, im2col_kernel, may_take_cudnn=True):
    """The last op's kernels are those of one path: cuDNN's graph and no
    im2col kernel, or (not cuDNN) ``im2col_kernel`` unless the conv is 1x1."""
    launched = device.launched
    if "cudnn" in launched:
        assert may_take_cudnn and im2col_kernel not in launched, launched
    elif not pointwise:
        assert im2col_kernel in launched, launched


@pytest.mark.parametrize("case", CONV_CASES[:3])
def test_conv_gpu_branch_in_chunks(device, case, monkeypatch):
    """A scratch bound that fits one sample: every direction runs per sample
    (the weight gradient accumulates over the chunks)."""
    from purine_mpi.gpu import conv as gpu_conv
    monkeypatch.setattr(gpu_conv, "COL_CHUNK_BYTES_GPU", 1)
    x_shape, (o, kh, kw), attrs = case
    group = attrs.get("group", 1)
    x = _rand(x_shape, np.float64)
    w = _rand((o, x_shape[1] // group, kh, kw), np.float64, 1)
    (y,), _ = compare(device, "Conv", attrs, [x, w], [], np.float64)
    dy = _rand(y.shape, np.float64, 3)
    compare(device, "ConvGradData", dict(attrs, x_shape=list(x_shape)), [dy, w], [],
             np.float64)
    compare(device, "ConvGradWeight", dict(attrs, w_shape=list(w.shape)), [dy, x],
             ["sum_rows"], np.float64)
    assert device.launched.count("sum_rows") == x_shape[0]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("axis", [1, 2])
def test_inner_product_gpu_branch(device, dtype, axis):
    x = _rand((4, 3, 2, 5), dtype)
    k = int(np.prod(x.shape[axis:]))
    w, b = _rand((6, k), dtype, 1), _rand((6,), dtype, 2)
    attrs = {"axis": axis}
    (y,), _ = compare(device, "InnerProduct", attrs, [x, w, b], ["bias_act"], dtype)
    dy = _rand(y.shape, dtype, 3)
    compare(device, "InnerProductGradData", dict(attrs, x_shape=list(x.shape)), [dy, w], [],
             dtype)
    compare(device, "InnerProductGradWeight", attrs, [dy, x], [], dtype)
    # rows 1..3 only (a chunk of a split weight): dy's columns as a strided view
    compare(device, "InnerProductGradWeight", dict(attrs, rows=[1, 4]), [dy, x], [], dtype)
    compare(device, "InnerProductGradBias", attrs, [dy], ["sum_rows"], dtype)


POOL_CASES = [
    {"pool": "max", "kernel": 3, "stride": 2, "pad": 1, "ceil_mode": True},
    {"pool": "max", "kernel": [2, 3], "stride": [2, 1]},
    {"pool": "ave", "kernel": 3, "stride": 2, "ceil_mode": True},
    {"pool": "ave", "kernel": 3, "stride": 2, "pad": 1},
    {"pool": "ave", "global": True},
    {"pool": "max", "global": True},
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("attrs", POOL_CASES)
def test_pool_gpu_branch(device, attrs, dtype):
    x = _rand((2, 3, 7, 6), dtype)
    kind = "maxpool" if attrs["pool"] == "max" else "avepool"
    outs, _ = compare(device, "Pool", attrs, [x], [f"{kind}_forward"], dtype)
    dy = _rand(outs[0].shape, dtype, 1)
    grad_in = [dy, outs[1]] if kind == "maxpool" else [dy]
    compare(device, "PoolGrad", dict(attrs, x_shape=list(x.shape)), grad_in,
             [f"{kind}_backward"], dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_lrn_gpu_branch(device, dtype):
    attrs = {"local_size": 5, "alpha": 0.3, "beta": 0.75, "k": 2.0}
    x = _rand((2, 7, 3, 4), dtype)
    (y, scale), _ = compare(device, "LRN", attrs, [x], ["lrn_forward"], dtype)
    dy = _rand(x.shape, dtype, 1)
    compare(device, "LRNGrad", attrs, [dy, x, y, scale], ["lrn_backward"], dtype)


SOFTMAX_CASES = [  # logits shape, ignore_label
    ((6, 5), None),
    ((6, 5), 2),
    ((2, 4, 3, 2), None),
    ((2, 4, 3, 2), 1),
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", SOFTMAX_CASES)
def test_softmax_loss_gpu_branch(device, case, dtype):
    shape, ignore = case
    rng = np.random.default_rng(0)
    x = _rand(shape, dtype, scale=3.0)
    label = rng.integers(0, shape[1], size=(shape[0],) + shape[2:]).astype(np.int64)
    attrs = {} if ignore is None else {"ignore_label": ignore}
    (loss, prob), _ = compare(device, "SoftmaxLoss", attrs, [x, label],
                               ["softmax_loss_forward"], dtype)
    assert loss.shape == ()
    dloss = np.asarray(0.7, dtype=dtype)
    compare(device, "SoftmaxLossGrad", attrs, [dloss, prob, label],
             ["softmax_loss_backward"], dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_softmax_loss_gpu_branch_with_a_normaliser(device, dtype):
    """The global-count normaliser (ops/data.py ``count_label``) on a GPU:
    the fused kernels, the loss rescaled on the device, as the CPU op."""
    rng = np.random.default_rng(1)
    x = _rand((2, 4, 3, 2), dtype, scale=3.0)
    label = rng.integers(0, 4, size=(2, 3, 2)).astype(np.int64)
    label.flat[::3] = 1
    norm = np.asarray(17.0 / 4, dtype=np.float64)
    (loss, prob), _ = compare(device, "SoftmaxLoss", {"ignore_label": 1}, [x, label, norm],
                              ["softmax_loss_forward", "softmax_loss_mean"], dtype)
    counted = label != 1
    nll = -np.log(np.take_along_axis(prob, label[:, None], axis=1)[:, 0])
    np.testing.assert_allclose(loss, (nll * counted).sum() / norm,
                               rtol=1e-10 if dtype == np.float64 else 2e-6)
    compare(device, "SoftmaxLossGrad", {"ignore_label": 1},
            [np.asarray(0.7, dtype=dtype), prob, label, norm], ["softmax_loss_backward"], dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape, axis", [((6, 5), 1), ((2, 4, 3, 2), 1), ((2, 3, 4), 2),
                                         ((3, 4), 0)])
def test_softmax_gpu_branch(device, shape, axis, dtype):
    """The Softmax op and its gradient on a GPU: one raw kernel each (no
    CuPy reduction, so a CUDA graph captures them), any axis."""
    x = _rand(shape, dtype, scale=3.0)
    (y,), _ = compare(device, "Softmax", {"axis": axis}, [x], ["softmax_forward"], dtype)
    compare(device, "SoftmaxGrad", {"axis": axis}, [_rand(shape, dtype, 1), y],
             ["softmax_backward"], dtype)


def test_softmax_into_a_strided_blob_on_a_gpu(device):
    """A softmax over axis 2 whose output is a channel slice of a larger
    buffer (as a concat's input is): its (outer, C, inner) reshape would be
    a copy, so the op takes the generic path and the slice gets the values."""
    x = _rand((2, 3, 4), np.float64, scale=3.0)
    want = run_kernel("Softmax", {"axis": 2}, [x])[0]
    buf = device.to_device(np.full((2, 5, 4), np.nan))
    y = buf[:, 1:4]                                   # not C-contiguous
    kernel = get_kernel_class("Softmax")(Op("probe", "Softmax", [], [], {"axis": 2}))
    device.launched.clear()
    kernel.run([device.to_device(x)], [y])
    assert "softmax_forward" not in device.launched
    got = np.array(backend.to_numpy(buf))
    np.testing.assert_allclose(got[:, 1:4], want, rtol=1e-12)
    assert np.isnan(got[:, 0]).all() and np.isnan(got[:, 4]).all()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("lr_on_host", [True, False])
def test_sgd_update_gpu_branch(device, dtype, lr_on_host):
    attrs = {"momentum": 0.9, "weight_decay": 5e-4, "lr_mult": 2.0, "decay_mult": 0.5,
             "grad_scale": 0.25}
    w, g, v = _rand((5, 7), dtype), _rand((5, 7), dtype, 1), _rand((5, 7), dtype, 2)
    lr = np.asarray(0.05, dtype=np.float32)
    compare(device, "SGDUpdate", attrs, [w, g, v, lr], ["sgd_momentum"], dtype,
             host_inputs=(3,) if lr_on_host else ())


def test_sgd_update_gpu_branch_in_place(device):
    """As in a graph: w@new and v@new are w and v (the kernel's in-place case)."""
    attrs = {"momentum": 0.9, "weight_decay": 1e-3}
    w, g, v = _rand((4, 3), np.float64), _rand((4, 3), np.float64, 1), np.zeros((4, 3))
    lr = np.asarray(0.1, np.float32)
    kernel = get_kernel_class("SGDUpdate")(Op("u", "SGDUpdate", [], [], attrs))
    dw, dv = device.to_device(w), device.to_device(v)
    kernel.run([dw, device.to_device(g), dv, lr], [dw, dv])
    v_ref = float(lr) * (g + 1e-3 * w)
    np.testing.assert_allclose(device.to_host(dv), v_ref, rtol=1e-12)
    np.testing.assert_allclose(device.to_host(dw), w - v_ref, rtol=1e-12)
    assert device.launched == ["sgd_momentum"]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("iter_on_host", [True, False])
def test_dropout_gpu_branch_draws_the_cpu_mask(device, dtype, iter_on_host):
    """Same seed, op and iteration: the device draws the CPU's mask, bit for bit."""
    x = _rand((5, 7, 3), dtype)
    it = np.asarray(12, np.int64)
    cpu, got = compare(device, "Dropout", {"ratio": 0.4}, [x, it], ["dropout_forward"], dtype,
                        host_inputs=(1,) if iter_on_host else ())
    for c, g in zip(cpu, got):
        np.testing.assert_array_equal(g, c)
    assert 0 < cpu[1].mean() < 1
    dy = _rand(x.shape, dtype, 1)
    cpu, got = compare(device, "DropoutGrad", {"ratio": 0.4}, [dy, cpu[1]],
                        ["dropout_backward"], dtype)
    np.testing.assert_array_equal(got[0], cpu[0])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("slope", [0.0, 0.1])
def test_relu_gpu_branch_is_one_kernel_each_way(device, dtype, slope):
    x = _rand((4, 3, 5), dtype)
    x.reshape(-1)[:4] = [np.nan, -0.0, 0.0, np.inf]   # NaN propagates, as in NumPy
    attrs = {"negative_slope": slope}
    cpu, got = compare(device, "Relu", attrs, [x], ["relu_forward"], dtype)
    assert device.launched == ["relu_forward"]
    np.testing.assert_array_equal(got[0], cpu[0])
    assert np.isnan(got[0].reshape(-1)[0])
    dy = _rand(x.shape, dtype, 1)
    dy.reshape(-1)[5] = np.inf
    cpu, got = compare(device, "ReluGrad", attrs, [dy, x], ["relu_backward"], dtype)
    assert device.launched == ["relu_backward"]
    np.testing.assert_array_equal(got[0], cpu[0])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_bias_gradients_are_one_reduction_kernel(device, dtype):
    dy = _rand((5, 6, 3, 4), dtype)
    compare(device, "ConvGradBias", {}, [dy], ["bias_grad"], dtype)
    assert device.launched == ["bias_grad"]
    # 36 float32 columns: the vectorised column sums (four columns a thread)
    name = "sum_rows_vec_f32" if dtype == np.float32 else "sum_rows"
    compare(device, "InnerProductGradBias", {}, [dy.reshape(5, 2, 36)], [name], dtype)
    assert device.launched == [name]


@pytest.mark.parametrize("op_type,shapes", [
    ("Conv", [(2, 3, 6, 5), (4, 3, 3, 3), (4,)]),
    ("InnerProduct", [(3, 2, 2, 2), (5, 8), (5,)]),
])
@pytest.mark.parametrize("slope", [0.0, 0.2])
def test_relu_fused_into_its_producer(device, op_type, shapes, slope, monkeypatch):
    """attr relu: the producer's output is the ReLU of its unfused output, on
    the CPU and on the device: in the bias kernel (one launch) on the im2col
    path, in cuDNN's epilogue when cuDNN takes the conv and fuses it (a GPU
    with the frontend; else cuDNN's conv and the bias kernel)."""
    x, w, b = (_rand(s, np.float32, i) for i, s in enumerate(shapes))
    attrs = {"pad": 1} if op_type == "Conv" else {}
    (plain,) = run_kernel(op_type, attrs, [x, w, b])
    (relu,) = run_kernel("Relu", {"negative_slope": slope}, [plain])
    fused = dict(attrs, relu=True, negative_slope=slope)
    for conv in _conv_paths(device) if op_type == "Conv" else ["im2col"]:
        with _forced_conv(monkeypatch, conv):
            (cpu,), (got,) = compare(device, op_type, fused, [x, w, b], [], np.float32)
            np.testing.assert_array_equal(cpu, relu)
            # cuDNN's epilogue, or our bias kernel after the product: never both
            in_epilogue = "cudnn_epilogue" in device.launched
            assert device.launched.count("bias_act") == (0 if in_epilogue else 1), \
                (conv, device.launched)


def test_float16_on_a_gpu_takes_the_generic_path():
    from purine_mpi.gpu.raw import raw_kernels
    fake_xp = types.SimpleNamespace()
    assert raw_kernels(np, np.zeros(2, np.float32)) is None
    assert raw_kernels(fake_xp, np.zeros(2, np.float16)) is None
    assert raw_kernels(fake_xp, np.zeros(2, np.float32)) is kernels


@register
class _SimComm(OpKernel):
    """A communication op: ``y = x`` delivered after a few polls (in finish)."""

    op_type = "TestGpuFakeComm"
    category = "comm"

    @classmethod
    def infer(cls, attrs, ins):
        return [ins[0]]

    def run(self, ins, outs):
        x, y = ins[0], outs[0]
        sent = np.array(x, copy=True)  # what a send would read now

        class _P(Pending):
            polls = int(self.attrs.get("polls", 2))

            def test(self):
                self.polls -= 1
                return self.polls <= 0

            def finish(self):
                y[...] = sent
        return _P()


def _chain_graph(locations):
    """x -> op0 -> b0 -> op1 -> b1 ... with ops at the given (device, thread,
    op type[, device of the output]) places; a Sum adds the host blob 'one'."""
    g = Graph("chain")
    g.add_blob("x", (3,), location=Location(0, -1))
    g.add_blob("one", (3,), location=Location(0, -1))
    prev = "x"
    for i, (dev, thread, op_type, *out_dev) in enumerate(locations):
        out = f"b{i}"
        g.add_blob(out, (3,), location=Location(0, out_dev[0] if out_dev else dev))
        ins = [prev] if op_type in ("Copy", "TestGpuFakeComm") else [prev, "one"]
        attrs = {"seq": i} if op_type == "TestGpuFakeComm" else {}
        g.add_op(f"op{i}", op_type, ins, [out], attrs, location=Location(0, dev), thread=thread)
        prev = out
    g.infer_shapes().validate()
    return g


def _dispatcher(graph, runtime, cuda_graph=False, **kw):
    """The stream dispatcher on ``runtime`` (eager unless ``cuda_graph``)."""
    ws = cpu_workspace(graph)
    d = make_dispatcher(graph, runtime=runtime, workspace=ws, cuda_graph=cuda_graph, **kw)
    assert isinstance(d, StreamDispatcher)
    log_kernels(d, runtime)
    return d, ws


def test_cross_stream_edge_waits_same_stream_edge_does_not():
    # op2 copies its result to host memory, which the host op op3 reads
    g = _chain_graph([(0, 0, "Sum"), (0, 0, "Sum"), (0, 1, "Copy", -1), (-1, 0, "Sum")])
    rt = SimulatedRuntime()
    d, ws = _dispatcher(g, rt)
    try:
        ws.set("x", np.arange(3.0))
        ws.set("one", np.ones(3))
        d.run()
        np.testing.assert_array_equal(ws["b3"], np.arange(3.0) + 3)
        ev = d.executor.events
        # op0 -> op1 share stream (0, 0): no event; op1 -> op2 crosses to (0, 1);
        # op2 -> op3 goes to the host
        assert set(ev) == {"op1", "op2"}
        waits = [(c[1], c[2]) for c in rt.calls if c[0] == "wait"]
        assert waits == [((0, 1), ev["op1"])]
        syncs = [c[1] for c in rt.calls if c[0] == "sync_event"]
        assert syncs == [ev["op2"]]
        check_order(rt.log, g)
        # the host op ran only after its producer ran on the device
        assert rt.log.index("op2") < rt.log.index("op3")
        assert [k for k in d.executor.streams.values()] == [(0, 0), (0, 0), (0, 1), None]
    finally:
        d.close()


def test_host_sync_before_comm_op_and_event_after_it():
    """GPU -> comm -> GPU: the comm op is posted only once its input is
    complete on the device (polled, not a blocking sync), and its GPU
    consumer waits on an event recorded after the comm op finished."""
    g = _chain_graph([(0, 0, "Sum"), (0, 0, "Sum"), (0, 0, "TestGpuFakeComm"), (0, 0, "Sum")])
    rt = SimulatedRuntime(poll_steps=(0, 1))
    d, ws = _dispatcher(g, rt)
    try:
        ws.set("x", np.arange(3.0))
        ws.set("one", np.ones(3))
        d.run()
        np.testing.assert_array_equal(ws["b3"], np.arange(3.0) + 3)
        check_order(rt.log, g)
        assert d.executor.streams["op2"] == (0, "comm")
        ev = d.executor.events
        # polled op1's event (never a blocking sync) before the comm op ran
        polls = [i for i, c in enumerate(rt.calls) if c[0] == "query" and c[1] is ev["op1"]]
        comm_call = next(i for i, c in enumerate(rt.calls) if c[0] == "call")
        assert polls and rt.calls[polls[-1]][2] is True and polls[-1] < comm_call
        assert not [c for c in rt.calls if c[0] == "sync_event"]
        # the GPU consumer waits on the comm op's event, recorded on the comm stream
        waits = [(c[1], c[2]) for c in rt.calls if c[0] == "wait"]
        assert waits == [((0, 0), ev["op2"])] and ev["op2"].stream.key == (0, "comm")
    finally:
        d.close()


def test_comm_ops_held_back_keep_their_seq_order():
    """A comm op whose GPU input is late must not be overtaken by the next one."""
    g = Graph("two_comms")
    for b in ("x", "one"):
        g.add_blob(b, (3,), location=Location(0, -1))
    g.add_blob("a", (3,), location=Location(0, 0))
    g.add_op("gpu", "Sum", ["x", "one"], ["a"], location=Location(0, 0))
    g.add_op("late", "TestGpuFakeComm", ["a"], ["a_sent"], {"seq": 0}, location=Location(0, 0))
    g.add_op("early", "TestGpuFakeComm", ["x"], ["x_sent"], {"seq": 1}, location=Location(0, -1))
    g.infer_shapes().validate()
    rt = SimulatedRuntime(stalled_polls=30)  # the GPU work completes late
    d, ws = _dispatcher(g, rt)
    try:
        ws.set("x", np.arange(3.0))
        ws.set("one", np.ones(3))
        d.run()
        assert rt.log.index("late") < rt.log.index("early")
        np.testing.assert_array_equal(ws["a_sent"], np.arange(3.0) + 1)
    finally:
        d.close()


def test_accumulating_writers_on_two_streams_chain_their_adds():
    g = Graph("acc")
    for b in ("x", "y"):
        g.add_blob(b, (4,), location=Location(0, -1))
    g.add_blob("acc", (4,), location=Location(0, 0))
    g.add_blob("out", (4,), location=Location(0, 0))
    g.add_op("w1", "Copy", ["x"], ["acc"], location=Location(0, 0), thread=1, accumulate=True)
    g.add_op("w2", "Copy", ["y"], ["acc"], location=Location(0, 0), thread=2, accumulate=True)
    g.add_op("read", "Copy", ["acc"], ["out"], location=Location(0, 0), thread=3)
    g.infer_shapes().validate()
    for seed in range(5):
        rt = SimulatedRuntime(seed)
        d, ws = _dispatcher(g, rt)
        try:
            ws.set("x", np.arange(4.0))
            ws.set("y", 10 * np.ones(4))
            for _ in range(2):  # zeroed again every iteration
                rt.log.clear()
                d.run()
                np.testing.assert_array_equal(ws["out"], np.arange(4.0) + 10)
                check_order(rt.log, g)
            # the second add waits for the first one (a device-side race otherwise,
            # which this simulation, running each launch atomically, cannot show)
            writers = {(0, 1), (0, 2)}
            chained = [c for c in rt.calls if c[0] == "wait" and c[1] in writers
                       and c[2].stream.key in writers - {c[1]}]
            assert len(chained) == 2  # one per iteration
        finally:
            d.close()


def _with_fake_allreduce(graph, grads):
    """Route one gradient through a comm op (as data parallelism would)."""
    param = sorted(grads)[0]
    grad = grads[param]
    update = next(op for op in graph.ops.values()
                  if op.op_type == "SGDUpdate" and op.inputs[0] == param)
    graph.add_op(f"{grad}.allreduce", "TestGpuFakeComm", [grad], [f"{grad}.sum"],
                 {"seq": 0, "polls": 3}, location=update.location)
    update.inputs[1] = f"{grad}.sum"
    graph.infer_shapes().validate()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_training_graph_on_a_simulated_gpu_matches_serial(seed):
    """A placed training graph, ops spread over three streams at random:
    every op runs after its producers and the results are bitwise those of
    the serial dispatcher on the CPU graph."""
    config = tiny_config()
    graph, grads = build_train_graph(make_job(config))
    _with_fake_allreduce(graph, grads)
    reference = copy.deepcopy(graph)
    place_on_device(graph, 0)
    rng = random.Random(seed)
    for op in graph.ops.values():
        if op.location.device >= 0 and op.op_type != "Copy":
            op.thread = rng.choice([0, 1, 2])
    rt = SimulatedRuntime(seed)
    d, ws = _dispatcher(graph, rt, seed=7)
    d.profiler = Profiler()
    ref = SerialDispatcher(reference, seed=7)
    init_params(ws, graph, 5)
    init_params(ref.workspace, reference, 5)
    try:
        for it in range(3):
            rt.log.clear()
            ws["iter"][...] = it
            ref.workspace["iter"][...] = it
            d.run(it)
            ref.run(it)
            check_order(rt.log, d.graph)
            np.testing.assert_array_equal(ws["loss"], ref.workspace["loss"])
        for p in reference.params():
            np.testing.assert_array_equal(ws[p.name], ref.workspace[p.name])
        # distinct streams were really used, with device-side waits between them
        assert len({k for k in d.executor.streams.values() if k is not None}) >= 4
        assert any(c[0] == "wait" for c in rt.calls)
        # GPU ops are traced on their streams, with device times
        tids = {e["tid"] for e in d.profiler.events}
        assert {"gpu0:0", "gpu0:1", "gpu0:2", "comm"} <= tids
        assert all(e["dur"] >= 0 for e in d.profiler.events)
    finally:
        d.close()


@pytest.mark.parametrize("fused", [False, True], ids=["placed", "placed+fused"])
def test_training_on_an_emulated_gpu_matches_the_cpu(host_build_dir, monkeypatch, fused):
    """Everything at once, without a GPU: a placed training graph whose
    workspace is a device arena of emulated CuPy arrays, ops taking their
    GPU branches (the raw kernels compiled for the host), run by the stream
    dispatcher on the simulated device. Losses and weights match the CPU;
    so they do after the device fusions (parallel/fuse.py), with the fused kernels."""
    config = tiny_config()
    cpu_losses, cpu_params = train_simulated(config, -1)
    use_emulated_cupy(monkeypatch, host_build_dir)
    launched = []
    real_launch = kernels.base._launch
    monkeypatch.setattr(kernels.base, "_launch", lambda source, func, *a: (
        launched.append(func), real_launch(source, func, *a))[1])
    real_blocks = kernels.base._launch_blocks
    monkeypatch.setattr(kernels.base, "_launch_blocks", lambda source, func, *a: (
        launched.append(func), real_blocks(source, func, *a))[1])
    try:
        losses, params, ws = train_simulated(config, 0, fuse=fused)
    finally:
        gpu.clear_kernel_cache()
    # (no col2im: conv1 needs no data gradient, conv2 is 1x1)
    assert {"im2col", "maxpool_forward", "maxpool_backward", "avepool_forward",
            "avepool_backward", "lrn_forward", "lrn_backward", "softmax_loss_forward",
            "softmax_loss_backward", "relu_backward", "bias_grad", "learning_rate"} \
        <= set(launched)
    if fused:
        # prepared for the device, dropout keeps no mask: the forward and the
        # gradient each draw it (placement.redraw_dropout_masks)
        assert launched.count("dropout_apply") == 2 * 3
        assert not {"dropout_forward", "dropout_backward"} & set(launched)
        assert {"sgd_momentum_multi", "bias_act"} <= set(launched)
        assert not {"sgd_momentum", "relu_forward"} & set(launched)
        assert launched.count("sgd_momentum_multi") == 3  # one update per iteration
    else:
        assert {"sgd_momentum", "relu_forward", "dropout_forward",
                "dropout_backward"} <= set(launched)
    np.testing.assert_allclose(losses, cpu_losses, rtol=1e-5)
    for name, value in cpu_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=1e-6)
    # the device blobs are views of one arena; the host side of the copies is pinned
    arena = ws._arena[0]
    for name, blob in ws.graph.blobs.items():
        arr = ws[name]
        if blob.location.device == 0:
            assert isinstance(arr, DeviceArray) and np.shares_memory(arr, arena), name
        else:
            assert not isinstance(arr, DeviceArray), name
    assert ws.device_bytes[0] == arena.nbytes


def test_cpu_graph_still_gets_the_event_dispatcher():
    config = tiny_config()
    graph, _ = build_train_graph(make_job(config))
    d = make_dispatcher(graph)
    try:
        assert type(d) is EventDispatcher
    finally:
        d.close()
    # 'stream' on a CPU graph: the event dispatcher's behaviour, no CUDA at all
    d = make_dispatcher(graph, "stream")
    try:
        assert isinstance(d, StreamDispatcher) and d.executor.runtime is None
        init_params(d.workspace, graph, 5)
        d.workspace["iter"][...] = 0
        d.run(0)
        assert np.isfinite(float(d.workspace["loss"]))
    finally:
        d.close()


# =====================================================================
# 3. placement, memory planning, configuration
# =====================================================================

def test_place_on_device():
    config = tiny_config()
    graph, _ = build_train_graph(make_job(config))
    n_ops = len(graph.ops)
    place_on_device(graph, 1)
    ops = graph.ops
    # the lr policy runs on the device, from the iteration counted there
    assert ops["solver.lr"].location.device == 1
    # the data reader stages its batches itself and copies them on the h2d stream
    assert ops["data"].location.device == 1 and ops["data"].thread == "h2d"
    for name in ("data", "label"):
        assert graph.blobs[name].location.device == 1
        assert not graph.blobs[name].attrs.get("pinned")
    # the host iteration is not copied: a counter on the device writes its twin
    assert graph.blobs["iter"].location.device == -1
    assert not graph.blobs["iter"].attrs.get("pinned")
    assert graph.blobs["lr"].location.device == 1
    assert not [n for n, op in ops.items() if op.op_type == "Copy"]
    counter = ops["iter.count"]
    assert counter.op_type == "IterationCounter" and counter.inputs == []
    assert counter.outputs == ["iter@gpu1", "iter.counter@gpu1"]
    assert graph.blobs["iter.counter@gpu1"].kind == "state"
    assert graph.blobs["iter@gpu1"].attrs["copy_of"] == "iter"
    assert ops["solver.lr"].inputs == ["iter@gpu1"] and ops["drop.fwd"].inputs[1] == "iter@gpu1"
    assert len(ops) == n_ops + 1
    for op in ops.values():
        assert op.location.device == 1, op.name
        for i, b in enumerate(op.inputs):
            on_host = graph.blobs[b].location.device < 0
            # no device op reads a host blob (the iteration is counted there)
            assert not on_host, (op.name, b)
    for name, blob in graph.blobs.items():
        if blob.alias_of is not None:
            assert blob.location == graph.blobs[graph.storage_root(name)].location
    graph.validate()
    assert place_on_device(copy.deepcopy(graph), -1).ops.keys() == graph.ops.keys()


def test_plan_device_memory_is_aligned_and_disjoint():
    config = tiny_config()
    graph, _ = build_train_graph(make_job(config))
    place_on_device(graph, 0)
    plans = plan_device_memory(graph)
    assert list(plans) == [0]
    total, offsets = plans[0]
    roots = [n for n, b in graph.blobs.items() if b.alias_of is None and b.location.device == 0]
    assert sorted(offsets) == sorted(roots)
    spans = sorted((off, off + max(graph.blobs[n].nbytes, 1)) for n, off in offsets.items())
    assert all(off % ARENA_ALIGN == 0 for off, _ in spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= total < spans[-1][1] + ARENA_ALIGN
    # parameters shared from another workspace are not planned again
    shared = {p.name for p in graph.params()}
    assert not set(plan_device_memory(graph, skip=shared)[0][1]) & shared


def test_cpu_workspace_unchanged():
    config = tiny_config()
    graph, _ = build_train_graph(make_job(config))
    ws = Workspace(graph)
    assert ws.device_bytes == {} and plan_device_memory(graph) == {}
    roots = [b for b in graph.blobs.values() if b.alias_of is None]
    assert ws.allocated_bytes == sum(max(b.size, 1) * np.dtype(b.dtype).itemsize for b in roots)
    assert all(type(ws[b]) is np.ndarray for b in graph.blobs)


def test_a_gpu_graph_without_cupy_is_a_user_error():
    if backend.cupy_available():
        pytest.skip("a GPU is available here")
    config = tiny_config()
    graph, _ = build_train_graph(make_job(config))
    place_on_device(graph, 0)
    with pytest.raises(UserError, match="CuPy"):
        Workspace(graph)


def test_select_device_and_tf32_key():
    config = tiny_config()
    assert config["tf32"] is False and select_device(make_job(config)) == -1
    with pytest.raises(ConfigError, match="tf32"):
        tiny_config(tf32="yes")
    with pytest.raises(ConfigError, match="backend: numpy"):
        select_device(make_job(dict(config, device=0, backend="numpy")))
    if not backend.cupy_available():
        with pytest.raises(UserError, match="CuPy"):
            select_device(make_job(dict(config, device=0)))
        with pytest.raises(UserError, match="CuPy"):
            select_device(make_job(dict(config, backend="cupy")))


# =====================================================================
# 4. on a real GPU (skipped without CuPy and a CUDA device)
# =====================================================================

GRAPH_OP_CASES = [  # op type, attrs, input shapes (first is x), wrt
    ("Conv", {"stride": 2, "pad": 1, "group": 2}, [(2, 4, 7, 6), (6, 2, 3, 3), (6,)],
     ("x", "in1", "in2")),
    ("Conv", {}, [(2, 6, 5, 4), (4, 6, 1, 1)], ("x", "in1")),
    ("Pool", {"pool": "max", "kernel": 3, "stride": 2, "ceil_mode": True}, [(2, 3, 7, 6)],
     ("x",)),
    ("Pool", {"pool": "ave", "kernel": 3, "stride": 2, "pad": 1}, [(2, 3, 7, 6)], ("x",)),
    ("LRN", {"local_size": 5, "alpha": 0.3, "beta": 0.75, "k": 2.0}, [(2, 7, 3, 4)], ("x",)),
    ("InnerProduct", {}, [(4, 3, 2, 2), (5, 12), (5,)], ("x", "in1", "in2")),
    ("Relu", {}, [(3, 4)], ("x",)),
    ("Softmax", {}, [(3, 5)], ("x",)),
    ("Dropout", {"ratio": 0.3}, [(6, 8), ((), "int64")], ("x",)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GRAPH_OP_CASES,
                         ids=[f"{c[0]}{i}" for i, c in enumerate(GRAPH_OP_CASES)])
def test_every_op_on_gpu_matches_numpy(case):
    _gpu_cupy()
    from tests.opcheck import run_op
    op_type, attrs, shapes, wrt = case
    names = ["x"] + [f"in{i}" for i in range(1, len(shapes))]
    inputs = {n: np.asarray(7, np.int64) if s == ((), "int64") else _rand(s, np.float32, i)
              for i, (n, s) in enumerate(zip(names, shapes))}   # int64 (): the iteration
    outs_cpu, grads_cpu = run_op(op_type, attrs, inputs, wrt)
    outs_gpu, grads_gpu = run_graph_on_gpu(op_type, attrs, inputs, wrt)
    for k, v in outs_cpu.items():
        if k == "_loss_weights":
            continue
        np.testing.assert_allclose(outs_gpu[k], v, rtol=1e-4, atol=1e-5)
    for p, v in grads_cpu.items():
        np.testing.assert_allclose(grads_gpu[p], v, rtol=1e-4, atol=1e-5 * max(1, np.abs(v).max()))


@pytest.mark.gpu
@pytest.mark.parametrize("ignore", [None, 2])
def test_softmax_loss_on_gpu_matches_numpy(ignore):
    _gpu_cupy()
    from tests.opcheck import run_op
    rng = np.random.default_rng(0)
    inputs = {"x": _rand((6, 5), np.float32, scale=3.0),
              "label": rng.integers(0, 5, size=6).astype(np.int64)}
    attrs = {} if ignore is None else {"ignore_label": ignore}
    weights = [np.asarray(1.0, np.float32), None]
    outs_cpu, grads_cpu = run_op("SoftmaxLoss", attrs, inputs, ("x",), loss_weights=weights)
    outs_gpu, grads_gpu = _run_graph_on_gpu_weights("SoftmaxLoss", attrs, inputs, ("x",), weights)
    np.testing.assert_allclose(outs_gpu[0], outs_cpu[0], rtol=1e-5)
    np.testing.assert_allclose(outs_gpu[1], outs_cpu[1], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grads_gpu["x"], grads_cpu["x"], rtol=1e-5, atol=1e-7)


def _run_graph_on_gpu_weights(op_type, attrs, inputs, wrt, weights):
    from tests.opcheck import _build
    g, outs, loss_terms, grads, _ = _build(op_type, attrs, inputs, wrt, weights, 0)
    place_on_device(g, 0)
    d = make_dispatcher(g)
    try:
        for name, value in inputs.items():
            d.workspace.set(name, value)
        for k, _, w in loss_terms:
            d.workspace.set(f"lw{k}", w)
        d.run()
        return ({k: backend.to_numpy(d.workspace[o]) for k, o in enumerate(outs)},
                {p: backend.to_numpy(d.workspace[n]) for p, n in grads.items()})
    finally:
        d.close()


@pytest.mark.gpu
def test_workspace_arena_on_gpu():
    cupy = _gpu_cupy()
    graph, _ = build_train_graph(make_job(tiny_config()))
    place_on_device(graph, 0)
    ws = Workspace(graph)
    arena = ws._arena[0]
    for name, blob in graph.blobs.items():
        arr = ws[name]
        if blob.location.device < 0:
            assert isinstance(arr, np.ndarray)
            continue
        assert isinstance(arr, cupy.ndarray) and arr.device.id == 0
        assert arena.data.ptr <= arr.data.ptr < arena.data.ptr + arena.nbytes
    ws.set("conv1/weight", np.ones(graph.blobs["conv1/weight"].shape, np.float32))
    assert float(ws["conv1/weight"].sum()) == graph.blobs["conv1/weight"].size


def _train(config, device, iters, seed=0, fuse=False):
    """Losses of ``iters`` iterations of ``config`` on ``device`` (-1: CPU);
    ``fuse``: placed and fused as the trainer does."""
    graph, _ = build_train_graph(make_job(config))
    if fuse:
        prepare_for_device(graph, device)
    else:
        place_on_device(graph, device)
    d = make_dispatcher(graph, seed=seed)
    try:
        init_params(d.workspace, graph, config["seed"])
        losses = []
        for it in range(iters):
            d.workspace["iter"][...] = it
            d.run(it)
            losses.append(float(d.workspace["loss"]))
        return losses, {p.name: backend.to_numpy(d.workspace[p.name]) for p in graph.params()}
    finally:
        d.close()


@pytest.mark.gpu
def test_tiny_net_on_gpu_matches_cpu():
    _gpu_cupy()
    config = tiny_config()
    cpu, cpu_params = _train(config, -1, 4)
    dev, dev_params = _train(config, 0, 4)
    np.testing.assert_allclose(dev, cpu, rtol=1e-4)
    for name, value in cpu_params.items():
        np.testing.assert_allclose(dev_params[name], value, rtol=1e-3, atol=1e-5)


@pytest.mark.gpu
def test_cifar10_quick_on_gpu_matches_cpu():
    """A few iterations of jobs/cifar10_quick.yaml (batch 16): same losses."""
    _gpu_cupy()
    from purine_mpi.job.config import load_config
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "jobs", "cifar10_quick.yaml")
    config = load_config(path, overrides=["data.train.batch_size=16",
                                          "solver.base_lr=0.01"], check_files=False)
    cpu, _ = _train(config, -1, 5)
    dev, _ = _train(config, 0, 5)
    np.testing.assert_allclose(dev, cpu, rtol=2e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("conv", ["auto", "im2col"])
@pytest.mark.parametrize("net,rtol", [("cifar10_quick", 2e-4), ("nin_cifar10", 1e-3)])
def test_nets_on_gpu_match_cpu_fused_with_dropout(net, rtol, conv, monkeypatch):
    """cifar10_quick and NIN (dropout on: the same Philox masks on both
    devices), placed and fused as train runs them, on cuDNN (when present)
    and on the im2col fallback: the same losses as the CPU over 5 iterations."""
    _gpu_cupy()
    import os
    from purine_mpi.gpu import cudnn as gpu_cudnn
    from purine_mpi.job.config import load_config
    monkeypatch.setenv("PURINE_CONV", conv)
    gpu_cudnn.reset()
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "jobs", f"{net}.yaml")
    config = load_config(path, overrides=["data.train.batch_size=16", "solver.base_lr=0.01"],
                         check_files=False)
    cpu, cpu_params = _train(config, -1, 5)
    dev, dev_params = _train(config, 0, 5, fuse=True)
    gpu_cudnn.reset()
    np.testing.assert_allclose(dev, cpu, rtol=rtol)
    for name, value in cpu_params.items():
        np.testing.assert_allclose(dev_params[name], value, rtol=50 * rtol,
                                   atol=1e-3 * max(1.0, float(np.abs(value).max())))


@pytest.mark.gpu
def test_trainer_on_gpu_resumes_bit_exactly_with_dropout(tmp_path):
    """The emulated test below, on the real GPU (CUDA graphs on, cuDNN when
    present): stop at 4, resume, end bit-identical to the straight run."""
    _gpu_cupy()
    _check_trainer_resume(tmp_path, emulated=False)


@pytest.mark.gpu
def test_stream_dispatcher_real_streams():
    """The chain graph across two streams (and the h2d copies), on a real GPU."""
    _gpu_cupy()
    g = _chain_graph([(0, 0, "Sum"), (0, 0, "Sum"), (0, 1, "Sum"), (0, 2, "Copy", -1),
                      (-1, 0, "Sum"), (0, 1, "Sum")])
    place_on_device(g, 0)  # inserts the copies between host and device
    d = make_dispatcher(g)
    try:
        d.workspace.set("x", np.arange(3.0, dtype=np.float32))
        d.workspace.set("one", np.ones(3, np.float32))
        for _ in range(3):
            d.run()
            np.testing.assert_array_equal(backend.to_numpy(d.workspace["b5"]),
                                          np.arange(3.0) + 5)
        assert len(d.executor.runtime.pool) >= 3
    finally:
        d.close()


def _no_readback(self):
    raise AssertionError("a device value was read back to the host")


@pytest.mark.parametrize("lr_on_device", [False, True])
@pytest.mark.parametrize("kind", ["nesterov", "adagrad", "rmsprop", "adadelta", "adam", "adamw"])
def test_solver_updates_run_in_place_on_the_device(device, kind, lr_on_device, monkeypatch):
    """Every solver besides SGD is one xp code path: on device arrays it
    updates the weight and its state in place (w@new is w) and matches the
    same op on the CPU, with the learning rate a host scalar or the device
    blob (never read back); Adam's iteration is a host scalar."""
    from purine_mpi.ops.updates import SOLVER_UPDATES
    op_type, states = SOLVER_UPDATES[kind]
    attrs = {"momentum": 0.9, "momentum2": 0.99, "delta": 1e-6, "rms_decay": 0.9,
             "weight_decay": 1e-2, "lr_mult": 1.5, "decay_mult": 0.5, "grad_scale": 0.5}
    w, g = _rand((6, 5), np.float32), _rand((6, 5), np.float32, 1)
    state = [np.abs(_rand((6, 5), np.float32, 2 + i)) for i in range(len(states))]
    host = [np.asarray(0.05, np.float32)] + ([np.asarray(3, np.int64)]
                                             if kind.startswith("adam") else [])
    cls = get_kernel_class(op_type)
    cpu = [a.copy() for a in [w] + state]
    cls(Op("u", op_type, [], [], dict(attrs))).run([cpu[0], g] + cpu[1:] + host, cpu)
    dev = [device.to_device(a) for a in [w] + state]
    with monkeypatch.context() as patch:
        if lr_on_device:  # the lr blob computed on the device (placement puts it there)
            host = [device.to_device(host[0])] + host[1:]
            if device.name == "emulated":   # and never read back to the host
                patch.setattr(DeviceArray, "__float__", _no_readback, raising=False)
        cls(Op("u", op_type, [], [], dict(attrs))).run([dev[0], device.to_device(g)] + dev[1:]
                                                       + host, dev)
    for ours, ref in zip(dev, cpu):
        assert not isinstance(ours, np.ndarray) or isinstance(ours, DeviceArray)
        np.testing.assert_allclose(device.to_host(ours), ref, rtol=1e-6, atol=1e-7)
    assert not np.allclose(cpu[0], w)


def _trainer_run(config, out, resume=None):
    from purine_mpi.train.trainer import Trainer
    from tests.conftest import FakeWorld
    t = Trainer(make_job(config), str(out), world=FakeWorld(), resume=resume, log=lambda m: None)
    t.run()
    return t


def test_trainer_on_an_emulated_gpu_resumes_bit_exactly_with_dropout(
        host_build_dir, monkeypatch, tmp_path):
    """`train` with device: 0 (emulated): the graph is placed and fused (one
    multi-tensor SGD update, ReLU in the conv), dropout draws its masks on
    the device from iter@gpu0 and the lr comes from the device. Stopping at
    iteration 4 and resuming ends bit-identical to the uninterrupted run, and
    close to the same run on the CPU."""
    emulated_trainer_env(monkeypatch, host_build_dir)
    _check_trainer_resume(tmp_path, emulated=True)


def _check_trainer_resume(tmp_path, emulated):
    from purine_mpi.job.checkpoint_file import load_checkpoint
    raw = tiny_raw(device=0, checkpoint={"interval": 4, "keep": 5})
    raw["solver"].update(max_iter=8, display=0, test_interval=0)
    config = validate_config(raw, check_files=False)
    cpu_config = validate_config(dict(raw, device=-1), check_files=False)
    cpu = _trainer_run(cpu_config, tmp_path / "cpu")
    try:
        straight = _trainer_run(config, tmp_path / "straight")
        assert straight.graphs.device == 0
        ops = {op.op_type for op in straight.graphs.graph.ops.values()}
        assert "MultiSGDUpdate" in ops and "SGDUpdate" not in ops and "Relu" not in ops
        weight = straight.ws["conv1/weight"]
        assert isinstance(weight, DeviceArray) if emulated else \
            type(weight).__module__.startswith("cupy")
        split = tmp_path / "split"
        cut = dict(config, solver=dict(config["solver"], max_iter=4))
        _trainer_run(cut, split)
        _trainer_run(config, split, resume=str(split / "ckpt_4.h5"))
    finally:
        gpu.clear_kernel_cache()
    a = load_checkpoint(str(tmp_path / "straight" / "latest.h5"))
    b = load_checkpoint(str(split / "latest.h5"))
    c = load_checkpoint(str(tmp_path / "cpu" / "latest.h5"))
    assert a.iteration == b.iteration == c.iteration == 8
    assert sorted(a.params) == sorted(c.params) == sorted(p.name for p in cpu.graphs.graph.params())
    for name in a.params:
        assert a.params[name].tobytes() == b.params[name].tobytes(), name
        assert a.solver[name]["momentum"].tobytes() == b.solver[name]["momentum"].tobytes()
        np.testing.assert_allclose(a.params[name], c.params[name], rtol=1e-4, atol=1e-6)
    assert not np.array_equal(a.params["fc1/weight"],
                              load_checkpoint(str(split / "ckpt_4.h5")).params["fc1/weight"])
