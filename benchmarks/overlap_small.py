"""Is each bucket's allreduce posted the moment its gradients exist, and how
much of the communication runs under compute? The small conv/fc net of
issue 10 on RANKS ranks of this machine (shared memory, no emulated link):

    conv 16 (3x3, pad 1) -> relu -> maxpool 2 -> fc 256 -> relu -> fc 10
    on 3x16x16 synthetic inputs, parallel.bucket_mb 0.25

    .venv/bin/python benchmarks/overlap_small.py [--ranks 2] [--batch 16]
        [--iters 40] [--warmup 5] [--bucket-mb 0.25] [--min-buckets 4]
        [--trace-iters 10:30] [--set KEY=VALUE ...]

Two runs, one BLAS/OpenMP thread per rank:

1. ``python -m purine_mpi bench CONFIG --json`` under ``mpiexec -n RANKS``:
   ``post_latency_ms`` per bucket (median over the timed iterations, the
   worst rank's), ``post_latency_ms_worst`` and ``comm_overlap``;
2. ``python -m purine_mpi train CONFIG --profile-iters A:B`` under the same
   launcher, and the traces ``trace.rank<R>.json`` read back: for every
   traced iteration and rank, each comm event's post latency (its start
   minus the end of the last op that wrote its inputs, the ops taken from
   ``graph --np RANKS --format yaml``; the same as the event's
   ``args.post_latency_us`` up to the microseconds between the end of the
   op and its completion) and the share of its communication time during
   which compute ops ran (the same measure as ``bench``; compute of any
   iteration counts, as a deferred tail runs on into the next); the medians
   over iterations, the worst rank's.

Prints one JSON object {"bench": ..., "trace": ..., "plan": ...}. Targets
(issue 10): worst-bucket post latency <= 0.3 ms, comm_overlap >= 0.5.
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from purine_mpi.tools.bench import comm_overlap  # noqa: E402


def small_net(batch, bucket_mb, min_buckets=None, iters=30):
    return {
        "name": "overlap_small", "seed": 0,
        "data": {"train": {"source": "synthetic", "shape": [3, 16, 16], "classes": 10,
                           "num_samples": 4096, "batch_size": batch}},
        "net": [
            {"type": "conv", "name": "conv1", "bottom": "data", "top": "conv1",
             "num_output": 16, "kernel": 3, "pad": 1},
            {"type": "relu", "name": "relu1", "bottom": "conv1", "top": "conv1"},
            {"type": "pool", "name": "pool1", "bottom": "conv1", "top": "pool1", "pool": "max",
             "kernel": 2, "stride": 2},
            {"type": "fc", "name": "fc1", "bottom": "pool1", "top": "fc1", "num_output": 256},
            {"type": "relu", "name": "relu2", "bottom": "fc1", "top": "fc1"},
            {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2", "num_output": 10},
            {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"], "top": "loss"},
        ],
        "solver": {"base_lr": 0.01, "momentum": 0.9, "lr_policy": "fixed", "max_iter": iters,
                   "display": 0, "test_interval": 0},
        "checkpoint": {"interval": 0, "keep": 1},
        "parallel": dict({"scheme": "data", "mode": "sync", "bucket_mb": bucket_mb},
                         **({"min_buckets": min_buckets} if min_buckets else {})),
    }


def env():
    e = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        e[var] = "1"
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return e


def launch(ranks, args, check=True):
    cmd = [sys.executable, "-m", "purine_mpi"] + args
    if ranks > 1:
        cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(ranks)] + cmd
    out = subprocess.run(cmd, env=env(), capture_output=True, text=True, cwd=ROOT, timeout=900)
    if out.returncode != 0 and check:
        sys.exit(f"{' '.join(args[:2])} failed:\n{out.stdout}\n{out.stderr}")
    return out.stdout if check else out


def comm_inputs(graph_yaml):
    """{comm op: [ops writing its inputs]} from ``graph --format yaml``."""
    items = yaml.safe_load(graph_yaml)["graph"]
    ops = [it for it in items if it["type"] == "op"]
    writers = {}
    for op in ops:
        for b in op.get("outputs", []):
            writers.setdefault(b, []).append(op["name"])
    return {op["name"]: sorted({w for b in op.get("inputs", []) for w in writers.get(b, [])})
            for op in ops if op["op_type"] in ("Allreduce", "Send", "Recv")}


def trace_stats(paths, producers, window):
    """Per traced iteration and rank: each comm event's post latency (its
    start minus the end of the last op that wrote its inputs, both from the
    trace) and the overlap share; medians over iterations, worst rank."""
    per_rank = []
    for path in sorted(paths):
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        by_iter = {}
        for e in events:
            if window[0] <= e["args"]["iter"] < window[1]:
                by_iter.setdefault(e["args"]["iter"], []).append(e)
        overlaps, latencies = [], {}
        # an iteration's transfers may run on under the next one's compute
        # (parallel.defer_update): any compute of the rank covers them
        compute = [e for e in events if e["cat"] != "comm"]
        for it, evs in sorted(by_iter.items()):
            ov = comm_overlap([e for e in evs if e["cat"] == "comm"] + compute)
            if ov is not None:
                overlaps.append(ov)
            end = {e["name"]: e["ts"] + e["dur"] for e in evs}
            for e in evs:
                ready = [end[p] for p in producers.get(e["name"], ()) if p in end]
                if e["cat"] == "comm" and ready:
                    latencies.setdefault(e["name"], []).append(e["ts"] - max(ready))
        per_rank.append({
            "iterations": len(by_iter),
            "comm_overlap_median": round(statistics.median(overlaps), 4) if overlaps else None,
            "post_latency_ms_median": {n: round(statistics.median(v) / 1000, 4)
                                       for n, v in sorted(latencies.items())},
        })
    worst_lat = {}
    for r in per_rank:
        for n, v in r["post_latency_ms_median"].items():
            worst_lat[n] = max(worst_lat.get(n, 0.0), v)
    overlaps = [r["comm_overlap_median"] for r in per_rank if r["comm_overlap_median"] is not None]
    return {"per_rank": per_rank, "post_latency_ms": worst_lat,
            "post_latency_ms_worst": max(worst_lat.values()) if worst_lat else None,
            "comm_overlap_min_rank": min(overlaps) if overlaps else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="per-rank batch")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=0.25)
    ap.add_argument("--min-buckets", type=int, default=None,
                    help="parallel.min_buckets (default: the config default)")
    ap.add_argument("--trace-iters", default="10:30", metavar="A:B")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE", help="passed to both runs")
    ap.add_argument("--no-trace", action="store_true", help="only the bench run")
    args = ap.parse_args()
    start, stop = (int(x) for x in args.trace_iters.split(":"))
    cfg = small_net(args.batch, args.bucket_mb, args.min_buckets, stop)
    sets = [a for s in args.overrides for a in ("--set", s)]
    with tempfile.TemporaryDirectory(prefix="overlap_small") as tmp:
        path = os.path.join(tmp, "overlap_small.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        text = launch(1, ["graph", path, "--np", str(args.ranks)] + sets).splitlines()
        start_plan = [i for i, line in enumerate(text) if line.startswith("bucket plan")]
        plan = [line.strip() for line in text[start_plan[0]:]] if start_plan else None
        producers = comm_inputs(launch(1, ["graph", path, "--np", str(args.ranks),
                                           "--format", "yaml"] + sets))
        bench = json.loads(launch(args.ranks, ["bench", path, "--json", "--iters",
                                               str(args.iters), "--warmup", str(args.warmup)]
                                  + sets).strip().splitlines()[-1])
        out = {"ranks": args.ranks, "batch_per_rank": args.batch, "bucket_mb": args.bucket_mb,
               "buckets": len(producers), "plan": plan,
               "bench": {k: bench.get(k) for k in ("iter_ms_median", "images_per_s",
                                                   "comm_overlap", "post_latency_ms",
                                                   "post_latency_ms_worst", "comm_ms_per_iter",
                                                   "compute_ms_per_iter")}}
        if not args.no_trace:
            run_dir = os.path.join(tmp, "run")
            res = launch(args.ranks, ["train", path, "--out", run_dir, "--profile-iters",
                                      args.trace_iters] + sets, check=False)
            if res.returncode != 0 and "--profile-iters" in res.stderr:
                launch(args.ranks, ["train", path, "--out", run_dir, "--profile"] + sets)
            elif res.returncode != 0:
                sys.exit(f"train failed:\n{res.stdout}\n{res.stderr}")
            traces = glob.glob(os.path.join(run_dir, "**", "trace.rank*.json"), recursive=True)
            out["trace"] = dict(trace_stats(traces, producers, (start, stop)),
                                iters=args.trace_iters)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
