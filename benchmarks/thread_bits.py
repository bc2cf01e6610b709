"""Which CPU kernels give results that depend on the thread count: every
case's forward and backward (``tests/opcheck.run_op``: the real gradient
builder and the serial runtime) run in one process per thread count
(``PURINE_THREADS``; the count is fixed when purine_mpi is imported), the
outputs and gradients compared bitwise.

    .venv/bin/python benchmarks/thread_bits.py [--threads 1 2] [--only SUBSTRING] [--json]

Prints one line per case and output: ``same`` or the largest absolute and
relative difference against the first thread count, and how many elements
differ. Exit 1 when any differs (docs/running.md, "Reproducibility").
The shapes are those of jobs/digits_lenet.yaml (batch 32), cifar10_quick
(batch 100), a GPT block, and sizes where OpenBLAS starts its threads.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _conv(name, x, w, attrs, bias=True):
    ins = {"x": x, "w": w}
    if bias:
        ins["b"] = (w[0],)
    return name, "Conv", attrs, ins


#: (name, op type, attrs, {input: shape}); every float input is a gradient target
CASES = [
    _conv("digits.conv1", (32, 1, 8, 8), (16, 1, 3, 3), {"pad": 1}),
    _conv("digits.conv2", (32, 16, 4, 4), (32, 16, 3, 3), {"pad": 1}),
    ("digits.pool1", "Pool", {"pool": "max", "kernel": 2, "stride": 2}, {"x": (32, 16, 8, 8)}),
    ("digits.fc1", "InnerProduct", {}, {"x": (32, 32, 2, 2), "w": (64, 128), "b": (64,)}),
    ("digits.fc2", "InnerProduct", {}, {"x": (32, 64), "w": (10, 64), "b": (10,)}),
    ("digits.loss", "SoftmaxLoss", {}, {"x": (32, 10), "label": ("label", 10, 32)}),
    _conv("cifar.conv1", (100, 3, 32, 32), (32, 3, 5, 5), {"pad": 2}),
    _conv("cifar.conv2", (100, 32, 16, 16), (32, 32, 5, 5), {"pad": 2}),
    _conv("cifar.conv3", (100, 32, 8, 8), (64, 32, 5, 5), {"pad": 2}),
    _conv("conv.stride2", (16, 8, 15, 15), (8, 8, 3, 3), {"pad": 1, "stride": 2}),
    _conv("conv.group", (16, 8, 12, 12), (16, 4, 3, 3), {"pad": 1, "group": 2}),
    _conv("conv.1x1", (64, 32, 8, 8), (64, 32, 1, 1), {}),
    ("cifar.pool.ave", "Pool", {"pool": "ave", "kernel": 3, "stride": 2},
     {"x": (100, 32, 16, 16)}),
    ("cifar.pool.max", "Pool", {"pool": "max", "kernel": 3, "stride": 2},
     {"x": (100, 32, 32, 32)}),
    ("cifar.fc", "InnerProduct", {}, {"x": (100, 64, 4, 4), "w": (64, 1024), "b": (64,)}),
    ("fc.large", "InnerProduct", {}, {"x": (256, 512), "w": (512, 512), "b": (512,)}),
    ("fc.one_output", "InnerProduct", {}, {"x": (512, 4096), "w": (1, 4096), "b": (1,)}),
    ("fc.one_row", "InnerProduct", {}, {"x": (1, 4096), "w": (256, 4096), "b": (256,)}),
    ("lrn", "LRN", {"local_size": 5}, {"x": (32, 16, 8, 8)}),
    ("batchnorm", "BatchNorm", {}, {"x": (64, 32, 8, 8), "gamma": (32,), "beta": (32,),
                                    "running_mean": ("const", 0.0, 32),
                                    "running_var": ("const", 1.0, 32)}),
    ("layernorm", "LayerNorm", {"eps": 1e-5}, {"x": (8, 64, 256), "g": (256,), "b": (256,)}),
    ("attention", "Attention", {"num_heads": 4, "causal": True}, {"qkv": (8, 64, 3 * 256)}),
    ("softmax", "Softmax", {}, {"x": (256, 1000)}),
    ("relu", "Relu", {}, {"x": (100, 32, 16, 16)}),
    ("gelu", "Gelu", {}, {"x": (100, 32, 16, 16)}),
    ("tanh", "Tanh", {}, {"x": (100, 32, 16, 16)}),
    ("eltwise.sum", "Eltwise", {"operation": "sum"}, {"a": (100, 4096), "b": (100, 4096)}),
    ("gradnormsq", "GradNormSq", {"scales": [1.0, 0.5]}, {"g1": ("nograd", 300000),
                                                        "g2": ("nograd", 70000)}),
]


def _inputs(spec, rng):
    import numpy as np
    out = {}
    for name, shape in spec.items():
        if shape[0] == "label":
            out[name] = rng.integers(0, shape[1], shape[2]).astype(np.float32)
        elif shape[0] == "const":
            out[name] = np.full(shape[2], shape[1], np.float32)
        elif shape[0] == "nograd":
            out[name] = rng.standard_normal(shape[1:]).astype(np.float32)
        else:
            out[name] = rng.standard_normal(shape).astype(np.float32)
    return out


def worker(path, only):
    """Runs every case in this process (its thread count fixed by the
    environment) and saves the results to ``path`` (.npz)."""
    sys.path.insert(0, ROOT)
    import purine_mpi  # noqa: F401  (decides the threads before NumPy loads)
    import numpy as np
    from purine_mpi.base import threads
    from tests.opcheck import run_op
    saved = {}
    for k, (name, op, attrs, spec) in enumerate(CASES):
        if only and only not in name:
            continue
        rng = np.random.default_rng(1000 + k)
        ins = _inputs(spec, rng)
        wrt = [n for n, s in spec.items() if s[0] not in ("label", "const", "nograd")]
        outs, grads = run_op(op, attrs, ins, wrt=wrt, seed=k)
        for i, v in outs.items():
            if isinstance(i, int):
                saved[f"{name}|out{i}"] = np.asarray(v)
        for p, v in grads.items():
            saved[f"{name}|d{p}"] = np.asarray(v)
    np.savez(path, _threads=np.array(threads.DECISION[0]), **saved)


def _env(n):
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(var, None)  # PURINE_THREADS alone decides every pool
    env["PURINE_THREADS"] = str(n)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def compare(threads, only=""):
    """{case|output: None when bitwise the same, else (max abs, max rel,
    differing, size)} over the thread counts, against the first."""
    import numpy as np
    with tempfile.TemporaryDirectory(prefix="thread_bits") as tmp:
        results = []
        for n in threads:
            path = os.path.join(tmp, f"t{n}.npz")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", path,
                            "--only", only], env=_env(n), check=True)
            with np.load(path) as f:
                got = dict(f)
            assert int(got.pop("_threads")) == n, "the thread count was not applied"
            results.append(got)
    table = {}
    first = results[0]
    for key in first:
        worst = None
        for other in results[1:]:
            a, b = first[key], other[key]
            if np.array_equal(a, b, equal_nan=True):
                continue
            diff = np.abs(a.astype(np.float64) - b)
            rel = diff / np.maximum(np.abs(a.astype(np.float64)), 1e-30)
            entry = (float(diff.max()), float(rel.max()), int(np.count_nonzero(a != b)), a.size)
            worst = entry if worst is None or entry[0] > worst[0] else worst
        table[key] = worst
    return table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--only", default="", help="cases whose name contains this")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.only)
        return 0
    table = compare(args.threads, args.only)
    if args.json:
        print(json.dumps(table, indent=1))
    else:
        print(f"threads {' vs '.join(map(str, args.threads))}")
        for key, entry in table.items():
            if entry is None:
                print(f"  {key:32s} same")
            else:
                print(f"  {key:32s} max abs {entry[0]:.3g}  max rel {entry[1]:.3g}  "
                      f"{entry[2]}/{entry[3]} differ")
    return 1 if any(table.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
