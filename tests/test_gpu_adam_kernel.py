"""The Adam and AdamW updates on a GPU: one fused raw kernel (cuda/adam.cu)
that allocates nothing, against the CPU update op.

On the host-compiled kernel (the emulated device) the kernel computes in the
CPU update's order, so the result is the CPU's bit for bit; on a real GPU
(``-m gpu``; fused multiply-adds) within float32/float64 rounding. The
learning rate and the iteration may be host numbers or device blobs (read by
the kernel itself). A GPT step with AdamW allocating nothing in its steady
state is in tests/test_gpt_gpu.py.
"""
import numpy as np
import pytest

from purine_mpi.graph.core import Op
from purine_mpi.ops.catalog import get_kernel_class
from tests.emulated_gpu.helpers import assert_update_matches


def _op(op_type, attrs):
    return get_kernel_class(op_type)(Op("update", op_type, [], [], attrs))


def _state(rng, shape, dtype):
    w = rng.standard_normal(shape).astype(dtype)
    m = (0.1 * rng.standard_normal(shape)).astype(dtype)
    v = np.abs(0.01 * rng.standard_normal(shape)).astype(dtype)
    return [w, m, v]


@pytest.mark.parametrize("op_type", ["AdamUpdate", "AdamWUpdate"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("on_device", [False, True], ids=["host-lr-iter", "device-lr-iter"])
def test_the_adam_kernel_matches_the_cpu_update(device, op_type, dtype, on_device):
    """Four steps (iterations 0, 1, 2 and 1000: the bias corrections change)
    of Adam / AdamW with weight decay, decay_mult, lr_mult and grad_scale:
    the device kernel's w, m, v equal the CPU op's; the update launches the
    fused kernel once and nothing else."""
    attrs = {"momentum": 0.85, "momentum2": 0.995, "delta": 1e-7, "weight_decay": 0.03,
             "decay_mult": 0.5, "lr_mult": 2.0, "grad_scale": 0.25}
    rng = np.random.default_rng(3)
    shape = (37, 5)   # not a multiple of a block: the grid-stride tail
    cpu = _state(rng, shape, dtype)
    dev = [device.to_device(a.copy()) for a in cpu]
    cpu_op, dev_op = _op(op_type, attrs), _op(op_type, attrs)
    for it, lr in ((0, 0.01), (1, 0.02), (2, 0.005), (1000, 0.01)):
        grad = rng.standard_normal(shape).astype(dtype)
        cpu_lr, cpu_it = np.array(lr, np.float32), np.array(it, np.int64)
        cpu_op.run([cpu[0], grad] + cpu[1:] + [cpu_lr, cpu_it], cpu)
        if on_device:
            dev_lr, dev_it = device.to_device(cpu_lr), device.to_device(cpu_it)
        else:
            dev_lr, dev_it = cpu_lr, cpu_it
        device.launched.clear()
        dev_op.run([dev[0], device.to_device(grad)] + dev[1:] + [dev_lr, dev_it], dev)
        assert device.launched == ["adam_update"]
        assert_update_matches(device, dev, cpu, dtype, on_device,
                              f"w, m, v at iteration {it}", tol64=1e-13)


def test_the_adamw_kernel_matches_torch(host_device):
    """The kernel against an independent oracle: torch.optim.AdamW (float64,
    three steps, constant rate), on the host-compiled kernel."""
    torch = pytest.importorskip("torch")
    from purine_mpi.gpu import kernels
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal(50)
    grads = [rng.standard_normal(50) for _ in range(3)]
    w, m, v = w0.copy(), np.zeros(50), np.zeros(50)
    for it, g in enumerate(grads):
        kernels.adam_update(w, g, m, v, 0.01, it, beta1=0.9, beta2=0.99, delta=1e-8,
                            weight_decay=0.1, decoupled=True)
    p = torch.nn.Parameter(torch.tensor(w0))
    opt = torch.optim.AdamW([p], lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
    np.testing.assert_allclose(w, p.detach().numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("op_type", ["AdamUpdate", "AdamWUpdate"])
def test_the_adam_update_allocates_nothing_on_the_device(device, op_type):
    """With the lr and iteration blobs on the device, an update allocates no
    device memory (what a captured iteration that replays needs)."""
    if device.name != "emulated":
        pytest.skip("the allocation log is the emulated device's")
    from tests.emulated_gpu import Allocations
    rng = np.random.default_rng(1)
    dev = [device.to_device(a) for a in _state(rng, (64,), np.float32)]
    grad = device.to_device(rng.standard_normal(64).astype(np.float32))
    lr = device.to_device(np.array(0.01, np.float32))
    it = device.to_device(np.array(4, np.int64))
    op = _op(op_type, {"weight_decay": 0.01})
    op.run([dev[0], grad] + dev[1:] + [lr, it], dev)    # the first run may set up
    Allocations.counting, Allocations.log = True, []
    try:
        op.run([dev[0], grad] + dev[1:] + [lr, it], dev)
    finally:
        Allocations.counting = False
    assert Allocations.log == []
