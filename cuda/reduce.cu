// The deterministic reductions: channel sums, column sums, bias gradients,
// an embedding's weight gradient.
//
// channel_sum: db[c] = sum over n and the spatial positions s of dy[n, c,
// s] (a batch norm's sums; a column sum of a tall matrix takes sum_rows
// below). One block per channel (grid-stride over
// channels): its threads add strided slices of the channel in double, then
// a shared-memory tree adds the per-thread partial sums in a fixed order --
// no atomics, so the result is the same on every run (a resume stays
// bit-exact). Launched with at most PURINE_REDUCE_THREADS threads per block.
//
// Compiled at run time by purine_mpi.gpu.load_kernel("reduce"); one
// extern "C" entry point per dtype: <name>_f32, <name>_f64.

#include "block_sum.cuh"
#include "precision.cuh"

#define PURINE_REDUCE_THREADS 256

// An element as the double the sums add (purine_load: bfloat16 bits widened
// exactly, the value the float32 storage of the same blob holds, so the same sums)
template <typename T>
__device__ __forceinline__ double purine_sum_load(const T* x, long long i) {
  return (double)purine_load(x, i);
}

template <typename T>
__device__ void channel_sum_impl(long long channels, const T* dy, long long n,
                                 long long inner, T* out) {
  __shared__ double partial[PURINE_REDUCE_THREADS];
  const unsigned int tid = threadIdx.x;
  const long long per_channel = n * inner;
  for (long long c = blockIdx.x; c < channels; c += gridDim.x) {
    double sum = 0.0;
    for (long long k = tid; k < per_channel; k += blockDim.x) {
      const long long sample = k / inner, s = k - sample * inner;
      sum += (double)dy[(sample * channels + c) * inner + s];
    }
    const double total = purine_block_sum(sum, partial);
    if (tid == 0) out[c] = (T)total;
  }
}

// The per-channel reductions' entry points: NAME_SUFFIX(channels, dy, n, inner, out).
#define PURINE_PER_CHANNEL_ENTRY(NAME, SUFFIX, T)                                   \
  extern "C" __global__ void NAME##_##SUFFIX(long long channels, const T* dy,       \
                                             long long n, long long inner, T* out) { \
    NAME##_impl<T>(channels, dy, n, inner, out);                                    \
  }

PURINE_PER_CHANNEL_ENTRY(channel_sum, f32, float)
PURINE_PER_CHANNEL_ENTRY(channel_sum, f64, double)

// Column sums of a (rows, cols) matrix, x C-contiguous: out[j] = sum_i
// x[i, j] (plus out[j] itself when `accumulate`), in double, rounded once.
// A fully connected layer's bias gradient (dy (N, C)), a layer norm's
// weight and bias gradients, a weight gradient from per-sample partial
// products (the im2col convolution's batched GEMM).
//
// Tiled and split so the whole GPU takes part (one thread per column
// looping over all rows ran 768-3072 threads, 1.9 ms a call on average over
// GPT-2 124M's (16384, 768-3072) dys on an H200): the columns are cut into tiles of
// PURINE_SUM_ROWS_TILE consecutive columns and the rows into `splits`
// consecutive ranges (split s: rows [s*rows/splits, (s+1)*rows/splits)); one
// block per (tile, split) job, grid-stride over the tiles * splits jobs. A
// block of B threads is `lanes` = min(B, TILE) columns wide and B / lanes
// row lanes deep (256 threads: 32 columns x 8 rows; a warp reads 32
// consecutive elements of a row, coalesced); thread (row lane r, lane l)
// adds rows first + r, first + r + depth, ... of its column in double, in
// row order (four independent loads in flight, added in that order); a
// fixed-order shared-memory tree over the row lanes (pairs at distance 1,
// 2, 4, ...) adds a column's row lanes. With one split the block writes
// out[j] (out[j] + the sum when accumulating); else its partial sum to
// partial[j * splits + s] and bias_grad_finish adds each column's
// partials in split order (after out[j] when accumulating). The splits
// depend on the shape alone (bias_grad_splits with inner 1,
// purine_mpi/gpu/kernels/elementwise.py) and the block size is fixed: no
// atomics, the same bits on every run and every GPU. Not the bits of the
// old one-thread-per-column kernel (rows added serially in double): the
// same double sum in another order, so a float32 result differs from it in
// the rare last-bit cases where the two double sums round apart, a float64
// one in its last bits. Launched with at most PURINE_REDUCE_THREADS
// threads per block.
#define PURINE_SUM_ROWS_TILE 32

