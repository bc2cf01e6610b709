"""Element-wise activations: Relu (leaky), Sigmoid, Tanh, and their gradients.

The backward ops read what the formula needs most cheaply: ReLU's gradient
needs the sign of its input ``x``, which its output ``y`` has too for a
slope >= 0; sigmoid's and tanh's are functions of ``y``. So all of them read
``y`` (a leaky ReLU with a negative slope reads ``x``), and ``x`` can be
freed right after the forward.
"""
from ..base.backend import get_xp
from ..base.errors import ShapeError
from ..gpu.raw import raw_kernels
from .registry import OpKernel, gradient, register


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


@register
class SigmoidGrad(OpKernel):
    """[dy, y] -> [dx]: dx = dy * y * (1 - y)."""

    op_type = "SigmoidGrad"

    @classmethod
    def infer(cls, attrs, ins):
        return _same_shape(cls.op_type, ins)

    def run(self, ins, outs):
        dy, y = ins
        xp, dx = get_xp(dy), outs[0]
        (t,) = self.temporaries(dy, (dy.shape, dy.dtype))  # no new array: capturable
        xp.subtract(1, y, out=t)
        xp.multiply(dy, y, out=dx)
        dx *= t


@gradient("Sigmoid")
def _sigmoid_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    if dy is not None and g.needs_grad(op.inputs[0]):
        g.emit("SigmoidGrad", [dy, op.outputs[0]], [g.grad_blob(op.inputs[0])])


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
class TanhGrad(OpKernel):
    """[dy, y] -> [dx]: dx = dy * (1 - y^2)."""

    op_type = "TanhGrad"

    @classmethod
    def infer(cls, attrs, ins):
        return _same_shape(cls.op_type, ins)

    def run(self, ins, outs):
        dy, y = ins
        xp = get_xp(dy)
        (t,) = self.temporaries(dy, (dy.shape, dy.dtype))  # no new array: capturable
        xp.multiply(y, y, out=t)
        xp.subtract(1, t, out=t)
        xp.multiply(dy, t, out=outs[0])


@gradient("Tanh")
def _tanh_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    if dy is not None and g.needs_grad(op.inputs[0]):
        g.emit("TanhGrad", [dy, op.outputs[0]], [g.grad_blob(op.inputs[0])])
