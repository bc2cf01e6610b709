"""The config's schema as tables: the top-level keys, each section's
defaults, the choices, and the meaning of every key (docs/config.md is
generated from them, with the layers' own declarations). Validation is
``io/config.py``; the checkers of single values are ``io/checks.py``.

To add a key, add its default here, a checker to its section's table in
io/config.py, a one-line meaning to KEY_DOCS and its field to the part of
the Job in io/job.py; then run ``python -m purine_mpi.docgen --write``.
Imports only ``io/transform`` (its keys).

Layer: job (docs/DESIGN.md); may import the foundation, devices, data, ops and
graph layers below it, and its own.
"""
from .transform import TRANSFORM_KEYS


# The schema. docs/config.md is generated from these tables (and from the
# layer registry, purine_mpi/layers): after changing keys run
#     python -m purine_mpi.docgen --write
TOP_KEYS = ("name", "data", "net", "graph", "solver", "parallel", "checkpoint", "seed",
            "backend", "device", "tf32", "cuda_graph", "memory_plan")


LR_POLICIES = ("fixed", "step", "multistep", "poly", "exp", "inv", "cosine")


SOLVER_TYPES = ("sgd", "nesterov", "adagrad", "rmsprop", "adadelta", "adam", "adamw")


PARALLEL_SCHEMES = ("data", "none", "pipeline", "hybrid")


PARALLEL_MODES = ("sync", "async", "sync_ps")


PIPELINE_SCHEDULES = ("1f1b", "gpipe")


BACKENDS = ("auto", "numpy", "cupy")


DATA_SOURCES = ("hdf5", "lmdb", "synthetic")


SOLVER_DEFAULTS = {
    "type": "sgd", "base_lr": 0.01, "momentum": 0.9, "weight_decay": 0.0,
    "lr_policy": "fixed", "gamma": 0.1, "stepsize": None, "stepvalues": [],
    "power": 1.0, "max_iter": 1000, "test_interval": 0, "test_iter": None,
    "display": 20, "warmup_iters": 0, "momentum2": 0.999, "delta": 1e-8, "rms_decay": 0.99,
    "test_initialization": False, "early_stop": None, "clip_gradients": None,
}


PARALLEL_DEFAULTS = {
    "scheme": "data", "mode": "sync", "bucket_mb": 4, "first_bucket_mb": 1, "min_buckets": 4,
    "split_params": True, "defer_update": True, "ps_ranks": 1, "max_staleness": 0,
    "stall_timeout": 300, "check_collectives": False,
    "stages": {}, "micro_batches": 1, "schedule": "1f1b",
}


CHECKPOINT_DEFAULTS = {"interval": 0, "keep": 3, "best": None, "folder": None}


DATA_KEYS = ("source", "path", "split", "batch_size", "shuffle", "in_memory", "external", "shape",
             "classes", "num_samples", "seed") + TRANSFORM_KEYS


SYNTHETIC_NUM_SAMPLES = 1024


#: top-level key -> (type, default, meaning)
TOP_DOC = {
    "name": ("string", "the file's stem", "names the run: its output goes to `runs/<name>/<N>`"),
    "seed": ("integer in [0, 2^63)", 0, "seeds the initial weights, the data order, the random crops "
             "and flips, and dropout"),
    "data": ("mapping", {}, "`train:` and `test:` data specs (see [data](#data))"),
    "net": ("list", "—", "the layers, in order (see [net](#net)); give `net` or `graph`"),
    "graph": ("list", "—", "instead of `net`: the low-level list of blob and op entries (see "
              "[graph](#graph))"),
    "solver": ("mapping", {}, "the optimiser and the learning-rate schedule (see "
               "[solver](#solver))"),
    "parallel": ("mapping", {}, "how the ranks share the work (see [parallel](#parallel))"),
    "checkpoint": ("mapping", {}, "how often to write checkpoints and how many to keep (see "
                   "[checkpoint](#checkpoint))"),
    "device": ("integer >= -1", -1, "-1: the CPU; D >= 0: GPU D + the rank's index on its node "
               "(modulo the node's GPUs); needs CuPy"),
    "backend": ("one of auto, numpy, cupy", "`auto`", "the array library: `numpy` forbids a "
                "device, `cupy` without a device means device 0"),
    "tf32": ("true/false", False, "GPU float32 GEMMs may use TensorFloat-32 (faster, about "
             "1e-3 relative error)"),
    "cuda_graph": ("true/false", True, "on a GPU, replay each iteration as captured CUDA "
                   "graphs (the runs of GPU ops between host and communication ops); `false`: "
                   "eager stream dispatch, for debugging (per-op trace events); ignored on a "
                   "CPU"),
    "memory_plan": ("true/false", True, "plan the memory of the host and of each GPU from "
                    "the static graph: blobs written and read within one iteration share one "
                    "arena per device wherever the graph "
                    "orders their lifetimes apart (`graph --memory` prints the plan); "
                    "parameters, solver state, losses, metrics and what runs on into the next "
                    "iteration keep their own memory; `false`: one buffer per blob, for "
                    "debugging (the results are bit-identical)"),
}


