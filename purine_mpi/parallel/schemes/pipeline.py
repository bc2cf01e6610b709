"""``scheme: pipeline``: layers placed on ranks by ``parallel.stages`` (one
rank per stage); each edge between ranks becomes a Send/Recv pair, or a
window transfer (parallel.transport, parallel/one_sided.py). The staged
layout is R replicas x p stages, rank = replica * p + stage
(parallel/compose.py); a pipeline is R = 1 (``scheme: hybrid``: R >= 1).

With ``parallel.tensor_parallel`` t (on the CPU, one replica; scheme
hybrid, a subclass, builds R replicas of it): p stages x t tensor shards,
rank = stage * t + shard (``Layout.rank``: (replica * p + stage) * t +
shard, the tensor shards fastest), so stage s is the t consecutive ranks
s·t .. s·t + t - 1. The whole replica's graph is split as
scheme tensor splits a net (parallel/tensor_parallel.split_for: each
rank's shard, its allreduces over its stage's tensor group), then cut into
stages; shard k of stage s sends to shard k of stage s + 1 (and the
gradients back). The tensor allreduces are posted in each stage's
emission order, the whole net's (with micro-batches its schedule's;
``_post_in_schedule_order``);
``solver.clip_gradients`` adds the squared norms of every rank of the
replica, a replicated weight counted on shard 0 of its stage only. Checkpoints hold
whole blobs: each stage's shards joined on save, split on load."""
from ...base.errors import ConfigError, UserError
from .base import Composition, Layout, Scheme, register_scheme


