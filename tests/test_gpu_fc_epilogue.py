"""A fully connected layer's bias and fused ReLU in the cuBLASLt epilogue
(issue 35, item 7; gpu/blaslt.py) on the emulated device, with the emulated
``nvmath.linalg.advanced`` (tests/emulated_gpu/nvmath_advanced.py): against
the CPU reference and PyTorch (float64), the plan cache cold and warm, the
capture keeping the capturable path, the fallback when nvmath's advanced
API is missing."""
import numpy as np
import pytest

from purine_mpi.gpu import blas, blaslt
from purine_mpi.graph.core import Op
from purine_mpi.ops.catalog import get_kernel_class
from tests.emulated_gpu import DeviceArray, SimulatedRuntime, use_emulated_cupy
from tests.emulated_gpu.helpers import run_kernel
from tests.emulated_gpu.nvmath_advanced import LOG, PLAN_REFUSED, use_emulated_nvmath_advanced


def _rand(shape, dtype, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _dev(a):
    return np.array(a).view(DeviceArray)


@pytest.fixture
def lt(monkeypatch, host_build_dir):
    use_emulated_cupy(monkeypatch, host_build_dir)
    monkeypatch.setenv("PURINE_FC_EPILOGUE", "cublaslt")
    return use_emulated_nvmath_advanced(monkeypatch)


def test_by_default_the_layer_keeps_its_kernel(lt, monkeypatch):
    """The epilogue is opt-in (gpu/blaslt.py: nvmath allocates its result at
    each execute): without PURINE_FC_EPILOGUE the bias and ReLU stay in the
    bias_act kernel and nothing is planned."""
    monkeypatch.delenv("PURINE_FC_EPILOGUE")
    attrs = {"relu": True, "negative_slope": 0.0}
    ins = _case(np.float32, True)
    y = _dev(np.zeros((5, 4), np.float32))
    _fc(attrs).run([_dev(a) for a in ins], [y])
    assert LOG == [] and blaslt.plan_count() == 0
    np.testing.assert_allclose(np.asarray(y), run_kernel("InnerProduct", attrs, ins)[0],
                               **_tol(np.float32))


def test_the_emulated_execute_allocates_its_result(lt):
    """As nvmath-python 1.0 does on a GPU (seen on an H200: two pool
    allocations a steady iteration of cifar10_quick): each execute is a
    device allocation the no-allocation checks count."""
    from tests.emulated_gpu.arrays import Allocations
    x, w = _dev(_rand((3, 4), np.float32, 0)), _dev(_rand((2, 4), np.float32, 1))
    mm = lt.Matmul(w, x.T)
    mm.plan(epilog=lt.MatmulEpilog.RELU)
    Allocations.log.clear()
    Allocations.counting = True
    try:
        mm.execute()
        mm.execute()
    finally:
        Allocations.counting = False
    assert [shape for _, shape, _ in Allocations.log] == [(2, 3), (2, 3)]


def _fc(attrs):
    return get_kernel_class("InnerProduct")(Op("fc", "InnerProduct", [], [], dict(attrs)))


def _case(dtype, bias, seed=0):
    x, w = _rand((5, 3, 2), dtype, seed), _rand((4, 6), dtype, seed + 1)
    return [x, w] + ([_rand((4,), dtype, seed + 2)] if bias else [])


def _tol(dtype):
    return dict(rtol=1e-12, atol=1e-12) if dtype == np.float64 else dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias, relu", [(True, True), (True, False), (False, True)])
def test_forward_in_the_epilogue_cold_and_warm(lt, dtype, bias, relu):
    attrs = {"relu": True, "negative_slope": 0.0} if relu else {}
    ins = _case(dtype, bias)
    kernel = _fc(attrs)
    dev_ins = [_dev(a) for a in ins]
    y = _dev(np.full((5, 4), np.nan, dtype))
    epilog = ("RELU_BIAS" if bias else "RELU") if relu else "BIAS"
    for step in range(3):   # cold (plans), then warm: execute only, new values read
        host = _case(dtype, bias, seed=10 * step)
        for d, h in zip(dev_ins, host):
            d[...] = h
        kernel.run(dev_ins, [y])
        want = run_kernel("InnerProduct", attrs, host)[0]   # the CPU op
        np.testing.assert_allclose(np.asarray(y), want, **_tol(dtype))
        assert LOG == [("plan", epilog)] + [("execute", epilog)] * (step + 1)
    assert blaslt.plan_count() == 1
    if relu:
        assert (np.asarray(y) >= 0).all() and (np.asarray(y) == 0).any()


def test_fc_relu_forward_and_backward_against_torch(lt):
    """The epilogue's output is the ReLU mask of the fused layer's backward
    (the ReluGrad reads y): forward and gradients against PyTorch, float64."""
    torch = pytest.importorskip("torch")
    x, w, b = _case(np.float64, True, seed=3)
    dy = _rand((5, 4), np.float64, 9)
    y = _dev(np.zeros((5, 4)))
    _fc({"relu": True, "negative_slope": 0.0}).run([_dev(x), _dev(w), _dev(b)], [y])
    assert LOG[-1] == ("execute", "RELU_BIAS")

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


def test_a_capture_keeps_the_capturable_path_and_says_so(lt, capsys):
    """Matmul.execute allocates its result: never inside a capture. The
    captured layer keeps cuBLAS + bias_act, replays right, said once."""
    attrs = {"relu": True, "negative_slope": 0.0}
    x, w, b = (_dev(a) for a in _case(np.float32, True))
    y = _dev(np.zeros((5, 4), np.float32))
    rt = SimulatedRuntime(0)
    s = rt.stream(0, "capture")
    blas.reserve(s)
    kernel = _fc(attrs)
    rt.begin_capture(0, s)
    rt.launch(0, s, lambda: kernel.run([x, w, b], [y]), "fc")
    rt.launch(0, s, lambda: kernel.run([x, w, b], [y]), "fc")
    graph = rt.end_capture(0, s)
    assert LOG == []
    x[...] = _rand(x.shape, np.float32, 7)
    rt.launch_graph(0, graph, s)
    s.synchronize()
    want = run_kernel("InnerProduct", attrs, [np.asarray(a) for a in (x, w, b)])[0]
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-5, atol=2e-5)
    err = capsys.readouterr().err
    assert err.count(blaslt.CAPTURE_NOTE) == 1, err


