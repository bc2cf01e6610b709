// Element-wise activations, one kernel each (instead of CuPy's greater /
// maximum / multiply chain), and the bias + ReLU epilogue of a convolution or
// fully connected layer, fused into one pass over its output:
//
//   relu_forward:   y = x > 0 ? x : slope * x                 (Caffe's leaky ReLU)
//   relu_backward:  dx = x > 0 ? dy : slope * dy               (x: the input, or the
//                   output y, which is > 0 where x is, for slope >= 0)
//   bias_act:       y[n, c, s] = act(y[n, c, s] + b[c])        in place; act = identity
//                   (relu = 0) or leaky ReLU (relu = 1), c = (i / inner) % channels
//   gelu_forward:   y = x Phi(x)                               (tanh_form = 0: exact)
//                   y = x s, s = 0.5 (1 + tanh u) = 1 / (1 + exp(-2u)),
//                   u = sqrt(2/pi) (x + 0.044715 x^3)          (tanh_form = 1)
//   gelu_backward:  dx = dy (Phi(x) + x phi(x))                (exact)
//                   dx = dy (s + x 2 s (1 - s) u'),            (tanh; 0.5 (1 - tanh^2 u)
//                   u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2)      = 2 s (1 - s))
//
// GELU (ops/activation.py Gelu / GeluGrad, PyTorch's gelu with approximate
// 'none' / 'tanh') is one pass: x (and dy) read once, y (dx) written once, no
// scratch -- CuPy's chain took ~10 launches over full-size arrays and 3-4
// full-size temporaries. y may be x, dx may be dy (each element is read
// before it is written). Accurate in the tails, where the textbook forms
// cancel (1 + erf(x / sqrt 2), 1 + tanh u: PyTorch's float32 loses most
// digits there): Phi(x) = erfc(-x / sqrt 2) / 2 (CUDA's normcdf, written out
// here since the host build's libm has none), its argument's rounding error
// taken back to first order by a fused multiply-add; phi's exp(-x^2 / 2)
// likewise (x^2's rounding error); the tanh form through exp(-2|u|) <= 1,
// 2u's rounding errors taken back the same way. Within a few ulp of a
// 100-bit evaluation over both tails (tests/test_gpt_gpu.py), on the
// emulated device's glibc erfc/exp (<= 1 ulp) -- a GPU's erfcf/expf are
// within 2-4 ulp. The error-free steps use __fadd_rn / __fmul_rn on a GPU,
// which NVRTC never contracts into a fused multiply-add.
// Non-finite values as the host op computes them: NaN in, NaN out; y(-inf)
// = -inf * 0 = NaN, y(+inf) = inf; the gradient at +-inf, and the tanh
// form's where x^2 overflows, NaN (x * 0 * inf). |x| beyond 16 (float32) or
// 40 (float64) evaluates Phi and phi at that bound, where they are exactly 1
// or 0 and x^2 cannot overflow.
// `round`: the float32 output rounded in the same pass to the precision
// pass's low type (0 none, 1 bfloat16, 2 float16; precision.cuh, the bits
// of precision.cu's round_bf16 / round_fp16), instead of a second launch
// (ops/registry.py ``rounds_own_outputs``); float64 is launched with 0.
// gelu_forward_bits_f32 writes y as bfloat16 bits (uint16, the upper halves
// of round_bf16's float32: a y stored as bits, purine_mpi/parallel/
// precision.store_bits): the bits of a float32 run followed by to_bf16_bits.
// The _bx entry points read x as bfloat16 bits (uint16: the fc output GELU
// reads, stored as bits by precision.store_bits), widened exactly to the
// float32 the float32 storage holds, then the same float32 arithmetic: the
// same y / dx bit for bit. bias_bits_f32 adds the bias of a fully connected
// layer whose output is stored as bits to its float32 product and rounds
// once (bias_act then round_bf16, in one pass); add_bits_f32 is the
// residual add of a float32 term and one stored as bits.
// Memory-bound: 8 bytes per element forward, 12 backward (float32), grid-
// stride loops of 256-thread blocks, consecutive threads on consecutive
// elements (coalesced); no atomics, no sums: the same bits every run.
//
// Compiled at run time by
// purine_mpi.gpu.load_kernel("activation"); one extern "C" entry point per
// dtype: <name>_f32, <name>_f64.

#include "precision.cuh"

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

// ------------------------------------------------------------------ GELU ---

