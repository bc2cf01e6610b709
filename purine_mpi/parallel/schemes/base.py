"""The ``Scheme`` interface and its registry.

A scheme is how the ranks of a run share one net: ``parallel.scheme`` (and,
for the parameter servers, ``parallel.mode``) of the config names one. Each
scheme is a ``Scheme`` subclass in a module of its own in this package,
registered under its name::

    @register_scheme("pipeline")
    class Pipeline(Scheme):
        staged = True                              # capabilities: class attributes
        keys = ("stages", "schedule", ...)         # the parallel keys it reads

        def layout(self, job, world): ...          # the ranks: a Layout
        def compose(self, graph, grads, job, world): ...   # -> Composition
        def scheme_lines(self, trainer, composition): ...  # the start-up block
        def graph_notes(self, lay, rank, comp=None): ...   # ``graph --np N`` header
        def checkpoint_sections(self, graphs, ws, world, local): ...  # what a save writes
        def gathers_checkpoint(self, graphs): ...   # whether a save gathers the ranks' parts
        def join_checkpoint(self, graphs, parts): ...  # rank 0: the whole blobs from them
        def split_checkpoint(self, graphs, name, value): ...  # this rank's part, on load
        def whole_solver_shapes(self, graphs): ...     # solver state in blobs of its own
        def load_held_solver_state(self, graphs, ws, solver): ...  # ... set on load
        def held_weights(self, graphs): ...    # the blobs holding this rank's weights
        def set_weight(self, graphs, ws, name, value): ...  # a whole weight, on init/load
        def give_test_weights(self, graphs, ws, world, test_ws): ...  # the test graph's weights
        def save_meta(self, graphs): ...       # this rank's part of a save, from its blobs
        def save_bytes(self, graphs, everyone): ...  # the host bytes a save adds (plan)
        def held_bytes(self, graphs): ...   # what the loop's services keep (plan)

Callers look a scheme up (``scheme_of(job)``, ``scheme_class(name, mode)``)
and ask it; nothing outside this package and the config language (job/,
below parallel/: it validates names and their cross-key rules before any
scheme is loaded) compares a scheme's name (tests/test_schemes.py checks).
``SCHEMES`` is the registry, in registration order (the package's
``__init__`` imports every module).

The base class is also "the job's own scheme": a bare ``Scheme()`` (or a
subclass not registered, e.g. a test's) lays out, composes, plans and
notes as the job's registered scheme does (its methods given the job ask
``job_scheme(job)``); it has no capabilities of its own (reading one
raises a TypeError: its class defaults are not the job's), and the
methods given no job (the checkpoint's) are the defaults: their callers
ask ``scheme_of(job)``. Imports ``base/errors`` only (the
schemes import their compositions: steps.py and the modules of parallel/,
which never import a scheme).
"""
import dataclasses
import types

import numpy as np


#: registered name -> Scheme subclass, in registration order
SCHEMES = {}

#: the parallel keys the schemes' notes speak of (job/schema.py's PARALLEL):
#: those that shape the allreduce of gradient buckets (scheme data, mode sync;
#: hybrid), and the parameter servers'
BUCKET_KEYS = ("bucket_mb", "first_bucket_mb", "min_buckets")
SERVER_KEYS = ("ps_ranks", "max_staleness")


def register_scheme(name, scheme=None, modes=("sync",)):
    """Register a ``Scheme`` subclass under ``name``. ``scheme``: the
    ``parallel.scheme`` value that selects it (default ``name``); ``modes``:
    the ``parallel.mode`` values it runs."""
    def deco(cls):
        if name in SCHEMES:
            raise ValueError(f"scheme {name!r} registered twice")
        cls.name, cls.config_name, cls.modes = name, scheme or name, tuple(modes)
        SCHEMES[name] = cls
        return cls
    return deco


def scheme_names():
    """The ``parallel.scheme`` values, in registration order, once each."""
    return tuple(dict.fromkeys(cls.config_name for cls in SCHEMES.values()))


def scheme_class(scheme, mode="sync"):
    """The registered class that runs ``parallel.scheme: scheme`` with
    ``parallel.mode: mode``, or None."""
    for cls in SCHEMES.values():
        if cls.config_name == scheme and mode in cls.modes:
            return cls
    return None


def mode_class(mode):
    """The registered class that owns a mode other than ``sync`` (the
    parameter servers' ``async`` and ``sync_ps``), or None."""
    return next((cls for cls in SCHEMES.values() if cls.servers and mode in cls.modes), None)


def scheme_of(job):
    """The scheme of ``job`` (job/job.py): an instance of its registered class."""
    par = job.parallel
    cls = scheme_class(par.scheme, par.mode) or mode_class(par.mode)
    if cls is None:  # parallel.scheme: auto, before train or plan --choose chose one
        from ...base.errors import ConfigError  # the key: its line, or the --set that wrote it
        raise ConfigError(job.path, "parallel.scheme", f"{par.scheme} is chosen by train "
                          "at start-up, or shown by plan --np N --choose; this command needs "
                          "the scheme itself: give it with --set parallel.scheme=...")
    return cls()


