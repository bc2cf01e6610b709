"""The test-phase inference graph -> an ONNX model (``export onnx``).

The exported graph starts at the data op's ``data`` output (the model input,
N x C x H x W float32) and ends at the blobs the loss and accuracy layers
read (their logits), plus any blob no op reads; the loss, accuracy and label
are left out. Parameters become initializers with their trained values.
Ops are mapped one by one (opset 13):

    Conv -> Conv               InnerProduct -> Flatten + Gemm (transB)
    Pool -> MaxPool / AveragePool (+ Mul for Caffe's divisor) / Global*Pool
    Relu -> Relu / LeakyRelu   Sigmoid, Tanh, Softmax, LRN, Concat, Flatten
    BatchNorm (test) -> BatchNormalization   Dropout (test) -> Identity
    Slice -> Split             Split -> Identity per output
    Eltwise -> Sum (with Mul for coefficients) / Mul / Max
    Reshape -> Reshape         Scale -> Mul

Any other op is a UserError naming the op and its layer.
"""
import os

import numpy as np

from ..errors import UserError

OPSET = 13
_DROPPED = ("SoftmaxLoss", "Accuracy")


def export_onnx(job, weights_path, out_path, batch=None):
    """Write the ONNX model of ``job``'s test phase (a Job or a validated
    config dict) with the params of ``weights_path``; returns a one-line
    summary."""
    try:
        import onnx
    except ImportError:
        raise UserError("export onnx needs the onnx package: pip install "
                        "'purine_mpi[onnx]' (or pip install onnx)") from None
    from ..io.checkpoint import load_params
    from ..model import forward_graph
    from ..model import init_params
    from ..io.job import job_of
    job = job_of(job)
    if job.data.test is None:
        raise UserError(f"{job.path}: key 'data.test': export onnx writes the test "
                        "phase: the config needs a data.test section (its sample shape is the "
                        "model's input shape)")
    graph = forward_graph(job, "test", job.data.test)
    loaded = load_params(weights_path)
    params = [b.name for b in graph.params()]
    init_params(loaded, params, job, weights_path)
    values = {}
    for p in params:
        value = np.asarray(loaded[p], dtype=np.float32)
        if value.shape != tuple(graph.blobs[p].shape):
            raise UserError(f"weights file '{weights_path}': '{p}' has shape {list(value.shape)}"
                            f", the net expects {list(graph.blobs[p].shape)}")
        values[p] = value
    model = build_model(graph, values, job.name, batch)
    onnx.checker.check_model(model)
    out_dir = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{out_path}.tmp.{os.getpid()}"
    try:
        onnx.save(model, tmp)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    outputs = ", ".join(o.name for o in model.graph.output)
    return f"{len(model.graph.node)} nodes, input data, outputs {outputs}"


