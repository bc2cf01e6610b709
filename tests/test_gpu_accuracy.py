"""The Accuracy op on a GPU: two raw kernels (cuda/softmax_loss.cu
``accuracy_forward``, ``accuracy_mean``), nothing read back to the host, so
a test pass captures it; against the CPU op (the reference), on the
emulated device and on a GPU when there is one.

On an H200 the op's CuPy reductions (``take_along_axis``, ``sum``,
``isfinite().all()``) compiled at first use and stalled gpt_tiny's first
test pass by about 7 s; it also ran eagerly between the captured graphs."""
import numpy as np
import pytest

from purine_mpi.graph.core import Blob, Location, Op
from purine_mpi.ops.catalog import get_kernel_class
from tests.emulated_gpu.helpers import compare, run_kernel

KERNELS = ["accuracy_forward", "accuracy_mean"]


def _scores(rng, shape, dtype):
    """Scores rounded to one decimal: ties with the true class happen."""
    return np.round(rng.standard_normal(shape), 1).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_accuracy_on_the_device_is_the_cpus(device, dtype, top_k):
    rng = np.random.default_rng(top_k)
    x = _scores(rng, (12, 5, 3), dtype)        # 5 classes, 3 positions a sample
    label = rng.integers(0, 5, (12, 3))
    x[0, :, 0] = np.nan                         # a diverged position: wrong
    x[1, 2, 1] = np.inf
    x[2, :, 2] = x[2, label[2, 2], 2]           # every class ties with the truth
    attrs = {"top_k": top_k}
    (cpu,), _ = compare(device, "Accuracy", attrs, [x, label], KERNELS, dtype)
    assert 0.0 < float(cpu) < 1.0
    ignored = label.copy()
    ignored[3:6] = -1
    compare(device, "Accuracy", dict(attrs, ignore_label=-1), [x, ignored], KERNELS, dtype)
    # every position ignored: 0, not a division by zero
    (none,), _ = compare(device, "Accuracy", dict(attrs, ignore_label=-1),
                         [x, np.full_like(label, -1)], KERNELS, dtype)
    assert float(none) == 0.0


def test_the_token_layout_and_int32_labels(device):
    """A transformer's (batch, tokens, vocabulary) scores over axis -1, the
    text source's int32 labels (copied into int64 scratch)."""
    rng = np.random.default_rng(5)
    x = _scores(rng, (3, 7, 11), np.float32)
    label = rng.integers(0, 11, (3, 7)).astype(np.int32)
    label[0, :3] = np.argmax(x[0, :3], axis=-1)   # some right
    (cpu,), _ = compare(device, "Accuracy", {"axis": -1}, [x, label], KERNELS, np.float32)
    assert float(cpu) > 0


def test_a_bad_label_is_nan_on_the_device_and_an_error_on_the_cpu(device):
    """A label outside [0, C): the CPU op raises; the device, which reads
    nothing back, gives NaN (never a number that looks like an accuracy),
    as the device loss does."""
    x = _scores(np.random.default_rng(0), (4, 5), np.float32)
    label = np.array([0, 1, 7, 2])
    with pytest.raises(ValueError, match="outside"):
        run_kernel("Accuracy", {}, [x, label])
    (got,) = run_kernel("Accuracy", {}, [x, label], device.to_device)
    assert np.isnan(got)


def test_capturable_on_the_device_only():
    """Answered from the blobs (device, dtype), before any array exists: the
    executor's segment cut and ``plan`` ask the same question."""
    kernel = get_kernel_class("Accuracy")(Op("acc", "Accuracy", [], [], {}))
    gpu, host = Location(device=0), Location()

    def ask(location, dtype="float32"):
        return kernel.capturable_on([Blob("x", (4, 5), dtype, location),
                                     Blob("l", (4,), "int64", location)],
                                    [Blob("a", (), dtype, location)])
    assert ask(host) is False                  # counted on the host
    assert ask(gpu) is None                    # no objection: captured with its segment
    assert ask(gpu, "float64") is None
    assert ask(gpu, "float16") is False        # the generic CuPy path reads back
