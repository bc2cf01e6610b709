"""The low-level graph YAML: one entry per node (docs/config.md, "graph").

``dump(graph)`` writes every blob and op with everything needed to rebuild
the graph exactly; ``load(entries, path)`` rebuilds it, with errors naming
the entry and key at fault.
"""
import numpy as np

from ..base.errors import ConfigError
from .core import Graph, Location

BLOB_KEYS = {"type", "name", "size", "dtype", "location", "kind", "alias_of", "offset", "attrs"}
OP_KEYS = {"type", "name", "op_type", "inputs", "outputs", "attrs", "location", "thread",
           "accumulate", "control_inputs"}
# Meanings of the keys above, for docs/config.md (after changing keys run
# python -m purine_mpi.tools.docgen --write).
BLOB_DOC = {
    "type": "`blob`",
    "name": "unique blob name, printable (no control character nor NUL, as a layer's name)",
    "size": "shape, a list of integers (null: inferred from the op that writes it)",
    "dtype": "float32 (default), float64, int64, ...",
    "location": "{rank: R, device: D} or {ip: A, device: D}; device -1 is the CPU",
    "kind": "data (default), param, grad, state, iter, lr or bucket",
    "alias_of": "another blob whose storage this one views",
    "offset": "element offset of the view in alias_of",
    "attrs": "mapping, e.g. filler, lr_mult, decay_mult of a param",
}
OP_DOC = {
    "type": "`op`",
    "name": "unique op name, printable (no control character nor NUL)",
    "op_type": "the kernel (Conv, InnerProduct, Relu, SGDUpdate, Allreduce, ...)",
    "inputs": "list of blob names read",
    "outputs": "list of blob names written",
    "attrs": "mapping of the kernel's attributes",
    "location": "as for a blob",
    "thread": "worker thread number or name, printable (a CUDA stream on a GPU)",
    "accumulate": "add into the outputs: several writers of one blob must all accumulate "
                  "(the blob is zeroed before each iteration)",
    "control_inputs": "ops that must finish before this one (no data edge)",
}


def dump(graph):
    entries = []
    for b in graph.blobs.values():
        e = {"type": "blob", "name": b.name, "size": list(b.shape) if b.shape is not None else None,
             "dtype": b.dtype, "location": b.location.to_dict(), "kind": b.kind}
        if b.alias_of is not None:
            e["alias_of"], e["offset"] = b.alias_of, b.offset
        if b.attrs:
            e["attrs"] = b.attrs
        entries.append(e)
    for op in graph.ops.values():
        e = {"type": "op", "op_type": op.op_type, "name": op.name, "inputs": op.inputs,
             "outputs": op.outputs, "location": op.location.to_dict(), "thread": op.thread}
        if op.attrs:
            e["attrs"] = op.attrs
        if op.accumulate:
            e["accumulate"] = True
        if op.control_inputs:
            e["control_inputs"] = op.control_inputs
        entries.append(e)
    return entries


def _location(v, path, key, hosts=None):
    if v is None:
        return Location()
    if not isinstance(v, dict):
        raise ConfigError(path, key, f"expected a mapping {{rank: R, device: D}} or "
                                     f"{{ip: A, device: D}}, got {v!r}")
    unknown = set(v) - {"rank", "ip", "device"}
    if unknown:
        raise ConfigError(path, key, f"unknown location field(s) {sorted(unknown)}")
    rank = v.get("rank")
    ip = v.get("ip")
    if rank is None:
        rank = (hosts or {}).get(ip, 0) if ip is not None else 0
    if not isinstance(rank, int) or rank < 0:
        raise ConfigError(path, key + ".rank", f"expected a non-negative integer, got {rank!r}")
    device = v.get("device", -1)
    if not isinstance(device, int):
        raise ConfigError(path, key + ".device", f"expected an integer (-1 = CPU), got {device!r}")
    return Location(rank, device, ip)