#: section -> {key: meaning}, for every key of the section's defaults table
KEY_DOCS = {
    "solver": {
        "type": "the update rule (see [solver types](#solver-types))",
        "base_lr": "the base learning rate",
        "momentum": "momentum (sgd, nesterov); β₁ of adam/adamw; ρ of adadelta; adagrad and "
                    "rmsprop take none (a nonzero value is an error)",
        "weight_decay": "L2 regularisation, times each parameter's decay_mult (adamw: "
                        "decoupled decay)",
        "lr_policy": "the learning-rate schedule (see [lr policies](#lr-policies))",
        "gamma": "factor of step, multistep, exp and inv",
        "stepsize": "iterations per step (lr_policy step)",
        "stepvalues": "increasing iterations at which multistep multiplies by gamma",
        "power": "exponent of poly and inv",
        "max_iter": "iterations to train (`--iters` overrides); also the horizon of poly "
                    "and cosine",
        "test_interval": "evaluate on data.test every this many iterations (0: only at the "
                         "end)",
        "test_iter": "test batches per evaluation, each sample counted as often as it is "
                     "read (null: one pass that counts each sample of the test split once, "
                     "on any number of ranks)",
        "display": "log the mean training loss every this many iterations (0: never)",
        "warmup_iters": "multiply the rate by a linear ramp (it + 1) / W over the first W "
                        "iterations",
        "momentum2": "β₂ of adam and adamw",
        "delta": "ε of adagrad, rmsprop, adadelta, adam and adamw",
        "rms_decay": "decay of the squared-gradient average of rmsprop",
        "test_initialization": "run a test pass before the first iteration (as Caffe's "
                               "`test_initialization`, Lightning's sanity check); it is row "
                               "`iter` = the start iteration of metrics.jsonl",
        "clip_gradients": "scale the gradients by min(1, C / ‖g‖) before the update, ‖g‖ the "
                          "global L2 norm of the reduced (averaged over ranks and micro-"
                          "batches) gradients of all learnable parameters, before weight decay "
                          "(Caffe's clip_gradients, Lightning's gradient_clip_val; every "
                          "scheme; on a GPU computed on the device); null: no clipping",
        "early_stop": "stop (with a checkpoint, exit 0) when the test figure `metric` "
                      "(`accuracy`, `loss`, ...) has not improved by more than `min_delta` "
                      "(default 0) in `patience` test passes in a row (default 5); `mode` "
                      "`max` or `min` (default: min for a loss, else max)",
    },
    "parallel": {
        "scheme": "the composition (see [schemes](#schemes))",
        "mode": "with scheme data on several ranks: allreduce or parameter servers (see "
                "[modes](#modes)); pipeline and hybrid run sync only",
        "bucket_mb": "largest gradient bucket, in MiB (sync data parallelism)",
        "first_bucket_mb": "largest first bucket, in MiB (it is also at most half the others)",
        "min_buckets": "at least this many buckets when the model has that many parameter "
                       "blobs, so a small model still overlaps",
        "split_params": "split a fully connected weight whose gradient is over 1 MiB and "
                        "over twice the bucket size into row chunks, each reduced and "
                        "updated on its own, so its allreduce starts with its first rows "
                        "(sync data parallelism; the same result up to float rounding)",
        "defer_update": "let the last buckets' allreduce and the weight updates behind "
                        "them finish while the next iteration's forward runs; each op of "
                        "the next iteration waits only for the updates of what it reads "
                        "(sync data parallelism on the CPU; the same result, bit for bit)",
        "ps_ranks": "parameter-server modes: the last K ranks are servers",
        "max_staleness": "mode async: how many updates a worker's weights may lag (0: "
                         "synchronous SGD)",
        "stall_timeout": "seconds a collective or transfer may wait before the job ends with "
                         "a message naming it",
        "check_collectives": "verify at start-up that every rank posts the same sequence of "
                             "collectives",
        "stages": "schemes pipeline and hybrid: {layer name: stage}, every layer, stages "
                  "0..S-1",
        "micro_batches": "split each rank's batch into M micro-batches (divides "
                         "data.train.batch_size); pipeline stages overlap them, scheme data "
                         "accumulates gradients",
        "schedule": "order of the micro-batches on a stage: 1f1b (one forward, one backward; "
                    "stage s of p allocates min(p-s, M) micro-batches' activations) or gpipe "
                    "(all forwards, then all backwards; all M)",
    },
    "checkpoint": {
        "interval": "write `ckpt_<iter>.h5` every this many iterations (0: only at the end and "
                    "on a stop)",
        "keep": "keep the newest K checkpoints of this run (0: keep all); `latest.h5` is never "
                "deleted",
        "best": "also keep `best_<iter>.h5` for the `keep` best test passes (default 1) by the "
                "test figure `metric` (`accuracy`, `loss`, ...), `mode` `max` or `min` "
                "(default: min for a loss, else max); rotation of the newest checkpoints "
                "never deletes them",
        "folder": "without `--out`, the runs go to numbered folders `<folder>/<N>` instead "
                  "of `runs/<name>/<N>` (a relative folder is relative to the working "
                  "directory; `convert caffe` sets it from Caffe's snapshot_prefix)",
    },
}


