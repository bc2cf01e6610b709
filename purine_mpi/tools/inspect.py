"""``inspect CKPT.h5 [--diff OTHER.h5] [--json]``: what a checkpoint holds
(attributes, every blob with its shape, dtype and statistics) and how two
differ, as text or JSON. Reads through job/checkpoint_file.py.
"""
import json
import math

import numpy as np

from ..base.errors import UserError
from ..job.checkpoint_file import KIND, open_h5, plain_attr


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


#: the most bytes inspect holds of one dataset at a time
BLOCK_BYTES = 64 << 20


def _read_errors(path, name=None):
    """HDF5's errors on a damaged file, and memory, as one UserError naming
    the file (and ``name``, the dataset being read, when given)."""
    import contextlib

    @contextlib.contextmanager
    def guard():
        try:
            yield
        except UserError:
            raise
        except (OSError, KeyError, ValueError, RuntimeError) as e:
            at = f" (dataset '{name}')" if name else ""
            raise UserError(f"'{path}' is corrupt{at}: {type(e).__name__}: {e}") from None
        except MemoryError:
            raise UserError(f"'{path}': a dataset does not fit in memory ({BLOCK_BYTES >> 20} "
                            "MiB at a time is read)") from None
    return guard()


def _datasets(f):
    """{"/name": h5py.Dataset} of every dataset of an open file (hard links)."""
    import h5py
    found = {}

    def visit(name, obj):  # returning anything but None would end the walk
        if isinstance(obj, h5py.Dataset):
            found["/" + name] = obj
    f.visititems(visit)
    return found


def _shown_attrs(obj):
    """An object's attributes as plain Python (job/checkpoint_file.read_attrs),
    text as it is shown: bytes that are not UTF-8 (an
    ASCII string attribute holding \xe9) as escapes, not replaced by U+FFFD
    nor as lone surrogates (which no terminal prints)."""
    return {k: _text(v) if isinstance(v, (bytes, str, np.ndarray)) else plain_attr(v)
            for k, v in obj.attrs.items()}


