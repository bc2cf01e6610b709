"""Where a rank's resident bytes above memory.json's baseline are, by kind
of mapping: /proc/self/smaps and glibc's ``mallinfo2`` read at the baseline
(train/trainer.py, after MPI's initialisation and the deferred imports,
before any graph) and after the last iteration (train/loop.py, the
dispatcher drained, before the end's test pass and checkpoint), on every
rank of a run of benchmarks/rss_vs_plan.py's case (the same ``plan`` and
``train`` commands, the same --set values), beside its measured peak and
plan's host total. The attribution tables of docs/running.md ("Where the
rest is, attributed", the pipeline's rank 1):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/smaps_by_mapping.py \\
        --out /tmp/smaps --iters 3 --cases cifar10_quick:data,cifar10_quick:pipeline

Prints one JSON object: per case and rank, MiB above the baseline of each
class of mapping (Rss): ``anonymous`` (mmap'd NumPy arrays, glibc's thread
arenas, thread stacks, BLAS and MPI buffers), ``heap`` (glibc's main heap,
``[heap]``), ``code`` (executable file mappings: pages first executed after
the baseline), ``file`` (other file mappings), ``shm`` (/dev/shm: MPI's
segment) and ``stack``; ``mallinfo2``'s ``arena`` (glibc's heap and thread
arenas), ``uordblks`` (in use), ``fordblks`` (freed but kept) and
``hblkhd`` (chunks mmap'd one each); ``total`` (every mapping), ``peak``
(memory.json's ``above_baseline_bytes``: the high-water mark, which may be
mid-iteration) and ``planned`` (plan's host total). Mapping classes are by
the kernel's view only: what inside an anonymous mapping is whose (a
thread arena, OpenBLAS's buffer) needs an allocation log, not kept here.
With ``--traced``, tracemalloc runs from the baseline on and ``traced``
gives the bytes live at the loop's end of NumPy's arrays (its domain) and
of Python's objects made since (tracemalloc's own bookkeeping then adds to
the mappings' figures).

Internally (``--as-purine``) it is ``python -m purine_mpi`` with the two
reads hooked in, each rank writing OUT/CASE/smaps-rank<R>.json.
"""
import argparse
import ctypes
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CLASSES = ("anonymous", "heap", "code", "file", "shm", "stack")
MALLINFO = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")


def smaps_by_class(files=None):
    """{class: resident bytes} of this process's mappings; ``files``, a
    dict, gets each code or file mapping's resident bytes ("code:PATH",
    "file:PATH")."""
    out = dict.fromkeys(CLASSES, 0)
    kind = path = None
    with open("/proc/self/smaps") as f:
        for line in f:
            p = line.split()
            if "-" in p[0] and not p[0].endswith(":"):
                path = p[5] if len(p) > 5 else ""
                if path == "[heap]":
                    kind = "heap"
                elif path.startswith("[stack"):
                    kind = "stack"
                elif path.startswith("/dev/shm/"):
                    kind = "shm"
                elif path.startswith("/"):
                    kind = "code" if "x" in p[1] else "file"
                else:   # no path, [anon:...], [vdso], [vvar]
                    kind = "anonymous"
            elif p[0] == "Rss:":
                out[kind] += int(p[1]) * 1024
                if files is not None and kind in ("code", "file"):
                    files[kind + ":" + path] = files.get(kind + ":" + path, 0) + \
                        int(p[1]) * 1024
    return out


def mallinfo2():
    """glibc's mallinfo2 as {field: bytes}."""
    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    info = libc.mallinfo2()
    return {name: int(getattr(info, name)) for name in MALLINFO}


def snapshot():
    files = {}
    return {"smaps": smaps_by_class(files), "mallinfo2": mallinfo2(), "code_files": files}


def as_purine(out):
    """``python -m purine_mpi ARGS`` with the baseline's and the loop end's
    reads hooked in (rss_vs_plan.run_hooked; ``train``: any other command
    runs as it is)."""
    import rss_vs_plan   # not at the top: tests/test_plan_rss.py imports smaps_by_class alone
    taken = {}
    traced = os.environ.get("SMAPS_TRACED") == "1"

    def baseline():
        taken["baseline"] = snapshot()
        if traced:
            import tracemalloc
            tracemalloc.start()

    def loop_end(rank):
        taken["after"] = snapshot()
        if traced:   # what tracemalloc traces live, by domain: NumPy's arrays, Python's
            import tracemalloc

            import numpy as np
            traces = tracemalloc.take_snapshot().traces
            numpy = sum(t.size for t in traces if t.domain == np.lib.tracemalloc_domain)
            taken["traced"] = {"numpy": numpy, "python": sum(t.size for t in traces) - numpy}
        with open(os.path.join(out, f"smaps-rank{rank}.json"), "w") as f:
            json.dump(taken, f)
    rss_vs_plan.run_hooked(baseline, loop_end)


def attribute(taken):
    """MiB above the baseline, by class and mallinfo2 field."""
    b, a = taken["baseline"], taken["after"]
    mib = lambda x: round(x / 2**20, 2)  # noqa: E731
    res = {k: mib(a["smaps"][k] - b["smaps"][k]) for k in CLASSES}
    res["total"] = mib(sum(a["smaps"].values()) - sum(b["smaps"].values()))
    res["mallinfo2"] = {k: mib(a["mallinfo2"][k] - b["mallinfo2"][k])
                        for k in ("arena", "uordblks", "fordblks", "hblkhd")}
    if "traced" in taken:   # --traced: tracemalloc's live bytes since the baseline
        res["traced"] = {k: mib(v) for k, v in taken["traced"].items()}
    if "code_files" in a:   # the code and file mappings that grew most, by file
        for kind in ("code", "file"):
            grew = {os.path.basename(f.split(":", 1)[1]): a["code_files"][f]
                    - b["code_files"].get(f, 0) for f in a["code_files"]
                    if f.startswith(kind + ":")}
            res[kind + "_by_file"] = {f: mib(v) for f, v in
                                      sorted(grew.items(), key=lambda kv: -kv[1])[:8] if v > 0}
    return res


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--as-purine":
        out = sys.argv[2]
        sys.argv = [sys.argv[0]] + sys.argv[3:]
        return as_purine(out)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/smaps_by_mapping")
    ap.add_argument("--cases", default="cifar10_quick:data,cifar10_quick:pipeline")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--traced", action="store_true",
                    help="also tracemalloc from the baseline on: the bytes NumPy's arrays "
                         "and Python's objects made since hold at the loop's end (its own "
                         "bookkeeping adds to the other figures)")
    args = ap.parse_args()
    sys.path.insert(0, HERE)
    import rss_vs_plan
    result = {}
    cases = rss_vs_plan.hooked_cases(
        args.cases, args.out, "smaps",
        lambda where: [sys.executable, os.path.abspath(__file__), "--as-purine", where],
        "smaps-rank{}.json", iters=args.iters, env={"SMAPS_TRACED": "1"} if args.traced else None)
    for case, res, ranks in cases:
        if "error" in res:
            result[case] = {"error": res["error"]}
            continue
        result[case] = {}
        for r, p, m, path in ranks:
            with open(path) as f:
                result[case][r] = dict(attribute(json.load(f)), peak=round(m / 2**20, 2),
                                       planned=round(p / 2**20, 2))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
