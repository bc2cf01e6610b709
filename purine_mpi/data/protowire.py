"""Protobuf wire format, the little that Caffe's binary files need: varints,
fixed 32/64-bit and length-delimited fields, packed and unpacked repeated
scalars, and the two messages read outside a ``.caffemodel``:

- ``BlobProto`` (a ``.binaryproto`` mean file, a ``.caffemodel`` blob):
  ``read_blob`` gives its values as float32 in its shape;
- ``Datum`` (one record of a Caffe LMDB): ``read_datum`` gives its fields.

Field numbers are those of BVLC Caffe's ``caffe.proto``. The
``.caffemodel`` reader (``interop/caffemodel.py``) builds on this module.
Imports NumPy and the errors only (the data layer).
"""
import struct

import numpy as np

from ..base.errors import UserError

# BlobProto
BLOB_NUM, BLOB_CHANNELS, BLOB_HEIGHT, BLOB_WIDTH = 1, 2, 3, 4
BLOB_DATA, BLOB_SHAPE, BLOB_DOUBLE_DATA = 5, 7, 8
SHAPE_DIM = 1
# Datum
DATUM_CHANNELS, DATUM_HEIGHT, DATUM_WIDTH, DATUM_DATA = 1, 2, 3, 4
DATUM_LABEL, DATUM_FLOAT_DATA, DATUM_ENCODED = 5, 6, 7


def _varint(buf, pos):
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def fields(buf):
    """Yield (field number, wire type, value) of one message's bytes; the
    value is an int (varint), raw bytes (fixed 64 / 32 bits) or a memoryview
    (length-delimited)."""
    buf = memoryview(buf) if not isinstance(buf, memoryview) else buf
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = bytes(buf[pos:pos + 8]), pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + length], pos + length
        elif wire == 5:
            value, pos = bytes(buf[pos:pos + 4]), pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire} (field {number})")
        if pos > end:
            raise ValueError(f"field {number} runs past the end of its message")
        yield number, wire, value


def floats(wire, value, fmt):
    """The float (``fmt`` 'f') or double ('d') values of one field, packed or not:
    a view of the message's bytes (the callers copy what they keep)."""
    size = struct.calcsize(fmt)
    if wire == 2:  # packed
        if len(value) % size:
            raise ValueError("packed float data has a partial element")
    return np.frombuffer(value, dtype=f"<{fmt}")


def ints(wire, value):
    """The integer values of one field, packed or not."""
    if wire == 0:
        return [value]
    out, pos = [], 0
    while pos < len(value):
        v, pos = _varint(value, pos)
        out.append(v)
    return out


def _signed32(value):
    """A varint int32 as Caffe writes it (negatives take ten bytes)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def read_blob(buf):
    """A BlobProto's values as float32 in its shape (legacy num/channels/height/width too).
    Raises ValueError on bytes that are not a BlobProto."""
    data, dims, legacy = [], [], {}
    for number, wire, value in fields(buf):
        if number == BLOB_DATA:
            data.append(floats(wire, value, "f"))
        elif number == BLOB_DOUBLE_DATA:
            data.append(floats(wire, value, "d"))
        elif number == BLOB_SHAPE and wire == 2:
            for n, w, v in fields(value):
                if n == SHAPE_DIM:
                    dims += ints(w, v)
        elif number in (BLOB_NUM, BLOB_CHANNELS, BLOB_HEIGHT, BLOB_WIDTH) and wire == 0:
            legacy[number] = value
    # one copy of the values, the blob's own (not views of the file's bytes): a
    # packed blob is one part, cast or copied once (tools/plan.init_bytes
    # counts the file and these arrays)
    values = (data[0].astype(np.float32) if len(data) == 1 else
              np.concatenate(data).astype(np.float32, copy=False) if data else
              np.zeros(0, np.float32))
    if not dims and legacy:
        dims = [legacy.get(n, 1) for n in (BLOB_NUM, BLOB_CHANNELS, BLOB_HEIGHT, BLOB_WIDTH)]
    shape = tuple(int(d) for d in dims) if dims else (values.size,)
    if int(np.prod(shape, dtype=np.int64)) != values.size:
        raise ValueError(f"a blob of shape {list(shape)} holds {values.size} values")
    return values.reshape(shape)


def blob_size(buf):
    """The number of values ``read_blob`` gives for a BlobProto's bytes,
    read from the fields' headers (the values themselves are not read)."""
    n = 0
    for number, wire, value in fields(buf):
        if number in (BLOB_DATA, BLOB_DOUBLE_DATA):
            size = 4 if number == BLOB_DATA else 8
            n += len(value) // size if wire == 2 else 1
    return n


