"""A fully connected layer's bias and fused ReLU in the cuBLASLt epilogue
(issue 35, item 7; gpu/blaslt.py, ``PURINE_FC_EPILOGUE=cublaslt``) through
``nvmath.bindings.cublasLt`` on the emulated device (tests/emulated_gpu/
cublaslt.py): against the CPU reference and PyTorch (float64), the plan
made once and then one ``matmul`` a product, the leading dimensions and
transposes, a captured iteration using it and allocating nothing, the
fallback (said once) when the binding is missing or the heuristic finds no
algorithm. The bf16 case: tests/test_gpu_fc_lt_bf16.py."""
import sys

import numpy as np
import pytest

from purine_mpi.gpu import blas, blaslt
from purine_mpi.graph.core import Op
from purine_mpi.ops.catalog import get_kernel_class
from tests.emulated_gpu import Allocations, DeviceArray, SimulatedRuntime, use_emulated_cupy
from tests.emulated_gpu.helpers import run_kernel


def _rand(shape, dtype, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _dev(a):
    return np.array(a).view(DeviceArray)


@pytest.fixture
def lt(monkeypatch, host_build_dir):
    """The emulated nvmath cuBLASLt binding, opted in."""
    use_emulated_cupy(monkeypatch, host_build_dir)
    monkeypatch.setenv("PURINE_FC_EPILOGUE", "cublaslt")
    yield sys.modules["nvmath.bindings.cublasLt"]
    Allocations.counting = False


def _heuristics(lt):
    return len(lt.heuristics)


def _fc(attrs):
    return get_kernel_class("InnerProduct")(Op("fc", "InnerProduct", [], [], dict(attrs)))


def _case(dtype, bias, seed=0):
    x, w = _rand((5, 3, 2), dtype, seed), _rand((4, 6), dtype, seed + 1)
    return [x, w] + ([_rand((4,), dtype, seed + 2)] if bias else [])


def _tol(dtype):
    return dict(rtol=1e-12, atol=1e-12) if dtype == np.float64 else dict(rtol=2e-5, atol=2e-5)


def test_by_default_the_layer_keeps_its_kernel(lt, monkeypatch):
    """The epilogue is opt-in: without PURINE_FC_EPILOGUE the bias and ReLU
    stay in the bias_act kernel and cuBLASLt is not called."""
    monkeypatch.delenv("PURINE_FC_EPILOGUE")
    attrs = {"relu": True, "negative_slope": 0.0}
    ins = _case(np.float32, True)
    y = _dev(np.zeros((5, 4), np.float32))
    _fc(attrs).run([_dev(a) for a in ins], [y])
    assert lt.calls == [] and blaslt.plan_count() == 0
    np.testing.assert_allclose(np.asarray(y), run_kernel("InnerProduct", attrs, ins)[0],
                               **_tol(np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias, relu", [(True, True), (True, False), (False, True)])
def test_forward_in_the_epilogue_cold_and_warm(lt, dtype, bias, relu):
    attrs = {"relu": True, "negative_slope": 0.0} if relu else {}
    ins = _case(dtype, bias)
    kernel = _fc(attrs)
    dev_ins = [_dev(a) for a in ins]
    y = _dev(np.full((5, 4), np.nan, dtype))
    epilog = ("RELU_BIAS" if bias else "RELU") if relu else "BIAS"
    name = np.dtype(dtype).name
    for step in range(3):   # cold (plans), then warm: matmul only, new values read
        host = _case(dtype, bias, seed=10 * step)
        for d, h in zip(dev_ins, host):
            d[...] = h
        kernel.run(dev_ins, [y])
        want = run_kernel("InnerProduct", attrs, host)[0]   # the CPU op
        np.testing.assert_allclose(np.asarray(y), want, **_tol(dtype))
        assert lt.matmuls == [(epilog, name)] * (step + 1)
        assert _heuristics(lt) == 1
    assert blaslt.plan_count() == 1
    if relu:
        assert (np.asarray(y) >= 0).all() and (np.asarray(y) == 0).any()


def test_the_leading_dimensions_and_transposes_reach_cublaslt(lt):
    """x, w and y as row views of wider arrays (row strides 9, 8 and 7): the
    layouts' ld are theirs (y^T = w @ x^T column-major), the columns
    outside y untouched; a wrong ld or transpose gives other numbers."""
    xs, ws = _rand((5, 9), np.float64, 0), _rand((4, 8), np.float64, 1)
    bias = _rand((4,), np.float64, 2)
    x, w = _dev(xs)[:, :6], _dev(ws)[:, :6]
    ys = _dev(np.full((5, 7), np.nan))
    assert blaslt.fc_forward(x, w, ys[:, :4], _dev(bias), True)
    want = np.maximum(xs[:, :6] @ ws[:, :6].T + bias, 0)
    np.testing.assert_allclose(np.asarray(ys)[:, :4], want, rtol=1e-12, atol=1e-12)
    assert np.isnan(np.asarray(ys)[:, 4:]).all()
    layouts = [call[1:] for call in lt.calls if call[0] == "matrix_layout_create"]
    cuda_r_64f = 1
    assert layouts == [(cuda_r_64f, 6, 4, 8), (cuda_r_64f, 6, 5, 9), (cuda_r_64f, 4, 5, 7)]


def test_tf32_products_compute_in_fast_tf32(lt):
    """A float32 product where TF32 is on (gpu/blas ``tf32_products``)
    computes in COMPUTE_32F_FAST_TF32, as the cuBLAS path's math mode: the
    numbers of TF32-rounded operands; off, in COMPUTE_32F."""
    from tests.emulated_gpu.host_kernels import tf32_round
    x, w, b = _case(np.float32, True)
    x = x.reshape(5, 6)
    for tf32, compute in ((True, 77), (False, 68)):
        y = _dev(np.zeros((5, 4), np.float32))
        with blas.tf32_products(tf32):
            assert blaslt.fc_forward(_dev(x), _dev(w), y, _dev(b), False)
        assert ("matmul_desc_create", compute, 0) in lt.calls
        ops = (tf32_round(x), tf32_round(w)) if tf32 else (x, w)
        want = (ops[1] @ ops[0].T).T + b
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-6, atol=1e-6)
    assert blaslt.plan_count() == 2


def test_fc_relu_forward_and_backward_against_torch(lt):
    """The epilogue's output is the ReLU mask of the fused layer's backward
    (the ReluGrad reads y): forward and gradients against PyTorch, float64."""
    torch = pytest.importorskip("torch")
    x, w, b = _case(np.float64, True, seed=3)
    dy = _rand((5, 4), np.float64, 9)
    y = _dev(np.zeros((5, 4)))
    _fc({"relu": True, "negative_slope": 0.0}).run([_dev(x), _dev(w), _dev(b)], [y])
    assert lt.matmuls[-1] == ("RELU_BIAS", "float64")

    def op(op_type, attrs, ins, shape):
        out = _dev(np.zeros(shape))
        get_kernel_class(op_type)(Op(op_type, op_type, [], [], attrs)).run(ins, [out])
        return out

    dz = op("ReluGrad", {}, [_dev(dy), y], (5, 4))
    dx = op("InnerProductGradData", {"x_shape": [5, 3, 2]}, [dz, _dev(w)], (5, 3, 2))
    dw = op("InnerProductGradWeight", {}, [dz, _dev(x)], (4, 6))
    db = op("InnerProductGradBias", {}, [dz], (4,))
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    ty = torch.relu(tx.reshape(5, 6) @ tw.T + tb)
    ty.backward(torch.tensor(dy))
    for got, want in ((y, ty), (dx, tx.grad), (dw, tw.grad), (db, tb.grad)):
        np.testing.assert_allclose(np.asarray(got), want.detach().numpy(), rtol=1e-12,
                                   atol=1e-12)


def test_a_capture_records_the_epilogue_and_allocates_nothing(lt):
    """The plan made eagerly (the first product), the captured layer is one
    cuBLASLt matmul on y, nothing allocated while capturing or replaying;
    the replay reads the new x and writes the right y."""
    attrs = {"relu": True, "negative_slope": 0.0}
    x, w, b = (_dev(a) for a in _case(np.float32, True))
    y = _dev(np.zeros((5, 4), np.float32))
    rt = SimulatedRuntime(0)
    s = rt.stream(0, "capture")
    blas.reserve(s)
    kernel = _fc(attrs)
    with s:
        kernel.run([x, w, b], [y])   # eager: the plan
    s.synchronize()
    Allocations.log = []
    Allocations.counting = True
    rt.begin_capture(0, s)
    rt.launch(0, s, lambda: kernel.run([x, w, b], [y]), "fc")
    graph = rt.end_capture(0, s)
    x[...] = _rand(x.shape, np.float32, 7)
    rt.launch_graph(0, graph, s)
    s.synchronize()
    Allocations.counting = False
    assert Allocations.log == []
    assert lt.matmuls == [("RELU_BIAS", "float32")] * 2 and _heuristics(lt) == 1
    want = run_kernel("InnerProduct", attrs, [np.asarray(a) for a in (x, w, b)])[0]
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-5, atol=2e-5)
    # the workspace is the stream's cuBLAS handle's, its size the preference's
    handle = blas._handles[(0, int(s.ptr), None)]
    assert blaslt.plan_count() == 1
    plan = next(iter(blaslt._plans.values()))
    assert plan.workspace == (handle.workspace.ctypes.data, blas.workspace_bytes())


def test_without_the_binding_the_layer_says_so_once(lt, monkeypatch, capsys):
    bindings = sys.modules["nvmath.bindings"]
    monkeypatch.delattr(bindings, "cublasLt")
    monkeypatch.setitem(sys.modules, "nvmath.bindings.cublasLt", None)
    attrs = {"relu": True, "negative_slope": 0.0}
    ins = _case(np.float32, True)
    for _ in range(2):
        y = _dev(np.zeros((5, 4), np.float32))
        _fc(attrs).run([_dev(a) for a in ins], [y])
        np.testing.assert_allclose(np.asarray(y), run_kernel("InnerProduct", attrs, ins)[0],
                                   rtol=2e-5, atol=2e-5)
    err = capsys.readouterr().err
    assert err.count("nvmath.bindings.cublasLt (the cuBLASLt epilogue) is missing") == 1, err
    assert blaslt.plan_count() == 0


def test_a_leaky_relu_keeps_its_kernel(lt):
    attrs = {"relu": True, "negative_slope": 0.1}
    ins = _case(np.float64, True)
    y = _dev(np.zeros((5, 4)))
    _fc(attrs).run([_dev(a) for a in ins], [y])
    assert lt.matmuls == []
    np.testing.assert_allclose(np.asarray(y), run_kernel("InnerProduct", attrs, ins)[0],
                               rtol=1e-12, atol=1e-12)


def _fc_net_config():
    from tests.emulated_gpu.helpers import tiny_raw
    from purine_mpi.job.config import validate_config
    gauss = {"type": "gaussian", "std": 0.1}
    raw = tiny_raw()
    net = [raw["net"][0], raw["net"][1], raw["net"][2],
           {"type": "fc", "name": "fc1", "bottom": "pool1", "top": "fc1", "num_output": 7,
            "weight_filler": gauss, "bias_filler": {"type": "constant", "value": 0.05}},
           {"type": "relu", "name": "relu2", "bottom": "fc1", "top": "fc1"},
           {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2", "num_output": 5,
            "weight_filler": gauss},
           {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"], "top": "loss"}]
    return validate_config(dict(raw, net=net), check_files=False)


def test_a_captured_iteration_with_the_epilogue_allocates_nothing(lt, monkeypatch):
    """The fc net in CUDA graphs under the opt-in (as tests/test_gpu_no_alloc.py
    counts): the eager first iteration plans, the captured ones replay the
    cuBLASLt products, and the third iteration allocates nothing."""
    from purine_mpi.job.replica import build_train_graph
    from purine_mpi.parallel.placement import prepare_for_device
    from purine_mpi.runtime.factory import make_dispatcher
    from tests.conftest import make_job
    from tests.emulated_gpu import init_params
    from tests.emulated_gpu import capture
    real, captured = lt.matmul, []

    def matmul(*args):   # whether each call is recorded into a capture
        captured.append(capture.is_capturing())
        return real(*args)
    monkeypatch.setattr(lt, "matmul", matmul)
    graph, _ = build_train_graph(make_job(_fc_net_config()))
    prepare_for_device(graph, 0)
    d = make_dispatcher(graph, runtime=SimulatedRuntime(2), seed=1, cuda_graph=True)
    try:
        init_params(d.workspace, graph, 3)
        for it in range(3):
            d.workspace["iter"][...] = it
            Allocations.log = []
            Allocations.counting = it == 2
            try:
                d.run(it)
            finally:
                Allocations.counting = False
        assert Allocations.log == [], Allocations.log
        assert np.isfinite(float(d.workspace["loss"]))
        segs = list(d.executor.segment_plan.values())   # captured, replayed
        assert segs and all(s.failed is None and s.captures for s in segs), \
            [(s.name, s.failed) for s in segs]
    finally:
        d.close()
    # fc1 (+ ReLU) and fc2: eagerly first, then recorded into the captures
    assert lt.matmuls[:2] == [("RELU_BIAS", "float32"), ("BIAS", "float32")], lt.matmuls
    assert not captured[0] and any(captured), captured
    assert blaslt.plan_count() == 2 and not blaslt.refused()


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_a_net_with_fc_relu_trains_like_the_cpu(lt, cuda_graph):
    """fc -> relu fused (parallel/fuse.py) in the epilogue, eagerly and
    captured (the captured iterations replay the cuBLASLt products): both
    train like the CPU."""
    from tests.emulated_gpu.helpers import train_simulated
    config = _fc_net_config()
    cpu_losses, cpu_params = train_simulated(config, -1, iters=3)
    losses, params, _ = train_simulated(config, 0, iters=3, cuda_graph=cuda_graph, fuse=True)
    np.testing.assert_allclose(losses, cpu_losses, rtol=1e-4)
    for name, value in cpu_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    # the eager iterations call matmul; a captured one records it once
    assert ("RELU_BIAS", "float32") in lt.matmuls and ("BIAS", "float32") in lt.matmuls
    if not cuda_graph:
        assert lt.matmuls.count(("RELU_BIAS", "float32")) == 3
    assert blaslt.plan_count() == 2 and not blaslt.refused()


def test_no_algorithm_falls_back_to_the_kernels_said_once(lt, capfd):
    """Where cuBLASLt's heuristic returns no algorithm (the emulated hook),
    the layer keeps cuBLAS + its bias/ReLU kernel for that product, says so
    once, and the result is still right."""
    lt.no_algorithm = lambda config: True
    attrs = {"relu": True, "negative_slope": 0.0}
    kernel = _fc(attrs)
    dev_ins = [_dev(a) for a in _case(np.float32, True)]   # a layer's blobs: the same addresses
    y = _dev(np.full((5, 4), np.nan, np.float32))
    for step in range(2):
        host = _case(np.float32, True, seed=step)
        for d, h in zip(dev_ins, host):
            d[...] = h
        kernel.run(dev_ins, [y])
        np.testing.assert_allclose(np.asarray(y), run_kernel("InnerProduct", attrs, host)[0],
                                   **_tol(np.float32))
    err = capfd.readouterr().err
    assert err.count("cuBLASLt refused the epilogue (RuntimeError: the heuristic returned no "
                     "algorithm)") == 1, err
    assert blaslt.plan_count() == 0 and len(blaslt.refused()) == 1
    assert lt.matmuls == [] and _heuristics(lt) == 1   # refused for good: asked once


def test_rows_that_overlap_are_refused_not_misread(lt):
    """An operand whose rows overlap (a row stride below its width: a
    broadcast row, stride 0) has no column-major layout (cuBLASLt: ld >=
    rows): fc_forward says so (ValueError, as for a column stride) instead
    of handing cuBLASLt the width as ld, which reads the memory after the
    first row as the other rows."""
    base = _dev(_rand((5, 6), np.float64, 0))
    w, b = _dev(_rand((4, 6), np.float64, 1)), _dev(_rand((4,), np.float64, 2))
    for strides in ((0, 8), (8, 8)):
        x = np.lib.stride_tricks.as_strided(base, shape=(5, 6), strides=strides, subok=True)
        y = _dev(np.zeros((5, 4)))
        with pytest.raises(ValueError, match="overlap"):
            blaslt.fc_forward(x, w, y, b, False)
    ys = _dev(np.zeros((5, 4)))
    y = np.lib.stride_tricks.as_strided(ys, shape=(5, 4), strides=(0, 8), subok=True)
    with pytest.raises(ValueError, match="overlap"):
        blaslt.fc_forward(base, w, y, b, False)
    assert lt.matmuls == [] and blaslt.plan_count() == 0


def test_shapes_that_do_not_make_the_product_are_refused(lt):
    """y = x @ w^T + bias with a w of another width (cuBLASLt would take its
    first K columns), a y of other rows (written past, or left), a bias of
    another length or not packed (the BIAS epilogue reads O consecutive
    values): ValueError naming the shapes, nothing planned nor run."""
    x, w = _dev(_rand((5, 6), np.float64, 0)), _dev(_rand((4, 6), np.float64, 1))
    b2 = _dev(_rand((8,), np.float64, 2))
    for xx, ww, yy, bb in ((x, _dev(_rand((4, 7), np.float64, 1)), (5, 4), b2[:4]),
                           (x, w, (6, 4), b2[:4]), (x, w, (5, 3), b2[:4]),
                           (x, w, (5, 4), b2[:3]), (x, w, (5, 4), b2[::2])):
        with pytest.raises(ValueError, match="cuBLASLt fc"):
            blaslt.fc_forward(xx, ww, _dev(np.zeros(yy)), bb, False)
    assert lt.matmuls == [] and blaslt.plan_count() == 0


def test_a_heuristic_result_that_is_not_success_is_not_run(lt, capfd):
    """cublasLtMatmulAlgoGetHeuristic: a returned result's fields are valid
    only where its ``state`` is CUBLAS_STATUS_SUCCESS (the emulated hook
    returns one whose state is NOT_SUPPORTED): the product is refused at
    its plan, said once, cublasLtMatmul never called with that algorithm,
    and the layer keeps its kernels."""
    lt.heuristic_state = lambda config: 15
    attrs = {"relu": True, "negative_slope": 0.0}
    ins = _case(np.float32, True)
    y = _dev(np.zeros((5, 4), np.float32))
    _fc(attrs).run([_dev(a) for a in ins], [y])
    np.testing.assert_allclose(np.asarray(y), run_kernel("InnerProduct", attrs, ins)[0],
                               **_tol(np.float32))
    assert not [c for c in lt.calls if c[0] == "matmul"], lt.calls
    err = capfd.readouterr().err
    assert err.count("cuBLASLt refused the epilogue (RuntimeError: the heuristic's algorithm "
                     "has state 15)") == 1, err
    assert blaslt.plan_count() == 0 and len(blaslt.refused()) == 1


def test_a_plan_refused_at_its_product_is_kept_until_reset(lt, monkeypatch):
    """cublasLtMatmul refuses a product whose plan was made (the emulated
    call raises): the layer keeps its kernels from then on, but the plan's
    descriptors are not destroyed then -- another stream's thread may be
    inside a cublasLtMatmul with them (the plans are shared) -- only at
    ``reset``."""
    real = lt.matmul

    def refuse(*args):
        raise lt.cuBLASLtError("EXECUTION_FAILED")

    attrs = {"relu": True, "negative_slope": 0.0}
    ins = _case(np.float32, True)
    kernel, dev_ins = _fc(attrs), [_dev(a) for a in ins]
    y = _dev(np.zeros((5, 4), np.float32))
    kernel.run(dev_ins, [y])   # planned and run
    monkeypatch.setattr(lt, "matmul", refuse)
    kernel.run(dev_ins, [y])   # refused: the kernels
    np.testing.assert_allclose(np.asarray(y), run_kernel("InnerProduct", attrs, ins)[0],
                               **_tol(np.float32))
    assert blaslt.plan_count() == 0 and len(blaslt.refused()) == 1
    destroyed = [c for c in lt.calls if c[0] in ("matmul_desc_destroy", "matrix_layout_destroy")]
    assert destroyed == []
    monkeypatch.setattr(lt, "matmul", real)
    blaslt.reset()
    destroyed = [c[0] for c in lt.calls if c[0] in ("matmul_desc_destroy",
                                                     "matrix_layout_destroy")]
    assert sorted(destroyed) == ["matmul_desc_destroy"] + ["matrix_layout_destroy"] * 3


def test_the_emulated_heuristic_follows_the_datatype_table(lt):
    """cuBLAS's cublasLtMatmul() table: a bfloat16 D takes a bfloat16 bias
    (BIAS_DATA_TYPE defaults to D's type), not a float32 one; a float32 D
    of bfloat16 A/B takes a float32 bias."""
    import nvmath
    types = nvmath.CudaDataType
    handle = lt.create()

    def heuristic(d_type, bias_type):
        desc = lt.matmul_desc_create(68, int(types.CUDA_R_32F))
        for attr, value in ((lt.MatmulDescAttribute.EPILOGUE, int(lt.Epilogue.BIAS)),
                            (lt.MatmulDescAttribute.BIAS_POINTER, 256),
                            (lt.MatmulDescAttribute.BIAS_DATA_TYPE, bias_type)):
            buf = np.array([value], lt.get_matmul_desc_attribute_dtype(attr))
            lt.matmul_desc_set_attribute(desc, attr, buf.ctypes.data, buf.itemsize)
        a = lt.matrix_layout_create(int(types.CUDA_R_16BF), 8, 8, 8)
        d = lt.matrix_layout_create(d_type, 8, 8, 8)
        pref = lt.matmul_preference_create()
        results, count = lt.MatmulHeuristicResult(1), np.zeros(1, np.int32)
        lt.matmul_algo_get_heuristic(handle, desc, a, a, d, d, pref, 1, results.ptr,
                                     count.ctypes.data)
        return int(count[0])

    bf16, f32 = int(types.CUDA_R_16BF), int(types.CUDA_R_32F)
    assert heuristic(bf16, bf16) == 1 and heuristic(f32, f32) == 1
    with pytest.raises(lt.cuBLASLtError, match="NOT_SUPPORTED"):
        heuristic(bf16, f32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias, relu", [(True, True), (True, False), (False, True)])
def test_the_real_epilogue_on_a_gpu(monkeypatch, dtype, bias, relu):
    """cuBLASLt's own epilogue through nvmath.bindings.cublasLt
    (PURINE_FC_EPILOGUE=cublaslt) on a GPU, y its output: cold then warm,
    against the CPU op."""
    from tests.conftest import cuda_cupy_or_skip
    cupy = cuda_cupy_or_skip()
    pytest.importorskip("nvmath.bindings.cublasLt")
    monkeypatch.setenv("PURINE_FC_EPILOGUE", "cublaslt")
    blaslt.reset()
    attrs = {"relu": True, "negative_slope": 0.0} if relu else {}
    kernel = _fc(attrs)
    dev_ins = [cupy.asarray(a) for a in _case(dtype, bias)]
    y = cupy.full((5, 4), np.nan, dtype)
    try:
        with blas.tf32_products(False):
            for step in range(3):
                host = _case(dtype, bias, seed=10 * step)
                for d, h in zip(dev_ins, host):
                    d[...] = cupy.asarray(h)
                kernel.run(dev_ins, [y])
                cupy.cuda.get_current_stream().synchronize()
                want = run_kernel("InnerProduct", attrs, host)[0]
                np.testing.assert_allclose(cupy.asnumpy(y), want, **_tol(dtype))
        assert blaslt.plan_count() == 1 and not blaslt.refused(), blaslt.refused()
    finally:
        blaslt.reset()
