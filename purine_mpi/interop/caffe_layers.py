"""Caffe layer types -> our layer entries: one handler per type.

A handler ``fn(converter, layer, entry, extra)`` fills ``entry`` (already
holding name, bottom, top, phase) from the Caffe layer's ``*_param``
message, failing through ``converter.fail`` with the line at fault. Caffe's
defaults are written out where ours differ (fillers, LRN alpha, pooling's
ceil rounding).
"""

DATA_TYPES = ("Data", "HDF5Data", "ImageData")


def window(conv, layer, fail, name, default, plural_ok=True):
    """Caffe's kernel/stride/pad spellings -> int or [h, w]."""
    h, w = conv.get(f"{name}_h"), conv.get(f"{name}_w")
    values = conv.all(name if name != "kernel" else "kernel_size")
    if h is not None or w is not None:
        if values:
            fail(conv.line_of(f"{name}_h"), layer, f"give {name}_h/{name}_w or the plain "
                                                   f"form, not both")
        if h is None or w is None:
            fail(conv.line_of(f"{name}_h" if h is not None else f"{name}_w"), layer,
                 f"{name}_h and {name}_w come together")
        return [h, w] if h != w else h
    if not values:
        return default
    if len(values) == 1:
        return values[0]
    if len(values) == 2 and plural_ok:
        return values if values[0] != values[1] else values[0]
    fail(conv.line_of(name), layer, f"{len(values)} values of {name} for a 2-D layer")


# ------------------------------------------------------------ layer table
def _conv(c, layer, e, _):
    c.check_only(layer, "convolution_param", ("convolution_param",))
    p = c.sub(layer, "convolution_param")
    if not p.has("num_output"):
        c.fail(layer.line, layer, "convolution_param needs num_output")
    kernel = window(p, layer, c.fail, "kernel", None)
    if kernel is None:
        c.fail(p.line, layer, "convolution_param needs kernel_size (or kernel_h and kernel_w)")
    dilation = p.all("dilation")
    if len(dilation) > 2:
        c.fail(p.line_of("dilation"), layer, "at most 2 dilation values for a 2-D convolution")
    e.update(type="conv", num_output=p.get("num_output"), kernel=kernel,
             stride=window(p, layer, c.fail, "stride", 1), pad=window(p, layer, c.fail, "pad", 0))
    if dilation:
        e["dilation"] = dilation[0] if len(set(dilation)) == 1 else dilation
    if p.get("group", 1) != 1:
        e["group"] = p.get("group")
    e["bias_term"] = p.get("bias_term", True)
    e["weight_filler"] = c.filler(layer, p.get("weight_filler"))
    if e["bias_term"]:
        e["bias_filler"] = c.filler(layer, p.get("bias_filler"))
    c.param_mults(layer, e, 2 if e["bias_term"] else 1)


def _pool(c, layer, e, _):
    c.check_only(layer, "pooling_param", ("pooling_param",))
    p = c.sub(layer, "pooling_param")
    kind = p.get("pool", "MAX")
    if kind == "STOCHASTIC":
        c.fail(p.line_of("pool"), layer, "STOCHASTIC pooling is not supported (MAX, AVE are)")
    e.update(type="pool", pool="max" if kind == "MAX" else "ave",
             stride=window(p, layer, c.fail, "stride", 1, False),
             pad=window(p, layer, c.fail, "pad", 0, False),
             ceil_mode=p.get("round_mode", "CEIL") == "CEIL")
    if p.get("global_pooling", False):
        e["global"] = True
        if p.has("kernel_size") or p.has("kernel_h"):
            c.fail(p.line_of("kernel_size"), layer, "global_pooling takes no kernel size")
    else:
        kernel = window(p, layer, c.fail, "kernel", None, False)
        if kernel is None:
            c.fail(p.line, layer, "pooling_param needs kernel_size (or kernel_h and kernel_w, "
                                  "or global_pooling: true)")
        e["kernel"] = kernel


