"""Host-side helpers of the convolution and pooling kernels: reusable
per-thread buffers, the im2col / col2im copies of the CPU convolution, its
col2im data gradient (``data_grad_col2im``) and its channels-last path
(``im2col_rows``, ``forward_rows``, ``weight_grad_rows``; when
``ops/conv.py`` takes which is said there).

Imports only NumPy (and takes the array module ``xp`` as an argument), so
``ops/conv.py`` and ``ops/pool.py`` both use it without importing each
other's internals.

Buffers. A convolution over a batch copies, a chunk of samples at a time,
the padded input and its columns into buffers that stay in cache; allocating
them afresh each chunk costs more than the copies (a fresh multi-megabyte
array is new pages from the kernel, faulted in on first write). ``buffer``
hands out one array per (thread, slot, shape, dtype, fill): the dispatcher's
worker threads never share one, and an op never runs twice at once, so ops
of one thread may reuse the same bytes one after the other. A padded buffer
is filled (zeros, or -inf for max pooling) once, when it is made, and only its
interior is ever written afterwards, so its border stays as filled: the key
names the interior's place (``fill`` and the pad), so two geometries never
share a padded buffer. The memory is bounded by the chunk sizes
(``conv.COL_CHUNK_BYTES``, ``pool._CHUNK_BYTES``) times the distinct
geometries a thread runs.

Shared arrays. A constant array that kernels only read (attention's causal
mask) is kept once per process, whichever thread or kernel asks for it
(``shared``, by a Hold with ``shared`` set): ``plan`` counts each such
Hold once per rank, not per lane (runtime/footprint.host_kernel_bytes).
"""
import threading
import weakref
from collections import namedtuple

import numpy as np

from . import hostgemm
from .hostgemm import ThreadCache, matmul

_LOCAL = threading.local()
#: every live thread's caches (``held_bytes``), registered when a thread
#: makes one (weakly: a finished thread's buffers are freed as before)
_ALL = weakref.WeakSet()
_LOCK = threading.Lock()
#: the process's shared read-only arrays (``shared``), by their Hold's identity
_SHARED = {}


def _cache(name):
    """This thread's cache ``name`` ("buffers", "flat"), made and registered once."""
    cache = getattr(_LOCAL, name, None)
    if cache is None:
        cache = ThreadCache()
        setattr(_LOCAL, name, cache)
        with _LOCK:
            _ALL.add(cache)
    return cache


def buffer(xp, slot, shape, dtype, fill=None, key=()):
    """This thread's reusable array of ``shape``/``dtype`` for ``slot``: its
    content is whatever the last user left, or ``fill`` everywhere when it
    is new (only when ``fill`` is given is it part of the key). ``key``:
    extra hashables that must match (e.g. where the interior lies)."""
    cache = _cache("buffers")
    ident = (slot, xp.__name__, tuple(shape), np.dtype(dtype).str, fill, tuple(key))
    arr = cache.get(ident)
    if arr is None:
        arr = xp.empty(shape, dtype=dtype) if fill is None else xp.full(shape, fill, dtype=dtype)
        cache[ident] = arr
    return arr


class Hold(namedtuple("Hold", "slot shape dtype fill key flat shared", defaults=(False,))):
    """One array a kernel's host path takes from this thread's caches:
    ``buffer``'s (slot, shape, dtype, fill, key), or with ``flat`` the front
    of the growing flat buffer ``slot`` (``_flat``), or with ``shared`` the
    process's one read-only array of (slot, shape, dtype, key) (``shared``:
    every thread's and kernel's, made once). The one copy of each
    buffer's size: the kernels take their arrays by it (``take``) and state
    them before anything runs (``OpKernel.host_scratch``, which ``plan``'s
    host scratch row sums by ``held_by``)."""

    __slots__ = ()

    @property
    def nbytes(self):
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def hold(slot, shape, dtype, fill=None, key=()):
    """A ``buffer`` Hold."""
    return Hold(slot, tuple(int(d) for d in shape), np.dtype(dtype), fill, tuple(key), False)


