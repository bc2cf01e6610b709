"""What micro-batches (parallel.micro_batches) cost in data memory: the M
data-reader copies of a replica share one source and epoch order
(data/sources.shared_source) and read the rows they read without it, and
``plan`` counts the source once, so M micro-batches plan no more data pool
than one and, on a net whose activations dominate, less in all."""
import numpy as np
import pytest

from purine_mpi.job.config import load_job
from purine_mpi.ops.data import DataReader
from purine_mpi.tools.plan import _offline_graphs, offline_footprint
from tests.conftest import make_job


def _config(micro, shuffle=False, samples=4000):
    """A conv net whose activations (16 x 32 x 32 floats a sample at batch
    32) outweigh its weights, on a synthetic source of ``samples`` CIFAR
    shapes (a 47 MiB pool at 4000)."""
    return {
        "name": "pool", "seed": 3,
        "data": {"train": {"source": "synthetic", "shape": [3, 32, 32], "classes": 10,
                           "num_samples": samples, "batch_size": 32, "shuffle": shuffle}},
        "net": [
            {"type": "conv", "name": "conv1", "bottom": "data", "top": "conv1",
             "num_output": 16, "kernel": 3, "pad": 1},
            {"type": "relu", "name": "relu1", "bottom": "conv1", "top": "conv1"},
            {"type": "conv", "name": "conv2", "bottom": "conv1", "top": "conv2",
             "num_output": 16, "kernel": 3, "pad": 1},
            {"type": "relu", "name": "relu2", "bottom": "conv2", "top": "conv2"},
            {"type": "pool", "name": "pool1", "bottom": "conv2", "top": "pool1", "pool": "max",
             "kernel": 2, "stride": 2},
            {"type": "fc", "name": "fc1", "bottom": "pool1", "top": "fc1", "num_output": 10},
            {"type": "softmax_loss", "name": "loss", "bottom": ["fc1", "label"], "top": "loss"},
        ],
        "solver": {"base_lr": 0.01, "momentum": 0.9, "max_iter": 4, "test_interval": 0},
        "parallel": {"scheme": "data", "micro_batches": micro},
    }


def _footprint(micro, np_=2):
    return offline_footprint(make_job(_config(micro)), np_, 0)


def test_micro_batches_plan_less_than_one_batch():
    """Before: each copy's reader made its own synthetic pool, and plan
    counted one per copy: the data pool row grew 47 MiB a copy, and the
    total at 2 micro-batches was 1.6x the total at 1 (111.5 MB against
    68.2 MB; the first assertion failed: 98761472 == 49577472). Now 2
    and 4 micro-batches plan 62.3 and 59.5 MB: the arena holds one copy's
    activations (3.8 and 2.2 MB against 7.3 MB)."""
    one = _footprint(1)
    for m in (2, 4):
        fp = _footprint(m)
        assert fp.host["data_pool"] == one.host["data_pool"], (m, fp.host, one.host)
        # the copies' activations take the same arena bytes one after another
        assert fp.host["activations"] < one.host["activations"], (m, fp.host, one.host)
        assert fp.loop_total < one.loop_total, (m, fp.loop_total, one.loop_total)


def _readers(job, rank=0, np_=2):
    graph = _offline_graphs(job, np_, rank).graph
    ops = sorted((op for op in graph.ops.values() if op.op_type == "DataReader"),
                 key=lambda op: op.name)
    return [DataReader(op) for op in ops]


