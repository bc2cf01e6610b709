"""Issue 42, defect 6: every numeric key of every layer declares its range
(``Key.range``, or the kind's own for ``posint``/``nonneg``), the config
reader refuses a value outside it (exit 2 naming the file, the layer, the
key and the range), and docs/config.md shows it. The cases are derived from
the declarations and cross-checked against a hand-written list, so that a
range dropped or widened in a declaration fails here too."""
import math
import os

import pytest

from purine_mpi.base.errors import ConfigError
from purine_mpi.job.config import resolve_config
from purine_mpi.layers import LAYER_SPECS, Key, Range, layer
from purine_mpi.layers.registry import FILLER_RANGES, NUMERIC_KINDS, PARAM_RANGE

from .conftest import REPO, run_cli_args, run_cli_here, write_config_file
from .test_cli import assert_user_error

#: good values of the required keys (the probe layer must pass but for the key under test)
REQUIRED_OK = {"num_output": 2, "kernel": 1, "shape": [0, -1], "input_dim": 4,
               "max_length": 4, "num_heads": 1}


def _config(layer_cfg):
    return {"data": {"train": {"source": "synthetic", "shape": [2, 4, 4], "classes": 2,
                               "batch_size": 2}},
            "net": [{"type": "relu", "name": "r", "bottom": "data"}, layer_cfg]}


def _probe(ltype, **keys):
    spec = LAYER_SPECS[ltype]
    cfg = {"type": ltype, "name": "probe", "bottom": "r"}
    cfg.update({k.name: REQUIRED_OK[k.name] for k in spec.keys
                if k.name in REQUIRED_OK and type(k.default).__name__ == "Required"})
    cfg.update(keys)
    return cfg


def _outside(key):
    """Values just outside the declared range of ``key`` (each element of a
    pair or list), and a non-finite one for a number."""
    r = key.value_range
    out = []
    if r.lo is not None:
        out.append(r.lo if r.lo_open else r.lo - 1)
    if r.hi is not None:
        out.append(r.hi if r.hi_open else r.hi + 1)
    if key.kind in ("number", "numbers"):
        out.append(math.inf)
    if not out:  # an integer only the shapes bound (an axis): not an integer
        out.append(1.5)
    if key.kind == "pair":
        return out + [[1, v] for v in out]
    if key.kind in ("ints", "numbers"):
        return [[v] for v in out]
    return out


NUMERIC = [(ltype, key) for ltype, spec in sorted(LAYER_SPECS.items()) for key in spec.keys
           if key.kind in NUMERIC_KINDS]
CASES = [(ltype, key.name, bad) for ltype, key in NUMERIC for bad in _outside(key)]


def test_every_numeric_layer_key_declares_its_range():
    missing = [(t, k.name) for t, k in NUMERIC if k.value_range is None]
    assert not missing
    assert len(NUMERIC) >= 35  # every layer type's numeric keys, not a handful


@pytest.mark.parametrize("ltype, name, bad", CASES, ids=[f"{t}.{k}={b}" for t, k, b in CASES])
def test_out_of_range_value_is_refused_when_the_config_is_read(ltype, name, bad):
    key = LAYER_SPECS[ltype].key(name)
    with pytest.raises(ConfigError) as info:
        resolve_config(_config(_probe(ltype, **{name: bad})), path="cfg.yaml")
    msg = str(info.value)
    assert info.value.exit_code == 2
    assert info.value.key == f"net[1].{name}", msg
    assert "cfg.yaml" in msg and "layer 'probe'" in msg, msg
    r = key.value_range
    if r.lo is not None or r.hi is not None:
        assert r.text in msg, msg  # the expected range


@pytest.mark.parametrize("ltype, name", [(t, k.name) for t, k in NUMERIC],
                         ids=[f"{t}.{k.name}" for t, k in NUMERIC])
def test_values_inside_the_range_still_load(ltype, name):
    """The range's own bounds, where closed, load (no range is narrower than
    declared)."""
    key = LAYER_SPECS[ltype].key(name)
    r = key.value_range
    inside = [v for v, open_ in ((r.lo, r.lo_open), (r.hi, r.hi_open))
              if v is not None and not open_] or [1]
    for v in inside:
        value = [v] if key.kind in ("ints", "numbers") else v
        if name == "slice_point" or (name == "shape" and v == -1):
            value = [1] if name == "slice_point" else [-1]
        resolve_config(_config(_probe(ltype, **{name: value})), path="cfg.yaml")


