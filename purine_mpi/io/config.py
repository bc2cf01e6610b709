"""Config YAML: loading, ``--set`` overrides, validation and defaults.

``load_config(path)`` returns the *resolved* config: every section present,
every default filled in, data paths resolved, plus ``config["_path"]`` (the
file it came from). Every problem is a ``ConfigError(path, key, message)``
naming the file, the dotted key and what was expected, e.g.::

    jobs/lenet.yaml: key 'solver.base_lr': expected a positive number, got 'abc'

The schema lives in this module's tables: TOP_DOC (top-level keys), the
sections' defaults (SOLVER_DEFAULTS, PARALLEL_DEFAULTS, CHECKPOINT_DEFAULTS)
with their checkers and KEY_DOCS meanings, DATA_DOC (data specs), and the
choices (SOLVER_TYPES, LR_POLICIES, PARALLEL_SCHEMES, PARALLEL_MODES, ...)
with CHOICE_DOCS. The layers' keys are declared in purine_mpi/layers.
docs/config.md is generated from all of these.

To add a key, add its default to the section's defaults table, a checker to
the section's validator table and a one-line meaning to KEY_DOCS; unknown
keys are errors (with a "did you mean" suggestion) so that typos never pass
silently. AFTER CHANGING KEYS RUN ``python -m purine_mpi.docgen --write``
(tests/test_docs.py fails while docs/config.md is stale or a key has no
meaning).
"""
import copy
import difflib
import math
import os

import yaml

from ..errors import ConfigError

SEED_LIMIT = 2 ** 63  # seeds are stored as 64-bit integers (checkpoints, HDF5)