def run_scheme_of(job, world_size):
    """The scheme a run of ``world_size`` ranks of ``job`` trains under, as
    train/trainer.run_training dispatches it: on several ranks a
    parameter-server ``parallel.mode`` starts the servers whatever
    ``parallel.scheme`` names (scheme none too: its class runs those modes
    on one rank only), so its workers' scheme (``mode_class``); else
    ``scheme_of(job)``. What ``graph --np``, ``plan`` and the scaling model
    ask where they stand for a run."""
    served = mode_class(job.parallel.mode)
    return served() if world_size > 1 and served is not None else scheme_of(job)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a rank sits: ``replicas`` x ``stages`` ranks (see
    parallel/compose.py); the data is sharded over the replicas (docs/config.md,
    "Sample order")."""

    scheme: str
    replicas: int
    stages: int
    replica: int
    stage: int
    micro_batches: int = 1
    tensor: int = 1           # the ranks of a tensor-parallel group (scheme tensor;
    #                           scheme pipeline with parallel.tensor_parallel)
    shard: int = 0            # this rank's place in its group

    # rank = (replica * stages + stage) * tensor + shard: the tensor shards
    # fastest, then the stages, then the replicas; with one shard it is the
    # staged schemes' replica * p + stage, with one stage scheme tensor's
    # replica * t + shard (parallel/compose.py)
    def rank(self, replica, stage, shard=None):
        """The rank of ``replica``'s stage ``stage`` that holds tensor shard
        ``shard`` (default: this rank's)."""
        k = self.shard if shard is None else shard
        return (replica * self.stages + stage) * self.tensor + k

    def test_shard(self, apart=False):
        """(replica, replicas): the test split's shard this rank's test graph
        reads: its replica's, or where the replicas train ``apart`` (scheme
        none) the whole split (rank 0 evaluates the saved model alone)."""
        return (0, 1) if apart else (self.replica, self.replicas)

    def tensor_ranks(self, replica=None, stage=None):
        """The ranks of one tensor-parallel group (default: this rank's
        replica; this rank's stage)."""
        r = self.replica if replica is None else replica
        s = self.stage if stage is None else stage
        return [self.rank(r, s, k) for k in range(self.tensor)]

    def shard_ranks(self, shard=None):
        """The ranks holding shard ``shard`` (default: this rank's) of this
        rank's stage, one per replica."""
        return [self.rank(r, self.stage, shard) for r in range(self.replicas)]

    def tensor_groups(self):
        """Every tensor-parallel group (each replica's, each stage's)."""
        return [self.tensor_ranks(r, s) for r in range(self.replicas) for s in range(self.stages)]

    def shard_groups(self):
        """Every group of the ranks holding one shard of one stage."""
        return [[self.rank(r, s, k) for r in range(self.replicas)]
                for s in range(self.stages) for k in range(self.tensor)]

    def stage_ranks(self, stage=None):
        """The ranks that hold stage ``stage`` (default: this rank's) and this
        rank's tensor shard, one per replica."""
        s = self.stage if stage is None else stage
        return [self.rank(r, s) for r in range(self.replicas)]

    def all_stage_ranks(self, stage):
        """Every rank of stage ``stage``: its replicas' tensor groups."""
        return [self.rank(r, stage, k) for r in range(self.replicas) for k in range(self.tensor)]

    def replica_ranks(self, replica=None):
        """The ranks of one replica (default: this rank's), stage order (and
        in a stage its tensor shards)."""
        r = self.replica if replica is None else replica
        return [self.rank(r, s, k) for s in range(self.stages) for k in range(self.tensor)]

    @property
    def staged(self):
        return self.stages > 1

    def describe(self):
        """E.g. ``[hybrid: 2 replicas x 2 stages, 4 micro-batches, 4 ranks]``."""
        n = self.replicas * self.stages * self.tensor
        parts = [f"{self.scheme}: {count(self.replicas, 'replica')}"
                 + (f" x {count(self.stages, 'stage')}" if self.staged else "")
                 + (f" x {self.tensor}-way tensor" if self.tensor > 1 else "")]
        if self.micro_batches > 1:
            parts.append(count(self.micro_batches, "micro-batch", "micro-batches"))
        return "[" + ", ".join(parts + [count(n, "rank")]) + "]"

    def as_dict(self):
        return dataclasses.asdict(self)

    def same_shape(self, other):
        """Same scheme, replicas, stages and micro-batches (positions aside)."""
        keys = ("scheme", "replicas", "stages", "micro_batches")
        return all(getattr(self, k) == other.get(k) for k in keys) and \
            self.tensor == other.get("tensor", 1)


def count(n, one, many=None):
    return f"{n} {one if n == 1 else many or one + 's'}"


def counted(n, one, many=None):
    """``1 bucket``, ``1,024 layers`` (the start-up block's counts)."""
    return f"{n:,} {one if n == 1 else many or one + 's'}"


def ranges(ranks):
    """``0-3, 6, 8-9`` from a list of ranks."""
    ranks = sorted(ranks)
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def ranks_word(ranks):
    """``rank 3`` or ``ranks 0-2``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranges(ranks)}"


@dataclasses.dataclass
class Composition:
    """What a scheme's composition gives the trainer: the graph this rank
    runs and the facts about it that the start-up block, ``graph --np N``
    and the memory plan read."""

    graph: object                  # this rank's composed training graph
    layout: Layout                 # this rank's place
    bucket_plan: list = None       # the allreduce buckets (data_parallel.plan_buckets)
    tensor_plan: tuple = ()        # scheme tensor: one line per split pair
    transport: list = None         # [(what, how, why)]: how the bytes travel
    windows: object = None         # the windows allocated for it (comm/windows.Windows)
    #: (WindowLayout, {rank: node}) of the one-sided transport's windows, made
    #: offline too (graph --np, plan): what runtime/footprint.py counts; a list
    #: of them where windows are allocated apart (scheme sharded at shard 3
    #: with stages: the stage transfers' and the weights'; ``windows`` too)
    window_placement: tuple = None
    #: scheme sharded: the stage-1 buckets (parallel/sharding.compose_zero1's plan)
    shard_plan: list = None
    #: scheme sharded: the ZeRO stage it shards at (parallel.shard), 0 where
    #: nothing is sharded (one rank, one replica); the same on every rank,
    #: unlike ``shard_plan`` (a pipeline stage without parameters has no bucket)
    shard: int = 0
    #: a parameter-server worker: the servers' plan (parallel/param_server.plan_param_server)
    server_plan: dict = None


#: the capability attributes of ``Scheme`` (callers ask these, never the name)
CAPABILITIES = ("staged", "exchanges_gradients", "allreduces", "servers", "micro_batches",
                "gpu", "nccl", "one_sided", "deferrable", "defer_loss_readback",
                "defers_update", "shards_state")


class Capability:
    """A capability's default on ``Scheme``: what a registered scheme (its
    class, an instance, a subclass of it such as a parameter-server worker)
    reads unless it declares its own. A stand-in for the job's scheme (an
    unregistered class: the bare ``Scheme``, compose.JobScheme, a test's
    subclass of them) has no capabilities: the default is not the job's
    (scheme none exchanges no gradients), so reading one raises a TypeError."""

    def __init__(self, default):
        self.default = default

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, cls=None):
        cls = type(obj) if cls is None else cls
        if cls.name is None:
            raise TypeError(f"{cls.__name__}.{self.name}: {cls.__name__} stands for the job's "
                            "scheme, whose capabilities are its own: ask scheme_of(job)."
                            f"{self.name} or {cls.__name__}().job_scheme(job).{self.name}")
        return self.default


def _refuse_own_capabilities(cls):
    """A TypeError when stand-in class ``cls`` (or a class between it and
    ``Scheme``) declares a capability: the job's scheme would answer
    instead, the declaration silently ignored."""
    for klass in cls.__mro__:
        if klass is Scheme:
            return
        own = sorted(set(vars(klass)) & set(CAPABILITIES))
        if own:
            raise TypeError(f"{klass.__name__} sets {', '.join(own)}, but as a stand-in for the "
                            "job's scheme (not registered) it takes every capability from "
                            "scheme_of(job): set it on that class (type(scheme_of(job))) or "
                            "register a scheme")


class Scheme:
    """How a trainer's rank takes part in its parallel scheme: its layout,
    the graph it runs and what the start-up block says of it (the decisions
    it shares with other ranks during the run, the stop agreement and the
    checkpoints, are loop services: train/signals.py, train/ps_worker.py)."""

    name = None                    # the registry's name (register_scheme)
    config_name = None             # the parallel.scheme value that selects it
    modes = ("sync",)              # the parallel.mode values it runs
    #: the parallel keys it reads besides the common ones (the others that
    #: are set get a "has no effect" note: settings_without_effect)
    keys = ()

    # ---- capabilities (callers ask these, never the name): a registered
    # scheme's class attributes, their defaults here (``Capability``); a
    # stand-in has none of its own (reading one raises: ``job_scheme``)
    #: layers placed on ranks by parallel.stages (a staged layout)
    staged = Capability(False)
    #: gradients summed over the ranks (allreduce buckets or servers)
    exchanges_gradients = Capability(True)
    #: gradients summed by allreduce buckets (parallel.bucket_mb ...)
    allreduces = Capability(True)
    #: workers and parameter-server ranks
    servers = Capability(False)
    #: takes parallel.micro_batches > 1
    micro_batches = Capability(True)
    #: runs on a GPU (job.device >= 0)
    gpu = Capability(True)
    #: its buckets can go through NCCL (parallel.backend)
    nccl = Capability(False)
    #: its transfers can go through windows (parallel.transport)
    one_sided = Capability(False)
    #: a deferred tail may run the last updates into the next iteration
    #: (the composition marks its graph ``deferrable``, runtime/memory_plan.py)
    deferrable = Capability(True)
    #: on a GPU, the trainer reads the loss back only at the display, test and
    #: checkpoint intervals (and before a checkpoint a signal asks for)
    defer_loss_readback = Capability(True)
    #: the CPU event dispatcher may finish the last allreduces and updates
    #: while the next iteration starts (parallel.defer_update)
    defers_update = Capability(True)
    #: ZeRO: each rank holds its own shards of the optimizer state (and of the
    #: gradients, weights), cut per bucket: ranks differ by where their shard
    #: falls (tools/plan.py builds each cut apart)
    shards_state = Capability(False)

    def job_scheme(self, job):
        """The registered scheme this one stands for: itself, or (a stand-in:
        a bare ``Scheme``, compose.JobScheme, an unregistered subclass) the
        job's, ``scheme_of(job)``: ask it the capabilities. A stand-in's class
        that declares a capability of its own (a class attribute, a patch)
        is refused: it would be ignored, the job's scheme answering."""
        if type(self).name is not None:
            return self
        _refuse_own_capabilities(type(self))
        return scheme_of(job)

    # ---- layout and composition
    def layout(self, job, world):
        """This rank's Layout: one rank per replica."""
        own = self.job_scheme(job)
        if own is not self:
            return own.layout(job, world)
        par = job.parallel
        return Layout(par.scheme, world.size, 1, world.rank, 0, par.micro_batches)

    def compose(self, graph, grads, job, world):
        """This rank's training graph from one replica's: a Composition."""
        return self.job_scheme(job).compose(graph, grads, job, world)

    def compose_test(self, graph, job, world):
        """This rank's test graph (each replica reads its own shard): a Composition."""
        own = self.job_scheme(job)
        if own is not self:
            return own.compose_test(graph, job, world)
        return Composition(graph, self.layout(job, world))

    def plan_memory(self, graph, job, world):
        """Share the buffers of micro-batch copies never live at once
        (parallel/micro_memory.py), on the graph as it will run."""
        from ..micro_memory import plan_for_layout
        return plan_for_layout(graph, self.layout(job, world), job.parallel.schedule,
                               arena=job.memory_plan)

    def trains_apart(self, job, lay):
        """Whether the replicas of layout ``lay`` train apart: several that
        exchange no gradients (scheme none). A save writes rank 0's replica
        and a test pass evaluates it over the whole split, rank 0 alone
        (parallel/rank_graphs.RankGraphs.apart)."""
        return not self.job_scheme(job).exchanges_gradients and lay.replicas > 1

    def defer_update_applies(self, job, replicas, staged):
        """Whether ``parallel.defer_update`` takes effect (runtime/tail.py): set
        in the config, several replicas reducing gradients, no stages, on the CPU
        (the GPU dispatchers end every iteration with every op done); a
        composition that is not ``deferrable`` declines."""
        return job.parallel.defer_update and replicas > 1 and not staged and job.device < 0 \
            and self.job_scheme(job).deferrable

    def update_deferred(self, job, lay):
        """Whether the dispatcher defers the last updates into the next
        iteration (runtime/tail.py) on layout ``lay``: the scheme
        ``defers_update`` and ``defer_update_applies``."""
        return self.job_scheme(job).defers_update and \
            self.defer_update_applies(job, lay.replicas, lay.staged)

    # ---- the settings
    def settings_without_effect(self, job, world_size):
        """Notes (one line each) on the ``parallel`` settings that do nothing,
        or something else than they say, in a run of ``world_size`` ranks, so
        that none is ignored silently: a parameter-server mode or a staged
        scheme on one rank, bucket keys where nothing is allreduced, keys of
        another mode or scheme, ``mode: async`` with ``max_staleness: 0``. A key
        counts as set when it differs from its default (docs/config.md)."""
        own = self.job_scheme(job)
        if own is not self:
            return own.settings_without_effect(job, world_size)
        par = job.parallel
        notes = []
        changed = par.changed()

        def note(keys, one, many=None):
            """A note on the keys that are set: ``one`` of one key, ``many`` of several."""
            keys = [k for k in keys if k in changed]
            if keys:
                text = one if len(keys) == 1 or many is None else many
                notes.append(f"note: parallel.{', parallel.'.join(keys)} {text}")
                changed.difference_update(keys)

        served = mode_class(par.mode)  # the parameter servers' mode, whatever the scheme
        if world_size == 1:
            if served is not None:
                served.mode_notes(job, note, changed)
            self.one_rank_notes(job, note, changed)
            if self.exchanges_gradients:
                note(list(BUCKET_KEYS) + ["split_params", "check_collectives", "grad_dtype"],
                     "has no effect on 1 rank: there are no gradients to allreduce",
                     "have no effect on 1 rank: there are no gradients to allreduce")
            note(["transport"], "has no effect on 1 rank: no bytes travel between ranks")
        elif served is not None:
            notes += served.many_rank_notes(job)
        why = self.why_no_buckets(par) or (served.why_no_buckets(par) if served else None) \
            or (self.why_none_reduced(job, world_size) if world_size > 1 else None)
        if why:
            what = "allreduce buckets (scheme data with mode sync, or hybrid)"
            note(list(BUCKET_KEYS) + ["split_params"], f"shapes {what}; {why}, so it has no "
                 "effect", f"shape {what}; {why}, so they have no effect")
        # parallel.grad_dtype: the dtype the buckets are reduced in (the config
        # rules accept it where nothing is reduced: job/config.py)
        if why:
            note(["grad_dtype"], f"sets the dtype the gradient buckets are reduced in; {why}, "
                 "so it has no effect: the gradients stay float32")
        why = self.why_no_transport(job, world_size) if world_size > 1 else None
        if why:
            note(["transport"], "chooses windows or two-sided Send/Recv for the bytes between "
                 f"ranks; {why}, so it has no effect")
        if served is None:
            what = f"parameter servers (mode {_or(_server_modes())}) only; mode {par.mode} has none"
            note(list(SERVER_KEYS), f"applies to {what}, so it has no effect",
                 f"apply to {what}, so they have no effect")
        else:
            served.served_key_notes(par, note)
        self.key_notes(par, note, world_size)
        if "defer_update" in changed and not self.defers_anything(job, world_size):
            which = " and ".join(dict.fromkeys(c.config_name for c in SCHEMES.values()
                                               if c.defers_update and c.deferrable
                                               and not c.staged))
            note(["defer_update"], f"false keeps every update inside its iteration; with "
                 f"scheme {par.scheme} on {count(world_size, 'rank')} none is deferred anyway "
                 "(updates are deferred on the CPU, with several replicas and no stages, under "
                 f"schemes {which}), so it has no effect")
        if par.micro_batches == 1:
            note(["schedule"], "orders the micro-batches of parallel.micro_batches; with one "
                 "micro-batch it has no effect")
        if "ignore_label_mean" in changed:  # (the layout asked only then)
            if served is not None and par.micro_batches == 1:
                note(["ignore_label_mean"], "normalises a loss's shards by the global batch's "
                     "count; the parameter-server modes keep each worker's own mean (over "
                     "its micro-batches, where it has several), so with one micro-batch it "
                     "has no effect")
            elif self.shards(job, world_size) == 1:
                note(["ignore_label_mean"], "normalises a loss's shards (replicas x "
                     "micro-batches) by the global batch's count; with one shard it has no "
                     "effect")
        return notes

    def shards(self, job, world_size):
        """The data shards of one update in a run of ``world_size`` ranks:
        replicas (where they exchange gradients) x micro-batches (0: a
        world the layout refuses)."""
        from ...base.errors import UserError
        own = self.job_scheme(job)
        try:
            lay = own.layout(job, types.SimpleNamespace(size=world_size, rank=0))
        except UserError:  # a world the layout refuses (exit 2 when it runs): no note
            return 0
        return (lay.replicas if own.exchanges_gradients else 1) * job.parallel.micro_batches

    def defers_anything(self, job, world_size):
        """Whether ``parallel.defer_update: true`` (the default) defers any
        update in a run of ``world_size`` ranks (``update_deferred``)."""
        from ...base.errors import UserError
        own = self.job_scheme(job)
        default = job.replace(parallel=dataclasses.replace(job.parallel, defer_update=True))
        try:
            lay = own.layout(default, types.SimpleNamespace(size=world_size, rank=0))
        except UserError:  # a world the layout refuses (exit 2 when it runs): no note
            return True
        return own.update_deferred(default, lay)

    def one_rank_notes(self, job, note, changed):
        """The notes of a run on one rank, where the scheme does nothing."""

    def why_no_buckets(self, par):
        """Why the bucket keys have no effect under this scheme, or None."""
        return None

    def why_none_reduced(self, job, world_size):
        """Why no gradient bucket is reduced in a run of ``world_size`` > 1
        ranks under this scheme's layout (so the bucket keys and
        ``grad_dtype`` have no effect), or None."""
        return None

    def why_no_transport(self, job, world_size):
        """Why ``parallel.transport`` has no effect in a run of
        ``world_size`` > 1 ranks under this scheme (no transfer it shapes),
        or None."""
        return None

    def key_notes(self, par, note, world_size):
        """The keys of other schemes (``keys``) this one ignores (in a run of
        ``world_size`` ranks)."""
        for key in ("stages", "tensor_parallel", "shard", "prefetch", "reduce_scatter"):
            if key in self.keys:
                continue
            users = [n for n in scheme_names() if key in _keys_of(n)]
            which = f"schemes {' and '.join(users)}" if len(users) > 1 else f"scheme {users[0]}"
            note([key], f"applies to {which} only; scheme {par.scheme} ignores it")

    # ---- reporting
    def scheme_lines(self, trainer, composition):
        """[(label, text)] of the start-up block on several ranks: which ranks
        do what, and how the bytes travel."""
        return transport_lines(composition)

    def graph_notes(self, lay, rank, comp=None):
        """The ``graph --np N`` header line of this rank's place (``comp``:
        its Composition, when there is one), or None."""
        return None

    def startup_lines(self, trainer, composition):
        """The start-up block's scheme rows (one rank: no scheme)."""
        own = self.job_scheme(trainer.job)
        if own is not self:
            return own.startup_lines(trainer, composition)
        if trainer.world.size == 1:
            return [("scheme", "one rank, no parallel scheme")]
        return self.scheme_lines(trainer, composition)

    def server_ranks(self):
        """{"workers": [...], "servers": [...]} of a parameter-server worker, else None."""
        return None

    # ---- checkpoints (whole blobs on file: any scheme resumes any other's)
    def checkpoint_sections(self, graphs, ws, world, local):
        """The ``/params`` and ``/solver`` sections a save writes, whole
        (train/checkpoints.py). ``local()``: this rank's part, ``(params,
        solver)`` dicts of ``held_weights`` and the per-parameter solver
        state. On rank 0 each section is a dict or a ``Streamed`` one
        (job/checkpoint_file.py: its pairs come, and their collectives run,
        as the file is written); every other rank iterates its sections'
        ``items()`` for their collectives, in the same order, and writes
        nothing. Collective: by default, when ``gathers_checkpoint`` (the
        stages' and tensor shards' layouts), streamed parameter by parameter
        (``streamed_join``): rank 0 holds one parameter's whole weight and
        state at a time beyond its own, and the file is the one
        ``join_checkpoint`` makes of every rank's parts. What each rank
        holds meanwhile is ``save_bytes``'s figure: change them together."""
        params, solver = local()
        if not self.gathers_checkpoint(graphs):
            return params, solver
        if world.size == 1:
            return self.join_checkpoint(graphs, [(params, solver)])
        return streamed_join(graphs, world, params, solver)

    # ---- what a save holds (``plan``'s "checkpoint save" row)
    def save_meta(self, graphs):
        """This rank's part of a save as ``save_bytes`` reads it, from the
        graph's blobs (no workspace): ``stream_meta`` of ``held_weights`` and
        the per-parameter solver state blobs (``state_blobs``)."""
        blobs = graphs.graph.blobs
        return stream_meta(graphs, {p: blobs[p] for p in self.held_weights(graphs)},
                           state_blobs(graphs))

    def save_ranks(self, graphs):
        """The ranks whose part (``save_meta``) rank 0's ``save_bytes``
        reads: replica 0's (``plan`` builds them where it builds fewer)."""
        return range(graphs.layout.stages * graphs.layout.tensor)

    def save_bytes(self, graphs, everyone):
        """The host bytes this rank holds beyond its footprint while a save
        runs (``checkpoint_sections`` then the writer), at their most:
        ``everyone`` is {rank: ``save_meta``} of at least replica 0's ranks
        (the ranks rank 0 gathers from). A rank whose weights or solver
        state are on a GPU copies its part to the host (``local()``:
        ``to_numpy``); on rank 0 of a layout that ``gathers_checkpoint``,
        ``stream_bytes`` (the receive buffers, the tensor splits' joins);
        every other rank sends its own arrays (nothing more)."""
        lay = graphs.layout
        out = host_copies(graphs, self.held_weights(graphs))
        rank = lay.rank(lay.replica, lay.stage)
        if rank == 0 and self.gathers_checkpoint(graphs) and \
                lay.replicas * lay.stages * lay.tensor > 1:
            out += stream_bytes(lay, everyone)
        return out

    def held_bytes(self, graphs):
        """Host bytes this rank's loop services keep between iterations
        besides its workspaces, from a save or a test pass on (``plan``'s
        "other kept blobs" row counts them): none by default."""
        return 0

    def gathers_checkpoint(self, graphs):
        """Whether a save gathers every rank's (params, solver state) to
        rank 0 (train/checkpoints.py; ``graphs``: the RankGraphs)."""
        return False

    def join_checkpoint(self, graphs, parts):
        """Rank 0's whole (params, solver state) from every rank's
        (``parts``, world order)."""
        return parts[0]

    def split_checkpoint(self, graphs, name, value):
        """This rank's part of blob ``name``'s whole value from a checkpoint."""
        return value

    # solver state not held per parameter (``state_name(p, s)`` blobs): a
    # sharded run holds one flat blob per bucket and state, its shard's part
    # (a save writes it through ``checkpoint_sections``)
    def whole_solver_shapes(self, graphs):
        """{(param, state): (shape, dtype)} of the state held that way, as a
        checkpoint holds it (whole, per parameter)."""
        return {}

    def load_held_solver_state(self, graphs, ws, solver):
        """Set the state held that way from a checkpoint's whole
        ``{param: {state: value}}``; returns the (param, state) pairs it
        lacked (they start from zero)."""
        return set()

    # weights not held whole (ZeRO stage 3: each rank holds its shard of each
    # bucket's flat weights; the parameters' own blobs are transient views)
    def held_weights(self, graphs):
        """The blobs that hold this rank's weights between iterations: what
        a save reads (then ``checkpoint_sections``) and the divergence check
        tests for finite values. The parameters by default."""
        return list(graphs.params)

    def set_weight(self, graphs, ws, name, value):
        """Set parameter ``name`` from its whole ``value`` (after
        ``split_checkpoint``): fillers, ``--init``, ``--resume``."""
        ws.set(name, value)

    def give_test_weights(self, graphs, ws, world, test_ws):
        """Fill the test workspace ``test_ws``'s parameters that do not
        share the training workspace ``ws``'s arrays
        (runtime/footprint.shared_params) before an evaluation (collective
        on every rank). Nothing by default: the test graph reads the
        training arrays; ZeRO-3 gathers its weight shards into them."""
        return None


