"""How ``purine_mpi.gpu.load_kernel`` compiles cuda/*.cu: without flush to zero.

CuPy appends ``-ftz=true`` to every ``RawModule(code=...)``'s options, after
the caller's (cupy/cuda/compiler.py, ``_compile_with_cache_cuda``), and NVRTC
takes the last of repeated options, so a RawModule's float32 arithmetic
flushes subnormals that NumPy and PyTorch keep. The loader compiles through
``cupy.cuda.compiler.compile_using_nvrtc`` with ``-ftz=false`` and loads the
binary with ``RawModule(path=...)``. Checked here without a GPU: the options
the compiler gets (a stand-in for CuPy with CuPy 14's option assembly), the
on-disk cache, and the emulated device; on a GPU (``gpu`` mark) a leaky
ReLU's subnormal products against NumPy's, bit for bit.
"""
import sys
import types

import numpy as np
import pytest

import purine_mpi.gpu as gpu
from tests.conftest import cuda_cupy_or_skip


class _StandInCupy:
    """Just what ``load_kernel`` touches of CuPy 14, recording the compile
    and refusing ``RawModule(code=...)`` (where CuPy adds ``-ftz=true``)."""

    def __init__(self, monkeypatch):
        self.compiled, self.loaded, self.code_loaded = [], [], []
        self.compile_error = None          # raised by compile_using_nvrtc when set
        self.binary = lambda filename: b"cubin of " + filename.encode()
        cupy = types.ModuleType("cupy")
        cupy.__path__ = []
        cupy.__version__ = "14.2.0"
        core_pkg = types.ModuleType("cupy._core")
        core_pkg.__path__ = []
        core = types.ModuleType("cupy._core.core")

        def assemble_cupy_compiler_options(options):   # CuPy 14.2's, in short
            assert isinstance(options, tuple)
            return ("-I/cccl",) + options + ("--std=c++17", "-I/cupy/include")
        core.assemble_cupy_compiler_options = assemble_cupy_compiler_options

        class CompileException(Exception):
            pass

        def compile_using_nvrtc(source, options=(), arch=None, filename="kern.cu", **kw):
            self.compiled.append((filename, tuple(options), source))
            if self.compile_error is not None:
                raise self.compile_error
            return self.binary(filename), None

        stand_in = self

        class RawModule:
            """CuPy's: ``path=`` is read by the driver when a kernel is
            first taken (``module``), not when the RawModule is made."""
            def __init__(self, code=None, options=(), path=None):
                if code is not None:           # CuPy would add -ftz=true
                    stand_in.code_loaded.append((code, tuple(options)))
                else:
                    stand_in.loaded.append(path)
                self.path = path

            @property
            def module(self):
                if self.path is not None:     # the driver: CUDA_ERROR_INVALID_IMAGE
                    data = open(self.path, "rb").read()
                    if not data.startswith(b"cubin of ") and not data.startswith(b"\x7fELF"):
                        raise RuntimeError(f"CUDA_ERROR_INVALID_IMAGE: {self.path}")
                return self

            def get_function(self, name):
                return (self.module, name)

        cupy.RawModule = RawModule
        cupy.cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDevice=lambda: 0),
            compiler=types.SimpleNamespace(compile_using_nvrtc=compile_using_nvrtc,
                                           CompileException=CompileException),
            nvrtc=types.SimpleNamespace(getVersion=lambda: (13, 0)),
            Device=lambda device: types.SimpleNamespace(compute_capability="90"))
        for name, module in (("cupy", cupy), ("cupy._core", core_pkg),
                             ("cupy._core.core", core)):
            monkeypatch.setitem(sys.modules, name, module)
        cupy._core, core_pkg.core = core_pkg, core
        self.module = cupy


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    monkeypatch.setenv("PURINE_CACHE_DIR", str(tmp_path / "cache"))
    gpu.clear_kernel_cache()
    yield _StandInCupy(monkeypatch)
    gpu.clear_kernel_cache()


