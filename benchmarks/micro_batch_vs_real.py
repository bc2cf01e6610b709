"""What more micro-batches cost, predicted (``plan --choose``'s model) and
measured: the iteration at ``parallel.micro_batches`` M over the one at 1.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python \\
        benchmarks/micro_batch_vs_real.py [--configs benchmarks/cifar10_quick_wide.yaml \\
        jobs/gpt_small.yaml] [--ranks 1 2] [--micro 1 2 4] [--rounds 3] [--iters 10] \\
        [--warmup 3] [--calibration-dir DIR]

Per config (shortened as benchmarks/sharded.py's ``SHORTEN`` says, a token
file made where a text job's is absent):

1. a fresh calibration (tools/choose.calibrate: two traced runs of one rank,
   at the batch and at a quarter of it) in the ranks' environment (one BLAS
   thread: benchmarks/sharded.py ``rank_env``), into ``--calibration-dir``;
2. the predicted seconds per iteration at each rank count and micro-batch
   count (data parallel, the global batch unchanged), by the model
   (``Predictor``: the dispatcher's cost per op apart from its cost per
   iteration, each op's cost per call fitted from its least traced times;
   docs/scaling.md) and by the rule before (``"before"``: the same
   calibration without its gaps and least times: the traced iteration's
   whole remainder spread over the ops, the cost per call fitted from the
   ops' medians);
3. ``bench --json`` of each setting, rounds interleaved, the order rotating
   per round, ``mpiexec -n R`` for R > 1.

Prints one JSON object: per config and rank count, per M the predicted
seconds of both rules and their ratio to M = 1, the measured median
iteration of each round and the median over the rounds of the per-round
ratio to M = 1 (each round's settings ran back to back).
"""
import argparse
import copy
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sharded  # noqa: E402  (benchmarks/sharded.py: the ranks' environment, bench runs)

sys.path.insert(0, sharded.ROOT)


def predictions(config, base, ranks, micro, cache):
    """{n: {m: {"model": s, "before": s}}} and the calibration's costs."""
    from purine_mpi.job.config import load_job
    from purine_mpi.tools.choose import Predictor, calibrate
    from purine_mpi.tools.scaling.link import make_link
    job = load_job(config, tuple(base), check_files=False)
    durations, small, calib_job, add = calibrate(job, config, tuple(base), cache,
                                                 lambda s: print(s, file=sys.stderr))
    link = make_link(None, None, None, gamma=add)
    model = Predictor(calib_job, durations, link, small=small, add=add)
    bare = copy.copy(durations)
    bare.gaps, bare.fastest = {}, {}
    bare_small = None
    if small is not None:
        bare_small = (copy.copy(small[0]), small[1])
        bare_small[0].fastest = {}
    old = Predictor(calib_job, bare, link, small=bare_small, add=add)
    out = {}
    for n in ranks:
        out[n] = {}
        for m in micro:
            j = load_job(config, tuple(base) + ("parallel.scheme=data",
                                                f"parallel.micro_batches={m}"),
                         check_files=False)
            out[n][m] = {"model": model.predict(j, n)[0], "before": old.predict(j, n)[0]}
    costs = {"overhead_us_per_op": round(model.overhead * 1e6, 2),
             "per_iteration_ms": round(model.per_iteration * 1e3, 3),
             "before_overhead_us_per_op": round(old.overhead * 1e6, 2),
             "traced_iter_ms": round(durations.iter_seconds[0] * 1e3, 3),
             "gap_us_per_op": round(durations.gaps.get(0, 0.0) * 1e6, 2)}
    return out, costs


def measure(config, base, n, micro, a):
    """{m: [median iteration seconds per round]}, rounds interleaved."""
    runs = {m: [] for m in micro}
    for r in range(a.rounds):
        k = r % len(micro)
        for m in micro[k:] + micro[:k]:
            got = sharded.bench_once(config, base + ["parallel.scheme=data",
                                                     f"parallel.micro_batches={m}"],
                                     n, a.iters, a.warmup)
            runs[m].append(got["iter_ms_median"] / 1e3)
            print(f"  {os.path.basename(config)} {n} rank(s) round {r + 1}: {m} micro-batches "
                  f"{got['iter_ms_median']:.1f} ms/iter", file=sys.stderr, flush=True)
    return runs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=[
        os.path.join("benchmarks", "cifar10_quick_wide.yaml"),
        os.path.join("jobs", "gpt_small.yaml")])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--calibration-dir", default=None)
    p.add_argument("--set", action="append", default=[])
    a = p.parse_args(argv)
    os.environ.clear()
    os.environ.update(sharded.rank_env())  # the calibration runs as the ranks do
    folder = a.calibration_dir or tempfile.mkdtemp(prefix="micro_vs_real-")
    os.makedirs(folder, exist_ok=True)
    out = {"ranks": a.ranks, "micro": a.micro, "rounds": a.rounds, "iters": a.iters,
           "configs": {}}
    for config in a.configs:
        if not os.path.exists(config):
            config = os.path.join(sharded.ROOT, config)
        config = os.path.abspath(config)
        base = sharded.base_sets(config, a.set, folder)
        name = os.path.splitext(os.path.basename(config))[0]
        pred, costs = predictions(config, base, a.ranks, a.micro,
                                  os.path.join(folder, f"{name}.calibration.json"))
        entry = {"sets": base, "calibration": costs, "by_ranks": {}}
        for n in a.ranks:
            runs = measure(config, base, n, a.micro, a)
            m1 = a.micro[0]
            rows = {}
            for m in a.micro:
                ratios = [x / y for x, y in zip(runs[m], runs[m1])]
                rows[m] = {
                    "predicted_s": round(pred[n][m]["model"], 5),
                    "predicted_ratio": round(pred[n][m]["model"] / pred[n][m1]["model"], 3),
                    "before_s": round(pred[n][m]["before"], 5),
                    "before_ratio": round(pred[n][m]["before"]
                                               / pred[n][m1]["before"], 3),
                    "measured_s_rounds": [round(x, 5) for x in runs[m]],
                    "measured_ratio": round(statistics.median(ratios), 3),
                    "measured_ratio_range": [round(min(ratios), 3), round(max(ratios), 3)]}
            entry["by_ranks"][n] = rows
        out["configs"][name] = entry
        print(json.dumps(entry), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
