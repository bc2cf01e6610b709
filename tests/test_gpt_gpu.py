"""The transformer ops' GPU branches on the emulated device (and on a real
GPU when CuPy and one are there, marked ``gpu``): each op against its NumPy
path, the attention's products through gpu/blas.py's
cuBLAS (the emulated nvmath binding), the token-level loss through the
fused loss kernels, and a GPT trained on the simulated stream runtime, with
and without CUDA-graph capture, against the CPU with no allocation in a
steady-state iteration. The emulated device is tests/emulated_gpu/'s."""
import numpy as np
import pytest

from tests.emulated_gpu import compare as _compare


def _rand(shape, dtype, seed=0, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(dtype)


F64, F32 = np.float64, np.float32


@pytest.fixture
def products(monkeypatch):
    """The matrix products of gpu/blas.py, counted (they still run)."""
    from purine_mpi.gpu import blas
    calls, real = [], blas.gemm

    def spy(a, b, c, **kw):
        calls.append((tuple(a.shape), tuple(b.shape), tuple(c.shape)))
        return real(a, b, c, **kw)
    monkeypatch.setattr(blas, "gemm", spy)
    return calls


@pytest.mark.parametrize("dtype", [F64, F32])
def test_embedding_gpu_branch(device, dtype, products):
    ids = np.array([[1, 3, 3, 0], [3, 1, 4, 3]], dtype=np.int32)
    w = _rand((6, 5), dtype)
    (y,), _ = _compare(device, "Embedding", {}, [ids, w], [], dtype)
    products.clear()
    _compare(device, "EmbeddingGrad", {"input_dim": 6}, [_rand(y.shape, dtype, 1), ids],
             ["embedding_order_i32", "embedding_grad"], dtype)
    assert products == []  # raw kernels (tests/test_gpu_embedding_grad.py), no one-hot GEMM
    x, pw = _rand((2, 3, 5), dtype, 2), _rand((4, 5), dtype, 3)
    _compare(device, "PositionEmbedding", {}, [x, pw], [], dtype)
    _compare(device, "PositionEmbeddingGrad", {"max_length": 4}, [x], ["sum_rows"], dtype)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_layer_norm_and_gelu_gpu_branches(device, dtype):
    x, g, b = _rand((2, 3, 8), dtype, scale=3.0), _rand((8,), dtype, 1), _rand((8,), dtype, 2)
    # one kernel each way (cuda/layernorm.cu), its sums fixed-order trees;
    # dg and db the deterministic column sums, never CuPy's reductions
    (y, mean, rstd), _ = _compare(device, "LayerNorm", {"eps": 1e-5}, [x, g, b],
                                  ["layernorm_forward"], dtype)
    assert device.launched == ["layernorm_forward"]
    dy = _rand(y.shape, dtype, 3)
    _compare(device, "LayerNormGrad", {"outputs": ["dx", "dg", "db"]},
             [dy, x, g, mean, rstd], ["layernorm_backward"], dtype)
    # (float32, 8 columns: the vectorised column sums, four columns a thread)
    column_sum = "sum_rows_vec_f32" if dtype == F32 else "sum_rows"
    assert sorted(device.launched) == ["layernorm_backward", column_sum, column_sum]
    # GELU: one kernel each way (cuda/activation.cu), no scratch reserved
    # (CuPy's chain took ~10 launches and 3-4 temporaries of x's size)
    for approximate in ("none", "tanh"):
        _compare(device, "Gelu", {"approximate": approximate}, [x], ["gelu_forward"], dtype)
        assert device.launched == ["gelu_forward"]
        _compare(device, "GeluGrad", {"approximate": approximate}, [dy, x], ["gelu_backward"],
                 dtype)
        assert device.launched == ["gelu_backward"]
    for op_type, ins in (("Gelu", [x]), ("GeluGrad", [dy, x])):
        kernel = _probe(op_type, {"approximate": "tanh"})
        on_device = [device.to_device(a) for a in ins]
        assert kernel.scratch_specs(on_device, on_device[:1]) == []
        kernel.setup(on_device, on_device[:1])
        assert getattr(kernel, "_own_scratch", None) is None or kernel._own_scratch.reserved == 0


def _probe(op_type, attrs):
    from purine_mpi.graph.core import Op
    from purine_mpi.ops.catalog import get_kernel_class
    return get_kernel_class(op_type)(Op("probe", op_type, [], [], dict(attrs)))


#: GELU's two forms as PyTorch names them
_GELU_FORMS = ("none", "tanh")


def _gelu_oracle(x, approximate):
    """y, dy/dx and the gradient's scale (the sum of its two terms' sizes:
    they cancel near x = -0.75) at each (finite) x, to 100 bits (mpmath)."""
    mp = pytest.importorskip("mpmath")
    y, d, scale = [], [], []
    with mp.workprec(100):
        for v in x.astype(F64):
            v = mp.mpf(float(v))
            if approximate == "none":
                cdf, slope = mp.ncdf(v), v * mp.npdf(v)
            else:
                k, c = mp.sqrt(2 / mp.pi), mp.mpf("0.044715")
                cdf = 1 / (1 + mp.exp(-2 * k * (v + c * v ** 3)))   # 0.5 (1 + tanh u)
                slope = v * 2 * cdf * (1 - cdf) * k * (1 + 3 * c * v ** 2)
            y.append(float(v * cdf))
            d.append(float(cdf + slope))
            scale.append(float(abs(cdf) + abs(slope)))
    return np.array(y), np.array(d), np.array(scale)


def _gelu_points(dtype):
    """Both tails (beyond the kernels' bound of 16 / 40 too), the bulk, the
    gradient's zero near -0.75, tiny and subnormal values, +-0."""
    tiny = np.finfo(dtype).tiny
    return np.concatenate([np.linspace(-14, 14, 281), np.linspace(-0.80, -0.70, 11),
                           [-45.0, -20.0, 20.0, 45.0, -1e3, 1e3, 1e-30, -1e-30, tiny / 8,
                            -tiny / 8, 0.0, -0.0]]).astype(dtype)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("approximate", _GELU_FORMS)
def test_gelu_kernels_are_accurate_to_a_few_ulp(device, dtype, approximate):
    """gelu_forward / gelu_backward against a 100-bit evaluation (mpmath):
    within 4 ulp of y and of the gradient's scale (its terms cancel near
    its zero) over both tails, + the smallest normal number times (1 + |x|)^3
    (where Phi is subnormal, with fewer bits, and the factors of x scale its
    error: the deep left tail, |y| < 1e-34). PyTorch's CPU gelu (1 + erf, 1 + tanh:
    cancellation in the left tail) is far off in float32 -- the same bound
    rejects it, so it can fail -- and agrees to within its own cancellation
    (eps |x|; the tanh form's gradient eps |x| u')."""
    import torch
    from purine_mpi.gpu import kernels
    x = _gelu_points(dtype)
    y_ref, d_ref, scale = _gelu_oracle(x, approximate)
    xd = device.to_device(x)
    y = np.asarray(device.to_host(kernels.gelu_forward(xd, approximate)))
    d = np.asarray(device.to_host(kernels.gelu_backward(device.to_device(np.ones_like(x)), xd,
                                                        approximate)))
    assert y.dtype == d.dtype == dtype
    tiny = np.finfo(dtype).tiny
    # the floor: where Phi(x) (or the tanh form's 1 / (1 + e^-2u)) falls
    # below the smallest normal number it has fewer bits (subnormal), and y =
    # x Phi, d = Phi + x phi (with the tanh form's u' ~ x^2) scale that
    # absolute error by up to ~|x|^3: on an H200 float32 erfcf / expf gave y
    # 8e-38 off at x = -13 and d 2.8e-37 off at x = -10.2 (tanh form) there
    floor = tiny * (1 + np.abs(x.astype(F64))) ** 3
    tol_y = 4 * np.spacing(np.maximum(np.abs(y_ref), tiny).astype(dtype)) + floor
    tol_d = 4 * np.spacing(np.maximum(scale, tiny).astype(dtype)) + floor
    # (a GPU's erfcf / expf are within 2-4 ulp where glibc's are within 1)
    slack = 1 if device.name == "emulated" else 2
    err_y, err_d = np.abs(y - y_ref), np.abs(d - d_ref)
    assert (err_y <= slack * tol_y).all(), (x[err_y > slack * tol_y][:5], (err_y / tol_y).max())
    assert (err_d <= slack * tol_d).all(), (x[err_d > slack * tol_d][:5], (err_d / tol_d).max())
    t = torch.tensor(x, requires_grad=True)
    ty = torch.nn.functional.gelu(t, approximate=approximate)
    ty.backward(torch.ones_like(ty))
    torch_y, torch_d = ty.detach().numpy(), t.grad.numpy()
    eps = np.finfo(dtype).eps
    if dtype == F32:
        assert (np.abs(torch_y - y_ref) > 100 * tol_y).any()    # torch's float32 tail
        assert (np.abs(torch_d - d_ref) > 100 * tol_d).any()
    # torch's cancellation: 1 + erf / 1 + tanh to eps, times |x| in y; in the
    # gradient 1 - tanh^2 to eps, times |x| u' (u' = du/dx)
    xs = np.abs(x.astype(F64))
    cancel = xs * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * xs ** 2) if approximate == "tanh" \
        else 0.0
    np.testing.assert_array_less(np.abs(y - torch_y), 8 * eps * (np.abs(y_ref) + xs) + tiny)
    np.testing.assert_array_less(np.abs(d - torch_d), 8 * eps * (scale + 1 + cancel))


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("approximate", _GELU_FORMS)
def test_gelu_kernels_propagate_what_the_host_op_does(device, dtype, approximate):
    """inf, -inf, NaN, +-0, values whose square overflows: the GPU kernels
    give NaN exactly where the host op (NumPy) does (y(-inf) = -inf * 0,
    the gradient at +-inf, the tanh form's where x^2 overflows), and its
    values elsewhere, signed zeros included; in place (y over x, dx over
    dy) the same bits."""
    from purine_mpi.gpu import kernels
    from tests.emulated_gpu import run_kernel
    big = np.sqrt(np.finfo(dtype).max) * 4
    x = np.array([np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, big, -big, 1e3, -1e3, 1.5, -1.5],
                 dtype)
    dy = np.linspace(-2, 2, x.size).astype(dtype)
    attrs = {"approximate": approximate}
    with np.errstate(all="ignore"):
        (host_y,) = run_kernel("Gelu", attrs, [x])
        (host_dx,) = run_kernel("GeluGrad", attrs, [dy, x])
    y = run_kernel("Gelu", attrs, [x], device.to_device)[0]
    dx = run_kernel("GeluGrad", attrs, [dy, x], device.to_device)[0]
    for got, want in ((y, host_y), (dx, host_dx)):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        np.testing.assert_allclose(got[ok], want[ok], rtol=4 * np.finfo(dtype).eps, atol=0)
        np.testing.assert_array_equal(np.signbit(got[ok]), np.signbit(want[ok]))
    xin, dyin = device.to_device(x), device.to_device(dy)
    kernels.gelu_backward(dyin, xin, approximate, out=dyin)
    kernels.gelu_forward(xin, approximate, out=xin)
    np.testing.assert_array_equal(np.asarray(device.to_host(xin)).view(np.uint8),
                                  y.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(device.to_host(dyin)).view(np.uint8),
                                  dx.view(np.uint8))


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("outputs", [["dx", "dg", "db"], ["dx"], ["dg", "db"], ["db"]])
def test_layer_norm_kernels_on_rows_wider_than_a_block(device, dtype, outputs):
    """cuda/layernorm.cu on 600-wide rows (each of the 256 threads takes 2-3
    elements) with an offset of 80 standard deviations, each requested
    gradient alone: every output within rounding of the float64 NumPy path,
    and in float32 no further from it than the float32 NumPy path (the
    kernel's sums are in double)."""
    from tests.emulated_gpu import run_kernel

    def check(op_type, attrs, ins, kernels):
        truth = run_kernel(op_type, attrs, [a.astype(F64) for a in ins])
        cpu = run_kernel(op_type, attrs, ins)
        device.launched.clear()
        got = run_kernel(op_type, attrs, ins, device.to_device)
        assert set(kernels) <= set(device.launched), device.launched
        for t, c, d in zip(truth, cpu, got):
            assert d.dtype == dtype
            scale = np.abs(t).max()
            err, cpu_err = np.abs(d - t).max() / scale, np.abs(c - t).max() / scale
            assert err <= (1e-5 if dtype == F32 else 1e-13), (op_type, err)
            if dtype == F32:  # (in float64 the NumPy path is the truth)
                assert err <= cpu_err * 1.01 + np.finfo(dtype).eps, (op_type, err, cpu_err)
        return cpu

    x = _rand((3, 5, 600), dtype, 4, scale=0.5) + 40.0
    g, b = _rand((600,), dtype, 5), _rand((600,), dtype, 6)
    y, mean, rstd = check("LayerNorm", {"eps": 1e-5}, [x, g, b], ["layernorm_forward"])
    check("LayerNormGrad", {"outputs": outputs}, [_rand(x.shape, dtype, 7), x, g, mean, rstd],
          ["layernorm_backward"] if {"dx", "dg"} & set(outputs) else [])
    column_sum = "sum_rows_vec_f32" if dtype == F32 else "sum_rows"   # 600 columns
    assert device.launched.count(column_sum) == len({"dg", "db"} & set(outputs))


