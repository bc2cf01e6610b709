"""A ``batch_norm`` with ``sync: true`` (PyTorch's ``SyncBatchNorm``): its
statistics and the two sums its gradient takes are those of the global
batch, summed over the replicas by Allreduce ops in the graph.

- The kernels: a batch split in two, each half's sums added (what the
  Allreduce does), give PyTorch's BatchNorm2d of the whole batch: outputs,
  running statistics, dx, and dgamma / dbeta as the sum of the halves'.
- 2 ranks × 8 under schemes data and sharded (stage 2): the checkpoints of
  3 SGD iterations (digits, a 3×3 ``conv`` into ``batch_norm``, an ``fc``)
  are those of 1 rank × 16 (every weight, γ, β and the running statistics),
  and so are the loss rows; without ``sync`` the running variance is not.
- ``sync: true`` where no scheme sums it: exit 2 naming the key.
"""
import json

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from purine_mpi.base.errors import ConfigError
from purine_mpi.graph import Graph
from purine_mpi.job.config import validate_config
from purine_mpi.ops.catalog import get_kernel_class
from tests.conftest import run_cli_args, run_mpi_cli, write_config_file

G = 16  # the global batch


def _kernel(op_type, ins, outs, attrs=None):
    """Run op ``op_type`` on arrays ``ins``, writing ``outs`` (arrays)."""
    g = Graph()
    names = [f"i{k}" for k in range(len(ins))] + [f"o{k}" for k in range(len(outs))]
    for name, a in zip(names, list(ins) + list(outs)):
        g.add_blob(name, a.shape, str(a.dtype))
    op = g.add_op("op", op_type, names[:len(ins)], names[len(ins):], attrs or {})
    get_kernel_class(op_type, "op")(op).run(list(ins), list(outs))
    return outs


