// Inverted dropout with masks drawn on the device by Philox4x32-10
// (philox.cuh), keyed by (op id, seed) and counted by (block, seed high word,
// iteration), the iteration read from a device blob (no host work, no
// generator state). purine_mpi/philox.py documents the stream; the CPU draws
// the same words, so both devices drop the same units:
//
//   word(i)  = philox4x32_10((i / 4, ctr1, iter lo, iter hi), (key0, key1))[i % 4]
//   mask[i]  = word(i) >= threshold ? 1 : 0          threshold = floor(ratio 2^32)
//   y[i]     = (x[i] * mask[i]) * scale               scale = 1 / (1 - ratio)
//   dx[i]    = (dy[i] * mask[i]) * scale              (the backward)
//
// One thread per block of four elements (one Philox call each), grid-stride.
// `philox_words` writes the raw words (tests compare them with NumPy's).
//
// dropout_apply_copy_f32 (float32 only): dropout_apply's y and also `copy`,
// the bits of the bfloat16 nearest each y (uint16: what a Cast of y to bits
// writes, precision.cuh), in the same pass -- the redrawn backward's dx read
// as float32 (a bias gradient) and, as bits, by the products
// (ops/dropout.py DropoutRedrawGrad with bits_copy,
// parallel/precision.fold_copies). copy is no input's bytes.
// dropout_backward_copy_f32 (float32 only): dropout_backward's dx from a kept
// mask and its bfloat16 bits into `copy`, one pass (ops/dropout.py
// DropoutGrad with bits_copy); dx may be dy, copy is no input's bytes.
//
// Bit-packed masks (activation recompute's, ops/dropout.py ``packed_mask``):
// the mask as np.packbits of the flat keep-mask, big bit order -- element i
// is bit 7 - i % 8 of byte i / 8, the last byte's unused bits 0.
// dropout_forward_packed: dropout_forward's y and the mask written packed,
// one thread per byte (two Philox calls: elements 8 j .. 8 j + 7), no float
// mask anywhere. dropout_backward_packed: dx[i] = (dy[i] * bit(i)) * scale
// read straight from the packed bits (bit(i) as T 1 or 0: dropout_backward's
// product, bit for bit), so no unpacked mask is ever made; also DropoutReplay's
// y = (x * bit) * scale. dropout_backward_packed_copy_f32: that and dx's
// bfloat16 bits into `copy` in the same pass (DropoutGrad with bits_copy).
// dx may be dy; copy is no input's bytes.
//
// Compiled at run time by purine_mpi.gpu.load_kernel("dropout"); one
// extern "C" entry point per dtype: <name>_f32, <name>_f64.

#include "philox.cuh"
#include "precision.cuh"

#define CUDA_KERNEL_LOOP(i, n)                                              \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;      \
       i < (n); i += (long long)blockDim.x * gridDim.x)

__device__ __forceinline__ long long purine_iteration(long long value,
                                                      const long long* ptr, int has_ptr) {
  return has_ptr ? ptr[0] : value;
}

// y[i] = (x[i] * mask[i]) * scale, the mask drawn from (key, ctr1, iteration)
// and written where `mask` is given. Without it (dropout_apply) this is, given
// dy for x, the backward's dx with the mask drawn again instead of kept
// (parallel/placement.redraw_dropout_masks): the kept mask's bits.
// COPY (T float): also y's bfloat16 bits into `copy`
template <typename T, bool COPY = false>
__device__ void dropout_forward_impl(long long blocks, long long total, const T* x,
                                     long long iter_value, const long long* iter_ptr,
                                     int has_iter_ptr, unsigned int key0, unsigned int key1,
                                     unsigned int ctr1, unsigned int threshold, T scale,
                                     T* y, T* mask, unsigned short* copy = nullptr) {
  const unsigned long long it =
      (unsigned long long)purine_iteration(iter_value, iter_ptr, has_iter_ptr);
  CUDA_KERNEL_LOOP(b, blocks) {
    unsigned int ctr[4] = {(unsigned int)b, ctr1, (unsigned int)it,
                           (unsigned int)(it >> 32)};
    purine_philox4x32(ctr, key0, key1, 10);
    for (int j = 0; j < 4; ++j) {
      const long long i = 4 * b + j;
      if (i < total) {
        const T m = ctr[j] >= threshold ? T(1) : T(0);
        if (mask != nullptr) mask[i] = m;
        const T v = (x[i] * m) * scale;
        y[i] = v;
        if (COPY) copy[i] = (unsigned short)(purine_round_bf16(purine_float_bits((float)v)) >> 16);
      }
    }
  }
}

