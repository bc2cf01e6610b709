#!/usr/bin/env python
"""Issue 45's learning target, measured in one run (the ``learn`` stage of
benchmarks/gpu_session.sh): ``gpt2_124m`` on a byte-level BPE vocabulary
trained on a few MB of Python's standard library; the validation loss must
fall below the unigram entropy within 10 minutes, and bf16 must stay within
0.05 nats of fp32 at the same iteration.

    python benchmarks/learn_gpu.py --work DIR [--report-dir DIR] [--budget-s S]
        [--config jobs/gpt2_124m.yaml] [--device 0] [--precisions bf16 fp32]
        [--corpus-mb 8] [--bpe-vocab 50257] [--batch 16] [--seq T] [--iters 3000]
        [--eval-interval 50] [--warmup 100] [--first-share 0.35]
        [--target-s 600] [--max-gap 0.05] [--stop-grace-s 30]
    python benchmarks/learn_gpu.py --work DIR --config jobs/gpt_tiny.yaml --device -1 \\
        --precisions fp32 fp32 --corpus-mb 0.2 --bpe-vocab 300 --batch 4 --iters 6 \\
        --eval-interval 2                                    # the CPU run of the tests

Steps, each with existing machinery (nothing here trains or evaluates):

1. the corpus: the ``*.py`` files of this interpreter's standard library
   (``sysconfig``'s ``stdlib``; not ``site-packages``/``dist-packages``, not
   the test suites: no path part ``test``, ``tests`` or ``idle_test``), in
   sorted order of their relative paths, the first ones until ``--corpus-mb``
   MB (a file that is not UTF-8 is skipped and counted), copied under
   ``WORK/corpus``; the list's SHA-256 is in the JSON;
2. ``python -m purine_mpi data text --from WORK/corpus --glob '*.py'
   --bpe-vocab N --val-fraction 0.1``: a byte-level BPE trained on the whole
   corpus (the ``tokenizers`` library; the vocabulary only: the validation
   tokens are never trained on), the last 10 % of the token stream -- the
   alphabetically last modules -- the validation split;
3. the unigram entropy, nats per token: the cross-entropy of the validation
   tokens under the training split's unigram frequencies with add-one
   smoothing over the vocabulary (the validation loss of a unigram model
   fitted on the training split): ``entropy`` (the threshold).
   Beside it, ``train_entropy`` (the training split's own unigram entropy)
   and ``val_entropy`` (the validation split's own: no unigram model does
   better on it);
4. ``python -m purine_mpi train`` of the job (the config, shortened: one
   micro-batch of ``--batch`` sequences a step, ``--iters`` iterations with
   ``--warmup`` warm-up iterations and the job's cosine to its ``min_lr`` at
   the end, a validation pass over the whole validation split every
   ``--eval-interval`` iterations and at iteration 0, the vocabulary padded
   up to a multiple of 128 where the config's is smaller), once per
   precision in ``--precisions`` order (bf16 first: the headline), each from
   the same seed and the same number of iterations. The runs share the time
   left after step 2 (``--budget-s`` from the start, less 10 s): the first
   gets ``--first-share`` of it, the second the rest; a run still going at
   its share is stopped (SIGTERM: it ends its iteration and writes its
   checkpoint; killed 30 s later), and its ``metrics.jsonl`` rows are kept.
   Its checkpoints are deleted after it (not reported).

The JSON (stdout, also rewritten after each step so that a killed run leaves
what it had): the corpus, the vocabulary, the entropies, each run's
validation curve ``[iteration, seconds, loss]`` (seconds: wall time since the
``train`` process started, its start-up -- graph, kernels, CUDA graph
captures -- included; ``loop_s`` beside it, the training loop's own
``time``), and two verdicts:

- ``below_entropy``: the first evaluation of the first run whose loss is
  below ``entropy`` (its iteration and seconds). PASS where that is within
  ``--target-s`` (600: issue 45's 10 minutes); FAIL where it came later, or
  the run lasted ``--target-s`` without one, or its loss was not finite;
  INCOMPLETE where the run was shorter than ``--target-s`` and never got
  below (one call of the device tool has 600 s: a shorter run that gets
  below meets the target, one that does not cannot say it fails);
- ``below_val_entropy``: the same against ``val_entropy``, the stricter
  threshold (said beside the verdict, not issue 45's);
- ``gap``: ``first - second`` loss at the last iteration both runs evaluated
  (above 0); PASS where its magnitude is at most ``--max-gap``, FAIL above,
  INCOMPLETE where no iteration above 0 was evaluated by both. Every matched
  iteration's gap is listed, with the largest (``max_abs_gap``).

Exit status 0 when the steps ran (whatever the verdicts), 1 when a step
failed (the JSON says which), 2 on bad arguments.
"""
import argparse
import hashlib
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import sysconfig
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
STOP_GRACE_S = 30   # after a SIGTERM: the iteration's end and the checkpoint's write
SPARE_S = 10        # of --budget-s, for the verdicts and the JSON
#: the thresholds, as the verdicts name them: ``entropy`` is not an entropy
#: of one distribution but the validation loss of a unigram model fitted on
#: the training split (>= the validation split's own unigram entropy)
ENTROPY_NAME = "the unigram cross-entropy"
VAL_ENTROPY_NAME = "the val split's own unigram entropy"


