"""Activation recompute (config key ``recompute``, graph/recompute.py): the
memory plan's figures and the time per iteration of ``none``, ``full`` and
``selective`` on one job, interleaved.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/recompute.py \\
        [--config jobs/gpt_small.yaml] [--batch 16] [--rounds 3] [--iters 5] [--warmup 2] \\
        [--set KEY=VALUE ...]

The plan (no iteration run): each mode's training graph for one rank, planned
as the trainer plans it (``graph --memory``: order_ops on): the arena
(``planned_bytes``), and at the schedule position where the planned live
bytes peak, the op there and the live bytes split into activations and
gradients (runtime/memory_plan.py, ``peak_live``); the (N, H, T, T) share
of the activations at the peak (blobs of attention's scores, probs and
attention dropout), the share ``selective`` can recompute.

The time: each round runs ``bench --json`` once per mode (one process each,
the order rotating from round to round, synthetic data of the job's shapes
where its data file is absent), and each mode's figure is the median over
rounds of its ``iter_ms_median``; ``time_ratio`` is the median of the
rounds' ratios to ``none``. Prints one JSON object.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = ("none", "full", "selective")
TT_TAGS = (".scores", ".probs", ".attn_drop")


def plan_figures(config, sets, mode):
    sys.path.insert(0, ROOT)
    from purine_mpi.job.config import load_config
    from purine_mpi.job.job import job_of
    from purine_mpi.runtime.factory import memory_plans
    from purine_mpi.runtime.memory_plan import batch_blobs, peak_live
    from purine_mpi.tools.graph import compose_for
    job = job_of(load_config(config, overrides=list(sets) + [f"recompute={mode}"],
                             check_files=False))
    graph = compose_for(job, 1, 0)
    plan, _ = memory_plans(graph, keep=batch_blobs(graph), order_ops=True)
    at, op, split = peak_live(graph, plan)
    tt = 0
    for root, (first, last) in plan.lifetimes.items():
        if first <= at <= last and root not in plan.in_place and \
                graph.blobs[root].kind != "grad" and \
                any(tag in root for tag in TT_TAGS) and len(graph.blobs[root].shape) == 4:
            tt += plan.sizes[root]
    return {"planned_bytes": plan.planned_bytes, "peak_op": op, "peak_position": at,
            "peak_activation_bytes": split["activations"],
            "peak_gradient_bytes": split["gradients"],
            "peak_tt_activation_bytes": tt}


def bench_once(config, sets, mode, iters, warmup):
    args = [sys.executable, "-m", "purine_mpi", "bench", config, "--json", "--iters", str(iters),
            "--warmup", str(warmup)]
    for s in list(sets) + [f"recompute={mode}"]:
        args += ["--set", s]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"bench {mode} failed ({res.returncode}): {res.stderr.strip()[-400:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "jobs", "gpt_small.yaml"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    a = ap.parse_args()
    sets = [f"data.train.batch_size={a.batch}"] + a.sets
    plans = {m: plan_figures(a.config, sets, m) for m in MODES}
    times, ratios = {m: [] for m in MODES}, {m: [] for m in MODES}
    for r in range(a.rounds):
        order = MODES[r % 3:] + MODES[:r % 3]
        got = {m: bench_once(a.config, sets, m, a.iters, a.warmup)["iter_ms_median"]
               for m in order}
        for m in MODES:
            times[m].append(got[m])
            ratios[m].append(got[m] / got["none"])
        print(json.dumps({"round": r, "iter_ms": got}), file=sys.stderr, flush=True)
    base = plans["none"]
    out = {"config": a.config, "batch": a.batch, "rounds": a.rounds, "iters": a.iters,
           "modes": {}}
    for m in MODES:
        p = plans[m]
        timed = bool(times[m])  # --rounds 0: the plan alone
        out["modes"][m] = dict(
            p, iter_ms_median=statistics.median(times[m]) if timed else None, iter_ms=times[m],
            time_ratio=round(statistics.median(ratios[m]), 4) if timed else None,
            planned_ratio=round(p["planned_bytes"] / base["planned_bytes"], 4),
            peak_activation_ratio=round(p["peak_activation_bytes"]
                                        / base["peak_activation_bytes"], 4))
    out["tt_share_of_peak_activations_none"] = round(
        base["peak_tt_activation_bytes"] / base["peak_activation_bytes"], 4)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
