// Gradient clipping by the global L2 norm, on the device (Caffe's
// SGDSolver::ClipGradients; purine_mpi/ops/clip.py, solver.clip_gradients):
//
//   grad_sumsq   partial[s] = scale2 * sum of g[i]^2 over slot s's stripe
//                (slot s of `slots` takes the elements s*B + t + k*slots*B,
//                B = blockDim.x; block-strided over slots, a shared-memory
//                tree in double per slot: no atomics, so one result per run)
//   clip_total   out[0] = sum of partial[0 .. count) in index order
//                (one thread; the partials of every gradient of the rank)
//   clip_scale   g[i] *= clip / sqrt(sumsq[0]) when sqrt(sumsq[0]) > clip
//                (else g is left as it is, as Caffe; a NaN norm clips nothing)
//
// The norm stays on the device between the three (and the allreduce of
// the squared norm across stages, when a rank holds only part of the
// parameters): no host round trip inside an iteration.
//
// Compiled at run time by purine_mpi.gpu.load_kernel("clip"); one extern
// "C" entry point per gradient dtype: <name>_f32, <name>_f64.

#include "block_sum.cuh"

#define PURINE_CLIP_THREADS 256

template <typename T>
__device__ void grad_sumsq_impl(long long n, const T* g, double scale2, int slots,
                                double* partial) {
  __shared__ double part[PURINE_CLIP_THREADS];
  const unsigned int tid = threadIdx.x;
  const long long width = (long long)blockDim.x;
  for (int s = blockIdx.x; s < slots; s += gridDim.x) {
    double sum = 0.0;
    for (long long i = (long long)s * width + tid; i < n; i += (long long)slots * width) {
      const double v = (double)g[i];
      sum += v * v;
    }
    const double total = purine_block_sum(sum, part);
    if (tid == 0) partial[s] = scale2 * total;
  }
}

template <typename T>
__device__ void clip_total_impl(const double* partial, long long count, double* out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double sum = 0.0;
  for (long long k = 0; k < count; ++k) sum += partial[k];
  out[0] = sum;
}

template <typename T>
__device__ void clip_scale_impl(long long n, T* g, const double* sumsq, double clip) {
  const double norm = sqrt(sumsq[0]);
  if (!(norm > clip)) return;
  const double factor = clip / norm;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)blockDim.x * gridDim.x) {
    g[i] = (T)((double)g[i] * factor);
  }
}

#define PURINE_CLIP_ENTRY(SUFFIX, T)                                                   \
  extern "C" __global__ void grad_sumsq_##SUFFIX(long long n, const T* g, double scale2,  \
                                                 int slots, double* partial) {         \
    grad_sumsq_impl<T>(n, g, scale2, slots, partial);                                  \
  }                                                                                    \
  extern "C" __global__ void clip_total_##SUFFIX(const double* partial, long long count, \
                                                 double* out) {                        \
    clip_total_impl<T>(partial, count, out);                                           \
  }                                                                                    \
  extern "C" __global__ void clip_scale_##SUFFIX(long long n, T* g, const double* sumsq,  \
                                                 double clip) {                        \
    clip_scale_impl<T>(n, g, sumsq, clip);                                             \
  }

PURINE_CLIP_ENTRY(f32, float)
PURINE_CLIP_ENTRY(f64, double)
