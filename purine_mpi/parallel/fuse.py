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

``fuse_sgd_updates(graph)``
    The SGDUpdate ops of one device that share the learning rate, momentum,
    weight decay and gradient scale become one ``MultiSGDUpdate``: the
    weights become views into one flat buffer ``solver.params`` (kind
    ``param_buffer``; each view 256-byte aligned), the momenta views into
    ``solver.momentum`` (kind ``state_buffer``), and one kernel updates them
    all, each with its own lr_mult and decay_mult. Blob names stay, so
    checkpoints, ``--init`` and the test graph's shared weights are
    unchanged.

``fuse_for_device(graph, train=True)`` applies them to a placed graph (the
trainer does, for ``device >= 0``); CPU graphs are never rewritten.
"""
from ..graph.core import Location

#: producers a ReLU fuses into (their kernels apply it in the bias epilogue)
RELU_PRODUCERS = ("Conv", "InnerProduct")
#: flat buffers of the fused solver, and their blob kinds
PARAM_BUFFER, MOMENTUM_BUFFER = "solver.params", "solver.momentum"
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
        fused.append(op.name)
    return fused


def fuse_dgrad_relu(graph):
    """Fuse ReluGrads into the ConvGradData writing their gradient input (see
    the module docstring); returns the names of the ReluGrad ops removed."""
    fused = []
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
        dgrad.inputs = dgrad.inputs + [m]
        dgrad.outputs = [out]
        dgrad.attrs["mask_slope"] = slope
        graph.remove_op(op.name)
        del graph.blobs[d]
        fused.append(op.name)
    return fused


def _update_group_key(graph, op):
    a = op.attrs
    return (op.location, op.thread, op.inputs[3], graph.blobs[op.inputs[0]].dtype,
            float(a.get("momentum", 0.0)), float(a.get("weight_decay", 0.0)),
            float(a.get("grad_scale", 1.0)), a.get("skip_if"))


def _fusable_update(graph, op, producers):
    """An SGDUpdate whose weight and momentum own their storage and are
    written by it alone, through whole-blob aliases."""
    if op.op_type != "SGDUpdate" or op.accumulate or op.location.device is None \
            or op.location.device < 0 or len(op.inputs) != 4 or len(op.outputs) != 2:
        return False
    for src, new in zip(op.inputs[:3:2], op.outputs):
        sb, nb = graph.blobs[src], graph.blobs[new]
        if sb.alias_of is not None or nb.alias_of != src or nb.offset != 0 \
                or nb.size != sb.size or sb.dtype != nb.dtype:
            return False
        if [w.name for w in producers.get(src, ())] or \
                [w.name for w in producers.get(new, ())] != [op.name]:
            return False
    return graph.blobs[op.inputs[0]].dtype == graph.blobs[op.inputs[2]].dtype


def fuse_sgd_updates(graph):
    """Replace same-setting SGDUpdate ops by one MultiSGDUpdate per group
    (see the module docstring). Returns the names of the new ops."""
    producers = graph.producers()
    groups = {}
    for op in graph.ops.values():
        if _fusable_update(graph, op, producers):
            groups.setdefault(_update_group_key(graph, op), []).append(op)
    created = []
    for k, ((location, thread, lr, dtype, momentum, decay, scale, skip_if), ops) in \
            enumerate(groups.items()):
        if len(ops) < 2:
            continue
        suffix = "" if k == 0 else f"#{k}"
        params_name, momenta_name = PARAM_BUFFER + suffix, MOMENTUM_BUFFER + suffix
        offsets, total = [], 0
        for op in ops:
            offsets.append(total)
            size = graph.blobs[op.inputs[0]].size
            total += -(-size // FLAT_ALIGN) * FLAT_ALIGN
        for name, kind in ((params_name, PARAM_BUFFER_KIND), (momenta_name, STATE_BUFFER_KIND)):
            graph.add_blob(name, (total,), dtype, location, kind=kind)
            graph.add_blob(f"{name}@new", (total,), dtype, location, kind=kind, alias_of=name)
        for op, off in zip(ops, offsets):
            w, _, v, _ = op.inputs
            for blob, root in ((w, params_name), (v, momenta_name)):
                b = graph.blobs[blob]
                b.alias_of, b.offset = root, off
            for new in op.outputs:
                del graph.blobs[new]
            graph.remove_op(op.name)
        attrs = {"momentum": momentum, "weight_decay": decay, "grad_scale": scale,
                 "params": [op.inputs[0] for op in ops],
                 "offsets": offsets, "sizes": [graph.blobs[op.inputs[0]].size for op in ops],
                 "lr_mults": [float(op.attrs.get("lr_mult", 1.0)) for op in ops],
                 "decay_mults": [float(op.attrs.get("decay_mult", 1.0)) for op in ops]}
        if skip_if:  # fp16's overflow flag (graph/loss_scale.py): skipped as one
            attrs["skip_if"] = skip_if
        controls = list(dict.fromkeys(c for op in ops for c in op.control_inputs))
        name = "solver.update" + suffix
        graph.add_op(name, "MultiSGDUpdate",
                     [params_name, momenta_name, lr] + [op.inputs[1] for op in ops],
                     [f"{params_name}@new", f"{momenta_name}@new"], attrs,
                     location=Location(location.rank, location.device, location.ip),
                     thread=thread, control_inputs=controls)
        gone = {op.name for op in ops}  # an op that waited for a fused update waits for it
        for other in graph.ops.values():
            if gone.intersection(other.control_inputs):
                other.control_inputs = list(dict.fromkeys(
                    name if c in gone else c for c in other.control_inputs))
        created.append(name)
    return created


def fuse_for_device(graph, train=True):
    """Both rewrites on a placed graph (the SGD one on a training graph);
    returns the graph."""
    fuse_relu(graph)
    if train:
        fuse_dgrad_relu(graph)
        fuse_sgd_updates(graph)
    graph.infer_shapes().validate()
    return graph
