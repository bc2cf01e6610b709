"""``scheme: sharded``, ``shard: 1``: ZeRO stage 1 (issue 43); ``shard: 2``:
stage 2, the same with each full gradient bucket a transient blob (freed
after its reduce-scatter: the rank holds its gradient shard only). Every rank is
a data-parallel replica on its share of the batch; each gradient bucket is
reduce-scattered, each rank runs the solver on its shard of every bucket
(its optimizer state: that shard's only) and the updated weights are
allgathered (parallel/sharding.compose_zero1). On MPI, on the CPU.

Checkpoints hold whole blobs: rank 0's weights (every rank holds them all)
and the optimizer state of every rank's shard, joined in rank order per
bucket and cut back into each parameter's shape, so the file is the one
plain data parallelism writes; on load each rank takes its shard of the
whole state. ``shard: 3``: stage 3, each rank holds its shard of every
bucket's weights alone (the frozen weights', ``lr_mult`` 0, in gather
units of their own: sharding.frozen_units), gathered into transient
buffers before the bucket's forward and backward readers
(parallel/sharding.compose_zero3);
the weights are written (fillers, ``--init``, ``--resume``) into the
shards, saved joined whole, and gathered whole for the test graph
(``held_weights``, ``set_weight``, ``give_test_weights``); with micro-batches
each buffer is gathered once per iteration and held across them. Stage 3
with ``parallel.transport: one_sided`` on one node holds each bucket's
weights once per node, in a shared window every rank reads in place
(parallel/zero3_windows.py); across hosts (``one_sided``, or ``auto``
where the network does RDMA) each rank's weight shards lie in its RMA
window and the gathers are MPI_Rget of every owner's shard.

On GPUs (``device >= 0``) with ``parallel.backend: nccl``, every stage:
parallel/nccl_backend.use_nccl turns the reduce-scatters and gathers into
NcclReduceScatter and NcclAllgather (comm/nccl.py), on the device's one
``nccl`` stream in ``seq`` order, captured with the rest of the iteration.
With ``parallel.stages`` (every stage, on the CPU): R replicas x p
pipeline stages as scheme hybrid lays them out (rank = replica * p + stage,
this class is a ``Hybrid``), each replica a pipeline on its share of the
batch; instead of hybrid's allreduce, each stage's slice gets the same
rewrite (``compose_zero1`` over the stage's R ranks, its shard the rank's
replica) with every ReduceScatter and Allgather on the stage's
sub-communicator (``group``: ``Layout.stage_ranks``, the one hybrid's
allreduce uses); stage 3 gathers each bucket once per iteration for the
forward and once for the backward of all the stage's micro-batches (the
forward ops told apart on the whole net: stage 0's slice has no loss), or
once for both where the schedule (1F1B) runs a forward reader after a
backward reader (``sharding._gather_units``, ``reuse``). A
checkpoint joins each parameter's state pieces (stage 3: and weight
pieces) in world order (a stage's ranks in replica order: its shards'
order), so the file is hybrid's and data parallelism's; the save streams
it a parameter at a time (``checkpoint_sections``: base.streamed_join with
``_join_plan``), rank 0 holding one parameter's whole weight and state
beyond its own.

With ``parallel.tensor_parallel`` t (every stage, on the CPU): R
replicas x t shards as scheme tensor lays them out (rank = replica * t +
shard), the net split as tensor splits it (parallel/tensor_parallel.
compose_tensor); instead of tensor's allreduce of each tensor shard's
buckets, the same rewrite over its R replicas (``Layout.shard_ranks``, the
sub-communicator that allreduce uses; stage 3: each tensor shard's weights
sharded and gathered over them), stage 2's and 3's collectives numbered
with the tensor groups' allreduces in one order, the same on every rank
(``sharding.sequence_collectives``). A checkpoint joins each tensor shard's
pieces (stage 3: of weights too) over its replicas, then the tensor shards
as tensor joins them: tensor's file, streamed a parameter at a time as
with stages.

With both (every stage, on the CPU; Megatron's distributed optimizer in
its 3-D layout): R replicas x p stages x t shards as scheme hybrid lays
them out (rank = (replica * p + stage) * t + shard), each replica
pipeline's tensor-split pipeline (``Pipeline._split`` before the slicing,
``_tensor_done`` after); the stages' path, each (stage, tensor shard)
position's buckets sharded over its R replicas (``Layout.stage_ranks``:
that position's ranks; the groups ``Layout.shard_groups``), stage 2's and
3's collectives numbered among the tensor allreduces
(``sequence_collectives``, as with tensor parallelism alone). A checkpoint
joins each position's pieces over its replicas, then each stage's tensor
shards: hybrid's file, streamed as above.

One replica (as many ranks as stages or tensor shards: no other rank
shares a stage's or tensor shard's model state) has nothing to shard: it
composes as scheme pipeline or tensor does (``_plain``: no bucket, no
reduce-scatter or gather over a group of one), its start-up block, ``graph
--np`` header and checkpoints are that scheme's, and the notes say so.

With stages and the one-sided transport on several replicas: the stage
transfers through windows (hybrid's); stages 1 and 2 reduce-scatter and
gather two-sided on each stage's ranks, stage 3 puts each stage's weights
in windows over its ranks (parallel/zero3_windows.py with ``group``: one
shared region per bucket where the stage's ranks share a node, each
rank's shard in its RMA window where they span nodes, the layout
exchanged, the barriers on the stage's sub-communicator); one replica of
stages takes it as scheme pipeline does. With tensor parallelism (with
stages too) stage 3 puts each tensor shard's (each (stage, tensor shard)
position's) weights in windows over its replicas alike, the WindowSyncs
numbered among the tensor groups' allreduces as the gathers are
(``sequence_collectives``).

A GPU with another backend (more than one rank), NCCL with the one-sided
transport, with ``solver.clip_gradients``, with stages or with tensor
parallelism, the one-sided transport of stages 1 and 2 without stages, and
combinations with other schemes are refused (the config rules,
job/config.py's ``_check_sharded``; the GPU -- the device given on the
command line -- by ``compose``). A pipeline stage that holds no
parameter (the loss alone) has no bucket: its ranks take part in the
collectives over every rank only (the clip's, a save's gathers, stage 3's
test weights), which every rank decides from ``Composition.shard``, never
its own plan.
"""
import numpy as np

from ...base.errors import GraphError, UserError
from .base import (BUCKET_KEYS, Buffers, Composition, Scheme, counted, host_copies, ranges,
                   register_scheme, state_blobs, stream_bytes, stream_meta, streamed_join)
from .hybrid import Hybrid
from .pipeline import Pipeline
from .tensor import TensorParallel


