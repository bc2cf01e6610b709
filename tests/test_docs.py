"""The reference docs stay true: docs/config.md is what the generator makes
from the code (and a stale or hand-edited copy is caught); a key or choice
added without a meaning fails; the examples in it load; the tables of
docs/formats.md name exactly what a run writes; links between the docs
resolve; nothing points outside the repository; every CLI option has help
text, and --version works."""
import argparse
import json
import os
import re
import subprocess

import h5py
import pytest
import yaml

import purine_mpi
from purine_mpi.tools import docgen, docgen_examples
from purine_mpi.cli import build_parser
from purine_mpi.job import config as config_mod
from purine_mpi.job import schema as schema_mod
from purine_mpi.job.config import resolve_config
from purine_mpi.job.replica import build_train_graph

from .conftest import (PYTHON, REPO, cli_env, make_job, run_cli_args, run_cli_here,
                       write_config_file)

CONFIG_MD = os.path.join(REPO, "docs", "config.md")
FORMATS_MD = os.path.join(REPO, "docs", "formats.md")


# ------------------------------------------------------- docs/config.md
def test_config_md_is_up_to_date():
    diff = docgen.check(CONFIG_MD)
    assert diff is None, f"docs/config.md is stale: run python -m purine_mpi.tools.docgen --write\n{diff}"


def test_stale_config_md_fails_the_check(tmp_path):
    """The check fails for a modified copy -- a hand edit, or a key added to
    the code but not regenerated -- and passes for a faithful one, both in
    process and through ``python -m purine_mpi.tools.docgen --check``."""
    with open(CONFIG_MD, encoding="utf-8") as f:
        text = f.read()
    good = tmp_path / "good.md"
    good.write_text(text, encoding="utf-8")
    edited = tmp_path / "edited.md"
    edited.write_text(text.replace("| `keep` |", "| `kept` |"), encoding="utf-8")
    missing = tmp_path / "missing.md"
    missing.write_text(text.replace("#### lrn", "#### lrn (gone)"), encoding="utf-8")
    assert docgen.check(str(good)) is None
    assert "kept" in docgen.check(str(edited))
    assert docgen.check(str(missing)) is not None
    assert "does not exist" in docgen.check(str(tmp_path / "absent.md"))

    def run(path):
        return subprocess.run([PYTHON, "-m", "purine_mpi.tools.docgen", "--check", "--path", str(path)],
                              cwd=REPO, env=cli_env(), capture_output=True, text=True,
                              timeout=60)
    assert run(good).returncode == 0
    res = run(edited)
    assert res.returncode == 1 and "stale" in res.stderr and "docgen --write" in res.stderr


def test_a_new_key_is_picked_up_and_needs_a_meaning(monkeypatch):
    """A key declared in a section's table (as `cuda_graph` will be) shows in
    the generated docs with its type and default; without a meaning in
    its declaration the generator refuses."""
    from purine_mpi.job import schema
    from purine_mpi.job.checks import _bool
    from purine_mpi.job.keys import ConfigKey

    def declare(meaning):  # the one place a key is added: its section's table
        monkeypatch.setitem(schema.SECTION_KEYS, "parallel",
                            schema.PARALLEL + (ConfigKey("cuda_graph", _bool, False, meaning),))
    declare("")
    with pytest.raises(docgen.SchemaDocError, match="cuda_graph"):
        docgen.render()
    declare("capture a CUDA graph")
    assert "| `cuda_graph` | true/false | `false` | capture a CUDA graph |" in docgen.render()


def test_a_new_choice_needs_a_meaning(monkeypatch):
    """A value added to a choice list (a new scheme, solver type or lr
    policy) must be documented in CHOICE_DOCS, and then shows."""
    assert "zigzag" not in schema_mod.PARALLEL_SCHEMES
    monkeypatch.setitem(schema_mod.CHOICES, "scheme", schema_mod.PARALLEL_SCHEMES + ("zigzag",))
    with pytest.raises(docgen.SchemaDocError, match="zigzag"):
        docgen.render()
    monkeypatch.setitem(schema_mod.CHOICE_DOCS, "scheme",
                        dict(schema_mod.CHOICE_DOCS["scheme"], zigzag="stages in a zigzag"))
    assert "| `zigzag` | stages in a zigzag |" in docgen.render()