def state_blobs(graphs):
    """{param: {state: blob}}: the graph's per-parameter solver state blobs
    (``<param>.<state>``), what a save's ``local()`` lists of them."""
    params, held = set(graphs.params), {}
    for name, blob in graphs.graph.blobs.items():
        owner, _, state = name.rpartition(".")
        if blob.kind == "state" and "@" not in name and owner in params:
            held.setdefault(owner, {})[state] = blob
    return held


def host_copies(graphs, weights):
    """The bytes of the host copies a save makes of this rank's part
    (``to_numpy`` of ``weights`` and the solver state, ``state_blobs``):
    those on a GPU."""
    blobs = graphs.graph.blobs
    held = {name: blobs[name] for name in weights if "@" not in name}
    held.update((blob.name, blob) for states in state_blobs(graphs).values()
                for blob in states.values())
    return sum(blob.nbytes for blob in held.values()
               if blob.location.device >= 0 and blob.shape is not None)


class Buffers:
    """Rank 0's receive buffers of a streamed save: slot i, a byte buffer
    kept at the largest size asked of it, each gather a view of it."""

    def __init__(self):
        self.slots = []

    def view(self, slot, size, dtype):
        dtype = np.dtype(dtype)
        while len(self.slots) <= slot:
            self.slots.append(np.empty(0, np.uint8))
        if self.slots[slot].size < size * dtype.itemsize:
            self.slots[slot] = np.empty(size * dtype.itemsize, np.uint8)
        return self.slots[slot][:size * dtype.itemsize].view(dtype)


