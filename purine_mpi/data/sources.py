"""Data sources and the data-parallel batching rule.

A source holds ``n_samples`` samples of one ``sample_shape`` (float32, or
uint8 for an HDF5 file stored as bytes and for Caffe's LMDB records, see
``data/lmdb_source.py``) with int64 labels and returns any of
them by index (``gather``). An HDF5 split that does not fit the memory budget
is read batch by batch from its (chunked) datasets instead of being loaded. The order in
which samples are read is fixed by ``batch_indices`` (docs/config.md, "Sample order"):

    with N ranks and per-rank batch B, iteration t reads the global sample
    positions [t*N*B, (t+1)*N*B) of the epoch order, and rank r takes
    [r*B, (r+1)*B) of that window. Position p is sample ``order(epoch)[p % n]``
    of epoch ``p // n``, where ``order`` is a permutation that depends only on
    (seed, epoch) when shuffling and the identity otherwise.

So N ranks x B read exactly the samples of 1 rank x N*B, and a run's data
order does not depend on how it is split over ranks.

One pass over a split (a test pass with ``test_iter: null``, ``predict``) is
``pass_batches(n, B, N)`` iterations: the last may reach past position n,
and the positions there wrap around as above but are padding, not samples:
``pass_counts`` says how many samples of each rank's batch count (those at
positions < n), so every sample counts exactly once on any number of ranks.
"""
import functools
import json
import os
import resource
import stat
import threading
import weakref
from collections import OrderedDict

import numpy as np

from ..base import env
from ..base.errors import DataSpecError, UserError, one_line
from ..base.progress_bar import human_bytes
from .filecache import INFO_DIGEST_BYTES, file_identity, per_file_version, same_version
from .h5links import check_sources, link_outside

#: synthetic sources hold at most this many bytes of distinct samples and
#: repeat them beyond (benchmarks with ImageNet-sized shapes stay small)
SYNTHETIC_POOL_BYTES = 64 << 20
#: the block of samples a synthetic pool is made in (its one temporary)
SYNTHETIC_BLOCK_BYTES = 4 << 20


# ------------------------------------------------------------------ sources
class DataSource:
    """Base class: ``n_samples``, ``sample_shape``, ``gather(indices)``."""

    n_samples = 0
    sample_shape = ()

    def gather(self, indices):
        """(data float32 (len, *sample_shape), labels int64 (len,)) of ``indices``."""
        raise NotImplementedError


def gather_labels(source, indices):
    """The labels of samples ``indices`` of ``source``, without their data
    where the source holds its labels apart (``labels``: an HDF5 split, a
    synthetic source; a text source's own ``gather_labels``), else those of
    ``gather``. The data reader counts a global batch's labels with it."""
    own = getattr(source, "gather_labels", None)
    if own is not None:
        return own(indices)
    labels = getattr(source, "labels", None)
    if isinstance(labels, np.ndarray):
        return labels[indices]
    return source.gather(indices)[1]


def data_hint(data_path, what="data file"):
    """How to make the missing data file ``data_path``, by the data set its
    name suggests (a text data file: ``data text``)."""
    name = os.path.basename(str(data_path)).lower()
    if what == "text data file":
        return (f"make it with 'python -m purine_mpi data text --from PATH --out {data_path}' "
                "(PATH: a UTF-8 file or a folder, e.g. a package of Python's standard library "
                "with --glob '*.py')")
    if "cifar" in name:
        return (f"make it with 'python -m purine_mpi data cifar10 --download --out {data_path}' "
                "(or --from DIR with the unpacked python batches)")
    if "digit" in name:
        return f"make it with 'python -m purine_mpi data digits --out {data_path}'"
    return ("convert your data to the HDF5 layout of docs/formats.md ('HDF5 data files'); "
            "'python -m purine_mpi data digits|cifar10 --out PATH.h5' writes the bundled sets")


@functools.lru_cache(maxsize=None)
def _info_reader(split, external):
    """The reader of a file's (split, external) answer of ``hdf5_info``:
    one function per pair, under which filecache.per_file_version keeps
    the answer of each file's version."""
    return lambda path: _read_hdf5_info(path, split, external)


