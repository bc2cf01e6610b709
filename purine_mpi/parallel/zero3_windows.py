"""ZeRO stage 3 with one shared copy of the weights per node
(``parallel.scheme: sharded``, ``parallel.shard: 3``,
``parallel.transport: one_sided``, every rank on one node; issue 43).

Stage 3 on MPI (parallel/sharding.compose_zero3) keeps each rank's shard
of a bucket's flat weights and gathers the whole bucket into two transient
buffers before its forward and its backward readers. On one node the
gathers need not copy anything: each bucket's flat weights live in one
region of a shared window (``MPI.Win.Allocate_shared``, comm/windows.py),
``z3/<weights>``, owned by the node's first rank, laid out as the bucket is
(rank r's shard at ``shard_range(n, N, r)``). Every rank's shard blob is a
view of its range of it (the shard solver updates it in place), and the
forward and backward readers read the region itself: the node holds one
copy of the weights, however many ranks it runs.

The two gathers of a bucket become two ``WindowSync`` ops
(comm/window_sync.py, a barrier with the window's memory syncs, in the
collectives' ``seq`` order):

- ``<weights>.acquire`` before the bucket's readers (where its forward
  gather stood): every rank's update of its slice in the last iteration
  is complete and visible;
- ``<weights>.release`` after every reader of the bucket on this rank and
  before this rank's updates of its slice: no rank updates while another
  still reads the weights of this iteration.

Across hosts (``parallel.transport: one_sided``, or ``auto`` where the
ranks agree the network does RDMA: comm/windows.rma_across_hosts) each
rank's weight shard of every bucket is region ``z3/<weights>@<r>`` of its
own RMA window (``MPI.Win.Allocate``, the shard blob lives there and the
shard solver updates it in place), and each of a bucket's two gathers
becomes a ``GetShards`` (comm/rma_pull.py): an ``MPI_Rget`` of every other
owner's shard into the transient buffer, its own shard copied. The same
two WindowSyncs order them (``Win_sync`` on the RMA window makes the
owner's stores public): ``acquire`` before both GetShards (every owner
finished last iteration's update of its shard), ``release`` after both
and before this rank's updates of its shard (no owner writes a shard
another rank may still be reading). Where the library allocates no
window, or ``auto`` finds no RDMA, the two-sided gathers stay (the
start-up block says why, once). Offline (``graph --np N``: no
communicator) the graph is converted as the node table says
(``PURINE_RANKS_PER_HOST`` splits it) and nothing is allocated.

With ``parallel.stages`` on several replicas (``group``: this rank's
stage's ranks, ``Layout.stage_ranks``, replica order) each stage's buckets
are its own, sharded over its ranks: the same two forms per stage, the
stage's ranks as the owners (shard i of a bucket owned by ``group[i]``;
one node: the shared region ``z3/<weights>@<group[0]>`` owned by the
stage's first rank; across nodes: ``z3/<weights>@<group[i]>``), the
WindowSyncs barriers on the stage's sub-communicator (attr ``group``).
Which form a stage takes is its ranks' node table's (one node:
shared, one_sided only, as without stages; several: RMA). A rank knows
its own stage's plan only, so the layout is exchanged: every rank sends
its stage's regions (one allgather of the world, the stage-transfer
windows' pattern), every rank declares their union in world order and
allocates it (collective on the world, beside the stage transfers'
windows: a Windows of its own); a stage without parameters sends none
and still takes part. Where no stage takes windows nothing is allocated.

With ``parallel.tensor_parallel`` the same with ``group`` the ranks that
shard a tensor shard's buckets (its replicas, ``Layout.shard_ranks``;
with stages too, a (stage, tensor shard) position's, ``stage_ranks``),
and the WindowSyncs (and GetShards) numbered among ``others``, the tensor
groups' allreduces, in ``sequence_collectives``' one order, as the
gathers were: numbered without them a barrier took an allreduce's seq.

    to_shared_weights(graph, plan, job, world, group=None, others=(), who="stage")
        -> (windows, transport lines, placement)
"""
from ..comm.ops import shard_range
from ..comm.windows import WindowLayout, allocate_or_fall_back, fake_host_of, node_groups
from ..graph.core import WORKING_SET_ATTR
from .sharding import sequence_collectives, shard0_bias_readers

PREFIX = "z3/"
GATHERED = ("weights", "allgathered into transient buffers (MPI Iallgatherv)")
SHARED = ("weights", "one shared copy per node: each bucket's weights in one shared window "
          "of its {who}, read in place (the gathers only synchronise)")
