"""The parameter servers' loop: what a server rank does in a parameter-server
run (the protocol and the graphs are parallel/param_server.py's). A sync_ps
server runs its server graph once per iteration; an async server runs
``AsyncServer.serve()`` (async_server.py). Both take part in the workers'
stop agreement and send their momenta to rank 0 for its checkpoints
(train/ps_worker.py is the workers' side).

    run_server_rank(job, out_dir, world, resume=None, init=None, dispatcher=None) -> status
    run_server(job, world, resume=None, init=None, log=None, dispatcher=None)
        -> {"params", "momenta", "stats", "plan"}   # one server rank's work
    recv_state(world, servers) -> (momenta, weights),
    state_transfer_due(job, done, start, final_only): the momenta's way to
    rank 0 (and an async server's weights: the model the run ends with).
"""
import numpy as np

from ..graph.solver_graph import momentum_name
from ..job.checkpoint_check import check_finite, check_for_net, check_same_vocabulary
from ..job.run_checkpoints import resolve_resume
from ..parallel.param_server import (plan_param_server, ps_layout, scale_for_micro_batches,
                                      served_params, server_graph)
from ..parallel.schemes.param_server import lockstep
from ..runtime.stop import StopSignal
from .async_server import MEMORY_TAG, STATE_TAG, AsyncServer, send_state