class _Loader(yaml.SafeLoader):
    """Safe YAML that reads ``1e-3`` and ``5E8`` (YAML 1.2 floats without a
    dot) as numbers, as every other YAML reader does: a string where a number
    is expected is then always a quoted one, and refused."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    __import__("re").compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))
from ..layers import check_layer
from .transform import TRANSFORM_KEYS

# The schema. docs/config.md is generated from these tables (and from the
# layer registry, purine_mpi/layers): after changing keys run
#     python -m purine_mpi.docgen --write
TOP_KEYS = ("name", "data", "net", "graph", "solver", "parallel", "checkpoint", "seed",
            "backend", "device", "tf32", "cuda_graph", "memory_plan")
LR_POLICIES = ("fixed", "step", "multistep", "poly", "exp", "inv", "cosine")
SOLVER_TYPES = ("sgd", "nesterov", "adagrad", "rmsprop", "adadelta", "adam", "adamw")
PARALLEL_SCHEMES = ("data", "none", "pipeline", "hybrid")
PARALLEL_MODES = ("sync", "async", "sync_ps")
PIPELINE_SCHEDULES = ("1f1b", "gpipe")
BACKENDS = ("auto", "numpy", "cupy")
DATA_SOURCES = ("hdf5", "synthetic")

SOLVER_DEFAULTS = {
    "type": "sgd", "base_lr": 0.01, "momentum": 0.9, "weight_decay": 0.0,
    "lr_policy": "fixed", "gamma": 0.1, "stepsize": None, "stepvalues": [],
    "power": 1.0, "max_iter": 1000, "test_interval": 0, "test_iter": None,
    "display": 20, "warmup_iters": 0, "momentum2": 0.999, "delta": 1e-8, "rms_decay": 0.99,
    "test_initialization": False, "early_stop": None,
}
PARALLEL_DEFAULTS = {
    "scheme": "data", "mode": "sync", "bucket_mb": 4, "first_bucket_mb": 1, "min_buckets": 4,
    "split_params": True, "defer_update": True, "ps_ranks": 1, "max_staleness": 0,
    "stall_timeout": 300, "check_collectives": False,
    "stages": {}, "micro_batches": 1, "schedule": "1f1b",
}
CHECKPOINT_DEFAULTS = {"interval": 0, "keep": 3, "best": None}
DATA_KEYS = ("source", "path", "split", "batch_size", "shuffle", "in_memory", "shape", "classes",
             "num_samples", "seed") + TRANSFORM_KEYS
SYNTHETIC_NUM_SAMPLES = 1024

#: top-level key -> (type, default, meaning)
TOP_DOC = {
    "name": ("string", "the file's stem", "names the run: its output goes to `runs/<name>/<N>`"),
    "seed": ("integer in [0, 2^63)", 0, "seeds the initial weights, the data order, the random crops "
             "and flips, and dropout"),
    "data": ("mapping", {}, "`train:` and `test:` data specs (see [data](#data))"),
    "net": ("list", "—", "the layers, in order (see [net](#net)); give `net` or `graph`"),
    "graph": ("list", "—", "instead of `net`: the low-level list of blob and op entries (see "
              "[graph](#graph))"),
    "solver": ("mapping", {}, "the optimiser and the learning-rate schedule (see "
               "[solver](#solver))"),
    "parallel": ("mapping", {}, "how the ranks share the work (see [parallel](#parallel))"),
    "checkpoint": ("mapping", {}, "how often to write checkpoints and how many to keep (see "
                   "[checkpoint](#checkpoint))"),
    "device": ("integer >= -1", -1, "-1: the CPU; D >= 0: GPU D + the rank's index on its node "
               "(modulo the node's GPUs); needs CuPy"),
    "backend": ("one of auto, numpy, cupy", "`auto`", "the array library: `numpy` forbids a "
                "device, `cupy` without a device means device 0"),
    "tf32": ("true/false", False, "GPU float32 GEMMs may use TensorFloat-32 (faster, about "
             "1e-3 relative error)"),
    "cuda_graph": ("true/false", True, "on a GPU, replay each iteration as captured CUDA "
                   "graphs (the runs of GPU ops between host and communication ops); `false`: "
                   "eager stream dispatch, for debugging (per-op trace events); ignored on a "
                   "CPU"),
    "memory_plan": ("true/false", True, "plan the host memory from the static graph: blobs "
                    "written and read within one iteration share one arena wherever the graph "
                    "orders their lifetimes apart (`graph --memory` prints the plan); "
                    "parameters, solver state, losses, metrics and what runs on into the next "
                    "iteration keep their own memory; `false`: one buffer per blob, for "
                    "debugging (the results are bit-identical)"),
}

#: section -> {key: meaning}, for every key of the section's defaults table
KEY_DOCS = {
    "solver": {
        "type": "the update rule (see [solver types](#solver-types))",
        "base_lr": "the base learning rate",
        "momentum": "momentum (sgd, nesterov); β₁ of adam/adamw; ρ of adadelta; adagrad and "
                    "rmsprop take none (a nonzero value is an error)",
        "weight_decay": "L2 regularisation, times each parameter's decay_mult (adamw: "
                        "decoupled decay)",
        "lr_policy": "the learning-rate schedule (see [lr policies](#lr-policies))",
        "gamma": "factor of step, multistep, exp and inv",
        "stepsize": "iterations per step (lr_policy step)",
        "stepvalues": "increasing iterations at which multistep multiplies by gamma",
        "power": "exponent of poly and inv",
        "max_iter": "iterations to train (`--iters` overrides); also the horizon of poly "
                    "and cosine",
        "test_interval": "evaluate on data.test every this many iterations (0: only at the "
                         "end)",
        "test_iter": "test batches per evaluation (null: enough to cover the test split once)",
        "display": "log the mean training loss every this many iterations (0: never)",
        "warmup_iters": "multiply the rate by a linear ramp (it + 1) / W over the first W "
                        "iterations",
        "momentum2": "β₂ of adam and adamw",
        "delta": "ε of adagrad, rmsprop, adadelta, adam and adamw",
        "rms_decay": "decay of the squared-gradient average of rmsprop",
        "test_initialization": "run a test pass before the first iteration (as Caffe's "
                               "`test_initialization`, Lightning's sanity check); it is row "
                               "`iter` = the start iteration of metrics.jsonl",
        "early_stop": "stop (with a checkpoint, exit 0) when the test figure `metric` "
                      "(`accuracy`, `loss`, ...) has not improved by more than `min_delta` "
                      "(default 0) in `patience` test passes in a row (default 5); `mode` "
                      "`max` or `min` (default: min for a loss, else max)",
    },
    "parallel": {
        "scheme": "the composition (see [schemes](#schemes))",
        "mode": "with scheme data on several ranks: allreduce or parameter servers (see "
                "[modes](#modes)); pipeline and hybrid run sync only",
        "bucket_mb": "largest gradient bucket, in MiB (sync data parallelism)",
        "first_bucket_mb": "largest first bucket, in MiB (it is also at most half the others)",
        "min_buckets": "at least this many buckets when the model has that many parameter "
                       "blobs, so a small model still overlaps",
        "split_params": "split a fully connected weight whose gradient is over 1 MiB and "
                        "over twice the bucket size into row chunks, each reduced and "
                        "updated on its own, so its allreduce starts with its first rows "
                        "(sync data parallelism; the same result up to float rounding)",
        "defer_update": "let the last buckets' allreduce and the weight updates behind "
                        "them finish while the next iteration's forward runs; each op of "
                        "the next iteration waits only for the updates of what it reads "
                        "(sync data parallelism on the CPU; the same result, bit for bit)",
        "ps_ranks": "parameter-server modes: the last K ranks are servers",
        "max_staleness": "mode async: how many updates a worker's weights may lag (0: "
                         "synchronous SGD)",
        "stall_timeout": "seconds a collective or transfer may wait before the job ends with "
                         "a message naming it",
        "check_collectives": "verify at start-up that every rank posts the same sequence of "
                             "collectives",
        "stages": "schemes pipeline and hybrid: {layer name: stage}, every layer, stages "
                  "0..S-1",
        "micro_batches": "split each rank's batch into M micro-batches (divides "
                         "data.train.batch_size); pipeline stages overlap them, scheme data "
                         "accumulates gradients",
        "schedule": "order of the micro-batches on a stage: 1f1b (one forward, one backward; "
                    "stage s of p allocates min(p-s, M) micro-batches' activations) or gpipe "
                    "(all forwards, then all backwards; all M)",
    },
    "checkpoint": {
        "interval": "write `ckpt_<iter>.h5` every this many iterations (0: only at the end and "
                    "on a stop)",
        "keep": "keep the newest K checkpoints of this run (0: keep all); `latest.h5` is never "
                "deleted",
        "best": "also keep `best_<iter>.h5` for the `keep` best test passes (default 1) by the "
                "test figure `metric` (`accuracy`, `loss`, ...), `mode` `max` or `min` "
                "(default: min for a loss, else max); rotation of the newest checkpoints "
                "never deletes them",
    },
}

#: data spec key -> (type, default, meaning); every key of DATA_KEYS
DATA_DOC = {
    "source": ("one of hdf5, synthetic", "hdf5 with a path, synthetic with a shape",
               "where the samples come from"),
    "path": ("string", "—", "hdf5: the data file, relative to the working directory or to the "
             "config's folder"),
    "split": ("string or null", "`null` (hdf5), the phase (synthetic)",
              "hdf5: the group holding data and label (null: the file's top level)"),
    "batch_size": ("integer > 0", "required", "samples per rank per iteration (the global "
                   "batch is ranks × batch_size)"),
    "shuffle": ("true/false", "`true` for train, `false` for test", "a new permutation each epoch, "
                "from the seed and the epoch"),
    "in_memory": ("auto, true or false", "`auto`", "hdf5: load the split (true), read each "
                  "batch from the file (false), or load it when its float32 size fits a "
                  "quarter of the memory (auto)"),
    "shape": ("list of integers", "—", "synthetic: one sample's shape [C, H, W]"),
    "classes": ("integer > 0", "—", "synthetic: the number of classes"),
    "num_samples": ("integer > 0", SYNTHETIC_NUM_SAMPLES, "synthetic: samples in the split"),
    "seed": ("integer in [0, 2^63)", "the config's seed", "seed of the shuffle and of synthetic data"),
    "scale": ("number > 0", "—", "transform: multiply, after the mean is subtracted"),
    "mean": ("number or list", "—", "transform: subtract (one value, or one per channel)"),
    "mirror": ("true/false", False, "transform: random horizontal flip, training only"),
    "crop_size": ("integer > 0", "—", "transform: a square window, random in training, "
                  "centred in testing"),
}

#: choice list -> {value: meaning}, for every value a key accepts
CHOICE_DOCS = {
    "lr_policy": {
        "fixed": "base_lr",
        "step": "base_lr · gamma ^ floor(iter / stepsize)",
        "multistep": "base_lr · gamma ^ (number of stepvalues <= iter)",
        "exp": "base_lr · gamma ^ iter",
        "inv": "base_lr · (1 + gamma · iter) ^ (−power)",
        "poly": "base_lr · (1 − iter / max_iter) ^ power",
        "cosine": "base_lr · (1 + cos(π · iter / max_iter)) / 2",
    },
    "solver_type": {
        "sgd": "v = momentum·v + rate·g; w −= v (Caffe's SGD)",
        "nesterov": "v' = momentum·v + rate·g; w −= (1 + momentum)·v' − momentum·v",
        "adagrad": "h += g²; w −= rate·g / (√h + delta)",
        "rmsprop": "h = rms_decay·h + (1 − rms_decay)·g²; w −= rate·g / (√h + delta)",
        "adadelta": "h = ρ·h + (1 − ρ)·g²; u = g·√(h₂ + delta) / √(h + delta); "
                    "h₂ = ρ·h₂ + (1 − ρ)·u²; w −= rate·u (ρ = momentum)",
        "adam": "m = β₁·m + (1 − β₁)·g; v = β₂·v + (1 − β₂)·g²; w −= rate / (1 − β₁ᵗ) · m / "
                "(√v / √(1 − β₂ᵗ) + delta), t = iter + 1 (β₁ = momentum, β₂ = momentum2)",
        "adamw": "w ×= 1 − rate·weight_decay·decay_mult, then adam without the decay in g",
    },
    "scheme": {
        "data": "every rank runs a replica on its shard of the batch; gradients are summed "
                "by allreduce ops in the graph (mode sync) or through parameter servers",
        "none": "no composition: each rank trains its own replica on its shard of the data, "
                "exchanging no gradients (tests, debugging)",
        "pipeline": "layers are placed on ranks by `stages` (one rank per stage); each edge "
                    "between ranks becomes a Send/Recv pair",
        "hybrid": "R replicas × p stages (rank = replica·p + stage): each replica is a "
                  "pipeline on its shard of the batch, and each stage allreduces its "
                  "gradients over the R replicas; the world size is a multiple of p >= 2",
    },
    "mode": {
        "sync": "allreduce of gradient buckets, posted as soon as each is ready",
        "async": "parameter servers; workers push gradients and pull weights without waiting, "
                 "up to max_staleness",
        "sync_ps": "parameter servers that average the workers' gradients each iteration "
                   "(Purine's synchronous variant)",
    },
    "schedule": {
        "1f1b": "after p−s−1 warm-up forwards on stage s of p, one forward then one backward",
        "gpipe": "all forwards, then all backwards",
    },
    "source": {
        "hdf5": "an HDF5 file holding data (N×C×H×W, float or uint8) and label (N integers)",
        "synthetic": "random samples of `shape` with random labels below `classes` (benchmarks)",
    },
    "backend": {
        "auto": "CuPy when device >= 0, else NumPy",
        "numpy": "the CPU",
        "cupy": "the GPU (device 0 unless device is given)",
    },
}
#: the choices CHOICE_DOCS documents
CHOICES = {"lr_policy": LR_POLICIES, "solver_type": SOLVER_TYPES, "scheme": PARALLEL_SCHEMES,
           "mode": PARALLEL_MODES, "schedule": PIPELINE_SCHEDULES, "source": DATA_SOURCES,
           "backend": BACKENDS}


# ------------------------------------------------------------------ loading
def load_config(path, overrides=(), iters=None, check_files=True):
    """Read, override, validate and resolve the config at ``path``.

    ``overrides``: ``"dotted.key=value"`` strings (``--set``); the value is
    parsed as YAML (``0.05``, ``true``, ``[1, 8, 8]``); integer parts index
    lists (``net.0.num_output=8``). ``iters`` overrides ``solver.max_iter``.
    ``check_files``: check at load time that HDF5 data files exist.
    """
    path = str(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(path, None, "config file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(path, None, f"not a YAML text file: byte {e.start} is not UTF-8 "
                                      "(a binary file given as the config?)") from None
    except OSError as e:
        raise ConfigError(path, None, f"cannot read the config file: {e.strerror or e}") from None
    try:
        raw = yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = e.problem or ""
        if e.context:
            start = e.context_mark
            started = (f" (started at line {start.line + 1}, column {start.column + 1})"
                       if start is not None and start is not mark else "")
            what = f"{e.context}{started}: {what}"
        raise ConfigError(path, None, f"malformed YAML at {where}{what}") from None
    except yaml.YAMLError as e:
        raise ConfigError(path, None, f"malformed YAML: {e}") from None
    if raw is None:
        raise ConfigError(path, None, "the config file is empty")
    return resolve_config(raw, path, overrides, iters, check_files)


def resolve_config(raw, path="<config>", overrides=(), iters=None, check_files=True):
    """``load_config`` for an already-parsed mapping (tests, benchmarks)."""
    if not isinstance(raw, dict):
        raise ConfigError(path, None, "expected a mapping of top-level keys "
                                      f"({', '.join(TOP_KEYS)}), got {_kind(raw)}")
    config = copy.deepcopy(raw)
    for text in overrides or ():
        apply_override(config, text, path)
    if iters is not None:
        config.setdefault("solver", {})
        if not isinstance(config["solver"], dict):
            raise ConfigError(path, "solver", f"expected a mapping, got {_kind(config['solver'])}")
        config["solver"]["max_iter"] = _check_int("--iters", iters, path, minimum=0)
    return validate_config(config, path, check_files)


def apply_override(config, text, path="<config>"):
    """Apply one ``KEY=VALUE`` override in place (creating missing mappings)."""
    key, sep, value_text = str(text).partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or any(not p.strip() for p in parts):
        raise ConfigError(path, None, f"bad --set override {text!r}: expected KEY=VALUE with a "
                                      "dotted key, e.g. solver.base_lr=0.05 or net.0.num_output=8")
    try:
        value = yaml.load(value_text, Loader=_Loader) if value_text.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(path, key, f"bad --set override {text!r}: the value is not valid "
                                     f"YAML ({str(e).splitlines()[0]})") from None
    node = config
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        here = ".".join(parts[:depth]) or "the top level"
        if isinstance(node, list):
            if not part.lstrip("-").isdigit():
                raise ConfigError(path, key, f"bad --set override {text!r}: {here} is a list, "
                                             f"index it with an integer, not {part!r}")
            index = int(part)
            if not -len(node) <= index < len(node):
                raise ConfigError(path, key, f"bad --set override {text!r}: index {index} is "
                                             f"out of range ({here} has {len(node)} entries)")
            if last:
                node[index] = value
            node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise ConfigError(path, key, f"bad --set override {text!r}: {here} is "
                                         f"{_kind(node)}, it has no key {part!r}")
    return config


def dump_config(config):
    """YAML text of a resolved config, without private (``_``-prefixed) keys."""
    public = {k: v for k, v in config.items() if not str(k).startswith("_")}
    return yaml.safe_dump(public, sort_keys=False, default_flow_style=None, width=100)


# --------------------------------------------------------------- validation
def validate_config(config, path="<config>", check_files=True):
    """Check every section of a parsed config and fill in defaults."""
    _check_keys("", config, TOP_KEYS, path)
    out = {}
    from_file = path and not str(path).startswith("<")
    stem = os.path.splitext(os.path.basename(path))[0] if from_file else "net"
    out["name"] = _check_name(config.get("name", stem), path)
    out["seed"] = check_seed("seed", config.get("seed", 0), path)
    out["data"] = _check_data(config.get("data"), path, check_files)
    if config.get("net") is None and config.get("graph") is None:
        raise ConfigError(path, "net", "the config defines no network: give 'net' "
                                       "(a list of layers) or 'graph' (a list of blobs and ops)")
    if config.get("net") is not None:
        out["net"] = _check_net(config["net"], path)
    if config.get("graph") is not None:
        out["graph"] = _check_graph(config["graph"], path)
    out["solver"] = _check_solver(config.get("solver"), path)
    out["parallel"] = _check_parallel(config.get("parallel"), path)
    if out["parallel"]["mode"] in ("async", "sync_ps") and out["solver"]["type"] != "sgd":
        raise ConfigError(path, "solver.type", f"parallel.mode {out['parallel']['mode']!r} "
                          f"(parameter servers) supports solver type 'sgd' only, got "
                          f"{out['solver']['type']!r}; use parallel.mode: sync")
    _check_pipeline(out, path)
    out["checkpoint"] = _check_section("checkpoint", config.get("checkpoint"),
                                       CHECKPOINT_DEFAULTS, _CHECKPOINT_CHECKS, path)
    if config.get("backend") is not None:
        out["backend"] = _check_choice("backend", config["backend"], BACKENDS, path)
    out["device"] = _check_int("device", config.get("device", -1), path, minimum=-1)
    out["tf32"] = _check_bool("tf32", config.get("tf32", False), path)
    out["cuda_graph"] = _check_bool("cuda_graph", config.get("cuda_graph", True), path)
    out["memory_plan"] = _check_bool("memory_plan", config.get("memory_plan", True), path)
    out["_path"] = path
    return out


def _check_name(name, path):
    if not isinstance(name, str) or not name.strip() or "/" in name or name in (".", ".."):
        raise ConfigError(path, "name", "expected a non-empty name without '/' (it names the "
                                        f"output directory runs/<name>), got {name!r}")
    return name


def _check_net(net, path):
    if not isinstance(net, list):
        raise ConfigError(path, "net", f"expected a list of layers, got {_kind(net)}")
    seen = {}
    for i, layer in enumerate(net):
        key = f"net.{i}"
        if not isinstance(layer, dict):
            raise ConfigError(path, key, f"expected a layer mapping with 'type' and 'name', "
                                         f"got {_kind(layer)}")
        for field in ("type", "name"):
            if not isinstance(layer.get(field), str) or not layer[field]:
                raise ConfigError(path, f"{key}.{field}", f"every layer needs a '{field}' "
                                                          f"string, got {layer.get(field)!r}")
        if layer["name"] in seen:
            raise ConfigError(path, f"{key}.name", f"duplicate layer name {layer['name']!r} "
                                                   f"(also net.{seen[layer['name']]})")
        seen[layer["name"]] = i
        check_layer(layer, i, path)  # known type, declared keys (purine_mpi/layers)
    return copy.deepcopy(net)


def _check_graph(graph, path):
    if not isinstance(graph, list):
        raise ConfigError(path, "graph", f"expected a list of blob/op entries, got {_kind(graph)}")
    for i, entry in enumerate(graph):
        key = f"graph.{i}"
        if not isinstance(entry, dict):
            raise ConfigError(path, key, f"expected a mapping with 'type: blob' or 'type: op', "
                                         f"got {_kind(entry)}")
        if entry.get("type") not in ("blob", "op"):
            raise ConfigError(path, f"{key}.type", f"expected 'blob' or 'op', "
                                                   f"got {entry.get('type')!r}")
        if not isinstance(entry.get("name"), str) or not entry["name"]:
            raise ConfigError(path, f"{key}.name", f"every {entry['type']} needs a 'name' "
                                                   f"string, got {entry.get('name')!r}")
    return copy.deepcopy(graph)


# ---------------------------------------------------------------- data specs
def _check_data(data, path, check_files):
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(path, "data", f"expected a mapping with 'train' and/or 'test', "
                                        f"got {_kind(data)}")
    _check_keys("data", data, ("train", "test"), path)
    return {split: _check_data_spec(split, spec, path, check_files)
            for split, spec in data.items() if spec is not None}


def _check_data_spec(phase, spec, path, check_files):
    key = f"data.{phase}"
    if not isinstance(spec, dict):
        raise ConfigError(path, key, f"expected a mapping (source, path, split, batch_size, ...), "
                                     f"got {_kind(spec)}")
    _check_keys(key, spec, DATA_KEYS, path)
    source = spec.get("source")
    if source is None:  # infer the obvious case, so a path alone is enough
        source = "hdf5" if "path" in spec else "synthetic" if "shape" in spec else None
    if source is None:
        raise ConfigError(path, f"{key}.source", "expected 'hdf5' (with a path) or 'synthetic' "
                                                 "(with shape and classes)")
    out = {"source": _check_choice(f"{key}.source", source, DATA_SOURCES, path)}
    if "batch_size" not in spec:
        raise ConfigError(path, f"{key}.batch_size", "missing; expected a positive integer "
                                                     "(the per-rank batch size)")
    out["batch_size"] = _check_int(f"{key}.batch_size", spec["batch_size"], path, minimum=1)
    out["shuffle"] = _check_bool(f"{key}.shuffle", spec.get("shuffle", phase == "train"), path)
    if spec.get("seed") is not None:
        out["seed"] = check_seed(f"{key}.seed", spec["seed"], path)
    out.update(_check_transform(key, spec, path))
    if source == "hdf5":
        if not isinstance(spec.get("path"), str) or not spec["path"]:
            raise ConfigError(path, f"{key}.path", "expected the path of an HDF5 file, got "
                                                   f"{spec.get('path')!r}")
        out["path"] = _resolve_data_path(spec["path"], path, f"{key}.path", check_files)
        in_memory = spec.get("in_memory", "auto")
        if in_memory not in ("auto", True, False):
            raise ConfigError(path, f"{key}.in_memory", "expected auto (load the split when it "
                              "fits in a quarter of the memory), true or false (read each "
                              f"batch from the file), got {in_memory!r}")
        out["in_memory"] = in_memory
        split = spec.get("split")
        if split is not None and (not isinstance(split, str) or not split):
            raise ConfigError(path, f"{key}.split",
                              f"expected a group name such as 'train', or null for top-level "
                              f"data/label, got {split!r}")
        out["split"] = split
    else:
        shape = spec.get("shape")
        if (not isinstance(shape, list) or not shape
                or not all(_is_int(s) and s > 0 for s in shape)):
            raise ConfigError(path, f"{key}.shape", "expected a list of positive integers "
                                                    f"[C, H, W] (one sample), got {shape!r}")
        out["shape"] = [int(s) for s in shape]
        if "classes" not in spec:
            raise ConfigError(path, f"{key}.classes", "missing; synthetic data needs the "
                                                      "number of classes (a positive integer)")
        out["classes"] = _check_int(f"{key}.classes", spec["classes"], path, minimum=1)
        out["num_samples"] = _check_int(f"{key}.num_samples",
                                        spec.get("num_samples", SYNTHETIC_NUM_SAMPLES), path,
                                        minimum=1)
        out["split"] = spec.get("split", phase)
    return out


def data_notes(config):
    """One line for each data split whose batch is larger than the split (each
    batch then holds samples several times over: a mistyped batch_size, or a
    small stand-in file). Reads the HDF5 files' metadata."""
    from .data import source_info
    notes = []
    for phase, spec in (config.get("data") or {}).items():
        n = source_info(spec)[0]
        if spec["batch_size"] > n:
            notes.append(f"note: data.{phase}.batch_size {spec['batch_size']} is larger than the "
                         f"{n} samples of the {phase} data: each batch holds samples several "
                         "times over")
    return notes


