"""Trust audit: one iteration's update, from a checkpoint to the next,
against PyTorch.

A run saves a checkpoint every iteration; from checkpoint k (the weights,
the solver state of docs/config.md's solver table: SGD's ``momentum`` v,
Adam's ``m`` and ``v``, the iteration count) ``torch.optim`` takes one step
on the batch the documented sample order gives iteration k ("Sample
order": rank r reads positions [k·N·B + r·B, k·N·B + (r+1)·B), scheme data
the whole window), at the rate the lr policy gives iteration k, and that
step is checkpoint k+1's to float32 roundoff. Caffe's SGD keeps v = m·v +
rate·g (w −= v), torch's buffer b = m·b + g (w −= rate·b), so torch's
buffer before the step is v / rate_k: the two forms agree at every step,
also where the step policy changes the rate between the checkpoints.

The loss has an ``ignore_label`` whose counts differ between the ranks and
micro-batches of each compared iteration. Under scheme none (each rank its
own replica, no gradient exchanged) rank 0's saved weights are its own
replica's, trained on its own batch's mean over its counted positions
(docs/config.md, ``parallel.ignore_label_mean``). Found: on several ranks
the trainer normalised each rank's loss by both ranks' count over 2, with
and without micro-batches (iteration 1 here: 8 and 5 counted, rank 0's
gradient 8 / 6.5 of its own mean; its step 0.114 from torch's with SGD on
2 x 2 micro-batches, 0.0996 with AdamW without): ``build_rank_graphs``
asked the trainer's bare ``Scheme()`` whether the replicas exchange
gradients (yes, the class default) instead of the job's scheme (none), and
``graph --np`` did not ask. The test of that rule
(tests/test_global_label_count.py) compared two runs that shared the error.
"""
import types

import h5py
import numpy as np
import pytest
import torch
import yaml

from tests.conftest import FakeWorld, make_job, run_mpi_cli, write_config_file
from tests.test_micro_batches import _params

IGNORE, BATCH, ITERS = 3, 8, 5
#: each rank's batch as (counted, ignored) at iterations 1..4 on 2 ranks of
#: 8: the counts differ between the ranks and between 2 micro-batches of 4
IGNORED = {0: (1, 4), 1: (0, 3), 2: (2, 5), 3: (3, 0), 4: (1, 6)}


def _data(path):
    """A small HDF5 file (docs/config.md, "data"): 2·8·5 samples of 1x4x4,
    5 classes, label 3 placed IGNORED[k] times in rank 0's and rank 1's
    halves of iteration k's window (at the halves' starts: micro-batch 0
    holds more of them)."""
    rng = np.random.default_rng(7)
    n = 2 * BATCH * ITERS
    label = rng.choice([0, 1, 2, 4], n)
    for k, counts in IGNORED.items():
        for r, c in enumerate(counts):
            start = (2 * k + r) * BATCH
            label[start:start + c] = IGNORE
    with h5py.File(path, "w") as f:
        f["train/data"] = rng.standard_normal((n, 1, 4, 4)).astype(np.float32)
        f["train/label"] = label
    return str(path)


def _config(data, solver, parallel):
    base = {"sgd": {"type": "sgd", "base_lr": 0.2, "momentum": 0.9, "weight_decay": 0.01},
            "adamw": {"type": "adamw", "base_lr": 0.02, "momentum": 0.8,
                      "momentum2": 0.95, "delta": 1e-4, "weight_decay": 0.1}}[solver]
    return {"name": "step_oracle", "seed": 5,
            "data": {"train": {"source": "hdf5", "path": data, "split": "train",
                               "batch_size": BATCH, "shuffle": False}},
            "net": [{"type": "fc", "name": "fc1", "bottom": "data", "top": "h",
                     "num_output": 6},
                    {"type": "relu", "name": "act", "bottom": "h", "top": "h"},
                    {"type": "fc", "name": "fc2", "bottom": "h", "top": "out",
                     "num_output": 5},
                    {"type": "softmax_loss", "name": "loss", "bottom": ["out", "label"],
                     "top": "loss", "ignore_label": IGNORE}],
            "solver": dict(base, lr_policy="step", stepsize=2, gamma=0.5, max_iter=ITERS,
                           display=0, test_interval=0),
            "checkpoint": {"interval": 1, "keep": ITERS},
            "parallel": parallel}


NAMES = ("fc1/weight", "fc1/bias", "fc2/weight", "fc2/bias")


def _checkpoint(path):
    """(the checkpoint's params/ and solver/ arrays, its iteration, its config)."""
    with h5py.File(path, "r") as f:
        it, config = int(f.attrs["iteration"]), yaml.safe_load(f.attrs["config"])
    return _params(path), it, config


