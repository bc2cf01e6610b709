"""Layer keys are declared and checked: an unknown key in a layer (or in its
filler or ``param``), or a top-level key starting with ``_``, exits 2 with
one message naming the file, the layer and the key; every declared key is
read by its layer; every key the shipped jobs and the Caffe converter write
is declared."""
import copy
import glob
import os

import pytest
import yaml

import purine_mpi.layers as layers
from purine_mpi.interop.caffe_convert import convert
from purine_mpi.job.config import resolve_config
from purine_mpi.job.job import job_of
from purine_mpi.layers import COMMON_KEYS, LAYER_SPECS, LAYERS
from purine_mpi.job.replica import forward_graph

from .conftest import (REPO, make_job, run_cli_args, run_cli_here, small_net_config,
                       write_config_file)
from .test_caffe_convert import fixture, random_h5
from .test_cli import assert_user_error


@pytest.fixture(scope="module")
def base(digits_h5, tmp_path_factory):
    return {"dir": tmp_path_factory.mktemp("layer_keys"), "cfg": small_net_config(digits_h5)}


def _variant(base, name, mutate):
    cfg = copy.deepcopy(base["cfg"])
    mutate(cfg)
    return write_config_file(base["dir"], cfg, name)


# ------------------------------------------------------------ via the CLI
def test_typo_on_pool_exits_2_with_did_you_mean(base):
    def mutate(cfg):
        cfg["net"][2]["stide"] = 2
        del cfg["net"][2]["stride"]
    path = _variant(base, "stide.yaml", mutate)
    text = assert_user_error(run_cli_here("train", path, "--iters", "1"), "stide.yaml",
                             "net[2].stide", "pool1", "unknown key 'stide'")
    assert "did you mean 'stride'?" in text
    assert not os.path.exists(os.path.join(REPO, "runs", "tiny", "stide"))


def test_unknown_key_on_conv_exits_2(base):
    def mutate(cfg):
        cfg["net"][0]["foo"] = 3
    text = assert_user_error(run_cli_here("graph", _variant(base, "foo.yaml", mutate)),
                             "foo.yaml", "net[0].foo", "conv1", "unknown key 'foo'")
    assert "num_output" in text  # the valid keys are listed


def test_underscore_top_level_key_exits_2(base):
    def mutate(cfg):
        cfg["_foo"] = {"x": 1}
    text = assert_user_error(run_cli_here("train", _variant(base, "underscore.yaml", mutate)),
                             "underscore.yaml", "key '_foo'", "'_'")
    assert "valid keys: name" in text


@pytest.mark.parametrize("where, mutate, needles", [
    ("filler", lambda cfg: cfg["net"][0].update(weight_filler={"type": "gaussian",
                                                               "sdt": 0.1}),
     ["net[0].weight_filler.sdt", "conv1", "did you mean 'std'?"]),
    ("param", lambda cfg: cfg["net"][3].update(param=[{"lr_mul": 1.0}]),
     ["net[3].param[0].lr_mul", "fc1", "did you mean 'lr_mult'?"]),
    ("phase-layer", lambda cfg: cfg["net"][5].update(topk=2),
     ["net[5].topk", "acc", "did you mean 'top_k'?"]),
    ("key-on-wrong-type", lambda cfg: cfg["net"][1].update(num_output=3),
     ["net[1].num_output", "relu1", "(relu)"]),
])
def test_unknown_keys_anywhere_in_a_layer(base, where, mutate, needles):
    path = _variant(base, f"bad_{where}.yaml", mutate)
    assert_user_error(run_cli_here("graph", path), f"bad_{where}.yaml", *needles)


def test_load_time_check_covers_both_phases(base, tmp_path):
    """The accuracy layer is test-only, yet its typo fails at load time,
    before any graph of either phase is built (resolve_config)."""
    cfg = copy.deepcopy(base["cfg"])
    cfg["net"][5]["top_kk"] = 1
    with pytest.raises(Exception) as info:
        resolve_config(cfg, path="x.yaml")
    assert "net[5].top_kk" in str(info.value) and "did you mean 'top_k'" in str(info.value)


def test_flatten_axis_is_applied(base):
    """flatten's ``axis`` (which the Caffe converter writes) is declared and
    reaches the op: it used to be ignored."""
    cfg = resolve_config({
        "data": {"train": {"source": "synthetic", "shape": [2, 3, 4], "classes": 2,
                           "batch_size": 5}},
        "net": [{"type": "flatten", "name": "f", "bottom": "data", "axis": 2}]})
    job = make_job(cfg)
    g = forward_graph(job, "train", job.data.train)
    assert tuple(g.blobs["f"].shape) == (5, 2, 12)


