"""Element-wise activations: Relu (leaky), Sigmoid, Tanh, Gelu, and their gradients.

The backward ops read what the formula needs most cheaply: ReLU's gradient
needs the sign of its input ``x``, which its output ``y`` has too for a
slope >= 0; sigmoid's and tanh's are functions of ``y``. So all of them read
``y`` (a leaky ReLU with a negative slope reads ``x``), and ``x`` can be
freed right after the forward. GELU's gradient is no function of ``y``
alone: it reads ``x``.
"""
import math

import numpy as np

from ..base.backend import get_xp
from ..base.errors import ShapeError
from ..base.precision import BITS, from_bf16_bits, is_bits, to_bf16_bits, value_dtype, wire_scratch
from ..gpu.raw import KERNEL_DTYPES, column_scratch, float_kernels, last_axis_rows, raw_kernels
from .registry import OpKernel, gradient, out_dtype, register, spans


def relu(xp, x, slope, out):
    """out = max(x, 0) (slope 0) or where(x > 0, x, slope * x), as the Relu op
    and the producers a ReLU is fused into (``relu`` attr) compute it on the CPU."""
    if slope == 0.0:
        xp.maximum(x, 0, out=out)
    else:
        out[...] = xp.where(x > 0, x, x * slope)


def _same_shape(op_type, ins):
    shapes = [tuple(s) for s, _ in ins]
    if len(set(shapes)) != 1:
        raise ShapeError(f"{op_type} needs inputs of one shape, got {shapes}")
    return [ins[0]]


@register
class Relu(OpKernel):
    """y = max(x, 0) + negative_slope * min(x, 0)  (Caffe's leaky ReLU;
    attr ``negative_slope``, default 0).
    Gradient: dx = dy * (1 if x > 0 else negative_slope)."""

    op_type = "Relu"
    in_place = ((0, 0),)

    @classmethod
    def infer(cls, attrs, ins):
        return [ins[0]]

    def run(self, ins, outs):
        xp = get_xp(ins[0])
        x, slope = ins[0], float(self.attrs.get("negative_slope", 0.0))
        k = raw_kernels(xp, x)
        if k is not None:  # one kernel (CuPy's maximum is one too, but allocates a scalar)
            k.relu_forward(x, slope, out=outs[0])
            return
        relu(xp, x, slope, outs[0])


@register
class ReluGrad(OpKernel):
    """[dy, x] -> [dx]: dx = dy * (1 if x > 0 else negative_slope). ``x`` is
    the ReLU's output (y > 0 exactly where x > 0 for a slope >= 0), or its
    input for a negative slope.
    On a GPU one kernel (CuPy: a comparison, a temporary and a multiply)."""

    op_type = "ReluGrad"
    in_place = ((0, 0),)  # dx over dy

    @classmethod
    def infer(cls, attrs, ins):
        return _same_shape(cls.op_type, ins)

    def run(self, ins, outs):
        relu_backward(ins[0], ins[1], float(self.attrs.get("negative_slope", 0.0)), outs[0])

    def host_temporaries(self, ins, outs):
        """``relu_backward``'s NumPy temporaries: the mask ``x > 0``, and
        with a slope ``dy * slope`` and ``where``'s result."""
        dy = ins[0]
        mask = [(dy.shape, np.bool_)]
        if float(self.attrs.get("negative_slope", 0.0)) == 0.0:
            return mask
        return mask + [(dy.shape, dy.dtype)] * 2


def relu_backward(dy, x, slope, out):
    """out = dy * (1 if x > 0 else slope); ``out`` may be ``dy`` (ReluGrad,
    and the ReLU mask fused into a convolution's data gradient)."""
    xp = get_xp(dy)
    k = raw_kernels(xp, dy, x)
    if k is not None:
        k.relu_backward(dy, x, slope, out=out)
    elif slope == 0.0:
        xp.multiply(dy, x > 0, out=out)
    else:
        out[...] = xp.where(x > 0, dy, dy * slope)


@gradient("Relu")
def _relu_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    if dy is not None and g.needs_grad(op.inputs[0]):
        slope = float(op.attrs.get("negative_slope", 0.0))
        # y > 0 exactly where x > 0 for a slope >= 0 (NaN and -0.0 too): the
        # gradient reads y, so x is free after the forward (the memory plan
        # may even compute y over x's bytes)
        sign = op.outputs[0] if slope >= 0.0 else op.inputs[0]
        g.emit("ReluGrad", [dy, sign], [g.grad_blob(op.inputs[0])],
               {"negative_slope": op.attrs.get("negative_slope", 0.0)})