__device__ __forceinline__ float purine_erfc(float v) { return erfcf(v); }
__device__ __forceinline__ double purine_erfc(double v) { return erfc(v); }
__device__ __forceinline__ float purine_exp(float v) { return expf(v); }
__device__ __forceinline__ double purine_exp(double v) { return exp(v); }
__device__ __forceinline__ float purine_fma(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double purine_fma(double a, double b, double c) {
  return fma(a, b, c);
}
// A sum and a product rounded as written, never contracted into a fused
// multiply-add (NVRTC contracts by default): the error-free transformations
// below need the rounded value itself. The host build (the emulated device)
// contracts nothing (g++ in ISO C++ mode, no -mfma).
#ifdef __CUDACC__
__device__ __forceinline__ float purine_add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double purine_add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float purine_mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double purine_mul_rn(double a, double b) { return __dmul_rn(a, b); }
#else
template <typename T>
__device__ __forceinline__ T purine_add_rn(T a, T b) { return a + b; }
template <typename T>
__device__ __forceinline__ T purine_mul_rn(T a, T b) { return a * b; }
#endif
// dx = dy * d of the GELU gradient, and y = x * Phi(x) of its forward. A
// GPU's product of a NaN is its one canonical NaN; x86's, of two NaNs, the
// first operand's, which g++ may swap, differently in each kernel
// instantiated (and as the source around it changes: the forward's vec and
// old kernels parted when the _colsum kernels came): the host build (the
// emulated device) multiplies in one out-of-line function, so that every
// kernel (dy float32 or bits, with a copy or not, vec or not) gives the same
// NaN for the same operands.
#ifdef __CUDACC__
template <typename T>
__device__ __forceinline__ T purine_mul_dx(T a, T b) { return a * b; }
#else
__attribute__((noinline)) float purine_mul_dx(float a, float b) { return a * b; }
__attribute__((noinline)) double purine_mul_dx(double a, double b) { return a * b; }
#endif
// The constants' rounding errors, c - T(c): 1/sqrt(2), A = 2 sqrt(2/pi)
// and B = 0.044715 A (the tanh form's 2u = x (A + B x^2))
__device__ __forceinline__ float purine_sqrt_half_lo(float) { return 1.21016175e-08f; }
__device__ __forceinline__ double purine_sqrt_half_lo(double) { return -4.833646656726457e-17; }
__device__ __forceinline__ float purine_gelu_a_lo(float) { return -4.534068e-08f; }
__device__ __forceinline__ double purine_gelu_a_lo(double) { return -9.96930880911092e-17; }
__device__ __forceinline__ float purine_gelu_b_lo(float) { return 2.3988325e-09f; }
__device__ __forceinline__ double purine_gelu_b_lo(double) { return -6.175149918155315e-19; }
// The |x| from which Phi(x) and the tanh form's s are exactly 0 or 1 in T
// and phi(x), s (1 - s) exactly 0, and below which x^2 is finite: x is
// clamped to it (a NaN stays NaN)
__device__ __forceinline__ float purine_gelu_bound(float) { return 16.0f; }
__device__ __forceinline__ double purine_gelu_bound(double) { return 40.0; }

template <typename T>
__device__ __forceinline__ T purine_gelu_clamp(T x) {
  const T bound = purine_gelu_bound(x);
  return x > bound ? bound : (x < -bound ? -bound : x);
}

// Phi(x) and phi(x) of the standard normal distribution.
template <typename T>
__device__ __forceinline__ void purine_normal(T x, T* cdf, T* pdf) {
  const T a = purine_gelu_clamp(x);
  // phi(a) = exp(-(p + pe) / 2) / sqrt(2 pi), a^2 = p + pe exactly
  const T p = purine_mul_rn(a, a);
  const T pe = purine_fma(a, a, -p);
  const T phi = purine_exp(T(-0.5) * p) * (T(1) - T(0.5) * pe) * T(0.3989422804014327);
  // Phi(a) = erfc(z + dz) / 2, -a / sqrt 2 = z + dz (to T's precision
  // squared); erfc(z + dz) = erfc(z) - dz 2 / sqrt(pi) exp(-z^2), and
  // exp(-z^2) / sqrt(pi) = sqrt(2) phi(a)
  const T z = purine_mul_rn(-a, T(0.7071067811865476));
  const T dz = purine_fma(-a, T(0.7071067811865476), -z) - a * purine_sqrt_half_lo(x);
  *cdf = T(0.5) * purine_erfc(z) - T(1.4142135623730951) * dz * phi;
  *pdf = phi;
}

// The tanh form's s = 0.5 (1 + tanh u) = 1 / (1 + exp(-2u)) and s (1 - s),
// through e = exp(-2|u|) <= 1 (no cancellation, no overflow), 2u = w + c:
// w = a (A + B a^2) rounded, c its rounding errors (two-sum, fused
// multiply-adds, the constants'), to first order: exp(-|w + c|) =
// exp(-|w|) (1 -+ c).
template <typename T>
__device__ __forceinline__ void purine_gelu_tanh(T x, T* s, T* s1s) {
  const T a = purine_gelu_clamp(x);
  const T A = T(1.5957691216057308), B = T(0.07135481627260025);
  const T p = purine_mul_rn(a, a), pe = purine_fma(a, a, -p);        // a^2 = p + pe
  const T bp = purine_mul_rn(B, p), bpe = purine_fma(B, p, -bp);     // B p = bp + bpe
  const T q = purine_add_rn(A, bp), t = purine_add_rn(q, -A);        // A + bp = q + qe
  const T qe = purine_add_rn(A, -purine_add_rn(q, -t)) + purine_add_rn(bp, -t);
  const T w = purine_mul_rn(a, q);
  const T c = purine_fma(a, q, -w) +
              a * (qe + bpe + B * pe + purine_gelu_a_lo(x) + purine_gelu_b_lo(x) * p);
  const bool positive = w >= T(0);
  const T e = purine_exp(positive ? -w : w) * (T(1) - (positive ? c : -c));
  const T r = T(1) / (T(1) + e);
  *s = positive ? r : e * r;   // a NaN x: e r, NaN
  *s1s = e * r * r;
}


// y[i] = v: rounded to the pass's low type (`round`) for a float32 / float64
// y, or as the bits of the bfloat16 nearest v (a y stored as bits: the upper
// half of round_bf16's float32, `round` unused)
template <typename T>
__device__ __forceinline__ void purine_store(T* y, long long i, T v, int round) {
  y[i] = purine_round_low(v, round);
}
__device__ __forceinline__ void purine_store(unsigned short* y, long long i, float v, int) {
  y[i] = (unsigned short)(purine_round_bf16(purine_float_bits(v)) >> 16);
}

// T: the type computed in; X, Y: x's and y's storage (T, or bfloat16 bits
// for T float)
template <typename T, typename X, typename Y, bool TANH>
__device__ void gelu_forward_loop(long long total, const X* x, int round, Y* y) {
  CUDA_KERNEL_LOOP(i, total) {
    const T v = purine_load(x, i);
    T factor, unused;
    if (TANH) {
      purine_gelu_tanh(v, &factor, &unused);
    } else {
      purine_normal(v, &factor, &unused);
    }
    purine_store(y, i, purine_mul_dx(v, factor), round);
  }
}

template <typename X, typename Y>
__device__ void gelu_forward_f32(long long total, const X* x, int tanh_form, int round, Y* y) {
  if (tanh_form) {
    gelu_forward_loop<float, X, Y, true>(total, x, round, y);
  } else {
    gelu_forward_loop<float, X, Y, false>(total, x, round, y);
  }
}

// float32 x, y as bits
extern "C" __global__ void gelu_forward_bits_f32(long long total, const float* x,
                                                 int tanh_form, unsigned short* y) {
  gelu_forward_f32(total, x, tanh_form, 0, y);
}

// x as bits (a blob stored as bits: the fully connected output GELU reads),
// y float32 (rounded to `round`) or as bits; a bits y may be x (each element
// is read before it is written)
extern "C" __global__ void gelu_forward_bx_f32(long long total, const unsigned short* x,
                                               int tanh_form, int round, float* y) {
  gelu_forward_f32(total, x, tanh_form, round, y);
}

extern "C" __global__ void gelu_forward_bx_bits_f32(long long total, const unsigned short* x,
                                                    int tanh_form, unsigned short* y) {
  gelu_forward_f32(total, x, tanh_form, 0, y);
}

// D, X: dy's and x's storage (T, or bfloat16 bits for T float)
// copy: null, or (T float) also the bits of the bfloat16 nearest each dx
// written (a gradient that products read as bits, bf16 storage: the Cast's
// bits of the float32 dx, in the same pass)
template <typename T, typename D, typename X, bool TANH, bool COPY>
__device__ void gelu_backward_loop(long long total, const D* dy, const X* x, int round, T* dx,
                                   unsigned short* copy) {
  CUDA_KERNEL_LOOP(i, total) {
    const T v = purine_load(x, i);
    T d;
    if (TANH) {
      T s, s1s;
      purine_gelu_tanh(v, &s, &s1s);
      const T du = T(0.7978845608028654) + T(0.10703222440890037) * (v * v);   // u'
      d = s + v * (T(2) * s1s) * du;
    } else {
      T cdf, pdf;
      purine_normal(v, &cdf, &pdf);
      d = cdf + v * pdf;
    }
    dx[i] = purine_round_low(purine_mul_dx(T(purine_load(dy, i)), d), round);
    if (COPY) purine_store(copy, i, float(dx[i]), 0);
  }
}

template <typename T>
__device__ void gelu_forward_impl(long long total, const T* x, int tanh_form, int round, T* y) {
  if (tanh_form) {
    gelu_forward_loop<T, T, T, true>(total, x, round, y);
  } else {
    gelu_forward_loop<T, T, T, false>(total, x, round, y);
  }
}

template <typename T, typename D, typename X>
__device__ void gelu_backward_impl(long long total, const D* dy, const X* x, int tanh_form,
                                   int round, T* dx, unsigned short* copy = nullptr) {
  if (copy != nullptr && tanh_form) {
    gelu_backward_loop<T, D, X, true, true>(total, dy, x, round, dx, copy);
  } else if (copy != nullptr) {
    gelu_backward_loop<T, D, X, false, true>(total, dy, x, round, dx, copy);
  } else if (tanh_form) {
    gelu_backward_loop<T, D, X, true, false>(total, dy, x, round, dx, copy);
  } else {
    gelu_backward_loop<T, D, X, false, false>(total, dy, x, round, dx, copy);
  }
}

// float32 dy and dx, x as bits
extern "C" __global__ void gelu_backward_bx_f32(long long total, const float* dy,
                                                const unsigned short* x, int tanh_form,
                                                int round, float* dx) {
  gelu_backward_impl<float, float, unsigned short>(total, dy, x, tanh_form, round, dx);
}

// dy as bits (a data gradient stored as bits, bf16 storage), x float32 or
// as bits, dx float32: dy widened exactly, the float32 dy's dx bit for bit
extern "C" __global__ void gelu_backward_bdy_f32(long long total, const unsigned short* dy,
                                                 const float* x, int tanh_form, int round,
                                                 float* dx) {
  gelu_backward_impl<float, unsigned short, float>(total, dy, x, tanh_form, round, dx);
}

extern "C" __global__ void gelu_backward_bdy_bx_f32(long long total, const unsigned short* dy,
                                                    const unsigned short* x, int tanh_form,
                                                    int round, float* dx) {
  gelu_backward_impl<float, unsigned short, unsigned short>(total, dy, x, tanh_form, round,
                                                            dx);
}

// The _copy entry points: float32 dx as above (dy, x float32 or as bits)
// and its bfloat16 bits in `copy` too (uint16, to_bf16_bits of dx), one pass:
// dx read by a float32 reader (a bias gradient) and its bits by the products
// (parallel/precision.fold_copies). dx may be a float32 dy's bytes, copy a
// dy's or an x's stored as bits (in place: each element of them is read
// before dx's and copy's are written; ops/activation.py GeluGrad.in_place).
extern "C" __global__ void gelu_backward_copy_f32(long long total, const float* dy,
                                                  const float* x, int tanh_form, int round,
                                                  float* dx, unsigned short* copy) {
  gelu_backward_impl<float, float, float>(total, dy, x, tanh_form, round, dx, copy);
}

extern "C" __global__ void gelu_backward_bx_copy_f32(long long total, const float* dy,
                                                     const unsigned short* x, int tanh_form,
                                                     int round, float* dx,
                                                     unsigned short* copy) {
  gelu_backward_impl<float, float, unsigned short>(total, dy, x, tanh_form, round, dx, copy);
}

extern "C" __global__ void gelu_backward_bdy_copy_f32(long long total, const unsigned short* dy,
                                                      const float* x, int tanh_form, int round,
                                                      float* dx, unsigned short* copy) {
  gelu_backward_impl<float, unsigned short, float>(total, dy, x, tanh_form, round, dx, copy);
}

extern "C" __global__ void gelu_backward_bdy_bx_copy_f32(long long total,
                                                         const unsigned short* dy,
                                                         const unsigned short* x,
                                                         int tanh_form, int round, float* dx,
                                                         unsigned short* copy) {
  gelu_backward_impl<float, unsigned short, unsigned short>(total, dy, x, tanh_form, round, dx,
                                                            copy);
}

// The bias of a fully connected layer whose output is stored as bits: y[i]
// = the bfloat16 bits of the float32 src[i] + bias[i % channels] (src: the
// float32 product, row-major (rows, channels)) -- the float32 storage path's
// bias_act (relu 0, inner 1) followed by round_bf16, one rounding, in one
// pass. No fused ReLU (the pass stores no such output as bits).
extern "C" __global__ void bias_bits_f32(long long total, const float* src, const float* bias,
                                         long long channels, unsigned short* y) {
  CUDA_KERNEL_LOOP(i, total) {
    float v = src[i];
    v += bias[i % channels];
    y[i] = (unsigned short)(purine_round_bf16(purine_float_bits(v)) >> 16);
  }
}

// A residual add whose second term is stored as bits (an fc output with a
// bias, bf16 storage): y[i] = a[i] + the float32 value of the bfloat16 bits
// b[i] (exact), one float32 addition -- the Eltwise sum's of the float32
// storage (an addition commutes exactly, so b may be either input); y may
// be a (each element read before it is written).
extern "C" __global__ void add_bits_f32(long long total, const float* a,
                                        const unsigned short* b, float* y) {
  CUDA_KERNEL_LOOP(i, total) { y[i] = a[i] + purine_bf16_float(b[i]); }
}

// A gradient sum whose result products read as bits too (a residual
// gradient, bf16 storage; ops/basic.py Sum with bits_copy): y[i] = a[i] +
// b[i] in float32 (the sum's own addition) and copy[i] = the bits of the
// bfloat16 nearest y[i] (to_bf16_bits of y), one pass. y may be a or b.
extern "C" __global__ void add_copy_f32(long long total, const float* a, const float* b,
                                        float* y, unsigned short* copy) {
  CUDA_KERNEL_LOOP(i, total) {
    const float v = a[i] + b[i];
    y[i] = v;
    purine_store(copy, i, v, 0);
  }
}

// ------------------------------------------------- the vectorised kernels ---
// bias_bits_vec_f32, gelu_forward_bx_bits_vec_f32 and the gelu_backward_
// ..._vec_f32 entry points: the float32 / bits kernels above made memory-
// bound for GPT-2's (16384, 768-3072) activations. The old ones stay (the
// launchers choose; benchmarks/bias_gelu_gpu.py times old against new).
// Each thread owns chunks of 8 consecutive elements (grid-stride over the
// chunks): 8 bfloat16 bits in one 16-byte load or store (uint4, two to a
// word, the lower address in the low half), 8 float32 in two. The old
// kernels moved 2 bytes a thread per bits operand, and bias_bits divided a
// 64-bit index by the channels once an element (i % channels: a 64-bit
// division is a long software sequence on a GPU); here the chunk's first
// channel moves by a fixed step (one division a thread, not one an element).
// The arithmetic is the old kernels' own inline functions on the same
// float32 values in the same order: the same bits. The launcher takes
// these only where every array's base is 16-byte aligned (and, bias_bits,
// channels a multiple of 8, so a chunk's bias is two aligned 16-byte loads);
// the last total % 8 elements go the scalar way, one a thread. In place as
// the old kernels (each thread reads its chunk of every input before it
// writes that chunk of any output).

// A chunk of 8 float32 from two 16-byte loads, or from 8 bfloat16 bits in one
__device__ __forceinline__ void purine_load8(const float* x, long long chunk, float* v) {
  const uint4* p = (const uint4*)(const void*)x + 2 * chunk;
  const uint4 a = p[0], b = p[1];
  v[0] = purine_bits_float(a.x); v[1] = purine_bits_float(a.y);
  v[2] = purine_bits_float(a.z); v[3] = purine_bits_float(a.w);
  v[4] = purine_bits_float(b.x); v[5] = purine_bits_float(b.y);
  v[6] = purine_bits_float(b.z); v[7] = purine_bits_float(b.w);
}
__device__ __forceinline__ void purine_load8(const unsigned short* x, long long chunk,
                                             float* v) {
  const uint4 a = ((const uint4*)(const void*)x)[chunk];
  const unsigned int w[4] = {a.x, a.y, a.z, a.w};
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = purine_bits_float(w[k] << 16);
    v[2 * k + 1] = purine_bits_float(w[k] & 0xffff0000u);
  }
}
__device__ __forceinline__ void purine_store8(float* y, long long chunk, const float* v) {
  uint4 a, b;
  a.x = purine_float_bits(v[0]); a.y = purine_float_bits(v[1]);
  a.z = purine_float_bits(v[2]); a.w = purine_float_bits(v[3]);
  b.x = purine_float_bits(v[4]); b.y = purine_float_bits(v[5]);
  b.z = purine_float_bits(v[6]); b.w = purine_float_bits(v[7]);
  uint4* p = (uint4*)(void*)y + 2 * chunk;
  p[0] = a;
  p[1] = b;
}
// the bits of the bfloat16 nearest each of 8 float32 (purine_store's)
__device__ __forceinline__ void purine_store8_bits(unsigned short* y, long long chunk,
                                                   const float* v) {
  unsigned int w[4];
  for (int k = 0; k < 4; ++k) {
    w[k] = (purine_round_bf16(purine_float_bits(v[2 * k])) >> 16) |
           purine_round_bf16(purine_float_bits(v[2 * k + 1]));
  }
  uint4 a;
  a.x = w[0]; a.y = w[1]; a.z = w[2]; a.w = w[3];
  ((uint4*)(void*)y)[chunk] = a;
}