def _mapping(v, path, key):
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(path, key, f"expected a mapping, got {v!r}")
    return dict(v)


def load(entries, path, name="graph", hosts=None):
    """Build a Graph from seed-format entries. ``hosts`` maps ip -> rank."""
    if not isinstance(entries, list):
        raise ConfigError(path, "graph", "expected a list of blob/op entries")
    g = Graph(name)
    ops, aliases = [], []
    for i, e in enumerate(entries):
        key = f"graph[{i}]"
        if not isinstance(e, dict) or e.get("type") not in ("blob", "op"):
            raise ConfigError(path, key, f"expected a mapping with type: blob or type: op, got {e!r}")
        allowed = BLOB_KEYS if e["type"] == "blob" else OP_KEYS
        unknown = set(e) - allowed
        if unknown:
            raise ConfigError(path, f"{key}.{sorted(unknown)[0]}",
                              f"unknown field for a {e['type']} entry (allowed: {sorted(allowed)})")
        if not isinstance(e.get("name"), str):
            raise ConfigError(path, f"{key}.name", "every entry needs a name")
        loc = _location(e.get("location"), path, f"{key}.location", hosts)
        if e["type"] == "blob":
            size = e.get("size")
            if size is not None and not (isinstance(size, list) and
                                         all(isinstance(s, int) and s >= 0 for s in size)):
                raise ConfigError(path, f"{key}.size", f"expected a list of non-negative "
                                                       f"integers, got {size!r}")
            if e["name"] in g.blobs:
                raise ConfigError(path, f"{key}.name", f"blob '{e['name']}' is defined twice")
            try:
                dtype = np.dtype(e.get("dtype", "float32")).name
            except TypeError:
                raise ConfigError(path, f"{key}.dtype", f"blob '{e['name']}': unknown dtype "
                                  f"{e.get('dtype')!r} (e.g. float32, float64, int64)") from None
            offset = e.get("offset", 0)
            if not isinstance(offset, int) or offset < 0:
                raise ConfigError(path, f"{key}.offset", f"expected a non-negative integer, "
                                                         f"got {offset!r}")
            g.add_blob(e["name"], size, dtype, loc, e.get("kind", "data"),
                       alias_of=e.get("alias_of"), offset=offset,
                       attrs=_mapping(e.get("attrs"), path, f"{key}.attrs"))
            aliases.append((key, e))
        else:
            ops.append((key, e, loc))
    for key, e in aliases:  # checked once every blob is known (any order works)
        if e.get("alias_of") is not None and e["alias_of"] not in g.blobs:
            raise ConfigError(path, f"{key}.alias_of", f"blob '{e['name']}' aliases "
                                                       f"'{e['alias_of']}', which is not a blob "
                                                       "of the graph")
    for key, e, loc in ops:
        for k in ("op_type", "inputs", "outputs"):
            if k not in e:
                raise ConfigError(path, f"{key}.{k}", f"op '{e['name']}' needs '{k}'")
        for k in ("inputs", "outputs"):
            if not isinstance(e[k], list) or not all(isinstance(b, str) for b in e[k]):
                raise ConfigError(path, f"{key}.{k}", "expected a list of blob names")
        if e["name"] in g.ops:
            raise ConfigError(path, f"{key}.name", f"op '{e['name']}' is defined twice")
        thread = e.get("thread", 0)
        if not isinstance(thread, (int, str)) or isinstance(thread, bool):
            raise ConfigError(path, f"{key}.thread", f"expected a thread number or name, "
                                                     f"got {thread!r}")
        control = e.get("control_inputs", [])
        if not isinstance(control, list) or not all(isinstance(c, str) for c in control):
            raise ConfigError(path, f"{key}.control_inputs", "expected a list of op names")
        g.add_op(e["name"], e["op_type"], e["inputs"], e["outputs"],
                 _mapping(e.get("attrs"), path, f"{key}.attrs"), loc, thread,
                 bool(e.get("accumulate", False)), control)
    return g
