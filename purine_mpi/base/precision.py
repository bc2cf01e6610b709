"""Compute precisions (config key ``precision``) and the rounding of the
low ones, on any array module (NumPy, CuPy, the emulated device's arrays).

``PRECISIONS``: ``fp32`` (the default), ``tf32`` (float32 storage, GEMMs and
convolutions may use TensorFloat-32), ``bf16`` and ``fp16`` (the GEMMs,
convolutions and attention round their inputs and outputs to bfloat16 or
float16 and accumulate in float32; docs/gpu.md, "Precision").
``LOW_DTYPES`` maps each low precision to its dtype name, the name the
precision pass (parallel/precision.py) writes into ``compute_dtype``.

``round_to(x, dtype, scratch)`` rounds a float32 array in place to the
nearest ``dtype`` value (round to nearest, ties to even, as the GPU's
conversions do): the values a bfloat16 or float16 array would hold, kept in
float32 storage. bfloat16 is the upper half of a float32, so rounding is
integer arithmetic on the float32's bits (no bfloat16 type needed: neither
NumPy nor CuPy has one); float16 goes through a float16 array. ``scratch``
is an array of ``scratch_spec(x.shape, dtype)``: the rounding allocates
nothing (a captured CUDA graph may hold it)."""
import numpy as np

#: the values of the config key ``precision``
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
#: the low precisions and their dtype names
LOW_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
#: short names of the dtype names (graph listings, blob suffixes)
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

_BF16_ROUND, _BF16_MASK, _EXPONENT = 0x7FFF, 0xFFFF0000, 0x7F800000


def low_dtype(precision):
    """The dtype name of a low precision (``bf16`` -> ``bfloat16``), else None."""
    return LOW_DTYPES.get(precision)


def scratch_spec(shape, dtype):
    """(shape, dtype) of the scratch ``round_to`` needs for an array of
    ``shape`` rounded to ``dtype``."""
    if dtype == "bfloat16":
        return (2,) + tuple(shape), np.uint32
    return tuple(shape), np.float16


def round_to(x, dtype, scratch):
    """Round the float32 array ``x`` in place to ``dtype`` (``bfloat16`` or
    ``float16``), through ``scratch`` (``scratch_spec``). Infinities stay;
    finite values beyond the type's range become infinite, as a cast does."""
    if x.dtype != np.float32:
        raise TypeError(f"round_to: a float32 array, got {x.dtype}")
    if dtype == "float16":
        with np.errstate(over="ignore"):  # beyond 65504: infinite, as on the GPU
            scratch[...] = x
        x[...] = scratch
        return x
    if dtype != "bfloat16":
        raise ValueError(f"round_to: bfloat16 or float16, got {dtype!r}")
    xp = _xp(x)
    bits, inc, finite = x.view(np.uint32), scratch[0], scratch[1]
    xp.right_shift(bits, 16, out=inc)               # the bit that decides a tie
    xp.bitwise_and(inc, 1, out=inc)
    xp.add(inc, _BF16_ROUND, out=inc)
    # infinities and NaNs are truncated, not rounded (a carry would turn a
    # NaN into a wrong number); a NaN whose payload lies in the low 16 bits
    # only becomes infinite: non-finite still, as the overflow check needs
    xp.bitwise_and(bits, _EXPONENT, out=finite)
    xp.not_equal(finite, _EXPONENT, out=finite)
    xp.multiply(inc, finite, out=inc)
    xp.add(bits, inc, out=bits)
    xp.bitwise_and(bits, _BF16_MASK, out=bits)
    return x


def _xp(x):
    from .backend import get_xp
    return get_xp(x)
