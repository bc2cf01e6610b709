"""The Nesterov, AdaGrad, RMSProp and AdaDelta updates on a GPU: one raw
kernel (cuda/adaptive.cu) that allocates nothing, against the CPU update op.

On the host-compiled kernel (the emulated device) the kernel computes in the
CPU update's order, so a float32 result is the CPU's bit for bit; on a real
GPU (``-m gpu``; fused multiply-adds) within rounding. Before this kernel
those updates were CuPy element-wise arithmetic, whose temporaries were
allocated every iteration (also inside a captured CUDA graph)."""
import numpy as np
import pytest

from purine_mpi.graph.core import Op
from purine_mpi.ops.catalog import get_kernel_class
from purine_mpi.ops.updates import SOLVER_UPDATES
from tests.emulated_gpu.helpers import assert_update_matches

KINDS = ["nesterov", "adagrad", "rmsprop", "adadelta"]


def _op(op_type, attrs):
    return get_kernel_class(op_type)(Op("update", op_type, [], [], attrs))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("on_device", [False, True], ids=["host-lr", "device-lr"])
def test_the_adaptive_kernel_matches_the_cpu_update(device, kind, dtype, on_device):
    """Four steps with weight decay, decay_mult, lr_mult and grad_scale:
    the kernel's weight and states equal the CPU op's; the update launches
    the fused kernel once and nothing else."""
    op_type, states = SOLVER_UPDATES[kind]
    attrs = {"momentum": 0.85, "rms_decay": 0.93, "delta": 1e-6, "weight_decay": 0.03,
             "decay_mult": 0.5, "lr_mult": 2.0, "grad_scale": 0.25}
    rng = np.random.default_rng(KINDS.index(kind))
    shape = (37, 5)   # not a multiple of a block: the grid-stride tail
    cpu = [rng.standard_normal(shape).astype(dtype)] + \
        [np.abs(0.1 * rng.standard_normal(shape)).astype(dtype) for _ in states]
    dev = [device.to_device(a.copy()) for a in cpu]
    w0 = cpu[0].copy()
    cpu_op, dev_op = _op(op_type, attrs), _op(op_type, attrs)
    for lr in (0.01, 0.02, 0.005, 0.01):
        grad = rng.standard_normal(shape).astype(dtype)
        cpu_lr = np.array(lr, np.float32)
        cpu_op.run([cpu[0], grad] + cpu[1:] + [cpu_lr], cpu)
        dev_lr = device.to_device(cpu_lr) if on_device else cpu_lr
        device.launched.clear()
        dev_op.run([dev[0], device.to_device(grad)] + dev[1:] + [dev_lr], dev)
        assert device.launched == ["adaptive_update"]
        assert_update_matches(device, dev, cpu, dtype, on_device, f"{kind}, lr {lr}")
    assert not np.allclose(cpu[0], w0)   # the steps moved the weights


@pytest.mark.parametrize("kind", KINDS)
def test_the_adaptive_update_allocates_nothing_on_the_device(device, kind):
    """With the lr blob on the device, an update allocates no device memory
    (what a captured iteration that replays needs)."""
    if device.name != "emulated":
        pytest.skip("the allocation log is the emulated device's")
    from tests.emulated_gpu import Allocations
    op_type, states = SOLVER_UPDATES[kind]
    rng = np.random.default_rng(1)
    dev = [device.to_device(np.abs(rng.standard_normal(64)).astype(np.float32))
           for _ in range(1 + len(states))]
    grad = device.to_device(rng.standard_normal(64).astype(np.float32))
    lr = device.to_device(np.array(0.01, np.float32))
    op = _op(op_type, {"weight_decay": 0.01, "momentum": 0.9})
    op.run([dev[0], grad] + dev[1:] + [lr], dev)    # the first run may set up
    Allocations.counting, Allocations.log = True, []
    try:
        op.run([dev[0], grad] + dev[1:] + [lr], dev)
    finally:
        Allocations.counting = False
    assert Allocations.log == []


def test_a_wrong_kind_or_state_count_is_refused(device):
    from purine_mpi.gpu import kernels
    w = device.to_device(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="kind must be one of"):
        kernels.adaptive_update("adamax", w, w, [w], 0.1)
    with pytest.raises(ValueError, match="adadelta keeps 2 state"):
        kernels.adaptive_update("adadelta", w, w, [w], 0.1)
