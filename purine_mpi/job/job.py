"""The job: a validated config resolved once into frozen, typed parts.

``load_config`` (job/config.py) validates the YAML into a resolved dict;
``job_of(config)`` turns that dict into a ``Job``: frozen dataclasses with
every default filled in (``SolverSpec``, ``ParallelSpec``,
``CheckpointSpec``, ``DataSpecs`` of ``DataSpec``), lists as tuples, the
net's and the graph's entries as read-only mappings (``FrozenMap``: the
layer registry reads them by key). Everything outside ``job/`` and ``data/`` reads the job's
attributes, never the dict; values derived from several keys (the global
batch, the stage map of a pipeline) are the job's properties and methods.
``Job.to_config()`` is the resolved dict again (``config.yaml`` of a run,
the text ranks compare at start-up).

Each part's fields are made from its section's declarations in
job/schema.py (``spec_of``, job/keys.py): a new key needs nothing here.
Imports ``job/schema``, ``job/keys`` and the standard library only.
"""
import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..base.precision import GRAD_WIRE
from .keys import FrozenMap, Typed, spec_of
from .schema import (CHECKPOINT, DATA, GPU, LOSS_SCALE, PARALLEL, PARALLEL_DEFAULTS,
                     RESOLVED_FIRST, SOLVER, SOURCE_KEYS, SYNTHETIC_NUM_SAMPLES, TOP)

#: schemes that place layers on ranks by ``parallel.stages``
STAGED_SCHEMES = ("pipeline", "hybrid")

#: modes that run through parameter servers
SERVER_MODES = ("async", "sync_ps")


@spec_of(SOLVER)
class SolverSpec:
    """The ``solver`` section (job/schema.py's SOLVER)."""


@spec_of(PARALLEL)
class ParallelSpec:
    """The ``parallel`` section (job/schema.py's PARALLEL)."""

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

    def wire_dtype(self):
        """The dtype the gradient buckets cross the ranks in (``grad_dtype``:
        None for float32, ``bfloat16`` for bf16)."""
        return GRAD_WIRE[self.grad_dtype]

    def changed(self):
        """The keys set to something else than their default."""
        return {k for k, v in self.to_config().items() if v != PARALLEL_DEFAULTS[k]}


@spec_of(CHECKPOINT)
class CheckpointSpec:
    """The ``checkpoint`` section (job/schema.py's CHECKPOINT)."""


@spec_of(GPU)
class GpuSpec:
    """The ``gpu`` section (job/schema.py's GPU)."""


@spec_of(LOSS_SCALE)
class LossScaleSpec:
    """The ``loss_scale`` section (job/schema.py's LOSS_SCALE): fp16's
    dynamic loss scaling (graph/loss_scale.py)."""

    def changed(self):
        """The keys set to something else than their default."""
        return sorted(k.name for k in LOSS_SCALE if getattr(self, k.name) != k.default)


def precision_notes(job):
    """One line when ``loss_scale`` keys are set under a precision other
    than fp16, where they have no effect (none scales the loss)."""
    changed = job.loss_scale.changed()
    if job.precision == "fp16" or not changed:
        return []
    keys = ", ".join(f"loss_scale.{k}" for k in changed)
    verb = "has" if len(changed) == 1 else "have"
    return [f"note: {keys} {verb} no effect: precision is {job.precision}, and only fp16 "
            "scales the loss"]


#: the keys of a validated data spec before the source's own (SOURCE_KEYS),
#: in the order job/data_spec.py writes them
_DATA_HEAD = ("source", "batch_size", "shuffle", "seed", "mean_file", "scale", "mean", "mirror",
              "crop_size")


@spec_of(DATA)
class DataSpec:
    """One data split (``data.train`` or ``data.test``; job/schema.py's DATA).
    Keys a validated spec leaves out (a synthetic source's path, a transform
    not asked for, the seed when the config's seed applies) are None."""

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
        elif source == "text":
            values.setdefault("split", "train" if phase == "train" else "val")
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
        own = SOURCE_KEYS.get(self.source, ())
        out = {}
        for key in _DATA_HEAD + own:
            value = getattr(self, key)
            if value is None and key not in own:
                continue
            out[key] = list(value) if isinstance(value, tuple) else value
        return out

    def source_dict(self):
        """The spec without ``batch_size``: the DataReader op's ``source`` attribute
        and what data/sources.py's sources read."""
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


#: the Job's part of each section (the rest of TOP are plain values)
_PARTS = {"data": DataSpecs, "solver": SolverSpec, "parallel": ParallelSpec,
          "checkpoint": CheckpointSpec, "gpu": GpuSpec, "loss_scale": LossScaleSpec}
_JOB_KEYS = tuple(key._replace(typed=Typed(_PARTS[key.name].from_config,
                                           _PARTS[key.name].to_config))
                  if key.name in _PARTS else key for key in TOP)


@spec_of(_JOB_KEYS)
class Job:
    """A training job, resolved once from its config (``job_of``): one field
    per top-level key of job/schema.py's TOP, ``path`` (the config file) and
    ``net_keys`` (the file's key of each layer when its net has a ``repeat``)."""
    path: Optional[str] = None
    #: the file's key of each layer of ``net`` when the file has a ``repeat``
    #: (``net.4``, ``net.3.block.2``: job/repeat.py), else None
    net_keys: Optional[tuple] = None
    #: the ``--set`` texts it was loaded with, in order (job/config.py's
    #: resolve_job: a start-up note on a key one of them wrote names it, not
    #: the file), else None; where the values came from, not what they are:
    #: no part of the job's equality, nor of its config
    overrides: Optional[tuple] = dataclasses.field(default=None, compare=False)
    #: (phase, key, value, the ``--set`` that wrote it or None) of each key of
    #: a data spec that its source does not read (job/config.py's
    #: resolve_job; data_spec.data_notes names them at start-up), else
    #: None; as ``overrides``, no part of the job's equality nor its config
    ignored_data_keys: Optional[tuple] = dataclasses.field(default=None, compare=False)

    @classmethod
    def from_config(cls, config):
        """A job from a validated config dict (a missing section takes the
        schema's defaults)."""
        keys = config.get("_net_keys")
        return cls(path=config.get("_path"), net_keys=tuple(keys) if keys else None, **{
            key.name: key.job_value(config.get(key.name, key.default)) for key in cls.KEYS})

    def to_config(self):
        """The resolved config dict (as ``load_config`` returns it)."""
        first = [key for key in self.KEYS if key.name in RESOLVED_FIRST]
        out = {}
        for key in first + [key for key in self.KEYS if key not in first]:
            value = getattr(self, key.name)
            if value is None and key.default is None:
                continue  # net, graph, backend: absent
            out[key.name] = key.config_value(value)
        out["_path"] = self.path
        if self.net_keys:
            out["_net_keys"] = list(self.net_keys)
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

    @property
    def test_initially(self):
        """``solver.test_initialization`` with its null resolved: true for token
        data (``data.test`` a text source, as nanoGPT evaluates at iteration 0)."""
        value = self.solver.test_initialization
        if value is None:
            return self.data.test is not None and self.data.test.source == "text"
        return bool(value)

    def with_training(self, **solver):
        """The job with some solver keys changed (``max_iter`` of bench, ...)."""
        return dataclasses.replace(self, solver=dataclasses.replace(self.solver, **solver))


def job_of(config):
    """The ``Job`` of a validated config dict; a ``Job`` is returned unchanged."""
    if isinstance(config, Job):
        return config
    return Job.from_config(config)
