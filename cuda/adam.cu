// Fused Adam / AdamW update (purine_mpi/ops/updates.py AdamUpdate,
// AdamWUpdate), in place, one pass over memory and no temporaries (the CuPy
// element-wise form allocates every iteration, which a captured CUDA graph
// that replays must not). With s = iteration + 1:
//   g  = grad_scale * grad (+ decay * w unless decoupled: Adam's L2)
//   w *= 1 - rate * decay                   (AdamW: decoupled, before the step)
//   m  = b1 * m + (1 - b1) * g
//   v  = b2 * v + ((1 - b2) * g) * g
//   w -= (rate / (1 - b1^s)) * m / (sqrt(v) / sqrt(1 - b2^s) + delta)
// in the order the CPU update computes it (its float32 roundings; the bias
// corrections, rate and decay factor in double, as Python computes them).
// rate = lr_value * (*lr_ptr if has_lr_ptr); the step is s = it_value + 1, or
// with has_it_ptr s = *it_ptr + it_value + 1 (the iteration blob on the
// device, it_value then minus the iteration the moments started at: a resume
// that starts them afresh): the kernel reads both itself, so a captured graph
// replays with each iteration's values.
//
// The low-precision copy of the weights (the precision pass's ``<w>@bf16``,
// parallel/precision.fold_weight_casts): with copy_mode != 0 the kernel
// writes, in the same pass, the rounding of each new float32 weight --
//   1  the nearest bfloat16, kept in float32 storage    (copy32)
//   2  the nearest float16, kept in float32 storage     (copy32)
//   3  the nearest bfloat16 as its uint16 bits           (copy16)
// by precision.cuh's functions, so the bits of a separate Cast op's
// round_bf16 / round_fp16 / to_bf16_bits pass over the updated weights
// (cuda/precision.cu), without its launch and its read of the weights.
// Only the float32 entry points take a copy (the f64 ones ignore it: the
// low precisions round float32 storage only).
//
// Compiled at run time by purine_mpi.gpu.load_kernel("adam") (NVRTC: the
// loader inlines precision.cuh); one extern "C" entry point per dtype:
// <name>_f32, <name>_f64.

#include "precision.cuh"

#define CUDA_KERNEL_LOOP(i, n)                                              \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;      \
       i < (n); i += (long long)blockDim.x * gridDim.x)

// One element of the step, in place on w, m, v from the raw gradient g
// (adam_update and adam_multi: the same arithmetic, so the same bits).
// element i of a weight's low-precision copy from its new value w (copy_mode
// as in the header; 0: none)
__device__ __forceinline__ void adam_copy(float w, long long i, unsigned int* copy32,
                                          unsigned short* copy16, int copy_mode) {
  if (copy_mode == 3) {
    copy16[i] = (unsigned short)(purine_round_bf16(purine_float_bits(w)) >> 16);
  } else if (copy_mode == 1) {
    copy32[i] = purine_round_bf16(purine_float_bits(w));
  } else if (copy_mode == 2) {
    copy32[i] = purine_round_fp16(purine_float_bits(w));
  }
}

__device__ __forceinline__ void adam_copy(double, long long, unsigned int*, unsigned short*,
                                          int) {}

template <typename T>
__device__ void adam_element(T* w, T* m, T* v, T g, T grad_scale, double rate, double decay,
                             int decoupled, T step, T correction2, T tb1, T ob1, T tb2, T ob2,
                             T delta) {
  T wi = *w;
  T gi = grad_scale * g;
  if (!decoupled && decay != 0.0) gi = gi + wi * (T)decay;
  if (decoupled && decay != 0.0) wi = wi * (T)(1.0 - rate * decay);
  const T mi = tb1 * *m + ob1 * gi;
  const T vi = tb2 * *v + (ob2 * gi) * gi;
  *m = mi;
  *v = vi;
  const T denom = sqrt(vi) / correction2 + delta;
  *w = wi - (step * mi) / denom;
}

template <typename T>
__device__ void adam_impl(long long total, T* w, const T* g, T* m, T* v,
                          double lr_value, const T* lr_ptr, int has_lr_ptr,
                          long long it_value, const long long* it_ptr, int has_it_ptr,
                          double b1, double b2, T delta, T grad_scale, double decay,
                          int decoupled, unsigned int* copy32, unsigned short* copy16,
                          int copy_mode) {
  const double rate = has_lr_ptr ? lr_value * (double)lr_ptr[0] : lr_value;
  const double s = (double)((has_it_ptr ? it_ptr[0] : 0) + it_value + 1);
  const T step = (T)(rate / (1.0 - pow(b1, s)));
  const T correction2 = (T)sqrt(1.0 - pow(b2, s));
  const T tb1 = (T)b1, tb2 = (T)b2, ob1 = (T)(1.0 - b1), ob2 = (T)(1.0 - b2);
  CUDA_KERNEL_LOOP(index, total) {
    adam_element<T>(w + index, m + index, v + index, g[index], grad_scale, rate, decay,
                    decoupled, step, correction2, tb1, ob1, tb2, ob2, delta);
    adam_copy(w[index], index, copy32, copy16, copy_mode);
  }
}

