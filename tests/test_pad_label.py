"""The padding of a one-pass test is apart from every layer's ignore_label
(job/replica.py ``mark_padding``, the SoftmaxLoss and Accuracy ops' attr
``pad_label``, cuda/softmax_loss.cu).

A test split of 20 samples in batches of 8 (on 2 ranks: 2 x 8) ends with a
padded batch. The padding carries PAD_LABEL (-1, never a class) and counts
in no figure; a loss's ``ignore_label: L`` drops class L from that loss
only: an accuracy layer without ignore_label counts every real sample, of
every class. Before, the padding took the loss's ignore_label and the
accuracy got it as its own, so the real samples of class 2 dropped out of
the accuracy (0.3905 for 7/20 on the audit's job); and two losses ignoring
different labels left the pass unpadded (it wrapped around).

A loss or accuracy with an ignore_label is the mean over its counted
positions of the whole pass (PyTorch's CrossEntropyLoss(ignore_index),
Caffe's VALID normalization over the whole set): before, each batch's mean
was weighted by the batch's samples (loss 4.6481 where NumPy gives 4.7446,
accuracy 0.1810 for 0.1765, on 1 and 2 ranks).

The figures are checked against NumPy on the test split itself (one fc
layer: logits = x W^T + b), on the CPU and on the emulated GPU (the CUDA
kernels compiled for the host), on 1 and 2 ranks
(tests/mpi_scripts/pad_label.py)."""
import numpy as np
import pytest

from purine_mpi.job.config import validate_config
from tests.conftest import FakeWorld, make_job
from tests.emulated_gpu import compare, emulated_trainer_env
from tests.emulated_gpu.fixtures import device  # noqa: F401  (a fixture)

SAMPLES, CLASSES = 20, 4
#: the ignore_labels of the losses: one loss ignoring class 2; two losses
#: ignoring different classes (before: no padding, the pass wrapped around)
CASES = [(2,), (1, 2)]


def pad_raw(device, ignores):
    """One fc layer, a softmax_loss per ignore_label (``loss``, ``loss2``),
    an accuracy without one; the test split's last batch is padded."""
    shape = [3, 2, 2]
    net = [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1",
            "num_output": CLASSES, "weight_filler": {"type": "gaussian", "std": 1.0}}]
    for i, label in enumerate(ignores):
        name = "loss" if i == 0 else f"loss{i + 1}"
        net.append({"type": "softmax_loss", "name": name, "bottom": ["fc1", "label"],
                    "top": name, "ignore_label": label})
    net.append({"type": "accuracy", "name": "accuracy", "bottom": ["fc1", "label"],
                "top": "accuracy", "phase": "test"})
    # an accuracy ignoring the first loss's class: a mean over counted positions
    net.append({"type": "accuracy", "name": "accuracy2", "bottom": ["fc1", "label"],
                "top": "accuracy2", "phase": "test", "ignore_label": ignores[0]})
    return {"name": "pad", "seed": 5, "device": device,
            "data": {"train": {"source": "synthetic", "shape": shape, "classes": CLASSES,
                               "num_samples": 16, "batch_size": 8},
                     "test": {"source": "synthetic", "shape": shape, "classes": CLASSES,
                              "num_samples": SAMPLES, "batch_size": 8}},
            "net": net, "solver": {"base_lr": 0.1, "max_iter": 1}}


def pad_job(device, ignores):
    return make_job(validate_config(pad_raw(device, ignores), check_files=False))


def reference(job, trainer, ignores, ranks=1, batch=8):
    """NumPy's figures over the real samples of the test split, whatever the
    ranks and the test batch: the accuracy over all of them; ``accuracy2``
    (ignoring the first loss's class) over those whose label is not that
    class; each loss the mean of the losses of the samples whose label is
    not its ignore_label (PyTorch's CrossEntropyLoss(ignore_index), Caffe's
    VALID normalization, over the whole pass: not a mean of the batches'
    means); ``loss`` is the losses' sum (weight 1 each)."""
    from purine_mpi.data.sources import make_source
    x, y = make_source(job.data.test.source_dict(), job.seed).gather(np.arange(SAMPLES))
    ws = trainer.train.workspace
    w, b = (np.asarray(ws[f"fc1/{p}"], np.float64) for p in ("weight", "bias"))
    z = x.reshape(SAMPLES, -1).astype(np.float64) @ w.T + b
    top = z.max(axis=1)
    nll = np.log(np.exp(z - top[:, None]).sum(axis=1)) + top - z[np.arange(SAMPLES), y]
    right = z.argmax(axis=1) == y
    kept = y != ignores[0]
    out = {"accuracy": float(right.mean()), "accuracy2": float(right[kept].mean()),
           "samples": SAMPLES, "loss": 0.0}
    # the last global batch is padded, and some batch's share of each
    # ignored class differs from the split's (else the batch-wise mean
    # would be the same figure)
    assert SAMPLES % (batch * ranks)
    for label in ignores:
        assert (y == label).any() and (y != label).any()  # the case is there to see
        out["loss"] += float(nll[y != label].mean())
    return out


