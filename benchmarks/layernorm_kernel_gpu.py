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
the order of the double sums, so few or none). And ``layernorm_backward_sums``
(PURINE_LN_SUMS=1): the backward with dg and db, old the warp-per-row
backward writing dyxhat and ``sum_rows`` over dy and dyxhat (2 + 4 + 4 + 4
+ 2 + 4 = 20 bytes an element), new ``layernorm_backward_bdy_colsum_f32``
and the two finishes (10 bytes an element, its rates' bytes, + the blocks'
partial sums); dx must agree bit for bit, dg and db in their last bits.

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
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import kernel_bench  # noqa: E402  (benchmarks/kernel_bench.py)

FORWARD, BACKWARD = "layernorm_forward_bits_f32", "layernorm_backward_bdy_f32"
#: the backward with dg's and db's column sums: old (the backward, dyxhat,
#: two sum_rows) against new (kernels.layernorm_backward_sums)
SUMS = "layernorm_backward_sums"
THREADS = 256   # PURINE_LN_THREADS of both sources


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
    kernel_bench.add_timing_args(ap, reps=50)
    args = ap.parse_args(argv)
    cupy = kernel_bench.need_cupy(
        "layernorm_kernel_gpu.py", "--rows, --cols, --reps and --rounds must be >= 1"
        if min(args.rows, args.cols, args.reps, args.rounds) < 1 else None)
    if cupy is None:
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

    # the backward with dg's and db's column sums (PURINE_LN_SUMS=1): old, the
    # warp-per-row backward writing dyxhat, then sum_rows over dy (db) and over
    # dyxhat (dg); new, layernorm_backward_bdy_colsum_f32 (the blocks' partial
    # sums) and bias_grad_finish for each
    from purine_mpi.gpu import kernels
    st = out["old"]
    xd, dyd, gd = (cupy.asarray(a) for a in (x, dy, g))   # (CuPy's own arrays already)
    sums = {side: {"dx": cupy.empty((n, c), f32), "dg": cupy.empty(c, f32),
                   "db": cupy.empty(c, f32)} for side in ("old", "new")}
    dyxhat = cupy.empty((n, c), f32)
    col_partial = cupy.empty(kernels.bias_grad_scratch((n, c))[0], np.float64)
    ln_partial = cupy.empty(kernels.layernorm_sums_scratch((n, c))[0], np.float64)

    def with_sums(side):
        o = sums[side]
        if side == "new":
            return lambda: kernels.layernorm_backward_sums(
                dyd, xd, gd, st["mean"], st["rstd"], o["dx"], o["dg"], o["db"],
                partial=ln_partial)

        def old():
            kernels.sum_rows(dyd, o["db"], partial=col_partial)
            kernels.layernorm_backward(dyd, xd, gd, st["mean"], st["rstd"], dx=o["dx"],
                                       dyxhat=dyxhat)
            kernels.sum_rows(dyxhat, o["dg"], partial=col_partial)
        return old

    launches = {}
    for side in ("old", "new"):
        launches[f"{FORWARD}:{side}"] = forward(side)
    for side in ("old", "new"):
        launches[f"{BACKWARD}:{side}"] = backward(side)
    for side in ("old", "new"):
        launches[f"{SUMS}:{side}"] = with_sums(side)
    for launch in launches.values():   # compile, warm up; the outputs compared below
        launch()
    cupy.cuda.Device().synchronize()
    agreement = {name: _differ(cupy, out["new"][name], out["old"][name])
                 for name in ("y", "mean", "rstd", "dx", "dyxhat")}
    agreement.update({f"sums_{name}": _differ(cupy, sums["new"][name], sums["old"][name])
                      for name in ("dx", "dg", "db")})
    # the backward with its sums: what both must move, the new one's (dy, x
    # read, dx written); the old one moves 10 bytes an element more (dyxhat
    # written and read, dy read again) -- see SUMS_OLD_BYTES in the report
    moved = {FORWARD: n * c * (4 + 2) + n * 8, BACKWARD: n * c * (2 + 4 + 4 + 4) + n * 8,
             SUMS: n * c * (2 + 4 + 4) + n * 8}
    # interleaved: each kernel once a round
    times, rounds = kernel_bench.interleaved(cupy, launches, args, began)
    results = {}
    for name, ms in times.items():
        nbytes = moved[name.split(":")[0]]
        results[name] = kernel_bench.rates(ms, nbytes, args.bound_gbs)
        results[name]["bound_ms"] = kernel_bench.bound_ms(nbytes, args.bound_gbs)
    report = {
        "benchmark": "layernorm_kernel_gpu", "rows": n, "cols": c,
        **kernel_bench.run_info(cupy, args, rounds),
        "grids": grids, "threads": THREADS, "kernels": results,
        "forward_speedup": round(results[f"{FORWARD}:old"]["ms"]
                                 / results[f"{FORWARD}:new"]["ms"], 3),
        "backward_speedup": round(results[f"{BACKWARD}:old"]["ms"]
                                  / results[f"{BACKWARD}:new"]["ms"], 3),
        "backward_with_sums_speedup": round(results[f"{SUMS}:old"]["ms"]
                                            / results[f"{SUMS}:new"]["ms"], 3),
        "backward_with_sums_old_bytes": n * c * (2 + 4 + 4 + 4 + 2 + 4) + n * 8,
        "agreement": agreement}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
