"""Building blocks of sharded data parallelism (ZeRO stage 1; issue 43,
docs/parallel.md "Sharding building blocks"): the flat weights of a
gradient bucket, the solver over one shard of it, and the stage-1 rewrite
that joins them with the ``ReduceScatter`` and ``Allgather`` ops
(comm/ops.py).

Layout. A bucket (``data_parallel.plan_buckets``) is a flat gradient buffer
whose per-parameter views the backward ops write (``make_bucket``). Here
the bucket's weights get the same layout: one flat buffer (kind
``param_buffer``, so checkpoints and ``Graph.params`` still see each weight
by its name) of which every weight is a view at its gradient's offset. So
element i of the gradient bucket is the gradient of element i of the weight
buffer, and a shard -- ``comm.ops.shard_range``: rank r holds elements
``[r*c, min(n, (r+1)*c))``, ``c = ceil(n/N)`` -- is one range of both.

``flatten_bucket_params(graph, name, params, offsets)``
    the flat weight buffer ``name`` of a bucket; the weights become views.
``add_shard_solver(graph, ...)``
    the update ops of the bucket's weights, cut to the shard: for each
    weight that overlaps the shard, its update op (SGD, AdamW, any
    ``solver.type``) on the views of its overlap, with its own ``lr_mult``
    and ``decay_mult``; the solver state (momentum, Adam's moments) is one
    flat blob per state sized to the shard, and the full-size state blobs
    go.
``compose_zero1(graph, grads, shards, shard, ...)``
    stage 1 of one replica's training graph: per bucket a ReduceScatter of
    the gradient bucket (``seq`` in bucket order, posted as soon as its
    gradients exist; in place: the shard's gradient is the bucket's own
    range), the shard solver, then an Allgather of the updated
    shard into the weight buffer (``seq`` after every ReduceScatter, so a
    bucket's reduce-scatter never waits behind an earlier bucket's update).

The update divides the summed gradient by N through ``grad_scale``, as data
parallelism's update does: with the same sum, the numbers are those of
plain data parallelism bit for bit (see the docs for when the sums agree).
"""
from collections import defaultdict

from ..base.errors import GraphError
from ..comm.ops import shard_range
from ..graph.core import WORKING_SET_ATTR, reachable  # noqa: F401  (runtime/footprint counts it apart)
from ..graph.core import ancestor_bits
from ..ops.updates import UPDATE_OP_TYPES
from .data_parallel import (_replace_ops, gradients_first, make_bucket, next_seq, wire_attrs,
                            plan_buckets, prepare_replica)
from .fuse import PARAM_BUFFER_KIND
from .tensor_split import SHARD0_BIAS_ATTR

#: the kind of a view of a shard of a bucket's weights (not a checkpointed param)
PARAM_SHARD_KIND = "param_shard"


def flatten_bucket_params(graph, name, params, offsets):
    """Make blob ``name`` (kind ``param_buffer``) hold ``params`` (blob
    names, one dtype and location, each owning its storage) at element
    ``offsets``, and make each param a view of it (``alias_of`` +
    ``offset``; aliases of a param, such as ``p@new``, follow). Returns
    ``name``."""
    blobs = [graph.blobs[p] for p in params]
    for b in blobs:
        if b.alias_of is not None:
            raise GraphError(f"weight '{b.name}' is a view of '{b.alias_of}'; a bucket's "
                             "flat weight buffer needs weights that own their storage")
        if b.shape is None:
            raise GraphError(f"weight '{b.name}' has no shape; run shape inference first")
    kinds = {(b.dtype, b.location) for b in blobs}
    if len(kinds) != 1:
        raise GraphError(f"the weights of one flat buffer must share dtype and location, "
                         f"got {sorted(map(str, kinds))}")
    spans = sorted(zip(offsets, (b.size for b in blobs)))
    if any(a + n > b for (a, n), (b, _) in zip(spans, spans[1:])):
        raise GraphError(f"the weights of '{name}' overlap at the offsets given")
    total = max((o + n for o, n in spans), default=0)
    graph.add_blob(name, (total,), blobs[0].dtype, blobs[0].location, kind=PARAM_BUFFER_KIND)
    for b, off in zip(blobs, offsets):
        b.alias_of, b.offset = name, int(off)
    return name


