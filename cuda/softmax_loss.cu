// Fused softmax + cross-entropy (Caffe's SoftmaxWithLoss), softmax over axis 1.
//
// x is viewed as (N, C, inner) with inner = prod(shape[2:]) (1 for (N, C));
// labels as (N, inner), int64 (the data reader's). For each position (n, s):
//   prob[n, :, s] = exp(x - max) / sum(exp(x - max))
//   loss[n, s]    = log(sum(exp(x - max))) - (x[label] - max)
//   valid[n, s]   = 1
// except where label == ignore_label (when has_ignore) or label == pad_label
// (when has_pad: a test graph's padding sample): loss = valid = 0.
// A label outside [0, C) gives loss = NaN (valid = 1), so a bad label file
// shows up in the loss instead of reading out of bounds.
// softmax_loss_mean then takes the batch mean, sum(loss) / max(sum(valid), 1),
// on the device (one block). Backward, per element: dx = scale * (prob -
// onehot(label)), 0 where ignored; scale = scale_value * (*scale_ptr if
// has_scale_ptr) / (*count_ptr if has_count_ptr), so the top gradient and the
// valid count (softmax_loss_count) stay on the device.
// softmax_forward / softmax_backward are the Softmax op alone (no loss):
// y = exp(x - max) / sum(exp(x - max)) and dx = y * (dy - sum_c dy * y),
// one thread per position, in place allowed.
//
// softmax_loss_forward, softmax_forward, softmax_backward and
// accuracy_forward each have a `_rows` twin, same arguments, for a position
// of many classes (the wrappers take it for inner == 1 and C >= the block
// size: GPT's loss, 16384 positions of 50304 classes; the attention
// softmax's rows): ONE BLOCK PER POSITION (grid-stride over positions), its
// threads reading the classes c = tid, tid + B, ... (coalesced, where one
// thread per row walked a whole row three times). The softmax makes one pass
// for the row's maximum and normaliser at once (the online normaliser of
// Milakov & Gimelshein 2018: each thread keeps its maximum m and its sum d
// of exp(x - m), rescaling d when m grows), combines the threads' (m, d) in
// the fixed-order trees of block_sum.cuh (the maximum, then the sum of d *
// exp(m - max) in double: no atomics, the same bits every run), then one
// pass writes exp(x - max) / sum. Everything a block reads of its row
// before the trees (x[label] too) is read before any thread writes the row,
// and each thread rewrites only the elements it reads after them, so y and
// prob may be x and dx may be dy, as in the one-thread kernels. Launched
// with PURINE_SOFTMAX_THREADS threads a block.
//
// Compiled at run time by purine_mpi.gpu.load_kernel("softmax_loss") (NVRTC,
// so no #include); one extern "C" entry point per dtype: <name>_f32, <name>_f64.

#include "block_sum.cuh"
#include "precision.cuh"

// The threads of a block of the one-block kernels (the `_rows` kernels, the
// batch means): base.py's _REDUCE_THREADS
#define PURINE_SOFTMAX_THREADS 256

#define CUDA_KERNEL_LOOP(i, n)                                              \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;      \
       i < (n); i += (long long)blockDim.x * gridDim.x)

__device__ __forceinline__ float exponential(float a) { return expf(a); }
__device__ __forceinline__ double exponential(double a) { return exp(a); }
__device__ __forceinline__ float logarithm(float a) { return logf(a); }
__device__ __forceinline__ double logarithm(double a) { return log(a); }

template <typename T> __device__ __forceinline__ T quiet_nan();
template <> __device__ __forceinline__ float quiet_nan<float>() {
  return __int_as_float(0x7fc00000);
}
template <> __device__ __forceinline__ double quiet_nan<double>() {
  return __longlong_as_double(0x7ff8000000000000LL);
}
template <typename T> __device__ __forceinline__ T negative_infinity();
template <> __device__ __forceinline__ float negative_infinity<float>() {
  return __int_as_float(0xff800000);
}
template <> __device__ __forceinline__ double negative_infinity<double>() {
  return __longlong_as_double(0xfff0000000000000LL);
}

// Whether a position's label is not counted: the layer's ignore_label or the
// padding label of a test graph's last batch (never a class).
__device__ __forceinline__ bool skipped(long long label, int ignore_label, int has_ignore,
                                        int pad_label, int has_pad) {
  return (has_ignore && label == ignore_label) || (has_pad && label == pad_label);
}

// Where position index = n * inner + s of (N, inner) starts in an (N, C,
// inner) array: element (n, 0, s); class c is inner further each.
__device__ __forceinline__ long long position_base(long long index, int channels, int inner) {
  return (index / inner) * channels * inner + index % inner;
}

// The softmax of one position (n, s) over the C classes (stride inner),
// max-shifted so exp never overflows: y[j] = exp(x[j] - max) / sum. y may be
// x (each x[j] is read before y[j] is written, the maximum before any write).
// Returns log(sum), with *largest_out the maximum (when not null): the
// cross-entropy at class j is then log(sum) - (x[j] - max), exact however
// small prob[j] is.
template <typename T>
__device__ __forceinline__ T softmax_at(const T* x, long long base, int channels,
                                        int inner, T* y, T* largest_out = nullptr) {
  T largest = x[base];
  for (int c = 1; c < channels; ++c) {
    const T v = x[base + (long long)c * inner];
    largest = v > largest ? v : largest;
  }
  T sum = T(0);
  for (int c = 0; c < channels; ++c) {
    const long long j = base + (long long)c * inner;
    const T e = exponential(x[j] - largest);
    y[j] = e;
    sum += e;
  }
  const T inv_sum = T(1) / sum;
  for (int c = 0; c < channels; ++c) {
    y[base + (long long)c * inner] *= inv_sum;
  }
  if (largest_out) *largest_out = largest;
  return logarithm(sum);
}

