"""``parallel.stages: S`` (an integer, Megatron-LM's pipeline-model-parallel
size): the net's layers cut into S contiguous stages of about equal static
cost, resolved at config-load time into the explicit {layer: stage} map
(job/config.py) so that every consumer sees the map.

A layer's cost is the FLOPs of its forward and backward matrix products in
one replica's training graph (``graph/flops.op_flops``; an op belongs to
the layer its name starts with: ``layer.*``, ``layer/*``, ``layer@*``,
``layer[*``). The cut is ``contiguous_cut`` (``plan --choose``'s cut by
traced time, tools/choose.py, uses it too): computed from the config and
the data's shapes alone, the same on every rank, before any MPI.
"""
import re

from ..graph.flops import op_flops


def op_layer(op_name):
    """The layer an op of a net's graph belongs to (the start of its name)."""
    return re.split(r"[./@\[]", op_name, 1)[0]


def contiguous_cut(names, weights, stages):
    """{layer: stage}: the layers ``names`` (in order, costs ``weights``) cut
    into ``stages`` contiguous runs of about equal cost (a layer without cost
    weighs 1% of the least); a layer's middle past k/S of the whole starts
    stage k, and every stage keeps at least one layer."""
    floor = min((w for w in weights if w > 0), default=1.0) * 0.01
    w = [max(x, floor) for x in weights]
    total, out, acc, stage = sum(w), {}, 0.0, 0
    for i, n in enumerate(names):
        left = len(names) - i  # every stage keeps at least one layer
        # a new stage starts where the layer's middle passes the stage's share
        if stage < stages - 1 and (acc + w[i] / 2 > total * (stage + 1) / stages or
                                   left <= stages - 1 - stage) and \
                any(v == stage for v in out.values()):
            stage += 1
        out[n] = stage
        acc += w[i]
    return out


def layer_flops(job, graph=None):
    """{layer: FLOPs of one iteration's forward and backward} of ``job``'s
    net (in the net's order), from ``graph`` or one replica's training graph."""
    if graph is None:
        from .replica import build_train_graph
        graph, _ = build_train_graph(job)
    out = {n: 0 for n in job.layer_names}

    def shape(b):
        return graph.blobs[b].shape
    for name, op in graph.ops.items():
        layer = op_layer(name)
        if layer in out:
            out[layer] += op_flops(op, shape)
    return out


def flop_stages(out):
    """The {layer: stage} map of a validated config dict ``out`` whose
    ``parallel.stages`` is an integer (config.py checked it against the
    scheme and the net's length)."""
    from ..base.errors import ConfigError, UserError
    from .job import job_of
    count = out["parallel"]["stages"]
    plain = dict(out, parallel=dict(out["parallel"], stages={}, scheme="data"))
    try:
        return flop_cut(job_of(plain), count)
    except UserError as e:  # the data's shapes unread (a command that reads no data)
        if isinstance(e, ConfigError) and not str(e.key or "").startswith("data."):
            raise
        why = e.problem if isinstance(e, ConfigError) else str(e)  # (replica.forward_graph)
        raise ConfigError(out["_path"], "parallel.stages", f"{count} stages are cut by the "
                          "layers' FLOPs, which need the data's shapes, but: " + why +
                          "; make the data, or give the map {layer: stage}") from None


def flop_cut(job, count):
    """{layer: stage}: ``job``'s layers cut into ``count`` stages by their FLOPs."""
    flops = layer_flops(job)
    return contiguous_cut(list(flops), list(flops.values()), count)


def stage_spans(stages, flops):
    """[(stage, its layers in order, its share of the FLOPs in %)] of the map
    ``stages`` (``flops``: ``layer_flops``)."""
    by_stage = {}
    for name, stage in stages.items():
        by_stage.setdefault(stage, []).append(name)
    total = sum(flops.values()) or 1
    return [(s, by_stage[s], 100.0 * sum(flops.get(n, 0) for n in by_stage[s]) / total)
            for s in sorted(by_stage)]


def span_text(names):
    """``first..last`` of a stage's layers (the one name of a one-layer stage)."""
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def stage_lines(stages, flops):
    """Compact lines of a stage map: each stage's first..last layer and its
    share of the FLOPs (``graph --np N``, ``plan``)."""
    return [f"stage {s}: {span_text(names)} ({len(names)} layer{'s' if len(names) > 1 else ''}"
            f", {share:.1f}% of the FLOPs)" for s, names, share in stage_spans(stages, flops)]


def job_stage_lines(job):
    """``stage_lines`` of a staged job's map (none for a ``graph:`` job)."""
    if not job.layer_names or not job.stage_map:
        return []
    return stage_lines(job.stage_map, layer_flops(job))
