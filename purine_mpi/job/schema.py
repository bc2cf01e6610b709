"""The config's keys, each declared once (``ConfigKey``, job/keys.py: its
name, checker, default and meaning; the checker's ``doc`` is its type):
the top-level keys (TOP), the sections (SOLVER, PARALLEL, CHECKPOINT), the
data spec keys (DATA), and the choices with their meanings. The
validation (job/config.py), the defaults, the ``Job``'s fields (job/job.py)
and docs/config.md (with the layers' own declarations) are derived from
these tables.

To add a key, add its ``ConfigKey`` to its section's table below (and read
the job's field where it is used); then run
``python -m purine_mpi.tools.docgen --write``. Imports ``job/keys``, ``job/checks``
and ``data/transform`` (its keys).
"""
from .checks import (_bool, _check_folder, _check_name, _check_patterns, _check_stages, _choice,
                     _int, _num, _optional, _size, _stepvalues, check_seed)
from .keys import (ENTRIES, INT_MAP, TUPLE, BestSpec, ConfigKey as Key, EarlyStopSpec, Typed,
                   defaults_of, typed_watch, watch_check)
from ..base.precision import PRECISIONS
from ..data.transform import TRANSFORM_KEYS


LR_POLICIES = ("fixed", "step", "multistep", "poly", "exp", "inv", "cosine")


SOLVER_TYPES = ("sgd", "nesterov", "adagrad", "rmsprop", "adadelta", "adam", "adamw")


PARALLEL_SCHEMES = ("data", "none", "pipeline", "hybrid", "tensor", "sharded")
#: parallel.scheme: auto: train chooses one of the schemes at start-up (plan
#: --choose's choice, tools/choose.py); no scheme of its own
AUTO_SCHEME = "auto"


PARALLEL_MODES = ("sync", "async", "sync_ps")


#: parallel.shard: ZeRO's stages the config language names (job/config.py
#: refuses those scheme sharded does not build yet; plan --choose tries each)
SHARD_STAGES = (1, 2, 3)


PIPELINE_SCHEDULES = ("1f1b", "gpipe")
TRANSPORTS = ("auto", "one_sided", "two_sided")


BACKENDS = ("auto", "numpy", "cupy")


RECOMPUTE_MODES = ("none", "full", "selective")


GRAD_DTYPES = ("fp32", "bf16")


DATA_SOURCES = ("hdf5", "lmdb", "text", "synthetic")


SYNTHETIC_NUM_SAMPLES = 1024


