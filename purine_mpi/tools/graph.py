"""``graph`` command: a rank's slice of the composed graph as text, the
seed's YAML, or Graphviz DOT. The entry points take a job (job/job.py).
"""
import dataclasses

import yaml

from ..ops.catalog import get_kernel_class
from ..base.precision import SHORT
from ..graph import seed_yaml
from ..graph.core import op_precision


def compose_for(job, world_size, rank, phase="train"):
    """The graph ``rank`` of ``world_size`` would run, built without MPI."""
    return composed(job, world_size, rank, phase)[0]


def composed(job, world_size, rank, phase="train", device_passes=True):
    """(the graph ``rank`` of ``world_size`` would run, built without MPI,
    and its scheme's Composition; (None, None) without such a phase).
    ``device_passes`` False: the graph before ``prepare_for_device`` (no
    device placement, precision pass or device fusions: what ``graph
    --format yaml`` prints, which a loaded config's run places and fuses
    again as ``train`` does)."""
    from ..job.replica import build_test_graph, build_train_graph, check_test_phase, param_shapes
    from ..parallel.schemes import Composition, run_scheme_of
    world = _OfflineWorld(rank, world_size)
    par = job.parallel
    # the scheme train runs: a parameter-server mode's on several ranks,
    # also under scheme none (its own class answers ``servers`` False)
    scheme = run_scheme_of(job, world_size)
    lay = scheme.layout(job, world)  # a world that does not fit the stages: exit 2 here
    replica, replicas = lay.replica, lay.replicas  # the data shard (compose.data_window)
    if phase == "test":  # replicas trained apart: rank 0's over the whole split (train's)
        test = build_test_graph(job, *lay.test_shard(scheme.trains_apart(job, lay)))
        if test is None:
            return None, None
        comp = scheme.compose_test(test, job, world)
        comp.layout = lay
        return comp.graph, comp
    graph, grads = build_train_graph(job, replica, replicas, scheme.exchanges_gradients)
    # a broken test-only layer, test data that changes a parameter's shape: exit 2 here too
    check_test_phase(job, replica, replicas, param_shapes(graph))
    if world_size > 1 and scheme.servers:
        from ..parallel.param_server import compose_for_rank
        graph = compose_for_rank(graph, grads, job, world_size, rank).infer_shapes()
        graph.validate()
        comp = Composition(graph, lay)
    else:  # the trainer's own composition; the cross-rank check needs MPI: skip it
        offline = job.replace(parallel=dataclasses.replace(par, check_collectives=False))
        comp = scheme.compose(graph, grads, offline, world)
        graph = comp.graph
    if device_passes:
        from ..parallel.placement import prepare_for_device
        # placed and fused as the trainer runs it (needs no CuPy)
        prepare_for_device(graph, job.device, precision=job.precision)
    from ..parallel.partition import partition, ranks_used
    if len(ranks_used(graph, size=world_size)) > 1:  # a seed graph placed on several ranks
        graph = comp.graph = partition(graph, rank, size=world_size)
    else:  # micro-batch copies share buffers as the trainer plans them
        scheme.plan_memory(graph, job, world)
    comp.layout = lay
    return graph, comp


def describe_layout(lay, rank, comp=None):
    """Where ``rank`` sits in a staged scheme (``graph`` text header), or None."""
    from ..parallel.schemes import scheme_class
    return scheme_class(lay.scheme)().graph_notes(lay, rank, comp)


class _NoAliasDumper(yaml.SafeDumper):
    """Writes a dict shared by several nodes (e.g. a filler) out in full at
    each place: no ``&id001`` anchors, so editing one entry never silently
    edits another."""

    def ignore_aliases(self, data):
        return True


class _OfflineWorld:
    """Rank and size for composing a slice without starting MPI."""

    def __init__(self, rank, size):
        self.rank, self.size, self.hosts = rank, size, None


NL = "\\n"  # a DOT line break inside a label
#: DOT fill colours of the ops computing in a low precision (parallel/precision.py)
LOW_COLORS = {"bfloat16": "#ffb870", "float16": "#ff9ec4"}


