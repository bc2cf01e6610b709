"""The ``lmdb`` data source: a Caffe LMDB of ``Datum`` records, as Caffe's
``convert_imageset`` and ``convert_mnist_data`` write them (keys such as
``%08d`` or ``%08d_<file>``, in key order).

A record is raw uint8 C x H x W bytes (``data``), ``float_data`` (float32),
or an encoded JPEG/PNG image (``encoded: true``) decoded with Pillow: a grey
image is 1 x H x W, a colour one 3 x H x W in **BGR** channel order, as
Caffe's OpenCV decoding gives it (so a mean file or ``mean_value`` list made
for Caffe applies unchanged). The label is the record's ``label``.

Only the keys (a few bytes each) are held in memory. Records are read from
the memory-mapped database in ``gather``, in the DataReader's prefetch
thread, so a database larger than the process's memory trains with flat
memory: its pages are the kernel's file cache, never the process's own heap.
The sample order, the shuffle per epoch (over the key index) and the
sharding across data-parallel ranks are those of every source
(``data/sources.py``, "Sample order").

A missing or empty database, a record that is not a Datum, and records of
different shapes are a UserError (exit 2) naming the database and the key.
The ``lmdb`` and ``Pillow`` packages are the ``caffe`` extra
(``pip install 'purine_mpi[caffe]'``), imported only when such a source is
used. Imports ``data/protowire`` and the errors (the data layer).
"""
import io
import os
import threading

import numpy as np

from ..base.errors import UserError
from .filecache import HEADER_DIGEST_BYTES, per_file_version
from .protowire import read_datum

EXTRA_HINT = "pip install 'purine_mpi[caffe]'"


def _import(module, what):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise UserError(f"{what} needs the '{module if module != 'PIL.Image' else 'Pillow'}' "
                        f"package, which is not installed: {EXTRA_HINT}") from None


def _lmdb():
    return _import("lmdb", "the lmdb data source")


_ENVS, _ENVS_LOCK = {}, threading.Lock()


def shared_env(path):
    """The process's one read-only Environment of ``path`` (lmdb allows one
    per database and process; a forked child opens its own)."""
    key = (os.path.abspath(path), os.getpid())
    with _ENVS_LOCK:
        env = _ENVS.get(key)
        if env is None:
            env = _ENVS[key] = open_env(path)
        return env


def open_env(path):
    """A read-only lmdb Environment of ``path`` (a folder holding data.mdb,
    or the .mdb file itself); UserError when it is missing or no LMDB."""
    lmdb = _lmdb()
    if not os.path.exists(path):
        raise UserError(f"lmdb source '{path}' not found (expected a folder holding data.mdb)")
    subdir = os.path.isdir(path)
    if subdir and not os.path.isfile(os.path.join(path, "data.mdb")):
        raise UserError(f"lmdb source '{path}' is a folder without data.mdb: not an LMDB "
                        "database")
    try:
        return lmdb.open(path, subdir=subdir, readonly=True, lock=False, readahead=False,
                         meminit=False, max_readers=512)
    except lmdb.Error as e:
        raise UserError(f"lmdb source '{path}' cannot be opened as an LMDB database ({e})") \
            from None


def _key_text(key):
    return bytes(key).decode("utf-8", "backslashreplace")


def decode(buf, path, key):
    """(array C x H x W uint8 or float32, label) of one Datum record."""
    try:
        datum = read_datum(buf)
    except (ValueError, IndexError) as e:
        raise UserError(f"lmdb source '{path}': record '{_key_text(key)}' is not a Caffe Datum "
                        f"({e})") from None
    c, h, w, data = datum["channels"], datum["height"], datum["width"], datum["data"]
    if datum["encoded"]:
        return _decode_image(data, path, key), datum["label"]
    if data is not None and len(data):
        if c * h * w != len(data):
            raise UserError(f"lmdb source '{path}': record '{_key_text(key)}' holds {len(data)} "
                            f"bytes for channels x height x width = {c} x {h} x {w}")
        return np.frombuffer(data, dtype=np.uint8).reshape(c, h, w), datum["label"]
    values = datum["float_data"]
    if values is not None and values.size:
        if c * h * w != values.size:
            raise UserError(f"lmdb source '{path}': record '{_key_text(key)}' holds "
                            f"{values.size} float_data values for channels x height x width "
                            f"= {c} x {h} x {w}")
        return values.reshape(c, h, w), datum["label"]
    raise UserError(f"lmdb source '{path}': record '{_key_text(key)}' holds neither data nor "
                    "float_data")