// X: x's storage (T, or bfloat16 bits for T float: sum_rows_bits_f32)
template <typename T, typename X>
__device__ void sum_rows_impl(long long cols, const X* x, long long rows, long long splits,
                              int accumulate, double* partial, T* out) {
  __shared__ double sums[PURINE_REDUCE_THREADS];
  const unsigned int tid = threadIdx.x;
  const unsigned int lanes = blockDim.x < PURINE_SUM_ROWS_TILE ? blockDim.x
                                                               : PURINE_SUM_ROWS_TILE;
  const unsigned int depth = blockDim.x / lanes;   // row lanes
  const unsigned int lane = tid % lanes, row_lane = tid / lanes;   // row_lane == depth: idle
  const long long tiles = (cols + PURINE_SUM_ROWS_TILE - 1) / PURINE_SUM_ROWS_TILE;
  const long long d = depth;
  for (long long job = blockIdx.x; job < tiles * splits; job += gridDim.x) {
    const long long tile = job / splits, j = job - tile * splits;
    const long long first = j * rows / splits, last = (j + 1) * rows / splits;
    const long long start = tile * PURINE_SUM_ROWS_TILE;
    const long long width = cols - start < PURINE_SUM_ROWS_TILE ? cols - start
                                                                : PURINE_SUM_ROWS_TILE;
    // one pass over the tile on a GPU (lanes == TILE); more with a small block
    for (long long offset = 0; offset < width; offset += lanes) {
      const long long c = start + offset + lane;
      const bool mine = row_lane < depth && offset + lane < width;
      double sum = 0.0;
      if (mine) {
        const X* column = x + c;
        long long i = first + row_lane;
        for (; i + 3 * d < last; i += 4 * d) {
          const double a = purine_sum_load(column, i * cols);
          const double b = purine_sum_load(column, (i + d) * cols);
          const double e = purine_sum_load(column, (i + 2 * d) * cols);
          const double f = purine_sum_load(column, (i + 3 * d) * cols);
          sum += a;
          sum += b;
          sum += e;
          sum += f;
        }
        for (; i < last; i += d) sum += purine_sum_load(column, i * cols);
      }
      sums[tid] = sum;
      __syncthreads();
      for (unsigned int stride = 1; stride < depth; stride <<= 1) {
        if (row_lane % (2 * stride) == 0 && row_lane + stride < depth) {
          sums[tid] += sums[tid + stride * lanes];
        }
        __syncthreads();
      }
      if (mine && row_lane == 0) {
        const double total = sums[tid];
        if (splits == 1) out[c] = (T)(accumulate ? (double)out[c] + total : total);
        else partial[c * splits + j] = total;
      }
      __syncthreads();   // every total is read: sums may be reused
    }
  }
}

#define PURINE_SUM_ROWS_ENTRY(SUFFIX, T)                                             \
  extern "C" __global__ void sum_rows_##SUFFIX(long long cols, const T* x,          \
                                               long long rows, long long splits,    \
                                               int accumulate, double* partial,     \
                                               T* out) {                            \
    sum_rows_impl<T, T>(cols, x, rows, splits, accumulate, partial, out);           \
  }

PURINE_SUM_ROWS_ENTRY(f32, float)
PURINE_SUM_ROWS_ENTRY(f64, double)

// x as bfloat16 bits (an activation gradient stored as bits: qkv's, read by
// its bias gradient), out float32: the float32 storage's sums bit for bit
// (the same doubles in the same order); bias_grad_finish_f32 finishes it
extern "C" __global__ void sum_rows_bits_f32(long long cols, const unsigned short* x,
                                             long long rows, long long splits, int accumulate,
                                             double* partial, float* out) {
  sum_rows_impl<float, unsigned short>(cols, x, rows, splits, accumulate, partial, out);
}