// The softmax of one position (n, s) as softmax_at, by a whole block (the
// `_rows` kernels; every thread calls it): one read pass of the online
// maximum and normaliser, the block's trees, one pass writing y. The trees
// hold every thread at a barrier until all have read the row, so y may be x,
// and what a thread read of the row before the call is x's. Returns
// log(sum) and *largest_out the maximum, as softmax_at. A row of -inf only
// (or with +inf or NaN) gives NaN, as softmax_at.
template <typename T>
__device__ __forceinline__ T softmax_row(const T* x, long long base, int channels, int inner,
                                         T* y, double* shared, T* largest_out = nullptr) {
  T m = negative_infinity<T>();
  double d = 0.0;   // sum of exp(x - m) over this thread's classes
  for (int c = threadIdx.x; c < channels; c += blockDim.x) {
    const T v = x[base + (long long)c * inner];
    if (v > m) {
      d = d * (double)exponential(m - v) + 1.0;
      m = v;
    } else if (v != negative_infinity<T>()) {   // -inf adds 0 (not exp(-inf + inf))
      d += (double)exponential(v - m);
    }
  }
  const T largest = (T)purine_block_max((double)m, shared);
  const double sum = purine_block_sum(d * exponential((double)m - (double)largest), shared);
  const T inv_sum = (T)(1.0 / sum);
  for (int c = threadIdx.x; c < channels; c += blockDim.x) {
    const long long j = base + (long long)c * inner;
    y[j] = exponential(x[j] - largest) * inv_sum;
  }
  if (largest_out) *largest_out = largest;
  return (T)logarithm(sum);
}

// The loss of a position from its label, log(sum) and maximum: loss, valid
// as the header says (picked: x[label], read before y was written).
template <typename T>
__device__ __forceinline__ void position_loss(long long index, long long label, int channels,
                                              bool skip, T picked, T log_sum, T largest,
                                              T* loss, T* valid) {
  if (skip) {
    loss[index] = T(0);
    valid[index] = T(0);
  } else if (label < 0 || label >= channels) {
    loss[index] = quiet_nan<T>();
    valid[index] = T(1);
  } else {
    // -log softmax at the label as the CPU op computes it (no clamp of
    // prob: a clamp at FLT_MIN capped each position's loss at 87.3 nats)
    loss[index] = log_sum - (picked - largest);
    valid[index] = T(1);
  }
}

// One thread per position (n, s); loops over the C classes (stride inner).
template <typename T>
__device__ void softmax_loss_forward_impl(long long total, const T* x,
                                          const long long* labels, int channels,
                                          int inner, int ignore_label,
                                          int has_ignore, int pad_label, int has_pad,
                                          T* prob, T* loss, T* valid) {
  CUDA_KERNEL_LOOP(index, total) {
    const long long base = position_base(index, channels, inner);
    // x[label] is read before softmax_at overwrites it (prob may be x)
    const long long label = labels[index];
    const bool skip = skipped(label, ignore_label, has_ignore, pad_label, has_pad);
    const bool counted = !skip && label >= 0 && label < channels;
    const T picked = counted ? x[base + label * inner] : T(0);
    T largest;
    const T log_sum = softmax_at(x, base, channels, inner, prob, &largest);
    position_loss(index, label, channels, skip, picked, log_sum, largest, loss, valid);
  }
}

// One block per position (n, s) (the `_rows` twin): the same formulas, the
// normaliser summed in double.
template <typename T>
__device__ void softmax_loss_forward_rows_impl(long long total, const T* x,
                                               const long long* labels, int channels,
                                               int inner, int ignore_label,
                                               int has_ignore, int pad_label, int has_pad,
                                               T* prob, T* loss, T* valid) {
  __shared__ double shared[PURINE_SOFTMAX_THREADS];
  for (long long index = blockIdx.x; index < total; index += gridDim.x) {
    const long long base = position_base(index, channels, inner);
    const long long label = labels[index];
    const bool skip = skipped(label, ignore_label, has_ignore, pad_label, has_pad);
    const bool counted = !skip && label >= 0 && label < channels;
    // read before softmax_row's barriers, so before any thread writes the
    // row (prob may be x)
    const T picked = (counted && threadIdx.x == 0) ? x[base + label * inner] : T(0);
    T largest;
    const T log_sum = softmax_row(x, base, channels, inner, prob, shared, &largest);
    if (threadIdx.x == 0) {
      position_loss(index, label, channels, skip, picked, log_sum, largest, loss, valid);
    }
  }
}

// One thread per element (n, c, s) of prob.
template <typename T>
__device__ void softmax_loss_backward_impl(long long total, const T* prob,
                                           const long long* labels, int channels,
                                           int inner, int ignore_label,
                                           int has_ignore, int pad_label, int has_pad,
                                           T scale_value,
                                           const T* scale_ptr,
                                           int has_scale_ptr, const T* count_ptr,
                                           int has_count_ptr, T* dx) {
  T scale = has_scale_ptr ? scale_value * scale_ptr[0] : scale_value;
  if (has_count_ptr) scale = scale / count_ptr[0];
  CUDA_KERNEL_LOOP(index, total) {
    const int s = (int)(index % inner);
    const int c = (int)((index / inner) % channels);
    const long long n = index / ((long long)inner * channels);
    const long long label = labels[n * inner + s];
    if (skipped(label, ignore_label, has_ignore, pad_label, has_pad)) {
      dx[index] = T(0);
    } else {
      dx[index] = scale * (prob[index] - (c == label ? T(1) : T(0)));
    }
  }
}

// ------------------------------------------------ vectorized row kernels ---
// softmax_loss_forward_vec / softmax_loss_backward_vec: the loss's kernels
// for rows of many classes (inner == 1, C >= the block size: GPT's 16384 x
// 50304 logits), made memory-bound; the `_rows` forward and the
// one-thread-per-element backward stay (inner > 1, few classes, and
// benchmarks/loss_kernel_gpu.py times old against new). Per row, a float
// row whose base is 16-byte aligned the same way in x and in the output is
// read and written four floats at a time (float4), each thread its own
// chunks of four: a scalar head up to the first aligned element and a
// scalar tail of fewer than four (C not a multiple of 4, an unaligned
// base; a double row, or x and the output misaligned differently: all of
// it the scalar way). Forward: each thread keeps a float maximum m and
// sum d of exp(x - m), rescaled once per chunk of four (the chunk's
// maximum first), not per element; the block combines the threads' (m,
// d) in double in the fixed-order trees as `_rows` (the same bits every
// run), then writes prob = exp(x - max) * (1 / sum) by the same chunks.
// Each thread writes only what it read, after the trees' barriers, so
// prob may be x. Backward: one block per tile of a row (4 * blockDim.x
// elements; grid-stride over rows x tiles), the label read once per tile,
// dx = scale * (prob - onehot) four at a time; dx may be prob.

