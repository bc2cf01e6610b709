"""bf16 storage (parallel/precision.store_bits; docs/gpu.md, "Precision"):
a bfloat16 blob whose every reader takes bfloat16 bits (the fully connected
products' operands) is stored as the uint16 bits of its values, written so
by its producer, and the products take it as it is.

- each bits-writing kernel (the Cast; the host and the device paths)
  against NumPy's rounding (base/precision._round_bits), bit for bit;
- the fc ops on bits operands equal the float32 path bit for bit, also
  where GemmEx is refused (the bits widened);
- the pass stores what it should in the 2-block GPT and nothing where a
  reader cannot take bits, nothing with PURINE_BF16_STORAGE=0;
- the bf16 GPT trained a few steps on the emulated device, captured in CUDA
  graphs, gives the same losses and weights bit for bit with and without
  bits storage, with fewer conversion and rounding launches a step.
"""
import collections

import numpy as np
import pytest

from purine_mpi.base.precision import _round_bits
from purine_mpi.graph.core import Op
from purine_mpi.ops.registry import make_kernel
from tests.emulated_gpu.fixtures import device  # noqa: F401
from tests.test_precision_device import _adversarial

BF16 = "bfloat16"


def _numpy_bits(x):
    """The uint16 bits of the bfloat16 nearest each float32 of ``x``: the
    upper halves of base/precision._round_bits (NumPy)."""
    bits = x.copy().view(np.uint32)
    _round_bits(np, bits, np.empty_like(bits), np.empty_like(bits))
    return (bits >> np.uint32(16)).astype(np.uint16)


def _cast(bits=True):
    return make_kernel(Op("c", "Cast", ["x"], ["y"], dict({"dtype": BF16},
                                                         **({"bits_out": [0]} if bits else {}))))


@pytest.mark.parametrize("n", [1, 3, 4, 4097])
def test_the_cast_writes_numpys_bf16_bits_in_one_launch(device, n):
    """A Cast with ``bits_out`` writes the bits of the bfloat16 nearest each
    value (ties to even, infinities and NaNs truncated: base/precision's
    rounding) in one to_bf16_bits launch, odd lengths too; the host path
    (NumPy arrays) the same bits."""
    x = np.resize(_adversarial(), (2, n))
    want = _numpy_bits(x)
    k = _cast()
    src, dst = device.to_device(x), device.to_device(np.zeros(x.shape, np.uint16))
    k.setup([src], [dst])
    device.launched.clear()
    k.run([src], [dst])
    assert device.launched == ["to_bf16_bits"]
    np.testing.assert_array_equal(np.asarray(device.to_host(dst)), want)
    np.testing.assert_array_equal(np.asarray(device.to_host(src)).view(np.uint32),
                                  x.view(np.uint32))   # the source unchanged
    host = np.zeros(x.shape, np.uint16)
    k.run([x.copy()], [host])
    np.testing.assert_array_equal(host, want)


def test_the_cast_infers_bits_storage_only_with_bits_out():
    from purine_mpi.ops.basic import Cast
    assert Cast.infer({"dtype": BF16, "bits_out": [0]}, [((3, 4), "float32")]) == [((3, 4),
                                                                                   "uint16")]
    assert Cast.infer({"dtype": BF16}, [((3, 4), "float32")]) == [((3, 4), "float32")]
    assert Cast.bits_outputs({"dtype": "float16"}) == ()


def _fc(**extra):
    attrs = {"num_output": 6, "compute_dtype": BF16}
    return (make_kernel(Op("fc", "InnerProduct", ["x", "w"], ["y"], attrs)),
            make_kernel(Op("fd", "InnerProductGradData", ["dy", "w"], ["dx"],
                           dict(attrs, x_shape=[10, 3, 4]))),
            make_kernel(Op("fw", "InnerProductGradWeight", ["dy", "x"], ["dw"], attrs)))


def _run(device, kernels, x, w, dy):
    fc, fd, fw = kernels
    on = [device.to_device(a) for a in (x, w, dy)]
    outs = [device.to_device(np.full(s, np.nan, np.float32)) for s in ((10, 6), (10, 3, 4),
                                                                       (6, 12))]
    for k, ins, out in ((fc, [on[0], on[1]], outs[0]), (fd, [on[2], on[1]], outs[1]),
                        (fw, [on[2], on[0]], outs[2])):
        k.setup(ins, [out])
        k.run(ins, [out])
    return [np.asarray(device.to_host(o)) for o in outs]


def _bf16_values(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    bits = _numpy_bits(x)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32), bits


