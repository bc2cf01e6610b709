"""The test-phase inference graph -> an ONNX model (``export onnx``).

The exported graph starts at the data op's ``data`` output (the model input,
N x C x H x W float32) and ends at the blobs the loss and accuracy layers
read (their logits), plus any blob no op reads; the loss, accuracy and label
are left out. Parameters become initializers with their trained values.
Ops are mapped one by one (opset 13; a transformer's ops, interop/onnx_gpt.py,
take opset 23 and a token input of free batch and sequence length):

    Conv -> Conv               InnerProduct -> Flatten + Gemm (transB); with
                               axis k > 1: Reshape (axes k.. merged) + MatMul, Add
    Pool -> MaxPool / AveragePool (+ Mul for Caffe's divisor) / Global*Pool
    Relu -> Relu / LeakyRelu   Sigmoid, Tanh, Softmax, LRN, Concat, Flatten
    BatchNorm (test) -> BatchNormalization   Dropout (test) -> Identity
    Slice -> Split             Split -> Identity per output
    Eltwise -> Sum (with Mul for coefficients) / Mul / Max
    Reshape -> Reshape (a fixed first axis, not 0: only at the config's batch)
    Scale -> Mul
    Flatten with axis k > 1 -> Reshape (ONNX's Flatten merges axes 0..k-1 too)
    LRN within_channel -> Mul (x^2) + AveragePool + Mul, Add, Pow + Mul

Any other op is a UserError naming the op and its layer.

The data transform of the test spec (``data/transform.py``, test phase: the
centre crop, no mirror) is part of the model by default (``raw_input``): the
input ``data`` is a batch as the data file holds it (N x C x H x W before the
crop; uint8 when the file stores bytes), and the graph applies, in Caffe's
order, Cast to float, Slice (the centre crop), Sub (the mean image's centre
window, or the mean values), Mul (scale). With ``raw_input=False`` the input
is the transformed batch, as before. Either way the model's metadata
(``purine.preprocessing``, JSON) says what the input is and which transform
the model applies, and the summary line says it.
"""
import json

import numpy as np

from ..base.errors import ConfigError, UserError
from ..base.runfiles import make_parent, write_replacing
from .onnx_gpt import EMITTERS as GPT_EMITTERS, GPT_OPS, OPSET_GPT

OPSET = 13
_DROPPED = ("SoftmaxLoss", "Accuracy")


def export_onnx(job, weights_path, out_path, batch=None, raw_input=True):
    """Write the ONNX model of ``job``'s test phase (job/job.py's Job) with
    the params of ``weights_path``; returns a one-line summary.
    ``raw_input``: the model takes untransformed input and applies the test
    spec's transform."""
    try:
        import onnx
    except ImportError:
        raise UserError("export onnx needs the onnx package: pip install "
                        "'purine_mpi[onnx]' (or pip install onnx)") from None
    from ..job.replica import forward_graph, trained_values
    if job.graph is not None:  # forward_graph builds the net: list only
        raise ConfigError(job.path, "graph", "export onnx writes the test phase of a "
                          "net: list (docs/config.md); a graph config has none, and its ops "
                          "would not be in the model")
    if job.data.test is None:
        raise ConfigError(job.path, "data.test", "export onnx writes the test "
                          "phase: the config needs a data.test section (its sample shape is the "
                          "model's input shape)")
    graph = forward_graph(job, "test", job.data.test)
    values = trained_values(graph, job, weights_path)
    # a model of NaN weights computes nothing: exit 3, as export hf, test,
    # predict and generate refuse them, before anything is written
    from ..job.checkpoint_check import check_finite
    check_finite(values, weights_path)
    spec = job.data.test.source_dict()  # the source and transform keys, as data/sources reads them
    pre = preprocessing(spec) if raw_input else None
    model = build_model(graph, values, job.name, batch, pre)
    said = describe(spec, pre)
    ids = graph.blobs["data"]
    if np.dtype(ids.dtype).kind in "iu":  # a text source: token ids, no transform
        said = {"line": f"input data: {np.dtype(ids.dtype).name} token ids (batch x sequence)",
                "meta": {"input": "tokens", "dtype": np.dtype(ids.dtype).name}}
    entry = model.metadata_props.add()
    entry.key, entry.value = "purine.preprocessing", json.dumps(said["meta"])
    note = precision_note(job)
    if note is not None:  # the model computes in float32, not as the run's forward did
        entry = model.metadata_props.add()
        entry.key, entry.value = "purine.precision", json.dumps(
            {"trained": job.precision, "model": "float32", "note": note})
    onnx.checker.check_model(model)
    try:  # the shapes ONNX infers op by op must be ours: a file that loads, as declared
        onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except onnx.shape_inference.InferenceError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"export onnx: {job.path}: ONNX's shape inference refuses the model "
                        f"built from this net ({first}); nothing written: an op is mapped "
                        "in a way ONNX reads otherwise (an exporter bug: report it with the "
                        "config)") from None
    make_parent(out_path)
    write_replacing(out_path, lambda tmp: onnx.save(model, tmp))
    outputs = ", ".join(o.name for o in model.graph.output)
    return f"{len(model.graph.node)} nodes, outputs {outputs}; {said['line']}"


