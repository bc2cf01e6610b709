"""A ``batch_norm`` with ``sync: true`` (PyTorch's ``SyncBatchNorm``): its
statistics and the two sums its gradient takes are those of the global
batch, summed over the replicas by Allreduce ops in the graph.

- The kernels: a batch split in two, each half's sums added (what the
  Allreduce does), give PyTorch's BatchNorm2d of the whole batch: outputs,
  running statistics, dx, and dgamma / dbeta as the sum of the halves'.
- 2 replicas × 8 under schemes data, sharded (stage 2) and hybrid (2
  stages each, 4 ranks): the checkpoints of 3 SGD iterations (digits, a 3×3 ``conv`` into ``batch_norm``, an ``fc``)
  are those of 1 rank × 16 (every weight, γ, β and the running statistics),
  and so are the loss rows; without ``sync`` the running variance is not.
- Each checkpoint's step against PyTorch's (float64, ``torch_sync_step``:
  DDP with SyncBatchNorm and gradient accumulation, statistics per forward
  call) with micro-batches, sharded with stages, tensor shards (tensor,
  hybrid) and pipeline.
- ``sync: true`` where no scheme sums it (scheme none, the
  parameter-server modes): exit 2, one line naming the key.
"""
import glob
import json

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from purine_mpi.base.backend import to_numpy
from purine_mpi.base.errors import ConfigError
from purine_mpi.graph.core import Op
from purine_mpi.job.config import validate_config
from purine_mpi.ops.catalog import get_kernel_class
from tests.conftest import run_mpi_cli, train_here, write_config_file
from tests.emulated_gpu import compare, emulated_trainer_env, tiny_raw
from tests.emulated_gpu.fixtures import device  # noqa: F401  (a fixture)

G = 16  # the global batch


def _kernel(op_type, ins, outs, attrs=None):
    """Run op ``op_type`` on arrays ``ins``, writing ``outs`` (arrays)."""
    get_kernel_class(op_type)(Op("probe", op_type, [], [], attrs or {})).run(list(ins),
                                                                            list(outs))
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


def _saved(out, name=None):
    """(params of ``out``'s latest.h5, its loss rows); of ``name``: the params."""
    with h5py.File(out / (name or "latest.h5"), "r") as f:
        params = {}
        f["params"].visititems(lambda k, v: params.__setitem__(k, v[()])
                               if isinstance(v, h5py.Dataset) else None)
    if name:
        return params
    with open(out / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if r["phase"] == "train"]
    return params, losses


def _run(tmp_path, tag, n, cfg):
    out = tmp_path / tag
    if n == 1:  # in this process (conftest.train_here)
        train_here(cfg, out)
        return _saved(out)
    res = run_mpi_cli(n, "train", write_config_file(tmp_path, cfg, f"{tag}.yaml"), "--out", out)
    assert res.returncode == 0, res.stderr[-2000:]
    return _saved(out)


@pytest.fixture(scope="module")
def one_rank(digits_h5, tmp_path_factory):
    """1 rank × 16 with sync (one rank: its own sums)."""
    return _run(tmp_path_factory.mktemp("whole"), "one", 1,
                _config(digits_h5, _net(True), {"scheme": "data"}, G))


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, parallel", [
    (2, {"scheme": "data"}), (2, {"scheme": "sharded", "shard": 2}),
    (4, {"scheme": "hybrid", "stages": {"c1": 0, "bn": 1, "fc": 1, "loss": 1}}),
    (2, {"scheme": "data", "transport": "one_sided"})],
    ids=["data", "sharded2", "hybrid", "data-one_sided"])
