"""``repeat`` in a job's net (job/repeat.py, issue 45 item 4): jobs/gpt_small.yaml
written with one repeated block builds the graph of the spelled-out file it
replaced (tests/fixtures/jobs/gpt_small_spelled_out.yaml): the same blob
names and shapes, and the same bits after training iterations; a repeat's
errors exit 2 naming the file and the key."""
import copy
import os

import numpy as np
import pytest

from purine_mpi.base.errors import ConfigError
from purine_mpi.job.config import load_config, resolve_config
from purine_mpi.tools.graph import compose_for
from purine_mpi.train.trainer import Trainer
from tests.conftest import REPO, FakeWorld, make_job, run_cli_here, write_config_file

NEW = os.path.join(REPO, "jobs", "gpt_small.yaml")
OLD = os.path.join(REPO, "tests", "fixtures", "jobs", "gpt_small_spelled_out.yaml")


def test_the_file_is_shorter_and_resolves_to_the_spelled_out_net():
    with open(NEW) as f, open(OLD) as g:
        assert len(f.read().splitlines()) < len(g.read().splitlines()) - 40
    new, old = (load_config(p, check_files=False) for p in (NEW, OLD))
    assert [layer["name"] for layer in new["net"]][3:6] == ["h0_ln1", "h0_attn", "h0_res1"]
    assert new["net"] == old["net"]


def _data(text_h5):
    return [f"data.train.path={text_h5}", f"data.test.path={text_h5}"]


def _graph(path, text_h5):
    cfg = load_config(path, overrides=_data(text_h5))
    return compose_for(make_job(cfg), 1, 0)


def test_same_blobs_and_shapes(text_h5):
    a, b = _graph(NEW, text_h5), _graph(OLD, text_h5)
    assert {n: tuple(x.shape) for n, x in a.blobs.items()} == \
        {n: tuple(x.shape) for n, x in b.blobs.items()}
    assert list(a.ops) == list(b.ops)
    assert any(n.startswith("h5_") for n in a.blobs) and len(a.ops) > 100


def _train(path, tmp, text_h5, iters=2):
    cfg = load_config(path, overrides=_data(text_h5) + [
        "data.train.batch_size=1", "data.train.sequence_length=32", f"solver.max_iter={iters}"])
    t = Trainer(make_job(cfg), str(tmp), world=FakeWorld(), log=lambda m: None)
    try:
        before = {p: np.array(t.ws[p]) for p in t.graphs.params}
        for it in range(iters):
            t.ws["iter"][...] = it
            t.train.run(it)
        after = {p: np.array(t.ws[p]) for p in t.graphs.params}
    finally:
        t.close()
    assert any(not np.array_equal(before[p], after[p]) for p in after)
    return after


def test_same_bits_after_training(tmp_path, text_h5):
    a, b = _train(NEW, tmp_path / "new", text_h5), _train(OLD, tmp_path / "old", text_h5)
    assert sorted(a) == sorted(b) and len(a) > 60
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name


BLOCK = [{"type": "fc", "name": "fc{i}", "bottom": "x{i}", "top": "x{i+1}", "num_output": 4},
         {"type": "relu", "name": "relu{i}", "bottom": "x{i+1}", "top": "x{i+1}"}]


def _config(net):
    return {"name": "r", "net": net, "data": {"train": {"source": "synthetic",
                                                      "shape": [4], "classes": 4,
                                                      "batch_size": 2}}}


def _net(**repeat):
    return [{"type": "fc", "name": "in", "bottom": "data", "top": "x1", "num_output": 4},
            dict({"repeat": 3, "start": 1, "block": BLOCK}, **repeat),
            {"type": "softmax_loss", "name": "loss", "bottom": ["x4", "label"]}]


def test_placeholders_and_start():
    net = resolve_config(_config(_net()), check_files=False)["net"]
    assert [(layer["name"], layer["bottom"], layer["top"]) for layer in net[1:7]] == [
        ("fc1", "x1", "x2"), ("relu1", "x2", "x2"), ("fc2", "x2", "x3"),
        ("relu2", "x3", "x3"), ("fc3", "x3", "x4"), ("relu3", "x4", "x4")]
    block = [dict(BLOCK[0], name="fc{i}_{{raw}}", top="y{i-1}")]
    net = resolve_config(_config([_net()[0], {"repeat": 2, "start": 1, "block": block},
                                  _net()[2]]), check_files=False)["net"]
    assert [(layer["name"], layer["top"]) for layer in net[1:3]] == [("fc1_{raw}", "y0"),
                                                                       ("fc2_{raw}", "y1")]


