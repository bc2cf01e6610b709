"""``bench``: time training iterations of a config (output: docs/formats.md, "bench --json").

Runs warm-up iterations, then a barrier (several ranks), then times each
iteration from the end of the one before (with ``parallel.defer_update`` an
iteration's tail overlaps the next; the last iteration waits for its own),
profiling the timed ones to compute ``comm_overlap``: the share of this
rank's communication time during which compute ops were also running, and
``post_latency_ms``: for each comm op (a data-parallel bucket's allreduce),
the median over the timed iterations of its post time minus the time its
last input (the bucket's last gradient) was written, the worst rank's.
``post_latency_ms_worst`` is the largest of them (the trace shows the same
per event: ``args.post_latency_us`` and ``args.ready_ts``).
``staging_ms_per_iter``: on a GPU with a non-CUDA-aware MPI, the device time
of the buckets' asynchronous copies to and from their page-locked host
mirrors (trace category ``staging``), per iteration; 0 elsewhere.
``model_state_bytes`` / ``model_state_peak_bytes``: rank 0's weights,
gradients and optimizer state, held (runtime/footprint.model_state_bytes:
the start-up block's ``model state`` line) and live at once
(``model_state_peak``, from the workspace's memory plans);
``bytes_reduce_scattered_per_iter``, ``bytes_allgathered_per_iter``,
``bytes_allreduced_per_iter``: the whole buffers of the composed graph's
ReduceScatter, Allgather and Allreduce ops (comm.ops.collective_bytes);
``max_rss_bytes_per_rank``, ``model_state_bytes_per_rank``: every timed
rank's peak RSS and model-state totals.

``run_bench`` takes a job (job/job.py).
"""
import dataclasses
import statistics
import time

import numpy as np

from ..base.backend import cupy_available, xp_for_device
from ..base.errors import UserError
from ..base.rss import peak_rss_bytes
from ..comm.ops import collective_bytes
from ..gpu.memory import start_peak_memory
from ..job.job import DataSpec
from ..parallel.schemes import mode_class
from ..runtime.footprint import MODEL_STATE_ROWS, model_state_peak
from ..runtime.trace import merge_intervals


def synthetic_config(job):
    """The job with its train data replaced by synthetic data of the same
    shapes, and no test data."""
    spec = job.data.train
    if spec is None:  # a graph: config: its own data ops (the file they name is read)
        return job
    if spec.source == "text":  # token ids, not random floats: the (small) file is read
        return job.replace(data=dataclasses.replace(job.data, test=None, order=("train",)))
    if spec.source != "synthetic":
        from ..data.transform import output_shape
        from ..ops.data import source_info
        try:
            source = spec.source_dict()
            n, sample_shape = source_info(source)
            sample_shape = output_shape(source, sample_shape)  # what the net sees
        except UserError as exc:
            raise UserError(f"bench needs the shapes of data.train: {exc}") from None
        spec = DataSpec(source="synthetic", batch_size=spec.batch_size, shuffle=False,
                        shape=tuple(int(s) for s in sample_shape), classes=_classes(job),
                        num_samples=max(n, spec.batch_size * 4))
    return job.replace(data=dataclasses.replace(job.data, train=spec, test=None,
                                                order=("train",)))


def _classes(job):
    """The classes of the synthetic labels: the fewest any loss or accuracy
    reading the data's labels predicts (10 where none does), so a net of
    fewer than 10 (a binary classifier) takes them (it was refused, exit 2)."""
    from ..job.replica import forward_graph, label_classes
    if job.graph is not None:  # a graph: job's own ops
        return 10
    graph = forward_graph(job, "train", job.data.train.with_batch(job.micro_batch))
    return min((c for _, _, c in label_classes(graph)), default=10)


