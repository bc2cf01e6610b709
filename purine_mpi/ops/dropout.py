"""Inverted dropout: units are scaled by 1/(1 - ratio) at train time, so the
test-time op is the identity (Caffe's and PyTorch's convention).

The keep-mask is an explicit output blob of the forward op, read by the
backward op, so no state hides in the kernel between the two. It is drawn
from Philox4x32-10 (:mod:`purine_mpi.base.philox`), a counter-based generator
keyed by (run seed, op) and counted by (element, iteration), the iteration
read from the iteration blob (an input of the op). So the masks:

- are the same on the CPU (NumPy) and on a GPU (``cuda/dropout.cu``), bit
  for bit, and the GPU draws them on the device with no host work;
- need no generator state: a resumed run redraws the masks of the
  iterations it runs, so it stays bit-identical to an uninterrupted one.

With the attr ``packed_mask`` (set by activation recompute,
graph/recompute.py) the forward writes the mask bit-packed instead: one bit
an element, ``np.packbits`` of the flat keep-mask (big bit order), a uint8
blob of ceil(n / 8) bytes (1/32 of a float32 mask), that ``DropoutGrad``
(same attr) and a recompute copy (``DropoutReplay``) read instead of
drawing Philox again: on a GPU one kernel each (cuda/dropout.cu
``dropout_forward_packed``, ``dropout_backward_packed``) that writes or
reads the bits where it multiplies, so no float or unpacked mask is made
and nothing is allocated (a CUDA graph captures them); on the host NumPy
packs and unpacks (the kernels' ``host_temporaries``).

The run seed is the dispatcher's per-rank seed (``seed`` of the config and
the rank), handed over through the runtime's per-op generator hook
(``needs_rng``); the kernel keeps only the two 32-bit words it derives from
it and drops the generator, so checkpoints hold no random state for it.
Without a dispatcher (a kernel run by hand) the seed is the ``seed`` attr
(default 0).
"""
import numpy as np

from ..base.backend import get_xp, to_numpy
from ..base.errors import ShapeError
from ..base.precision import BITS, to_bf16_bits, wire_scratch
from ..gpu.raw import raw_kernels
from ..base.philox import dropout_keys, keep_mask, keep_mask_temporaries
from .registry import OpKernel, gradient, register, specs_nbytes


def _ratio(attrs, key="ratio", default=0.5):
    ratio = float(attrs.get(key, default))
    if not 0.0 <= ratio < 1.0:
        raise ShapeError(f"dropout ratio must lie in [0, 1), got {ratio}")
    return ratio


def _train(attrs):
    phase = attrs.get("phase", "train")
    if phase not in ("train", "test"):
        raise ShapeError(f"dropout phase must be 'train' or 'test', got {phase!r}")
    return phase == "train"


