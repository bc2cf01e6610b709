"""Softmax, the softmax cross-entropy loss, and top-k accuracy.

All three work over ``axis`` (default 1, the channel axis): an input of shape
``(N, C)`` or ``(N, C, H, W)`` is viewed as ``(outer, C, inner)`` and every
one of the ``outer * inner`` positions is one prediction, as in Caffe.
Labels are integers of shape ``(N,)`` or ``(N, H, W)`` (any shape with one
entry per position); float labels holding integers are truncated to int.

On a GPU (CuPy arrays of float32/float64, C-contiguous, any ``axis``: the
(outer, C, inner) view is the kernels' layout, so (N, T, V) logits over
axis -1 are (N*T, V, 1)) the softmax loss and
its gradient are the fused raw kernels of cuda/softmax_loss.cu, and nothing
is read back to the host: the batch mean (one block-reduction kernel) and
the gradient scale stay on the device, the per-position losses live in the
op's scratch memory, labels of another dtype than int64 are copied there
(no allocation per iteration). There a label outside [0, C) gives a NaN loss instead of the
ValueError the CPU raises (checking would cost a device-to-host sync).

From the logits (attr ``from_logits``, set by the precision pass,
parallel/precision.loss_from_logits, where the logits are bfloat16 values
and the probabilities are read by the loss's gradient alone): the loss has
no ``prob`` output, and its gradient reads the logits instead and computes
the probabilities again. The logits may then be stored as bfloat16 bits (2
bytes an element, written so by the lm-head's GemmEx: bf16 storage), and
no full-size float32 array of them, of the probabilities or of their
gradient exists. On a GPU, for (positions, classes) rows of at least
ROW_BLOCK_CLASSES classes (GPT's logits over axis -1), each op is one
kernel that reads the bits itself (``softmax_loss_forward_bits``,
``softmax_loss_grad_bits``: widened in registers, dx rounded into bits in
the pass that computes it), with the float32 kernels' order of operations:
the same bits as the path below (where each chunk starts on the vector
grid, as every chunk of GPT-2's 50304 classes does), with no float32
scratch and no conversion launch. Otherwise (fewer classes, inner > 1,
float32 logits, the host) both ops work ``LOSS_CHUNK`` elements of whole
positions at a time, widening a chunk of the logits into float32 scratch (exact),
running the same float32 kernels (the same code on the host) on it -- the
same probabilities bit for bit, since each position's softmax reads its own
row only -- and the gradient writes its chunk as bits where its readers
take bits (the lm-head's backward products: ``bits_out``), the bits of the
float32 gradient's rounding. In float32 throughout, as PyTorch's autocast
computes ``cross_entropy`` of bfloat16 logits.
"""
import numpy as np

from ..base.backend import get_xp
from ..base.errors import ShapeError
from ..base.precision import is_bits, to_bf16_bits, value_dtype, wire_scratch
from ..gpu.raw import raw_kernels, widen
from .registry import OpKernel, gradient, out_dtype, register, spans

#: elements of logits (whole positions, at least one) the ``from_logits``
#: loss and its gradient widen into float32 at a time: their scratch
#: (256 MiB of float32)
LOSS_CHUNK = 1 << 26


def _axis(attrs, ndim):
    axis = int(attrs.get("axis", 1))
    if not -ndim <= axis < ndim:
        raise ShapeError(f"axis {axis} is out of range for a {ndim}-d input")
    return axis % ndim


def _split_dims(shape, axis):
    """(outer, C, inner) of ``shape`` around ``axis``."""
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
    return outer, int(shape[axis]), inner


def _contiguous(*arrays):
    """Whether every array is C-contiguous, so its (outer, C, inner) reshape
    is a view (a strided blob, e.g. a slice of a concat, would be copied, and
    a kernel writing the copy would leave the blob as it was)."""
    return all(a.flags.c_contiguous for a in arrays)


def _check_label(attrs, x_shape, label_shape, op_type):
    if len(x_shape) < 2:
        raise ShapeError(f"{op_type} needs predictions of at least 2 dims (N, C, ...), "
                         f"got shape {list(x_shape)}")
    axis = _axis(attrs, len(x_shape))
    outer, _, inner = _split_dims(x_shape, axis)
    size = int(np.prod(label_shape, dtype=np.int64))
    # one label per sample row unless the classes are axis 0 (no batch axis)
    if size != outer * inner or (axis and len(label_shape) and label_shape[0] != x_shape[0]):
        expect = list(x_shape[:axis]) + list(x_shape[axis + 1:])
        raise ShapeError(f"{op_type}: the label has shape {list(label_shape)} but the predictions "
                         f"{list(x_shape)} need one label per position, i.e. shape {expect}")
    return axis


