"""Trust audit, part 2: the solver's features, one iteration from a
checkpoint to the next against ``torch.optim`` (tests/test_trust_step_oracle.py's
method), under the parallel schemes.

The net is a residual MLP block with a layer norm (fc0, ln, fc1, relu, fc2,
a residual sum, out, softmax_loss): under tensor parallelism fc1 and fc2
are split, and fc0, the layer norm, fc2's bias and out are held whole on
every shard.
Every parameter has its own ``lr_mult`` / ``decay_mult`` (docs/config.md,
"param"; biases with decay, the norm's bias at decay_mult 0), the loss has
an ``ignore_label`` whose counts differ between the ranks and micro-batches
and a ``loss_weight``, the solver clips the global norm (``clip_gradients``:
the norm of the reduced gradients of every parameter, each counted once,
before weight decay; it acts at every compared step) and its rate follows a
warm-up into a cosine (``warmup_iters`` 2, ``min_lr``), so the compared steps
cross the warm-up's end. From checkpoint k (weights, SGD's momentum or
Adam's moments, the iteration) torch takes one step on the documented batch
(docs/config.md, "Sample order") with per-parameter groups (lr = rate ·
lr_mult; weight_decay = weight_decay · decay_mult: L2 for SGD, decoupled
for AdamW) after ``clip_grad_norm_``'s scaling, and that is checkpoint
k+1 to float32 roundoff.

Found: a frozen parameter (``lr_mult: 0``, the pretrained trunk of a
fine-tuning) was counted in the clip's norm; Caffe computes no gradient
for it (``param_propagate_down`` false, its diff stays 0) and torch's
``clip_grad_norm_`` sees none (``requires_grad`` False), so the trainable
parameters' steps were scaled too small: with fc0 frozen, ln/weight's step
from checkpoint 1 to 2 was 0.0507 (relative) from torch's on 1 rank, under
tensor parallelism and sharded stage 2 (with fc2 frozen too: 0.114, 0.145
under tensor parallelism): graph/clip.py counted every update's gradient.

Found right: the clip under tensor parallelism (a weight held whole on
every shard counted once), pipeline stages, TP x pipeline, hybrid, sharded
stages 1-3 (with stages, with tensor shards), micro-batches and sync_ps
(and sync_ps over 2 servers, unclipped); per-parameter multipliers with
SGD's L2, Adam's L2 and AdamW's decoupled decay, also where a shard spans
parameters of several multipliers; the warm-up into the cosine at its
boundary; the ignored labels counted over micro-batches and replicas (a
shard with none counted), ``ignore_label_mean: shard``, ``loss_weight``
(two losses, each with its own ignore_label and weight, counted apart); a
resume on another layout.
"""
import math

import h5py
import numpy as np
import pytest
import torch
import yaml

from tests.conftest import FakeWorld, make_job, run_mpi_cli, train_here, write_config_file
from tests.test_micro_batches import _params
from tests.test_trust_step_oracle import adam_moments

IGNORE, CLASSES, FEAT, ITERS, CLIP, LOSS_WEIGHT = 3, 5, 6, 4, 0.3, 0.5
LAYERS = (("fc0", (2, 3), (0.5, 1)), ("ln", (0.5, 4), (1, 0)), ("fc1", (1, 0.5), (2, 3)),
          ("fc2", (1.5, 2), (1, 2)), ("out", (0.25, 1), (3, 0.5)))
NAMES = tuple(f"{layer}/{p}" for layer, _, _ in LAYERS for p in ("weight", "bias"))
STAGES = {"fc0": 0, "ln": 0, "fc1": 0, "act": 0, "fc2": 1, "res": 1, "out": 1, "loss": 1}


