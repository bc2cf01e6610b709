"""The short text benchmarks/gpu_session.sh leaves beside its archive
(``$OUT/summary.txt``): each stage's status and seconds, each step's exit
status, and the headline figures of the reports written so far.

    python benchmarks/gpu_session_summary.py WORK_DIR

reads WORK_DIR (the stages' folder: stages.txt, status.txt, pytest_gpu.xml,
probe.txt, *.json) and prints the summary (a JSON report's ``headline``, a
list of lines, as they are; its figures by key name). It never fails on a missing or
half-written report (a stage cut at its budget or a killed call): such a
file gets one line saying so. Standard library only.
"""
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

#: tests whose outcome on a GPU the summary names one by one: the ones only
#: a GPU can confirm (no flush to zero: docs/gpu.md "Compiling the kernels";
#: the vectorized loss kernels)
WATCHED = ("test_gpu_kernel_options", "gelu_gradient_copy_kernels_on_adversarial",
           "layer_norm_gradient_copy_kernels_on_adversarial",
           "test_the_redrawn_dropout_gradient_writes_dx_and_its_bits",
           "test_gpu_loss_vec", "test_gpu_bias_gelu_vec")
#: the figures worth a line, by key name (the last line: gpt_gpu.json's
#: ``device_memory`` of each side of ours, what its peak is made of)
HEADLINE = re.compile(r"(per_s$|_ms$|^ms$|ms_per_iter$|ms_median$|peak|^mfu$|speedup|"
                      r"fraction|bitwise|max_abs_diff|_vs_|"
                      r"^in_use_before|^left_in_use|^cublaslt_|^cublas_handles$|"
                      r"^cublas_workspace_bytes$|^arena_bytes$|^scratch_bytes$)")
#: keys that are lists of rows, and the keys that name a row
ROWS = ("results",)
ROW_NAME = ("config", "batch", "precision", "path")


def _number(value):
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1e5 else f"{value:.4g}"
    return str(value)


def _scalars(prefix, mapping, out, depth=0):
    """``key=value`` for the headline scalars of ``mapping`` (and of the
    dicts in it, one level down, as ``parent.key``)."""
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and depth < 1:
            _scalars(name + ".", value, out, depth + 1)
        elif isinstance(value, (int, float, bool)) and value is not None \
                and HEADLINE.search(str(key)):
            out.append(f"{name}={_number(value)}")


def json_lines(path):
    """One or a few lines of headline figures of a JSON report."""
    text = path.read_text(errors="replace").strip()
    if not text:
        return [f"{path.name}: empty (the run wrote nothing: cut or failed, see its .log)"]
    docs = []
    try:
        docs = [json.loads(text)]
    except json.JSONDecodeError:
        for line in text.splitlines():   # one report a line (gpu_dp.json)
            try:
                docs.append(json.loads(line))
            except json.JSONDecodeError:
                return [f"{path.name}: not JSON (cut while writing?): {text[:80]!r}"]
    lines = []
    for doc in docs:
        if not isinstance(doc, dict):
            lines.append(f"{path.name}: {str(doc)[:100]}")
            continue
        rows = [row for key in ROWS for row in doc.get(key) or [] if isinstance(row, dict)]
        sides = doc.get("sides") if isinstance(doc.get("sides"), dict) else {}
        head = {k: v for k, v in doc.items() if k not in ROWS and k != "sides"}
        # a report's own lines (learn_gpu.py's verdicts): each as it is
        said = [str(text) for text in doc.get("headline") or []]
        lines += [f"{path.name}: {text}" for text in said]
        figures = []
        _scalars("", head, figures)
        if figures or not (rows or sides or said):
            lines.append(f"{path.name}: " + (" ".join(figures) or "(no headline figure)"))
        for row in rows:
            figures = []
            _scalars("", {k: v for k, v in row.items() if k not in ROW_NAME}, figures)
            label = " ".join(f"{k}={row[k]}" for k in ROW_NAME if k in row)
            lines.append(f"{path.name}: {label}: " + " ".join(figures))
        for side, values in sides.items():
            figures = []
            if isinstance(values, dict):
                _scalars("", values, figures)
            lines.append(f"{path.name}: {side}: " + " ".join(figures))
    return lines


def pytest_lines(work):
    """The pytest tally, the failed tests, the watched tests' outcomes."""
    lines = []
    text = work / "pytest_gpu.txt"
    if text.is_file():
        tail = [line for line in text.read_text(errors="replace").splitlines() if line.strip()]
        lines.append("pytest -m gpu: " + (tail[-1].strip("= ") if tail else "(no output)"))
    xml = work / "pytest_gpu.xml"
    if not xml.is_file():
        return lines
    try:
        cases = ET.parse(xml).getroot().iter("testcase")
    except ET.ParseError as exc:
        return lines + [f"pytest_gpu.xml: unreadable ({exc})"]
    failed, watched = [], {}
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed", "error": "error"}.get(tag, tag)
        if outcome in ("failed", "error"):
            failed.append(name)
        for pattern in WATCHED:
            if pattern in name:
                counts = watched.setdefault(pattern, {})
                counts[outcome] = counts.get(outcome, 0) + 1
    for name in failed[:20]:
        lines.append(f"  failed: {name}")
    if len(failed) > 20:
        lines.append(f"  ... and {len(failed) - 20} more failed (pytest_gpu.txt)")
    for pattern in WATCHED:
        counts = watched.get(pattern)
        said = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) if counts else "not run"
        lines.append(f"  GPU-only check {pattern}: {said}")
    return lines


def summary(work):
    work = Path(work)
    lines = ["# benchmarks/gpu_session.sh: stages (status, seconds)"]
    stages = work / "stages.txt"
    lines += stages.read_text().splitlines() if stages.is_file() else ["(no stage finished)"]
    status = work / "status.txt"
    if status.is_file():
        lines += ["", "# steps (stage step exit-status)"] + status.read_text().splitlines()
    lines += ["", "# headline figures"]
    probe = work / "probe.txt"
    if probe.is_file():
        rows = probe.read_text(errors="replace").splitlines()
        bad = [row for row in rows if not row.startswith("PASS")]
        lines.append(f"probe: {len(rows) - len(bad)} of {len(rows)} PASS")
        lines += [f"  {row}" for row in bad]
    lines += pytest_lines(work)
    for path in sorted(work.glob("*.json")):
        if path.name == "probe.json":
            continue
        try:
            lines += json_lines(path)
        except Exception as exc:   # a report of a shape not foreseen: say so, go on
            lines.append(f"{path.name}: not summarized ({type(exc).__name__}: {exc})")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: gpu_session_summary.py WORK_DIR", file=sys.stderr)
        sys.exit(2)
    sys.stdout.write(summary(sys.argv[1]))