#define PURINE_VEC_LOOP(k, chunks)                                             \
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;         \
       k < (chunks); k += (long long)blockDim.x * gridDim.x)
// the last total % 8 elements, one a thread of the grid's first ones
#define PURINE_VEC_TAIL(i, total)                                              \
  for (long long i = ((total) / 8) * 8 + (long long)blockIdx.x * blockDim.x + \
                     threadIdx.x;                                              \
       i < (total); i += (long long)blockDim.x * gridDim.x)

// bias_bits_f32 by chunks (channels a multiple of 8, src, bias, y 16-byte
// aligned): a chunk lies in one row, its channels c .. c + 7
extern "C" __global__ void bias_bits_vec_f32(long long total, const float* src,
                                             const float* bias, long long channels,
                                             unsigned short* y) {
  const long long chunks = total / 8;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long stride = (long long)blockDim.x * gridDim.x;
  long long c = (8 * first) % channels;   // the chunk's first channel
  const long long step = (8 * stride) % channels;
  for (long long k = first; k < chunks; k += stride) {
    float v[8], b[8];
    purine_load8(src, k, v);
    purine_load8(bias, c / 8, b);
    for (int j = 0; j < 8; ++j) v[j] += b[j];
    purine_store8_bits(y, k, v);
    c += step;
    if (c >= channels) c -= channels;
  }
  PURINE_VEC_TAIL(i, total) {   // none here while channels % 8 == 0; kept for safety
    float v = src[i];
    v += bias[i % channels];
    y[i] = (unsigned short)(purine_round_bf16(purine_float_bits(v)) >> 16);
  }
}