#: data spec key -> (type, default, meaning); every key of DATA_KEYS
DATA_DOC = {
    "source": ("one of hdf5, lmdb, synthetic", "hdf5 with a path to a file, lmdb with a path "
               "to a folder, synthetic with a shape", "where the samples come from"),
    "path": ("string", "—", "hdf5: the data file; lmdb: the database folder (holding "
             "data.mdb); relative to the working directory or to the config's folder"),
    "split": ("string or null", "`null` (hdf5), the phase (synthetic)",
              "hdf5: the group holding data and label (null: the file's top level)"),
    "batch_size": ("integer > 0", "required", "samples per rank per iteration (the global "
                   "batch is ranks × batch_size)"),
    "shuffle": ("true/false", "`true` for train, `false` for test", "a new permutation each epoch, "
                "from the seed and the epoch"),
    "in_memory": ("auto, true or false", "`auto`", "hdf5: load the split (true), read each "
                  "batch from the file (false), or load it when its float32 size fits a "
                  "quarter of the memory (auto)"),
    "external": ("true/false", "`false`", "hdf5: allow the split's data and label to read "
                 "from other files (external storage, external links, virtual datasets); "
                 "every such file must then exist and be large enough"),
    "shape": ("list of integers", "—", "synthetic: one sample's shape [C, H, W]"),
    "classes": ("integer > 0", "—", "synthetic: the number of classes"),
    "num_samples": ("integer > 0", SYNTHETIC_NUM_SAMPLES, "synthetic: samples in the split"),
    "seed": ("integer in [0, 2^63)", "the config's seed", "seed of the shuffle and of synthetic data"),
    "scale": ("number > 0", "—", "transform: multiply, after the mean is subtracted"),
    "mean": ("number or list", "—", "transform: subtract (one value, or one per channel; "
             "Caffe's mean_value)"),
    "mean_file": ("string", "—", "transform: subtract this Caffe `.binaryproto` mean image "
                  "(C×H×W, the samples' shape before the crop; not with `mean`), pixel by "
                  "pixel, before the crop's window is flipped"),
    "mirror": ("true/false", False, "transform: random horizontal flip, training only"),
    "crop_size": ("integer > 0", "—", "transform: a square window, random in training, "
                  "centred in testing"),
}


