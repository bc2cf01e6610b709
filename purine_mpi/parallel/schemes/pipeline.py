"""``scheme: pipeline``: layers placed on ranks by ``parallel.stages`` (one
rank per stage); each edge between ranks becomes a Send/Recv pair, or a
window transfer (parallel.transport, parallel/one_sided.py). The staged
layout is R replicas x p stages, rank = replica * p + stage
(parallel/compose.py); a pipeline is R = 1 (``scheme: hybrid``: R >= 1)."""
from ...base.errors import UserError
from .base import Composition, Layout, Scheme, register_scheme


@register_scheme("pipeline")
class Pipeline(Scheme):
    keys = ("stages", "schedule", "transport")
    staged = True
    allreduces = False
    one_sided = True

    def layout(self, job, world):
        """This rank's Layout; a UserError (exit 2) naming ``parallel.stages``
        when the world does not fit the stages."""
        par = job.parallel
        if world.size == 1:
            return Scheme.layout(self, job, world)
        self.check_world(job, world.size, par.stage_count)
        count = par.stage_count
        return Layout(par.scheme, world.size // count, count, world.rank // count,
                      world.rank % count, par.micro_batches)

    def check_world(self, job, size, count):
        if not count or size != count:
            why = ("is more than" if count and size % count == 0 else
                   "is not a multiple of") + f" the {count} stage(s)"
            raise UserError(f"{job.path}: key 'parallel.stages': scheme pipeline runs "
                            f"one rank per stage, but the world size {size} {why}; start "
                            f"{count} rank(s) (mpiexec -n {count}), change the stages, or use "
                            "scheme: hybrid for several replicas of the pipeline")

    def compose(self, graph, grads, job, world):
        """This rank's slice (parallel/compose.compose_stages); on one rank
        the net unsplit, its micro-batches accumulated."""
        from .steps import accumulate, clipped, compose_stages, micro_copies
        lay = self.layout(job, world)
        if not lay.staged:
            accumulate(graph, grads, job)
            return clipped(Composition(graph.validate(), lay), job, world)
        comp = compose_stages(graph, job, world, micro_copies(graph, grads, job))
        return clipped(self.reduce_stages(comp, grads, job, world), job, world)

    def reduce_stages(self, comp, grads, job, world):
        """What follows the slicing: nothing in a pipeline (scheme hybrid
        allreduces each stage over the replicas)."""
        return comp

    def compose_test(self, graph, job, world):
        from .steps import compose_stages
        if not self.layout(job, world).staged:
            return Scheme.compose_test(self, graph, job, world)
        return compose_stages(graph, job, world)

    # ---- notes
    def one_rank_notes(self, job, note, changed):
        count = job.parallel.stage_count
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
            self.stage_lines(composition.layout, trainer.job)

    def stage_lines(self, lay, job):
        """The start-up block's row of each stage: its ranks and layers."""
        from .base import counted as _count, ranks_word as _ranks_word
        out = []
        stages, layers = job.stage_map, job.layer_names
        for s in range(lay.stages):
            names = [n for n in layers if stages.get(n) == s]
            shown = ", ".join(names) if len(names) <= 6 else \
                f"{', '.join(names[:3])}, ..., {', '.join(names[-2:])}"
            out.append((f"stage {s}", f"{_ranks_word(lay.stage_ranks(s))}: "
                        f"{_count(len(names), 'layer')} ({shown})"))
        return out

    def describe(self, lay):
        return (f"pipeline: {lay.stages} stages, rank s runs stage s; "
                "activations and gradients cross between them")

    def graph_notes(self, lay, rank, comp=None):
        if not lay.staged:
            return None
        return (f"layout {lay.describe()}; rank = replica * {lay.stages} + stage; rank {rank} = "
                f"replica {lay.replica}, stage {lay.stage}; transfers with ranks "
                f"{lay.replica_ranks()} (this replica)")

    # ---- checkpoints
    def gathers_checkpoint(self, graphs):
        """Each stage holds its own layers' parameters."""
        return graphs.layout.staged

    def join_checkpoint(self, graphs, parts):
        """Replica 0's stages (the replicas hold the same values)."""
        params, solver = (dict(x) for x in parts[0])
        for r in graphs.layout.replica_ranks(0):
            params.update(parts[r][0])
            solver.update(parts[r][1])
        return params, solver
