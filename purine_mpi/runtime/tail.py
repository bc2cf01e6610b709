"""The deferred tail of an iteration: what may still run while the next
iteration starts (``parallel.defer_update``).

In synchronous data parallelism the last buckets' allreduce, and the weight
updates behind it, are the end of every iteration: with a slow link the
whole job waits for the bottom layers' gradients to cross it, and then for
their update, before the next forward starts -- although that forward's
first layers read none of what is still on its way. ``deferred_tail`` picks
the ops that may finish while the next iteration runs, and for each of them
the ops of the *next* iteration that must wait for it:

- the tail is every collective comm op (kernel category ``comm``, posted in
  ``seq`` order) but those within a pass (attr ``IN_PASS``, comm/ops.py: a
  synchronised batch norm's sums, after which the forward or backward goes
  on) and everything downstream of one, less any op that reads
  storage nothing in the graph writes (fed from outside between iterations,
  like ``iter``), or touches storage an accumulating op writes (zeroed at
  the start of every iteration), and less everything upstream of such an op
  (the tail is closed downstream: nothing outside it waits for it within
  its own iteration);
- a next-iteration op waits for a tail op when one of them writes memory
  the other reads or writes (blobs on one storage root whose element ranges
  overlap: ``Graph._overlap``), when it is the same op, or when it is one of
  the tail op's predecessors -- so at most one instance of each op is in
  flight, and every value is what a run without deferral would see.

The event dispatcher (``runtime/dispatcher.py``) uses the result; results
are bit-identical to running the iterations one after the other.
"""
from collections import defaultdict

from ..comm.ops import IN_PASS


def deferred_tail(graph, kernels, deps=None):
    """(tail op names as a frozenset, {tail op: tuple of the ops of the next
    iteration that wait for it}). ``kernels``: {op name: kernel}, for each
    op's ``category`` and ``seq_ordered``. Empty when nothing can be
    deferred."""
    deps = deps if deps is not None else graph.dependencies()
    succ = defaultdict(set)
    for n, d in deps.items():
        for p in d:
            succ[p].add(n)
    ops = graph.ops
    comm = {n for n, k in kernels.items() if k.category == "comm"}
    roots = [n for n in comm if kernels[n].seq_ordered and not ops[n].attrs.get(IN_PASS)]
    tail, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if n not in tail:
            tail.add(n)
            stack.extend(succ[n])
    root = graph.storage_root
    written = {root(b) for op in ops.values() for b in op.outputs}
    accumulated = {root(b) for op in ops.values() if op.accumulate for b in op.outputs}
    for n in list(tail):
        op = ops[n]
        if (n in comm and not kernels[n].seq_ordered) \
                or any(root(b) not in written for b in op.inputs) \
                or any(root(b) in accumulated for b in op.inputs + op.outputs):
            tail.discard(n)
    changed = True
    while changed:  # closed downstream: an op whose successor stays behind stays too
        changed = False
        for n in list(tail):
            if any(s not in tail for s in succ[n]):
                tail.discard(n)
                changed = True
    if not tail:
        return frozenset(), {}
    # who touches which storage: root -> [(op, blob, writes)]
    touch = defaultdict(list)
    for op in ops.values():
        for b in op.inputs:
            touch[root(b)].append((op.name, b, False))
        for b in op.outputs:
            touch[root(b)].append((op.name, b, True))
    cross = {}
    for n in tail:
        op = ops[n]
        waiters = {n} | set(deps[n])
        mine = [(b, False) for b in op.inputs] + [(b, True) for b in op.outputs]
        for b, writes in mine:
            for other, ob, other_writes in touch[root(b)]:
                if other in waiters or not (writes or other_writes):
                    continue
                if b == ob or graph._overlap(b, ob) is not False:
                    waiters.add(other)
        cross[n] = tuple(sorted(waiters))
    return frozenset(tail), cross


def describe_tail(graph):
    """One line for ``graph --np N``: what of an iteration may run on into
    the next one, and what of the next one waits for it; None when nothing."""
    from ..ops.catalog import make_kernel
    kernels = {name: make_kernel(op) for name, op in graph.ops.items()}
    tail, cross = deferred_tail(graph, kernels)
    if not tail:
        return None
    comm = sum(1 for n in tail if kernels[n].category == "comm")
    waiting = {w for t in tail for w in cross[t]} - tail
    order = [op.name for op in graph.topo_order() if op.name in waiting]
    first = f" (first: {order[0]})" if order else ""
    return (f"deferred tail (parallel.defer_update): {comm} allreduce(s) and {len(tail) - comm} "
            f"op(s) behind them may finish while the next iteration runs; {len(waiting)} op(s) "
            f"of the next iteration wait for them{first}")
