"""Parameter servers (Purine §4 / DistBelief): K ranks hold the parameters,
the other ranks (workers) compute gradients on their shard of the data.

Config: ``parallel: {scheme: data, mode: async | sync_ps, ps_ranks: K,
max_staleness: s}``. With N ranks, the *last* K are servers and ranks
0..N-K-1 are workers, so rank 0 (metrics, checkpoints) is a worker. Worker
i reads data shard i of N-K (the sample order of docs/config.md with world_size N-K).

Parameters are sharded over the servers (largest first, each to the least
loaded server). Every worker runs its training graph with the SGDUpdate ops
replaced by communication ops, per parameter p in gradient-ready order (top
layer first, so pushes overlap the rest of the backward pass):

    p.push   Send [p.grad] -> server(p)         tag 2i      (seq 2k)
    p.pull   Recv  -> [p@new] from server(p)    tag 2i + 1  (seq 2k + 1)

``p@new`` aliases ``p``, so the pull waits for every reader of ``p`` in the
iteration and then writes the fresh weights in place.

With ``parallel.micro_batches: M`` a worker's graph is copied M times
(micro_batch.py) after the servers' plan is made from the uncopied graph;
the M gradients are summed in place into the gradient the push sends
(``accumulate_micro_batches``), and every server divides its updates by M
too (``scale_for_micro_batches``: the worker's update ops, which the
copies scale, are replaced by the pushes and pulls).

mode sync_ps (synchronous, equal to data-parallel allreduce): each server
runs a graph too -- per owned p, one Recv per worker, a Sum, the SGDUpdate
(grad_scale / W) and one Send of ``p@new`` per worker -- once per iteration.

mode async: each server runs ``AsyncServer.serve()``, an MPI loop: a push of
p from worker w is applied at once as one SGD step with the gradient and the
weight decay divided by W (W pushes ~ one synchronous step) at the learning
rate of w's iteration; the reply (fresh weights) goes back when w is at most
``max_staleness`` pushes of p ahead of the slowest worker. Staleness 0 makes
every worker wait for all W gradients of the round: all workers then get
the same weights, after all W updates. (The ``train`` command runs
``max_staleness: 0`` as sync_ps -- one update of the summed round -- so that
it is synchronous SGD; see ``synchronous_if_no_staleness``.)

Interface (every function takes the *global* World unless it says so):

    split_workers(job, world) -> (job, the workers' World or None)
    WorkerScheme(job, world)
        # ``train`` on every rank of a PS run (trainer.run_param_server):
        # splits the ranks, servers call run_server_rank (train/ps_server.py,
        # the servers' loop), workers run a
        # Trainer over the workers' World with the WorkerScheme, whose graph
        # comes from compose_param_server, and the stop agreement with the
        # servers as a loop service (train/ps_worker.py). Checkpoints
        # (rank 0, a worker) hold the weights it pulled last and the servers'
        # momenta (sent to rank 0 at checkpoint iterations for sync_ps, at
        # the end for async), so --resume continues exactly in sync_ps.
    compose_param_server(graph, grads, job, world) -> a worker's Composition
    compose_for_rank(graph, grads, job, world_size, rank) -> graph
        # any rank's graph without MPI (``graph --np N --rank R``)
    ps_layout(world_size, ps_ranks), plan_param_server(graph, grads, layout),
    build_worker_graph(graph, plan), build_server_graph(graph, grads, plan,
    server_rank), server_graph(graph, grads, plan, rank, job),
    worker_world(world, ps_ranks): the pieces.
"""

import dataclasses

from ..comm import ops as _comm_ops  # noqa: F401  (registers Send/Recv)
from ..base.errors import ConfigError, UserError
from ..graph.core import Graph
from ..graph.solver_graph import momentum_name
from .schemes.base import Layout
from .schemes.param_server import ParameterServers, asynchronous, lockstep
from .data_parallel import gradient_ready_order, gradients_first, next_seq, place_on_rank


# ----------------------------------------------------------------- layout
def ps_layout(world_size, ps_ranks, path=None):
    """Ranks of the workers and the servers (the last ``ps_ranks``);
    ``path``: the config's, which a wrong count names."""
    ps_ranks = int(ps_ranks)
    if ps_ranks < 1 or ps_ranks >= world_size:
        raise ConfigError(path, "parallel.ps_ranks", f"{ps_ranks} server rank(s), but a "
                          "parameter-server run needs at least one server and one worker: "
                          f"start at least {ps_ranks + 1} ranks (this job has {world_size})")
    return {"workers": list(range(world_size - ps_ranks)),
            "servers": list(range(world_size - ps_ranks, world_size))}