def streamed_join(graphs, world, params, held_states, plan=None):
    """``Streamed`` ``/params`` and ``/solver`` sections of a staged or
    tensor-split layout: the datasets ``join_checkpoint`` makes of every
    rank's ``(params, solver)`` (Pipeline's, TensorParallel's:
    ``tensor_parallel.gather_whole``; ``plan``: another join's), in its
    order, each parameter's pieces sent to rank 0 as its turn comes. One
    allgather of every rank's list of names, shapes, dtypes and splits;
    from it ``plan`` (default ``_stream_plan``) makes the same order and
    holders on every rank. Then per parameter and array one Igatherv of
    bytes over the world (``World.gatherv``, under the stall watchdog
    naming it), every rank taking part, those holding none of it with
    nothing to send; a parameter rank 0 alone holds needs none. Rank 0's
    buffers (``Buffers``) are reused parameter after parameter. A weight's
    value may be a pair ``(whole shape, 1-D piece)``: a piece of it,
    joined with the other holders' (scheme sharded's stage-3 weight
    shards)."""
    from ...job.checkpoint_file import Streamed
    everyone = world.allgather_object(stream_meta(graphs, params, held_states),
                                      "the checkpoint's list of parameters (Iallgatherv)")
    weights, states = (plan or _stream_plan)(graphs.layout, everyone)
    pool = Buffers()

    def weight_pairs():
        for p, (split, groups) in weights.items():
            holders = [r for ranks, _ in groups for r in ranks]
            got = _fetch(world, pool, 0, groups, {r: everyone[r][0][p][:2] for r in holders},
                         _piece(params.get(p)), f"the checkpoint's gather of the weight '{p}' "
                         f"from ranks {holders} (Igatherv)")
            if got is not None:
                yield p, _whole(split, got)

    def state_pairs():
        for p, named in states.items():
            values = {}
            for i, (s, (split, groups)) in enumerate(named.items()):
                holders = [r for ranks, _ in groups for r in ranks]
                got = _fetch(world, pool, i, groups,
                             {r: everyone[r][1][p][s] for r in holders},
                             held_states.get(p, {}).get(s), f"the checkpoint's gather of the "
                             f"solver state '{s}' of '{p}' from ranks {holders} (Igatherv)")
                if got is not None:
                    values[s] = _whole(split, got)
            if world.rank == 0:
                yield p, values

    return Streamed(weight_pairs()), Streamed(state_pairs())


