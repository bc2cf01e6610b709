"""cuDNN plans chosen by measurement, once, and remembered on disk.

A convolution graph (gpu/cudnn.py) has several execution plans (engines:
implicit GEMM, Winograd, FFT, with or without a filter flip, ...). With
``PURINE_CUDNN_BENCHMARK`` on (the default) every plan the heuristics list
is built (``build_plans(build_plan_policy.ALL)``) and timed on the op's own
input buffers, in the op's ``setup`` (before any CUDA-graph capture): one
warm-up run, then ``REPS`` runs between two CUDA events on CuPy's current
stream; the fastest plan is kept and run by index
(``execute_plan_at_index``). FFT and filter-flip engines compete like the
others, but only among the accurate: without TF32, a plan whose result
deviates from the majority of plans by more than ``ACCURACY_TOL`` of the
largest magnitude is never kept (``time_plans``). A bf16/fp16 op's plans
(TF32 allowed: its operands are exact in TF32) are held to the same
tolerance, timed on copies of its inputs rounded to its precision
(gpu/cudnn.py): there a TF32 plan computes the products exactly, as the
float32 plans do, and only an inaccurate engine deviates. Plans that do not build or
fail to run are skipped. With
``PURINE_CUDNN_BENCHMARK=0`` the heuristic's first plan that builds is taken
(``build_plans()``), as before. ``PURINE_CUDNN_DETERMINISTIC=0`` lets
non-deterministic engines (atomics: a resume is then not bit-exact) compete;
by default they are deselected.

The choice is cached in ``$PURINE_CACHE_DIR/cudnn_plans/`` (default
``~/.cache/purine_mpi/cudnn_plans/``), one JSON file per (GPU name, cuDNN
version), one entry per key (direction, shapes, dtype, stride, padding,
dilation, fused epilogue, determinism, TF32). The file is written
atomically (a temporary file, then ``os.replace``), merged with what other
processes wrote meanwhile. Nothing in it is trusted: a file that does not
parse, or names another GPU, cuDNN version or format, is ignored (and
rewritten); an entry whose plan count or plan name at its index differs from
this graph's, or whose plan does not build, is re-timed.

A plan's workspace is capped (``set_workspace_limit``, the config's
``gpu.workspace_limit``): the fastest kept plan whose workspace fits the cap
is chosen; when none fits, the one with the smallest workspace (said once).
Each choice keeps its workspace and how much slower it is than the fastest
kept plan regardless of the cap; ``summary()`` reports both.

``summary()`` is the start-up block's line: plans timed, how long it took,
plans from the cache, the chosen plans' workspace and the time given up to
the cap.
"""
import json
import os
import re
import tempfile
import threading

import numpy as np

from ..base import env
from . import cache_dir

#: timed runs of each plan (after one warm-up run)
REPS = 3
#: layout of the cache files; another value is a stale file (2: plans chosen
#: among the accurate ones only; 3: accuracy checked on inputs of varied
#: values -- format 2 compared the plans on the op's buffers at set-up,
#: zeros in a training job, and kept an inaccurate engine)
FORMAT = 3
#: the largest deviation from the majority's result, relative to its largest
#: magnitude, of a float32 plan that may be kept (without TF32; float32
#: implicit-GEMM engines agree within about 1e-6 on an H200)
ACCURACY_TOL = 1e-4

#: the default cap on one plan's workspace (bytes): ``gpu.workspace_limit``
DEFAULT_WORKSPACE_LIMIT = 256 << 20

_lock = threading.RLock()
_limit = {"bytes": DEFAULT_WORKSPACE_LIMIT}
_stats = {"timed": 0, "cached": 0, "heuristic": 0, "seconds": 0.0, "path": None,
          "rejected": [], "inaccurate": 0, "undecided": 0, "workspace_max": 0,
          "workspace_total": 0, "ms_given_up": 0.0, "capped": 0, "over_cap": 0}


def set_workspace_limit(nbytes):
    """Cap each chosen plan's workspace at ``nbytes`` (None: the default)."""
    _limit["bytes"] = DEFAULT_WORKSPACE_LIMIT if nbytes is None else int(nbytes)