def _update_op_of(graph, param):
    ops = [op for op in graph.ops.values()
           if op.op_type in UPDATE_OP_TYPES and op.inputs and op.inputs[0] == param]
    if len(ops) != 1:
        raise GraphError(f"weight '{param}' has {len(ops)} update ops; a shard solver "
                         "needs exactly one")
    return ops[0]


def add_shard_solver(graph, weights, params, offsets, shard_grad, shards, shard,
                     grad_divisor=None, shard_weights=None):
    """Replace the update ops of ``params`` (views of the flat weight buffer
    ``weights`` at ``offsets``) by update ops on shard ``shard`` of
    ``shards`` of that buffer (``shard_range``). ``shard_grad`` is the
    shard's gradient (shape (count,)); each update reads a view of it,
    which the ReduceScatter must write (its outputs: ``grads`` below, so
    each update depends on it); the updates
    multiply their ``grad_scale`` by ``1 / grad_divisor`` (default
    ``shards``: the ReduceScatter sums, the update makes it the mean, as
    data parallelism's update does; 1 for a ReduceScatter with ``average``).

    Each weight overlapping the shard gets its update op (same type and
    attrs) on views of the overlap: ``<p>.shard[a:b]`` of the weight buffer,
    of ``shard_grad`` and of one flat state blob per solver state,
    ``<weights>.shard.<state>`` (kind ``state``, the shard's size: the only
    optimizer state this rank holds). With ``shard_weights`` (ZeRO stage 3:
    the rank's persistent flat shard of ``weights``, shape (count,)) the
    weight views are of it, so the update writes the shard in place. The
    full-size state blobs and the replaced ops go. Returns a dict: ``ops`` (the new op names), ``states``
    (the flat state blobs), ``grads`` (the views of ``shard_grad`` the
    updates read, in buffer order: the ReduceScatter's outputs) and
    ``written`` (the weight views the updates write, ``...@new``, in buffer
    order: the Allgather's inputs)."""
    total = graph.blobs[weights].size
    lo, hi = shard_range(total, shards, shard)
    divisor = float(shards if grad_divisor is None else grad_divisor)
    ups = [_update_op_of(graph, p) for p in params]
    kinds = {(op.op_type, len(op.outputs)) for op in ups}
    if len(kinds) != 1:
        raise GraphError(f"the weights of '{weights}' are updated by different solvers "
                         f"({', '.join(sorted(k for k, _ in kinds))})")
    n_states = len(ups[0].outputs) - 1
    wb = graph.blobs[weights]
    suffixes = [_state_suffix(ups[0], params[0], i) for i in range(n_states)]
    state_names = [graph.free_name(f"{weights}.shard.{x}") for x in suffixes]
    for s in state_names:
        graph.add_blob(s, (hi - lo,), wb.dtype, wb.location, kind="state")
    replaced, written, grad_parts = {}, [], []
    for p, off, up in sorted(zip(params, offsets, ups), key=lambda t: t[1]):
        size = graph.blobs[p].size
        a, b = max(lo, off), min(hi, off + size)
        extra = up.inputs[2 + n_states:]
        replaced[up.name] = []
        if a >= b:
            continue
        tag = f"[{a - off}:{b - off}]"

        def view(base, of, at, kind):
            name = graph.free_name(f"{base}.shard{tag}")
            graph.add_blob(name, (b - a,), wb.dtype, wb.location, kind=kind, alias_of=of,
                           offset=at)
            return name

        w = view(p, weights, a, PARAM_SHARD_KIND) if shard_weights is None else \
            view(p, shard_weights, a - lo, PARAM_SHARD_KIND)
        g = view(f"{p}.grad", shard_grad, a - lo, "grad")
        states = [view(f"{p}.{x}", s, a - lo, "state") for x, s in zip(suffixes, state_names)]
        outs = []
        for src in [w] + states:
            graph.add_blob(f"{src}@new", (b - a,), wb.dtype, wb.location,
                           kind=graph.blobs[src].kind, alias_of=src)
            outs.append(f"{src}@new")
        attrs = dict(up.attrs, grad_scale=float(up.attrs.get("grad_scale", 1.0)) / divisor)
        op = graph.add_op(f"{up.name}{tag}", up.op_type, [w, g] + states + list(extra), outs,
                          attrs, location=up.location, thread=up.thread,
                          control_inputs=up.control_inputs)
        replaced[up.name].append(op)
        written.append(outs[0])
        grad_parts.append(g)
    _replace_ops(graph, replaced)  # where the old updates stood; control edges follow
    _drop_blobs(graph, [blob for up in ups
                        for blob in list(up.outputs) + list(up.inputs[2:2 + n_states])])
    return {"ops": [op.name for ops in replaced.values() for op in ops], "states": state_names,
            "grads": grad_parts, "written": written}


