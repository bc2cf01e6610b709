"""2-D convolution (NCHW), computed as Caffe does: im2col + GEMM.

Forward ("Conv", inputs [x, w] or [x, w, b], output [y])::

    y[n, o, i, j] = b[o] + sum_{c, p, q} w[o, c, p, q] *
                    xpad[n, g(o)*C/G + c, i*sh + p*dh, j*sw + q*dw]

with ``xpad`` the input zero-padded by ``pad``, ``G = group`` and ``g(o)`` the
group of output channel ``o``; ``w`` has shape (O, C/G, kh, kw). Attrs:
``stride``, ``pad``, ``dilation`` (int or [h, w]; defaults 1, 0, 1), ``group``
(default 1). Output size: ``OH = (H + 2*ph - (dh*(kh-1) + 1)) // sh + 1``.

Gradients (col = im2col(x), one row per (c, p, q), one column per (n, i, j)):

    dw = dy @ col^T          ("ConvGradWeight", [dy, x] -> [dw])
    dx = col2im(w^T @ dy)    ("ConvGradData",   [dy, w] -> [dx], attr x_shape)
    db = sum_{n,i,j} dy      ("ConvGradBias",   [dy] -> [db])

On the CPU the columns are copied a chunk of the batch at a time (the
chunk's columns stay under ``COL_CHUNK_BYTES``, in cache) into per-thread
buffers that are reused across chunks, calls and ops (``ops/im2col.py``:
nothing is allocated per call, and the padding is a border written once,
not an ``np.pad`` copy). From ``ROWS_MIN_C`` input channels up (one group)
they are copied channels-last (``im2col_rows``: a row per output pixel, its
columns (kh, kw, C)), so the copy moves runs of kw*C numbers rather than one
image row at a time; the forward is then ``rows @ w^T`` and the weight
gradient one GEMM per chunk, ``dy (O, n*L) @ rows (n*L, K)``, accumulated
over the chunks (one GEMM over the whole batch when it fits one chunk).
Measured, one thread, cifar10_quick's conv2 / conv3 (benchmarks/conv_ops.py):
forward 1.18x / 1.41x, weight gradient 1.36x / 1.47x, data gradient 1.17x /
1.70x faster than the (C, kh, kw)-ordered copy; on 3 input channels the
runs are too short and it is slower (conv1's forward: 0.63x), so fewer
channels, and groups, keep that copy: one strided view of the padded chunk copied out,
the weight gradient one GEMM per chunk (``im2col_batch``) where the column
matrix has at least ``WGRAD_GEMM_MIN_K`` rows, else one GEMM per sample and a
sum (measured faster at K = 75). col2im loops over the kh*kw kernel offsets
with strided slice-adds (no scatter). A 1x1 convolution at stride 1 without
padding needs no columns: forward and data gradient are GEMMs on x, dy and w
as they are; its weight gradient one GEMM per sample and a sum (one GEMM
over the batch would first transpose x and dy: measured slower on NIN).

On the CPU the forward adds the bias to each chunk of y while it is in cache
(on the rows path within the copy into y's layout) instead of in a pass over
all of y afterwards (cifar10_quick's conv1: 4.3 -> 0.5 ms), and the bias
gradient is a matrix-vector product of dy's planes with ones, then a sum
over the batch.

On the CPU a stride-1 ConvGradData is computed as the forward convolution it
is equal to: dy, padded by ``d*(k-1) - pad``, correlated with the kernel
flipped and its in/out channels swapped (per group). That is one im2col copy
and a GEMM whose inner dimension is O*kh*kw, instead of a GEMM with inner
dimension O writing a (C*kh*kw)-row column matrix and kh*kw strided
read-modify-write passes over dx: about 1.8x faster on CIFAR's 5x5 convs.
Strided convolutions, and pads past ``d*(k-1)``, keep the col2im path.

On a GPU (CuPy arrays) each direction runs a cuDNN graph built once in the
op's ``setup`` (``gpu/cudnn.py``: NVIDIA's cuDNN frontend, the bias and a
fused ReLU in its epilogue where it offers that), or, without cuDNN or a
plan for the shape, ``gpu/conv.py``: the raw im2col/col2im kernels of
cuda/im2col.cu into the op's scratch memory and cuBLAS GEMMs on strided
views, the bias and a fused ReLU in one epilogue kernel. Either way nothing
is copied or allocated per iteration; the bias gradient is one reduction
kernel. A ReLU mask fused into ConvGradData goes into cuDNN's dgrad graph
(dgrad + drelu) where it has a plan, else one kernel after it.
"""
import numpy as np

from ..base.backend import get_xp
from ..base.errors import ShapeError
from ..gpu.raw import raw_kernels, sum_scratch
from .hostgemm import matmul
from .im2col import (cols_hold, data_grad_col2im, data_grad_holds, flat_hold,
                     forward_rows, forward_rows_holds, gemm_holds, hold, im2col, im2col_batch,
                     pad_hold, padded, take, weight_grad_rows, weight_grad_rows_holds)
