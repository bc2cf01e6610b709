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

The host draw (:func:`keep_mask`, :func:`random_bits`) runs a chunk of
:data:`CHUNK` blocks at a time through a :class:`Stream`'s preallocated
buffers with in-place ufuncs (a chunk's buffers stay in a core's cache): the
counter words 0 and 2 are kept in uint64 arrays (high halves 0, the
multiplies' operands), the 32-bit halves of a 64-bit product are read as
strided uint32 views of it (by its byte order, :func:`halves`), and a
round's key is XORed into the last round's products (whose low halves are
the words 1 and 3 the round reads); a chunk's first round is cheaper (the
counter words 1 to 3 are the same in every block: :meth:`Stream.draw`).
keep_mask compares a chunk's words with the threshold as they come: no
array of all the words exists.
"""
import sys
import zlib

import numpy as np

#: Philox4x32 round multipliers and Weyl key increments (Random123's values)
M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
#: blocks (4 words each) a chunk of a host draw: a :class:`Stream`'s seven
#: uint64 buffers of a chunk (896 KiB) fit a core's L2 cache; 8-64 Ki blocks
#: measured within the noise of each other, 16 Ki the best of them
#: (benchmarks/philox_speed.py --chunk)
CHUNK = 1 << 14
#: the uint64 buffers of a Stream: counter words 0 and 2, the two products
#: of a round and the two of the last, and the block numbers 0, 1, ...
STREAM_BUFFERS = 7

_U32 = np.uint32
_U64 = np.uint64
_MASK32 = 0xFFFFFFFF


def halves(a):
    """(hi, lo): the 32-bit halves of the elements of ``a`` (a 1-D contiguous
    uint64 array) as strided uint32 views of it, by its byte order: the low
    word is the first of an element's two on a little-endian array, the
    second on a big-endian one."""
    order = a.dtype.byteorder
    little = (sys.byteorder == "little") if order in "=|" else order == "<"
    words = a.view(np.dtype(_U32).newbyteorder(order))
    lo = 0 if little else 1
    return words[1 - lo::2], words[lo::2]


def _round_keys(key, rounds):
    """The key of each round (bumped by the Weyl increments before every
    round but the first)."""
    k0, k1 = int(key[0]) & _MASK32, int(key[1]) & _MASK32
    for _ in range(rounds):
        yield k0, k1
        k0, k1 = (k0 + W0) & _MASK32, (k1 + W1) & _MASK32


def _rounds(x0, x2, p0, p1, q0, q1, key, rounds):
    """Philox4x32-``rounds`` in place on n counters: ``x0``, ``x2`` (uint64,
    n) hold the counter words 0 and 2 (high halves 0), the low halves of
    ``p1``, ``p0`` (uint64, n) the words 1 and 3; ``q0``, ``q1`` (uint64, n)
    are scratch. A round: the round's key into the low halves of p1, p0;
    q0 = M0·x0, q1 = M1·x2 (exact: 32 by 32 bits); x0 <- hi(q1) ^ lo(p1),
    x2 <- hi(q0) ^ lo(p0); the products are the next round's p (their low
    halves the new words 1 and 3). Returns the four output words, strided
    uint32 views of the buffers."""
    lo0, lo2 = halves(x0)[1], halves(x2)[1]
    last, this = (halves(p0), halves(p1)), (halves(q0), halves(q1))
    m0, m1 = _U64(M0), _U64(M1)
    for k0, k1 in _round_keys(key, rounds):
        np.bitwise_xor(p1, _U64(k0), out=p1)
        np.bitwise_xor(p0, _U64(k1), out=p0)
        np.multiply(x0, m0, out=q0)
        np.multiply(x2, m1, out=q1)
        np.bitwise_xor(this[1][0], last[1][1], out=lo0)
        np.bitwise_xor(this[0][0], last[0][1], out=lo2)
        p0, p1, q0, q1 = q0, q1, p0, p1
        last, this = this, last
    return lo0, last[1][1], lo2, last[0][1]


def philox4x32(counter, key, rounds=ROUNDS):
    """Philox4x32-``rounds`` of ``counter`` (4 arrays or a (4, n) array of
    uint32, broadcast together) under ``key`` (two uint32). Returns a
    (4, n) uint32 array: the four output words of each counter."""
    c0, c1, c2, c3 = np.broadcast_arrays(*(np.asarray(c, dtype=_U32) for c in counter))
    x0, x2, p0, p1, q0, q1 = (np.empty(c0.size, _U64) for _ in range(6))
    for buffer, word in ((x0, c0), (x2, c2), (p0, c3), (p1, c1)):
        buffer[...] = word.reshape(-1)
    words = _rounds(x0, x2, p0, p1, q0, q1, key, rounds)
    return np.stack(words).reshape((4,) + c0.shape)


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


class Stream:
    """A host draw of an op's stream (the module docstring) at one
    iteration, for a stream of ``elements`` elements (at most 2^34): the
    buffers of a chunk of ``size`` blocks (:data:`STREAM_BUFFERS` uint64
    arrays of ``size``)."""

    def __init__(self, key0, key1, ctr1, iteration, elements, size):
        if -(-int(elements) // 4) > (1 << 32):
            raise ValueError("a Philox dropout stream holds at most 2^34 elements, got "
                             f"{elements}")
        iteration = int(iteration) % (1 << 64)
        self.key = (key0, key1)
        self.counter = (int(ctr1) & _MASK32, iteration & _MASK32, iteration >> 32)
        self.size = int(size)
        self.buffers = [np.empty(self.size, _U64) for _ in range(STREAM_BUFFERS - 1)]
        self.ramp = np.arange(self.size, dtype=_U64)   # 0, 1, ... (block offsets)

    @property
    def numbers(self):
        """Where a chunk's block numbers go before :meth:`draw` (uint64, size)."""
        return self.buffers[0]

    def draw(self, m):
        """The four words (uint32 views, m each) of the ``m`` blocks numbered
        by ``numbers[:m]`` (which the draw overwrites). The first round
        apart: the counter words 1 to 3 are the same in every block, so only
        word 0's product varies (word 0 after it is one number, word 2 =
        hi(M0·c0) ^ c3 ^ k1, word 3 = lo(M0·c0), word 1 = lo(M1·c2))."""
        x0, x2, p0, p1, q0, q1 = (b[:m] for b in self.buffers)
        c1, c2, c3 = self.counter
        keys = _round_keys(self.key, 2)
        k0, k1 = next(keys)
        np.multiply(x0, _U64(M0), out=p0)
        np.right_shift(p0, _U64(32), out=x2)
        np.bitwise_xor(x2, _U64(c3 ^ k1), out=x2)
        product = M1 * c2
        x0.fill((product >> 32) ^ c1 ^ k0)
        p1.fill(product & _MASK32)
        return _rounds(x0, x2, p0, p1, q0, q1, next(keys), ROUNDS - 1)


