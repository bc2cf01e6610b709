"""How long ``plan`` takes with micro-batches (issue 44): ``python -m
purine_mpi plan JOB --np 1 --set parallel.micro_batches=M`` for M = 1, 2,
4, 8 (gradient accumulation: the graph holds M copies of the forward and
backward, runtime/memory_plan.py plans them).

    .venv/bin/python benchmarks/plan_time.py [--config jobs/gpt_small.yaml ...]
        [--micro 1 2 4 8] [--data FILE.h5]

Each figure is one ``plan`` in a fresh process (``run_plan``, what the CLI
and train's start-up memory check run: the rank's graphs, then their memory
plans), in CPU seconds of that process (``time.process_time``: steadier than
the wall clock on a shared machine) and in wall seconds, without Python's
start-up and imports. The jobs read text data only for its vocabulary: a
file is made with ``data text`` from Python's ``email`` package unless
``--data`` names one. Prints one JSON object: {job: {M: {"cpu_s", "wall_s",
"ops", "arena_bytes"}}}.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

ONE = """
import json, sys, time
sys.path.insert(0, {root!r})
from purine_mpi.job.config import load_job
from purine_mpi.tools.plan import offline_footprint
job = load_job({config!r}, {sets!r}, None, check_files=False)
t, w = time.process_time(), time.perf_counter()
fp = offline_footprint(job, 1, 0)
print(json.dumps({{"cpu_s": round(time.process_time() - t, 2),
                  "wall_s": round(time.perf_counter() - w, 2),
                  "ops": fp.peak["ops"], "arena_bytes": fp.peak["arena_bytes"]}}))
"""


def one(config, sets):
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", ONE.format(root=ROOT, config=config, sets=sets)],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", nargs="+", default=[os.path.join(ROOT, "jobs", "gpt_small.yaml"),
                                                    os.path.join(ROOT, "jobs", "gpt2_124m.yaml")])
    ap.add_argument("--micro", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--data", help="a text data file (default: made from Python's email package)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            import email
            data = os.path.join(tmp, "email.h5")
            subprocess.run([sys.executable, "-m", "purine_mpi", "data", "text", "--from",
                            os.path.dirname(email.__file__), "--glob", "*.py", "--out", data],
                           check=True, capture_output=True, cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=ROOT))
        out = {}
        for config in args.config:
            name = os.path.splitext(os.path.basename(config))[0]
            out[name] = {m: one(config, [f"data.train.path={data}", f"data.test.path={data}",
                                         f"parallel.micro_batches={m}"]) for m in args.micro}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
