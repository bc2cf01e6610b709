#!/usr/bin/env python
"""Training throughput on one GPU: purine_mpi (CuPy, cuDNN, the CUDA-stream
dispatcher) against the same net in PyTorch on the same GPU, three ways.

    python benchmarks/gpu_throughput.py \\
        [--configs jobs/cifar10_quick.yaml jobs/nin_cifar10.yaml] \\
        [--batches 128 512] [--iters 50] [--warmup 5] [--device 0] [--tf32] \\
        [--modes eager graph] [--no-torch] [--no-compile] [--profile-iters 5]
    python benchmarks/gpu_throughput.py --dry-run      # CPU smoke run, no figures

For each config and batch size: ``--warmup`` untimed then ``--iters`` timed
training iterations (forward, backward, SGD-momentum update, synthetic data
of the config's shape copied from pinned host memory every iteration) of

- purine_mpi, placed and fused for the GPU as ``train`` runs it, in each of
  its ``--modes``: ``eager`` (the stream dispatcher launching op by op) and
  ``graph`` (the iteration replayed as captured CUDA graphs, ``train``'s
  default; the warm-up's first iteration is the one that captures);
- PyTorch eager (cuDNN, ``cudnn.benchmark`` on: its best eager setting);
- PyTorch with the whole step (copy-in, forward, backward, optimizer step)
  captured as one CUDA graph (``torch.cuda.graph``) and replayed;
- ``torch.compile`` of the model (default mode; ``--no-compile`` skips it).

then one JSON object on stdout. Each entry of ``results`` has::

    config, batch,
    purine_images_per_s          purine_mpi in its default mode (graph when
                                 measured, else eager; see purine_mode)
    torch_eager_images_per_s, torch_graph_images_per_s, torch_compile_images_per_s,
    purine_gpu_busy              GPU kernel time / wall time of an iteration
    purine_kernels_per_iter      kernels the GPU ran per iteration
    blas                         the cuBLAS binding of the matrix products:
                                 "nvmath" (capturable) or "cupy" (not)
    cuda_graph                   the graph mode's capture report, whole
                                 (segments, captured, failed segments and
                                 eager GPU ops with their reasons, ...)

plus each mode's own figures (``purine_eager_*``, ``purine_graph_*``: images/s,
ms per iteration, first and last loss, the arena, the CUDA-graph segments),
``purine_kernel_ms_per_iter`` and ``torch_eager_kernel_ms_per_iter``, and
where that time goes: ``purine_top_kernels`` and ``torch_eager_top_kernels``
([kernel name, ms per iteration, launches per iteration], the 15 longest).

Device memory, side by side: ``purine_device_pool_bytes`` (what CuPy's pool
holds after purine_mpi's run in its default mode: the arena, planned as
``train`` plans it, the scratch and every other allocation; the pool is
emptied before each run and frees nothing by itself, so this is the run's
high-water mark; ``purine_<mode>_device_planned_bytes`` and
``_unplanned_bytes`` give the plan's share of the arena and what the same
blobs take one buffer each), ``torch_eager_max_memory_allocated`` (PyTorch's
peak of live tensors over its run) and ``purine_vs_torch_memory``, their
ratio; peak against peak, ``purine_device_peak_bytes`` (the most bytes in
use at once in CuPy's pool over purine_mpi's run, read at each allocation,
plus the CUDA-graph captures' private pools: gpu/memory.py, as ``bench
--json``'s ``device_peak_bytes``; less what an earlier run of the process
still held in use when it began and kept while it allocated,
``purine_<mode>_device_in_use_before_bytes``: gpu/memory ``own_peak``)
and ``purine_vs_torch_peak_memory``, its
ratio to ``torch_eager_max_memory_allocated`` (both allocators' live bytes
at the worst moment of the same training step, set-up included).
``purine_planned_device_rows`` / ``_total`` / ``purine_planned_peak_op``:
``plan``'s device rows of the same job (counted after the run, so the
cuDNN workspaces are the tuner's choices); ``torch_eager_tensor_peak``:
PyTorch's live tensors at their peak, counted without a GPU
(benchmarks/device_plan.py ``torch_peak``; fp32), and
``torch_eager_beyond_tensors_bytes`` what ``max_memory_allocated`` holds
beyond them (its cuBLAS and cuDNN workspaces). Kernel
counts and times come from CUPTI through PyTorch's profiler (it records every
kernel of the process, CuPy's, cuBLAS's and cuDNN's included, also inside
CUDA graphs) over ``--profile-iters`` further iterations; the busy fraction
divides the union of the kernel intervals per iteration by the unprofiled
wall time per iteration. Without PyTorch (``--no-torch``) those are null.

Float32 math uses TF32 in both frameworks only with ``--tf32``. ``--precision
bf16``: ours with the job's ``precision: bf16`` (the convolutions and GEMMs
in bf16), PyTorch channels-last under ``torch.autocast(bfloat16)`` in every
way it runs (eager, the captured whole step, torch.compile). Without CuPy
and a CUDA device, or without a CUDA build of PyTorch, the script stops with
exit status 1 and says why: it never reports CPU numbers as GPU ones.
``--dry-run`` builds every net of both frameworks and runs one iteration of
each on the CPU, and prints the same JSON with every figure null and
``"dry_run": true``: a smoke test of the script on any machine.
"""
import argparse
import gc
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DEFAULT_CONFIGS = [os.path.join(REPO, "jobs", "cifar10_quick.yaml"),
                   os.path.join(REPO, "jobs", "nin_cifar10.yaml")]