@register
class Sigmoid(OpKernel):
    """y = 1 / (1 + exp(-x)).  Gradient: dx = dy * y * (1 - y)."""

    op_type = "Sigmoid"

    @classmethod
    def infer(cls, attrs, ins):
        return [ins[0]]

    def run(self, ins, outs):
        xp = get_xp(ins[0])
        # the tanh form never overflows (exp(-x) does for very negative x)
        y = outs[0]
        xp.multiply(ins[0], 0.5, out=y)
        xp.tanh(y, out=y)
        y += 1
        y *= 0.5


class _OutputGrad(OpKernel):
    """[dy, y] -> [dx]: the gradient of an elementwise op from its output y
    (Sigmoid's, Tanh's), all three of one shape; its run takes one temporary
    of ``dy``'s shape (``temporary``)."""

    @classmethod
    def infer(cls, attrs, ins):
        return _same_shape(cls.op_type, ins)

    def host_temporaries(self, ins, outs):
        return [(ins[0].shape, ins[0].dtype)]

    def temporary(self, ins, outs):
        """The temporary, capturable (``temporaries``)."""
        (t,) = self.temporaries(ins[0], *self.host_temporaries(ins, outs))
        return t


def _output_gradient(op_type, grad_type):
    """Register the gradient of ``op_type`` (y = f(x)): ``grad_type``
    [dy, y] -> [dx] (an ``_OutputGrad``)."""
    @gradient(op_type)
    def _grad(g, op):
        dy = g.grad_of(op.outputs[0])
        if dy is not None and g.needs_grad(op.inputs[0]):
            g.emit(grad_type, [dy, op.outputs[0]], [g.grad_blob(op.inputs[0])])


@register
class SigmoidGrad(_OutputGrad):
    """[dy, y] -> [dx]: dx = dy * y * (1 - y)."""

    op_type = "SigmoidGrad"

    def run(self, ins, outs):
        dy, y = ins
        xp, dx = get_xp(dy), outs[0]
        t = self.temporary(ins, outs)
        xp.subtract(1, y, out=t)
        xp.multiply(dy, y, out=dx)
        dx *= t


_output_gradient("Sigmoid", "SigmoidGrad")


@register
class Tanh(OpKernel):
    """y = tanh(x).  Gradient: dx = dy * (1 - y^2)."""

    op_type = "Tanh"

    @classmethod
    def infer(cls, attrs, ins):
        return [ins[0]]

    def run(self, ins, outs):
        get_xp(ins[0]).tanh(ins[0], out=outs[0])


@register
class TanhGrad(_OutputGrad):
    """[dy, y] -> [dx]: dx = dy * (1 - y^2)."""

    op_type = "TanhGrad"

    def run(self, ins, outs):
        dy, y = ins
        xp = get_xp(dy)
        t = self.temporary(ins, outs)
        xp.multiply(y, y, out=t)
        xp.subtract(1, t, out=t)
        xp.multiply(dy, t, out=outs[0])


_output_gradient("Tanh", "TanhGrad")


_SQRT_2_OVER_PI = 0.7978845608028654   # sqrt(2 / pi)
_INV_SQRT_2PI = 0.3989422804014327     # 1 / sqrt(2 pi)
_GELU_C = 0.044715


def _erf(xp, x, out):
    """out = erf(x): SciPy's (CuPy's on a GPU) where installed, else
    Python's math.erf element by element (exact too, slower)."""
    if xp is not np:
        from cupyx.scipy.special import erf
        erf(x, out=out)
        return
    try:
        from scipy.special import erf
    except ImportError:
        out[...] = _math_erf(x)
        return
    erf(x, out=out)


_math_erf = np.frompyfunc(math.erf, 1, 1)

#: erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z / 2), z >= 0: the Chebyshev
#: fit of Numerical Recipes' erfcc, fractional error < 1.2e-7 (abs. error of
#: erf < 1e-7, below float32's resolution of values near 1); P's
#: coefficients from t^9 down to t^0
_ERFC_P = (0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806,
           0.09678418, 0.37409196, 1.00002368, -1.26551223)


