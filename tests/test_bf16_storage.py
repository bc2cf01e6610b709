"""bf16 storage (parallel/precision.store_bits; docs/gpu.md, "Precision"):
a bfloat16 blob whose every reader takes bfloat16 bits (the fully connected
products' operands) is stored as the uint16 bits of its values, written so
by its producer, and the products take it as it is.

- each bits-writing kernel (the Cast, Gelu and LayerNorm: their device
  kernels and host paths) against NumPy's rounding (base/precision.
  _round_bits) of the float32 values, bit for bit;
- the fc ops on bits operands equal the float32 path bit for bit, also
  where GemmEx is refused (the bits widened);
- the pass stores what it should in the 2-block GPT (the layer norms and
  GELU writing their copies themselves, their Casts and float32 outputs
  gone; the MLP's fc output and qkv written by their biased products; the
  logits written by the lm-head, their gradient's copy by the
  loss's gradient, on the logits' bytes), nothing where a reader
  cannot take bits, nothing with PURINE_BF16_STORAGE=0 or in fp16;
- GELU and its gradient reading x as bits, the fused attention and its
  gradient reading qkv as bits, against the float32 storage bit for bit;
- the gradients' copies (``fold_copies``): GELU's gradient, a gradient
  Sum, a layer norm's gradient (ln_f's dx) and a redrawn dropout's
  gradient writing their float32
  output's bits beside it (the kernels against the float32 kernel and
  to_bf16_bits on adversarial values; the ops on the device and the
  host), no Cast of a gradient in the GPT;
- GemmEx into a bfloat16 result, the fc writing its output as bits
  (without a bias from GemmEx, with one through bias_bits: one rounding
  after the bias), the softmax loss and its gradient ``from_logits`` on
  bits logits (in chunks) against the float32 path bit for bit and against PyTorch's
  CPU autocast ``cross_entropy``; the pass's ``loss_from_logits`` only
  where the gradient's copy becomes bits;
- the bf16 GPT trained a few steps on the emulated device, captured in CUDA
  graphs, gives the same losses and weights bit for bit with and without
  bits storage, with fewer conversion and rounding launches a step; so
  does the trainer with micro-batches, checkpoints and a resume.
"""

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from purine_mpi.base.precision import _round_bits, is_bits
from purine_mpi.graph.core import Op
from purine_mpi.ops.registry import make_kernel
from tests.emulated_gpu.fixtures import device  # noqa: F401
from tests.test_precision_device import _adversarial
from tests.gpu_reference import same_bits_any_nan

BF16 = "bfloat16"


def _places(device):
    """(dev, put, get) for the emulated ``device``, then for the host (dev
    None): ``put`` an array there, ``get`` one back as a NumPy array."""
    yield device, device.to_device, lambda a: np.asarray(device.to_host(a))
    yield None, np.array, np.asarray


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


def _producer(op_type, bits, **attrs):
    ins = {"Gelu": ["x"], "LayerNorm": ["x", "g", "b"]}[op_type]
    outs = {"Gelu": ["y"], "LayerNorm": ["y", "mean", "rstd"]}[op_type]
    return make_kernel(Op("p", op_type, ins, outs, dict(attrs, **({"bits_out": [0]} if bits
                                                                   else {}))))


def _producer_case(op_type, rows, cols):
    """(kernel kwargs, float32 inputs, output shapes) of a Gelu or a LayerNorm
    over (rows, cols), with the adversarial values in x (large ones, ties
    after the op: GELU's ~identity for large x, the layer norm's g = 1,
    b = 0 rows keep many exact bf16 ties)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * 3
    if op_type == "Gelu":
        flat = x.reshape(-1)
        adv = _adversarial()
        adv = adv[np.isfinite(adv) & (np.abs(adv) < 1e12)][:flat.size]   # no x^3 overflow
        flat[:adv.size] = adv
        return {"approximate": "tanh"}, [x], [x.shape]
    g = np.where(rng.random(cols) < 0.5, 1.0, rng.standard_normal(cols)).astype(np.float32)
    b = np.where(rng.random(cols) < 0.5, 0.0, rng.standard_normal(cols)).astype(np.float32)
    return {"eps": 1e-5}, [x, g, b], [x.shape, (rows,), (rows,)]


@pytest.mark.parametrize("op_type", ["Gelu", "LayerNorm"])
@pytest.mark.parametrize("rows,cols", [(3, 5), (64, 128)])
def test_gelu_and_layer_norm_write_numpys_bits_of_their_float32_output(device, op_type, rows,
                                                                       cols):
    """Gelu and LayerNorm with ``bits_out: [0]`` write y as the bits of the
    bfloat16 nearest the float32 y the op computes without it (NumPy's
    rounding, base/precision._round_bits), bit for bit, in their one
    launch (no separate conversion); the other outputs (the layer norm's
    mean and rstd) the same bits as the float32 run's; the host path too."""
    attrs, ins, shapes = _producer_case(op_type, rows, cols)
    for dev, put, get in _places(device):
        wide = _producer(op_type, False, **attrs)
        on = [put(a) for a in ins]
        ref = [put(np.full(s, np.nan, np.float32)) for s in shapes]
        wide.setup(on, ref)
        wide.run(on, ref)
        want = [get(a) for a in ref]
        k = _producer(op_type, True, **attrs)
        outs = [put(np.zeros(shapes[0], np.uint16))] + \
            [put(np.full(s, np.nan, np.float32)) for s in shapes[1:]]
        k.setup(on, outs)
        if dev:
            device.launched.clear()
        k.run(on, outs)
        if dev:
            assert device.launched == [{"Gelu": "gelu_forward_bits_f32",
                                        "LayerNorm": "layernorm_forward_bits_f32"}[op_type]]
        got = [get(a) for a in outs]
        np.testing.assert_array_equal(got[0], _numpy_bits(want[0]))
        for g, w in zip(got[1:], want[1:]):
            np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("rows,cols", [(3, 5), (64, 128)])
