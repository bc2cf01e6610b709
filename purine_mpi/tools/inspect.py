"""``inspect CKPT.h5 [--diff OTHER.h5] [--json]``: what a checkpoint holds
(attributes, every blob with its shape, dtype and statistics) and how two
differ, as text or JSON. Reads through job/checkpoint_file.py.
"""
import json
import math

import numpy as np

from ..base.errors import UserError, one_line
from ..data.h5links import Alias
from ..job.checkpoint_file import KIND, open_h5, plain_attr


# ------------------------------------------------------------------ inspect
def inspect_checkpoint(path, diff=None, as_json=False):
    """Every dataset of ``path`` with shape, dtype and statistics (min, max,
    mean, std, L2 norm) and the root attributes; with ``diff`` (another file)
    per common dataset the max abs difference and the relative L2 difference
    ``||a - b|| / max(||a||, ||b||)``, and the datasets only one file has.
    Returns text, or a JSON string with the same content when ``as_json``."""
    links, aliases = {}, []
    with open_h5(path, "file", links) as f, _read_errors(path):
        sets = _datasets(f, links, aliases)  # one walk of the file for both
        try:
            report = _describe(path, f, sets)
            report["aliases"] = [dict(a, name=_text(a["name"]), alias_of=_text(a["alias_of"]))
                                 for a in aliases]
            if diff is not None:
                report["diff"] = _diff(path, diff, f, sets, aliases)
        finally:
            sets.clear()  # each dataset closed here, not looked for by the file's close
    if as_json:
        return json.dumps(_jsonable(report))
    return _format_text(report)


#: the most bytes inspect holds of one dataset at a time
BLOCK_BYTES = 64 << 20


def _read_errors(path, name=None):
    """HDF5's errors on a damaged file, and memory, as one UserError naming
    the file (and ``name``, the dataset being read, when given)."""
    return _ReadErrors(path, name)


class _ReadErrors:
    """The context manager of ``_read_errors`` (a class: one per dataset of
    a file of many costs less than a generator's)."""

    def __init__(self, path, name):
        self.path, self.name = path, name

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if kind is None or issubclass(kind, UserError):
            return False
        if issubclass(kind, (OSError, KeyError, ValueError, RuntimeError)):
            at = f" (dataset '{one_line(self.name)}')" if self.name else ""
            raise UserError(f"'{self.path}' is corrupt{at}: {kind.__name__}: {one_line(e)}") \
                from None
        if issubclass(kind, MemoryError):
            raise UserError(f"'{self.path}': a dataset does not fit in memory "
                            f"({BLOCK_BYTES >> 20} MiB at a time is read)") from None
        return False


def _datasets(f, links, aliases=None):
    """{"/name": dataset} of every dataset of an open file, under its first
    name, from ``links``, what open_h5's walk found (every link, HDF5's own
    visit, which enters each group once: a group linking to its own parent
    ends there). Each second name of an object (a second hard link to a
    dataset or group, a soft link to one) goes to ``aliases``, a list, as
    {"name", "alias_of", "kind", "link"} (``alias_of`` its first name),
    never as a second entry nor walked into (open_h5 has refused the
    dangling soft links and the external links, which are never followed).
    A name that is not UTF-8 is a key with surrogate escapes (``_text``
    shows it)."""
    import h5py
    found = {}
    for name, ids in links.items():
        shown = "/" + name.decode("utf-8", "surrogateescape")
        if isinstance(ids, Alias):
            if aliases is not None:
                aliases.append({"name": shown, "alias_of": ids.target.decode(
                    "utf-8", "surrogateescape"), "kind": "group" if ids.group else "dataset",
                    "link": "soft" if ids.soft else "hard"})
            continue
        if ids is None:  # a soft link the walk did not resolve to a first name
            oid = h5py.h5o.open(f.id, name)
            if not isinstance(oid, h5py.h5d.DatasetID):
                continue
            ids = oid, oid.get_create_plist()
        found[shown] = _Dataset(*ids)
    links.clear()
    return found


