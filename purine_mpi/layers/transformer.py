"""The transformer layers: token and position embeddings, layer norm, GELU
and multi-head causal self-attention (a GPT's blocks, with ``fc`` over the
last axis, ``eltwise`` residual sums and ``softmax_loss`` over the last
axis). Their ops are in ops/embedding.py, ops/layernorm.py,
ops/activation.py (GELU) and ops/attention.py; docs/transformers.md shows
a GPT block built from them.

Each ``@layer`` declares its keys like the standard layers do; after
changing keys run ``python -m purine_mpi.tools.docgen --write``.
"""
import numpy as np

from .registry import POSITIVE, RATIO, REQUIRED, Key, Slot, layer
from .standard import ITER_BLOB, _filler, _param_key

#: nanoGPT's initialisation of the embeddings and projections: N(0, 0.02²)
GPT_NORMAL = {"type": "gaussian", "std": 0.02}


@layer("embedding", "embed", keys=(
    Key("input_dim", "posint", REQUIRED, "the vocabulary size: token ids lie in [0, input_dim) "
        "(an id of the data outside it stops the run, exit 1, on a GPU as on the CPU: the data "
        "op checks each batch)"),
    Key("num_output", "posint", REQUIRED, "the embedding width C"),
    Key("weight_filler", "filler", GPT_NORMAL, "initialisation of the table"),
    _param_key("the table", Slot("weight"))))
def embedding(b):
    """Token embedding (Caffe's Embed, no bias): integer ids (N, T) → (N, T, C), one row of
    the (input_dim, num_output) table `<name>/weight` per token; its gradient scatter-adds.
    An `fc` with `tie_weight` may share the table as its weight."""
    (ids,) = b.bottoms(1)
    b.shape(ids)
    dtype = np.dtype(b.graph.blobs[ids].dtype)
    if dtype.kind not in "iu":
        b.fail("bottom", f"embedding needs integer token ids, '{ids}' holds {dtype.name} (the "
                         "text source's data blob, or a label)")
    (y,) = b.tops(1)
    w = b.param("weight", (b.get("input_dim"), b.get("num_output")),
                _filler(b, "weight_filler"), 0)
    b.op("Embedding", [ids, w], [y])


@layer("position_embedding", "pos_embedding", keys=(
    Key("max_length", "posint", REQUIRED, "the longest sequence: rows of the table"),
    Key("weight_filler", "filler", GPT_NORMAL, "initialisation of the table"),
    _param_key("the table", Slot("weight"))))
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
    Key("eps", "number", 1e-5, "added to the variance", POSITIVE),
    Key("weight_filler", "filler", {"type": "constant", "value": 1.0},
        "initialisation of the scale"),
    Key("bias_filler", "filler", {"type": "constant", "value": 0.0},
        "initialisation of the shift"),
    _param_key("weight, then bias", Slot("weight"), Slot("bias"))))
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


@layer("attention", "self_attention", keys=(
    Key("num_heads", "posint", REQUIRED, "attention heads H (dividing the width C)",
        weights=True),
    Key("causal", "bool", True, "mask the future: position t attends to positions ≤ t",
        weights=True),
    Key("attn_dropout", "number", 0.0, "dropout ratio on the attention probabilities "
                                       "(training only)", RATIO),
    Key("resid_dropout", "number", 0.0, "dropout ratio on the output projection (training "
                                        "only)", RATIO),
    Key("bias_term", "bool", True, "learn `qkv_bias` and `proj_bias`"),
    Key("fused", "bool", True, "one Attention op computing softmax(q·kᵀ/√D)·v, keeping no "
                               "probabilities (its gradient recomputes them), with "
                               "attn_dropout > 0 also the dropout (the raw path's mask, bit "
                               "for bit, from the same Philox stream), its mask kept "
                               "bit-packed for the gradient on the host (1/32 of a float "
                               "mask), redrawn by the gradient on a GPU; false: the raw sub-graph AttentionScores → "
                               "Softmax → (Dropout →) AttentionContext, which keeps the "
                               "(N, H, T, T) probabilities (and the mask and the dropped "
                               "probabilities)"),
    Key("weight_filler", "filler", GPT_NORMAL, "initialisation of qkv_weight and proj_weight"),
    Key("bias_filler", "filler", {"type": "constant", "value": 0.0},
        "initialisation of qkv_bias and proj_bias"),
    _param_key("qkv_weight, qkv_bias, proj_weight, proj_bias", Slot("qkv_weight"),
               Slot("qkv_bias", "bias_term"), Slot("proj_weight"),
               Slot("proj_bias", "bias_term"))))