// sum_rows_vec_f32 / sum_rows_bits_vec_f32: sum_rows_impl's sums bit for
// bit (each column's rows split over the same row lanes, added in the same
// order, the same tree, the same splits), four consecutive columns a thread:
// one 16-byte load of four float32 (8 bytes of four bfloat16 bits) where
// sum_rows took four 4-byte (2-byte) loads, so a block owns a tile of 4 x
// PURINE_SUM_ROWS_TILE columns (4x fewer blocks, each 4x the bytes in
// flight a load), a thread's loads of 8 rows issued before their adds. For cols a multiple of 4 and x's base 16-byte (bits:
// 8-byte) aligned, as the launcher checks; the splits are sum_rows's for
// the shape (the tiles of 32 columns), so the partial sums are the same.
#ifdef __CUDACC__
typedef float4 purine_sum_f4;
#else
struct alignas(16) purine_sum_f4 { float x, y, z, w; };
#endif

// Four consecutive elements of x at i: one load (kept narrow while loads
// are in flight), then widened exactly to the doubles the sums add
template <typename X> struct purine_sum_vec;
template <> struct purine_sum_vec<float> {
  typedef purine_sum_f4 type;
  static __device__ __forceinline__ type load(const float* x, long long i) {
    return *(const purine_sum_f4*)(const void*)(x + i);
  }
  static __device__ __forceinline__ double at(const type& a, int k) {
    return (double)(k == 0 ? a.x : k == 1 ? a.y : k == 2 ? a.z : a.w);
  }
};
template <> struct purine_sum_vec<unsigned short> {
  typedef uint2 type;
  static __device__ __forceinline__ type load(const unsigned short* x, long long i) {
    return *(const uint2*)(const void*)(x + i);
  }
  static __device__ __forceinline__ double at(const type& a, int k) {
    const unsigned int w = k < 2 ? a.x : a.y;
    return (double)purine_bits_float((k & 1) ? (w & 0xffff0000u) : (w << 16));
  }
};

#define PURINE_SUM_ROWS_VEC_BATCH 8   // rows' loads in flight a thread

template <typename X>
__device__ void sum_rows_vec_impl(long long cols, const X* x, long long rows, long long splits,
                                  int accumulate, double* partial, float* out) {
  __shared__ double sums[4][PURINE_REDUCE_THREADS];
  const unsigned int tid = threadIdx.x;
  const unsigned int lanes = blockDim.x < PURINE_SUM_ROWS_TILE ? blockDim.x
                                                               : PURINE_SUM_ROWS_TILE;
  const unsigned int depth = blockDim.x / lanes;   // row lanes, as sum_rows
  const unsigned int lane = tid % lanes, row_lane = tid / lanes;
  const long long tile_cols = 4 * PURINE_SUM_ROWS_TILE;
  const long long tiles = (cols + tile_cols - 1) / tile_cols;
  const long long d = depth;
  for (long long job = blockIdx.x; job < tiles * splits; job += gridDim.x) {
    const long long tile = job / splits, j = job - tile * splits;
    const long long first = j * rows / splits, last = (j + 1) * rows / splits;
    const long long start = tile * tile_cols;
    const long long width = cols - start < tile_cols ? cols - start : tile_cols;
    for (long long offset = 0; offset < width; offset += 4 * (long long)lanes) {
      const long long c = start + offset + 4 * (long long)lane;   // columns c .. c + 3
      const bool mine = row_lane < depth && offset + 4 * (long long)lane < width;
      double sum[4] = {0.0, 0.0, 0.0, 0.0};
      if (mine) {
        typedef purine_sum_vec<X> V;
        const int batch = PURINE_SUM_ROWS_VEC_BATCH;
        long long i = first + row_lane;
        // a batch of rows' loads, then their adds in row order (each column's
        // sum the serial one over its rows, as sum_rows)
        for (; i + (batch - 1) * d < last; i += batch * d) {
          typename V::type r[PURINE_SUM_ROWS_VEC_BATCH];
          for (int b = 0; b < batch; ++b) r[b] = V::load(x, (i + b * d) * cols + c);
          for (int b = 0; b < batch; ++b) {
            for (int k = 0; k < 4; ++k) sum[k] += V::at(r[b], k);
          }
        }
        for (; i < last; i += d) {
          const typename V::type r = V::load(x, i * cols + c);
          for (int k = 0; k < 4; ++k) sum[k] += V::at(r, k);
        }
      }
      for (int k = 0; k < 4; ++k) sums[k][tid] = sum[k];
      __syncthreads();
      for (unsigned int stride = 1; stride < depth; stride <<= 1) {
        if (row_lane % (2 * stride) == 0 && row_lane + stride < depth) {
          for (int k = 0; k < 4; ++k) sums[k][tid] += sums[k][tid + stride * lanes];
        }
        __syncthreads();
      }
      if (mine && row_lane == 0) {
        for (int k = 0; k < 4; ++k) {
          const double total = sums[k][tid];
          if (splits == 1) out[c + k] = (float)(accumulate ? (double)out[c + k] + total : total);
          else partial[(c + k) * splits + j] = total;
        }
      }
      __syncthreads();   // every total is read: sums may be reused
    }
  }
}

