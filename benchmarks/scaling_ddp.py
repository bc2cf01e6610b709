"""Data-parallel scaling on one machine: purine_mpi (bucketed Allreduce in
the graph) against PyTorch DistributedDataParallel (gloo), same net, same
per-rank batch, one BLAS/OpenMP thread per process.

    .venv/bin/python benchmarks/scaling_ddp.py [--config jobs/cifar10_quick.yaml]
        [--iters 20] [--warmup 3] [--ranks 2] [--set KEY=VALUE ...]

purine_mpi runs ``python -m purine_mpi bench CONFIG --json`` on 1 rank and
under ``mpiexec -n RANKS``; PyTorch runs the equivalent network (built from
the config's conv / pool / relu / fc / softmax_loss layers) in 1 process and
in RANKS DDP processes (``--set`` overrides go to purine_mpi's runs, e.g.
``--set parallel.defer_update=false``). Prints one JSON object: images/s and median
iteration time for each, and the per-process efficiency
``(images/s at N) / (N * images/s at 1)``. For purine_mpi it also runs RANKS
independent one-rank processes at once (no communication):
``efficiency_vs_independent`` is the share of that throughput the
data-parallel run keeps, i.e. the cost of the communication alone, apart
from what the cores and memory bandwidth allow N processes. ``--repeat K``
runs K interleaved rounds and reports each figure's median, each round's
efficiencies, and in how many rounds purine_mpi's efficiency was at least
0.95 and at least DDP's.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def one_thread_env():
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "PURINE_THREADS"):
        env[var] = "1"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def peak_rss_bytes():
    """This process's peak RSS in bytes, ``import torch`` included: purine_mpi's
    base/rss.peak_rss_bytes (VmHWM: not the peak of the process that started
    this one, which getrusage's ru_maxrss reports after a vfork), loaded from
    its file, as importing the package would set the PyTorch process's malloc
    arenas and threads."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "purine_rss", os.path.join(ROOT, "purine_mpi", "base", "rss.py"))
    rss = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rss)
    return rss.peak_rss_bytes()


def bench_cmd(config, iters, warmup, sets=()):
    cmd = [sys.executable, "-m", "purine_mpi", "bench", config, "--iters", str(iters),
           "--warmup", str(warmup), "--json"]
    for kv in sets:
        cmd += ["--set", kv]
    return cmd


