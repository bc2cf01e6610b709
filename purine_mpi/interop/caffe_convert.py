"""Caffe net (+ solver) prototxt -> our job config (``convert caffe``).

``convert(net_path, solver_path=None, data_path=None)`` returns
``(config, notes)``: the config mapping, ready to write as YAML, and notes
on what was ignored. Every problem is a ``PrototxtError`` naming the file,
the line, the layer and its type.

Semantics kept exact:
- Caffe's pooling rounds up (``ceil_mode: true``; ``round_mode: FLOOR`` keeps floor).
- In-place layers (top == bottom) keep Caffe's meaning: our layers version the blob.
- ``BatchNorm`` followed by a ``Scale`` reading its top becomes one
  ``batch_norm`` layer (the Scale's gamma/beta are its weight/bias); a
  ``BatchNorm`` alone keeps gamma = 1, beta = 0 (learning rate 0). Its
  running averages are Caffe's (``moving_average_fraction``).
- Fillers are written out with Caffe's defaults (a missing filler is
  Caffe's ``constant`` 0).
- Data layers (Data, HDF5Data, ImageData) become the HDF5 source at
  ``data_path`` (split train / test by the layer's phase); their tops are
  renamed to our ``data`` / ``label`` blobs; ``transform_param`` becomes the
  source's scale / mean / mirror / crop_size.
"""
import os

from .caffe_schema import PHASES, TEXT_SCHEMA, V1_TYPES
from .prototxt import PrototxtError, parse_file

DATA_TYPES = ("Data", "HDF5Data", "ImageData")
FILLER_TYPES = ("constant", "gaussian", "xavier", "msra", "uniform")
LR_POLICIES = ("fixed", "step", "multistep", "poly", "exp", "inv")


class _Layer:
    """One Caffe layer of the file: type, name, bottoms, tops, phase, line."""

    def __init__(self, msg, v1):
        self.msg, self.line, self.v1 = msg, msg.line, v1
        raw_type = msg.get("type")
        self.type = V1_TYPES.get(raw_type, raw_type) if v1 else raw_type
        self.name = msg.get("name") or f"{self.type}@{self.line}"
        self.bottoms, self.tops = msg.all("bottom"), msg.all("top")
        self.phase = _phase(msg)

    def where(self):
        return f"layer '{self.name}' (type {self.type})"


def _phase(msg):
    include = [rule.get("phase") for rule in msg.all("include") if rule.has("phase")]
    exclude = [rule.get("phase") for rule in msg.all("exclude") if rule.has("phase")]
    if msg.has("phase"):
        include.append(msg.get("phase"))
    phases = set(include or PHASES) - set(exclude)
    if len(phases) == 2:
        return None
    if not phases:
        return "never"
    return phases.pop().lower()


