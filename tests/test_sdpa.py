"""Fused attention through cuDNN's SDPA graphs (purine_mpi/gpu/sdpa.py).

Without a GPU: the emulated frontend (tests/emulated_gpu/cudnn.py, SDPA
after cuDNN's documented semantics) checked against PyTorch's
``scaled_dot_product_attention`` in float64, a tiny bf16 GPT on the
emulated device through the SDPA path against the same GPT without it, and
the fallback of a refused shape (said once). On a GPU (marked ``gpu``): the
real frontend's forward and backward against the float64 reference."""
import sys

import numpy as np
import pytest

from purine_mpi.gpu import sdpa
from tests.emulated_gpu.cudnn import FakeCudnn, decode, encode
from tests.gpt_oracle import gpt_graph, gpt_net
from tests.test_precision import SOLVER

torch = pytest.importorskip("torch")

#: bf16 has 8 significant bits: results within a few of its ulps (2^-8)
BF16_TOL = 3e-2


@pytest.fixture(autouse=True)
def _fresh():
    sdpa.reset()
    yield
    sdpa.reset()


def _bf16(x):
    return decode(encode(x, "bfloat16"), "bfloat16")


def _qkv(n, t, heads, d, seed=0):
    """A (N, T, 3C) float32 qkv of bfloat16 values."""
    return _bf16(np.random.default_rng(seed).standard_normal((n, t, 3 * heads * d)))


def _torch_reference(qkv, heads, causal, dctx):
    """ctx, lse, dqkv of PyTorch's SDPA in float64 (heads split as ours)."""
    n, t, c3 = qkv.shape
    d = c3 // 3 // heads
    x = torch.tensor(qkv, dtype=torch.float64, requires_grad=True)
    q, k, v = (x.reshape(n, t, 3, heads, d)[:, :, i].transpose(1, 2) for i in range(3))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    ctx = o.transpose(1, 2).reshape(n, t, heads * d)
    ctx.backward(torch.tensor(dctx, dtype=torch.float64))
    s = q @ k.transpose(-1, -2) / np.sqrt(d)
    if causal:
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return ctx.detach().numpy(), lse.detach().numpy(), x.grad.numpy()


def _close(got, want, what):
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max()) / scale
    assert err < BF16_TOL, f"{what}: {err:.3g} of the largest value"


@pytest.mark.parametrize("causal", [True, False])
def test_the_emulated_sdpa_matches_torch_in_float64(host_build_dir, monkeypatch, causal):
    """The plumbing (16-bit copies, strided q/k/v in qkv, stats, workspace)
    and the emulation: forward, log-sum-exp and dq, dk, dv against PyTorch's
    SDPA in float64, within bf16's tolerance."""
    from tests.emulated_gpu import DeviceArray, use_emulated_cupy
    use_emulated_cupy(monkeypatch, host_build_dir)
    fake = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    n, t, heads, d = 2, 7, 2, 8
    qkv = _qkv(n, t, heads, d)
    dctx = _bf16(np.random.default_rng(1).standard_normal((n, t, heads * d)))
    plans = sdpa.plans("Attention", 0, (n, heads, t, d, "bfloat16", causal, 0.0))
    assert plans is not None
    dev = lambda a: np.array(a, np.float32).view(DeviceArray)  # noqa: E731
    ctx, stats = dev(np.zeros((n, t, heads * d))), dev(np.zeros((n, heads, t, 1)))
    scratch = [np.zeros(s, dt).view(DeviceArray) for s, dt in plans.scratch_specs(False)]
    plans.forward(dev(qkv), ctx, stats, scratch)
    dqkv = dev(np.zeros_like(qkv))
    plans.backward(dev(dctx), dev(qkv), ctx, stats, dqkv,
                   [np.zeros(s, dt).view(DeviceArray) for s, dt in plans.scratch_specs(True)])
    want_ctx, want_lse, want_dqkv = _torch_reference(qkv, heads, causal, dctx)
    _close(np.asarray(ctx), want_ctx, "ctx")
    np.testing.assert_allclose(np.asarray(stats), want_lse, rtol=1e-5, atol=1e-5)
    c = heads * d
    for i, name in enumerate(("dq", "dk", "dv")):
        _close(np.asarray(dqkv)[..., i * c:(i + 1) * c], want_dqkv[..., i * c:(i + 1) * c], name)
    # the outputs are bfloat16 values; the graphs as the frontend's samples build them
    assert np.array_equal(np.asarray(ctx), _bf16(np.asarray(ctx)))
    (fwd_kind, fwd), (bwd_kind, bwd) = fake.graphs[0].ops[0], fake.graphs[1].ops[0]
    assert (fwd_kind, bwd_kind) == ("sdpa", "sdpa_backward")
    assert fwd["stats"] and fwd["causal"] == causal and bwd["deterministic"]
    assert fwd["q"].stride == [t * 3 * c, d, 3 * c, 1] and fwd["q"].data_type == "bfloat16"


