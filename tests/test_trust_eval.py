"""Issue 32 ("Trust"), case 6: a test figure never depends on the launch.

One test pass without ``test_iter`` counts every sample of the split exactly
once, on any number of ranks and with any test batch: the last batch is
padded, and the padding counts neither in the loss mean nor in the accuracy
(data/sources.py ``pass_batches``/``pass_counts``, the DataReader's ``pad_from``,
job/replica.py ``mark_padding``, train/evaluation.py). ``test``, ``train``'s
evaluations and ``predict`` agree. On 6dff0b5 the reader wrapped around and
counted the first samples twice (0.975 on 480 samples on 4 ranks for 360).
"""
import json

import h5py
import numpy as np
import pytest

from purine_mpi.graph.core import Op
from purine_mpi.job.config import resolve_config
from purine_mpi.ops.data import DataReader
from purine_mpi.train.trainer import Trainer
from tests.conftest import (FakeWorld, make_job, run_cli_args, run_mpi_cli, small_net_config,
                            train_here, write_config_file)

SPLIT = 360  # the digits test split


def _reader(n, batch, rank, ranks, pad_label=-1):
    """A test-phase DataReader of rank ``rank`` of ``ranks`` over a synthetic
    split of ``n`` samples."""
    source = {"source": "synthetic", "shape": [1, 2, 2], "classes": 5, "num_samples": n,
              "seed": 7, "split": "test"}
    attrs = {"source": source, "batch_size": batch, "rank": rank, "world_size": ranks,
             "seed": 1, "train": False, "pad_label": pad_label}
    DataReader.infer(attrs, [])
    return DataReader(Op("data", "DataReader", [], ["data", "label"], attrs))


