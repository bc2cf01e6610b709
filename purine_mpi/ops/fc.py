"""Fully connected layer (Caffe's InnerProduct).

Forward ("InnerProduct", inputs [x, w] or [x, w, b], output [y])::

    X = x.reshape(M, K)      M = prod(x.shape[:axis]), K = prod(x.shape[axis:])
    y = X @ w^T + b          w: (O, K), b: (O,), y: x.shape[:axis] + (O,)

Attr ``axis`` (default 1, Caffe's): the first axis flattened into K.

Gradients::

    dX = dy @ w,  reshaped to x's shape   ("InnerProductGradData",   [dy, w] -> [dx], attr x_shape)
    dw = dy^T @ X                          ("InnerProductGradWeight", [dy, x] -> [dw])
    db = sum over rows of dy               ("InnerProductGradBias",   [dy] -> [db])

On a GPU the products are cuBLAS calls on the blobs themselves (gpu/blas.py:
the transposes are cuBLAS flags, nothing is copied or allocated), the bias
and a fused ReLU one epilogue kernel, the bias gradient one reduction kernel.
With ``PURINE_FC_EPILOGUE=cublaslt`` and nvmath-python's cuBLASLt binding,
the forward product adds the bias and applies a fused ReLU in its cuBLASLt
epilogue instead, writing y itself (gpu/blaslt.py: nothing allocated, so
captured too; the plan made at the first, eager, product).

An op the precision pass marked bf16 (``compute_dtype``: its inputs are
bfloat16 values in float32 storage) multiplies them as bfloat16 on a GPU:
one kernel per operand writes its bfloat16 bits (uint16) into the op's
scratch, reserved in ``setup`` (``scratch_specs``: what ``plan`` counts),
and one ``cublasGemmEx`` (gpu/blas.gemm_low) takes them with a float32
result -- products exact in float32, so the same numbers as TF32 on the
float32 storage up to cuBLAS's summation order, at twice TF32's tensor
rate. ``PURINE_BF16_GEMM=0``, a refused GemmEx (said once), fp16 (no bits
kernel yet) and a gradient of weight rows (``rows``) keep the TF32 path.

An operand stored as bfloat16 bits (uint16: parallel/precision.store_bits,
where every reader of a blob takes bits -- ``bits_inputs``: the forward's x
and w, the data gradient's dy and w, the weight gradient's dy and x, the
last not for a gradient of rows) goes to GemmEx as it is: no conversion, no
scratch for it. The output stays float32. Where GemmEx is refused the bits
are widened into float32 (exactly) for the float32 product.

The forward's output y is stored as bits too where every reader of it takes
bits (the softmax loss of the logits, reading them ``from_logits``; GELU;
the fused attention; a residual add; attr ``bits_out``) and the product
has no fused ReLU (``bits_outputs``). Without a bias GemmEx writes it with
a ``CUDA_R_16BF`` result -- its float32 accumulator rounded once to the
nearest bfloat16, the bits of the float32 result's rounding the float32
storage path makes after the product (``round_bf16``), so no float32 y
exists. With a bias, GemmEx cannot add a
float32 bias before its rounding (and a bias added to rounded values would
round twice; cuBLASLt's bias epilogue takes a bias of D's type, a
bfloat16 bias for a bfloat16 D -- a float32 bias only with a float32 D,
cuBLAS's ``cublasLtMatmul()`` datatype table -- so it would round the
bias first: docs/gpu.md, "Precision"): GemmEx writes its float32 result into the op's
scratch (the float32 product of y's size, the same scratch a refused
GemmEx multiplies into) and one kernel (gpu/kernels ``bias_bits``,
cuda/activation.cu) adds the bias in float32 and rounds once into y: the
float32 path's epilogue (``bias_act``) and ``round_bf16``, bit for bit.
Where GemmEx is refused, the product goes to that float32 scratch and one
``to_bf16_bits`` (or ``bias_bits``) rounds it into y (on the host: a
float32 product, the bias added, and base/precision.to_bf16_bits), the same
bits.

With ``PURINE_FC_EPILOGUE=cublaslt`` (``_lt_bits``) a biased y stored as
bits is one cuBLASLt product instead (gpu/blaslt.fc_forward_bits): the
bias rounded to bfloat16 (one ``to_bf16_bits`` into the op's scratch: O
elements, in place of the float32 product's M x O) and added by the BIAS
epilogue to the float32 accumulator before the one rounding into y --
PyTorch autocast's linear; the same numbers as above where the bias
holds bfloat16 values (the precision pass's ``b@bf16`` copy, as in every
bf16 graph), not for a float32 bias. A refusal (said once) returns this
op to the path above for good.
"""
import numpy as np

