"""fp16's loss scale in the run's log and metrics (a loop service): one
line of rank 0's log for each skipped step (an inf/nan gradient on some
rank: every rank skipped its update), and ``loss_scale`` and
``skipped_steps`` in each train row of metrics.jsonl (docs/formats.md).
The values live in the graph's state blobs (graph/loss_scale.py), the same
on every rank; reading them is one read back per iteration on a GPU, after
the update op read the flag already."""
from ..graph.loss_scale import GOOD, SCALE, SKIPPED
from ..ops.loss_scale import LossScaleUpdate
from .loop import Service


def scale_values(loop):
    """(scale, good steps in a row, skipped steps), or None without fp16."""
    if SCALE not in loop.ws.arrays:
        return None
    return LossScaleUpdate.values([loop.ws[b] for b in (SCALE, GOOD, SKIPPED)])


class LossScaleLog(Service):
    def __init__(self):
        self.last = None  # (scale, skipped) after the last iteration

    def on_start(self, loop):
        values = scale_values(loop)
        self.last = None if values is None else (values[0], values[2])

    def after_step(self, loop, done):
        if self.last is None:
            return
        scale, _, skipped = scale_values(loop)
        was, before = self.last
        if skipped > before:
            loop.say(f"iter {done}: an inf/nan gradient (fp16): step skipped on every rank "
                     f"(weights and solver state unchanged), loss scale {was:g} -> {scale:g}, "
                     f"{skipped} step{'s' if skipped != 1 else ''} skipped so far")
        self.last = (scale, skipped)
