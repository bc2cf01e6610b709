"""Parameter servers over windows (``parallel.transport``, issue 34): the
workers' pushes and pulls of parallel/param_server.py become one-sided.

Every rank (workers and servers) declares the same layout from the PS plan
(``ps_window_layout``; the plan is deterministic) and allocates it once at
start-up (``allocate``: comm/windows.py, collective on the global world).
Server s owns, per param p it serves:

    ps/<grad>@w<w>            worker w's gradient slot (shape of p), with
                              notify words ``.written`` (server) and
                              ``.free`` (worker w): the Put/WaitWrite/
                              Release protocol of comm/rma_ops.py
    ps/<p>                    the weights, readable by every worker, with
                              the word ``ps/<p>.version`` (server)
    ps/<p>.applied@w<w>       (async) worker w's pushes of p applied so far

sync_ps: a worker's ``p.push`` Send becomes a Put into its slot and its
``p.pull`` Recv a Get of ``ps/<p>`` once ``version`` reached the iteration
count; the server's Recvs become WaitWrites (the slots are the received
blobs: no copy; a Release after the ops that read each) and its W Sends
of p@new one ``p.publish`` (Publish: p into
the region, version += 1). The server never takes part in a pull.
async: the server loop (train/async_server.py) polls its slots' words,
applies each gradient, raises ``applied``; a worker's Get waits for its own
push applied and the slowest worker within ``max_staleness``, and reads
under the version's sequence lock. The async server serves no pulls.

The transport is one for the whole run: windows when ``pair_transport``
gives every (worker, server) pair a window, else two-sided Send/Recv (a
note says why). ``graph --np N`` converts the ops as on one node and
allocates nothing.
"""
from .schemes.param_server import asynchronous, lockstep
from ..comm.windows import (WindowLayout, allocate_or_fall_back, fake_host_of, node_groups,
                            pair_transport)

PREFIX = "ps/"


def slot(plan, p, w):
    return f"{PREFIX}{plan['grads'][p]}@w{w}"


def weights(p):
    return f"{PREFIX}{p}"


def applied(p, w):
    return f"{PREFIX}{p}.applied@w{w}"


def ps_window_layout(graph, plan, mode):
    """The WindowLayout every rank declares for the PS plan ``plan``."""
    layout = WindowLayout()
    workers = plan["workers"]
    for p in plan["order"]:
        s, blob = plan["owner"][p], graph.blobs[p]
        for w in workers:
            name = slot(plan, p, w)
            layout.add(name, s, blob.shape, blob.dtype, peers=[w])
            layout.add_word(name + ".written", s, peers=[w])
            layout.add_word(name + ".free", w, peers=[s])
            if asynchronous(mode):
                layout.add_word(applied(p, w), s, peers=workers)
        layout.add(weights(p), s, blob.shape, blob.dtype, peers=workers)
        layout.add_word(weights(p) + ".version", s, peers=workers)
    return layout


def choose(job, world, plan):
    """(kind, why, node table): "shared"/"rma" when every (worker, server)
    pair gets a window, else "two_sided"; the same on every rank."""
    transport = job.parallel.transport
    live = getattr(world, "comm", None) is not None
    node_of = node_groups(world) if live else \
        {r: fake_host_of(r) or 0 for r in range(world.size)}
    kinds = {}
    for s in plan["servers"]:
        for w in plan["workers"]:
            kind, why = pair_transport(transport, node_of, w, s)
            kinds.setdefault(kind, why)
    if "two_sided" in kinds:
        return "two_sided", kinds["two_sided"], node_of
    kind = "rma" if "rma" in kinds else "shared"
    return kind, kinds[kind], node_of