class Converter:
    def __init__(self, path, data_path):
        self.path, self.data_path = path, data_path
        self.notes, self.data, self.net = [], {}, []
        self.rename = {}
        self.source = {}  # our layer name -> the Caffe layer it came from

    def fail(self, line, layer, message):
        where = f"{layer.where()}: " if layer is not None else ""
        raise PrototxtError(self.path, line, f"{where}{message}")

    # -------------------------------------------------------------- net
    def convert_net(self, net):
        layers = [_Layer(m, False) for m in net.all("layer")] + \
                 [_Layer(m, True) for m in net.all("layers")]
        if not layers:
            raise PrototxtError(self.path, None, "the net has no 'layer { }' entries")
        layers = [layer for layer in layers if layer.phase != "never"]
        check_graph(layers, self.path)
        seen = {}
        for layer in layers:
            if layer.type in DATA_TYPES:
                continue
            other = seen.get(layer.name)
            if other is not None:
                self.fail(layer.line, layer, f"the layer name is also used on line {other.line}; "
                                             "layer names must be unique")
            seen[layer.name] = layer
        scale_of = self._batchnorm_scales(layers)
        fused = {id(scale) for scale in scale_of.values()}
        for layer in layers:
            if layer.type in DATA_TYPES:
                self.data_layer(layer)
            elif id(layer) in fused:
                continue
            else:
                handler = _LAYERS.get(layer.type)
                if handler is None:
                    self.fail(layer.line, layer, f"layer type '{layer.type}' is not supported "
                                                 f"(supported: {', '.join(sorted(_SUPPORTED))})")
                entry = {"type": None, "name": layer.name}
                bottoms = [self.rename.get(b, b) for b in layer.bottoms]
                if bottoms:
                    entry["bottom"] = bottoms[0] if len(bottoms) == 1 else bottoms
                if layer.tops:
                    entry["top"] = layer.tops[0] if len(layer.tops) == 1 else list(layer.tops)
                if layer.phase:
                    entry["phase"] = layer.phase
                handler(self, layer, entry, scale_of.get(id(layer)))
                self.net.append(entry)
                self.source[layer.name] = layer
        if not self.net:
            raise PrototxtError(self.path, None, "the net has only data layers")
        return self.net

    def _batchnorm_scales(self, layers):
        """{id(BatchNorm layer): the Scale layer that reads its top next}."""
        out = {}
        for i, layer in enumerate(layers):
            if layer.type != "Scale":
                continue
            prev = next((p for p in reversed(layers[:i]) if set(p.tops) & set(layer.bottoms)),
                        None)
            if prev is None or prev.type != "BatchNorm" or len(layer.bottoms) != 1 \
                    or prev.phase != layer.phase:
                self.fail(layer.line, layer, "a Scale layer is supported only right after a "
                                             "BatchNorm layer, reading its top (the pair is "
                                             "one batch_norm layer here)")
            out[id(prev)] = layer
        return out

    def data_layer(self, layer):
        kind = {"Data": "data_param", "HDF5Data": "hdf5_data_param",
                "ImageData": "image_data_param"}[layer.type]
        param = layer.msg.get(kind)
        if param is None or not param.has("batch_size"):
            self.fail(layer.line, layer, f"needs {kind} {{ batch_size: N }}")
        if self.data_path is None:
            self.fail(layer.line, layer, "data layers read our HDF5 data file: give --data "
                                         "DATA.h5 (e.g. from 'python -m purine_mpi data digits')")
        phases = [layer.phase] if layer.phase else ["train", "test"]
        spec = {"source": "hdf5", "path": self.data_path, "batch_size": param.get("batch_size")}
        spec["shuffle"] = bool(param.get("shuffle", False))
        transform = layer.msg.get("transform_param")
        for src in (param, transform):  # old nets put the transform in data_param
            if src is None:
                continue
            if src.has("scale"):
                spec["scale"] = src.get("scale")
            if src.has("mirror"):
                spec["mirror"] = src.get("mirror")
            if src.get("crop_size", 0):
                spec["crop_size"] = src.get("crop_size")
            means = src.all("mean_value") if src is transform else []
            if means:
                spec["mean"] = means[0] if len(means) == 1 else means
        tops = layer.tops
        if not 1 <= len(tops) <= 2:
            self.fail(layer.line, layer, f"expected tops [data, label], got {tops}")
        for ours, theirs in zip(("data", "label"), tops):
            if ours != theirs:
                self.rename[theirs] = ours
        for phase in phases:
            if phase in self.data:
                self.fail(layer.line, layer, f"a second data layer for the {phase} phase")
            self.data[phase] = dict(spec, split=phase)
        self.notes.append(f"{layer.where()} (line {layer.line}) reads {self.data_path} "
                          f"(split {' and '.join(phases)}); its source "
                          f"{param.get('source', '')!r} is not used")

    # ------------------------------------------------------------ helpers
    def param_mults(self, layer, entry, count):
        specs = layer.msg.all("param")
        if layer.v1:
            lrs, decays = layer.msg.all("blobs_lr"), layer.msg.all("weight_decay")
            specs = None
            out = [{"lr_mult": float(lrs[i]) if i < len(lrs) else 1.0,
                    "decay_mult": float(decays[i]) if i < len(decays) else 1.0}
                   for i in range(max(len(lrs), len(decays)))]
        else:
            out = [{"lr_mult": s.get("lr_mult", 1.0), "decay_mult": s.get("decay_mult", 1.0)}
                   for s in specs]
        if len(out) > count:
            self.fail(layer.line, layer, f"{len(out)} param {{ }} entries for {count} blob(s)")
        if out:
            entry["param"] = out

    def filler(self, layer, msg, default_value=0.0):
        if msg is None:
            return {"type": "constant", "value": default_value}
        kind = msg.get("type", "constant")
        if kind not in FILLER_TYPES:
            self.fail(msg.line, layer, f"filler type '{kind}' is not supported (supported: "
                                       f"{', '.join(FILLER_TYPES)})")
        if msg.get("variance_norm", "FAN_IN") != "FAN_IN":
            self.fail(msg.line_of("variance_norm"), layer, "only variance_norm FAN_IN (Caffe's "
                                                           "default) is supported")
        if kind == "constant":
            return {"type": "constant", "value": msg.get("value", 0.0)}
        if kind == "gaussian":
            return {"type": "gaussian", "mean": msg.get("mean", 0.0), "std": msg.get("std", 1.0)}
        if kind == "uniform":
            return {"type": "uniform", "min": msg.get("min", 0.0), "max": msg.get("max", 1.0)}
        return {"type": kind}

    def sub(self, layer, field):
        """The layer's ``*_param`` message (an empty one when absent)."""
        msg = layer.msg.get(field)
        if msg is None:
            from .prototxt import Message
            msg = Message(TEXT_SCHEMA[layer.msg.type_name][field], layer.line)
        return msg

    def check_only(self, layer, field, allowed):
        """Fail on any ``*_param`` other than ``field`` (e.g. pooling_param on a conv)."""
        for f in layer.msg.fields:
            if f.name.endswith("_param") and f.name not in allowed:
                self.fail(f.line, layer, f"'{f.name}' does not apply to a {layer.type} layer")


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
    if p.get("axis", 1) != 1 or p.get("transpose", False):
        c.fail(p.line, layer, "only axis 1 and transpose false are supported")
    e.update(type="fc", num_output=p.get("num_output"), bias_term=p.get("bias_term", True),
             weight_filler=c.filler(layer, p.get("weight_filler")))
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
    if p.get("norm_region", "ACROSS_CHANNELS") != "ACROSS_CHANNELS":
        c.fail(p.line_of("norm_region"), layer, "only norm_region ACROSS_CHANNELS is supported")
    e.update(local_size=p.get("local_size", 5), alpha=p.get("alpha", 1.0),
             beta=p.get("beta", 0.75), k=p.get("k", 1.0))


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
    if p.get("axis", 1) != 1 or p.has("ignore_label"):
        c.fail(p.line, layer, "accuracy supports top_k only (axis 1, no ignore_label)")
    e["top_k"] = p.get("top_k", 1)


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
    if p.has("ignore_label"):
        e["ignore_label"] = p.get("ignore_label")
    if c.sub(layer, "softmax_param").get("axis", 1) != 1:
        c.fail(layer.line, layer, "softmax axis other than 1")
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


