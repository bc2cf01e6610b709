"""2-D max / average pooling (NCHW), Caffe semantics.

Forward ("Pool", input [x]; outputs [y, mask] for max, [y] for average).
Attrs: ``pool`` ("max" | "ave"), ``kernel``, ``stride`` (default 1), ``pad``
(default 0), all int or [h, w]; ``ceil_mode`` (default false); ``global``
(kernel = the whole plane). Windows start at ``i*s - pad``::

    max:  y[n,c,i,j] = max over the window of x (padding never wins);
          mask[n,c,i,j] = h*W + w, the argmax's flat index in its (n, c)
          plane (int32; as torch's return_indices and the CUDA kernels)
    ave:  y[n,c,i,j] = sum over the window of x / size, where size counts
          padding but not what lies past H + pad (Caffe's AVE; torch's
          count_include_pad=True)

Output size: ``OH = floor((H + 2*pad - k) / s) + 1``, or with ``ceil_mode``
``ceil(...) + 1`` less one when the last window would start at or past
``H + pad`` (torch's rule; Caffe's with pad > 0: without padding Caffe keeps
that window, wholly past the input when stride > kernel, its max -FLT_MAX
and its average 0/0 -- an extra row no net means to have).

Gradient ("PoolGrad", inputs [dy, mask] for max, [dy] for average, attr
``x_shape``): max routes dy to the argmax of each window; average spreads
dy / size over the window. Overlapping windows add up: max with one
deterministic scatter-add (``add.at``, in the outputs' order) per chunk of
samples, average with strided slice-adds over the kh*kw kernel offsets.

Average pooling is linear: on the CPU, planes of at most ``DENSE_MAX_PLANE``
inputs (H*W) are pooled as one GEMM over all N*C planes with the dense
(OH*OW, H*W) pooling matrix (entry 1/size where the input lies in the
window, padding left out), its transpose for the gradient: NumPy's strided
slice-adds run a few numbers per call on such small planes, the GEMM wastes
flops on zeros but runs at BLAS speed. Measured, one thread, cifar10_quick's
pool2 (16x16) / pool3 (8x8): forward 3.1 -> 1.5 / 3.0 -> 0.3 ms, backward
5.2 -> 1.5 / 5.1 -> 0.3 ms; on 32x32 planes the GEMM is slower (8.8 -> 19 ms).

On a GPU (CuPy arrays of float32/float64) forward and backward are one raw
kernel each (cuda/pooling.cu), with the same mask convention and divisor.
"""
import numpy as np

from ..base.backend import get_xp
from ..base.errors import ShapeError
from ..gpu.raw import raw_kernels
from .conv import pair
from .hostgemm import matmul
from .im2col import gemm_holds, hold, pad_hold, padded, shared, shared_hold, take
from .registry import OpKernel, gradient, register

_KINDS = {"max": "max", "ave": "ave", "avg": "ave", "average": "ave"}


