"""How a config key is declared, once: ``ConfigKey`` (name, checker,
default, meaning; the checker's ``doc`` is its type), and what is derived
from a section's declarations: its defaults, its validation
(``check_section``) and the frozen part of the ``Job`` that holds it
(``spec_of``). The declarations themselves are the tables of job/schema.py,
as the layer types' keys are declared with ``@layer(..., keys=...)``.

Also the job's read-only values that a key's value becomes (``FrozenMap``
for a mapping, the metric watches ``EarlyStopSpec`` and ``BestSpec``, whose
fields are the watch's keys and defaults). Imports ``job/checks``.
"""
import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple, Optional

from ..base.errors import ConfigError
from .checks import _check_choice, _check_int, _check_keys, _check_number, _kind


class Typed(NamedTuple):
    """How a key's checked config value becomes the job's value and back."""
    to_job: object
    to_config: object


class ConfigKey(NamedTuple):
    """One config key: ``check(dotted_key, value, path)`` returns the checked
    value (``None`` where another part validates it, as the data specs);
    ``default`` its value when absent; ``meaning`` one line for
    docs/config.md. ``kind``: the type column when the checker's ``doc``
    does not give it; ``shown``: the default column when prose says it
    better than the value; ``typed``: how the value becomes the job's."""
    name: str
    check: object
    default: object
    meaning: str
    kind: Optional[str] = None
    shown: object = None
    typed: Optional[Typed] = None

    @property
    def type_doc(self):
        """The type column of docs/config.md."""
        return self.kind or getattr(self.check, "doc", None)

    def job_value(self, value):
        """The checked config value as the job holds it."""
        return self.typed.to_job(value) if self.typed else value

    def config_value(self, value):
        """The job's value as the resolved config writes it."""
        return self.typed.to_config(value) if self.typed else value


def defaults_of(keys):
    """{name: default} of declared keys (a fresh copy)."""
    return {key.name: copy.deepcopy(key.default) for key in keys}


def check_section(section, value, keys, path):
    """A section mapping checked key by key against its declarations, the
    defaults filled in (in declaration order)."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(path, section, f"expected a mapping, got {_kind(value)}")
    _check_keys(section, value, tuple(key.name for key in keys), path)
    return {key.name: key.check(f"{section}.{key.name}", value[key.name], path)
            if key.name in value else copy.deepcopy(key.default) for key in keys}


def spec_of(keys, **options):
    """Make the decorated class a frozen dataclass with one field per
    declared key, in order, defaulting to the key's default as the job holds
    it; ``from_config`` and ``to_config`` convert a section's dict. The
    class body adds only what is derived from several keys."""
    def deco(cls):
        own = dict(cls.__dict__.get("__annotations__", {}))  # fields of the class's own
        cls.__annotations__ = {}
        for key in keys:
            default = key.job_value(copy.deepcopy(key.default))
            cls.__annotations__[key.name] = object
            if default is None or isinstance(default, (bool, int, float, str, tuple)):
                setattr(cls, key.name, default)
            else:
                setattr(cls, key.name, dataclasses.field(
                    default_factory=lambda d=default: copy.deepcopy(d)))
        cls.__annotations__.update(own)
        cls.KEYS = tuple(keys)
        for name in ("from_config", "to_config"):
            if name not in cls.__dict__:
                setattr(cls, name, _SECTION_METHODS[name])
        return dataclass(frozen=True, **options)(cls)
    return deco


@classmethod
def _from_config(cls, section):
    values = {**defaults_of(cls.KEYS), **(section or {})}
    return cls(**{key.name: key.job_value(values[key.name]) for key in cls.KEYS})


def _to_config(self):
    return {key.name: key.config_value(getattr(self, key.name)) for key in self.KEYS}


_SECTION_METHODS = {"from_config": _from_config, "to_config": _to_config}


# ------------------------------------------------------- the job's values
class FrozenMap(Mapping):
    """A read-only mapping (a layer entry, ``parallel.stages``): reads like
    the dict it was made from, refuses assignment, pickles and copies."""
    __slots__ = ("_data",)

    def __init__(self, data=()):
        object.__setattr__(self, "_data", dict(data))

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)

    def __setattr__(self, name, value):
        raise AttributeError("a FrozenMap is read-only")

    def __repr__(self):
        return f"FrozenMap({self._data!r})"

    def __reduce__(self):
        return FrozenMap, (self._data,)

    def to_dict(self):
        """A deep copy as a plain dict."""
        return copy.deepcopy(self._data)


class _Watch:
    """A metric watch: its fields are its keys (``metric``, ``mode``, counts)."""

    @property
    def direction(self):
        """``max`` or ``min``: the given mode, else min for a loss, max otherwise."""
        return self.mode or ("min" if "loss" in str(self.metric).lower() else "max")

    def to_config(self):
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EarlyStopSpec(_Watch):
    """``solver.early_stop``: stop when ``metric`` stalls for ``patience`` tests."""
    metric: str
    mode: Optional[str] = None
    patience: int = 5
    min_delta: float = 0.0


@dataclass(frozen=True)
class BestSpec(_Watch):
    """``checkpoint.best``: keep the ``keep`` best checkpoints by ``metric``."""
    metric: str
    mode: Optional[str] = None
    keep: int = 1


def watch_keys(spec):
    """{key: default} of a metric watch (its spec's fields; ``metric`` has none)."""
    return {f.name: None if f.default is dataclasses.MISSING else f.default
            for f in dataclasses.fields(spec)}


def typed_watch(spec):
    """A watch mapping (or null) as ``spec`` and back."""
    return Typed(lambda v: None if v is None else spec(**v),
                 lambda v: None if v is None else v.to_config())


def _frozen_entries(entries):
    return None if entries is None else tuple(FrozenMap(copy.deepcopy(e)) for e in entries)


#: a list of mappings (``net``, ``graph``) as a tuple of FrozenMaps and back
ENTRIES = Typed(_frozen_entries,
                lambda v: None if v is None else [entry.to_dict() for entry in v])
#: a list as a tuple and back
TUPLE = Typed(lambda v: tuple(v or ()), list)
#: {name: integer} as a FrozenMap and back
INT_MAP = Typed(lambda v: FrozenMap({k: int(x) for k, x in (v or {}).items()}), dict)


def watch_check(spec, doc):
    """The checker of a metric watch (checkpoint.best, solver.early_stop):
    ``metric`` (a test figure: accuracy, loss, ...), ``mode`` max|min
    (default: min for a loss, else max) and the counts of ``spec``; null
    turns it off."""
    defaults = watch_keys(spec)

    def check(key, value, path):
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ConfigError(path, key, f"expected a mapping such as {{metric: accuracy}}, got "
                                         f"{_kind(value)}")
        _check_keys(key, value, tuple(defaults), path)
        metric = value.get("metric")
        if not isinstance(metric, str) or not metric:
            raise ConfigError(path, f"{key}.metric", "expected the name of a test figure, e.g. "
                                                     "accuracy or loss")
        out = dict(defaults, **value)
        if out["mode"] is not None:
            out["mode"] = _check_choice(f"{key}.mode", out["mode"], ("max", "min"), path)
        for name in ("keep", "patience"):
            if name in defaults:
                out[name] = _check_int(f"{key}.{name}", out[name], path, minimum=1)
        if "min_delta" in defaults:
            out["min_delta"] = _check_number(f"{key}.min_delta", out["min_delta"], path, 0,
                                             False, None)
        return out
    check.doc = doc
    return check