def _normal_cdf_f32(x, out, z, acc):
    """out = Phi(x) for a float32 host array in about twenty vectorised passes
    (SciPy's erf takes ~25 times a multiply per element): Phi(x) = 0.5 +
    sign(x) (0.5 - erfc(|x| / sqrt 2) / 2), erfc from ``_ERFC_P``.
    ``z``, ``acc``: temporaries of x's shape."""
    np.abs(x, out=z)
    z *= 1 / math.sqrt(2)
    np.multiply(z, 0.5, out=out)
    out += 1
    np.reciprocal(out, out=out)               # t
    acc.fill(_ERFC_P[0])
    for c in _ERFC_P[1:]:
        acc *= out
        acc += c
    z *= z
    acc -= z
    np.exp(acc, out=acc)
    out *= acc
    np.multiply(out, -0.5, out=out)           # -erfc / 2
    out += 0.5
    np.copysign(out, x, out=out)
    out += 0.5


def _gelu_factor(xp, x, approximate, t, d=None, e=None, f=None):
    """t = the factor y / x: Phi(x) (exact) or 0.5 (1 + tanh(u)) with
    u = sqrt(2/pi) (x + 0.044715 x^3) (tanh). With ``d`` also d = dy/dx:
    Phi(x) + x phi(x), or 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) u'.
    ``e``, ``f``: temporaries (float32 on the host: Phi by
    ``_normal_cdf_f32``; else erf, exact)."""
    if approximate == "tanh":
        xp.multiply(x, x, out=t)
        if d is not None:  # d = u' = sqrt(2/pi) (1 + 3c x^2), before t is overwritten
            xp.multiply(t, 3 * _GELU_C * _SQRT_2_OVER_PI, out=d)
            d += _SQRT_2_OVER_PI
        t *= _GELU_C
        t += 1
        t *= x
        t *= _SQRT_2_OVER_PI
        xp.tanh(t, out=t)                      # t = tanh(u)
        if d is not None:
            xp.multiply(t, t, out=e)
            xp.subtract(1, e, out=e)           # e = 1 - tanh^2
            d *= e
            d *= x
        t += 1
        t *= 0.5                               # t = 0.5 (1 + tanh u)
        if d is not None:
            d *= 0.5
            d += t
        return
    if xp is np and x.dtype == np.float32 and e is not None:
        _normal_cdf_f32(x, t, e, f)
    else:
        xp.multiply(x, 1 / math.sqrt(2), out=t)
        _erf(xp, t, t)
        t += 1
        t *= 0.5                               # t = Phi(x)
    if d is not None:                          # d = Phi(x) + x phi(x)
        xp.multiply(x, x, out=d)
        d *= -0.5
        xp.exp(d, out=d)
        d *= _INV_SQRT_2PI
        d *= x
        d += t


#: a host Gelu or GeluGrad evaluates this many elements at a time: its
#: ~15 passes (20-odd for the exact form) then go over temporaries of 128
#: KiB each, which stay in the core's L2 cache, instead of arrays of the
#: whole input's size streamed through memory on every pass (gpt_tiny's
#: (32, 128, 512): 8 MiB each; its GeluGrad ran ~1.8x faster in chunks).
#: Element-wise throughout, so the values are the whole array's
HOST_CHUNK = 1 << 15


def _gelu_host_specs(x, count):
    """``count`` flat temporaries of a host chunk (``HOST_CHUNK``) of ``x``
    (float32 for an ``x`` stored as bfloat16 bits)."""
    return [((min(int(x.size), HOST_CHUNK),), value_dtype(x))] * count


def _approximate(attrs):
    a = attrs.get("approximate", "none")
    if a not in ("none", "tanh"):
        raise ShapeError(f"Gelu: approximate must be none or tanh, got {a!r}")
    return a


def _fused_gelu(*arrays):
    """Whether a GPU Gelu / GeluGrad of these inputs runs cuda/activation.cu's
    one kernel (float32 or float64: ``raw_kernels``' dtypes, or an x stored
    as bfloat16 bits), which takes no scratch; other dtypes on a GPU run
    ``_gelu_factor``'s CuPy chain over full-size temporaries."""
    return all(np.dtype(a.dtype) in KERNEL_DTYPES or is_bits(a) for a in arrays)


def _host_x(flat, s, wide):
    """The host chunk ``s`` of the flat x: as it is, or where x is bfloat16
    bits its float32 values widened (exactly) into ``wide``."""
    if not is_bits(flat):
        return flat[s]
    return from_bf16_bits(flat[s], wide[:s.stop - s.start])


