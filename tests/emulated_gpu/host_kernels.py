"""The ``cuda/*.cu`` kernels compiled for the host with g++ and launched
through ctypes (every argument checked against the kernel's C signature),
a host cuBLAS, and the emulated ``nvmath.bindings.cublas``."""
import ctypes
import enum
import fcntl
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import types

import numpy as np

from . import capture
from .arrays import NoDevice

_HOST_PRELUDE = r"""
// Stand-ins for the CUDA built-ins used by cuda/*.cu, so they compile as host
// C++. A launch of a kernel without __syncthreads in its source runs serially
// over (block, thread), set by purine_emu_set. A kernel whose source has
// __syncthreads runs its blocks one by one, the threads of a block as
// cooperative fibers on the launching host thread (ucontext, each with its
// own stack; purine_emu_grid_<kernel>, one call per launch): a barrier
// switches to the next fiber, and the threads of a block run in index order
// between two barriers. A fiber is entered once through its ucontext and
// switched with _setjmp/_longjmp afterwards: swapcontext saves and restores
// the signal mask, a system call per switch (1.6 us here, where a barrier of
// a 3-thread block is 3 switches), _longjmp none. __shared__ is a
// thread_local static, so launches from several host threads do not share
// it. Without <ucontext.h>, or built with -DPURINE_EMU_THREADED
// (PURINE_EMU_THREADED=1), the threads of a block are concurrent host
// threads and __shared__ a static shared by them.
// (_FORTIFY_SOURCE's longjmp check refuses a jump to another stack: off)
#undef _FORTIFY_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if !defined(PURINE_EMU_THREADED) && defined(__has_include)
#if __has_include(<ucontext.h>)
#define PURINE_EMU_FIBERS 1
#endif
#endif
#define __global__
#define __device__
#define __forceinline__ inline
struct purine_dim3 { unsigned int x, y, z; };
static thread_local purine_dim3 threadIdx = {0, 0, 0}, blockIdx = {0, 0, 0};
static thread_local purine_dim3 blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
extern "C" void purine_emu_set(unsigned int block, unsigned int thread,
                               unsigned int blocks, unsigned int threads) {
  blockIdx.x = block; threadIdx.x = thread; gridDim.x = blocks; blockDim.x = threads;
}
#ifdef PURINE_EMU_FIBERS
#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>
#define __shared__ static thread_local
extern "C" int purine_emu_fibers(void) { return 1; }
enum { PURINE_EMU_READY, PURINE_EMU_WAITING, PURINE_EMU_DONE };
// context: where the fiber starts (entered once); resume: where it waits,
// once it has run (started set)
struct purine_emu_fiber { ucontext_t context; jmp_buf resume; int state, started; };
// One launch on this host thread: its fibers, where the scheduler waits, and
// the barrier's count (every thread of the block must arrive, as in the
// threaded emulation: a thread that returns while others wait at a barrier
// keeps it shut for ever -- detected here, a message and abort()).
struct purine_emu_launch {
  jmp_buf back;   // the scheduler, waiting for a thread to return
  purine_emu_fiber *fibers;
  unsigned int threads, current, arrived;
  void (*body)(void *);
  void *arg;
};
static thread_local purine_emu_launch *purine_emu_current = nullptr;
// The fibers' stacks, kept for the host thread's next launches; a
// PROT_NONE page under each stack turns an overflow into a fault.
static const size_t purine_emu_stack_bytes = 256 * 1024, purine_emu_guard_bytes = 4096;
struct purine_emu_stacks {
  char *base = nullptr;
  size_t bytes = 0;
  char *get(unsigned int threads) {
    const size_t each = purine_emu_stack_bytes + purine_emu_guard_bytes;
    if (bytes < threads * each) {
      if (base) munmap(base, bytes);
      bytes = threads * each;
      void *map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                       -1, 0);
      if (map == MAP_FAILED) { perror("purine_emu fiber stacks"); abort(); }
      base = (char *)map;
      for (unsigned int t = 0; t < threads; ++t) mprotect(base + t * each, purine_emu_guard_bytes,
                                                          PROT_NONE);
    }
    return base;
  }
  ~purine_emu_stacks() { if (base) munmap(base, bytes); }
};
static thread_local purine_emu_stacks purine_emu_stack_pool;
// The next thread to run after thread `from`: the first ready one after it,
// in index order, wrapping round (after a barrier opens: from thread 0).
static unsigned int purine_emu_next(purine_emu_launch *launch, unsigned int from) {
  for (unsigned int i = 1; i <= launch->threads; ++i) {
    const unsigned int t = (from + i) % launch->threads;
    if (launch->fibers[t].state == PURINE_EMU_READY) return t;
  }
  fprintf(stderr, "purine emulated GPU: block %u: %u of its %u threads wait at __syncthreads, "
          "the others have returned: the barrier never opens\n",
          blockIdx.x, launch->arrived, launch->threads);
  abort();
}
// The fibers entered through their ucontext on this host thread (each a
// system call): one per thread of each block, however many barriers.
static thread_local unsigned long long purine_emu_context_entries = 0;
extern "C" unsigned long long purine_emu_fiber_entries(void) { return purine_emu_context_entries; }
// Run fiber `next` of the launch: resume it where it waits, or enter it.
// The caller has saved its own place (its jmp_buf) first.
static void purine_emu_enter(purine_emu_launch *launch, unsigned int next) {
  purine_emu_fiber *fiber = &launch->fibers[next];
  if (fiber->started) _longjmp(fiber->resume, 1);
  fiber->started = 1;
  ++purine_emu_context_entries;
  setcontext(&fiber->context);
  abort();
}
static void purine_emu_fiber_main() {
  purine_emu_launch *launch = purine_emu_current;
  launch->body(launch->arg);
  launch->fibers[launch->current].state = PURINE_EMU_DONE;
  _longjmp(launch->back, 1);   // to the scheduler
}
static inline void __syncthreads() {
  purine_emu_launch *launch = purine_emu_current;
  if (launch == nullptr) abort();   // only fiber launches reach a barrier
  const unsigned int self = launch->current;
  unsigned int next;
  if (++launch->arrived == launch->threads) {   // the last one opens it
    launch->arrived = 0;
    for (unsigned int t = 0; t < launch->threads; ++t) {
      if (launch->fibers[t].state == PURINE_EMU_WAITING) launch->fibers[t].state = PURINE_EMU_READY;
    }
    next = purine_emu_next(launch, launch->threads - 1);   // from thread 0 again
    if (next == self) return;
  } else {
    launch->fibers[self].state = PURINE_EMU_WAITING;
    next = purine_emu_next(launch, self);
  }
  launch->current = next; threadIdx.x = next;
  if (_setjmp(launch->fibers[self].resume) == 0) purine_emu_enter(launch, next);
}
// Runs body(arg) as every thread of `blocks` blocks of `threads` threads:
// the threads of a block in index order until each reaches a barrier or
// returns; the barrier opens when every thread of the block has reached it.
static void purine_emu_fiber_grid(unsigned int blocks, unsigned int threads,
                                  void (*body)(void *), void *arg) {
  if (threads == 0 || threads > 1024 || purine_emu_current != nullptr) abort();
  const size_t each = purine_emu_stack_bytes + purine_emu_guard_bytes;
  char *stacks = purine_emu_stack_pool.get(threads);
  purine_emu_fiber *fibers = (purine_emu_fiber *)calloc(threads, sizeof(purine_emu_fiber));
  if (fibers == nullptr) abort();
  purine_emu_launch launch;
  launch.fibers = fibers; launch.threads = threads; launch.body = body; launch.arg = arg;
  purine_emu_current = &launch;
  gridDim.x = blocks; blockDim.x = threads;
  for (unsigned int b = 0; b < blocks; ++b) {
    blockIdx.x = b;
    for (unsigned int t = 0; t < threads; ++t) {
      ucontext_t *context = &fibers[t].context;
      if (getcontext(context) != 0) abort();
      context->uc_stack.ss_sp = stacks + t * each + purine_emu_guard_bytes;
      context->uc_stack.ss_size = purine_emu_stack_bytes;
      context->uc_link = nullptr;   // a returning thread jumps to launch.back
      makecontext(context, purine_emu_fiber_main, 0);
      fibers[t].state = PURINE_EMU_READY;
      fibers[t].started = 0;
    }
    launch.arrived = 0;
    launch.current = 0;
    // volatile: read again after _longjmp comes back here
    volatile unsigned int done = 0;
    _setjmp(launch.back);   // 0 now; 1 each time a thread has returned
    if (done > 0) {
      if (done == threads) continue;   // the block is over
      launch.current = purine_emu_next(&launch, launch.current);   // the next ready one runs
    }
    ++done;
    threadIdx.x = launch.current;
    purine_emu_enter(&launch, launch.current);
  }
  purine_emu_current = nullptr;
  free(fibers);
}
template <typename F>
static void purine_emu_call(void *body) { (*static_cast<F *>(body))(); }
#else
#include <condition_variable>
#include <mutex>
#define __shared__ static
extern "C" int purine_emu_fibers(void) { return 0; }
static std::mutex purine_emu_mutex;
static std::condition_variable purine_emu_cv;
static unsigned int purine_emu_waiting = 0, purine_emu_generation = 0, purine_emu_count = 1;
extern "C" void purine_emu_barrier_init(unsigned int count) {
  std::lock_guard<std::mutex> lock(purine_emu_mutex);
  purine_emu_count = count; purine_emu_waiting = 0;
}
static inline void __syncthreads() {
  std::unique_lock<std::mutex> lock(purine_emu_mutex);
  const unsigned int generation = purine_emu_generation;
  if (++purine_emu_waiting == purine_emu_count) {
    purine_emu_waiting = 0; ++purine_emu_generation; purine_emu_cv.notify_all();
  } else {
    purine_emu_cv.wait(lock, [&] { return generation != purine_emu_generation; });
  }
}
#endif
// CUDA's built-in 16-byte vector (vector_types.h): loads and stores of 16
// bytes where the kernel has checked the alignment
struct __attribute__((aligned(16))) uint4 { unsigned int x, y, z, w; };
struct __attribute__((aligned(8))) uint2 { unsigned int x, y; };
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, sizeof f); return f; }
static inline double __longlong_as_double(long long i) {
  double d; memcpy(&d, &i, sizeof d); return d;
}
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
// Warp shuffles: the lanes of a warp (32 consecutive threads of the block)
// swap values through a table between two block-wide barriers, so every
// thread of the block must call them together (our kernels never shuffle
// under a divergent branch). Only the full mask is modelled; a source lane
// past the end of the block (a partial warp) is undefined on a GPU: NaN here.
#include <stdlib.h>
#define warpSize 32
template <typename T>
static inline T __shfl_down_sync(unsigned int mask, T var, unsigned int delta) {
  __shared__ T lanes[1024];
  if (mask != 0xffffffffu || blockDim.x > 1024) abort();
  lanes[threadIdx.x] = var;
  __syncthreads();
  const unsigned int lane = threadIdx.x & 31u, source = threadIdx.x + delta;
  const T out = lane + delta >= 32u ? var : (source < blockDim.x ? lanes[source] : (T)NAN);
  __syncthreads();
  return out;
}
template <typename T>
static inline T __shfl_xor_sync(unsigned int mask, T var, int lane_mask) {
  __shared__ T lanes[1024];
  if (mask != 0xffffffffu || blockDim.x > 1024 || lane_mask < 0 || lane_mask > 31) abort();
  lanes[threadIdx.x] = var;
  __syncthreads();
  const unsigned int source = threadIdx.x ^ (unsigned int)lane_mask;
  const T out = source < blockDim.x ? lanes[source] : (T)NAN;
  __syncthreads();
  return out;
}
"""
_EMU_BLOCKS, _EMU_THREADS = 2, 3   # small grid: exercises the grid-stride loops
_EMU_WARP_THREADS = 64   # kernels with warp shuffles: two whole warps per block
_C_SCALARS = {"long long": (np.int64, ctypes.c_longlong), "int": (np.int32, ctypes.c_int),
              "unsigned int": (np.uint32, ctypes.c_uint),
              "float": (np.float32, ctypes.c_float), "double": (np.float64, ctypes.c_double)}
