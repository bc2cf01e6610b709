"""The FLOPs of one op of a graph: the multiply-add FLOPs (2 per
multiply-add) of the matrix products (tools/flops.py's model FLOPs, the
scaling predictor's work, and ``parallel.stages: S``'s balanced cut,
job/stage_cut.py, read it)."""
import math


def _size(shape):
    return int(math.prod(int(s) for s in shape))


def op_flops(op, shape):
    """The FLOPs of one op (``shape(blob)`` its shape); 0 for the ops not counted."""
    t = op.op_type
    ins, outs = op.inputs, op.outputs
    if t == "InnerProduct":             # y (.., N) = x (.., K) · wᵀ
        return 2 * _size(shape(outs[0])) * int(shape(ins[1])[1])
    if t == "InnerProductGradData":     # dx (.., K) = dy (.., N) · w
        return 2 * _size(shape(outs[0])) * int(shape(ins[1])[0])
    if t == "InnerProductGradWeight":   # dw (N, K) = dyᵀ · x, over the rows of dy
        dy = shape(ins[0])
        return 2 * _size(shape(outs[0])) * (_size(dy) // int(dy[-1]))
    if t == "Conv":                     # y (N, O, OH, OW), w (O, C/g, kh, kw)
        return 2 * _size(shape(outs[0])) * _size(shape(ins[1])[1:])
    if t == "ConvGradData":             # [dy, w]
        return 2 * _size(shape(ins[0])) * _size(shape(ins[1])[1:])
    if t == "ConvGradWeight":           # [dy, x] -> dw
        return 2 * _size(shape(ins[0])) * _size(shape(outs[0])[1:])
    if t in ("Attention", "AttentionGrad", "AttentionScores", "AttentionScoresGrad",
             "AttentionContext", "AttentionContextGrad"):
        # the (N, T, 3C) qkv input (not the last: the fused ops' iteration
        # with dropout, the SDPA gradient's statistics)
        qkv = shape(ins[QKV_INPUT[t]])
        n, seq, width = int(qkv[0]), int(qkv[1]), int(qkv[2]) // 3
        one = 2 * n * seq * seq * width  # one of q·kᵀ, P·v (all heads)
        return one * {"Attention": 2, "AttentionGrad": 4, "AttentionScores": 1,
                      "AttentionScoresGrad": 2, "AttentionContext": 1,
                      "AttentionContextGrad": len(op.attrs.get("outputs") or (0, 0))}[t]
    return 0


#: the index of the qkv input of each attention op
QKV_INPUT = {"Attention": 0, "AttentionGrad": 1, "AttentionScores": 0, "AttentionScoresGrad": 1,
             "AttentionContext": 1, "AttentionContextGrad": 2}