@pytest.mark.parametrize("repeat,key,words", [
    ({"repeat": 0}, "net.1.repeat", "integer in [1,"),
    ({"repeat": "six"}, "net.1.repeat", "number of blocks"),
    ({"repeat": True}, "net.1.repeat", "number of blocks"),
    ({"start": -1}, "net.1.start", "integer >= 0"),
    ({"block": []}, "net.1.block", "non-empty list"),
    ({"layers": BLOCK}, "net.1.layers", "takes the keys repeat, start, block"),
    ({"block": [dict(BLOCK[0], top="x{j}")]}, "net.1.block.0.top", "unknown placeholder '{j}'"),
    ({"block": [dict(BLOCK[0], top="x{i")]}, "net.1.block.0.top", "unmatched brace"),
    ({"block": [dict(BLOCK[0], name="fc")]}, "net.1.block.0.name", "holds no placeholder"),
    ({"start": 0, "block": [dict(BLOCK[0], top="x{i-1}")]}, "net.1.block.0.top",
     "give the repeat a 'start' of at least 1"),
    ({"block": [dict(BLOCK[0], stride=2)]}, "net.1.block.0.stride", "unknown key"),
    ({"block": [{"repeat": 2, "block": BLOCK}]}, "net.1.block.0", "repeat inside a repeat"),
])
def test_errors_name_the_key(repeat, key, words):
    with pytest.raises(ConfigError) as e:
        resolve_config(_config(_net(**repeat)), "job.yaml", check_files=False)
    assert e.value.key == key and words in e.value.problem, str(e.value)


def test_duplicate_names_across_entries_name_the_block():
    net = _net()
    net.insert(1, {"type": "relu", "name": "fc2", "bottom": "x1", "top": "x1"})
    with pytest.raises(ConfigError) as e:
        resolve_config(_config(net), "job.yaml", check_files=False)
    assert e.value.key == "net.2.block.0.name" and "(also net.1)" in e.value.problem


def test_cli_exits_2_naming_file_and_key(tmp_path):
    path = write_config_file(tmp_path, _config(_net(repeat=-2)), "bad.yaml")
    res = run_cli_here("plan", path)
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert "bad.yaml" in line and "'net.1.repeat'" in line and "got -2" in line


@pytest.mark.parametrize("change,key,words", [
    # a shape of a block's layer that cannot work: the block's key in the file
    (lambda n: n[1]["block"][0].update(axis=2), "net.1.block.0.axis", "layer 'fc1'"),
    (lambda n: n[1]["block"][1].update(type="eltwise", bottom=["x{i+1}", "label"]),
     "net.1.block.1.bottom", "Eltwise needs inputs of one shape"),
    (lambda n: n[1]["block"][0].update(bottom="x{i+5}"), "net.1.block.0.bottom",
     "bottom blob 'x6'"),
    # a layer after the repeat: its position in the file (net[2]), not the
    # expanded net's (net[7])
    (lambda n: n[2].update(bottom=["x9", "label"]), "net[2].bottom", "bottom blob 'x9'"),
    (lambda n: n.append({"type": "accuracy", "name": "acc", "bottom": ["x4", "label"],
                         "top": "acc"}) or n.insert(0, {"type": "relu", "name": "r",
                                                         "bottom": "data", "top": "data"}),
     "net[4].phase", "micro_batches 2"),
])
def test_graph_errors_after_a_repeat_name_the_files_key(change, key, words):
    """The graph's errors (a shape that cannot work, a missing bottom, a
    rule of micro-batches) named the layer's index in the expanded net
    (``net[7]`` for the file's ``net.2``); now the file's key."""
    net = copy.deepcopy(_net())
    change(net)
    cfg = dict(_config(net), parallel={"micro_batches": 2})
    with pytest.raises(ConfigError) as e:
        compose_for(make_job(cfg, "job.yaml"), 1, 0)
    assert e.value.key == key and words in str(e.value), str(e.value)
