"""A config error names the file, the LINE where its key is written, the key
and what was expected (``job.yaml:17: key 'net[3].num_output': ...``):
job/yamlread.read_yaml_lines keeps the line of each key beside the loaded
values (plain dicts, lists, strings, numbers), job/config.locate puts it
in the message. A key the file lacks points at its nearest parent; a key
of a ``repeat`` block at its line in the block; a value a ``--set`` wrote
names the ``--set``. Also: the folders a refused ``--out a/b/../c`` made
are all removed; the names of a ``graph:`` refuse control characters; the
unused-data-keys note applies the ``--set`` values once."""
import os

import pytest

from purine_mpi.base.errors import ConfigError
from purine_mpi.job import config as config_module
from purine_mpi.job.config import load_config, load_job, resolve_config
from purine_mpi.job.yamlread import read_yaml, read_yaml_lines
from tests.conftest import run_cli_args, run_cli_here

#: a small synthetic job; each test breaks one line of it (line numbers below)
GOOD = """\
name: lines
seed: 1
data:
  train: {source: synthetic, shape: [1, 8, 8], classes: 10, batch_size: 4}
net:
  - {type: conv, name: conv1, bottom: data, top: conv1, num_output: 4, kernel: 3}
  - type: conv
    name: conv2
    bottom: conv1
    top: conv2
    num_output: 4
    kernel: 3
  - {type: fc, name: fc, bottom: conv2, top: fc, num_output: 10}
  - {type: softmax_loss, name: loss, bottom: [fc, label], top: loss}
solver:
  base_lr: 0.1
  momentum: 0.9
  max_iter: 3
"""

#: a net with a repeat (the blocks of gpt2_124m.yaml, in small)
REPEAT = """\
name: rep
data:
  train: {source: synthetic, shape: [1, 8, 8], classes: 10, batch_size: 4}
net:
  - {type: fc, name: h0, bottom: data, top: x0, num_output: 8}
  - repeat: 2
    block:
      - {type: relu, name: "r{i}", bottom: "x{i}", top: "y{i}"}
      - type: fc
        name: "f{i}"
        bottom: "y{i}"
        top: "x{i+1}"
        num_output: 8
  - {type: fc, name: out, bottom: x2, top: out, num_output: 10}
  - {type: softmax_loss, name: loss, bottom: [out, label], top: loss}
solver: {base_lr: 0.1, max_iter: 2}
"""


