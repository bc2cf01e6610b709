"""CPU micro-benchmark of the convolution and pooling kernels, one thread:
each op of cifar10_quick (batch 100) and NIN (batch 128) timed alone, this
checkout against another one (``--baseline``), interleaved.

    git worktree add DIR main            # or any commit to compare with
    .venv/bin/python benchmarks/conv_ops.py --baseline DIR [--rounds 5]
        [--reps 5] [--net cifar10_quick|nin|all] [--only SUBSTRING] [--torch]
        [--bias]

Every round runs one worker process per checkout (taking turns at going
first), each timing every selected op ``--reps`` times after one warm-up
run in CPU time (``time.process_time``: the time the process is descheduled
by its neighbours on a shared machine does not count); the fastest run is
the round's figure. Prints one JSON object: per op, the
median and range over the rounds of each checkout's ms, and
``baseline_over_this`` (baseline ms / this ms, the median of the rounds'
ratios: above 1 this checkout is faster). Without
``--baseline`` only this checkout is timed. ``--torch`` adds PyTorch CPU's
time for the same op (aten's convolution / convolution_backward / pooling
and their backward) as a third process each round. ``--bias`` gives every
Conv a bias input, as the nets' layers have (both sides add it).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _conv(name, n, c, hw, o, k, pad, stride=1, data_grad=True):
    attrs = {"pad": pad, "stride": stride}
    oh = (hw + 2 * pad - k) // stride + 1
    x, w, y = (n, c, hw, hw), (o, c, k, k), (n, o, oh, oh)
    ops = [(f"{name}.Conv", "Conv", attrs, [x, w], [y]),
           (f"{name}.ConvGradWeight", "ConvGradWeight", dict(attrs, w_shape=list(w)), [y, x], [w])]
    if data_grad:  # a first layer's input (the data) has no gradient in training
        ops.append((f"{name}.ConvGradData", "ConvGradData", dict(attrs, x_shape=list(x)),
                    [y, w], [x]))
    return ops


def _pool(name, kind, n, c, hw, k, s):
    attrs = {"pool": kind, "kernel": k, "stride": s, "ceil_mode": True}
    oh = -(-(hw - k) // s) + 1
    x, y = (n, c, hw, hw), (n, c, oh, oh)
    fwd_outs = [y, y] if kind == "max" else [y]
    grad_ins = [y, y] if kind == "max" else [y]
    return [
        (f"{name}.Pool", "Pool", attrs, [x], fwd_outs),
        (f"{name}.PoolGrad", "PoolGrad", dict(attrs, x_shape=list(x)), grad_ins, [x]),
    ]


CASES = {
    "cifar10_quick": (_conv("c10q.conv1", 100, 3, 32, 32, 5, 2, data_grad=False)
                      + _pool("c10q.pool1", "max", 100, 32, 32, 3, 2)
                      + _conv("c10q.conv2", 100, 32, 16, 32, 5, 2)
                      + _pool("c10q.pool2", "ave", 100, 32, 16, 3, 2)
                      + _conv("c10q.conv3", 100, 32, 8, 64, 5, 2)
                      + _pool("c10q.pool3", "ave", 100, 64, 8, 3, 2)),
    "nin": (_conv("nin.conv1", 128, 3, 32, 192, 5, 2, data_grad=False)
            + _conv("nin.cccp1", 128, 192, 32, 160, 1, 0)
            + _pool("nin.pool1", "max", 128, 96, 32, 3, 2)
            + _conv("nin.conv2", 128, 96, 16, 192, 5, 2)
            + _conv("nin.cccp3", 128, 192, 16, 192, 1, 0)
            + _conv("nin.conv3", 128, 192, 8, 192, 3, 1)),
}


def _inputs(op_type, attrs, shapes, rng):
    import numpy as np
    arrays = []
    for i, shape in enumerate(shapes):
        if op_type == "PoolGrad" and i == 1:  # a max mask: flat argmax indices in range
            h, w = attrs["x_shape"][2:]
            arrays.append(rng.integers(0, h * w, size=shape).astype(np.int32))
        else:
            arrays.append(rng.standard_normal(shape).astype(np.float32))
    return arrays


def _with_bias(case):
    """The case with a bias input when it is a Conv (``--bias``)."""
    name, op_type, attrs, in_shapes, out_shapes = case
    if op_type != "Conv":
        return case
    return name, op_type, attrs, in_shapes + [(in_shapes[1][0],)], out_shapes


def _ours(case):
    import types

    import numpy as np

    from purine_mpi.ops.catalog import get_kernel_class
    name, op_type, attrs, in_shapes, out_shapes = case
    rng = np.random.default_rng(0)
    ins = _inputs(op_type, attrs, in_shapes, rng)
    outs = [np.empty(s, dtype=np.int32 if (op_type == "Pool" and i == 1) else np.float32)
            for i, s in enumerate(out_shapes)]
    kernel = get_kernel_class(op_type)(types.SimpleNamespace(name=name, attrs=attrs,
                                                             op_type=op_type))
    kernel.setup(ins, outs)
    return lambda: kernel.run(ins, outs)


def _torch(case):
    import numpy as np
    import torch
    import torch.nn.functional as F
    name, op_type, attrs, in_shapes, out_shapes = case
    ins = [torch.from_numpy(a) for a in _inputs(op_type, attrs, in_shapes,
                                                 np.random.default_rng(0))]
    conv = dict(stride=[attrs.get("stride", 1)] * 2, padding=[attrs.get("pad", 0)] * 2,
                dilation=[1, 1], transposed=False, output_padding=[0, 0], groups=1)
    if op_type == "Conv":
        bias = ins[2] if len(ins) == 3 else None
        return lambda: torch.ops.aten.convolution(ins[0], ins[1], bias, **conv)
    if op_type in ("ConvGradData", "ConvGradWeight"):
        dy, other = ins
        x = torch.empty(attrs["x_shape"]) if op_type == "ConvGradData" else other
        w = other if op_type == "ConvGradData" else torch.empty(attrs["w_shape"])
        mask = [op_type == "ConvGradData", op_type == "ConvGradWeight", False]
        conv["bias_sizes"] = None
        return lambda: torch.ops.aten.convolution_backward(dy, x, w, output_mask=mask, **conv)
    k, s = attrs["kernel"], attrs["stride"]
    if op_type == "Pool":
        fn = F.max_pool2d if attrs["pool"] == "max" else F.avg_pool2d
        return lambda: fn(ins[0], k, s, ceil_mode=True)
    x = torch.randn(attrs["x_shape"], requires_grad=True)
    if attrs["pool"] == "max":
        y = F.max_pool2d(x, k, s, ceil_mode=True)
    else:
        y = F.avg_pool2d(x, k, s, ceil_mode=True)
    dy = torch.randn(y.shape)
    return lambda: torch.autograd.grad(y, x, dy, retain_graph=True)


def worker(cases, reps, impl, bias=False):
    if impl == "torch":
        import torch
        torch.set_num_threads(1)
    make = _torch if impl == "torch" else _ours
    result = {}
    for case in cases:
        fn = make(_with_bias(case) if bias else case)
        fn()
        times = []
        for _ in range(reps):
            t = time.process_time()
            fn()
            times.append(time.process_time() - t)
        result[case[0]] = 1000 * min(times)
    return result


def _env(root):
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "PURINE_THREADS"):
        env[var] = "1"
    env["PYTHONPATH"] = root
    return env


def _run_worker(root, args, impl):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--reps",
           str(args.reps), "--net", args.net] + (["--only", args.only] if args.only else []) \
        + (["--bias"] if args.bias else [])
    out = subprocess.run(cmd, env=_env(root), capture_output=True, text=True, cwd=root,
                         timeout=1800)
    if out.returncode:
        sys.exit(f"worker in {root} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _selected(net, only):
    nets = list(CASES) if net == "all" else [net]
    return [c for n in nets for c in CASES[n] if not only or only in c[0]]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="a checkout of the version to compare with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--net", default="cifar10_quick", choices=list(CASES) + ["all"])
    p.add_argument("--only", help="only the ops whose name contains this")
    p.add_argument("--torch", action="store_true", help="also time PyTorch CPU")
    p.add_argument("--bias", action="store_true", help="Conv ops with a bias input")
    p.add_argument("--worker", choices=["ours", "torch"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(_selected(args.net, args.only), args.reps, args.worker,
                                args.bias)))
        return
    runs = [("baseline", args.baseline, "ours")] if args.baseline else []
    runs.append(("this", ROOT, "ours"))
    if args.torch:
        runs.append(("torch", ROOT, "torch"))
    rounds = []
    for i in range(args.rounds):  # the order alternates, so neither side always goes first
        order = runs if i % 2 == 0 else runs[::-1]
        rounds.append({label: _run_worker(root, args, impl) for label, root, impl in order})
    ops = {}
    for case in _selected(args.net, args.only):
        name = case[0]
        entry = {}
        for label, _, _ in runs:
            ms = [r[label][name] for r in rounds]
            entry[label + "_ms"] = round(statistics.median(ms), 3)
            entry[label + "_ms_range"] = [round(min(ms), 3), round(max(ms), 3)]
        for ref in ("baseline", "torch"):
            if any(label == ref for label, _, _ in runs):
                entry[f"{ref}_over_this"] = round(statistics.median(
                    r[ref][name] / r["this"][name] for r in rounds), 3)
        ops[name] = entry
    totals = {label + "_ms": round(sum(ops[n][label + "_ms"] for n in ops), 3)
              for label, _, _ in runs}
    print(json.dumps({"net": args.net, "rounds": args.rounds, "reps": args.reps,
                      "threads": 1, "bias": args.bias, "baseline": args.baseline, "ops": ops,
                      "total": totals}))


if __name__ == "__main__":
    main()