def allocate(job, world, graph, plan):
    """The run's PS windows: (Windows or None, the start-up line, the
    placement ``(WindowLayout, node_of)`` runtime/footprint.py counts, or
    None: two-sided). Collective on the global world. Offline (a world
    without MPI: ``plan``) nothing is allocated, but the placement is the
    one a run on those nodes makes (``windowed`` says whether the graphs
    are converted)."""
    kind, why, node_of = choose(job, world, plan)
    if kind == "two_sided":
        return None, _line(kind, why), None
    layout = ps_window_layout(graph, plan, job.parallel.mode)
    if getattr(world, "comm", None) is None:
        layout.place(node_of)
        return None, _line(kind, why), (layout, node_of)
    win, lines = allocate_or_fall_back(
        world, layout, node_of, lambda exc: _line("two_sided", f"auto: {exc}"),
        refuse=job.path if job.parallel.transport == "one_sided" else None)
    return win, lines or _line(kind, why), (layout, node_of) if win is not None else None


def shared_slots(placement, plan, rank):
    """Whether worker ``rank``'s gradient slots are shared memory (one node):
    the gradients are then computed into them (``in_place``)."""
    if placement is None or not plan["order"]:
        return False
    return placement[0].regions[slot(plan, plan["order"][0], rank)].where == "shared"


def _line(kind, why):
    words = {"shared": "one-sided, shared windows (gradients put into the servers' slots, "
                       "weights read with Get)",
             "rma": "one-sided, RMA windows (gradients put into the servers' slots, "
                    "weights read with Get)",
             "two_sided": "two-sided Send/Recv"}
    return [("gradients and weights", words[kind], why)]


def windowed_worker(graph, plan, rank, mode, staleness, shared=False):
    """Turn worker ``rank``'s push Sends into Puts and pull Recvs into Gets.
    ``shared`` (the windows are shared memory, one node): the gradients are
    computed straight into the slots and, in sync_ps, the weights are read
    in place (``in_place``)."""
    for p in plan["order"]:
        push, pull = graph.ops[f"{p}.push"], graph.ops[f"{p}.pull"]
        region = slot(plan, p, rank)
        push.op_type = "Put"
        push.attrs.pop("tag", None)
        push.attrs.update(region=region, written=region + ".written", free=region + ".free")
        pull.op_type = "Get"
        pull.attrs.pop("tag", None)
        pull.attrs.update(region=weights(p), version=weights(p) + ".version")
        if asynchronous(mode):
            pull.attrs.update(applied=applied(p, rank), staleness=int(staleness),
                              applied_all=[applied(p, w) for w in plan["workers"]])
    if shared:
        in_place(graph, plan, rank, mode)
    return graph


def _place(blob, **attrs):
    """Mark ``blob`` for window memory. A new attrs dict: a param's attrs
    may be the config's, shared with the other graphs built from it."""
    blob.attrs = {**blob.attrs, **attrs}


def in_place(graph, plan, rank, mode):
    """Zero copies on one node (shared windows). Each gradient whose one
    writer may compute into the server's memory (``one_sided._computes_into``),
    or that a worker's micro-batches sum into in place (``_summed_into``),
    lives in its slot: a WaitFree before the (first) writer waits until the
    server released the slot, and the Put only notifies. In sync_ps each weight p
    is the server's region ``ps/<p>`` itself: the Get only waits for the
    version, and the Put of p's gradient waits for every op here that reads
    p (control edges). The server overwrites p only once every worker's
    gradient of the next iteration is in, so it never writes weights a
    worker still reads. In async the server updates p at any time: a worker
    reading p in place for a whole pass would see half-written updates, so
    the Get copies p under the sequence lock (counted in bytes_copied)."""
    from .one_sided import _add_releases, _computes_into
    computed, summed = [], []
    for p in plan["order"]:
        g, region = plan["grads"][p], slot(plan, p, rank)
        first = g if _computes_into(graph, g, None) else _summed_into(graph, g)
        if first is not None:
            # with micro-batches (``_summed_into``) the sums' views view the slot too
            _place(graph.blobs[g], window=region, **({} if first == g else
                                                     {"window_views": True}))
            op = graph.ops[f"{p}.push"]
            computed.append((first, region, plan["owner"][p], op.location, op.thread))
            if first != g:
                summed.append(first)
        if not lockstep(mode):
            continue
        _place(graph.blobs[p], window=weights(p), window_views=True)
        push = graph.ops[f"{p}.push"]
        alias = {b.name for b in graph.blobs.values() if graph.storage_root(b.name) == p}
        readers = [op.name for op in graph.ops.values()
                   if op is not push and op.op_type != "Get" and alias & set(op.inputs)]
        push.control_inputs = list(push.control_inputs) + \
            [r for r in readers if r not in push.control_inputs]
    _add_releases(graph, [], computed)
    if summed:
        # copy 0's gradient ops now wait for the servers' release: the data
        # gradients beside them wait for them in turn, as one batch's do
        # (compose_param_server's gradients_first orders the last Sums'),
        # so that their inputs do not stay alive to the end of the backward
        # (cifar10_quick sync_ps M=2: 2.4 MiB more activations at the peak)
        from .data_parallel import gradients_first
        gradients_first(graph, {b: b for b in summed})


