"""Tensor plumbing: Concat / Slice (and ConcatGrad), Split (fan-out copies),
Eltwise (sum, prod, max), Reshape, Flatten and Scale.

Backward ops that need an input's shape (ConcatGrad, the backward Reshape)
take it from the forward graph, so gradients are built after shape inference
(as ``GradContext.grad_blob`` already requires).
"""
import numpy as np

from ..base.backend import get_xp
from ..base.errors import GraphError, ShapeError
from ..base.precision import is_bits
from ..gpu.raw import raw_kernels, widen
from .registry import OpKernel, gradient, register


def _norm_axis(axis, ndim):
    axis = int(axis)
    if not -ndim <= axis < ndim:
        raise ShapeError(f"axis {axis} is out of range for a {ndim}-d input")
    return axis % ndim


def _shape_of(g, blob):
    shape = g.graph.blobs[blob].shape
    if shape is None:
        raise GraphError(f"blob '{blob}' has no shape yet: infer shapes before "
                         "building the backward pass")
    return tuple(shape)


# ----------------------------------------------------------------- Concat
@register
class Concat(OpKernel):
    """[x_0, x_1, ...] -> [y]: y = concatenate(x_i, axis) (attr ``axis``, default 1).
    Gradient: dx_i = the i-th block of dy along ``axis`` (one ConcatGrad op)."""

    op_type = "Concat"
    category = "copy"

    @classmethod
    def infer(cls, attrs, ins):
        first = tuple(ins[0][0])
        axis = _norm_axis(attrs.get("axis", 1), len(first))
        total = 0
        for shape, _ in ins:
            shape = tuple(shape)
            if len(shape) != len(first) or shape[:axis] + shape[axis + 1:] != \
                    first[:axis] + first[axis + 1:]:
                raise ShapeError(f"Concat along axis {axis} needs inputs equal in every other "
                                 f"axis, got {[list(s) for s, _ in ins]}")
            total += shape[axis]
        return [(first[:axis] + (total,) + first[axis + 1:], ins[0][1])]

    def run(self, ins, outs):
        axis = _norm_axis(self.attrs.get("axis", 1), ins[0].ndim)
        get_xp(ins[0]).concatenate(ins, axis=axis, out=outs[0])


class _Blocks(OpKernel):
    """Shared by Slice and ConcatGrad: copy blocks of ``x`` along ``axis``
    (block sizes ``sizes``) into the outputs; ``which`` lists the block index
    of each output (default: every block, in order)."""

    category = "copy"

    @classmethod
    def _sizes(cls, attrs, shape, n_out):
        return [int(s) for s in attrs["sizes"]]

    @classmethod
    def infer(cls, attrs, ins):
        shape, dtype = tuple(ins[0][0]), ins[0][1]
        axis = _norm_axis(attrs.get("axis", 1), len(shape))
        sizes = cls._sizes(attrs, shape, attrs.get("n_outputs"))
        if sum(sizes) != shape[axis] or min(sizes) < 0:
            raise ShapeError(f"{cls.op_type}: blocks {sizes} do not tile axis {axis} "
                             f"of size {shape[axis]}")
        which = attrs.get("which", range(len(sizes)))
        return [(shape[:axis] + (sizes[i],) + shape[axis + 1:], dtype) for i in which]

    def run(self, ins, outs):
        x = ins[0]
        axis = _norm_axis(self.attrs.get("axis", 1), x.ndim)
        sizes = self._sizes(self.attrs, x.shape, len(outs))
        starts = np.concatenate([[0], np.cumsum(sizes)])
        which = self.attrs.get("which", range(len(sizes)))
        for out, i in zip(outs, which):
            index = (slice(None),) * axis + (slice(int(starts[i]), int(starts[i + 1])),)
            out[...] = x[index]


@register
class ConcatGrad(_Blocks):
    """[dy] -> [dx_i for i in which]: the blocks of dy along ``axis`` (attrs
    ``axis``, ``sizes`` = every forward input's size along axis, ``which``)."""

    op_type = "ConcatGrad"