#ifdef __CUDACC__
typedef float4 purine_float4;
#else
struct alignas(16) purine_float4 { float x, y, z, w; };
#endif

// How many elements of a row (x's at xr, the output's at yr) go the scalar
// way before the first element where both are 16-byte aligned: C when the
// row is not vectorized (a double, or x and y misaligned differently).
template <typename T>
__device__ __forceinline__ int vec_head(const T* xr, const T* yr, int channels) {
  return channels;
}
template <>
__device__ __forceinline__ int vec_head<float>(const float* xr, const float* yr,
                                               int channels) {
  const unsigned long long a = (unsigned long long)(const void*)xr;
  const unsigned long long b = (unsigned long long)(const void*)yr;
  if (((a ^ b) & 15ULL) != 0 || (a & 3ULL) != 0) return channels;
  const int head = (int)(((16ULL - (a & 15ULL)) & 15ULL) / 4ULL);
  return head < channels ? head : channels;
}

// One value into a thread's online (m, d): float, as the chunks.
template <typename T>
__device__ __forceinline__ void online_one(T v, T& m, T& d) {
  if (v > m) {
    d = d * exponential(m - v) + T(1);
    m = v;
  } else if (v != negative_infinity<T>()) {   // -inf adds 0 (not exp(-inf + inf))
    d += exponential(v - m);
  }
}

// Four values: their maximum first, one rescale of d, then four exps. A
// NaN is passed over by the maximum and makes d NaN in the sum (as the
// element-wise update: the row's loss and prob are NaN).
__device__ __forceinline__ void online_four(float v0, float v1, float v2, float v3,
                                            float& m, float& d) {
  float lm = v0 > v1 ? v0 : v1;
  const float l2 = v2 > v3 ? v2 : v3;
  lm = lm > l2 ? lm : l2;
  if (lm > m) {
    d = d * expf(m - lm);   // m = -inf: 0 * 0
    m = lm;
  }
  const float ninf = negative_infinity<float>();
  d += (v0 != ninf ? expf(v0 - m) : 0.0f) + (v1 != ninf ? expf(v1 - m) : 0.0f) +
       (v2 != ninf ? expf(v2 - m) : 0.0f) + (v3 != ninf ? expf(v3 - m) : 0.0f);
}


// The vector loops: this thread's chunks k = tid, tid + blockDim.x, ... of
// `vectors` chunks of four at p (16-byte aligned); nothing for a double
// (vec_head makes every double row scalar).
template <typename T>
__device__ __forceinline__ void vec_online(const T* p, int vectors, T& m, T& d) {}
template <>
__device__ __forceinline__ void vec_online<float>(const float* p, int vectors, float& m,
                                                  float& d) {
  const purine_float4* xv = (const purine_float4*)(const void*)p;
  const int threads = blockDim.x;
  int k = threadIdx.x;
  // two chunks' loads in flight before their updates (the same order of
  // updates, so the same bits, as one chunk at a time)
  for (; k + threads < vectors; k += 2 * threads) {
    const purine_float4 a = xv[k];
    const purine_float4 b = xv[k + threads];
    online_four(a.x, a.y, a.z, a.w, m, d);
    online_four(b.x, b.y, b.z, b.w, m, d);
  }
  if (k < vectors) {
    const purine_float4 a = xv[k];
    online_four(a.x, a.y, a.z, a.w, m, d);
  }
}
template <typename T>
__device__ __forceinline__ void vec_write(const T* p, int vectors, T largest, T inv_sum,
                                          T* y) {}
template <>
__device__ __forceinline__ void vec_write<float>(const float* p, int vectors, float largest,
                                                 float inv_sum, float* y) {
  const purine_float4* xv = (const purine_float4*)(const void*)p;
  purine_float4* yv = (purine_float4*)(void*)y;
  for (int k = threadIdx.x; k < vectors; k += blockDim.x) {
    purine_float4 v = xv[k];
    v.x = expf(v.x - largest) * inv_sum;
    v.y = expf(v.y - largest) * inv_sum;
    v.z = expf(v.z - largest) * inv_sum;
    v.w = expf(v.w - largest) * inv_sum;
    yv[k] = v;
  }
}
// chunk k (classes c0 .. c0 + 3) of dx = s * (prob - onehot(label))
template <typename T>
__device__ __forceinline__ void vec_grad(const T* p, long long k, long long c0,
                                         long long label, T s, T* dx) {}
template <>
__device__ __forceinline__ void vec_grad<float>(const float* p, long long k, long long c0,
                                                long long label, float s, float* dx) {
  purine_float4 v = ((const purine_float4*)(const void*)p)[k];
  v.x = s * (v.x - (c0 == label ? 1.0f : 0.0f));
  v.y = s * (v.y - (c0 + 1 == label ? 1.0f : 0.0f));
  v.z = s * (v.z - (c0 + 2 == label ? 1.0f : 0.0f));
  v.w = s * (v.w - (c0 + 3 == label ? 1.0f : 0.0f));
  ((purine_float4*)(void*)dx)[k] = v;
}

template <typename T>
__device__ __forceinline__ T softmax_row_vec(const T* xr, int channels, T* yr,
                                             double* shared, T* largest_out) {
  const int head = vec_head(xr, yr, channels);
  const int vectors = (channels - head) / 4;
  const int tail = head + 4 * vectors;
  const int tid = threadIdx.x, threads = blockDim.x;
  T m = negative_infinity<T>();
  T d = T(0);
  for (int c = tid; c < head; c += threads) online_one(xr[c], m, d);
  vec_online(xr + head, vectors, m, d);
  for (int c = tail + tid; c < channels; c += threads) online_one(xr[c], m, d);
  const double big = purine_block_max((double)m, shared);
  const double sum = purine_block_sum((double)d * exp((double)m - big), shared);
  const T largest = (T)big;
  const T inv_sum = (T)(1.0 / sum);
  for (int c = tid; c < head; c += threads) yr[c] = exponential(xr[c] - largest) * inv_sum;
  vec_write(xr + head, vectors, largest, inv_sum, yr + head);
  for (int c = tail + tid; c < channels; c += threads)
    yr[c] = exponential(xr[c] - largest) * inv_sum;
  *largest_out = largest;
  return (T)log(sum);
}