def fail(message):
    print(f"gpu_throughput: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def require_gpu(device, need_torch):
    """CuPy with ``device`` (and a CUDA PyTorch), or exit 1 saying what is missing."""
    from purine_mpi.base.backend import cupy_available
    if not cupy_available():
        fail("needs CuPy and a CUDA device (pip install purine_mpi[gpu]); none found, "
             "so there is nothing to measure")
    import cupy
    count = cupy.cuda.runtime.getDeviceCount()
    if not 0 <= device < count:
        fail(f"--device {device}: this machine has {count} CUDA device(s)")
    if need_torch:
        try:
            import torch
        except ImportError:
            fail("the PyTorch baseline needs torch with CUDA (or pass --no-torch)")
        if not torch.cuda.is_available():
            fail(f"torch {torch.__version__} sees no CUDA device (a CPU-only build?); "
                 "install a CUDA build or pass --no-torch")
    return cupy


def load(path, batch, precision="fp32", device=0):
    """The config at ``batch``; ``precision`` bf16 (a GPU setting: on ``device``)."""
    from purine_mpi.job.config import load_config
    sets = [f"data.train.batch_size={batch}"]
    if precision != "fp32":
        sets += [f"precision={precision}", f"device={device}"]
    config = load_config(path, overrides=sets, check_files=False)
    spec = config["data"]["train"]
    if spec.get("source") != "synthetic":
        from purine_mpi.tools.bench import synthetic_config
        config = synthetic_config(config).to_config()  # a Job: the dict again
    config["data"].pop("test", None)
    return config


# ----------------------------------------------------------- purine_mpi ---

def bench_purine(config, device, iters, warmup, tf32, cuda_graph=False, profile_iters=0):
    """Time ``iters`` iterations after ``warmup``; ``cuda_graph``: replay
    captured CUDA graphs (else eager stream dispatch). With ``profile_iters``,
    that many more iterations run under the kernel profiler (``kernels``)."""
    import cupy

    from purine_mpi.gpu import set_tf32
    from purine_mpi.parallel.placement import prepare_for_device
    from purine_mpi.layers.fillers import fill
    from purine_mpi.job.job import job_of
    from purine_mpi.job.replica import build_train_graph, loss_blobs
    from purine_mpi.runtime.cuda_graph import GraphDispatcher
    from purine_mpi.runtime.factory import make_dispatcher, planned_workspace
    from purine_mpi.runtime.memory_plan import batch_blobs
    from purine_mpi.runtime.streams_dispatcher import StreamDispatcher

    set_tf32(tf32)
    cupy.cuda.Device(device).use()
    pool = cupy.get_default_memory_pool()
    gc.collect()                        # an earlier run's cycles: its arrays back to the pool
    pool.free_all_blocks()              # what an earlier run left cached
    held_before = pool.total_bytes()
    # what an earlier run still holds in use (its cuBLAS handles' workspaces:
    # gpu/blas keeps them): in the tracker's peak, not this run's (issue 45)
    in_use_before = int(pool.used_bytes())
    from purine_mpi.gpu.memory import start_peak_memory
    peak = start_peak_memory(cupy)      # the most bytes in use at once, from here on
    graph, _ = build_train_graph(job_of(config))
    # placed, in the job's precision and fused, as train does
    prepare_for_device(graph, device, precision=config.get("precision", "fp32"))
    notes = []
    # the memory as train lays it out: planned on the host and the GPU
    ws = planned_workspace(graph, bool(config.get("memory_plan", True)),
                           keep=batch_blobs(graph))
    d = make_dispatcher(graph, seed=int(config.get("seed", 0)), cuda_graph=cuda_graph,
                        log=notes.append, workspace=ws)
    try:
        if not isinstance(d, StreamDispatcher) or \
                isinstance(d, GraphDispatcher) != bool(cuda_graph):
            fail(f"expected the CUDA-stream dispatcher (cuda_graph={cuda_graph}), "
                 f"got {type(d).__name__}")
        ws = d.workspace
        params = graph.params()
        if not params or not all(isinstance(ws[p.name], cupy.ndarray) for p in params):
            fail("the parameters are not CuPy arrays: the graph did not go to the GPU")
        for p in params:
            ws.set(p.name, fill(p, int(config.get("seed", 0))))
        losses = list(loss_blobs(graph))
        first_loss = None
        for it in range(warmup):
            ws["iter"][...] = it
            d.run(it)
            if first_loss is None:
                first_loss = sum(float(ws[b]) for b in losses)
        d.synchronize()
        t0 = time.perf_counter()
        for it in range(warmup, warmup + iters):
            ws["iter"][...] = it
            d.run(it, sync=False)  # as the trainer's steps: no host wait between them
        d.synchronize()
        elapsed = time.perf_counter() - t0
        last_loss = sum(float(ws[b]) for b in losses)
        out = {"seconds": elapsed, "first_loss": first_loss, "last_loss": last_loss,
               "device_arena_bytes": int(sum(ws.device_bytes.values())),
               "device_planned_bytes": int(sum(p.planned_bytes
                                               for p in ws.device_plans.values())),
               "device_unplanned_bytes": int(sum(p.unplanned_bytes
                                                 for p in ws.device_plans.values())),
               "scratch_bytes": int(sum(ws.scratch_bytes.values())),
               # CuPy's pool frees nothing back by itself: what it holds after
               # the run is the run's high-water mark on the device
               "device_pool_bytes": int(pool.total_bytes() - held_before),
               "streams": len(d.executor.runtime.pool.items())}
        if peak is not None:   # the profiled iterations below run under PyTorch's profiler
            peak.close()
            captured = (d.capture_report() or {}).get("capture_pool_bytes") or {}
            # beyond what was in use before and stayed in use while this run
            # allocated (gpu/memory own_peak: peak less in_use_before read too
            # low where an earlier run's bytes were let go and reused here)
            out["device_peak_bytes"] = int(peak.own_peak().get(device, 0) +
                                           captured.get(str(device), 0))
            out["device_in_use_before_bytes"] = in_use_before
        if profile_iters:
            start = warmup + iters

            def step(i):
                ws["iter"][...] = start + i
                d.run(start + i)
            out["kernels"] = kernel_stats(step, profile_iters)
        from purine_mpi.gpu.blas import blas_backend
        out["blas"] = blas_backend()
        if cuda_graph:
            out["capture"] = d.capture_report()
            out["notes"] = notes
        return out
    finally:
        if peak is not None:
            peak.close()
        d.close()


# -------------------------------------------------------------- PyTorch ---

def torch_net(config):
    """The config's (sequential) net as a torch.nn.Sequential, plus the loss."""
    import torch
    from torch import nn

    spec = config["data"]["train"]
    shape = (2,) + tuple(spec["shape"])
    probe = torch.zeros(shape)
    layers = []
    top = "data"
    loss = None
    for layer in config["net"]:
        kind, name = layer["type"], layer["name"]
        if layer.get("phase", "train") != "train" or kind == "accuracy":
            continue
        bottom = layer["bottom"]
        bottoms = bottom if isinstance(bottom, list) else [bottom]
        if bottoms[0] != top:
            fail(f"{config.get('_path')}: layer '{name}' reads '{bottoms[0]}', not the previous "
                 f"top '{top}'; this baseline builds sequential nets only")
        if kind == "softmax_loss":
            loss = nn.CrossEntropyLoss()
            break
        module = _torch_layer(nn, layer, probe)
        layers.append(module)
        with torch.no_grad():
            probe = module(probe)
        top = layer["top"]
    if loss is None:
        fail(f"{config.get('_path')}: no softmax_loss layer for the baseline")
    return nn.Sequential(*layers), loss


def _pair(value):
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value), int(value))