@register
class Slice(_Blocks):
    """[x] -> [y_0, ..., y_{k-1}]: Caffe's Slice. Attr ``axis`` (default 1) and
    ``slice_point`` (k-1 increasing cut indices), or without it k equal parts
    (the number of outputs ``n_outputs`` must then be set for inference).
    Gradient: dx = concatenate(dy_i) (zeros for outputs without a gradient)."""

    op_type = "Slice"

    @classmethod
    def _sizes(cls, attrs, shape, n_out):
        axis = _norm_axis(attrs.get("axis", 1), len(shape))
        points = attrs.get("slice_point")
        if points:
            cuts = [0] + [int(p) for p in points] + [shape[axis]]
            return [b - a for a, b in zip(cuts, cuts[1:])]
        n_out = int(n_out or attrs.get("n_outputs") or 0)
        if n_out < 1 or shape[axis] % n_out:
            raise ShapeError(f"Slice without slice_point splits axis {axis} (size "
                             f"{shape[axis]}) into n_outputs={n_out} equal parts; it must divide")
        return [shape[axis] // n_out] * n_out


@gradient("Concat")
def _concat_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    axis = op.attrs.get("axis", 1)
    shapes = [_shape_of(g, x) for x in op.inputs]
    axis = _norm_axis(axis, len(shapes[0]))
    which = [i for i, x in enumerate(op.inputs) if g.needs_grad(x)]
    if dy is None or not which:
        return
    # an input listed twice gets one contribution per occurrence
    outs = [g.grad_blob(op.inputs[i]) for i in which]
    g.emit("ConcatGrad", [dy], outs,
           {"axis": axis, "sizes": [s[axis] for s in shapes], "which": which})


@gradient("Slice")
def _slice_grad(g, op):
    x = op.inputs[0]
    if not g.needs_grad(x):
        return
    dys = []
    for y in op.outputs:
        dy = g.grad_of(y)
        if dy is None:  # a block without gradient contributes zeros
            dy = g.temp_blob(f"zero_{y}", _shape_of(g, y), g.graph.blobs[y].dtype)
            g.emit("Constant", [], [dy], {"value": 0.0, "shape": list(_shape_of(g, y)),
                                          "dtype": g.graph.blobs[y].dtype}, tag=f"zero_{y}")
        dys.append(dy)
    g.emit("Concat", dys, [g.grad_blob(x)], {"axis": op.attrs.get("axis", 1)})


# ------------------------------------------------------------------ Split
@register
class Split(OpKernel):
    """[x] -> [y_0, ..., y_{k-1}]: each y_i = x (a copy; Caffe's Split for a blob
    read by several layers).  Gradient: dx = sum of the dy_i that exist."""

    op_type = "Split"
    category = "copy"

    @classmethod
    def infer(cls, attrs, ins):
        n = int(attrs.get("n_outputs", 0)) or None
        if n is None:
            raise ShapeError("Split needs attr n_outputs (the number of copies)")
        return [ins[0]] * n

    def run(self, ins, outs):
        for out in outs:
            out[...] = ins[0]


@gradient("Split")
def _split_grad(g, op):
    x = op.inputs[0]
    dys = [d for d in (g.grad_of(y) for y in op.outputs) if d is not None]
    if not dys or not g.needs_grad(x):
        return
    g.emit("Sum" if len(dys) > 1 else "Copy", dys, [g.grad_blob(x)])


# ---------------------------------------------------------------- Eltwise
_ELTWISE_OPS = ("sum", "prod", "max")


def _eltwise_attrs(attrs, n_inputs):
    operation = str(attrs.get("operation", "sum")).lower()
    if operation not in _ELTWISE_OPS:
        raise ShapeError(f"Eltwise operation must be one of {', '.join(_ELTWISE_OPS)}, "
                         f"got {operation!r}")
    coeff = attrs.get("coeff")
    if coeff is not None and len(coeff) > 0:
        if operation != "sum":
            raise ShapeError("Eltwise coeff applies to operation 'sum' only (as in Caffe)")
        if len(coeff) != n_inputs:
            raise ShapeError(f"Eltwise has {n_inputs} inputs but {len(coeff)} coeffs")
        coeff = [float(c) for c in coeff]
    else:
        coeff = [1.0] * n_inputs
    return operation, coeff


@register
class Eltwise(OpKernel):
    """[x_0, x_1, ...] -> [y], inputs of one shape; attr ``operation``:
    sum:  y = sum_i coeff_i * x_i  (attr ``coeff``, default all 1)
    prod: y = prod_i x_i
    max:  y = max_i x_i
    Gradient (one EltwiseGrad per input i): sum: dx_i = coeff_i * dy;
    prod: dx_i = dy * prod_{j != i} x_j; max: dx_i = dy where x_i is the
    maximum (on ties, only the lowest i), else 0.

    A sum takes its first two inputs stored as bfloat16 bits too
    (``bits_inputs``, bf16 storage: the residual add of an fc output with a
    bias), y float32: a sum of two, coefficients 1, one of them bits, the
    arrays C-contiguous and the other float32, is one kernel on a GPU
    (``add_bits``: the float32 addition of the widened values); otherwise
    (and for a prod or max run on bits directly) each bits input is widened
    exactly into a float32 temporary first. The float32 storage's result
    from the same values, bit for bit."""

    op_type = "Eltwise"

    @classmethod
    def infer(cls, attrs, ins):
        shapes = [tuple(s) for s, _ in ins]
        if len(set(shapes)) != 1:
            raise ShapeError(f"Eltwise needs inputs of one shape, got {[list(s) for s in shapes]}")
        _eltwise_attrs(attrs, len(ins))
        floats = [d for _, d in ins if not is_bits(d)]
        return [(ins[0][0], floats[0] if floats else np.float32)]

    @classmethod
    def bits_inputs(cls, attrs):
        return (0, 1) if str(attrs.get("operation", "sum")).lower() == "sum" else ()

    def _adds_bits(self, ins, y):
        """(float32 term, bits term) when a sum runs as one ``add_bits``
        kernel on a device (two inputs, one of them bits, coefficients 1,
        the other and y float32, all C-contiguous: a host array, plan's
        stand-in of a blob, counts as contiguous, as the blobs are), else
        None."""
        operation, coeff = _eltwise_attrs(self.attrs, len(ins))
        bits = [i for i, x in enumerate(ins) if is_bits(x)]
        if operation != "sum" or len(ins) != 2 or len(bits) != 1 or coeff != [1.0, 1.0]:
            return None
        a, b = ins[1 - bits[0]], ins[bits[0]]   # an addition commutes exactly
        if any(np.dtype(v.dtype) != np.float32 for v in (a, y)) or \
                not all(get_xp(v) is np or v.flags.c_contiguous for v in (a, b, y)):
            return None   # add_bits takes C-contiguous float32 arrays alone; else widened
        return a, b

    def scratch_specs(self, ins, outs):
        """On a device the general path's temporaries (``host_temporaries``':
        the result, the scaled term, the widened bits terms); none for the
        one ``add_bits`` kernel."""
        return [] if self._adds_bits(ins, outs[0]) else self.host_temporaries(ins, outs)

    def setup(self, ins, outs):
        self.reserve_temporaries(ins[0], *self.scratch_specs(ins, outs))

    def run(self, ins, outs):
        xp = get_xp(ins[0])
        operation, coeff = _eltwise_attrs(self.attrs, len(ins))
        y = outs[0]
        bits = [i for i, x in enumerate(ins) if is_bits(x)]
        pair = self._adds_bits(ins, y) if xp is not np else None
        if pair is not None:   # float32 on a device: the raw kernels
            raw_kernels(xp, pair[0], y).add_bits(*pair, y)
            return
        acc, *term = self.temporaries(y, *self.host_temporaries(ins, outs))
        if bits:   # each widened exactly into its temporary (the last ones)
            wide, term = term[len(term) - len(bits):], term[:len(term) - len(bits)]
            ins = list(ins)
            for i, w in zip(bits, wide):   # (a strided term on a GPU: through a copy)
                ins[i] = widen(ins[i], w)
        if operation == "sum" and coeff[0] != 1.0:
            xp.multiply(ins[0], coeff[0], out=acc)
        else:
            xp.copyto(acc, ins[0])
        for x, c in zip(ins[1:], coeff[1:]):
            if operation == "sum":
                if c != 1.0:
                    x = xp.multiply(x, c, out=term[0])
                acc += x
            elif operation == "prod":
                acc *= x
            else:
                xp.maximum(acc, x, out=acc)
        xp.copyto(y, acc)

    def host_temporaries(self, ins, outs):
        """The result is built in a temporary, so y may share an input's
        storage; temporaries, not new arrays, so a CUDA graph captures it
        (and a second for coeff_i * x_i where a coefficient is not 1, and a
        float32 copy of each input stored as bits)."""
        operation, coeff = _eltwise_attrs(self.attrs, len(ins))
        scaled = operation == "sum" and any(c != 1.0 for c in coeff[1:])
        widened = sum(1 for x in ins if is_bits(x))   # a float32 copy of each bits input
        return [(outs[0].shape, outs[0].dtype)] * (1 + scaled) + \
            [(outs[0].shape, np.float32)] * widened


@register
class EltwiseGrad(OpKernel):
    """[dy] (sum) or [dy, x_0, x_1, ...] (prod, max) -> [dx_index]; attrs
    ``operation``, ``coeff``, ``index`` (which input's gradient)."""

    op_type = "EltwiseGrad"

    @classmethod
    def infer(cls, attrs, ins):
        return [ins[0]]

    def run(self, ins, outs):
        xp = get_xp(ins[0])
        dy, xs, dx = ins[0], ins[1:], outs[0]
        operation = str(self.attrs.get("operation", "sum")).lower()
        index = int(self.attrs["index"])
        if operation == "sum":
            coeff = self.attrs.get("coeff") or None
            c = float(coeff[index]) if coeff else 1.0
            xp.multiply(dy, c, out=dx)
        elif operation == "prod":
            (acc,) = self.temporaries(dy, *self.host_temporaries(ins, outs))  # dx may share an input
            xp.copyto(acc, dy)
            for j, x in enumerate(xs):
                if j != index:  # the product of the others: no division by x_i, so 0 is safe
                    acc *= x
            xp.copyto(dx, acc)
        else:
            # x_index wins where it beats every earlier input strictly and
            # equals-or-beats every later one: ties go to the lowest index
            win, beats = self.temporaries(dy, *self.host_temporaries(ins, outs))
            win.fill(True)
            for j, x in enumerate(xs):
                if j != index:
                    (xp.greater if j < index else xp.greater_equal)(xs[index], x, out=beats)
                    win &= beats
            xp.multiply(dy, win, out=dx)

    def host_temporaries(self, ins, outs):
        """sum: none; prod: the product of the others; max: two masks."""
        operation = str(self.attrs.get("operation", "sum")).lower()
        dy = ins[0]
        if operation == "sum":
            return []
        if operation == "prod":
            return [(dy.shape, dy.dtype)]
        return [(dy.shape, np.bool_)] * 2


@gradient("Eltwise")
def _eltwise_grad(g, op):
    """One EltwiseGrad per input that needs a gradient, but for a sum's
    input of coefficient exactly 1 (or none given): its gradient is dy, bit
    for bit (1 * dy), so dy itself is its contribution (``GradContext.
    share``: no copy, no blob of its own; a residual add's two gradients
    are the one blob its consumers read). Kept as a copy where sharing is
    not sound (``GradContext.shareable``): an input that is a parameter
    (its gradient ``<param>.grad`` is what the buckets reduce, clipping,
    loss-scale unscaling and the micro-batch running sums write in place,
    the solver reads), or a dy placed elsewhere than the Eltwise. Any other
    coefficient keeps its EltwiseGrad (coeff_i * dy rounds)."""
    dy = g.grad_of(op.outputs[0])
    if dy is None:
        return
    operation, coeff = _eltwise_attrs(op.attrs, len(op.inputs))
    ins = [dy] if operation == "sum" else [dy] + list(op.inputs)
    for i, x in enumerate(op.inputs):
        if not g.needs_grad(x):
            continue
        if operation == "sum" and coeff[i] == 1.0 and g.shareable(x, dy):
            g.share(x, dy)
            continue
        g.emit("EltwiseGrad", ins, [g.grad_blob(x)],
               {"operation": operation, "coeff": coeff, "index": i}, tag=f"eltwise_grad{i}")


# -------------------------------------------------------- Reshape, Flatten
def _reshape_target(spec, shape):
    """Caffe's ReshapeParameter: 0 copies the input's dim at that index, -1
    (at most once) is inferred from the element count."""
    spec = [int(d) for d in spec]
    out = []
    for i, d in enumerate(spec):
        if d == 0:
            if i >= len(shape):
                raise ShapeError(f"reshape {spec}: 0 at index {i} copies a dim the "
                                 f"{len(shape)}-d input does not have")
            out.append(shape[i])
        elif d == -1 or d > 0:
            out.append(d)
        else:
            raise ShapeError(f"reshape {spec}: dims must be > 0, 0 (copy) or -1 (infer)")
    count = int(np.prod(shape, dtype=np.int64))
    if out.count(-1) > 1:
        raise ShapeError(f"reshape {spec}: at most one dim may be -1")
    if -1 in out:
        known = int(np.prod([d for d in out if d != -1], dtype=np.int64))
        if known == 0 or count % known:
            raise ShapeError(f"reshape {spec}: cannot infer the -1 dim of an input "
                             f"{list(shape)} of {count} elements")
        out[out.index(-1)] = count // known
    if int(np.prod(out, dtype=np.int64)) != count:
        raise ShapeError(f"cannot reshape {list(shape)} ({count} elements) to {out}")
    return tuple(out)


class _Reshape(OpKernel):
    category = "copy"

    def run(self, ins, outs):
        outs[0][...] = ins[0].reshape(outs[0].shape)


def _reshape_back(g, op):
    x = op.inputs[0]
    dy = g.grad_of(op.outputs[0])
    if dy is not None and g.needs_grad(x):
        g.emit("Reshape", [dy], [g.grad_blob(x)], {"shape": list(_shape_of(g, x))})


@register
class Reshape(_Reshape):
    """[x] -> [y]: y = x reshaped to attr ``shape`` (Caffe: 0 copies the input
    dim, -1 is inferred).  Gradient: dx = dy reshaped to x's shape."""

    op_type = "Reshape"

    @classmethod
    def infer(cls, attrs, ins):
        if "shape" not in attrs:
            raise ShapeError("Reshape needs attr shape (e.g. [0, -1])")
        return [(_reshape_target(attrs["shape"], tuple(ins[0][0])), ins[0][1])]


@register
class Flatten(_Reshape):
    """[x] -> [y]: y = x reshaped to (N, -1); more generally the axes from
    ``axis`` (default 1) to the end are merged.  Gradient: reshape back."""

    op_type = "Flatten"

    @classmethod
    def infer(cls, attrs, ins):
        shape = tuple(ins[0][0])
        axis = _norm_axis(attrs.get("axis", 1), len(shape))
        rest = int(np.prod(shape[axis:], dtype=np.int64))
        return [(shape[:axis] + (rest,), ins[0][1])]


gradient("Reshape")(_reshape_back)
gradient("Flatten")(_reshape_back)


# ------------------------------------------------------------------ Scale
@register
class Scale(OpKernel):
    """[x] -> [y]: y = scale * x (attr ``scale``, a constant).
    Gradient: dx = scale * dy (another Scale op)."""

    op_type = "Scale"

    @classmethod
    def infer(cls, attrs, ins):
        if "scale" not in attrs:
            raise ShapeError("Scale needs attr scale (a number)")
        return [ins[0]]

    def run(self, ins, outs):
        get_xp(ins[0]).multiply(ins[0], float(self.attrs["scale"]), out=outs[0])


@gradient("Scale")
def _scale_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    if dy is not None and g.needs_grad(op.inputs[0]):
        g.emit("Scale", [dy], [g.grad_blob(op.inputs[0])], {"scale": op.attrs["scale"]})
