// Fused softmax + cross-entropy (Caffe's SoftmaxWithLoss), softmax over axis 1.
//
// x is viewed as (N, C, inner) with inner = prod(shape[2:]) (1 for (N, C));
// labels as (N, inner), int32. For each position (n, s):
//   prob[n, :, s] = exp(x - max) / sum(exp(x - max))
//   loss[n, s]    = -log(max(prob[n, label, s], FLT_MIN))
//   valid[n, s]   = 1
// except where label == ignore_label (when has_ignore): loss = valid = 0.
// A label outside [0, C) gives loss = NaN (valid = 1), so a bad label file
// shows up in the loss instead of reading out of bounds.
// The caller normalizes: loss = sum(loss) / sum(valid) for the batch mean.
// Backward, per element: dx = scale * (prob - onehot(label)), 0 where ignored;
// scale = scale_value * (*scale_ptr if has_scale_ptr) so a device-side scalar
// (e.g. top gradient / valid count) needs no host round trip.
//
// Compiled at run time by purine_mpi.gpu.load_kernel("softmax_loss") (NVRTC,
// so no #include); one extern "C" entry point per dtype: <name>_f32, <name>_f64.

#define CUDA_KERNEL_LOOP(i, n)                                              \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;      \
       i < (n); i += (long long)blockDim.x * gridDim.x)

__device__ __forceinline__ float exponential(float a) { return expf(a); }
__device__ __forceinline__ double exponential(double a) { return exp(a); }
__device__ __forceinline__ float logarithm(float a) { return logf(a); }
__device__ __forceinline__ double logarithm(double a) { return log(a); }

// Smallest normal float: Caffe clamps prob with FLT_MIN (for both dtypes).
#define PURINE_FLT_MIN 1.175494351e-38

template <typename T> __device__ __forceinline__ T quiet_nan();
template <> __device__ __forceinline__ float quiet_nan<float>() {
  return __int_as_float(0x7fc00000);
}
template <> __device__ __forceinline__ double quiet_nan<double>() {
  return __longlong_as_double(0x7ff8000000000000LL);
}

// One thread per position (n, s); loops over the C classes (stride inner).
template <typename T>
__device__ void softmax_loss_forward_impl(long long total, const T* x,
                                          const int* labels, int channels,
                                          int inner, int ignore_label,
                                          int has_ignore, T* prob, T* loss,
                                          T* valid) {
  CUDA_KERNEL_LOOP(index, total) {
    const long long n = index / inner;
    const int s = (int)(index % inner);
    const long long base = n * channels * inner + s;
    T largest = x[base];
    for (int c = 1; c < channels; ++c) {
      const T v = x[base + (long long)c * inner];
      largest = v > largest ? v : largest;
    }
    T sum = T(0);
    for (int c = 0; c < channels; ++c) {
      const long long j = base + (long long)c * inner;
      const T e = exponential(x[j] - largest);
      prob[j] = e;
      sum += e;
    }
    const T inv_sum = T(1) / sum;
    for (int c = 0; c < channels; ++c) {
      prob[base + (long long)c * inner] *= inv_sum;
    }
    const int label = labels[index];
    if (has_ignore && label == ignore_label) {
      loss[index] = T(0);
      valid[index] = T(0);
    } else if (label < 0 || label >= channels) {
      loss[index] = quiet_nan<T>();
      valid[index] = T(1);
    } else {
      T p = prob[base + (long long)label * inner];
      p = p > T(PURINE_FLT_MIN) ? p : T(PURINE_FLT_MIN);
      loss[index] = -logarithm(p);
      valid[index] = T(1);
    }
  }
}

// One thread per element (n, c, s) of prob.
template <typename T>
__device__ void softmax_loss_backward_impl(long long total, const T* prob,
                                           const int* labels, int channels,
                                           int inner, int ignore_label,
                                           int has_ignore, T scale_value,
                                           const T* scale_ptr,
                                           int has_scale_ptr, T* dx) {
  const T scale = has_scale_ptr ? scale_value * scale_ptr[0] : scale_value;
  CUDA_KERNEL_LOOP(index, total) {
    const int s = (int)(index % inner);
    const int c = (int)((index / inner) % channels);
    const long long n = index / ((long long)inner * channels);
    const int label = labels[n * inner + s];
    if (has_ignore && label == ignore_label) {
      dx[index] = T(0);
    } else {
      dx[index] = scale * (prob[index] - (c == label ? T(1) : T(0)));
    }
  }
}

#define PURINE_SOFTMAX_LOSS_ENTRY(SUFFIX, T)                                    \
  extern "C" __global__ void softmax_loss_forward_##SUFFIX(                     \
      long long total, const T* x, const int* labels, int channels, int inner,  \
      int ignore_label, int has_ignore, T* prob, T* loss, T* valid) {           \
    softmax_loss_forward_impl<T>(total, x, labels, channels, inner,             \
                                 ignore_label, has_ignore, prob, loss, valid);  \
  }                                                                             \
  extern "C" __global__ void softmax_loss_backward_##SUFFIX(                    \
      long long total, const T* prob, const int* labels, int channels,          \
      int inner, int ignore_label, int has_ignore, T scale_value,               \
      const T* scale_ptr, int has_scale_ptr, T* dx) {                           \
    softmax_loss_backward_impl<T>(total, prob, labels, channels, inner,         \
                                  ignore_label, has_ignore, scale_value,        \
                                  scale_ptr, has_scale_ptr, dx);                \
  }

PURINE_SOFTMAX_LOSS_ENTRY(f32, float)
PURINE_SOFTMAX_LOSS_ENTRY(f64, double)
