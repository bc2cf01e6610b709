"""bf16/fp16 on the device (docs/gpu.md, "Precision"): the one rounding
kernel (cuda/precision.cu) against base/precision's NumPy rounding, bit for
bit, and the one launch per rounded array of a low-precision op; the
bfloat16 wire conversions of ``parallel.grad_dtype: bf16`` (one kernel each
way) against base/precision's ``to_bf16_bits``/``from_bf16_bits``; the
TF32 math the low-precision products ask cuBLAS and cuDNN for; the GELU
kernels' rounding of their own output (no second pass)."""
import numpy as np
import pytest

from purine_mpi.base.precision import (_round_bits, from_bf16_bits, round_to, scratch_spec,
                                      to_bf16_bits, wire_scratch)
from purine_mpi.graph.core import Op
from purine_mpi.gpu import kernels
from purine_mpi.ops.catalog import get_kernel_class
from purine_mpi.ops.registry import make_kernel
from tests.emulated_gpu.fixtures import device  # noqa: F401

_U = np.uint32


def _adversarial():
    """float32 bit patterns where a rounding goes wrong first: ties both
    ways for bf16 (bit 16 odd/even, low half 0x8000) and fp16 (bit 13,
    low 13 bits 0x1000), one below and above a tie (0x7fff / 0x8001),
    the largest finite float32 and bf16 carrying into infinity, fp16's
    65504 / 65519.99 / 65520, -0, float32 and float16 subnormals and
    their ties, infinities, NaNs with payload only in the low bits,
    and random values over the whole exponent range."""
    bits = [0x3F808000, 0x3F818000, 0xBF808000, 0x3F807FFF, 0x3F808001, 0x3F80FFFF,
            0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF,          # bf16 carry to inf
            0x3F801000, 0x3F803000, 0x3F800FFF, 0x3F801001, 0xBF803000,  # fp16 ties
            0x80000000, 0x00000000, 0x00000001, 0x807FFFFF, 0x00400000,
            0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x7F80FFFF,
            0x7F810000, 0xFF800100, 0x7FA02000, 0x7F802001, 0x7FFFFFFF]
    values = [65504.0, 65519.996, 65520.0, -65520.0, 65536.0, 1e6, -3.4e38,
              2.0 ** -14, 2.0 ** -15, 2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25,
              -2.0 ** -25, 3 * 2.0 ** -25, 2.5 * 2.0 ** -24, 0.75 * 2.0 ** -24,
              2.0 ** -14 - 2.0 ** -26, 2.0 ** -14 - 2.0 ** -25, 6.1e-5, 1.0, -1.0]
    x = np.concatenate([np.array(bits, _U).view(np.float32),
                        np.array(values, np.float32)])
    rng = np.random.default_rng(7)
    with np.errstate(over="ignore"):
        spread = (rng.standard_normal(4000) * np.exp(rng.uniform(-100, 100, 4000))).astype(
            np.float32)
    return np.concatenate([x, spread, rng.integers(0, 1 << 32, 4000, dtype=np.uint64)
                           .astype(_U).view(np.float32)])