#: choice list -> {value: meaning}, for every value a key accepts
CHOICE_DOCS = {
    "lr_policy": {
        "fixed": "base_lr",
        "step": "base_lr · gamma ^ floor(iter / stepsize)",
        "multistep": "base_lr · gamma ^ (number of stepvalues <= iter)",
        "exp": "base_lr · gamma ^ iter",
        "inv": "base_lr · (1 + gamma · iter) ^ (−power)",
        "poly": "base_lr · (1 − iter / max_iter) ^ power",
        "cosine": "base_lr · (1 + cos(π · iter / max_iter)) / 2",
    },
    "solver_type": {
        "sgd": "v = momentum·v + rate·g; w −= v (Caffe's SGD)",
        "nesterov": "v' = momentum·v + rate·g; w −= (1 + momentum)·v' − momentum·v",
        "adagrad": "h += g²; w −= rate·g / (√h + delta)",
        "rmsprop": "h = rms_decay·h + (1 − rms_decay)·g²; w −= rate·g / (√h + delta)",
        "adadelta": "h = ρ·h + (1 − ρ)·g²; u = g·√(h₂ + delta) / √(h + delta); "
                    "h₂ = ρ·h₂ + (1 − ρ)·u²; w −= rate·u (ρ = momentum)",
        "adam": "m = β₁·m + (1 − β₁)·g; v = β₂·v + (1 − β₂)·g²; w −= rate / (1 − β₁ᵗ) · m / "
                "(√v / √(1 − β₂ᵗ) + delta), t = iter + 1 (β₁ = momentum, β₂ = momentum2)",
        "adamw": "w ×= 1 − rate·weight_decay·decay_mult, then adam without the decay in g",
    },
    "scheme": {
        "data": "every rank runs a replica on its shard of the batch; gradients are summed "
                "by allreduce ops in the graph (mode sync) or through parameter servers",
        "none": "no composition: each rank trains its own replica on its shard of the data, "
                "exchanging no gradients (tests, debugging)",
        "pipeline": "layers are placed on ranks by `stages` (one rank per stage); each edge "
                    "between ranks becomes a Send/Recv pair",
        "hybrid": "R replicas × p stages (rank = replica·p + stage): each replica is a "
                  "pipeline on its shard of the batch, and each stage allreduces its "
                  "gradients over the R replicas; the world size is a multiple of p >= 2",
    },
    "mode": {
        "sync": "allreduce of gradient buckets, posted as soon as each is ready",
        "async": "parameter servers; workers push gradients and pull weights without waiting, "
                 "up to max_staleness",
        "sync_ps": "parameter servers that average the workers' gradients each iteration "
                   "(Purine's synchronous variant)",
    },
    "schedule": {
        "1f1b": "after p−s−1 warm-up forwards on stage s of p, one forward then one backward",
        "gpipe": "all forwards, then all backwards",
    },
    "source": {
        "hdf5": "an HDF5 file holding data (N×C×H×W, float or uint8) and label (N integers)",
        "lmdb": "a Caffe LMDB of Datum records (raw uint8, float_data, or JPEG/PNG decoded "
                "to BGR as Caffe does), read record by record from the memory-mapped file; "
                "needs `pip install 'purine_mpi[caffe]'`",
        "synthetic": "random samples of `shape` with random labels below `classes` (benchmarks)",
    },
    "backend": {
        "auto": "CuPy when device >= 0, else NumPy",
        "numpy": "the CPU",
        "cupy": "the GPU (device 0 unless device is given)",
    },
}


#: the choices CHOICE_DOCS documents
CHOICES = {"lr_policy": LR_POLICIES, "solver_type": SOLVER_TYPES, "scheme": PARALLEL_SCHEMES,
           "mode": PARALLEL_MODES, "schedule": PIPELINE_SCHEDULES, "source": DATA_SOURCES,
           "backend": BACKENDS}