@pytest.mark.parametrize("sdpa_on", [True, False])
def test_the_sdpa_outputs_are_low_precision_values_already(host_build_dir, monkeypatch,
                                                           sdpa_on):
    """On the SDPA path Attention's ctx and AttentionGrad's dqkv are cuDNN's
    bfloat16 outputs widened exactly: the ops say output 0 needs no
    rounding (``rounds_own_outputs``), and it is bfloat16 values, whatever
    the (random bfloat16) inputs; on the cuBLAS path they say nothing."""
    from purine_mpi.graph.core import Op
    from purine_mpi.ops.catalog import get_kernel_class
    from tests.emulated_gpu import DeviceArray, use_emulated_cupy
    use_emulated_cupy(monkeypatch, host_build_dir)
    emulate_cudnn(monkeypatch, sdpa_on)
    n, t, heads, d = 2, 5, 2, 8
    attrs = {"num_heads": heads, "sdpa": True, "compute_dtype": "bfloat16", "causal": True}
    dev = lambda a: np.array(a, np.float32).view(DeviceArray)  # noqa: E731
    fwd = get_kernel_class("Attention")(Op("a", "Attention", ["qkv"], ["ctx", "st"], attrs))
    bwd = get_kernel_class("AttentionGrad")(Op("g", "AttentionGrad", [], ["dqkv"], attrs))
    for seed in range(3):
        qkv = dev(_qkv(n, t, heads, d, seed) * 4.0 ** seed)
        dctx = dev(_bf16(np.random.default_rng(10 + seed).standard_normal((n, t, heads * d))))
        ctx, stats = dev(np.zeros((n, t, heads * d))), dev(np.zeros((n, heads, t, 1)))
        dqkv = dev(np.zeros(qkv.shape))
        fwd.setup([qkv], [ctx, stats])
        fwd.run([qkv], [ctx, stats])
        bwd.setup([dctx, qkv, ctx, stats], [dqkv])
        bwd.run([dctx, qkv, ctx, stats], [dqkv])
        want = (0,) if sdpa_on else ()
        assert fwd.rounds_own_outputs([qkv], [ctx, stats]) == want
        assert bwd.rounds_own_outputs([dctx, qkv, ctx, stats], [dqkv]) == want
        if sdpa_on:
            for got in (ctx, dqkv):
                assert np.abs(np.asarray(got)).max() > 0
                np.testing.assert_array_equal(np.asarray(got), _bf16(np.asarray(got)))


