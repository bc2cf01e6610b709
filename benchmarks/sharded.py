"""Sharded data parallelism (``parallel.scheme: sharded``, issue 43) against
plain data parallelism, side by side, on the same ranks and the same global
batch.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/sharded.py \\
        [--configs jobs/gpt_small.yaml jobs/cifar10_quick.yaml] [--ranks 2] [--pairs 3] \\
        [--iters 5] [--warmup 2] [--check-steps 5] [--check-solver adamw|sgd] \\
        [--set KEY=VALUE ...]

The settings: ``data`` and ``sharded`` at each ``parallel.shard`` value the
config accepts, read from the config's own validation (``shard_values``:
from the key's least value up, a value is accepted when the config with
``scheme: sharded`` and that ``shard`` loads; the values end where the key
itself refuses one under ``scheme: data``), so ZeRO's stages join as they
are built. Every run is ``mpiexec -n RANKS python -m purine_mpi bench CONFIG
--json`` (the same per-rank batch, so the same global batch; one BLAS/OpenMP
thread per rank, and OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE taken out of the
ranks' environment, as the other CPU benchmarks run: those variables pin
OpenBLAS to a core type and cache size that need not be this host's). Each
pair runs every setting once, the order rotating from pair to pair
(interleaved: load on the shared machine falls on every setting alike).
The configs are shortened by ``SHORTEN`` (and ``--set``): a text job gets
a token file made from Python's ``email`` package when its own is absent.

Prints one JSON object, per config and setting:

- ``images_per_s`` (and ``tokens_per_s`` for a text job): the median over
  the pairs of ``bench``'s figure (global batch / median iteration);
  ``ratio_to_data``: the median of the pairs' ratios to ``data`` in the
  same pair, with their range;
- ``model_state_bytes``, ``model_state_peak_bytes``: ``bench --json``'s
  (rank 0: weights, gradients, optimizer state, held and live at once),
  ``model_state_bytes_per_rank`` every rank's totals (deterministic: the
  first pair's);
- ``max_rss_mib_per_rank``: each rank's peak resident memory, the median
  over the pairs;
- ``comm_hidden_ms_per_iter``: rank 0's communication hidden behind
  compute, from ``bench``'s trace of the timed iterations: the wall time
  with a comm op in flight (``comm_in_flight_ms_per_iter``) less the part
  with no compute op running (``comm_exposed_ms_per_iter``); with
  ``comm_in_flight_ms_per_iter`` and ``comm_overlap`` beside it (medians);
- the bytes reduce-scattered, allgathered and allreduced per iteration.

``--check-steps K`` (default 5; 0: off): each setting also trains K AdamW
steps from the same seed (``train``, ``solver.type: adamw``, no test, no
checkpoints but the last), and every parameter of its last checkpoint is
compared with data parallelism's: ``max_rel_diff`` = the largest over the
parameters of max |sharded - data| / max |data| (0: bitwise), with the
parameter where it falls. ``--check-solver sgd`` trains those steps with
SGD and momentum instead (``solver.type: sgd``, ``solver.momentum: 0.9``:
issue 43's second tolerance, 2e-6); the check names its solver.
``--set parallel.reduce_scatter=false`` runs every sharded setting with
each bucket summed by data parallelism's allreduce (its sums: the check's
``max_rel_diff`` 0 at any rank count; scheme data ignores the key, a
note), and the JSON's ``reduce_scatter`` says which was run. Timing
is wall clock on a shared machine: compare the ratios of one run, not
figures across runs.

``--rss``: memory instead of time. Each setting trains ``--iters``
iterations (``train --iters``, no test, a checkpoint at the end only; ``--pairs`` runs
each, the order rotating, and each rank's figures are the medians) and its
OUT/memory.json gives every rank's peak resident bytes and the model state
its memory plan holds (``held``: weights, gradients, optimizer state) and
has live at its peak (``peak``: held plus the transient buckets' working
set); rss_vs_plan.train_memory runs it. The RSS compared is
``loop_peak_rss_bytes``, the high-water mark after the last iteration
(``peak_rss_bytes``, beside it, also holds the end's checkpoint, which a
sharded run streams to rank 0 a bucket at a time). Against ``data``, per rank: the
saving in that peak RSS, in held and in peak model state, and
``rss_per_peak_saving`` = (RSS saving) / (peak model-state saving) and
``rss_per_held_saving`` = (RSS saving) / (held model-state saving); their
least over the ranks beside them. Prints one JSON object: the job, the
solver, the settings (``--settings`` picks some), each with those figures.

    .venv/bin/python benchmarks/sharded.py --rss --configs jobs/gpt_small.yaml --ranks 4 \
        --iters 3 --pairs 1 --settings data sharded_shard3
"""
import argparse
import email
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)  # rss_vs_plan

