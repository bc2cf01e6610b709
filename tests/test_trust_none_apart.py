"""Trust audit: scheme none on 2 ranks against each rank alone.

Scheme none trains one replica per rank on its shard, exchanging nothing
(docs/config.md, ``parallel.scheme``); a save writes rank 0's replica. So
rank 0's checkpoint and the run's test rows are those of one rank trained
on rank 0's batches alone: here a 1-rank run on a file holding just those
batches (rows [16t, 16t + 8) of digits' train split), same seed, same
initial weights. Found: the test pass evaluated each rank's replica on its
own half of the test split and summed them (figures of no model: in the
audit's sweep, an fc-relu-fc net after 4 SGD steps, accuracy 0.108 where
the saved model's is 0.153), and a test pass or a save set
each batch norm's running statistics to their mean over the ranks,
exchanging the replicas' state (the saved ones were no rank's own). Now
rank 0 evaluates its replica over the whole split (the others add
nothing), and each replica keeps its own running statistics; ``predict``
writes the split once.
"""
import json

import h5py
import numpy as np
import pytest

from tests.conftest import final_figures, run_cli_args, run_mpi_cli, train_here, write_config_file

B = 8  # per rank; 2 ranks read [16t, 16t + 16) at iteration t


def _config(path, batch_norm):
    net = [{"type": "convolution", "name": "conv", "bottom": "data", "top": "c",
            "num_output": 4, "kernel": 3}]
    if batch_norm:
        net.append({"type": "batch_norm", "name": "bn", "bottom": "c", "top": "c"})
    net += [{"type": "relu", "name": "act", "bottom": "c", "top": "c"},
            {"type": "fc", "name": "fc", "bottom": "c", "top": "out", "num_output": 10},
            {"type": "softmax_loss", "name": "loss", "bottom": ["out", "label"],
             "top": "loss", "ignore_label": 3},
            {"type": "accuracy", "name": "acc", "bottom": ["out", "label"], "top": "acc",
             "phase": "test"}]
    return {"name": "apart", "seed": 5,
            "data": {"train": {"source": "hdf5", "path": path, "split": "train",
                               "batch_size": B, "shuffle": False},
                     "test": {"source": "hdf5", "path": path, "split": "test",
                              "batch_size": 50, "shuffle": False}},
            "net": net,
            "solver": {"type": "sgd", "base_lr": 0.2, "momentum": 0.9, "weight_decay": 0.01,
                       "lr_policy": "step", "stepsize": 2, "gamma": 0.5, "max_iter": 4,
                       "display": 1, "test_interval": 2},
            "checkpoint": {"interval": 4}}


def _rank0_file(digits_h5, path):
    """digits with rank 0's training batches alone (the test split whole)."""
    with h5py.File(digits_h5, "r") as f, h5py.File(path, "w") as out:
        n = len(f["train/label"])
        rows = np.concatenate([np.arange(t, t + B) for t in range(0, n - 2 * B + 1, 2 * B)])
        for k in ("data", "label"):
            out[f"train/{k}"] = f[f"train/{k}"][()][rows]
            out[f"test/{k}"] = f[f"test/{k}"][()]
        for k, v in f.attrs.items():
            out.attrs[k] = v
    return str(path)


def _saved(out):
    with h5py.File(out / "latest.h5", "r") as f:
        arrays = {}
        f.visititems(lambda k, v: arrays.__setitem__(k, v[()])
                     if isinstance(v, h5py.Dataset) and k.startswith(("params/", "solver/"))
                     else None)
    return arrays


def _test_rows(out):
    return [(r["iter"], r["loss"], r["accuracy"], r["samples"])
            for r in map(json.loads, open(out / "metrics.jsonl")) if r["phase"] == "test"]