def purine(config, ranks, iters, warmup, sets=()):
    cmd = bench_cmd(config, iters, warmup, sets)
    if ranks > 1:
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        cmd = [mpiexec, "-n", str(ranks)] + cmd
    out = subprocess.run(cmd, env=one_thread_env(), capture_output=True, text=True, cwd=ROOT,
                         timeout=1800)
    if out.returncode != 0:
        sys.exit(f"purine_mpi bench failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def purine_independent(config, ranks, iters, warmup, sets=()):
    """``ranks`` one-rank bench processes at once, no communication between
    them: what the machine itself allows (cores, memory bandwidth)."""
    cmd = bench_cmd(config, iters, warmup, sets)
    procs = [subprocess.Popen(cmd, env=one_thread_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for _ in range(ranks)]
    outs = [p.communicate(timeout=1800) for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("purine_mpi bench failed:\n" + "\n".join(o + e for o, e in outs))
    res = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    med = statistics.mean(r["iter_ms_median"] for r in res)
    return {"iter_ms_median": round(med, 3),
            "images_per_s": round(sum(r["images_per_s"] for r in res), 2)}


# ------------------------------------------------------------------ torch
def torch_net(config):
    """The config's net as a torch.nn.Sequential (the layer types the
    CIFAR-style configs use)."""
    import torch.nn as nn
    layers, channels, size = [], None, None
    spec = config["data"]["train"]
    channels, size = spec["shape"][0], spec["shape"][1:]
    flat = None
    for layer in config["net"]:
        kind = layer["type"]
        if layer.get("phase") == "test":
            continue
        if kind == "conv":
            k, p, s = layer["kernel"], layer.get("pad", 0), layer.get("stride", 1)
            layers.append(nn.Conv2d(channels, layer["num_output"], k, s, p))
            channels = layer["num_output"]
            size = [(x + 2 * p - k) // s + 1 for x in size]
        elif kind == "pool" and layer.get("global"):
            pool = nn.AdaptiveMaxPool2d if layer.get("pool", "max") == "max" else \
                nn.AdaptiveAvgPool2d
            layers.append(pool(1))
            size = [1, 1]
        elif kind == "pool":
            k, s = layer["kernel"], layer.get("stride", 1)
            ceil = layer.get("ceil_mode", False)
            pool = nn.MaxPool2d if layer.get("pool", "max") == "max" else nn.AvgPool2d
            layers.append(pool(k, s, ceil_mode=ceil))
            rnd = (lambda v: -(-v // s)) if ceil else (lambda v: v // s)
            size = [rnd(x - k) + 1 for x in size]
        elif kind == "relu":
            layers.append(nn.ReLU())
        elif kind == "dropout":
            layers.append(nn.Dropout(layer.get("ratio", 0.5)))
        elif kind == "flatten":
            layers.append(nn.Flatten())
            flat = channels * size[0] * size[1]
        elif kind == "fc":
            if flat is None:
                layers.append(nn.Flatten())
                flat = channels * size[0] * size[1]
            layers.append(nn.Linear(flat, layer["num_output"]))
            flat = layer["num_output"]
        elif kind in ("softmax_loss", "accuracy"):
            continue
        else:
            raise SystemExit(f"scaling_ddp.py: no torch equivalent for layer type {kind!r}")
    return nn.Sequential(*layers)


def torch_worker(rank, world, config, iters, warmup, port, queue):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch_net(config)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(model)
    solver = config["solver"]
    opt = torch.optim.SGD(model.parameters(), lr=solver.get("base_lr", 0.01),
                          momentum=solver.get("momentum", 0.9),
                          weight_decay=solver.get("weight_decay", 0.0))
    spec = config["data"]["train"]
    batch = spec["batch_size"]
    x = torch.randn(batch, *spec["shape"])
    y = torch.randint(0, spec["classes"], (batch,))
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for it in range(warmup + iters):  # timed as `bench` times purine_mpi's
        if it == warmup:
            if world > 1:
                dist.barrier()
            t_prev = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if it >= warmup:
            now = time.perf_counter()
            times.append(now - t_prev)
            t_prev = now
    queue.put((rank, statistics.median(times), peak_rss_bytes()))
    if world > 1:
        dist.destroy_process_group()


def pytorch(config, ranks, iters, warmup):
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    os.environ.update({k: v for k, v in one_thread_env().items() if k.endswith("THREADS")})
    procs = [ctx.Process(target=torch_worker, args=(r, ranks, config, iters, warmup, port,
                                                    queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    reports = [queue.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    med = statistics.mean(r[1] for r in reports)
    batch = config["data"]["train"]["batch_size"]
    return {"world_size": ranks, "iter_ms_median": round(1000 * med, 3),
            "images_per_s": round(batch * ranks / med, 2),
            "max_rss_bytes": max(r[2] for r in reports)}


def one_round(args, config):
    """Both frameworks once, interleaved: {name: figures}."""
    result = {}
    for name, fn in (("purine_mpi", purine), ("pytorch_ddp_gloo", pytorch)):
        if name.startswith("pytorch") and args.skip_torch:
            continue
        extra = (args.set,) if fn is purine else ()
        one = fn(args.config if fn is purine else config, 1, args.iters, args.warmup, *extra)
        many = fn(args.config if fn is purine else config, args.ranks, args.iters, args.warmup,
                  *extra)
        keep = ("images_per_s", "iter_ms_median", "comm_overlap")
        result[name] = {
            "1": {k: one[k] for k in keep if k in one},
            str(args.ranks): {k: many[k] for k in keep if k in many},
            "efficiency": round(many["images_per_s"] / (args.ranks * one["images_per_s"]), 3),
        }
        if fn is purine:
            # the same number of processes with no communication at all:
            # separates the cost of data parallelism from the machine's limits
            alone = purine_independent(args.config, args.ranks, args.iters, args.warmup,
                                       args.set)
            result[name][f"{args.ranks}_independent"] = alone
            result[name]["efficiency_vs_independent"] = round(
                many["images_per_s"] / alone["images_per_s"], 3)
    return result


def _median_of(dicts):
    """Key by key, the median of the numbers (None where some are None)."""
    out = {}
    for k, v in dicts[0].items():
        if isinstance(v, dict):
            out[k] = _median_of([d[k] for d in dicts])
        elif all(isinstance(d[k], (int, float)) for d in dicts):
            out[k] = round(statistics.median(d[k] for d in dicts), 4)
        else:
            out[k] = v
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "jobs", "cifar10_quick.yaml"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of both frameworks, interleaved; the figures are then "
                        "medians over the rounds, with each round's efficiencies under "
                        "'rounds' (the machine's noise is several per cent)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for purine_mpi's runs (repeatable)")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    from purine_mpi.job.config import load_config
    config = load_config(args.config, check_files=False)

    result = {"config": os.path.relpath(args.config, ROOT), "ranks": args.ranks,
              "iters": args.iters, "batch_per_rank": config["data"]["train"]["batch_size"],
              "threads_per_process": 1, "cpu_count": os.cpu_count(), "set": args.set,
              "repeat": args.repeat}
    runs = [one_round(args, config) for _ in range(args.repeat)]
    for name in runs[0]:
        # one round as it was; over several, the median of each figure
        result[name] = runs[0][name] if args.repeat == 1 else _median_of(
            [r[name] for r in runs])
    if args.repeat > 1:
        result["rounds"] = [{name: {"efficiency": r[name]["efficiency"]} for name in r}
                            for r in runs]
        both = [r["purine_mpi"]["efficiency"] >= max(0.95, r["pytorch_ddp_gloo"]["efficiency"])
                for r in runs if "pytorch_ddp_gloo" in r]
        if both:
            result["rounds_purine_at_least_0.95_and_ddp"] = sum(both)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
