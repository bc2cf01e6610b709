"""The bias and GELU kernels of GPT-2's bf16 step on a GPU, the vectorised
ones (cuda/activation.cu ``bias_bits_vec_f32``,
``gelu_forward_bx_bits_vec_f32``, ``gelu_backward_bdy_bx_copy_vec_f32``: 8
elements a thread, 16-byte loads and stores) against the one-element ones
before them, at the real shapes (16384 positions; the bias on the qkv,
projection and MLP products, 2304 / 768 / 3072 columns; GELU on the MLP's
16384 x 3072), interleaved in one process (CuPy events; rounds of
``--reps`` launches of each kernel in turn). JSON on stdout: per kernel the
median ms of a launch over the rounds, the GB/s of the bytes it must move
(bias: float32 read, bits written, 6 bytes an element; GELU forward: bits
in, bits out, 4; backward: dy and x bits read, float32 dx and its bits
written, 10; the bias gradients' column sums ``sum_rows``, old against
``sum_rows_vec_f32`` / ``sum_rows_bits_vec_f32``: x read once, 4 or 2;
``gelu_backward_bias_grad``: GELU's backward with fc1's bias gradient,
old the backward kernel then ``sum_rows`` reading dx again, 14 bytes an
element, new ``gelu_backward_bdy_bx_copy_colsum_f32``, the column sums in
the same pass, 10 -- the row's rates are of the 10 both must move)
and that rate's fraction of ``--bound-gbs`` (4800: an H200's HBM3e); each pair's speedup and whether new and old agree bit for bit;
and ``ms_per_gpt2_step``: old, new and bound summed over a GPT-2 124M
step's launches (48 bias adds, 12 GELUs each way, 12 GELU backwards with
their bias gradient).

    python benchmarks/bias_gelu_gpu.py [--rows 16384 --approximate tanh]

Needs CuPy and a GPU: without them it says so and exits 2."""
import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import kernel_bench  # noqa: E402  (benchmarks/kernel_bench.py)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--width", type=int, default=768, help="the model width (qkv 3x, MLP 4x)")
    ap.add_argument("--approximate", choices=("none", "tanh"), default="tanh",
                    help="the GELU form (default GPT-2's, jobs/gpt2_124m.yaml)")
    kernel_bench.add_timing_args(ap)
    args = ap.parse_args(argv)
    cupy = kernel_bench.need_cupy(
        "bias_gelu_gpu.py", "--rows, --reps, --rounds must be >= 1 and --width a positive "
        "multiple of 8" if min(args.rows, args.width, args.reps, args.rounds) < 1
        or args.width % 8 else None)
    if cupy is None:
        return 2
    from purine_mpi.gpu import kernels

    began = time.monotonic()
    n, w = args.rows, args.width

    def values(size, scale, phase):   # spread values made on the device
        return cupy.asarray(scale * cupy.sin(cupy.arange(size, dtype=np.float32)
                                             * np.float32(0.7) + np.float32(phase)))

    def bits(a):
        out = cupy.empty(a.shape, np.uint16)
        kernels.to_bf16_bits_device(a, out)
        return out

    cases = {}   # name -> (launch(vec), bytes, outputs to compare)
    for cols in (3 * w, w, 4 * w):
        src = values(n * cols, 3.0, 0.1).reshape(n, cols)
        bias = values(cols, 0.5, 0.3)
        out = cupy.empty((n, cols), np.uint16)
        cases[f"bias_bits_{cols}"] = (
            (lambda s, b, o: lambda vec: kernels.bias_bits(s, b, o, vec=vec))(src, bias, out),
            6 * n * cols, (out,))
    m = 4 * w
    x = bits(values(n * m, 3.0, 0.2).reshape(n, m))
    dy = bits(values(n * m, 0.1, 0.4).reshape(n, m))
    y = cupy.empty_like(x)
    dx = cupy.empty((n, m), np.float32)
    copy = cupy.empty_like(x)
    cases["gelu_forward_bits"] = (
        lambda vec: kernels.gelu_forward_bits(x, args.approximate, y, vec=vec), 4 * n * m, (y,))
    cases["gelu_backward_bdy_bx_copy"] = (
        lambda vec: kernels.gelu_backward(dy, x, args.approximate, out=dx, copy=copy, vec=vec),
        10 * n * m, (dx, copy))
    # GELU's backward with fc1's bias gradient: old, the _vec kernel then
    # sum_rows_vec_f32 reading dx again (+ bias_grad_finish); new, one pass
    # (gelu_backward_bdy_bx_copy_colsum_f32 + the finish), PURINE_GELU_BIAS_GRAD=1
    dx2, copy2 = cupy.empty((n, m), np.float32), cupy.empty_like(x)
    db2 = cupy.empty((m,), np.float32)
    partial2 = cupy.empty(kernels.bias_grad_scratch((n, m))[0], np.float64)

    def gelu_bias(vec):
        if vec:
            kernels.gelu_backward_bias_grad(dy, x, args.approximate, dx2, db2, copy=copy2,
                                            partial=partial2)
            return
        kernels.gelu_backward(dy, x, args.approximate, out=dx2, copy=copy2)
        kernels.sum_rows(dx2, db2, partial=partial2)

    cases["gelu_backward_bias_grad"] = (gelu_bias, 10 * n * m, (dx2, copy2, db2, partial2))
    # the bias gradients' column sums (cuda/reduce.cu sum_rows): float32 dys of
    # the projection / fc2 and fc1, the qkv's dy as bits (sum_rows_bits)
    for label, a in ((f"sum_rows_{w}", values(n * w, 1.0, 0.5).reshape(n, w)),
                     (f"sum_rows_{m}", dx),
                     (f"sum_rows_bits_{3 * w}", bits(values(n * 3 * w, 1.0, 0.6)
                                                       .reshape(n, 3 * w)))):
        db = cupy.empty((a.shape[1],), np.float32)
        partial = cupy.empty(kernels.bias_grad_scratch(a.shape)[0], np.float64)
        cases[label] = (
            (lambda a, db, p: lambda vec: kernels.sum_rows(a, db, partial=p, vec=vec))(
                a, db, partial), a.dtype.itemsize * a.size, (db, partial))

    agreement = {}
    for name, (launch, _, outs) in cases.items():   # also the first compile of each
        got = []
        for vec in (False, True):
            for o in outs:
                o.fill(0)
            launch(vec)
            got.append([cupy.asnumpy(o).view(np.uint8) for o in outs])
        agreement[name] = all(np.array_equal(a, b) for a, b in zip(*got))
        launch(False)
        launch(True)   # warm-up
    launches = {(name, vec): (lambda launch, vec: lambda: launch(vec))(cases[name][0], vec)
                for name in cases for vec in (False, True)}
    # interleaved: each kernel once a round, old and new next to each other,
    # which goes first alternating from round to round (neither always
    # follows the other's traffic)
    times, rounds = kernel_bench.interleaved(
        cupy, launches, args, began,
        order=lambda r: [(name, vec) for name in cases
                         for vec in ((False, True) if r % 2 == 0 else (True, False))])
    results = {}
    for name, (_, moved, _) in cases.items():
        entry = {"bytes": moved, "bound_ms": kernel_bench.bound_ms(moved, args.bound_gbs),
                 "bitwise_equal": agreement[name]}
        for vec in (False, True):
            entry["new" if vec else "old"] = kernel_bench.rates(
                times[(name, vec)], moved, args.bound_gbs, with_bytes=False)
        entry["speedup"] = round(entry["old"]["ms"] / entry["new"]["ms"], 3)
        results[name] = entry
    # a GPT-2 step's launches of each (12 blocks: the bias on qkv, the
    # projection, fc1 and fc2; one GELU each way): old and new ms a step, to
    # set beside a profile's per-kernel totals
    per_step = {f"bias_bits_{3 * w}": 12, f"bias_bits_{w}": 24, f"bias_bits_{4 * w}": 12,
                "gelu_forward_bits": 12, "gelu_backward_bdy_bx_copy": 12,
                "gelu_backward_bias_grad": 12}
    step = {}
    for group, names in (("bias_bits", [k for k in per_step if k.startswith("bias_bits")]),
                         ("gelu_forward_bits", ["gelu_forward_bits"]),
                         ("gelu_backward_bdy_bx_copy", ["gelu_backward_bdy_bx_copy"]),
                         ("gelu_backward_bias_grad", ["gelu_backward_bias_grad"])):
        step[group] = {side: round(sum(per_step[k] * results[k][side]["ms"] for k in names), 3)
                       for side in ("old", "new")}
        step[group]["bound"] = round(sum(per_step[k] * results[k]["bound_ms"] for k in names), 3)
    # flat, for gpu_session.sh's summary.txt (it reads scalars one level down,
    # by key name): each pair's speedup and agreement, the step's ms
    headline = {"all_bitwise_equal": all(agreement.values())}
    for name, entry in results.items():
        headline[f"{name}_speedup"] = entry["speedup"]
        headline[f"{name}_bitwise_equal"] = entry["bitwise_equal"]
    for group, ms in step.items():
        headline.update({f"{group}_{side}_ms": ms[side] for side in ("old", "new", "bound")})
    report = {
        "benchmark": "bias_gelu_gpu", "headline": headline, "ms_per_gpt2_step": step,
        "rows": n, "width": w,
        "approximate": args.approximate,
        **kernel_bench.run_info(cupy, args, rounds), "kernels": results}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