def workspace_limit():
    """The cap on one plan's workspace, in bytes."""
    return _limit["bytes"]


def _flag(name):
    return env.get(name)  # a flag, default on; EnvError when not a flag


def benchmark_enabled():
    """``PURINE_CUDNN_BENCHMARK`` (default on): time the plans."""
    return _flag("PURINE_CUDNN_BENCHMARK")


def deterministic():
    """``PURINE_CUDNN_DETERMINISTIC`` (default on): deterministic plans only."""
    return _flag("PURINE_CUDNN_DETERMINISTIC")


def device_name(cupy, device):
    """The GPU's name, as CUDA reports it."""
    name = cupy.cuda.runtime.getDeviceProperties(int(device))["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def cache_path(gpu_name, version):
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", gpu_name).strip("_") or "gpu"
    return os.path.join(cache_dir(), "cudnn_plans", f"{slug}-cudnn{version}.json")


def plan_key(kind, geo, dtype, bias, relu, slope, determ, tf32, values=None):
    """The cache key of one convolution direction (``values``: the low
    precision its float32 operands hold, ``bfloat16`` or ``float16``, or
    None: a float32 op; such a key ends in it)."""
    g = geo
    return (f"{kind} x{g['N']}x{g['C']}x{g['H']}x{g['W']} w{g['O']}x{g['C']}x{g['kh']}x{g['kw']}"
            f" s{g['sh']},{g['sw']} p{g['ph']},{g['pw']} d{g['dh']},{g['dw']} g{g['G']}"
            f" {np.dtype(dtype).name} bias{int(bool(bias))} relu{int(bool(relu))}:{float(slope)}"
            f" det{int(bool(determ))} tf32{int(bool(tf32))} ws{workspace_limit()}"
            + (f" {values}" if values else ""))


def _reject(why):
    with _lock:
        if why not in _stats["rejected"]:
            _stats["rejected"].append(why)


def load(path, gpu_name, version):
    """The entries of the cache file at ``path`` ({} when it is missing,
    corrupt, or written for another GPU / cuDNN version / format)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        _reject(f"{path}: unreadable ({type(exc).__name__})")
        return {}
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or \
            doc.get("gpu") != gpu_name or doc.get("cudnn") != version or \
            not isinstance(doc.get("plans"), dict):
        _reject(f"{path}: for another GPU, cuDNN version or format")
        return {}
    return doc["plans"]


def cached_entry(key):
    """The entry of ``key`` in any cache file of this cache folder (the
    newest file first), or None: for a footprint made before a GPU is
    chosen, where neither its name nor the cuDNN version is known."""
    import glob
    files = glob.glob(os.path.join(cache_dir(), "cudnn_plans", "*.json"))
    for path in sorted(files, key=os.path.getmtime, reverse=True):
        try:
            with open(path) as f:
                doc = json.load(f)
            entry = doc["plans"][key] if doc.get("format") == FORMAT else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if isinstance(entry, dict) and isinstance(entry.get("workspace"), int):
            return entry
    return None


def store(path, gpu_name, version, key, entry):
    """Add ``entry`` under ``key`` to the cache file, atomically."""
    with _lock:
        plans = dict(load(path, gpu_name, version))
        plans[key] = entry
        doc = {"format": FORMAT, "gpu": gpu_name, "cudnn": version, "plans": plans}
        folder = os.path.dirname(path)
        try:
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".cudnn_plans.", dir=folder)
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError:   # a read-only cache: the choice is only not remembered
            return False
    return True


def _plan_name(graph, index):
    try:
        return str(graph.get_plan_name_at_index(index))
    except Exception:
        return ""


def cached_index(graph, entry):
    """The plan index ``entry`` names, built, or None when the entry does not
    match this graph (count, name) or its plan does not build."""
    try:
        index, count, name = int(entry["index"]), int(entry["count"]), str(entry["name"])
    except (KeyError, TypeError, ValueError):
        return None
    if count != int(graph.get_execution_plan_count()) or not 0 <= index < count or \
            _plan_name(graph, index) != name:
        return None
    try:
        graph.build_plan_at_index(index)
    except Exception:
        return None
    return index


def _run_plan(graph, pack, handle, cupy, index):
    """Run plan ``index`` once with a workspace of its own; returns that
    workspace (its size is the plan's). Raises when the plan is not built
    or refuses to run."""
    from .raw import data_ptr
    ws_bytes = int(graph.get_workspace_size_plan_at_index(index))
    workspace = cupy.empty((max(ws_bytes, 1),), dtype=np.uint8)
    graph.execute_plan_at_index(pack, data_ptr(workspace), index=index, handle=handle)
    return workspace, ws_bytes


def _deviation(cupy, output, reference, scale):
    """max |output - reference| / scale (inf for a NaN)."""
    value = float(cupy.abs(output - reference).max()) / scale
    return value if value == value else float("inf")


def _accurate(graph, pack, handle, cupy, output, runs, tol):
    """The runs whose output agrees with the majority's within ``tol`` of
    the largest magnitude. The first run's output is the reference; when
    fewer than half agree with it, it was the odd one, and the first that
    disagreed becomes the reference (each plan runs once more). Sets each
    run's "deviation"; marks the others rejected."""
    def against(ref_index):
        _run_plan(graph, pack, handle, cupy, ref_index)
        reference = output.copy()
        scale = float(cupy.abs(reference).max()) or 1.0
        for run in runs:
            if run["index"] == ref_index:
                run["deviation"] = 0.0
                continue
            _run_plan(graph, pack, handle, cupy, run["index"])
            run["deviation"] = _deviation(cupy, output, reference, scale)
        return [r for r in runs if r["deviation"] <= tol]

    agree = against(runs[0]["index"])
    if 2 * len(agree) < len(runs):
        other = next(r for r in runs if r["deviation"] > tol)
        agree = against(other["index"])
        if 2 * len(agree) < len(runs):   # no majority: nothing to tell the odd ones by
            with _lock:
                _stats["undecided"] += 1
            return runs
    return agree


def time_plans(graph, pack, handle, cupy, reps=REPS, output=None, tol=None, check_pack=None):
    """Time every built plan of ``graph`` on the variant pack ``pack``
    ({tensor: device address}) on CuPy's current stream. With ``output``
    (the CuPy array the pack writes) and ``tol``, a plan whose result
    deviates from the majority's by more than ``tol`` of the largest
    magnitude is not kept, however fast (``_accurate``; on an H200 a
    Winograd-style weight-gradient engine was the fastest and off by up to
    6e-3). The results compared are those of ``check_pack`` (default
    ``pack``), a pack writing the same ``output`` from inputs of varied
    values: on zeros every plan agrees. Returns the entry of the fastest kept,
    {"index", "name", "count", "ms", "workspace", "rejected"}, or None when
    no plan ran."""
    from .raw import data_ptr
    stream = cupy.cuda.get_current_stream()
    count = int(graph.get_execution_plan_count())
    runs = []
    for index in range(count):
        try:
            workspace, ws_bytes = _run_plan(graph, pack, handle, cupy, index)   # warm-up
            ptr = data_ptr(workspace)
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            for _ in range(reps):
                graph.execute_plan_at_index(pack, ptr, index=index, handle=handle)
            stop.record(stream)
            stop.synchronize()
            ms = float(cupy.cuda.get_elapsed_time(start, stop)) / reps
        except Exception:   # not built (ALL builds what it can), or refused to run
            continue
        runs.append({"index": index, "name": _plan_name(graph, index), "count": count,
                     "ms": ms, "workspace": ws_bytes})
    if not runs:
        return None
    kept = runs
    if output is not None and tol is not None and len(runs) > 1:
        kept = _accurate(graph, pack if check_pack is None else check_pack, handle, cupy,
                         output, runs, tol)
    rejected = [{"name": r["name"], "deviation": r["deviation"]} for r in runs
                if r not in kept]
    best = dict(choose(kept, workspace_limit()))
    best.pop("deviation", None)
    best["rejected"] = rejected
    with _lock:
        _stats["inaccurate"] += len(rejected)
    return best


def choose(runs, limit):
    """The fastest of ``runs`` ({"ms", "workspace", ...}) whose workspace
    is at most ``limit`` bytes, else the one with the smallest workspace
    (then the fastest of those), with "fastest_ms" (the fastest regardless
    of the cap) and "over_cap" (no run fitted)."""
    fastest = min(runs, key=lambda r: r["ms"])
    fits = [r for r in runs if r["workspace"] <= limit]
    if fits:
        best, over = min(fits, key=lambda r: r["ms"]), False
    else:
        best, over = min(runs, key=lambda r: (r["workspace"], r["ms"])), True
    return dict(best, fastest_ms=fastest["ms"], over_cap=over)


def note_choice(workspace, ms=None, fastest_ms=None, over_cap=False):
    """Count a chosen plan's workspace and the time it gives up to the cap."""
    with _lock:
        _stats["workspace_max"] = max(_stats["workspace_max"], int(workspace))
        _stats["workspace_total"] += int(workspace)
        if ms is not None and fastest_ms is not None and ms > fastest_ms:
            _stats["ms_given_up"] += float(ms) - float(fastest_ms)
            _stats["capped"] += 1
        if over_cap:
            _stats["over_cap"] += 1


def note(source, seconds=0.0, path=None):
    """Count one plan chosen from ``source``: timed, cached or heuristic."""
    with _lock:
        _stats[source] += 1
        _stats["seconds"] += seconds
        if path:
            _stats["path"] = path


def stats():
    with _lock:
        return dict(_stats, rejected=list(_stats["rejected"]))


def reset():
    """Forget the counts and the workspace cap (tests; a new process): the
    cap ``configure_device`` set for one job does not outlive it."""
    with _lock:
        _limit["bytes"] = DEFAULT_WORKSPACE_LIMIT
        _stats.update(timed=0, cached=0, heuristic=0, seconds=0.0, path=None, rejected=[],
                      inaccurate=0, undecided=0, workspace_max=0, workspace_total=0,
                      ms_given_up=0.0, capped=0, over_cap=0)


def summary():
    """The start-up block's cuDNN line, or None when no cuDNN plan was made."""
    s = stats()
    if not (s["timed"] or s["cached"] or s["heuristic"]):
        return None
    if s["heuristic"] and not (s["timed"] or s["cached"]):
        return (f"{s['heuristic']} plans from the heuristics, untimed "
                "(PURINE_CUDNN_BENCHMARK=0)")
    text = (f"{s['timed']} plans timed in {s['seconds']:.2f} s, "
            f"{s['cached']} from the cache")
    if s["path"]:
        text += f" ({s['path']})"
    if s["inaccurate"]:
        text += (f"; {s['inaccurate']} inaccurate plan(s) set aside (off the others' result "
                 f"by more than {ACCURACY_TOL:g} of its largest value)")
    if s["undecided"]:
        text += (f"; {s['undecided']} convolution(s) whose plans disagree with no majority "
                 "(the fastest kept)")
    if s["rejected"]:
        text += f"; {len(s['rejected'])} cache file(s) ignored and rewritten"
    return text + "; " + workspace_summary(s)


def workspace_summary(s=None):
    """The chosen plans' workspace against the cap, and the time given up."""
    from ..base.progress_bar import human_bytes
    s = s or stats()
    text = (f"workspace up to {human_bytes(s['workspace_max'])} a plan "
            f"({human_bytes(s['workspace_total'])} in all; cap {human_bytes(workspace_limit())}, "
            "gpu.workspace_limit)")
    if s["capped"]:
        text += (f", {s['capped']} plan(s) slower than the fastest by "
                 f"{s['ms_given_up']:.3f} ms a run in all")
    if s["over_cap"]:
        text += f", {s['over_cap']} with no plan under the cap (the smallest taken)"
    return text