def precision_note(job):
    """None for an fp32 config; else the one line saying that the exported
    model (float32 master weights, float32 ops) does not compute what the
    config's ``precision`` forward computes: its outputs differ by the
    rounding of bf16/fp16 GEMMs (or TF32's), they are not that forward's."""
    precision = getattr(job, "precision", "fp32")
    if precision in (None, "fp32"):
        return None
    how = {"tf32": "TensorFloat-32 GEMMs and convolutions",
           "bf16": "bfloat16 GEMMs, convolutions and attention",
           "fp16": "float16 GEMMs, convolutions and attention"}.get(precision, precision)
    return (f"note: precision is {precision}: the model holds the float32 master weights and "
            f"computes in float32, so its outputs are not those of the {precision} forward "
            f"({how}); they differ by that rounding")


# ------------------------------------------------------------ the transform
def preprocessing(spec):
    """{shape (C, H, W), dtype, crop, mean_image, mean, scale} of the test
    spec's transform as the model applies it (None when there is none and
    the data is float32: the input is then the data as it is)."""
    from ..data.sources import source_info
    from ..data.transform import has_transform, mean_image
    _, shape = source_info(spec)
    dtype = _raw_dtype(spec)
    if not has_transform(spec) and dtype == np.float32:
        return None
    crop = spec.get("crop_size")
    image = mean_image(spec["mean_file"]) if spec.get("mean_file") is not None else None
    top = left = 0
    if crop is not None:
        top, left = (shape[1] - crop) // 2, (shape[2] - crop) // 2
        if image is not None:
            image = image[:, top:top + crop, left:left + crop]
    return {"shape": tuple(shape), "dtype": dtype, "crop": crop, "top": top, "left": left,
            "mean_image": image, "mean": spec.get("mean"), "scale": spec.get("scale")}


def _raw_dtype(spec):
    """uint8 or float32: what the source's samples are before the transform."""
    kind = spec.get("source", "hdf5")
    if kind == "lmdb":
        from ..data.lmdb_source import lmdb_meta
        return np.uint8 if lmdb_meta(spec["path"]).dtype == np.uint8 else np.float32
    if kind == "hdf5":
        import h5py
        with h5py.File(spec["path"], "r") as f:
            group = f if spec.get("split") is None else f[spec["split"]]
            return np.uint8 if group["data"].dtype == np.uint8 else np.float32
    return np.float32


def describe(spec, pre):
    """{"line": what the summary says, "meta": the metadata's JSON} of the input."""
    from ..data.transform import has_transform
    steps = []
    if spec.get("crop_size") is not None:
        steps.append(f"centre crop {spec['crop_size']}")
    if spec.get("mean_file") is not None:
        steps.append(f"subtract the mean image {spec['mean_file']}")
    if spec.get("mean") is not None:
        steps.append(f"subtract mean {spec['mean']}")
    if spec.get("scale") is not None:
        steps.append(f"multiply by {spec['scale']:g}")
    meta = {"transform": {k: spec[k] for k in ("crop_size", "mean_file", "mean", "scale")
                          if spec.get(k) is not None}}
    if pre is not None:
        dtype = np.dtype(pre["dtype"]).name
        meta.update(input="raw", dtype=dtype, shape=list(pre["shape"]))
        line = (f"input data: raw samples as the data file holds them ({dtype} "
                f"{' x '.join(map(str, pre['shape']))})"
                + (f"; the model applies: {', '.join(steps)}" if steps else ""))
    elif has_transform(spec):
        meta.update(input="transformed")
        line = (f"input data: already transformed (--no-raw-input): {', '.join(steps)} "
                "before feeding it (also in the model's metadata 'purine.preprocessing')")
    else:
        meta.update(input="raw")
        line = "input data: the samples as the data file holds them (no transform)"
    return {"line": line, "meta": meta}


