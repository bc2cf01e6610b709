"""Parameter initialisation (Caffe's fillers). Each parameter draws from its
own generator seeded by (seed, name), so initial weights depend only on the
seed -- never on the rank count or the order layers were built in."""
import zlib

import numpy as np


def fill(blob, seed):
    """Initial value of a param blob from its ``attrs['filler']``."""
    f = blob.attrs.get("filler", {"type": "constant", "value": 0.0})
    rng = np.random.default_rng([seed, zlib.crc32(blob.name.encode())])
    shape = blob.shape
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])
    kind = f.get("type", "constant")
    if kind == "constant":
        v = np.full(shape, f.get("value", 0.0))
    elif kind == "xavier":  # Caffe: U(-a, a), a = sqrt(3 / fan_in)
        a = np.sqrt(3.0 / fan_in)
        v = rng.uniform(-a, a, shape)
    elif kind == "msra":  # He et al.: N(0, 2 / fan_in)
        v = rng.normal(0.0, np.sqrt(2.0 / fan_in), shape)
    elif kind == "gaussian":
        v = rng.normal(f.get("mean", 0.0), f.get("std", 0.01), shape)
    elif kind == "uniform":
        v = rng.uniform(f.get("min", -0.05), f.get("max", 0.05), shape)
    else:
        raise ValueError(f"unknown filler {kind!r}")
    return v.astype(blob.dtype)
