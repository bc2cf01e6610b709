"""The iteration counter on the device.

On a GPU the iteration index (read by the learning-rate policy, the dropout
masks and the loss watch) lives on the device and moves on by itself: the
``IterationCounter`` op, put there by ``parallel/placement.py`` in place of a
per-iteration host-to-device copy of the host ``iter`` blob, writes

    iteration = counter;  counter = counter + 1

with one single-thread kernel (cuda/lr_policy.cu). So the iteration holds no
host-to-device copy (CuPy refuses one inside a stream capture) and a captured
CUDA graph replays the schedule by itself. The host writes the counter only
when the dispatcher is asked for an iteration other than the one that
follows the last (the first iteration, a resume, an iteration set by hand):
``before_iteration``, which the stream dispatcher calls every iteration,
with the device idle.

outputs: ``iteration`` (0-d int64, the blob its readers see), ``counter``
(0-d int64, a state blob nobody else reads). No inputs, no gradient.
"""
import numpy as np

from ..base.backend import get_xp
from ..base.errors import ShapeError
from .registry import OpKernel, register


@register
class IterationCounter(OpKernel):
    """[] -> [iteration, counter]: iteration = counter; counter += 1."""

    op_type = "IterationCounter"
    category = "update"
    keeps_outputs = True  # the counter carries over to the next iteration

    @classmethod
    def infer(cls, attrs, ins):
        if ins:
            raise ShapeError(f"IterationCounter takes no inputs, got {len(ins)}")
        return [((), "int64"), ((), "int64")]

    def __init__(self, op):
        super().__init__(op)
        self.expected = None  # the iteration the counter holds now (None: unknown)

    def before_iteration(self, iteration, host_write):
        """Set the counter to ``iteration`` unless it holds it already."""
        if iteration != self.expected:
            counter = self.outs[1]
            host_write(lambda: counter.fill(int(iteration)))
        self.expected = int(iteration) + 1
        return None

    def run(self, ins, outs):
        iteration, counter = outs
        if get_xp(counter) is not np:
            from ..gpu import kernels
            kernels.iteration_next(counter.reshape(1), iteration.reshape(1))
            return
        iteration[...] = counter
        counter += 1
