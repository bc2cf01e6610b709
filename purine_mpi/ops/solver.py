"""The solver as graph ops: the learning-rate schedule and Caffe's SGD update.

``LearningRate`` turns the iteration counter blob into the learning-rate blob
each iteration; one ``SGDUpdate`` per parameter then updates the weight and
its momentum in place (through alias blobs ``w@new``, ``w/momentum@new``,
which the graph orders after every other reader of the old values).

On a GPU (CuPy weights of float32/float64) the update is one fused raw
kernel (cuda/sgd.cu) instead of four element-wise passes. The learning rate
may be a host blob (read as a number: no sync) or a device blob (read by the
kernel: no host round trip either).
"""
import math

import numpy as np

from ..backend import get_xp
from ..errors import ConfigError, ShapeError
from ..gpu.raw import raw_kernels, same_buffer
from .registry import OpKernel, register

LR_POLICIES = ("fixed", "step", "multistep", "poly", "exp", "inv", "sigmoid", "cosine")


def _need(attrs, key, policy):
    if attrs.get(key) is None:
        raise ConfigError(None, f"solver.{key}", f"lr_policy '{policy}' needs {key}")
    return float(attrs[key])


def learning_rate(attrs, iteration):
    """The learning rate at ``iteration`` (0-based), Caffe's
    ``SGDSolver::GetLearningRate``:

    - fixed:     base_lr
    - step:      base_lr * gamma ^ floor(iter / stepsize)
    - multistep: base_lr * gamma ^ (number of stepvalues <= iter)
    - exp:       base_lr * gamma ^ iter
    - inv:       base_lr * (1 + gamma * iter) ^ (-power)
    - poly:      base_lr * (1 - iter / max_iter) ^ power
    - sigmoid:   base_lr / (1 + exp(-gamma * (iter - stepsize)))
    - cosine:    min_lr + (base_lr - min_lr) * (1 + cos(pi * iter / max_iter)) / 2

    poly and cosine hold iter at max_iter past the end (Caffe would return
    NaN or climb back up). With ``warmup_iters`` W > 0, the first W
    iterations multiply the policy's rate by a linear ramp
    ``f + (1 - f) * (iter + 1) / W``, f = ``warmup_start_factor`` (default 0),
    which reaches the policy's rate at iteration W - 1.
    """
    if attrs.get("base_lr") is None:
        raise ConfigError(None, "solver.base_lr", "the solver needs base_lr")
    base = float(attrs["base_lr"])
    policy = attrs.get("lr_policy", "fixed")
    it = int(iteration)
    if policy == "fixed":
        rate = base
    elif policy == "step":
        stepsize = int(_need(attrs, "stepsize", policy))
        if stepsize <= 0:
            raise ConfigError(None, "solver.stepsize", f"must be > 0, got {stepsize}")
        rate = base * _need(attrs, "gamma", policy) ** (it // stepsize)
    elif policy == "multistep":
        steps = attrs.get("stepvalues")
        if not steps:
            raise ConfigError(None, "solver.stepvalues", "lr_policy 'multistep' needs a list "
                              "of stepvalues")
        rate = base * _need(attrs, "gamma", policy) ** sum(1 for s in steps if int(s) <= it)
    elif policy == "exp":
        rate = base * _need(attrs, "gamma", policy) ** it
    elif policy == "inv":
        gamma, power = _need(attrs, "gamma", policy), _need(attrs, "power", policy)
        rate = base * (1.0 + gamma * it) ** (-power)
    elif policy == "sigmoid":
        gamma, stepsize = _need(attrs, "gamma", policy), _need(attrs, "stepsize", policy)
        rate = base / (1.0 + math.exp(-gamma * (it - stepsize)))
    elif policy in ("poly", "cosine"):
        max_iter = _need(attrs, "max_iter", policy)
        if max_iter <= 0:
            raise ConfigError(None, "solver.max_iter", f"must be > 0, got {max_iter}")
        frac = min(it, max_iter) / max_iter
        if policy == "poly":
            rate = base * (1.0 - frac) ** _need(attrs, "power", policy)
        else:
            min_lr = float(attrs.get("min_lr", 0.0))
            rate = min_lr + (base - min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))
    else:
        raise ConfigError(None, "solver.lr_policy", f"unknown lr_policy {policy!r}; "
                          f"use one of {', '.join(LR_POLICIES)}")
    warmup = int(attrs.get("warmup_iters", 0) or 0)
    if warmup > 0 and it < warmup:
        start = float(attrs.get("warmup_start_factor", 0.0))
        rate *= start + (1.0 - start) * (it + 1) / warmup
    return rate


