"""``plan --choose``'s ranking against the same settings run for real (issue
44's "the choice" target): the setting ranked first, run for real, within
10 % of the fastest of the ranked settings also run for real, interleaved.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/choose_vs_real.py \\
        [--configs benchmarks/cifar10_quick_wide.yaml jobs/gpt_small.yaml] [--ranks 2] \\
        [--rounds 3] [--top K] [--iters 10] [--warmup 3] [--set KEY=VALUE ...] [--with-ps] \\
        [--calibrate-link | --network LINK.json [--ranks-per-node K]] [--compare]
        [--baseline-root CHECKOUT]

Per config (shortened as benchmarks/sharded.py's ``SHORTEN`` says, then
``--set``):

1. ``plan CONFIG --np RANKS --choose --json`` ranks the settings (its
   calibration, one traced run on one rank, written to a temporary folder,
   so every run of this script calibrates afresh on the machine as it is);
2. every ranked setting that fits (or the first ``--top``) runs ``mpiexec -n
   RANKS python -m purine_mpi bench CONFIG --json`` with that setting's
   ``--set`` options; each round runs every setting once, the order rotating
   from round to round, so load on the shared machine falls on each alike;
3. a setting's measured throughput is the median over the rounds of
   ``bench``'s images/s (global batch over the median iteration), or its
   tokens/s for a text job (``plan``'s unit: the sequences times their
   length);
4. ``--with-ps``: the settings ``plan`` lists unranked (parameter servers)
   run in the same rounds too; their predicted and measured figures come
   under ``not_ranked``, out of every ranking figure below;
5. ranks sharing a node (docs/scaling.md "Ranks sharing a node"): by
   default plan gets no link file (its default link, no node correction).
   ``--calibrate-link`` first runs ``mpiexec -n RANKS python -m purine_mpi
   predict --calibrate`` per config into the temporary folder (in the
   ranks' environment below) and passes it to plan as ``--network`` with
   ``--ranks-per-node RANKS`` (every rank on this host); ``--network
   LINK.json`` passes a given file instead (``--ranks-per-node K``: plan's,
   else the file's calibration's ranks per host). The file's contents come
   under ``network``. ``--compare`` (with either) also ranks with plan's
   default link (``default``) and with the same file less its ``node``
   object (``link_without_node``: the same α and β, no node correction);
   every plan's settings (the union, with ``--top`` the first K of each)
   run in the same rounds, and each other plan's ranking figures come
   under ``compare``, by name.

Prints one JSON object: per config, each setting's predicted and measured
time per iteration and throughput, its predicted and measured rank, the
setting ranked first and the fastest measured, ``first_vs_fastest`` (the
first-ranked setting's measured throughput over the fastest's: the target
is ≥ 0.90; ``first_vs_round_best``: the same within each round, against
that round's best, and its median), and the rank correlation (Spearman) of prediction and
measurement (the top-level ones: the plan with the link file where one is
given). The ranks' environment is benchmarks/sharded.py's (one BLAS
thread a rank, OpenBLAS's core-type pins taken out). Timing is wall clock:
compare within one run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import sharded  # noqa: E402  (benchmarks/sharded.py: the ranks' environment, bench runs)

DEFAULT_CONFIGS = [os.path.join("benchmarks", "cifar10_quick_wide.yaml"),
                   os.path.join("jobs", "gpt_small.yaml")]


def ranked(config, sets, ranks, folder, link=None, root=None):
    """``plan --choose --json``'s ranked candidates that fit, best first
    (not the unranked parameter servers, ``"ranked": false``: listed after
    every ranked setting whatever their prediction, never the choice).
    ``link``: None (plan's default link, no node correction) or (FILE,
    K): ``--network FILE`` and, when K, ``--ranks-per-node K``. ``root``:
    the plan of another checkout (``--baseline-root``), with its own
    calibration file; None: this one's."""
    name = os.path.splitext(os.path.basename(config))[0]
    args = ["plan", config, "--np", str(ranks), "--choose", "--json",
            "--calibration", os.path.join(folder, f"calibration_{name}"
                                          + ("_baseline" if root else "") + ".json")]
    if link is not None:
        args += ["--network", link[0]]
        if link[1]:
            args += ["--ranks-per-node", str(link[1])]
    for s in sets:
        args += ["--set", s]
    env = sharded.rank_env()
    if root:
        # the other checkout's code, in the plan and in the calibration run it
        # starts (``python -m purine_mpi`` too): ``-m`` and ``-c`` put the
        # working directory, this checkout, before PYTHONPATH unless
        # PYTHONSAFEPATH is set (Python 3.11), which the children inherit
        env["PYTHONPATH"] = os.path.abspath(root)
        env["PYTHONSAFEPATH"] = "1"
    res = subprocess.run([sys.executable, "-m", "purine_mpi", *args], cwd=sharded.ROOT,
                         env=env, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        sys.exit(f"plan --choose {config} failed ({res.returncode}): "
                 f"{res.stderr.strip()[-600:]}")
    plan = json.loads(res.stdout)
    fits = [c for c in plan["candidates"] if c.get("fits")]
    return ([c for c in fits if c.get("ranked", True)], plan.get("unit", "images"),
            [c for c in fits if not c.get("ranked", True)])


def spearman(a, b):
    """Spearman's rank correlation of two equally long lists (no ties assumed
    beyond their order of appearance)."""
    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0] * len(xs)
        for r, i in enumerate(order):
            out[i] = r
        return out
    n = len(a)
    if n < 2:
        return None
    ra, rb = ranks(a), ranks(b)
    d2 = sum((x - y) ** 2 for x, y in zip(ra, rb))
    return 1 - 6 * d2 / (n * (n * n - 1))


