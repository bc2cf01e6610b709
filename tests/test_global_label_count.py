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


FC = {"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1", "num_output": 4,
      "weight_filler": {"type": "gaussian", "std": 0.1}}
NET = [FC, {"type": "softmax_loss", "name": "loss", "bottom": ["fc1", "label"], "top": "loss",
            "ignore_label": 2}]


def _raw(device, micro, cuda_graph=False, mean="global", net=NET):
    raw = tiny_raw(device=device, cuda_graph=cuda_graph)
    raw["data"]["train"].update(batch_size=8, classes=4)
    raw["net"] = net
    raw["parallel"] = {"micro_batches": micro, "ignore_label_mean": mean}
    raw["solver"] = {"base_lr": 0.5, "momentum": 0.0, "weight_decay": 0.0,
                     "lr_policy": "fixed", "max_iter": 4, "display": 1, "test_interval": 0}
    return raw


def _job(raw):
    from purine_mpi.job.config import validate_config
    return make_job(validate_config(raw, check_files=False))


def _train(tmp_path, out, device, micro, cuda_graph=False, mean="global", net=NET, raw=None):
    from purine_mpi.train.trainer import Trainer
    raw = raw or _raw(device, micro, cuda_graph, mean, net)
    trainer = Trainer(_job(raw), str(tmp_path / out), log=lambda line: None)
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
    from tests.conftest import run_cli_here
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    res = run_cli_here("data", "text", "--from", text, "--out", tmp_path / "t.h5")
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
    ({"mode": "async"}, 3, True), ({"mode": "async", "micro_batches": 2}, 3, False)])
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


def test_micro_batch_copies_count_the_global_labels_once():
    """4 micro-batches: copy 0's data op alone counts the global batch's
    labels (attr count_label), and every copy's loss and its gradient read
    its normaliser; before, each copy's data op counted them (4 counting
    readers: M x the work per rank and iteration)."""
    from purine_mpi.job.replica import build_train_graph
    from purine_mpi.parallel.micro_batch import replicate_micro_batches
    g, grads = build_train_graph(_job(_raw(-1, 4)))
    replicate_micro_batches(g, grads, 4)
    counting = [op.name for op in g.ops.values()
                if op.op_type == "DataReader" and op.attrs.get("count_label") is not None]
    assert counting == ["data@mb0"], counting
    readers = [op for op in g.ops.values() if op.op_type in ("SoftmaxLoss", "SoftmaxLossGrad")]
    assert len(readers) == 8 and all(op.inputs[-1] == "label.normaliser@mb0" for op in readers)
    g.infer_shapes().validate()


def test_two_losses_of_other_ignore_labels_train_as_the_whole_batch(tmp_path):
    """Two losses on one data op's label, ignore_label 2 and 1, 4
    micro-batches of 2: both are the global batch's means (the data op
    counts for each label), so losses and weights equal 1 rank x 8. Before,
    the second loss kept its micro-batches' own means (the data op counted
    for one ignore_label)."""
    net = NET + [{"type": "softmax_loss", "name": "loss1", "bottom": ["fc1", "label"],
                  "top": "loss1", "ignore_label": 1}]
    whole = _train(tmp_path, "whole", -1, 1, net=net)
    micro = _train(tmp_path, "micro", -1, 4, net=net)
    np.testing.assert_allclose(micro[0], whole[0], rtol=2e-6)
    for name, value in whole[1].items():
        np.testing.assert_allclose(micro[1][name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    shards = _train(tmp_path, "shards", -1, 4, mean="shard", net=net)
    assert max(abs(a - b) for a, b in zip(shards[0], whole[0])) > 1e-3  # the case tells


def test_a_graph_config_s_loss_with_ignore_label_trains_as_the_whole_batch(tmp_path):
    """A complete ``graph:`` (backward and updates given: the graph of 4
    micro-batches of 2 printed without the normaliser, ``shard``) run with
    4 micro-batches under ``global``: the loss and its gradient op get the
    data op's normaliser, so losses and weights equal 1 rank x 8 (a net's).
    Before, the graph's loss kept each micro-batch's own mean."""
    import yaml
    from purine_mpi.graph import seed_yaml
    from purine_mpi.job.replica import build_train_graph
    seed, _ = build_train_graph(_job(_raw(-1, 4, mean="shard")))
    raw = _raw(-1, 4)
    del raw["net"]
    raw["graph"] = yaml.safe_load(yaml.safe_dump(seed_yaml.dump(seed), sort_keys=False))
    whole = _train(tmp_path, "whole", -1, 1)
    graph = _train(tmp_path, "graph", -1, 4, raw=raw)
    np.testing.assert_allclose(graph[0], whole[0], rtol=2e-6)
    for name, value in whole[1].items():
        np.testing.assert_allclose(graph[1][name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("graph", [False, True])
def test_a_label_another_op_makes_is_refused_under_global(graph):
    """A loss with an ignore_label whose label a slice layer makes (no copy
    of the data op's label: the data op cannot count it) over 2 micro-batches
    under ``global``: a ConfigError naming parallel.ignore_label_mean and the
    layer (the op of a ``graph:``); ``shard`` builds. Before, the loss kept
    its shard's own mean under ``global``."""
    from purine_mpi.base.errors import ConfigError
    from purine_mpi.graph import seed_yaml
    from purine_mpi.job.replica import build_train_graph, forward_graph
    net = [FC, {"type": "slice", "name": "cut", "bottom": "label", "top": ["la", "lb"],
                "axis": 0},
           {"type": "slice", "name": "cutx", "bottom": "fc1", "top": ["xa", "xb"], "axis": 0},
           {"type": "softmax_loss", "name": "loss", "bottom": ["xa", "la"], "top": "loss",
            "ignore_label": 2}]
    raw = _raw(-1, 2, net=net)
    where = "layer 'loss' \\(net\\[3\\]\\)"
    if graph:
        job = _job(raw)
        seed = forward_graph(job, "train", job.data.train.with_batch(job.micro_batch))
        seed.blobs["loss"].attrs["loss_weight"] = 1.0
        del raw["net"]
        raw["graph"] = seed_yaml.dump(seed)
        where = "op 'loss.fwd' of the graph"
    with pytest.raises(ConfigError, match=f"key 'parallel.ignore_label_mean': .*{where} has "
                                          "ignore_label 2, but its label 'la' is not the data "
                                          "op's.*set parallel.ignore_label_mean: shard"):
        build_train_graph(_job(raw))
    build_train_graph(_job(dict(raw, parallel={"micro_batches": 2,
                                               "ignore_label_mean": "shard"})))