GOT = ("weights", "RMA Get of the owners' shards: each rank's weight shard in its RMA "
       "window, each gather an MPI_Rget of every owner's shard into a transient buffer")


def to_shared_weights(graph, plan, job, world, group=None, others=(), who="stage"):
    """Put the stage-3 buckets of ``plan`` (compose_zero3's) into one
    shared window per node when ``parallel.transport`` is one_sided and
    every rank shares one node (see the module docstring); allocate it
    (collective). ``group``: with pipeline stages, this rank's stage's
    ranks; with tensor parallelism, its tensor shard's replicas (with
    stages too: its (stage, tensor shard) position's), ``who`` naming them
    in the transport row (``_stage_weights``; every rank calls it, a stage
    without parameters too). ``others``: the collectives the WindowSyncs
    are numbered among (``sequence_collectives``: the tensor groups'
    allreduces, a synchronised batch norm's sums). Returns (the Windows or None, the transport lines or
    None, the window placement ``(layout, node_of)`` or None)."""
    transport = job.parallel.transport
    if transport not in ("one_sided", "auto") or world.size == 1 or job.device >= 0 or \
            (group is None and not any("weight_shard" in entry for entry in plan)):
        return None, None, None
    live = getattr(world, "comm", None) is not None
    node_of = node_groups(world) if live else \
        {r: fake_host_of(r) or 0 for r in range(world.size)}
    if group is not None:
        return _stage_weights(graph, plan, transport, world, node_of, live, list(group),
                              others, who)
    hosts = len(set(node_of.values()))
    if hosts != 1:
        return _rma_weights(graph, plan, transport, world, node_of, live, others)
    if transport != "one_sided":
        return None, None, None
    owner = min(node_of)
    layout = WindowLayout()
    for entry in plan:
        wb = graph.blobs[entry["weights"]]
        layout.add(PREFIX + entry["weights"], owner, wb.shape, wb.dtype,
                   peers=range(world.size))
    placed = (layout, node_of)  # what each rank's windows hold (runtime/footprint.py)
    windows = None
    if live:
        windows, lines = allocate_or_fall_back(
            world, layout, node_of, lambda exc: [GATHERED + (f"one_sided: {exc}",)])
        if windows is None:
            return None, lines, None
    share_weights(graph, plan, world.rank, owner, others=others)
    return windows, [("weights", "one shared copy per node: each bucket's weights in one "
                      "shared window, read in place (the gathers only synchronise)",
                      "parallel.transport: one_sided, ranks of one node")], placed


def _rma_weights(graph, plan, transport, world, node_of, live, others=()):
    """Across hosts: each rank's weight shards in its RMA window, the
    gathers Gets (see the module docstring), where ``transport`` is
    one_sided or ``auto`` and the ranks agree the network does RDMA; the
    collectives renumbered among ``others``."""
    from .one_sided import _agreed_across_hosts
    hosts = len(set(node_of.values()))
    why = f"parallel.transport: {transport}, ranks on {hosts} nodes"
    if transport == "auto":
        ok, rdma = _agreed_across_hosts(world, node_of)
        why = f"{why}, {rdma}"
        if not ok:
            return None, [GATHERED + (why,)], None
    layout = WindowLayout()
    for entry in plan:
        wb = graph.blobs[entry["weights"]]
        for r in range(world.size):
            lo, hi = shard_range(wb.size, world.size, r)
            layout.add(shard_region(entry["weights"], r), r, (hi - lo,), wb.dtype,
                       peers=range(world.size))
    windows = None
    if live:
        windows, lines = allocate_or_fall_back(
            world, layout, node_of, lambda exc: [GATHERED + (f"{why}: {exc}",)])
        if windows is None:
            return None, lines, None
    get_weights(graph, plan, world.rank, range(world.size), others=others)
    return windows, [GOT + (why,)], (layout, node_of)


