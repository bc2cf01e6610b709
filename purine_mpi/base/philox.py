"""Philox4x32-10, the counter-based generator of Random123 (Salmon et al.,
"Parallel random numbers: as easy as 1, 2, 3", SC'11), in vectorised NumPy.

A counter-based generator has no state: the 128-bit output for a (counter,
key) pair is a fixed bijection of the counter under the key, so any element
of a random stream is computed directly from its index. Dropout draws its
masks this way, keyed by (run seed, op) and counted by (element, iteration),
so a mask depends only on those numbers:

- the CPU (this module) and the GPU (``cuda/philox.cuh``, the same rounds in
  CUDA) draw bit-identical masks;
- nothing is saved in a checkpoint: a resumed run redraws the masks of the
  iterations it runs, bit for bit;
- a GPU kernel reads the iteration from a device blob, so the host does no
  work per iteration (and a captured CUDA graph replays correctly).

The stream of an op (see :func:`dropout_keys`)::

    key     = (crc32(op name), seed mod 2^32)
    counter = (block, seed >> 32 mod 2^32, iteration mod 2^32, iteration >> 32)

and element ``i`` of the op's output takes word ``i % 4`` of the block
``i // 4`` (``i`` counted in the unsplit op's output for a tensor-parallel
shard of it, attr ``mask_split``: see :func:`keep_mask`). An element is
kept when its 32-bit word is ``>= threshold``, ``threshold = floor(ratio *
2^32)``: an exact integer test, the same on every device (P(keep) = 1 -
threshold / 2^32, within 2^-32 of 1 - ratio).
"""
import zlib

import numpy as np

#: Philox4x32 round multipliers and Weyl key increments (Random123's values)
M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10

_U32 = np.uint32
_MASK32 = np.uint64(0xFFFFFFFF)


def _mulhilo(multiplier, x):
    """(hi, lo) 32-bit halves of the 64-bit product ``multiplier * x``."""
    product = np.uint64(multiplier) * x.astype(np.uint64)
    return (product >> np.uint64(32)).astype(_U32), (product & _MASK32).astype(_U32)


def philox4x32(counter, key, rounds=ROUNDS):
    """Philox4x32-``rounds`` of ``counter`` (4 arrays or a (4, n) array of
    uint32, broadcast together) under ``key`` (two uint32). Returns a
    (4, n) uint32 array: the four output words of each counter."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=_U32) for c in counter)
    c0, c1, c2, c3 = np.broadcast_arrays(c0, c1, c2, c3)
    k0, k1 = _U32(int(key[0]) & 0xFFFFFFFF), _U32(int(key[1]) & 0xFFFFFFFF)
    with np.errstate(over="ignore"):
        for r in range(rounds):
            if r > 0:  # bump the key before every round but the first
                k0 = _U32((int(k0) + W0) & 0xFFFFFFFF)
                k1 = _U32((int(k1) + W1) & 0xFFFFFFFF)
            hi0, lo0 = _mulhilo(M0, c0)
            hi1, lo1 = _mulhilo(M1, c2)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return np.stack([np.asarray(c, dtype=_U32) for c in (c0, c1, c2, c3)])


def op_id(name):
    """The 32-bit id of an op: crc32 of its name (the same on every rank)."""
    return zlib.crc32(str(name).encode())


def dropout_keys(seed, name):
    """(key0, key1, counter word 1) of op ``name`` under run seed ``seed``."""
    seed = int(seed) % (1 << 64)
    return op_id(name), seed & 0xFFFFFFFF, seed >> 32


def keep_threshold(ratio):
    """The 32-bit threshold of a dropout ``ratio`` in [0, 1)."""
    ratio = float(ratio)
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"dropout ratio must lie in [0, 1), got {ratio}")
    return min(int(ratio * 4294967296.0), 0xFFFFFFFF)


def random_bits(count, key0, key1, ctr1, iteration, start=0):
    """The ``count`` 32-bit words of the stream (see the module docstring)
    at ``iteration`` from element ``start`` on (elements start ..
    start + count - 1): a uint32 array of length ``count``."""
    count, start = int(count), int(start)
    first, end = start // 4, -(-(start + count) // 4)
    words = _block_words(np.arange(first, end, dtype=np.uint64), start + count,
                         key0, key1, ctr1, iteration)
    skip = start - 4 * first
    return words.T.reshape(-1)[skip:skip + count]


def _block_words(blocks, elements, key0, key1, ctr1, iteration):
    """The (4, n) words of the stream's blocks ``blocks`` (uint64, flat) at
    ``iteration``, of a stream of ``elements`` elements (at most 2^34)."""
    if -(-int(elements) // 4) > (1 << 32):
        raise ValueError("a Philox dropout stream holds at most 2^34 elements, got "
                         f"{elements}")
    iteration = int(iteration) % (1 << 64)
    return philox4x32((blocks.astype(_U32), ctr1, iteration & 0xFFFFFFFF, iteration >> 32),
                      (key0, key1))


def keep_mask(shape, ratio, key0, key1, ctr1, iteration, split=None):
    """Boolean keep-mask of ``shape``: element i kept iff its word >= threshold.

    ``split`` ({"axis", "parts", "index"}, a tensor-parallel shard's op:
    parallel/tensor_parallel.py): the array of ``shape`` is part ``index``
    of ``parts`` equal parts along ``axis`` of the unsplit op's array, and
    each element takes the word of its flat index in that whole array, so
    the shard's mask is the unsplit mask's slice. The elements of one index
    before ``axis`` (a run) are contiguous in the whole, run r from element
    (r·parts + index)·run on: every run's blocks are drawn at once, and the
    runs starting at the same word of a block (at most 4 groups) are taken
    together."""
    threshold = _U32(keep_threshold(ratio))
    shape = tuple(int(s) for s in shape)
    if not split or int(split["parts"]) == 1:
        count = int(np.prod(shape, dtype=np.int64))
        return (random_bits(count, key0, key1, ctr1, iteration) >= threshold).reshape(shape)
    axis, parts, index = (int(split[k]) for k in ("axis", "parts", "index"))
    axis = axis + len(shape) if axis < 0 else axis
    runs = int(np.prod(shape[:axis], dtype=np.int64))
    run = int(np.prod(shape[axis:], dtype=np.int64))
    starts = (np.arange(runs, dtype=np.uint64) * parts + index) * run
    skips = (starts % 4).astype(np.int64)
    blocks = -(-(run + int(skips.max(initial=0))) // 4)  # the blocks a run spans
    first = starts // 4
    words = _block_words((first[:, None] + np.arange(blocks, dtype=np.uint64)).reshape(-1),
                         runs * parts * run, key0, key1, ctr1, iteration)
    words = words.T.reshape(runs, 4 * blocks)
    keep = np.empty((runs, run), dtype=bool)
    for skip in np.unique(skips):
        rows = skips == skip
        keep[rows] = words[rows, skip:skip + run] >= threshold
    return keep.reshape(shape)


def keep_mask_temporaries(shape):
    """The ``(shape, dtype)`` arrays live at the peak of a host
    :func:`keep_mask` of ``shape`` besides its result, from the shapes as
    the code allocates them (tests/test_host_temporaries.py measures them):
    in the last rounds the four counter words, two 32-bit halves of a
    product and the 64-bit product with its shifted copy, a quarter of the
    elements each, with the block numbers: 14 bytes an element."""
    return [(tuple(shape), np.uint32)] * 3 + [(tuple(shape), np.uint16)]