def open_stream(key0, key1, ctr1, iteration, elements, blocks):
    """The :class:`Stream` of a host draw of ``blocks`` blocks in all: its
    chunk is ``blocks`` (at least 1) up to :data:`CHUNK`. Every host draw
    opens one (a test counts the draws here)."""
    return Stream(key0, key1, ctr1, iteration, elements, chunk_blocks(blocks))


def chunk_blocks(blocks):
    """The blocks of a draw's chunk buffers, for ``blocks`` blocks in all."""
    return min(max(int(blocks), 1), CHUNK)


def _draw_range(stream, start, out, chunk, emit):
    """out (1-D) <- the words of the elements start .. start + out.size - 1
    through ``emit(words, column)``, a chunk of blocks at a time into
    ``chunk`` ((stream.size, 4), out's dtype, a block a row)."""
    count = out.size
    first, end = start // 4, -(-(start + count) // 4)
    flat = chunk.reshape(-1)
    for b in range(first, end, stream.size):
        m = min(stream.size, end - b)
        np.add(stream.ramp[:m], _U64(b), out=stream.numbers[:m])
        for j, words in enumerate(stream.draw(m)):
            emit(words, chunk[:m, j])
        lo, hi = max(4 * b, start), min(4 * (b + m), start + count)
        out[lo - start:hi - start] = flat[lo - 4 * b:hi - 4 * b]