def build_model(graph, values, name, batch=None):
    """An onnx ModelProto of ``graph`` (an inference graph with a DataReader)."""
    from onnx import TensorProto, helper, numpy_helper
    order = graph.topo_order()
    consumers = graph.consumers()
    nodes, inits, outputs = [], [], []
    for p, value in values.items():
        inits.append(numpy_helper.from_array(value, p))
    counter = [0]

    def const(array, hint):
        counter[0] += 1
        cname = f"{hint}/const{counter[0]}"
        inits.append(numpy_helper.from_array(np.asarray(array), cname))
        return cname

    data_shape = None
    for op in order:
        if op.op_type == "DataReader":
            data_shape = list(graph.blobs[op.outputs[0]].shape)
            continue
        if op.op_type in _DROPPED:
            outputs += [x for x in op.inputs[:1] if x not in outputs]
            continue
        emit = _EMITTERS.get(op.op_type)
        if emit is None:
            layer = op.name.split(".")[0]
            raise UserError(f"export onnx: op '{op.name}' (type {op.op_type}) of layer '{layer}' "
                            f"cannot be expressed in ONNX; exportable op types: "
                            f"{', '.join(sorted(_EMITTERS))}")
        nodes += emit(op, graph, const, helper)
    for op in order:  # blobs nobody reads (e.g. a softmax output)
        if op.op_type in _DROPPED or op.op_type == "DataReader":
            continue
        main = op.outputs if op.op_type in ("Split", "Slice") else op.outputs[:1]
        for blob in main:
            if not consumers.get(blob) and blob not in outputs:
                outputs.append(blob)
    if data_shape is None:
        raise UserError("export onnx: the net has no data input")
    data_shape[0] = batch if batch else "batch"
    inputs = [helper.make_tensor_value_info("data", TensorProto.FLOAT, data_shape)]
    outs = []
    for blob in outputs:
        shape = list(graph.blobs[blob].shape)
        shape[0] = batch if batch else "batch"
        outs.append(helper.make_tensor_value_info(blob, TensorProto.FLOAT, shape))
    onnx_graph = helper.make_graph(nodes, name, inputs, outs, initializer=inits)
    model = helper.make_model(onnx_graph, producer_name="purine_mpi",
                              opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = min(model.ir_version, 8)  # readable by older runtimes too
    return model


# ------------------------------------------------------------------ emitters
def _pair(v):
    return [int(v), int(v)] if np.isscalar(v) else [int(x) for x in v]


def _conv(op, graph, const, helper):
    pad = _pair(op.attrs.get("pad", 0))
    w_shape = graph.blobs[op.inputs[1]].shape
    return [helper.make_node("Conv", list(op.inputs), [op.outputs[0]], name=op.name,
                             kernel_shape=list(w_shape[2:]), pads=pad + pad,
                             strides=_pair(op.attrs.get("stride", 1)),
                             dilations=_pair(op.attrs.get("dilation", 1)),
                             group=int(op.attrs.get("group", 1)))]


def _fc(op, graph, const, helper):
    x = op.inputs[0]
    nodes = []
    if len(graph.blobs[x].shape) != 2:
        flat = f"{op.name}/flat"
        nodes.append(helper.make_node("Flatten", [x], [flat], name=f"{op.name}.flatten", axis=1))
        x = flat
    nodes.append(helper.make_node("Gemm", [x] + list(op.inputs[1:]), [op.outputs[0]],
                                  name=op.name, transB=1))
    return nodes


def _pool(op, graph, const, helper):
    """Caffe's windows with explicit pads and no ceil_mode: ONNX's ceil-mode
    output size lacks Caffe's rule that drops a last window starting in the
    padding, so the end pads are chosen to give our output size in floor mode.
    Average pooling then divides by kh*kw everywhere; a constant factor per
    output position turns that into Caffe's divisor (padding counted, but
    nothing past H + pad)."""
    kind = "Max" if op.attrs.get("pool", "max") == "max" else "Average"
    x, y = op.inputs[0], op.outputs[0]
    if op.attrs.get("global"):
        return [helper.make_node(f"Global{kind}Pool", [x], [y], name=op.name)]
    (kh, kw), (sh, sw) = _pair(op.attrs["kernel"]), _pair(op.attrs.get("stride", 1))
    ph, pw = _pair(op.attrs.get("pad", 0))
    height, width = graph.blobs[x].shape[2:]
    out_h, out_w = graph.blobs[y].shape[2:]
    end_h = max((out_h - 1) * sh + kh - height - ph, 0)
    end_w = max((out_w - 1) * sw + kw - width - pw, 0)
    attrs = {"kernel_shape": [kh, kw], "strides": [sh, sw], "pads": [ph, pw, end_h, end_w]}
    if kind == "Max":
        return [helper.make_node("MaxPool", [x], [y], name=op.name, **attrs)]
    sizes_h = [min(i * sh - ph + kh, height + ph) - (i * sh - ph) for i in range(out_h)]
    sizes_w = [min(j * sw - pw + kw, width + pw) - (j * sw - pw) for j in range(out_w)]
    factor = (kh * kw) / np.outer(sizes_h, sizes_w)
    if np.all(factor == 1):
        return [helper.make_node("AveragePool", [x], [y], name=op.name, count_include_pad=1,
                                 **attrs)]
    mean = f"{op.name}/mean_kxk"
    return [helper.make_node("AveragePool", [x], [mean], name=op.name, count_include_pad=1,
                             **attrs),
            helper.make_node("Mul", [mean, const(factor.astype(np.float32)[None, None],
                                                 op.name)], [y], name=f"{op.name}.divisor")]


def _relu(op, graph, const, helper):
    slope = float(op.attrs.get("negative_slope", 0.0))
    if slope:
        return [helper.make_node("LeakyRelu", [op.inputs[0]], [op.outputs[0]], name=op.name,
                                 alpha=slope)]
    return [helper.make_node("Relu", [op.inputs[0]], [op.outputs[0]], name=op.name)]


def _unary(onnx_type, **fixed):
    def emit(op, graph, const, helper):
        attrs = {k: (fn(op.attrs) if callable(fn) else fn) for k, fn in fixed.items()}
        return [helper.make_node(onnx_type, [op.inputs[0]], [op.outputs[0]], name=op.name,
                                 **attrs)]
    return emit


def _lrn(op, graph, const, helper):
    a = op.attrs
    return [helper.make_node("LRN", [op.inputs[0]], [op.outputs[0]], name=op.name,
                             size=int(a.get("local_size", 5)), alpha=float(a.get("alpha", 1e-4)),
                             beta=float(a.get("beta", 0.75)), bias=float(a.get("k", 1.0)))]


def _batchnorm(op, graph, const, helper):
    if str(op.attrs.get("phase", "test")).lower() != "test":
        raise UserError(f"export onnx: op '{op.name}' is a training-phase batch norm")
    return [helper.make_node("BatchNormalization", list(op.inputs), [op.outputs[0]],
                             name=op.name, epsilon=float(op.attrs.get("eps", 1e-5)))]


def _slice(op, graph, const, helper):
    shape = graph.blobs[op.inputs[0]].shape
    axis = int(op.attrs.get("axis", 1)) % len(shape)
    sizes = [int(graph.blobs[y].shape[axis]) for y in op.outputs]
    return [helper.make_node("Split", [op.inputs[0], const(np.array(sizes, np.int64), op.name)],
                             list(op.outputs), name=op.name, axis=axis)]


def _split(op, graph, const, helper):
    return [helper.make_node("Identity", [op.inputs[0]], [y], name=f"{op.name}.{i}")
            for i, y in enumerate(op.outputs)]


def _eltwise(op, graph, const, helper):
    operation = op.attrs.get("operation", "sum")
    inputs, nodes = list(op.inputs), []
    coeff = op.attrs.get("coeff")
    if operation == "sum" and coeff is not None:
        scaled = []
        for i, (x, c) in enumerate(zip(inputs, coeff)):
            out = f"{op.name}/scaled{i}"
            nodes.append(helper.make_node("Mul", [x, const(np.float32(c), op.name)], [out],
                                          name=f"{op.name}.coeff{i}"))
            scaled.append(out)
        inputs = scaled
    onnx_type = {"sum": "Sum", "prod": "Mul", "max": "Max"}[operation]
    if onnx_type == "Mul":  # binary in ONNX: a chain
        acc = inputs[0]
        for i, x in enumerate(inputs[1:]):
            out = op.outputs[0] if i == len(inputs) - 2 else f"{op.name}/prod{i}"
            nodes.append(helper.make_node("Mul", [acc, x], [out], name=f"{op.name}.{i}"))
            acc = out
        return nodes
    return nodes + [helper.make_node(onnx_type, inputs, [op.outputs[0]], name=op.name)]


def _reshape(op, graph, const, helper):
    shape = np.array([int(s) for s in op.attrs["shape"]], np.int64)
    return [helper.make_node("Reshape", [op.inputs[0], const(shape, op.name)], [op.outputs[0]],
                             name=op.name)]


def _scale(op, graph, const, helper):
    return [helper.make_node("Mul", [op.inputs[0], const(np.float32(op.attrs["scale"]),
                                                         op.name)], [op.outputs[0]],
                             name=op.name)]


_EMITTERS = {
    "Conv": _conv, "InnerProduct": _fc, "Pool": _pool, "Relu": _relu,
    "Sigmoid": _unary("Sigmoid"), "Tanh": _unary("Tanh"),
    "Softmax": _unary("Softmax", axis=lambda a: int(a.get("axis", 1))),
    "LRN": _lrn, "Dropout": _unary("Identity"), "BatchNorm": _batchnorm,
    "Concat": lambda op, g, const, helper: [helper.make_node(
        "Concat", list(op.inputs), [op.outputs[0]], name=op.name,
        axis=int(op.attrs.get("axis", 1)))],
    "Flatten": _unary("Flatten", axis=lambda a: int(a.get("axis", 1))),
    "Slice": _slice, "Split": _split, "Eltwise": _eltwise, "Reshape": _reshape,
    "Scale": _scale, "Copy": _unary("Identity"),
}