def _write(tmp_path, text, name="job.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _refusal(path, overrides=()):
    with pytest.raises(ConfigError) as e:
        load_job(path, overrides)
    return str(e.value)


def test_the_lines_lie_beside_plain_values():
    text = "a:\n  b: [1, {c: x}]\n  d: &d {e: 2}\nf:\n  <<: *d\n  g: 3\n"
    data, lines = read_yaml_lines(text, "t.yaml")
    assert data == read_yaml(text, "t.yaml")
    assert type(data) is dict and type(data["a"]["b"]) is list and type(data["f"]) is dict
    assert type(data["a"]["b"][0]) is int and type(data["a"]["b"][1]["c"]) is str
    assert lines[("a",)] == 1 and lines[("a", "b")] == 2 and lines[("a", "b", "1", "c")] == 2
    assert lines[("a", "d", "e")] == 3 and lines[("f",)] == 4 and lines[("f", "g")] == 6
    assert lines[("f", "e")] == 3  # merged by '<<': the line of the anchor's key
    assert ("f", "<<") not in lines


def test_wrong_value_deep_in_a_layer_names_its_line(tmp_path):
    path = _write(tmp_path, GOOD.replace("    num_output: 4\n", "    num_output: 0\n"))
    err = _refusal(path)
    # before: "job.yaml: key 'net[1].num_output': ..."
    assert err.startswith(f"{path}:11: key 'net[1].num_output': "), err
    assert "got 0" in err
    path = _write(tmp_path, GOOD.replace("kernel: 3}", "kernel: 'x'}"), "flow.yaml")
    assert _refusal(path).startswith(f"{path}:6: key 'net[0].kernel': "), _refusal(path)


def test_unknown_key_names_its_line(tmp_path):
    path = _write(tmp_path, GOOD.replace("  momentum: 0.9\n", "  momentun: 0.9\n"))
    err = _refusal(path)
    assert err.startswith(f"{path}:17: key 'solver.momentun': "), err
    assert "momentum" in err  # the did-you-mean


def test_missing_key_names_the_line_of_its_parent(tmp_path):
    path = _write(tmp_path, GOOD.replace(", batch_size: 4}", "}"))
    err = _refusal(path)
    assert err.startswith(f"{path}:4: key 'data.train.batch_size': missing"), err
    path = _write(tmp_path, GOOD.replace("  base_lr: 0.1\n", "  base_lr: 0.1\n  lr_policy: step\n"),
                  "step.yaml")
    err = _refusal(path)
    assert err.startswith(f"{path}:15: key 'solver.stepsize': "), err  # the line of solver:
    # a top-level key the file lacks has no line to name
    path = _write(tmp_path, GOOD.split("net:")[0], "nonet.yaml")
    assert _refusal(path).startswith(f"{path}: key 'net': "), _refusal(path)


def test_a_repeat_blocks_key_names_its_line_in_the_block(tmp_path):
    path = _write(tmp_path, REPEAT.replace("        num_output: 8\n", "        num_output: -3\n"))
    err = _refusal(path)
    assert err.startswith(f"{path}:13: key 'net.1.block.1.num_output': "), err
    path = _write(tmp_path, REPEAT.replace('name: "r{i}"', 'name: "r{j}"'), "ph.yaml")
    assert _refusal(path).startswith(f"{path}:8: key 'net.1.block.0.name': "), _refusal(path)
    path = _write(tmp_path, REPEAT.replace("repeat: 2", "repeat: 0"), "count.yaml")
    assert _refusal(path).startswith(f"{path}:6: key 'net.1.repeat': "), _refusal(path)
    # a layer after the repeat: its position in the file, not in the expanded net
    path = _write(tmp_path, REPEAT.replace("top: out, num_output: 10", "top: out, num_output: 0"),
                  "after.yaml")
    assert _refusal(path).startswith(f"{path}:14: key 'net[2].num_output': "), _refusal(path)


def test_a_set_value_names_the_set_not_a_line(tmp_path):
    path = _write(tmp_path, GOOD)
    err = _refusal(path, ["solver.base_lr=abc"])
    assert err.startswith("--set solver.base_lr=abc: key 'solver.base_lr': "), err
    err = _refusal(path, ["net.1.num_output=0"])
    assert err.startswith("--set net.1.num_output=0: key 'net[1].num_output': "), err
    # the file's fault under an unrelated --set: the file and its line
    path = _write(tmp_path, GOOD.replace("  momentum: 0.9\n", "  momentum: -1\n"), "m.yaml")
    err = _refusal(path, ["solver.base_lr=0.2"])
    assert err.startswith(f"{path}:17: key 'solver.momentum': "), err
    # load_config names the line as load_job does; a parsed mapping has none to name
    with pytest.raises(ConfigError, match=r"m\.yaml:17: key 'solver\.momentum'"):
        load_config(path)
    import yaml
    with pytest.raises(ConfigError) as e:
        resolve_config(yaml.safe_load(open(path)), "m.yaml")
    assert str(e.value).startswith("m.yaml: key 'solver.momentum': ")


def test_the_cli_prints_one_line_with_the_line_and_exits_2(tmp_path):
    path = _write(tmp_path, GOOD.replace("    num_output: 4\n", "    num_output: 0\n"))
    res = run_cli_args("train", path, "--out", tmp_path / "run")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines == [f"error: {path}:11: key 'net[1].num_output': layer 'conv2' (conv): "
                     "expected an integer > 0, got 0"], res.stderr
    assert not (tmp_path / "run").exists()


def test_an_error_found_building_the_graph_names_the_line(tmp_path):
    """A key refused after the config was resolved (the graph's shapes: a
    kernel larger than its input) names its line too (cli's blame_override)."""
    path = _write(tmp_path, GOOD.replace("    kernel: 3\n", "    kernel: 30\n"))
    res = run_cli_here("graph", path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().startswith(f"error: {path}:12: key 'net[1].kernel': "), res.stderr
    res = run_cli_here("graph", path, "--set", "net.1.kernel=40")
    assert res.stderr.strip().startswith("error: --set net.1.kernel=40: key 'net[1].kernel'"), \
        res.stderr


def test_a_refused_out_through_dotdot_leaves_no_folder(tmp_path):
    """``--out a/b/../c`` makes a, a/b and a/c; a run refused at start-up
    removes all three."""
    from purine_mpi.base import logfile
    from purine_mpi.job.rundir import choose_run_dir, lock_run_dir, release_run_dirs
    out = os.path.join(str(tmp_path), "a", "b", "..", "c")
    try:
        choose_run_dir("j", out=out, lock=lock_run_dir)
        assert (tmp_path / "a" / "c").is_dir() and (tmp_path / "a" / "b").is_dir()
        logfile.end_run(2)
        # before: a/b stayed, empty (and a with it)
        assert not (tmp_path / "a").exists(), os.listdir(tmp_path / "a")
    finally:
        release_run_dirs()
        logfile.new_run()


@pytest.mark.parametrize("entry, key", [
    ({"type": "blob", "name": "x\x1b[31m", "size": [1]}, "graph.1.name"),
    ({"type": "op", "name": "op\nnext", "op_type": "Relu", "inputs": ["a"],
      "outputs": ["b"]}, "graph.1.name"),
    ({"type": "op", "name": "relu", "op_type": "Relu", "inputs": ["a\u202e"],
      "outputs": ["b"]}, "graph.1.inputs.0"),
    ({"type": "blob", "name": "n\0ul", "size": [1]}, "graph.1.name"),
])
def test_graph_names_refuse_control_characters(entry, key):
    config = {"graph": [{"type": "blob", "name": "a", "size": [1]}, entry],
              "solver": {"base_lr": 0.1, "max_iter": 1}}
    # before: accepted (the check covered a net's layer names only)
    with pytest.raises(ConfigError, match="control character|NUL character") as e:
        resolve_config(config, "g.yaml")
    assert e.value.key == key


def test_the_data_keys_note_applies_each_set_once(tmp_path, monkeypatch):
    path = _write(tmp_path, GOOD)
    calls = []
    real = config_module.apply_override

    def counted(config, text, path="<config>"):
        calls.append(text)
        return real(config, text, path)
    monkeypatch.setattr(config_module, "apply_override", counted)
    job = load_job(path, ["solver.base_lr=0.2", "data.train.in_memory=true"])
    # before: each --set applied twice (resolve_config, then _ignored_data_keys)
    assert calls == ["solver.base_lr=0.2", "data.train.in_memory=true"], calls
    assert job.solver.base_lr == 0.2
    assert job.ignored_data_keys == (("train", "in_memory", True,
                                      "data.train.in_memory=true"),), job.ignored_data_keys