@pytest.mark.parametrize("refused", [False, True], ids=["gemm_ex", "refused"])
def test_the_fc_directions_on_bits_operands_equal_the_float32_path(device, monkeypatch,
                                                                   refused):
    """x, w and dy stored as bits (every operand of the three directions):
    the outputs are the float32 storage's bit for bit, the bits operands
    converted by nobody (no to_bf16_bits launch) and needing no scratch;
    where GemmEx is refused, the bits are widened for the float32 product,
    the same numbers again."""
    if refused and device.name != "emulated":
        pytest.skip("the refusal is provoked on the emulated device")
    from purine_mpi.gpu import blas
    rng = np.random.default_rng(11)
    (x, xb), (w, wb), (dy, dyb) = (_bf16_values(rng, s) for s in ((10, 3, 4), (6, 12),
                                                                   (10, 6)))
    want = _run(device, _fc(), x, w, dy)
    if refused:
        monkeypatch.setitem(blas._state, "ex_refused", "provoked by the test")
    kernels = _fc()
    device.launched.clear()
    got = _run(device, kernels, xb, wb, dyb)
    for g, t in zip(got, want):
        np.testing.assert_array_equal(g.view(np.uint32), t.view(np.uint32))
    assert "to_bf16_bits" not in device.launched
    assert ("from_bf16_bits" in device.launched) == refused
    if not refused:   # no scratch: nothing to convert
        for k, ins, out in zip(kernels, ((xb, wb), (dyb, wb), (dyb, xb)),
                               ((10, 6), (10, 3, 4), (6, 12))):
            assert k.scratch_specs(list(ins), [np.empty(out, np.float32)]) == []
    mixed = _run(device, _fc(), xb, w, dyb)   # some operands bits, some float32
    for g, t in zip(mixed, want):
        np.testing.assert_array_equal(g.view(np.uint32), t.view(np.uint32))


def test_the_fc_ops_on_the_host_widen_bits_operands():
    """The host path (NumPy arrays): bits operands widened exactly, the
    float32 path's numbers."""
    rng = np.random.default_rng(2)
    (x, xb), (w, wb), (dy, dyb) = (_bf16_values(rng, s) for s in ((10, 3, 4), (6, 12),
                                                                   (10, 6)))

    class Host:
        name = "host"
        to_device = staticmethod(np.array)
        to_host = staticmethod(np.asarray)

    want = _run(Host, _fc(), x, w, dy)
    got = _run(Host, _fc(), xb, wb, dyb)
    for g, t in zip(got, want):
        np.testing.assert_array_equal(g, t)


# ------------------------------------------------------------- the pass
def _gpt(monkeypatch, host_build_dir, precision="bf16"):
    from purine_mpi.parallel.placement import prepare_for_device
    from tests.emulated_gpu import use_emulated_cupy
    from tests.gpt_oracle import gpt_graph, gpt_net
    from tests.test_precision import SOLVER
    use_emulated_cupy(monkeypatch, host_build_dir)
    net = gpt_net(vocab=16, width=16, heads=2, blocks=2, max_length=8, approximate="tanh")
    g, _, _ = gpt_graph(net, dict(SOLVER, max_iter=3), 2, 8)
    prepare_for_device(g, 0, precision=precision)
    return g


def test_the_pass_stores_as_bits_the_blobs_only_products_read(host_build_dir, monkeypatch):
    """In the 2-block GPT: the weights' copies, the layer norms' and GELU's
    outputs' copies and the gradients the products read are bits, each read
    by fc products only and written by a producer marked ``bits_out``; the
    biases' copies (read by the forward's epilogue), the attention's output
    (read by the attention's gradient too) and the qkv gradient (read by
    the bias gradient too) stay float32. Nothing with PURINE_BF16_STORAGE=0
    or in fp16."""
    g = _gpt(monkeypatch, host_build_dir)
    cons, prod = g.consumers(), g.producers()
    bits = {n for n, b in g.blobs.items() if b.dtype == "uint16"}
    for name in ("h0_attn/qkv_weight@bf16", "h1_fc/weight@bf16", "wte/weight@bf16",
                 "h0_n1@bf16", "h1_n2@bf16", "xf@bf16", "logits.grad@bf16"):
        assert name in bits, name
    for name in ("h0_attn/qkv_bias@bf16", "h0_attn.ctx", "h0_attn.qkv.grad"):
        assert g.blobs[name].dtype == "float32", name
    assert any("gelu" in n for n in bits)
    for name in bits:
        assert g.blobs[name].attrs["precision"] == BF16
        (w,) = prod[name]
        assert w.outputs.index(name) in w.attrs["bits_out"]
        assert all(r.op_type in ("InnerProduct", "InnerProductGradData",
                                 "InnerProductGradWeight") for r in cons[name])
    monkeypatch.setenv("PURINE_BF16_STORAGE", "0")
    assert all(b.dtype != "uint16" for b in _gpt(monkeypatch, host_build_dir).blobs.values())
    monkeypatch.delenv("PURINE_BF16_STORAGE")
    assert all(b.dtype != "uint16"
               for b in _gpt(monkeypatch, host_build_dir, "fp16").blobs.values())


