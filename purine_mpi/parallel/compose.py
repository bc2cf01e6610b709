"""From the job's ``parallel`` section to the graph a rank runs.

The trainer builds one replica's training graph, hands it to a ``Scheme``
and runs what comes back; everything scheme-specific lives here and in the
modules this one calls (nothing in ``parallel/`` imports the trainer):

    scheme = Scheme()                          # data / pipeline / hybrid / tensor / none
    local = scheme.compose(graph, grads, job, world)

    layout = layout_of(job, world)             # replicas x stages; this rank's place
    compose(graph, grads, job, world)          # the data-parallel, pipeline or hybrid slice
    compose_stages(graph, job, world)          # a staged scheme's slice (train or test)
    plan_memory(graph, job, world)             # micro-batch copies share buffers (last)

``job`` is job/job.py's ``Job``.

Rank layout of the staged schemes (``pipeline``, ``hybrid``): the world is
R replicas x p stages and

    rank = replica * p + stage

so a replica's stages are consecutive ranks (its Send/Recv stay among
them) and stage s's ranks are s, p + s, 2p + s, ... (they allreduce that
stage's gradients on a sub-communicator). ``pipeline`` is R = 1.

Scheme ``tensor`` (parallel/tensor_parallel.py) is R replicas x t shards,
rank = replica * t + shard: a group of t consecutive ranks splits the
net's MLPs and attention layers, and each shard's gradients are allreduced
over the replicas (``Layout.tensor``, ``Layout.shard``).

The parameter-server worker (param_server.WorkerScheme) is a Scheme too.
"""
import dataclasses

from ..base.errors import UserError
from ..job.job import STAGED_SCHEMES as STAGED
from .micro_batch import add_schedule, replicate_micro_batches

