"""``plan JOB.yaml --np N``: every byte each rank will hold, before launch,
and whether it fits; ``train``'s start-up check (``check_memory``) is the
same figure for its own rank, made before the workspaces are allocated.

Each rank's graphs are built as the trainer builds them
(``parallel.rank_graphs.build_rank_graphs``) for an offline world (no MPI,
as ``graph --np N --rank R``), laid out by the trainer's memory plans, and
counted by ``runtime/footprint.py``. Only the ranks of the first two
replicas are built (at any count of ranks; before, every rank up to 8: the
8 data-parallel ranks of gpt2_124m built 8 alike graphs): the other
replicas hold what the second one holds (same stages, same tensor shards, same buckets); under
ZeRO (scheme sharded), whose shards of a bucket differ in size where it
does not divide by the ranks, a rank whose shards are cut as no rank built
is cut is built too (``_alike``).

The memory a rank may use: ``--host-memory`` (each rank's) /
``--device-memory`` when given, and the GPU's total memory when the rank
has one. The host is checked per node: the host needs of the ranks that
share a node, summed, against ``--node-memory``, else (without
``--host-memory``) the node's ``MemAvailable`` (/proc/meminfo) at the
time (``node_checks``). ``plan`` places the ranks in blocks (node i holds
ranks i*K .. i*K+K-1, mpiexec's and SLURM's default placement);
``train`` groups them by the host table its world gathered.
"""
import dataclasses
import os

import numpy as np

from ..base.errors import MemoryTooSmall, UserError
from ..base.progress_bar import human_bytes, parse_size
from ..comm.mpi_transport import transport_bytes, transport_note
from ..runtime.footprint import LABELS  # row labels as printed (train's start-up block's too)


def parse_bytes(text, option):
    """``80GiB``, ``512MiB``, ``24G`` (binary), ``16GB`` (decimal), ``1000``
    (bytes): a byte count; a UserError naming ``option`` otherwise."""
    nbytes = parse_size(text)
    if nbytes is None:
        raise UserError(f"{option} {text}: expected a size of at least one byte such as 80GiB, "
                        "512MiB or 24G "
                        "(KiB/MiB/GiB/TiB or K/M/G/T: powers of 1024; KB/MB/GB/TB: of 1000)")
    return nbytes


@dataclasses.dataclass
class MemoryLimits:
    """What ``train`` checks its rank against (``--host-memory``,
    ``--device-memory``: bytes, None: the machine's); ``check`` False:
    ``--no-memory-check``; ``ranks_per_node``: ``plan --ranks-per-node``
    (None: ``node_ranks``' default); ``node``: ``--node-memory``, what the
    ranks of a node may hold together (None: the node's MemAvailable,
    unless ``host`` is given)."""

    host: object = None
    device: object = None
    check: bool = True
    ranks_per_node: object = None
    node: object = None


def node_ranks(limits, size):
    """(the ranks of a ``size``-rank job that share a node, what says so)
    for ``plan``, whose ranks share the node's MemAvailable:
    ``--ranks-per-node``, else the launcher's count of the ranks on this
    node (base/threads.LOCAL_SIZE_VARS: SLURM_NTASKS_PER_NODE in an
    allocation, ...), else all of them; at most ``size``."""
    from ..base.threads import ranks_on_this_host
    if limits is not None and limits.ranks_per_node is not None:
        return min(limits.ranks_per_node, size), "--ranks-per-node"
    n, var = ranks_on_this_host()
    if var is not None:
        return min(n, size), var
    return size, None


