"""Caffe-style layers: each is a function that emits a small bi-graph.

``build_net(config, phase, data_shapes)`` turns the config's ``net:`` list into
the forward graph of one replica. A layer whose ``top`` equals its ``bottom``
(Caffe's in-place, e.g. ReLU) writes a new single-assignment blob
(``conv1@relu1``) and later layers reading ``conv1`` see that newest version.

Learnable blobs are ``<layer>/weight`` and ``<layer>/bias`` (kind ``param``),
carrying their filler and lr/decay multipliers in ``attrs``.
"""
import difflib

from ..errors import ConfigError

LAYERS = {}


def layer(*names):
    def deco(fn):
        for n in names:
            LAYERS[n] = fn
        return fn
    return deco


class NetBuilder:
    """State while emitting one net: the graph and the current version of
    every top name."""

    def __init__(self, graph, phase, path, index=0):
        self.graph, self.phase, self.path = graph, phase, path
        self.current = {}
        self.cfg, self.index = None, index

    # -- config access with errors that name file and key ----------------
    def key(self, k):
        return f"net[{self.index}].{k}" if k else f"net[{self.index}]"

    def fail(self, k, msg):
        raise ConfigError(self.path, self.key(k), f"layer '{self.cfg.get('name')}': {msg}")

    def get(self, k, default=None, kind=None, required=False):
        if k not in self.cfg:
            if required:
                self.fail(k, f"missing required field '{k}'")
            return default
        v = self.cfg[k]
        if kind == "posint" and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            self.fail(k, f"expected a positive integer, got {v!r}")
        if kind == "nonneg" and not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            self.fail(k, f"expected a non-negative integer, got {v!r}")
        if kind == "pair":
            ok = (isinstance(v, int) and v >= 0) or (isinstance(v, list) and len(v) == 2 and
                                                    all(isinstance(x, int) and x >= 0 for x in v))
            if not ok:
                self.fail(k, f"expected a non-negative integer or [h, w], got {v!r}")
        if kind == "number" and not isinstance(v, (int, float)):
            self.fail(k, f"expected a number, got {v!r}")
        if kind == "bool" and not isinstance(v, bool):
            self.fail(k, f"expected true or false, got {v!r}")
        if isinstance(kind, tuple) and v not in kind:
            self.fail(k, f"expected one of {', '.join(map(str, kind))}, got {v!r}")
        return v

    def bottoms(self, n=None):
        b = self.get("bottom", required=True)
        b = [b] if isinstance(b, str) else b
        if not isinstance(b, list) or not all(isinstance(x, str) for x in b):
            self.fail("bottom", f"expected a blob name or a list of names, got {b!r}")
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
        t = [t] if isinstance(t, str) else t
        if n is not None and len(t) != n:
            self.fail("top", f"expected {n} top blob(s), got {len(t)}")
        names = []
        for top in t:
            name = top if top not in self.graph.blobs else f"{top}@{self.cfg['name']}"
            self.current[top] = name
            names.append(name)
        return names

    def param(self, suffix, shape, filler, idx):
        """A learnable blob ``<layer>/<suffix>`` with Caffe's per-param mults."""
        name = f"{self.cfg['name']}/{suffix}"
        specs = self.cfg.get("param", [])
        spec = specs[idx] if isinstance(specs, list) and idx < len(specs) else {}
        attrs = {"filler": filler, "lr_mult": float(spec.get("lr_mult", 1.0)),
                 "decay_mult": float(spec.get("decay_mult", 1.0))}
        self.graph.add_blob(name, shape, kind="param", attrs=attrs)
        return name

    def state(self, suffix, shape, value):
        name = f"{self.cfg['name']}/{suffix}"
        self.graph.add_blob(name, shape, kind="param",
                            attrs={"filler": {"type": "constant", "value": value},
                                   "learnable": False, "lr_mult": 0.0, "decay_mult": 0.0})
        return name

    def op(self, op_type, inputs, outputs, attrs=None, tag="fwd"):
        return self.graph.add_op(f"{self.cfg['name']}.{tag}", op_type, inputs, outputs, attrs,
                                 thread=self.cfg.get("thread", 0))

    def shape(self, blob):
        self.graph.infer_shapes()
        return self.graph.blobs[blob].shape


def build_net(config, phase, data_blobs):
    """Forward graph of the config's net for ``phase`` ('train' or 'test').

    ``data_blobs`` maps names the net may read (``data``, ``label``) to blobs
    already in a graph; returns (graph, builder) with the data op added by
    the caller beforehand."""
    graph, path = data_blobs
    from . import standard  # noqa: F401  registers the layer functions
    b = NetBuilder(graph, phase, path)
    b.current = {n: n for n in graph.blobs}
    names = set()
    for i, cfg in enumerate(config.get("net") or []):
        b.cfg, b.index = cfg, i
        if not isinstance(cfg, dict):
            raise ConfigError(path, f"net[{i}]", f"expected a mapping, got {cfg!r}")
        ltype = cfg.get("type")
        name = cfg.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(path, f"net[{i}].name", "every layer needs a non-empty name")
        if name in names:
            raise ConfigError(path, f"net[{i}].name", f"layer name '{name}' is used twice")
        names.add(name)
        layer_phase = cfg.get("phase")
        if layer_phase not in (None, "train", "test"):
            b.fail("phase", f"expected train or test, got {layer_phase!r}")
        if layer_phase is not None and layer_phase != phase:
            continue
        fn = LAYERS.get(str(ltype).lower())
        if fn is None:
            close = difflib.get_close_matches(str(ltype).lower(), LAYERS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(path, f"net[{i}].type",
                              f"layer '{name}': unknown layer type {ltype!r}{hint}; "
                              f"known: {', '.join(sorted(LAYERS))}")
        fn(b)
    return b
