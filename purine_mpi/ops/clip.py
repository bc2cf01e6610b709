"""Gradient clipping by the global L2 norm (``solver.clip_gradients``,
Caffe's ``SGDSolver::ClipGradients``): two op kinds that ``graph/clip.py``
puts between the gradients and the update ops.

GradNormSq  ins [g_1 .. g_n]  outs [sumsq (1,) float64, partial (n*S,) float64]
            attrs scales [s_1 .. s_n]
    sumsq = sum_i s_i^2 * ||g_i||^2: the squared L2 norm of the gradients the
    updates apply (s_i is update i's ``grad_scale``: 1/N for a sum over N
    ranks, 1/M over M micro-batches). ``partial`` is the device's scratch
    (S = CLIP_SLOTS partial sums per gradient; unused on the CPU). Every
    squared norm is accumulated in float64 (the device kernel's
    per-element double sums; on the CPU ``sumsq64``), so a parameter cut
    into pieces (ZeRO's shards, whose sums an Allreduce adds) gives the
    norm its whole gives to ~1e-16, and ClipScale's float32 factor with it
    (but where the two straddle a float32 rounding: ~1e-9 of the cases).
ClipScale   ins [g_1 .. g_n, sumsq]  outs [g_1@clip .. g_n@clip] (aliases)
            attrs clip
    g@clip = g * clip / sqrt(sumsq) when sqrt(sumsq) > clip, else g. The
    clip pass adds one per gradient (n = 1); on a device, the fusion pass
    (parallel/fuse.py ``fuse_clip``) makes them one op.

On a GPU both run as raw kernels (cuda/clip.cu) that read and write the
norm on the device: no host synchronisation inside the iteration; GradNormSq
is two launches, whatever the number of gradients (``grad_sumsq_multi``
over a table of them built at setup, then ``clip_total``), and a fused
ClipScale one (``clip_scale_multi`` over its table; gradients that moved
since setup fall back to one ``clip_scale`` each, the same bits). No
gradient: they act after the backward pass. Imports the registry, the
backend and the device kernels (the ops layer).
"""
import math

import numpy as np

from ..base.backend import get_xp
from ..base.errors import ShapeError
from ..gpu.raw import carry, raw_kernels
from .registry import OpKernel, register

#: partial sums per gradient on a GPU (cuda/clip.cu; the CPU ignores them)
CLIP_SLOTS = 32
#: elements per float64 chunk of ``sumsq64`` (128 KiB of scratch; the
#: fastest of 4K..64K on gpt_small's gradients, docs/parallel.md)
SUMSQ_CHUNK = 16384


def _multi_table(arrays, make):
    """``make(k)`` (a multi-tensor kernel's device table, gpu/kernels/step.py)
    where the ``arrays`` are on a GPU (``k``: ``raw_kernels``), of one dtype
    and C-contiguous, as one launch over them needs; else None (one launch
    per array)."""
    k = raw_kernels(get_xp(arrays[0]), *arrays)
    if k is None or len({np.dtype(a.dtype) for a in arrays}) != 1 or \
            not all(a.flags.c_contiguous for a in arrays):
        return None
    return make(k)


@register
class GradNormSq(OpKernel):
    """[g_1 .. g_n] -> [sumsq (1,), partial (n*CLIP_SLOTS,)], float64."""

    op_type = "GradNormSq"
    category = "update"

    @classmethod
    def infer(cls, attrs, ins):
        if not ins or len(attrs.get("scales", ())) != len(ins):
            raise ShapeError(f"GradNormSq needs gradients and one scale each, got {len(ins)} "
                             f"gradient(s) and {len(attrs.get('scales', ()))} scale(s)")
        return [((1,), "float64"), ((len(ins) * CLIP_SLOTS,), "float64")]

    def setup(self, ins, outs):
        """On a GPU, the table of one ``grad_sumsq_multi`` launch over every
        gradient (their addresses, sizes and scales), where they are
        C-contiguous arrays of one dtype."""
        scales2 = [float(s) ** 2 for s in self.attrs["scales"]]
        self._table = _multi_table(ins, lambda k: k.SumsqTable(list(ins), scales2, CLIP_SLOTS))

    def run(self, ins, outs):
        sumsq, partial = outs
        scales = [float(s) for s in self.attrs["scales"]]
        xp = get_xp(ins[0])
        k = raw_kernels(xp, *ins)
        if k is not None:
            table = getattr(self, "_table", None)
            if table is not None and table.holds(ins):   # one launch, the same bits
                k.grad_sumsq_multi(table, partial)
            else:
                for i, (g, s) in enumerate(zip(ins, scales)):
                    k.grad_sumsq(g, partial[i * CLIP_SLOTS:(i + 1) * CLIP_SLOTS], s * s)
            k.clip_total(partial, sumsq, ins[0].dtype)
            return
        total, scratch = 0.0, None
        for g, s in zip(ins, scales):
            part, scratch = sumsq64(xp, g, scratch)
            total += s * s * part
        sumsq[...] = total