@register_scheme("sharded")
class Sharded(Hybrid):
    keys = BUCKET_KEYS + ("check_collectives", "shard", "prefetch", "transport", "stages",
                          "schedule", "tensor_parallel", "reduce_scatter")
    #: stage 3 on one node: the weights in one shared window (parallel/zero3_windows.py)
    one_sided = True
    #: each rank its shards of every bucket (ZeRO)
    shards_state = True
    #: the deferred tail knows allreduce buckets only
    deferrable = False
    defers_update = False
    #: on GPUs through NCCL: the reduce-scatters and gathers become
    #: NcclReduceScatter and NcclAllgather (parallel/nccl_backend.use_nccl)
    gpu = True
    nccl = True

    def layout(self, job, world):
        """Hybrid's R replicas x p stages with ``parallel.stages``, scheme
        tensor's R replicas x t shards with ``parallel.tensor_parallel``,
        else one replica per rank."""
        if job.parallel.stages:
            return Pipeline.layout(self, job, world)
        if job.parallel.tensor_parallel > 1:
            return TensorParallel.layout(self, job, world)
        return Scheme.layout(self, job, world)

    def compose(self, graph, grads, job, world):
        """Micro-batches accumulated (with stages: this rank's slice, its
        micro-batches scheduled), then the stage-1 rewrite over the replicas
        (one rank: the replica as built; one replica of stages or tensor
        shards: scheme pipeline's or tensor's composition, ``_plain``); ``solver.clip_gradients`` by one
        allreduce of the shards' sums of squares over every rank (``_clip``)."""
        from .steps import accumulate, clipped, compose_stages, micro_copies
        par = job.parallel
        tensor = par.tensor_parallel > 1
        if job.device >= 0 and (par.backend != "nccl" or par.stages or tensor):
            # --device given on the command line, past the config rules: the
            # collectives of a GPU run through NCCL, inside the captured iteration
            # (with stages or tensor parallelism: refused, their groups reduce on MPI)
            key = "stages" if par.stages else "tensor_parallel"
            raise UserError(f"{job.path}: key 'parallel.backend': scheme sharded on GPU "
                            f"{job.device} runs its collectives through NCCL, not "
                            f"{par.backend}; use parallel.backend: nccl (or device: -1)"
                            if not (par.stages or tensor) else
                            f"{job.path}: key 'parallel.{key}': scheme sharded with "
                            f"{'stages' if par.stages else 'tensor parallelism'} runs on the "
                            f"CPU (device -1), not on GPU {job.device}")
        lay = self.layout(job, world)
        plain = _plain(lay)
        if plain is not None:  # one replica: nothing to shard, the plain scheme's graph
            return plain.compose(self, graph, grads, job, world)
        if lay.tensor > 1 and not lay.staged:
            return self._compose_tensor(graph, grads, job, world, lay)
        forward = None
        if lay.staged:  # with tensor shards: the replica's graph split first, as pipeline's
            pairs = self._split(graph, job, world, lay)
            copies = micro_copies(graph, grads, job, in_place=True)
            if par.shard >= 3:  # told apart on the whole net: stage 0's slice has no loss
                from ..sharding import forward_ops
                forward = forward_ops(graph)
            comp = compose_stages(graph, job, world, copies)
            self._tensor_done(comp, pairs, lay, job)
            graph = comp.graph
        else:
            accumulate(graph, grads, job, in_place=True)
            if world.size == 1:
                return clipped(Composition(graph.validate(), lay), job, world)
            comp = Composition(graph, lay)
        from ..data_parallel import sum_over_replicas
        from ..sharding import compose_zero1
        from ..tensor_parallel import sum_over_shard_replicas
        # a synchronised batch norm's sums over the replicas (with stages: the
        # stage's, with tensor shards those holding this shard, numbered
        # among the tensor group's allreduces)
        synced = sum_over_shard_replicas(graph, lay) if lay.staged else \
            [op.name for op in sum_over_replicas(graph)]
        plan = compose_zero1(graph, grads, lay.replicas, lay.replica, stage=par.shard,
                             wire_dtype=par.wire_dtype(), reuse_forward=lay.staged,
                             **_zero_settings(par, forward))
        if synced and par.shard >= 2 and not lay.staged:
            # numbered first, a backward sum could wait (bound_live_buckets) for
            # a later reduce-scatter; stage 3's gathers go before the forward's
            from ..sharding import sequence_collectives
            sequence_collectives(graph, plan, synced)
        if lay.staged:
            tensor = [op.name for op in graph.ops.values() if op.op_type == "Allreduce"
                      and op.attrs.get("group") == lay.tensor_ranks()] if lay.tensor > 1 \
                else []
            tensor += synced  # the batch norm's sums, numbered alike
            if tensor and par.shard >= 2:
                # the plan's collectives numbered among the tensor group's
                # allreduces (``_compose_tensor`` says why); the slice's emission
                # order is its schedule's, as ``_post_in_schedule_order`` numbered them
                from ..sharding import sequence_collectives
                sequence_collectives(graph, plan, tensor)
            _on_stage_group(graph, plan, lay, world)
            if par.shard >= 3:
                # one_sided (auto across RDMA hosts): each stage's (with
                # tensor shards: each position's) weights in windows over its
                # ranks, beside the stage transfers' windows; every rank (a
                # stage without parameters too: the exchange); the WindowSyncs
                # numbered among the tensor groups' allreduces, as the gathers
                from ..zero3_windows import to_shared_weights
                _beside(comp, *to_shared_weights(
                    graph, plan, job, world, lay.stage_ranks(), tensor,
                    "stage and tensor shard" if lay.tensor > 1 else "stage"))
        else:
            # stage 3, parallel.transport one_sided, one node: one shared copy
            # (the WindowSyncs numbered among a synchronised batch norm's sums)
            from ..zero3_windows import to_shared_weights
            comp.windows, comp.transport, comp.window_placement = \
                to_shared_weights(graph, plan, job, world, others=synced)
        # never deferred (``deferrable``): the memory plan must not keep the
        # deferred tail's blobs (under SGD it reached the full buckets)
        graph.deferrable = False
        graph.infer_shapes().validate()
        comp.shard_plan, comp.shard = plan, par.shard
        if job.solver.clip_gradients is not None:
            _clip(comp, job.solver.clip_gradients, world.size)
        if par.check_collectives:
            from ...comm.verify import check_collectives
            check_collectives(graph, world)
        return comp

    def _compose_tensor(self, graph, grads, job, world, lay):
        """With ``parallel.tensor_parallel`` (stages 1-3): scheme
        tensor's split of the net (parallel/tensor_parallel.compose_tensor),
        each tensor shard's gradients then rewritten by ``compose_zero1``
        over its R replicas (the ranks ``lay.shard_ranks()``: the
        sub-communicator tensor's bucket allreduce uses) in place of that
        allreduce; ``solver.clip_gradients`` by ``_clip``."""
        from ..sharding import compose_zero1, sequence_collectives
        from ..tensor_parallel import compose_tensor
        par = job.parallel

        def reduce(graph, grads, group):
            tensor = [op.name for op in graph.ops.values() if op.op_type == "Allreduce"]
            plan = compose_zero1(graph, grads, lay.replicas, lay.replica, stage=par.shard,
                                 wire_dtype=par.wire_dtype(), **_zero_settings(par))
            if par.shard >= 2:
                # a bucket's writers wait for an earlier bucket's reduce-scatter
                # (bound_live_buckets): posted in seq order, that reduce-scatter
                # must not come after a tensor allreduce behind those writers;
                # stage 3's gathers go before their readers, among the allreduces
                sequence_collectives(graph, plan, tensor)
            _on_group(graph, plan, group)
            fields = {"shard_plan": plan, "shard": par.shard}
            if par.shard >= 3:
                # one_sided (auto across RDMA hosts): each tensor shard's
                # weights in windows over its replicas, the WindowSyncs (and
                # GetShards) numbered among the tensor allreduces, as the gathers
                from ..zero3_windows import to_shared_weights
                windows, lines, placed = to_shared_weights(graph, plan, job, world, group,
                                                           tensor, "tensor shard")
                fields.update(windows=windows, transport=lines, window_placement=placed)
            return fields

        comp = compose_tensor(graph, grads, job, world, lay, reduce=reduce)
        if job.solver.clip_gradients is not None:
            _clip(comp, job.solver.clip_gradients, world.size)
        return comp

    def compose_test(self, graph, job, world):
        """With ``parallel.tensor_parallel``: scheme tensor's split test graph
        (with stages too: scheme pipeline's)."""
        lay = self.layout(job, world)
        if lay.tensor > 1 and not lay.staged:
            return TensorParallel.compose_test(self, graph, job, world)
        return super().compose_test(graph, job, world)

    def why_no_buckets(self, par):
        return None

    def why_none_reduced(self, job, world_size):
        """Where the ranks make one replica (``_one_replica``): it runs as
        the plain scheme, no bucket built."""
        one = _one_replica(job.parallel, world_size)
        if one is None:
            return None
        ways, what, like = one
        return (f"the {world_size} ranks are one replica ({ways} {what}), whose gradients no "
                f"other rank shares: it runs as {like}, with no bucket")

    def why_no_transport(self, job, world_size):
        par = job.parallel
        if par.tensor_parallel > 1 and not par.stages and _one_replica(par, world_size):
            # one replica runs as scheme tensor (with stages: their transfers)
            return TensorParallel.why_no_transport(self, job, world_size)
        if not par.stages and par.shard < 3:
            return (f"scheme sharded at shard {par.shard} reduce-scatters and gathers through "
                    "two-sided MPI collectives (windows hold shard 3's weights only)")
        return None

    def key_notes(self, par, note, world_size):
        super().key_notes(par, note, world_size)
        note(["split_params"], "splits large weights into row chunks for the allreduce "
             "buckets; scheme sharded's reduce-scatter cuts every bucket anyway, so it has no "
             "effect")
        one = _one_replica(par, world_size)
        if one is not None:
            ways, what, like = one
            note(["shard", "prefetch", "reduce_scatter"], "shapes how each replica's model "
                 f"state is sharded; "
                 f"the {world_size} ranks are one replica ({ways} {what}), which runs as "
                 f"{like}: nothing is sharded, so it has no effect",
                 f"shape how each replica's model state is sharded; the {world_size} ranks "
                 f"are one replica ({ways} {what}), which runs as {like}: nothing is sharded, "
                 "so they have no effect")
        if par.shard == 1:
            note(["prefetch"], "bounds the buckets live at once at shard 2 and 3 (the full "
                 "gradient buckets; shard 3: the gathered weights); with shard 1 it has no "
                 "effect")

    def one_rank_notes(self, job, note, changed):
        if job.parallel.stages:
            Pipeline.one_rank_notes(self, job, note, changed)
            return
        t = job.parallel.tensor_parallel
        if t > 1:
            note(["scheme"], f"sharded has no effect on 1 rank: the net runs unsplit on this "
                 f"rank and holds the whole model state (start a multiple of {t} ranks, "
                 f"mpiexec -n {t} or more, to split it {t} ways)")
            changed.discard("tensor_parallel")
            return
        note(["scheme"], "sharded has no effect on 1 rank: the one rank holds the whole model "
             "state")

    def settings_without_effect(self, job, world_size):
        """Scheme's notes, and where the ranks make one replica (as many
        ranks as stages or tensor shards): no other rank shares a stage's or
        tensor shard's model state, so it runs as the plain scheme
        (``compose``: ``_plain``)."""
        notes = super().settings_without_effect(job, world_size)
        one = _one_replica(job.parallel, world_size)
        if one is not None:
            ways, what, like = one
            notes.append(f"note: parallel.scheme sharded has no effect with 1 replica: the "
                         f"{world_size} ranks are its {ways} {what}, whose model state no "
                         f"other rank shares, so it runs as {like} (each rank holds its "
                         f"{what[:-1]}'s whole; start mpiexec -n {2 * ways} or more to shard "
                         "it)")
        return notes

    # ---- reporting
    def scheme_lines(self, trainer, composition):
        from ...base.progress_bar import human_bytes
        plan = composition.shard_plan or []
        lay = composition.layout
        plain = _plain(lay)
        if plain is not None:  # one replica: the plain scheme's rows
            rows = plain.scheme_lines(self, trainer, composition)
            what = Pipeline.describe(self, lay) if lay.staged else rows[0][1]
            return [("scheme", f"sharded with 1 replica: runs as scheme {what}")] + rows[1:]
        n = lay.replicas
        held = trainer.model_state()  # the graph's storage (runtime/footprint.py)
        stage = trainer.job.parallel.shard
        grads = "; the full gradient buckets are transient (freed after their reduce-scatter)"
        shared = any("window" in entry for entry in plan)
        what = {1: ", the weights allgathered", 2: ", the weights allgathered" + grads}.get(
            stage, f" (the only weights it holds){grads}; each bucket's weights are allgathered "
            f"into transient buffers before its forward and its backward readers, "
            f"{trainer.job.parallel.prefetch} bucket(s) ahead" + (
                f", each gathered once per iteration and read by all {lay.micro_batches} "
                "micro-batches" if lay.micro_batches > 1 else ""))
        reused = sum(bool(entry.get("backward_reads_forward")) for entry in plan)
        if reused:  # stages under 1F1B: the forward buffer read by the backward too
            what += (f"; {reused} of {len(plan)} bucket(s) gathered once for both (1F1B "
                     "interleaves the forwards and backwards: the backward reads the "
                     "forward's buffer)")
        if shared:
            what = (f" in place{grads}; each bucket's weights are one shared window of the "
                    "node (one copy, read in place by every rank), synchronised before its "
                    "readers and before the updates")
        elif any("gets" in entry for entry in plan):
            what = what.replace("allgathered into transient buffers",
                                "read (MPI_Rget of every owner's shard, from the owners' RMA "
                                "windows) into transient buffers")
        who = f"ranks {ranges(range(n))} are data-parallel replicas; gradients reduce-scattered"
        where = " of its stage" if lay.staged else ""
        if lay.tensor > 1:
            t = lay.tensor
            who = (f"{counted(lay.replicas, 'replica')} x {t}-way tensor parallel (rank = "
                   f"replica x {t} + shard; split layers' activations allreduced in each "
                   f"group of {t} ranks); each tensor shard's gradients reduce-scattered over "
                   f"its {counted(n, 'rank')} (this rank's: {ranges(lay.shard_ranks())})")
            where = " of its tensor shard"
        if lay.staged:
            from .pipeline import tensor_order
            t = lay.tensor
            split, position = ((f" x {t}-way tensor parallel ({tensor_order(lay)}; split "
                                f"layers' activations allreduced in each stage's group of {t} "
                                "ranks)", "(stage, tensor shard)") if t > 1 else
                               (f" (rank = replica x {lay.stages} + stage)", "stage"))
            who = (f"{counted(lay.replicas, 'replica')} x {lay.stages} stages{split}; each "
                   f"{position}'s gradients reduce-scattered over its {counted(n, 'rank')} "
                   f"(this rank's: {ranges(lay.stage_ranks())})")
            where = " of its stage and tensor shard" if t > 1 else where
        from ..sharding import gradient_buckets
        frozen = [entry for entry in plan if entry.get("frozen")]
        if frozen:  # stage 3: the frozen weights sharded too, in units of their own
            what += (f"; the frozen weights (lr_mult 0) held as 1/{n} shards too, in "
                     f"{counted(len(frozen), 'unit')} of their own gathered alike (never "
                     "reduce-scattered or updated, no solver state)")
        body = (f"{who} in {counted(len(gradient_buckets(plan)), 'bucket')}, each rank updates "
                f"its 1/{n} shard of every bucket{where}{what}")
        if lay.staged and not plan:  # a stage without parameters (the loss alone)
            body = f"{who}; stage {lay.stage} (this rank's) holds no parameter: no bucket"
        if not trainer.job.parallel.reduce_scatter:
            body = _allreduced(body)
        rows = [("scheme", f"sharded (ZeRO stage {stage}): {body}"),
                ("model state", f"per rank: weights {human_bytes(held['weights'])}, gradients "
                 f"{human_bytes(held['gradients'])}, optimizer state "
                 f"{human_bytes(held['optimizer_state'])} "
                 f"({held['weights']} + {held['gradients']} + {held['optimizer_state']} bytes "
                 f"held; peak {held['peak']} bytes with the transient buckets' "
                 f"{held['working']})")] + Scheme.scheme_lines(self, trainer, composition)
        return rows + (self.stage_lines(lay, trainer.job) if lay.staged else []) + \
            [("split", line) for line in composition.tensor_plan]

    def graph_notes(self, lay, rank, comp=None):
        note = self._graph_notes(lay, rank, comp)
        plan = getattr(comp, "shard_plan", None) or []
        if note and any(comp.graph.ops[e["reduce_scatter"]].attrs.get("allreduce")
                        for e in plan if "reduce_scatter" in e):
            note = _allreduced(note.replace("reduce-scattered and gathered",
                                            "summed and gathered"))
            if "allreduce" not in note:
                note += ("; each bucket summed whole by data parallelism's allreduce, this "
                         "rank keeping its shard's range (parallel.reduce_scatter: false)")
        return note

    def _graph_notes(self, lay, rank, comp=None):
        plain = _plain(lay)
        if plain is not None:
            return (f"sharded with 1 replica: runs as scheme {plain.config_name}; layout "
                    f"{lay.describe()}; " + (
                        Pipeline.graph_notes(self, lay, rank).split("; ", 1)[1]
                        if lay.staged else f"rank = replica * {lay.tensor} + shard; rank "
                        f"{rank} = replica {lay.replica}, tensor shard {lay.shard}"))
        from ..sharding import gradient_buckets
        plan = getattr(comp, "shard_plan", None) or []
        what = "optimizer state"  # stage 2's gradient buckets are transient; stage 3's weights
        if any("weight_shard" in entry for entry in plan):
            what = "weights, gradients and optimizer state"
        elif plan and comp.graph.blobs[gradient_buckets(plan)[0]["name"]].kind == "grad":
            what = "gradients and optimizer state"
        if lay.tensor > 1 and not lay.staged:
            return (f"layout {lay.describe()}; rank = replica * {lay.tensor} + shard; rank "
                    f"{rank} = replica {lay.replica}, tensor shard {lay.shard}; sharded (ZeRO): "
                    f"rank {rank} holds shard {lay.replica} of {lay.replicas} of every bucket's "
                    f"{what} of its tensor shard, reduce-scattered and gathered over ranks "
                    f"{lay.shard_ranks()} (its tensor shard's replicas)")
        if lay.staged and not plan:  # a stage without parameters (the loss alone)
            return (f"{Pipeline.graph_notes(self, lay, rank)}; sharded (ZeRO): stage "
                    f"{lay.stage} holds no parameter: rank {rank} holds no bucket")
        if lay.staged:
            whose, who = ((" and tensor shard", "this stage's replicas of this tensor shard")
                          if lay.tensor > 1 else ("", "this stage"))
            return (f"{Pipeline.graph_notes(self, lay, rank)}; sharded (ZeRO): rank {rank} "
                    f"holds shard {lay.replica} of {lay.replicas} of every bucket's {what} "
                    f"of this stage{whose}, reduce-scattered and gathered over ranks "
                    f"{lay.stage_ranks()} ({who})")
        return (f"sharded (ZeRO): rank {rank} holds shard {rank} of "
                f"{lay.replicas} of every bucket's {what}")

    # ---- checkpoints: whole blobs on file, streamed bucket by bucket
    def checkpoint_sections(self, graphs, ws, world, local):
        """Streamed (``Streamed``): rank 0 writes the weights, then the
        solver state, bucket by bucket in plan order, each bucket's shards
        gathered as its turn comes (one Igatherv of bytes per bucket and
        blob, ``World.gatherv``) into a buffer of the largest bucket's size
        that the next bucket reuses; the datasets are views of it, cut into
        each parameter's shape. Stages 1 and 2: every rank holds the whole
        weights, rank 0 writes its own (nobody sends them). So rank 0 holds
        one bucket's whole state at a time beyond its own, never the
        model's; the file is the one a join of every rank's parts made (the
        same datasets in the same order). One rank, or one replica of
        stages or tensor shards (no buckets): the plain scheme's sections.
        With pipeline stages (each stage's buckets sharded over its own
        replicas) or tensor parallelism (each tensor shard's over its
        replicas): streamed parameter by parameter (``streamed_join`` with
        ``_join_plan``, the plan of ``join_checkpoint``): each parameter's
        pieces of state (stage 3: and of weight) sent to rank 0 from the
        ranks holding them (``checkpoint_parts``) as its turn comes, so
        rank 0 holds one parameter's whole weight and state at a time
        beyond its own. What each rank holds meanwhile is ``save_bytes``'s
        figure (``plan``'s "checkpoint save" row): change them together."""
        if not _sharding(graphs):  # one rank, one replica of stages or tensor shards
            return Scheme.checkpoint_sections(self, graphs, ws, world, local)
        if self.gathers_checkpoint(graphs):
            params, solver = self.checkpoint_parts(graphs, ws, local)
            return streamed_join(graphs, world, params, solver, _join_plan)
        from ...job.checkpoint_file import Streamed
        plan, pool = _plan(graphs), Buffers()
        return (Streamed(_streamed_weights(graphs, ws, world, plan, pool)),
                Streamed(_streamed_states(graphs, ws, world, plan, pool)))

    # ---- what a save holds, as ``checkpoint_sections`` does it
    def save_meta(self, graphs):
        """``checkpoint_parts``'s lists (``stream_meta``, what the save's
        ``streamed_join`` allgathers) from the graph's blobs, no workspace:
        the weights no bucket holds at stage 3 (else every one), the
        per-parameter state blobs, and each parameter's pieces of this
        rank's flat state shards (stage 3: of its weight shards), cut from
        zero-memory stand-ins of the shards as ``_pieces`` cuts them. No
        bucket: the base class's, the plain scheme's part."""
        blobs = graphs.graph.blobs
        where = _zero3(graphs)
        params = {p: blobs[p] for p in self.held_weights(graphs) if p in graphs.params}
        states = state_blobs(graphs)
        for entry in _plan(graphs):
            for flat, state in _states(entry):
                for p, piece in _pieces(graphs, entry, _stand_in(blobs[flat])):
                    states.setdefault(p, {})[state] = piece
            if where:
                params.update((p, (tuple(blobs[p].shape), piece)) for p, piece in
                              _pieces(graphs, entry, _stand_in(blobs[entry["weight_shard"]])))
        return stream_meta(graphs, params, states)

    def save_ranks(self, graphs):
        """With stages or tensor shards and buckets, every rank: each holds
        its own pieces (``_join_plan`` reads them all)."""
        lay = graphs.layout
        if self.gathers_checkpoint(graphs) and _sharding(graphs):
            return range(lay.replicas * lay.stages * lay.tensor)
        return super().save_ranks(graphs)

    def save_bytes(self, graphs, everyone):
        """As ``checkpoint_sections`` saves. No bucket (one rank, one
        replica of stages or tensor shards): the plain scheme's figure.
        With stages or tensor shards: each rank's host copies on a GPU
        (``checkpoint_parts``: ``to_numpy`` of its weights, flat state
        shards and stage 3's weight shards); on rank 0 ``stream_bytes``
        with ``_join_plan`` over every rank's ``save_meta`` (``everyone``):
        its receive buffers, one parameter's whole weight and states, and
        with tensor shards each shard's pieces copied together (not one
        span of the buffer) and the shards joined, a parameter's size
        each. Else streamed bucket by bucket: on rank 0 the receive
        buffers, slot i at the largest bucket gathered into it (stage 3's
        weights and each bucket's first state into slot 0, its i-th state
        into slot i); on a GPU each rank's host copy of the shard it sends
        (the largest) and rank 0's of a whole weight it writes
        (``to_numpy``: this one and the one written before it)."""
        lay, plan = graphs.layout, _plan(graphs)
        rank = lay.rank(lay.replica, lay.stage)
        blobs = graphs.graph.blobs
        if not _sharding(graphs):
            return Scheme.save_bytes(self, graphs, everyone)
        if self.gathers_checkpoint(graphs):
            flat = [f for entry in plan for f, _ in _states(entry)]
            out = host_copies(graphs, self.held_weights(graphs) + flat)
            return out + (stream_bytes(lay, everyone, _join_plan) if rank == 0 else 0)
        slots, on_gpu = {}, []
        for entry in plan:
            total = int(blobs[entry["weights"]].size)
            # _streamed_weights: stage 3's weights into slot 0;
            # _streamed_states: a bucket's i-th state into slot i
            named = ([(0, entry["weight_shard"])] if "weight_shard" in entry else []) + \
                list(enumerate(f for f, _ in _states(entry)))
            for slot, f in named:
                n = total * np.dtype(blobs[f].dtype).itemsize
                slots[slot] = max(slots.get(slot, 0), n)
                if blobs[f].location.device >= 0:  # the shard a GPU rank copies to send
                    on_gpu.append(blobs[f].nbytes)
        out = sum(slots.values()) if rank == 0 else 0
        out += max(on_gpu, default=0)
        if rank == 0:
            whole = [blobs[p].nbytes for p in graphs.params if p not in _zero3(graphs)
                     and blobs[p].location.device >= 0]
            out += sum(sorted(whole)[-2:])
        return out

    # ---- checkpoints with pipeline stages or tensor parallelism: each
    # parameter's pieces joined on rank 0
    def gathers_checkpoint(self, graphs):
        return graphs.layout.staged or graphs.layout.tensor > 1

    def checkpoint_parts(self, graphs, ws, local):
        """This rank's part of a save with stages or tensor shards, what
        ``join_checkpoint`` joins: ``local()``'s weights (stage 3: those no
        bucket holds, and each parameter's piece of the weight shards,
        ``held_weight_pieces``) and each parameter's pieces of the state
        shards (``held_solver_state``); views of the rank's own blobs."""
        params, solver = local()
        solver.update(self.held_solver_state(graphs, ws))  # a shard's flat state
        if _zero3(graphs):  # stage 3: each parameter's piece of the weight shards
            params = {p: v for p, v in params.items() if p in graphs.params}
            params.update(self.held_weight_pieces(graphs, ws))
        return params, solver

    def held_solver_state(self, graphs, ws):
        """{param: {state: 1-D piece}}: each parameter's part of this rank's
        shard of every bucket's state (the shard's range of its flattened
        state; a parameter outside the shard has none)."""
        from ...base.backend import to_numpy
        out = {}
        for entry in _plan(graphs):
            for flat, state in _states(entry):
                for p, piece in _pieces(graphs, entry, to_numpy(ws[flat])):
                    out.setdefault(p, {})[state] = piece
        return out

    def held_weight_pieces(self, graphs, ws):
        """Stage 3 with stages: {param: (its whole shape, its 1-D piece of
        this rank's weight shard)}, as ``held_solver_state`` cuts the state
        (rank 0 joins the pieces of every stage's parameters: the shapes of
        another stage's are not in its graph)."""
        from ...base.backend import to_numpy
        return {p: (tuple(graphs.graph.blobs[p].shape), piece) for entry in _plan(graphs)
                for p, piece in _pieces(graphs, entry, to_numpy(ws[entry["weight_shard"]]))}

    def join_checkpoint(self, graphs, parts):
        """The weights: each parameter's first holder in world order (rank
        0; with stages, replica 0's stage ranks); at stage 3 each bucketed
        parameter's pieces (``held_weight_pieces``) joined in world order
        into its shape. The state: each parameter's pieces
        (``held_solver_state``) joined in world order -- a stage's ranks in
        replica order, the order of its shards -- and cut into the weight's
        shape; a piece already the whole is taken as it is (a parameter
        inside one shard). With tensor parallelism: each tensor shard's
        pieces joined so over its replicas (``Layout.shard_ranks``), then
        the tensor shards joined into whole blobs as scheme tensor joins
        them (``tensor_parallel.gather_whole``): scheme tensor's file."""
        lay = graphs.layout
        plain = _plain(lay)
        if plain is not None:  # one replica: the plain scheme's join
            return plain.join_checkpoint(self, graphs, parts)
        if lay.tensor > 1:
            # replica 0's rank of each (stage, tensor shard) position: its
            # replicas' pieces joined; then its stage's tensor shards, with
            # stages as scheme pipeline joins them (a part's third item: the
            # splits of the parameters rank 0's graph does not hold)
            from ..tensor_parallel import gather_whole
            joined = {lay.rank(0, s, k): self._join_pieces(
                [parts[lay.rank(r, s, k)] for r in range(lay.replicas)])
                for s in range(lay.stages) for k in range(lay.tensor)}
            splits = {p: split for part in parts for p, split in
                      (part[2] if len(part) > 2 else {}).items()}
            return gather_whole(graphs.graph, lay, joined, splits)
        return self._join_pieces(parts)

    def split_checkpoint(self, graphs, name, value):
        """With tensor parallelism: this rank's tensor shard of a whole blob."""
        if graphs.layout.tensor > 1:
            return TensorParallel.split_checkpoint(self, graphs, name, value)
        return value

    @staticmethod
    def _join_pieces(parts):
        params, weight_pieces = {}, {}
        for part in parts:
            for p, value in part[0].items():
                if isinstance(value, tuple):  # (whole shape, piece): stage 3
                    weight_pieces.setdefault(p, (value[0], []))[1].append(value[1])
                else:
                    params.setdefault(p, value)
        for p, (shape, got) in weight_pieces.items():
            params[p] = _joined(f"the weight '{p}'", got, shape)
        pieces = {}
        for part in parts:
            for p, states in part[1].items():
                for state, value in states.items():
                    pieces.setdefault(p, {}).setdefault(state, []).append(np.asarray(value))
        saved = {}
        for p, states in pieces.items():
            for state, got in states.items():
                saved.setdefault(p, {})[state] = _joined(f"the state '{state}' of '{p}'", got,
                                                         np.shape(params[p]))
        return params, saved

    # ---- stage 3: the weights held as each bucket's shard
    def held_weights(self, graphs):
        """Stage 3: each bucket's weight shard (the frozen weights' units'
        too, ``sharding.frozen_units``), and the parameters no unit holds
        (a running statistic; a parameter no op reads): held whole."""
        where = _zero3(graphs)
        if not where:
            return list(graphs.params)
        shards = [entry["weight_shard"] for entry in _plan(graphs)]
        return shards + [p for p in graphs.params if p not in where]

    def set_weight(self, graphs, ws, name, value):
        """Stage 3: this rank's range of the whole weight, into its bucket's
        shard (the parameter's own blob is a transient view)."""
        where = _zero3(graphs).get(name)
        if where is None:
            ws.set(name, value)
            return
        entry, off = where
        shape = tuple(graphs.graph.blobs[name].shape)
        value = np.asarray(value)
        if tuple(value.shape) != shape:
            raise GraphError(f"cannot load blob '{name}': shape {list(value.shape)} given, "
                             f"the graph has {list(shape)}")
        lo, hi = entry["shard"]
        a, b = max(lo, off), min(hi, off + value.size)
        if a < b:
            ws[entry["weight_shard"]][a - lo:b - lo] = value.ravel()[a - off:b - off]

    def give_test_weights(self, graphs, ws, world, test_ws):
        """Stage 3: the test graph's whole weights gathered from the shards
        of its group (the ranks ``Layout.stage_ranks``: every replica of
        this stage and tensor shard) straight into its own parameter
        arrays: per bucket (plan order) and per parameter (bucket order),
        one Allgatherv of each rank's part of that parameter (its shard's
        range of it; none when the range misses it) into the test array,
        in the group's rank order -- the same order on every rank, each
        under the stall watchdog naming the parameter. A weight held whole
        (no bucket holds it) comes from the group's first rank (Ibcast), as
        the checkpoint join takes it. Nothing is pickled or joined: beside
        the test graph's own whole weights the pass holds at most one
        parameter (a test array on a GPU, or of another dtype than the
        shard: received on the host, then set)."""
        if _sharding(graphs) < 3:
            return
        from ...base.backend import to_numpy
        from ...comm.ops import shard_range
        group = list(graphs.layout.stage_ranks())
        me = group.index(world.rank)
        comm = world.group_comm(group) if graphs.params else None  # a stage without any: none
        for entry in _plan(graphs):
            if "weight_shard" not in entry:
                continue
            total = int(graphs.graph.blobs[entry["weights"]].size)
            ranges = [shard_range(total, len(group), i) for i in range(len(group))]
            if tuple(ranges[me]) != tuple(entry["shard"]):
                raise GraphError(f"rank {world.rank}: bucket {entry['weights']}'s shard "
                                 f"{list(entry['shard'])} is not its range {list(ranges[me])} "
                                 f"among the ranks {group}: the graph was composed for "
                                 "another world")
            shard, lo = ws[entry["weight_shard"]].reshape(-1), entry["shard"][0]
            dtype = np.dtype(graphs.graph.blobs[entry["weight_shard"]].dtype)
            for p, off in zip(entry["params"], entry["offsets"]):
                shape = tuple(graphs.graph.blobs[p].shape)
                size = int(np.prod(shape, dtype=np.int64))
                parts = [(max(a, off), min(b, off + size)) for a, b in ranges]
                a, b = parts[me]
                # this rank's part of ``p``: a view on the host, a copy of
                # the part alone from a GPU
                mine = np.ascontiguousarray(to_numpy(shard[a - lo:b - lo] if a < b
                                                     else shard[:0]), dtype=dtype)
                item = dtype.itemsize
                counts = [max(0, y - x) * item for x, y in parts]
                displs = [max(0, x - off) * item if y > x else 0 for x, y in parts]

                def gather(recv, direct):
                    world.allgatherv(mine, recv, counts, displs,
                                     f"the test graph's gather of the weight '{p}' from its "
                                     f"shards (Allgatherv over ranks {group})", comm)
                _land(test_ws, p, shape, dtype, lambda: np.empty(shape, dtype), gather)
        where = _zero3(graphs)
        for p in graphs.params:  # held whole: the group's first rank's, in graph order
            if p in where:
                continue
            blob = graphs.graph.blobs[p]
            shape, dtype = tuple(blob.shape), np.dtype(blob.dtype)

            def bcast(buf, direct):
                if direct and me == 0 and buf is not ws[p]:  # the root sends its own in place
                    test_ws.set(p, ws[p])
                world.bcast(buf, 0, f"the test graph's weight '{p}' from rank {group[0]} "
                                    f"(Ibcast over ranks {group})", comm)
            _land(test_ws, p, shape, dtype,
                  lambda: np.array(to_numpy(ws[p]), dtype=dtype, order="C"), bcast)

    def whole_solver_shapes(self, graphs):
        from ..tensor_parallel import whole_shape
        g = graphs.graph
        return {(p, state): (whole_shape(g.blobs[p]), g.blobs[flat].dtype)
                for entry in _plan(graphs) for flat, state in _states(entry)
                for p in entry["params"]}

    def load_held_solver_state(self, graphs, ws, saved):
        """Each bucket's whole state laid out from the parameters' (a
        checkpoint of any scheme, on any number of ranks; with tensor
        parallelism each parameter's tensor shard of it first); this rank's
        shard of it; a parameter's state the checkpoint lacks (another solver
        type's file; the parameter frozen, ``lr_mult`` 0, in the run that
        wrote it) is zero, the bucket's others' loaded."""
        fresh = set()
        for entry in _plan(graphs):
            lo, hi = entry["shard"]
            for flat, state in _states(entry):
                whole = np.zeros(graphs.graph.blobs[entry["weights"]].size,
                                 dtype=graphs.graph.blobs[flat].dtype)
                for p, off in zip(entry["params"], entry["offsets"]):
                    if state not in saved.get(p, {}):
                        fresh.add((p, state))
                        continue
                    value = np.asarray(self.split_checkpoint(
                        graphs, p, np.asarray(saved[p][state]))).ravel()
                    whole[off:off + value.size] = value
                ws.set(flat, whole[lo:hi])
        return fresh


