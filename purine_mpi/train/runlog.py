"""The start-up block a training run prints on rank 0 before its first
iteration: what runs, where, on what, and where it writes. Plain lines (no
colours, no cursor control), so a batch log reads as well as a terminal::

    purine_mpi 0.1.0: train digits_lenet (jobs/digits_lenet.yaml)
      ranks       2 on 1 host
      devices     node1: ranks 0-1 on the CPU
      threads     1 per rank (2 usable cores / 2 ranks on this host (MPI_LOCALNRANKS))
      scheme      data parallel (mode sync): ranks 0-1 are workers, gradients allreduced in 4 buckets
      gradients   reduced in float32 (parallel.grad_dtype: fp32)
      batch       32 per rank x 2 ranks = 64 global; test 60 per rank
      parameters  23,466 in 8 blobs (91.7 KiB, float32)
      memory      584.9 KiB of blobs on rank 0: 22 transient blobs planned into a 416.0 KiB arena (947.8 KiB one buffer each), 168.9 KiB kept
      planned     4.5 MiB of host memory on rank 0 (4,729,764 bytes: host scratch 2.6 MiB, activations 712.0 KiB, MPI transport buffers 512.0 KiB, ...); measured: memory.json
      data        train 1,437 samples (data/digits.h5, split train), test 360 samples (...)
      solver      sgd, base_lr 0.05, lr_policy step; iterations 0 -> 900
      output      runs/digits_lenet/2
      set-up      0.21 s (graphs, data, initial weights)

A ``note`` row after ``devices`` names the GPU-only ``PURINE_*`` variables
set for a run whose ranks are all on the CPU (they have no effect there).

On a GPU whose convolutions take the cuDNN path, a last row says how many
plans were timed, in how long, and how many came from the plan cache
(gpu/cudnn_tune.py)::

      cuDNN plans 0 plans timed in 0.00 s, 9 from the cache (~/.cache/purine_mpi/cudnn_plans/...)

``startup_lines(trainer, ranks)`` builds it from a Trainer and every rank's
(hostname, device) of the trainer's world (gathered by the trainer).
"""
import socket

from .. import __version__
from ..base import env, threads
from ..data.sources import source_info
from ..base.progress_bar import human_bytes
from ..comm.ops import bucket_reductions, moved_bytes
from ..parallel.schemes.base import counted as _count, ranges, ranks_word as _ranks_word  # noqa: F401

#: hosts listed one by one in the devices line; the rest are counted
MAX_HOSTS = 8


def rank_info(trainer):
    """This rank's (hostname, device) for the devices line."""
    hosts = getattr(trainer.world, "hosts", None)
    name = hosts.host_names[hosts.host_of[trainer.world.rank]] if hosts is not None \
        else socket.gethostname()
    return name, int(trainer.graphs.device)


def devices_line(infos, servers=()):
    """``node1: ranks 0-1 on the CPU; node2: ranks 2-3 on GPUs 0, 1`` from
    {rank: (host, device)}; ``servers``: {rank: host} of parameter-server
    ranks (they hold the parameters in host memory)."""
    by_host = {}
    for r, (host, dev) in sorted(infos.items()):
        by_host.setdefault(host, []).append((r, dev))
    for r, host in sorted(dict(servers).items()):
        by_host.setdefault(host, []).append((r, None))
    parts = []
    for host, members in list(by_host.items())[:MAX_HOSTS]:
        words = []
        workers = [(r, d) for r, d in members if d is not None]
        cpu = [r for r, d in workers if d < 0]
        gpu = [(r, d) for r, d in workers if d >= 0]
        if cpu:
            words.append(f"{_ranks_word(cpu)} on the CPU")
        if gpu:
            ids = ", ".join(str(d) for _, d in gpu)
            words.append(f"{_ranks_word([r for r, _ in gpu])} on "
                         f"{'GPU' if len(gpu) == 1 else 'GPUs'} {ids}")
        served = [r for r, d in members if d is None]
        if served:
            words.append(f"{_ranks_word(served)} ({'server' if len(served) == 1 else 'servers'})"
                         " on the CPU")
        parts.append(f"{host}: {', '.join(words)}")
    if len(by_host) > MAX_HOSTS:
        parts.append(f"and {len(by_host) - MAX_HOSTS} more hosts")
    return "; ".join(parts)