def test_the_compiler_gets_ftz_false_after_every_other_option(stand_in, tmp_path):
    """adam (``--fmad=false`` of its own) and a caller's option: NVRTC gets
    CuPy's assembly of them and ``-ftz=false``, never ``-ftz=true``, and
    the kernel is the binary it wrote, loaded by path."""
    gpu.load_kernel("adam", options=("-DEXTRA=1",))
    [(filename, options, source)] = stand_in.compiled
    assert filename == "adam.cu" and source == gpu.kernel_source("adam")
    assert options == ("-I/cccl", "--fmad=false", "-DEXTRA=1", "-ftz=false", "--std=c++17",
                       "-I/cupy/include"), options
    assert "-ftz=true" not in options and "--ftz=true" not in options
    [path] = stand_in.loaded
    assert path.startswith(str(tmp_path / "cache" / "kernels" / "adam-"))
    assert open(path, "rb").read() == b"cubin of adam.cu" and stand_in.code_loaded == []
    assert gpu.compile_options("pooling") == ("-ftz=false",)
    assert gpu.compile_options("sgd", ("-DX",)) == ("--fmad=false", "-DX", "-ftz=false")


def test_a_compiled_kernel_is_loaded_from_the_cache_in_a_later_process(stand_in, monkeypatch):
    """The binary is kept under $PURINE_CACHE_DIR/kernels: after the process
    forgets its modules (a new process) it is loaded, not compiled again;
    other options, another compute capability or another NVRTC compile anew."""
    first = gpu.load_kernel("pooling")
    assert gpu.load_kernel("pooling") is first and len(stand_in.compiled) == 1
    gpu.clear_kernel_cache()
    gpu.load_kernel("pooling")
    assert len(stand_in.compiled) == 1 and stand_in.loaded[1] == stand_in.loaded[0]
    gpu.load_kernel("pooling", options=("-DX",))
    assert len(stand_in.compiled) == 2 and stand_in.loaded[2] != stand_in.loaded[0]
    gpu.clear_kernel_cache()
    monkeypatch.setattr(stand_in.module.cuda, "Device",
                        lambda device: types.SimpleNamespace(compute_capability="80"))
    gpu.load_kernel("pooling")
    gpu.clear_kernel_cache()
    monkeypatch.setattr(stand_in.module.cuda.nvrtc, "getVersion", lambda: (13, 2))
    gpu.load_kernel("pooling")
    assert len(stand_in.compiled) == 4 and len(set(stand_in.loaded)) == 4


def test_an_unwritable_cache_compiles_into_a_folder_of_the_process(stand_in, monkeypatch,
                                                                     tmp_path, capfd):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PURINE_CACHE_DIR", str(blocker))   # kernels/ cannot be made
    monkeypatch.setattr(gpu, "_private_dir", [])
    gpu.load_kernel("pooling")
    [path] = stand_in.loaded
    assert open(path, "rb").read() == b"cubin of pooling.cu"
    assert not path.startswith(str(blocker)) and "not writable" in capfd.readouterr().err


def test_the_emulated_device_compiles_our_options_and_refuses_ftz_true(host_build_dir,
                                                                       monkeypatch, tmp_path):
    """The emulated CuPy's compile_using_nvrtc sees the loader's options
    (``-ftz=false`` mapped to the host's IEEE arithmetic, no g++ flag) and
    refuses ``-ftz=true``, which the host cannot emulate; its leaky ReLU
    keeps subnormals as NumPy does."""
    from tests.emulated_gpu import host_kernels
    from tests.emulated_gpu.arrays import DeviceArray
    from tests.emulated_gpu.cupy_module import use_emulated_cupy
    from purine_mpi.gpu import kernels
    monkeypatch.setenv("PURINE_CACHE_DIR", str(tmp_path / "cache"))
    use_emulated_cupy(monkeypatch, host_build_dir)
    before = len(host_kernels.COMPILED_OPTIONS)
    gpu.load_kernel("activation")
    assert host_kernels.COMPILED_OPTIONS[before:] == [("-ftz=false",)]
    with pytest.raises(ValueError, match="-ftz=true"):
        host_kernels.compile_using_nvrtc("", ("-ftz=true",))
    x = _subnormal_products_input()
    y = np.asarray(kernels.relu_forward(np.array(x).view(DeviceArray), negative_slope=0.5))
    assert np.array_equal(y.view(np.uint32), _leaky_numpy(x).view(np.uint32))
    gpu.clear_kernel_cache()