def _one_replica(par, world_size):
    """(ways, "stages" or "tensor shards", the scheme that lays them out
    alike) where the ``world_size`` > 1 ranks are one replica (as many as
    stages or tensor shards: each bucket is reduce-scattered over one rank),
    else None."""
    t = par.tensor_parallel
    ways, what, like = ((par.stage_count * t, "stage x tensor shard positions",
                         "scheme pipeline with tensor_parallel") if par.stages and t > 1 else
                        (par.stage_count, "stages", "scheme pipeline") if par.stages else
                        (t, "tensor shards", "scheme tensor"))
    return (ways, what, like) if world_size > 1 and ways > 1 and world_size == ways else None


def _beside(comp, windows, lines, placed):
    """Stage 3's weight windows with stages (``zero3_windows``) beside the
    stage transfers' (``compose_stages``): their transport rows after
    theirs; ``windows`` and ``window_placement`` a list where both hold
    some (runtime/footprint.window_bytes counts each placement)."""
    comp.transport = (comp.transport or []) + (lines or [])
    if windows is not None:
        comp.windows = windows if comp.windows is None else [comp.windows, windows]
    if placed is not None:
        comp.window_placement = placed if comp.window_placement is None else \
            [comp.window_placement, placed]


def _stand_in(blob):
    """A zero-memory array of ``blob``'s shape and dtype (``save_meta``)."""
    return np.broadcast_to(np.zeros((), np.dtype(blob.dtype)), tuple(blob.shape))