@pytest.mark.parametrize("dtype", [F64, F32])
def test_layer_norm_kernels_in_place(device, dtype):
    """y over x, and dx over dy, give what separate buffers give (each
    element is read and written by one thread after its row's sums)."""
    from purine_mpi.gpu import kernels
    x, g, b = _rand((4, 300), dtype, 8, scale=2.0), _rand((300,), dtype, 9), \
        _rand((300,), dtype, 10)
    d = device.to_device
    out = [d(np.zeros_like(x)), d(np.zeros(4, dtype)), d(np.zeros(4, dtype))]
    kernels.layernorm_forward(d(x), d(g), d(b), 1e-5, *out)
    xin = d(x)
    mean, rstd = d(np.zeros(4, dtype)), d(np.zeros(4, dtype))
    kernels.layernorm_forward(xin, d(g), d(b), 1e-5, xin, mean, rstd)
    np.testing.assert_array_equal(device.to_host(xin), device.to_host(out[0]))
    dy = _rand(x.shape, dtype, 11)
    dx, dyxhat = d(np.zeros_like(x)), d(np.zeros_like(x))
    kernels.layernorm_backward(d(dy), d(x), d(g), mean, rstd, dx=dx, dyxhat=dyxhat)
    dyin = d(dy)
    kernels.layernorm_backward(dyin, d(x), d(g), mean, rstd, dx=dyin)
    np.testing.assert_array_equal(device.to_host(dyin), device.to_host(dx))
    xhat = (x - device.to_host(mean)[:, None]) * device.to_host(rstd)[:, None]
    np.testing.assert_allclose(device.to_host(dyxhat), dy * xhat, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_gpu_branches(device, dtype, causal, products):
    attrs = {"num_heads": 2, "causal": causal}
    qkv = _rand((2, 5, 24), dtype)
    (ctx,), _ = _compare(device, "Attention", attrs, [qkv], ["softmax_forward"], dtype)
    # per head, batched over the 2 sequences: q k^T, then P v (on the CPU: none)
    assert products == [((2, 5, 4), (2, 5, 4), (2, 5, 5))] * 2 + \
        [((2, 5, 5), (2, 5, 4), (2, 5, 4))] * 2
    dctx = _rand(ctx.shape, dtype, 1)
    _compare(device, "AttentionGrad", attrs, [dctx, qkv],
             ["softmax_forward", "softmax_backward"], dtype)
    (s,), _ = _compare(device, "AttentionScores", attrs, [qkv], [], dtype)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    _compare(device, "AttentionScoresGrad", attrs, [_rand(s.shape, dtype, 2), qkv], [], dtype)
    _compare(device, "AttentionContext", attrs, [p, qkv], [], dtype)
    _compare(device, "AttentionContextGrad", dict(attrs, outputs=["dP", "dqkv"]),
             [dctx, p, qkv], [], dtype)


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["streams", "cuda-graph"])
def test_gpt_on_an_emulated_gpu_matches_the_cpu(host_build_dir, monkeypatch, cuda_graph):
    """A 2-block GPT (fused attention in one block, the raw sub-graph in the
    other), placed on the emulated device and run by the stream dispatcher
    on the simulated runtime, optionally captured in CUDA graphs: 3 AdamW
    steps give the CPU's losses and weights, and the third iteration
    allocates no device memory. Captured, the whole iteration is one graph:
    the AdamW updates read the device iteration (on an H200 they once read
    the host 'iter' and ran eagerly between two segments, with the position
    embedding's device-to-device gradient Copy). Every parameter is read
    back after each iteration (issue 35: the emulator once mixed two host
    threads' launches on one stream, and a variant's 2nd loss differed)."""
    from purine_mpi.parallel.placement import place_on_device
    from purine_mpi.runtime.factory import make_dispatcher
    from purine_mpi.layers.fillers import fill
    from tests.gpt_oracle import build_ours, gpt_graph, gpt_net, step_ours
    from tests.emulated_gpu import Allocations, DeviceArray, SimulatedRuntime, use_emulated_cupy
    net = gpt_net(vocab=16, width=8, heads=2, blocks=2, max_length=6, approximate="tanh")
    next(e for e in net if e["type"] == "attention")["fused"] = False
    # AdamW, the transformer's solver: its update is one raw kernel
    # (cuda/adam.cu) that allocates nothing
    solver = {"type": "adamw", "base_lr": 0.01, "momentum": 0.9, "momentum2": 0.99,
              "weight_decay": 1e-2, "max_iter": 3}
    toks = np.random.default_rng(0).integers(0, 16, (3, 2, 7))
    cpu, _, _ = build_ours(net, solver, 2, 6, seed=1)
    cpu_losses, cpu_params = [], []
    for it in range(3):
        step_ours(cpu, toks[it, :, :-1], toks[it, :, 1:], it)
        cpu_losses.append(float(cpu.workspace["loss"]))
        cpu_params.append({p.name: np.array(cpu.workspace[p.name]) for p in cpu.graph.params()})
    use_emulated_cupy(monkeypatch, host_build_dir)
    # CuPy's reductions (which may take CUB scratch from the pool) are kept
    # out of an iteration: record any the emulated arrays see
    reductions, real = [], DeviceArray.__array_function__

    def watch(self, func, types, args, kwargs):
        if func.__name__ in ("sum", "mean", "max", "min", "amax", "amin", "prod", "var"):
            reductions.append(func.__name__)
        return real(self, func, types, args, kwargs)
    monkeypatch.setattr(DeviceArray, "__array_function__", watch)
    g, _, _ = gpt_graph(net, solver, 2, 6)
    place_on_device(g, 0)
    d = make_dispatcher(g, runtime=SimulatedRuntime(1), seed=1, cuda_graph=cuda_graph)
    try:
        for p in g.params():
            d.workspace.set(p.name, fill(p, 1))
        losses = []
        for it in range(3):
            d.workspace.set("data", toks[it, :, :-1].astype(np.int32))
            d.workspace.set("label", toks[it, :, 1:].astype(np.int32))
            d.workspace["iter"][...] = it
            Allocations.counting, Allocations.log = it == 2, []
            reductions.clear()
            d.run(it)
            losses.append(float(d.workspace["loss"]))
            Allocations.counting = False
            # read back between iterations, as a user's monitoring would
            for p in g.params():
                np.testing.assert_allclose(np.array(d.workspace[p.name]), cpu_params[it][p.name],
                                           rtol=1e-4, atol=2e-5, err_msg=f"{p.name}, iteration {it}")
        assert Allocations.log == [] and reductions == []
        if cuda_graph:
            report = d.executor.report()
            assert report["captured"] == report["segments"] == 1 and not report["failed"], report
            assert report["eager_gpu_ops"] == {} and report["launches_per_iter"] == 1, report
        np.testing.assert_allclose(losses, cpu_losses, rtol=1e-5)
        # atol: the key bias's gradient is zero in exact arithmetic (softmax
        # ignores a constant per row), so Adam turns its rounding noise,
        # which differs between the two graphs, into steps of a few 1e-6
        # (a wrong update is off by about lr = 1e-2)
        for p in g.params():
            np.testing.assert_allclose(np.asarray(d.workspace[p.name]), cpu.workspace[p.name],
                                       rtol=1e-4, atol=2e-5, err_msg=p.name)
    finally:
        Allocations.counting = False
        d.close()


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("ignore", [None, 3])
def test_token_level_softmax_loss_gpu_branch(device, dtype, ignore):
    """(N, T, V) logits over the last axis with int32 labels: the fused
    kernels on the (N*T, V, 1) view, the labels copied into int64 scratch."""
    attrs = {"axis": 2} if ignore is None else {"axis": 2, "ignore_label": ignore}
    x = _rand((2, 3, 5), dtype, scale=3.0)
    label = np.random.default_rng(1).integers(0, 5, (2, 3)).astype(np.int32)
    (loss, prob), _ = _compare(device, "SoftmaxLoss", attrs, [x, label],
                               ["softmax_loss_forward", "softmax_loss_mean"], dtype)
    dloss = np.asarray(0.7, dtype)
    _compare(device, "SoftmaxLossGrad", attrs, [dloss, prob, label],
             ["softmax_loss_backward"], dtype, host_inputs=(0,))


