// Philox4x32-10 (Random123; Salmon et al., SC'11): a counter-based generator.
// The 128-bit output is a keyed bijection of the 128-bit counter, so every
// thread computes the words it needs from their index alone: no generator
// state, on the device or on the host. purine_mpi/philox.py is the same
// function in NumPy (bit-identical; tests check both against Random123's
// known-answer vectors).
//
// Included by the kernels that draw random numbers (dropout.cu); the loader
// (purine_mpi.gpu.kernel_source) inlines it, since NVRTC has no include path.
// Only 32x32->64-bit products: no intrinsics, so it compiles for the host too.

#ifndef PURINE_PHILOX_CUH
#define PURINE_PHILOX_CUH

#define PURINE_PHILOX_M0 0xD2511F53u
#define PURINE_PHILOX_M1 0xCD9E8D57u
#define PURINE_PHILOX_W0 0x9E3779B9u
#define PURINE_PHILOX_W1 0xBB67AE85u

// Philox4x32 with `rounds` rounds, in place on ctr[0..3] under (k0, k1).
__device__ __forceinline__ void purine_philox4x32(unsigned int ctr[4], unsigned int k0,
                                                  unsigned int k1, int rounds) {
  for (int r = 0; r < rounds; ++r) {
    if (r > 0) {  // the key is bumped before every round but the first
      k0 += PURINE_PHILOX_W0;
      k1 += PURINE_PHILOX_W1;
    }
    const unsigned long long p0 = (unsigned long long)PURINE_PHILOX_M0 * ctr[0];
    const unsigned long long p1 = (unsigned long long)PURINE_PHILOX_M1 * ctr[2];
    const unsigned int hi0 = (unsigned int)(p0 >> 32), lo0 = (unsigned int)p0;
    const unsigned int hi1 = (unsigned int)(p1 >> 32), lo1 = (unsigned int)p1;
    const unsigned int c1 = ctr[1], c3 = ctr[3];
    ctr[0] = hi1 ^ c1 ^ k0;
    ctr[1] = lo1;
    ctr[2] = hi0 ^ c3 ^ k1;
    ctr[3] = lo0;
  }
}

#endif  // PURINE_PHILOX_CUH
