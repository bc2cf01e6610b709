"""The solver as graph: a LearningRate op (iteration blob -> lr blob) and one
SGDUpdate op per learnable parameter, Caffe's formulation (DESIGN.md §6):
``v = mu*v + lr*lr_mult*(grad_scale*g + wd*decay_mult*w); w = w - v``.

Updates write alias blobs (``p@new`` views ``p``), so each update runs only
after every other reader of ``p`` in the iteration has finished."""

LR_KEYS = ("base_lr", "lr_policy", "gamma", "stepsize", "stepvalues", "power", "max_iter",
           "warmup_iters", "warmup_start_factor", "min_lr")


def momentum_name(param):
    return f"{param}.momentum"


def add_solver(graph, grads, solver, thread=0):
    """Emit the lr and update ops for ``grads`` ({param: grad blob}).
    Returns the list of sink blobs (updated params and momenta)."""
    graph.add_blob("iter", (), "int64", kind="iter")
    graph.add_blob("lr", (), "float32", kind="lr")
    graph.add_op("solver.lr", "LearningRate", ["iter"], ["lr"],
                 {k: solver[k] for k in LR_KEYS if solver.get(k) is not None}, thread=thread)
    sinks = []
    for param, grad in grads.items():
        blob = graph.blobs[param]
        if not blob.attrs.get("learnable", True):
            continue
        m = momentum_name(param)
        graph.add_blob(m, blob.shape, blob.dtype, blob.location, kind="state")
        graph.add_blob(f"{param}@new", blob.shape, blob.dtype, blob.location, kind="param",
                       alias_of=param)
        graph.add_blob(f"{m}@new", blob.shape, blob.dtype, blob.location, kind="state",
                       alias_of=m)
        attrs = {"momentum": float(solver.get("momentum", 0.0)),
                 "weight_decay": float(solver.get("weight_decay", 0.0)),
                 "lr_mult": blob.attrs.get("lr_mult", 1.0),
                 "decay_mult": blob.attrs.get("decay_mult", 1.0),
                 "grad_scale": 1.0}
        graph.add_op(f"{param}.update", "SGDUpdate", [param, grad, m, "lr"],
                     [f"{param}@new", f"{m}@new"], attrs, location=blob.location, thread=thread)
        sinks += [f"{param}@new", f"{m}@new"]
    return sinks