extern "C" __global__ void sum_rows_vec_f32(long long cols, const float* x, long long rows,
                                            long long splits, int accumulate, double* partial,
                                            float* out) {
  sum_rows_vec_impl<float>(cols, x, rows, splits, accumulate, partial, out);
}

extern "C" __global__ void sum_rows_bits_vec_f32(long long cols, const unsigned short* x,
                                                 long long rows, long long splits,
                                                 int accumulate, double* partial, float* out) {
  sum_rows_vec_impl<unsigned short>(cols, x, rows, splits, accumulate, partial, out);
}

// The bias gradient of a convolution, fast: db[c] = sum over n and s of
// dy[n, c, s], dy (N, C, inner) contiguous, split over many blocks so the
// whole GPU takes part (one block per channel used 32 of an H200's 132 SMs
// on cifar10_quick and was its longest kernel, 16x PyTorch's reduction at
// batch 512).
//
// bias_grad: each channel's N samples are cut into `splits` consecutive
// ranges (split j: samples [j*N/splits, (j+1)*N/splits)); one block per
// (channel, split) job, grid-stride over the channels * splits jobs. Its
// threads walk the range's runs of `inner` contiguous elements as one flat
// range, consecutive threads on consecutive addresses (coalesced loads; the
// (sample, s) position moves by a fixed step, no division per element),
// adding in double; a shared-memory tree adds the threads' sums in a fixed
// order. With one split the block writes db[c] itself; else it writes its
// partial sum to partial[c * splits + j] and bias_grad_finish adds each
// channel's partials in split order. The splits depend on the shape alone
// (purine_mpi/gpu/kernels/elementwise.py), no atomics: the same bits on
// every run and every GPU. Launched with at most PURINE_REDUCE_THREADS
// threads per block.
template <typename T>
__device__ void bias_grad_impl(long long channels, const T* dy, long long n, long long inner,
                               long long splits, double* partial, T* out) {
  __shared__ double sums[PURINE_REDUCE_THREADS];
  const unsigned int tid = threadIdx.x;
  const long long step_sample = blockDim.x / inner, step_s = blockDim.x % inner;
  for (long long job = blockIdx.x; job < channels * splits; job += gridDim.x) {
    const long long c = job / splits, j = job - c * splits;
    const long long first = j * n / splits, last = (j + 1) * n / splits;
    double sum = 0.0;
    long long sample = first + tid / inner, s = tid % inner;
    const T* channel = dy + c * inner;
    while (sample < last) {
      sum += (double)channel[sample * channels * inner + s];
      sample += step_sample;
      s += step_s;
      if (s >= inner) { s -= inner; ++sample; }
    }
    const double total = purine_block_sum(sum, sums);
    if (tid == 0) {
      if (splits == 1) out[c] = (T)total;
      else partial[job] = total;
    }
  }
}

