"""bf16 storage (docs/gpu.md, "Precision"), counted offline on the emulated
device (tests/emulated_gpu: the CUDA kernels compiled for the host), with
and without it (``PURINE_BF16_STORAGE``):

- ``launches``: the kernel launches of one eager training step (the second)
  of the test GPT (``gpt_net`` of tests/gpt_oracle.py, width 16, ``--blocks`` blocks)
  in bf16, by kernel (``to_bf16_bits``, ``round_bf16``, ``from_bf16_bits``,
  ``bias_bits_f32``, ``add_bits_f32``, all: our raw kernels, not CuPy's
  element-wise ones or cuBLAS calls), and whether
  the losses and weights after ``--iters`` steps are bit for bit the same;
- ``plan``: ``python -m purine_mpi plan`` of a job (``--plan-job``, with
  ``--set`` overrides) on the emulated device: the GPU total, the arena,
  the scratch slot and the peak's op.

``DATA.h5``: any token file of the job's vocabulary, e.g. a byte-token one,
``python -m purine_mpi data text --from DIR --glob '*.py' --out DATA.h5``.

    PYTHONPATH=. python benchmarks/bf16_storage.py --blocks 12 --plan-job jobs/gpt2_124m.yaml \\
        --set precision=bf16 --set device=0 --set data.train.batch_size=16 \\
        --set parallel.micro_batches=1 --set data.train.path=DATA.h5 --set data.test.path=DATA.h5

Prints one JSON object. A GPU runs cuDNN's SDPA for the attention, which
the emulated device has not (its cuBLAS fallback runs): the GPU's counts
add the SDPA's own conversions, and its scratch slot is not the fallback's.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def launches(storage, blocks, iters, build_dir):
    """({kernel: launches} of the second step, losses, {param: weights})."""
    from _pytest.monkeypatch import MonkeyPatch

    from tests.emulated_gpu import use_emulated_cupy
    from tests.emulated_gpu.helpers import bf16_gpt_steps
    from tests.test_precision import SOLVER
    mp = MonkeyPatch()
    mp.setenv("PURINE_BF16_STORAGE", storage)
    use_emulated_cupy(mp, build_dir)
    try:
        losses, weights, steps = bf16_gpt_steps(mp, SOLVER, iters, blocks, cuda_graph=False,
                                                elementwise=True)
    finally:
        mp.undo()
    return dict(steps[1 if iters > 1 else 0]), losses, weights


_PLAN = """
import pathlib, sys
from _pytest.monkeypatch import MonkeyPatch
from tests.emulated_gpu.helpers import emulated_gpu_env
emulated_gpu_env(MonkeyPatch(), pathlib.Path(sys.argv[1]))
from purine_mpi.cli import main
sys.exit(main(sys.argv[2:]))
"""


def plan(storage, job, sets, build_dir):
    """The device figures of ``plan --json`` on the emulated device."""
    args = [sys.executable, "-c", _PLAN, str(build_dir), "plan", job, "--json",
            "--device-memory", "141G"] + [a for s in sets for a in ("--set", s)]
    env = dict(os.environ, PURINE_BF16_STORAGE=storage,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"plan failed ({res.returncode}): {res.stderr[-2000:]}")
    rank = json.loads(res.stdout)["ranks"][0]
    (device,) = rank["devices"].values()
    return {"total": device["total"], "activations": device["activations"],
            "scratch": device["scratch"], "peak_op": rank["peak"]["op"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--plan-job", default=None)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    build_dir = pathlib.Path(tempfile.mkdtemp(prefix="bf16_storage_kernels_"))
    out = {"blocks": args.blocks}
    runs = {s: launches(s, args.blocks, args.iters, build_dir) for s in ("0", "1")}
    keys = ("to_bf16_bits", "round_bf16", "from_bf16_bits", "bias_bits_f32", "add_bits_f32")
    for s, name in (("0", "float32_storage"), ("1", "bits_storage")):
        counts = runs[s][0]
        out[name] = dict({k: counts.get(k, 0) for k in keys}, all=sum(counts.values()))
    same = runs["0"][1] == runs["1"][1] and all(
        runs["0"][2][p].tobytes() == runs["1"][2][p].tobytes() for p in runs["0"][2])
    out["bitwise_same"] = same
    if args.plan_job:
        out["plan"] = {name: plan(s, args.plan_job, args.sets, build_dir)
                       for s, name in (("0", "float32_storage"), ("1", "bits_storage"))}
    print(json.dumps(out, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
