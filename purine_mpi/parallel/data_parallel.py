"""Synchronous data parallelism as a graph rewrite (Purine §4, bucketed as in
the RDMA paper): every rank runs the same single-replica training graph on
its own shard of the batch, and the gradients are summed across ranks by
Allreduce ops placed in the graph, so a top layer's gradient is reduced while
the lower layers still back-propagate.

``compose_data_parallel(graph, grads, world_size, rank)`` rewrites in place:

- gradient blobs become views (``alias_of`` + ``offset``) into flat bucket
  blobs (kind ``bucket``): the backward ops write straight into the buffer
  MPI reduces, so there is no packing copy;
- buckets are filled in the order the gradients become ready in backward
  (top layer first), sized to the model (``plan_buckets``): at least
  ``min_buckets`` of them, none over ``bucket_mb``, the first one small so
  communication starts early;
- a large fully connected weight is first split into row chunks
  (``split_large_params``; ``parallel.split_params``), each chunk a
  gradient, an allreduce and an update of its own, so the transfer of the
  first rows starts before the last rows' gradient is computed, and only
  the last chunk's update waits for the end of the transfer;
- one ``Allreduce`` op per bucket, ``seq`` numbers in bucket order (the same
  on every rank, since every rank builds the same graph), outputs
  ``<grad>.sum`` aliasing the same bucket ranges (in-place reduction);
- each ``SGDUpdate`` reads ``<grad>.sum`` with ``grad_scale`` divided by the
  world size (the sum becomes the mean gradient);
- ``DataReader`` ops get ``rank`` / ``world_size`` (the sharding of docs/config.md, "Sample order");
- with ``grad_first`` (default) each layer's parameter gradients are
  computed before the backward pass moves to the layer below
  (``gradients_first``), so the buckets fill, and their Allreduce starts,
  as early as possible (measured on benchmarks/overlap_netns.py: 502 ->
  321 ms per iteration at 1 Gbit/s).

With ``check_collectives=True`` the composed graph's sequence of
collectives is compared across ranks (``purine_mpi.comm.verify``).
"""
import dataclasses
import hashlib

import numpy as np

from ..comm.ops import IN_PASS, is_collective, is_comm_op
from ..base.errors import GraphError, UserError
from ..ops.batchnorm import REPLICA_SUM
from ..ops.updates import UPDATE_OP_TYPES

MB = 2 ** 20


def next_seq(graph):
    """The first free comm sequence number of ``graph``."""
    seqs = [int(op.attrs["seq"]) for op in graph.ops.values()
            if is_comm_op(op) and "seq" in op.attrs]
    return max(seqs) + 1 if seqs else 0


def sum_after(graph, op, name, group, seq, tag="partial"):
    """Rename ``op``'s first output to a partial blob (``<output>.<tag>``)
    and add the Allreduce ``name`` over ``group`` (None: every rank) that
    writes the original blob from it."""
    out = op.outputs[0]
    blob = graph.blobs[out]
    partial = graph.free_name(f"{out}.{tag}")
    graph.add_blob(partial, None, blob.dtype, blob.location, kind=blob.kind)
    op.outputs[0] = partial
    attrs = {"seq": seq} if group is None else {"seq": seq, "group": list(group)}
    return graph.add_op(name, "Allreduce", [partial], [out], attrs, location=op.location,
                        thread="comm")


def emit_after(graph, after):
    """Move each added op right after the op it follows in emission order
    ({op name: added op name}): the graph's order stays a topological one.
    A pipeline stage's slice keeps the whole net's emission order
    (parallel/partition.py), and its collectives are numbered in that order
    (schemes/pipeline._post_in_schedule_order); appended last, a stage's
    closing allreduce (a row-split fc whose sum the next stage receives)
    came after the backward's allreduces that wait for the next stage."""
    ops, moved = dict(graph.ops), set(after.values())
    graph.ops = {}
    for n, op in ops.items():
        if n in moved:
            continue
        graph.ops[n] = op
        if n in after:
            graph.ops[after[n]] = ops[after[n]]


