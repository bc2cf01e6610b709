"""``plan``'s predicted host peak against the measured one, per rank.

For each (job, scheme) it runs ``plan JOB --np N --json`` (the host total of
each rank) and ``mpiexec -n N python -m purine_mpi train JOB --iters K``,
whose OUT/memory.json (train/trainer.write_memory) holds each rank's
resident bytes before its graphs were built and at their high-water mark,
and the pages of the other ranks' shared-window regions resident in the
rank after the last iteration (``peer_window_bytes``: in its resident bytes
and in their owner's). ``plan`` counts a region once, on its owner (its
``windows`` row: the node holds it once), and gives each rank's pages of
the others' regions beside its rows (JSON ``peer_window_pages``), so the
table compares like with like: the rank's resident bytes against its host
total plus those pages (a rank's resident bytes count them; the node's
need does not).
The table in docs/running.md ("Will it fit?") is its output:

    python benchmarks/rss_vs_plan.py --out /tmp/rss [--cases cifar10_quick:data,...]

(the gap: predicted resident bytes less measured, over measured).

Each case's figures are kept in OUT/JOB-SCHEME.json too, with
``loop_measured``: each rank's high-water mark after the last iteration,
before the end's test pass and checkpoint, above its baseline (the
"loop peak" of docs/running.md's pipeline paragraphs).

The data: synthetic for the CNNs (their yaml's own), and the standard
library's email package as text for the GPTs (as tests/test_plan.py makes it).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = [sys.executable, "-m", "purine_mpi"]
JOBS = ("cifar10_quick", "nin_cifar10", "gpt_tiny", "gpt_small")
SCHEMES = ("data", "pipeline", "tensor", "sharded1", "sharded2", "sharded3", "tppp",
           "sync_ps", "async")
#: the ranks of a scheme's run: 2; tensor x pipeline (``tppp``: 2 stages x 2
#: tensor shards, scheme pipeline with parallel.tensor_parallel 2) 4; the
#: parameter servers' modes 3 (2 workers, 1 server: ``ps_ranks`` more servers
#: with ``measure``'s ``sets``)
RANKS = {"tppp": 4, "sync_ps": 3, "async": 3}


def text_data(out):
    """gpt's data: the email package's sources, as tests/test_plan.py makes them."""
    import email as pkg
    path = os.path.join(out, "email.h5")
    if not os.path.exists(path):
        subprocess.run(PY + ["data", "text", "--from", os.path.dirname(pkg.__file__), "--glob",
                             "*.py", "--out", path], check=True, capture_output=True)
    return path


def sets_for(job, scheme, out):
    """The --set overrides of ``job`` under ``scheme`` (on ``RANKS`` of it, else 2)."""
    path = os.path.join(ROOT, "jobs", f"{job}.yaml")
    sets = ["solver.test_interval=0", "checkpoint.interval=0", "solver.display=1"]
    if job.startswith("gpt"):
        data = text_data(out)
        sets += [f"data.train.path={data}", f"data.test.path={data}"]
    if scheme in ("pipeline", "tppp"):
        from purine_mpi.job.repeat import expand_net
        net, _ = expand_net(yaml.safe_load(open(path))["net"], path)   # gpt_small's blocks
        names = [layer["name"] for layer in net]
        half = len(names) // 2
        stages = ", ".join(f"{n}: {0 if i < half else 1}" for i, n in enumerate(names))
        sets += ["parallel.scheme=pipeline", f"parallel.stages={{{stages}}}"]
        if scheme == "tppp":
            sets += ["parallel.tensor_parallel=2"]
    elif scheme == "tensor":
        # 2-way tensor parallelism (without parallel.tensor_parallel the
        # scheme's ranks are replicas of one shard: data parallelism)
        sets += ["parallel.scheme=tensor", "parallel.tensor_parallel=2"]
    elif scheme.startswith("sharded"):
        sets += ["parallel.scheme=sharded", f"parallel.shard={scheme[-1]}"]
    elif scheme in ("sync_ps", "async"):
        # two-sided: a shared window's pages count in the resident bytes of
        # every rank that touches them (plan counts them once, on the owner);
        # async with max_staleness 1 (0 runs as sync_ps)
        sets += ["parallel.scheme=data", f"parallel.mode={scheme}", "parallel.ps_ranks=1",
                 "parallel.transport=two_sided"] + \
            (["parallel.max_staleness=1"] if scheme == "async" else [])
    else:
        sets += ["parallel.scheme=data"]
    return path, sets


def train_memory(path, args, run, np_=2, iters=5, env=None, mpiexec="mpiexec"):
    """``mpiexec -n NP python -m purine_mpi train PATH --out RUN --iters
    ITERS ARGS`` (RUN emptied first): its OUT/memory.json's ranks
    (train/trainer.write_memory), or the error as one line."""
    shutil.rmtree(run, ignore_errors=True)
    t = subprocess.run([mpiexec, "-n", str(np_)] + PY + ["train", path, "--out", run,
                                                          "--iters", str(iters)] + list(args),
                       capture_output=True, text=True, env=env, cwd=ROOT)
    if t.returncode != 0:
        return "train: " + (t.stderr.strip().splitlines() or ["?"])[-1]
    with open(os.path.join(run, "memory.json")) as f:
        return json.load(f)["ranks"]


def run_command(*args, env=None):
    """``python -m purine_mpi ARGS`` in a new interpreter from the repo root:
    its CompletedProcess (text)."""
    return subprocess.run(PY + list(args), capture_output=True, text=True, env=env, cwd=ROOT)


def measure(job, scheme, out, np_=None, iters=5, env=None, sets=(), path=None,
            plan_with=None):
    """{"predicted": [bytes per rank], "measured": [...], "baseline": [...],
    "plan": the plan's JSON}, or {"error": text}; on ``np_`` ranks, by
    default the scheme's (``RANKS``, else 2). ``sets``: more --set values
    (after the scheme's); ``path``: a config file in the place of
    jobs/JOB.yaml; ``plan_with``: what runs the offline ``plan`` command
    (``f(*args)`` -> CompletedProcess; a new interpreter by default, the
    tests' own process in tests/test_plan_rss.py)."""
    np_ = np_ or RANKS.get(scheme, 2)
    own, more = sets_for(job, scheme, out)
    path = path or own
    args = [a for s in list(more) + list(sets) for a in ("--set", s)]
    env = {**os.environ, **(env or {})}
    plan_with = plan_with or (lambda *a: run_command(*a, env=env))
    p = plan_with("plan", path, "--np", str(np_), "--json", *args)
    if p.returncode not in (0, 2) or not p.stdout.strip():  # 2 with no JSON: a refusal
        return {"error": "plan: " + (p.stderr.strip().splitlines() or ["?"])[-1]}
    plan = json.loads(p.stdout)
    predicted, peers = [0] * np_, [0] * np_
    for kind in plan["ranks"]:
        for r in kind["ranks"]:
            predicted[r] = kind["host"]["total"]
            peers[r] = kind["host"].get("peer_window_pages", 0)
    ranks = train_memory(path, args, os.path.join(out, f"{job}-{scheme}"), np_, iters, env)
    if isinstance(ranks, str):
        return {"error": ranks}
    return {"predicted": predicted, "plan": plan,
            # plan's pages of other ranks' shared-window regions the rank
            # accesses (in its resident bytes, not in its host total), and
            # the resident bytes predicted: the total and those pages
            "peer_window_planned": peers,
            "predicted_resident": [p + w for p, w in zip(predicted, peers)],
            "measured": [r["above_baseline_bytes"] for r in ranks],
            "baseline": [r["baseline_rss_bytes"] for r in ranks],
            # the high-water mark after the last iteration, before the end's
            # test pass and checkpoint (memory.json's loop_peak_rss_bytes)
            "loop_measured": [None if r.get("loop_peak_rss_bytes") is None
                              or r["baseline_rss_bytes"] is None
                              else r["loop_peak_rss_bytes"] - r["baseline_rss_bytes"]
                              for r in ranks],
            # the pages of other ranks' shared-window regions resident in the
            # rank after the last iteration (memory.json's peer_window_bytes)
            "peer_window": [r.get("peer_window_bytes") for r in ranks]}


def run_hooked(at_baseline, at_loop_end):
    """``python -m purine_mpi`` (``sys.argv`` as it is) with two reads hooked
    in: ``at_baseline()`` when ``train`` reads memory.json's baseline
    (train/trainer.py, after MPI's initialisation and the deferred imports,
    before any graph), ``at_loop_end(rank)`` when it reads the loop's peak
    after the last iteration (train/loop.py, the dispatcher drained, before
    the end's test pass and checkpoint); any other command runs as it is.
    The diagnosis scripts' stand-in for the command (``hooked_cases``)."""
    import runpy

    from purine_mpi.train import loop, trainer
    rss, peak = trainer.rss_bytes, loop.peak_rss_bytes

    def baseline():
        b = rss()
        at_baseline()
        return b

    def loop_end():
        p = peak()
        at_loop_end(int(os.environ.get("PMI_RANK", "0")))
        return p
    trainer.rss_bytes, loop.peak_rss_bytes = baseline, loop_end
    runpy.run_module("purine_mpi", run_name="__main__")


def hooked_cases(cases, out, kind, command, rank_file, iters=3, env=None):
    """The loop of the diagnosis scripts (benchmarks/big_mallocs.py,
    benchmarks/smaps_by_mapping.py): for each "job:scheme" of ``cases`` (a
    comma-separated string), ``measure`` of the case (the same ``plan`` and
    ``train`` commands) with ``python -m purine_mpi`` replaced by
    ``command(where)`` (the argv of a stand-in that calls ``run_hooked``
    and writes each rank's reads into ``where``, OUT/JOB-SCHEME-KIND,
    emptied first, as ``rank_file.format(rank)``). Yields (case, the
    result: ``measure``'s, or {"error": text}, and [(rank, predicted,
    measured, its file)] for each rank whose file was written: a parameter
    server has no training loop)."""
    global PY
    plain = PY
    try:
        for case in cases.split(","):
            job, scheme = case.split(":")
            where = os.path.join(out, f"{job}-{scheme}-{kind}")
            os.makedirs(where, exist_ok=True)
            for name in os.listdir(where):
                os.remove(os.path.join(where, name))
            PY = list(command(where))
            res = measure(job, scheme, out, iters=iters, env=env)
            ranks = [] if "error" in res else [
                (r, p, m, os.path.join(where, rank_file.format(r)))
                for r, (p, m) in enumerate(zip(res["predicted"], res["measured"]))]
            yield case, res, [x for x in ranks if os.path.exists(x[3])]
    finally:
        PY = plain


def mib(n):
    return f"{n / 2**20:.1f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/rss_vs_plan")
    ap.add_argument("--cases", default=None,
                    help="job:scheme,... (default: every job under every scheme)")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cases = [c.split(":") for c in args.cases.split(",")] if args.cases else \
        [(j, s) for j in JOBS for s in SCHEMES]
    print("| job | scheme | rank | baseline MiB | host total MiB | peers' window pages MiB, "
          "planned / measured | predicted resident MiB | measured MiB | gap |")
    print("|---|---|---|---|---|---|---|---|---|")
    for job, scheme in cases:
        res = measure(job, scheme, args.out, iters=args.iters)
        if "error" in res:
            print(f"| {job} | {scheme} | - | - | - | - | - | - | {res['error']} |", flush=True)
            continue
        for r, (p, w, pr, m, b, mw) in enumerate(zip(
                res["predicted"], res["peer_window_planned"], res["predicted_resident"],
                res["measured"], res["baseline"], res["peer_window"])):
            print(f"| {job} | {scheme} | {r} | {mib(b)} | {mib(p)} | {mib(w)} / "
                  f"{'-' if mw is None else mib(mw)} | {mib(pr)} | {mib(m)} | "
                  f"{100 * (pr - m) / m:+.1f}% |", flush=True)
        with open(os.path.join(args.out, f"{job}-{scheme}.json"), "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