def test_case6_one_pass_rule_counts_each_sample_once_on_any_launch():
    """Case 6, the rule: for many (samples, batch, ranks), N < batch x ranks
    and ranks > batches among them, the batches of one pass hold every
    sample once at positions < N, and exactly ``pass_counts`` of each rank's
    batch are samples; the rest carry the pad label, so the loss and the
    accuracy ignore them."""
    from purine_mpi.data.sources import make_source, pass_batches, pass_counts
    for n, batch, ranks in [(360, 60, 1), (360, 60, 3), (360, 60, 4), (360, 60, 5),
                            (360, 100, 1), (10, 3, 4), (5, 4, 7), (1, 1, 3), (7, 7, 1),
                            (13, 2, 3), (100, 33, 2), (4, 64, 2)]:
        iters = pass_batches(n, batch, ranks)
        assert iters == max(1, -(-n // (batch * ranks)))
        assert (iters - 1) * batch * ranks < n <= iters * batch * ranks
        readers = [_reader(n, batch, r, ranks) for r in range(ranks)]
        labels_of = make_source(readers[0].attrs["source"]).labels
        seen = []
        for t in range(iters):
            counts = pass_counts(t, ranks, batch, n)
            for r, k in enumerate(readers):
                k.pad_from(n)
                _, labels = k.prepare(t, n)
                real = labels != -1
                assert int(real.sum()) == counts[r], (n, batch, ranks, t, r)
                # the samples come first in a batch, the padding after them
                assert real[:counts[r]].all() and not real[counts[r]:].any()
                start = (t * ranks + r) * batch
                idx = np.arange(start, start + counts[r])
                np.testing.assert_array_equal(labels[:counts[r]], labels_of[idx])
                seen.extend(idx.tolist())
        assert sorted(seen) == list(range(n)), (n, batch, ranks)


def test_case6_padding_reaches_the_reader_through_its_prefetch():
    """Case 6: a prefetched batch made before ``pad_from`` changed is not
    delivered (the padding of a test pass is never lost to the prefetch)."""
    k = _reader(10, 4, 0, 1)
    out = [np.empty((4, 1, 2, 2), np.float32), np.empty(4, np.int64)]
    k.setup([], out)  # prefetches batch 0 without padding
    k.reset_position(2)
    k.pad_from(10)
    k.run([], out)
    np.testing.assert_array_equal(out[1][2:], [-1, -1])
    assert (out[1][:2] >= 0).all()
    k.pad_from(None)
    k.reset_position(2)
    k.run([], out)
    assert (out[1] >= 0).all()  # without padding the batch wraps around the split


def _evaluate(digits_h5, tmp_path, test_batch, test_iter=None):
    """An in-process one-rank test pass of the small net at its initial
    weights (drawn from the seed and the parameter names: the same in every
    trainer) with test batch ``test_batch``."""
    cfg = small_net_config(digits_h5)
    cfg["data"]["test"]["batch_size"] = test_batch
    t = Trainer(make_job(cfg), str(tmp_path / f"r{test_batch}"), world=FakeWorld(),
                log=lambda m: None)
    try:
        return t.evaluate(test_iter)
    finally:
        t.close()


def test_case6_padded_samples_count_in_no_figure(digits_h5, tmp_path):
    """Case 6, the masking: on one rank a test batch that does not divide
    the split (7, 100, 1000 for 360 samples) gives the figures of one batch
    of the whole split: 360 samples, the same loss and accuracy. On 6dff0b5
    the reader wrapped (400 samples with batch 100, 1000 with batch 1000)."""
    ref = _evaluate(digits_h5, tmp_path, SPLIT)
    assert ref["samples"] == SPLIT
    for batch in (7, 100, 1000):
        res = _evaluate(digits_h5, tmp_path, batch)
        assert res["samples"] == SPLIT, (batch, res)
        assert res["accuracy"] == pytest.approx(ref["accuracy"], abs=1e-6), (batch, res)
        assert res["loss"] == pytest.approx(ref["loss"], rel=1e-5), (batch, res)


def test_explicit_test_iter_counts_each_sample_as_often_as_it_is_read(digits_h5, tmp_path):
    """With test_iter given the pass wraps around the split, as documented:
    2 batches of 200 read 400 samples, the first 40 twice, and the figures
    are the mean over those 400 reads (checked against the per-sample
    predictions of one exact batch)."""
    cfg = small_net_config(digits_h5)
    cfg["data"]["test"]["batch_size"] = SPLIT
    t = Trainer(make_job(cfg), str(tmp_path / "p"), world=FakeWorld(), log=lambda m: None)
    try:
        t.evaluate()
        ws = t.test.workspace
        scores, labels = np.array(ws["fc1"], dtype=np.float64), np.array(ws["label"])
    finally:
        t.close()
    correct = (scores.argmax(1) == labels).astype(np.float64)
    res = _evaluate(digits_h5, tmp_path, 200, test_iter=2)
    assert res["samples"] == 400
    expect = (correct.sum() + correct[:40].sum()) / 400
    assert res["accuracy"] == pytest.approx(expect, abs=1e-6)


def _json(res):
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def trained(digits_h5, tmp_path_factory):
    """The small digits net trained 20 iterations on one rank: its folder,
    config and latest.h5."""
    d = tmp_path_factory.mktemp("trust_eval")
    cfg = small_net_config(digits_h5, checkpoint={"interval": 20, "keep": 2})
    path = write_config_file(d, cfg)
    train_here(cfg, d / "run")
    return {"dir": d, "cfg": cfg, "path": path, "weights": d / "run" / "latest.h5"}


def test_case6_test_gives_the_same_figures_on_1_3_4_5_ranks_and_agrees_with_predict(trained):
    """Case 6: ``test`` with the same weights and test batch 60 counts the
    360 samples once on 1, 3, 4 and 5 ranks (2 batches of 60 x 4 = 480
    positions, x 5 = 600) and gives the 1-rank figures; the accuracy is the
    one of ``predict``'s scores. On 6dff0b5 4 ranks counted 480 samples and
    5 ranks 600, with other figures."""
    path, weights = trained["path"], trained["weights"]
    one = _json(run_cli_args("test", path, "--weights", weights))
    assert one["samples"] == SPLIT
    for n in (3, 4, 5):
        res = run_mpi_cli(n, "test", path, "--weights", weights)
        got = _json(res)
        assert got["samples"] == SPLIT, (n, got)
        assert got["accuracy"] == pytest.approx(one["accuracy"], abs=2e-6), (n, got, one)
        assert got["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=2e-6), (n, got, one)
        assert "wraps around" not in res.stderr  # no note: nothing is counted twice
    preds = trained["dir"] / "preds.h5"
    res = run_cli_args("predict", path, "--weights", weights, "--out", preds)
    assert res.returncode == 0, res.stderr[-2000:]
    with h5py.File(preds, "r") as f:
        scores = f["outputs"][list(f["outputs"])[0]][...]
        labels = f["label"][...]
    assert len(labels) == SPLIT
    assert one["accuracy"] == pytest.approx(float((scores.argmax(1) == labels).mean()),
                                            abs=2e-6)


def test_case6_train_evaluations_on_4_ranks_count_the_split_once(trained):
    """Case 6: ``train`` on 4 ranks (2 test batches of 60 x 4 = 480
    positions for 360 samples) writes test rows of 360 samples whose
    figures are those ``test`` gives for the same weights on one rank. On
    6dff0b5 the rows said 480 samples."""
    d = trained["dir"]
    cfg = dict(trained["cfg"], checkpoint={"interval": 20, "keep": 2})
    cfg["solver"] = dict(cfg["solver"], test_interval=10)
    path = write_config_file(d, cfg, "cfg4.yaml")
    res = run_mpi_cli(4, "train", path, "--out", d / "run4")
    assert res.returncode == 0, res.stderr[-2000:]
    with open(d / "run4" / "metrics.jsonl") as f:
        rows = [r for r in map(json.loads, f) if r.get("phase") == "test"]
    assert [r["iter"] for r in rows] == [10, 20]
    assert all(r["samples"] == SPLIT for r in rows), rows
    one = _json(run_cli_args("test", path, "--weights", d / "run4" / "latest.h5"))
    assert rows[-1]["accuracy"] == pytest.approx(one["accuracy"], abs=2e-6), (rows, one)
    assert rows[-1]["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=2e-6), (rows, one)


def test_case6_padding_label_is_one_the_loss_and_accuracy_ignore(digits_h5):
    """Case 6, which label the padding carries (job/replica.mark_padding): -1
    (PAD_LABEL), which every loss and accuracy skips as attr pad_label,
    apart from their own ignore_label (an accuracy without one still counts
    every class: tests/test_pad_label.py), also when two losses ignore
    different labels; none (a one-pass test that wraps, with its note) when
    the label reaches another op."""
    from purine_mpi.job.replica import build_test_graph, mark_padding

    def graph(net_extra=(), **loss_keys):
        cfg = small_net_config(digits_h5)
        cfg["net"][4].update(loss_keys)
        cfg["net"].extend(net_extra)
        return build_test_graph(make_job(cfg))

    def skipped(g):
        return {op.name: (op.attrs.get("ignore_label"), op.attrs.get("pad_label"))
                for op in g.ops.values() if op.op_type in ("SoftmaxLoss", "Accuracy")}

    g = graph()
    assert mark_padding(g) == -1
    assert g.ops["data"].attrs["pad_label"] == -1
    assert set(skipped(g).values()) == {(None, -1)}
    g = graph(ignore_label=255)
    assert mark_padding(g) == -1 and g.ops["data"].attrs["pad_label"] == -1
    assert sorted(skipped(g).values(), key=str) == [(255, -1), (None, -1)]
    second = {"type": "softmax_loss", "name": "loss2", "bottom": ["fc1", "label"],
              "top": "loss2", "ignore_label": 9}
    g = graph([second], ignore_label=8)
    assert mark_padding(g) == -1 and g.ops["data"].attrs["pad_label"] == -1
    assert sorted(skipped(g).values(), key=str) == [(8, -1), (9, -1), (None, -1)]
    g = graph()
    g.add_op("odd", "Scale", ["label"], ["label2"], {"scale": 1.0})
    assert mark_padding(g) is None and "pad_label" not in g.ops["data"].attrs


def test_case6_every_scheme_that_evaluates_counts_the_split_once(trained):
    """Case 6 on the other schemes, test batch 100 (a global batch that does
    not divide 360): ``test`` with scheme hybrid (2 replicas x 2 stages) and
    scheme none on 4 ranks gives the 1-rank figures on 360 samples, and
    ``train`` with parameter servers (3 workers and a server) writes test
    rows of 360 samples equal to ``test`` of its weights on one rank. On
    6dff0b5: 400, 400 and 600 samples."""
    d, weights = trained["dir"], trained["weights"]
    cfg = dict(trained["cfg"])
    cfg["data"] = dict(cfg["data"], test=dict(cfg["data"]["test"], batch_size=100))
    path = write_config_file(d, cfg, "cfg100.yaml")
    one = _json(run_cli_args("test", path, "--weights", weights))
    assert one["samples"] == SPLIT
    stages = "{conv1: 0, relu1: 0, pool1: 0, fc1: 1, loss: 1, acc: 1}"
    for sets in (["parallel.scheme=hybrid", f"parallel.stages={stages}"],
                 ["parallel.scheme=none"]):
        got = _json(run_mpi_cli(4, "test", path, "--weights", weights,
                                *[a for s in sets for a in ("--set", s)]))
        assert got["samples"] == SPLIT, (sets, got)
        assert got["accuracy"] == pytest.approx(one["accuracy"], abs=2e-6), (sets, got, one)
        assert got["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=2e-6), (sets, got, one)
    res = run_mpi_cli(4, "train", path, "--out", d / "run_ps", "--set", "parallel.mode=sync_ps",
                      "--set", "solver.test_interval=10", "--set", "checkpoint.interval=20")
    assert res.returncode == 0, res.stderr[-2000:]
    with open(d / "run_ps" / "metrics.jsonl") as f:
        rows = [r for r in map(json.loads, f) if r.get("phase") == "test"]
    assert [r["samples"] for r in rows] == [SPLIT, SPLIT], rows
    ps = _json(run_cli_args("test", path, "--weights", d / "run_ps" / "latest.h5"))
    assert rows[-1]["accuracy"] == pytest.approx(ps["accuracy"], abs=2e-6), (rows, ps)
    assert rows[-1]["loss"] == pytest.approx(ps["loss"], rel=1e-5, abs=2e-6), (rows, ps)
