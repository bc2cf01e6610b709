"""What the kernel microbenchmarks share (benchmarks/loss_kernel_gpu.py,
bias_gelu_gpu.py, layernorm_kernel_gpu.py): their timing options, the
refusal without CuPy or a GPU, a launch timed with CuPy events, the rounds
that interleave the kernels in one process, and the JSON rows of a
kernel's times and rates. Imported by those scripts (benchmarks/ is on
their path: ``python benchmarks/NAME.py`` puts it first)."""
import sys
import time

import numpy as np


def add_timing_args(ap, reps=20):
    """--reps (default ``reps``), --rounds, --bound-gbs and --budget-s."""
    ap.add_argument("--reps", type=int, default=reps, help="launches a kernel a round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bound-gbs", type=float, default=4800.0,
                    help="the memory bound in GB/s (default an H200's 4800)")
    ap.add_argument("--budget-s", type=float, default=60.0,
                    help="no round starts after this many seconds (at least one runs)")


def need_cupy(script, bad_args=None):
    """CuPy with a GPU, or None once what is wrong is said on stderr in one
    line (the caller then exits 2): ``script: bad_args`` where the options
    are bad (``bad_args`` not None: CuPy not imported), else ``script:
    needs CuPy and a GPU (...)`` where there is none."""
    if bad_args is not None:
        print(f"{script}: {bad_args}", file=sys.stderr)
        return None
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:   # no CuPy, or no GPU
        print(f"{script}: needs CuPy and a GPU ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return None
    return cupy


def timed(cupy, launch, reps):
    """ms a launch: ``reps`` calls of ``launch`` between two CuPy events."""
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(reps):
        launch()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / reps


def interleaved(cupy, launches, args, began, order=None):
    """``({name: [ms a launch, each round]}, rounds run)``: each round
    times every launch once (``args.reps`` calls), in ``launches``' order
    or ``order(round)``'s; at most ``args.rounds`` rounds, none started
    ``args.budget_s`` after ``began`` (time.monotonic), the first always."""
    times = {k: [] for k in launches}
    rounds = 0
    while rounds < args.rounds and (rounds == 0 or time.monotonic() - began < args.budget_s):
        for name in (order(rounds) if order else launches):
            times[name].append(timed(cupy, launches[name], args.reps))
        rounds += 1
    return times, rounds


def rates(ms, nbytes, bound_gbs, with_bytes=True):
    """A kernel's row: the median ms of its rounds ``ms``, each round's,
    (``bytes``: ``nbytes``), the GB/s of ``nbytes`` and its fraction of
    ``bound_gbs``."""
    med = float(np.median(ms))
    gbs = nbytes / (med * 1e-3) / 1e9
    row = {"ms": round(med, 4), "ms_rounds": [round(t, 4) for t in ms]}
    if with_bytes:
        row["bytes"] = nbytes
    row["gb_per_s"] = round(gbs, 1)
    row["fraction_of_bound"] = round(gbs / bound_gbs, 3)
    return row


def bound_ms(nbytes, bound_gbs):
    """ms to move ``nbytes`` at ``bound_gbs``."""
    return round(nbytes / (bound_gbs * 1e9) * 1e3, 4)


def run_info(cupy, args, rounds):
    """The report's device, reps, rounds and bound_gb_per_s."""
    return {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(errors="replace"),
            "reps": args.reps, "rounds": rounds, "bound_gb_per_s": args.bound_gbs}
