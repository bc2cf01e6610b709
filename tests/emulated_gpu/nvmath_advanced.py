"""The emulated ``nvmath.linalg.advanced`` (nvmath-python 1.0's stateful
``Matmul`` as gpu/blaslt.py uses it): the cuBLASLt epilogues computed with
NumPy.

As the real one: ``Matmul(a, b, c=None, *, alpha, beta, qualifiers,
options, stream)`` keeps its operands (no copy for device arrays),
``plan(epilog=..., epilog_inputs={"bias": ..., "relu_aux": ...})`` chooses
the algorithms, ``autotune`` times them, ``execute(stream=...)`` allocates a
new result (and the auxiliary outputs: ``relu_aux``, ``drelu_bgrad``'s
``drelu_bgrad``, ``bgradb``) and returns it, or ``(result, aux dict)`` when
the epilogue has auxiliary outputs. Planning and autotuning allocate and
synchronise, so they are refused during a stream capture; ``execute``
allocates its result, refused there too (``capture.refuse_allocation``,
our house rule); its product is device work, queued or recorded into the
capture, reading its operands when it runs.

``use_emulated_nvmath_advanced(monkeypatch)`` installs it (next to the
emulated ``nvmath.bindings.cublas``), or with ``enabled=False`` makes it
fail to import. The bias is one value per row of the result (extent M,
stride 1), as cuBLASLt broadcasts it. ``LOG`` records ("plan" | "autotune" | "execute", epilog)."""
import enum
import sys
import types

import numpy as np

from . import capture
from .arrays import Allocations, DeviceArray

#: what the stand-in says when a plan is made inside a capture
PLAN_REFUSED = ("nvmath.linalg.advanced: planning or autotuning a matmul during a stream "
                "capture (it allocates and synchronises the device)")
LOG = []


class MatmulEpilog(enum.IntEnum):
    """cublasLtEpilogue_t values, as nvmath exposes them."""
    DEFAULT = 1
    RELU = 2
    RELU_AUX = 130
    BIAS = 4
    RELU_BIAS = 6
    RELU_AUX_BIAS = 134
    DRELU = 136
    DRELU_BGRAD = 152
    BGRADA = 256
    BGRADB = 512


def _refuse(what):
    if capture.is_capturing():
        raise RuntimeError(f"{PLAN_REFUSED}: {what}")