def _data(path, n, feat=FEAT):
    """``n`` samples of FEAT features, label IGNORE at about a third of
    them, irregularly (the ranks' and micro-batches' counts differ)."""
    rng = np.random.default_rng(11)
    label = rng.choice([0, 1, 2, 4], n)
    label[rng.random(n) < 0.35] = IGNORE
    window = n // ITERS  # iteration 2's second half all ignored: a shard counting none
    label[2 * window + window // 2:3 * window] = IGNORE
    with h5py.File(path, "w") as f:
        f["train/data"] = rng.standard_normal((n, feat, 1, 1)).astype(np.float32)
        f["train/label"] = label
    return str(path)


def _config(data, solver, parallel, batch, width=8, frozen=()):
    base = {"sgd": {"type": "sgd", "base_lr": 0.1, "momentum": 0.9, "weight_decay": 0.05},
            "adam": {"type": "adam", "base_lr": 0.02, "momentum": 0.8,
                     "momentum2": 0.95, "delta": 1e-4, "weight_decay": 0.1},
            "adamw": {"type": "adamw", "base_lr": 0.02, "momentum": 0.8,
                      "momentum2": 0.95, "delta": 1e-4, "weight_decay": 0.1}}[solver]
    net = []
    for layer, lr, decay in LAYERS:
        param = [{"lr_mult": 0 if layer in frozen else lr[i], "decay_mult": decay[i]}
                 for i in range(2)]
        if layer == "ln":
            net.append({"type": "layer_norm", "name": "ln", "bottom": "x", "top": "xn",
                        "param": param})
            continue
        bottom, top, n = {"fc0": ("data", "x", width), "fc1": ("xn", "h", 16),
                          "fc2": ("h", "m", width), "out": ("y", "logits", CLASSES)}[layer]
        net.append({"type": "fc", "name": layer, "bottom": bottom, "top": top,
                    "num_output": n, "param": param})
        if layer == "fc1":
            net.append({"type": "relu", "name": "act", "bottom": "h", "top": "h"})
        if layer == "fc2":
            net.append({"type": "eltwise", "name": "res", "bottom": ["xn", "m"], "top": "y"})
    net.append({"type": "softmax_loss", "name": "loss", "bottom": ["logits", "label"],
                "top": "loss", "ignore_label": IGNORE, "loss_weight": LOSS_WEIGHT})
    return {"name": "step_oracle2", "seed": 5,
            "data": {"train": {"source": "hdf5", "path": data, "split": "train",
                               "batch_size": batch, "shuffle": False}},
            "net": net,
            "solver": dict(base, lr_policy="cosine", warmup_iters=2, min_lr=0.1 * base["base_lr"],
                           max_iter=ITERS, clip_gradients=CLIP, display=0, test_interval=0),
            "checkpoint": {"interval": 1, "keep": ITERS},
            "parallel": parallel}


def rate_at(solver, k):
    """docs/config.md, "lr policies": cosine to min_lr, with warm-up."""
    base, low = solver["base_lr"], solver["min_lr"]
    rate = low + (base - low) * (1 + math.cos(math.pi * min(k, ITERS) / ITERS)) / 2
    w = solver["warmup_iters"]
    return rate * (k + 1) / w if k < w else rate


def _forward(w, x):
    p = dict(zip(NAMES, w))
    h = x @ p["fc0/weight"].T + p["fc0/bias"]
    xn = torch.nn.functional.layer_norm(h, (h.shape[1],), p["ln/weight"], p["ln/bias"], 1e-5)
    m = torch.relu(xn @ p["fc1/weight"].T + p["fc1/bias"]) @ p["fc2/weight"].T + p["fc2/bias"]
    return (xn + m) @ p["out/weight"].T + p["out/bias"]


def torch_step(before, config, k, groups):
    """The weights after one ``torch.optim`` step from checkpoint arrays
    ``before`` (iteration k): the loss the mean over ``groups`` (lists of
    the training file's rows: each its own mean over its counted positions,
    the parameter-server workers'; one group: the global batch's)."""
    solver = config["solver"]
    clip = solver.get("clip_gradients")
    mults = {f"{layer['name']}/{p}": (m["lr_mult"], m["decay_mult"])
             for layer in config["net"] for p, m in zip(("weight", "bias"), layer.get("param", []))}
    with h5py.File(config["data"]["train"]["path"], "r") as f:
        label = f["train/label"][()]
        data = f["train/data"][()].reshape(len(label), -1)
    # a frozen parameter (lr_mult 0) as a fine-tuning's in torch: requires_grad
    # False, no gradient, no optimizer state (the checkpoint holds none for it)
    w = [torch.tensor(before[f"params/{n}"], requires_grad=bool(mults[n][0])) for n in NAMES]
    trained = [(p, n) for p, n in zip(w, NAMES) if mults[n][0]]
    losses = [(layer["ignore_label"], layer.get("loss_weight", 1.0)) for layer in config["net"]
              if layer["type"] == "softmax_loss"]
    loss = sum(weight * torch.nn.functional.cross_entropy(  # Caffe's mean over at least 1
        _forward(w, torch.tensor(data[rows])), torch.tensor(label[rows]), ignore_index=ignore,
        reduction="sum") / max(1, int((label[rows] != ignore).sum()))
        for rows in groups for ignore, weight in losses) / len(groups)
    loss.backward()
    if clip:  # torch's frozen parameters (requires_grad False) and Caffe's (no diff) count not
        norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p, _ in trained)))
        assert norm > clip, f"the clip should act at step {k}: the norm is {norm:.4g}"
        for p, _ in trained:
            p.grad *= clip / norm
    rate = rate_at(solver, k)
    groups = [{"params": [p], "lr": rate * mults[n][0],
               "weight_decay": solver["weight_decay"] * mults[n][1]} for p, n in trained]
    if solver["type"] == "sgd":
        opt = torch.optim.SGD(groups, lr=rate, momentum=solver["momentum"])
        for p, n in trained:  # Caffe's v = rate x lr_mult x torch's buffer
            opt.state[p]["momentum_buffer"] = torch.tensor(
                before[f"solver/{n}/momentum"]) / (rate * mults[n][0])
    else:
        kind = torch.optim.AdamW if solver["type"] == "adamw" else torch.optim.Adam
        opt = kind(groups, lr=rate, betas=(solver["momentum"], solver["momentum2"]),
                   eps=solver["delta"])
        adam_moments(opt, *zip(*trained), before, k)
    opt.step()
    return {n: p.detach().numpy() for n, p in zip(NAMES, w)}


