"""Basic tensor ops used by the graph builders themselves."""
import numpy as np

from ..base.backend import get_xp, to_numpy
from ..base.precision import BITS, is_bits, wire_scratch
from ..gpu.raw import carry, narrow
from .registry import OpKernel, gradient, register, round_low


@register
class Constant(OpKernel):
    """y = value (a source op; attrs ``shape``, ``value``, ``dtype``).

    On a GPU the blob is filled once: nothing else writes it (an op that
    adds into it would make the op ``accumulate``, and then it fills every
    iteration), so later iterations launch nothing for it. Its output
    therefore keeps its own memory in the memory plan (``keeps_outputs``),
    on the host too (a loss's gradient seed: a few bytes)."""

    op_type = "Constant"
    keeps_outputs = True

    @classmethod
    def infer(cls, attrs, ins):
        return [(tuple(attrs["shape"]), attrs.get("dtype", "float32"))]

    def run(self, ins, outs):
        y = outs[0]
        if get_xp(y) is not np and not self.op.accumulate:
            if getattr(self, "_filled", None) is y:
                return
            self._filled = y
        y.fill(self.attrs["value"])


@register
class Sum(OpKernel):
    """y = x_0 + x_1 + ... (same shapes).  Gradient: dx_i = dy.

    With attr ``bits_copy: [0]`` (bf16 storage, parallel/precision.
    fold_copies: a float32 gradient sum, a residual's, read by float32
    readers -- the next sum, a bias gradient -- and, as bits, by products) a
    second output, y's bfloat16 bits (uint16: the bits a Cast of y wrote):
    on a GPU two float32 C-contiguous terms in one pass (``add_copy_f32``),
    else the sum then ``to_bf16_bits`` of it (the host a chunk of scratch
    at a time, declared in ``host_temporaries``)."""

    op_type = "Sum"

    @classmethod
    def in_place_of(cls, attrs):
        """With ``bits_copy``, y over a term that dies at the sum (the memory
        plan's rule; every kernel reads x_i[j] before it writes y[j]:
        add_copy_f32, "y may be a or b"; NumPy's and CuPy's add with out= a
        term, += the further terms): a residual gradient's sum with its
        bits copy holds 4 + 4 + 2 bytes an element, where y of its own made
        it 4 + 4 + 4 + 2 beside the terms (the Cast's design, 4 + 4 + 4 at
        the sum, 4 + 2 at the Cast). A sum without the copy keeps bytes of
        its own (the micro-batches' running sums are views instead:
        parallel/micro_batch._sum_in_place)."""
        return ((0, 0), (1, 0)) if attrs.get("bits_copy") else ()

    @classmethod
    def bits_copies(cls, attrs):
        return (0,)

    @classmethod
    def infer(cls, attrs, ins):
        from ..base.errors import ShapeError
        shapes = {tuple(s) for s, _ in ins}
        if len(shapes) != 1:
            raise ShapeError(f"Sum needs inputs of one shape, got {sorted(shapes)}")
        copy = list(attrs.get("bits_copy", ()))
        if copy not in ([], [0]) or (copy and np.dtype(ins[0][1]) != np.float32):
            raise ShapeError(f"Sum: bits_copy takes [0] of a float32 sum, got {copy} "
                             f"({ins[0][1]})")
        return [ins[0]] + [(ins[0][0], BITS)] * len(copy)

    def host_temporaries(self, ins, outs):
        """to_bf16_bits's scratch where y's bits are written too."""
        return [(wire_scratch(outs[0].size).shape, np.uint32)] if len(outs) > 1 else []

    def run(self, ins, outs):
        xp = get_xp(outs[0])
        copy = outs[1] if len(outs) > 1 else None
        if copy is not None and xp is not np and len(ins) == 2 and all(
                np.dtype(a.dtype) == np.float32 and a.flags.c_contiguous
                for a in (*ins, outs[0])):
            from ..gpu.kernels import add_copy
            add_copy(ins[0], ins[1], outs[0], copy)
            return
        xp.add(ins[0], ins[1], out=outs[0]) if len(ins) > 1 else outs[0].__setitem__(..., ins[0])
        for x in ins[2:]:
            outs[0] += x
        if copy is not None:
            narrow(outs[0], copy, lambda: self.temporaries(
                outs[0], *self.host_temporaries(ins, outs))[0])


@gradient("Sum")
def _sum_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    for x in op.inputs:
        if g.needs_grad(x):
            g.emit("Copy", [dy], [g.grad_blob(x)])


@register
class Copy(OpKernel):
    """y = x (a copy into y's own storage).  Gradient: dx = dy."""

    op_type = "Copy"
    category = "copy"

    @classmethod
    def infer(cls, attrs, ins):
        return [ins[0]]

    def run(self, ins, outs):
        dst, src = outs[0], ins[0]
        if get_xp(dst) is get_xp(src):
            dst[...] = src
        elif get_xp(dst) is np:  # device -> host
            dst[...] = to_numpy(src)
        elif dst.flags.c_contiguous and np.dtype(dst.dtype) == np.dtype(src.dtype) and \
                tuple(dst.shape) == tuple(np.shape(src)):
            # host -> device straight into the blob (CuPy's set: no device temporary)
            dst.set(np.ascontiguousarray(src))
        else:  # host -> device, converted on the way
            dst[...] = get_xp(dst).asarray(src)


