"""Every cuda/*.cu compiles with nvcc for Ampere (sm_80) and Hopper (sm_90).

Needs nvcc, not a GPU: runs in CI on CPU machines, skipped where nvcc is
missing. Each file is compiled to PTX as the loader would hand it to NVRTC
(with its ``#line`` directive), warnings as errors, and the PTX must export
both dtype entry points (``<func>_f32``, ``<func>_f64``) of every kernel the
Python wrappers launch -- so a missing explicit instantiation fails here, not
on the first GPU run. The 12 compiles run two at a time (~0.5 s each).
"""
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

import purine_mpi.gpu as gpu
from purine_mpi.gpu.kernels import ENTRY_POINTS, PLAIN_ENTRY_POINTS

NVCC = shutil.which("nvcc")
ARCHS = ("sm_80", "sm_90")
SOURCES = sorted(path.stem for path in gpu.CUDA_DIR.glob("*.cu"))
# C++14 (CuPy 14 compiles as C++17: the sources stay C++14-clean).
NVCC_FLAGS = ("-std=c++14", "--ptx", "-Werror", "all-warnings")

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")


def _compile(name, arch, out_dir, extra=None, tag=""):
    """nvcc of cuda/<name>.cu with the loader's options for it
    (``gpu.compile_options``: ``-ftz=false`` included), or ``extra`` instead."""
    extra = gpu.compile_options(name) if extra is None else extra
    # One source file per (name, arch): the two archs of a file compile at the
    # same time, and a shared file could be read by one nvcc while the other
    # thread truncates and rewrites it (an empty PTX, seen in CI).
    source = out_dir / f"{name}.{arch}{tag}.cu"
    source.write_text(gpu.kernel_source(name))   # #line keeps messages on cuda/<name>.cu
    ptx = out_dir / f"{name}.{arch}{tag}.ptx"
    result = subprocess.run([NVCC, f"-arch={arch}", *NVCC_FLAGS, *extra, "-o", str(ptx),
                             str(source)], capture_output=True, text=True)
    text = ptx.read_text() if result.returncode == 0 else ""
    return result.returncode, result.stdout + result.stderr, text


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{(name, arch): (returncode, compiler output, ptx)}, compiled in parallel."""
    out_dir = tmp_path_factory.mktemp("ptx")
    jobs = [(name, arch) for name in SOURCES for arch in ARCHS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {job: pool.submit(_compile, *job, out_dir) for job in jobs}
        return {job: future.result() for job, future in futures.items()}


def test_every_source_is_wrapped():
    assert SOURCES, f"no .cu files in {gpu.CUDA_DIR}"
    assert set(SOURCES) == set(ENTRY_POINTS) | set(PLAIN_ENTRY_POINTS), (
        "cuda/*.cu and purine_mpi.gpu.kernels.(PLAIN_)ENTRY_POINTS disagree")


@pytest.mark.parametrize("name", SOURCES)
def test_sources_have_no_includes(name):
    # NVRTC (CuPy's compiler) has no standard library headers on its path:
    # a source includes only cuda/*.cuh headers, which the loader inlines.
    text = (gpu.CUDA_DIR / f"{name}.cu").read_text()
    for header in re.findall(r'^\s*#\s*include\s*(\S+)', text, re.MULTILINE):
        assert re.fullmatch(r'"\w+\.cuh"', header), f"cuda/{name}.cu includes {header}"
        assert (gpu.CUDA_DIR / header.strip('"')).is_file(), header
    assert not re.search(r"^\s*#\s*include", gpu.kernel_source(name), re.MULTILINE)


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", SOURCES)
def test_compiles_and_exports_entry_points(compiled, name, arch):
    returncode, output, ptx = compiled[(name, arch)]
    assert returncode == 0, f"nvcc -arch={arch} failed on cuda/{name}.cu:\n{output}"
    entries = set(re.findall(r"^\.visible \.entry (\w+)\(", ptx, re.MULTILINE))
    expected = {f"{func}_{suffix}" for func in ENTRY_POINTS.get(name, ())
                for suffix in ("f32", "f64")}
    expected |= set(PLAIN_ENTRY_POINTS.get(name, ()))
    assert expected <= entries, f"missing entry points: {sorted(expected - entries)}"


#: a float32 fused multiply-add in PTX (the float64 kernels' ``pow`` from
#: libdevice has fma.rn.f64 of its own, written out, whatever the option)
_FMA = re.compile(r"^\s*fma\.rn\.f32\b", re.MULTILINE)


@needs_nvcc
@pytest.mark.parametrize("name", sorted(gpu.SOURCE_OPTIONS))
def test_the_solver_updates_round_every_operation(compiled, name, tmp_path):
    """The solver updates compile with ``--fmad=false`` (the loader's
    SOURCE_OPTIONS): no float32 fused multiply-add in their PTX, so each product
    rounds as the CPU update's does and adam_update and adam_multi agree to
    the bit (they did not on an H200 with contraction). Compiled without
    the option, the same source has fused multiply-adds: the check can fail."""
    _, _, ptx = compiled[(name, "sm_90")]
    assert ptx and not _FMA.search(ptx), f"cuda/{name}.cu: fma in the PTX"
    returncode, output, contracted = _compile(name, "sm_90", tmp_path, extra=(), tag=".fmad")
    assert returncode == 0, output
    assert _FMA.search(contracted), f"cuda/{name}.cu has no fma even with contraction"


#: a float32 instruction that flushes subnormals (add.ftz.f32, setp.lt.ftz.f32, ...);
#: not libdevice's approximations (ex2.approx.ftz.f32, rcp.approx.ftz.f32 inside
#: expf and division: there with -ftz=false too, on arguments it scaled itself)
_FTZ = re.compile(r"^\s*(?![\w.]*approx)[\w.]*\.ftz\.[\w.]*f32\b", re.MULTILINE)


@needs_nvcc
def test_no_source_flushes_subnormals(compiled, tmp_path):
    """With the loader's options (``-ftz=false``, gpu.COMMON_OPTIONS) no
    float32 instruction of any source flushes subnormals to zero, as NumPy
    keeps them; compiled with CuPy's ``-ftz=true`` (what a RawModule adds
    after the caller's options) the activations do: the check can fail."""
    flushing = [name for (name, arch), (_, _, ptx) in compiled.items()
                if arch == "sm_90" and _FTZ.search(ptx)]
    assert not flushing, f"flush-to-zero float32 instructions in the PTX of {flushing}"
    returncode, output, ptx = _compile("activation", "sm_90", tmp_path,
                                       extra=("-ftz=false", "-ftz=true"), tag=".ftz")
    assert returncode == 0, output
    assert _FTZ.search(ptx), "-ftz=true gave no .ftz.f32 instruction in cuda/activation.cu"