# ------------------------------------------------------------- server rank
class ServerRank:
    """What server rank ``world.rank`` of a parameter-server run holds,
    built as ``run_server`` builds it (the single-replica graph, the plan,
    the windows and, in sync_ps, the server graph) before any array is
    allocated: ``plan`` (tools/plan.py, offline) and train's start-up check
    count it through ``footprint`` (the same figure).

    sync_ps: the server graph runs in a Workspace of its own (every root an
    array: its weights, momenta, one receive buffer per worker and owned
    gradient, their sum; in window memory the slots and the weights), the
    dispatcher's kernels; runtime/footprint.py counts it as a worker's.
    async: the loop's arrays (``AsyncServer``): the owned weights and
    momenta, without windows a receive buffer and a reply buffer (the
    weights' snapshot a reply sends) per (worker, param), over windows the
    window's regions (slots and weights) instead; the SGD updates' host
    temporaries, one at a time. The ``save`` (between iterations): the state
    a checkpoint sends to rank 0 (``send_state``: the momenta pickled, with
    the weights in async) and, at the end, the weights and momenta
    ``run_server`` returns (sync_ps: copied out of the workspace). An async
    server that rank 0 never asks for its state mid-run (``state_asked``)
    sends it once its loop returned, its receive and reply buffers freed
    (``Footprint.save_frees``); they are made after the first fill too
    (``Footprint.fill_rows``)."""

    def __init__(self, job, world):
        from ..job.replica import build_train_graph, check_test_phase, param_shapes
        from ..parallel.ps_windows import allocate, windowed_server
        par = job.parallel
        self.job, self.rank = job, world.rank
        layout = ps_layout(world.size, par.ps_ranks, job.path)
        self.graph, self.grads = build_train_graph(job, 0, len(layout["workers"]))
        self.plan = plan_param_server(self.graph, self.grads, layout)
        scale_for_micro_batches(self.graph, job)
        self.owned = [p for p in self.plan["order"] if self.plan["owner"][p] == world.rank]
        # parallel.transport: the windows (collective with the workers' compose)
        self.windows, self.transport, self.placement = allocate(job, world, self.graph,
                                                                self.plan)
        self.server_graph = None
        if lockstep(par.mode):
            self.server_graph = server_graph(self.graph, self.grads, self.plan, world.rank, job)
            if self.placement is not None:
                windowed_server(self.server_graph, self.plan, world.rank).validate()
        # test data that gives a parameter another shape: the workers' start-up
        # error (after the windows, a collective with their compose, as they
        # find it), found here too, so every rank finds it alike: one line, exit 2
        check_test_phase(job, 0, len(layout["workers"]), param_shapes(self.graph))

    def owned_bytes(self):
        return sum(self.graph.blobs[p].nbytes for p in self.owned)

    def footprint(self, dispatcher=None):
        """This rank's runtime/footprint.Footprint (see the class docstring)."""
        from types import SimpleNamespace
        from ..parallel.schemes.base import Composition
        from ..runtime.footprint import STARTUP_ROWS, Footprint, WorkspacePlans, footprint, \
            host_kernel_bytes, peer_window_bytes, window_bytes
        comp = Composition(self.server_graph, None, window_placement=self.placement)
        owned = self.owned_bytes()
        # between iterations: send_state's pickle of the momenta (async: and the
        # weights), and at the end run_server's copies of both (async: the pickle)
        save = 2 * owned
        if self.server_graph is not None:  # Workspace(graph): no memory plan
            graphs = SimpleNamespace(graph=self.server_graph, test_graph=None, device=-1,
                                     composition=comp)
            return footprint(graphs, WorkspacePlans(keep=[]), self.rank, save=save,
                             dispatcher=dispatcher)
        nw = len(self.plan["workers"])
        updates = self._updates()
        host = {"weights": owned, "optimizer_state": owned,
                "comm_buffers": 0 if self.placement is not None else 2 * nw * owned,
                "windows": window_bytes(comp, self.rank),
                "kernel_temporaries": host_kernel_bytes(updates, serial=True)[
                    "kernel_temporaries"]}
        # the loop's receive and reply buffers are serve()'s, made after the
        # first fill (run_server); a state sent at the end (or on a stop) is
        # sent once they are freed, only one rank 0 asks for mid-run beside them
        return Footprint(rank=self.rank, device=-1, host=host, devices={},
                         model_state={"weights": owned, "gradients": 0,
                                      "optimizer_state": owned},
                         save=save, peer_windows=peer_window_bytes(comp, self.rank),
                         save_frees=() if state_asked(self.job) else
                         ("comm_buffers",),
                         fill_rows=tuple(k for k in STARTUP_ROWS if k != "comm_buffers"))

    def _updates(self):
        """A graph of the owned parameters' SGDUpdate ops (what the async
        loop's kernels run, one at a time on its thread)."""
        from ..graph.core import Graph
        from ..parallel.param_server import build_server_graph
        full = build_server_graph(self.graph, self.grads, self.plan, self.rank)
        g = Graph(full.name)
        g.blobs = full.blobs
        for op in full.ops.values():
            if op.op_type == "SGDUpdate":
                g.add_op(op.name, op.op_type, op.inputs, op.outputs, op.attrs, op.location,
                         op.thread)
        return g