def test_the_sdpa_gradient_reads_and_writes_bits_without_copies(host_build_dir, monkeypatch):
    """bf16 storage on the SDPA path: AttentionGrad with dctx, qkv and ctx
    stored as bfloat16 bits and dqkv written as bits (``bits_out``) gives
    the bits of the float32 storage's dqkv (cuDNN's own bfloat16 output,
    widened there), with no 16-bit copy of any of them in its scratch (an
    empty array in each one's place) and no conversion launch; the forward
    with qkv and ctx as bits likewise reserves no copies."""
    from purine_mpi.graph.core import Op
    from purine_mpi.ops.registry import make_kernel
    from tests.emulated_gpu import DeviceArray, use_emulated_cupy
    from tests.test_bf16_storage import _numpy_bits
    use_emulated_cupy(monkeypatch, host_build_dir)
    emulate_cudnn(monkeypatch, True)
    n, t, heads, d = 2, 5, 2, 8
    attrs = {"num_heads": heads, "sdpa": True, "compute_dtype": "bfloat16", "causal": True}
    dev = lambda a, dt=np.float32: np.array(a, dt).view(DeviceArray)  # noqa: E731
    qkv = _qkv(n, t, heads, d, 1)
    dctx = _bf16(np.random.default_rng(11).standard_normal((n, t, heads * d)))
    got = {}
    for name, dt, bits_out in (("float32", np.float32, {}), ("bits", np.uint16, [0])):
        conv = (lambda a: _numpy_bits(np.asarray(a, np.float32))) if dt == np.uint16 else \
            (lambda a: np.asarray(a, np.float32))
        fwd = make_kernel(Op("a", "Attention", ["qkv"], ["ctx", "st"],
                             dict(attrs, **({"bits_out": bits_out} if bits_out else {}))))
        bwd = make_kernel(Op("g", "AttentionGrad", ["dctx", "qkv", "ctx", "st"], ["dqkv"],
                             dict(attrs, **({"bits_out": bits_out} if bits_out else {}))))
        q = dev(conv(qkv), dt)
        ctx, stats = dev(np.zeros((n, t, heads * d)), dt), dev(np.zeros((n, heads, t, 1)))
        dqkv = dev(np.zeros(qkv.shape), dt)
        fwd.setup([q], [ctx, stats])
        fwd.run([q], [ctx, stats])
        ins = [dev(conv(dctx), dt), q, ctx, stats]
        bwd.setup(ins, [dqkv])
        specs = bwd.scratch_specs(ins, [dqkv])
        fspecs = fwd.scratch_specs([q], [ctx, stats])
        if name == "bits":
            assert [s for s, _ in specs[:4]] == [(0,)] * 4 and \
                [s for s, _ in fspecs[:2]] == [(0,)] * 2
        else:
            assert all(int(np.prod(s)) > 0 for s, _ in specs[:4] + fspecs[:2])
        bwd.run(ins, [dqkv])
        got[name] = np.asarray(dqkv)
    np.testing.assert_array_equal(got["bits"], _numpy_bits(got["float32"]))
    np.testing.assert_array_equal(got["float32"], _bf16(got["float32"]))


def emulate_cudnn(monkeypatch, sdpa_on=True):
    """The emulated cuDNN frontend as ``cudnn`` (returned), the SDPA path's
    state forgotten, on (``sdpa_on``) or off by PURINE_SDPA=0. The path's
    availability check and plans live in dicts of ``monkeypatch``'s own, so
    its undo leaves no emulated frontend behind for a later test of the
    process (a check cached on the fake sent a later test's attention down
    the SDPA path where its plan counted the cuBLAS path's scratch)."""
    sdpa.reset()
    monkeypatch.setattr(sdpa, "_plans", {})
    monkeypatch.setattr(sdpa, "_state", {"checked": False, "module": None, "reason": None})
    fake = FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    if sdpa_on:
        monkeypatch.delenv("PURINE_SDPA", raising=False)
    else:
        monkeypatch.setenv("PURINE_SDPA", "0")
    return fake


def _losses(monkeypatch, host_build_dir, capsys, width, heads, sdpa_on, iters=6,
            cuda_graph=False):
    """The losses of a 2-block GPT in bf16 on the emulated device, with the
    emulated frontend (``sdpa_on``) or PURINE_SDPA=0; and the log."""
    from tests.test_precision import _ours_on_the_emulated_device
    fake = emulate_cudnn(monkeypatch, sdpa_on)
    toks = np.random.default_rng(3).integers(0, 16, (iters, 2, 9))
    import tests.test_precision as tp
    net_orig = tp.gpt_net
    monkeypatch.setattr(tp, "gpt_net", lambda **kw: net_orig(**dict(kw, width=width,
                                                                     heads=heads)))
    capsys.readouterr()
    _, losses, _ = _ours_on_the_emulated_device(monkeypatch, host_build_dir, "bf16", toks,
                                                iters, cuda_graph=cuda_graph)
    return losses, capsys.readouterr().err, fake


def test_a_bf16_gpt_runs_cudnn_sdpa_and_tracks_the_cublas_path(host_build_dir, monkeypatch,
                                                               capsys):
    on, log, fake = _losses(monkeypatch, host_build_dir, capsys, 16, 2, True)
    assert log.count("Attention ops run cuDNN's fused attention (SDPA, bfloat16)") == 1
    assert log.count("AttentionGrad ops run cuDNN's fused attention") == 1
    kinds = [g.ops[0][0] for g in fake.graphs]
    assert kinds == ["sdpa", "sdpa_backward"]   # one shape: built once, shared by 2 blocks
    assert len(fake.executed) == 6 * 2 * 2      # iterations x blocks x directions
    off, log_off, _ = _losses(monkeypatch, host_build_dir, capsys, 16, 2, False)
    assert log_off.count("not cuDNN's fused attention (PURINE_SDPA=0)") == 2  # per op type
    np.testing.assert_allclose(on, off, rtol=2e-2)
    assert on != off   # another kernel: another rounding