def comm_timeline(events):
    """``(in_flight, covered, ops)`` of the communication in ``events`` (trace
    microseconds): ``in_flight`` the wall time during which at least one comm
    op was between its post and its completion (the union of their
    intervals, so comm ops that overlap each other count once), ``covered``
    the part of it during which a compute op (categories ``compute``,
    ``update``, ``copy``) was also running on some thread, ``ops`` the
    number of comm events. ``in_flight - covered`` is the exposed
    communication: time spent with a comm op in flight and no compute op
    running."""
    compute = merge_intervals([(e["ts"], e["ts"] + e["dur"]) for e in events
                               if e["cat"] in ("compute", "update", "copy")])
    comm_events = [e for e in events if e["cat"] == "comm"]
    comm = merge_intervals([(e["ts"], e["ts"] + e["dur"]) for e in comm_events])
    total = sum(e - s for s, e in comm)
    covered = 0.0
    j = 0
    for s, e in comm:
        while j < len(compute) and compute[j][1] <= s:
            j += 1
        k = j
        while k < len(compute) and compute[k][0] < e:
            covered += min(e, compute[k][1]) - max(s, compute[k][0])
            k += 1
    return total, covered, len(comm_events)


def comm_overlap(events):
    """Share of communication time covered by compute (0..1), or None
    when there was no communication."""
    total, covered, _ = comm_timeline(events)
    if total <= 0:
        return None
    return covered / total