def stream_meta(graphs, params, held_states):
    """This rank's list of its part of a streamed save (``streamed_join``
    allgathers it): ``({param: (shape, dtype, split, whole shape of a
    piece)}, {param: {state: (shape, dtype)}})`` of ``params`` {name:
    array, or ``(whole shape, 1-D piece)``} and ``held_states`` {param:
    {state: array}}; anything with a shape and a dtype stands for an array
    (``Scheme.save_meta``: the graph's blobs, before any workspace)."""
    from ..tensor_split import split_of
    return ({p: (tuple(_piece(v).shape), np.dtype(_piece(v).dtype).str,
                 split_of(graphs.graph.blobs[p]) if p in graphs.graph.blobs else None,
                 tuple(v[0]) if isinstance(v, tuple) else None) for p, v in params.items()},
            {p: {s: (tuple(v.shape), np.dtype(v.dtype).str) for s, v in states.items()}
             for p, states in held_states.items()})


def stream_bytes(lay, everyone, plan=None):
    """The bytes rank 0 holds beyond its own while ``streamed_join``
    streams a save with ``plan`` (default ``_stream_plan``; ``everyone``:
    {rank: ``stream_meta``} of the ranks the plan reads): its receive
    buffers (``Buffers``: slot i at the largest array gathered into it, the
    weights into slot 0, a parameter's i-th state into slot i) and the
    arrays ``_fetch`` and ``_whole`` make anew: a group's pieces not one
    span of the buffer copied together, a tensor split's shards joined
    (the copies freed once joined). The writer still holds the previous
    parameter's arrays while the next is made, and a parameter's earlier
    states while its next one is. A parameter rank 0 alone holds takes
    none of it: its own array is written."""
    weights, states = (plan or _stream_plan)(lay, everyone)
    slots = {}

    def take(slot, split, groups, shapes):
        """(bytes made while this array is, bytes its array keeps)."""
        size = {r: int(np.prod(shapes[r][0], dtype=np.int64)) * np.dtype(shapes[r][1]).itemsize
                for ranks, _ in groups for r in ranks}
        if list(size) == [0]:
            return 0, 0
        slots[slot] = max(slots.get(slot, 0), sum(size.values()))
        order = sorted(size)
        copies = sum(sum(size[r] for r in ranks) for ranks, _ in groups
                     if not _one_span(order, ranks))
        joined = sum(size.values()) if split and len(groups) > 1 else 0
        return copies + joined, joined if joined else copies

    def peak(items):
        """The most a section's parameters hold at once, the previous one's kept."""
        most, before = 0, 0
        for arrays in items:
            kept = 0
            for made, keeps in arrays:
                most = max(most, before + kept + made)
                kept += keeps
            before = kept
        return most

    held = peak([take(0, split, groups, {r: everyone[r][0][p][:2] for ranks, _ in groups
                                         for r in ranks})]
                for p, (split, groups) in weights.items())
    held = max(held, peak([take(i, split, groups, {r: everyone[r][1][p][s] for ranks, _ in groups
                                                   for r in ranks})
                           for i, (s, (split, groups)) in enumerate(named.items())]
                          for p, named in states.items()))
    return sum(slots.values()) + held