def _check_normaliser(ins, op_type):
    """A loss's optional normaliser input: one 0-d blob."""
    if len(ins) > 1 or (ins and tuple(ins[0][0]) != ()):
        raise ShapeError(f"{op_type}: takes at most one normaliser input, a 0-d blob, got "
                         f"{[list(s) for s, _ in ins]}")


def _skipped(attrs):
    """{attr: label value} of the labels a position is not counted for."""
    return {k: attrs.get(k) for k in ("ignore_label", "pad_label")
            if attrs.get(k) is not None}


def _valid(lab, skipped):
    """The mask of ``lab``'s (int64) positions whose label is none of ``skipped``."""
    valid = get_xp(lab).ones(lab.shape, dtype=bool)
    for value in skipped.values():
        valid &= lab != int(value)
    return valid


def _labels(attrs, label, outer, channels, inner):
    """Labels as int64 (outer, inner), the mask of counted positions, and
    the count (at least 1, as Caffe's normalizer, so an all-ignored batch
    gives loss 0 rather than NaN). A position is not counted when its label
    is attr ``ignore_label`` (the layer's) or attr ``pad_label`` (a padding
    sample of a test graph's last batch, job/replica.py ``mark_padding``)."""
    xp = get_xp(label)
    lab = label.reshape(outer, inner).astype(np.int64)
    skipped = _skipped(attrs)
    valid = _valid(lab, skipped)
    lab = xp.where(valid, lab, 0)
    if bool(((lab < 0) | (lab >= channels)).any()):
        bad = int(lab[(lab < 0) | (lab >= channels)][0])
        raise ValueError(f"label value {bad} is outside [0, {channels}) for {channels} classes"
                         + "".join(f" (and is not {k} {v})" for k, v in skipped.items()))
    count = max(int(valid.sum()), 1)
    return lab, valid, count


def _loss_specs(x, axis=1):
    """Scratch of the GPU loss: per-position loss and valid flags (float32
    for logits stored as bits)."""
    outer, _, inner = _split_dims(x.shape, axis)
    return [((outer * inner,), value_dtype(x.dtype))] * 2


def _accuracy_specs(x, axis=1):
    """Scratch of the GPU accuracy: per-position correct and valid flags."""
    outer, _, inner = _split_dims(x.shape, axis)
    return [((outer * inner,), x.dtype), ((outer * inner,), x.dtype)]


def _label_specs(label):
    """Scratch for the labels as the GPU kernels read them (int64): none when
    they are int64 already, else one buffer they are copied into (a copy
    kernel, so an iteration allocates nothing, e.g. the int32 tokens of the
    text source)."""
    if np.dtype(label.dtype) == np.int64:
        return []
    return [((int(np.prod(label.shape, dtype=np.int64)),), np.int64)]


def _device_labels(label, buffers, shape):
    """``label`` as int64 of ``shape`` (a view, or a copy into ``buffers``)."""
    if not buffers:
        return label.reshape(shape)
    buffers[0][...] = label.reshape(-1)
    return buffers[0].reshape(shape)


def _raw_specs(x, specs):
    """``specs`` when the raw GPU kernels take ``x``'s dtype (float32/64),
    else []: the generic path reserves nothing."""
    from ..gpu.raw import KERNEL_DTYPES
    return list(specs) if np.dtype(x.dtype) in KERNEL_DTYPES else []


def _reserve(kernel, x, specs):
    """Make room in setup for the kernel's scratch ``specs`` on ``x``'s
    device: where the raw kernels take ``x``'s dtype, and for a loss or
    gradient ``from_logits`` whatever it is (logits stored as bits: the
    float32 chunks, or for ``_bits_rows`` the labels' and count's scratch
    alone); nothing on the host."""
    if kernel.attrs.get("from_logits"):
        kernel.reserve_temporaries(x, *specs)
    elif raw_kernels(get_xp(x), x) is not None:
        from ..gpu.raw import array_device, op_scratch
        op_scratch(kernel, array_device(x)).reserve(*specs)


@register
class Softmax(OpKernel):
    """y = exp(x) / sum_axis(exp(x))  (attr ``axis``, default 1).
    Gradient: dx = y * (dy - sum_axis(dy * y))."""

    op_type = "Softmax"

    @classmethod
    def infer(cls, attrs, ins):
        _axis(attrs, len(ins[0][0]))
        return [ins[0]]

    def run(self, ins, outs):
        xp = get_xp(ins[0])
        x, y = ins[0], outs[0]
        axis = _axis(self.attrs, x.ndim)
        k = raw_kernels(xp, x)
        # GPU: one raw kernel (no reduction, which a capture refuses)
        if k is not None and _contiguous(x, y):
            planes = _split_dims(x.shape, axis)
            k.softmax_forward(x.reshape(planes), out=y.reshape(planes))
            return
        xp.subtract(x, x.max(axis=axis, keepdims=True), out=y)  # no overflow in exp
        xp.exp(y, out=y)
        y /= y.sum(axis=axis, keepdims=True)