def _fc(c, layer, e, _):
    c.check_only(layer, "inner_product_param", ("inner_product_param",))
    p = c.sub(layer, "inner_product_param")
    if not p.has("num_output"):
        c.fail(layer.line, layer, "inner_product_param needs num_output")
    if p.get("transpose", False):
        c.fail(p.line_of("transpose"), layer, "only transpose false is supported")
    e.update(type="fc", num_output=p.get("num_output"), bias_term=p.get("bias_term", True),
             weight_filler=c.filler(layer, p.get("weight_filler")))
    if p.get("axis", 1) != 1:  # our fc's axis is Caffe's (a negative one counts from the end)
        e["axis"] = p.get("axis")
    if e["bias_term"]:
        e["bias_filler"] = c.filler(layer, p.get("bias_filler"))
    c.param_mults(layer, e, 2 if e["bias_term"] else 1)


def _simple(our_type, field=None, convert=None):
    def fn(c, layer, e, _):
        c.check_only(layer, field, (field,) if field else ())
        e["type"] = our_type
        if convert is not None:
            convert(c, layer, c.sub(layer, field), e)
    return fn


def _relu(c, layer, p, e):
    if p.get("negative_slope", 0.0):
        e["negative_slope"] = p.get("negative_slope")


def _lrn(c, layer, p, e):
    region = p.get("norm_region", "ACROSS_CHANNELS")
    if region not in ("ACROSS_CHANNELS", "WITHIN_CHANNEL"):
        c.fail(p.line_of("norm_region"), layer, f"norm_region {region} is not supported: "
               "ACROSS_CHANNELS or WITHIN_CHANNEL")
    e.update(local_size=p.get("local_size", 5), alpha=p.get("alpha", 1.0),
             beta=p.get("beta", 0.75), k=p.get("k", 1.0))
    if region == "WITHIN_CHANNEL":  # Caffe adds 1 there, whatever its k says
        e.update(norm_region="within_channel", k=1.0)


def _dropout(c, layer, p, e):
    e["ratio"] = p.get("dropout_ratio", 0.5)


def _concat(c, layer, p, e):
    e["axis"] = p.get("axis", p.get("concat_dim", 1))


def _slice(c, layer, p, e):
    e["axis"] = p.get("axis", p.get("slice_dim", 1))
    if p.all("slice_point"):
        e["slice_point"] = p.all("slice_point")


def _eltwise(c, layer, p, e):
    e["operation"] = p.get("operation", "SUM").lower()
    if p.all("coeff"):
        if e["operation"] != "sum":
            c.fail(p.line_of("coeff"), layer, "coeff applies to operation SUM only")
        if len(p.all("coeff")) != len(layer.bottoms):
            c.fail(p.line_of("coeff"), layer, f"{len(p.all('coeff'))} coeff values for "
                                              f"{len(layer.bottoms)} bottoms")
        e["coeff"] = p.all("coeff")


def _softmax(c, layer, p, e):
    if p.get("axis", 1) != 1:
        e["axis"] = p.get("axis")


def _accuracy(c, layer, p, e):
    if p.get("axis", 1) != 1:
        e["axis"] = p.get("axis")
    e["top_k"] = p.get("top_k", 1)
    if p.has("ignore_label"):
        e["ignore_label"] = p.get("ignore_label")


def _flatten(c, layer, p, e):
    if p.get("end_axis", -1) != -1:
        c.fail(p.line_of("end_axis"), layer, "only end_axis -1 is supported")
    if p.get("axis", 1) != 1:
        e["axis"] = p.get("axis")


def _reshape(c, layer, p, e):
    if p.get("axis", 0) != 0 or p.get("num_axes", -1) != -1:
        c.fail(p.line, layer, "only the whole-shape form (axis 0, num_axes -1) is supported")
    if p.get("shape") is None:
        c.fail(p.line, layer, "reshape_param needs shape { dim: ... }")
    e["shape"] = p.get("shape").all("dim")