def scheme_lines(trainer):
    """[(label, text)] of the scheme: which ranks are workers, servers or
    stages, and the micro-batches (the scheme's ``startup_lines``)."""
    job = trainer.job
    par = job.parallel
    lay = trainer.graphs.layout
    out = trainer.scheme.startup_lines(trainer, trainer.graphs.composition)
    micro = par.micro_batches
    if micro > 1:
        use = "per stage, overlapped across stages" if lay.staged else "gradients accumulated"
        out.append(("micro-batches", f"{micro} of {job.micro_batch} samples, schedule "
                    f"{par.schedule} ({use})"))
    return out


def data_text(data):
    """``train 1,437 and test 360 samples of 1x8x8 (data/digits.h5)``;
    ``data``: the job's DataSpecs."""
    parts = []
    for phase, spec in data.items():
        n, shape = source_info(spec.source_dict())
        where = {"hdf5": spec.path, "lmdb": f"lmdb {spec.path}",
                 "text": f"text {spec.path}"}.get(spec.source, "synthetic")
        parts.append((phase, n, "x".join(map(str, shape)), where))
    if len({(shape, where) for _, _, shape, where in parts}) == 1:
        _, _, shape, where = parts[0]
        counts = " and ".join(f"{phase} {n:,}" for phase, n, _, _ in parts)
        return f"{counts} samples of {shape} ({where})"
    return ", ".join(f"{phase} {n:,} samples of {shape} ({where})"
                     for phase, n, shape, where in parts)


def memory_text(trainer):
    """The memory row: rank 0's blobs, with the memory plans' arenas (the
    host's, each GPU's: runtime/memory_plan.py) and what their blobs would
    take one buffer each."""
    ws = trainer.ws
    plan = getattr(ws, "plan", None)
    text = f"{human_bytes(ws.allocated_bytes)} of blobs on rank 0"
    if plan is None:
        return text + " (memory_plan: false: one buffer per blob)"
    text += (f": {_count(len(plan.offsets), 'transient blob')} planned into a "
             f"{human_bytes(plan.planned_bytes)} arena ({human_bytes(plan.unplanned_bytes)} one "
             f"buffer each), {human_bytes(plan.persistent_bytes)} kept")
    for device, dplan in sorted(getattr(ws, "device_plans", {}).items()):
        text += (f"; GPU {device}: {_count(len(dplan.offsets), 'transient blob')} in "
                 f"{human_bytes(dplan.planned_bytes)} ({human_bytes(dplan.unplanned_bytes)} one "
                 f"buffer each), {human_bytes(dplan.persistent_bytes)} kept")
    return text


def planned_text(fp):
    """The ``planned`` row: rank 0's footprint as train's start-up check
    counted it (tools/plan.check_memory), the figures ``plan`` prints for
    the same job and layout: the host's need, its rows (the MPI transport
    buffers from the node the run found), and each GPU's; None without a
    check (``--no-memory-check``)."""
    if fp is None:
        return None
    need = fp.host_total
    text = f"{human_bytes(need)} of host memory on rank 0 ({need:,} bytes: {fp.rows_text()}"
    if need != fp.loop_total:  # a save or the start-up load holds the most
        when = "a save" if need == fp.save_total else "start-up"
        text += f"; {human_bytes(need - fp.loop_total)} more at {when}"
    text += ")"
    for d in sorted(fp.devices):
        text += f"; GPU {d}: {human_bytes(fp.device_total(d))} ({fp.rows_text(d)})"
    return text + "; measured: memory.json"


def gradient_line(graph, grad_dtype):
    """The start-up block's ``gradients`` row: the dtype the gradient
    buckets are reduced in (``parallel.grad_dtype``; float32 where each is
    reduced over one rank: data_parallel.wire_attrs), or None where the
    graph reduces no bucket (one rank, parameter servers, pipelines)."""
    ops = bucket_reductions(graph)
    if not ops:
        return None
    if grad_dtype == "fp32":
        return "reduced in float32 (parallel.grad_dtype: fp32)"
    if not any("wire_dtype" in op.attrs for op in ops):  # over one rank each: not rounded
        return (f"reduced in float32 (parallel.grad_dtype: {grad_dtype} has no effect: each "
                "bucket is reduced over one rank)")
    wire = sum(moved_bytes(graph, op) for op in ops)
    return (f"reduced in bfloat16 (parallel.grad_dtype: {grad_dtype}): "
            f"{human_bytes(wire)} per iteration, half of float32's; the master weights, the "
            "local gradients and the update stay float32")


