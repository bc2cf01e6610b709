"""Caffe's binary ``.caffemodel`` (a NetParameter in protobuf wire format)
-> our parameters, by layer name (``train --init`` / ``test --weights``).

The wire-format reader is ``data/protowire.py``. This module reads only what weights
need (layer name, type, bottoms, tops, blobs) from both ``layer`` (field
100) and the old ``layers`` (field 2) entries.

Blob mapping (Caffe layer L -> our blobs):
    Convolution, InnerProduct   blobs[0] -> L/weight, blobs[1] -> L/bias
    BatchNorm                   blobs[0] / blobs[2][0] -> L/running_mean,
                                blobs[1] / blobs[2][0] -> L/running_var
                                (Caffe stores sums and their scale factor,
                                which the BatchNorm kernel continues from)
    Scale after BatchNorm B     blobs[0] -> B/weight, blobs[1] -> B/bias
"""
import mmap
import os

import numpy as np

from ..base.errors import UserError
from ..data import protowire
from . import caffe_schema as S


class CaffemodelError(UserError):
    pass


# ------------------------------------------------------------- wire format
# the reader lives in data/protowire (the mean files and LMDB records use it too)
fields, read_blob = protowire.fields, protowire.read_blob


def read_layers(path, blob=None):
    """[(name, type, bottoms, tops, [blob arrays])] of a .caffemodel, in file
    order. The file is read whole and each blob's values copied out of it
    (float32: ``read_blob``), the file's bytes held until the last.
    ``blob``: what each blob becomes in their place (``caffemodel_nbytes``:
    its number of values; the file is then mapped, only the fields' headers
    read)."""
    try:
        with open(path, "rb") as f:
            if blob is not None and os.fstat(f.fileno()).st_size:
                buf = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            else:
                buf = memoryview(f.read())
    except FileNotFoundError:
        raise CaffemodelError(f"weights file '{path}' not found") from None
    except OSError as e:
        raise CaffemodelError(f"weights file '{path}' cannot be read ({e})") from None
    layers = []
    try:
        for number, wire, value in fields(buf):
            if wire != 2 or number not in (S.NET_LAYER, S.NET_LAYERS_V1):
                continue
            v1 = number == S.NET_LAYERS_V1
            ids = ((S.V1_NAME, S.V1_TYPE, S.V1_BOTTOM, S.V1_TOP, S.V1_BLOBS) if v1 else
                   (S.LAYER_NAME, S.LAYER_TYPE, S.LAYER_BOTTOM, S.LAYER_TOP, S.LAYER_BLOBS))
            name, kind, bottoms, tops, blobs = "", "", [], [], []
            for n, w, v in fields(value):
                if n == ids[0] and w == 2:
                    name = bytes(v).decode("utf-8")
                elif n == ids[1]:
                    kind = bytes(v).decode("utf-8") if w == 2 else S.V1_BY_NUMBER.get(v, str(v))
                elif n == ids[2] and w == 2:
                    bottoms.append(bytes(v).decode("utf-8"))
                elif n == ids[3] and w == 2:
                    tops.append(bytes(v).decode("utf-8"))
                elif n == ids[4] and w == 2:
                    blobs.append((blob or read_blob)(v))
            layers.append((name, kind, bottoms, tops, blobs))
    except (ValueError, UnicodeDecodeError) as e:
        raise CaffemodelError(f"weights file '{path}' is not a Caffe NetParameter in binary "
                              f"protobuf format ({e})") from None
    if not layers:
        raise CaffemodelError(f"weights file '{path}' holds no layers; expected a binary "
                              "Caffe .caffemodel")
    return layers


def caffemodel_nbytes(path):
    """The host bytes ``caffe_params`` holds at its most (``plan --init``'s
    start-up load): the file read whole and, by its end, every blob of
    every layer copied out as a float32 array (``read_layers``; the arrays
    of the layers the net uses are kept, the file and the others let go
    once it returns)."""
    sizes = [n for *_, blobs in read_layers(path, blob=protowire.blob_size) for n in blobs]
    return os.path.getsize(path) + 4 * sum(sizes)


# ------------------------------------------------------------------ mapping
def caffe_params(path, shapes):
    """({our param name: array}, report lines, {BatchNorm layer: Caffe's
    moving-average factor}) for the params in ``shapes`` ({name: shape})
    that the .caffemodel at ``path`` holds. A blob whose shape differs from
    ours is a CaffemodelError naming both."""
    layers = read_layers(path)
    values, report, factors = {}, [], {}
    for i, (name, kind, bottoms, tops, blobs) in enumerate(layers):
        if not blobs:
            continue
        owner, targets = name, _targets(kind, blobs)
        if kind == "Scale":
            bn = next((lay for lay in reversed(layers[:i]) if set(lay[3]) & set(bottoms)), None)
            if bn is not None and bn[1] == "BatchNorm":
                owner = bn[0]
        matched, again = [], []
        for suffix, value in targets:
            ours = f"{owner}/{suffix}"
            if ours not in shapes:
                continue
            if ours in values:  # a second layer of the name: the later wins, as in Caffe
                again.append(ours)
            value = _fit(value, tuple(shapes[ours]), ours, name, path)
            values[ours] = value
            matched.append(f"{suffix} {list(value.shape)}")
        if matched and kind == "BatchNorm" and len(blobs) >= 3 and blobs[2].size:
            factors[owner] = float(blobs[2].reshape(-1)[0])
        if matched:
            via = f" -> {owner}" if owner != name else ""
            report.append(f"matched {name} ({kind}){via}: {', '.join(matched)}")
        else:
            report.append(f"not used: {name} ({kind}, {len(blobs)} blob(s)): no such layer "
                          "in the net")
        if again:
            report.append(f"note: the file has an earlier layer named '{name}': its "
                          f"{', '.join(again)} replace that layer's (the later layer wins, as "
                          "in Caffe's loader)")
    return values, report, factors


def _targets(kind, blobs):
    if kind == "BatchNorm" and len(blobs) >= 3:
        factor = float(blobs[2].reshape(-1)[0]) if blobs[2].size else 0.0
        scale = 0.0 if factor == 0 else 1.0 / factor  # Caffe's own rule
        return [("running_mean", blobs[0] * np.float32(scale)),
                ("running_var", blobs[1] * np.float32(scale))]
    return list(zip(("weight", "bias"), blobs))


def _fit(value, shape, ours, layer, path):
    """The blob in our shape: exact, or a legacy 4-D blob (1, 1, out, in)
    with the same values once its leading ones are dropped."""
    if value.shape == shape:
        return value
    squeeze = value.shape
    while len(squeeze) > len(shape) and squeeze[0] == 1:
        squeeze = squeeze[1:]
    if squeeze == shape:
        return value.reshape(shape)
    raise CaffemodelError(f"weights file '{path}': layer '{layer}' blob for '{ours}' has shape "
                          f"{list(value.shape)}, the net expects {list(shape)}")