def run_bench(job, iters=20, warmup=3, real_data=False, dispatcher=None):
    from ..comm.world import get_world, install_abort_handler
    from ..runtime.trace import Profiler
    from ..train.collectives import world_mean
    from ..train.trainer import Trainer
    from .bench_transport import (BENCH_TAG, counters, no_servers, ps_figures, ps_server,
                                  transport_figures)
    from .flops import rank_place
    world = get_world()
    install_abort_handler(world)
    job = job if real_data else synthetic_config(job)
    job = job.with_training(max_iter=warmup + iters)
    scheme, gworld, servers = None, world, None
    if world.size > 1 and mode_class(job.parallel.mode) is not None:
        # the parameter-server modes: the servers serve (bench_transport), the
        # workers are timed; no checkpoints, so the servers' momenta travel once
        from ..parallel.param_server import WorkerScheme, split_workers
        job = job.replace(checkpoint=dataclasses.replace(job.checkpoint, interval=0))
        job, sub = split_workers(job, world)
        if sub is None:
            # a server's part; then rank 0's verdict on the workers' divergence,
            # so that every rank ends alike (one line by rank 0, exit 3 on all)
            ps_server(job, world, warmup, dispatcher)
            what = world.recv_object(0, BENCH_TAG, "bench's verdict on a diverged run")
            if what:
                raise _diverged_error(job, warmup, iters, real_data, what)
            return None
        scheme, world = WorkerScheme(job, gworld), sub
        servers = scheme.ranks["servers"]
    peak = start_peak_memory(xp_for_device(0)) if cupy_available() else None   # before any allocation
    try:
        trainer = Trainer(job, out_dir="/nonexistent-bench-output", world=world, profile=False,
                          dispatcher=dispatcher, log=lambda m: None, scheme=scheme)
    except BaseException:
        if peak is not None:
            peak.close()
        raise
    d = trainer.train
    times, latencies = [], {}
    peaks = own = None
    try:
        # an iteration's time is from the end of the one before: with
        # parallel.defer_update its tail overlaps the next one, and the last
        # tail is waited for inside the last iteration
        for it in range(warmup + iters):
            if it == warmup:
                d.drain()
                d.profiler = Profiler(world.rank)
                moved_before = counters(d)
                if world.size > 1:
                    world.barrier()
                t_prev = time.perf_counter()
            trainer.step(it)
            if it >= warmup:
                if it == warmup + iters - 1:
                    d.drain()
                now = time.perf_counter()
                times.append(now - t_prev)
                t_prev = now
                for name, seconds in d.comm_post_latency().items():
                    latencies.setdefault(name, []).append(seconds * 1000)
        events = d.profiler.events
        report = d.capture_report()
        if peak is not None:   # the run's: not the divergence check's temporaries below
            peaks, own = peak.peak(), peak.own_peak()
        diverged = _diverged(trainer, world)
        replicas = trainer.graphs.data_size
        moved = transport_figures(d, trainer.graphs, iters, moved_before)
    finally:
        trainer.close()
        if peak is not None:
            if peaks is None:   # (the run ended before its figures)
                peaks, own = peak.peak(), peak.own_peak()
            peak.close()
    server_places = []
    moved.update(ps_figures(gworld, servers, server_places)
                 if servers is not None and gworld.rank == 0 else no_servers())
    if servers is not None and gworld.rank == 0:  # the servers wait for it (ps_server above)
        for s in servers:
            gworld.send_object(diverged, s, BENCH_TAG, "bench's verdict on a diverged run")
    plan = trainer.ws.plan
    state = model_state_figures(trainer)
    state.update(per_rank_figures(world, state))
    overlap = comm_overlap(events)
    in_flight_us, covered_us, comm_ops = comm_timeline(events)
    names = sorted(latencies)
    worst = world.allreduce(np.array([statistics.median(latencies[n]) for n in names] or [0.0]),
                            "max", "the post latencies") if world.size > 1 else \
        np.array([statistics.median(latencies[n]) for n in names] or [0.0])
    post_latency = {n: round(float(v), 4) for n, v in zip(names, worst)}
    med = world_mean(world, statistics.median(times))
    mean = world_mean(world, float(np.mean(times)))
    from ..train.progress import global_batch
    batch = job.train_batch
    samples = global_batch(trainer)  # a graph: config's from its data ops
    comm_ms = sum(e["dur"] for e in events if e["cat"] == "comm") / 1000.0 / iters
    compute_ms = sum(e["dur"] for e in events
                     if e["cat"] not in ("comm", "staging", "rma")) / 1000.0 / iters
    # a GPU's buckets through host mirrors (a non-CUDA-aware MPI): the
    # device-to-host copies and the copies back, on the device
    staging_ms = sum(e["dur"] for e in events if e["cat"] == "staging") / 1000.0 / iters
    on_gpu = cupy_available() and any(b.location.device >= 0
                                      for b in trainer.graphs.graph.blobs.values())
    result = {
        "config": job.name,
        "world_size": gworld.size,
        "iters": iters,
        "batch_per_rank": batch if batch is not None else samples // max(1, replicas),
        # the samples of one iteration over every data replica: a pipeline's
        # or a tensor-parallel group's ranks share theirs (job.global_batch)
        "images_per_s": round(samples / med, 2),
        # the closed form over the wall clock: iterations x samples / elapsed
        # (the timed iterations back to back), which slow iterations lower
        # and the median above ignores
        "images_per_s_elapsed": round(samples / mean, 2),
        "iter_ms_median": round(med * 1000, 3),
        "iter_ms_mean": round(mean * 1000, 3),
        "compute_ms_per_iter": round(compute_ms, 3),
        "comm_ms_per_iter": round(comm_ms, 3),
        "staging_ms_per_iter": round(staging_ms, 3),
        # comm_ms_per_iter sums the comm ops' post-to-completion spans; these
        # say what the iteration's wall clock saw of them (comm_timeline)
        "comm_ops_per_iter": round(comm_ops / iters, 2),
        "comm_in_flight_ms_per_iter": round(in_flight_us / 1000.0 / iters, 3),
        "comm_exposed_ms_per_iter": round((in_flight_us - covered_us) / 1000.0 / iters, 3),
        "comm_overlap": None if overlap is None else round(overlap, 4),
        "post_latency_ms": post_latency,
        "post_latency_ms_worst": max(post_latency.values()) if post_latency else None,
        "peak_mem_bytes": int(trainer.ws.allocated_bytes),
        # the host memory plan (runtime/memory_plan.py): its arena, and what
        # the same blobs take one buffer each (null with memory_plan: false)
        "planned_bytes": None if plan is None else int(plan.planned_bytes),
        "unplanned_bytes": None if plan is None else int(plan.unplanned_bytes),
        # this rank's figure in max_rss_bytes_per_rank: one reading, so the
        # two never disagree (the peak can grow between two readings)
        "max_rss_bytes": state["max_rss_bytes_per_rank"][world.rank],
        # each GPU's memory, {device: bytes}: the arena of its blobs, the
        # plan's share of it (transient blobs; what they take one buffer
        # each), the kernels' scratch, and what CuPy's pool holds (with
        # CuPy on a GPU); empty on the CPU
        **device_memory(trainer.ws, peaks, report, own),
        **state,
        "backend": "cupy" if on_gpu else "numpy",
        "dispatcher": type(d).__name__,
        # parallel.backend: who reduced the buckets ("mpi", "nccl"; null: one rank, mpi) and why
        "comm_backend": trainer.graphs.comm_backend,
        "comm_backend_note": trainer.graphs.comm_backend_note,
        "blas": _blas_backend() if on_gpu else None,
        "cuda_graph": None if report is None else json_safe(report),
        "mode": job.parallel.mode if servers is not None else None,
        **moved,
    }
    if job.data.train is not None and job.data.train.source == "text":  # tokens
        result["tokens_per_s"] = round(result["images_per_s"]
                                       * job.data.train.sequence_length, 2)
        result["tokens_per_s_elapsed"] = round(result["images_per_s_elapsed"]
                                               * job.data.train.sequence_length, 2)
    # where every rank runs: the peak MFU divides by is the hardware the job occupies
    place = rank_place(trainer.graphs.device)
    places = world.gather_object(place, 0, "the ranks' devices and cores") \
        if world.size > 1 else [place]
    if world.rank == 0:
        result.update(throughput_flops(job, result, trainer.graphs.graph if on_gpu else None,
                                       places + server_places))
    if diverged:  # after every collective of the figures: no rank (nor server) left waiting
        raise _diverged_error(job, warmup, iters, real_data, diverged)
    return result if world.rank == 0 else None