def _reached(f, names):
    """{"/name": dataset} of each of ``names`` (keys of another file's
    listing) that is a dataset of the open file ``f`` though its walk did
    not list it: an alias (a second hard link or a soft link to the
    dataset), or a name through an alias of a group, which the listing
    does not walk into (a group linking to its parent would give names
    without end). Looked up one
    name at a time: ``f`` has passed open_h5's check, so a name resolves
    inside the file or not at all."""
    import h5py
    found = {}
    for name in names:
        try:
            oid = h5py.h5o.open(f.id, name.encode("utf-8", "surrogateescape"))
        except (KeyError, ValueError, RuntimeError):  # not a name of f
            continue
        if isinstance(oid, h5py.h5d.DatasetID):
            found[name] = _Dataset(oid, oid.get_create_plist())
    return found


class _Dataset:
    """A dataset (its DatasetID) whose shape, dtype, sizes and chunks are
    looked up once, straight from HDF5 (h5py's Dataset asks again at each
    use, and building one costs more than reading a small dataset: a file
    of 20,000 of them); anything else is h5py.Dataset's, built on first use."""

    def __init__(self, oid, dcpl):
        import h5py
        self.id, self.dcpl, self._dset = oid, dcpl, None
        self.shape, self.dtype = oid.shape, oid.dtype
        self.chunks = dcpl.get_chunk() if dcpl.get_layout() == h5py.h5d.CHUNKED else None
        self.ndim = 0 if self.shape is None else len(self.shape)
        self.size = 0 if self.shape is None else math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize

    def __getattr__(self, key):
        if key.startswith("__") or key == "_dset":
            raise AttributeError(key)
        return getattr(self._h5(), key)

    def __getitem__(self, index):
        return self._h5()[index]

    def _h5(self):
        if self._dset is None:
            import h5py
            self._dset = h5py.Dataset(self.id)
        return self._dset


def _shown_attrs(obj):
    """An object's attributes as plain Python (job/checkpoint_file.read_attrs),
    text as it is shown: bytes that are not UTF-8 (an ASCII string
    attribute holding \xe9, a name that is not UTF-8) as escapes, not
    replaced by U+FFFD nor as lone surrogates (which no terminal prints); a
    reference as ``<reference to /path>`` (what it points to); one larger
    than BLOCK_BYTES by its size, unread."""
    import h5py
    shown = {}
    for key in obj.attrs:  # h5py's names: text, or bytes that are not UTF-8
        raw = key if isinstance(key, bytes) else key.encode("utf-8")
        try:
            size = h5py.h5a.open(obj.id, raw).get_storage_size()
        except RuntimeError:  # HDF5 says 0 as an error: an empty (h5py.Empty) attribute
            size = 0
        if size > BLOCK_BYTES:
            shown[_text(key)] = f"<{size:,} bytes, not read>"
            continue
        value = _no_refs(obj.attrs[key], obj.file)
        shown[_text(key)] = _text(value) if isinstance(value, (bytes, str, np.ndarray)) \
            else plain_attr(value)
    return shown


def _ref_text(ref, f):
    """What an HDF5 reference points to: ``<reference to /path>`` (a region
    reference adds its selection), ``<null reference>`` for none."""
    import h5py
    if not ref:
        return "<null reference>"
    name = h5py.h5r.get_name(ref, f.id)
    where = "?" if name is None else name.decode("utf-8", "surrogateescape")
    if isinstance(ref, h5py.RegionReference):
        space = h5py.h5r.get_region(ref, f.id)
        kind = space.get_select_type()
        if kind == h5py.h5s.SEL_HYPERSLABS:
            where += f" blocks {space.get_select_hyper_blocklist().tolist()}"
        elif kind == h5py.h5s.SEL_POINTS:
            where += f" points {space.get_select_elem_pointlist().tolist()}"
        else:
            where += " all" if kind == h5py.h5s.SEL_ALL else " none"
        return f"<region reference to {where}>"
    return f"<reference to {where}>"


