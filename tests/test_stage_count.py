"""``parallel.stages: S`` (job/stage_cut.py): the layers cut into S
contiguous stages balanced by their forward+backward FLOPs, resolved at
config-load time into the explicit map; its refusals; and a pipeline run
with ``stages: 2`` bit-identical to the run with the map it resolves to."""
import os
import subprocess

import h5py
import numpy as np
import pytest
import yaml

from purine_mpi.base.errors import ConfigError
from purine_mpi.job.config import load_job
from purine_mpi.job.stage_cut import layer_flops, stage_lines
from tests.conftest import (MPIEXEC, PYTHON, REPO, cli_env, make_job, run_cli_here,
                            write_config_file)
from tests.gpt_nets import text_h5 as make_text_h5

B = 32


def _mlp(digits_h5, stages, scheme="pipeline"):
    net = [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1", "num_output": 256},
           {"type": "relu", "name": "relu1", "bottom": "fc1", "top": "fc1"},
           {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2", "num_output": 256},
           {"type": "relu", "name": "relu2", "bottom": "fc2", "top": "fc2"},
           {"type": "fc", "name": "fc3", "bottom": "fc2", "top": "fc3", "num_output": 10},
           {"type": "softmax_loss", "name": "loss", "bottom": ["fc3", "label"]}]
    return {"name": "m", "net": net, "parallel": {"scheme": scheme, "stages": stages},
            "data": {"train": {"source": "hdf5", "path": digits_h5, "split": "train",
                               "batch_size": B}}}


def _within_bound(stages, flops, count):
    """No stage above the ideal share + the largest layer's FLOPs."""
    total, largest = sum(flops.values()), max(flops.values())
    per = [sum(f for n, f in flops.items() if stages[n] == s) for s in range(count)]
    assert all(p <= total / count + largest for p in per), (per, total / count, largest)
    return per


def test_mlp_resolves_to_the_flop_balanced_map(digits_h5):
    job = make_job(_mlp(digits_h5, 2))
    assert dict(job.parallel.stages) == {"fc1": 0, "relu1": 0, "fc2": 1, "relu2": 1,
                                         "fc3": 1, "loss": 1}
    # the counts against the closed form: 2·rows·in·out per product; fc1 has no data gradient
    flops = layer_flops(job)
    assert flops == {"fc1": 4 * B * 64 * 256, "relu1": 0, "fc2": 6 * B * 256 * 256, "relu2": 0,
                     "fc3": 6 * B * 256 * 10, "loss": 0}
    _within_bound(job.parallel.stages, flops, 2)
    # three stages: fc2 (83% of the FLOPs) alone in the middle
    three = make_job(_mlp(digits_h5, 3)).parallel.stages
    assert dict(three) == {"fc1": 0, "relu1": 0, "fc2": 1, "relu2": 2, "fc3": 2, "loss": 2}
    _within_bound(three, flops, 3)
    # the same map as given explicitly, and one stage as the explicit one-stage map
    assert make_job(_mlp(digits_h5, dict(job.parallel.stages))) == job
    assert set(make_job(_mlp(digits_h5, 1)).parallel.stages.values()) == {0}
    lines = stage_lines(job.parallel.stages, flops)
    assert lines[0].startswith("stage 0: fc1..relu1 (2 layers, 13.8% of the FLOPs)"), lines


@pytest.mark.parametrize("count", [2, 3, 4])
def test_gpt_tiny_stages_are_balanced(tmp_path, count):
    path = make_text_h5(tmp_path)
    job = load_job(os.path.join(REPO, "jobs", "gpt_tiny.yaml"), [
        f"data.train.path={path}", f"data.test.path={path}", "parallel.scheme=pipeline",
        f"parallel.stages={count}"])
    stages = job.parallel.stages
    assert list(stages) == list(job.layer_names)  # every layer, in the net's order
    assert list(stages.values()) == sorted(stages.values())  # contiguous
    assert set(stages.values()) == set(range(count))
    flops = layer_flops(job)
    assert flops["h0_attn"] > 0 and flops["h0_fc"] > 0 and flops["h0_gelu"] == 0
    per = _within_bound(stages, flops, count)
    assert min(per) > 0


@pytest.mark.parametrize("parallel,problem", [
    ({"scheme": "pipeline", "stages": 0}, "expected a number of stages >= 1"),
    ({"scheme": "pipeline", "stages": 7}, "7 stages for a net of 6 layers; give at most 6"),
    ({"scheme": "data", "stages": 2}, "scheme data takes no stages (got 2)"),
    ({"scheme": "tensor", "stages": 2}, "scheme tensor takes no stages"),
    ({"scheme": "hybrid", "stages": 1}, "needs at least 2 stages"),
    ({"scheme": "sharded", "stages": 1}, "needs at least 2 stages"),
    ({"scheme": "pipeline", "stages": True}, "expected a mapping of layer name to stage"),
])
def test_refused_counts(digits_h5, parallel, problem):
    cfg = _mlp(digits_h5, parallel["stages"], parallel["scheme"])
    with pytest.raises(ConfigError) as e:
        make_job(cfg, "m.yaml")
    assert e.value.key == "parallel.stages" and problem in str(e.value), str(e.value)
    assert str(e.value).startswith("m.yaml: key 'parallel.stages'")


def test_a_count_without_the_data_names_the_key(tmp_path):
    """A command that reads no data (check_files off) still needs the data's
    shapes for the cut: one line naming parallel.stages and the data file."""
    cfg = _mlp(str(tmp_path / "absent.h5"), 2)
    with pytest.raises(ConfigError) as e:
        make_job(cfg, "m.yaml", check_files=False)
    assert e.value.key == "parallel.stages" and "absent.h5" in str(e.value)
    assert "give the map {layer: stage}" in str(e.value)
    assert make_job(_mlp(str(tmp_path / "absent.h5"), {}, "data"), check_files=False)


def test_graph_and_plan_print_the_resolved_map(tmp_path, digits_h5):
    cfg = write_config_file(tmp_path, _mlp(digits_h5, 2), "m.yaml")
    # fc1 4·B·64·256 of 4·B·64·256 + 6·B·256·256 + 6·B·256·10 FLOPs
    share = 100 * 4 * 64 * 256 / (4 * 64 * 256 + 6 * 256 * 256 + 6 * 256 * 10)
    lines = [f"stage 0: fc1..relu1 (2 layers, {share:.1f}% of the FLOPs)",
             f"stage 1: fc2..loss (4 layers, {100 - share:.1f}% of the FLOPs)"]
    graph = run_cli_here("graph", cfg, "--np", "2", "--rank", "1")
    assert graph.returncode == 0, graph.stderr
    assert graph.stdout.splitlines()[1:3] == lines, graph.stdout[:400]
    plan = run_cli_here("plan", cfg, "--np", "2")
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.splitlines()[1:3] == [f"  {line}" for line in lines], plan.stdout[:400]
    bad = run_cli_here("train", write_config_file(tmp_path, _mlp(digits_h5, 9), "bad.yaml"))
    assert bad.returncode == 2
    stages_line = 1 + (tmp_path / "bad.yaml").read_text().splitlines().index("  stages: 9")
    assert bad.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'bad.yaml'}:{stages_line}: key 'parallel.stages': 9 stages for a "
        "net of 6 "
        "layers; give at most 6 (each stage holds a layer)"], bad.stderr