@pytest.mark.parametrize("device_id", [-1, 0], ids=["cpu", "emulated-gpu"])
def test_a_token_id_outside_the_embedding_stops_the_run_on_a_gpu_as_on_the_cpu(
        host_build_dir, monkeypatch, tmp_path, email_h5, device_id):
    """Byte-level text (bytes up to 125 in its first batch) into an
    embedding of 100 rows: the CPU op raised, but on a GPU, whose op reads
    nothing back, CuPy's take read a wrapped row (the emulated CuPy wraps as
    CuPy does) and the gradient dropped the token, so the run trained on.
    Now the data op checks each batch on the host before its transfer: the
    run stops at the batch with the CPU op's message, on either device."""
    from purine_mpi.base.errors import OpError
    from tests.conftest import make_job, refused_trainer_run
    from tests.emulated_gpu import emulated_trainer_env
    from purine_mpi.job.config import validate_config
    if device_id >= 0:
        emulated_trainer_env(monkeypatch, host_build_dir)
    config = validate_config({
        "name": "ids", "seed": 1, "device": device_id,
        "data": {"train": {"source": "text", "path": email_h5, "batch_size": 2,
                           "sequence_length": 8}},
        "net": [{"type": "embedding", "name": "wte", "bottom": "data", "top": "x",
                 "input_dim": 100, "num_output": 8},
                {"type": "fc", "name": "head", "bottom": "x", "top": "logits", "axis": -1,
                 "num_output": 256},
                {"type": "softmax_loss", "name": "loss", "bottom": ["logits", "label"],
                 "axis": -1}],
        "solver": {"base_lr": 0.1, "max_iter": 2, "display": 0}}, check_files=False)
    from purine_mpi.data.text import TextSource
    first = TextSource({"path": email_h5, "split": "train", "sequence_length": 8}) \
        .gather(np.arange(2))[0]
    assert first.max() >= 100  # the first batch (no shuffle) holds such ids
    bad = int(first[first >= 100].ravel()[0])
    # a text source's tokens are checked against the embedding at start-up
    # (job/replica.check_data_labels); the per-batch check below is what
    # guards a source that is not scanned there (an HDF5 of ids)
    from purine_mpi.base.errors import UserError
    from purine_mpi.train.trainer import Trainer
    from tests.conftest import FakeWorld
    with pytest.raises(UserError, match=r"holds token \d+, outside \[0, 100\): layer 'wte'"):
        Trainer(make_job(config), str(tmp_path / "refused"), world=FakeWorld(),
                log=lambda m: None)
    import purine_mpi.data.sources as sources
    monkeypatch.setattr(sources, "check_token_ids", lambda *a, **k: None)
    _, err = refused_trainer_run(make_job(config), tmp_path / "run", OpError)
    assert isinstance(err.value.cause, ValueError), err.value
    assert str(err.value.cause) == \
        f"token id {bad} is outside [0, 100) for an embedding of 100 rows", err.value
