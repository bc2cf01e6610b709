"""Caffe's SolverParameter -> our solver and checkpoint sections.

    iter_size K        gradient accumulation: the caller (caffe_convert)
                       makes data.train.batch_size K x B, split into
                       parallel.micro_batches K (each micro-batch is
                       Caffe's batch B; the gradient is their mean, as
                       Caffe's Normalize)
    clip_gradients C   solver.clip_gradients C / K: Caffe clips the *sum*
                       of the K gradients to C, ours clips their mean, and
                       ||sum|| > C  <=>  ||mean|| > C / K with the same factor
    snapshot_prefix P  checkpoint.folder P (absolute, resolved against the
                       working directory as Caffe does)
    random_seed S      the config's seed
    test_initialization  solver.test_initialization (Caffe's default true: a
                       test pass at iteration 0 where test_interval is set)
    type / solver_type SGD, Nesterov, AdaGrad, RMSProp, AdaDelta, Adam
"""
import os

from .prototxt import PrototxtError

LR_POLICIES = ("fixed", "step", "multistep", "poly", "exp", "inv")
#: Caffe's solver type (``type: "Adam"`` or ``solver_type: ADAM``) -> ours
SOLVER_TYPES = {"SGD": "sgd", "NESTEROV": "nesterov", "ADAGRAD": "adagrad",
                "RMSPROP": "rmsprop", "ADADELTA": "adadelta", "ADAM": "adam"}


def convert_solver(msg, path, notes):
    """(solver section, checkpoint section, seed or None, iter_size) of a
    SolverParameter."""
    def fail(field, message):
        raise PrototxtError(path, msg.line_of(field), message)

    kind = msg.get("type", msg.get("solver_type", "SGD"))
    if str(kind).upper() not in SOLVER_TYPES:
        fail("type" if msg.has("type") else "solver_type",
             f"solver type '{kind}' is not supported (supported: SGD, Nesterov, AdaGrad, "
             "RMSProp, AdaDelta, Adam)")
    if not msg.has("base_lr"):
        fail(None, "the solver needs base_lr")
    iter_size = msg.get("iter_size", 1)
    if iter_size < 1:
        fail("iter_size", f"iter_size must be >= 1, got {iter_size}")
    if msg.get("regularization_type", "L2") != "L2":
        fail("regularization_type", "only L2 regularization is supported")
    policy = msg.get("lr_policy", "fixed")
    if policy not in LR_POLICIES:
        fail("lr_policy", f"lr_policy '{policy}' is not supported "
                          f"(supported: {', '.join(LR_POLICIES)})")
    solver = {"type": SOLVER_TYPES[str(kind).upper()], "base_lr": msg.get("base_lr"),
              "lr_policy": policy, "momentum": msg.get("momentum", 0.0),
              "weight_decay": msg.get("weight_decay", 0.0),
              "max_iter": msg.get("max_iter", 0), "display": msg.get("display", 0),
              "test_interval": msg.get("test_interval", 0)}
    for key in ("gamma", "power", "stepsize", "momentum2", "delta", "rms_decay"):
        if msg.has(key):
            solver[key] = msg.get(key)
    if msg.all("stepvalue"):
        solver["stepvalues"] = msg.all("stepvalue")
    if msg.all("test_iter"):
        solver["test_iter"] = msg.all("test_iter")[0]
        if len(msg.all("test_iter")) > 1:
            notes.append("solver: several test_iter values; the first is used (one test net)")
    clip = msg.get("clip_gradients", -1.0)
    if clip > 0:
        solver["clip_gradients"] = clip / iter_size
        if iter_size > 1:
            notes.append(f"solver: clip_gradients {clip:g} with iter_size {iter_size}: Caffe "
                         f"clips the sum of the {iter_size} gradients, so solver.clip_gradients "
                         f"is {clip / iter_size:g} on their mean (the same clipping)")
    elif clip == 0:
        fail("clip_gradients", "clip_gradients 0 would zero every gradient; give a positive "
                               "norm, or a negative one (Caffe's default -1) for none")
    checkpoint = {"interval": msg.get("snapshot", 0)}
    if msg.get("snapshot_prefix"):
        folder = os.path.abspath(msg.get("snapshot_prefix"))
        checkpoint["folder"] = folder
        notes.append(f"solver: snapshot_prefix {msg.get('snapshot_prefix')!r} -> "
                     f"checkpoint.folder {folder} (resolved against the working directory, as "
                     "Caffe does): runs without --out go to its numbered subfolders")
    if solver["test_interval"]:  # Caffe tests at iteration 0 too unless told not to
        solver["test_initialization"] = bool(msg.get("test_initialization", True))
    for field in ("solver_mode", "device_id", "net", "train_net", "test_net",
                  "average_loss", "debug_info", "snapshot_format",
                  "snapshot_diff", "snapshot_after_train"):
        if msg.has(field):
            what = {"solver_mode": "the device is chosen by the config's 'device' key",
                    "net": "the net is the NET.prototxt given"}.get(field, "no equivalent")
            notes.append(f"solver: '{field}' (line {msg.line_of(field)}) is ignored: {what}")
    seed = msg.get("random_seed", -1)
    return solver, checkpoint, (seed if seed >= 0 else None), iter_size
