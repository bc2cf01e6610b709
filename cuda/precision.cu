// Rounding of float32 arrays, in place, to the nearest bfloat16 or float16
// value, kept in float32 storage (base/precision.py; the precision pass's
// Cast ops and the rounded outputs of ops/registry._round_outputs):
//
//   round_bf16   bits[i] = the float32 bits of the bfloat16 nearest bits[i]
//                (ties to even; infinities and NaNs truncated to their upper
//                16 bits, as base/precision._round_bits: a NaN whose payload
//                lies in the low 16 bits only becomes infinite; the largest
//                finite values carry into infinity)
//   round_fp16   bits[i] = the float32 bits of the float16 nearest bits[i]
//                (ties to even, as __float2half_rn and NumPy's cast: beyond
//                65504 (from 65520 on) infinite, below 2^-14 the float16
//                subnormals, multiples of 2^-24; a NaN keeps its sign and the
//                top 10 bits of its payload, or becomes the NaN 0x7f802000 of
//                that sign if they are zero, as NumPy's float16 round trip)
//   to_bf16_bits    bits[i] = the upper 16 bits of round_bf16(x[i]): the
//                   bfloat16 nearest x[i] as its uint16 bits, x unchanged
//                   (base/precision.to_bf16_bits, parallel.grad_dtype: bf16)
//   from_bf16_bits  x[i] = bits[i] << 16: the bfloat16 widened exactly
//                   (base/precision.from_bf16_bits)
//
// One pass over the array (the bit functions in precision.cuh, which
// activation.cu's GELU shares), integer arithmetic on the float32 bits (no
// float16 type: NVRTC gets no cuda_fp16.h here), no scratch, nothing
// allocated: a captured CUDA graph may hold a launch. The float32 arrays
// are viewed as uint32 (the bfloat16 bits are uint16), so the entry points
// exist once, without a dtype suffix: purine_mpi.gpu.kernels.round_in_place,
// round_copy, to_bf16_bits_device and from_bf16_bits_device launch them.
//
// round_bf16 / round_fp16 (n, src, dst): dst[i] = the rounding of src[i];
// src == dst rounds in place (round_in_place: a low-precision op's outputs),
// src != dst is the Cast op's copy and rounding in one pass (round_copy:
// read once, written once, instead of a copy and an in-place pass). They
// are memory bound: where src and dst are both 16-byte aligned (a CuPy
// allocation is; a view into the memory plan's arena may not be) each
// thread moves 16 bytes a load and a store (uint4: 4 values), grid-stride,
// then the n % 4 last values one each; otherwise one value a thread. A
// 16-byte access keeps 4x the bytes of a 4-byte one in flight per thread
// (one 4-byte load per thread cannot keep HBM busy). Every value is rounded
// by the same function either way: the same bits.

#include "precision.cuh"

// dst[i] = ROUND(src[i]) for i < n (see the header: 16 bytes a thread where
// both pointers are 16-byte aligned, then the tail)
template <int FP16>
__device__ __forceinline__ unsigned int purine_round_value(unsigned int b) {
  return FP16 ? purine_round_fp16(b) : purine_round_bf16(b);
}

// The grid-stride pass of every kernel here: quad(i) for each group i of 4
// values (i < n / 4) where ``vector`` (the pointers allow 16-byte access),
// then one(i) for each value i from the first that no quad covered.
template <class Quad, class One>
__device__ __forceinline__ void purine_quad_pass(long long n, bool vector, Quad quad, One one) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long scalar_from = 0;
  if (vector) {
    const long long quads = n >> 2;
    for (long long i = first; i < quads; i += stride) {
      quad(i);
    }
    scalar_from = quads << 2;
  }
  for (long long i = scalar_from + first; i < n; i += stride) {
    one(i);
  }
}

template <int FP16>
__device__ __forceinline__ void purine_round_pass(long long n, const unsigned int* src,
                                                  unsigned int* dst) {
  const uint4* s4 = (const uint4*)src;
  uint4* d4 = (uint4*)dst;
  purine_quad_pass(
      n, (((unsigned long long)src | (unsigned long long)dst) & 15ull) == 0ull,
      [=](long long i) {
        uint4 v = s4[i];
        v.x = purine_round_value<FP16>(v.x);
        v.y = purine_round_value<FP16>(v.y);
        v.z = purine_round_value<FP16>(v.z);
        v.w = purine_round_value<FP16>(v.w);
        d4[i] = v;
      },
      [=](long long i) { dst[i] = purine_round_value<FP16>(src[i]); });
}

extern "C" __global__ void round_bf16(long long n, const unsigned int* src, unsigned int* dst) {
  purine_round_pass<0>(n, src, dst);
}

extern "C" __global__ void round_fp16(long long n, const unsigned int* src, unsigned int* dst) {
  purine_round_pass<1>(n, src, dst);
}

// to_bf16_bits / from_bf16_bits: 4 values a thread (16 bytes of float32,
// 8 of bfloat16 bits: a uint4 and a uint2) where the float32 array is
// 16-byte aligned and the bits 8-byte aligned, then the n % 4 last ones;
// otherwise one a thread. The same bits either way.
__device__ __forceinline__ bool purine_bits_vector(const void* x, const void* bits) {
  return ((unsigned long long)x & 15ull) == 0ull && ((unsigned long long)bits & 7ull) == 0ull;
}

extern "C" __global__ void to_bf16_bits(long long n, const unsigned int* x,
                                        unsigned short* bits) {
  const uint4* x4 = (const uint4*)x;
  uint2* b4 = (uint2*)bits;
  purine_quad_pass(
      n, purine_bits_vector(x, bits),
      [=](long long i) {
        const uint4 v = x4[i];
        uint2 out;   // little-endian: value 4i in the low half of out.x
        out.x = (purine_round_bf16(v.x) >> 16) | (purine_round_bf16(v.y) & 0xffff0000u);
        out.y = (purine_round_bf16(v.z) >> 16) | (purine_round_bf16(v.w) & 0xffff0000u);
        b4[i] = out;
      },
      [=](long long i) { bits[i] = (unsigned short)(purine_round_bf16(x[i]) >> 16); });
}

extern "C" __global__ void from_bf16_bits(long long n, const unsigned short* bits,
                                          unsigned int* x) {
  const uint2* b4 = (const uint2*)bits;
  uint4* x4 = (uint4*)x;
  purine_quad_pass(
      n, purine_bits_vector(x, bits),
      [=](long long i) {
        const uint2 b = b4[i];
        uint4 out;
        out.x = b.x << 16;
        out.y = b.x & 0xffff0000u;
        out.z = b.y << 16;
        out.w = b.y & 0xffff0000u;
        x4[i] = out;
      },
      [=](long long i) { x[i] = (unsigned int)bits[i] << 16; });
}