#: per config: what shortens it to a benchmark (``--set`` goes after these)
SHORTEN = {
    "gpt_small": ["data.train.batch_size=4", "data.train.sequence_length=64", "data.test=null"],
    "cifar10_quick": ["data.train.batch_size=32"],
}
#: the variables taken out of the ranks' environment (see the docstring)
OPENBLAS_PINS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
#: the venv's own mpiexec (the MPICH of its mpi4py)
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
#: where shard_values stops when the key refuses no value (a safety bound)
MAX_SHARD_PROBE = 64


def rank_env():
    env = {k: v for k, v in os.environ.items() if k not in OPENBLAS_PINS}
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "PURINE_THREADS"):
        env[var] = "1"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _loads(config, sets):
    from purine_mpi.base.errors import UserError
    from purine_mpi.job.config import load_config
    try:
        load_config(config, overrides=list(sets), check_files=False)
        return True
    except UserError:
        return False


def shard_values(config, sets=()):
    """The ``parallel.shard`` values ``config`` accepts with ``scheme:
    sharded`` (see the module docstring), ascending."""
    from purine_mpi.job.schema import PARALLEL
    key = next(k for k in PARALLEL if k.name == "shard")
    values, k = [], int(key.default)
    while k > 0 and _loads(config, list(sets) + ["parallel.scheme=data",
                                                 f"parallel.shard={k - 1}"]):
        k -= 1  # the least value the key takes (its default need not be it)
    while k <= MAX_SHARD_PROBE and _loads(config, list(sets) + ["parallel.scheme=data",
                                                                f"parallel.shard={k}"]):
        if _loads(config, list(sets) + ["parallel.scheme=sharded", f"parallel.shard={k}"]):
            values.append(k)
        k += 1
    return values


def settings_of(config, sets=()):
    """{setting name: its --set overrides}: data, then sharded at each stage."""
    out = {"data": ["parallel.scheme=data"]}
    for k in shard_values(config, sets):
        out[f"sharded_shard{k}"] = ["parallel.scheme=sharded", f"parallel.shard={k}"]
    return out


def token_file(folder):
    """A token file of Python's email package (what jobs/gpt_small.yaml's
    comment makes) in ``folder``."""
    path = os.path.join(folder, "email.h5")
    if not os.path.exists(path):
        res = subprocess.run([sys.executable, "-m", "purine_mpi", "data", "text", "--from",
                              os.path.dirname(email.__file__), "--glob", "*.py", "--out", path],
                             cwd=ROOT, env=rank_env(), capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"making the token file failed: {res.stderr.strip()[-400:]}")
    return path


def base_sets(config, extra, folder):
    """The shortening of ``config`` and ``extra``, with a token file when the
    config reads a text file that is not there."""
    from purine_mpi.job.config import load_config
    name = os.path.splitext(os.path.basename(config))[0]
    sets = list(SHORTEN.get(name, [])) + list(extra)
    cfg = load_config(config, overrides=sets, check_files=False)
    train = cfg["data"]["train"]
    if train.get("source") == "text" and not os.path.exists(os.path.join(ROOT, train["path"])) \
            and not os.path.exists(train["path"]):
        sets.append(f"data.train.path={token_file(folder)}")
    return sets