template <typename T>
__device__ void dropout_backward_impl(long long total, const T* dy, const T* mask, T scale,
                                      T* dx) {
  CUDA_KERNEL_LOOP(i, total) { dx[i] = (dy[i] * mask[i]) * scale; }
}

// Bit i of a packed mask (np.packbits' big bit order) as T: 1 or 0.
template <typename T>
__device__ __forceinline__ T purine_mask_bit(const unsigned char* bits, long long i) {
  return ((bits[i >> 3] >> (7 - (int)(i & 7))) & 1) ? T(1) : T(0);
}

// dropout_forward_impl's y with the mask packed: thread j draws elements
// 8 j .. 8 j + 7 (Philox blocks 2 j and 2 j + 1: the words dropout_forward
// draws for them) and writes their byte, the bits past `total` 0.
template <typename T>
__device__ void dropout_forward_packed_impl(long long bytes, long long total, const T* x,
                                            long long iter_value, const long long* iter_ptr,
                                            int has_iter_ptr, unsigned int key0,
                                            unsigned int key1, unsigned int ctr1,
                                            unsigned int threshold, T scale, T* y,
                                            unsigned char* bits) {
  const unsigned long long it =
      (unsigned long long)purine_iteration(iter_value, iter_ptr, has_iter_ptr);
  CUDA_KERNEL_LOOP(j, bytes) {
    unsigned int byte = 0;
    for (int half = 0; half < 2; ++half) {
      const long long b = 2 * j + half;
      unsigned int ctr[4] = {(unsigned int)b, ctr1, (unsigned int)it,
                             (unsigned int)(it >> 32)};
      purine_philox4x32(ctr, key0, key1, 10);
      for (int k = 0; k < 4; ++k) {
        const long long i = 4 * b + k;
        if (i < total) {
          const bool keep = ctr[k] >= threshold;
          const T m = keep ? T(1) : T(0);
          y[i] = (x[i] * m) * scale;
          if (keep) byte |= 1u << (7 - (4 * half + k));
        }
      }
    }
    bits[j] = (unsigned char)byte;
  }
}

template <typename T>
__device__ void dropout_backward_packed_impl(long long total, const T* dy,
                                             const unsigned char* bits, T scale, T* dx) {
  CUDA_KERNEL_LOOP(i, total) { dx[i] = (dy[i] * purine_mask_bit<T>(bits, i)) * scale; }
}

