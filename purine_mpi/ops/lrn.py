"""Local response normalisation across channels (Caffe's ACROSS_CHANNELS LRN;
equal to torch.nn.LocalResponseNorm) or within each channel (Caffe's
WITHIN_CHANNEL LRN).

Forward ("LRN", input [x], outputs [y, scale])::

    scale[n,c,...] = k + alpha/n_size * sum_{c' = c-r .. c+r} x[n,c',...]^2
    y = x * scale^(-beta)                          r = (local_size - 1) / 2

Attrs: ``local_size`` (odd, default 5), ``alpha`` (1e-4), ``beta`` (0.75),
``k`` (1.0). Channels past the edges count as zeros. ``scale`` is an output
so the backward op need not recompute it.

Gradient ("LRNGrad", inputs [dy, x, y, scale] -> [dx])::

    dx = dy * scale^(-beta)
         - 2*alpha*beta/n_size * x * sum_{c' = c-r .. c+r} dy[c'] * y[c'] / scale[c']

On a GPU (CuPy arrays of float32/float64) each direction is one raw kernel
(cuda/lrn.cu) instead of local_size shifted adds plus element-wise passes.

Attr ``norm_region: within_channel`` (Caffe's WITHIN_CHANNEL; x is N, C, H, W)
replaces the window of channels by a local_size x local_size spatial window
in each channel, averaged as Caffe's AVE pooling with pad r and stride 1
does (zeros past the edges, always divided by n_size^2)::

    scale[n,c,h,w] = k + alpha/n_size^2 * sum_{|h'-h| <= r, |w'-w| <= r} x[n,c,h',w']^2
    y = x * scale^(-beta)
    dx = dy * scale^(-beta)
         - 2*alpha*beta/n_size^2 * x * (the same window sum of dy * y / scale)

Caffe's WITHIN_CHANNEL ignores its ``k`` (it adds 1): the converter passes
k 1. One ``xp`` path on both devices: shifted adds into the op's outputs and
``temporaries`` (a zero-padded plane and a row-summed one), nothing allocated.
"""
from ..base.backend import get_xp
from ..base.errors import ShapeError
from ..gpu.raw import raw_kernels
from .registry import OpKernel, gradient, register


def _params(attrs):
    size = int(attrs.get("local_size", 5))
    if size < 1 or size % 2 == 0:
        raise ShapeError(f"LRN local_size must be a positive odd number (as in Caffe), got {size}")
    return size, float(attrs.get("alpha", 1e-4)), float(attrs.get("beta", 0.75)), \
        float(attrs.get("k", 1.0))


REGIONS = ("across_channels", "within_channel")


def _within(attrs):
    """True for norm_region within_channel; a ShapeError for an unknown region."""
    region = str(attrs.get("norm_region", "across_channels")).lower()
    if region not in REGIONS:
        raise ShapeError(f"LRN norm_region {attrs['norm_region']!r} is not supported; "
                         f"use across_channels or within_channel")
    return region == "within_channel"


def _plane_specs(x, size):
    """The temporaries of the within-channel window sum: the zero-padded
    plane (N, C, H+2r, W+2r) and its sums along W (N, C, H+2r, W)."""
    r = size // 2
    n, c, h, w = x.shape
    return ((n, c, h + 2 * r, w + 2 * r), x.dtype), ((n, c, h + 2 * r, w), x.dtype)


