// Element-wise activations, one kernel each (instead of CuPy's greater /
// maximum / multiply chain), and the bias + ReLU epilogue of a convolution or
// fully connected layer, fused into one pass over its output:
//
//   relu_forward:   y = x > 0 ? x : slope * x                 (Caffe's leaky ReLU)
//   relu_backward:  dx = x > 0 ? dy : slope * dy               (x: the input, or the
//                   output y, which is > 0 where x is, for slope >= 0)
//   bias_act:       y[n, c, s] = act(y[n, c, s] + b[c])        in place; act = identity
//                   (relu = 0) or leaky ReLU (relu = 1), c = (i / inner) % channels
//
// Compiled at run time by
// purine_mpi.gpu.load_kernel("activation"); one extern "C" entry point per
// dtype: <name>_f32, <name>_f64.

#define CUDA_KERNEL_LOOP(i, n)                                              \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;      \
       i < (n); i += (long long)blockDim.x * gridDim.x)

// As NumPy computes them on the CPU: maximum(x, 0) keeps x when x > 0 or x
// is NaN (a NaN propagates, so a diverging net is still seen), else 0;
// where(x > 0, x, slope x).
template <typename T>
__device__ __forceinline__ T purine_leaky(T x, T slope, int has_slope) {
  if (has_slope) return x > T(0) ? x : slope * x;
  return (x > T(0) || x != x) ? x : T(0);
}

template <typename T>
__device__ void relu_forward_impl(long long total, const T* x, T slope, int has_slope, T* y) {
  CUDA_KERNEL_LOOP(i, total) { y[i] = purine_leaky(x[i], slope, has_slope); }
}

// dy * (x > 0) (a NaN or inf dy still gives NaN where x <= 0, as on the CPU),
// or where(x > 0, dy, slope dy).
template <typename T>
__device__ void relu_backward_impl(long long total, const T* dy, const T* x, T slope,
                                   int has_slope, T* dx) {
  CUDA_KERNEL_LOOP(i, total) {
    const bool positive = x[i] > T(0);
    dx[i] = has_slope ? (positive ? dy[i] : slope * dy[i]) : dy[i] * T(positive ? 1 : 0);
  }
}

template <typename T>
__device__ void bias_act_impl(long long total, T* y, const T* bias, int has_bias,
                              long long channels, long long inner, int relu, T slope,
                              int has_slope) {
  CUDA_KERNEL_LOOP(i, total) {
    T v = y[i];
    if (has_bias) v += bias[(i / inner) % channels];
    y[i] = relu ? purine_leaky(v, slope, has_slope) : v;
  }
}

#define PURINE_ACTIVATION_ENTRY(SUFFIX, T)                                             \
  extern "C" __global__ void relu_forward_##SUFFIX(long long total, const T* x,        \
                                                   T slope, int has_slope, T* y) {     \
    relu_forward_impl<T>(total, x, slope, has_slope, y);                               \
  }                                                                                    \
  extern "C" __global__ void relu_backward_##SUFFIX(long long total, const T* dy,      \
                                                    const T* x, T slope,               \
                                                    int has_slope, T* dx) {            \
    relu_backward_impl<T>(total, dy, x, slope, has_slope, dx);                         \
  }                                                                                    \
  extern "C" __global__ void bias_act_##SUFFIX(long long total, T* y, const T* bias,   \
                                               int has_bias, long long channels,       \
                                               long long inner, int relu, T slope,     \
                                               int has_slope) {                        \
    bias_act_impl<T>(total, y, bias, has_bias, channels, inner, relu, slope,           \
                     has_slope);                                                       \
  }

PURINE_ACTIVATION_ENTRY(f32, float)
PURINE_ACTIVATION_ENTRY(f64, double)
