"""``scheme: tensor`` (parallel/tensor_parallel.py): R replicas x t shards,
rank = replica * t + shard: a group of t consecutive ranks splits the net's
MLPs and attention layers, and each shard's gradients are allreduced over
the replicas (``Layout.tensor``, ``Layout.shard``). Checkpoints hold whole
blobs: the shards are joined on save and split on load. With
``parallel.grad_dtype: bf16`` the replicas' bucket allreduces run in
bfloat16; the tensor groups' allreduces of activations and partial sums
stay float32 (they are no gradient buckets)."""
from ...base.errors import ConfigError
from .base import Layout, Scheme, register_scheme
from .data import DataParallel


@register_scheme("tensor")
class TensorParallel(DataParallel):
    keys = DataParallel.keys + ("tensor_parallel",)
    micro_batches = False
    nccl = False
    one_sided = False
    #: nothing is deferred: the memory plan need not keep what a deferred
    #: tail would touch
    deferrable = False

    def layout(self, job, world):
        par = job.parallel
        if world.size == 1:
            return Scheme.layout(self, job, world)
        t = par.tensor_parallel
        if world.size % t:
            raise ConfigError(job.path, "parallel.tensor_parallel", f"scheme "
                              f"{self.config_name} runs replicas x {t} ranks, but the world "
                              f"size {world.size} is not a multiple of {t}; start a multiple of "
                              f"{t} ranks or change the degree")
        return Layout(par.scheme, world.size // t, 1, world.rank // t, 0, par.micro_batches, t,
                      world.rank % t)

    def compose(self, graph, grads, job, world):
        lay = self.layout(job, world)
        if lay.tensor == 1:
            return DataParallel.compose(self, graph, grads, job, world)
        from .steps import clipped
        from ..tensor_parallel import compose_tensor
        return clipped(compose_tensor(graph, grads, job, world, lay), job, world)

    def compose_test(self, graph, job, world):
        lay = self.layout(job, world)
        if lay.tensor == 1:
            return Scheme.compose_test(self, graph, job, world)
        from ..tensor_parallel import compose_tensor
        return compose_tensor(graph, {}, job, world, lay, train=False)

    def why_none_reduced(self, job, world_size):
        t = job.parallel.tensor_parallel
        if world_size == t:
            return (f"parallel.tensor_parallel {t} on {world_size} ranks is one replica, whose "
                    "gradients no other rank shares")
        return None

    def why_no_transport(self, job, world_size):
        if job.parallel.tensor_parallel == 1:  # scheme data's allreduce (compose)
            return None
        return "scheme tensor's allreduces are two-sided MPI collectives, never windows"

    def one_rank_notes(self, job, note, changed):
        t = job.parallel.tensor_parallel
        if t == 1:  # nothing to split on any number of ranks (scheme data's allreduce)
            note(["scheme"], "tensor has no effect on 1 rank: parallel.tensor_parallel is 1, "
                 "which splits nothing (set it to the ranks of a tensor-parallel group)")
            return
        note(["scheme"], f"tensor has no effect on 1 rank: the net runs unsplit on this "
             f"rank (start mpiexec -n {t} to split it {t} ways)")
        changed.discard("tensor_parallel")

    def scheme_lines(self, trainer, composition):
        from .base import counted as _count
        lay = composition.layout
        if lay.tensor == 1:
            return DataParallel.scheme_lines(self, trainer, composition)
        plan = composition.bucket_plan or []
        dp = (f"; each shard's gradients allreduced over its {lay.replicas} ranks in "
              f"{_count(len(plan), 'bucket')}") if lay.replicas > 1 else ""
        return [("scheme", f"tensor: {_count(lay.replicas, 'replica')} x {lay.tensor}-way "
                 f"tensor parallel (rank = replica x {lay.tensor} + shard); split layers' "
                 f"activations allreduced in each group of {lay.tensor} ranks{dp}")] + \
            [("split", line) for line in composition.tensor_plan]

    # ---- checkpoints
    def gathers_checkpoint(self, graphs):
        """Each rank holds shards: the file holds whole blobs."""
        return graphs.layout.tensor > 1

    def join_checkpoint(self, graphs, parts):
        """Tensor group 0's shards joined into whole blobs."""
        from ..tensor_parallel import gather_whole
        return gather_whole(graphs.graph, graphs.layout, parts)

    def split_checkpoint(self, graphs, name, value):
        """A whole blob from the file: this rank's shard of it."""
        from ..tensor_parallel import param_split, take_shard
        split = param_split(graphs.graph, name)
        if split and tuple(value.shape) == tuple(split["shape"]):  # whole in the file
            value = take_shard(split, value)
        return value