_C_POINTEES = {"float": np.float32, "double": np.float64, "int": np.int32,
               "long long": np.int64, "unsigned int": np.uint32, "unsigned short": np.uint16,
               "unsigned long long": np.uint64, "unsigned char": np.uint8}
_SIGNATURE = re.compile(r'extern "C" void (\w+)\s*\(([^)]*)\)')
#: g++ -E's text of each source by its digest (prelude, defines, code): a
#: kernel module is built again by every test that makes a backend, and
#: its preprocessing (~0.05 s of g++ a time, 842 times a session) gave the
#: same text each time
_EXPANDED = {}
_PARAM_NAME = re.compile(r"(\w+)\s*$")
#: set to 1: kernels with __syncthreads run each CUDA thread as a host thread
#: (the emulator's former way, slower), not as fibers on the launching one
THREADED_ENV = "PURINE_EMU_THREADED"

# the threaded emulation's __syncthreads is one barrier per library: kernels
# that use it run one at a time, whichever host threads launch them (fibers
# keep a launch's barrier and __shared__ on the launching thread: no lock)
_THREADED_KERNEL = threading.Lock()


class _HostKernel:
    """One extern "C" entry point; checks arguments like a strict CuPy."""

    def __init__(self, library, name, params, threaded=False, warps=False, fibers=False):
        self.name, self.params, self.threaded = name, params, threaded
        self.threads = _EMU_WARP_THREADS if warps else _EMU_THREADS
        self._func = getattr(library, name)
        self._func.restype = None
        self._set = library.purine_emu_set
        # a kernel with barriers: one call runs the whole grid as fibers
        self._fiber_grid = getattr(library, f"purine_emu_grid_{name}") if (
            threaded and fibers) else None
        if self._fiber_grid is not None:
            self._fiber_grid.restype = None
        else:
            self._barrier = getattr(library, "purine_emu_barrier_init", None)

    def _convert(self, index, arg, param):
        kind, ctype_name = param
        where = f"{self.name} argument {index} ({ctype_name})"
        if kind == "pointer":
            if not isinstance(arg, np.ndarray):
                raise TypeError(f"{where}: expected an array, got {type(arg).__name__}")
            if arg.dtype != _C_POINTEES[ctype_name] or not arg.flags.c_contiguous:
                raise TypeError(f"{where}: got a {arg.dtype} array, contiguous="
                                f"{arg.flags.c_contiguous}")
            return ctypes.c_void_p(arg.ctypes.data)
        numpy_type, ctype = _C_SCALARS[ctype_name]
        if type(arg) is not numpy_type:
            raise TypeError(f"{where}: expected {numpy_type.__name__}, got {type(arg).__name__}")
        return ctype(arg)

    def __call__(self, grid, block, args, **kwargs):
        if len(args) != len(self.params):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.params)} parameters")
        if self.threads == _EMU_WARP_THREADS:
            # a warp-shuffling kernel runs here with two whole warps whatever
            # the launch asks; on a GPU a block that is not whole warps has a
            # partial last warp, whose full-mask shuffles are undefined
            threads = int(np.prod(block)) if isinstance(block, tuple) else int(block)
            if threads % 32 or not 0 < threads <= 1024:
                raise ValueError(f"{self.name}: a kernel with warp shuffles launched with "
                                 f"{threads} threads a block, not a whole number of warps "
                                 "(32) up to 1024")
        # converted now: scalars and pointers are fixed at launch (and so
        # frozen into a captured graph), the memory is read when it runs
        c_args = [self._convert(i, a, p) for i, (a, p) in enumerate(zip(args, self.params))]

        def run(b, t):
            self._set(b, t, _EMU_BLOCKS, self.threads)
            self._func(*c_args)   # ctypes releases the GIL: the threads run at once

        def grid():
            if self._fiber_grid is not None:
                self._fiber_grid(ctypes.c_uint(_EMU_BLOCKS), ctypes.c_uint(self.threads), *c_args)
                return
            if not self.threaded:
                for b in range(_EMU_BLOCKS):
                    for t in range(self.threads):
                        run(b, t)
                return
            with _THREADED_KERNEL:
                threaded_grid()

        def threaded_grid():
            for b in range(_EMU_BLOCKS):
                self._barrier(self.threads)
                threads = [threading.Thread(target=run, args=(b, t))
                           for t in range(self.threads)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()

        capture.device_work(grid, kwargs.get("stream"))


_DEFINITION = re.compile(r"\b(\w+)\s*\([^;{}()]*\)\s*\{")


def _shuffling(expanded):
    """The names of the functions of a preprocessed source that reach a warp
    shuffle, directly or through the functions they call: only those kernels
    run with whole warps of host threads (the others keep the small block,
    so a library with one shuffling kernel does not slow all of its kernels
    down 20-fold)."""
    bodies = {}
    for match in _DEFINITION.finditer(expanded):
        depth, end = 1, match.end()
        while depth and end < len(expanded):
            depth += {"{": 1, "}": -1}.get(expanded[end], 0)
            end += 1
        bodies.setdefault(match.group(1), "")
        bodies[match.group(1)] += expanded[match.end():end]
    reach = {"__shfl_down_sync", "__shfl_xor_sync"}
    grown = True
    while grown:
        grown = False
        for name, body in bodies.items():
            if name not in reach and any(re.search(rf"\b{r}\b", body) for r in reach):
                reach.add(name)
                grown = True
    return reach


def _grid_wrappers(signatures):
    """For each extern "C" kernel (name, parameter text), the fibers' entry
    point: ``purine_emu_grid_<name>(blocks, threads, <its parameters>)``
    runs the kernel as every thread of the grid (the prelude's
    purine_emu_fiber_grid); compiled only where fibers are."""
    out = ["#ifdef PURINE_EMU_FIBERS"]
    for name, params in signatures:
        declarations = [d for d in params.split(",") if d.strip() not in ("", "void")]
        names = ", ".join(_PARAM_NAME.search(d).group(1) for d in declarations)
        head = ", ".join(["unsigned int purine_emu_blocks", "unsigned int purine_emu_threads"]
                         + [d.strip() for d in declarations])
        out.append(f'extern "C" void purine_emu_grid_{name}({head}) {{\n'
                   f"  auto purine_emu_body = [&]() {{ {name}({names}); }};\n"
                   "  purine_emu_fiber_grid(purine_emu_blocks, purine_emu_threads,\n"
                   "                        purine_emu_call<decltype(purine_emu_body)>,"
                   " &purine_emu_body);\n}")
    out.append("#endif")
    return "\n".join(out) + "\n"


def _parse_params(text):
    params = []
    for declaration in text.split(","):
        ctype_name = declaration.strip().rsplit(None, 1)[0]   # drop the name
        pointer = "*" in ctype_name
        ctype_name = ctype_name.replace("const", "").replace("*", "").strip()
        params.append(("pointer" if pointer else "scalar", ctype_name))
    return params


def tf32_round(x):
    """float32 ``x`` with each finite value rounded to TensorFloat-32 (10
    mantissa bits, to nearest, ties away from zero: ``cvt.rna.tf32.f32``),
    what tensor cores read of a float32 operand; a copy."""
    bits = np.array(x, dtype=np.float32).view(np.uint32)
    finite = (bits & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    bits[finite] = (bits[finite] + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    return bits.view(np.float32)


#: cublasMath_t: CUBLAS_TF32_TENSOR_OP_MATH
TF32_MATH = 3
#: cudaDataType_t (library_types.h) of the types a GemmEx here takes
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
#: cublasComputeType_t's CUBLAS_COMPUTE_32F, cublasGemmAlgo_t's CUBLAS_GEMM_DEFAULT
COMPUTE_32F, GEMM_DEFAULT = 68, -1


def widen_bits(bits, data_type):
    """float32 values of the uint16 ``bits`` of bfloat16 (``CUDA_R_16BF``)
    or float16 (``CUDA_R_16F``) values: exact, in ``bits``' memory order
    (NumPy's product then sums as it does for float32 operands laid out
    alike: the same bits as the TF32 path's)."""
    if data_type == CUDA_R_16BF:
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


def bf16_bits(x):
    """The uint16 bits of the bfloat16 nearest each float32 of ``x`` (ties
    to even; infinities and NaNs truncated): base/precision's rounding."""
    from purine_mpi.base.precision import _round_bits
    bits = np.array(x, dtype=np.float32).view(np.uint32)
    _round_bits(np, bits, np.empty_like(bits), np.empty_like(bits))
    return (bits >> np.uint32(16)).astype(np.uint16)


def check_gemm_ex(a_type, b_type, c_type, compute_type, algo):
    """What a GemmEx here takes (cuBLAS takes more): A and B both bfloat16
    or both float16, C float32 (or bfloat16 for bfloat16 operands: the
    float32 result rounded once, to nearest even), float32 compute, the
    default algorithm; the reason it refuses anything else
    (CUBLAS_STATUS_NOT_SUPPORTED)."""
    if a_type != b_type or a_type not in (CUDA_R_16BF, CUDA_R_16F):
        return f"A and B of types {a_type} and {b_type}"
    if c_type not in (CUDA_R_32F, a_type if a_type == CUDA_R_16BF else CUDA_R_32F) or \
            compute_type != COMPUTE_32F or algo != GEMM_DEFAULT:
        return f"C type {c_type}, compute type {compute_type}, algorithm {algo}"
    return None


class HostCublas:
    """cuBLAS's column-major GEMMs (CuPy's ``cupy.cuda.cublas`` signatures,
    host pointer mode) on host memory addresses: operands are read where the
    pointers, leading dimensions and batch strides say, so a wrong ld, stride
    or transpose flag in purine_mpi/gpu/blas.py gives wrong numbers here, and
    an ld cuBLAS would reject is an error.

    Like CuPy's binding, every call refuses a capturing current stream
    (``NotImplementedError``, CuPy's message: its ``setStream`` checks).
    A handle's math mode (``setMathMode``) is kept; a float32 product under
    TF32 math (``TF32_MATH``) reads its operands rounded to TF32, as tensor
    cores do. ``gemms``: (function name, math mode) of every product."""

    def __init__(self):
        self.math, self.gemms = {}, []

    def setMathMode(self, handle, mode):  # noqa: N802  (CuPy's name)
        self.math[handle] = int(mode)

    def getMathMode(self, handle):  # noqa: N802
        return self.math.get(handle, 0)

    def _view(self, ptr, dtype, rows, cols, ld, stride, batch):
        item = np.dtype(dtype).itemsize
        span = (batch - 1) * stride + (cols - 1) * ld + rows
        raw = (ctypes.c_char * (span * item)).from_address(ptr)
        buf = np.frombuffer(raw, dtype=dtype)
        return np.lib.stride_tricks.as_strided(buf, (batch, rows, cols),
                                               (stride * item, item, ld * item))

    def _scalar(self, ptr, dtype):
        item = np.dtype(dtype).itemsize
        return np.frombuffer((ctypes.c_char * item).from_address(ptr), dtype=dtype)[0]

    def _gemm(self, dtype, transa, transb, m, n, k, alpha, A, lda, sA, B, ldb, sB, beta, C,
              ldc, sC, batch, stream=None, workspace=None, tf32=False, low=None, c_low=None):
        """Check the arguments and read alpha and beta (host pointer mode) now,
        as cuBLAS does at the call; the product itself is device work on
        ``stream`` (``capture.device_work``: recorded on a capturing
        stream, the operands read when it runs). ``low``: a GemmEx's
        operand type (``CUDA_R_16BF``, ``CUDA_R_16F``): A and B are its
        uint16 bits, widened exactly to float32 for the product (each
        product of two such values is exact in float32, as on tensor
        cores), C and the scalars ``dtype``; ``c_low`` ``CUDA_R_16BF``: C
        is the uint16 bits of the float32 result rounded to bfloat16 (to
        nearest, ties to even: cuBLAS's conversion of its float32
        accumulator), with beta 0 (C not read)."""
        a_rows, b_rows = (m if transa == 0 else k), (k if transb == 0 else n)
        for name, ld, rows in (("lda", lda, a_rows), ("ldb", ldb, b_rows), ("ldc", ldc, m)):
            if ld < max(1, rows):
                raise ValueError(f"cuBLAS would reject {name}={ld} < {max(1, rows)}")
        ab = dtype if low is None else np.uint16
        a = self._view(A, ab, a_rows, k if transa == 0 else m, lda, sA, batch)
        b = self._view(B, ab, b_rows, n if transb == 0 else k, ldb, sB, batch)
        c = self._view(C, np.uint16 if c_low is not None else dtype, m, n, ldc, sC, batch)
        op_a = a if transa == 0 else a.transpose(0, 2, 1)
        op_b = b if transb == 0 else b.transpose(0, 2, 1)
        alpha, beta = self._scalar(alpha, dtype), self._scalar(beta, dtype)

        def run():
            if low is not None:
                product = np.matmul(widen_bits(op_a, low), widen_bits(op_b, low))
            elif tf32 and dtype == np.float32:   # tensor cores read TF32 operands
                product = np.matmul(tf32_round(op_a), tf32_round(op_b))
            else:
                product = np.matmul(op_a, op_b)
            if alpha != 1:   # a product by 1 is exact: the same numbers without the pass
                product *= alpha
            if c_low is not None:   # one rounding of the float32 result, into bits
                if beta != 0:
                    raise ValueError("the emulated GemmEx into bfloat16 takes beta 0 only")
                c[...] = bf16_bits(np.ascontiguousarray(product, np.float32))
                return
            c[...] = product if beta == 0 else product + beta * c  # beta 0: C is not read

        if workspace is not None:   # the scratch it uses (two replays must not share it)
            run.cublas_workspace = workspace
        capture.device_work(run, DEFAULT_STREAM if stream is None else stream)

    def _cupy_call(self, dtype, handle, *args):
        stream = capture.current_stream()
        capture.refuse_if_capturing(NotImplementedError, capture.CUBLAS_REFUSED,
                                        stream=stream)
        math = self.getMathMode(handle)
        self.gemms.append(("sgemm" if dtype == np.float32 else "dgemm", math))
        self._gemm(dtype, *args, stream=stream, tf32=math == TF32_MATH)

    def sgemmStridedBatched(self, handle, ta, tb, m, n, k, alpha, A, lda, sA, B, ldb, sB,
                            beta, C, ldc, sC, batch):
        self._cupy_call(np.float32, handle, ta, tb, m, n, k, alpha, A, lda, sA, B, ldb, sB,
                        beta, C, ldc, sC, batch)

    def dgemmStridedBatched(self, handle, ta, tb, m, n, k, alpha, A, lda, sA, B, ldb, sB,
                            beta, C, ldc, sC, batch):
        self._cupy_call(np.float64, handle, ta, tb, m, n, k, alpha, A, lda, sA, B, ldb, sB,
                        beta, C, ldc, sC, batch)

    #: CuPy's names of the GemmEx codes (cupy.cuda.cublas)
    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT = COMPUTE_32F, GEMM_DEFAULT

    class CUBLASError(RuntimeError):
        """CuPy's cupy.cuda.cublas.CUBLASError."""

    def _cupy_ex(self, what, handle, ta, tb, m, n, k, alpha, A, Atype, lda, sA, B, Btype, ldb,
                 sB, beta, C, Ctype, ldc, sC, batch, computeType, algo):
        stream = capture.current_stream()
        capture.refuse_if_capturing(NotImplementedError, capture.CUBLAS_REFUSED,
                                        stream=stream)
        refused = check_gemm_ex(Atype, Btype, Ctype, computeType, algo)
        if refused:
            raise self.CUBLASError(f"CUBLAS_STATUS_NOT_SUPPORTED: {refused}")
        self.gemms.append((what, self.getMathMode(handle)))
        self._gemm(np.float32, ta, tb, m, n, k, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc, sC,
                   batch, stream=stream, low=Atype, c_low=None if Ctype == CUDA_R_32F else Ctype)

    def gemmEx(self, handle, ta, tb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb,  # noqa: N802
               beta, C, Ctype, ldc, computeType, algo):  # noqa: N803  (CuPy's names)
        self._cupy_ex("gemmEx", handle, ta, tb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb,
                      0, beta, C, Ctype, ldc, 0, 1, computeType, algo)

    def gemmStridedBatchedEx(self, handle, ta, tb, m, n, k, alpha, A, Atype, lda,  # noqa: N802
                             strideA, B, Btype, ldb, strideB, beta, C, Ctype,  # noqa: N803
                             ldc, strideC, batchCount, computeType, algo):  # noqa: N803
        self._cupy_ex("gemmStridedBatchedEx", handle, ta, tb, m, n, k, alpha, A, Atype, lda,
                      strideA, B, Btype, ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount,
                      computeType, algo)

    def sgemm(self, handle, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
        self._cupy_call(np.float32, handle, ta, tb, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C,
                        ldc, 0, 1)

    def dgemm(self, handle, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
        self._cupy_call(np.float64, handle, ta, tb, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C,
                        ldc, 0, 1)


#: the default (legacy NULL) stream of the emulated device: never capturing
DEFAULT_STREAM = capture.DEFAULT_STREAM


def emulated_nvmath_cublas():
    """A module standing in for ``nvmath.bindings.cublas`` (nvmath-python
    1.0: the functions and enums gpu/blas.py uses, with their signatures),
    doing the arithmetic of :class:`HostCublas`.

    As cuBLAS: a handle is bound to one stream (``set_stream``, which also
    resets the workspace to cuBLAS's default pool); alpha and beta are read
    at the call (host pointer mode: frozen into a capture), the operands
    when the work runs (at each replay); the work goes to the handle's
    stream, recorded if it is capturing -- and a handle without a workspace
    of its own refuses a capturing stream (cuBLAS would allocate one)."""
    host = HostCublas()
    module = types.ModuleType("nvmath.bindings.cublas")
    module.Operation = enum.IntEnum("Operation", {"N": 0, "T": 1, "C": 2})
    module.PointerMode = enum.IntEnum("PointerMode", {"HOST": 0, "DEVICE": 1})
    module.Math = enum.IntEnum("Math", {"DEFAULT_MATH": 0, "TENSOR_OP_MATH": 1,
                                        "PEDANTIC_MATH": 2, "TF32_TENSOR_OP_MATH": 3})
    module.ComputeType = enum.IntEnum("ComputeType", {"COMPUTE_16F": 64,
                                                      "COMPUTE_32F": COMPUTE_32F,
                                                      "COMPUTE_32F_FAST_TF32": 77,
                                                      "COMPUTE_64F": 70})
    module.GemmAlgo = enum.IntEnum("GemmAlgo", {"DEFAULT": GEMM_DEFAULT,
                                                "DEFAULT_TENSOR_OP": 99})

    class cuBLASError(Exception):
        pass

    module.cuBLASError = cuBLASError
    handles = {}
    module.handles = handles      # for the tests: handle -> its state
    module.calls = []             # (function name, handle) of every call
    module.gemms = []             # (function name, handle, math mode) of every product
    counter = iter(range(1, 1 << 30))

    def state(handle, what):
        module.calls.append((what, handle))
        if handle not in handles:
            raise cuBLASError(f"{what}: CUBLAS_STATUS_NOT_INITIALIZED (no handle {handle})")
        return handles[handle]

    def create():
        handle = next(counter)
        handles[handle] = {"stream": 0, "workspace": None, "pointer_mode": 0, "math": 0}
        module.calls.append(("create", handle))
        return handle

    def destroy(handle):
        state(handle, "destroy")
        del handles[handle]

    def set_workspace(handle, workspace, workspace_size_in_bytes):
        state(handle, "set_workspace")["workspace"] = (int(workspace),
                                                       int(workspace_size_in_bytes))

    def set_stream(handle, stream_id):
        s = state(handle, "set_stream")
        s["stream"], s["workspace"] = int(stream_id), None   # cublasSetStream resets it

    def get_stream(handle):
        return state(handle, "get_stream")["stream"]

    def set_pointer_mode(handle, mode):
        state(handle, "set_pointer_mode")["pointer_mode"] = int(mode)

    def get_pointer_mode(handle):
        return state(handle, "get_pointer_mode")["pointer_mode"]

    def set_math_mode(handle, mode):
        state(handle, "set_math_mode")["math"] = int(mode)

    def get_math_mode(handle):
        return state(handle, "get_math_mode")["math"]

    def gemm(what, dtype, handle, args, low=None, c_low=None):
        s = state(handle, what)
        stream = capture.stream_of(s["stream"]) or DEFAULT_STREAM
        if s["pointer_mode"] != 0:
            raise NotImplementedError("the emulated cuBLAS reads alpha and beta on the host only")
        if s["workspace"] is None and capture.is_capturing(stream):
            raise cuBLASError(f"{what}: a handle without a workspace of its own on a capturing "
                              "stream (cuBLAS would allocate its default workspace inside the "
                              "capture)")
        module.gemms.append((what, handle, s["math"]))
        host._gemm(dtype, *args, stream=stream,
                   workspace=s["workspace"][0] if s["workspace"] else None,
                   tf32=s["math"] == TF32_MATH, low=low, c_low=c_low)

    def gemm_ex_call(what, handle, args, types):
        refused = check_gemm_ex(*types)
        if refused:
            state(handle, what)
            raise cuBLASError(f"{what}: CUBLAS_STATUS_NOT_SUPPORTED ({refused})")
        gemm(what, np.float32, handle, args, low=types[0],
             c_low=None if types[2] == CUDA_R_32F else types[2])

    def gemm_ex(handle, transa, transb, m, n, k, alpha, a, atype, lda, b, btype, ldb, beta, c,
                ctype, ldc, compute_type, algo):
        gemm_ex_call("gemm_ex", handle,
                     (transa, transb, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, 0, 1),
                     (atype, btype, ctype, compute_type, algo))

    def gemm_strided_batched_ex(handle, transa, transb, m, n, k, alpha, a, atype, lda, stride_a,
                                b, btype, ldb, stride_b, beta, c, ctype, ldc, stride_c,
                                batch_count, compute_type, algo):
        gemm_ex_call("gemm_strided_batched_ex", handle,
                     (transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c,
                      ldc, stride_c, batch_count),
                     (atype, btype, ctype, compute_type, algo))

    def sgemm(handle, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        gemm("sgemm", np.float32, handle,
             (transa, transb, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, 0, 1))

    def dgemm(handle, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        gemm("dgemm", np.float64, handle,
             (transa, transb, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, 0, 1))

    def sgemm_strided_batched(handle, transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb,
                              stride_b, beta, c, ldc, stride_c, batch_count):
        gemm("sgemm_strided_batched", np.float32, handle,
             (transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c, ldc,
              stride_c, batch_count))

    def dgemm_strided_batched(handle, transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb,
                              stride_b, beta, c, ldc, stride_c, batch_count):
        gemm("dgemm_strided_batched", np.float64, handle,
             (transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c, ldc,
              stride_c, batch_count))

    for fn in (create, destroy, set_workspace, set_stream, get_stream, set_pointer_mode,
               get_pointer_mode, set_math_mode, get_math_mode, sgemm, dgemm,
               sgemm_strided_batched, dgemm_strided_batched, gemm_ex, gemm_strided_batched_ex):
        setattr(module, fn.__name__, fn)
    return module


def use_emulated_nvmath(monkeypatch, enabled=True):
    """Make ``nvmath.bindings.cublas`` and ``nvmath.bindings.cublasLt`` the
    emulated ones (``enabled``; the latter: tests/emulated_gpu/cublaslt.py,
    reachable as the returned module's ``lt``), or make nvmath-python fail
    to import (``enabled=False``: gpu/blas.py falls back to CuPy's cuBLAS),
    for this test; gpu/blas.py and gpu/blaslt.py forget their handles, plans
    and checks. Returns the emulated cublas module (None when disabled)."""
    from purine_mpi.gpu import SaidOnce, blas, blaslt
    from .cublaslt import emulated_nvmath_cublaslt
    monkeypatch.setattr(blas, "_state", {"checked": False, "cublas": None, "reason": None,
                                         "noted": False})
    monkeypatch.setattr(blas, "_handles", {})
    monkeypatch.setattr(blas, "_say_once", SaidOnce())
    monkeypatch.setattr(blaslt, "_state", {"checked": False, "lt": None, "reason": None})
    for name in ("_handles", "_plans", "_refused"):
        monkeypatch.setattr(blaslt, name, {})
    monkeypatch.setattr(blaslt, "_retired", [])
    monkeypatch.setattr(blaslt, "_say_once", SaidOnce())
    if not enabled:
        for name in ("nvmath", "nvmath.bindings", "nvmath.bindings.cublas",
                     "nvmath.bindings.cublasLt"):
            monkeypatch.setitem(sys.modules, name, None)   # import raises ImportError
        return None
    cublas = emulated_nvmath_cublas()
    bindings = types.ModuleType("nvmath.bindings")
    bindings.cublas = cublas
    bindings.cublasLt = emulated_nvmath_cublaslt()   # tests reach it as cublas.lt
    cublas.lt = bindings.cublasLt
    nvmath = types.ModuleType("nvmath")
    nvmath.bindings = bindings
    nvmath.CudaDataType = enum.IntEnum("CudaDataType", {   # nvmath._utils.CudaDataType
        "CUDA_R_32F": CUDA_R_32F, "CUDA_R_64F": 1, "CUDA_R_16F": CUDA_R_16F,
        "CUDA_R_16BF": CUDA_R_16BF})
    nvmath.__path__ = []      # a package, so "from nvmath.bindings import cublas" works
    bindings.__path__ = []
    monkeypatch.setitem(sys.modules, "nvmath", nvmath)
    monkeypatch.setitem(sys.modules, "nvmath.bindings", bindings)
    monkeypatch.setitem(sys.modules, "nvmath.bindings.cublas", cublas)
    monkeypatch.setitem(sys.modules, "nvmath.bindings.cublasLt", bindings.cublasLt)
    return cublas


#: the NVRTC options the host build knows, and its g++ flag for each
#: (g++ for x86-64 contracts nothing without -mfma; said anyway; the host's
#: float arithmetic keeps subnormals, as -ftz=false: no flag. -ftz=true,
#: which CuPy's own RawModule adds, has no host equivalent: refused)
_NVRTC_TO_GXX = {"--fmad=false": "-ffp-contract=off", "-ftz=false": None}
#: the first line of an emulated "binary" (compile_using_nvrtc's output)
_BINARY_MAGIC = b"purine-emulated-nvrtc-binary\n"
#: every options tuple the emulated compile_using_nvrtc received (tests)
COMPILED_OPTIONS = []


def _host_flags(options):
    """g++ flags for NVRTC ``options``; one the host build does not know is
    an error (a real GPU would compile it: the emulation must not drop it)."""
    unknown = [o for o in options if o not in _NVRTC_TO_GXX]
    if unknown:
        raise ValueError(f"emulated RawModule: NVRTC options {unknown} have no host "
                         f"equivalent here (known: {sorted(_NVRTC_TO_GXX)})")
    return [_NVRTC_TO_GXX[o] for o in options if _NVRTC_TO_GXX[o] is not None]


def _own_suffix():
    """A name part no other process or thread writing now has."""
    return f"{os.getpid()}-{threading.get_ident()}.part"


def _write_whole(path, text):
    """``text`` in ``path``, unless it holds it already: written under a
    name of this thread's own, then renamed over ``path`` (another process
    reading ``path`` meanwhile reads the old file or the new, whole)."""
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    part = path.with_name(f"{path.name}.{_own_suffix()}")
    part.write_text(text)
    os.replace(part, path)


def compile_using_nvrtc(source, options=(), arch=None, filename="kern.cu", **_):
    """``cupy.cuda.compiler.compile_using_nvrtc``: the "binary" is the
    options and the source (RawModule(path=...) builds it with g++); the
    options are checked here, as NVRTC would."""
    options = tuple(options)
    _host_flags(options)
    COMPILED_OPTIONS.append(options)
    return _BINARY_MAGIC + json.dumps([list(options), source]).encode(), None


def keep_kernels_in(monkeypatch, build_dir):
    """Point ``$PURINE_CACHE_DIR`` (where ``gpu.load_kernel`` keeps compiled
    kernels) at ``build_dir`` for this test, unless the test chose one: the
    emulated device's kernels never go to the user's ~/.cache."""
    if not os.environ.get("PURINE_CACHE_DIR"):
        monkeypatch.setenv("PURINE_CACHE_DIR", str(pathlib.Path(build_dir) / "purine_cache"))


def host_cupy(build_dir):
    """A module standing in for cupy: NumPy arrays, RawModule built by g++."""

    class RawModule:
        def __init__(self, code=None, options=(), path=None):
            if (code is None) == (path is None):
                raise TypeError("Exactly one of `code` and `path` keyword arguments must be "
                                "given.")
            if path is not None:   # what the emulated compile_using_nvrtc wrote
                data = pathlib.Path(path).read_bytes()
                if not data.startswith(_BINARY_MAGIC):
                    raise ValueError(f"emulated RawModule: {path} is no emulated binary")
                options, code = json.loads(data[len(_BINARY_MAGIC):])
            # read at each build: a test may build both ways in one process
            defines = ["-DPURINE_EMU_THREADED"] if os.environ.get(THREADED_ENV) == "1" else []
            defines += _host_flags(options)
            digest = hashlib.sha1("\0".join([_HOST_PRELUDE, *defines, code]).encode()
                                  ).hexdigest()[:16]
            source = build_dir / f"{digest}.cu"
            library_path = build_dir / f"{digest}.so"
            prelude = build_dir / "prelude.h"
            base = ["g++", "-std=c++14", "-include", str(prelude), *defines, "-x", "c++"]
            # a build folder may be shared by processes (the ranks of an MPI
            # test, a test's subprocess and pytest's own: each kernel built
            # once a session, not once a rank and launch): the digest's lock
            # held while one builds, every file written whole under a name
            # of its own and renamed (a reader never sees a part of it)
            with open(build_dir / f"{digest}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                _write_whole(prelude, _HOST_PRELUDE)
                _write_whole(source, code)
                expanded = _EXPANDED.get(digest)
                if expanded is None:
                    expanded = _EXPANDED[digest] = subprocess.run(
                        base + [str(source), "-E", "-P"], check=True, capture_output=True,
                        text=True).stdout
                signatures = _SIGNATURE.findall(expanded)
                # a warp shuffle is two block barriers here (the prelude)
                self._threaded = "__syncthreads" in code or "__shfl" in code
                if not library_path.exists():
                    built = source
                    if self._threaded:   # the kernels, then their fibers' entry points
                        built = build_dir / f"{digest}_grid.cu"
                        _write_whole(built, code + "\n" + _grid_wrappers(signatures))
                    # -fno-gnu-unique: a template kernel's __shared__ (a static of a
                    # template) stays this library's own, not bound process-wide to
                    # the same name in another build of the source (the other mode)
                    part = library_path.with_name(f"{digest}.{_own_suffix()}.so")
                    subprocess.run(base + [str(built), "-O1", "-fPIC", "-fno-gnu-unique",
                                           "-shared", "-o", str(part)],
                                   check=True, capture_output=True, text=True)
                    os.replace(part, library_path)
            self._signatures = {name: _parse_params(params) for name, params in signatures}
            self._library = ctypes.CDLL(str(library_path))
            self._fibers = bool(self._library.purine_emu_fibers())
            self._warps = _shuffling(expanded) if "__shfl" in code else set()

        def get_function(self, name):
            if name not in self._signatures:
                raise AttributeError(f"no extern \"C\" kernel {name}")
            return _HostKernel(self._library, name, self._signatures[name], self._threaded,
                               name in self._warps, self._fibers)

    fake = types.ModuleType("cupy")
    fake.ndarray = np.ndarray
    fake.empty = np.empty
    fake.ascontiguousarray = np.ascontiguousarray
    fake.asarray = np.asarray
    fake.RawModule = RawModule
    fake.__version__ = "emulated"
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(
                                          getDevice=lambda: 0, CUDA_R_32F=CUDA_R_32F,
                                          CUDA_R_16F=CUDA_R_16F, CUDA_R_16BF=CUDA_R_16BF),
                                      cublas=HostCublas(),
                                      compiler=types.SimpleNamespace(
                                          compile_using_nvrtc=compile_using_nvrtc),
                                      nvrtc=types.SimpleNamespace(getVersion=lambda: (0, 0)),
                                      Device=NoDevice,
                                      device=types.SimpleNamespace(get_cublas_handle=lambda: 0),
                                      get_current_stream=lambda: (capture.current_stream()
                                                                  or DEFAULT_STREAM))
    return fake
