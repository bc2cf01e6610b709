"""The layer registry: each layer type declares its keys (``Key``: name,
kind, default, meaning, and for a numeric key its ``Range``) when it
registers with ``@layer(..., keys=[...])``; ``check_layer`` rejects a key no
declaration names (exit 2, with a "did you mean") and a value outside its
kind or range, when the config is read. docs/config.md is generated from
these declarations. Imports ``errors`` and ``layers.fillers``.
"""
import difflib
import math
from typing import NamedTuple, Optional

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


class Range(NamedTuple):
    """The values a numeric key accepts (each element of a list or pair):
    ``lo`` .. ``hi`` (None: unbounded on that side), each end closed unless
    ``lo_open`` / ``hi_open``; always finite. ``note``: a bound only the
    net's shapes decide (an axis), checked when the net is built."""
    lo: object = None
    hi: object = None
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""

    def __contains__(self, v):
        if not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    @property
    def text(self):
        """The range in the reference's terse words: ``> 0``, ``in [0, 1)``."""
        if self.lo is not None and self.hi is not None:
            return (f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}"
                    f"{')' if self.hi_open else ']'}")
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {self.hi}"
        return self.note or "finite"


POSITIVE = Range(0, lo_open=True)     # > 0
NON_NEGATIVE = Range(0)               # >= 0
AT_LEAST_ONE = Range(1)               # >= 1
RATIO = Range(0, 1, hi_open=True)     # in [0, 1): a dropout ratio
FRACTION = Range(0, 1)                # in [0, 1]
FINITE = Range()                      # any finite number


class Slot(NamedTuple):
    """One parameter of a layer type, at its place in the layer's ``param``
    list: ``name``, the blob ``<layer>/<name>``; ``switch``, a bool key of
    the layer whose false leaves the parameter out (fc's ``bias_term``),
    None where the layer always has it."""
    name: str
    switch: Optional[str] = None


class Key(NamedTuple):
    """One layer key: ``kind`` is what ``NetBuilder.get`` checks (see
    KIND_DOC), ``default`` its value when absent (``Required`` if it must be
    given), ``meaning`` one line for docs/config.md; ``range`` the values a
    numeric kind accepts (``posint`` and ``nonneg`` imply theirs). ``weights``:
    another value changes what the layer's weights mean though their shapes
    stay (attention's num_heads): weights saved with another value are refused
    (job/checkpoint_check.py, ``check_same_meaning``). ``slots``: of a
    ``params`` key, the layer type's parameters in order (``Slot`` tuples);
    ``check_layer`` refuses more entries than these and a non-default entry
    for a parameter this config leaves out."""
    name: str
    kind: object
    default: object
    meaning: str
    range: Optional[Range] = None
    weights: bool = False
    slots: tuple = ()

    @property
    def value_range(self):
        """The declared range, or the one the kind implies; None for a key
        that is not numeric."""
        return self.range or IMPLIED_RANGE.get(self.kind)

    @property
    def type_doc(self):
        """The type column of docs/config.md: the kind and the range."""
        if isinstance(self.kind, tuple):
            return "one of " + ", ".join(map(str, self.kind))
        doc = KIND_DOC[self.kind]
        if self.range is None:
            return doc
        bounded = self.range.lo is not None or self.range.hi is not None
        each = "each " if self.kind in LIST_KINDS else ""
        return f"{doc}{' ' if bounded and not each else ', '}{each}{self.range.text}"


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
    "filler": "filler", "thread": "integer >= 0 or a printable name",
    "params": "list of {lr_mult, decay_mult}",
}
#: the numeric kinds: each key of one declares its range (``Key.range``),
#: or its kind implies it (IMPLIED_RANGE)
NUMERIC_KINDS = ("int", "posint", "nonneg", "number", "pair", "ints", "numbers")
IMPLIED_RANGE = {"posint": POSITIVE, "nonneg": NON_NEGATIVE}  # as KIND_DOC says
LIST_KINDS = ("pair", "ints", "numbers")  # a range bounds each element