def _elf64(program_headers=2):
    """A minimal ELF64 image: its header, then ``program_headers`` program
    headers, the last field of the last one (p_align) 8: its top byte 0."""
    import struct
    header = bytearray(64)
    header[:5] = b"\x7fELF\x02"
    struct.pack_into("<QQ", header, 0x20, 64, 0)                  # e_phoff, e_shoff
    struct.pack_into("<HHHH", header, 0x36, 56, program_headers, 64, 0)
    body = b"".join(b"\x01" * 48 + (8).to_bytes(8, "little") for _ in range(program_headers))
    return bytes(header) + body


def test_a_cubin_that_cupy_cut_short_is_written_whole(stand_in):
    """CuPy 14's ``nvrtc.getCUBIN`` returns the cubin less its last byte
    (``cubin_ptr[:cubinSizeRet-1]``, "strip the trailing NULL", though
    nvrtcGetCUBINSize counts none: with libnvrtc 13.5 the size is exactly
    the ELF's extent, its program headers last). CuPy loads it from memory,
    where Python's bytes end in a NUL; the driver reading our file would
    find the last program header cut. The file is the whole ELF."""
    whole = _elf64()
    stand_in.binary = lambda filename: whole[:-1]
    gpu.load_kernel("pooling")
    [path] = stand_in.loaded
    assert open(path, "rb").read() == whole
    # a PTX (CUPY_COMPILE_WITH_PTX=1) or a whole cubin is written as it is
    gpu.clear_kernel_cache()
    stand_in.binary = lambda filename: whole
    gpu.load_kernel("pooling", options=("-DX",))
    assert open(stand_in.loaded[-1], "rb").read() == whole
    assert gpu._whole_binary(b"//\n.version 8.0\n") == b"//\n.version 8.0\n"


def test_a_corrupted_cached_kernel_is_compiled_again(stand_in, capfd):
    """A cached binary the driver refuses (cut short, overwritten) is found
    when the kernel is loaded, not at its first launch, and compiled again
    in its place; the run goes on."""
    gpu.load_kernel("pooling")
    [path] = stand_in.loaded
    with open(path, "wb") as f:
        f.write(b"cub")                    # what a disk-full write could leave
    gpu.clear_kernel_cache()
    module = gpu.load_kernel("pooling")
    assert len(stand_in.compiled) == 2 and open(path, "rb").read() == b"cubin of pooling.cu"
    assert module.get_function("maxpool_forward_f32")[1] == "maxpool_forward_f32"
    assert "compiling it again" in capfd.readouterr().err


@pytest.mark.parametrize("error", [TypeError("compile_using_nvrtc() got an unexpected "
                                             "keyword argument 'filename'"),
                                   AttributeError("module has no attribute 'nvrtc'")])
def test_a_cupy_whose_compiler_does_not_fit_falls_back_to_rawmodule_code(stand_in, capfd,
                                                                          error):
    """Where our own compile path fails for a reason not in our source (a
    CuPy whose compiler has other signatures), the kernels still load, as
    CuPy's RawModule(code=...) with the options of before (which flush
    subnormals): one line says so."""
    stand_in.compile_error = error
    module = gpu.load_kernel("adam", options=("-DX",))
    assert stand_in.code_loaded == [(gpu.kernel_source("adam"), ("--fmad=false", "-DX"))]
    assert module.get_function("adam_update_f32")[1] == "adam_update_f32"
    err = capfd.readouterr().err
    assert "RawModule(code=...)" in err and "flush" in err and type(error).__name__ in err


def test_a_compile_error_in_our_source_is_raised_not_hidden(stand_in):
    stand_in.compile_error = stand_in.module.cuda.compiler.CompileException("adam.cu(3): error")
    with pytest.raises(stand_in.module.cuda.compiler.CompileException):
        gpu.load_kernel("adam")
    assert stand_in.code_loaded == []


