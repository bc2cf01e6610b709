"""Micro-batches: one replica's training graph with its forward/backward
sub-graph copied once per micro-batch over shared weights
(``parallel.micro_batches: M``), and the schedule that orders the copies.

    replicate_micro_batches(graph, grads, M)   # in place
    add_schedule(graph, M, "1f1b", stage_of)   # control edges, per stage

Copy k of every op between the data and the gradients is named
``<op>@mb<k>`` and writes ``<blob>@mb<k>``; weights, ``iter`` and ``lr`` are
shared; an op whose attr ``stream`` names the op whose Philox stream it
draws (the fused attention's dropout: its raw path's Dropout op) draws
``<stream>@mb<k>`` in copy k, as copy k of that Dropout op would: each
micro-batch its own masks. State an op updates in place (a batch norm's
running statistics: a ``state`` output aliasing one of its inputs) is
updated by the copies in turn: copy k reads copy k−1's output, and a kernel
with ``micro_batch_attrs`` learns its copy from attrs ``micro_batch`` and
``micro_batches`` (a Caffe running average counts the M updates). The graph comes built for one micro-batch (job/replica.build_train_graph
reads B/M samples); copy k's DataReader reads rows ``[k·B/M, (k+1)·B/M)``
of the rank's batch B: it is replica ``r·M + k`` of ``W·M`` in the sample
order of docs/config.md, so the samples (and their transforms) are exactly
those of the batch without micro-batches. Each parameter's M gradients are
added up as the copies finish, in copy order: ``<grad>.micro_sum<k>`` =
``<grad>.micro_sum<k-1>`` + ``<grad>@mb<k>`` (copy 0's gradient starts the
sum; the last ``Sum``, ``<grad>.micro_sum``, writes the gradient the update
reads). That is the M-input ``Sum``'s own order, so the result is the
same bit for bit, but copy k's gradient dies with copy k: the rank holds
the gradient and the gradients of one copy, not M (the running sums
belong to copy k's backward in the schedule): copy 0's gradient and the
running sums are views of the gradient the update reads, so copy 0
writes it as without micro-batches and each ``Sum`` adds in place
(``_sum_in_place``; schemes data, none, sharded, pipeline and hybrid,
and a parameter-server worker, whose push sends that gradient). The
update's ``grad_scale`` is divided by M once: every copy's loss is its
micro-batch mean, so the update sees the mean over the whole batch (a
loss with an ``ignore_label`` divides its micro-batch's sum by the global
batch's count / shards instead, the data reader's normaliser: the mean of
the copies' losses is then the global batch's mean, job/replica.py
``global_label_counts``; copy 0's data reader counts for every copy, the
other copies' losses read its normaliser). Each
copy's loss blob keeps its ``loss_weight`` and gets ``micro_batch_share``
1/M, which the trainer uses to report the batch's loss.

Schedules are control edges on each stage (a stage is a rank of a
pipeline; the whole graph for ``scheme: data``), so the same dispatcher
runs them:

- ``gpipe``: F0 F1 … F(M−1), then B0 B1 … B(M−1);
- ``1f1b``: stage s of p first runs min(p−s−1, M) forwards (warm-up), then
  alternates one forward and one backward, then the remaining backwards.
  A stage then holds the activations of at most p−s micro-batches at once
  (GPipe: M), and allocates only that many (micro_memory.py).

F(s, k) are copy k's ops on stage s that lead to the loss, B(s, k) its
other ops (the backward pass); every op of a group waits for the last ops
of the group before it on the same stage.
"""
from ..graph.core import copy_value
from ..job.replica import loss_blobs
from ..ops.catalog import get_kernel_class
from ..ops.updates import UPDATE_OP_TYPES

SCHEDULES = ("1f1b", "gpipe")


def micro_name(name, k):
    return f"{name}@mb{k}"


def per_sample_ops(graph, grads):
    """Names of the ops one micro-batch repeats: every ancestor of a
    gradient or a loss (data, forward, backward), in graph order."""
    targets = set(grads.values()) | set(loss_blobs(graph))
    prod = graph.producers()
    keep, stack = set(), list(targets)
    while stack:
        for op in prod.get(stack.pop(), ()):
            if op.name not in keep:
                keep.add(op.name)
                stack.extend(op.inputs)
    return [n for n in graph.ops if n in keep]