from ..base.backend import get_xp
from ..base.errors import ShapeError
from ..base.precision import from_bf16_bits, is_bits, to_bf16_bits, value_dtype, wire_scratch
from ..gpu.raw import column_scratch, float_kernels, last_axis_rows, raw_kernels
from .hostgemm import matmul, matmul_rows
from .im2col import gemm_holds
from .registry import OpKernel, ProductKernel, gradient, out_dtype, register


def _on_gpu(xp, *arrays):
    """The GEMMs go to cuBLAS directly (gpu/blas.py) for float32/64 device
    arrays (or bfloat16 bits) that are C-contiguous (blobs always are)."""
    return float_kernels(xp, *arrays) is not None and \
        all(a.flags.c_contiguous for a in arrays)


def _host(x):
    """``x`` as float32 values where it is bfloat16 bits (the host path: a
    new array, exact), else ``x``."""
    return from_bf16_bits(x, np.empty(x.shape, np.float32)) if is_bits(x) else x


def _host_widenings(*operands):
    """The float32 copies ``_host`` makes of the operands stored as bits,
    each ``(2-D shape, dtype)``: a host product's temporaries
    (``host_temporaries``)."""
    return [(tuple(shape), np.float32) for shape, dtype in operands if is_bits(dtype)]


def gemm(*args, **kwargs):
    from ..gpu.blas import gemm as cublas_gemm
    return cublas_gemm(*args, **kwargs)


def _lt_forward(x2d, w, y2d, bias, attrs):
    """The cuBLASLt epilogue (gpu/blaslt.py), when it applies."""
    from ..gpu.blaslt import fc_forward
    return fc_forward(x2d, w, y2d, bias, bool(attrs.get("relu", False)),
                      float(attrs.get("negative_slope", 0.0)))


def _bits_specs(kernel, a, b, rows=False, c=None, bias=False, lt_bias=None):
    """The scratch of a low-precision product (``scratch_specs``) of
    operands ``a`` and ``b``, each ``(2-D shape, dtype)``: where gpu/blas.
    gemm_low multiplies them as bfloat16, the uint16 bits of each float32
    one (none for an operand stored as bits); where it does not (GemmEx
    refused), the float32 widening of each bits one, and for a result ``c``
    (``(2-D shape, dtype)``) stored as bits its float32 product -- also with
    GemmEx where a ``bias`` is added to that product before its one rounding
    (``bias_bits``), except under the cuBLASLt epilogue (``lt_bias``: the
    bias's (shape, dtype), ``_lt_bits``), which writes the bits itself and
    takes the bias's bfloat16 bits instead (a float32 bias's; none for a
    bias stored as bits); [] none. The product's (or the bias bits), where
    there is one, comes last."""
    from ..gpu.blas import low_products
    low = not rows and low_products(kernel.attrs.get("compute_dtype"))
    specs = []
    for shape, dtype in (a, b):
        if low and not is_bits(dtype):
            specs.append((tuple(shape), np.uint16))
        elif not low and is_bits(dtype):
            specs.append((tuple(shape), np.float32))
    if low and bias and lt_bias is not None and c is not None and is_bits(c[1]):
        if not is_bits(lt_bias[1]):
            specs.append((tuple(lt_bias[0]), np.uint16))
        return specs
    if c is not None and (not low or bias) and is_bits(c[1]):
        specs.append((tuple(c[0]), np.float32))
    return specs


