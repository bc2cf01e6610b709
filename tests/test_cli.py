"""The command line: user errors (exit 2, one paragraph, no traceback), --help,
``graph`` in its three formats, and ``inspect``."""
import copy
import json
import math
import os
import re
import shutil
import subprocess

import h5py
import numpy as np
import pytest
import yaml

from purine_mpi.tools.graph import render_graph
from purine_mpi.job.replica import build_train_graph

from . import conftest
from .conftest import make_job, small_net_config, write_config_file

#: the working directory of this module's commands: a tmp folder, never the
#: repository's (a ``train`` without --out, also one that refuses its config,
#: makes runs/<name>/<N> in the working directory)
_CWD = {}


@pytest.fixture(autouse=True)
def _commands_run_in_tmp(tmp_path):
    _CWD["now"] = tmp_path
    yield
    _CWD.pop("now", None)


def _cwd(cwd):
    if cwd is None:
        cwd = _CWD.get("now")
    assert cwd is not None, "give cwd: a tmp folder, not the repository's"
    return cwd


def run_cli_args(*args, cwd=None, **kw):
    """conftest's, in this test's tmp folder (``_CWD``)."""
    return conftest.run_cli_args(*args, cwd=_cwd(cwd), **kw)


def run_cli_here(*args, cwd=None):
    """conftest's, in this test's tmp folder (``_CWD``)."""
    return conftest.run_cli_here(*args, cwd=_cwd(cwd))


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def assert_user_error(res, *needles):
    """Exit 2, 'error: ...' as one paragraph on stderr, no traceback, and
    the message names every ``needle`` (file, key, node)."""
    err = res.stderr
    assert res.returncode == 2, (res.returncode, err)
    assert "Traceback" not in err, err
    text = err.strip()
    assert text.startswith("error: "), err
    assert "\n\n" not in text and len(text.splitlines()) <= 3, err
    for n in needles:
        assert str(n) in text, f"{n!r} not in: {text}"
    return text


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def base(digits_h5, tmp_path_factory):
    """A small config and a 20-iteration run of it (checkpoints at 10, 20)."""
    d = tmp_path_factory.mktemp("cli")
    cfg = small_net_config(digits_h5, checkpoint={"interval": 10, "keep": 5})
    cfg["solver"]["display"] = 5
    path = write_config_file(d, cfg)
    out = d / "run"
    res = run_cli_args("train", path, "--out", out, cwd=d)
    assert res.returncode == 0, res.stderr
    return {"dir": d, "cfg": cfg, "path": path, "out": out}


def variant(base, name, mutate):
    cfg = copy.deepcopy(base["cfg"])
    mutate(cfg)
    return write_config_file(base["dir"], cfg, name)


# --------------------------------------------------------------- bad inputs
def test_malformed_yaml(base):
    path = write_config_file(base["dir"], "name: x\nnet:\n  - {type: conv, name: c1\n"
                                          "solver: {base_lr: 0.1}\n", "malformed.yaml")
    text = assert_user_error(run_cli_args("train", path), "malformed.yaml", "line")
    assert "YAML" in text


def test_missing_config_file(base):
    assert_user_error(run_cli_args("train", base["dir"] / "absent.yaml"), "absent.yaml",
                      "not found")


def test_unknown_layer_type(base):
    def mutate(cfg):
        cfg["net"][3]["type"] = "fcc"
    text = assert_user_error(run_cli_here("train", variant(base, "unknown_layer.yaml", mutate)),
                             "unknown_layer.yaml", "fcc", "fc1", "net")
    assert "did you mean 'fc'" in text


def test_missing_bottom_blob(base):
    def mutate(cfg):
        cfg["net"][3]["bottom"] = "nothere"
    assert_user_error(run_cli_args("train", variant(base, "bottom.yaml", mutate)),
                      "bottom.yaml", "nothere", "fc1", "bottom")


def test_conv_group_must_divide_channels(base):
    def mutate(cfg):
        cfg["net"][0]["group"] = 2  # the data has 1 channel
    assert_user_error(run_cli_args("train", variant(base, "group.yaml", mutate)),
                      "group.yaml", "conv1", "group")


def test_seed_graph_with_wrong_blob_size(base):
    text = render_graph(make_job(base["cfg"]), fmt="yaml")
    doc = yaml.safe_load(text)
    entry = next(e for e in doc["graph"] if e["type"] == "blob" and e["name"] == "fc1")
    assert entry["size"] == [16, 10]
    entry["size"] = [16, 11]
    cfg = {"name": "seed_bad", "graph": doc["graph"], "solver": base["cfg"]["solver"]}
    path = write_config_file(base["dir"], cfg, "seed_bad.yaml")
    assert_user_error(run_cli_args("train", path), "fc1.fwd", "'fc1'", "[16, 10]", "[16, 11]")