def _no_refs(value, f):
    """``value`` with every HDF5 reference in it (a scalar, an array of
    them) as the text of what it points to (``_ref_text``): two files'
    references compare by their targets, not by their addresses."""
    import h5py
    if isinstance(value, h5py.Reference):
        return _ref_text(value, f)
    if isinstance(value, np.ndarray) and value.dtype == object and value.size and \
            any(isinstance(v, h5py.Reference) for v in value.flat):
        return np.array([_ref_text(v, f) if isinstance(v, h5py.Reference) else v
                         for v in value.flat], dtype=object).reshape(value.shape)
    return value


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
    return h5py.check_string_dtype(dset.dtype) is not None or _kind(dset) == "json"


def _kind(dset):
    """A dataset's purine_kind attribute ("json" for JSON text), or None:
    looked up without reading the attributes of every dataset."""
    import h5py
    if not h5py.h5a.exists(dset.id, KIND.encode()):
        return None
    return plain_attr(dset.attrs.get(KIND))


def _numeric(dset):
    return dset.dtype.kind in "biuf"


#: the dtype shown for a dataset of HDF5 references, by h5py's check_ref_dtype
def _ref_kind(dtype):
    import h5py
    ref = h5py.check_ref_dtype(dtype)
    if ref is None:
        return None
    return "region reference" if ref is h5py.RegionReference else "object reference"


#: the most references --diff compares (each is looked up in its file)
MAX_REFS = 100_000


def _missing_filter(dset):
    """The name of a filter (compression) a dataset needs that this HDF5
    lacks, or None: its values cannot be read here, which is no damage."""
    import h5py
    if dset.chunks is None:  # filters apply to chunked datasets only
        return None
    dcpl = dset.dcpl  # fetched once, by the walk (_Dataset)
    for i in range(dcpl.get_nfilters()):
        code, _, _, name = dcpl.get_filter(i)
        if not h5py.h5z.filter_avail(code):
            name = one_line(name.decode("utf-8", "backslashreplace"))[:20]
            return f"{code} ({name})" if name else str(code)
    return None


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
        if not np.isfinite(x).all():  # (one pass where every value is finite, the rule)
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
        acc.add(_read_whole(dset))
        return acc.result()
    chunks = dset.chunks
    offsets = _allocated_chunks(dset) if chunks else None
    if offsets is not None:
        chunk_bytes = int(np.prod(chunks, dtype=np.int64)) * dset.dtype.itemsize
        if chunk_bytes > BLOCK_BYTES:
            raise UserError(f"dataset '{one_line(name)}' has chunks of {chunk_bytes} bytes; "
                            f"inspect reads at most {BLOCK_BYTES} bytes at a time")
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


def _read_whole(dset):
    """A numeric dataset's values in one read (HDF5's own, without h5py's
    selection machinery: a file of many small datasets)."""
    import h5py
    out = np.empty(dset.shape, dtype=dset.dtype)
    dset.id.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
    return out


def _describe(path, f, sets):
    """The report of the open file ``f`` (``path``), its datasets ``sets``."""
    datasets = []
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf show up as such
        for name, dset in sets.items():
            with _read_errors(path, name):
                datasets.append(_stats(_text(name), dset))
    return {"path": str(path), "attrs": _shown_attrs(f), "datasets": datasets}


