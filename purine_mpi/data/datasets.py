"""Converters from public data sets to the HDF5 data layout of docs/formats.md
("HDF5 data files"): groups ``/train`` and ``/test``, each with ``data``
(N x C x H x W, float32 or uint8) and ``label`` (N, int64).

    write_digits(out_path)            scikit-learn's bundled 8x8 digits (no download)
    write_cifar10(src_dir, out_path)  CIFAR-10's python pickle batches
    write_lmdb({split: db}, out_path)  Caffe LMDBs of Datum records (data/lmdb_source)

Files are written to a temporary name and renamed (``write_hdf5_replacing``), so
an interrupted or failed conversion never leaves a half-written file (a full
disk is one line naming the file; a file already there stays as it was).
"""
import os
import pickle

import numpy as np

from ..base.errors import UserError
from ..base.progress_bar import progress
from ..base.runfiles import HDF5_MODE, make_parent, stop_if_write_failed, write_hdf5_replacing

CIFAR_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST_BATCH = "test_batch"


def write_digits(out_path, test_size=360, seed=0):
    """Write the 1,797 digits of ``sklearn.datasets.load_digits`` (1 x 8 x 8,
    pixel values 0..16 divided by 16 into [0, 1]) with a stratified split,
    fixed by ``seed``: 1,437 train / 360 test. Returns a summary dict."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise UserError("the digits data set needs scikit-learn: pip install "
                        "'purine_mpi[examples]' (or pip install scikit-learn)") from None
    digits = load_digits()
    data = (digits.images.astype(np.float32) / np.float32(16.0))[:, None, :, :]
    labels = digits.target.astype(np.int64)
    train_x, test_x, train_y, test_y = train_test_split(
        data, labels, test_size=test_size, stratify=labels, random_state=seed)
    splits = {"train": (train_x, train_y), "test": (test_x, test_y)}
    attrs = {"source": "sklearn.datasets.load_digits (UCI optical digits, 8x8)",
             "scale": "pixel / 16", "classes": 10, "split_seed": seed}
    _write_splits(out_path, splits, attrs)
    return {"path": out_path, "train": len(train_y), "test": len(test_y),
            "shape": list(data.shape[1:]), "classes": 10}


def write_cifar10(src_dir, out_path, log=None):
    """Write CIFAR-10 from its python batches (``data_batch_1..5``,
    ``test_batch`` in ``src_dir`` or ``src_dir/cifar-10-batches-py``): the
    3 x 32 x 32 uint8 pixels as they are (a quarter of float32's size),
    chunked and gzip-compressed, so the loader reads batches straight from
    the file; the per-channel mean of the training pixels (0..255) is the
    root attribute ``mean``, for the data spec's ``mean``/``scale`` keys
    (jobs/cifar10_quick_hdf5.yaml). Progress (base/progress_bar.py: a bar on a
    terminal, else lines) and a summary go to ``log``. Returns a summary dict."""
    if os.path.isdir(os.path.join(src_dir, "cifar-10-batches-py")):
        src_dir = os.path.join(src_dir, "cifar-10-batches-py")
    if not os.path.isdir(src_dir):
        raise UserError(f"CIFAR-10 source '{src_dir}' not found; --from takes "
                        "cifar-10-python.tar.gz (https://www.cs.toronto.edu/~kriz/cifar.html), "
                        "the folder holding it, or the unpacked cifar-10-batches-py; or give "
                        "--download")
    log = log or (lambda msg: None)
    train = []
    names = CIFAR_TRAIN_BATCHES + (CIFAR_TEST_BATCH,)
    with progress(len(names), "read", "files", log=log) as bar:
        for name in CIFAR_TRAIN_BATCHES:
            train.append(_read_cifar_batch(src_dir, name))
            bar.update(1)
        test = _read_cifar_batch(src_dir, CIFAR_TEST_BATCH)
        bar.update(1)
    log(f"read {sum(len(y) for _, y in train):,} training and {len(test[1]):,} test images "
        f"from {src_dir}")
    # the mean over every training pixel of each channel, accumulated exactly
    # from the uint8 values so it does not depend on float summation order
    totals = sum(images.sum(axis=(0, 2, 3), dtype=np.int64) for images, _ in train)
    count = sum(images.shape[0] for images, _ in train) * 32 * 32
    mean = (totals / count).astype(np.float32)

    splits = {"train": ([x for x, _ in train], [y for _, y in train]),
              "test": ([test[0]], [test[1]])}
    attrs = {"source": "CIFAR-10 python batches", "pixels": "uint8 0..255, not normalised",
             "mean": mean, "classes": 10}
    _write_splits(out_path, splits, attrs, log=log)
    return {"path": out_path, "train": sum(len(y) for y in splits["train"][1]),
            "test": len(test[1]), "shape": [3, 32, 32], "classes": 10,
            "mean": [float(m) for m in mean]}


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles only what a CIFAR-10 python batch holds: builtin containers,
    numbers, strings and bytes (no globals needed) and NumPy arrays, dtypes
    and scalars. Any other global (``os.system``, ``builtins.eval``...) is
    refused before it is looked up, so a crafted file runs nothing."""

    SAFE = {(module, name) for module in ("numpy.core.multiarray", "numpy._core.multiarray")
            for name in ("_reconstruct", "scalar")} | {
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("_codecs", "encode"),  # how Python 3 pickles bytes under protocol 2
    }

    def find_class(self, module, name):
        if (module, name) not in self.SAFE:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in a "
                                         "CIFAR-10 batch")
        return super().find_class(module, name)