# ------------------------------------------------- declared == consumed
def _probe_net(ltype):
    """A net in which layer ``ltype`` (named 'probe') builds."""
    data = {"type": "conv", "name": "c", "bottom": "data", "num_output": 4, "kernel": 1}
    probe = {"type": ltype, "name": "probe", "bottom": "c"}
    if ltype in ("softmax_loss", "accuracy"):
        probe["bottom"] = ["scores", "label"]
        return [data, {"type": "global_pool", "name": "gp", "bottom": "c"},
                {"type": "flatten", "name": "scores", "bottom": "gp"}, probe]
    if ltype in ("position_embedding", "attention"):  # an (N, T, C) bottom
        probe.update(bottom="seq", **({"max_length": 4} if ltype == "position_embedding"
                                      else {"num_heads": 2}))
        return [data, {"type": "reshape", "name": "seq", "bottom": "c", "shape": [0, 4, -1]},
                probe]
    extra = {"conv": {"num_output": 2, "kernel": 1}, "fc": {"num_output": 3},
             "embedding": {"bottom": "label", "input_dim": 4, "num_output": 3},
             "pool": {"kernel": 2}, "reshape": {"shape": [0, -1]},
             "eltwise": {"bottom": ["c", "c"]}, "concat": {"bottom": ["c", "c"]},
             "slice": {"top": ["s1", "s2"]}, "split": {"top": ["s1", "s2"]}}
    probe.update(extra.get(ltype, {}))
    return [data, probe]


class _Recording(dict):
    """A layer mapping that records every key asked about while ``on``."""

    def __init__(self, *args, seen, state):
        super().__init__(*args)
        self.seen, self.state = seen, state

    def _note(self, k):
        if self.state["on"]:
            self.seen.add(k)

    def __contains__(self, k):
        self._note(k)
        return super().__contains__(k)

    def __getitem__(self, k):
        self._note(k)
        return super().__getitem__(k)

    def get(self, k, default=None):
        self._note(k)
        return super().get(k, default)


@pytest.mark.parametrize("ltype", sorted(LAYER_SPECS))
def test_every_declared_key_is_read_by_its_layer(ltype, monkeypatch):
    """Build the layer in both phases with only its required keys, and
    record which keys the builder asks for, given or not (the key check
    itself, which reads every key, is left out): it must be exactly the
    declared keys, so no declaration documents a key that does nothing
    (as flatten's axis once did) and no key is read undeclared."""
    seen, state = set(), {"on": True}
    real_check = layers.check_layer

    def check_layer(*args):
        state["on"] = False
        try:
            return real_check(*args)
        finally:
            state["on"] = True
    monkeypatch.setattr(layers, "check_layer", check_layer)
    for phase in ("train", "test"):
        cfg = resolve_config({
            "data": {"train": {"source": "synthetic", "shape": [3, 4, 4], "classes": 4,
                               "batch_size": 2}},
            "net": _probe_net(ltype)}, check_files=False)
        # the layers read the job's net entries (job/job.py): instrument those
        job = job_of(cfg)
        job = job.replace(net=tuple(_Recording(e, seen=seen, state=state)
                                    if e["name"] == "probe" else e for e in job.net))
        forward_graph(job, phase, job.data.train)
    declared = {k.name for k in LAYER_SPECS[ltype].all_keys()}
    assert declared - seen == set(), f"{ltype}: declared but never read: {declared - seen}"
    assert seen - declared == set(), f"{ltype}: read but not declared: {seen - declared}"


def test_every_registered_name_has_a_spec():
    for name, fn in LAYERS.items():
        assert fn.spec.type in LAYER_SPECS and (name == fn.spec.type or name in fn.spec.aliases)
        assert fn.spec.doc, name
        for key in fn.spec.all_keys():
            assert key.meaning and key.kind in layers.KIND_DOC or isinstance(key.kind, tuple), \
                (name, key)
    assert [k.name for k in COMMON_KEYS] == ["type", "name", "bottom", "top", "phase", "thread"]


# ------------------------------- declared >= what jobs and converter write
def _undeclared(net):
    bad = []
    for i, entry in enumerate(net):
        spec = layers.layer_spec(entry["type"])
        assert spec is not None, entry
        bad += [(i, entry["name"], k) for k in entry if spec.key(k) is None]
    return bad


@pytest.mark.parametrize("job", sorted(glob.glob(os.path.join(REPO, "jobs", "*.yaml"))),
                         ids=os.path.basename)
def test_shipped_jobs_use_declared_keys_only(job):
    with open(job) as f:
        raw = yaml.safe_load(f)
    assert raw.get("net"), job
    from purine_mpi.job.repeat import expand_net
    assert _undeclared(expand_net(raw["net"], job)[0]) == []  # a repeat's blocks, expanded
    resolve_config(raw, path=job, check_files=False)


@pytest.mark.parametrize("prototxt", ["all_layers.prototxt", "googlenet_mini.prototxt",
                                      "lenet_digits.prototxt", "v1_layers.prototxt"])
def test_converter_output_uses_declared_keys_only(prototxt, tmp_path):
    data = random_h5(tmp_path / "d.h5", (3, 12, 12), 4) if prototxt == "all_layers.prototxt" \
        else str(tmp_path / "absent.h5")  # data layers need a path; no file: no build
    config, _ = convert(fixture(prototxt), data_path=data)
    assert _undeclared(config["net"]) == []
    resolve_config(config, path="converted.yaml", check_files=False)


