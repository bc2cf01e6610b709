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


def composed(job, world_size, rank, phase="train"):
    """(the graph ``rank`` of ``world_size`` would run, built without MPI,
    and its scheme's Composition; (None, None) without such a phase)."""
    from ..job.replica import build_test_graph, build_train_graph
    from ..parallel.schemes import Composition, scheme_of
    world = _OfflineWorld(rank, world_size)
    par = job.parallel
    scheme = scheme_of(job)
    lay = scheme.layout(job, world)  # a world that does not fit the stages: exit 2 here
    replica, replicas = lay.replica, lay.replicas  # the data shard (compose.data_window)
    if phase == "test":
        test = build_test_graph(job, replica, replicas)
        if test is None:
            return None, None
        comp = scheme.compose_test(test, job, world)
        comp.layout = lay
        return comp.graph, comp
    graph, grads = build_train_graph(job, replica, replicas)
    if world_size > 1 and scheme.servers:
        from ..parallel.param_server import compose_for_rank
        graph = compose_for_rank(graph, grads, job, world_size, rank).infer_shapes()
        graph.validate()
        comp = Composition(graph, lay)
    else:  # the trainer's own composition; the cross-rank check needs MPI: skip it
        offline = job.replace(parallel=dataclasses.replace(par, check_collectives=False))
        comp = scheme.compose(graph, grads, offline, world)
        graph = comp.graph
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


def describe_layout(lay, rank):
    """Where ``rank`` sits in a staged scheme (``graph`` text header), or None."""
    from ..parallel.schemes import scheme_class
    return scheme_class(lay.scheme)().graph_notes(lay, rank)


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
    def q(s):
        return '"' + str(s).replace('"', r'\"') + '"'
    touched = {b for op in graph.ops.values() for b in (*op.inputs, *op.outputs)}
    views = {}
    for b in graph.blobs.values():
        if b.alias_of is not None and b.alias_of not in touched:
            views.setdefault(b.alias_of, []).append(b.name)
    lines = [f"digraph {q(graph.name)} {{", "  rankdir=TB;", "  node [fontsize=10];"]
    for b in graph.blobs.values():
        shape = list(b.shape) if b.shape is not None else "?"
        style = ', style=filled, fillcolor="#ffe9a8"' if b.kind == "param" else ""
        text = f"{b.name}{NL}{shape}"
        if b.name in views:
            text += f"{NL}flat buffer, {len(views[b.name])} views"
            style = ", style=dashed"
        lines.append(f"  {q('b:' + b.name)} [label={q(text)}, shape=ellipse{style}];")
    for owner, names in views.items():
        for v in names:
            lines.append(f"  {q('b:' + owner)} -> {q('b:' + v)} "
                         '[style=dashed, label="view", fontsize=8];')
    for op in graph.ops.values():
        category = get_kernel_class(op.op_type, op.name).category
        color = {"comm": "#a8d8ff", "update": "#c8f0c8", "io": "#f0d0f0"}.get(category, "#eeeeee")
        dtype = op_precision(op)
        color = LOW_COLORS.get(dtype, color)  # the precision pass's bf16/fp16 ops
        label = q(op.name + NL + op.op_type + (NL + SHORT[dtype] if dtype in LOW_COLORS else ""))
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
    graph, comp = composed(job, world_size, rank, phase)
    if graph is None:
        from ..base.errors import UserError
        raise UserError(f"the config has no {phase} graph")
    if fmt == "yaml":
        # the solver section too: the loop's keys (max_iter, display, ...) and
        # the start-up block then match the lr op the graph carries
        solver = {k: v for k, v in job.solver.to_config().items() if v is not None}
        return yaml.dump({"name": job.name, "solver": solver,
                          "graph": seed_yaml.dump(graph)},
                         Dumper=_NoAliasDumper, sort_keys=False, default_flow_style=None,
                         width=100)
    if fmt == "dot":
        return to_dot(graph)
    lines = [graph.summary()]
    lay = comp.layout
    if describe_layout(lay, rank):
        lines.insert(0, describe_layout(lay, rank))
    split = comp.tensor_plan
    if split:
        lines.append(f"tensor-parallel split over ranks {lay.tensor_ranks()} "
                     f"(rank {rank} = replica {lay.replica}, shard {lay.shard}):")
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
    from ..graph.recompute import describe_recompute
    if describe_recompute(graph):
        lines.append(f"recompute {describe_recompute(graph)}")
    from ..parallel.micro_memory import describe_plan
    if describe_plan(graph):
        lines.append(describe_plan(graph))
    if memory:
        lines += memory_lines(job, graph)
    return "\n".join(lines)


def memory_lines(job, graph):
    """``graph --memory``: the memory plans the trainer lays this graph out
    by (runtime/memory_plan.py), the host's then each GPU's, or a line each
    saying it is off."""
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
    return lines
