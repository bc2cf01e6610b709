"""bf16 products on bfloat16 tensor cores (docs/gpu.md, "Precision";
gpu/blas.gemm_ex, gemm_low; ops/fc.py): a bf16 op's fully connected
products convert their operands (bfloat16 values in float32 storage) to
bfloat16 bits in the op's reserved scratch and run one cublasGemmEx
(CUDA_R_16BF operands, CUDA_R_32F result, CUBLAS_COMPUTE_32F).

- ``gemm_ex`` against the float32 product of the widened operands: bit for
  bit on the emulated device (tests/emulated_gpu: its GemmEx widens the
  bits and multiplies in float32), within cuBLAS's summation order on a GPU
  (the ``cupy`` parameter, marked gpu; the lead's H200 check:
  ``python -m pytest -q -m gpu tests/test_gpu_bf16_gemm.py``);
- its argument checks, and the fallback to the TF32 path when cuBLAS
  refuses a GemmEx (said once);
- the fc ops' three directions on gemm_ex equal the TF32 path bit for bit
  on the emulated device (bf16 values are exact in TF32; each product of
  two of them is exact in float32);
- a bf16 GPT on the emulated device: its fc products all go to gemm_ex, the
  losses are the TF32 path's bit for bit, and a steady captured iteration
  allocates nothing; ``plan`` counts the bits' scratch.
"""
import numpy as np
import pytest

from purine_mpi.graph.core import Op
from purine_mpi.ops.registry import make_kernel
from tests.emulated_gpu.fixtures import device  # noqa: F401

BF16, FP16 = "bfloat16", "float16"


def _low_values(rng, shape, low):
    """(float32 values exact in ``low``, their uint16 bits)."""
    x = rng.standard_normal(shape).astype(np.float32)
    if low == FP16:
        half = x.astype(np.float16)
        return half.astype(np.float32), half.view(np.uint16)
    bits = (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16)   # truncated: bf16-exact
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32), bits


def _cublas():
    import sys
    return sys.modules["nvmath.bindings.cublas"]


@pytest.mark.parametrize("low", [BF16, FP16])
@pytest.mark.parametrize("case", ["nn", "nt", "tn", "batched"])
def test_gemm_ex_gives_the_float32_product_of_the_widened_operands(device, low, case):
    from purine_mpi.gpu.blas import gemm_ex
    rng = np.random.default_rng(7)
    m, n, k = 37, 29, 300
    trans_a, trans_b = case == "tn", case == "nt"
    a_shape = (4, m, k) if case == "batched" else ((k, m) if trans_a else (m, k))
    b_shape = (n, k) if trans_b else (k, n)
    (a, a_bits), (b, b_bits) = _low_values(rng, a_shape, low), _low_values(rng, b_shape, low)
    c_shape = (4, m, n) if case == "batched" else (m, n)
    c = device.to_device(np.full(c_shape, np.nan, np.float32))
    gemm_ex(device.to_device(a_bits), device.to_device(b_bits), c, low, trans_a=trans_a,
            trans_b=trans_b)
    got = np.asarray(device.to_host(c))
    op_a, op_b = (a.swapaxes(-1, -2) if trans_a else a), (b.T if trans_b else b)
    if device.name == "emulated":   # the float32 GEMM of the widened values, bit for bit
        from purine_mpi.gpu.blas import gemm
        wide = device.to_device(np.full(c_shape, np.nan, np.float32))
        gemm(device.to_device(a), device.to_device(b), wide, trans_a=trans_a, trans_b=trans_b)
        np.testing.assert_array_equal(got, np.asarray(device.to_host(wide)))
        np.testing.assert_allclose(got, np.matmul(op_a, op_b), rtol=1e-5, atol=1e-4)
        batched = case == "batched"
        assert [g[0] for g in _cublas().gemms] == [
            "gemm_strided_batched_ex" if batched else "gemm_ex",
            "sgemm_strided_batched" if batched else "sgemm"]
        return
    # a GPU: CuPy's float32 product of the widened operands (exact in TF32
    # too, should it be on); the products are exact, the sums differ by
    # cuBLAS's order: at most k roundings of 2^-24 of the sum of magnitudes
    import cupy
    want = cupy.asnumpy(cupy.matmul(cupy.asarray(op_a), cupy.asarray(op_b)))
    bound = np.matmul(np.abs(op_a).astype(np.float64), np.abs(op_b).astype(np.float64))
    assert np.all(np.abs(got.astype(np.float64) - want) <= 2 * k * 2.0 ** -24 * bound)


