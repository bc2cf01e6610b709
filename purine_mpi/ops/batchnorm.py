"""Batch normalisation over the batch and spatial axes, per channel (axis 1);
for (N, C) and (N, C, H, W) inputs alike.

Forward ("BatchNorm", inputs [x, gamma, beta, running_mean, running_var]).
Attrs ``eps`` (1e-5), ``momentum`` (0.1), ``phase`` ("train" | "test").

Train, outputs [y, saved_mean, saved_invstd, running_mean@new, running_var@new]::

    mean = E[x],  var = E[(x - mean)^2]      (over the M = N*H*W values of a channel)
    invstd = 1 / sqrt(var + eps),  xhat = (x - mean) * invstd
    y = gamma * xhat + beta
    running_mean@new = (1 - momentum) * running_mean + momentum * mean
    running_var@new  = (1 - momentum) * running_var  + momentum * var * M / (M - 1)

(torch's convention; the last two outputs alias the running stats' storage).
With attr ``moving_average_fraction`` (maf; Caffe's BatchNorm) the running
statistics are instead Caffe's normalised sums: after t training steps they
are sum_i maf^(t-i) * stat_i / sum_i maf^(t-i), i.e. the update above with
momentum = 1 / factor, where the kernel's ``factor`` (Caffe's third blob,
saved in checkpoints, set from a .caffemodel) grows as factor = maf *
factor + 1 from 0. So the first step takes the batch statistics as they are,
as Caffe does, instead of blending them with the initial 0 and 1. Under
``parallel.micro_batches: M`` each copy's update counts (Caffe's
``iter_size``): copy k (attr ``micro_batch``) blends with 1 / factor after
the iteration's first k+1 updates, and every copy keeps the factor after all
M, so a checkpoint's factor is the same with or without micro-batches.

Test, outputs [y]: y = gamma * (x - running_mean) / sqrt(running_var + eps) + beta.

Synchronised (a ``batch_norm`` layer's ``sync: true``): a sixth input, the
float64 sums [sum x (C), sum x^2 (C), M] of the global batch, takes the
place of this rank's own: mean = S / M, var = S2 / M - mean^2, and the
running variance is unbiased over that M. ``BatchNormStats`` [x] -> [sums]
gives a rank's part (from a two-pass mean and squared deviation in x's
dtype, S2 = M2 + M * mean^2 in float64, so the difference keeps its
digits); its attr ``REPLICA_SUM`` asks the schemes to put an Allreduce of
the sums over the replicas between the two (parallel/data_parallel.py,
``sum_over_replicas``); on one rank they are its own, the plain kernel's.

Gradient ("BatchNormGrad", inputs [dy, x, gamma, mean, invstd] where mean and
invstd are the saved batch statistics in train phase, the running mean and
running var in test phase; outputs: the gradients named by attr ``grads``, a
subset of ["x", "gamma", "beta"] in that order)::

    dbeta = sum dy,  dgamma = sum dy * xhat
    train: dx = gamma * invstd / M * (M * dy - dbeta - xhat * dgamma)
    test:  dx = gamma * invstd * dy

Synchronised, ``BatchNormGradStats`` [dy, x, mean, invstd] -> [sums]
gives a rank's float64 [sum dy (C), sum dy * xhat (C), M], summed over the
replicas as above, and ``BatchNormGrad``'s sixth input: dx takes their
means over the global batch in place of dbeta / M and dgamma / M (as
PyTorch's ``SyncBatchNorm``); dgamma and dbeta, the parameters' gradients,
stay this rank's (the buckets sum them).

The running statistics get no gradient.
"""
from ..base.backend import get_xp
from ..base.errors import ShapeError
from ..gpu.raw import raw_kernels
from .registry import OpKernel, gradient, register

_GRAD_NAMES = ("x", "gamma", "beta")
#: the attr of an op whose output is this replica's part of a sum over the
#: replicas of a batch (the schemes allreduce it: data_parallel.sum_over_replicas)
REPLICA_SUM = "sum_over_replicas"


def _phase(attrs):
    phase = str(attrs.get("phase", "train")).lower()
    if phase not in ("train", "test"):
        raise ShapeError(f"BatchNorm attr 'phase' must be 'train' or 'test', got {phase!r}")
    return phase


def _axes(x):
    """Reduction axes and the broadcast shape of a per-channel vector."""
    return (0,) + tuple(range(2, x.ndim)), (1, x.shape[1]) + (1,) * (x.ndim - 2)


