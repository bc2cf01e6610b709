"""Fused attention through cuDNN's scaled dot-product attention (SDPA), the
frontend's ``sdpa`` / ``sdpa_backward`` graphs (``nvidia-cudnn-frontend``,
docs/operations/Attention.md of NVIDIA/cudnn-frontend).

Runs on a GPU only; the tests emulate it (tests/emulated_gpu/cudnn.py, the
same ``pygraph`` calls executed with NumPy after cuDNN's documented
semantics).

The fused ``Attention`` op of a graph in ``precision: bf16`` or ``fp16``
(parallel/precision.py gives it a second output, the statistics) and its
``AttentionGrad`` take this path when it can:

    forward    O, stats = sdpa(q, k, v, attn_scale=1/sqrt(D), causal (top-left
               diagonal, right bound 0), generate_stats=True[, dropout])
    backward   dq, dk, dv = sdpa_backward(q, k, v, O, dO, stats, the same
               scale, mask and dropout)

``stats`` is the softmax's log-sum-exp per row, ``max_j S + ln sum_j
exp(S - max_j S)``, (B, H, T, 1) float32: the op's second output blob, so
the memory planner keeps it live from the forward to the backward (B H T
floats instead of the (B, H, T, T) probabilities).

The tensors are read where they lie: q, k, v are strided views of the
packed (B, T, 3C) qkv (strides [3CT, D, 3C, 1], BS3HD, "interleaved" in
cuDNN's support matrix), O, dO of the (B, T, C) context, dq, dk, dv of the
(B, T, 3C) gradient. Our blobs hold bfloat16 (float16) values in float32
storage (base/precision.py), cuDNN reads and writes the 16-bit type: the op
copies qkv, ctx and dctx into 16-bit scratch (bfloat16 as uint16: the upper
half of each float32, exact since the values are bfloat16 already) and
widens the results back; the copies, the plans' workspace and nothing else
are the op's scratch, reserved at setup. A qkv or ctx stored as bfloat16
bits (bf16 storage: parallel/precision.store_bits) is read as it is, no
copy (its 16-bit scratch then goes unused).

Dropout (the ops' attr ``dropout`` > 0, the layer's ``attn_dropout``;
``dropout=(p, seed, offset)`` in both graphs): cuDNN's Philox, the seed a
device int64 of each op made once from our run seed and the op's stream
(:func:`dropout_seed`, base/philox.py's keys; the plans are shared by the
ops of one shape, the seeds are not), the offset a device int64 of the op
written on its stream each run, iteration * B H T T (ops/attention.py
``_sdpa_dropout``), read at each replay; the backward redraws the same
mask. Its bits are cuDNN's, not those of ops/dropout.py: the SDPA path's
masks differ from the host's and the cuBLAS path's (which are the Dropout
op's), as its rounding does.

Plans are built in the op's ``setup`` (before any capture, as cuDNN
requires: building allocates and synchronises), for both directions at once
and cached by (device, B, H, T, D, dtype, causal, dropout): the forward and
its gradient take the same path or neither does. Each execution binds
CuPy's current stream to the handle, so it is captured with the iteration.

Where the frontend is missing, cuDNN unusable or a graph refused (head size
not a multiple of 8 or over 128/256, an old GPU, ...), the ops keep the
cuBLAS + softmax-kernel path (ops/attention.py); one line on standard error
says so, once per op type and reason. ``PURINE_SDPA=0`` turns the path off.
Nothing here imports ``cudnn`` or CuPy at import time.
"""
import math
import threading

import numpy as np

from . import SaidOnce

_lock = threading.Lock()
#: one line on standard error, once per key
say_once = SaidOnce()
_plans = {}   # key -> SdpaPlans or the exception that refused it
_state = {"checked": False, "module": None, "reason": None}

#: the 16-bit storage of each low dtype name on the device (CuPy has no bfloat16)
STORAGE = {"bfloat16": np.uint16, "float16": np.float16}


def reset():
    """Forget the plans, the availability check and the notes (tests)."""
    with _lock:
        say_once.clear()
        _plans.clear()
        _state.update(checked=False, module=None, reason=None)