#define PURINE_BIAS_GRAD_ENTRY(SUFFIX, T)                                                \
  extern "C" __global__ void bias_grad_##SUFFIX(long long channels, const T* dy,        \
                                                long long n, long long inner,           \
                                                long long splits, double* partial,      \
                                                T* out) {                               \
    bias_grad_impl<T>(channels, dy, n, inner, splits, partial, out);                    \
  }

PURINE_BIAS_GRAD_ENTRY(f32, float)
PURINE_BIAS_GRAD_ENTRY(f64, double)

// db[c] = the sum of channel c's `splits` partial sums, in split order
// (after db[c] itself when `accumulate`: sum_rows), one thread per channel.
template <typename T>
__device__ void bias_grad_finish_impl(long long channels, long long splits, int accumulate,
                                      const double* partial, T* out) {
  for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < channels;
       c += (long long)blockDim.x * gridDim.x) {
    double sum = accumulate ? (double)out[c] : 0.0;
    for (long long j = 0; j < splits; ++j) sum += partial[c * splits + j];
    out[c] = (T)sum;
  }
}

#define PURINE_BIAS_GRAD_FINISH_ENTRY(SUFFIX, T)                                         \
  extern "C" __global__ void bias_grad_finish_##SUFFIX(long long channels,              \
                                                       long long splits,                \
                                                       int accumulate,                  \
                                                       const double* partial, T* out) { \
    bias_grad_finish_impl<T>(channels, splits, accumulate, partial, out);               \
  }

PURINE_BIAS_GRAD_FINISH_ENTRY(f32, float)
PURINE_BIAS_GRAD_FINISH_ENTRY(f64, double)

// An embedding's weight gradient, a deterministic scatter-add:
// dw[v, :] = sum over the positions p with ids[p] == v of dy[p, :], dw
// (vocab, width) and dy (n, width) contiguous, the ids already checked to lie
// in [0, vocab) (the op's check_ids, on the host). Two kernels, no atomics,
// the op's scratch reserved at setup (nothing allocated, so a CUDA graph
// captures them):
//
//   embedding_order(_i32)  a counting sort of the positions by (token,
//     position), whose keys are distinct, so the order is unique: thread p
//     counts less = #{q : ids[q] < ids[p]}, before = #{q < p : ids[q] ==
//     ids[p]} and after = #{q > p : ids[q] == ids[p]} over all n ids, staged
//     PURINE_EMBED_STAGE at a time in shared memory (n^2 comparisons, every
//     one a broadcast shared-memory read), and writes its position at
//     rank r = less + before: order[r] = p, tokens[r] = ids[p]; a token's
//     first position (before == 0) writes first[v] = r, its last (after ==
//     0) end[v] = r + 1. first and end are not cleared: the sum kernel
//     takes first[v] only where it lies in [0, n) and tokens[first[v]] ==
//     v, which a stale or garbage value cannot fake (tokens is rewritten
//     whole: v occurs, so this sort wrote first[v]);
//   embedding_grad  one block per row v of dw (grid-stride; a thread per
//     column up to 1,024, launched so): zero for a
//     token that does not occur, else its run order[first[v] .. end[v]) is
//     staged PURINE_EMBED_STAGE positions at a time and each thread adds
//     dy[order[r], c] for its columns c in increasing r, 16 rows' loads
//     issued before their adds (a repeated token's rows are a chain of
//     dependent adds: loads in flight, not the adds, set its speed).
//
// Every row's sum runs in increasing position in T, from 0: the bits of
// np.add.at (the host path's np.add.reduceat sums pairwise past a few rows).
// The previous kernel (each block owned 32 rows and scanned all n ids,
// adding its tokens' rows one after the other) took 12.5 ms on an H200 for
// GPT-2's 16 x 1024 tokens: 1,572 blocks each reading every id, and the
// tiles of frequent tokens serialised.
#define PURINE_EMBED_STAGE 256
#define PURINE_EMBED_BATCH 16