def test_kernels_of_two_halves_are_the_whole_batch():
    """Two halves of a (16, 3, 4, 4) batch whose mean is large against its
    spread (the sums' float64 keeps the variance's digits), sums added as the
    Allreduce adds them: y, the running statistics, dx against PyTorch's
    batch_norm over the whole batch; dgamma, dbeta the sums of the halves'."""
    rng = np.random.default_rng(5)
    C = 3
    x = (rng.standard_normal((G, C, 4, 4)) * 0.5 + 20).astype(np.float32)
    w = rng.standard_normal(x.shape).astype(np.float32)  # d loss / d y
    gamma = rng.uniform(0.5, 2, C).astype(np.float32)
    beta = rng.standard_normal(C).astype(np.float32)
    halves = [slice(0, G // 2), slice(G // 2, G)]
    sums = sum(_kernel("BatchNormStats", [x[h]], [np.empty(2 * C + 1)])[0] for h in halves)
    attrs = {"eps": 1e-5, "momentum": 0.1, "phase": "train"}
    ys, dxs, dgammas, dbetas, running = [], [], 0, 0, None
    for h in halves:
        rm, rv = np.zeros(C, np.float32), np.ones(C, np.float32)
        y, mean, invstd = (np.empty_like(x[h]), np.empty(C, np.float32),
                           np.empty(C, np.float32))
        _kernel("BatchNorm", [x[h], gamma, beta, rm, rv, sums], [y, mean, invstd, rm, rv], attrs)
        running = (rm, rv)
        gsums = sum(_kernel("BatchNormGradStats", [w[k], x[k], mean, invstd],
                            [np.empty(2 * C + 1)])[0] for k in halves)
        dx, dgamma, dbeta = (np.empty_like(x[h]), np.empty(C, np.float32),
                             np.empty(C, np.float32))
        _kernel("BatchNormGrad", [w[h], x[h], gamma, mean, invstd, gsums], [dx, dgamma, dbeta],
                {"phase": "train", "eps": 1e-5})
        ys.append(y)
        dxs.append(dx)
        dgammas, dbetas = dgammas + dgamma, dbetas + dbeta
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    gt = torch.tensor(gamma, dtype=torch.float64, requires_grad=True)
    bt = torch.tensor(beta, dtype=torch.float64, requires_grad=True)
    rm, rv = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    y = F.batch_norm(xt, rm, rv, gt, bt, training=True, momentum=0.1, eps=1e-5)
    (y * torch.tensor(w, dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(np.concatenate(ys), y.detach().numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(running[0], rm.numpy(), rtol=1e-6)
    np.testing.assert_allclose(running[1], rv.numpy(), rtol=1e-5)
    scale = float(xt.grad.abs().max())
    np.testing.assert_allclose(np.concatenate(dxs), xt.grad.numpy(), rtol=0, atol=1e-4 * scale)
    np.testing.assert_allclose(dgammas, gt.grad.numpy(), rtol=1e-4)
    np.testing.assert_allclose(dbetas, bt.grad.numpy(), rtol=1e-5)


def _net(sync):
    bn = {"type": "batch_norm", "name": "bn", "bottom": "c1", "top": "bn", "momentum": 0.1}
    if sync is not None:
        bn["sync"] = sync
    return [{"type": "conv", "name": "c1", "bottom": "data", "top": "c1", "num_output": 4,
             "kernel": 3, "bias_term": False}, bn,  # (a bias before it gets no gradient)
            {"type": "fc", "name": "fc", "bottom": "bn", "top": "fc", "num_output": 10},
            {"type": "softmax_loss", "name": "loss", "bottom": ["fc", "label"], "top": "loss"}]


def _config(digits_h5, net, parallel, batch):
    return {"name": "syncbn", "seed": 3,
            "data": {"train": {"source": "hdf5", "path": digits_h5, "split": "train",
                               "batch_size": batch, "shuffle": False}},
            "net": net, "parallel": parallel,
            "solver": {"lr_policy": "fixed", "base_lr": 0.1, "momentum": 0.0,
                       "weight_decay": 0.0, "max_iter": 3, "test_interval": 0, "display": 1},
            "checkpoint": {"interval": 3}}


def _saved(out):
    with h5py.File(out / "latest.h5", "r") as f:
        params = {}
        f["params"].visititems(lambda k, v: params.__setitem__(k, v[()])
                               if isinstance(v, h5py.Dataset) else None)
    with open(out / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if r["phase"] == "train"]
    return params, losses


def _run(tmp_path, tag, n, cfg):
    out = tmp_path / tag
    path = write_config_file(tmp_path, cfg, f"{tag}.yaml")
    res = run_mpi_cli(n, "train", path, "--out", out) if n > 1 else \
        run_cli_args("train", path, "--out", out)
    assert res.returncode == 0, res.stderr[-2000:]
    return _saved(out)


@pytest.fixture(scope="module")
def one_rank(digits_h5, tmp_path_factory):
    """1 rank × 16 with sync (one rank: its own sums)."""
    return _run(tmp_path_factory.mktemp("whole"), "one", 1,
                _config(digits_h5, _net(True), {"scheme": "data"}, G))


@pytest.mark.mpi
@pytest.mark.parametrize("parallel", [{"scheme": "data"}, {"scheme": "sharded", "shard": 2}],
                         ids=["data", "sharded2"])
def test_two_ranks_train_as_one_rank_of_the_global_batch(one_rank, digits_h5, tmp_path,
                                                         parallel):
    """2 ranks × 8 with sync: every saved parameter and running statistic,
    and the loss rows, within 1e-5 relative of 1 rank × 16's. Before
    ``sync`` the key was refused (exit 2); without it the running variance
    lacks the spread of the ranks' means (asserted on scheme data)."""
    params, losses = _run(tmp_path, "two", 2, _config(digits_h5, _net(True), parallel, G // 2))
    want, want_losses = one_rank
    assert sorted(params) == sorted(want)
    for name in want:
        np.testing.assert_allclose(params[name], want[name], rtol=1e-5,
                                   atol=1e-5 * float(np.abs(want[name]).max()),
                                   err_msg=name)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    if parallel["scheme"] == "data":  # the case tells sync from the ranks' own statistics
        plain, _ = _run(tmp_path, "plain", 2, _config(digits_h5, _net(None), parallel, G // 2))
        gap = np.abs(plain["bn/running_var"] - want["bn/running_var"]).max()
        assert gap > 1e-4 * np.abs(want["bn/running_var"]).max()


@pytest.mark.parametrize("parallel, words", [
    ({"scheme": "none"}, "scheme none does not sum it"),
    ({"scheme": "tensor"}, "scheme tensor does not sum it"),
    ({"scheme": "data", "mode": "async"}, "parallel.mode 'async'"),
    ({"scheme": "data", "micro_batches": 2}, "parallel.micro_batches 2"),
    ({"scheme": "sharded", "stages": {"c1": 0, "fc": 1}},
     "scheme sharded with stages or tensor shards")])
def test_sync_where_no_scheme_sums_it_is_refused(parallel, words):
    """Exit 2 (a ConfigError) naming net[1].sync and why."""
    cfg = _config("/nonexistent.h5", _net(True), parallel, G)
    with pytest.raises(ConfigError) as exc:
        validate_config(cfg, "cfg.yaml", check_files=False)
    text = str(exc.value)
    assert "net[1].sync" in text and words in text, text
