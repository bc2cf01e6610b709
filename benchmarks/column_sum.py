"""GPU micro-benchmark: the column sums of GPT-2 124M's (16384, C) float32
dys (a fully connected layer's bias gradient, a layer norm's dg and db):
cuda/reduce.cu's tiled, split ``sum_rows`` + ``bias_grad_finish``
(``purine_mpi.gpu.kernels.sum_rows``) against the one-thread-per-column
kernel it replaced (its text is below), each ``--reps`` times in one
captured CUDA graph (no Python between the launches), timed with CUDA
events. Checks both against NumPy's float64 sums first. Needs CuPy and a
GPU::

    python benchmarks/column_sum.py [--rows 16384] [--cols 768 2304 3072] [--reps 50]

One line per width: old and new ms per call, old / new, the new kernels'
read rate (rows x cols x 4 bytes per call).
"""
import argparse

import numpy as np

#: the kernel sum_rows was before (one thread per column, rows in order)
OLD = r'''
extern "C" __global__ void sum_rows_old_f32(long long cols, const float* x, long long rows,
                                            float* out) {
  for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < cols;
       j += (long long)blockDim.x * gridDim.x) {
    double sum = 0.0;
    for (long long i = 0; i < rows; ++i) sum += (double)x[i * cols + j];
    out[j] = (float)sum;
  }
}
'''


def graph_ms(cupy, fn, reps):
    """ms per call of ``fn`` (launches on the current stream), ``reps``
    calls captured in one CUDA graph and replayed once under events."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()   # compiles, touches the scratch
        stream.synchronize()
        stream.begin_capture()
        for _ in range(reps):
            fn()
        graph = stream.end_capture()
        graph.launch(stream)   # warm
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / reps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--cols", type=int, nargs="+", default=[768, 2304, 3072])
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    import cupy
    from purine_mpi.gpu import kernels
    old = cupy.RawModule(code=OLD).get_function("sum_rows_old_f32")
    rng = np.random.default_rng(0)
    for cols in args.cols:
        host = rng.standard_normal((args.rows, cols)).astype(np.float32)
        x = cupy.asarray(host)
        out_old, out_new = cupy.empty(cols, np.float32), cupy.empty(cols, np.float32)
        (size,), _ = kernels.bias_grad_scratch(x.shape)
        partial = cupy.empty(size, np.float64)

        def run_old():
            old((-(-cols // 256),), (256,), (np.int64(cols), x, np.int64(args.rows), out_old))

        def run_new():
            kernels.sum_rows(x, out_new, partial=partial)

        run_old()
        run_new()
        want = host.astype(np.float64).sum(axis=0)
        for name, out in (("old", out_old), ("new", out_new)):
            err = np.abs(cupy.asnumpy(out) - want).max() / np.abs(want).max()
            assert err < 1e-6, f"{cols} columns: the {name} kernel is {err:.2e} off NumPy"
        t_old, t_new = graph_ms(cupy, run_old, args.reps), graph_ms(cupy, run_new, args.reps)
        splits = kernels.elementwise.bias_grad_splits(args.rows, cols, 1)
        print(f"({args.rows}, {cols}) float32: old {t_old:.4f} ms, new {t_new:.4f} ms "
              f"({splits} row ranges), old/new {t_old / t_new:.1f}x, new reads "
              f"{args.rows * cols * 4 / t_new / 1e6:.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