def _rounds_own(kernel, out):
    """(0,) where the GELU kernel writes ``out`` on a GPU and rounds it to
    the precision pass's ``round_dtype`` itself, in the same pass (a float32
    output: ``OpKernel.rounds_own_outputs``); () elsewhere (the host, the
    CuPy chain, float64), where ``round_low`` rounds it."""
    if (kernel.round_dtype is not None and np.dtype(out.dtype) == np.float32
            and get_xp(out) is not np):
        return (0,)
    return ()


def _own_rounding(kernel, ins, outs):
    """The ``round_to`` of the GELU kernel's launch: ``round_dtype`` where
    ``rounds_own_outputs`` says the run rounds y (dx) itself, else None."""
    return kernel.round_dtype if kernel.rounds_own_outputs(ins, outs) else None


@register
class Gelu(OpKernel):
    """y = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)) (attr ``approximate``:
    none, the default; float32 on the host evaluates Phi to within 1e-7,
    ``_normal_cdf_f32``), or 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    (``tanh``), PyTorch's two forms.
    Gradient: dx = dy (Phi(x) + x phi(x)), phi the standard normal density;
    for tanh: dx = dy (0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) u'),
    u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2). The gradient reads x.
    On a GPU one kernel (cuda/activation.cu ``gelu_forward``), no scratch,
    rounding y itself in a bf16/fp16 run (``rounds_own_outputs``).

    y stored as bfloat16 bits (attr ``bits_out: [0]``, bf16 storage:
    parallel/precision.store_bits): the bits of the bfloat16 nearest each
    float32 y, on a GPU in the same kernel (``gelu_forward_bits_f32``), on
    the host a chunk at a time -- the bits of a float32 y and a Cast.
    x may be stored as bfloat16 bits (``bits_inputs``: the fc output it
    reads, bf16 storage), widened exactly where it is read -- in the kernel
    on a GPU (``gelu_forward_bx_f32``, ``gelu_forward_bx_bits_f32``), a chunk
    at a time on the host: the float32 x's y bit for bit."""

    op_type = "Gelu"
    in_place = ((0, 0),)  # y = x * t, t computed from x first

    @classmethod
    def bits_inputs(cls, attrs):
        return (0,)

    @classmethod
    def bits_outputs(cls, attrs):
        return (0,)

    def scratch_specs(self, ins, outs):
        if _fused_gelu(ins[0]):
            return []
        return [(ins[0].shape, ins[0].dtype)] * 3

    def setup(self, ins, outs):
        self.reserve_temporaries(ins[0], *self.scratch_specs(ins, outs))

    @classmethod
    def infer(cls, attrs, ins):
        _approximate(attrs)
        return [(ins[0][0], out_dtype(attrs, ins[0][1]))]

    def host_temporaries(self, ins, outs):
        """A chunk's t, e, f; for a bits y a chunk's float32 y and
        to_bf16_bits's scratch; for a bits x a chunk's float32 x."""
        x = ins[0]
        n = min(int(x.size), HOST_CHUNK)
        specs = _gelu_host_specs(x, 3)
        if is_bits(outs[0]):
            specs += [((n,), np.float32), (wire_scratch(n).shape, np.uint32)]
        if is_bits(x):
            specs += [((n,), np.float32)]
        return specs

    def rounds_own_outputs(self, ins, outs):
        return _rounds_own(self, outs[0]) if _fused_gelu(ins[0]) else ()

    def run(self, ins, outs):
        x = ins[0]
        xp = get_xp(x)
        approximate = _approximate(self.attrs)
        k = float_kernels(xp, x, outs[0])
        bits = is_bits(outs[0])
        if k is not None and bits:
            k.gelu_forward_bits(x, approximate, outs[0])
            return
        if k is not None:
            k.gelu_forward(x, approximate, out=outs[0],
                           round_to=_own_rounding(self, ins, outs))
            return
        if xp is not np:
            if bits or is_bits(x):
                raise TypeError(f"Gelu: bfloat16 bits take a float32 x or y, got {x.dtype} "
                                f"and {outs[0].dtype}")
            t, e, f = self.temporaries(x, *self.scratch_specs(ins, outs))
            _gelu_factor(xp, x, approximate, t, e=e, f=f)
            xp.multiply(x, t, out=outs[0])
            return
        flat, y = x.reshape(-1), outs[0].reshape(-1)   # y may be x (in place)
        temps = self.temporaries(x, *self.host_temporaries(ins, outs))
        for s in spans(flat.size, HOST_CHUNK):
            t, e, f = (a[:s.stop - s.start] for a in temps[:3])
            xs = _host_x(flat, s, temps[-1])   # x's chunk read before y's is written
            _gelu_factor(xp, xs, approximate, t, e=e, f=f)
            if not bits:
                np.multiply(xs, t, out=y[s])
                continue
            wide = temps[3][:s.stop - s.start]
            np.multiply(xs, t, out=wide)
            to_bf16_bits(wide, y[s], temps[4])