def _diverged_error(job, warmup, iters, real_data, what):
    """The NonFiniteWeights (exit 3) of a bench run that diverged (``what``:
    ``_diverged``'s answer): the same on every rank, a parameter-server
    run's servers too."""
    from ..job.checkpoint_check import NonFiniteWeights
    return NonFiniteWeights(
        f"bench: {job.name} diverged: {what} after the "
        f"{warmup + iters} iterations ({'the config' if real_data else 'synthetic'} data, "
        f"solver.base_lr {job.solver.base_lr:g}); no figure is reported: they would time "
        "arithmetic on non-finite numbers, which runs at another speed than the run's "
        "(lower solver.base_lr, or check the config with a short train run)")


def _diverged(trainer, world):
    """What diverged, or None: the loss of the last timed iteration (the
    host's, where it holds it) or a weight or its solver state NaN or inf
    on any rank of ``world`` -- one allreduce, at the same place on every
    rank; where something diverged, one gather of each rank's first
    non-finite blob, so that the answer, the same on every rank, names
    them (the loss, the blob and its rank)."""
    from ..train.divergence import DivergenceWatch
    weights = not DivergenceWatch.params_finite(trainer)
    loss = not trainer.graphs.deferred and not trainer.loss_now()[1]
    bad = np.array([int(loss), int(weights)], np.int64)
    if world.size > 1:
        bad = world.allreduce(bad, "max", "bench's check of a diverged loss (allreduce)")
    loss, weights = (bool(v) for v in bad)
    if not (loss or weights):
        return None
    what = []
    if loss:
        what.append("the loss of the last iteration is NaN or inf")
    if weights:
        blob = DivergenceWatch.first_nonfinite(trainer)
        found = [(r, b) for r, b in enumerate(world.allgather_object(
            blob, "bench's names of the non-finite blobs")) if b] \
            if world.size > 1 else ([(0, blob)] if blob else [])
        if found:
            rank, blob = found[0]
            more = len(found) - 1
            where = (f" on rank {rank}" + (f" (and {more} other rank{'s' if more > 1 else ''})"
                                           if more else "")) if world.size > 1 else ""
            what.append(f"'{blob}'{where} holds NaN or inf")
        else:
            what.append("the weights or their solver state hold NaN or inf")
    return " and ".join(what)


#: bench's fields of the bytes each collective type carries per iteration
COLLECTIVE_FIELDS = (("ReduceScatter", "bytes_reduce_scattered_per_iter"),
                     ("Allgather", "bytes_allgathered_per_iter"),
                     ("Allreduce", "bytes_allreduced_per_iter"))


def model_state_figures(trainer):
    """The model-state and collective fields of ``bench --json`` for
    ``trainer``'s rank: ``model_state_bytes`` ({weights, gradients,
    optimizer_state, total}: held, as the start-up block's ``model state``
    line counts them; ``working``: the most bytes of a ZeRO stage's
    transient full buckets live at once), ``model_state_peak_bytes`` (the same rows live at
    once in the workspace's memory plans, and the op where they peak) and
    the bytes of the training graph's ReduceScatter, Allgather and
    Allreduce ops per iteration (each op's whole buffer)."""
    state = trainer.model_state()
    held = {**{row: int(state[row]) for row in MODEL_STATE_ROWS},
            "total": int(sum(state[row] for row in MODEL_STATE_ROWS)),
            "working": int(state.get("working", 0))}
    ws = trainer.ws
    plans = [ws.plan, *(getattr(ws, "device_plans", {}) or {}).values()]
    peak = model_state_peak(trainer.graphs.graph, plans)
    moved = collective_bytes(trainer.graphs.graph)
    return {"model_state_bytes": held,
            "model_state_peak_bytes": {**{k: int(v) for k, v in peak.items() if k != "op"},
                                       "op": peak["op"]},
            **{key: int(moved.get(op_type, 0)) for op_type, key in COLLECTIVE_FIELDS}}