def host_ranks(limits, size, rank, per_node=None):
    """The ranks of a ``size``-rank job that share ``rank``'s node, the
    ranks placed in blocks of ``node_ranks`` (``block_nodes``: the last
    node the rest): what the launcher tells that rank in the run
    (base/threads.LOCAL_SIZE_VARS), and so the ranks its thread count is
    shared among (base/threads.decide). ``per_node``: ``node_ranks``'
    count, where the caller has it (it reads the environment)."""
    if per_node is None:
        per_node = node_ranks(limits, size)[0]
    return min(per_node, size - rank // per_node * per_node)


def mem_available():
    """Bytes of /proc/meminfo's MemAvailable (the free memory a new process
    can take without swapping), else the free pages; None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_total(device):
    """The total memory of GPU ``device``, None without CuPy or a GPU."""
    from ..base.backend import cupy_available
    if device < 0 or not cupy_available():
        return None
    import cupy
    return int(cupy.cuda.runtime.getDeviceProperties(int(device))["totalGlobalMem"])


def limits_for(limits, devices):
    """[(where, device, bytes, why)]: the memory each part of a rank may
    use on its own (``devices``: the GPUs the rank has blobs on): the host
    only with ``--host-memory`` (else the host is checked per node:
    ``node_checks``), each GPU."""
    out = []
    if limits.host is not None:
        out.append(("host", -1, limits.host, "--host-memory"))
    for d in devices:
        if limits.device is not None:
            out.append((f"GPU {d}", d, limits.device, "--device-memory"))
        else:
            total = device_total(d)
            if total is not None:
                out.append((f"GPU {d}", d, total, "the GPU's total memory"))
    return out


def block_nodes(size, per_node):
    """The ranks of each node when ``per_node`` share one, placed in
    blocks: node i holds ranks i*K .. i*K+K-1 (``mpiexec -ppn K``'s and
    SLURM's block distribution), the last node the rest."""
    per_node = max(int(per_node), 1)
    return [list(range(s, min(s + per_node, size))) for s in range(0, size, per_node)]


def node_checks(needs, nodes, limits, avail, held=None, placed=None):
    """[{"node", "ranks", "need_bytes", "limit_bytes", "limit_from",
    "fits"}] of each node: the host needs of its ranks (``needs``: rank ->
    bytes) summed, against ``--node-memory``, else (without
    ``--host-memory``) the node's MemAvailable (``avail``: node -> bytes,
    None unknown) plus the bytes its ranks hold already (``held``: rank ->
    bytes, the checkpoint a resume read: MemAvailable no longer has them);
    [] where there is no figure. ``placed``: how the ranks were placed, said
    in ``limit_from``."""
    if limits.node is None and (limits.host is not None or avail is None):
        return []
    out = []
    for i, ranks in enumerate(nodes):
        need = sum(needs[r] for r in ranks)
        if limits.node is not None:
            limit, why = limits.node, "--node-memory"
        else:
            a = avail[i]
            if a is None:
                continue
            kept = sum((held or {}).get(r, 0) for r in ranks)
            limit = a + kept
            why = "MemAvailable" + (f", {placed}" if placed else "") + \
                (f" + the {human_bytes(kept)} " + ("it holds" if len(ranks) == 1 else
                                                   "its ranks hold") + " already"
                 if kept else "")
        out.append({"node": i, "ranks": list(ranks), "need_bytes": int(need),
                    "limit_bytes": int(limit), "limit_from": why, "fits": need <= limit})
    return out


def plan_node_checks(fps, like, size, limits):
    """``node_checks`` for ``plan`` (``fps``, ``like``:
    ``offline_footprints``' and ``ranks_to_build``'s): the ranks placed in
    blocks of ``node_ranks``, each node checked against this host's
    MemAvailable (the node plan runs on stands for each)."""
    per_node, source = node_ranks(limits, size)
    totals = {r: fp.host_total for r, fp in fps.items()}  # each footprint once
    needs = {r: totals[like.get(r, r)] for r in range(size)}
    nodes = block_nodes(size, per_node)
    avail = mem_available()
    placed = (f"{per_node} ranks a node, from {source}" if source else
              f"all {size} ranks on one node" if size > 1 else "")
    return node_checks(needs, nodes, limits, None if avail is None else [avail] * len(nodes),
                       placed=placed)


#: the most ranks ``plan --np N`` takes (2**20). Its answer names every
#: rank and node (the JSON's rank and node lists, a line per node), so its
#: time and memory grow with N however alike the ranks are: on a small job
#: --np 1048576 takes ~1.4 s of CPU and ~330 MB, --np 10000000 took 41.6 s
#: and 2.2 GB, 1e8 ran past 60 s; more is refused with one line (exit 2)
MAX_PLAN_RANKS = 1 << 20


#: what ``node_refusal`` says would make a node fit (``plan`` prints it
#: under a node that does not)
NODE_ADVICE = "fewer ranks a node, a smaller batch or more pipeline stages would need less"


def node_refusal(check, needs, name=None):
    """The one line a node whose ranks' host needs outgrow its memory is
    refused with (``needs``: rank -> bytes; ``name``: its host name)."""
    from ..parallel.schemes.base import ranges
    ranks = check["ranks"]
    where = f"node {check['node']}" + (f" ({name})" if name else "")
    over = (f"more than the {human_bytes(check['limit_bytes'])} the node has "
            f"({check['limit_from']})")
    if len(ranks) == 1:
        return (f"{where}: rank {ranks[0]} needs {human_bytes(check['need_bytes'])} of host "
                f"memory, {over}; a smaller batch or more pipeline stages would need less; "
                "or skip the check with --no-memory-check")
    each = ", ".join(f"rank {r} {human_bytes(needs[r])}" for r in ranks)
    return (f"{where}: its ranks {ranges(ranks)} need {human_bytes(check['need_bytes'])} "
            f"of host memory together ({each}), {over}; {NODE_ADVICE}; "
            "or skip the check with --no-memory-check")


def need_of(fp, device):
    return fp.host_total if device < 0 else fp.device_total(device)


def set_transport(fp, local_ranks):
    """``fp``'s "MPI transport buffers" row: MPI's shared-memory cells of the
    other ``local_ranks - 1`` ranks of its node that it reads
    (comm/mpi_transport.py), and the note of what it stands on."""
    fp.host["mpi_transport"] = transport_bytes(local_ranks)
    note = transport_note(local_ranks)
    if note is not None and note not in fp.notes:
        fp.notes.append(note)


def _transport_of(fp):
    """The bytes of ``fp``'s MPI transport buffers row (0 without one)."""
    return int(fp.host.get("mpi_transport", 0))


def set_transports(fps, size, limits):
    """``set_transport`` on ``plan``'s footprints ({rank: footprint}): the
    ranks placed in blocks of ``node_ranks`` (a footprint that stands for
    other ranks too, ``ranks_to_build``, takes its own rank's node)."""
    for r, fp in fps.items():
        set_transport(fp, host_ranks(limits, size, r))


# ------------------------------------------------------------------ graphs
def offline_footprint(job, size, rank, everyone=None, restore=None, limits=None):
    """The footprint of ``rank`` of ``size``, built without MPI;
    ``everyone``: the ranks' ``save_meta`` (``save_metas``) its checkpoint
    save's bytes are figured from (None: ``save_metas`` builds them);
    ``restore``: ``load_bytes``' init and resume ({}: a fresh start);
    ``limits``: the ``MemoryLimits`` whose ``ranks_per_node`` places the
    ranks on nodes (``_as_placed``)."""
    with _as_placed(limits, size, rank):
        graphs = _offline_graphs(job, size, rank)
        if everyone is None:
            everyone = save_metas(job, size, {rank: graphs})
        return _footprint_of(job, graphs, rank, everyone, restore)


def _as_placed(limits, size, rank):
    """The block in which ``rank`` of ``size`` is built and counted as one
    of the ``host_ranks`` of its node: the host products' scratch
    (ops/hostgemm.planned_threads) at the threads the run gives each of
    them (base/threads.decide over those ranks, as under mpiexec), not at
    those of one process alone on the host (``plan`` runs outside
    mpiexec: no launcher's count of the ranks; before, ``--np 2`` on 2
    cores counted 2 threads, a K-cut product's pieces after the first one
    matrix each, where each rank runs 1 thread and keeps one matrix)."""
    from ..ops.hostgemm import planned_for
    return planned_for(host_ranks(limits, size, rank))


def offline_footprints(job, size, ranks, restore=None, built=None, limits=None):
    """({rank: footprint} of ``ranks`` of ``size`` (``offline_footprint``),
    every rank's part of a save (``save_metas``) their save's bytes come from).
    ``built``: a dict that takes each rank's (graphs, their memory plans:
    ``runtime/footprint.workspace_plans``; None for a parameter server)
    (``plan --choose`` predicts from them: ``predictable_graph``);
    ``limits``: as ``offline_footprint``'s."""
    graphs = {}
    for r in ranks:
        with _as_placed(limits, size, r):
            graphs[r] = _offline_graphs(job, size, r)
    everyone = save_metas(job, size, graphs)
    plans = {}
    fps = {}
    for r, g in graphs.items():
        with _as_placed(limits, size, r):
            fps[r] = _footprint_of(job, g, r, everyone, restore, plans)
    if built is not None:
        built.update({r: (g, plans.get(r)) for r, g in graphs.items()})
    return fps, everyone


def predictable_graph(job, size, graphs, plans):
    """The training graph of ``graphs`` (a rank's ``_offline_graphs``, laid
    out by ``plans``: its ``workspace_plans``) made the graph ``tools/graph.
    compose_for`` composes for that rank, so the scaling predictor may read
    it instead of composing it again (``plan --choose``): the control
    edges the memory plans added (``MemoryPlan.edges``, each appended to
    its op's ``control_inputs``) taken out again, in place: the footprint
    is counted, and the graph is no longer the one they planned. None where
    the two are built apart: a parameter-server rank (``compose_for_rank``),
    a complete ``graph:`` (partitioned over the ranks there), a GPU job
    (``compose_for`` places and fuses it without a device), a backend other
    than MPI (NCCL rewrites the buckets). Otherwise both are the scheme's
    composition of the same replica graph, laid out by the same micro-batch
    memory plan (tests/test_choose.py compares them op by op, blob by blob)."""
    if is_server(graphs) or plans is None or (size > 1 and job.parallel.servers) \
            or job.graph is not None or job.device >= 0 \
            or getattr(graphs, "device", -1) >= 0 \
            or getattr(graphs, "comm_backend", None) not in (None, "mpi"):
        return None
    graph = graphs.graph
    for plan in (plans.host, *(plans.devices or {}).values()):
        for a, dst in (plan.edges if plan is not None else ()):
            graph.ops[dst].control_inputs.remove(a)
    return graph


def _offline_graphs(job, size, rank):
    from ..parallel.rank_graphs import build_rank_graphs
    from .graph import _OfflineWorld
    offline = job.replace(parallel=dataclasses.replace(job.parallel, check_collectives=False))
    world = _OfflineWorld(rank, size)
    if size > 1 and job.parallel.servers:
        return _server_mode_rank(offline, world)
    return build_rank_graphs(offline, world, check_memory=False)


def _server_mode_rank(job, world):
    """A parameter-server rank as ``train`` builds it (trainer.run_param_server):
    a worker's graphs over the workers' world with the worker's scheme, a
    server's ``ServerRank`` (train/ps_server.py)."""
    from ..parallel.param_server import WorkerScheme, ps_layout, synchronous_if_no_staleness
    from ..parallel.rank_graphs import build_rank_graphs
    from ..train.ps_server import ServerRank
    from .graph import _OfflineWorld
    job = synchronous_if_no_staleness(job)
    workers = ps_layout(world.size, job.parallel.ps_ranks, job.path)["workers"]
    if world.rank not in workers:
        return ServerRank(job, world)
    return build_rank_graphs(job, _OfflineWorld(world.rank, len(workers)),
                             WorkerScheme(job, world), check_memory=False)


def _footprint_of(job, graphs, rank, everyone, restore=None, plans=None):
    """``plans``: a dict that takes the rank's memory plans (``workspace_plans``)."""
    from ..runtime.footprint import footprint, workspace_plans
    if is_server(graphs):
        fp = graphs.footprint()
    else:
        laid = workspace_plans(graphs, job.memory_plan)
        if plans is not None:
            plans[rank] = laid
        fp = footprint(graphs, laid, rank,
                       cuda_graph=job.cuda_graph, save=save_bytes(job, graphs, everyone),
                       held=held_bytes(job, graphs))
    set_load(fp, job, graphs, **(restore or {}))
    return fp


# ------------------------------------------------------- the start-up load
def load_bytes(job, graphs, fp, init=None, resume=None):
    """The host bytes the weights' start-up fill and load hold beyond the
    rows written by then (runtime/footprint.STARTUP_ROWS), at their most
    (``Footprint.load``; train/checkpoints.restore; a parameter server's
    apart, ``set_load``): ``resume``'s arrays (read before the graphs are built
    and held until the weights are set) and the largest of the first fill
    of the largest parameter (``fill_bytes``), ``init``'s weights
    (``init_bytes``) and, on a resume, the optimizer state it sets (``fp``'s
    row: untouched zeros until then). ``resume``: the Checkpoint read
    (``train``), True for a checkpoint of this job (``plan --resume``:
    ``own_checkpoint_bytes``) or None; ``init``: an ``--init`` weights file
    or None."""
    held = resume_bytes(job, graphs, resume)
    state = fp.host.get("optimizer_state", 0) if resume is not None else 0
    return held + max(fill_bytes(graphs.graph, graphs.params),
                      init_bytes(init, job) if init else 0, state)


def resume_bytes(job, graphs, resume):
    """The bytes of ``resume``'s arrays (``load_bytes``)."""
    if resume is True:
        return own_checkpoint_bytes(job, graphs)
    return arrays_nbytes(resume) if resume is not None else 0


def set_load(fp, job, graphs, init=None, resume=None):
    """Set ``fp``'s start-up load (``load_bytes``). A parameter server
    (train/ps_server.run_server) reads ``resume`` and ``init`` whole once
    its windows are allocated, before its other arrays: their bytes on the
    windows alone (``Footprint.load_rows``); its first fill and the
    optimizer state a resume sets once its arrays are (``Footprint.fill``,
    on ``STARTUP_ROWS``). Before, the files' bytes were counted on every
    start-up row: an async server loading 146 MiB, 236 MiB planned, 160
    measured (tests/test_plan_rss.py)."""
    if not is_server(graphs):
        fp.load = load_bytes(job, graphs, fp, init, resume)
        return
    fp.load = resume_bytes(job, graphs, resume) + (init_bytes(init, job) if init else 0)
    fp.load_rows = ("windows",)
    state = fp.host.get("optimizer_state", 0) if resume is not None else 0
    fp.fill = max(fill_bytes(graphs.graph, graphs.owned), state)


def fill_bytes(graph, params):
    """What the first fill of ``params`` (layers/fillers.fill, one at a
    time) holds at its most: the largest parameter's whole value drawn in
    float64 and its cast to the blob's dtype (a tensor shard's whole
    parameter is drawn, then sliced: parallel/tensor_parallel.initial_value)."""
    from ..parallel.tensor_split import split_of
    most = 0
    for p in params:
        blob = graph.blobs[p]
        split = split_of(blob)
        n = int(np.prod(split["shape"] if split else blob.shape, dtype=np.int64))
        most = max(most, n * (8 + np.dtype(blob.dtype).itemsize))
    return most


def own_checkpoint_bytes(job, graphs):
    """The arrays a checkpoint of this job holds, as ``--resume`` reads
    them whole on every rank (job/checkpoint_file.load_checkpoint): every
    parameter of the net and each of its solver states (the parameter's
    dtype: graph/solver_graph.py) -- the trained ones': running statistics
    and frozen parameters (``param_counts``' rest) have no solver state."""
    from ..graph.solver_graph import solver_states
    from ..parallel.rank_graphs import param_counts
    trained, rest = param_counts(graphs.graph) if is_server(graphs) else graphs.param_counts
    return trained[1] * (1 + len(solver_states(job.solver.type))) + rest[1]


def arrays_nbytes(value):
    """The bytes of the arrays in a Checkpoint's sections or a nested dict."""
    if hasattr(value, "params") and hasattr(value, "solver"):
        return sum(arrays_nbytes(v) for v in (value.params, value.solver, value.state))
    if isinstance(value, dict):
        return sum(arrays_nbytes(v) for v in value.values())
    return int(value.nbytes) if isinstance(value, (np.ndarray, np.generic)) else 0


def init_bytes(init, job):
    """The bytes loading ``--init``'s weights holds at its most: an HDF5
    file's ``/params`` datasets (read whole: job/checkpoint_file.load_params);
    a .caffemodel read whole and every blob in it as a float32 array
    (interop/caffemodel.caffemodel_nbytes); a .safetensors file's arrays
    with its mapped pages, or the copies ``job``'s GPT-2 layout makes of them
    (interop/hf_gpt2.hf_load_nbytes)."""
    if str(init).endswith(".caffemodel"):
        from ..interop.caffemodel import caffemodel_nbytes
        return caffemodel_nbytes(init)
    if str(init).endswith(".safetensors"):
        from ..interop.hf_gpt2 import hf_load_nbytes
        return hf_load_nbytes(init, job)
    from ..job.checkpoint_file import params_nbytes
    return params_nbytes(init)


def is_server(graphs):
    """Whether ``graphs`` is a parameter server's rank (a ``ServerRank``,
    train/ps_server.py: it counts its own footprint), not a RankGraphs."""
    return hasattr(graphs, "server_graph")


def save_metas(job, size, built):
    """{rank: its part of a save} (``Scheme.save_meta``) for every rank of
    ``size``: those of ``built`` ({rank: graphs}), the others built here
    when their part is needed (``Scheme.save_ranks``: those whose parts
    rank 0's figure reads, replica 0's; scheme sharded's with stages or
    tensor shards, every rank's), else taken from the rank of
    ``ranks_to_build`` they are like."""
    from ..parallel.schemes import scheme_of
    built = {r: g for r, g in built.items() if not is_server(g)}  # a server writes nothing
    scheme = scheme_of(job)
    first = next(iter(built.values()))
    metas = {r: scheme.save_meta(g) for r, g in built.items()}
    if not scheme.gathers_checkpoint(first):  # each rank's figure is its own
        return metas
    per = first.layout.stages * first.layout.tensor  # the ranks of one replica
    for r in scheme.save_ranks(first):
        if r not in metas:
            metas[r] = scheme.save_meta(_offline_graphs(job, size, r))
    _, like = _alike(job, size)   # a part of a save does not depend on the node
    for r in range(size):
        if r not in metas:
            src = like.get(r, per + r % per)
            if src not in metas:
                metas[src] = scheme.save_meta(_offline_graphs(job, size, src))
            metas[r] = metas[src]
    return metas


def _scheme_of(job, graphs):
    """The scheme that built ``graphs``: a parameter-server worker's where
    they carry the servers' plan (also under scheme none, whose class
    counts no server state: ``run_scheme_of``), else the job's."""
    from ..parallel.schemes import run_scheme_of
    served = getattr(graphs.composition, "server_plan", None) is not None
    return run_scheme_of(job, 2 if served else 1)


def save_bytes(job, graphs, everyone):
    """The host bytes this rank's checkpoint save adds (``Scheme.save_bytes``;
    a parameter server's rank counts its own: ``ServerRank.footprint``)."""
    if getattr(graphs, "layout", None) is None or not everyone:
        return 0
    return _scheme_of(job, graphs).save_bytes(graphs, everyone)


def held_bytes(job, graphs):
    """The host bytes this rank's loop services keep (``Scheme.held_bytes``)."""
    if getattr(graphs, "layout", None) is None:
        return 0
    return _scheme_of(job, graphs).held_bytes(graphs)


def ranks_to_build(job, size, limits=None):
    """The ranks ``plan`` builds, and {rank not built: the rank it is like}:
    the ranks alike by their place in the job (``_alike``) and on nodes of
    as many ranks (``limits``' placement, ``host_ranks``: the threads a
    rank's host products get, and so their K-cut scratch, and its MPI
    transport row depend on them). A rank on a node of another count than
    the rank it would be like (the last node, which holds the rest) is
    built once for that rank and that count; before, ``plan --np 9
    --ranks-per-node 2`` on 2 cores gave rank 8, alone on its node at 2
    threads, rank 1's 1-thread scratch: 65536 bytes for 458752."""
    built, like = _alike(job, size)
    per_node = node_ranks(limits, size)[0]
    count = {r: host_ranks(limits, size, r, per_node) for r in set(like) | set(like.values())}
    placed, first = {}, {}
    for r in sorted(like):
        src = like[r]
        if count[r] == count[src]:
            placed[r] = src
        elif (src, count[r]) in first:
            placed[r] = first[(src, count[r])]
        else:
            first[(src, count[r])] = r
    return built + sorted(first.values()), placed


def _alike(job, size):
    """The ranks ``plan`` builds, and {rank not built: the rank it is like},
    by their place in the job alone (``ranks_to_build`` adds their nodes):
    the ranks of the first two replicas (a replica's ranks: its stages x
    tensor shards; before, the larger of the two, so with both a rank was
    taken as like a rank of another stage), each other rank like the rank
    at its place in the second. Under ZeRO (scheme sharded) a rank is like
    it only where their shards are cut alike (``_zero_alike``)."""
    if size > 1 and job.parallel.servers:  # two workers (the others hold what rank 1 holds), every server
        from ..parallel.param_server import ps_layout
        lay = ps_layout(size, job.parallel.ps_ranks, job.path)
        built = lay["workers"][:2] + lay["servers"]
        return built, {r: 1 for r in lay["workers"][2:]}
    from ..parallel.compose import layout_of
    from ..parallel.schemes import scheme_of
    from .graph import _OfflineWorld
    lay = layout_of(job, _OfflineWorld(0, size))
    per = max(lay.stages * lay.tensor, 1)  # the ranks of one replica
    built = list(range(min(size, 2 * per)))
    like = {r: per + r % per for r in range(len(built), size)}
    if scheme_of(job).shards_state and like:
        return _zero_alike(job, size, per, built, like)
    return built, like


#: ``_zero_alike``'s answers, the last few jobs' ((job, size), answer):
#: ``_alike`` is asked several times of one job (``ranks_to_build``,
#: ``save_metas``, ``run_plan``'s last line), each answer a graph build
_ZERO_ALIKE = []


def _zero_alike(job, size, per, built, like):
    """``_alike`` under ZeRO: a shard is ``comm.ops.shard_range``'s
    ``[r*c, min(n, (r+1)*c))``, ``c = ceil(n/N)``, so where a bucket's n does
    not divide by the N replicas the last ones hold less of it or none,
    and their rows differ (optimizer state, stage 2's gradients, stage 3's
    weights, and what the memory plan colours around them: on 9 ranks of
    tests/test_plan_zero_uneven.py's net rank 7's kept blobs 32 bytes,
    rank 1's 16). A rank is like the first rank at its place in the
    replica (stage and tensor shard) whose shards are cut alike: in each
    bucket the same size, and the same size of each parameter's piece of
    it (``_cut_of``: which update ops the rank has, and on how much); a
    rank like none built is built. The buckets of each place read from
    the graphs of replica 0's rank there: ``per`` more builds, where
    building every rank cost one per rank (gpt_small, 64 ranks: 6
    distinct cuts)."""
    for (j, n), answer in _ZERO_ALIKE:
        if j is job and n == size:
            return list(answer[0]), dict(answer[1])
    buckets = {q: _buckets_of(_offline_graphs(job, size, q)) for q in range(per)}
    replicas = size // per
    first = {}  # (place, cut) -> the first rank with it, of the second replica on
    for r in built[per:]:
        first.setdefault((r % per, _cut_of(buckets[r % per], replicas, r // per)), r)
    built, like = list(built), {}
    for r in range(len(built), size):
        key = (r % per, _cut_of(buckets[r % per], replicas, r // per))
        if key in first:
            like[r] = first[key]
        else:
            first[key] = r
            built.append(r)
    _ZERO_ALIKE[:] = _ZERO_ALIKE[-3:] + [((job, size), (built, like))]
    return list(built), dict(like)


def _buckets_of(graphs):
    """[(n, [(offset, size) of each parameter])] of each ZeRO bucket of a
    rank's ``graphs`` (its shard plan, ``parallel/sharding.compose_zero1``:
    the same at every replica of its place)."""
    blobs = graphs.graph.blobs
    plan = getattr(getattr(graphs, "composition", None), "shard_plan", None) or []
    return [(int(blobs[e["weights"]].size),
             tuple((int(o), int(blobs[p].size)) for p, o in zip(e["params"], e["offsets"])))
            for e in plan]


def _cut_of(buckets, replicas, replica):
    """How replica ``replica`` of ``replicas`` cuts ``buckets``
    (``_buckets_of``): per bucket its shard's size and the size of each
    parameter's piece of the shard."""
    from ..comm.ops import shard_range
    out = []
    for n, spans in buckets:
        lo, hi = shard_range(n, replicas, replica)
        out.append((hi - lo, tuple(max(0, min(hi, o + k) - max(lo, o)) for o, k in spans)))
    return tuple(out)


# ------------------------------------------------------------- suggestions
def _with_batch(job, batch):
    train = dataclasses.replace(job.data.train, batch_size=int(batch))
    return job.replace(data=dataclasses.replace(job.data, train=train))


def fitting_batch(job, size, rank, device, limit, need, everyone=None, restore=None,
                  limits=None, seen=None, transport=0):
    """The largest ``data.train.batch_size`` (a multiple of the
    micro-batches) under which ``rank`` needs at most ``limit`` bytes on
    ``device`` (-1: the host), from the footprints at two batch sizes (the
    bytes grow with the batch by a constant per sample), checked by
    building it; None when even the smallest does not fit. At most four
    builds. ``everyone``: the ranks' parts of a save (``save_metas``: the
    batch does not change them); ``restore``: the start-up load's and
    ``limits`` the ranks' nodes (``offline_footprint``); ``seen``: a dict
    that receives the smaller batch built first and its footprint
    (``batch``, ``fp``), for ``advice`` to say what does not shrink;
    ``transport``: the bytes of the MPI transport buffers row of the
    footprint ``need`` is of (``set_transport``: the node's ranks, not the
    batch, decide it), counted in each footprint built here as in that one
    (before, left out: ``need`` less the built one's need was that row
    too, and the bytes said at the smaller batch were that row short of
    what ``plan --json`` says at that batch)."""
    b0 = job.train_batch
    m = job.parallel.micro_batches
    if b0 is None or b0 <= m:
        return None

    def need_at(batch):
        fp = offline_footprint(_with_batch(job, batch), size, rank, everyone, restore, limits)
        if transport:
            fp.host["mpi_transport"] = transport
        return fp, need_of(fp, device)
    b1 = max(m, b0 // 2 // m * m)
    fp1, n1 = need_at(b1)
    if seen is not None:
        seen.update(batch=b1, fp=fp1)
    per = (need - n1) / (b0 - b1)
    if n1 <= limit and per <= 0:
        return b1
    if per <= 0:
        return None
    b = min(int((limit - (n1 - per * b1)) // per) // m * m, b0 - m)
    # b1, built and known to fit, is the answer once the tries reach it
    # (the bytes are not linear in the batch everywhere: a smaller try that
    # fits is not the largest, and none fitting does not mean b1 does not)
    fallback = b1 if n1 <= limit else None
    for _ in range(3):
        if b < m or (fallback is not None and b <= b1):
            return fallback
        if need_at(b)[1] <= limit:
            return b
        b = b * 3 // 4 // m * m
    return fallback


def advice(job, size, rank, device, limit, need, everyone=None, restore=None, limits=None,
           transport=0):
    """What would make ``rank`` fit, in words (``limits``, ``transport``:
    ``fitting_batch``'s)."""
    if size > 1 and job.parallel.servers:
        from ..parallel.param_server import ps_layout
        servers = ps_layout(size, job.parallel.ps_ranks, job.path)["servers"]
        if rank in servers:
            return (f"rank {rank} is a parameter server: more servers (parallel.ps_ranks, "
                    "more ranks) split the parameters further; the batch does not change "
                    "what it holds")
    parts = []
    seen = {}
    b = fitting_batch(job, size, rank, device, limit, need, everyone, restore, limits, seen,
                      transport)
    if b is not None:
        parts.append(f"data.train.batch_size {b} would fit (--set data.train.batch_size={b})")
    elif seen:  # what the rank still needs at the smaller batch: what does not shrink
        small = seen["fp"]
        rows = small.rows_text(device).split(", ")
        parts.append(f"no smaller data.train.batch_size fits: at batch {seen['batch']} it "
                     f"still needs {human_bytes(need_of(small, device))} "
                     f"({', '.join(rows[:3])}{', ...' if len(rows) > 3 else ''})")
    elif job.train_batch is not None:
        parts.append(f"no smaller data.train.batch_size fits: {job.train_batch} is the "
                     "smallest (one sample per micro-batch)")
    from ..parallel.compose import layout_of
    from .graph import _OfflineWorld
    lay = layout_of(job, _OfflineWorld(rank, size))
    if lay.staged:
        parts.append("more pipeline stages (parallel.stages, more ranks) split the layers "
                     "further")
    elif lay.tensor > 1:
        parts.append("a wider tensor-parallel group (parallel.tensor) splits the layers "
                     "further")
    else:
        parts.append("more data-parallel ranks would not help (each holds the whole model "
                     "and its own batch): a pipeline (parallel.scheme: pipeline) splits the "
                     "layers")
    return "; ".join(parts)


def over(fp, limits):
    """[(where, device, need, limit, why)] of the parts of ``fp`` that do not
    fit on their own (``limits_for``)."""
    out = []
    for where, d, limit, why in limits_for(limits, sorted(fp.devices)):
        need = need_of(fp, d)
        if need > limit:
            out.append((where, d, need, limit, why))
    return out


def refusal(job, fp, size, problem, offline_rank=None, everyone=None, restore=None):
    """The one line ``train`` (and ``plan --check``) refuses a job with."""
    where, device, need, limit, why = problem
    text = (f"rank {fp.rank} needs {human_bytes(need)} of {where} memory "
            f"({fp.rows_text(device)}), more "
            f"than the {human_bytes(limit)} it has ({why})")
    if fp.peak is not None:
        p = fp.peak
        text += (f"; its transient blobs peak at {human_bytes(p['live_bytes'])} at op "
                 f"'{p['op']}' ({p['position'] + 1} of {p['ops']} in the schedule)")
    rank = fp.rank if offline_rank is None else offline_rank
    if fp.save and device < 0 and fp.save_total > fp.loop_total:
        text += (f"; its checkpoint save holds {human_bytes(fp.save)} more between "
                 "iterations")
    if fp.load and device < 0 and fp.load_total == fp.host_total > fp.loop_total:
        text += (f"; before its first iteration it holds {human_bytes(fp.load_total)}: the "
                 f"weights and data, and its start-up load of {human_bytes(fp.load)} (the "
                 "weights' first fill, --init's weights, the --resume checkpoint read whole)")
    tip = advice(job, size, rank, device, limit, need, everyone, restore,
                 transport=_transport_of(fp))
    return f"{text}; {tip}; or skip the check with --no-memory-check"


def check_memory(job, graphs, plans, world, limits, dispatcher=None, init=None, resume=None):
    """``train``'s start-up check: a MemoryTooSmall (exit 2, one line) when
    this rank's footprint exceeds what it has, before the workspaces are
    allocated. ``limits``: a MemoryLimits (None: no check); ``dispatcher``:
    train's --dispatcher; ``init``, ``resume``: the run's --init file and
    the Checkpoint it resumes from (``load_bytes``). Returns the footprint
    (``plan``'s figures for this rank, its MPI transport row from the node
    the run found: the start-up block's ``planned`` row, memory.json's
    ``planned``), None without a check."""
    if limits is None or not limits.check:
        return None
    from ..runtime.footprint import footprint
    if is_server(graphs):  # a parameter server (train/ps_server.py), world the global one
        everyone, fp, size = None, graphs.footprint(dispatcher), world.size
    else:
        everyone = train_save_metas(job, graphs, world)
        fp = footprint(graphs, plans, world.rank, cuda_graph=job.cuda_graph,
                       dispatcher=dispatcher, save=save_bytes(job, graphs, everyone),
                       held=held_bytes(job, graphs))
        # a parameter-server worker's world is the workers'
        comp = getattr(graphs, "composition", None)
        plan = getattr(comp, "server_plan", None)
        size = world.size + (len(plan["servers"]) if plan else 0)
    set_load(fp, job, graphs, init, resume)
    from ..comm.world import get_world
    glob = get_world()  # a parameter-server worker's world is the workers': the node's ranks
    set_transport(fp, 1 if glob.size == 1 else
                  len(glob.hosts.host_ranks[glob.hosts.host_of[glob.rank]]))
    # the checkpoint --resume read is resident already (in the load, and out
    # of the MemAvailable read now)
    held = arrays_nbytes(resume) if resume is not None else 0
    node = train_node_checks(fp.host_total, held, limits)
    problems = over(fp, limits)
    if node is not None:  # every rank alike
        check, needs, name, me = node
        if check["ranks"] != [me]:
            raise MemoryTooSmall(node_refusal(check, needs, name))
        # a node of this rank alone: the rank's own refusal, with its rows
        problems = [("host", -1, check["need_bytes"], check["limit_bytes"],
                     check["limit_from"])]
    if problems:
        raise MemoryTooSmall(refusal(job, fp, size, problems[0], everyone=everyone,
                                     restore={"init": init, "resume": resume}))
    return fp


def train_node_checks(need, held, limits):
    """``train``'s per-node host check, the same on every rank: one
    allgather over the global world (a parameter-server job's servers and
    workers alike) of each rank's host need, the bytes it holds already and
    its MemAvailable; the nodes are the world's host table (the launcher's
    real placement), each node's MemAvailable its first rank's. (the
    first node that does not fit's ``node_checks`` entry, rank -> need, its
    host name, this rank in the global world), else None."""
    if limits.node is None and limits.host is not None:
        return None
    from ..comm.world import get_world
    glob = get_world()
    mine = (int(need), int(held), mem_available())
    if glob.size == 1:
        every, nodes, names = [mine], [[0]], [None]
    else:
        every = glob.allgather_object(mine, "each rank's host need, for the per-node memory "
                                      "check (Iallgatherv)")
        nodes, names = glob.hosts.host_ranks, glob.hosts.host_names
    avail = [every[ranks[0]][2] for ranks in nodes]
    checks = node_checks({r: e[0] for r, e in enumerate(every)}, nodes, limits,
                         None if all(a is None for a in avail) else avail,
                         {r: e[1] for r, e in enumerate(every)})
    for c in checks:
        if not c["fits"]:
            return c, {r: e[0] for r, e in enumerate(every)}, names[c["node"]], glob.rank
    return None


def train_save_metas(job, graphs, world):
    """``save_metas`` in a run: this rank's part, and where a save gathers
    the ranks' parts (``Scheme.gathers_checkpoint``, the same on every rank)
    every rank's, by one allgather (each rank's lists of names and shapes,
    what the save itself allgathers first)."""
    from ..parallel.schemes import scheme_of
    if getattr(graphs, "layout", None) is None:
        return {}
    scheme = scheme_of(job)
    mine = scheme.save_meta(graphs)
    if world.size == 1 or not scheme.gathers_checkpoint(graphs):
        return {world.rank: mine}
    return dict(enumerate(world.allgather_object(
        mine, "the ranks' parts of a checkpoint, for the memory check (Iallgatherv)")))


# ------------------------------------------------------------------ output
def _need_word(fp, total):
    """The end of an ``at a save`` / ``at start-up`` line holding more than an iteration."""
    return "more than an iteration holds" + (": the host's need)" if total == fp.host_total
                                             else ")")


def run_plan(job, size, limits, as_json=False, restore=None):
    """``plan``: (text or JSON object, exit status): 0 when every rank fits.
    ``restore``: {"init": the --init file, "resume": True}: the run's
    start-up load (``load_bytes``; None: a fresh start)."""
    built, like = ranks_to_build(job, size, limits)
    fps, everyone = offline_footprints(job, size, built, restore, limits=limits)
    set_transports(fps, size, limits)
    groups, keys = {}, {}  # keys: {built rank: its footprint's figures}, each read once
    for r in range(size):
        src = like.get(r, r)
        key = keys.get(src)
        if key is None:
            d = fps[src].as_dict()
            d.pop("rank")
            key = keys[src] = repr(d)
        groups.setdefault(key, (fps[src], []))[1].append(r)
    kinds = []
    for fp, ranks in groups.values():
        lims = limits_for(limits, sorted(fp.devices))
        fits = {where: {"need_bytes": need_of(fp, d), "limit_bytes": int(lim), "limit_from": why,
                        "fits": need_of(fp, d) <= lim} for where, d, lim, why in lims}
        kinds.append((fp, ranks, fits))
    node_fits = plan_node_checks(fps, like, size, limits)
    ok = all(f["fits"] for _, _, fits in kinds for f in fits.values()) and \
        all(c["fits"] for c in node_fits)
    if as_json:
        import json
        out = {"config": job.name, "world_size": size, "fits": ok,
               "ranks": [{**fp.as_dict(), "rank": ranks[0], "ranks": ranks, "fits": fits}
                         for fp, ranks, fits in kinds],
               "nodes": node_fits}
        return json.dumps(out), 0 if ok else 2
    from ..parallel.compose import layout_of
    from .graph import _OfflineWorld
    lay = layout_of(job, _OfflineWorld(0, size))
    shape, per = lay.describe(), "rank"
    if size > 1 and job.parallel.servers:  # trainer.run_param_server's ranks
        from ..parallel.param_server import ps_layout, synchronous_if_no_staleness
        from ..parallel.schemes.base import ranks_word
        ps = ps_layout(size, job.parallel.ps_ranks, job.path)
        shape = (f"[parameter servers, mode {synchronous_if_no_staleness(job).parallel.mode}: "
                 f"{ranks_word(ps['workers'])} workers, {ranks_word(ps['servers'])} "
                 f"server{'s' if len(ps['servers']) > 1 else ''}]")
        per = "worker"
    batch = job.train_batch
    if batch is None and job.graph is not None:  # a graph: config's own data ops
        batch = sum(int((e.to_dict().get("attrs") or {}).get("batch_size", 0))
                    for e in job.graph if e.to_dict().get("op_type") == "DataReader")
    lines = [f"plan {job.name}: {size} rank{'s' if size != 1 else ''} {shape}, "
             f"batch {batch} per {per}; bytes each rank holds before its first "
             "iteration"]
    if lay.staged:  # the stage map (parallel.stages: S resolved at load: job/stage_cut.py)
        from ..job.stage_cut import job_stage_lines
        lines += [f"  {line}" for line in job_stage_lines(job)]
    from ..train.runlog import ranges
    for fp, ranks, fits in kinds:
        head = f"rank {ranks[0]}" if len(ranks) == 1 else \
            f"ranks {ranges(ranks)} ({len(ranks)} alike)"
        cols = [("host", fp.host)] + [(f"GPU {d}", rows) for d, rows in sorted(fp.devices.items())]
        lines.append(f"{head}:" + "".join(f"  {w:>12}" for w, _ in cols))
        for k in (k for k in LABELS if any(rows.get(k) for _, rows in cols) or k in (
                "weights", "gradients", "optimizer_state", "activations")):
            lines.append(f"  {LABELS[k]:<21}" + "".join(f"  {human_bytes(rows.get(k, 0)):>12}"
                                                        for _, rows in cols))
        lines.append(f"  {'total':<21}" + "".join(
            f"  {human_bytes(sum(rows.values())):>12}" for _, rows in cols))
        if fp.peer_windows:   # runtime/footprint.peer_window_bytes
            label = "peers' window pages"
            lines.append(f"  {label:<21}  {human_bytes(fp.peer_windows):>12}  "
                         "(the other ranks' shared-window regions it stores into or loads "
                         "from: in its resident bytes too; counted on their owner's windows "
                         "row, not in this total)")
        # the save runs between iterations (host memory only): rank 0's
        # receive buffers and joins, a GPU rank's host copies of its part
        lines.append(f"  {'checkpoint save':<21}  {human_bytes(fp.save):>12}")
        if fp.save:
            lines.append(f"  {'at a save':<21}  {human_bytes(fp.save_total):>12}  (between "
                         "iterations: the total less the kernel temporaries"
                         + "".join(f" and the {LABELS[k]}" for k in fp.save_frees)
                         + ", plus the save; "
                         + (_need_word(fp, fp.save_total) if fp.save_total > fp.loop_total
                            else "no more than an iteration holds)"))
        # before the first iteration: the weights' first fill, --init's
        # weights, the --resume checkpoint (read whole on every rank)
        lines.append(f"  {'start-up load':<21}  {human_bytes(fp.load):>12}" + (
            f"  (its first fill, on its arrays: {human_bytes(fp.fill)})" if fp.fill else ""))
        if fp.load or fp.fill:
            lines.append(f"  {'at start-up':<21}  {human_bytes(fp.load_total):>12}  (before "
                         "the first iteration: the weights, data, kept blobs and buffers, "
                         "plus the load; "
                         + (_need_word(fp, fp.load_total) if fp.load_total > fp.loop_total
                            else "no more than an iteration holds)"))
        ms = fp.model_state
        if ms:  # train's start-up ``model state`` figures (runtime/footprint.model_state_bytes)
            lines.append(f"  model state: weights {human_bytes(ms['weights'])}, gradients "
                         f"{human_bytes(ms['gradients'])}, optimizer state "
                         f"{human_bytes(ms['optimizer_state'])} ({ms['weights']} + "
                         f"{ms['gradients']} + {ms['optimizer_state']} bytes held, each whole "
                         "even where the arena places it)")
        p = fp.peak
        if p is not None:
            lines.append(f"  peak: the {p['where']} arena holds {human_bytes(p['arena_bytes'])}; "
                         f"its blobs peak at {human_bytes(p['live_bytes'])} live at op "
                         f"'{p['op']}' ({p['position'] + 1} of {p['ops']} in the schedule"
                         + (f", {human_bytes(p['gradients_bytes'])} of it gradients"
                            if p["gradients_bytes"] else "") + ")")
        for where, f in fits.items():
            verdict = "fits" if f["fits"] else "DOES NOT FIT"
            lines.append(f"  {where}: {verdict}: {human_bytes(f['need_bytes'])} of "
                         f"{human_bytes(f['limit_bytes'])} ({f['limit_from']})")
            if not f["fits"]:
                d = -1 if where == "host" else int(where.split()[1])
                lines.append("    " + advice(job, size, ranks[0], d, f["limit_bytes"],
                                             f["need_bytes"], everyone, restore, limits,
                                             _transport_of(fp)))
        if fp.devices and not any(w != "host" for w in fits):
            lines.append("  no GPU here: give --device-memory to check the GPU's part")
        for note in fp.notes:
            lines.append(f"  note: {note}")
    for c in node_fits:  # the host, per node
        verdict = "fits" if c["fits"] else "DOES NOT FIT"
        lines.append(f"node {c['node']} (ranks {ranges(c['ranks'])}): host: {verdict}: "
                     f"{human_bytes(c['need_bytes'])} of {human_bytes(c['limit_bytes'])} "
                     f"({c['limit_from']}; the ranks' host needs summed)")
        if not c["fits"]:  # a rank alone on its node: the batch that would fit it
            alone = fps[like.get(c["ranks"][0], c["ranks"][0])]
            lines.append("  " + (advice(job, size, c["ranks"][0], -1, c["limit_bytes"],
                                        c["need_bytes"], everyone, restore, limits,
                                        _transport_of(alone))
                                 if len(c["ranks"]) == 1 else NODE_ADVICE))
    if like:
        from ..parallel.schemes import scheme_of
        lines.append(f"ranks {ranges(sorted(like))} were not built: each holds what " +
                     ("worker rank 1 holds" if per == "worker" else
                      "the rank of the second replica at its place holds"
                      if not scheme_of(job).shards_state else
                      "the first rank past the first replica at its place whose ZeRO "
                      "shards are cut alike holds") +
                     (" (on a node of another count of ranks, what the rank built for "
                      "that count holds)" if set(like.values()) - set(_alike(job, size)[0])
                      else ""))
    return "\n".join(lines), 0 if ok else 2
