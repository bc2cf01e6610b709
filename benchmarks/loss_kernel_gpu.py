"""The GPT loss kernels on a GPU, the vectorized ones against the ones before
them (cuda/softmax_loss.cu): forward ``softmax_loss_forward_vec`` against
``softmax_loss_forward_rows``, backward ``softmax_loss_backward_vec``
against the one-thread-per-element ``softmax_loss_backward``, on GPT-2's
logits (16384 positions x 50304 classes, float32), interleaved in one
process (CuPy events; rounds of ``--reps`` launches of each kernel in
turn). JSON on stdout: per kernel the median ms of a launch over the
rounds, the GB/s of the bytes it must move (forward: x read twice, prob
written once, 12 bytes an element; backward: prob read, dx written, 8) and
that rate's fraction of ``--bound-gbs`` (4800: an H200's HBM3e); and the
new kernels' agreement with the old (prob's max abs difference over the
first ``rows_checked`` rows, loss's over every row, dx bit for bit over the
first rows).

And the from_logits loss on logits stored as bfloat16 bits (bf16 storage,
section ``bits``): the path before (each ``LOSS_CHUNK`` of rows widened by
``from_bf16_bits`` into a float32 chunk, the vec kernels in place on it,
the gradient's chunk rounded by ``to_bf16_bits``; ``ops/softmax.py``)
against one kernel each (``softmax_loss_forward_bits_f32``,
``softmax_loss_grad_bits_f32``), interleaved in the same rounds; bytes a
step must move: widen-path forward 18 an element (bits read, float32
written, then 12), bits forward 2 (one read of the bits); widen-path
gradient 32 (6 + 12 + 8 + 6), bits gradient 6 (the bits read twice, dx's
bits written); agreement: the loss and every dx bit of the two paths equal.

    python benchmarks/loss_kernel_gpu.py [--rows 16384 --classes 50304]

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

FORWARD = ("softmax_loss_forward_rows", "softmax_loss_forward_vec")
BACKWARD = (None, "softmax_loss_backward_vec")   # None: softmax_loss_backward


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--classes", type=int, default=50304)
    kernel_bench.add_timing_args(ap)
    args = ap.parse_args(argv)
    cupy = kernel_bench.need_cupy(
        "loss_kernel_gpu.py", "--rows, --classes, --reps and --rounds must be >= 1"
        if min(args.rows, args.classes, args.reps, args.rounds) < 1 else None)
    if cupy is None:
        return 2
    from purine_mpi.gpu import kernels
    from purine_mpi.ops.softmax import LOSS_CHUNK

    began = time.monotonic()
    n, c = args.rows, args.classes
    # logits of spread +-3 made on the device (no host array of 3.3 GB):
    # sin of a multiple of the index, the labels spread over the classes
    x = cupy.asarray(3 * cupy.sin(cupy.arange(n * c, dtype=np.float32) * np.float32(0.7)))
    x = x.reshape(n, c)
    labels = cupy.asarray((cupy.arange(n, dtype=np.int64) * 7919) % c)
    prob = cupy.empty_like(x)
    dx = cupy.empty_like(x)
    loss = cupy.empty((n,), np.float32)
    valid = cupy.empty((n,), np.float32)
    top = cupy.asarray(cupy.full((1,), 1.0, np.float32))   # the top gradient, on the device

    def forward(kernel):
        return lambda: kernels.softmax_loss_forward(x, labels, out=(prob, loss, valid),
                                                    rows_kernel=kernel)

    def backward(kernel):
        return lambda: kernels.softmax_loss_backward(prob, labels, top, out=dx,
                                                     scale_factor=1.0 / n, rows_kernel=kernel)

    # logits stored as bits (the float logits rounded), dx's bits, the
    # float32 chunk of the path before (LOSS_CHUNK elements of whole rows)
    xb = cupy.empty((n, c), np.uint16)
    kernels.to_bf16_bits_device(x.reshape(-1), xb.reshape(-1))
    dxb = cupy.empty_like(xb)
    chunk_rows = max(1, min(n, LOSS_CHUNK // c))
    wide = cupy.empty((chunk_rows, c), np.float32)
    spans = [(r, min(n, r + chunk_rows)) for r in range(0, n, chunk_rows)]

    def widen_forward():   # ops/softmax.py SoftmaxLoss._from_logits before
        for a, b in spans:
            w = wide[:b - a]
            kernels.from_bf16_bits_device(xb[a:b].reshape(-1), w.reshape(-1))
            kernels.softmax_loss_forward(w, labels[a:b], out=(w, loss[a:b], valid[a:b]))

    def bits_forward():
        kernels.softmax_loss_forward_bits(xb, labels, out=(loss, valid))

    def widen_grad():      # SoftmaxLossGrad._from_logits before (dx as bits)
        for a, b in spans:
            w = wide[:b - a]
            kernels.from_bf16_bits_device(xb[a:b].reshape(-1), w.reshape(-1))
            kernels.softmax_loss_forward(w, labels[a:b], out=(w, loss[a:b], valid[a:b]))
            kernels.softmax_loss_backward(w, labels[a:b], top, out=w, scale_factor=1.0 / n)
            kernels.to_bf16_bits_device(w.reshape(-1), dxb[a:b].reshape(-1))

    def bits_grad():
        kernels.softmax_loss_grad_bits(xb, labels, top, out=dxb, scale_factor=1.0 / n)

    BITS = {"widen_forward_vec": (widen_forward, 18), "softmax_loss_forward_bits_f32":
            (bits_forward, 2), "widen_grad_vec_round": (widen_grad, 32),
            "softmax_loss_grad_bits_f32": (bits_grad, 6)}
    widen_forward()
    old_loss = loss.copy()
    bits_forward()
    widen_grad()
    old_dx = dxb.copy()
    bits_grad()
    bits_agreement = {
        "loss_bitwise_equal": bool(cupy.array_equal(old_loss.view(np.uint32),
                                                    loss.view(np.uint32))),
        "dx_bitwise_equal": bool(cupy.array_equal(old_dx, dxb)), "rows_checked": n}
    del old_dx

    # agreement (and the first compile of each kernel)
    check_rows = min(n, 512)
    got = {}
    for fk in FORWARD:
        forward(fk)()
        got[fk] = (cupy.asnumpy(prob[:check_rows]), cupy.asnumpy(loss))
    for bk in BACKWARD:   # both of the same prob (the new forward's)
        backward(bk)()
        got[bk or "softmax_loss_backward"] = cupy.asnumpy(dx[:check_rows])
    old_p, old_l = got[FORWARD[0]]
    new_p, new_l = got[FORWARD[1]]
    agreement = {
        "prob_max_abs_diff": float(np.abs(new_p.astype(np.float64) - old_p).max()),
        "loss_max_abs_diff": float(np.abs(new_l.astype(np.float64) - old_l).max()),
        "dx_bitwise_equal": bool(np.array_equal(got["softmax_loss_backward"].view(np.uint32),
                                                got[BACKWARD[1]].view(np.uint32))),
        "rows_checked": check_rows}

    launches = {k: forward(k) for k in FORWARD}
    launches.update({(k or "softmax_loss_backward"): backward(k) for k in BACKWARD})
    moved = {k: (12 if k in FORWARD else 8) * n * c for k in launches}
    for name, (launch, per) in BITS.items():
        launches[name] = launch
        moved[name] = per * n * c
    for launch in launches.values():   # warm-up
        launch()
    # interleaved: each kernel once a round
    times, rounds = kernel_bench.interleaved(cupy, launches, args, began)
    results = {name: kernel_bench.rates(ms, moved[name], args.bound_gbs)
               for name, ms in times.items()}
    kernels_rows = {k: results.pop(k) for k in BITS}
    report = {
        "benchmark": "loss_kernel_gpu", "rows": n, "classes": c, "dtype": "float32",
        **kernel_bench.run_info(cupy, args, rounds), "kernels": results,
        "forward_speedup": round(results[FORWARD[0]]["ms"] / results[FORWARD[1]]["ms"], 3),
        "backward_speedup": round(results["softmax_loss_backward"]["ms"]
                                  / results[BACKWARD[1]]["ms"], 3),
        "agreement": agreement,
        "bits": {"chunk_rows": chunk_rows, "chunks": len(spans), "kernels": kernels_rows,
                 "forward_speedup": round(kernels_rows["widen_forward_vec"]["ms"]
                                          / kernels_rows["softmax_loss_forward_bits_f32"]["ms"],
                                          3),
                 "grad_speedup": round(kernels_rows["widen_grad_vec_round"]["ms"]
                                       / kernels_rows["softmax_loss_grad_bits_f32"]["ms"], 3),
                 "agreement": bits_agreement}}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