@register
class BatchNorm(OpKernel):
    """y = gamma * normalised x + beta; see the module docstring."""

    op_type = "BatchNorm"
    micro_batch_attrs = True  # Caffe's factor counts each micro-batch's update

    @classmethod
    def infer(cls, attrs, ins):
        if len(ins) not in (5, 6):
            raise ShapeError("BatchNorm takes inputs [x, gamma, beta, running_mean, running_var] "
                             f"and, synchronised, the batch's sums; got {len(ins)}")
        x_shape, dtype = tuple(ins[0][0]), ins[0][1]
        C = _channels("BatchNorm", x_shape)
        for (shape, _), name in zip(ins[1:], ("gamma", "beta", "running_mean", "running_var")):
            if tuple(shape) != (C,):
                raise ShapeError(f"BatchNorm {name} must have shape [{C}] (the channels of "
                                 f"{list(x_shape)}), got {list(shape)}")
        if len(ins) == 6:
            _check_sums("BatchNorm", ins[5], C)
        if _phase(attrs) == "test":
            return [(x_shape, dtype)]
        return [(x_shape, dtype), ((C,), dtype), ((C,), dtype), ins[3], ins[4]]

    def __init__(self, op):
        super().__init__(op)
        self.caffe_average = "moving_average_fraction" in self.attrs
        self.stateful = self.caffe_average  # the factor is state
        self.factor = 0.0

    def _momentum(self):
        if not self.caffe_average:
            return float(self.attrs.get("momentum", 0.1))
        # copy k of M (micro-batches) makes the (k+1)-th of the iteration's M
        # updates: factor(n + j) = maf^j * factor(n) + sum_{i<j} maf^i; every
        # copy keeps the factor after all M (that of the op without copies)
        maf = float(self.attrs["moving_average_fraction"])
        k, m = int(self.attrs.get("micro_batch", 0)), int(self.attrs.get("micro_batches", 1))
        before = self.factor
        self.factor = maf ** m * before + _powers(maf, m)
        return 1.0 / (maf ** (k + 1) * before + _powers(maf, k + 1))

    def state_dict(self):
        return {"factor": float(self.factor)}

    def load_state_dict(self, state):
        self.factor = float(state["factor"])

    def run(self, ins, outs):
        x, gamma, beta, running_mean, running_var = ins[:5]
        xp = get_xp(x)
        eps = float(self.attrs.get("eps", 1e-5))
        _, bshape = _axes(x)
        y, C = outs[0], x.shape[1]
        scale, stat, *rest = self.temporaries(x, *self.host_temporaries(ins, outs))
        if _phase(self.attrs) == "test":
            _invstd(xp, running_var, eps, out=stat)
            xp.subtract(x, running_mean.reshape(bshape), out=y)
            xp.multiply(stat, gamma, out=scale)
            y *= scale.reshape(bshape)
            y += beta.reshape(bshape)
            return
        m = self._momentum()
        mean, invstd, var = outs[1], outs[2], stat
        if len(ins) == 6:  # synchronised: the global batch's sums
            unbiased = _summed_stats(xp, ins[5], mean, var, *rest)
            xp.subtract(x, mean.reshape(bshape), out=y)
        else:
            (sq,) = rest
            count = x.size // C
            _channel_sum(xp, x, out=mean)
            mean /= count                                   # E[x]
            xp.subtract(x, mean.reshape(bshape), out=y)
            xp.multiply(y, y, out=sq)
            _channel_sum(xp, sq, out=var)
            var /= count                                    # E[(x - mean)^2]
            unbiased = count / max(count - 1, 1)
        _invstd(xp, var, eps, out=invstd)
        xp.multiply(invstd, gamma, out=scale)
        y *= scale.reshape(bshape)
        y += beta.reshape(bshape)
        # outs[3], outs[4] share storage with ins[3], ins[4] in a graph
        _blend(xp, outs[3], running_mean, mean, m, scale)
        var *= unbiased
        _blend(xp, outs[4], running_var, var, m, scale)

    def host_temporaries(self, ins, outs):
        """Two per-channel temporaries, and one of x's size (synchronised:
        three float64 per-channel ones instead): no new array on a GPU, so a
        CUDA graph captures the op."""
        x = ins[0]
        C = x.shape[1]
        rest = [((C,), "float64")] * 3 if len(ins) == 6 else [(x.shape, x.dtype)]
        return [((C,), x.dtype)] * 2 + rest