def _check_transform(key, spec, path):
    """The transform keys of a data spec (``purine_mpi.io.transform``); absent
    keys stay absent. Whether they fit the samples (crop within H x W, one
    mean per channel) is checked when the data op reads the file's shape."""
    out = {}
    if spec.get("scale") is not None:
        out["scale"] = float(_check_number(f"{key}.scale", spec["scale"], path, 0, strict=True))
    mean = spec.get("mean")
    if mean is not None:
        values = mean if isinstance(mean, list) else [mean]
        if not values or not all(_is_number(v) for v in values):
            raise ConfigError(path, f"{key}.mean", "expected a number or a list of numbers (one "
                                                   f"per channel), got {mean!r}")
        out["mean"] = [float(v) for v in values] if isinstance(mean, list) else float(mean)
    if spec.get("mirror") is not None:
        out["mirror"] = _check_bool(f"{key}.mirror", spec["mirror"], path)
    if spec.get("crop_size") is not None:
        out["crop_size"] = _check_int(f"{key}.crop_size", spec["crop_size"], path, minimum=1)
    return out


def _resolve_data_path(data_path, config_path, key, check_files):
    """The data file relative to the working directory first, then to the
    config file's directory (so a config works from the repo root and from
    its own folder). Returns an absolute path when the file was found."""
    candidates = [data_path]
    if not os.path.isabs(data_path) and config_path and not config_path.startswith("<"):
        candidates.append(os.path.join(os.path.dirname(os.path.abspath(config_path)), data_path))
    for candidate in candidates:
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    if check_files:
        tried = " or ".join(repr(os.path.abspath(c)) for c in candidates)
        raise ConfigError(config_path, key, f"data file {data_path!r} not found (looked for "
                                            f"{tried}); {data_hint(data_path)}")
    return data_path


