"""Micro-batches (parallel.micro_batches) and pipeline schedules: the same
global batch trains like one rank without micro-batches (float32
tolerance: only the summation order differs), the schedules order each
stage's copies as documented, and bad pipeline configs exit 2 naming the key."""
import subprocess

import h5py
import numpy as np
import pytest

from purine_mpi.job.config import resolve_config
from purine_mpi.parallel.micro_batch import stage_order
from tests.conftest import (MPIEXEC, PYTHON, REPO, cli_env, make_job, run_cli_here, train_here,
                            write_config_file)

STAGES = {"conv1": 0, "relu1": 0, "pool1": 0, "fc1": 1, "relu3": 1, "fc2": 1, "loss": 1}


def _config(**parallel):
    """A dropout-free tiny net on synthetic data, cut in two stages."""
    return {
        "name": "micro", "seed": 2,
        "data": {"train": {"source": "synthetic", "shape": [1, 8, 8], "classes": 10,
                           "batch_size": 8}},
        "net": [
            {"type": "conv", "name": "conv1", "bottom": "data", "top": "conv1",
             "num_output": 4, "kernel": 3, "pad": 1},
            {"type": "relu", "name": "relu1", "bottom": "conv1", "top": "conv1"},
            {"type": "pool", "name": "pool1", "bottom": "conv1", "top": "pool1", "pool": "max",
             "kernel": 2, "stride": 2},
            {"type": "fc", "name": "fc1", "bottom": "pool1", "top": "fc1", "num_output": 16},
            {"type": "relu", "name": "relu3", "bottom": "fc1", "top": "fc1"},
            {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2", "num_output": 10},
            {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"], "top": "loss"},
        ],
        "solver": {"base_lr": 0.05, "momentum": 0.9, "weight_decay": 0.001, "max_iter": 6,
                   "display": 3, "test_interval": 0},
        "parallel": parallel,
    }


def _params(path):
    with h5py.File(path, "r") as f:
        out = {}
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) and name.startswith(("params", "solver"))
                     else None)
        return out


def _close(a, b):
    assert sorted(a) == sorted(b) and a
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)


def _train_in_process(parallel, iters=5):
    from purine_mpi.train.trainer import Trainer
    t = Trainer(make_job(_config(**parallel)), "/nonexistent-unused", log=lambda m: None)
    try:
        losses = []
        for it in range(iters):
            t.ws["iter"][...] = it
            t.train.run(it)
            g = t.graphs
            losses.append(sum(float(t.ws[b]) * s for b, s in zip(g.losses, g.loss_shares)))
        return {p: t.ws[p].copy() for p in t.graphs.params}, losses
    finally:
        t.close()


@pytest.mark.parametrize("micro,schedule", [(2, "1f1b"), (4, "gpipe")])
def test_gradient_accumulation_equals_the_whole_batch(micro, schedule):
    ref, ref_loss = _train_in_process({"scheme": "data"})
    got, got_loss = _train_in_process({"scheme": "data", "micro_batches": micro,
                                       "schedule": schedule})
    _close(ref, got)
    np.testing.assert_allclose(ref_loss, got_loss, rtol=1e-5)


def _one_sum(graph, grads, micro, in_place=False):
    """replicate_micro_batches as it was: each parameter's M gradients added
    by one M-input Sum after the last copy, not by running sums (each copy's
    gradient a buffer of its own)."""
    from purine_mpi.parallel.micro_batch import micro_name, replicate_micro_batches, sum_name
    copies = replicate_micro_batches(graph, grads, micro)
    for grad in grads.values():
        thread = graph.ops[f"{grad}.micro_sum"].thread
        for k in range(1, micro):
            name = f"{grad}.micro_sum" if k == micro - 1 else sum_name(grad, k)
            del graph.ops[name]
            copies.pop(name)
            if k < micro - 1:
                del graph.blobs[name]
        graph.add_op(f"{grad}.micro_sum", "Sum", [micro_name(grad, k) for k in range(micro)],
                     [grad], location=graph.blobs[grad].location, thread=thread)
    graph.ops = {op.name: op for op in graph.topo_order()}
    return copies