def _stage_weights(graph, plan, transport, world, node_of, live, group, others=(),
                   who="stage"):
    """With pipeline stages on several replicas (or tensor shards: ``who``
    names the groups): this rank's stage's buckets in windows over its
    ranks ``group``, the WindowSyncs numbered among ``others`` (see the module
    docstring): one shared region per bucket where the stage's ranks share
    one node and ``transport`` is one_sided, each rank's shard in its RMA
    window where they span nodes (``auto``: where the ranks agree the
    network does RDMA), else the two-sided gathers stay. The layout
    exchanged and allocated on every rank alike."""
    from .one_sided import _agreed_across_hosts
    # one allreduce where the world spans nodes (the same on every rank)
    across = _agreed_across_hosts(world, node_of) if transport == "auto" else (True, "")
    hosts = len({node_of[r] for r in group})
    why = f"parallel.transport: {transport}, the {who}'s ranks {group} on " + (
        "one node" if hosts == 1 else f"{hosts} nodes")
    kind = ("shared" if transport == "one_sided" else None) if hosts == 1 else \
        ("rma" if across[0] else None)
    if hosts > 1 and transport == "auto":
        why = f"{why}, {across[1]}"
    specs = []  # (region, owner, shape, dtype) of this rank's stage
    for entry in plan if kind else ():
        wb = graph.blobs[entry["weights"]]
        if kind == "shared":
            specs.append((shard_region(entry["weights"], group[0]), group[0], tuple(wb.shape),
                          str(wb.dtype)))
            continue
        for i, r in enumerate(group):
            lo, hi = shard_range(wb.size, len(group), i)
            specs.append((shard_region(entry["weights"], r), r, (hi - lo,), str(wb.dtype)))
    # (a stage without parameters gathers nothing: no row of its own)
    form = {"shared": (SHARED[0], SHARED[1].format(who=who)), "rma": GOT}.get(
        kind, GATHERED) if plan else None
    everyone = world.allgather_object((specs, group, form, hosts), "the stage-3 window "
                                      "layout exchange") if live else [(specs, group, form, hosts)]
    # the start-up block names every stage's form, each once (world order)
    stages = {}
    for _, peers, form, n in everyone:
        if form is not None:
            stages.setdefault(tuple(form), {})[tuple(peers)] = n
    lines = [(what, how, f"parallel.transport: {transport}, " + ", ".join(
        f"{who} ranks {list(g)} on {'one node' if n == 1 else f'{n} nodes'}"
        for g, n in groups.items()) + (f", {across[1]}" if transport == "auto" and any(
            n > 1 for n in groups.values()) else ""))
        for (what, how), groups in stages.items()]
    layout = WindowLayout()
    for rank_specs, peers, _, _ in everyone:  # a stage's ranks send the same regions
        for name, owner, shape, dtype in rank_specs:
            if name not in layout.regions:
                layout.add(name, owner, shape, dtype, peers=peers)
    if not layout.regions:  # no stage takes windows (the same on every rank)
        return None, lines if any(n > 1 for *_, n in everyone) else None, None
    windows = None
    if live:
        windows, failed = allocate_or_fall_back(
            world, layout, node_of, lambda exc: [GATHERED + (f"{why}: {exc}",)])
        if windows is None:
            return None, failed, None
    if kind == "shared":
        share_weights(graph, plan, world.rank, group[0], group, others)
    elif kind == "rma":
        get_weights(graph, plan, group.index(world.rank), group, staged=True, others=others)
    return windows, lines, (layout, node_of)


def shard_region(weights, rank):
    """The window region of rank ``rank``'s shard of bucket ``weights`` (with
    stages on one node: the stage's shared region of the bucket, owned by
    its first rank ``rank``)."""
    return f"{PREFIX}{weights}@{rank}"


def get_weights(graph, plan, index, owners, staged=False, others=()):
    """Rewrite stage 3's gathers of ``graph`` (shard ``index`` of the
    shards owned by the world ranks ``owners``, in shard order) into
    GetShards from the owners' RMA windows, between a bucket's two
    WindowSyncs (see the module docstring; ``staged``: barriers on the
    owners' sub-communicator); renumber the collectives' ``seq`` (among
    ``others``: ``sequence_collectives``; the GetShards after them). Each
    plan entry gets ``windows`` (its regions,
    shard by shard), ``gets`` (the GetShards, by pass) and ``gathers``
    {"acquire", "release"}."""
    group = list(owners) if staged else None
    for entry in plan:
        weights, own = entry["weights"], entry["weight_shard"]
        regions = [shard_region(weights, r) for r in owners]
        ob = graph.blobs[own]  # the shard lives in the window; its views view it
        ob.attrs = dict(ob.attrs, window=regions[index], window_views=True)
        gets = entry["gathers"]
        first = graph.ops[next(iter(gets.values()))]
        acquire, release = _window_syncs(graph, weights, regions[index], first.location,
                                         first.thread, group)
        for name in gets.values():
            op = graph.ops[name]
            op.op_type = "GetShards"
            op.attrs = dict({k: v for k, v in op.attrs.items() if k not in ("seq", "group")},
                            region=regions[index], regions=regions, peer=-1)
            op.control_inputs.append(acquire.name)
        release.control_inputs = [acquire.name] + list(gets.values())
        rooted = {n for n in graph.blobs if graph.storage_root(n) == own}
        for op in graph.ops.values():
            if rooted.intersection(op.outputs):  # the updates of the shard
                op.control_inputs.append(release.name)
        entry["gathers"] = {"acquire": acquire.name, "release": release.name}
        entry["gets"], entry["windows"] = dict(gets), regions
    graph.topo_order()  # no cycle
    sequence_collectives(graph, plan, others)
    seq = 1 + max(op.attrs["seq"] for op in graph.ops.values()
                  if "seq" in op.attrs and op.op_type != "GetShards")
    for entry in plan:
        for name in entry["gets"].values():
            graph.ops[name].attrs["seq"] = seq
            seq += 1
    return plan