def data_hint(data_path):
    """How to make the missing data file ``data_path``, by the data set its
    name suggests."""
    name = os.path.basename(str(data_path)).lower()
    if "cifar" in name:
        return (f"make it with 'python -m purine_mpi data cifar10 --download --out {data_path}' "
                "(or --from DIR with the unpacked python batches)")
    if "digit" in name:
        return f"make it with 'python -m purine_mpi data digits --out {data_path}'"
    return ("convert your data to the HDF5 layout of docs/formats.md ('HDF5 data files'); "
            "'python -m purine_mpi data digits|cifar10 --out PATH.h5' writes the bundled sets")


# ------------------------------------------------------- solver / parallel
def _check_solver(solver, path):
    out = _check_section("solver", solver, SOLVER_DEFAULTS, _SOLVER_CHECKS, path)
    policy = out["lr_policy"]
    if policy == "step" and out["stepsize"] is None:
        raise ConfigError(path, "solver.stepsize", "lr_policy 'step' needs a stepsize "
                                                   "(a positive integer number of iterations)")
    if policy == "multistep" and not out["stepvalues"]:
        raise ConfigError(path, "solver.stepvalues", "lr_policy 'multistep' needs stepvalues "
                                                     "(an increasing list of iterations)")
    given = solver if isinstance(solver, dict) else {}
    if out["type"] in ("adagrad", "rmsprop") and given.get("momentum"):
        raise ConfigError(path, "solver.momentum", f"solver type {out['type']!r} takes no "
                          "momentum (as in Caffe); remove the key or set it to 0")
    return out


