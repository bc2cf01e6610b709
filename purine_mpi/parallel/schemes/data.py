"""``scheme: data``, ``mode: sync``: every rank runs a replica on its shard
of the batch; its gradient buckets are summed by Allreduce ops in the graph
(parallel/data_parallel.py), through MPI, NCCL (parallel.backend) or a
shared window (parallel.transport: one_sided, parallel/dp_windows.py). A
``batch_norm`` with ``sync: true`` has its batch's sums allreduced over every
rank in forward and backward (ops/batchnorm.py), before the buckets
(``sum_over_replicas``); with micro-batches each copy's sums, in the
copies' schedule order (PyTorch's SyncBatchNorm syncs per forward call)."""
from .base import BUCKET_KEYS, Composition, Scheme, register_scheme


@register_scheme("data")
class DataParallel(Scheme):
    keys = BUCKET_KEYS + ("check_collectives", "split_params", "defer_update", "backend",
                          "transport")
    nccl = True
    one_sided = True

    def compose(self, graph, grads, job, world):
        """Gradient buckets + allreduce (one rank: the replica as built, its
        micro-batches accumulated); then fp16's loss scaling (every rank skips
        the same steps) and ``solver.clip_gradients``."""
        from .steps import accumulate, clipped, loss_scaled, split_before_copies
        if world.size > 1:  # a large weight's row chunks, each copy's too
            grads = split_before_copies(graph, grads, job)
        # the gradients persist (buckets, or the replica's own): the running
        # sums may add into them (micro_batch.replicate_micro_batches)
        accumulate(graph, grads, job, in_place=True)
        lay = self.layout(job, world)
        if world.size == 1:
            return clipped(loss_scaled(Composition(graph.validate(), lay), job, world), job,
                           world)
        comp = self.allreduce(graph, grads, job, world, lay)
        return clipped(loss_scaled(comp, job, world, group=list(range(world.size))), job, world)

    def allreduce(self, graph, grads, job, world, lay):
        """A synchronised batch norm's sums over every rank (``sum_over_replicas``),
        then the buckets."""
        from ..data_parallel import compose_data_parallel, sum_over_replicas
        from ..dp_windows import to_window_allreduce  # parallel.transport: one_sided
        par = job.parallel
        sum_over_replicas(graph)
        plan = compose_data_parallel(graph, grads, world.size, world.rank,
                                     check_collectives=par.check_collectives, world=world,
                                     wire_dtype=par.wire_dtype(), **par.bucket_settings())
        graph.infer_shapes().validate()
        windows, transport, placed = to_window_allreduce(graph, job, world)
        return Composition(graph, lay, bucket_plan=plan, transport=transport, windows=windows,
                           window_placement=placed)

    def scheme_lines(self, trainer, composition):
        from .base import counted as _count, ranges
        plan = composition.bucket_plan or []
        return [("scheme", f"data parallel (mode sync): ranks "
                 f"{ranges(range(trainer.world.size))} are workers, gradients allreduced in "
                 f"{_count(len(plan), 'bucket')}")] + super().scheme_lines(trainer, composition)