def _summed_into(graph, g):
    """Where a worker's micro-batches sum their gradients of ``g`` in place
    (micro_batch._sum_in_place: copy 0's gradient and the running sums are
    views of ``g``, the last ``Sum`` writes ``g``), the blob whose writer
    is the first to write ``g``'s storage in an iteration (copy 0's
    gradient: every running sum reads what the one before wrote), so that
    ``g`` lives in the server's slot as one batch's gradient does
    (``_computes_into``): the WaitFree before that writer, the sums adding
    into the slot, the Put only notifying. None where ``g`` is not summed
    so (one micro-batch, or views of another kind): it keeps memory of its
    own and the Put copies it, a whole gradient more on the worker."""
    from .micro_batch import micro_name, sum_name
    blob = graph.blobs[g]
    views = {b.name for b in graph.blobs.values() if b.alias_of == g}
    first = micro_name(g, 0)
    if not views or first not in views or blob.alias_of is not None or \
            blob.location.device >= 0:
        return None
    sums = {sum_name(g, k) for k in range(1, len(views))}
    if views - sums - {first}:
        return None
    writers = [op for op in graph.ops.values() if set(op.outputs) & (views | {g})]
    # one op a blob: copy 0's gradient op, each running sum, the last Sum
    if len(writers) != len(views) + 1 or any(op.accumulate for op in writers) or \
            sum(first in op.outputs for op in writers) != 1:
        return None
    return first


def windowed_server(graph, plan, rank):
    """Turn sync_ps server ``rank``'s Recvs into WaitWrites (the slots are
    the received blobs) and its Sends of p@new into one Publish per p."""
    from .one_sided import _add_releases
    owned = [p for p in plan["order"] if plan["owner"][p] == rank]
    released = []
    for p in owned:
        for w in plan["workers"]:
            op = graph.ops.pop(f"{plan['grads'][p]}@w{w}.recv")
            region = slot(plan, p, w)
            op.op_type, op.name = "WaitWrite", f"{plan['grads'][p]}@w{w}.wait"
            op.attrs.pop("tag", None)
            op.attrs.update(region=region, written=region + ".written", free=region + ".free")
            graph.ops[op.name] = op
            graph.blobs[op.outputs[0]].attrs["window"] = region
            released.append((op.outputs[0], region, w, op.location, op.thread))
        # p in its region: the update writes it in place, the Publish copies nothing
        _place(graph.blobs[p], window=weights(p), window_views=True)
        sends = [graph.ops.pop(f"{p}.send@r{w}") for w in plan["workers"]]
        first = sends[0]
        graph.add_op(f"{p}.publish", "Publish", list(first.inputs), [],
                     {"seq": first.attrs["seq"], "peer": rank, "region": weights(p),
                      "version": weights(p) + ".version"},
                     location=first.location, thread=first.thread)
    # each slot free again once the sum (or the update) has read it
    _add_releases(graph, released)
    return graph