def test_every_schema_entry_is_in_the_docs():
    from purine_mpi.layers import LAYER_SPECS
    with open(CONFIG_MD, encoding="utf-8") as f:
        text = f.read()
    for key in schema_mod.TOP_KEYS + schema_mod.DATA_KEYS:
        assert f"| `{key}` |" in text, key
    for section, (defaults, _) in config_mod.SECTIONS.items():
        assert f"## {section}" in text
        for key in defaults:
            assert f"| `{key}` |" in text, (section, key)
    for values in schema_mod.CHOICES.values():
        for value in values:
            assert f"| `{value}` |" in text, value
    for ltype, spec in LAYER_SPECS.items():
        assert f"#### {ltype}\n" in text
        for key in spec.all_keys():
            assert f"| `{key.name}` |" in text


def test_config_md_examples_load_and_build():
    """The examples the generator writes are configs that validate and
    build (with synthetic data in place of the digits file)."""
    example = yaml.safe_load(docgen_examples.EXAMPLE)
    resolve_config(example, path="example.yaml", check_files=False)
    example["data"] = {"train": {"source": "synthetic", "shape": [1, 8, 8], "classes": 10,
                                 "batch_size": 4}}
    build_train_graph(make_job(example))
    residual = yaml.safe_load(docgen_examples.RESIDUAL_EXAMPLE)
    residual["data"] = {"train": {"source": "synthetic", "shape": [3, 8, 8], "classes": 10,
                                  "batch_size": 4}}
    residual["net"] += [{"type": "fc", "name": "fc", "bottom": "sum", "num_output": 10},
                        {"type": "softmax_loss", "name": "loss", "bottom": ["fc", "label"]}]
    build_train_graph(make_job(residual))


def test_custom_layer_example_registers_and_checks_its_keys():
    from purine_mpi import layers
    namespace = {}
    saved = dict(layers.LAYERS), dict(layers.LAYER_SPECS)
    try:
        exec(compile(docgen_examples.CUSTOM_LAYER_EXAMPLE, "config.md", "exec"), namespace)
        cfg = {"data": {"train": {"source": "synthetic", "shape": [2, 4, 4], "classes": 2,
                                  "batch_size": 3}},
               "net": [{"type": "scaled_relu", "name": "s", "bottom": "data", "scale": 2.0},
                       {"type": "fc", "name": "fc", "bottom": "s", "num_output": 2},
                       {"type": "softmax_loss", "name": "loss", "bottom": ["fc", "label"]}]}
        graph, _ = build_train_graph(make_job(cfg))
        assert graph.ops["s.fwd"].op_type == "Scale" and graph.ops["s.fwd"].attrs["scale"] == 2.0
        cfg["net"][0]["scal"] = 1.0
        with pytest.raises(Exception, match="did you mean 'scale'"):
            resolve_config(cfg)
    finally:
        layers.LAYERS.clear(), layers.LAYERS.update(saved[0])
        layers.LAYER_SPECS.clear(), layers.LAYER_SPECS.update(saved[1])