def to_dot(graph):
    """Graphviz DOT: blobs are ellipses, ops are boxes, ranks are clusters.
    A blob no op reads or writes is storage that others view (a gradient
    bucket: one flat buffer whose views are the gradients it holds, which
    the allreduce reads): it is drawn with a dashed edge labelled "view" to
    each blob that views it, so no blob floats unconnected."""
    def q(*lines):  # a DOT string of lines: their backslashes and quotes escaped
        return '"' + NL.join(str(s).replace("\\", "\\\\").replace('"', r'\"')
                             for s in lines) + '"'
    touched = {b for op in graph.ops.values() for b in (*op.inputs, *op.outputs)}
    views = {}
    for b in graph.blobs.values():
        if b.alias_of is not None and b.alias_of not in touched:
            views.setdefault(b.alias_of, []).append(b.name)
    lines = [f"digraph {q(graph.name)} {{", "  rankdir=TB;", "  node [fontsize=10];"]
    for b in graph.blobs.values():
        shape = list(b.shape) if b.shape is not None else "?"
        style = ', style=filled, fillcolor="#ffe9a8"' if b.kind == "param" else ""
        text = [b.name, shape]
        if b.name in views:
            text.append(f"flat buffer, {len(views[b.name])} views")
            style = ", style=dashed"
        lines.append(f"  {q('b:' + b.name)} [label={q(*text)}, shape=ellipse{style}];")
    for owner, names in views.items():
        for v in names:
            lines.append(f"  {q('b:' + owner)} -> {q('b:' + v)} "
                         '[style=dashed, label="view", fontsize=8];')
    for op in graph.ops.values():
        category = get_kernel_class(op.op_type, op.name).category
        color = {"comm": "#a8d8ff", "update": "#c8f0c8", "io": "#f0d0f0"}.get(category, "#eeeeee")
        dtype = op_precision(op)
        color = LOW_COLORS.get(dtype, color)  # the precision pass's bf16/fp16 ops
        label = q(op.name, op.op_type, *([SHORT[dtype]] if dtype in LOW_COLORS else []))
        lines.append(f"  {q('o:' + op.name)} [label={label}, "
                     f"shape=box, style=filled, fillcolor={q(color)}];")
        for b in op.inputs:
            lines.append(f"  {q('b:' + b)} -> {q('o:' + op.name)};")
        for b in op.outputs:
            lines.append(f"  {q('o:' + op.name)} -> {q('b:' + b)};")
    lines.append("}")
    return "\n".join(lines)


def render_graph(job, world_size=None, rank=0, fmt="text", phase="train", memory=False):
    world_size = world_size or 1
    if not 0 <= rank < world_size:
        from ..base.errors import UserError
        raise UserError(f"--rank {rank} is outside 0..{world_size - 1} (--np {world_size})")
    # yaml: the graph before the device passes, with the job's device and
    # precision keys, so the loaded config places, casts and fuses it as
    # train does (a graph already fused for a GPU did not load: its fused
    # updates hid the backward, built again: 'op loss.grad_seed is defined twice')
    graph, comp = composed(job, world_size, rank, phase, device_passes=fmt != "yaml")
    if graph is None:  # graph --phase test of a job without test data (or with a 'graph:')
        from ..base.errors import ConfigError
        if job.data.get(phase) is None:
            raise ConfigError(job.path, f"data.{phase}", f"the config has no {phase} graph "
                              f"(graph --phase {phase} shows the net on data.{phase}, which "
                              "is not given)")
        raise ConfigError(job.path, None, f"the config has no {phase} graph")
    if fmt == "yaml":
        # the solver section too: the loop's keys (max_iter, display, ...) and
        # the start-up block then match the lr op the graph carries; and the
        # seed, which draws the initial weights (the fillers) and the dropout
        # masks: without it the graph trained from other weights than the config
        solver = {k: v for k, v in job.solver.to_config().items() if v is not None}
        head = {"name": job.name, "seed": job.seed}
        if int(job.device) >= 0:
            head["device"] = int(job.device)
        if job.precision != "fp32":
            head["precision"] = job.precision
        return yaml.dump(dict(head, solver=solver, graph=seed_yaml.dump(graph)),
                         Dumper=_NoAliasDumper, sort_keys=False, default_flow_style=None,
                         width=100)
    if fmt == "dot":
        return to_dot(graph)
    lines = [graph.summary()]
    lay = comp.layout
    if describe_layout(lay, rank, comp):
        lines.insert(0, describe_layout(lay, rank, comp))
    if lay.staged:  # the stage map (parallel.stages: S resolved at load: job/stage_cut.py)
        from ..job.stage_cut import job_stage_lines
        lines[1:1] = job_stage_lines(job)
    split = comp.tensor_plan
    if split:
        lines.append(f"tensor-parallel split over ranks {lay.tensor_ranks()} "
                     f"(rank {rank} = replica {lay.replica}, "
                     + (f"stage {lay.stage}, " if lay.staged else "") + f"shard {lay.shard}):")
        lines += [f"  {line}" for line in split]
    plan = comp.bucket_plan
    if plan:
        from ..parallel.data_parallel import format_plan
        lines += format_plan(plan)
        from ..parallel.compose import defer_update_applies
        if defer_update_applies(job, world_size, lay.staged):
            from ..runtime.tail import describe_tail
            line = describe_tail(graph)
            if line:
                lines.append(line)
    lines += shard_lines(job, graph)
    from ..graph.recompute import describe_recompute
    if describe_recompute(graph):
        lines.append(f"recompute {describe_recompute(graph)}")
    from ..parallel.micro_memory import describe_plan
    if describe_plan(graph):
        lines.append(describe_plan(graph))
    if memory:
        lines += memory_lines(job, graph)
    return "\n".join(lines)