def _plain(lay):
    """The plain scheme (class) a layout of one replica of stages or tensor
    shards runs as: Pipeline or TensorParallel, else None (several replicas,
    or one rank)."""
    if lay.replicas != 1:
        return None
    return Pipeline if lay.staged else TensorParallel if lay.tensor > 1 else None


def _land(test_ws, p, shape, dtype, spare, fill):
    """The test workspace's parameter ``p`` (``shape``, ``dtype``) filled
    by the collective ``fill(buffer, direct)``: straight in its own array
    where ``_receives`` allows (``direct``), else in ``spare()``, a host
    array of the collective's own, then set (a test graph without ``p``:
    the collective runs all the same, into ``spare()``)."""
    into = test_ws.arrays.get(p) if p in test_ws.graph.blobs else None
    direct = _receives(into, shape, dtype)
    buf = into if direct else spare()
    fill(buf, direct)
    if into is not None and not direct:
        test_ws.set(p, buf)


def _receives(array, shape, dtype):
    """Whether a collective can land straight in ``array`` (a test
    workspace's parameter): a C-contiguous host array of ``shape`` and
    ``dtype``; else it lands in a host array of its own, then set."""
    return (isinstance(array, np.ndarray) and array.dtype == dtype and
            array.flags.c_contiguous and tuple(array.shape) == tuple(shape))