def _read_cifar_batch(src_dir, name):
    path = os.path.join(src_dir, name)
    if not os.path.isfile(path):
        raise UserError(f"CIFAR-10 batch '{path}' not found; '{src_dir}' must hold "
                        f"{', '.join(CIFAR_TRAIN_BATCHES)} and {CIFAR_TEST_BATCH}")
    try:
        with open(path, "rb") as f:
            batch = _CifarUnpickler(f, encoding="bytes").load()
        data = np.asarray(batch[b"data"] if b"data" in batch else batch["data"])
        labels = batch.get(b"labels", batch.get("labels"))
        labels = np.asarray(labels, dtype=np.int64)
    except Exception as e:  # unpickling errors come in many types
        raise UserError(f"CIFAR-10 batch '{path}' is not a CIFAR-10 python pickle "
                        f"({type(e).__name__}: {e})") from None
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or data.dtype != np.uint8 \
            or labels.shape != (data.shape[0],):
        raise UserError(f"CIFAR-10 batch '{path}': expected 'data' uint8 (N, 3072) and N "
                        f"'labels', got data {data.dtype} {list(data.shape)} and "
                        f"{labels.shape[0] if labels.ndim else 0} labels")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise UserError(f"CIFAR-10 batch '{path}': labels must be in 0..9")
    return data.reshape(-1, 3, 32, 32), labels


#: target bytes of one HDF5 chunk of the data sets we write
CHUNK_BYTES = 64 << 10


def _write_splits(out_path, splits, attrs, log=None):
    """Write {split: (data or list of chunks, labels or list)} atomically.
    Data keeps its dtype (uint8 pixels stay uint8, anything else is
    float32), in chunks of whole samples of about CHUNK_BYTES, compressed
    (shuffle + gzip), so a reader of a few samples decodes little."""
    make_parent(out_path)

    def fill(f):
        for key, value in attrs.items():
            f.attrs[key] = value
        for split, (data, labels) in splits.items():
            chunks = data if isinstance(data, list) else [data]
            label_chunks = labels if isinstance(labels, list) else [labels]
            n = sum(len(c) for c in chunks)
            group = f.create_group(split)
            dtype = np.uint8 if chunks[0].dtype == np.uint8 else np.float32
            sample = chunks[0].shape[1:]
            rows = max(1, min(n, CHUNK_BYTES // (np.dtype(dtype).itemsize
                                                  * int(np.prod(sample)))))
            dset = group.create_dataset("data", shape=(n,) + sample, dtype=dtype,
                                        chunks=(rows,) + sample, compression="gzip",
                                        compression_opts=4, shuffle=True)
            start = 0
            step = rows * 64  # a few MB per write, so progress moves
            with progress(n, f"write {split}", "samples", log=log,
                          enabled=log is not None) as bar:
                for chunk in chunks:
                    for i in range(0, len(chunk), step):
                        piece = chunk[i:i + step]
                        dset[start:start + len(piece)] = piece
                        start += len(piece)
                        bar.update(len(piece))
                        stop_if_write_failed()  # a full disk: the rest is not written
            if log:
                log(f"wrote {n:,} {split} samples ({np.dtype(dtype).name}, "
                    f"{'x'.join(map(str, sample))})")
            group.create_dataset("label", data=np.concatenate(label_chunks).astype(np.int64))
    write_hdf5_replacing(out_path, fill, HDF5_MODE)


def write_lmdb(splits, out_path, log=None, block=1024):
    """Write Caffe LMDBs ({split: database folder}) as one HDF5 data file,
    record by record in key order (``block`` records in memory at a time,
    so a database larger than memory converts): raw and encoded images stay
    uint8 (decoded images in BGR order, as Caffe reads them), float_data is
    float32. Returns {split: samples}."""
    from .lmdb_source import LMDBSource
    sources = {split: LMDBSource(path) for split, path in splits.items()}
    make_parent(out_path)

    def fill(f):
        f.attrs["source"] = "Caffe LMDB: " + ", ".join(
            f"{split}={os.path.abspath(path)}" for split, path in splits.items())
        for split, src in sources.items():
            n, sample = src.n_samples, src.sample_shape
            dtype = np.uint8 if src.dtype == np.uint8 else np.float32
            rows = max(1, min(n, CHUNK_BYTES // (np.dtype(dtype).itemsize
                                                  * int(np.prod(sample)))))
            group = f.create_group(split)
            dset = group.create_dataset("data", shape=(n,) + sample, dtype=dtype,
                                        chunks=(rows,) + sample, compression="gzip",
                                        compression_opts=4, shuffle=True)
            labels = np.empty(n, dtype=np.int64)
            with progress(n, f"write {split}", "samples", log=log,
                          enabled=log is not None) as bar:
                for start in range(0, n, block):
                    data, labels[start:start + block] = src.gather(
                        np.arange(start, min(n, start + block)))
                    dset[start:start + len(data)] = data
                    bar.update(len(data))
                    stop_if_write_failed()  # a full disk: the rest is not read nor written
            group.create_dataset("label", data=labels)
            if log:
                log(f"wrote {n:,} {split} samples ({np.dtype(dtype).name}, "
                    f"{'x'.join(map(str, sample))})")
    write_hdf5_replacing(out_path, fill, HDF5_MODE)
    return {split: src.n_samples for split, src in sources.items()}