def per_rank_figures(world, state):
    """Every timed rank's peak resident memory and model-state totals (held,
    live at once), rank order: ``max_rss_bytes_per_rank`` and
    ``model_state_bytes_per_rank`` ({"held": [...], "peak": [...]}), summed
    over ``world`` from each rank's own slot."""
    mine = np.zeros((3, world.size), dtype=np.float64)
    mine[:, world.rank] = (peak_rss_bytes(),
                           state["model_state_bytes"]["total"],
                           state["model_state_peak_bytes"]["total"])
    every = world.allreduce(mine, "sum", "the ranks' memory figures") if world.size > 1 else mine
    rss, held, peak = ([int(v) for v in row] for row in every)
    return {"max_rss_bytes_per_rank": rss,
            "model_state_bytes_per_rank": {"held": held, "peak": peak}}


def throughput_flops(job, result, gpu_graph=None, places=None):
    """The FLOPs and MFU fields of ``bench --json`` (tools/flops.py): the
    model FLOPs of a training sample (and token) counted from the ops of one
    replica's graph, PaLM's closed form for a transformer, and the MFU
    against the dense peak, for the precision in use, of the hardware the
    job occupies: ``places``, every rank's ``(host, device, cores)``
    (flops.occupied: the GPUs the ranks run on, else every rank's cores)."""
    from ..job.replica import build_train_graph
    from .flops import (device_peak, gpt_closed_form, gpt_figures, graph_flops, mfu_fields,
                        occupied, rank_place)
    # one micro-batch of one replica, before the scheme, and without activation
    # recompute: model FLOPs count the forward once (PaLM's MFU; a recomputed
    # forward is hardware work, and would raise the MFU of the same model)
    graph, _ = build_train_graph(job.replace(recompute="none", recompute_layers=None))
    # the samples its data ops read: one micro-batch's (B/M), a graph: config's own
    per_sample = graph_flops(graph) / sum(int(op.attrs.get("batch_size", 0))
                                          for op in graph.ops.values()
                                          if op.op_type == "DataReader")
    device, precision = None, "fp32"
    if gpu_graph is not None:
        from ..gpu.cudnn_tune import device_name
        import cupy
        dev = next(b.location.device for b in gpu_graph.blobs.values() if b.location.device >= 0)
        # the precision of the GEMMs (bf16, fp16, tf32, fp32): the peak of that kind
        device, precision = device_name(cupy, dev), job.precision
    kind, units = occupied(places or [rank_place(-1 if device is None else 0)])
    hosts = len({p[0] for p in places or [()]})
    if kind == "gpu":
        peak, source = device_peak(device, precision)
        source += f" x {units} GPU(s) the ranks run on"
    else:
        peak, source = device_peak(None, precision, cores=units)
        source += f" (the cores the {len(places or [0])} rank(s) may run on, {hosts} host(s))"
        units = 1
    out = mfu_fields(per_sample, result["images_per_s"], peak, source, precision, units)
    out["flops_counted"] = ("matrix products of the training graph's ops (fc, conv, "
                            "attention; forward and backward), per sample")
    if "tokens_per_s" in result:
        seq = job.data.train.sequence_length
        out["model_flops_per_token"] = round(per_sample / seq, 1)
        gpt = gpt_figures(graph)
        if gpt is not None:
            n, layers, width, t = gpt
            out["model_flops_per_token_closed_form"] = gpt_closed_form(n, layers, width, t)
            out["closed_form"] = (f"PaLM's 6N + 12*L*H*Q*T with N = {n:,} (the parameters "
                                  f"without position embeddings, as nanoGPT's estimate_mfu), "
                                  f"L = {layers}, H*Q = {width}, T = {t}")
    return out


