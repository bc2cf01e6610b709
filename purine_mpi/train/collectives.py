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
