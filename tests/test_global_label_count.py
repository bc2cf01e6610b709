"""A loss with an ``ignore_label`` over micro-batches is the global batch's
mean over its counted positions (``parallel.ignore_label_mean: global``, the
default; docs/config.md, "Sample order"): the data reader's normaliser
(ops/data.py ``count_label``) on the emulated GPU, under CUDA graph capture,
equals 1 rank without micro-batches on the CPU; a text source's labels read
alone are those of its batches. The CPU runs against PyTorch over ranks and
micro-batches are in tests/test_trust_shard_conventions.py and
tests/test_trust_progress_figures.py.
"""
import json

import numpy as np
import pytest

from purine_mpi.data.sources import EpochOrder, batch_indices, gather_labels
from tests.conftest import make_job
from tests.emulated_gpu import emulated_gpu_env, tiny_raw


def _train(tmp_path, out, device, micro, cuda_graph=False, mean="global"):
    from purine_mpi.job.config import validate_config
    from purine_mpi.train.trainer import Trainer
    raw = tiny_raw(device=device, cuda_graph=cuda_graph)
    raw["data"]["train"].update(batch_size=8, classes=4)
    raw["net"] = [
        {"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1", "num_output": 4,
         "weight_filler": {"type": "gaussian", "std": 0.1}},
        {"type": "softmax_loss", "name": "loss", "bottom": ["fc1", "label"], "top": "loss",
         "ignore_label": 2}]
    raw["parallel"] = {"micro_batches": micro, "ignore_label_mean": mean}
    raw["solver"] = {"base_lr": 0.5, "momentum": 0.0, "weight_decay": 0.0,
                     "lr_policy": "fixed", "max_iter": 4, "display": 1, "test_interval": 0}
    trainer = Trainer(make_job(validate_config(raw, check_files=False)), str(tmp_path / out),
                      log=lambda line: None)
    try:
        trainer.run()
        params = {p: np.array(trainer.ws[p]) for p in trainer.graphs.params}
    finally:
        trainer.close()
    lines = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return [r["loss"] for r in rows if r["phase"] == "train"], params


def test_micro_batches_on_the_emulated_gpu_train_as_the_whole_batch(tmp_path, monkeypatch,
                                                                   host_build_dir):
    """Synthetic data, 4 classes, label 2 ignored, batch 8 in 4 micro-batches
    of 2 (several hold no counted label, or only ignored ones), captured in
    a CUDA graph: 4 iterations' losses and the weights equal 1 rank × 8 on
    the CPU (float32 tolerance); the micro-batches' plain mean
    (``ignore_label_mean: shard``) does not."""
    whole = _train(tmp_path, "cpu", -1, 1)
    emulated_gpu_env(monkeypatch, host_build_dir)
    gpu = _train(tmp_path, "gpu", 0, 4, cuda_graph=True)
    np.testing.assert_allclose(gpu[0], whole[0], rtol=2e-6)
    for name, value in whole[1].items():
        np.testing.assert_allclose(gpu[1][name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    shards = _train(tmp_path, "shards", 0, 4, cuda_graph=True, mean="shard")
    assert max(abs(a - b) for a, b in zip(shards[0], whole[0])) > 1e-3  # the case tells


def test_a_text_source_reads_its_labels_alone_as_in_its_batches(tmp_path):
    """``gather_labels`` of a text source (no data read) is ``gather``'s labels."""
    from purine_mpi.data.sources import make_source
    from tests.conftest import run_cli_args
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    res = run_cli_args("data", "text", "--from", text, "--out", tmp_path / "t.h5")
    assert res.returncode == 0, res.stderr[-2000:]
    source = make_source({"source": "text", "path": str(tmp_path / "t.h5"), "split": "train",
                          "sequence_length": 7})
    indices = batch_indices(3, 1, 2, 4, EpochOrder(source.n_samples, True, 5))
    got = gather_labels(source, indices)
    want = source.gather(indices)[1]
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("parallel, ranks, noted", [
    ({}, 1, True), ({}, 2, False), ({"micro_batches": 2}, 1, False),
    ({"mode": "async"}, 3, True)])
def test_ignore_label_mean_is_noted_where_it_has_no_effect(parallel, ranks, noted):
    """``ignore_label_mean: shard`` is noted as without effect on one shard
    (1 rank, no micro-batches) and under the parameter servers (each
    worker's own mean), not over shards."""
    from purine_mpi.parallel.schemes import scheme_of
    raw = tiny_raw()
    raw["parallel"] = dict(parallel, ignore_label_mean="shard")
    job = make_job(raw)
    notes = [n for n in scheme_of(job).settings_without_effect(job, ranks)
             if "parallel.ignore_label_mean" in n]
    assert bool(notes) == noted, notes


@pytest.mark.mpi
def test_scheme_none_normalises_each_rank_over_its_own_micro_batches(digits_h5, tmp_path):
    """Scheme none (2 ranks, each its own replica, no gradient exchanged):
    with 4 micro-batches each rank trains as without them, on its own batch
    of 16 (its own mean: no normaliser, the plain path), the count over its
    own micro-batches and not over both ranks' batches (which gave rank 0's
    micro-batches 3.25 at iteration 3 for its own 3.5); ``shard`` (the
    micro-batches' means) differs. Rank 0's saved weights after 3 iterations."""
    import h5py
    from tests.conftest import run_mpi_cli, write_config_file
    net = [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1", "num_output": 10},
           {"type": "softmax_loss", "name": "loss", "bottom": ["fc1", "label"], "top": "loss",
            "ignore_label": 3}]

    def weights(name, parallel):
        cfg = {"name": name, "seed": 3, "net": net, "parallel": dict(parallel, scheme="none"),
               "data": {"train": {"source": "hdf5", "path": digits_h5, "split": "train",
                                  "batch_size": 16, "shuffle": False}},
               "solver": {"base_lr": 0.5, "lr_policy": "fixed", "momentum": 0.0,
                          "weight_decay": 0.0, "max_iter": 3, "test_interval": 0}}
        out = tmp_path / name
        res = run_mpi_cli(2, "train", write_config_file(tmp_path, cfg, f"{name}.yaml"),
                          "--out", out)
        assert res.returncode == 0, res.stderr[-2000:]
        with h5py.File(out / "latest.h5", "r") as f:
            return f["params/fc1/weight"][()]
    whole = weights("whole", {})
    np.testing.assert_allclose(weights("micro", {"micro_batches": 4}), whole,
                               rtol=0, atol=1e-6)
    shards = weights("shards", {"micro_batches": 4, "ignore_label_mean": "shard"})
    assert float(np.abs(shards - whole).max()) > 1e-3  # the case tells the two apart