def _check_parallel(parallel, path):
    return _check_section("parallel", parallel, PARALLEL_DEFAULTS, _PARALLEL_CHECKS, path)


def _check_section(section, value, defaults, checks, path):
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(path, section, f"expected a mapping, got {_kind(value)}")
    _check_keys(section, value, tuple(defaults), path)
    out = {}
    for name, default in defaults.items():
        if name in value:
            out[name] = checks[name](f"{section}.{name}", value[name], path)
        else:
            out[name] = copy.deepcopy(default)
    return out


def _stepvalues(key, value, path):
    if (not isinstance(value, list) or not all(_is_int(v) and v > 0 for v in value)
            or any(b <= a for a, b in zip(value, value[1:]))):
        raise ConfigError(path, key, f"expected an increasing list of positive integers "
                                     f"(iterations), got {value!r}")
    return [int(v) for v in value]


def _described(doc):
    """Attach ``doc`` (the type column of docs/config.md) to a checker."""
    def deco(check):
        check.doc = doc
        return check
    return deco


def _optional(check):
    return _described(f"{check.doc} or null")(
        lambda key, value, path: None if value is None else check(key, value, path))


def _int(minimum):
    doc = {0: "integer >= 0", 1: "integer > 0"}.get(minimum, f"integer >= {minimum}")
    return _described(doc)(lambda key, value, path: _check_int(key, value, path,
                                                                minimum=minimum))


