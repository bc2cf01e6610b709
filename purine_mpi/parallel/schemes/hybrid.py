"""``scheme: hybrid``: R replicas x p stages (rank = replica * p + stage):
each replica is a pipeline on its shard of the batch, and each stage
allreduces its gradient buckets over the R ranks that hold it (in bfloat16
with ``parallel.grad_dtype: bf16``: steps.allreduce_stage)."""
from ...base.errors import UserError
from .base import BUCKET_KEYS, register_scheme
from .pipeline import Pipeline


@register_scheme("hybrid")
class Hybrid(Pipeline):
    keys = Pipeline.keys + BUCKET_KEYS + ("check_collectives", "split_params")
    allreduces = True

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
        from .steps import allreduce_stage
        return allreduce_stage(comp, grads, job.parallel, world)

    def ranks_needed(self, count):
        return f"a multiple of {count}"

    def why_no_buckets(self, par):
        return None

    def describe(self, lay):
        return (f"hybrid: {lay.replicas} replicas x {lay.stages} stages "
                f"(rank = replica x {lay.stages} + stage); each stage's gradients "
                f"allreduced over its {lay.replicas} ranks")

    def graph_notes(self, lay, rank, comp=None):
        text = super().graph_notes(lay, rank, comp)
        if text is not None:
            text += f"; gradients allreduced over ranks {lay.stage_ranks()} (this stage)"
        return text