def _state_suffix(up, param, i):
    """The state's name as solver_graph.state_name spells it (``<p>.<state>``)."""
    name = up.inputs[2 + i]
    return name[len(param) + 1:] if name.startswith(param + ".") else f"state{i}"


def _drop_blobs(graph, names):
    """Delete each blob of ``names``, in turn, when no op uses it and no
    blob views it (a view dropped before it no longer does). The ops' uses
    and the views counted once, not per blob (a scan of the graph per name:
    8% of ``plan --choose`` on gpt_small)."""
    used = {b for op in graph.ops.values() for b in op.inputs + op.outputs}
    views = defaultdict(int)
    for b in graph.blobs.values():
        if b.alias_of is not None:
            views[b.alias_of] += 1
    for name in names:
        if name in graph.blobs and name not in used and not views[name]:
            of = graph.blobs.pop(name).alias_of
            if of is not None:
                views[of] -= 1




def compose_zero1(graph, grads, shards, shard, bucket_mb=4, first_bucket_mb=1, min_buckets=4,
                  thread="comm", grad_first=True, stage=1, prefetch=1, wire_dtype=None,
                  forward=None, reuse_forward=False, allreduce=False):
    """Rewrite ``graph`` (one replica's training graph with its solver,
    shapes inferred) for ZeRO stage 1 over ``shards`` ranks, as rank
    ``shard``: the buckets of data parallelism (``plan_buckets``; weights
    are not split in rows: the reduce-scatter cuts every bucket anyway),
    each with its flat weight buffer, a ReduceScatter of its gradients, the
    solver over this rank's shard and an Allgather of the updated weights.
    Stage 1: the gradient shard ``<bucket>.shard`` is a view of the
    bucket's range ``shard_range`` (the ReduceScatter writes it in place,
    comm/ops.py), so the rank holds 4Ψ of gradients, not 4Ψ + 4Ψ/N.
    ``stage`` 2 (ZeRO stage 2) makes each gradient bucket transient (kind
    ``grad``, not ``bucket``): written by the backward ops (or the
    micro-batches' sums), read by its ReduceScatter alone, so the memory
    plan gives its bytes to other blobs after the reduce-scatter, and the
    rank holds only its shard of the gradients. ``stage`` 3 (``compose_zero3``)
    also keeps the weights as this rank's shard alone; ``forward``: the
    names of the forward ops (``forward_ops`` of the whole graph: a
    pipeline stage's slice may hold no loss), by default this graph's;
    ``reuse_forward``: a bucket's backward reads its forward buffer where
    the schedule interleaves them (``_gather_units``); ``allreduce``
    (``parallel.reduce_scatter: false``): each ReduceScatter gets attr
    ``allreduce``, summing its bucket whole by data parallelism's in-place
    allreduce and keeping this rank's range (comm/ops.py: the sums, and so
    the weights, are data parallelism's bit for bit; an allreduce's
    bytes; the memory as with the reduce-scatter: the full bucket lives
    until the op completes). Returns the plan:
    a list of {"name", "weights", "params", "offsets", "shard",
    "reduce_scatter", "allgather", "seq", "states", "bytes"}
    (stage 3: "weight_shard", "gathers" instead of "allgather"; after the
    buckets the frozen weights' units, ``frozen_units``: no
    "reduce_scatter", "states" empty, "frozen" True)."""
    grads = prepare_replica(graph, grads, shards, shard)
    producers = graph.producers()
    seq = next_seq(graph)
    plan = []
    for i, b in enumerate(plan_buckets(graph, grads, bucket_mb, first_bucket_mb, min_buckets)):
        name = graph.free_name(f"grad_bucket{i}")
        views = make_bucket(graph, name, b, grads, producers)
        params, offsets = [p for p, _, _ in views], [o for _, _, o in views]
        weights = flatten_bucket_params(graph, graph.free_name(f"weight_bucket{i}"), params,
                                        offsets)
        if stage >= 2:  # transient: its lifetime ends at the reduce-scatter
            graph.blobs[name].kind = "grad"
            graph.blobs[name].attrs[WORKING_SET_ATTR] = "gradients"
        total = graph.blobs[name].size
        lo, hi = shard_range(total, shards, shard)
        # the gradient shard: stage 1 keeps the whole bucket, so the shard is
        # its range [lo, hi) (the ReduceScatter runs in place: no bytes of
        # its own); stage 2 frees the bucket after the reduce-scatter, so
        # the shard outlives it in a blob of its own
        shard_grad = graph.free_name(f"{name}.shard")
        graph.add_blob(shard_grad, (hi - lo,), b["dtype"], b["location"], kind="grad",
                       alias_of=name if stage < 2 else None, offset=lo if stage < 2 else 0)
        own = None
        if stage >= 3:  # the rank's persistent shard of the weights, updated in place
            own = graph.free_name(f"{weights}.shard")
            graph.add_blob(own, (hi - lo,), b["dtype"], b["location"], kind=PARAM_BUFFER_KIND)
            graph.blobs[weights].attrs[WORKING_SET_ATTR] = "weights"
        cut = add_shard_solver(graph, weights, params, offsets, shard_grad, shards, shard,
                               shard_weights=own)
        rs = graph.add_op(f"{name}.reduce_scatter", "ReduceScatter", [v for _, v, _ in views],
                          cut["grads"],
                          {"seq": seq, "bucket": name, "shards": shards, "shard": shard,
                           "shapes": [list(graph.blobs[x].shape) for x in cut["grads"]],
                           **({"allreduce": True} if allreduce else {}),
                           **wire_attrs(wire_dtype, shards)},
                          location=b["location"], thread=thread)
        plan.append({"name": name, "weights": weights, "params": params, "offsets": offsets,
                     "shard": [lo, hi], "reduce_scatter": rs.name, "states": cut["states"],
                     "written": cut["written"], "seq": seq,
                     "bytes": int(graph.blobs[name].nbytes)})
        if own is not None:
            plan[-1]["weight_shard"] = own
        seq += 1
    if stage >= 2:
        bound_live_buckets(graph, plan, prefetch)
    if stage >= 3:
        for entry in plan:
            entry.pop("written")
        plan += frozen_units(graph, grads, shards, shard, bucket_mb, first_bucket_mb,
                             min_buckets)
        _gather_units(graph, plan, shards, shard, prefetch, thread, forward, reuse_forward)
        if grad_first:
            gradients_first(graph, grads)
        sequence_collectives(graph, plan)
        return plan
    for entry in plan:  # the gathers after every reduce-scatter (module docstring)
        weights = entry["weights"]
        wb = graph.blobs[weights]
        graph.add_blob(f"{weights}@new", wb.shape, wb.dtype, wb.location,
                       kind=PARAM_BUFFER_KIND, alias_of=weights)
        ag = graph.add_op(f"{weights}.allgather", "Allgather", entry.pop("written"),
                          [f"{weights}@new"],
                          {"seq": seq, "bucket": weights, "shards": shards, "shard": shard,
                           "shapes": [list(wb.shape)], "dtype": wb.dtype},
                          location=wb.location, thread=thread)
        entry["allgather"], entry["gather_seq"] = ag.name, seq
        seq += 1
    if grad_first:
        gradients_first(graph, grads)
    return plan