def replicate_micro_batches(graph, grads, micro_batches, in_place=False):
    """Copy the per-sample sub-graph ``micro_batches`` times (in place);
    returns {op name of copy: (k, original op name)}, the running sums of
    the gradients among them as (k, None): they belong to copy k's backward
    (``add_schedule``). ``in_place``: copy 0's gradients and the running
    sums are views of the gradients the update reads (``_sum_in_place``):
    scheme data's and hybrid's buckets, a replica's or a pipeline stage's
    own gradients, ZeRO's buckets (stage 2's and 3's transient ones too:
    the reduce-scatter of bucket k, which a later bucket's writers wait for
    (sharding.bound_live_buckets), already waits for every copy's backward
    before the last, so copy 0's writers and the running sums get no edge,
    as before; the last ``Sum`` writes the bucket as it did)."""
    m = int(micro_batches)
    names = per_sample_ops(graph, grads)
    ops = [graph.ops[n] for n in names]
    # the blobs the copied ops write, in op order (a set's order follows the
    # Python hash seed: the copies' blobs, and so a printed graph, would
    # differ between two processes of the same job)
    old_blobs = {b: graph.blobs[b] for op in ops for b in op.outputs}
    made = set(old_blobs)
    grad_blobs = set(grads.values())
    losses = loss_blobs(graph)
    # state a copied op updates in place (a batch norm's running statistics:
    # a state output aliasing an input no copied op makes): copy k reads what
    # copy k-1 wrote, so the copies update it one after another, in copy order
    updated = {graph.blobs[b].alias_of: b for op in ops for b in op.outputs
               if graph.blobs[b].kind == "state" and graph.blobs[b].alias_of in op.inputs
               and graph.blobs[b].alias_of not in made}
    thread_of = {b: op.thread for op in ops for b in op.outputs}
    for n in names:
        del graph.ops[n]
    for b in old_blobs:
        del graph.blobs[b]
    copies = {}
    for k in range(m):
        for b, blob in old_blobs.items():
            new = blob.copy()
            new.name = micro_name(b, k)
            if new.alias_of in made:
                new.alias_of = micro_name(new.alias_of, k)
            if b in losses:
                new.attrs["micro_batch_share"] = 1.0 / m
            graph.blobs[new.name] = new
        for op in ops:
            attrs = copy_value(op.attrs)
            if op.op_type == "DataReader":
                attrs["rank"] = int(attrs.get("rank", 0)) * m + k
                attrs["world_size"] = int(attrs.get("world_size", 1)) * m
                attrs["micro_batch"], attrs["micro_batches"] = k, m
            if get_kernel_class(op.op_type).micro_batch_attrs:
                attrs["micro_batch"], attrs["micro_batches"] = k, m
            if "stream" in attrs:   # a Philox stream named by an op (the fused
                # attention's dropout: its raw path's Dropout op), per copy as
                # that op's copy's own: each micro-batch draws its own masks
                attrs["stream"] = micro_name(attrs["stream"], k)
            name = micro_name(op.name, k)
            graph.add_op(name, op.op_type,
                         [micro_name(b, k) if b in made else
                          micro_name(updated[b], k - 1) if k and b in updated else b
                          for b in op.inputs],
                         [micro_name(b, k) for b in op.outputs], attrs, op.location, op.thread,
                         op.accumulate,
                         [micro_name(c, k) for c in op.control_inputs if c in names])
            copies[name] = (k, op.name)
    _count_once(graph, ops, m)
    after = {}  # {op writing a copy's gradient: the running sum that reads it}
    prod = graph.producers()
    index = {n: i for i, n in enumerate(graph.ops)}
    for grad in sorted(grad_blobs):  # the gradient the update reads, summed over copies
        blob = old_blobs[grad].copy()
        graph.blobs[grad] = blob
        total = micro_name(grad, 0)
        for k in range(1, m):
            out = grad if k == m - 1 else sum_name(grad, k)
            if out != grad:
                part = blob.copy()
                part.name = out
                graph.blobs[out] = part
            name = f"{grad}.micro_sum" if k == m - 1 else sum_name(grad, k)
            graph.add_op(name, "Sum", [total, micro_name(grad, k)], [out],
                         location=blob.location, thread=thread_of[grad])
            copies[name] = (k, None)
            writers = [op.name for op in prod.get(micro_name(grad, k), ())]
            if writers:
                after.setdefault(max(writers, key=index.get), []).append(name)
            total = out
        if in_place:
            _sum_in_place(graph, grad, m, prod)
    for op in graph.ops.values():  # scaled once, before the update
        if op.op_type in UPDATE_OP_TYPES and op.inputs[1] in grad_blobs:
            op.attrs["grad_scale"] = float(op.attrs.get("grad_scale", 1.0)) / m
    # each running sum right after the op that writes its copy's gradient:
    # the copy's gradient dies there (the order breaks the topological ties)
    moved = {n for names in after.values() for n in names}
    order = []
    for name in graph.ops:
        if name not in moved:
            order.append(name)
            order.extend(after.get(name, ()))
    graph.ops = {n: graph.ops[n] for n in order}
    _reorder(graph)
    return copies