def run_server(job, world=None, resume=None, init=None, log=None, init_skip=(), stop=None,
               profile_from=None, dispatcher=None, memory=None, profiler=None):
    """Everything a server rank does in a parameter-server run. Returns
    {"params": {p: array}, "momenta": {p: array}, "stats": {...}, "plan",
    "planned" (the footprint train's start-up check counted, or None), "stop_code",
    "stopped_by"}. ``stop``: a StopSignal to take part in the workers' stop
    agreement (the ``train`` command); None when workers that make no
    agreement drive the server (tests). ``dispatcher``: the kind that runs
    a sync_ps server's graph (runtime/factory.make_dispatcher; default
    event). ``profiler``: a sync_ps server's dispatcher records its ops
    into it from the first iteration (train's TraceFile, which keeps its
    window's; opened then, once its window is checked as the workers'
    Traces check it). ``memory(server)``: train's start-up memory check of this rank
    (a ``ServerRank``), before the server's arrays are allocated."""
    from ..layers.fillers import fill
    if world is None:
        from ..comm.world import get_world
        world = get_world()
    par = job.parallel
    from ..job.replica import job_vocabulary
    # the text data's vocabulary, read (and checked: a damaged /tokenizer)
    # as every worker's graphs read it, so each rank stops alike
    vocabulary = job_vocabulary(job)
    server = ServerRank(job, world)
    # the footprint the check counted (tools/plan.check_memory), for memory.json
    planned = memory(server) if memory is not None else None
    graph, plan, owned = server.graph, server.plan, server.owned
    windows, transport = server.windows, server.transport
    seed = job.seed
    values, momenta = {}, {}  # the starting values --init and --resume give
    start = 0
    if init:
        from ..job.checkpoint_file import load_params
        from ..job.replica import init_params, kept_constant, param_layer
        found = None  # the params the file may lack: a .caffemodel's kept constants
        if str(init).endswith(".caffemodel"):  # Caffe's weights by layer name, as a worker's
            from ..interop.caffemodel import caffe_params
            skip = set(init_skip)
            # every parameter of the net, as a worker reads them, not this
            # server's alone: a NaN (or a wrong shape) in another server's
            # is found here too, so every rank ends with one message
            loaded = caffe_params(init, {b.name: b.shape for b in graph.params()
                                         if param_layer(b.name) not in skip})[0]
            found = dict.fromkeys(set(loaded) | {b.name for b in graph.params()
                                                 if kept_constant(b)})
        elif str(init).endswith(".safetensors"):  # GPT-2 in Hugging Face's layout
            from ..interop.hf_gpt2 import hf_params
            loaded, _ = hf_params(init, job, init_skip)
        else:
            loaded = load_params(init)
        # checked for every parameter of the net as the workers check it (one
        # the file lacks is found on every rank alike), then this server's
        every = init_params(loaded if found is None else found,
                            [b.name for b in graph.params()], job, init, init_skip)
        if found is None:  # as the workers check it
            check_same_vocabulary(init, vocabulary, job, every)
        # NaN or inf in the file: found here as the workers find it (every
        # parameter they take, in their order), so every rank ends with one
        # message (exit 3), not each worker with its own while this one waits
        check_finite({p: loaded[p] for p in every if p in loaded}, init)
        mine = set(owned)
        wanted = [p for p in every if p in mine]
        values.update({p: np.asarray(loaded[p], graph.blobs[p].dtype) for p in wanted
                       if p in loaded})
        del loaded
    if resume:
        ck = resolve_resume(None, resume)  # a path, or the Checkpoint already read
        # checked against the net as the workers check it (train/checkpoints.py),
        # before any of it is read: a checkpoint of another net is the user's
        # error, found alike on every rank (exit 2), not a KeyError of a server
        zeros = {p: np.broadcast_to(np.zeros((), graph.blobs[p].dtype), graph.blobs[p].shape)
                 for p in owned}
        check_for_net(ck, ck.path, [b.name for b in graph.params()], zeros,
                      {(p, "momentum"): a for p, a in zeros.items()})
        check_same_vocabulary(ck.path, vocabulary, job,
                              [b.name for b in graph.params()], resume=True)
        start = int(ck.attrs["iteration"])
        for p in owned:
            values[p] = np.asarray(ck.params[p], graph.blobs[p].dtype)
            m = (ck.solver or {}).get(p, {}).get("momentum")
            if m is not None:
                momenta[p] = np.asarray(m, graph.blobs[p].dtype)
        ck.loaded()  # the owned arrays are kept above; the others go (a run's own read)
        ck = None

    def starting(p):
        """(weight, momentum) of ``p`` to start from: given, else the
        filler's and zeros; made one parameter at a time (a sync_ps server
        copies each into its workspace before the next: ServerRank counts
        the workspace alone)."""
        blob = graph.blobs[p]
        return (values.pop(p) if p in values else fill(blob, seed),
                momenta.pop(p) if p in momenta else np.zeros(blob.shape, blob.dtype))
    max_iter = job.solver.max_iter
    mode = par.mode
    code = 0
    if lockstep(mode):
        from ..runtime.factory import make_dispatcher
        d = make_dispatcher(server.server_graph, dispatcher, rank=world.rank,
                            stall_timeout=float(par.stall_timeout), profiler=profiler)
        try:
            # train's TraceFile, where this server runs iterations: a run with
            # none (a resume of a finished run) is the workers' "nothing to
            # do" (exit 0) or their refusal, and its earlier trace stays
            if getattr(profiler, "open", None) is not None and start < max_iter:
                window = getattr(profiler, "window", None)
                if window is not None:  # refused as the workers refuse it, file untouched
                    from .profiling import check_window
                    check_window(window, start, max_iter)
                from .profiling import keep_earlier_trace
                keep_earlier_trace(profiler.path, start)  # as a worker's (the workers say it)
                profiler.open()
            for p in owned:
                w, m = starting(p)
                d.workspace.set(p, w)
                d.workspace.set(momentum_name(p), m)
                w = m = None
            for it in range(start, max_iter):
                if profile_from is not None and it == start + profile_from:
                    from ..runtime.trace import Profiler
                    d.drain()
                    d.profiler = Profiler(world.rank)
                d.workspace["iter"][...] = it
                d.run(it)
                # the servers take part in the workers' stop agreement
                code = stop.agree(world) if stop is not None else 0
                if code == StopSignal.DIVERGED:
                    break
                stopping = bool(code) and it + 1 != max_iter
                if stopping or state_transfer_due(job, it + 1, start, final_only=False):
                    send_state(world, {p: d.workspace[momentum_name(p)] for p in owned})
                if stopping:
                    break
                code = 0
            values = {p: d.workspace[p].copy() for p in owned}
            momenta = {p: d.workspace[momentum_name(p)].copy() for p in owned}
            events = d.profiler.events if profile_from is not None and d.profiler else None
        finally:
            d.close()
        stats = {"iterations": max_iter - start}
        if events is not None:
            stats["events"] = events
    else:
        values, momenta = (dict(zip(owned, v)) for v in zip(*map(starting, owned))) \
            if owned else ({}, {})
        lr_op = next(op for op in graph.ops.values() if op.op_type == "LearningRate")
        loop = AsyncServer(world, plan, values, momenta, served_params(graph), lr_op.attrs,
                           par.max_staleness, start, max_iter - start, stop=stop,
                           windows=windows)
        stats = loop.serve()
        code = stats.get("stop_code", 0)
        if code != StopSignal.DIVERGED and (
                code or state_transfer_due(job, max_iter, start, final_only=True)):
            # the weights too: each worker holds the copy it last pulled, which
            # misses the pushes applied after it; the run's model is these
            send_state(world, momenta, values)
    if log:
        log(f"server rank {world.rank}: {len(owned)} params, {stats}")
    stats["transport"] = transport[0][1]
    return {"params": values, "momenta": momenta, "stats": stats, "plan": plan,
            "planned": planned,
            "stop_code": code, "stopped_by": stop.name if code and stop else None}


