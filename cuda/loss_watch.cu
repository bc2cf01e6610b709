// The training loss watched on the device, so the host reads it back only at
// display, test and checkpoint intervals (purine_mpi/ops/watch.py, LossWatch).
//
// One thread, once per iteration, after the loss blobs are written:
//
//   now     = ((0 + loss_0 * share_0) + loss_1 * share_1) + ...   (double)
//   out[0] += now                        the display window's running sum
//   out[1]  = iter + 1, if now is not finite and out[1] is still 0
//                                        the first diverged iteration
//
// in the same order of double operations as the host loop of
// purine_mpi/trainer.py (``float(loss) * share`` summed from 0), with the
// rounding spelled out (__dmul_rn, __dadd_rn: never contracted into an FMA),
// so the displayed mean is the CPU's bit for bit. The losses are read through
// a table of device pointers (one per micro-batch copy), the iteration from
// the device iteration blob: nothing changes per iteration on the host, so a
// captured CUDA graph replays it.
//
// Compiled at run time by purine_mpi.gpu.load_kernel("loss_watch"); one
// extern "C" entry point per loss dtype: loss_watch_f32, loss_watch_f64.

template <typename T>
__device__ void loss_watch_impl(const unsigned long long* losses, const double* shares, int n,
                                const long long* iter_ptr, double* out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double now = 0.0;
  for (int k = 0; k < n; ++k) {
    const T* loss = (const T*)losses[k];
    now = __dadd_rn(now, __dmul_rn((double)loss[0], shares[k]));
  }
  out[0] = __dadd_rn(out[0], now);
  if (!isfinite(now) && out[1] == 0.0) out[1] = (double)(iter_ptr[0] + 1);
}

extern "C" __global__ void loss_watch_f32(const unsigned long long* losses,
                                          const double* shares, int n,
                                          const long long* iter_ptr, double* out) {
  loss_watch_impl<float>(losses, shares, n, iter_ptr, out);
}

extern "C" __global__ void loss_watch_f64(const unsigned long long* losses,
                                          const double* shares, int n,
                                          const long long* iter_ptr, double* out) {
  loss_watch_impl<double>(losses, shares, n, iter_ptr, out);
}