// (N, C) rows only (inner 1); the arguments of softmax_loss_forward.
template <typename T>
__device__ void softmax_loss_forward_vec_impl(long long total, const T* x,
                                              const long long* labels, int channels,
                                              int inner, int ignore_label,
                                              int has_ignore, int pad_label, int has_pad,
                                              T* prob, T* loss, T* valid) {
  __shared__ double shared[PURINE_SOFTMAX_THREADS];
  for (long long index = blockIdx.x; index < total; index += gridDim.x) {
    const long long base = index * (long long)channels;
    const long long label = labels[index];
    const bool skip = skipped(label, ignore_label, has_ignore, pad_label, has_pad);
    const bool counted = !skip && label >= 0 && label < channels;
    // read before the trees' barriers, so before any thread writes the row
    const T picked = (counted && threadIdx.x == 0) ? x[base + label] : T(0);
    T largest;
    const T log_sum = softmax_row_vec(x + base, channels, prob + base, shared, &largest);
    if (threadIdx.x == 0) {
      position_loss(index, label, channels, skip, picked, log_sum, largest, loss, valid);
    }
  }
}

// (N, C) rows only; the arguments of softmax_loss_backward (total: N * C).
// Launched with blockDim.x threads, grid-stride over N * tiles tiles.
template <typename T>
__device__ void softmax_loss_backward_vec_impl(long long total, const T* prob,
                                               const long long* labels, int channels,
                                               int inner, int ignore_label,
                                               int has_ignore, int pad_label, int has_pad,
                                               T scale_value, const T* scale_ptr,
                                               int has_scale_ptr, const T* count_ptr,
                                               int has_count_ptr, T* dx) {
  T scale = has_scale_ptr ? scale_value * scale_ptr[0] : scale_value;
  if (has_count_ptr) scale = scale / count_ptr[0];
  const long long rows = total / channels;
  const int threads = blockDim.x, tid = threadIdx.x;
  const long long span = 4LL * threads;                    // elements a tile
  const long long tiles = (channels + span - 1) / span;    // tiles a row
  // tile t = row * tiles + tile, stepped by gridDim.x without a division a tile
  const long long step_rows = gridDim.x / tiles, step_tiles = gridDim.x % tiles;
  long long row = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  for (; row < rows; row += step_rows, tile += step_tiles) {
    if (tile >= tiles) {
      tile -= tiles;
      if (++row >= rows) break;
    }
    const long long base = row * (long long)channels;
    const long long label = labels[row];
    const T s = skipped(label, ignore_label, has_ignore, pad_label, has_pad) ? T(0) : scale;
    const T* pr = prob + base;
    T* dr = dx + base;
    const int head = vec_head(pr, (const T*)dr, channels);
    const int vectors = (channels - head) / 4;
    const int tail = head + 4 * vectors;
    // tile `tile` covers vectors [tile * threads, (tile + 1) * threads), the
    // first tile the head too, the last the tail; a tile past the vectors
    // (a scalar row) covers elements [tile * span, (tile + 1) * span)
    if (vectors == 0) {
      for (long long c = tile * span + tid; c < channels && c < (tile + 1) * span;
           c += threads)
        dr[c] = s * (pr[c] - (c == label ? T(1) : T(0)));
      continue;
    }
    if (tile == 0) {
      for (int c = tid; c < head; c += threads)
        dr[c] = s * (pr[c] - (c == label ? T(1) : T(0)));
    }
    if (tile == tiles - 1) {
      for (int c = tail + tid; c < channels; c += threads)
        dr[c] = s * (pr[c] - (c == label ? T(1) : T(0)));
    }
    const long long k = tile * threads + tid;
    if (k < vectors) {
      vec_grad(pr + head, k, head + 4 * k, label, s, dr + head);
    }
  }
}

// ------------------------------------------------- bfloat16 bits rows ---
// softmax_loss_forward_bits_f32 / softmax_loss_grad_bits_f32 (and its
// float32-dx twin softmax_loss_grad_bx_f32): the from_logits loss on (N, C)
// logits stored as bfloat16 bits (uint16, bf16 storage), read as bits and
// widened in registers (exact), so no float32 copy of the logits, of the
// probabilities or of dx exists. The arithmetic is the float32 `_vec`
// kernels' -- the same online (m, d) per thread, rescaled once per chunk of
// four (online_four), the same double trees, the same formulas -- and the
// same PARTITION of a row over the threads: a scalar head up to the first
// element whose bits are 8-byte aligned (4 values: the `_vec` kernel's
// float4 chunk is 16 bytes of float32, 8 of bits), chunks of four k = tid,
// tid + blockDim.x, ... (two loads in flight, updated in order), a scalar
// tail. A row whose bits sit at element offset o (mod 4) from the 8-byte
// grid is therefore reduced exactly as the `_vec` kernel reduces its
// widened float32 copy sitting at float offset o (mod 4) from the 16-byte
// grid: the same bits of loss and of dx as widening the bits into float32
// (an aligned buffer for aligned bits) and running softmax_loss_forward_vec
// then softmax_loss_backward_vec and to_bf16_bits. The loads are 8 bytes a
// thread (uint2, a warp's 256 contiguous bytes: coalesced), not 16: a
// 16-byte load of 8 values would give two consecutive chunks to one thread
// and change the order of the float sums (other bits than the float path).
// One block a row, grid-stride over the rows. Forward: loss and valid only
// (no probabilities: the from_logits loss has none). Gradient: the row's
// reduction, then dx = s * (exp(x - max) * (1 / sum) - onehot) written by
// the same chunks -- rounded to nearest even into bits (purine_round_bf16,
// to_bf16_bits's rounding) or float32 -- each thread writing only what it
// read, after the trees' barriers, so dx may be x (in place). The product
// exp * (1 / sum) is __fmul_rn: never contracted with the subtraction of
// the one-hot into an FMA, so it is the float probability the float path
// stores and reads back.

// The first element of a bits row at xr whose address is 8-byte aligned
// (capped at C): vec_head's rule for bits.
__device__ __forceinline__ int bits_head(const unsigned short* xr, int channels) {
  const unsigned long long a = (unsigned long long)(const void*)xr;
  if ((a & 1ULL) != 0) return channels;
  const int head = (int)(((8ULL - (a & 7ULL)) & 7ULL) / 2ULL);
  return head < channels ? head : channels;
}

__device__ __forceinline__ float bits_lo(unsigned int w) { return purine_bits_float(w << 16); }
__device__ __forceinline__ float bits_hi(unsigned int w) {
  return purine_bits_float(w & 0xffff0000u);
}