def test_the_sdpa_plans_are_built_before_the_capture_and_replayed(host_build_dir,
                                                                   monkeypatch, capsys):
    """In the whole-iteration CUDA graph: the plans are built at setup (the
    emulated frontend refuses building inside a capture), the executions
    are captured and replayed with the iteration: the same losses, bit for
    bit, as the eager run."""
    eager, _, _ = _losses(monkeypatch, host_build_dir, capsys, 16, 2, True, iters=4)
    graphed, log, fake = _losses(monkeypatch, host_build_dir, capsys, 16, 2, True, iters=4,
                                 cuda_graph=True)
    assert "fused attention (SDPA" in log and fake.executed
    assert [g.ops[0][0] for g in fake.graphs] == ["sdpa", "sdpa_backward"]
    assert graphed == eager


def test_the_pass_keeps_the_statistics_for_the_gradient():
    from purine_mpi.parallel.placement import prepare_for_device
    g, _, _ = gpt_graph(gpt_net(vocab=16, width=16, heads=2, blocks=1, max_length=8),
                        SOLVER, 2, 8)
    prepare_for_device(g, 0, precision="bf16")
    (fwd,) = [op for op in g.ops.values() if op.op_type == "Attention"]
    (bwd,) = [op for op in g.ops.values() if op.op_type == "AttentionGrad"]
    ctx, stats = fwd.outputs
    assert g.blobs[stats].shape == (2, 2, 8, 1) and g.blobs[stats].dtype == "float32"
    assert "precision" not in g.blobs[stats].attrs   # not rounded: float32
    assert bwd.inputs[2:] == [ctx, stats] and fwd.attrs["sdpa"] and bwd.attrs["sdpa"]
    fp32, _, _ = gpt_graph(gpt_net(vocab=16, width=16, heads=2, blocks=1, max_length=8),
                           SOLVER, 2, 8)
    prepare_for_device(fp32, 0, precision="fp32")
    assert all(len(op.outputs) == 1 for op in fp32.ops.values() if op.op_type == "Attention")


def test_a_refused_shape_falls_back_said_once(host_build_dir, monkeypatch, capsys):
    """Head size 6 (not a multiple of 8): cuDNN refuses the graph, the ops
    keep today's path -- the same losses, bit for bit, as with SDPA off --
    and one line per op type says so."""
    got, log, fake = _losses(monkeypatch, host_build_dir, capsys, 12, 2, True, iters=3)
    lines = [ln for ln in log.splitlines() if "fused attention" in ln]
    assert len(lines) == 2 and "head dim 6 unsupported" in lines[0], lines
    assert lines[0].startswith("purine_mpi: Attention ops use cuBLAS + the softmax kernels")
    assert not fake.executed
    off, _, _ = _losses(monkeypatch, host_build_dir, capsys, 12, 2, False, iters=3)
    assert got == off


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cudnn_sdpa_matches_float64_on_a_gpu(dtype):
    """Runs on a GPU only: the real frontend's SDPA forward, statistics and
    backward through the Attention ops, against PyTorch in float64."""
    from purine_mpi.graph.core import Op
    from purine_mpi.ops.catalog import get_kernel_class
    from tests.conftest import cuda_cupy_or_skip
    cupy = cuda_cupy_or_skip()
    pytest.importorskip("cudnn")
    if sdpa.frontend() is None:
        pytest.skip(f"cuDNN frontend unusable: {sdpa.reason()}")
    n, t, heads, d = 4, 128, 4, 64
    low = (lambda x: _bf16(x)) if dtype == "bfloat16" else \
        (lambda x: np.asarray(x, np.float16).astype(np.float32))
    qkv = low(np.random.default_rng(0).standard_normal((n, t, 3 * heads * d)))
    dctx = low(np.random.default_rng(1).standard_normal((n, t, heads * d)))
    attrs = {"num_heads": heads, "causal": True, "sdpa": True, "compute_dtype": dtype}
    fwd = get_kernel_class("Attention")(Op("a", "Attention", [], [], dict(attrs)))
    bwd = get_kernel_class("AttentionGrad")(Op("g", "AttentionGrad", [], [], dict(attrs)))
    x = cupy.asarray(qkv)
    ctx = cupy.full((n, t, heads * d), np.nan, np.float32)
    stats = cupy.full((n, heads, t, 1), np.nan, np.float32)
    fwd.setup([x], [ctx, stats])
    assert fwd._sdpa is not None, sdpa.reason()
    fwd.run([x], [ctx, stats])
    dqkv = cupy.full(qkv.shape, np.nan, np.float32)
    ins = [cupy.asarray(dctx), x, ctx, stats]
    bwd.setup(ins, [dqkv])
    bwd.run(ins, [dqkv])
    cupy.cuda.get_current_stream().synchronize()
    want_ctx, want_lse, want_dqkv = _torch_reference(qkv, heads, True, dctx)
    _close(cupy.asnumpy(ctx), want_ctx, "ctx")
    np.testing.assert_allclose(cupy.asnumpy(stats), want_lse, rtol=1e-3, atol=1e-3)
    _close(cupy.asnumpy(dqkv), want_dqkv, "dqkv")



