// Gradient clipping by the global L2 norm, on the device (Caffe's
// SGDSolver::ClipGradients; purine_mpi/ops/clip.py, solver.clip_gradients):
//
//   grad_sumsq   partial[s] = scale2 * sum of g[i]^2 over slot s's stripe
//                (slot s of `slots` takes the elements s*B + t + k*slots*B,
//                B = blockDim.x; block-strided over slots, a shared-memory
//                tree in double per slot: no atomics, so one result per run)
//   grad_sumsq_multi  the same for many gradients in one launch (GPT-2 has
//                148: one launch of 32 blocks each kept 32 SMs busy, the
//                largest gradient's stripes one after another): the blocks
//                stride over (gradient, slot) items of a table built once
//                (pointers, sizes, scale2 and the gradient's row of
//                `partial`, largest gradient first so its long stripes
//                start first); each item is grad_sumsq's slot, the same bits
//   clip_total   out[0] = sum of partial[0 .. count) in index order
//                (one thread; the partials of every gradient of the rank)
//   clip_scale   g[i] *= clip / sqrt(sumsq[0]) when sqrt(sumsq[0]) > clip
//                (else g is left as it is, as Caffe; a NaN norm clips nothing)
//   clip_scale_multi  the same for many gradients in one launch (GPT-2 has
//                148, one launch each: 6.0 ms a step on an H200 at main
//                9f37bfe, most gradients small): the blocks stride over items of `chunk`
//                elements of a table built once (pointers, sizes and the
//                first item of each gradient, ascending); an item finds its
//                gradient by a binary search over the firsts (once per
//                item, not per element), its threads load up to
//                PURINE_CLIP_BATCH elements (coalesced, blockDim apart)
//                before they store them scaled. The factor and each
//                product are clip_scale's (purine_clip_factor): the same bits.
//                Each element is read and written once (GPT-2 124M float32:
//                ~1 GB moved, ~30k items of 4,096 elements); when the norm
//                is within the clip every block returns at once
//
// The norm stays on the device between them (and the allreduce of
// the squared norm across stages, when a rank holds only part of the
// parameters): no host round trip inside an iteration.
//
// Compiled at run time by purine_mpi.gpu.load_kernel("clip"); one extern
// "C" entry point per gradient dtype: <name>_f32, <name>_f64.

#include "block_sum.cuh"

#define PURINE_CLIP_THREADS 256

#define PURINE_CLIP_BATCH 16

// Thread threadIdx.x's sum of g[i]^2 over its part of slot s's stripe, in
// increasing i; PURINE_CLIP_BATCH loads issued before their adds (the adds
// in the same order: the bits of one load and add at a time).
template <typename T>
__device__ __forceinline__ double purine_stripe_sumsq(long long n, const T* g, int s,
                                                      int slots) {
  const long long width = (long long)blockDim.x, step = (long long)slots * width;
  double sum = 0.0;
  long long i = (long long)s * width + threadIdx.x;
  for (; i + (PURINE_CLIP_BATCH - 1) * step < n; i += PURINE_CLIP_BATCH * step) {
    T v[PURINE_CLIP_BATCH];
    for (int j = 0; j < PURINE_CLIP_BATCH; ++j) v[j] = g[i + j * step];
    for (int j = 0; j < PURINE_CLIP_BATCH; ++j) {
      const double d = (double)v[j];
      sum += d * d;
    }
  }
  for (; i < n; i += step) {
    const double d = (double)g[i];
    sum += d * d;
  }
  return sum;
}

template <typename T>
__device__ void grad_sumsq_impl(long long n, const T* g, double scale2, int slots,
                                double* partial) {
  __shared__ double part[PURINE_CLIP_THREADS];
  for (int s = blockIdx.x; s < slots; s += gridDim.x) {
    const double total = purine_block_sum(purine_stripe_sumsq<T>(n, g, s, slots), part);
    if (threadIdx.x == 0) partial[s] = scale2 * total;
  }
}

// Item k of count * slots: gradient k / slots of the table (pointers[j],
// sizes[j], scale2[j], its partial sums at rows[j] * slots), slot k % slots.
template <typename T>
__device__ void grad_sumsq_multi_impl(const unsigned long long* pointers, const long long* sizes,
                                      const double* scale2, const long long* rows, int count,
                                      int slots, double* partial) {
  __shared__ double part[PURINE_CLIP_THREADS];
  const long long items = (long long)count * slots;
  for (long long k = blockIdx.x; k < items; k += gridDim.x) {   // the same k in a block
    const long long j = k / slots;
    const int s = (int)(k - j * slots);
    const T* g = (const T*)pointers[j];
    const double total = purine_block_sum(purine_stripe_sumsq<T>(sizes[j], g, s, slots), part);
    if (threadIdx.x == 0) partial[rows[j] * slots + s] = scale2[j] * total;
  }
}

