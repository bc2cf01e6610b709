"""Helpers of the GPU tests on the emulated device: a small training config,
weights, one kernel against the CPU, a few iterations of training."""
import numpy as np

import purine_mpi.base.backend as backend
from purine_mpi.graph.core import Op
from purine_mpi.job.config import validate_config
from purine_mpi.job.replica import build_train_graph
from purine_mpi.layers.fillers import fill
from purine_mpi.ops.catalog import get_kernel_class
from purine_mpi.parallel.placement import place_on_device, prepare_for_device
from purine_mpi.runtime.dispatcher import SerialDispatcher
from purine_mpi.runtime.factory import make_dispatcher
from purine_mpi.runtime.streams_dispatcher import StreamDispatcher
from tests.conftest import make_job

from .arrays import DeviceArray
from .cupy_module import use_emulated_cupy
from .runtime import SimulatedRuntime


def on_device(values):
    """``values`` as a float32 array on the emulated device."""
    return np.array(values, dtype=np.float32).view(DeviceArray)


def run_kernel(op_type, attrs, inputs, convert=None, host_inputs=()):
    """Run one kernel on ``inputs`` (converted with ``convert``, except the
    indices in ``host_inputs``); returns its outputs as NumPy arrays."""
    cls = get_kernel_class(op_type)
    specs = cls.infer(attrs, [(a.shape, str(a.dtype)) for a in inputs])
    kernel = cls(Op("probe", op_type, [], [], dict(attrs)))
    convert = convert or (lambda a: a)
    ins = [a if i in host_inputs else convert(a) for i, a in enumerate(inputs)]
    outs = [convert(np.full(shape, np.nan if np.dtype(d).kind == "f" else -7, dtype=d))
            for shape, d in specs]
    kernel.run(ins, outs)
    return [np.array(backend.to_numpy(o)) for o in outs]


def assert_update_matches(dev, got, want, dtype, lr_on_device, what, tol64=1e-12):
    """A solver kernel's arrays (``got``, on ``dev``) against the CPU op's
    (``want``): bit for bit on the emulated device, which computes in the CPU
    update's order (unless a float32 device lr widened to float64 differs
    from the host's number), else within float32/float64 rounding (a GPU's
    fused multiply-adds)."""
    for i, (g, w) in enumerate(zip(got, want)):
        g = dev.to_host(g)
        if dev.name == "emulated" and not (lr_on_device and dtype == np.float64):
            np.testing.assert_array_equal(g, w, err_msg=f"{what}, array {i}")
        else:
            tol = 2e-6 if dtype == np.float32 else tol64
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol * 1e-3,
                                       err_msg=f"{what}, array {i}")


def compare(dev, op_type, attrs, inputs, expect_kernels, dtype, host_inputs=()):
    cpu = run_kernel(op_type, attrs, inputs)
    dev.launched.clear()
    got = run_kernel(op_type, attrs, inputs, dev.to_device, host_inputs)
    assert set(expect_kernels) <= set(dev.launched), \
        f"{op_type}: the GPU branch launched {dev.launched}, expected {expect_kernels}"
    tight = dtype == np.float64
    for c, g in zip(cpu, got):
        assert c.shape == g.shape and c.dtype == g.dtype
        if c.dtype.kind == "f":
            np.testing.assert_allclose(g, c, rtol=1e-10 if tight else 2e-5,
                                       atol=1e-10 if tight else 2e-5)
        else:
            np.testing.assert_array_equal(g, c)
    return cpu, got


def tiny_config(**overrides):
    return validate_config(tiny_raw(**overrides), check_files=False)