@pytest.mark.mpi
def test_scheme_none_saves_and_tests_rank_0s_replica_as_one_rank_alone(digits_h5, tmp_path):
    """Weights, momenta and the batch norm's running statistics of
    latest.h5 within 1e-6 of the rank-0-alone run's; its test rows and
    ``final`` line equal (rel 1e-6; accuracy exactly). Before: the saved
    running mean 0.235 (relative) from rank 0's own (the ranks' mean)."""
    cfg = _config(digits_h5, batch_norm=True)
    cfg["parallel"] = {"scheme": "none"}
    res = run_mpi_cli(2, "train", write_config_file(tmp_path, cfg, "none.yaml"), "--out",
                      tmp_path / "none")
    assert res.returncode == 0, res.stdout + res.stderr
    alone = _config(_rank0_file(digits_h5, tmp_path / "rank0.h5"), batch_norm=True)
    ref = run_cli_args("train", write_config_file(tmp_path, alone, "alone.yaml"), "--out",
                       tmp_path / "alone")
    assert ref.returncode == 0, ref.stdout + ref.stderr
    got, want = _saved(tmp_path / "none"), _saved(tmp_path / "alone")
    assert sorted(got) == sorted(want) and "params/bn/running_var" in want
    for k in want:
        err = np.abs(got[k] - want[k]).max() / max(np.abs(want[k]).max(), 1e-12)
        assert err < 1e-6, f"{k}: {err:.3g} (relative) from rank 0 alone"
    rows, ref_rows = _test_rows(tmp_path / "none"), _test_rows(tmp_path / "alone")
    assert len(rows) == len(ref_rows) == 2
    for (it, loss, acc, n), (it2, loss2, acc2, n2) in zip(rows, ref_rows):
        assert (it, n, acc) == (it2, n2, acc2), (rows, ref_rows)
        assert loss == pytest.approx(loss2, rel=1e-6), (rows, ref_rows)
    final, ref_final = final_figures(res), final_figures(ref)
    assert final["accuracy"] == ref_final["accuracy"]
    assert final["loss"] == pytest.approx(ref_final["loss"], rel=1e-6)


@pytest.mark.mpi
def test_predict_under_scheme_none_writes_the_split_once(digits_h5, tmp_path):
    """``predict`` on 2 ranks under scheme none (both ranks given the same
    weights): the 1-rank file's rows, each test sample once, in order."""
    cfg = _config(digits_h5, batch_norm=False)
    one = write_config_file(tmp_path, cfg, "one.yaml")
    train_here(cfg, tmp_path / "run")
    cfg["parallel"] = {"scheme": "none"}
    two = write_config_file(tmp_path, cfg, "two.yaml")
    weights = tmp_path / "run" / "latest.h5"
    outs = []
    for n, path in ((1, one), (2, two)):
        args = ("predict", path, "--weights", weights, "--out", tmp_path / f"p{n}.h5")
        res = run_mpi_cli(n, *args) if n > 1 else run_cli_args(*args)
        assert res.returncode == 0, res.stdout + res.stderr
        with h5py.File(tmp_path / f"p{n}.h5", "r") as f:
            outs.append({k: f[k][()] for k in f if isinstance(f[k], h5py.Dataset)})
    assert sorted(outs[0]) == sorted(outs[1]) and "label" in outs[0]
    for k in outs[0]:
        assert len(outs[1][k]) == 360
        np.testing.assert_allclose(outs[1][k], outs[0][k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_train_and_graph_build_rank_1s_test_reader_over_the_whole_split(digits_h5):
    """Rank 1 of 2 under scheme none: the trainer's test graph and ``graph
    --np 2 --rank 1 --phase test`` read the split as replica 0 of 1 (rank 0
    alone reports), under scheme data as replica 1 of 2. Before: 1 of 2
    under both schemes."""
    import types

    from purine_mpi.parallel.rank_graphs import build_rank_graphs
    from purine_mpi.tools.graph import composed
    from tests.conftest import make_job
    world = types.SimpleNamespace(size=2, rank=1, comm=None)
    for scheme, want in (("none", (0, 1)), ("data", (1, 2))):
        cfg = _config(digits_h5, batch_norm=False)
        cfg["parallel"] = {"scheme": scheme}
        job = make_job(cfg)
        graphs = build_rank_graphs(job, world, check_memory=False)
        assert graphs.apart == (scheme == "none") and graphs.test_data == want
        for g in (graphs.test_graph, composed(job, 2, 1, "test")[0]):
            readers = [(op.attrs["rank"], op.attrs["world_size"]) for op in g.ops.values()
                       if op.op_type == "DataReader"]
            assert readers == [want], (scheme, readers)