# ------------------------------------------- param entries the layer lacks
def _synthetic(*net):
    return {"data": {"train": {"source": "synthetic", "shape": [3, 4, 4], "classes": 4,
                               "batch_size": 2}}, "net": list(net)}


def _fc(**keys):
    return dict({"type": "fc", "name": "fc1", "bottom": "data", "num_output": 4}, **keys)


def _refused(cfg):
    with pytest.raises(Exception) as info:
        resolve_config(cfg, path="x.yaml", check_files=False)
    return str(info.value)


@pytest.mark.parametrize("entry, needles", [
    # more entries than the type has: Caffe's "Too many params specified"
    (_fc(param=[{}, {}, {"lr_mult": 0}]),
     ["net[0].param", "layer 'fc1' (fc): 3 entries", "has 2 parameters: weight, bias"]),
    ({"type": "batch_norm", "name": "bn", "bottom": "data",
      "param": [{}, {}, {"lr_mult": 0}]},
     ["net[0].param", "3 entries", "2 parameters: weight, bias"]),
    ({"type": "attention", "name": "at", "bottom": "data", "num_heads": 1,
      "param": [{}] * 5}, ["net[0].param", "4 parameters: qkv_weight, qkv_bias, "
                                            "proj_weight, proj_bias"]),
    # a multiplier for the bias an fc with bias_term: false does not have
    (_fc(bias_term=False, param=[{}, {"lr_mult": 0}]),
     ["net[0].param[1]", "lr_mult: 0 for parameter 'bias'", "bias_term is false"]),
    ({"type": "attention", "name": "at", "bottom": "data", "num_heads": 1,
      "bias_term": False, "param": [{}, {}, {}, {"decay_mult": 0}]},
     ["net[0].param[3]", "decay_mult: 0 for parameter 'proj_bias'", "bias_term is false"]),
])
def test_param_entries_for_parameters_the_layer_lacks_are_refused(entry, needles):
    """A `param` entry for a parameter the layer has not was ignored: a
    misplaced `lr_mult: 0` froze nothing, silently (before: DID NOT
    RAISE)."""
    text = _refused(_synthetic(entry))
    for n in needles:
        assert n in text, text


def test_param_entries_in_a_repeat_block_name_the_block_key():
    block = [{"type": "fc", "name": "fc{i}", "bottom": "data", "num_output": 4,
              "bias_term": False, "param": [{}, {"lr_mult": 0}]}]
    text = _refused(_synthetic({"type": "relu", "name": "r", "bottom": "data"},
                               {"repeat": 2, "block": block}))
    assert "net.1.block.0.param[1]" in text and "layer 'fc0' (fc)" in text, text


@pytest.mark.parametrize("entry", [
    _fc(bias_term=False, param=[{"lr_mult": 0}, {}]),                    # a placeholder
    _fc(bias_term=False, param=[{}, {"lr_mult": 1, "decay_mult": 1.0}]),  # the defaults
    _fc(param=[{}, {"lr_mult": 0}]),
    {"type": "attention", "name": "at", "bottom": "data", "num_heads": 1, "bias_term": False,
     "param": [{"decay_mult": 0}, {}, {"lr_mult": 2}, {}]},
])
def test_param_placeholders_for_absent_parameters_are_accepted(entry):
    resolve_config(_synthetic(entry), path="x.yaml", check_files=False)


def test_every_shipped_config_with_param_entries_loads():
    """The jobs, benchmarks and test fixtures carry `param` placeholders
    (the GPT configs' bias entries): each still loads."""
    paths = [p for pattern in ("jobs/*.yaml", "benchmarks/*.yaml", "tests/fixtures/**/*.yaml")
             for p in glob.glob(os.path.join(REPO, pattern), recursive=True)]
    with_param = [p for p in paths if "param:" in open(p).read()]
    assert len(with_param) >= 8, with_param
    for p in with_param:
        with open(p) as f:
            cfg = yaml.safe_load(f)
        if isinstance(cfg, dict) and "net" in cfg:
            resolve_config(cfg, path=p, check_files=False)


def test_train_refuses_too_many_param_entries_in_one_line(base):
    def mutate(cfg):
        cfg["net"][3]["param"] = [{}, {}, {"lr_mult": 0}]
    res = run_cli_here("train", _variant(base, "param3.yaml", mutate), "--iters", "1")
    text = assert_user_error(res, "param3.yaml", "net[3].param", "layer 'fc1' (fc)",
                             "2 parameters: weight, bias")
    assert len(text.splitlines()) == 1, text


def test_a_params_key_declares_its_parameters():
    """A layer's `param` key names its parameters (``slots``), so that the
    check above knows them; a custom layer's without is refused at
    registration, as a numeric key without a range."""
    with pytest.raises(ValueError, match="declares no parameters"):
        layers.layer("no_slots_probe", keys=(layers.Key("param", "params", [], "x"),))(
            lambda b: None)
    with pytest.raises(ValueError, match="not a bool key"):
        layers.layer("bad_switch_probe", keys=(layers.Key(
            "param", "params", [], "x", slots=(layers.Slot("w", "bias_term"),)),))(
            lambda b: None)
    assert "no_slots_probe" not in LAYERS and "bad_switch_probe" not in LAYERS
