// im2col / col2im for NCHW batches (Caffe's layout, with dilation).
//
// cols has shape (N, C*kh*kw, out_h*out_w): row c*kh*kw + i*kw + j holds, for
// every output position (oh, ow), the input pixel
//   x[n, c, oh*sh - ph + i*dh, ow*sw - pw + j*dw]   (0 outside the image),
// the same layout as torch.nn.functional.unfold, so a convolution is one GEMM
// per image: y[n] = W.reshape(M, C*kh*kw) @ cols[n].
// col2im is its adjoint (sums the columns back into the image), used by the
// data gradient of a convolution; written as a gather (one thread per input
// pixel) so it needs no atomics and is deterministic.
//
// Compiled at run time by purine_mpi.gpu.load_kernel("im2col") (NVRTC, so no
// #include); one extern "C" entry point per dtype: <name>_f32, <name>_f64.

// Grid-stride loop over [0, n): the launch may use fewer threads than elements.
#define CUDA_KERNEL_LOOP(i, n)                                              \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;      \
       i < (n); i += (long long)blockDim.x * gridDim.x)

__device__ __forceinline__ int int_min(int a, int b) { return a < b ? a : b; }

// One thread per (n, c, oh, ow): writes the kh*kw column entries of that
// output position.
template <typename T>
__device__ void im2col_impl(long long total, const T* x, int height, int width,
                            int kh, int kw, int sh, int sw, int ph, int pw,
                            int dh, int dw, int out_h, int out_w, T* cols) {
  const long long out_area = (long long)out_h * out_w;
  CUDA_KERNEL_LOOP(index, total) {
    const int ow = (int)(index % out_w);
    const int oh = (int)((index / out_w) % out_h);
    const long long plane = index / out_area;  // n * C + c
    const T* x_plane = x + plane * height * width;
    // Rows of this (n, c) start at plane * kh * kw in the (N*C*kh*kw, L) view.
    T* col = cols + plane * kh * kw * out_area + (long long)oh * out_w + ow;
    const int h0 = oh * sh - ph;
    const int w0 = ow * sw - pw;
    for (int i = 0; i < kh; ++i) {
      const int h = h0 + i * dh;
      for (int j = 0; j < kw; ++j) {
        const int w = w0 + j * dw;
        *col = (h >= 0 && w >= 0 && h < height && w < width)
                   ? x_plane[h * width + w] : T(0);
        col += out_area;
      }
    }
  }
}

// One thread per input pixel (n, c, h, w): sums every column entry that was
// copied from it (Caffe's col2im_gpu_kernel).
template <typename T>
__device__ void col2im_impl(long long total, const T* cols, int height,
                            int width, int kh, int kw, int sh, int sw, int ph,
                            int pw, int dh, int dw, int out_h, int out_w,
                            T* x) {
  const int extent_h = (kh - 1) * dh + 1;
  const int extent_w = (kw - 1) * dw + 1;
  const long long out_area = (long long)out_h * out_w;
  CUDA_KERNEL_LOOP(index, total) {
    // Coordinates in the padded image.
    const int w_pad = (int)(index % width) + pw;
    const int h_pad = (int)((index / width) % height) + ph;
    const long long plane = index / ((long long)width * height);
    // Output positions whose (dilated) window can cover this pixel.
    const int ow_start = (w_pad < extent_w) ? 0 : (w_pad - extent_w) / sw + 1;
    const int ow_end = int_min(w_pad / sw + 1, out_w);
    const int oh_start = (h_pad < extent_h) ? 0 : (h_pad - extent_h) / sh + 1;
    const int oh_end = int_min(h_pad / sh + 1, out_h);
    const T* col_plane = cols + plane * kh * kw * out_area;
    T sum = T(0);
    for (int oh = oh_start; oh < oh_end; ++oh) {
      int i = h_pad - oh * sh;
      if (i % dh != 0) continue;  // falls between dilated taps
      i /= dh;
      for (int ow = ow_start; ow < ow_end; ++ow) {
        int j = w_pad - ow * sw;
        if (j % dw != 0) continue;
        j /= dw;
        sum += col_plane[((long long)(i * kw + j) * out_h + oh) * out_w + ow];
      }
    }
    x[index] = sum;
  }
}

#define PURINE_IM2COL_ENTRY(SUFFIX, T)                                          \
  extern "C" __global__ void im2col_##SUFFIX(                                   \
      long long total, const T* x, int height, int width, int kh, int kw,       \
      int sh, int sw, int ph, int pw, int dh, int dw, int out_h, int out_w,     \
      T* cols) {                                                                \
    im2col_impl<T>(total, x, height, width, kh, kw, sh, sw, ph, pw, dh, dw,     \
                   out_h, out_w, cols);                                         \
  }                                                                             \
  extern "C" __global__ void col2im_##SUFFIX(                                   \
      long long total, const T* cols, int height, int width, int kh, int kw,    \
      int sh, int sw, int ph, int pw, int dh, int dw, int out_h, int out_w,     \
      T* x) {                                                                   \
    col2im_impl<T>(total, cols, height, width, kh, kw, sh, sw, ph, pw, dh, dw,  \
                   out_h, out_w, x);                                            \
  }

PURINE_IM2COL_ENTRY(f32, float)
PURINE_IM2COL_ENTRY(f64, double)