COMMON_KEYS = (
    Key("type", "str", REQUIRED, "the layer type (or one of its aliases)"),
    Key("name", "str", REQUIRED, "unique layer name; its parameters are `<name>/weight` "
                                 "and `<name>/bias` (so its parts between `/` are non-empty, "
                                 "not `.` or `..`, and no layer is named as another's "
                                 "parameter, `fc1/weight`: a checkpoint could not hold both)"),
    Key("bottom", "blobs", REQUIRED, "input blob(s): data, label or an earlier layer's top"),
    Key("top", "blobs", "<name>", "output blob(s); the same name as bottom means in place"),
    Key("phase", ("train", "test"), None, "build the layer in this phase only (default "
        "both); the test phase of a net with such layers is checked by train and graph "
        "also without data.test"),
    Key("thread", "thread", 0, "worker thread (CUDA stream on a GPU) that runs its ops"),
)
PARAM_KEYS = {"lr_mult": 1.0, "decay_mult": 1.0}
PARAM_RANGE = NON_NEGATIVE  # of each PARAM_KEYS value
#: the range of a filler's number key (fillers.FILLERS), FINITE where absent
FILLER_RANGES = {"std": NON_NEGATIVE}


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
        for k in spec.keys:
            if k.kind in NUMERIC_KINDS and k.value_range is None:
                raise ValueError(f"layer {names[0]!r}: numeric key {k.name!r} declares no "
                                 "range (Key(..., range=Range(...)))")
            if k.kind == "params" and not k.slots:
                raise ValueError(f"layer {names[0]!r}: params key {k.name!r} declares no "
                                 "parameters (Key(..., slots=(Slot('weight'), ...)))")
            for slot in k.slots:
                switch = slot.switch and spec.key(slot.switch)
                if slot.switch and (switch is None or switch.kind != "bool"):
                    raise ValueError(f"layer {names[0]!r}: parameter {slot.name!r} is "
                                     f"switched by {slot.switch!r}, not a bool key of the layer")
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


def layer_key(keys, index):
    """The file's key of layer ``index`` of the net as built (its ``repeat``
    entries expanded): ``net.3.block.2`` for a layer of a repeat's block
    (``keys``: job/repeat.py expand_net's, the Job's ``net_keys``; None
    when the file has no repeat), else ``net[i]``, i the layer's position
    in the file (after a repeat, not ``index``)."""
    if keys and 0 <= index < len(keys):
        key = keys[index]
        return key if ".block." in key else f"net[{key.split('.')[1]}]"
    return f"net[{index}]"