def torch_step(before, config, k, rows):
    """The weights after one ``torch.optim`` step from checkpoint arrays
    ``before`` (iteration k) on the training file's rows ``rows``."""
    solver = config["solver"]
    with h5py.File(config["data"]["train"]["path"], "r") as f:
        x = torch.tensor(f["train/data"][()][rows].reshape(len(rows), -1))
        y = torch.tensor(f["train/label"][()][rows])
    w = [torch.tensor(before[f"params/{n}"], requires_grad=True) for n in NAMES]
    out = torch.relu(x @ w[0].T + w[1]) @ w[2].T + w[3]
    torch.nn.functional.cross_entropy(out, y, ignore_index=IGNORE).backward()
    rate = solver["base_lr"] * solver["gamma"] ** (k // solver["stepsize"])
    if solver["type"] == "sgd":
        opt = torch.optim.SGD(w, lr=rate, momentum=solver["momentum"],
                              weight_decay=solver["weight_decay"])
        for p, n in zip(w, NAMES):  # Caffe's v = rate x torch's buffer
            opt.state[p]["momentum_buffer"] = torch.tensor(before[f"solver/{n}/momentum"]) / rate
    else:
        opt = torch.optim.AdamW(w, lr=rate, betas=(solver["momentum"], solver["momentum2"]),
                                eps=solver["delta"], weight_decay=solver["weight_decay"])
        adam_moments(opt, w, NAMES, before, k)
    opt.step()
    return {n: p.detach().numpy() for n, p in zip(NAMES, w)}


def adam_moments(opt, w, names, before, k):
    """Adam's state of checkpoint arrays ``before`` (iteration k) on the
    parameters ``w`` of ``opt`` (named ``names``): k steps taken (the next
    is step k + 1) and the checkpoint's moments."""
    for p, n in zip(w, names):
        opt.state[p].update(step=torch.tensor(float(k)),
                            exp_avg=torch.tensor(before[f"solver/{n}/m"]),
                            exp_avg_sq=torch.tensor(before[f"solver/{n}/v"]))


def check_steps(out, ranks, whole):
    """Each checkpoint k -> k+1 of run ``out`` (rank 0's replica, or with
    ``whole`` the ranks' one) against ``torch_step``: the largest error
    relative to the step's largest element, per parameter, below 1e-5."""
    for k in range(1, ITERS):
        before, it, config = _checkpoint(out / f"ckpt_{k}.h5")
        after, it2, _ = _checkpoint(out / f"ckpt_{k + 1}.h5")
        assert (it, it2) == (k, k + 1)
        window = np.arange(k * ranks * BATCH, (k + 1) * ranks * BATCH)
        ref = torch_step(before, config, k, window if whole else window[:BATCH])
        for n in NAMES:
            step, want = after[f"params/{n}"] - before[f"params/{n}"], \
                ref[n] - before[f"params/{n}"]
            err = float(np.abs(step - want).max() / np.abs(want).max())
            assert err < 1e-5, (f"{out.name}: {n}'s step from checkpoint {k} to {k + 1} is "
                                f"{err:.3g} (relative) from torch.optim's")


@pytest.mark.parametrize("solver, scheme, ranks, micro", [
    ("sgd", "none", 1, 1),
    pytest.param("sgd", "none", 2, 2, marks=pytest.mark.mpi),
    pytest.param("adamw", "none", 2, 1, marks=pytest.mark.mpi),
    pytest.param("adamw", "data", 2, 2, marks=pytest.mark.mpi)])
def test_each_checkpoint_is_one_torch_step_from_the_one_before(tmp_path, solver, scheme,
                                                               ranks, micro):
    """SGD with momentum and weight decay, AdamW with decoupled decay, the
    rate halved every 2 iterations; 1 rank; scheme none on 2 ranks (rank
    0's own batch and count), with and without 2 micro-batches; scheme
    data on 2 ranks x 2 micro-batches (the global batch of 16)."""
    cfg = _config(_data(tmp_path / "d.h5"), solver,
                  {"scheme": scheme, "micro_batches": micro})
    if ranks == 1:  # in this process, as the CLI's trainer (its bare Scheme())
        from purine_mpi.train.trainer import Trainer, run_and_report
        trainer = Trainer(make_job(cfg), str(tmp_path / "run"), world=FakeWorld(),
                          log=lambda line: None)
        assert run_and_report(trainer, FakeWorld()) == 0
    else:
        res = run_mpi_cli(ranks, "train", write_config_file(tmp_path, cfg), "--out",
                          tmp_path / "run")
        assert res.returncode == 0, res.stdout + res.stderr
    check_steps(tmp_path / "run", ranks, whole=scheme == "data")


@pytest.mark.parametrize("micro", [1, 2])
def test_scheme_none_counts_each_rank_alone_however_its_graphs_are_built(tmp_path, micro):
    """Rank 0 of 2 under scheme none: the trainer's bare ``Scheme()``, the
    job's own scheme and ``graph --np 2`` (tools/graph.py) build the same
    data reader, which counts the ignored labels of its own replica only
    (micro-batches: ``count_over: replica``, copy 0's reader for every
    copy; one: no count, the plain mean). Before, the bare Scheme and the graph tool counted both ranks'."""
    from purine_mpi.parallel.rank_graphs import build_rank_graphs
    from purine_mpi.parallel.schemes import Scheme, scheme_of
    from purine_mpi.tools.graph import composed
    job = make_job(_config(_data(tmp_path / "d.h5"), "sgd",
                           {"scheme": "none", "micro_batches": micro}))
    world = types.SimpleNamespace(size=2, rank=0, comm=None)
    graphs = [build_rank_graphs(job, world, s, check_memory=False).graph
              for s in (Scheme(), scheme_of(job))] + [composed(job, 2, 0)[0]]
    # the counting readers (micro-batch copy 0's alone counts for every copy)
    readers = [[(op.attrs["count_label"], op.attrs.get("count_over"))
                for op in g.ops.values() if op.op_type == "DataReader" and
                op.attrs.get("count_label") is not None] for g in graphs]
    want = [(IGNORE, "replica")] if micro > 1 else []
    assert readers == [want] * 3, readers