def _plan(graphs):
    comp = getattr(graphs, "composition", None)
    return (comp.shard_plan if comp is not None else None) or []


def _sharding(graphs):
    """The ZeRO stage the run shards at, 0 where nothing is sharded (one
    rank, one replica of stages or tensor shards). What decides a save's
    and a test pass's collectives: the same on every rank, unlike this
    rank's ``_plan`` (a pipeline stage without parameters has no bucket,
    yet takes part in the other stages' gathers)."""
    comp = getattr(graphs, "composition", None)
    return comp.shard if comp is not None else 0


def _zero3(graphs):
    """Stage 3: {param: (bucket entry, element offset in its bucket)}; {}
    for stages 1 and 2."""
    return {p: (entry, off) for entry in _plan(graphs) if "weight_shard" in entry
            for p, off in zip(entry["params"], entry["offsets"])}


def _gathered(graphs, ws, world, entry, blob, what, pool, slot):
    """Bucket ``entry``'s whole flat array on rank 0 (None elsewhere) from
    every rank's shard ``blob``: one Igatherv of bytes into ``pool``'s
    ``slot``, under the stall watchdog naming ``what``."""
    from ...base.backend import to_numpy
    from ...comm.ops import shard_range
    dtype = np.dtype(graphs.graph.blobs[blob].dtype)
    total = int(graphs.graph.blobs[entry["weights"]].size)
    mine = np.ascontiguousarray(to_numpy(ws[blob]), dtype=dtype).reshape(-1)
    counts = [(hi - lo) * dtype.itemsize
              for lo, hi in (shard_range(total, world.size, r) for r in range(world.size))]
    recv = pool.view(slot, total, dtype) if world.rank == 0 else None
    world.gatherv(mine, recv, counts, 0, f"the checkpoint's gather of {what} of bucket "
                                         f"{entry['weights']} (Igatherv)")
    return recv