def _torch_layer(nn, layer, probe):
    kind = layer["type"]
    if kind == "conv":
        return nn.Conv2d(probe.shape[1], int(layer["num_output"]), _pair(layer["kernel"]),
                         stride=_pair(layer.get("stride", 1)), padding=_pair(layer.get("pad", 0)),
                         dilation=_pair(layer.get("dilation", 1)),
                         groups=int(layer.get("group", 1)), bias=layer.get("bias_term", True))
    if kind == "pool":
        pool = layer.get("pool", "max")
        if layer.get("global", False) or layer.get("global_pooling", False):
            return nn.AdaptiveMaxPool2d(1) if pool == "max" else nn.AdaptiveAvgPool2d(1)
        args = dict(kernel_size=_pair(layer["kernel"]), stride=_pair(layer.get("stride", 1)),
                    padding=_pair(layer.get("pad", 0)),
                    ceil_mode=bool(layer.get("ceil_mode", False)))
        return nn.MaxPool2d(**args) if pool == "max" else \
            nn.AvgPool2d(count_include_pad=True, **args)
    if kind == "relu":
        return nn.ReLU(inplace=layer["top"] == layer["bottom"])
    if kind == "fc":
        in_features = int(np.prod(probe.shape[1:]))
        return nn.Sequential(nn.Flatten(), nn.Linear(in_features, int(layer["num_output"]),
                                                     bias=layer.get("bias_term", True)))
    if kind == "dropout":
        return nn.Dropout(float(layer.get("ratio", 0.5)))
    if kind == "flatten":
        return nn.Flatten()
    if kind == "lrn":
        return nn.LocalResponseNorm(int(layer.get("local_size", 5)),
                                    alpha=float(layer.get("alpha", 1e-4)),
                                    beta=float(layer.get("beta", 0.75)),
                                    k=float(layer.get("k", 1.0)))
    fail(f"layer type '{kind}' (layer '{layer['name']}') has no PyTorch equivalent here")