@pytest.mark.parametrize("memory_plan", [True, False])
def test_running_sums_train_bitwise_like_one_sum(monkeypatch, memory_plan):
    """Copy k adds its gradient to the running sum of copies 0..k-1: the
    M-input Sum's order of additions, so weights and losses after 5
    iterations are those of one Sum after the last copy, bit for bit."""
    import purine_mpi.parallel.schemes.steps as steps
    par = {"scheme": "data", "micro_batches": 4, "schedule": "1f1b"}

    def train():
        from purine_mpi.train.trainer import Trainer
        cfg = _config(**par)
        cfg["memory_plan"] = memory_plan
        t = Trainer(make_job(cfg), "/nonexistent-unused", log=lambda m: None)
        try:
            losses = []
            for it in range(5):
                t.ws["iter"][...] = it
                t.train.run(it)
                losses.append([t.ws[b].copy() for b in t.graphs.losses])
            ops = set(t.graphs.graph.ops)
            return {p: t.ws[p].copy() for p in t.graphs.params}, losses, ops
        finally:
            t.close()
    got, got_loss, got_ops = train()
    monkeypatch.setattr(steps, "replicate_micro_batches", _one_sum)
    ref, ref_loss, ref_ops = train()
    assert any(n.endswith(".micro_sum1") for n in got_ops - ref_ops)
    assert sorted(got) == sorted(ref) and got
    for name in ref:
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
    for a, b in zip(got_loss, ref_loss):
        assert len(a) == len(b) == 4 and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_copies_are_built_in_the_same_order_in_every_process():
    """The micro-batch copies' blobs follow the copied ops' order, not a
    set's (which follows the Python hash seed): two processes of one job
    build the same graph, so `graph` prints the same text and every rank's
    plan lays its blobs out alike (PYTHONHASHSEED 1 and 2 gave three
    different DOT outputs of digits_lenet with micro_batches 2 before)."""
    import json
    code = ("import json\n"
            "from tests.conftest import make_job\n"
            "from tests.test_micro_batches import _config\n"
            "from purine_mpi.tools.graph import compose_for\n"
            "g = compose_for(make_job(_config(scheme='data', micro_batches=4)), 1, 0)\n"
            "print(json.dumps([list(g.blobs), list(g.ops)]))\n")
    out = []
    for seed in ("1", "2"):
        env = dict(cli_env(), PYTHONHASHSEED=seed)
        res = subprocess.run([PYTHON, "-c", code], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        out.append(json.loads(res.stdout.splitlines()[-1]))
    assert any(b.endswith("@mb3") for b in out[0][0]), out[0][0]
    assert out[0] == out[1]


def test_schedule_orders():
    assert stage_order(0, 2, 4, "1f1b") == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1),
                                           ("F", 3), ("B", 2), ("B", 3)]
    assert stage_order(1, 2, 4, "1f1b") == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2),
                                           ("B", 2), ("F", 3), ("B", 3)]
    assert stage_order(0, 2, 2, "gpipe") == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_stage_slice_runs_in_schedule_order(tmp_path, schedule):
    """The serial order of stage 0's slice (control edges of the schedule)."""
    from purine_mpi.tools.graph import compose_for
    cfg = resolve_config(_config(scheme="pipeline", stages=STAGES, micro_batches=4,
                                 schedule=schedule))
    g = compose_for(make_job(cfg), 2, 0)
    seen = []
    for op in g.topo_order():
        if "@mb" in op.name and op.op_type not in ("Send", "Recv", "Put", "WaitWrite",
                                                   "Release", "WaitFree", "DataReader"):
            step = ("B" if ".bwd." in op.name else "F", int(op.name.rsplit("@mb", 1)[1]))
            if not seen or seen[-1] != step:
                seen.append(step)
    assert seen == stage_order(0, 2, 4, schedule)


@pytest.mark.mpi
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_with_micro_batches_matches_one_rank(tmp_path, schedule):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    one = write_config_file(tmp_path, _config(scheme="data"), "one.yaml")
    many = write_config_file(tmp_path, _config(scheme="pipeline", stages=STAGES,
                                               micro_batches=4, schedule=schedule), "many.yaml")
    train_here(one, tmp_path / "one")  # the one-rank reference, in this process
    r2 = subprocess.run([MPIEXEC, "-n", "2", PYTHON, "-m", "purine_mpi", "train", many,
                         "--out", tmp_path / "many"], cwd=REPO, env=cli_env(),
                        capture_output=True, text=True, timeout=120)
    assert r2.returncode == 0, r2.stderr
    _close(_params(tmp_path / "one" / "latest.h5"), _params(tmp_path / "many" / "latest.h5"))


@pytest.mark.mpi
def test_data_parallel_with_micro_batches_matches_one_rank(tmp_path):
    """2 ranks x batch 8 in 2 micro-batches == 1 rank x batch 16."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    cfg = _config(scheme="data")
    cfg["data"]["train"]["batch_size"] = 16
    one = write_config_file(tmp_path, cfg, "one.yaml")
    many = write_config_file(tmp_path, _config(scheme="data", micro_batches=2), "many.yaml")
    train_here(one, tmp_path / "one")  # the one-rank reference, in this process
    r2 = subprocess.run([MPIEXEC, "-n", "2", PYTHON, "-m", "purine_mpi", "train", many,
                         "--out", tmp_path / "many"], cwd=REPO, env=cli_env(),
                        capture_output=True, text=True, timeout=120)
    assert r2.returncode == 0, r2.stderr
    _close(_params(tmp_path / "one" / "latest.h5"), _params(tmp_path / "many" / "latest.h5"))


@pytest.mark.parametrize("parallel,np_,key,words", [
    ({"scheme": "pipeline", "stages": {k: v for k, v in STAGES.items() if k != "fc2"}}, 2,
     "parallel.stages", "fc2"),
    ({"scheme": "pipeline", "stages": dict(STAGES, fc1=2, relu3=2, fc2=2, loss=2)}, 3,
     "parallel.stages", "stage(s) 1 have no layers"),
    ({"scheme": "pipeline", "stages": STAGES}, 3, "parallel.stages", "not a multiple"),
    ({"scheme": "data", "micro_batches": 3}, 1, "parallel.micro_batches", "batch_size 8"),
])
def test_bad_pipeline_config_exits_2(tmp_path, parallel, np_, key, words):
    cfg = write_config_file(tmp_path, _config(**parallel))
    res = run_cli_here("graph", cfg, "--np", str(np_))
    assert res.returncode == 2, res.stderr
    assert f"'{key}'" in res.stderr and words in res.stderr and "Traceback" not in res.stderr