def _cut(graphs, entry, whole):
    """(parameter, view of ``whole`` in its shape) of a bucket, in order."""
    for p, off in zip(entry["params"], entry["offsets"]):
        shape = graphs.graph.blobs[p].shape
        size = int(np.prod(shape, dtype=np.int64))
        yield p, whole[off:off + size].reshape(shape)


def _streamed_weights(graphs, ws, world, plan, pool):
    """``/params``: the weights held whole first (all of them under stages
    1 and 2, rank 0's own), then stage 3's buckets, each gathered."""
    from ...base.backend import to_numpy
    where = _zero3(graphs)
    if world.rank == 0:
        for p in graphs.params:
            if p not in where:
                yield p, to_numpy(ws[p])
    for entry in plan:
        if "weight_shard" in entry:
            whole = _gathered(graphs, ws, world, entry, entry["weight_shard"], "the weights",
                              pool, 0)
            if whole is not None:
                yield from _cut(graphs, entry, whole)


def _streamed_states(graphs, ws, world, plan, pool):
    """``/solver``: per bucket, each state gathered into a slot of its own,
    then every parameter's ``{state: value}``."""
    for entry in plan:
        states = _states(entry)  # none: SGD without momentum
        if not states:
            continue
        wholes = [_gathered(graphs, ws, world, entry, flat, f"the solver state '{state}'",
                            pool, i) for i, (flat, state) in enumerate(states)]
        if world.rank != 0:
            continue
        cuts = [dict(_cut(graphs, entry, whole)) for whole in wholes]
        for p in entry["params"]:
            yield p, {state: cut[p] for (_, state), cut in zip(states, cuts)}