def hdf5_info(path, split=None, external=False):
    """(n_samples, sample_shape) of an HDF5 data file's split, reading only
    metadata. Raises UserError naming the file and dataset when the file is
    missing, not HDF5, or the layout is wrong (data must be N x C x H x W
    float, label 1-D integer of the same N), or when the split's data or
    label reads from another file (data/h5links.py) without ``external``
    (the data spec's key), or with it from a file that is missing or short."""
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise UserError(f"data file '{path}' is a folder, not a file; give the file's path")
    if st is None or not stat.S_ISREG(st.st_mode):
        raise UserError(f"data file '{path}' not found; {data_hint(path)}")
    # a start-up asks ~25 times of one file (each op's shapes, the plan, the
    # notes), 5 ms an open: the answer is read once per file version (a
    # file replaced or rewritten is read again; metadata only, so a racy
    # file over INFO_DIGEST_BYTES is not hashed but read each time); only
    # answers are kept, never errors
    return per_file_version(path, _info_reader(split, bool(external)), digest=INFO_DIGEST_BYTES)


def _read_hdf5_info(path, split, external):
    import h5py
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise UserError(f"data file '{path}' cannot be opened as HDF5 ({e})") from None
    try:
        with f:
            _check_outside(f, path, split, external)
            return _layout(f, path, split)
    except (OSError, KeyError, RuntimeError, ValueError) as e:  # damaged object headers
        raise UserError(f"data file '{path}' is corrupt: {type(e).__name__}: {e}") from None


def _layout(f, path, split):
    """The split's (n_samples, sample_shape), its layout checked."""
    group, where = _split_group(f, path, split)
    data, label = _dataset(group, "data", path, where), _dataset(group, "label", path, where)
    if data.ndim != 4 or not (data.dtype.kind == "f" or data.dtype == np.uint8):
        raise UserError(f"data file '{path}': dataset '{where}data' must be 4-D float or "
                        f"uint8 (N x C x H x W), got shape {list(data.shape)} dtype "
                        f"{data.dtype}")
    if label.ndim != 1 or label.dtype.kind not in "iu":
        raise UserError(f"data file '{path}': dataset '{where}label' must be 1-D integer "
                        f"(N,), got shape {list(label.shape)} dtype {label.dtype}")
    if data.shape[0] == 0:  # not "has 0 samples but ... has 0"
        raise UserError(f"data file '{path}': '{where}data' holds no samples (shape "
                        f"{list(data.shape)}); a split needs at least 1")
    if label.shape[0] != data.shape[0]:
        raise UserError(f"data file '{path}': '{where}data' has {data.shape[0]} samples but "
                        f"'{where}label' has {label.shape[0]}; they must agree")
    return int(data.shape[0]), tuple(int(s) for s in data.shape[1:])


def _check_outside(f, path, split, external):
    """Refuse a split whose group, data or label reads from another file
    unless the spec opts in; with it, every such file must be there."""
    import h5py
    names = ([f"/{split}"] if split is not None else []) + \
        [f"{'' if split is None else '/' + split}/{n}" for n in ("data", "label")]
    for name in names:
        parent, _, base = name.rpartition("/")
        group = f[parent or "/"]
        if not isinstance(group, h5py.Group) or group.get(base, getlink=True) is None:
            return  # a missing name: _layout says which
        if not external:
            why = link_outside(f, name)
            if why:
                raise UserError(f"data file '{path}': '{name}' is {one_line(why)}; set the data "
                                "spec's 'external: true' to read data kept in other files")
            continue
        try:  # allowed: what it points to must be there
            obj = f[name]
        except (KeyError, OSError) as e:
            raise UserError(f"data file '{path}': '{name}' is {one_line(link_outside(f, name))}, "
                            f"which cannot be read ({type(e).__name__}: {one_line(e)})") from None
        if isinstance(obj, h5py.Dataset):
            check_sources(obj, path, name)


def _split_group(f, path, split):
    if split is None:
        groups = sorted(k for k in f if hasattr(f[k], "keys"))
        if "data" not in f and groups:
            raise DataSpecError(f"data file '{path}' has no top-level 'data' dataset; it has "
                                f"the groups {', '.join(groups)}: set the data spec's 'split' "
                                "to one", "split")
        return f, "/"
    if split not in f or not hasattr(f[split], "keys"):
        groups = ", ".join(sorted(k for k in f if hasattr(f[k], "keys"))) or "none"
        raise DataSpecError(f"data file '{path}' has no group '/{split}' (groups: {groups}); "
                            "check the data spec's 'split'", "split")
    return f[split], f"/{split}/"