def served_params(graph):
    """{param: SGDUpdate op} for every param the solver updates."""
    return {op.inputs[0]: op for op in graph.ops.values() if op.op_type == "SGDUpdate"}


def plan_param_server(graph, grads, layout):
    """Which server owns each updated param, the push/pull tags, and the
    gradient-ready order. Deterministic: every rank computes the same plan."""
    updates = served_params(graph)
    order = gradient_ready_order(graph, {p: grads[p] for p in updates if p in grads})
    load = {s: 0 for s in layout["servers"]}
    owner = {}
    for p in sorted(order, key=lambda p: (-graph.blobs[p].nbytes, order.index(p))):
        s = min(load, key=lambda s: (load[s], s))
        owner[p] = s
        load[s] += graph.blobs[p].nbytes
    tags = {p: (2 * i, 2 * i + 1) for i, p in enumerate(order)}
    return {"order": order, "owner": owner, "tags": tags, "grads": {p: grads[p] for p in order},
            "workers": list(layout["workers"]), "servers": list(layout["servers"])}


# ----------------------------------------------------------------- worker
def build_worker_graph(graph, plan, thread="comm"):
    """Replace the SGDUpdate ops of ``graph`` by push/pull comm ops (in place)."""
    updates = served_params(graph)
    seq = next_seq(graph)
    for p in plan["order"]:
        op = updates[p]
        graph.remove_op(op.name)
        for b in (momentum_name(p), f"{momentum_name(p)}@new"):
            graph.blobs.pop(b, None)
    for p in plan["order"]:
        blob = graph.blobs[p]
        new = f"{p}@new"
        if new not in graph.blobs:
            graph.add_blob(new, blob.shape, blob.dtype, blob.location, kind="param", alias_of=p)
        push, pull = plan["tags"][p]
        server = plan["owner"][p]
        graph.add_op(f"{p}.push", "Send", [plan["grads"][p]], [],
                     {"seq": seq, "peer": server, "tag": push}, location=blob.location,
                     thread=thread)
        graph.add_op(f"{p}.pull", "Recv", [], [new],
                     {"seq": seq + 1, "peer": server, "tag": pull, "shape": list(blob.shape),
                      "dtype": blob.dtype}, location=blob.location, thread=thread)
        seq += 2
    return graph


def compose_param_server(graph, grads, job, world=None):
    """A worker's training graph for ``parallel.mode`` async or sync_ps.
    ``graph`` is the single-replica graph built for (worker index, number of
    workers); ``world`` is the global World (default: get_world())."""
    world = _global_world(world)
    layout = ps_layout(world.size, job.parallel.ps_ranks, job.path)
    if world.rank not in layout["workers"]:
        raise UserError(f"rank {world.rank} is a parameter server; it runs run_server(), "
                        "not a training graph")
    plan = plan_param_server(graph, grads, layout)   # the servers' (uncopied graph)
    accumulate_micro_batches(graph, grads, job)
    build_worker_graph(graph, plan)
    # parallel.transport: the windows (collective with the servers' run_server)
    # offline (plan) nothing is allocated, and the graph is converted as a run's
    from .ps_windows import allocate, shared_slots, windowed_worker
    windows, transport, placed = allocate(job, world, graph, plan)
    if placed is not None:
        windowed_worker(graph, plan, world.rank, job.parallel.mode, job.parallel.max_staleness,
                        shared=shared_slots(placed, plan, world.rank))
    gradients_first(graph, plan["grads"])  # pushes start as early as possible
    place_on_rank(graph, world.rank)
    graph.infer_shapes().validate()
    from .schemes.base import Composition
    nw = len(layout["workers"])
    lay = Layout(job.parallel.scheme, nw, 1, world.rank, 0, job.parallel.micro_batches)
    return Composition(graph, lay, transport=transport, windows=windows, window_placement=placed,
                       server_plan=dict(plan, mode=job.parallel.mode))