# ------------------------------------------------------------- the sections
SOLVER = (
    Key("type", _choice(SOLVER_TYPES), "sgd", "the update rule (see [solver types](#solver-types))"),
    Key("base_lr", _num(0), 0.01, "the base learning rate"),
    Key("momentum", _num(0, below=1), 0.9,
        "momentum (sgd, nesterov); β₁ of adam/adamw; ρ of adadelta; adagrad and rmsprop take "
        "none (a nonzero value is an error)"),
    Key("weight_decay", _num(0), 0.0, "L2 regularisation, times each parameter's decay_mult "
        "(adamw: decoupled decay)"),
    Key("lr_policy", _choice(LR_POLICIES), "fixed",
        "the learning-rate schedule (see [lr policies](#lr-policies))"),
    Key("gamma", _num(0, strict=True), 0.1, "factor of step, multistep, exp and inv"),
    Key("stepsize", _optional(_int(1)), None, "iterations per step (lr_policy step)"),
    Key("stepvalues", _stepvalues, [], "increasing iterations at which multistep multiplies by "
        "gamma", typed=TUPLE),
    Key("power", _num(0), 1.0, "exponent of poly and inv"),
    Key("min_lr", _num(0), 0.0, "the rate cosine decays to (torch's eta_min); at most base_lr "
        "(above it the rate would rise over the run: exit 2)"),
    Key("max_iter", _int(0), 1000, "iterations to train (`--iters` overrides); also the "
        "horizon of poly and cosine"),
    Key("test_interval", _int(0), 0, "evaluate on data.test every this many iterations (0: "
        "only at the end)"),
    Key("test_iter", _optional(_int(1)), None, "test batches per evaluation, each sample "
        "counted as often as it is read (null: one pass that counts each sample of the test "
        "split once, on any number of ranks)"),
    Key("display", _int(0), 20, "log the mean training loss every this many iterations (0: "
        "never)"),
    Key("display_seconds", _num(0), 30.0, "also log a progress line (iteration, the latest "
        "loss rank 0 knows, images/s, ETA; no metrics row) when this many seconds have passed "
        "since the last line, for iterations slower than `display` makes visible (0: never)"),
    Key("warmup_iters", _int(0), 0, "multiply the rate by a linear ramp (it + 1) / W over the "
        "first W iterations"),
    Key("momentum2", _num(0, below=1), 0.999, "β₂ of adam and adamw"),
    Key("delta", _num(0, strict=True), 1e-8, "ε of adagrad, rmsprop, adadelta, adam and adamw"),
    Key("rms_decay", _num(0, below=1), 0.99, "decay of the squared-gradient average of rmsprop"),
    Key("test_initialization", _optional(_bool), None, "run a test pass before the first "
        "iteration (as Caffe's `test_initialization`, Lightning's sanity check, nanoGPT's "
        "`eval` at iteration 0); it is row `iter` = the start iteration of metrics.jsonl. "
        "null: true when `data.test` is a `text` source (a language model's val loss at "
        "iteration 0, as nanoGPT prints it), false otherwise"),
    Key("early_stop", watch_check(EarlyStopSpec, "mapping {metric, patience, min_delta, mode} "
                                                 "or null"), None,
        "stop (with a checkpoint, exit 0) when the test figure `metric` (`accuracy`, `loss`, "
        "...) has not improved by more than `min_delta` (default 0) in `patience` test passes "
        "in a row (default 5); `mode` `max` or `min` (default: min for a loss, else max); "
        "not with parameter servers (`parallel.mode` sync_ps, async); needs `data.test`, and "
        "`metric` one of the net's test figures (checked at start-up)",
        typed=typed_watch(EarlyStopSpec)),
    Key("clip_gradients", _optional(_num(0, strict=True)), None,
        "scale the gradients by min(1, C / ‖g‖) before the update, ‖g‖ the global L2 norm of "
        "the reduced (averaged over ranks and micro-batches) gradients of all learnable "
        "parameters, each counted once (a weight held whole on every tensor shard too), "
        "before weight decay; a frozen parameter (`lr_mult: 0`) counts not, as Caffe computes "
        "no gradient for it and torch's clip_grad_norm_ sees none (Caffe's clip_gradients, "
        "Lightning's "
        "gradient_clip_val; every scheme; on a GPU computed on the device); null: no "
        "clipping"),
)

