// The block-per-row layer-norm kernels as they were before the warp-per-row
// rewrite of cuda/layernorm.cu (commit c52f663's cuda/layernorm.cu, verbatim
// below this note): the baseline of benchmarks/layernorm_kernel_gpu.py, which
// compiles it beside the current file and times both. Not loaded by the
// product.
//
// Layer normalisation over the last axis in one kernel each way
// (purine_mpi/ops/layernorm.py LayerNorm, LayerNormGrad), for x viewed as
// (rows, C), g and b (C,):
//
//   layernorm_forward   mean[r] = sum_c x[r, c] / C
//                       rstd[r] = 1 / sqrt(sum_c (x[r, c] - mean[r])^2 / C + eps)
//                       y[r, c] = (x[r, c] - mean[r]) * rstd[r] * g[c] + b[c]
//   layernorm_backward  xhat = (x - mean) * rstd, dxhat = dy * g,
//                       a[r] = sum_c dxhat / C, k[r] = sum_c dxhat * xhat / C
//                       dx = (dxhat - xhat * k - a) * rstd (where `has_dx`)
//                       and, where `has_dyxhat`, dyxhat = dy * xhat (the
//                       layer's dg is its column sums, db dy's: cuda/reduce.cu)
//
// One block per row (grid-stride over rows). The row's sums are taken in
// double: each thread adds the elements c = tid, tid + B, ... (B =
// blockDim.x), then a shared-memory tree adds the threads' sums in a fixed
// order -- no atomics, so the same bits on every run. The statistics (mean,
// 1 / sqrt(var + eps), the two backward means) are computed in double and
// rounded once to T; the element-wise parts are in T. Reading an element
// and writing its result is done by the same thread after the row's sums,
// so y may be x and dx may be dy or x (in place). Replaces 12 (forward) and
// 15 (backward) launches of element-wise CuPy and per-row reductions.
// Launched with at most PURINE_LN_THREADS threads per block.
//
// layernorm_backward_bdy_f32 reads dy as bfloat16 bits (a data gradient
// stored as bits), widened exactly: the float32 dy's results.
//
// layernorm_backward_copy_f32 and layernorm_backward_bdy_copy_f32 (dy
// float32 or bits) write dx as above and also `copy`, the bits of the
// bfloat16 nearest each float32 dx (uint16: what a Cast of dx to bits
// writes), in the same pass: a dx read as float32 (a residual sum, a bias
// gradient) and as bits by the products (ops/layernorm.py LayerNormGrad
// with bits_copy, parallel/precision.fold_copies). copy is no input's bytes
// but a bits dy's (the memory plan puts it there where dy dies at the op):
// a row's dy is read in the first pass before the block's sums, and the
// thread that writes copy[i] in the second has read dy[i] just before.
//
// layernorm_forward_bits_f32 writes y as bfloat16 bits (uint16: the upper
// halves of precision.cu's round_bf16 of the float32 y, precision.cuh), for a
// y stored as bits (purine_mpi/parallel/precision.store_bits): the bits a
// float32 run followed by to_bf16_bits gives, in the same pass.
//
// Compiled at run time by purine_mpi.gpu.load_kernel("layernorm"); one
// extern "C" entry point per dtype: <name>_f32, <name>_f64.

#define PURINE_LN_THREADS 256

#include "block_sum.cuh"
#include "precision.cuh"

// y's element: T itself, or (float32 into uint16) the bfloat16 bits
template <typename T>
__device__ __forceinline__ void purine_ln_store(T* y, T v) { *y = v; }

__device__ __forceinline__ void purine_ln_store(unsigned short* y, float v) {
  *y = (unsigned short)(purine_round_bf16(purine_float_bits(v)) >> 16);
}