def test_seed_graph_with_unknown_op_type(base):
    doc = yaml.safe_load(render_graph(make_job(base["cfg"]), fmt="yaml"))
    op = next(e for e in doc["graph"] if e["type"] == "op" and e["name"] == "fc1.fwd")
    op["op_type"] = "InnerProdukt"
    path = write_config_file(base["dir"], {"graph": doc["graph"]}, "seed_op.yaml")
    assert_user_error(run_cli_args("train", path), "fc1.fwd", "InnerProdukt")


def _alias_of(graph):
    e = next(e for e in graph if e.get("alias_of"))
    e["alias_of"] = "nonexistent"
    return ["alias_of", "nonexistent", e["name"]]


def _dtype(graph):
    e = next(e for e in graph if e["name"] == "fc1/weight")
    e["dtype"] = "float33"
    return ["dtype", "float33", "fc1/weight"]


def _op_attrs(graph):
    e = next(e for e in graph if e["name"] == "fc1.fwd")
    e["attrs"] = [1, 2]
    return ["attrs"]


def _thread(graph):
    e = next(e for e in graph if e["name"] == "fc1.fwd")
    e["thread"] = [1, 2]
    return ["thread"]


@pytest.mark.parametrize("mutate", [_alias_of, _dtype, _op_attrs, _thread])
def test_seed_graph_bad_entries(base, mutate):
    doc = yaml.safe_load(render_graph(make_job(base["cfg"]), fmt="yaml"))
    needles = mutate(doc["graph"])
    path = write_config_file(base["dir"], {"graph": doc["graph"]}, f"seed_{mutate.__name__}.yaml")
    assert_user_error(run_cli_args("train", path), path.rsplit("/", 1)[1], "graph[",
                      *needles)


def test_missing_data_file(base, tmp_path):
    missing = tmp_path / "nope" / "digits.h5"

    def mutate(cfg):
        cfg["data"]["train"]["path"] = str(missing)
    assert_user_error(run_cli_here("train", variant(base, "nodata.yaml", mutate)),
                      "nodata.yaml", "data.train.path", str(missing))


@pytest.mark.parametrize("override,needles", [
    ("solver.base_lr", ["--set", "solver.base_lr", "KEY=VALUE"]),
    ("net.first.num_output=3", ["net.first.num_output", "integer"]),
    ("net.42.num_output=3", ["net.42.num_output", "out of range"]),
    ("solver.base_lr=[1,", ["solver.base_lr", "YAML"]),
    ("solver.base_lr=abc", ["solver.base_lr", "abc"]),
    ("solver.no_such_key=1", ["solver.no_such_key"]),
])
def test_bad_set_override(base, override, needles):
    assert_user_error(run_cli_here("train", base["path"], "--set", override), *needles)



@pytest.mark.parametrize("flags,needles", [
    (["--iters", "0"], ["--iters 0", ">= 1"]),
    (["--iters", "-3"], ["--iters -3", ">= 1"]),
    (["--warmup", "-1"], ["--warmup -1", ">= 0"]),
])
def test_bench_bad_iteration_counts(base, flags, needles):
    """bench --iters 0 (or --warmup -1) timed nothing and died in a traceback
    (exit 1, 'AttributeError: 'NoneType' object has no attribute 'events'');
    refused before the job is built."""
    assert_user_error(run_cli_here("bench", base["path"], *flags), *needles)

