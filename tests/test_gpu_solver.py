"""The solver on the device: the lr policy evaluated from the iteration blob
(cuda/lr_policy.cu) against the host formula, for every policy, on the
host-compiled kernel (and a real GPU when there is one)."""
import numpy as np
import pytest

from purine_mpi.gpu import kernels
from purine_mpi.graph.core import Op
from purine_mpi.kernels import get_kernel_class
from purine_mpi.ops.solver import LR_POLICIES, LR_POLICY_CODES, learning_rate, lr_policy_args
from tests.test_gpu_kernels import backend  # noqa: F401  (the host/cupy fixture)

POLICY_ATTRS = {
    "fixed": {},
    "step": {"gamma": 0.5, "stepsize": 7},
    "multistep": {"gamma": 0.3, "stepvalues": [3, 11, 40]},
    "exp": {"gamma": 0.97},
    "inv": {"gamma": 1e-2, "power": 0.75},
    "sigmoid": {"gamma": -0.2, "stepsize": 20},
    "poly": {"power": 1.7, "max_iter": 50},
    "cosine": {"max_iter": 50, "min_lr": 1e-3},
}
ITERATIONS = [0, 1, 2, 3, 6, 7, 8, 10, 11, 13, 20, 39, 40, 49, 50, 51, 77, 1000, (1 << 33) + 5]


def test_every_policy_is_covered():
    assert set(POLICY_ATTRS) == set(LR_POLICIES) == set(LR_POLICY_CODES)


def _device_rate(backend, attrs, iteration, device_iter):  # noqa: F811
    args = lr_policy_args(attrs)
    args["steps"] = backend.to_device(np.asarray(args["steps"] or [0], np.int64))
    out = backend.to_device(np.full((), np.nan, np.float32))
    it = backend.to_device(np.asarray(iteration, np.int64)) if device_iter else iteration
    kernels.learning_rate(it, out, **args)
    return backend.to_host(out)


@pytest.mark.parametrize("warmup", [0, 5])
@pytest.mark.parametrize("policy", sorted(POLICY_ATTRS))
def test_lr_policy_on_the_device_matches_the_host_formula(backend, policy, warmup):  # noqa: F811
    """The float32 lr equals the host formula rounded to float32: bit for bit
    on the host-compiled kernel (same libm), to one float32 ulp on a GPU
    (CUDA's pow/exp/cos are within 2 ulp in double)."""
    attrs = {"base_lr": 0.1, "lr_policy": policy, **POLICY_ATTRS[policy]}
    if warmup:
        attrs.update(warmup_iters=warmup, warmup_start_factor=0.2)
    want = np.array([np.float32(learning_rate(attrs, it)) for it in ITERATIONS])
    got = np.array([_device_rate(backend, attrs, it, device_iter=k % 2 == 0)
                    for k, it in enumerate(ITERATIONS)])
    if backend.name == "host":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=2 ** -22, atol=0)
    assert len(set(want.tolist())) > (1 if policy != "fixed" or warmup else 0)


def test_lr_op_on_emulated_device_reads_the_iteration_blob(monkeypatch, host_build_dir):
    """The LearningRate op with device blobs: its setup uploads the policy's
    constants once; each run reads the iteration from the device blob."""
    import sys
    import purine_mpi.backend as backend_module
    import purine_mpi.gpu as gpu
    from tests.test_gpu_backend import DeviceArray, _emulated_cupy
    gpu.clear_kernel_cache()
    fake = _emulated_cupy(host_build_dir)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(backend_module, "_cupy", fake)
    attrs = {"base_lr": 0.1, "lr_policy": "multistep", "gamma": 0.1, "stepvalues": [2, 4]}
    k = get_kernel_class("LearningRate")(Op("lr", "LearningRate", [], [], attrs))
    it = np.zeros((), np.int64).view(DeviceArray)
    lr = np.zeros((), np.float32).view(DeviceArray)
    k.setup([it], [lr])
    try:
        for i in range(6):
            it[...] = i
            k.run([it], [lr])
            assert float(lr) == np.float32(learning_rate(attrs, i))
    finally:
        gpu.clear_kernel_cache()
