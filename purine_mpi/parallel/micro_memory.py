"""Memory plan for micro-batch copies: copies that are never live at the
same time share their activation buffers.

    plan_micro_batch_memory(graph, slots)      # in place, on a rank's graph
    live_slots(schedule, stages, stage, M)     # how many copies a stage keeps
    activation_bytes(graph)                    # bytes the activations own

A stage running ``1f1b`` holds at most L = min(p − s, M) micro-batches at
once (stage s of p; ``micro_batch.stage_order``): copy k + L's forward
starts after copy k's backward. So copy k's activation blobs (and their
gradients) take the buffers of copy k mod L: ``<blob>@mb<k>`` becomes an
alias of ``<blob>@mb<k mod L>`` and the workspace allocates L copies, not
M. ``gpipe`` runs every forward before any backward, so its L is M (its
documented cost); gradient accumulation (``scheme: data``, one stage) is
``1f1b`` with L = 1: forward k + 1 after backward k. With the job's
``memory_plan`` (the default) one stage gets no plan here: the arena
(runtime/memory_plan.py) reuses copy k's bytes for copy k + 1 blob by blob
(``plan_for_layout``).

What is shared: a copy's storage roots (and their views) that only ops of
that copy touch (``<op>@mb<k>`` and its Send/Recv/Copy ``<blob>@mb<k>.…``),
that some op reads, that nobody writes with ``accumulate`` (the dispatcher
zeroes those once per iteration, not once per copy) and that are no loss or
metric (the trainer reads those after the iteration). Weights and the
per-copy weight gradients (read by the ``Sum`` after the last backward)
are never shared.

Safety is made explicit, not assumed: every op of copy k + L that writes a
shared buffer gets a control edge from every op of copy k that touches it
(its readers, the backward among them), and the graph must stay acyclic
(a GraphError otherwise). On a stage these edges repeat what the schedule's
own control edges already imply (F(k + L) comes after B(k) in the 1F1B
order), so the order of the ops does not change; what they add is a Recv
or host-to-device Copy of copy k + L waiting until copy k is done with the
buffer it writes. A Recv is posted as soon as its output may be written
(point-to-point ops are not ordered by ``seq``), and the op that consumes
it waited for copy k already, so no rank waits on a transfer its peer
cannot make: the pipeline cannot deadlock on the new edges. The results
are bit-identical to the unshared graph: every kernel writes its whole
output, so a buffer's previous contents never reach a result (as between
iterations, which reuse every buffer already).
"""
import re

from ..base.errors import GraphError

_MARK = re.compile(r"@mb(\d+)(?!\d)")


def copy_index(name):
    """k of a name that carries ``@mb<k>`` (a copy's op or blob), else None."""
    found = {int(m) for m in _MARK.findall(name)}
    return found.pop() if len(found) == 1 else None


def live_slots(schedule, stages, stage, micro_batches):
    """Copies stage ``stage`` of ``stages`` keeps at once under ``schedule``."""
    m = int(micro_batches)
    if schedule == "gpipe":
        return m
    return max(1, min(int(stages) - int(stage), m))


def _copy_root(graph, name):
    """The blob that holds ``name``'s storage within its own copy: the alias
    chain is followed while it stays in the copy (a planned blob aliases the
    buffer of another copy: it is its own copy root)."""
    k = copy_index(name)
    while True:
        target = graph.blobs[name].alias_of
        if target is None or copy_index(target) != k:
            return name
        name = target


def _storage_groups(graph):
    """{copy root: [blobs on it]} for the micro-batch copies' storage."""
    groups = {}
    for name in graph.blobs:
        root = _copy_root(graph, name)
        if copy_index(root) is not None:
            groups.setdefault(root, []).append(name)
    return groups


def shareable_roots(graph):
    """{k: [storage roots of copy k that may share buffers]} (see the module
    docstring for the rules)."""
    prod, cons = graph.producers(), graph.consumers()
    unmarked = {graph.storage_root(n) for n in graph.blobs if copy_index(n) is None}
    out = {}
    for root, names in _storage_groups(graph).items():
        if graph.storage_root(root) in unmarked:
            continue  # something outside the copies views this storage
        k = copy_index(root)
        blobs = [graph.blobs[n] for n in names]
        alias = graph.blobs[root].alias_of
        if alias is not None and copy_index(alias) is None:
            continue  # a view into storage outside the copies (a bucket)
        if any("loss_weight" in b.attrs or b.attrs.get("metric") or b.kind in
               ("param", "state", "param_buffer", "lr", "iter") for b in blobs):
            continue
        if any(b.attrs.get("window") for b in blobs):
            continue  # in window memory, one region per copy (parallel/one_sided.py)
        writers = [op for n in names for op in prod.get(n, ())]
        readers = [op for n in names for op in cons.get(n, ())]
        if not writers or not readers or any(op.accumulate for op in writers):
            continue
        if any(copy_index(op.name) != k for op in writers + readers):
            continue
        out.setdefault(k, []).append(root)
    return out