# corrupt files: not HDF5, truncated, a flipped bit in a parameter's data
@pytest.fixture(scope="module")
def corrupt_files(base):
    d = base["dir"] / "corrupt"
    d.mkdir()
    good = base["out"] / "latest.h5"
    files = {}
    files["garbage"] = d / "garbage.h5"
    files["garbage"].write_bytes(bytes(range(256)) * 20)
    raw = good.read_bytes()
    files["truncated"] = d / "truncated.h5"
    files["truncated"].write_bytes(raw[:len(raw) // 2])
    files["bitflip"] = d / "bitflip.h5"
    shutil.copy(good, files["bitflip"])
    with h5py.File(files["bitflip"], "r") as f:
        offset = f["params/fc1/weight"].id.get_chunk_info(0).byte_offset
    with open(files["bitflip"], "r+b") as f:
        f.seek(offset + 64)
        byte = f.read(1)
        f.seek(offset + 64)
        f.write(bytes([byte[0] ^ 0x10]))
    return files


COMMANDS = {
    "resume": lambda b, f: ["train", b["path"], "--resume", f, "--out", b["dir"] / "r"],
    "init": lambda b, f: ["train", b["path"], "--init", f, "--out", b["dir"] / "i"],
    "inspect": lambda b, f: ["inspect", f],
    "test": lambda b, f: ["test", b["path"], "--weights", f, "--out", b["dir"] / "t"],
}
#: how each of COMMANDS runs: train reads the checkpoint after MPI is up
#: (a process of its own); inspect and test before (in this process)
COMMAND_RUNS = {"resume": run_cli_args, "init": run_cli_args, "inspect": run_cli_here,
                "test": run_cli_here}


@pytest.mark.parametrize("kind", ["garbage", "truncated", "bitflip"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_corrupt_checkpoint(base, corrupt_files, kind, command):
    path = corrupt_files[kind]
    text = assert_user_error(COMMAND_RUNS[command](*COMMANDS[command](base, path)), path.name)
    assert re.search(r"corrupt|truncated|not an HDF5", text), text
    if kind == "bitflip" and command != "inspect":
        # the dataset that failed its checksum (inspect's message does not
        # name it yet: job/checkpoint_file.py _walk)
        assert "fc1/weight" in text


def test_foreign_hdf5_files(base, digits_h5):
    # a valid HDF5 file that is not a checkpoint
    assert_user_error(run_cli_args(*COMMANDS["resume"](base, digits_h5)), "digits.h5",
                      "not a purine_mpi checkpoint")
    assert_user_error(run_cli_args(*COMMANDS["init"](base, digits_h5)), "digits.h5",
                      "/params")
    assert_user_error(run_cli_here(*COMMANDS["test"](base, digits_h5)), "digits.h5",
                      "/params")


def test_checkpoint_of_another_net(base):
    def mutate(cfg):
        cfg["net"][0]["num_output"] = 6
    other = variant(base, "wider.yaml", mutate)
    ckpt = base["out"] / "latest.h5"
    for args in (["--resume", ckpt], ["--init", ckpt]):
        assert_user_error(run_cli_args("train", other, *args, "--out", base["dir"] / "w"),
                          "latest.h5", "conv1/weight", "[4, 1, 3, 3]", "[6, 1, 3, 3]")


def test_missing_checkpoint_file(base):
    missing = base["dir"] / "nowhere.h5"
    for command in sorted(COMMANDS):
        # --weights takes a run folder too, so it says both (issue 46)
        said = "no such run folder or checkpoint" if command == "test" else "not found"
        assert_user_error(COMMAND_RUNS[command](*COMMANDS[command](base, missing)), "nowhere.h5",
                          said)


# -------------------------------------------------------------------- help
@pytest.mark.parametrize("command", ["train", "test", "graph", "inspect", "data", "bench",
                                     "convert", "export"])
def test_help_for_every_subcommand(command):
    res = run_cli_here(command, "--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage:") and command in res.stdout.splitlines()[0]
    assert "Traceback" not in res.stderr


def test_top_level_help_and_missing_command():
    res = run_cli_args("--help")
    assert res.returncode == 0
    for command in ("train", "test", "graph", "inspect", "data", "bench"):
        assert command in res.stdout
    res = run_cli_args()
    assert res.returncode == 2 and "Traceback" not in res.stderr


# ------------------------------------------------------------------- graph
def test_graph_yaml_loads_back_and_trains_identically(base):
    # a process of its own, as a user runs it (its exit status and whole
    # output at exit); the other graph and inspect calls run in this one
    res = run_cli_args("graph", base["path"], "--format", "yaml")
    assert res.returncode == 0, res.stderr
    doc = yaml.safe_load(res.stdout)
    assert "&id" not in res.stdout  # no YAML anchors: each entry stands alone
    assert {e["type"] for e in doc["graph"]} == {"blob", "op"}
    cfg = {"name": "from_graph", "graph": doc["graph"], "data": base["cfg"]["data"],
           "solver": base["cfg"]["solver"], "checkpoint": base["cfg"]["checkpoint"],
           "seed": base["cfg"]["seed"]}
    path = write_config_file(base["dir"], cfg, "from_graph.yaml")
    out = base["dir"] / "from_graph"
    res = run_cli_args("train", path, "--out", out)
    assert res.returncode == 0, res.stderr

    def losses(d):
        return [(r["iter"], r["loss"]) for r in read_metrics(d) if r["phase"] == "train"]
    assert losses(out) == losses(base["out"])
    assert len(losses(out)) == 4
    with h5py.File(out / "latest.h5", "r") as a, h5py.File(base["out"] / "latest.h5") as b:
        names = []
        a["params"].visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset)
                               else None)
        assert sorted(names) == ["conv1/bias", "conv1/weight", "fc1/bias", "fc1/weight"]
        for n in names:
            assert np.array_equal(a["params"][n][...], b["params"][n][...]), n
    # the round trip is a fixed point: dumping the loaded graph gives the same text
    again = run_cli_here("graph", path, "--format", "yaml")
    assert yaml.safe_load(again.stdout)["graph"] == doc["graph"]


def test_graph_yaml_of_a_gpu_job_loads_back_as_the_same_placed_graph(base, tmp_path):
    # the yaml is the graph before the device passes, with the job's device
    # (and precision) keys: loaded, it is placed and fused as train does.
    # Before: the graph already fused for the GPU (one MultiSGDUpdate) was
    # printed; loaded, its backward was built again: "op 'loss.grad_seed' is
    # defined twice", exit 2 (no CuPy needed: graph composes offline)
    res = run_cli_here("graph", base["path"], "--format", "yaml", "--set", "device=0")
    assert res.returncode == 0, res.stderr
    doc = yaml.safe_load(res.stdout)
    assert doc["device"] == 0 and "precision" not in doc
    assert not any(e.get("op_type", "").startswith("Multi") for e in doc["graph"])
    cfg = dict(doc, data=base["cfg"]["data"])
    path = write_config_file(tmp_path, cfg, "from_gpu_graph.yaml")
    loaded = run_cli_here("graph", path)
    direct = run_cli_here("graph", base["path"], "--set", "device=0")
    assert loaded.returncode == 0, loaded.stderr
    assert "MultiSGDUpdate" in direct.stdout
    assert loaded.stdout.splitlines()[1:] == direct.stdout.splitlines()[1:]


def _dot_structure(text):
    assert text.startswith("digraph ") and text.rstrip().endswith("}")
    assert text.count("{") == text.count("}")
    node_re = re.compile(r'^\s*("(?:[^"\\]|\\.)*")\s*\[(.*)\];$')
    edge_re = re.compile(r'^\s*("(?:[^"\\]|\\.)*")\s*->\s*("(?:[^"\\]|\\.)*");$')
    nodes, edges = set(), []
    for line in text.splitlines()[1:-1]:
        if not line.strip() or line.strip() in ("rankdir=TB;",) or line.strip().startswith(
                ("node ", "edge ", "graph ", "subgraph", "}", "label", "style", "color")):
            continue
        m = edge_re.match(line)
        if m:
            edges.append((m.group(1), m.group(2)))
            continue
        m = node_re.match(line)
        assert m, f"not a DOT statement: {line!r}"
        nodes.add(m.group(1))
    for a, b in edges:
        assert a in nodes and b in nodes, (a, b)
    return nodes, edges


def test_graph_dot_is_valid(base):
    res = run_cli_here("graph", base["path"], "--format", "dot")
    assert res.returncode == 0, res.stderr
    nodes, edges = _dot_structure(res.stdout)
    graph, _ = build_train_graph(make_job(base["cfg"]))
    assert len(nodes) == len(graph.blobs) + len(graph.ops)
    assert len(edges) == sum(len(op.inputs) + len(op.outputs) for op in graph.ops.values())
    assert '"o:fc1.fwd"' in nodes and '"b:fc1/weight"' in nodes
    dot = shutil.which("dot")
    if dot:
        check = subprocess.run([dot, "-Tsvg"], input=res.stdout, capture_output=True,
                               text=True, timeout=60)
        assert check.returncode == 0, check.stderr
        assert "<svg" in check.stdout


def test_graph_text_lists_every_op(base):
    res = run_cli_here("graph", base["path"], "--format", "text")
    assert res.returncode == 0, res.stderr
    graph, _ = build_train_graph(make_job(base["cfg"]))
    lines = res.stdout.splitlines()
    assert f"{len(graph.blobs)} blobs, {len(graph.ops)} ops" in lines[0]
    listed = [line.split()[0] for line in lines[1:] if line.strip()]
    assert sorted(listed) == sorted(graph.ops)
    for line in lines[1:]:
        name, op_type = line.split()[:2]
        assert graph.ops[name].op_type == op_type
    # listed in an order that respects every dependency
    pos = {n: i for i, n in enumerate(listed)}
    for n, deps in graph.dependencies().items():
        assert all(pos[d] < pos[n] for d in deps), n


def test_graph_test_phase_and_bad_rank(base):
    res = run_cli_here("graph", base["path"], "--phase", "test")
    assert res.returncode == 0, res.stderr
    assert "acc.fwd" in res.stdout and "SGDUpdate" not in res.stdout
    assert_user_error(run_cli_here("graph", base["path"], "--rank", "3"), "--rank 3")


# ----------------------------------------------------------------- inspect
def _h5_datasets(path):
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                out["/" + name] = obj[()]
        f.visititems(visit)
    return out


def _is_numeric(v):
    return isinstance(v, np.ndarray) and v.dtype.kind in "biuf"


def test_inspect_json_stats(base):
    ckpt = base["out"] / "ckpt_20.h5"
    res = run_cli_args("inspect", ckpt, "--json")  # a process of its own, as graph's yaml
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["attrs"]["iteration"] == 20
    assert report["attrs"]["format"] == "purine_mpi.checkpoint"
    ref = _h5_datasets(ckpt)
    rows = {d["name"]: d for d in report["datasets"]}
    assert set(rows) == set(ref)
    assert "/params/conv1/weight" in rows and "/solver/fc1/bias/momentum" in rows
    for name, value in ref.items():
        row = rows[name]
        if not _is_numeric(value):
            continue
        assert row["shape"] == list(value.shape) and row["dtype"] == str(value.dtype)
        if value.size:
            x = value.astype(np.float64)
            for key, want in (("min", x.min()), ("max", x.max()), ("mean", x.mean()),
                              ("std", x.std()), ("l2", math.sqrt(float((x * x).sum())))):
                assert row[key] == pytest.approx(want, rel=1e-9, abs=1e-12), (name, key)


def test_inspect_text_lists_every_dataset(base):
    ckpt = base["out"] / "latest.h5"
    res = run_cli_here("inspect", ckpt)
    assert res.returncode == 0, res.stderr
    lines = {line.split()[0]: line for line in res.stdout.splitlines() if line.startswith("/")}
    ref = _h5_datasets(ckpt)
    assert set(lines) == set(ref)
    w = ref["/params/fc1/weight"]
    fields = lines["/params/fc1/weight"].split()
    assert fields[1] == "x".join(map(str, w.shape)) and fields[2] == "float32"
    assert float(fields[3]) == pytest.approx(float(w.min()), rel=1e-5)
    assert float(fields[4]) == pytest.approx(float(w.max()), rel=1e-5)
    assert "@iteration = 20" in res.stdout


def test_inspect_diff(base):
    a, b = base["out"] / "ckpt_10.h5", base["out"] / "ckpt_20.h5"
    res = run_cli_here("inspect", a, "--diff", b, "--json")
    assert res.returncode == 0, res.stderr
    diff = json.loads(res.stdout)["diff"]
    ra, rb = _h5_datasets(a), _h5_datasets(b)
    rows = {r["name"]: r for r in diff["datasets"]}
    numeric = [n for n in ra if _is_numeric(ra[n])]
    assert numeric and set(numeric) <= set(rows)
    for n in numeric:
        x, y = ra[n].astype(np.float64), rb[n].astype(np.float64)
        d = x - y
        norm = max(np.linalg.norm(x), np.linalg.norm(y))
        assert rows[n]["max_abs_diff"] == pytest.approx(np.abs(d).max(), rel=1e-9, abs=1e-15)
        assert rows[n]["rel_l2_diff"] == pytest.approx(np.linalg.norm(d) / norm if norm else 0,
                                                       rel=1e-9, abs=1e-15)
    assert rows["/params/fc1/weight"]["max_abs_diff"] > 0
    assert diff["attrs"]["iteration"] == [10, 20]
    assert diff["only_in_first"] == [] and diff["only_in_second"] == []
    # a file against itself: no differences; text output names the other file
    same = json.loads(run_cli_here("inspect", a, "--diff", a, "--json").stdout)["diff"]
    assert all(r.get("max_abs_diff", 0) == 0 for r in same["datasets"])
    text = run_cli_here("inspect", a, "--diff", b)
    assert text.returncode == 0 and "diff against" in text.stdout and "ckpt_20.h5" in text.stdout
    assert "/params/fc1/weight" in text.stdout.split("diff against")[1]
