"""Config loading: defaults, overrides and errors that name the file and key."""
import os
import textwrap

import h5py
import numpy as np
import pytest

from purine_mpi.base.errors import ConfigError
from purine_mpi.job.config import dump_config, load_config, resolve_config

BASE = """\
name: tiny
data:
  train: {source: hdf5, path: tiny.h5, split: train, batch_size: 4}
  test:  {source: hdf5, path: tiny.h5, split: test, batch_size: 5}
net:
  - {type: fc, name: fc1, bottom: data, top: fc1, num_output: 10}
  - {type: softmax_loss, name: loss, bottom: [fc1, label], top: loss}
solver: {base_lr: 0.1, lr_policy: step, stepsize: 100, max_iter: 200}
"""


@pytest.fixture
def cfg_dir(tmp_path):
    with h5py.File(tmp_path / "tiny.h5", "w") as f:
        for split, n in (("train", 8), ("test", 5)):
            f.create_dataset(f"{split}/data", data=np.zeros((n, 1, 2, 2), np.float32))
            f.create_dataset(f"{split}/label", data=np.zeros(n, np.int64))
    return tmp_path


def write(directory, text, name="cfg.yaml"):
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def error_of(path, **kw):
    with pytest.raises(ConfigError) as info:
        load_config(path, **kw)
    return info.value, str(info.value)


def test_defaults_are_filled(cfg_dir):
    config = load_config(write(cfg_dir, BASE))
    assert config["name"] == "tiny" and config["seed"] == 0 and config["device"] == -1
    assert config["precision"] == "fp32" and config["tf32"] is False
    assert config["solver"]["momentum"] == 0.9 and config["solver"]["type"] == "sgd"
    assert config["solver"]["test_iter"] is None and config["solver"]["display"] == 20
    assert config["parallel"] == {"scheme": "data", "mode": "sync", "bucket_mb": 4,
                                  "first_bucket_mb": 1, "min_buckets": 4, "split_params": True,
                                  "defer_update": True, "backend": "mpi",
                                  "grad_dtype": "fp32", "ps_ranks": 1,
                                  "max_staleness": 0,
                                  "stall_timeout": 300, "check_collectives": False,
                                  "stages": {}, "tensor_parallel": 1, "shard": 1, "prefetch": 1,
                                  "reduce_scatter": True, "micro_batches": 1,
                                  "ignore_label_mean": "global", "schedule": "1f1b",
                                  "transport": "auto"}
    assert config["checkpoint"] == {"interval": 0, "keep": 3, "best": None, "folder": None}
    assert config["solver"]["clip_gradients"] is None
    assert config["data"]["train"]["shuffle"] is True
    assert config["data"]["test"]["shuffle"] is False
    # the data path was found next to the config and made absolute
    assert config["data"]["train"]["path"] == str(cfg_dir / "tiny.h5")
    assert config["_path"].endswith("cfg.yaml")


def test_name_defaults_to_file_stem_and_synthetic_defaults(tmp_path):
    path = write(tmp_path, """\
        data: {train: {source: synthetic, shape: [3, 4, 4], classes: 5, batch_size: 2}}
        net: [{type: fc, name: fc1}]
        """, name="bench-net.yaml")
    config = load_config(path)
    assert config["name"] == "bench-net"
    train = config["data"]["train"]
    assert train["num_samples"] == 1024 and train["shape"] == [3, 4, 4] and train["classes"] == 5


def test_overrides_and_iters(cfg_dir):
    config = load_config(write(cfg_dir, BASE), overrides=[
        "solver.base_lr=0.05", "data.train.batch_size=32", "net.0.num_output=8",
        "parallel.mode=async", "checkpoint.interval=50", "data.train.shuffle=false"], iters=7)
    assert config["solver"]["base_lr"] == 0.05
    assert config["data"]["train"]["batch_size"] == 32
    assert config["net"][0]["num_output"] == 8
    assert config["parallel"]["mode"] == "async" and config["checkpoint"]["interval"] == 50
    assert config["data"]["train"]["shuffle"] is False
    assert config["solver"]["max_iter"] == 7


