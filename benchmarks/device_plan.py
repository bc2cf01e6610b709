#!/usr/bin/env python
"""``plan``'s device rows of a job on one GPU, counted offline on the
emulated device (tests/emulated_gpu: CuPy emulated on the host; no GPU
needed), optionally against the measured ``device_peak_bytes`` of one
iteration there.

    python benchmarks/device_plan.py jobs/cifar10_quick.yaml --batch 128 \\
        [--set precision=bf16 ...] [--conv im2col] [--measure] [--ops 5]

prints one JSON object per line: the job, the batch, each device row of
``tools/plan.offline_footprint`` (weights, gradients, optimizer state,
activations = the arena at its peak, scratch slots, cuBLAS workspaces,
capture pools), their total, the op where the arena peaks, the scratch
slots (bytes and the op that sizes each), and the ``--ops`` largest blobs
live at the peak; with ``--measure`` also ``bench``'s measured
``device_peak_bytes`` of one iteration on the emulated device (slow for
large nets: every kernel runs on the host).

The emulated device has no cuDNN frontend of a real size (its engines'
workspaces are a few KiB), so ``--conv im2col`` (the default here, as
tests/test_plan_device_total.py runs) counts the im2col path's scratch; on
a GPU with cuDNN the scratch slot is the largest chosen plan's workspace
(at most ``gpu.workspace_limit``) or the largest other scratch, whichever
is larger.
"""
import argparse
import json
import os
import pathlib
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def emulated(build_dir, conv):
    """CuPy emulated on the host and the stream dispatcher's runtime
    simulated, as tests/emulated_gpu/helpers.emulated_gpu_env sets them
    (a pytest MonkeyPatch, undone at exit)."""
    import pytest

    from tests.emulated_gpu.helpers import emulated_gpu_env
    mp = pytest.MonkeyPatch()
    os.environ["PURINE_CONV"] = conv
    emulated_gpu_env(mp, pathlib.Path(build_dir))
    return mp


def rows_of(path, batch, sets, measure, top):
    from purine_mpi.job.config import load_config
    from purine_mpi.runtime.footprint import live_bytes, live_spans, workspace_plans
    from purine_mpi.tools.plan import _footprint_of, _offline_graphs, save_metas
    from tests.conftest import make_job
    overrides = [f"data.train.batch_size={batch}", "device=0"]
    job = make_job(load_config(path, overrides=overrides + list(sets), check_files=False))
    graphs = _offline_graphs(job, 1, 0)
    fp = _footprint_of(job, graphs, 0, save_metas(job, 1, {0: graphs}))
    rows = dict(fp.devices[0])
    extras = fp.extras[0]
    out = {"job": os.path.relpath(path, REPO), "batch": batch, "set": list(sets),
           "rows": rows, "total": fp.device_total(0),
           "peak": fp.peak,
           "slots": [[b, ops[:3] + (["..."] if len(ops) > 3 else [])]
                     for b, ops in extras["slots"]],
           "scratch_ops": sorted(([n, b, note] for n, (b, note) in extras["ops"].items()),
                                 key=lambda r: -r[1])[:top],
           "cublas_handles": len(extras["cublas_handles"]),
           "peak_blobs": None}
    plan = workspace_plans(graphs, job.memory_plan).devices.get(0)
    if plan is not None and plan.offsets:
        # were each op's scratch a blob of the arena live while the op runs
        # (PyTorch's workspaces: allocated at the call, freed after), the
        # arena and the scratch slots would peak together at
        # max over the schedule of (live blobs + that op's scratch):
        # a bound the slots (held all along) cannot go below, fragmentation
        # aside
        live = live_bytes(plan)
        need = {n: b for n, (b, _) in extras["ops"].items()}
        both = [(lv + need.get(op, 0), op) for lv, op in zip(live, plan.order)]
        out["arena_and_scratch_as_transients"] = list(max(both))
    if top and plan is not None and fp.peak is not None:
        at = fp.peak["position"]
        live = [(plan.sizes[u], u) for u, (a, b) in live_spans(plan).items() if a <= at <= b]
        live.sort(reverse=True)
        out["peak_blobs"] = {"count": len(live), "largest": [[u, n] for n, u in live[:top]]}
    if measure:
        from purine_mpi.gpu import blas, import_cupy
        from purine_mpi.tools.bench import run_bench
        blas.reset()
        held = import_cupy().get_default_memory_pool().used_bytes()
        res = run_bench(job, iters=1, warmup=0)
        out["measured_device_peak_bytes"] = res["device_peak_bytes"]["0"] - held
        out["planned_vs_measured"] = round(out["total"] / out["measured_device_peak_bytes"], 4)
    return out