@register
class SoftmaxGrad(OpKernel):
    """[dy, y] -> [dx]: dx = y * (dy - sum_axis(dy * y))."""

    op_type = "SoftmaxGrad"

    @classmethod
    def infer(cls, attrs, ins):
        if tuple(ins[0][0]) != tuple(ins[1][0]):
            raise ShapeError(f"SoftmaxGrad: dy {list(ins[0][0])} and y {list(ins[1][0])} differ")
        return [ins[0]]

    def run(self, ins, outs):
        xp = get_xp(ins[0])
        dy, y = ins
        axis = _axis(self.attrs, y.ndim)
        k = raw_kernels(xp, dy, y)
        if k is not None and _contiguous(dy, y, outs[0]):  # GPU: one raw kernel
            planes = _split_dims(y.shape, axis)
            k.softmax_backward(dy.reshape(planes), y.reshape(planes),
                               out=outs[0].reshape(planes))
            return
        dot = (dy * y).sum(axis=axis, keepdims=True)
        xp.subtract(dy, dot, out=outs[0])
        outs[0] *= y


@gradient("Softmax")
def _softmax_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    if dy is not None and g.needs_grad(op.inputs[0]):
        g.emit("SoftmaxGrad", [dy, op.outputs[0]], [g.grad_blob(op.inputs[0])],
               {"axis": op.attrs.get("axis", 1)})


def _bits_rows(x, axis):
    """Whether the ``from_logits`` loss and gradient read ``x`` (an array
    or a blob's shape and dtype) on a GPU as bfloat16 bits themselves, with
    no float32 chunk: logits stored as bits whose classes are the last axis
    (inner 1, GPT's (batch, tokens, vocabulary) over axis -1), at least
    ROW_BLOCK_CLASSES of them -- the rows the float32 path gives a block
    each (the ``_vec`` kernels), whose order of operations the bits kernels
    ``softmax_loss_forward_bits`` and ``softmax_loss_grad_bits`` keep (the
    same bits; fewer classes go a thread a position, another order)."""
    from ..gpu.kernels.loss import ROW_BLOCK_CLASSES
    _, channels, inner = _split_dims(x.shape, axis)
    return is_bits(x) and inner == 1 and channels >= ROW_BLOCK_CLASSES


