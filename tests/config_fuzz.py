"""A config fuzzer: the job files of jobs/*.yaml, each mutated at one key
(wrong types, out-of-range numbers, empty values, unknown keys at every
level, broken layer definitions, impossible shapes, parallel keys against
the rank count, missing paths), run in-process through the command line
(``graph``, ``plan --np N``) and classified against the promise of
docs/failures.md: exit 2, one line naming the file and the key, no
traceback. A value accepted (exit 0) is judged against docs/config.md's
type column (an independent reading of the generated reference, not the
checkers that made it): accepting what the reference says is not of the
key's type is a silent acceptance.

``mutations(jobs)`` lists every mutation (deterministic); ``run_case``
runs one; ``classify`` says which class its outcome is in. tests/
test_config_fuzz.py runs a seeded sample; ``python -m tests.config_fuzz``
runs them all and prints the counts per class.
"""
import copy
import functools
import math
import os
import re
import signal
import sys

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = os.path.join(REPO, "jobs")

#: the ranks plan --np is given for a job (its parallel scheme's layout)
JOB_RANKS = {"digits_hybrid": 4, "digits_pipeline": 2}

#: outcome classes
GOOD = "good"                    # exit 2, one line, names the file and the key
ACCEPTED = "accepted"            # exit 0, the value is of the documented type
NO_KEY = "exit2-no-key"          # exit 2 but no key named
WRONG_KEY = "exit2-wrong-key"    # exit 2 naming another key
NO_FILE = "exit2-no-file"        # exit 2 not naming the config file
LONG = "exit2-not-one-line"
SILENT = "exit0-silent"          # exit 0 although the docs' type refuses the value
CRASH = "crash"                  # a traceback (an exception out of main) or exit 1
HANG = "hang"
EXPANDED = "exit2-expanded-index"  # names the layer's key by its index after repeat expansion
DOWNSTREAM = "exit2-downstream"  # a shape change refused where a later layer no longer fits
BAD = (NO_KEY, WRONG_KEY, NO_FILE, LONG, SILENT, CRASH, HANG)
#: the mutations that change a shape, which a later layer may be the one to refuse
SHAPE_WHATS = ("stride-too-large", "pad-larger-than-kernel", "num-output-changed-upstream",
               "kernel-too-large", "top-overwrites-data", "zero", "neg", "frac", "delete",
               "huge", "empty-list", "list", "map", "str", "int")


# ------------------------------------------------------------ the oracle
@functools.lru_cache(maxsize=None)
def doc_types(path=os.path.join(REPO, "docs", "config.md")):
    """{section: {key: type column}} of docs/config.md's key tables; the
    sections are 'top', 'data', 'layer' (every layer's keys), 'layer:TYPE',
    and the '## section' names (solver, parallel, checkpoint, gpu,
    loss_scale)."""
    out, section = {}, None
    with open(path, encoding="utf-8") as f:
        for line in f:
            head = re.match(r"^(#+) (.*)", line)
            if head:
                title = head.group(2).strip()
                section = {"Top-level keys": "top", "Data spec keys": "data",
                           "Keys of every layer": "layer"}.get(title)
                if section is None and head.group(1) == "####":
                    section = f"layer:{title}"
                elif section is None and head.group(1) == "##":
                    section = title
                continue
            row = re.match(r"^\| `([^`]+)` \| ([^|]+) \|", line)
            if row and section:
                out.setdefault(section, {})[row.group(1)] = row.group(2).strip()
    return out


def _int(v):
    """An integer, or a float that is one (YAML reads 1e3 as a float), in int64's range."""
    return (isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float)
            and v.is_integer()) and abs(v) < 2 ** 63


def _num(v):
    return (_int(v) or isinstance(v, float)) and not isinstance(v, bool) and math.isfinite(v)