# ------------------------------------------------------ docs/formats.md
def _section(text, heading):
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def _tables(section):
    """Each markdown table of a section as a list of first-column names
    (every `code` span of the first cell)."""
    tables, current = [], None
    for line in section.splitlines():
        if line.startswith("|"):
            if current is None:
                current = []
                tables.append(current)
                continue  # the header row
            first = line.split("|")[1]
            if set(first.strip()) <= set("- "):
                continue  # the separator row
            current += re.findall(r"`([^`]+)`", first) or [first.strip()]
        else:
            current = None
    return tables


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A short profiled run of a tiny synthetic net and a bench of it."""
    d = tmp_path_factory.mktemp("formats")
    cfg = {"name": "tiny",
           "data": {"train": {"source": "synthetic", "shape": [1, 6, 6], "classes": 3,
                              "batch_size": 4},
                    "test": {"source": "synthetic", "shape": [1, 6, 6], "classes": 3,
                             "batch_size": 4, "num_samples": 8}},
           "net": [{"type": "conv", "name": "conv1", "bottom": "data", "num_output": 2,
                    "kernel": 3},
                   {"type": "dropout", "name": "drop", "bottom": "conv1"},
                   {"type": "fc", "name": "fc", "bottom": "drop", "num_output": 3},
                   {"type": "softmax_loss", "name": "loss", "bottom": ["fc", "label"]},
                   {"type": "accuracy", "name": "accuracy", "bottom": ["fc", "label"],
                    "phase": "test"}],
           "solver": {"max_iter": 4, "display": 2, "test_interval": 2},
           "checkpoint": {"interval": 2}}
    path = write_config_file(d, cfg, "tiny.yaml")
    out = d / "run"
    res = run_cli_args("train", path, "--out", out, "--profile")
    assert res.returncode == 0, res.stderr
    bench = run_cli_args("bench", path, "--iters", "2", "--warmup", "1", "--json")
    assert bench.returncode == 0, bench.stderr
    plan = run_cli_here("plan", path, "--np", "2", "--resume", "--host-memory", "64GiB",
                        "--node-memory", "128GiB", "--json")
    assert plan.returncode == 0, plan.stderr
    inspect = run_cli_here("inspect", out / "latest.h5", "--diff", out / "ckpt_2.h5", "--json")
    assert inspect.returncode == 0, inspect.stderr
    return {"out": out, "bench": json.loads(bench.stdout.strip().splitlines()[-1]),
            "plan": json.loads(plan.stdout), "inspect": json.loads(inspect.stdout)}


@pytest.fixture(scope="module")
def formats_text():
    with open(FORMATS_MD, encoding="utf-8") as f:
        return f.read()


def test_formats_checkpoint_attributes(tiny_run, formats_text):
    (attrs,) = [t for t in _tables(_section(formats_text, "Checkpoints")) if "format" in t]
    with h5py.File(tiny_run["out"] / "latest.h5", "r") as f:
        assert set(f.attrs) == set(attrs)
        assert set(f) == {"params", "solver", "state"}
        assert "sha256" in f["state"].attrs and f["params/conv1/weight"].fletcher32
        assert f["state/ranks"].attrs["purine_kind"] == "json"
        state = json.loads(f["state/ranks"].asstr()[()])
        layout = json.loads(f["state/layout"].asstr()[()])
    assert set(state["0"]["data"]["state"]) == {"position", "global_batch", "seed"}
    (listed,) = re.findall(r"`/state/layout` \(JSON: (.*?)\):\n", formats_text, flags=re.S)
    assert set(layout) == set(re.findall(r"`(\w+)`", listed))
    assert "drop.fwd" not in state["0"]  # Philox dropout keeps no random state
    files = set(os.listdir(tiny_run["out"]))
    assert {".purine.lock", "config.yaml", "metrics.jsonl", "ckpt_2.h5", "ckpt_4.h5",
            "latest.h5", "trace.rank0.json"} <= files
    (documented,) = [t for t in _tables(_section(formats_text, "Run folders"))
                     if ".purine.lock" in t]
    patterns = [re.escape(n).replace(re.escape("<iter>"), r"\d+").replace(
        re.escape("<R>"), r"\d+").replace(re.escape("<pid>"), r"\d+").replace(r"\*", ".*")
        for n in documented]
    for name in files:
        assert any(re.fullmatch(p, name) for p in patterns), name


def test_formats_metrics_rows(tiny_run, formats_text):
    train_fields, test_fields = _tables(_section(formats_text, "metrics.jsonl"))
    with open(tiny_run["out"] / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    kinds = {row["phase"] for row in rows}
    assert kinds == {"train", "test"}
    for row in rows:
        assert set(row) == set(train_fields if row["phase"] == "train" else test_fields), row


def test_formats_trace_events(tiny_run, formats_text):
    section = _section(formats_text, "Traces")
    (fields,) = [t for t in _tables(section) if "cat" in t]
    with open(tiny_run["out"] / "trace.rank0.json") as f:
        trace = json.load(f)
    assert set(trace) == {"displayTimeUnit", "traceEvents"}
    ops = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    meta = {e["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert ops and meta == {"process_name", "process_sort_index", "thread_name"}
    for name in meta:
        assert f"`{name}`" in section
    documented = set(fields)
    for e in ops:
        assert set(e) - {"args"} <= documented, e
        assert {f"args.{k}" for k in e["args"]} <= documented, e
        assert f"`{e['cat']}`" in section


def test_formats_bench_keys(tiny_run, formats_text):
    (keys,) = _tables(_section(formats_text, "bench --json"))
    assert set(tiny_run["bench"]) == set(keys)


def _bullets(section):
    """{first `name` of a top-level bullet: its text} of a section's lists."""
    return {m.group(1): m.group(2) for m in
            re.finditer(r"^- `([^`]+)`(.*?)(?=^- |^\S|\Z)", section, flags=re.M | re.S)}


