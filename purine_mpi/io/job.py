"""The job: a validated config resolved once into frozen, typed parts.

``load_config`` (io/config.py) validates the YAML into a resolved dict;
``job_of(config)`` turns that dict into a ``Job``: frozen dataclasses with
every default filled in (``SolverSpec``, ``ParallelSpec``,
``CheckpointSpec``, ``DataSpecs`` of ``DataSpec``), lists as tuples, the
net's and the graph's entries as read-only mappings (``FrozenMap``: the
layer registry reads them by key). Everything below ``io/`` reads the job's
attributes, never the dict; values derived from several keys (the global
batch, the stage map of a pipeline) are the job's properties and methods.
``Job.to_config()`` is the resolved dict again (``config.yaml`` of a run,
the text ranks compare at start-up).

A new config key: its default in io/schema.py, its checker in io/config.py,
its meaning in KEY_DOCS, and its field here (tests/test_job.py checks
that every schema key has one). Imports ``io/schema`` and the standard
library only.

Layer: job (docs/DESIGN.md); may import the foundation, devices, data, ops and
graph layers below it, and its own.
"""
import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from .schema import (CHECKPOINT_DEFAULTS, PARALLEL_DEFAULTS, SOLVER_DEFAULTS,
                     SYNTHETIC_NUM_SAMPLES)

#: schemes that place layers on ranks by ``parallel.stages``
STAGED_SCHEMES = ("pipeline", "hybrid")

#: modes that run through parameter servers
SERVER_MODES = ("async", "sync_ps")


class FrozenMap(Mapping):
    """A read-only mapping (a layer entry, ``parallel.stages``): reads like
    the dict it was made from, refuses assignment, pickles and copies."""
    __slots__ = ("_data",)

    def __init__(self, data=()):
        object.__setattr__(self, "_data", dict(data))

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)

    def __setattr__(self, name, value):
        raise AttributeError("a FrozenMap is read-only")

    def __repr__(self):
        return f"FrozenMap({self._data!r})"

    def __reduce__(self):
        return FrozenMap, (self._data,)

    def to_dict(self):
        """A deep copy as a plain dict."""
        return copy.deepcopy(self._data)


def _watch_direction(metric, mode):
    """``max`` or ``min``: the given mode, else min for a loss, max otherwise."""
    return mode or ("min" if "loss" in str(metric).lower() else "max")


@dataclass(frozen=True)
class EarlyStopSpec:
    """``solver.early_stop``: stop when ``metric`` stalls for ``patience`` tests."""
    metric: str
    mode: Optional[str] = None
    patience: int = 5
    min_delta: float = 0.0

    @property
    def direction(self):
        return _watch_direction(self.metric, self.mode)

    def to_config(self):
        return {"metric": self.metric, "mode": self.mode, "patience": self.patience,
                "min_delta": self.min_delta}


@dataclass(frozen=True)
class BestSpec:
    """``checkpoint.best``: keep the ``keep`` best checkpoints by ``metric``."""
    metric: str
    mode: Optional[str] = None
    keep: int = 1

    @property
    def direction(self):
        return _watch_direction(self.metric, self.mode)

    def to_config(self):
        return {"metric": self.metric, "mode": self.mode, "keep": self.keep}