class Scheme:
    """How a trainer's rank takes part in its parallel scheme: the graph it
    runs (the decisions it shares with other ranks during the run, the stop
    agreement and the checkpoints, are loop services: train/signals.py,
    train/ps_worker.py)."""

    #: on a GPU, the trainer reads the loss back only at the display, test and
    #: checkpoint intervals (and before a checkpoint a signal asks for)
    defer_loss_readback = True
    #: the CPU event dispatcher may finish the last allreduces and updates
    #: while the next iteration starts (parallel.defer_update)
    defers_update = True

    def compose(self, graph, grads, job, world):
        return compose(graph, grads, job, world)

    def plan_memory(self, graph, job, world):
        """Share the buffers of micro-batch copies never live at once
        (parallel/micro_memory.py), on the graph as it will run."""
        return plan_memory(graph, job, world)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a rank sits: ``replicas`` x ``stages`` ranks (see the module
    docstring); the data is sharded over the replicas (docs/config.md, "Sample order")."""

    scheme: str
    replicas: int
    stages: int
    replica: int
    stage: int
    micro_batches: int = 1
    tensor: int = 1           # scheme tensor: the ranks of a tensor-parallel group
    shard: int = 0            # this rank's place in its group

    def rank(self, replica, stage):
        return replica * self.stages + stage

    # scheme tensor: rank = replica * tensor + shard (parallel/tensor_parallel.py)
    def tensor_ranks(self, replica=None):
        """The ranks of one tensor-parallel group (default: this rank's)."""
        r = self.replica if replica is None else replica
        return [r * self.tensor + k for k in range(self.tensor)]

    def shard_ranks(self, shard=None):
        """The ranks holding shard ``shard`` (default: this rank's), one per replica."""
        k = self.shard if shard is None else shard
        return [r * self.tensor + k for r in range(self.replicas)]

    def tensor_groups(self):
        return [self.tensor_ranks(r) for r in range(self.replicas)]

    def shard_groups(self):
        return [self.shard_ranks(k) for k in range(self.tensor)]

    def stage_ranks(self, stage=None):
        """The ranks that hold stage ``stage`` (default: this rank's), one per replica."""
        s = self.stage if stage is None else stage
        return [self.rank(r, s) for r in range(self.replicas)]

    def replica_ranks(self, replica=None):
        """The ranks of one replica (default: this rank's), stage order."""
        r = self.replica if replica is None else replica
        return [self.rank(r, s) for s in range(self.stages)]

    @property
    def staged(self):
        return self.stages > 1

    def describe(self):
        """E.g. ``[hybrid: 2 replicas x 2 stages, 4 micro-batches, 4 ranks]``."""
        n = self.replicas * self.stages * self.tensor
        parts = [f"{self.scheme}: {_count(self.replicas, 'replica')}"
                 + (f" x {_count(self.stages, 'stage')}" if self.staged else "")
                 + (f" x {self.tensor}-way tensor" if self.tensor > 1 else "")]
        if self.micro_batches > 1:
            parts.append(_count(self.micro_batches, "micro-batch", "micro-batches"))
        return "[" + ", ".join(parts + [_count(n, "rank")]) + "]"

    def as_dict(self):
        return dataclasses.asdict(self)

    def same_shape(self, other):
        """Same scheme, replicas, stages and micro-batches (positions aside)."""
        keys = ("scheme", "replicas", "stages", "micro_batches")
        return all(getattr(self, k) == other.get(k) for k in keys) and \
            self.tensor == other.get("tensor", 1)


def _count(n, one, many=None):
    return f"{n} {one if n == 1 else many or one + 's'}"


def stage_count(job):
    return job.parallel.stage_count


def layout_of(job, world):
    """This rank's Layout; a UserError (exit 2) naming ``parallel.stages``
    when the world does not fit the stages."""
    par = job.parallel
    scheme = par.scheme
    micro = par.micro_batches
    if scheme == "tensor" and world.size > 1:
        t = par.tensor_parallel
        if world.size % t:
            raise UserError(f"{job.path}: key 'parallel.tensor_parallel': scheme tensor runs "
                            f"replicas x {t} ranks, but the world size {world.size} is not a "
                            f"multiple of {t}; start a multiple of {t} ranks or change the "
                            "degree")
        return Layout(scheme, world.size // t, 1, world.rank // t, 0, micro, t, world.rank % t)
    if world.size == 1 or scheme not in STAGED:
        return Layout(scheme, world.size, 1, world.rank, 0, micro)
    count = par.stage_count
    path = job.path
    if scheme == "pipeline" and (not count or world.size != count):
        why = ("is more than" if count and world.size % count == 0 else
               "is not a multiple of") + f" the {count} stage(s)"
        raise UserError(f"{path}: key 'parallel.stages': scheme pipeline runs "
                        f"one rank per stage, but the world size {world.size} {why}; start "
                        f"{count} rank(s) (mpiexec -n {count}), change the stages, or use "
                        "scheme: hybrid for several replicas of the pipeline")
    if scheme == "hybrid":
        if count < 2:
            raise UserError(f"{path}: key 'parallel.stages': scheme hybrid needs at least 2 "
                            f"stages, got {count}; with one stage use scheme: data")
        if world.size % count:
            raise UserError(f"{path}: key 'parallel.stages': scheme hybrid runs replicas x "
                            f"{count} stages, but the world size {world.size} is not a "
                            f"multiple of the {count} stage(s); start a multiple of {count} "
                            "ranks or change the stages")
    return Layout(scheme, world.size // count, count, world.rank // count, world.rank % count,
                  micro)


def is_pipeline(job, world):
    """Whether this run places layers on ranks (scheme pipeline or hybrid on
    more than one rank)."""
    return layout_of(job, world).staged


def defer_update_applies(job, replicas, staged):
    """Whether ``parallel.defer_update`` takes effect (runtime/tail.py): set
    in the config, several replicas reducing gradients, no stages, on the CPU
    (the GPU dispatchers end every iteration with every op done). The
    trainer's scheme may still decline (``Scheme.defers_update``)."""
    return job.parallel.defer_update and replicas > 1 and not staged and job.device < 0 \
        and job.parallel.scheme != "tensor"


def data_window(job, world):
    """(replica, replicas): the data shard this rank's graph reads (docs/config.md,
    "Sample order"); a pipeline's replica is the whole world."""
    lay = layout_of(job, world)
    return lay.replica, lay.replicas


def compose(graph, grads, job, world):
    """Apply the config's parallel scheme to this rank's training graph:
    data parallel (gradient buckets + allreduce), pipeline (layers placed on
    ranks by ``parallel.stages``, cut into slices joined by Send/Recv) or
    hybrid (pipelines side by side, each stage's buckets allreduced across
    the replicas); then ``solver.clip_gradients`` (graph/clip.py) on the
    reduced gradients."""
    local = _compose(graph, grads, job, world)
    clip = job.solver.clip_gradients
    if clip is None:
        return local
    from ..graph.clip import add_clip
    lay = layout_of(job, world)
    if lay.tensor > 1:
        from .tensor_parallel import add_tensor_clip
        return add_tensor_clip(local, clip, lay).validate()
    if not lay.staged:
        return add_clip(local, clip).validate()
    # a replica's stages hold its parameters between them: their norms add up
    split = getattr(world, "split_groups", None)
    if split is not None and lay.replicas > 1:
        split([lay.replica_ranks(r) for r in range(lay.replicas)])
    return add_clip(local, clip, group=lay.replica_ranks()).validate()


def _compose(graph, grads, job, world):
    par = job.parallel
    micro = par.micro_batches
    copies = replicate_micro_batches(graph, grads, micro) if micro > 1 else None
    lay = layout_of(job, world)
    if lay.tensor > 1:
        from .tensor_parallel import compose_tensor
        return compose_tensor(graph, grads, job, world, lay)
    if lay.staged:
        local = compose_stages(graph, job, world, copies)
        if lay.scheme == "hybrid":
            local = _allreduce_stage(local, grads, par, world, lay)
        return local
    if copies:  # one stage: gradient accumulation
        add_schedule(graph, copies, micro, par.schedule, lambda op: 0, 1)
    if world.size == 1 or par.scheme == "none":
        return graph.validate()
    if par.mode == "sync":
        from .data_parallel import compose_data_parallel
        #: the bucket plan (``graph --np N`` prints it)
        graph.bucket_plan = compose_data_parallel(
            graph, grads, world.size, world.rank,
            check_collectives=par.check_collectives, world=world, **par.bucket_settings())
        graph.infer_shapes().validate()
        from .dp_windows import to_window_allreduce  # parallel.transport: one_sided
        return to_window_allreduce(graph, job, world)
    raise UserError(f"{job.path}: key 'parallel.mode': mode "
                    f"'{par.mode}' runs through the parameter-server trainer")


def plan_memory(graph, job, world):
    """This rank's micro-batch memory plan (parallel/micro_memory.py): under
    ``1f1b`` stage s of p keeps min(p - s, M) copies' activations, under
    ``gpipe`` all M. Returns the plan, or None without micro-batches."""
    from .micro_memory import plan_for_layout
    return plan_for_layout(graph, layout_of(job, world), job.parallel.schedule)


def compose_stages(graph, job, world, copies=None):
    """This rank's slice of a graph whose layers ``parallel.stages`` places
    on stages ({layer name: stage}); unlisted layers follow their input.
    ``copies``: the micro-batch copies (replicate_micro_batches), ordered on
    each stage by ``parallel.schedule``. The graph is cut by stage; its
    Send/Recv go to the ranks of this rank's replica (``Layout``)."""
    from .model_parallel import compose_partitioned, layer_of, place_layers
    from .data_parallel import place_on_rank
    lay = layout_of(job, world)
    stages = job.stage_map
    unknown = sorted(set(stages) - set(job.layer_names))
    if unknown:
        raise UserError(f"{job.path}: key 'parallel.stages': no layer named "
                        f"{', '.join(unknown)} in the net")
    # a phase lacks some layers (accuracy is test-only, dropout masks train-only)
    present = {k: v for k, v in stages.items() if any(layer_of(op, [k]) for op in graph.ops)}
    place_layers(graph, present)
    if copies:
        add_schedule(graph, copies, job.parallel.micro_batches, job.parallel.schedule,
                     lambda op: op.location.rank, lay.stages)
    local = compose_partitioned(graph, size=lay.stages, rank=lay.stage)
    # stage t of this replica is rank replica * p + t (a Send's name ends in
    # its destination rank, ``<blob>.send@r<rank>``)
    renamed = {}
    for op in local.ops.values():
        if op.op_type in ("Send", "Recv"):
            op.attrs["peer"] = lay.rank(lay.replica, int(op.attrs["peer"]))
        if op.op_type == "Send":
            renamed[op.name] = f"{op.name.rsplit('@r', 1)[0]}@r{op.attrs['peer']}"
            op.name = renamed[op.name]
    if renamed:
        local.ops = {op.name: op for op in local.ops.values()}
        for op in local.ops.values():
            op.control_inputs = [renamed.get(c, c) for c in op.control_inputs]
    for blob in local.blobs.values():
        if "received_from" in blob.attrs:
            blob.attrs["received_from"] = lay.rank(lay.replica, blob.attrs["received_from"])
    place_on_rank(local, world.rank)
    local.layout = lay
    from .one_sided import to_windows  # parallel.transport: Put/WaitWrite into windows
    return to_windows(local, job, world)


# kept for callers of the pipeline-only name
compose_pipeline = compose_stages


def _allreduce_stage(local, grads, par, world, lay):
    """Hybrid: sum this stage's gradient buckets over the replicas that hold
    the same stage (ranks ``lay.stage_ranks()``, one sub-communicator made at
    start-up); ``seq`` numbers follow the slice's Send/Recv, the same on
    every rank of the stage."""
    from .data_parallel import compose_data_parallel, place_on_rank
    group = lay.stage_ranks()
    plan = compose_data_parallel(local, grads, lay.replicas, lay.replica,
                                 check_collectives=False, **par.bucket_settings())
    place_on_rank(local, world.rank)
    for b in plan:
        local.ops[b["op"]].attrs["group"] = list(group)
        b["group"] = list(group)
    local.bucket_plan = plan
    local.layout = lay
    local.infer_shapes().validate()
    split = getattr(world, "split_groups", None)
    if split is not None:  # a live MPI world (graph --np composes offline)
        split([lay.stage_ranks(s) for s in range(lay.stages)])
    if par.check_collectives:
        from ..comm.verify import check_collectives
        check_collectives(local, world)
    return local


def compose_test(graph, job, world):
    """The test graph of this rank: a staged scheme's slice, else as built
    (each replica reads its own shard)."""
    lay = layout_of(job, world) if graph is not None else None
    if lay is not None and lay.tensor > 1:
        from .tensor_parallel import compose_tensor
        return compose_tensor(graph, {}, job, world, lay, train=False)
    if lay is not None and lay.staged:
        return compose_stages(graph, job, world)
    return graph


#: keys that shape the allreduce of gradient buckets (scheme data, mode sync; hybrid)
BUCKET_KEYS = ("bucket_mb", "first_bucket_mb", "min_buckets")


def settings_without_effect(job, world_size):
    """Notes (one line each) on the ``parallel`` settings that do nothing,
    or something else than they say, in a run of ``world_size`` ranks, so
    that none is ignored silently: a parameter-server mode or a staged
    scheme on one rank, bucket keys where nothing is allreduced, keys of
    another mode or scheme, ``mode: async`` with ``max_staleness: 0``. A key
    counts as set when it differs from its default (docs/config.md)."""
    par = job.parallel
    scheme, mode = par.scheme, par.mode
    ps = par.servers  # the config allows these with scheme data only
    changed = par.changed()
    notes = []

    def note(keys, one, many=None):
        """A note on the keys that are set: ``one`` of one key, ``many`` of several."""
        keys = [k for k in keys if k in changed]
        if keys:
            text = one if len(keys) == 1 or many is None else many
            notes.append(f"note: parallel.{', parallel.'.join(keys)} {text}")
            changed.difference_update(keys)

    if world_size == 1:
        if ps:
            servers = par.ps_ranks
            solver = job.solver.type
            note(["mode"], f"{mode} has no effect on 1 rank: parameter servers need at least "
                 f"{servers + 1} ranks (ps_ranks {servers} and a worker), so this rank trains "
                 f"alone with the plain {solver} solver (start mpiexec -n {servers + 1} or "
                 "more for servers)")
            changed.difference_update({"ps_ranks", "max_staleness"})
        if scheme in STAGED:
            count = par.stage_count
            ranks = f"{count}" if scheme == "pipeline" else f"a multiple of {count}"
            note(["scheme"], f"{scheme} has no effect on 1 rank: the {count} stages of "
                 f"parallel.stages need {ranks} ranks, so the net runs unsplit on this rank "
                 f"(start mpiexec -n {count} to split it)")
            changed.discard("stages")
        if scheme == "tensor":
            t = par.tensor_parallel
            note(["scheme"], f"tensor has no effect on 1 rank: the net runs unsplit on this "
                 f"rank (start mpiexec -n {t} to split it {t} ways)")
            changed.discard("tensor_parallel")
        if scheme != "none":
            note(list(BUCKET_KEYS) + ["check_collectives"],
                 "has no effect on 1 rank: there are no gradients to allreduce",
                 "have no effect on 1 rank: there are no gradients to allreduce")
    elif mode == "async" and par.max_staleness == 0:
        notes.append("note: parallel.mode async with max_staleness 0 lets no worker run "
                     "ahead, so it runs as mode sync_ps (synchronous SGD: one update per "
                     "round of gradients); set max_staleness >= 1 for asynchronous updates")
    if scheme in ("pipeline", "none") or ps:
        why = {"pipeline": "scheme pipeline has no allreduce",
               "none": "scheme none exchanges no gradients"}.get(
            scheme, f"mode {mode} sends gradients to parameter servers")
        what = "allreduce buckets (scheme data with mode sync, or hybrid)"
        note(list(BUCKET_KEYS), f"shapes {what}; {why}, so it has no effect",
             f"shape {what}; {why}, so they have no effect")
    if not ps:
        what = f"parameter servers (mode async or sync_ps) only; mode {mode} has none"
        note(["ps_ranks", "max_staleness"], f"applies to {what}, so it has no effect",
             f"apply to {what}, so they have no effect")
    elif mode == "sync_ps":
        note(["max_staleness"], "applies to mode async only; mode sync_ps is synchronous, "
             "so it has no effect")
    if scheme not in STAGED:
        note(["stages"], f"applies to schemes pipeline and hybrid only; scheme {scheme} "
             "ignores it")
    if scheme != "tensor":
        note(["tensor_parallel"], f"applies to scheme tensor only; scheme {scheme} ignores it")
    if par.micro_batches == 1:
        note(["schedule"], "orders the micro-batches of parallel.micro_batches; with one "
             "micro-batch it has no effect")
    return notes
