"""The standard layer set. Each function reads its config fields and emits
the forward ops; backward comes from the gradient rules of those ops.

Each ``@layer`` declares the keys its function reads (``Key(name, kind,
default, meaning)``); ``b.get(name)`` takes the kind and default from there.
docs/config.md is generated from these declarations: after changing keys
run ``python -m purine_mpi.tools.docgen --write``.
"""
from ..base.errors import excerpt
from ..ops.batchnorm import REPLICA_SUM
from .registry import (AT_LEAST_ONE, FINITE, FRACTION, NON_NEGATIVE, POSITIVE, RATIO, REQUIRED,
                       Key, Range, Required, Slot, layer)
from .fillers import FILLERS

XAVIER = {"type": "xavier"}
#: the iteration counter blob (graph/solver_graph.py writes the same name)
ITER_BLOB = "iter"
ZERO = {"type": "constant", "value": 0.0}
ONE = {"type": "constant", "value": 1.0}


def _param_key(what, *slots):
    """The ``param`` key of a layer whose parameters are ``slots`` (``Slot``
    tuples, in order; ``what``: their names in the docs)."""
    return Key("param", "params", [], f"lr_mult / decay_mult per parameter ({what}); "
                                      "default 1.0 each", slots=slots)


#: the parameters of a layer with a weight and a ``bias_term``
WEIGHT_BIAS = (Slot("weight"), Slot("bias", "bias_term"))


def _filler_keys(weight, bias, weight_what="weight", bias_what="bias"):
    return (Key("weight_filler", "filler", weight, f"initialisation of the {weight_what}"),
            Key("bias_filler", "filler", bias, f"initialisation of the {bias_what}"))


BIAS_TERM = Key("bias_term", "bool", True, "learn a bias (`<name>/bias`)")


def _pair(v):
    return [v, v] if isinstance(v, int) else list(v)


def _filler(b, key):
    f = b.get(key)
    if not isinstance(f, dict) or not isinstance(f.get("type"), str) \
            or f["type"] not in FILLERS:
        b.fail(key, "expected a filler such as {type: xavier}, {type: gaussian, std: 0.01}, "
                    f"{{type: msra}}, {{type: uniform, min: -a, max: a}}, or {{type: constant, "
                    f"value: 0}}; got {excerpt(f)}")
    return f


@layer("conv", "convolution", keys=(
    Key("num_output", "posint", REQUIRED, "output channels"),
    Key("kernel", "pair", REQUIRED, "kernel size", AT_LEAST_ONE),
    Key("stride", "pair", 1, "stride", AT_LEAST_ONE),
    Key("pad", "pair", 0, "zero padding on each side", NON_NEGATIVE),
    Key("dilation", "pair", 1, "dilation of the kernel", AT_LEAST_ONE,
        weights=True),
    Key("group", "posint", 1, "channel groups (divides the input channels and num_output)",
        weights=True),
    BIAS_TERM, *_filler_keys(XAVIER, ZERO), _param_key("weight, then bias", *WEIGHT_BIAS)))