def measure(config, base, candidates, a):
    """{label: [bench JSON per round]}, rounds interleaved, order rotating."""
    runs = {c["label"]: [] for c in candidates}
    for r in range(a.rounds):
        k = r % len(candidates)
        for c in candidates[k:] + candidates[:k]:
            got = sharded.bench_once(config, base + list(c["set"]), a.ranks, a.iters, a.warmup)
            runs[c["label"]].append(got)
            print(f"  round {r + 1}: {c['label']}: {got['images_per_s']:.1f} images/s, "
                  f"{got['iter_ms_median']:.1f} ms/iter", file=sys.stderr, flush=True)
    return runs


def links(config, a, folder):
    """The plans to rank under, {name: None or (FILE, K)}, the first the
    primary one (the top-level figures): ``default`` (no ``--network``:
    plan's default link, no node correction) without ``--network`` or
    ``--calibrate-link``; else ``link`` (the file, K = ``--ranks-per-node``,
    or RANKS for a calibration made here), and with ``--compare`` also
    ``default`` and ``link_without_node`` (the same file less its ``node``
    object: the same α and β, no node correction)."""
    network, calibrate = getattr(a, "network", None), getattr(a, "calibrate_link", False)
    if not (network or calibrate):
        return {"default": None}, None
    name = os.path.splitext(os.path.basename(config))[0]
    if calibrate:
        path, k = os.path.join(folder, f"link_{name}.json"), a.ranks
        sharded.run(a.ranks, ["predict", "--calibrate", path], "predict --calibrate")
    else:
        path, k = os.path.abspath(network), getattr(a, "ranks_per_node", 0)
    with open(path) as f:
        link = json.load(f)
    out = {"link": (path, k)}
    if getattr(a, "compare", False):
        bare = os.path.join(folder, f"link_without_node_{name}.json")
        with open(bare, "w") as f:
            json.dump({key: v for key, v in link.items() if key != "node"}, f)
        out["default"] = None
        out["link_without_node"] = (bare, k)
    return out, link


def ranking(candidates, runs, key, rounds):
    """One plan's ranking against the measured runs: its settings' predicted
    and measured figures, the first-ranked against the fastest, Spearman."""
    rows = []
    for rank, c in enumerate(candidates, 1):
        got = runs[c["label"]]
        per_s = statistics.median(g[key] for g in got)
        rows.append({
            "label": c["label"], "set": c["set"], "predicted_rank": rank,
            "predicted_iter_s": round(c["iter_s"], 5),
            "predicted_samples_per_s": round(c["samples_per_s"], 2),
            "measured_iter_s": round(statistics.median(g["iter_ms_median"] for g in got) / 1e3, 5),
            "measured_samples_per_s": round(per_s, 2),
            "measured_samples_per_s_rounds": [round(g[key], 2) for g in got],
            "predicted_over_measured": round(c["samples_per_s"] / per_s, 3),
        })
    by_speed = sorted(rows, key=lambda r: -r["measured_samples_per_s"])
    for i, r in enumerate(by_speed, 1):
        r["measured_rank"] = i
    first, fastest = rows[0], by_speed[0]
    # per round: the first-ranked setting's figure over that round's best
    # (the rounds' load differs; within a round every setting ran back to back)
    per_round = [first["measured_samples_per_s_rounds"][r]
                 / max(row["measured_samples_per_s_rounds"][r] for row in rows)
                 for r in range(rounds)]
    return {
        "settings": rows,
        "first_ranked": first["label"], "fastest_measured": fastest["label"],
        "first_vs_fastest": round(first["measured_samples_per_s"]
                                  / fastest["measured_samples_per_s"], 3),
        "within_10_percent": first["measured_samples_per_s"]
        >= 0.9 * fastest["measured_samples_per_s"],
        "first_vs_round_best": [round(x, 3) for x in per_round],
        "first_vs_round_best_median": round(statistics.median(per_round), 3),
        "spearman": spearman([-r["predicted_samples_per_s"] for r in rows],
                             [-r["measured_samples_per_s"] for r in rows]),
    }


