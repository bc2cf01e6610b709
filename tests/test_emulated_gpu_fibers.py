"""The emulated device's kernels with barriers (``__syncthreads``, the warp
shuffle): the threads of a block run as fibers on the launching host thread,
one ctypes call per launch (tests/emulated_gpu/host_kernels.py), instead of
one host thread per CUDA thread (the former way, still there with
PURINE_EMU_THREADED=1). Same grid, same barrier, same numbers."""
import ctypes
import pathlib
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from purine_mpi.gpu import kernel_source
from tests.emulated_gpu.host_kernels import THREADED_ENV, host_cupy

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A row sum with a warp-shuffle tree, then the warps' sums through shared
# memory; `lanes` keeps each thread's shuffled value of the first step.
SHUFFLING = r'''
template <typename T> __device__ T warp_sum(T v, T* first, long long at) {
  for (unsigned int d = 16; d > 0; d >>= 1) {
    v += __shfl_down_sync(0xffffffffu, v, d);
    if (d == 16) first[at] = v;
  }
  return v;
}
template <typename T>
__device__ void row_sums_impl(long long rows, long long cols, const T* x, T* first, T* out) {
  __shared__ T warps[32];
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    T s = 0;
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) s += x[r * cols + j] * x[r * cols + j];
    s = warp_sum(s, first, r * blockDim.x + threadIdx.x);
    if ((threadIdx.x & 31u) == 0) warps[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
      T t = 0;
      for (unsigned int w = 0; w < blockDim.x / 32; ++w) t += warps[w];
      out[r] = sqrt(t);
    }
    __syncthreads();
  }
}
extern "C" __global__ void row_sums_f32(long long rows, long long cols, const float* x,
                                        float* first, float* out) {
  row_sums_impl<float>(rows, cols, x, first, out);
}
extern "C" __global__ void row_sums_f64(long long rows, long long cols, const double* x,
                                        double* first, double* out) {
  row_sums_impl<double>(rows, cols, x, first, out);
}
'''


def _run_all(build_dir):
    """The shuffling kernel (both dtypes) and reduce.cu's block reductions
    (__syncthreads, the small block) on fixed inputs: every output array,
    the kernels launched (to see which path each took), the inputs."""
    cupy = host_cupy(build_dir)
    rng = np.random.default_rng(11)
    outputs, launched, inputs = [], [], []
    shuffling = cupy.RawModule(code=SHUFFLING)
    for dtype, suffix in ((np.float32, "f32"), (np.float64, "f64")):
        kernel = shuffling.get_function(f"row_sums_{suffix}")
        x = rng.standard_normal((7, 150)).astype(dtype)
        first, out = np.zeros(7 * 64, dtype), np.zeros(7, dtype)
        kernel((2,), (64,), (np.int64(7), np.int64(150), x, first, out))
        outputs += [first, out]
        launched.append(kernel)
        inputs.append(x)
    reduce = cupy.RawModule(code=kernel_source("reduce"))
    dy = rng.standard_normal((5, 6, 9)).astype(np.float32)
    kernel = reduce.get_function("channel_sum_f32")
    out = np.zeros(6, np.float32)
    kernel((2,), (256,), (np.int64(6), dy, np.int64(5), np.int64(9), out))
    outputs.append(out)
    launched.append(kernel)
    inputs.append(dy)
    kernel = reduce.get_function("bias_grad_f64")
    dy64, partial, db = dy.astype(np.float64), np.zeros(6 * 3), np.zeros(6)   # db: unset
    kernel((2,), (256,), (np.int64(6), dy64, np.int64(5), np.int64(9), np.int64(3), partial, db))
    outputs += [partial, db]
    launched.append(kernel)
    return outputs, launched, inputs


def test_fibers_and_host_threads_give_the_same_bits(host_build_dir, monkeypatch):
    monkeypatch.delenv(THREADED_ENV, raising=False)
    fibers, fiber_kernels, inputs = _run_all(host_build_dir)
    monkeypatch.setenv(THREADED_ENV, "1")
    threads, thread_kernels, _ = _run_all(host_build_dir)
    assert all(k._fiber_grid is not None for k in fiber_kernels)
    assert all(k._fiber_grid is None and k.threaded for k in thread_kernels)
    assert [k.threads for k in fiber_kernels] == [64, 64, 3, 3]   # the same grids
    for i, (a, b) in enumerate(zip(fibers, threads)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}")), i
    # and the numbers are the sums they stand for
    x32, x64, dy = inputs
    np.testing.assert_allclose(fibers[1], np.sqrt((x32 * x32).sum(axis=1)), rtol=1e-5)
    np.testing.assert_allclose(fibers[3], np.sqrt((x64 * x64).sum(axis=1)), rtol=1e-12)
    np.testing.assert_allclose(fibers[4], dy.sum(axis=(0, 2)), rtol=1e-6)
    np.testing.assert_allclose(fibers[5].reshape(6, 3).sum(axis=1),
                               dy.astype(np.float64).sum(axis=(0, 2)),
                               rtol=1e-12)   # 3 splits: the partial sums


