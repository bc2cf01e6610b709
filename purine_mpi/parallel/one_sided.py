"""``parallel.transport``: a staged slice's Send/Recv pairs become one-sided
Put/WaitWrite pairs (comm/rma_ops.py) into window memory (comm/windows.py)
where the pair of ranks gets a window.

    windows, transport, placed = to_windows(local, job, world)   # in compose_stages, per graph

For every Recv of blob b from rank p on this rank r (and every Send of b to
rank r on rank p -- both sides compute the same names from their own
slice), ``pair_transport(transport, node table, p, r)`` decides:

- ``two_sided``: the pair stays as it is;
- ``shared`` / ``rma``: rank r owns the region ``g<n>/<b>@r<r>`` (b's
  shape and dtype; ``n`` counts the windowed graphs of this world: train
  0, test 1) with its notify word ``.written``; rank p owns ``.free``
  (each word has one writer: the other rank). The Recv becomes
  ``<b>.wait`` (WaitWrite), the Send ``<b>.put@r<r>`` (Put), keeping
  ``seq`` and control edges; a ``<b>.release`` (Release) after every op
  that touches b on rank r tells p the region may be written again; the
  received blob gets ``attrs['window']`` = its region, so the workspace
  places it in the window (runtime/workspace.py) and the memory planner
  leaves it alone. On one node, where the consumer only reads the blob and
  one op of p writes it, p's blob gets the same ``attrs['window']``: that
  op computes straight into the consumer's region (the Put then only
  notifies), after ``<b>.free@r<r>`` (WaitFree) saw the region released.

The layout is gathered from every rank (one allgather: a rank knows only
its own transfers) and allocated at once (``Windows.allocate``): the same
collectives in the same order on every rank. Without MPI (``graph --np N``)
the ops are converted as on a single node (``PURINE_RANKS_PER_HOST``
splits it) and nothing is allocated. When the library allocates no window,
or the stages run on GPUs (windows of device memory, CUDA IPC, would fit
``comm/window_layout.MemoryDevice`` but are not built), ``auto`` keeps
Send/Recv (the start-up block says why) and ``one_sided`` is a user error.

The transport lines (the Composition's ``transport``) are the start-up
block's: each kind of transfer,
its transport and why.
"""
import numpy as np

from ..base.errors import ConfigError
from ..comm.windows import (WindowLayout, allocate_or_fall_back, fake_host_of, node_groups,
                            pair_transport, rma_across_hosts)
from .placement import asks_for_gpu


def refuse_on_gpu(job, what):
    """``parallel.transport: one_sided`` where ``what`` runs on GPUs: a
    user error naming both keys (windows of GPU memory are not built)."""
    where = f"device: {job.device}" if job.device >= 0 else "backend: cupy"
    raise ConfigError(job.path, "parallel.transport", f"one_sided needs {what} on the "
                      f"CPU, but key '{where.split(':')[0]}' puts them on a GPU ({where}; windows "
                      "of GPU memory are not built yet); use auto or two_sided")


def _live(world):
    return getattr(world, "comm", None) is not None


def _region_spec(prefix, blob, owner, peer, read_only):
    """One Recv region of the window layout exchange: (name, owner, the
    peer that writes it, shape, dtype, read_only); the region of ``blob``
    (the same name on both sides of a Send/Recv pair) on rank ``owner``."""
    return (prefix + f"{blob.name}@r{owner}", owner, peer, list(blob.shape), str(blob.dtype),
            read_only)


