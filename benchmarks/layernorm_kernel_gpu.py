"""The GPT layer-norm kernels on a GPU, the warp-per-row ones of
cuda/layernorm.cu against the block-per-row ones before them
(benchmarks/layernorm_block_rows.cu, compiled beside them): the two a bf16
GPT step launches, ``layernorm_forward_bits_f32`` (float32 x, y written as
bfloat16 bits, the rows' mean and rstd) and ``layernorm_backward_bdy_f32``
(dy as bits, float32 x; dx and dy * xhat written as float32), on GPT-2's
activations (16384 rows x 768, the same launch grids as
purine_mpi/gpu/kernels/elementwise.py's), interleaved in one process (CuPy
events; rounds of ``--reps`` launches of each kernel in turn).

JSON on stdout: per kernel the median ms of a launch over the rounds, the
GB/s of the bytes it must move at least (forward: x read, y written, 4 + 2
bytes an element, and mean and rstd, 8 bytes a row; backward: dy, x read,
dx, dyxhat written, 2 + 4 + 4 + 4 bytes an element, and mean and rstd read)
and that rate's fraction of ``--bound-gbs`` (4800: an H200's HBM3e); and
the new kernels' agreement with the old (the number of elements whose bits
differ and the largest difference, per output: the new kernels change only
the order of the double sums, so few or none).

    python benchmarks/layernorm_kernel_gpu.py [--rows 16384 --cols 768]

Needs CuPy and a GPU: without them it says so and exits 2."""
import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

FORWARD, BACKWARD = "layernorm_forward_bits_f32", "layernorm_backward_bdy_f32"
THREADS = 256   # PURINE_LN_THREADS of both sources


def _timed(cupy, launch, reps):
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(reps):
        launch()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / reps


def _old_source():
    """benchmarks/layernorm_block_rows.cu with cuda/'s headers inlined
    (NVRTC has no include path)."""
    with open(os.path.join(HERE, "layernorm_block_rows.cu")) as f:
        text = f.read()
    for header in ("block_sum.cuh", "precision.cuh"):
        with open(os.path.join(ROOT, "cuda", header)) as f:
            text = text.replace(f'#include "{header}"', f.read())
    return text


def _differ(cupy, a, b):
    a, b = cupy.asnumpy(a), cupy.asnumpy(b)
    if a.dtype == np.uint16:   # bfloat16 bits: compare the values
        a, b = ((x.astype(np.uint32) << 16).view(np.float32) for x in (a, b))
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return {"elements_differing": int((a.view(np.uint32) != b.view(np.uint32)).sum()),
            "max_abs_diff": float(diff.max()) if diff.size else 0.0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--cols", type=int, default=768)
    ap.add_argument("--reps", type=int, default=50, help="launches a kernel a round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bound-gbs", type=float, default=4800.0,
                    help="the memory bound in GB/s (default an H200's 4800)")
    ap.add_argument("--budget-s", type=float, default=60.0,
                    help="no round starts after this many seconds (at least one runs)")
    args = ap.parse_args(argv)
    if min(args.rows, args.cols, args.reps, args.rounds) < 1:
        print("layernorm_kernel_gpu.py: --rows, --cols, --reps and --rounds must be >= 1",
              file=sys.stderr)
        return 2
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:   # no CuPy, or no GPU
        print(f"layernorm_kernel_gpu.py: needs CuPy and a GPU ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 2
    from purine_mpi.gpu import kernel_source

    began = time.monotonic()
    n, c = args.rows, args.cols
    modules = {"old": cupy.RawModule(code=_old_source()),
               "new": cupy.RawModule(code=kernel_source("layernorm"))}
    grids = {"old": min(n, 65535), "new": min(-(-n // (THREADS // 32)), 65535)}
    f32 = np.float32
    # activations made on the device: a residual-stream-like x (offset,
    # spread), dy as bfloat16 bits of a spread of +-1
    idx = cupy.arange(n * c, dtype=f32)
    x = (0.5 + 2 * cupy.sin(idx * f32(0.37))).reshape(n, c).astype(f32)
    dy = (cupy.cos(idx * f32(0.11)).astype(f32).view(cupy.uint32) >> 16).astype(cupy.uint16)
    dy = dy.reshape(n, c)
    g = (1 + 0.1 * cupy.sin(cupy.arange(c, dtype=f32))).astype(f32)
    b = (0.1 * cupy.cos(cupy.arange(c, dtype=f32))).astype(f32)
    out = {side: {"y": cupy.empty((n, c), cupy.uint16), "mean": cupy.empty(n, f32),
                  "rstd": cupy.empty(n, f32), "dx": cupy.empty((n, c), f32),
                  "dyxhat": cupy.empty((n, c), f32)} for side in modules}

    def forward(side):
        k, o = modules[side].get_function(FORWARD), out[side]
        return lambda: k((grids[side],), (THREADS,), (
            np.int64(n), np.int64(c), x, g, b, np.float64(1e-5), o["y"], o["mean"], o["rstd"]))

    def backward(side):   # both from the old forward's statistics
        k, o, s = modules[side].get_function(BACKWARD), out[side], out["old"]
        return lambda: k((grids[side],), (THREADS,), (
            np.int64(n), np.int64(c), dy, x, g, s["mean"], s["rstd"], o["dx"], np.int32(1),
            o["dyxhat"], np.int32(1)))

    launches = {}
    for side in ("old", "new"):
        launches[f"{FORWARD}:{side}"] = forward(side)
    for side in ("old", "new"):
        launches[f"{BACKWARD}:{side}"] = backward(side)
    for launch in launches.values():   # compile, warm up; the outputs compared below
        launch()
    cupy.cuda.Device().synchronize()
    agreement = {name: _differ(cupy, out["new"][name], out["old"][name])
                 for name in ("y", "mean", "rstd", "dx", "dyxhat")}
    moved = {FORWARD: n * c * (4 + 2) + n * 8, BACKWARD: n * c * (2 + 4 + 4 + 4) + n * 8}
    times = {k: [] for k in launches}
    rounds = 0
    while rounds < args.rounds and (rounds == 0 or time.monotonic() - began < args.budget_s):
        for name, launch in launches.items():   # interleaved: each kernel once a round
            times[name].append(_timed(cupy, launch, args.reps))
        rounds += 1
    results = {}
    for name, ms in times.items():
        med = float(np.median(ms))
        nbytes = moved[name.split(":")[0]]
        gbs = nbytes / (med * 1e-3) / 1e9
        results[name] = {"ms": round(med, 4), "ms_rounds": [round(t, 4) for t in ms],
                         "bytes": nbytes, "gb_per_s": round(gbs, 1),
                         "fraction_of_bound": round(gbs / args.bound_gbs, 3),
                         "bound_ms": round(nbytes / (args.bound_gbs * 1e9) * 1e3, 4)}
    report = {
        "benchmark": "layernorm_kernel_gpu", "rows": n, "cols": c,
        "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(errors="replace"),
        "reps": args.reps, "rounds": rounds, "bound_gb_per_s": args.bound_gbs,
        "grids": grids, "threads": THREADS, "kernels": results,
        "forward_speedup": round(results[f"{FORWARD}:old"]["ms"]
                                 / results[f"{FORWARD}:new"]["ms"], 3),
        "backward_speedup": round(results[f"{BACKWARD}:old"]["ms"]
                                  / results[f"{BACKWARD}:new"]["ms"], 3),
        "agreement": agreement}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