def test_a_reader_that_cannot_take_bits_keeps_the_float32_storage():
    """A copy read by a product and by an op that takes no bits (here a
    weight gradient of rows, whose dy is a strided slice) stays float32;
    the same copy read by products alone becomes bits."""
    from purine_mpi.graph.core import Graph
    from purine_mpi.parallel.precision import store_bits

    def graph(rows):
        g = Graph()
        for name, shape in (("x", (4, 8)), ("dy", (4, 6))):
            g.add_blob(name, shape, "float32", None, kind="data")
        g.add_blob("w", (6, 8), "float32", None, kind="param")
        for name in ("x@bf16", "dy@bf16"):
            g.add_blob(name, None, "float32", None, kind="data", attrs={"precision": BF16})
        g.add_op("cx", "Cast", ["x"], ["x@bf16"], {"dtype": BF16})
        g.add_op("cdy", "Cast", ["dy"], ["dy@bf16"], {"dtype": BF16})
        g.add_blob("dw", None, "float32", None, kind="data")
        g.add_op("fw", "InnerProductGradWeight", ["dy@bf16", "x@bf16"], ["dw"],
                 dict({"compute_dtype": BF16}, **({"rows": [0, 3]} if rows else {})))
        store_bits(g)
        g.infer_shapes()
        return g

    g = graph(rows=True)
    assert [g.blobs[n].dtype for n in ("x@bf16", "dy@bf16", "dw")] == ["float32"] * 3
    assert "bits_out" not in g.ops["cx"].attrs
    g = graph(rows=False)
    assert [g.blobs[n].dtype for n in ("x@bf16", "dy@bf16", "dw")] == ["uint16", "uint16",
                                                                       "float32"]


# ------------------------------------------------------ training, bitwise
def _train(monkeypatch, host_build_dir, storage, iters=3, blocks=2):
    """(losses, weights, launches by kernel per step) of ``iters`` AdamW
    steps of the bf16 GPT on the emulated device, CUDA graphs on, with
    PURINE_BF16_STORAGE=``storage``."""
    from purine_mpi.base.backend import to_numpy
    from purine_mpi.gpu import kernels
    from purine_mpi.layers.fillers import fill
    from purine_mpi.parallel.placement import prepare_for_device
    from purine_mpi.runtime.factory import make_dispatcher
    from tests.emulated_gpu import SimulatedRuntime, use_emulated_cupy
    from tests.gpt_oracle import gpt_graph, gpt_net
    from tests.test_precision import SOLVER
    with monkeypatch.context() as m:
        m.setenv("PURINE_BF16_STORAGE", storage)
        use_emulated_cupy(m, host_build_dir)
        counts = collections.Counter()
        real = kernels.base._launch_blocks

        def spy(source, func, *args):
            counts[func] += 1
            return real(source, func, *args)

        m.setattr(kernels.base, "_launch_blocks", spy)
        toks = np.random.default_rng(3).integers(0, 16, (iters, 2, 9))
        net = gpt_net(vocab=16, width=16, heads=2, blocks=blocks, max_length=8,
                      approximate="tanh")
        g, _, _ = gpt_graph(net, dict(SOLVER, max_iter=iters), 2, 8)
        prepare_for_device(g, 0, precision="bf16")
        d = make_dispatcher(g, runtime=SimulatedRuntime(1), seed=1, cuda_graph=True)
        steps = []
        try:
            for p in g.params():
                d.workspace.set(p.name, fill(p, 1))
            losses = []
            for it in range(iters):
                d.workspace.set("data", toks[it, :, :-1].astype(np.int32))
                d.workspace.set("label", toks[it, :, 1:].astype(np.int32))
                d.workspace["iter"][...] = it
                before = collections.Counter(counts)
                d.run(it)
                steps.append(counts - before)
                losses.append(float(d.workspace["loss"]))
            weights = {p.name: np.array(to_numpy(d.workspace[p.name])) for p in g.params()}
        finally:
            d.close()
        return losses, weights, steps


def test_a_bf16_gpt_trains_bitwise_the_same_with_bits_storage(host_build_dir, monkeypatch):
    """Four captured AdamW steps of the 2-block GPT in bf16: the losses and
    every weight bit for bit the same with bits storage as with float32
    storage (the bits are the upper halves of the roundings the float32
    path's products convert), and fewer to_bf16_bits and round_bf16
    launches a step (counted on the eager first step: the captured steps
    replay the same launches)."""
    on = _train(monkeypatch, host_build_dir, "1", iters=4)
    off = _train(monkeypatch, host_build_dir, "0", iters=4)
    assert on[0] == off[0]
    assert sorted(on[1]) == sorted(off[1])
    for name in on[1]:
        np.testing.assert_array_equal(on[1][name].view(np.uint32), off[1][name].view(np.uint32),
                                      err_msg=name)
    assert on[0][-1] != on[0][0]   # it trains
    first_on, first_off = on[2][0], off[2][0]
    assert first_on["to_bf16_bits"] < first_off["to_bf16_bits"]
    assert first_on["round_bf16"] < first_off["round_bf16"]