def _window_syncs(graph, weights, region, location, thread, group=None):
    """A bucket's two WindowSync ops on ``region`` (see the module
    docstring): (``acquire``, ``release``), no edges yet; ``group``: their
    barriers on that sub-communicator (a stage's ranks)."""
    common = {"window": region, "bucket": weights}
    if group is not None:
        common["group"] = list(group)
    return tuple(graph.add_op(graph.free_name(f"{weights}.{phase}"), "WindowSync", [], [],
                              dict(common, phase=phase), location=location, thread=thread)
                 for phase in ("acquire", "release"))


def share_weights(graph, plan, rank, owner, group=None, others=()):
    """Rewrite stage 3's gathers of ``graph`` (rank ``rank``'s) for the
    shared window of ``owner`` (see the module docstring; ``group``: a
    stage's ranks, the region named by its owner, the barriers on their
    sub-communicator); renumber the collectives' ``seq`` (among
    ``others``: ``sequence_collectives``). Each plan entry
    gets ``window`` (its region) and ``gathers`` {"acquire", "release"}.
    A tensor shard's row-split fc that adds no bias reads it as shard 0's
    does (``sharding.shard0_bias_readers``): the same WindowSyncs on every
    rank, in the same order."""
    biases = shard0_bias_readers(graph)
    for entry in plan:
        weights, own = entry["weights"], entry["weight_shard"]
        region = PREFIX + weights if group is None else shard_region(weights, owner)
        wb = graph.blobs[weights]
        attrs = {k: v for k, v in wb.attrs.items() if k != WORKING_SET_ATTR}
        # the region is the buffer; its views (the weights) view it; the
        # rank holds its bytes only where its segment holds them
        wb.attrs = dict(attrs, window=region, window_views=True,
                        window_held=int(wb.nbytes) if rank == owner else 0)
        ob = graph.blobs[own]
        ob.alias_of, ob.offset = weights, int(entry["shard"][0])
        old = entry["gathers"]
        thread = graph.ops[next(iter(old.values()))].thread if old else \
            graph.ops[entry["reduce_scatter"]].thread
        back = graph.ops[old["backward"]].outputs[0] if "backward" in old else None
        if back is not None:  # the backward readers' views: of the window too
            for b in graph.blobs.values():
                if b.alias_of == back:
                    b.alias_of = weights
        for name in old.values():
            del graph.ops[name]
        if back is not None:
            del graph.blobs[back]
        rooted = {n for n in graph.blobs if graph.storage_root(n) == weights}
        writers = [op for op in graph.ops.values() if rooted.intersection(op.outputs)]
        nominal = {op.name for b in rooted for op in biases.get(b, ())}
        readers = [op for op in graph.ops.values() if op not in writers
                   and (rooted.intersection(op.inputs) or op.name in nominal)]
        for op in graph.ops.values():
            op.control_inputs = [c for c in op.control_inputs if c not in old.values()]
        acquire, release = _window_syncs(graph, weights, region, wb.location, thread, group)
        release.control_inputs = [acquire.name] + [op.name for op in readers]
        for op in readers:
            op.control_inputs.append(acquire.name)
        for op in writers:
            op.control_inputs.append(release.name)
        entry["gathers"] = {"acquire": acquire.name, "release": release.name}
        entry["window"] = region
    graph.topo_order()  # no cycle
    sequence_collectives(graph, plan, others)
    return plan