def _out_size(size, k, s, p, ceil_mode):
    if ceil_mode:
        out = -(-(size + 2 * p - k) // s) + 1
        if (out - 1) * s >= size + p:  # the last window must start inside the input
            out -= 1
        return out
    return (size + 2 * p - k) // s + 1


def _geometry(attrs, x_shape):
    if len(x_shape) != 4:
        raise ShapeError(f"Pool needs a 4-D NCHW input, got shape {list(x_shape)}")
    N, C, H, W = x_shape
    kind = _KINDS.get(str(attrs.get("pool", "max")).lower())
    if kind is None:
        raise ShapeError(f"Pool attr 'pool' must be 'max' or 'ave', got {attrs.get('pool')!r}")
    if attrs.get("global", False):
        (kh, kw), (sh, sw), (ph, pw) = (H, W), (1, 1), (0, 0)
    else:
        if "kernel" not in attrs:
            raise ShapeError("Pool needs attr 'kernel' (or global: true)")
        kh, kw = pair(attrs["kernel"], "kernel")
        sh, sw = pair(attrs.get("stride", 1), "stride")
        ph, pw = pair(attrs.get("pad", 0), "pad")
    if min(kh, kw, sh, sw) < 1 or not (0 <= ph < kh and 0 <= pw < kw):
        raise ShapeError(f"Pool needs kernel, stride >= 1 and 0 <= pad < kernel, got kernel="
                         f"{[kh, kw]} stride={[sh, sw]} pad={[ph, pw]}")
    ceil_mode = bool(attrs.get("ceil_mode", False))
    OH, OW = _out_size(H, kh, sh, ph, ceil_mode), _out_size(W, kw, sw, pw, ceil_mode)
    if OH < 1 or OW < 1:
        raise ShapeError(f"Pool kernel {[kh, kw]} does not fit the padded input "
                         f"{[H + 2 * ph, W + 2 * pw]}")
    return dict(kind=kind, N=N, C=C, H=H, W=W, kh=kh, kw=kw, sh=sh, sw=sw, ph=ph, pw=pw,
                OH=OH, OW=OW, whole=(OH == OW == 1 and kh == H and kw == W and ph == pw == 0))


def _extent(geo):
    """Height/width of the padded buffer every window fits in."""
    return (max((geo["OH"] - 1) * geo["sh"] + geo["kh"], geo["H"] + geo["ph"]),
            max((geo["OW"] - 1) * geo["sw"] + geo["kw"], geo["W"] + geo["pw"]))


def _unpadded(geo):
    """Every window lies inside the input: no padding buffer is needed."""
    return geo["ph"] == geo["pw"] == 0 and _extent(geo) == (geo["H"], geo["W"])


def _padded_chunks(xp, x, geo, fill, step):
    """(n, chunk) for each run of ``step`` samples from n: the chunk of ``x``
    padded to the extent every window fits in, with ``fill`` around it. One
    small buffer per thread and geometry is reused for every chunk and every
    call (``im2col.padded``: its border is written once), so the padded copy
    stays in cache and nothing is allocated per call."""
    N, ph, pw = geo["N"], geo["ph"], geo["pw"]
    if _unpadded(geo):
        for n in range(0, N, step):
            yield n, x[n:n + step]
        return
    for n in range(0, N, step):
        yield n, padded(xp, x[n:n + step], ph, pw, _extent(geo), fill, slot="pool",
                        capacity=min(step, N))


def _pad_holds(geo, dtype, fill, step):
    """``_padded_chunks``' buffer ([] where every window lies inside)."""
    if _unpadded(geo):
        return []
    return [pad_hold(min(step, geo["N"]), geo["C"], geo["H"], geo["W"], geo["ph"], geo["pw"],
                     _extent(geo), dtype, fill, slot="pool")]


def _max_step(geo, dtype):
    """Samples per chunk of ``_max_pool_cpu``'s window stack."""
    return _step(geo["C"] * geo["OH"] * geo["OW"] * geo["kh"] * geo["kw"] *
                 np.dtype(dtype).itemsize)


def _max_holds(geo, dtype):
    """``_max_pool_cpu``'s stack (K, n, C, OH, OW) and, for K <= 127, its
    equality, rank and code buffers (ops/im2col.Hold)."""
    K, step = geo["kh"] * geo["kw"], _max_step(geo, dtype)
    shape = (K, min(step, geo["N"]), geo["C"], geo["OH"], geo["OW"])
    out = [hold("pool_stack", shape, dtype)]
    if K <= 127:
        out += [hold("pool_eq", shape, np.bool_), hold("pool_rank_k", shape, np.int8),
                hold("pool_rank", shape[1:], np.int8)]
    return out


def _ave_step(geo, dtype):
    eh, ew = _extent(geo)
    return _step(geo["C"] * eh * ew * np.dtype(dtype).itemsize)


def _scatter_hold(geo, dtype):
    """``_max_pool_grad_cpu``'s index buffer: (cap, C, OH, OW) of int32/64."""
    N, C = geo["N"], geo["C"]
    plane = geo["H"] * geo["W"]
    cap = min(_step(C * plane * np.dtype(dtype).itemsize), N)
    itype = np.int32 if cap * C * plane < 2 ** 31 else np.int64
    return hold("pool_scatter", (cap, C, geo["OH"], geo["OW"]), itype)


def _dense(geo):
    """Whether CPU average pooling is one GEMM (``_dense_matrix``)."""
    return geo["H"] * geo["W"] <= DENSE_MAX_PLANE


def _step(per_sample_bytes):
    """Samples per chunk: as many as fit in ``_CHUNK_BYTES`` (at least one)."""
    return max(1, _CHUNK_BYTES // max(per_sample_bytes, 1))


def _window(buf, geo, p, q):
    """The (n, c, OH, OW) strided slice of ``buf`` seen at kernel offset (p, q)."""
    return buf[:, :, p:p + geo["sh"] * (geo["OH"] - 1) + 1:geo["sh"],
               q:q + geo["sw"] * (geo["OW"] - 1) + 1:geo["sw"]]


def _window_origins(xp, geo, split=False):
    """Flat plane index h*W + w of each window's top-left corner, shape (OH, OW)
    (or its row and column parts, broadcastable, with ``split``)."""
    h = np.arange(geo["OH"]).reshape(-1, 1) * geo["sh"] - geo["ph"]
    w = np.arange(geo["OW"]).reshape(1, -1) * geo["sw"] - geo["pw"]
    if split:
        return xp.asarray(h.astype(np.int32)), xp.asarray(w.astype(np.int32))
    return xp.asarray((h * geo["W"] + w).astype(np.int32))


def _divisor(xp, geo, dtype):
    """Caffe's AVE window sizes: padding counts, the part past H + pad does not."""
    def sizes(out, k, s, p, size):
        start = np.arange(out) * s - p
        return np.minimum(start + k, size + p) - start
    div = np.outer(sizes(geo["OH"], geo["kh"], geo["sh"], geo["ph"], geo["H"]),
                   sizes(geo["OW"], geo["kw"], geo["sw"], geo["pw"], geo["W"]))
    return xp.asarray(div.astype(dtype))


# a chunk of the window stack that stays in cache while it is reduced
_CHUNK_BYTES = 1 << 21

#: CPU average pooling of planes of at most this many inputs (H*W): one GEMM
#: with the dense pooling matrix (module docstring); 0 turns it off
DENSE_MAX_PLANE = 256


def _dense_key(geo):
    return tuple(geo[k] for k in ("H", "W", "kh", "kw", "sh", "sw", "ph", "pw", "OH", "OW"))


def _dense_hold(geo, dtype):
    """The Hold of the host's dense pooling matrix (``_dense_matrix``): one
    read-only array per geometry and dtype in the process (ops/im2col.shared:
    ``plan``'s host scratch row counts it once)."""
    return shared_hold("pool_dense", (geo["OH"] * geo["OW"], geo["H"] * geo["W"]), dtype,
                       key=_dense_key(geo))


def _dense_matrix(xp, geo, dtype):
    """The (OH*OW, H*W) matrix of CPU average pooling (``DENSE_MAX_PLANE``),
    or None where the plane is larger: row (i, j) holds 1/size on the inputs
    of window (i, j), Caffe's divisor (``_divisor``). Made once per geometry
    (on the host the process's one, ``_dense_hold``)."""
    if not _dense(geo):
        return None

    def make():
        def inside(out, k, s, p, size):  # (out, size): input in window, padding left out
            start = np.arange(out).reshape(-1, 1) * s - p
            at = np.arange(size).reshape(1, -1)
            return (at >= start) & (at < start + k)
        rows = inside(geo["OH"], geo["kh"], geo["sh"], geo["ph"], geo["H"])
        cols = inside(geo["OW"], geo["kw"], geo["sw"], geo["pw"], geo["W"])
        div = _divisor(np, geo, np.float64).reshape(-1, 1)
        return (np.kron(rows, cols) / div).astype(dtype)
    if xp is np:
        return shared(_dense_hold(geo, dtype), make)
    ident = (_dense_key(geo), xp.__name__, np.dtype(dtype).str)
    mat = _DENSE.get(ident)
    if mat is None:
        mat = _DENSE[ident] = xp.asarray(make())
    return mat


_DENSE = {}


def _max_pool_cpu(xp, x, geo, y, mask):
    """Max pooling with the argmax mask on the CPU. Each kernel offset's
    strided window is copied into one slot of a contiguous stack (a chunk of
    samples at a time, so it stays in cache); the max is a reduction over the
    slots, and the first slot holding it is K minus the largest rank K - k
    of the equal slots (int8, into reused buffers), its plane offset read
    from a lookup table -- several times faster than NumPy's
    argmax over a short axis."""
    kh, kw = geo["kh"], geo["kw"]
    K = kh * kw
    origins = _window_origins(xp, geo)
    step = _max_step(geo, x.dtype)
    stack, *rest = (take(xp, h) for h in _max_holds(geo, x.dtype))
    if K <= 127:  # flat plane offset of the first maximum, looked up by its rank
        first = K - np.arange(K + 1)  # rank r -> slot K - r (rank 0: unused)
        offset = xp.asarray(((first // kw) * geo["W"] + first % kw).astype(np.int32))
        weights = xp.asarray(np.arange(K, 0, -1, dtype=np.int8).reshape(K, 1, 1, 1, 1))
        eq_b, t8_b, rank_b = rest
    for n, part in _padded_chunks(xp, x, geo, -xp.inf, step):
        st = stack[:, :part.shape[0]]
        for k in range(K):
            st[k] = _window(part, geo, *divmod(k, kw))
        top = y[n:n + step]
        xp.max(st, axis=0, out=top)  # NaN propagates, as in PyTorch
        if K > 127:
            idx = st.argmax(axis=0)
            xp.add((idx // kw) * geo["W"] + idx % kw, origins, out=mask[n:n + step])
            continue
        # rank = max over k of (K - k) where slot k equals the maximum: the
        # first such k is K - rank (0: none, a NaN maximum); int8, in place
        eq, t8 = eq_b[:, :part.shape[0]], t8_b[:, :part.shape[0]]
        code = rank_b[:part.shape[0]]
        xp.equal(st, top, out=eq)
        xp.multiply(eq.view(np.int8), weights, out=t8)
        xp.max(t8, axis=0, out=code)
        xp.add(offset.take(code), origins, out=mask[n:n + step])
        if not xp.all(code):  # a NaN maximum equals nothing: point at the first NaN
            idx = xp.isnan(st).argmax(axis=0)
            nan_at = (idx // kw) * geo["W"] + idx % kw + origins
            xp.copyto(mask[n:n + step], nan_at, where=code == 0)


def _max_pool_grad_cpu(xp, dy, mask, geo, dx):
    """dx of max pooling on the CPU: every dy added to the input its argmax
    names, one unbuffered scatter-add (``add.at``, in the outputs' order, so
    deterministic) per chunk of samples that stays in cache."""
    N, C = geo["N"], geo["C"]
    plane = geo["H"] * geo["W"]
    step = _step(C * plane * dx.itemsize)
    idx_b = take(xp, _scatter_hold(geo, dx.dtype))
    cap, itype = idx_b.shape[0], idx_b.dtype.type
    planes = xp.arange(cap * C, dtype=itype).reshape(-1, C, 1, 1) * itype(plane)
    for n in range(0, N, step):
        m = mask[n:n + step]
        part, idx = dx[n:n + step], idx_b[:m.shape[0]]
        xp.add(m, planes[:m.shape[0]], out=idx)
        part.fill(0)
        d = xp.ascontiguousarray(dy[n:n + step]).reshape(-1)
        xp.add.at(part.reshape(-1), idx.reshape(-1), d)


def _kernel_args(geo):
    """(kh, kw, sh, sw, ph, pw) of the raw pooling kernels."""
    return geo["kh"], geo["kw"], geo["sh"], geo["sw"], geo["ph"], geo["pw"]


def _ceil(attrs):
    return bool(attrs.get("ceil_mode", False))


@register
class Pool(OpKernel):
    """Max or average pooling; see the module docstring."""

    op_type = "Pool"

    @classmethod
    def infer(cls, attrs, ins):
        geo = _geometry(attrs, ins[0][0])
        y = ((geo["N"], geo["C"], geo["OH"], geo["OW"]), ins[0][1])
        return [y, (y[0], "int32")] if geo["kind"] == "max" else [y]

    def host_scratch(self, ins, outs):
        geo = _geometry(self.attrs, ins[0].shape)
        dtype = ins[0].dtype
        if geo["whole"]:
            return []
        if geo["kind"] == "max":
            return _max_holds(geo, dtype) + _pad_holds(geo, dtype, -np.inf,
                                                       _max_step(geo, dtype))
        if _dense(geo):   # the dense matrix (a contiguous y: a blob's), the product's scratch
            return [_dense_hold(geo, dtype)] + gemm_holds(
                dtype, ((geo["N"] * geo["C"], geo["H"] * geo["W"]),
                        (geo["H"] * geo["W"], geo["OH"] * geo["OW"])))
        return _pad_holds(geo, dtype, 0, _ave_step(geo, dtype))

    def run(self, ins, outs):
        x = ins[0]
        xp = get_xp(x)
        geo = _geometry(self.attrs, x.shape)
        y = outs[0]
        k = raw_kernels(xp, x)
        if k is not None:  # GPU: one raw kernel writes y (and the argmax mask)
            if geo["kind"] == "max":
                k.maxpool_forward(x, *_kernel_args(geo), ceil_mode=_ceil(self.attrs),
                                  out=(y, outs[1]))
            else:
                k.avepool_forward(x, *_kernel_args(geo), ceil_mode=_ceil(self.attrs), out=y)
            return
        if geo["whole"]:
            flat = x.reshape(geo["N"], geo["C"], -1)
            if geo["kind"] == "max":
                outs[1][...] = xp.argmax(flat, axis=2).reshape(outs[1].shape)
                xp.max(flat, axis=2, out=y.reshape(geo["N"], geo["C"]))
            else:
                xp.mean(flat, axis=2, out=y.reshape(geo["N"], geo["C"]))
            return
        if geo["kind"] == "max":
            _max_pool_cpu(xp, x, geo, y, outs[1])
            return
        mat = _dense_matrix(xp, geo, y.dtype) if y.flags.c_contiguous else None
        if mat is not None:  # one GEMM over the N*C planes
            planes = geo["N"] * geo["C"]
            matmul(xp, x.reshape(planes, -1), mat.T, out=y.reshape(planes, -1))
        else:
            div = _divisor(xp, geo, y.dtype)
            for n, part in _padded_chunks(xp, x, geo, 0, _ave_step(geo, x.dtype)):
                top = y[n:n + part.shape[0]]
                top.fill(0)
                for p in range(geo["kh"]):
                    for q in range(geo["kw"]):
                        top += _window(part, geo, p, q)
                top /= div


@register
class PoolGrad(OpKernel):
    """dx of Pool: inputs [dy, mask] (max) or [dy] (ave); Pool's attrs + x_shape."""

    op_type = "PoolGrad"

    @classmethod
    def infer(cls, attrs, ins):
        x_shape = tuple(attrs["x_shape"])
        geo = _geometry(attrs, x_shape)
        want = (geo["N"], geo["C"], geo["OH"], geo["OW"])
        if tuple(ins[0][0]) != want:
            raise ShapeError(f"PoolGrad: dy shape {list(ins[0][0])} is not the output shape "
                             f"{list(want)}")
        if geo["kind"] == "max" and (len(ins) != 2 or tuple(ins[1][0]) != want):
            raise ShapeError("PoolGrad of max pooling needs inputs [dy, mask] of one shape")
        return [(x_shape, ins[0][1])]

    def host_scratch(self, ins, outs):
        geo = _geometry(self.attrs, outs[0].shape)
        if geo["whole"]:
            return []
        if geo["kind"] == "max":
            return [_scatter_hold(geo, outs[0].dtype)]
        if _dense(geo):   # the dense matrix (a contiguous dx: a blob's), the product's scratch
            return [_dense_hold(geo, outs[0].dtype)] + gemm_holds(
                outs[0].dtype, ((geo["N"] * geo["C"], geo["OH"] * geo["OW"]),
                                (geo["OH"] * geo["OW"], geo["H"] * geo["W"])))
        if _unpadded(geo):
            return []
        return [_ave_grad_hold(geo, outs[0].dtype)]

    def run(self, ins, outs):
        dy = ins[0]
        xp = get_xp(dy)
        dx = outs[0]
        geo = _geometry(self.attrs, dx.shape)
        N, C = geo["N"], geo["C"]
        k = raw_kernels(xp, dy)
        if k is not None:  # GPU: one raw kernel gathers each dx from its windows
            if geo["kind"] == "max":
                k.maxpool_backward(dy, ins[1], dx.shape, *_kernel_args(geo), out=dx)
            else:
                k.avepool_backward(dy, dx.shape, *_kernel_args(geo), out=dx)
            return
        if geo["whole"]:
            flat = dx.reshape(N, C, -1)
            if geo["kind"] == "max":
                hits = xp.arange(flat.shape[2]).reshape(1, 1, -1) == ins[1].reshape(N, C, 1)
                xp.multiply(hits, dy.reshape(N, C, 1), out=flat)
            else:
                flat[...] = dy.reshape(N, C, 1) / flat.shape[2]
            return
        if geo["kind"] == "max":
            _max_pool_grad_cpu(xp, dy, ins[1], geo, dx)
            return
        mat = _dense_matrix(xp, geo, dx.dtype) if dx.flags.c_contiguous else None
        if mat is not None:  # one GEMM over the N*C planes
            matmul(xp, dy.reshape(N * C, -1), mat, out=dx.reshape(N * C, -1))
            return
        # average: dy / size added into every window of a padded buffer, a
        # chunk of samples at a time (one buffer, in cache), then cropped
        H, W, ph, pw = geo["H"], geo["W"], geo["ph"], geo["pw"]
        direct = _unpadded(geo)
        step = _ave_step(geo, dx.dtype)
        div = _divisor(xp, geo, dy.dtype)
        buf = None if direct else take(xp, _ave_grad_hold(geo, dx.dtype))
        for n in range(0, N, step):
            share = dy[n:n + step] / div
            part = dx[n:n + step] if direct else buf[:share.shape[0]]
            part.fill(0)
            for p in range(geo["kh"]):
                for q in range(geo["kw"]):
                    _window(part, geo, p, q)[...] += share
            if not direct:
                dx[n:n + step] = part[:, :, ph:ph + H, pw:pw + W]


def _ave_grad_hold(geo, dtype):
    """Average pooling's padded gradient buffer (cap, C) + extent."""
    return hold("pool_grad", (min(_ave_step(geo, dtype), geo["N"]), geo["C"]) + _extent(geo),
                dtype)


_POOL_ATTRS = ("pool", "kernel", "stride", "pad", "ceil_mode", "global")


@gradient("Pool")
def _pool_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    x = op.inputs[0]
    if dy is None or not g.needs_grad(x):
        return
    attrs = {k: op.attrs[k] for k in _POOL_ATTRS if k in op.attrs}
    attrs["x_shape"] = list(g.graph.blobs[x].shape)
    ins = [dy, op.outputs[1]] if len(op.outputs) == 2 else [dy]
    g.emit("PoolGrad", ins, [g.grad_blob(x)], attrs)
