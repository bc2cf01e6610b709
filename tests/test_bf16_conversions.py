"""Which ops of a bf16 GPT step widen bits into a float32 copy
(``from_bf16_bits``) or round a float32 array into bits (``to_bf16_bits``)
on the emulated device: one step of the 2-block test GPT
(tests/emulated_gpu/helpers.bf16_gpt_steps, bits storage, a vocabulary of
256: rows of as many classes as the loss kernels' block), each launch of
the two conversion kernels (cuda/precision.cu) attributed to the op whose
kernel made it.

What it pins (docs/gpu.md, "Precision"): with cuDNN's SDPA (what a GPU
runs; the emulated frontend here) the only conversions left are

- each product's float32 master weight rounded into bits (cuBLAS reads
  bf16 operands): by the AdamW update in its own pass after the first step
  (``parallel/precision.fold_weight_casts``), so a step launches no
  conversion for them; the copies are made once, outside any op, before
  the first step (``refresh_weight_copies``), and with the fold off
  (``PURINE_FOLD_WEIGHT_CASTS=0``) a ``Cast`` op each step makes them;

the ``from_logits`` loss (``SoftmaxLoss``, ``SoftmaxLossGrad``) reads the
bits logits and writes its dx as bits in its own kernels
(``softmax_loss_forward_bits_f32``, ``softmax_loss_grad_bits_f32``: no
chunk widened, none rounded; before them 2 x 13 widenings and 13 roundings
at GPT-2's 16384 x 50304), as do layer norm, GELU, the residual adds,
the fully connected ops and their
bias gradients read and write bits in their own kernels: none of them
launches a conversion. On the cuBLAS attention path (no cuDNN) the
attention ops also widen their bits operands and round their outputs."""
import collections
import inspect

import pytest

from purine_mpi.ops.registry import OpKernel


def _conversions(monkeypatch, host_build_dir, sdpa):
    from purine_mpi.gpu import kernels
    from tests.emulated_gpu import use_emulated_cupy
    from tests.emulated_gpu.helpers import bf16_gpt_steps
    from tests.test_precision import SOLVER
    where = collections.Counter()
    with monkeypatch.context() as m:
        use_emulated_cupy(m, host_build_dir)
        if sdpa:
            from tests.test_sdpa import emulate_cudnn
            emulate_cudnn(m)
        real = kernels.base._launch_blocks

        def spy(source, func, *args):
            if func in ("to_bf16_bits", "from_bf16_bits"):
                stack = inspect.stack()[1:]
                ops = [f.frame.f_locals["self"] for f in stack
                       if isinstance(f.frame.f_locals.get("self"), OpKernel)]
                if not ops and any(f.function == "refresh_weight_copies" for f in stack):
                    where[(func, "refresh", "")] += 1   # the copies made before step 1
                else:
                    assert ops, f"a {func} launch outside an op"
                    where[(func, type(ops[0]).__name__, ops[0].op.name)] += 1
            return real(source, func, *args)

        m.setattr(kernels.base, "_launch_blocks", spy)
        _, _, steps = bf16_gpt_steps(m, SOLVER, 1, 2, cuda_graph=False, vocab=256)
    return where, steps[0]


@pytest.mark.parametrize("sdpa,fold", [(True, True), (False, True), (True, False)])
def test_only_weight_casts_and_the_loss_convert_in_a_bf16_gpt_step(host_build_dir, monkeypatch,
                                                                  sdpa, fold):
    monkeypatch.setenv("PURINE_FOLD_WEIGHT_CASTS", "1" if fold else "0")
    where, counts = _conversions(monkeypatch, host_build_dir, sdpa)
    by_type = collections.Counter()
    for (func, kind, name), n in where.items():
        if kind not in ("AttentionGrad", "refresh"):   # one launch an op
            assert n == 1, (func, kind, name, n)
        by_type[(func, kind)] += n
        if kind == "Cast":
            assert func == "to_bf16_bits" and name.endswith("weight.cast"), name
    # 2 blocks x (qkv, attention projection, fc, projection) + the tied embedding
    weights = 2 * 4 + 1
    # folded: made once before step 1, then by the update (no conversion
    # kernel); else a Cast op each step
    want = {("to_bf16_bits", "refresh" if fold else "Cast"): weights}
    if not sdpa:   # the cuBLAS attention (a launch an op, its gradient two widenings)
        want.update({("from_bf16_bits", "Attention"): 2, ("to_bf16_bits", "Attention"): 2,
                     ("from_bf16_bits", "AttentionGrad"): 4,
                     ("to_bf16_bits", "AttentionGrad"): 2})
    assert dict(by_type) == want
    assert counts["to_bf16_bits"] == sum(n for (f, _), n in want.items() if f == "to_bf16_bits")
    # (the refresh before step 1 is counted in step 1's launches)
    assert counts["from_bf16_bits"] == sum(n for (f, _), n in want.items()
                                           if f == "from_bf16_bits")
    # the layer norms read and write bits themselves
    assert counts["layernorm_forward_bits_f32"] == 2 * 2 + 1
    assert counts["layernorm_backward_bdy_f32"] + counts["layernorm_backward_bdy_copy_f32"] == 5
    # and the loss reads the logits' bits and writes dx's bits itself
    assert counts["softmax_loss_forward_bits_f32"] == counts["softmax_loss_grad_bits_f32"] == 1


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_the_bits_loss_kernels_train_the_gpt_as_the_widening_path(host_build_dir,
                                                                   monkeypatch, cuda_graph):
    """Three AdamW steps of the bf16 2-block GPT with a vocabulary of 301
    (odd: the rows of bits logits sit 0..3 elements off the vector grid)
    with the loss's bits kernels and with them switched off (each chunk
    widened into float32, the float32 kernels, dx rounded by to_bf16_bits,
    as before them): the same losses and the same weights, bit for bit;
    with CUDA graphs on too (the bits kernels captured: no allocation)."""
    import numpy as np

    from purine_mpi.ops import softmax
    from tests.emulated_gpu import use_emulated_cupy
    from tests.emulated_gpu.helpers import bf16_gpt_steps
    from tests.test_precision import SOLVER
    runs = {}
    for bits in (True, False):
        with monkeypatch.context() as m:
            use_emulated_cupy(m, host_build_dir)
            if not bits:
                m.setattr(softmax, "_bits_rows", lambda x, axis: False)
            losses, weights, steps = bf16_gpt_steps(m, SOLVER, 3, 2, cuda_graph=cuda_graph,
                                                    vocab=301)
        assert all(bool(s["softmax_loss_grad_bits_f32"]) == bits for s in steps[:1])
        runs[bits] = losses, weights
    (new, new_w), (old, old_w) = runs[True], runs[False]
    assert np.array(new, np.float32).view(np.uint32).tolist() == \
        np.array(old, np.float32).view(np.uint32).tolist(), (new, old)
    assert len(set(new)) == 3   # it trains: the steps differ
    assert new_w.keys() == old_w.keys()
    for name in new_w:
        np.testing.assert_array_equal(new_w[name].view(np.uint8), old_w[name].view(np.uint8),
                                      err_msg=name)