def _preprocess_nodes(pre, const, helper):
    """Nodes from the raw input ``data`` to ``data/transformed`` (Caffe's order)."""
    from onnx import TensorProto
    nodes, x = [], "data"

    def step(op_type, inputs, **attrs):
        nonlocal x
        out = f"data/{op_type.lower()}{len(nodes)}"
        nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        x = out

    if pre["dtype"] != np.float32:
        step("Cast", [x], to=TensorProto.FLOAT)
    crop = pre["crop"]
    if crop is not None:
        starts = np.array([pre["top"], pre["left"]], np.int64)
        step("Slice", [x, const(starts, "data"), const(starts + crop, "data"),
                       const(np.array([2, 3], np.int64), "data")])
    if pre["mean_image"] is not None:
        step("Sub", [x, const(pre["mean_image"][None].astype(np.float32), "data")])
    mean = pre["mean"]
    if mean is not None:
        value = np.asarray(mean, np.float32)
        step("Sub", [x, const(value.reshape(1, -1, 1, 1) if value.ndim else value, "data")])
    if pre["scale"] is not None:
        step("Mul", [x, const(np.float32(pre["scale"]), "data")])
    if not nodes:
        step("Identity", [x])
    nodes[-1].output[0] = "data/transformed"
    return nodes


def build_model(graph, values, name, batch=None, pre=None):
    """An onnx ModelProto of ``graph`` (an inference graph with a DataReader);
    ``pre`` (``preprocessing``): the model's input is raw and these nodes
    transform it first."""
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
    rows = graph.blobs["data"].shape[0]  # the batch the graph was built with
    # the loss's and the accuracy's ops, and what reads their figures (a
    # softmax_loss normalization's Scale): the model ends at their logits
    dropped = set()
    for op in order:
        if op.op_type == "DataReader":
            data_shape = list(graph.blobs[op.outputs[0]].shape)
            continue
        if op.op_type in _DROPPED or dropped.intersection(op.inputs):
            if op.op_type in _DROPPED:
                outputs += [x for x in op.inputs[:1] if x not in outputs]
            dropped.update(op.outputs)
            continue
        if op.op_type == "Reshape" and batch != rows and int(op.attrs["shape"][0]) > 0:
            layer = op.name.split(".")[0]
            given = f"--batch {batch}" if batch else "a free batch (no --batch)"
            raise UserError(f"export onnx: layer '{layer}' reshapes to a fixed first axis of "
                            f"{op.attrs['shape'][0]} (shape {list(op.attrs['shape'])}): with "
                            f"{given} the model would mix or drop samples of a batch other "
                            f"than the config's {rows}; write 0 there (the batch axis "
                            f"kept), or export with --batch {rows}")
        emit = _EMITTERS.get(op.op_type)
        if emit is None:
            layer = op.name.split(".")[0]
            raise UserError(f"export onnx: op '{op.name}' (type {op.op_type}) of layer '{layer}' "
                            f"cannot be expressed in ONNX; exportable op types: "
                            f"{', '.join(sorted(_EMITTERS))}")
        nodes += emit(op, graph, const, helper)
    for op in order:  # blobs nobody reads (e.g. a softmax output)
        if op.op_type == "DataReader" or dropped.intersection(op.outputs):
            continue
        main = op.outputs if op.op_type in ("Split", "Slice") else op.outputs[:1]
        for blob in main:
            if not consumers.get(blob) and blob not in outputs:
                outputs.append(blob)
    if data_shape is None:
        raise UserError("export onnx: the net has no data input")
    if not outputs:
        raise UserError(f"export onnx: the net '{name}' has no output (no loss or accuracy "
                        "input, no blob that nothing reads): nothing to export")
    data_shape[0] = batch if batch else "batch"
    elem = TensorProto.FLOAT
    if pre is not None:
        for node in nodes:  # the net reads the transformed batch
            node.input[:] = ["data/transformed" if i == "data" else i for i in node.input]
        nodes = _preprocess_nodes(pre, const, helper) + nodes
        data_shape = [data_shape[0]] + list(pre["shape"])
        elem = TensorProto.UINT8 if pre["dtype"] == np.uint8 else TensorProto.FLOAT
    tokens = pre is None and np.dtype(graph.blobs["data"].dtype).kind in "iu"
    if tokens:  # (N, T) token ids: batch and sequence length both free
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(graph.blobs["data"].dtype))
        if len(data_shape) > 1 and not batch:
            data_shape[1] = "sequence"
    inputs = [helper.make_tensor_value_info("data", elem, data_shape)]
    outs = []
    for blob in outputs:
        shape = list(graph.blobs[blob].shape)
        if shape[0] == rows:
            shape[0] = batch if batch else "batch"
        elif batch != rows:  # axis 0 is not the batch (a concat along it): left unnamed
            shape[0] = None
        if tokens and not batch and len(shape) > 2:
            shape[1] = "sequence"
        outs.append(helper.make_tensor_value_info(blob, TensorProto.FLOAT, shape))
    onnx_graph = helper.make_graph(nodes, name, inputs, outs, initializer=inits)
    gpt = any(op.op_type in GPT_OPS for op in order)  # LayerNormalization, Attention, ...
    model = helper.make_model(onnx_graph, producer_name="purine_mpi",
                              opset_imports=[helper.make_opsetid("", OPSET_GPT if gpt
                                                                 else OPSET)])
    if not gpt:
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


