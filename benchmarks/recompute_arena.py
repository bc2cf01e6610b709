#!/usr/bin/env python
"""What activation recompute does to the memory plan of a job, op by op, on
the host and on the emulated device (tests/emulated_gpu: no GPU needed),
for each ``recompute`` setting: the arena, its live peak and the op there,
as ``plan`` counts them (tools/plan.offline_footprints; runtime/footprint.py).

    python benchmarks/recompute_arena.py jobs/cifar10_quick.yaml \\
        [--modes none,full,selective] [--where host,gpu] [--ops] [--peak] [--set K=V ...]

prints one line per (setting, where): the arena's bytes, the live bytes at
its peak and the op there; ``--ops``: the live bytes at each op of the
schedule and the blobs born there; ``--peak``: the blobs live at the peak,
largest first, with their lifetimes (first writer .. last reader).
"""
import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def plans_of(path, mode, device, sets, build_dir):
    """(training graph, its WorkspacePlans) of ``path`` under ``recompute:
    mode`` on ``device`` (0: the emulated GPU), as ``plan`` builds them."""
    import pytest

    from purine_mpi.job.config import load_config
    from purine_mpi.tools.plan import offline_footprints
    from tests.conftest import make_job
    mp = pytest.MonkeyPatch()
    try:
        if device >= 0:
            from tests.emulated_gpu import emulated_trainer_env
            emulated_trainer_env(mp, build_dir)
        job = make_job(load_config(path, overrides=[f"recompute={mode}", f"device={device}"]
                                   + list(sets), check_files=False))
        built = {}
        offline_footprints(job, 1, [0], built=built)
        graphs, plans = built[0]
        return graphs.graph, plans
    finally:
        mp.undo()


def report(graph, plan, label, ops, peak):
    from purine_mpi.runtime.footprint import arena_peak, live_bytes, live_spans
    p = arena_peak(graph, plan)
    print(f"{label}: arena {plan.total_bytes:,} bytes; peak {p['live_bytes']:,} live at "
          f"'{p['op']}' ({p['position'] + 1} of {p['ops']})")
    span = live_spans(plan)
    if ops:
        for i, (n, live) in enumerate(zip(plan.order, live_bytes(plan, span))):
            born = ", ".join(f"{u} {plan.sizes[u]:,}" for u, (a, _) in span.items() if a == i)
            print(f"  {i + 1:4d} {live:>14,}  {n}" + (f"  + {born}" if born else ""))
    if peak:
        at = p["position"]
        for u, (a, b) in sorted(span.items(), key=lambda x: -plan.sizes[x[0]]):
            if a <= at <= b:
                print(f"  live {plan.sizes[u]:>14,}  {u}  {plan.order[a]} .. {plan.order[b]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--modes", default="none,full,selective")
    ap.add_argument("--where", default="host,gpu")
    ap.add_argument("--ops", action="store_true")
    ap.add_argument("--peak", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--build-dir", default=None,
                    help="where the emulated device's kernels are built (default: a temp dir)")
    args = ap.parse_args()
    import tempfile
    build_dir = args.build_dir or tempfile.mkdtemp(prefix="recompute_arena_")
    name = os.path.splitext(os.path.basename(args.config))[0]
    for where in args.where.split(","):
        device = -1 if where == "host" else 0
        for mode in args.modes.split(","):
            g, plans = plans_of(args.config, mode, device, args.set, build_dir)
            plan = plans.host if device < 0 else plans.devices[device]
            report(g, plan, f"{name} {where} recompute={mode}", args.ops, args.peak)


if __name__ == "__main__":
    main()