@register
class LearningRate(OpKernel):
    """[iter] -> [lr]: lr = learning_rate(attrs, iter) (see that function);
    iter is a 0-d int64 blob, lr a 0-d float32 blob. No gradient."""

    op_type = "LearningRate"
    category = "update"

    @classmethod
    def infer(cls, attrs, ins):
        if int(np.prod(ins[0][0], dtype=np.int64)) != 1:
            raise ShapeError(f"LearningRate reads a scalar iteration blob, got shape "
                             f"{list(ins[0][0])}")
        learning_rate(attrs, 0)  # configuration errors surface at build time
        return [((), "float32")]

    def run(self, ins, outs):
        outs[0].fill(learning_rate(self.attrs, int(ins[0].reshape(()))))


@register
class SGDUpdate(OpKernel):
    """[w, grad, momentum, lr] -> [w_new, momentum_new] (aliases of w and
    momentum), Caffe's SGD with momentum and L2 weight decay:

        rate = lr * lr_mult
        v = momentum * v + rate * (grad_scale * grad + weight_decay * decay_mult * w)
        w = w - v

    Attrs ``momentum`` (0), ``weight_decay`` (0), ``lr_mult`` (1),
    ``decay_mult`` (1), ``grad_scale`` (1; the data-parallel composition sets
    1/N when grad is a sum over N ranks). No gradient."""

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
        xp = get_xp(w)
        k = raw_kernels(xp, w, grad, v)
        if k is not None and w_new.flags.c_contiguous and v_new.flags.c_contiguous:
            self._run_gpu(k, xp, ins, outs)
            return
        rate = float(lr.reshape(())) * float(a.get("lr_mult", 1.0))
        decay = float(a.get("weight_decay", 0.0)) * float(a.get("decay_mult", 1.0))
        # Element-wise ops with out= are safe when v_new is v and w_new is w
        # (the alias case); w is read in full before w_new is written.
        xp.multiply(v, float(a.get("momentum", 0.0)), out=v_new)
        v_new += grad * (rate * float(a.get("grad_scale", 1.0)))
        if decay:
            v_new += w * (rate * decay)
        xp.subtract(w, v_new, out=w_new)

    def _run_gpu(self, k, xp, ins, outs):
        """The fused kernel updates in place, so it works on the outputs
        (normally the aliases ``w@new``/``v@new``, i.e. ``w`` and ``v``
        themselves; otherwise w and v are copied there first)."""
        w, grad, v, lr = ins
        w_new, v_new = outs
        a = self.attrs
        lr_mult = float(a.get("lr_mult", 1.0))
        if get_xp(lr) is np:  # a host blob: a number, no sync
            rate = float(lr.reshape(())) * lr_mult
        else:  # a device blob: the kernel reads it, no host round trip
            rate = lr.reshape(()) if lr_mult == 1.0 else lr.reshape(()) * lr_mult
        for old, new in ((w, w_new), (v, v_new)):
            if not same_buffer(old, new):
                new[...] = old
        k.sgd_momentum_update(w_new, grad, v_new, rate,
                              momentum=float(a.get("momentum", 0.0)),
                              weight_decay=float(a.get("weight_decay", 0.0))
                              * float(a.get("decay_mult", 1.0)),
                              grad_scale=float(a.get("grad_scale", 1.0)))