def bound_live_buckets(graph, plan, depth=1):
    """Stages 2 and 3: at most ``depth + 1`` full gradient buckets live at
    once in the backward. Each writer of bucket ``k + 1 + depth`` (the ops
    writing its storage: the backward's, or the micro-batches' sums) waits
    by a control edge for the reduce-scatter of bucket ``k`` (the plan's
    order: the gradients' ready order), so the memory plan can give bucket
    k's bytes to bucket k + 1 + depth. A writer the reduce-scatter already
    depends on (an earlier micro-batch's backward: every bucket accumulates
    across the micro-batches) gets no edge: no cycle. Nor does a writer
    that would wait, through the reduce-scatter, for a point-to-point
    transfer (a pipeline stage's Recv) it does not wait for already: what
    that transfer waits for on the other rank may be behind the writer
    (scheme sharded with stages; the bound is then looser). Returns the
    edges added, [(reduce-scatter, writer)]."""
    from ..comm.ops import is_point_to_point
    depth = max(int(depth), 0)
    writers = {}
    for op in graph.ops.values():
        for out in op.outputs:
            writers.setdefault(graph.storage_root(out), []).append(op)
    added = []
    for j in range(1 + depth, len(plan)):
        rs = plan[j - 1 - depth]["reduce_scatter"]
        deps = graph.dependencies()
        before = reachable(rs, deps)  # the ops it waits for
        waits = {d for d in before if is_point_to_point(graph.ops[d])}
        for op in writers.get(plan[j]["name"], ()):
            if op.name not in before and rs not in op.control_inputs and \
                    not (waits and waits - reachable(op.name, deps)):
                op.control_inputs.append(rs)
                added.append((rs, op.name))
    graph.topo_order()  # no cycle
    return added