def sum_over_replicas(graph, group=None):
    """Sum over the replicas (``group``, None: every rank) the output of each
    op with attr ``REPLICA_SUM`` (a synchronised batch norm's sums of its
    batch and of its gradient, ops/batchnorm.py): an Allreduce after each,
    ``seq`` in emission order (a topological one; in a pipeline stage's
    slice the whole net's, where a Recv, ready from the start, would pull
    the backward's sum ahead in the topological order) from the graph's
    first free one: before the buckets a scheme adds next, so the forward's
    sum never waits behind a gradient's; the same on every rank. Each has
    attr ``IN_PASS``: the passes go on after it, so the deferred tail
    (``parallel.defer_update``) does not start there. Returns the
    Allreduce ops."""
    seq, added, after = next_seq(graph), [], {}
    for op in [op for op in graph.ops.values() if op.attrs.get(REPLICA_SUM)]:
        added.append(sum_after(graph, op, graph.free_name(f"{op.name}.allreduce"), group, seq))
        added[-1].attrs[IN_PASS] = True  # no end of the iteration (runtime/tail.py)
        after[op.name] = added[-1].name
        seq += 1
    emit_after(graph, after)
    if added:
        graph.infer_shapes()
    return added


def gradient_ready_order(graph, grads):
    """Params ordered by when backward produces their gradient (top layer
    first): the position of each gradient's producer in topological order."""
    position = {op.name: i for i, op in enumerate(graph.topo_order())}
    producers = graph.producers()

    def when(param):
        ops = producers.get(grads[param], ())
        return max((position[o.name] for o in ops), default=-1)

    return sorted(grads, key=lambda p: (when(p), list(grads).index(p)))


def bucket_cap(graph, grads, bucket_mb=4, min_buckets=4):
    """The most bytes a bucket holds: ``bucket_mb`` or, when smaller, the
    gradient bytes divided by ``min_buckets``."""
    cap = bucket_mb * MB
    total = sum(graph.blobs[g].nbytes for g in grads.values())
    if min_buckets > 1 and total:
        cap = min(cap, total / min_buckets)
    return cap


#: a weight gradient is split only above this size (smaller ones gain less
#: than the extra ops and messages cost)
SPLIT_MIN_BYTES = MB


def split_large_params(graph, grads, cap, min_bytes=SPLIT_MIN_BYTES, accept=None):
    """Split each large fully connected weight into row chunks of about
    ``cap`` bytes, so its gradient can be reduced, and its update run, chunk
    by chunk: the first chunk's allreduce starts when its rows of the
    gradient exist, not when the whole gradient does, and only the last
    chunk's update waits for the end of the transfer.

    A parameter ``p`` with gradient ``g`` is split when ``g`` is over
    ``min_bytes`` and over twice ``cap``, ``g`` is written by one
    ``InnerProductGradWeight`` op and read only by ``p``'s update op, and
    ``p`` and its solver state own their storage. Then, for rows a..b-1:

    - ``g[a:b]``: a blob of its own, written by the gradient op with attr
      ``rows: [a, b]`` (the bucket plan later makes it a view of a bucket);
    - ``p[a:b]``, ``p[a:b]@new`` and the same for each state blob: views
      (``alias_of`` + ``offset``) of ``p`` and the states, so checkpoints and
      every other reader still see whole blobs;
    - ``<update>[a:b]``: the update op on those views, same attrs.

    The chunk ops take the place of the ops they replace in emission order.
    ``accept(gradient op, row bounds)``: the row bounds to split that
    weight at, or falsy to leave it whole.
    Returns the new ``{param: grad}`` map (a chunk's key is ``p[a:b]``)."""
    producers, consumers = graph.producers(), graph.consumers()
    out = {}
    for p, g in grads.items():
        chunks = _split_rows(graph, p, g, cap, min_bytes, producers, consumers, accept)
        out.update(chunks if chunks else {p: g})
    return out


