"""The emulated GPU of the tests: a stand-in for CuPy on a machine without
a GPU (docs/gpu.md, "The emulated device").

- ``capture``: what a CUDA stream capture allows and refuses, with CuPy's
  exceptions and messages, word for word;
- ``arrays``: ``DeviceArray`` (a NumPy array standing for a CuPy array),
  the allocation log;
- ``host_kernels``: the ``cuda/*.cu`` kernels compiled for the host, a host
  cuBLAS and the emulated ``nvmath.bindings.cublas``;
- ``cublaslt``: the emulated ``nvmath.bindings.cublasLt`` (installed with
  the emulated ``nvmath.bindings.cublas``: gpu/blaslt.py's epilogues);
- ``cupy_module``: the stand-in ``cupy`` module (``use_emulated_cupy``);
- ``device``: the simulated device: asynchronous streams, events, capture,
  graphs and their replays;
- ``cudnn``: the emulated cuDNN frontend (``pygraph``), on streams and in
  captures;
- ``runtime``: the stand-in ``cupy.cuda`` namespace (``cuda_namespace``:
  ``Stream``, ``Event``, ``Device``, ``MemoryPool``, ``using_allocator``,
  ``get_elapsed_time``; ``cupy.cuda.nccl`` belongs there too, when it is
  emulated) and ``SimulatedRuntime``, the project's ``CudaRuntime`` on the
  simulated device plus the logs and knobs the tests need;
- ``helpers`` and ``fixtures``: what the GPU tests share (the fixtures
  ``device``, ``backend`` and ``host_device`` are a pytest plugin,
  registered in tests/conftest.py);
- ``train``: a job trained on the emulated device in a process of its own
  (``python -m tests.emulated_gpu.train``, one BLAS thread).
"""
from .arrays import SYNC_COPIES, Allocations, DeviceArray
from .capture import CUDARuntimeError
from .cupy_module import MEMCPY_LOG, emulated_cupy, pinned_range, use_emulated_cupy
from .device import SimEvent, SimGraph, SimStream, check_order, cpu_workspace, log_kernels
from .runtime import SimulatedRuntime
from .helpers import compare, emulated_gpu_env, emulated_trainer_env, init_params, net_config, \
    on_device, reporting_raw, run_graph_on_gpu, run_kernel, tiny_config, tiny_raw, train_simulated
from .host_kernels import HostCublas, host_cupy, use_emulated_nvmath

__all__ = ["SYNC_COPIES", "Allocations", "DeviceArray", "CUDARuntimeError", "MEMCPY_LOG",
           "emulated_cupy", "pinned_range", "use_emulated_cupy", "SimEvent", "SimGraph", "SimStream",
           "SimulatedRuntime", "check_order", "cpu_workspace", "log_kernels", "compare",
           "emulated_gpu_env", "emulated_trainer_env", "init_params", "net_config", "on_device", "reporting_raw", "run_graph_on_gpu", "run_kernel",
           "tiny_config", "tiny_raw", "train_simulated", "HostCublas", "host_cupy",
           "use_emulated_nvmath"]