@register
class GeluGrad(OpKernel):
    """[dy, x] -> [dx]: dx = dy * dGelu/dx (attr ``approximate``). On a GPU
    one kernel (cuda/activation.cu ``gelu_backward``), as Gelu's. x may be
    stored as bfloat16 bits (``bits_inputs``; ``gelu_backward_bx_f32``), as
    Gelu's x; dy and dx are float32 then. dy may be stored as bits too (the
    projection's data gradient, bf16 storage; ``gelu_backward_bdy_f32``,
    ``gelu_backward_bdy_bx_f32``; the host widens a chunk at a time): dx is
    float32, the float32 dy's bit for bit (not on dy's bytes: 4 bytes an
    element against 2).

    With attr ``bits_copy: [0]`` (bf16 storage, parallel/precision.
    fold_copies: dx read by a float32 reader, the fc bias gradient, and by
    products that take bits) a second output, dx's bfloat16 bits (uint16,
    the bits a Cast of dx wrote), in the same pass on a GPU (the ``_copy``
    kernels), a chunk at a time on the host (``to_bf16_bits`` of the float32
    chunk): no Cast, no second read of dx. The copy may take the bytes of a
    dy or an x stored as bits (``in_place`` (0, 1), (1, 1): 2 bytes an
    element each, each element read before its copy is written): where they
    die at this op the memory plan puts it there, as the Cast's copy came
    after them (GPT: dx's bits on the projection's data gradient's).

    With attr ``bias_grad: true`` (parallel/fuse.fold_gelu_bias_grads,
    opted in by ``PURINE_GELU_BIAS_GRAD=1``: the fc feeding GELU, whose
    bias gradient summed this dx) a last output, db = dx summed over every
    axis but the last (float32): on a GPU in the same pass
    (``kernels.gelu_backward_bias_grad``, the column sums of the
    ``InnerProductGradBias`` it replaces bit for bit, with its scratch), on
    the host ``InnerProductGradBias``'s sum of dx: db and dx keep their
    bits; dx is no longer read again."""

    op_type = "GeluGrad"
    # dx over dy; dx's bits copy (bits_copy) over a dy or an x stored as bits
    in_place = ((0, 0), (0, 1), (1, 1))

    @classmethod
    def bits_inputs(cls, attrs):
        return (0, 1)

    @classmethod
    def bits_copies(cls, attrs):
        return (0,)

    def scratch_specs(self, ins, outs):
        """The CuPy chain's four temporaries (dtypes without the kernel);
        with ``bias_grad`` last the column sums' partial sums (``column_scratch``
        of dx, as ``InnerProductGradBias``'s)."""
        specs = [] if _fused_gelu(*ins) else [(ins[1].shape, ins[1].dtype)] * 4
        if self.attrs.get("bias_grad"):
            specs += column_scratch(outs[0])
        return specs

    def setup(self, ins, outs):
        self.reserve_temporaries(ins[1], *self.scratch_specs(ins, outs))

    @classmethod
    def infer(cls, attrs, ins):
        ((shape, dtype),) = _same_shape(cls.op_type, ins)
        copy = list(attrs.get("bits_copy", ()))
        if copy not in ([], [0]) or (copy and value_dtype(dtype) != np.float32):
            raise ShapeError(f"GeluGrad: bits_copy takes [0] of a float32 dx, got {copy} "
                             f"({value_dtype(dtype)})")
        # a bits dy: float32 dx; bias_grad: db last, dx's dtype
        db = [((shape[-1],), value_dtype(dtype))] if attrs.get("bias_grad") else []
        return [(shape, value_dtype(dtype))] + [(shape, BITS)] * len(copy) + db

    def host_temporaries(self, ins, outs):
        """A chunk's t, d, e, f; for a bits x a chunk's float32 x; for a
        bits dy a chunk's float32 dy; for a bits copy of dx to_bf16_bits's
        scratch."""
        dy, x = ins
        n = min(int(x.size), HOST_CHUNK)
        wide = is_bits(dy) or is_bits(x)
        specs = [((n,), np.float32 if wide else x.dtype)] * 4
        specs += [((n,), np.float32) for a in (x, dy) if is_bits(a)]
        if "bits_copy" in self.attrs and self.attrs["bits_copy"]:
            specs.append((wire_scratch(n).shape, np.uint32))
        return specs

    def rounds_own_outputs(self, ins, outs):
        return _rounds_own(self, outs[0]) if _fused_gelu(*ins) else ()

    def run(self, ins, outs):
        db = outs[-1] if self.attrs.get("bias_grad") else None
        if db is not None:
            outs = outs[:-1]
        if not self._dx(ins, outs, db) and db is not None:
            self._bias_grad(ins, outs, db)

    def _bias_grad(self, ins, outs, db):
        """db = dx summed over every axis but the last, where the fused pass
        (``gelu_backward_bias_grad``) did not: ``InnerProductGradBias``'s
        kernels and calls on a float32 dx."""
        dx = outs[0]
        xp = get_xp(dx)
        k = float_kernels(xp, dx, db)
        rows = dx.reshape(last_axis_rows(dx.shape))
        if k is not None:
            partial = self.temporaries(ins[1], *self.scratch_specs(ins, outs + [db]))[-1]
            k.bias_grad(rows, out=db, partial=partial)
            return
        xp.sum(dx.reshape(-1, dx.shape[-1]), axis=0, out=db)

    def _dx(self, ins, outs, db):
        dy, x = ins
        xp = get_xp(x)
        approximate = _approximate(self.attrs)
        copy = outs[1] if len(outs) > 1 else None
        k = float_kernels(xp, dy, x, outs[0])
        if k is not None:
            if db is not None and np.dtype(outs[0].dtype) == np.dtype(np.float32):
                (partial,) = self.temporaries(x, *self.scratch_specs(ins, outs + [db]))
                rows = last_axis_rows(outs[0].shape)
                k.gelu_backward_bias_grad(dy.reshape(rows), x.reshape(rows), approximate,
                                          outs[0].reshape(rows), db,
                                          round_to=_own_rounding(self, ins, outs),
                                          copy=None if copy is None else copy.reshape(rows),
                                          partial=partial)
                return True
            k.gelu_backward(dy, x, approximate, out=outs[0],
                            round_to=_own_rounding(self, ins, outs), copy=copy)
            return False
        if xp is not np:
            if is_bits(x) or is_bits(dy) or copy is not None:
                raise TypeError(f"GeluGrad: bfloat16 bits take a float32 dy, x and dx, got "
                                f"{dy.dtype}, {x.dtype} and {outs[0].dtype}")
            t, d, e, f = self.temporaries(x, *self.scratch_specs(ins, outs + [db]))[:4]
            _gelu_factor(xp, x, approximate, t, d, e, f)
            xp.multiply(dy, d, out=outs[0])
            return False
        flat, g, dx = x.reshape(-1), dy.reshape(-1), outs[0].reshape(-1)   # dx may be dy
        temps = self.temporaries(outs[0], *self.host_temporaries(ins, outs))
        rest = temps[4:-1] if copy is not None else temps[4:]
        wx = rest[0] if is_bits(x) else None
        wdy = rest[-1] if is_bits(dy) else None
        bits = copy.reshape(-1) if copy is not None else None
        for s in spans(flat.size, HOST_CHUNK):
            t, d, e, f = (a[:s.stop - s.start] for a in temps[:4])
            _gelu_factor(xp, _host_x(flat, s, wx), approximate, t, d, e, f)
            np.multiply(_host_x(g, s, wdy), d, out=dx[s])
            if bits is not None:
                to_bf16_bits(dx[s], bits[s], temps[-1])
        return False


@gradient("Gelu")
def _gelu_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    if dy is not None and g.needs_grad(op.inputs[0]):
        g.emit("GeluGrad", [dy, op.inputs[0]], [g.grad_blob(op.inputs[0])],
               {"approximate": op.attrs.get("approximate", "none")})
