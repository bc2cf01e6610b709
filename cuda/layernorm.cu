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
// One warp per row: a block of B threads (a multiple of 32) takes B / 32
// consecutive rows at a time, grid-stride over groups of rows (every warp
// of the block runs the same number of groups, a warp past the last row with
// an empty row: its shuffles meet its block's, it writes nothing). The row's
// sums are taken in double: each lane adds its elements (chunks of four at
// c = 4 lane, 4 lane + 128, ... where the row can be read 16 bytes at a
// time, see below; else c = lane, lane + 32, ...) in order, then a
// butterfly of warp shuffles (xor 16, 8, 4, 2, 1) adds the lanes' sums,
// no shared memory, no barrier, no atomics: the same bits on every run and
// in every lane (a + b == b + a in IEEE arithmetic). The statistics (mean,
// 1 / sqrt(var + eps), the two backward means) are computed in double and
// rounded once to T; the element-wise parts are in T, the same expressions
// as before this layout (a block per row, a shared-memory tree), so only
// the order of the double sums changed. Reading an element and writing its
// result is done by the same lane after the row's sums, so y may be x and dx
// may be dy or x (in place). Why: a block of 256 threads per 768-wide row
// took three elements a thread between two 8-level shared-memory trees with
// 10 barriers each -- latency-bound, 134 us a launch at 16384 x 768 on an
// H200 against a 16 us traffic bound (docs/gpu.md).
//
// Vectorised: for float32 x where cols % 4 == 0 and every row array (x, g, b,
// y, dy, dx, dyxhat, copy) is 16-byte aligned (8 for bfloat16 bits), a lane
// moves four elements a load/store (uint4, or uint2 of bits); otherwise (odd
// widths, float64, an offset view) one element at a time. Same arithmetic
// either way. Launched with PURINE_LN_THREADS threads per block.
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
// a row's dy is read in the first pass before the warp's sums, and the
// lane that writes copy[i] in the second has read dy[i] just before.
//
// layernorm_forward_bits_f32 writes y as bfloat16 bits (uint16: the upper
// halves of precision.cu's round_bf16 of the float32 y, precision.cuh), for a
// y stored as bits (purine_mpi/parallel/precision.store_bits): the bits a
// float32 run followed by to_bf16_bits gives, in the same pass.
//
// Compiled at run time by purine_mpi.gpu.load_kernel("layernorm"); one
// extern "C" entry point per dtype: <name>_f32, <name>_f64.

#define PURINE_LN_THREADS 256

#include "precision.cuh"

// y's element: T itself, or (float32 into uint16) the bfloat16 bits
template <typename T>
__device__ __forceinline__ void purine_ln_store(T* y, T v) { *y = v; }

__device__ __forceinline__ void purine_ln_store(unsigned short* y, float v) {
  *y = (unsigned short)(purine_round_bf16(purine_float_bits(v)) >> 16);
}

// The sum of every lane's v over the warp, the same bits in every lane.
__device__ __forceinline__ double purine_ln_warp_sum(double v) {
  for (int mask = 16; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask);
  return v;
}

// Whether an array can be moved four elements at a time: float32 16-byte
// aligned, bfloat16 bits 8-byte aligned; float64 never (scalar path).
template <typename T>
__device__ __forceinline__ bool purine_ln_vec_ok(const T*) { return false; }
__device__ __forceinline__ bool purine_ln_vec_ok(const float* p) {
  return ((unsigned long long)p & 15ull) == 0ull;
}
__device__ __forceinline__ bool purine_ln_vec_ok(const unsigned short* p) {
  return ((unsigned long long)p & 7ull) == 0ull;
}

// W elements of p from i on (W 4: one 16-byte / 8-byte load, i % 4 == 0,
// the array checked by purine_ln_vec_ok; W 1: p[i], bits widened exactly).
template <int W, typename T, typename V>
__device__ __forceinline__ void purine_ln_load(const T* p, long long i, V* v) {
  for (int j = 0; j < W; ++j) v[j] = (V)purine_load(p, i + j);
}
template <>
__device__ __forceinline__ void purine_ln_load<4, float, float>(const float* p, long long i,
                                                                float* v) {
  const uint4 u = *(const uint4*)(p + i);
  v[0] = purine_bits_float(u.x);
  v[1] = purine_bits_float(u.y);
  v[2] = purine_bits_float(u.z);
  v[3] = purine_bits_float(u.w);
}
template <>
__device__ __forceinline__ void purine_ln_load<4, unsigned short, float>(
    const unsigned short* p, long long i, float* v) {
  const uint2 u = *(const uint2*)(p + i);   // little-endian: element i in the low half of u.x
  v[0] = purine_bits_float(u.x << 16);
  v[1] = purine_bits_float(u.x & 0xffff0000u);
  v[2] = purine_bits_float(u.y << 16);
  v[3] = purine_bits_float(u.y & 0xffff0000u);
}