# ------------------------------------------------- checkpoints and the run
# the servers' state goes to rank 0 (STATE_TAG, async_server.send_state); async
# stops (async_server.py, train/ps_worker.py): rank 0 tells the servers the
# workers' stop code (STOP_TAG); a server that got a signal asks rank 0 to
# stop (STOP_REQUEST_TAG); rank 0 asks an async server for its state between
# two pushes (STATE_REQUEST_TAG)


def state_transfer_due(job, done, start, final_only):
    """Whether servers send their momenta to rank 0 after iteration ``done``:
    at the trainer's checkpoint iterations (sync_ps), with ``checkpoint.best``
    at its test iterations too (a test pass may write a best checkpoint,
    which the servers cannot foresee: rank 0 takes the state whether or not
    it writes one, train/ps_worker.py), and after the last one; never before
    the first iteration the servers run (``start``). Both sides evaluate this
    same rule, so a transfer is never left unmatched."""
    max_iter = job.solver.max_iter
    if done == max_iter:
        return start < max_iter
    if final_only or done <= start:
        return False
    interval, tests = job.checkpoint.interval, job.solver.test_interval
    return (interval > 0 and done % interval == 0) or \
        (job.checkpoint.best is not None and tests > 0 and done % tests == 0)


def state_asked(job, start=0):
    """Whether rank 0 asks an async server for its state between two
    pushes (train/ps_worker.sync, STATE_REQUEST_TAG) in a run from
    iteration ``start``: after an iteration before the last at which a
    checkpoint is due (``checkpoint.interval``) or, with test data, a test
    pass (``solver.test_interval``). The state of the end and of a stop
    comes unasked, once the loop returned."""
    max_iter = job.solver.max_iter

    def before_end(interval):
        return bool(interval) and (start // interval + 1) * interval < max_iter
    return before_end(job.checkpoint.interval) or (
        job.data.test is not None and before_end(job.solver.test_interval))


def recv_state(world, servers):
    """(momenta, weights) of every server, by parameter (weights: empty but
    from async servers)."""
    momenta, weights = {}, {}
    for s in servers:
        got = world.recv_object(s, STATE_TAG, "the server state (momenta)")
        momenta.update(got["momenta"])
        weights.update(got["weights"])
    return momenta, weights


def run_server_rank(job, out_dir, world, resume=None, init=None, init_skip=(),
                    dispatcher=None, memory=None, baseline=None, profile=False,
                    trace_epoch=None):
    """``train`` on a server rank: serve (``dispatcher``: as the workers'),
    take part in the stop agreement, send rank 0 this rank's resident bytes
    for its OUT/memory.json (MEMORY_TAG: ``baseline``, its resident bytes
    before the graphs were built, and the high-water mark;
    trainer.write_memory) and return the stop agreement's exit status (what
    the workers alone find at the end, a non-finite last test pass, comes
    in trainer.agreed_status, after this). ``memory``: train's start-up
    check (tools/plan.py check_memory), given this rank's ``ServerRank``.
    ``profile`` (train's ``--profile``/``--profile-iters``): a sync_ps
    server writes ``OUT/trace.rank<R>.json`` as a worker does (its server
    graph's ops: WaitWrite, the sum, the update, Publish, Release), on the
    workers' time axis (``trace_epoch``: rank 0's start, agreed over every
    rank); an async server runs no graph and writes none."""
    from ..base.rss import peak_rss_bytes
    from ..runtime.footprint import planned_figures
    # the same checkpoint the workers' Trainer resumes from
    resumed = resolve_resume(out_dir, resume)
    traces = None
    if profile and trace_epoch is None:
        raise ValueError("a traced server rank needs the run's time origin (trace_epoch)")
    if profile and lockstep(job.parallel.mode):
        from ..runtime.trace import SERVER_ROLE
        from .profiling import Traces
        traces = Traces(profile, out_dir, world, epoch=trace_epoch, role=SERVER_ROLE)
    try:
        res = run_server(job, world, resume=resumed, init=init, init_skip=init_skip,
                         stop=StopSignal(), dispatcher=dispatcher,
                         memory=None if memory is None else
                         lambda server: memory(job, server, None, world, init=init,
                                               resume=resumed),
                         profiler=None if traces is None else traces.profiler)
    finally:
        if traces is not None:
            traces.profiler.close()
    peak = peak_rss_bytes()
    world.send_object({"rank": world.rank, "server": True, "baseline_rss_bytes": baseline,
                       "peak_rss_bytes": peak,
                       "above_baseline_bytes": None if baseline is None else peak - baseline,
                       "loop_peak_rss_bytes": None, "peer_window_bytes": None,
                       "planned": planned_figures(res.get("planned"))}, 0, MEMORY_TAG,
                      "sending the server's memory figures")
    if res["stop_code"] == StopSignal.DIVERGED:
        return 3
    return StopSignal.exit_status(res["stopped_by"])
