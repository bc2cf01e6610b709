"""``repeat`` entries of ``net``: a block of layers written once and built
``repeat`` times (a transformer's blocks), expanded into plain layers when
the config is read (job/config.py), so everything after the config (the
graph, ``--set``'s checks, the saved config of a checkpoint) sees the
spelled-out net::

    - repeat: 6          # count, an integer >= 1
      start: 0           # the first index (default 0)
      block:             # the layers of one block
        - {type: layer_norm, name: "h{i}_ln1", bottom: "x{i}", top: "h{i}_n1"}
        ...
        - {type: eltwise, name: "h{i}_res2", bottom: ["h{i}_r", "h{i}_p"], top: "x{i+1}"}

Every string of a block's layers (names, bottoms, tops, ``tie_weight``, ...)
has its placeholders replaced: ``{i}`` is the block's index, ``{i+K}`` and
``{i-K}`` that index plus or minus K (so a block reads ``x{i}``, the
previous block's ``x{i+1}``); ``{{`` and ``}}`` are literal braces. Every
layer name of a block must hold a placeholder (each block's names differ).
A problem is a ``ConfigError`` naming the entry's key (``net.3.repeat``,
``net.3.block.2.name``). Imports ``errors``.
"""
import re

from ..base.errors import ConfigError, excerpt

REPEAT_KEYS = ("repeat", "start", "block")
MAX_REPEAT = 10000  # a bound on the expanded net, so a typo cannot build millions of layers
_FIELD = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_INDEX = re.compile(r"\s*i\s*(?:([+-])\s*(\d+)\s*)?$")


def is_repeat(entry):
    """Whether a net entry is a ``repeat`` (a mapping with the key ``repeat``)."""
    return isinstance(entry, dict) and "repeat" in entry


def expand_net(net, path):
    """``net`` with every ``repeat`` entry replaced by its blocks, and for each
    layer of the result the key that names its source in the file
    (``net.4`` or ``net.3.block.2``): ``(layers, keys)``."""
    layers, keys = [], []
    for n, entry in enumerate(net):
        if not is_repeat(entry):
            layers.append(entry)
            keys.append(f"net.{n}")
            continue
        for i, j, layer in _blocks(entry, f"net.{n}", path):
            layers.append(layer)
            keys.append(f"net.{n}.block.{j}")
    return layers, keys


def _blocks(entry, key, path):
    unknown = [k for k in entry if k not in REPEAT_KEYS]
    if unknown:
        raise ConfigError(path, f"{key}.{unknown[0]}", f"a repeat entry takes the keys "
                          f"{', '.join(REPEAT_KEYS)}, not {excerpt(unknown[0])} (the layers go "
                          "in its 'block' list)")
    count, start = entry["repeat"], entry.get("start", 0)
    if not _is_int(count) or not 1 <= count <= MAX_REPEAT:
        raise ConfigError(path, f"{key}.repeat", f"expected the number of blocks, an integer "
                          f"in [1, {MAX_REPEAT}], got {excerpt(count)}")
    if not _is_int(start) or start < 0:
        raise ConfigError(path, f"{key}.start", f"expected the first block's index, an "
                          f"integer >= 0, got {excerpt(start)}")
    block = entry.get("block")
    if not isinstance(block, list) or not block:
        raise ConfigError(path, f"{key}.block", f"expected a non-empty list of layers, got "
                          f"{excerpt(block)}")
    for j, layer in enumerate(block):
        where = f"{key}.block.{j}"
        if is_repeat(layer):
            raise ConfigError(path, where, "a repeat inside a repeat's block is not supported "
                              "(its {i} would be ambiguous); write the inner blocks out")
        if not isinstance(layer, dict):
            raise ConfigError(path, where, f"expected a layer mapping with 'type' and 'name', "
                              f"got {excerpt(layer)}")
        name = layer.get("name")
        if isinstance(name, str) and count > 1 and not _has_field(name):
            raise ConfigError(path, f"{where}.name", f"layer name {excerpt(name)} holds no "
                              "placeholder: each of the repeated blocks would define it; "
                              "write e.g. 'h{i}_" + name + "'")
        _substitute(layer, start, f"{where}", path)  # the placeholders, checked once
    for i in range(start, start + count):
        for j, layer in enumerate(block):
            yield i, j, _substitute(layer, i, f"{key}.block.{j}", path)


def _substitute(value, i, key, path):
    """``value`` (a layer's mapping, list or string) with ``{i}``, ``{i+K}``,
    ``{i-K}`` replaced by index ``i``'s values."""
    if isinstance(value, dict):
        return {k: _substitute(v, i, f"{key}.{k}", path) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, i, f"{key}.{j}", path) for j, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def field(m):
        text = m.group(0)
        if text in ("{{", "}}"):
            return text[0]
        if m.group(1) is None:
            raise ConfigError(path, key, f"unmatched brace in {excerpt(value)}: a placeholder "
                              "is {i}, {i+1} or {i-1}; write a literal brace as {{ or }}")
        index = _INDEX.match(m.group(1))
        if index is None:
            raise ConfigError(path, key, f"unknown placeholder {excerpt(text)} in "
                              f"{excerpt(value)}: a repeat's block knows {{i}} (the block's "
                              "index), {i+K} and {i-K}")
        sign, k = index.groups()
        result = i + (int(k) if sign == "+" else -int(k)) if k else i
        if result < 0:
            raise ConfigError(path, key, f"{excerpt(text)} in {excerpt(value)} is negative "
                              f"for block {i}; give the repeat a 'start' of at least "
                              f"{i - result}")
        return str(result)
    return _FIELD.sub(field, value)


def _has_field(text):
    return any(m.group(1) is not None for m in _FIELD.finditer(text))


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)