def torch_peak(path, batch, iters=3):
    """PyTorch's live tensor bytes at their peak over ``iters`` steps of
    benchmarks/gpu_throughput.py's eager PyTorch step (copy-in, zero_grad
    to None, forward, CrossEntropyLoss, backward, SGD-momentum with weight
    decay, foreach as on CUDA), counted without a GPU: the model on
    PyTorch's ``meta`` device under ``torch.distributed._tools.mem_tracker``
    (each storage once, while it lives), every storage rounded up to the
    CUDA caching allocator's 512-byte blocks, dropout as CUDA's fused kernel
    (``native_dropout``: a bool mask). What ``max_memory_allocated`` counts
    besides: cuBLAS's handle workspace (one stream) and the cuDNN
    workspaces its benchmark mode chooses (and tries, during the warm-up);
    neither exists here. Returns {category: bytes} at the peak and "Total"."""
    import math

    import torch
    import torch.nn.init as init
    from torch.distributed._tools import mem_tracker as mtm

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import gpu_throughput as gt

    def rounded(self):
        n = self.size * self.element_size
        return math.ceil(n / mtm._PYTORCH_MIN_ALLOCATE) * mtm._PYTORCH_MIN_ALLOCATE
    saved = [(mtm._WeakRefInfo, "_calculate_mem_consumed",
              mtm._WeakRefInfo._calculate_mem_consumed)]
    saved += [(init, name, getattr(init, name))
              for name in ("kaiming_uniform_", "uniform_", "normal_")]
    mtm._WeakRefInfo._calculate_mem_consumed = rounded
    for name in ("kaiming_uniform_", "uniform_", "normal_"):   # no values on meta
        setattr(init, name, lambda t, *a, **k: t)
    try:
        return _tracked_peak(torch, mtm, gt, path, batch, iters)
    finally:   # a PyTorch run in the same process initialises its weights again
        for owner, name, value in saved:
            setattr(owner, name, value)


def _tracked_peak(torch, mtm, gt, path, batch, iters):
    import yaml
    with open(path) as f:
        config = yaml.safe_load(f)
    config["data"]["train"]["batch_size"] = batch
    dev = torch.device("meta")
    with dev:
        model, criterion = gt.torch_net(config)
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.forward = (lambda p: lambda x: torch.native_dropout(x, p, True)[0])(m.p)
    s = config["solver"]
    opt = torch.optim.SGD(model.parameters(), lr=float(s["base_lr"]),
                          momentum=float(s.get("momentum", 0.0)),
                          weight_decay=float(s.get("weight_decay", 0.0)), foreach=True)
    spec = config["data"]["train"]
    x_host = torch.empty((batch,) + tuple(spec["shape"]))
    y_host = torch.zeros((batch,), dtype=torch.int64)
    tracker = mtm.MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        for _ in range(iters):
            x, y = x_host.to(dev), y_host.to(dev)
            opt.zero_grad(set_to_none=True)
            loss = criterion(model(x), y)
            loss.backward()
            opt.step()
            tracker.reset_mod_stats()
    snap = tracker.get_tracker_snapshot("peak")[dev]
    return {getattr(k, "value", str(k)): int(v) for k, v in snap.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--batch", type=int, nargs="+", default=[128])
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE, as train's --set")
    p.add_argument("--conv", choices=("im2col", "cudnn", "auto"), default="im2col")
    p.add_argument("--measure", action="store_true",
                   help="also run one iteration on the emulated device and read its peak")
    p.add_argument("--torch", action="store_true",
                   help="also PyTorch's live tensor peak of the same step (torch_peak)")
    p.add_argument("--ops", type=int, default=5, help="largest blobs at the peak to list")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="device_plan_") as build:
        mp = emulated(build, args.conv)
        try:
            for b in args.batch:
                out = rows_of(os.path.abspath(args.config), b, args.set, args.measure, args.ops)
                if args.torch:
                    out["torch_tensor_peak"] = torch_peak(os.path.abspath(args.config), b)
                print(json.dumps(out), flush=True)
        finally:
            mp.undo()


if __name__ == "__main__":
    main()
