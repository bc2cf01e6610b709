"""The solver's update ops: Caffe's SGD update and the adaptive solvers.

The learning rate comes from ``LearningRate`` (ops/lr_policy.py); one ``SGDUpdate`` per parameter then updates the weight and
its momentum in place (through alias blobs ``w@new``, ``w/momentum@new``,
which the graph orders after every other reader of the old values).

On a GPU (CuPy weights of float32/float64) the SGD update is one fused raw
kernel (cuda/sgd.cu) instead of four element-wise passes, and so are Adam
and AdamW (cuda/adam.cu): nothing allocates in a captured iteration; the
fuse pass (parallel/fuse.py) then makes the updates of a device one
multi-tensor op (MultiSGDUpdate, MultiAdamUpdate): one launch for them all. The learning rate
may be a host blob (read as a number: no sync) or a device blob (read by the
kernel: no host round trip either).
"""
import math
import types

import numpy as np

from ..base.backend import get_xp
from ..base.errors import ShapeError
from ..base.precision import BITS
from ..gpu.raw import carry, raw_kernels
from .registry import OpKernel, register


def frozen(attrs):
    """Whether an update op's ``attrs`` say its parameter is frozen
    (``lr_mult`` 0, Caffe's way): its update changes nothing, the weight and
    the solver state stay bit for bit whatever the gradient holds (torch
    leaves a parameter without ``grad`` alone), and its gradient counts not
    in the clip's norm (graph/clip.py) nor in fp16's overflow check
    (graph/loss_scale.py)."""
    return float(attrs.get("lr_mult", 1.0)) == 0.0


@register
class SGDUpdate(OpKernel):
    """[w, grad, momentum, lr] -> [w_new, momentum_new] (aliases of w and
    momentum), Caffe's SGD with momentum and L2 weight decay:

        rate = lr * lr_mult
        v = momentum * v + rate * (grad_scale * grad + weight_decay * decay_mult * w)
        w = w - v

    Attrs ``momentum`` (0), ``weight_decay`` (0), ``lr_mult`` (1),
    ``decay_mult`` (1), ``grad_scale`` (1; the data-parallel composition sets
    1/N when grad is a sum over N ranks). At ``lr_mult`` 0 (``frozen``) it
    changes nothing, whatever grad holds. No gradient."""

    op_type = "SGDUpdate"
    category = "update"

    @classmethod
    def infer(cls, attrs, ins):
        (ws, wd), (gs, _), (vs, vd), (ls, _) = ins
        if not tuple(ws) == tuple(gs) == tuple(vs):
            raise ShapeError(f"SGDUpdate needs weight, gradient and momentum of one shape, "
                             f"got {list(ws)}, {list(gs)}, {list(vs)}")
        if int(np.prod(ls, dtype=np.int64)) != 1:
            raise ShapeError(f"SGDUpdate's learning rate must be a scalar, got shape {list(ls)}")
        return [(tuple(ws), wd), (tuple(vs), vd)]

    def run(self, ins, outs):
        w, grad, v, lr = ins
        w_new, v_new = outs
        a = self.attrs
        if frozen(a):
            carry((w, v), outs)   # frozen: the weight and state as they are
            return
        xp = get_xp(w)
        k = raw_kernels(xp, w, grad, v)
        if k is not None and w_new.flags.c_contiguous and v_new.flags.c_contiguous:
            self._run_gpu(k, xp, ins, outs)
            return
        _sgd_step(xp, w, grad, v, lr, a, w_new, v_new)

    def host_temporaries(self, ins, outs):
        """``_sgd_step``'s NumPy temporaries, one at a time: the scaled
        gradient, then (with weight decay) the scaled weights; none when
        frozen."""
        a = self.attrs
        if frozen(a):
            return []
        decay = float(a.get("weight_decay", 0.0)) * float(a.get("decay_mult", 1.0))
        big = max([ins[1]] + ([ins[0]] if decay else []),
                  key=lambda x: x.size * np.dtype(x.dtype).itemsize)
        return [(tuple(big.shape), big.dtype)]

    def _run_gpu(self, k, xp, ins, outs):
        """The fused kernel updates in place, so it works on the outputs
        (normally the aliases ``w@new``/``v@new``, i.e. ``w`` and ``v``
        themselves; otherwise w and v are copied there first)."""
        w, grad, v, lr = ins
        w_new, v_new = outs
        a = self.attrs
        # a host lr blob is read as a number (no sync); a device blob is read
        # by the kernel, which applies lr_mult (no host round trip, no temporary)
        rate = float(lr.reshape(())) if get_xp(lr) is np else lr
        carry((w, v), (w_new, v_new))
        k.sgd_momentum_update(w_new, grad, v_new, rate,
                              momentum=float(a.get("momentum", 0.0)),
                              weight_decay=float(a.get("weight_decay", 0.0))
                              * float(a.get("decay_mult", 1.0)),
                              grad_scale=float(a.get("grad_scale", 1.0)),
                              lr_mult=float(a.get("lr_mult", 1.0)))


