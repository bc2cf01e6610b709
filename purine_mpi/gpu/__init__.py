"""Raw CUDA kernels for the GPU backend, loaded from ``cuda/<name>.cu``.

Most ops run the same ``xp`` code on NumPy and CuPy; the few that CuPy has no
efficient equivalent for (im2col/col2im, pooling, LRN, fused softmax-loss,
fused SGD update, dropout mask) call the wrappers in
:mod:`purine_mpi.gpu.kernels`, which launch the kernels compiled here.

Each ``.cu`` file is one op family. It defines templates and one
``extern "C"`` entry point per dtype -- ``<func>_f32`` and ``<func>_f64`` --
so the Python side picks a kernel by name without C++ name mangling::

    module = load_kernel("pooling")                      # cupy.RawModule
    kernel = get_function(module, "maxpool_forward", x.dtype)
    kernel((blocks,), (256,), args)                      # on the current stream

The source is compiled by NVRTC (CuPy's ``compile_using_nvrtc``, with the
options CuPy's RawModule would use, but without the ``-ftz=true`` CuPy adds
to every RawModule: see ``COMMON_OPTIONS``) on first use, cached per (name,
device, options) in the process and as a binary in
``$PURINE_CACHE_DIR/kernels/`` (keyed by source, options, CuPy and NVRTC
versions and the device's compute capability), which later processes load
with ``cupy.RawModule(path=...)``. A ``#line 1 "<file>"`` directive is
prepended so compile errors name the real file and line.

Nothing here imports CuPy at import time: the package loads on CPU machines.
The sources are looked up in ``$PURINE_CUDA_DIR`` if set, else in the
``cuda/`` folder at the repository root.
"""
import hashlib
import os
import re
import struct
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

CUDA_DIR = Path(os.environ.get("PURINE_CUDA_DIR")
                or Path(__file__).resolve().parents[2] / "cuda")

_DTYPE_SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}

#: NVRTC options a source always compiles with. The solver updates take
#: ``--fmad=false``: NVRTC otherwise contracts ``a * b + c`` into a fused
#: multiply-add wherever it likes, so two kernels with the same arithmetic
#: (``adam_update`` and ``adam_multi``: one parameter or all at once) gave
#: results a last bit apart on an H200, and neither the CPU update's
#: (NumPy rounds each product). Without contraction every operation rounds
#: as the CPU's does; the updates are memory-bound, so it costs nothing.
SOURCE_OPTIONS = {name: ("--fmad=false",) for name in ("sgd", "adam", "adaptive")}

#: NVRTC options every source compiles with, after its own and the caller's:
#: IEEE float32 subnormals. CuPy appends ``-ftz=true`` to every RawModule's
#: options (``cupy/cuda/compiler.py``, ``_compile_with_cache_cuda``), after
#: the user's, and NVRTC takes the last of repeated options (with a warning,
#: cupy/cupy#9576), so a RawModule cannot be told ``-ftz=false``: our
#: float32 kernels flushed subnormal operands and results to zero, unlike
#: NumPy and PyTorch (the bf16 copies of a subnormal gave 0 where NumPy
#: gives 0x8080, on an H200). ``load_kernel`` therefore compiles through
#: CuPy's ``compile_using_nvrtc`` (which adds only the architecture and
#: ``--device-as-default-execution-space``) and loads the binary itself.
COMMON_OPTIONS = ("-ftz=false",)

_lock = threading.Lock()       # the dispatcher loads kernels from many threads
_modules = {}                  # (name, device, options) -> cupy.RawModule
_functions = {}                # (name, func, suffix, device, options) -> RawKernel


class SaidOnce:
    """``say(key, line)``: ``line`` on standard error the first time ``key``
    comes (thread-safe; a None line says nothing); ``clear()`` forgets the
    keys (the modules' ``reset()``, tests). The GPU paths' fallback notes."""

    def __init__(self):
        self._lock = threading.Lock()
        self._said = set()

    def __call__(self, key, line):
        if line is None:
            return
        with self._lock:
            if key in self._said:
                return
            self._said.add(key)
        print(line, file=sys.stderr, flush=True)

    def clear(self):
        with self._lock:
            self._said.clear()


