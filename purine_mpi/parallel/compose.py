"""From the job's ``parallel`` section to the graph a rank runs: the
helpers the schemes (parallel/schemes/, one module each) compose with, and
the job-level entry points that look the job's scheme up in the registry.

The trainer builds one replica's training graph, hands it to its scheme
and runs what comes back (nothing in ``parallel/`` imports the trainer):

    scheme = scheme_of(job)                    # parallel/schemes: the registered class
    comp = scheme.compose(graph, grads, job, world)   # a Composition: graph, layout, plans

    layout = layout_of(job, world)             # replicas x stages; this rank's place
    compose(graph, grads, job, world)          # the composed graph alone
    compose_stages(graph, job, world)          # a staged scheme's slice (train or test)
    plan_memory(graph, job, world)             # micro-batch copies share buffers (last)

``job`` is job/job.py's ``Job``. ``Scheme`` here is ``JobScheme``, the
job's own scheme (the trainer's default); the interface every scheme
implements is parallel/schemes/base.py's ``Scheme``.

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

Scheme ``pipeline`` with ``parallel.tensor_parallel`` t (one replica)
splits each stage across t ranks, scheme ``hybrid`` with it runs R replicas
of that (data x pipeline x tensor); all three orders are one:

    rank = (replica * p + stage) * t + shard   # Layout.rank

The parameter-server worker (param_server.WorkerScheme) is a Scheme too.
"""
from .schemes import Composition, scheme_of  # noqa: F401  (importable from here)
from .schemes import Scheme as SchemeInterface
from .schemes.base import BUCKET_KEYS, Layout  # noqa: F401  (importable from here)
from .schemes.steps import compose_stages  # noqa: F401  (importable from here)


class JobScheme(SchemeInterface):
    """The job's own scheme, whichever its config names (the trainer's
    default, ``Scheme()``): every method asks the job's registered scheme;
    the micro-batch memory plan goes through this module's ``plan_memory``.
    Subclass it to change one step of a run (a test's scheme without the plan).
    Its capabilities (``staged``, ``exchanges_gradients``, ...) are the job's
    scheme's: reading one on it raises a TypeError (ask ``scheme_of(job)``
    or ``job_scheme(job)``), and a subclass may not set one (schemes/base.py's
    ``Capability``)."""

    def plan_memory(self, graph, job, world):
        return plan_memory(graph, job, world)


#: the name the trainer and the tests know it by
Scheme = JobScheme


def stage_count(job):
    return job.parallel.stage_count


def layout_of(job, world):
    """This rank's Layout (its scheme's ``layout``); a UserError (exit 2)
    naming ``parallel.stages`` when the world does not fit the stages."""
    return scheme_of(job).layout(job, world)


def is_pipeline(job, world):
    """Whether this run places layers on ranks (scheme pipeline or hybrid on
    more than one rank)."""
    return layout_of(job, world).staged


def defer_update_applies(job, replicas, staged):
    """Whether ``parallel.defer_update`` takes effect (runtime/tail.py): set
    in the config, several replicas reducing gradients, no stages, on the CPU
    (the GPU dispatchers end every iteration with every op done). The
    trainer's scheme may still decline (``Scheme.defers_update``)."""
    return scheme_of(job).defer_update_applies(job, replicas, staged)


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
    reduced gradients. Returns the graph (the scheme's ``compose`` gives
    the whole Composition)."""
    return scheme_of(job).compose(graph, grads, job, world).graph


def plan_memory(graph, job, world):
    """This rank's micro-batch memory plan (parallel/micro_memory.py): under
    ``1f1b`` stage s of p keeps min(p - s, M) copies' activations, under
    ``gpipe`` all M. Returns the plan, or None without micro-batches."""
    return scheme_of(job).plan_memory(graph, job, world)


# kept for callers of the pipeline-only name
compose_pipeline = compose_stages


def compose_test(graph, job, world):
    """The test graph of this rank: a staged scheme's slice, else as built
    (each replica reads its own shard)."""
    if graph is None:
        return None
    return scheme_of(job).compose_test(graph, job, world).graph


def settings_without_effect(job, world_size):
    """Notes (one line each) on the ``parallel`` settings that do nothing in
    a run of ``world_size`` ranks (the scheme's ``settings_without_effect``)."""
    return scheme_of(job).settings_without_effect(job, world_size)
