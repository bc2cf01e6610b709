"""Data parallelism through a shared window (``parallel.transport:
one_sided``, every rank on one node): each bucket's Allreduce gets window
regions, allocated once at start-up, and sums through them
(comm/rma_reduce.py's ``WindowAllreduce`` op) instead of ``MPI_Iallreduce``.

Why only with ``one_sided`` (``auto`` keeps MPI's allreduce):
benchmarks/transport.py's ``reduce`` rows measure the sum over a shared
window faster than ``Allreduce`` on 2 ranks of one node (1-16 MiB), but
in a whole job its additions run on the ranks' compute cores, where
``MPI_Iallreduce`` on shared memory overlaps the backward pass; the
whole-job comparison (``--jobs``) decides, see docs/performance.md.
On GPUs (keys ``device``, ``backend``) ``one_sided`` is a user error:
the window is host memory, and the buckets' device staging
(comm/device.py) would be bypassed.

    to_window_allreduce(local, job, world) -> (windows, transport lines, placement)
"""
from ..comm.windows import WindowLayout, allocate_or_fall_back, fake_host_of, node_groups
from .one_sided import refuse_on_gpu
from .placement import asks_for_gpu

PREFIX = "dp/"


def to_window_allreduce(local, job, world):
    """Give the whole-world bucket Allreduce ops of ``local`` (a data-parallel
    rank's graph) window regions when ``parallel.transport`` is one_sided
    and every rank shares one node; allocate them (collective). Returns
    (the Windows or None, the transport lines: what was chosen, or None,
    the window placement ``(layout, node_of)`` the footprint counts, or
    None). Offline (``graph --np``, ``plan``: no communicator) the layout
    is made and nothing is allocated."""
    if job.parallel.transport != "one_sided" or world.size == 1:
        return None, None, None
    # decided by the job: the graph is placed on its device only after this
    # (parallel/rank_graphs.py), so its blobs are all on the CPU here
    if asks_for_gpu(job):
        refuse_on_gpu(job, "the gradient buckets")
    live = getattr(world, "comm", None) is not None  # graph --np, plan: nothing to allocate
    node_of = node_groups(world) if live else \
        {r: fake_host_of(r) or 0 for r in range(world.size)}
    # the buckets' (a synchronised batch norm's float64 sums stay MPI's)
    ops = sorted((op for op in local.ops.values() if op.op_type == "Allreduce"
                  and not op.attrs.get("group") and "bucket" in op.attrs),
                 key=lambda op: int(op.attrs.get("seq", 0)))
    dtypes = {local.blobs[b].dtype for op in ops for b in op.outputs}
    if len(set(node_of.values())) != 1 or not ops or dtypes != {"float32"}:
        return None, [("gradients", "MPI allreduce", "ranks on several hosts, or "
                       "buckets the shared-window sum does not take")], None
    layout, size = WindowLayout(), world.size
    for op in ops:
        base = f"{PREFIX}{op.name}"
        n = sum(int(local.blobs[b].size) for b in op.outputs)
        everyone = range(size)
        for q in everyone:
            layout.add(f"{base}@r{q}", q, (n,), "float32", peers=everyone)
            for word in ("arrived", "reduced"):
                layout.add_word(f"{base}.{word}@r{q}", q, peers=everyone, writer=q)
        layout.add(f"{base}.sum", 0, (n,), "float32", peers=everyone)
    placed = (layout, node_of)  # what each rank's windows hold (runtime/footprint.py)
    if not live:
        return None, None, placed
    windows, lines = allocate_or_fall_back(  # MPI's allreduce stands in for the window
        world, layout, node_of, lambda exc: [("gradients", "MPI allreduce", f"one_sided: {exc}")])
    if windows is None:
        return None, lines, None
    for op in ops:
        op.op_type = "WindowAllreduce"  # comm/rma_reduce.py: the sum through the window
        op.attrs.update(window=f"{PREFIX}{op.name}", window_ranks=size)
    return windows, [("gradients", "summed through a shared window",
                      "parallel.transport: one_sided, ranks of one node")], placed