def check_figures(got, want):
    assert set(got) == set(want), (got, want)
    assert got["samples"] == want["samples"], (got, want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=2e-6, abs=1e-6), (k, got, want)


def _evaluate(device, ignores, out):
    from purine_mpi.train.trainer import Trainer
    job = pad_job(device, ignores)
    t = Trainer(job, str(out), world=FakeWorld(), log=lambda line: None)
    assert (t.graphs.watch is not None) == (device >= 0)  # the GPU's own path
    check_figures(t.evaluate(), reference(job, t, ignores))
    assert t.graphs.test_pad == -1  # padded: PAD_LABEL, whatever the losses ignore


@pytest.mark.parametrize("ignores", CASES)
def test_the_accuracy_counts_every_real_sample_on_the_cpu(ignores, tmp_path):
    _evaluate(-1, ignores, tmp_path)


@pytest.mark.parametrize("ignores", CASES)
def test_the_accuracy_counts_every_real_sample_on_the_gpu(ignores, host_build_dir,
                                                           monkeypatch, tmp_path):
    emulated_trainer_env(monkeypatch, host_build_dir)
    _evaluate(0, ignores, tmp_path)


@pytest.mark.mpi
def test_two_ranks_count_every_real_sample(host_build_dir, tmp_path):
    """2 ranks of data parallelism, on the CPU and on emulated GPUs
    (tests/mpi_scripts/pad_label.py): each rank's figures are NumPy's."""
    from tests.mpi_scripts.launch import run_mpi
    proc, _ = run_mpi("pad_label.py", 2, host_build_dir, timeout=240)
    assert proc.stdout.count("OK pad_label") == 2, proc.stdout + proc.stderr


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_ops_skip_the_pad_label_and_their_ignore_label(device, dtype):
    """The ops' pad_label on the device is the CPU's: a position labelled
    either pad_label or ignore_label is not counted (the loss's mean, its
    gradient's normaliser, the accuracy's denominator), every other class
    is; a label -1 without pad_label stays an error on the CPU."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((10, 4)).astype(dtype)
    label = np.array([0, 1, 2, 3, 2, 1, 0, 3, -1, -1], np.int64)
    attrs = {"ignore_label": 2, "pad_label": -1}
    (loss, prob), _ = compare(device, "SoftmaxLoss", attrs, [x, label],
                              ["softmax_loss_forward"], dtype)
    real = label >= 0
    counted = real & (label != 2)
    x64 = x.astype(np.float64)
    top = x64.max(axis=1)
    nll = np.log(np.exp(x64 - top[:, None]).sum(axis=1)) + top - x64[np.arange(10), label]
    assert float(loss) == pytest.approx(nll[counted].mean(), rel=1e-5)
    (dx,), _ = compare(device, "SoftmaxLossGrad", attrs, [np.asarray(1.0, dtype), prob, label],
                       ["softmax_loss_count", "softmax_loss_backward"], dtype)
    onehot = np.eye(4)[np.where(counted, label, 0)]
    np.testing.assert_allclose(dx, (prob - onehot) * counted[:, None] / counted.sum(),
                               rtol=1e-5, atol=1e-7)
    (acc,), _ = compare(device, "Accuracy", {"pad_label": -1}, [x, label],
                        ["accuracy_forward", "accuracy_mean"], dtype)
    assert float(acc) == pytest.approx((x64.argmax(axis=1) == label)[real].mean())
    from tests.emulated_gpu.helpers import run_kernel
    with pytest.raises(ValueError, match="label value -1"):
        run_kernel("Accuracy", {"ignore_label": 2}, [x, label])
