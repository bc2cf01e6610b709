"""From the config's ``parallel`` section to the graph a rank runs.

The trainer builds one replica's training graph, hands it to a ``Scheme``
and runs what comes back; everything scheme-specific lives here and in the
modules this one calls (nothing in ``parallel/`` imports the trainer):

    scheme = Scheme()                          # data parallel / pipeline / none
    local = scheme.compose(graph, grads, config, world)
    code = scheme.agree_to_stop(trainer, done, diverged)
    scheme.before_save(trainer, iteration)     # e.g. fetch the servers' momenta

    is_pipeline(config, world)                 # one data stream, layers on ranks?
    compose(graph, grads, config, world)       # the data-parallel or pipeline slice
    compose_pipeline(graph, config, world)     # a pipeline's slice (train or test)

The parameter-server worker (param_server.WorkerScheme) is a Scheme too.
"""
from ..errors import UserError
from .micro_batch import add_schedule, replicate_micro_batches


class Scheme:
    """How a trainer's rank takes part in its parallel scheme: the graph it
    runs and the decisions it shares with other ranks. The trainer passes
    itself to the hooks (its ``world``, ``stop``, ``ws`` and ``start_iter``)."""

    def compose(self, graph, grads, config, world):
        return compose(graph, grads, config, world)

    def agree_to_stop(self, trainer, done, diverged):
        """The stop code every rank agrees on after iteration ``done``."""
        return trainer.stop.agree(trainer.world, diverged)

    def before_save(self, trainer, iteration):
        """Called on every rank before a checkpoint is gathered."""


def is_pipeline(config, world):
    par = config.get("parallel", {})
    return world.size > 1 and par.get("scheme") == "pipeline"


def compose(graph, grads, config, world):
    """Apply the config's parallel scheme to this rank's training graph:
    data parallel (gradient buckets + allreduce) or pipeline/model parallel
    (layers placed on ranks by ``parallel.stages``, cut into slices joined by
    Send/Recv)."""
    par = config.get("parallel", {})
    micro = int(par.get("micro_batches", 1))
    copies = replicate_micro_batches(graph, grads, micro) if micro > 1 else None
    if world.size > 1 and par.get("scheme") == "pipeline":
        return compose_pipeline(graph, config, world, copies)
    if copies:  # one stage: gradient accumulation
        add_schedule(graph, copies, micro, par.get("schedule", "1f1b"), lambda op: 0, 1)
    if world.size == 1 or par.get("scheme", "data") == "none":
        return graph.validate()
    if par.get("mode", "sync") == "sync":
        from .data_parallel import compose_data_parallel
        #: the bucket plan (``graph --np N`` prints it)
        graph.bucket_plan = compose_data_parallel(
            graph, grads, world.size, world.rank, bucket_mb=par.get("bucket_mb", 4),
            first_bucket_mb=par.get("first_bucket_mb", 1),
            min_buckets=par.get("min_buckets", 4),
            check_collectives=par.get("check_collectives", False), world=world)
        graph.infer_shapes().validate()
        return graph
    raise UserError(f"{config.get('_path')}: key 'parallel.mode': mode "
                    f"'{par.get('mode')}' runs through the parameter-server trainer")


def compose_pipeline(graph, config, world, copies=None):
    """This rank's slice of a graph whose layers ``parallel.stages`` places
    on ranks ({layer name: rank}); unlisted layers follow their input.
    ``copies``: the micro-batch copies (replicate_micro_batches), ordered on
    each stage by ``parallel.schedule``."""
    from .model_parallel import compose_partitioned, layer_of, place_layers
    stages = config["parallel"].get("stages") or {}
    count = max(map(int, stages.values())) + 1 if stages else 0
    if not stages or world.size != count:
        why = ("is more than" if count and world.size % count == 0 else
               "is not a multiple of") + f" the {count} stage(s)"
        raise UserError(f"{config.get('_path')}: key 'parallel.stages': scheme pipeline runs "
                        f"one rank per stage, but the world size {world.size} {why}; start "
                        f"{count} rank(s) (mpiexec -n {count}) or change the stages")
    layers = {layer.get("name") for layer in config.get("net") or []}
    unknown = sorted(set(stages) - layers)
    if unknown:
        raise UserError(f"{config.get('_path')}: key 'parallel.stages': no layer named "
                        f"{', '.join(unknown)} in the net")
    # a phase lacks some layers (accuracy is test-only, dropout masks train-only)
    present = {k: v for k, v in stages.items() if any(layer_of(op, [k]) for op in graph.ops)}
    place_layers(graph, present)
    if copies:
        par = config["parallel"]
        add_schedule(graph, copies, par["micro_batches"], par.get("schedule", "1f1b"),
                     lambda op: op.location.rank, world.size)
    return compose_partitioned(graph, world)