def _torch_setup(config, device, tf32):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda", device) if device is not None else torch.device("cpu")
    torch.manual_seed(int(config.get("seed", 0)))
    model, criterion = torch_net(config)
    model = model.to(dev).train()
    solver = config["solver"]
    optimizer = torch.optim.SGD(model.parameters(), lr=float(solver["base_lr"]),
                                momentum=float(solver.get("momentum", 0.0)),
                                weight_decay=float(solver.get("weight_decay", 0.0)))
    spec = config["data"]["train"]
    batch = int(spec["batch_size"])
    gen = torch.Generator().manual_seed(0)
    x_host = torch.randn((batch,) + tuple(spec["shape"]), generator=gen)
    y_host = torch.randint(0, int(spec.get("classes", 10)), (batch,), generator=gen)
    if config.get("precision") == "bf16":   # channels-last, as autocast's convolutions like
        model = model.to(memory_format=torch.channels_last)
        x_host = x_host.contiguous(memory_format=torch.channels_last)
    if dev.type == "cuda":
        x_host, y_host = x_host.pin_memory(), y_host.pin_memory()
    return torch, dev, model, criterion, optimizer, x_host, y_host


def autocast(torch, dev, config):
    """``torch.autocast(bfloat16)`` for a bf16 config (its cast cache off:
    a captured graph replays the casts), else nothing."""
    import contextlib
    if config.get("precision") != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(dev.type, dtype=torch.bfloat16, cache_enabled=False)


def _timed(torch, dev, step, iters, warmup, profile_iters=0):
    """Run ``warmup`` then ``iters`` timed steps (and profiled ones)."""
    first_loss = None
    for _ in range(warmup):
        loss = step()
        if first_loss is None:
            first_loss = float(loss.detach())
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        loss = step()
    torch.cuda.synchronize(dev)
    elapsed = time.perf_counter() - t0
    out = {"seconds": elapsed, "first_loss": first_loss, "last_loss": float(loss.detach())}
    if profile_iters:
        out["kernels"] = kernel_stats(lambda i: step(), profile_iters)
    return out