def test_the_emulated_api_refuses_planning_and_execute_inside_a_capture(lt):
    x, w = _dev(_rand((3, 4), np.float32, 0)), _dev(_rand((2, 4), np.float32, 1))
    rt = SimulatedRuntime(0)
    s = rt.stream(0, "capture")
    planned = lt.Matmul(w, x.T)
    planned.plan(epilog=lt.MatmulEpilog.RELU)
    rt.begin_capture(0, s)
    with pytest.raises(RuntimeError, match=PLAN_REFUSED.split(" (")[0]):
        rt.launch(0, s, lambda: lt.Matmul(w, x.T), "plan")
    rt.abort_capture(0, s)
    rt.begin_capture(0, s)
    with pytest.raises(RuntimeError, match="allocat"):
        rt.launch(0, s, lambda: planned.execute(stream=s), "execute")
    rt.abort_capture(0, s)


@pytest.mark.parametrize("case", ["relu_aux_bias", "drelu_bgrad", "bgradb"])
def test_the_emulated_epilogues_against_numpy(lt, case):
    """The stand-in's own arithmetic, for the epilogues a backward would use."""
    E = lt.MatmulEpilog
    a, b = _rand((4, 6), np.float64, 0), _rand((6, 5), np.float64, 1)
    bias, prod = _rand((4,), np.float64, 2), a @ _rand((6, 5), np.float64, 1)
    if case == "relu_aux_bias":
        mm = lt.Matmul(_dev(a), _dev(b))
        mm.plan(epilog=E.RELU_AUX_BIAS, epilog_inputs={"bias": _dev(bias)})
        d, aux = mm.execute()
        np.testing.assert_allclose(d, np.maximum(prod + bias[:, None], 0))
        np.testing.assert_array_equal(aux["relu_aux"] != 0, prod + bias[:, None] > 0)
    elif case == "drelu_bgrad":
        mask = (prod > 0).astype(np.uint8)
        mm = lt.Matmul(_dev(a), _dev(b))
        mm.plan(epilog=E.DRELU_BGRAD, epilog_inputs={"relu_aux": mask})
        d, aux = mm.execute()
        np.testing.assert_allclose(d, np.where(mask != 0, prod, 0))
        np.testing.assert_allclose(aux["drelu_bgrad"], np.where(mask != 0, prod, 0).sum(1))
    else:
        mm = lt.Matmul(_dev(a), _dev(b))
        mm.plan(epilog=E.BGRADB)
        d, aux = mm.execute()
        np.testing.assert_allclose(d, prod)
        np.testing.assert_allclose(aux["bgradb"], b.sum(0))


