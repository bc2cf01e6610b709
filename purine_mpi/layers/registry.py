"""The layer registry: each layer type declares its keys (``Key``: name,
kind, default, meaning) when it registers with ``@layer(..., keys=[...])``;
``check_layer`` rejects a key no declaration names (exit 2, with a "did you
mean"). docs/config.md is generated from these declarations. Imports
``errors`` and ``layers.fillers``.
"""
import difflib
from typing import NamedTuple

from ..base.errors import ConfigError, excerpt
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
    given), ``meaning`` one line for docs/config.md. ``weights``: another
    value changes what the layer's weights mean though their shapes stay
    (attention's num_heads): weights saved with another value are refused
    (job/checkpoint_check.py, ``check_same_meaning``)."""
    name: str
    kind: object
    default: object
    meaning: str
    weights: bool = False


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
    name = excerpt(cfg.get("name"), quote=False)  # for the messages
    ltype = cfg.get("type")
    spec = layer_spec(ltype)
    if spec is None:
        close = difflib.get_close_matches(str(ltype).lower(), LAYERS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(path, f"net[{index}].type",
                          f"layer '{name}': unknown layer type {excerpt(ltype)}{hint}; "
                          f"known: {', '.join(sorted(LAYERS))}")
    valid = [k.name for k in spec.all_keys()]
    for k in cfg:
        if k not in valid:
            raise ConfigError(path, f"net[{index}].{k}",
                              f"layer '{name}' ({spec.type}): unknown key {excerpt(k)}"
                              f"{_suggest(k, valid)} (valid keys: {', '.join(valid)})")
    for key in spec.keys:
        if key.kind == "filler" and isinstance(cfg.get(key.name), dict):
            _check_filler(cfg[key.name], f"net[{index}].{key.name}", name, path)
        if key.kind == "params" and isinstance(cfg.get(key.name), list):
            for j, entry in enumerate(cfg[key.name]):
                where = f"net[{index}].{key.name}[{j}]"
                if not isinstance(entry, dict):
                    raise ConfigError(path, where, f"layer '{name}': expected a mapping "
                                      f"{{lr_mult: 1, decay_mult: 1}}, got {excerpt(entry)}")
                for k, v in entry.items():
                    if k not in PARAM_KEYS:
                        raise ConfigError(path, f"{where}.{k}", f"layer '{name}': unknown "
                                          f"key {excerpt(k)}{_suggest(k, PARAM_KEYS)} (valid keys: "
                                          f"{', '.join(PARAM_KEYS)})")
                    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                        raise ConfigError(path, f"{where}.{k}", f"layer '{name}': expected a "
                                          f"number, got {excerpt(v)}")


def _check_filler(filler, where, name, path):
    kind = filler.get("type")
    if kind not in FILLERS:
        return  # NetBuilder's filler check names the valid types
    valid = ["type", *FILLERS[kind]]
    for k, v in filler.items():
        if k not in valid:
            raise ConfigError(path, f"{where}.{k}", f"layer '{name}': unknown key "
                              f"{excerpt(k)} in a {kind} filler{_suggest(k, valid)} (valid keys: "
                              f"{', '.join(valid)})")
        if k != "type" and (isinstance(v, bool) or not isinstance(v, (int, float)) or v != v):
            raise ConfigError(path, f"{where}.{k}", f"layer '{name}': expected a number, "
                                                    f"got {excerpt(v)}")


def _suggest(value, choices):
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
