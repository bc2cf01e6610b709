"""fp16's dynamic loss scaling (``precision: fp16``, ``loss_scale``): the op
kinds ``graph/loss_scale.py`` puts around the gradients and the updates.

FoundInf        ins [g_1 .. g_n]  outs [flag (1,) float32]
    flag = 1 when any gradient holds an inf or a NaN, else 0 (then one
    Allreduce with ``reduce: max`` makes it every rank's).
Unscale         ins [g, scale]  outs [g@unscale] (an alias of g)
    g@unscale = g / scale: the gradient of the unscaled loss.
AdamStep        ins [iter, skipped]  outs [step]   (int64, iter's shape; a host op)
    step = iter - skipped: the iteration an Adam update sees, so that its
    step count moves only with the steps applied (torch.optim's ``step``).
LossScaleUpdate ins [flag, scale, good, skipped]  outs [scale@new, good@new,
                skipped@new (aliases), skip (1,) float32]   attrs growth_factor,
                backoff_factor, growth_interval, init_scale
    A host op (parallel/placement.py: its flag comes back from the device
    by a copy, its blobs live on the host), after the unscaling and before
    the updates: skip = the flag; a flagged step counts as skipped, the scale is
    multiplied by ``backoff_factor`` and the run of good steps restarts;
    else ``growth_interval`` good steps in a row multiply it by
    ``growth_factor``, unless float32 would make that inf (then it stays;
    PyTorch GradScaler's ``_amp_update_scale_``, step for step). Its
    blobs (kind state) are set to ``init_scale``, 0, 0 at set-up, and it
    is stateful: a checkpoint holds the three values.

InjectInf       ins [g]  outs [g@inject] (an alias of g)   attrs iteration, iter_blob
    developers, tests (``PURINE_FP16_INJECT_INF``, graph/loss_scale.py):
    when the host blob ``iter_blob`` (the trainer's 0-based iteration) is
    ``iteration``, the first element of g becomes +inf, so that step
    overflows; a graph has the op only while the variable names this rank.

The update ops themselves are skipped by ops/registry.py's ``make_kernel``
(attr ``skip_if``: the host blob ``skip``): on a flagged step they run not
at all, so the weights and the solver state stay bit for bit. The flag
comes back to the host once per iteration (GradScaler's ``step`` reads it
too), and the skippable updates run eagerly, not captured. No gradient:
they act after the backward pass.
"""
import numpy as np

from ..base.backend import get_xp, to_numpy
from ..base.errors import ShapeError
from ..gpu.raw import carry
from .registry import OpKernel, flag_set, register

#: the attr that makes an update op skippable (its value: the flag blob)
SKIP_IF = "skip_if"


@register
class FoundInf(OpKernel):
    """[g_1 .. g_n] -> [flag (1,) float32]: 1 when any g_i is not finite."""

    op_type = "FoundInf"
    category = "update"
    capturable = False
    capture_note = "reduces the gradients' finiteness with temporaries"

    @classmethod
    def infer(cls, attrs, ins):
        if not ins:
            raise ShapeError("FoundInf needs at least one gradient")
        return [((1,), "float32")]

    def run(self, ins, outs):
        flag = outs[0]
        xp = get_xp(flag)
        flag[...] = 0
        for g in ins:  # on a device: device work only, no read back
            bad = xp.logical_not(xp.isfinite(g)).any()
            xp.maximum(flag, bad.astype(flag.dtype), out=flag)


@register
class InjectInf(OpKernel):
    """[g] -> [g@inject] (an alias of g): g[0] = inf on one iteration."""

    op_type = "InjectInf"
    category = "update"
    capturable = False
    capture_note = "a test's injected overflow (PURINE_FP16_INJECT_INF)"

    @classmethod
    def infer(cls, attrs, ins):
        return [tuple(ins[0])]

    def run(self, ins, outs):
        g, out = ins[0], outs[0]
        carry([g], [out])
        # the host's iteration blob, written before the run (no edge: no
        # device twin, whose value a host decision could not read)
        it = int(np.asarray(self.workspace[self.attrs["iter_blob"]]).reshape(-1)[0])
        if it == int(self.attrs["iteration"]):
            out.reshape(-1)[:1] = np.inf


@register
class Unscale(OpKernel):
    """[g, scale] -> [g@unscale] (an alias of g): g / scale."""

    op_type = "Unscale"
    category = "update"

    @classmethod
    def infer(cls, attrs, ins):
        (gs, gd), (ss, _) = ins
        if int(np.prod(ss, dtype=np.int64)) != 1:
            raise ShapeError(f"Unscale's scale must be one value, got shape {list(ss)}")
        return [(tuple(gs), gd)]

    def run(self, ins, outs):
        g, scale = ins
        out = outs[0]
        carry([g], [out])
        xp = get_xp(out)
        if xp is np:
            out /= out.dtype.type(scale.reshape(-1)[0])
        else:  # the scale stays on the device: no read back
            xp.divide(out, scale.reshape((1,) * out.ndim).astype(out.dtype, copy=False), out=out)


@register
class AdamStep(OpKernel):
    """[iter, skipped] -> [step]: iter - skipped (Adam's step count)."""

    op_type = "AdamStep"
    category = "update"
    capturable = False
    capture_note = "reads the skipped-step count"

    @classmethod
    def infer(cls, attrs, ins):
        return [ins[0]]

    def run(self, ins, outs):
        it, skipped = ins
        outs[0][...] = it - skipped.reshape(it.shape).astype(it.dtype, copy=False)


@register
class LossScaleUpdate(OpKernel):
    """[flag, scale, good, skipped] -> their aliases: GradScaler's update."""

    op_type = "LossScaleUpdate"
    category = "update"
    capturable = False
    capture_note = "decides on the host whether the step was skipped"
    stateful = True

    @classmethod
    def infer(cls, attrs, ins):
        return [tuple(x) for x in ins[1:4]] + [((1,), "float32")]

    def setup(self, ins, outs):
        self.write(outs[:3], float(self.attrs["init_scale"]), 0, 0)
        outs[3][...] = 0

    def run(self, ins, outs):
        flag = ins[0]
        carry(ins[1:], outs[:3])
        scale, good, skipped = self.values(outs[:3])
        a = self.attrs
        found = flag_set(flag)
        if found:
            scale, good, skipped = scale * float(a["backoff_factor"]), 0, skipped + 1
        else:
            good += 1
            if good >= int(a["growth_interval"]):
                # a scale that float32 cannot hold is not taken (torch's
                # _amp_update_scale_: the old scale stays, the count restarts);
                # an inf scale would make every later step inf and skipped
                grown = scale * float(a["growth_factor"])
                with np.errstate(over="ignore"):
                    held = bool(np.isfinite(np.float32(grown)))
                scale, good = (grown if held else scale), 0
        self.write(outs[:3], scale, good, skipped)
        outs[3][...] = 1.0 if found else 0.0

    @staticmethod
    def values(arrays):
        """(scale, good steps in a row, skipped steps) as host numbers."""
        scale, good, skipped = (np.asarray(to_numpy(a)).reshape(-1)[0] for a in arrays)
        return float(scale), int(good), int(skipped)

    @staticmethod
    def write(arrays, scale, good, skipped):
        for a, v in zip(arrays, (scale, good, skipped)):
            a[...] = v

    def state_dict(self):
        scale, good, skipped = self.values(self.outs[:3])
        return {"scale": scale, "good_steps": good, "skipped_steps": skipped}

    def load_state_dict(self, state):
        self.write(self.outs[:3], float(state["scale"]), int(state["good_steps"]),
                   int(state["skipped_steps"]))
