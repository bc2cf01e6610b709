"""``inspect CKPT.h5 [--diff OTHER.h5] [--json]``: what a checkpoint holds
(attributes, every blob with its shape, dtype and statistics) and how two
differ, as text or JSON. Reads through io/checkpoint.py.

Layer: job (docs/DESIGN.md); may import the foundation, devices, data, ops and
graph layers below it, and its own.
"""
import json
import math

import numpy as np

from ..errors import UserError
from .checkpoint import KIND, _open, _read_attrs, _str


# ------------------------------------------------------------------ inspect
def inspect_checkpoint(path, diff=None, as_json=False):
    """Every dataset of ``path`` with shape, dtype and statistics (min, max,
    mean, std, L2 norm) and the root attributes; with ``diff`` (another file)
    per common dataset the max abs difference and the relative L2 difference
    ``||a - b|| / max(||a||, ||b||)``, and the datasets only one file has.
    Returns text, or a JSON string with the same content when ``as_json``."""
    report = _describe(path)
    if diff is not None:
        report["diff"] = _diff(path, diff)
    if as_json:
        return json.dumps(_jsonable(report))
    return _format_text(report)


def _walk(path):
    """{dataset name: numpy value} and root attrs of any HDF5 file."""
    import h5py
    with _open(path, "file") as f:
        values = {}

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                kind = _str(obj.attrs.get(KIND))
                values["/" + name] = (obj.asstr()[()] if kind == "json" or obj.dtype.kind in "SO"
                                      else np.asarray(obj[...]))
        try:
            f.visititems(visit)
        except (OSError, KeyError, ValueError, RuntimeError) as e:
            raise UserError(f"'{path}' is corrupt: {type(e).__name__}: {e}") from None
        return values, _read_attrs(f)


def _numeric(value):
    return isinstance(value, np.ndarray) and value.dtype.kind in "biuf"


def _describe(path):
    values, attrs = _walk(path)
    datasets = []
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf show up as such
        for name, value in values.items():
            datasets.append(_stats(name, value))
    return {"path": str(path), "attrs": attrs, "datasets": datasets}


def _stats(name, value):
    entry = {"name": name}
    if _numeric(value):
        entry.update(shape=list(value.shape), dtype=str(value.dtype))
        if value.size:
            x = value.astype(np.float64)
            entry.update(min=x.min(), max=x.max(), mean=x.mean(), std=x.std(),
                         l2=math.sqrt(float(np.sum(x * x))))
    elif isinstance(value, np.ndarray):
        entry.update(shape=list(value.shape), dtype=str(value.dtype))
    else:
        entry.update(shape=[], dtype="string", value=str(value))
    return entry


def _diff(path, other):
    a_values, a_attrs = _walk(path)
    b_values, b_attrs = _walk(other)
    rows = []
    for name in a_values:
        if name not in b_values:
            continue
        a, b = a_values[name], b_values[name]
        row = {"name": name}
        if _numeric(a) and _numeric(b):
            if a.shape != b.shape:
                row["shapes"] = [list(a.shape), list(b.shape)]
            elif a.size:
                x, y = a.astype(np.float64), b.astype(np.float64)
                with np.errstate(invalid="ignore", over="ignore"):
                    d = x - y
                    norm = max(math.sqrt(float(np.sum(x * x))),
                               math.sqrt(float(np.sum(y * y))))
                    dist = math.sqrt(float(np.sum(d * d)))
                    row.update(max_abs_diff=float(np.max(np.abs(d))),
                               rel_l2_diff=dist / norm if norm else 0.0)
            else:
                row.update(max_abs_diff=0.0, rel_l2_diff=0.0)
        else:
            row["equal"] = bool(np.array_equal(a, b)) if isinstance(a, np.ndarray) else a == b
        rows.append(row)
    attrs = {k: [a_attrs.get(k), b_attrs.get(k)] for k in list(a_attrs) + [
        k for k in b_attrs if k not in a_attrs] if not _same(a_attrs.get(k), b_attrs.get(k))}
    return {"other": str(other), "datasets": rows,
            "only_in_first": [n for n in a_values if n not in b_values],
            "only_in_second": [n for n in b_values if n not in a_values],
            "attrs": attrs}


def _same(a, b):
    try:
        return bool(np.array_equal(a, b)) if isinstance(a, np.ndarray) else a == b
    except Exception:
        return False


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, np.generic):
        return _jsonable(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # strict JSON has no NaN / Infinity
    return value


def _fmt(value):
    return f"{value:.6g}" if isinstance(value, (float, np.floating)) else str(value)


def _format_text(report):
    lines = [f"file {report['path']}"]
    for key, value in report["attrs"].items():
        if isinstance(value, str) and "\n" in value:
            value = f"<{len(value.splitlines())} lines of text>"
        lines.append(f"  @{key} = {_fmt(value)}")
    width = max([len(d["name"]) for d in report["datasets"]] + [7])
    lines.append(f"{'dataset':<{width}}  {'shape':<16} {'dtype':<8} {'min':>11} {'max':>11} "
                 f"{'mean':>11} {'std':>11} {'l2':>11}")
    for d in report["datasets"]:
        shape = "x".join(str(s) for s in d["shape"]) or "scalar"
        line = f"{d['name']:<{width}}  {shape:<16} {d['dtype']:<8}"
        if "min" in d:
            line += "".join(f" {_fmt(d[k]):>11}" for k in ("min", "max", "mean", "std", "l2"))
        elif "value" in d:
            text = d["value"]
            line += " " + (text if len(text) <= 60 else text[:57] + "...")
        lines.append(line)
    diff = report.get("diff")
    if diff:
        lines.append(f"diff against {diff['other']}")
        lines.append(f"{'dataset':<{width}}  {'max_abs_diff':>13} {'rel_l2_diff':>13}")
        for row in diff["datasets"]:
            if "max_abs_diff" in row:
                tail = f"{_fmt(row['max_abs_diff']):>13} {_fmt(row['rel_l2_diff']):>13}"
            elif "shapes" in row:
                tail = f"shapes differ: {row['shapes'][0]} vs {row['shapes'][1]}"
            else:
                tail = "equal" if row["equal"] else "differs"
            lines.append(f"{row['name']:<{width}}  {tail}")
        for label, names in (("only in first", diff["only_in_first"]),
                             ("only in second", diff["only_in_second"])):
            if names:
                lines.append(f"{label}: {', '.join(names)}")
        for key, (a, b) in diff["attrs"].items():
            if isinstance(a, str) and "\n" in a or isinstance(b, str) and "\n" in b:
                lines.append(f"attribute @{key} differs")
            else:
                lines.append(f"attribute @{key}: {_fmt(a)} vs {_fmt(b)}")
    return "\n".join(lines)
