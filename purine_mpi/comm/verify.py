"""Debug check (``parallel.check_collectives: true``): before the first
iteration, every rank compares the communication its graph will post.

MPI matches collectives by call order only: if rank 1's third Allreduce is
another bucket than rank 0's, the job silently reduces mismatched buffers or
hangs. So each rank lists its comm ops in ``seq`` order as (kind, element
count, dtype; a ReduceScatter counts its input, an Allgather its output:
the whole bucket), the lists are gathered, and the first position where they
differ is reported, naming both ops. A collective with a ``group`` (a
hybrid run's stage: a sub-communicator of some ranks) is compared among the
ranks of that group only, in ``seq`` order within the group, and every
rank of the group must post it. Point-to-point ops are checked in pairs:
every Send must meet a Recv on its peer with the same tag, element count
and dtype; every Put (comm/rma_ops.py) a WaitWrite of the same window
region (its ``tag`` here).
"""
import numpy as np

from ..base.errors import GraphError, UserError
from .ops import data_blobs, is_collective, is_comm_op

_SENDERS = ("Send", "Put")          # point-to-point: the writing side
_RECEIVERS = ("Recv", "WaitWrite")  # and the side that receives
# no partner op: comm/rma_ops.py's Release and WaitFree, comm/rma_pull.py's reads
_UNPAIRED = ("Release", "WaitFree", "Get", "Publish", "GetShards")


def comm_signature(graph):
    """This rank's comm ops in seq order: a list of dicts with seq, op, kind,
    count, dtype (and peer, tag for point-to-point). Raises GraphError when a
    comm op lacks ``seq`` or two share one."""
    entries, seen = [], {}
    for op in graph.ops.values():
        if not is_comm_op(op):
            continue
        if "seq" not in op.attrs:
            raise GraphError(f"communication op '{op.name}' ({op.op_type}) has no seq attribute")
        seq = int(op.attrs["seq"])
        if seq in seen:
            raise GraphError(f"communication ops '{seen[seq]}' and '{op.name}' share seq {seq}")
        seen[seq] = op.name
        blobs = data_blobs(op)
        count = sum(int(np.prod(graph.blobs[b].shape)) for b in blobs)
        # a bucket reduced in bfloat16 crosses the ranks as such (attr wire_dtype)
        dtypes = [op.attrs["wire_dtype"]] if "wire_dtype" in op.attrs else \
            sorted({graph.blobs[b].dtype for b in blobs})
        e = {"seq": seq, "op": op.name, "kind": op.op_type, "count": count,
             "dtype": ",".join(dtypes)}
        if not is_collective(op):
            tag = op.attrs["region"] if "region" in op.attrs else int(op.attrs["tag"])
            e["peer"], e["tag"] = int(op.attrs["peer"]), tag
        elif op.attrs.get("group") is not None:
            e["group"] = sorted(int(r) for r in op.attrs["group"])
        entries.append(e)
    return sorted(entries, key=lambda e: e["seq"])


def _fmt(e):
    return f"{e['kind']} of {e['count']} {e['dtype']} (op '{e['op']}', seq {e['seq']})"


def _fmt_or_none(e, posted):
    return _fmt(e) if e else f"nothing (it has only {len(posted)})"


def compare_signatures(signatures):
    """Problems (strings) across ranks' signatures; empty when consistent."""
    problems = []
    size = len(signatures)
    everyone = tuple(range(size))
    # collectives per communicator: the world's, or a group's (its ranks)
    groups = {}
    for r, sig in enumerate(signatures):
        for e in sig:
            if e["kind"] in _SENDERS + _RECEIVERS + _UNPAIRED:
                continue
            g = tuple(e.get("group") or everyone)
            if r not in g:
                problems.append(f"rank {r} posts {_fmt(e)} on the group of ranks {list(g)}, "
                                f"which it is not part of")
                continue
            groups.setdefault(g, {}).setdefault(r, []).append(e)
    for g in sorted(groups):
        colls = [groups[g].get(r, []) for r in g]
        where = "" if g == everyone else f" among ranks {list(g)}"
        n = max(len(c) for c in colls)
        for i in range(n):
            row = [c[i] if i < len(c) else None for c in colls]
            keys = {(e["kind"], e["count"], e["dtype"]) if e else None for e in row}
            if len(keys) == 1:
                continue
            ref, r0 = row[0], g[0]
            for j, e in enumerate(row[1:], 1):
                if (e and (e["kind"], e["count"], e["dtype"])) != \
                        (ref and (ref["kind"], ref["count"], ref["dtype"])):
                    problems.append(f"collective #{i}{where} differs: rank {r0} posts "
                                    f"{_fmt_or_none(ref, colls[0])}, rank {g[j]} posts "
                                    f"{_fmt_or_none(e, colls[j])}")
                    break
            break  # the first difference is what matters; later ones follow from it
    sends, recvs = {}, {}
    for r, sig in enumerate(signatures):
        for e in sig:
            if e["kind"] in _SENDERS:
                sends[(r, e["peer"], e["tag"])] = e
            elif e["kind"] in _RECEIVERS:
                recvs[(e["peer"], r, e["tag"])] = e
    for key in sorted(set(sends) | set(recvs), key=str):
        s, v = sends.get(key), recvs.get(key)
        src, dst, tag = key
        if s is None:
            problems.append(f"rank {dst} expects {_fmt(v)} from rank {src} tag {tag}, "
                            f"but rank {src} sends nothing with that tag")
        elif v is None:
            problems.append(f"rank {src} sends {_fmt(s)} to rank {dst} tag {tag}, "
                            f"but rank {dst} posts no matching receive")
        elif (s["count"], s["dtype"]) != (v["count"], v["dtype"]):
            problems.append(f"rank {src} sends {_fmt(s)} to rank {dst} tag {tag}, but rank "
                            f"{dst} receives {_fmt(v)}")
    return problems


def check_collectives(graph, world=None):
    """Gather every rank's comm signature and raise UserError (on every rank)
    describing the first mismatch. Collective call: every rank must call it."""
    from .world import get_world
    world = world or get_world()
    local = comm_signature(graph)
    signatures = world.comm.allgather(local)
    problems = compare_signatures(signatures)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise UserError("parallel.check_collectives: the ranks' communication does not match: "
                        + problems[0] + more + ". Every rank must build its graph from the "
                        "same config; compare 'python -m purine_mpi graph CONFIG --np N "
                        "--rank R' between ranks.")
    return signatures