def _number_range(minimum, strict, below, doc):
    """The allowed range of a number key, in the reference's terse words
    (``doc``) or in an error message's."""
    if minimum == 0 and below is not None:
        return f"number in [0, {below})" if doc else f"a number in [0, {below})"
    if minimum == 0:
        if doc:
            return "number > 0" if strict else "number >= 0"
        return "a positive number" if strict else "a non-negative number"
    return "number" if doc else "a number"


def _num(minimum=None, strict=False, below=None):
    return _described(_number_range(minimum, strict, below, doc=True))(
        lambda key, value, path: _check_number(key, value, path, minimum, strict, below))


def _choice(choices):
    return _described(f"one of {', '.join(choices)}")(
        lambda key, value, path: _check_choice(key, value, choices, path))


@_described("true/false")
def _bool(key, value, path):
    return _check_bool(key, value, path)


_stepvalues.doc = "list of integers"

_SOLVER_CHECKS = {
    "type": _choice(SOLVER_TYPES), "base_lr": _num(0), "momentum": _num(0, below=1),
    "weight_decay": _num(0), "lr_policy": _choice(LR_POLICIES), "gamma": _num(0, strict=True),
    "stepsize": _optional(_int(1)), "stepvalues": _stepvalues, "power": _num(0),
    "max_iter": _int(0), "test_interval": _int(0), "test_iter": _optional(_int(1)),
    "display": _int(0), "warmup_iters": _int(0), "momentum2": _num(0, below=1),
    "delta": _num(0, strict=True), "rms_decay": _num(0, below=1),
    "test_initialization": _bool,
    "early_stop": lambda key, value, path: _check_watch(
        key, value, path, {"metric": None, "mode": None, "patience": 5, "min_delta": 0.0}),
}
_SOLVER_CHECKS["early_stop"].doc = "mapping {metric, patience, min_delta, mode} or null"
_PARALLEL_CHECKS = {
    "scheme": _choice(PARALLEL_SCHEMES), "mode": _choice(PARALLEL_MODES),
    "bucket_mb": _num(0, strict=True), "first_bucket_mb": _num(0, strict=True),
    "min_buckets": _int(1), "split_params": _bool, "defer_update": _bool,
    "ps_ranks": _int(1), "max_staleness": _int(0), "stall_timeout": _num(0, strict=True),
    "check_collectives": _bool,
    "stages": lambda key, value, path: _check_stages(key, value, path),
    "micro_batches": _int(1), "schedule": _choice(PIPELINE_SCHEDULES),
}
_PARALLEL_CHECKS["stages"].doc = "mapping layer → stage"