def flat_hold(slot, shape, dtype):
    """A ``_flat`` Hold (``scratch``)."""
    return Hold(slot, tuple(int(d) for d in shape), np.dtype(dtype), None, (), True)


def gemm_holds(dtype, *products):
    """[Hold] of the scratch ``hostgemm.matmul`` keeps in the calling
    thread for the products ``(a shape, b shape)`` a kernel runs with a
    ``dtype`` result into C-contiguous outputs (a 2-D product cut along K:
    ``hostgemm.scratch_shape``), at the thread count ``plan`` assumes
    (``hostgemm.planned_threads``): flat Holds of the slot
    ``hostgemm.SCRATCH_SLOT``, one growing buffer per dtype as
    ``hostgemm._scratch`` keeps it."""
    count = hostgemm.planned_threads()
    shapes = (hostgemm.scratch_shape(a, b, count) for a, b in products)
    return [flat_hold(hostgemm.SCRATCH_SLOT, s, dtype) for s in shapes if s is not None]


def shared_hold(slot, shape, dtype, key=()):
    """A ``shared`` Hold: one array of the process."""
    return Hold(slot, tuple(int(d) for d in shape), np.dtype(dtype), None, tuple(key), False,
                True)


def shared(h, make):
    """The process's one array of shared Hold ``h``: ``make()``'s (a host
    array of ``h``'s shape and dtype) the first time, made read-only, the
    same array after, for every thread."""
    ident = (h.slot, h.shape, h.dtype.str, h.key)
    arr = _SHARED.get(ident)
    if arr is None:
        with _LOCK:
            arr = _SHARED.get(ident)
            if arr is None:
                arr = make()
                if arr.shape != h.shape or arr.dtype != h.dtype:
                    raise ValueError(f"shared array {h.slot}: made {arr.shape} {arr.dtype}, "
                                     f"held as {h.shape} {h.dtype}")
                arr.flags.writeable = False
                _SHARED[ident] = arr
    return arr


def take(xp, h):
    """This thread's array of Hold ``h``."""
    if h.flat:
        return _flat(xp, h.slot, h.shape, h.dtype)
    return buffer(xp, h.slot, h.shape, h.dtype, fill=h.fill, key=h.key)


def held_by(holds):
    """Bytes one thread's caches hold once it has taken ``holds``: each
    distinct buffer once, each flat slot at its largest (``_flat`` grows to
    the largest request and keeps it); of shared Holds, the process's
    arrays (each distinct one once, whoever takes it)."""
    bufs, flats = {}, {}
    for h in holds:
        if h.shared:
            bufs[("shared", h.slot, h.shape, h.dtype.str, h.key)] = h.nbytes
        elif h.flat:
            k = (h.slot, h.dtype.str)
            flats[k] = max(flats.get(k, 0), h.nbytes)
        else:
            bufs[(h.slot, h.shape, h.dtype.str, h.fill, h.key)] = h.nbytes
    return sum(bufs.values()) + sum(flats.values())


def pad_hold(cap, C, H, W, ph, pw, extent, dtype, fill, slot="pad"):
    """The padded buffer of ``padded``: (cap, C) + ``extent``, keyed by the
    interior's place."""
    return hold(slot, (cap, C) + tuple(extent), dtype, fill=fill, key=(ph, pw, H, W))


#: the column layouts of ``cols_hold``: im2col's (n, C, kh, kw, OH, OW),
#: im2col_batch's (C, kh, kw, n, OH, OW), im2col_rows' (n, OH, OW, kh, kw, C)
def cols_hold(n, geo, dtype, order="nchw"):
    """The column buffer of a chunk of ``n`` samples (flat slot "col")."""
    C, kh, kw, OH, OW = geo["C"], geo["kh"], geo["kw"], geo["OH"], geo["OW"]
    shape = {"nchw": (n, C, kh, kw, OH, OW), "batch": (C, kh, kw, n, OH, OW),
             "rows": (n, OH, OW, kh, kw, C)}[order]
    return flat_hold("col", shape, dtype)


