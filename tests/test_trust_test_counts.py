"""The test pass's counted positions under a pipeline (train/evaluation.py,
ops/softmax.py ``CountedPositions``).

A loss or accuracy with an ``ignore_label`` is the mean over the positions
it counts in the whole pass (docs/formats.md), so each batch's figure is
weighted by its counted positions. Those were read from the label blob
after the batch; on a pipeline's last stage the label is a transfer window
that the first stage refills with the next batch's label as soon as the
stage's readers release it, so the count was often the next batch's:
2 stages × 2 micro-batches, digits' 360 test samples in batches of 7,
``ignore_label: 3``: test loss 2.205541 and accuracy 0.181771 where NumPy
on the saved weights gives 2.209189 and 0.182663 (an accuracy without
``ignore_label`` was right: 0.163889). Now the count is made in the graph
beside the figure, by an op reading the label before it is released
(on a GPU one block of cuda/softmax_loss.cu, ``softmax_loss_count`` with
floor 0, on the emulated device here).
"""
import json

import h5py
import numpy as np
import pytest

from tests.conftest import run_mpi_cli, write_config_file
from tests.emulated_gpu import compare
from tests.emulated_gpu.fixtures import device  # noqa: F401  (a fixture)

NET = [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1", "num_output": 16},
       {"type": "relu", "name": "relu1", "bottom": "fc1", "top": "fc1"},
       {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2", "num_output": 10},
       {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"], "top": "loss",
        "ignore_label": 3},
       {"type": "accuracy", "name": "acc", "bottom": ["fc2", "label"], "top": "acc",
        "phase": "test", "ignore_label": 3},
       {"type": "accuracy", "name": "acc_all", "bottom": ["fc2", "label"], "top": "acc_all",
        "phase": "test"}]
STAGES = {"fc1": 0, "relu1": 0, "fc2": 1, "loss": 1, "acc": 1, "acc_all": 1}


def _numpy(digits_h5, weights):
    """NumPy's figures (float64) of the whole test split under ``weights``."""
    with h5py.File(digits_h5, "r") as f:
        x, y = f["test/data"][()], f["test/label"][()]
    with h5py.File(weights, "r") as f:
        p = {k: f[f"params/{k}"][()].astype(np.float64)
             for k in ("fc1/weight", "fc1/bias", "fc2/weight", "fc2/bias")}
    h = np.maximum(x.reshape(len(y), -1) @ p["fc1/weight"].T + p["fc1/bias"], 0.0)
    z = h @ p["fc2/weight"].T + p["fc2/bias"]
    top = z.max(axis=1)
    nll = np.log(np.exp(z - top[:, None]).sum(axis=1)) + top - z[np.arange(len(y)), y]
    kept, right = y != 3, z.argmax(axis=1) == y
    return {"loss": nll[kept].mean(), "acc": right[kept].mean(), "acc_all": right.mean(),
            "samples": len(y)}


@pytest.mark.mpi
def test_a_pipeline_with_micro_batches_counts_each_batch_s_own_positions(digits_h5,
                                                                         tmp_path):
    """2 stages × 2 micro-batches, test batches of 7 (the last one padded):
    the test row is NumPy's over the 360 samples on the saved weights."""
    cfg = {"name": "counts", "seed": 3,
           "data": {"train": {"source": "hdf5", "path": digits_h5, "split": "train",
                              "batch_size": 8},
                    "test": {"source": "hdf5", "path": digits_h5, "split": "test",
                             "batch_size": 7}},
           "net": NET,
           "parallel": {"scheme": "pipeline", "micro_batches": 2, "stages": STAGES},
           "solver": {"base_lr": 0.1, "max_iter": 4, "test_interval": 4, "test_iter": None,
                      "display": 4},
           "checkpoint": {"interval": 4}}
    out = tmp_path / "run"
    res = run_mpi_cli(2, "train", write_config_file(tmp_path, cfg), "--out", out)
    assert res.returncode == 0, res.stderr[-2000:]
    with open(out / "metrics.jsonl") as f:
        (row,) = [r for r in map(json.loads, f) if r["phase"] == "test"]
    want = _numpy(digits_h5, out / "latest.h5")
    assert row["samples"] == want["samples"]
    for key in ("loss", "acc", "acc_all"):
        assert row[key] == pytest.approx(want[key], rel=1e-5), \
            f"test {key} {row[key]} is not NumPy's {want[key]:.6f}"


@pytest.mark.parametrize("label_dtype", [np.int64, np.int32])
def test_the_count_op_counts_what_the_loss_counts(device, label_dtype):
    """CountedPositions: the positions whose label is neither the
    ignore_label nor the padding's, on the CPU and the device (int32 labels,
    the text source's, copied to int64 there); an all-ignored batch counts 0
    (the loss's normaliser is 1 there, its loss 0: weighed 0 in a pass)."""
    attrs = {"ignore_label": 2, "pad_label": -1}
    for label, want in (([[0, 2, -1], [3, 2, 1]], 3.0), ([[2, -1, 2]], 0.0)):
        label = np.array(label, label_dtype)
        (cpu,), (got,) = compare(device, "CountedPositions", attrs, [label],
                                 ["softmax_loss_count"], np.float64)
        assert cpu.dtype == np.float64 and cpu.shape == ()
        assert float(cpu) == float(np.asarray(got)) == want


def test_the_count_op_reserves_its_label_copy_at_setup(host_build_dir, monkeypatch):
    """CountedPositions on int32 labels (the text source's): the int64 copy
    the device kernel reads is reserved in setup, as the loss's is -- a
    CUDA-graph capture of the run must allocate nothing. The reservation
    goes by the count's dtype (float64, which the raw kernels take), not
    the label's (int32, which they do not: nothing was reserved)."""
    from purine_mpi.graph.core import Op
    from purine_mpi.gpu.raw import op_scratch
    from purine_mpi.gpu.scratch import Scratch
    from purine_mpi.ops.catalog import get_kernel_class
    from tests.emulated_gpu import use_emulated_cupy
    use_emulated_cupy(monkeypatch, host_build_dir)
    import cupy
    attrs = {"ignore_label": 2}
    cls = get_kernel_class("CountedPositions")
    kernel = cls(Op("probe", "CountedPositions", [], [], dict(attrs)))
    ins = [cupy.asarray(np.array([[0, 2, 1], [3, 2, 1]], np.int32))]
    outs = [cupy.asarray(np.zeros((), np.float64))]
    specs = kernel.scratch_specs(ins, outs)
    assert specs == [((6,), np.int64)]
    kernel.setup(ins, outs)
    assert op_scratch(kernel, 0).reserved >= Scratch._layout(specs)[1]
    kernel.run(ins, outs)
    assert float(cupy.asnumpy(outs[0])) == 4.0
