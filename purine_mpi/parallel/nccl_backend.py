"""``parallel.backend``: the data-parallel buckets reduced by NCCL.

``apply_backend(graph, job, world, device)`` asks comm/nccl.choose_backend
(the same answer on every rank) and, for nccl, turns each bucket's
``Allreduce`` (comm/ops.py, posted by the host) into an ``NcclAllreduce``
(comm/nccl.py), and scheme sharded's ``ReduceScatter`` and ``Allgather``
into ``NcclReduceScatter`` and ``NcclAllgather``: GPU ops on the device's
``nccl`` stream, so the CUDA-graph
capture takes it with the rest of the iteration, right after its bucket's
gradients. The ops keep their ``seq`` and get a chain of control edges in
``seq`` order: one stream launches them in that order on every rank, as NCCL
requires. A collective over a group (``attrs['group']``) stays on MPI.

Layer: parallel (imports: comm).
"""
from ..base.errors import ConfigError, GraphError
from ..comm.nccl import NCCL_STREAM, choose_backend
from ..comm.ops import bucket_reductions
from .schemes import SCHEMES, scheme_of


def apply_backend(graph, job, world, device):
    """Choose the backend for ``graph`` and rewrite it for NCCL when chosen.
    Returns (backend, reason), or (None, None) where there is nothing to
    choose (one rank and parallel.backend: mpi)."""
    par = job.parallel
    requested = getattr(par, "backend", "mpi")
    if world.size == 1 and requested == "mpi":
        return None, None
    if requested != "mpi" and not scheme_of(job).nccl:
        # decided from the config alone (no collective: parameter servers run
        # other trainers, and their ranks never get here)
        served = sorted({cls.config_name for cls in SCHEMES.values() if cls.nccl})
        why = (f"NCCL reduces the buckets of scheme{'s' * (len(served) > 1)} "
               f"{' and '.join(served)}, mode sync; this job runs scheme "
               f"{par.scheme}, mode {par.mode}")
        if requested == "nccl":
            raise ConfigError(job.path, "parallel.backend", f"nccl cannot run here: {why}; "
                              "use mpi or auto")
        backend, why = "mpi", f"auto: {why}"
    else:
        backend, why = choose_backend(requested, world, device)
    if backend != "nccl" and device >= 0 and getattr(par, "grad_dtype", "fp32") != "fp32" \
            and bucket_reductions(graph):
        # backend auto's choice (a scheme NCCL does not reduce: hybrid,
        # tensor), or --device past the config rules
        raise ConfigError(job.path, "parallel.grad_dtype", f"{par.grad_dtype} on GPU "
                          f"{device} reduces the buckets through NCCL, and this job's go through "
                          f"{backend} ({why}); use parallel.backend: nccl or grad_dtype: fp32")
    if backend == "nccl":
        use_nccl(graph)
    return backend, why


#: the MPI collectives NCCL takes over, and the NCCL op each becomes
NCCL_OPS = {"Allreduce": "NcclAllreduce", "ReduceScatter": "NcclReduceScatter",
            "Allgather": "NcclAllgather"}


def use_nccl(graph):
    """Each ungrouped Allreduce, ReduceScatter and Allgather of ``graph``
    becomes its NCCL op (``NCCL_OPS``) on its device's ``nccl`` stream, all
    chained in ``seq`` order. Returns their names."""
    ops = sorted((op for op in graph.ops.values()
                  if op.op_type in NCCL_OPS and op.attrs.get("group") is None),
                 key=lambda op: op.attrs.get("seq", 0))
    previous = None
    for op in ops:
        devices = {graph.blobs[graph.storage_root(b)].location.device
                   for b in op.inputs + op.outputs}
        if len(devices) != 1 or min(devices) < 0:
            raise GraphError(f"parallel.backend nccl: {op.op_type} '{op.name}' reduces blobs "
                             f"on {sorted(devices)}, NCCL needs them on one GPU")
        op.op_type, op.thread = NCCL_OPS[op.op_type], NCCL_STREAM
        if previous is not None and previous.name not in op.control_inputs:
            op.control_inputs.append(previous.name)
        previous = op
    return [op.name for op in ops]