// A row's online reduction, the trees, and the results: as softmax_row_vec
// on the widened row (head, vectors, tail as bits_head gives them).
__device__ __forceinline__ void bits_row_reduce(const unsigned short* xr, int channels,
                                                int head, int vectors, double* shared,
                                                float* largest_out, float* inv_sum_out,
                                                double* sum_out) {
  const int tail = head + 4 * vectors;
  const int tid = threadIdx.x, threads = blockDim.x;
  float m = negative_infinity<float>();
  float d = 0.0f;
  for (int c = tid; c < head; c += threads) online_one(purine_bf16_float(xr[c]), m, d);
  const uint2* xv = (const uint2*)(const void*)(xr + head);
  int k = tid;
  for (; k + threads < vectors; k += 2 * threads) {
    const uint2 a = xv[k];
    const uint2 b = xv[k + threads];
    online_four(bits_lo(a.x), bits_hi(a.x), bits_lo(a.y), bits_hi(a.y), m, d);
    online_four(bits_lo(b.x), bits_hi(b.x), bits_lo(b.y), bits_hi(b.y), m, d);
  }
  if (k < vectors) {
    const uint2 a = xv[k];
    online_four(bits_lo(a.x), bits_hi(a.x), bits_lo(a.y), bits_hi(a.y), m, d);
  }
  for (int c = tail + tid; c < channels; c += threads)
    online_one(purine_bf16_float(xr[c]), m, d);
  const double big = purine_block_max((double)m, shared);
  const double sum = purine_block_sum((double)d * exp((double)m - big), shared);
  *largest_out = (float)big;
  *inv_sum_out = (float)(1.0 / sum);
  *sum_out = sum;
}

__device__ void softmax_loss_forward_bits_impl(long long total, const unsigned short* x,
                                               const long long* labels, int channels,
                                               int ignore_label, int has_ignore,
                                               int pad_label, int has_pad, float* loss,
                                               float* valid) {
  __shared__ double shared[PURINE_SOFTMAX_THREADS];
  for (long long index = blockIdx.x; index < total; index += gridDim.x) {
    const unsigned short* xr = x + index * (long long)channels;
    const long long label = labels[index];
    const bool skip = skipped(label, ignore_label, has_ignore, pad_label, has_pad);
    const bool counted = !skip && label >= 0 && label < channels;
    const float picked = (counted && threadIdx.x == 0) ? purine_bf16_float(xr[label]) : 0.0f;
    const int head = bits_head(xr, channels);
    float largest, inv_sum;
    double sum;
    bits_row_reduce(xr, channels, head, (channels - head) / 4, shared, &largest, &inv_sum,
                    &sum);
    if (threadIdx.x == 0) {
      position_loss(index, label, channels, skip, picked, (float)log(sum), largest, loss,
                    valid);
    }
  }
}

// dx's element: bits (rounded to nearest even) or float32
__device__ __forceinline__ void grad_store(unsigned short* dx, long long i, float v) {
  dx[i] = (unsigned short)(purine_round_bf16(purine_float_bits(v)) >> 16);
}
__device__ __forceinline__ void grad_store(float* dx, long long i, float v) { dx[i] = v; }
__device__ __forceinline__ void grad_store4(unsigned short* dx, long long k, float v0, float v1,
                                            float v2, float v3) {
  uint2 u;
  u.x = (purine_round_bf16(purine_float_bits(v0)) >> 16) |
        (purine_round_bf16(purine_float_bits(v1)) & 0xffff0000u);
  u.y = (purine_round_bf16(purine_float_bits(v2)) >> 16) |
        (purine_round_bf16(purine_float_bits(v3)) & 0xffff0000u);
  ((uint2*)(void*)dx)[k] = u;
}
__device__ __forceinline__ void grad_store4(float* dx, long long k, float v0, float v1,
                                            float v2, float v3) {
  purine_float4 v;
  v.x = v0;
  v.y = v1;
  v.z = v2;
  v.w = v3;
  ((purine_float4*)(void*)dx)[k] = v;
}
// Whether dx's row at dr takes dx's chunks where x's row at xr has its own:
// bits rows aligned alike (mod 8 bytes), a float32 row at the same element
// offset from the 16-byte grid.
__device__ __forceinline__ bool grad_aligned(const unsigned short* xr, const unsigned short* dr) {
  return ((((unsigned long long)(const void*)xr) ^ ((unsigned long long)(const void*)dr)) &
          7ULL) == 0;
}
__device__ __forceinline__ bool grad_aligned(const unsigned short* xr, const float* dr) {
  const unsigned long long a = (unsigned long long)(const void*)xr;
  const unsigned long long b = (unsigned long long)(const void*)dr;
  return (b & 3ULL) == 0 && ((a >> 1) & 3ULL) == ((b >> 2) & 3ULL);
}

// the gradient of one element: s * (prob - onehot), prob as the float path stores it
__device__ __forceinline__ float grad_value(float v, float largest, float inv_sum, float s,
                                            long long c, long long label) {
  const float p = __fmul_rn(expf(v - largest), inv_sum);
  return s * (p - (c == label ? 1.0f : 0.0f));
}

