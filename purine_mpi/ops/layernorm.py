"""Layer normalisation over the last axis (a transformer's LayerNorm).

Forward ("LayerNorm", inputs [x, g, b], outputs [y, mean, rstd])::

    mu   = mean(x, last axis)                    x: (..., C), g, b: (C,)
    var  = mean((x - mu)^2, last axis)           (biased, as PyTorch)
    rstd = 1 / sqrt(var + eps)                   mean, rstd: x.shape[:-1]
    y    = (x - mu) * rstd * g + b

Gradient ("LayerNormGrad", [dy, x, g, mean, rstd] -> the requested ones of
[dx, dg, db], attr ``outputs``), with xhat = (x - mu) * rstd, dxhat = dy * g::

    dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
    dg = sum over the leading axes of dy * xhat
    db = sum over the leading axes of dy
"""
from ..base.backend import get_xp
from ..base.errors import ShapeError
from .registry import OpKernel, gradient, register


@register
class LayerNorm(OpKernel):
    """y = (x - mean) / sqrt(var + eps) * g + b over the last axis (attr
    ``eps``, default 1e-5); see the module docstring."""

    op_type = "LayerNorm"

    @classmethod
    def infer(cls, attrs, ins):
        (xs, xd), (gs, _), (bs, _) = ins
        if not xs or tuple(gs) != (xs[-1],) or tuple(bs) != (xs[-1],):
            raise ShapeError(f"LayerNorm: weight {list(gs)} and bias {list(bs)} must both be "
                             f"[{xs[-1] if xs else '?'}] for an input of shape {list(xs)}")
        return [(tuple(xs), xd), (tuple(xs[:-1]), xd), (tuple(xs[:-1]), xd)]

    def run(self, ins, outs):
        x, g, b = ins
        y, mean, rstd = outs
        xp = get_xp(x)
        xp.mean(x, axis=-1, out=mean)
        xp.subtract(x, mean[..., None], out=y)
        (sq,) = self.temporaries(x, (x.shape, x.dtype))
        xp.multiply(y, y, out=sq)
        xp.mean(sq, axis=-1, out=rstd)
        rstd += float(self.attrs.get("eps", 1e-5))
        xp.sqrt(rstd, out=rstd)
        xp.divide(1, rstd, out=rstd)
        y *= rstd[..., None]
        y *= g
        y += b


@register
class LayerNormGrad(OpKernel):
    """[dy, x, g, mean, rstd] -> the gradients named in attr ``outputs``
    (a subset of dx, dg, db, in that order)."""

    op_type = "LayerNormGrad"

    @classmethod
    def infer(cls, attrs, ins):
        (dys, dyd), (xs, _), (gs, _), _, _ = ins
        shapes = {"dx": tuple(xs), "dg": tuple(gs), "db": tuple(gs)}
        return [(shapes[o], dyd) for o in attrs["outputs"]]

    def run(self, ins, outs):
        dy, x, g, mean, rstd = ins
        xp = get_xp(dy)
        got = dict(zip(self.attrs["outputs"], outs))
        row = (x.shape[:-1] + (1,), x.dtype)
        xhat, dxhat, a, c = self.temporaries(x, (x.shape, x.dtype), (x.shape, x.dtype), row, row)
        xp.subtract(x, mean[..., None], out=xhat)
        xhat *= rstd[..., None]
        lead = tuple(range(x.ndim - 1))
        if "db" in got:
            xp.sum(dy, axis=lead, out=got["db"])
        if "dg" in got:
            xp.multiply(dy, xhat, out=dxhat)
            xp.sum(dxhat, axis=lead, out=got["dg"])
        if "dx" in got:
            dx = got["dx"]
            xp.multiply(dy, g, out=dxhat)
            xp.mean(dxhat, axis=-1, keepdims=True, out=a)
            xp.multiply(dxhat, xhat, out=dx)
            xp.mean(dx, axis=-1, keepdims=True, out=c)
            xp.multiply(xhat, c, out=dx)
            xp.subtract(dxhat, dx, out=dx)
            dx -= a
            dx *= rstd[..., None]


@gradient("LayerNorm")
def _layer_norm_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    if dy is None:
        return
    x, w, b = op.inputs
    wanted = [(name, blob) for name, blob in (("dx", x), ("dg", w), ("db", b))
              if g.needs_grad(blob)]
    if wanted:
        g.emit("LayerNormGrad", [dy, x, w, op.outputs[1], op.outputs[2]],
               [g.grad_blob(blob) for _, blob in wanted],
               {"outputs": [name for name, _ in wanted]})