template <bool TANH>
__device__ __forceinline__ float purine_gelu_y(float v) {
  float factor, unused;
  if (TANH) {
    purine_gelu_tanh(v, &factor, &unused);
  } else {
    purine_normal(v, &factor, &unused);
  }
  return purine_mul_dx(v, factor);
}

template <bool TANH>
__device__ void gelu_forward_bits_vec_loop(long long total, const unsigned short* x,
                                           unsigned short* y) {
  PURINE_VEC_LOOP(k, total / 8) {
    float v[8];
    purine_load8(x, k, v);
    for (int j = 0; j < 8; ++j) v[j] = purine_gelu_y<TANH>(v[j]);
    purine_store8_bits(y, k, v);
  }
  PURINE_VEC_TAIL(i, total) { purine_store(y, i, purine_gelu_y<TANH>(purine_load(x, i)), 0); }
}

// gelu_forward_bx_bits_f32 by chunks; y may be x
extern "C" __global__ void gelu_forward_bx_bits_vec_f32(long long total,
                                                        const unsigned short* x,
                                                        int tanh_form, unsigned short* y) {
  if (tanh_form) {
    gelu_forward_bits_vec_loop<true>(total, x, y);
  } else {
    gelu_forward_bits_vec_loop<false>(total, x, y);
  }
}

