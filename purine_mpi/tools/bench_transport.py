"""``bench``'s transport figures and its parameter-server modes.

    transport_figures(dispatcher, graphs, iters, before) -> the JSON fields
        transport, transport_lines, bytes_one_sided_per_iter,
        bytes_two_sided_per_iter, bytes_copied_per_iter (rank 0's ops)
    counters(dispatcher) -> the one-sided ops' byte counters now
    ps_server(job, world, warmup)      # a server rank of a bench run
    ps_figures(world, servers)         # rank 0: the servers' figures

A sync_ps server's figures (the largest over the servers; null for the
async loop, which runs no graph): ``server_comm_ms_per_iter`` its comm ops'
post-to-completion spans summed, ``server_comm_in_flight_ms_per_iter`` the
wall time with one in flight (both include the wait for the workers'
gradients), ``server_send_ms_per_iter`` the spans of the ops that give the
workers the weights (W Sends of each param, or its one Publish: the
workers Get), ``server_recv_ms_per_iter`` those of the ops that take the
gradients (Recv or WaitWrite), ``server_bytes_copied_per_iter`` what its
one-sided ops copied with the CPU (its rma trace events).

Bytes per iteration, over the timed iterations: ``one_sided``: what this
rank's Put, Get and GetShards ops moved through MPI (``MPI_Rput``/``MPI_Get``
into or out of an RMA window; GetShards: ZeRO stage 3's gathers across
hosts, an ``MPI_Rget`` of every other owner's shard); ``two_sided``: what its Send, Recv, Allreduce,
ReduceScatter and Allgather ops carry (each op's blobs, once per iteration:
``comm.ops.data_blobs``, a bucket whole for the collectives); ``copied``: what its
one-sided ops copied with the CPU (a store into or a load out of a shared
window, a region copied into a blob that does not live in it; a bucket
summed through a shared window: its copy in and its copy out; a GetShards:
the rank's own shard into the gathered buffer). 0 copied
for a blob that lives in the window its peer writes (the pipeline's
WaitWrite): no copy at all.
"""
import numpy as np

from ..comm.ops import moved_bytes
from .flops import rank_place

_ONE_SIDED = ("Put", "WaitWrite", "Get", "Publish", "WindowAllreduce", "GetShards")
_TWO_SIDED = ("Send", "Recv", "Allreduce", "ReduceScatter", "Allgather")
#: a sync_ps server's ops that give the workers the weights, and that take
#: their gradients (two-sided and one-sided)
_SERVER_SENDS = ("Send", "Publish")
_SERVER_RECVS = ("Recv", "WaitWrite")
_SERVER_KEYS = ("comm_ms_per_iter", "comm_in_flight_ms_per_iter", "send_ms_per_iter",
                "recv_ms_per_iter", "bytes_copied_per_iter")
#: the tag bench's servers send their figures to rank 0 with (above the PS tags)
BENCH_TAG = (1 << 20) + 3


def _one_sided(op):
    """A window op (an Allreduce summed through a shared window is one)."""
    return op.op_type in _ONE_SIDED


def counters(dispatcher):
    """{op: (bytes moved one-sided, bytes copied)} of the one-sided kernels."""
    out = {}
    for name, k in getattr(dispatcher, "kernels", {}).items():
        if _one_sided(k.op):
            moved = getattr(k, "bytes_put", 0) + getattr(k, "bytes_got", 0)
            out[name] = (moved, getattr(k, "bytes_copied", 0))
    return out


def transport_figures(dispatcher, graphs, iters, before):
    """The transport fields of ``bench --json`` (see the module docstring) of
    the trainer's ``graphs`` (RankGraphs); ``before``: ``counters`` at the
    start of the timed iterations."""
    graph = graphs.graph
    after = counters(dispatcher)
    moved = sum(a[0] - before.get(n, (0, 0))[0] for n, a in after.items())
    copied = sum(a[1] - before.get(n, (0, 0))[1] for n, a in after.items())
    two = 0
    kinds = set()
    for op in graph.ops.values():
        if _one_sided(op):
            kinds.add("one_sided")
        elif op.op_type in _TWO_SIDED:
            two += moved_bytes(graph, op)
            kinds.add("two_sided")
    transport = ("none" if not kinds else "mixed" if len(kinds) == 2 else kinds.pop())
    lines = [f"{what}: {how} ({why})" for what, how, why in
             graphs.composition.transport or ()]
    return {"transport": transport, "transport_lines": lines,
            "bytes_one_sided_per_iter": int(round(moved / max(iters, 1))),
            "bytes_two_sided_per_iter": two,
            "bytes_copied_per_iter": int(round(copied / max(iters, 1)))}


def ps_server(job, world, warmup, dispatcher=None):
    """A server rank's part of a bench run: serve the workers' warm-up and
    timed iterations (``dispatcher``: the workers'), then send rank 0 its
    figures (after its state: the order run_server's transfers and
    ``ps_figures`` agree on)."""
    from ..runtime.trace import merge_intervals
    from ..train.ps_server import run_server
    res = run_server(job, world, profile_from=warmup, dispatcher=dispatcher)
    stats = res["stats"]
    events = stats.pop("events", None)
    timed = max(stats.get("iterations", 0) - warmup, 1)
    # what it occupies: the job's peak FLOP/s counts its cores (tools/flops.py occupied)
    figures = {"transport": stats.get("transport"), "place": rank_place(-1)}
    if events is not None:
        in_flight = sum(b - a for a, b in merge_intervals(
            [(e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] == "comm"]))

        def spans(kinds):
            total = sum(e["dur"] for e in events if e["cat"] == "comm"
                        and (kinds is None or e["args"].get("op_type") in kinds))
            return round(total / 1000.0 / timed, 3)

        figures.update(comm_ms_per_iter=spans(None), send_ms_per_iter=spans(_SERVER_SENDS),
                       recv_ms_per_iter=spans(_SERVER_RECVS),
                       comm_in_flight_ms_per_iter=round(in_flight / 1000.0 / timed, 3),
                       bytes_copied_per_iter=int(round(sum(
                           e["args"].get("bytes_copied", 0) for e in events
                           if e["cat"] == "rma") / timed)))
    world.send_object(figures, 0, BENCH_TAG, "the server's bench figures")


def ps_figures(world, servers, places):
    """Rank 0: take the servers' final state (the end of run_server) and
    their figures: the fields ``server_*`` of ``bench --json``; each
    server's ``(host, device, cores)`` is appended to ``places``."""
    from ..train.ps_server import recv_state
    recv_state(world, servers)
    got = [world.recv_object(s, BENCH_TAG, "a server's bench figures") for s in servers]
    places.extend(g["place"] for g in got)
    out = {"server_transport": got[0]["transport"] if got else None}
    for key in _SERVER_KEYS:
        values = [g[key] for g in got if g.get(key) is not None]
        out[f"server_{key}"] = float(np.max(values)) if values else None
    return out


def no_servers():
    """The ``server_*`` fields of a run without parameter servers: null."""
    return {"server_transport": None, **{f"server_{k}": None for k in _SERVER_KEYS}}