def parameters_text(graphs):
    """The ``parameters`` row: the trained parameters' count (those a
    solver updates), then, where the net has any, the state that is not
    trained (batch norm's running statistics, frozen parameters) apart:
    ``13,706 in 8 blobs (53.5 KiB, float32); not trained: 64 in 2 blobs
    (256 B: running statistics)``."""
    (n_params, n_bytes, n_blobs, dtypes), (n_rest, rest_bytes, rest_blobs, kinds) = \
        graphs.param_counts
    text = (f"{n_params:,} in {_count(n_blobs, 'blob')} "
            f"({human_bytes(n_bytes)}, {', '.join(dtypes) or 'none'})")
    if rest_blobs:
        text += (f"; not trained: {n_rest:,} in {_count(rest_blobs, 'blob')} "
                 f"({human_bytes(rest_bytes)}: {' and '.join(kinds)})")
    return text


def startup_lines(trainer, infos, setup_seconds):
    """The start-up block (see the module docstring). ``infos``: {rank:
    (host, device)} of the trainer's world."""
    job = trainer.job
    replicas = trainer.graphs.data_size
    ps = trainer.scheme.server_ranks()  # a parameter-server worker's {workers, servers}
    size = trainer.world.size + (len(ps["servers"]) if ps else 0)
    head = f"purine_mpi {__version__}: train {job.name}"
    if job.path:
        head += f" ({job.path})"
    hosts = {h for h, _ in infos.values()}
    servers = {}
    if ps:
        gw = trainer.scheme.world
        gh = getattr(gw, "hosts", None)
        servers = {r: gh.host_names[gh.host_of[r]] if gh is not None else "?"
                   for r in ps["servers"]}
        hosts |= set(servers.values())
    rows = [("ranks", f"{size} on {_count(len(hosts), 'host')}"),
            ("devices", devices_line(infos, servers))]
    unused = env.cpu_note() if all(d < 0 for _, d in infos.values()) else None
    if unused:  # PURINE_CONV and the like, set for a run on the CPU
        rows.append(("note", unused))
    rows.append(("threads", threads.describe()))
    rows += scheme_lines(trainer)
    backend = getattr(trainer.graphs, "comm_backend", None)
    if backend is not None:   # parallel.backend: which reduces the buckets, and why
        rows.append(("collectives", f"{backend} ({trainer.graphs.comm_backend_note})"))
    grads = gradient_line(trainer.graphs.graph, job.parallel.grad_dtype)
    if grads:   # parallel.grad_dtype: what the gradient buckets cross the ranks in
        rows.append(("gradients", grads))
    data = job.data
    if data.train is not None:
        per = "worker" if ps else ("pipeline" if trainer.graphs.layout.staged else "rank")
        b = job.train_batch
        text = f"{b:,} per {per}"
        if replicas > 1:
            text += f" x {replicas} {per}s = {job.global_batch(replicas):,} global"
        if data.test is not None:
            text += f"; test {data.test.batch_size:,} per {per}"
        rows.append(("batch", text))
    rows.append(("parameters", parameters_text(trainer.graphs)))
    rows.append(("memory", memory_text(trainer)))
    planned = planned_text(getattr(trainer, "planned", None))
    if planned:  # the start-up check's footprint: plan's figures for rank 0
        rows.append(("planned", planned))
    from ..graph.recompute import describe_recompute
    recompute = describe_recompute(trainer.graphs.graph)
    if recompute:
        rows.append(("recompute", recompute))
    if data:
        rows.append(("data", data_text(data)))
    sol = job.solver
    rows.append(("solver", f"{sol.type}, base_lr {sol.base_lr}, "
                 f"lr_policy {sol.lr_policy}; iterations "
                 f"{trainer.state.start_iter:,} -> {sol.max_iter:,}"))
    ck = job.checkpoint
    every = ck.interval
    rows.append(("output", f"{trainer.out_dir} (checkpoints "
                 + (f"every {every:,} iterations, " if every else "at the end, ")
                 + (f"keep {ck.keep})" if ck.keep else "keep all)")))
    rows.append(("set-up", f"{setup_seconds:.2f} s (graphs, data, initial weights)"))
    from ..gpu.cudnn_tune import summary as cudnn_summary
    cudnn_line = cudnn_summary()   # convolutions on the cuDNN path: plans timed / cached
    if cudnn_line:
        rows.append(("cuDNN plans", cudnn_line))
    width = max(len(k) for k, _ in rows) + 2
    return [head] + [f"  {k:<{width}}{v}" for k, v in rows]