@register
class BatchNormStats(OpKernel):
    """A rank's part of the sums of a synchronised BatchNorm's batch: inputs
    [x], outputs [sums], float64 [sum x (C), sum x^2 (C), M] (module docstring)."""

    op_type = "BatchNormStats"

    @classmethod
    def infer(cls, attrs, ins):
        return [((2 * _channels("BatchNormStats", ins[0][0]) + 1,), "float64")]

    def run(self, ins, outs):
        (x,), (sums,) = ins, outs
        xp = get_xp(x)
        _, bshape = _axes(x)
        C = x.shape[1]
        count = x.size // C
        mean, m2, dev = self.temporaries(x, *self.host_temporaries(ins, outs))
        _channel_sum(xp, x, out=mean)
        mean /= count
        xp.subtract(x, mean.reshape(bshape), out=dev)
        dev *= dev
        _channel_sum(xp, dev, out=m2)                    # M2 about this rank's mean
        s, s2 = sums[:C], sums[C:2 * C]
        xp.copyto(s, mean)                               # widened before squaring
        xp.multiply(s, s, out=s2)
        s2 *= count
        s2 += m2                                         # sum x^2 = M2 + M * mean^2
        s *= count
        sums[2 * C:].fill(count)

    def host_temporaries(self, ins, outs):
        """Two per-channel temporaries and one of x's size."""
        x = ins[0]
        return [((x.shape[1],), x.dtype)] * 2 + [(x.shape, x.dtype)]


