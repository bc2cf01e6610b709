"""Partitioning a global graph by location: each rank keeps its own ops and
blobs, and every edge that crosses ranks becomes a matched pair of
non-blocking ``Send`` / ``Recv`` ops (Purine: "a remote rank is just another
location").

    local = partition(global_graph, rank, hosts=world)      # this rank's slice
    slices = partition_all(global_graph, size=N)            # every rank's (tests, CLI)

Rules:

- An op runs on the rank of its location: ``{rank: R}``, or ``{ip, device}``
  through the host table (``World`` / ``HostTable``; see comm/world.py).
- A blob lives where its producer runs; a blob without producer (weights,
  inputs, buckets) lives at its own location.
- For every blob ``b`` living on rank h and read by ops on rank r != h, rank h
  gets ``Send b`` (``<b>.send@r<r>``) and rank r gets ``Recv b``
  (``<b>.recv``) writing r's own copy of ``b`` (same name, kind ``data``, no
  alias), which r's ops read unchanged. One transfer per (blob, rank).
- Sequence numbers and tags are computed from the global graph alone, so
  every rank derives the same ones: transfers are ordered by the global
  topological position of the blob's producer (sources first), then blob
  name, then destination rank; each pair gets the next ``seq`` and uses it
  as its MPI tag. Posting in that order cannot deadlock: a transfer's data
  never depends on a transfer that comes later.
- Comm ops already in the graph keep their ``seq``; new pairs number after
  them.

A partitioned slice must not be pruned again with data sinks only: a Send
has no outputs (pass its op name as a sink, or prune before partitioning).
"""
import copy

from ..base.errors import GraphError, UserError
from ..graph.core import Graph, Location

COMM_THREAD = "comm"


def _comm_op_types():
    from ..comm.ops import is_comm_op
    return is_comm_op


def resolve_ranks(graph, hosts=None, size=None):
    """{op name: rank} and {blob name: home rank} for a global graph.

    ``hosts`` (a World or HostTable) resolves ``{ip, device}`` locations;
    without it, a location's ``rank`` is used. ``size`` bounds the ranks."""
    table = getattr(hosts, "hosts", hosts)  # a World carries its HostTable
    if table is None and any(x.location.ip is not None for x in
                             list(graph.ops.values()) + list(graph.blobs.values())):
        # offline (``graph --np N``): plan one rank per device of each ip
        from ..comm.world import HostTable
        locs = [x.location for x in list(graph.ops.values()) + list(graph.blobs.values())]
        table = HostTable.planned(locs, size)
    if size is None and table is not None:
        size = getattr(hosts, "size", None) or len(table.infos)

    def rank_of(loc, what):
        if table is not None and loc.ip is not None:
            return table.rank_of(loc, what, size=size)
        # no host table: trust the rank the loader gave the location
        r = int(loc.rank)
        if size is not None and not 0 <= r < size:
            raise UserError(f"{what} is placed on rank {r}, but the job has {size} rank(s); "
                            "start more ranks (mpiexec -n) or change its location")
        return r

    op_rank = {n: rank_of(op.location, f"op '{n}'") for n, op in graph.ops.items()}
    prod = graph.producers()
    blob_rank = {}
    for name, blob in graph.blobs.items():
        writers = prod.get(name, ())
        ranks = sorted({op_rank[w.name] for w in writers})
        if len(ranks) > 1:
            raise GraphError(f"blob '{name}' is written on several ranks ({ranks}) by ops "
                             f"{', '.join(w.name for w in writers)}; give each rank its own "
                             "blob and sum them explicitly")
        blob_rank[name] = ranks[0] if ranks else rank_of(blob.location, f"blob '{name}'")
    for name, blob in graph.blobs.items():
        if blob.alias_of is not None:
            root = graph.storage_root(name)
            if blob_rank[name] != blob_rank[root]:
                raise GraphError(f"alias blob '{name}' lives on rank {blob_rank[name]} but its "
                                 f"storage '{root}' lives on rank {blob_rank[root]}; an alias "
                                 "must be written on the rank that holds its storage")
    return op_rank, blob_rank


def plan_transfers(graph, op_rank, blob_rank):
    """The cross-rank edges in their global order: a list of
    {"blob", "src", "dst", "seq", "tag"}; seq continues after existing comm ops."""
    is_comm = _comm_op_types()
    order = graph.topo_order()
    position = {op.name: i for i, op in enumerate(order)}
    prod = graph.producers()
    needed = set()
    for op in order:
        r = op_rank[op.name]
        for b in op.inputs:
            if blob_rank[b] != r:
                needed.add((b, r))
    existing = [int(op.attrs["seq"]) for op in graph.ops.values()
                if is_comm(op) and "seq" in op.attrs]
    seq = max(existing) + 1 if existing else 0

    def key(edge):
        b, r = edge
        when = max((position[o.name] for o in prod.get(b, ())), default=-1)
        return (when, b, r)

    transfers = []
    for b, r in sorted(needed, key=key):
        transfers.append({"blob": b, "src": blob_rank[b], "dst": r, "seq": seq, "tag": seq})
        seq += 1
    return transfers


