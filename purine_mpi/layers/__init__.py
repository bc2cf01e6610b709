"""Caffe-style layers: each is a function that emits a small bi-graph.

``build_net(config, phase, data_shapes)`` turns the config's ``net:`` list into
the forward graph of one replica. A layer whose ``top`` equals its ``bottom``
(Caffe's in-place, e.g. ReLU) writes a new single-assignment blob
(``conv1@relu1``) and later layers reading ``conv1`` see that newest version.

Learnable blobs are ``<layer>/weight`` and ``<layer>/bias`` (kind ``param``),
carrying their filler and lr/decay multipliers in ``attrs``.

Every layer type declares its keys (``Key``: name, kind, default, meaning)
when it registers with ``@layer(..., keys=[...])``; ``check_layer`` rejects a
key no declaration names (exit 2 with a "did you mean"), at config load time
and again when the net is built. ``NetBuilder.get(key)`` takes the declared
kind and default, so a declaration is the one place a key is defined.
docs/config.md is generated from these declarations: after changing keys run
``python -m purine_mpi.docgen --write``.
"""
import difflib
from typing import NamedTuple

from ..errors import ConfigError
from .fillers import FILLERS

LAYERS = {}        # type name or alias -> layer function
LAYER_SPECS = {}   # canonical type name -> LayerSpec


class Required:
    """The default of a key that must be given (``note``: when)."""

    def __init__(self, note=""):
        self.note = note

    def __repr__(self):
        return f"required {self.note}".strip()


REQUIRED = Required()


class Key(NamedTuple):
    """One layer key: ``kind`` is what ``NetBuilder.get`` checks (see
    KIND_DOC), ``default`` its value when absent (``Required`` if it must be
    given), ``meaning`` one line for docs/config.md."""
    name: str
    kind: object
    default: object
    meaning: str


class LayerSpec(NamedTuple):
    type: str
    aliases: tuple
    keys: tuple      # the layer's own keys, after COMMON_KEYS
    doc: str
    fn: object

    def all_keys(self):
        return COMMON_KEYS + self.keys

    def key(self, name):
        for k in self.all_keys():
            if k.name == name:
                return k
        return None


# What each kind accepts (the `type` column of docs/config.md).
KIND_DOC = {
    "str": "string", "int": "integer", "posint": "integer > 0", "nonneg": "integer >= 0",
    "number": "number", "bool": "true/false", "pair": "int or [h, w]",
    "blobs": "blob name or list", "ints": "list of integers", "numbers": "list of numbers",
    "filler": "filler", "thread": "integer >= 0 or a name",
    "params": "list of {lr_mult, decay_mult}",
}

COMMON_KEYS = (
    Key("type", "str", REQUIRED, "the layer type (or one of its aliases)"),
    Key("name", "str", REQUIRED, "unique layer name; its parameters are `<name>/weight` "
                                 "and `<name>/bias`"),
    Key("bottom", "blobs", REQUIRED, "input blob(s): data, label or an earlier layer's top"),
    Key("top", "blobs", "<name>", "output blob(s); the same name as bottom means in place"),
    Key("phase", ("train", "test"), None, "build the layer in this phase only (default both)"),
    Key("thread", "thread", 0, "worker thread (CUDA stream on a GPU) that runs its ops"),
)
PARAM_KEYS = {"lr_mult": 1.0, "decay_mult": 1.0}


def layer(*names, keys=(), doc=None):
    """Register a layer function under ``names`` (the first is its type in
    the docs, the rest aliases) with its declared ``keys`` (``Key`` tuples,
    besides COMMON_KEYS). ``doc``: one line for docs/config.md; default the
    first paragraph of the function's docstring."""
    def deco(fn):
        text = doc or " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())
        spec = LayerSpec(names[0], tuple(names[1:]), tuple(keys), text, fn)
        common = {k.name for k in COMMON_KEYS}
        clash = [k.name for k in spec.keys if k.name in common]
        if clash or len({k.name for k in spec.keys}) != len(spec.keys):
            raise ValueError(f"layer {names[0]!r}: keys declared twice: {clash or spec.keys}")
        fn.spec = spec
        LAYER_SPECS[names[0]] = spec
        for n in names:
            LAYERS[n] = fn
        return fn
    return deco


def layer_spec(ltype):
    """The LayerSpec of a type name or alias, or None."""
    fn = LAYERS.get(str(ltype).lower())
    return getattr(fn, "spec", None)