@register
class MultiSGDUpdate(OpKernel):
    """[w_flat, momentum_flat, lr, grad_0, ..., grad_{n-1}] -> [w_flat_new,
    momentum_flat_new] (aliases of the flat buffers): SGDUpdate of n
    parameters at once. Parameter k is the view of ``sizes[k]`` elements at
    ``offsets[k]`` of both flat buffers (parallel/fuse.py lays the weights and
    momenta out so), with its own ``lr_mults[k]`` and ``decay_mults[k]``;
    ``momentum``, ``weight_decay`` and ``grad_scale`` are shared.

    On a GPU one kernel updates everything (cuda/sgd.cu, sgd_momentum_multi:
    the arithmetic of SGDUpdate's kernel, bit for bit), reading the gradients
    where they are through a pointer table built once in ``setup``; on the
    CPU each parameter is updated as SGDUpdate does. A frozen parameter
    (``lr_mults[k]`` 0) is left out of both: its views stay as they are.
    No gradient."""

    op_type = "MultiSGDUpdate"
    category = "update"
    #: the flat buffers (weights, then the states) and the scalar inputs
    #: after them, before the gradients
    flat, scalars = ("weights", "momenta"), ("learning rate",)

    @classmethod
    def infer(cls, attrs, ins):
        sizes, offsets = list(attrs["sizes"]), list(attrs["offsets"])
        n, head = len(sizes), len(cls.flat) + len(cls.scalars)
        if len(ins) != head + n or not n == len(offsets) == len(attrs["lr_mults"]) == \
                len(attrs["decay_mults"]):
            raise ShapeError(f"{cls.op_type} takes the flat {', the flat '.join(cls.flat)}, "
                             f"the {' and the '.join(cls.scalars)} and one gradient per "
                             f"parameter ({n}), with one size, offset, lr_mult and "
                             f"decay_mult each; got {len(ins)} inputs")
        flat = ins[:len(cls.flat)]
        ws = flat[0][0]
        if len({tuple(s) for s, _ in flat}) != 1 or len(ws) != 1:
            raise ShapeError(f"{cls.op_type} needs flat {' and '.join(cls.flat)} buffers of "
                             f"one length, got {', '.join(str(list(s)) for s, _ in flat)}")
        for what, (ls, _) in zip(cls.scalars, ins[len(cls.flat):head]):
            if int(np.prod(ls, dtype=np.int64)) != 1:
                raise ShapeError(f"{cls.op_type}'s {what} must be a scalar, got {list(ls)}")
        for k, ((gs, _), size, off) in enumerate(zip(ins[head:], sizes, offsets)):
            if int(np.prod(gs, dtype=np.int64)) != int(size) or off < 0 or \
                    off + size > ws[0]:
                raise ShapeError(f"{cls.op_type}: gradient {k} has shape {list(gs)}, its "
                                 f"parameter {size} elements at offset {off} of {ws[0]}")
        return [(tuple(s), d) for s, d in flat]

    #: the dtype of the table's lr_mults and decays (None: the weights')
    factor_dtype = None

    def setup(self, ins, outs):
        self._table = None
        a = self.attrs
        live = self.live()
        grads = [ins[len(self.flat) + len(self.scalars) + k] for k in live]
        flat = outs[:len(self.flat)]
        xp = get_xp(outs[0])
        k = raw_kernels(xp, *flat, *grads)
        if live and k is not None and \
                all(x.flags.c_contiguous for x in list(flat) + list(grads)):
            wd = float(a.get("weight_decay", 0.0))
            extra = {}
            copies = weight_copies(a, outs[len(self.flat):])
            if copies:
                extra = dict(copies=[copies.get(i) for i in live],
                             precision=a["copy_dtype"])
            self._table = k.MultiTensorTable(
                grads, [a["offsets"][i] for i in live],
                [float(a["lr_mults"][i]) for i in live],
                [wd * float(a["decay_mults"][i]) for i in live], outs[0].dtype,
                factor_dtype=self.factor_dtype, **extra)

    def live(self):
        """The indices of the parameters this op moves: a frozen one's
        (lr_mult 0) is left out, its views in the flat buffers untouched."""
        return [k for k, m in enumerate(self.attrs["lr_mults"]) if not frozen({"lr_mult": m})]

    def segments(self, grads):
        """(grad, offset, size, lr_mult, decay_mult) of each parameter this
        op moves (the CPU path's loop)."""
        a = self.attrs
        return [(grads[k], a["offsets"][k], a["sizes"][k], a["lr_mults"][k],
                 a["decay_mults"][k]) for k in self.live()]

    def run(self, ins, outs):
        w, v, lr = ins[:3]
        w_new, v_new = outs
        a = self.attrs
        carry((w, v), (w_new, v_new))
        table = getattr(self, "_table", None)
        if table is not None:
            from ..gpu import kernels
            kernels.sgd_momentum_multi(w_new, v_new, table,
                                       float(lr.reshape(())) if get_xp(lr) is np else lr,
                                       momentum=float(a.get("momentum", 0.0)),
                                       grad_scale=float(a.get("grad_scale", 1.0)))
            return
        for grad, off, size, lr_mult, decay_mult in self.segments(ins[3:]):
            view = slice(int(off), int(off) + int(size))
            single = dict(a, lr_mult=lr_mult, decay_mult=decay_mult)
            _sgd_step(get_xp(w_new), w_new[view], grad.reshape(-1), v_new[view], lr, single,
                      w_new[view], v_new[view])


