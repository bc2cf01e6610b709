"""The divergence watch: the window's loss and the first non-finite
iteration read back from the device loss watch (ops/watch.py), and the
check that every weight is finite before a checkpoint. A part of
``Trainer`` (mixed in)."""
import numpy as np

from ..backend import get_xp, to_numpy


class DivergenceMixin:
    def _read_losses(self):
        """(sum of the losses since the last reset, first non-finite
        iteration or None) from the device loss watch: one read-back; then
        the first non-finite iteration of any rank (collective, at the same
        iterations on every rank)."""
        total, first = 0.0, 0
        self.train.drain()  # the device work queued so far is done: the blobs hold it
        if self.watch is not None:
            total, first = (float(v) for v in to_numpy(self.ws[self.watch]))
        first = int(first) or None
        if self.size > 1:  # the earliest over the ranks: MAX of the negated iteration
            worst = self.world.allreduce(np.array([-(first or 2 ** 62)], np.int64), "max",
                                         "the first diverged iteration (allreduce)")
            first = None if -int(worst[0]) == 2 ** 62 else -int(worst[0])
        return total, first

    def _reset_loss_window(self):
        if self.watch is not None:
            self.ws[self.watch][0] = 0.0

    def _params_finite(self):
        """Whether every parameter of this rank is finite (no NaN or inf)."""
        self.train.drain()
        return all(bool(get_xp(self.ws[p]).isfinite(self.ws[p]).all()) for p in self.params)