_LAYERS = {
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
_SUPPORTED = set(_LAYERS) | set(DATA_TYPES) | {"Scale"}


# ------------------------------------------------------------- structure
def check_graph(layers, path):
    """Per phase: every bottom is produced by an earlier layer (Caffe's
    rule); a bottom produced only later is a cycle or out-of-order layers,
    and a cycle is named layer by layer."""
    for phase in ("train", "test"):
        active = [layer for layer in layers if layer.phase in (None, phase)]
        producers = {}
        for layer in active:
            for top in layer.tops:
                producers.setdefault(top, []).append(layer)
        seen = set()
        for layer in active:
            for bottom in layer.bottoms:
                if bottom in seen:
                    continue
                later = [p for p in producers.get(bottom, []) if p is not layer]
                if not later:
                    raise PrototxtError(path, layer.line, f"{layer.where()}: bottom '{bottom}' "
                                                          f"is produced by no layer "
                                                          f"(phase {phase})")
                cycle = _find_cycle(layer, producers)
                if cycle:
                    names = " -> ".join(f"'{x.name}' (line {x.line})" for x in cycle)
                    raise PrototxtError(path, layer.line, f"the layers form a cycle: {names}")
                raise PrototxtError(path, layer.line, f"{layer.where()}: bottom '{bottom}' is "
                                                      f"produced only by the later layer "
                                                      f"'{later[0].name}' (line {later[0].line});"
                                                      " Caffe needs producers first")
            seen.update(layer.tops)


def _find_cycle(start, producers):
    """A list of layers start -> ... -> start where each reads the next one's top."""
    stack = [(start, [start])]
    visited = set()
    while stack:
        layer, trail = stack.pop()
        for bottom in layer.bottoms:
            for producer in producers.get(bottom, []):
                if producer is layer and bottom in layer.bottoms and bottom in layer.tops:
                    continue  # in place
                if producer is start:
                    return trail + [start]
                if id(producer) not in visited:
                    visited.add(id(producer))
                    stack.append((producer, trail + [producer]))
    return None


# ----------------------------------------------------------------- solver
def convert_solver(msg, path, notes):
    """(solver section, checkpoint section, seed or None) of a SolverParameter."""
    def fail(field, message):
        raise PrototxtError(path, msg.line_of(field), message)

    kind = msg.get("type", msg.get("solver_type", "SGD"))
    if str(kind).upper() != "SGD":
        fail("type" if msg.has("type") else "solver_type",
             f"solver type '{kind}' is not supported (SGD is)")
    if not msg.has("base_lr"):
        fail(None, "the solver needs base_lr")
    if msg.get("iter_size", 1) != 1:
        fail("iter_size", "iter_size other than 1 (gradient accumulation) is not supported")
    if msg.get("regularization_type", "L2") != "L2":
        fail("regularization_type", "only L2 regularization is supported")
    policy = msg.get("lr_policy", "fixed")
    if policy not in LR_POLICIES:
        fail("lr_policy", f"lr_policy '{policy}' is not supported "
                          f"(supported: {', '.join(LR_POLICIES)})")
    solver = {"type": "sgd", "base_lr": msg.get("base_lr"), "lr_policy": policy,
              "momentum": msg.get("momentum", 0.0), "weight_decay": msg.get("weight_decay", 0.0),
              "max_iter": msg.get("max_iter", 0), "display": msg.get("display", 0),
              "test_interval": msg.get("test_interval", 0)}
    for key in ("gamma", "power", "stepsize"):
        if msg.has(key):
            solver[key] = msg.get(key)
    if msg.all("stepvalue"):
        solver["stepvalues"] = msg.all("stepvalue")
    if msg.all("test_iter"):
        solver["test_iter"] = msg.all("test_iter")[0]
        if len(msg.all("test_iter")) > 1:
            notes.append("solver: several test_iter values; the first is used (one test net)")
    checkpoint = {"interval": msg.get("snapshot", 0)}
    for field in ("solver_mode", "device_id", "snapshot_prefix", "net", "train_net", "test_net",
                  "test_initialization", "average_loss", "debug_info", "snapshot_format",
                  "snapshot_diff", "snapshot_after_train"):
        if msg.has(field):
            what = {"solver_mode": "the device is chosen by the config's 'device' key",
                    "snapshot_prefix": "checkpoints go to the run's --out folder",
                    "net": "the net is the NET.prototxt given"}.get(field, "no equivalent")
            notes.append(f"solver: '{field}' (line {msg.line_of(field)}) is ignored: {what}")
    seed = msg.get("random_seed", -1)
    return solver, checkpoint, (seed if seed >= 0 else None)


# --------------------------------------------------------------- checking
def check_builds(config, converter):
    """Build the converted net's forward graph of each phase, so that what our
    layers reject (a group that does not divide the channels, blobs of
    different shapes joined by Concat or Eltwise) is reported against the
    prototxt line of the Caffe layer at fault."""
    from ..errors import ConfigError, UserError
    from ..io.config import resolve_config
    from ..model import forward_graph
    try:
        resolved = resolve_config(config, None)
        for phase, spec in resolved["data"].items():
            forward_graph(resolved, phase, spec)
    except UserError as e:
        layer = None
        if isinstance(e, ConfigError) and str(e.key or "").startswith("net["):
            index = int(e.key[4:e.key.index("]")])
            layer = converter.source.get(config["net"][index]["name"])
        else:  # a shape error names the op '<layer>.<tag>'
            text = str(e)
            hits = [lay for name, lay in converter.source.items() if f"'{name}." in text]
            layer = max(hits, key=lambda lay: len(lay.name)) if hits else None
        if layer is None:
            raise PrototxtError(converter.path, None, f"the converted net does not build: {e}") \
                from None
        raise PrototxtError(converter.path, layer.line, f"{layer.where()}: {e}") from None


# ------------------------------------------------------------------ entry
def convert(net_path, solver_path=None, data_path=None):
    """(config, notes) from a Caffe net prototxt and optional solver."""
    net = parse_file(net_path, TEXT_SCHEMA, "NetParameter")
    data_abs = os.path.abspath(data_path) if data_path else None
    conv = Converter(net_path, data_abs)
    layers = conv.convert_net(net)
    name = net.get("name") or os.path.splitext(os.path.basename(net_path))[0]
    config = {"name": "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)}
    if conv.data:
        config["data"] = conv.data
    config["net"] = layers
    if solver_path:
        msg = parse_file(solver_path, TEXT_SCHEMA, "SolverParameter")
        solver, checkpoint, seed = convert_solver(msg, solver_path, conv.notes)
        config["solver"], config["checkpoint"] = solver, checkpoint
        if seed is not None:
            config["seed"] = seed
    if conv.data and os.path.isfile(data_abs):
        check_builds(config, conv)
    return config, conv.notes


def write_config(net_path, out_path, solver_path=None, data_path=None):
    """Convert and write the job YAML atomically (notes as a comment header);
    returns the notes."""
    import yaml
    config, notes = convert(net_path, solver_path, data_path)
    header = [f"# converted from {net_path}" + (f" and {solver_path}" if solver_path else "")]
    header += [f"# note: {n}" for n in notes]
    text = "\n".join(header) + "\n" + yaml.safe_dump(config, sort_keys=False,
                                                     default_flow_style=None, width=100)
    out_dir = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{out_path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, out_path)
    return notes
