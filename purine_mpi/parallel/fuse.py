"""Graph rewrites that cut kernel launches on a GPU, each exact (the same
numbers as the graph it rewrites, up to float summation order at most):

``fuse_relu(graph)``
    A ReLU whose input is produced by a Conv or InnerProduct (its only
    writer), and read by nothing but the ReLU and its gradient, moves into
    its producer (attr ``relu``): the producer adds its bias and applies the
    ReLU in one kernel (``bias_act``) and writes the ReLU's output blob; the
    ReluGrad reads that output instead of the input (y > 0 exactly where
    x > 0 for a slope >= 0). The pre-activation blob disappears.

``fuse_dgrad_relu(graph)``
    A ReluGrad whose gradient input is written by a ConvGradData (its only
    writer and reader) moves into that op: ConvGradData takes the ReLU's
    mask blob as a third input and writes the ReluGrad's output, so the
    data-gradient convolution applies the mask (cuDNN's dgrad + drelu graph,
    or one kernel after the im2col path). The intermediate gradient goes.
    Not where the mask is made after the ConvGradData (activation
    recompute: the ReLU recomputed just before its gradient, after the
    next layer's data gradient), which would make a cycle.

An op that waited for a fused ReLU or ReluGrad (a recomputed copy waits for
the backward op before its own) waits for the op it moved into, and that op
for what it waited for (``_fused_into``).

``fuse_updates(graph)``
    The SGDUpdate ops of one device that share the learning rate, momentum,
    weight decay and gradient scale become one ``MultiSGDUpdate``: the
    weights become views into one flat buffer ``solver.params`` (kind
    ``param_buffer``; each view 256-byte aligned), the momenta views into
    ``solver.momentum`` (kind ``state_buffer``), and one kernel updates them
    all, each with its own lr_mult and decay_mult. Likewise AdamUpdate and
    AdamWUpdate ops sharing the learning rate, iteration, betas, delta,
    weight decay and gradient scale become one ``MultiAdamUpdate`` over
    ``solver.params``, ``solver.m`` and ``solver.v`` (torch's fused AdamW).
    Blob names stay, so checkpoints, ``--init`` and the test graph's shared
    weights are unchanged.

``fuse_clip(graph)``
    The ClipScale ops of one device, thread and dtype that read the same
    squared norm with the same clip (graph/clip.py adds one per gradient)
    become one ClipScale over all their gradients: one ``clip_scale_multi``
    launch instead of one per gradient (GPT-2: 148), the same bits. Blob
    names stay (the updates read the same ``g@clip`` aliases).

``fold_gelu_bias_grads(graph)``
    (``PURINE_GELU_BIAS_GRAD=1``; off by default until a GPU has timed
    it: benchmarks/bias_gelu_gpu.py) An ``InnerProductGradBias`` whose dy
    is the dx of a ``GeluGrad`` (its only writer) whose x is the output of
    a biased ``InnerProduct`` (the MLP's fc and GELU) moves into that
    GeluGrad (attr ``bias_grad``, db its last output): the column sums of
    dx in the same pass as dx (``kernels.gelu_backward_bias_grad``), not a
    second read of dx. The same bits (the sums' blocks and order are
    ``sum_rows``'s).

``fold_layernorm_sums(graph)``
    (``PURINE_LN_SUMS=1``; off by default until a GPU has timed it:
    benchmarks/layernorm_kernel_gpu.py) Each ``LayerNormGrad`` that writes
    dg and db gets attr ``column_sums``: on a GPU (float32, width a
    multiple of 4 up to 768) its backward kernel writes the blocks'
    partial column sums of dy and dy * xhat and a finishing kernel adds
    them (``kernels.layernorm_backward_sums``), in place of dy * xhat in
    scratch and two column-sum kernels. dx keeps its bits; dg and db are
    the same sums in another fixed order (last bits).

``fuse_for_device(graph, train=True)`` applies them to a placed graph (the
trainer does, for ``device >= 0``); CPU graphs are never rewritten.
"""
from ..graph.core import Location, reachable

#: producers a ReLU fuses into (their kernels apply it in the bias epilogue)
RELU_PRODUCERS = ("Conv", "InnerProduct")
#: flat buffers of the fused solver, and their blob kinds
PARAM_BUFFER, MOMENTUM_BUFFER = "solver.params", "solver.momentum"   # solver.<state>
PARAM_BUFFER_KIND, STATE_BUFFER_KIND = "param_buffer", "state_buffer"
#: element alignment of each view in a flat buffer (256 bytes of float32)
FLAT_ALIGN = 64