def frontend():
    """The ``cudnn`` module when it and the cuDNN library load and
    ``PURINE_SDPA`` is not 0, else None (``reason()`` says why)."""
    with _lock:
        if _state["checked"]:
            return _state["module"]
    module, why = None, None
    from ..base import env
    if not env.get("PURINE_SDPA"):
        why = "PURINE_SDPA=0"
    else:
        try:
            import cudnn as module  # nvidia-cudnn-frontend
            if not module.backend_version():   # loads libcudnn: fails without it
                raise RuntimeError("cuDNN reports no backend version")
        except ImportError as exc:
            module, why = None, f"no cuDNN frontend ({exc})".splitlines()[0]
        except Exception as exc:
            module, why = None, f"cuDNN unusable: {type(exc).__name__}: {exc}".splitlines()[0]
    with _lock:
        _state.update(checked=True, module=module, reason=why)
    return module


def reason():
    frontend()
    return _state["reason"] or ""


def _strides(shape):
    out, step = [], 1
    for s in reversed(shape):
        out.append(step)
        step *= int(s)
    return list(reversed(out))


class SdpaPlans:
    """The forward and backward cuDNN graphs of one attention shape.

    ``key``: (B, H, T, D, dtype name, causal, dropout ratio). Raises when
    either graph is refused (the caller falls back)."""

    def __init__(self, cudnn, device, key):
        from .cudnn import _handle
        b, h, t, d, dtype, causal, ratio = key
        self.cudnn, self.device, self.key = cudnn, int(device), key
        self.dtype, self.causal, self.ratio = dtype, bool(causal), float(ratio)
        self.scale = 1.0 / math.sqrt(d)
        c = h * d
        self.dims = [b, h, t, d]
        self.qkv_stride = [t * 3 * c, d, 3 * c, 1]     # q, k, v in (B, T, 3C)
        self.ctx_stride = [t * c, d, c, 1]             # O, dO in (B, T, C)
        self.stats_dims, self.stats_stride = [b, h, t, 1], [h * t, t, 1, 1]
        self.offsets = (0, c, 2 * c)                   # q, k, v: elements into a row
        self.handle = _handle(cudnn, device)
        io = {"bfloat16": cudnn.data_type.BFLOAT16, "float16": cudnn.data_type.HALF}[dtype]
        self.io = io
        self.fwd, self.fwd_t = self._graph(backward=False)
        self.bwd, self.bwd_t = self._graph(backward=True)
        self.workspace_bytes = max(int(self.fwd.get_workspace_size()),
                                   int(self.bwd.get_workspace_size()))

    def _graph(self, backward):
        cudnn, f32 = self.cudnn, self.cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=self.io, intermediate_data_type=f32,
                          compute_data_type=f32, handle=self.handle)

        def tensor(name, stride, dims=None, dtype=None):
            return g.tensor(name=name, dim=list(dims or self.dims), stride=list(stride),
                            data_type=dtype or self.io)

        t = {n: tensor(n.upper(), self.qkv_stride) for n in ("q", "k", "v")}
        kw = {"attn_scale": self.scale}
        if self.causal:   # S[i, j] masked for j > i: top-left diagonal, right bound 0
            kw.update(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                      diagonal_band_right_bound=0)
        if self.ratio > 0:
            i64 = cudnn.data_type.INT64
            t["seed"] = tensor("Seed", [1, 1, 1, 1], [1, 1, 1, 1], i64)
            t["offset"] = tensor("Offset", [1, 1, 1, 1], [1, 1, 1, 1], i64)
            kw["dropout"] = (self.ratio, t["seed"], t["offset"])
        if not backward:
            o, stats = g.sdpa(name="sdpa", q=t["q"], k=t["k"], v=t["v"], generate_stats=True,
                              **kw)
            o.set_output(True).set_dim(self.dims).set_stride(self.ctx_stride) \
                .set_data_type(self.io)
            stats.set_output(True).set_dim(self.stats_dims).set_stride(self.stats_stride) \
                .set_data_type(f32)
            t.update(o=o, stats=stats)
        else:
            t["o"] = tensor("O", self.ctx_stride)
            t["do"] = tensor("dO", self.ctx_stride)
            t["stats"] = tensor("Stats", self.stats_stride, self.stats_dims, f32)
            dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=t["q"], k=t["k"], v=t["v"],
                                         o=t["o"], dO=t["do"], stats=t["stats"],
                                         use_deterministic_algorithm=True, **kw)
            for name, out in (("dq", dq), ("dk", dk), ("dv", dv)):
                out.set_output(True).set_dim(self.dims).set_stride(self.qkv_stride) \
                    .set_data_type(self.io)
                t[name] = out
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return g, t

    # -- execution: 16-bit copies in the op's scratch, then the graph
    def scratch_specs(self, backward, stored=()):
        """(shape, dtype) of the scratch of one direction, in ``take`` order:
        the 16-bit qkv, O (and dO, dqkv), then the workspace. ``stored``:
        the names among ``qkv``, ``o``, ``do``, ``dqkv`` whose arrays are
        stored as the 16-bit values themselves (bf16 storage: read or
        written as they are), which take no copy (an empty array in its
        place)."""
        b, h, t, d = self.dims
        low = STORAGE[self.dtype]
        names = [("qkv", 3), ("o", 1)] + ([("do", 1), ("dqkv", 3)] if backward else [])
        specs = [(((0,) if name in stored else (b, t, k * h * d)), low) for name, k in names]
        return specs + [((max(self.workspace_bytes, 1),), np.uint8)]

    def _run(self, graph, tensors, arrays, workspace):
        from . import import_cupy
        from .raw import data_ptr
        cupy = import_cupy()
        self.cudnn.set_stream(handle=self.handle, stream=cupy.cuda.get_current_stream().ptr)
        pack = {}
        for name, (array, offset) in arrays.items():
            pack[tensors[name]] = data_ptr(array) + offset * array.itemsize
        graph.execute(pack, data_ptr(workspace), handle=self.handle)

    def _packed(self, qkv16):
        return {n: (qkv16, off) for n, off in zip(("q", "k", "v"), self.offsets)}

    def _dropout(self, dropout):
        if self.ratio <= 0:
            return {}
        if dropout is None:
            raise ValueError("SDPA plans with dropout need the op's (seed, offset) device int64s")
        seed, offset = dropout
        return {"seed": (seed, 0), "offset": (offset, 0)}

    def forward(self, qkv, ctx, stats, scratch, dropout=None):
        """ctx, stats <- SDPA(qkv): qkv, ctx float32 device arrays holding
        ``dtype`` values (ctx may be uint16, the bfloat16 values' own bits:
        bf16 storage; cuDNN writes it directly, and the backward reads it
        so); stats (B, H, T, 1) float32; ``scratch``: arrays of
        ``scratch_specs(False)``; ``dropout``: (seed, offset), one-element
        device int64 arrays, with a dropout ratio (read when it runs)."""
        qkv16, o16, workspace = scratch
        bits = np.dtype(ctx.dtype) == np.dtype(np.uint16)   # ctx stored as the 16-bit values
        qkv16 = _narrowed(qkv, qkv16, self.dtype)
        arrays = dict(self._packed(qkv16), o=(ctx if bits else o16, 0), stats=(stats, 0))
        arrays.update(self._dropout(dropout))
        self._run(self.fwd, self.fwd_t, arrays, workspace)
        if not bits:
            widen(o16, ctx, self.dtype)

    def backward(self, dctx, qkv, ctx, stats, dqkv, scratch, dropout=None):
        """dqkv <- SDPA's gradient from dctx, qkv, the forward's ctx and stats
        (and with dropout the forward's seed and offset: the same mask).
        Each of qkv, ctx, dctx stored as bfloat16 bits (uint16: bf16
        storage) is read as it is, and a dqkv stored so is written by cuDNN
        itself (no widening)."""
        qkv16, o16, do16, dqkv16, workspace = scratch
        qkv16 = _narrowed(qkv, qkv16, self.dtype)
        o16 = _narrowed(ctx, o16, self.dtype)
        do16 = _narrowed(dctx, do16, self.dtype)
        bits = np.dtype(dqkv.dtype) == np.dtype(np.uint16)   # stored as the 16-bit values
        target = dqkv if bits else dqkv16
        arrays = dict(self._packed(qkv16), o=(o16, 0), do=(do16, 0), stats=(stats, 0))
        arrays.update({n: (target, off) for n, off in zip(("dq", "dk", "dv"), self.offsets)})
        arrays.update(self._dropout(dropout))
        self._run(self.bwd, self.bwd_t, arrays, workspace)
        if not bits:
            widen(dqkv16, dqkv, self.dtype)