// dx = dy dGELU(x), rounded to `round`: gelu_backward_loop's float32 body
template <bool TANH>
__device__ __forceinline__ float purine_gelu_dx(float g, float v, int round) {
  float d;
  if (TANH) {
    float s, s1s;
    purine_gelu_tanh(v, &s, &s1s);
    const float du = 0.7978845608028654f + 0.10703222440890037f * (v * v);   // u'
    d = s + v * (2.0f * s1s) * du;
  } else {
    float cdf, pdf;
    purine_normal(v, &cdf, &pdf);
    d = cdf + v * pdf;
  }
  return purine_round_low(purine_mul_dx(g, d), round);
}

template <typename D, typename X, bool TANH, bool COPY>
__device__ void gelu_backward_vec_loop(long long total, const D* dy, const X* x, int round,
                                       float* dx, unsigned short* copy) {
  PURINE_VEC_LOOP(k, total / 8) {
    float g[8], v[8];
    purine_load8(dy, k, g);
    purine_load8(x, k, v);
    for (int j = 0; j < 8; ++j) g[j] = purine_gelu_dx<TANH>(g[j], v[j], round);
    purine_store8(dx, k, g);
    if (COPY) purine_store8_bits(copy, k, g);
  }
  PURINE_VEC_TAIL(i, total) {
    const float r = purine_gelu_dx<TANH>(purine_load(dy, i), purine_load(x, i), round);
    dx[i] = r;
    if (COPY) purine_store(copy, i, r, 0);
  }
}