@gradient("Copy")
def _copy_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    if g.needs_grad(op.inputs[0]):
        g.emit("Copy", [dy], [g.grad_blob(op.inputs[0])])


@register
class Noop(OpKernel):
    """Does nothing; used in tests and as a synchronisation point."""

    op_type = "Noop"

    @classmethod
    def infer(cls, attrs, ins):
        return [(tuple(s), np.dtype(d).name) for s, d in
                [(attrs["shape"], attrs.get("dtype", "float32"))] * attrs.get("n_outputs", 0)]

    def run(self, ins, outs):
        pass


@register
class WeightedSum(OpKernel):
    """loss = sum(x * w) (a 0-d scalar).  Gradient: dx = dloss * w.  Used as a
    probe loss by tests and gradient checks."""

    op_type = "WeightedSum"

    @classmethod
    def infer(cls, attrs, ins):
        return [((), ins[0][1])]

    def run(self, ins, outs):
        xp = get_xp(ins[0])
        outs[0][...] = xp.sum(ins[0] * ins[1])


@register
class Scaled(OpKernel):
    """y = s * w with s a 0-d blob (ins = [s, w]).  Backward helper."""

    op_type = "Scaled"

    @classmethod
    def infer(cls, attrs, ins):
        return [ins[1]]

    def run(self, ins, outs):
        s = ins[0].reshape(()) if ins[0].size == 1 else ins[0]  # a (1,) blob too
        get_xp(outs[0]).multiply(ins[1], s, out=outs[0])


@gradient("WeightedSum")
def _weighted_sum_grad(g, op):
    dloss = g.grad_of(op.outputs[0])
    x, w = op.inputs
    if g.needs_grad(x):
        g.emit("Scaled", [dloss, w], [g.grad_blob(x)])


def cast_copy(src, dst, dtype):
    """``dst`` = float32 ``src`` rounded to ``dtype`` (``bfloat16`` or
    ``float16``), a Cast op's result outside its op: float32 storage, or
    bfloat16 bits where ``dst`` is bits -- the same kernels (cuda/
    precision.cu) on a GPU, base/precision's on the host (a scratch made
    here: not for a captured iteration). The weight copies' refresh
    (parallel/precision.refresh_weight_copies) and an update op's fallback
    where its kernel does not write the copy itself."""
    if is_bits(dst):
        narrow(src, dst, lambda: np.empty(wire_scratch(dst.size).shape, np.uint32))
        return
    if get_xp(dst) is not np:
        from ..gpu.kernels import round_copy
        round_copy(src, dst, dtype)
        return
    from ..base.precision import round_to, scratch_spec
    carry([src], [dst])
    shape, sdtype = scratch_spec(dst.shape, dtype)
    round_to(dst, dtype, np.empty(shape, sdtype))


@register
class Cast(OpKernel):
    """y = x rounded to attr ``dtype`` (``bfloat16`` or ``float16``), kept in
    float32 storage (base/precision.py): the low-precision copy the
    precision pass (parallel/precision.py) gives a GEMM's, convolution's or
    attention's float32 input -- a weight's ``<w>@bf16``, made once per
    iteration. No gradient: the pass runs on a graph whose backward is
    built.

    On a GPU one kernel reads the source and writes the rounded copy
    (cuda/precision.cu via gpu/kernels.round_copy: no separate copy pass).
    In place (``in_place``): where the Cast is the last op to touch its
    float32 source and both are transient (an activation's gradient, e.g.
    the logits'), the memory plan (runtime/memory_plan.py) puts the copy on
    the source's bytes, and the kernel rounds them where they are: no
    memory of the copy's own. A weight, kept across iterations, keeps its
    separate copy.

    As bits (attr ``bits_out: [0]``, set by parallel/precision.store_bits
    where every reader of a bfloat16 copy takes bfloat16 bits): the copy is
    the uint16 bits of the bfloat16 nearest each value (2 bytes an element,
    never on the source's 4), one ``to_bf16_bits`` kernel on a GPU
    (cuda/precision.cu), base/precision.to_bf16_bits on the host: the bits
    of the float32 rounding's upper halves, so its readers multiply the same
    numbers."""

    op_type = "Cast"
    in_place = ((0, 0),)

    @classmethod
    def infer(cls, attrs, ins):
        if 0 in attrs.get("bits_out", ()):
            return [(ins[0][0], BITS)]
        return [ins[0]]

    @classmethod
    def bits_outputs(cls, attrs):
        return (0,) if attrs.get("dtype") == "bfloat16" else ()

    def run(self, ins, outs):
        dst = outs[0]
        if is_bits(dst):
            narrow(ins[0], dst, lambda: self.temporaries(
                dst, (wire_scratch(dst.size).shape, np.uint32))[0])
            return
        if get_xp(dst) is not np:   # one kernel, copy and rounding in one pass, no scratch
            from ..gpu.kernels import round_copy
            round_copy(ins[0], dst, self.attrs["dtype"])
            return
        carry([ins[0]], [dst])   # none where the plan put the copy on its source
        round_low(self, [dst], self.attrs["dtype"])

    def host_temporaries(self, ins, outs):
        from ..base.precision import scratch_spec
        if is_bits(outs[0]):   # to_bf16_bits's chunk
            return [(wire_scratch(outs[0].size).shape, np.uint32)]
        return [scratch_spec(outs[0].shape, self.attrs["dtype"])]   # round_to's, on the host