def weight_copies(attrs, extra):
    """{parameter index: its low-precision copy} of a multi-tensor update
    whose ``attrs["copy_of"]`` lists the parameters (by index) whose copies
    its outputs after the flat buffers (``extra``) are
    (parallel/precision.fold_weight_casts); {} without."""
    return {int(k): c for k, c in zip(attrs.get("copy_of", ()), extra)}


def copy_outputs(attrs, ins, count):
    """(shape, dtype) of ``count`` weight copies of attr ``copy_bits`` (bits:
    BITS, else float32; one or one per copy) of the parameters whose (shape, dtype) ``ins``
    lists: an update op's outputs after its own (fold_weight_casts)."""
    bits = attrs.get("copy_bits")
    bits = list(bits) if isinstance(bits, (list, tuple)) else [bool(bits)] * count
    return [(tuple(s), BITS if b else "float32") for (s, _), b in zip(ins[:count], bits)]


def _sgd_step(xp, w, grad, v, lr, a, w_new, v_new):
    """SGDUpdate's arithmetic in xp (the CPU path): see SGDUpdate."""
    rate = float(lr.reshape(())) * float(a.get("lr_mult", 1.0))
    decay = float(a.get("weight_decay", 0.0)) * float(a.get("decay_mult", 1.0))
    # Element-wise ops with out= are safe when v_new is v and w_new is w
    # (the alias case); w is read in full before w_new is written.
    xp.multiply(v, float(a.get("momentum", 0.0)), out=v_new)
    v_new += grad * (rate * float(a.get("grad_scale", 1.0)))
    if decay:
        v_new += w * (rate * decay)
    xp.subtract(w, v_new, out=w_new)


def _rate(rate, t):
    """The rate as the update multiplies by it: a number of the weights'
    dtype, or the 0-d device array of a learning-rate blob on the GPU."""
    return t(rate) if isinstance(rate, float) else rate