def _check_stages(key, value, path):
    """parallel.stages: {layer name: stage} for scheme pipeline or hybrid."""
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and _is_int(v) and v >= 0 for k, v in value.items()):
        raise ConfigError(path, key, f"expected a mapping of layer name to stage, e.g. "
                                     f"{{conv1: 0, fc1: 1}}, got {value!r}")
    return value


def _check_pipeline(out, path):
    """Cross-key rules of parallel.micro_batches and parallel.stages."""
    par = out["parallel"]
    micro = par["micro_batches"]
    if micro > 1:
        if par["mode"] in ("async", "sync_ps"):
            raise ConfigError(path, "parallel.micro_batches", f"parameter-server mode "
                              f"{par['mode']!r} takes no micro-batches; use mode: sync")
        train = (out.get("data") or {}).get("train") or {}
        batch = train.get("batch_size")
        if batch is not None and batch % micro:
            raise ConfigError(path, "parallel.micro_batches", f"{micro} micro-batches do not "
                              f"divide data.train.batch_size {batch}; choose a divisor")
    scheme = par["scheme"]
    if scheme not in ("pipeline", "hybrid"):
        return
    if par["mode"] != "sync":
        raise ConfigError(path, "parallel.mode", f"scheme {scheme} runs with mode: sync, not "
                          f"{par['mode']!r} (parameter servers serve data-parallel workers)")
    if out.get("net") is None:
        return
    if not par["stages"]:
        raise ConfigError(path, "parallel.stages", f"scheme {scheme} needs a mapping layer -> "
                          "stage for every layer, e.g. {conv1: 0, fc1: 1}")
    names = [layer.get("name") for layer in out["net"]]
    unknown = sorted(set(par["stages"]) - set(names))
    if unknown:
        raise ConfigError(path, "parallel.stages", f"no layer named {', '.join(unknown)} in "
                          "the net")
    missing = [n for n in names if n not in par["stages"]]
    if missing:
        raise ConfigError(path, "parallel.stages", f"layer(s) {', '.join(missing)} have no "
                          "stage; give every layer of the net a stage")
    count = max(par["stages"].values()) + 1
    empty = [s for s in range(count) if s not in par["stages"].values()]
    if empty:
        raise ConfigError(path, "parallel.stages", f"stage(s) {', '.join(map(str, empty))} "
                          f"have no layers; number the stages 0..{count - 1 - len(empty)}")
    if scheme == "hybrid" and count < 2:
        raise ConfigError(path, "parallel.stages", "scheme hybrid needs at least 2 stages "
                          "(replicas x stages), but every layer is on stage 0; with one stage "
                          "use scheme: data")