def _lt_bits(kernel, ins, outs):
    """Whether the forward's output stored as bits, with a bias, comes from
    one cuBLASLt product whose epilogue adds the bias rounded to bfloat16
    (gpu/blaslt.fc_forward_bits; ``PURINE_FC_EPILOGUE=cublaslt``), so that
    its scratch holds the bias's bits, not the float32 product: opted in,
    a bfloat16 product (GemmEx not refused) and cuBLASLt not refused for
    this op yet (``_lt_refused``, set at its run), nvmath's cuBLASLt binding
    importing (else the run keeps the default path from its first product:
    the plan counts that path's scratch, as the run takes it)."""
    from ..gpu.blaslt import available, opted_in
    return (len(ins) == 3 and bool(outs) and is_bits(outs[0])
            and kernel.attrs.get("compute_dtype") == "bfloat16"
            and not getattr(kernel, "_lt_refused", False) and opted_in() and available())


def _product(kernel, ins, outs, a, b, c, **trans):
    """``c = op(a) @ op(b)`` on a GPU: gpu/blas.gemm_low on the op's
    reserved scratch when its ``scratch_specs`` has some or an operand is
    bfloat16 bits, else ``gemm``."""
    specs = kernel.scratch_specs(ins, outs)
    if not specs and not (is_bits(a) or is_bits(b) or is_bits(c)):
        gemm(a, b, c, **trans)
        return
    from ..gpu.blas import gemm_low
    gemm_low(a, b, c, kernel.attrs["compute_dtype"],
             kernel.temporaries(c, *specs) if specs else [], **trans)


def _split(shape, axis):
    """(M, K) of an input of ``shape`` flattened from ``axis``."""
    if not 0 < axis <= len(shape):
        raise ShapeError(f"InnerProduct axis {axis} is out of range for an input of shape "
                         f"{list(shape)}")
    return int(np.prod(shape[:axis], dtype=np.int64)), int(np.prod(shape[axis:], dtype=np.int64))