def _merged(x, axis, name, const, helper, out=None):
    """A Reshape node merging the axes of ``x`` from ``axis`` to the end into
    one (the leading axes kept: ONNX's Flatten would merge them too)."""
    shape = np.array([0] * axis + [-1], np.int64)
    return helper.make_node("Reshape", [x, const(shape, name)], [out or f"{name}/merged"],
                            name=f"{name}.merge" if out is None else name)


def _flatten(op, graph, const, helper):
    ndim = len(graph.blobs[op.inputs[0]].shape)
    axis = int(op.attrs.get("axis", 1)) % ndim
    if axis <= 1:
        return [helper.make_node("Flatten", [op.inputs[0]], [op.outputs[0]], name=op.name,
                                 axis=axis)]
    return [_merged(op.inputs[0], axis, op.name, const, helper, op.outputs[0])]


def _fc(op, graph, const, helper):
    x = op.inputs[0]
    ndim = len(graph.blobs[x].shape)
    axis = int(op.attrs.get("axis", 1)) % ndim if ndim > 2 else 1
    if axis > 1:  # y = x.shape[:axis] + (O,): a product over the merged last axis
        from .onnx_gpt import linear
        nodes = [] if axis == ndim - 1 else [_merged(x, axis, op.name, const, helper)]
        b = op.inputs[2] if len(op.inputs) == 3 else None
        return nodes + linear(nodes[0].output[0] if nodes else x, op.inputs[1], b,
                              op.outputs[0], op.name, helper)
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
    if str(a.get("norm_region", "across_channels")).lower() == "within_channel":
        return _lrn_within(op, graph, const, helper)
    return [helper.make_node("LRN", [op.inputs[0]], [op.outputs[0]], name=op.name,
                             size=int(a.get("local_size", 5)), alpha=float(a.get("alpha", 1e-4)),
                             beta=float(a.get("beta", 0.75)), bias=float(a.get("k", 1.0)))]


def _lrn_within(op, graph, const, helper):
    """Caffe's WITHIN_CHANNEL LRN as Caffe builds it: x^2, an AveragePool of
    size x size (pad size // 2, stride 1, the padding counted), then
    y = x * (k + alpha * avg)^(-beta)."""
    a = op.attrs
    size, r = int(a.get("local_size", 5)), int(a.get("local_size", 5)) // 2
    dtype = np.dtype(graph.blobs[op.inputs[0]].dtype).type
    x, name = op.inputs[0], op.name
    sq, avg, sc, sh, p = (f"{name}/{s}" for s in ("square", "avg", "scaled", "scale", "pow"))
    return [
        helper.make_node("Mul", [x, x], [sq], name=f"{name}.square"),
        helper.make_node("AveragePool", [sq], [avg], name=f"{name}.avg",
                         kernel_shape=[size, size], pads=[r, r, r, r], strides=[1, 1],
                         count_include_pad=1),
        helper.make_node("Mul", [avg, const(dtype(a.get("alpha", 1e-4)), name)], [sc],
                         name=f"{name}.alpha"),
        helper.make_node("Add", [sc, const(dtype(a.get("k", 1.0)), name)], [sh],
                         name=f"{name}.k"),
        helper.make_node("Pow", [sh, const(dtype(-float(a.get("beta", 0.75))), name)], [p],
                         name=f"{name}.beta"),
        helper.make_node("Mul", [x, p], [op.outputs[0]], name=f"{name}.y"),
    ]


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
    "Flatten": _flatten,
    "Slice": _slice, "Split": _split, "Eltwise": _eltwise, "Reshape": _reshape,
    "Scale": _scale, "Copy": _unary("Identity"),
}
_EMITTERS.update(GPT_EMITTERS)  # a transformer's ops (interop/onnx_gpt.py)