def _pieces(graphs, entry, arr):
    """(param, 1-D view of its part of ``arr``), ``arr`` this rank's shard of
    a bucket's flat array (weights or a state); a parameter outside the
    shard has none."""
    lo, hi = entry["shard"]
    for p, off in zip(entry["params"], entry["offsets"]):
        a, b = max(lo, off), min(hi, off + graphs.graph.blobs[p].size)
        if a < b:
            yield p, arr[a - lo:b - lo]


def _joined(what, got, shape):
    """The pieces ``got`` (world order) joined into ``shape``; a piece
    already the whole is taken as it is."""
    got = [np.asarray(x) for x in got]
    size = int(np.prod(shape, dtype=np.int64))
    whole = got[0] if got[0].size == size else np.concatenate([x.ravel() for x in got])
    if whole.size != size:
        raise GraphError(f"{what} joins to {whole.size} elements from the ranks' shards, "
                         f"the weight has {size}")
    return whole.reshape(shape)


def _join_plan(lay, everyone):
    """``join_checkpoint``'s plan for ``streamed_join`` from every rank's
    lists (``everyone``, world order; base ``_stream_plan`` says their
    form): ``_pieces_plan`` over every rank, or with tensor parallelism
    over each tensor shard's ranks (its replicas; with stages too, each
    stage's replicas of it), their tensor shards then joined as
    ``tensor_parallel.gather_whole`` joins them (shard 0's order; a split
    parameter's weight and states from every shard, any other from shard
    0)."""
    if lay.tensor == 1:
        return _pieces_plan(everyone, range(len(everyone)))
    # tensor shard k's ranks in world order: with stages, each stage's
    # replicas of it in replica order (a parameter lies in one stage)
    shards = [_pieces_plan(everyone, range(k, len(everyone), lay.tensor))
              for k in range(lay.tensor)]
    first_weights, first_states = shards[0]
    # a parameter's split, as its first holder lists it (the shards differ in their index only)
    split = {p: everyone[groups[0][0][0]][0][p][2] for p, (_, groups) in first_weights.items()}
    weights = {p: (split[p], [w[p][1][0] for w, _ in shards]) if split[p] else v
               for p, v in first_weights.items()}
    states = {p: {x: (split[p], [s[p][x][1][0] for _, s in shards])
                  if split.get(p) else v for x, v in named.items()}
              for p, named in first_states.items()}
    return weights, states


