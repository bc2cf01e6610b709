"""One-process CPU training speed: purine_mpi against PyTorch CPU doing the
same steps, one BLAS/OpenMP thread each, in interleaved pairs.

    .venv/bin/python benchmarks/cpu_speed.py [--config jobs/cifar10_quick.yaml ...]
        [--pairs 5] [--iters 20] [--warmup 3] [--set KEY=VALUE ...]

Each pair runs ``python -m purine_mpi bench CONFIG --json`` and then the
PyTorch script of ``scaling_ddp.py`` (the config's net as a torch.nn
Sequential, SGD with the config's momentum and weight decay, a synthetic
batch), one process each, one after the other; the next pair starts with
PyTorch, so neither side always runs first. Prints one JSON object: per
config, each side's images/s (median and range over the pairs), every
pair's ratio (purine_mpi / PyTorch) and their median and range. Timing is
wall clock, as ``bench`` reports it; on a shared machine compare the ratios
of one run, not figures across runs.
"""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from scaling_ddp import purine, pytorch  # noqa: E402


def _summary(values):
    return {"median": round(statistics.median(values), 2),
            "range": [round(min(values), 2), round(max(values), 2)]}


def compare(path, args):
    from purine_mpi.io.config import load_config
    config = load_config(path, check_files=False)
    ours, theirs, ratios = [], [], []
    for i in range(args.pairs):
        run = {}
        order = ("purine_mpi", "pytorch") if i % 2 == 0 else ("pytorch", "purine_mpi")
        for side in order:
            if side == "purine_mpi":
                run[side] = purine(path, 1, args.iters, args.warmup, args.set)["images_per_s"]
            else:
                run[side] = pytorch(config, 1, args.iters, args.warmup)["images_per_s"]
        ours.append(run["purine_mpi"])
        theirs.append(run["pytorch"])
        ratios.append(run["purine_mpi"] / run["pytorch"])
    return {"batch": config["data"]["train"]["batch_size"],
            "purine_mpi_images_per_s": _summary(ours),
            "pytorch_images_per_s": _summary(theirs),
            "ratio": dict(_summary(ratios), pairs=[round(r, 3) for r in ratios])}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", nargs="+",
                   default=[os.path.join(ROOT, "jobs", "cifar10_quick.yaml")])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for purine_mpi's runs (repeatable)")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    result = {"threads_per_process": 1, "pairs": args.pairs, "iters": args.iters,
              "warmup": args.warmup, "set": args.set, "load_average": list(os.getloadavg())}
    for path in args.config:
        result[os.path.relpath(path, ROOT)] = compare(path, args)
    result["load_average_after"] = list(os.getloadavg())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