def shard_lines(job, graph):
    """The gather and free points of a graph with ReduceScatter and
    Allgather ops (the sharded scheme), one entry per op in ``seq`` order:
    the bucket it reduce-scatters or gathers (its bytes, its parameters,
    this rank's shard), the op after which it posts (the last writer of its
    inputs), the ops that read the gathered buffer and after which op the
    buffer's storage is free: its last op in the memory plan's schedule
    when the plan the trainer makes (``memory_plans``, on a copy of the
    graph) puts it in the arena, else "held" (storage of its own, kept
    between iterations). Empty without such ops."""
    from ..base.progress_bar import human_bytes
    from ..comm.ops import data_blobs, shard_range
    ops = sorted((op for op in graph.ops.values()
                  if op.op_type in ("ReduceScatter", "Allgather")),
                 key=lambda op: (int(op.attrs.get("seq", 0)), op.name))
    if not ops:
        return []
    from ..runtime.factory import memory_plans
    from ..runtime.memory_plan import batch_blobs
    order = {op.name: i for i, op in enumerate(graph.topo_order())}
    plans = []
    if job.memory_plan:
        host, devices = memory_plans(graph.copy(), keep=batch_blobs(graph), order_ops=True)
        plans = [p for p in [host, *devices.values()] if p is not None]
    producers = graph.producers()
    readers = {}
    for op in graph.ops.values():
        for b in op.inputs:
            readers.setdefault(graph.storage_root(b), []).append(op.name)

    def last_writer(names):
        ops_ = {w.name for b in names for w in producers.get(b, ())}
        return max(ops_, key=order.get) if ops_ else None

    def storage(root):
        for plan in plans:
            if root in plan.offsets and root in plan.lifetimes:
                return f"free after {plan.order[plan.lifetimes[root][1]]} (memory plan)"
        why = "memory_plan: false" if not job.memory_plan else "own memory"
        return f"held between iterations ({why})"

    shards, shard = int(ops[0].attrs["shards"]), int(ops[0].attrs["shard"])
    group = ops[0].attrs.get("group")  # scheme sharded with stages: the stage's ranks
    whose = f"rank {shard}'s shard of {shards}" if group is None else \
        f"shard {shard} of {shards}, over ranks {list(group)}"
    lines = [f"sharded buckets ({whose}; shard r of a bucket of n "
             "elements is [r*c, min(n, (r+1)*c)), c = ceil(n/N)):"]
    for op in ops:
        data = data_blobs(op)
        root = graph.storage_root(data[0])
        total = sum(graph.blobs[b].size for b in data)
        lo, hi = shard_range(total, int(op.attrs["shards"]), int(op.attrs["shard"]))
        nbytes = sum(graph.blobs[b].nbytes for b in data)
        after = last_writer(op.inputs)
        if op.op_type == "ReduceScatter":
            params = [b[:-len(".grad")] if b.endswith(".grad") else b for b in op.inputs]
            lines.append(f"  {op.attrs.get('bucket', root)}: {human_bytes(nbytes)} "
                         f"({', '.join(params)}), shard [{lo}:{hi}) of {total:,} elements")
            how = ("all-reduced whole (parallel.reduce_scatter: false; this rank keeps "
                   "its shard's range) by" if op.attrs.get("allreduce") else
                   "reduce-scattered by")
            lines.append(f"    {how} {op.name} (seq {op.attrs.get('seq', 0)})"
                         + (f" after {after}" if after else "")
                         + f"; its storage {root}: {storage(root)}")
            continue
        reads = sorted({r for b in data for r in readers.get(graph.storage_root(b), ())
                        if r != op.name}, key=order.get)
        read = (f"; read by {len(reads)} op{'s' if len(reads) != 1 else ''}, "
                f"{reads[0]} first, {reads[-1]} last" if reads else "; read by no op")
        lines.append(f"  {op.attrs.get('bucket', root)}: {human_bytes(nbytes)}, shard "
                     f"[{lo}:{hi}) of {total:,} elements")
        lines.append(f"    gathered by {op.name} (seq {op.attrs.get('seq', 0)})"
                     + (f" after {after}" if after else "")
                     + f"{read}; its storage {root}: {storage(root)}")
    return lines