def mpi_cmd(ranks, args):
    cmd = [sys.executable, "-m", "purine_mpi", *args]
    if ranks > 1:
        cmd = [MPIEXEC, "-n", str(ranks)] + cmd
    return cmd


def run(ranks, args, what):
    res = subprocess.run(mpi_cmd(ranks, args), cwd=ROOT, env=rank_env(), capture_output=True,
                         text=True, timeout=3600)
    if res.returncode != 0:
        sys.exit(f"{what} failed ({res.returncode}): {res.stderr.strip()[-600:]}")
    return res.stdout


def bench_once(config, sets, ranks, iters, warmup):
    args = ["bench", config, "--json", "--iters", str(iters), "--warmup", str(warmup)]
    for s in sets:
        args += ["--set", s]
    out = run(ranks, args, f"bench {' '.join(sets[-2:])}")
    return json.loads(out.strip().splitlines()[-1])


#: ``--check-solver``: the solver settings of the parameter check
CHECK_SOLVERS = {"adamw": ["solver.type=adamw"],
                 "sgd": ["solver.type=sgd", "solver.momentum=0.9"]}


def trained_params(config, sets, ranks, steps, out, solver="adamw"):
    """The parameters after ``steps`` steps of ``config`` under ``solver``
    (a CHECK_SOLVERS key): {name: array}."""
    from purine_mpi.job.checkpoint_file import load_params
    args = ["train", config, "--out", out]
    for s in CHECK_SOLVERS[solver]:
        args += ["--set", s]
    args += ["--set", f"solver.max_iter={steps}", "--set", "solver.display=0",
            "--set", "solver.test_interval=0", "--set", "data.test=null",
            "--set", "checkpoint.interval=0"]
    for s in sets:
        args += ["--set", s]
    run(ranks, args, f"train {' '.join(sets[-2:])}")
    return {k: v for k, v in load_params(os.path.join(out, "latest.h5")).items()
            if not k.startswith("solver/")}


def memory_once(config, sets, ranks, iters, run_dir):
    """Every rank's OUT/memory.json figures after ``iters`` iterations of
    ``train`` (no test; a checkpoint at the end only), rank order."""
    from rss_vs_plan import train_memory
    args = ["--set", "solver.display=0", "--set", "solver.test_interval=0",
            "--set", "data.test=null", "--set", "checkpoint.interval=0"]
    for s in sets:
        args += ["--set", s]
    got = train_memory(config, args, run_dir, ranks, iters, rank_env(), MPIEXEC)
    if isinstance(got, str):
        sys.exit(f"train {' '.join(sets[-2:])} failed: {got}")
    return got


def memory_figures(runs):
    """One setting's per-rank figures (medians over the runs) from its
    memory.json ranks."""
    def per_rank(get):
        return [int(_median([get(run[i]) for run in runs])) for i in range(len(runs[0]))]
    return {"loop_peak_rss_bytes_per_rank": per_rank(lambda r: r["loop_peak_rss_bytes"]),
            "peak_rss_bytes_per_rank": per_rank(lambda r: r["peak_rss_bytes"]),
            "baseline_rss_bytes_per_rank": per_rank(lambda r: r["baseline_rss_bytes"]),
            "model_state_held_bytes_per_rank": per_rank(lambda r: r["model_state"]["held"]),
            "model_state_peak_bytes_per_rank": per_rank(lambda r: r["model_state"]["peak"]),
            "model_state_working_bytes_per_rank":
                per_rank(lambda r: r["model_state"]["working"])}


