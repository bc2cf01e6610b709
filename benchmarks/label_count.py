"""What the global label count (``parallel.ignore_label_mean: global``,
ops/data.py attr ``count_label``) costs one rank's data readers per
iteration: the count once per rank (copy 0's reader, as the graph has it)
against one count per micro-batch copy (every copy's reader, as before).

    python -m purine_mpi data text --from SOME.txt --out /tmp/t.h5
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/label_count.py \\
        /tmp/t.h5 [--micro 4] [--batch 64] [--length 1024] [--ranks 2] [--iters 20] [--pairs 8]

Rank 0 of ``--ranks``: a text source of ``--batch`` sequences of
``--length`` tokens per rank, shuffled, a loss with an ``ignore_label``,
``--micro`` micro-batches. Each side runs every reader copy's ``prepare``
(the prefetch thread's work: the copy's batch and, where it counts, the
global batch's labels) for ``--iters`` iterations, in ``--pairs``
interleaved pairs that take turns at going first. Prints one JSON object:
each side's median milliseconds per iteration and the pairs' ratios
(each copy counting over once). On a shared machine compare the ratios.
"""
import argparse
import json
import statistics
import time

from purine_mpi.job.config import resolve_job
from purine_mpi.job.replica import build_train_graph
from purine_mpi.ops.catalog import get_kernel_class
from purine_mpi.parallel.micro_batch import replicate_micro_batches


def readers(path, args, each):
    """The DataReader kernels of one rank's micro-batch copies; ``each``:
    every copy counts (copy 0's count attrs given to all)."""
    raw = {"name": "label_count", "seed": 1,
           "data": {"train": {"source": "text", "path": path, "split": "train",
                              "batch_size": args.batch, "sequence_length": args.length,
                              "shuffle": True}},
           "net": [{"type": "embedding", "name": "wte", "bottom": "data", "top": "tok",
                    "input_dim": 256, "num_output": 4},
                   {"type": "fc", "name": "head", "bottom": "tok", "top": "logits", "axis": -1,
                    "num_output": 256},
                   {"type": "softmax_loss", "name": "loss", "bottom": ["logits", "label"],
                    "top": "loss", "axis": -1, "ignore_label": 32}],
           "parallel": {"micro_batches": args.micro},
           "solver": {"base_lr": 0.1, "max_iter": 10}}
    g, grads = build_train_graph(resolve_job(raw, "<label_count>"), 0, args.ranks, True)
    replicate_micro_batches(g, grads, args.micro)
    ops = [op for op in g.ops.values() if op.op_type == "DataReader"]
    if each:
        keys = ("count_label", "count_over")
        for op in ops:
            op.attrs.update({k: ops[0].attrs[k] for k in keys})
    kernels = [get_kernel_class("DataReader")(op) for op in ops]
    for k in kernels:
        k.prepare(0)  # the source opened, its first batch read
    return kernels


def per_iteration(kernels, start, iters):
    t = time.perf_counter()
    for i in range(start, start + iters):
        for k in kernels:
            k.prepare(i)
    return (time.perf_counter() - t) / iters * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--pairs", type=int, default=8)
    args = p.parse_args()
    sides = {"once": readers(args.path, args, False), "each_copy": readers(args.path, args, True)}
    times = {k: [] for k in sides}
    for pair in range(args.pairs):
        order = list(sides) if pair % 2 == 0 else list(sides)[::-1]
        for name in order:
            times[name].append(per_iteration(sides[name], 1 + pair * args.iters, args.iters))
    ratios = [b / a for a, b in zip(times["once"], times["each_copy"])]
    print(json.dumps({"micro_batches": args.micro, "tokens_per_rank": args.batch * args.length,
                      "ms_per_iteration": {k: round(statistics.median(v), 3)
                                           for k, v in times.items()},
                      "ratio_median": round(statistics.median(ratios), 2),
                      "ratio_range": [round(min(ratios), 2), round(max(ratios), 2)]}))


if __name__ == "__main__":
    main()
