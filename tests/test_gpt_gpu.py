"""The transformer ops' GPU branches on the emulated device (and on a real
GPU when CuPy and one are there, marked ``gpu``): each op against its NumPy
path, the attention products through gpu/blas.py's cuBLAS (the emulated
nvmath binding), and a GPT trained on the simulated stream runtime against
the CPU. The emulated device is tests/test_gpu_backend.py's."""
import sys
import types

import numpy as np
import pytest

from tests.test_gpu_backend import _compare, _rand, device  # noqa: F401  (a fixture)

F64, F32 = np.float64, np.float32


@pytest.fixture(autouse=True)
def emulated_cupyx(request, monkeypatch):
    """cupyx.scipy.special.erf (the exact GELU's erf on a GPU) for the
    emulated CuPy: SciPy's ufunc on the emulated arrays (a real CuPy has
    its own, which the ``cupy`` runs use)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("device") == "cupy":
        return
    from scipy.special import erf
    special = types.ModuleType("cupyx.scipy.special")
    special.erf = lambda x, out=None: erf(np.asarray(x), out=np.asarray(out))
    scipy_mod = types.ModuleType("cupyx.scipy")
    scipy_mod.special, scipy_mod.__path__ = special, []
    cupyx = types.ModuleType("cupyx")
    cupyx.scipy, cupyx.__path__ = scipy_mod, []
    for name, module in (("cupyx", cupyx), ("cupyx.scipy", scipy_mod),
                         ("cupyx.scipy.special", special)):
        monkeypatch.setitem(sys.modules, name, module)


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
def test_embedding_gpu_branch(device, dtype, products):  # noqa: F811
    ids = np.array([[1, 3, 3, 0], [3, 1, 4, 3]], dtype=np.int32)
    w = _rand((6, 5), dtype)
    (y,), _ = _compare(device, "Embedding", {}, [ids, w], [], dtype)
    products.clear()
    _compare(device, "EmbeddingGrad", {"input_dim": 6}, [_rand(y.shape, dtype, 1), ids], [],
             dtype)
    assert products == [((8, 6), (8, 5), (6, 5))]  # onehot^T @ dy, deterministic
    x, pw = _rand((2, 3, 5), dtype, 2), _rand((4, 5), dtype, 3)
    _compare(device, "PositionEmbedding", {}, [x, pw], [], dtype)
    _compare(device, "PositionEmbeddingGrad", {"max_length": 4}, [x], [], dtype)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_layer_norm_and_gelu_gpu_branches(device, dtype):  # noqa: F811
    x, g, b = _rand((2, 3, 8), dtype, scale=3.0), _rand((8,), dtype, 1), _rand((8,), dtype, 2)
    (y, mean, rstd), _ = _compare(device, "LayerNorm", {"eps": 1e-5}, [x, g, b], [], dtype)
    dy = _rand(y.shape, dtype, 3)
    _compare(device, "LayerNormGrad", {"outputs": ["dx", "dg", "db"]},
             [dy, x, g, mean, rstd], [], dtype)
    for approximate in ("none", "tanh"):
        _compare(device, "Gelu", {"approximate": approximate}, [x], [], dtype)
        _compare(device, "GeluGrad", {"approximate": approximate}, [dy, x], [], dtype)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_gpu_branches(device, dtype, causal, products):  # noqa: F811
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