def savings(data, other):
    """``other``'s savings against ``data`` (memory_figures of each), per
    rank, and the ratios of the RSS saving to the model-state savings."""
    def less(key):
        return [d - o for d, o in zip(data[key], other[key])]
    rss = less("loop_peak_rss_bytes_per_rank")
    held = less("model_state_held_bytes_per_rank")
    peak = less("model_state_peak_bytes_per_rank")
    out = {"rss_saving_bytes_per_rank": rss, "model_state_held_saving_bytes_per_rank": held,
           "model_state_peak_saving_bytes_per_rank": peak}
    for name, by in (("rss_per_peak_saving", peak), ("rss_per_held_saving", held)):
        ratios = [round(r / m, 4) if m > 0 else None for r, m in zip(rss, by)]
        out[name] = ratios
        out[f"{name}_min"] = min(ratios) if None not in ratios else None
    return out


def rss_config(config, a, folder):
    """``--rss``: every setting's memory figures and savings against data."""
    from purine_mpi.job.config import load_config
    sets = base_sets(config, a.sets, folder)
    settings = settings_of(config, sets)
    names = [n for n in settings if not a.settings or n in a.settings or n == "data"]
    runs = {n: [] for n in names}
    for p in range(a.pairs):
        for n in names[p % len(names):] + names[:p % len(names)]:
            runs[n].append(memory_once(config, sets + settings[n], a.ranks, a.iters,
                                       os.path.join(folder, f"rss.{n}")))
    figs = {n: memory_figures(runs[n]) for n in names}
    for n in names[1:]:
        figs[n].update(savings(figs["data"], figs[n]))
    return {"sets": sets, "solver": load_config(config, overrides=sets,
                                                check_files=False)["solver"]["type"],
            "settings": figs}


def max_rel_diff(ref, got):
    """(largest over the parameters of max|got - ref| / max|ref|, the
    parameter where it falls: None when every one is equal)."""
    import numpy as np
    if sorted(ref) != sorted(got):
        sys.exit(f"the runs hold different parameters: {sorted(set(ref) ^ set(got))[:5]}")
    worst, at = 0.0, None
    for k in sorted(ref):
        a, b = np.asarray(ref[k], np.float64), np.asarray(got[k], np.float64)
        scale = max(float(np.abs(a).max()) if a.size else 0.0, 1e-30)
        d = float(np.abs(a - b).max()) / scale if a.size else 0.0
        if d > worst:
            worst, at = d, k
    return worst, at


def _median(values):
    return statistics.median(values) if values else None


def figures(runs, ratios, text):
    """One setting's JSON from its pairs' bench results."""
    first = runs[0]
    rate = "tokens_per_s" if text else "images_per_s"
    hidden = [r["comm_in_flight_ms_per_iter"] - r["comm_exposed_ms_per_iter"] for r in runs]
    out = {
        rate: round(_median([r[rate] for r in runs]), 2),
        f"{rate}_pairs": [r[rate] for r in runs],
        "ratio_to_data": round(_median(ratios), 4) if ratios else None,
        "ratio_to_data_range": [round(min(ratios), 4), round(max(ratios), 4)] if ratios else None,
        "iter_ms_median": round(_median([r["iter_ms_median"] for r in runs]), 3),
        "model_state_bytes": first["model_state_bytes"],
        "model_state_peak_bytes": first["model_state_peak_bytes"],
        "model_state_bytes_per_rank": first["model_state_bytes_per_rank"],
        "max_rss_mib_per_rank": [round(_median([r["max_rss_bytes_per_rank"][i] for r in runs])
                                       / 2 ** 20, 1)
                                 for i in range(len(first["max_rss_bytes_per_rank"]))],
        "comm_hidden_ms_per_iter": round(_median(hidden), 3),
        "comm_in_flight_ms_per_iter": round(_median([r["comm_in_flight_ms_per_iter"]
                                                     for r in runs]), 3),
        "comm_overlap": _median([r["comm_overlap"] for r in runs
                                 if r["comm_overlap"] is not None]),
    }
    for key in ("bytes_reduce_scattered_per_iter", "bytes_allgathered_per_iter",
                "bytes_allreduced_per_iter"):
        out[key] = first[key]
    return out