def doc_accepts(kind, value):
    """Whether a value is of the documented type ``kind`` (True/False), or
    None where the words are not read here (a filler, a mapping)."""
    kind = kind.strip()
    if kind.endswith(" or null"):
        return True if value is None else doc_accepts(kind[:-len(" or null")], value)
    simple = {
        "integer > 0": lambda v: _int(v) and v > 0,
        "integer >= 0": lambda v: _int(v) and v >= 0,
        "integer >= -1": lambda v: _int(v) and v >= -1,
        "integer in [0, 2^63)": lambda v: _int(v) and 0 <= v < 2 ** 63,
        "number > 0": lambda v: _num(v) and v > 0,
        "number >= 0": lambda v: _num(v) and v >= 0,
        "number in [0, 1)": lambda v: _num(v) and 0 <= v < 1,
        "number in [0, 1]": lambda v: _num(v) and 0 <= v <= 1,
        "number": _num, "number, finite": _num,
        "true/false": lambda v: isinstance(v, bool),
        "string": lambda v: isinstance(v, str) and v != "",
        "list of integers": lambda v: isinstance(v, list) and all(_int(x) for x in v),
        "list of numbers, each finite": lambda v: isinstance(v, list) and all(map(_num, v)),
        "list of strings": lambda v: isinstance(v, list) and bool(v) and
        all(isinstance(x, str) and x for x in v),
        "int or [h, w], each >= 1": lambda v: (_int(v) and v >= 1) or (
            isinstance(v, list) and len(v) == 2 and all(_int(x) and x >= 1 for x in v)),
        "int or [h, w], each >= 0": lambda v: (_int(v) and v >= 0) or (
            isinstance(v, list) and len(v) == 2 and all(_int(x) and x >= 0 for x in v)),
        "mapping": lambda v: isinstance(v, dict),
        "list": lambda v: isinstance(v, list),
        "auto, true or false": lambda v: v == "auto" or isinstance(v, bool),
        "blob name or list": lambda v: (isinstance(v, str) and v != "") or (
            isinstance(v, list) and bool(v) and all(isinstance(x, str) and x for x in v)),
        "number or list": lambda v: _num(v) or (isinstance(v, list) and all(map(_num, v))),
        "list of {lr_mult, decay_mult}": lambda v: isinstance(v, list) and all(
            isinstance(x, dict) for x in v),
        "integer, an axis of the bottom": _int, "integer, an axis of the bottom but 0": _int,
        "integer, an axis of the scores": _int,
    }
    if kind in simple:
        return bool(simple[kind](value))
    if kind.startswith("one of "):
        return value in [c.strip() for c in kind[len("one of "):].split(",")]
    if kind.startswith("list of integers, each >= "):
        low = int(kind.rsplit(" ", 1)[1])
        return isinstance(value, list) and all(_int(x) and x >= low for x in value)
    return None


def documented_type(types, path, raw):
    """The docs' type of the key at ``path`` (a tuple) of the job ``raw``, or None."""
    if len(path) == 1:
        return types["top"].get(path[0])
    head = path[0]
    if head == "data" and len(path) == 3:
        return types["data"].get(path[2])
    if head == "net" and len(path) == 3 and isinstance(path[1], int):
        layer = raw["net"][path[1]]
        if isinstance(layer, dict) and "type" in layer:
            own = types.get(f"layer:{layer['type']}", {})
            return own.get(path[2]) or types["layer"].get(path[2])
        return None
    if len(path) == 2 and head in types:
        return types[head].get(path[1])
    return None


# ------------------------------------------------------------ mutations
class Mutation:
    """One mutated job: ``text`` (YAML), the dotted ``key`` it changes, what
    (``what``), the ``ranks`` of plan --np, and the value (``value``, or
    ``MISSING`` where the key is deleted or the mutation is structural)."""

    def __init__(self, job, key, what, config, ranks=1, value=None, path=None, expect=None):
        value = MISSING if value is None and what != "null" else value
        self.job, self.key, self.what, self.ranks = job, key, what, ranks
        self.value, self.path, self.expect = value, path, expect
        self.config = config

    @property
    def name(self):
        return f"{self.job}:{self.key}:{self.what}"

    def text(self):
        return yaml.dump(self.config, Dumper=_Dumper, sort_keys=False, allow_unicode=True)


class _Dumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):
    """Quotes a string that reads as a number (PyYAML writes '1e-08' bare,
    which the config reader, as YAML 1.2 does, reads as a float)."""