from .registry import OpKernel, gradient, register, spans

#: upper bound on the im2col buffer of one chunk of the batch. On the CPU a
#: chunk that stays in cache is faster than one big GEMM (measured: ~1.5x on a
#: CIFAR conv); on a GPU fewer, larger launches win (gpu/conv.py). 4 MiB (in
#: L3) against 2 MiB, one thread, best of 15 runs: cifar10_quick's conv2
#: forward / weight / data gradient 22.2 / 23.8 / 25.9 -> 21.3 / 21.1 / 20.6
#: ms, conv3 the same to 5%, NIN unchanged (its chunks are a sample or two).
COL_CHUNK_BYTES = 4 << 20

#: ConvGradWeight on the CPU: from this many rows of the column matrix
#: (C/G*kh*kw) up, one GEMM per chunk of the batch (dy as (O, n*L) against
#: the columns as (n*L, K)); below it, one small GEMM per sample and a sum
#: over the chunk. Measured, one thread: NIN's conv3 (K 1728) 136 -> 82 ms,
#: conv2 (K 2400) 508 -> 445 ms, cifar10_quick's conv3 (K 800) 20 -> 15 ms;
#: the 5x5 convs on 3 channels (K 75) 84 -> 90 ms and 13.5 -> 14.2 ms.
WGRAD_GEMM_MIN_K = 256

#: from this many input channels up (one group), the CPU convolutions copy
#: their columns channels-last (``im2col_rows``): runs of kw*C numbers
#: instead of OW, measured below.
ROWS_MIN_C = 16