def bench_config(config, a, folder):
    sets = base_sets(config, a.sets, folder)
    settings = settings_of(config, sets)
    names = list(settings)
    runs = {n: [] for n in names}
    ratios = {n: [] for n in names if n != "data"}
    for p in range(a.pairs):
        order = names[p % len(names):] + names[:p % len(names)]
        got = {n: bench_once(config, sets + settings[n], a.ranks, a.iters, a.warmup)
               for n in order}
        for n in names:
            runs[n].append(got[n])
            if n != "data":
                ratios[n].append(got[n]["images_per_s"] / got["data"]["images_per_s"])
        print(json.dumps({"config": config, "pair": p,
                          "images_per_s": {n: got[n]["images_per_s"] for n in names}}),
              file=sys.stderr, flush=True)
    text = "tokens_per_s" in runs["data"][0] if runs["data"] else False
    out = {"sets": sets, "batch_per_rank": runs["data"][0]["batch_per_rank"] if runs["data"]
           else None, "settings": {}}
    for n in names:
        out["settings"][n] = figures(runs[n], ratios.get(n, []), text) if runs[n] else {}
    if a.check_steps > 0:
        ref = trained_params(config, sets + settings["data"], a.ranks, a.check_steps,
                             os.path.join(folder, f"{os.path.basename(config)}.data"),
                             a.check_solver)
        for n in names[1:]:
            got = trained_params(config, sets + settings[n], a.ranks, a.check_steps,
                                 os.path.join(folder, f"{os.path.basename(config)}.{n}"),
                                 a.check_solver)
            worst, at = max_rel_diff(ref, got)
            out["settings"][n]["check"] = {"solver": a.check_solver,
                                           f"{a.check_solver}_steps": a.check_steps,
                                           "params": len(ref), "max_rel_diff": worst,
                                           "worst_param": at}
    return out


def reduce_scatter_of(sets):
    """``parallel.reduce_scatter`` as the ``--set`` options give it (the
    last one wins; the default true): whether the sharded settings
    reduce-scatter or sum by data parallelism's allreduce."""
    import yaml
    value = True
    for s in sets:
        key, _, v = s.partition("=")
        if key.strip() == "parallel.reduce_scatter":
            value = yaml.safe_load(v) is not False  # as --set reads it (a bad one: refused)
    return value


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", default=[os.path.join("jobs", "gpt_small.yaml"),
                                                     os.path.join("jobs", "cifar10_quick.yaml")])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--check-steps", type=int, default=5,
                    help="steps of the parameter check against data (0: no check)")
    ap.add_argument("--check-solver", choices=sorted(CHECK_SOLVERS), default="adamw",
                    help="the solver of the parameter check (sgd: with momentum 0.9)")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--rss", action="store_true",
                    help="peak resident memory against the planned model state (see above)")
    ap.add_argument("--settings", nargs="+", default=None,
                    help="with --rss: the settings to run (data always runs)")
    a = ap.parse_args(argv)
    if a.pairs < 1:
        ap.error("--pairs must be at least 1")
    if a.rss:
        out = {"ranks": a.ranks, "pairs": a.pairs, "iters": a.iters, "configs": {}}
        with tempfile.TemporaryDirectory(prefix="sharded_rss_") as folder:
            for config in a.configs:
                out["configs"][config] = rss_config(config, a, folder)
        print(json.dumps(out))
        return
    out = {"ranks": a.ranks, "pairs": a.pairs, "iters": a.iters, "warmup": a.warmup,
           "check_steps": a.check_steps, "check_solver": a.check_solver,
           "reduce_scatter": reduce_scatter_of(a.sets),
           "openblas_unset": [v for v in OPENBLAS_PINS if v in os.environ], "configs": {}}
    with tempfile.TemporaryDirectory(prefix="sharded_bench_") as folder:
        for config in a.configs:
            out["configs"][config] = bench_config(config, a, folder)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