PARALLEL = (
    Key("scheme", _choice(PARALLEL_SCHEMES + (AUTO_SCHEME,)), "data", "the composition (see [schemes](#schemes))"),
    Key("mode", _choice(PARALLEL_MODES), "sync", "with scheme data on several ranks: allreduce "
        "or parameter servers (see [modes](#modes)); pipeline and hybrid run sync only"),
    Key("bucket_mb", _num(0, strict=True), 4, "largest gradient bucket, in MiB (sync data "
        "parallelism)"),
    Key("first_bucket_mb", _num(0, strict=True), 1, "largest first bucket, in MiB (it is also "
        "at most half the others)"),
    Key("min_buckets", _int(1), 4, "at least this many buckets when the model has that many "
        "parameter blobs, so a small model still overlaps"),
    Key("split_params", _bool, True, "split a fully connected weight whose gradient is over "
        "1 MiB and over twice the bucket size into row chunks, each reduced and updated on its "
        "own, so its allreduce starts with its first rows (sync data parallelism; the same "
        "result up to float rounding)"),
    Key("defer_update", _bool, True, "let the last buckets' allreduce and the weight updates "
        "behind them finish while the next iteration's forward runs; each op of the next "
        "iteration waits only for the updates of what it reads (sync data parallelism on the "
        "CPU; the same result, bit for bit)"),
    Key("backend", _choice(("mpi", "nccl", "auto")), "mpi", "who reduces the gradient buckets "
        "of sync data parallelism on GPUs: mpi (the comm ops, through host staging unless the "
        "MPI is CUDA-aware), nccl (an ncclAllReduce per bucket on the device, inside the "
        "captured iteration; CuPy with NCCL and one GPU per rank, else an error) or auto (nccl "
        "where it can run, else mpi; the start-up block says which and why)"),
    Key("grad_dtype", _choice(GRAD_DTYPES), "fp32", "the dtype the gradient buckets cross "
        "the ranks in: fp32, or bf16 (each bucket rounded to bfloat16, reduced, widened back "
        "before the mean and the update: half the bytes of the allreduce or reduce-scatter; "
        "the master weights, local gradients and optimizer stay float32). Mode sync: schemes "
        "data and sharded through two-sided MPI on the CPU or NCCL on GPUs; hybrid (each "
        "stage's buckets), tensor (each tensor shard's, over the replicas; the tensor groups' "
        "activations stay float32) and sharded with stages or with tensor_parallel (shard 1, "
        "2 or 3) on the CPU; no effect, noted, where nothing is reduced (pipeline, none, tensor, hybrid "
        "and sharded on one replica); each add of the reduction rounds to bfloat16 (docs/parallel.md, "
        "\"Gradients in bfloat16\")"),
    Key("ps_ranks", _int(1), 1, "parameter-server modes: the last K ranks are servers"),
    Key("max_staleness", _int(0), 0, "mode async: how many updates a worker's weights may lag "
        "(0: synchronous SGD)"),
    Key("stall_timeout", _num(0, strict=True), 300, "seconds a collective or transfer may wait "
        "before the job ends with a message naming it"),
    Key("transport", _choice(TRANSPORTS), "auto", "how activations and gradients cross "
        "between ranks: one_sided puts them into MPI windows (a shared window between ranks "
        "of one node, an RMA window between hosts), two_sided sends them (Send/Recv); auto "
        "picks per pair of ranks: shared windows on one node, RMA windows between hosts "
        "where the network does RDMA, else two-sided (see docs/parallel.md)"),
    Key("check_collectives", _bool, False, "verify at start-up that every rank posts the same "
        "sequence of collectives"),
    Key("stages", _check_stages, {}, "schemes pipeline, hybrid and sharded (shard 1, 2 and "
        "3: each stage's replicas shard it): {layer name: stage}, every layer, stages 0..S-1; "
        "or the number of stages S (Megatron-LM's pipeline_model_parallel_size): the layers "
        "in the net's order cut into S contiguous stages of about equal forward+backward "
        "FLOPs, resolved at load into the map (the start-up block, `graph --np` and `plan` "
        "print it; see [parallel.md](parallel.md))",
        typed=INT_MAP),
    Key("tensor_parallel", _int(1), 1, "schemes tensor and sharded (shard 1, 2 and 3: "
        "each tensor shard's replicas shard its model state): the ranks of a tensor-parallel group "
        "(Megatron-LM's tensor_model_parallel_size); the world is replicas x this many ranks; "
        "schemes pipeline and hybrid: each stage split across this many ranks, the world "
        "(replicas x) stages x this many, rank = (replica·p + stage)·t + shard (see "
        "[parallel.md](parallel.md))"),
    Key("shard", _int(1), 1, "scheme sharded: ZeRO's stage, 1 (the optimizer state "
        "sharded), 2 (and the gradients: the full gradient buckets are transient) or 3 (and "
        "the weights: each rank holds its shard, gathered before each bucket's forward and "
        "backward readers; with transport one_sided on one node, one shared copy per node "
        "read in place; across hosts with one_sided, or auto where the network does RDMA, "
        "gathered by MPI_Rget of the owners' shards from their RMA windows); with "
        "parallel.stages any of them, over each stage's replicas (shard 3: each stage's "
        "weights gathered once per iteration for all its micro-batches); with "
        "parallel.tensor_parallel any of them, over each tensor shard's replicas (with "
        "parallel.stages too: each (stage, tensor shard)'s) (see "
        "[parallel.md](parallel.md))"),
    Key("prefetch", _int(1), 1, "scheme sharded, shard 2 and 3: how many full gradient "
        "buckets the backward writes ahead of the oldest one not yet reduce-scattered (the "
        "writers of bucket k + 1 + prefetch wait for bucket k's reduce-scatter: at most "
        "prefetch + 1 live at once); shard 3: and how many buckets' weights are "
        "gathered ahead of the computing one (each gather waits for the start of the bucket "
        "this many before it, in the forward and in the backward): at most prefetch + 1 "
        "buckets' full weights live at once in each pass"),
    Key("reduce_scatter", _bool, True, "scheme sharded (shard 1, 2 and 3): true reduces "
        "each gradient bucket by a reduce-scatter; false (DeepSpeed's "
        "zero_optimization.reduce_scatter: false) sums each bucket whole by the allreduce "
        "scheme data posts for it (in place, same dtype and buckets) and each rank keeps its "
        "shard's range: the sums, and so the weights, are data parallelism's bit for bit at "
        "any rank count, for an allreduce's bytes (about twice a reduce-scatter's); the "
        "memory is the stage's; with transport one_sided too, whose windows carry the "
        "weights and stage transfers, not the gradient sums (see "
        "[parallel.md](parallel.md))"),
    Key("micro_batches", _int(1), 1, "split each rank's batch into M micro-batches (divides "
        "data.train.batch_size); pipeline stages overlap them, scheme data accumulates "
        "gradients"),
    Key("ignore_label_mean", _choice(("global", "shard")), "global", "a softmax_loss with "
        "an `ignore_label` split over shards (ranks x micro-batches): global (each shard's "
        "sum over its counted positions divided by the global batch's count over the shards, "
        "so loss and gradient are the global batch's mean over its counted positions, as 1 "
        "rank without micro-batches and PyTorch's CrossEntropyLoss(ignore_index) over it; "
        "transformers' num_items_in_batch) or shard (each shard's own mean, their mean "
        "taken: PyTorch DDP's and gradient accumulation's plain average). Each loss's "
        "ignore_label is counted (several losses, several counts); global refuses (exit 2) a "
        "loss whose label an op other than a copy or reshape makes. The "
        "parameter-server modes always take each worker's own mean (with micro-batches, "
        "global: its batch's, shard: its micro-batches'), scheme none each rank's "
        "own batch's (see \"Sample order\")"),
    Key("schedule", _choice(PIPELINE_SCHEDULES), "1f1b", "order of the micro-batches on a "
        "stage: 1f1b (one forward, one backward; stage s of p allocates min(p-s, M) "
        "micro-batches' activations) or gpipe (all forwards, then all backwards; all M)"),
)