@dataclass(frozen=True)
class SolverSpec:
    """The ``solver`` section (keys of io/schema.py's SOLVER_DEFAULTS)."""
    type: str = SOLVER_DEFAULTS["type"]
    base_lr: float = SOLVER_DEFAULTS["base_lr"]
    momentum: float = SOLVER_DEFAULTS["momentum"]
    weight_decay: float = SOLVER_DEFAULTS["weight_decay"]
    lr_policy: str = SOLVER_DEFAULTS["lr_policy"]
    gamma: float = SOLVER_DEFAULTS["gamma"]
    stepsize: Optional[int] = SOLVER_DEFAULTS["stepsize"]
    stepvalues: tuple = tuple(SOLVER_DEFAULTS["stepvalues"])
    power: float = SOLVER_DEFAULTS["power"]
    max_iter: int = SOLVER_DEFAULTS["max_iter"]
    test_interval: int = SOLVER_DEFAULTS["test_interval"]
    test_iter: Optional[int] = SOLVER_DEFAULTS["test_iter"]
    display: int = SOLVER_DEFAULTS["display"]
    warmup_iters: int = SOLVER_DEFAULTS["warmup_iters"]
    momentum2: float = SOLVER_DEFAULTS["momentum2"]
    delta: float = SOLVER_DEFAULTS["delta"]
    rms_decay: float = SOLVER_DEFAULTS["rms_decay"]
    test_initialization: bool = SOLVER_DEFAULTS["test_initialization"]
    early_stop: Optional[EarlyStopSpec] = None
    clip_gradients: Optional[float] = SOLVER_DEFAULTS["clip_gradients"]

    @classmethod
    def from_config(cls, section):
        values = {**copy.deepcopy(SOLVER_DEFAULTS), **(section or {})}
        values["stepvalues"] = tuple(values["stepvalues"] or ())
        early = values["early_stop"]
        values["early_stop"] = None if early is None else EarlyStopSpec(**early)
        return cls(**values)

    def to_config(self):
        out = {k: getattr(self, k) for k in SOLVER_DEFAULTS}
        out["stepvalues"] = list(self.stepvalues)
        out["early_stop"] = None if self.early_stop is None else self.early_stop.to_config()
        return out


@dataclass(frozen=True)
class ParallelSpec:
    """The ``parallel`` section (keys of io/schema.py's PARALLEL_DEFAULTS)."""
    scheme: str = PARALLEL_DEFAULTS["scheme"]
    mode: str = PARALLEL_DEFAULTS["mode"]
    bucket_mb: float = PARALLEL_DEFAULTS["bucket_mb"]
    first_bucket_mb: float = PARALLEL_DEFAULTS["first_bucket_mb"]
    min_buckets: int = PARALLEL_DEFAULTS["min_buckets"]
    split_params: bool = PARALLEL_DEFAULTS["split_params"]
    defer_update: bool = PARALLEL_DEFAULTS["defer_update"]
    ps_ranks: int = PARALLEL_DEFAULTS["ps_ranks"]
    max_staleness: int = PARALLEL_DEFAULTS["max_staleness"]
    stall_timeout: float = PARALLEL_DEFAULTS["stall_timeout"]
    check_collectives: bool = PARALLEL_DEFAULTS["check_collectives"]
    stages: FrozenMap = dataclasses.field(default_factory=FrozenMap)
    micro_batches: int = PARALLEL_DEFAULTS["micro_batches"]
    schedule: str = PARALLEL_DEFAULTS["schedule"]

    @classmethod
    def from_config(cls, section):
        values = {**copy.deepcopy(PARALLEL_DEFAULTS), **(section or {})}
        values["stages"] = FrozenMap({k: int(v) for k, v in (values["stages"] or {}).items()})
        return cls(**values)

    def to_config(self):
        out = {k: getattr(self, k) for k in PARALLEL_DEFAULTS}
        out["stages"] = dict(self.stages)
        return out

    @property
    def staged(self):
        """Whether the scheme places layers on ranks (pipeline, hybrid)."""
        return self.scheme in STAGED_SCHEMES

    @property
    def servers(self):
        """Whether the mode runs through parameter servers (async, sync_ps)."""
        return self.mode in SERVER_MODES

    @property
    def stage_count(self):
        """Stages of ``stages`` (0 when none is given)."""
        return max(self.stages.values()) + 1 if self.stages else 0

    def stage_layers(self):
        """{stage: (layer names, in the order of ``stages``)}: the stage map."""
        out = {}
        for name, stage in self.stages.items():
            out.setdefault(stage, []).append(name)
        return {s: tuple(out[s]) for s in sorted(out)}

    def bucket_settings(self):
        """compose_data_parallel's bucket-plan arguments."""
        return {"bucket_mb": self.bucket_mb, "first_bucket_mb": self.first_bucket_mb,
                "min_buckets": self.min_buckets, "split_params": self.split_params}

    def changed(self):
        """The keys set to something else than their default."""
        return {k for k, v in self.to_config().items() if v != PARALLEL_DEFAULTS[k]}


