// The deterministic block reductions the reduction kernels share
// (reduce.cu, clip.cu, softmax_loss.cu): every thread's double in a
// shared-memory tree of fixed order -- pairs at distance 1, 2, 4, ...,
// no atomics -- so the sum has the same bits on every run and every GPU.
//
// Included by those kernels; the loader (purine_mpi.gpu.kernel_source)
// inlines it, since NVRTC has no include path. Plain C++: it compiles for
// the host too (the emulated device in the tests).

#ifndef PURINE_BLOCK_SUM_CUH
#define PURINE_BLOCK_SUM_CUH

// The sum of every thread's `v` over the block, returned to every thread.
// `shared`: blockDim.x doubles of shared memory; free again on return (the
// next call may reuse it). Every thread of the block must call it.
__device__ double purine_block_sum(double v, double* shared) {
  const unsigned int tid = threadIdx.x;
  shared[tid] = v;
  __syncthreads();
  for (unsigned int stride = 1; stride < blockDim.x; stride <<= 1) {
    if (tid % (2 * stride) == 0 && tid + stride < blockDim.x) {
      shared[tid] += shared[tid + stride];
    }
    __syncthreads();
  }
  const double total = shared[0];
  __syncthreads();  // every thread has read it: shared may be reused
  return total;
}

// The maximum of every thread's `v` over the block, returned to every
// thread, by the same tree (a NaN `v` is passed over unless it is thread
// 0's: callers hand in no NaN). Same contract as purine_block_sum.
__device__ double purine_block_max(double v, double* shared) {
  const unsigned int tid = threadIdx.x;
  shared[tid] = v;
  __syncthreads();
  for (unsigned int stride = 1; stride < blockDim.x; stride <<= 1) {
    if (tid % (2 * stride) == 0 && tid + stride < blockDim.x &&
        shared[tid + stride] > shared[tid]) {
      shared[tid] = shared[tid + stride];
    }
    __syncthreads();
  }
  const double largest = shared[0];
  __syncthreads();
  return largest;
}

#endif  // PURINE_BLOCK_SUM_CUH