CHECKPOINT = (
    Key("interval", _int(0), 0, "write `ckpt_<iter>.h5` every this many iterations (0: only "
        "at the end and on a stop)"),
    Key("keep", _int(0), 3, "keep the newest K checkpoints of this run (0: keep all); "
        "`latest.h5` is never deleted"),
    Key("best", watch_check(BestSpec, "mapping {metric, mode, keep} or null"), None,
        "also keep `best_<iter>.h5` for the `keep` best test passes (default 1) by the test "
        "figure `metric` (`accuracy`, `loss`, ...), `mode` `max` or `min` (default: min for a "
        "loss, else max); rotation of the newest checkpoints never deletes them; needs "
        "`data.test`, and `metric` one of the net's test figures (checked at start-up)",
        typed=typed_watch(BestSpec)),
    Key("folder", _check_folder, None, "without `--out`, the runs go to numbered folders "
        "`<folder>/<N>` instead of `runs/<name>/<N>` (a relative folder is relative to the "
        "working directory; `convert caffe` sets it from Caffe's snapshot_prefix)"),
)

GPU = (
    Key("workspace_limit", _size, 256 << 20, "the most scratch one cuDNN convolution plan may "
        "take: the fastest plan whose workspace fits is chosen (the smallest when none does, "
        "said once); the start-up block's `cuDNN plans` row gives the chosen plans' workspace "
        "and the time given up against the fastest (docs/gpu.md, \"Device memory\")",
        shown="268435456 (256MiB)"),
)