def _piece(value):
    """A listed weight's array: itself, or of a ``(whole shape, piece)``
    pair the piece."""
    return value[1] if isinstance(value, tuple) else value


def _stream_plan(lay, everyone):
    """What ``join_checkpoint`` does with every rank's parts, from their
    lists (``everyone``: per rank ``({param: (shape, dtype, split, whole
    shape of a piece)}, {param: {state: (shape, dtype)}})``): ``({param:
    (split, groups)}, {param: {state: (split, groups)}})`` in the joined
    file's order, ``groups`` a list of ``(ranks, shape)``: the ranks whose
    pieces, in order, make an array of that shape; a split parameter's
    groups are its tensor shards, joined. Replica 0's groups, stage by
    stage: a group's shard 0 lists the parameters; a split one is joined
    from every shard of its group (tensor shards), any other taken from
    shard 0; a parameter listed by a later stage's group too is that
    group's (a dict's update)."""
    weights, states = {}, {}
    for s in range(lay.stages):
        group = lay.tensor_ranks(0, s)
        first_params, first_state = everyone[group[0]]
        for p, (shape, _, split, _) in first_params.items():
            whole = split if lay.tensor > 1 else None
            weights[p] = (whole, [([r], everyone[r][0][p][0]) for r in group] if whole
                          else [([group[0]], shape)])
        for p, names in first_state.items():
            whole = first_params[p][2] if lay.tensor > 1 and p in first_params else None
            states[p] = {x: (whole, [([r], everyone[r][1][p][x][0]) for r in group] if whole
                             else [([group[0]], shape)]) for x, (shape, _) in names.items()}
    return weights, states