def frozen_weights(graph, grads):
    """The frozen parameters (``lr_mult`` 0, ops/updates.frozen) stage 3
    shards beside the buckets: learnable, owning their storage, with no
    gradient in ``grads`` and no op writing them, read by some op (a
    tensor shard's row-split fc reading its bias on shard 0 alone counts,
    ``shard0_bias_readers``), in the order of their first reader. A
    running statistic (not learnable, written by its layer) is no weight
    here: it stays whole."""
    from ..ops.updates import frozen
    producers, cons = graph.producers(), graph.consumers()
    dropped = shard0_bias_readers(graph)
    pos = {op.name: i for i, op in enumerate(graph.topo_order())}
    first = {}
    for b in graph.params():
        if b.alias_of is not None or b.name in grads or producers.get(b.name) or \
                not b.attrs.get("learnable", True) or not frozen(b.attrs):
            continue
        readers = [op.name for op in list(cons.get(b.name, ())) + dropped.get(b.name, [])]
        if readers:
            first[b.name] = min(pos[r] for r in readers)
    return sorted(first, key=first.get)


def frozen_units(graph, grads, shards, shard, bucket_mb=4, first_bucket_mb=1, min_buckets=4):
    """Stage 3's gather units of the frozen weights (``frozen_weights``):
    cut as ``plan_buckets`` cuts gradients (the same caps, over the frozen
    bytes, in first-reader order), each a flat weight buffer
    ``frozen_bucket<i>`` (the weights its views, ``flatten_bucket_params``)
    made transient (``WORKING_SET_ATTR``) and this rank's persistent shard
    ``<weights>.shard`` of it: ``_gather_units`` gathers them as it
    gathers a bucket's. No gradient bucket, reduce-scatter, update or
    solver state: plan entries without ``reduce_scatter``, ``states`` [],
    ``frozen`` True. The same units on every rank of the group (they
    differ in the shard solver alone, which reads no frozen weight)."""
    frozen = frozen_weights(graph, grads)
    out = []
    for i, b in enumerate(plan_buckets(graph, {p: p for p in frozen}, bucket_mb,
                                       first_bucket_mb, min_buckets)):
        params = list(b["params"])
        offsets = [0]
        for p in params[:-1]:
            offsets.append(offsets[-1] + graph.blobs[p].size)
        weights = flatten_bucket_params(graph, graph.free_name(f"frozen_bucket{i}"), params,
                                        offsets)
        wb = graph.blobs[weights]
        wb.attrs[WORKING_SET_ATTR] = "weights"
        lo, hi = shard_range(wb.size, shards, shard)
        own = graph.free_name(f"{weights}.shard")
        graph.add_blob(own, (hi - lo,), wb.dtype, wb.location, kind=PARAM_BUFFER_KIND)
        out.append({"name": weights, "weights": weights, "params": params, "offsets": offsets,
                    "shard": [lo, hi], "states": [], "weight_shard": own, "frozen": True,
                    "bytes": int(wb.nbytes)})
    return out


def gradient_buckets(plan):
    """The plan's entries that reduce-scatter a gradient bucket (not stage
    3's units of frozen weights, ``frozen_units``)."""
    return [entry for entry in plan if "reduce_scatter" in entry]


#: the kind of the views of a bucket's weights gathered for the backward
#: (stage 3): not ``param`` (``Graph.params``, checkpoints see each weight
#: once, by its name: the forward's view), not persistent
PARAM_GATHERED_KIND = "param_gathered"