@register
class InnerProduct(ProductKernel):
    """y = x.reshape(M, K) @ w^T + b, then a fused ReLU when attr ``relu`` is
    true; see the module docstring."""

    op_type = "InnerProduct"

    @classmethod
    def infer(cls, attrs, ins):
        if len(ins) not in (2, 3):
            raise ShapeError(f"InnerProduct takes [x, w] or [x, w, b], got {len(ins)} inputs")
        x_shape, w_shape = tuple(ins[0][0]), tuple(ins[1][0])
        axis = int(attrs.get("axis", 1))
        _, K = _split(x_shape, axis)
        if len(w_shape) != 2 or w_shape[1] != K:
            raise ShapeError(f"InnerProduct weight must be (num_output, {K}) for an input of shape "
                             f"{list(x_shape)} flattened from axis {axis}; got {list(w_shape)}")
        if len(ins) == 3 and tuple(ins[2][0]) != (w_shape[0],):
            raise ShapeError(f"InnerProduct bias must have shape [{w_shape[0]}], got "
                             f"{list(ins[2][0])}")
        y = out_dtype(attrs, ins[0][1])
        return [(x_shape[:axis] + (w_shape[0],), y)]

    @classmethod
    def bits_inputs(cls, attrs):
        return (0, 1)

    @classmethod
    def bits_outputs(cls, attrs):
        """y as bfloat16 bits (attr ``bits_out``: bf16 storage) for a
        bfloat16 product with no fused ReLU: without a bias GemmEx writes
        the bits of its float32 result's rounding; with one its float32
        result goes to scratch and ``bias_bits`` adds the bias and rounds
        once (the module docstring)."""
        return (0,) if attrs.get("compute_dtype") == "bfloat16" and \
            not attrs.get("relu") else ()

    def scratch_specs(self, ins, outs):
        M, K = _split(ins[0].shape, int(self.attrs.get("axis", 1)))
        return _bits_specs(self, ((M, K), ins[0].dtype), (ins[1].shape, ins[1].dtype),
                           c=((M, ins[1].shape[0]), outs[0].dtype) if outs else None,
                           bias=len(ins) == 3,
                           lt_bias=((ins[2].shape, ins[2].dtype) if _lt_bits(self, ins, outs)
                                    else None))

    def _bits_y_specs(self, ins, outs):
        """y stored as bits: the float32 product (the bias added to it) and
        to_bf16_bits's chunk (the host run's ``temporaries``)."""
        if not outs or not is_bits(outs[0]):
            return []
        M, _ = _split(ins[0].shape, int(self.attrs.get("axis", 1)))
        return [((M, ins[1].shape[0]), np.float32),
                (wire_scratch(outs[0].size).shape, np.uint32)]

    def host_temporaries(self, ins, outs):
        """y stored as bits: the float32 product (the bias added to it) and
        to_bf16_bits's chunk; a float32 copy of each operand stored as
        bits."""
        M, K = _split(ins[0].shape, int(self.attrs.get("axis", 1)))
        return self._bits_y_specs(ins, outs) + _host_widenings(((M, K), ins[0].dtype),
                                                              (ins[1].shape, ins[1].dtype))

    def host_scratch(self, ins, outs):
        """The host product's scratch (a cut along K: ops/im2col.gemm_holds),
        of the float32 product's dtype when y is stored as bits."""
        M, K = _split(ins[0].shape, int(self.attrs.get("axis", 1)))
        dtype = np.float32 if outs and is_bits(outs[0]) else outs[0].dtype
        return gemm_holds(dtype, ((M, K), (K, ins[1].shape[0])))

    def setup(self, ins, outs):
        self.reserve_temporaries(ins[0], *self.scratch_specs(ins, outs))

    def _lt_bits_forward(self, ins, outs, x, w, y, bias):
        """y (bits) = round_bf16(x @ w^T + bf16(bias)) as one cuBLASLt product
        (``_lt_bits``): each float32 operand's bits and the float32 bias's
        (rounded to nearest even: one small kernel) into the op's scratch,
        then gpu/blaslt.fc_forward_bits. False where it does not apply, or
        cuBLASLt refuses (said once there): from then on this op keeps the
        GemmEx + ``bias_bits`` path (``_lt_refused``; its float32 scratch
        taken then, eagerly: the plan at the first product)."""
        from ..gpu.blas import low_products
        from ..gpu.blaslt import fc_forward_bits, opted_in, say_if_missing
        if not _lt_bits(self, ins, outs) or not low_products(self.attrs["compute_dtype"]):
            if opted_in():
                say_if_missing()
            return False
        from ..gpu.kernels import to_bf16_bits_device
        scratch = list(self.temporaries(y, *self.scratch_specs(ins, outs)))
        ops = [a if is_bits(a) else to_bf16_bits_device(a, scratch.pop(0)) for a in (x, w)]
        b16 = bias if is_bits(bias) else to_bf16_bits_device(bias, scratch.pop(0))
        if fc_forward_bits(ops[0], ops[1], y, b16):
            return True
        self._lt_refused = True
        return False

    def run(self, ins, outs):
        x, w = ins[0], ins[1]
        xp = get_xp(x)
        M, K = _split(x.shape, int(self.attrs.get("axis", 1)))
        y = outs[0].reshape(M, -1)
        bias = ins[2] if len(ins) == 3 else None
        if is_bits(y):   # bf16 storage (no fused ReLU: bits_outputs)
            if self.attrs.get("relu"):
                raise ValueError(f"InnerProduct '{self.op.name}': an output stored as bits takes "
                                 "no fused ReLU (bits_outputs)")
            if xp is not np and bias is None:
                _product(self, ins, outs, x.reshape(M, K), w, y, trans_b=True)
                return
            if xp is not np and self._lt_bits_forward(ins, outs, x.reshape(M, K), w, y, bias):
                return   # one cuBLASLt product, the bf16 bias in its epilogue
            if xp is not np:   # the float32 product in scratch, + bias, one rounding
                *operands, wide = self.temporaries(y, *self.scratch_specs(ins, outs))
                from ..gpu.blas import gemm_low
                gemm_low(x.reshape(M, K), w, wide, self.attrs["compute_dtype"], operands,
                         trans_b=True)
                raw_kernels(xp, wide, bias).bias_bits(wide, bias, y)
                return
            wide, scratch = self.temporaries(y, *self._bits_y_specs(ins, outs))
            matmul(xp, _host(x).reshape(M, K), _host(w).T, out=wide)
            if bias is not None:   # the float32 path's epilogue (_epilogue), then one rounding
                wide += bias.reshape(1, -1)
            to_bf16_bits(wide, y, scratch)
            return
        bits = is_bits(x) or is_bits(w)
        if not bits and _on_gpu(xp, x, w, y, *(() if bias is None else (bias,))) and \
                _lt_forward(x.reshape(M, K), w, y, bias, self.attrs):
            return   # one cuBLASLt product, the bias and ReLU in its epilogue
        if _on_gpu(xp, x, w, y):  # cuBLAS straight on the blobs: y = x @ w^T
            _product(self, ins, outs, x.reshape(M, K), w, y, trans_b=True)
        else:
            matmul(xp, _host(x).reshape(M, K), _host(w).T, out=y)
        from .conv import _epilogue
        _epilogue(xp, float_kernels(xp, y, x, w), y, bias, self.attrs)