def _fetch(world, pool, slot, groups, shapes, mine, what):
    """Rank 0's arrays (None elsewhere) of one array held in pieces by the
    ranks of ``groups`` (``[(ranks, shape)]``: pieces that, in that order,
    make one array of that shape; ``shapes``: {rank: (piece shape, dtype)};
    ``mine``: this rank's piece): one Igatherv into ``pool``'s ``slot``
    (rank order), or none when rank 0 alone holds it. A group whose ranks
    lie in rank order, one after the other in the buffer, is a view of it;
    another's pieces are copied together."""
    holders = [r for ranks, _ in groups for r in ranks]
    if holders == [0]:
        return [np.reshape(mine, groups[0][1])] if world.rank == 0 else None
    dtype = np.dtype(shapes[holders[0]][1])
    sizes = {r: int(np.prod(shapes[r][0], dtype=np.int64)) for r in holders}
    counts = [sizes.get(r, 0) * dtype.itemsize for r in range(world.size)]
    send = np.ascontiguousarray(mine, dtype=dtype) if world.rank in sizes \
        else np.empty(0, np.uint8)
    recv = pool.view(slot, sum(sizes.values()), dtype) if world.rank == 0 else None
    world.gatherv(send, recv, counts, 0, what)
    if recv is None:
        return None
    order = sorted(sizes)
    offsets = dict(zip(order, np.cumsum([0] + [sizes[r] for r in order])))
    arrays = []
    for ranks, shape in groups:
        if _one_span(order, ranks):
            arrays.append(recv[offsets[ranks[0]]:offsets[ranks[0]] +
                               sum(sizes[r] for r in ranks)].reshape(shape))
        else:
            arrays.append(np.concatenate([recv[offsets[r]:offsets[r] + sizes[r]]
                                          for r in ranks]).reshape(shape))
    return arrays


def _one_span(order, ranks):
    """Whether the pieces of ``ranks`` lie one after the other in a buffer
    gathered in rank ``order`` (``_fetch`` then takes a view of it;
    ``stream_bytes`` counts no copy)."""
    at = order.index(ranks[0])
    return ranks == order[at:at + len(ranks)]


def _whole(split, arrays):
    """A parameter's whole array from its groups' arrays (``_fetch``): a
    tensor split's shards joined (``tensor_split.join_shards``), else the
    one group's array."""
    if split and len(arrays) > 1:
        from ..tensor_split import join_shards
        return join_shards(split, arrays)
    return arrays[0]


def transport_lines(composition):
    """The start-up block's transport rows of a composition."""
    return [("transport", f"{what}: {how} ({why})")
            for what, how, why in (composition.transport if composition else None) or ()]


def _keys_of(config_name):
    return {k for c in SCHEMES.values() if c.config_name == config_name for k in c.keys}


def _server_modes():
    return [m for c in SCHEMES.values() if c.servers for m in c.modes]


def _or(words):
    return " or ".join(words)