def _rename(name, k, j):
    return _MARK.sub(lambda m: f"@mb{j}" if int(m.group(1)) == k else m.group(0), name)


def plan_micro_batch_memory(graph, slots):
    """Let copy k's shareable blobs use the buffers of copy k mod ``slots``
    (in place); adds the control edges that make it safe and checks the
    graph stays acyclic. Returns {"slots", "shared": [blob], "saved_bytes"}."""
    slots = int(slots)
    roots = shareable_roots(graph)
    plan = {"slots": slots, "shared": [], "saved_bytes": 0}
    if slots < 1 or not roots:
        return plan
    ok = {k: set(v) for k, v in roots.items()}
    prod, cons = graph.producers(), graph.consumers()
    groups = _storage_groups(graph)

    def touching(root):
        """Ops that read or write any blob on ``root``'s storage."""
        ops = {}
        for n in groups[root]:
            for op in list(prod.get(n, ())) + list(cons.get(n, ())):
                ops[op.name] = op
        return ops

    def writers(root):
        return {op.name: op for n in groups[root] for op in prod.get(n, ())}

    for k in sorted(roots):
        if k < slots:
            continue
        for root in roots[k]:
            prev = _rename(root, k, k - slots)   # the copy before it in this slot
            owner = _rename(root, k, k % slots)  # the copy that owns the buffer
            if graph.blobs[root].alias_of is not None:
                continue  # planned already
            if prev not in ok.get(k - slots, ()) or owner not in ok.get(k % slots, ()):
                continue
            a, b = graph.blobs[root], graph.blobs[owner]
            if (a.shape, a.dtype, a.location) != (b.shape, b.dtype, b.location):
                continue
            before = list(touching(prev))
            for op in writers(root).values():
                extra = [n for n in before if n != op.name]
                op.control_inputs = list(dict.fromkeys(list(op.control_inputs) + extra))
            a.alias_of, a.offset = owner, 0
            plan["shared"].append(root)
            plan["saved_bytes"] += a.nbytes
    if plan["shared"]:
        try:
            graph.topo_order()
        except GraphError as e:
            raise GraphError(f"the micro-batch memory plan ({slots} slot(s)) would make the "
                             f"schedule wait on itself: {e}") from None
    graph.memory_plan = plan
    return plan


def activation_bytes(graph, workspace=None):
    """Bytes of storage the micro-batch copies' shareable blobs own (their
    storage roots), what ``plan_micro_batch_memory`` shrinks: planned from
    the graph, or with ``workspace`` the arrays it allocated for them."""
    roots = [n for names in shareable_roots(graph).values() for n in names
             if graph.blobs[n].alias_of is None]
    if workspace is not None:
        return sum(int(workspace.storage(n).nbytes) for n in roots)
    return sum(graph.blobs[n].nbytes for n in roots)


def describe_plan(graph):
    """One line for ``graph`` text output, or None without a plan."""
    plan = graph.memory_plan
    if plan is None:
        return None
    return (f"memory plan: micro-batch activations in {plan['slots']} slot(s), "
            f"{len(plan['shared'])} blob(s) reuse an earlier copy's buffer, "
            f"{activation_bytes(graph)} bytes allocated, {plan['saved_bytes']} saved")


def plan_for_layout(graph, layout, schedule, arena=False):
    """The plan of a rank at ``layout`` (parallel/compose.Layout) running
    ``schedule``; nothing without micro-batches. ``arena``: the job's
    ``memory_plan`` lays the transient blobs out (runtime/memory_plan.py);
    then one stage (gradient accumulation) gets no plan here: its schedule
    orders every op of copy k before every op of copy k + 1 already, so the
    arena reuses copy k's bytes for copy k + 1 blob by blob, while a blob
    made to alias the buffer of an earlier copy would be one root live from
    copy k's first op to copy k + 1's last, bytes the arena could not give
    to anything in between (about M times one copy's activations)."""
    if int(layout.micro_batches) <= 1 or (arena and not layout.staged):
        return None
    return plan_micro_batch_memory(
        graph, live_slots(schedule, layout.stages, layout.stage, layout.micro_batches))