template <typename D>
__device__ void softmax_loss_grad_bits_impl(long long total, const unsigned short* x,
                                            const long long* labels, int channels,
                                            int ignore_label, int has_ignore, int pad_label,
                                            int has_pad, float scale_value,
                                            const float* scale_ptr, int has_scale_ptr,
                                            const float* count_ptr, int has_count_ptr, D* dx) {
  __shared__ double shared[PURINE_SOFTMAX_THREADS];
  float scale = has_scale_ptr ? scale_value * scale_ptr[0] : scale_value;
  if (has_count_ptr) scale = scale / count_ptr[0];
  const int tid = threadIdx.x, threads = blockDim.x;
  for (long long index = blockIdx.x; index < total; index += gridDim.x) {
    const long long base = index * (long long)channels;
    const unsigned short* xr = x + base;
    D* dr = dx + base;
    const long long label = labels[index];
    const float s = skipped(label, ignore_label, has_ignore, pad_label, has_pad) ? 0.0f : scale;
    const int head = bits_head(xr, channels);
    const int vectors = (channels - head) / 4;
    float largest, inv_sum;
    double sum;
    bits_row_reduce(xr, channels, head, vectors, shared, &largest, &inv_sum, &sum);
    // after the trees' barriers: every thread has read the row
    if (grad_aligned(xr, dr)) {
      const int tail = head + 4 * vectors;
      for (int c = tid; c < head; c += threads)
        grad_store(dr, c, grad_value(purine_bf16_float(xr[c]), largest, inv_sum, s, c, label));
      const uint2* xv = (const uint2*)(const void*)(xr + head);
      for (int k = tid; k < vectors; k += threads) {
        const uint2 a = xv[k];
        const long long c0 = head + 4LL * k;
        grad_store4(dr + head, k, grad_value(bits_lo(a.x), largest, inv_sum, s, c0, label),
                    grad_value(bits_hi(a.x), largest, inv_sum, s, c0 + 1, label),
                    grad_value(bits_lo(a.y), largest, inv_sum, s, c0 + 2, label),
                    grad_value(bits_hi(a.y), largest, inv_sum, s, c0 + 3, label));
      }
      for (int c = tail + tid; c < channels; c += threads)
        grad_store(dr, c, grad_value(purine_bf16_float(xr[c]), largest, inv_sum, s, c, label));
    } else {   // dx off x's grid (never x itself): one element a thread
      for (int c = tid; c < channels; c += threads)
        grad_store(dr, c, grad_value(purine_bf16_float(xr[c]), largest, inv_sum, s, c, label));
    }
  }
}

extern "C" __global__ void softmax_loss_forward_bits_f32(
    long long total, const unsigned short* x, const long long* labels, int channels,
    int ignore_label, int has_ignore, int pad_label, int has_pad, float* loss, float* valid) {
  softmax_loss_forward_bits_impl(total, x, labels, channels, ignore_label, has_ignore,
                                 pad_label, has_pad, loss, valid);
}

extern "C" __global__ void softmax_loss_grad_bits_f32(
    long long total, const unsigned short* x, const long long* labels, int channels,
    int ignore_label, int has_ignore, int pad_label, int has_pad, float scale_value,
    const float* scale_ptr, int has_scale_ptr, const float* count_ptr, int has_count_ptr,
    unsigned short* dx) {
  softmax_loss_grad_bits_impl<unsigned short>(total, x, labels, channels, ignore_label,
                                              has_ignore, pad_label, has_pad, scale_value,
                                              scale_ptr, has_scale_ptr, count_ptr,
                                              has_count_ptr, dx);
}

extern "C" __global__ void softmax_loss_grad_bx_f32(
    long long total, const unsigned short* x, const long long* labels, int channels,
    int ignore_label, int has_ignore, int pad_label, int has_pad, float scale_value,
    const float* scale_ptr, int has_scale_ptr, const float* count_ptr, int has_count_ptr,
    float* dx) {
  softmax_loss_grad_bits_impl<float>(total, x, labels, channels, ignore_label, has_ignore,
                                     pad_label, has_pad, scale_value, scale_ptr,
                                     has_scale_ptr, count_ptr, has_count_ptr, dx);
}

// The batch mean in one block (a fixed-order tree in double, no atomics):
//   out_loss = sum(loss) / max(sum(valid), 1)
// and, when has_count, out_count = max(sum(valid), 1). Launched with one
// block of at most PURINE_SOFTMAX_THREADS threads.

__device__ __forceinline__ void purine_block_sum2(double* a, double* b) {
  const unsigned int tid = threadIdx.x;
  for (unsigned int stride = 1; stride < blockDim.x; stride <<= 1) {
    if (tid % (2 * stride) == 0 && tid + stride < blockDim.x) {
      a[tid] += a[tid + stride];
      b[tid] += b[tid + stride];
    }
    __syncthreads();
  }
}

// sums[0] of thread 0 of block 0: sum(x) and sum(y) over ``total`` elements
// in double, each thread's strided slice then the fixed-order tree; every
// thread of the block calls it (it synchronises them).
template <typename T>
__device__ __forceinline__ void purine_pair_sums(long long total, const T* x, const T* y,
                                                 double* sum_x, double* sum_y) {
  const unsigned int tid = threadIdx.x;
  double a = 0.0, b = 0.0;
  if (blockIdx.x == 0) {
    for (long long i = tid; i < total; i += blockDim.x) {
      a += (double)x[i];
      b += (double)y[i];
    }
  }
  sum_x[tid] = a;
  sum_y[tid] = b;
  __syncthreads();
  purine_block_sum2(sum_x, sum_y);
}

template <typename T>
__device__ void softmax_loss_mean_impl(long long total, const T* loss, const T* valid,
                                       T* out_loss, T* out_count, int has_count) {
  __shared__ double sum_loss[PURINE_SOFTMAX_THREADS];
  __shared__ double sum_valid[PURINE_SOFTMAX_THREADS];
  const unsigned int tid = threadIdx.x;
  purine_pair_sums(total, loss, valid, sum_loss, sum_valid);
  if (blockIdx.x == 0 && tid == 0) {
    const double count = sum_valid[0] > 1.0 ? sum_valid[0] : 1.0;
    out_loss[0] = (T)(sum_loss[0] / count);
    if (has_count) out_count[0] = (T)count;
  }
}

// The loss normaliser alone, from the labels (the backward of a loss with an
// ignore_label or a pad_label): out_count = max(number of labels counted,
// floor); floor 1 for the normaliser, 0 for the count itself (the test
// pass's weight of a batch, ops/softmax.py CountedPositions).
template <typename T>
__device__ void softmax_loss_count_impl(long long total, const long long* labels,
                                        int ignore_label, int has_ignore, int pad_label,
                                        int has_pad, T* out_count, int floor) {
  __shared__ double counted[PURINE_SOFTMAX_THREADS];
  __shared__ double unused[PURINE_SOFTMAX_THREADS];
  const unsigned int tid = threadIdx.x;
  double a = 0.0;
  if (blockIdx.x == 0) {
    for (long long i = tid; i < total; i += blockDim.x) {
      a += !skipped(labels[i], ignore_label, has_ignore, pad_label, has_pad);
    }
  }
  counted[tid] = a;
  unused[tid] = 0.0;
  __syncthreads();
  purine_block_sum2(counted, unused);
  if (blockIdx.x == 0 && tid == 0)
    out_count[0] = (T)(counted[0] > (double)floor ? counted[0] : (double)floor);
}