LOSS_SCALE = (
    Key("init_scale", _num(0, strict=True), 65536.0, "the first scale (PyTorch GradScaler's "
        "names and defaults): the loss gradient is multiplied by it, the gradients divided "
        "by it before clipping and the update"),
    Key("growth_factor", _num(1, strict=True), 2.0, "the scale is multiplied by it after "
        "`growth_interval` steps in a row without an inf/nan gradient"),
    Key("backoff_factor", _num(0, strict=True, below=1), 0.5, "a step with an inf/nan "
        "gradient on any rank is skipped on every rank (weights and solver state unchanged) "
        "and the scale multiplied by it"),
    Key("growth_interval", _int(1), 2000, "finite steps in a row before the scale grows"),
)

#: the sections with declared keys, by top-level key
SECTION_KEYS = {"solver": SOLVER, "parallel": PARALLEL, "checkpoint": CHECKPOINT, "gpu": GPU,
                "loss_scale": LOSS_SCALE}


# ---------------------------------------------------------- top-level keys
#: the top-level keys, in the order of docs/config.md and of the messages;
#: ``check`` None: job/config.py validates it (a section, the data, the net)
TOP = (
    Key("name", _check_name, "net", "names the run: its output goes to `runs/<name>/<N>`",
        shown="the file's stem"),
    Key("data", None, {}, "`train:` and `test:` data specs (see [data](#data))",
        kind="mapping"),
    Key("net", None, None, "the layers, in order (see [net](#net)); give `net` or `graph`",
        kind="list", shown="—", typed=ENTRIES),
    Key("graph", None, None, "instead of `net`: the low-level list of blob and op entries "
        "(see [graph](#graph))", kind="list", shown="—", typed=ENTRIES),
    Key("solver", None, {}, "the optimiser and the learning-rate schedule (see "
        "[solver](#solver))", kind="mapping"),
    Key("parallel", None, {}, "how the ranks share the work (see [parallel](#parallel))",
        kind="mapping"),
    Key("checkpoint", None, {}, "how often to write checkpoints and how many to keep (see "
        "[checkpoint](#checkpoint))", kind="mapping"),
    Key("gpu", None, {}, "the GPU's memory choices (see [gpu](#gpu))", kind="mapping"),
    Key("seed", check_seed, 0, "seeds the initial weights, the data order (a data spec's "
        "own `seed` replaces it there), the random crops and flips, and dropout", kind="integer in [0, 2^63)"),
    Key("backend", _choice(BACKENDS), None, "the array library: `numpy` forbids a device, "
        "`cupy` without a device means device 0", shown="`auto`"),
    Key("device", _int(-1), -1, "-1: the CPU; D >= 0: GPU D + the rank's index on its node "
        "(modulo the node's GPUs); needs CuPy"),
    Key("tf32", _bool, False, "GPU float32 GEMMs may use TensorFloat-32 (faster, about 1e-3 "
        "relative error); the same as `precision: tf32`, which takes it over"),
    Key("precision", _choice(PRECISIONS), "fp32", "the GPU's compute precision: `fp32`; "
        "`tf32` (float32 GEMMs may use TensorFloat-32); `bf16` or `fp16`: GEMMs, convolutions "
        "and attention in bfloat16/float16 with float32 accumulation, the rest and the "
        "float32 master weights as in fp32 (docs/gpu.md, \"Precision\"); bf16 and fp16 are "
        "GPU settings, refused on the CPU; fp16 scales the loss dynamically (`loss_scale`)"),
    Key("loss_scale", None, {}, "fp16's dynamic loss scaling (see [loss_scale](#loss_scale)); "
        "under the other precisions it has no effect (a note says so)", kind="mapping"),
    Key("cuda_graph", _bool, True, "on a GPU, replay each iteration as captured CUDA graphs "
        "(the runs of GPU ops between host and communication ops); `false`: eager stream "
        "dispatch, for debugging (per-op trace events); ignored on a CPU"),
    Key("memory_plan", _bool, True, "plan the memory of the host and of each GPU from the "
        "static graph: blobs written and read within one iteration share one arena per device "
        "wherever the graph orders their lifetimes apart (`graph --memory` prints the plan); "
        "parameters, solver state, losses, metrics and what runs on into the next iteration "
        "keep their own memory; `false`: one buffer per blob, for debugging (the results are "
        "bit-identical)"),
    Key("recompute", _choice(RECOMPUTE_MODES), "none", "activation recompute: keep fewer "
        "activations from the forward to the backward and compute them again just before "
        "the backward that reads them (the recompute choices below; docs/running.md, "
        "\"Activation recompute\"); the results are bit-identical. With micro-batches too "
        "(each micro-batch copy recomputes its own); not with the pipeline, hybrid or "
        "tensor schemes (nor sharded with `parallel.tensor_parallel` or `parallel.stages`)"),
    Key("recompute_layers", _check_patterns, None, "the layers `recompute` applies to: "
        "name patterns (fnmatch: `h*_attn`, `h[0-2]_*`); each must match a layer of the net",
        shown="every layer", typed=Typed(lambda v: None if v is None else tuple(v),
                                         lambda v: None if v is None else list(v))),
)

