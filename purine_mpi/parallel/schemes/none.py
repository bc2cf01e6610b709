"""``scheme: none``: each rank trains its own replica on its shard of the
data, exchanging no gradients (tests, debugging)."""
from .base import Scheme, register_scheme


@register_scheme("none", modes=("sync", "async", "sync_ps"))
class NoScheme(Scheme):
    """Exchanges nothing, whatever ``parallel.mode`` says (on several ranks a
    parameter-server mode still starts the servers: train/trainer.py)."""
    exchanges_gradients = False
    allreduces = False

    def compose(self, graph, grads, job, world):
        from .steps import accumulate, clipped, loss_scaled
        # the gradients persist (buckets, or the replica's own): the running
        # sums may add into them (micro_batch.replicate_micro_batches)
        accumulate(graph, grads, job, in_place=True)
        return clipped(loss_scaled(self.composition(graph.validate(), job, world), job, world),
                       job, world)

    def composition(self, graph, job, world):
        from .base import Composition
        return Composition(graph, self.layout(job, world))

    def why_no_buckets(self, par):
        return "scheme none exchanges no gradients"

    def why_no_transport(self, job, world_size):
        from .base import mode_class
        if mode_class(job.parallel.mode) is None:  # no parameter servers either
            return "scheme none exchanges nothing between ranks"
        return None

    def scheme_lines(self, trainer, composition):
        from .base import ranges
        return [("scheme", f"none: ranks {ranges(range(trainer.world.size))} each train their "
                 "own replica on their shard, exchanging no gradients")]