_CHECKPOINT_CHECKS = {"interval": _int(0), "keep": _int(0),
                      "best": lambda key, value, path: _check_watch(
                          key, value, path, {"metric": None, "mode": None, "keep": 1})}
_CHECKPOINT_CHECKS["best"].doc = "mapping {metric, mode, keep} or null"


def _check_watch(key, value, path, defaults):
    """A metric watch (checkpoint.best, solver.early_stop): ``metric`` (a
    test figure: accuracy, loss, ...), ``mode`` max|min (default: min for a
    loss, else max) and its own counts; null turns it off."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(path, key, f"expected a mapping such as {{metric: accuracy}}, got "
                                     f"{_kind(value)}")
    _check_keys(key, value, tuple(defaults), path)
    metric = value.get("metric")
    if not isinstance(metric, str) or not metric:
        raise ConfigError(path, f"{key}.metric", "expected the name of a test figure, e.g. "
                                                 "accuracy or loss")
    out = dict(defaults, **value)
    if out["mode"] is not None:
        out["mode"] = _check_choice(f"{key}.mode", out["mode"], ("max", "min"), path)
    for name in ("keep", "patience"):
        if name in defaults:
            out[name] = _check_int(f"{key}.{name}", out[name], path, minimum=1)
    if "min_delta" in defaults:
        out["min_delta"] = _check_number(f"{key}.min_delta", out["min_delta"], path, 0, False,
                                         None)
    return out

#: the sections with a defaults table: name -> (defaults, checkers); docs/config.md
#: lists their keys from here (KEY_DOCS gives the meanings)
SECTIONS = {"solver": (SOLVER_DEFAULTS, _SOLVER_CHECKS),
            "parallel": (PARALLEL_DEFAULTS, _PARALLEL_CHECKS),
            "checkpoint": (CHECKPOINT_DEFAULTS, _CHECKPOINT_CHECKS)}


# ------------------------------------------------------------ scalar checks
def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def check_seed(key, value, path):
    """A seed: an integer in [0, 2^63) (``seed``, ``data.*.seed``, ``--seed``)."""
    if _is_int(value) and 0 <= value < SEED_LIMIT:
        return int(value)
    raise ConfigError(path, key, f"expected a non-negative integer below 2^63 (it is stored "
                                 f"as a 64-bit integer), got {value!r}")


def _check_int(key, value, path, minimum=None):
    ok = _is_int(value) or (isinstance(value, float) and value.is_integer())
    if ok and (minimum is None or value >= minimum):
        return int(value)
    want = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
        minimum, f"an integer >= {minimum}")
    raise ConfigError(path, key, f"expected {want}, got {value!r}")


def _check_number(key, value, path, minimum=None, strict=False, below=None):
    number = value
    if isinstance(value, str):  # 1e-3 reads as a number (_Loader): this was quoted
        raise ConfigError(path, key, f"expected {_number_range(minimum, strict, below, False)}"
                                     f", got the string {value!r} (a number is written "
                                     "without quotes)")
    if isinstance(number, bool) or not isinstance(number, (int, float)) \
            or not math.isfinite(number):  # .nan and .inf are YAML numbers, never good ones
        number = None
    ok = number is not None
    if ok and minimum is not None:
        ok = number > minimum if strict else number >= minimum
    if ok and below is not None:
        ok = number < below
    if ok:
        return number
    want = _number_range(minimum, strict, below, doc=False)
    raise ConfigError(path, key, f"expected {want} (finite), got {value!r}")


def _check_bool(key, value, path):
    if isinstance(value, bool):
        return value
    raise ConfigError(path, key, f"expected true or false, got {value!r}")


def _check_choice(key, value, choices, path):
    if value in choices:
        return value
    hint = _suggest(value, choices)
    raise ConfigError(path, key, f"expected one of {', '.join(choices)}, got {value!r}{hint}")


def _check_keys(section, mapping, allowed, path):
    for k in mapping:
        if k not in allowed:
            key = f"{section}.{k}" if section else str(k)
            where = f"in '{section}'" if section else "at the top level"
            if not section and str(k).startswith("_"):
                raise ConfigError(path, key, f"unknown key {k!r} at the top level (keys "
                                  "starting with '_' are not private: they are rejected like "
                                  "any unknown key; to share a value, put a YAML anchor &name "
                                  f"on its first use) (valid keys: {', '.join(allowed)})")
            raise ConfigError(path, key, f"unknown key {k!r} {where}{_suggest(k, allowed)} "
                                         f"(valid keys: {', '.join(allowed)})")


def _suggest(value, choices):
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _kind(value):
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"