def device_memory(ws, peaks=None, report=None, own=None):
    """The ``device_*_bytes`` fields of ``bench --json`` for workspace ``ws``;
    ``peaks``: gpu/memory.PeakMemory's {device: bytes}, ``own``: its
    ``own_peak()`` (the run's own, beyond what earlier runs of the process
    held), ``report``: the CUDA-graph capture report (its private pools
    count towards both)."""
    plans = getattr(ws, "device_plans", {}) or {}
    out = {
        "device_arena_bytes": {str(d): int(n) for d, n in sorted(ws.device_bytes.items())},
        "device_planned_bytes": {str(d): int(p.planned_bytes) for d, p in sorted(plans.items())},
        "device_unplanned_bytes": {str(d): int(p.unplanned_bytes)
                                   for d, p in sorted(plans.items())},
        "device_scratch_bytes": {str(d): int(n) for d, n in sorted(ws.scratch_bytes.items())},
        "device_pool_bytes": {},
        # the most bytes in use at once: CuPy's default pool, sampled at each
        # allocation (gpu/memory.py), plus what the captures' pools keep
        "device_peak_bytes": {},
        # the same less what was in use when the run began (and stayed in
        # use while it allocated): a run sharing the process with earlier ones
        "device_own_peak_bytes": {},
    }
    captured = (report or {}).get("capture_pool_bytes") or {}
    for d in sorted(ws.device_bytes):
        if peaks is not None and d in peaks:
            out["device_peak_bytes"][str(d)] = int(peaks[d]) + int(captured.get(str(d), 0))
        if own is not None and d in own:
            out["device_own_peak_bytes"][str(d)] = int(own[d]) + int(captured.get(str(d), 0))
    if ws.device_bytes and cupy_available():
        import cupy
        for d in sorted(ws.device_bytes):
            with cupy.cuda.Device(d):
                out["device_pool_bytes"][str(d)] = int(
                    cupy.get_default_memory_pool().total_bytes())
    return out


def _blas_backend():
    """The cuBLAS binding of the matrix products: "nvmath" or "cupy"."""
    from ..gpu.blas import blas_backend
    return blas_backend()