def import_cupy():
    """CuPy, or a UserError that says how to get it."""
    try:
        import cupy
    except ImportError as exc:
        from ..base.errors import UserError
        raise UserError("GPU kernels need CuPy: install purine_mpi[gpu] (or the "
                        "cupy-cudaXXx wheel matching your CUDA), or run on "
                        f"device: -1 ({exc})") from exc
    return cupy


def data_ptr(array):
    """Address of an array's first element (NumPy or CuPy), to tell whether
    two arrays are the same buffer (e.g. an update's ``w`` and ``w@new``)
    and to hand device pointers to kernels and libraries."""
    ptr = getattr(getattr(array, "data", None), "ptr", None)
    if ptr is None:
        ptr = array.__array_interface__["data"][0]
    return int(ptr)


def dtype_suffix(dtype):
    """Entry-point suffix for an array dtype: 'f32' or 'f64'."""
    try:
        return _DTYPE_SUFFIX[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"CUDA kernels exist for float32 and float64 only, "
                        f"not {np.dtype(dtype)}") from None


def source_path(name):
    """Path of ``cuda/<name>.cu``; a clear error when it is missing."""
    path = CUDA_DIR / f"{name}.cu"
    if not path.is_file():
        from ..base.errors import UserError
        raise UserError(f"CUDA source {path} not found; set PURINE_CUDA_DIR to "
                        "the folder holding purine_mpi's cuda/*.cu files")
    return path


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([\w.]+\.cuh)"\s*$')


def _line_directive(path, line=1):
    escaped = str(path).replace("\\", "\\\\").replace('"', '\\"')
    return f'#line {line} "{escaped}"'


def _expand(path, seen):
    """``path``'s text with each ``#include "x.cuh"`` replaced by that header
    (from the same folder, once per compile), ``#line`` directives keeping
    compiler messages on the real file and line."""
    lines = [_line_directive(path)]
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = _LOCAL_INCLUDE.match(line)
        if match is None:
            lines.append(line)
            continue
        header = (path.parent / match.group(1)).resolve()
        if not header.is_file():
            from ..base.errors import UserError
            raise UserError(f"{path}:{number}: included header {header} not found")
        if header not in seen:
            seen.add(header)
            lines.append(_expand(header, seen))
        lines.append(_line_directive(path, number + 1))
    return "\n".join(lines)


def kernel_source(name):
    """The text compiled for ``name``: a ``#line`` directive, then the file,
    with the local headers it includes (``#include "philox.cuh"``) inlined,
    since NVRTC has no include path for them."""
    path = source_path(name).resolve()
    text = _expand(path, set())
    return text + "\n" if path.read_text().endswith("\n") else text


def _current_device(cupy):
    return cupy.cuda.runtime.getDevice()


def compile_options(name, options=()):
    """The NVRTC options ``cuda/<name>.cu`` compiles with: its
    ``SOURCE_OPTIONS``, then ``options``, then ``COMMON_OPTIONS``."""
    return SOURCE_OPTIONS.get(name, ()) + tuple(options) + COMMON_OPTIONS