template <typename T>
__device__ void clip_total_impl(const double* partial, long long count, double* out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double sum = 0.0;
  for (long long k = 0; k < count; ++k) sum += partial[k];
  out[0] = sum;
}

// Whether the gradients are scaled (their norm sqrt(sumsq[0]) exceeds
// clip; not for a NaN norm), and by which factor: clip / norm in double.
__device__ __forceinline__ bool purine_clip_factor(const double* sumsq, double clip,
                                                   double* factor) {
  const double norm = sqrt(sumsq[0]);
  if (!(norm > clip)) return false;
  *factor = clip / norm;
  return true;
}

template <typename T>
__device__ void clip_scale_impl(long long n, T* g, const double* sumsq, double clip) {
  double factor;
  if (!purine_clip_factor(sumsq, clip, &factor)) return;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)blockDim.x * gridDim.x) {
    g[i] = (T)((double)g[i] * factor);
  }
}

// Item k of `items`: gradient j (the last with firsts[j] <= k; firsts[0] =
// 0) at pointers[j], its elements [c * chunk, min((c + 1) * chunk,
// sizes[j])), c = k - firsts[j]; each scaled as clip_scale scales it.
template <typename T>
__device__ void clip_scale_multi_impl(const unsigned long long* pointers, const long long* sizes,
                                      const long long* firsts, int count, long long items,
                                      long long chunk, const double* sumsq, double clip) {
  double factor;
  if (!purine_clip_factor(sumsq, clip, &factor)) return;
  const long long width = (long long)blockDim.x;
  for (long long k = blockIdx.x; k < items; k += gridDim.x) {   // the same k in a block
    int lo = 0, hi = count - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (firsts[mid] <= k) lo = mid; else hi = mid - 1;
    }
    T* g = (T*)pointers[lo];
    const long long start = (k - firsts[lo]) * chunk;
    const long long end = start + chunk < sizes[lo] ? start + chunk : sizes[lo];
    for (long long i = start + threadIdx.x; i < end; i += PURINE_CLIP_BATCH * width) {
      T v[PURINE_CLIP_BATCH];
      for (int j = 0; j < PURINE_CLIP_BATCH; ++j) {
        const long long at = i + j * width;
        if (at < end) v[j] = g[at];
      }
      for (int j = 0; j < PURINE_CLIP_BATCH; ++j) {
        const long long at = i + j * width;
        if (at < end) g[at] = (T)((double)v[j] * factor);
      }
    }
  }
}

#define PURINE_CLIP_ENTRY(SUFFIX, T)                                                   \
  extern "C" __global__ void grad_sumsq_##SUFFIX(long long n, const T* g, double scale2,  \
                                                 int slots, double* partial) {         \
    grad_sumsq_impl<T>(n, g, scale2, slots, partial);                                  \
  }                                                                                    \
  extern "C" __global__ void grad_sumsq_multi_##SUFFIX(                                 \
      const unsigned long long* pointers, const long long* sizes, const double* scale2,   \
      const long long* rows, int count, int slots, double* partial) {                     \
    grad_sumsq_multi_impl<T>(pointers, sizes, scale2, rows, count, slots, partial);       \
  }                                                                                    \
  extern "C" __global__ void clip_total_##SUFFIX(const double* partial, long long count, \
                                                 double* out) {                        \
    clip_total_impl<T>(partial, count, out);                                           \
  }                                                                                    \
  extern "C" __global__ void clip_scale_##SUFFIX(long long n, T* g, const double* sumsq,  \
                                                 double clip) {                        \
    clip_scale_impl<T>(n, g, sumsq, clip);                                             \
  }                                                                                    \
  extern "C" __global__ void clip_scale_multi_##SUFFIX(                                 \
      const unsigned long long* pointers, const long long* sizes, const long long* firsts, \
      int count, long long items, long long chunk, const double* sumsq, double clip) {     \
    clip_scale_multi_impl<T>(pointers, sizes, firsts, count, items, chunk, sumsq, clip);  \
  }

PURINE_CLIP_ENTRY(f32, float)
PURINE_CLIP_ENTRY(f64, double)