@pytest.mark.parametrize("shuffle", [False, True])
def test_copies_share_one_source_and_read_the_same_rows(shuffle):
    """The copies of a replica's reader hold one source and one epoch order
    (the same objects), and copy k of M delivers rows [k B/M, (k+1) B/M) of
    the batch one reader delivers without micro-batches, bit for bit, at
    every iteration (past an epoch's end: 200 samples, 64 a global batch)
    and after a resume (``load_state_dict``)."""
    cfg = _config(1, shuffle, samples=200)
    whole = _readers(make_job(cfg), rank=1)
    (ref,) = whole
    for m in (2, 4):
        copies = _readers(make_job(dict(cfg, parallel={"scheme": "data", "micro_batches": m})),
                          rank=1)
        assert len(copies) == m
        for k in copies:
            k._ensure_source()
        assert all(k._source is copies[0]._source and k._order is copies[0]._order
                   for k in copies)
        for t in (0, 1, 3, 4, 7):
            data, labels = ref.prepare(t)
            parts = [k.prepare(t) for k in copies]
            np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), data)
            np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), labels)
        # a resumed run: every copy continues at the saved position
        for k in copies:
            k.load_state_dict({"position": 5, "global_batch": 64, "seed": 3})
            assert k.position == 5


def test_plan_counts_one_source_per_spec_and_seed():
    """Readers of one spec and seed share their source (data/sources.
    source_key); another seed or spec makes a source of its own."""
    from purine_mpi.data.sources import shared_source
    spec = {"source": "synthetic", "shape": [2, 3], "classes": 3, "num_samples": 10}
    a, b = shared_source(spec, 0), shared_source(dict(spec), 0)
    assert a is b
    assert shared_source(spec, 1) is not a
    assert shared_source(dict(spec, num_samples=11), 0) is not a


def test_gradient_accumulation_holds_one_copys_gradients():
    """benchmarks/cifar10_quick_wide.yaml on 2 ranks (its 4 MiB ip1 weight
    dominates the gradients; the final gradients live in the allreduce
    buckets): copy 0 writes its gradients into the gradients the update
    reads and the running sums add into them in place, so the arena holds
    one copy's gradients at its peak, and the planned total falls with M.
    Before: copy 0's gradients lived in the arena until copy 1's were made
    (the first assertion failed: 8.6 MiB of gradients live at
    'ip1.bwd.inner_product_grad_weight@mb1' against 4.3 MiB of weights;
    the arena was 12.4 and 14.3 MiB at M = 2 and 4 against 12.0 at M = 1)."""
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def footprint(m):
        job = load_job(os.path.join(root, "benchmarks", "cifar10_quick_wide.yaml"),
                       [f"parallel.micro_batches={m}", "data.train.num_samples=200"], None,
                       check_files=False)
        return offline_footprint(job, 2, 0)
    one = footprint(1)
    weights = one.model_state["weights"]
    for m in (2, 4):
        fp = footprint(m)
        assert fp.peak["gradients_bytes"] <= weights, (m, fp.peak, weights)
        assert fp.host["activations"] < one.host["activations"], (m, fp.host, one.host)
        assert fp.loop_total < one.loop_total, (m, fp.loop_total, one.loop_total)


def test_readers_that_read_other_samples_share_no_source(tmp_path):
    """``source_key`` keeps apart what reads other samples or another order:
    the train and test splits of one file, shuffled or not, another spec
    seed, and a file rewritten while a reader of the old one is alive (its
    new values are read, not the old file's)."""
    import h5py

    from purine_mpi.data.sources import shared_source
    path = str(tmp_path / "d.h5")

    def write(value):
        with h5py.File(path, "w") as f:
            for split in ("train", "test"):
                f.create_dataset(f"{split}/data", data=np.full((6, 1, 2, 2), value, np.float32))
                f.create_dataset(f"{split}/label", data=np.arange(6) % 2)
    write(1.0)
    spec = {"source": "hdf5", "path": path, "split": "train", "shuffle": True}
    train = shared_source(spec, 0)
    assert shared_source(dict(spec), 0) is train
    assert shared_source(dict(spec, split="test"), 0) is not train
    assert shared_source(dict(spec, shuffle=False), 0) is not train
    assert shared_source(dict(spec, seed=5), 0).order.seed == 5 != train.order.seed
    write(2.0)
    fresh = shared_source(spec, 0)
    assert fresh is not train
    assert fresh.source.gather([0])[0][0, 0, 0, 0] == 2.0
    assert train.source.gather([0])[0][0, 0, 0, 0] == 1.0  # read into memory before
