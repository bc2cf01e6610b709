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
``H + pad`` (Caffe's and torch's rule).

Gradient ("PoolGrad", inputs [dy, mask] for max, [dy] for average, attr
``x_shape``): max routes dy to the argmax of each window; average spreads
dy / size over the window. Overlapping windows add up; both loop over the
kh*kw kernel offsets with strided slice-adds (no scatter).

On a GPU (CuPy arrays of float32/float64) forward and backward are one raw
kernel each (cuda/pooling.cu), with the same mask convention and divisor.
"""
import numpy as np

from ..backend import get_xp
from ..errors import ShapeError
from ..gpu.raw import raw_kernels
from .conv import pair
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


def _padded(xp, x, geo, fill):
    if geo["ph"] == geo["pw"] == 0 and _extent(geo) == (geo["H"], geo["W"]):
        return x
    eh, ew = _extent(geo)
    buf = xp.full(x.shape[:2] + (eh, ew), fill, dtype=x.dtype)
    buf[:, :, geo["ph"]:geo["ph"] + geo["H"], geo["pw"]:geo["pw"] + geo["W"]] = x
    return buf


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
            buf = _padded(xp, x, geo, -xp.inf)
            y[...] = _window(buf, geo, 0, 0)
            for p in range(geo["kh"]):
                for q in range(geo["kw"]):
                    xp.maximum(y, _window(buf, geo, p, q), out=y)
            # a second pass for the argmax, last offset first so that the first
            # maximum wins on ties, as in Caffe (2x faster than one pass of
            # compare-and-select: numpy's maximum is much cheaper than copyto)
            mask = outs[1]
            mask.fill(0)
            for k in range(geo["kh"] * geo["kw"] - 1, -1, -1):
                p, q = divmod(k, geo["kw"])
                xp.copyto(mask, p * geo["W"] + q, where=_window(buf, geo, p, q) == y)
            mask += _window_origins(xp, geo)
        else:
            buf = _padded(xp, x, geo, 0)
            y.fill(0)
            for p in range(geo["kh"]):
                for q in range(geo["kw"]):
                    y += _window(buf, geo, p, q)
            y /= _divisor(xp, geo, y.dtype)


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
        eh, ew = _extent(geo)
        direct = geo["ph"] == geo["pw"] == 0 and (eh, ew) == (geo["H"], geo["W"])
        buf = dx if direct else xp.zeros((N, C, eh, ew), dtype=dx.dtype)
        buf.fill(0)
        if geo["kind"] == "max":
            # back from flat plane indices to offsets inside each window
            origin_h, origin_w = _window_origins(xp, geo, split=True)
            mask = (ins[1] // geo["W"] - origin_h) * geo["kw"] + (ins[1] % geo["W"] - origin_w)
            routed = xp.empty_like(dy)
            for p in range(geo["kh"]):
                for q in range(geo["kw"]):
                    xp.multiply(mask == p * geo["kw"] + q, dy, out=routed)
                    _window(buf, geo, p, q)[...] += routed
        else:
            share = dy / _divisor(xp, geo, dy.dtype)
            for p in range(geo["kh"]):
                for q in range(geo["kw"]):
                    _window(buf, geo, p, q)[...] += share
        if not direct:
            dx[...] = buf[:, :, geo["ph"]:geo["ph"] + geo["H"], geo["pw"]:geo["pw"] + geo["W"]]


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
