"""The solver as graph: a LearningRate op (iteration blob -> lr blob) and one
update op per learnable parameter: ``SGDUpdate`` (Caffe's formulation,
``v = mu*v + lr*lr_mult*(grad_scale*g + wd*decay_mult*w); w = w - v``) or the
op of another ``solver.type`` (Nesterov, AdaGrad, RMSProp, AdaDelta, Adam,
AdamW; see ops/updates.py). Each keeps its state in blobs ``<param>.<state>``
(``<param>.momentum`` for SGD), which checkpoints save under
``/solver/<param>/<state>``.

Updates write alias blobs (``p@new`` views ``p``), so each update runs only
after every other reader of ``p`` in the iteration has finished.
"""

from ..ops.updates import SOLVER_UPDATES

LR_KEYS = ("base_lr", "lr_policy", "gamma", "stepsize", "stepvalues", "power", "max_iter",
           "warmup_iters", "warmup_start_factor", "min_lr")


#: solver keys each solver type passes to its update ops (besides the multipliers)
UPDATE_KEYS = {"sgd": ("momentum", "weight_decay"), "nesterov": ("momentum", "weight_decay"),
               "adagrad": ("delta", "weight_decay"),
               "rmsprop": ("rms_decay", "delta", "weight_decay"),
               "adadelta": ("momentum", "delta", "weight_decay"),
               "adam": ("momentum", "momentum2", "delta", "weight_decay"),
               "adamw": ("momentum", "momentum2", "delta", "weight_decay")}


def momentum_name(param):
    return state_name(param, "momentum")


def state_name(param, state):
    """The blob holding solver state ``state`` of ``param``."""
    return f"{param}.{state}"


def solver_states(solver_type):
    """The state names of ``solver_type`` (e.g. ``("m", "v")`` for adam)."""
    return SOLVER_UPDATES[solver_type or "sgd"][1]


def lr_attrs(solver):
    """The LearningRate op's attrs of the job's ``solver`` (read by
    attribute): ``ops.lr_policy.learning_rate(lr_attrs(solver), it)`` is
    the rate the op gives at iteration ``it``."""
    return {k: list(v) if isinstance(v, tuple) else v
            for k, v in ((k, getattr(solver, k, None)) for k in LR_KEYS) if v is not None}


def add_solver(graph, grads, solver, thread=0):
    """Emit the lr and update ops for ``grads`` ({param: grad blob}) as the
    job's ``solver`` (job/job.py's SolverSpec, read by attribute) says.
    Returns the list of sink blobs (updated params and momenta)."""
    graph.add_blob("iter", (), "int64", kind="iter", exist_ok=True)  # dropout may add it
    graph.add_blob("lr", (), "float32", kind="lr")
    graph.add_op("solver.lr", "LearningRate", ["iter"], ["lr"], lr_attrs(solver), thread=thread)
    kind = solver.type or "sgd"
    op_type, states = SOLVER_UPDATES[kind]
    extra = ["lr"] + (["iter"] if op_type in ("AdamUpdate", "AdamWUpdate") else [])
    sinks = []
    for param, grad in grads.items():
        blob = graph.blobs[param]
        if not blob.attrs.get("learnable", True):
            continue
        names = [state_name(param, s) for s in states]
        for m in names:
            graph.add_blob(m, blob.shape, blob.dtype, blob.location, kind="state")
            graph.add_blob(f"{m}@new", blob.shape, blob.dtype, blob.location, kind="state",
                           alias_of=m)
        graph.add_blob(f"{param}@new", blob.shape, blob.dtype, blob.location, kind="param",
                       alias_of=param)
        attrs = {k: float(getattr(solver, k) or 0.0) for k in UPDATE_KEYS[kind]}
        attrs.update({"lr_mult": blob.attrs.get("lr_mult", 1.0),
                      "decay_mult": blob.attrs.get("decay_mult", 1.0), "grad_scale": 1.0})
        outs = [f"{param}@new"] + [f"{m}@new" for m in names]
        graph.add_op(f"{param}.update", op_type, [param, grad] + names + extra, outs, attrs,
                     location=blob.location, thread=thread)
        sinks += outs
    return sinks