class _AdaptiveUpdate(OpKernel):
    """Base of the solvers besides SGD: ``[w, grad, *states, lr(, iter)] ->
    [w_new, *states_new]`` (aliases of w and the states), written in one xp
    code path, so the same op runs on NumPy and CuPy arrays.

    Every solver first forms Caffe's regularised gradient
    ``g = grad_scale * grad + weight_decay * decay_mult * w`` (L2 added to the
    gradient, as torch.optim does; AdamW decouples it instead) and the rate
    ``lr * lr_mult``; ``step`` then updates ``w`` and the states in place.
    Attrs: ``weight_decay``, ``lr_mult``, ``decay_mult``, ``grad_scale`` as
    for SGDUpdate, plus the solver's own (``momentum``, ``momentum2``,
    ``delta``, ``rms_decay``). At ``lr_mult`` 0 (``frozen``) nothing changes:
    neither the weight (no decoupled decay either) nor the states."""

    category = "update"
    #: names of the per-parameter state blobs, in input order after grad
    states = ()
    #: reads the iteration blob after lr (Adam's bias correction)
    needs_iter = False
    #: weight decay applied to the weight, not added to the gradient (AdamW)
    decoupled = False

    @classmethod
    def infer(cls, attrs, ins):
        n = len(cls.states)
        if len(ins) != 3 + n + int(cls.needs_iter):
            raise ShapeError(f"{cls.op_type} takes weight, gradient, {n} state blob(s), the "
                             f"learning rate{' and the iteration' if cls.needs_iter else ''}; "
                             f"got {len(ins)} inputs")
        shapes = [tuple(s) for s, _ in ins[:2 + n]]
        if len(set(shapes)) != 1:
            raise ShapeError(f"{cls.op_type} needs weight, gradient and state of one shape, "
                             f"got {', '.join(str(list(s)) for s in shapes)}")
        for s, _ in ins[2 + n:]:
            if int(np.prod(s, dtype=np.int64)) != 1:
                raise ShapeError(f"{cls.op_type}'s learning rate and iteration must be "
                                 f"scalars, got shape {list(s)}")
        return [(shapes[0], ins[0][1])] + [(shapes[0], d) for _, d in ins[2:2 + n]]

    #: cuda/adaptive.cu's kind of this solver (None: its own GPU path or none)
    gpu_kind = None
    #: the attr of the solver's own hyper-parameter (momentum or rms_decay;
    #: None: none) and its default, read by ``step`` and the GPU kernel alike
    hyper = (None, 0.0)

    def _hyper(self):
        name, default = self.hyper
        return float(self.attrs.get(name, default)) if name else 0.0

    def run(self, ins, outs):
        n = len(self.states)
        w, grad = ins[0], ins[1]
        lr = ins[2 + n]
        a = self.attrs
        xp = get_xp(w)
        carry([w] + list(ins[2:2 + n]), outs)
        if frozen(a):
            return
        w_new, states = outs[0], outs[1:]
        decay = float(a.get("weight_decay", 0.0)) * float(a.get("decay_mult", 1.0))
        k = raw_kernels(xp, w_new, grad, *states) if self.gpu_kind else None
        if k is not None and all(o.flags.c_contiguous for o in outs):
            # on a GPU: one kernel (cuda/adaptive.cu), no temporaries; the
            # lr blob on the device is read by the kernel
            k.adaptive_update(self.gpu_kind, w_new, grad, list(states),
                              float(lr.reshape(())) if get_xp(lr) is np else lr,
                              a=self._hyper(), delta=float(a.get("delta", 1e-8)),
                              grad_scale=float(a.get("grad_scale", 1.0)),
                              weight_decay=decay, lr_mult=float(a.get("lr_mult", 1.0)))
            return
        if get_xp(lr) is np:
            rate = float(lr.reshape(())) * float(a.get("lr_mult", 1.0))
        else:  # the lr blob on the device: a 0-d device array, never read back
            rate = lr.reshape(()).astype(w_new.dtype) * w_new.dtype.type(a.get("lr_mult", 1.0))
        dtype = w_new.dtype.type
        g = grad * dtype(a.get("grad_scale", 1.0))
        if decay and not self.decoupled:
            g += w_new * dtype(decay)
        it = int(ins[3 + n].reshape(())) if self.needs_iter else None
        self.step(xp, w_new, g, states, dtype, rate, decay, it)

    def step(self, xp, w, g, states, t, rate, decay, it):
        raise NotImplementedError