def bench_torch(config, device, iters, warmup, tf32, compile_model=False, profile_iters=0):
    """PyTorch eager (or ``torch.compile``d) training steps; with them the
    peak of its caching allocator (``max_memory_allocated``: the bytes of
    live tensors at the worst moment, the model and optimizer state included)."""
    import torch as _torch
    _torch.cuda.empty_cache()
    _torch.cuda.reset_peak_memory_stats(device)
    torch, dev, model, criterion, optimizer, x_host, y_host = _torch_setup(config, device, tf32)
    if compile_model:
        model = torch.compile(model)

    def step():
        x = x_host.to(dev, non_blocking=True)
        y = y_host.to(dev, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with autocast(torch, dev, config):
            loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    out = _timed(torch, dev, step, iters, warmup, profile_iters)
    out["max_memory_allocated"] = int(torch.cuda.max_memory_allocated(dev))
    out["max_memory_reserved"] = int(torch.cuda.max_memory_reserved(dev))
    return out


def static_inputs(torch, dev, *hosts):
    """The captured step's input buffers on ``dev``, each laid out as its
    pinned host tensor (``empty_like``: bf16's channels-last images stay
    channels-last). A copy between a CPU and a CUDA tensor of different
    strides is not one ``cudaMemcpyAsync``: PyTorch's copy_kernel_cuda makes
    the source contiguous first, a new pageable CPU tensor, and a capture
    refuses to copy from one ("Cannot copy between CPU and CUDA tensors
    during CUDA graph capture unless the CPU tensor is pinned"). Same
    strides, same dtype: one memcpy straight from the pinned tensor."""
    return tuple(torch.empty_like(h, device=dev) for h in hosts)


def bench_torch_graph(config, device, iters, warmup, tf32):
    """PyTorch with the whole step -- the copy from pinned host memory,
    forward, backward, the optimizer step -- captured as one CUDA graph
    (PyTorch's whole-network capture recipe) and replayed."""
    torch, dev, model, criterion, optimizer, x_host, y_host = _torch_setup(config, device, tf32)
    static_x, static_y = static_inputs(torch, dev, x_host, y_host)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up on a side stream, as the recipe says
        for _ in range(3):
            static_x.copy_(x_host, non_blocking=True)
            static_y.copy_(y_host, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with autocast(torch, dev, config):
                warm_loss = criterion(model(static_x), static_y)
            warm_loss.backward()
            optimizer.step()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_x.copy_(x_host, non_blocking=True)
        static_y.copy_(y_host, non_blocking=True)
        with autocast(torch, dev, config):
            static_loss = criterion(model(static_x), static_y)
        static_loss.backward()
        optimizer.step()

    def step():
        graph.replay()
        return static_loss

    return _timed(torch, dev, step, iters, warmup)


def kernel_stats(step, iters, match=None, events=None):
    """{kernels_per_iter, kernel_ms_per_iter} of ``iters`` calls of
    ``step(i)``, from CUPTI through PyTorch's profiler: every kernel the
    process runs (CuPy's, cuBLAS's, cuDNN's, inside CUDA graphs too);
    kernel time is the union of the kernel intervals (overlaps once).
    ``match`` (a regular expression): also ``matched_ms_per_iter`` and
    ``matched_kernels``, the kernels whose names it finds (case ignored).
    ``events`` (a list): the host is profiled too, every thread's ranges
    (``record_function``, PyTorch's ops) and CUDA API calls, and the
    trace's events (Chrome format) are appended to it (gpt_gpu.py
    attributes GPU work to the ranges that launched it).
    None without a CUDA build of PyTorch."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    import tempfile
    from purine_mpi.runtime.trace import merge_intervals
    activities, extra = [ProfilerActivity.CUDA], {}
    if events is not None:   # the host too: the ranges of every thread (ours launch on several)
        activities.append(ProfilerActivity.CPU)
        try:
            from torch.profiler import _ExperimentalConfig
            extra["experimental_config"] = _ExperimentalConfig(profile_all_threads=True)
        except (ImportError, TypeError):   # an older PyTorch: the calling thread's only
            pass
    torch.cuda.synchronize()
    with profile(activities=activities, **extra) as prof:
        for i in range(iters):
            step(i)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f).get("traceEvents", [])
    if events is not None:
        events.extend(trace)
    events = trace
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    busy_us = sum(e - s for s, e in merge_intervals(
        [(float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0))) for k in kernels]))
    by_name = {}
    for k in kernels:
        total = by_name.setdefault(k.get("name", "?"), [0.0, 0])
        total[0] += float(k.get("dur", 0))
        total[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    matched = {}
    if match is not None:
        import re
        matched = {"matched_ms_per_iter": round(sum(
            us for name, (us, _) in by_name.items() if re.search(match, name, re.I))
            / 1e3 / iters, 4), "matched_kernels": sorted(
            name[:120] for name in by_name if re.search(match, name, re.I)),
            # [name, ms per iteration, launches per iteration], the longest first
            "matched_table": [[name[:120], round(us / 1e3 / iters, 4), round(n / iters, 2)]
                              for name, (us, n) in sorted(by_name.items(),
                                                          key=lambda kv: -kv[1][0])
                              if re.search(match, name, re.I)]}
    return {**matched,"kernels_per_iter": round(len(kernels) / iters, 1),
            "kernel_ms_per_iter": round(busy_us / 1e3 / iters, 4),
            # where the kernel time goes: [name (cut to 120 characters),
            # ms per iteration, launches per iteration], the longest first
            "top_kernels": [[name[:120], round(us / 1e3 / iters, 4), round(n / iters, 2)]
                            for name, (us, n) in top]}


#: how many kernels ``top_kernels`` lists
TOP_KERNELS = 15


# ------------------------------------------------------------------ main ---

def dry_run(configs, batches, precision="fp32"):
    """Build every net of both frameworks and run one iteration of each on
    the CPU; the JSON has the real keys and null figures."""
    from purine_mpi.job.job import job_of
    from purine_mpi.layers.fillers import fill
    from purine_mpi.job.replica import build_train_graph, loss_blobs
    from purine_mpi.runtime.factory import make_dispatcher
    results = []
    for path in configs:
        for batch in batches:
            config = load(path, batch)   # the CPU computes ours in fp32
            graph, _ = build_train_graph(job_of(config))
            d = make_dispatcher(graph, seed=0)
            try:
                for p in graph.params():
                    d.workspace.set(p.name, fill(p, 0))
                d.workspace["iter"][...] = 0
                d.run(0)
                loss = sum(float(d.workspace[b]) for b in loss_blobs(graph))
            finally:
                d.close()
            if not np.isfinite(loss):
                fail(f"dry run: {config['name']} batch {batch}: purine_mpi's loss is {loss}")
            torch_loss = None
            try:
                import torch  # noqa: F401
                torch_, dev, model, criterion, optimizer, x, y = _torch_setup(
                    dict(config, precision=precision), None, False)
                with autocast(torch_, dev, dict(config, precision=precision)):
                    loss_t = criterion(model(x), y)
                loss_t.backward()
                optimizer.step()
                torch_loss = float(loss_t.detach())
            except ImportError:
                pass
            entry = {key: None for key in RESULT_KEYS}
            entry.update(config=config["name"], batch=batch, dry_run_purine_loss=loss,
                         dry_run_torch_loss=torch_loss)
            results.append(entry)
    return {"benchmark": "gpu_throughput", "dry_run": True, "device": "cpu (dry run: no "
            "figures)", "precision": precision, "batches": batches, "results": results}


#: the keys every entry of ``results`` has
RESULT_KEYS = ("config", "batch", "purine_images_per_s", "torch_eager_images_per_s",
               "torch_graph_images_per_s", "torch_compile_images_per_s", "purine_gpu_busy",
               "purine_kernels_per_iter", "blas", "cuda_graph", "purine_device_pool_bytes",
               "torch_eager_max_memory_allocated", "purine_vs_torch_memory",
               "purine_device_peak_bytes", "purine_vs_torch_peak_memory")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    ap.add_argument("--batches", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--batch", type=int, default=None, help="one batch size (for --batches)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--tf32", action="store_true", help="allow TF32 float32 math in both")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: ours in precision bf16, PyTorch channels-last under autocast")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch baselines "
                    "(and the kernel profile, which needs PyTorch's profiler)")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--profile-iters", type=int, default=5,
                    help="iterations profiled for kernel counts and times (0: none)")
    ap.add_argument("--modes", nargs="+", choices=("eager", "graph"), default=["eager", "graph"],
                    help="purine_mpi's modes: eager stream dispatch, CUDA-graph replay")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU smoke run: build and run one iteration of each net, no figures")
    args = ap.parse_args(argv)
    batches = [args.batch] if args.batch is not None else args.batches
    if args.iters < 1 or args.warmup < 1 or min(batches) < 1:
        fail("--iters, --warmup and the batch sizes must be >= 1")
    if args.dry_run:
        print(json.dumps(dry_run(args.configs, batches, args.precision), indent=1))
        return 0
    cupy = require_gpu(args.device, not args.no_torch)
    props = cupy.cuda.runtime.getDeviceProperties(args.device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    profile = 0 if args.no_torch else max(0, args.profile_iters)
    results = []
    for path in args.configs:
        for batch in batches:
            results.append(_entry(args, path, batch, profile))
    versions = {"cupy": cupy.__version__, "numpy": np.__version__}
    from purine_mpi.gpu import cudnn as gpu_cudnn
    versions["purine_conv"] = "cudnn" if gpu_cudnn.frontend() is not None else \
        f"im2col ({gpu_cudnn.fallback_reason()})"
    from purine_mpi.gpu import blas
    versions["purine_blas"] = blas.blas_backend()
    note = blas.blas_note()
    if note:
        print(note, file=sys.stderr, flush=True)
    if not args.no_torch:
        import torch
        versions["torch"] = torch.__version__
        versions["cudnn"] = torch.backends.cudnn.version()
    print(json.dumps({"benchmark": "gpu_throughput", "device": name, "device_index": args.device,
                      "batches": batches, "iters": args.iters, "warmup": args.warmup,
                      "tf32": args.tf32, "precision": args.precision, "versions": versions, "results": results}, indent=1))
    return 0


def planned_device(config, device):
    """``plan``'s device rows of the same job on ``device``
    (tools/plan.offline_footprint, after the run: its cuDNN workspaces are
    the tuner cache's choices), their total and the op where the arena
    peaks; {"purine_planned_device_error": why} where it cannot."""
    try:
        from purine_mpi.job.job import job_of
        from purine_mpi.tools.plan import offline_footprint
        fp = offline_footprint(job_of(dict(config, device=int(device))), 1, 0)
        return {"purine_planned_device_rows": dict(fp.devices[int(device)]),
                "purine_planned_device_total": int(fp.device_total(int(device))),
                "purine_planned_peak_op": (fp.peak or {}).get("op")}
    except Exception as exc:   # a figure left out, said, not the benchmark stopped
        return {"purine_planned_device_error": f"{type(exc).__name__}: {exc}".splitlines()[0]}


def torch_tensor_peak(path, batch, precision):
    """PyTorch's live-tensor peak of the same eager step counted without a
    GPU (benchmarks/device_plan.torch_peak), fp32 only (None otherwise):
    ``max_memory_allocated`` less this is what its cuBLAS and cuDNN
    workspaces took at the peak."""
    if precision != "fp32":
        return None
    try:
        sys.path.insert(0, os.path.join(REPO, "benchmarks"))
        from device_plan import torch_peak
        return torch_peak(path, batch)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}


def _entry(args, path, batch, profile):
    from purine_mpi.tools.bench import json_safe
    precision = getattr(args, "precision", "fp32")
    config = load(path, batch, precision, args.device)
    entry = {key: None for key in RESULT_KEYS}
    entry.update(config=config["name"], batch=batch, path=os.path.relpath(path, REPO),
                 precision=precision)
    default = "graph" if "graph" in args.modes else "eager"
    for mode in args.modes:
        graph = mode == "graph"
        kwargs = {"profile_iters": profile} if profile and mode == default else {}
        p = bench_purine(config, args.device, args.iters, args.warmup, args.tf32,
                         cuda_graph=graph, **kwargs)
        key = f"purine_{mode}"
        entry.update({f"{key}_images_per_s": round(batch * args.iters / p["seconds"], 1),
                      f"{key}_iter_ms": round(1e3 * p["seconds"] / args.iters, 3),
                      f"{key}_first_loss": p["first_loss"],
                      f"{key}_last_loss": p["last_loss"],
                      f"{key}_device_arena_bytes": p["device_arena_bytes"],
                      f"{key}_device_planned_bytes": p.get("device_planned_bytes"),
                      f"{key}_device_unplanned_bytes": p.get("device_unplanned_bytes"),
                      f"{key}_device_pool_bytes": p.get("device_pool_bytes"),
                      f"{key}_device_peak_bytes": p.get("device_peak_bytes"),
                      f"{key}_device_in_use_before_bytes": p.get("device_in_use_before_bytes"),
                      f"{key}_scratch_bytes": p.get("scratch_bytes"),
                      f"{key}_streams": p["streams"]})
        if p.get("blas"):
            entry["blas"] = p["blas"]
        if graph:
            rep = p["capture"]
            entry["cuda_graph"] = json_safe(rep)
            entry.update({"purine_graph_segments": rep["segments"],
                          "purine_graph_captured_ops": rep["captured_ops"],
                          "purine_graph_eager_gpu_ops": sorted(rep["eager_gpu_ops"]),
                          "purine_graph_failed": rep["failed"]})
        if mode == default:
            entry["purine_mode"] = mode
            entry["purine_images_per_s"] = entry[f"{key}_images_per_s"]
            entry["purine_device_pool_bytes"] = p.get("device_pool_bytes")
            entry["purine_device_peak_bytes"] = p.get("device_peak_bytes")
            stats = p.get("kernels")
            if stats:
                iter_ms = 1e3 * p["seconds"] / args.iters
                entry["purine_kernels_per_iter"] = stats["kernels_per_iter"]
                entry["purine_kernel_ms_per_iter"] = stats["kernel_ms_per_iter"]
                entry["purine_top_kernels"] = stats["top_kernels"]
                entry["purine_gpu_busy"] = round(min(1.0, stats["kernel_ms_per_iter"] / iter_ms),
                                                 3)
        if not np.isfinite(p["last_loss"]):
            fail(f"{config['name']}: purine_mpi's loss ({mode}) is {p['last_loss']} on the GPU")
    entry.update(planned_device(config, args.device))
    if not args.no_torch:
        t = bench_torch(config, args.device, args.iters, args.warmup, args.tf32,
                        profile_iters=profile)
        entry["torch_eager_tensor_peak"] = torch_tensor_peak(path, batch, precision)
        tensors = (entry["torch_eager_tensor_peak"] or {}).get("Total")
        if tensors is not None and t.get("max_memory_allocated"):
            entry["torch_eager_beyond_tensors_bytes"] = t["max_memory_allocated"] - tensors
        entry.update({"torch_eager_images_per_s": round(batch * args.iters / t["seconds"], 1),
                      "torch_eager_iter_ms": round(1e3 * t["seconds"] / args.iters, 3),
                      "torch_eager_first_loss": t["first_loss"],
                      "torch_eager_last_loss": t["last_loss"],
                      "torch_eager_max_memory_allocated": t.get("max_memory_allocated"),
                      "torch_eager_max_memory_reserved": t.get("max_memory_reserved")})
        if entry["purine_device_pool_bytes"] and t.get("max_memory_allocated"):
            entry["purine_vs_torch_memory"] = round(
                entry["purine_device_pool_bytes"] / t["max_memory_allocated"], 3)
        if entry["purine_device_peak_bytes"] and t.get("max_memory_allocated"):
            # peak against peak: the same step, both allocators' live bytes at the worst moment
            entry["purine_vs_torch_peak_memory"] = round(
                entry["purine_device_peak_bytes"] / t["max_memory_allocated"], 3)
        if t.get("kernels"):
            entry["torch_eager_kernels_per_iter"] = t["kernels"]["kernels_per_iter"]
            entry["torch_eager_kernel_ms_per_iter"] = t["kernels"]["kernel_ms_per_iter"]
            entry["torch_eager_top_kernels"] = t["kernels"]["top_kernels"]
        for kind, runner in (("graph", bench_torch_graph), ("compile", None)):
            if kind == "compile" and args.no_compile:
                continue
            try:
                if runner is None:
                    r = bench_torch(config, args.device, args.iters, args.warmup, args.tf32,
                                    compile_model=True)
                else:
                    r = runner(config, args.device, args.iters, args.warmup, args.tf32)
            except Exception as exc:  # a baseline that cannot run here is reported, not fatal
                entry[f"torch_{kind}_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                continue
            entry[f"torch_{kind}_images_per_s"] = round(batch * args.iters / r["seconds"], 1)
            entry[f"torch_{kind}_iter_ms"] = round(1e3 * r["seconds"] / args.iters, 3)
        for kind in ("eager", "graph", "compile"):
            theirs = entry.get(f"torch_{kind}_images_per_s")
            if theirs and entry["purine_images_per_s"]:
                entry[f"purine_vs_torch_{kind}"] = round(entry["purine_images_per_s"] / theirs, 3)
    return entry


if __name__ == "__main__":
    sys.exit(main())