def test_a_launch_with_barriers_is_one_call_on_the_launching_thread(host_build_dir,
                                                                    monkeypatch):
    """No host thread per CUDA thread (they made an emulated GPT iteration
    cost ~10 CPU-seconds), and two host threads may launch at once: each
    launch's barrier and __shared__ memory are its own thread's."""
    monkeypatch.delenv(THREADED_ENV, raising=False)
    reduce = host_cupy(host_build_dir).RawModule(
        code=kernel_source("reduce"))
    kernel = reduce.get_function("channel_sum_f64")
    rng = np.random.default_rng(5)
    dys = [rng.standard_normal((4, 40, 6)) for _ in range(2)]
    outs = [np.zeros(40) for _ in dys]
    started = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start",
                        lambda self: (started.append(self), real_start(self)))
    kernel((2,), (256,), (np.int64(40), dys[0], np.int64(4), np.int64(6), outs[0]))
    assert started == []

    def launch(i):
        for _ in range(30):
            kernel((2,), (256,), (np.int64(40), dys[i], np.int64(4), np.int64(6), outs[i]))
    host = [threading.Thread(target=launch, args=(i,)) for i in range(2)]
    for t in host:
        t.start()
    for t in host:
        t.join(120)
    assert len(started) == 2    # only the test's own two
    for dy, out in zip(dys, outs):
        np.testing.assert_allclose(out, dy.sum(axis=(0, 2)), rtol=1e-13)



def test_a_barrier_switches_fibers_without_a_system_call(host_build_dir, monkeypatch):
    """A fiber is entered once through its ucontext (setcontext restores the
    signal mask: a system call, 1.6 us here) and switched at each barrier by
    _setjmp/_longjmp. With swapcontext at every barrier, the row means of a
    gpt_tiny layer norm (channel_sum over 4096 rows of 128: 4 barriers a
    row, 3 switches each in a block of 3) cost 17 ms a launch, a third of a
    bf16 iteration's kernels on the emulated device; now 5 ms. The entries
    are one per thread of each block, however many barriers the launch
    passes, and the sums are right."""
    monkeypatch.delenv(THREADED_ENV, raising=False)
    reduce = host_cupy(host_build_dir).RawModule(
        code=kernel_source("reduce"))
    entries = reduce._library.purine_emu_fiber_entries
    entries.restype = ctypes.c_ulonglong
    kernel = reduce.get_function("channel_sum_f64")
    for rows in (1, 2, 500):   # 1 row: one block has no row, its threads return at once
        x = np.random.default_rng(rows).standard_normal((1, rows, 7))
        out = np.zeros(rows)
        before = entries()
        kernel((2,), (256,), (np.int64(rows), x, np.int64(1), np.int64(7), out))
        assert entries() - before == 2 * kernel.threads, rows   # 2 blocks
        np.testing.assert_allclose(out, x.sum(axis=(0, 2)), rtol=1e-13)


EARLY_RETURN = r'''
extern "C" __global__ void early(double* out) {
  if (threadIdx.x == 1) return;   // the others then wait at the barrier
  out[threadIdx.x] = 1.0;
  __syncthreads();
}
'''


def test_a_thread_returning_while_the_others_wait_at_a_barrier_aborts(tmp_path):
    """The barrier counts every thread of the block (as the threaded
    emulation's did: there the launch hung for ever); with fibers the
    deadlock is seen at once: a message and abort()."""
    script = (f"import numpy as np, pathlib\n"
              f"from tests.emulated_gpu.host_kernels import host_cupy\n"
              f"k = host_cupy(pathlib.Path({str(tmp_path)!r})).RawModule(code={EARLY_RETURN!r})"
              f".get_function('early')\n"
              f"k((2,), (3,), (np.zeros(8),))\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != THREADED_ENV}
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == -signal.SIGABRT, res.stderr
    assert ("block 0: 2 of its 3 threads wait at __syncthreads, the others have returned: "
            "the barrier never opens") in res.stderr


XOR = r'''
extern "C" __global__ void xor_lanes(long long n, const double* x, double* out) {
  // every lane the value of lane ^ m, for m = 1, 5, 16 (the warp's own lanes)
  const unsigned int t = threadIdx.x;
  out[0 * n + t] = __shfl_xor_sync(0xffffffffu, x[t], 1);
  out[1 * n + t] = __shfl_xor_sync(0xffffffffu, x[t], 5);
  out[2 * n + t] = __shfl_xor_sync(0xffffffffu, x[t], 16);
}
'''


def test_the_xor_shuffle_swaps_the_lanes_of_each_warp(host_build_dir):
    """``__shfl_xor_sync`` (cuda/layernorm.cu's butterfly): lane l gets lane
    l ^ m's value, within its warp, in a block of two warps."""
    cupy = host_cupy(host_build_dir)
    kernel = cupy.RawModule(code=XOR).get_function("xor_lanes")
    x = np.arange(64, dtype=np.float64) * 1.5
    out = np.zeros(3 * 64)
    kernel((1,), (64,), (np.int64(64), x, out))
    lanes = np.arange(64)
    for row, m in enumerate((1, 5, 16)):
        np.testing.assert_array_equal(out[row * 64:(row + 1) * 64], x[lanes ^ m], err_msg=m)


@pytest.mark.parametrize("threads", [48, 31, 2048])
def test_a_shuffling_kernel_on_a_block_of_partial_warps_is_refused(host_build_dir, threads):
    """The emulator runs a kernel with warp shuffles as two whole warps,
    whatever block the launch asks; a block that is not whole warps (a
    partial last warp: full-mask shuffles undefined on a GPU) is an error
    here, naming the kernel, rather than a run a GPU would not give."""
    cupy = host_cupy(host_build_dir)
    kernel = cupy.RawModule(code=XOR).get_function("xor_lanes")
    x, out = np.zeros(64), np.zeros(3 * 64)
    with pytest.raises(ValueError, match=f"xor_lanes: .* {threads} threads a block"):
        kernel((1,), (threads,), (np.int64(64), x, out))
