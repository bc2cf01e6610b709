"""Dropout's bit-packed mask on the GPU path (issue 45; activation
recompute's ``packed_mask``, ops/dropout.py): the forward writes the bits
and the backward (``DropoutGrad``, and the recompute copy
``DropoutReplay``) reads them in one kernel each (cuda/dropout.cu
``dropout_forward_packed``, ``dropout_backward_packed``,
``dropout_backward_packed_copy_f32``), so no float or unpacked mask is made
on the device. Before, the GPU path allocated a float mask, a bool array
and the bits in the forward and an unpacked uint8 array and a float mask in
the backward, every iteration, none of it in the plan: a CUDA-graph
capture of such a graph failed at the first packed Dropout and the whole
iteration ran eagerly.

- the kernels bit for bit against an independent NumPy reference (each bit
  found by its byte and shift, np.packbits' big bit order), against the
  unpack-then-multiply path on the device and against the CPU op: float32,
  float64 and float32 with the bfloat16 bits copy (bf16 storage's
  ``bits_copy``), sizes not a multiple of 8, dx over dy, inf and NaN in dy;
- a 2-block GPT with dropout under ``recompute: full`` on the emulated
  device (fp32, and bf16 with bits storage): the iteration is captured as a
  CUDA graph, a steady iteration allocates nothing, and the weights are
  those without recompute (the redrawn masks), bit for bit.
"""
import numpy as np
import pytest

from purine_mpi.base.philox import dropout_keys, keep_mask
from purine_mpi.graph.core import Op
from purine_mpi.ops.catalog import get_kernel_class
from tests.emulated_gpu import Allocations, DeviceArray, SimulatedRuntime
from tests.gpu_reference import same_bits_any_nan

RATIO = 0.3
SHAPES = [(37,), (3, 5, 7), (2, 8)]


def _dev(a):
    return np.array(a).view(DeviceArray)