def check_layer(cfg, index, path, where=None):
    """Exit-2 checks of one net entry that need no shapes: a known type and
    no key its type does not declare (nor in its fillers and ``param``).
    ``where``: the entry's key in the file (default ``net[index]``; a layer
    of a ``repeat`` block is ``net.3.block.2``)."""
    at = where or f"net[{index}]"
    name = excerpt(cfg.get("name"), quote=False)  # for the messages
    ltype = cfg.get("type")
    spec = layer_spec(ltype)
    if spec is None:
        close = difflib.get_close_matches(str(ltype).lower(), LAYERS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(path, f"{at}.type",
                          f"layer '{name}': unknown layer type {excerpt(ltype)}{hint}; "
                          f"known: {', '.join(sorted(LAYERS))}")
    valid = [k.name for k in spec.all_keys()]
    for k in cfg:
        if k not in valid:
            raise ConfigError(path, f"{at}.{k}",
                              f"layer '{name}' ({spec.type}): unknown key {excerpt(k)}"
                              f"{_suggest(k, valid)} (valid keys: {', '.join(valid)})")
    for k, v in cfg.items():
        key = spec.key(k)
        problem = value_problem(key.kind, key.range, v)
        if problem:
            raise ConfigError(path, f"{at}.{k}", f"layer '{name}' ({spec.type}): "
                                                         f"{problem}")
    for key in spec.keys:
        if key.kind == "filler" and isinstance(cfg.get(key.name), dict):
            _check_filler(cfg[key.name], f"{at}.{key.name}", name, path)
        if key.kind == "params" and isinstance(cfg.get(key.name), list):
            for j, entry in enumerate(cfg[key.name]):
                where = f"{at}.{key.name}[{j}]"
                if not isinstance(entry, dict):
                    raise ConfigError(path, where, f"layer '{name}': expected a mapping "
                                      f"{{lr_mult: 1, decay_mult: 1}}, got {excerpt(entry)}")
                for k, v in entry.items():
                    if k not in PARAM_KEYS:
                        raise ConfigError(path, f"{where}.{k}", f"layer '{name}': unknown "
                                          f"key {excerpt(k)}{_suggest(k, PARAM_KEYS)} (valid keys: "
                                          f"{', '.join(PARAM_KEYS)})")
                    problem = value_problem("number", PARAM_RANGE, v)
                    if problem:
                        raise ConfigError(path, f"{where}.{k}", f"layer '{name}': {problem}")
            _check_slots(cfg, key, spec, at, name, path)


def _check_slots(cfg, key, spec, at, name, path):
    """A ``param`` list (entries checked) against the type's parameters
    (``key.slots``): no more entries than it has (Caffe: "Too many params
    specified"), and where ``cfg`` switches a parameter off, its entry a
    placeholder ({} or the defaults) only, so a multiplier set for it is
    never silently ignored."""
    entries, slots = cfg[key.name], key.slots
    names = ", ".join(s.name for s in slots)
    if len(entries) > len(slots):
        raise ConfigError(path, f"{at}.{key.name}", f"layer '{name}' ({spec.type}): "
                          f"{len(entries)} entries, but type {spec.type} has "
                          f"{len(slots)} parameter{'s' if len(slots) > 1 else ''}: {names} "
                          f"(one entry each, in this order)")
    for j, (entry, slot) in enumerate(zip(entries, slots)):
        if slot.switch is None or cfg.get(slot.switch, spec.key(slot.switch).default):
            continue
        given = [f"{k}: {excerpt(v, quote=False)}" for k, v in entry.items()
                 if float(v) != PARAM_KEYS[k]]
        if given:
            raise ConfigError(path, f"{at}.{key.name}[{j}]", f"layer '{name}' ({spec.type}): "
                              f"{', '.join(given)} for parameter '{slot.name}', which this "
                              f"layer does not have: {slot.switch} is false (an entry for it "
                              f"may only hold the defaults, as a placeholder: {{}}); drop "
                              f"the setting, or set {slot.switch}: true")


def _check_filler(filler, where, name, path):
    kind = filler.get("type")
    if not isinstance(kind, str) or kind not in FILLERS:
        return  # NetBuilder's filler check names the valid types
    valid = ["type", *FILLERS[kind]]
    for k, v in filler.items():
        if k not in valid:
            raise ConfigError(path, f"{where}.{k}", f"layer '{name}': unknown key "
                              f"{excerpt(k)} in a {kind} filler{_suggest(k, valid)} (valid keys: "
                              f"{', '.join(valid)})")
        problem = k != "type" and value_problem("number", FILLER_RANGES.get(k, FINITE), v)
        if problem:
            raise ConfigError(path, f"{where}.{k}", f"layer '{name}': {problem}")
    if kind == "uniform":
        bounds = dict(FILLERS[kind], **filler)
        if bounds["min"] > bounds["max"]:
            raise ConfigError(path, f"{where}.max", f"layer '{name}': a uniform filler needs "
                              f"min <= max, got min {bounds['min']}, max {bounds['max']}")


def _suggest(value, choices):
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: what a value of each kind is, in an error message (before its range)
_WANT = {"int": "an integer", "posint": "an integer", "nonneg": "an integer",
         "number": "a number", "pair": "an integer or [h, w]", "ints": "a list of integers",
         "numbers": "a list of numbers"}


def value_problem(kind, rng, v):
    """What a value of ``kind`` (see KIND_DOC) within range ``rng`` (a
    ``Range``; None: the kind's own) must be, when ``v`` is not one; else
    None. A filler passes: _check_filler and the layer's build own it."""
    if kind in NUMERIC_KINDS:
        rng = rng or IMPLIED_RANGE.get(kind)
        if kind in ("number", "numbers"):
            ok = _is_number
        else:
            ok = _is_int
        if kind in ("ints", "numbers"):
            elems = v if isinstance(v, list) and all(map(ok, v)) else None
        elif kind == "pair":
            elems = [v] if ok(v) else v if isinstance(v, list) and len(v) == 2 and all(
                map(ok, v)) else None
        else:
            elems = [v] if ok(v) else None
        if elems is not None and (rng is None or all(e in rng for e in elems)):
            return None
        bounded = rng is not None and (rng.lo is not None or rng.hi is not None)
        want = _WANT[kind] + ((", each " if kind in LIST_KINDS else " ") + rng.text
                              if bounded else "")
        finite = " (finite)" if kind in ("number", "numbers") else ""
        return f"expected {want}{finite}, got {excerpt(v)}"
    if kind == "thread" and not ((_is_int(v) and v >= 0) or (isinstance(v, str) and v)):
        return f"expected a thread number (>= 0) or name, got {excerpt(v)}"
    if kind == "bool" and not isinstance(v, bool):
        return f"expected true or false, got {excerpt(v)}"
    if kind == "str" and not isinstance(v, str):
        return f"expected a string, got {excerpt(v)}"
    if kind == "blobs" and not (isinstance(v, str) and v or isinstance(v, list) and all(
            isinstance(x, str) and x for x in v)):
        return f"expected a blob name or a list of names, got {excerpt(v)}"
    if kind == "params" and not (isinstance(v, list) and all(isinstance(x, dict) for x in v)):
        return f"expected a list of {{lr_mult, decay_mult}} mappings, one per parameter, got " \
               f"{excerpt(v)}"
    if isinstance(kind, tuple) and v not in kind:
        return f"expected one of {', '.join(map(str, kind))}, got {excerpt(v)}"
    return None