def compose_zero3(graph, grads, shards, shard, prefetch=1, **settings):
    """ZeRO stage 3 of one replica's training graph: ``compose_zero1`` with
    ``stage=3`` (see ``_gather_units``). Returns the plan."""
    return compose_zero1(graph, grads, shards, shard, stage=3, prefetch=prefetch, **settings)


def forward_ops(graph):
    """The ops from which a loss is reachable (the forward; as
    parallel/micro_batch.add_schedule tells them apart)."""
    from ..job.replica import loss_blobs
    prod, forward = graph.producers(), set()
    stack = list(loss_blobs(graph))
    while stack:
        for op in prod.get(stack.pop(), ()):
            if op.name not in forward:
                forward.add(op.name)
                stack.extend(op.inputs)
    return forward


def _gather_units(graph, plan, shards, shard, prefetch, thread, forward=None, reuse=False):
    """Stage 3's gathers. Each bucket is a unit (FSDP's): its flat weight
    buffer (the weights are views of it) becomes transient, written by an
    Allgather of the rank's shard before its first forward reader; the
    backward readers of its weights read views ``<p>.bwd`` of a second
    transient buffer ``<weights>.bwd`` that another Allgather fills. Both
    buffers carry ``WORKING_SET_ATTR`` (the memory plan gives their bytes
    away after their last reader). Prefetch: the forward gather of the
    unit ``prefetch`` places after unit k in forward order waits for unit
    k's first forward reader; in the backward the same over the order of
    the units' first backward readers (the first ``prefetch`` gathers wait
    for the first forward reader of the forward's last unit), so at most
    ``prefetch + 1`` units' full weights are live in each pass. With
    micro-batches every copy's readers read the same two buffers: each
    is gathered once per iteration and lives from its first reader (the
    first micro-batch's) to its last (the last micro-batch's). ``forward``:
    the forward ops' names (default ``forward_ops(graph)``). ``reuse``
    (scheme sharded with stages): a unit whose forward buffer is still
    read after a backward reader may run (``_interleaved``: 1F1B's
    forward of a later micro-batch after an earlier one's backward) gets
    no backward gather: its backward readers read the forward's views,
    and the forward buffer lives to their last (the weights do not change
    before the updates, which come after every backward); the entry says
    ``backward_reads_forward``. Under GPipe, or with one micro-batch,
    every forward reader goes before every backward reader: two gathers,
    the forward buffer freed before the backward's."""
    forward = forward_ops(graph) if forward is None else set(forward)
    cons = graph.consumers()
    if reuse:  # the readers' order, as the schedule's control edges fix it
        deps = graph.dependencies()
        pos, anc = ancestor_bits([op.name for op in graph.topo_order(deps)], deps)
    dropped = shard0_bias_readers(graph)
    units = []
    for entry in plan:
        weights, own = entry["weights"], entry["weight_shard"]
        wb = graph.blobs[weights]
        fwd, bwd = [], []
        for p in entry["params"]:
            for op in cons.get(p, ()):
                (fwd if op.name in forward else bwd).append((op, p))
            fwd += [(op, p) for op in dropped.get(p, ()) if op.name in forward]
        attrs = {"bucket": weights, "shards": shards, "shard": shard,
                 "shapes": [list(wb.shape)], "dtype": wb.dtype}
        gathers = {}
        if reuse and fwd and bwd and _interleaved([op.name for op, _ in fwd],
                                                  [op.name for op, _ in bwd], pos, anc):
            entry["backward_reads_forward"] = True
        if fwd:
            gathers["forward"] = graph.add_op(f"{weights}.allgather", "Allgather", [own],
                                              [weights], dict(attrs), location=wb.location,
                                              thread=thread).name
        if bwd and not entry.get("backward_reads_forward"):
            back = graph.free_name(f"{weights}.bwd")
            graph.add_blob(back, wb.shape, wb.dtype, wb.location, kind=PARAM_GATHERED_KIND)
            graph.blobs[back].attrs[WORKING_SET_ATTR] = "weights"
            views = {}
            for op, p in bwd:
                if p not in views:
                    views[p] = graph.free_name(f"{p}.bwd")
                    pb = graph.blobs[p]
                    graph.add_blob(views[p], pb.shape, pb.dtype, pb.location,
                                   kind=PARAM_GATHERED_KIND, alias_of=back, offset=pb.offset)
                op.inputs = [views[p] if x == p else x for x in op.inputs]
            gathers["backward"] = graph.add_op(f"{back}.allgather", "Allgather", [own], [back],
                                               dict(attrs, bucket=back), location=wb.location,
                                               thread=thread).name
        entry["gathers"] = gathers
        # the readers read views of the gathered buffer: data edges are by
        # blob name, so each waits for its gather by a control edge
        for key, readers in (("forward", fwd), ("backward", bwd)):
            gather = gathers.get(key, gathers.get("forward"))
            for op, _ in readers:
                if gather not in op.control_inputs:
                    op.control_inputs.append(gather)
        units.append((entry, [op.name for op, _ in fwd],
                      [op.name for op, _ in bwd] if "backward" in gathers else []))
    from ..comm.ops import is_point_to_point
    transfers = any(is_point_to_point(op) for op in graph.ops.values())  # a pipeline stage
    pos = {op.name: i for i, op in enumerate(graph.topo_order())}
    depth = max(int(prefetch), 1)
    fwd_last = None  # the forward's last first reader: the backward's first gather waits for it
    for key, which in (("forward", 1), ("backward", 2)):
        order = sorted((min(pos[o] for o in u[which]), i) for i, u in enumerate(units)
                       if u[which])
        firsts = [min(units[i][which], key=pos.get) for _, i in order]
        for j, (_, i) in enumerate(order):
            # the nearest unit at least ``depth`` before whose first reader is
            # another op (one op may read two units first: no edge to itself)
            back = [k for k in range(j - depth + 1) if firsts[k] != firsts[j]]
            if back:
                after = firsts[back[-1]]
            elif key == "backward" and fwd_last is not None:
                after = fwd_last
            else:
                continue
            op = graph.ops[units[i][0]["gathers"][key]]
            if transfers and not _delays_the_gather_alone(graph, after, units[i][which]):
                continue
            if after not in op.control_inputs:
                op.control_inputs.append(after)
        if key == "forward":
            fwd_last = firsts[-1] if firsts else None
    graph.topo_order()  # no cycle