def random_bits(count, key0, key1, ctr1, iteration, start=0):
    """The ``count`` 32-bit words of the stream (see the module docstring)
    at ``iteration`` from element ``start`` on (elements start ..
    start + count - 1): a uint32 array of length ``count``."""
    count, start = int(count), int(start)
    stream = open_stream(key0, key1, ctr1, iteration, start + count,
                         -(-(start + count) // 4) - start // 4)
    words = np.empty(count, _U32)
    _draw_range(stream, start, words, np.empty((stream.size, 4), _U32), _copy)
    return words


def _copy(words, out):
    np.copyto(out, words)


def _runs(shape, split):
    """(runs, run, parts, index) of a keep_mask of ``shape`` under ``split``
    (see :func:`keep_mask`): ``runs`` runs of ``run`` elements, run r from
    element (r·parts + index)·run of the unsplit array on."""
    count = int(np.prod(shape, dtype=np.int64))
    if not split or int(split["parts"]) == 1:
        return 1, count, 1, 0
    axis, parts, index = (int(split[k]) for k in ("axis", "parts", "index"))
    axis = axis + len(shape) if axis < 0 else axis
    return (int(np.prod(shape[:axis], dtype=np.int64)),
            int(np.prod(shape[axis:], dtype=np.int64)), parts, index)


def _plan(shape, split):
    """How keep_mask draws ``shape`` under ``split``: (runs, run, parts,
    index, the blocks a run spans, each run's skip by r mod 4, whether a
    chunk holds whole runs (a split's runs that fit a chunk), the blocks of
    the chunk buffers)."""
    runs, run, parts, index = _runs(shape, split)
    skips = [((r * parts + index) * run) % 4 for r in range(4)]
    span = -(-(run + max(skips)) // 4)
    grouped = runs > 1 and 0 < span <= CHUNK
    blocks = chunk_blocks(runs * span if grouped else span)
    return runs, run, parts, index, span, skips, grouped, blocks


def keep_mask(shape, ratio, key0, key1, ctr1, iteration, split=None):
    """Boolean keep-mask of ``shape``: element i kept iff its word >= threshold.

    ``split`` ({"axis", "parts", "index"}, a tensor-parallel shard's op:
    parallel/tensor_parallel.py): the array of ``shape`` is part ``index``
    of ``parts`` equal parts along ``axis`` of the unsplit op's array, and
    each element takes the word of its flat index in that whole array, so
    the shard's mask is the unsplit mask's slice. The elements of one index
    before ``axis`` (a run) are contiguous in the whole, run r from element
    (r·parts + index)·run on. A run longer than a chunk is drawn as a range
    of blocks; shorter runs a chunk of whole runs at a time (every run's
    blocks), the runs starting at the same word of a block (the runs of one
    residue mod 4) taken together, one strided view."""
    threshold = _U32(keep_threshold(ratio))
    shape = tuple(int(s) for s in shape)
    runs, run, parts, index, span, skips, grouped, blocks = _plan(shape, split)
    stream = open_stream(key0, key1, ctr1, iteration, runs * parts * run, blocks)
    keep = np.empty((runs, run), dtype=bool)
    chunk = np.empty((stream.size, 4), dtype=bool)

    def emit(words, out):
        np.greater_equal(words, threshold, out=out)
    if not grouped:
        for r in range(runs):
            _draw_range(stream, (r * parts + index) * run, keep[r], chunk, emit)
        return keep.reshape(shape)
    firsts = np.arange(runs, dtype=_U64)   # each run's first block
    for op, value in ((np.multiply, parts), (np.add, index), (np.multiply, run),
                      (np.floor_divide, 4)):
        op(firsts, _U64(value), out=firsts)
    rows = stream.size // span   # runs a chunk
    for r0 in range(0, runs, rows):
        r1 = min(runs, r0 + rows)
        m = (r1 - r0) * span
        np.add(firsts[r0:r1, None], stream.ramp[:span],
               out=stream.numbers[:m].reshape(r1 - r0, span))
        for j, words in enumerate(stream.draw(m)):
            emit(words, chunk[:m, j])
        got = chunk[:m].reshape(r1 - r0, 4 * span)
        for j in range(min(4, r1 - r0)):
            skip = skips[(r0 + j) % 4]
            keep[r0 + j:r1:4] = got[j::4, skip:skip + run]
    return keep.reshape(shape)


def keep_mask_temporaries(shape, split=None):
    """The ``(shape, dtype)`` arrays live at the peak of a host
    :func:`keep_mask` of ``shape`` (under ``split``), from the arrays the
    code allocates (tests/test_host_temporaries.py measures them): the
    result (bool), the Stream's buffers (:data:`STREAM_BUFFERS` uint64 of
    a chunk's blocks), the chunk's comparisons (bool, 4 a block) and, for a
    chunk of whole runs, each run's first block (uint64)."""
    shape = tuple(int(s) for s in shape)
    runs, _, _, _, _, _, grouped, blocks = _plan(shape, split)
    return ([(shape, np.bool_)] + [((blocks,), np.uint64)] * STREAM_BUFFERS
            + [((blocks, 4), np.bool_)] + ([((runs,), np.uint64)] if grouped else []))