#define PURINE_ADAM_ENTRY(SUFFIX, T)                                                \
  extern "C" __global__ void adam_update_##SUFFIX(                                  \
      long long total, T* w, const T* g, T* m, T* v, double lr_value,               \
      const T* lr_ptr, int has_lr_ptr, long long it_value, const long long* it_ptr, \
      int has_it_ptr, double b1, double b2, T delta, T grad_scale, double decay,    \
      int decoupled, unsigned int* copy32, unsigned short* copy16, int copy_mode) { \
    adam_impl<T>(total, w, g, m, v, lr_value, lr_ptr, has_lr_ptr, it_value, it_ptr, \
                 has_it_ptr, b1, b2, delta, grad_scale, decay, decoupled, copy32,   \
                 copy16, copy_mode);                                                \
  }

PURINE_ADAM_ENTRY(f32, float)
PURINE_ADAM_ENTRY(f64, double)

// The same update over every parameter at once (a multi-tensor apply, as
// torch.optim.AdamW(fused=True) does): the weights and both moments are
// views into three flat buffers w, m and v; parameter s holds
// `starts[s+1] - starts[s]` elements at offset `offsets[s]` of each, and its
// gradient (anywhere: e.g. a view into an all-reduce bucket) at the address
// `grads[s]`. Element i of the concatenation finds its parameter by a binary
// search over `starts` (ascending, starts[0] = 0). Per parameter, the
// arithmetic of adam_update with rate = lr * lr_mults[s] and decay =
// decays[s] (weight_decay * decay_mult), both in double as there: bit for
// bit the single-parameter kernel's result. lr = lr_value, or *lr_ptr when
// has_lr_ptr (the lr blob on the device, without lr_mult). Parameter s's
// low-precision copy (see the header) is at the address `copies[s]` in mode
// `copy_modes[s]` (0: none; the address then unread).
template <typename T>
__device__ void adam_multi_impl(long long total, T* w, T* m, T* v,
                                const unsigned long long* grads, const long long* starts,
                                const long long* offsets, const double* lr_mults,
                                const double* decays, int segments, double lr_value,
                                const T* lr_ptr, int has_lr_ptr, long long it_value,
                                const long long* it_ptr, int has_it_ptr, double b1, double b2,
                                T delta, T grad_scale, int decoupled,
                                const unsigned long long* copies, const int* copy_modes) {
  const double lr = has_lr_ptr ? (double)lr_ptr[0] : lr_value;
  const double s = (double)((has_it_ptr ? it_ptr[0] : 0) + it_value + 1);
  const double correction1 = 1.0 - pow(b1, s);
  const T correction2 = (T)sqrt(1.0 - pow(b2, s));
  const T tb1 = (T)b1, tb2 = (T)b2, ob1 = (T)(1.0 - b1), ob2 = (T)(1.0 - b2);
  CUDA_KERNEL_LOOP(index, total) {
    int lo = 0, hi = segments - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (starts[mid] <= index) lo = mid; else hi = mid - 1;
    }
    const long long at = offsets[lo] + (index - starts[lo]);
    const T* g = (const T*)grads[lo];
    const double rate = lr_mults[lo] * lr;
    adam_element<T>(w + at, m + at, v + at, g[index - starts[lo]], grad_scale, rate,
                    decays[lo], decoupled, (T)(rate / correction1), correction2, tb1, ob1,
                    tb2, ob2, delta);
    const int mode = copy_modes[lo];
    if (mode != 0) {
      adam_copy(w[at], index - starts[lo], (unsigned int*)copies[lo],
                (unsigned short*)copies[lo], mode);
    }
  }
}

#define PURINE_ADAM_MULTI_ENTRY(SUFFIX, T)                                               \
  extern "C" __global__ void adam_multi_##SUFFIX(                                        \
      long long total, T* w, T* m, T* v, const unsigned long long* grads,                \
      const long long* starts, const long long* offsets, const double* lr_mults,         \
      const double* decays, int segments, double lr_value, const T* lr_ptr,              \
      int has_lr_ptr, long long it_value, const long long* it_ptr, int has_it_ptr,       \
      double b1, double b2, T delta, T grad_scale, int decoupled,                        \
      const unsigned long long* copies, const int* copy_modes) {                         \
    adam_multi_impl<T>(total, w, m, v, grads, starts, offsets, lr_mults, decays,         \
                       segments, lr_value, lr_ptr, has_lr_ptr, it_value, it_ptr,         \
                       has_it_ptr, b1, b2, delta, grad_scale, decoupled, copies,         \
                       copy_modes);                                                      \
  }

PURINE_ADAM_MULTI_ENTRY(f32, float)
PURINE_ADAM_MULTI_ENTRY(f64, double)
