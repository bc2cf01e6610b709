"""On a GPU a training Dropout keeps no mask: the gradient draws it again
from the forward's Philox stream and iteration
(parallel/placement.redraw_dropout_masks, ops/dropout.DropoutRedrawGrad,
cuda/dropout.cu ``dropout_apply``). The same bits as the kept mask's, on
the emulated device, and the mask's bytes gone from the device plan."""
import numpy as np
import pytest

import purine_mpi.gpu as gpu
import purine_mpi.parallel.placement as placement
from purine_mpi.base.philox import dropout_keys
from purine_mpi.gpu import kernels
from purine_mpi.job.replica import build_train_graph
from tests.conftest import make_job
from tests.emulated_gpu import use_emulated_cupy
from tests.emulated_gpu.helpers import tiny_config, train_simulated


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dropout_apply_is_the_kept_masks_product(host_build_dir, monkeypatch, dtype):
    """dropout_apply(x) is dropout_forward's y, and dropout_apply(dy) is
    dropout_backward(dy, mask), bit for bit, at a size that is no multiple
    of four (the last Philox block part used) and an iteration above 2^32."""
    use_emulated_cupy(monkeypatch, host_build_dir)
    try:
        import cupy
        rng = np.random.default_rng(1)
        x = cupy.asarray(rng.standard_normal(1003).astype(dtype))
        dy = cupy.asarray(rng.standard_normal(1003).astype(dtype))
        key0, key1, ctr1 = dropout_keys(7, "drop")
        it = (1 << 32) + 5
        y, mask = kernels.dropout_forward(x, it, 0.3, key0, key1, ctr1)
        dx = kernels.dropout_backward(dy, mask, 0.3)
        assert 0 < float(cupy.asnumpy(mask).mean()) < 1
        np.testing.assert_array_equal(
            cupy.asnumpy(kernels.dropout_apply(x, it, 0.3, key0, key1, ctr1)), cupy.asnumpy(y))
        np.testing.assert_array_equal(
            cupy.asnumpy(kernels.dropout_apply(dy, it, 0.3, key0, key1, ctr1)),
            cupy.asnumpy(dx))
        # another iteration draws another mask (the draw reads it)
        other = kernels.dropout_apply(dy, it + 1, 0.3, key0, key1, ctr1)
        assert not np.array_equal(cupy.asnumpy(other), cupy.asnumpy(dx))
    finally:
        gpu.clear_kernel_cache()


def test_the_graph_keeps_no_mask_on_a_device():
    graph, _ = build_train_graph(make_job(tiny_config()))
    assert "drop.mask" in graph.blobs or any(
        op.op_type == "Dropout" and len(op.outputs) == 2 for op in graph.ops.values())
    placement.prepare_for_device(graph, 0)
    (fwd,) = [op for op in graph.ops.values() if op.op_type == "Dropout"]
    (grad,) = [op for op in graph.ops.values() if op.op_type == "DropoutRedrawGrad"]
    assert fwd.attrs["redraw_mask"] and len(fwd.outputs) == 1
    assert grad.inputs[1] == fwd.inputs[1] and grad.attrs["stream"] == fwd.name
    assert not any(op.op_type == "DropoutGrad" for op in graph.ops.values())


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_training_with_the_mask_redrawn_is_bitwise_the_kept_masks(
        host_build_dir, monkeypatch, cuda_graph):
    """Three iterations of the tiny net prepared for the emulated device, with
    and without the redraw: the same losses and weights, bit for bit."""
    use_emulated_cupy(monkeypatch, host_build_dir)
    config = tiny_config()
    try:
        got = train_simulated(config, 0, cuda_graph=cuda_graph, fuse=True)
        with monkeypatch.context() as m:
            m.setattr(placement, "redraw_dropout_masks", lambda graph: [])
            kept = train_simulated(config, 0, cuda_graph=cuda_graph, fuse=True)
    finally:
        gpu.clear_kernel_cache()
    assert got[0] == kept[0]
    assert got[1].keys() == kept[1].keys()
    for name in kept[1]:
        np.testing.assert_array_equal(got[1][name], kept[1][name], err_msg=name)
    # the mask's blob is gone from the device workspace
    assert not any(b.endswith("mask") and "drop" in b for b in got[2].graph.blobs)
    assert any(b.endswith("mask") and "drop" in b for b in kept[2].graph.blobs)
