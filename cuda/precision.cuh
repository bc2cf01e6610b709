// The float32 -> bfloat16 / float16 rounding on the bits of a float32, shared
// by precision.cu (the rounding kernels) and the kernels that round their own
// float32 output in the pass that writes it (activation.cu's GELU): the same
// functions, so the same bits as a separate round_bf16 / round_fp16 pass.
// The rules (ties to even, infinities, NaN payloads, float16 subnormals) are
// in precision.cu's header.
//
// Included by those kernels; the loader (purine_mpi.gpu.kernel_source)
// inlines it, since NVRTC has no include path. Plain C++: it compiles for
// the host too (the emulated device in the tests).

#ifndef PURINE_PRECISION_CUH
#define PURINE_PRECISION_CUH

#define PURINE_EXPONENT 0x7f800000u

__device__ __forceinline__ float purine_bits_float(unsigned int bits) {
  union { unsigned int u; float f; } v;
  v.u = bits;
  return v.f;
}

__device__ __forceinline__ unsigned int purine_float_bits(float value) {
  union { float f; unsigned int u; } v;
  v.f = value;
  return v.u;
}

// The float32 value of bfloat16 bits (uint16): exact (the upper half)
__device__ __forceinline__ float purine_bf16_float(unsigned short bits) {
  return purine_bits_float((unsigned int)bits << 16);
}

// An element of x as the value computed with: a float32 / float64 one as it
// is, bfloat16 bits (a blob stored as bits) widened exactly to float32 --
// the value the float32 storage of the same blob holds, so the same result.
template <typename T>
__device__ __forceinline__ T purine_load(const T* x, long long i) { return x[i]; }
__device__ __forceinline__ float purine_load(const unsigned short* x, long long i) {
  return purine_bf16_float(x[i]);
}

__device__ __forceinline__ unsigned int purine_round_bf16(unsigned int b) {
  // the bit that decides a tie, plus 0x7fff; none for infinities and NaNs
  const unsigned int inc = (b & PURINE_EXPONENT) == PURINE_EXPONENT ? 0u
                           : ((b >> 16) & 1u) + 0x7fffu;
  return (b + inc) & 0xffff0000u;
}

__device__ __forceinline__ unsigned int purine_round_fp16(unsigned int b) {
  const unsigned int sign = b & 0x80000000u, a = b & 0x7fffffffu;
  if (a >= PURINE_EXPONENT) {   // infinity, or NaN: its top 10 payload bits
    if (a == PURINE_EXPONENT) return b;
    const unsigned int payload = a & 0x007fe000u;
    return sign | PURINE_EXPONENT | (payload ? payload : 0x00002000u);
  }
  if (a < 0x38800000u) {        // below 2^-14: a multiple of 2^-24, exactly
    // (|x| 2^24 is exact, rintf rounds it to the nearest integer, ties to
    // even, and the integer (<= 1024) times 2^-24 is exact)
    const float q = rintf(purine_bits_float(a) * 16777216.0f) * 5.9604644775390625e-8f;
    return sign | purine_float_bits(q);
  }
  const unsigned int r = (a + 0x0fffu + ((a >> 13) & 1u)) & 0xffffe000u;
  return sign | (r > 0x477fe000u ? PURINE_EXPONENT : r);   // beyond 65504: infinite
}

// `v` rounded to the precision pass's type `mode`: 0 none (float32 kept),
// 1 bfloat16, 2 float16 -- the bits round_bf16 / round_fp16 give. A double
// is never rounded (the low types round float32 storage only; the
// launchers pass 0 for float64).
__device__ __forceinline__ float purine_round_low(float v, int mode) {
  if (mode == 1) return purine_bits_float(purine_round_bf16(purine_float_bits(v)));
  if (mode == 2) return purine_bits_float(purine_round_fp16(purine_float_bits(v)));
  return v;
}

__device__ __forceinline__ double purine_round_low(double v, int) { return v; }

#endif  // PURINE_PRECISION_CUH