def _loss(c, layer, e, _):
    c.check_only(layer, None, ("loss_param", "softmax_param"))
    e["type"] = "softmax_loss"
    p = c.sub(layer, "loss_param")
    if p.get("normalization", "VALID") not in ("VALID", "BATCH_SIZE") or \
            not p.get("normalize", True):
        c.fail(p.line, layer, "only VALID (Caffe's default) or BATCH_SIZE normalization")
    if p.get("normalization") == "BATCH_SIZE" and p.has("ignore_label"):
        c.fail(p.line, layer, "BATCH_SIZE normalization with ignore_label is not supported")
    if p.get("normalization") == "BATCH_SIZE":  # the sum over a sample's positions
        e["normalization"] = "batch_size"
    if p.has("ignore_label"):
        e["ignore_label"] = p.get("ignore_label")
    if c.sub(layer, "softmax_param").get("axis", 1) != 1:
        e["axis"] = c.sub(layer, "softmax_param").get("axis")
    weights = layer.msg.all("loss_weight")
    if weights:
        e["loss_weight"] = weights[0]


def _batchnorm(c, layer, e, scale):
    c.check_only(layer, "batch_norm_param", ("batch_norm_param",))
    p = c.sub(layer, "batch_norm_param")
    if p.has("use_global_stats") and p.get("use_global_stats") != (layer.phase == "test"):
        c.fail(p.line_of("use_global_stats"), layer, "use_global_stats is supported only as "
                                                     "Caffe's default (false in training, true "
                                                     "in testing)")
    e.update(type="batch_norm", eps=p.get("eps", 1e-5),
             moving_average_fraction=p.get("moving_average_fraction", 0.999))
    if scale is None:  # Caffe's BatchNorm has no affine part
        e["param"] = [{"lr_mult": 0.0, "decay_mult": 0.0}] * 2
        c.notes.append(f"{layer.where()} (line {layer.line}) has no Scale layer after it: "
                       "gamma stays 1 and beta 0")
        return
    s = c.sub(scale, "scale_param")
    c.check_only(scale, "scale_param", ("scale_param",))
    if s.get("axis", 1) != 1 or s.get("num_axes", 1) != 1:
        c.fail(s.line, scale, "only a per-channel scale (axis 1, num_axes 1) is supported")
    e["top"] = scale.tops[0] if scale.tops else e.get("top")
    e["weight_filler"] = c.filler(scale, s.get("filler"), 1.0)
    e["bias_filler"] = c.filler(scale, s.get("bias_filler"))
    c.param_mults(scale, e, 2)
    mults = e.get("param", [])
    mults += [{"lr_mult": 1.0, "decay_mult": 1.0}] * (2 - len(mults))
    if not s.get("bias_term", False):
        mults[1] = {"lr_mult": 0.0, "decay_mult": 0.0}  # beta stays 0
    e["param"] = mults
    c.notes.append(f"{layer.where()} and {scale.where()} (lines {layer.line}, {scale.line}) "
                   f"are one batch_norm layer '{layer.name}'")


LAYERS = {
    "Convolution": _conv, "Pooling": _pool, "InnerProduct": _fc,
    "ReLU": _simple("relu", "relu_param", _relu), "Sigmoid": _simple("sigmoid", "sigmoid_param"),
    "TanH": _simple("tanh", "tanh_param"), "LRN": _simple("lrn", "lrn_param", _lrn),
    "Dropout": _simple("dropout", "dropout_param", _dropout),
    "Concat": _simple("concat", "concat_param", _concat),
    "Split": _simple("split"), "Slice": _simple("slice", "slice_param", _slice),
    "Eltwise": _simple("eltwise", "eltwise_param", _eltwise),
    "Softmax": _simple("softmax", "softmax_param", _softmax),
    "SoftmaxWithLoss": _loss,
    "Accuracy": _simple("accuracy", "accuracy_param", _accuracy),
    "BatchNorm": _batchnorm, "Flatten": _simple("flatten", "flatten_param", _flatten),
    "Reshape": _simple("reshape", "reshape_param", _reshape),
}
SUPPORTED = set(LAYERS) | set(DATA_TYPES) | {"Scale"}
