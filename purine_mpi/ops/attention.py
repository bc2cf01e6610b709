"""Multi-head (causal) self-attention: the ops of the ``attention`` layer.

The layer projects its (N, T, C) input to ``qkv`` (N, T, 3C) with an
InnerProduct over the last axis (rows of the weight: q, then k, then v;
head h of q is q's columns h*D..(h+1)*D, D = C/H, nanoGPT's c_attn layout),
and ``qkv`` is read in place as q, k, v of shape (N, H, T, D) each. Then,
for every sequence n and head h::

    S = q k^T / sqrt(D)                  (T, T), S[i, j] = -inf for j > i (causal)
    P = softmax(S) over the last axis    max-subtracted: exp(S - max_j S)
    O = P v                              (T, D), written as ctx[n, :, h*D:(h+1)*D]

and an output projection (InnerProduct, c_proj) maps ctx (N, T, C) back.

Two paths compute the middle, both differentiated by their own gradient ops:

- the raw sub-graph: "AttentionScores" [qkv] -> [S] (N, H, T, T), the
  existing "Softmax" over axis 3 -> [P], an optional dropout on P, and
  "AttentionContext" [P, qkv] -> [ctx]. Gradients::

      dS = "SoftmaxGrad";  dq = dS k / sqrt(D),  dk = dS^T q / sqrt(D)
      dP = dO v^T,  dv = P^T dO          ("AttentionScoresGrad", "AttentionContextGrad";
                                          the two parts of dqkv are summed)

- the fused single op "Attention" [qkv] -> [ctx] keeping nothing else; its
  gradient "AttentionGrad" [dctx, qkv] -> [dqkv] recomputes S and P instead
  of keeping the (N, H, T, T) probabilities::

      dP = dO v^T,  dS = P (dP - rowsum(dP * P)),  dq = dS k / sqrt(D),
      dk = dS^T q / sqrt(D),  dv = P^T dO

On the host without dropout the fused ops take a group of sequences at a
time (``HOST_GROUP_BYTES`` of scores: one sequence of gpt_tiny), so their
temporaries are the group's (g, H, T, T) and stay in cache; the values are
the whole batch's, bit for bit (tests/test_host_temporaries.py). They hold
the scores transposed, S^T = k q^T / sqrt(D) (keys along the rows), so
the softmax's reductions over the keys (the max, the sum, dP's rowsum
against P) are NumPy reductions along the leading axis of each matrix,
element-wise over contiguous rows, instead of 128-element reductions along
every row (the row max alone cost ~2.7 ms a gpt_tiny attention);
the products read P^T and dS^T as BLAS transposes (no copies). The scores
and their max are the same bits as the row layout's; the softmax's sums
are BLAS matrix-vector products with ones and dP's rowsum against P one
einsum (no product array), in other orders than NumPy's pairwise sums
along a row, so P and what follows differ in the last bits from the raw
sub-graph's (tests/test_gpt_layers.py checks both against PyTorch).

Attr ``num_heads`` (H, dividing C), ``causal`` (default true). Every mask
position is exactly -inf before the softmax, so it gets probability 0 and
gradient 0; the diagonal is never masked, so no row is all -inf.

Dropout on the probabilities (the layer's ``attn_dropout`` in training):
the fused ops take attr ``dropout`` (the ratio) and ``stream`` (the op
whose Philox stream they draw: the name the raw sub-graph's Dropout op
gets, ``<layer>.attn_drop``) and the iteration blob as their last input,
and compute exactly what the raw sub-graph's Dropout op does between the
softmax and the context (ops/dropout.py: the same mask, keyed by (run seed,
stream) and counted by (element, iteration), the same products; a
tensor-parallel shard's ops, attr ``mask_split`` {axis 1, parts t, index
k}, count the element in the unsplit (N, H, T, T) array, so heads
k·H/t.. get the unsplit model's masks of those heads)::

    forward   P' = P * mask / (1 - ratio),  O = P' v
    gradient  dv = P'^T dO,  dP = (dO v^T) * mask / (1 - ratio),  then dS as above

On the host the forward keeps the mask bit-packed (attr ``packed_mask``,
set by the layer: a second output ``<layer>.attn_mask.bits``, uint8, 1 bit
an element, ceil(N H T T / 8) bytes, 1/32 of a float32 mask; the packing of
ops/dropout.py's ``packed_mask``) and the gradient reads it (before the
iteration: [dctx, qkv, bits, iter]) and unpacks it instead of drawing
Philox again (a host draw costs ~50 times an unpack). On a GPU a Philox
draw is one cheap kernel: placement (parallel/placement.py,
``redraw_attention_masks``) drops the packed mask and the gradient redraws
it (same stream, same iteration), so nothing of (N, H, T, T) outlives the
op there. Activation recompute's copy of the op (graph/recompute.py) draws
nothing on the host either: attr ``replay_mask``, it reads the original's
packed mask ([qkv, bits, iter] -> [ctx]) and unpacks it as the gradient
does, writing no mask of its own (placement on a GPU drops the input and
the attr with the packed output: the copy redraws there). Either way the
fused and the raw paths give the same bits on the CPU. On the SDPA path
cuDNN draws its own mask (gpu/sdpa.py).

On a GPU the products are cuBLAS calls through gpu/blas.py (nvmath's
binding, capturable in a CUDA graph): one strided-batched GEMM per head,
batched over the N sequences, reading q, k, v where they lie in ``qkv`` and
writing ctx, dqkv in place (no transposed copies); the softmax and its
gradient are the raw kernels of the Softmax op (cuda/softmax_loss.cu), the
mask one element-wise add of a (T, T) mask made once, the intermediate
(N, H, T, T) arrays the op's scratch. Nothing is allocated per iteration.

With bf16 storage (parallel/precision.store_bits) the fused ops take qkv
stored as bfloat16 bits (``bits_inputs``): cuDNN's SDPA reads them as they
are; the cuBLAS path widens them exactly into a float32 array of qkv's
size in its scratch (``_wide_qkv``; the host path into a new array) and
computes as from the float32 storage of the same values: the same bits.
"""
import functools
import math