def _dataset(group, name, path, where):
    if name not in group or not hasattr(group[name], "shape"):
        raise UserError(f"data file '{path}' has no dataset '{where}{name}'")
    return group[name]


def memory_budget():
    """Bytes of decoded data an HDF5 split may occupy in memory: a quarter of
    the physical memory, or of the address-space limit (``ulimit -v``) when
    that is lower; ``PURINE_DATA_MEMORY_MB`` overrides it."""
    mib = env.get("PURINE_DATA_MEMORY_MB")
    if mib is not None:
        return int(mib * (1 << 20))
    budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        budget = min(budget, limit)
    return budget // 4


class HDF5Source(DataSource):
    """A split of an HDF5 data file (``/split/data``, ``/split/label``, or the
    top-level ``data``/``label`` when ``split`` is None), float or uint8.

    ``in_memory`` (the data spec's key): ``auto`` (default) loads the split
    into memory once per process, shared between readers of the same file,
    when it fits ``memory_budget()``; otherwise (or with ``false``) every
    ``gather`` reads just the rows of its batch from the file (sorted, unique
    indices through h5py, with a chunk cache), in the prefetch thread, so a
    split larger than memory trains. Either way the sample order is the one
    of docs/config.md ("Sample order") and uint8 stays uint8 until the transform step. Labels (N
    integers) are always in memory. A float split kept on disk is read once
    at start-up to check that every value is finite."""

    _cache = {}
    _cache_lock = threading.Lock()
    #: h5py's chunk cache per open file in the on-demand mode
    CHUNK_CACHE_BYTES = 64 << 20

    def __init__(self, path, split=None, in_memory="auto", external=False, identity=None):
        """``identity``: the file's ``filecache.file_identity`` where the
        caller took it just now (``shared_source``: a racy file is hashed
        once, not once per look)."""
        self.path, self.split = path, split
        self.n_samples, self.sample_shape = hdf5_info(path, split, external)
        self.where = "/" if split is None else f"/{split}/"
        decoded = self.n_samples * int(np.prod(self.sample_shape)) * 4
        budget = memory_budget()
        if self.n_samples * 8 > budget:  # the labels are always held in memory
            raise UserError(
                f"data file '{path}': dataset '{self.where}label' holds {self.n_samples} "
                f"labels, {human_bytes(self.n_samples * 8)} in memory as int64, more than the "
                f"data memory budget of {human_bytes(budget)} (a quarter of the memory or of "
                "ulimit -v, or PURINE_DATA_MEMORY_MB); the labels of a split are always kept "
                "in memory: use a smaller split, or raise PURINE_DATA_MEMORY_MB (in MB) if the "
                "memory is there")
        self.in_memory = in_memory is True or (in_memory in ("auto", None)
                                               and decoded <= budget)
        # the file's version (filecache.file_identity: a racy file's digest too)
        if identity is None:
            identity = file_identity(path)
        # one version kept per file and split: an unchanged file loaded while
        # racy is not loaded (nor held) again once it is not
        # (filecache.same_version); a rewritten one replaces the old version
        slot = (os.path.abspath(path), split, self.in_memory)
        with self._cache_lock:
            held = self._cache.get(slot)
            if held is not None and same_version(held[0], identity, path):
                cached = held[1]
                self._cache[slot] = (identity, cached)
            else:
                cached = self._load()
                self._cache[slot] = (identity, cached)
        self.data, self.labels = cached
        self._file = None
        self._read_lock = threading.Lock()

    def _load(self):
        import h5py
        try:
            with h5py.File(self.path, "r") as f:
                group = f if self.split is None else f[self.split]
                try:
                    labels = np.ascontiguousarray(group["label"][...], dtype=np.int64)
                except MemoryError:
                    raise UserError(f"data file '{self.path}': dataset '{self.where}label' "
                                    f"({self.n_samples} labels) does not fit in memory (labels "
                                    "are always kept in memory; PURINE_DATA_MEMORY_MB may be set "
                                    "above what the machine has)") from None
                data = None
                stored = group["data"]
                if self.in_memory:
                    dtype = np.uint8 if stored.dtype == np.uint8 else np.float32
                    data = np.ascontiguousarray(stored[...], dtype=dtype)
                elif stored.dtype.kind == "f":
                    self._scan_finite(stored)
        except (OSError, KeyError) as e:
            raise UserError(f"data file '{self.path}': reading split {self.split!r} failed "
                            f"({e}); the file may be truncated") from None
        if data is not None:
            self._check_finite(data, 0)
            data.setflags(write=False)  # shared between readers: nobody may change it
        labels.setflags(write=False)
        return data, labels

    def _scan_finite(self, stored, block_bytes=64 << 20):
        """Read a float split kept on disk once, a block of rows at a time, so
        a NaN or inf is found at start-up (exit 2, before any training) and
        never in the middle of a run or an evaluation. uint8 data needs no scan."""
        row = max(1, int(np.prod(stored.shape[1:])) * stored.dtype.itemsize)
        step = max(1, block_bytes // row)
        for start in range(0, stored.shape[0], step):
            self._check_finite(np.asarray(stored[start:start + step]), start)

    def _check_finite(self, data, first_index, indices=None):
        if data.dtype.kind != "f":
            return
        finite = np.isfinite(data.reshape(len(data), -1)).all(axis=1)
        if not finite.all():
            bad = np.flatnonzero(~finite)
            at = int(bad[0]) + first_index if indices is None else int(indices[bad[0]])
            raise UserError(f"data file '{self.path}': dataset '{self.where}data' holds "
                            f"non-finite values (NaN or inf) in {len(bad)} sample(s), the "
                            f"first at index {at}; training on them would give a NaN loss")

    def gather(self, indices):
        if self.data is not None:
            return self.data[indices], self.labels[indices]
        import h5py
        indices = np.asarray(indices, dtype=np.int64)
        unique, inverse = np.unique(indices, return_inverse=True)
        with self._read_lock:
            if self._file is None:
                self._file = h5py.File(self.path, "r", rdcc_nbytes=self.CHUNK_CACHE_BYTES,
                                       rdcc_nslots=10007)
            dset = self._file["data"] if self.split is None else self._file[self.split]["data"]
            try:
                rows = dset[unique]
            except (OSError, KeyError) as e:
                raise UserError(f"data file '{self.path}': reading '{self.where}data' failed "
                                f"({e}); the file may be truncated") from None
        if rows.dtype != np.uint8:
            rows = rows.astype(np.float32, copy=False)
        self._check_finite(rows, 0, unique)
        return rows[inverse.reshape(-1)], self.labels[indices]


class SyntheticSource(DataSource):
    """Deterministic random data: sample i is ``center[label_i] + noise_i``
    (so a net can learn it), float32, labels uniform in [0, classes).

    The class centers depend only on ``seed``; the samples also on ``split``,
    so a train and a test source with one seed share their classes but not
    their samples. At most SYNTHETIC_POOL_BYTES of distinct samples are made;
    beyond that sample i repeats sample i % pool (benchmarks only need the
    shapes)."""

    def __init__(self, shape, classes, num_samples=1024, seed=0, split=None):
        self.sample_shape = tuple(int(s) for s in shape)
        self.n_samples, self.classes = int(num_samples), int(classes)
        sample_bytes = 4 * int(np.prod(self.sample_shape))
        pool = max(1, min(self.n_samples, SYNTHETIC_POOL_BYTES // max(sample_bytes, 1)))
        centers = np.random.default_rng([seed, 0x5EED]).standard_normal(
            (self.classes,) + self.sample_shape, dtype=np.float32)
        split_tag = int.from_bytes(str(split).encode()[:8].ljust(8, b"\0"), "little")
        rng = np.random.default_rng([seed, 0xDA7A, split_tag])
        self.labels = rng.integers(0, self.classes, size=self.n_samples, dtype=np.int64)
        noise = rng.standard_normal((pool,) + self.sample_shape, dtype=np.float32)
        self.pool = noise
        # the centers added a block of samples at a time: a whole-pool
        # temporary would double the source's peak (plan's data pool row
        # counts the pool once)
        step = max(1, SYNTHETIC_BLOCK_BYTES // max(sample_bytes, 1))
        for i in range(0, pool, step):
            end = min(i + step, pool)  # labels run on past the pool (repeated samples)
            self.pool[i:end] += centers[self.labels[i:end]]
        self.pool_size = pool
        if pool < self.n_samples:  # repeated samples keep their pool sample's label
            self.labels = self.labels[np.arange(self.n_samples) % pool]

    def gather(self, indices):
        indices = np.asarray(indices)
        return self.pool[indices % self.pool_size], self.labels[indices]


def make_source(spec, seed=0, identity=None):
    """A source from a data spec as in the config (``source: hdf5|lmdb|synthetic``).
    ``seed`` is used for synthetic data when the spec gives no ``seed``;
    ``identity``: its file's ``file_identity`` taken just now, or None."""
    kind = spec.get("source", "hdf5")
    if kind == "hdf5":
        return HDF5Source(spec["path"], spec.get("split"), spec.get("in_memory", "auto"),
                          bool(spec.get("external")), identity=identity)
    if kind == "lmdb":
        from .lmdb_source import LMDBSource
        return LMDBSource(spec["path"])
    if kind == "text":
        from .text import TextSource
        return TextSource(spec)
    if kind == "synthetic":
        s = spec.get("seed")
        return SyntheticSource(spec["shape"], spec["classes"], spec.get("num_samples", 1024),
                               seed if s is None else s, spec.get("split"))
    raise UserError(f"unknown data source {kind!r}; expected 'hdf5', 'lmdb', 'text' or "
                    "'synthetic'")


class SharedSource:
    """A source and its epoch order, held by every data reader of one
    process that reads the same spec with the same seed (``shared_source``)."""

    def __init__(self, source, order):
        self.source, self.order = source, order


#: {source_key: SharedSource} of the readers alive in this process: an
#: entry goes with its last reader
_SHARED = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def shares_source(spec):
    """Whether data readers of ``spec`` share one source (``shared_source``):
    every kind whose ``gather`` is safe from several threads at once
    (synthetic and text: read-only arrays; HDF5: its data in memory, or
    the open file behind the source's lock), not an LMDB (its read
    transactions are per thread; its environment is shared already)."""
    return spec.get("source", "hdf5") in ("synthetic", "text", "hdf5")


def source_key(spec, seed=0, digest=True):
    """The key under which readers of data spec ``spec`` at run seed
    ``seed`` share their source and epoch order (``shared_source``; plan's
    data pool row counts one per key): the spec (every key, canonically),
    the seed, and a file's identity (a rewritten file is read again, also
    within one tick of a file system's coarse timestamps:
    data/filecache.py's ``file_identity``). ``digest=False`` for a caller
    that only groups the readers of one look (the footprint): a racy file
    is not hashed."""
    ident = None
    path = spec.get("path")
    if path is not None:
        try:  # coarse timestamps: a racy file's digest (filecache.file_identity)
            ident = file_identity(path, digest)
        except OSError:
            ident = (str(path),)
    return (json.dumps(spec, sort_keys=True, default=str), int(seed), ident)


def shared_source(spec, seed=0):
    """(source, EpochOrder) of data spec ``spec`` at run seed ``seed``
    (the spec's own ``seed`` wins, as ``make_source``): one pair per
    ``source_key`` in this process while some reader holds it, so the M
    micro-batch copies of a replica's data reader (parallel/micro_batch.py)
    hold one source -- a synthetic pool, a text split's tokens, an HDF5
    file's chunk cache -- and one epoch's permutation, not M. Each reader
    still gathers its own rows in its own prefetch thread; what it reads
    depends only on its batch positions, so the samples are those of
    readers with sources of their own. An LMDB (``shares_source``) gets a
    pair of its own each call."""
    def make(identity=None):
        source = make_source(spec, seed, identity=identity)
        own = spec.get("seed")  # the spec's seed of the shuffle, else the run's
        return SharedSource(source, EpochOrder(source.n_samples, spec.get("shuffle", False),
                                               seed if own is None else own))
    if not shares_source(spec):
        return make()
    key = source_key(spec, seed)
    # an HDF5 file's identity the key holds (None, or (path,) where it
    # cannot be stat'ed): a racy file is hashed once here, not again
    identity = key[2] if spec.get("source", "hdf5") == "hdf5" and key[2] is not None and \
        len(key[2]) == 7 else None
    with _SHARED_LOCK:
        held = _SHARED.get(key)
        if held is None:
            held = _SHARED[key] = make(identity)
        return held


def token_range(spec):
    """(smallest, largest) token of the text data file of ``spec``'s split,
    scanned once per file version: start-up checks them against the
    embedding (``check_token_ids``) and the loss (``check_labels``), each
    a pass over every token of a corpus that may be gigabytes."""
    from .text import TextSource
    try:
        st = os.stat(spec["path"])
    except OSError:  # TextSource says what is wrong with the file, as before
        source = TextSource(spec)
        return source.min_token(), source.max_token()
    key = (os.path.realpath(spec["path"]), spec.get("split"), st.st_mtime_ns, st.st_size)
    if key not in _TOKEN_RANGES:
        source = TextSource(spec)
        _TOKEN_RANGES[key] = (source.min_token(), source.max_token())
    return _TOKEN_RANGES[key]


#: ``token_range``'s answers, by file (real path, split, mtime, size)
_TOKEN_RANGES = {}


def check_token_ids(spec, rows, layer="?", key=None):
    """At load time: the tokens of the text data file of ``spec`` that an
    embedding of ``rows`` rows reads as ids (ops/data.py's ``id_limit``)
    must lie in [0, ``rows``): a UserError naming the file, the split, the
    token and the layer (``key``: its config key). Before, only the labels
    were checked at start-up (against the loss's classes): a byte-level
    file read by a smaller table (``input_dim: 128`` for ASCII text, an
    untied head of more classes) ended the run at the first batch that held
    such a byte, hours in, exit 1 -- or never, where no batch drew it."""
    if spec.get("source") != "text":
        return
    low, top = token_range(spec)
    if top < rows and low >= 0:
        return
    where = f" ({key})" if key else ""
    raise UserError(f"text data file '{spec['path']}': split '{spec.get('split')}' holds "
                    f"token {top if top >= rows else low}, outside [0, {rows}): layer "
                    f"'{layer}'{where} is an embedding of {rows} rows (a byte-level "
                    "vocabulary needs 256)")


def check_labels(spec, classes, ignore_label=None, layer="?"):
    """Raise a UserError naming the file and dataset when a label of the
    data spec lies outside [0, ``classes``) (``ignore_label`` excepted):
    ``classes`` is what the consuming ``layer`` (a loss or accuracy) sees.
    Synthetic data draws its labels in range by construction; an LMDB is
    scanned when its file fits ``memory_budget()`` (a larger one is read
    only batch by batch, and the loss checks its labels then)."""
    if spec.get("source", "hdf5") == "lmdb":
        from .lmdb_source import LMDBSource, lmdb_file_bytes
        if lmdb_file_bytes(spec["path"]) > memory_budget():
            return
        source = LMDBSource(spec["path"])
        labels = source.labels()
        bad = (labels < 0) | (labels >= classes)
        if ignore_label is not None:
            bad &= labels != int(ignore_label)
        if bad.any():
            first = int(np.argmax(bad))
            key = bytes(source.keys[first]).decode("utf-8", "backslashreplace")
            _check_label_range(labels, classes, ignore_label, layer,
                               f"lmdb source '{spec['path']}'", f"record '{key}' holds label")
        return
    if spec.get("source") == "text":
        low, top = token_range(spec)
        if top >= classes or low < 0:
            # a negative token (a signed dtype) trained silently before: the
            # embedding read it as a row from the end, the loss as a class
            raise UserError(f"text data file '{spec['path']}': split '{spec.get('split')}' "
                            f"holds token {top if top >= classes else low}, outside "
                            f"[0, {classes}): layer '{layer}' sees {classes} classes (a "
                            "byte-level vocabulary needs 256)")
        return
    if spec.get("source", "hdf5") != "hdf5":
        if int(spec.get("classes", classes)) > classes:
            raise UserError(f"data: synthetic source has {spec.get('classes')} classes but "
                            f"layer '{layer}' sees {classes} (check its input's num_output)")
        return
    source = HDF5Source(spec["path"], spec.get("split"), spec.get("in_memory", "auto"),
                        bool(spec.get("external")))
    where = "/" if spec.get("split") is None else f"/{spec['split']}/"
    _check_label_range(source.labels, classes, ignore_label, layer,
                       f"data file '{spec['path']}'", f"dataset '{where}label' holds label")


def _check_label_range(labels, classes, ignore_label, layer, what, holds):
    bad = (labels < 0) | (labels >= classes)
    if ignore_label is not None:
        bad &= labels != int(ignore_label)
    if bad.any():
        first = int(np.argmax(bad))
        raise UserError(f"{what}: {holds} {int(labels[first])} (sample {first}; "
                        f"{int(bad.sum())} bad in all), outside [0, {classes}): layer "
                        f"'{layer}' sees {classes} classes (check the num_output of the layer "
                        "feeding it)")


def source_info(spec):
    """(n_samples, sample_shape) of a data spec without loading the data."""
    kind = spec.get("source", "hdf5")
    if kind == "hdf5":
        return hdf5_info(spec["path"], spec.get("split"), bool(spec.get("external")))
    if kind == "lmdb":
        from .lmdb_source import lmdb_info
        return lmdb_info(spec["path"])
    if kind == "text":
        from .text import text_info
        return text_info(spec)
    if kind == "synthetic":
        return int(spec.get("num_samples", 1024)), tuple(int(s) for s in spec["shape"])
    raise UserError(f"unknown data source {kind!r}; expected 'hdf5', 'lmdb', 'text' or "
                    "'synthetic'")


def resident_bytes(spec):
    """(key, bytes) of what the source of data spec ``spec`` holds in memory
    for the whole run, by the rules of its class, reading only metadata:
    an HDF5 split loaded into memory (``HDF5Source``: its data, uint8 or
    float32, when it fits ``memory_budget``; else h5py's chunk cache) and
    its int64 labels; a synthetic source's pool of distinct samples and its
    labels; a text source's tokens (``text_resident_bytes``); an LMDB: 0
    (memory-mapped, read in pages). ``key``: sources with the same key
    share these bytes (HDF5Source's per-process cache), None: never."""
    kind = spec.get("source", "hdf5")
    if kind == "synthetic":
        n, shape = source_info(spec)
        sample = 4 * int(np.prod(shape))
        pool = max(1, min(n, SYNTHETIC_POOL_BYTES // max(sample, 1)))
        return None, pool * sample + n * 8
    if kind == "text":
        from .text import text_resident_bytes
        return None, text_resident_bytes(spec)
    if kind == "hdf5":
        import h5py
        path, split = spec["path"], spec.get("split")
        n, shape = hdf5_info(path, split, bool(spec.get("external")))
        with h5py.File(path, "r") as f:
            stored = (f if split is None else f[split])["data"].dtype
        item = 1 if stored == np.uint8 else 4
        decoded = n * int(np.prod(shape)) * 4
        mode = spec.get("in_memory", "auto")
        loaded = mode is True or (mode in ("auto", None) and decoded <= memory_budget())
        data = n * int(np.prod(shape)) * item if loaded else HDF5Source.CHUNK_CACHE_BYTES
        return (os.path.abspath(path), split, loaded), data + n * 8
    return None, 0


def batch_types(spec, dtype="float32"):
    """(data dtype, label shape of one sample, label dtype) of a data spec's
    batches: a text source gives int32 tokens and (T,) int32 next tokens,
    the others ``dtype`` data and one int64 label per sample."""
    if spec.get("source") == "text":
        return "int32", (int(spec["sequence_length"]),), "int32"
    return np.dtype(dtype).name, (), "int64"


# ----------------------------------------------------------------- batching
def order_bytes(spec):
    """Bytes of one epoch's order an ``EpochOrder`` of data spec ``spec``
    holds (a permutation of the sample indices, int64; 0 without
    ``shuffle``), reading only metadata: plan's data pool row counts one
    per reader (a second joins it once the run crosses an epoch)."""
    if not spec.get("shuffle", False):
        return 0
    return 8 * int(source_info(spec)[0])


class EpochOrder:
    """The permutation of each epoch: depends only on (seed, epoch) when
    ``shuffle``, the identity otherwise. Keeps the last few epochs' orders
    (``cache``; each ``order_bytes``). Thread-safe: the micro-batch copies
    of a data reader share one (``shared_source``), each asking from its
    own prefetch thread."""

    def __init__(self, n_samples, shuffle, seed=0, cache=2):
        self.n, self.shuffle, self.seed = int(n_samples), bool(shuffle), int(seed)
        self._cache, self._cache_size = OrderedDict(), cache
        self._lock = threading.Lock()

    def __call__(self, epoch):
        if not self.shuffle:
            return None
        with self._lock:
            order = self._cache.get(epoch)
            if order is None:
                order = np.random.default_rng([self.seed, int(epoch),
                                               0x0DE5]).permutation(self.n)
                self._cache[epoch] = order
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            return order

    def indices(self, start, count):
        """Sample indices at global positions [start, start + count)."""
        positions = np.arange(start, start + count, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.n)
        if not self.shuffle:
            return offsets
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self(int(epoch))[offsets[sel]]
        return out


def batch_start(iteration, rank, world_size, batch_size):
    """Global position of the first sample rank ``rank`` reads at ``iteration``."""
    return (int(iteration) * world_size + rank) * batch_size


def batch_positions(iteration, rank, world_size, batch_size):
    """Global positions (B,) rank ``rank`` reads at ``iteration``; the data
    transform's random draws derive from them (``purine_mpi.data.transform``)."""
    start = batch_start(iteration, rank, world_size, batch_size)
    return np.arange(start, start + batch_size, dtype=np.int64)


def batch_indices(iteration, rank, world_size, batch_size, order):
    """Sample indices rank ``rank`` reads at ``iteration`` (the rule above)."""
    return order.indices(batch_start(iteration, rank, world_size, batch_size), batch_size)


def pass_batches(n_samples, batch_size, world_size):
    """Iterations of one pass over ``n_samples`` samples with ``world_size``
    ranks x ``batch_size``: the fewest that read every sample (at least 1)."""
    return max(1, -(-int(n_samples) // (int(batch_size) * int(world_size))))


def pass_counts(iteration, world_size, batch_size, limit):
    """(world_size,) int64: how many of each rank's ``batch_size`` positions
    at ``iteration`` lie below ``limit`` (the samples of one pass; the rest
    are padding), from rank 0's batch to the last."""
    starts = np.array([batch_start(iteration, r, world_size, batch_size)
                       for r in range(int(world_size))], dtype=np.int64)
    return np.clip(int(limit) - starts, 0, int(batch_size))


def repeat_note(batches, batch_size, ranks, n_samples, unpadded=False):
    """The note on a test pass of ``batches`` global batches of ``batch_size``
    x ``ranks`` that is longer than the split's ``n_samples`` (None when it
    is not): the test reader wraps around (as Caffe's), so sample i counts
    q + 1 times for the first r samples and q times for the others, where
    q, r = divmod(total, n_samples). ``unpadded``: a one-pass test (null
    test_iter) whose net allows no padding (job/replica.py, ``mark_padding``)."""
    total = batches * batch_size * ranks
    if total <= n_samples:
        return None
    q, r = divmod(total, n_samples)
    how = f"{total} samples of a {n_samples}-sample test split: "
    first = "the first sample counts" if r == 1 else f"the first {r} samples count"
    if r == 0:
        how += f"{q} full passes, each sample counts {q} times"
    elif q == 1:
        how += f"a full pass, and {first} twice"
    else:
        how += (f"{q} full passes and a part: {first} {q + 1} times, the other "
                f"{n_samples - r} count {q} times")
    advice = "make test_iter x the global batch equal the split (null test_iter: one pass)"
    if unpadded:
        advice = ("make the global batch divide the split: with null test_iter the last batch "
                  "is not padded here, as the test net's label reaches other layers than "
                  "softmax_loss and accuracy, or two losses ignore different labels")
    return (f"note: a test pass of {batches} batches of {batch_size} x {ranks} rank(s) reads "
            f"{how} (the reader wraps around, as in Caffe); for exact figures {advice}")