@register
class NesterovUpdate(_AdaptiveUpdate):
    """Caffe's Nesterov momentum (NesterovSolver):
    ``v' = momentum * v + rate * g; w -= (1 + momentum) * v' - momentum * v``,
    equal to torch.optim.SGD(nesterov=True) at a constant rate."""

    op_type = "NesterovUpdate"
    gpu_kind, hyper = "nesterov", ("momentum", 0.0)
    states = ("momentum",)

    def step(self, xp, w, g, states, t, rate, decay, it):
        (v,) = states
        mu = t(self._hyper())
        previous = v * mu
        v *= mu
        v += g * _rate(rate, t)
        w -= v * (t(1) + mu) - previous


@register
class AdaGradUpdate(_AdaptiveUpdate):
    """AdaGrad: ``h += g^2; w -= rate * g / (sqrt(h) + delta)`` (Caffe's
    AdaGradSolver, torch.optim.Adagrad with lr_decay 0)."""

    op_type = "AdaGradUpdate"
    gpu_kind = "adagrad"
    states = ("history",)

    def step(self, xp, w, g, states, t, rate, decay, it):
        (h,) = states
        h += g * g
        w -= _rate(rate, t) * g / (xp.sqrt(h) + t(self.attrs.get("delta", 1e-8)))


@register
class RMSPropUpdate(_AdaptiveUpdate):
    """RMSProp: ``h = rms_decay * h + (1 - rms_decay) * g^2;
    w -= rate * g / (sqrt(h) + delta)`` (Caffe's RMSPropSolver,
    torch.optim.RMSprop with alpha = rms_decay)."""

    op_type = "RMSPropUpdate"
    gpu_kind, hyper = "rmsprop", ("rms_decay", 0.99)
    states = ("history",)

    def step(self, xp, w, g, states, t, rate, decay, it):
        (h,) = states
        rho = t(self._hyper())
        h *= rho
        h += (t(1) - rho) * g * g
        w -= _rate(rate, t) * g / (xp.sqrt(h) + t(self.attrs.get("delta", 1e-8)))


@register
class AdaDeltaUpdate(_AdaptiveUpdate):
    """AdaDelta (Caffe's AdaDeltaSolver, torch.optim.Adadelta with
    rho = momentum, eps = delta)::

        h  = momentum * h + (1 - momentum) * g^2
        u  = g * sqrt(h2 + delta) / sqrt(h + delta)
        h2 = momentum * h2 + (1 - momentum) * u^2
        w -= rate * u
    """

    op_type = "AdaDeltaUpdate"
    gpu_kind, hyper = "adadelta", ("momentum", 0.9)
    states = ("history", "update_history")

    def step(self, xp, w, g, states, t, rate, decay, it):
        h, h2 = states
        rho, eps = t(self._hyper()), t(self.attrs.get("delta", 1e-8))
        h *= rho
        h += (t(1) - rho) * g * g
        u = xp.sqrt(h2 + eps) / xp.sqrt(h + eps) * g
        h2 *= rho
        h2 += (t(1) - rho) * u * u
        w -= _rate(rate, t) * u


