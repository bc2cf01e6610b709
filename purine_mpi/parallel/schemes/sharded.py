"""``scheme: sharded``, ``shard: 1``: ZeRO stage 1 (issue 43). Every rank is
a data-parallel replica on its share of the batch; each gradient bucket is
reduce-scattered, each rank runs the solver on its shard of every bucket
(its optimizer state: that shard's only) and the updated weights are
allgathered (parallel/sharding.compose_zero1). On MPI, on the CPU.

Checkpoints hold whole blobs: rank 0's weights (every rank holds them all)
and the optimizer state of every rank's shard, joined in rank order per
bucket and cut back into each parameter's shape, so the file is the one
plain data parallelism writes; on load each rank takes its shard of the
whole state. Stages 2 and 3, GPUs, NCCL, the one-sided transport and
combinations with other schemes are refused by the config rules
(job/config.py's ``_check_sharded``).
"""
import numpy as np

from ...base.errors import UserError
from .base import BUCKET_KEYS, Composition, Scheme, counted, ranges, register_scheme


@register_scheme("sharded")
class Sharded(Scheme):
    keys = BUCKET_KEYS + ("check_collectives", "shard")
    #: the deferred tail and NCCL know allreduce buckets only
    deferrable = False
    defers_update = False
    gpu = False

    def compose(self, graph, grads, job, world):
        """Micro-batches accumulated, then the stage-1 rewrite (one rank: the
        replica as built); ``solver.clip_gradients`` by one allreduce of the
        shards' sums of squares (``_clip``)."""
        from .steps import accumulate, clipped
        if job.device >= 0:  # --device given on the command line, past the config rules
            raise UserError(f"{job.path}: key 'device': parallel.scheme sharded runs on the CPU "
                            f"(MPI) only, not on GPU {job.device}; use device: -1 or scheme data")
        accumulate(graph, grads, job)
        lay = self.layout(job, world)
        if world.size == 1:
            return clipped(Composition(graph.validate(), lay), job, world)
        from ..sharding import compose_zero1
        par = job.parallel
        settings = par.bucket_settings()
        settings.pop("split_params")  # the reduce-scatter cuts every bucket anyway
        plan = compose_zero1(graph, grads, world.size, world.rank, **settings)
        # nothing is deferred (``deferrable``): the memory plan need not keep
        # what a deferred tail would touch (each bucket's shard of the
        # gradients goes into the arena, as a transient blob)
        graph.deferrable = False
        graph.infer_shapes().validate()
        comp = Composition(graph, lay, shard_plan=plan)
        if job.solver.clip_gradients is not None:
            _clip(comp, job.solver.clip_gradients, world.size)
        if par.check_collectives:
            from ...comm.verify import check_collectives
            check_collectives(graph, world)
        return comp

    def why_no_buckets(self, par):
        return None

    def one_rank_notes(self, job, note, changed):
        note(["scheme"], "sharded has no effect on 1 rank: the one rank holds the whole model "
             "state")

    # ---- reporting
    def scheme_lines(self, trainer, composition):
        from ...base.progress_bar import human_bytes
        plan = composition.shard_plan or []
        n = trainer.world.size
        held = trainer.model_state()  # the graph's storage (runtime/footprint.py)
        return [("scheme", f"sharded (ZeRO stage 1): ranks {ranges(range(n))} are data-parallel "
                 f"replicas; gradients reduce-scattered in {counted(len(plan), 'bucket')}, each "
                 f"rank updates its 1/{n} shard of every bucket, the weights allgathered"),
                ("model state", f"per rank: weights {human_bytes(held['weights'])}, gradients "
                 f"{human_bytes(held['gradients'])}, optimizer state "
                 f"{human_bytes(held['optimizer_state'])} "
                 f"({held['weights']} + {held['gradients']} + {held['optimizer_state']} bytes "
                 "held)")]

    def graph_notes(self, lay, rank):
        return (f"sharded (ZeRO stage 1): rank {rank} holds shard {rank} of "
                f"{lay.replicas} of every bucket's optimizer state")

    # ---- checkpoints: whole blobs on file
    def gathers_checkpoint(self, graphs):
        return bool(_plan(graphs))

    def held_solver_state(self, graphs, ws):
        from ...base.backend import to_numpy
        return {s: to_numpy(ws[s]) for entry in _plan(graphs) for s in entry["states"]}

    def join_checkpoint(self, graphs, parts):
        """Rank 0's weights; each bucket's state shards joined in rank order
        and cut into every parameter's whole state."""
        params, saved = parts[0][0], {}
        for entry in _plan(graphs):
            for flat, state in _states(entry):
                whole = np.concatenate([part[1][flat] for part in parts])
                for p, off in zip(entry["params"], entry["offsets"]):
                    shape = graphs.graph.blobs[p].shape
                    size = int(np.prod(shape, dtype=np.int64))
                    saved.setdefault(p, {})[state] = whole[off:off + size].reshape(shape).copy()
        return params, saved

    def whole_solver_shapes(self, graphs):
        g = graphs.graph
        return {(p, state): (g.blobs[p].shape, g.blobs[flat].dtype)
                for entry in _plan(graphs) for flat, state in _states(entry)
                for p in entry["params"]}

    def load_held_solver_state(self, graphs, ws, saved):
        """Each bucket's whole state laid out from the parameters' (a
        checkpoint of any scheme, on any number of ranks); this rank's
        shard of it."""
        fresh = set()
        for entry in _plan(graphs):
            lo, hi = entry["shard"]
            for flat, state in _states(entry):
                if not all(state in saved.get(p, {}) for p in entry["params"]):
                    fresh.add(state)
                    continue
                whole = np.zeros(graphs.graph.blobs[entry["weights"]].size,
                                 dtype=graphs.graph.blobs[flat].dtype)
                for p, off in zip(entry["params"], entry["offsets"]):
                    value = np.asarray(saved[p][state]).ravel()
                    whole[off:off + value.size] = value
                ws.set(flat, whole[lo:hi])
        return fresh


def _plan(graphs):
    comp = getattr(graphs, "composition", None)
    return (comp.shard_plan if comp is not None else None) or []


def _states(entry):
    """(flat state blob, solver state name) of a bucket: ``<weights>.shard.<state>``."""
    prefix = f"{entry['weights']}.shard."
    return [(flat, flat[len(prefix):]) for flat in entry["states"]]


def _clip(comp, clip, shards):
    """``solver.clip_gradients`` on the shards: each rank's squared norm of
    its shard's (scaled) gradients, one Allreduce of the sums over every
    rank, then each shard scaled. The Allreduce goes between the last
    reduce-scatter and the first allgather in ``seq`` order (the gathers
    wait on the clipped updates)."""
    from ...graph.clip import add_clip
    graph, plan = comp.graph, comp.shard_plan
    first = min(entry["gather_seq"] for entry in plan)
    for entry in plan:
        graph.ops[entry["allgather"]].attrs["seq"] += 1
        entry["gather_seq"] += 1
    comp.graph = add_clip(graph, clip, group=list(range(shards)), seq=first).validate()