# Independent of the declarations: what each of these keys must accept and refuse.
HAND = [
    ("layer_norm", "eps", "> 0", [1e-12], [0, -1, -1e-5]),
    ("batch_norm", "eps", "> 0", [1e-5], [0.0, -1]),
    ("batch_norm", "momentum", "in [0, 1]", [0, 1], [-0.1, 1.5]),
    ("dropout", "ratio", "in [0, 1)", [0, 0.99], [1, 1.0, -0.5]),
    ("dropout", "dropout_ratio", "in [0, 1)", [0.5], [1.0]),
    ("attention", "attn_dropout", "in [0, 1)", [0.0], [1.0, -0.1]),
    ("attention", "resid_dropout", "in [0, 1)", [0.1], [2]),
    ("attention", "num_heads", "> 0", [1], [0, -2]),
    ("conv", "num_output", "> 0", [1], [0]),
    ("conv", "kernel", ">= 1", [1, [1, 3]], [0, [3, 0]]),
    ("conv", "stride", ">= 1", [2], [0, [1, 0]]),
    ("conv", "pad", ">= 0", [0, [0, 1]], [-1, [0, -1]]),
    ("conv", "dilation", ">= 1", [1], [0]),
    ("pool", "stride", ">= 1", [1], [0]),
    ("lrn", "k", "> 0", [0.5], [0, -1]),
    ("lrn", "alpha", ">= 0", [0], [-1e-4]),
    ("softmax_loss", "loss_weight", ">= 0", [0, 2.5], [-1]),
    ("embedding", "input_dim", "> 0", [4], [0]),
    ("position_embedding", "max_length", "> 0", [4], [0]),
]


@pytest.mark.parametrize("ltype, name, text, good, bad", HAND,
                         ids=[f"{h[0]}.{h[1]}" for h in HAND])
def test_hand_written_ranges(ltype, name, text, good, bad):
    key = LAYER_SPECS[ltype].key(name)
    assert text in key.type_doc
    for v in good:
        resolve_config(_config(_probe(ltype, **{name: v})), path="cfg.yaml")
    for v in bad:
        with pytest.raises(ConfigError) as info:
            resolve_config(_config(_probe(ltype, **{name: v})), path="cfg.yaml")
        assert f"net[1].{name}'" in str(info.value) and text in str(info.value), v


def test_a_numeric_key_without_a_range_is_refused_at_registration():
    with pytest.raises(ValueError, match="declares no range"):
        layer("t5_no_range", keys=(Key("scale", "number", 1.0, "factor"),))(lambda b: None)
    assert "t5_no_range" not in LAYER_SPECS
    ok = layer("t5_with_range", keys=(Key("scale", "number", 1.0, "factor", Range(0)),))
    try:
        ok(lambda b: None)
        with pytest.raises(ConfigError, match=">= 0"):
            resolve_config(_config({"type": "t5_with_range", "name": "probe", "bottom": "r",
                                    "scale": -1}), path="cfg.yaml")
    finally:
        from purine_mpi.layers import LAYERS
        LAYER_SPECS.pop("t5_with_range", None)
        LAYERS.pop("t5_with_range", None)


@pytest.mark.parametrize("where, value, needles", [
    ("weight_filler", {"type": "gaussian", "std": -0.1}, ["net[1].weight_filler.std", ">= 0"]),
    ("weight_filler", {"type": "uniform", "min": 1, "max": -1},
     ["net[1].weight_filler.max", "min <= max"]),
    ("weight_filler", {"type": "constant", "value": math.nan}, ["weight_filler.value",
                                                                "finite"]),
    ("param", [{"lr_mult": -1}], ["net[1].param[0].lr_mult", ">= 0"]),
])
def test_filler_and_param_numbers_have_ranges(where, value, needles):
    assert FILLER_RANGES["std"].text == ">= 0" and PARAM_RANGE.text == ">= 0"
    with pytest.raises(ConfigError) as info:
        resolve_config(_config(_probe("conv", **{where: value})), path="cfg.yaml")
    for n in needles:
        assert n in str(info.value), str(info.value)


def test_layer_norm_negative_eps_exits_2_before_training(tmp_path):
    """The issue's case: it trained and 'diverged' at iteration 1 (exit 3,
    advice to lower the learning rate)."""
    cfg = {"data": {"train": {"source": "synthetic", "shape": [4, 6], "classes": 4,
                              "batch_size": 2}},
           "net": [{"type": "layer_norm", "name": "ln", "bottom": "data", "eps": -1},
                   {"type": "fc", "name": "head", "bottom": "ln", "num_output": 4},
                   {"type": "softmax_loss", "name": "loss", "bottom": ["head", "label"]}]}
    res = run_cli_here("train", write_config_file(tmp_path, cfg), "--out", tmp_path / "r",
                       "--iters", "2")
    text = assert_user_error(res, "cfg.yaml", "net[0].eps", "layer 'ln'", "> 0", "got -1")
    assert len(text.splitlines()) == 1 and "diverged" not in text
    assert not os.path.exists(tmp_path / "r")


def test_docs_show_every_layer_keys_range():
    with open(os.path.join(REPO, "docs", "config.md"), encoding="utf-8") as f:
        text = f.read()
    for ltype, key in NUMERIC:
        section = text.split(f"#### {ltype}\n", 1)[1].split("\n#### ", 1)[0]
        assert f"| `{key.name}` | {key.type_doc} |" in section, (ltype, key.name)
    assert "| `eps` | number > 0 |" in text.split("#### layer_norm\n", 1)[1]
