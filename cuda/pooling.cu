// Max and average pooling over NCHW, forward and backward (Caffe semantics).
//
// Output position (oh, ow) pools the window rows [oh*sh - ph, oh*sh - ph + kh)
// and columns [ow*sw - pw, ow*sw - pw + kw), clipped to the image.
//   max:  y = max over the window; mask = argmax as a flat index h*W + w into
//         the (n, c) plane (int32), consumed by the backward kernel.
//         dx[h, w] = sum of dy over the outputs whose mask points at (h, w).
//   ave:  y = sum over the window / pool_size, where pool_size counts the
//         window clipped to the *padded* input (padding counts, the part past
//         the padded border does not: Caffe, and PyTorch's
//         count_include_pad=True).  dx[h, w] = sum of dy / pool_size over the
//         outputs whose window covers (h, w).
// The output size (floor or ceil_mode) is computed by the Python wrapper.
// Backward kernels are gathers (one thread per input pixel): no atomics,
// deterministic.
//
// Compiled at run time by purine_mpi.gpu.load_kernel("pooling") (NVRTC, so no
// #include); one extern "C" entry point per dtype: <name>_f32, <name>_f64.

#define CUDA_KERNEL_LOOP(i, n)                                              \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;      \
       i < (n); i += (long long)blockDim.x * gridDim.x)