def conv(b):
    """2-D convolution (N×C×H×W); the weight `<name>/weight` is num_output × C/group × kh ×
    kw."""
    (x,) = b.bottoms(1)
    (y,) = b.tops(1)
    num_output = b.get("num_output")
    kernel = _pair(b.get("kernel"))
    group = b.get("group")
    attrs = {"stride": _pair(b.get("stride")), "pad": _pair(b.get("pad")),
             "dilation": _pair(b.get("dilation")), "group": group}
    shape = b.shape(x)
    if len(shape) != 4:
        b.fail("bottom", f"conv needs a 4-D N×C×H×W input, '{x}' is {list(shape)}")
    if shape[1] % group or num_output % group:
        b.fail("group", f"group {group} must divide the input channels ({shape[1]}) and "
                        f"num_output ({num_output})")
    w = b.param("weight", (num_output, shape[1] // group, *kernel), _filler(b, "weight_filler"),
                0)
    inputs = [x, w]
    bias_filler = _filler(b, "bias_filler")
    if b.get("bias_term"):
        inputs.append(b.param("bias", (num_output,), bias_filler, 1))
    b.op("Conv", inputs, [y], attrs)


@layer("fc", "inner_product", "innerproduct", keys=(
    Key("num_output", "posint", REQUIRED, "output features"),
    Key("axis", "int", 1, "the first axis flattened into the features (Caffe's): 1 flattens "
                          "(N, ...) to N rows; -1 (or 2 of an (N, T, C) blob) maps the last "
                          "axis, giving (N, T, num_output)", Range(note="an axis of the bottom "
                                                                   "but 0"),
        weights=True),
    Key("tie_weight", "str", None, "use that earlier layer's `weight` as this layer's weight "
                                   "(an embedding's (input_dim, C) table for an output "
                                   "projection with num_output = input_dim); its gradient is "
                                   "the sum of both uses, its multipliers the owner's (a "
                                   "`param` entry 0 giving others exits 2, as Caffe's "
                                   "mismatched shared param)"),
    BIAS_TERM, *_filler_keys(XAVIER, ZERO), _param_key("weight, then bias", *WEIGHT_BIAS)))
def fc(b):
    """Fully connected (Caffe's InnerProduct): y = x·Wᵀ + b with the input flattened from
    `axis` on (after axis 0 by default)."""
    (x,) = b.bottoms(1)
    (y,) = b.tops(1)
    num_output = b.get("num_output")
    shape = b.shape(x)
    axis = b.get("axis")
    if not -len(shape) < axis <= len(shape) - 1 or axis == 0:
        b.fail("axis", f"expected an axis in 1..{len(shape) - 1} or -{len(shape) - 1}..-1 for "
                       f"an input of shape {list(shape)}, got {axis}")
    axis %= len(shape)
    fan_in = 1
    for s in shape[axis:]:
        fan_in *= s
    tie = b.get("tie_weight")
    if tie is None:
        w = b.param("weight", (num_output, fan_in), _filler(b, "weight_filler"), 0)
    else:
        w = f"{tie}/weight"
        have = b.graph.blobs.get(w)
        if have is None or have.kind != "param":
            b.fail("tie_weight", f"no earlier layer named '{tie}' has a weight to share")
        if tuple(have.shape) != (num_output, fan_in):
            b.fail("tie_weight", f"the weight of '{tie}' has shape {list(have.shape)}, this "
                                 f"layer needs [{num_output}, {fan_in}] (num_output, features)")
        b.shared_param(w, 0)
    inputs = [x, w]
    bias_filler = _filler(b, "bias_filler")
    if b.get("bias_term"):
        inputs.append(b.param("bias", (num_output,), bias_filler, 1))
    b.op("InnerProduct", inputs, [y], {"axis": axis} if axis != 1 else None)


def _simple(op_type, doc, *keys):
    @layer(op_type.lower(), keys=keys, doc=doc)
    def fn(b):
        (x,) = b.bottoms(1)
        attrs = {k.name: b.get(k.name) for k in keys}
        (y,) = b.tops(1)
        b.op(op_type, [x], [y], attrs)
    return fn


_simple("Relu", "Rectified linear unit; leaky with negative_slope.",
        Key("negative_slope", "number", 0.0, "slope for x < 0 (leaky ReLU)", FINITE))
_simple("Sigmoid", "Logistic sigmoid.")
_simple("Tanh", "Hyperbolic tangent.")


@layer("softmax", keys=(Key("axis", "int", 1, "the axis normalised (negative counts from the "
                                              "end)", Range(note="an axis of the bottom")),))
def softmax(b):
    """Softmax over an axis (probabilities; not a loss)."""
    (x,) = b.bottoms(1)
    (y,) = b.tops(1)
    b.op("Softmax", [x], [y], {"axis": _axis(b, x)})


_simple("Flatten", "Merge the axes from axis to the end into one.",
        Key("axis", "int", 1, "first axis merged (negative counts from the end)",
            Range(note="an axis of the bottom")))


@layer("reshape", keys=(
    Key("shape", "ints", REQUIRED, "the new shape: 0 copies that input dim, -1 is inferred",
        Range(-1)),))
def reshape(b):
    """Reshape (Caffe's whole-shape form)."""
    (x,) = b.bottoms(1)
    shape = b.get("shape")
    if not isinstance(shape, list) or not all(isinstance(s, int) for s in shape):
        b.fail("shape", "expected a list of integers (0 copies a dim, -1 infers), got "
                        f"{excerpt(shape)}")
    (y,) = b.tops(1)
    b.op("Reshape", [x], [y], {"shape": shape})


@layer("pool", "pooling", keys=(
    Key("pool", ("max", "ave", "avg", "average"), "max", "max or average pooling"),
    Key("kernel", "pair", Required("unless global"), "window size", AT_LEAST_ONE),
    Key("stride", "pair", 1, "stride", AT_LEAST_ONE),
    Key("pad", "pair", 0, "zero padding on each side", NON_NEGATIVE),
    Key("ceil_mode", "bool", False, "round the output size up (Caffe's rounding), less the "
                                    "last window if it would start at or past H + pad "
                                    "(torch's rule; Caffe drops it only with pad > 0)"),
    Key("global", "bool", False, "pool each whole feature map to 1×1 (no kernel)"),
    Key("global_pooling", "bool", False, "Caffe's name for global")))
def pool(b):
    """Max or average pooling (Caffe's): an average divides by the window size counting the
    padding but not what lies past it."""
    (x,) = b.bottoms(1)
    kind = "max" if b.get("pool") == "max" else "ave"
    is_global = b.get("global") or b.get("global_pooling")
    attrs = {"pool": kind, "global": is_global,
             "stride": _pair(b.get("stride")), "pad": _pair(b.get("pad")),
             "ceil_mode": b.get("ceil_mode")}
    if not is_global:
        attrs["kernel"] = _pair(b.get("kernel"))
    elif "kernel" in b.cfg:
        b.fail("kernel", "a global pool takes no kernel (it pools each whole feature map)")
    else:
        for k, none in (("stride", [1, 1]), ("pad", [0, 0])):  # as Caffe's check
            if attrs[k] != none:
                b.fail(k, f"a global pool takes {k} {none[0]} (it pools each whole feature "
                          f"map), got {excerpt(b.get(k))}")
    (y,) = b.tops(1)
    outs = [y, f"{b.cfg['name']}.mask"] if kind == "max" else [y]
    b.op("Pool", [x], outs, attrs)


@layer("global_pool", "global_ave_pool")
def global_pool(b):
    """Average over each whole feature map (N×C×1×1)."""
    (x,) = b.bottoms(1)
    (y,) = b.tops(1)
    b.op("Pool", [x], [y], {"pool": "ave", "global": True, "stride": [1, 1], "pad": [0, 0],
                            "ceil_mode": False})


@layer("lrn", keys=(
    Key("local_size", "posint", 5, "channels in the window"),
    Key("alpha", "number", 1e-4, "scale α", NON_NEGATIVE),
    Key("beta", "number", 0.75, "exponent β", NON_NEGATIVE),
    Key("k", "number", 1.0, "offset k (k + α·Σx²/n stays > 0)", POSITIVE),
    Key("norm_region", ("across_channels", "within_channel"), "across_channels",
        "across_channels: a window of local_size channels; within_channel: a "
        "local_size × local_size window in each channel, α divided by local_size² "
        "(Caffe's WITHIN_CHANNEL)")))
def lrn(b):
    """Local response normalisation across channels (Caffe's ACROSS_CHANNELS):
    y = x · (k + α/local_size · Σ x²)^(−β) over a window of channels; or within
    each channel (Caffe's WITHIN_CHANNEL): y = x · (k + α/local_size² · Σ x²)^(−β)
    over a local_size × local_size window, zeros past the edges."""
    (x,) = b.bottoms(1)
    attrs = {"local_size": b.get("local_size"), "alpha": float(b.get("alpha")),
             "beta": float(b.get("beta")), "k": float(b.get("k"))}
    if b.get("norm_region") == "within_channel":
        attrs["norm_region"] = "within_channel"
    (y,) = b.tops(1)
    b.op("LRN", [x], [y, f"{b.cfg['name']}.scale"], attrs)


@layer("dropout", keys=(
    Key("ratio", "number", 0.5, "probability of dropping a unit", RATIO),
    Key("dropout_ratio", "number", None, "Caffe's name for ratio", RATIO)))
def dropout(b):
    """Inverted dropout in training (kept units scaled by 1/(1−ratio)); identity in testing.
    The masks come from a counter-based generator (Philox4x32-10) keyed by `seed`, the
    rank, the layer and the iteration: the CPU and a GPU draw the same masks, and a resume
    draws the same masks as the uninterrupted run."""
    (x,) = b.bottoms(1)
    ratio = float(b.get("ratio", b.get("dropout_ratio", 0.5)))  # ranges: the declarations
    (y,) = b.tops(1)
    if b.phase == "train":
        # the iteration keys the mask (ops/dropout.py); the solver writes it
        b.graph.add_blob(ITER_BLOB, (), "int64", kind="iter", exist_ok=True)
        b.op("Dropout", [x, ITER_BLOB], [y, f"{b.cfg['name']}.mask"],
             {"ratio": ratio, "phase": "train"})
    else:
        b.op("Dropout", [x], [y], {"ratio": ratio, "phase": "test"})


@layer("batch_norm", "batchnorm", "bn", keys=(
    Key("eps", "number", 1e-5, "added to the variance", POSITIVE),
    Key("momentum", "number", 0.1, "running-statistics update: r = (1−momentum)·r + "
                                   "momentum·batch (PyTorch's convention)", FRACTION),
    Key("moving_average_fraction", "number", None, "instead of momentum: Caffe's normalised "
                                                   "moving sums with this factor", FRACTION),
    Key("sync", "bool", False, "normalise with the statistics of the global batch, summed over "
                               "the replicas in the graph (PyTorch's `SyncBatchNorm`; schemes "
                               "data, sharded, hybrid, tensor and pipeline, with or without "
                               "tensor shards; not none or the parameter-server modes): as "
                               "1 rank × batch N·B; with "
                               "micro-batches each micro-batch's, summed over the replicas "
                               "(PyTorch's per forward call)"),
    *_filler_keys(ONE, ZERO, "scale γ", "shift β"),
    _param_key("γ, then β", Slot("weight"), Slot("bias"))))
def batch_norm(b):
    """Batch normalisation with a learnt per-channel scale γ and shift β; the running mean and
    variance (`<name>/running_mean`, `<name>/running_var`) serve in testing."""
    (x,) = b.bottoms(1)
    shape = b.shape(x)
    c = (shape[1],)
    gamma = b.param("weight", c, _filler(b, "weight_filler"), 0)
    beta = b.param("bias", c, _filler(b, "bias_filler"), 1)
    mean = b.state("running_mean", c, 0.0)
    var = b.state("running_var", c, 1.0)
    attrs = {"eps": float(b.get("eps")), "momentum": float(b.get("momentum"))}
    maf = b.get("moving_average_fraction")
    if maf is not None:  # Caffe's running average (ops/batchnorm.py)
        attrs["moving_average_fraction"] = float(maf)  # in [0, 1]: its declaration
    (y,) = b.tops(1)
    name = b.cfg["name"]
    if b.phase == "train":
        g = b.graph
        g.add_blob(f"{mean}@new", c, alias_of=mean, kind="state")
        g.add_blob(f"{var}@new", c, alias_of=var, kind="state")
        inputs = [x, gamma, beta, mean, var]
        if b.get("sync"):  # the batch's sums, which the schemes allreduce (ops/batchnorm.py)
            inputs.append(f"{name}.batch_sums")
            b.op("BatchNormStats", [x], inputs[-1:], {REPLICA_SUM: True}, tag="sums")
        b.op("BatchNorm", inputs,
             [y, f"{name}.saved_mean", f"{name}.saved_invstd", f"{mean}@new", f"{var}@new"],
             dict(attrs, phase="train"))
    else:
        b.op("BatchNorm", [x, gamma, beta, mean, var], [y], dict(attrs, phase="test"))


@layer("concat", keys=(Key("axis", "int", 1, "the axis joined along (negative counts from the "
                                             "end)", Range(note="an axis of the bottoms")),))
def concat(b):
    """Join the bottoms along an axis (an inception block's branches)."""
    xs = b.bottoms()
    (y,) = b.tops(1)
    b.op("Concat", xs, [y], {"axis": _axis(b, xs[0])})


@layer("slice", keys=(
    Key("axis", "int", 1, "the axis cut (negative counts from the end)",
        Range(note="an axis of the bottom")),
    Key("slice_point", "ints", None, "increasing cut indices (default: equal parts, one per "
                                     "top)", AT_LEAST_ONE)))
def slice_(b):
    """Cut the bottom along an axis into the tops."""
    (x,) = b.bottoms(1)
    attrs = {"axis": _axis(b, x)}
    points = b.get("slice_point")
    if points is not None:
        if not isinstance(points, list) or not all(isinstance(p, int) and p > 0 for p in points) \
                or any(q <= p for p, q in zip(points, points[1:])):
            b.fail("slice_point", f"expected an increasing list of positive cut indices, "
                                  f"got {excerpt(points)}")
        attrs["slice_point"] = points
    ys = b.tops()
    if points is not None and len(ys) != len(points) + 1:
        b.fail("top", f"{len(points)} slice_point(s) make {len(points) + 1} tops, got {len(ys)}")
    attrs["n_outputs"] = len(ys)
    b.op("Slice", [x], ys, attrs)


@layer("eltwise", keys=(
    Key("operation", ("sum", "prod", "max"), "sum", "element-wise sum, product or maximum"),
    Key("coeff", "numbers", None, "sum only: one coefficient per bottom (default all 1)",
        FINITE)))
def eltwise(b):
    """Element-wise combination of bottoms of one shape (a residual sum)."""
    xs = b.bottoms()
    attrs = {"operation": b.get("operation")}
    coeff = b.get("coeff")
    if coeff is not None:
        attrs["coeff"] = [float(c) for c in coeff]
    (y,) = b.tops(1)
    b.op("Eltwise", xs, [y], attrs)


@layer("split")
def split(b):
    """Copy the bottom to several tops (their gradients are summed)."""
    (x,) = b.bottoms(1)
    ys = b.tops()
    b.op("Split", [x], ys, {"n_outputs": len(ys)})


def _axis(b, x, what="an input"):
    """The layer's ``axis`` of blob ``x`` counted from 0 (Caffe's: a negative
    axis counts from the end), or exit 2 naming the key."""
    axis, ndim = b.get("axis"), len(b.shape(x))
    if not -ndim <= axis < ndim:
        b.fail("axis", f"expected an axis in -{ndim}..{ndim - 1} for {what} of shape "
                       f"{list(b.shape(x))}, got {axis}")
    return axis % ndim


def _class_axis(b, x):
    """The op attrs of the layer's class ``axis`` over scores ``x``: {} for
    Caffe's default 1, else {"axis": the axis counted from 0}."""
    axis = _axis(b, x, "scores")
    return {"axis": axis} if axis != 1 else {}


@layer("softmax_loss", "softmaxwithloss", "softmax_with_loss", keys=(
    Key("axis", "int", 1, "the class axis (Caffe's): 1 for (N, C, ...) scores; -1 for (N, T, V) "
                          "logits with (N, T) labels, the token-level loss: the mean over every "
                          "position, in nats per token", Range(note="an axis of the scores")),
    Key("ignore_label", "nonneg", None, "a label value that adds no loss (excluded from the "
                                        "mean)"),
    Key("normalization", ("valid", "batch_size", "full", "none"), "valid",
        "Caffe's loss normalization, what the sum of the positions' losses is divided by: "
        "valid: the counted positions; batch_size: the samples (the scores' axes before "
        "`axis`); full: all positions; none: 1. Other than valid only without ignore_label"),
    Key("loss_weight", "number", 1.0, "weight of this loss in the total", NON_NEGATIVE)))
def softmax_loss(b):
    """Softmax cross-entropy (natural log: nats); bottoms [scores, label]; the mean over the
    counted positions (or as `normalization` says)."""
    x, label = b.bottoms(2)
    (loss,) = b.tops(1)
    attrs = _class_axis(b, x)
    ignore = b.get("ignore_label")
    if ignore is not None:
        attrs["ignore_label"] = ignore
    norm = b.get("normalization")
    if norm != "valid" and ignore is not None:
        b.fail("normalization", f"normalization {norm} with ignore_label is not supported "
                                "(valid divides by the counted positions)")
    # without ignored positions every normalization is the mean's static multiple
    shape, axis = b.shape(x), attrs.get("axis", 1)
    outer = inner = 1
    for s in shape[:axis]:
        outer *= s
    for s in shape[axis + 1:]:
        inner *= s
    scale = {"valid": 1, "full": 1, "batch_size": inner, "none": outer * inner}[norm]
    mean = b.graph.free_name(f"{b.cfg['name']}.mean") if scale != 1 else loss
    b.op("SoftmaxLoss", [x, label], [mean, f"{b.cfg['name']}.prob"], attrs)
    if mean != loss:
        b.op("Scale", [mean], [loss], {"scale": float(scale)}, tag="norm")
    b.graph.blobs[loss].attrs["loss_weight"] = float(b.get("loss_weight"))


@layer("accuracy", keys=(
    Key("top_k", "posint", 1, "a sample counts as right when its label is among the k best "
                              "scores; below the number of classes (or 1)"),
    Key("axis", "int", 1, "the class axis, as softmax_loss's (-1: the next-token accuracy "
                          "of (N, T, V) logits over every position)",
        Range(note="an axis of the scores")),
    Key("ignore_label", "nonneg", None, "a label value that is not counted (excluded from the "
                                        "mean; Caffe's), e.g. the softmax_loss's")))
def accuracy(b):
    """Top-k accuracy; bottoms [scores, label]; a non-finite score counts as wrong."""
    x, label = b.bottoms(2)
    (acc,) = b.tops(1)
    attrs = dict(_class_axis(b, x), top_k=b.get("top_k"))
    classes = b.shape(x)[attrs.get("axis", 1)]
    # Caffe refuses k > C; k = C > 1 counts every finite sample right as well
    if attrs["top_k"] > 1 and attrs["top_k"] >= classes:
        b.fail("top_k", f"expected a top_k below the {classes} classes of the scores "
                        f"{list(b.shape(x))} (with k >= the classes every sample counts as "
                        f"right: accuracy 1), got {attrs['top_k']}")
    ignore = b.get("ignore_label")
    if ignore is not None:
        attrs["ignore_label"] = ignore
    b.op("Accuracy", [x, label], [acc], attrs)
    b.graph.blobs[acc].attrs["metric"] = True
