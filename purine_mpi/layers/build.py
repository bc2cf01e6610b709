"""``build_net``: the job's ``net:`` list as the forward bi-graph of one
replica, each layer emitting its sub-graph through a ``NetBuilder`` (see the
package docstring). Imports ``errors`` and the registry.
"""
from collections.abc import Mapping

from ..base.errors import ConfigError, ShapeError, excerpt
from .registry import Required, check_layer, layer_key, layer_spec, value_problem

_DECLARED = object()

#: the layer key a shape that cannot work is named by, by the op type whose
#: shape inference refused it (the others: ``bottom``, the inputs' shapes)
SHAPE_KEYS = {"Conv": "kernel", "Pool": "kernel", "Reshape": "shape", "Slice": "slice_point"}


class NetBuilder:
    """State while emitting one net: the graph and the current version of
    every top name."""

    def __init__(self, graph, phase, path, index=0, keys=None):
        self.graph, self.phase, self.path = graph, phase, path
        self.keys = keys  # the file's key of each layer (repeats: layer_key)
        self.current = {}
        self.cfg, self.index, self.spec = None, index, None
        self.layer_of = {}  # op name -> (index, layer entry) of the layer that added it
        self.inferred = set()  # the ops whose outputs' shapes ``shape`` inferred
        self.stored = {}  # parameter name -> its layer's name
        self.stored_under = {}  # a proper '/'-prefix of a parameter name -> that name

    # -- config access with errors that name file and key ----------------
    def key(self, k, index=None):
        at = layer_key(self.keys, self.index if index is None else index)
        return f"{at}.{k}" if k else at

    def fail(self, k, msg):
        name = excerpt(self.cfg.get("name"), quote=False)
        raise ConfigError(self.path, self.key(k), f"layer '{name}': {msg}")

    def get(self, k, default=_DECLARED, kind=_DECLARED, required=None):
        """The layer's key ``k``, checked against its ``kind``; absent: its
        ``default`` (or a failure when required). ``default``, ``kind`` and
        ``required`` come from the layer's ``Key`` declaration unless given."""
        spec = getattr(self, "spec", None)
        declared = spec.key(k) if spec is not None else None
        if declared is None and spec is not None:
            raise KeyError(f"layer type {spec.type!r} reads key {k!r} without declaring it")
        if default is _DECLARED:
            default = declared.default if declared is not None else None
        if kind is _DECLARED:
            kind = declared.kind if declared is not None else None
        if required is None:
            required = isinstance(default, Required)
        if k not in self.cfg:
            if required:
                note = f" ({default.note})" if isinstance(default, Required) and default.note \
                    else ""
                self.fail(k, f"missing required field '{k}'{note}")
            return None if isinstance(default, Required) else default
        v = self.cfg[k]
        problem = value_problem(kind, declared.range if declared is not None else None, v)
        if problem:
            self.fail(k, problem)
        return v

    def bottoms(self, n=None):
        b = self.get("bottom", required=True)
        b = [b] if isinstance(b, str) else b
        if not isinstance(b, list) or not all(isinstance(x, str) for x in b):
            self.fail("bottom", f"expected a blob name or a list of names, got {excerpt(b)}")
        if n is not None and len(b) != n:
            self.fail("bottom", f"expected {n} bottom blob(s), got {len(b)}")
        out = []
        for name in b:
            if name not in self.current:
                known = ", ".join(sorted(self.current)) or "none"
                self.fail("bottom", f"bottom blob '{name}' is not produced by the data or an "
                          f"earlier layer (available: {known})")
            out.append(self.current[name])
        return out

    def tops(self, n=None):
        t = self.get("top", default=self.cfg.get("name"))
        if isinstance(t, list) and not all(isinstance(x, str) for x in t) \
                or not isinstance(t, (str, list)):
            self.fail("top", f"expected a blob name or a list of names, got {excerpt(t)}")
        t = [t] if isinstance(t, str) else t
        if n is not None and len(t) != n:
            self.fail("top", f"expected {n} top blob(s), got {len(t)}")
        names = []
        for top in t:
            name = top if top not in self.graph.blobs else f"{top}@{self.cfg['name']}"
            self.current[top] = name
            names.append(name)
        return names

    def _param_spec(self, idx):
        specs = self.get("param")
        return specs[idx] if isinstance(specs, list) and idx < len(specs) else {}

    def param(self, suffix, shape, filler, idx):
        """A learnable blob ``<layer>/<suffix>`` with Caffe's per-param mults."""
        name = self._stored_name(suffix)
        spec = self._param_spec(idx)
        attrs = {"filler": filler, "lr_mult": float(spec.get("lr_mult", 1.0)),
                 "decay_mult": float(spec.get("decay_mult", 1.0))}
        self.graph.add_blob(name, shape, kind="param", attrs=attrs)
        return name

    def _stored_name(self, suffix):
        """``<layer>/<suffix>``, the name of a parameter, which a checkpoint
        stores at that HDF5 path; refused when it and another layer's
        parameter nest (layer 'fc' has the dataset 'fc/weight', under which a
        layer 'fc/weight' could not store its 'fc/weight/weight'): else the
        run trains and fails at its first checkpoint."""
        layer = self.cfg["name"]
        name = f"{layer}/{suffix}"
        parts = name.split("/")
        above = ["/".join(parts[:i]) for i in range(1, len(parts))]
        outer = next((p for p in above if p in self.stored), None)
        inner = self.stored_under.get(name) if outer is None else None
        if outer is not None or inner is not None:
            other = outer or inner
            self.fail("name", f"its parameter '{name}' and layer '{self.stored[other]}''s "
                              f"parameter '{other}' cannot both be saved: a checkpoint stores "
                              f"a parameter at /params/<its name>, and nothing can be stored "
                              f"under the array '{min(name, other, key=len)}'; rename one of "
                              "the two layers")
        self.stored[name] = layer
        for p in above:
            self.stored_under.setdefault(p, name)
        return name

    def shared_param(self, name, idx):
        """An earlier layer's parameter ``name`` used as this layer's
        parameter ``idx`` (a tied weight): its ``param`` entry, if any, must
        give the owner's multipliers (Caffe: "Shared param has mismatched
        lr_mult"); they are the owner's. Returns ``name``."""
        spec, have = self._param_spec(idx), self.graph.blobs[name].attrs
        for k in ("lr_mult", "decay_mult"):
            if k in spec and float(spec[k]) != float(have.get(k, 1.0)):
                owner = name.rsplit("/", 1)[0]
                self.fail(f"param[{idx}].{k}", f"{k} {excerpt(spec[k])} for '{name}', which "
                          f"it shares with layer '{owner}', whose {k} is "
                          f"{float(have.get(k, 1.0)):g}: a shared parameter takes its owner's "
                          f"multipliers (give the same, or set them on '{owner}')")
        return name

    def state(self, suffix, shape, value):
        name = self._stored_name(suffix)
        self.graph.add_blob(name, shape, kind="param",
                            attrs={"filler": {"type": "constant", "value": value},
                                   "learnable": False, "lr_mult": 0.0, "decay_mult": 0.0})
        return name

    def op(self, op_type, inputs, outputs, attrs=None, tag="fwd"):
        self.layer_of[f"{self.cfg['name']}.{tag}"] = (self.index, self.cfg)
        return self.graph.add_op(f"{self.cfg['name']}.{tag}", op_type, inputs, outputs, attrs,
                                 thread=self.get("thread"))

    def shape_failure(self, exc):
        """A ShapeError of an op a layer added as a ConfigError naming the
        file, the layer's key (SHAPE_KEYS) and the op's shapes; another
        ShapeError as it is."""
        if exc.op not in self.layer_of:
            return exc
        index, cfg = self.layer_of[exc.op]
        key = SHAPE_KEYS.get(self.graph.ops[exc.op].op_type, "bottom")
        name = excerpt(cfg.get("name"), quote=False)
        err = ConfigError(self.path, self.key(key, index),
                          f"layer '{name}' ({cfg.get('type')}): {exc}")
        err.shape_error = exc  # the op's own words (convert caffe names the prototxt's layer)
        return err

    def shape(self, blob):
        """``blob``'s shape: the ops added since the last call inferred
        (``Graph.infer_shapes(ops)``), not the whole graph again (per layer
        that asked: quadratic in the layers, 30% of ``plan --choose`` on
        gpt_small); ``build_net`` infers the whole graph at its end."""
        pending = [op for name, op in self.graph.ops.items() if name not in self.inferred]
        self.graph.infer_shapes(pending)
        self.inferred.update(op.name for op in pending)
        return self.graph.blobs[blob].shape