def _params(path):
    with h5py.File(path, "r") as f:
        out = {}
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
        return out


@pytest.mark.mpi
def test_pipeline_run_with_a_count_equals_the_map(tmp_path, digits_h5):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    with open(os.path.join(REPO, "jobs", "digits_pipeline.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg["data"]["train"]["path"] = cfg["data"]["test"]["path"] = digits_h5
    cfg["solver"].update(max_iter=30, display=10, test_interval=0)
    explicit = write_config_file(tmp_path, cfg, "map.yaml")
    resolved = load_job(explicit, ["parallel.stages=2"]).parallel.stages
    assert dict(resolved) == cfg["parallel"]["stages"]  # conv1..pool1 | fc1..accuracy
    runs = {}
    for name in ("map", "count"):
        sets = ["--set", "parallel.stages=2"] if name == "count" else []
        res = subprocess.run([MPIEXEC, "-n", "2", PYTHON, "-m", "purine_mpi", "train",
                              explicit, *sets, "--out", tmp_path / name], cwd=REPO,
                             env=cli_env(), capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        runs[name] = res
    a, b = _params(tmp_path / "map" / "latest.h5"), _params(tmp_path / "count" / "latest.h5")
    assert sorted(a) == sorted(b) and a
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    assert runs["map"].stdout.splitlines()[-1] == runs["count"].stdout.splitlines()[-1]


def test_plan_choose_writes_the_integer_where_its_cut_is_the_flop_cut(digits_h5):
    from purine_mpi.graph.flops import op_flops
    from purine_mpi.job.replica import build_train_graph
    from purine_mpi.tools.choose import staged_settings
    from purine_mpi.tools.scaling.trace_reader import Durations
    job = make_job(_mlp(digits_h5, {}, "data"))
    graph, _ = build_train_graph(job)
    # traced times proportional to the FLOPs: the balanced cut is parallel.stages: 2's
    timed = Durations({0: {name: 1e-12 * op_flops(op, lambda b: graph.blobs[b].shape)
                           for name, op in graph.ops.items()}})
    assert {text for text, _, _ in staged_settings(job, 2, timed)} == {"2"}
    # no trace: every layer weighs alike, fc1..fc2 | relu2..loss, not the FLOP cut
    texts = {text for text, _, _ in staged_settings(job, 2, Durations({}))}
    assert texts == {"{fc1: 0, relu1: 0, fc2: 0, relu2: 1, fc3: 1, loss: 1}"}