template <typename D, typename X, bool COPY>
__device__ void gelu_backward_vec(long long total, const D* dy, const X* x, int tanh_form,
                                  int round, float* dx, unsigned short* copy) {
  if (tanh_form) {
    gelu_backward_vec_loop<D, X, true, COPY>(total, dy, x, round, dx, copy);
  } else {
    gelu_backward_vec_loop<D, X, false, COPY>(total, dy, x, round, dx, copy);
  }
}

// gelu_backward<_bdy><_bx><_copy>_f32 by chunks: <NAME>_vec_f32, the same
// arguments (D, X: dy's and x's storage)
#define PURINE_GELU_BACKWARD_VEC(NAME, D, X)                                           \
  extern "C" __global__ void NAME##_vec_f32(long long total, const D* dy, const X* x,  \
                                            int tanh_form, int round, float* dx) {     \
    gelu_backward_vec<D, X, false>(total, dy, x, tanh_form, round, dx, nullptr);       \
  }                                                                                    \
  extern "C" __global__ void NAME##_copy_vec_f32(long long total, const D* dy,         \
                                                 const X* x, int tanh_form, int round, \
                                                 float* dx, unsigned short* copy) {    \
    gelu_backward_vec<D, X, true>(total, dy, x, tanh_form, round, dx, copy);           \
  }

PURINE_GELU_BACKWARD_VEC(gelu_backward, float, float)
PURINE_GELU_BACKWARD_VEC(gelu_backward_bx, float, unsigned short)
PURINE_GELU_BACKWARD_VEC(gelu_backward_bdy, unsigned short, float)
PURINE_GELU_BACKWARD_VEC(gelu_backward_bdy_bx, unsigned short, unsigned short)

