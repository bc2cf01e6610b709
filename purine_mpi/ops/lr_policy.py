"""The learning-rate schedule as a graph op.

``LearningRate`` turns the iteration blob into the learning-rate blob each
iteration, by Caffe's policies (``learning_rate``); on a GPU one
single-thread kernel evaluates the same formula from the device iteration
blob (cuda/lr_policy.cu), so a captured CUDA graph replays the schedule.
Imports: NumPy, ``backend``, ``errors``, ``ops.registry``.
"""
import math

import numpy as np

from ..base.backend import get_xp
from ..base.errors import ConfigError, ShapeError
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
        try:
            rate = base / (1.0 + math.exp(-gamma * (it - stepsize)))
        except OverflowError:  # exp beyond float range: the rate is 0 (as in C)
            rate = base * 0.0
    elif policy in ("poly", "cosine"):
        max_iter = _need(attrs, "max_iter", policy)
        if max_iter < 0:
            raise ConfigError(None, "solver.max_iter", f"must be >= 0, got {max_iter}")
        # max_iter 0 (nothing to train, e.g. --iters 0): the horizon is passed
        frac = min(it, max_iter) / max_iter if max_iter else 1.0
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


def lr_policy_args(attrs):
    """The arguments of the device kernel (cuda/lr_policy.cu) for the policy
    in ``attrs``: a dict of policy code, base, gamma, power, stepsize,
    max_iter, min_lr, steps (ints), warmup, warmup_start. Unused values are 0."""
    learning_rate(attrs, 0)  # configuration errors, as on the host
    policy = attrs.get("lr_policy", "fixed")

    def num(key, default=0.0):
        value = attrs.get(key)
        return float(default if value is None else value)
    return {"policy": LR_POLICY_CODES[policy], "base": num("base_lr"), "gamma": num("gamma"),
            "power": num("power"), "stepsize": num("stepsize"), "max_iter": num("max_iter"),
            "min_lr": num("min_lr"),
            "steps": [int(v) for v in (attrs.get("stepvalues") or [])]
            if policy == "multistep" else [],
            "warmup": int(attrs.get("warmup_iters", 0) or 0),
            "warmup_start": num("warmup_start_factor")}


#: policy codes of cuda/lr_policy.cu
LR_POLICY_CODES = {"fixed": 0, "step": 1, "multistep": 2, "exp": 3, "inv": 4, "sigmoid": 5,
                   "poly": 6, "cosine": 7}


@register
class LearningRate(OpKernel):
    """[iter] -> [lr]: lr = learning_rate(attrs, iter) (see that function);
    iter is a 0-d int64 blob, lr a 0-d float32 blob. No gradient.

    On a GPU (lr a device blob) one single-thread kernel (cuda/lr_policy.cu)
    evaluates the same formula from the iteration blob on the device: no
    host work and no host round trip in the iteration (a ``fixed`` rate
    without warm-up is written once)."""

    op_type = "LearningRate"
    category = "update"

    @classmethod
    def infer(cls, attrs, ins):
        if int(np.prod(ins[0][0], dtype=np.int64)) != 1:
            raise ShapeError(f"LearningRate reads a scalar iteration blob, got shape "
                             f"{list(ins[0][0])}")
        learning_rate(attrs, 0)  # configuration errors surface at build time
        return [((), "float32")]

    def setup(self, ins, outs):
        self._device_args = None
        if get_xp(outs[0]) is not np:  # the policy's constants go to the device once
            args = lr_policy_args(self.attrs)
            args["steps"] = get_xp(outs[0]).asarray(np.asarray(args["steps"] or [0], np.int64))
            self._device_args = args

    def run(self, ins, outs):
        if get_xp(outs[0]) is not np:
            from ..gpu import kernels
            if getattr(self, "_device_args", None) is None:
                self.setup(ins, outs)
            args = self._device_args
            constant = args["policy"] == LR_POLICY_CODES["fixed"] and args["warmup"] <= 0
            if constant and getattr(self, "_written", None) is outs[0]:
                return  # a fixed rate: written once, nothing to launch after that
            it = ins[0] if get_xp(ins[0]) is not np else int(ins[0].reshape(()))
            kernels.learning_rate(it, outs[0], **args)
            self._written = outs[0]
            return
        outs[0].fill(learning_rate(self.attrs, int(np.asarray(ins[0]).reshape(()))))
