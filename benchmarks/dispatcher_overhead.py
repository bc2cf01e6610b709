"""Dispatcher overhead per op on graphs of trivial ops (issue: aim < 20 µs/op).

    python benchmarks/dispatcher_overhead.py [--ops 400] [--iters 200]

Prints one JSON object: microseconds per op for a chain and a wide graph, on
one and on two worker threads, for the event-driven dispatcher and the serial
reference, all measured side by side in this run. Each op copies 4 floats, so
the time is the dispatcher's own cost (plus the copy, ~0.3 µs)."""
import argparse
import json
import time

from purine_mpi.graph import Graph
from purine_mpi.runtime.dispatcher import EventDispatcher, SerialDispatcher


def chain(n, threads):
    g = Graph("chain")
    g.add_blob("x", (4,), kind="param")
    prev = "x"
    for i in range(n):
        g.add_op(f"c{i}", "Copy", [prev], [f"b{i}"], thread=i % threads)
        prev = f"b{i}"
    return g.infer_shapes()


def wide(n, threads):
    g = Graph("wide")
    g.add_blob("x", (4,), kind="param")
    for i in range(n):
        g.add_op(f"c{i}", "Copy", ["x"], [f"b{i}"], thread=i % threads)
    g.add_op("join", "Sum", [f"b{i}" for i in range(n)], ["y"])
    return g.infer_shapes()


def per_op_us(dispatcher_cls, graph, iters):
    d = dispatcher_cls(graph)
    try:
        for _ in range(5):
            d.run()
        best = float("inf")
        for _ in range(3):  # best of three rounds: the machine may be shared
            t0 = time.perf_counter()
            for _ in range(iters):
                d.run()
            best = min(best, time.perf_counter() - t0)
    finally:
        d.close()
    return best / iters / len(graph.ops) * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=400)
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    out = {"ops": args.ops, "iters": args.iters, "us_per_op": {}}
    for shape, build in (("chain", chain), ("wide", wide)):
        for threads in (1, 2):
            g = build(args.ops, threads)
            for name, cls in (("event", EventDispatcher), ("serial", SerialDispatcher)):
                key = f"{shape}_{threads}thread_{name}"
                out["us_per_op"][key] = round(per_op_us(cls, g, args.iters), 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