@register
class ClipScale(OpKernel):
    """[g_1 .. g_n, sumsq] -> [g_1@clip .. g_n@clip]: each g scaled to the
    clip norm when the norm exceeds it (n = 1 as graph/clip.py adds it;
    parallel/fuse.py's ``fuse_clip`` makes one op of a device's)."""

    op_type = "ClipScale"
    category = "update"

    @classmethod
    def infer(cls, attrs, ins):
        if len(ins) < 2:
            raise ShapeError(f"ClipScale needs gradients and the squared norm, got {len(ins)} "
                             f"input(s)")
        ss = ins[-1][0]
        if int(np.prod(ss, dtype=np.int64)) != 1:
            raise ShapeError(f"ClipScale's squared norm must be one value, got shape {list(ss)}")
        if not float(attrs.get("clip", 0)) > 0:
            raise ShapeError(f"ClipScale needs clip > 0, got {attrs.get('clip')!r}")
        return [(tuple(gs), gd) for gs, gd in ins[:-1]]

    def setup(self, ins, outs):
        """On a GPU, with several gradients: the table of one
        ``clip_scale_multi`` launch over every output (their addresses and
        sizes), where they are C-contiguous arrays of one dtype."""
        self._table = _multi_table(outs, lambda k: k.ClipScaleTable(list(outs))) \
            if len(outs) > 1 else None

    def run(self, ins, outs):
        sumsq = ins[-1]
        clip = float(self.attrs["clip"])
        carry(ins, outs)
        xp = get_xp(outs[0])
        k = raw_kernels(xp, *outs)
        table = getattr(self, "_table", None)
        if k is not None and table is not None and get_xp(sumsq) is xp and table.holds(outs):
            k.clip_scale_multi(table, sumsq, clip)   # one launch, the same bits
            return
        factor = None
        for out in outs:
            k = raw_kernels(xp, out)
            if k is not None and out.flags.c_contiguous and get_xp(sumsq) is xp:
                k.clip_scale(out, sumsq, clip)
                continue
            if factor is None:
                factor = clip_factor(sumsq.reshape(-1)[0], clip)
            if factor != 1.0:
                out *= out.dtype.type(factor)


def sumsq64(xp, g, scratch=None):
    """(||g||^2 accumulated in float64, the scratch used): each chunk of
    ``SUMSQ_CHUNK`` elements of g cast into a float64 scratch buffer (made
    when ``scratch`` is None; never a float64 copy of the whole of g) and
    dotted with itself, the chunks' sums added in order. A float32 square
    is exact in float64, so the sum is good to ~1e-16 relative, whatever
    the pieces g comes in."""
    flat = g.reshape(-1)
    total = 0.0
    if flat.dtype == np.float64:
        for a in range(0, flat.size, SUMSQ_CHUNK):
            c = flat[a:a + SUMSQ_CHUNK]
            total += float(xp.dot(c, c))
        return total, scratch
    if scratch is None:
        scratch = xp.empty(min(SUMSQ_CHUNK, max(flat.size, 1)), dtype=np.float64)
    elif scratch.size < min(SUMSQ_CHUNK, flat.size):
        scratch = xp.empty(min(SUMSQ_CHUNK, flat.size), dtype=np.float64)
    for a in range(0, flat.size, SUMSQ_CHUNK):
        c = scratch[:min(SUMSQ_CHUNK, flat.size - a)]
        c[...] = flat[a:a + SUMSQ_CHUNK]
        total += float(xp.dot(c, c))
    return total, scratch


def clip_factor(sumsq, clip):
    """min(1, clip / sqrt(sumsq)): the scale ClipScale applies."""
    norm = math.sqrt(float(sumsq))
    return clip / norm if norm > clip else 1.0