#: the resolved config (config.yaml) starts with these, then the rest of TOP in order
RESOLVED_FIRST = ("name", "seed")


# --------------------------------------------------------------- data specs
#: the keys of a data spec; job/data_spec.py checks them by source, with the
#: declared checker where one is given (``check`` None: a rule of its own
#: there); ``shown`` is the default column (the job's value is None where a
#: spec leaves a key out)
DATA = (
    Key("source", None, None, "where the samples come from", kind="one of hdf5, lmdb, "
        "text, synthetic", shown="hdf5 with a path to a file, lmdb with a path to a folder, "
        "synthetic with a shape"),
    Key("path", None, None, "hdf5: the data file; lmdb: the database folder (holding "
        "data.mdb); text: the token file of `data text`; relative to the working directory "
        "or to the config's folder (the working directory's first where both hold the same "
        "bytes; where they differ, exit 2 naming both: give an absolute path)", kind="string", shown="—"),
    Key("split", None, None, "hdf5: the group holding data and label (null: the file's top "
        "level); text: `train` or `val`", kind="string or null",
        shown="`null` (hdf5), `train` for train and `val` for test (text), the phase "
              "(synthetic)"),
    Key("sequence_length", _int(1), None, "text: tokens per sample T; a sample is a window "
        "of T + 1 tokens, data its first T and label its last T (int32, N×T each); shuffled: "
        "every offset of the split is a window, else disjoint windows in order",
        shown="required (text)"),
    Key("batch_size", _int(1), None, "samples per rank per iteration (the global batch is "
        "ranks × batch_size)", shown="required"),
    Key("shuffle", _bool, None, "a new permutation each epoch, from the seed and the epoch",
        shown="`true` for train, `false` for test"),
    Key("in_memory", None, None, "hdf5: load the split (true), read each batch from the file "
        "(false), or load it when its float32 size fits a quarter of the memory (auto)",
        kind="auto, true or false", shown="`auto`"),
    Key("external", _bool, None, "hdf5: allow the split's data and label to read from other "
        "files (external storage, external links, virtual datasets); every such file must "
        "then exist and be large enough", shown="`false`"),
    Key("shape", None, None, "synthetic: one sample's shape [C, H, W]", kind="list of integers",
        shown="—"),
    Key("classes", _int(1), None, "synthetic: the number of classes", shown="—"),
    Key("num_samples", _int(1), None, "synthetic: samples in the split",
        shown=SYNTHETIC_NUM_SAMPLES),
    Key("seed", check_seed, None, "seed of the shuffle and of synthetic data",
        kind="integer in [0, 2^63)", shown="the config's seed"),
    Key("scale", _num(0, strict=True), None, "transform: multiply, after the mean is "
        "subtracted", shown="—"),
    Key("mean", None, None, "transform: subtract (one value, or one per channel; Caffe's "
        "mean_value)", kind="number or list", shown="—"),
    Key("mean_file", None, None, "transform: subtract this Caffe `.binaryproto` mean image "
        "(C×H×W, the samples' shape before the crop; not with `mean`), pixel by pixel, before "
        "the crop's window is flipped", kind="string", shown="—"),
    Key("mirror", _bool, None, "transform: random horizontal flip, training only",
        shown=False),
    Key("crop_size", _int(1), None, "transform: a square window, random in training, centred "
        "in testing", shown="—"),
)