def shard0_bias_readers(graph):
    """{bias: [ops]}: the row-split fc ops of a tensor shard other than 0
    that read their bias on shard 0 alone (``SHARD0_BIAS_ATTR``). Stage 3
    counts them among the bias's readers (``_gather_units``, and
    zero3_windows.share_weights for its WindowSyncs): a bucket of such
    biases alone would else be gathered on tensor shard 0 only, and the
    ranks' lists of collectives (the ``seq`` of every later one) differ."""
    readers = defaultdict(list)
    for op in graph.ops.values():
        if SHARD0_BIAS_ATTR in op.attrs:
            readers[op.attrs[SHARD0_BIAS_ATTR]].append(op)
    return readers


def _interleaved(fwd, bwd, pos, anc):
    """Whether some of the backward readers ``bwd`` may run before one of
    the forward readers ``fwd`` (op names) is done, by the graph's order
    (``pos``, ``anc``: ``graph.core.ancestor_bits``): a backward reader
    not behind every forward reader, so the forward buffer is live then."""
    need = 0
    for n in fwd:
        need |= 1 << pos[n]
    return any(anc[n] & need != need for n in bwd)


def _delays_the_gather_alone(graph, after, readers):
    """Whether each of a gather's ``readers`` waits already for every
    point-to-point transfer (a pipeline stage's Recv, a window's wait) op
    ``after`` waits for: a prefetch edge from ``after`` then delays the
    gather alone, no op behind it waits for a transfer from the other
    stage it did not wait for (scheme sharded with stages; the bound on the
    live buffers is looser where it is not, as in ``bound_live_buckets``)."""
    from ..comm.ops import is_point_to_point
    deps = graph.dependencies()
    need = {d for d in reachable(after, deps) | {after} if is_point_to_point(graph.ops[d])}
    return all(need <= reachable(r, deps) for r in readers)