def test_two_replicas_train_as_one_rank_of_the_global_batch(one_rank, digits_h5, tmp_path,
                                                            ranks, parallel):
    """2 replicas × 8 with sync (2 ranks; hybrid: 2 stages each, the batch
    norm on the second): every saved parameter and running statistic, and
    the loss rows, within 1e-5 relative of 1 rank × 16's. Before ``sync``
    the key was refused (exit 2); with the layer's sums but no Allreduce
    (data's ``sum_over_replicas`` taken out) ``bn/bias`` is off by 2.1
    relative after 3 iterations; without ``sync`` the running variance lacks
    the spread of the ranks' means (asserted on scheme data). With
    ``transport: one_sided`` the buckets still go through the shared window
    (the float64 sums through MPI; before, they sent every bucket to MPI)."""
    params, losses = _run(tmp_path, "two", ranks,
                          _config(digits_h5, _net(True), parallel, G // 2))
    want, want_losses = one_rank
    assert sorted(params) == sorted(want)
    for name in want:
        np.testing.assert_allclose(params[name], want[name], rtol=1e-5,
                                   atol=1e-5 * float(np.abs(want[name]).max()),
                                   err_msg=name)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    if "transport" in parallel:
        log = "".join(open(p).read() for p in glob.glob(str(tmp_path / "two" / "*.log")))
        assert "summed through a shared window" in log, log[-2000:]
    elif parallel["scheme"] == "data":  # the case tells sync from the ranks' own statistics
        plain, _ = _run(tmp_path, "plain", 2, _config(digits_h5, _net(None), parallel, G // 2))
        gap = np.abs(plain["bn/running_var"] - want["bn/running_var"]).max()
        assert gap > 1e-4 * np.abs(want["bn/running_var"]).max()


def _mlp(sync):
    """``_net`` with a tensor-parallel pair after the batch norm (fc1 split
    by columns, fc by rows): the batch norm outside the split, each shard
    of a group holding the same batch."""
    conv, bn, fc, loss = _net(sync)
    return [conv, bn, {"type": "fc", "name": "fc1", "bottom": "bn", "top": "h",
                       "num_output": 16},
            {"type": "relu", "name": "act", "bottom": "h", "top": "h"},
            dict(fc, bottom="h"), loss]


def torch_sync_step(before, data, k, replicas, batch, micro):
    """Checkpoint ``before``'s weights and running statistics after one SGD
    step (lr 0.1) of iteration ``k`` as PyTorch's DDP with ``SyncBatchNorm``
    and gradient accumulation takes it: ``replicas`` ranks of ``batch``
    samples ("Sample order"), each forward call a micro-batch of batch /
    ``micro``, its statistics those of the replicas' micro-batch together
    (SyncBatchNorm syncs per forward call), the running statistics updated
    per call; the loss the mean of the micro-batches' means. In float64."""
    p = {n: torch.tensor(v, dtype=torch.float64, requires_grad="running" not in n)
         for n, v in before.items()}
    rm, rv = p["bn/running_mean"].detach().clone(), p["bn/running_var"].detach().clone()
    xs, ys = data
    part, loss = batch // micro, 0
    for j in range(micro):
        rows = np.concatenate([np.arange(k * replicas * batch + r * batch + j * part,
                                         k * replicas * batch + r * batch + (j + 1) * part)
                               for r in range(replicas)])
        h = F.conv2d(torch.tensor(xs[rows], dtype=torch.float64), p["c1/weight"])
        h = F.batch_norm(h, rm, rv, p["bn/weight"], p["bn/bias"], training=True,
                         momentum=0.1, eps=1e-5).reshape(len(rows), -1)
        if "fc1/weight" in p:
            h = torch.relu(h @ p["fc1/weight"].T + p["fc1/bias"])
        out = h @ p["fc/weight"].T + p["fc/bias"]
        loss = loss + F.cross_entropy(out, torch.tensor(ys[rows], dtype=torch.long)) / micro
    loss.backward()
    after = {n: (v - 0.1 * v.grad).detach().numpy() for n, v in p.items() if v.requires_grad}
    after.update({"bn/running_mean": rm.numpy(), "bn/running_var": rv.numpy()})
    return after


MLP_STAGES = {"c1": 0, "bn": 1, "fc1": 1, "act": 1, "fc": 1, "loss": 1}


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, net, parallel", [
    (2, _net, {"scheme": "data", "micro_batches": 2}),
    (4, _net, {"scheme": "sharded", "shard": 3, "micro_batches": 2, "schedule": "gpipe",
               "stages": {"c1": 0, "bn": 0, "fc": 1, "loss": 1}}),
    (4, _mlp, {"scheme": "tensor", "tensor_parallel": 2}),
    (8, _mlp, {"scheme": "hybrid", "tensor_parallel": 2, "micro_batches": 2,
               "stages": MLP_STAGES}),
    (2, _net, {"scheme": "pipeline", "micro_batches": 2,
               "stages": {"c1": 0, "bn": 1, "fc": 1, "loss": 1}})],
    ids=["data-micro2", "sharded3-stages-micro2", "tensor2x2", "hybrid-tensor-micro2",
         "pipeline-micro2"])
def test_each_step_is_pytorch_s_sync_batch_norm(digits_h5, tmp_path, ranks, net, parallel):
    """2 replicas × 8 (tensor: × 2 shards; hybrid: × 2 stages × 2 shards,
    the batch norm on the split pair's stage; pipeline: 1 replica × 16),
    checkpoints at 1, 2, 3: each step is ``torch_sync_step``'s within 2e-5
    relative (weights, γ, β, running statistics). With micro-batches each
    forward call's statistics are the replicas' micro-batch's: not 1 rank
    × 16 × 2 micro-batches' (other samples) nor the global batch's (the
    running variance 0.9 relative off). With tensor shards the sums are
    over the replicas alone (over the whole world the running variance is
    4.8e-4 off); under hybrid they are numbered among the stage's tensor
    allreduces (numbered after them, the run hung: 'op c1.grad@mb0.wait
    (WaitWrite ...)' stalled). Before, all five were refused (exit 2
    naming net[1].sync)."""
    replicas = 1 if parallel["scheme"] == "pipeline" else 2
    cfg = _config(digits_h5, net(True), parallel, G // replicas)
    cfg["checkpoint"] = {"interval": 1}
    out = tmp_path / "run"
    res = run_mpi_cli(ranks, "train", write_config_file(tmp_path, cfg), "--out", out)
    assert res.returncode == 0, res.stderr[-2000:]
    with h5py.File(digits_h5, "r") as f:
        data = f["train/data"][()], f["train/label"][()]
    for k in (1, 2):
        before = _saved(out, f"ckpt_{k}.h5")
        after = _saved(out, f"ckpt_{k + 1}.h5")
        want = torch_sync_step(before, data, k, replicas, G // replicas,
                               parallel.get("micro_batches", 1))
        assert sorted(want) == sorted(after)
        for name, value in want.items():
            step, ref = after[name] - before[name], value - before[name]
            err = float(np.abs(step - ref).max() / np.abs(ref).max())
            assert err < 2e-5, f"{name}'s step {k} -> {k + 1}: {err:.3g} relative from torch's"


def test_defer_update_defers_the_end_of_the_iteration_alone(digits_h5):
    """Offline, scheme data on 2 ranks with ``defer_update`` (the default):
    the batch norm's Allreduces start no deferred tail, so the tail is the
    buckets and the updates as without ``sync``, and the memory plan keeps
    no activation of the passes for it. Before: the tail held the forward
    after the sums ('bn.fwd', 'fc.fwd', 'loss.fwd', ...: 21 ops, not 9) and
    the plan kept 15 roots ('c1', 'fc', 'loss.prob', ...) out of the arena."""
    from purine_mpi.ops.catalog import make_kernel
    from purine_mpi.runtime.memory_plan import plan_memory
    from purine_mpi.runtime.tail import deferred_tail
    from purine_mpi.tools.graph import composed
    from tests.conftest import make_job
    tails = []
    for sync in (None, True):
        g, _ = composed(make_job(_config(digits_h5, _net(sync), {"scheme": "data"}, G // 2)),
                        2, 0)
        tail, _ = deferred_tail(g, {n: make_kernel(op) for n, op in g.ops.items()})
        tails.append(tail)
        kept = [root for root, why in plan_memory(g).persistent.items() if "tail" in why]
        assert kept == [], (sync, kept)
    assert tails[0] and tails[1] == tails[0], sorted(tails[1])


@pytest.mark.parametrize("per_host", [None, "1"], ids=["shared", "rma"])
def test_sharded3_windows_number_the_sums_among_the_barriers(digits_h5, monkeypatch,
                                                            per_host):
    """Offline, 2 ranks at shard 3 with ``transport: one_sided`` (one node:
    a shared window; a host per rank: RMA Gets): the batch norm's two
    Allreduces keep their own ``seq`` when the gathers become WindowSyncs,
    and both ranks post one order (check_collectives' signature). Before:
    "communication ops 'weight_bucket2.acquire' and
    'bn.bwd.batch_norm_grad_stats.allreduce' share seq 8" (the windows
    renumbered the plan without the sums)."""
    from purine_mpi.comm.verify import comm_signature, compare_signatures
    from purine_mpi.tools.graph import composed
    from tests.conftest import make_job
    if per_host:
        monkeypatch.setenv("PURINE_RANKS_PER_HOST", per_host)
    job = make_job(_config(digits_h5, _net(True), {"scheme": "sharded", "shard": 3,
                                                   "transport": "one_sided"}, G // 2))
    signatures = []
    for rank in range(2):
        g, comp = composed(job, 2, rank)
        kinds = {op.op_type for op in g.ops.values()}
        assert "WindowSync" in kinds and "Allgather" not in kinds
        assert ("GetShards" in kinds) == bool(per_host)
        assert sum(op.op_type == "Allreduce" and "bucket" not in op.attrs
                   for op in g.ops.values()) == 2
        signatures.append(comm_signature(g))
    assert compare_signatures(signatures) == []


REFUSED = [
    ({"scheme": "none"}, "scheme none does not sum it (its replicas train apart"),
    ({"scheme": "data", "mode": "async"}, "parallel.mode 'async'"),
    ({"scheme": "data", "mode": "sync_ps"}, "parallel.mode 'sync_ps'")]


@pytest.mark.parametrize("parallel, words", REFUSED)
def test_sync_where_no_scheme_sums_it_is_refused(parallel, words):
    """Exit 2 (a ConfigError) naming net[1].sync and why. Built, no longer
    refused: micro-batches, sharded with stages, tensor shards under
    schemes tensor, sharded and hybrid, pipeline (one replica: its own
    sums) (test_each_step_is_pytorch_s_sync_batch_norm)."""
    cfg = _config("/nonexistent.h5", _net(True), parallel, G)
    with pytest.raises(ConfigError) as exc:
        validate_config(cfg, "cfg.yaml", check_files=False)
    text = str(exc.value)
    assert "net[1].sync" in text and words in text, text


@pytest.mark.parametrize("parallel, key", [
    (REFUSED[0][0], "net[1].sync"), (REFUSED[1][0], "net[1].sync"),
    ({"scheme": "sharded", "stages": 1}, "parallel.stages")])
def test_a_refusal_is_one_line_and_exit_2(digits_h5, tmp_path, parallel, key):
    """``train`` itself: exit 2, one line naming the file and the key. With
    ``stages: 1`` under scheme sharded the stages rule speaks (before, the
    sync rule named it "sharded with stages", though one stage is none)."""
    from tests.conftest import run_cli_here
    path = write_config_file(tmp_path, _config(digits_h5, _net(True), parallel, G))
    res = run_cli_here("train", path, "--out", tmp_path / "run")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    # the file, the line where the key is written, the key
    import re
    found = re.match(rf"error: {re.escape(str(path))}:(\d+): key '{re.escape(key)}'", lines[0])
    assert found, lines[0]
    written = open(path).read().splitlines()[int(found.group(1)) - 1]
    assert key.rsplit(".", 1)[-1] in written, (written, lines[0])


@pytest.mark.parametrize("parallel, words", [
    ({"scheme": "data", "mode": "async"}, "parallel.mode 'async'"),
    ({"scheme": "none"}, "scheme none does not sum it")])
def test_a_graph_s_replica_sum_where_no_scheme_sums_it_is_refused(digits_h5, parallel, words):
    """A ``graph:`` (the seed of the sync net, its BatchNormStats with attr
    sum_over_replicas) where no scheme sums it: exit 2 naming the op's
    attr, as the net's ``sync``; under scheme data it builds. Before, it
    ran with each rank's own statistics."""
    import yaml
    from purine_mpi.graph import seed_yaml
    from purine_mpi.job.replica import build_train_graph
    from tests.conftest import make_job
    seed, _ = build_train_graph(make_job(_config(digits_h5, _net(True), {"scheme": "data"}, G)))
    cfg = _config(digits_h5, None, {"scheme": "data"}, G)
    del cfg["net"]
    cfg["graph"] = yaml.safe_load(yaml.safe_dump(seed_yaml.dump(seed), sort_keys=False))
    stats = next(i for i, e in enumerate(cfg["graph"]) if e.get("op_type") == "BatchNormStats")
    validate_config(cfg, "cfg.yaml", check_files=False)
    with pytest.raises(ConfigError) as exc:
        validate_config(dict(cfg, parallel=parallel), "cfg.yaml", check_files=False)
    text = str(exc.value)
    assert f"graph.{stats}.attrs.sum_over_replicas" in text and words in text, text


def test_the_synchronised_kernels_on_the_emulated_device(device):
    """The four kernels' GPU branch (the raw channel sums, float64 sums on
    the device) against their CPU run."""
    rng = np.random.default_rng(7)
    C = 3
    x = (rng.standard_normal((4, C, 3, 3)) * 0.5 + 5).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    gamma, beta = rng.uniform(0.5, 2, C).astype(np.float32), np.zeros(C, np.float32)
    (sums,), _ = compare(device, "BatchNormStats", {}, [x], ["channel_sum"], np.float32)
    sums = sums * 2  # as two ranks' alike
    rm, rv = np.zeros(C, np.float32), np.ones(C, np.float32)
    (_, mean, invstd, _, _), _ = compare(device, "BatchNorm", {"phase": "train"},
                                         [x, gamma, beta, rm, rv, sums], [], np.float32)
    (gsums,), _ = compare(device, "BatchNormGradStats", {}, [dy, x, mean, invstd],
                          ["channel_sum"], np.float32)
    compare(device, "BatchNormGrad", {"phase": "train"}, [dy, x, gamma, mean, invstd, gsums * 2],
            ["channel_sum"], np.float32)


def _device_run(tmp_path, out, sync):
    """3 iterations on the emulated GPU, the iteration captured as one CUDA
    graph: (params, loss rows)."""
    from purine_mpi.train.trainer import Trainer
    from tests.conftest import FakeWorld, make_job
    raw = tiny_raw(device=0, cuda_graph=True)
    raw["net"] = [dict(_net(sync)[0], bottom="data", pad=1), dict(_net(sync)[1]),
                  {"type": "relu", "name": "relu", "bottom": "bn", "top": "bn"},
                  *_net(sync)[2:]]
    raw["solver"].update(max_iter=3, display=1)
    config = validate_config(raw, check_files=False)
    trainer = Trainer(make_job(config), str(tmp_path / out), world=FakeWorld(), log=lambda m: None)
    try:
        trainer.run()
        params = {p: np.array(to_numpy(trainer.ws[p])) for p in trainer.graphs.params}
        report = trainer.train.capture_report()
        assert report["captured"] == report["segments"] >= 1 and report["failed"] == {}, report
    finally:
        trainer.close()
    with open(tmp_path / out / "metrics.jsonl") as f:
        return params, [r["loss"] for r in map(json.loads, f) if r["phase"] == "train"]


def test_one_rank_on_the_emulated_gpu_trains_as_without_sync(host_build_dir, monkeypatch,
                                                              tmp_path):
    """The trainer's GPU path (placement, the memory plan, a whole-iteration
    CUDA graph) with ``sync: true`` on one rank, whose sums are its own:
    the plain batch norm's parameters, running statistics and losses."""
    import purine_mpi.gpu as gpu
    emulated_trainer_env(monkeypatch, host_build_dir)
    try:
        synced, plain = _device_run(tmp_path, "sync", True), _device_run(tmp_path, "plain", None)
    finally:
        gpu.clear_kernel_cache()
    for name, value in plain[0].items():
        np.testing.assert_allclose(synced[0][name], value, rtol=1e-5,
                                   atol=1e-6 * float(np.abs(value).max()), err_msg=name)
    np.testing.assert_allclose(synced[1], plain[1], rtol=1e-5)


@pytest.mark.mpi
def test_two_emulated_gpus_train_as_the_cpu(host_build_dir, tmp_path):
    """2 ranks on emulated GPUs (captured iterations; the sums staged through
    the host to MPI, or an NcclAllreduce of float64 on the emulated NCCL;
    tests/mpi_scripts/sync_bn_gpu.py): the checkpoints are the CPU run's
    within float32 rounding."""
    from tests.mpi_scripts.launch import run_mpi
    proc, _ = run_mpi("sync_bn_gpu.py", 2, host_build_dir, tmp_path, timeout=240)
    assert proc.stdout.count("OK sync_bn_gpu") == 2, proc.stdout + proc.stderr
    cpu = _saved(tmp_path / "cpu")[0]
    assert "bn/running_var" in cpu
    for run in ("gpu", "nccl"):
        got = _saved(tmp_path / run)[0]
        assert sorted(got) == sorted(cpu)
        for name, value in cpu.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5,
                                       atol=1e-5 * float(np.abs(value).max()),
                                       err_msg=f"{run}: {name}")