def _stats(name, dset):
    entry = {"name": name}
    if dset.shape is None:  # a null dataspace (h5py.Empty): a dtype, no value at all
        entry.update(shape=None, dtype=str(dset.dtype), value="<null dataspace: no value>")
        return entry
    ref = _ref_kind(dset.dtype)
    if ref:  # what references point to is no statistic (--diff compares the targets)
        entry.update(shape=list(dset.shape), dtype=ref)
        return entry
    missing = _missing_filter(dset)
    if missing:  # no damage: this HDF5 cannot decompress it
        entry.update(shape=list(dset.shape), dtype=str(dset.dtype),
                     value=f"<not read: HDF5 filter {missing} missing>")
        return entry
    if _kind(dset) != "json" and _numeric(dset):
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
    whole = len(parts) == 1 and max(a.nbytes, b.nbytes) <= BLOCK_BYTES  # one read each
    with np.errstate(invalid="ignore", over="ignore"):
        for index in parts:
            with _read_errors(paths[0], row["name"]):
                x = _read_whole(a) if whole else a[index]
            with _read_errors(paths[1], row["name"]):
                y = _read_whole(b) if whole else b[index]
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
    if kinds in ("iu", "ui"):  # int64 against uint64: exact where both are >= 0
        nonneg = (raw_x >= 0) & (raw_y >= 0)
        ux = np.where(nonneg, raw_x, 0).astype(np.uint64)
        uy = np.where(nonneg, raw_y, 0).astype(np.uint64)
        magnitude = np.where(ux >= uy, ux - uy, uy - ux).astype(np.float64)
        # one negative, the other not: |x - y| >= 1 in float64 too, never 0
        return np.where(nonneg, np.where(ux >= uy, magnitude, -magnitude), x - y)
    d = x - y
    same = (x == y) | (np.isnan(x) & np.isnan(y))
    return np.where(same, 0.0, d)


def _diff(path, other, fa, a_sets, a_aliases):
    """The diff of the open file ``fa`` (``path``, its datasets ``a_sets``
    and second names ``a_aliases``) against the file ``other``."""
    b_links, b_aliases = {}, []
    with open_h5(other, "file", b_links) as fb, _read_errors(path):
        b_sets = _datasets(fb, b_links, b_aliases)
        a_of, b_of = ({a["name"]: a["alias_of"] for a in aliases}
                      for aliases in (a_aliases, b_aliases))
        # a second name of the same first name in both files: compared there
        same = {n for n in a_of if b_of.get(n) == a_of[n]}
        a_names, b_names = ([n for n in sets if n not in same] +
                            [a["name"] for a in aliases if a["kind"] == "dataset" and
                             a["name"] not in same]
                            for sets, aliases in ((a_sets, a_aliases), (b_sets, b_aliases)))
        # a name one file lists (or has as a second name of a dataset) that
        # the other reaches only through a second name (of a dataset, of a
        # group: not listed) is compared there, not called "only in"
        a_more = _reached(fa, [n for n in b_names if n not in a_sets])
        b_more = _reached(fb, [n for n in a_names if n not in b_sets])
        try:
            a_all, b_all = {**a_sets, **a_more}, {**b_sets, **b_more}
            rows = _diff_rows(path, other, a_all, b_all)
            only = ([_text(n) for n in a_names if n not in b_all],
                    [_text(n) for n in b_names if n not in a_all])
        finally:
            for sets in (b_sets, a_more, b_more):
                sets.clear()  # each dataset closed here, not looked for by the file's close
        a_attrs, b_attrs = _shown_attrs(fa), _shown_attrs(fb)
    attrs, unchecked = {}, []
    for k in list(a_attrs) + [k for k in b_attrs if k not in a_attrs]:
        try:
            if not _same(a_attrs.get(k), b_attrs.get(k)):
                attrs[k] = [a_attrs.get(k), b_attrs.get(k)]
        except _NotCompared:  # references inside records
            unchecked.append(k)
    # a name that is a second name in one file and not (or of another first
    # name) in the other: its values compare as any dataset's, this says so
    aliases = [{"name": _text(n), "first": _text(a_of.get(n)), "second": _text(b_of.get(n))}
               for n in list(a_of) + [n for n in b_of if n not in a_of]
               if a_of.get(n) != b_of.get(n)]
    report = {"other": str(other), "datasets": rows,
              "only_in_first": only[0], "only_in_second": only[1],
              "aliases": aliases, "attrs": attrs}
    if unchecked:
        report["attrs_not_compared"] = unchecked
    return report