def json_safe(value):
    """``value`` with every dict key a string, tuples and sets as lists, NumPy
    scalars as Python numbers and anything else JSON cannot hold as its str."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
        return [json_safe(v) for v in items]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _comm_rows(res, ms):
    """The communication rows of ``format_bench``: the comm ops' summed
    post-to-completion time, and (where the result has them) how much of
    the iteration's wall clock they held and how much of that no compute
    hid (the rows after the first have no name, so the columns stay)."""
    overlap = res.get("comm_overlap")
    if overlap is None:
        return [("communication", "none")]
    in_flight = res.get("comm_in_flight_ms_per_iter")
    exposed = res.get("comm_exposed_ms_per_iter")
    ops = res.get("comm_ops_per_iter")
    if in_flight is None or exposed is None or ops is None:  # an older result
        return [("communication", f"{ms(res['comm_ms_per_iter'])} per iteration, "
                                  f"{100 * overlap:.0f}% overlapped with compute")]
    ops_text = f"{ops:,.0f}" if float(ops).is_integer() else f"{ops:,.2f}"
    return [
        ("communication", f"{ms(res['comm_ms_per_iter'])} per iteration summed over {ops_text} "
                          f"comm op{'s' if ops != 1 else ''}, each from its post to its "
                          "completion (they overlap each other and compute)"),
        ("", f"in flight {ms(in_flight)} of the iteration's wall time (at least one comm op "
             f"posted and not completed), {100 * overlap:.0f}% of it with compute running"),
        ("", f"exposed {ms(exposed)}: a comm op in flight and no compute op running (rank 0)"),
    ]


def _state_rows(res, human_bytes):
    """The model-state and collectives rows of ``format_bench`` (none for a
    result without them)."""
    held, peak = res.get("model_state_bytes"), res.get("model_state_peak_bytes")
    rows = []
    if held is not None:
        text = (f"weights {human_bytes(held['weights'])}, gradients "
                f"{human_bytes(held['gradients'])}, optimizer state "
                f"{human_bytes(held['optimizer_state'])}: {human_bytes(held['total'])} held "
                "(rank 0)")
        if peak is not None:
            text += (f", {human_bytes(peak['total'])} live at once at its peak"
                     + (f" (at {peak['op']})" if peak.get("op") else ""))
        rows.append(("model state", text))
    moved = [(what, res.get(key)) for what, key in
             (("reduce-scattered", "bytes_reduce_scattered_per_iter"),
              ("allgathered", "bytes_allgathered_per_iter"),
              ("allreduced", "bytes_allreduced_per_iter"))]
    if any(v is not None for _, v in moved):
        said = [f"{human_bytes(v)} {what}" for what, v in moved if v]
        rows.append(("collectives", ", ".join(said) + " per iteration (whole buffers)"
                     if said else "none"))
    return rows


def format_bench(res, warmup=None):
    """``bench`` without ``--json``: the result in human units (images/s with
    thousands separators, milliseconds, KiB/MiB), ``n/a`` where a figure
    does not exist (no communication on one rank)."""
    from ..base.progress_bar import human_bytes
    ranks = res["world_size"]
    head = (f"bench {res['config']}: {ranks} rank{'s' if ranks != 1 else ''}, batch "
            f"{res['batch_per_rank']:,} per rank, {res['iters']:,} timed iterations"
            + (f" after {warmup:,} warm-up" if warmup is not None else "")
            + f", backend {res['backend']}, {res['dispatcher']}")

    def ms(v):
        return "n/a" if v is None else f"{v:,.2f} ms"

    lat = res.get("post_latency_ms") or {}
    mfu = res.get("mfu")
    rows = [
        ("throughput", f"{res['images_per_s']:,.0f} images/s" if "tokens_per_s" not in res
         else f"{res['tokens_per_s']:,.0f} tokens/s ({res['images_per_s']:,.1f} sequences/s)"),
        ("model FLOPs", "n/a" if "achieved_flops_per_s" not in res else
         f"{res['achieved_flops_per_s'] / 1e9:,.2f} GFLOP/s, MFU "
         + ("n/a" if mfu is None else f"{100 * mfu:.2f}%") + f" of {res['peak_source']}"),
        ("iteration", f"{ms(res['iter_ms_median'])} median, {ms(res['iter_ms_mean'])} mean"),
        ("compute", f"{ms(res['compute_ms_per_iter'])} per iteration (rank 0's ops, summed "
                    "over its threads)"),
        *_comm_rows(res, ms),
        ("post latency", f"{ms(res.get('post_latency_ms_worst'))} worst over "
                         f"{len(lat)} comm op{'s' if len(lat) != 1 else ''}" if lat else
                         "n/a (no communication)"),
        ("memory", f"{human_bytes(res['peak_mem_bytes'])} in blobs (rank 0), "
                   f"{human_bytes(res['max_rss_bytes'])} peak resident"),
        *_state_rows(res, human_bytes),
    ]
    if res.get("blas"):
        rows.append(("matrix products", f"cuBLAS through {res['blas']}"))
    graphs = res.get("cuda_graph")
    if graphs:
        eager = graphs.get("eager_gpu_ops") or {}
        rows.append(("CUDA graphs", f"{graphs.get('captured', 0)} of "
                                    f"{graphs.get('segments', 0)} segments captured, "
                                    f"{len(graphs.get('failed') or {})} failed, {len(eager)} "
                                    f"GPU op{'s' if len(eager) != 1 else ''} run eagerly"))
    if res.get("planned_bytes") is not None:
        rows.append(("memory plan", f"a {human_bytes(res['planned_bytes'])} arena for the "
                     f"blobs that take {human_bytes(res['unplanned_bytes'])} one buffer each"))
    for d, arena in (res.get("device_arena_bytes") or {}).items():
        planned = (res.get("device_planned_bytes") or {}).get(d)
        text = f"a {human_bytes(arena)} arena"
        if planned is not None:
            text += (f", {human_bytes(planned)} of it planned for the blobs that take "
                     f"{human_bytes(res['device_unplanned_bytes'][d])} one buffer each")
        text += f"; {human_bytes((res.get('device_scratch_bytes') or {}).get(d, 0))} scratch"
        pool = (res.get("device_pool_bytes") or {}).get(d)
        if pool is not None:
            text += f"; CuPy's pool holds {human_bytes(pool)}"
        rows.append((f"GPU {d} memory", text))
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join([head] + [f"  {k:<{width}}{v}" for k, v in rows])