def to_windows(local, job, world):
    """Convert ``local``'s Send/Recv pairs as ``parallel.transport`` says
    (see the module docstring), in place; returns (the Windows or None,
    the transport lines or None, the window placement ``(layout, node_of)``
    that runtime/footprint.py counts, or None)."""
    transport = job.parallel.transport
    pairs = [op for op in local.ops.values() if op.op_type in ("Send", "Recv")]
    if world.size == 1:
        return None, None, None
    if transport == "two_sided":
        return None, [("activations and gradients", "two-sided Send/Recv",
                       "parallel.transport: two_sided")], None
    if asks_for_gpu(job):  # device memory windows (CUDA IPC) are not built
        if transport == "one_sided":
            refuse_on_gpu(job, "the stages")
        return None, [("activations and gradients", "two-sided Send/Recv",
                       "auto: the stages run on GPUs, and windows of GPU memory (CUDA "
                       "IPC) are not built; Send/Recv stage through host memory")], None
    node_of = node_groups(world) if _live(world) else \
        {r: fake_host_of(r) or 0 for r in range(world.size)}
    count = getattr(world, "windowed_graphs", 0)  # per world: the same on every rank
    world.windowed_graphs = count + 1
    prefix = f"g{count}/"
    specs, chosen, why_seen = [], {}, {}
    across = _agreed_across_hosts(world, node_of) if transport == "auto" else None
    for op in pairs:
        peer = int(op.attrs["peer"])
        kind, why = pair_transport(transport, node_of, peer, world.rank, across=across)
        chosen[op.name] = kind
        why_seen[f"{kind}: {why}"] = (kind, why)
        if kind == "two_sided" or op.op_type != "Recv":
            continue
        b = local.blobs[op.outputs[0]]
        # the producer may compute into this region when nothing here writes it
        read_only = not any(b.name in o.outputs for o in local.ops.values() if o is not op)
        specs.append(_region_spec(prefix, b, world.rank, peer, read_only))
    if _live(world):
        everyone = world.allgather_object((specs, why_seen), "the window layout exchange")
    else:  # offline (plan, graph --np): the peers' regions this rank sends into, as the
        # exchange would bring them: their ".free" words are this rank's to hold
        sent = [_region_spec(prefix, local.blobs[op.inputs[0]], int(op.attrs["peer"]),
                             world.rank, True)
                for op in pairs if op.op_type == "Send" and chosen[op.name] != "two_sided"]
        everyone = [(specs, why_seen), (sent, {})]
    layout = WindowLayout()
    for rank_specs, _ in everyone:
        for name, owner, peer, shape, dtype, read_only in rank_specs:
            layout.add(name, owner, shape, dtype, peers=[peer]).read_only = read_only
            layout.add_word(name + ".written", owner, writer=peer)
            layout.add_word(name + ".free", peer, writer=owner)
    placed = (layout, node_of)  # what each rank's windows hold (runtime/footprint.py)
    windows = None
    if _live(world) and layout.regions:
        windows, lines = allocate_or_fall_back(
            world, layout, node_of,
            lambda exc: [("activations and gradients", "two-sided Send/Recv", f"auto: {exc}")],
            refuse=job.path if transport == "one_sided" else None)
        if windows is None:
            return None, lines, None
    _convert(local, prefix, chosen, world.rank, layout)
    # the start-up block names every rank's pairs: each kind once
    return windows, _summary([rank_why for _, rank_why in everyone]), placed


def _agreed_across_hosts(world, node_of):
    """``rma_across_hosts`` as every rank sees it (one allreduce, made only
    when the ranks span several nodes: the same on every rank): RMA between
    hosts only where every host does RDMA."""
    ok, why = rma_across_hosts()
    if len(set(node_of.values())) < 2 or not _live(world):
        return ok, why
    nobody = int(world.allreduce(np.array([0 if ok else 1], np.int64), "max",
                                 what="the RDMA agreement")[0])
    if nobody and ok:
        return False, "another host has no RDMA network: the library would emulate RMA over TCP"
    return ok, why


