// Local response normalization across channels (Caffe's ACROSS_CHANNELS).
//
// With n = local_size (odd), pre = (n - 1) / 2 and the window of channel c
// being c' in [c - pre, c + pre] clipped to [0, C):
//   scale[c] = k + alpha / n * sum_{c' in window(c)} x[c']^2
//   y[c]     = x[c] * scale[c]^(-beta)
//   dx[c]    = dy[c] * scale[c]^(-beta)
//              - (2 * alpha * beta / n) * x[c]
//                * sum_{c' in window(c)} dy[c'] * y[c'] / scale[c']
// (same as torch.nn.functional.local_response_norm for odd n). scale is an
// output of the forward kernel so the backward needs no recomputation.
// Caffe slides a running sum along the channels in one thread per (n, h, w);
// here each thread owns one element and sums its window directly: more
// parallel, and no drift from adding and subtracting squares.
//
// Compiled at run time by purine_mpi.gpu.load_kernel("lrn") (NVRTC, so no
// #include); one extern "C" entry point per dtype: <name>_f32, <name>_f64.

#define CUDA_KERNEL_LOOP(i, n)                                              \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;      \
       i < (n); i += (long long)blockDim.x * gridDim.x)

__device__ __forceinline__ int int_min(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int int_max(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ float power(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double power(double a, double b) { return pow(a, b); }

// One thread per element (n, c, s) of x viewed as (N, C, spatial).
template <typename T>
__device__ void lrn_forward_impl(long long total, const T* x, int channels,
                                 int spatial, int pre_pad, T alpha_over_n,
                                 T k, T neg_beta, T* scale, T* y) {
  CUDA_KERNEL_LOOP(index, total) {
    const int c = (int)((index / spatial) % channels);
    const T* x_c0 = x + (index - (long long)c * spatial);  // channel 0, same s
    const int first = int_max(c - pre_pad, 0);
    const int last = int_min(c + pre_pad, channels - 1);
    T sum = T(0);
    for (int cc = first; cc <= last; ++cc) {
      const T v = x_c0[(long long)cc * spatial];
      sum += v * v;
    }
    const T s = k + alpha_over_n * sum;
    scale[index] = s;
    y[index] = x[index] * power(s, neg_beta);
  }
}

// One thread per element; the window is symmetric for odd local_size, so
// "channels whose window contains c" is again [c - pre, c + pre].
template <typename T>
__device__ void lrn_backward_impl(long long total, const T* x, const T* y,
                                  const T* scale, const T* dy, int channels,
                                  int spatial, int pre_pad, T neg_beta,
                                  T cache_ratio, T* dx) {
  CUDA_KERNEL_LOOP(index, total) {
    const int c = (int)((index / spatial) % channels);
    const long long c0 = index - (long long)c * spatial;
    const int first = int_max(c - pre_pad, 0);
    const int last = int_min(c + pre_pad, channels - 1);
    T accum = T(0);
    for (int cc = first; cc <= last; ++cc) {
      const long long j = c0 + (long long)cc * spatial;
      accum += dy[j] * y[j] / scale[j];
    }
    dx[index] = dy[index] * power(scale[index], neg_beta)
                - cache_ratio * x[index] * accum;
  }
}

#define PURINE_LRN_ENTRY(SUFFIX, T)                                             \
  extern "C" __global__ void lrn_forward_##SUFFIX(                              \
      long long total, const T* x, int channels, int spatial, int pre_pad,      \
      T alpha_over_n, T k, T neg_beta, T* scale, T* y) {                        \
    lrn_forward_impl<T>(total, x, channels, spatial, pre_pad, alpha_over_n, k,  \
                        neg_beta, scale, y);                                    \
  }                                                                             \
  extern "C" __global__ void lrn_backward_##SUFFIX(                             \
      long long total, const T* x, const T* y, const T* scale, const T* dy,     \
      int channels, int spatial, int pre_pad, T neg_beta, T cache_ratio,        \
      T* dx) {                                                                  \
    lrn_backward_impl<T>(total, x, y, scale, dy, channels, spatial, pre_pad,    \
                         neg_beta, cache_ratio, dx);                            \
  }

PURINE_LRN_ENTRY(f32, float)
PURINE_LRN_ENTRY(f64, double)
