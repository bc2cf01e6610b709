"""The kernels PyTorch's GPU time beat us on (issue 35 item 7), against the
CPU reference: the bias-gradient reduction (cuda/reduce.cu ``bias_grad``:
each channel cut into sample ranges, a block per range, coalesced loads,
fixed-order trees, then ``bias_grad_finish``) on the host-compiled kernels
(g++, tests/emulated_gpu/host_kernels.py) and on a GPU when there is one."""
import numpy as np
import pytest

from purine_mpi.gpu import kernels

BIAS_SHAPES = [
    (5, 6, 3, 4),      # inner 12: runs shorter than a warp, samples interleave in a step
    (3, 4, 8, 8),      # inner 64: one sample per step of the emulated 64-thread block
    (2, 3, 11, 13),    # inner 143: a step ends mid-run
    (1, 7, 1, 100),    # one sample, channels > emulated blocks: the grid-stride loop
    (4, 3, 2, 1),      # inner 2
    (6, 5),            # a fully connected layer: a column sum (sum_rows)
    (4, 3, 1, 1),      # a 1x1 output: inner 1, as a fully connected layer
    (8, 3, 32, 32),    # 2 sample ranges a channel: partial sums, then bias_grad_finish
    (9, 2, 30, 31),    # 2 ranges of 4 and 5 samples
    (16, 2, 32, 32),   # 4 ranges
]


def test_the_splits_depend_on_the_shape_alone():
    """About BIAS_GRAD_BLOCKS blocks, none under BIAS_GRAD_MIN_ELEMENTS
    elements, at most a range per sample (cifar10_quick's conv1 at batch
    128: 32 channels x 32 ranges of 4 samples)."""
    from purine_mpi.gpu.kernels.elementwise import bias_grad_splits
    assert bias_grad_splits(128, 32, 32 * 32) == 32
    assert bias_grad_splits(512, 32, 32 * 32) == 32
    assert bias_grad_splits(128, 192, 32 * 32) == 5
    assert bias_grad_splits(5, 6, 12) == 1
    assert bias_grad_splits(3, 2000, 4096) == 1
    assert bias_grad_splits(2, 1, 1 << 20) == 2     # never more ranges than samples


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", BIAS_SHAPES)
def test_bias_grad_matches_the_cpu_reference(backend, shape, dtype):
    rng = np.random.default_rng(sum(shape))
    dy = rng.standard_normal(shape).astype(dtype)
    want = dy.astype(np.float64).sum(axis=tuple(i for i in range(dy.ndim) if i != 1))
    got = kernels.bias_grad(backend.to_device(dy))
    assert got.dtype == dtype and got.shape == (shape[1],)
    got = backend.to_host(got)
    # summed in double on the device: float32 is the reference rounded once
    if dtype == np.float32:
        np.testing.assert_array_equal(got, want.astype(np.float32))
    else:
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
    out = backend.to_device(np.full(shape[1], 7, dtype))
    kernels.bias_grad(backend.to_device(dy), out=out)       # into a given buffer, twice:
    np.testing.assert_array_equal(backend.to_host(out), got)   # the same bits each run


def test_bias_grad_in_the_ops_matches_numpy_and_keeps_the_cpu_results(backend):
    """ConvGradBias and InnerProductGradBias take it on a device; their CPU
    branch is the reference (tests/test_gpu_backend.py compares op by op)."""
    from purine_mpi.ops.catalog import get_kernel_class
    dy = np.random.default_rng(3).standard_normal((4, 6, 5, 5))
    for op_type, x in (("ConvGradBias", dy), ("InnerProductGradBias", dy.reshape(4, 150))):
        cls = get_kernel_class(op_type, "b")
        assert "bias_grad" in cls.run.__code__.co_names, op_type
        want = x.sum(axis=0) if x.ndim == 2 else x.sum(axis=(0, 2, 3))
        got = backend.to_host(kernels.bias_grad(backend.to_device(x)))
        np.testing.assert_allclose(got, want, rtol=1e-13)


def test_the_host_warp_shuffle_reads_no_lane_past_the_block(backend, host_build_dir):
    """The stand-in follows CUDA: lane l of each warp reads lane l + delta of
    the same warp, and a source past lane 31 gives the lane its own value."""
    if backend.name != "host":
        pytest.skip("the host stand-in only")
    import sys
    cupy = sys.modules["cupy"]
    code = r'''
extern "C" __global__ void shfl_probe(double* out) {
  double v = (double)threadIdx.x;
  out[blockIdx.x * blockDim.x + threadIdx.x] = __shfl_down_sync(0xffffffffu, v, 16);
  __syncthreads();
}'''
    kernel = cupy.RawModule(code=code).get_function("shfl_probe")
    out = np.zeros(2 * 64)
    kernel((2,), (64,), (out,))
    lanes = out[:64]
    assert list(lanes[:16]) == list(range(16, 32))      # lane l reads lane l + 16
    assert list(lanes[16:32]) == list(range(16, 32))    # l + 16 past the warp: its own
    assert list(lanes[32:48]) == list(range(48, 64))    # the second warp likewise
    np.testing.assert_array_equal(out[64:], lanes)      # the second block


# ------------------------------------------- dgrad + drelu (cuDNN and im2col)
import json  # noqa: E402
import sys  # noqa: E402

from purine_mpi.gpu import cudnn as gpu_cudnn  # noqa: E402
from purine_mpi.gpu import cudnn_tune as tune  # noqa: E402
from tests import test_cudnn_path as cudnn_tests  # noqa: E402
from tests.emulated_gpu.cudnn import FakeCudnn  # noqa: E402
from tests.emulated_gpu import run_kernel  # noqa: E402

