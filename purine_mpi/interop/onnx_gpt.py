"""ONNX emitters of a transformer's ops (``export onnx`` of a GPT).

Standard ONNX ops only; a graph holding any of these is written with
opset ``OPSET_GPT`` (23: ``LayerNormalization`` is 17+, ``Gelu`` 20+,
``Attention`` 23+; onnxruntime 1.32 runs all three on the CPU):

    Embedding          -> Gather (the table, the int token ids; axis 0)
    PositionEmbedding  -> Shape + Slice of the table's first T rows, Add
    LayerNorm          -> LayerNormalization (axis -1, epsilon)
    Gelu               -> Gelu (approximate none | tanh)
    InnerProduct over the last axis of an (N, T, C) blob
                       -> Transpose of the weight, MatMul, Add
    Attention (fused)  -> Split of qkv into q, k, v, then ONNX's Attention
                          (q_num_heads = kv_num_heads = H, is_causal)
    AttentionScores, AttentionContext (the raw path, ``fused: false``)
                       -> Split, Reshape + Transpose to heads, MatMul, Mul by
                          1/sqrt(D), Where with a Trilu mask; MatMul by v,
                          Transpose, Reshape (the Softmax between is ONNX's)
    (the q, k, v and output projections are last-axis fc ops, above)

The model's input ``data`` keeps the data blob's dtype (int32 token ids).
"""
import numpy as np

#: the opset of a model with a transformer's ops
OPSET_GPT = 23

#: op types whose presence selects OPSET_GPT
GPT_OPS = ("Embedding", "PositionEmbedding", "LayerNorm", "Gelu", "Attention",
           "AttentionScores")


def _embedding(op, graph, const, helper):
    ids, w = op.inputs
    return [helper.make_node("Gather", [w, ids], [op.outputs[0]], name=op.name, axis=0)]


def _position(op, graph, const, helper):
    x, w = op.inputs
    name = op.name
    shape, t, rows = (f"{name}/{s}" for s in ("shape", "T", "rows"))
    return [
        helper.make_node("Shape", [x], [shape], name=f"{name}.shape"),
        helper.make_node("Slice", [shape, const(np.array([1], np.int64), name),
                                   const(np.array([2], np.int64), name)], [t],
                         name=f"{name}.T"),
        helper.make_node("Slice", [w, const(np.array([0], np.int64), name), t,
                                   const(np.array([0], np.int64), name)], [rows],
                         name=f"{name}.rows"),
        helper.make_node("Add", [x, rows], [op.outputs[0]], name=name),
    ]


def _layer_norm(op, graph, const, helper):
    return [helper.make_node("LayerNormalization", list(op.inputs[:3]), [op.outputs[0]],
                             name=op.name, axis=-1,
                             epsilon=float(op.attrs.get("eps", 1e-5)))]


def _gelu(op, graph, const, helper):
    return [helper.make_node("Gelu", [op.inputs[0]], [op.outputs[0]], name=op.name,
                             approximate=str(op.attrs.get("approximate", "none")))]


def linear(x, w, b, y, name, helper):
    """y = x @ w^T (+ b) over the last axis: Transpose of the weight, MatMul
    and Add."""
    wt, out = f"{name}/weight_t", y if b is None else f"{name}/matmul"
    nodes = [helper.make_node("Transpose", [w], [wt], name=f"{name}.transpose", perm=[1, 0]),
             helper.make_node("MatMul", [x, wt], [out], name=f"{name}.matmul")]
    if b is not None:
        nodes.append(helper.make_node("Add", [out, b], [y], name=f"{name}.bias"))
    return nodes


def last_axis_fc(op, graph, const, helper):
    """An InnerProduct that maps the last axis of a 3-D or wider blob."""
    b = op.inputs[2] if len(op.inputs) == 3 else None
    return linear(op.inputs[0], op.inputs[1], b, op.outputs[0], op.name, helper)


def _qkv_split(op, graph, const, helper):
    """Split the op's (N, T, 3C) qkv input into q, k, v (N, T, C) and
    return (nodes, (q, k, v), C, H)."""
    qkv = op.inputs[-1]
    c = int(graph.blobs[qkv].shape[2]) // 3
    name = op.name
    q, k, v = (f"{name}/{s}" for s in ("q", "k", "v"))
    node = helper.make_node("Split", [qkv, const(np.array([c, c, c], np.int64), name)],
                            [q, k, v], name=f"{name}.split", axis=-1)
    return [node], (q, k, v), c, int(op.attrs.get("num_heads", 1))