def partition(graph, rank, hosts=None, size=None):
    """This rank's slice of the global ``graph`` (shapes inferred), with
    Send/Recv ops for every edge that crosses ranks. Deterministic: every
    rank computes matching halves."""
    graph = _with_shapes(graph)
    op_rank, blob_rank = resolve_ranks(graph, hosts, size)
    if size is not None and not 0 <= rank < size:
        raise UserError(f"rank {rank} is outside the job's {size} rank(s)")
    transfers = plan_transfers(graph, op_rank, blob_rank)
    return _slice(graph, rank, op_rank, blob_rank, transfers)


def partition_all(graph, hosts=None, size=None):
    """Every rank's slice (a list indexed by rank); ``size`` defaults to the
    highest rank used + 1."""
    graph = _with_shapes(graph)
    op_rank, blob_rank = resolve_ranks(graph, hosts, size)
    if size is None:
        size = max(list(op_rank.values()) + list(blob_rank.values()) + [0]) + 1
    transfers = plan_transfers(graph, op_rank, blob_rank)
    return [_slice(graph, r, op_rank, blob_rank, transfers) for r in range(size)]


def ranks_used(graph, hosts=None, size=None):
    """Sorted ranks that run at least one op of ``graph``."""
    op_rank, _ = resolve_ranks(graph, hosts, size)
    return sorted(set(op_rank.values()))


def _with_shapes(graph):
    if any(b.shape is None for b in graph.blobs.values()):
        graph = graph.copy()
        graph.infer_shapes()
    return graph


def _slice(graph, rank, op_rank, blob_rank, transfers):
    local = Graph(graph.name)
    local_ops = [op for op in graph.ops.values() if op_rank[op.name] == rank]
    local_names = {op.name for op in local_ops}
    used = set()
    for op in local_ops:
        for c in op.control_inputs:
            if c not in local_names:
                raise GraphError(f"op '{op.name}' (rank {rank}) has control input '{c}' on rank "
                                 f"{op_rank[c]}; ordering across ranks needs a data edge")
        used.update(op.inputs + op.outputs)
    sends = [t for t in transfers if t["src"] == rank]
    recvs = [t for t in transfers if t["dst"] == rank]
    used.update(t["blob"] for t in sends)
    received = {t["blob"] for t in recvs}
    # blobs living here (plus the alias roots they need) keep their definition
    frontier = [b for b in used if b not in received]
    keep = set()
    while frontier:
        b = frontier.pop()
        if b in keep:
            continue
        keep.add(b)
        if graph.blobs[b].alias_of is not None:
            frontier.append(graph.blobs[b].alias_of)
    for name, blob in graph.blobs.items():
        if name in keep:
            local.blobs[name] = blob.copy(location=_at(blob.location, rank))
        elif name in received:
            src = next(t["src"] for t in recvs if t["blob"] == name)
            attrs = dict(copy.deepcopy(blob.attrs))
            attrs["received_from"] = src
            local.blobs[name] = blob.copy(
                location=_consumer_location(graph, name, local_ops, rank),
                kind="data", alias_of=None, offset=0, attrs=attrs)
    # Emit in the global order (a Recv just before its first reader, a Send
    # just after its producer) so a serial, topological run posts them in a
    # natural order too.
    recv_of = {t["blob"]: t for t in recvs}
    sends_of = {}
    for t in sends:
        sends_of.setdefault(t["blob"], []).append(t)
    prod = graph.producers()
    for t in sends:
        if not prod.get(t["blob"]):
            _add_send(local, t)
    for op in local_ops:
        for b in op.inputs:
            t = recv_of.pop(b, None)
            if t is not None:
                _add_recv(local, graph, t)
        local.ops[op.name] = op.copy(location=_at(op.location, rank))
        for b in op.outputs:
            for t in sends_of.get(b, ()):
                _add_send(local, t)
    for t in recv_of.values():  # received but read by nobody here (cannot happen)
        _add_recv(local, graph, t)
    return local


def _add_recv(local, graph, t):
    b = graph.blobs[t["blob"]]
    local.add_op(f"{t['blob']}.recv", "Recv", [], [t["blob"]],
                 {"seq": t["seq"], "peer": t["src"], "tag": t["tag"],
                  "shape": list(b.shape), "dtype": b.dtype},
                 location=local.blobs[t["blob"]].location, thread=COMM_THREAD)


def _add_send(local, t):
    local.add_op(f"{t['blob']}.send@r{t['dst']}", "Send", [t["blob"]], [],
                 {"seq": t["seq"], "peer": t["dst"], "tag": t["tag"]},
                 location=local.blobs[t["blob"]].location, thread=COMM_THREAD)


def _at(loc, rank):
    return Location(rank, loc.device, loc.ip)


def _consumer_location(graph, blob, local_ops, rank):
    for op in local_ops:
        if blob in op.inputs:
            return _at(op.location, rank)
    return Location(rank)


def transfer_summary(graph, hosts=None, size=None):
    """Human-readable list of the cross-rank transfers (``graph`` CLI)."""
    graph = _with_shapes(graph)
    op_rank, blob_rank = resolve_ranks(graph, hosts, size)
    lines = []
    for t in plan_transfers(graph, op_rank, blob_rank):
        b = graph.blobs[t["blob"]]
        lines.append(f"  seq {t['seq']:>4}  {t['blob']:<32} rank {t['src']} -> rank {t['dst']}  "
                     f"{list(b.shape)} {b.dtype}")
    return "\n".join(lines)