@dataclass(frozen=True)
class CheckpointSpec:
    """The ``checkpoint`` section."""
    interval: int = CHECKPOINT_DEFAULTS["interval"]
    keep: int = CHECKPOINT_DEFAULTS["keep"]
    best: Optional[BestSpec] = None
    folder: Optional[str] = CHECKPOINT_DEFAULTS["folder"]

    @classmethod
    def from_config(cls, section):
        values = {**copy.deepcopy(CHECKPOINT_DEFAULTS), **(section or {})}
        values["best"] = None if values["best"] is None else BestSpec(**values["best"])
        return cls(**values)

    def to_config(self):
        return {"interval": self.interval, "keep": self.keep,
                "best": None if self.best is None else self.best.to_config(),
                "folder": self.folder}


#: the keys of a data spec in the order of the validated dict; the
#: source's own keys follow the transform keys
_DATA_HEAD = ("source", "batch_size", "shuffle", "seed", "mean_file", "scale", "mean", "mirror",
              "crop_size")
_DATA_TAIL = {"hdf5": ("path", "in_memory", "external", "split"), "lmdb": ("path",),
              "synthetic": ("shape", "classes", "num_samples", "split")}


@dataclass(frozen=True)
class DataSpec:
    """One data split (``data.train`` or ``data.test``; io/schema.py's DATA_KEYS).
    Keys a validated spec leaves out (a synthetic source's path, a transform
    not asked for, the seed when the config's seed applies) are None."""
    source: str
    batch_size: int
    shuffle: bool
    path: Optional[str] = None
    split: Optional[str] = None
    in_memory: object = None
    external: Optional[bool] = None
    shape: Optional[tuple] = None
    classes: Optional[int] = None
    num_samples: Optional[int] = None
    seed: Optional[int] = None
    scale: Optional[float] = None
    mean_file: Optional[str] = None
    mean: object = None
    mirror: Optional[bool] = None
    crop_size: Optional[int] = None

    @classmethod
    def from_config(cls, phase, spec):
        values = dict(spec)
        source = values.get("source") or ("hdf5" if "path" in values else "synthetic")
        values["source"] = source
        values.setdefault("shuffle", phase == "train")
        if source == "hdf5":
            values.setdefault("in_memory", "auto")
            values.setdefault("external", False)
            values.setdefault("split", None)
        elif source == "synthetic":
            values.setdefault("num_samples", SYNTHETIC_NUM_SAMPLES)
            values.setdefault("split", phase)
        if values.get("shape") is not None:
            values["shape"] = tuple(int(s) for s in values["shape"])
        if isinstance(values.get("mean"), list):
            values["mean"] = tuple(values["mean"])
        return cls(**values)

    def to_config(self):
        """The validated spec's dict (same keys, same order)."""
        out = {}
        for key in _DATA_HEAD + _DATA_TAIL.get(self.source, ()):
            value = getattr(self, key)
            if value is None and not (key == "split" or key in _DATA_TAIL.get(self.source, ())):
                continue
            out[key] = list(value) if isinstance(value, tuple) else value
        return out

    def source_dict(self):
        """The spec without ``batch_size``: the DataReader op's ``source`` attribute
        and what io/data.py's sources read."""
        out = self.to_config()
        del out["batch_size"]
        return out

    def with_batch(self, batch_size):
        return dataclasses.replace(self, batch_size=int(batch_size))


@dataclass(frozen=True)
class DataSpecs:
    """The ``data`` section: the train and test specs (None when absent);
    ``order``: the phases in the order the config gave them."""
    train: Optional[DataSpec] = None
    test: Optional[DataSpec] = None
    order: tuple = ("train", "test")

    @classmethod
    def from_config(cls, data):
        data = {k: v for k, v in (data or {}).items() if v is not None}
        return cls(**{phase: DataSpec.from_config(phase, spec) for phase, spec in data.items()},
                   order=tuple(data))

    def get(self, phase):
        return getattr(self, phase)

    def items(self):
        """(phase, spec) of the given phases, in the config's order."""
        return [(p, getattr(self, p)) for p in self.order if getattr(self, p) is not None]

    def __bool__(self):
        return self.train is not None or self.test is not None

    def to_config(self):
        return {phase: spec.to_config() for phase, spec in self.items()}