class Stopped(Exception):
    """SIGTERM to this script (the stage's timeout)."""


def stdlib_files(root):
    """The standard library's ``*.py`` files under ``root``, sorted by their
    relative paths, without the test suites and installed packages."""
    root = pathlib.Path(root)
    files = [p for p in root.rglob("*.py") if p.is_file()
             and not SKIP_PARTS & set(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def build_corpus(root, dest, max_bytes):
    """Copy the first files of ``stdlib_files(root)`` until ``max_bytes``
    (at least one) under ``dest``; a summary dict."""
    root, dest = pathlib.Path(root), pathlib.Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    listing, total, skipped = hashlib.sha256(), 0, 0
    n = 0
    for path in stdlib_files(root):
        if total >= max_bytes and n:
            break
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        rel = path.relative_to(root).as_posix()
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(data)
        listing.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
        total += len(data)
        n += 1
    if not n:
        raise SystemExit(f"learn_gpu: no *.py file under {root}")
    return {"stdlib": str(root), "files": n, "bytes": total, "not_utf8_skipped": skipped,
            "last_file": rel, "listing_sha256": listing.hexdigest()}


def unigram(train, val, vocab_size):
    """Nats per token: the validation tokens' cross-entropy under the
    training split's add-one-smoothed unigram frequencies (``entropy``), the
    training split's own entropy and the validation split's own."""
    train = np.asarray(train, np.int64)
    val = np.asarray(val, np.int64)
    v = max(int(vocab_size), int(train.max()) + 1, int(val.max()) + 1)
    counts = np.bincount(train, minlength=v).astype(np.float64)
    p = (counts + 1.0) / (counts.sum() + v)
    own = counts[counts > 0] / counts.sum()
    vc = np.bincount(val, minlength=v).astype(np.float64)
    q = vc[vc > 0] / vc.sum()
    return {"entropy": float(-np.log(p[val]).mean()),
            "train_entropy": float(-(own * np.log(own)).sum()),
            "val_entropy": float(-(q * np.log(q)).sum()),
            "val_tokens_unseen_in_train": int((counts[val] == 0).sum()),
            "vocab_size": v, "train_tokens": int(train.size), "val_tokens": int(val.size)}


def read_curve(metrics, started):
    """The test rows of a ``metrics.jsonl``: [{iter, seconds, loop_s, loss}]
    (seconds: the row's timestamp less ``started``; loss None where not
    finite), in order of iteration."""
    rows = []
    if not os.path.exists(metrics):
        return rows
    with open(metrics) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue   # a line cut by a kill
            if rec.get("phase") != "test":
                continue
            loss = rec.get("loss")
            rows.append({"iter": int(rec["iter"]),
                         "seconds": round(float(rec["timestamp"]) - started, 3),
                         "loop_s": rec.get("time"),
                         "loss": float(loss) if loss is not None else None})
    return sorted(rows, key=lambda r: r["iter"])


def _finite(x):
    return x is not None and math.isfinite(x)


def crossing(curve, threshold, wall_s, target_s=600.0, name=None):
    """The verdict on a run's validation ``curve`` (read_curve's rows) getting
    below ``threshold`` within ``target_s`` (module docstring, ``below_entropy``);
    ``wall_s``: how long the run lasted; ``name``: what the threshold is (said
    in ``why`` before its value)."""
    line = f"{name} {threshold:.4f}" if name else f"{threshold:.4f}"
    for row in curve:
        if not _finite(row["loss"]):
            return {"verdict": "FAIL", "why": f"loss not finite at iteration {row['iter']}"}
        if row["loss"] < threshold:
            ok = row["seconds"] <= target_s
            return {"verdict": "PASS" if ok else "FAIL", "iter": row["iter"],
                    "seconds": row["seconds"], "loss": row["loss"],
                    "why": (f"below {line} at iteration {row['iter']}, "
                            f"{row['seconds']:.1f} s after the start "
                            f"({'within' if ok else 'after'} {target_s:g} s)")}
    ran = float(wall_s or 0.0)
    best = min((r["loss"] for r in curve if _finite(r["loss"])), default=None)
    where = (f"the lowest {best:.4f} by iteration {curve[-1]['iter']}" if best is not None
             else "no evaluation")
    if ran >= target_s:
        return {"verdict": "FAIL", "why": f"never below {line} in {ran:.0f} s ({where})"}
    return {"verdict": "INCOMPLETE", "why": f"not below {line} in the {ran:.0f} s run, "
                                            f"shorter than {target_s:g} s ({where})"}


def verdicts(entropy, first, second, target_s=600.0, max_gap=0.05, val_entropy=None):
    """The verdicts (module docstring) from the runs' dicts: ``curve``
    (read_curve's rows), ``wall_s`` (how long the run lasted)."""
    out = {"below_entropy": dict(crossing(first["curve"], entropy, first.get("wall_s"),
                                          target_s, ENTROPY_NAME), entropy=entropy)}
    if val_entropy is not None:   # the stricter threshold, said beside it
        out["below_val_entropy"] = dict(crossing(first["curve"], val_entropy,
                                                 first.get("wall_s"), target_s,
                                                 VAL_ENTROPY_NAME),
                                        entropy=val_entropy)
    ref = {r["iter"]: r["loss"] for r in second["curve"]}
    matched = [[r["iter"], r["loss"], ref[r["iter"]],
                (r["loss"] - ref[r["iter"]]) if _finite(r["loss"]) and _finite(ref[r["iter"]])
                else None]
               for r in first["curve"] if r["iter"] in ref]
    later = [m for m in matched if m[0] > 0]
    gap = {"max_gap": max_gap, "matched": matched}
    if not later:
        gap.update(verdict="INCOMPLETE", why="no iteration above 0 evaluated by both runs")
    else:
        it, a, b, d = later[-1]
        finite = [abs(m[3]) for m in later if m[3] is not None]
        gap.update(iter=it, gap=d, max_abs_gap=max(finite) if finite else None)
        if d is None:
            gap.update(verdict="FAIL", why=f"a loss not finite at iteration {it}")
        else:
            gap.update(verdict="PASS" if abs(d) <= max_gap else "FAIL",
                       why=f"{a:.4f} - {b:.4f} = {d:+.4f} at iteration {it} "
                           f"({'within' if abs(d) <= max_gap else 'beyond'} {max_gap:g})")
    out["gap"] = gap
    return out


def headline(res):
    """The lines gpu_session_summary.py prints: the verdicts, the runs, a failure."""
    lines = []
    for key, v in (res.get("verdicts") or {}).items():
        lines.append(f"{key} {v['verdict']}: {v['why']}")
    if "unigram" in res:
        u = res["unigram"]
        lines.append(f"threshold: {ENTROPY_NAME} {u['entropy']:.4f} nats/token (the val "
                     f"tokens under the train split's add-one-smoothed unigram frequencies); "
                     f"the splits' own unigram entropies: train {u['train_entropy']:.4f}, "
                     f"val {u['val_entropy']:.4f}; {u['vocab_size']} tokens, "
                     f"{u['train_tokens']} train, {u['val_tokens']} val")
    for r in res.get("runs") or []:
        if r.get("precision"):
            lines.append(f"{r['precision']}: evaluated to iteration {r.get('iters_evaluated')} "
                         f"in {r.get('wall_s')} s (cap {r.get('cap_s')} s"
                         f"{', stopped there' if r.get('stopped_at_cap') else ''}), "
                         f"exit {r.get('rc')}")
    if res.get("failed"):
        lines.append(f"failed: {res['failed']}")
    return lines


def job_file(config, data_path, vocab_size, args, dest):
    """The job shortened for this run, written to ``dest`` (module docstring)."""
    import yaml
    job = yaml.safe_load(pathlib.Path(config).read_text())
    data = job["data"]
    for split in ("train", "test"):
        data[split]["path"] = str(data_path)
        if args.seq:
            data[split]["sequence_length"] = args.seq
    data["train"]["batch_size"] = args.batch
    job.setdefault("parallel", {})["micro_batches"] = 1
    solver = job.setdefault("solver", {})
    solver.update(max_iter=args.iters, warmup_iters=args.warmup, test_interval=args.eval_interval,
                  test_iter=None, test_initialization=True, display=args.eval_interval)
    job.setdefault("checkpoint", {})["interval"] = 0
    padded = -(-int(vocab_size) // 128) * 128
    for layer in job["net"]:
        if not isinstance(layer, dict) or "type" not in layer:
            continue
        if layer["type"] == "embedding" and layer.get("input_dim", 0) < vocab_size:
            layer["input_dim"] = padded
            tied = layer["name"]
            for other in job["net"]:
                if isinstance(other, dict) and other.get("tie_weight") == tied:
                    other["num_output"] = padded
        if layer["type"] == "position_embedding" and args.seq:
            layer["max_length"] = max(int(layer.get("max_length", 0)), args.seq)
    pathlib.Path(dest).write_text(yaml.safe_dump(job, sort_keys=False))
    return padded


def run(cmd, cap_s, log_path, env, grace_s=STOP_GRACE_S):
    """``cmd`` with its output to ``log_path``, stopped after ``cap_s`` (TERM to
    its process group, then KILL after ``grace_s``); (exit status, start
    time, seconds, stopped)."""
    started = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO, start_new_session=True)
        stopped = False
        try:
            rc = proc.wait(timeout=max(cap_s, 1))
        except subprocess.TimeoutExpired:
            stopped = True
            _end(proc, grace_s)
            rc = proc.returncode
        except Stopped:   # this script was told to end: the command too, at once (the
            _end(proc, min(grace_s, 3))   # stage's timeout kills this script 5 s on)
            raise
    return rc, started, time.time() - started, stopped


def _end(proc, grace_s):
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="folder for the corpus, data and runs")
    ap.add_argument("--report-dir", help="learn.json (at every step) and each run's "
                    "metrics.jsonl and logs, copied here")
    ap.add_argument("--budget-s", type=float, default=580.0)
    ap.add_argument("--config", default=str(REPO / "jobs" / "gpt2_124m.yaml"))
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--precisions", nargs=2, default=["bf16", "fp32"])
    ap.add_argument("--stdlib", default=sysconfig.get_path("stdlib"))
    ap.add_argument("--corpus-mb", type=float, default=8.0)
    ap.add_argument("--bpe-vocab", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=None, help="default: the config's")
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--eval-interval", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--first-share", type=float, default=0.35)
    ap.add_argument("--stop-grace-s", type=float, default=STOP_GRACE_S,
                    help="after a run's TERM at its share, how long it may take to end")
    ap.add_argument("--target-s", type=float, default=600.0)
    ap.add_argument("--max-gap", type=float, default=0.05)
    args = ap.parse_args(argv)
    for name in ("corpus_mb", "budget_s", "target_s", "max_gap", "stop_grace_s"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    for name in ("batch", "iters", "eval_interval", "bpe_vocab"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.first_share < 1:
        ap.error("--first-share must lie in (0, 1)")
    if not os.path.isfile(args.config):
        ap.error(f"--config {args.config}: no such file")
    return args


def main(argv=None):
    args = parse(argv)
    t0 = time.time()
    deadline = t0 + args.budget_s - SPARE_S
    work = pathlib.Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    report = pathlib.Path(args.report_dir).resolve() if args.report_dir else None
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                     else "")
    res = {"config": os.path.relpath(args.config, REPO), "device": args.device,
           "precisions": args.precisions, "budget_s": args.budget_s, "target_s": args.target_s,
           "settings": {"corpus_mb": args.corpus_mb, "bpe_vocab": args.bpe_vocab,
                        "batch": args.batch, "seq": args.seq, "iters": args.iters,
                        "eval_interval": args.eval_interval, "warmup": args.warmup,
                        "first_share": args.first_share},
           "entropy_note": "nats per token: the validation tokens' cross-entropy under the "
                           "training split's add-one-smoothed unigram frequencies",
           "seconds_note": "wall seconds since the train process started (start-up included)",
           "failed": None}

    def judge():   # the verdicts on the runs so far (one not yet run: no curve)
        runs = list(res.get("runs") or [])
        runs += [{"precision": None, "curve": [], "wall_s": 0}] * (2 - len(runs))
        res["verdicts"] = verdicts(res["unigram"]["entropy"], runs[0], runs[1],
                                   args.target_s, args.max_gap, res["unigram"]["val_entropy"])

    def say():   # WORK/learn.json (and --report-dir's), whole at every write
        if "unigram" in res and res.get("runs"):   # a killed call keeps those so far
            judge()
        res["headline"] = headline(res)
        for folder in filter(None, (work, report)):
            (folder / "learn.json.part").write_text(json.dumps(res, indent=1))
            os.replace(folder / "learn.json.part", folder / "learn.json")

    def collect(entry, out, name, started):
        """A run's curve and seconds; its logs to --report-dir; its checkpoints deleted."""
        entry["wall_s"] = round(time.time() - started, 1)
        entry["curve"] = read_curve(out / "metrics.jsonl", started)
        entry["iters_evaluated"] = entry["curve"][-1]["iter"] if entry["curve"] else None
        if report:
            for src, dst in ((out / "metrics.jsonl", f"learn_{name}_metrics.jsonl"),
                             (out / "train.log", f"learn_{name}_train.log"),
                             (work / f"{name}.log", f"learn_{name}.log")):
                if src.exists():
                    shutil.copy(src, report / dst)
        for ckpt in list(out.glob("*.h5")):
            ckpt.unlink()

    current = None

    def on_term(*_):
        raise Stopped()
    # (restored at the end: main() also runs inside other processes, the tests')
    before = signal.signal(signal.SIGTERM, on_term)
    try:
        t = time.time()
        res["corpus"] = build_corpus(args.stdlib, work / "corpus", int(args.corpus_mb * 1e6))
        data = work / "corpus.h5"
        cmd = [sys.executable, "-m", "purine_mpi", "data", "text", "--from",
               str(work / "corpus"), "--glob", "*.py", "--bpe-vocab", str(args.bpe_vocab),
               "--val-fraction", "0.1", "--out", str(data), "--force"]
        rc, _, secs, stopped = run(cmd, deadline - time.time(), work / "data_text.log", env)
        res["data_s"] = round(time.time() - t, 1)
        if report:
            shutil.copy(work / "data_text.log", report / "learn_data_text.log")
        if rc != 0:
            res["failed"] = f"data text exited {rc}" + (" (stopped at the budget)"
                                                         if stopped else "")
            return 1
        import h5py
        with h5py.File(data, "r") as f:
            vocab = int(f.attrs["vocab_size"])
            res["unigram"] = unigram(f["train/tokens"][:], f["val/tokens"][:], vocab)
        say()
        runs = res["runs"] = []
        for i, prec in enumerate(args.precisions):
            name = f"run{i}_{prec}"
            out = work / name
            padded = job_file(args.config, data, vocab, args, work / f"{name}.yaml")
            left = deadline - time.time()
            cap = (left * args.first_share if i == 0 else left) - args.stop_grace_s
            cmd = [sys.executable, "-m", "purine_mpi", "train", str(work / f"{name}.yaml"),
                   "--out", str(out), "--force", "--set", f"device={args.device}"]
            if prec != "fp32" or args.device >= 0:
                cmd += ["--set", f"precision={prec}"]
            entry = {"precision": prec, "vocab_padded": padded, "cap_s": round(cap, 1),
                     "curve": []}
            runs.append(entry)
            current = (entry, out, name, time.time())
            rc, _, secs, stopped = run(cmd, cap, work / f"{name}.log", env, args.stop_grace_s)
            entry.update(rc=rc, stopped_at_cap=stopped)
            collect(*current)
            current = None
            if rc != 0 and not stopped and res["failed"] is None:
                res["failed"] = f"train {prec} exited {rc} (see {name}.log)"
            say()
        judge()
        return 1 if res["failed"] else 0
    except Stopped:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        res["failed"] = res["failed"] or "terminated (SIGTERM) before the end"
        if current is not None:   # the run that was going (ended by run())
            current[0]["stopped_at_cap"] = False
            collect(*current)
        if "unigram" in res:
            runs = res.setdefault("runs", [])
            while len(runs) < 2:
                runs.append({"precision": None, "curve": [], "wall_s": 0})
            judge()
        return 1
    finally:
        signal.signal(signal.SIGTERM, before)
        res["total_s"] = round(time.time() - t0, 1)
        say()
        print(json.dumps(res, indent=1))


if __name__ == "__main__":
    sys.exit(main())