def _diff_rows(path, other, a_sets, b_sets):
    """The diff's row of each dataset both files have (``a_sets`` of
    ``path``, ``b_sets`` of ``other``)."""
    rows = []
    for name in a_sets:
        if name not in b_sets:
            continue
        a, b = a_sets[name], b_sets[name]
        row = {"name": _text(name)}
        if a.shape is None or b.shape is None:  # null dataspaces: no values to compare
            row["equal"] = a.shape is None and b.shape is None and a.dtype == b.dtype
            rows.append(row)
            continue
        if _ref_kind(a.dtype) or _ref_kind(b.dtype):
            row.update(_diff_refs(a, b, (path, other)))
            rows.append(row)
            continue
        missing = _missing_filter(a) or _missing_filter(b)
        if missing:
            row.update(equal=None, not_compared=f"HDF5 filter {missing} missing here")
            rows.append(row)
            continue
        numeric = all(_numeric(d) and _kind(d) != "json" for d in (a, b))
        if numeric and a.dtype != b.dtype:  # equal values may be of two types: said
            row["dtypes"] = [str(a.dtype), str(b.dtype)]
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
            try:
                row["equal"] = x is not None and y is not None and _same(x, y)
            except _NotCompared as e:
                row.update(equal=None, not_compared=str(e))
        rows.append(row)
    for row in rows:
        _status(row)
    return rows


def _status(row):
    """A --diff row's verdict, plain: ``status`` "equal", "differs" or
    "not_compared", and ``equal`` true, false or null (not compared) on
    every row, numeric ones too (equal: every value the same, NaN and
    infinities in the same places): a reader testing ``not row["equal"]``
    would take null for a difference, ``status`` says which."""
    if "max_abs_diff" in row:
        row["equal"] = row["max_abs_diff"] == 0.0  # a NaN on one side only: nan, differs
    elif "shapes" in row:
        row["equal"] = False
    row["status"] = ("not_compared" if row["equal"] is None else
                     "equal" if row["equal"] else "differs")


class _NotCompared(Exception):
    """Two values inspect does not compare (the text says why)."""


def _diff_refs(a, b, paths):
    """A --diff row's verdict on datasets of HDF5 references: equal when
    both point, element by element, to the same paths (a region reference
    to the same selection too) in their own files; not compared beyond
    MAX_REFS references; a null reference equals only a null one."""
    if _ref_kind(a.dtype) != _ref_kind(b.dtype) or a.shape != b.shape:
        return {"equal": False}
    if a.size > MAX_REFS:
        return {"equal": None, "not_compared": f"{a.size:,} references; at most {MAX_REFS:,} "
                                               "are compared"}
    targets = []
    for dset, path in zip((a, b), paths):
        with _read_errors(path, dset.name):
            values = np.asarray(dset[()], dtype=object).reshape(-1)
            targets.append([_ref_text(v, dset.file) for v in values])
    return {"equal": targets[0] == targets[1]}


def _same(a, b):
    """Whether two values (arrays, strings, numbers) are equal; values that
    cannot be compared (a record array and floats) are not. Records compare
    field by field (NaN in the same place is no difference); an HDF5
    reference in a record or sequence raises _NotCompared (its target is
    not looked up there)."""
    import h5py
    if isinstance(a, h5py.Reference) or isinstance(b, h5py.Reference):
        raise _NotCompared("holds HDF5 references")
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and (a.dtype.names or
                                                                   b.dtype.names):
        if a.dtype.names != b.dtype.names or a.shape != b.shape:
            return False
        return all(_same(np.asarray(a[n]), np.asarray(b[n])) for n in a.dtype.names)
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
    except _NotCompared:
        raise
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


#: the most characters of an attribute's value the text form shows
ATTR_CHARS = 200


def _attr_line(value):
    """An attribute's value as the text form shows it: one line (an array
    without NumPy's line breaks, control characters escaped), at most
    ATTR_CHARS characters (a longer one cut, with its length); multi-line
    text as ``<N lines of text>``."""
    if isinstance(value, str) and "\n" in value:
        return f"<{len(value.splitlines())} lines of text>"
    if isinstance(value, np.ndarray):
        text = np.array2string(value, max_line_width=1 << 30)  # summarised beyond 1000 values
        text = text.replace("\n", "")
    else:
        text = _fmt(value)
    text = one_line(text)
    if len(text) > ATTR_CHARS:
        text = f"{text[:ATTR_CHARS - 3]}... ({len(text):,} characters)"
    return text


