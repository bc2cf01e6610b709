"""Parameter initialisation (Caffe's fillers). Each parameter draws from its
own generator seeded by (seed, name), so initial weights depend only on the
seed -- never on the rank count or the order layers were built in.
"""
import zlib

import numpy as np

# Filler type -> its keys and their defaults (docs/config.md is generated
# from this table: after changing it run python -m purine_mpi.tools.docgen --write).
FILLERS = {
    "constant": {"value": 0.0},
    "xavier": {},     # U(-a, a), a = sqrt(3 / fan_in)  (Caffe's xavier, variance_norm FAN_IN)
    "msra": {},       # N(0, 2 / fan_in)  (He et al.)
    "gaussian": {"mean": 0.0, "std": 0.01},
    "uniform": {"min": -0.05, "max": 0.05},
}
FILLER_DOC = {
    "constant": "every element = value",
    "xavier": "U(-a, a), a = sqrt(3 / fan_in) (Caffe's xavier)",
    "msra": "N(0, 2 / fan_in) (He et al.)",
    "gaussian": "N(mean, std²)",
    "uniform": "U(min, max)",
}


def fill(blob, seed):
    """Initial value of a param blob from its ``attrs['filler']``."""
    f = blob.attrs.get("filler", {"type": "constant", "value": 0.0})
    rng = np.random.default_rng([seed, zlib.crc32(blob.name.encode())])
    shape = blob.shape
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])
    kind = f.get("type", "constant")
    if kind not in FILLERS:
        raise ValueError(f"unknown filler {kind!r}")
    f = dict(FILLERS[kind], **f)
    if kind == "constant":
        v = np.full(shape, f["value"])
    elif kind == "xavier":  # Caffe: U(-a, a), a = sqrt(3 / fan_in)
        a = np.sqrt(3.0 / fan_in)
        v = rng.uniform(-a, a, shape)
    elif kind == "msra":  # He et al.: N(0, 2 / fan_in)
        v = rng.normal(0.0, np.sqrt(2.0 / fan_in), shape)
    elif kind == "gaussian":
        v = rng.normal(f["mean"], f["std"], shape)
    elif kind == "uniform":
        v = rng.uniform(f["min"], f["max"], shape)
    return v.astype(blob.dtype)