def fuse_relu(graph):
    """Fuse ReLUs into their producers (see the module docstring); returns
    the names of the ReLU ops removed."""
    fused = []
    for op in list(graph.ops.values()):
        if op.op_type != "Relu" or op.accumulate or len(op.inputs) != 1:
            continue
        slope = float(op.attrs.get("negative_slope", 0.0))
        if slope < 0.0:  # the output's sign no longer tells the input's
            continue
        x, y = op.inputs[0], op.outputs[0]
        producers, consumers = graph.producers(), graph.consumers()
        writers = producers.get(x, [])
        if len(writers) != 1:
            continue
        producer = writers[0]
        if (producer.op_type not in RELU_PRODUCERS or producer.accumulate
                or producer.attrs.get("relu") or producer.location != op.location):
            continue
        xb, yb = graph.blobs[x], graph.blobs[y]
        if xb.alias_of is not None or yb.alias_of is not None or x == y:
            continue
        if any(graph.blobs[b].alias_of == x for b in graph.blobs):
            continue  # something views the pre-activation
        readers = [c for c in consumers.get(x, ()) if c.name != op.name]
        if any(c.op_type != "ReluGrad" or c.inputs[1:] != [x] for c in readers):
            continue
        producer.outputs = [y if b == x else b for b in producer.outputs]
        producer.attrs["relu"] = True
        producer.attrs["negative_slope"] = slope
        for c in readers:
            c.inputs = [c.inputs[0], y]
        graph.remove_op(op.name)
        del graph.blobs[x]
        _fused_into(graph, op, producer)
        fused.append(op.name)
    return fused


def fuse_dgrad_relu(graph):
    """Fuse ReluGrads into the ConvGradData writing their gradient input (see
    the module docstring); returns the names of the ReluGrad ops removed."""
    fused, pos = [], None
    for op in list(graph.ops.values()):
        if op.op_type != "ReluGrad" or op.accumulate or len(op.inputs) != 2:
            continue
        d, m, out = op.inputs[0], op.inputs[1], op.outputs[0]
        slope = float(op.attrs.get("negative_slope", 0.0))
        writers, readers = graph.producers().get(d, []), graph.consumers().get(d, [])
        if len(writers) != 1 or [c.name for c in readers] != [op.name]:
            continue
        dgrad = writers[0]
        if (dgrad.op_type != "ConvGradData" or dgrad.accumulate or len(dgrad.inputs) != 2
                or dgrad.location != op.location or slope < 0.0):
            continue
        if graph.blobs[d].alias_of is not None or graph.blobs[out].alias_of is not None or \
                any(b.alias_of in (d, out) for b in graph.blobs.values()) or d == out:
            continue
        if pos is None:   # a topological order: an op after the dgrad may depend on it
            pos = {o.name: i for i, o in enumerate(graph.topo_order())}
        late = [w.name for w in graph.producers().get(m, ()) if pos[w.name] > pos[dgrad.name]]
        if late and any(dgrad.name in reachable(w, graph.dependencies()) for w in late):
            continue  # the mask is made after the dgrad (recomputed just before the ReLU's grad)
        dgrad.inputs = dgrad.inputs + [m]
        dgrad.outputs = [out]
        dgrad.attrs["mask_slope"] = slope
        graph.remove_op(op.name)
        del graph.blobs[d]
        _fused_into(graph, op, dgrad)
        if op.control_inputs:
            pos = None   # the dgrad may now wait for an op after it in that order
        fused.append(op.name)
    return fused


#: the update ops the pass fuses: {op type: (the multi-tensor op, its
#: states' names, the attrs that must agree within a group, attrs of the
#: multi op fixed by the op type)}
FUSED_UPDATES = {
    "SGDUpdate": ("MultiSGDUpdate", ("momentum",),
                  (("momentum", 0.0), ("weight_decay", 0.0), ("grad_scale", 1.0)), {}),
    "AdamUpdate": ("MultiAdamUpdate", ("m", "v"),
                   (("momentum", 0.9), ("momentum2", 0.999), ("delta", 1e-8),
                    ("weight_decay", 0.0), ("grad_scale", 1.0)), {"decoupled": False}),
    "AdamWUpdate": ("MultiAdamUpdate", ("m", "v"),
                    (("momentum", 0.9), ("momentum2", 0.999), ("delta", 1e-8),
                     ("weight_decay", 0.0), ("grad_scale", 1.0)), {"decoupled": True}),
}


def _update_group_key(graph, op):
    _, states, shared, _ = FUSED_UPDATES[op.op_type]
    return (op.op_type, op.location, op.thread, tuple(op.inputs[2 + len(states):]),
            graph.blobs[op.inputs[0]].dtype,
            tuple(float(op.attrs.get(k, d)) for k, d in shared), op.attrs.get("skip_if"))