def _host_specs(x, size, within, grad):
    """What a host run of LRN (``grad``: LRNGrad) allocates at its peak:
    within a channel its temporaries (``_plane_specs``, and the gradient's
    ``dy * scale^-beta``); across channels the product it sums (x^2; dy y /
    scale) and ``_window_sum``'s zero-padded copy of it, (N, C+2r, ...)."""
    if within:
        return list(_plane_specs(x, size)) + ([(x.shape, x.dtype)] if grad else [])
    padded = (x.shape[0], x.shape[1] + 2 * (size // 2)) + tuple(x.shape[2:])
    return [(x.shape, x.dtype), (padded, x.dtype)]


def _plane_window_sum(xp, padded, rows, size, out):
    """out[..., h, w] = sum of padded's interior over the size x size window
    centred on (h, w); ``padded``'s border holds zeros. Writes only into
    ``rows`` and ``out``."""
    h, w = out.shape[-2:]
    xp.copyto(rows, padded[..., :, 0:w])
    for i in range(1, size):
        xp.add(rows, padded[..., :, i:i + w], out=rows)
    xp.copyto(out, rows[..., 0:h, :])
    for i in range(1, size):
        xp.add(out, rows[..., i:i + h, :], out=out)


def _interior(padded, size, shape):
    r = size // 2
    return padded[..., r:r + shape[-2], r:r + shape[-1]]


def _window_sum(xp, a, size, out):
    """out[:, c] = sum of a[:, c'] for |c' - c| <= size // 2 (zeros past the edges)."""
    r = size // 2
    C = a.shape[1]
    padded = xp.zeros((a.shape[0], C + 2 * r) + a.shape[2:], dtype=a.dtype)
    padded[:, r:r + C] = a
    out[...] = padded[:, 0:C]
    for i in range(1, size):
        out += padded[:, i:i + C]


@register
class LRN(OpKernel):
    """y = x * (k + alpha/n * window sum of x^2)^(-beta); see the module docstring."""

    op_type = "LRN"

    @classmethod
    def infer(cls, attrs, ins):
        _params(attrs)
        if _within(attrs) and len(ins[0][0]) != 4:
            raise ShapeError(f"LRN within_channel needs an input of 4 axes (N, C, H, W), got "
                             f"{list(ins[0][0])}")
        if len(ins[0][0]) < 2:
            raise ShapeError(f"LRN needs an input with a channel axis (N, C, ...), got "
                             f"{list(ins[0][0])}")
        return [ins[0], ins[0]]

    def run(self, ins, outs):
        x = ins[0]
        xp = get_xp(x)
        size, alpha, beta, k = _params(self.attrs)
        y, scale = outs
        if _within(self.attrs):
            padded, rows = self.temporaries(x, *_plane_specs(x, size))
            padded.fill(0)
            xp.multiply(x, x, out=_interior(padded, size, x.shape))
            _plane_window_sum(xp, padded, rows, size, scale)
            scale *= alpha / (size * size)
            scale += k
            xp.power(scale, -beta, out=y)
            y *= x
            return
        raw = raw_kernels(xp, x)
        if raw is not None:  # GPU: one raw kernel writes y and scale
            raw.lrn_forward(x, size, alpha, beta, k, out=(y, scale))
            return
        _window_sum(xp, x * x, size, scale)
        scale *= alpha / size
        scale += k
        xp.power(scale, -beta, out=y)
        y *= x

    def host_temporaries(self, ins, outs):
        return _host_specs(ins[0], _params(self.attrs)[0], _within(self.attrs), False)


@register
class LRNGrad(OpKernel):
    """dx of LRN.  Inputs [dy, x, y, scale]; LRN's attrs."""

    op_type = "LRNGrad"

    @classmethod
    def infer(cls, attrs, ins):
        return [ins[1]]

    def run(self, ins, outs):
        dy, x, y, scale = ins
        xp = get_xp(dy)
        size, alpha, beta, _ = _params(self.attrs)
        dx = outs[0]
        if _within(self.attrs):
            padded, rows, t = self.temporaries(x, *_host_specs(x, size, True, True))
            padded.fill(0)
            inner = _interior(padded, size, x.shape)
            xp.multiply(dy, y, out=inner)
            xp.divide(inner, scale, out=inner)
            _plane_window_sum(xp, padded, rows, size, dx)
            dx *= x
            dx *= -2.0 * alpha * beta / (size * size)
            xp.power(scale, -beta, out=t)
            t *= dy
            dx += t
            return
        raw = raw_kernels(xp, dy, x, y, scale)
        if raw is not None:  # GPU: one raw kernel
            raw.lrn_backward(x, y, scale, dy, size, alpha, beta, out=dx)
            return
        _window_sum(xp, dy * y / scale, size, dx)
        dx *= x * (-2.0 * alpha * beta / size)
        dx += dy * xp.power(scale, -beta)

    def host_temporaries(self, ins, outs):
        return _host_specs(ins[1], _params(self.attrs)[0], _within(self.attrs), True)


@gradient("LRN")
def _lrn_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    x = op.inputs[0]
    if dy is not None and g.needs_grad(x):
        g.emit("LRNGrad", [dy, x, op.outputs[0], op.outputs[1]], [g.grad_blob(x)], dict(op.attrs))