// W values into p from i on (purine_ln_store's element each).
template <int W, typename Y, typename V>
__device__ __forceinline__ void purine_ln_put(Y* p, long long i, const V* v) {
  for (int j = 0; j < W; ++j) purine_ln_store(p + i + j, v[j]);
}
template <>
__device__ __forceinline__ void purine_ln_put<4, float, float>(float* p, long long i,
                                                               const float* v) {
  uint4 u;
  u.x = purine_float_bits(v[0]);
  u.y = purine_float_bits(v[1]);
  u.z = purine_float_bits(v[2]);
  u.w = purine_float_bits(v[3]);
  *(uint4*)(p + i) = u;
}
template <>
__device__ __forceinline__ void purine_ln_put<4, unsigned short, float>(unsigned short* p,
                                                                        long long i,
                                                                        const float* v) {
  uint2 u;
  u.x = (purine_round_bf16(purine_float_bits(v[0])) >> 16) |
        (purine_round_bf16(purine_float_bits(v[1])) & 0xffff0000u);
  u.y = (purine_round_bf16(purine_float_bits(v[2])) >> 16) |
        (purine_round_bf16(purine_float_bits(v[3])) & 0xffff0000u);
  *(uint2*)(p + i) = u;
}

// W: elements a lane takes at a time (4: the vectorised path, 1: scalar)
template <int W, typename T, typename Y>
__device__ void layernorm_forward_rows(long long rows, long long cols, const T* x, const T* g,
                                       const T* b, double eps, Y* y, T* mean, T* rstd) {
  const long long warps = blockDim.x >> 5, warp = threadIdx.x >> 5;
  const long long lane = threadIdx.x & 31u, step = 32 * W;
  for (long long first = (long long)blockIdx.x * warps; first < rows;
       first += (long long)gridDim.x * warps) {
    const long long r = first + warp;
    const long long n = r < rows ? cols : 0;   // a warp past the last row: an empty one
    const T* xr = x + (r < rows ? r : 0) * cols;
    Y* yr = y + (r < rows ? r : 0) * cols;
    double s = 0.0;
    for (long long c = lane * W; c < n; c += step) {
      T v[W];
      purine_ln_load<W>(xr, c, v);
      for (int j = 0; j < W; ++j) s += (double)v[j];
    }
    const T mu = (T)(purine_ln_warp_sum(s) / (double)cols);
    double q = 0.0;
    for (long long c = lane * W; c < n; c += step) {
      T v[W];
      purine_ln_load<W>(xr, c, v);
      for (int j = 0; j < W; ++j) {
        const double d = (double)(T)(v[j] - mu);
        q += d * d;
      }
    }
    const T rs = (T)(1.0 / sqrt(purine_ln_warp_sum(q) / (double)cols + eps));
    for (long long c = lane * W; c < n; c += step) {
      T v[W], gv[W], bv[W], out[W];
      purine_ln_load<W>(xr, c, v);
      purine_ln_load<W>(g, c, gv);
      purine_ln_load<W>(b, c, bv);
      for (int j = 0; j < W; ++j) out[j] = (T)((T)((T)((T)(v[j] - mu) * rs) * gv[j]) + bv[j]);
      purine_ln_put<W>(yr, c, out);
    }
    if (lane == 0 && r < rows) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

template <typename T, typename Y>
__device__ void layernorm_forward_impl(long long rows, long long cols, const T* x, const T* g,
                                       const T* b, double eps, Y* y, T* mean, T* rstd) {
  if ((cols & 3) == 0 && purine_ln_vec_ok(x) && purine_ln_vec_ok(g) && purine_ln_vec_ok(b) &&
      purine_ln_vec_ok(y)) {
    layernorm_forward_rows<4>(rows, cols, x, g, b, eps, y, mean, rstd);
  } else {
    layernorm_forward_rows<1>(rows, cols, x, g, b, eps, y, mean, rstd);
  }
}

// The backward's inputs at W elements (both passes of
// layernorm_backward_rows): dy's and x's from i on (i: the row's offset +
// c), g's from column c on.
template <int W, typename T, typename D>
__device__ __forceinline__ void purine_ln_backward_load(const D* dy, const T* x, const T* g,
                                                        long long i, long long c, T* d, T* xv,
                                                        T* gv) {
  purine_ln_load<W>(x, i, xv);
  purine_ln_load<W>(dy, i, d);
  purine_ln_load<W>(g, c, gv);
}

// D: dy's storage (T, or bfloat16 bits for T float: layernorm_backward_bdy_f32)
// COPY (T float, has_dx): also dx's bfloat16 bits into `copy`
template <int W, typename T, typename D, bool COPY>
__device__ void layernorm_backward_rows(long long rows, long long cols, const D* dy,
                                        const T* x, const T* g, const T* mean, const T* rstd,
                                        T* dx, int has_dx, T* dyxhat, int has_dyxhat,
                                        unsigned short* copy) {
  const long long warps = blockDim.x >> 5, warp = threadIdx.x >> 5;
  const long long lane = threadIdx.x & 31u, step = 32 * W;
  for (long long first = (long long)blockIdx.x * warps; first < rows;
       first += (long long)gridDim.x * warps) {
    const long long r = first + warp;
    const long long n = r < rows ? cols : 0;   // a warp past the last row: an empty one
    const long long at = (r < rows ? r : 0) * cols;
    const T mu = mean[r < rows ? r : 0], rs = rstd[r < rows ? r : 0];
    double sa = 0.0, sk = 0.0;
    for (long long c = lane * W; c < n; c += step) {
      T xv[W], d[W], gv[W], p[W];
      purine_ln_backward_load<W>(dy, x, g, at + c, c, d, xv, gv);
      for (int j = 0; j < W; ++j) {
        const T xhat = (T)(xv[j] - mu) * rs;
        const T dxhat = d[j] * gv[j];
        sa += (double)dxhat;
        sk += (double)dxhat * (double)xhat;
        p[j] = d[j] * xhat;
      }
      if (has_dyxhat) purine_ln_put<W>(dyxhat, at + c, p);
    }
    if (!has_dx) continue;  // uniform over the grid: every warp shuffles alike
    const T a = (T)(purine_ln_warp_sum(sa) / (double)cols);
    const T k = (T)(purine_ln_warp_sum(sk) / (double)cols);
    for (long long c = lane * W; c < n; c += step) {
      T xv[W], d[W], gv[W], v[W];
      purine_ln_backward_load<W>(dy, x, g, at + c, c, d, xv, gv);
      for (int j = 0; j < W; ++j) {
        const T xhat = (T)(xv[j] - mu) * rs;
        const T dxhat = d[j] * gv[j];
        v[j] = (T)((T)(dxhat - (T)(xhat * k)) - a) * rs;
      }
      purine_ln_put<W>(dx, at + c, v);
      if (COPY) purine_ln_put<W>(copy, at + c, v);
    }
  }
}

template <typename T, typename D, bool COPY = false>
__device__ void layernorm_backward_impl(long long rows, long long cols, const D* dy,
                                        const T* x, const T* g, const T* mean, const T* rstd,
                                        T* dx, int has_dx, T* dyxhat, int has_dyxhat,
                                        unsigned short* copy = nullptr) {
  if ((cols & 3) == 0 && purine_ln_vec_ok(dy) && purine_ln_vec_ok(x) && purine_ln_vec_ok(g) &&
      purine_ln_vec_ok(dx) && purine_ln_vec_ok(dyxhat) && (!COPY || purine_ln_vec_ok(copy))) {
    layernorm_backward_rows<4, T, D, COPY>(rows, cols, dy, x, g, mean, rstd, dx, has_dx,
                                           dyxhat, has_dyxhat, copy);
  } else {
    layernorm_backward_rows<1, T, D, COPY>(rows, cols, dy, x, g, mean, rstd, dx, has_dx,
                                           dyxhat, has_dyxhat, copy);
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

// ------------------------------------ the backward with dg's and db's sums ---
// layernorm_backward[_bdy][_copy]_colsum_f32: layernorm_backward_rows<4>'s
// dx (and copy) bit for bit -- the same lanes, columns, row sums and
// expressions -- and, in place of dyxhat and the two column-sum kernels
// after it (cuda/reduce.cu sum_rows over dy and over dyxhat), the block's
// partial column sums of dy (db) and of dy * xhat (dg), written to
// partial[(q * cols + c) * gridDim.x + blockIdx.x] (q 0: db, 1: dg, in
// double) for reduce.cu's bias_grad_finish_f32 to add in block order (the
// second stage). The rows are cut into `blocks` jobs (the launcher's,
// a function of the rows: PURINE_LN_SUM_ROWS rows a warp; a block a job,
// grid-stride): job b's warp w takes rows b warps + w + k blocks warps. A
// lane owns columns 4 lane + 128 k .. + 3 (k < CH, the row's chunks: cols
// <= 128 CH) of every row its warp takes and adds its rows' terms in
// float32 in row order; then the job's warps add theirs in warp order into
// shared doubles (a barrier between warps) and the job writes column b of
// the partial sums: no atomics, and the order depends on the shape alone
// (and the block size, fixed), so the same bits every run. cols a multiple of 4, at most 128 PURINE_LN_SUM_CHUNKS;
// an array off the 16-byte (bits: 8-byte) grid is read and written an
// element at a time in the same lanes (VEC false): the same numbers.
#define PURINE_LN_SUM_CHUNKS 6   // 768 columns at most (GPT-2 124M's width)
// a lane's 2 x 4 CH float32 sums live in registers: 128 a thread at CH 6 on
// sm_90, no spills (CH 8 took 168, one block of 256 threads an SM); bounded
// so that two blocks fit an SM
#ifdef __CUDACC__
#define PURINE_LN_SUM_BOUNDS __launch_bounds__(256, 2)
#else
#define PURINE_LN_SUM_BOUNDS
#endif
#define PURINE_LN_SUM_ROWS 4     // rows a warp, the launcher's grid

template <bool VEC, typename T, typename V>
__device__ __forceinline__ void purine_ln_load4(const T* p, long long i, V* v) {
  if (VEC) {
    purine_ln_load<4>(p, i, v);
  } else {
    for (int j = 0; j < 4; ++j) purine_ln_load<1>(p, i + j, v + j);
  }
}
template <bool VEC, typename Y, typename V>
__device__ __forceinline__ void purine_ln_put4(Y* p, long long i, const V* v) {
  if (VEC) {
    purine_ln_put<4>(p, i, v);
  } else {
    for (int j = 0; j < 4; ++j) purine_ln_put<1>(p, i + j, v + j);
  }
}

template <int CH, bool VEC, typename D, bool COPY>
__device__ void layernorm_backward_colsum_rows(long long rows, long long cols, const D* dy,
                                               const float* x, const float* g,
                                               const float* mean, const float* rstd,
                                               float* dx, int has_dx, unsigned short* copy,
                                               long long blocks, double* partial,
                                               double* sums) {   // 2 x 128 CHUNKS, shared
  const long long warps = blockDim.x >> 5, warp = threadIdx.x >> 5;
  const long long lane = threadIdx.x & 31u, step = 128;
  // job b: the rows b warps + warp + k blocks warps of each warp, partial sums
  // column b (grid-stride over the jobs: the sums depend on `blocks` alone)
  for (long long job = blockIdx.x; job < blocks; job += gridDim.x) {
    float db[CH][4], dg[CH][4];
    for (int k = 0; k < CH; ++k) {
      for (int j = 0; j < 4; ++j) db[k][j] = dg[k][j] = 0.0f;
    }
    for (long long first = job * warps; first < rows; first += blocks * warps) {
      const long long r = first + warp;
      const long long n = r < rows ? cols : 0;   // a warp past the last row: an empty one
      const long long at = (r < rows ? r : 0) * cols;
      const float mu = mean[r < rows ? r : 0], rs = rstd[r < rows ? r : 0];
      double sa = 0.0, sk = 0.0;
      for (int k = 0; k < CH; ++k) {
        const long long c = lane * 4 + k * step;
        if (c >= n) break;
        float xv[4], d[4], gv[4];
        purine_ln_load4<VEC>(x, at + c, xv);
        purine_ln_load4<VEC>(dy, at + c, d);
        purine_ln_load4<VEC>(g, c, gv);
        for (int j = 0; j < 4; ++j) {
          const float xhat = (float)(xv[j] - mu) * rs;
          const float dxhat = d[j] * gv[j];
          sa += (double)dxhat;
          sk += (double)dxhat * (double)xhat;
          dg[k][j] += d[j] * xhat;
          db[k][j] += d[j];
        }
      }
      if (!has_dx) continue;  // uniform over the grid: every warp shuffles alike
      const float a = (float)(purine_ln_warp_sum(sa) / (double)cols);
      const float kk = (float)(purine_ln_warp_sum(sk) / (double)cols);
      for (int k = 0; k < CH; ++k) {
        const long long c = lane * 4 + k * step;
        if (c >= n) break;
        float xv[4], d[4], gv[4], v[4];
        purine_ln_load4<VEC>(x, at + c, xv);
        purine_ln_load4<VEC>(dy, at + c, d);
        purine_ln_load4<VEC>(g, c, gv);
        for (int j = 0; j < 4; ++j) {
          const float xhat = (float)(xv[j] - mu) * rs;
          const float dxhat = d[j] * gv[j];
          v[j] = (float)((float)(dxhat - (float)(xhat * kk)) - a) * rs;
        }
        purine_ln_put4<VEC>(dx, at + c, v);
        if (COPY) purine_ln_put4<VEC>(copy, at + c, v);
      }
    }
    // the job's warps' sums, in warp order, then its partial sums
    for (long long w = 0; w < warps; ++w) {
      __syncthreads();   // warp w - 1 is done (and, w 0, the last job's writes)
      if (warp == w) {
        for (int k = 0; k < CH; ++k) {
          const long long c = lane * 4 + k * step;
          if (c >= cols) break;
          for (int j = 0; j < 4; ++j) {
            double* s0 = sums + c + j;                              // db's
            double* s1 = sums + 128 * PURINE_LN_SUM_CHUNKS + c + j;   // dg's
            *s0 = (w == 0 ? 0.0 : *s0) + (double)db[k][j];
            *s1 = (w == 0 ? 0.0 : *s1) + (double)dg[k][j];
          }
        }
      }
    }
    __syncthreads();
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
      partial[c * blocks + job] = sums[c];
      partial[(cols + c) * blocks + job] = sums[128 * PURINE_LN_SUM_CHUNKS + c];
    }
  }
}

template <typename D, bool COPY>
__device__ void layernorm_backward_colsum(long long rows, long long cols, const D* dy,
                                          const float* x, const float* g, const float* mean,
                                          const float* rstd, float* dx, int has_dx,
                                          unsigned short* copy, long long blocks,
                                          double* partial) {
  // one array for every instantiation below (each its own: 16 of them)
  __shared__ double sums[2 * 128 * PURINE_LN_SUM_CHUNKS];
  const bool vec = purine_ln_vec_ok(dy) && purine_ln_vec_ok(x) && purine_ln_vec_ok(g) &&
                   purine_ln_vec_ok(dx) && (!COPY || purine_ln_vec_ok(copy));
  const int chunks = (int)((cols + 127) / 128);
#define PURINE_LN_COLSUM_CASE(CH)                                                          \
  case CH:                                                                                 \
    if (vec) {                                                                             \
      layernorm_backward_colsum_rows<CH, true, D, COPY>(rows, cols, dy, x, g, mean, rstd, \
                                                        dx, has_dx, copy, blocks, partial, sums); \
    } else {                                                                               \
      layernorm_backward_colsum_rows<CH, false, D, COPY>(rows, cols, dy, x, g, mean, rstd, \
                                                         dx, has_dx, copy, blocks, partial, sums); \
    }                                                                                      \
    break;
  switch (chunks) {
    PURINE_LN_COLSUM_CASE(1)
    PURINE_LN_COLSUM_CASE(2)
    PURINE_LN_COLSUM_CASE(3)
    PURINE_LN_COLSUM_CASE(4)
    PURINE_LN_COLSUM_CASE(5)
    PURINE_LN_COLSUM_CASE(6)
    default: break;   // the launcher never asks (cols > 128 PURINE_LN_SUM_CHUNKS)
  }
#undef PURINE_LN_COLSUM_CASE
}

#define PURINE_LN_BACKWARD_COLSUM(NAME, D)                                                  \
  extern "C" __global__ void PURINE_LN_SUM_BOUNDS NAME##_colsum_f32(                       \
      long long rows, long long cols, const D* dy,                                          \
                                               const float* x, const float* g,              \
                                               const float* mean, const float* rstd,        \
                                               float* dx, int has_dx, long long blocks,     \
                                               double* partial) {                           \
    layernorm_backward_colsum<D, false>(rows, cols, dy, x, g, mean, rstd, dx, has_dx,       \
                                        nullptr, blocks, partial);                          \
  }                                                                                         \
  extern "C" __global__ void PURINE_LN_SUM_BOUNDS NAME##_copy_colsum_f32(                   \
      long long rows, long long cols, const D* dy, const float* x, const float* g,          \
      const float* mean, const float* rstd, float* dx, unsigned short* copy,                \
      long long blocks, double* partial) {                                                  \
    layernorm_backward_colsum<D, true>(rows, cols, dy, x, g, mean, rstd, dx, 1, copy,       \
                                       blocks, partial);                                    \
  }

PURINE_LN_BACKWARD_COLSUM(layernorm_backward, float)
PURINE_LN_BACKWARD_COLSUM(layernorm_backward_bdy, unsigned short)