def tiny_raw(**overrides):
    cfg = {
        "name": "gpu-tiny", "seed": 5,
        "data": {"train": {"source": "synthetic", "shape": [3, 8, 8], "classes": 5,
                           "num_samples": 64, "batch_size": 8, "shuffle": True}},
        "net": [
            {"type": "conv", "name": "conv1", "bottom": "data", "top": "conv1",
             "num_output": 4, "kernel": 3, "pad": 1,
             "weight_filler": {"type": "gaussian", "std": 0.1}},
            {"type": "relu", "name": "relu1", "bottom": "conv1", "top": "conv1"},
            {"type": "pool", "name": "pool1", "bottom": "conv1", "top": "pool1",
             "pool": "max", "kernel": 3, "stride": 2, "ceil_mode": True},
            {"type": "lrn", "name": "norm1", "bottom": "pool1", "top": "norm1",
             "local_size": 3, "alpha": 0.01, "beta": 0.75},
            {"type": "conv", "name": "conv2", "bottom": "norm1", "top": "conv2",
             "num_output": 6, "kernel": 1, "weight_filler": {"type": "gaussian", "std": 0.1}},
            {"type": "pool", "name": "pool2", "bottom": "conv2", "top": "pool2",
             "pool": "ave", "kernel": 2, "stride": 2},
            {"type": "dropout", "name": "drop", "bottom": "pool2", "top": "pool2",
             "ratio": 0.3},
            {"type": "fc", "name": "fc1", "bottom": "pool2", "top": "fc1", "num_output": 5,
             "weight_filler": {"type": "gaussian", "std": 0.1}},
            {"type": "softmax_loss", "name": "loss", "bottom": ["fc1", "label"], "top": "loss"},
        ],
        "solver": {"base_lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3,
                   "lr_policy": "step", "gamma": 0.5, "stepsize": 2, "max_iter": 10},
    }
    cfg.update(overrides)
    return cfg


def reporting_raw(device, cuda_graph=False, **solver):
    """``tiny_raw`` with everything a run reports: a test split of 20
    samples (a pass of 3 batches, the last padded) with an accuracy layer,
    a display row every 3 iterations, a test pass every 2, a checkpoint
    every 4, the 2 best by test accuracy kept, early stopping watched on
    the test loss (``solver`` overrides, e.g. its patience)."""
    raw = tiny_raw(device=device, cuda_graph=cuda_graph,
                   checkpoint={"interval": 4, "keep": 5, "best": {"metric": "accuracy", "keep": 2}})
    raw["data"]["test"] = {"source": "synthetic", "shape": [3, 8, 8], "classes": 5,
                           "num_samples": 20, "batch_size": 8}
    raw["net"].append({"type": "accuracy", "name": "accuracy", "bottom": ["fc1", "label"],
                       "top": "accuracy", "phase": "test"})
    raw["solver"].update(max_iter=10, display=3, test_interval=2, test_iter=None,
                         early_stop={"metric": "loss", "patience": 50})
    raw["solver"].update(solver)
    return raw


def init_params(ws, graph, seed):
    for p in graph.params():
        ws.set(p.name, fill(p, seed))



def train_simulated(config, device, iters=3, cuda_graph=False, fuse=False):
    graph, _ = build_train_graph(make_job(config))
    if fuse:
        prepare_for_device(graph, device)
    else:
        place_on_device(graph, device)
    if device < 0:
        d = SerialDispatcher(graph, seed=3)
    else:
        d = make_dispatcher(graph, runtime=SimulatedRuntime(1), seed=3, cuda_graph=cuda_graph)
        assert isinstance(d, StreamDispatcher)
    try:
        init_params(d.workspace, graph, 5)
        losses = []
        for it in range(iters):
            d.workspace["iter"][...] = it
            d.run(it)
            losses.append(float(d.workspace["loss"]))
        params = {p.name: np.array(d.workspace[p.name]) for p in graph.params()}
        return (losses, params) if device < 0 else (losses, params, d.workspace)
    finally:
        d.close()



def run_graph_on_gpu(op_type, attrs, inputs, wrt):
    """tests/opcheck.run_op, but with the graph placed on GPU 0 and run by
    the stream dispatcher."""
    from tests.opcheck import _build
    g, outs, loss_terms, grads, _ = _build(op_type, attrs, inputs, wrt, None, 0)
    place_on_device(g, 0)
    d = make_dispatcher(g, seed=0)
    assert isinstance(d, StreamDispatcher)
    try:
        for name, value in inputs.items():
            d.workspace.set(name, value)
        for k, _, w in loss_terms:
            d.workspace.set(f"lw{k}", w)
        d.run()
        result = {k: backend.to_numpy(d.workspace[o]) for k, o in enumerate(outs)}
        return result, {p: backend.to_numpy(d.workspace[gname]) for p, gname in grads.items()}
    finally:
        d.close()


def one_gpu(seed):
    """A stand-in for ``CudaRuntime`` (the stream dispatcher's): every
    runtime it makes is on one simulated device, made by the first with
    ``seed``, as a trainer's dispatchers (its training and test graphs)
    share GPU 0. (A fresh device each made the second dispatcher's device
    the active one, on which the first one's streams were then made: its
    synchronisations waited for nothing, and the trainer read the device's
    loss window and lr before the iterations had run.)"""
    made = []

    def runtime(*args, **kw):
        rt = SimulatedRuntime(seed, device=made[0].device if made else None)
        made.append(rt)
        return rt
    return runtime