def config_figures(config, a, folder):
    if not os.path.exists(config):   # a path relative to the repository
        config = os.path.join(sharded.ROOT, config)
    config = os.path.abspath(config)
    base = sharded.base_sets(config, a.set, folder)
    plans, link = links(config, a, folder)
    chosen, unit, unranked = {}, "images", []
    for name, l in plans.items():
        cands, u, ps = ranked(config, base, a.ranks, folder, l)
        if a.top:
            cands = cands[:a.top]
        if len(cands) < 2:
            sys.exit(f"plan --choose ranked {len(cands)} fitting settings of {config}"
                     + ("" if l is None else f" with --network {l[0]}"))
        chosen[name] = cands
        if not unranked:
            unit, unranked = u, ps
    if getattr(a, "baseline_root", None):  # another checkout's plan: its ranking of these runs
        cands, _, _ = ranked(config, base, a.ranks, folder, None, a.baseline_root)
        chosen["baseline"] = cands[:a.top] if a.top else cands
    # every plan's settings, measured once in the same rounds: the primary
    # plan's first, in its order, then those only another plan ranked
    seen, candidates = set(), []
    for cands in chosen.values():
        for c in cands:
            if c["label"] not in seen:
                seen.add(c["label"])
                candidates.append(c)
    extra = unranked if a.with_ps else []
    print(f"{config}: {len(candidates)} settings (+{len(extra)} unranked), {a.rounds} rounds",
          file=sys.stderr)
    runs = measure(config, base, candidates + extra, a)
    key = "tokens_per_s" if unit == "tokens" else "images_per_s"   # plan's unit
    # --with-ps: the unranked settings, measured in the same rounds (each
    # predicted figure against its measurement), out of every ranking figure
    not_ranked = []
    for c in extra:
        got = runs[c["label"]]
        per_s = statistics.median(g[key] for g in got)
        not_ranked.append({
            "label": c["label"], "set": c["set"],
            "predicted_iter_s": round(c["iter_s"], 5),
            "predicted_samples_per_s": round(c["samples_per_s"], 2),
            "measured_iter_s": round(statistics.median(g["iter_ms_median"] for g in got) / 1e3, 5),
            "measured_samples_per_s": round(per_s, 2),
            "measured_samples_per_s_rounds": [round(g[key], 2) for g in got],
            "predicted_over_measured": round(c["samples_per_s"] / per_s, 3)})
    names = list(chosen)
    out = {"unit": unit, "ranks": a.ranks, "sets": base, "rounds": a.rounds, "iters": a.iters}
    out.update(ranking(chosen[names[0]], runs, key, a.rounds))
    out["not_ranked"] = not_ranked
    if link is not None:
        out["network"] = {"file": plans["link"][0], "ranks_per_node": plans["link"][1],
                          "link": link}
    if len(names) > 1:
        out["compare"] = {n: ranking(chosen[n], runs, key, a.rounds) for n in names[1:]}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--top", type=int, default=0,
                   help="run only the first K ranked settings that fit (default: all)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--with-ps", action="store_true",
                   help="also run the unranked settings (parameter servers) in every round: "
                        "their predicted and measured figures, under not_ranked")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--network", metavar="LINK.json",
                   help="pass this predict --calibrate file to plan (--network): its node "
                        "object corrects for ranks sharing a node")
    g.add_argument("--calibrate-link", action="store_true",
                   help="per config, first run mpiexec -n RANKS python -m purine_mpi predict "
                        "--calibrate into the temporary folder and pass it to plan with "
                        "--ranks-per-node RANKS")
    p.add_argument("--ranks-per-node", type=int, default=0, metavar="K",
                   help="with --network: plan's --ranks-per-node (default: the file's "
                        "calibration's ranks per host)")
    p.add_argument("--compare", action="store_true",
                   help="with --network or --calibrate-link: also rank with plan's default "
                        "link and with the file less its node object, every plan's settings "
                        "measured in the same rounds (figures under compare)")
    p.add_argument("--baseline-root", metavar="CHECKOUT",
                   help="also rank with the plan of another checkout of purine_mpi (its "
                        "own calibration, plan's default link), its settings measured in the "
                        "same rounds: its ranking figures under compare.baseline")
    a = p.parse_args(argv)
    if a.baseline_root and sys.version_info < (3, 11):
        p.error("--baseline-root needs Python 3.11 or later (PYTHONSAFEPATH: else the plan "
                "imports this checkout's code, not the other's)")
    if (a.compare or a.ranks_per_node) and not (a.network or a.calibrate_link):
        p.error("--compare and --ranks-per-node need --network or --calibrate-link")
    if a.ranks_per_node and a.calibrate_link:
        p.error("--ranks-per-node goes with --network (--calibrate-link uses --ranks)")
    if a.ranks_per_node < 0:
        p.error("--ranks-per-node must be at least 1")
    if a.network and not os.path.isfile(a.network):
        p.error(f"--network {a.network}: no such file")
    out = {}
    with tempfile.TemporaryDirectory(prefix="choose_vs_real_") as folder:
        for config in a.configs:
            out[os.path.splitext(os.path.basename(config))[0]] = config_figures(config, a, folder)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