@register
class AdamUpdate(_AdaptiveUpdate):
    """Adam (Kingma & Ba), step ``s = iter - step0 + 1``, with Caffe's key
    names (momentum = beta1, momentum2 = beta2, delta = epsilon)::

        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g^2
        w -= rate / (1 - b1^s) * m / (sqrt(v) / sqrt(1 - b2^s) + delta)

    as torch.optim.Adam computes it (Caffe adds delta before the bias
    correction of v instead, a difference of delta * sqrt(1 - b2^s)). The
    weight decay is L2 added to the gradient, as in torch.optim.Adam.
    Attr ``step0`` (default 0): the iteration the moments started at, set
    by a resume that starts them from zero (a checkpoint of another solver
    type: train/checkpoints.py), so that s counts the steps they have seen,
    as a fresh torch optimizer's state does."""

    op_type = "AdamUpdate"
    states = ("m", "v")
    needs_iter = True

    @classmethod
    def infer(cls, attrs, ins):
        out = super().infer(attrs, ins)
        if attrs.get("copy_dtype"):   # the weight's low-precision copy (w@bf16@new)
            out += copy_outputs(attrs, ins, 1)
        return out

    def run(self, ins, outs):
        """The update (below); with attr ``copy_dtype`` (parallel/precision
        .fold_weight_casts) a fourth output, the weight's low-precision
        copy, is written from the new weight: by the fused kernel in its
        pass, else after the update (ops/basic.cast_copy): the bits of a
        Cast of it either way."""
        copy = outs[3] if len(outs) > 3 else None
        if self._update(ins, outs[:3], copy) and copy is not None:
            from .basic import cast_copy
            cast_copy(outs[0], copy, self.attrs["copy_dtype"])

    def _update(self, ins, outs, copy):
        """Returns whether the copy is still to write (not by the kernel)."""
        w, grad, m, v, lr, it = ins
        if frozen(self.attrs):
            carry((w, m, v), outs)   # frozen: the weight and states as they are
            return False   # unchanged: so is its copy
        xp = get_xp(w)
        k = raw_kernels(xp, w, grad, m, v)
        if k is None or not all(o.flags.c_contiguous for o in outs) or (
                copy is not None and (not copy.flags.c_contiguous
                                      or np.dtype(w.dtype) != np.float32)):
            super().run(ins, outs)
            return True
        # on a GPU: one fused kernel (cuda/adam.cu), no temporaries; the lr
        # and iteration blobs on the device are read by the kernel
        carry((w, m, v), outs)
        a = self.attrs
        lr = float(lr.reshape(())) if get_xp(lr) is np else lr
        it = int(it.reshape(())) if get_xp(it) is np else it
        w_new, m_new, v_new = outs
        k.adam_update(w_new, grad, m_new, v_new, lr, it,
                      beta1=float(a.get("momentum", 0.9)), beta2=float(a.get("momentum2", 0.999)),
                      delta=float(a.get("delta", 1e-8)), grad_scale=float(a.get("grad_scale", 1.0)),
                      weight_decay=float(a.get("weight_decay", 0.0)) * float(a.get("decay_mult", 1.0)),
                      decoupled=self.decoupled, lr_mult=float(a.get("lr_mult", 1.0)),
                      step0=int(a.get("step0", 0)), copy=copy,
                      precision=a.get("copy_dtype", "bfloat16"))
        return False

    def step(self, xp, w, g, states, t, rate, decay, it):
        m, v = states
        b1, b2 = float(self.attrs.get("momentum", 0.9)), float(self.attrs.get("momentum2", 0.999))
        s = it - int(self.attrs.get("step0", 0)) + 1
        m *= t(b1)
        m += t(1 - b1) * g
        v *= t(b2)
        v += t(1 - b2) * g * g
        denom = xp.sqrt(v) / t(math.sqrt(1 - b2 ** s)) + t(self.attrs.get("delta", 1e-8))
        step = t(rate / (1 - b1 ** s)) if isinstance(rate, float) else rate / t(1 - b1 ** s)
        w -= step * m / denom


@register
class AdamWUpdate(AdamUpdate):
    """AdamW (Loshchilov & Hutter): Adam with the weight decay decoupled from
    the gradient, ``w *= 1 - rate * weight_decay * decay_mult`` before the
    Adam step, as torch.optim.AdamW does."""

    op_type = "AdamWUpdate"
    decoupled = True

    def step(self, xp, w, g, states, t, rate, decay, it):
        if decay:
            w *= t(1 - rate * decay) if isinstance(rate, float) else 1 - rate * t(decay)
        super().step(xp, w, g, states, t, rate, decay, it)


