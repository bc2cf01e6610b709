"""The divergence watch (a loop service): the display window's loss and
the first non-finite iteration, read from the host blobs every iteration
on the CPU, or back from the device loss watch (ops/watch.py) only at the
display, test and checkpoint iterations on a GPU; and the check that every
weight and its solver state are finite before a checkpoint or a test pass
may follow. A non-finite loss or weight makes the agreed stop code DIVERGED
(runtime/stop.py).
"""
import numpy as np

from ..base.backend import all_finite, get_xp, to_numpy
from ..gpu.raw import array_device
from ..graph.solver_graph import solver_states, state_name
from ..parallel.schemes import scheme_of
from ..runtime.footprint import model_state_roots
from ..runtime.stop import StopSignal
from .loop import Service


class DivergenceWatch(Service):
    def __init__(self):
        self.checked = True  # the loss of this iteration was looked at

    def after_step(self, loop, done):
        # on a GPU the loss is read back only where it is shown or a
        # checkpoint may follow (the same iterations on every rank)
        self.checked = not loop.graphs.deferred or loop.display_due(done) or \
            loop.checkpoint_due(done) or loop.test_due(done)
        if not loop.graphs.deferred:
            value, finite = loop.loss_now()
            loop.state.window.loss += value
            if loop.graphs.layout.stages == 1:  # this rank's: the time-based line shows
                # it; a stage of a pipeline holds none of the objective, or a part
                loop.state.last_loss = (done, value)
            loop.state.first_bad = None if finite else done
        elif self.checked:
            loop.state.window.loss, loop.state.first_bad = self.read_losses(loop)
        # a checkpoint is never written with non-finite weights, nor a test
        # pass run on them (its accuracy would be reported, a best_<iter>.h5
        # written): where either may follow, the parameters are checked too
        loop.state.diverged = loop.state.first_bad is not None or (
            (loop.checkpoint_due(done) or loop.test_due(done)) and not self.params_finite(loop))

    def on_display(self, loop, done):
        if loop.graphs.watch is not None:  # the device window starts again
            loop.ws[loop.graphs.watch][0] = 0.0

    def on_stop_request(self, loop, done):
        """After the agreement (signals.py): a signal that asks for a
        checkpoint between the intervals has the loss and the weights
        checked first, on every rank."""
        code = loop.state.stop_code
        if code == StopSignal.DIVERGED and not loop.graphs.deferred and loop.world.size > 1:
            # each rank looked at its own loss: the iteration whose loss was
            # non-finite on any rank is the run's (rank 0 says it; its own
            # loss may be finite: the run stopped on another rank's NaN,
            # its first iteration's message blames the initial weights)
            bad = loop.world.allreduce(np.array([int(loop.state.first_bad is not None)],
                                                np.int64), "max",
                                       "the diverged loss of any rank (allreduce)")
            loop.state.first_bad = done if int(bad[0]) else None
            return
        if not loop.graphs.deferred or self.checked or not code or code == StopSignal.DIVERGED:
            return
        # the window's sum too: the checkpoint that follows holds it
        loop.state.window.loss, loop.state.first_bad = self.read_losses(loop)
        diverged = loop.state.first_bad is not None or not self.params_finite(loop)
        if loop.world.size > 1:
            diverged = bool(loop.world.allreduce(
                np.array([int(diverged)], np.int64), "max",
                "the divergence check before a checkpoint (allreduce)")[0])
        loop.state.stop_code = StopSignal.DIVERGED if diverged else code

    @staticmethod
    def read_losses(loop):
        """(sum of the losses since the last reset, first non-finite
        iteration or None) from the device loss watch: one read-back; then
        the first non-finite iteration of any rank (collective, at the same
        iterations on every rank)."""
        total, first = 0.0, 0
        loop.train.drain()  # the device work queued so far is done: the blobs hold it
        if loop.graphs.watch is not None:
            total, first = (float(v) for v in to_numpy(loop.ws[loop.graphs.watch]))
        first = int(first) or None
        if loop.world.size > 1:  # the earliest over the ranks: MAX of the negated iteration
            worst = loop.world.allreduce(np.array([-(first or 2 ** 62)], np.int64), "max",
                                         "the first diverged iteration (allreduce)")
            first = None if -int(worst[0]) == 2 ** 62 else -int(worst[0])
        return total, first

    @staticmethod
    def params_finite(loop):
        """Whether every weight this rank holds and its solver state (the
        momentum, Adam's moments: a checkpoint holds them too) is finite (no
        NaN or inf). The float32 blobs on a GPU are checked by our own
        kernel, one read-back per device (gpu/kernels ``all_finite``); the
        rest by base/backend.all_finite (a host array by its largest and
        smallest elements: no array-sized temporary)."""
        loop.train.drain()
        ws = loop.ws
        by_device, rest = {}, []
        for a in (ws[n] for n in DivergenceWatch.held_state(loop)):
            if get_xp(a) is not np and np.dtype(a.dtype) == np.float32 and a.flags.c_contiguous:
                by_device.setdefault(array_device(a), []).append(a)
            else:
                rest.append(a)
        if by_device:
            from ..gpu import import_cupy, kernels
            cupy = import_cupy()
            for device, group in by_device.items():
                with cupy.cuda.Device(device):
                    if not kernels.all_finite(group):
                        return False
        return all(all_finite(a) for a in rest)

    @staticmethod
    def first_nonfinite(loop):
        """The name of the first blob ``params_finite`` checks that holds
        NaN or inf (each read on its own: for a message, after the check
        said so), or None."""
        loop.train.drain()
        ws = loop.ws
        for name in DivergenceWatch.held_state(loop):
            a = ws[name]
            if get_xp(a) is not np and np.dtype(a.dtype) == np.float32 and a.flags.c_contiguous:
                from ..gpu import import_cupy, kernels
                with import_cupy().cuda.Device(array_device(a)):
                    finite = kernels.all_finite([a])
            else:
                finite = all_finite(a)
            if not finite:
                return name
        return None

    @staticmethod
    def held_state(loop):
        """The blobs ``params_finite`` checks: the weights this rank holds,
        their solver states, the optimizer state held otherwise."""
        ws = loop.ws
        states = solver_states(loop.job.solver.type)
        # the blobs that hold the weights (a ZeRO-3 rank: its shards) and the
        # optimizer state (a ZeRO rank: its flat shards, named by no parameter)
        names = scheme_of(loop.job).held_weights(loop.graphs) + [
            state_name(p, s) for p in loop.graphs.params for s in states
            if state_name(p, s) in ws.arrays]
        g = loop.graphs.graph
        covered = {g.storage_root(n) for n in names if n in g.blobs}  # read once, not twice
        names += [root for root, row in model_state_roots(g).items()
                  if row == "optimizer_state" and root in ws.arrays and root not in covered]
        return names