def test_gemm_ex_checks_its_arguments(device):
    from purine_mpi.gpu.blas import gemm_ex
    bits = device.to_device(np.zeros((4, 6), np.uint16))
    c = device.to_device(np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError, match="operands of bfloat16, float16, got 'float8'"):
        gemm_ex(bits, bits, c, "float8", trans_b=True)
    with pytest.raises(TypeError, match="uint16 bits of bfloat16 values, got float32 and uint16"):
        gemm_ex(device.to_device(np.zeros((4, 6), np.float32)), bits, c, BF16, trans_b=True)
    with pytest.raises(TypeError, match="a float32 result .*only, got float64"):
        gemm_ex(bits, bits, device.to_device(np.zeros((4, 4))), BF16, trans_b=True)
    with pytest.raises(ValueError, match="does not give c"):
        gemm_ex(bits, bits, c, BF16)   # (4, 6) @ (4, 6)
    if device.name == "emulated":   # cuBLAS's own check: types it has no GemmEx for
        cublas = _cublas()
        from purine_mpi.gpu import blas, import_cupy
        handle = blas.reserve(import_cupy().cuda.get_current_stream())
        with pytest.raises(cublas.cuBLASError, match="NOT_SUPPORTED"):   # bf16 A, fp16 B
            cublas.gemm_ex(handle, 0, 0, 4, 4, 6, 0, 0, 14, 4, 0, 2, 6, 0, 0, 0, 4, 68, -1)


def _fc_kernels(compute_dtype):
    """InnerProduct, its data and weight gradients, marked ``compute_dtype``."""
    attrs = {"num_output": 6, "compute_dtype": compute_dtype}
    return (make_kernel(Op("fc", "InnerProduct", ["x", "w"], ["y"], attrs)),
            make_kernel(Op("fd", "InnerProductGradData", ["dy", "w"], ["dx"],
                           dict(attrs, x_shape=[10, 3, 4]))),
            make_kernel(Op("fw", "InnerProductGradWeight", ["dy", "x"], ["dw"], attrs)))


def _run_fc(device, kernels, x, w, dy):
    """(y, dx, dw) of the three kernels on the device, each set up first."""
    fc, fd, fw = kernels
    on = [device.to_device(a) for a in (x, w, dy)]
    outs = [device.to_device(np.full(s, np.nan, np.float32)) for s in ((10, 6), x.shape,
                                                                       w.shape)]
    for k, ins, out in ((fc, [on[0], on[1]], outs[0]), (fd, [on[2], on[1]], outs[1]),
                        (fw, [on[2], on[0]], outs[2])):
        k.setup(ins, [out])
        k.run(ins, [out])
    return [np.asarray(device.to_host(o)) for o in outs]


def test_the_fc_directions_on_gemm_ex_equal_the_tf32_path(device, monkeypatch):
    """bf16-exact operands, the three fc directions: on gemm_ex (two
    to_bf16_bits launches and one GemmEx each, the bits in the scratch the
    op reserved) and on TF32 (PURINE_BF16_GEMM=0: sgemm with TF32 math, no
    scratch) -- the same bits on the emulated device, and close on a GPU."""
    rng = np.random.default_rng(1)
    (x, _), (w, _), (dy, _) = (_low_values(rng, s, BF16) for s in ((10, 3, 4), (6, 12),
                                                                   (10, 6)))
    kernels = _fc_kernels(BF16)
    device.launched.clear()
    got = _run_fc(device, kernels, x, w, dy)
    assert device.launched.count("to_bf16_bits") == 6, device.launched
    from purine_mpi.gpu.scratch import Scratch
    for k, (a, b) in zip(kernels, (((10, 12), (6, 12)), ((10, 6), (6, 12)),
                                   ((10, 6), (10, 12)))):   # each op's two operands' bits
        assert k._own_scratch.reserved == Scratch._layout([(a, np.uint16), (b, np.uint16)])[1]
    monkeypatch.setenv("PURINE_BF16_GEMM", "0")
    tf32_kernels = _fc_kernels(BF16)
    device.launched.clear()
    want = _run_fc(device, tf32_kernels, x, w, dy)
    assert "to_bf16_bits" not in device.launched
    assert all(getattr(k, "_own_scratch", None) is None or k._own_scratch.reserved == 0
               for k in tf32_kernels)
    host = [x.reshape(10, 12) @ w.T, (dy @ w).reshape(x.shape), dy.T @ x.reshape(10, 12)]
    for g, t, h in zip(got, want, host):
        if device.name == "emulated":
            np.testing.assert_array_equal(g, t)
        np.testing.assert_allclose(g, h, rtol=1e-2, atol=1e-2)   # rounded to bf16 after
    if device.name == "emulated":
        names = [g[0] for g in _cublas().gemms]
        assert names == ["gemm_ex"] * 3 + ["sgemm"] * 3, names


