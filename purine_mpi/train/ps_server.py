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
from ..job.run_checkpoints import resolve_resume
from ..parallel.param_server import plan_param_server, ps_layout, served_params, server_graph
from ..parallel.schemes.param_server import lockstep
from ..runtime.stop import StopSignal
from .async_server import STATE_TAG, AsyncServer, send_state


# ------------------------------------------------------------- server rank
def run_server(job, world=None, resume=None, init=None, log=None, init_skip=(), stop=None,
               profile_from=None, dispatcher=None):
    """Everything a server rank does in a parameter-server run. Returns
    {"params": {p: array}, "momenta": {p: array}, "stats": {...}, "stop_code",
    "stopped_by"}. ``stop``: a StopSignal to take part in the workers' stop
    agreement (the ``train`` command); None when workers that make no
    agreement drive the server (tests). ``dispatcher``: the kind that runs
    a sync_ps server's graph (runtime/factory.make_dispatcher; default
    event)."""
    from ..layers.fillers import fill
    from ..job.replica import build_train_graph
    if world is None:
        from ..comm.world import get_world
        world = get_world()
    par = job.parallel
    layout = ps_layout(world.size, par.ps_ranks, job.path)
    nw = len(layout["workers"])
    graph, grads = build_train_graph(job, 0, nw)
    plan = plan_param_server(graph, grads, layout)
    seed = job.seed
    owned = [p for p in plan["order"] if plan["owner"][p] == world.rank]
    values = {p: fill(graph.blobs[p], seed) for p in owned}
    momenta = {p: np.zeros(graph.blobs[p].shape, graph.blobs[p].dtype) for p in owned}
    start = 0
    if init:
        from ..job.checkpoint_file import load_params
        from ..job.replica import init_params
        if str(init).endswith(".safetensors"):  # GPT-2 in Hugging Face's layout
            from ..interop.hf_gpt2 import hf_params
            loaded, _ = hf_params(init, job, init_skip)
        else:
            loaded = load_params(init)
        wanted = init_params(loaded, owned, job, init, init_skip)
        values.update({p: np.asarray(loaded[p], graph.blobs[p].dtype) for p in wanted})
    if resume:
        ck = resolve_resume(None, resume)  # a path, or the Checkpoint already read
        start = int(ck.attrs["iteration"])
        for p in owned:
            values[p] = np.asarray(ck.params[p], graph.blobs[p].dtype)
            m = (ck.solver or {}).get(p, {}).get("momentum")
            if m is not None:
                momenta[p] = np.asarray(m, graph.blobs[p].dtype)
    max_iter = job.solver.max_iter
    mode = par.mode
    code = 0
    # parallel.transport: the windows (collective with the workers' compose)
    from ..parallel.ps_windows import allocate, windowed_server
    windows, transport = allocate(job, world, graph, plan)
    if lockstep(mode):
        from ..runtime.factory import make_dispatcher
        sg = server_graph(graph, grads, plan, world.rank, job)
        if windows is not None:
            windowed_server(sg, plan, world.rank).validate()
        d = make_dispatcher(sg, dispatcher, rank=world.rank,
                            stall_timeout=float(par.stall_timeout))
        try:
            for p in owned:
                d.workspace.set(p, values[p])
                d.workspace.set(momentum_name(p), momenta[p])
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
        lr_op = next(op for op in graph.ops.values() if op.op_type == "LearningRate")
        server = AsyncServer(world, plan, values, momenta, served_params(graph), lr_op.attrs,
                             par.max_staleness, start, max_iter - start, stop=stop,
                             windows=windows)
        stats = server.serve()
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
            "stop_code": code, "stopped_by": stop.name if code and stop else None}


# ------------------------------------------------- checkpoints and the run
# the servers' state goes to rank 0 (STATE_TAG, async_server.send_state); async
# stops (async_server.py, train/ps_worker.py): rank 0 tells the servers the
# workers' stop code (STOP_TAG); a server that got a signal asks rank 0 to
# stop (STOP_REQUEST_TAG); rank 0 asks an async server for its state between
# two pushes (STATE_REQUEST_TAG)


def state_transfer_due(job, done, start, final_only):
    """Whether servers send their momenta to rank 0 after iteration ``done``:
    at the trainer's checkpoint iterations (sync_ps) and after the last one.
    Both sides evaluate this same rule, so a transfer is never left unmatched."""
    max_iter = job.solver.max_iter
    if done == max_iter:
        return start < max_iter
    interval = job.checkpoint.interval
    return not final_only and interval > 0 and done % interval == 0


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
                    dispatcher=None):
    """``train`` on a server rank: serve (``dispatcher``: as the workers'),
    take part in the stop agreement, and return the same exit status as the
    workers (trainer.run_and_report)."""
    # the same checkpoint the workers' Trainer resumes from
    resumed = resolve_resume(out_dir, resume)
    res = run_server(job, world, resume=resumed, init=init, init_skip=init_skip,
                     stop=StopSignal(), dispatcher=dispatcher)
    if res["stop_code"] == StopSignal.DIVERGED:
        return 3
    return StopSignal.exit_status(res["stopped_by"])