def _pieces_plan(everyone, ranks):
    """``Sharded._join_pieces``'s plan over the lists of ``ranks`` (world
    order), in its order: the weights held whole from their first holder,
    then stage 3's pieces of each parameter from every rank holding one;
    each parameter's pieces of each state from every rank holding one, in
    the weight's shape; a first piece already the whole alone. A parameter
    whose pieces do not make its size is refused on every rank, before any
    gather."""
    weights, pieces = {}, {}
    for r in ranks:
        for p, (shape, _, _, whole) in everyone[r][0].items():
            if whole is None:
                weights.setdefault(p, (None, [([r], shape)]))
            else:
                pieces.setdefault(p, (whole, []))[1].append(r)
    for p, (shape, got) in pieces.items():
        weights[p] = (None, [(_holders(f"the weight '{p}'", got, [everyone[r][0][p][0]
                                                                 for r in got], shape), shape)])
    held = {}
    for r in ranks:
        for p, named in everyone[r][1].items():
            for x in named:
                held.setdefault(p, {}).setdefault(x, []).append(r)
    states = {}
    for p, named in held.items():
        shape = weights[p][1][0][1]
        states[p] = {x: (None, [(_holders(f"the state '{x}' of '{p}'", got,
                                          [everyone[r][1][p][x][0] for r in got], shape),
                                 shape)]) for x, got in named.items()}
    return weights, states


def _holders(what, ranks, shapes, shape):
    """The ranks whose pieces (of ``shapes``) make an array of ``shape``, as
    ``_joined`` joins them: the first alone where its piece is the whole."""
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    size = int(np.prod(shape, dtype=np.int64))
    if sizes[0] == size:
        return list(ranks[:1])
    if sum(sizes) != size:
        raise GraphError(f"{what} joins to {sum(sizes)} elements from the ranks' shards, "
                         f"the weight has {size}")
    return list(ranks)


def _states(entry):
    """(flat state blob, solver state name) of a bucket: ``<weights>.shard.<state>``."""
    prefix = f"{entry['weights']}.shard."
    return [(flat, flat[len(prefix):]) for flat in entry["states"]]


def _on_stage_group(graph, plan, lay, world):
    """Scheme sharded with stages: the plan's ReduceScatter and Allgather
    ops on this stage's sub-communicator (the ranks ``lay.stage_ranks()``,
    made at start-up as hybrid's allreduce makes it: ``split_groups``, one
    group per stage), every op placed back on this rank (compose_zero1
    placed the replica's slice on its shard index)."""
    from ..data_parallel import place_on_rank
    _on_group(graph, plan, lay.stage_ranks())
    place_on_rank(graph, world.rank)
    split = getattr(world, "split_groups", None)
    if split is not None:  # a live MPI world (graph --np composes offline)
        split(lay.shard_groups())  # with one tensor shard: each stage's ranks


def _on_group(graph, plan, group):
    """The plan's ReduceScatter and Allgather ops on the sub-communicator of
    the ranks ``group`` (a stage's, or a tensor shard's, replicas)."""
    from ..sharding import entry_collectives
    for entry in plan:
        for op in entry_collectives(entry):
            graph.ops[op].attrs["group"] = list(group)
        entry["group"] = list(group)


def _allreduced(text):
    """A start-up or ``graph --np`` text of the reduce-scatters told as
    what ``parallel.reduce_scatter: false`` posts: each bucket summed whole
    by data parallelism's allreduce, the rank keeping its shard's range."""
    return text.replace("gradients reduce-scattered", "gradients summed by data "
                        "parallelism's allreduce, each rank keeping its shard's range "
                        "(parallel.reduce_scatter: false),").replace(
        "freed after their reduce-scatter", "freed after their allreduce").replace(
        "reduce-scattered over", "allreduced over")


def _zero_settings(par, forward=None):
    """``compose_zero1``'s keyword settings from the parallel section."""
    settings = par.bucket_settings()
    settings.pop("split_params")  # the reduce-scatter cuts every bucket anyway
    if not par.reduce_scatter:  # DeepSpeed's reduce_scatter: false: data parallelism's sums
        settings["allreduce"] = True
    if par.shard >= 2:  # the live gradient buckets (and stage 3's gathered weights)
        settings["prefetch"] = par.prefetch
    if forward is not None:
        settings["forward"] = forward
    return settings


def _params_of_updates(graph, plan):
    """{gradient an update op reads: the parameter its weight view is part
    of} (the shard solver's weight views are of a bucket's flat weight
    buffer, at the element's offset; at stage 3 of the rank's weight shard,
    at the offset less the shard's start)."""
    from ...graph.clip import update_ops
    where = {entry["weights"]: (entry, 0) for entry in plan}
    where.update({entry["weight_shard"]: (entry, entry["shard"][0]) for entry in plan
                  if "weight_shard" in entry})
    out = {}
    for op in update_ops(graph):
        w = graph.blobs[op.inputs[0]]
        entry, start = where.get(w.alias_of, (None, 0))
        out[op.inputs[1]] = graph.storage_root(op.inputs[0]) if entry is None else next(
            p for p, off in zip(entry["params"], entry["offsets"])
            if off <= start + w.offset < off + graph.blobs[p].size)
    return out


def _clip(comp, clip, shards):
    """``solver.clip_gradients`` on the shards: each rank's squared norm of
    its shard's (scaled) gradients, one Allreduce of the sums over every
    rank, then each shard scaled. The Allreduce goes between the last
    reduce-scatter and the first allgather in ``seq`` order (the gathers
    wait on the clipped updates); stage 3: after every collective. With
    tensor parallelism a whole (replicated) weight counts on tensor shard 0
    only (``tensor_parallel.count_whole_once``, as scheme tensor's clip
    counts it), the split weights' shards on every rank."""
    from ...graph.clip import add_clip
    graph, plan = comp.graph, comp.shard_plan
    param_of = _params_of_updates(graph, plan) if comp.layout.tensor > 1 else None
    if not any("gather_seq" in entry for entry in plan):  # stage 3: after every collective
        first = 1 + max(op.attrs["seq"] for op in graph.ops.values() if "seq" in op.attrs)
    else:
        first = min(entry["gather_seq"] for entry in plan)
        for entry in plan:
            graph.ops[entry["allgather"]].attrs["seq"] += 1
            entry["gather_seq"] += 1
    comp.graph = add_clip(graph, clip, group=list(range(shards)), seq=first)
    if param_of is not None:
        from ..tensor_parallel import count_whole_once
        count_whole_once(comp.graph, comp.layout, param_of)
    comp.graph.validate()