def _format_text(report):
    lines = [f"file {one_line(report['path'])}"]
    for key, value in report["attrs"].items():
        lines.append(f"  @{one_line(key)} = {_attr_line(value)}")
    aliases = report.get("aliases", [])
    width = max([len(one_line(d["name"])) for d in report["datasets"] + aliases] + [7])
    lines.append(f"{'dataset':<{width}}  {'shape':<16} {'dtype':<8} {'min':>11} {'max':>11} "
                 f"{'mean':>11} {'std':>11} {'l2':>11}")
    for d in report["datasets"]:
        shape = "null" if d["shape"] is None else "x".join(str(s) for s in d["shape"]) or "scalar"
        line = f"{one_line(d['name']):<{width}}  {shape:<16} {d['dtype']:<8}"
        if "min" in d:
            line += "".join(f" {_fmt(d[k]):>11}" for k in ("min", "max", "mean", "std", "l2"))
            bad = [f"{d[k]:,} {k}" for k in ("nan", "inf") if d.get(k)]
            if bad:  # how many of the values make the figures nan or inf
                line += f"  ({', '.join(bad)} of {math.prod(d['shape']):,})"
        elif "value" in d:
            text = one_line(d["value"])
            line += " " + (text if len(text) <= 60 else text[:57] + "...")
        lines.append(line)
    for a in aliases:  # a second name: its object is listed under its first
        how = ", ".join(([] if a["kind"] == "dataset" else ["a group"]) +
                        (["soft link"] if a["link"] == "soft" else []))
        lines.append(f"{one_line(a['name']):<{width}}  alias of {one_line(a['alias_of'])}"
                     + (f" ({how})" if how else ""))
    diff = report.get("diff")
    if diff:
        # its rows' names too: a name reached through an alias is in no listing above
        width = max([width] + [len(one_line(r["name"])) for r in diff["datasets"]])
        lines.append(f"diff against {one_line(diff['other'])}")
        lines.append(f"{'dataset':<{width}}  {'max_abs_diff':>13} {'rel_l2_diff':>13}")
        for row in diff["datasets"]:
            if "max_abs_diff" in row:
                tail = f"{_fmt(row['max_abs_diff']):>13} {_fmt(row['rel_l2_diff']):>13}"
                if "dtypes" in row:
                    tail += f"  (dtypes differ: {row['dtypes'][0]} vs {row['dtypes'][1]})"
                if row["unread_fill"]:  # compared as the fill values, not read
                    tail += (f"  ({row['unread_fill']:,} values written by neither file, "
                             "compared as their fill values)")
            elif "shapes" in row:
                tail = f"shapes differ: {row['shapes'][0]} vs {row['shapes'][1]}"
            elif row["equal"] is None:
                tail = f"not compared ({row['not_compared']})"
            else:
                tail = "equal" if row["equal"] else "differs"
            lines.append(f"{one_line(row['name']):<{width}}  {tail}")
        for label, names in (("only in first", diff["only_in_first"]),
                             ("only in second", diff["only_in_second"])):
            if names:
                lines.append(f"{label}: {', '.join(map(one_line, names))}")
        for a in diff.get("aliases", ()):
            first, second = (f"alias of {one_line(x)}" if x is not None else "not an alias"
                             for x in (a["first"], a["second"]))
            lines.append(f"name {one_line(a['name'])}: {first} in first, {second} in second")
        for key, (a, b) in diff["attrs"].items():
            if isinstance(a, str) and "\n" in a or isinstance(b, str) and "\n" in b:
                lines.append(f"attribute @{one_line(key)} differs")
            else:
                lines.append(f"attribute @{one_line(key)}: {_attr_line(a)} vs {_attr_line(b)}")
        for key in diff.get("attrs_not_compared", ()):
            lines.append(f"attribute @{one_line(key)} not compared (holds HDF5 references)")
    return "\n".join(lines)