def attention(b):
    """Multi-head (causal) self-attention on (N, T, C), nanoGPT's CausalSelfAttention: qkv =
    x·`qkv_weight`ᵀ + `qkv_bias` ((3C, C): rows q, k, v, heads contiguous), per head
    softmax(q·kᵀ/√D) with a causal mask (max-subtracted), times v, heads joined, then
    `proj_weight` (C, C) and `proj_bias`."""
    (x,) = b.bottoms(1)
    shape = b.shape(x)
    if len(shape) != 3:
        b.fail("bottom", f"attention needs an (N, T, C) input, '{x}' is {list(shape)}")
    c, heads = shape[2], b.get("num_heads")
    if c % heads:
        b.fail("num_heads", f"num_heads {heads} must divide the width {c}")
    ratios = {k: float(b.get(k)) for k in ("attn_dropout", "resid_dropout")}  # in [0, 1)
    name, wf, bf = b.cfg["name"], _filler(b, "weight_filler"), _filler(b, "bias_filler")
    bias = b.get("bias_term")
    fused = b.get("fused")
    qkv_w = b.param("qkv_weight", (3 * c, c), wf, 0)
    qkv_in = [x, qkv_w] + ([b.param("qkv_bias", (3 * c,), bf, 1)] if bias else [])
    proj_w = b.param("proj_weight", (c, c), wf, 2)
    proj_b = [b.param("proj_bias", (c,), bf, 3)] if bias else []
    (y,) = b.tops(1)
    g = b.graph
    qkv = g.free_name(f"{name}.qkv")
    b.op("InnerProduct", qkv_in, [qkv], {"axis": 2}, tag="qkv")
    attrs = {"num_heads": heads, "causal": b.get("causal")}
    ctx = g.free_name(f"{name}.ctx")
    train = b.phase == "train"
    if fused and train and ratios["attn_dropout"] > 0:
        # the raw path's Dropout op's stream (<name>.attn_drop): the same mask,
        # kept bit-packed for the gradient (a GPU's placement drops it: the
        # gradient redraws there; ops/attention.py)
        g.add_blob(ITER_BLOB, (), "int64", kind="iter", exist_ok=True)
        b.op("Attention", [qkv, ITER_BLOB], [ctx, g.free_name(f"{name}.attn_mask.bits")],
             dict(attrs, dropout=ratios["attn_dropout"], stream=f"{name}.attn_drop",
                  packed_mask=True),
             tag="attn")
    elif fused:
        b.op("Attention", [qkv], [ctx], attrs, tag="attn")
    else:
        s, p = g.free_name(f"{name}.scores"), g.free_name(f"{name}.probs")
        b.op("AttentionScores", [qkv], [s], attrs, tag="scores")
        b.op("Softmax", [s], [p], {"axis": 3}, tag="softmax")
        if train and ratios["attn_dropout"] > 0:
            p = _dropout(b, p, ratios["attn_dropout"], "attn_drop")
        b.op("AttentionContext", [p, qkv], [ctx], attrs, tag="context")
    out = y
    if train and ratios["resid_dropout"] > 0:
        out = g.free_name(f"{name}.proj")
    b.op("InnerProduct", [ctx, proj_w] + proj_b, [out], {"axis": 2}, tag="proj")
    if out != y:
        _dropout(b, out, ratios["resid_dropout"], "resid_drop", y)


def _dropout(b, x, ratio, tag, y=None):
    """A training-time Dropout op of x (its mask keyed by the op's name)."""
    g = b.graph
    y = y or g.free_name(f"{b.cfg['name']}.{tag}")
    g.add_blob(ITER_BLOB, (), "int64", kind="iter", exist_ok=True)
    b.op("Dropout", [x, ITER_BLOB], [y, g.free_name(f"{b.cfg['name']}.{tag}_mask")],
         {"ratio": ratio, "phase": "train"}, tag=tag)
    return y
