"""``scheme: hybrid``: R replicas x p stages (rank = replica * p + stage):
each replica is a pipeline on its shard of the batch, and each stage
allreduces its gradient buckets over the R ranks that hold it (in bfloat16
with ``parallel.grad_dtype: bf16``: steps.allreduce_stage); one replica
(R = 1) allreduces nothing: it runs as scheme pipeline does.

With ``parallel.tensor_parallel`` t (on the CPU): Megatron-LM's 3-D layout,
R replicas x p stages x t tensor shards, rank = (replica * p + stage) * t +
shard (``Layout.rank``): each replica is scheme pipeline's tensor-parallel
pipeline (pipeline.py owns the split, the transfers, the clip and the
checkpoints), and each (stage, shard) position's buckets are allreduced
over the R ranks that hold it (``Layout.stage_ranks``, one sub-communicator
per position: ``Layout.shard_groups``). One replica is scheme pipeline with
tensor_parallel, the same graphs.

A ``batch_norm`` with ``sync: true`` has its sums allreduced over its
stage's R ranks (with tensor shards, those holding this rank's shard),
before the stage's buckets, numbered among the stage's tensor allreduces
in the slice's emission order, its schedule's with micro-batches
(tensor_parallel.sum_over_shard_replicas)."""
from ...base.errors import ConfigError, UserError
from .base import BUCKET_KEYS, register_scheme
from .pipeline import Pipeline


@register_scheme("hybrid")
class Hybrid(Pipeline):
    keys = Pipeline.keys + BUCKET_KEYS + ("check_collectives", "split_params")
    allreduces = True

    def check_world(self, job, size, count):
        path = job.path
        if count < 2:
            raise ConfigError(path, "parallel.stages", f"scheme {self.config_name} needs "
                              f"at least 2 stages, got {count}; with one stage use scheme: data")
        t = self.tensor_degree(job)
        if t > 1 and size % (count * t):
            raise UserError(f"{path}: keys 'parallel.stages', 'parallel.tensor_parallel': "
                            f"scheme {self.config_name} with tensor parallelism runs replicas "
                            f"x {count} stages x {t} tensor shards, but the world size {size} "
                            f"is not a multiple of {count * t}; start a multiple of {count * t} "
                            "ranks or change the stages or the tensor shards")
        if size % count:
            raise ConfigError(path, "parallel.stages", f"scheme {self.config_name} runs "
                              "replicas x "
                              f"{count} stages, but the world size {size} is not a "
                              f"multiple of the {count} stage(s); start a multiple of {count} "
                              "ranks or change the stages")

    def reduce_stages(self, comp, grads, job, world):
        """Each stage's buckets allreduced over its replicas; one replica (as
        many ranks as stages) shares its gradients with no other rank: the
        pipeline's slice as it is, no bucket (so neither rounded to
        ``grad_dtype`` nor shaped by the bucket keys: ``why_none_reduced``)."""
        if comp.layout.replicas == 1:
            return comp
        from ..tensor_parallel import sum_over_shard_replicas
        from .steps import allreduce_stage
        # a synchronised batch norm's sums over the stage's replicas (with
        # tensor shards: those holding this shard), before its buckets
        sum_over_shard_replicas(comp.graph, comp.layout)
        return allreduce_stage(comp, grads, job.parallel, world)

    def ranks_needed(self, count):
        return f"a multiple of {count}"

    def why_no_buckets(self, par):
        return None

    def why_none_reduced(self, job, world_size):
        count, t = job.parallel.stage_count, self.tensor_degree(job)
        if world_size == count * t:
            shards = f" x the {t} tensor shards" if t > 1 else ""
            return (f"the {count} stages of parallel.stages{shards} on {world_size} ranks are "
                    "one replica, whose gradients no other rank shares")
        return None

    def describe(self, lay):
        what = (f"each stage's gradients allreduced over its {lay.replicas} ranks"
                if lay.replicas > 1 else "one replica: no gradient is allreduced")
        if lay.tensor > 1:
            from .pipeline import TENSOR_WORDS, tensor_order
            what = (f"each (stage, shard)'s gradients allreduced over its {lay.replicas} ranks"
                    if lay.replicas > 1 else "one replica: no gradient is allreduced")
            return (f"hybrid: {lay.replicas} replicas x {lay.stages} stages x {lay.tensor}-way "
                    f"tensor parallel ({tensor_order(lay)}); "
                    f"{TENSOR_WORDS.format(t=lay.tensor)}; {what}")
        return (f"hybrid: {lay.replicas} replicas x {lay.stages} stages "
                f"(rank = replica x {lay.stages} + stage); {what}")

    def graph_notes(self, lay, rank, comp=None):
        text = super().graph_notes(lay, rank, comp)
        if text is not None and lay.replicas > 1:
            text += (f"; gradients allreduced over ranks {lay.stage_ranks()} (this stage"
                     + (", this shard)" if lay.tensor > 1 else ")"))
        return text