def test_the_emulated_device_recompiles_a_truncated_cache_file_and_falls_back(
        host_build_dir, monkeypatch, tmp_path, capfd):
    """On the emulated device: a cached binary cut in half is compiled
    again; a compile_using_nvrtc that raises leaves RawModule(code=...),
    whose leaky ReLU still runs."""
    from tests.emulated_gpu import host_kernels
    from tests.emulated_gpu.arrays import DeviceArray
    from tests.emulated_gpu.cupy_module import use_emulated_cupy
    from purine_mpi.gpu import kernels
    monkeypatch.setenv("PURINE_CACHE_DIR", str(tmp_path / "cache"))
    fake = use_emulated_cupy(monkeypatch, host_build_dir)
    x = _subnormal_products_input()
    gpu.load_kernel("activation")
    [path] = (tmp_path / "cache" / "kernels").glob("activation-*.bin")
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    gpu.clear_kernel_cache()
    before = len(host_kernels.COMPILED_OPTIONS)
    y = np.asarray(kernels.relu_forward(np.array(x).view(DeviceArray), negative_slope=0.5))
    assert np.array_equal(y.view(np.uint32), _leaky_numpy(x).view(np.uint32))
    assert len(host_kernels.COMPILED_OPTIONS) == before + 1 and path.read_bytes() == data
    gpu.clear_kernel_cache()

    def mismatched(*args, **kwargs):
        raise TypeError("compile_using_nvrtc() takes 1 positional argument")
    monkeypatch.setattr(fake.cuda.compiler, "compile_using_nvrtc", mismatched)
    monkeypatch.setenv("PURINE_CACHE_DIR", str(tmp_path / "cache2"))
    y = np.asarray(kernels.relu_forward(np.array(x).view(DeviceArray), negative_slope=0.5))
    assert np.array_equal(y.view(np.uint32), _leaky_numpy(x).view(np.uint32))
    err = capfd.readouterr().err
    assert "compiling it again" in err and "RawModule(code=...)" in err
    gpu.clear_kernel_cache()


def _subnormal_products_input():
    """Negative float32 values whose halves are subnormal (or are already):
    a flush to zero makes them -0."""
    tiny = np.finfo(np.float32).tiny
    x = -np.array([tiny, 1.5 * tiny, 1e-39, 2.9e-45, 3e-44, tiny / 3, 1.9 * tiny],
                  dtype=np.float32)
    assert np.all(np.abs(x * np.float32(0.5)) < tiny) and np.all(x * np.float32(0.5) != 0)
    return x


def _leaky_numpy(x):
    return np.where(x > 0, x, np.float32(0.5) * x).astype(np.float32)


@pytest.mark.gpu
def test_a_kernel_keeps_subnormals_on_the_gpu(monkeypatch, tmp_path):
    """On a real GPU: the leaky ReLU's float32 products that are subnormal
    come out as NumPy's, bit for bit (with CuPy's -ftz=true they were -0),
    both from a fresh compile and from the cached binary."""
    cupy = cuda_cupy_or_skip()
    from purine_mpi.gpu import kernels
    monkeypatch.setenv("PURINE_CACHE_DIR", str(tmp_path / "cache"))
    x = _subnormal_products_input()
    for _ in ("compiled", "loaded from the cache"):
        gpu.clear_kernel_cache()
        y = cupy.asnumpy(kernels.relu_forward(cupy.asarray(x), negative_slope=0.5))
        assert np.array_equal(y.view(np.uint32), _leaky_numpy(x).view(np.uint32)), \
            (y, _leaky_numpy(x))
    assert len(list((tmp_path / "cache" / "kernels").glob("activation-*.bin"))) == 1
    gpu.clear_kernel_cache()


def test_the_emulated_device_keeps_its_kernels_out_of_the_users_home(host_build_dir,
                                                                      monkeypatch, tmp_path):
    """A test on the emulated device that sets no $PURINE_CACHE_DIR compiles
    into the build folder, not ~/.cache/purine_mpi/kernels."""
    from tests.emulated_gpu.cupy_module import use_emulated_cupy
    monkeypatch.delenv("PURINE_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    use_emulated_cupy(monkeypatch, host_build_dir)
    gpu.load_kernel("activation")
    assert not (tmp_path / "home").exists()
    assert list((host_build_dir / "purine_cache" / "kernels").glob("activation-*.bin"))
    gpu.clear_kernel_cache()