def _decode_image(data, path, key):
    image_mod = _import("PIL.Image", "an encoded (JPEG/PNG) lmdb record")
    try:
        image = image_mod.open(io.BytesIO(bytes(data or b"")))
        image.load()
    except Exception as e:  # Pillow raises many kinds for bad bytes
        raise UserError(f"lmdb source '{path}': record '{_key_text(key)}' is marked encoded but "
                        f"Pillow cannot decode it ({type(e).__name__}: {e})") from None
    if image.mode in ("L", "1", "LA"):
        return np.asarray(image.convert("L"), dtype=np.uint8)[None]
    if image.mode in ("I;16", "I", "F"):
        raise UserError(f"lmdb source '{path}': record '{_key_text(key)}' is a {image.mode} "
                        "image; 8-bit grey or colour images are supported")
    rgb = np.asarray(image.convert("RGB"), dtype=np.uint8)
    return np.ascontiguousarray(rgb[..., ::-1].transpose(2, 0, 1))  # BGR, as OpenCV


class _Meta:
    """The keys, the sample shape and dtype of one database (one scan of its keys)."""

    def __init__(self, path):
        with shared_env(path).begin(buffers=False) as txn:
            self.keys = [k for k, _ in _iter_keys(txn)]
            if not self.keys:
                raise UserError(f"lmdb source '{path}' is empty (no records)")
            first, _ = decode(txn.get(self.keys[0]), path, self.keys[0])
            last, _ = decode(txn.get(self.keys[-1]), path, self.keys[-1])
        self.shape, self.dtype = first.shape, first.dtype
        check_record(path, self.keys[-1], last, self.shape, self.dtype, self.keys[0])


def _iter_keys(txn):
    with txn.cursor() as cursor:
        for key in cursor.iternext(keys=True, values=False):
            yield key, None


def check_record(path, key, array, shape, dtype, first_key):
    if array.shape != shape or array.dtype != dtype:
        raise UserError(f"lmdb source '{path}': record '{_key_text(key)}' has shape "
                        f"{list(array.shape)} {array.dtype.name} but the first record "
                        f"'{_key_text(first_key)}' has {list(shape)} {np.dtype(dtype).name}; "
                        "all records must have one shape (resize the images when making the "
                        "database, e.g. convert_imageset --resize_height/--resize_width)")


def lmdb_meta(path):
    """The database's _Meta, scanned once per process and file version."""
    data_file = os.path.join(path, "data.mdb") if os.path.isdir(path) else path
    return per_file_version(path, _Meta, stat_path=data_file,
                            digest=HEADER_DIGEST_BYTES)


def lmdb_file_bytes(path):
    """Size in bytes of the database file (0 when it cannot be read)."""
    data_file = os.path.join(path, "data.mdb") if os.path.isdir(path) else path
    try:
        return os.path.getsize(data_file)
    except OSError:
        return 0


def lmdb_info(path):
    """(n_samples, sample_shape) of the database, reading its keys and the
    first and last records only."""
    meta = lmdb_meta(path)
    return len(meta.keys), tuple(int(s) for s in meta.shape)


class LMDBSource:
    """A Caffe LMDB as a data source (``n_samples``, ``sample_shape``,
    ``gather``; the interface of ``data/sources.DataSource``)."""

    def __init__(self, path):
        self.path = path
        meta = lmdb_meta(path)
        self.keys, self.dtype = meta.keys, meta.dtype
        self.n_samples, self.sample_shape = len(self.keys), tuple(int(s) for s in meta.shape)

    def _environment(self):
        return shared_env(self.path)

    def gather(self, indices):
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        data = np.empty((len(indices),) + self.sample_shape, dtype=self.dtype)
        labels = np.empty(len(indices), dtype=np.int64)
        with self._environment().begin(buffers=True) as txn:
            for i, index in enumerate(indices):
                key = self.keys[int(index)]
                buf = txn.get(key)
                if buf is None:
                    raise UserError(f"lmdb source '{self.path}': record '{_key_text(key)}' "
                                    "vanished; the database changed while training")
                array, labels[i] = decode(buf, self.path, key)
                if array.shape != self.sample_shape or array.dtype != self.dtype:
                    check_record(self.path, key, array, self.sample_shape, self.dtype,
                                 self.keys[0])
                data[i] = array
        if data.dtype.kind == "f" and not np.isfinite(data).all():
            bad = int(np.flatnonzero(~np.isfinite(data.reshape(len(data), -1)).all(1))[0])
            raise UserError(f"lmdb source '{self.path}': record "
                            f"'{_key_text(self.keys[int(indices[bad])])}' holds non-finite "
                            "float_data (NaN or inf)")
        return data, labels

    def labels(self):
        """Every record's label, in key order (one pass over the database,
        once per process)."""
        meta = lmdb_meta(self.path)
        if getattr(meta, "labels", None) is None:
            out = np.empty(self.n_samples, dtype=np.int64)
            with self._environment().begin(buffers=True) as txn:
                for i, key in enumerate(self.keys):
                    try:
                        out[i] = read_datum(txn.get(key))["label"]
                    except (ValueError, IndexError, TypeError) as e:
                        raise UserError(f"lmdb source '{self.path}': record "
                                        f"'{_key_text(key)}' is not a Caffe Datum ({e})") \
                            from None
            out.setflags(write=False)
            meta.labels = out
        return meta.labels