def test_a_refused_gemm_ex_falls_back_to_tf32_said_once(device, monkeypatch, capsys):
    """cuBLAS refusing GemmEx (here the emulated one, as an old cuBLAS or
    an unsupported device would): the product takes the TF32 path, the
    same numbers, one line on stderr, and later products skip the
    conversions."""
    if device.name != "emulated":
        pytest.skip("refusing is the emulated cuBLAS's")
    cublas = _cublas()

    def refuse(*args):
        raise cublas.cuBLASError("gemm_ex: CUBLAS_STATUS_NOT_SUPPORTED")

    rng = np.random.default_rng(2)
    (x, _), (w, _), (dy, _) = (_low_values(rng, s, BF16) for s in ((10, 3, 4), (6, 12),
                                                                   (10, 6)))
    want = _run_fc(device, _fc_kernels(BF16), x, w, dy)
    monkeypatch.setattr(cublas, "gemm_ex", refuse)
    device.launched.clear()
    got = _run_fc(device, _fc_kernels(BF16), x, w, dy)
    for g, t in zip(got, want):
        np.testing.assert_array_equal(g, t)
    assert device.launched.count("to_bf16_bits") == 2   # the first product's, then none
    err = capsys.readouterr().err
    assert err.count("run on TF32 tensor cores") == 1 and "NOT_SUPPORTED" in err, err


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["streams", "cuda-graph"])
def test_a_bf16_gpt_allocates_nothing_and_plan_counts_the_bits(host_build_dir, monkeypatch,
                                                                cuda_graph):
    """The 2-block GPT in bf16 on the emulated device: its fc products go
    to GemmEx, a steady iteration (captured or not) allocates nothing --
    the bits live in the scratch the ops reserved in setup -- and the
    device's scratch is what ``plan`` counts (runtime/footprint.
    device_extras: the bits of each fc op's float32 operands -- none for an
    operand stored as bits, parallel/precision.store_bits -- and the float32
    product of a forward fc with a bias whose output is stored as bits;
    none with PURINE_BF16_GEMM=0)."""
    from purine_mpi.gpu.scratch import Scratch
    from purine_mpi.layers.fillers import fill
    from purine_mpi.parallel.placement import prepare_for_device
    from purine_mpi.runtime.factory import make_dispatcher
    from purine_mpi.runtime.footprint import device_extras
    from tests.emulated_gpu import Allocations, SimulatedRuntime, use_emulated_cupy
    from tests.gpt_oracle import gpt_graph, gpt_net
    from tests.test_precision import SOLVER
    use_emulated_cupy(monkeypatch, host_build_dir)
    net = gpt_net(vocab=16, width=16, heads=2, blocks=2, max_length=8, approximate="tanh")
    g, _, _ = gpt_graph(net, dict(SOLVER, max_iter=3), 2, 8)
    prepare_for_device(g, 0, precision="bf16")
    extras = device_extras(g, 0, cuda_graph)
    fc = [op for op in g.ops.values() if op.op_type.startswith("InnerProduct")
          and op.op_type != "InnerProductGradBias"]
    assert len(fc) >= 12 and all(op.attrs.get("compute_dtype") == BF16 for op in fc)
    stored = 0
    for op in fc:
        a, b = (g.blobs[n].shape for n in op.inputs[:2])
        a = (int(np.prod(a[:-1])), a[-1])     # the GPT's fc layers flatten from the last axis
        if op.op_type == "InnerProductGradWeight":
            b = (int(np.prod(b[:-1])), b[-1])
        floats = [(s, np.uint16) for s, n in zip((a, b), op.inputs[:2])
                  if g.blobs[n].dtype == "float32"]
        stored += 2 - len(floats)
        y = g.blobs[op.outputs[0]]
        if op.op_type == "InnerProduct" and len(op.inputs) == 3 and y.dtype == "uint16":
            # an output stored as bits with a bias: GemmEx's float32 product,
            # to which bias_bits adds the bias before the one rounding
            floats.append(((a[0], y.shape[-1]), np.float32))
        want = Scratch._layout(floats)[1] if floats else 0
        assert extras["ops"].get(op.name, (0,))[0] == want, op.name
    assert stored >= 12   # the weights' copies and the operands stored as bits
    cublas = _cublas()
    d = make_dispatcher(g, runtime=SimulatedRuntime(1), seed=1, cuda_graph=cuda_graph)
    toks = np.random.default_rng(5).integers(0, 16, (3, 2, 9))
    try:
        for p in g.params():
            d.workspace.set(p.name, fill(p, 1))
        for it in range(3):
            d.workspace.set("data", toks[it, :, :-1].astype(np.int32))
            d.workspace.set("label", toks[it, :, 1:].astype(np.int32))
            d.workspace["iter"][...] = it
            Allocations.counting, Allocations.log = it == 2, []
            d.run(it)
            Allocations.counting = False
        assert Allocations.log == []
        assert np.isfinite(float(d.workspace["loss"]))
        assert sum(d.workspace.scratch_bytes.values()) == extras["scratch"]
        assert {what for what, _, _ in cublas.gemms} >= {"gemm_ex"}
    finally:
        Allocations.counting = False
        d.close()
    monkeypatch.setenv("PURINE_BF16_GEMM", "0")   # float32 storage, products on TF32
    g, _, _ = gpt_graph(net, dict(SOLVER, max_iter=3), 2, 8)
    prepare_for_device(g, 0, precision="bf16")
    assert all(b.dtype != "uint16" for b in g.blobs.values())
    assert not set(device_extras(g, 0, cuda_graph)["ops"]) & {op.name for op in fc}


