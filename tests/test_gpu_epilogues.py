"""The kernels PyTorch's GPU time beat us on (issue 35 item 7), against the
CPU reference: the bias-gradient reduction (cuda/reduce.cu ``bias_grad``:
one block per channel, coalesced loads, warp-shuffle trees) on the
host-compiled kernels (g++, the warp shuffle modelled lane by lane by the
host stand-in of tests/emulated_gpu/host_kernels.py) and on a GPU when there is one."""
import numpy as np
import pytest

from purine_mpi.gpu import kernels

BIAS_SHAPES = [
    (5, 6, 3, 4),      # inner 12: runs shorter than a warp, samples interleave in a step
    (3, 4, 8, 8),      # inner 64: one sample per step of the emulated 64-thread block
    (2, 3, 11, 13),    # inner 143: a step ends mid-run
    (1, 7, 1, 100),    # one sample, channels > emulated blocks: the grid-stride loop
    (4, 3, 2, 1),      # inner 2
    (6, 5),            # a fully connected layer: one thread per column (sum_rows)
    (4, 3, 1, 1),      # a 1x1 output: inner 1, as a fully connected layer
]


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