// ------------------------------- GELU's gradient with its bias gradient ---
// gelu_backward<_bdy><_bx><_copy>_colsum_f32: the _vec kernels' dx (and
// copy) of a (rows, cols) dy and x, and in the same pass the column sums
// of dx a fully connected layer's bias gradient takes (the fc feeding
// GELU: db = sum over rows of dx; ops/activation.py GeluGrad with attr
// ``bias_grad``, parallel/fuse.fold_gelu_bias_grads) -- where the graph
// had GeluGrad write dx and InnerProductGradBias read all of it again
// (cuda/reduce.cu sum_rows_vec_f32). The column sums are sum_rows_vec's
// bit for bit: the same blocks (a tile of 4 x PURINE_GELU_SUM_TILE
// columns x a range of rows, split s of `splits`: rows [s*rows/splits,
// (s+1)*rows/splits), the splits bias_grad_splits gives sum_rows for the
// shape), the same row lanes (a block of B threads: min(B, TILE) lanes of
// 4 columns x B / lanes row lanes), each column's float32 dx added in
// double in row order, the same fixed-order shared-memory tree over the
// row lanes; with one split the block writes db[c] (rounded to float32),
// else its partial sum to partial[c * splits + s] and reduce.cu's
// bias_grad_finish_f32 adds each column's partials in split order. No
// atomics: the same bits every run, and the bits of the two-kernel path.
// For cols a multiple of 4 and 16-byte aligned dx (8-byte aligned bits
// operands), as the launcher checks (else it takes the two kernels).
// Launched with at most PURINE_GELU_SUM_THREADS threads a block. dx may
// be dy, copy a bits dy or x (each element read before it is written).
#define PURINE_GELU_SUM_THREADS 256
#define PURINE_GELU_SUM_TILE 32      // PURINE_SUM_ROWS_TILE of cuda/reduce.cu
#define PURINE_GELU_SUM_BATCH 8      // rows' loads in flight a thread

#ifdef __CUDACC__
typedef float4 purine_gelu_f4;
#else
struct alignas(16) purine_gelu_f4 { float x, y, z, w; };
#endif

// four consecutive float32 (one 16-byte load) or bfloat16 bits (8 bytes)
template <typename T> struct purine_four;
template <> struct purine_four<float> {
  typedef purine_gelu_f4 type;
  static __device__ __forceinline__ type load(const float* x, long long i) {
    return *(const purine_gelu_f4*)(const void*)(x + i);
  }
  static __device__ __forceinline__ float at(const type& a, int k) {
    return k == 0 ? a.x : k == 1 ? a.y : k == 2 ? a.z : a.w;
  }
};
template <> struct purine_four<unsigned short> {
  typedef uint2 type;
  static __device__ __forceinline__ type load(const unsigned short* x, long long i) {
    return *(const uint2*)(const void*)(x + i);
  }
  static __device__ __forceinline__ float at(const type& a, int k) {
    const unsigned int w = k < 2 ? a.x : a.y;
    return purine_bits_float((k & 1) ? (w & 0xffff0000u) : (w << 16));
  }
};

// dx and copy of one row's four columns at i; the four dx values in r
template <typename D, typename X, bool TANH, bool COPY>
__device__ __forceinline__ void purine_gelu_four(const typename purine_four<D>::type& g,
                                                 const typename purine_four<X>::type& v,
                                                 int round, long long i, float* dx,
                                                 unsigned short* copy, float* r) {
  for (int k = 0; k < 4; ++k) {
    r[k] = purine_gelu_dx<TANH>(purine_four<D>::at(g, k), purine_four<X>::at(v, k), round);
  }
  purine_gelu_f4 o;
  o.x = r[0]; o.y = r[1]; o.z = r[2]; o.w = r[3];
  *(purine_gelu_f4*)(void*)(dx + i) = o;
  if (COPY) {
    uint2 b;
    b.x = (purine_round_bf16(purine_float_bits(r[0])) >> 16) |
          purine_round_bf16(purine_float_bits(r[1]));
    b.y = (purine_round_bf16(purine_float_bits(r[2])) >> 16) |
          purine_round_bf16(purine_float_bits(r[3]));
    *(uint2*)(void*)(copy + i) = b;
  }
}