def _fusable_update(graph, op, producers):
    """An update of FUSED_UPDATES whose weight and states own their storage
    and are written by it alone, through whole-blob aliases, all of one
    dtype."""
    spec = FUSED_UPDATES.get(op.op_type)
    if spec is None or op.accumulate or op.location.device is None \
            or op.location.device < 0:
        return False
    states = spec[1]
    scalars = 2 if op.op_type != "SGDUpdate" else 1   # lr (and the iteration)
    if len(op.inputs) != 2 + len(states) + scalars or len(op.outputs) != 1 + len(states):
        return False
    held = [op.inputs[0]] + op.inputs[2:2 + len(states)]
    for src, new in zip(held, op.outputs):
        sb, nb = graph.blobs[src], graph.blobs[new]
        if sb.alias_of is not None or nb.alias_of != src or nb.offset != 0 \
                or nb.size != sb.size or sb.dtype != nb.dtype:
            return False
        if [w.name for w in producers.get(src, ())] or \
                [w.name for w in producers.get(new, ())] != [op.name]:
            return False
    return len({graph.blobs[b].dtype for b in held}) == 1


def fuse_updates(graph):
    """Replace same-setting update ops (SGDUpdate; AdamUpdate, AdamWUpdate)
    by one multi-tensor op per group (MultiSGDUpdate, MultiAdamUpdate; see
    the module docstring). Returns the names of the new ops."""
    producers = graph.producers()
    groups = {}
    for op in graph.ops.values():
        if _fusable_update(graph, op, producers):
            groups.setdefault(_update_group_key(graph, op), []).append(op)
    created = []
    for k, (key, ops) in enumerate(groups.items()):
        if len(ops) < 2:
            continue
        op_type, location, thread, scalars, dtype, _, skip_if = key
        multi_type, states, shared, fixed = FUSED_UPDATES[op_type]
        suffix = "" if k == 0 else f"#{k}"
        buffers = [PARAM_BUFFER + suffix] + [f"solver.{s}{suffix}" for s in states]
        offsets, total = [], 0
        for op in ops:
            offsets.append(total)
            size = graph.blobs[op.inputs[0]].size
            total += -(-size // FLAT_ALIGN) * FLAT_ALIGN
        for name, kind in zip(buffers, [PARAM_BUFFER_KIND] + [STATE_BUFFER_KIND] * len(states)):
            graph.add_blob(name, (total,), dtype, location, kind=kind)
            graph.add_blob(f"{name}@new", (total,), dtype, location, kind=kind, alias_of=name)
        for op, off in zip(ops, offsets):
            held = [op.inputs[0]] + op.inputs[2:2 + len(states)]
            for blob, root in zip(held, buffers):
                b = graph.blobs[blob]
                b.alias_of, b.offset = root, off
            for new in op.outputs:
                del graph.blobs[new]
            graph.remove_op(op.name)
        first = ops[0].attrs
        attrs = dict({key: float(first.get(key, d)) for key, d in shared}, **fixed,
                     params=[op.inputs[0] for op in ops], offsets=offsets,
                     sizes=[graph.blobs[op.inputs[0]].size for op in ops],
                     lr_mults=[float(op.attrs.get("lr_mult", 1.0)) for op in ops],
                     decay_mults=[float(op.attrs.get("decay_mult", 1.0)) for op in ops])
        if skip_if:  # fp16's overflow flag (graph/loss_scale.py): skipped as one
            attrs["skip_if"] = skip_if
        controls = list(dict.fromkeys(c for op in ops for c in op.control_inputs))
        name = "solver.update" + suffix
        graph.add_op(name, multi_type, buffers + list(scalars) + [op.inputs[1] for op in ops],
                     [f"{b}@new" for b in buffers], attrs,
                     location=Location(location.rank, location.device, location.ip),
                     thread=thread, control_inputs=controls)
        _wait_for(graph, {op.name for op in ops}, name)
        created.append(name)
    return created


def _fused_into(graph, gone, into):
    """The op ``gone`` (removed) was fused into the op ``into``, which wrote
    its input: ``into`` waits for what ``gone`` waited for (but itself), and
    an op that waited for ``gone`` waits for ``into`` (activation recompute's
    copies wait for the backward op before theirs, a ReluGrad: without this
    a device graph with ``recompute`` named an op no longer there)."""
    if gone.control_inputs:
        deps = graph.dependencies()
        into.control_inputs = list(dict.fromkeys(list(into.control_inputs) + [
            c for c in gone.control_inputs
            if c != into.name and c in graph.ops and into.name not in reachable(c, deps)]))
    _wait_for(graph, {gone.name}, into.name)


def _wait_for(graph, gone, name):
    """An op that waited for one of the ops ``gone`` (fused away) waits for
    the fused op ``name`` instead."""
    for other in graph.ops.values():
        if gone.intersection(other.control_inputs):
            other.control_inputs = list(dict.fromkeys(
                name if c in gone else c for c in other.control_inputs))


#: the name of the fused clip op (``#k`` after it for a further group)
CLIP_SCALE_OP = "clip.scale"


def fuse_clip(graph):
    """Replace the ClipScale ops of one device, thread, dtype, squared norm
    and clip by one ClipScale over all their gradients (see the module
    docstring). Returns the names of the new ops."""
    groups = {}
    for op in graph.ops.values():
        if op.op_type != "ClipScale" or op.accumulate or len(op.inputs) != 2 \
                or op.location is None or op.location.device is None or op.location.device < 0:
            continue
        key = (op.location, op.thread, op.inputs[1], float(op.attrs["clip"]),
               graph.blobs[op.inputs[0]].dtype)
        groups.setdefault(key, []).append(op)
    created = []
    for key, ops in groups.items():
        if len(ops) < 2:
            continue
        location, thread, sumsq, clip, _ = key
        name = graph.free_name(CLIP_SCALE_OP)
        gone = {op.name for op in ops}  # an op that waited for a clip waits for the fused one
        controls = list(dict.fromkeys(c for op in ops for c in op.control_inputs
                                      if c not in gone))
        for op in ops:
            graph.remove_op(op.name)
        graph.add_op(name, "ClipScale", [op.inputs[0] for op in ops] + [sumsq],
                     [op.outputs[0] for op in ops], {"clip": clip},
                     location=Location(location.rank, location.device, location.ip),
                     thread=thread, control_inputs=controls)
        _wait_for(graph, gone, name)
        created.append(name)
    return created


def fold_gelu_bias_grads(graph):
    """Fold each fc bias gradient of GELU's dx into the GeluGrad (see the
    module docstring): only where the ``InnerProductGradBias`` (one input,
    not accumulating) reads the dx (output 0) of one ``GeluGrad`` (its only
    writer, not accumulating, on the same device) whose x is written by an
    ``InnerProduct`` with a bias alone, neither dx nor x is a view or
    viewed, and db has that one writer (db may be a view: a data-parallel
    bucket's range, micro-batch copy 0's gradient; or viewed: fp16's
    ``@unscale``). Returns the names of the bias-gradient ops removed."""
    folded = []
    prod = graph.producers()
    viewed = {b.alias_of for b in graph.blobs.values() if b.alias_of}
    for op in list(graph.ops.values()):
        if op.op_type != "InnerProductGradBias" or op.accumulate or len(op.inputs) != 1 \
                or len(op.outputs) != 1:
            continue
        dx, db = op.inputs[0], op.outputs[0]
        writers = prod.get(dx, [])
        if len(writers) != 1 or len(prod.get(db, [])) != 1:
            continue
        g = writers[0]
        if g.op_type != "GeluGrad" or g.accumulate or g.location != op.location or \
                g.attrs.get("bias_grad") or not g.outputs or g.outputs[0] != dx or \
                len(g.inputs) != 2:
            continue
        fc = prod.get(g.inputs[1], [])
        if len(fc) != 1 or fc[0].op_type != "InnerProduct" or len(fc[0].inputs) != 3 or \
                fc[0].outputs[0] != g.inputs[1]:
            continue
        # db may be a view (a data-parallel bucket's range, micro-batch copy
        # 0's of the gradient the update reads) or viewed (fp16's Unscale
        # writes its ``@unscale`` view in place): GeluGrad writes those
        # contiguous elements, before the same readers, as the
        # InnerProductGradBias did
        if any(graph.blobs[b].alias_of or b in viewed for b in (dx, g.inputs[1])):
            continue
        g.outputs.append(db)
        g.attrs["bias_grad"] = True
        graph.remove_op(op.name)
        _fused_into(graph, op, g)
        prod = graph.producers()
        folded.append(op.name)
    return folded


def fold_layernorm_sums(graph):
    """Mark each ``LayerNormGrad`` that writes dg and db, not accumulating,
    ``column_sums`` (see the module docstring). Returns their names."""
    marked = []
    for op in graph.ops.values():
        wanted = op.attrs.get("outputs", ())
        if op.op_type == "LayerNormGrad" and not op.accumulate and "dg" in wanted and \
                "db" in wanted:
            op.attrs["column_sums"] = True
            marked.append(op.name)
    return marked


def fuse_for_device(graph, train=True):
    """The rewrites on a placed graph (the update and clip ones on a
    training graph; the GELU bias-gradient fold and the layer norms'
    column sums where ``PURINE_GELU_BIAS_GRAD`` / ``PURINE_LN_SUMS`` are
    on); returns the graph."""
    fuse_relu(graph)
    if train:
        from ..base import env
        if env.get("PURINE_GELU_BIAS_GRAD"):
            fold_gelu_bias_grads(graph)
        if env.get("PURINE_LN_SUMS"):
            fold_layernorm_sums(graph)
        fuse_dgrad_relu(graph)
        fuse_clip(graph)
        fuse_updates(graph)
    graph.infer_shapes().validate()
    return graph
