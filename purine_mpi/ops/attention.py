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
  existing "Softmax" over axis 3 -> [P] (its max-subtracted form keeps long
  rows with large logits finite), an optional dropout on P, and
  "AttentionContext" [P, qkv] -> [ctx]. Gradients::

      dS = "SoftmaxGrad";  dq = dS k / sqrt(D),  dk = dS^T q / sqrt(D)
      dP = dO v^T,  dv = P^T dO          ("AttentionScoresGrad", "AttentionContextGrad";
                                          the two parts of dqkv are summed)

- the fused single op "Attention" [qkv] -> [ctx, lse], lse (N, H, T) the
  log-sum-exp of each row of S (m + log sum exp(S - m), m its max); its
  gradient "AttentionGrad" [dctx, qkv, ctx, lse] -> [dqkv] recomputes
  P = exp(S - lse) instead of keeping the (N, H, T, T) probabilities::

      dP = dO v^T,  dS = P (dP - rowsum(dO * O)),  dq = dS k / sqrt(D),
      dk = dS^T q / sqrt(D),  dv = P^T dO

Attr ``num_heads`` (H, dividing C), ``causal`` (default true). Every mask
position is exactly -inf before the softmax, so it gets probability 0 and
gradient 0; the diagonal is never masked, so no row is all -inf.
"""
import math

import numpy as np

from ..base.backend import get_xp
from ..base.errors import ShapeError
from .registry import OpKernel, gradient, register


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


def _mask_upper(xp, s):
    """S[..., i, j] = -inf for j > i."""
    t = s.shape[-1]
    s[..., xp.triu(xp.ones((t, t), dtype=bool), 1)] = -np.inf


def scores(xp, q, k, scale, causal, out):
    """out = q k^T * scale, masked when causal."""
    xp.matmul(q, k.transpose(0, 1, 3, 2), out=out)
    out *= scale
    if causal:
        _mask_upper(xp, out)


def _causal(attrs):
    return bool(attrs.get("causal", True))


@register
class AttentionScores(OpKernel):
    """[qkv] -> [S]: S = q k^T / sqrt(D), -inf above the diagonal when causal."""

    op_type = "AttentionScores"

    @classmethod
    def infer(cls, attrs, ins):
        n, t, _, h, _ = _dims(attrs, ins[0][0])
        return [((n, h, t, t), ins[0][1])]

    def run(self, ins, outs):
        qkv = ins[0]
        xp = get_xp(qkv)
        q, k, _ = split_heads(qkv, int(self.attrs["num_heads"]))
        scores(xp, q, k, 1.0 / math.sqrt(q.shape[-1]), _causal(self.attrs), outs[0])


@register
class AttentionScoresGrad(OpKernel):
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
        (tmp,) = self.temporaries(qkv, (q.shape, qkv.dtype))
        xp.matmul(ds, k, out=tmp)
        xp.multiply(tmp, scale, out=dq)
        xp.matmul(ds.transpose(0, 1, 3, 2), q, out=tmp)
        xp.multiply(tmp, scale, out=dk)
        dv[...] = 0


@gradient("AttentionScores")
def _scores_grad(g, op):
    ds = g.grad_of(op.outputs[0])
    if ds is not None and g.needs_grad(op.inputs[0]):
        g.emit("AttentionScoresGrad", [ds, op.inputs[0]], [g.grad_blob(op.inputs[0])],
               {"num_heads": op.attrs["num_heads"]})


@register
class AttentionContext(OpKernel):
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
        xp = get_xp(qkv)
        heads = int(self.attrs["num_heads"])
        _, _, v = split_heads(qkv, heads)
        (tmp,) = self.temporaries(qkv, (v.shape, qkv.dtype))
        xp.matmul(p, v, out=tmp)
        heads_view(outs[0], heads)[...] = tmp


@register
class AttentionContextGrad(OpKernel):
    """[dctx, P, qkv] -> the gradients named in attr ``outputs`` (dP, dqkv):
    dP = dO v^T; dqkv: dv = P^T dO, dq = dk = 0."""

    op_type = "AttentionContextGrad"

    @classmethod
    def infer(cls, attrs, ins):
        shapes = {"dP": ins[1], "dqkv": ins[2]}
        return [shapes[o] for o in attrs["outputs"]]

    def run(self, ins, outs):
        dctx, p, qkv = ins
        xp = get_xp(qkv)
        heads = int(self.attrs["num_heads"])
        got = dict(zip(self.attrs["outputs"], outs))
        _, _, v = split_heads(qkv, heads)
        do, tmp = self.temporaries(qkv, (v.shape, qkv.dtype), (v.shape, qkv.dtype))
        do[...] = heads_view(dctx, heads)
        if "dP" in got:
            xp.matmul(do, v.transpose(0, 1, 3, 2), out=got["dP"])
        if "dqkv" in got:
            dq, dk, dv = split_heads(got["dqkv"], heads)
            dq[...] = 0
            dk[...] = 0
            xp.matmul(p.transpose(0, 1, 3, 2), do, out=tmp)
            dv[...] = tmp


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


@register
class Attention(OpKernel):
    """[qkv] -> [ctx, lse]: the fused path, softmax(q k^T / sqrt(D)) v in one
    op with the rows' log-sum-exp kept for the backward; see the module
    docstring."""

    op_type = "Attention"

    @classmethod
    def infer(cls, attrs, ins):
        n, t, c, h, _ = _dims(attrs, ins[0][0])
        return [((n, t, c), ins[0][1]), ((n, h, t), ins[0][1])]

    def run(self, ins, outs):
        qkv = ins[0]
        ctx, lse = outs
        xp = get_xp(qkv)
        heads = int(self.attrs["num_heads"])
        q, k, v = split_heads(qkv, heads)
        n, h, t, d = q.shape
        s, o = self.temporaries(qkv, ((n, h, t, t), qkv.dtype), (q.shape, qkv.dtype))
        scores(xp, q, k, 1.0 / math.sqrt(d), _causal(self.attrs), s)
        xp.max(s, axis=-1, out=lse)
        s -= lse[..., None]
        xp.exp(s, out=s)                              # P * l, every entry <= 1
        xp.matmul(s, v, out=o)
        row = s.sum(axis=-1)                           # l >= 1: the max's own entry
        o /= row[..., None]
        heads_view(ctx, heads)[...] = o
        xp.log(row, out=row)
        lse += row


@register
class AttentionGrad(OpKernel):
    """[dctx, qkv, ctx, lse] -> [dqkv], recomputing P = exp(S - lse); see the
    module docstring."""

    op_type = "AttentionGrad"

    @classmethod
    def infer(cls, attrs, ins):
        return [ins[1]]

    def run(self, ins, outs):
        dctx, qkv, ctx, lse = ins
        xp = get_xp(qkv)
        heads = int(self.attrs["num_heads"])
        q, k, v = split_heads(qkv, heads)
        dq, dk, dv = split_heads(outs[0], heads)
        n, h, t, d = q.shape
        scale = 1.0 / math.sqrt(d)
        p, dp, do, tmp = self.temporaries(qkv, ((n, h, t, t), qkv.dtype),
                                          ((n, h, t, t), qkv.dtype), (q.shape, qkv.dtype),
                                          (q.shape, qkv.dtype))
        scores(xp, q, k, scale, _causal(self.attrs), p)
        p -= lse[..., None]
        xp.exp(p, out=p)
        do[...] = heads_view(dctx, heads)
        xp.matmul(p.transpose(0, 1, 3, 2), do, out=tmp)
        dv[...] = tmp
        xp.matmul(do, v.transpose(0, 1, 3, 2), out=dp)
        xp.multiply(do, heads_view(ctx, heads), out=tmp)
        dp -= tmp.sum(axis=-1)[..., None]
        dp *= p                                         # dS
        xp.matmul(dp, k, out=tmp)
        xp.multiply(tmp, scale, out=dq)
        xp.matmul(dp.transpose(0, 1, 3, 2), q, out=tmp)
        xp.multiply(tmp, scale, out=dk)


@gradient("Attention")
def _attention_grad(g, op):
    dctx = g.grad_of(op.outputs[0])
    qkv = op.inputs[0]
    if dctx is not None and g.needs_grad(qkv):
        g.emit("AttentionGrad", [dctx, qkv, op.outputs[0], op.outputs[1]], [g.grad_blob(qkv)],
               {k: op.attrs[k] for k in ("num_heads", "causal") if k in op.attrs})
