"""One-process CPU training speed: purine_mpi against PyTorch CPU doing the
same steps, one BLAS/OpenMP thread each, in interleaved pairs.

    .venv/bin/python benchmarks/cpu_speed.py [--config jobs/cifar10_quick.yaml ...]
        [--pairs 5] [--iters 20] [--warmup 3] [--set KEY=VALUE ...] [--baseline DIR]

Each pair runs ``python -m purine_mpi bench CONFIG --json`` and the
PyTorch script of ``scaling_ddp.py`` (the config's net as a torch.nn
Sequential, SGD with the config's momentum and weight decay, a synthetic
batch), one process each, one after the other; the pairs take turns at
going first. A config reading a ``text`` source (jobs/gpt_tiny.yaml) is a
GPT: its PyTorch side is ``gpt_torch.py``'s nanoGPT model with the job's
AdamW, rate schedule and clipping, and the figures are tokens/s
(``bench`` reads the job's token file: make it first, or point
``--set data.train.path=...`` at one). Prints one JSON object: per
config, each side's images/s (median and range over the pairs), every
pair's ratio (purine_mpi / PyTorch) and their median and range, and each
side's peak RSS in MiB (``*_max_rss_mib``: the whole process, its
framework's import included, as ``/usr/bin/time -v`` reports it; VmHWM,
not getrusage's ru_maxrss, which a process started here with subprocess
inherits from this one: base/rss.peak_rss_bytes). Timing is
wall clock, as ``bench`` reports it; on a shared machine compare the ratios
of one run, not figures across runs. ``--baseline DIR`` (a checkout of
another version, e.g. made by ``git worktree add DIR main``) adds its
``bench`` to every round (the rounds then rotate three sides) and reports
its images/s and this checkout's speed-up over it.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from gpt_torch import pytorch_process  # noqa: E402
from scaling_ddp import bench_cmd, one_thread_env, purine, pytorch  # noqa: E402


def purine_at(root, config, iters, warmup, sets):
    """``bench --json`` of the checkout at ``root`` (one process)."""
    env = one_thread_env()
    env["PYTHONPATH"] = root
    out = subprocess.run(bench_cmd(os.path.abspath(config), iters, warmup, sets), env=env,
                         capture_output=True, text=True, cwd=root, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"bench in {root} failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summary(values):
    return {"median": round(statistics.median(values), 2),
            "range": [round(min(values), 2), round(max(values), 2)]}


def compare(path, args):
    from purine_mpi.job.config import load_config
    config = load_config(path, check_files=False)
    text = config["data"]["train"].get("source") == "text"
    rate = "tokens_per_s" if text else "images_per_s"
    sides = ["purine_mpi", "pytorch"] + (["baseline"] if args.baseline else [])
    runs = []
    for i in range(args.pairs):
        run = {}
        for side in sides[i % len(sides):] + sides[:i % len(sides)]:  # rotate who goes first
            if side == "purine_mpi":
                run[side] = purine(path, 1, args.iters, args.warmup, args.set)
            elif side == "baseline":
                run[side] = purine_at(args.baseline, path, args.iters, args.warmup, args.set)
            elif text:
                os.environ.update({k: v for k, v in one_thread_env().items()
                                   if k.endswith("THREADS")})
                run[side] = pytorch_process(config, args.iters, args.warmup)
            else:
                run[side] = pytorch(config, 1, args.iters, args.warmup)
        runs.append(run)

    def figures(side, key, scale=1.0):
        return [r[side][key] / scale for r in runs]
    ratios = [a / b for a, b in zip(figures("purine_mpi", rate), figures("pytorch", rate))]
    mib = 2.0 ** 20
    result = {"batch": config["data"]["train"]["batch_size"],
              f"purine_mpi_{rate}": _summary(figures("purine_mpi", rate)),
              f"pytorch_{rate}": _summary(figures("pytorch", rate)),
              "ratio": dict(_summary(ratios), pairs=[round(r, 3) for r in ratios]),
              # each process's peak RSS, the import of its framework included
              "purine_mpi_max_rss_mib": _summary(figures("purine_mpi", "max_rss_bytes", mib)),
              "pytorch_max_rss_mib": _summary(figures("pytorch", "max_rss_bytes", mib))}
    if args.baseline:
        speedups = [a / b for a, b in zip(figures("purine_mpi", rate),
                                          figures("baseline", rate))]
        result[f"baseline_{rate}"] = _summary(figures("baseline", rate))
        result["speedup_over_baseline"] = dict(_summary(speedups),
                                               rounds=[round(x, 3) for x in speedups])
        result["baseline_max_rss_mib"] = _summary(
            [r["baseline"].get("max_rss_bytes", float("nan")) / mib for r in runs])
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", nargs="+",
                   default=[os.path.join(ROOT, "jobs", "cifar10_quick.yaml")])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for purine_mpi's runs (repeatable)")
    p.add_argument("--baseline", help="a checkout of another purine_mpi version to time too")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    result = {"threads_per_process": 1, "pairs": args.pairs, "iters": args.iters,
              "warmup": args.warmup, "set": args.set, "baseline": args.baseline,
              "load_average": list(os.getloadavg())}
    for path in args.config:
        result[os.path.relpath(path, ROOT)] = compare(path, args)
    result["load_average_after"] = list(os.getloadavg())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