def cache_dir():
    """``$PURINE_CACHE_DIR`` or ``~/.cache/purine_mpi``: compiled kernels
    (``kernels/``) and cuDNN's chosen plans (``cudnn_plans/``)."""
    from ..base import env
    return env.get("PURINE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "purine_mpi")


def kernel_cache_dir():
    """Where compiled kernels are kept: ``$PURINE_CACHE_DIR/kernels``
    (default ``~/.cache/purine_mpi/kernels``)."""
    return Path(cache_dir()) / "kernels"


def _cupy_assembled(options):
    """``options`` as CuPy's RawModule hands them to its compiler (C++
    standard, CCCL and CUDA include folders), less its ``-ftz=true``; as
    they are where this CuPy has no such step."""
    try:
        from cupy._core.core import assemble_cupy_compiler_options
    except ImportError:
        return tuple(options)
    return tuple(assemble_cupy_compiler_options(tuple(options)))


def _write_once(path, data):
    """``data`` into ``path`` atomically (ranks and test workers compile the
    same kernel at once: a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


_private_dir = []   # the process's own kernel folder, where the cache is not writable


def _whole_binary(binary):
    """``binary`` (``compile_using_nvrtc``'s) as bytes the driver can read
    from a file. CuPy's ``nvrtc.getCUBIN`` (14.2) returns the cubin less its
    last byte (``cubin_ptr[:cubinSizeRet-1]``, "strip the trailing NULL",
    but nvrtcGetCUBINSize counts no NUL: measured with libnvrtc 13.5, the
    size is the ELF's extent, its program headers last). CuPy loads it from
    memory, where a Python bytes object ends in a NUL, so the driver reads
    that byte as 0; a file must hold it. An ELF one byte short of the
    extent its header states gets that 0 back; anything else (PTX, a whole
    ELF) is returned as it is."""
    if isinstance(binary, str):
        binary = binary.encode()
    binary = bytes(binary)
    if binary[:5] == b"\x7fELF\x02" and len(binary) >= 64:
        phoff, shoff = struct.unpack_from("<QQ", binary, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", binary, 0x36)
        extent = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
        if extent == len(binary) + 1:
            binary += b"\0"
    return binary


def _load(cupy, path):
    """``cupy.RawModule(path=path)``, loaded now: CuPy reads the file when a
    kernel is first taken, so a file the driver refuses would otherwise
    fail at the first launch instead of here."""
    module = cupy.RawModule(path=str(path))
    getattr(module, "module", None)
    return module


def _build_module(cupy, name, source, options):
    """``source`` (of ``cuda/<name>.cu``) compiled by NVRTC with exactly
    ``options`` (plus CuPy's assembly and the architecture), loaded as a
    RawModule. A cached binary the driver refuses is compiled again."""
    full = _cupy_assembled(options)
    device = _current_device(cupy)
    identity = (getattr(cupy, "__version__", "?"), tuple(cupy.cuda.nvrtc.getVersion()),
                str(cupy.cuda.Device(device).compute_capability),
                os.environ.get("CUPY_COMPILE_WITH_PTX", ""))
    digest = hashlib.sha256(repr((source, full, identity)).encode()).hexdigest()[:32]
    file_name = f"{name}-{digest}.bin"    # a cubin or PTX: the driver tells them apart
    for folder in [kernel_cache_dir()] + _private_dir:
        cached = folder / file_name
        if cached.is_file():
            try:
                return _load(cupy, cached)
            except Exception as exc:     # cut short, overwritten: compile it again
                print(f"purine_mpi: cached kernel {cached} cannot be loaded "
                      f"({type(exc).__name__}: {exc}); compiling it again", file=sys.stderr)
                break
    binary = cupy.cuda.compiler.compile_using_nvrtc(source, full, filename=f"{name}.cu")
    if isinstance(binary, tuple):         # CuPy 13+: (binary, name mapping)
        binary = binary[0]
    binary = _whole_binary(binary)
    path = kernel_cache_dir() / file_name
    try:
        _write_once(path, binary)
    except OSError as exc:
        if not _private_dir:
            _private_dir.append(Path(tempfile.mkdtemp(prefix="purine_mpi_kernels_")))
            print(f"purine_mpi: kernel cache {path.parent} not writable ({exc}); compiled "
                  f"kernels go to {_private_dir[0]} for this process", file=sys.stderr)
        path = _private_dir[0] / file_name
        _write_once(path, binary)
    return _load(cupy, path)


def _fallback_module(cupy, name, source, options, exc):
    """CuPy's own ``RawModule(code=...)`` with ``options`` (the source's and
    the caller's): where our compile path fails for a reason not in our
    source (a CuPy whose compiler differs from 14's), the kernels still
    run, as before that path existed, flushing float32 subnormals."""
    print(f"purine_mpi: compiling cuda/{name}.cu through cupy.cuda.compiler failed "
          f"({type(exc).__name__}: {exc}); loading it with cupy.RawModule(code=...), whose "
          f"-ftz=true makes float32 kernels flush subnormals to zero", file=sys.stderr)
    module = cupy.RawModule(code=source, options=tuple(options))
    getattr(module, "module", None)
    return module


def load_kernel(name, options=()):
    """The ``cupy.RawModule`` for ``cuda/<name>.cu`` on the current device,
    compiled with ``compile_options(name, options)`` (no flush to zero)."""
    cupy = import_cupy()
    full = compile_options(name, options)
    key = (name, _current_device(cupy), full)
    with _lock:
        module = _modules.get(key)
        if module is None:
            source = kernel_source(name)
            compile_error = getattr(getattr(cupy.cuda, "compiler", None),
                                    "CompileException", ())
            try:
                module = _build_module(cupy, name, source, full)
            except compile_error:       # an error in our source: no fallback hides it
                raise
            except Exception as exc:
                module = _fallback_module(cupy, name, source,
                                          SOURCE_OPTIONS.get(name, ()) + tuple(options), exc)
            _modules[key] = module
        return module


def get_function(module, func_name, dtype, options=()):
    """The kernel ``<func_name>_<f32|f64>`` for ``dtype`` from ``module``
    (``dtype=None``: the entry point ``<func_name>`` itself, for kernels that
    exist once, e.g. ``philox_words``).

    ``module`` is a source name (``"pooling"``, loaded with ``load_kernel``) or
    a RawModule. Kernels fetched by name are cached, so this is cheap to call
    on every launch."""
    suffix = None if dtype is None else dtype_suffix(dtype)
    full_name = func_name if suffix is None else f"{func_name}_{suffix}"
    if not isinstance(module, str):
        return module.get_function(full_name)
    cupy = import_cupy()
    options = tuple(options)
    key = (module, func_name, suffix, _current_device(cupy), options)
    kernel = _functions.get(key)
    if kernel is None:
        raw_module = load_kernel(module, options)
        with _lock:
            kernel = _functions.get(key)
            if kernel is None:
                kernel = raw_module.get_function(full_name)
                _functions[key] = kernel
    return kernel


def clear_kernel_cache():
    """Forget compiled modules (after editing a .cu file in a live session)."""
    with _lock:
        _modules.clear()
        _functions.clear()


def set_tf32(enabled=True):
    """Allow (or forbid) TensorFloat-32 in CuPy's float32 matrix products.

    TF32 runs cuBLAS float32 GEMMs (fc layers, the im2col convolution GEMM) on
    tensor cores of Ampere and newer GPUs with a 10-bit mantissa: much faster,
    less exact (~1e-3 relative). It is off by default, as in CuPy, so GPU
    results match the CPU ones to float32 tolerance. The raw kernels here are
    unaffected.

    CuPy reads ``CUPY_TF32`` when it first needs a float32 compute type, so the
    variable is set for that case; a process that already ran a float32
    matmul is switched through ``cupy._core._routines_linalg.set_compute_type``
    (CuPy's own switch, in a private module, hence the fallback)."""
    os.environ["CUPY_TF32"] = "1" if enabled else "0"
    try:
        import cupy  # noqa: F401
        from cupy._core import _routines_linalg as linalg
    except ImportError:
        return
    compute_type = (linalg.COMPUTE_TYPE_TF32 if enabled
                    else linalg.COMPUTE_TYPE_DEFAULT)
    try:
        # TF32 asks the current device's compute capability (< 8.0: CuPy warns
        # and keeps the default).
        linalg.set_compute_type(np.float32, compute_type)
    except (AttributeError, RuntimeError):
        pass  # no device or CuPy internals moved: the variable still applies


def tf32_enabled():
    """Whether float32 matmuls may use TF32 (as last set or from CUPY_TF32)."""
    try:
        return int(os.environ.get("CUPY_TF32", "0")) > 0
    except ValueError:
        return False