def test_without_the_advanced_api_the_layer_says_so_once(monkeypatch, host_build_dir, capsys):
    use_emulated_cupy(monkeypatch, host_build_dir)
    monkeypatch.setenv("PURINE_FC_EPILOGUE", "cublaslt")
    use_emulated_nvmath_advanced(monkeypatch, enabled=False)
    attrs = {"relu": True, "negative_slope": 0.0}
    ins = _case(np.float32, True)
    for _ in range(2):
        y = _dev(np.zeros((5, 4), np.float32))
        _fc(attrs).run([_dev(a) for a in ins], [y])
        np.testing.assert_allclose(np.asarray(y), run_kernel("InnerProduct", attrs, ins)[0],
                                   rtol=2e-5, atol=2e-5)
    err = capsys.readouterr().err
    assert err.count("nvmath.linalg.advanced") == 1 and "missing" in err, err
    assert blaslt.plan_count() == 0


def test_a_leaky_relu_keeps_its_kernel(lt):
    attrs = {"relu": True, "negative_slope": 0.1}
    ins = _case(np.float64, True)
    y = _dev(np.zeros((5, 4)))
    _fc(attrs).run([_dev(a) for a in ins], [y])
    assert LOG == []
    np.testing.assert_allclose(np.asarray(y), run_kernel("InnerProduct", attrs, ins)[0],
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_a_net_with_fc_relu_trains_like_the_cpu(lt, cuda_graph, capsys):
    """fc -> relu fused (parallel/fuse.py), the epilogue eagerly; captured,
    the layer keeps its capturable path: both train like the CPU."""
    from tests.emulated_gpu.helpers import tiny_raw, train_simulated
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
    config = validate_config(dict(raw, net=net), check_files=False)
    cpu_losses, cpu_params = train_simulated(config, -1, iters=3)
    losses, params, _ = train_simulated(config, 0, iters=3, cuda_graph=cuda_graph, fuse=True)
    np.testing.assert_allclose(losses, cpu_losses, rtol=1e-4)
    for name, value in cpu_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    executed = [e for e in LOG if e[0] == "execute"]
    if cuda_graph:   # eager iterations before the capture execute; replays do not
        assert executed.count(("execute", "RELU_BIAS")) < 3, LOG
        assert capsys.readouterr().err.count(blaslt.CAPTURE_NOTE) == 1
    else:
        assert executed.count(("execute", "RELU_BIAS")) == 3 and \
            executed.count(("execute", "BIAS")) == 3, LOG


def test_a_library_refusal_falls_back_to_the_kernels_said_once(lt, monkeypatch, capfd):
    """The real nvmath may refuse operands the emulated one takes (a layout,
    a dtype): the layer then keeps cuBLAS + its bias/ReLU kernel for good,
    says so once, and the result is still right."""
    import tests.emulated_gpu.nvmath_advanced as emulated

    def refuse(self, *a, **kw):
        raise ValueError("unsupported layout for the epilogue")
    monkeypatch.setattr(emulated.Matmul, "plan", refuse)
    attrs = {"relu": True, "negative_slope": 0.0}
    kernel = _fc(attrs)
    for step in range(2):
        host = _case(np.float32, True, seed=step)
        y = _dev(np.full((5, 4), np.nan, np.float32))
        kernel.run([_dev(a) for a in host], [y])
        np.testing.assert_allclose(np.asarray(y), run_kernel("InnerProduct", attrs, host)[0],
                                   **_tol(np.float32))
    err = capfd.readouterr().err
    assert err.count("cuBLASLt epilogue refused (ValueError: unsupported layout") == 1, err
    assert blaslt.plan_count() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias, relu", [(True, True), (True, False), (False, True)])
def test_the_real_epilogue_on_a_gpu(monkeypatch, dtype, bias, relu):
    """nvmath-python's own cuBLASLt epilogue (PURINE_FC_EPILOGUE=cublaslt) on
    a GPU: x^T taken as a column-ordered operand, the bias one value per row
    of y^T; cold then warm, against the CPU op."""
    from tests.conftest import cuda_cupy_or_skip
    cupy = cuda_cupy_or_skip()
    pytest.importorskip("nvmath.linalg.advanced")
    monkeypatch.setenv("PURINE_FC_EPILOGUE", "cublaslt")
    blaslt.reset()
    attrs = {"relu": True, "negative_slope": 0.0} if relu else {}
    kernel = _fc(attrs)
    dev_ins = [cupy.asarray(a) for a in _case(dtype, bias)]
    y = cupy.full((5, 4), np.nan, dtype)
    try:
        for step in range(3):
            host = _case(dtype, bias, seed=10 * step)
            for d, h in zip(dev_ins, host):
                d[...] = cupy.asarray(h)
            kernel.run(dev_ins, [y])
            cupy.cuda.get_current_stream().synchronize()
            want = run_kernel("InnerProduct", attrs, host)[0]
            np.testing.assert_allclose(cupy.asnumpy(y), want, **_tol(dtype))
        assert blaslt.plan_count() == 1
    finally:
        blaslt.reset()