def test_gelu_and_its_gradient_read_an_x_stored_as_bits(device, approximate, rows, cols):
    """Gelu (y float32 or as bits, the latter also in place on x's bytes) and
    GeluGrad with x stored as bfloat16 bits (the fc output they read, bf16
    storage): the same bits as from the float32 storage of the same values,
    in one launch each (x widened in the kernel: gelu_forward_bx_f32,
    gelu_forward_bx_bits_f32, gelu_backward_bx_f32), no scratch; the host
    path (NumPy, chunked) too. x holds the adversarial values rounded to
    bfloat16 (ties after the op, large and tiny ones)."""
    from purine_mpi.ops.activation import HOST_CHUNK
    _, (x32,), _ = _producer_case("Gelu", rows, cols)
    xb = _numpy_bits(x32)
    x = (xb.astype(np.uint32) << np.uint32(16)).view(np.float32)   # the bf16 values
    dy = np.random.default_rng(8).standard_normal(x.shape).astype(np.float32)
    attrs = {"approximate": approximate}
    if rows * cols > 1000:   # the host path over several chunks
        x, xb, dy = (np.resize(a, (3, HOST_CHUNK // 2 + 7)) for a in (x, xb, dy))

    def ops(bits_out):
        return (make_kernel(Op("g", "Gelu", ["x"], ["y"],
                               dict(attrs, **({"bits_out": [0]} if bits_out else {})))),
                make_kernel(Op("gg", "GeluGrad", ["dy", "x"], ["dx"], attrs)))

    for dev, put, get in _places(device):
        results = {}
        for name, xs in (("float32", x), ("bits", xb)):
            (fwd, grad), (fwd_bits, _) = ops(False), ops(True)
            on, d = put(xs), put(dy)
            y = put(np.full(x.shape, np.nan, np.float32))
            yb = put(np.zeros(x.shape, np.uint16))
            dx = put(np.full(x.shape, np.nan, np.float32))
            for k, ins, out in ((fwd, [on], y), (fwd_bits, [on], yb), (grad, [d, on], dx)):
                assert k.scratch_specs(ins, [out]) == []
                k.setup(ins, [out])
                if dev:
                    device.launched.clear()
                k.run(ins, [out])
                if dev and name == "bits":
                    assert device.launched == [{"Gelu": "gelu_forward_bx_f32",
                                                "GeluGrad": "gelu_backward_bx_f32"}[
                        k.op.op_type] if out is not yb else "gelu_forward_bx_bits_vec_f32"]
            results[name] = [get(a) for a in (y, yb, dx)]
            if name == "bits":   # in place: the bits of y over x's own bits
                fwd_bits.run([on], [on])
                results["in_place"] = get(on)
        for got, want in zip(results["bits"], results["float32"]):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got.view(np.uint16 if got.dtype == np.uint16
                                                   else np.uint32),
                                          want.view(np.uint16 if want.dtype == np.uint16
                                                    else np.uint32))
        np.testing.assert_array_equal(results["in_place"], results["float32"][1])
        np.testing.assert_array_equal(results["float32"][1], _numpy_bits(results["float32"][0]))


@pytest.mark.parametrize("x_bits", [False, True], ids=["x_float32", "x_bits"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelus_gradient_reads_a_dy_stored_as_bits(device, approximate, x_bits):
    """GeluGrad with dy stored as bfloat16 bits (the projection's data
    gradient, bf16 storage), x float32 or bits: dx float32, the same bits
    as from the float32 storage of the same dy, in one launch
    (gelu_backward_bdy_f32, gelu_backward_bdy_bx_f32), no scratch; on the
    host over several chunks (each dy chunk widened). The output infers
    float32; the op takes dy and x as bits."""
    from purine_mpi.ops.activation import HOST_CHUNK, GeluGrad
    rng = np.random.default_rng(11)
    shape = (3, HOST_CHUNK // 2 + 7)
    x32, xb = _bf16_values(rng, shape)
    dy32, dyb = _bf16_values(rng, shape)
    dy32[0, :5], dyb[0, :5] = 0.0, 0   # zeros, and large values
    dy32[1, :3] = np.float32(3e38)
    dyb[1, :3] = _numpy_bits(dy32[1, :3])
    dy32[1, :3] = (dyb[1, :3].astype(np.uint32) << np.uint32(16)).view(np.float32)
    x = xb if x_bits else x32
    attrs = {"approximate": approximate}
    for dev, put, get in _places(device):
        got = {}
        for name, dy in (("float32", dy32), ("bits", dyb)):
            k = make_kernel(Op("gg", "GeluGrad", ["dy", "x"], ["dx"], attrs))
            ins, out = [put(dy), put(x)], put(np.full(shape, np.nan, np.float32))
            assert k.scratch_specs(ins, [out]) == []
            k.setup(ins, [out])
            if dev:
                device.launched.clear()
            with np.errstate(all="ignore"):
                k.run(ins, [out])
            if dev and name == "bits":
                assert device.launched == ["gelu_backward_bdy_bx_vec_f32" if x_bits
                                           else "gelu_backward_bdy_vec_f32"]
            got[name] = get(out)
        np.testing.assert_array_equal(got["bits"].view(np.uint32), got["float32"].view(np.uint32))
    assert GeluGrad.bits_inputs({}) == (0, 1)
    assert GeluGrad.infer(attrs, [((2, 3), "uint16"), ((2, 3), "uint16")]) == [
        ((2, 3), np.float32)]


@pytest.mark.parametrize("dy_bits,x_bits", [(False, False), (False, True), (True, False),
                                             (True, True)], ids=["f32", "bx", "bdy", "bdy_bx"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelus_gradient_writes_dx_and_its_bits_in_one_pass(device, approximate, dy_bits,
                                                           x_bits):
    """GeluGrad with ``bits_copy: [0]`` (parallel/precision.fold_copies: dx
    read by the fc bias gradient as float32 and by the products as bits):
    dx the same float32 bits as without the copy, and its second output
    NumPy's bfloat16 bits of that dx (what the Cast wrote), in one launch
    on the device (the ``_copy`` kernel of dy's and x's storage), a chunk
    at a time over several chunks on the host. The op infers a float32 dx
    and a bits copy; a copy of anything but output 0 is refused."""
    from purine_mpi.base.errors import ShapeError
    from purine_mpi.ops.activation import HOST_CHUNK, GeluGrad
    rng = np.random.default_rng(5)
    shape = (3, HOST_CHUNK // 2 + 7)
    x32, xb = _bf16_values(rng, shape)
    dy32, dyb = _bf16_values(rng, shape)
    x, dy = (xb if x_bits else x32), (dyb if dy_bits else dy32)
    attrs = {"approximate": approximate}
    func = "gelu_backward" + "_bdy" * dy_bits + "_bx" * x_bits + "_copy_vec_f32"
    for dev in (device, None):
        put = (lambda a: device.to_device(a)) if dev else np.array
        get = (lambda a: np.asarray(device.to_host(a))) if dev else np.asarray
        plain = make_kernel(Op("gg", "GeluGrad", ["dy", "x"], ["dx"], attrs))
        ins = [put(dy), put(x)]
        want = put(np.full(shape, np.nan, np.float32))
        plain.setup(ins, [want])
        plain.run(ins, [want])
        k = make_kernel(Op("gg", "GeluGrad", ["dy", "x"], ["dx", "dx@bf16"],
                           dict(attrs, bits_copy=[0], bits_out=[1])))
        outs = [put(np.full(shape, np.nan, np.float32)), put(np.zeros(shape, np.uint16))]
        assert k.scratch_specs(ins, outs) == []
        k.setup(ins, outs)
        if dev:
            device.launched.clear()
        k.run(ins, outs)
        if dev:
            assert device.launched == [func]
        np.testing.assert_array_equal(get(outs[0]).view(np.uint32), get(want).view(np.uint32))
        np.testing.assert_array_equal(get(outs[1]), _numpy_bits(get(want)))
    assert GeluGrad.bits_copies({}) == (0,)
    assert GeluGrad.infer(dict(attrs, bits_copy=[0]), [((2, 3), "uint16")] * 2) == [
        ((2, 3), np.float32), ((2, 3), "uint16")]
    with pytest.raises(ShapeError, match="bits_copy"):
        GeluGrad.infer(dict(attrs, bits_copy=[1]), [((2, 3), "float32")] * 2)


@pytest.mark.parametrize("over", ["dy", "x"])
def test_gelus_gradient_writes_dx_s_bits_over_a_bits_dy_or_x(device, over):
    """``GeluGrad.in_place`` lets the memory plan put dx's bits copy on the
    bytes of a dy or an x stored as bits (each element read before its copy
    is written): the same dx and copy as on bytes of their own, on the
    device (one ``_copy`` launch) and on the host (a chunk at a time over
    several chunks)."""
    from purine_mpi.ops.activation import HOST_CHUNK, GeluGrad
    assert {(0, 1), (1, 1)} <= set(GeluGrad.in_place)
    rng = np.random.default_rng(23)
    shape = (3, HOST_CHUNK // 2 + 7)
    _, xb = _bf16_values(rng, shape)
    _, dyb = _bf16_values(rng, shape)
    attrs = {"approximate": "tanh", "bits_copy": [0], "bits_out": [1]}
    for dev in (device, None):
        put = (lambda a: device.to_device(a)) if dev else np.array
        get = (lambda a: np.asarray(device.to_host(a))) if dev else np.asarray
        k = make_kernel(Op("gg", "GeluGrad", ["dy", "x"], ["dx", "dx@bf16"], attrs))
        ins = [put(dyb), put(xb)]
        outs = [put(np.zeros(shape, np.float32)), put(np.zeros(shape, np.uint16))]
        k.setup(ins, outs)
        k.run(ins, outs)
        want = [get(o).copy() for o in outs]
        ins = [put(dyb), put(xb)]
        outs = [put(np.zeros(shape, np.float32)), ins[0 if over == "dy" else 1]]
        k.run(ins, outs)
        np.testing.assert_array_equal(get(outs[0]).view(np.uint32), want[0].view(np.uint32))
        np.testing.assert_array_equal(get(outs[1]), want[1])


def test_the_gelu_gradient_copy_kernels_on_adversarial_values(device):
    """The ``_copy`` GELU gradient kernels (dy and x float32 or bits) against
    the float32 kernel followed by to_bf16_bits_device, bit for bit, at an
    odd length: dx the same float32 and the copy its bits. Where x is 20
    the factor is exactly 1 (Phi 1, phi 0; tanh's s 1, s(1 - s) 0), so dx
    is dy itself and the rounding meets every adversarial value of
    test_precision_device._adversarial (ties both ways, carries into
    infinity, subnormals, infinities, NaNs with payloads in the low
    bits); elsewhere x runs over them too."""
    from purine_mpi.gpu import kernels
    v = _adversarial()
    n = v.size // 2 * 2 - 1   # odd
    put, get = device.to_device, (lambda a: np.asarray(device.to_host(a)))
    dy32 = v[:n].copy()
    x32 = v[::-1][:n].copy()
    x32[::2] = 20.0                       # dx = dy exactly
    # bits operands: each holding the values of their float32 twin
    dyb, xb = _numpy_bits(dy32), _numpy_bits(x32)
    widen = (lambda b: (b.astype(np.uint32) << np.uint32(16)).view(np.float32))
    for approximate in ("none", "tanh"):
        for dy_bits in (False, True):
            for x_bits in (False, True):
                dy = dyb if dy_bits else dy32
                x = xb if x_bits else x32
                want = put(np.zeros(n, np.float32))
                with np.errstate(all="ignore"):
                    kernels.gelu_backward(put(widen(dyb) if dy_bits else dy32),
                                          put(widen(xb) if x_bits else x32), approximate,
                                          out=want)
                bits = put(np.zeros(n, np.uint16))
                kernels.to_bf16_bits_device(want, bits)
                out, copy = put(np.zeros(n, np.float32)), put(np.zeros(n, np.uint16))
                with np.errstate(all="ignore"):
                    kernels.gelu_backward(put(dy), put(x), approximate, out=out, copy=copy)
                what = (approximate, dy_bits, x_bits)
                np.testing.assert_array_equal(get(out).view(np.uint32),
                                              get(want).view(np.uint32), err_msg=str(what))
                np.testing.assert_array_equal(get(copy), get(bits), err_msg=str(what))
                if not dy_bits:   # where the factor is 1, the copy is dy's own rounding
                    keep = ~np.isnan(dy32[::2])   # (dy * 1 quiets a signalling NaN)
                    np.testing.assert_array_equal(get(copy)[::2][keep],
                                                  _numpy_bits(dy32[::2])[keep])
    with pytest.raises(ValueError, match="copy"):
        kernels.gelu_backward(put(dy32), put(x32), out=None, copy=put(np.zeros(n, np.uint16)))
    # a gradient sum's copy (add_copy_f32): the float32 addition, then
    # to_bf16_bits_device; b holds zeros (y = a, every adversarial value
    # rounded) and the values reversed (sums of them, NaN with NaN)
    a = put(dy32)
    for b in (np.zeros(n, np.float32), x32[::-1].copy(), dy32[::-1].copy()):
        with np.errstate(all="ignore"):
            want = put(dy32 + b)
        bits = put(np.zeros(n, np.uint16))
        kernels.to_bf16_bits_device(want, bits)
        out, copy = put(np.zeros(n, np.float32)), put(np.zeros(n, np.uint16))
        kernels.add_copy(a, put(b), out, copy)
        np.testing.assert_array_equal(get(out).view(np.uint32), get(want).view(np.uint32))
        np.testing.assert_array_equal(get(copy), get(bits))


@pytest.mark.parametrize("terms", [2, 3])
def test_a_gradient_sum_writes_its_bits_beside_its_float32_sum(device, terms):
    """Sum with ``bits_copy: [0]`` (parallel/precision.fold_copies: a
    residual gradient read as float32 by the next sum and a bias gradient,
    as bits by the products): y the same float32 bits as without the copy,
    the copy NumPy's bfloat16 bits of y (what the Cast wrote); on the device
    two terms in one launch (add_copy_f32), three as the sum then one
    to_bf16_bits; on the host the sum then to_bf16_bits in its declared
    scratch. The op infers a float32 y and a bits copy; a copy of a float64
    sum is refused."""
    from purine_mpi.base.errors import ShapeError
    from purine_mpi.ops.basic import Sum
    rng = np.random.default_rng(19)
    shape = (5, 37)
    xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(terms)]
    for dev in (device, None):
        put = (lambda a: device.to_device(a)) if dev else np.array
        get = (lambda a: np.asarray(device.to_host(a))) if dev else np.asarray
        names = [f"x{i}" for i in range(terms)]
        plain = make_kernel(Op("s", "Sum", names, ["y"], {}))
        ins = [put(x) for x in xs]
        want = put(np.full(shape, np.nan, np.float32))
        plain.setup(ins, [want])
        plain.run(ins, [want])
        k = make_kernel(Op("s", "Sum", names, ["y", "y@bf16"], {"bits_copy": [0],
                                                               "bits_out": [1]}))
        outs = [put(np.full(shape, np.nan, np.float32)), put(np.zeros(shape, np.uint16))]
        k.setup(ins, outs)
        if dev:
            device.launched.clear()
        k.run(ins, outs)
        if dev:
            assert device.launched == (["add_copy_f32"] if terms == 2 else ["to_bf16_bits"])
        else:
            assert k.host_temporaries(ins, outs) == [((3, int(np.prod(shape))), np.uint32)]
        np.testing.assert_array_equal(get(outs[0]).view(np.uint32), get(want).view(np.uint32))
        np.testing.assert_array_equal(get(outs[1]), _numpy_bits(get(want)))
    assert Sum.bits_copies({}) == (0,)
    assert Sum.infer({"bits_copy": [0]}, [((2, 3), "float32")] * 2) == [
        ((2, 3), "float32"), ((2, 3), "uint16")]
    with pytest.raises(ShapeError, match="bits_copy"):
        Sum.infer({"bits_copy": [0]}, [((2, 3), "float64")] * 2)


@pytest.mark.parametrize("terms", [2, 3])
@pytest.mark.parametrize("copy", [False, True])
def test_a_sum_written_over_one_of_its_terms_equals_its_sum_beside_them(device, terms, copy):
    """Sum with ``bits_copy`` declares y over a term (``in_place_of``
    (0, 0), (1, 0): the memory plan puts a residual gradient's sum on the
    bytes of a term that dies there; a sum without the copy none): y
    written over term 0 or term 1 has the float32 bits of the sum into a
    buffer of its own, and its copy NumPy's bfloat16 bits of them (the
    device's add_copy_f32 and its add then to_bf16_bits, the host's), with
    NaN and infinities among the terms; without the copy the same sum."""
    from purine_mpi.ops.basic import Sum
    assert Sum.in_place_of({"bits_copy": [0]}) == ((0, 0), (1, 0))
    assert Sum.in_place_of({}) == ()
    rng = np.random.default_rng(23)
    shape = (7, 33)
    xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(terms)]
    xs[0][0, :4] = [np.nan, np.inf, -np.inf, 3e38]
    xs[1][0, :4] = [1.0, -np.inf, 2.0, 3e38]
    names = [f"x{i}" for i in range(terms)]
    attrs = {"bits_copy": [0], "bits_out": [1]} if copy else {}
    outs_names = ["y", "y@bf16"] if copy else ["y"]
    for dev in (device, None):
        put = (lambda a: device.to_device(a)) if dev else np.array
        get = (lambda a: np.asarray(device.to_host(a))) if dev else np.asarray
        with np.errstate(all="ignore"):
            want = np.sum(xs, axis=0, dtype=np.float32) if terms == 2 else \
                (xs[0] + xs[1]) + xs[2]
        for over in (0, 1):
            ins = [put(x) for x in xs]
            outs = [ins[over]] + ([put(np.zeros(shape, np.uint16))] if copy else [])
            k = make_kernel(Op("s", "Sum", names, outs_names, dict(attrs)))
            k.setup(ins, outs)
            with np.errstate(all="ignore"):
                k.run(ins, outs)
            if dev:   # a GPU's float32 NaN is 0x7FFFFFFF whatever the terms' NaNs
                assert same_bits_any_nan(get(outs[0]), want)
                if copy:
                    assert same_bits_any_nan(get(outs[1]), _numpy_bits(want))
                continue
            np.testing.assert_array_equal(get(outs[0]).view(np.uint32), want.view(np.uint32))
            if copy:
                np.testing.assert_array_equal(get(outs[1]), _numpy_bits(want))


def _ln_grad_inputs(rng, rows, cols):
    """x, g, mean and rstd of a layer norm over (rows, cols) (x's own row
    statistics)."""
    x = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    g = rng.standard_normal(cols).astype(np.float32)
    mean = x.mean(axis=1).astype(np.float32)
    rstd = (1 / np.sqrt(x.var(axis=1) + 1e-5)).astype(np.float32)
    return x, g, mean, rstd


@pytest.mark.parametrize("wanted", [("dx", "dg", "db"), ("dx",), ("dx", "db")])
@pytest.mark.parametrize("dy_bits", [False, True], ids=["f32", "bdy"])
def test_the_layer_norm_gradient_writes_dx_and_its_bits_in_one_pass(device, monkeypatch,
                                                                    wanted, dy_bits):
    """LayerNormGrad with ``bits_copy`` (parallel/precision.fold_copies: the
    final layer norm's dx, read as float32 by the last residual sum and the
    projection's bias gradient, as bits by its data and weight gradients):
    dx, dg and db the same float32 bits as without the copy, and the last
    output NumPy's bfloat16 bits of that dx (what the Cast wrote); on the
    device in the backward kernel's one launch (``layernorm_backward_copy_f32``
    / ``_bdy_copy_f32``, no to_bf16_bits), on the host a chunk of rows at a
    time over several chunks (to_bf16_bits's scratch declared). The op
    infers the float32 gradients and a bits copy; a copy of anything but
    dx, or of a float64 dx, is refused."""
    from purine_mpi.base.errors import ShapeError
    from purine_mpi.ops import layernorm
    from purine_mpi.ops.layernorm import LayerNormGrad
    rows, cols = 300, 96
    monkeypatch.setattr(layernorm, "HOST_CHUNK_BYTES", 64 * cols * 4)   # 5 chunks of rows
    rng = np.random.default_rng(31)
    x, g, mean, rstd = _ln_grad_inputs(rng, rows, cols)
    dy32, dyb = _bf16_values(rng, (rows, cols))
    dy = dyb if dy_bits else dy32
    attrs = {"outputs": list(wanted)}
    index = list(wanted).index("dx")
    shapes = {"dx": (rows, cols), "dg": (cols,), "db": (cols,)}
    func = "layernorm_backward" + "_bdy" * dy_bits + "_copy_f32"
    names = ["dy", "x", "g", "mean", "rstd"]
    for dev, put, get in _places(device):
        plain = make_kernel(Op("lg", "LayerNormGrad", names, list(wanted), attrs))
        ins = [put(dy), put(x), put(g), put(mean), put(rstd)]
        want = [put(np.full(shapes[w], np.nan, np.float32)) for w in wanted]
        plain.setup(ins, want)
        plain.run(ins, want)
        k = make_kernel(Op("lg", "LayerNormGrad", names, list(wanted) + ["dx@bf16"],
                           dict(attrs, bits_copy=[index], bits_out=[len(wanted)])))
        outs = [put(np.full(shapes[w], np.nan, np.float32)) for w in wanted] + [
            put(np.zeros((rows, cols), np.uint16))]
        k.setup(ins, outs)
        if dev:
            assert k.scratch_specs(ins, outs) == plain.scratch_specs(ins, want)
            device.launched.clear()
        else:
            assert k.host_temporaries(ins, outs) == plain.host_temporaries(ins, want) + [
                ((3, 64 * cols), np.uint32)]
        k.run(ins, outs)
        if dev:
            assert func in device.launched and "to_bf16_bits" not in device.launched
            assert not any(f.startswith("layernorm_backward") and f != func
                           for f in device.launched)
        for a, b, w in zip(outs, want, wanted):
            np.testing.assert_array_equal(get(a).view(np.uint32), get(b).view(np.uint32),
                                          err_msg=w)
        np.testing.assert_array_equal(get(outs[-1]), _numpy_bits(get(want[index])))
    in_shapes = [((rows, cols), "uint16" if dy_bits else "float32"), ((rows, cols), "float32"),
                 ((cols,), "float32"), ((rows,), "float32"), ((rows,), "float32")]
    assert LayerNormGrad.bits_copies(attrs) == (index,)
    assert LayerNormGrad.bits_copies({"outputs": ["dg", "db"]}) == ()
    assert LayerNormGrad.infer(dict(attrs, bits_copy=[index]), in_shapes) == [
        (shapes[w], np.float32) for w in wanted] + [((rows, cols), "uint16")]
    with pytest.raises(ShapeError, match="bits_copy"):
        LayerNormGrad.infer(dict(attrs, bits_copy=[index + 1]), in_shapes)
    with pytest.raises(ShapeError, match="bits_copy"):
        LayerNormGrad.infer({"outputs": ["dx"], "bits_copy": [0]},
                            [(s, "float64") for s, _ in in_shapes])


def test_the_layer_norm_gradient_copy_kernels_on_adversarial_values(device):
    """The ``_copy`` layer norm gradient kernels (dy float32 or bits, with
    and without dy * xhat) against the float32 kernel followed by
    to_bf16_bits_device, bit for bit: dx and dyxhat the same float32 and
    the copy dx's bits. Rows of two columns [v, -v] with x 0, g 1, mean 0
    and rstd 1 have dx = dy exactly (xhat 0, mean(dy * g) 0), so the
    rounding meets every adversarial value of
    test_precision_device._adversarial (ties both ways, carries into
    infinity, subnormals; an infinity's or NaN's row is NaN); rows of 300
    random columns take every thread of a block and the row sums' tree."""
    from purine_mpi.gpu import kernels
    put, get = device.to_device, (lambda a: np.asarray(device.to_host(a)))
    v = _adversarial()
    pairs = np.stack([v, -v], axis=1).astype(np.float32)
    rng = np.random.default_rng(37)
    x, g, mean, rstd = _ln_grad_inputs(rng, 5, 300)
    cases = [(pairs, np.zeros_like(pairs), np.ones(2, np.float32),
              np.zeros(len(v), np.float32), np.ones(len(v), np.float32)),
             ((rng.standard_normal(x.shape) * 2).astype(np.float32), x, g, mean, rstd)]
    widen = (lambda b: (b.astype(np.uint32) << np.uint32(16)).view(np.float32))
    for case, (dy32, x, g, mean, rstd) in enumerate(cases):
        dyb = _numpy_bits(dy32)
        for dy_bits in (False, True):
            for with_dyxhat in (False, True):
                dy = dyb if dy_bits else dy32
                want = put(np.zeros(x.shape, np.float32))
                want_p = put(np.zeros(x.shape, np.float32)) if with_dyxhat else None
                with np.errstate(all="ignore"):
                    kernels.layernorm_backward(put(widen(dyb) if dy_bits else dy32), put(x),
                                               put(g), put(mean), put(rstd), dx=want,
                                               dyxhat=want_p)
                bits = put(np.zeros(x.shape, np.uint16))
                kernels.to_bf16_bits_device(want.reshape(-1), bits.reshape(-1))
                out, copy = put(np.zeros(x.shape, np.float32)), put(np.zeros(x.shape, np.uint16))
                p = put(np.zeros(x.shape, np.float32)) if with_dyxhat else None
                with np.errstate(all="ignore"):
                    kernels.layernorm_backward(put(dy), put(x), put(g), put(mean), put(rstd),
                                               dx=out, dyxhat=p, copy=copy)
                what = (case, dy_bits, with_dyxhat)
                np.testing.assert_array_equal(get(out).view(np.uint32),
                                              get(want).view(np.uint32), err_msg=str(what))
                np.testing.assert_array_equal(get(copy), get(bits), err_msg=str(what))
                if with_dyxhat:
                    np.testing.assert_array_equal(get(p).view(np.uint32),
                                                  get(want_p).view(np.uint32), err_msg=str(what))
                if case == 0 and not dy_bits:   # dx = dy: the copy is dy's own rounding
                    finite = np.isfinite(v)
                    np.testing.assert_array_equal(get(copy)[finite], _numpy_bits(pairs)[finite],
                                                  err_msg=str(what))
    with pytest.raises(ValueError, match="copy"):
        kernels.layernorm_backward(put(dy32), put(x), put(g), put(mean), put(rstd), dx=None,
                                   copy=put(np.zeros(x.shape, np.uint16)))


@pytest.mark.parametrize("n", [1003, 4096])
def test_the_redrawn_dropout_gradient_writes_dx_and_its_bits_in_one_pass(device, n):
    """DropoutRedrawGrad with ``bits_copy: [0]`` (parallel/precision.
    fold_copies: a residual dropout's dx, read as float32 by the projection's
    bias gradient and as bits by its data and weight gradients): dx the
    same float32 bits as without the copy (the same redrawn mask), and its
    second output NumPy's bfloat16 bits of that dx (what the Cast wrote);
    on the device one ``dropout_apply_copy_f32`` launch (no to_bf16_bits),
    on the host the draw then to_bf16_bits in its declared scratch. The
    kernel against dropout_apply + to_bf16_bits_device on adversarial
    values (kept ones scaled, dropped ones 0 or NaN). The op infers a
    float32 dx and a bits copy; a copy of a float64 dx is refused."""
    from purine_mpi.base.errors import ShapeError
    from purine_mpi.base.philox import dropout_keys
    from purine_mpi.gpu import kernels
    from purine_mpi.ops.dropout import DropoutRedrawGrad
    rng = np.random.default_rng(41)
    dy = rng.standard_normal((n,)).astype(np.float32) * 3
    attrs = {"ratio": 0.3, "stream": "h0_drop", "seed": 7}
    for dev, put, get in _places(device):
        it = put(np.array(5, np.int64)) if dev else np.array(5, np.int64)
        plain = make_kernel(Op("dg", "DropoutRedrawGrad", ["dy", "iter"], ["dx"], attrs))
        want = put(np.full(dy.shape, np.nan, np.float32))
        plain.setup([put(dy), it], [want])
        plain.run([put(dy), it], [want])
        k = make_kernel(Op("dg", "DropoutRedrawGrad", ["dy", "iter"], ["dx", "dx@bf16"],
                           dict(attrs, bits_copy=[0], bits_out=[1])))
        outs = [put(np.full(dy.shape, np.nan, np.float32)), put(np.zeros(dy.shape, np.uint16))]
        k.setup([put(dy), it], outs)
        if dev:
            device.launched.clear()
        else:
            assert k.host_temporaries([dy, it], outs) == \
                plain.host_temporaries([dy, it], [want]) + [((3, n), np.uint32)]
        k.run([put(dy), it], outs)
        if dev:
            assert device.launched == ["dropout_apply_copy_f32"]
        np.testing.assert_array_equal(get(outs[0]).view(np.uint32), get(want).view(np.uint32))
        np.testing.assert_array_equal(get(outs[1]), _numpy_bits(get(want)))
        assert 0 < np.count_nonzero(get(want)) < n   # some dropped, some kept
    # the kernel on adversarial values, at an odd length (a part Philox block)
    put, get = device.to_device, (lambda a: np.asarray(device.to_host(a)))
    v = _adversarial()
    v = v[:v.size // 2 * 2 - 1]
    key0, key1, ctr1 = dropout_keys(7, "h0_drop")
    for ratio in (0.0, 0.3):
        want = put(np.zeros(v.size, np.float32))
        with np.errstate(all="ignore"):
            kernels.dropout_apply(put(v), (1 << 32) + 3, ratio, key0, key1, ctr1, out=want)
        bits = put(np.zeros(v.size, np.uint16))
        kernels.to_bf16_bits_device(want, bits)
        out, copy = put(np.zeros(v.size, np.float32)), put(np.zeros(v.size, np.uint16))
        with np.errstate(all="ignore"):
            kernels.dropout_apply(put(v), (1 << 32) + 3, ratio, key0, key1, ctr1, out=out,
                                  copy=copy)
        np.testing.assert_array_equal(get(out).view(np.uint32), get(want).view(np.uint32))
        np.testing.assert_array_equal(get(copy), get(bits), err_msg=str(ratio))
        if ratio == 0.0:   # scale 1, every unit kept: the copy is v's own rounding
            keep = ~np.isnan(v)
            np.testing.assert_array_equal(get(copy)[keep], _numpy_bits(v)[keep])
    with pytest.raises(ValueError, match="copy"):
        kernels.dropout_apply(put(v), 3, 0.3, key0, key1, ctr1, out=None,
                              copy=put(np.zeros(v.size, np.uint16)))
    assert DropoutRedrawGrad.bits_copies(attrs) == (0,)
    specs = [((2, 3), "float32"), ((), "int64")]
    assert DropoutRedrawGrad.infer(dict(attrs, bits_copy=[0]), specs) == [
        ((2, 3), "float32"), ((2, 3), "uint16")]
    with pytest.raises(ShapeError, match="bits_copy"):
        DropoutRedrawGrad.infer(dict(attrs, bits_copy=[0]), [((2, 3), "float64"), ((), "int64")])


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("n", [1003, 4096])
def test_the_kept_mask_dropout_gradient_writes_dx_and_its_bits_in_one_pass(device, n, packed):
    """DropoutGrad (a kept mask, float or bit-packed) with ``bits_copy: [0]``
    (parallel/precision.fold_copies, as DropoutRedrawGrad's): dx the same
    float32 bits as without the copy, and its second output the bits the
    Cast after it wrote (the Cast op on that dx); on the device one
    ``dropout_backward_copy_f32`` launch and no to_bf16_bits, on the host
    the product then to_bf16_bits in its declared scratch; dx over dy
    (its ``in_place``) the same. The kernel against dropout_backward +
    to_bf16_bits_device on adversarial values (kept ones scaled, dropped
    ones 0 or NaN). The op infers a float32 dx and a bits copy; a copy of
    a float64 dx is refused."""
    from purine_mpi.base.errors import ShapeError
    from purine_mpi.gpu import kernels
    from purine_mpi.ops.dropout import DropoutGrad, pack_mask
    rng = np.random.default_rng(43)
    dy = rng.standard_normal((n,)).astype(np.float32) * 3
    keep = rng.random(n) >= 0.3
    mask = pack_mask(keep) if packed else keep.astype(np.float32)
    attrs = {"ratio": 0.3, **({"packed_mask": True} if packed else {})}
    for dev, put, get in _places(device):
        plain = make_kernel(Op("dg", "DropoutGrad", ["dy", "mask"], ["dx"], attrs))
        want = put(np.full(dy.shape, np.nan, np.float32))
        plain.setup([put(dy), put(mask)], [want])
        plain.run([put(dy), put(mask)], [want])
        cast, bits = _cast(), put(np.zeros(dy.shape, np.uint16))
        cast.setup([want], [bits])
        cast.run([want], [bits])
        k = make_kernel(Op("dg", "DropoutGrad", ["dy", "mask"], ["dx", "dx@bf16"],
                           dict(attrs, bits_copy=[0], bits_out=[1])))
        for over in (False, True):
            ins = [put(dy), put(mask)]
            outs = [ins[0] if over else put(np.full(dy.shape, np.nan, np.float32)),
                    put(np.zeros(dy.shape, np.uint16))]
            k.setup(ins, outs)
            if dev:
                device.launched.clear()
            else:
                assert k.host_temporaries(ins, outs) == \
                    plain.host_temporaries(ins, [want]) + [((3, n), np.uint32)]
            k.run(ins, outs)
            if dev:   # a packed mask: its bits read in the same kernel (no unpacking)
                assert device.launched == ["dropout_backward_packed_copy_f32" if packed
                                           else "dropout_backward_copy_f32"]
            np.testing.assert_array_equal(get(outs[0]).view(np.uint32),
                                          get(want).view(np.uint32))
            np.testing.assert_array_equal(get(outs[1]), get(bits))
            np.testing.assert_array_equal(get(outs[1]), _numpy_bits(get(want)))
        assert 0 < np.count_nonzero(get(want)) < n   # some dropped, some kept
    # the kernel on adversarial values, at an odd length
    put, get = device.to_device, (lambda a: np.asarray(device.to_host(a)))
    v = _adversarial()
    v = v[:v.size // 2 * 2 - 1]
    m = (np.arange(v.size) % 3 != 0).astype(np.float32)
    for ratio in (0.0, 0.3):
        want = put(np.zeros(v.size, np.float32))
        with np.errstate(all="ignore"):
            kernels.dropout_backward(put(v), put(m), ratio, out=want)
        bits = put(np.zeros(v.size, np.uint16))
        kernels.to_bf16_bits_device(want, bits)
        out, copy = put(np.zeros(v.size, np.float32)), put(np.zeros(v.size, np.uint16))
        with np.errstate(all="ignore"):
            kernels.dropout_backward(put(v), put(m), ratio, out=out, copy=copy)
        np.testing.assert_array_equal(get(out).view(np.uint32), get(want).view(np.uint32))
        np.testing.assert_array_equal(get(copy), get(bits), err_msg=str(ratio))
    with pytest.raises(ValueError, match="copy"):
        kernels.dropout_backward(put(v), put(m), 0.3, out=None,
                                 copy=put(np.zeros(v.size, np.uint16)))
    assert DropoutGrad.bits_copies(attrs) == (0,)
    specs = [((2, 3), "float32"), ((2, 3), "float32")]
    assert DropoutGrad.infer({"ratio": 0.3, "bits_copy": [0]}, specs) == [
        ((2, 3), "float32"), ((2, 3), "uint16")]
    with pytest.raises(ShapeError, match="bits_copy"):
        DropoutGrad.infer({"ratio": 0.3, "bits_copy": [0]}, [((2, 3), "float64")] * 2)


@pytest.mark.parametrize("n", [1, 7, 33, 1023])
def test_the_kept_mask_dropout_gradients_copy_at_odd_sizes_against_float64(device, n):
    """DropoutGrad with ``bits_copy: [0]`` at sizes 1, 7, 33 and 1023 (no
    multiple of a vector width; a packed mask's last byte part used), as a
    (n, 1) and a flat blob, ratios 0, 0.1, 0.5 and 0.9 (the scale
    1 / (1 - ratio)), float and bit-packed masks, into dx of its own and
    over dy: dx within an ulp of the float64 dy * mask / (1 - ratio) (zero
    where dropped), and its bits bit for bit those a Cast after the op
    wrote, on the emulated device and on the host."""
    rng = np.random.default_rng(1000 + n)
    for shape in ((n,), (n, 1)):
        dy = (rng.standard_normal(shape) * 5).astype(np.float32)
        keep = rng.random(shape) >= 0.4
        for ratio, packed in ((0.0, False), (0.1, True), (0.5, False), (0.5, True),
                              (0.9, True)):
            from purine_mpi.ops.dropout import pack_mask
            mask = pack_mask(keep) if packed else keep.astype(np.float32)
            ref = dy.astype(np.float64) * keep / (1.0 - ratio)
            attrs = {"ratio": ratio, **({"packed_mask": True} if packed else {})}
            k = make_kernel(Op("dg", "DropoutGrad", ["dy", "mask"], ["dx", "dx@bf16"],
                               dict(attrs, bits_copy=[0], bits_out=[1])))
            for dev, put, get in _places(device):
                for over in (False, True):
                    ins = [put(dy), put(mask)]
                    outs = [ins[0] if over else put(np.full(shape, np.nan, np.float32)),
                            put(np.full(shape, 0xFFFF, np.uint16))]
                    k.setup(ins, outs)
                    k.run(ins, outs)
                    dx = get(outs[0])
                    what = f"n={n} shape={shape} ratio={ratio} packed={packed} over={over} " \
                        f"device={dev is not None}"
                    np.testing.assert_allclose(dx, ref, rtol=2 ** -23, atol=0, err_msg=what)
                    assert np.array_equal(dx == 0, ~keep), what
                    cast, bits = _cast(), put(np.zeros(shape, np.uint16))
                    cast.setup([put(dx)], [bits])
                    cast.run([put(dx)], [bits])
                    np.testing.assert_array_equal(get(outs[1]), get(bits), err_msg=what)
                    np.testing.assert_array_equal(get(outs[1]), _numpy_bits(dx), err_msg=what)


@pytest.mark.parametrize("where", ["gemm_ex", "refused", "host"])
def test_the_data_gradient_writes_dx_as_the_float32_paths_bits(device, monkeypatch, where):
    """InnerProductGradData with ``bits_out: [0]`` (bf16 storage: a data
    gradient every reader of which takes bits): dx is the bits of the
    float32 path's dx (its product, rounded to bfloat16 after the run), bit
    for bit: one GemmEx with a bfloat16 result, no rounding or conversion
    launch and no scratch; where GemmEx is refused, the float32 product in
    the op's scratch and one to_bf16_bits; on the host the float32 product
    and base/precision's rounding. Not in float16."""
    from purine_mpi.gpu import blas
    from purine_mpi.ops.fc import InnerProductGradData
    rng = np.random.default_rng(12)
    (_, dy), (_, w) = _bf16_values(rng, (10, 3, 6)), _bf16_values(rng, (6, 4))
    attrs = {"compute_dtype": BF16, "axis": 2, "x_shape": [10, 3, 4]}
    host = where == "host"
    put = np.array if host else device.to_device
    get = np.asarray if host else (lambda a: np.asarray(device.to_host(a)))
    wide = make_kernel(Op("gd", "InnerProductGradData", ["dy", "w"], ["dx"], attrs))
    dx = put(np.full((10, 3, 4), np.nan, np.float32))
    ins = [put(dy), put(w)]
    wide.setup(ins, [dx])
    wide.run(ins, [dx])
    want = _numpy_bits(get(dx))
    np.testing.assert_array_equal((want.astype(np.uint32) << np.uint32(16)),
                                  get(dx).view(np.uint32))   # dx was rounded after the run
    if where == "refused":
        monkeypatch.setitem(blas._state, "ex_refused", "provoked by the test")
    k = make_kernel(Op("gd", "InnerProductGradData", ["dy", "w"], ["dx"],
                       dict(attrs, bits_out=[0])))
    out = put(np.zeros((10, 3, 4), np.uint16))
    k.setup(ins, [out])
    device.launched.clear()
    k.run(ins, [out])
    np.testing.assert_array_equal(get(out), want)
    if not host:
        assert "round_bf16" not in device.launched
        assert device.launched.count("to_bf16_bits") == (where == "refused")
        specs = k.scratch_specs(ins, [out])
        assert (((30, 4), np.float32) in specs) == (where == "refused")
    assert InnerProductGradData.infer(dict(attrs, bits_out=[0]), [((10, 3, 6), "uint16"),
                                                                  ((6, 4), "uint16")]) == [
        ((10, 3, 4), "uint16")]
    assert InnerProductGradData.bits_outputs(attrs) == (0,)
    assert InnerProductGradData.bits_outputs({"compute_dtype": "float16"}) == ()


@pytest.mark.parametrize("n,t,heads", [(2, 8, 2), (3, 5, 1)])
def test_the_fused_attention_and_its_gradient_read_a_qkv_stored_as_bits(device, n, t, heads):
    """Attention and AttentionGrad (bf16, the cuBLAS path) with qkv stored
    as bfloat16 bits (the qkv product's output, bf16 storage): ctx and dqkv
    the same bits as from the float32 storage of the same values, qkv
    widened exactly into the op's scratch (one from_bf16_bits launch each;
    the scratch grows by qkv's float32), float32 outputs; the host path too."""
    from purine_mpi.ops.attention import Attention, AttentionGrad
    rng = np.random.default_rng(12)
    c = 4 * heads
    qkv, qkvb = _bf16_values(rng, (n, t, 3 * c))
    dctx = _bf16_values(rng, (n, t, c))[0]
    attrs = {"num_heads": heads, "compute_dtype": BF16}
    assert Attention.bits_inputs(attrs) == (0,) and AttentionGrad.bits_inputs(attrs) == (0, 1)
    assert Attention.infer(attrs, [((n, t, 3 * c), "uint16")]) == [((n, t, c), np.float32)]
    assert AttentionGrad.infer(attrs, [((n, t, c), "float32"), ((n, t, 3 * c), "uint16")]) \
        == [((n, t, 3 * c), np.float32)]
    for dev, put, get in _places(device):
        results = {}
        for name, x in (("float32", qkv), ("bits", qkvb)):
            fwd = make_kernel(Op("a", "Attention", ["qkv"], ["ctx"], attrs))
            grad = make_kernel(Op("ag", "AttentionGrad", ["dctx", "qkv"], ["dqkv"], attrs))
            on, d = put(x), put(dctx)
            ctx = put(np.full((n, t, c), np.nan, np.float32))
            dqkv = put(np.full((n, t, 3 * c), np.nan, np.float32))
            for k, ins, out in ((fwd, [on], ctx), (grad, [d, on], dqkv)):
                k.setup(ins, [out])
                if dev:
                    specs = k.scratch_specs(ins, [out])
                    assert (((n, t, 3 * c), np.float32) in specs) == (name == "bits")
                    device.launched.clear()
                k.run(ins, [out])
                if dev:
                    assert device.launched.count("from_bf16_bits") == (name == "bits")
            results[name] = [get(a) for a in (ctx, dqkv)]
        for got, want in zip(results["bits"], results["float32"]):
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("t", [6, 13])
@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["plain", "dropout"])
def test_the_attention_gradient_reads_dctx_and_writes_dqkv_as_bits(device, dropout, t):
    """AttentionGrad (bf16, the cuBLAS path) with dctx stored as bfloat16
    bits (the projection's data gradient) and dqkv written as bits
    (``bits_out``: read by qkv's three gradients, bf16 storage): dqkv the
    bits of the float32 storage's rounded dqkv, bit for bit -- dctx widened
    exactly into the op's scratch, dqkv's float32 into its scratch and one
    to_bf16_bits (no round_bf16); the host path too (over several groups
    where it can: no dropout); with dropout (the same Philox draw). The
    bias gradient's column sums of the bits dqkv: the float32 dqkv's, bit
    for bit (sum_rows_bits_f32; the host widening dy first). Where P's
    bytes hold a (N, T, 3C) array (T >= 3D) and there is no dropout, the
    device path computes dqkv over qkv's widening (no float32 dqkv in its
    scratch), the same bits."""
    from purine_mpi.ops.attention import AttentionGrad
    from purine_mpi.ops.fc import InnerProductGradBias
    rng = np.random.default_rng(13)
    n, heads = 3, 2
    c = 4 * heads
    over = not dropout and t >= 3 * 4
    qkv, qkvb = _bf16_values(rng, (n, t, 3 * c))
    dctx, dctxb = _bf16_values(rng, (n, t, c))
    attrs = {"num_heads": heads, "compute_dtype": BF16}
    if dropout:
        attrs.update(dropout=dropout, stream="a", seed=7)
    assert AttentionGrad.bits_outputs(attrs) == (0,)
    assert AttentionGrad.bits_outputs({"compute_dtype": "float16"}) == ()
    assert AttentionGrad.bits_inputs(dict(attrs, sdpa=True)) == (0, 1, 2)
    assert AttentionGrad.infer(dict(attrs, bits_out=[0]), [
        ((n, t, c), "uint16"), ((n, t, 3 * c), "uint16")] + (
        [((), "int64")] if dropout else [])) == [((n, t, 3 * c), "uint16")]
    assert InnerProductGradBias.bits_inputs({}) == (0,)
    assert InnerProductGradBias.infer({}, [((n, t, 3 * c), "uint16")]) == [
        ((3 * c,), np.float32)]
    for dev, put, get in _places(device):
        extra = [put(np.asarray(5, np.int64))] if dropout else []
        inputs = ["dctx", "qkv"] + (["iter"] if dropout else [])
        got = {}
        for name, d, out_dtype in (("float32", dctx, np.float32), ("bits", dctxb, np.uint16)):
            grad = make_kernel(Op("ag", "AttentionGrad", inputs, ["dqkv"],
                                  dict(attrs, **({"bits_out": [0]} if name == "bits" else {}))))
            ins = [put(d), put(qkvb)] + extra
            dqkv = put(np.zeros((n, t, 3 * c), out_dtype))
            grad.setup(ins, [dqkv])
            if dev:
                specs = grad.scratch_specs(ins, [dqkv])
                assert (((n, t, c), np.float32) in specs) == (name == "bits")
                # qkv's widening in both; dqkv's float32 in the bits run
                # unless it is computed over qkv's widening
                assert specs.count(((n, t, 3 * c), np.float32)) == 1 + (
                    name == "bits" and not over)
                device.launched.clear()
            grad.run(ins, [dqkv])
            if dev:
                launched = device.launched
                assert launched.count("round_bf16") == (name == "float32")
                assert launched.count("to_bf16_bits") == (name == "bits")
                # qkv is bits in both; dctx too in the bits run
                assert launched.count("from_bf16_bits") == 1 + (name == "bits")
            db = put(np.full(3 * c, np.nan, np.float32))
            bias = make_kernel(Op("fb", "InnerProductGradBias", ["dqkv"], ["db"], {}))
            bias.setup([dqkv], [db])
            if dev:
                device.launched.clear()
            bias.run([dqkv], [db])
            if dev and name == "bits":
                assert _with_vec(Counter(device.launched)).get("sum_rows_bits_f32", 0) == 1
            got[name] = (get(dqkv), get(db))
        np.testing.assert_array_equal(got["bits"][0], _numpy_bits(got["float32"][0]))
        np.testing.assert_array_equal(
            (got["bits"][0].astype(np.uint32) << np.uint32(16)), got["float32"][0].view(np.uint32))
        np.testing.assert_array_equal(got["bits"][1].view(np.uint32),
                                      got["float32"][1].view(np.uint32))


@pytest.mark.parametrize("t", [6, 13])
def test_the_attention_gradient_with_a_packed_mask_reads_dctx_and_writes_dqkv_as_bits(t):
    """The host's fused attention with dropout keeps its mask bit-packed
    (attr ``packed_mask``: the forward's second output, which the gradient
    unpacks instead of drawing again): AttentionGrad reading dctx as bits
    and writing dqkv as bits (``bits_out``) from that mask gives the bits of
    the float32 storage's dqkv (dctx float32) from the same mask, bit for
    bit, and those are the bits of the gradient that redraws the mask (no
    ``packed_mask``). (Its host temporaries: tests/test_host_temporaries.py.)"""
    from purine_mpi.ops.attention import AttentionGrad
    from purine_mpi.ops.dropout import packed_shape
    rng = np.random.default_rng(17)
    n, heads = 3, 2
    c = 4 * heads
    qkv, qkvb = _bf16_values(rng, (n, t, 3 * c))
    dctx, dctxb = _bf16_values(rng, (n, t, c))
    it = np.asarray(5, np.int64)
    attrs = {"num_heads": heads, "compute_dtype": BF16, "dropout": 0.25, "stream": "a",
             "seed": 7}
    fwd = make_kernel(Op("a", "Attention", ["qkv", "iter"], ["ctx", "bits"],
                         dict(attrs, packed_mask=True)))
    mask = np.zeros(packed_shape((n, heads, t, t)), np.uint8)
    ctx = np.full((n, t, c), np.nan, np.float32)
    fwd.setup([qkvb, it], [ctx, mask])
    fwd.run([qkvb, it], [ctx, mask])
    assert mask.any() and not np.all(mask == 255)
    assert AttentionGrad.infer(dict(attrs, packed_mask=True, bits_out=[0]), [
        ((n, t, c), "uint16"), ((n, t, 3 * c), "uint16"), (mask.shape, "uint8"),
        ((), "int64")]) == [((n, t, 3 * c), "uint16")]
    got = {}
    for name, d, out_dtype, pack in (("float32", dctx, np.float32, True),
                                     ("bits", dctxb, np.uint16, True),
                                     ("redrawn", dctxb, np.uint16, False)):
        extra = {"bits_out": [0]} if out_dtype == np.uint16 else {}
        if pack:
            extra["packed_mask"] = True
        grad = make_kernel(Op("ag", "AttentionGrad",
                              ["dctx", "qkv"] + (["bits"] if pack else []) + ["iter"],
                              ["dqkv"], dict(attrs, **extra)))
        ins = [d, qkvb] + ([mask] if pack else []) + [it]
        dqkv = np.zeros((n, t, 3 * c), out_dtype)
        grad.setup(ins, [dqkv])
        grad.run(ins, [dqkv])
        got[name] = dqkv
    np.testing.assert_array_equal(got["bits"], _numpy_bits(got["float32"]))
    np.testing.assert_array_equal(got["bits"], got["redrawn"])


@pytest.mark.parametrize("wanted", [("dx", "dg", "db"), ("dx",), ("dg", "db")])
def test_the_layer_norm_gradient_reads_a_dy_stored_as_bits(device, wanted):
    """LayerNormGrad with dy stored as bfloat16 bits (a data gradient of the
    fc products, bf16 storage): dx, dg and db float32, the float32 storage's
    bit for bit -- on the device dy widened in the kernels
    (layernorm_backward_bdy_f32, db's column sums sum_rows_bits_f32; no
    from_bf16_bits launch, no scratch beyond the float32 run's), on the
    host (several chunks of rows) from a float32 copy. The gradients infer
    float32; dy (only) is taken as bits."""
    from purine_mpi.ops.layernorm import LayerNormGrad
    rng = np.random.default_rng(14)
    rows, cols = 300, 96
    x = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    g = rng.standard_normal(cols).astype(np.float32)
    mean = x.mean(axis=1).astype(np.float32)
    rstd = (1 / np.sqrt(x.var(axis=1) + 1e-5)).astype(np.float32)
    dy32, dyb = _bf16_values(rng, (rows, cols))
    attrs = {"outputs": list(wanted)}
    shapes = {"dx": (rows, cols), "dg": (cols,), "db": (cols,)}
    assert LayerNormGrad.bits_inputs(attrs) == (0,)
    assert LayerNormGrad.infer(attrs, [((rows, cols), "uint16"), ((rows, cols), "float32"),
                                       ((cols,), "float32"), ((rows,), "float32"),
                                       ((rows,), "float32")]) == [
        (shapes[w], np.float32) for w in wanted]
    for dev, put, get in _places(device):
        got = {}
        for name, dy in (("float32", dy32), ("bits", dyb)):
            k = make_kernel(Op("lg", "LayerNormGrad", ["dy", "x", "g", "mean", "rstd"],
                               list(wanted), attrs))
            ins = [put(dy), put(x), put(g), put(mean), put(rstd)]
            outs = [put(np.full(shapes[w], np.nan, np.float32)) for w in wanted]
            k.setup(ins, outs)
            if dev:   # the bits dy's scratch is the float32 dy's (run first)
                if name == "float32":
                    float32_specs = k.scratch_specs(ins, outs)
                assert k.scratch_specs(ins, outs) == float32_specs
                device.launched.clear()
            k.run(ins, outs)
            if dev and name == "bits":
                assert "from_bf16_bits" not in device.launched
                assert ("layernorm_backward_bdy_f32" in device.launched) == (
                    "dx" in wanted or "dg" in wanted)
                assert (_with_vec(Counter(device.launched)).get("sum_rows_bits_f32", 0) == 1) \
                    == ("db" in wanted)
            got[name] = [get(o) for o in outs]
        for a, b, w in zip(got["bits"], got["float32"], wanted):
            assert a.dtype == np.float32
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=w)


@pytest.mark.parametrize("case", ["second", "first", "both", "coeff"])
def test_the_residual_add_reads_a_term_stored_as_bits(device, case):
    """Eltwise sum with inputs stored as bfloat16 bits (an fc output with a
    bias, bf16 storage): y float32, the float32 storage's sum of the same
    values bit for bit -- one add_bits_f32 launch for two inputs, one of
    them bits, coefficients 1 (either order: the addition commutes
    exactly); otherwise each bits input widened (from_bf16_bits) first;
    the host path too. prod and max take no bits."""
    from purine_mpi.ops.tensor import Eltwise
    rng = np.random.default_rng(13)
    shape = (3, 7, 5)
    x, h = rng.standard_normal(shape).astype(np.float32), _bf16_values(rng, shape)
    attrs = {"operation": "sum"}
    values, stored = [x, h[0]], [x, h[1]]
    if case == "first":
        values, stored = values[::-1], stored[::-1]
    elif case == "both":
        g = _bf16_values(rng, shape)
        values, stored = [g[0], h[0]], [g[1], h[1]]
    elif case == "coeff":
        attrs["coeff"] = [1.0, -0.5]
    ((out_shape, out_dtype),) = Eltwise.infer(attrs, [(shape, a.dtype) for a in stored])
    assert out_shape == shape and np.dtype(out_dtype) == np.float32
    assert Eltwise.bits_inputs(attrs) == (0, 1)
    assert Eltwise.bits_inputs({"operation": "prod"}) == ()
    for dev, put, get in _places(device):
        got = {}
        for name, ins in (("float32", values), ("bits", stored)):
            k = make_kernel(Op("add", "Eltwise", ["a", "b"], ["y"], attrs))
            on = [put(a) for a in ins]
            y = put(np.full(shape, np.nan, np.float32))
            if dev:
                device.launched.clear()
            k.run(on, [y])
            got[name] = get(y)
            if dev and name == "bits":
                fused = case in ("first", "second")
                assert device.launched.count("add_bits_f32") == fused
                assert device.launched.count("from_bf16_bits") == (
                    0 if fused else sum(is_bits(a) for a in ins))
        np.testing.assert_array_equal(got["bits"].view(np.uint32), got["float32"].view(np.uint32))


def test_the_bits_kernels_equal_the_float32_kernels_on_adversarial_values(device):
    """The kernels of bf16 storage against the float32 storage's kernels on
    the same device, bit for bit, over the rounding's adversarial values
    (ties, carries into infinity, subnormals, infinities, NaNs with payload
    in the low bits; test_precision_device._adversarial), an odd length:
    bias_bits_f32 = bias_act then to_bf16_bits (the bias adding infinities,
    subnormals, -0); add_bits_f32 = the float32 addition of the widened
    term; the _bx GELU kernels (y float32, rounded to bfloat16 or float16
    in the pass or not, y as bits, the gradient) = the float32 x's."""
    from purine_mpi.gpu import kernels
    x32 = _adversarial()
    n = x32.size // 7 * 7 - 1   # odd
    src = x32[:n + 1].reshape(-1, 7)
    bias = np.array([0.0, -0.0, 1.0, 3e38, 1e-40, np.inf, 2.0 ** -130], np.float32)
    put, get = device.to_device, (lambda a: np.asarray(device.to_host(a)))
    got = put(np.zeros(src.shape, np.uint16))
    kernels.bias_bits(put(src), put(bias), got)
    wide = put(src.copy())
    kernels.bias_act(wide, put(bias))
    want = put(np.zeros(src.shape, np.uint16))
    kernels.to_bf16_bits_device(wide.reshape(-1), want.reshape(-1))
    np.testing.assert_array_equal(get(got), get(want))
    xb = _numpy_bits(x32[:n])
    x = (xb.astype(np.uint32) << np.uint32(16)).view(np.float32)   # the same values
    a = x32[::-1][:n].copy()
    y = put(np.zeros(n, np.float32))
    kernels.add_bits(put(a), put(xb), y)
    with np.errstate(all="ignore"):
        sum32 = get(put(a) + put(x))
    np.testing.assert_array_equal(get(y).view(np.uint32), sum32.view(np.uint32))
    for approximate in ("none", "tanh"):
        for round_to in (None, "bfloat16", "float16"):
            pair = [put(np.zeros(n, np.float32)) for _ in range(2)]
            with np.errstate(all="ignore"):
                for xs, out in zip((x, xb), pair):
                    kernels.gelu_forward(put(xs), approximate, out=out, round_to=round_to)
            np.testing.assert_array_equal(*(get(o).view(np.uint32) for o in pair))
        pair = [put(np.zeros(n, np.uint16)) for _ in range(2)]
        with np.errstate(all="ignore"):
            for xs, out in zip((x, xb), pair):
                kernels.gelu_forward_bits(put(xs), approximate, out)
        np.testing.assert_array_equal(*(get(o) for o in pair))
        pair = [put(np.zeros(n, np.float32)) for _ in range(2)]
        with np.errstate(all="ignore"):
            for xs, out in zip((x, xb), pair):
                kernels.gelu_backward(put(a), put(xs), approximate, out=out)
        np.testing.assert_array_equal(*(get(o).view(np.uint32) for o in pair))
        # dy as bits (a data gradient stored as bits), x float32 or bits
        want = put(np.zeros(n, np.float32))
        with np.errstate(all="ignore"):
            kernels.gelu_backward(put(x[::-1].copy()), put(x), approximate, out=want)
            for xs in (x, xb):
                out = put(np.zeros(n, np.float32))
                kernels.gelu_backward(put(xb[::-1].copy()), put(xs), approximate, out=out)
                np.testing.assert_array_equal(get(out).view(np.uint32),
                                              get(want).view(np.uint32))


@pytest.mark.parametrize("case", ["prod", "max", "strided", "float64"])
def test_an_eltwise_takes_add_bits_only_for_a_sum_of_contiguous_float32(device, case):
    """A bits term the pass never gives them (``bits_inputs``: sums only),
    but run directly: a prod or max of a float32 and a bits term on a
    device is the product / maximum of the values (not add_bits' sum), a
    strided bits term or a float64 one (y float64) is widened (a float32
    temporary) and summed -- the host path's values, bit for bit, never
    add_bits (which takes C-contiguous float32 arrays alone)."""
    rng = np.random.default_rng(14)
    shape = (4, 6)
    a = rng.standard_normal(shape)
    a = a if case == "float64" else a.astype(np.float32)
    values, bits = _bf16_values(rng, (4, 12) if case == "strided" else shape)
    attrs = {"operation": case if case in ("prod", "max") else "sum"}
    want = np.empty(shape, a.dtype)
    k = make_kernel(Op("e", "Eltwise", ["a", "b"], ["y"], attrs))
    k.run([a, values[:, ::2] if case == "strided" else values], [want])
    host = np.empty(shape, a.dtype)
    k.run([a, bits[:, ::2] if case == "strided" else bits], [host])
    np.testing.assert_array_equal(host, want)
    on = device.to_device(bits)
    y = device.to_device(np.full(shape, np.nan, a.dtype))
    device.launched.clear()
    k.run([device.to_device(a), on[:, ::2] if case == "strided" else on], [y])
    assert "add_bits_f32" not in device.launched
    got = np.asarray(device.to_host(y))
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_the_producers_infer_bits_storage_only_with_bits_out():
    from purine_mpi.ops.activation import Gelu
    from purine_mpi.ops.layernorm import LayerNorm
    assert Gelu.infer({"bits_out": [0]}, [((2, 3), "float32")]) == [((2, 3), "uint16")]
    assert Gelu.infer({}, [((2, 3), "float32")]) == [((2, 3), "float32")]
    # an x stored as bits: y float32 unless written as bits
    assert Gelu.infer({}, [((2, 3), "uint16")]) == [((2, 3), np.float32)]
    assert Gelu.infer({"bits_out": [0]}, [((2, 3), "uint16")]) == [((2, 3), "uint16")]
    from purine_mpi.ops.activation import GeluGrad
    assert GeluGrad.infer({}, [((2, 3), "float32"), ((2, 3), "uint16")]) == [((2, 3),
                                                                              "float32")]
    assert Gelu.bits_inputs({}) == (0,) and GeluGrad.bits_inputs({}) == (0, 1)
    ln = [((2, 3), "float32"), ((3,), "float32"), ((3,), "float32")]
    assert [d for _, d in LayerNorm.infer({"bits_out": [0]}, ln)] == ["uint16", "float32",
                                                                      "float32"]
    assert Gelu.bits_outputs({}) == LayerNorm.bits_outputs({}) == (0,)


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


@pytest.mark.parametrize("case", ["float32", "coeff", "bits", "first", "both", "strided",
                                  "prod", "max", "three"])
def test_an_eltwise_declares_the_device_scratch_it_takes(device, monkeypatch, case):
    """Eltwise's ``scratch_specs`` (plan's device scratch) is the scratch
    its device run takes (``temporaries``, reserved at setup so a capture
    allocates nothing): the general path's result (a residual add of two
    float32 blobs: GPT's in fp32), a scaled term where a coefficient is not
    1, a float32 copy of each bits term widened; nothing for the one
    ``add_bits`` kernel (a float32 and a bits term, contiguous: GPT's in
    bf16). From the blobs' stand-ins (plan: runtime/footprint._stand_in)
    the same, where the arrays are contiguous as blobs are. Before, it
    declared none: 'assert 1024 == 0' (float32)."""
    from purine_mpi.gpu.raw import op_scratch
    from purine_mpi.gpu.scratch import Scratch
    from purine_mpi.runtime.footprint import _stand_in
    rng = np.random.default_rng(15)
    shape = (4, 8, 8)
    x = rng.standard_normal(shape).astype(np.float32)
    values, bits = _bf16_values(rng, (4, 8, 16) if case == "strided" else shape)
    attrs = {"operation": case if case in ("prod", "max") else "sum"}
    stored = {"float32": [x, x], "coeff": [x, x], "bits": [x, bits], "first": [bits, x],
              "both": [bits, bits], "strided": [x, bits], "prod": [x, x], "max": [x, x],
              "three": [x, x, x]}[case]
    if case == "coeff":
        attrs["coeff"] = [1.0, -0.5]
    k = make_kernel(Op("e", "Eltwise", [f"x{i}" for i in range(len(stored))], ["y"], attrs))
    ins = [device.to_device(a) for a in stored]
    if case == "strided":   # a strided bits term: widened, not add_bits
        ins[1] = ins[1][..., ::2]
    y = device.to_device(np.full(shape, np.nan, np.float32))
    taken, real = [], Scratch.take
    monkeypatch.setattr(Scratch, "take",
                        lambda self, *specs: taken.append(Scratch._layout(specs)[1])
                        or real(self, *specs))
    k.setup(ins, [y])
    k.run(ins, [y])
    declared = Scratch._layout(k.scratch_specs(ins, [y]))[1] if k.scratch_specs(ins, [y]) \
        else 0
    assert max(taken, default=0) == declared, (case, taken, declared)
    assert (declared == 0) == (case in ("bits", "first"))
    assert op_scratch(k, 0).reserved == declared
    if case != "strided":   # plan's stand-ins of the (contiguous) blobs
        stand = [_stand_in(SimpleNamespace(shape=a.shape, dtype=a.dtype)) for a in stored]
        assert k.scratch_specs(stand, [_stand_in(SimpleNamespace(shape=shape,
                                                                  dtype=np.float32))]) == \
            k.scratch_specs(ins, [y])
    want = {"prod": x * x, "max": x, "three": x + x + x}.get(case)
    if want is not None:
        np.testing.assert_array_equal(np.asarray(device.to_host(y)), want)


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
def _gpt(monkeypatch, host_build_dir, precision="bf16", blocks=2):
    from purine_mpi.parallel.placement import prepare_for_device
    from tests.emulated_gpu import use_emulated_cupy
    from tests.gpt_oracle import gpt_graph, gpt_net
    from tests.test_precision import SOLVER
    use_emulated_cupy(monkeypatch, host_build_dir)
    net = gpt_net(vocab=16, width=16, heads=2, blocks=blocks, max_length=8, approximate="tanh")
    g, _, _ = gpt_graph(net, dict(SOLVER, max_iter=3), 2, 8)
    prepare_for_device(g, 0, precision=precision)
    return g


def test_the_pass_stores_as_bits_the_blobs_only_products_read(host_build_dir, monkeypatch):
    """In the 2-block GPT: the weights' copies, the layer norms' and GELU's
    outputs' copies, the attention's output and the gradients the products
    read are bits, each read by fc products (and the attention's output by
    the SDPA gradient) only and written by a producer marked ``bits_out``;
    so are the outputs of the products with a bias: the MLP's first fc
    output, read by GELU and its gradient, the attention's qkv, read by the
    fused attention and its gradient, and the projections' outputs, read by
    the residual adds; the biases' copies (read by the forward's epilogue)
    stay float32. The data gradients of bf16 values whose readers take
    bits: the MLP projection's (read by GELU's gradient), the attention
    projection's (dctx, read by the attention's gradient), the
    attention's dqkv (read by qkv's data, weight and bias gradients) and
    qkv's, fc1's and the lm-head's (read by the layer norms' gradients).
    Nothing with PURINE_BF16_STORAGE=0 or in fp16."""
    g = _gpt(monkeypatch, host_build_dir)
    cons, prod = g.consumers(), g.producers()
    bits = {n for n, b in g.blobs.items() if b.dtype == "uint16"}
    # h1_x1.grad: the attention's residual add's gradient, which is also the
    # attention output h1_a's (no copy: ops/tensor.py _eltwise_grad)
    for name in ("h0_attn/qkv_weight@bf16", "h1_fc/weight@bf16", "wte/weight@bf16",
                 "h0_n1@bf16", "h1_n2@bf16", "xf@bf16", "h0_m.grad@bf16", "h1_x1.grad@bf16",
                 "h0_attn.ctx", "h1_attn.ctx", "logits", "logits.grad@bf16", "h0_m", "h1_m",
                 "h0_attn.qkv", "h1_attn.qkv", "h0_a", "h1_mo"):
        assert name in bits, name
    assert g.blobs["h0_attn/qkv_bias@bf16"].dtype == "float32"
    assert any("gelu" in n for n in bits)
    writers = {}
    # the weights' copies: written by the fused AdamW update (through their
    # @new aliases, parallel/precision.fold_weight_casts), as bits
    (update,) = [op for op in g.ops.values() if op.op_type == "MultiAdamUpdate"]
    for name in [n for n in bits if g.blobs[n].kind == "param_copy"]:
        bits.discard(name)
        if g.blobs[name].alias_of is None:
            assert not prod[name] and g.blobs[name].attrs["precision"] == BF16
            writers[name] = update.op_type
        else:
            assert prod[name] == [update] and update.attrs["copy_bits"][
                update.outputs.index(name) - 3]
    for name in bits:
        assert g.blobs[name].attrs["precision"] == BF16
        (w,) = prod[name]
        assert w.outputs.index(name) in w.attrs["bits_out"]
        writers[name] = w.op_type
        assert all(r.op_type in ("InnerProduct", "InnerProductGradData",
                                 "InnerProductGradWeight", "AttentionGrad", "SoftmaxLoss",
                                 "SoftmaxLossGrad", "Gelu", "GeluGrad", "Attention",
                                 "Eltwise", "InnerProductGradBias", "LayerNormGrad")
                   for r in cons[name])
    # the layer norms and GELU write their copies themselves: no Cast, and
    # their float32 outputs are gone; the weights' by the update, the
    # logits' gradient by a Cast
    assert {n for n, t in writers.items() if t == "LayerNorm"} == {
        "h0_n1@bf16", "h0_n2@bf16", "h1_n1@bf16", "h1_n2@bf16", "xf@bf16"}
    assert sorted(n for n, t in writers.items() if t == "Gelu") == ["h0_m@h0_gelu@bf16",
                                                                   "h1_m@h1_gelu@bf16"]
    assert all(t == "MultiAdamUpdate" for n, t in writers.items()
               if n.endswith("@bf16") and "weight" in n)
    # the float32 gradients the products read as bits: GELU's dx, the
    # residual sums and ln_f's dx (its LayerNormGrad) write their bits
    # themselves: no Cast of a gradient is left
    assert {n: t for n, t in writers.items() if ".grad@bf16" in n and "logits" not in n} == {
        "h0_m.grad@bf16": "GeluGrad", "h1_m.grad@bf16": "GeluGrad",
        "h0_x1.grad@bf16": "Sum", "h1_x1.grad@bf16": "Sum", "h0_x.grad@bf16": "Sum",
        "h1_x.grad@bf16": "LayerNormGrad"}
    assert not any(op.op_type == "Cast" and ".grad" in op.inputs[0] for op in g.ops.values())
    # ln_f's dx: float32 for the last residual sum and the projection's bias
    # gradient, its bits (the LayerNormGrad's last output) for the products
    (w,) = prod["h1_x.grad@bf16"]
    assert w.outputs == ["h1_x.grad", "ln_f/weight.grad", "ln_f/bias.grad",
                         "h1_x.grad@bf16"]
    assert w.attrs["bits_copy"] == [0] and w.attrs["bits_out"] == [3]
    assert g.blobs["h1_x.grad"].dtype == "float32"
    assert sorted(r.op_type for r in cons["h1_x.grad"]) == ["InnerProductGradBias", "Sum"]
    assert sorted(r.op_type for r in cons["h1_x.grad@bf16"]) == ["InnerProductGradData",
                                                                 "InnerProductGradWeight"]
    for i in (0, 1):   # the residual sums: float32 for the next sum and the bias gradient
        for dx, copy in ((f"h{i}_x1.grad", f"h{i}_x1.grad@bf16"),) + (
                ((f"h{i}_x.grad", f"h{i}_x.grad@bf16"),) if i == 0 else ()):
            (w,) = prod[copy]
            assert w.outputs == [dx, copy] and w.attrs["bits_copy"] == [0]
            assert w.attrs["bits_out"] == [1] and g.blobs[dx].dtype == "float32"
            assert sorted(r.op_type for r in cons[dx]) == ["InnerProductGradBias", "Sum"]
    # GELU's gradient writes dx (float32 values, read by the fc bias gradient
    # as they are) and its bits for fc1's data and weight gradients, in one
    # pass: no Cast of dx (parallel/precision.fold_copies)
    for i in (0, 1):
        dx, copy = f"h{i}_m.grad", f"h{i}_m.grad@bf16"
        (w,) = prod[copy]
        assert w.op_type == "GeluGrad" and w.outputs == [dx, copy]
        assert w.attrs["bits_copy"] == [0] and w.attrs["bits_out"] == [1]
        assert g.blobs[dx].dtype == "float32"
        assert [r.op_type for r in cons[dx]] == ["InnerProductGradBias"]
        assert sorted(r.op_type for r in cons[copy]) == ["InnerProductGradData",
                                                         "InnerProductGradWeight"]
    assert not any(op.op_type == "Cast" and op.inputs[0].endswith("_m.grad")
                   for op in g.ops.values())
    # the layer norms' input gradients' dy (the data gradients of qkv, fc1
    # and the lm-head) written as bits by their GemmEx, read by the layer
    # norms' gradients, which write float32 gradients (ln_f's, xf.grad's
    # reader, its dx's bits too, as its last output)
    for dy in ("h0_n1.grad", "h0_n2.grad", "h1_n1.grad", "h1_n2.grad", "xf.grad"):
        assert writers[dy] == "InnerProductGradData", dy
        assert [r.op_type for r in cons[dy]] == ["LayerNormGrad"], dy
        outs = cons[dy][0].outputs
        assert all(g.blobs[o].dtype == "float32" for o in outs[:3])
        assert outs[3:] == (["h1_x.grad@bf16"] if dy == "xf.grad" else [])
    # the MLP projection's data gradient (bf16 values, read by GELU's gradient
    # alone) written as bits by its GemmEx; GELU's gradient reads it so and
    # writes a float32 dx (the fc bias gradient's input)
    for i in (0, 1):
        dgelu = f"h{i}_m@h{i}_gelu.grad"
        assert writers[dgelu] == "InnerProductGradData"
        assert [r.op_type for r in cons[dgelu]] == ["GeluGrad"]
        assert g.blobs[cons[dgelu][0].outputs[0]].dtype == "float32"
        # the attention's: dctx written as bits by the projection's data
        # gradient, read by the attention's gradient, which writes dqkv as
        # bits, read by qkv's three gradients (the bias's column sums too)
        dctx, dqkv = f"h{i}_attn.ctx.grad", f"h{i}_attn.qkv.grad"
        assert writers[dctx] == "InnerProductGradData"
        assert [r.op_type for r in cons[dctx]] == ["AttentionGrad"]
        assert writers[dqkv] == "AttentionGrad"
        assert sorted(r.op_type for r in cons[dqkv]) == [
            "InnerProductGradBias", "InnerProductGradData", "InnerProductGradWeight"]
        assert g.blobs[f"h{i}_attn/qkv_bias.grad"].dtype == "float32"
    assert writers["h0_attn.ctx"] == "Attention"
    # the MLP's first fc (with its bias) writes its output as bits, which
    # GELU and its gradient read
    for i in (0, 1):
        assert writers[f"h{i}_m"] == "InnerProduct" and len(prod[f"h{i}_m"][0].inputs) == 3
        assert sorted(r.op_type for r in cons[f"h{i}_m"]) == ["Gelu", "GeluGrad"]
        assert writers[f"h{i}_attn.qkv"] == "InnerProduct"
        assert sorted(r.op_type for r in cons[f"h{i}_attn.qkv"]) == ["Attention",
                                                                    "AttentionGrad"]
        for out in (f"h{i}_a", f"h{i}_mo"):   # the projections, read by the residual adds
            assert writers[out] == "InnerProduct" and [r.op_type for r in cons[out]] == [
                "Eltwise"]
            (add,) = cons[out]
            assert g.blobs[add.outputs[0]].dtype == "float32"
    # the logits: written by the lm-head's GemmEx (no bias), read by the loss
    # and its gradient from_logits (no probabilities: the gradient computes
    # them again), whose own gradient is written as bits by it (no Cast)
    assert writers["logits"] == "InnerProduct" and writers["logits.grad@bf16"] == \
        "SoftmaxLossGrad"
    assert sorted(r.op_type for r in cons["logits"]) == ["SoftmaxLoss", "SoftmaxLossGrad"]
    assert all(r.attrs["from_logits"] for r in cons["logits"])
    assert not any(b.endswith(".prob") for b in g.blobs)
    assert "logits.grad" not in g.blobs
    for gone in ("h0_n1", "xf", "h0_m@h0_gelu"):
        assert gone not in g.blobs
    casts = {op.inputs[0] for op in g.ops.values() if op.op_type == "Cast"}
    assert not casts & {"h0_n1", "xf", "h0_m@h0_gelu"}
    # the memory plan sizes them at 2 bytes an element
    from purine_mpi.runtime.factory import memory_plans
    from purine_mpi.runtime.memory_plan import batch_blobs
    _, devices = memory_plans(g, keep=batch_blobs(g))
    plan = devices[0]
    for name in ("h0_n1@bf16", "h0_m.grad@bf16", "logits", "logits.grad@bf16", "h0_m",
                 "h0_attn.qkv", "h0_m@h0_gelu.grad"):
        assert plan.sizes[name] == 2 * int(np.prod(g.blobs[name].shape)), name
    # the logits' gradient on the logits' bytes (each chunk read before written)
    assert plan.in_place["logits.grad@bf16"][0] == "logits"
    monkeypatch.setenv("PURINE_BF16_STORAGE", "0")
    assert all(b.dtype != "uint16" for b in _gpt(monkeypatch, host_build_dir).blobs.values())
    monkeypatch.delenv("PURINE_BF16_STORAGE")
    assert all(b.dtype != "uint16"
               for b in _gpt(monkeypatch, host_build_dir, "fp16").blobs.values())


def test_the_biased_outputs_as_bits_shrink_the_device_plan(host_build_dir, monkeypatch):
    """The 2-block GPT's device arena (runtime/memory_plan) is smaller with
    the fc outputs that have a bias stored as bits (the MLP's fc output,
    qkv and the projections': 8 more blobs of bits) than under the former
    rule, where a product with a bias could not write bits
    (``bits_outputs_of``)."""
    from purine_mpi.ops.fc import InnerProduct
    from purine_mpi.runtime.factory import memory_plans
    from purine_mpi.runtime.memory_plan import batch_blobs

    def plan(former):
        with monkeypatch.context() as m:
            if former:
                m.setattr(InnerProduct, "bits_outputs_of", classmethod(
                    lambda cls, op: () if len(op.inputs) == 3 else cls.bits_outputs(op.attrs)))
            g = _gpt(m, host_build_dir)
        _, devices = memory_plans(g, keep=batch_blobs(g))
        return devices[0].total_bytes, {n for n, b in g.blobs.items() if b.dtype == "uint16"}

    (now, bits), (before, bits_before) = plan(False), plan(True)
    assert bits - bits_before == {f"h{i}_{n}" for i in (0, 1)
                                  for n in ("m", "attn.qkv", "a", "mo")}
    assert now < before, (now, before)


@pytest.mark.parametrize("blocks", [1, 2])
def test_the_gradients_copies_take_no_more_device_memory_than_their_casts(host_build_dir,
                                                                         monkeypatch, blocks):
    """The GPT's device arena (runtime/memory_plan) with the gradients'
    copies written by their producers (``fold_copies``) is no larger than
    with the Casts that wrote them: GELU's gradient writes dx's bits over
    its dy stored as bits (``GeluGrad.in_place`` (0, 1): dy is read before
    the copy is written, 2 bytes an element each), where its dy and x
    died at it and the Cast's copy came after them. Here the arena peaks
    at GELU's gradient (vocabulary 16, an MLP 4x wide): with the copy of
    its own beside dy it grew by the copy (one block: 1536 -> 1792
    bytes)."""
    # the weights' Casts kept (PURINE_FOLD_WEIGHT_CASTS=0): their copies
    # then transient, as when this was measured (the fold makes them
    # persistent, tests/test_weight_cast_fold.py)
    monkeypatch.setenv("PURINE_FOLD_WEIGHT_CASTS", "0")
    from purine_mpi.parallel import precision
    from purine_mpi.runtime.factory import memory_plans
    from purine_mpi.runtime.memory_plan import batch_blobs

    def plan(fold):
        with monkeypatch.context() as m:
            if not fold:
                m.setattr(precision, "fold_copies", lambda graph: [])
            g = _gpt(m, host_build_dir, blocks=blocks)
        _, devices = memory_plans(g, keep=batch_blobs(g))
        return g, devices[0]

    (g, now), (_, before) = plan(True), plan(False)
    grads = [op for op in g.ops.values() if op.op_type == "GeluGrad"]
    assert len(grads) == blocks and all(op.attrs.get("bits_copy") == [0] for op in grads)
    for op in grads:   # the copy on the bits dy's bytes
        assert g.blobs[op.inputs[0]].dtype == "uint16"
        assert now.in_place.get(op.outputs[1]) == (op.inputs[0], op.name), op.name
    assert now.total_bytes <= before.total_bytes, (now.total_bytes, before.total_bytes)


@pytest.mark.parametrize("blocks", [1, 2])
def test_a_gradient_sums_copy_holds_no_more_live_bytes_than_its_cast(host_build_dir,
                                                                     monkeypatch, blocks):
    """A residual gradient's Sum with its bits copy (``fold_copies``) writes
    y over a term that dies there (``Sum.in_place_of``), so the live bytes of
    the GPT's device plan at each such sum are fewer than at that sum when
    the Cast wrote the bits after it and y took bytes of its own (the former
    Sum, no ``in_place``): 4 + 4 + 2 bytes an element against 4 + 4 + 4
    (with the copy beside y of its own, 4 + 4 + 4 + 2: in gpt_tiny 2 MiB
    more at each residual sum). The arena is no larger."""
    # the weights' Casts kept (PURINE_FOLD_WEIGHT_CASTS=0): their copies
    # then transient, as when this was measured (the fold makes them
    # persistent, tests/test_weight_cast_fold.py)
    monkeypatch.setenv("PURINE_FOLD_WEIGHT_CASTS", "0")
    from purine_mpi.parallel import precision
    from purine_mpi.runtime.factory import memory_plans
    from purine_mpi.runtime.footprint import live_bytes
    from purine_mpi.runtime.memory_plan import batch_blobs

    def plan(former):
        with monkeypatch.context() as m:
            if former:
                m.setattr(precision, "fold_copies", lambda graph: [])
            g = _gpt(m, host_build_dir, blocks=blocks)
            _, devices = memory_plans(g, keep=batch_blobs(g))
        p = devices[0]
        live = dict(zip(p.order, live_bytes(p)))
        return g, p, {op.outputs[0]: live[op.name] for op in g.ops.values()
                      if op.op_type == "Sum" and op.outputs[0].endswith(".grad")}

    (g, now, at_now), (g0, before, at_before) = plan(False), plan(True)
    assert not any(op.op_type == "Sum" and x in before.in_place for op in g0.ops.values()
                   for x in op.outputs)
    sums = [op for op in g.ops.values() if op.attrs.get("bits_copy") and op.op_type == "Sum"]
    assert len(sums) == 2 * blocks - 1, [op.name for op in sums]
    for op in sums:
        assert now.in_place.get(op.outputs[0]) in ((x, op.name) for x in op.inputs), op.name
        assert at_now[op.outputs[0]] < at_before[op.outputs[0]], (op.name, at_now, at_before)
    assert now.total_bytes <= before.total_bytes, (now.total_bytes, before.total_bytes)


def test_the_layer_norm_gradients_copy_takes_no_more_device_memory_than_its_cast(
        host_build_dir, monkeypatch):
    """The layer norm gradient's dx copy (``fold_copies``) takes the bytes of
    its dy stored as bits where dy dies at it (``LayerNormGrad.in_place_of``:
    the copy, after the gradients, over dy), as the Cast's copy came after
    dy died: the device arena of a net whose plan peaks at the layer norm's
    gradient (fc1 -> layer norm -> head of 16 classes, 64 wide: its dx read
    by fc1's bias gradient as float32 and, as bits, by fc1's data and
    weight gradients) is no larger than with the Cast. With the copy of its
    own beside dy it grew by the copy (41984 -> 46080 bytes)."""
    from purine_mpi.parallel import precision
    from purine_mpi.parallel.placement import prepare_for_device
    from purine_mpi.runtime.factory import memory_plans
    from purine_mpi.runtime.memory_plan import batch_blobs
    from tests.emulated_gpu import use_emulated_cupy
    from tests.gpt_oracle import gpt_graph
    from tests.test_precision import SOLVER
    net = [{"type": "embedding", "name": "wte", "bottom": "data", "top": "tok",
            "input_dim": 16, "num_output": 64},
           {"type": "fc", "name": "fc1", "bottom": "tok", "top": "h", "axis": -1,
            "num_output": 64},
           {"type": "layer_norm", "name": "ln", "bottom": "h", "top": "n"},
           {"type": "fc", "name": "head", "bottom": "n", "top": "logits", "axis": -1,
            "num_output": 16, "bias_term": False},
           {"type": "softmax_loss", "name": "loss", "bottom": ["logits", "label"],
            "top": "loss", "axis": -1}]

    def plan(fold):
        with monkeypatch.context() as m:
            if not fold:
                m.setattr(precision, "fold_copies", lambda graph: [])
            use_emulated_cupy(m, host_build_dir)
            g, _, _ = gpt_graph(net, dict(SOLVER, max_iter=3), 4, 8)
            prepare_for_device(g, 0, precision="bf16")
        _, devices = memory_plans(g, keep=batch_blobs(g))
        return g, devices[0]

    (g, now), (_, before) = plan(True), plan(False)
    (op,) = [op for op in g.ops.values() if op.op_type == "LayerNormGrad"]
    assert op.attrs.get("bits_copy") == [0] and len(op.outputs) == 4, op.outputs
    assert g.blobs[op.inputs[0]].dtype == "uint16"
    assert now.in_place.get(op.outputs[3]) == (op.inputs[0], op.name)
    assert now.total_bytes <= before.total_bytes, (now.total_bytes, before.total_bytes)


@pytest.mark.parametrize("wanted", [("dx", "dg", "db"), ("dx",), ("dx", "db")])
def test_the_layer_norm_gradient_writes_dx_s_bits_over_its_bits_dy(device, wanted):
    """LayerNormGrad with ``bits_copy`` and the copy on the bytes of its dy
    stored as bits (what ``in_place_of`` lets the memory plan do): dx, dg,
    db and the copy the bits of separate arrays, on the device (db's column
    sums of dy before the backward kernel writes the copy over dy) and on
    the host (dy widened first). Only a copy after the gradients over a
    bits dy is declared, none without ``bits_copy``."""
    from purine_mpi.ops.layernorm import LayerNormGrad
    rows, cols = 70, 96
    rng = np.random.default_rng(43)
    x, g, mean, rstd = _ln_grad_inputs(rng, rows, cols)
    _, dyb = _bf16_values(rng, (rows, cols))
    attrs = {"outputs": list(wanted), "bits_copy": [0], "bits_out": [len(wanted)]}
    shapes = {"dx": (rows, cols), "dg": (cols,), "db": (cols,)}
    names = ["dy", "x", "g", "mean", "rstd"]
    assert LayerNormGrad.in_place_of(attrs) == ((0, len(wanted)),)
    assert LayerNormGrad.in_place_of({"outputs": list(wanted)}) == ()
    for dev, put, get in _places(device):
        k = make_kernel(Op("lg", "LayerNormGrad", names, list(wanted) + ["dx@bf16"], attrs))
        results = []
        for shared in (False, True):
            dy = put(dyb.copy())
            ins = [dy, put(x), put(g), put(mean), put(rstd)]
            copy = dy.reshape(rows, cols)[...] if shared else put(np.zeros((rows, cols),
                                                                         np.uint16))
            outs = [put(np.full(shapes[w], np.nan, np.float32)) for w in wanted] + [copy]
            k.setup(ins, outs)
            k.run(ins, outs)
            results.append([get(a).copy() for a in outs])
            if shared:   # the copy written over dy's bytes
                np.testing.assert_array_equal(get(dy), results[-1][-1])
        for a, b, w in zip(results[0], results[1], list(wanted) + ["copy"]):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=w)


def test_a_reader_that_cannot_take_bits_keeps_the_float32_storage():
    """A copy read by a product and by an op that takes no bits (here a
    weight gradient of rows, whose dy is a strided slice) stays float32;
    the same copy read by products alone becomes bits."""
    from purine_mpi.graph.core import Graph
    from purine_mpi.parallel.precision import store_bits

    def graph(rows):
        g = Graph()
        # sources kept (a weight) or read by more than their Cast (a bias
        # gradient): no in-place float32 copy would take their bytes
        g.add_blob("x", (4, 8), "float32", None, kind="param")
        g.add_blob("dy", (4, 6), "float32", None, kind="data")
        g.add_blob("db", None, "float32", None, kind="data")
        g.add_op("fb", "InnerProductGradBias", ["dy"], ["db"])
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


@pytest.mark.parametrize("case", ["folded", "accumulate", "in_place", "elsewhere", "kept",
                                  "waits", "no_copies"])
def test_fold_copies_folds_a_cast_into_a_producer_that_can_write_the_bits(case):
    """A Cast to bits (``bits_out``) of a float32 gradient that a bias
    gradient reads too: folded into the producer (GeluGrad, ``bits_copies``)
    as its second output (attrs ``bits_copy`` [0], ``bits_out`` [1]; an op
    that waited for the Cast waits for the producer), the float32 blob kept
    for the bias gradient; not where the producer accumulates, writes the
    blob in place over an input, lives on another device than the Cast,
    where the blob is kept across iterations (a parameter's), where the
    Cast waits on a control input, nor where the producer copies nothing
    (a Relu gradient)."""
    from purine_mpi.graph.core import Graph
    from purine_mpi.parallel.precision import fold_copies, store_bits
    g = Graph()
    dev = "gpu:0"
    grad = "ReluGrad" if case == "no_copies" else "GeluGrad"
    for name in ("dy", "x"):
        g.add_blob(name, (4, 6), "float32", dev, kind="data")
    g.add_blob("dx", (4, 6), "float32", dev, kind="param" if case == "kept" else "data")
    g.add_op("gg", grad, ["dy", "x"] if case != "in_place" else ["dx", "x"], ["dx"],
             {"approximate": "tanh"} if grad == "GeluGrad" else {},
             location="gpu:1" if case == "elsewhere" else dev,
             accumulate=case == "accumulate")
    if case == "waits":
        g.add_op("before", "Noop", [], [], {"shape": []}, location=dev)
    g.add_blob("db", None, "float32", dev, kind="data")
    g.add_op("fb", "InnerProductGradBias", ["dx"], ["db"], location=dev)
    g.add_blob("dx@bf16", None, "float32", dev, kind="data", attrs={"precision": BF16})
    g.add_op("cast", "Cast", ["dx"], ["dx@bf16"], {"dtype": BF16}, location=dev,
             control_inputs=["before"] if case == "waits" else ())
    g.add_blob("dw", None, "float32", dev, kind="data")
    g.add_op("fw", "InnerProductGradWeight", ["dx@bf16", "x"], ["dw"],
             {"compute_dtype": BF16}, location=dev)
    g.add_op("after", "Noop", [], [], {"shape": []}, location=dev, control_inputs=["cast"])
    assert store_bits(g) == ["dx@bf16"]
    folded = fold_copies(g)
    g.infer_shapes()
    assert g.blobs["dx"].dtype == "float32" and g.blobs["dx@bf16"].dtype == "uint16"
    if case != "folded":
        assert folded == [] and "cast" in g.ops and g.ops["gg"].outputs == ["dx"]
        return
    assert folded == ["cast"] and "cast" not in g.ops
    op = g.ops["gg"]
    assert op.outputs == ["dx", "dx@bf16"]
    assert op.attrs["bits_copy"] == [0] and op.attrs["bits_out"] == [1]
    assert [r.name for r in g.consumers()["dx"]] == ["fb"]
    assert g.ops["after"].control_inputs == ["gg"]


def test_fold_copies_runs_the_float32_readers_before_the_readers_of_the_bits():
    """The bias gradient (emitted after the fc's data and weight gradients,
    as the fc's backward emits them) reads the float32 dx; the products its
    bits. With the Cast, the products waited for it and the schedule
    (``Graph.topo_order``: emission order breaks ties) ran the bias gradient
    first, ending dx's lifetime; folded, the products would be ready at
    once and hold dx across them. ``fold_copies`` moves a float32 reader
    that would be ready as early before the first reader of the bits; one
    that waits for an op emitted later (a sum of dx and the weight
    gradient's output) stays where it is, and so does a comm op."""
    from purine_mpi.graph.core import Graph
    from purine_mpi.parallel.precision import fold_copies, store_bits
    g = Graph()
    dev = "gpu:0"
    for name in ("dy", "x", "dx"):
        g.add_blob(name, (6, 6), "float32", dev, kind="data")   # square: dw is dx's shape
    g.add_op("gg", "GeluGrad", ["dy", "x"], ["dx"], {"approximate": "tanh"}, location=dev)
    g.add_blob("dx@bf16", None, "float32", dev, kind="data", attrs={"precision": BF16})
    g.add_op("cast", "Cast", ["dx"], ["dx@bf16"], {"dtype": BF16}, location=dev)
    for name in ("dw", "db", "dd"):
        g.add_blob(name, None, "float32", dev, kind="data")
    g.add_op("fw", "InnerProductGradWeight", ["dx@bf16", "x"], ["dw"],
             {"compute_dtype": BF16}, location=dev)
    g.add_op("fb", "InnerProductGradBias", ["dx"], ["db"], location=dev)
    g.add_op("later", "Sum", ["dx", "dw"], ["dd"], location=dev)   # waits for fw
    # a pipeline's send of dx: a comm op keeps its place
    g.add_op("send", "Send", ["dx"], [], {"seq": 0, "peer": 1, "tag": 0}, location=dev,
             thread="comm")
    g.infer_shapes()
    assert [op.name for op in g.topo_order()] == ["gg", "cast", "fw", "fb", "later", "send"]
    assert store_bits(g) == ["dx@bf16"] and fold_copies(g) == ["cast"]
    g.infer_shapes().validate()
    assert list(g.ops) == ["gg", "fb", "fw", "later", "send"]
    assert [op.name for op in g.topo_order()] == ["gg", "fb", "fw", "later", "send"]


# ------------------------------------------------------ training, bitwise
def _train(monkeypatch, host_build_dir, storage, iters=3, blocks=2, sdpa=False):
    """(losses, weights, launches by kernel per step) of ``iters`` AdamW
    steps of the bf16 GPT on the emulated device, CUDA graphs on, with
    PURINE_BF16_STORAGE=``storage``; with ``sdpa`` the attention through
    the emulated cuDNN frontend's SDPA (tests/test_sdpa.py)."""
    from tests.emulated_gpu import use_emulated_cupy
    from tests.emulated_gpu.helpers import bf16_gpt_steps
    from tests.test_precision import SOLVER
    with monkeypatch.context() as m:
        m.setenv("PURINE_BF16_STORAGE", storage)
        use_emulated_cupy(m, host_build_dir)
        fake = None
        if sdpa:
            from tests.test_sdpa import emulate_cudnn
            fake = emulate_cudnn(m)
        losses, weights, steps = bf16_gpt_steps(m, SOLVER, iters, blocks, cuda_graph=True)
        assert not sdpa or len(fake.executed) == iters * blocks * 2   # SDPA ran
        return losses, weights, steps


def _assert_dropout_grads_write_bits(g, grads):
    """The 2-block GPT's dropout gradients ``grads`` that write dx's bits
    themselves (``bits_copy``): the four residual dropouts', each dx read
    by the bias gradient, its bits by the data and weight products.
    Returns them."""
    cons = g.consumers()
    copied = [op for op in grads if op.attrs.get("bits_copy")]
    assert len(copied) == 4   # the two blocks' attention and MLP residual dropouts
    for op in copied:
        dx, copy = op.outputs
        assert op.attrs["bits_copy"] == [0] and op.attrs["bits_out"] == [1]
        assert g.blobs[dx].dtype == "float32" and g.blobs[copy].dtype == "uint16"
        assert [r.op_type for r in cons[dx]] == ["InnerProductGradBias"]
        assert sorted(r.op_type for r in cons[copy]) == ["InnerProductGradData",
                                                         "InnerProductGradWeight"]
    return copied


@pytest.mark.parametrize("attention", ["cublas", "sdpa"])
def test_a_bf16_gpt_trains_bitwise_the_same_with_bits_storage(host_build_dir, monkeypatch,
                                                              attention):
    """Four captured AdamW steps of the 2-block GPT in bf16, the attention
    on the cuBLAS path or cuDNN's SDPA (the emulated frontend): the losses
    and every weight bit for bit the same with bits storage as with float32
    storage (the bits are the upper halves of the roundings the float32
    path's products convert; SDPA writes and reads ctx as its own 16-bit
    values), and fewer to_bf16_bits and round_bf16 launches a step
    (counted on the eager first step: the captured steps replay the same
    launches)."""
    sdpa = attention == "sdpa"
    on = _train(monkeypatch, host_build_dir, "1", iters=4, sdpa=sdpa)
    off = _train(monkeypatch, host_build_dir, "0", iters=4, sdpa=sdpa)
    assert on[0] == off[0]
    assert sorted(on[1]) == sorted(off[1])
    for name in on[1]:
        np.testing.assert_array_equal(on[1][name].view(np.uint32), off[1][name].view(np.uint32),
                                      err_msg=name)
    assert on[0][-1] != on[0][0]   # it trains
    first_on, first_off = on[2][0], off[2][0]
    assert first_on["to_bf16_bits"] < first_off["to_bf16_bits"]
    assert first_on["round_bf16"] < first_off["round_bf16"]
    # the MLP's fc1 (with a bias) writes its output as bits, GELU and its
    # gradient read x as bits (one launch each per block), the gradient its dy
    # too (the projection's data gradient, written as bits by its GemmEx),
    # none without bits storage
    # and writes dx's bits beside its float32 dx (no Cast of dx)
    # every launch of the kernels with a _vec twin (cuda/activation.cu) takes
    # the twin: the arena's blobs and the scratch are 256-byte aligned, the
    # widths multiples of 8; below, the launches of both counted together
    for func in ("bias_bits_f32", "gelu_forward_bx_bits_f32", "gelu_backward_bdy_bx_copy_f32"):
        assert first_on.get(func, 0) == 0 and first_on[func[:-4] + "_vec_f32"] > 0, func
    first_on, first_off = _with_vec(first_on), _with_vec(first_off)
    gelu = first_on["gelu_forward_bx_bits_f32"]
    assert gelu > 0 and first_on["gelu_backward_bdy_bx_copy_f32"] == gelu
    assert first_on.get("gelu_backward_bdy_bx_f32", 0) == 0
    # the residual gradients' sums write their bits too: a block's two, but
    # for the last block's first, ln_f's dx (its LayerNormGrad writes them,
    # reading the lm-head's data gradient as bits) -- three sums for the two
    # blocks' GELUs
    assert 2 * first_on["add_copy_f32"] == 3 * gelu
    assert 2 * first_on["layernorm_backward_bdy_copy_f32"] == gelu   # one ln_f, two blocks
    # qkv, the attention's projection, fc1 and fc2 (with their biases)
    # write bits: four for each GELU; the two residual adds read them
    assert first_on["bias_bits_f32"] == 4 * gelu
    assert first_on["add_bits_f32"] == 2 * gelu
    for func in ("bias_bits_f32", "gelu_forward_bx_bits_f32", "gelu_backward_bx_f32",
                 "gelu_backward_bdy_bx_f32", "gelu_backward_bdy_bx_copy_f32", "add_bits_f32",
                 "add_copy_f32", "layernorm_backward_bdy_copy_f32"):
        assert first_off.get(func, 0) == 0, func


def _with_vec(counts):
    """Launch counts with each ``<name>_vec_f32``'s added to ``<name>_f32``'s
    (the launchers take the vectorised twin where the bases are aligned)."""
    out = dict(counts)
    for name, count in counts.items():
        if name.endswith("_vec_f32"):
            base = name[:-len("_vec_f32")] + "_f32"
            out[base] = out.get(base, 0) + count
    return out


def test_a_bf16_gpt_with_dropout_writes_the_dropout_gradients_bits_and_trains_the_same(
        host_build_dir, monkeypatch):
    """The 2-block GPT with dropout 0.1 (the attention's and the MLP's
    residual dropouts, redrawn on the device): each redrawn dropout
    gradient read by a bias gradient and, through a Cast, by products
    writes dx's bits itself (``bits_copy``, ``fold_copies``): no Cast of a
    gradient is left. Three captured AdamW steps give the same losses and
    weights bit for bit with bits storage as with float32 storage, the
    redrawn gradients as ``dropout_apply_copy_f32`` launches."""
    import functools

    import tests.gpt_oracle as oracle
    monkeypatch.setattr(oracle, "gpt_net", functools.partial(oracle.gpt_net, dropout=0.1))
    g = _gpt(monkeypatch, host_build_dir)
    grads = [op for op in g.ops.values() if op.op_type == "DropoutRedrawGrad"]
    assert grads and not any(op.op_type == "Cast" and ".grad" in op.inputs[0]
                             for op in g.ops.values())
    copied = _assert_dropout_grads_write_bits(g, grads)
    on = _train(monkeypatch, host_build_dir, "1", iters=3)
    off = _train(monkeypatch, host_build_dir, "0", iters=3)
    assert on[0] == off[0] and on[0][-1] != on[0][0]
    for name in off[1]:
        np.testing.assert_array_equal(on[1][name].view(np.uint32), off[1][name].view(np.uint32),
                                      err_msg=name)
    assert on[2][0]["dropout_apply_copy_f32"] == 2 * len(copied)   # eager and captured
    assert off[2][0].get("dropout_apply_copy_f32", 0) == 0


def test_a_bf16_gpt_with_kept_dropout_masks_writes_the_dropout_gradients_bits(
        host_build_dir, monkeypatch):
    """The 2-block GPT with dropout 0.1 and its masks kept (no redraw: what
    activation recompute's packed masks or a tensor-parallel shard leave):
    each ``DropoutGrad`` read by a bias gradient and, through a Cast, by
    products writes dx's bits itself (``bits_copy``): no Cast of a gradient
    is left, and the device plan is no larger than with those Casts."""
    import functools

    import tests.gpt_oracle as oracle
    from purine_mpi.parallel import placement, precision
    from purine_mpi.runtime.factory import memory_plans
    from purine_mpi.runtime.memory_plan import batch_blobs
    monkeypatch.setattr(oracle, "gpt_net", functools.partial(oracle.gpt_net, dropout=0.1))
    monkeypatch.setattr(placement, "redraw_dropout_masks", lambda graph: [])

    def plan(fold):
        with monkeypatch.context() as m:
            if not fold:
                m.setattr(precision, "fold_copies", lambda graph: [])
            g = _gpt(m, host_build_dir)
            _, devices = memory_plans(g, keep=batch_blobs(g))
        return g, devices[0]

    (g, now), (g0, before) = plan(True), plan(False)
    grads = [op for op in g.ops.values() if op.op_type == "DropoutGrad"]
    assert grads and not any(op.op_type == "DropoutRedrawGrad" for op in g.ops.values())
    assert not any(op.op_type == "Cast" and ".grad" in op.inputs[0] for op in g.ops.values())
    assert any(op.op_type == "Cast" and ".grad" in op.inputs[0] for op in g0.ops.values())
    _assert_dropout_grads_write_bits(g, grads)
    assert now.total_bytes <= before.total_bytes, (now.total_bytes, before.total_bytes)


@pytest.mark.parametrize("way", ["micro_batches", "recompute", "dropout"])
def test_the_trainer_with_micro_batches_and_checkpoints_is_bitwise_the_same(
        host_build_dir, monkeypatch, tmp_path, way):
    """The trainer on the emulated device (CUDA graphs, a checkpoint every 3
    iterations; two micro-batches a step, or one with the layer norms and
    GELU recomputed before the backward, ``recompute: full``, or residual
    dropouts with every layer recomputed: their masks kept packed, their
    gradients DropoutGrad with a bits copy), a 2-block
    GPT of width 32 in bf16 for 6 iterations: the losses, the checkpoints'
    float32 masters (no @bf16 blob in them) and the final weights bit for
    bit the same with bits storage as without (the residual gradients' sums
    with bits computed over a term); and a bits-storage run
    resumes from the float32-storage run's checkpoint to the same final
    weights."""
    import json

    import h5py

    from purine_mpi.base.backend import to_numpy
    from purine_mpi.job.config import validate_config
    from purine_mpi.train.trainer import Trainer, run_and_report
    from tests.conftest import FakeWorld, make_job
    from tests.emulated_gpu import emulated_trainer_env
    from tests.gpt_nets import gpt_config, text_h5
    emulated_trainer_env(monkeypatch, host_build_dir)

    def train(name, storage, resume=None):
        monkeypatch.setenv("PURINE_BF16_STORAGE", storage)
        raw = gpt_config(text_h5(tmp_path), layers=2, width=32, heads=4, length=16, batch=4,
                         iters=6, parallel={"micro_batches": 2} if way == "micro_batches"
                         else None)
        raw.update(device=0, precision="bf16", cuda_graph=True)
        if way == "recompute":
            raw.update(recompute="full", recompute_layers=["b*_ln1", "b*_ln2", "b*_gelu"])
        if way == "dropout":   # residual dropouts, every layer recomputed: kept packed masks
            at = [i for i, layer in enumerate(raw["net"]) if layer["name"].endswith("_proj")]
            for i in reversed(at):
                top = raw["net"][i]["top"]
                raw["net"].insert(i + 1, {"type": "dropout", "name": top + "_drop",
                                          "bottom": top, "top": top, "ratio": 0.1})
            raw.update(recompute="full")
        raw["data"].pop("test")
        raw["solver"].update(base_lr=0.01, test_interval=0)
        raw["checkpoint"] = {"interval": 3, "keep": 0}
        out = tmp_path / name
        t = Trainer(make_job(validate_config(raw, check_files=False)), str(out),
                    world=FakeWorld(), log=lambda line: None, resume=resume)
        graph = t.graphs.graph
        bits = sorted(n for n, b in graph.blobs.items() if b.dtype == "uint16")
        if way == "recompute" and storage == "1":   # the copies write bits too
            recomputed = [op for op in graph.ops.values() if op.op_type in ("LayerNorm", "Gelu")
                          and op.attrs.get("bits_out") and "recompute" in op.name]
            assert len(recomputed) >= 4, [op.name for op in graph.ops.values()]
        if way == "dropout" and storage == "1":   # DropoutGrad writes dx's bits (bits_copy)
            assert any(op.op_type == "DropoutGrad" and op.attrs.get("bits_copy")
                       for op in graph.ops.values()), sorted(graph.ops)
        if storage == "1":   # the residual gradients' sums written over a term (in_place_of)
            plan = t.train.workspace.device_plans[0]
            sums = [op for op in graph.ops.values()
                    if op.op_type == "Sum" and op.attrs.get("bits_copy")]
            assert sums and all(plan.in_place.get(op.outputs[0], (None,))[0] in op.inputs
                                for op in sums), (sorted(plan.in_place), [s.name for s in sums])
        assert run_and_report(t, FakeWorld()) == 0
        rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
        losses = {r["iter"]: r["loss"] for r in rows if r["phase"] == "train"}
        final = {p: np.array(to_numpy(t.train.workspace[p])) for p in t.graphs.params}
        with h5py.File(out / "ckpt_3.h5", "r") if resume is None else _nothing() as f:
            saved = {} if f is None else {n: f["params"][n][()] for n in _datasets(f["params"])}
        return bits, losses, final, saved, out

    on = train("bits", "1")
    off = train("float32", "0")
    assert on[0] and not off[0]   # bits storage applied in one run only
    assert any(n.startswith("logits") for n in on[0]), on[0]   # the loss from its bits
    assert on[1] == off[1] and sorted(on[1]) == list(range(1, 7))
    for a, b in ((on[2], off[2]), (on[3], off[3])):
        assert sorted(a) == sorted(b) and a
        for name in a:
            np.testing.assert_array_equal(a[name].view(np.uint32), b[name].view(np.uint32),
                                          err_msg=name)
    assert not any("@" in n for n in on[3])
    resumed = train("resumed", "1", resume=str(off[4] / "ckpt_3.h5"))
    for name in on[2]:
        np.testing.assert_array_equal(resumed[2][name].view(np.uint32),
                                      on[2][name].view(np.uint32), err_msg=name)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _datasets(group):
    names = []
    group.visit(lambda n: names.append(n) if hasattr(group[n], "shape") else None)
    return names


def test_predict_reads_a_blob_stored_as_bits_as_its_values(host_build_dir, monkeypatch):
    """``predict --blobs h0_n1`` reads the newest version of the layer
    norm's top, its bf16 copy, stored as bits in the bf16 GPT: predict
    writes the bfloat16 values (float32), not the uint16 bits as numbers."""
    from purine_mpi.tools.predict import newest_version, read_blob
    g = _gpt(monkeypatch, host_build_dir)
    name = newest_version(g, "h0_n1")
    assert g.blobs[name].dtype == "uint16", name
    values = np.array([[1.0, -2.5], [3.140625, 0.0]], np.float32)   # bfloat16 values
    got = read_blob(g, {name: _numpy_bits(values)}, name)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, values)
    # a blob of float32 storage is read as it is
    other = newest_version(g, "h0_attn/qkv_bias")
    assert g.blobs[other].dtype == "float32"
    np.testing.assert_array_equal(read_blob(g, {other: values}, other), values)


# ------------------------------------------- fc outputs and the loss as bits
def test_gemm_ex_writes_the_bits_of_its_float32_results_rounding(device):
    """GemmEx of bfloat16 operands into a bfloat16 result (uint16 bits):
    the bits of the float32 GemmEx's result rounded to the nearest
    bfloat16 (ties to even), in one call; a result of bits takes bfloat16
    operands, alpha 1 and beta 0 only."""
    from purine_mpi.gpu.blas import gemm_ex
    rng = np.random.default_rng(4)
    (_, ab), (_, bb) = _bf16_values(rng, (37, 300)), _bf16_values(rng, (29, 300))
    wide = device.to_device(np.full((37, 29), np.nan, np.float32))
    gemm_ex(device.to_device(ab), device.to_device(bb), wide, BF16, trans_b=True)
    bits = device.to_device(np.zeros((37, 29), np.uint16))
    gemm_ex(device.to_device(ab), device.to_device(bb), bits, BF16, trans_b=True)
    want = _numpy_bits(np.asarray(device.to_host(wide)))
    got = np.asarray(device.to_host(bits))
    if device.name == "emulated":
        np.testing.assert_array_equal(got, want)
    else:   # a GPU: cuBLAS's summation order may differ between the two kernels
        diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
        assert diff.max() <= 1 and (diff == 0).mean() > 0.99
    with pytest.raises(TypeError, match="alpha 1 and beta 0"):
        gemm_ex(device.to_device(ab), device.to_device(bb), bits, BF16, trans_b=True, beta=1.0)
    with pytest.raises(TypeError, match="for bfloat16 operands"):
        gemm_ex(device.to_device(ab), device.to_device(bb), bits, "float16", trans_b=True)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("where", ["gemm_ex", "refused", "host"])
def test_an_fc_writes_its_output_as_the_float32_paths_bits(device, monkeypatch, where, bias):
    """InnerProduct with ``bits_out: [0]``: y is the bits of the float32
    path's y (its product, the bias added in float32, then round_bf16), bit
    for bit. Without a bias: one GemmEx with a bfloat16 result and no
    rounding or conversion launch; where GemmEx is refused, the float32
    product in the op's scratch and one to_bf16_bits. With a bias: GemmEx's
    float32 result in the op's scratch (the refused path's) and one
    bias_bits launch that adds the bias and rounds once -- not the bits of
    the rounded product plus the bias rounded again (which differ). On the
    host the float32 product (+ bias) and base/precision's rounding. With a
    fused ReLU (or in float16) it cannot write bits."""
    from purine_mpi.gpu import blas
    from purine_mpi.ops.fc import InnerProduct
    rng = np.random.default_rng(9)
    # the operands as bits, as the lm-head's or fc1's (the layer norm's copy,
    # the weight's copy): nothing else to convert
    (_, x), (_, w) = _bf16_values(rng, (10, 3, 4)), _bf16_values(rng, (6, 12))
    b = rng.standard_normal(6).astype(np.float32)   # the master bias: float32
    names = ["x", "w"] + (["b"] if bias else [])
    attrs = {"num_output": 6, "compute_dtype": BF16}
    host = where == "host"
    put = np.array if host else device.to_device
    get = np.asarray if host else (lambda a: np.asarray(device.to_host(a)))
    wide = make_kernel(Op("fc", "InnerProduct", names, ["y"], attrs))
    ins, y = [put(x), put(w)] + ([put(b)] if bias else []), \
        put(np.full((10, 6), np.nan, np.float32))
    wide.setup(ins, [y])
    wide.run(ins, [y])
    want = _numpy_bits(get(y))
    if where == "refused":
        monkeypatch.setitem(blas._state, "ex_refused", "provoked by the test")
    k = make_kernel(Op("fc", "InnerProduct", names, ["y"], dict(attrs, bits_out=[0])))
    out = put(np.zeros((10, 6), np.uint16))
    k.setup(ins, [out])
    device.launched.clear()
    k.run(ins, [out])
    np.testing.assert_array_equal(get(out), want)
    if bias:   # rounding before the bias and again after it gives other bits
        widen = (lambda u: (u.astype(np.uint32) << np.uint32(16)).view(np.float32))
        product = (widen(x).reshape(10, 12) @ widen(w).T).astype(np.float32)
        twice = _numpy_bits(widen(_numpy_bits(product)) + b)
        assert (twice != want).any()
    if not host:
        assert "round_bf16" not in device.launched
        assert device.launched.count("bias_bits_f32") + \
            device.launched.count("bias_bits_vec_f32") == bias
        assert device.launched.count("to_bf16_bits") == (where == "refused" and not bias)
        assert device.launched.count("from_bf16_bits") == 2 * (where == "refused")
        specs = k.scratch_specs(ins, [out])
        # the float32 product in scratch where it is rounded after the GemmEx
        assert (((10, 6), np.float32) in specs) == (where == "refused" or bias)
        assert all(dtype == np.float32 for _, dtype in specs)
    assert InnerProduct.infer(dict(attrs, bits_out=[0]), [((10, 3, 4), "uint16"),
                                                          ((6, 12), "float32")]) == [
        ((10, 6), "uint16")]
    assert InnerProduct.bits_outputs_of(Op("fc", "InnerProduct", ["x", "w", "b"], ["y"],
                                           attrs)) == (0,)
    assert InnerProduct.bits_outputs(dict(attrs, relu=True)) == ()
    assert InnerProduct.bits_outputs({"compute_dtype": "float16"}) == ()


def _loss_kernels(from_logits, bits_out=False, norm=None, **attrs):
    grad_attrs = dict(attrs, **({"from_logits": True} if from_logits else {}),
                      **({"bits_out": [0]} if bits_out else {}))
    extra = [] if norm is None else ["norm"]
    fwd = make_kernel(Op("l", "SoftmaxLoss", ["x", "label"] + extra,
                         ["loss"] if from_logits else ["loss", "prob"],
                         dict(attrs, **({"from_logits": True} if from_logits else {}))))
    bwd = make_kernel(Op("lg", "SoftmaxLossGrad", ["dloss", "x" if from_logits else "prob",
                                                   "label"] + extra, ["dx"], grad_attrs))
    fwd.norm = bwd.norm = norm
    return fwd, bwd


def _loss_run(put, get, kernels, x, label, dloss, dx_dtype):
    """(loss, dx) of the loss and its gradient (``from_logits`` or not),
    with the kernels' normaliser input where they have one."""
    fwd, bwd = kernels
    from_logits = fwd.attrs.get("from_logits")
    xs, lab = put(x), put(label)
    norm = [] if fwd.norm is None else [put(np.asarray(fwd.norm, np.float32))]
    loss = put(np.full((), np.nan, np.float32))
    outs = [loss] if from_logits else [loss, put(np.full(x.shape, np.nan, np.float32))]
    fwd.setup([xs, lab] + norm, outs)
    fwd.run([xs, lab] + norm, outs)
    ins = [put(np.asarray(dloss, np.float32)), xs if from_logits else outs[1], lab] + norm
    dx = put(np.full(x.shape, 0, dx_dtype))
    bwd.setup(ins, [dx])
    bwd.run(ins, [dx])
    return get(loss), get(dx)


@pytest.mark.parametrize("place", ["device", "host"])
@pytest.mark.parametrize("shape,axis,ignore,norm", [
    ((3, 5, 40), -1, None, None), ((3, 5, 40), -1, 2, None), ((3, 5, 40), -1, 2, 11.0),
    ((2, 300), 1, None, None), ((5, 6, 3, 2), 1, None, None), ((3, 5, 301), -1, 2, None),
    ((3, 5, 300), -1, 2, 11.0), ((3, 5, 256), -1, None, None)])
def test_the_loss_from_bits_logits_equals_the_float32_path(device, monkeypatch, place, shape,
                                                           axis, ignore, norm):
    """The softmax loss ``from_logits`` on bf16 logits stored as bits, in
    chunks of whole positions (``LOSS_CHUNK`` made small: several chunks,
    the last one short): the loss bit for bit the float32 path's on the
    same values (its probabilities, then the mean), and its gradient,
    written as bits, the bits of the float32 path's gradient (from the
    stored probabilities, then rounded: what the Cast made); written as
    float32, that gradient itself; logits of float32 storage the same. The
    GPU's one-thread and one-block (C >= 256) kernels, an ``ignore_label``
    (with a normaliser input, the data reader's global count), classes on
    axis 1 with positions after them. No scratch of the logits'
    size: a chunk of them, widened one chunk at a time."""
    from purine_mpi.ops import softmax
    ax = axis % len(shape)
    outer = int(np.prod(shape[:ax]))
    rows = max(1, (outer - 1) // 3)
    monkeypatch.setattr(softmax, "LOSS_CHUNK", rows * int(np.prod(shape[ax:])))
    rng = np.random.default_rng(6)
    x, xb = _bf16_values(rng, shape)
    x, xb = x * 4, _numpy_bits(x * 4)
    label = rng.integers(0, shape[ax], shape[:ax] + shape[ax + 1:]).astype(np.int32)
    attrs = {"axis": axis, "norm": norm,
             **({"ignore_label": ignore} if ignore is not None else {})}
    host = place == "host"
    put = np.array if host else device.to_device
    get = np.asarray if host else (lambda a: np.asarray(device.to_host(a)))
    want_loss, want_dx = _loss_run(put, get, _loss_kernels(False, **attrs), x, label, 0.75,
                                   np.float32)
    kernels = _loss_kernels(True, bits_out=True, **attrs)
    if not host:
        device.launched.clear()
    loss, dx = _loss_run(put, get, kernels, xb, label, 0.75, np.uint16)
    launched = [] if host else list(device.launched)
    assert loss.view(np.uint32) == want_loss.view(np.uint32)
    np.testing.assert_array_equal(dx, _numpy_bits(want_dx))
    for logits in (xb, x):
        loss, wide = _loss_run(put, get, _loss_kernels(True, **attrs), logits, label, 0.75,
                               np.float32)
        assert loss.view(np.uint32) == want_loss.view(np.uint32)
        np.testing.assert_array_equal(wide.view(np.uint32), want_dx.view(np.uint32))
    chunks = -(-outer // rows)
    assert chunks > 1
    if norm is not None:   # the normaliser counts, not the shard's own positions
        assert want_loss != _loss_run(put, get, _loss_kernels(False, **dict(attrs, norm=None)),
                                      x, label, 0.75, np.float32)[0]
    if not host:
        xs = device.to_device(xb)
        specs = [(s, d) for k, ins, outs in (
            (kernels[0], [xs, put(label)], [put(np.zeros((), np.float32))]),
            (kernels[1], [put(np.float32(1)), xs, put(label)], [xs]))
            for s, d in k.scratch_specs(ins, outs)]
        assert max(int(np.prod(s)) for s, _ in specs) < xb.size
        if ax == len(shape) - 1 and shape[-1] >= 256:
            # rows of many classes: the bits kernels read the bits and write
            # dx's bits themselves (no conversion, no float32 chunk)
            assert launched.count("from_bf16_bits") == launched.count("to_bf16_bits") == 0
            assert launched.count("softmax_loss_forward_bits_f32") == 1
            assert launched.count("softmax_loss_grad_bits_f32") == 1
            assert max(int(np.prod(s)) for s, _ in specs) <= outer
        else:   # each chunk widened by the loss and by its gradient, rounded once
            assert launched.count("from_bf16_bits") == 2 * chunks
            assert launched.count("to_bf16_bits") == chunks


def test_the_loss_from_bits_logits_reserves_its_chunk_at_setup(host_build_dir, monkeypatch):
    """The loss and its gradient ``from_logits`` on logits stored as bits
    (uint16, a dtype the raw kernels do not take) reserve their scratch
    (the chunk of float32 logits, the per-position figures, the labels'
    int64 copy) in setup on the logits' device, so that a run captured in
    a CUDA graph allocates nothing: ops/softmax._reserve."""
    from purine_mpi.gpu.raw import op_scratch
    from purine_mpi.gpu.scratch import Scratch
    from tests.emulated_gpu import use_emulated_cupy
    use_emulated_cupy(monkeypatch, host_build_dir)
    import cupy
    rng = np.random.default_rng(3)
    _, xb = _bf16_values(rng, (2, 3, 40))
    xs = cupy.asarray(xb)
    label = cupy.asarray(rng.integers(0, 40, (2, 3)).astype(np.int32))
    fwd, bwd = _loss_kernels(True, bits_out=True, axis=-1)
    for k, ins, outs in ((fwd, [xs, label], [cupy.asarray(np.zeros((), np.float32))]),
                         (bwd, [cupy.asarray(np.float32(1)), xs, label],
                          [cupy.asarray(np.zeros(xb.shape, np.uint16))])):
        specs = k.scratch_specs(ins, outs)
        assert ((6, 40, 1), np.float32) in [(tuple(s), d) for s, d in specs]   # 6 positions
        k.setup(ins, outs)
        assert op_scratch(k, 0).reserved >= Scratch._layout(specs)[1] > 0, k.op.op_type


def test_the_loss_from_bits_logits_against_pytorch_autocast_cross_entropy():
    """PyTorch's CPU autocast(bfloat16) computes ``cross_entropy`` of
    bfloat16 logits in float32 (its float32 list) and hands their gradient
    back in bfloat16: the loss ``from_logits`` on the same logits stored
    as bits (host path, several chunks) gives that loss to float32's
    rounding and that gradient's bits to within one bfloat16 step (their
    sums run in other orders), most of them equal."""
    import torch

    from purine_mpi.ops import softmax
    rng = np.random.default_rng(12)
    x, xb = _bf16_values(rng, (4, 8, 96))
    x, xb = x * 3, _numpy_bits(x * 3)
    label = rng.integers(0, 96, (4, 8)).astype(np.int64)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(softmax, "LOSS_CHUNK", 3 * 96)
        loss, dx = _loss_run(np.array, np.asarray, _loss_kernels(True, bits_out=True, axis=-1),
                             xb, label, 1.0, np.uint16)
    logits = torch.from_numpy(x).to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, 96),
                                                 torch.from_numpy(label).reshape(-1))
    assert want.dtype == torch.float32
    want.backward()
    np.testing.assert_allclose(float(loss), float(want.detach()), rtol=2e-6)
    theirs = logits.grad.view(torch.int16).numpy().view(np.uint16)
    steps = np.abs(dx.astype(np.int32) - theirs.astype(np.int32))
    assert steps.max() <= 1 and (steps == 0).mean() > 0.95, (steps.max(), (steps == 0).mean())


def test_the_loss_reads_the_logits_as_bits_only_where_its_gradient_goes_to_bits():
    """``loss_from_logits`` on an lm-head (bf16 product, with or without a
    bias: both write bits) and its loss: the loss reads the logits as bits
    (its probabilities gone, its gradient after it, reading the logits and
    writing its copy as bits) where the gradient's copy is read by products
    that take bits; not where a weight gradient of rows reads it (its
    float32 gradient could not take the 2-byte logits' bytes: more memory,
    not less)."""
    from purine_mpi.graph.core import Graph
    from purine_mpi.parallel.precision import fold_casts, loss_from_logits, store_bits

    def graph(rows=False, bias=False):
        g = Graph()
        g.add_blob("xf@bf16", (2, 4, 8), "uint16", None, kind="data",
                   attrs={"precision": BF16})
        g.add_blob("w@bf16", (16, 8), "uint16", None, kind="data", attrs={"precision": BF16})
        g.add_blob("label", (2, 4), "int32", None, kind="data")
        g.add_blob("b", (16,), "float32", None, kind="param")
        g.add_blob("logits", None, "float32", None, kind="data", attrs={"precision": BF16})
        fc = {"axis": 2, "compute_dtype": BF16}
        g.add_op("fc", "InnerProduct", ["xf@bf16", "w@bf16"] + (["b"] if bias else []),
                 ["logits"], fc)
        for n in ("loss", "prob", "dlogits", "dw"):
            g.add_blob(n, None, "float32", None, kind="data")
        g.add_blob("dloss", (), "float32", None, kind="data")
        g.blobs["loss"].attrs["loss_weight"] = 1.0
        g.add_op("loss", "SoftmaxLoss", ["logits", "label"], ["loss", "prob"], {"axis": -1})
        g.add_op("dl", "SoftmaxLossGrad", ["dloss", "prob", "label"], ["dlogits"],
                 {"axis": -1})
        g.add_blob("dlogits@bf16", None, "float32", None, kind="data",
                   attrs={"precision": BF16})
        g.add_op("cast", "Cast", ["dlogits"], ["dlogits@bf16"], {"dtype": BF16})
        g.add_blob("dxf", None, "float32", None, kind="data")
        g.add_op("fd", "InnerProductGradData", ["dlogits@bf16", "w@bf16"], ["dxf"],
                 dict(fc, x_shape=[2, 4, 8]))
        g.add_op("fw", "InnerProductGradWeight", ["dlogits@bf16", "xf@bf16"], ["dw"],
                 dict(fc, **({"rows": [0, 8]} if rows else {})))
        g.infer_shapes()
        marked = loss_from_logits(g)
        store_bits(g)
        fold_casts(g)
        g.infer_shapes()
        return g, marked

    for bias in (False, True):
        g, marked = graph(bias=bias)
        assert marked == ["loss"]
        assert g.ops["loss"].outputs == ["loss"] and "prob" not in g.blobs
        assert g.ops["dl"].inputs == ["dloss", "logits", "label"] and \
            g.ops["dl"].control_inputs == ["loss"]
        assert g.blobs["logits"].dtype == g.blobs["dlogits@bf16"].dtype == "uint16"
        assert "cast" not in g.ops and g.ops["dl"].outputs == ["dlogits@bf16"]
        assert g.ops["fc"].attrs["bits_out"] == [0] and g.ops["dl"].attrs["bits_out"] == [0]
    for kwargs in ({"rows": True},):
        g, marked = graph(**kwargs)
        assert marked == [] and "prob" in g.blobs, kwargs
        assert g.blobs["logits"].dtype == "float32" and "from_logits" not in g.ops["dl"].attrs
