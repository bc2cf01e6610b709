// Channel sums in one kernel: the bias gradient of a convolution
// (db[c] = sum over n and the spatial positions s of dy[n, c, s]) or of a
// fully connected layer (inner = 1: db[c] = sum over rows n of dy[n, c]).
//
// One block per channel (grid-stride over channels): its threads add
// strided slices of the channel in double, then a shared-memory tree adds the
// per-thread partial sums in a fixed order -- no atomics, so the result is
// the same on every run (a resume stays bit-exact). Launched with at most
// PURINE_REDUCE_THREADS threads per block.
//
// Compiled at run time by purine_mpi.gpu.load_kernel("reduce"); one
// extern "C" entry point per dtype: <name>_f32, <name>_f64.

#define PURINE_REDUCE_THREADS 256

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
    partial[tid] = sum;
    __syncthreads();
    for (unsigned int stride = 1; stride < blockDim.x; stride <<= 1) {
      if (tid % (2 * stride) == 0 && tid + stride < blockDim.x) {
        partial[tid] += partial[tid + stride];
      }
      __syncthreads();
    }
    if (tid == 0) out[c] = (T)partial[0];
    __syncthreads();  // partial is reused by the next channel
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

// Column sums of a (rows, cols) matrix, one thread per column (coalesced
// reads along each row), in double, in row order: out[j] = sum_i x[i, j],
// plus out[j] itself when `accumulate`. A weight gradient from per-sample
// partial products (the im2col convolution's batched GEMM).
template <typename T>
__device__ void sum_rows_impl(long long cols, const T* x, long long rows, int accumulate,
                              T* out) {
  for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < cols;
       j += (long long)blockDim.x * gridDim.x) {
    double sum = accumulate ? (double)out[j] : 0.0;
    for (long long i = 0; i < rows; ++i) sum += (double)x[i * cols + j];
    out[j] = (T)sum;
  }
}

#define PURINE_SUM_ROWS_ENTRY(SUFFIX, T)                                             \
  extern "C" __global__ void sum_rows_##SUFFIX(long long cols, const T* x,          \
                                               long long rows, int accumulate,      \
                                               T* out) {                            \
    sum_rows_impl<T>(cols, x, rows, accumulate, out);                               \
  }

PURINE_SUM_ROWS_ENTRY(f32, float)
PURINE_SUM_ROWS_ENTRY(f64, double)

// The bias gradient of a convolution, fast: db[c] = sum over n and s of
// dy[n, c, s], dy (N, C, inner) contiguous. One block per channel
// (grid-stride over channels). Its threads walk the channel's N runs of
// `inner` contiguous elements as one flat range, consecutive threads on
// consecutive addresses (coalesced loads; the (sample, s) position moves
// by a fixed step, no division per element), adding in double. Then a
// warp-shuffle tree adds each warp's 32 partial sums, and one more shuffle
// tree adds the warps' sums, every thread taking part (no divergent
// shuffles). A fixed order throughout, no atomics: the same result on
// every run. Launched with a multiple of 32 threads, at most
// PURINE_REDUCE_THREADS (32 warps' sums fit one warp).
template <typename T>
__device__ __forceinline__ T warp_sum(T value) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  return value;
}

template <typename T>
__device__ void bias_grad_impl(long long channels, const T* dy, long long n, long long inner,
                               T* out) {
  __shared__ double warp_sums[32];
  const unsigned int tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
  const unsigned int warps = blockDim.x >> 5;
  const long long step_sample = blockDim.x / inner, step_s = blockDim.x % inner;
  for (long long c = blockIdx.x; c < channels; c += gridDim.x) {
    double sum = 0.0;
    long long sample = tid / inner, s = tid % inner;
    const T* channel = dy + c * inner;
    while (sample < n) {
      sum += (double)channel[sample * channels * inner + s];
      sample += step_sample;
      s += step_s;
      if (s >= inner) { s -= inner; ++sample; }
    }
    sum = warp_sum(sum);
    if (lane == 0) warp_sums[warp] = sum;
    __syncthreads();
    sum = lane < warps ? warp_sums[lane] : 0.0;  // every warp adds the warps' sums
    sum = warp_sum(sum);
    if (tid == 0) out[c] = (T)sum;
    __syncthreads();  // warp_sums is reused by the next channel
  }
}

PURINE_PER_CHANNEL_ENTRY(bias_grad, f32, float)
PURINE_PER_CHANNEL_ENTRY(bias_grad, f64, double)