def dropout_seed(key0, key1, ctr1=0):
    """The int64 SDPA dropout seed of a Philox stream's keys
    (base/philox.dropout_keys: the op's crc32, the run seed's words): key0
    in the low word, key1 (the run seed's low word) xor the high word's
    counter word in the high one, as a signed int64."""
    value = (int(key0) & 0xFFFFFFFF) | (((int(key1) ^ int(ctr1)) & 0xFFFFFFFF) << 32)
    return value - (1 << 64) if value >= 1 << 63 else value


def _bits_kernels(*arrays):
    """Whether the bfloat16 conversions of ``arrays`` run as the wire
    kernels of cuda/precision.cu (device arrays, C-contiguous): one pass
    each, where CuPy's strided copies took two passes to widen."""
    from ..base.backend import get_xp
    return get_xp(arrays[0]) is not np and all(a.flags.c_contiguous for a in arrays)


def _narrowed(x, out, dtype):
    """x's 16-bit values: ``x`` itself where it is stored as them (uint16,
    bfloat16 bits: bf16 storage), else ``narrow``-ed into ``out``."""
    if np.dtype(x.dtype) == np.dtype(np.uint16):
        return x
    narrow(x, out, dtype)
    return out


def narrow(x, out, dtype):
    """out (16-bit storage) <- the float32 array x's ``dtype`` values:
    bfloat16 the upper halves of the float32s (exact: x holds bfloat16
    values; on a device ``to_bf16_bits_device``, whose rounding leaves such
    values as they are), float16 a cast. Allocates nothing."""
    if dtype == "bfloat16" and _bits_kernels(x, out):
        from .kernels import to_bf16_bits_device
        to_bf16_bits_device(x.reshape(-1), out.reshape(-1))
    elif dtype == "bfloat16":
        out[...] = x.view(np.uint16)[..., 1::2]    # little-endian: the high half
    else:
        out[...] = x


