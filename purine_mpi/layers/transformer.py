"""The transformer layers: token and position embeddings, layer norm, GELU
and multi-head causal self-attention (a GPT's blocks, with ``fc`` over the
last axis, ``eltwise`` residual sums and ``softmax_loss`` over the last
axis). Their ops are in ops/embedding.py, ops/layernorm.py,
ops/activation.py (GELU) and ops/attention.py; docs/transformers.md shows
a GPT block built from them.

Each ``@layer`` declares its keys like the standard layers do; after
changing keys run ``python -m purine_mpi.tools.docgen --write``.
"""
from .registry import REQUIRED, Key, layer
from .standard import _filler, _param_key

#: nanoGPT's initialisation of the embeddings and projections: N(0, 0.02²)
GPT_NORMAL = {"type": "gaussian", "std": 0.02}


@layer("embedding", "embed", keys=(
    Key("input_dim", "posint", REQUIRED, "the vocabulary size: token ids lie in [0, input_dim)"),
    Key("num_output", "posint", REQUIRED, "the embedding width C"),
    Key("weight_filler", "filler", GPT_NORMAL, "initialisation of the table"),
    _param_key("the table")))
def embedding(b):
    """Token embedding (Caffe's Embed, no bias): integer ids (N, T) → (N, T, C), one row of
    the (input_dim, num_output) table `<name>/weight` per token; its gradient scatter-adds.
    An `fc` with `tie_weight` may share the table as its weight."""
    (ids,) = b.bottoms(1)
    (y,) = b.tops(1)
    w = b.param("weight", (b.get("input_dim"), b.get("num_output")),
                _filler(b, "weight_filler"), 0)
    b.op("Embedding", [ids, w], [y])


@layer("position_embedding", "pos_embedding", keys=(
    Key("max_length", "posint", REQUIRED, "the longest sequence: rows of the table"),
    Key("weight_filler", "filler", GPT_NORMAL, "initialisation of the table"),
    _param_key("the table")))
def position_embedding(b):
    """Learned position embedding: adds the first T rows of a (max_length, C) table
    `<name>/weight` to its (N, T, C) bottom (T ≤ max_length)."""
    (x,) = b.bottoms(1)
    shape = b.shape(x)
    if len(shape) != 3:
        b.fail("bottom", f"position_embedding needs an (N, T, C) input, '{x}' is {list(shape)}")
    if shape[1] > b.get("max_length"):
        b.fail("max_length", f"sequences of {shape[1]} tokens need max_length >= {shape[1]}, "
                             f"got {b.get('max_length')}")
    w = b.param("weight", (b.get("max_length"), shape[2]), _filler(b, "weight_filler"), 0)
    (y,) = b.tops(1)
    b.op("PositionEmbedding", [x, w], [y])


@layer("layer_norm", "layernorm", keys=(
    Key("eps", "number", 1e-5, "added to the variance"),
    Key("weight_filler", "filler", {"type": "constant", "value": 1.0},
        "initialisation of the scale"),
    Key("bias_filler", "filler", {"type": "constant", "value": 0.0},
        "initialisation of the shift"),
    _param_key("weight, then bias")))
def layer_norm(b):
    """Layer normalisation over the last axis: y = (x − mean) / sqrt(var + eps) · weight + bias,
    mean and (biased) variance over the C features of each position; params `<name>/weight`
    (ones) and `<name>/bias` (zeros) of shape (C,)."""
    (x,) = b.bottoms(1)
    c = (b.shape(x)[-1],)
    w = b.param("weight", c, _filler(b, "weight_filler"), 0)
    bias = b.param("bias", c, _filler(b, "bias_filler"), 1)
    (y,) = b.tops(1)
    name = b.cfg["name"]
    b.op("LayerNorm", [x, w, bias], [y, f"{name}.mean", f"{name}.rstd"],
         {"eps": float(b.get("eps"))})


@layer("gelu", keys=(
    Key("approximate", ("none", "tanh"), "none",
        "none: exact, x·Φ(x) with erf; tanh: PyTorch's and GPT-2's tanh approximation"),))
def gelu(b):
    """Gaussian error linear unit: y = x·Φ(x) = 0.5·x·(1 + erf(x/√2)), or with
    `approximate: tanh` 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))); in place allowed."""
    (x,) = b.bottoms(1)
    (y,) = b.tops(1)
    b.op("Gelu", [x], [y], {"approximate": b.get("approximate")})