def accumulate_micro_batches(graph, grads, job):
    """A worker's micro-batch copies (``parallel.micro_batches``), their
    gradients summed in place into the gradient its push sends
    (micro_batch._sum_in_place: copy 0 writes it, each running sum adds
    into it), after the servers' plan was made from the uncopied graph
    (its order and tags are the servers'); the copies' update scale is the
    servers' (``scale_for_micro_batches``): the workers' updates are
    replaced by pushes and pulls."""
    from .schemes.steps import accumulate
    accumulate(graph, grads, job, in_place=True)


def scale_for_micro_batches(graph, job):
    """A server's updates of a worker's pushes divided by the micro-batches
    too (in place on the server's uncopied graph, before ``server_graph``
    or the async loop reads them): a worker pushes the sum of its M
    micro-batch gradients, each its micro-batch's mean, as
    micro_batch.replicate_micro_batches scales the update once by 1/M."""
    m = int(job.parallel.micro_batches)
    if m > 1:
        for op in served_params(graph).values():
            op.attrs["grad_scale"] = float(op.attrs.get("grad_scale", 1.0)) / m


def synchronous_if_no_staleness(job):
    """``mode: async`` with ``max_staleness: 0`` lets no worker run ahead of
    any other: every step waits for all W gradients. Applying them one push
    at a time would still take W momentum steps per round, which is not
    synchronous SGD; the server instead sums the round and makes one update
    -- the synchronous protocol (mode sync_ps). Returns the job to run."""
    par = job.parallel
    if asynchronous(par.mode) and par.max_staleness == 0:
        job = dataclasses.replace(job, parallel=dataclasses.replace(par, mode="sync_ps"))
    return job


def compose_for_rank(graph, grads, job, world_size, rank):
    """The graph global ``rank`` of ``world_size`` runs, built without MPI
    (``graph`` CLI). ``graph`` is a single-replica training graph; its data
    shard is re-set to this worker's. A sync_ps server gets its server graph;
    an async server runs a loop, not a graph, and gets an empty graph that
    says so in its name."""
    job = synchronous_if_no_staleness(job)
    par = job.parallel
    layout = ps_layout(world_size, par.ps_ranks, job.path)
    nw = len(layout["workers"])
    plan = plan_param_server(graph, grads, layout)
    from . import ps_windows
    offline = _Offline(world_size, rank)
    kind = ps_windows.choose(job, offline, plan)[0]
    windowed = kind != "two_sided"
    if rank in layout["workers"]:
        for op in graph.ops.values():
            if op.op_type == "DataReader":
                op.attrs["rank"], op.attrs["world_size"] = rank, nw
        accumulate_micro_batches(graph, grads, job)   # copy k reads shard rank*M + k
        build_worker_graph(graph, plan)
        if windowed:
            ps_windows.windowed_worker(graph, plan, rank, par.mode, par.max_staleness,
                                       shared=kind == "shared")
        gradients_first(graph, plan["grads"])
        place_on_rank(graph, rank)
        return graph.infer_shapes().validate()
    scale_for_micro_batches(graph, job)
    if lockstep(par.mode):
        server = server_graph(graph, grads, plan, rank, job)
        return ps_windows.windowed_server(server, plan, rank).validate() if windowed else server
    owned = [p for p in plan["order"] if plan["owner"][p] == rank]
    return Graph(f"{graph.name}.async_server{rank} (AsyncServer loop over "
                 f"{len(owned)} params: {', '.join(owned)})")


class _Offline:
    """A world of ``size`` ranks without MPI (``graph --np N``)."""

    comm = None

    def __init__(self, size, rank):
        self.size, self.rank = size, rank


def worker_world(world=None, ps_ranks=1, path=None):
    """A World over the worker ranks only, for the trainer's collectives
    (metrics, evaluation). Collective: every rank calls it; servers get None.
    Worker i of the result is global rank i. ``path``: the config's, which a
    wrong count names."""
    from ..comm.world import World
    world = _global_world(world)
    layout = ps_layout(world.size, ps_ranks, path)
    color = 1 if world.rank in layout["servers"] else 0
    sub = world.world_comm.Split(color, world.rank)
    if color == 1:
        sub.Free()
        return None
    return World(sub)


def _global_world(world):
    if world is None:
        from ..comm.world import get_world
        world = get_world()
    return world