def widen(x16, out, dtype):
    """out (float32) <- the 16-bit values x16, exactly (bfloat16 on a
    device: ``from_bf16_bits_device``, one pass)."""
    if dtype == "bfloat16" and _bits_kernels(x16, out):
        from .kernels import from_bf16_bits_device
        from_bf16_bits_device(x16.reshape(-1), out.reshape(-1))
    elif dtype == "bfloat16":
        halves = out.view(np.uint16)
        halves[..., 1::2] = x16
        halves[..., 0::2] = 0
    else:
        out[...] = x16


def plans(op_type, device, key):
    """The :class:`SdpaPlans` of ``key`` on ``device``, built once, or None:
    the fallback, said once per op type and reason."""
    cudnn = frontend()
    if cudnn is None:
        _note(op_type, reason())
        return None
    full = (int(device),) + tuple(key)
    with _lock:
        got = _plans.get(full)
    if got is None:
        try:
            got = SdpaPlans(cudnn, device, key)
        except Exception as exc:
            got = exc
        with _lock:
            _plans[full] = got
    if isinstance(got, Exception):
        _note(op_type, f"cuDNN refused B,H,T,D={key[:4]} {key[4]}: {type(got).__name__}: "
                       f"{str(got).splitlines()[0] if str(got) else ''}".rstrip(": "))
        return None
    say_once(("on", op_type), f"purine_mpi: {op_type} ops run cuDNN's fused attention "
                              f"(SDPA, {key[4]})")
    return got


def _note(op_type, why):
    say_once(("off", op_type, why), f"purine_mpi: {op_type} ops use cuBLAS + the softmax "
                                    f"kernels, not cuDNN's fused attention ({why})")