#: the keys each data source takes besides the common ones, in the order of
#: the validated spec (after the common keys and the transform's)
SOURCE_KEYS = {"hdf5": ("path", "in_memory", "external", "split"), "lmdb": ("path",),
               "text": ("path", "split", "sequence_length"),
               "synthetic": ("shape", "classes", "num_samples", "split")}


# ------------------------------------------- views derived from the tables
TOP_KEYS = tuple(key.name for key in TOP)
#: top-level key -> (type, default, meaning)
TOP_DOC = {key.name: (key.type_doc, key.default if key.shown is None else key.shown,
                      key.meaning) for key in TOP}
SOLVER_DEFAULTS = defaults_of(SOLVER)
PARALLEL_DEFAULTS = defaults_of(PARALLEL)
CHECKPOINT_DEFAULTS = defaults_of(CHECKPOINT)
GPU_DEFAULTS = defaults_of(GPU)
DATA_KEYS = tuple(key.name for key in DATA)
#: data spec key -> its declared checker (None: job/data_spec.py's own rule)
DATA_CHECKS = {key.name: key.check for key in DATA}
assert set(TRANSFORM_KEYS) <= set(DATA_KEYS)


#: choice list -> {value: meaning}, for every value a key accepts
CHOICE_DOCS = {
    "lr_policy": {
        "fixed": "base_lr",
        "step": "base_lr · gamma ^ floor(iter / stepsize)",
        "multistep": "base_lr · gamma ^ (number of stepvalues <= iter)",
        "exp": "base_lr · gamma ^ iter",
        "inv": "base_lr · (1 + gamma · iter) ^ (−power)",
        "poly": "base_lr · (1 − iter / max_iter) ^ power",
        "cosine": "min_lr + (base_lr − min_lr) · (1 + cos(π · iter / max_iter)) / 2",
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
                "exchanging no gradients (tests, debugging); a save writes rank 0's "
                "replica and a test pass evaluates it over the whole split (see \"Sample "
                "order\")",
        "pipeline": "layers are placed on ranks by `stages` (one rank per stage); each edge "
                    "between ranks becomes a Send/Recv pair; with `tensor_parallel` t each "
                    "stage is split across t ranks as scheme tensor splits a net (p·t ranks)",
        "hybrid": "R replicas × p stages (rank = replica·p + stage): each replica is a "
                  "pipeline on its shard of the batch, and each stage allreduces its "
                  "gradients over the R replicas; the world size is a multiple of p >= 2; "
                  "with `tensor_parallel` t (Megatron-LM's 3-D layout, CPU) each replica is "
                  "a pipeline of p stages x t shards, rank = (replica·p + stage)·t + shard, "
                  "each (stage, shard)'s gradients allreduced over the R replicas",
        "tensor": "Megatron-LM's tensor parallelism: groups of `tensor_parallel` ranks split "
                  "each MLP (fc, element-wise layers, fc) by columns then rows, one allreduce "
                  "per block forward and one backward; R = world / tensor_parallel replicas "
                  "(rank = replica·t + shard) allreduce the gradients of each shard "
                  "([parallel.md](parallel.md))",
        "sharded": "ZeRO stage 1 (`shard: 1`): data-parallel replicas whose gradient buckets "
                   "are reduce-scattered; each rank updates its 1/N shard of every bucket, "
                   "holding the optimizer state of that shard only, then the weights are "
                   "allgathered; stage 2 (`shard: 2`) also frees each full gradient bucket "
                   "after its reduce-scatter, holding the gradients' shard only; stage 3 "
                   "(`shard: 3`) holds only the weights' shard too, each bucket's weights "
                   "allgathered into transient buffers before its forward and its backward "
                   "readers; MPI on the CPU; with `stages` (shard 1, 2 or 3), R replicas × p "
                   "stages as under hybrid, each stage sharded over its R ranks; with "
                   "`tensor_parallel` t (shard 1, 2 or 3), R replicas × t shards as under tensor, "
                   "each tensor shard sharded over its R ranks; with both, R replicas × p "
                   "stages × t shards as under hybrid, each (stage, shard) sharded over its R "
                   "ranks ([parallel.md](parallel.md))",
        "auto": "`train` chooses at start-up, as `plan --np N --choose` does: the setting of "
                "the scheme and its keys (data, sharded, pipeline stages and micro-batches, "
                "tensor, tensor within pipeline stages; `recompute`; never parameter servers, "
                "whose model is not validated, so `parallel.mode` must be sync) predicted fastest among those whose bytes fit "
                "each "
                "rank's memory, timed from two short traced runs of the job on rank 0, at its "
                "batch and at a quarter of it (cached "
                "in the run folder's `calibration.json`); the start-up block names it and why "
                "([scaling.md](scaling.md#choosing-a-plan---choose))",
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
        "text": "byte-level tokens of UTF-8 text (`python -m purine_mpi data text`): windows "
                "of `sequence_length` + 1 tokens, data the first T and label the next token "
                "at each position",
        "synthetic": "random samples of `shape` with random labels below `classes` (benchmarks)",
    },
    "recompute": {
        "none": "every activation the backward reads is kept from the forward",
        "full": "the matched layers keep only their inputs: in a net with residual adds "
                "(`eltwise` layers of two or more bottoms) each run of layers up to the next "
                "add is one unit (a transformer's attention and MLP halves, whose outputs, "
                "the next unit's inputs, are kept; a run that `recompute_layers` cuts before "
                "its add, such as `h*_gelu` or `h*_ln1`, recomputes its outputs too), "
                "otherwise each layer; a unit's forward "
                "runs again just before its backward, dropout replaying its masks, kept "
                "bit-packed (1 bit an element) (Megatron-LM's full recompute, PyTorch's "
                "`checkpoint`). Units that make a loss, layers a copy could not repeat "
                "exactly (batch norm's running statistics), and units whose copies would "
                "hold at least the bytes they drop (a chain net's ReLU: the next layer "
                "keeps its output anyway) keep their activations",
        "selective": "only attention's (N, H, T, T) tensors, the softmax and its dropout, are "
                     "recomputed (from the kept `qkv`; the dropout mask kept bit-packed), "
                     "Megatron-LM's selective recompute: the raw sub-graph's (`fused: "
                     "false`); the fused Attention op keeps none, with attn_dropout or "
                     "without",
    },
    "backend": {
        "auto": "CuPy when device >= 0, else NumPy",
        "numpy": "the CPU",
        "cupy": "the GPU (device 0 unless device is given)",
    },
}


#: the choices CHOICE_DOCS documents
CHOICES = {"lr_policy": LR_POLICIES, "solver_type": SOLVER_TYPES,
           "scheme": PARALLEL_SCHEMES + (AUTO_SCHEME,),
           "mode": PARALLEL_MODES, "schedule": PIPELINE_SCHEDULES, "source": DATA_SOURCES,
           "backend": BACKENDS, "recompute": RECOMPUTE_MODES}