__device__ __forceinline__ int int_min(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int int_max(int a, int b) { return a > b ? a : b; }

// Most negative finite value: the starting point of a running maximum.
template <typename T> __device__ __forceinline__ T lowest();
template <> __device__ __forceinline__ float lowest<float>() {
  return -3.402823466e+38f;
}
template <> __device__ __forceinline__ double lowest<double>() {
  return -1.7976931348623157e+308;
}

// The output (n, c, oh, ow) of thread ``index``: its (n, c) plane and its
// window's first row and column, unclipped (oh*sh - ph, ow*sw - pw).
__device__ __forceinline__ void pool_window(long long index, int out_h, int out_w, int sh,
                                            int sw, int ph, int pw, long long* plane,
                                            int* hstart, int* wstart) {
  const int ow = (int)(index % out_w);
  const int oh = (int)((index / out_w) % out_h);
  *plane = index / ((long long)out_w * out_h);
  *hstart = oh * sh - ph;
  *wstart = ow * sw - pw;
}

// The outputs [*start, *end) along one axis (window k, stride s, out of
// them) whose window covers the padded coordinate p (the input's plus its
// padding).
__device__ __forceinline__ void pool_outputs(int p, int k, int s, int out, int* start,
                                             int* end) {
  *start = (p < k) ? 0 : (p - k) / s + 1;
  *end = int_min(p / s + 1, out);
}

// One thread per output (n, c, oh, ow).
template <typename T>
__device__ void maxpool_forward_impl(long long total, const T* x, int height,
                                     int width, int out_h, int out_w, int kh,
                                     int kw, int sh, int sw, int ph, int pw,
                                     T* y, int* mask) {
  CUDA_KERNEL_LOOP(index, total) {
    long long plane;
    int hstart, wstart;
    pool_window(index, out_h, out_w, sh, sw, ph, pw, &plane, &hstart, &wstart);
    const T* x_plane = x + plane * height * width;
    const int hend = int_min(hstart + kh, height);
    const int wend = int_min(wstart + kw, width);
    hstart = int_max(hstart, 0);
    wstart = int_max(wstart, 0);
    T best = lowest<T>();
    int best_index = -1;
    for (int h = hstart; h < hend; ++h) {
      for (int w = wstart; w < wend; ++w) {
        const T value = x_plane[h * width + w];
        // Strict '>' keeps the first maximum (Caffe, PyTorch); a NaN is
        // taken (as PyTorch does) so a diverged network shows NaN.
        if (value > best || value != value) {
          best = value;
          best_index = h * width + w;
        }
      }
    }
    y[index] = best;
    mask[index] = best_index;
  }
}

// One thread per input pixel (n, c, h, w): gathers dy from every output
// window that contains it and whose argmax is this pixel.
template <typename T>
__device__ void maxpool_backward_impl(long long total, const T* dy,
                                      const int* mask, int height, int width,
                                      int out_h, int out_w, int kh, int kw,
                                      int sh, int sw, int ph, int pw, T* dx) {
  CUDA_KERNEL_LOOP(index, total) {
    const int w = (int)(index % width);
    const int h = (int)((index / width) % height);
    const long long plane = index / ((long long)width * height);
    int oh_start, oh_end, ow_start, ow_end;
    pool_outputs(h + ph, kh, sh, out_h, &oh_start, &oh_end);
    pool_outputs(w + pw, kw, sw, out_w, &ow_start, &ow_end);
    const long long offset = plane * out_h * out_w;
    const T* dy_plane = dy + offset;
    const int* mask_plane = mask + offset;
    const int self = h * width + w;
    T sum = T(0);
    for (int oh = oh_start; oh < oh_end; ++oh) {
      for (int ow = ow_start; ow < ow_end; ++ow) {
        if (mask_plane[oh * out_w + ow] == self) {
          sum += dy_plane[oh * out_w + ow];
        }
      }
    }
    dx[index] = sum;
  }
}

// The average's window from (hstart, wstart) (unclipped) clipped to the
// padded input: its ends (*hend, *wend) and its size, the divisor
// (padding counts, the part past the padded border does not).
__device__ __forceinline__ int ave_window(int hstart, int wstart, int height, int width,
                                          int kh, int kw, int ph, int pw, int* hend,
                                          int* wend) {
  *hend = int_min(hstart + kh, height + ph);
  *wend = int_min(wstart + kw, width + pw);
  return (*hend - hstart) * (*wend - wstart);
}

// One thread per output (n, c, oh, ow).
template <typename T>
__device__ void avepool_forward_impl(long long total, const T* x, int height,
                                     int width, int out_h, int out_w, int kh,
                                     int kw, int sh, int sw, int ph, int pw,
                                     T* y) {
  CUDA_KERNEL_LOOP(index, total) {
    long long plane;
    int hstart, wstart;
    pool_window(index, out_h, out_w, sh, sw, ph, pw, &plane, &hstart, &wstart);
    const T* x_plane = x + plane * height * width;
    // The divisor counts the window clipped to the padded input...
    int hend, wend;
    const int pool_size = ave_window(hstart, wstart, height, width, kh, kw, ph, pw, &hend,
                                     &wend);
    // ...the sum only the pixels inside the image (padding is zero).
    hstart = int_max(hstart, 0);
    wstart = int_max(wstart, 0);
    hend = int_min(hend, height);
    wend = int_min(wend, width);
    T sum = T(0);
    for (int h = hstart; h < hend; ++h) {
      for (int w = wstart; w < wend; ++w) {
        sum += x_plane[h * width + w];
      }
    }
    y[index] = sum / T(pool_size);
  }
}

// One thread per input pixel (n, c, h, w).
template <typename T>
__device__ void avepool_backward_impl(long long total, const T* dy, int height,
                                      int width, int out_h, int out_w, int kh,
                                      int kw, int sh, int sw, int ph, int pw,
                                      T* dx) {
  CUDA_KERNEL_LOOP(index, total) {
    // Coordinates in the padded image.
    const int w = (int)(index % width) + pw;
    const int h = (int)((index / width) % height) + ph;
    const long long plane = index / ((long long)width * height);
    int oh_start, oh_end, ow_start, ow_end;
    pool_outputs(h, kh, sh, out_h, &oh_start, &oh_end);
    pool_outputs(w, kw, sw, out_w, &ow_start, &ow_end);
    const T* dy_plane = dy + plane * out_h * out_w;
    T sum = T(0);
    for (int oh = oh_start; oh < oh_end; ++oh) {
      for (int ow = ow_start; ow < ow_end; ++ow) {
        int hend, wend;
        const int pool_size = ave_window(oh * sh - ph, ow * sw - pw, height, width, kh, kw,
                                         ph, pw, &hend, &wend);
        sum += dy_plane[oh * out_w + ow] / T(pool_size);
      }
    }
    dx[index] = sum;
  }
}

#define PURINE_POOLING_ENTRY(SUFFIX, T)                                         \
  extern "C" __global__ void maxpool_forward_##SUFFIX(                          \
      long long total, const T* x, int height, int width, int out_h,            \
      int out_w, int kh, int kw, int sh, int sw, int ph, int pw, T* y,          \
      int* mask) {                                                              \
    maxpool_forward_impl<T>(total, x, height, width, out_h, out_w, kh, kw, sh,  \
                            sw, ph, pw, y, mask);                               \
  }                                                                             \
  extern "C" __global__ void maxpool_backward_##SUFFIX(                         \
      long long total, const T* dy, const int* mask, int height, int width,     \
      int out_h, int out_w, int kh, int kw, int sh, int sw, int ph, int pw,     \
      T* dx) {                                                                  \
    maxpool_backward_impl<T>(total, dy, mask, height, width, out_h, out_w, kh,  \
                             kw, sh, sw, ph, pw, dx);                           \
  }                                                                             \
  extern "C" __global__ void avepool_forward_##SUFFIX(                          \
      long long total, const T* x, int height, int width, int out_h,            \
      int out_w, int kh, int kw, int sh, int sw, int ph, int pw, T* y) {        \
    avepool_forward_impl<T>(total, x, height, width, out_h, out_w, kh, kw, sh,  \
                            sw, ph, pw, y);                                     \
  }                                                                             \
  extern "C" __global__ void avepool_backward_##SUFFIX(                         \
      long long total, const T* dy, int height, int width, int out_h,           \
      int out_w, int kh, int kw, int sh, int sw, int ph, int pw, T* dx) {       \
    avepool_backward_impl<T>(total, dy, height, width, out_h, out_w, kh, kw,    \
                             sh, sw, ph, pw, dx);                               \
  }

PURINE_POOLING_ENTRY(f32, float)
PURINE_POOLING_ENTRY(f64, double)