def _reference_backward(dy, bits, ratio):
    """(dy * bit_i) * scale in dy's dtype, bit_i read from byte i // 8,
    bit 7 - i % 8 (np.packbits' order), written independently of the code
    under test."""
    flat = dy.reshape(-1)
    i = np.arange(flat.size)
    bit = (bits.reshape(-1)[i // 8].astype(np.int64) >> (7 - i % 8)) & 1
    scale = dy.dtype.type(1.0 / (1.0 - ratio))
    with np.errstate(invalid="ignore"):   # inf * 0
        return ((flat * bit.astype(dy.dtype)) * scale).reshape(dy.shape)


def _bf16_bits_reference(x):
    """The bits of the bfloat16 nearest each float32 (ties to even; NaN
    kept a quiet NaN with its top bits), by integer arithmetic."""
    u = x.reshape(-1).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x.reshape(-1))
    rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded.reshape(x.shape)


def _inputs(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    dy = rng.standard_normal(shape).astype(dtype)
    flat = dy.reshape(-1)
    flat[0], flat[-1] = np.inf, np.nan   # inf * 0 and NaN * 0: NaN, as the float mask gives
    flat[1] = -0.0
    keep = rng.random(flat.size) >= RATIO
    keep[:2] = [False, True]
    return dy, keep.reshape(shape), np.packbits(keep)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_packed_backward_kernel_is_the_unpacked_product(device, shape, dtype):
    from purine_mpi.gpu import kernels
    on, back = device.to_device, device.to_host
    dy, keep, bits = _inputs(shape, dtype, 1)
    want = _reference_backward(dy, bits, RATIO)
    with np.errstate(invalid="ignore"):
        assert not same_bits_any_nan(want, dy * keep)   # the scale and the mask both show
    got = kernels.dropout_backward_packed(on(dy), on(bits), RATIO)
    unpacked = kernels.dropout_backward(on(dy), on(keep.astype(dtype)), RATIO)
    assert same_bits_any_nan(back(got), want) and same_bits_any_nan(back(unpacked), want)
    inplace = on(dy)   # dx over dy (DropoutGrad's in_place)
    kernels.dropout_backward_packed(inplace, on(bits), RATIO, out=inplace)
    assert same_bits_any_nan(back(inplace), want)
    assert device.launched.count("dropout_backward_packed") == 2


@pytest.mark.parametrize("shape", SHAPES)
def test_the_packed_backward_copy_kernel_writes_the_bf16_bits(device, shape):
    from purine_mpi.gpu import kernels
    on, back = device.to_device, device.to_host
    dy, keep, bits = _inputs(shape, np.float32, 2)
    want = _reference_backward(dy, bits, RATIO)
    dx, copy = on(np.full(shape, 7, np.float32)), on(np.zeros(shape, np.uint16))
    kernels.dropout_backward_packed(on(dy), on(bits), RATIO, out=dx, copy=copy)
    assert device.launched == ["dropout_backward_packed_copy_f32"]
    assert same_bits_any_nan(back(dx), want)
    assert same_bits_any_nan(back(copy), _bf16_bits_reference(want))
    dx2, copy2 = on(np.zeros(shape, np.float32)), on(np.zeros(shape, np.uint16))
    kernels.dropout_backward(on(dy), on(keep.astype(np.float32)), RATIO, out=dx2,
                             copy=copy2)
    assert same_bits_any_nan(back(dx2), back(dx)) and same_bits_any_nan(back(copy2), back(copy))


def test_the_packed_kernels_refuse_a_wrong_mask(device):
    from purine_mpi.gpu import kernels
    with pytest.raises(ValueError, match="packed mask of 37 elements is a C-contiguous uint8 "
                                         "array of 5 bytes"):
        kernels.dropout_backward_packed(device.to_device(np.zeros(37, np.float32)),
                                        device.to_device(np.zeros(4, np.uint8)), RATIO)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_packed_forward_kernel_draws_dropouts_mask(device, shape, dtype):
    """y as ``dropout_forward``'s and the bits np.packbits of the host's
    Philox keep-mask (base/philox.keep_mask), the padding bits 0."""
    from purine_mpi.gpu import kernels
    on, back = device.to_device, device.to_host
    x = np.random.default_rng(3).standard_normal(shape).astype(dtype)
    key0, key1, ctr1 = dropout_keys(5, "l.drop")
    it = 11
    keep = keep_mask(shape, RATIO, key0, key1, ctr1, it)
    y, bits = kernels.dropout_forward_packed(on(x), on(np.array([it], np.int64)), RATIO,
                                             key0, key1, ctr1)
    y_ref, mask = kernels.dropout_forward(on(x), it, RATIO, key0, key1, ctr1)
    y, bits, y_ref, mask = back(y), back(bits), back(y_ref), back(mask)
    assert np.array_equal(bits, np.packbits(keep.reshape(-1)))
    assert np.array_equal(mask.astype(bool), keep)
    assert same_bits_any_nan(y, y_ref)
    assert same_bits_any_nan(y, ((x * keep.astype(dtype)) * dtype(1 / (1 - RATIO))))


def _op_kernel(op_type, attrs):
    kernel = get_kernel_class(op_type)(Op("l.drop", op_type, [], [], dict(attrs)))
    return kernel


@pytest.mark.parametrize("copy", [False, True])
def test_the_packed_ops_on_the_device_are_the_cpu_ops(emulated, copy):
    """Dropout (packed_mask), DropoutGrad (packed_mask, with and without
    bits_copy) and DropoutReplay on the emulated device write the CPU ops'
    bits; the device ops allocate nothing."""
    shape = (3, 5, 7)
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    dy = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    it = np.array(2, np.int64)
    n_bits = (-(-x.size // 8),)

    def run(device):
        conv = _dev if device else np.array
        fwd = _op_kernel("Dropout", {"ratio": RATIO, "packed_mask": True, "seed": 9})
        y, bits = conv(np.zeros(shape, np.float32)), conv(np.zeros(n_bits, np.uint8))
        grad_attrs = {"ratio": RATIO, "packed_mask": True}
        outs = [conv(np.zeros(shape, np.float32))]
        if copy:
            grad_attrs["bits_copy"] = [0]
            outs.append(conv(np.zeros(shape, np.uint16)))
        grad = _op_kernel("DropoutGrad", grad_attrs)
        replay = _op_kernel("DropoutReplay", {"ratio": RATIO})
        y2 = conv(np.zeros(shape, np.float32))
        Allocations.log, Allocations.counting = [], device
        try:
            fwd.run([conv(x), conv(it.reshape(1)) if device else it], [y, bits])
            grad.run([conv(dy), bits], outs)
            replay.run([conv(x), bits], [y2])
        finally:
            Allocations.counting = False
        assert not device or Allocations.log == [], Allocations.log
        return [np.array(a) for a in [y, bits, y2] + outs]

    host, device = run(False), run(True)
    assert all(same_bits_any_nan(h, d) for h, d in zip(host, device))
    y, bits, y2, dx = host[:4]
    assert same_bits_any_nan(y2, y) and same_bits_any_nan(dx, _reference_backward(dy, bits, RATIO))
    if copy:
        assert same_bits_any_nan(host[4], _bf16_bits_reference(dx))


# ------------------------------------------- a captured iteration, recompute
def _gpt_on_the_emulated_device(monkeypatch, precision, recompute, cuda_graph, iters=3):
    """The 2-block raw-attention GPT with dropout 0.2 (its attention and
    residual Dropout ops) ``iters`` AdamW steps on the emulated device;
    returns (graph, the dispatcher's notes, the allocations of the last
    iteration, {param: weights after})."""
    from purine_mpi.base.backend import to_numpy
    from purine_mpi.graph.recompute import add_recompute
    from purine_mpi.parallel.placement import prepare_for_device
    from purine_mpi.runtime.factory import make_dispatcher
    from tests.emulated_gpu.helpers import fill
    from tests.gpt_oracle import gpt_graph, gpt_net
    from tests.test_attention_dropout import _layers
    from tests.test_precision import SOLVER
    monkeypatch.setenv("PURINE_BF16_STORAGE", "1")
    net = gpt_net(vocab=16, width=16, heads=2, blocks=2, max_length=8, approximate="tanh",
                  dropout=0.2, fused=False)
    g, _, _ = gpt_graph(net, dict(SOLVER, max_iter=iters), 2, 8)
    add_recompute(g, recompute, _layers(net))
    prepare_for_device(g, 0, precision=precision)
    notes = []
    d = make_dispatcher(g, runtime=SimulatedRuntime(1), seed=1, cuda_graph=cuda_graph,
                        log=notes.append)
    tokens = np.random.default_rng(3).integers(0, 16, (iters, 2, 9))
    try:
        for p in g.params():
            d.workspace.set(p.name, fill(p, 1))
        for it in range(iters):
            d.workspace.set("data", tokens[it, :, :-1].astype(np.int32))
            d.workspace.set("label", tokens[it, :, 1:].astype(np.int32))
            d.workspace["iter"][...] = it
            Allocations.log, Allocations.counting = [], it == iters - 1
            try:
                d.run(it)
            finally:
                Allocations.counting = False
        log = list(Allocations.log)
        weights = {p.name: np.array(to_numpy(d.workspace[p.name])) for p in g.params()}
        return g, notes, log, weights
    finally:
        d.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_recompute_iteration_with_packed_masks_is_captured_and_allocates_nothing(
        emulated, monkeypatch, precision):
    """Before: 'could not capture graph0 (...) (op 'h0_attn.attn_drop'
    (Dropout): RuntimeError: allocation during a stream capture ...:
    empty_like)', and the steady eager iteration allocated the float mask,
    the bools and bits of each packed Dropout and the unpacked bytes and
    float mask of each DropoutGrad and DropoutReplay."""
    g, notes, log, full = _gpt_on_the_emulated_device(monkeypatch, precision, "full", True)
    packed = [op for op in g.ops.values() if op.attrs.get("packed_mask")]
    assert {op.op_type for op in packed} == {"Dropout", "DropoutGrad"} and len(packed) == 12
    assert any(op.op_type == "DropoutReplay" for op in g.ops.values())
    if precision == "bf16":
        assert any(op.attrs.get("bits_copy") for op in packed)   # the _copy_f32 kernel
    assert not [n for n in notes if "could not capture" in n], notes
    assert log == [], f"device allocations in a steady captured iteration: {log}"
    _, _, eager_log, eager = _gpt_on_the_emulated_device(monkeypatch, precision, "full", False)
    assert eager_log == [], eager_log
    _, _, _, none = _gpt_on_the_emulated_device(monkeypatch, precision, "none", True)
    assert sorted(none) == sorted(full) == sorted(eager) and len(none) > 10
    assert [k for k in none if not (same_bits_any_nan(none[k], full[k]) and
                                    same_bits_any_nan(none[k], eager[k]))] == []


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_packed_kernels_cover_more_than_their_grid(device, monkeypatch, dtype):
    """review (rmisc): a grid of one block (``_MAX_BLOCKS`` 1: 256 threads)
    over 6,149 elements (769 bytes, a tail of 5 bits): the forward's
    grid-stride loop over bytes (4 rounds) and the backward's over elements
    (25 rounds) reach every element and byte, as the launch over 2**25 + 3
    elements on the real grid of 65,535 x 256 threads must (2**22 + 1 bytes
    in 1 round: the forward's loop is only taken past 2**27 elements)."""
    from purine_mpi.gpu import kernels
    from purine_mpi.gpu.kernels import base
    monkeypatch.setattr(base, "_MAX_BLOCKS", 1)
    on, back = device.to_device, device.to_host
    n = 8 * 256 * 3 + 5
    x = np.random.default_rng(4).standard_normal(n).astype(dtype)
    key0, key1, ctr1 = dropout_keys(6, "l.drop")
    keep = keep_mask((n,), RATIO, key0, key1, ctr1, 9)
    y, bits = kernels.dropout_forward_packed(on(x), on(np.array([9], np.int64)), RATIO,
                                             key0, key1, ctr1)
    assert np.array_equal(back(bits), np.packbits(keep))
    assert same_bits_any_nan(back(y), (x * keep.astype(dtype)) * dtype(1 / (1 - RATIO)))
    dy = np.random.default_rng(5).standard_normal(n).astype(dtype)
    dx = kernels.dropout_backward_packed(on(dy), on(np.packbits(keep)), RATIO)
    assert same_bits_any_nan(back(dx), _reference_backward(dy, np.packbits(keep), RATIO))


def test_float16_packed_ops_on_the_device_take_the_generic_path(emulated):
    """review (rmisc): float16, which no raw dropout kernel takes
    (gpu/raw.raw_kernels), keeps the path before the packed kernels on a
    device: the CPU ops' bits, with a float mask allocated by the forward
    and an unpacked one by the gradient and the copy (docs/running.md says
    so: such an iteration is not captured)."""
    shape = (3, 5, 7)
    x = np.random.default_rng(6).standard_normal(shape).astype(np.float16)
    dy = np.random.default_rng(7).standard_normal(shape).astype(np.float16)
    it = np.array(4, np.int64)

    def run(device):
        conv = _dev if device else np.array
        fwd = _op_kernel("Dropout", {"ratio": RATIO, "packed_mask": True, "seed": 9})
        grad = _op_kernel("DropoutGrad", {"ratio": RATIO, "packed_mask": True})
        replay = _op_kernel("DropoutReplay", {"ratio": RATIO})
        y, bits = conv(np.zeros(shape, np.float16)), conv(np.zeros((14,), np.uint8))
        dx, y2 = conv(np.zeros(shape, np.float16)), conv(np.zeros(shape, np.float16))
        Allocations.log, Allocations.counting = [], device
        try:
            fwd.run([conv(x), conv(it.reshape(1)) if device else it], [y, bits])
            grad.run([conv(dy), bits], [dx])
            replay.run([conv(x), bits], [y2])
        finally:
            Allocations.counting = False
        return [np.array(a) for a in (y, bits, dx, y2)], list(Allocations.log)

    (host, _), (device, allocated) = run(False), run(True)
    assert all(same_bits_any_nan(h, d) for h, d in zip(host, device))
    y, bits, dx, y2 = host
    assert same_bits_any_nan(y2, y) and same_bits_any_nan(dx, _reference_backward(dy, bits, RATIO))
    assert allocated, "float16 took an allocation-free path: say so in docs/running.md"