def test_string_exponent_is_a_number(cfg_dir):
    # PyYAML alone reads 1e-3 (no dot) as a string; our loader reads it as YAML 1.2 does
    config = load_config(write(cfg_dir, BASE), overrides=["solver.weight_decay=5e-4"])
    assert config["solver"]["weight_decay"] == 5e-4


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "name: x\nsolver: {base_lr: 0.1\nnet: []\n")
    _, msg = error_of(path)
    assert path in msg and "line" in msg and "column" in msg


def test_missing_and_empty_config(tmp_path):
    _, msg = error_of(str(tmp_path / "nope.yaml"))
    assert "nope.yaml" in msg and "not found" in msg
    _, msg = error_of(write(tmp_path, ""))
    assert "empty" in msg


def test_unknown_top_level_key_suggests(cfg_dir):
    err, msg = error_of(write(cfg_dir, BASE + "solvr: {base_lr: 1}\n"))
    assert err.key == "solvr" and "did you mean 'solver'" in msg and "cfg.yaml" in msg


def test_unknown_nested_key_suggests(cfg_dir):
    err, msg = error_of(write(cfg_dir, BASE), overrides=["solver.momentun=0.5"])
    assert err.key == "solver.momentun" and "momentum" in msg


@pytest.mark.parametrize("override, key, expected", [
    ("data.train.batch_size=abc", "data.train.batch_size",
     "expected a positive integer, got 'abc'"),
    ("data.train.batch_size=0", "data.train.batch_size", "positive integer"),
    ("solver.base_lr=fast", "solver.base_lr", "non-negative number"),
    ("solver.momentum=1.5", "solver.momentum", "[0, 1)"),
    ("solver.lr_policy=stepp", "solver.lr_policy", "did you mean 'step'"),
    ("parallel.mode=asynch", "parallel.mode", "sync, async, sync_ps"),
    ("parallel.check_collectives=3", "parallel.check_collectives", "true or false"),
    ("parallel.min_buckets=0", "parallel.min_buckets", "positive integer"),
    ("seed=-1", "seed", "non-negative integer"),
    ("net=5", "net", "list of layers"),
    ("data.train.source=csv", "data.train.source", "hdf5, lmdb, text, synthetic"),
    ("solver.stepvalues=[5, 3]", "solver.stepvalues", "increasing"),
])
def test_wrong_types_name_the_key(cfg_dir, override, key, expected):
    path = write(cfg_dir, BASE)
    err, msg = error_of(path, overrides=[override])
    # the value came from --set, which the message names (not the file)
    assert err.key == key and msg.startswith(f"--set {override}: ") and f"'{key}'" in msg
    assert expected in msg


def test_policy_needs_its_fields(cfg_dir):
    err, msg = error_of(write(cfg_dir, BASE), overrides=["solver.stepsize=null"])
    assert err.key == "solver.stepsize"
    err, _ = error_of(write(cfg_dir, BASE), overrides=["solver.lr_policy=multistep"])
    assert err.key == "solver.stepvalues"


def test_net_entries_are_checked(cfg_dir):
    err, _ = error_of(write(cfg_dir, BASE), overrides=["net.1.name=fc1"])
    assert err.key == "net.1.name"
    path = write(cfg_dir, BASE.replace("name: fc1,", ""))
    err, msg = error_of(path)
    assert err.key == "net.0.name" and "needs a 'name'" in msg


def test_graph_entries_are_checked(cfg_dir):
    path = write(cfg_dir, BASE + "graph:\n  - {type: blb, name: w}\n")
    err, msg = error_of(path)
    assert err.key == "graph.0.type" and "'blob' or 'op'" in msg


@pytest.mark.parametrize("override", ["solver.base_lr", "=3", "solver..base_lr=1",
                                      "net.x.name=a", "net.7.name=a", "name.sub=1"])
def test_bad_override_is_named(cfg_dir, override):
    _, msg = error_of(write(cfg_dir, BASE), overrides=[override])
    assert repr(override) in msg