def _split_rows(graph, p, g, cap, floor, producers, consumers, accept=None):
    gb, pb = graph.blobs[g], graph.blobs.get(p)
    if gb.shape is None or gb.nbytes <= max(2 * cap, floor) or pb is None or \
            pb.shape is None or pb.alias_of is not None or gb.alias_of is not None or \
            len(pb.shape) != 2:
        return None
    makers, readers = producers.get(g, []), consumers.get(g, [])
    if len(makers) != 1 or len(readers) != 1:
        return None
    gop, up = makers[0], readers[0]
    if gop.op_type != "InnerProductGradWeight" or gop.accumulate or "rows" in gop.attrs or \
            gop.outputs != [g] or up.op_type not in UPDATE_OP_TYPES or up.accumulate or \
            up.inputs[:2] != [p, g]:
        return None
    states = up.inputs[2:1 + len(up.outputs)]
    extra = up.inputs[1 + len(up.outputs):]
    for src, new in zip([p] + states, up.outputs):
        nb = graph.blobs[new]
        if graph.blobs[src].alias_of is not None or nb.alias_of != src or nb.offset or \
                consumers.get(new):
            return None
    rows, cols = pb.shape
    k = min(rows, -(-gb.nbytes // int(cap)))
    bounds = [rows * i // k for i in range(k + 1)]
    if accept is not None:
        bounds = accept(gop, bounds)
        if not bounds:
            return None
        bounds = [int(r) for r in bounds]

    def view(src, name, alias_of, a, b):
        sb = graph.blobs[src]
        graph.add_blob(name, (b - a, cols), sb.dtype, sb.location, kind=sb.kind,
                       alias_of=alias_of, offset=a * cols)
        return name

    chunks, grad_ops, update_ops = {}, [], []
    for a, b in zip(bounds, bounds[1:]):
        tag = f"[{a}:{b}]"
        graph.add_blob(g + tag, (b - a, cols), gb.dtype, gb.location, kind=gb.kind)
        grad_ops.append(graph.add_op(
            gop.name + tag, gop.op_type, gop.inputs, [g + tag], dict(gop.attrs, rows=[a, b]),
            location=gop.location, thread=gop.thread, control_inputs=gop.control_inputs))
        ins = [view(p, p + tag, p, a, b), g + tag] + \
            [view(s, s + tag, s, a, b) for s in states] + list(extra)
        outs = [view(new, src + tag + "@new", src, a, b)
                for src, new in zip([p] + states, up.outputs)]
        update_ops.append(graph.add_op(
            up.name + tag, up.op_type, ins, outs, dict(up.attrs), location=up.location,
            thread=up.thread, control_inputs=up.control_inputs))
        chunks[p + tag] = g + tag
    _replace_ops(graph, {gop.name: grad_ops, up.name: update_ops})
    for name in [g] + list(up.outputs):
        del graph.blobs[name]
    return chunks


def _replace_ops(graph, replacements):
    """Put each op's replacements where it stood in emission order (the
    dispatcher's tie-break), and point control edges at them."""
    new_names = {op.name for ops in replacements.values() for op in ops}
    items = [(n, op) for n, op in graph.ops.items() if n not in new_names]
    graph.ops.clear()
    for name, op in items:
        for new in replacements.get(name, [op]):
            graph.ops[new.name] = new
    for op in graph.ops.values():
        if any(c in replacements for c in op.control_inputs):
            op.control_inputs = [n for c in op.control_inputs
                                 for n in ([o.name for o in replacements[c]]
                                           if c in replacements else [c])]


def plan_buckets(graph, grads, bucket_mb=4, first_bucket_mb=1, min_buckets=4):
    """Group gradients into buckets: a list of {"dtype", "location", "params",
    "bytes"} in ready order (top layer first).

    Buckets follow the model: the cap is ``bucket_mb`` or, when smaller, the
    gradient bytes divided by ``min_buckets``, so a small model still gets at
    least ``min_buckets`` buckets (when it has that many parameter blobs) and
    communication can start before backward ends. The first bucket's cap is
    half that (at most ``first_bucket_mb``), so the first transfer starts as
    early as possible. A bucket closes when the next gradient would pass its
    cap (unless that gradient is tiny, under 1/64 of the cap); a gradient larger than the cap gets a bucket of its own; then the
    bucket with the most bytes that holds several gradients is split in two
    (at the byte midpoint) until there are ``min_buckets``. Gradients of
    another dtype or location go to buckets of their own kind."""
    order = gradient_ready_order(graph, grads)
    cap = bucket_cap(graph, grads, bucket_mb, min_buckets)
    first_cap = min(first_bucket_mb * MB, cap / 2 if min_buckets > 1 else cap)
    buckets, open_by_kind = [], {}
    for p in order:
        g = graph.blobs[grads[p]]
        kind = (g.dtype, g.location)
        b = open_by_kind.get(kind)
        # a tiny gradient (a bias) rides along rather than costing a message
        if b is not None and b["bytes"] + g.nbytes > b["cap"] and g.nbytes * 64 > b["cap"]:
            b = None
        if b is None:
            b = {"dtype": g.dtype, "location": g.location, "params": [], "bytes": 0,
                 "cap": first_cap if not buckets else cap}
            buckets.append(b)
            open_by_kind[kind] = b
        b["params"].append(p)
        b["bytes"] += g.nbytes
    while len(buckets) < min_buckets:
        splittable = [b for b in buckets if len(b["params"]) > 1]
        if not splittable:
            break
        b = max(splittable, key=lambda x: x["bytes"])
        sizes = [graph.blobs[grads[p]].nbytes for p in b["params"]]
        cut = min(range(1, len(sizes)), key=lambda i: abs(2 * sum(sizes[:i]) - b["bytes"]))
        tail = dict(b, params=b["params"][cut:], bytes=sum(sizes[cut:]))
        b["params"], b["bytes"] = b["params"][:cut], sum(sizes[:cut])
        buckets.insert(buckets.index(b) + 1, tail)
    return buckets


def format_plan(plan):
    """The bucket plan as text lines (``graph --np N`` prints it): posting
    order, size, and the gradients in each bucket."""
    group = plan[0].get("group") if plan else None
    over = f" over ranks {group} (the ranks holding the same part)" if group else ""
    lines = [f"bucket plan: {len(plan)} allreduce(s){over}, posted in seq order, "
             "top layer first"]
    for b in plan:
        size = f"{b['bytes'] / 2 ** 10:.1f} KB" if b["bytes"] < MB else f"{b['bytes'] / MB:.2f} MB"
        lines.append(f"  seq {b['seq']:<3} {b['name']:<16} {size:>10}  {', '.join(b['params'])}")
    return lines


def prepare_replica(graph, grads, world_size, rank):
    """Make ``graph`` (one replica's training graph) replica ``rank`` of
    ``world_size``: its data readers read that replica's share of the
    batch, and every op and blob is placed on ``rank``. Returns the
    ``{param: grad}`` entries whose gradient is in the graph. A graph that
    places ops on several locations is a UserError."""
    ranks = sorted({op.location.rank for op in graph.ops.values()})
    ips = sorted({op.location.ip for op in graph.ops.values()} - {None})
    spread = ranks if len(ranks) > 1 else ips
    if len(spread) > 1:
        raise UserError(f"data-parallel composition needs one replica's graph, but this graph "
                        f"places ops on several locations ({', '.join(map(str, spread))}); "
                        "for a graph with locations use parallel.scheme: pipeline")
    for op in graph.ops.values():
        if op.op_type == "DataReader":
            # micro-batch k of M (micro_batch.py) is replica rank·M + k of world_size·M
            m, k = int(op.attrs.get("micro_batches", 1)), int(op.attrs.get("micro_batch", 0))
            op.attrs["rank"], op.attrs["world_size"] = int(rank) * m + k, int(world_size) * m
    place_on_rank(graph, rank)
    return {p: g for p, g in grads.items() if g in graph.blobs}


def make_bucket(graph, name, bucket, grads, producers):
    """Make the flat gradient blob ``name`` (kind ``bucket``) of ``bucket``
    (a ``plan_buckets`` entry) and turn its gradients into views of it, in
    the bucket's order, so the backward ops write straight into the buffer
    a collective sends. Returns ``[(param, view blob, element offset)]``."""
    total = sum(graph.blobs[grads[p]].size for p in bucket["params"])
    graph.add_blob(name, (total,), bucket["dtype"], bucket["location"], kind="bucket")
    offset, out = 0, []
    for p in bucket["params"]:
        g = graph.blobs[grads[p]]
        view = grads[p]
        if g.alias_of is not None:
            # already a view of other storage (an in-place op wrote it):
            # copy it into the bucket, the one packing copy we cannot avoid
            view = graph.free_name(f"{grads[p]}.bucketed")
            graph.add_blob(view, g.shape, g.dtype, g.location, kind="grad")
            owner = producers.get(grads[p], [None])[0]
            graph.add_op(f"{view}.copy", "Copy", [grads[p]], [view], location=g.location,
                         thread=owner.thread if owner is not None else 0)
        blob = graph.blobs[view]
        blob.alias_of, blob.offset = name, offset
        out.append((p, view, offset))
        offset += g.size
    return out


def compose_data_parallel(graph, grads, world_size, rank, bucket_mb=4, first_bucket_mb=1,
                          check_collectives=False, world=None, thread="comm", grad_first=True,
                          min_buckets=4, split_params=True, split_min_bytes=SPLIT_MIN_BYTES,
                          wire_dtype=None):
    """Rewrite ``graph`` (one replica's training graph, shapes inferred) for
    synchronous data parallelism over ``world_size`` ranks. ``grads`` maps
    param -> gradient blob (``build_backward``'s result). ``wire_dtype``:
    ``bfloat16`` reduces the buckets in it (``parallel.grad_dtype: bf16``;
    the Allreduce's attr, comm/ops.py). Returns the bucket plan: a list of
    {"name", "op", "seq", "params", "grads", "bytes"}."""
    grads = prepare_replica(graph, grads, world_size, rank)
    if split_params:
        grads = split_large_params(graph, grads, bucket_cap(graph, grads, bucket_mb, min_buckets),
                                   split_min_bytes)
    producers = graph.producers()
    # the update ops, found once (the buckets add none): a sweep of every
    # op per bucket was buckets x ops, and the ops grow with micro-batches
    updates = [op for op in graph.ops.values() if op.op_type in UPDATE_OP_TYPES]
    seq = next_seq(graph)
    plan = []
    for i, b in enumerate(plan_buckets(graph, grads, bucket_mb, first_bucket_mb,
                                                min_buckets)):
        name = graph.free_name(f"grad_bucket{i}")
        total = sum(graph.blobs[grads[p]].size for p in b["params"])
        ins, outs = [], []
        for p, view, offset in make_bucket(graph, name, b, grads, producers):
            g = graph.blobs[grads[p]]
            total_name = graph.free_name(f"{grads[p]}.sum")
            graph.add_blob(total_name, g.shape, g.dtype, g.location, kind="grad",
                           alias_of=name, offset=offset)
            ins.append(view)
            outs.append(total_name)
        op = graph.add_op(f"{name}.allreduce", "Allreduce", ins, outs,
                          {"seq": seq, "bucket": name, **wire_attrs(wire_dtype, world_size)},
                          location=b["location"], thread=thread)
        _rewire_updates(updates, dict(zip(ins, outs)), {grads[p]: v for p, v in
                                                       zip(b["params"], ins)}, world_size)
        plan.append({"name": name, "op": op.name, "seq": seq, "params": list(b["params"]),
                     "grads": ins, "bytes": int(total * np.dtype(b["dtype"]).itemsize)})
        seq += 1
    if grad_first:
        gradients_first(graph, grads)
    if check_collectives:
        from ..comm.verify import check_collectives as _check
        _check(graph, world)
    return plan


def wire_attrs(wire_dtype, ranks):
    """The attrs that make a bucket's collective over ``ranks`` ranks reduce
    in ``wire_dtype`` (none for float32, the buckets' own dtype; none over
    one rank, which sums nothing: its gradients are not rounded for nothing,
    and the start-up notes say grad_dtype has no effect there)."""
    return {} if wire_dtype is None or ranks == 1 else {"wire_dtype": wire_dtype}


def adopt_ready_order(dispatcher, world):
    """After an iteration, post the buckets' allreduces in the order their
    gradients were observed to become ready (as DDP rebuilds its buckets
    after the first iteration): rank 0's observation decides and is
    broadcast, so every rank keeps one ``seq`` order. Only for graphs whose
    comm ops are all collectives, the same ones (by name, in ``seq`` order)
    on every rank (one allreduce says whether they are: rank 0's order
    applied to other lists would post another rank's collectives out of
    their order); returns the new order, or None when there is nothing to
    reorder (each rank then keeps its ``seq`` order). Call on every rank at
    the same point, between iterations."""
    order = getattr(dispatcher, "comm_order", None)
    if world.size == 1 or order is None:
        return None
    current = order()
    ours = -1  # this rank's order's digest; -1: none to reorder (decided by every rank)
    if len(current) >= 2 and all(is_collective(dispatcher.graph.ops[n]) for n in current):
        ours = int.from_bytes(hashlib.sha256("\n".join(current).encode()).digest()[:7],
                              "little")
    top = world.allreduce(np.array([ours, -ours], dtype=np.int64), op="max",
                          what="the agreement on the bucket posting order")
    if ours < 0 or top[0] != -top[1]:
        return None
    observed = dispatcher.comm_ready_order()
    index = np.array([current.index(n) for n in observed], dtype=np.int64)
    world.wait(world.comm.Ibcast(index, root=0), "the broadcast of the bucket posting order")
    new = [current[int(i)] for i in index]
    dispatcher.set_comm_order(new)
    return new


def place_on_rank(graph, rank):
    """Give every op and blob of a replica the location rank ``rank`` (the
    device stays): the replica is what that rank runs."""
    for x in list(graph.ops.values()) + list(graph.blobs.values()):
        if x.location.rank != rank:
            x.location = dataclasses.replace(x.location, rank=int(rank))


def gradients_first(graph, grads):
    """Scheduling hint (opt-in): make the backward pass produce each layer's
    parameter gradients before it continues to the layer below, so their
    Allreduce can start early. For each op G writing a parameter gradient,
    the ops that read the *data* gradient computed beside G (from the same
    output gradient) get G as a control input. On one worker thread this
    only reorders work; a dispatcher that already runs ready ops in
    topological order does not need it. Returns the number of edges added."""
    producers, consumers = graph.producers(), graph.consumers()
    param_grad_ops = {op.name for g in grads.values() for op in producers.get(g, ())}
    added = []
    for g in grads.values():
        for op in producers.get(g, ()):
            for dy in op.inputs:
                if graph.blobs[dy].kind != "grad":
                    continue
                for sibling in consumers.get(dy, ()):
                    if sibling.name in param_grad_ops:
                        continue
                    for out in sibling.outputs:
                        for reader in consumers.get(out, ()):
                            if op.name not in reader.control_inputs and reader is not op:
                                reader.control_inputs.append(op.name)
                                added.append((reader, op.name))
    try:
        graph.topo_order()
    except GraphError:  # an unusual graph where the hint would form a cycle: drop it
        for reader, name in added:
            reader.control_inputs.remove(name)
        return 0
    return len(added)


def _rewire_updates(updates, summed, renamed, world_size):
    """Update ops (``updates``, the graph's, in its order) read the reduced
    gradient, scaled by 1/world_size."""
    for op in updates:
        g = renamed.get(op.inputs[1], op.inputs[1])
        if g in summed:
            op.inputs[1] = summed[g]
            op.attrs["grad_scale"] = float(op.attrs.get("grad_scale", 1.0)) / world_size


def broadcast_params(arrays, world=None, root=0):
    """Copy every array of ``arrays`` ({name: array}) from ``root`` to all
    ranks, in sorted name order (blocking; call on every rank at the same
    point). Guarantees identical starting weights whatever each rank's
    initialiser did."""
    from ..comm.device import HostStage
    from ..comm.world import get_world
    world = world or get_world()
    if world.size == 1:
        return
    for name in sorted(arrays):
        st = HostStage(arrays[name])
        buf = st.buffer(copy_in=True)
        world.comm.Bcast(buf.reshape(-1) if buf.flags.c_contiguous else buf, root=root)
        st.copy_back()