@register
class MultiAdamUpdate(MultiSGDUpdate):
    """[w_flat, m_flat, v_flat, lr, iter, grad_0, ..., grad_{n-1}] ->
    [w_flat_new, m_flat_new, v_flat_new] (aliases of the flat buffers):
    AdamUpdate (attr ``decoupled`` false) or AdamWUpdate (true) of n
    parameters at once, laid out as MultiSGDUpdate's (parallel/fuse.py), each
    with its own ``lr_mults[k]`` and ``decay_mults[k]``; ``momentum``,
    ``momentum2``, ``delta``, ``weight_decay`` and ``grad_scale`` shared.

    On a GPU one kernel updates everything (cuda/adam.cu, adam_multi: the
    arithmetic of the single-parameter kernel, bit for bit; torch's
    ``fused=True`` multi-tensor apply); on the CPU each parameter is updated
    by the single op's code. No gradient."""

    op_type = "MultiAdamUpdate"
    flat, scalars = ("weights", "first moments", "second moments"), \
        ("learning rate", "iteration")
    factor_dtype = np.float64

    @classmethod
    def infer(cls, attrs, ins):
        out = super().infer(attrs, ins)
        of = [int(k) for k in attrs.get("copy_of", ())]
        if of:   # the copies of parameters copy_of (fold_weight_casts): their shapes
            grads = ins[len(cls.flat) + len(cls.scalars):]
            out += copy_outputs(attrs, [grads[k] for k in of], len(of))
        return out

    def run(self, ins, outs):
        """The update (see the class); with attr ``copy_of`` (parallel/
        precision.fold_weight_casts) the outputs after the flat buffers are
        the low-precision copies (attr ``copy_dtype``) of those parameters,
        written from their new weights by the kernel in its pass (the
        table's copies), else after each one's update (ops/basic.cast_copy)."""
        a = self.attrs
        copies = weight_copies(a, outs[3:])
        outs = outs[:3]
        carry(ins[:3], outs)
        lr, it = ins[3:5]
        table = getattr(self, "_table", None)
        if table is not None:
            from ..gpu import kernels
            kernels.adam_multi(*outs, table, float(lr.reshape(())) if get_xp(lr) is np else lr,
                               int(it.reshape(())) if get_xp(it) is np else it,
                               beta1=float(a.get("momentum", 0.9)),
                               beta2=float(a.get("momentum2", 0.999)),
                               delta=float(a.get("delta", 1e-8)),
                               grad_scale=float(a.get("grad_scale", 1.0)),
                               decoupled=bool(a.get("decoupled")), step0=int(a.get("step0", 0)))
            return
        single = AdamWUpdate if a.get("decoupled") else AdamUpdate
        shared = {k: a[k] for k in ("momentum", "momentum2", "delta", "weight_decay",
                                    "grad_scale", "step0") if k in a}
        live = self.live()
        for k, (grad, off, size, lr_mult, decay_mult) in zip(live, self.segments(ins[5:])):
            views = [o[int(off):int(off) + int(size)].reshape(grad.shape) for o in outs]
            kernel = single(types.SimpleNamespace(
                name=self.op.name, op_type=single.op_type,
                attrs=dict(shared, lr_mult=lr_mult, decay_mult=decay_mult)))
            kernel.run([views[0], grad, views[1], views[2], lr, it], views)
            if k in copies:
                from .basic import cast_copy
                cast_copy(views[0], copies[k], a["copy_dtype"])


#: update op type and state names of each ``solver.type``
SOLVER_UPDATES = {"sgd": ("SGDUpdate", ("momentum",)),
                  "nesterov": (NesterovUpdate.op_type, NesterovUpdate.states),
                  "adagrad": (AdaGradUpdate.op_type, AdaGradUpdate.states),
                  "rmsprop": (RMSPropUpdate.op_type, RMSPropUpdate.states),
                  "adadelta": (AdaDeltaUpdate.op_type, AdaDeltaUpdate.states),
                  "adam": (AdamUpdate.op_type, AdamUpdate.states),
                  "adamw": (AdamWUpdate.op_type, AdamWUpdate.states)}
#: every op type that updates a parameter (its inputs: w, grad, states...)
UPDATE_OP_TYPES = frozenset(op for op, _ in SOLVER_UPDATES.values())
