// The learning-rate policy on the device: one thread evaluates Caffe's
// SGDSolver::GetLearningRate (purine_mpi/ops/solver.py, learning_rate) at the
// iteration read from the device iteration blob, and writes the float32 lr
// blob the update kernels read. The host does nothing per iteration, so a
// captured CUDA graph replays the schedule too. Computed in double, as the
// host formula, in the same order of operations:
//
//   0 fixed:     base
//   1 step:      base * gamma ^ floor(iter / stepsize)
//   2 multistep: base * gamma ^ (number of steps[k] <= iter)
//   3 exp:       base * gamma ^ iter
//   4 inv:       base * (1 + gamma * iter) ^ (-power)
//   5 sigmoid:   base / (1 + exp(-gamma * (iter - stepsize)))
//   6 poly:      base * (1 - min(iter, max_iter) / max_iter) ^ power
//   7 cosine:    min_lr + (base - min_lr) * 0.5 * (1 + cos(pi * min(iter, max_iter) / max_iter))
//
// then, for iter < warmup, times warmup_start + (1 - warmup_start) * (iter + 1) / warmup.
//
// Compiled at run time by purine_mpi.gpu.load_kernel("lr_policy"); one entry
// point, no dtype suffix (the lr blob is float32).

extern "C" __global__ void learning_rate(long long iter_value, const long long* iter_ptr,
                                         int has_iter_ptr, int policy, double base,
                                         double gamma, double power, double stepsize,
                                         double max_iter, double min_lr,
                                         const long long* steps, int n_steps,
                                         long long warmup, double warmup_start, float* out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const long long it = has_iter_ptr ? iter_ptr[0] : iter_value;
  const double itd = (double)it;
  double rate = base;
  if (policy == 1) {
    const long long size = (long long)stepsize;
    long long q = it / size;
    if ((it % size != 0) && ((it < 0) != (size < 0))) q -= 1;  // floor, as Python's //
    rate = base * pow(gamma, (double)q);
  } else if (policy == 2) {
    int passed = 0;
    for (int k = 0; k < n_steps; ++k) passed += steps[k] <= it ? 1 : 0;
    rate = base * pow(gamma, (double)passed);
  } else if (policy == 3) {
    rate = base * pow(gamma, itd);
  } else if (policy == 4) {
    rate = base * pow(1.0 + gamma * itd, -power);
  } else if (policy == 5) {
    rate = base / (1.0 + exp(-gamma * (itd - stepsize)));
  } else if (policy == 6 || policy == 7) {
    const double frac = (itd < max_iter ? itd : max_iter) / max_iter;
    if (policy == 6) {
      rate = base * pow(1.0 - frac, power);
    } else {
      rate = min_lr + (base - min_lr) * 0.5 * (1.0 + cos(3.141592653589793 * frac));
    }
  }
  if (warmup > 0 && it < warmup) {
    rate *= warmup_start + (1.0 - warmup_start) * (double)(it + 1) / (double)warmup;
  }
  out[0] = (float)rate;
}

// The iteration counter on the device (purine_mpi/ops/iteration.py): the
// iteration this run of the graph computes is the counter's value, and the
// counter moves on by one. The host writes the counter only when the
// trainer's iteration is not the one that follows (the first iteration, a
// resume), so a captured CUDA graph replays every later iteration alone.
extern "C" __global__ void iteration_next(long long* counter, long long* iteration) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  iteration[0] = counter[0];
  counter[0] = counter[0] + 1;
}
