"""The trainer's few collectives outside the graph (checkpoint gathers,
metric means), each a non-blocking request polled under the stall timeout
(``World.wait``), and the object helpers they use.
"""
import numpy as np



def get_world():
    """The MPI world (rank, size, comm); works without a launcher too."""
    from ..comm.world import get_world as _get
    return _get()


def world_gather(world, obj, what="a checkpoint gather"):
    """Gather picklable ``obj`` from every rank to rank 0 (None elsewhere),
    under the stall watchdog."""
    return world.gather_object(obj, 0, what) if world.size > 1 else [obj]


def world_mean(world, values, what="a metric mean"):
    """Mean over ranks of a float or a float array (same order on all ranks,
    under the stall watchdog)."""
    arr = world_sum(world, np.atleast_1d(values), what) / world.size
    return float(arr[0]) if np.ndim(values) == 0 else arr


def world_sum(world, values, what="a metric sum"):
    """Sum over ranks of a float array (same order on all ranks, under the
    stall watchdog)."""
    arr = np.asarray(values, dtype=np.float64)
    return world.allreduce(arr, "sum", what) if world.size > 1 else arr


def _plain(obj):
    """Checkpointed RNG states come back with numpy scalars; make them ints."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, np.ndarray) and obj.ndim == 0:
        return obj.item()
    return obj


def average_running_stats(world, graph, ws, shard=0):
    """Set every rank's running statistics (the parameters no gradient
    moves: a batch norm's ``running_mean`` and ``running_var``) to their
    mean over the ranks that hold them (those of tensor shard ``shard``),
    before a test pass and a save. Each replica updates its own from its
    part of the batch; their mean is what one rank with the whole batch
    keeps (the running averages are linear in the batch statistics: exact
    for the mean, the variance the replicas' mean), and the test pass and the
    checkpoint then use one model. Collective over ``world``, at the same
    point on every rank; nothing on one rank."""
    if world.size == 1:
        return
    from ..base.backend import to_numpy
    mine = {f"{shard}/{b.name}": (b.name, tuple(b.shape)) for b in graph.params()
            if not b.attrs.get("learnable", True) and b.name in ws.arrays}
    union = {}
    for held in world.allgather_object({k: s for k, (_, s) in mine.items()},
                                       "the running statistics' names"):
        union.update(held)
    if not union:
        return
    keys = sorted(union)  # the same order on every rank
    sizes = [int(np.prod(union[k], dtype=np.int64)) for k in keys]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    send = np.zeros(int(starts[-1]) + len(keys))  # the values, then the holders
    for i, k in enumerate(keys):
        if k in mine:
            send[starts[i]:starts[i + 1]] = to_numpy(ws[mine[k][0]]).ravel()
            send[starts[-1] + i] = 1.0
    total = world.allreduce(send, "sum", "the running statistics' mean")
    for i, k in enumerate(keys):
        if k in mine:
            name, shape = mine[k]
            mean = total[starts[i]:starts[i + 1]] / total[starts[-1] + i]
            ws.set(name, mean.reshape(shape).astype(ws[name].dtype))


def share_running_stats(loop):
    """``average_running_stats`` of a loop's graphs, before its test pass
    or save: over the replicas that hold each (its tensor shard's); not
    where the replicas train apart (scheme none: each keeps its own, and
    rank 0's replica is the model tested and saved: ``RankGraphs.apart``)."""
    if not loop.graphs.apart:
        average_running_stats(loop.world, loop.graphs.graph, loop.ws,
                              getattr(loop.graphs.layout, "shard", 0))