def _frozen_entries(entries):
    return None if entries is None else tuple(FrozenMap(copy.deepcopy(e)) for e in entries)


#: top-level keys in the order of the validated dict
_TOP_ORDER = ("name", "seed", "data", "net", "graph", "solver", "parallel", "checkpoint",
              "backend", "device", "tf32", "cuda_graph", "memory_plan")


@dataclass(frozen=True)
class Job:
    """A training job, resolved once from its config (``job_of``)."""
    name: str = "net"
    path: Optional[str] = None
    seed: int = 0
    net: Optional[tuple] = None
    graph: Optional[tuple] = None
    solver: SolverSpec = dataclasses.field(default_factory=SolverSpec)
    parallel: ParallelSpec = dataclasses.field(default_factory=ParallelSpec)
    checkpoint: CheckpointSpec = dataclasses.field(default_factory=CheckpointSpec)
    data: DataSpecs = dataclasses.field(default_factory=DataSpecs)
    backend: Optional[str] = None
    device: int = -1
    tf32: bool = False
    cuda_graph: bool = True
    memory_plan: bool = True

    @classmethod
    def from_config(cls, config):
        """A job from a validated config dict (a missing section takes the
        schema's defaults)."""
        return cls(name=config.get("name", "net"), path=config.get("_path"),
                   seed=int(config.get("seed", 0)),
                   net=_frozen_entries(config.get("net")),
                   graph=_frozen_entries(config.get("graph")),
                   solver=SolverSpec.from_config(config.get("solver")),
                   parallel=ParallelSpec.from_config(config.get("parallel")),
                   checkpoint=CheckpointSpec.from_config(config.get("checkpoint")),
                   data=DataSpecs.from_config(config.get("data")),
                   backend=config.get("backend"), device=int(config.get("device", -1)),
                   tf32=bool(config.get("tf32", False)),
                   cuda_graph=bool(config.get("cuda_graph", True)),
                   memory_plan=bool(config.get("memory_plan", True)))

    def to_config(self):
        """The resolved config dict (as ``load_config`` returns it)."""
        out = {}
        for key in _TOP_ORDER:
            value = getattr(self, key)
            if key in ("net", "graph", "backend") and value is None:
                continue
            if key in ("net", "graph"):
                value = [entry.to_dict() for entry in value]
            elif hasattr(value, "to_config"):
                value = value.to_config()
            out[key] = value
        out["_path"] = self.path
        return out

    def replace(self, **changes):
        """A copy with some fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------ derived values
    @property
    def layer_names(self):
        """The net's layer names, in order (empty for a ``graph:`` job)."""
        return tuple(layer["name"] for layer in self.net or ())

    @property
    def train_batch(self):
        """``data.train.batch_size``: samples per rank per iteration (None without train data)."""
        return None if self.data.train is None else self.data.train.batch_size

    @property
    def micro_batch(self):
        """Samples of one micro-batch of ``parallel.micro_batches`` (the train
        graph is built for one)."""
        batch = self.train_batch
        return None if batch is None else batch // self.parallel.micro_batches

    def global_batch(self, replicas):
        """Samples per iteration over ``replicas`` data replicas."""
        return self.train_batch * int(replicas)

    @property
    def stage_map(self):
        """{layer name: stage} of a staged scheme (``parallel.stages``)."""
        return self.parallel.stages

    def stage_of(self, layer):
        return self.parallel.stages.get(layer)

    def with_training(self, **solver):
        """The job with some solver keys changed (``max_iter`` of bench, ...)."""
        return dataclasses.replace(self, solver=dataclasses.replace(self.solver, **solver))


def data_spec_of(phase, spec):
    """A ``DataSpec`` from a validated spec dict; a ``DataSpec`` unchanged."""
    return spec if isinstance(spec, DataSpec) else DataSpec.from_config(phase, spec)


def job_of(config):
    """The ``Job`` of a validated config dict; a ``Job`` is returned unchanged."""
    if isinstance(config, Job):
        return config
    return Job.from_config(config)