def _numpy_rounding(x, dtype):
    """The reference bits: base/precision._round_bits (bf16) and NumPy's
    float32 -> float16 -> float32 (fp16)."""
    if dtype == "bfloat16":
        bits = x.copy().view(_U)
        _round_bits(np, bits, np.empty_like(bits), np.empty_like(bits))
        return bits
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(np.float16).astype(np.float32).view(_U)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_rounding_kernel_gives_numpys_bits_in_one_launch(device, dtype):
    x = _adversarial()
    want = _numpy_rounding(x, dtype)
    on_device = device.to_device(x)
    device.launched.clear()
    kernels.round_in_place(on_device, dtype)
    got = np.asarray(device.to_host(on_device)).view(_U)
    assert device.launched == [{"bfloat16": "round_bf16", "float16": "round_fp16"}[dtype]]
    nan = np.isnan(want.view(np.float32))
    bad = np.flatnonzero((got != want) & ~nan)
    assert bad.size == 0, [(hex(x.view(_U)[i]), hex(got[i]), hex(want[i])) for i in bad[:8]]
    # NaNs: NaN, sign kept, the top 10 (bf16: 7) payload bits kept, as NumPy's
    # software conversion (a NumPy built on F16C hardware would quiet them)
    assert np.isnan(got[nan].view(np.float32)).all()
    if dtype == "bfloat16":
        np.testing.assert_array_equal(got[nan], want[nan])
    else:
        keep = x.view(_U)[nan] & _U(0xFFFFE000)
        np.testing.assert_array_equal(got[nan], np.where(keep & _U(0x7FE000), keep,
                                                         keep | _U(0x2000)))
    # and the host round_to (the scratch path) gives the same
    host = x.copy()
    shape, sdt = scratch_spec(host.shape, dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        round_to(host, dtype, np.empty(shape, sdt))
    np.testing.assert_array_equal(host.view(_U)[~nan], got[~nan])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_rounding_kernel_is_exact_at_any_alignment_and_length(device, dtype):
    """The kernel moves 16 bytes a thread where source and destination are
    both 16-byte aligned, one value a thread otherwise, then the n % 4
    last ones: the same bits at every start (0..3 values into an aligned
    array) and length (n % 4 = 0..3, n < 4), in place and into another
    array (``round_copy``, the Cast's one pass; source unchanged)."""
    x = _adversarial()[:203]
    for start in range(4):
        for n in (0, 1, 2, 3, 4, 5, 7, 64, 198, 199):
            src = x[:n]
            want = _numpy_rounding(src, dtype)
            base = device.to_device(np.zeros(n + 8, np.float32))
            view = base[start:start + n]
            view[...] = device.to_device(src)
            kernels.round_in_place(view, dtype)
            got = np.asarray(device.to_host(base)).view(_U)
            nan = np.isnan(want.view(np.float32))
            np.testing.assert_array_equal(got[start:start + n][~nan], want[~nan])
            assert not got[:start].any() and not got[start + n:].any(), (start, n)
            for shift in range(4):   # source and destination misaligned alike or not
                holder = device.to_device(np.concatenate([np.zeros(shift, np.float32), src]))
                source = holder[shift:]
                out = device.to_device(np.zeros(n + 8, np.float32))
                kernels.round_copy(source, out[start:start + n], dtype)
                got = np.asarray(device.to_host(out)).view(_U)
                np.testing.assert_array_equal(got[start:start + n][~nan], want[~nan])
                assert not got[:start].any() and not got[start + n:].any(), (start, n, shift)
                np.testing.assert_array_equal(np.asarray(device.to_host(source)).view(_U),
                                              src.view(_U))


def test_the_wire_kernels_are_exact_at_any_alignment_and_length(device):
    """to_bf16_bits / from_bf16_bits take 4 values a thread where the
    float32 array is 16-byte and the bits 8-byte aligned, one otherwise,
    then the tail: the same bits at every start of either and every n % 4."""
    x = _adversarial()[:203]
    for n in (0, 1, 3, 4, 6, 64, 199, 203):
        src = x[:n]
        want = to_bf16_bits(src, np.empty(n, np.uint16), wire_scratch(max(n, 1)))
        for start in range(4):
            for shift in range(4):
                values = device.to_device(np.zeros(n + 8, np.float32))
                values[start:start + n] = device.to_device(src)
                bits = device.to_device(np.zeros(n + 8, np.uint16))
                kernels.to_bf16_bits_device(values[start:start + n], bits[shift:shift + n])
                got = np.asarray(device.to_host(bits))
                np.testing.assert_array_equal(got[shift:shift + n], want)
                assert not got[:shift].any() and not got[shift + n:].any(), (n, start, shift)
                wide = device.to_device(np.full(n + 8, 7.0, np.float32))
                kernels.from_bf16_bits_device(bits[shift:shift + n], wide[start:start + n])
                back = np.asarray(device.to_host(wide)).view(_U)
                np.testing.assert_array_equal(back[start:start + n],
                                              want.astype(_U) << _U(16))
                assert (back[:start] == np.float32(7).view(_U)).all()
                assert (back[start + n:] == np.float32(7).view(_U)).all()


def test_the_rounding_kernel_refuses_what_it_cannot_round_in_place(device):
    x = device.to_device(np.ones((4, 4), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.round_in_place(x[:, ::2], "bfloat16")
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        kernels.round_in_place(x, "float8")
    with pytest.raises(TypeError, match="float32"):
        kernels.round_in_place(device.to_device(np.ones(3)), "bfloat16")
    with pytest.raises(ValueError, match="16 values into 8"):
        kernels.round_copy(x, x[:2], "bfloat16")
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.round_copy(x[:, ::2], x[:, :2], "bfloat16")


def test_the_wire_kernels_give_numpys_bf16_bits_in_one_launch_each(device):
    """float32 -> bfloat16 bits (ties both ways, 0x7fff/0x8001 around them,
    the largest finite values carrying into infinity, -0, subnormals,
    infinities, NaNs with payload only in the low 16 bits: infinite, as
    base/precision's) and back, bit for bit against the NumPy functions,
    over more than one of their chunks, one kernel each way; x unchanged."""
    x = np.concatenate([_adversarial()] * 9)   # 9 x 8052 > WIRE_CHUNK: the host chunks
    want = to_bf16_bits(x, np.empty(x.size, np.uint16), wire_scratch(x.size))
    on_device, bits = device.to_device(x), device.to_device(np.zeros(x.size, np.uint16))
    device.launched.clear()
    kernels.to_bf16_bits_device(on_device, bits)
    assert device.launched == ["to_bf16_bits"]
    got = np.asarray(device.to_host(bits))
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(x.view(_U)[i]), hex(got[i]), hex(want[i])) for i in bad[:8]]
    np.testing.assert_array_equal(np.asarray(device.to_host(on_device)).view(_U), x.view(_U))
    # back: the widened bits, exactly (NaN payloads included)
    wide = device.to_device(np.full((3, x.size // 3), np.nan, np.float32))
    device.launched.clear()
    kernels.from_bf16_bits_device(bits, wide)
    assert device.launched == ["from_bf16_bits"]
    back = np.asarray(device.to_host(wide)).view(_U).reshape(-1)
    np.testing.assert_array_equal(back, from_bf16_bits(want, np.empty(x.size, np.float32))
                                  .view(_U))


def test_the_wire_kernels_refuse_what_they_cannot_convert(device):
    x = device.to_device(np.ones((4, 4), np.float32))
    bits = device.to_device(np.zeros(16, np.uint16))
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.to_bf16_bits_device(x[:, ::2], bits[:8])
    with pytest.raises(ValueError, match="16 values into 8 bits"):
        kernels.to_bf16_bits_device(x, bits[:8])
    with pytest.raises(TypeError, match="uint16"):
        kernels.from_bf16_bits_device(x, x)
    with pytest.raises(TypeError, match="float32"):
        kernels.from_bf16_bits_device(bits, device.to_device(np.ones(16)))


def _fc_kernel(dtype, bias=True):
    attrs = {"num_output": 3, "compute_dtype": dtype}
    ins = ["x", "w", "b"] if bias else ["x", "w"]
    return make_kernel(Op("fc", "InnerProduct", ins, ["y"], attrs))


def _no_copy_into(array):
    """``array`` as an array that refuses to be assigned to (``a[...] =``):
    the Cast's copy and rounding are one kernel, no copy first."""
    class NoCopy(type(array)):
        def __setitem__(self, key, value):
            raise AssertionError("a copy into the Cast's output before its rounding kernel")
    return array.view(NoCopy)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_low_precision_op_launches_one_rounding_kernel_per_output(device, dtype):
    rng = np.random.default_rng(3)
    # the op's inputs are low values (the precision pass's Cast ops): a
    # bf16 op multiplies their bfloat16 bits (gpu/blas.gemm_low)
    raw = [rng.standard_normal(s).astype(np.float32) for s in ((5, 7), (3, 7), (3,))]
    x, w, b = (_numpy_rounding(a, dtype).view(np.float32) for a in raw)
    host_y = np.full((5, 3), np.nan, np.float32)
    _fc_kernel(dtype).run([x, w, b], [host_y])
    ins = [device.to_device(a) for a in (x, w, b)]
    y = device.to_device(np.full((5, 3), np.nan, np.float32))
    kernel = _fc_kernel(dtype)
    kernel.setup(ins, [y])
    device.launched.clear()
    kernel.run(ins, [y])
    name = {"bfloat16": "round_bf16", "float16": "round_fp16"}[dtype]
    assert device.launched.count(name) == 1, device.launched
    assert not [k for k in device.launched if k.startswith("round_") and k != name]
    got = np.asarray(device.to_host(y))
    np.testing.assert_array_equal(got.view(_U), _numpy_rounding(got, dtype))  # rounded
    np.testing.assert_allclose(got, host_y, rtol=1e-2)
    # the Cast op: one launch, the NumPy path's bits, no scratch reserved
    cast = get_kernel_class("Cast")(Op("c", "Cast", ["x"], ["x@low"], {"dtype": dtype}))
    out = device.to_device(np.zeros((5, 7), np.float32))
    x = raw[0]   # not yet rounded
    on_device = device.to_device(x)
    cast.setup([on_device], [out])
    device.launched.clear()
    cast.run([on_device], [_no_copy_into(out)])
    assert device.launched == [name]   # and no copy before it (_no_copy_into)
    np.testing.assert_array_equal(np.asarray(device.to_host(out)).view(_U),
                                  _numpy_rounding(x, dtype))
    assert getattr(cast, "_own_scratch", None) is None or cast._own_scratch.reserved == 0
    # in place (the memory plan put the copy on its source's bytes): the
    # rounding kernel alone, on the source's own bytes
    same = device.to_device(x)
    view = same.reshape(same.shape)   # another array object over the same bytes
    device.launched.clear()
    cast.run([same], [view])
    assert device.launched == [name]
    np.testing.assert_array_equal(np.asarray(device.to_host(same)).view(_U),
                                  _numpy_rounding(x, dtype))
    host = x.copy()   # the host's Cast: round_to over the same bytes
    get_kernel_class("Cast")(Op("c", "Cast", ["x"], ["x@low"], {"dtype": dtype})).run(
        [host], [host.reshape(host.shape)])
    np.testing.assert_array_equal(host.view(_U), _numpy_rounding(x, dtype))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_gelu_kernels_round_their_own_output_in_the_same_pass(device, dtype):
    """gelu_forward / gelu_backward with ``round_to``: bit for bit the
    unrounded kernel's output rounded by round_in_place afterwards (the
    adversarial float32 patterns: ties, values carrying into infinity,
    subnormals, NaNs), both forms; a low-precision Gelu / GeluGrad op
    (the precision pass's ``compute_dtype``) launches its one kernel and no
    rounding kernel (``rounds_own_outputs``), with those bits, while on the
    host it still rounds after the run (``round_low``)."""
    x = _adversarial()
    dy = np.random.default_rng(5).standard_normal(x.size).astype(np.float32) * 4
    name = {"bfloat16": "round_bf16", "float16": "round_fp16"}[dtype]
    for approximate in ("none", "tanh"):
        attrs = {"approximate": approximate, "compute_dtype": dtype}
        xd, dyd = device.to_device(x), device.to_device(dy)
        with np.errstate(all="ignore"):
            want_y = kernels.round_in_place(kernels.gelu_forward(xd, approximate), dtype)
            want_dx = kernels.round_in_place(kernels.gelu_backward(dyd, xd, approximate), dtype)
        device.launched.clear()
        y = kernels.gelu_forward(xd, approximate, round_to=dtype)
        dx = kernels.gelu_backward(dyd, xd, approximate, round_to=dtype)
        assert device.launched == ["gelu_forward", "gelu_backward"]
        for got, want in ((y, want_y), (dx, want_dx)):
            np.testing.assert_array_equal(np.asarray(device.to_host(got)).view(_U),
                                          np.asarray(device.to_host(want)).view(_U))
        for op_type, ins, want, kernel_name in (("Gelu", [x], want_y, "gelu_forward"),
                                                ("GeluGrad", [dy, x], want_dx, "gelu_backward")):
            kernel = make_kernel(Op("g", op_type, ["a", "b"][:len(ins)], ["out"], attrs))
            on_device = [device.to_device(a) for a in ins]
            out = device.to_device(np.full(x.shape, np.nan, np.float32))
            kernel.setup(on_device, [out])
            device.launched.clear()
            kernel.run(on_device, [out])
            assert device.launched == [kernel_name], device.launched
            np.testing.assert_array_equal(np.asarray(device.to_host(out)).view(_U),
                                          np.asarray(device.to_host(want)).view(_U))
            host_out = np.full(x.shape, np.nan, np.float32)
            with np.errstate(all="ignore"):
                make_kernel(Op("g", op_type, ["a", "b"][:len(ins)], ["out"], attrs)).run(
                    list(ins), [host_out])
            assert make_kernel(Op("g", op_type, ["a", "b"][:len(ins)], ["out"], attrs)
                               ).rounds_own_outputs(ins, [host_out]) == ()
            ok = ~np.isnan(host_out)
            np.testing.assert_array_equal(host_out.view(_U)[ok],
                                          _numpy_rounding(host_out, dtype)[ok])   # rounded
    # what the launch refuses
    with pytest.raises(TypeError, match="float32"):
        kernels.gelu_forward(device.to_device(np.ones(3)), round_to=dtype)
    with pytest.raises(ValueError, match="none or tanh"):
        kernels.gelu_forward(device.to_device(x), "erf")
    with pytest.raises(ValueError, match="round_to"):
        kernels.gelu_forward(device.to_device(x), round_to="float8")
    assert name not in device.launched


# -------------------------------------------------------------- TF32 products
def _gemm_spy(monkeypatch):
    """[(op type, math mode, or "ex" for a GemmEx)] of every cuBLAS product
    (the emulated nvmath cuBLAS records the handle's math mode at each
    call; the op is the OpKernel whose run made it)."""
    import sys
    from purine_mpi.gpu import blas
    from purine_mpi.ops.registry import OpKernel
    seen = []

    def spying(real):
        def spy(*args, **kwargs):
            cublas = sys.modules["nvmath.bindings.cublas"]
            frame, op_type = sys._getframe(1), None
            while frame is not None and op_type is None:
                me = frame.f_locals.get("self") or frame.f_locals.get("kernel")
                op_type = me.op.op_type if isinstance(me, OpKernel) else None
                frame = frame.f_back
            before = len(cublas.gemms)
            out = real(*args, **kwargs)
            seen.extend((op_type, "ex" if what.endswith("_ex") else math)
                        for what, _, math in cublas.gemms[before:])
            return out
        return spy

    monkeypatch.setattr(blas, "gemm", spying(blas.gemm))
    monkeypatch.setattr(blas, "gemm_ex", spying(blas.gemm_ex))
    return seen


def test_a_bf16_gpts_fc_products_run_as_bf16_its_others_on_tf32(host_build_dir, monkeypatch):
    """Three AdamW steps of the 2-block GPT on the emulated device: in bf16
    every product of the InnerProduct* ops is a bfloat16 GemmEx on their
    operands' bits (gpu/blas.gemm_low), those of the AttentionScores/
    Context* ops run with cuBLAS's TF32 math (3), the fused Attention's
    (float32 probabilities) with the default (0); with PURINE_BF16_GEMM=0
    the InnerProduct* products take TF32 too; in fp32 all the default. The
    emulated cuBLAS reads TF32 operands rounded to TF32 and widens GemmEx's
    bits: the bf16 losses are bit for bit the same all three ways (bf16
    values are exact in TF32, and each product of two exact in float32)."""
    from purine_mpi.ops import registry
    from tests.test_precision import _ours_on_the_emulated_device
    toks = np.random.default_rng(3).integers(0, 16, (3, 2, 9))
    losses, modes = {}, {}
    for precision, way in (("bf16", "ex"), ("bf16", "tf32"), ("bf16", "fp32"),
                           ("fp32", "fp32")):
        with monkeypatch.context() as m:
            if way != "ex":
                m.setenv("PURINE_BF16_GEMM", "0")
            if way == "fp32":
                m.setattr(registry, "_tf32_products", lambda kernel: None)
            seen = _gemm_spy(m)
            _, losses[precision, way], _ = _ours_on_the_emulated_device(
                m, host_build_dir, precision, toks, 3)
            modes[precision, way] = seen
    fc = {"InnerProduct", "InnerProductGradData", "InnerProductGradWeight"}
    low = fc | {"AttentionScores", "AttentionScoresGrad", "AttentionContext",
                "AttentionContextGrad"}
    for way, fc_mode in (("ex", "ex"), ("tf32", 3)):
        by_type = {}
        for op_type, math in modes["bf16", way]:
            by_type.setdefault(op_type, set()).add(math)
        assert {t for t in by_type if t in low} >= fc, by_type
        assert all(by_type[t] == {fc_mode} for t in fc), (way, by_type)
        assert all(by_type[t] == {3} for t in by_type if t in low - fc), by_type
        assert all(by_type[t] == {0} for t in by_type if t not in low), by_type
    assert modes["fp32", "fp32"] and {m for _, m in modes["fp32", "fp32"]} == {0}
    assert {m for _, m in modes["bf16", "fp32"]} == {0}
    assert losses["bf16", "ex"] == losses["bf16", "tf32"] == losses["bf16", "fp32"]
    assert losses["bf16", "ex"] != losses["fp32", "fp32"]