def _attention_launches(monkeypatch, host_build_dir, iters=2):
    """The device work our Attention and AttentionGrad ops launch in
    ``iters`` steps of the 2-block bf16 GPT on the emulated device, SDPA on
    (its eager dispatch: the work a CUDA graph of the step captures):
    [(op type, (where, ...))] a run each, each piece of device work (a
    kernel, a copy, a memset, a cuDNN graph) named by the innermost
    purine_mpi function on the stack that queued it."""
    import os
    import threading
    import traceback

    from purine_mpi.ops import attention
    from tests.emulated_gpu import capture
    from tests.test_precision import _ours_on_the_emulated_device
    emulate_cudnn(monkeypatch, True)
    local, runs = threading.local(), []
    for cls in (attention.Attention, attention.AttentionGrad):
        def run(self, ins, outs, real=cls.run, op_type=cls.op_type):
            local.work = []
            try:
                return real(self, ins, outs)
            finally:
                runs.append((op_type, tuple(local.work)))
                local.work = None
        monkeypatch.setattr(cls, "run", run)
    real_work = capture.device_work
    package = os.sep + "purine_mpi" + os.sep

    def device_work(fn, stream=None):
        if getattr(local, "work", None) is not None:
            local.work.append(next((f"{os.path.basename(f.filename)}:{f.name}" for f in
                                    reversed(traceback.extract_stack()[:-1])
                                    if package in f.filename), "?"))
        return real_work(fn, stream)
    monkeypatch.setattr(capture, "device_work", device_work)
    toks = np.random.default_rng(3).integers(0, 16, (iters, 2, 9))
    _ours_on_the_emulated_device(monkeypatch, host_build_dir, "bf16", toks, iters)
    return runs


@pytest.mark.parametrize("storage", ["bits", "float32"])
def test_the_attention_ops_launch_the_cudnn_graphs_alone(host_build_dir, monkeypatch, storage):
    """Every run of a bf16 GPT's Attention and AttentionGrad ops (2 blocks,
    2 steps, eager) on the SDPA path launches one piece of device work, its
    cuDNN graph: qkv, ctx, dctx and dqkv stored as bfloat16 bits (the
    default) are handed to cuDNN as they lie, q, k, v as strided views of
    qkv, with no 16-bit copy, no memset, no seed/offset write (no dropout)
    and no widening. With ``PURINE_BF16_STORAGE=0`` (float32 storage) the
    same count sees the copies: qkv narrowed, ctx widened in the forward;
    qkv, ctx and dctx narrowed and dqkv widened in the backward."""
    if storage == "float32":
        monkeypatch.setenv("PURINE_BF16_STORAGE", "0")
    runs = _attention_launches(monkeypatch, host_build_dir)
    assert [op for op, _ in runs] == ["Attention", "Attention", "AttentionGrad",
                                      "AttentionGrad"] * 2
    work = {op: {w for o, w in runs if o == op} for op in ("Attention", "AttentionGrad")}
    if storage == "bits":
        assert work == {"Attention": {("sdpa.py:_run",)}, "AttentionGrad": {("sdpa.py:_run",)}}
    else:
        fwd, = work["Attention"]
        bwd, = work["AttentionGrad"]
        assert fwd.count("sdpa.py:_run") == 1 and len(fwd) == 3, fwd
        assert bwd.count("sdpa.py:_run") == 1 and len(bwd) == 5, bwd
