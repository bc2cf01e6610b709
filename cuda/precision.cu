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
// to_bf16_bits_device and from_bf16_bits_device launch them.

#include "precision.cuh"

extern "C" __global__ void round_bf16(long long n, unsigned int* bits) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)blockDim.x * gridDim.x) {
    bits[i] = purine_round_bf16(bits[i]);
  }
}

extern "C" __global__ void round_fp16(long long n, unsigned int* bits) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)blockDim.x * gridDim.x) {
    bits[i] = purine_round_fp16(bits[i]);
  }
}

extern "C" __global__ void to_bf16_bits(long long n, const unsigned int* x,
                                        unsigned short* bits) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)blockDim.x * gridDim.x) {
    bits[i] = (unsigned short)(purine_round_bf16(x[i]) >> 16);
  }
}

extern "C" __global__ void from_bf16_bits(long long n, const unsigned short* bits,
                                          unsigned int* x) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)blockDim.x * gridDim.x) {
    x[i] = (unsigned int)bits[i] << 16;
  }
}