def read_datum(buf):
    """A Datum's fields: {channels, height, width, data (bytes or None),
    label, float_data (float32 array or None), encoded}. Raises ValueError
    on bytes that are not a Datum."""
    out = {"channels": 0, "height": 0, "width": 0, "data": None, "label": 0,
           "float_data": None, "encoded": False}
    float_parts = []
    for number, wire, value in fields(buf):
        if number == DATUM_DATA and wire == 2:
            out["data"] = value
        elif number == DATUM_FLOAT_DATA:
            float_parts.append(floats(wire, value, "f"))
        elif wire != 0:
            continue
        elif number == DATUM_CHANNELS:
            out["channels"] = value
        elif number == DATUM_HEIGHT:
            out["height"] = value
        elif number == DATUM_WIDTH:
            out["width"] = value
        elif number == DATUM_LABEL:
            out["label"] = _signed32(value)
        elif number == DATUM_ENCODED:
            out["encoded"] = bool(value)
    if float_parts:
        out["float_data"] = np.concatenate(float_parts).astype(np.float32, copy=False)
    return out


# ------------------------------------------------------------------ writing
def _key(number, wire):
    return _encode_varint((number << 3) | wire)


def _encode_varint(value):
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _bytes_field(number, payload):
    return _key(number, 2) + _encode_varint(len(payload)) + bytes(payload)


def write_datum(channels=0, height=0, width=0, data=None, label=0, float_data=None,
                encoded=False):
    """A Datum's bytes as Caffe's ``convert_imageset`` writes them (the
    ``data lmdb`` writer and the tests use it)."""
    out = bytearray()
    for number, value in ((DATUM_CHANNELS, channels), (DATUM_HEIGHT, height),
                          (DATUM_WIDTH, width)):
        out += _key(number, 0) + _encode_varint(int(value))
    if data is not None:
        out += _bytes_field(DATUM_DATA, bytes(data))
    out += _key(DATUM_LABEL, 0) + _encode_varint(int(label))
    if float_data is not None:
        for v in np.asarray(float_data, dtype="<f4").reshape(-1):  # unpacked, as Caffe's proto2
            out += _key(DATUM_FLOAT_DATA, 5) + struct.pack("<f", float(v))
    if encoded:
        out += _key(DATUM_ENCODED, 0) + _encode_varint(1)
    return bytes(out)


def write_blob(array):
    """A BlobProto's bytes: ``shape`` and packed ``data`` (float32)."""
    array = np.asarray(array, dtype="<f4")
    shape = b"".join(_key(SHAPE_DIM, 0) + _encode_varint(int(d)) for d in array.shape)
    return _bytes_field(BLOB_SHAPE, shape) + _bytes_field(BLOB_DATA, array.tobytes())


def read_mean_file(path):
    """The mean image (C x H x W float32) of a ``.binaryproto`` mean file
    (a BlobProto of shape 1 x C x H x W, or C x H x W). UserError naming the
    file when it is missing or not such a BlobProto."""
    try:
        with open(path, "rb") as f:
            buf = f.read()
    except FileNotFoundError:
        raise UserError(f"mean file '{path}' not found") from None
    except OSError as e:
        raise UserError(f"mean file '{path}' cannot be read ({e})") from None
    try:
        blob = read_blob(buf)
    except (ValueError, IndexError) as e:
        raise UserError(f"mean file '{path}' is not a Caffe BlobProto (.binaryproto): {e}") \
            from None
    if blob.ndim == 4 and blob.shape[0] == 1:
        blob = blob[0]
    if blob.ndim != 3 or blob.size == 0:
        raise UserError(f"mean file '{path}' holds a blob of shape {list(blob.shape)}; "
                        "expected a mean image 1 x C x H x W")
    if not np.isfinite(blob).all():
        raise UserError(f"mean file '{path}' holds non-finite values (NaN or inf)")
    return np.ascontiguousarray(blob)
