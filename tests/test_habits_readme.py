"""Issue 36 "Everyday habits", items 6 and 9.

- 9: ``bench``'s human output says what its communication figure is (the
  comm ops' post-to-completion times summed over the ops, which overlap each
  other and compute) and how much of it the iteration's wall clock saw with
  no compute running (``comm_in_flight_ms_per_iter``,
  ``comm_exposed_ms_per_iter``, ``comm_ops_per_iter`` in ``bench --json``).
- 6: the README is a short first screen (set-up, quick start, pointers to
  docs/); the reference material lives in docs/, every relative link of the
  README and docs/*.md resolves, and the set-up extras cover ``plot``.
"""
import configparser
import json
import os
import re

import pytest

from .conftest import REPO, run_mpi_cli, write_config_file


def _tiny_config(directory):
    cfg = {"name": "tiny",
           "data": {"train": {"source": "synthetic", "shape": [1, 8, 8], "classes": 4,
                              "batch_size": 8}},
           "net": [{"type": "conv", "name": "conv1", "bottom": "data", "num_output": 4,
                    "kernel": 3},
                   {"type": "relu", "name": "relu1", "bottom": "conv1", "top": "conv1"},
                   {"type": "fc", "name": "fc1", "bottom": "conv1", "num_output": 16},
                   {"type": "fc", "name": "fc2", "bottom": "fc1", "num_output": 4},
                   {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"]}],
           "solver": {"max_iter": 10, "display": 0, "test_interval": 0},
           "checkpoint": {"interval": 0}}
    return write_config_file(directory, cfg, "tiny.yaml")


# ------------------------------------------------------------- item 9
def test_case9_comm_timeline_arithmetic():
    """Case 9: the figures behind the explanation, on a hand-made trace. Two
    comm ops overlap each other (0-40 and 20-60 µs: 80 summed, 60 in
    flight); compute runs 10-30 and 50-100 (an update), so 30 µs of the
    60 are covered and 30 exposed; the io event (data) covers nothing."""
    from purine_mpi.tools.bench import comm_overlap, comm_timeline

    def ev(cat, ts, dur):
        return {"cat": cat, "ts": float(ts), "dur": float(dur)}
    events = [ev("comm", 0, 40), ev("comm", 20, 40), ev("compute", 10, 20),
              ev("update", 50, 50), ev("io", 30, 20)]
    in_flight, covered, ops = comm_timeline(events)
    assert (in_flight, covered, ops) == (60.0, 30.0, 2)
    assert comm_overlap(events) == pytest.approx(0.5)
    assert comm_timeline([ev("compute", 0, 5)]) == (0, 0.0, 0)


@pytest.mark.mpi
def test_case9_bench_json_comm_figures_add_up(tmp_path):
    """Case 9: ``bench --json`` on 2 ranks gives the comm ops per iteration
    (one allreduce per gradient bucket: as many as post_latency_ms names),
    their wall time in flight (at most their summed time) and the exposed
    part, which is the in-flight time not covered by compute."""
    res = run_mpi_cli(2, "bench", _tiny_config(tmp_path), "--iters", 5, "--warmup", 2,
                      "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    ops, summed = out["comm_ops_per_iter"], out["comm_ms_per_iter"]
    in_flight, exposed = out["comm_in_flight_ms_per_iter"], out["comm_exposed_ms_per_iter"]
    assert ops == len(out["post_latency_ms"]) >= 1, out
    assert 0 < in_flight <= summed + 0.002, out
    assert 0 <= exposed <= in_flight + 0.001, out
    assert exposed == pytest.approx(in_flight * (1 - out["comm_overlap"]), abs=0.002), out


@pytest.mark.mpi
def test_case9_bench_human_output_explains_communication(tmp_path):
    """Case 9: the human output of a 2-rank bench says the communication
    figure is summed over N comm ops from post to completion, that they
    overlap each other and compute, and gives the in-flight and exposed
    wall time; the figures agree with each other (exposed = in flight x
    (1 - the share with compute), to the printed rounding)."""
    res = run_mpi_cli(2, "bench", _tiny_config(tmp_path), "--iters", 5, "--warmup", 2)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    m = re.search(r"^  communication  ([\d.,]+) ms per iteration summed over (\d+) comm ops, "
                  r"each from its post to its completion \(they overlap each other and "
                  r"compute\)\n {17}in flight ([\d.,]+) ms of the iteration's wall time \(at "
                  r"least one comm op posted and not completed\), (\d+)% of it with compute "
                  r"running\n {17}exposed ([\d.,]+) ms: a comm op in flight and no compute op "
                  r"running \(rank 0\)$", text, re.M)
    assert m, text
    summed, ops, in_flight, pct, exposed = (float(g.replace(",", "")) for g in m.groups())
    latency = re.search(r"^  post latency   [\d.]+ ms worst over (\d+) comm ops$", text, re.M)
    assert latency and int(latency.group(1)) == ops, text
    assert 0 < in_flight <= summed + 0.01, text
    assert 0 <= exposed <= in_flight + 0.01, text
    # pct is rounded to 1 %, the ms figures to 0.01 ms
    assert abs(exposed - in_flight * (1 - pct / 100)) <= in_flight * 0.005 + 0.01, text


# ------------------------------------------------------------- item 6
README = os.path.join(REPO, "README.md")
DOCS = os.path.join(REPO, "docs")
SETUP_MAIN = ("python3 -m venv .venv && . .venv/bin/activate && pip install -e "
              "'.[mpi,examples,plot]' && python -m purine_mpi data digits --out data/digits.h5 "
              "&& python -m purine_mpi train jobs/digits_lenet.yaml")
SETUP_TESTS = ("python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && "
               "python -m pytest -q -n 2")


def _readme():
    with open(README, encoding="utf-8") as f:
        return f.read()


def _code_lines(text):
    """The lines of the indented code blocks of a markdown text, stripped; a
    command continued over lines with a trailing backslash is one line."""
    lines, held = [], ""
    for line in text.splitlines():
        if not line.startswith("    "):
            continue
        line = held + line.strip()
        if line.endswith("\\"):
            held = line[:-1]
            continue
        lines.append(line)
        held = ""
    return lines


def test_case6_readme_first_screen_sets_up_and_starts():
    """Case 6: the README is short (under 250 lines), and its first 40 lines
    hold the two set-up commands (the main job's with the `plot` extra, the
    tests' as CI runs them), a quick start (train, watch, test, plot,
    resume, mpiexec -n 2) and links into docs/."""
    text = _readme()
    assert len(text.splitlines()) < 250
    screen = "\n".join(text.splitlines()[:40])
    code = _code_lines(screen)
    assert SETUP_MAIN in code and SETUP_TESTS in code
    quick = [c for c in code if c not in (SETUP_MAIN, SETUP_TESTS)]
    commands = [c.split("#")[0].split() for c in quick]
    assert any(c[:4] == ["python", "-m", "purine_mpi", "train"] and "--resume" not in c
               for c in commands), quick
    assert any(c[:2] == ["tail", "-f"] and c[-1].endswith("train.log") for c in commands), quick
    assert any(c[:4] == ["python", "-m", "purine_mpi", "test"] and "--weights" in c
               for c in commands), quick
    assert any(c[:4] == ["python", "-m", "purine_mpi", "plot"] for c in commands), quick
    assert any(c[:4] == ["python", "-m", "purine_mpi", "train"] and "--resume" in c
               for c in commands), quick
    assert any(c[:3] == ["mpiexec", "-n", "2"] and "train" in c for c in commands), quick
    assert len(set(re.findall(r"\]\(docs/[a-z]+\.md\)", screen))) >= 4, screen


def test_case6_setup_extras_cover_the_quick_start():
    """Case 6: the extras of the main job's set-up command are extras of
    setup.cfg and bring what its next commands import: scikit-learn for
    `data digits` (examples), MPICH's mpiexec (mpi) and matplotlib for
    `plot` (plot). The README's test command is the one .ci/run runs."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "setup.cfg"))
    extras = cfg["options.extras_require"]
    (main,) = [c for c in _code_lines(_readme()) if "digits_lenet" in c and "pip install" in c]
    named = re.search(r"pip install -e '\.\[([a-z,]+)\]'", main).group(1).split(",")
    brought = {name: extras[name].split() for name in named}
    assert any(r.startswith("matplotlib") for r in brought.get("plot", [])), named
    assert "scikit-learn" in brought.get("examples", []), named
    assert "mpich" in brought.get("mpi", []), named
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    assert re.search(r"^python -m pip install -q -e '\.\[test\]'$", ci, re.M)
    assert re.search(r"^python -m pytest -q -n 2$", ci, re.M)
    assert SETUP_TESTS in _code_lines(_readme())


# where today's reference sections of the README live
MOVED = {
    "running.md": ["Run folders", "Habits from Caffe and Lightning", "Threads per rank",
                   "What the log says", "Memory", "Curves", "The config file"],
    "environment.md": ["Environment variables"],
    "parallel.md": ["Parallel schemes (`parallel:` in the config)"],
    "scaling.md": ["Scaling prediction: how many nodes to ask for"],
    "cluster.md": ["Using your cluster's MPI", "Preemption and requeue under SLURM",
                   "Resuming on another number of ranks"],
    "failures.md": ["Stops, failures and exit statuses"],
    "gpu.md": ["GPU"],
    "performance.md": ["Performance: benchmarks and measurements"],
    "caffe.md": ["Nets and solvers", "Weights"],
    "onnx.md": ["ONNX export"],
    "solvers.md": ["Solvers and gradient clipping"],
    "data.md": ["Data transforms", "HDF5 data files and data larger than memory",
                "Caffe LMDB data"],
}


def test_case6_reference_material_lives_in_docs():
    """Case 6: each reference section is a heading of its docs page, which
    the README links; the README keeps none of them; the performance page
    names no commit hashes."""
    text = _readme()
    headings = set(re.findall(r"^#+ (.+)$", text, re.M))
    for page, sections in MOVED.items():
        with open(os.path.join(DOCS, page), encoding="utf-8") as f:
            doc = f.read()
        doc_headings = set(re.findall(r"^#+ (.+)$", doc, re.M))
        for section in sections:
            assert section in doc_headings, (page, section)
            assert section not in headings, section
        assert f"](docs/{page})" in text, page
    with open(os.path.join(DOCS, "performance.md"), encoding="utf-8") as f:
        perf = f.read()
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", perf)
              if re.search(r"[a-f]", w) and re.search(r"\d", w)]
    assert hashes == []


def test_case6_every_relative_link_resolves():
    """Case 6: every relative link of the README and of every docs/*.md page
    names a file of the repository (and a heading of it, for an anchor)."""
    from .test_docs import _anchors
    docs = [README] + sorted(os.path.join(DOCS, n) for n in os.listdir(DOCS)
                             if n.endswith(".md"))
    bad, seen = [], 0
    for path in docs:
        with open(path, encoding="utf-8") as f:
            text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", link):
                continue
            seen += 1
            target, _, anchor = link.partition("#")
            target_path = os.path.normpath(os.path.join(os.path.dirname(path), target)) \
                if target else path
            if not target_path.startswith(REPO + os.sep) or not os.path.exists(target_path):
                bad.append((path, link))
            elif anchor and anchor not in _anchors(target_path):
                bad.append((path, link))
    assert seen and bad == []


# ------------------------------------------------- issue 46 §2, items 1 and 8
def _section(text, heading):
    start = text.index(f"## {heading}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_issue46_readme_top_reads_in_five_minutes():
    """Item 8: the set-up commands are lines a reader can take in (each
    line at most 100 characters; command 1 may continue over lines with a
    backslash and is still one command), and no paragraph of prose runs
    over 8 lines (details live in docs/, a line and a link stay)."""
    text = _readme()
    setup = _section(text, "Set-up")
    raw = [line for line in setup.splitlines() if line.startswith("    ")]
    assert raw and max(len(line) for line in raw) <= 100, max(raw, key=len)
    paragraphs, run = [], []
    for line in text.splitlines() + [""]:
        prose = line.strip() and not line.startswith(("    ", "#", "|", "- ", "  "))
        if prose:
            run.append(line)
        elif run:
            paragraphs.append(run)
            run = []
    longest = max(paragraphs, key=len)
    assert len(longest) <= 8, "\n".join(longest)


def test_issue46_readme_says_what_the_full_suite_starts():
    """Item 1: the README says which services the full test suite starts
    (SLURM's daemons, network namespaces) and gives the quick local run its
    own line."""
    setup = _section(_readme(), "Set-up")
    prose = " ".join(line for line in setup.splitlines() if not line.startswith("    "))
    assert "slurmctld" in prose and "slurmd" in prose and "network namespaces" in prose
    assert 'python -m pytest -q -n 2 -m "not slow"' in [c.split("#")[0].strip()
                                                   for c in _code_lines(setup)]