def _names(text):
    """The key-like `code` spans of a text (not options, values or paths)."""
    return set(re.findall(r"`([a-z_]+)`", text))


def test_formats_plan_json_keys(tiny_run, formats_text):
    """Every key `plan --json` writes is named in formats.md, at its level,
    and every row the `host` item names is one it writes."""
    section = _section(formats_text, "plan --json")
    head, _, _ = section.partition("\n- ")
    plan = tiny_run["plan"]
    assert set(plan) <= _names(head)
    items = _bullets(section)
    (entry,) = plan["ranks"]
    documented = set(items) | {k for name in items for k in re.findall(r"`(\w+)`", name)}
    documented |= _names(items["rank"]) | {"devices"} & _names(items["host"])
    assert set(entry) <= documented, set(entry) - documented
    host = _names(items["host"]) - {"devices"}
    assert set(entry["host"]) == host
    assert set(entry["model_state"]) == _names(items["model_state"])
    assert set(entry["peak"]) <= set(re.findall(r'"(\w+)"', items["peak"]))
    (fits,) = entry["fits"].values()
    assert set(fits) <= _names(items["fits"])
    nodes = section[section.index("`nodes`: "):]
    nodes = nodes[:nodes.index("\n\n")]
    assert plan["nodes"] and all(set(n) <= _names(nodes) for n in plan["nodes"])


def test_formats_inspect_json_keys(tiny_run, formats_text):
    section = _section(formats_text, "Other machine-readable output")
    (text,) = [b for b in re.split(r"\n- ", section) if b.startswith("`inspect FILE --json`")]
    documented = set(re.findall(r'"(\w+)"', text))
    out = tiny_run["inspect"]
    written = set(out) | set(out["diff"])
    for entry in out["datasets"] + out["diff"]["datasets"]:  # the /state text ones too
        written |= set(entry)
    assert written == documented, (written - documented, documented - written)


def test_formats_memory_json_keys(tiny_run, formats_text):
    (row,) = [line for line in _section(formats_text, "Run folders").splitlines()
              if line.startswith("| `memory.json` |")]
    with open(tiny_run["out"] / "memory.json") as f:
        memory = json.load(f)
    (rank,) = memory["ranks"]
    documented = set(re.findall(r'"(\w+)"', row))
    assert set(memory) | set(rank) | set(rank["model_state"]) <= documented, \
        (set(memory) | set(rank) | set(rank["model_state"])) - documented


def test_formats_exit_statuses_match_the_cli_help(formats_text):
    (codes,) = _tables(_section(formats_text, "Exit statuses"))
    import purine_mpi.cli as cli
    epilog = cli.build_parser().epilog
    for code in codes:
        assert re.search(rf"\b{code}\b", epilog), code


# ------------------------------------------------------------------ links
def _slug(heading):
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path):
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("doc", ["README.md", "docs/config.md", "docs/formats.md"])
def test_links_resolve(doc):
    path = os.path.join(REPO, doc)
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        target_path = os.path.normpath(os.path.join(os.path.dirname(path), target)) \
            if target else path
        assert os.path.exists(target_path), (doc, link)
        if anchor:
            assert anchor in _anchors(target_path), (doc, link)


def test_readme_links_both_docs_and_names_the_console_script():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert "](docs/config.md)" in text and "](docs/formats.md)" in text
    assert "purine-mpi" in text


def test_nothing_points_outside_the_repository():
    needles = ["../" + "shared", "DESIGN" + ".md", "DESIGN" + " §", "DESIGN" + " section"]
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for name in files:
        path = os.path.join(REPO, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            continue
        # the repository's own developer guide, docs/DESIGN.md, may be named
        text = text.replace("docs/" + "DESIGN" + ".md", "")
        hits += [f"{name}: {n}" for n in needles if n in text]
    assert hits == []


# -------------------------------------------------------------------- CLI
def _walk(parser, where="purine_mpi"):
    for action in parser._actions:
        yield where, action
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{where} {name}")


def test_every_cli_option_has_help():
    missing = [f"{where}: {action.option_strings or action.dest}"
               for where, action in _walk(build_parser())
               if not action.help or action.help == argparse.SUPPRESS]
    assert missing == []
    configs = [(where, action.help) for where, action in _walk(build_parser())
               if action.dest == "config"]
    assert configs and all("docs/config.md" in h for _, h in configs), configs


DOCS = ["README.md"] + sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(REPO, "docs"))
                              if n.endswith(".md"))
