"""The bf16 fully connected forward with a bias, output stored as bits, as
ONE cuBLASLt product under ``PURINE_FC_EPILOGUE=cublaslt`` (gpu/blaslt.
fc_forward_bits, ops/fc.py ``_lt_bits``): bfloat16 A/B, the bias rounded to
bfloat16 first (cuBLASLt takes no float32 bias with a bfloat16 D), D the
output's bits -- PyTorch autocast's linear. On the emulated device
(tests/emulated_gpu/cublaslt.py): bit for bit a NumPy reference (bf16
operands, float32 product, + the bf16-rounded bias, one rounding) at the
GPT-2 fc shapes; the float32 product's scratch not reserved nor planned;
the fallback to GemmEx + ``bias_bits`` where the heuristic finds no
algorithm (said once); a bf16 GPT training with it beside the default."""
import sys

import numpy as np
import pytest

from purine_mpi.base.precision import _round_bits
from purine_mpi.gpu import blaslt
from purine_mpi.graph.core import Op
from purine_mpi.ops.registry import make_kernel
from tests.emulated_gpu.fixtures import device  # noqa: F401

BF16 = "bfloat16"
#: GPT-2 124M's fully connected (K, O): qkv, the attention's projection, fc1, fc2
GPT2_FC = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]


def _bias_bits(launched):
    """The bias_bits launches in ``launched`` (a list of kernel names, or a
    {name: count}): the one-element kernel's and its vectorised twin's."""
    names = ("bias_bits_f32", "bias_bits_vec_f32")
    if isinstance(launched, dict):
        return sum(launched.get(n, 0) for n in names)
    return sum(launched.count(n) for n in names)


def _bits(x):
    """The bfloat16 bits nearest each float32 of ``x`` (ties to even)."""
    bits = np.array(x, np.float32).view(np.uint32)
    _round_bits(np, bits, np.empty_like(bits), np.empty_like(bits))
    return (bits >> np.uint32(16)).astype(np.uint16)


def _widen(bits):
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def reference(x_bits, w_bits, bias):
    """y's bits: the float32 product of the bfloat16 operands (laid out as
    cuBLASLt's y^T = w @ x^T), plus the bias rounded to bfloat16, widened,
    rounded once."""
    product = np.matmul(_widen(w_bits), _widen(x_bits).T)
    return _bits(product + _widen(_bits(bias)).reshape(-1, 1)).T


def _operands(seed):
    """x (8, 32) and w (16, 32) as bfloat16 bits, a float32 bias (16,)."""
    rng = np.random.default_rng(seed)
    xb, wb = _bits(rng.standard_normal((8, 32))), _bits(rng.standard_normal((16, 32)))
    return xb, wb, rng.standard_normal(16).astype(np.float32)


def _default_bits(x_bits, w_bits, bias):
    """y's bits on the default path: the float32 product plus the float32
    bias (unrounded), rounded once."""
    return _bits(_widen(x_bits) @ _widen(w_bits).T + bias)


def _kernel():
    return make_kernel(Op("fc", "InnerProduct", ["x", "w", "b"], ["y"],
                          {"compute_dtype": BF16, "bits_out": [0]}))


def _run(device, x, w, b, m, o):
    k = _kernel()
    ins = [device.to_device(a) for a in (x, w, b)]
    out = device.to_device(np.zeros((m, o), np.uint16))
    k.setup(ins, [out])
    device.launched.clear()
    k.run(ins, [out])
    return k, ins, out, np.asarray(device.to_host(out))


@pytest.fixture
def opted(device, monkeypatch):  # noqa: F811
    monkeypatch.setenv("PURINE_FC_EPILOGUE", "cublaslt")
    if device.name == "cupy":
        pytest.importorskip("nvmath.bindings.cublasLt")
        blaslt.reset()
        yield device
        blaslt.reset()
    else:
        yield device