template <typename D, typename X, bool TANH, bool COPY>
__device__ void gelu_backward_colsum_loop(long long cols, const D* dy, const X* x,
                                          long long rows, long long splits, int round,
                                          float* dx, unsigned short* copy, double* partial,
                                          float* db) {
  __shared__ double sums[4][PURINE_GELU_SUM_THREADS];
  const unsigned int tid = threadIdx.x;
  const unsigned int lanes = blockDim.x < PURINE_GELU_SUM_TILE ? blockDim.x
                                                               : PURINE_GELU_SUM_TILE;
  const unsigned int depth = blockDim.x / lanes;   // row lanes
  const unsigned int lane = tid % lanes, row_lane = tid / lanes;
  const long long tile_cols = 4 * PURINE_GELU_SUM_TILE;
  const long long tiles = (cols + tile_cols - 1) / tile_cols;
  const long long d = depth;
  typedef purine_four<D> GD;
  typedef purine_four<X> GX;
  for (long long job = blockIdx.x; job < tiles * splits; job += gridDim.x) {
    const long long tile = job / splits, j = job - tile * splits;
    const long long first = j * rows / splits, last = (j + 1) * rows / splits;
    const long long start = tile * tile_cols;
    const long long width = cols - start < tile_cols ? cols - start : tile_cols;
    for (long long offset = 0; offset < width; offset += 4 * (long long)lanes) {
      const long long c = start + offset + 4 * (long long)lane;   // columns c .. c + 3
      const bool mine = row_lane < depth && offset + 4 * (long long)lane < width;
      double sum[4] = {0.0, 0.0, 0.0, 0.0};
      if (mine) {
        const int batch = PURINE_GELU_SUM_BATCH;
        long long i = first + row_lane;
        // a batch of rows' loads, then each row's dx, stores and adds in row order
        for (; i + (batch - 1) * d < last; i += batch * d) {
          typename GD::type g[PURINE_GELU_SUM_BATCH];
          typename GX::type v[PURINE_GELU_SUM_BATCH];
#pragma unroll
          for (int b = 0; b < batch; ++b) {
            g[b] = GD::load(dy, (i + b * d) * cols + c);
            v[b] = GX::load(x, (i + b * d) * cols + c);
          }
#pragma unroll
          for (int b = 0; b < batch; ++b) {
            float r[4];
            purine_gelu_four<D, X, TANH, COPY>(g[b], v[b], round, (i + b * d) * cols + c, dx,
                                               copy, r);
            for (int k = 0; k < 4; ++k) sum[k] += (double)r[k];
          }
        }
        for (; i < last; i += d) {
          const typename GD::type g = GD::load(dy, i * cols + c);
          const typename GX::type v = GX::load(x, i * cols + c);
          float r[4];
          purine_gelu_four<D, X, TANH, COPY>(g, v, round, i * cols + c, dx, copy, r);
          for (int k = 0; k < 4; ++k) sum[k] += (double)r[k];
        }
      }
      for (int k = 0; k < 4; ++k) sums[k][tid] = sum[k];
      __syncthreads();
      for (unsigned int stride = 1; stride < depth; stride <<= 1) {
        if (row_lane % (2 * stride) == 0 && row_lane + stride < depth) {
          for (int k = 0; k < 4; ++k) sums[k][tid] += sums[k][tid + stride * lanes];
        }
        __syncthreads();
      }
      if (mine && row_lane == 0) {
        for (int k = 0; k < 4; ++k) {
          const double total = sums[k][tid];
          if (splits == 1) db[c + k] = (float)total;
          else partial[(c + k) * splits + j] = total;
        }
      }
      __syncthreads();   // every total is read: sums may be reused
    }
  }
}

template <typename D, typename X, bool COPY>
__device__ void gelu_backward_colsum(long long cols, const D* dy, const X* x, long long rows,
                                     long long splits, int tanh_form, int round, float* dx,
                                     unsigned short* copy, double* partial, float* db) {
  if (tanh_form) {
    gelu_backward_colsum_loop<D, X, true, COPY>(cols, dy, x, rows, splits, round, dx, copy,
                                                partial, db);
  } else {
    gelu_backward_colsum_loop<D, X, false, COPY>(cols, dy, x, rows, splits, round, dx, copy,
                                                 partial, db);
  }
}

#define PURINE_GELU_BACKWARD_COLSUM(NAME, D, X)                                              \
  extern "C" __global__ void NAME##_colsum_f32(long long cols, const D* dy, const X* x,      \
                                               long long rows, long long splits,             \
                                               int tanh_form, int round, float* dx,          \
                                               double* partial, float* db) {                 \
    gelu_backward_colsum<D, X, false>(cols, dy, x, rows, splits, tanh_form, round, dx,       \
                                      nullptr, partial, db);                                 \
  }                                                                                          \
  extern "C" __global__ void NAME##_copy_colsum_f32(                                         \
      long long cols, const D* dy, const X* x, long long rows, long long splits,             \
      int tanh_form, int round, float* dx, unsigned short* copy, double* partial,            \
      float* db) {                                                                           \
    gelu_backward_colsum<D, X, true>(cols, dy, x, rows, splits, tanh_form, round, dx, copy,  \
                                     partial, db);                                           \
  }

PURINE_GELU_BACKWARD_COLSUM(gelu_backward, float, float)
PURINE_GELU_BACKWARD_COLSUM(gelu_backward_bx, float, unsigned short)
PURINE_GELU_BACKWARD_COLSUM(gelu_backward_bdy, unsigned short, float)
PURINE_GELU_BACKWARD_COLSUM(gelu_backward_bdy_bx, unsigned short, unsigned short)

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
  }                                                                                    \
  extern "C" __global__ void gelu_forward_##SUFFIX(long long total, const T* x,        \
                                                   int tanh_form, int round, T* y) {   \
    gelu_forward_impl<T>(total, x, tanh_form, round, y);                               \
  }                                                                                    \
  extern "C" __global__ void gelu_backward_##SUFFIX(long long total, const T* dy,      \
                                                    const T* x, int tanh_form,         \
                                                    int round, T* dx) {                \
    gelu_backward_impl<T, T, T>(total, dy, x, tanh_form, round, dx);                      \
  }

PURINE_ACTIVATION_ENTRY(f32, float)
PURINE_ACTIVATION_ENTRY(f64, double)
