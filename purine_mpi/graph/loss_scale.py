"""fp16's dynamic loss scaling as graph (``precision: fp16``,
``loss_scale``): a pass over a rank's composed training graph, after the
gradients are reduced and before ``graph/clip.py``'s clipping.

    <loss>.grad_seed      Constant -> <seed>.weight  (the loss weight)
    <loss>.grad_seed.scale Scaled [loss_scale, <seed>.weight] -> <seed>
                          (<seed>: the seed blob, <loss>.grad or <loss>.grad@seed)
    loss_scale.check      FoundInf [g_i: lr_mult_i > 0] -> loss_scale.found_inf
    loss_scale.any        Allreduce (reduce max) -> loss_scale.found_inf.all   (``group``)
    g_i.unscale           Unscale [g_i, loss_scale] -> g_i@unscale   (alias of g_i)
    loss_scale.step       AdamStep [iter, loss_scale.skipped] -> loss_scale.adam_iter
                          (Adam and AdamW read it instead of iter)
    loss_scale.update     LossScaleUpdate [flag, loss_scale, good_steps, skipped]
                          -> their @new aliases, loss_scale.skip
    u_i                   reads g_i@unscale; after loss_scale.update; attr
                          skip_if: loss_scale.skip (runs not at all when set)
    loss_scale.inject     InjectInf [g_1] -> g_1@inject   (``inject``
                          only: developers, tests; PURINE_FP16_INJECT_INF)

On a GPU the two deciding ops (LossScaleUpdate, AdamStep) are host ops
(parallel/placement.py): the flag comes back by one copy, the scale goes
to the device by one.

``loss_scale``, ``loss_scale.good_steps`` and ``loss_scale.skipped`` are
persistent blobs (kind state) at the gradients' location; the update op
keeps them in checkpoints (ops/loss_scale.py). Every rank holding updates
takes part in the one Allreduce of the flag (``seq`` after the graph's
other comm ops), so every rank skips the same steps. A frozen parameter's
gradient (``lr_mult`` 0) is not checked: its update changes nothing
(ops/updates.py's ``frozen``), so an inf there skips no step, as torch's
GradScaler sees no gradient of a parameter that does not require one. Imports the graph and
the solver table (the graph layer).
"""
from ..ops.updates import frozen
from .clip import group_attrs, reroute_grad, update_ops

#: the blobs of the scale and its counters (kind state)
SCALE, GOOD, SKIPPED = "loss_scale", "loss_scale.good_steps", "loss_scale.skipped"
FLAG, SKIP, UPDATE = "loss_scale.found_inf", "loss_scale.skip", "loss_scale.update"
LOSS_SCALE_OPS = ("FoundInf", "Unscale", "AdamStep", "LossScaleUpdate")


def seed_ops(graph):
    """The loss gradients' seed ops (graph/grad.py: a Constant per loss, per
    micro-batch copy)."""
    return [op for op in graph.ops.values()
            if op.op_type == "Constant" and ".grad_seed" in op.name]


def add_loss_scale(graph, settings, group=None, seq=None, thread=0, inject=None):
    """Scale ``graph``'s loss gradient and unscale its gradients in place,
    skipping the updates of a step with an inf/nan gradient (see the module
    docstring). ``settings``: the ``loss_scale`` section (init_scale,
    growth_factor, backoff_factor, growth_interval); ``group``: the ranks
    that decide together (None: this rank alone); ``seq``: their
    Allreduce's; ``inject``: an iteration (0-based) on which the first
    gradient is made +inf (developers, tests: ``PURINE_FP16_INJECT_INF``).
    Returns the graph."""
    from .core import CPU
    updates = update_ops(graph)
    grads = [op.inputs[1] for op in updates]
    if inject is not None and grads:
        grads[0] = _inject(graph, grads[0], int(inject), updates[0].thread)
    location = graph.blobs[grads[0]].location if grads else CPU
    for name, dtype in ((SCALE, "float32"), (GOOD, "int64"), (SKIPPED, "int64")):
        graph.add_blob(name, (1,), dtype, location, kind="state")
        graph.add_blob(f"{name}@new", (1,), dtype, location, kind="state", alias_of=name)
    for op in seed_ops(graph):
        seed = op.outputs[0]
        blob = graph.blobs[seed]
        weight = graph.free_name(f"{seed}.weight")
        graph.add_blob(weight, blob.shape, blob.dtype, blob.location, kind="grad")
        op.outputs[0] = weight
        graph.add_op(graph.free_name(f"{op.name}.scale"), "Scaled", [SCALE, weight], [seed],
                     location=op.location, thread=op.thread)
    graph.add_blob(FLAG, (1,), "float32", location, kind="grad")
    flag_op = "loss_scale.check"
    checked = [g for op, g in zip(updates, grads) if not frozen(op.attrs)]
    graph.add_op(flag_op, "FoundInf", checked or [SCALE], [FLAG], location=location,
                 thread=thread)
    flag = FLAG
    if group is not None and len(group) > 1:
        flag, flag_op = f"{FLAG}.all", "loss_scale.any"
        graph.add_blob(flag, (1,), "float32", location, kind="grad")
        graph.add_op(flag_op, "Allreduce", [FLAG], [flag],
                     dict(group_attrs(graph, group, seq), reduce="max"),
                     location=location, thread=thread)
    step = None
    for op, grad in zip(updates, grads):
        reroute_grad(graph, op, grad, "unscale", "Unscale", [grad, SCALE])
        op.attrs["skip_if"] = SKIP  # the host's copy of the decision
        op.control_inputs.append(UPDATE)
        if op.op_type in ("AdamUpdate", "AdamWUpdate"):  # the step count of applied steps
            step = step or _adam_step(graph, op.inputs[-1], location, thread)
            op.inputs[-1] = step
    graph.add_blob(SKIP, (1,), "float32", location, kind="grad")
    graph.add_op(UPDATE, "LossScaleUpdate", [flag, SCALE, GOOD, SKIPPED],
                 [f"{SCALE}@new", f"{GOOD}@new", f"{SKIPPED}@new", SKIP],
                 {"init_scale": float(settings.init_scale),
                  "growth_factor": float(settings.growth_factor),
                  "backoff_factor": float(settings.backoff_factor),
                  "growth_interval": int(settings.growth_interval)},
                 location=location, thread=thread)
    return graph.infer_shapes()


def _adam_step(graph, iteration, location, thread):
    """The blob of ``iteration`` less the skipped steps (AdamStep)."""
    src = graph.blobs[iteration]
    name = "loss_scale.adam_iter"
    graph.add_blob(name, src.shape, src.dtype, location, kind="grad")
    graph.add_op("loss_scale.step", "AdamStep", [iteration, SKIPPED], [name],
                 location=location, thread=thread)
    return name


def _inject(graph, grad, iteration, thread):
    """``grad`` with +inf in its first element on ``iteration``
    (InjectInf): the name of the alias the loss scaling reads instead."""
    blob = graph.blobs[grad]
    it = next(n for n, b in graph.blobs.items() if b.kind == "iter")
    name = f"{grad}@inject"
    graph.add_blob(name, blob.shape, blob.dtype, blob.location, kind="grad", alias_of=grad)
    graph.add_op("loss_scale.inject", "InjectInf", [grad], [name],
                 {"iteration": int(iteration), "iter_blob": it}, location=blob.location,
                 thread=thread)
    return name
