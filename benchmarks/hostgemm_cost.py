"""What ``ops/hostgemm.py`` costs against plain ``np.matmul`` on the host
products of a cifar10_quick iteration, per shape and for the whole
iteration.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/hostgemm_cost.py \\
        [--config jobs/cifar10_quick.yaml] [--threads 1 2] [--pairs 7] [--reps 20] \\
        [--iter-pairs 7] [--iters 3] [--only SUBSTRING] [--root DIR] [--constant NAME=VALUE]

One process per thread count (``PURINE_THREADS=N``: the count is fixed
when purine_mpi is imported). Each builds the config's trainer (synthetic
data, as ``bench`` runs it), records every call of ``hostgemm.matmul``
during one iteration (the operands' shapes and layouts: a transposed view
stays one), then

- per shape: ``hostgemm.matmul`` and ``np.matmul`` on operands of that
  layout, ``--reps`` calls each, in ``--pairs`` interleaved pairs that take
  turns at going first; the ratio of a pair is np.matmul's time over
  hostgemm's (above 1: hostgemm is faster, as with 2 threads it may be);
- the whole iteration: ``--iters`` training steps with the call sites'
  ``matmul`` as it is and ``--iters`` with it replaced by ``np.matmul``
  (the same graph, the same process), in ``--iter-pairs`` interleaved
  pairs; the ratio is the plain side's time over hostgemm's.

Prints one JSON object: per thread count, each shape's calls per iteration,
multiply-adds, the median time of both sides (microseconds per call), the
median and range of the pairs' ratios, and the iteration's. On a shared
machine compare ratios of one run, not times across runs. ``--root DIR``
imports purine_mpi from another checkout (e.g. a ``git archive`` of the code
before a change) to measure its hostgemm against the same np.matmul.
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
#: the modules that call hostgemm.matmul (``from .hostgemm import matmul``)
CALL_SITES = ("purine_mpi.ops.conv", "purine_mpi.ops.im2col", "purine_mpi.ops.fc",
              "purine_mpi.ops.pool", "purine_mpi.ops.attention")


def _layout(x):
    """An operand's shape, whether its last two axes are a transposed view,
    and whether it broadcasts (a zero stride)."""
    swapped = x.ndim >= 2 and x.strides[-2] < x.strides[-1] and x.shape[-1] > 1
    return [list(x.shape), bool(swapped)]


def _operand(np, rng, shape, swapped):
    if not swapped:
        return rng.standard_normal(shape).astype(np.float32)
    shape = list(shape)
    shape[-2], shape[-1] = shape[-1], shape[-2]
    return rng.standard_normal(shape).astype(np.float32).swapaxes(-1, -2)


def _modules():
    import importlib
    return [importlib.import_module(m) for m in CALL_SITES]


def _patch(mods, fn):
    for m in mods:
        m.matmul = fn


def _trainer(config):
    from purine_mpi.job.config import load_job
    from purine_mpi.tools.bench import synthetic_config
    from purine_mpi.train.trainer import Trainer
    job = synthetic_config(load_job(config, check_files=False))
    job = job.with_training(max_iter=10 ** 6)
    return Trainer(job, out_dir="/nonexistent-hostgemm-cost", profile=False, log=lambda m: None)


def _record(trainer, mods, hostgemm, step):
    """{(layout of a, layout of b, out given): calls} of one iteration."""
    seen = {}

    def recording(xp, a, b, out=None):
        key = json.dumps([_layout(a), _layout(b), out is not None])
        seen[key] = seen.get(key, 0) + 1
        return hostgemm.matmul(xp, a, b, out=out)

    _patch(mods, recording)
    try:
        trainer.step(step)
        trainer.train.drain()
    finally:
        _patch(mods, hostgemm.matmul)
    return seen


def _timed(fn, reps):
    """(wall seconds, CPU seconds of the whole process) per call."""
    w, c = time.perf_counter(), time.process_time()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - w) / reps, (time.process_time() - c) / reps


def _pairs(side_a, side_b, pairs, reps):
    """[(a's (wall, cpu), b's (wall, cpu))] of ``pairs`` interleaved pairs."""
    out = []
    for p in range(pairs):
        if p % 2:
            b = _timed(side_b, reps)
            out.append((_timed(side_a, reps), b))
        else:
            a = _timed(side_a, reps)
            out.append((a, _timed(side_b, reps)))
    return out


def _summary(pairs, scale, unit):
    """Medians of both sides and of the pairs' ratios (b / a), by the wall
    clock and by the process's CPU time (less sensitive to other processes
    taking the cores, as long as a side runs one thread)."""
    res = {}
    for i, clock in enumerate(("wall", "cpu")):
        ratios = [b[i] / a[i] for a, b in pairs]
        ours = statistics.median(a[i] for a, _ in pairs)
        plain = statistics.median(b[i] for _, b in pairs)
        res.update({f"hostgemm_{unit}_{clock}": round(ours * scale, 1),
                    f"numpy_{unit}_{clock}": round(plain * scale, 1),
                    f"ratio_{clock}": round(statistics.median(ratios), 3),
                    f"ratio_{clock}_range": [round(min(ratios), 3), round(max(ratios), 3)]})
    return res


def child(args):
    from purine_mpi.ops import hostgemm  # first: it holds BLAS to one thread before NumPy loads
    import numpy as np
    assert os.environ.get("OPENBLAS_NUM_THREADS") == "1", os.environ.get("OPENBLAS_NUM_THREADS")
    for item in args.constant:
        name, value = item.split("=", 1)
        setattr(hostgemm, name, int(value))
    mods = _modules()
    trainer = _trainer(args.config)
    step = 0
    for _ in range(2):  # warm-up: scratch buffers, the pool
        trainer.step(step)
        step += 1
    trainer.train.drain()
    seen = _record(trainer, mods, hostgemm, step)
    step += 1
    rng = np.random.default_rng(0)
    shapes = []
    for key, calls in sorted(seen.items(), key=lambda kv: -kv[1]):
        (sa, ta), (sb, tb), has_out = json.loads(key)
        name = f"{tuple(sa)}{'T' if ta else ''} @ {tuple(sb)}{'T' if tb else ''}"
        if args.only and args.only not in name:
            continue
        a, b = _operand(np, rng, sa, ta), _operand(np, rng, sb, tb)
        shape = np.matmul(a, b).shape
        out = np.empty(shape, np.float32) if has_out else None
        times = _pairs(lambda: hostgemm.matmul(np, a, b, out=out),
                       lambda: np.matmul(a, b, out=out), args.pairs, args.reps)
        shapes.append({"product": name, "out_given": has_out, "calls_per_iter": calls,
                       "multiply_adds": int(np.prod(shape)) * a.shape[-1],
                       "cut": _cut(hostgemm, a, b, shape),
                       **_summary(times, 1e6, "us")})

    def plain(xp, a, b, out=None):
        return xp.matmul(a, b, out=out)

    def iters(fn):
        def run():
            nonlocal step
            _patch(mods, fn)
            for _ in range(args.iters):
                trainer.step(step)
                step += 1
            trainer.train.drain()
        return run

    it = _pairs(iters(hostgemm.matmul), iters(plain), args.iter_pairs, 1)
    _patch(mods, hostgemm.matmul)
    trainer.close()
    whole = _summary(it, 1e3 / args.iters, "ms")
    whole["pair_ratios_wall"] = [round(b[0] / a[0], 3) for a, b in it]
    print(json.dumps({"threads": hostgemm.threads(), "shapes": shapes, "iteration": whole}))


def _cut(hostgemm, a, b, shape):
    """How hostgemm runs the product: the 2-D plan, or the batch."""
    if b.ndim < 2:
        return "vector: np.matmul"
    if len(shape) == 2:
        axis, cuts = hostgemm.plan(shape[0], shape[1], a.shape[-1])
        return f"{'MNK'[axis]} x{len(cuts)}" if len(cuts) > 1 else "one call"
    return f"batched {shape[:-2]}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "jobs", "cifar10_quick.yaml"))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--iter-pairs", type=int, default=7)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--only", default=None, help="the products whose name holds this")
    parser.add_argument("--constant", action="append", default=[], metavar="NAME=VALUE",
                        help="set a hostgemm constant (PIECE_MIN_WORK=8388608) to try it")
    parser.add_argument("--root", default=ROOT, help="the checkout whose purine_mpi runs")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    args.config = os.path.abspath(args.config)
    result = {"config": args.config, "root": os.path.abspath(args.root)}
    for n in args.threads:
        env = dict(os.environ, PURINE_THREADS=str(n),
                   PYTHONPATH=os.path.abspath(args.root))
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env.pop(var, None)  # PURINE_THREADS alone decides; BLAS runs one thread
        cmd = [sys.executable, os.path.abspath(__file__), "--child"] + sys.argv[1:]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=args.root)
        if out.returncode != 0:
            sys.exit(f"{n} threads failed:\n{out.stdout}\n{out.stderr}")
        result[str(n)] = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