@pytest.mark.parametrize("k_in, o", GPT2_FC)
def test_the_output_bits_equal_numpys_at_the_gpt2_shapes(opted, k_in, o):
    """x and w stored as bits (the layer norm's and the weight's copies), a
    float32 master bias: one cuBLASLt product, the bias's bits made by one
    to_bf16_bits launch, no bias_bits; y bit for bit NumPy's (on a GPU
    within one bfloat16 step: cuBLAS's summation order) -- and not the
    default path's bits (its bias float32, unrounded)."""
    device = opted
    rng = np.random.default_rng(k_in + o)
    m = 16
    xb, wb = _bits(rng.standard_normal((m, k_in))), _bits(rng.standard_normal((o, k_in)) * .05)
    b = rng.standard_normal(o).astype(np.float32)
    k, ins, out, got = _run(device, xb, wb, b, m, o)
    want = reference(xb, wb, b)
    if device.name == "emulated":
        np.testing.assert_array_equal(got, want)
        lt = sys.modules["nvmath.bindings.cublasLt"]
        assert lt.matmuls == [("BIAS", "bfloat16")]
    else:
        np.testing.assert_allclose(_widen(got), _widen(want), rtol=2 ** -7, atol=2 ** -7)
    assert device.launched.count("to_bf16_bits") == 1 and _bias_bits(device.launched) == 0
    # the scratch: the bias's bits, no float32 product
    assert k.scratch_specs(ins, [out]) == [((o,), np.uint16)]
    default = _default_bits(xb, wb, b)
    assert (default != want).any()


def test_float32_operands_are_converted_then_multiplied(opted):
    """x and w as bfloat16 values in float32 storage: their bits and the
    bias's into the op's scratch (three to_bf16_bits launches), then the
    one product; bit for bit NumPy's on the emulated device."""
    device = opted
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((12, 40)).astype(np.float32), \
        rng.standard_normal((24, 40)).astype(np.float32)
    b = rng.standard_normal(24).astype(np.float32)
    k, ins, out, got = _run(device, x, w, b, 12, 24)
    want = reference(_bits(x), _bits(w), b)
    if device.name == "emulated":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(_widen(got), _widen(want), rtol=2 ** -7, atol=2 ** -7)
    assert device.launched.count("to_bf16_bits") == 3
    assert k.scratch_specs(ins, [out]) == [((12, 40), np.uint16), ((24, 40), np.uint16),
                                           ((24,), np.uint16)]


def test_without_the_opt_in_the_path_is_todays(device, monkeypatch):  # noqa: F811
    """The default: GemmEx's float32 product in scratch and bias_bits (the
    float32 bias), the float32 path's bits; cuBLASLt not called."""
    monkeypatch.delenv("PURINE_FC_EPILOGUE", raising=False)
    xb, wb, b = _operands(2)
    k, ins, out, got = _run(device, xb, wb, b, 8, 16)
    if device.name == "emulated":
        np.testing.assert_array_equal(got, _default_bits(xb, wb, b))
        assert sys.modules["nvmath.bindings.cublasLt"].calls == []
    assert _bias_bits(device.launched) == 1
    assert k.scratch_specs(ins, [out]) == [((8, 16), np.float32)]


def test_no_algorithm_keeps_gemm_ex_and_bias_bits_said_once(device, monkeypatch,  # noqa: F811
                                                            capfd):
    """The heuristic finds no algorithm (the emulated hook): the op keeps
    GemmEx + bias_bits (the float32 bias: the default path's bits, its
    float32 scratch taken then, eagerly), says so once, and from then on
    does not ask again."""
    if device.name != "emulated":
        pytest.skip("the hook is the emulated binding's")
    monkeypatch.setenv("PURINE_FC_EPILOGUE", "cublaslt")
    lt = sys.modules["nvmath.bindings.cublasLt"]
    lt.no_algorithm = lambda config: True
    xb, wb, b = _operands(3)
    k = _kernel()
    ins = [device.to_device(a) for a in (xb, wb, b)]
    out = device.to_device(np.zeros((8, 16), np.uint16))
    k.setup(ins, [out])
    assert k.scratch_specs(ins, [out]) == [((16,), np.uint16)]   # planned for cuBLASLt
    for _ in range(2):
        k.run(ins, [out])
        np.testing.assert_array_equal(np.asarray(device.to_host(out)), _default_bits(xb, wb, b))
    assert k.scratch_specs(ins, [out]) == [((8, 16), np.float32)]
    err = capfd.readouterr().err
    assert err.count("cuBLASLt refused the epilogue (RuntimeError: the heuristic returned no "
                     "algorithm)") == 1, err
    assert len(lt.heuristics) == 1 and lt.matmuls == [] and blaslt.plan_count() == 0