// Softmax alone over axis 1 (the Softmax op; the GPU's path, which a CUDA
// graph can capture): one thread per position (n, s); y may be x.
template <typename T>
__device__ void softmax_forward_impl(long long total, const T* x, int channels, int inner,
                                     T* y) {
  CUDA_KERNEL_LOOP(index, total) {
    const long long base = position_base(index, channels, inner);
    softmax_at(x, base, channels, inner, y);
  }
}

// One block per position (the `_rows` twin).
template <typename T>
__device__ void softmax_forward_rows_impl(long long total, const T* x, int channels,
                                          int inner, T* y) {
  __shared__ double shared[PURINE_SOFTMAX_THREADS];
  for (long long index = blockIdx.x; index < total; index += gridDim.x) {
    softmax_row(x, position_base(index, channels, inner), channels, inner, y, shared);
  }
}

// Its gradient: dx = y * (dy - sum_c dy * y), one thread per position; dx
// may be dy's storage (the dot product is read before any write).
template <typename T>
__device__ void softmax_backward_impl(long long total, const T* dy, const T* y, int channels,
                                      int inner, T* dx) {
  CUDA_KERNEL_LOOP(index, total) {
    const long long base = position_base(index, channels, inner);
    T dot = T(0);
    for (int c = 0; c < channels; ++c) {
      const long long j = base + (long long)c * inner;
      dot += dy[j] * y[j];
    }
    for (int c = 0; c < channels; ++c) {
      const long long j = base + (long long)c * inner;
      dx[j] = y[j] * (dy[j] - dot);
    }
  }
}

// One block per position (the `_rows` twin): the dot product in double,
// the block's fixed-order tree; its barriers come after every read of dy
// for it, and each thread then rewrites only its own elements (dx may be dy).
template <typename T>
__device__ void softmax_backward_rows_impl(long long total, const T* dy, const T* y,
                                           int channels, int inner, T* dx) {
  __shared__ double shared[PURINE_SOFTMAX_THREADS];
  for (long long index = blockIdx.x; index < total; index += gridDim.x) {
    const long long base = position_base(index, channels, inner);
    double part = 0.0;
    for (int c = threadIdx.x; c < channels; c += blockDim.x) {
      const long long j = base + (long long)c * inner;
      part += (double)dy[j] * (double)y[j];
    }
    const T dot = (T)purine_block_sum(part, shared);
    for (int c = threadIdx.x; c < channels; c += blockDim.x) {
      const long long j = base + (long long)c * inner;
      dx[j] = y[j] * (dy[j] - dot);
    }
  }
}

// Accuracy (top-k), the test-time metric: one thread per position (n, s).
// correct = 1 when fewer than top_k classes besides the true one score at
// least the true class's score (a tie counts against it, as Caffe) and
// every score of the position is finite; valid = 1; both 0 where label ==
// ignore_label or pad_label (when has_ignore, has_pad); a label outside
// [0, C) gives valid = NaN, so the accuracy is NaN (never a number) for a
// bad label file.
template <typename T>
__device__ void accuracy_forward_impl(long long total, const T* x, const long long* labels,
                                      int channels, int inner, int ignore_label,
                                      int has_ignore, int pad_label, int has_pad, int top_k,
                                      T* correct, T* valid) {
  CUDA_KERNEL_LOOP(index, total) {
    const long long label = labels[index];
    if (skipped(label, ignore_label, has_ignore, pad_label, has_pad)) {
      correct[index] = T(0);
      valid[index] = T(0);
      continue;
    }
    if (label < 0 || label >= channels) {
      correct[index] = T(0);
      valid[index] = quiet_nan<T>();
      continue;
    }
    const long long base = position_base(index, channels, inner);
    const T truth = x[base + label * inner];
    int at_least = 0;
    bool finite = true;
    for (int c = 0; c < channels; ++c) {
      const T v = x[base + (long long)c * inner];
      finite = finite && isfinite(v);
      at_least += v >= truth;
    }
    correct[index] = (finite && at_least - 1 < top_k) ? T(1) : T(0);
    valid[index] = T(1);
  }
}

// One block per position (the `_rows` twin): the threads count their
// classes, the block's trees add the counts (exact in double).
template <typename T>
__device__ void accuracy_forward_rows_impl(long long total, const T* x, const long long* labels,
                                           int channels, int inner, int ignore_label,
                                           int has_ignore, int pad_label, int has_pad,
                                           int top_k, T* correct, T* valid) {
  __shared__ double shared[PURINE_SOFTMAX_THREADS];
  for (long long index = blockIdx.x; index < total; index += gridDim.x) {
    const long long label = labels[index];
    const bool skip = skipped(label, ignore_label, has_ignore, pad_label, has_pad);
    // the same for the whole block: no thread waits at a barrier alone
    if (skip || label < 0 || label >= channels) {
      if (threadIdx.x == 0) {
        correct[index] = T(0);
        valid[index] = skip ? T(0) : quiet_nan<T>();
      }
      continue;
    }
    const long long base = position_base(index, channels, inner);
    const T truth = x[base + label * inner];
    double at_least = 0.0, not_finite = 0.0;
    for (int c = threadIdx.x; c < channels; c += blockDim.x) {
      const T v = x[base + (long long)c * inner];
      not_finite += !isfinite(v);
      at_least += v >= truth;
    }
    at_least = purine_block_sum(at_least, shared);
    not_finite = purine_block_sum(not_finite, shared);
    if (threadIdx.x == 0) {
      correct[index] = (not_finite == 0.0 && at_least - 1.0 < (double)top_k) ? T(1) : T(0);
      valid[index] = T(1);
    }
  }
}

// out = sum(correct) / sum(valid), 0 without a valid position, NaN with a
// bad label; one block, fixed-order sums in double.
template <typename T>
__device__ void accuracy_mean_impl(long long total, const T* correct, const T* valid, T* out) {
  __shared__ double sum_correct[PURINE_SOFTMAX_THREADS];
  __shared__ double sum_valid[PURINE_SOFTMAX_THREADS];
  purine_pair_sums(total, correct, valid, sum_correct, sum_valid);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const double v = sum_valid[0];
    out[0] = v != v ? quiet_nan<T>() : (v > 0.0 ? (T)(sum_correct[0] / v) : T(0));
  }
}

