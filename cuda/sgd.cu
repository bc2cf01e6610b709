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
