"""The loss watch: the training loss kept on the device between read-backs.

On a GPU the trainer reads the loss back to the host only at display,
test and checkpoint intervals (and when a stop signal asks for a
checkpoint), not every iteration. This op, added to a GPU training graph
by ``purine_mpi.parallel.placement.add_loss_watch``, runs once per iteration
after the losses and keeps, in its two-element float64 output:

    out[0]  the sum of the iterations' losses since the trainer last reset
            it (each iteration's loss: the sum of loss_k * share_k, as the
            host computes it, in double -- so the displayed mean is the same)
    out[1]  the first iteration (counted from 1, as "iteration N done")
            whose loss was not finite, 0 while there is none

inputs: the loss blobs (one per micro-batch copy), then the iteration blob;
attrs: ``shares`` (each loss's share of the iteration's loss). Nothing is
read on the host: on a GPU it is one single-thread kernel reading a table of
device pointers and the device iteration blob (cuda/loss_watch.cu), which a
captured CUDA graph replays. It keeps no host state (the output blob is the
state; the trainer zeroes ``out[0]`` after reading it).
"""
import math

import numpy as np

from ..base.backend import get_xp
from ..base.errors import ShapeError
from .registry import OpKernel, register


@register
class LossWatch(OpKernel):
    """inputs: loss_0 .. loss_{n-1} (one element each), iter (int64);
    output: (2,) float64 [window sum, first non-finite iteration or 0]."""

    op_type = "LossWatch"
    keeps_outputs = True  # the window sum goes on from the last iteration

    @classmethod
    def infer(cls, attrs, ins):
        shares = attrs.get("shares") or []
        if len(ins) < 2 or len(shares) != len(ins) - 1:
            raise ShapeError(f"LossWatch takes [loss_0, ..., iter] with one share per loss, "
                             f"got {len(ins)} input(s) and {len(shares)} share(s)")
        for shape, dtype in ins[:-1]:
            if int(np.prod(shape or (1,))) != 1:
                raise ShapeError(f"LossWatch: a loss has one element, got shape {list(shape)}")
        shape, dtype = ins[-1]
        if np.dtype(dtype) != np.dtype(np.int64) or int(np.prod(shape or (1,))) != 1:
            raise ShapeError(f"LossWatch: the last input is the int64 iteration, got "
                             f"{np.dtype(dtype)} of shape {list(shape)}")
        return [((2,), "float64")]

    def __init__(self, op):
        super().__init__(op)
        self.shares = [float(s) for s in self.attrs["shares"]]
        self._table = None

    def setup(self, ins, outs):
        outs[0][...] = 0.0

    def run(self, ins, outs):
        out, losses, it = outs[0], ins[:-1], ins[-1]
        if get_xp(out) is not np:
            from ..gpu import kernels
            if self._table is None or any(a is not b for a, b in
                                          zip(self._table.losses, losses)):
                self._table = kernels.LossTable([a.reshape(1) for a in losses], self.shares)
                self._table.losses = list(losses)
            kernels.loss_watch(self._table, it.reshape(1), out)
            return
        now = 0
        for loss, share in zip(losses, self.shares):
            now = now + float(loss) * share
        out[0] = float(out[0]) + now
        if not math.isfinite(now) and out[1] == 0:
            out[1] = int(it) + 1