def pair(value, name):
    """An int or a [h, w] pair -> (h, w) ints (Caffe's kernel/stride/pad)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ShapeError(f"attr '{name}' must be an int or a [h, w] pair, got {value!r}")
        return int(value[0]), int(value[1])
    return int(value), int(value)


def _geometry(attrs, x_shape, w_shape):
    """Checked conv geometry: dict of stride/pad/dilation pairs, group, output size."""
    if len(x_shape) != 4:
        raise ShapeError(f"Conv needs a 4-D NCHW input, got shape {list(x_shape)}")
    if len(w_shape) != 4:
        raise ShapeError(f"Conv weight must be 4-D (out, in/group, kh, kw), got {list(w_shape)}")
    N, C, H, W = x_shape
    O, Cg, kh, kw = w_shape
    sh, sw = pair(attrs.get("stride", 1), "stride")
    ph, pw = pair(attrs.get("pad", 0), "pad")
    dh, dw = pair(attrs.get("dilation", 1), "dilation")
    group = int(attrs.get("group", 1))
    if min(sh, sw, dh, dw, group) < 1 or min(ph, pw) < 0:
        raise ShapeError("Conv needs stride, dilation, group >= 1 and pad >= 0, got "
                         f"stride={[sh, sw]} dilation={[dh, dw]} group={group} pad={[ph, pw]}")
    if C % group or O % group:
        raise ShapeError(f"Conv group={group} must divide the input channels ({C}) and the "
                         f"output channels ({O})")
    if Cg * group != C:
        raise ShapeError(f"Conv weight {list(w_shape)} expects {Cg * group} input channels "
                         f"(in/group={Cg}, group={group}); the input has {C}")
    OH = (H + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    OW = (W + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    if OH < 1 or OW < 1:
        raise ShapeError(f"Conv kernel {[kh, kw]} (dilation {[dh, dw]}) does not fit the padded "
                         f"input {[H + 2 * ph, W + 2 * pw]}")
    return dict(N=N, C=C, H=H, W=W, O=O, kh=kh, kw=kw, sh=sh, sw=sw, ph=ph, pw=pw,
                dh=dh, dw=dw, G=group, OH=OH, OW=OW)


def _step(geo, itemsize):
    """Samples per chunk: as many as keep the columns under the chunk size."""
    per_sample = geo["C"] * geo["kh"] * geo["kw"] * geo["OH"] * geo["OW"] * itemsize
    return max(1, COL_CHUNK_BYTES // max(per_sample, 1))


def _chunks(xp, geo, itemsize):
    """Batch slices whose column buffers stay under the chunk size."""
    step = _step(geo, itemsize)
    return spans(geo["N"], step)


def _cap(geo, itemsize):
    """The most samples a chunk has (``_chunks``' first)."""
    return min(_step(geo, itemsize), geo["N"])


def _pad_holds(geo, dtype):
    """``_padded_chunks``' buffer ([] without padding)."""
    ph, pw, H, W = geo["ph"], geo["pw"], geo["H"], geo["W"]
    if ph == 0 and pw == 0:
        return []
    return [pad_hold(_cap(geo, np.dtype(dtype).itemsize), geo["C"], H, W, ph, pw,
                     (H + 2 * ph, W + 2 * pw), dtype, 0)]


def _sizes(geo, dtype):
    """The distinct sample counts of ``_chunks``' chunks (the first's, the
    last's)."""
    return sorted({s.stop - s.start for s in _chunks(np, geo, np.dtype(dtype).itemsize)})


def _K(geo):
    """A group's inner size C/G*kh*kw."""
    return geo["C"] // geo["G"] * geo["kh"] * geo["kw"]


def _forward_holds(geo, dtype):
    """[Hold] ``_forward_cpu`` takes for geometry ``geo`` (ops/im2col.Hold),
    the products' scratch (``gemm_holds``) with them."""
    G, O, C, L = geo["G"], geo["O"], geo["C"], geo["OH"] * geo["OW"]
    if _pointwise(geo):
        return gemm_holds(dtype, ((G, O // G, C // G), (geo["N"], G, C // G, L)))
    cap = _cap(geo, np.dtype(dtype).itemsize)
    if _by_rows(geo):
        return forward_rows_holds(cap, geo, dtype) + gemm_holds(
            dtype, *(((n * L, _K(geo)), (_K(geo), O)) for n in _sizes(geo, dtype)))
    return _pad_holds(geo, dtype) + [cols_hold(cap, geo, dtype)] + gemm_holds(
        dtype, *(((G, O // G, _K(geo)), (n, G, _K(geo), L)) for n in _sizes(geo, dtype)))


def _data_grad_holds(geo, dtype):
    """[Hold] ConvGradData's CPU path takes."""
    G, O, C, L = geo["G"], geo["O"], geo["C"], geo["OH"] * geo["OW"]
    if _pointwise(geo):
        return gemm_holds(dtype, ((G, C // G, O // G), (geo["N"], G, O // G, L)))
    tgeo = _transposed_geometry(geo)
    if tgeo is not None:
        return _forward_holds(tgeo, dtype)
    return data_grad_holds(_cap(geo, np.dtype(dtype).itemsize), geo, dtype) + gemm_holds(
        dtype, *(((G, _K(geo), O // G), (n, G, O // G, L)) for n in _sizes(geo, dtype)))


def _wgrad_small_holds(n, geo, dw_dtype):
    """The per-sample weight gradient's accumulator (G, K, O/G) and the GEMM
    output (n, G, K, O/G) of a chunk of ``n`` samples."""
    G, O = geo["G"], geo["O"]
    K = geo["C"] // G * geo["kh"] * geo["kw"]
    return [flat_hold("dw_acc", (G, K, O // G), dw_dtype),
            flat_hold("gemm", (n, G, K, O // G), dw_dtype)]


def _weight_grad_holds(geo, dtype, dw_dtype):
    """[Hold] ConvGradWeight's CPU path takes: its buffers and its products'
    scratch (``gemm_holds``; the first chunk's product written into dw or
    its accumulator, of dw's dtype, the others' into new arrays)."""
    G, O, C, L, K = geo["G"], geo["O"], geo["C"], geo["OH"] * geo["OW"], _K(geo)
    sizes = _sizes(geo, dtype)
    cap = _cap(geo, np.dtype(dtype).itemsize)
    if _pointwise(geo):
        return gemm_holds(dtype, *(((n, G, O // G, L), (n, G, L, C // G)) for n in sizes))
    if _by_rows(geo):
        first, rest = ((O, cap * L), (cap * L, K)), [((O, n * L), (n * L, K)) for n in sizes]
    elif K < WGRAD_GEMM_MIN_K:
        return (_wgrad_small_holds(cap, geo, dw_dtype) + _pad_holds(geo, dtype)
                + [cols_hold(cap, geo, dtype)]
                + gemm_holds(dw_dtype, *(((n, G, K, L), (n, G, L, O // G)) for n in sizes)))
    else:
        first = ((G, O // G, cap * L), (G, cap * L, K))
        rest = [((G, O // G, n * L), (G, n * L, K)) for n in sizes]
    rest = gemm_holds(dtype, *rest) if len(_chunks(np, geo, np.dtype(dtype).itemsize)) > 1 \
        else []
    holds = gemm_holds(dw_dtype, first) + rest
    if _by_rows(geo):
        return weight_grad_rows_holds(cap, geo, dtype, dw_dtype) + holds
    return _pad_holds(geo, dtype) + [cols_hold(cap, geo, dtype, "batch")] + holds


def _ones_hold(dy_shape, dtype):
    """ConvGradBias' CPU vector of ones, one per plane element."""
    return hold("ones", (int(np.prod(dy_shape[2:], dtype=np.int64)),), dtype, fill=1)


def _padded_chunks(xp, x, geo):
    """(slice, padded chunk of x) for each chunk of the batch (``_chunks``):
    the chunk copied into the interior of this thread's reused zero-bordered
    buffer (``im2col.padded``; no ``np.pad`` copy of the batch, nothing
    allocated per call); without padding the chunks are views of x."""
    chunks = _chunks(xp, geo, x.itemsize)
    ph, pw, H, W = geo["ph"], geo["pw"], geo["H"], geo["W"]
    if ph == 0 and pw == 0:
        for sl in chunks:
            yield sl, x[sl]
        return
    cap = chunks[0].stop - chunks[0].start
    for sl in chunks:
        yield sl, padded(xp, x[sl], ph, pw, (H + 2 * ph, W + 2 * pw), 0, capacity=cap)


def _pointwise(geo):
    """Whether the conv is a 1x1 kernel at stride 1 without padding: a plain
    GEMM per sample on the input as it is (no im2col)."""
    return (geo["kh"], geo["kw"], geo["sh"], geo["sw"], geo["ph"], geo["pw"]) == (1, 1, 1, 1, 0, 0)


def _forward_cpu(xp, x, wmat, geo, y, bias=None):
    """y = conv(x) (+ ``bias`` per output channel) with the (G, O/G, C/G*kh*kw)
    weight matrix ``wmat``: im2col of a chunk of the batch at a time, one
    batched GEMM each, the bias added to the chunk while it is in cache (on
    the rows path within the copy into y's layout) rather than in a pass over
    all of y afterwards (a 1x1 conv at stride 1: one GEMM per sample on x
    itself)."""
    G = geo["G"]
    y = y.reshape(geo["N"], G, geo["O"] // G, geo["OH"] * geo["OW"])
    b = None if bias is None else bias.reshape(G, geo["O"] // G, 1)
    if _pointwise(geo):
        matmul(xp, wmat, x.reshape(geo["N"], G, geo["C"] // G, -1), out=y)
        if b is not None:
            y += b
        return
    if _by_rows(geo):
        forward_rows(xp, x, wmat, geo, y, _chunks(xp, geo, x.itemsize), bias)
        return
    for sl, xpad in _padded_chunks(xp, x, geo):
        # (G, O/G, K) @ (n, G, K, L) -> (n, G, O/G, L): y's own layout, no transpose
        matmul(xp, wmat, im2col(xp, xpad, geo), out=y[sl])
        if b is not None:
            y[sl] += b


def _by_rows(geo):
    """Whether the CPU paths take the channels-last columns (``im2col_rows``):
    one group of at least ``ROWS_MIN_C`` input channels."""
    return geo["G"] == 1 and geo["C"] >= ROWS_MIN_C


def _transposed_geometry(geo):
    """The geometry of the forward convolution that computes a stride-1
    conv's input gradient (see the module docstring), or None where there is
    none: a stride above 1, or a pad past the dilated kernel's reach."""
    qh = geo["dh"] * (geo["kh"] - 1) - geo["ph"]
    qw = geo["dw"] * (geo["kw"] - 1) - geo["pw"]
    if geo["sh"] != 1 or geo["sw"] != 1 or qh < 0 or qw < 0:
        return None
    return dict(geo, C=geo["O"], O=geo["C"], H=geo["OH"], W=geo["OW"],
                OH=geo["H"], OW=geo["W"], ph=qh, pw=qw)


def _data_grad_as_conv(xp, dy, w, geo, tgeo, dx):
    """dx of a stride-1 conv as the forward conv of dy (geometry ``tgeo``)
    with the flipped kernel: w (O, C/G, kh, kw) -> per group (C/G, O/G, kh, kw)."""
    G, O, C, kh, kw = geo["G"], geo["O"], geo["C"], geo["kh"], geo["kw"]
    flipped = w.reshape(G, O // G, C // G, kh, kw)[:, :, :, ::-1, ::-1].transpose(0, 2, 1, 3, 4)
    _forward_cpu(xp, dy, xp.ascontiguousarray(flipped).reshape(G, C // G, -1), tgeo, dx)


def _gpu(kernel, *arrays):
    """(gpu.conv module, scratch) when the arrays live on a GPU (float32/64),
    else (None, None): the NumPy path."""
    xp = get_xp(arrays[0])
    if raw_kernels(xp, *arrays) is None:
        return None, None
    from ..gpu import conv as gpu_conv
    from ..gpu.raw import array_device, op_scratch
    return gpu_conv, op_scratch(kernel, array_device(arrays[0]))


def _gpu_prepared(kernel, ins, outs, *arrays):
    """``_gpu`` for ``run``: on a GPU, the op's ``setup`` (plan, scratch) runs
    first when nothing has run it yet."""
    gpu, scratch = _gpu(kernel, *arrays)
    if gpu is not None and not getattr(kernel, "_gpu_ready", False):
        kernel.setup(ins, outs)
    return gpu, scratch


def _gpu_setup(kernel, kind, geo, arrays, buffers=None, **fusion):
    """Once per op on a GPU: the cuDNN plan of direction ``kind`` (or None:
    the im2col path) and the op's scratch reserved for it. ``buffers``: the
    op's inputs by cuDNN tensor key, the plans are timed on them. Returns the
    plan."""
    gpu, scratch = _gpu(kernel, *arrays)
    kernel._gpu_ready = True
    kernel._plan = None
    if gpu is None:
        return None
    from ..gpu import cudnn as gpu_cudnn
    from ..gpu.raw import array_device
    kernel._plan = gpu_cudnn.plan(kernel, kind, geo, arrays[0].dtype,
                                  array_device(arrays[0]), buffers=buffers,
                                  values=_low_values(kernel), **fusion)
    if kernel._plan is not None:
        scratch.reserve(((kernel._plan.workspace_bytes,), np.uint8))
    else:
        gpu.reserve(scratch, geo, _WHICH[kind], arrays[0].dtype)
    return kernel._plan


_WHICH = {"fprop": "forward", "dgrad": "data", "wgrad": "weight"}


def _low_values(kernel):
    """``bfloat16``/``float16`` for an op the precision pass marked so (its
    cuDNN plans may use TF32: ``tf32_when_low``), else None."""
    dtype = kernel.attrs.get("compute_dtype")
    return dtype if dtype in ("bfloat16", "float16") else None


class _ConvScratch:
    """The scratch of one convolution direction (``OpKernel.scratch_specs``):
    once set up on a GPU, its cuDNN plan's workspace or the im2col columns
    (gpu/conv.scratch_specs); before (``plan``), the workspace cuDNN will
    take (gpu/cudnn.expected_workspace: the tuner's cache, else the cap) or
    the columns. Subclasses give ``_direction(ins, outs)``: (cuDNN kind,
    geometry, dtype, fusion)."""

    tf32_when_low = True   # its products read only its (rounded) inputs

    def _expected(self, ins, outs):
        """(kind, geo, dtype, workspace bytes or None: im2col, source, entry)."""
        kind, geo, dtype, fusion = self._direction(ins, outs)
        if getattr(self, "_gpu_ready", False):   # set up: the plan it took
            plan = self._plan
            if plan is None:
                return kind, geo, dtype, None, "im2col", None
            return kind, geo, dtype, int(plan.workspace_bytes), "cuDNN plan", None
        from ..gpu import cudnn as gpu_cudnn
        found = gpu_cudnn.expected_workspace(kind, geo, dtype, values=_low_values(self),
                                             **fusion)
        if found is None:
            return kind, geo, dtype, None, "im2col", None
        return (kind, geo, dtype) + tuple(found)

    def scratch_specs(self, ins, outs):
        from ..gpu.raw import KERNEL_DTYPES
        kind, geo, dtype, workspace, _, _ = self._expected(ins, outs)
        if np.dtype(dtype) not in KERNEL_DTYPES:
            return []
        if workspace is not None:
            return [((workspace,), np.uint8)] if workspace else []
        from ..gpu import conv as gpu_conv
        return gpu_conv.scratch_specs(geo, _WHICH[kind], dtype)

    def scratch_note(self, ins, outs):
        _, _, _, workspace, source, entry = self._expected(ins, outs)
        if workspace is None:
            return "im2col columns"
        note = f"cuDNN workspace ({source}"
        if entry is not None and entry.get("ms") is not None and \
                entry.get("fastest_ms") is not None:
            note += (f"; {float(entry['ms']) - float(entry['fastest_ms']):.3f} ms a run "
                     "given up against the fastest plan")
        return note + ")"

    def runs_products(self, ins, outs):
        """The im2col path's GEMMs go through cuBLAS; cuDNN's do not."""
        return self._expected(ins, outs)[3] is None


def _cudnn_run(kernel, scratch, arrays):
    """Run the op's cuDNN plan on ``arrays``, its workspace from the scratch."""
    plan = kernel._plan
    (workspace,) = scratch.take(((plan.workspace_bytes,), np.uint8))
    plan.execute(arrays, workspace)


def _epilogue(xp, k, y, bias, attrs):
    """y += bias (per channel, axis 1), then the ReLU fused into this layer
    (attr ``relu``, set by parallel/fuse.py; ``negative_slope``): one kernel on a
    GPU, the Relu op's own arithmetic on the CPU."""
    fused = bool(attrs.get("relu", False))
    slope = float(attrs.get("negative_slope", 0.0))
    if k is not None and y.flags.c_contiguous:
        if bias is not None or fused:
            k.bias_act(y, bias, fused, slope)
        return
    if bias is not None:
        y += bias.reshape((1, -1) + (1,) * (y.ndim - 2))
    if fused:
        from .activation import relu
        relu(xp, y, slope, y)


@register
class Conv(_ConvScratch, OpKernel):
    """y = conv2d(x, w) + b, then a fused ReLU when attr ``relu`` is true;
    see the module docstring."""

    op_type = "Conv"

    @classmethod
    def infer(cls, attrs, ins):
        if len(ins) not in (2, 3):
            raise ShapeError(f"Conv takes [x, w] or [x, w, b], got {len(ins)} inputs")
        geo = _geometry(attrs, ins[0][0], ins[1][0])
        if len(ins) == 3 and tuple(ins[2][0]) != (geo["O"],):
            raise ShapeError(f"Conv bias must have shape [{geo['O']}], got {list(ins[2][0])}")
        return [((geo["N"], geo["O"], geo["OH"], geo["OW"]), ins[0][1])]

    def run(self, ins, outs):
        x, w = ins[0], ins[1]
        xp = get_xp(x)
        geo = _geometry(self.attrs, x.shape, w.shape)
        G, O = geo["G"], geo["O"]
        gpu, scratch = _gpu_prepared(self, ins, outs, x, w)
        if gpu is not None:
            plan = self._plan
            if plan is not None:  # cuDNN, with the bias and ReLU when it fuses them
                arrays = {"x": x, "w": w, "y": outs[0]}
                if "b" in plan.tensors:
                    arrays["b"] = ins[2]
                _cudnn_run(self, scratch, arrays)
                if plan.fused:
                    return
            else:  # raw im2col kernel into scratch, cuBLAS GEMMs
                gpu.forward(x, w, outs[0], geo, scratch)
            _epilogue(xp, raw_kernels(xp, x, w), outs[0], ins[2] if len(ins) == 3 else None,
                      self.attrs)
        else:  # the bias added chunk by chunk, in cache
            _forward_cpu(xp, x, w.reshape(G, O // G, -1), geo, outs[0],
                         ins[2] if len(ins) == 3 else None)
            _epilogue(xp, None, outs[0], None, self.attrs)

    def _direction(self, ins, outs):
        return ("fprop", _geometry(self.attrs, ins[0].shape, ins[1].shape), ins[0].dtype,
                dict(bias=len(ins) == 3, relu=bool(self.attrs.get("relu", False)),
                     slope=float(self.attrs.get("negative_slope", 0.0))))

    def host_scratch(self, ins, outs):
        return _forward_holds(_geometry(self.attrs, ins[0].shape, ins[1].shape), ins[0].dtype)

    def setup(self, ins, outs):
        x, w = ins[0], ins[1]
        buffers = {"x": x, "w": w}
        if len(ins) == 3:
            buffers["b"] = ins[2]
        _gpu_setup(self, "fprop", _geometry(self.attrs, x.shape, w.shape), (x, w),
                   buffers=buffers, bias=len(ins) == 3,
                   relu=bool(self.attrs.get("relu", False)),
                   slope=float(self.attrs.get("negative_slope", 0.0)))


@register
class ConvGradData(_ConvScratch, OpKernel):
    """dx = col2im(w^T @ dy) (on the CPU at stride 1: the equal forward conv of dy
    with the flipped kernel). Inputs [dy, w] (+ m, the ReLU mask of the layer below,
    parallel/fuse.py: dx *= m > 0, or mask_slope); attr x_shape plus Conv's attrs."""

    op_type = "ConvGradData"

    def _direction(self, ins, outs):
        return ("dgrad", _geometry(self.attrs, outs[0].shape, ins[1].shape), ins[0].dtype,
                dict(relu=len(ins) > 2, slope=float(self.attrs.get("mask_slope", 0))))

    def setup(self, ins, outs):
        dy, w, m = ins[0], ins[1], ins[2:]   # m: the fused ReLU mask
        _gpu_setup(self, "dgrad", _geometry(self.attrs, outs[0].shape, w.shape), (dy, w),
                   buffers=dict(dy=dy, w=w, **({"m": m[0]} if m else {})), relu=bool(m),
                   slope=float(self.attrs.get("mask_slope", 0)))

    def host_scratch(self, ins, outs):
        return _data_grad_holds(_geometry(self.attrs, outs[0].shape, ins[1].shape),
                                ins[0].dtype)

    @classmethod
    def infer(cls, attrs, ins):
        x_shape = tuple(attrs["x_shape"])
        geo = _geometry(attrs, x_shape, ins[1][0])
        if tuple(ins[0][0]) != (geo["N"], geo["O"], geo["OH"], geo["OW"]):
            raise ShapeError(f"ConvGradData: dy shape {list(ins[0][0])} does not match the "
                             f"output shape {[geo['N'], geo['O'], geo['OH'], geo['OW']]}")
        return [(x_shape, ins[0][1])]

    def run(self, ins, outs):
        self._data_grad(ins[0], ins[1], outs, ins)
        if ins[2:] and not getattr(getattr(self, "_plan", None), "fused", False):
            from .activation import relu_backward   # the mask, when cuDNN did not fuse it
            relu_backward(outs[0], ins[2], float(self.attrs.get("mask_slope", 0)), outs[0])

    def _data_grad(self, dy, w, outs, ins):
        xp = get_xp(dy)
        geo = _geometry(self.attrs, outs[0].shape, w.shape)
        G, O, C, N = geo["G"], geo["O"], geo["C"], geo["N"]
        gpu, scratch = _gpu_prepared(self, ins, outs, dy, w)
        if gpu is not None:
            if self._plan is not None:   # with the mask when the plan fused it
                _cudnn_run(self, scratch, dict({"dy": dy, "w": w, "dx": outs[0]},
                                               **({"m": ins[2]} if self._plan.fused else {})))
            else:  # cuBLAS GEMMs (W transposed by cuBLAS), raw col2im
                gpu.backward_data(dy, w, outs[0], geo, scratch)
            return
        if _pointwise(geo):  # dx[n] = w^T dy[n], one GEMM per sample
            wT = xp.ascontiguousarray(w.reshape(G, O // G, C // G).transpose(0, 2, 1))
            matmul(xp, wT, dy.reshape(N, G, O // G, -1), out=outs[0].reshape(N, G, C // G, -1))
            return
        tgeo = _transposed_geometry(geo)
        if tgeo is not None:
            _data_grad_as_conv(xp, dy, w, geo, tgeo, outs[0])
            return
        data_grad_col2im(xp, dy, w, geo, outs[0], _chunks(xp, geo, dy.itemsize))


@register
class ConvGradWeight(_ConvScratch, OpKernel):
    """dw = sum_n dy[n] @ im2col(x)[n]^T.  Inputs [dy, x]; Conv's attrs."""

    op_type = "ConvGradWeight"

    def _direction(self, ins, outs):
        return ("wgrad", _geometry(self.attrs, ins[1].shape, outs[0].shape), ins[0].dtype, {})

    def setup(self, ins, outs):
        dy, x = ins
        _gpu_setup(self, "wgrad", _geometry(self.attrs, x.shape, outs[0].shape), (dy, x),
                   buffers={"x": x, "dy": dy})

    def host_scratch(self, ins, outs):
        return _weight_grad_holds(_geometry(self.attrs, ins[1].shape, outs[0].shape),
                                  ins[1].dtype, outs[0].dtype)

    def host_temporaries(self, ins, outs):
        """A 1x1 conv's new arrays, a chunk of the batch at a time: the
        chunk's per-sample products (n, G, O/G, C/G) and their sum over the
        chunk (G, O/G, C/G), live together (NIN's cccp5 at batch 128: 12.1
        MiB, more than the rest of its stage's kernel temporaries, which
        plan counted without them). The other paths write into held buffers
        (``host_scratch``) but for, in a batch of several chunks, the new
        sum of each chunk after the first (the per-sample path's over its
        samples, the others' product: (G, K, O/G) or dw's shape)."""
        dy, x = ins
        geo = _geometry(self.attrs, x.shape, outs[0].shape)
        G, O, C = geo["G"], geo["O"], geo["C"]
        dtype = np.result_type(dy.dtype, x.dtype)
        if not _pointwise(geo):
            if len(_chunks(np, geo, x.itemsize)) < 2:
                return []
            if not _by_rows(geo) and _K(geo) < WGRAD_GEMM_MIN_K:
                return [((G, _K(geo), O // G), outs[0].dtype)]
            return [((O, _K(geo)), dtype)]
        return [((_cap(geo, x.itemsize), G, O // G, C // G), dtype),
                ((G, O // G, C // G), dtype)]

    @classmethod
    def infer(cls, attrs, ins):
        w_shape = tuple(attrs["w_shape"])
        geo = _geometry(attrs, ins[1][0], w_shape)
        if tuple(ins[0][0]) != (geo["N"], geo["O"], geo["OH"], geo["OW"]):
            raise ShapeError(f"ConvGradWeight: dy shape {list(ins[0][0])} does not match the "
                             f"output shape {[geo['N'], geo['O'], geo['OH'], geo['OW']]}")
        return [(w_shape, ins[0][1])]

    def run(self, ins, outs):
        dy, x = ins
        xp = get_xp(dy)
        geo = _geometry(self.attrs, x.shape, outs[0].shape)
        G, O, N = geo["G"], geo["O"], geo["N"]
        gpu, scratch = _gpu_prepared(self, ins, outs, dy, x)
        if gpu is not None:
            if self._plan is not None:
                _cudnn_run(self, scratch, {"x": x, "dy": dy, "dw": outs[0]})
            else:  # im2col, batched cuBLAS GEMM, one column-sum kernel
                gpu.backward_weight(dy, x, outs[0], geo, scratch)
            return
        L = geo["OH"] * geo["OW"]
        dyg = dy.reshape(N, G, O // G, L)
        dw = outs[0].reshape(G, O // G, -1)
        if _pointwise(geo):
            # a 1x1 conv: one small GEMM per sample on x itself, then a sum
            xg = x.reshape(N, G, geo["C"] // G, L)
            dw.fill(0)
            for sl in _chunks(xp, geo, x.itemsize):
                dw += matmul(xp, dyg[sl], xg[sl].transpose(0, 1, 3, 2)).sum(axis=0)
            return
        if _by_rows(geo):
            weight_grad_rows(xp, dy, x, geo, outs[0], _chunks(xp, geo, x.itemsize))
            return
        if geo["C"] // G * geo["kh"] * geo["kw"] < WGRAD_GEMM_MIN_K:
            # per sample dw^T (K, O/G) = col (K, L) @ dy^T (L, O/G): OpenBLAS
            # runs this orientation faster than dy @ col^T (conv1: 12.1 -> 11.2 ms)
            acc = take(xp, _wgrad_small_holds(0, geo, dw.dtype)[0])
            for i, (sl, xpad) in enumerate(_padded_chunks(xp, x, geo)):
                col = im2col(xp, xpad, geo)  # (n, G, K, L)
                per = take(xp, _wgrad_small_holds(col.shape[0], geo, dw.dtype)[1])
                matmul(xp, col, dyg[sl].transpose(0, 1, 3, 2), out=per)
                if i == 0:
                    xp.sum(per, axis=0, out=acc)
                else:
                    acc += per.sum(axis=0)
            dw[...] = acc.transpose(0, 2, 1)
            return
        # one GEMM per chunk of the batch: dy as (O, n*L) against the columns
        # as (n*L, K), both laid out so by their copies (im2col_batch)
        for i, (sl, xpad) in enumerate(_padded_chunks(xp, x, geo)):
            col = im2col_batch(xp, xpad, geo)  # (G, K, n*L)
            n = col.shape[2] // L
            dyt = xp.ascontiguousarray(dyg[sl].transpose(1, 2, 0, 3)).reshape(G, O // G, n * L)
            if i == 0:
                matmul(xp, dyt, col.transpose(0, 2, 1), out=dw)
            else:
                dw += matmul(xp, dyt, col.transpose(0, 2, 1))


@register
class ConvGradBias(OpKernel):
    """db[o] = sum_{n,i,j} dy[n, o, i, j].  Inputs [dy]."""

    op_type = "ConvGradBias"

    @classmethod
    def infer(cls, attrs, ins):
        return [((ins[0][0][1],), ins[0][1])]

    def scratch_specs(self, ins, outs):
        """The partial sums of bias_grad's split channels (float32/64)."""
        return sum_scratch(ins[0].shape, ins[0].dtype)

    def setup(self, ins, outs):
        if raw_kernels(get_xp(ins[0]), ins[0]) is not None:
            self.reserve_temporaries(ins[0], *self.scratch_specs(ins, outs))

    def host_scratch(self, ins, outs):
        return [_ones_hold(ins[0].shape, ins[0].dtype)]

    def run(self, ins, outs):
        xp = get_xp(ins[0])
        dy = ins[0]
        k = raw_kernels(xp, dy)
        if k is not None:  # deterministic reduction kernels, coalesced loads
            (partial,) = self.temporaries(dy, *self.scratch_specs(ins, outs))
            k.bias_grad(dy, out=outs[0], partial=partial)
            return
        # one matrix-vector product against ones over the planes, then a sum
        # over the batch: BLAS reads dy once at full speed (conv1 of
        # cifar10_quick: 0.80 -> 0.34 ms, one thread), NumPy's sum over the
        # axes (0, 2) walks it in short strided runs
        N, O = dy.shape[:2]
        planes = dy.reshape(N * O, -1)
        ones = take(xp, _ones_hold(dy.shape, dy.dtype))
        xp.sum(matmul(xp, planes, ones).reshape(N, O), axis=0, out=outs[0])


_GEOMETRY_ATTRS = ("stride", "pad", "dilation", "group")


@gradient("Conv")
def _conv_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    x, w = op.inputs[0], op.inputs[1]
    attrs = {k: op.attrs[k] for k in _GEOMETRY_ATTRS if k in op.attrs}
    if g.needs_grad(x):
        g.emit("ConvGradData", [dy, w], [g.grad_blob(x)],
               dict(attrs, x_shape=list(g.graph.blobs[x].shape)))
    if g.needs_grad(w):
        g.emit("ConvGradWeight", [dy, x], [g.grad_blob(w)],
               dict(attrs, w_shape=list(g.graph.blobs[w].shape)))
    if len(op.inputs) == 3 and g.needs_grad(op.inputs[2]):
        g.emit("ConvGradBias", [dy], [g.grad_blob(op.inputs[2])])
