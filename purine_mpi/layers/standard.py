"""The standard layer set. Each function reads its config fields and emits
the forward ops; backward comes from the gradient rules of those ops."""
from . import layer

XAVIER = {"type": "xavier"}
ZERO = {"type": "constant", "value": 0.0}


def _pair(v):
    return [v, v] if isinstance(v, int) else list(v)


def _filler(b, key, default):
    f = b.get(key, default)
    if not isinstance(f, dict) or f.get("type") not in ("constant", "xavier", "gaussian",
                                                          "msra", "uniform"):
        b.fail(key, "expected a filler such as {type: xavier}, {type: gaussian, std: 0.01}, "
                    f"{{type: msra}}, {{type: uniform, min: -a, max: a}}, or {{type: constant, "
                    f"value: 0}}; got {f!r}")
    return f


@layer("conv", "convolution")
def conv(b):
    (x,) = b.bottoms(1)
    (y,) = b.tops(1)
    num_output = b.get("num_output", required=True, kind="posint")
    kernel = _pair(b.get("kernel", required=True, kind="pair"))
    group = b.get("group", 1, kind="posint")
    attrs = {"stride": _pair(b.get("stride", 1, kind="pair")),
             "pad": _pair(b.get("pad", 0, kind="pair")),
             "dilation": _pair(b.get("dilation", 1, kind="pair")), "group": group}
    shape = b.shape(x)
    if len(shape) != 4:
        b.fail("bottom", f"conv needs a 4-D N×C×H×W input, '{x}' is {list(shape)}")
    if shape[1] % group or num_output % group:
        b.fail("group", f"group {group} must divide the input channels ({shape[1]}) and "
                        f"num_output ({num_output})")
    w = b.param("weight", (num_output, shape[1] // group, *kernel),
                _filler(b, "weight_filler", XAVIER), 0)
    inputs = [x, w]
    if b.get("bias_term", True, kind="bool"):
        inputs.append(b.param("bias", (num_output,), _filler(b, "bias_filler", ZERO), 1))
    b.op("Conv", inputs, [y], attrs)


@layer("fc", "inner_product", "innerproduct")
def fc(b):
    (x,) = b.bottoms(1)
    (y,) = b.tops(1)
    num_output = b.get("num_output", required=True, kind="posint")
    shape = b.shape(x)
    fan_in = 1
    for s in shape[1:]:
        fan_in *= s
    w = b.param("weight", (num_output, fan_in), _filler(b, "weight_filler", XAVIER), 0)
    inputs = [x, w]
    if b.get("bias_term", True, kind="bool"):
        inputs.append(b.param("bias", (num_output,), _filler(b, "bias_filler", ZERO), 1))
    b.op("InnerProduct", inputs, [y])


def _simple(op_type, **fields):
    def fn(b):
        (x,) = b.bottoms(1)
        attrs = {k: b.get(k, d, kind=kind) for k, (d, kind) in fields.items()}
        (y,) = b.tops(1)
        b.op(op_type, [x], [y], attrs)
    return fn


layer("relu")(_simple("Relu", negative_slope=(0.0, "number")))
layer("sigmoid")(_simple("Sigmoid"))
layer("tanh")(_simple("Tanh"))
layer("softmax")(_simple("Softmax", axis=(1, "nonneg")))
layer("flatten")(_simple("Flatten"))


@layer("reshape")
def reshape(b):
    (x,) = b.bottoms(1)
    shape = b.get("shape", required=True)
    if not isinstance(shape, list) or not all(isinstance(s, int) for s in shape):
        b.fail("shape", f"expected a list of integers (0 copies a dim, -1 infers), got {shape!r}")
    (y,) = b.tops(1)
    b.op("Reshape", [x], [y], {"shape": shape})


@layer("pool", "pooling")
def pool(b):
    (x,) = b.bottoms(1)
    kind = b.get("pool", "max", kind=("max", "ave", "avg", "average"))
    kind = "max" if kind == "max" else "ave"
    is_global = b.get("global", False, kind="bool") or b.get("global_pooling", False, kind="bool")
    attrs = {"pool": kind, "global": is_global,
             "stride": _pair(b.get("stride", 1, kind="pair")),
             "pad": _pair(b.get("pad", 0, kind="pair")),
             "ceil_mode": b.get("ceil_mode", False, kind="bool")}
    if not is_global:
        attrs["kernel"] = _pair(b.get("kernel", required=True, kind="pair"))
    (y,) = b.tops(1)
    outs = [y, f"{b.cfg['name']}.mask"] if kind == "max" else [y]
    b.op("Pool", [x], outs, attrs)


@layer("global_pool", "global_ave_pool")
def global_pool(b):
    (x,) = b.bottoms(1)
    (y,) = b.tops(1)
    b.op("Pool", [x], [y], {"pool": "ave", "global": True, "stride": [1, 1], "pad": [0, 0],
                            "ceil_mode": False})


@layer("lrn")
def lrn(b):
    (x,) = b.bottoms(1)
    attrs = {"local_size": b.get("local_size", 5, kind="posint"),
             "alpha": float(b.get("alpha", 1e-4, kind="number")),
             "beta": float(b.get("beta", 0.75, kind="number")),
             "k": float(b.get("k", 1.0, kind="number"))}
    (y,) = b.tops(1)
    b.op("LRN", [x], [y, f"{b.cfg['name']}.scale"], attrs)


@layer("dropout")
def dropout(b):
    (x,) = b.bottoms(1)
    ratio = float(b.get("ratio", b.get("dropout_ratio", 0.5), kind="number"))
    if not 0.0 <= ratio < 1.0:
        b.fail("ratio", f"expected 0 <= ratio < 1, got {ratio}")
    (y,) = b.tops(1)
    if b.phase == "train":
        b.op("Dropout", [x], [y, f"{b.cfg['name']}.mask"], {"ratio": ratio, "phase": "train"})
    else:
        b.op("Dropout", [x], [y], {"ratio": ratio, "phase": "test"})


@layer("batch_norm", "batchnorm", "bn")
def batch_norm(b):
    (x,) = b.bottoms(1)
    shape = b.shape(x)
    c = (shape[1],)
    gamma = b.param("weight", c, _filler(b, "weight_filler", {"type": "constant", "value": 1.0}),
                    0)
    beta = b.param("bias", c, _filler(b, "bias_filler", ZERO), 1)
    mean = b.state("running_mean", c, 0.0)
    var = b.state("running_var", c, 1.0)
    attrs = {"eps": float(b.get("eps", 1e-5, kind="number")),
             "momentum": float(b.get("momentum", 0.1, kind="number"))}
    if "moving_average_fraction" in b.cfg:  # Caffe's running average (ops/batchnorm.py)
        maf = float(b.get("moving_average_fraction", kind="number"))
        if not 0.0 <= maf <= 1.0:
            b.fail("moving_average_fraction", f"expected a number in [0, 1], got {maf}")
        attrs["moving_average_fraction"] = maf
    (y,) = b.tops(1)
    name = b.cfg["name"]
    if b.phase == "train":
        g = b.graph
        g.add_blob(f"{mean}@new", c, alias_of=mean, kind="state")
        g.add_blob(f"{var}@new", c, alias_of=var, kind="state")
        b.op("BatchNorm", [x, gamma, beta, mean, var],
             [y, f"{name}.saved_mean", f"{name}.saved_invstd", f"{mean}@new", f"{var}@new"],
             dict(attrs, phase="train"))
    else:
        b.op("BatchNorm", [x, gamma, beta, mean, var], [y], dict(attrs, phase="test"))


@layer("concat")
def concat(b):
    xs = b.bottoms()
    (y,) = b.tops(1)
    b.op("Concat", xs, [y], {"axis": b.get("axis", 1, kind="nonneg")})


@layer("slice")
def slice_(b):
    (x,) = b.bottoms(1)
    attrs = {"axis": b.get("axis", 1, kind="nonneg")}
    points = b.get("slice_point")
    if points is not None:
        if not isinstance(points, list) or not all(isinstance(p, int) and p > 0 for p in points) \
                or any(q <= p for p, q in zip(points, points[1:])):
            b.fail("slice_point", f"expected an increasing list of positive cut indices, "
                                  f"got {points!r}")
        attrs["slice_point"] = points
    ys = b.tops()
    if points is not None and len(ys) != len(points) + 1:
        b.fail("top", f"{len(points)} slice_point(s) make {len(points) + 1} tops, got {len(ys)}")
    attrs["n_outputs"] = len(ys)
    b.op("Slice", [x], ys, attrs)


@layer("eltwise")
def eltwise(b):
    xs = b.bottoms()
    attrs = {"operation": b.get("operation", "sum", kind=("sum", "prod", "max"))}
    if "coeff" in b.cfg:
        attrs["coeff"] = [float(c) for c in b.get("coeff")]
    (y,) = b.tops(1)
    b.op("Eltwise", xs, [y], attrs)


@layer("split")
def split(b):
    (x,) = b.bottoms(1)
    ys = b.tops()
    b.op("Split", [x], ys, {"n_outputs": len(ys)})


@layer("softmax_loss", "softmaxwithloss", "softmax_with_loss")
def softmax_loss(b):
    x, label = b.bottoms(2)
    (loss,) = b.tops(1)
    attrs = {}
    if "ignore_label" in b.cfg:
        attrs["ignore_label"] = b.get("ignore_label", kind="nonneg")
    b.op("SoftmaxLoss", [x, label], [loss, f"{b.cfg['name']}.prob"], attrs)
    b.graph.blobs[loss].attrs["loss_weight"] = float(b.get("loss_weight", 1.0, kind="number"))


@layer("accuracy")
def accuracy(b):
    x, label = b.bottoms(2)
    (acc,) = b.tops(1)
    b.op("Accuracy", [x, label], [acc], {"top_k": b.get("top_k", 1, kind="posint")})
    b.graph.blobs[acc].attrs["metric"] = True
