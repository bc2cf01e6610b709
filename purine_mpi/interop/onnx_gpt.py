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
    Attention          -> MatMul + Add (qkv), Split into q, k, v,
                          Attention (q_num_heads = kv_num_heads = H,
                          is_causal), MatMul + Add (the output projection)

The model's input ``data`` keeps the data blob's dtype (int32 token ids).
"""
import numpy as np

#: the opset of a model with a transformer's ops
OPSET_GPT = 23

#: op types whose presence selects OPSET_GPT
GPT_OPS = ("Embedding", "PositionEmbedding", "LayerNorm", "Gelu", "Attention")


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


def attention_nodes(name, x, y, params, heads, causal, graph, const, helper):
    """Nodes of multi-head self-attention on x (N, T, C): ``params`` the
    blobs (qkv_weight, qkv_bias or None, proj_weight, proj_bias or None)."""
    qkv_w, qkv_b, proj_w, proj_b = params
    c = int(graph.blobs[proj_w].shape[0])
    qkv, q, k, v, a = (f"{name}/{s}" for s in ("qkv", "q", "k", "v", "heads"))
    nodes = linear(x, qkv_w, qkv_b, qkv, f"{name}.qkv", helper)
    nodes.append(helper.make_node("Split", [qkv, const(np.array([c, c, c], np.int64), name)],
                                  [q, k, v], name=f"{name}.split", axis=-1))
    nodes.append(helper.make_node("Attention", [q, k, v], [a], name=f"{name}.attention",
                                  q_num_heads=int(heads), kv_num_heads=int(heads),
                                  is_causal=int(bool(causal))))
    return nodes + linear(a, proj_w, proj_b, y, f"{name}.proj", helper)


EMITTERS = {"Embedding": _embedding, "PositionEmbedding": _position,
            "LayerNorm": _layer_norm, "Gelu": _gelu}