def sequence_collectives(graph, plan, others=()):
    """The ``seq`` of every collective of the plan (gathers, reduce-scatters),
    and of the collectives ``others`` (scheme sharded with tensor
    parallelism at stages 2 and 3: the tensor groups' allreduces, which a
    bucket's writer may wait behind while it waits, by
    ``bound_live_buckets``'s edge, for an earlier bucket's reduce-scatter,
    and among which stage 3's gathers go before their readers):
    their order in emission order, each first put in its place there
    (``_in_place``: by the ops it waits for or that wait for it), a
    collective never before one it waits for. The same on every rank (the
    ranks' graphs differ in the shard solver's ops alone, which no
    collective waits for; with tensor parallelism also in which tensor
    shard adds a row-split layer's bias, which none waits for either).
    Not the topological order's: an op waiting for another stage's
    transfer (scheme sharded with stages; a Recv, a window's wait, no
    inputs) is ready there from the start and pulls the collectives behind
    it ahead of a forward gather the other stage waits for."""
    names = {c for entry in plan for c in entry_collectives(entry)} | set(others)
    if not names:  # a pipeline stage without parameters (the loss alone): none to number
        return
    _in_place(graph, names)
    first = min((graph.ops[n].attrs["seq"] for n in names  # stage 3's gathers: none yet
                 if "seq" in graph.ops[n].attrs), default=None)
    if first is None:  # frozen units alone (a pipeline stage of frozen layers)
        first = next_seq(graph)
    for k, n in enumerate(emission_order(graph, names)):
        graph.ops[n].attrs["seq"] = first + k
    for entry in plan:
        if "reduce_scatter" in entry:
            entry["seq"] = graph.ops[entry["reduce_scatter"]].attrs["seq"]
        if "gathers" in entry:
            entry["gather_seqs"] = {k: graph.ops[g].attrs["seq"]
                                    for k, g in entry["gathers"].items()}
        else:
            entry["gather_seq"] = graph.ops[entry["allgather"]].attrs["seq"]


def emission_order(graph, names):
    """The ops ``names`` (collectives) in ``graph``'s emission order, each
    after the collectives among them it waits for, directly or not. A
    pipeline stage's slice is emitted in the whole net's order (one every
    stage runs in); its topological order is not one: an op waiting for
    another stage's transfer (a Recv, a window's wait: no inputs) is ready
    there from the start and pulls what follows it ahead."""
    names = set(names)
    deps = graph.dependencies()
    waits = {n: reachable(n, deps) & names for n in names}
    pending, order = [n for n in graph.ops if n in names], []
    while pending:
        n = next(n for n in pending if waits[n] <= set(order))
        pending.remove(n)
        order.append(n)
    return order


def entry_gathers(entry):
    """A plan entry's gather ops: stage 3's two, else the one allgather."""
    return list(entry["gathers"].values()) if "gathers" in entry else [entry["allgather"]]


def entry_collectives(entry):
    """A plan entry's collectives: its reduce-scatter (none for stage 3's
    frozen units), then its gathers."""
    return ([entry["reduce_scatter"]] if "reduce_scatter" in entry else []) + \
        entry_gathers(entry)


def _in_place(graph, names):
    """Move the collectives ``names`` in emission order: a reduce-scatter
    right after the last op it waits for, a gather right before the first
    op that waits for it. The collectives are posted in ``seq`` order, so
    that order must be one the ranks can run; the emission order of a
    pipeline stage's slice is the whole net's (compose_stages), one every
    stage runs in. A stage-3 window's ``release`` (parallel/zero3_windows.py)
    as a reduce-scatter, after the last op it waits for (the bucket's
    readers, the same on every rank): what waits for it is this rank's
    updates of its shard, which differ between the ranks (before the first
    of them, rank 1 posted a bucket's release where rank 3 posted its
    reduce-scatter on a GPT's stage)."""
    deps = graph.dependencies()
    index = {n: i for i, n in enumerate(graph.ops)}
    succ = {}
    for n, d in deps.items():
        for p in d:
            succ.setdefault(p, []).append(n)
    before, after, last = {}, {}, []
    for n in [n for n in graph.ops if n in names]:
        if graph.ops[n].op_type == "ReduceScatter" or graph.ops[n].attrs.get("phase") == \
                "release":
            anchor = max((p for p in deps[n] if p not in names), key=index.get, default=None)
            (after.setdefault(anchor, []) if anchor else last).append(n)
        else:
            anchor = min((s for s in succ.get(n, ()) if s not in names), key=index.get,
                         default=None)
            (before.setdefault(anchor, []) if anchor else last).append(n)
    ops = dict(graph.ops)
    graph.ops = {}
    for n, op in ops.items():
        if n in names:
            continue
        for m in before.get(n, []) + [n] + after.get(n, []):
            graph.ops[m] = ops[m]
    for m in last:
        graph.ops[m] = ops[m]