import numpy as np

from ..base.backend import get_xp
from ..base.errors import ShapeError
from ..base.precision import is_bits, to_bf16_bits, value_dtype, wire_scratch
from ..gpu.raw import narrow, raw_kernels, widen
from ..base.philox import keep_mask_temporaries
from .dropout import (PhiloxStream, _check_packed, _ratio, check_iteration, dropout_backward,
                      dropout_forward, pack_mask, packed_shape, unpack_mask, unpack_temporaries)
from .hostgemm import matmul
from .im2col import gemm_holds, shared, shared_hold
from .registry import (OpKernel, ProductKernel, gradient, out_dtype, register, spans,
                       specs_nbytes)


def gemm(*args, **kwargs):
    from ..gpu.blas import gemm as cublas_gemm
    return cublas_gemm(*args, **kwargs)


def _dims(attrs, qkv_shape):
    """(N, T, C, H, D) of a qkv blob of shape (N, T, 3C)."""
    if len(qkv_shape) != 3 or qkv_shape[2] % 3:
        raise ShapeError(f"attention needs a (N, T, 3C) qkv blob, got {list(qkv_shape)}")
    n, t, c3 = (int(s) for s in qkv_shape)
    h = int(attrs.get("num_heads", 1))
    c = c3 // 3
    if h < 1 or c % h:
        raise ShapeError(f"attention: num_heads {h} must divide the width {c}")
    return n, t, c, h, c // h


