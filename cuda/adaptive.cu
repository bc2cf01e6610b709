// The other adaptive solvers' updates (purine_mpi/ops/updates.py
// NesterovUpdate, AdaGradUpdate, RMSPropUpdate, AdaDeltaUpdate), in place,
// one pass over memory and no temporaries (the CuPy element-wise form
// allocates every iteration, which a captured CUDA graph that replays must
// not). With g = grad_scale * grad (+ decay * w: L2 added to the gradient)
// and rate = lr_value * (*lr_ptr if has_lr_ptr):
//   kind 0, Nesterov (a = momentum):  p = a * v; v = a * v + g * rate;
//                                     w -= v * (1 + a) - p
//   kind 1, AdaGrad:                  h += g * g; w -= rate * g / (sqrt(h) + delta)
//   kind 2, RMSProp (a = rms_decay):  h = a * h + ((1 - a) * g) * g;
//                                     w -= rate * g / (sqrt(h) + delta)
//   kind 3, AdaDelta (a = momentum):  h = a * h + ((1 - a) * g) * g;
//                                     u = sqrt(h2 + delta) / sqrt(h + delta) * g;
//                                     h2 = a * h2 + ((1 - a) * u) * u; w -= rate * u
// in the order the CPU update computes it (its roundings, in T). The kernel
// reads the learning-rate blob itself, so a captured graph replays with each
// iteration's rate.
//
// Compiled at run time by purine_mpi.gpu.load_kernel("adaptive") (NVRTC, so
// no #include); one extern "C" entry point per dtype: <name>_f32, <name>_f64.

#define CUDA_KERNEL_LOOP(i, n)                                              \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;      \
       i < (n); i += (long long)blockDim.x * gridDim.x)

template <typename T>
__device__ void adaptive_impl(long long total, int kind, T* w, const T* g, T* s1, T* s2,
                              T lr_value, const T* lr_ptr, int has_lr_ptr, T grad_scale,
                              T decay, T a, T delta) {
  const T rate = has_lr_ptr ? lr_ptr[0] * lr_value : lr_value;
  const T one = T(1), keep = one - a, ahead = one + a;
  CUDA_KERNEL_LOOP(index, total) {
    T wi = w[index];
    T gi = g[index] * grad_scale;
    if (decay != T(0)) gi = gi + wi * decay;
    if (kind == 0) {
      const T vi = s1[index];
      const T previous = vi * a;
      const T vn = vi * a + gi * rate;
      s1[index] = vn;
      w[index] = wi - (vn * ahead - previous);
    } else if (kind == 1) {
      const T hi = s1[index] + gi * gi;
      s1[index] = hi;
      w[index] = wi - rate * gi / (sqrt(hi) + delta);
    } else if (kind == 2) {
      const T hi = s1[index] * a + keep * gi * gi;
      s1[index] = hi;
      w[index] = wi - rate * gi / (sqrt(hi) + delta);
    } else {
      const T hi = s1[index] * a + keep * gi * gi;
      s1[index] = hi;
      const T ui = sqrt(s2[index] + delta) / sqrt(hi + delta) * gi;
      s2[index] = s2[index] * a + keep * ui * ui;
      w[index] = wi - rate * ui;
    }
  }
}

#define PURINE_ADAPTIVE_ENTRY(SUFFIX, T)                                            \
  extern "C" __global__ void adaptive_update_##SUFFIX(                              \
      long long total, int kind, T* w, const T* g, T* s1, T* s2, T lr_value,        \
      const T* lr_ptr, int has_lr_ptr, T grad_scale, T decay, T a, T delta) {       \
    adaptive_impl<T>(total, kind, w, g, s1, s2, lr_value, lr_ptr, has_lr_ptr,       \
                     grad_scale, decay, a, delta);                                  \
  }

PURINE_ADAPTIVE_ENTRY(f32, float)
PURINE_ADAPTIVE_ENTRY(f64, double)