template <typename I>
__device__ void embedding_order_impl(long long n, const I* ids, int* order, int* tokens,
                                     int* first, int* end) {
  __shared__ int stage[PURINE_EMBED_STAGE];
  const unsigned int tid = threadIdx.x;
  // the loop's bounds depend on the block alone: every thread meets every barrier
  for (long long base = (long long)blockIdx.x * blockDim.x; base < n;
       base += (long long)blockDim.x * gridDim.x) {
    const long long p = base + tid;
    const int v = p < n ? (int)ids[p] : 0;
    long long less = 0, before = 0, after = 0;
    for (long long start = 0; start < n; start += PURINE_EMBED_STAGE) {
      const long long count = n - start < PURINE_EMBED_STAGE ? n - start : PURINE_EMBED_STAGE;
      __syncthreads();   // every thread is done with the previous stage
      for (long long k = tid; k < count; k += blockDim.x) stage[k] = (int)ids[start + k];
      __syncthreads();
      if (p < n) {
        for (long long k = 0; k < count; ++k) {
          const int w = stage[k];
          const long long q = start + k;
          less += w < v;
          before += (w == v) & (q < p);
          after += (w == v) & (q > p);
        }
      }
    }
    if (p < n) {
      const long long r = less + before;
      order[r] = (int)p;
      tokens[r] = v;
      if (before == 0) first[v] = (int)r;
      if (after == 0) end[v] = (int)(r + 1);
    }
  }
}

template <typename T>
__device__ void embedding_grad_impl(long long vocab, long long width, long long n,
                                    const int* order, const int* tokens, const int* first,
                                    const int* end, const T* dy, T* dw) {
  __shared__ int stage[PURINE_EMBED_STAGE];
  const unsigned int tid = threadIdx.x;
  for (long long v = blockIdx.x; v < vocab; v += gridDim.x) {   // the same v in a block
    T* row = dw + v * width;
    const long long lo = first[v];
    // tokens is rewritten whole by every sort: tokens[lo] == v says v occurs,
    // and then first[v] was written by this sort
    const bool occurs = lo >= 0 && lo < n && tokens[lo] == (int)v;
    const long long hi = occurs ? end[v] : lo;
    if (!occurs) {
      for (long long c = tid; c < width; c += blockDim.x) row[c] = (T)0;
      continue;
    }
    for (long long start = lo; start < hi; start += PURINE_EMBED_STAGE) {
      const long long count = hi - start < PURINE_EMBED_STAGE ? hi - start : PURINE_EMBED_STAGE;
      __syncthreads();   // every thread is done with the previous stage (or row)
      for (long long k = tid; k < count; k += blockDim.x) stage[k] = order[start + k];
      __syncthreads();
      for (long long c = tid; c < width; c += blockDim.x) {
        T sum = start == lo ? (T)0 : row[c];
        long long k = 0;
        for (; k + PURINE_EMBED_BATCH <= count; k += PURINE_EMBED_BATCH) {
          T rows[PURINE_EMBED_BATCH];   // the loads first, then the adds in order
          for (int j = 0; j < PURINE_EMBED_BATCH; ++j)
            rows[j] = dy[(long long)stage[k + j] * width + c];
          for (int j = 0; j < PURINE_EMBED_BATCH; ++j) sum += rows[j];
        }
        for (; k < count; ++k) sum += dy[(long long)stage[k] * width + c];
        row[c] = sum;
      }
    }
  }
}

#define PURINE_EMBEDDING_ORDER_ENTRY(NAME, I)                                           \
  extern "C" __global__ void NAME(long long n, const I* ids, int* order, int* tokens,  \
                                  int* first, int* end) {                              \
    embedding_order_impl<I>(n, ids, order, tokens, first, end);                        \
  }

PURINE_EMBEDDING_ORDER_ENTRY(embedding_order, long long)
PURINE_EMBEDDING_ORDER_ENTRY(embedding_order_i32, int)

#define PURINE_EMBEDDING_GRAD_ENTRY(SUFFIX, T)                                          \
  extern "C" __global__ void embedding_grad_##SUFFIX(                                   \
      long long vocab, long long width, long long n, const int* order,                  \
      const int* tokens, const int* first, const int* end, const T* dy, T* dw) {        \
    embedding_grad_impl<T>(vocab, width, n, order, tokens, first, end, dy, dw);         \
  }

PURINE_EMBEDDING_GRAD_ENTRY(f32, float)
PURINE_EMBEDDING_GRAD_ENTRY(f64, double)
