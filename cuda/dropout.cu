// Inverted dropout mask from uniform random numbers:
//   mask = (u >= ratio) / (1 - ratio)        u ~ U[0, 1), drawn by cupy.random
// so y = x * mask keeps each unit with probability 1 - ratio and needs no
// rescaling at test time; the backward is dx = dy * mask. The mask is an
// explicit output blob (the forward's random draw must be reused backward).
//
// Compiled at run time by purine_mpi.gpu.load_kernel("dropout") (NVRTC, so no
// #include); one extern "C" entry point per dtype: <name>_f32, <name>_f64.

#define CUDA_KERNEL_LOOP(i, n)                                              \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;      \
       i < (n); i += (long long)blockDim.x * gridDim.x)

template <typename T>
__device__ void dropout_mask_impl(long long total, const T* uniform, T ratio,
                                  T scale, T* mask) {
  CUDA_KERNEL_LOOP(index, total) {
    mask[index] = uniform[index] >= ratio ? scale : T(0);
  }
}

#define PURINE_DROPOUT_ENTRY(SUFFIX, T)                                         \
  extern "C" __global__ void dropout_mask_##SUFFIX(                             \
      long long total, const T* uniform, T ratio, T scale, T* mask) {           \
    dropout_mask_impl<T>(total, uniform, ratio, scale, mask);                   \
  }

PURINE_DROPOUT_ENTRY(f32, float)
PURINE_DROPOUT_ENTRY(f64, double)