class Matmul:
    def __init__(self, a, b, c=None, *, alpha=None, beta=None, qualifiers=None, options=None,
                 stream=None):
        _refuse("Matmul()")
        if a.shape[-1] != b.shape[-2]:
            raise ValueError(f"The 'K' extent must match for the operands: K={a.shape[-1]} in "
                             f"operand A is not equal to K={b.shape[-2]} in operand B.")
        if a.dtype != b.dtype:
            raise ValueError("operands of different dtypes")
        self.a, self.b, self.c = a, b, c
        self.alpha = 1.0 if alpha is None else alpha
        self.beta = 0.0 if beta is None else beta
        self.epilog, self.inputs, self.planned = None, {}, False

    def plan(self, *, preferences=None, algorithms=None, epilog=None, epilog_inputs=None,
             stream=None):
        _refuse("plan")
        epilog = MatmulEpilog.DEFAULT if epilog is None else MatmulEpilog(epilog)
        inputs = dict(epilog_inputs or {})
        m = self.a.shape[-2]
        if epilog in (MatmulEpilog.BIAS, MatmulEpilog.RELU_BIAS, MatmulEpilog.RELU_AUX_BIAS):
            if "bias" not in inputs or tuple(inputs["bias"].shape) not in ((m,), (m, 1)):
                raise ValueError(f"The epilog {epilog.name} takes a bias of extent M={m}")
        if epilog in (MatmulEpilog.DRELU, MatmulEpilog.DRELU_BGRAD) and "relu_aux" not in inputs:
            raise ValueError(f"The epilog {epilog.name} takes the 'relu_aux' input")
        self.epilog, self.inputs, self.planned = epilog, inputs, True
        LOG.append(("plan", epilog.name))
        return ["emulated-algorithm"]

    def autotune(self, iterations=3, prune=None, release_workspace=False, stream=None):
        _refuse("autotune")
        LOG.append(("autotune", self.epilog.name))

    def reset_operands(self, a=None, b=None, c=None, alpha=None, beta=None,
                       epilog_inputs=None, stream=None):
        self.a = self.a if a is None else a
        self.b = self.b if b is None else b
        self.c = self.c if c is None else c
        self.inputs.update(epilog_inputs or {})

    def execute(self, *, algorithm=None, release_workspace=False, stream=None):
        if not self.planned:
            raise RuntimeError("Execution cannot be performed before plan() has been called.")
        m, n = self.a.shape[-2], self.b.shape[-1]
        capture.refuse_allocation("nvmath Matmul.execute (its result)", m * n)
        E = MatmulEpilog
        # the epilogues with a bias or an auxiliary matrix need the result in
        # column order (nvmath's epilog handlers: ``order`` COL); else a's order
        col = self.epilog in (E.BIAS, E.RELU_BIAS, E.RELU_AUX_BIAS, E.RELU_AUX, E.DRELU,
                              E.DRELU_BGRAD, E.BGRADB) or not self.a.flags.c_contiguous
        result = (np.empty((n, m), dtype=self.a.dtype).T if col else
                  np.empty((m, n), dtype=self.a.dtype)).view(DeviceArray)
        aux = {}
        if self.epilog in (E.RELU_AUX, E.RELU_AUX_BIAS):
            # a byte per element; the real one packs a bitmask (ceil(M/8) bytes
            # rounded up to 16, by N) that only cuBLASLt reads
            aux["relu_aux"] = np.empty((m, n), dtype=np.uint8).view(DeviceArray)
        if self.epilog == E.DRELU_BGRAD:
            aux["drelu_bgrad"] = np.empty((m,), dtype=self.a.dtype).view(DeviceArray)
        if self.epilog == E.BGRADB:
            aux["bgradb"] = np.empty((n,), dtype=self.a.dtype).view(DeviceArray)
        if self.epilog == E.BGRADA:
            aux["bgrada"] = np.empty((m,), dtype=self.a.dtype).view(DeviceArray)
        # nvmath-python allocates these from CuPy's pool at every call (seen on
        # an H200): device allocations, as the emulated cupy's own are
        for array in (result, *aux.values()):
            Allocations.note("nvmath Matmul.execute", array)
        a, b, c, epilog, inputs = self.a, self.b, self.c, self.epilog, self.inputs
        alpha, beta = self.alpha, self.beta

        def run():   # device work: reads the operands when it runs
            a_, b_ = np.asarray(a), np.asarray(b)   # plain views: host arithmetic
            d = alpha * (a_ @ b_)
            if c is not None:
                d = d + beta * np.asarray(c)
            if epilog in (E.BIAS, E.RELU_BIAS, E.RELU_AUX_BIAS):
                d = d + np.asarray(inputs["bias"]).reshape(-1, 1)
            if epilog in (E.DRELU, E.DRELU_BGRAD):
                d = np.where(np.asarray(inputs["relu_aux"]) != 0, d, 0)
            if epilog in (E.RELU, E.RELU_BIAS, E.RELU_AUX, E.RELU_AUX_BIAS):
                if "relu_aux" in aux:
                    np.asarray(aux["relu_aux"])[...] = d > 0
                d = np.maximum(d, 0)
            if epilog == E.DRELU_BGRAD:
                np.asarray(aux["drelu_bgrad"])[...] = d.sum(axis=1)
            if epilog == E.BGRADB:
                np.asarray(aux["bgradb"])[...] = b_.sum(axis=0)
            if epilog == E.BGRADA:
                np.asarray(aux["bgrada"])[...] = a_.sum(axis=1)
            np.asarray(result)[...] = d

        capture.device_work(run, capture.stream_of(getattr(stream, "ptr", 0) or 0)
                            if stream is not None else None)
        LOG.append(("execute", epilog.name))
        return (result, aux) if aux else result

    def free(self):
        self.planned = False


def use_emulated_nvmath_advanced(monkeypatch, enabled=True):
    """Install the emulated ``nvmath.linalg.advanced`` for this test (or make
    it fail to import); gpu/blaslt.py forgets its plans and its check."""
    from purine_mpi.gpu import SaidOnce, blaslt
    monkeypatch.setattr(blaslt, "_state", {"checked": False, "advanced": None,
                                           "reason": None})
    monkeypatch.setattr(blaslt, "_say_once", SaidOnce())
    monkeypatch.setattr(blaslt, "_plans", {})
    LOG.clear()
    if not enabled:
        for name in ("nvmath.linalg", "nvmath.linalg.advanced"):
            monkeypatch.setitem(sys.modules, name, None)
        return None
    advanced = types.ModuleType("nvmath.linalg.advanced")
    advanced.Matmul, advanced.MatmulEpilog = Matmul, MatmulEpilog
    linalg = types.ModuleType("nvmath.linalg")
    linalg.advanced, linalg.__path__ = advanced, []
    nvmath = sys.modules.get("nvmath")
    if nvmath is None:
        nvmath = types.ModuleType("nvmath")
        nvmath.__path__ = []
        monkeypatch.setitem(sys.modules, "nvmath", nvmath)
    monkeypatch.setattr(nvmath, "linalg", linalg, raising=False)
    monkeypatch.setitem(sys.modules, "nvmath.linalg", linalg)
    monkeypatch.setitem(sys.modules, "nvmath.linalg.advanced", advanced)
    return advanced