def test_without_the_binding_the_scratch_is_the_float32_products(device, monkeypatch,  # noqa: F811
                                                                  capfd):
    """Opted in where nvmath's cuBLASLt binding does not import: the op's
    scratch -- what its setup reserves and the device plan counts -- is the
    default path's float32 product from the start, as its run takes it (not
    the bias bits, then a larger scratch taken at the first run); the bits
    are the default path's, and the missing binding is said once."""
    if device.name != "emulated":
        pytest.skip("the binding removed is the emulated one")
    monkeypatch.setenv("PURINE_FC_EPILOGUE", "cublaslt")
    monkeypatch.delattr(sys.modules["nvmath.bindings"], "cublasLt")
    monkeypatch.setitem(sys.modules, "nvmath.bindings.cublasLt", None)
    xb, wb, b = _operands(4)
    k = _kernel()
    ins = [device.to_device(a) for a in (xb, wb, b)]
    out = device.to_device(np.zeros((8, 16), np.uint16))
    planned = k.scratch_specs(ins, [out])
    k.setup(ins, [out])
    for _ in range(2):
        k.run(ins, [out])
    np.testing.assert_array_equal(np.asarray(device.to_host(out)), _default_bits(xb, wb, b))
    assert planned == k.scratch_specs(ins, [out]) == [((8, 16), np.float32)]
    assert _bias_bits(device.launched) == 2
    assert "to_bf16_bits" not in " ".join(device.launched)   # no bias rounded for nothing
    err = capfd.readouterr().err
    assert err.count("nvmath.bindings.cublasLt (the cuBLASLt epilogue) is missing") == 1, err


def test_the_device_plan_counts_no_float32_product_under_the_opt_in(host_build_dir,
                                                                    monkeypatch):
    """The 2-block GPT's planned device total (runtime/memory_plan and the
    scratch of runtime/footprint, from the ops' scratch_specs) is smaller
    under the opt-in: the biased fc outputs stored as bits need the bias's
    bits, not the float32 product."""
    from purine_mpi.runtime.footprint import device_extras
    from tests.test_bf16_storage import _gpt

    def scratch(opt_in):
        with monkeypatch.context() as m:
            if opt_in:
                m.setenv("PURINE_FC_EPILOGUE", "cublaslt")
            g = _gpt(m, host_build_dir)
            return device_extras(g, 0, cuda_graph=True)["ops"]

    on, off = scratch(True), scratch(False)
    assert sorted(on) == sorted(off)
    fcs = [n for n in on if on[n][0] < off[n][0]]
    # qkv, the attention's projection, fc1 and fc2 of the 2 blocks
    assert len(fcs) == 8, (on, off)
    assert all(on[n][0] == off[n][0] for n in on if n not in fcs)


@pytest.mark.parametrize("cuda_graph", [True])
def test_a_bf16_gpt_trains_under_the_opt_in(host_build_dir, monkeypatch, cuda_graph):
    """Four captured AdamW steps of the 2-block bf16 GPT on the emulated
    device with PURINE_FC_EPILOGUE=cublaslt: the biased fc outputs are
    cuBLASLt products (planned on the eager first step, replayed after; the
    layers of one shape share a plan: their bias bits are in the same
    scratch bytes), the losses within 1e-2 relative of the default path's,
    and it trains. (Here they are the same: the precision pass gives the
    fc its bias's bf16 copy, ``b@bf16``, so rounding it again is exact, and
    the emulated products sum alike.)"""
    from tests.emulated_gpu import use_emulated_cupy
    from tests.emulated_gpu.helpers import bf16_gpt_steps
    from tests.test_precision import SOLVER

    def train(opt_in):
        with monkeypatch.context() as m:
            if opt_in:
                m.setenv("PURINE_FC_EPILOGUE", "cublaslt")
            use_emulated_cupy(m, host_build_dir)
            losses, _, steps = bf16_gpt_steps(m, SOLVER, 4, 2, cuda_graph=cuda_graph)
            lt = sys.modules["nvmath.bindings.cublasLt"]
            return losses, steps, list(lt.matmuls), blaslt.plan_count(), blaslt.refused()

    on, off = train(True), train(False)
    np.testing.assert_allclose(on[0], off[0], rtol=1e-2)
    assert on[0][-1] < on[0][0]
    # 8 biased fc outputs as bits a step (qkv, proj, fc1, fc2 of 2 blocks), of
    # 4 shapes and bias addresses: 4 plans
    assert on[3] == 4 and not on[4]
    assert on[2].count(("BIAS", "bfloat16")) >= 8 and off[2] == []
    assert _bias_bits(on[1][0]) == 0 and _bias_bits(off[1][0]) > 0
