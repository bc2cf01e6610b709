"""``runtime/footprint.coexisting_bytes``, the most bytes of a set of
buffers (storage roots) that can be live at once in any order a graph
allows: the heaviest set of roots no two of which the graph orders apart
(root A before B: every op touching A is an ancestor of every writer of B).
It is computed as the heaviest antichain of that partial order, the total
less a maximum flow (Dilworth); here against trying every subset on random
small graphs (views of a root, several writers of one root, roots nothing
writes or nothing touches, control edges), and, at 2,100 buffers in 3
chains (a deep net's gradient buckets at a small ``parallel.bucket_mb``),
against the closed form for disjoint chains (each chain's largest): the
search it replaced (a branch-and-bound over the unordered pairs) took
1.05 s at 150 buffers in 3 chains, 11.1 s at 300, 179 s at 600."""
import itertools
import random

from purine_mpi.graph.core import Graph, GraphError
from purine_mpi.runtime.footprint import coexisting_bytes


def _random_graph(rng):
    """A random graph over ``k`` roots ``r<i>`` (float32, 1 to 9 elements,
    some with a view ``r<i>v`` of their first element), plain buffers and
    ops each reading buffers written before it, writing a new plain buffer
    or a root or view (again: several writers), some with control inputs;
    None where its write-after-read edges close a cycle. (graph, roots)."""
    g = Graph()
    k = rng.randint(1, 8)
    g.add_blob("x", shape=(1,))
    roots, targets = [], []
    for i in range(k):
        g.add_blob(f"r{i}", shape=(rng.randint(1, 9),))
        roots.append(f"r{i}")
        targets.append(f"r{i}")
        if rng.random() < 0.3:
            g.add_blob(f"r{i}v", shape=(1,), alias_of=f"r{i}", offset=0)
            targets.append(f"r{i}v")
    written, ops = ["x"], []
    for j in range(rng.randint(1, 12)):
        ins = rng.sample(written, rng.randint(1, min(3, len(written))))
        if rng.random() < 0.6:
            out = rng.choice(targets)
        else:
            out = f"d{j}"
            g.add_blob(out, shape=(1,))
        ctrl = [o for o in ops if rng.random() < 0.15]
        g.add_op(f"o{j}", "Sum", ins, [out], control_inputs=ctrl)
        ops.append(f"o{j}")
        written.append(out)
    try:
        g.topo_order()
    except GraphError:
        return None
    return g, rng.sample(roots, rng.randint(1, k))


def _brute_force(g, roots):
    """The definition, every subset tried: the ancestors of each op by a
    search over ``g.dependencies()``, A before B where B has a writer and
    every op touching A is an ancestor of every writer of B; the heaviest
    subset of ``roots`` no two of which are ordered. Also checks "before"
    is a strict partial order (what the flow's answer rests on)."""
    deps = g.dependencies()
    anc = {}

    def ancestors(o):
        if o not in anc:
            seen, todo = set(), list(deps[o])
            while todo:
                p = todo.pop()
                if p not in seen:
                    seen.add(p)
                    todo.extend(deps[p])
            anc[o] = seen
        return anc[o]

    touch = {r: set() for r in roots}
    write = {r: set() for r in roots}
    for op in g.ops.values():
        for b in op.outputs:
            if g.storage_root(b) in write:
                write[g.storage_root(b)].add(op.name)
                touch[g.storage_root(b)].add(op.name)
        for b in op.inputs:
            if g.storage_root(b) in touch:
                touch[g.storage_root(b)].add(op.name)
    before = {(a, b) for a in roots for b in roots
              if write[b] and all(t in ancestors(w) for t in touch[a] for w in write[b])}
    assert not any((a, a) in before for a in roots)
    assert all((a, c) in before for a, b in before for b2, c in before if b == b2)
    nbytes = {r: 4 * g.blobs[r].shape[0] for r in roots}
    best = 0
    for n in range(len(roots) + 1):
        for subset in itertools.combinations(roots, n):
            if not any((a, b) in before or (b, a) in before
                       for a, b in itertools.combinations(subset, 2)):
                best = max(best, sum(nbytes[r] for r in subset))
    return best


def test_coexisting_bytes_is_the_heaviest_antichain_of_random_graphs():
    """400 random graphs (seeded): the flow's figure is the subsets' best."""
    rng = random.Random(67)
    checked = 0
    while checked < 400:
        made = _random_graph(rng)
        if made is None:
            continue
        g, roots = made
        assert coexisting_bytes(g, roots) == _brute_force(g, roots), \
            ({n: (o.inputs, o.outputs, o.control_inputs) for n, o in g.ops.items()}, roots)
        checked += 1


def chain_graph(sizes, k):
    """Buffers ``b<i>`` of ``sizes[i]`` float32 elements, each written by
    one op and read by another, in ``k`` chains: b<i>'s writer reads what
    b<i-k>'s reader wrote (chain i mod k); benchmarks/coexisting_speed.py
    times it."""
    g = Graph()
    g.add_blob("x", shape=(1,))
    for i, n in enumerate(sizes):
        g.add_blob(f"b{i}", shape=(n,))
        g.add_op(f"w{i}", "Sum", [f"z{i - k}" if i >= k else "x"], [f"b{i}"])
        g.add_op(f"r{i}", "Copy", [f"b{i}"], [f"z{i}"])
    return g, [f"b{i}" for i in range(len(sizes))]


def test_coexisting_bytes_of_2100_buffers_in_3_chains():
    """2,100 buffers in 3 disjoint chains: one of each chain at a time, so
    the heaviest of each chain summed (the search it replaced took 179 s
    at 600); and 2,100 unordered buffers: all of them."""
    sizes = [1 + (i * 7919) % 13 for i in range(2100)]
    g, names = chain_graph(sizes, 3)
    assert coexisting_bytes(g, names) == 4 * sum(max(sizes[c::3]) for c in range(3))
    g, names = chain_graph(sizes, 2100)
    assert coexisting_bytes(g, names) == 4 * sum(sizes)