@register
class BatchNormGradStats(OpKernel):
    """A rank's part of the sums a synchronised BatchNorm's gradient takes:
    inputs [dy, x, mean, invstd], outputs [sums], float64 [sum dy (C),
    sum dy * xhat (C), M] (module docstring)."""

    op_type = "BatchNormGradStats"

    @classmethod
    def infer(cls, attrs, ins):
        return [((2 * _channels("BatchNormGradStats", ins[1][0]) + 1,), "float64")]

    def run(self, ins, outs):
        (dy, x, mean, invstd), (sums,) = ins, outs
        xp = get_xp(dy)
        _, bshape = _axes(x)
        C = x.shape[1]
        total, prod = self.temporaries(dy, *self.host_temporaries(ins, outs))
        _channel_sum(xp, dy, out=total)
        xp.copyto(sums[:C], total)
        xp.subtract(x, mean.reshape(bshape), out=prod)
        prod *= invstd.reshape(bshape)                   # xhat
        prod *= dy
        _channel_sum(xp, prod, out=total)
        xp.copyto(sums[C:2 * C], total)
        sums[2 * C:].fill(x.size // C)

    def host_temporaries(self, ins, outs):
        """One per-channel temporary and one of x's size."""
        dy, x = ins[:2]
        return [((x.shape[1],), dy.dtype), (x.shape, dy.dtype)]


def _channels(op_type, shape):
    if len(shape) < 2:
        raise ShapeError(f"{op_type} needs an (N, C, ...) input, got {list(shape)}")
    return shape[1]


def _check_sums(op_type, spec, C):
    shape, dtype = spec
    if tuple(shape) != (2 * C + 1,) or str(dtype) != "float64":
        raise ShapeError(f"{op_type}'s sums must be float64 of shape [{2 * C + 1}] (2 x the "
                         f"{C} channels + the count), got {str(dtype)} {list(shape)}")


def _summed_stats(xp, sums, mean, var, wide, wide_var, factor):
    """mean and var (biased) of the global batch from its sums [S, S2, M]
    (float64: ``wide``, ``wide_var``, ``factor`` are float64 scratch);
    returns ``factor``, M / (M - 1) per channel (the unbiased variance's)."""
    C = mean.shape[0]
    count = sums[2 * C:]
    xp.divide(sums[:C], count, out=wide)                 # E[x]
    xp.divide(sums[C:2 * C], count, out=wide_var)
    xp.multiply(wide, wide, out=factor)
    wide_var -= factor                                   # E[x^2] - E[x]^2
    xp.maximum(wide_var, 0.0, out=wide_var)
    xp.copyto(mean, wide)
    xp.copyto(var, wide_var)
    xp.subtract(count, 1.0, out=factor)
    xp.maximum(factor, 1.0, out=factor)
    xp.divide(count, factor, out=factor)
    return factor


def _powers(maf, n):
    """1 + maf + ... + maf^(n-1): the factor of n updates from 0."""
    return sum(maf ** i for i in range(n))


def _channel_sum(xp, a, out):
    """out[c] = sum of ``a``'s channel c over the batch and spatial axes
    (on a GPU one deterministic raw kernel, which a capture takes)."""
    k = raw_kernels(xp, a)
    if k is not None:
        k.channel_sum(a, out=out)
    else:
        a.sum(axis=_axes(a)[0], out=out)


def _invstd(xp, var, eps, out):
    """out = 1 / sqrt(var + eps), in place."""
    xp.add(var, eps, out=out)
    xp.sqrt(out, out=out)
    xp.divide(1.0, out, out=out)


def _blend(xp, out, running, value, m, tmp):
    """out = (1 - m) * running + m * value (``out`` may be ``running``'s
    storage; ``tmp``: scratch)."""
    xp.multiply(value, m, out=tmp)
    xp.multiply(running, 1.0 - m, out=out)
    out += tmp


@register
class BatchNormGrad(OpKernel):
    """Gradients of BatchNorm.  Inputs [dy, x, gamma, mean, invstd-or-var];
    attrs phase, eps, grads."""

    op_type = "BatchNormGrad"

    @classmethod
    def infer(cls, attrs, ins):
        grads = attrs.get("grads", list(_GRAD_NAMES))
        if not grads or any(n not in _GRAD_NAMES for n in grads):
            raise ShapeError(f"BatchNormGrad attr 'grads' must name some of {list(_GRAD_NAMES)}, "
                             f"got {grads!r}")
        if len(ins) == 6:
            _check_sums("BatchNormGrad", ins[5], ins[1][0][1])
        shapes = {"x": ins[1], "gamma": ins[2], "beta": ins[2]}
        return [shapes[n] for n in _GRAD_NAMES if n in grads]

    def run(self, ins, outs):
        dy, x, gamma, mean, stat = ins[:5]
        xp = get_xp(dy)
        _, bshape = _axes(x)
        C = x.shape[1]
        grads = self.attrs.get("grads", list(_GRAD_NAMES))
        out = dict(zip([n for n in _GRAD_NAMES if n in grads], outs))
        invstd, dbeta, dgamma, scale, xhat, prod = self.temporaries(
            dy, *self.host_temporaries(ins, outs))
        if _phase(self.attrs) == "test":
            _invstd(xp, stat, float(self.attrs.get("eps", 1e-5)), out=invstd)
        else:
            xp.copyto(invstd, stat)
        xp.subtract(x, mean.reshape(bshape), out=xhat)
        xhat *= invstd.reshape(bshape)
        _channel_sum(xp, dy, out=dbeta)
        xp.multiply(dy, xhat, out=prod)
        _channel_sum(xp, prod, out=dgamma)
        if "beta" in out:
            xp.copyto(out["beta"], dbeta)
        if "gamma" in out:
            xp.copyto(out["gamma"], dgamma)
        if "x" in out:
            dx = out["x"]
            xp.multiply(gamma, invstd, out=scale)
            if _phase(self.attrs) == "test":
                xp.multiply(dy, scale.reshape(bshape), out=dx)
                return
            if len(ins) == 6:  # synchronised: the means over the global batch
                sums = ins[5]
                xp.divide(sums[C:2 * C], sums[2 * C:], out=dgamma)
                xp.divide(sums[:C], sums[2 * C:], out=dbeta)
            else:
                count = x.size // C
                dgamma /= count
                dbeta /= count
            xhat *= dgamma.reshape(bshape)
            xp.subtract(dy, xhat, out=dx)
            dx -= dbeta.reshape(bshape)
            dx *= scale.reshape(bshape)

    def host_temporaries(self, ins, outs):
        """Four per-channel temporaries and two of x's size (x-hat, dy *
        x-hat): temporaries, not new arrays, so a CUDA graph captures the op."""
        dy, x = ins[:2]
        return [((x.shape[1],), dy.dtype)] * 4 + [(x.shape, dy.dtype)] * 2


@gradient("BatchNorm")
def _batchnorm_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    if dy is None:
        return
    x, gamma, beta, running_mean, running_var = op.inputs[:5]
    wanted = [(n, b) for n, b in zip(_GRAD_NAMES, (x, gamma, beta)) if g.needs_grad(b)]
    if not wanted:
        return
    phase = _phase(op.attrs)
    stats = [op.outputs[1], op.outputs[2]] if phase == "train" else [running_mean, running_var]
    attrs = {"phase": phase, "eps": op.attrs.get("eps", 1e-5), "grads": [n for n, _ in wanted]}
    if len(op.inputs) == 6 and phase == "train" and g.needs_grad(x):
        # synchronised: dx takes the global batch's sums (dgamma, dbeta this rank's)
        sums = g.temp_blob("grad_sums", None, "float64")
        g.emit("BatchNormGradStats", [dy, x] + stats, [sums], {REPLICA_SUM: True})
        stats = stats + [sums]
    g.emit("BatchNormGrad", [dy, x, gamma] + stats, [g.grad_blob(b) for _, b in wanted], attrs)