def _attention(op, graph, const, helper):
    """The fused op: ONNX's Attention (opset 23) on the 3-D q, k, v; its
    scale is 1/sqrt(D), as ours. The log-sum-exp output is not exported."""
    nodes, (q, k, v), _, heads = _qkv_split(op, graph, const, helper)
    return nodes + [helper.make_node("Attention", [q, k, v], [op.outputs[0]], name=op.name,
                                     q_num_heads=heads, kv_num_heads=heads,
                                     is_causal=int(bool(op.attrs.get("causal", True))))]


def _heads(x, name, c, heads, const, helper):
    """(N, T, C) -> (N, H, T, D): Reshape then Transpose."""
    split, out = f"{x}/split_heads", f"{x}/heads"
    shape = const(np.array([0, 0, heads, c // heads], np.int64), name)
    return [helper.make_node("Reshape", [x, shape], [split], name=f"{x}.split_heads"),
            helper.make_node("Transpose", [split], [out], name=f"{x}.heads",
                             perm=[0, 2, 1, 3])], out


def _scores(op, graph, const, helper):
    """The raw path's scores: q kᵀ / sqrt(D), -inf above the diagonal when
    causal (Trilu of a T x T block of ones), as MatMul, Mul, Where."""
    nodes, (q, k, _), c, heads = _qkv_split(op, graph, const, helper)
    name = op.name
    more, qh = _heads(q, name, c, heads, const, helper)
    nodes += more
    more, kh = _heads(k, name, c, heads, const, helper)
    nodes += more
    kt, raw = f"{name}/kT", f"{name}/raw"
    scaled = op.outputs[0] if not op.attrs.get("causal", True) else f"{name}/scaled"
    scale = np.float32(1.0 / np.sqrt(c // heads))
    nodes += [helper.make_node("Transpose", [kh], [kt], name=f"{name}.kT", perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", [qh, kt], [raw], name=f"{name}.qk"),
              helper.make_node("Mul", [raw, const(scale, name)], [scaled], name=f"{name}.scale")]
    if scaled == op.outputs[0]:
        return nodes
    shape, t, tt, ones, tri, keep = (f"{name}/{s}" for s in
                                     ("shape", "T", "TT", "ones", "tri", "keep"))
    from onnx import TensorProto
    nodes += [
        helper.make_node("Shape", [op.inputs[0]], [shape], name=f"{name}.shape"),
        helper.make_node("Slice", [shape, const(np.array([1], np.int64), name),
                                   const(np.array([2], np.int64), name)], [t], name=f"{name}.T"),
        helper.make_node("Concat", [t, t], [tt], name=f"{name}.TT", axis=0),
        helper.make_node("ConstantOfShape", [tt], [ones], name=f"{name}.ones",
                         value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])),
        helper.make_node("Trilu", [ones], [tri], name=f"{name}.tri", upper=0),
        helper.make_node("Cast", [tri], [keep], name=f"{name}.keep", to=TensorProto.BOOL),
        helper.make_node("Where", [keep, scaled, const(np.float32(-np.inf), name)],
                         [op.outputs[0]], name=f"{name}.mask")]
    return nodes


def _context(op, graph, const, helper):
    """The raw path's output: probabilities times v, heads joined: MatMul,
    Transpose, Reshape to (N, T, C)."""
    nodes, (_, _, v), c, heads = _qkv_split(op, graph, const, helper)
    name = op.name
    more, vh = _heads(v, name, c, heads, const, helper)
    ctx, joined = f"{name}/ctx", f"{name}/joined"
    return nodes + more + [
        helper.make_node("MatMul", [op.inputs[0], vh], [ctx], name=f"{name}.pv"),
        helper.make_node("Transpose", [ctx], [joined], name=f"{name}.join", perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", [joined, const(np.array([0, 0, c], np.int64), name)],
                         [op.outputs[0]], name=name)]


EMITTERS = {"Embedding": _embedding, "PositionEmbedding": _position,
            "LayerNorm": _layer_norm, "Gelu": _gelu, "Attention": _attention,
            "AttentionScores": _scores, "AttentionContext": _context}
