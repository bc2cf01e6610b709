"""Inverted dropout: units are scaled by 1/(1 - ratio) at train time, so the
test-time op is the identity (Caffe's and PyTorch's convention).

The keep-mask is an explicit output blob of the forward op, read by the
backward op, so no state hides in the kernel between the two.
"""
import numpy as np

from ..backend import get_xp
from ..errors import ShapeError
from .registry import OpKernel, gradient, register


def _ratio(attrs):
    ratio = float(attrs.get("ratio", 0.5))
    if not 0.0 <= ratio < 1.0:
        raise ShapeError(f"dropout ratio must lie in [0, 1), got {ratio}")
    return ratio


def _train(attrs):
    phase = attrs.get("phase", "train")
    if phase not in ("train", "test"):
        raise ShapeError(f"dropout phase must be 'train' or 'test', got {phase!r}")
    return phase == "train"


@register
class Dropout(OpKernel):
    """Train phase: [x] -> [y, mask], mask_i ~ Bernoulli(1 - ratio) (0 or 1,
    in x's dtype), y = x * mask / (1 - ratio).  Test phase: [x] -> [y], y = x.
    Attrs ``ratio`` (default 0.5), ``phase`` (default "train").
    Gradient: dx = dy * mask / (1 - ratio) (train), dx = dy (test).

    The mask is drawn on the host with ``self.rng`` (the runtime's per-op
    seeded numpy Generator, saved in checkpoints) and copied to the device
    for CuPy arrays, so a run is reproducible whatever the backend."""

    op_type = "Dropout"
    needs_rng = True

    @classmethod
    def infer(cls, attrs, ins):
        _ratio(attrs)
        return [ins[0], ins[0]] if _train(attrs) else [ins[0]]

    def run(self, ins, outs):
        x = ins[0]
        if not _train(self.attrs):
            outs[0][...] = x
            return
        if self.rng is None:
            raise RuntimeError("Dropout needs a random generator: the runtime must set "
                               "kernel.rng (needs_rng = True)")
        ratio = _ratio(self.attrs)
        dtype = x.dtype if x.dtype in (np.float32, np.float64) else np.float32
        keep = self.rng.random(x.shape, dtype=dtype) >= ratio
        y, mask = outs
        mask[...] = get_xp(x).asarray(keep)
        # x is read before y is written, so y may share x's storage
        get_xp(x).multiply(x, mask, out=y)
        y *= 1.0 / (1.0 - ratio)


@register
class DropoutGrad(OpKernel):
    """[dy, mask] -> [dx]: dx = dy * mask / (1 - ratio)."""

    op_type = "DropoutGrad"

    @classmethod
    def infer(cls, attrs, ins):
        if tuple(ins[0][0]) != tuple(ins[1][0]):
            raise ShapeError(f"DropoutGrad: dy {list(ins[0][0])} and mask "
                             f"{list(ins[1][0])} differ")
        return [ins[0]]

    def run(self, ins, outs):
        dy, mask = ins
        get_xp(dy).multiply(dy, mask, out=outs[0])
        outs[0] *= 1.0 / (1.0 - _ratio(self.attrs))


@gradient("Dropout")
def _dropout_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    x = op.inputs[0]
    if dy is None or not g.needs_grad(x):
        return
    if _train(op.attrs):
        g.emit("DropoutGrad", [dy, op.outputs[1]], [g.grad_blob(x)],
               {"ratio": op.attrs.get("ratio", 0.5)})
    else:
        g.emit("Copy", [dy], [g.grad_blob(x)])