def rows_pad_hold(cap, geo, dtype):
    """``im2col_rows``' channels-last padded buffer (cap, H+2ph, W+2pw, C)."""
    ph, pw, H, W = geo["ph"], geo["pw"], geo["H"], geo["W"]
    return hold("pad_nhwc", (cap, H + 2 * ph, W + 2 * pw, geo["C"]), dtype, fill=0,
                key=(ph, pw, H, W))


def padded(xp, part, ph, pw, extent, fill, slot="pad", capacity=None):
    """``part`` (n, C, H, W) copied into the interior of this thread's buffer
    of (capacity, C) + ``extent`` whose border holds ``fill``: a view of its
    first n samples. ``capacity``: the most samples any chunk has (default n)."""
    n, C, H, W = part.shape
    cap = n if capacity is None else capacity
    buf = take(xp, pad_hold(cap, C, H, W, ph, pw, extent, part.dtype, fill, slot))
    chunk = buf[:n]
    chunk[:, :, ph:ph + H, pw:pw + W] = part
    return chunk


def im2col(xp, xpad, geo):
    """Columns of a padded chunk: shape (n, G, C/G*kh*kw, OH*OW), copied with
    one strided copy into this thread's column buffer."""
    n, C = xpad.shape[:2]
    s = xpad.strides
    col = take(xp, cols_hold(n, dict(geo, C=C), xpad.dtype))
    view = xp.lib.stride_tricks.as_strided(
        xpad, shape=col.shape,
        strides=(s[0], s[1], s[2] * geo["dh"], s[3] * geo["dw"],
                 s[2] * geo["sh"], s[3] * geo["sw"]))
    xp.copyto(col, view)
    return col.reshape(n, geo["G"], -1, geo["OH"] * geo["OW"])


def im2col_batch(xp, xpad, geo):
    """Columns of a padded chunk with the samples side by side: shape
    (G, C/G*kh*kw, n*OH*OW), one strided copy into the column buffer."""
    n, C = xpad.shape[:2]
    s = xpad.strides
    col = take(xp, cols_hold(n, dict(geo, C=C), xpad.dtype, "batch"))
    view = xp.lib.stride_tricks.as_strided(
        xpad, shape=col.shape,
        strides=(s[1], s[2] * geo["dh"], s[3] * geo["dw"], s[0],
                 s[2] * geo["sh"], s[3] * geo["sw"]))
    xp.copyto(col, view)
    return col.reshape(geo["G"], -1, n * geo["OH"] * geo["OW"])


def _flat(xp, slot, shape, dtype):
    """A contiguous array of ``shape`` on the front of this thread's growing
    flat buffer ``slot`` (one buffer however the shapes vary)."""
    size = int(np.prod(shape))
    cache = _cache("flat")
    ident = (slot, xp.__name__, np.dtype(dtype).str)
    flat = cache.get(ident)
    if flat is None or flat.size < size:
        flat = cache[ident] = xp.empty(size, dtype=dtype)
    return flat[:size].reshape(shape)


def scratch(xp, slot, shape, dtype):
    """A contiguous array of ``shape`` from this thread's flat buffer
    ``slot``, content undefined (GEMM outputs, transposed copies)."""
    return _flat(xp, slot, shape, dtype)


def held_bytes():
    """Bytes of every live thread's buffers (``buffer``, ``_flat``), of
    the process's shared arrays (``shared``) and of the host products'
    scratch (``hostgemm.held_bytes``) held now: the figure ``plan``'s
    host-scratch row predicts (measured: cifar10_quick, data, 2 ranks: 10.3
    MiB per rank, one worker)."""
    with _LOCK:
        caches = list(_ALL)
        kept = list(_SHARED.values())
    return sum(a.nbytes for c in caches for a in list(c.values())) + \
        sum(a.nbytes for a in kept) + hostgemm.held_bytes()