def _chunk_positions(shape, axis):
    """(outer rows a chunk, (rows, C, inner)) of ``from_logits``' float32
    chunk of logits of ``shape``: ``LOSS_CHUNK`` elements of whole outer
    rows, at least one row."""
    outer, channels, inner = _split_dims(shape, axis)
    rows = max(1, min(outer, LOSS_CHUNK // max(channels * inner, 1)))
    return rows, (rows, channels, inner)


def _minus_onehot(d3, lab, valid):
    """The host gradient's prob - onehot(label) in ``d3`` (holding the
    probabilities, (outer, C, inner)): 1 off at each position's label (the
    bits of subtracting the one-hot mask, with no mask of prob's size), 0
    at positions not counted."""
    at = lab[:, None, :]
    np.put_along_axis(d3, at, np.take_along_axis(d3, at, axis=1) - 1, axis=1)
    if not bool(valid.all()):   # times 1 everywhere changes no bit
        d3 *= valid[:, None, :]


def _device_mean(k, nll, valid, loss, shard, normaliser):
    """The device loss: the mean of the per-position losses ``nll`` over
    the counted positions, or with a ``normaliser`` input (a list of at
    most one) their sum over it: mean x the shard's count (``shard``) / it."""
    k.softmax_loss_mean(nll, valid, loss, count=shard)
    if shard is not None:
        loss *= shard.reshape(())
        loss /= normaliser[0]


def _device_count(k, ins, lab, count, attrs):
    """The device gradient's normaliser into ``count`` where it is not the
    number of positions: the forward's normaliser input where the op has
    one (with or without an ``ignore_label``: the forward divides by it, as
    the host gradient does), else, with an ``ignore_label`` or
    ``pad_label``, the counted labels. Returns whether it is the number of
    positions (``_device_backward``'s ``plain``)."""
    ignore, pad = attrs.get("ignore_label"), attrs.get("pad_label")
    if len(ins) > 3:  # the forward's normaliser, in prob's dtype
        count[...] = ins[3].reshape(1)
        return False
    if ignore is None and pad is None:
        return True
    k.softmax_loss_count(lab, ignore, count, pad_label=pad)
    return False


def _device_backward(k, p3, lab, scale, attrs, out, count, positions, plain):
    """The fused gradient kernel on probabilities ``p3``: scaled by the
    number of ``positions`` when ``plain``, else by ``count``."""
    if plain:
        k.softmax_loss_backward(p3, lab, scale, None, out=out, scale_factor=1.0 / positions)
    else:
        k.softmax_loss_backward(p3, lab, scale, attrs.get("ignore_label"), out=out,
                                count=count, pad_label=attrs.get("pad_label"))


def _host_softmax(xp, x3, p3, lab):
    """The host loss's softmax of ``x3`` ((outer, C, inner)) into ``p3``
    before its normalisation: p3 = exp(x - max); returns (x[label] - max,
    the sum of p3 over the classes)."""
    # shifted (no overflow in exp) in prob's bytes: no temporary of x's size
    xp.subtract(x3, x3.max(axis=1, keepdims=True), out=p3)
    picked = xp.take_along_axis(p3, lab[:, None, :], axis=1)[:, 0, :]
    xp.exp(p3, out=p3)
    return picked, p3.sum(axis=1, keepdims=True)


@register
class SoftmaxLoss(OpKernel):
    """[x, label] -> [loss, prob]:  prob = softmax(x) over ``axis``;
    loss = -sum_{counted positions} log prob[label] / count, a 0-d scalar
    (the batch mean over N*H*W positions, Caffe's VALID normalization;
    positions whose label equals attr ``ignore_label`` or attr ``pad_label``
    (a test graph's padding, job/replica.py ``mark_padding``) are not counted).
    Gradient (x only, never label): dx = dloss * (prob - onehot(label)) / count,
    0 at ignored positions (plus the softmax gradient of d prob, if any).
    An optional third input, a 0-d normaliser (the data reader's attr
    ``count_label`` output: the global batch's count over the shards,
    ops/data.py), replaces ``count``: loss = -sum log prob[label] / it."""

    op_type = "SoftmaxLoss"
    #: prob over x (the logits, where the loss is their last reader): the
    #: GPU kernels read all of a position's row, x[label] too, before
    #: writing it (cuda/softmax_loss.cu); the host shifts x into prob's bytes
    in_place = ((0, 1),)

    @classmethod
    def bits_inputs(cls, attrs):
        """The logits, ``from_logits``: widened a chunk at a time, or read
        as bits by one kernel (``_bits_rows``)."""
        return (0,) if attrs.get("from_logits") else ()

    def scratch_specs(self, ins, outs):
        axis = _axis(self.attrs, ins[0].ndim)
        # with a normaliser: the shard's own count (the kernel's mean's)
        dtype = value_dtype(ins[0].dtype)
        shard = [((1,), dtype)] if len(ins) > 2 else []
        chunk = [(_chunk_positions(ins[0].shape, axis)[1], dtype)] \
            if self.attrs.get("from_logits") and not _bits_rows(ins[0], axis) else []
        return _raw_specs(np.empty(0, dtype), _loss_specs(ins[0], axis) +
                          _label_specs(ins[1]) + shard + chunk)

    def setup(self, ins, outs):
        _reserve(self, ins[0], self.scratch_specs(ins, outs))

    @classmethod
    def infer(cls, attrs, ins):
        (xs, xd), (ls, _) = ins[:2]
        _check_label(attrs, xs, ls, cls.op_type)
        _check_normaliser(ins[2:], cls.op_type)
        if attrs.get("from_logits"):   # no prob: the gradient computes it again
            return [((), "float32" if is_bits(xd) else xd)]
        return [((), xd), (tuple(xs), xd)]

    def run(self, ins, outs):
        if self.attrs.get("from_logits"):
            return self._from_logits(ins, outs[0])
        xp = get_xp(ins[0])
        x, label = ins[:2]
        loss, prob = outs
        axis = _axis(self.attrs, x.ndim)
        outer, channels, inner = _split_dims(x.shape, axis)
        k = raw_kernels(xp, x)
        if k is not None and _contiguous(x, prob):  # GPU: fused kernel, mean on the device
            # any axis: the (outer, C, inner) view is the kernel's axis-1 layout
            ignore, pad = self.attrs.get("ignore_label"), self.attrs.get("pad_label")
            nll, valid, *buf = self.temporaries(x, *self.scratch_specs(ins, outs))
            shard = buf.pop() if len(ins) > 2 else None
            pos = (outer, inner)
            k.softmax_loss_forward(x.reshape(outer, channels, inner),
                                   _device_labels(label, buf, pos), ignore,
                                   out=(prob.reshape(outer, channels, inner),
                                        nll.reshape(pos), valid.reshape(pos)), pad_label=pad)
            _device_mean(k, nll, valid, loss, shard, ins[2:])
            return
        lab, valid, count = _labels(self.attrs, label, outer, channels, inner)
        x3 = x.reshape(outer, channels, inner)
        p3 = prob.reshape(outer, channels, inner)
        picked, sumexp = _host_softmax(xp, x3, p3, lab)
        p3 /= sumexp
        nll = xp.log(sumexp[:, 0, :]) - picked  # -log softmax at the label
        loss[...] = (nll * valid).sum() / (ins[2] if len(ins) > 2 else count)

    def _from_logits(self, ins, loss):
        """The loss alone (``from_logits``): on a GPU for bits rows
        (``_bits_rows``) one kernel on the bits; else a chunk of positions at a time:
        the logits (bits or float32) widened into the chunk's float32
        scratch, the probabilities written there by the same kernels (the
        same code on the host), the per-position losses kept whole for the
        same batch mean."""
        x, label = ins[:2]
        xp = get_xp(x)
        axis = _axis(self.attrs, x.ndim)
        outer, channels, inner = _split_dims(x.shape, axis)
        rows, _ = _chunk_positions(x.shape, axis)
        x3 = x.reshape(outer, channels, inner)
        k = raw_kernels(xp, loss)
        if k is not None:
            ignore, pad = self.attrs.get("ignore_label"), self.attrs.get("pad_label")
            nll, valid, *buf = self.temporaries(x, *self.scratch_specs(ins, [loss]))
            if _bits_rows(x, axis):   # one kernel on the bits, no chunk
                shard = buf.pop() if len(ins) > 2 else None
                lab = _device_labels(label, buf, (outer,))
                k.softmax_loss_forward_bits(x.reshape(outer, channels), lab, ignore,
                                            out=(nll, valid), pad_label=pad)
                _device_mean(k, nll, valid, loss, shard, ins[2:])
                return
            wide = buf.pop()
            shard = buf.pop() if len(ins) > 2 else None
            lab = _device_labels(label, buf, (outer, inner))
            nll2, valid2 = nll.reshape(outer, inner), valid.reshape(outer, inner)
            for s in spans(outer, rows):
                w3 = wide[:s.stop - s.start]
                k.softmax_loss_forward(widen(x3[s], w3), lab[s], ignore,
                                       out=(w3, nll2[s], valid2[s]), pad_label=pad)
            _device_mean(k, nll, valid, loss, shard, ins[2:])
            return
        lab, valid, count = _labels(self.attrs, label, outer, channels, inner)
        nll = np.empty((outer, inner), loss.dtype)
        (wide,) = self.temporaries(loss, self.host_temporaries(ins, [loss])[-1])
        for s in spans(outer, rows):
            w3 = wide[:s.stop - s.start]
            picked, sumexp = _host_softmax(xp, widen(x3[s], w3), w3, lab[s])
            nll[s] = xp.log(sumexp[:, 0, :]) - picked
        loss[...] = (nll * valid).sum() / (ins[2] if len(ins) > 2 else count)

    def host_temporaries(self, ins, outs):
        """The host run's per-position arrays at its peak: the labels as
        int64 and the valid mask (``_labels``), the picked shifted score,
        the sum of exponentials, its log and the loss; ``from_logits``
        also the float32 chunk of the logits (the last)."""
        axis = _axis(self.attrs, ins[0].ndim)
        outer, _, inner = _split_dims(ins[0].shape, axis)
        pos, dtype = (outer * inner,), value_dtype(ins[0].dtype)
        chunk = [(_chunk_positions(ins[0].shape, axis)[1], dtype)] \
            if self.attrs.get("from_logits") else []
        return [(pos, np.int64), (pos, np.bool_)] + [(pos, dtype)] * 4 + chunk


@register
class SoftmaxLossGrad(OpKernel):
    """[dloss, prob, label(, normaliser)] -> [dx]: dx = dloss * (prob -
    onehot(label)) / count, the forward op's normaliser in place of count
    when it has one (attrs ``axis``, ``ignore_label``, ``pad_label`` as the
    forward op)."""

    op_type = "SoftmaxLossGrad"
    #: dx over prob: element-wise (each element's prob read before its dx);
    #: ``from_logits``, dx over x: each chunk of x is read (widened) before
    #: its dx is written, and dx has x's storage (bits for bits)
    in_place = ((1, 0),)

    @classmethod
    def bits_inputs(cls, attrs):
        """The logits, ``from_logits`` (its second input in place of prob)."""
        return (1,) if attrs.get("from_logits") else ()

    @classmethod
    def bits_outputs(cls, attrs):
        """dx as bfloat16 bits, ``from_logits``: a float32 chunk rounded."""
        return (0,) if attrs.get("from_logits") else ()

    def scratch_specs(self, ins, outs):
        dtype = value_dtype(ins[1].dtype)
        chunk = []
        axis = _axis(self.attrs, len(ins[1].shape))
        if self.attrs.get("from_logits") and not _bits_rows(ins[1], axis):
            # the chunk's losses, valid flags, logits
            rows, shape = _chunk_positions(ins[1].shape, axis)
            pos = ((rows * shape[2],), dtype)
            chunk = [pos, pos, (shape, dtype)]
        return _raw_specs(np.empty(0, dtype), [((1,), dtype)] + _label_specs(ins[2]) + chunk)

    def setup(self, ins, outs):
        _reserve(self, ins[1], self.scratch_specs(ins, outs))

    @classmethod
    def infer(cls, attrs, ins):
        _, (ps, pd), (ls, _) = ins[:3]
        _check_label(attrs, ps, ls, cls.op_type)
        _check_normaliser(ins[3:], cls.op_type)
        if attrs.get("from_logits"):
            return [(tuple(ps), out_dtype(attrs, pd))]
        return [(tuple(ps), pd)]

    def run(self, ins, outs):
        if self.attrs.get("from_logits"):
            return self._from_logits(ins, outs[0])
        xp = get_xp(ins[1])
        dloss, prob, label = ins[:3]
        axis = _axis(self.attrs, prob.ndim)
        outer, channels, inner = _split_dims(prob.shape, axis)
        k = raw_kernels(xp, prob)
        if k is not None and _contiguous(prob, outs[0]):  # GPU: fused kernel, scale on device
            scale = dloss if get_xp(dloss) is not np else float(np.asarray(dloss))
            count, *buf = self.temporaries(prob, *self.scratch_specs(ins, outs))
            planes = (outer, channels, inner)
            lab = _device_labels(label, buf, (outer, inner))
            plain = _device_count(k, ins, lab, count, self.attrs)
            _device_backward(k, prob.reshape(planes), lab, scale, self.attrs,
                             outs[0].reshape(planes), count, outer * inner, plain)
            return
        lab, valid, count = _labels(self.attrs, label, outer, channels, inner)
        dx = outs[0].reshape(outer, channels, inner)
        if xp is np:
            dx[...] = prob.reshape(outer, channels, inner)
            _minus_onehot(dx, lab, valid)
        else:
            # a device array without the fused kernel (another dtype, strides):
            # no read back to the host (bool(...) would end a stream capture)
            # and no put_along_axis (recent CuPy only)
            onehot = xp.arange(channels, dtype=np.int64)[None, :, None] == lab[:, None, :]
            xp.subtract(prob.reshape(outer, channels, inner), onehot, out=dx)
            dx *= valid[:, None, :]
        dx *= dloss / (ins[3] if len(ins) > 3 else count)

    def _from_logits(self, ins, dx):
        """dx from the logits (``from_logits``): on a GPU for bits rows
        (``_bits_rows``) one kernel on the bits writing dx (bits or float32);
        else a chunk of positions at a time: the chunk widened into float32
        scratch, its probabilities
        computed as the forward computed them (the same kernel or code: the
        same bits), dx = dloss * (prob - onehot) / count there by the
        float32 path's kernel or code, then written into dx -- rounded into
        bits where dx is bits (one ``to_bf16_bits``)."""
        dloss, x, label = ins[:3]
        xp = get_xp(x)
        axis = _axis(self.attrs, x.ndim)
        outer, channels, inner = _split_dims(x.shape, axis)
        rows, _ = _chunk_positions(x.shape, axis)
        x3 = x.reshape(outer, channels, inner)
        dx3 = dx.reshape(outer, channels, inner)
        bits = is_bits(dx)
        if xp is not np:
            from ..gpu.kernels import to_bf16_bits_device
            k = raw_kernels(xp, np.empty(0, value_dtype(x.dtype)))
            ignore, pad = self.attrs.get("ignore_label"), self.attrs.get("pad_label")
            scale = dloss if get_xp(dloss) is not np else float(np.asarray(dloss))
            count, *buf = self.temporaries(x, *self.scratch_specs(ins, [dx]))
            if _bits_rows(x, axis):   # one kernel on the bits: dx as bits or float32
                lab = _device_labels(label, buf, (outer,))
                plain = _device_count(k, ins, lab, count, self.attrs)
                x2, dx2 = x.reshape(outer, channels), dx.reshape(outer, channels)
                if plain:
                    k.softmax_loss_grad_bits(x2, lab, scale, None, out=dx2,
                                             scale_factor=1.0 / (outer * inner))
                else:
                    k.softmax_loss_grad_bits(x2, lab, scale, ignore, out=dx2, count=count,
                                             pad_label=pad)
                return
            wide, valid, nll = buf.pop(), buf.pop(), buf.pop()
            lab = _device_labels(label, buf, (outer, inner))
            plain = _device_count(k, ins, lab, count, self.attrs)
            for s in spans(outer, rows):
                n = s.stop - s.start
                w3 = wide[:n]
                k.softmax_loss_forward(widen(x3[s], w3), lab[s], ignore,
                                       out=(w3, nll[:n * inner].reshape(n, inner),
                                            valid[:n * inner].reshape(n, inner)),
                                       pad_label=pad)
                _device_backward(k, w3, lab[s], scale, self.attrs, w3 if bits else dx3[s],
                                 count, outer * inner, plain)
                if bits:
                    to_bf16_bits_device(w3.reshape(-1), dx3[s].reshape(-1))
            return
        lab, valid, count = _labels(self.attrs, label, outer, channels, inner)
        *_, wide, scratch = self.temporaries(dx, *self.host_temporaries(ins, [dx]))
        for s in spans(outer, rows):
            d3 = wide[:s.stop - s.start]
            _, sumexp = _host_softmax(xp, widen(x3[s], d3), d3, lab[s])
            d3 /= sumexp   # the probabilities, as the forward's
            _minus_onehot(d3, lab[s], valid[s])
            d3 *= dloss / (ins[3] if len(ins) > 3 else count)
            if bits:
                to_bf16_bits(d3, dx3[s], scratch)
            else:
                dx3[s] = d3

    def host_temporaries(self, ins, outs):
        """The host run's labels as int64, the valid mask, and the label's
        probabilities less 1 (taken, then the difference); ``from_logits``
        also the float32 chunk of the logits and to_bf16_bits's chunk (the
        last two)."""
        prob = ins[1]
        axis = _axis(self.attrs, len(prob.shape))
        outer, _, inner = _split_dims(prob.shape, axis)
        pos, dtype = (outer * inner,), value_dtype(prob.dtype)
        chunk = []
        if self.attrs.get("from_logits"):
            rows, shape = _chunk_positions(prob.shape, axis)
            chunk = [(shape, dtype), (wire_scratch(int(np.prod(shape))).shape, np.uint32)]
        return [(pos, np.int64), (pos, np.bool_), (pos, dtype), (pos, dtype)] + chunk


@gradient("SoftmaxLoss")
def _softmax_loss_grad(g, op):
    x, label = op.inputs[:2]
    dloss, dprob = g.grad_of(op.outputs[0]), g.grad_of(op.outputs[1])
    if not g.needs_grad(x):
        return
    if dloss is not None:
        attrs = {k: op.attrs[k] for k in ("axis", "ignore_label", "pad_label")
                 if k in op.attrs}
        g.emit("SoftmaxLossGrad", [dloss, op.outputs[1], label] + list(op.inputs[2:]),
               [g.grad_blob(x)], attrs)
    if dprob is not None:  # rare: the probabilities feed another loss
        g.emit("SoftmaxGrad", [dprob, op.outputs[1]], [g.grad_blob(x)],
               {"axis": op.attrs.get("axis", 1)})


@register
class Accuracy(OpKernel):
    """[x, label] -> [acc]: the fraction of counted positions whose label is
    among the ``top_k`` (default 1) highest scores of ``x`` over ``axis``,
    a 0-d scalar (counted: label neither attr ``ignore_label`` nor attr
    ``pad_label``, as SoftmaxLoss). As Caffe, a tie with the true class counts against it.
    A position with any non-finite score (NaN, +-inf: a diverged net) counts
    as wrong, never as right.
    A test-time metric: no gradient."""

    op_type = "Accuracy"
    capture_note = "counts the valid labels on the host"

    capturable = False

    def capturable_on(self, ins, outs):
        """Scores on a GPU in float32/64 (a blob is contiguous): the raw
        kernels run there and read nothing back, so the op may be captured
        (None: no objection); else it counts on the host: False. The
        blob-level form of ``_on_device``, which ``run`` asks of its arrays."""
        from ..gpu.raw import KERNEL_DTYPES
        x = ins[0]
        raw = (x.location.device >= 0 and np.dtype(x.dtype) in KERNEL_DTYPES
               and np.dtype(outs[0].dtype) == np.dtype(x.dtype))
        return None if raw else False

    @staticmethod
    def _on_device(x):
        return raw_kernels(get_xp(x), x) is not None and x.flags.c_contiguous

    def scratch_specs(self, ins, outs):
        axis = _axis(self.attrs, ins[0].ndim)
        return _raw_specs(ins[0], _accuracy_specs(ins[0], axis) + _label_specs(ins[1]))

    def setup(self, ins, outs):
        _reserve(self, ins[0], self.scratch_specs(ins, outs))

    def host_temporaries(self, ins, outs):
        """The host count's arrays live at its peak: the labels as int64 and
        the counted mask (``_labels``), the true class's scores, the
        comparison with them (a byte a score) and its count per position
        (int64): the bool array of the scores' size is the large one (1.1
        MiB on gpt_tiny's test batch, not counted before)."""
        x = ins[0]
        outer, channels, inner = _split_dims(x.shape, _axis(self.attrs, x.ndim))
        return [((outer, inner), np.int64), ((outer, inner), np.bool_),
                ((outer, 1, inner), x.dtype), ((outer, channels, inner), np.bool_),
                ((outer, inner), np.int64)]

    @classmethod
    def infer(cls, attrs, ins):
        (xs, xd), (ls, _) = ins
        _check_label(attrs, xs, ls, cls.op_type)
        top_k = int(attrs.get("top_k", 1))
        if top_k < 1:
            raise ShapeError(f"Accuracy: top_k must be >= 1, got {attrs.get('top_k')}")
        classes = xs[_axis(attrs, len(xs))]
        if top_k > classes:  # Caffe's CHECK_LE: every sample would count as right
            raise ShapeError(f"Accuracy: top_k must be at most the {classes} classes of the "
                             f"scores {list(xs)} (with more every sample counts as right), "
                             f"got {top_k}")
        dtype = xd if np.dtype(xd).kind == "f" else "float32"
        return [((), dtype)]

    def run(self, ins, outs):
        x, label = ins
        axis = _axis(self.attrs, x.ndim)
        outer, channels, inner = _split_dims(x.shape, axis)
        if self._on_device(x) and np.dtype(outs[0].dtype) == np.dtype(x.dtype):
            # GPU: two raw kernels, nothing read back (a bad label gives NaN)
            correct, valid, *buf = self.temporaries(x, *self.scratch_specs(ins, outs))
            raw_kernels(get_xp(x), x).accuracy(
                x.reshape(outer, channels, inner), _device_labels(label, buf, (outer, inner)),
                outs[0], top_k=int(self.attrs.get("top_k", 1)),
                ignore_label=self.attrs.get("ignore_label"), buffers=(correct, valid),
                pad_label=self.attrs.get("pad_label"))
            return
        lab, valid, _ = _labels(self.attrs, label, outer, channels, inner)
        x3 = x.reshape(outer, channels, inner)
        true_score = get_xp(x).take_along_axis(x3, lab[:, None, :], axis=1)
        better = (x3 >= true_score).sum(axis=1) - 1  # the true class itself counts once
        finite = get_xp(x).isfinite(x3).all(axis=1)
        correct = (better < int(self.attrs.get("top_k", 1))) & valid & finite
        n_valid = int(valid.sum())
        outs[0][...] = correct.sum() / n_valid if n_valid else 0.0


@register
class CountedPositions(OpKernel):
    """[label] -> [count]: how many positions of ``label`` a SoftmaxLoss or
    Accuracy with the same attrs ``ignore_label`` and ``pad_label`` counts
    (label neither ``ignore_label`` nor ``pad_label``), a 0-d float64: the
    number its batch figure is the mean over. The test pass weighs a figure
    with an ``ignore_label`` by it (train/evaluation.py): counted in the
    graph, when the op that makes the figure reads the label, rather than
    from the label blob after the batch, which a pipeline stage's transfer
    window hands back to the stage before as soon as its readers are done
    (the next batch's label may be in it by then). A test-time op: no
    gradient. On a GPU one block of cuda/softmax_loss.cu counts
    (``softmax_loss_count`` with floor 0: an all-ignored batch weighs 0,
    where the loss's normaliser is at least 1); nothing is read back."""

    op_type = "CountedPositions"

    @classmethod
    def infer(cls, attrs, ins):
        if len(ins) != 1:
            raise ShapeError(f"CountedPositions takes one input (the label), got {len(ins)}")
        return [((), "float64")]

    def scratch_specs(self, ins, outs):
        return _raw_specs(outs[0], _label_specs(ins[0]))

    def setup(self, ins, outs):
        # by the count's dtype (float64), as run takes the kernels: the label's
        # (int32 from the text source) has no raw kernels, and nothing was reserved
        _reserve(self, outs[0], self.scratch_specs(ins, outs))

    def run(self, ins, outs):
        label, count = ins[0], outs[0]
        k = raw_kernels(get_xp(count), count)
        if k is not None:  # GPU: one block counts on the device, in stream order
            buf = self.temporaries(count, *self.scratch_specs(ins, outs))
            lab = _device_labels(label, buf, (int(np.prod(label.shape, dtype=np.int64)),))
            k.softmax_loss_count(lab, self.attrs.get("ignore_label"), count.reshape(1),
                                 pad_label=self.attrs.get("pad_label"), floor=0)
            return
        count[...] = _valid(label.reshape(-1).astype(np.int64), _skipped(self.attrs)).sum()
