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
nothing (a captured CUDA graph may hold it).

``parallel.grad_dtype: bf16`` moves gradient buckets as bfloat16 bits
(``GRAD_WIRE``): ``to_bf16_bits`` rounds float32 into a uint16 copy the
same way, ``from_bf16_bits`` widens it back, ``add_bf16_bits`` is one step
of a bfloat16 sum (comm/ops.bf16_sum_op, MPI's user op). These are the host's
(MPI's buckets); a device bucket (comm/nccl.py) converts with one kernel each
way, the same bits (gpu/kernels ``to_bf16_bits_device``,
``from_bf16_bits_device``).

bf16 *storage* (parallel/precision.store_bits): a blob of bfloat16 values
whose every reader takes bfloat16 bits is stored as them, dtype ``BITS``
(uint16, 2 bytes an element), written as bits by its producer;
``is_bits`` tells such an array or dtype."""
import numpy as np

#: the values of the config key ``precision``
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
#: the low precisions and their dtype names
LOW_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
#: short names of the dtype names (graph listings, blob suffixes)
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

#: the storage dtype of a blob held as bfloat16 bits
BITS = "uint16"

_BF16_ROUND, _BF16_MASK, _EXPONENT = 0x7FFF, 0xFFFF0000, 0x7F800000


def low_dtype(precision):
    """The dtype name of a low precision (``bf16`` -> ``bfloat16``), else None."""
    return LOW_DTYPES.get(precision)


def is_bits(x):
    """Whether ``x`` (an array, or a dtype or its name) is bfloat16 bits
    storage (``BITS``)."""
    return np.dtype(getattr(x, "dtype", x)) == np.dtype(BITS)


def value_dtype(dtype):
    """The dtype of the values a blob of ``dtype`` (or an array) holds:
    float32 for bfloat16 bits storage (what its readers widen it to, what
    a product of it accumulates in), else its own."""
    return np.dtype(np.float32) if is_bits(dtype) else np.dtype(getattr(dtype, "dtype", dtype))


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
    _round_bits(_xp(x), x.view(np.uint32), scratch[0], scratch[1])
    return x


def _round_bits(xp, bits, inc, finite):
    """Round the float32 bit patterns ``bits`` (uint32) in place to the
    nearest bfloat16 (ties to even; ``inc`` and ``finite`` are uint32
    scratch of its shape): the low 16 bits end zero."""
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


#: ``parallel.grad_dtype`` -> the dtype the gradient buckets cross the ranks
#: in (None: their own, float32), and the bytes of one element of it
GRAD_WIRE = {"fp32": None, "bf16": "bfloat16"}
WIRE_ITEMSIZE = {"bfloat16": 2}
#: elements ``to_bf16_bits`` rounds per step (its scratch: 3 uint32 of each)
WIRE_CHUNK = 1 << 16


def wire_scratch(size, xp=np):
    """The scratch ``to_bf16_bits`` needs for ``size`` elements (a bounded
    chunk, allocated once: the rounding allocates nothing)."""
    return xp.empty((3, max(1, min(int(size), WIRE_CHUNK))), dtype=np.uint32)


def to_bf16_bits(x, out, scratch):
    """``out`` (uint16, ``x``'s size) = the bits of the bfloat16 nearest each
    float32 of ``x`` (ties to even; ``x`` is not changed), a chunk of
    ``scratch`` (``wire_scratch``) at a time."""
    xp = _xp(x)
    src, dst, step = x.reshape(-1).view(np.uint32), out.reshape(-1), scratch.shape[1]
    for a in range(0, src.size, step):
        b = min(src.size, a + step)
        bits, inc, finite = scratch[0, :b - a], scratch[1, :b - a], scratch[2, :b - a]
        bits[...] = src[a:b]
        _round_bits(xp, bits, inc, finite)
        xp.right_shift(bits, 16, out=bits)
        dst[a:b] = bits
    return out


def from_bf16_bits(bits, x):
    """``x`` (float32) = the bfloat16 values whose bits are ``bits`` (uint16),
    widened exactly."""
    wide = x.reshape(-1).view(np.uint32)
    wide[...] = bits.reshape(-1)
    _xp(x).left_shift(wide, 16, out=wide)
    return x


def add_bf16_bits(a, b):
    """``b += a`` for bfloat16 values held as their uint16 bits (NumPy): both
    widened to float32, added, the sum rounded back to bfloat16 -- one
    reduction step of a bfloat16 sum, as NCCL's."""
    with np.errstate(over="ignore"):
        total = (a.astype(np.uint32) << 16).view(np.float32) + \
            (b.astype(np.uint32) << 16).view(np.float32)
    bits = total.view(np.uint32)
    _round_bits(np, bits, np.empty_like(bits), np.empty_like(bits))
    b[...] = bits >> 16
    return b


def _xp(x):
    from .backend import get_xp
    return get_xp(x)