def _convert(local, prefix, chosen, rank, layout):
    renamed, released, in_place = {}, [], []
    sends = {}
    for op in local.ops.values():
        if op.op_type == "Send":
            sends[op.inputs[0]] = sends.get(op.inputs[0], 0) + 1
    for op in list(local.ops.values()):
        if chosen.get(op.name, "two_sided") == "two_sided":
            continue
        peer = int(op.attrs["peer"])
        if op.op_type == "Recv":
            blob = op.outputs[0]
            region = prefix + f"{blob}@r{rank}"
            op.op_type, new = "WaitWrite", f"{blob}.wait"
            local.blobs[blob].attrs["window"] = region
            released.append((blob, region, peer, op.location, op.thread))
        else:
            blob = op.inputs[0]
            region = prefix + f"{blob}@r{peer}"
            op.op_type, new = "Put", f"{blob}.put@r{peer}"
            if chosen[op.name] == "shared" and sends[blob] == 1 and \
                    _computes_into(local, blob, layout.regions.get(region)):
                local.blobs[blob].attrs["window"] = region
                in_place.append((blob, region, peer, op.location, op.thread))
        op.attrs.pop("tag", None)
        op.attrs.update(region=region, written=region + ".written", free=region + ".free",
                        released_by="release")
        renamed[op.name] = new
        op.name = new
    if renamed:
        local.ops = {op.name: op for op in local.ops.values()}
        for op in local.ops.values():
            op.control_inputs = [renamed.get(c, c) for c in op.control_inputs]
    _add_releases(local, released, in_place)


def _computes_into(local, blob, region):
    """Whether the producer may compute ``blob`` straight into the
    consumer's ``region``: the consumer only reads it, one op here writes
    it (and no other op, so the consumer sees that op's result), it views
    no other blob and none views it, it lives on the CPU."""
    b = local.blobs[blob]
    writers = [op for op in local.ops.values() if blob in op.outputs]
    viewed = any(x.alias_of == blob for x in local.blobs.values())
    return (getattr(region, "read_only", True) and len(writers) == 1 and b.alias_of is None
            and not viewed and b.location.device < 0 and not writers[0].accumulate)


def _add_releases(local, released, in_place=()):
    """After every op that touches a received blob: its region's Release
    (the producer may write it again); before the op that computes a sent
    blob into the consumer's region: a WaitFree (the consumer released
    it). ``seq`` numbers follow the slice's other comm ops, in blob order:
    the same on every rank of a stage."""
    from .data_parallel import next_seq
    seq = next_seq(local)
    for blob, region, peer, location, thread in sorted(in_place, key=lambda r: r[0]):
        name = f"{blob}.free@r{peer}"
        local.add_op(name, "WaitFree", [], [], {"seq": seq, "peer": peer, "region": region,
                                                 "free": region + ".free",
                                                 "released_by": "release"},
                     location=location, thread=thread)
        writer = next(op for op in local.ops.values() if blob in op.outputs)
        writer.control_inputs = list(writer.control_inputs) + [name]
        seq += 1
    for blob, region, peer, location, thread in sorted(released, key=lambda r: r[0]):
        users = [op.name for op in local.ops.values()
                 if op.op_type != "WaitWrite" and (blob in op.inputs or blob in op.outputs)]
        op = local.add_op(f"{blob}.release", "Release", [blob], [],
                          {"seq": seq, "peer": peer, "region": region, "free": region + ".free"},
                          location=location, thread=thread)
        op.control_inputs = users
        seq += 1


def _summary(per_rank):
    """The start-up block's rows from every rank's {key: (kind, why)}: one
    row per kind of transport chosen, with the lowest rank's reason. The
    ranks agree on the kind of every pair, not always on why: a variable
    of one rank's environment (``PURINE_RMA_ACROSS_HOSTS``, the network's)
    changes its reason, not the choice (``_agreed_across_hosts``)."""
    words = {"shared": "one-sided, shared windows", "rma": "one-sided, RMA windows",
             "two_sided": "two-sided Send/Recv"}
    reasons = {}  # kind -> {why: the first rank that gave it}
    for rank, why_seen in enumerate(per_rank):
        for kind, why in why_seen.values():
            reasons.setdefault(kind, {}).setdefault(why, rank)
    rows = []
    for kind in sorted(reasons):
        why, rank = next(iter(reasons[kind].items()))
        if len(reasons[kind]) > 1:
            why += f"; as rank {rank} sees it, other ranks give other reasons"
        rows.append(("activations and gradients", words[kind], why))
    return rows