def check_layer(cfg, index, path):
    """Exit-2 checks of one net entry that need no shapes: a known type and
    no key its type does not declare (nor in its fillers and ``param``)."""
    name = cfg.get("name")
    ltype = cfg.get("type")
    spec = layer_spec(ltype)
    if spec is None:
        close = difflib.get_close_matches(str(ltype).lower(), LAYERS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(path, f"net[{index}].type",
                          f"layer '{name}': unknown layer type {ltype!r}{hint}; "
                          f"known: {', '.join(sorted(LAYERS))}")
    valid = [k.name for k in spec.all_keys()]
    for k in cfg:
        if k not in valid:
            raise ConfigError(path, f"net[{index}].{k}",
                              f"layer '{name}' ({spec.type}): unknown key {k!r}"
                              f"{_suggest(k, valid)} (valid keys: {', '.join(valid)})")
    for key in spec.keys:
        if key.kind == "filler" and isinstance(cfg.get(key.name), dict):
            _check_filler(cfg[key.name], f"net[{index}].{key.name}", name, path)
        if key.kind == "params" and isinstance(cfg.get(key.name), list):
            for j, entry in enumerate(cfg[key.name]):
                where = f"net[{index}].{key.name}[{j}]"
                if not isinstance(entry, dict):
                    raise ConfigError(path, where, f"layer '{name}': expected a mapping "
                                      f"{{lr_mult: 1, decay_mult: 1}}, got {entry!r}")
                for k, v in entry.items():
                    if k not in PARAM_KEYS:
                        raise ConfigError(path, f"{where}.{k}", f"layer '{name}': unknown "
                                          f"key {k!r}{_suggest(k, PARAM_KEYS)} (valid keys: "
                                          f"{', '.join(PARAM_KEYS)})")
                    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                        raise ConfigError(path, f"{where}.{k}", f"layer '{name}': expected a "
                                          f"number, got {v!r}")


def _check_filler(filler, where, name, path):
    kind = filler.get("type")
    if kind not in FILLERS:
        return  # NetBuilder's filler check names the valid types
    valid = ["type", *FILLERS[kind]]
    for k, v in filler.items():
        if k not in valid:
            raise ConfigError(path, f"{where}.{k}", f"layer '{name}': unknown key {k!r} in a "
                              f"{kind} filler{_suggest(k, valid)} (valid keys: "
                              f"{', '.join(valid)})")
        if k != "type" and (isinstance(v, bool) or not isinstance(v, (int, float)) or v != v):
            raise ConfigError(path, f"{where}.{k}", f"layer '{name}': expected a number, "
                                                    f"got {v!r}")


def _suggest(value, choices):
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


_DECLARED = object()


class NetBuilder:
    """State while emitting one net: the graph and the current version of
    every top name."""

    def __init__(self, graph, phase, path, index=0):
        self.graph, self.phase, self.path = graph, phase, path
        self.current = {}
        self.cfg, self.index, self.spec = None, index, None

    # -- config access with errors that name file and key ----------------
    def key(self, k):
        return f"net[{self.index}].{k}" if k else f"net[{self.index}]"

    def fail(self, k, msg):
        raise ConfigError(self.path, self.key(k), f"layer '{self.cfg.get('name')}': {msg}")

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
        is_int = isinstance(v, int) and not isinstance(v, bool)
        if kind == "int" and not is_int:
            self.fail(k, f"expected an integer, got {v!r}")
        if kind == "posint" and not (is_int and v > 0):
            self.fail(k, f"expected a positive integer, got {v!r}")
        if kind == "nonneg" and not (is_int and v >= 0):
            self.fail(k, f"expected a non-negative integer, got {v!r}")
        if kind == "pair":
            ok = (is_int and v >= 0) or (isinstance(v, list) and len(v) == 2 and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v))
            if not ok:
                self.fail(k, f"expected a non-negative integer or [h, w], got {v!r}")
        if kind == "number" and (isinstance(v, bool) or not isinstance(v, (int, float))):
            self.fail(k, f"expected a number, got {v!r}")
        if kind == "numbers" and (not isinstance(v, list) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)):
            self.fail(k, f"expected a list of numbers, got {v!r}")
        if kind == "thread" and not ((is_int and v >= 0) or (isinstance(v, str) and v)):
            self.fail(k, f"expected a thread number (>= 0) or name, got {v!r}")
        if kind == "bool" and not isinstance(v, bool):
            self.fail(k, f"expected true or false, got {v!r}")
        if kind == "str" and not isinstance(v, str):
            self.fail(k, f"expected a string, got {v!r}")
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
        if isinstance(t, list) and not all(isinstance(x, str) for x in t) \
                or not isinstance(t, (str, list)):
            self.fail("top", f"expected a blob name or a list of names, got {t!r}")
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
        specs = self.get("param")
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
                                 thread=self.get("thread"))

    def shape(self, blob):
        self.graph.infer_shapes()
        return self.graph.blobs[blob].shape


def build_net(config, phase, data_blobs):
    """Forward graph of the config's net for ``phase`` ('train' or 'test').

    ``data_blobs`` maps names the net may read (``data``, ``label``) to blobs
    already in a graph; returns (graph, builder) with the data op added by
    the caller beforehand."""
    graph, path = data_blobs
    b = NetBuilder(graph, phase, path)
    b.current = {n: n for n in graph.blobs}
    names = set()
    for i, cfg in enumerate(config.get("net") or []):
        b.cfg, b.index, b.spec = cfg, i, None
        if not isinstance(cfg, dict):
            raise ConfigError(path, f"net[{i}]", f"expected a mapping, got {cfg!r}")
        name = cfg.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(path, f"net[{i}].name", "every layer needs a non-empty name")
        if name in names:
            raise ConfigError(path, f"net[{i}].name", f"layer name '{name}' is used twice")
        names.add(name)
        check_layer(cfg, i, path)
        b.spec = layer_spec(cfg["type"])
        layer_phase = b.get("phase")
        if layer_phase is not None and layer_phase != phase:
            continue
        b.spec.fn(b)
    return b


from . import standard  # noqa: E402,F401  registers the standard layers