def build_net(net, phase, data_blobs):
    """Forward graph of ``net`` (the job's layer entries, mappings read by
    key) for ``phase`` ('train' or 'test').

    ``data_blobs``: (the graph holding the blobs the net may read, ``data``
    and ``label``, the config's path[, the Job's ``net_keys``: a layer of a
    ``repeat`` is named by its key in the file, ``net.3.block.2``]); returns
    (graph, builder) with the data op added by the caller beforehand, every
    blob's shape inferred (a shape that cannot work: a ConfigError naming
    the layer's key, ``shape_failure``)."""
    graph, path, *keys = data_blobs
    b = NetBuilder(graph, phase, path, keys=keys[0] if keys else None)
    b.current = {n: n for n in graph.blobs}
    names = set()
    for i, cfg in enumerate(net or ()):
        b.cfg, b.index, b.spec = cfg, i, None
        if not isinstance(cfg, Mapping):
            raise ConfigError(path, b.key(None), f"expected a mapping, got {excerpt(cfg)}")
        name = cfg.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(path, b.key("name"), "every layer needs a non-empty name")
        if name in names:
            raise ConfigError(path, b.key("name"), f"layer name '{name}' is used twice")
        names.add(name)
        check_layer(cfg, i, path, where=b.key(None))
        b.spec = layer_spec(cfg["type"])
        layer_phase = b.get("phase")
        if layer_phase is not None and layer_phase != phase:
            continue
        try:
            b.spec.fn(b)
        except ShapeError as exc:  # an earlier layer's op, inferred for this one's shapes
            raise b.shape_failure(exc) from None
    try:
        graph.infer_shapes()
    except ShapeError as exc:
        raise b.shape_failure(exc) from None
    return b