def test_missing_data_file(cfg_dir):
    path = write(cfg_dir, BASE.replace("tiny.h5", "missing.h5"))
    err, msg = error_of(path)
    assert err.key == "data.train.path" and "missing.h5" in msg and path in msg
    # without the check the path is kept as written
    config = load_config(path, check_files=False)
    assert config["data"]["train"]["path"] == "missing.h5"


def test_data_path_relative_to_cwd_first(cfg_dir, tmp_path_factory, monkeypatch):
    other = tmp_path_factory.mktemp("cwd")
    (other / "tiny.h5").write_bytes((cfg_dir / "tiny.h5").read_bytes())
    monkeypatch.chdir(other)
    config = load_config(write(cfg_dir, BASE))
    assert config["data"]["train"]["path"] == os.path.join(str(other), "tiny.h5")


def test_dump_round_trips(cfg_dir):
    config = load_config(write(cfg_dir, BASE), overrides=["solver.momentum=0.5"])
    text = dump_config(config)
    assert "_path" not in text
    again = load_config(write(cfg_dir, text, name="tiny.yaml"))
    again.pop("_path"), config.pop("_path")
    assert again == config


def test_resolve_config_from_a_dict():
    config = resolve_config({"net": [{"type": "fc", "name": "a"}]}, path="<test>")
    assert config["name"] == "net" and config["_path"] == "<test>"
    with pytest.raises(ConfigError, match="defines no network"):
        resolve_config({"solver": {}}, path="x.yaml")


def test_dump_is_pyyamls_own_text(monkeypatch):
    """dump_config takes libyaml's emitter where PyYAML has it (4x faster;
    a run writes its config three times at start-up): the text is exactly
    what PyYAML's own emitter writes, for every shipped job and for strings
    that need quoting, escapes or folding."""
    import glob
    import yaml
    from purine_mpi.job import config as config_mod
    from tests.conftest import REPO
    if not getattr(yaml, "__with_libyaml__", False):
        pytest.skip("PyYAML without libyaml: dump_config uses its own emitter")
    assert config_mod._DUMPER is yaml.CSafeDumper
    odd = {"name": "naïve: run #1", "note": "x" * 150 + " tail", "seed": 7,
           "list": [1.5e-4, None, True, "yes", "0x10", "", " lead", "multi\nline"]}
    configs = [odd] + [load_config(path, check_files=False)
                       for path in sorted(glob.glob(os.path.join(REPO, "jobs", "*.yaml")))]
    for config in configs:
        fast = dump_config(config)
        monkeypatch.setattr(config_mod, "_DUMPER", yaml.SafeDumper)
        assert fast == dump_config(config)
        monkeypatch.undo()


@pytest.mark.parametrize("section,key", [("solver", "early_stop"), ("checkpoint", "best")])
def test_a_metric_watch_without_test_data_is_refused(cfg_dir, section, key):
    """checkpoint.best (or solver.early_stop) in a job without data.test ran
    to the end, exit 0, with no best file and no stop: no test pass ever
    gives the figure (before the fix: ``pytest.raises`` failed, DID NOT RAISE)."""
    text = BASE.replace("  test:  {source: hdf5, path: tiny.h5, split: test, batch_size: 5}\n",
                        "") + f"{section}:\n  {key}: {{metric: accuracy}}\n"
    if section == "solver":
        text = text.replace("solver: {base_lr: 0.1, lr_policy: step, stepsize: 100, "
                            "max_iter: 200}\n", "").replace(
            "solver:\n", "solver:\n  base_lr: 0.1\n  lr_policy: step\n  stepsize: 100\n")
    err, text = error_of(write(cfg_dir, text))
    assert err.key == f"{section}.{key}" and "no data.test" in text
    assert "'accuracy'" in text


def test_a_data_path_that_is_a_device_is_not_reported_missing(cfg_dir):
    """``path: /dev/null`` said 'not found (looked for '/dev/null')', which
    exists (before the fix: ``assert 'not a regular file' in text`` failed)."""
    err, text = error_of(write(cfg_dir, BASE.replace("path: tiny.h5, split: train",
                                                     "path: /dev/null, split: train")))
    assert err.key == "data.train.path" and "not a regular file" in text
    assert "not found" not in text
