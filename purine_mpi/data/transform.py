"""The data transform of a data source: Caffe's ``transform_param``.

A data spec may carry these keys (Caffe's names); the DataReader applies them
to every batch in its prefetch thread, after the samples are gathered:

    crop_size  int     crop_size x crop_size window of each H x W sample: at a
                       random offset in training, the center in testing
                       (offset (H - crop_size) // 2, as Caffe)
    mirror     bool    flip a sample horizontally (last axis) with probability
                       1/2, in training only (Caffe would also flip at test
                       time; a deterministic test pass is more useful here)
    mean_file  a Caffe ``.binaryproto`` mean image (C x H x W, the samples'
               shape before the crop), subtracted pixel by pixel: the window
               of the crop, before the flip (Caffe's index arithmetic)
    mean       number or per-channel list, subtracted (Caffe's mean_value;
               not together with mean_file)
    scale      number, multiplied after the mean is subtracted

In Caffe's order: ``out = (mirror(crop(x) - crop(mean_image)) - mean) * scale``, float32. The
input may be any numeric dtype (float32 or uint8 files); cropping and
flipping happen before the conversion to float32, so a uint8 batch is
converted once and only its cropped window.

The random choices of a sample depend only on the run seed and the sample's
global position in the data order (``purine_mpi.data.sources.batch_positions``),
never on the rank or the thread that reads it: N ranks x B read and transform
exactly what 1 rank x N*B does, and a resumed run draws what the
uninterrupted one would have drawn.
"""

import numpy as np

from ..base.errors import DataSpecError, UserError
from .filecache import per_file_version
from .protowire import read_mean_file

TRANSFORM_KEYS = ("scale", "mean", "mean_file", "mirror", "crop_size")

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
# one stream of random draws per decision, so adding one never shifts another
_STREAM_MIRROR, _STREAM_CROP_Y, _STREAM_CROP_X = 1, 2, 3


def has_transform(spec):
    """True when the data spec asks for any transform."""
    return any(spec.get(k) is not None for k in TRANSFORM_KEYS)


def output_shape(spec, sample_shape):
    """The shape of one transformed sample. Raises UserError when the spec
    does not fit the samples (a crop larger than the image, a mean with the
    wrong number of channels, a crop of samples that are not C x H x W)."""
    shape = tuple(int(s) for s in sample_shape)
    crop = spec.get("crop_size")
    mean = spec.get("mean")
    if spec.get("mean_file") is not None:
        try:
            image = mean_image(spec["mean_file"])
        except UserError as exc:  # missing or damaged: named against its key
            raise DataSpecError(str(exc), "mean_file") from None
        if image.shape != shape:
            raise DataSpecError(f"data spec: mean file '{spec['mean_file']}' holds a mean image of "
                            f"shape {list(image.shape)} but the samples of "
                            f"{_source_name(spec)} have shape {list(shape)} (C x H x W before "
                            "the crop); they must agree", "mean_file")
    if (crop is not None or spec.get("mirror")) and len(shape) != 3:
        raise DataSpecError(f"data spec: crop_size and mirror need C x H x W samples, "
                            f"the source's samples have shape {list(shape)}",
                            "crop_size" if crop is not None else "mirror")
    if isinstance(mean, (list, tuple)) and len(mean) != 1 and (not shape or len(mean) != shape[0]):
        raise DataSpecError(f"data spec: key 'mean' has {len(mean)} values but the samples "
                            f"have {shape[0] if shape else 0} channels (shape {list(shape)}); "
                            "give one value per channel or a single number", "mean")
    if crop is not None:
        if crop > shape[1] or crop > shape[2]:
            raise DataSpecError(f"data spec: crop_size {crop} is larger than the samples' "
                                f"H x W = {shape[1]} x {shape[2]}", "crop_size")
        shape = (shape[0], crop, crop)
    return shape


def _source_name(spec):
    if spec.get("source") == "lmdb":
        return f"lmdb source '{spec.get('path')}'"
    if spec.get("path"):
        return f"data file '{spec.get('path')}'"
    return "the synthetic source"


def mean_image(path):
    """The mean image of a ``.binaryproto`` file (read-only float32 C x H x W),
    read once per process and file version."""
    return per_file_version(path, _read_mean_image)


def _read_mean_image(path):
    image = read_mean_file(path)
    image.setflags(write=False)
    return image


def random_draws(seed, positions, stream):
    """One uint64 per position, a function of (seed, position, stream) only
    (SplitMix64 of the three mixed together)."""
    with np.errstate(over="ignore"):
        z = (np.asarray(positions, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
             + np.uint64(int(seed) & 0xFFFFFFFFFFFFFFFF) * np.uint64(0xD1B54A32D192ED03)
             + np.uint64(stream) * np.uint64(0x8CB92BA72F3D8DD7))
        z &= _MASK64
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def apply_transform(data, spec, positions, seed, train):
    """The transformed batch (float32) of ``data`` (B x C x H x W, any
    numeric dtype) whose samples sit at global ``positions`` (B,)."""
    if not has_transform(spec):
        return data
    positions = np.asarray(positions, dtype=np.int64)
    crop = spec.get("crop_size")
    image = mean_image(spec["mean_file"]) if spec.get("mean_file") is not None else None
    if crop is not None:
        top, left = _offsets(data, crop, positions, seed, train)
        data = _crop(data, crop, top, left)
    if image is not None:
        data = np.array(data, dtype=np.float32)  # the mean image follows the source pixel:
        if crop is None:                         # subtracted before the flip
            data -= image
        else:
            data -= _crop(np.broadcast_to(image, (len(data),) + image.shape), crop, top, left)
    if spec.get("mirror") and train:
        flip = (random_draws(seed, positions, _STREAM_MIRROR) >> np.uint64(63)).astype(bool)
        if flip.any():
            data = np.array(data)  # a copy: the source's arrays are shared read-only
            data[flip] = data[flip][..., ::-1]
    out = np.array(data, dtype=np.float32)  # always a fresh array
    mean = spec.get("mean")
    if mean is not None:
        mean = np.asarray(mean, dtype=np.float32)
        out -= mean.reshape((-1,) + (1,) * (out.ndim - 2)) if mean.ndim else mean
    scale = spec.get("scale")
    if scale is not None:
        out *= np.float32(scale)
    return out


def _offsets(data, crop, positions, seed, train):
    """(top, left) of each sample's crop window."""
    height, width = data.shape[-2], data.shape[-1]
    if train:
        top = (random_draws(seed, positions, _STREAM_CROP_Y) % np.uint64(height - crop + 1))
        left = (random_draws(seed, positions, _STREAM_CROP_X) % np.uint64(width - crop + 1))
        return top.astype(np.int64), left.astype(np.int64)
    return (np.full(len(data), (height - crop) // 2, dtype=np.int64),
            np.full(len(data), (width - crop) // 2, dtype=np.int64))


def _crop(data, crop, top, left):
    out = np.empty(data.shape[:-2] + (crop, crop), dtype=data.dtype)
    for i in range(len(data)):
        out[i] = data[i, ..., top[i]:top[i] + crop, left[i]:left[i] + crop]
    return out