def col2im(xp, col, geo, dxpad):
    """Adds columns (n, C, kh, kw, OH, OW) back into the padded gradient ``dxpad``."""
    OH, OW = geo["OH"], geo["OW"]
    sh, sw, dh, dw = geo["sh"], geo["sw"], geo["dh"], geo["dw"]
    for p in range(geo["kh"]):
        for q in range(geo["kw"]):
            dxpad[:, :, p * dh:p * dh + sh * (OH - 1) + 1:sh,
                  q * dw:q * dw + sw * (OW - 1) + 1:sw] += col[:, :, p, q]


def data_grad_holds(n, geo, dtype):
    """``data_grad_col2im``'s buffers for a chunk of ``n`` samples: its
    columns (n, G, C/G*kh*kw, OH*OW) and, with padding, the padded gradient."""
    G, C, H, W, ph, pw = geo["G"], geo["C"], geo["H"], geo["W"], geo["ph"], geo["pw"]
    out = [flat_hold("col", (n, G, C // G * geo["kh"] * geo["kw"], geo["OH"] * geo["OW"]),
                     dtype)]
    if ph or pw:
        out.append(flat_hold("dxpad", (n, C, H + 2 * ph, W + 2 * pw), dtype))
    return out


def data_grad_col2im(xp, dy, w, geo, dx, chunks):
    """dx = col2im(w^T @ dy), a chunk of the batch at a time (``chunks``):
    the GEMM writes the chunk's columns, col2im adds them into a zeroed
    padded buffer (or straight into dx where there is no padding to crop)."""
    G, O, C, N = geo["G"], geo["O"], geo["C"], geo["N"]
    H, W, ph, pw = geo["H"], geo["W"], geo["ph"], geo["pw"]
    # contiguous w^T: BLAS on a transposed view is several times slower in numpy
    wT = xp.ascontiguousarray(w.reshape(G, O // G, -1).transpose(0, 2, 1))
    dyg = dy.reshape(N, G, O // G, geo["OH"] * geo["OW"])
    for sl in chunks:
        n = sl.stop - sl.start
        holds = data_grad_holds(n, geo, dy.dtype)
        dcol = take(xp, holds[0])
        matmul(xp, wT, dyg[sl], out=dcol)
        dcol = dcol.reshape(n, C, geo["kh"], geo["kw"], geo["OH"], geo["OW"])
        if ph or pw:
            dxpad = take(xp, holds[1])
            dxpad.fill(0)
            col2im(xp, dcol, geo, dxpad)
            dx[sl] = dxpad[:, :, ph:ph + H, pw:pw + W]
        else:  # no padding to crop: add straight into the output
            dx[sl] = 0
            col2im(xp, dcol, geo, dx[sl])


def im2col_rows(xp, part, geo, capacity):
    """Columns of a chunk of samples ``part`` (n, C, H, W) as rows: shape
    (n*OH*OW, kh*kw*C), row (n, i, j) holding the window of output pixel
    (i, j) with the channels innermost. The chunk is first copied, padded,
    into this thread's channels-last buffer (n, H+2ph, W+2pw, C) (border
    zero, ``padded``'s rule); a window row of it is then ``kw*C`` contiguous
    numbers (at dilation 1), so the strided copy moves runs of hundreds of
    bytes instead of one image row (OW numbers) at a time. ``capacity``: the
    most samples any chunk has."""
    n, C, H, W = part.shape
    ph, pw = geo["ph"], geo["pw"]
    buf = take(xp, rows_pad_hold(capacity, geo, part.dtype))
    chunk = buf[:n]
    chunk[:, ph:ph + H, pw:pw + W, :] = part.transpose(0, 2, 3, 1)
    s = chunk.strides
    OH, OW, kh, kw = geo["OH"], geo["OW"], geo["kh"], geo["kw"]
    rows = take(xp, cols_hold(n, geo, part.dtype, "rows"))
    view = xp.lib.stride_tricks.as_strided(
        chunk, shape=rows.shape, strides=(s[0], s[1] * geo["sh"], s[2] * geo["sw"],
                                          s[1] * geo["dh"], s[2] * geo["dw"], s[3]))
    xp.copyto(rows, view)
    return rows.reshape(n * OH * OW, kh * kw * C)


def _weight_rows(xp, w, geo):
    """A (O, C*kh*kw) weight matrix -> (O, kh*kw*C): the rows' column order."""
    O, C, kh, kw = geo["O"], geo["C"], geo["kh"], geo["kw"]
    return xp.ascontiguousarray(w.reshape(O, C, kh, kw).transpose(0, 2, 3, 1)).reshape(O, -1)


def gemm_rows_hold(n, geo, dtype):
    """``forward_rows``' GEMM output of a chunk of ``n`` samples: (n*OH*OW, O)."""
    return flat_hold("gemm", (n * geo["OH"] * geo["OW"], geo["O"]), dtype)


def forward_rows_holds(cap, geo, dtype):
    """``forward_rows``' buffers, chunks of at most ``cap`` samples."""
    return [rows_pad_hold(cap, geo, dtype), cols_hold(cap, geo, dtype, "rows"),
            gemm_rows_hold(cap, geo, dtype)]


def dw_rows_hold(geo, dtype):
    """``weight_grad_rows``' accumulator (O, kh*kw*C)."""
    return flat_hold("dw_rows", (geo["O"], geo["kh"] * geo["kw"] * geo["C"]), dtype)


def dyt_hold(n, geo, dtype):
    """``weight_grad_rows``' dy of a chunk of ``n`` samples as (O, n, OH*OW)."""
    return flat_hold("dyt", (geo["O"], n, geo["OH"] * geo["OW"]), dtype)


def weight_grad_rows_holds(cap, geo, dtype, dw_dtype):
    """``weight_grad_rows``' buffers, chunks of at most ``cap`` samples."""
    return [dw_rows_hold(geo, dw_dtype), rows_pad_hold(cap, geo, dtype),
            cols_hold(cap, geo, dtype, "rows"), dyt_hold(cap, geo, dtype)]


def forward_rows(xp, x, wmat, geo, y, chunks, bias=None):
    """y = conv(x) from the channels-last columns, a chunk of the batch at a
    time (``chunks``: slices of the batch): rows (n*L, K) @ w^T -> (n*L, O),
    copied into y's (n, O, L) layout (OpenBLAS runs this product faster
    than w @ rows^T, measured), ``bias`` (O,) added by that copy.
    ``wmat``: w as (1, O, C*kh*kw)."""
    O, L = geo["O"], geo["OH"] * geo["OW"]
    wr = _weight_rows(xp, wmat, geo)
    cap = chunks[0].stop - chunks[0].start
    y = y.reshape(geo["N"], O, L)
    for sl in chunks:
        rows = im2col_rows(xp, x[sl], geo, cap)
        out = take(xp, gemm_rows_hold(sl.stop - sl.start, geo, x.dtype))
        matmul(xp, rows, wr.T, out=out)
        if bias is None:
            y[sl] = out.reshape(-1, L, O).transpose(0, 2, 1)
        else:
            xp.add(out.reshape(-1, L, O).transpose(0, 2, 1), bias.reshape(O, 1), out=y[sl])


def weight_grad_rows(xp, dy, x, geo, dw, chunks):
    """dw = dy (O, N*L) @ rows (N*L, kh*kw*C): one GEMM per chunk of the batch
    on the channels-last columns, accumulated in the rows' order and
    reordered into dw (O, C, kh, kw) at the end."""
    O, L = geo["O"], geo["OH"] * geo["OW"]
    cap = chunks[0].stop - chunks[0].start
    acc = take(xp, dw_rows_hold(geo, dw.dtype))
    dyl = dy.reshape(geo["N"], O, L)
    for i, sl in enumerate(chunks):
        rows = im2col_rows(xp, x[sl], geo, cap)
        n = sl.stop - sl.start
        dyt = take(xp, dyt_hold(n, geo, dy.dtype))
        dyt[...] = dyl[sl].transpose(1, 0, 2)
        if i == 0:
            matmul(xp, dyt.reshape(O, n * L), rows, out=acc)
        else:
            acc += matmul(xp, dyt.reshape(O, n * L), rows)
    dw[...] = acc.reshape(O, geo["kh"], geo["kw"], geo["C"]).transpose(0, 3, 1, 2)