def split_heads(qkv, heads):
    """q, k, v of a (N, T, 3C) array as (N, H, T, D) views (no copy)."""
    n, t, c3 = qkv.shape
    d = c3 // 3 // heads
    q, k, v = (qkv.reshape(n, t, 3, heads, d)[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    return q, k, v


def heads_view(x, heads):
    """A (N, T, C) array as (N, H, T, D), a view."""
    n, t, c = x.shape
    return x.reshape(n, t, heads, c // heads).transpose(0, 2, 1, 3)


#: on the host without dropout the fused ops run a group of sequences at a
#: time: its (g, H, T, T) scores at most this many bytes (at least one
#: sequence), so P, dP and the softmax's passes over them stay in the
#: core's L2 cache instead of streaming N H T T floats through memory for
#: every pass (gpt_tiny: 256 KiB a sequence, one at a time; the whole
#: batch's 8 MiB made each pass a trip to memory). Every element's value is
#: what the whole batch gives: the products are one BLAS call per matrix
#: either way (ops/hostgemm.py) and the softmax's reductions run along rows
HOST_GROUP_BYTES = 1 << 18


def bmm(xp, a, b, out, trans_a=False, trans_b=False, alpha=1.0):
    """out = alpha * op(a) @ op(b) for (N, H, ., .) arrays whose matrices have
    contiguous rows (views into qkv and ctx included), op a transpose when
    asked: on a GPU one strided-batched cuBLAS GEMM per head over the N
    sequences (gpu/blas.py), else NumPy's matmul."""
    if raw_kernels(xp, a, b, out) is not None:
        for h in range(a.shape[1]):
            gemm(a[:, h], b[:, h], out[:, h], trans_a=trans_a, trans_b=trans_b, alpha=alpha)
        return
    matmul(xp, a.swapaxes(-1, -2) if trans_a else a, b.swapaxes(-1, -2) if trans_b else b,
              out=out)
    if alpha != 1.0:
        out *= alpha


def causal_hold(t, dtype, transposed=False):
    """The Hold (ops/im2col.shared_hold) of the host's (T, T) causal mask
    addend, or with ``transposed`` its transpose (the fused ops' host path
    holds the scores transposed): one array per process of each length and
    dtype, whichever kernel or thread reads it (``plan``'s host scratch row
    counts it once)."""
    return shared_hold("causal_mask_t" if transposed else "causal_mask", (t, t), dtype)


def host_causal_mask(t, dtype, transposed=False):
    """The process's (T, T) causal mask addend on the host (``causal_hold``):
    0 on and below the diagonal, -inf above it (s + -inf = -inf exactly);
    with ``transposed`` its transpose (-inf below the diagonal), made once,
    read-only."""
    def make():
        inf = np.full((t, t), -np.inf, dtype=dtype)
        return np.tril(inf, -1) if transposed else np.triu(inf, 1)
    return shared(causal_hold(t, dtype, transposed), make)


class _AttentionKernel(OpKernel):
    """What the attention ops share: the causal mask (on the host the
    process's one per length and dtype, ``host_causal_mask``; on a GPU the
    kernel's own, made once per length)."""

    _mask = None

    def rounds_own_outputs(self, ins, outs):
        """(0,) on cuDNN's SDPA path (``_sdpa``: Attention's ctx,
        AttentionGrad's dqkv): cuDNN writes the output in the op's low type
        and gpu/sdpa.widen widens it exactly, so it holds bfloat16 (float16)
        values already and the precision pass's rounding after the run
        (ops/registry.py's ``rounds_own_outputs`` hook) would leave it as it
        is: GPT-2 bf16's 24 rounds of 12 x ((16, 1024, 768) + (16, 1024,
        2304)) float32 a step. () on the cuBLAS path (float32 products)."""
        return (0,) if getattr(self, "_sdpa", None) is not None else ()

    @property
    def ratio(self):
        """The dropout ratio on the probabilities (attr ``dropout``, default 0)."""
        return _ratio(self.attrs, "dropout", 0.0)

    def mask(self, xp, t, dtype):
        """The (T, T) causal mask as an addend: 0 on and below the diagonal,
        -inf above it (s + -inf = -inf exactly), on the arrays' device, made
        once (on the host the process's, ``host_causal_mask``)."""
        if xp is np:
            return host_causal_mask(t, dtype)
        if self._mask is None or self._mask.shape[0] != t or self._mask.dtype != dtype:
            self._mask = xp.triu(xp.full((t, t), -np.inf, dtype=dtype), 1)
        return self._mask

    def host_scratch(self, ins, outs):
        """The host's causal mask (``causal_hold``), transposed on the fused
        ops' path without dropout (``host_probs_t``), none when not causal;
        the scores' products' scratch (``score_product_holds``)."""
        qkv = self.qkv_input(ins)
        fused = isinstance(self, _FusedAttention)
        group = host_group(self, qkv) if fused else None
        products = score_product_holds(self.attrs, qkv, group)
        if not bool(self.attrs.get("causal", True)):
            return products
        return [causal_hold(qkv.shape[1], qkv.dtype, group is not None)] + products

    def qkv_input(self, ins):
        """The op's qkv input (its first)."""
        return ins[0]

    def host_probs_t(self, q, k, out):
        """out = P^T (g, H, T, T) of the host path without dropout: the
        scores S^T = k q^T / sqrt(D) (-inf above S's diagonal when causal)
        and their softmax over the keys, the leading axis of each matrix."""
        matmul(np, k, q.swapaxes(-1, -2), out=out)
        out *= 1.0 / math.sqrt(q.shape[-1])
        if bool(self.attrs.get("causal", True)):
            out += host_causal_mask(out.shape[-1], out.dtype, transposed=True)
        out -= out.max(axis=-2, keepdims=True)
        np.exp(out, out=out)
        out /= key_sums(out)[..., None, :]

    def scores(self, xp, q, k, out):
        """out = q k^T / sqrt(D), -inf above the diagonal when causal."""
        bmm(xp, q, k, out, trans_b=True, alpha=1.0 / math.sqrt(q.shape[-1]))
        if bool(self.attrs.get("causal", True)):
            out += self.mask(xp, out.shape[-1], out.dtype)

    def setup_mask(self, like, t):
        if get_xp(like) is not np:
            self.mask(get_xp(like), t, value_dtype(like.dtype))


def score_product_holds(attrs, qkv, group=None):
    """[Hold] of the scratch of the host products (T, D) @ (D, T) of the
    scores (q k^T, k q^T) and of dP (dO v^T, v dO^T): a head's, cut along
    D when it is a lone 2-D product (one head of one sequence: a group of
    1, or a batch of 1) of few rows (ops/im2col.gemm_holds; the other
    products' inner size is T, too short to cut where the rows are few).
    ``group``: the sequences a host group takes (``host_group``), None the
    whole batch."""
    n, t, _, h, d = _dims(attrs, qkv.shape)
    sizes = {n} if group is None else {s.stop - s.start for s in spans(n, group)}
    return gemm_holds(value_dtype(qkv.dtype), *(((b, h, t, d), (b, h, d, t)) for b in sizes))


def key_sums(pt):
    """The sums of P^T (..., T, T) over its keys (axis -2): one BLAS
    matrix-vector product per matrix (~3x NumPy's sum along that axis)."""
    return np.matmul(_ones(pt.shape[-2], pt.dtype), pt)


@functools.lru_cache(maxsize=8)
def _ones(n, dtype):
    """A read-only vector of ``n`` ones, made once per length and dtype."""
    ones = np.ones(n, dtype)
    ones.flags.writeable = False
    return ones


def softmax_rows(xp, s):
    """s = softmax(s) over the last axis, in place, max-subtracted (on a GPU
    the Softmax op's raw kernel)."""
    k = raw_kernels(xp, s)
    rows = s.reshape(-1, s.shape[-1])
    if k is not None:
        k.softmax_forward(rows, out=rows)
        return
    s -= s.max(axis=-1, keepdims=True)
    xp.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)


def softmax_rows_grad(xp, dp, p):
    """dp = p * (dp - rowsum(dp * p)), in place (the Softmax op's gradient)."""
    k = raw_kernels(xp, dp, p)
    if k is not None:
        rows = dp.reshape(-1, dp.shape[-1])
        k.softmax_backward(rows, p.reshape(rows.shape), out=rows)
        return
    dp -= (dp * p).sum(axis=-1, keepdims=True)
    dp *= p


@register
class AttentionScores(ProductKernel, _AttentionKernel):
    """[qkv] -> [S]: S = q k^T / sqrt(D), -inf above the diagonal when causal."""

    op_type = "AttentionScores"

    @classmethod
    def infer(cls, attrs, ins):
        n, t, _, h, _ = _dims(attrs, ins[0][0])
        return [((n, h, t, t), ins[0][1])]

    def setup(self, ins, outs):
        self.setup_mask(ins[0], ins[0].shape[1])

    def run(self, ins, outs):
        qkv = ins[0]
        q, k, _ = split_heads(qkv, int(self.attrs["num_heads"]))
        self.scores(get_xp(qkv), q, k, outs[0])


@register
class AttentionScoresGrad(ProductKernel):
    """[dS, qkv] -> [dqkv]: dq = dS k / sqrt(D), dk = dS^T q / sqrt(D), dv = 0."""

    op_type = "AttentionScoresGrad"

    @classmethod
    def infer(cls, attrs, ins):
        return [ins[1]]

    def run(self, ins, outs):
        ds, qkv = ins
        xp = get_xp(qkv)
        heads = int(self.attrs["num_heads"])
        q, k, _ = split_heads(qkv, heads)
        dq, dk, dv = split_heads(outs[0], heads)
        scale = 1.0 / math.sqrt(q.shape[-1])
        bmm(xp, ds, k, dq, alpha=scale)
        bmm(xp, ds, q, dk, trans_a=True, alpha=scale)
        dv[...] = 0


@gradient("AttentionScores")
def _scores_grad(g, op):
    ds = g.grad_of(op.outputs[0])
    if ds is not None and g.needs_grad(op.inputs[0]):
        g.emit("AttentionScoresGrad", [ds, op.inputs[0]], [g.grad_blob(op.inputs[0])],
               {"num_heads": op.attrs["num_heads"]})


@register
class AttentionContext(ProductKernel):
    """[P, qkv] -> [ctx]: ctx[:, :, head h] = P_h v_h, heads side by side (N, T, C)."""

    op_type = "AttentionContext"

    @classmethod
    def infer(cls, attrs, ins):
        (ps, _), (qs, qd) = ins
        n, t, c, h, _ = _dims(attrs, qs)
        if tuple(ps) != (n, h, t, t):
            raise ShapeError(f"AttentionContext: probabilities {list(ps)} do not fit qkv "
                             f"{list(qs)} with {h} heads")
        return [((n, t, c), qd)]

    def run(self, ins, outs):
        p, qkv = ins
        heads = int(self.attrs["num_heads"])
        _, _, v = split_heads(qkv, heads)
        bmm(get_xp(qkv), p, v, heads_view(outs[0], heads))


@register
class AttentionContextGrad(ProductKernel):
    """[dctx, P, qkv] -> the gradients named in attr ``outputs`` (dP, dqkv):
    dP = dO v^T; dqkv: dv = P^T dO, dq = dk = 0."""

    op_type = "AttentionContextGrad"

    @classmethod
    def infer(cls, attrs, ins):
        shapes = {"dP": ins[1], "dqkv": ins[2]}
        return [shapes[o] for o in attrs["outputs"]]

    def host_scratch(self, ins, outs):
        """dP's product's scratch (``score_product_holds``)."""
        return score_product_holds(self.attrs, ins[2]) if "dP" in self.attrs["outputs"] else []

    def run(self, ins, outs):
        dctx, p, qkv = ins
        xp = get_xp(qkv)
        heads = int(self.attrs["num_heads"])
        got = dict(zip(self.attrs["outputs"], outs))
        _, _, v = split_heads(qkv, heads)
        do = heads_view(dctx, heads)
        if "dP" in got:
            bmm(xp, do, v, got["dP"], trans_b=True)
        if "dqkv" in got:
            dq, dk, dv = split_heads(got["dqkv"], heads)
            dq[...] = 0
            dk[...] = 0
            bmm(xp, p, do, dv, trans_a=True)


@gradient("AttentionContext")
def _context_grad(g, op):
    dctx = g.grad_of(op.outputs[0])
    if dctx is None:
        return
    p, qkv = op.inputs
    wanted = [(name, blob) for name, blob in (("dP", p), ("dqkv", qkv)) if g.needs_grad(blob)]
    if wanted:
        g.emit("AttentionContextGrad", [dctx, p, qkv], [g.grad_blob(b) for _, b in wanted],
               {"num_heads": op.attrs["num_heads"], "outputs": [n for n, _ in wanted]})


def _wide_qkv(qkv, sdpa=False):
    """[the float32 widening of qkv] where qkv is stored as bfloat16 bits and
    the cuBLAS (or host) path computes from it; [] else (cuDNN's SDPA reads
    the bits themselves)."""
    if sdpa or not is_bits(qkv.dtype):
        return []
    return [(tuple(qkv.shape), np.float32)]


def _widened(qkv, temps):
    """qkv as float32 values: as it is, or where it is bfloat16 bits widened
    (exactly) into the first of ``temps`` (``_wide_qkv``), which is taken
    off; returns (qkv, the rest of temps)."""
    if not is_bits(qkv):
        return qkv, temps
    wide, *rest = temps
    return widen(qkv, wide), rest


def _scores_spec(qkv, heads):
    n, t = qkv.shape[:2]
    return ((n, heads, t, t), value_dtype(qkv.dtype))


def _scores_spec_of(attrs, qkv_shape):
    """The (N, H, T, T) shape of the probabilities of a qkv of ``qkv_shape``."""
    n, t, _, h, _ = _dims(attrs, qkv_shape)
    return (n, h, t, t)


def _sdpa_key(kernel, qkv):
    """The SDPA plan key of an op marked ``sdpa`` (parallel/precision.py) in
    bf16/fp16 whose arrays live on a GPU, else None (today's path)."""
    dtype = kernel.attrs.get("compute_dtype")
    if not kernel.attrs.get("sdpa") or dtype not in ("bfloat16", "float16") \
            or get_xp(qkv) is np or qkv.dtype != np.float32 and not (
                is_bits(qkv) and dtype == "bfloat16"):
        return None
    n, t, _, h, d = _dims(kernel.attrs, qkv.shape)
    return (n, h, t, d, dtype, bool(kernel.attrs.get("causal", True)), kernel.ratio)


def _sdpa_plans(kernel, qkv):
    """The op's cuDNN SDPA plans (gpu/sdpa.py), or None: today's path. With
    dropout the op's own device seed (made here, once) and offset: see
    ``_sdpa_dropout``."""
    key = _sdpa_key(kernel, qkv)
    if key is None:
        return None
    from ..gpu import sdpa
    from ..gpu.raw import array_device
    plans = sdpa.plans(kernel.op_type, array_device(qkv), key)
    if plans is not None and kernel.ratio > 0:
        xp = get_xp(qkv)
        kernel._sdpa_rng = (xp.asarray(np.array([sdpa.dropout_seed(*kernel.keys)], np.int64)),
                            xp.zeros((1,), np.int64))
    return plans


def _sdpa_dropout(kernel, it):
    """(seed, offset) device int64s of the op's SDPA dropout at iteration
    blob ``it`` (None without dropout): the seed made once from (run seed,
    stream); the offset iteration * (B H T T), written on the device by
    the op's own stream each run (captured with it), so the Philox
    counters of two iterations never overlap (cuDNN offsets a counter per
    element; the iteration itself would shift the same stream by one)."""
    if kernel.ratio <= 0:
        return None
    seed, offset = kernel._sdpa_rng
    n, h, t = kernel._sdpa.dims[:3]
    stride = np.int64(n * h * t * t)
    if get_xp(it) is np:
        offset[...] = np.int64(int(np.asarray(it).reshape(())) * int(stride))
    else:
        get_xp(offset).multiply(it.reshape((1,)), stride, out=offset)
    return seed, offset


def packed(attrs):
    """Whether a fused op with dropout keeps its mask bit-packed (attr
    ``packed_mask``; the host path, see the module docstring)."""
    return bool(attrs.get("packed_mask")) and _ratio(attrs, "dropout", 0.0) > 0


def replays(attrs):
    """Whether a fused forward op with dropout reads a kept bit-packed mask
    instead of drawing one (attr ``replay_mask``: activation recompute's
    copy, graph/recompute.py; the input before the iteration)."""
    return bool(attrs.get("replay_mask")) and _ratio(attrs, "dropout", 0.0) > 0


def _check_dropout_inputs(what, attrs, ins, base):
    """The iteration input of a fused op with dropout: ``ins[base]``, the
    last; none without."""
    ratio = _ratio(attrs, "dropout", 0.0)
    want = base + (1 if ratio > 0 else 0)
    if len(ins) != want:
        raise ShapeError(f"{what} takes {base} input(s)" + (
            " and the iteration blob (its dropout mask is counted by it)" if ratio > 0 else "")
            + f", got {len(ins)}")
    if ratio > 0:
        check_iteration(what, ins[base])


def _stored(**arrays):
    """The names of ``arrays`` stored as bfloat16 bits (SDPA reads or
    writes them as they are: no 16-bit copy in its scratch)."""
    return {name for name, a in arrays.items() if a is not None and is_bits(a.dtype)}


def _wide_ctx(outs, host=False):
    """A float32 ctx (and on the host to_bf16_bits's scratch) where the
    output ctx is stored as bfloat16 bits and the cuBLAS path computes it;
    [] else."""
    if not outs or not is_bits(outs[0]):
        return []
    specs = [(tuple(outs[0].shape), np.float32)]
    return specs + ([(wire_scratch(outs[0].size).shape, np.uint32)] if host else [])


def _probs_specs(kernel, qkv, count):
    """``count`` (N, H, T, T) arrays, and with dropout one more: the mask."""
    spec = _scores_spec(qkv, int(kernel.attrs["num_heads"]))
    return [spec] * (count + (1 if kernel.ratio > 0 else 0))


def host_group(kernel, qkv):
    """The sequences a host run of a fused op takes at a time
    (``HOST_GROUP_BYTES``), or None: the whole batch at once (dropout: its
    mask is one Philox draw over the whole (N, H, T, T) array). ``qkv``: the
    op's qkv input or a stand-in of its shape and dtype."""
    if kernel.ratio > 0:
        return None
    n, t, _, h, _ = _dims(kernel.attrs, qkv.shape)
    # one head: two sequences at least, so a group is a batch of matrices
    # (hostgemm.matmul cuts a lone 2-D product, whose bits can differ)
    least = 1 if h > 1 else 2
    item = value_dtype(qkv.dtype).itemsize
    return min(n, max(least, HOST_GROUP_BYTES // (h * t * t * item)))


def _host_specs(kernel, qkv, count):
    """The (N, H, T, T) arrays of a host run (``_probs_specs``), of its
    group's g sequences without dropout (``host_group``)."""
    g = host_group(kernel, qkv)
    if g is None:
        return _probs_specs(kernel, qkv, count)
    _, t, _, h, _ = _dims(kernel.attrs, qkv.shape)
    return [((g, h, t, t), value_dtype(qkv.dtype))] * count


def _dropout_temporaries(kernel, qkv, unpacks=False):
    """The host draw's temporaries (base/philox.py) of a fused op with
    dropout, or with ``unpacks`` (a kept packed mask) its unpacking's; []
    without dropout."""
    if kernel.ratio <= 0:
        return []
    shape = _scores_spec(qkv, int(kernel.attrs["num_heads"]))[0]
    return unpack_temporaries(shape) if unpacks else keep_mask_temporaries(shape, kernel.split)


def _kept_mask(kernel, bits, p, mask, out):
    """out = P' = p * mask / (1 - ratio), ``mask`` unpacked from ``bits`` (a
    kept packed mask): the Dropout op's product, with no Philox draw."""
    unpack_mask(bits, p.shape, p.dtype, out=mask)
    dropout_backward(p, mask, kernel.ratio, out)


class _FusedAttention(PhiloxStream, _AttentionKernel):
    """What the fused ops (Attention, AttentionGrad) share: cuDNN's SDPA
    plans where they take the op (``_sdpa``), else the causal mask, set up
    on their qkv input (``qkv_input``) with the scratch reserved."""

    temporaries_on_host = True   # new arrays of scratch_specs each host run
    products = True   # cuBLAS on a GPU (gpu/blas.py), or cuDNN's SDPA
    _sdpa = None
    _sdpa_rng = None

    def setup(self, ins, outs):
        qkv = self.qkv_input(ins)
        self._sdpa = _sdpa_plans(self, qkv)
        if self._sdpa is None:
            self.setup_mask(qkv, qkv.shape[1])
        self.reserve_temporaries(qkv, *self.scratch_specs(ins, outs))

    def run_temporaries(self, qkv, ins, outs):
        """The temporaries of a run off the SDPA path: the host path's
        (``host_specs``) on the host, else the device's (``scratch_specs``)."""
        host = get_xp(qkv) is np
        return self.temporaries(
            qkv, *(self.host_specs(ins, outs) if host else self.scratch_specs(ins, outs)))


@register
class Attention(_FusedAttention):
    """[qkv] -> [ctx] (or [ctx, stats] when marked ``sdpa``): the fused
    path, softmax(q k^T / sqrt(D)) v in one op, the probabilities in the
    op's scratch only; see the module docstring. In bf16/fp16 on a GPU,
    cuDNN's fused attention (gpu/sdpa.py) where it takes the shape, writing
    the softmax statistics (log-sum-exp, (N, H, T, 1) float32) to ``stats``
    for the gradient; elsewhere ``stats`` is not written (the gradient
    recomputes the probabilities). With attr ``dropout`` > 0: [qkv, iter],
    dropout on the probabilities drawn from the Philox stream of attr
    ``stream`` (the module docstring; ``seed`` as the Dropout op's), or
    with attr ``replay_mask`` ([qkv, bits, iter]) unpacked from ``bits``,
    the packed mask an original op wrote (a recompute copy: no draw)."""

    op_type = "Attention"

    def __init__(self, op):
        super().__init__(op)
        if op.attrs.get("sdpa"):
            self.fp32_outputs = (1,)   # the statistics stay float32 (ops/registry.py)

    @classmethod
    def infer(cls, attrs, ins):
        replay = replays(attrs)
        if replay and packed(attrs):
            raise ShapeError("Attention: attrs replay_mask (read a packed mask) and packed_mask "
                             "(write one) exclude each other")
        _check_dropout_inputs("Attention", attrs, ins, 2 if replay else 1)
        n, t, c, h, _ = _dims(attrs, ins[0][0])
        if replay:
            _check_packed("Attention", (n, h, t, t), ins[1])
        outs = [((n, t, c), out_dtype(attrs, ins[0][1]))]
        if attrs.get("sdpa"):
            outs.append(((n, h, t, 1), "float32"))
        if packed(attrs):   # the bit-packed keep-mask, for the gradient
            outs.append((packed_shape((n, h, t, t)), "uint8"))
        return outs

    @classmethod
    def bits_inputs(cls, attrs):
        """qkv (bf16 storage): cuDNN's SDPA reads the bits themselves (no
        narrowing); the cuBLAS path widens them into its scratch (exactly,
        ``_wide_qkv``) and the host path into a new array."""
        return (0,)

    @classmethod
    def bits_outputs(cls, attrs):
        """ctx as bfloat16 bits (bf16 storage): cuDNN's SDPA writes its
        bfloat16 output there (no widening); the cuBLAS path writes ctx's
        float32 into its scratch and rounds it into the bits."""
        return (0,) if attrs.get("compute_dtype") == "bfloat16" else ()

    def scratch_specs(self, ins, outs):
        """(a float32 qkv where qkv is bits,) P (and with dropout its mask;
        a float32 ctx where ctx is bits), or the SDPA plans' scratch."""
        if self._sdpa is not None:   # no copy of a qkv or ctx stored as bits
            return self._sdpa.scratch_specs(backward=False, stored=_stored(
                qkv=ins[0], o=outs[0] if outs else None))
        return _wide_qkv(ins[0]) + _probs_specs(self, ins[0], 1) + _wide_ctx(outs)

    def host_specs(self, ins, outs):
        """(a float32 qkv where qkv is bits,) P of a host group
        (``host_group``), or P and the mask (dropout); a float32 ctx and
        to_bf16_bits's scratch where ctx is bits."""
        return _wide_qkv(ins[0]) + _host_specs(self, ins[0], 1) + _wide_ctx(outs, host=True)

    def host_temporaries(self, ins, outs):
        """P (a group's), or P, the mask and the draw's (or the kept mask's
        unpacking's) temporaries (dropout)."""
        return self.host_specs(ins, outs) + _dropout_temporaries(self, ins[0],
                                                                 replays(self.attrs))

    def run(self, ins, outs):
        qkv = ins[0]
        if self._sdpa is not None:
            self._sdpa.forward(qkv, outs[0], outs[1],
                               self.temporaries(qkv, *self.scratch_specs(ins, outs)),
                               dropout=_sdpa_dropout(self, ins[-1]))
            return
        xp = get_xp(qkv)
        heads = int(self.attrs["num_heads"])
        host = xp is np
        qkv, (p, *mask) = _widened(qkv, self.run_temporaries(qkv, ins, outs))
        q, k, v = split_heads(qkv, heads)
        bits = is_bits(outs[0])
        if bits:   # ctx's float32 into the scratch, then rounded into the bits
            wide, *rest = mask[-(2 if host else 1):]
            mask = mask[:len(mask) - (2 if host else 1)]
            ctx = heads_view(wide, heads)
        else:
            ctx = heads_view(outs[0], heads)
        if host and not mask:   # P^T a group at a time, ctx = (P^T)^T v
            for s in spans(qkv.shape[0], host_group(self, qkv)):
                pt = p[:s.stop - s.start]
                self.host_probs_t(q[s], k[s], pt)
                matmul(np, pt.swapaxes(-1, -2), v[s], out=ctx[s])
            if bits:
                to_bf16_bits(wide, outs[0], rest[0])
            return
        # a device, or dropout (one Philox draw over the whole batch): at once
        self.scores(xp, q, k, p)
        softmax_rows(xp, p)
        if mask and replays(self.attrs):   # the original's kept mask, in place
            _kept_mask(self, ins[-2], p, mask[0], p)
        elif mask:   # P' = P * mask / (1 - ratio), in place: the Dropout op's
            dropout_forward(p, ins[-1], self.ratio, self.keys, p, mask[0], self.split)
            if packed(self.attrs):   # kept for the gradient (no second draw)
                outs[-1][...] = pack_mask(mask[0])
        bmm(xp, p, v, ctx)
        if bits:
            narrow(wide, outs[0], lambda: rest[0])


@register
class AttentionGrad(_FusedAttention):
    """[dctx, qkv] (or [dctx, qkv, ctx, stats] when marked ``sdpa``) ->
    [dqkv], recomputing S and P; see the module docstring. On the SDPA path
    (gpu/sdpa.py; the same plans as its forward op's, so both take it or
    neither) cuDNN's backward from the forward's ctx and statistics. With
    attr ``dropout`` > 0 the iteration blob is the last input and the mask
    is redrawn from the forward's stream (attrs ``stream``, ``dropout``),
    or with attr ``packed_mask`` unpacked from the forward's bit-packed mask,
    the input before the iteration."""

    op_type = "AttentionGrad"

    @classmethod
    def bits_inputs(cls, attrs):
        """dctx and qkv, as Attention's qkv (cuDNN's SDPA backward reads
        them as bfloat16: no narrowing; the cuBLAS path widens them into its
        scratch, the host into new arrays); ctx (marked ``sdpa``): cuDNN's
        SDPA backward reads it as bfloat16, the cuBLAS path not at all."""
        return (0, 1, 2) if attrs.get("sdpa") else (0, 1)

    @classmethod
    def bits_outputs(cls, attrs):
        """dqkv as bfloat16 bits (bf16 storage): cuDNN's SDPA writes its
        bfloat16 gradient there (no widening); the cuBLAS path writes
        dqkv's float32 into its scratch and rounds it into the bits (the
        rounding the precision pass gives its float32 dqkv)."""
        return (0,) if attrs.get("compute_dtype") == "bfloat16" else ()

    @classmethod
    def infer(cls, attrs, ins):
        base = (4 if attrs.get("sdpa") else 2) + (1 if packed(attrs) else 0)
        _check_dropout_inputs("AttentionGrad", attrs, ins, base)
        if packed(attrs):
            _check_packed("AttentionGrad", _scores_spec_of(attrs, ins[1][0]), ins[base - 1])
        return [(ins[1][0], out_dtype(attrs, ins[1][1]))]

    def qkv_input(self, ins):
        """The op's qkv input (its second, after dctx)."""
        return ins[1]

    def scratch_specs(self, ins, outs):
        """(a float32 qkv where qkv is bits, a float32 dctx where dctx is
        bits,) P, dP (and with dropout the mask; a float32 dqkv where dqkv
        is bits), or the SDPA plans' scratch."""
        if self._sdpa is not None:   # no copy of an array stored as bits
            return self._sdpa.scratch_specs(backward=True, stored=_stored(
                do=ins[0], qkv=ins[1], o=ins[2], dqkv=outs[0] if outs else None))
        over = self._over_qkv(ins, outs)   # dqkv's float32 over qkv's widening
        return _wide_qkv(ins[1]) + _wide_qkv(ins[0]) + _probs_specs(self, ins[1], 2) + \
            ([] if over else _wide_ctx(outs))

    def _over_qkv(self, ins, outs):
        """Whether the device path computes a dqkv stored as bits in the
        float32 widening of a qkv stored as bits (no dropout, and P's bytes
        hold a (N, T, 3C) float32 array, T >= 3D: ``_gradient_over_qkv``),
        instead of a float32 dqkv of its own in the scratch."""
        if not outs or not is_bits(outs[0]) or not is_bits(ins[1]) or self.ratio > 0:
            return False
        n, t, c3 = ins[1].shape
        return t >= c3 // int(self.attrs["num_heads"])

    def run(self, ins, outs):
        dctx, qkv = ins[:2]
        if self._sdpa is not None:
            ctx, stats = ins[2:4]
            self._sdpa.backward(dctx, qkv, ctx, stats, outs[0],
                                self.temporaries(qkv, *self.scratch_specs(ins, outs)),
                                dropout=_sdpa_dropout(self, ins[-1]))
            return
        xp = get_xp(qkv)
        heads = int(self.attrs["num_heads"])
        host = xp is np
        qkv, temps = _widened(qkv, self.run_temporaries(qkv, ins, outs))
        dctx, (p, dp, *mask) = _widened(dctx, temps)
        bits = is_bits(outs[0])
        if not host and self._over_qkv(ins, outs):   # in qkv's widening, then rounded
            self._gradient_over_qkv(xp, heads, qkv, dctx, p, dp)
            narrow(qkv, outs[0], None)   # a device's: no host scratch
            return
        if bits:   # dqkv's float32 into the scratch, then rounded into the bits
            wide, *rest = mask[-(2 if host else 1):]
            mask = mask[:len(mask) - (2 if host else 1)]
            self._gradient(xp, host, heads, qkv, dctx, wide, p, dp, mask, ins)
            narrow(wide, outs[0], lambda: rest[0])
            return
        self._gradient(xp, host, heads, qkv, dctx, outs[0], p, dp, mask, ins)

    def _gradient_over_qkv(self, xp, heads, qkv, dctx, p, dp):
        """The device path's dqkv (no dropout) computed over the float32
        ``qkv`` (the widening of a qkv stored as bits), each part where its
        source is read last: dP = dO v^T, then dv over v; dS; dk into P's
        bytes (dead after dS), laid out as a (N, T, 3C) array like qkv, so
        each product has the same operands, strides and alignment as the
        float32 path's (the same bits); dq over q (read by dk before), then
        dk copied over k (read by dq before)."""
        q, k, v = split_heads(qkv, heads)
        do = heads_view(dctx, heads)
        scale = 1.0 / math.sqrt(q.shape[-1])
        self.scores(xp, q, k, p)
        softmax_rows(xp, p)
        bmm(xp, do, v, dp, trans_b=True)
        bmm(xp, p, do, v, trans_a=True)                # dv, over v
        softmax_rows_grad(xp, dp, p)                   # dS
        _, dk, _ = split_heads(p.reshape(-1)[:qkv.size].reshape(qkv.shape), heads)
        bmm(xp, dp, q, dk, trans_a=True, alpha=scale)  # in P's bytes
        bmm(xp, dp, k, q, alpha=scale)                 # dq, over q
        k[...] = dk

    def _gradient(self, xp, host, heads, qkv, dctx, dqkv, p, dp, mask, ins):
        """dqkv (float32) from float32 qkv and dctx: the cuBLAS or host path."""
        q, k, v = split_heads(qkv, heads)
        dq, dk, dv = split_heads(dqkv, heads)
        do = heads_view(dctx, heads)
        scale = 1.0 / math.sqrt(q.shape[-1])
        if host and not mask:   # transposed: P^T, dP^T = v dO^T, dS^T
            for s in spans(qkv.shape[0], host_group(self, qkv)):
                pt, dpt = p[:s.stop - s.start], dp[:s.stop - s.start]
                self.host_probs_t(q[s], k[s], pt)
                matmul(np, pt, do[s], out=dv[s])
                matmul(np, v[s], do[s].swapaxes(-1, -2), out=dpt)
                dpt -= np.einsum("...kq,...kq->...q", dpt, pt)[..., None, :]
                dpt *= pt                                      # dS^T
                bmm(xp, dpt, k[s], dq[s], trans_a=True, alpha=scale)
                bmm(xp, dpt, q[s], dk[s], alpha=scale)
            return
        # a device, or dropout (one Philox draw over the whole batch): at once
        self.scores(xp, q, k, p)
        softmax_rows(xp, p)
        if mask and packed(self.attrs):   # the forward's mask, unpacked: P' in dP
            _kept_mask(self, ins[-2], p, mask[0], dp)
            bmm(xp, dp, do, dv, trans_a=True)
        elif mask:   # the forward's P' (in dP's bytes until dP is made) and mask
            dropout_forward(p, ins[-1], self.ratio, self.keys, dp, mask[0], self.split)
            bmm(xp, dp, do, dv, trans_a=True)
        else:
            bmm(xp, p, do, dv, trans_a=True)
        bmm(xp, do, v, dp, trans_b=True)
        if mask:   # the Dropout op's gradient
            dropout_backward(dp, mask[0], self.ratio, dp)
        softmax_rows_grad(xp, dp, p)                   # dS
        bmm(xp, dp, k, dq, alpha=scale)
        bmm(xp, dp, q, dk, trans_a=True, alpha=scale)

    def host_specs(self, ins, outs):
        """(a float32 qkv where qkv is bits, a float32 dctx where dctx is
        bits,) P and dP of a host group (``host_group``), or P, dP and the
        mask (dropout); a float32 dqkv and to_bf16_bits's scratch where
        dqkv is bits."""
        return _wide_qkv(ins[1]) + _wide_qkv(ins[0]) + _host_specs(self, ins[1], 2) + \
            _wide_ctx(outs, host=True)

    def host_temporaries(self, ins, outs):
        """P^T and dP^T of a group without dropout (the rowsum is einsum's,
        no product array); with dropout P, dP and the mask of the whole
        batch, and the largest of ``softmax_rows_grad``'s dP * P and the
        dropout draw's temporaries, or with a packed mask its unpacking's
        (they are not live at once)."""
        if self._sdpa is not None:
            return self.scratch_specs(ins, outs)
        specs = self.host_specs(ins, outs)
        if self.ratio <= 0:
            return specs
        if packed(self.attrs):   # P's spec: after qkv's and dctx's widenings, where any
            probs = specs[len(_wide_qkv(ins[1]) + _wide_qkv(ins[0])):][:1]
            return specs + max(unpack_temporaries(probs[0][0]), probs, key=specs_nbytes)
        return specs + _dropout_temporaries(self, ins[1])


@gradient("Attention")
def _attention_grad(g, op):
    dctx = g.grad_of(op.outputs[0])
    qkv = op.inputs[0]
    if dctx is not None and g.needs_grad(qkv):
        # with dropout: the same stream (and seed attr), and the iteration
        attrs = {k: op.attrs[k] for k in ("num_heads", "causal", "dropout", "stream", "seed",
                                          "packed_mask", "mask_split") if k in op.attrs}
        if "dropout" in attrs and "stream" not in attrs:
            attrs["stream"] = op.name   # the forward's own stream
        # with a packed mask: [dctx, qkv, bits, iter] (the forward's last output)
        bits = op.outputs[-1:] if packed(op.attrs) else []
        g.emit("AttentionGrad", [dctx, qkv] + bits + op.inputs[1:2], [g.grad_blob(qkv)], attrs)
