// Fused SGD-with-momentum update (Caffe's SGDSolver), in place:
//   v = momentum * v + lr * (grad_scale * g + weight_decay * w)
//   w = w - v
// One pass over memory instead of the four element-wise launches it would
// take with array expressions. grad_scale folds in e.g. the 1/N of averaging
// an all-reduced gradient sum. lr = lr_value * (*lr_ptr if has_lr_ptr): the
// learning rate may live on the device as a blob (no host round trip).
//
// Compiled at run time by purine_mpi.gpu.load_kernel("sgd") (NVRTC, so no
// #include); one extern "C" entry point per dtype: <name>_f32, <name>_f64.

#define CUDA_KERNEL_LOOP(i, n)                                              \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;      \
       i < (n); i += (long long)blockDim.x * gridDim.x)

template <typename T>
__device__ void sgd_momentum_impl(long long total, T* w, const T* g, T* v,
                                  T lr_value, const T* lr_ptr, int has_lr_ptr,
                                  T momentum, T weight_decay, T grad_scale) {
  const T lr = has_lr_ptr ? lr_value * lr_ptr[0] : lr_value;
  CUDA_KERNEL_LOOP(index, total) {
    const T w_old = w[index];
    const T step = momentum * v[index]
                   + lr * (grad_scale * g[index] + weight_decay * w_old);
    v[index] = step;
    w[index] = w_old - step;
  }
}

#define PURINE_SGD_ENTRY(SUFFIX, T)                                             \
  extern "C" __global__ void sgd_momentum_##SUFFIX(                             \
      long long total, T* w, const T* g, T* v, T lr_value, const T* lr_ptr,     \
      int has_lr_ptr, T momentum, T weight_decay, T grad_scale) {               \
    sgd_momentum_impl<T>(total, w, g, v, lr_value, lr_ptr, has_lr_ptr,          \
                         momentum, weight_decay, grad_scale);                   \
  }

PURINE_SGD_ENTRY(f32, float)
PURINE_SGD_ENTRY(f64, double)

// The same update over every parameter at once (a multi-tensor apply): the
// weights and momenta are views into two flat buffers w and v; parameter s
// holds `starts[s+1] - starts[s]` elements at offset `offsets[s]` of both,
// and its gradient (anywhere: e.g. a view into an all-reduce bucket) at the
// address `grads[s]`. Element i of the concatenation finds its parameter by a
// binary search over `starts` (ascending, starts[0] = 0). Per parameter:
//   rate = lr * lr_mults[s];  decay = decays[s] (weight_decay * decay_mult)
//   v = momentum * v + rate * (grad_scale * g + decay * w);  w = w - v
// as sgd_momentum does for one parameter (the same arithmetic, bit for bit).
template <typename T>
__device__ void sgd_momentum_multi_impl(long long total, T* w, T* v,
                                        const unsigned long long* grads,
                                        const long long* starts, const long long* offsets,
                                        const T* lr_mults, const T* decays, int segments,
                                        T lr_value, const T* lr_ptr, int has_lr_ptr,
                                        T momentum, T grad_scale) {
  const T lr = has_lr_ptr ? lr_value * lr_ptr[0] : lr_value;
  CUDA_KERNEL_LOOP(index, total) {
    int lo = 0, hi = segments - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (starts[mid] <= index) lo = mid; else hi = mid - 1;
    }
    const long long j = index - starts[lo];
    const long long at = offsets[lo] + j;
    const T* g = (const T*)grads[lo];
    const T w_old = w[at];
    const T step = momentum * v[at]
                   + (lr_mults[lo] * lr) * (grad_scale * g[j] + decays[lo] * w_old);
    v[at] = step;
    w[at] = w_old - step;
  }
}

#define PURINE_SGD_MULTI_ENTRY(SUFFIX, T)                                          \
  extern "C" __global__ void sgd_momentum_multi_##SUFFIX(                          \
      long long total, T* w, T* v, const unsigned long long* grads,                \
      const long long* starts, const long long* offsets, const T* lr_mults,        \
      const T* decays, int segments, T lr_value, const T* lr_ptr, int has_lr_ptr,  \
      T momentum, T grad_scale) {                                                  \
    sgd_momentum_multi_impl<T>(total, w, v, grads, starts, offsets, lr_mults,      \
                               decays, segments, lr_value, lr_ptr, has_lr_ptr,     \
                               momentum, grad_scale);                              \
  }

PURINE_SGD_MULTI_ENTRY(f32, float)
PURINE_SGD_MULTI_ENTRY(f64, double)