@register
class InnerProductGradData(ProductKernel):
    """dx = (dy @ w).reshape(x_shape).  Inputs [dy, w]; attrs x_shape, axis."""

    op_type = "InnerProductGradData"

    @classmethod
    def infer(cls, attrs, ins):
        dx = out_dtype(attrs, ins[0][1])
        return [(tuple(attrs["x_shape"]), dx)]

    @classmethod
    def bits_inputs(cls, attrs):
        return (0, 1)

    @classmethod
    def bits_outputs(cls, attrs):
        """dx as bfloat16 bits (attr ``bits_out``: bf16 storage) for a
        bfloat16 product: GemmEx writes the bits of its float32 result's
        rounding (no bias, no epilogue: InnerProduct's bias-free y), the
        bits the float32 path's rounding of dx gives."""
        return (0,) if attrs.get("compute_dtype") == "bfloat16" else ()

    def scratch_specs(self, ins, outs):
        M, K = _split(outs[0].shape, int(self.attrs.get("axis", 1)))
        return _bits_specs(self, ((M, ins[0].size // max(M, 1)), ins[0].dtype),
                           (ins[1].shape, ins[1].dtype), c=((M, K), outs[0].dtype))

    def _bits_dx_specs(self, outs):
        """dx stored as bits: the float32 product and to_bf16_bits's chunk
        (the host run's ``temporaries``)."""
        if not is_bits(outs[0]):
            return []
        M, K = _split(outs[0].shape, int(self.attrs.get("axis", 1)))
        return [((M, K), np.float32), (wire_scratch(outs[0].size).shape, np.uint32)]

    def host_temporaries(self, ins, outs):
        """dx stored as bits: the float32 product and to_bf16_bits's chunk;
        a float32 copy of each operand stored as bits."""
        M, _ = _split(outs[0].shape, int(self.attrs.get("axis", 1)))
        return self._bits_dx_specs(outs) + _host_widenings(
            ((M, ins[0].size // max(M, 1)), ins[0].dtype), (ins[1].shape, ins[1].dtype))

    def host_scratch(self, ins, outs):
        """The host product's scratch (a cut along K: ops/im2col.gemm_holds),
        of the float32 product's dtype when dx is stored as bits."""
        M, K = _split(outs[0].shape, int(self.attrs.get("axis", 1)))
        dtype = value_dtype(outs[0])
        return gemm_holds(dtype, ((M, ins[0].size // max(M, 1)), ins[1].shape))

    def setup(self, ins, outs):
        self.reserve_temporaries(ins[0], *self.scratch_specs(ins, outs))

    def run(self, ins, outs):
        dy, w = ins
        xp = get_xp(dy)
        M, K = _split(outs[0].shape, int(self.attrs.get("axis", 1)))
        dx = outs[0].reshape(M, K)
        if is_bits(dx) and xp is np:   # the float32 product, then one rounding
            wide, scratch = self.temporaries(dx, *self._bits_dx_specs(outs))
            matmul(xp, _host(dy).reshape(M, -1), _host(w), out=wide)
            to_bf16_bits(wide, dx, scratch)
            return
        if is_bits(dx) or _on_gpu(xp, dy, w, outs[0]):
            _product(self, ins, outs, dy.reshape(M, -1), w, dx)
            return
        matmul(xp, _host(dy).reshape(M, -1), _host(w), out=dx)


@register
class InnerProductGradWeight(ProductKernel):
    """dw = dy^T @ x.reshape(M, K).  Inputs [dy, x]; attr axis.

    Attr ``rows: [a, b]`` computes only rows a..b-1 of dw (output shape
    (b - a, K)) from columns a..b-1 of dy: the data-parallel composition
    splits a large weight's gradient this way, so the first rows' allreduce
    starts before the last rows are computed (``parallel.split_params``)."""

    op_type = "InnerProductGradWeight"

    @classmethod
    def infer(cls, attrs, ins):
        M, K = _split(tuple(ins[1][0]), int(attrs.get("axis", 1)))
        n = ins[0][0][-1]
        if "rows" in attrs:
            a, b = (int(r) for r in attrs["rows"])
            if not 0 <= a < b <= n:
                raise ShapeError(f"InnerProductGradWeight rows {[a, b]} are out of range for "
                                 f"{n} outputs")
            n = b - a
        return [((n, K), value_dtype(ins[0][1]))]

    @classmethod
    def bits_inputs(cls, attrs):
        return () if "rows" in attrs else (0, 1)   # rows: a strided slice of dy

    def scratch_specs(self, ins, outs):
        M, K = _split(ins[1].shape, int(self.attrs.get("axis", 1)))
        return _bits_specs(self, ((M, ins[0].size // max(M, 1)), ins[0].dtype),
                           ((M, K), ins[1].dtype), rows="rows" in self.attrs)

    def host_temporaries(self, ins, outs):
        """A float32 copy of each operand stored as bits (dy's columns of
        ``rows``)."""
        M, K = _split(ins[1].shape, int(self.attrs.get("axis", 1)))
        return _host_widenings(((M, outs[0].shape[0]), ins[0].dtype), ((M, K), ins[1].dtype))

    def host_scratch(self, ins, outs):
        """The host product's scratch (a cut along K, the weight gradient's
        dy^T (O, M) @ x (M, K) with few outputs and many rows:
        ops/im2col.gemm_holds)."""
        M, K = _split(ins[1].shape, int(self.attrs.get("axis", 1)))
        if self.row_pieces(ins[0].shape, ins[1].shape) is not None:
            return []   # the whole product's row calls: no scratch
        return gemm_holds(outs[0].dtype, ((outs[0].shape[0], M), (M, K)))

    def row_pieces(self, dy_shape, x_shape):
        """With attr ``rows`` [a, b]: the whole gradient's host row pieces
        over rows a..b (ops/hostgemm.row_pieces), when a and b are bounds
        of them; the run then makes the whole product's BLAS calls for
        those rows, so the chunk is the whole gradient's rows bit for bit
        (parallel/schemes/steps.split_before_copies). Else None."""
        if "rows" not in self.attrs:
            return None
        from .hostgemm import row_pieces
        M, K = _split(tuple(x_shape), int(self.attrs.get("axis", 1)))
        a, b = (int(r) for r in self.attrs["rows"])
        return row_pieces(int(np.prod(dy_shape, dtype=np.int64)) // max(M, 1), K, M, a, b)

    def setup(self, ins, outs):
        self.reserve_temporaries(ins[0], *self.scratch_specs(ins, outs))

    def run(self, ins, outs):
        dy, x = ins
        xp = get_xp(dy)
        M, K = _split(x.shape, int(self.attrs.get("axis", 1)))
        dy2 = dy.reshape(M, -1)
        if "rows" in self.attrs:
            a, b = (int(r) for r in self.attrs["rows"])
            dy2 = dy2[:, a:b]
        if _on_gpu(xp, dy, x, outs[0]):  # dy^T transposed by cuBLAS, not copied
            _product(self, ins, outs, dy2, x.reshape(M, K), outs[0], trans_a=True)
            return
        pieces = self.row_pieces(dy.shape, x.shape) if xp is np else None
        if pieces is not None:   # the whole product's calls for these rows
            matmul_rows(_host(dy2).T, _host(x).reshape(M, K), outs[0], pieces)
            return
        matmul(xp, _host(dy2).T, _host(x).reshape(M, K), out=outs[0])


@register
class InnerProductGradBias(OpKernel):
    """db = dy summed over every axis but the last.  Inputs [dy].

    dy may be stored as bfloat16 bits (``bits_inputs``: qkv's gradient,
    written as bits by the attention's gradient, bf16 storage): db float32,
    on a GPU the column-sum kernel widening each element exactly
    (``sum_rows_bits_f32``: the same doubles in the same order), on the host
    dy widened into a float32 copy first (``host_temporaries``) and summed
    as the float32 dy: the float32 storage's db bit for bit."""

    op_type = "InnerProductGradBias"

    @classmethod
    def infer(cls, attrs, ins):
        return [((ins[0][0][-1],), value_dtype(ins[0][1]))]

    @classmethod
    def bits_inputs(cls, attrs):
        return (0,)

    def scratch_specs(self, ins, outs):
        """The partial sums of the column sum's row ranges (float32/64; a
        bits dy's: float32's)."""
        return column_scratch(ins[0])

    def host_temporaries(self, ins, outs):
        """A float32 copy of a dy stored as bits."""
        return [(tuple(ins[0].shape), np.float32)] if is_bits(ins[0]) else []

    def setup(self, ins, outs):
        if float_kernels(get_xp(ins[0]), ins[0], *outs) is not None:
            self.reserve_temporaries(ins[0], *self.scratch_specs(ins, outs))

    def run(self, ins, outs):
        dy = ins[0]
        xp = get_xp(dy)
        k = float_kernels(xp, dy, outs[0])
        if k is not None:  # deterministic column-sum kernels, coalesced loads
            (partial,) = self.temporaries(dy, *self.scratch_specs(ins, outs))
            rows = dy.reshape(last_axis_rows(dy.shape))
            if is_bits(dy):
                k.sum_rows(rows, outs[0], partial=partial)
            else:
                k.bias_grad(rows, out=outs[0], partial=partial)
            return
        if is_bits(dy):
            if xp is not np:
                raise TypeError(f"InnerProductGradBias '{self.op.name}': a dy stored as bits "
                                f"takes a float32 db, got {outs[0].dtype}")
            (wide,) = self.temporaries(dy, *self.host_temporaries(ins, outs))
            dy = from_bf16_bits(dy, wide)
        xp.sum(dy.reshape(-1, dy.shape[-1]), axis=0, out=outs[0])


@gradient("InnerProduct")
def _inner_product_grad(g, op):
    dy = g.grad_of(op.outputs[0])
    x, w = op.inputs[0], op.inputs[1]
    axis = {"axis": op.attrs["axis"]} if "axis" in op.attrs else {}
    if g.needs_grad(x):
        g.emit("InnerProductGradData", [dy, w], [g.grad_blob(x)],
               dict(axis, x_shape=list(g.graph.blobs[x].shape)))
    if g.needs_grad(w):
        g.emit("InnerProductGradWeight", [dy, x], [g.grad_blob(w)], axis)
    if len(op.inputs) == 3 and g.needs_grad(op.inputs[2]):
        g.emit("InnerProductGradBias", [dy], [g.grad_blob(op.inputs[2])])