#define PURINE_ACCURACY_ENTRY(SUFFIX, T)                                                \
  extern "C" __global__ void accuracy_forward_##SUFFIX(                                 \
      long long total, const T* x, const long long* labels, int channels, int inner,    \
      int ignore_label, int has_ignore, int pad_label, int has_pad, int top_k,          \
      T* correct, T* valid) {                                                           \
    accuracy_forward_impl<T>(total, x, labels, channels, inner, ignore_label,           \
                             has_ignore, pad_label, has_pad, top_k, correct, valid);    \
  }                                                                                     \
  extern "C" __global__ void accuracy_forward_rows_##SUFFIX(                            \
      long long total, const T* x, const long long* labels, int channels, int inner,    \
      int ignore_label, int has_ignore, int pad_label, int has_pad, int top_k,          \
      T* correct, T* valid) {                                                           \
    accuracy_forward_rows_impl<T>(total, x, labels, channels, inner, ignore_label,      \
                                  has_ignore, pad_label, has_pad, top_k, correct,       \
                                  valid);                                               \
  }                                                                                     \
  extern "C" __global__ void accuracy_mean_##SUFFIX(long long total, const T* correct,  \
                                                    const T* valid, T* out) {           \
    accuracy_mean_impl<T>(total, correct, valid, out);                                  \
  }

PURINE_ACCURACY_ENTRY(f32, float)
PURINE_ACCURACY_ENTRY(f64, double)

#define PURINE_SOFTMAX_LOSS_ENTRY(SUFFIX, T)                                    \
  extern "C" __global__ void softmax_loss_forward_##SUFFIX(                     \
      long long total, const T* x, const long long* labels, int channels, int inner,  \
      int ignore_label, int has_ignore, int pad_label, int has_pad, T* prob,    \
      T* loss, T* valid) {                                                      \
    softmax_loss_forward_impl<T>(total, x, labels, channels, inner,             \
                                 ignore_label, has_ignore, pad_label, has_pad,  \
                                 prob, loss, valid);                            \
  }                                                                             \
  extern "C" __global__ void softmax_loss_forward_rows_##SUFFIX(                \
      long long total, const T* x, const long long* labels, int channels, int inner,  \
      int ignore_label, int has_ignore, int pad_label, int has_pad, T* prob,    \
      T* loss, T* valid) {                                                      \
    softmax_loss_forward_rows_impl<T>(total, x, labels, channels, inner,        \
                                      ignore_label, has_ignore, pad_label,      \
                                      has_pad, prob, loss, valid);              \
  }                                                                             \
  extern "C" __global__ void softmax_loss_backward_##SUFFIX(                    \
      long long total, const T* prob, const long long* labels, int channels,          \
      int inner, int ignore_label, int has_ignore, int pad_label, int has_pad,  \
      T scale_value, const T* scale_ptr, int has_scale_ptr, const T* count_ptr, \
      int has_count_ptr, T* dx) {                                               \
    softmax_loss_backward_impl<T>(total, prob, labels, channels, inner,         \
                                  ignore_label, has_ignore, pad_label, has_pad, \
                                  scale_value,                                  \
                                  scale_ptr, has_scale_ptr, count_ptr,          \
                                  has_count_ptr, dx);                           \
  }                                                                             \
  extern "C" __global__ void softmax_loss_forward_vec_##SUFFIX(                 \
      long long total, const T* x, const long long* labels, int channels, int inner,  \
      int ignore_label, int has_ignore, int pad_label, int has_pad, T* prob,    \
      T* loss, T* valid) {                                                      \
    softmax_loss_forward_vec_impl<T>(total, x, labels, channels, inner,         \
                                     ignore_label, has_ignore, pad_label,       \
                                     has_pad, prob, loss, valid);               \
  }                                                                             \
  extern "C" __global__ void softmax_loss_backward_vec_##SUFFIX(                \
      long long total, const T* prob, const long long* labels, int channels,          \
      int inner, int ignore_label, int has_ignore, int pad_label, int has_pad,  \
      T scale_value, const T* scale_ptr, int has_scale_ptr, const T* count_ptr, \
      int has_count_ptr, T* dx) {                                               \
    softmax_loss_backward_vec_impl<T>(total, prob, labels, channels, inner,     \
                                      ignore_label, has_ignore, pad_label,      \
                                      has_pad, scale_value, scale_ptr,          \
                                      has_scale_ptr, count_ptr, has_count_ptr,  \
                                      dx);                                      \
  }                                                                             \
  extern "C" __global__ void softmax_loss_mean_##SUFFIX(                        \
      long long total, const T* loss, const T* valid, T* out_loss,              \
      T* out_count, int has_count) {                                            \
    softmax_loss_mean_impl<T>(total, loss, valid, out_loss, out_count,          \
                              has_count);                                       \
  }                                                                             \
  extern "C" __global__ void softmax_loss_count_##SUFFIX(                       \
      long long total, const long long* labels, int ignore_label, int has_ignore,     \
      int pad_label, int has_pad, T* out_count, int floor) {                    \
    softmax_loss_count_impl<T>(total, labels, ignore_label, has_ignore,         \
                               pad_label, has_pad, out_count, floor);           \
  }

#define PURINE_SOFTMAX_ENTRY(SUFFIX, T)                                         \
  extern "C" __global__ void softmax_forward_##SUFFIX(                          \
      long long total, const T* x, int channels, int inner, T* y) {             \
    softmax_forward_impl<T>(total, x, channels, inner, y);                      \
  }                                                                             \
  extern "C" __global__ void softmax_forward_rows_##SUFFIX(                     \
      long long total, const T* x, int channels, int inner, T* y) {             \
    softmax_forward_rows_impl<T>(total, x, channels, inner, y);                 \
  }                                                                             \
  extern "C" __global__ void softmax_backward_##SUFFIX(                         \
      long long total, const T* dy, const T* y, int channels, int inner, T* dx) {  \
    softmax_backward_impl<T>(total, dy, y, channels, inner, dx);                \
  }                                                                             \
  extern "C" __global__ void softmax_backward_rows_##SUFFIX(                    \
      long long total, const T* dy, const T* y, int channels, int inner, T* dx) {  \
    softmax_backward_rows_impl<T>(total, dy, y, channels, inner, dx);           \
  }

PURINE_SOFTMAX_LOSS_ENTRY(f32, float)
PURINE_SOFTMAX_LOSS_ENTRY(f64, double)
PURINE_SOFTMAX_ENTRY(f32, float)
PURINE_SOFTMAX_ENTRY(f64, double)
