"""Caffe LMDBs and mean files for the tests, laid out as Caffe's tools write
them: keys ``%08d`` (convert_mnist_data) or ``%08d_<name>`` (convert_imageset),
one ``Datum`` per record in protobuf wire format (raw uint8 C x H x W,
``float_data``, or an encoded PNG), and a mean image as a ``BlobProto``
of shape 1 x C x H x W (compute_image_mean's ``.binaryproto``)."""
import io
import os

import numpy as np
import pytest

# the `caffe` and `test` extras bring it; a machine without them (the GPU
# machine's image) skips the modules that write LMDBs instead of erroring
lmdb = pytest.importorskip("lmdb")

from purine_mpi.data.protowire import write_blob, write_datum


def write_lmdb(path, images, labels, encoding="raw", names=False, map_size=1 << 30):
    """An LMDB of ``images`` (N x C x H x W, uint8 for raw/png, float for
    ``float``) with ``labels``; returns ``path``. PNG colour records are
    written as OpenCV writes them (the file holds RGB of the BGR array)."""
    os.makedirs(path, exist_ok=True)
    env = lmdb.open(str(path), map_size=map_size)
    with env.begin(write=True) as txn:
        for i, (image, label) in enumerate(zip(images, labels)):
            key = (b"%08d" % i) + (f"_img{i}.png".encode() if names else b"")
            txn.put(key, datum_bytes(image, int(label), encoding))
    env.close()
    return str(path)


def datum_bytes(image, label, encoding="raw"):
    c, h, w = image.shape
    if encoding == "raw":
        return write_datum(c, h, w, np.ascontiguousarray(image, np.uint8).tobytes(), label)
    if encoding == "float":
        return write_datum(c, h, w, None, label, float_data=image)
    if encoding == "png":
        from PIL import Image
        buf = io.BytesIO()
        pixels = image[0] if c == 1 else image[::-1].transpose(1, 2, 0)  # BGR -> RGB file
        Image.fromarray(np.ascontiguousarray(pixels, np.uint8)).save(buf, format="PNG")
        return write_datum(0, 0, 0, buf.getvalue(), label, encoded=True)
    raise ValueError(encoding)


def write_mean(path, image):
    """A .binaryproto mean image (1 x C x H x W) of ``image`` (C x H x W)."""
    with open(path, "wb") as f:
        f.write(write_blob(np.asarray(image, np.float32)[None]))
    return str(path)


def put(path, key, value, map_size=1 << 30):
    """Add (or replace) one raw record in an existing LMDB."""
    env = lmdb.open(str(path), map_size=map_size)
    with env.begin(write=True) as txn:
        txn.put(key, value)
    env.close()