def emulated_trainer_env(monkeypatch, host_build_dir):
    """The trainer's own GPU path on the emulated device: device selection,
    placement and fusion, the device arena, the stream dispatcher on the
    simulated runtime."""
    import purine_mpi.runtime.streams_dispatcher as sd
    use_emulated_cupy(monkeypatch, host_build_dir)
    monkeypatch.setattr(sd, "CudaRuntime", one_gpu(4))


def emulated_gpu_env(monkeypatch, build_dir):
    """CuPy emulated on the host (tests/emulated_gpu) and every
    dispatcher's CUDA runtime simulated: a Trainer with ``device: 0``
    trains on it."""

    import purine_mpi.gpu as gpu
    import purine_mpi.runtime.streams_dispatcher as streams
    use_emulated_cupy(monkeypatch, build_dir)
    monkeypatch.setattr(streams, "CudaRuntime", one_gpu(1))
    monkeypatch.setattr(gpu, "set_tf32", lambda flag: None)


def net_config(net, batch):
    """The config of ``jobs/<net>.yaml`` on ``batch`` samples a batch (four
    batches of data), or the tiny one (``net == "tiny"``)."""
    import os

    from purine_mpi.job.config import load_config
    if net == "tiny":
        return tiny_config()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return load_config(f"{repo}/jobs/{net}.yaml", overrides=[
        f"data.train.batch_size={batch}", f"data.train.num_samples={4 * batch}"],
        check_files=False)


def bf16_gpt_steps(mp, solver, iters, blocks, cuda_graph, elementwise=False, vocab=16):
    """``iters`` training steps of the test GPT (tests/gpt_oracle.gpt_net:
    vocabulary ``vocab`` (16), width 16, 2 heads, ``blocks`` blocks, 8 tokens, batch 2,
    tanh GELU) in bf16 on the emulated device (``mp``: a MonkeyPatch on
    which the caller made the device, ``use_emulated_cupy``, and set its
    environment), the weights filled with seed 1, token batches from seed 3,
    CUDA graphs on with ``cuda_graph``. Counts the kernel launches of each
    step (block kernels and the plain entry points, the bits kernels; with
    ``elementwise`` the elementwise ones too).
    Returns (losses, {param: weights}, [{kernel: launches} of each step]).
    tests/test_bf16_storage.py and benchmarks/bf16_storage.py run it."""
    import collections

    from purine_mpi.base.backend import to_numpy
    from purine_mpi.gpu import kernels
    from tests.gpt_oracle import gpt_graph, gpt_net
    counts = collections.Counter()
    real = kernels.base._launch_blocks

    def spy(source, func, *args):
        counts[func] += 1
        return real(source, func, *args)

    mp.setattr(kernels.base, "_launch_blocks", spy)
    real_elementwise = kernels.base._launch

    def spy_elementwise(source, func, dtype, total, args):
        if elementwise or dtype is None:   # the plain (bits) entry points always
            counts[func] += 1
        return real_elementwise(source, func, dtype, total, args)

    mp.setattr(kernels.base, "_launch", spy_elementwise)
    toks = np.random.default_rng(3).integers(0, vocab, (iters, 2, 9))
    net = gpt_net(vocab=vocab, width=16, heads=2, blocks=blocks, max_length=8, approximate="tanh")
    g, _, _ = gpt_graph(net, dict(solver, max_iter=iters), 2, 8)
    prepare_for_device(g, 0, precision="bf16")
    d = make_dispatcher(g, runtime=SimulatedRuntime(1), seed=1, cuda_graph=cuda_graph)
    steps = []
    try:
        for p in g.params():
            d.workspace.set(p.name, fill(p, 1))
        losses = []
        for it in range(iters):
            d.workspace.set("data", toks[it, :, :-1].astype(np.int32))
            d.workspace.set("label", toks[it, :, 1:].astype(np.int32))
            d.workspace["iter"][...] = it
            before = collections.Counter(counts)
            d.run(it)
            steps.append(counts - before)
            losses.append(float(d.workspace["loss"]))
        weights = {p.name: np.array(to_numpy(d.workspace[p.name])) for p in g.params()}
    finally:
        d.close()
    return losses, weights, steps