def _checkpoint(path):
    with h5py.File(path, "r") as f:
        it, config = int(f.attrs["iteration"]), yaml.safe_load(f.attrs["config"])
    return _params(path), it, config


def check_steps(out, window, rule="global", first=1, tol=1e-4):
    """Each checkpoint k -> k+1 (k from ``first``) of run ``out`` against
    ``torch_step`` on the global window of ``window`` samples per iteration,
    its groups as ``rule`` says (LAYOUTS): the largest error relative to
    the step's largest element, per parameter, below ``tol`` (float32
    roundoff: at most 2.7e-5 seen, AdamW under tensor parallelism).
    Returns the largest error."""
    worst = 0.0
    for k in range(first, ITERS):
        before, it, config = _checkpoint(out / f"ckpt_{k}.h5")
        after, it2, _ = _checkpoint(out / f"ckpt_{k + 1}.h5")
        assert (it, it2) == (k, k + 1)
        rows = np.arange(k * window, (k + 1) * window)
        groups = {"global": [rows], "workers": np.split(rows, 2), "rank0": [rows[:len(rows) // 2]],
                  "shards": np.split(rows, 4), "shards8": np.split(rows, 8)}
        ref = torch_step(before, config, k, groups[rule])
        for n in NAMES:
            step, want = after[f"params/{n}"] - before[f"params/{n}"], \
                ref[n] - before[f"params/{n}"]
            err = float(np.abs(step - want).max() / (np.abs(want).max() or 1))
            worst = max(worst, err)
            assert err < tol, (f"{out.name}: {n}'s step from checkpoint {k} to {k + 1} is "
                               f"{err:.3g} (relative) from torch.optim's")
    return worst


def _run(tmp_path, ranks, cfg, *more):
    tmp_path.mkdir(exist_ok=True)
    if ranks == 1:
        train_here(cfg, tmp_path / "run", resume=more[1] if more else None)
    else:
        res = run_mpi_cli(ranks, "train", write_config_file(tmp_path, cfg), "--out",
                          tmp_path / "run", *more)
        assert res.returncode == 0, res.stdout + res.stderr
    return tmp_path / "run"


#: id: (ranks, solver, parallel, batch per rank, replicas, the batch torch
#: takes: the global window, each of the 2 parameter-server workers' own
#: mean, rank 0's own (scheme none), or the mean of the shards' own means
#: (``ignore_label_mean: shard``, 4 or 8 shards)). Ids starting with
#: ``frozen`` freeze fc0 (lr_mult 0; under tensor parallelism held whole on
#: both shards). CI runs CORE; the whole table (about 2 minutes on 2 cores)
#: with PURINE_LONG_TESTS=1.
LAYOUTS = {
    "frozen_one": (1, "sgd", {}, 8, 1, "global"),
    "frozen_tensor": (2, "sgd", {"scheme": "tensor", "tensor_parallel": 2}, 8, 1, "global"),
    "tensor_pipeline": (4, "sgd", {"scheme": "pipeline", "stages": STAGES,
                                   "tensor_parallel": 2}, 8, 1, "global"),
    "hybrid_micro": (4, "adamw", {"scheme": "hybrid", "stages": STAGES, "micro_batches": 2},
                     4, 2, "global"),
    "frozen_sharded2": (2, "sgd", {"scheme": "sharded", "shard": 2}, 4, 2, "global"),
    "sync_ps": (3, "sgd", {"scheme": "data", "mode": "sync_ps"}, 4, 2, "workers"),
    # the rest of the audit
    "one": (1, "sgd", {}, 8, 1, "global"),
    "data_micro": (2, "sgd", {"scheme": "data", "micro_batches": 2}, 4, 2, "global"),
    "tensor": (2, "sgd", {"scheme": "tensor", "tensor_parallel": 2}, 8, 1, "global"),
    "frozen_tensor_adamw": (2, "adamw", {"scheme": "tensor", "tensor_parallel": 2}, 8, 1,
                            "global"),
    "tensor_replicas": (4, "adamw", {"scheme": "tensor", "tensor_parallel": 2}, 4, 2, "global"),
    "pipeline_micro": (2, "adamw", {"scheme": "pipeline", "stages": STAGES,
                                    "micro_batches": 2}, 8, 1, "global"),
    "hybrid": (4, "adamw", {"scheme": "hybrid", "stages": STAGES}, 4, 2, "global"),
    "hybrid_micro_sgd": (4, "sgd", {"scheme": "hybrid", "stages": STAGES, "micro_batches": 2},
                         4, 2, "global"),
    "sharded1": (2, "sgd", {"scheme": "sharded", "shard": 1}, 4, 2, "global"),
    "sharded2": (2, "sgd", {"scheme": "sharded", "shard": 2}, 4, 2, "global"),
    "sharded3": (2, "adamw", {"scheme": "sharded", "shard": 3}, 4, 2, "global"),
    "frozen_sharded3": (2, "adamw", {"scheme": "sharded", "shard": 3}, 4, 2, "global"),
    "sharded2_micro": (2, "adamw", {"scheme": "sharded", "shard": 2, "micro_batches": 2}, 4, 2,
                       "global"),
    "sharded2_tensor": (4, "sgd", {"scheme": "sharded", "shard": 2, "tensor_parallel": 2}, 4, 2,
                        "global"),
    "sharded3_stages": (4, "sgd", {"scheme": "sharded", "shard": 3, "stages": STAGES}, 4, 2,
                        "global"),
    "sharded1_tensor_stages": (4, "adamw", {"scheme": "sharded", "shard": 1, "stages": STAGES,
                                            "tensor_parallel": 2}, 8, 1, "global"),
    "frozen_sync_ps": (3, "sgd", {"scheme": "data", "mode": "sync_ps"}, 4, 2, "workers"),
    # 2 servers (no clip: it needs one), each updating its parameters
    "sync_ps2": (4, "sgd", {"scheme": "data", "mode": "sync_ps", "ps_ranks": 2}, 4, 2,
                 "workers"),
    "none_micro": (2, "sgd", {"scheme": "none", "micro_batches": 2}, 4, 2, "rank0"),
    "adam_data": (2, "adam", {"scheme": "data"}, 4, 2, "global"),
    "one_sided": (2, "sgd", {"scheme": "data", "transport": "one_sided"}, 4, 2, "global"),
    "no_defer": (2, "adamw", {"scheme": "data", "defer_update": False}, 4, 2, "global"),
    # fc0's 512 x 600 weight (1.2 MB) reduced and updated in 5 row chunks
    "split_rows": (2, "sgd", {"scheme": "data", "bucket_mb": 0.25}, 4, 2, "global"),
    "two_losses_data_micro": (2, "sgd", {"scheme": "data", "micro_batches": 2}, 4, 2,
                              "global"),
    "two_losses_hybrid": (4, "adamw", {"scheme": "hybrid", "stages": dict(STAGES, loss2=1),
                                       "micro_batches": 2}, 4, 2, "global"),
    "two_losses_shard_mean": (2, "sgd", {"scheme": "data", "micro_batches": 2,
                                         "ignore_label_mean": "shard"}, 4, 2, "shards"),
    "shard_mean_data": (2, "sgd", {"scheme": "data", "micro_batches": 2,
                                   "ignore_label_mean": "shard"}, 4, 2, "shards"),
    "shard_mean_hybrid": (4, "sgd", {"scheme": "hybrid", "stages": STAGES, "micro_batches": 2,
                                     "ignore_label_mean": "shard"}, 4, 2, "shards"),
    "shard_mean_sharded": (4, "adamw", {"scheme": "sharded", "shard": 1, "micro_batches": 2,
                                        "ignore_label_mean": "shard"}, 4, 4, "shards8"),
}
CORE = ("frozen_one", "frozen_tensor", "tensor_pipeline", "hybrid_micro", "frozen_sharded2",
        "sync_ps")


def _marks(layout):
    ranks = LAYOUTS[layout][0]
    return ([pytest.mark.mpi] if ranks > 1 else []) + \
        ([] if layout in CORE else [pytest.mark.slow, pytest.mark.long])


@pytest.mark.parametrize("layout", [pytest.param(k, marks=_marks(k)) for k in LAYOUTS])
def test_each_checkpoint_is_one_torch_step(tmp_path, layout):
    """The layout's run, from checkpoint 1 to 4: each step torch's. CORE:
    1 rank; tensor parallelism (fc0 whole on both shards and frozen, the
    layer norm, fc2's and out's biases whole and counted once); 2 stages x
    2 tensor shards (the norm over all 4 ranks); hybrid's 2 replicas x 2
    stages x 2 micro-batches (the ignored labels counted over the 4 shards
    of the global batch, one of them all ignored at iteration 2); sharded
    stage 2 (a shard spanning parameters of several multipliers, a frozen
    one among them); sync_ps's server (each worker's own mean)."""
    ranks, solver, parallel, batch, replicas, rule = LAYOUTS[layout]
    window = replicas * batch
    wide = layout == "split_rows"
    cfg = _config(_data(tmp_path / "d.h5", window * ITERS, 600 if wide else FEAT), solver,
                  parallel, batch, 512 if wide else 8,
                  frozen=("fc0",) if layout.startswith("frozen") else ())
    if layout == "sync_ps2":
        cfg["solver"]["clip_gradients"] = None
    if layout.startswith("two_losses"):  # a second loss with its own ignore_label and weight
        cfg["net"].append(dict(cfg["net"][-1], name="loss2", top="loss2", ignore_label=4,
                               loss_weight=0.25))
    out = _run(tmp_path, ranks, cfg)
    print(layout, check_steps(out, window, rule))


def test_after_a_resume_on_another_layout(tmp_path):
    """AdamW on 1 rank, resumed from its checkpoint 1 (the warm-up's last
    step next) on 2 ranks of scheme sharded stage 3, whose checkpoint 2 is
    resumed on 1 rank again: every step after each resume is torch's from
    the checkpoint resumed (the rate the policy gives the global
    iteration, Adam's step count continued)."""
    import shutil
    data = _data(tmp_path / "d.h5", 8 * ITERS)
    one = _run(tmp_path / "a", 1, _config(data, "adamw", {}, 8))
    cfg = _config(data, "adamw", {"scheme": "sharded", "shard": 3}, 4)
    two = _run(tmp_path / "b", 2, cfg, "--resume", one / "ckpt_1.h5")
    shutil.copy(one / "ckpt_1.h5", two / "ckpt_1.h5")
    print("to sharded3", check_steps(two, 8, first=1))
    back = _run(tmp_path / "c", 1, _config(data, "adamw", {}, 8), "--resume", two / "ckpt_2.h5")
    shutil.copy(two / "ckpt_2.h5", back / "ckpt_2.h5")
    print("back to one", check_steps(back, 8, first=2))


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("solver, precision", [("sgd", None), ("adamw", None), ("sgd", "fp16")])
def test_on_the_emulated_device(host_build_dir, monkeypatch, tmp_path, solver, precision):
    """``device: 0`` on the emulated GPU (the CUDA kernels compiled for the
    host): the updates fused into one multi-tensor op, each parameter with
    its own multipliers, the clip's norm and scale and the lr policy on the
    device; fp16 (loss scaling: the gradients unscaled before the clip)
    within its roundoff (5e-3 of the step)."""
    from purine_mpi.train.trainer import Trainer, run_and_report
    from tests.emulated_gpu import emulated_trainer_env
    emulated_trainer_env(monkeypatch, host_build_dir)
    cfg = _config(_data(tmp_path / "d.h5", 8 * ITERS), solver, {}, 8, frozen=("fc0",))
    cfg.update(device=0, cuda_graph=False)
    if precision:
        cfg.update(precision=precision, loss_scale={"init_scale": 1024.0})
    trainer = Trainer(make_job(cfg), str(tmp_path / "run"), world=FakeWorld(),
                      log=lambda line: None)
    assert run_and_report(trainer, FakeWorld()) == 0
    ops = {op.op_type for op in trainer.graphs.graph.ops.values()}
    assert {"GradNormSq", "ClipScale", "MultiSGDUpdate" if solver == "sgd"
            else "MultiAdamUpdate"} <= ops, sorted(ops)
    print(solver, precision, check_steps(tmp_path / "run", 8, tol=5e-3 if precision else 1e-4))


def test_a_tied_weight_takes_its_owners_multipliers(tmp_path):
    """A tied head's ``param`` entry 0 is the shared table's: its owner's
    multipliers, or exit 2 naming the entry (Caffe: "Shared param has
    mismatched lr_mult"). Before, ``lr_mult: 0`` there was taken silently
    and the table trained at the embedding's lr_mult 1."""
    from purine_mpi.base.errors import ConfigError
    from purine_mpi.job.replica import build_train_graph
    from tests.gpt_nets import gpt_config, text_h5
    cfg = gpt_config(text_h5(tmp_path), layers=1)
    head = next(layer for layer in cfg["net"] if layer.get("tie_weight"))
    cfg["net"][0]["param"] = [{"lr_mult": 0.5, "decay_mult": 0}]
    head["param"] = [{"lr_mult": 0.5, "decay_mult": 0.0}]  # the owner's: taken
    graph, _ = build_train_graph(make_job(cfg))
    assert graph.blobs["wte/weight"].attrs["lr_mult"] == 0.5
    for key, value in (("lr_mult", 0), ("decay_mult", 1)):
        head["param"] = [{key: value}]
        with pytest.raises(ConfigError, match=rf"net\[{cfg['net'].index(head)}\]\.param\[0\]"
                                              rf"\.{key}'.*layer 'wte'"):
            build_train_graph(make_job(cfg))