_FLAG = r"(?<![\w-])--[a-z][a-z0-9-]*"


def _commands(parser):
    """{command: the option strings of its parser}."""
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: {o for a in p._actions for o in a.option_strings}
            for name, p in sub.choices.items()}


def _doc_texts():
    texts = {}
    for doc in DOCS:
        with open(os.path.join(REPO, doc), encoding="utf-8") as f:
            texts[doc] = f.read()
    return texts


def _flags_not_on_their_command(texts, commands):
    """Each `--flag` written after a command (``purine_mpi CMD ...`` or
    ```CMD ...``` in a code span, up to a comment, pipe or cell end) that
    the command does not take."""
    names = "|".join(map(re.escape, commands))
    given = re.compile(rf"(?:purine_mpi|purine-mpi|`)\s*({names})\b([^`\n|#;&]*)")
    bad = []
    for doc, text in texts.items():
        for m in given.finditer(text.replace("\\\n", " ")):
            bad += [f"{doc}: {m.group(1)} {flag}" for flag in re.findall(_FLAG, m.group(2))
                    if flag not in commands[m.group(1)]]
    return bad


def _flags_not_documented(texts, commands):
    """Each (command, option) of the parser that no paragraph of the docs
    names together with the command."""
    paragraphs = [p for text in texts.values() for p in re.split(r"\n\s*\n", text)]
    missing = []
    for name, flags in commands.items():
        with_name = [p for p in paragraphs if re.search(rf"\b{re.escape(name)}\b", p)]
        missing += [f"{name} {flag}" for flag in sorted(flags) if flag not in ("-h", "--help") and not any(
            re.search(rf"(?<![\w-]){flag}(?![\w-])", p) for p in with_name)]
    return missing


JOB_FILES = sorted(os.path.join("jobs", n) for n in os.listdir(os.path.join(REPO, "jobs")))


def _usage_texts():
    """The docs and the job files, whose header comments give commands too."""
    texts = _doc_texts()
    for name in JOB_FILES:
        with open(os.path.join(REPO, name), encoding="utf-8") as f:
            texts[name] = f.read()
    return texts


def _commands_not_in_the_parser(texts, commands):
    """Each `python -m purine_mpi WORD` / `purine-mpi WORD` whose WORD is no
    command (a renamed or removed one)."""
    return [f"{doc}: {m.group(1)}" for doc, text in texts.items()
            for m in re.finditer(r"(?:python -m purine_mpi|purine-mpi)[ \t]+([a-z][\w-]*)", text)
            if m.group(1) not in commands]


def test_every_command_the_docs_run_is_one_the_parser_has():
    """Every `python -m purine_mpi CMD` in README.md, docs/*.md and the job
    files' headers names a command (a planted one is caught), and the
    README's command lists name every command the parser has."""
    commands, texts = _commands(build_parser()), _usage_texts()
    assert _commands_not_in_the_parser(texts, commands) == []
    planted = {"x.md": "    python -m purine_mpi evaluate JOB.yaml\n    purine-mpi train J\n"}
    assert _commands_not_in_the_parser(planted, commands) == ["x.md: evaluate"]
    named = set(re.findall(r"^ +(?:mpiexec -n \d+ )?python -m purine_mpi ([a-z]+)",
                           texts["README.md"], flags=re.M))
    assert named == set(commands), set(commands) ^ named


def _files_not_in_the_repository(texts):
    """Each path under benchmarks/, jobs/, tests/, cuda/, .ci/ or purine_mpi/
    a text names that does not exist. Paths with a placeholder (`<...>`,
    `*`, `NAME`) are patterns, and those in a quoted `error: ...` line
    examples, not files."""
    missing = []
    for doc, text in texts.items():
        for m in re.finditer(r"(?<![\w./-])((?:benchmarks|jobs|tests|cuda|\.ci|purine_mpi)/"
                             r"[\w./-]*\w)", text):
            path = m.group(1)
            line = text[text.rfind("\n", 0, m.start()) + 1:m.start()]
            if (re.search(r"[<*]|/[A-Z]+\b", text[m.start():m.end() + 1])
                    or path.endswith("/__init__") or "error: " in line):
                continue
            if not os.path.exists(os.path.join(REPO, path)):
                missing.append(f"{doc}: {path}")
    return missing