@register_scheme("pipeline")
class Pipeline(Scheme):
    keys = ("stages", "schedule", "transport", "tensor_parallel")
    staged = True
    allreduces = False
    one_sided = True

    def layout(self, job, world):
        """This rank's Layout, rank = (replica * p + stage) * t + shard
        (``Layout.rank``); a UserError (exit 2) naming ``parallel.stages``
        (and ``parallel.tensor_parallel``) when the world does not fit."""
        par = job.parallel
        if world.size == 1:
            return Scheme.layout(self, job, world)
        count, t = par.stage_count, self.tensor_degree(job)
        self.check_world(job, world.size, count)
        per = count * t   # the ranks of one replica
        return Layout(par.scheme, world.size // per, count, world.rank // per,
                      world.rank // t % count, par.micro_batches, t, world.rank % t)

    def tensor_degree(self, job):
        """The tensor shards of each stage (``parallel.tensor_parallel``)."""
        return job.parallel.tensor_parallel

    def check_world(self, job, size, count):
        t = self.tensor_degree(job)
        if t > 1 and size != count * t:
            why = ("is several replicas of it: use scheme: hybrid (R replicas x stages x "
                   "tensor shards), or" if size % (count * t) == 0 else "does not fit it;")
            raise UserError(f"{job.path}: keys 'parallel.stages', 'parallel.tensor_parallel': "
                            f"scheme pipeline with tensor parallelism runs one replica of "
                            f"{count} stage(s) x {t} tensor shards, but the world size {size} "
                            f"{why} start {count * t} ranks (mpiexec -n {count * t})")
        if t > 1:
            return
        if not count or size != count:
            why = ("is more than" if count and size % count == 0 else
                   "is not a multiple of") + f" the {count} stage(s)"
            raise ConfigError(job.path, "parallel.stages", f"scheme pipeline runs "
                              f"one rank per stage, but the world size {size} {why}; start "
                              f"{count} rank(s) (mpiexec -n {count}), change the stages, or use "
                              "scheme: hybrid for several replicas of the pipeline")

    def compose(self, graph, grads, job, world):
        """This rank's slice (parallel/compose.compose_stages); on one rank
        the net unsplit, its micro-batches accumulated."""
        from .steps import accumulate, clipped, compose_stages, micro_copies
        lay = self.layout(job, world)
        if not lay.staged:
            accumulate(graph, grads, job, in_place=True)
            return clipped(Composition(graph.validate(), lay), job, world)
        pairs = self._split(graph, job, world, lay)
        if self.allreduces and lay.replicas > 1:
            # hybrid: a stage's large weight (with tensor shards, its shard)
            # in row chunks, each copy's too
            from .steps import split_stages_before_copies
            grads = split_stages_before_copies(graph, grads, job)
        comp = compose_stages(graph, job, world, micro_copies(graph, grads, job, in_place=True))
        self._tensor_done(comp, pairs, lay, job)
        return clipped(self.reduce_stages(comp, grads, job, world), job, world)

    # ---- tensor parallelism within the stages
    def _split(self, graph, job, world, lay, train=True):
        """With tensor shards: the whole replica's graph split for this
        rank's shard (tensor_parallel.split_for), the tensor groups'
        sub-communicators made (the same call on every rank); else None."""
        if lay.tensor == 1:
            return None
        from ..placement import asks_for_gpu
        if asks_for_gpu(job):  # device or backend: cupy (also given on the command line)
            raise ConfigError(job.path, "parallel.tensor_parallel", "scheme pipeline with "
                              "tensor parallelism runs on the CPU (device -1), not on a GPU; "
                              "set device: -1, or tensor_parallel: 1")
        from ..tensor_parallel import split_for
        pairs = split_for(graph, job, lay, train)
        split = getattr(world, "split_groups", None)
        if split is not None:  # a live MPI world (graph --np composes offline)
            split(lay.tensor_groups())
        return pairs

    def _tensor_done(self, comp, pairs, lay, job):
        """The slice's tensor allreduces posted in its emission order
        (``_post_in_schedule_order``), the split's lines (every stage's, for
        the start-up block and ``graph --np``)."""
        if pairs is None:
            return
        from ..tensor_parallel import describe_splits
        _post_in_schedule_order(comp.graph, lay.tensor_ranks())
        from .base import ranks_word
        stage_of = job.stage_map
        plan = []
        for s in range(lay.stages):  # each stage's pairs, with the ranks that split them
            here = [p for p in pairs if stage_of.get(p.get("layer", p["column"])) == s]
            plan += [f"stage {s} ({ranks_word(lay.all_stage_ranks(s))}): {line}"
                     for line in describe_splits(here, lay.tensor)]
        comp.tensor_plan = plan
        comp.graph.infer_shapes().validate()

    def reduce_stages(self, comp, grads, job, world):
        """What follows the slicing: nothing in a pipeline (scheme hybrid
        allreduces each stage over the replicas)."""
        return comp

    def compose_test(self, graph, job, world):
        from .steps import compose_stages
        lay = self.layout(job, world)
        if not lay.staged:
            return Scheme.compose_test(self, graph, job, world)
        pairs = self._split(graph, job, world, lay, train=False)
        comp = compose_stages(graph, job, world)
        self._tensor_done(comp, pairs, lay, job)
        return comp

    # ---- notes
    def one_rank_notes(self, job, note, changed):
        count, t = job.parallel.stage_count, self.tensor_degree(job)
        if t > 1:
            note(["scheme"], f"{self.config_name} has no effect on 1 rank: the {count} stages "
                 f"of parallel.stages x the {t} tensor shards of parallel.tensor_parallel "
                 f"need {self.ranks_needed(count * t)} ranks, so the net runs unsplit on this "
                 f"rank (start mpiexec -n {count * t} to split it)")
            changed.difference_update(("stages", "tensor_parallel"))
            return
        note(["scheme"], f"{self.config_name} has no effect on 1 rank: the {count} stages of "
             f"parallel.stages need {self.ranks_needed(count)} ranks, so the net runs unsplit "
             f"on this rank (start mpiexec -n {count} to split it)")
        changed.discard("stages")

    def ranks_needed(self, count):
        return f"{count}"

    def why_no_buckets(self, par):
        return "scheme pipeline has no allreduce"

    # ---- reporting
    def scheme_lines(self, trainer, composition):
        return [("scheme", self.describe(composition.layout))] + \
            Scheme.scheme_lines(self, trainer, composition) + \
            self.stage_lines(composition.layout, trainer.job) + \
            [("split", line) for line in composition.tensor_plan]

    def stage_lines(self, lay, job):
        """The start-up block's row of each stage: its ranks, its layers
        (first..last) and its share of the FLOPs (job/stage_cut.py)."""
        from ...job.stage_cut import layer_flops, span_text, stage_spans
        from .base import counted as _count, ranks_word as _ranks_word
        layers = job.layer_names
        stages = {n: job.stage_map[n] for n in layers if n in job.stage_map}
        if not stages:  # a graph: job places its ops itself
            return []
        return [(f"stage {s}", f"{_ranks_word(lay.all_stage_ranks(s))}: "
                 f"{_count(len(names), 'layer')} ({span_text(names)}), {share:.1f}% of the "
                 "FLOPs") for s, names, share in stage_spans(stages, layer_flops(job))]

    def describe(self, lay):
        if lay.tensor > 1:
            return (f"pipeline: {lay.stages} stages x {lay.tensor}-way tensor parallel "
                    f"({tensor_order(lay)}); {TENSOR_WORDS.format(t=lay.tensor)}")
        return (f"pipeline: {lay.stages} stages, rank s runs stage s; "
                "activations and gradients cross between them")

    def graph_notes(self, lay, rank, comp=None):
        if not lay.staged:
            return None
        if lay.tensor > 1:
            where = f"replica {lay.replica}, " if lay.replicas > 1 else ""
            return (f"layout {lay.describe()}; {tensor_order(lay).replace(' x ', ' * ')}; "
                    f"rank {rank} = {where}stage {lay.stage}, tensor shard {lay.shard} of "
                    f"{lay.tensor}; transfers with ranks "
                    f"{[lay.rank(lay.replica, s) for s in range(lay.stages)]} "
                    f"(shard {lay.shard} of each stage); activations allreduced over ranks "
                    f"{lay.tensor_ranks()} (this stage's tensor group)")
        return (f"layout {lay.describe()}; rank = replica * {lay.stages} + stage; rank {rank} = "
                f"replica {lay.replica}, stage {lay.stage}; transfers with ranks "
                f"{lay.replica_ranks()} (this replica)")

    # ---- checkpoints
    def gathers_checkpoint(self, graphs):
        """Each stage holds its own layers' parameters."""
        return graphs.layout.staged

    def join_checkpoint(self, graphs, parts):
        """Replica 0's stages (the replicas hold the same values); with
        tensor shards, each stage's shards joined (tensor_parallel.gather_whole)."""
        lay = graphs.layout
        if lay.tensor > 1:
            from ..tensor_parallel import gather_whole
            splits = {p: split for part in parts for p, split in
                      (part[2] if len(part) > 2 else {}).items()}
            return gather_whole(graphs.graph, lay, parts, splits)
        params, solver = (dict(x) for x in parts[0])
        for r in lay.replica_ranks(0):
            params.update(parts[r][0])
            solver.update(parts[r][1])
        return params, solver

    def split_checkpoint(self, graphs, name, value):
        """A whole blob from the file: this rank's shard of it (with tensor
        shards; scheme tensor's ``split_checkpoint``)."""
        from .tensor import TensorParallel
        return TensorParallel.split_checkpoint(self, graphs, name, value)


#: what a rank of a stage split t ways does (the start-up block's scheme row)
TENSOR_WORDS = ("split layers' activations allreduced in each stage's group of {t} ranks; "
                "shard k of a stage sends to shard k of the next (gradients back)")


def tensor_order(lay):
    """``rank = stage x t + shard`` (one replica) or ``rank = (replica x p +
    stage) x t + shard``: Layout.rank in words."""
    if lay.replicas > 1:
        return f"rank = (replica x {lay.stages} + stage) x {lay.tensor} + shard"
    return f"rank = stage x {lay.tensor} + shard"


def _post_in_schedule_order(graph, group):
    """Number the tensor group's allreduces of a stage's slice (``group``)
    in its emission order (``sharding.emission_order``): the micro-batch
    copies of one allreduce share the whole graph's ``seq``, and posted by
    ``seq`` every copy's forward allreduce would go before any backward
    one, which under 1F1B waits for a later copy's forward that waits for
    it. The slice's emission order is the whole net's (with micro-batches
    its schedule's: micro_batch.add_schedule), the same on every rank of
    the group. Not its topological order: with one micro-batch, a stage
    ending at a row-split fc got its closing allreduce after the backward's,
    which the gradient wait (ready from the start) pulled ahead, and they
    wait for the next stage, which waits for that allreduce (a stall)."""
    names = [op.name for op in graph.ops.values()
             if op.op_type == "Allreduce" and op.attrs.get("group") == list(group)]
    if not names:
        return
    from ..data_parallel import next_seq
    from ..sharding import emission_order
    seq = next_seq(graph)
    for k, n in enumerate(emission_order(graph, names)):
        graph.ops[n].attrs["seq"] = seq + k
