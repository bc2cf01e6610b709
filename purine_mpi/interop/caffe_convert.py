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
  ``data_path`` (split train / test by the layer's phase) when it is given;
  without it a ``Data`` layer with ``backend: LMDB`` becomes the lmdb source
  of its own ``source`` (resolved against the working directory, as Caffe
  does; the notes say the absolute path). Their tops are renamed to our
  ``data`` / ``label`` blobs; ``transform_param`` becomes the source's
  scale / mean / mean_file / mirror / crop_size.
"""
import os

from ..base.runfiles import make_parent, write_text_replacing
from .caffe_layers import DATA_TYPES, LAYERS, SUPPORTED
from .caffe_schema import PHASES, REPEATED, TEXT_SCHEMA, V1_TYPES
from .caffe_solver import convert_solver
from .prototxt import Message, PrototxtError, parse_file

FILLER_TYPES = ("constant", "gaussian", "xavier", "msra", "uniform")


class _Layer:
    """One Caffe layer of the file: type, name, bottoms, tops, phase, line."""

    def __init__(self, msg, v1):
        self.msg, self.line, self.v1 = msg, msg.line, v1
        raw_type = msg.get("type")
        self.type = V1_TYPES.get(raw_type, raw_type) if v1 else raw_type
        self.name = msg.get("name") or f"{self.type}@{self.line}"
        self.bottoms, self.tops = msg.all("bottom"), msg.all("top")
        self.phase = _phase(msg)
        # the layer's own phase field: Caffe's mode of computation, not a filter
        self.mode = str(msg.get("phase")).lower() if msg.has("phase") else None

    def where(self):
        return f"layer '{self.name}' (type {self.type})"


def _phase(msg):
    include = [rule.get("phase") for rule in msg.all("include") if rule.has("phase")]
    exclude = [rule.get("phase") for rule in msg.all("exclude") if rule.has("phase")]
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
        for layer in layers:
            self.check_mode(layer)
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
            if layer.type != "SoftmaxWithLoss" and any(layer.msg.all("loss_weight")):
                # Caffe adds loss_weight x the sum of the top to the loss: not a layer's here
                self.fail(layer.msg.line_of("loss_weight"), layer,
                          f"loss_weight {layer.msg.all('loss_weight')[0]:g} on a layer that is "
                          "not a loss: Caffe adds that times the sum of its top to the loss; "
                          "only SoftmaxWithLoss takes a loss_weight here (0 elsewhere)")
            if layer.type in DATA_TYPES:
                self.data_layer(layer)
            elif id(layer) in fused:
                continue
            else:
                handler = LAYERS.get(layer.type)
                if handler is None:
                    self.fail(layer.line, layer, f"layer type '{layer.type}' is not supported "
                                                 f"(supported: {', '.join(sorted(SUPPORTED))})")
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
        phases = [layer.phase] if layer.phase else ["train", "test"]
        spec = self._data_source(layer, param)
        spec["batch_size"] = param.get("batch_size")
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
        if transform is not None and transform.get("mean_file"):
            if "mean" in spec:
                self.fail(transform.line_of("mean_file"), layer, "mean_file and mean_value "
                                                                 "together (Caffe allows one)")
            given = transform.get("mean_file")
            spec["mean_file"] = os.path.abspath(given)
            self.notes.append(f"{layer.where()} (line {layer.line}): mean_file {given!r} -> "
                              f"{spec['mean_file']} (resolved against the working directory, "
                              "as Caffe does)" + _missing(spec["mean_file"]))
        tops = layer.tops
        if not 1 <= len(tops) <= 2:
            self.fail(layer.line, layer, f"expected tops [data, label], got {tops}")
        for ours, theirs in zip(("data", "label"), tops):
            if ours != theirs:
                self.rename[theirs] = ours
        for phase in phases:
            if phase in self.data:
                self.fail(layer.line, layer, f"a second data layer for the {phase} phase")
            self.data[phase] = dict(spec, split=phase) if spec["source"] == "hdf5" else \
                dict(spec)
        if spec["source"] == "hdf5":
            self.notes.append(f"{layer.where()} (line {layer.line}) reads {self.data_path} "
                              f"(split {' and '.join(phases)}); its source "
                              f"{param.get('source', '')!r} is not used")

    def _data_source(self, layer, param):
        """{source, path} of a data layer: our HDF5 file (``--data``, which
        overrides), or the layer's own LMDB (Data with backend LMDB)."""
        if self.data_path is not None:
            return {"source": "hdf5", "path": self.data_path}
        if layer.type != "Data":
            self.fail(layer.line, layer, f"{layer.type} layers read our HDF5 data file: give "
                                         "--data DATA.h5 (e.g. from 'python -m purine_mpi data "
                                         "digits')")
        backend = param.get("backend", "LEVELDB")
        if backend != "LMDB":
            given = "" if param.has("backend") else " (Caffe's default: the layer gives no backend)"
            self.fail(param.line_of("backend"), layer,
                      f"backend LEVELDB{given} is not supported: convert the database to LMDB "
                      "(Caffe's convert_imageset --backend=lmdb, or tools/convert_db), or give "
                      "--data DATA.h5")
        source = param.get("source")
        if not source:
            self.fail(param.line, layer, "needs data_param { source: \"PATH_lmdb\" }")
        path = os.path.abspath(source)
        self.notes.append(f"{layer.where()} (line {layer.line}) reads the LMDB {path} "
                          f"(source {source!r}, resolved against the working directory "
                          f"{os.getcwd()}, as Caffe does)" + _missing(path))
        return {"source": "lmdb", "path": path}

    def check_mode(self, layer):
        """A layer's own ``phase: P`` (not ``include { phase: P }``) does not
        keep it out of the other net: Caffe builds it in both and computes
        it as in phase P in both. Layers computed alike in both phases take
        it as it is (a note); a Dropout, BatchNorm or data layer that would
        compute as in the other phase is refused."""
        if layer.mode is None:
            return
        other = [p for p in ([layer.phase] if layer.phase else ["train", "test"])
                 if p != layer.mode]
        if not other:
            return
        if layer.type in ("Dropout", "BatchNorm") + DATA_TYPES:
            self.fail(layer.msg.line_of("phase"), layer,
                      f"phase: {layer.mode.upper()} (the layer's own field, not include "
                      f"{{ phase }}) makes Caffe compute it as in {layer.mode}ing in the "
                      f"{other[0]} net too, which is not supported; to have the layer in the "
                      f"{layer.mode} net only, write include {{ phase: {layer.mode.upper()} }}")
        nets = "both nets" if layer.phase is None else f"the {layer.phase} net"
        self.notes.append(f"{layer.where()} (line {layer.line}): its phase: "
                          f"{layer.mode.upper()} is Caffe's mode of computation, not a filter: "
                          f"the layer is in {nets}, as in Caffe (include {{ phase }} keeps a "
                          "layer out of a net)")

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
            msg = Message(TEXT_SCHEMA[layer.msg.type_name][field], layer.line)
        return msg

    def check_only(self, layer, field, allowed):
        """Fail on any ``*_param`` other than ``field`` (e.g. pooling_param on a conv)."""
        for f in layer.msg.fields:
            if f.name.endswith("_param") and f.name not in allowed:
                self.fail(f.line, layer, f"'{f.name}' does not apply to a {layer.type} layer")


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


def _missing(path):
    return "" if os.path.exists(path) else "; it does not exist yet: train needs it there"


# --------------------------------------------------------------- checking
def check_builds(config, converter):
    """Build the converted net's forward graph of each phase, so that what our
    layers reject (a group that does not divide the channels, blobs of
    different shapes joined by Concat or Eltwise) is reported against the
    prototxt line of the Caffe layer at fault."""
    from ..base.errors import ConfigError, UserError
    from ..job.config import resolve_job
    from ..job.replica import forward_graph
    try:
        job = resolve_job(config, None)
        for phase, spec in job.data.items():
            forward_graph(job, phase, spec)
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
        shown = getattr(e, "shape_error", e)  # a shape: the op's words, not our net[i] key
        raise PrototxtError(converter.path, layer.line, f"{layer.where()}: {shown}") from None


# ------------------------------------------------------------------ entry
def convert(net_path, solver_path=None, data_path=None):
    """(config, notes) from a Caffe net prototxt and optional solver."""
    net = parse_file(net_path, TEXT_SCHEMA, "NetParameter", REPEATED)
    data_abs = os.path.abspath(data_path) if data_path else None
    conv = Converter(net_path, data_abs)
    layers = conv.convert_net(net)
    name = net.get("name") or os.path.splitext(os.path.basename(net_path))[0]
    config = {"name": "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)}
    if conv.data:
        config["data"] = conv.data
    config["net"] = layers
    if solver_path:
        msg = parse_file(solver_path, TEXT_SCHEMA, "SolverParameter", REPEATED)
        solver, checkpoint, seed, iter_size = convert_solver(msg, solver_path, conv.notes)
        config["solver"], config["checkpoint"] = solver, checkpoint
        if seed is not None:
            config["seed"] = seed
        if iter_size > 1:
            _accumulate(config, iter_size, conv.notes, solver_path, msg)
    present = conv.data and all(os.path.exists(spec["path"]) and os.path.exists(
        spec.get("mean_file", spec["path"])) for spec in conv.data.values())
    if present:
        check_builds(config, conv)
        _test_length_note(config, conv.notes)
    return config, conv.notes


def _accumulate(config, iter_size, notes, solver_path, msg):
    """Caffe's iter_size K: K batches of B per update -> one batch of K x B
    in K micro-batches (gradient accumulation; the same samples and the
    same mean gradient: with a loss's ignore_label, Caffe's mean of the K
    batches' own means, ``parallel.ignore_label_mean: shard``)."""
    train = (config.get("data") or {}).get("train")
    if train is None:
        raise PrototxtError(solver_path, msg.line_of("iter_size"), "iter_size needs a "
                            "training data layer in the net")
    batch = train["batch_size"]
    train["batch_size"] = batch * iter_size
    config["parallel"] = {"micro_batches": iter_size}
    notes.append(f"solver: iter_size {iter_size} -> data.train.batch_size {batch} x "
                 f"{iter_size} = {batch * iter_size} in parallel.micro_batches {iter_size} "
                 "(gradient accumulation: each micro-batch is Caffe's batch, the update "
                 "applies their mean gradient)")
    ignoring = [e["name"] for e in config.get("net") or ()
                if e.get("type") == "softmax_loss" and "ignore_label" in e]
    if ignoring:
        config["parallel"]["ignore_label_mean"] = "shard"
        notes.append(f"solver: iter_size {iter_size} with the ignore_label of "
                     f"{', '.join(ignoring)} -> parallel.ignore_label_mean shard (Caffe "
                     "divides each of the batches by its own counted positions and averages "
                     "their gradients; global would divide by the whole batch's count)")


def _test_length_note(config, notes):
    """Say what test_iter x the test batch reads of the test split (a full
    pass, or how many times each sample counts)."""
    from ..data.sources import repeat_note, source_info
    test = (config.get("data") or {}).get("test")
    test_iter = (config.get("solver") or {}).get("test_iter")
    if test is None or not test_iter:
        return
    n = source_info(test)[0]
    note = repeat_note(test_iter, test["batch_size"], 1, n)
    if note:
        notes.append(f"solver: test_iter {test_iter}: " + note[len("note: "):])
    elif test_iter * test["batch_size"] < n:
        notes.append(f"solver: test_iter {test_iter} x batch {test['batch_size']} reads "
                     f"{test_iter * test['batch_size']} of the {n} test samples (null "
                     "test_iter: one full pass)")


def write_config(net_path, out_path, solver_path=None, data_path=None):
    """Convert and write the job YAML atomically (notes as a comment header);
    returns the notes."""
    import yaml
    config, notes = convert(net_path, solver_path, data_path)
    header = [f"# converted from {net_path}" + (f" and {solver_path}" if solver_path else "")]
    header += [f"# note: {n}" for n in notes]
    text = "\n".join(header) + "\n" + yaml.safe_dump(config, sort_keys=False,
                                                     default_flow_style=None, width=100)
    make_parent(out_path)
    # by a rename over the name (base/runfiles): a write that fails (a full
    # disk, the file-size limit, Ctrl-C) leaves no temporary file and what
    # was at out_path as it was, and a full disk is one line
    write_text_replacing(out_path, text)
    return notes
