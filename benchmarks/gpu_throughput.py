#!/usr/bin/env python
"""Training throughput on one GPU: purine_mpi (CuPy + the CUDA-stream
dispatcher) against the same net in PyTorch eager mode on the same GPU.

    python benchmarks/gpu_throughput.py \\
        [--configs jobs/cifar10_quick.yaml jobs/nin_cifar10.yaml] \\
        [--batch 128] [--iters 50] [--warmup 5] [--device 0] [--tf32]

For each config: one run of ``--warmup`` untimed then ``--iters`` timed
training iterations (forward, backward, SGD-momentum update, synthetic data
of the config's shape copied from pinned host memory every iteration) in
each framework, then one JSON object on stdout::

    {"benchmark": "gpu_throughput", "device": "...", "batch": 128, ...,
     "results": [{"config": "cifar10_quick", "purine_images_per_s": ...,
                  "purine_graph_images_per_s": ...,
                  "torch_images_per_s": ..., "purine_vs_torch": ..., ...}, ...]}

purine_mpi runs in both of its modes (``--modes``): ``eager`` is the stream
dispatcher launching op by op (``cuda_graph: false``; the ``purine_*`` keys),
``graph`` replays the iteration as captured CUDA graphs (the default of
``train``; the ``purine_graph_*`` keys, with the number of segments, the GPU
ops left eager and any segment whose capture failed). The warm-up's first
iteration is the one that captures, so the timed iterations replay.

Float32 GEMMs use TF32 in both frameworks only with ``--tf32`` (PyTorch's
convolutions use cuDNN, with ``cudnn.benchmark`` on: its best eager setting).
Without CuPy and a CUDA device, or without a CUDA build of PyTorch, the
script stops with exit status 1 and says why: it never reports CPU numbers.
"""
import argparse
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
    from purine_mpi.backend import cupy_available
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


def load(path, batch):
    from purine_mpi.io.config import load_config
    config = load_config(path, overrides=[f"data.train.batch_size={batch}"], check_files=False)
    spec = config["data"]["train"]
    if spec.get("source") != "synthetic":
        from purine_mpi.bench import synthetic_config
        config = synthetic_config(config)
    config["data"].pop("test", None)
    return config


# ----------------------------------------------------------- purine_mpi ---

def bench_purine(config, device, iters, warmup, tf32, cuda_graph=False):
    """Time ``iters`` iterations after ``warmup``; ``cuda_graph``: replay
    captured CUDA graphs (else eager stream dispatch)."""
    import cupy

    from purine_mpi.gpu import set_tf32
    from purine_mpi.gpu.placement import place_on_device
    from purine_mpi.layers.fillers import fill
    from purine_mpi.model import build_train_graph, loss_blobs
    from purine_mpi.runtime.cuda_graph import GraphDispatcher
    from purine_mpi.runtime.factory import make_dispatcher
    from purine_mpi.runtime.streams_dispatcher import StreamDispatcher

    set_tf32(tf32)
    cupy.cuda.Device(device).use()
    graph, _ = build_train_graph(config)
    place_on_device(graph, device)
    notes = []
    d = make_dispatcher(graph, seed=int(config.get("seed", 0)), cuda_graph=cuda_graph,
                        log=notes.append)
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
        t0 = time.perf_counter()
        for it in range(warmup, warmup + iters):
            ws["iter"][...] = it
            d.run(it)  # returns once every stream is done
        elapsed = time.perf_counter() - t0
        last_loss = sum(float(ws[b]) for b in losses)
        out = {"seconds": elapsed, "first_loss": first_loss, "last_loss": last_loss,
               "device_arena_bytes": int(sum(ws.device_bytes.values())),
               "streams": len(d.runtime.pool)}
        if cuda_graph:
            out["capture"] = d.capture_report()
            out["notes"] = notes
        return out
    finally:
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


def bench_torch(config, device, iters, warmup, tf32):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda", device)
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
    x_host = torch.randn((batch,) + tuple(spec["shape"]), generator=gen).pin_memory()
    y_host = torch.randint(0, int(spec.get("classes", 10)), (batch,), generator=gen).pin_memory()

    def step():
        x = x_host.to(dev, non_blocking=True)
        y = y_host.to(dev, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    first_loss = None
    for _ in range(warmup):
        loss = step()
        if first_loss is None:
            first_loss = float(loss)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        loss = step()
    torch.cuda.synchronize(dev)
    elapsed = time.perf_counter() - t0
    return {"seconds": elapsed, "first_loss": first_loss, "last_loss": float(loss)}


# ------------------------------------------------------------------ main ---

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--tf32", action="store_true", help="allow TF32 float32 GEMMs in both")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    ap.add_argument("--modes", nargs="+", choices=("eager", "graph"), default=["eager", "graph"],
                    help="purine_mpi's modes: eager stream dispatch, CUDA-graph replay")
    args = ap.parse_args(argv)
    if args.iters < 1 or args.warmup < 1 or args.batch < 1:
        fail("--iters, --warmup and --batch must be >= 1")
    cupy = require_gpu(args.device, not args.no_torch)
    props = cupy.cuda.runtime.getDeviceProperties(args.device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    results = []
    for path in args.configs:
        config = load(path, args.batch)
        entry = {"config": config["name"], "path": os.path.relpath(path, REPO)}
        for mode in args.modes:
            graph = mode == "graph"
            p = bench_purine(config, args.device, args.iters, args.warmup, args.tf32,
                             cuda_graph=graph)
            key = "purine_graph" if graph else "purine"
            entry.update({f"{key}_images_per_s": round(args.batch * args.iters / p["seconds"], 1),
                          f"{key}_iter_ms": round(1e3 * p["seconds"] / args.iters, 3),
                          f"{key}_first_loss": p["first_loss"],
                          f"{key}_last_loss": p["last_loss"],
                          f"{key}_device_arena_bytes": p["device_arena_bytes"],
                          f"{key}_streams": p["streams"]})
            if graph:
                rep = p["capture"]
                entry.update({"purine_graph_segments": rep["segments"],
                              "purine_graph_captured_ops": rep["captured_ops"],
                              "purine_graph_eager_gpu_ops": sorted(rep["eager_gpu_ops"]),
                              "purine_graph_failed": rep["failed"]})
            if not np.isfinite(p["last_loss"]):
                fail(f"{config['name']}: purine_mpi's loss ({mode}) is {p['last_loss']} "
                     "on the GPU")
        if not args.no_torch:
            t = bench_torch(config, args.device, args.iters, args.warmup, args.tf32)
            entry.update({"torch_images_per_s": round(args.batch * args.iters / t["seconds"], 1),
                          "torch_iter_ms": round(1e3 * t["seconds"] / args.iters, 3),
                          "torch_first_loss": t["first_loss"], "torch_last_loss": t["last_loss"]})
            for key in ("purine", "purine_graph"):
                if f"{key}_images_per_s" in entry:
                    entry[f"{key}_vs_torch"] = round(entry[f"{key}_images_per_s"]
                                                     / entry["torch_images_per_s"], 3)
        results.append(entry)
    versions = {"cupy": cupy.__version__, "numpy": np.__version__}
    if not args.no_torch:
        import torch
        versions["torch"] = torch.__version__
        versions["cudnn"] = torch.backends.cudnn.version()
    print(json.dumps({"benchmark": "gpu_throughput", "device": name, "device_index": args.device,
                      "batch": args.batch, "iters": args.iters, "warmup": args.warmup,
                      "tf32": args.tf32, "versions": versions, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
