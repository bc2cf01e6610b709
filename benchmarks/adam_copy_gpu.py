"""The bf16 weight copies of a GPT-2 step on a GPU: the fused AdamW update
(cuda/adam.cu, ``adam_multi``) followed by one Cast kernel per copy (the
path before: ``to_bf16_bits`` for a weight a product reads as bits,
``round_bf16`` for a bias's float32 copy; cuda/precision.cu) against the
same update writing the copies in its own pass (``adam_multi`` with a copy
table: parallel/precision.fold_weight_casts), interleaved in one process
(CuPy events; rounds of ``--reps`` steps of each path in turn).

The parameters are GPT-2's (``--layers`` 12, ``--width`` 768, ``--vocab``
50304, ``--context`` 1024: 124M, the head tied to the embedding): the
copies are those of the weights the products read (the embedding/head and
4 per block, as bits) and of the products' biases (4 per block, float32).
JSON on stdout: per path the median ms of a step, the launches a step
makes, the bytes it must move (the update 28 bytes an element: w, m, v
read and written, the gradient read; a Cast reads the weight, 4 bytes,
and writes 2 (bits) or 4; the fused copy writes them only) and that
rate's fraction of ``--bound-gbs``; the speedup; and the agreement of
the two paths (the weights and every copy bit for bit, after one step of
each from the same state).

    python benchmarks/adam_copy_gpu.py [--layers 12 --width 768 --vocab 50304]

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

#: the update's bytes an element: w, m, v read and written, the gradient read
UPDATE_BYTES = 7 * 4


def gpt2_params(layers, width, vocab, context):
    """[(name, shape, copy)] of GPT-2's parameters; copy: "bits" (a weight
    a product reads), "float" (a product's bias: a float32 copy) or None
    (layer norms, the position embedding)."""
    out = [("wte/weight", (vocab, width), "bits"), ("wpe/weight", (context, width), None)]
    for i in range(layers):
        out += [(f"h{i}_ln1/weight", (width,), None), (f"h{i}_ln1/bias", (width,), None),
                (f"h{i}_attn/qkv_weight", (3 * width, width), "bits"),
                (f"h{i}_attn/qkv_bias", (3 * width,), "float"),
                (f"h{i}_attn/proj_weight", (width, width), "bits"),
                (f"h{i}_attn/proj_bias", (width,), "float"),
                (f"h{i}_ln2/weight", (width,), None), (f"h{i}_ln2/bias", (width,), None),
                (f"h{i}_fc/weight", (4 * width, width), "bits"),
                (f"h{i}_fc/bias", (4 * width,), "float"),
                (f"h{i}_proj/weight", (width, 4 * width), "bits"),
                (f"h{i}_proj/bias", (width,), "float")]
    return out + [("ln_f/weight", (width,), None), ("ln_f/bias", (width,), None)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--context", type=int, default=1024)
    kernel_bench.add_timing_args(ap)
    args = ap.parse_args(argv)
    cupy = kernel_bench.need_cupy(
        "adam_copy_gpu.py", "--layers, --width, --vocab, --context, --reps and --rounds must "
        "be >= 1" if min(args.layers, args.width, args.vocab, args.context, args.reps,
                         args.rounds) < 1 else None)
    if cupy is None:
        return 2
    from purine_mpi.gpu import kernels
    from purine_mpi.parallel.fuse import FLAT_ALIGN   # the fuse pass's layout

    began = time.monotonic()
    params = gpt2_params(args.layers, args.width, args.vocab, args.context)
    sizes = [int(np.prod(shape)) for _, shape, _ in params]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // FLAT_ALIGN) * FLAT_ALIGN
    rng = np.random.default_rng(0)

    def device(values):
        return cupy.asarray(values)

    start = [(0.02 * rng.standard_normal(total)).astype(np.float32),
             (1e-3 * rng.standard_normal(total)).astype(np.float32),
             np.abs(1e-5 * rng.standard_normal(total)).astype(np.float32)]
    grads = [device((1e-2 * rng.standard_normal(n)).astype(np.float32)) for n in sizes]

    def state():   # each path its own buffers (an emulated asarray may share the host's)
        return [device(a.copy()) for a in start]

    def copies_of():
        return [None if kind is None else
                cupy.empty((n,), np.uint16 if kind == "bits" else np.float32)
                for (_, _, kind), n in zip(params, sizes)]

    decays = [0.1 if len(shape) == 2 else 0.0 for _, shape, _ in params]
    old_state, new_state = state(), state()
    old_copies, new_copies = copies_of(), copies_of()
    plain = kernels.MultiTensorTable(grads, offsets, [1.0] * len(params), decays, np.float32,
                                     factor_dtype=np.float64)
    folded = kernels.MultiTensorTable(grads, offsets, [1.0] * len(params), decays, np.float32,
                                      factor_dtype=np.float64, copies=new_copies,
                                      precision="bfloat16")
    lr = device(np.full((1,), 6e-4, np.float32))
    it = device(np.full((1,), 10, np.int64))
    views = [(old_state[0][o:o + n], c) for o, n, c in zip(offsets, sizes, old_copies)
             if c is not None]

    def old_step():   # the update, then a Cast kernel per copy
        kernels.adam_multi(*old_state, plain, lr, it, beta1=0.9, beta2=0.95, decoupled=True)
        for w, c in views:
            if c.dtype == np.uint16:
                kernels.to_bf16_bits_device(w, c)
            else:
                kernels.round_copy(w, c, "bfloat16")

    def new_step():   # the update writing the copies itself
        kernels.adam_multi(*new_state, folded, lr, it, beta1=0.9, beta2=0.95, decoupled=True)

    old_step()
    new_step()
    agreement = {
        "weights_bitwise_equal": bool(cupy.array_equal(old_state[0].view(np.uint32),
                                                       new_state[0].view(np.uint32))),
        "copies_bitwise_equal": bool(all(
            cupy.array_equal(a.view(np.uint16 if a.dtype == np.uint16 else np.uint32),
                             b.view(np.uint16 if b.dtype == np.uint16 else np.uint32))
            for a, b in zip(old_copies, new_copies) if a is not None)),
        "copies": len(views)}
    elements = sum(sizes)
    copy_write = sum(int(c.nbytes) for _, c in views)
    copy_read = sum(4 * int(w.size) for w, _ in views)
    moved = {"update_then_casts": UPDATE_BYTES * elements + copy_read + copy_write,
             "update_writes_copies": UPDATE_BYTES * elements + copy_write}
    launches = {"update_then_casts": old_step, "update_writes_copies": new_step}
    times, rounds = kernel_bench.interleaved(cupy, launches, args, began)
    results = {name: dict(kernel_bench.rates(ms, moved[name], args.bound_gbs),
                          launches=1 + (len(views) if name == "update_then_casts" else 0))
               for name, ms in times.items()}
    report = {
        "benchmark": "adam_copy_gpu", "layers": args.layers, "width": args.width,
        "vocab": args.vocab, "context": args.context, "parameters": elements,
        **kernel_bench.run_info(cupy, args, rounds), "paths": results,
        "speedup": round(results["update_then_casts"]["ms"]
                         / results["update_writes_copies"]["ms"], 3),
        "agreement": agreement}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