#define PURINE_DROPOUT_ENTRY(SUFFIX, T)                                                  \
  extern "C" __global__ void dropout_forward_##SUFFIX(                                   \
      long long blocks, long long total, const T* x, long long iter_value,               \
      const long long* iter_ptr, int has_iter_ptr, unsigned int key0, unsigned int key1, \
      unsigned int ctr1, unsigned int threshold, T scale, T* y, T* mask) {               \
    dropout_forward_impl<T>(blocks, total, x, iter_value, iter_ptr, has_iter_ptr, key0,  \
                            key1, ctr1, threshold, scale, y, mask);                      \
  }                                                                                      \
  extern "C" __global__ void dropout_apply_##SUFFIX(                                     \
      long long blocks, long long total, const T* x, long long iter_value,               \
      const long long* iter_ptr, int has_iter_ptr, unsigned int key0, unsigned int key1, \
      unsigned int ctr1, unsigned int threshold, T scale, T* y) {                        \
    dropout_forward_impl<T>(blocks, total, x, iter_value, iter_ptr, has_iter_ptr, key0,  \
                            key1, ctr1, threshold, scale, y, nullptr);                   \
  }                                                                                      \
  extern "C" __global__ void dropout_backward_##SUFFIX(                                  \
      long long total, const T* dy, const T* mask, T scale, T* dx) {                     \
    dropout_backward_impl<T>(total, dy, mask, scale, dx);                                \
  }                                                                                      \
  extern "C" __global__ void dropout_forward_packed_##SUFFIX(                            \
      long long bytes, long long total, const T* x, long long iter_value,                \
      const long long* iter_ptr, int has_iter_ptr, unsigned int key0, unsigned int key1, \
      unsigned int ctr1, unsigned int threshold, T scale, T* y, unsigned char* bits) {   \
    dropout_forward_packed_impl<T>(bytes, total, x, iter_value, iter_ptr, has_iter_ptr,  \
                                   key0, key1, ctr1, threshold, scale, y, bits);         \
  }                                                                                      \
  extern "C" __global__ void dropout_backward_packed_##SUFFIX(                           \
      long long total, const T* dy, const unsigned char* bits, T scale, T* dx) {         \
    dropout_backward_packed_impl<T>(total, dy, bits, scale, dx);                         \
  }

PURINE_DROPOUT_ENTRY(f32, float)
PURINE_DROPOUT_ENTRY(f64, double)

extern "C" __global__ void dropout_apply_copy_f32(long long blocks, long long total,
                                                  const float* x, long long iter_value,
                                                  const long long* iter_ptr, int has_iter_ptr,
                                                  unsigned int key0, unsigned int key1,
                                                  unsigned int ctr1, unsigned int threshold,
                                                  float scale, float* y, unsigned short* copy) {
  dropout_forward_impl<float, true>(blocks, total, x, iter_value, iter_ptr, has_iter_ptr, key0,
                                    key1, ctr1, threshold, scale, y, nullptr, copy);
}

extern "C" __global__ void dropout_backward_copy_f32(long long total, const float* dy,
                                                     const float* mask, float scale, float* dx,
                                                     unsigned short* copy) {
  CUDA_KERNEL_LOOP(i, total) {
    const float v = (dy[i] * mask[i]) * scale;
    dx[i] = v;
    copy[i] = (unsigned short)(purine_round_bf16(purine_float_bits(v)) >> 16);
  }
}

extern "C" __global__ void dropout_backward_packed_copy_f32(long long total, const float* dy,
                                                            const unsigned char* bits,
                                                            float scale, float* dx,
                                                            unsigned short* copy) {
  CUDA_KERNEL_LOOP(i, total) {
    const float v = (dy[i] * purine_mask_bit<float>(bits, i)) * scale;
    dx[i] = v;
    copy[i] = (unsigned short)(purine_round_bf16(purine_float_bits(v)) >> 16);
  }
}

// The raw Philox words of counters (c0 + b, c1, c2, c3), b in [0, blocks):
// out[4 b + j] = word j (`rounds` rounds). One entry point, no dtype suffix:
// the words are uint32.
extern "C" __global__ void philox_words(long long blocks, unsigned int c0, unsigned int c1,
                                        unsigned int c2, unsigned int c3, unsigned int key0,
                                        unsigned int key1, int rounds, unsigned int* out) {
  CUDA_KERNEL_LOOP(b, blocks) {
    unsigned int ctr[4] = {c0 + (unsigned int)b, c1, c2, c3};
    purine_philox4x32(ctr, key0, key1, rounds);
    for (int j = 0; j < 4; ++j) out[4 * b + j] = ctr[j];
  }
}