def test_every_repository_file_the_docs_name_exists():
    """The scripts, jobs, tests and sources README.md, docs/*.md and the job
    files name (benchmarks/x.py, jobs/x.yaml, tests/test_x.py, ...) exist:
    a renamed or removed file fails, as a planted one does."""
    assert _files_not_in_the_repository(_usage_texts()) == []
    planted = {"x.md": "run `python benchmarks/gone.py` on jobs/digits_lenet.yaml, "
                       "runs/<name>/ckpt_<iter>.h5, benchmarks/NAME.py; error: jobs/x.yaml\n"}
    assert _files_not_in_the_repository(planted) == ["x.md: benchmarks/gone.py"]


def _benchmark_flags_not_taken(texts):
    """Each `--flag` written after benchmarks/NAME.py (up to a code span's
    end, a comment, a pipe or a blank line) that the script does not
    declare as an option string ("--flag" in its source)."""
    bad = []
    for doc, text in texts.items():
        for m in re.finditer(r"benchmarks/(\w+\.(?:py|sh))((?:[^`\n|#;&)]|\n(?!\n))*)",
                             text.replace("\\\n", " ")):
            path = os.path.join(REPO, "benchmarks", m.group(1))
            if not os.path.exists(path):
                continue  # test_every_repository_file_the_docs_name_exists says so
            with open(path, encoding="utf-8") as f:
                source = f.read()
            bad += [f"{doc}: {m.group(1)} {flag}" for flag in re.findall(_FLAG, m.group(2))
                    if f'"{flag}"' not in source and f"'{flag}'" not in source]
    return bad


def test_every_flag_the_docs_give_a_benchmark_is_one_it_takes():
    """`python benchmarks/X.py --flag` in the docs and job headers names an
    option X declares (a renamed or removed one fails, as a planted one
    does)."""
    assert _benchmark_flags_not_taken(_usage_texts()) == []
    planted = {"x.md": "`python benchmarks/cpu_speed.py --config J --pairs 5 --frobnicate`\n"}
    assert _benchmark_flags_not_taken(planted) == ["x.md: cpu_speed.py --frobnicate"]


def test_the_docs_name_the_commands_rank_0_runs_alone():
    """failures.md's and formats.md's lists of the commands rank 0 alone
    runs under a launcher are the CLI's (cli.RANK0_COMMANDS, and predict
    TRACE_DIR): a command added to it, or left out of a list, fails."""
    from purine_mpi.cli import RANK0_COMMANDS
    texts = _doc_texts()
    for doc in ("docs/failures.md", "docs/formats.md"):
        (listed,) = re.findall(r"((?:`[a-z]+`,?\s+(?:and\s+)?)+)`predict TRACE_DIR --np N`\)?"
                               r"\s+run\s+on\s+rank\s+0\s+alone", texts[doc])
        assert set(re.findall(r"`([a-z]+)`", listed)) == set(RANK0_COMMANDS), doc


def test_every_flag_the_docs_give_a_command_is_one_it_takes():
    """`python -m purine_mpi CMD ... --flag` and `CMD --flag` in README.md,
    docs/*.md and the job files' headers name options CMD has (a renamed or
    removed option fails), and a planted one is caught."""
    commands, texts = _commands(build_parser()), _usage_texts()
    assert _flags_not_on_their_command(texts, commands) == []
    planted = {"x.md": "run `plan JOB.yaml --np 2 --frobnicate`; "
                       "python -m purine_mpi bench JOB.yaml --ranks-per-node 2\n"}
    assert _flags_not_on_their_command(planted, commands) == [
        "x.md: plan --frobnicate", "x.md: bench --ranks-per-node"]


def test_every_option_of_every_command_is_documented():
    """Every option of every command's --help appears in a paragraph of the
    docs that names the command; a new option without docs fails."""
    parser, texts = build_parser(), _doc_texts()
    assert _flags_not_documented(texts, _commands(parser)) == []
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    sub.choices["inspect"].add_argument("--frobnicate", action="store_true", help="x")
    assert _flags_not_documented(texts, _commands(parser)) == ["inspect --frobnicate"]


def test_version():
    res = run_cli_args("--version")
    assert res.returncode == 0
    assert res.stdout.strip() == f"purine_mpi {purine_mpi.__version__}"