template <typename T, typename Y>
__device__ void layernorm_forward_impl(long long rows, long long cols, const T* x, const T* g,
                                       const T* b, double eps, Y* y, T* mean, T* rstd) {
  __shared__ double shared[PURINE_LN_THREADS];
  const unsigned int tid = threadIdx.x;
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    Y* yr = y + r * cols;
    double s = 0.0;
    for (long long c = tid; c < cols; c += blockDim.x) s += (double)xr[c];
    const T mu = (T)(purine_block_sum(s, shared) / (double)cols);
    double q = 0.0;
    for (long long c = tid; c < cols; c += blockDim.x) {
      const double d = (double)(T)(xr[c] - mu);
      q += d * d;
    }
    const T rs = (T)(1.0 / sqrt(purine_block_sum(q, shared) / (double)cols + eps));
    for (long long c = tid; c < cols; c += blockDim.x) {
      purine_ln_store(yr + c, (T)((T)((T)((T)(xr[c] - mu) * rs) * g[c]) + b[c]));
    }
    if (tid == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

// D: dy's storage (T, or bfloat16 bits for T float: layernorm_backward_bdy_f32)
// COPY (T float, has_dx): also dx's bfloat16 bits into `copy`
template <typename T, typename D, bool COPY = false>
__device__ void layernorm_backward_impl(long long rows, long long cols, const D* dy,
                                        const T* x, const T* g, const T* mean, const T* rstd,
                                        T* dx, int has_dx, T* dyxhat, int has_dyxhat,
                                        unsigned short* copy = nullptr) {
  __shared__ double shared[PURINE_LN_THREADS];
  const unsigned int tid = threadIdx.x;
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    const long long at = r * cols;
    const T mu = mean[r], rs = rstd[r];
    double sa = 0.0, sk = 0.0;
    for (long long c = tid; c < cols; c += blockDim.x) {
      const T xhat = (T)(x[at + c] - mu) * rs;
      const T d = purine_load(dy, at + c);
      const T dxhat = d * g[c];
      sa += (double)dxhat;
      sk += (double)dxhat * (double)xhat;
      if (has_dyxhat) dyxhat[at + c] = d * xhat;
    }
    if (!has_dx) continue;  // uniform over the block: no thread waits at a barrier alone
    const T a = (T)(purine_block_sum(sa, shared) / (double)cols);
    const T k = (T)(purine_block_sum(sk, shared) / (double)cols);
    for (long long c = tid; c < cols; c += blockDim.x) {
      const T xhat = (T)(x[at + c] - mu) * rs;
      const T dxhat = purine_load(dy, at + c) * g[c];
      const T v = (T)((T)(dxhat - (T)(xhat * k)) - a) * rs;
      dx[at + c] = v;
      if (COPY) purine_ln_store(copy + at + c, v);
    }
  }
}

#define PURINE_LN_FORWARD_ENTRY(SUFFIX, T)                                                 \
  extern "C" __global__ void layernorm_forward_##SUFFIX(                                   \
      long long rows, long long cols, const T* x, const T* g, const T* b, double eps,      \
      T* y, T* mean, T* rstd) {                                                            \
    layernorm_forward_impl<T>(rows, cols, x, g, b, eps, y, mean, rstd);                    \
  }

#define PURINE_LN_BACKWARD_ENTRY(SUFFIX, T)                                                \
  extern "C" __global__ void layernorm_backward_##SUFFIX(                                  \
      long long rows, long long cols, const T* dy, const T* x, const T* g, const T* mean,  \
      const T* rstd, T* dx, int has_dx, T* dyxhat, int has_dyxhat) {                       \
    layernorm_backward_impl<T, T>(rows, cols, dy, x, g, mean, rstd, dx, has_dx, dyxhat,    \
                                  has_dyxhat);                                             \
  }

PURINE_LN_FORWARD_ENTRY(f32, float)
extern "C" __global__ void layernorm_forward_bits_f32(long long rows, long long cols,
                                                      const float* x, const float* g,
                                                      const float* b, double eps,
                                                      unsigned short* y, float* mean,
                                                      float* rstd) {
  layernorm_forward_impl<float, unsigned short>(rows, cols, x, g, b, eps, y, mean, rstd);
}
PURINE_LN_FORWARD_ENTRY(f64, double)
PURINE_LN_BACKWARD_ENTRY(f32, float)
PURINE_LN_BACKWARD_ENTRY(f64, double)

// dy as bfloat16 bits (a data gradient stored as bits, bf16 storage), the
// rest float32: the float32 dy's dx and dyxhat bit for bit
extern "C" __global__ void layernorm_backward_bdy_f32(long long rows, long long cols,
                                                      const unsigned short* dy, const float* x,
                                                      const float* g, const float* mean,
                                                      const float* rstd, float* dx, int has_dx,
                                                      float* dyxhat, int has_dyxhat) {
  layernorm_backward_impl<float, unsigned short>(rows, cols, dy, x, g, mean, rstd, dx, has_dx,
                                                 dyxhat, has_dyxhat);
}

// dx and its bfloat16 bits in one pass (dy float32, or bits: _bdy_), dyxhat
// as above: a dx read as float32 and, as bits, by the products
extern "C" __global__ void layernorm_backward_copy_f32(long long rows, long long cols,
                                                       const float* dy, const float* x,
                                                       const float* g, const float* mean,
                                                       const float* rstd, float* dx,
                                                       float* dyxhat, int has_dyxhat,
                                                       unsigned short* copy) {
  layernorm_backward_impl<float, float, true>(rows, cols, dy, x, g, mean, rstd, dx, 1, dyxhat,
                                              has_dyxhat, copy);
}

extern "C" __global__ void layernorm_backward_bdy_copy_f32(long long rows, long long cols,
                                                           const unsigned short* dy,
                                                           const float* x, const float* g,
                                                           const float* mean, const float* rstd,
                                                           float* dx, float* dyxhat,
                                                           int has_dyxhat, unsigned short* copy) {
  layernorm_backward_impl<float, unsigned short, true>(rows, cols, dy, x, g, mean, rstd, dx, 1,
                                                       dyxhat, has_dyxhat, copy);
}