def _text(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # h5py's surrogateescape of bytes that are not UTF-8
            return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        return value
    if isinstance(value, np.ndarray) and value.dtype.kind in "OS":
        return np.array([_text(v) for v in value.reshape(-1)], dtype=object).reshape(value.shape)
    return value


def _is_text(dset):
    """A dataset of strings (fixed or variable length) or of JSON text; not
    one of variable-length sequences of numbers (dtype object too), which
    reads as an array of arrays."""
    import h5py
    return h5py.check_string_dtype(dset.dtype) is not None or \
        plain_attr(dset.attrs.get(KIND)) == "json"


def _numeric(dset):
    return dset.dtype.kind in "biuf"


def _small_value(dset):
    """A non-numeric dataset's value (text for strings/JSON), or None when it
    is larger than BLOCK_BYTES (shown by shape and dtype only)."""
    if _is_text(dset):
        if dset.size * 64 > BLOCK_BYTES:
            return None
        # bytes an ASCII (or UTF-8) string type does not allow are shown as
        # escapes (\xe9): a value HDF5 stored as given, not a damaged file
        return dset.asstr(encoding="utf-8", errors="backslashreplace")[()]
    return np.asarray(dset[...]) if dset.nbytes <= BLOCK_BYTES else None


def _slabs(shape, itemsize, block=BLOCK_BYTES):
    """Index tuples covering an array of ``shape`` in parts of at most
    ``block`` bytes (or one row of the innermost axis)."""
    shape = tuple(int(s) for s in shape)
    k = 0
    while k < len(shape) - 1 and int(np.prod(shape[k + 1:], dtype=np.float64)) * itemsize > block:
        k += 1
    inner = int(np.prod(shape[k + 1:], dtype=np.int64)) * itemsize
    step = max(1, block // max(inner, 1))
    for lead in np.ndindex(*shape[:k]):
        for start in range(0, shape[k], step):
            yield tuple(int(i) for i in lead) + (slice(start, min(start + step, shape[k])),)


class _Stats:
    """min, max, mean, std and L2 norm over blocks of values (float64),
    combined exactly as one pass would for a single block (NaN and
    infinities propagate, as in NumPy), and the counts of NaN and of
    infinite values; an integer dataset's min and max are exact integers
    (float64 rounds int64 beyond 2**53)."""

    def __init__(self):
        self.n = self.nan = self.inf = 0

    def add(self, x):
        raw = np.asarray(x)
        x = np.asarray(raw, dtype=np.float64).reshape(-1)  # no copy of float64
        if not x.size:
            return
        self.nan += int(np.count_nonzero(np.isnan(x)))
        self.inf += int(np.count_nonzero(np.isinf(x)))
        mean = x.mean()
        exact = raw.dtype.kind in "iu"
        part = (x.size, int(raw.min()) if exact else x.min(), int(raw.max()) if exact else x.max(),
                mean, float(np.sum(np.abs(x - mean) ** 2)), float(np.sum(x * x)))
        self._combine(*part)

    def add_constant(self, value, count):
        if count > 0:
            v = float(value)
            self.nan += count if math.isnan(v) else 0
            self.inf += count if math.isinf(v) else 0
            exact = int(value) if np.asarray(value).dtype.kind in "iu" else v
            self._combine(count, exact, exact, v, 0.0, v * v * count)

    def _combine(self, n, lo, hi, mean, m2, ss):
        if not self.n:
            self.n, self.lo, self.hi, self.mean, self.m2, self.ss = n, lo, hi, mean, m2, ss
            return
        total = self.n + n
        delta = mean - self.mean
        self.m2 = self.m2 + m2 + delta * delta * self.n * n / total
        self.mean = self.mean + delta * n / total
        if isinstance(lo, int) and isinstance(self.lo, int):  # exact integers
            self.lo, self.hi = min(self.lo, lo), max(self.hi, hi)
        else:
            self.lo, self.hi = np.minimum(self.lo, lo), np.maximum(self.hi, hi)
        self.ss, self.n = self.ss + ss, total

    def result(self):
        return dict(min=self.lo, max=self.hi, mean=self.mean, std=math.sqrt(self.m2 / self.n),
                    l2=math.sqrt(self.ss), nan=self.nan, inf=self.inf)


def _allocated_chunks(dset):
    """Offsets of the chunks of a chunked dataset that hold data (the rest
    read as the fill value), or None when HDF5 cannot list them."""
    offsets = []
    if hasattr(dset.id, "chunk_iter"):  # h5py 3.8 and later
        dset.id.chunk_iter(lambda info: offsets.append(info.chunk_offset))
    elif hasattr(dset.id, "get_num_chunks"):
        offsets = [dset.id.get_chunk_info(i).chunk_offset
                   for i in range(dset.id.get_num_chunks())]
    else:
        return None
    return offsets


def _numeric_stats(dset, name):
    """The statistics of a numeric dataset read BLOCK_BYTES at a time: a
    chunked one chunk by chunk (the chunks never written count as the fill
    value without being read), so a small file declaring a huge dataset
    costs neither the memory nor the time of its declared size."""
    acc = _Stats()
    if dset.nbytes <= BLOCK_BYTES:
        acc.add(dset[...])
        return acc.result()
    chunks = dset.chunks
    offsets = _allocated_chunks(dset) if chunks else None
    if offsets is not None:
        chunk_bytes = int(np.prod(chunks, dtype=np.int64)) * dset.dtype.itemsize
        if chunk_bytes > BLOCK_BYTES:
            raise UserError(f"dataset '{name}' has chunks of {chunk_bytes} bytes; inspect reads "
                            f"at most {BLOCK_BYTES} bytes at a time")
        covered = 0
        for offset in offsets:
            part = dset[tuple(slice(o, min(o + c, s))
                              for o, c, s in zip(offset, chunks, dset.shape))]
            covered += part.size
            acc.add(part)
        acc.add_constant(dset.fillvalue, dset.size - covered)
        return acc.result()
    if not chunks and dset.id.get_storage_size() == 0:  # never written: the fill value
        acc.add_constant(dset.fillvalue, dset.size)
        return acc.result()
    for index in _slabs(dset.shape, dset.dtype.itemsize):
        acc.add(dset[index])
    return acc.result()


def _describe(path):
    with open_h5(path, "file") as f, _read_errors(path):
        datasets = []
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf show up as such
            for name, dset in _datasets(f).items():
                with _read_errors(path, name):
                    datasets.append(_stats(name, dset))
        return {"path": str(path), "attrs": _shown_attrs(f), "datasets": datasets}


def _stats(name, dset):
    entry = {"name": name}
    if dset.shape is None:  # a null dataspace (h5py.Empty): a dtype, no value at all
        entry.update(shape=None, dtype=str(dset.dtype), value="<null dataspace: no value>")
        return entry
    if plain_attr(dset.attrs.get(KIND)) != "json" and _numeric(dset):
        entry.update(shape=list(dset.shape), dtype=str(dset.dtype))
        if dset.size:
            entry.update(_numeric_stats(dset, name))
        return entry
    value = _small_value(dset)
    import h5py
    base = None if _is_text(dset) else h5py.check_vlen_dtype(dset.dtype)
    if base is not None:  # variable-length sequences of numbers (an array of arrays)
        entry.update(shape=list(dset.shape), dtype=f"vlen {np.dtype(base)}")
    elif isinstance(value, np.ndarray):
        entry.update(shape=list(value.shape), dtype=str(value.dtype))
    elif value is None and not _is_text(dset):
        entry.update(shape=list(dset.shape), dtype=str(dset.dtype))
    elif value is None:
        entry.update(shape=list(dset.shape), dtype="string",
                     value=f"<{dset.size} strings, not shown>")
    else:
        entry.update(shape=[], dtype="string", value=str(value))
    return entry


#: control characters as their escapes (a name with a newline keeps its table row)
_CONTROL = {c: repr(chr(c))[1:-1] for c in (*range(32), 127)}


def _one_line(name):
    """A dataset's name as the table shows it: one line, control characters
    escaped (``\\n``); the JSON keeps it as it is."""
    return name.translate(_CONTROL)


def _diff_parts(a, b):
    """Index tuples covering two datasets of one shape BLOCK_BYTES at a
    time, and the count of values both hold as their fill value unread:
    with the same chunks only the chunks either file wrote are read."""
    itemsize = max(a.dtype.itemsize, b.dtype.itemsize)
    if a.chunks and a.chunks == b.chunks and a.nbytes > BLOCK_BYTES:
        offsets = [_allocated_chunks(d) for d in (a, b)]
        chunk_bytes = int(np.prod(a.chunks, dtype=np.int64)) * itemsize
        if None not in offsets and chunk_bytes <= BLOCK_BYTES:
            parts = [tuple(slice(o, min(o + c, s)) for o, c, s in zip(offset, a.chunks, a.shape))
                     for offset in sorted(set(map(tuple, offsets[0] + offsets[1])))]
            covered = sum(int(np.prod([p.stop - p.start for p in part])) for part in parts)
            return parts, a.size - covered
    return (list(_slabs(a.shape, itemsize)) if a.ndim else [()]), 0


def _diff_pair(a, b, row, paths):
    """max_abs_diff and rel_l2_diff of two numeric datasets of one shape,
    read BLOCK_BYTES at a time, and ``unread_fill``: how many values
    neither file wrote were compared as the two fill values, unread; a
    read that fails names its file of ``paths`` (a's, b's)."""
    sums = np.zeros(3)  # ||x||^2, ||y||^2, ||x - y||^2
    biggest = 0.0
    parts, fill = _diff_parts(a, b)
    with np.errstate(invalid="ignore", over="ignore"):
        for index in parts:
            with _read_errors(paths[0], row["name"]):
                x = a[index]
            with _read_errors(paths[1], row["name"]):
                y = b[index]
            part_sums, part_max = _diff_sums(x, y)
            sums += part_sums
            biggest = np.maximum(biggest, part_max)
        if fill:  # as that many copies of the fill values: NaN and NaN are equal
            part_sums, part_max = _diff_sums(np.asarray(a.fillvalue), np.asarray(b.fillvalue))
            sums += part_sums * fill
            biggest = np.maximum(biggest, part_max)
        xx, yy, dd = map(float, sums)
        norm = max(math.sqrt(xx), math.sqrt(yy))
        # equal values (NaN and infinities in the same places too) are no
        # difference whatever their norm
        row.update(max_abs_diff=float(biggest),
                   rel_l2_diff=0.0 if dd == 0 else math.sqrt(dd) / norm if norm else 0.0,
                   unread_fill=fill)


def _diff_sums(raw_x, raw_y):
    """([||x||^2, ||y||^2, ||x - y||^2], max |x - y|) of two arrays of one
    shape, in float64."""
    x = np.asarray(raw_x, dtype=np.float64)
    y = np.asarray(raw_y, dtype=np.float64)
    d = _difference(raw_x, raw_y, x, y)
    # the norms leave out a NaN or an infinity in the same place of both (no
    # difference: d is 0 there); one on one side only makes d, so dd and the
    # figures, nan or inf
    keep = ~((np.isnan(x) & np.isnan(y)) | (np.isinf(x) & (x == y)))
    return (np.array([np.sum(x[keep] ** 2), np.sum(y[keep] ** 2), np.sum(d * d)]),
            float(np.max(np.abs(d))))


def _difference(raw_x, raw_y, x, y):
    """``raw_x - raw_y`` as float64 (``x``, ``y``: the values as float64):
    integers subtracted exactly before the conversion (two int64 or uint64
    that float64 rounds to one value still differ), and a NaN or an
    infinity in the same place of both is no difference (NumPy's
    ``array_equal(..., equal_nan=True)``)."""
    raw_x, raw_y = np.asarray(raw_x), np.asarray(raw_y)
    kinds = raw_x.dtype.kind + raw_y.dtype.kind
    if kinds in ("ii", "uu"):
        wide = np.int64 if kinds == "ii" else np.uint64
        wx, wy = raw_x.astype(wide), raw_y.astype(wide)
        # |x - y| < 2**64 is exact in uint64's modular arithmetic
        ux, uy = wx.astype(np.uint64), wy.astype(np.uint64)
        magnitude = np.where(wx >= wy, ux - uy, uy - ux).astype(np.float64)
        return np.where(wx >= wy, magnitude, -magnitude)
    d = x - y
    same = (x == y) | (np.isnan(x) & np.isnan(y))
    return np.where(same, 0.0, d)


def _diff(path, other):
    with open_h5(path, "file") as fa, open_h5(other, "file") as fb, _read_errors(path):
        a_sets, b_sets = _datasets(fa), _datasets(fb)
        a_attrs, b_attrs = _shown_attrs(fa), _shown_attrs(fb)
        rows = []
        for name in a_sets:
            if name not in b_sets:
                continue
            a, b = a_sets[name], b_sets[name]
            row = {"name": name}
            if a.shape is None or b.shape is None:  # null dataspaces: no values to compare
                row["equal"] = a.shape is None and b.shape is None and a.dtype == b.dtype
                rows.append(row)
                continue
            numeric = all(_numeric(d) and plain_attr(d.attrs.get(KIND)) != "json" for d in (a, b))
            if numeric and a.shape != b.shape:
                row["shapes"] = [list(a.shape), list(b.shape)]
            elif numeric and a.size:
                _diff_pair(a, b, row, (path, other))
            elif numeric:
                row.update(max_abs_diff=0.0, rel_l2_diff=0.0, unread_fill=0)
            else:
                with _read_errors(path, name):
                    x = _small_value(a)
                with _read_errors(other, name):
                    y = _small_value(b)
                # values of other kinds (a record array beside floats) are not equal
                row["equal"] = x is not None and y is not None and _same(x, y)
            rows.append(row)
    attrs = {k: [a_attrs.get(k), b_attrs.get(k)] for k in list(a_attrs) + [
        k for k in b_attrs if k not in a_attrs] if not _same(a_attrs.get(k), b_attrs.get(k))}
    return {"other": str(other), "datasets": rows,
            "only_in_first": [n for n in a_sets if n not in b_sets],
            "only_in_second": [n for n in b_sets if n not in a_sets],
            "attrs": attrs}


def _same(a, b):
    """Whether two values (arrays, strings, numbers) are equal; values that
    cannot be compared (a record array and floats) are not."""
    try:
        if any(isinstance(v, np.ndarray) and v.dtype == object for v in (a, b)):
            # variable-length sequences: an array of arrays, compared element by element
            a, b = np.asarray(a, dtype=object), np.asarray(b, dtype=object)
            return a.shape == b.shape and all(_same(x, y) for x, y in zip(a.flat, b.flat))
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            try:  # NaN in the same place is no difference, as in a dataset's diff
                return bool(np.array_equal(a, b, equal_nan=True))
            except TypeError:  # values without NaN (strings, records)
                return bool(np.array_equal(a, b))
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        return bool(a == b)
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
    if isinstance(value, bytes):  # an attribute of raw bytes (np.void, np.bytes_)
        return value.decode("utf-8", errors="backslashreplace")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)  # JSON has no complex number (nor any other type): its text


def _fmt(value):
    return f"{value:.6g}" if isinstance(value, (float, np.floating)) else str(value)


def _format_text(report):
    lines = [f"file {report['path']}"]
    for key, value in report["attrs"].items():
        if isinstance(value, str) and "\n" in value:
            value = f"<{len(value.splitlines())} lines of text>"
        lines.append(f"  @{key} = {_fmt(value)}")
    width = max([len(_one_line(d["name"])) for d in report["datasets"]] + [7])
    lines.append(f"{'dataset':<{width}}  {'shape':<16} {'dtype':<8} {'min':>11} {'max':>11} "
                 f"{'mean':>11} {'std':>11} {'l2':>11}")
    for d in report["datasets"]:
        shape = "null" if d["shape"] is None else "x".join(str(s) for s in d["shape"]) or "scalar"
        line = f"{_one_line(d['name']):<{width}}  {shape:<16} {d['dtype']:<8}"
        if "min" in d:
            line += "".join(f" {_fmt(d[k]):>11}" for k in ("min", "max", "mean", "std", "l2"))
            bad = [f"{d[k]:,} {k}" for k in ("nan", "inf") if d.get(k)]
            if bad:  # how many of the values make the figures nan or inf
                line += f"  ({', '.join(bad)} of {math.prod(d['shape']):,})"
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
                if row["unread_fill"]:  # compared as the fill values, not read
                    tail += (f"  ({row['unread_fill']:,} values written by neither file, "
                             "compared as their fill values)")
            elif "shapes" in row:
                tail = f"shapes differ: {row['shapes'][0]} vs {row['shapes'][1]}"
            else:
                tail = "equal" if row["equal"] else "differs"
            lines.append(f"{_one_line(row['name']):<{width}}  {tail}")
        for label, names in (("only in first", diff["only_in_first"]),
                             ("only in second", diff["only_in_second"])):
            if names:
                lines.append(f"{label}: {', '.join(map(_one_line, names))}")
        for key, (a, b) in diff["attrs"].items():
            if isinstance(a, str) and "\n" in a or isinstance(b, str) and "\n" in b:
                lines.append(f"attribute @{key} differs")
            else:
                lines.append(f"attribute @{key}: {_fmt(a)} vs {_fmt(b)}")
    return "\n".join(lines)
