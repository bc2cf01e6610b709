#!/usr/bin/env python
"""Every cuDNN plan of a convolution, run on a GPU, against a float64 CPU
reference: which engines are accurate, which the timing picks.

    python benchmarks/cudnn_plans.py [--case N,C,H,W:O,KH,KW:PAD[:STRIDE]]...

For each case and direction (Conv, ConvGradData, ConvGradWeight) the op is
set up as ``train`` sets it up (its plans timed, the accuracy check of
gpu/cudnn_tune.py applied), then every plan the heuristics built runs on the
same inputs, and its result is compared with the CPU op's in float64.
Prints one JSON object: per case and direction, the plan the set-up chose
and, per plan, its name, workspace bytes and ``deviation`` (max |result -
reference| / max |reference|). On an H200 with cuDNN 9.19 the weight
gradient's ``eng17_k25=0`` deviated by 1.9e-3 and 6.2e-3 where the others
stayed within 7e-6, and was the fastest (docs/gpu.md).

Default cases: the 5x5 convolution of tests/test_cudnn_path.py (16 samples,
32 channels, 16x16) and cifar10_quick's conv2 at batch 128.
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DEFAULT_CASES = ["16,32,16,16:32,5,5:2", "128,32,16,16:32,5,5:2"]


def parse_case(text):
    """'N,C,H,W:O,KH,KW:PAD[:STRIDE]' -> (x shape, w shape, attrs)."""
    try:
        parts = text.split(":")
        n, c, h, w = (int(v) for v in parts[0].split(","))
        o, kh, kw = (int(v) for v in parts[1].split(","))
        attrs = {"pad": int(parts[2]) if len(parts) > 2 else 0}
        if len(parts) > 3:
            attrs["stride"] = int(parts[3])
    except (ValueError, IndexError):
        raise SystemExit(f"error: --case {text!r}: expected N,C,H,W:O,KH,KW:PAD[:STRIDE]")
    return (n, c, h, w), (o, c, kh, kw), attrs


def _rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def direction_rows(cupy, x_shape, w_shape, attrs):
    """The three directions of one case, each with every plan's deviation."""
    from purine_mpi.gpu import cudnn_tune as tune
    from purine_mpi.graph.core import Op
    from purine_mpi.ops.catalog import get_kernel_class
    from tests.emulated_gpu.helpers import run_kernel
    x, w = _rand(x_shape, 0), _rand(w_shape, 1)
    y_shape = run_kernel("Conv", attrs, [x[:1], w])[0].shape[1:]
    dy = _rand((x_shape[0],) + tuple(y_shape), 3)
    rows = []
    for op_type, op_attrs, args in (
            ("Conv", attrs, [x, w]),
            ("ConvGradData", dict(attrs, x_shape=list(x_shape)), [dy, w]),
            ("ConvGradWeight", dict(attrs, w_shape=list(w_shape)), [dy, x])):
        want = run_kernel(op_type, op_attrs, [a.astype(np.float64) for a in args])[0]
        scale = float(np.abs(want).max()) or 1.0
        kernel = get_kernel_class(op_type)(Op("probe", op_type, [], [], dict(op_attrs)))
        dev = [cupy.asarray(a) for a in args]
        out = cupy.empty(want.shape, dtype=np.float32)
        kernel.setup(dev, [out])
        plan = kernel._plan
        if plan is None:
            rows.append({"op": op_type, "error": "no cuDNN plan (the im2col path)"})
            continue
        chosen, graph = plan.index, plan.graph
        plans = []
        for index in range(int(graph.get_execution_plan_count())):
            try:
                plan.index = index
                plan.workspace_bytes = int(graph.get_workspace_size_plan_at_index(index))
                out.fill(np.nan)
                kernel.run(dev, [out])
            except Exception:   # not built, or refused to run
                continue
            got = cupy.asnumpy(out).astype(np.float64)   # on the current stream: after the run
            deviation = float(np.abs(got - want).max()) / scale
            plans.append({"index": index, "name": tune._plan_name(graph, index),
                          "workspace": plan.workspace_bytes,
                          "deviation": deviation if deviation == deviation else None})
        rows.append({"op": op_type, "chosen": chosen,
                     "chosen_name": tune._plan_name(graph, chosen) if chosen is not None
                     else "(heuristic)", "plans": plans})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", default=None,
                    help="N,C,H,W:O,KH,KW:PAD[:STRIDE] (repeatable; default: two cases)")
    args = ap.parse_args(argv)
    cases = [parse_case(c) for c in (args.case or DEFAULT_CASES)]
    from purine_mpi.gpu import import_cupy
    try:
        cupy = import_cupy()
    except Exception as exc:
        raise SystemExit(f"error: needs CuPy and a GPU ({type(exc).__name__}: {exc})")
    # a cache of its own, always: with another run's cache (gpu_session.sh's,
    # 2026-11-29) the set-up takes the cached plan and builds no other, so
    # the survey showed one plan per direction
    os.environ["PURINE_CACHE_DIR"] = tempfile.mkdtemp(prefix="cudnn_plans.")
    report = {"benchmark": "cudnn_plans", "cases": []}
    for x_shape, w_shape, attrs in cases:
        report["cases"].append({"x": list(x_shape), "w": list(w_shape), "attrs": attrs,
                                "directions": direction_rows(cupy, x_shape, w_shape, attrs)})
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