def test_without_nvmath_gemm_ex_takes_cupys_gemmEx(device, monkeypatch):
    """nvmath-python missing: the products take CuPy's cuBLAS binding
    (``gemmEx``, ``gemmStridedBatchedEx``, its codes from
    ``cupy.cuda.runtime`` and ``cupy.cuda.cublas``), the same numbers."""
    if device.name != "emulated":
        pytest.skip("nvmath is removed on the emulated device only")
    from purine_mpi.gpu import blas, import_cupy
    from tests.emulated_gpu import use_emulated_nvmath
    rng = np.random.default_rng(4)
    (x, _), (w, _), (dy, _) = (_low_values(rng, s, BF16) for s in ((10, 3, 4), (6, 12),
                                                                   (10, 6)))
    want = _run_fc(device, _fc_kernels(BF16), x, w, dy)
    use_emulated_nvmath(monkeypatch, enabled=False)
    assert blas.blas_backend() == "cupy"
    host = import_cupy().cuda.cublas
    before = len(host.gemms)
    got = _run_fc(device, _fc_kernels(BF16), x, w, dy)
    for g, t in zip(got, want):
        np.testing.assert_array_equal(g, t)
    assert [name for name, _ in host.gemms[before:]] == ["gemmEx"] * 3
    (a, a_bits), (b, b_bits) = (_low_values(rng, s, BF16) for s in ((3, 5, 7), (7, 4)))
    c = device.to_device(np.zeros((3, 5, 4), np.float32))
    blas.gemm_ex(device.to_device(a_bits), device.to_device(b_bits), c, BF16)
    assert host.gemms[-1][0] == "gemmStridedBatchedEx"
    np.testing.assert_allclose(np.asarray(device.to_host(c)), np.matmul(a, b), rtol=1e-6)