def packed_shape(shape):
    """The shape of the bit-packed mask of a blob of ``shape``: (ceil(n / 8),)."""
    return (-(-int(np.prod(shape, dtype=np.int64)) // 8),)


def _check_packed(what, shape, bits):
    """A ShapeError unless ``bits`` ((shape, dtype)) is the packed mask of ``shape``."""
    if tuple(bits[0]) != packed_shape(shape) or np.dtype(bits[1]) != np.uint8:
        raise ShapeError(f"{what}: the packed mask of {list(shape)} is uint8 of shape "
                         f"{list(packed_shape(shape))}, got {bits[1]} of shape {list(bits[0])}")


def pack_mask(keep):
    """The bit-packed form of a keep-mask (bool or 0/1) array: uint8, flat."""
    xp = get_xp(keep)
    return xp.packbits(keep.reshape(-1) != 0)


def pack_temporaries(shape):
    """The ``(shape, dtype)`` arrays :func:`pack_mask` of a mask of
    ``shape`` allocates: the comparison (bool) and the packed bits."""
    return [(tuple(shape), np.bool_), (packed_shape(shape), np.uint8)]


def unpack_mask(bits, shape, dtype, out=None):
    """The keep-mask of ``shape`` in ``dtype`` (0 and 1) from its packed
    form; written into ``out`` (of ``shape``) where given."""
    xp = get_xp(bits)
    count = int(np.prod(shape, dtype=np.int64))
    keep = xp.unpackbits(bits.reshape(-1))[:count].reshape(shape)
    if out is None:
        return keep.astype(dtype)
    out[...] = keep
    return out


def unpack_temporaries(shape, dtype=None):
    """The ``(shape, dtype)`` arrays :func:`unpack_mask` with ``out`` of
    ``shape`` allocates: the unpacked bytes (a whole number of bytes' bits);
    with ``dtype`` (no ``out``) the mask it returns too, live with them."""
    return [((8 * packed_shape(shape)[0],), np.uint8)] + (
        [] if dtype is None else [(tuple(shape), np.dtype(dtype))])


def _iteration_value(it):
    """The iteration held by a host blob (a NumPy scalar array)."""
    return int(np.asarray(it).reshape(()))


def check_iteration(what, spec):
    """A ShapeError unless ``spec`` ((shape, dtype)) is the iteration blob's:
    a scalar integer (the input that counts a Philox mask stream)."""
    shape, dtype = spec
    if int(np.prod(shape, dtype=np.int64)) != 1 or np.dtype(dtype).kind not in "iu":
        raise ShapeError(f"{what}'s iteration input is a scalar integer blob; got {dtype} of "
                         f"shape {list(shape)}")


def dropout_forward(x, it, ratio, keys, y, mask=None, split=None):
    """Dropout's train forward: y = x * keep / (1 - ratio), keep the Philox
    keep-mask of the stream ``keys`` ((key0, key1, counter word 1),
    :func:`purine_mpi.base.philox.dropout_keys`) at iteration ``it`` (the
    iteration blob), and mask <- keep in x's dtype (0 and 1) where given. y
    may be x. On a GPU the raw kernel of cuda/dropout.cu (``mask`` required),
    on the host NumPy: the same bits, the same products, in the same order.
    Used by the Dropout op and by the fused Attention op's dropout
    (ops/attention.py). ``split``: the op's attr ``mask_split`` (a
    tensor-parallel shard's: x is a part of the unsplit op's input and
    takes that part of its mask, :func:`purine_mpi.base.philox.keep_mask`;
    the host only, scheme tensor refuses a GPU there)."""
    xp = get_xp(x)
    key0, key1, ctr1 = keys
    k = raw_kernels(xp, x)
    if k is not None and split:
        raise ShapeError("a tensor-parallel shard's dropout mask (attr mask_split) is drawn "
                         "on the host only; the device kernels count the local elements")
    if k is not None:
        if get_xp(it) is np:
            it = _iteration_value(it)
        k.dropout_forward(x, it, ratio, key0, key1, ctr1, out=(y, mask))
        return
    keep = xp.asarray(keep_mask(x.shape, ratio, key0, key1, ctr1,
                                _iteration_value(to_numpy(it)), split))
    if mask is not None:
        mask[...] = keep
        keep = mask
    # x * keep is x or 0 exactly (the mask's 0/1 or the bools alike); x is
    # read before y is written, so y may share x's storage
    xp.multiply(x, keep, out=y)
    y *= 1.0 / (1.0 - ratio)


def dropout_apply(x, it, ratio, keys, y, split=None, copy=None, scratch=None):
    """y = x * keep / (1 - ratio) of ``dropout_forward``'s draw, no mask
    written: on a GPU one kernel (``dropout_apply``: nothing kept, nothing
    allocated), on the host ``dropout_forward`` without a mask. Given
    Dropout's dy for x, y is its dx: (dy * keep) * scale, the product
    ``dropout_backward`` makes with the kept mask, bit for bit. ``copy``
    (uint16, y's size; float32 y): y's bfloat16 bits too -- on a GPU in the
    same kernel (``dropout_apply_copy_f32``), on the host ``to_bf16_bits``
    of y after (``scratch``: its ``wire_scratch``)."""
    k = raw_kernels(get_xp(x), x)
    if k is None or split:
        dropout_forward(x, it, ratio, keys, y, None, split)
        if copy is not None:
            to_bf16_bits(y, copy, scratch)
        return
    key0, key1, ctr1 = keys
    if get_xp(it) is np:
        it = _iteration_value(it)
    k.dropout_apply(x, it, ratio, key0, key1, ctr1, out=y, copy=copy)


def dropout_backward(dy, mask, ratio, out, copy=None, scratch=None):
    """out = dy * mask / (1 - ratio) (Dropout's gradient; out may be dy):
    on a GPU the raw kernel, else NumPy in the same order. ``copy`` (uint16,
    out's size; float32 out): out's bfloat16 bits too -- on a GPU in the
    same kernel (``dropout_backward_copy_f32``), on the host
    ``to_bf16_bits`` of out after (``scratch``: its ``wire_scratch``)."""
    k = raw_kernels(get_xp(dy), dy, mask)
    if k is not None:
        k.dropout_backward(dy, mask, ratio, out=out, copy=copy)
        return
    get_xp(dy).multiply(dy, mask, out=out)
    out *= 1.0 / (1.0 - ratio)
    if copy is not None:
        to_bf16_bits(out, copy, scratch)


def dropout_forward_packed(x, it, ratio, keys, y, bits, split=None):
    """``dropout_forward`` with the mask written bit-packed into ``bits``
    (uint8, :func:`packed_shape`; ``pack_mask`` of the keep-mask). On a GPU
    one kernel (``dropout_forward_packed`` of cuda/dropout.cu: the same
    Philox words, y bit for bit, the bits written per byte, no float mask
    and nothing allocated, so a CUDA graph captures it); on the host
    ``dropout_forward`` into a float mask (x's shape and dtype), then
    ``pack_mask`` of it (``Dropout.host_temporaries`` counts both)."""
    k = raw_kernels(get_xp(x), x)
    if k is None or split:
        mask = get_xp(x).empty_like(x)
        dropout_forward(x, it, ratio, keys, y, mask, split)
        bits[...] = pack_mask(mask)
        return
    key0, key1, ctr1 = keys
    if get_xp(it) is np:
        it = _iteration_value(it)
    k.dropout_forward_packed(x, it, ratio, key0, key1, ctr1, out=(y, bits.reshape(-1)))


def dropout_backward_packed(dy, bits, ratio, out, copy=None, scratch=None):
    """``dropout_backward`` with the mask its packed bits (uint8,
    :func:`packed_shape`): out = (dy * bit_i) / (1 - ratio), out may be dy.
    On a GPU one kernel (``dropout_backward_packed`` of cuda/dropout.cu,
    ``dropout_backward_packed_copy_f32`` with ``copy``) reads each bit
    where it multiplies: no unpacked mask is made and nothing allocated;
    the bits ``dropout_backward`` gives from the unpacked mask. On the host
    ``unpack_mask`` (a new mask in dy's dtype, ``unpack_temporaries``),
    then ``dropout_backward``. Also ``DropoutReplay``'s y = (x * mask) *
    scale, the forward's product."""
    k = raw_kernels(get_xp(dy), dy)
    if k is not None:
        k.dropout_backward_packed(dy, bits.reshape(-1), ratio, out=out, copy=copy)
        return
    dropout_backward(dy, unpack_mask(bits, dy.shape, dy.dtype), ratio, out, copy, scratch)


class PhiloxStream:
    """What a kernel drawing Dropout's Philox masks shares (a mixin before
    OpKernel): the run seed from the dispatcher's per-op generator hook
    (``needs_rng``), kept as a number, the generator dropped (nothing to
    save); ``keys`` of the stream the ``stream`` attr names (default the
    op itself). A copy of such an op (activation recompute) redraws the
    same masks: ``counter_rng``."""

    #: the dispatcher's per-op generator hook carries the run seed (see the
    #: module docstring); no generator is kept
    needs_rng = True
    #: the draws are a function of (seed, stream, iteration): a copy of the
    #: op repeats them bit for bit (graph/recompute.py)
    counter_rng = True

    def __init__(self, op):
        self._seed = int(op.attrs.get("seed", 0))
        super().__init__(op)

    @property
    def rng(self):
        """Always None: the masks need no generator state (nothing to save)."""
        return None

    @rng.setter
    def rng(self, generator):
        # The runtime seeds its per-op generators with [run seed, crc32(op)]:
        # keep the run seed, the op id comes from the name (philox.op_id).
        if generator is not None and hasattr(generator, "bit_generator"):
            entropy = generator.bit_generator.seed_seq.entropy
            self._seed = int(entropy[0] if isinstance(entropy, (list, tuple)) else entropy)

    @property
    def split(self):
        """The attr ``mask_split`` (a tensor-parallel shard's op, drawing its
        part of the unsplit op's mask; see ``dropout_forward``), or None."""
        return self.op.attrs.get("mask_split")

    @property
    def keys(self):
        """(key0, key1, counter word 1) of this op's Philox stream (that of
        the op its ``stream`` attr names, if any)."""
        return dropout_keys(self._seed, self.op.attrs.get("stream", self.op.name))


@register
class Dropout(PhiloxStream, OpKernel):
    """Train phase: [x, iter] -> [y, mask], mask_i = 1 when Philox word i of
    the op's stream at iteration ``iter`` is >= floor(ratio 2^32), else 0 (in
    x's dtype; P(1) = 1 - ratio), y = x * mask / (1 - ratio).
    Test phase: [x] -> [y], y = x.
    Attrs ``ratio`` (default 0.5), ``phase`` (default "train"), ``seed``
    (used only when no dispatcher provides the run seed), ``stream`` (the
    op whose Philox stream it draws, default itself), ``packed_mask``
    (default false; true: the mask output is the bit-packed uint8 blob of
    :func:`packed_shape`, see the module docstring), ``redraw_mask``
    (default false; true: no mask output, the gradient, ``DropoutRedrawGrad``,
    draws it again: parallel/placement.redraw_dropout_masks on a GPU),
    ``mask_split`` (set
    by scheme tensor's split, parallel/tensor_parallel.py: {axis, parts,
    index}, x is that part of the unsplit op's input and draws that part
    of its mask).
    Gradient: dx = dy * mask / (1 - ratio) (train), dx = dy (test)."""

    op_type = "Dropout"
    in_place = ((0, 0),)  # y over x

    @classmethod
    def infer(cls, attrs, ins):
        _ratio(attrs)
        if not _train(attrs):
            if len(ins) != 1:
                raise ShapeError(f"Dropout (test phase) takes [x], got {len(ins)} inputs")
            return [ins[0]]
        if len(ins) != 2:
            raise ShapeError("Dropout (train phase) takes [x, iter]: the iteration blob keys "
                             f"its random mask; got {len(ins)} input(s)")
        check_iteration("Dropout", ins[1])
        if attrs.get("redraw_mask"):
            return [ins[0]]
        if attrs.get("packed_mask"):
            return [ins[0], (packed_shape(ins[0][0]), "uint8")]
        return [ins[0], ins[0]]

    def host_temporaries(self, ins, outs):
        """Train phase: the host Philox draw's temporaries (the bool
        keep-mask and a chunk's buffers, ``keep_mask_temporaries``; the
        mask output takes the bools, which are freed before the product).
        With ``packed_mask`` the float mask scratch (x's shape and dtype),
        live through the draw and the packing, and the larger of the two
        (``pack_mask``'s comparison and bits, ``pack_temporaries``)."""
        if not _train(self.attrs):
            return []
        shape = tuple(ins[0].shape)
        draw = keep_mask_temporaries(shape, self.split)
        if not self.attrs.get("packed_mask"):
            return draw
        return [(shape, ins[0].dtype)] + max(draw, pack_temporaries(shape), key=specs_nbytes)

    def run(self, ins, outs):
        x = ins[0]
        if not _train(self.attrs):
            outs[0][...] = x
            return
        ratio = _ratio(self.attrs)
        if self.attrs.get("redraw_mask"):   # no mask kept: DropoutRedrawGrad draws it again
            dropout_apply(x, ins[1], ratio, self.keys, outs[0], self.split)
            return
        y, mask = outs
        if self.attrs.get("packed_mask"):   # the packed bits are the output
            dropout_forward_packed(x, ins[1], ratio, self.keys, y, mask, self.split)
            return
        dropout_forward(x, ins[1], ratio, self.keys, y, mask, self.split)


@register
class DropoutReplay(OpKernel):
    """[x, bits] -> [y]: y = x * mask / (1 - ratio), mask unpacked from
    ``bits``, the packed mask of a ``Dropout`` with ``packed_mask`` (attr
    ``ratio``, the same): the same y as that Dropout's, bit for bit, with no
    Philox draw. Activation recompute's copy of such a Dropout
    (graph/recompute.py)."""

    op_type = "DropoutReplay"
    in_place = ((0, 0),)  # y over x

    @classmethod
    def infer(cls, attrs, ins):
        _ratio(attrs)
        if len(ins) != 2:
            raise ShapeError(f"DropoutReplay takes [x, bits], got {len(ins)} input(s)")
        _check_packed("DropoutReplay", ins[0][0], ins[1])
        return [ins[0]]

    def host_temporaries(self, ins, outs):
        """The mask unpacked from ``bits``: its bytes and x's dtype copy."""
        return unpack_temporaries(ins[0].shape, ins[0].dtype)

    def run(self, ins, outs):
        # as Dropout computes y: x * mask, then the scale -- dropout_backward's
        # product with x for dy (on a GPU read from the bits: nothing allocated)
        x, bits = ins
        dropout_backward_packed(x, bits, _ratio(self.attrs), outs[0])


@register
class DropoutGrad(OpKernel):
    """[dy, mask] -> [dx]: dx = dy * mask / (1 - ratio). With the attr
    ``packed_mask``, mask is the bit-packed uint8 blob of a Dropout with
    that attr (``dropout_backward_packed``: on a GPU read bit by bit in the
    product's kernel, on the host unpacked first).

    With attr ``bits_copy: [0]`` (bf16 storage, parallel/precision.
    fold_copies: a dropout's dx read as float32 by a bias gradient and, as
    bits, by products) a second output, dx's bfloat16 bits (uint16: the
    bits a Cast of dx wrote): on a GPU in the product's pass
    (``dropout_backward_copy_f32``), on the host ``to_bf16_bits`` of dx
    after it. As ``DropoutRedrawGrad``'s, from the kept mask."""

    op_type = "DropoutGrad"
    in_place = ((0, 0),)  # dx over dy

    @classmethod
    def bits_copies(cls, attrs):
        return (0,)

    @classmethod
    def infer(cls, attrs, ins):
        if attrs.get("packed_mask"):
            _check_packed("DropoutGrad", ins[0][0], ins[1])
        elif tuple(ins[0][0]) != tuple(ins[1][0]):
            raise ShapeError(f"DropoutGrad: dy {list(ins[0][0])} and mask "
                             f"{list(ins[1][0])} differ")
        copy = list(attrs.get("bits_copy", ()))
        if copy not in ([], [0]) or (copy and np.dtype(ins[0][1]) != np.float32):
            raise ShapeError(f"DropoutGrad: bits_copy takes [0] of a float32 dx, got "
                             f"{copy} ({ins[0][1]})")
        return [ins[0]] + [(ins[0][0], BITS)] * len(copy)

    def host_temporaries(self, ins, outs):
        """With ``packed_mask`` the host's unpacked mask (its bytes and dy's
        dtype copy; a GPU reads the bits in its kernel: no temporary); else
        none (dy * mask is written into dx); for dx's bits copy
        (``bits_copy``) to_bf16_bits's scratch."""
        specs = []
        if self.attrs.get("packed_mask"):
            specs = list(unpack_temporaries(ins[0].shape, ins[0].dtype))
        if len(outs) > 1:
            specs.append((wire_scratch(outs[0].size).shape, np.uint32))
        return specs

    def run(self, ins, outs):
        dy, mask = ins
        ratio = _ratio(self.attrs)
        copy = outs[1] if len(outs) > 1 else None
        scratch = None
        if copy is not None and get_xp(outs[0]) is np:
            (scratch,) = self.temporaries(outs[0], self.host_temporaries(ins, outs)[-1])
        if self.attrs.get("packed_mask"):   # on a GPU the bits read in the product's pass
            dropout_backward_packed(dy, mask, ratio, outs[0], copy, scratch)
            return
        dropout_backward(dy, mask, ratio, outs[0], copy, scratch)


@register
class DropoutRedrawGrad(PhiloxStream, OpKernel):
    """[dy, iter] -> [dx]: Dropout's gradient with the mask drawn again from
    the forward's Philox stream (attr ``stream``: the forward op's name, or
    its own ``stream``) at the same iteration instead of read from a kept
    mask: dx = (dy * mask) / (1 - ratio), the bits ``DropoutGrad`` gives.
    parallel/placement.redraw_dropout_masks makes it on a GPU, where the
    draw is one kernel that reads the device's iteration blob, so no mask
    lives from the forward to the backward (PyTorch keeps a bool one).

    With attr ``bits_copy: [0]`` (bf16 storage, parallel/precision.
    fold_copies: a residual dropout's dx read as float32 by the projection's
    bias gradient and, as bits, by its data and weight gradients) a second
    output, dx's bfloat16 bits (uint16: the bits a Cast of dx wrote): on a
    GPU in the draw's pass (``dropout_apply_copy_f32``), on the host
    ``to_bf16_bits`` of dx after the draw."""

    op_type = "DropoutRedrawGrad"
    in_place = ((0, 0),)  # dx over dy

    @classmethod
    def bits_copies(cls, attrs):
        return (0,)

    @classmethod
    def infer(cls, attrs, ins):
        _ratio(attrs)
        if len(ins) != 2:
            raise ShapeError(f"DropoutRedrawGrad takes [dy, iter], got {len(ins)} input(s)")
        if not attrs.get("stream"):
            raise ShapeError("DropoutRedrawGrad needs the forward's Philox stream (attr stream)")
        check_iteration("DropoutRedrawGrad", ins[1])
        copy = list(attrs.get("bits_copy", ()))
        if copy not in ([], [0]) or (copy and np.dtype(ins[0][1]) != np.float32):
            raise ShapeError(f"DropoutRedrawGrad: bits_copy takes [0] of a float32 dx, got "
                             f"{copy} ({ins[0][1]})")
        return [ins[0]] + [(ins[0][0], BITS)] * len(copy)

    def host_temporaries(self, ins, outs):
        """The host draw's temporaries (``keep_mask_temporaries``); for dx's
        bits copy (``bits_copy``) to_bf16_bits's scratch."""
        specs = keep_mask_temporaries(tuple(ins[0].shape), self.split)
        if len(outs) > 1:
            specs = list(specs) + [(wire_scratch(outs[0].size).shape, np.uint32)]
        return specs

    def run(self, ins, outs):
        copy = outs[1] if len(outs) > 1 else None
        scratch = None
        if copy is not None and get_xp(outs[0]) is np:
            (scratch,) = self.temporaries(outs[0], self.host_temporaries(ins, outs)[-1])
        dropout_apply(ins[0], ins[1], _ratio(self.attrs), self.keys, outs[0], self.split,
                      copy, scratch)


def redraw_grad_attrs(op):
    """The attrs of ``DropoutRedrawGrad`` for the gradient of the training
    Dropout ``op``: its ratio, seed and mask split, and the Philox stream
    it draws (its own ``stream``, default its name)."""
    attrs = {"ratio": op.attrs.get("ratio", 0.5), "stream": op.attrs.get("stream", op.name)}
    attrs.update({k: op.attrs[k] for k in ("seed", "mask_split") if k in op.attrs})
    return attrs


@gradient("Dropout")
def _dropout_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    x = op.inputs[0]
    if dy is None or not g.needs_grad(x):
        return
    if _train(op.attrs) and op.attrs.get("redraw_mask"):
        g.emit("DropoutRedrawGrad", [dy, op.inputs[1]], [g.grad_blob(x)], redraw_grad_attrs(op))
    elif _train(op.attrs):
        attrs = {"ratio": op.attrs.get("ratio", 0.5)}
        if op.attrs.get("packed_mask"):
            attrs["packed_mask"] = True
        g.emit("DropoutGrad", [dy, op.outputs[1]], [g.grad_blob(x)], attrs)
    else:
        g.emit("Copy", [dy], [g.grad_blob(x)])