device = cudnn_tests.device   # here: the emulated CuPy with the cuDNN stand-in's clock


def _masked_dgrad(attrs, slope, seed=0):
    """ConvGradData with the ReLU mask fused (on the device) and the CPU
    reference: ConvGradData, then ReluGrad."""
    rng = np.random.default_rng(seed)
    x_shape, w = (2, 3, 7, 6), rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    y = run_kernel("Conv", attrs, [np.zeros(x_shape, np.float32), w])[0]
    dy = rng.standard_normal(y.shape).astype(np.float32)
    mask = rng.standard_normal(x_shape).astype(np.float32)   # the layer below's output
    dattrs = dict(attrs, x_shape=list(x_shape))
    dx = run_kernel("ConvGradData", dattrs, [dy, w])[0]
    want = run_kernel("ReluGrad", {"negative_slope": slope}, [dx, mask])[0]
    got = run_kernel("ConvGradData", dict(dattrs, mask_slope=slope), [dy, w, mask],
                     cudnn_tests._dev)[0]
    return got, want


@pytest.mark.parametrize("slope", [0.0, 0.1])
def test_dgrad_with_the_relu_mask_in_one_cudnn_graph_cold_then_warm(device, monkeypatch, slope):
    attrs = {"stride": 2, "pad": 1}
    cold = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", cold)
    got, want = _masked_dgrad(attrs, slope)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert [[k for k, _ in g.ops] for g in cold.graphs] == [["conv_dgrad", "relu_backward"]]
    assert tune.stats()["timed"] == 1 and tune.stats()["cached"] == 0   # cold: timed
    doc = json.loads(open(tune.cache_path(cudnn_tests.GPU_NAME, cold.version)).read())
    assert len(doc["plans"]) == 1
    # a new process, the plan cache warm: the fused plan comes from the file
    gpu_cudnn.reset()
    tune.reset()
    warm = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", warm)
    got_warm, _ = _masked_dgrad(attrs, slope)
    np.testing.assert_array_equal(got_warm, got)
    assert tune.stats()["timed"] == 0 and tune.stats()["cached"] == 1
    assert [[k for k, _ in g.ops] for g in warm.graphs] == [["conv_dgrad", "relu_backward"]]


def test_without_a_fused_plan_the_mask_is_one_kernel_after_dgrad(device, monkeypatch):
    fake = FakeCudnn(unsupported={"relu_backward"})
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    got, want = _masked_dgrad({"pad": 1}, 0.0, seed=3)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    kinds = [[k for k, _ in g.ops] for g in fake.graphs]
    assert kinds == [["conv_dgrad", "relu_backward"], ["conv_dgrad"]]   # fused refused
    monkeypatch.setenv("PURINE_CONV", "im2col")   # the im2col path: the same kernel after
    gpu_cudnn.reset()
    got, want = _masked_dgrad({"pad": 1}, 0.0, seed=3)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_the_graph_fuses_relu_grad_into_the_data_gradient_and_trains_like_the_cpu(
        host_build_dir, monkeypatch):
    from purine_mpi.job.replica import build_train_graph
    from purine_mpi.parallel.fuse import fuse_for_device
    from purine_mpi.parallel.placement import place_on_device
    from tests.conftest import make_job
    from tests.emulated_gpu import tiny_raw, train_simulated, use_emulated_cupy
    from purine_mpi.job.config import validate_config
    raw = tiny_raw()
    raw["net"] = [
        {"type": "conv", "name": "conv1", "bottom": "data", "top": "conv1", "num_output": 4,
         "kernel": 3, "pad": 1, "weight_filler": {"type": "gaussian", "std": 0.2}},
        {"type": "relu", "name": "relu1", "bottom": "conv1", "top": "conv1"},
        {"type": "conv", "name": "conv2", "bottom": "conv1", "top": "conv2", "num_output": 5,
         "kernel": 3, "stride": 2, "pad": 1,
         "weight_filler": {"type": "gaussian", "std": 0.2}},
        {"type": "relu", "name": "relu2", "bottom": "conv2", "top": "conv2"},
        {"type": "fc", "name": "fc1", "bottom": "conv2", "top": "fc1", "num_output": 5,
         "weight_filler": {"type": "gaussian", "std": 0.1}},
        {"type": "softmax_loss", "name": "loss", "bottom": ["fc1", "label"], "top": "loss"}]
    raw["data"]["train"].pop("shuffle", None)
    config = validate_config(raw, check_files=False)
    graph, _ = build_train_graph(make_job(config))
    place_on_device(graph, -1)
    fuse_for_device(graph)
    (dgrad,) = [op for op in graph.ops.values() if op.op_type == "ConvGradData"]
    assert len(dgrad.inputs) == 3 and dgrad.inputs[2] == "conv1@relu1"   # relu1's output
    relu_grads = [op.name for op in graph.ops.values() if op.op_type == "ReluGrad"]
    assert relu_grads == ["relu2.bwd.relu_grad"]   # after the fc's data gradient: stays
    cpu_losses, cpu_params = train_simulated(config, -1, iters=3)
    use_emulated_cupy(monkeypatch, host_build_dir)
    losses, params, _ = train_simulated(config, 0, iters=3, fuse=True)
    np.testing.assert_allclose(losses, cpu_losses, rtol=1e-5)
    for name, value in cpu_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=1e-6)