def memory_lines(job, graph):
    """``graph --memory``: the memory plans the trainer lays this graph out
    by (runtime/memory_plan.py), the host's then each GPU's, or a line each
    saying it is off; then each GPU's scratch (``scratch_lines``)."""
    from ..runtime.factory import memory_plans
    from ..runtime.memory_plan import batch_blobs, format_plan
    on = job.memory_plan
    host, devices = memory_plans(graph, keep=batch_blobs(graph), order_ops=on)
    lines = []
    for plan in [host, *devices.values()]:
        if on:
            lines += format_plan(graph, plan)
            continue
        lines.append(f"{plan.title}: off (memory_plan: false): one buffer per blob; the "
                     f"plan would put {plan.unplanned_bytes:,} bytes of {len(plan.offsets)} "
                     f"transient blob(s) in a {plan.total_bytes:,}-byte arena")
    for device in sorted(devices):
        lines += scratch_lines(graph, device, job.cuda_graph)
    return lines


def scratch_lines(graph, device, cuda_graph=True):
    """GPU ``device``'s memory beyond the blobs, as ``plan`` counts it
    (runtime/footprint.device_extras): the scratch slots, each op's scratch
    bytes with where its size comes from (``OpKernel.scratch_note``), and
    the cuBLAS handle workspaces."""
    from ..base.progress_bar import human_bytes
    from ..runtime.footprint import device_extras
    extra = device_extras(graph, device, cuda_graph)
    slots, ops = extra["slots"], extra["ops"]
    lines = [f"GPU {device} scratch: {len(slots)} slot(s), {extra['scratch']:,} bytes "
             f"({human_bytes(extra['scratch'])}); {len(ops)} op(s) reserve scratch"]
    slot_of = {n: i for i, (_, members) in enumerate(slots) for n in members}
    width = max((len(n) for n in ops), default=0)
    for name, (nbytes, note) in ops.items():
        where = f"slot {slot_of[name]}" if name in slot_of else "no slot"
        lines.append(f"  {name:<{width}}  {nbytes:>14,} bytes  {where}"
                     + (f"  ({note})" if note else ""))
    handles = extra["cublas_handles"]
    lines.append(f"GPU {device} cuBLAS workspaces: {len(handles)} handle(s), "
                 f"{extra['cublas_workspaces']:,} bytes ({human_bytes(extra['cublas_workspaces'])})")
    return lines
