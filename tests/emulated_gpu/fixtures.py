"""Fixtures of the emulated device (a plugin module: a test module imports
the fixtures it uses, ``from tests.emulated_gpu.fixtures import device``).

- ``device``: where an op's GPU branch runs (the emulated CuPy, or real
  CuPy on a GPU); records the raw kernels launched;
- ``backend``: where the raw kernels run (host-compiled, or real CuPy);
- ``host_device``: the host-compiled kernels as ``cupy``, no GPU twin;
- ``emulated``: the emulated ``cupy`` (``use_emulated_cupy``), no GPU twin;
  yields the stand-in module."""
import sys

import numpy as np
import pytest

import purine_mpi.gpu as gpu
from purine_mpi.gpu import kernels
from tests.conftest import cuda_cupy_or_skip

from .cupy_module import use_emulated_cupy
from .arrays import DeviceArray
from .host_kernels import host_cupy, keep_kernels_in, use_emulated_nvmath


class Device:
    def __init__(self, name, to_device, to_host):
        self.name, self.to_device, self.to_host = name, to_device, to_host


@pytest.fixture(params=["emulated", pytest.param("cupy", marks=pytest.mark.gpu)])
def device(request, monkeypatch):
    """Where the op's GPU branch runs; records the raw kernels launched."""
    gpu.clear_kernel_cache()
    launched = []
    real_launch = kernels.base._launch

    def spy(source, func, dtype, total, args):
        launched.append(func)
        return real_launch(source, func, dtype, total, args)

    monkeypatch.setattr(kernels.base, "_launch", spy)
    real_blocks = kernels.base._launch_blocks

    def spy_blocks(source, func, dtype, blocks, threads, args):
        launched.append(func)
        return real_blocks(source, func, dtype, blocks, threads, args)

    monkeypatch.setattr(kernels.base, "_launch_blocks", spy_blocks)
    from purine_mpi.ops import conv as conv_ops
    real_cudnn_run = conv_ops._cudnn_run

    def spy_cudnn(kernel, scratch, arrays):   # a convolution that cuDNN took
        launched.extend(["cudnn", "cudnn_epilogue"] if kernel._plan.fused else ["cudnn"])
        return real_cudnn_run(kernel, scratch, arrays)

    monkeypatch.setattr(conv_ops, "_cudnn_run", spy_cudnn)
    if request.param == "cupy":
        cupy = cuda_cupy_or_skip()
        dev = Device("cupy", cupy.asarray, cupy.asnumpy)
    else:
        use_emulated_cupy(monkeypatch, request.getfixturevalue("host_build_dir"))
        dev = Device("emulated", lambda a: np.array(a).view(DeviceArray), np.asarray)
    dev.launched = launched
    yield dev
    gpu.clear_kernel_cache()


class Backend:
    def __init__(self, name, to_device, to_host):
        self.name, self.to_device, self.to_host = name, to_device, to_host


@pytest.fixture(params=["host", pytest.param("cupy", marks=pytest.mark.gpu)])
def backend(request, monkeypatch):
    """Where the kernels run; on the host, gemm goes through the emulated
    nvmath cuBLAS (``use_emulated_nvmath``)."""
    gpu.clear_kernel_cache()
    if request.param == "cupy":
        cupy = cuda_cupy_or_skip()
        yield Backend("cupy", cupy.asarray, cupy.asnumpy)
    else:
        build_dir = request.getfixturevalue("host_build_dir")
        keep_kernels_in(monkeypatch, build_dir)
        monkeypatch.setitem(sys.modules, "cupy", host_cupy(build_dir))
        use_emulated_nvmath(monkeypatch)
        yield Backend("host", np.array, np.asarray)
    gpu.clear_kernel_cache()


@pytest.fixture
def host_device(host_build_dir, monkeypatch):
    """The host backend without the ``backend`` fixture's GPU twin."""
    gpu.clear_kernel_cache()
    keep_kernels_in(monkeypatch, host_build_dir)
    monkeypatch.setitem(sys.modules, "cupy", host_cupy(host_build_dir))
    yield
    gpu.clear_kernel_cache()


@pytest.fixture
def emulated(monkeypatch, host_build_dir):
    """The emulated CuPy as ``cupy`` (``use_emulated_cupy``), no GPU twin:
    the stand-in module."""
    fake = use_emulated_cupy(monkeypatch, host_build_dir)
    yield fake
    gpu.clear_kernel_cache()
