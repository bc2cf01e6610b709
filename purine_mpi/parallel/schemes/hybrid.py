"""``scheme: hybrid``: R replicas x p stages (rank = replica * p + stage):
each replica is a pipeline on its shard of the batch, and each stage
allreduces its gradient buckets over the R ranks that hold it (in bfloat16
with ``parallel.grad_dtype: bf16``: steps.allreduce_stage); one replica
(R = 1) allreduces nothing: it runs as scheme pipeline does."""
from ...base.errors import UserError
from .base import BUCKET_KEYS, register_scheme
from .pipeline import Pipeline


@register_scheme("hybrid")
class Hybrid(Pipeline):
    keys = tuple(k for k in Pipeline.keys if k != "tensor_parallel") + BUCKET_KEYS + \
        ("check_collectives", "split_params")
    allreduces = True

    def tensor_degree(self, job):
        """No tensor shards (tensor parallelism within the stages is scheme
        pipeline's, one replica: the config rules refuse it here)."""
        return 1

    def check_world(self, job, size, count):
        path = job.path
        if count < 2:
            raise UserError(f"{path}: key 'parallel.stages': scheme {self.config_name} needs "
                            f"at least 2 stages, got {count}; with one stage use scheme: data")
        if size % count:
            raise UserError(f"{path}: key 'parallel.stages': scheme {self.config_name} runs "
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
        from .steps import allreduce_stage
        return allreduce_stage(comp, grads, job.parallel, world)

    def ranks_needed(self, count):
        return f"a multiple of {count}"

    def why_no_buckets(self, par):
        return None

    def why_none_reduced(self, job, world_size):
        count = job.parallel.stage_count
        if world_size == count:
            return (f"the {count} stages of parallel.stages on {world_size} ranks are one "
                    "replica, whose gradients no other rank shares")
        return None

    def describe(self, lay):
        what = (f"each stage's gradients allreduced over its {lay.replicas} ranks"
                if lay.replicas > 1 else "one replica: no gradient is allreduced")
        return (f"hybrid: {lay.replicas} replicas x {lay.stages} stages "
                f"(rank = replica x {lay.stages} + stage); {what}")

    def graph_notes(self, lay, rank, comp=None):
        text = super().graph_notes(lay, rank, comp)
        if text is not None and lay.replicas > 1:
            text += f"; gradients allreduced over ranks {lay.stage_ranks()} (this stage)"
        return text
