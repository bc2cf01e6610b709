"""Pipelining on a balanced 2-stage net: measured bubble against theory,
throughput with micro-batches, and the activations each schedule keeps.

    python benchmarks/pipeline.py [--iters 30] [--warmup 5] [--batch 512] [--width 512]

Runs ``mpiexec -n 2`` of itself (``--worker``) once per setting: M = 1,
M = 4 under ``1f1b``, M = 4 under ``gpipe``, on a net of fc layers cut in
two stages of equal work (stage 0: fc1, fc2; stage 1: fc3, fc4 and a small
classifier; every big layer is width x width), synthetic data, one BLAS
thread per rank. Prints one JSON object.

How each figure is measured (``purine_mpi/tools/pipeline_stats.py``):

- every timed iteration starts after a barrier; its span runs from the
  earliest start to the latest end over both ranks (the ranks' profilers
  share rank 0's clock origin);
- ``bubble.measured``: 1 - mean over stages of the stage's busy time (the
  union of its compute/update/copy op intervals in the trace) / the span,
  median over iterations; ``bubble.theory`` = (p-1)/(m+p-1), which assumes
  equal stages and free communication and leaves out the updates;
- ``stage_cpu_ms_median``: the CPU time each rank's process got per
  iteration (``time.process_time``, all threads): when it is well below the
  stage's busy time, other processes took the cores during its ops;
- ``images_per_s``: global batch / median span; ``speedup_m4_over_m1``
  compares M = 4 (1f1b) with M = 1, ``speedup_m4_gpipe_over_m1`` M = 4
  (gpipe) with M = 1;
- ``peak_live_micro_batches``: per stage, the most micro-batches whose
  activations are live at once (from the start of a micro-batch's first op
  on the stage to the end of its last backward op there), the worst
  iteration; ``peak_activation_bytes`` = that times the bytes of one
  micro-batch's activations on the stage (its non-gradient blobs that own
  storage);
- ``allocated_activation_bytes``: per stage, the bytes the workspace
  really allocated for the micro-batch copies' activations and activation
  gradients (``parallel/micro_memory.activation_bytes`` over the arrays it
  holds). Copies never live at once share buffers (the memory plan), so
  1F1B allocates ``activation_slots`` = min(p - s, M) copies on stage s,
  GPipe all M; ``workspace_bytes`` is everything the workspace allocated
  (weights, gradients and momenta included). M = 1 has no copies: null.
  The runs set ``memory_plan: false`` (one buffer per blob otherwise), so
  these figures show the micro-batch plan alone.
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
sys.path.insert(0, ROOT)


def net_config(micro, schedule, batch, width, iters):
    def fc(name, bottom, n):
        return {"type": "fc", "name": name, "bottom": bottom, "top": name, "num_output": n}

    def relu(name, top):
        return {"type": "relu", "name": name, "bottom": top, "top": top}

    net = [fc("fc1", "data", width), relu("relu1", "fc1"), fc("fc2", "fc1", width),
           relu("relu2", "fc2"), fc("fc3", "fc2", width), relu("relu3", "fc3"),
           fc("fc4", "fc3", width), relu("relu4", "fc4"), fc("fc5", "fc4", 10),
           {"type": "softmax_loss", "name": "loss", "bottom": ["fc5", "label"], "top": "loss"}]
    stages = {layer["name"]: (0 if layer["name"] in ("fc1", "relu1", "fc2", "relu2") else 1)
              for layer in net}
    return {"name": "pipeline_bench", "seed": 1,
            "data": {"train": {"source": "synthetic", "shape": [width], "classes": 10,
                               "batch_size": batch, "num_samples": batch * 8}},
            "net": net, "solver": {"base_lr": 0.01, "max_iter": iters, "display": 0},
            "parallel": {"scheme": "pipeline", "stages": stages, "micro_batches": micro,
                         "schedule": schedule},
            # the micro-batch plan alone: the host arena (memory_plan,
            # runtime/memory_plan.py) would share the copies' bytes further
            # and blur what 1F1B and GPipe allocate
            "memory_plan": False}


# ------------------------------------------------------------------ worker
def worker(args):
    import numpy as np
    from purine_mpi.comm.world import get_world, install_abort_handler
    from purine_mpi.job.config import resolve_job
    from purine_mpi.parallel.micro_memory import activation_bytes
    from purine_mpi.tools.pipeline_stats import micro_batch_of
    from purine_mpi.runtime.trace import Profiler
    from purine_mpi.train.trainer import Trainer
    world = get_world()
    install_abort_handler(world)
    job = resolve_job(net_config(args.micro, args.schedule, args.batch, args.width,
                                 args.warmup + args.iters))
    trainer = Trainer(job, "/nonexistent-bench-output", world=world, log=lambda m: None)
    epoch = float(world.allreduce(np.array([time.time() if world.rank == 0 else 0.0]))[0])
    d = trainer.train
    spans = []
    try:
        for it in range(args.warmup + args.iters):
            if it == args.warmup:
                d.profiler = Profiler(world.rank, epoch)
            world.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            trainer.step(it)
            t1, c1 = time.perf_counter(), time.process_time()
            if it >= args.warmup:
                t_origin = d.profiler.t0
                spans.append((it, (t0 - t_origin) * 1e6, (t1 - t_origin) * 1e6,
                              (c1 - c0) * 1e6))
        events = d.profiler.events
    finally:
        trainer.close()
    g = trainer.graphs.graph
    per_mb = {}
    for b in g.blobs.values():
        k = micro_batch_of(b.name)
        if k is None and args.micro == 1:
            k = 0 if b.kind not in ("param", "grad", "bucket") and b.name not in (
                "iter", "lr") and "momentum" not in b.name else None
        if k is not None and b.kind != "grad" and b.alias_of is None:
            per_mb[k] = per_mb.get(k, 0) + b.nbytes
    plan = trainer.graphs.memory_plan
    mine = {"events": events, "spans": spans, "activation_bytes_per_mb": max(per_mb.values()),
            "workspace_bytes": int(trainer.ws.allocated_bytes),
            "allocated_activation_bytes": (activation_bytes(g, trainer.ws)
                                           if args.micro > 1 else None),
            "activation_slots": plan["slots"] if plan else None}
    every = world.gather_object(mine, 0, "the benchmark results")
    if world.rank == 0:
        print(json.dumps(summarise(every, args)))


def summarise(ranks, args):
    from purine_mpi.tools.pipeline_stats import (bubble_fraction, busy_us, live_micro_batches,
                                                 theory_bubble)
    p = len(ranks)
    iters = [s[0] for s in ranks[0]["spans"]]
    spans, bubbles, busy_ms = [], [], [[] for _ in ranks]
    peaks = [0] * p
    for it in iters:
        start = min(s[1] for r in ranks for s in r["spans"] if s[0] == it)
        end = max(s[2] for r in ranks for s in r["spans"] if s[0] == it)
        busy = []
        for rank, r in enumerate(ranks):
            ev = [e for e in r["events"] if e.get("args", {}).get("iter") == it]
            busy.append(busy_us(ev))
            busy_ms[rank].append(busy[-1] / 1000)
            if args.micro > 1:
                peaks[rank] = max(peaks[rank], live_micro_batches(ev)[0])
            else:
                peaks[rank] = 1
        spans.append(end - start)
        bubbles.append(bubble_fraction(busy, end - start))
    span = statistics.median(spans)
    return {
        "micro_batches": args.micro, "schedule": args.schedule, "stages": p,
        "global_batch": args.batch, "iters": len(iters),
        "iter_ms_median": round(span / 1000, 3),
        "images_per_s": round(args.batch / (span / 1e6), 1),
        "stage_busy_ms_median": [round(statistics.median(b), 3) for b in busy_ms],
        # CPU time the rank's process got (all its threads): far below its busy
        # time when other processes share the cores
        "stage_cpu_ms_median": [round(statistics.median(s[3] for s in r["spans"]) / 1000, 3)
                                for r in ranks],
        "bubble": {"measured": round(statistics.median(bubbles), 4),
                   "theory": round(theory_bubble(p, args.micro), 4)},
        "peak_live_micro_batches": peaks,
        "peak_activation_bytes": [n * r["activation_bytes_per_mb"]
                                  for n, r in zip(peaks, ranks)],
        "activation_bytes_per_micro_batch": [r["activation_bytes_per_mb"] for r in ranks],
        "activation_slots": [r["activation_slots"] for r in ranks],
        "allocated_activation_bytes": [r["allocated_activation_bytes"] for r in ranks],
        "workspace_bytes": [r["workspace_bytes"] for r in ranks],
    }


# ------------------------------------------------------------------ driver
def one_thread_env():
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run(micro, schedule, args):
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = "mpiexec"
    cmd = [mpiexec, "-n", "2", sys.executable, os.path.abspath(__file__), "--worker",
           "--micro", str(micro), "--schedule", schedule, "--iters", str(args.iters),
           "--warmup", str(args.warmup), "--batch", str(args.batch), "--width", str(args.width)]
    out = subprocess.run(cmd, env=one_thread_env(), capture_output=True, text=True, cwd=ROOT,
                         timeout=1800)
    if out.returncode != 0:
        sys.exit(f"benchmark run failed ({' '.join(cmd)}):\n{out.stdout}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=512, help="global batch (one pipeline)")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--micro", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--schedule", default="1f1b", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    runs = {"m1": run(1, "1f1b", args), "m4_1f1b": run(4, "1f1b", args),
            "m4_gpipe": run(4, "gpipe", args)}
    result = {
        "benchmark": "pipeline", "stages": 2, "global_batch": args.batch, "width": args.width,
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "note": "2 ranks under mpiexec, one BLAS thread each, on a machine whose cores other "
                "jobs may share (see load_average_1min): timings are indicative",
        "bubble": {k: v["bubble"] for k, v in runs.items()},
        "images_per_s": {k: v["images_per_s"] for k, v in runs.items()},
        "speedup_m4_over_m1": round(runs["m4_1f1b"]["images_per_s"] /
                                    runs["m1"]["images_per_s"], 3),
        "speedup_m4_gpipe_over_m1": round(runs["m4_gpipe"]["images_per_s"] /
                                          runs["m1"]["images_per_s"], 3),
        "peak_live_micro_batches": {"1f1b": runs["m4_1f1b"]["peak_live_micro_batches"],
                                    "gpipe": runs["m4_gpipe"]["peak_live_micro_batches"],
                                    "theory": {"1f1b": [2, 1], "gpipe": [4, 4]}},
        "peak_activation_bytes": {"1f1b": runs["m4_1f1b"]["peak_activation_bytes"],
                                  "gpipe": runs["m4_gpipe"]["peak_activation_bytes"]},
        "allocated_activation_bytes": {
            "1f1b": runs["m4_1f1b"]["allocated_activation_bytes"],
            "gpipe": runs["m4_gpipe"]["allocated_activation_bytes"],
            "slots": {"1f1b": runs["m4_1f1b"]["activation_slots"],
                      "gpipe": runs["m4_gpipe"]["activation_slots"]}},
        "workspace_bytes": {k: v["workspace_bytes"] for k, v in runs.items()},
        "runs": runs,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