def _sum_in_place(graph, grad, m, prod):
    """Make copy 0's gradient and the running sums of ``grad`` views of
    ``grad`` itself: copy 0's gradient op writes the gradient the update
    reads (as without micro-batches) and each ``Sum`` adds copy k's
    gradient to it in place (``np.add(total, part, out=total)``: the same
    additions in the same order, so the same bits). The rank then holds
    the gradient and one copy's gradient, not also a running sum that
    lives from copy 0's backward to the last copy's (4.3 MiB more at the
    peak of cifar10_quick_wide's ip1, and at M >= 3 a sum read and one
    written at once). Left as separate blobs where copy 0's gradient is
    a view already or is accumulated by several ops (the dispatcher zeroes
    such a blob once per iteration: the gradient's storage must not be
    zeroed under another writer)."""
    first, blob = micro_name(grad, 0), graph.blobs[grad]
    part = graph.blobs[first]
    if blob.alias_of is not None or part.alias_of is not None or \
            any(op.accumulate for op in prod.get(first, ())):
        return
    for name in [first] + [sum_name(grad, k) for k in range(1, m - 1)]:
        graph.blobs[name].alias_of, graph.blobs[name].offset = grad, 0


def _count_once(graph, ops, m):
    """A data op counting the global batch's labels (attr ``count_label``,
    ops/data.py: the same normalisers in every copy) counts in copy 0
    alone: copy k > 0 drops the attr and its outputs after the label, and
    its losses read copy 0's (one count per rank and iteration, not M)."""
    for op in ops:
        if op.op_type != "DataReader" or op.attrs.get("count_label") is None:
            continue
        shared = {micro_name(b, k): micro_name(b, 0) for b in op.outputs[2:]
                  for k in range(1, m)}
        for k in range(1, m):
            reader = graph.ops[micro_name(op.name, k)]
            del reader.outputs[2:]
            reader.attrs.pop("count_label")
            reader.attrs.pop("count_over", None)
        for b in shared:
            del graph.blobs[b]
        for other in graph.ops.values():
            other.inputs = [shared.get(b, b) for b in other.inputs]


def sum_name(grad, k):
    """The running sum of copies 0..k of gradient ``grad`` (op and blob)."""
    return f"{grad}.micro_sum{k}"


def _reorder(graph):
    """Graph order = a topological order (the dispatchers' priorities and
    the transfers' ``seq`` follow it)."""
    order = graph.topo_order()
    graph.ops = {op.name: op for op in order}


def add_schedule(graph, copies, micro_batches, schedule, stage_of, stages):
    """Control edges that make each stage run its micro-batch copies in
    ``schedule`` order. ``stage_of(op)`` -> stage index in 0..stages-1."""
    m = int(micro_batches)
    cons = graph.consumers()
    prod = graph.producers()
    losses = set(loss_blobs(graph))
    # forward = ops of a copy from which a loss is reachable
    forward = set()
    stack = [b for b in losses]
    while stack:
        for op in prod.get(stack.pop(), ()):
            if op.name in copies and op.name not in forward:
                forward.add(op.name)
                stack.extend(op.inputs)
    groups = {}
    for name, (k, _) in copies.items():
        op = graph.ops[name]
        key = (stage_of(op), "F" if name in forward else "B", k)
        groups.setdefault(key, []).append(name)
    for s in range(stages):
        order = stage_order(s, stages, m, schedule)
        chain = [groups[(s, kind, k)] for kind, k in order if (s, kind, k) in groups]
        for before, after in zip(chain, chain[1:]):
            inside = set(before)
            last = [n for n in before
                    if not any(c.name in inside for b in graph.ops[n].outputs
                               for c in cons.get(b, ()))]
            after_set = set(after)
            for n in after:
                op = graph.ops[n]
                if not any(p.name in after_set for b in op.inputs for p in prod.get(b, ())):
                    op.control_inputs = list(dict.fromkeys(op.control_inputs + last))
    _reorder(graph)


def stage_order(stage, stages, micro_batches, schedule):
    """[("F" | "B", micro-batch)] in the order stage ``stage`` runs them."""
    m = micro_batches
    if schedule == "gpipe":
        return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
    warm = min(stages - stage - 1, m)
    order = [("F", k) for k in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", k) for k in range(m - warm, m)]
