"""The job (job/job.py): a validated config resolved once into frozen, typed
parts, read by attribute everywhere below io/."""
import ast
import copy
import dataclasses
import glob
import os
import pickle

import pytest

from purine_mpi.job.config import dump_config, load_config, load_job, resolve_config
from purine_mpi.job.job import CheckpointSpec, DataSpec, Job, ParallelSpec, SolverSpec, job_of
from purine_mpi.job.keys import BestSpec, EarlyStopSpec
from purine_mpi.job.schema import (CHECKPOINT_DEFAULTS, DATA_KEYS, PARALLEL_DEFAULTS,
                                   SOLVER_DEFAULTS, TOP_DOC, TOP_KEYS)
from tests.conftest import REPO, make_job

NET = [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1", "num_output": 5},
       {"type": "relu", "name": "relu1", "bottom": "fc1", "top": "fc1"},
       {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2", "num_output": 3},
       {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"], "top": "loss"}]


def _synthetic(batch, **extra):
    return dict({"source": "synthetic", "shape": [1, 2, 3], "classes": 3, "batch_size": batch},
                **extra)


def _minimal():
    return resolve_config({"data": {"train": _synthetic(4)}, "net": NET}, "<test>",
                          check_files=False)


def _rich(tmp_path):
    """Every kind of key: both watches, stages, transforms, an hdf5 spec given
    before the synthetic one, an explicit backend."""
    h5 = tmp_path / "d.h5"
    h5.write_bytes(b"")  # found by path; never opened here
    raw = {"name": "rich", "seed": 7, "backend": "numpy", "tf32": True, "memory_plan": False,
           "data": {"test": {"path": str(h5), "batch_size": 5, "split": "test", "scale": 0.5,
                             "mean": [1.0, 2.0], "crop_size": 2, "mirror": True,
                             "in_memory": False},
                    "train": _synthetic(6, seed=11, num_samples=60)},
           "net": NET,
           "solver": {"type": "adam", "lr_policy": "multistep", "stepvalues": [3, 9],
                      "early_stop": {"metric": "loss", "patience": 2}, "max_iter": 12},
           "parallel": {"scheme": "pipeline", "micro_batches": 3, "schedule": "gpipe",
                        "stages": {"fc1": 0, "relu1": 0, "fc2": 1, "loss": 1}},
           "checkpoint": {"interval": 4, "keep": 0, "best": {"metric": "accuracy"}}}
    return resolve_config(raw, str(tmp_path / "rich.yaml"))


# ------------------------------------------------------------------ frozen
def test_the_job_is_frozen():
    job = job_of(_minimal())
    for obj, field, value in [(job, "name", "x"), (job.solver, "base_lr", 1.0),
                              (job.parallel, "scheme", "none"), (job.checkpoint, "keep", 0),
                              (job.data, "train", None), (job.data.train, "batch_size", 1)]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, value)
    with pytest.raises(TypeError):
        job.net[0]["num_output"] = 9  # a layer entry is a read-only mapping
    with pytest.raises(TypeError):
        job.parallel.stages["fc1"] = 0
    assert isinstance(job.net, tuple) and isinstance(job.solver.stepvalues, tuple)


def test_the_job_does_not_share_the_dict_it_came_from():
    config = _minimal()
    job = job_of(config)
    config["solver"]["max_iter"] = 5
    config["net"][0]["num_output"] = 99
    assert job.solver.max_iter == SOLVER_DEFAULTS["max_iter"]
    assert job.net[0]["num_output"] == 5


# ---------------------------------------------------------------- defaults
def test_every_default_is_resolved():
    job = job_of(_minimal())
    # one field per schema key, so a new key cannot be left out of the job
    assert [f.name for f in dataclasses.fields(SolverSpec)] == list(SOLVER_DEFAULTS)
    assert [f.name for f in dataclasses.fields(ParallelSpec)] == list(PARALLEL_DEFAULTS)
    assert [f.name for f in dataclasses.fields(CheckpointSpec)] == list(CHECKPOINT_DEFAULTS)
    assert {f.name for f in dataclasses.fields(DataSpec)} == set(DATA_KEYS)
    assert {f.name for f in dataclasses.fields(Job)} == \
        set(TOP_KEYS) | {"path", "net_keys", "overrides", "ignored_data_keys"}
    assert job.solver.to_config() == SOLVER_DEFAULTS
    assert job.parallel.to_config() == PARALLEL_DEFAULTS
    assert job.checkpoint.to_config() == CHECKPOINT_DEFAULTS
    for key in ("seed", "device", "tf32", "cuda_graph", "memory_plan"):
        assert getattr(job, key) == TOP_DOC[key][1], key
    assert job.name == "net" and job.path == "<test>" and job.backend is None
    train = job.data.train
    assert (train.shuffle, train.num_samples, train.split, train.seed) == (True, 1024, "train",
                                                                           None)
    assert job.data.test is None and job.graph is None


def test_a_dict_missing_sections_takes_the_schema_defaults():
    job = job_of({"net": NET, "data": {"train": _synthetic(2)}})
    assert job.solver == SolverSpec() and job.parallel == ParallelSpec()
    assert job.checkpoint == CheckpointSpec()


# -------------------------------------------------------------- round trip
def _caffe_keys():
    """The keys a Caffe user's job has (convert caffe): an LMDB source with a
    mean file, gradient clipping, the snapshot folder."""
    raw = {"data": {"train": {"source": "lmdb", "path": "train_lmdb", "batch_size": 4,
                              "mean_file": "mean.binaryproto", "crop_size": 2, "mirror": True},
                    "test": {"source": "lmdb", "path": "test_lmdb", "batch_size": 4,
                             "mean": [104.0, 117.0, 123.0], "scale": 0.5}},
           "net": NET, "solver": {"clip_gradients": 10.0},
           "checkpoint": {"folder": "snapshots/lenet"}}
    return resolve_config(raw, "<caffe>", check_files=False)


def test_the_caffe_keys_read_as_typed_parts():
    job = job_of(_caffe_keys())
    assert job.solver.clip_gradients == 10.0 and job.checkpoint.folder == "snapshots/lenet"
    train, test = job.data.train, job.data.test
    assert (train.source, train.path, train.mean_file, train.crop_size) == (
        "lmdb", "train_lmdb", "mean.binaryproto", 2)
    assert (train.in_memory, train.split, train.num_samples) == (None, None, None)
    assert test.mean == (104.0, 117.0, 123.0) and test.mean_file is None


def _configs(tmp_path):
    out = [_minimal(), _rich(tmp_path), _caffe_keys()]
    for path in sorted(glob.glob(os.path.join(REPO, "jobs", "*.yaml"))):
        out.append(load_config(path, check_files=False))
    return out


def test_to_config_round_trips(tmp_path):
    for config in _configs(tmp_path):
        job = job_of(config)
        assert job.to_config() == config
        assert list(job.to_config()) == list(config)  # the same key order
        assert dump_config(job) == dump_config(config)
        assert job_of(job) is job
        assert job_of(job.to_config()) == job


def test_the_rich_job_reads_as_typed_parts(tmp_path):
    job = job_of(_rich(tmp_path))
    assert job.solver.stepvalues == (3, 9)
    assert job.solver.early_stop == EarlyStopSpec("loss", None, 2, 0.0)
    assert job.solver.early_stop.direction == "min"
    assert job.checkpoint.best == BestSpec("accuracy", None, 1)
    assert job.checkpoint.best.direction == "max"
    assert job.data.order == ("test", "train")
    assert job.data.test.mean == (1.0, 2.0) and job.data.test.in_memory is False
    assert job.data.test.source_dict()["mean"] == [1.0, 2.0]
    assert "batch_size" not in job.data.test.source_dict()
    assert job.data.train.seed == 11 and job.backend == "numpy"


def test_the_job_pickles_and_copies(tmp_path):
    job = job_of(_rich(tmp_path))
    assert pickle.loads(pickle.dumps(job)) == job
    assert copy.deepcopy(job) == job
    assert load_job(os.path.join(REPO, "jobs", "digits_lenet.yaml"), check_files=False) == \
        job_of(load_config(os.path.join(REPO, "jobs", "digits_lenet.yaml"), check_files=False))


# ---------------------------------------------------------- derived values
def test_batches(tmp_path):
    config = _rich(tmp_path)
    job = job_of(config)
    batch = config["data"]["train"]["batch_size"]
    assert job.train_batch == batch
    assert job.micro_batch == batch // config["parallel"]["micro_batches"] == 2
    for replicas in (1, 3, 8):
        assert job.global_batch(replicas) == batch * replicas
    assert job_of({"net": NET}).train_batch is None


def test_the_stage_map():
    config = load_config(os.path.join(REPO, "jobs", "digits_hybrid.yaml"), check_files=False)
    job = job_of(config)
    stages = config["parallel"]["stages"]
    assert dict(job.stage_map) == stages
    assert job.parallel.stage_count == len(set(stages.values())) == 2
    assert job.parallel.staged and not job.parallel.servers
    by_stage = job.parallel.stage_layers()
    assert sorted(by_stage) == [0, 1]
    for s, names in by_stage.items():
        assert list(names) == [n for n, v in stages.items() if v == s]
    assert job.layer_names == tuple(layer["name"] for layer in config["net"])
    assert job.stage_of("fc2") == stages["fc2"]


def test_parameter_servers_replace_rather_than_edit():
    from purine_mpi.parallel.param_server import synchronous_if_no_staleness
    config = _minimal()
    config["parallel"]["mode"] = "async"
    job = job_of(config)
    sync = synchronous_if_no_staleness(job)
    assert sync.parallel.mode == "sync_ps" and job.parallel.mode == "async"
    assert dataclasses.replace(sync.parallel, mode="async") == job.parallel


def test_a_job_and_its_dict_build_the_same_graph():
    from purine_mpi.graph import seed_yaml
    from purine_mpi.job.replica import build_train_graph
    config = _minimal()
    config["parallel"]["micro_batches"] = 2
    by_dict, _ = build_train_graph(make_job(config), 1, 2)
    by_job, _ = build_train_graph(job_of(config), 1, 2)
    assert seed_yaml.dump(by_dict) == seed_yaml.dump(by_job)
    reader = by_job.ops["data"]
    assert reader.attrs["batch_size"] == 2  # one micro-batch of 4
    assert reader.attrs["source"] == {k: v for k, v in config["data"]["train"].items()
                                      if k != "batch_size"}


# ------------------------------------------- no config dict below io/
#: modules that may still read or write config dicts: the config layer,
#: the Caffe converter (it writes configs) and the command line / doc tools
ALLOWED = ("purine_mpi/job/", "purine_mpi/data/", "purine_mpi/tools/inspect.py",
           "purine_mpi/interop/caffe_", "purine_mpi/cli.py", "purine_mpi/tools/docgen")
#: variables that held config dicts or their sections before the job
CONFIG_NAMES = {"config", "par", "sol", "solver", "ck"}
#: keys only a config dict (or one of its sections) has
CONFIG_KEYS = {"net", "graph", "solver", "parallel", "checkpoint", "_path", "stall_timeout",
               "max_iter", "test_interval", "ps_ranks"}


def config_reads(source, filename="<source>"):
    """(line, text) of each read of a config dict: a subscript or ``.get`` on
    a config variable or on an attribute ``config`` (``self.config[...]``),
    or with a key only a config has."""
    hits = []
    for node in ast.walk(ast.parse(source, filename)):
        target = key = None
        if isinstance(node, ast.Subscript):
            target, key = node.value, node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "get" and node.args:
            target, key = node.func.value, node.args[0]
        if target is None:
            continue
        named = (isinstance(target, ast.Name) and target.id in CONFIG_NAMES) or \
            (isinstance(target, ast.Attribute) and target.attr == "config")
        literal = key.value if isinstance(key, ast.Constant) else None
        if named or literal in CONFIG_KEYS:
            hits.append((node.lineno, ast.unparse(node)))
    return hits


def test_the_scan_finds_config_reads():
    text = ('par = config.get("parallel", {})\nx = par.get("stall_timeout", 300)\n'
            'y = self.config["solver"]["max_iter"]\nz = spec["_path"]\n')
    assert len(config_reads(text)) == 5
    assert config_reads("a = job.parallel.stall_timeout\nb = layer['name']\n") == []


def test_no_module_below_io_reads_a_config_dict():
    found = []
    for path in sorted(glob.glob(os.path.join(REPO, "purine_mpi", "**", "*.py"),
                                 recursive=True)):
        rel = os.path.relpath(path, REPO).replace(os.sep, "/")
        if rel.startswith(ALLOWED):
            continue
        with open(path, encoding="utf-8") as f:
            found += [f"{rel}:{line}: {text}" for line, text in config_reads(f.read(), rel)]
    assert not found, "config dict reads below io/ (read the Job's attributes):\n" + \
        "\n".join(found)


def test_a_key_declared_once_is_checked_defaulted_held_and_used():
    """solver.min_lr, declared by one ConfigKey in job/schema.py: validated,
    defaulted, a field of the job, and read by the LearningRate op."""
    from purine_mpi.base.errors import ConfigError
    from purine_mpi.job.replica import build_train_graph
    from purine_mpi.ops.lr_policy import learning_rate
    raw = {"data": {"train": _synthetic(4)}, "net": NET,
           "solver": {"lr_policy": "cosine", "base_lr": 0.1, "max_iter": 10, "min_lr": 0.002}}
    job = make_job(raw, check_files=False)
    assert job.solver.min_lr == 0.002 and job_of(_minimal()).solver.min_lr == 0.0
    attrs = build_train_graph(job)[0].ops["solver.lr"].attrs
    assert learning_rate(attrs, 10) == pytest.approx(0.002)
    assert learning_rate(attrs, 0) == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="key 'solver.min_lr': expected a non-negative number"):
        make_job(dict(raw, solver={"min_lr": -1}), check_files=False)