_Dumper.add_representer(str, lambda dumper, s: dumper.represent_scalar(
    "tag:yaml.org,2002:str", s, style="'" if re.fullmatch(
        r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", s) else None))


MISSING = object()
#: the sections whose null is read as {} (YAML's `solver:` with nothing below)
SECTIONS_MAY_BE_NULL = ("solver", "parallel", "checkpoint", "gpu", "loss_scale", "data")
UNKNOWN = "zz_unknown_key"


def _wrong_values(value):
    """(what, value) replacements of a scalar or a container."""
    out = []
    if isinstance(value, bool):
        out += [("str", "yes"), ("int", 1), ("null", None), ("list", [True])]
    elif _int(value) or isinstance(value, float):
        out += [("str", str(value)), ("list", [value]), ("map", {"a": value}),
                ("bool", True), ("null", None), ("zero", 0), ("neg", -1),
                ("huge", 1e30), ("nan", float("nan")), ("inf", float("inf")),
                ("empty-str", ""), ("frac", 0.5)]
    elif isinstance(value, str):
        out += [("int", 5), ("list", [value]), ("map", {value: 1}), ("empty-str", ""),
                ("null", None), ("bool", True)]
    elif isinstance(value, list):
        out += [("map", {"a": 1}), ("empty-list", []), ("null", None), ("str", "x"),
                ("int", 3)]
    elif isinstance(value, dict):
        out += [("list", [1]), ("empty-map", {}), ("null", None), ("str", "x"), ("int", 3)]
    return out


def _walk(node, path=()):
    """(path, value) of every node below ``node``, parents first."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield path + (k,), v
            yield from _walk(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield path + (i,), v
            yield from _walk(v, path + (i,))


def _set(config, path, value):
    node = config
    for part in path[:-1]:
        node = node[part]
    if value is MISSING:
        del node[path[-1]]
    else:
        node[path[-1]] = value


def dotted(path):
    return ".".join(str(p) for p in path)


#: the big jobs made small, so that a graph builds in a fraction of a second
#: (gpt2_124m's 32 micro-batches of 12 blocks take ~20 s to plan); each
#: change keeps the job valid: (dotted key, value)
SHRINK = {"gpt2_124m": (("net.2.repeat", 2), ("net.3.bottom", "x2"), ("parallel.micro_batches", 2),
                        ("data.train.batch_size", 4), ("data.train.sequence_length", 64),
                        ("data.test.sequence_length", 64), ("net.1.max_length", 64))}


def load_jobs():
    """{job name: parsed YAML} of jobs/*.yaml (SHRINK applied)."""
    jobs = {}
    for name in sorted(os.listdir(JOBS)):
        if name.endswith(".yaml"):
            with open(os.path.join(JOBS, name), encoding="utf-8") as f:
                raw = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
            for key, value in SHRINK.get(name[:-5], ()):
                _set(raw, tuple(int(p) if p.isdigit() else p for p in key.split(".")), value)
            jobs[name[:-5]] = raw
    return jobs


def mutations(jobs=None):
    """Every mutation of every job, in a fixed order."""
    jobs = load_jobs() if jobs is None else jobs
    out = []
    for job, raw in jobs.items():
        ranks = JOB_RANKS.get(job, 1)

        def add(key_path, what, value=MISSING, config=None, expect=None, ranks=ranks):
            cfg = copy.deepcopy(raw) if config is None else config
            if config is None:
                _set(cfg, key_path, value)
            out.append(Mutation(job, dotted(key_path), what, cfg, ranks,
                                value=value, path=key_path, expect=expect))

        sampled = _sampled_layers(raw)
        for path, value in list(_walk(raw)):
            if any(p == "block" for p in path):  # repeat blocks: their own entries below
                continue
            if len(path) >= 2 and path[0] == "net" and path[1] not in sampled:
                continue
            for what, new in _wrong_values(value):
                add(path, what, new)
            if isinstance(value, dict):  # an unknown key at every level of mappings
                cfg = copy.deepcopy(raw)
                node = cfg
                for p in path:
                    node = node[p]
                node[UNKNOWN] = 1
                add(path + (UNKNOWN,), "unknown-key", config=cfg)
            if len(path) >= 2 and not isinstance(path[-1], int):
                add(path, "delete")
        cfg = copy.deepcopy(raw)
        cfg[UNKNOWN] = 1
        add((UNKNOWN,), "unknown-key", config=cfg)
        out += _net_mutations(job, raw, ranks)
        out += _parallel_mutations(job, raw, ranks)
        out += _path_mutations(job, raw, ranks)
    return out


def _layers(raw):
    return [(i, layer) for i, layer in enumerate(raw.get("net") or [])
            if isinstance(layer, dict) and "type" in layer]


#: the layers of one type a job's key-by-key mutations visit (GoogLeNet has
#: 57 convolutions of the same keys)
PER_TYPE = 2


def _sampled_layers(raw):
    """The indices of the net's entries whose keys are mutated one by one:
    the first PER_TYPE layers of each type, and every repeat entry."""
    seen, out = {}, set()
    for i, layer in enumerate(raw.get("net") or []):
        kind = layer.get("type", "repeat") if isinstance(layer, dict) else None
        seen[kind] = seen.get(kind, 0) + 1
        if seen[kind] <= PER_TYPE:
            out.add(i)
    return out


def _net_mutations(job, raw, ranks):
    out = []

    def add(i, key, what, change):
        cfg = copy.deepcopy(raw)
        change(cfg["net"][i], cfg)
        out.append(Mutation(job, f"net.{i}.{key}" if key else f"net.{i}", what, cfg, ranks,
                            path=("net", i, key) if key else ("net", i)))

    layers = _layers(raw)
    sampled = _sampled_layers(raw)
    for n, (i, layer) in enumerate(layers):
        if i not in sampled:
            continue
        add(i, "name", "missing-name", lambda l, c: l.pop("name"))
        add(i, "type", "missing-type", lambda l, c: l.pop("type"))
        add(i, "type", "no-such-type", lambda l, c: l.__setitem__("type", "convolution3d"))
        add(i, "bottom", "dangling-bottom", lambda l, c: l.__setitem__("bottom", "no_such_blob"))
        add(i, "bottom", "missing-bottom", lambda l, c: l.pop("bottom"))
        add(i, "kernel_size", "wrong-param-name", lambda l, c: l.__setitem__("kernel_size", 3))
        if n > 0:
            prev = layers[n - 1][1]["name"]
            add(i, "name", "duplicate-name", lambda l, c, p=prev: l.__setitem__("name", p))
        if isinstance(layer.get("bottom"), list) and len(layer["bottom"]) > 1:
            add(i, "bottom", "dangling-second-bottom",
                lambda l, c: l.__setitem__("bottom", [l["bottom"][0], "no_such_blob"]))
        if "top" in layer:
            add(i, "top", "top-overwrites-data", lambda l, c: l.__setitem__("top", "label")
                if l.get("bottom") != "label" else None)
        if "kernel" in layer:
            add(i, "kernel", "kernel-too-large", lambda l, c: l.__setitem__("kernel", 4000))
            add(i, "stride", "stride-too-large", lambda l, c: l.__setitem__("stride", 4000))
            add(i, "pad", "pad-larger-than-kernel", lambda l, c: l.__setitem__("pad", 50))
        if layer["type"] == "conv":
            add(i, "group", "group-not-dividing", lambda l, c: l.__setitem__("group", 7))
        if layer["type"] in ("fc", "conv") and "num_output" in layer:
            add(i, "num_output", "num-output-changed-upstream",
                lambda l, c: l.__setitem__("num_output", l["num_output"] + 3))
        if layer["type"] == "fc":
            add(i, "axis", "fc-axis-out-of-range", lambda l, c: l.__setitem__("axis", 7))
        if layer["type"] == "concat":
            add(i, "axis", "concat-axis-mismatch", lambda l, c: l.__setitem__("axis", 2))
        if layer["type"] == "attention":
            add(i, "num_heads", "heads-not-dividing", lambda l, c: l.__setitem__("num_heads", 7))
        if layer["type"] in ("softmax_loss", "accuracy"):
            add(i, "axis", "loss-axis-out-of-range", lambda l, c: l.__setitem__("axis", 5))
        if layer["type"] == "embedding":
            add(i, "input_dim", "vocab-below-data", lambda l, c: l.__setitem__("input_dim", 3))
        if layer["type"] == "position_embedding":
            add(i, "max_length", "shorter-than-sequence",
                lambda l, c: l.__setitem__("max_length", 4))
        if layer.get("tie_weight"):
            add(i, "tie_weight", "tie-to-missing", lambda l, c: l.__setitem__("tie_weight",
                                                                                "no_such_layer"))
        if "phase" in layer:
            add(i, "phase", "bad-phase", lambda l, c: l.__setitem__("phase", "val"))
    # a channel mismatch into an eltwise or a concat: widen the layer that writes a bottom
    for i, layer in layers:
        if layer["type"] in ("eltwise", "concat") and isinstance(layer.get("bottom"), list):
            writer = next((j for j, l in layers if j < i and l.get("top") == layer["bottom"][-1]
                           and "num_output" in l), None)
            if writer is not None:
                cfg = copy.deepcopy(raw)
                cfg["net"][writer]["num_output"] += 1
                if layer["type"] == "concat":  # widening one branch of a concat is fine:
                    cfg["net"][i]["axis"] = 3  # join along the width, whose sizes differ
                out.append(Mutation(job, f"net.{i}.bottom", f"{layer['type']}-shape-mismatch",
                                    cfg, ranks, path=("net", i, "bottom")))
                break
    # a repeat entry: its count and its block
    for i, entry in enumerate(raw.get("net") or []):
        if isinstance(entry, dict) and "repeat" in entry:
            for what, value in (("zero", 0), ("neg", -2), ("str", "12"), ("huge", 10 ** 9)):
                cfg = copy.deepcopy(raw)
                cfg["net"][i]["repeat"] = value
                out.append(Mutation(job, f"net.{i}.repeat", what, cfg, ranks, value=value,
                                    path=("net", i, "repeat")))
            cfg = copy.deepcopy(raw)
            cfg["net"][i]["block"][0]["zz_unknown_key"] = 1
            out.append(Mutation(job, f"net.{i}.block.0.{UNKNOWN}", "unknown-key", cfg, ranks))
            cfg = copy.deepcopy(raw)
            cfg["net"][i]["block"] = []
            out.append(Mutation(job, f"net.{i}.block", "empty-list", cfg, ranks, value=[]))
            cfg = copy.deepcopy(raw)
            cfg["net"][i]["block"][1]["name"] = cfg["net"][i]["block"][0]["name"]
            out.append(Mutation(job, f"net.{i}.block.1.name", "duplicate-name", cfg, ranks))
    return out


def _parallel_mutations(job, raw, ranks):
    out = []

    def add(what, par, np, key):
        cfg = copy.deepcopy(raw)
        cfg["parallel"] = dict(cfg.get("parallel") or {}, **par)
        out.append(Mutation(job, key, what, cfg, np, path=tuple(key.split("."))))

    names = [layer["name"] for _, layer in _layers(raw)]
    add("tensor-parallel-vs-ranks", {"scheme": "tensor", "tensor_parallel": 3}, 2,
        "parallel.tensor_parallel")
    add("ps-ranks-vs-ranks", {"mode": "sync_ps", "ps_ranks": 4}, 2, "parallel.ps_ranks")
    add("shard-vs-ranks", {"scheme": "sharded", "shard": 3}, 1, "parallel.scheme")
    add("micro-batches-not-dividing", {"micro_batches": 7}, ranks, "parallel.micro_batches")
    if names and "repeat" not in str(raw.get("net")):
        stages = {n: int(k >= len(names) // 2) for k, n in enumerate(names)}
        add("pipeline-vs-ranks", {"scheme": "pipeline", "stages": stages}, 3, "parallel.stages")
        add("hybrid-vs-ranks", {"scheme": "hybrid", "stages": stages}, 3, "parallel.stages")
        add("stages-count-too-many", {"scheme": "pipeline", "stages": 10 ** 6}, 2,
            "parallel.stages")
    add("stages-gap", {"scheme": "pipeline", "stages": {n: 2 for n in names}}, 3,
        "parallel.stages")
    return out


def _path_mutations(job, raw, ranks):
    out = []
    for split, spec in (raw.get("data") or {}).items():
        if not isinstance(spec, dict):
            continue
        if "path" in spec:
            for what, value in (("no-such-file", "data/no_such_file.h5"), ("a-folder", "data")):
                cfg = copy.deepcopy(raw)
                cfg["data"][split]["path"] = value
                out.append(Mutation(job, f"data.{split}.path", what, cfg, ranks, value=value,
                                    path=("data", split, "path"), expect="files"))
        cfg = copy.deepcopy(raw)
        cfg["data"][split]["mean_file"] = "no_such_mean.binaryproto"
        cfg["data"][split].pop("mean", None)
        out.append(Mutation(job, f"data.{split}.mean_file", "no-such-file", cfg, ranks,
                            path=("data", split, "mean_file"), expect="files"))
    cfg = copy.deepcopy(raw)
    cfg.setdefault("checkpoint", {})["folder"] = "README.md"
    out.append(Mutation(job, "checkpoint.folder", "a-file", cfg, ranks,
                        path=("checkpoint", "folder"), expect="train"))
    return out


# ------------------------------------------------------------- running
class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def make_data(folder, digits_h5=None, text_h5=None):
    """``folder``/data/ with the files the jobs read (digits.h5, a tiny
    CIFAR-shaped cifar10.h5, email.h5 and corpus.h5: byte tokens); the
    digits and text files are made by the ``data`` command unless given."""
    import h5py
    import numpy as np
    from tests.conftest import EMAIL, run_cli_here
    data = os.path.join(folder, "data")
    os.makedirs(data, exist_ok=True)
    for name, given, args in (("digits.h5", digits_h5, ["data", "digits"]),
                              ("email.h5", text_h5, ["data", "text", "--from", EMAIL,
                                                     "--glob", "*.py"])):
        target = os.path.join(data, name)
        if given:
            os.symlink(given, target)
        else:
            res = run_cli_here(*args, "--out", target)
            assert res.returncode == 0, res.stderr
    os.symlink(os.path.join(data, "email.h5"), os.path.join(data, "corpus.h5"))
    rng = np.random.default_rng(0)
    with h5py.File(os.path.join(data, "cifar10.h5"), "w") as f:
        f.attrs["mean"] = np.array([125.0, 122.0, 113.0])
        for split, n in (("train", 200), ("test", 100)):
            f[f"{split}/data"] = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
            f[f"{split}/label"] = rng.integers(0, 10, n)
    return folder


def run_case(mutation, folder, command="graph", timeout=60):
    """Run ``command`` (graph or plan) on the mutated job in this process,
    in ``folder`` (which make_data filled): (status or 'crash'/'hang',
    stderr, stdout)."""
    from tests.conftest import run_cli_here
    path = os.path.join(folder, f"{mutation.job}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(mutation.text())
    args = [command, path]
    if command == "plan" or mutation.ranks > 1:
        args += ["--np", mutation.ranks]
    if command == "graph" and _test_only(mutation):
        args += ["--phase", "test"]  # graph shows the train phase unless told
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    try:
        res = run_cli_here(*args, cwd=folder)
        return res.returncode, res.stderr, res.stdout
    except Hang:
        return "hang", "", ""
    except Exception as exc:  # noqa: BLE001 (a traceback: what is classified)
        import traceback
        return "crash", "".join(traceback.format_exception(exc))[-3000:], ""
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _test_only(mutation):
    """Whether the mutation is at a layer of the test phase only."""
    path = mutation.path or ()
    if len(path) < 2 or path[0] != "net" or not isinstance(path[1], int):
        return False
    layer = jobs_cache(mutation.job)["net"][path[1]]
    return isinstance(layer, dict) and layer.get("phase") == "test"


_JOBS = {}


def jobs_cache(job):
    if not _JOBS:
        _JOBS.update(load_jobs())
    return _JOBS[job]


def _norm(key):
    return re.sub(r"\[(-?\d+)\]", r".\1", key)


def classify(mutation, status, err, types, jobs):
    """The outcome class of one run (GOOD, ACCEPTED or one of BAD)."""
    if status == "hang":
        return HANG
    if status == "crash" or status not in (0, 2) or "Traceback" in err:
        return CRASH
    if status == 0:
        if mutation.what in ("unknown-key", "wrong-param-name", "missing-name",
                             "missing-type", "no-such-type", "dangling-bottom",
                             "dangling-second-bottom", "duplicate-name", "bad-phase",
                             "tie-to-missing"):
            return SILENT
        if mutation.value is None and len(mutation.path or ()) == 1 and \
                mutation.path[0] in SECTIONS_MAY_BE_NULL:
            return ACCEPTED  # an empty section (`solver:` with nothing under it) is {}
        if mutation.value is None and len(mutation.path or ()) == 3 and \
                mutation.path[0] == "data":
            return ACCEPTED  # a data spec key given as null is absent (job/data_spec.py)
        if mutation.value is not MISSING and mutation.path is not None:
            kind = documented_type(types, mutation.path, jobs[mutation.job])
            if kind and doc_accepts(kind, mutation.value) is False:
                return SILENT
        return ACCEPTED
    lines = err.strip().splitlines()
    if len(lines) != 1:
        return LONG
    line = lines[0]
    if f"{mutation.job}.yaml" not in line and "--np" not in line:
        return NO_FILE
    named = [_norm(k) for k in re.findall(r"key '([^']+)'", line)]
    want = _norm(mutation.key)
    if mutation.what == "delete":  # the section or layer that lacks it is named
        want = want.rsplit(".", 1)[0]
    for key in named:
        if key == want or want.startswith(key + ".") or key.startswith(want + "."):
            return GOOD
        if mutation.what.endswith("-vs-ranks") and key.split(".")[0] in ("parallel", "solver"):
            return GOOD  # the contradiction, named by another of its keys
        if want.startswith("data.") and key.split(".")[:2] == want.split(".")[:2]:
            return GOOD  # the data spec's key that its file refuses (a source inferred)
        if key.rsplit(".", 1)[0] == want.rsplit(".", 1)[0] and \
                mutation.what in ("duplicate-name",):
            return GOOD
    if want in _norm(line):
        return GOOD
    path = mutation.path or ()
    if named and len(path) >= 3 and path[0] == "net" and isinstance(path[1], int):
        layer = jobs_cache(mutation.job)["net"][path[1]]
        name = layer.get("name") if isinstance(layer, dict) else None
        if name and f"layer '{name}'" in line and named[0].split(".", 2)[-1] == \
                ".".join(map(str, path[2:])):
            return EXPANDED
        if mutation.what in SHAPE_WHATS and named[0].startswith("net."):
            return DOWNSTREAM
    return WRONG_KEY if named else NO_KEY


def main(argv=None):
    import collections
    import json
    import tempfile
    import time
    argv = sys.argv[1:] if argv is None else argv
    commands = [c for c in argv if c in ("graph", "plan")] or ["graph", "plan"]
    only = [a for a in argv if a not in commands]
    jobs, types = load_jobs(), doc_types()
    skip = [s for s in os.environ.get("FUZZ_SKIP", "").split(",") if s]
    cases = [m for m in mutations(jobs) if (not only or any(o in m.name for o in only))
             and m.job not in skip]
    counts = collections.Counter()
    rows = []
    start = time.time()
    with tempfile.TemporaryDirectory() as folder:
        make_data(folder)
        for n, m in enumerate(cases):
            if n % 500 == 0:
                print(f"{n}/{len(cases)} {time.time() - start:.0f} s", file=sys.stderr, flush=True)
            for command in commands:
                if command == "plan" and "plan" not in argv and not (
                        m.key.startswith("parallel") or n % 10 == 0):
                    continue  # plan: the parallel keys' cases and a tenth of the others
                t0 = time.time()
                status, err, _ = run_case(m, folder, command)
                cls = classify(m, status, err, types, jobs)
                counts[(command, cls)] += 1
                rows.append({"case": m.name, "command": command, "class": cls,
                             "status": status, "err": err.strip()[-600:],
                             "s": round(time.time() - t0, 2)})
    print(json.dumps(rows, indent=0), file=open(os.environ.get("FUZZ_OUT", "/dev/null"), "w"))
    print(f"{len(cases)} mutations, {len(rows)} runs, {time.time() - start:.0f} s")
    for (command, cls), n in sorted(counts.items()):
        print(f"{command:6s} {cls:20s} {n}")


if __name__ == "__main__":
    main()
