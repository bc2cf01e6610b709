"""NumPy-like wrappers around the raw CUDA kernels in ``cuda/*.cu``.

Ops call these when ``get_xp(x) is cupy``; the CPU path stays in NumPy.
Inputs are CuPy arrays of float32 or float64 (the output dtype follows the
input). Each wrapper allocates its outputs, or writes into ``out=`` (an array,
or a tuple for several outputs, ``None`` entries allocated) so a kernel can
fill a preallocated blob in place; a non-contiguous ``out`` is filled through
a temporary. Kernels launch on CuPy's current stream, so the dispatcher's
``with stream:`` decides where they run. Formulas and Caffe references are in
each ``.cu`` file's header; tests/gpu_reference.py has a NumPy version of each.

Short names follow the issue and Caffe: kh/kw kernel height/width, sh/sw
stride, ph/pw zero padding, dh/dw dilation.

The wrappers live in one module per kernel family (``image``, ``loss``,
``solver``, ``elementwise``) over ``base`` (entry points, argument checks,
launches); this package hands them on under one name, so an op writes
``kernels.im2col(...)``. CuPy is imported on first call; importing this
package needs only NumPy.
"""
from .base import ENTRY_POINTS, PLAIN_ENTRY_POINTS, conv_output_size, pool_output_size  # noqa: F401
from .image import (im2col, col2im, maxpool_forward, maxpool_backward, avepool_forward,
                    avepool_backward, lrn_forward, lrn_backward)  # noqa: F401
from .loss import (softmax_loss_forward, softmax_loss_backward, softmax_loss_mean,
                   softmax_loss_count, softmax_forward, softmax_backward, LossTable, accuracy,
                   loss_watch, softmax_loss_forward_bits, softmax_loss_grad_bits)  # noqa: F401
from .step import (sgd_momentum_update, MultiTensorTable, sgd_momentum_multi, adam_update,  # noqa: F401
                   adam_multi,
                   learning_rate, iteration_next, grad_sumsq, SumsqTable,
                   grad_sumsq_multi, clip_total, clip_scale, ClipScaleTable,
                   clip_scale_multi,
                   all_finite, adaptive_update)
from .elementwise import (dropout_forward, dropout_apply, dropout_backward, philox_words,  # noqa: F401
                          dropout_forward_packed, dropout_backward_packed,
                          relu_forward,
                          relu_backward, bias_act, bias_bits, add_bits, add_copy, gelu_forward,
                          gelu_forward_bits, gelu_backward, gelu_backward_bias_grad,
                          channel_sum, bias_grad, bias_grad_scratch,
                          sum_rows, embedding_grad, embedding_grad_scratch, layernorm_forward,
                          layernorm_backward, layernorm_backward_sums, layernorm_sums_ok,
                          layernorm_sums_scratch,
                          round_in_place, round_copy, to_bf16_bits_device,
                          from_bf16_bits_device)