# ----------------------------------------------------------- sync_ps server
def server_graph(graph, grads, plan, rank, job):
    """The sync_ps graph server ``rank`` runs, placed on that rank, with
    ``solver.clip_gradients`` (graph/clip.py): the one server holds every
    parameter, so its norm is the global one (the config allows clipping
    with one server only)."""
    server = build_server_graph(graph, grads, plan, rank)
    clip = job.solver.clip_gradients
    if clip is not None:
        from ..graph.clip import add_clip
        server = add_clip(server, clip, thread="comm").validate()
    place_on_rank(server, rank)
    return server


def build_server_graph(graph, grads, plan, server_rank, thread="comm"):
    """The per-iteration graph of server ``server_rank`` for mode sync_ps:
    receive every worker's gradient of each owned param, sum, update, send
    the new weights back. ``graph`` is the single-replica training graph."""
    updates = served_params(graph)
    owned = [p for p in plan["order"] if plan["owner"][p] == server_rank]
    workers = plan["workers"]
    g = Graph(f"{graph.name}.server{server_rank}")
    keep = {"iter", "lr"}
    for p in owned:
        op = updates[p]
        keep.update(op.inputs + op.outputs)
        keep.discard(op.inputs[1])
    for name in graph.blobs:
        if name in keep:
            g.blobs[name] = _copy_blob(graph.blobs[name])
    lr_ops = [op for op in graph.ops.values() if "lr" in op.outputs]
    for op in lr_ops:
        g.add_op(op.name, op.op_type, op.inputs, op.outputs, op.attrs, op.location, op.thread)
    seq = 0
    received = {}
    for p in owned:
        gblob = graph.blobs[plan["grads"][p]]
        received[p] = []
        for w in workers:
            name = f"{plan['grads'][p]}@w{w}"
            g.add_blob(name, gblob.shape, gblob.dtype, gblob.location, kind="grad")
            g.add_op(f"{name}.recv", "Recv", [], [name],
                     {"seq": seq, "peer": w, "tag": plan["tags"][p][0],
                      "shape": list(gblob.shape), "dtype": gblob.dtype},
                     location=gblob.location, thread=thread)
            received[p].append(name)
            seq += 1
    for p in owned:
        op = updates[p]
        total = received[p][0]
        if len(workers) > 1:
            total = f"{plan['grads'][p]}.sum"
            gblob = graph.blobs[plan["grads"][p]]
            g.add_blob(total, gblob.shape, gblob.dtype, gblob.location, kind="grad")
            g.add_op(f"{total}.reduce", "Sum", received[p], [total], location=op.location,
                     thread=op.thread)
        attrs = dict(op.attrs)
        attrs["grad_scale"] = float(attrs.get("grad_scale", 1.0)) / len(workers)
        g.add_op(op.name, "SGDUpdate", [op.inputs[0], total] + op.inputs[2:], op.outputs,
                 attrs, op.location, op.thread)
    for p in owned:
        for w in workers:
            g.add_op(f"{p}.send@r{w}", "Send", [f"{p}@new"],
                     [], {"seq": seq, "peer": w, "tag": plan["tags"][p][1]},
                     location=graph.blobs[p].location, thread=thread)
            seq += 1
    return g.infer_shapes().validate()


def _copy_blob(blob):
    return blob.copy()


class WorkerScheme(ParameterServers):
    """A worker's part (the trainer runs it over the workers' World): the PS
    worker graph. ``world`` is the global World. The stop agreement with the
    servers and the checkpoints that carry the servers' momenta are a loop
    service (train/ps_worker.py)."""

    #: the stop agreement tells the servers at once, so a worker checks its
    #: loss every iteration (a divergence found later could not be taken back)
    defer_loss_readback = False
    #: a worker's pushes and pulls are point-to-point: no deferred tail
    defers_update = False

    def __init__(self, job, world):
        self.world = world
        self.ranks = ps_layout(world.size, job.parallel.ps_ranks, job.path)

    def compose(self, graph, grads, job, world):
        return compose_param_server(graph, grads, job, self.world)


def split_workers(job, world):
    """(the job a PS run trains with, the workers' World or None on a
    server). Collective: every rank calls it."""
    job = synchronous_if_no_staleness(job)
    return job, worker_world(world, job.parallel.ps_ranks, job.path)
