"""The sections of docs/config.md (see ``purine_mpi/tools/docgen.py``, which
assembles and checks the file): the prose and examples, and one function
per part of the config -- top-level keys, data, layers, the low-level
graph, solver, parallel schemes, checkpoints -- each reading its keys from
the code that defines them (job/schema.py's declarations, the layer registry, the
solver ops, graph/seed_yaml.py). A key without a meaning is a
``SchemaDocError``.
"""
import yaml

from ..base.errors import EXCERPT_CHARS
from ..job.yamlread import MAX_ALIAS_NODES, MAX_DEPTH
from .docgen_examples import CUSTOM_LAYER_EXAMPLE, EXAMPLE, RESIDUAL_EXAMPLE


class SchemaDocError(Exception):
    """A key or choice of the schema has no documentation."""


# ------------------------------------------------------------------ helpers
def _code(value):
    return f"`{value}`"


def _fmt(value):
    """A default as it is written in YAML."""
    from ..layers import Required
    if isinstance(value, Required):
        return repr(value)
    if value is None:
        return _code("null")
    if isinstance(value, bool):
        return _code("true" if value else "false")
    if isinstance(value, (int, float, list, dict)):
        text = yaml.safe_dump(value, default_flow_style=True).strip()
        if text.endswith("\n..."):
            text = text[:-4].strip()
        return _code(text.replace("...", "").strip())
    return _code(value)


def _prose_or_fmt(default):
    """A declared key's ``shown`` default: a string is prose (literal values are
    written in backticks there), anything else a YAML value."""
    return default if isinstance(default, str) else _fmt(default)


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _need(table, key, where):
    if key not in table:
        raise SchemaDocError(f"{where}: {key!r} has no documentation; add it (then run "
                             "python -m purine_mpi.tools.docgen --write)")
    return table[key]


def _choices(name):
    from ..job.schema import CHOICE_DOCS, CHOICES
    docs = CHOICE_DOCS.get(name, {})
    return [(value, _need(docs, value, f"CHOICE_DOCS[{name!r}] in purine_mpi/job/schema.py"))
            for value in CHOICES[name]]


def _anchor(title):
    keep = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return keep.replace(" ", "-")


# ----------------------------------------------------------------- sections
def _intro():
    return [
        "# Job configuration reference",
        "",
        "A job is one YAML file: `python -m purine_mpi train JOB.yaml` (or the installed "
        "`purine-mpi train JOB.yaml`). Its top-level keys are the sections below; every key "
        "has a default except the network itself. Each run resolves the file (defaults "
        "filled in, data paths made absolute) and saves the result as `config.yaml` in its "
        "output folder and in every checkpoint (see [formats.md](formats.md)).",
        "",
        "The file is checked before anything runs. An unknown key anywhere — at the top "
        "level, in a section, in a layer, in a filler or a `param` entry — a value of the "
        "wrong type, or a missing required key stops the command with exit status 2 and "
        "one line (no traceback) that names the file, the line where the key is written, "
        "the key and what was expected, with a \"did you mean\" for a near miss:",
        "",
        "    error: jobs/x.yaml:17: key 'net[2].stide': layer 'pool1' (pool): unknown key "
        "'stide' (did you mean 'stride'?) (valid keys: type, name, bottom, ...)",
        "",
        "A key the file lacks (a required one, or one a rule between keys asks for) is "
        "placed at the line of its nearest parent (`data.train.batch_size` missing: the "
        "line of `train:`); a key of a `repeat` block at its line in the block (`key "
        "'net.3.block.2.num_output'`, whichever block it was built for); a key a `<<` merge "
        "or an alias brings at the line of the text it comes from. Errors found later, "
        "when the graph is built on the data (a kernel larger than its input, a split the "
        "data file lacks), name the line alike. A key the file holds no part of (no `net` "
        "nor `graph`) has no line to name: `error: jobs/x.yaml: key 'net': ...`.",
        "",
        "Keys starting with `_` are no exception: they are rejected like any unknown key. "
        "Any key can be overridden on the command line with `--set DOTTED.KEY=VALUE`, the "
        "value read as YAML (`--set solver.base_lr=0.05`, `--set net.0.num_output=8`, "
        "`--set data.train.batch_size=64`); `--iters N` sets `solver.max_iter`. An error "
        "a `--set` value caused names that `--set`, not the file (nor a line of it): also "
        "a rule between keys "
        "that a `--set` of one of them broke (`--set solver.base_lr=0.0001` under the "
        "file's cosine `min_lr: 0.001`: `error: --set solver.base_lr=0.0001: key "
        "'solver.min_lr': 0.001 is above solver.base_lr 0.0001 ...`), and a start-up note "
        "on a solver key it wrote that the solver does not read. A YAML boolean where text "
        "is expected (an unquoted `no`, `off`, `yes` or `on`: `name: no`, `bottom: [on, "
        "label]`) is refused with a word to quote it; no key that takes text or a number "
        "takes a boolean.",
        "",
        "A number is written without quotes: `base_lr: \"0.05\"` is a string and is refused. "
        "`1e-3` and `5E8` (no dot) read as numbers, as in YAML 1.2. The YAML 1.1 "
        "number forms that YAML 1.2 reads otherwise are refused, naming the key and line: "
        "`1:20` (base 60: 80 in YAML 1.1, text in 1.2), `024` (octal 20 in YAML 1.1, 24 "
        "in 1.2) and `0b101` (binary 5 in YAML 1.1, text in 1.2); quoted, they are text. "
        "The other way round, `08` and `0o24` are text (YAML 1.1 reads a leading 0 as "
        "octal, and has no `0o`): where a number is expected the error says so; write 8 "
        "or 20. Seeds (`seed`, "
        "`data.*.seed`, `--seed`) are integers in [0, 2^63), as checkpoints store them. "
        "`train` says in a note at start-up when a `batch_size` is larger than its split "
        "(each batch then holds samples several times over), and refuses a net whose blobs "
        "would not fit in the machine's memory, naming the layer that takes the most.",
        "",
        "The YAML itself is read strictly (purine_mpi/job/yamlread.py). A key given twice in "
        "one mapping, at any level (a second `solver:` block at the end of the file), exits "
        "2 naming the key and both lines, where plain YAML would keep the second silently. "
        f"Nesting deeper than {MAX_DEPTH} levels exits 2 naming the line. Anchors and aliases "
        "share a value (`weight_filler: &f {type: gaussian, std: 0.01}`, then "
        "`weight_filler: *f`), but the values that aliases repeat may add at most "
        f"{MAX_ALIAS_NODES:,} to those written out, so a few lines of nested aliases (a "
        "\"billion laughs\") exit 2 at once instead of expanding. The same holds for `--set` "
        "values, for a run's `config.yaml` (`predict`) and for the config a checkpoint holds. "
        "A message quotes a value it refuses by at most "
        f"{EXCERPT_CHARS} characters, followed by `...` and its whole size.",
        "",
        "## Contents",
        "",
        "- [An example](#an-example)",
        "- [Top-level keys](#top-level-keys)",
        "- [data](#data): data specs, sources, transforms, the sample order",
        "- [net](#net): keys of every layer, `repeat` (a block written once), fillers, `param`, the layer types, custom layers",
        "- [graph](#graph): the low-level alternative to `net`",
        "- [solver](#solver): keys, [solver types](#solver-types), "
        "[lr policies](#lr-policies)",
        "- [parallel](#parallel): keys, [schemes](#schemes), [modes](#modes), "
        "[schedules](#schedules)",
        "- [checkpoint](#checkpoint)",
        "- [gpu](#gpu)",
        "",
        "## An example",
        "",
        "A LeNet-style net on the digits set (`python -m purine_mpi data digits --out "
        "data/digits.h5` makes the file); `jobs/` holds more:",
        "",
        "```yaml",
        EXAMPLE.rstrip(),
        "```",
        "",
        "Batch norm, a residual sum, dropout and AdamW with a cosine schedule and warm-up "
        "(the `data` section as above):",
        "",
        "```yaml",
        RESIDUAL_EXAMPLE.rstrip(),
        "```",
    ]


def _key_rows(keys, where):
    """The rows (key, type, default, meaning) of declared config keys; a
    key without a meaning is a ``SchemaDocError``."""
    rows = []
    for key in keys:
        if not key.meaning:
            raise SchemaDocError(f"{where}: {key.name!r} has no documentation; add its "
                                 "meaning (then run python -m purine_mpi.tools.docgen --write)")
        kind = key.type_doc or _kind_of(key.default)
        rows.append((_code(key.name), kind,
                     _fmt(key.default) if key.shown is None else _prose_or_fmt(key.shown),
                     key.meaning))
    return rows


def _top():
    from ..job.schema import TOP
    rows = _key_rows(TOP, "TOP in purine_mpi/job/schema.py")
    return ["## Top-level keys", "", _table(("key", "type", "default", "meaning"), rows),
            "", "Backend choices (`backend`):", "",
            _table(("value", "meaning"), [(_code(v), m) for v, m in _choices("backend")]),
            "", "Recompute choices (`recompute`):", "",
            _table(("value", "meaning"), [(_code(v), m) for v, m in _choices("recompute")])]


def _data():
    from ..job.schema import DATA
    from ..data.transform import TRANSFORM_KEYS
    rows = _key_rows(DATA, "DATA in purine_mpi/job/schema.py")
    transforms = ", ".join(_code(k) for k in TRANSFORM_KEYS)
    return [
        "## data",
        "",
        "`data.train` and `data.test` are data specs (either may be left out: without "
        "`test` there is no evaluation). `source` may be left out: a spec with a `path` "
        "reads HDF5, one with a `shape` is synthetic.",
        "",
        "```yaml",
        "data:",
        "  train: {path: data/cifar10.h5, split: train, batch_size: 100, in_memory: auto,",
        "          crop_size: 28, mirror: true, mean: [125.3, 123.0, 113.9], "
        "scale: 0.0078125}",
        "  test:  {source: synthetic, shape: [3, 32, 32], classes: 10, batch_size: 100}",
        "```",
        "",
        "### Data spec keys",
        "",
        _table(("key", "type", "default", "meaning"), rows),
        "",
        "### Data sources",
        "",
        _table(("source", "what"), [(_code(v), m) for v, m in _choices("source")]),
        "",
        "An HDF5 data file holds `data` (N × C × H × W, float32 or uint8) and `label` "
        "(N integers in [0, classes)), at the top level or in one group per split "
        "(`split:`). uint8 pixels stay bytes until the transform turns them into float32, "
        "so give `mean` and `scale`. The loader checks at start-up that labels lie in "
        "[0, classes) and, for a split it loads, that values are finite; each error names "
        "the file and the dataset. `python -m purine_mpi data digits|cifar10` writes such "
        "files (CIFAR-10 as uint8, chunked and gzip-compressed, its per-channel training "
        "mean in the root attribute `mean`).",
        "",
        "With `in_memory: auto` a split is loaded once per process when its float32 size "
        "fits a quarter of the machine's memory (or of `ulimit -v`; the environment "
        "variable `PURINE_DATA_MEMORY_MB` overrides the budget); otherwise the prefetch "
        "thread reads the rows of each batch from the file, so a split larger than memory "
        "trains, in the same sample order.",
        "",
        "### Transforms",
        "",
        f"The keys {transforms} transform each batch as Caffe's `transform_param` does, in "
        "the prefetch thread and in Caffe's order: `out = (mirror(crop(x)) - mean) * "
        "scale`, float32 out. The random crop offset and flip of a sample depend only on "
        "the run's seed and the sample's global position in the data order, so N ranks × B "
        "transform exactly what 1 rank × N·B does, and a resumed run draws what the "
        "uninterrupted one would have. Testing crops the centre and never flips.",
        "",
        "### Sample order",
        "",
        "With N ranks and per-rank batch B, iteration t reads the global positions "
        "[t·N·B, (t+1)·N·B) of the data order and rank r takes [r·B, (r+1)·B) of that "
        "window. Position p is sample `order(epoch)[p mod n]` of epoch `p div n`, where "
        "`order` is a permutation drawn from (seed, epoch) when `shuffle` is true and the "
        "identity otherwise. So N ranks × batch B train like 1 rank × batch N·B, also "
        "where a loss has an `ignore_label` (a `softmax_loss`, the text losses over "
        "`axis: -1` too): over S shards (ranks × micro-batches; the replicas of schemes "
        "sharded, hybrid and tensor; a pipeline's micro-batches) it is by default "
        "(`parallel.ignore_label_mean: global`) the global batch's mean over its counted "
        "positions, as 1 rank × batch N·B (PyTorch's `CrossEntropyLoss(ignore_index)` "
        "over it; what transformers' `num_items_in_batch` makes of gradient "
        "accumulation): each rank's data reader counts the global batch's labels, once "
        "per iteration for all its micro-batches (the labels alone: cheap, and no "
        "collective; at 2 ranks × 4 micro-batches of 16 × 1024 tokens a rank's readers do "
        "2.4-2.9× less work per iteration than with a count per micro-batch, medians of "
        "interleaved runs, benchmarks/label_count.py) and each shard's loss is its sum "
        "over its counted positions divided by that count / S, so the mean of the "
        "shards' losses, which the train rows report and the gradients' 1/S average "
        "is of, is the global mean (at least 1 counted position, as Caffe's normaliser: "
        "an all-ignored global batch has loss 0). A shard's own loss is then no mean of "
        "its own. A data op counts for the `ignore_label` of each loss reading its "
        "label (a second loss with another one is normalised by its own count); a "
        "`graph:` config's losses are normalised as a net's (and a complete graph's "
        "`SoftmaxLossGrad` ops). A loss whose label is not the data op's (made by a "
        "layer other than a copy or a reshape, e.g. a `slice`; a `graph:` of several "
        "data ops) has no count the data op could make: `global` refuses it, exit 2 "
        "naming `parallel.ignore_label_mean` and the layer (`shard` takes its shards' "
        "means). With `ignore_label_mean: shard` each shard's "
        "loss is the mean over its own counted positions and the iteration's figure "
        "and gradient the mean of these means (PyTorch DDP's average of per-shard "
        "means; gradient accumulation before transformers' fix), so a shard with fewer "
        "counted positions weighs each of them more: digits, one `fc`, "
        "`ignore_label: 3`, 2 ranks × 2 micro-batches of 4 with 2 of 16 samples "
        "ignored: loss 2.239136 for the global batch's 2.241457, the gradient's cosine "
        "with the global batch's 0.9947. The parameter-server modes keep each worker's "
        "own mean (a worker's gradient updates the servers on its own, not as a part "
        "of one global batch; with micro-batches its batch's mean, the count over its "
        "micro-batches, as scheme none's), and under scheme none, whose ranks exchange no "
        "gradients, a rank's batch is its own global batch (the count over its "
        "micro-batches): each replica trains as one rank alone on its own batches, "
        "keeps its own batch norm running statistics (none averaged), a save writes "
        "rank 0's replica, and a test pass (and `predict`) runs that replica over the "
        "whole split on rank 0, the other ranks adding nothing, so the test rows are "
        "the saved model's; a train row is the ranks' mean of their own losses "
        "(tests/test_trust_none_apart.py). Except where "
        "a `batch_norm` normalises with each rank's own batch statistics, not synchronised "
        "(the default): "
        "its running statistics, each replica's own, are set to their mean over the ranks "
        "(the replicas of a scheme that exchanges gradients) "
        "before every test pass and save, so the test figures are those of the saved "
        "model; the running mean is then that of 1 rank × batch N·B, the running "
        "variance the mean of the ranks' own (each PyTorch's unbiased `running_var` of "
        "its B samples), which lacks the spread between the ranks' batch means and so "
        "differs from 1 rank × batch N·B's (digits, a 3×3 `conv` into `batch_norm`, "
        "2 ranks × 8, 3 iterations: 1.5e-4 relative); with `sync: true` (schemes data, "
        "sharded, hybrid, tensor and pipeline: PyTorch's `SyncBatchNorm`; with micro-batches each "
        "micro-batch's statistics over the replicas, as PyTorch's per forward call) its "
        "batch statistics and the two sums its gradient takes are summed over the "
        "replicas in the graph, so outputs, gradients, parameters and running "
        "statistics are 1 rank × batch N·B's (the same case: within 1e-5 relative; "
        "[parallel.md](parallel.md#synchronised-batch-normalisation)), and "
        "the order does not depend on how the run is split over ranks. Parameter-server "
        "workers shard the data over the workers only; the stages of a pipeline all read "
        "the same batch, and with scheme hybrid the data is sharded over the replicas. "
        "A resume on another number of ranks continues at the same global sample "
        "(rounded down to a whole batch). A test pass with `solver.test_iter: null` is one "
        "pass: ⌈n / (N·B)⌉ iterations of this rule, whose positions at or past n are "
        "padding (their label, -1, is never a class: every loss and accuracy skips it "
        "apart from its own `ignore_label`), so each test "
        "sample counts exactly once on any number of ranks; `predict` reads the same "
        "batches and drops the padding.",
    ]


def _layer_section():
    from ..layers import COMMON_KEYS, KIND_DOC, LAYER_SPECS, PARAM_KEYS
    from ..layers.fillers import FILLER_DOC, FILLERS
    from ..layers.registry import FILLER_RANGES, FINITE, PARAM_RANGE

    def kind_text(key):
        if not isinstance(key.kind, tuple):
            _need(KIND_DOC, key.kind, "KIND_DOC in purine_mpi/layers/registry.py")
        return key.type_doc

    def filler_key(k, v):
        rng = FILLER_RANGES.get(k)
        return f"`{k}` ({v}{', ' + rng.text if rng else ''})"

    def default_text(key):
        if key.default is None:
            return "—"
        if key.default == "<name>":
            return "the layer's name"
        return _fmt(key.default)

    def key_rows(keys):
        return [(_code(k.name), kind_text(k), default_text(k),
                 k.meaning + ("; weights saved with another value are refused (they would "
                              "load but mean something else)" if k.weights else ""))
                for k in keys]

    out = [
        "## net",
        "",
        "`net` is a list of layers, Caffe style, run in order. Each layer reads its "
        "`bottom` blobs — `data` and `label` from the data spec, or an earlier layer's "
        "`top` — and writes its `top` blobs. A `top` equal to a `bottom` (in place, e.g. a "
        "ReLU) writes a new version of that blob, and later layers reading the name see "
        "the newest one. Learnable parameters are the blobs `<name>/weight` and "
        "`<name>/bias`; their gradients, the backward pass and the solver's update ops are "
        "generated (`python -m purine_mpi graph JOB.yaml` prints the whole graph). A layer "
        "type's name is case-insensitive; aliases are Caffe's names.",
        "",
        "### Keys of every layer",
        "",
        _table(("key", "type", "default", "meaning"), key_rows(COMMON_KEYS)),
        "",
        "### repeat",
        "",
        "A block of layers used several times (a transformer's blocks) is written once, as "
        "an entry `repeat: N` (the count, an integer in [1, 10000]) with `block:` (its list "
        "of layers) and optionally `start:` (the first index, default 0). It is expanded "
        "into N copies of the block when the config is read, so every command (and the "
        "config a checkpoint saves) sees the spelled-out layers. In every string of a "
        "block's layers (`name`, `bottom`, `top`, `tie_weight`, ...) `{i}` is the block's "
        "index and `{i+K}` / `{i-K}` that index plus or minus K: block i reads `x{i}`, the "
        "previous block's output, and writes `x{i+1}`; `{{` and `}}` are literal braces. "
        "Every layer name of a block holds a placeholder. A bad count or start, an unknown "
        "placeholder (`{j}`), a name without one, or a repeat inside a block exits 2 naming "
        "the file and the key (`net.3.repeat`, `net.3.block.2.top`); an error of a layer of "
        "the block names it the same way, its shapes' too (`net.3.block.2.bottom` and the "
        "layer's name, which holds its block's index), and a layer after the repeat by its "
        "position in the file (`net[4]`), not in the expanded net. `--set` indexes the "
        "entries of the file "
        "(`--set net.3.repeat=12`). jobs/gpt_small.yaml:",
        "",
        "```yaml",
        "net:",
        "  - {type: embedding, name: wte, bottom: data, top: tok, input_dim: 256, num_output: 384}",
        "  - {type: position_embedding, name: wpe, bottom: tok, top: x0, max_length: 256}",
        "  - repeat: 6                   # h0 .. h5: block i reads x{i}, writes x{i+1}",
        "    block:",
        "      - {type: layer_norm, name: \"h{i}_ln1\", bottom: \"x{i}\", top: \"h{i}_n1\"}",
        "      - {type: attention, name: \"h{i}_attn\", bottom: \"h{i}_n1\", top: \"h{i}_a\", "
        "num_heads: 6}",
        "      - {type: eltwise, name: \"h{i}_res1\", bottom: [\"x{i}\", \"h{i}_a\"], top: "
        "\"h{i}_r\"}",
        "      # ... ln_2, the MLP ...",
        "      - {type: eltwise, name: \"h{i}_res2\", bottom: [\"h{i}_r\", \"h{i}_p\"], top: "
        "\"x{i+1}\"}",
        "  - {type: layer_norm, name: ln_f, bottom: x6, top: xf}",
        "```",
        "",
        "### Fillers",
        "",
        "`weight_filler` and `bias_filler` initialise a parameter from the run's seed and "
        "the parameter's name only (not the rank count or the layer order). "
        "fan_in = the product of a weight's dimensions after the first. Each key is a "
        f"{FINITE.text} number (`std` {FILLER_RANGES['std'].text}); a uniform filler needs "
        "min <= max.",
        "",
        _table(("type", "keys (default)", "draws"),
               [(_code(kind), ", ".join(filler_key(k, v) for k, v in FILLERS[kind].items()) or
                 "—", _need(FILLER_DOC, kind, "FILLER_DOC in purine_mpi/layers/fillers.py"))
                for kind in FILLERS]),
        "",
        "### param",
        "",
        "A layer with parameters takes `param`, one entry per parameter in the order "
        "weight, bias: " + ", ".join(f"`{k}` (default {v})" for k, v in PARAM_KEYS.items())
        + f", each a number {PARAM_RANGE.text}. `lr_mult` scales the learning rate and "
        "`decay_mult` the weight decay of that parameter. `lr_mult: 0` freezes it, as "
        "torch's `requires_grad=False` (a fine-tuning's pretrained trunk): the weight "
        "stays bit for bit, weight decay included, and its gradient is neither computed "
        "nor communicated: the backward has no gradient op for it (the data gradient "
        "through its layer stays where a layer below learns; a layer whose parameters "
        "are all frozen and whose input needs no gradient, the first one reading the "
        "data, has no backward at all), no gradient bucket, allreduce or reduce-scatter "
        "holds it under any scheme, it has no update op and no solver state (no "
        "momentum, no Adam moments: a checkpoint holds none for it; under "
        "`parallel.shard: 3` the frozen weights are sharded like the learning ones, "
        "each rank holding 1/N of them in gather units of their own, gathered before "
        "their forward and backward readers and freed after, never reduce-scattered or "
        "updated: docs/parallel.md), so it counts not in `solver.clip_gradients`' norm "
        "nor in fp16's overflow check; `plan` shows the smaller graph. A checkpoint "
        "resumes across a change of `lr_mult: 0`: a parameter frozen in the run that "
        "wrote it and learning now starts its solver state from zero, as a fresh "
        "optimizer's, and a note names it (Adam's and AdamW's one step count goes on "
        "from the file's, their bias correction is not restarted for it); a parameter "
        "learning there and frozen now keeps its weight and leaves the file's state "
        "unread (the next checkpoint holds none for it). A net whose learnable "
        "parameters are all frozen exits 2 (`net`: nothing to train). Missing "
        "entries mean 1.0. More entries than the layer type has parameters (its `param` "
        "row below names them) exit 2 (`net[i].param`: Caffe's \"Too many params\"); "
        "an entry for a parameter the layer leaves out (the bias of a layer with "
        "`bias_term: false`) may be a placeholder only, `{}` or the defaults, and one "
        "that sets a multiplier exits 2 (`net[i].param[k]`: the `lr_mult: 0` meant to "
        "freeze something would freeze nothing).",
        "",
        "### Layer types",
        "",
    ]
    for ltype in sorted(LAYER_SPECS):
        spec = LAYER_SPECS[ltype]
        aliases = ", ".join(_code(a) for a in spec.aliases)
        out += [f"#### {ltype}", "", spec.doc + (f" Aliases: {aliases}." if aliases else ""),
                ""]
        if spec.keys:
            out += [_table(("key", "type", "default", "meaning"), key_rows(spec.keys)), ""]
        else:
            out += ["No keys besides those of every layer.", ""]
    out += [
        "### Custom layers",
        "",
        "A layer is a Python function registered with `@layer(TYPE, *aliases, keys=...)`; "
        "it reads its keys with `b.get(KEY)` (checked against the declared kind, defaulted "
        "from the declaration) and emits ops with `b.op(...)`. Its declared keys are "
        "checked like those of the built-in layers, when the config is read (exit 2 "
        "naming the file, the layer and the key). A key of a numeric kind declares its "
        "range, `Key(name, kind, default, meaning, Range(lo, hi, lo_open, hi_open))` "
        "(`purine_mpi.layers`: `POSITIVE`, `NON_NEGATIVE`, `AT_LEAST_ONE`, `RATIO`, "
        "`FRACTION`, `FINITE`); "
        "`posint` and `nonneg` imply theirs. A `params` key names the layer's parameters "
        "in order, `Key(\"param\", \"params\", [], meaning, slots=(Slot(\"weight\"), "
        "Slot(\"bias\", \"bias_term\")))`, a parameter's second field the bool key whose "
        "false leaves it out. Register it before the config is "
        "loaded (train from Python, `purine_mpi.job.config.load_config` then "
        "`purine_mpi.train.trainer.run_training`):",
        "",
        "```python",
        CUSTOM_LAYER_EXAMPLE.rstrip(),
        "```",
        "",
        "Key kinds: " + "; ".join(f"`{k}` ({v})" for k, v in KIND_DOC.items()) +
        "; a tuple of values means one of them.",
    ]
    return out


def _graph():
    from ..graph.seed_yaml import BLOB_DOC, BLOB_KEYS, OP_DOC, OP_KEYS
    first = ("type", "name")

    def rows(keys, doc, where):
        order = [k for k in first if k in keys] + sorted(k for k in keys if k not in first)
        return [(_code(k), _need(doc, k, where)) for k in order]
    return [
        "## graph",
        "",
        "Instead of `net`, a config may give `graph`: the bi-graph itself, one entry per "
        "blob or op. `python -m purine_mpi graph JOB.yaml --format yaml` prints any "
        "config's graph in this form (with `--np N --rank R`, a rank's slice after the "
        "parallel composition: a view of what rank R runs, not a config of the N-rank run "
        "-- under scheme data its reader reads shard R of N and its gradients are scaled "
        "by 1/N, so loaded alone it trains on 1/N of the data at 1/N of the rate --, which "
        "a one-line note on stderr says; train the net config on N ranks). An op's "
        "`location` places it on a rank and device, so a "
        "`graph` config can describe any placement by hand.",
        "",
        "```yaml",
        "graph:",
        "  - {type: blob, name: x, size: [4, 3], location: {rank: 0, device: -1}}",
        "  - {type: blob, name: y, size: [4, 3]}",
        "  - {type: op, name: act, op_type: Relu, inputs: [x], outputs: [y], thread: 0}",
        "```",
        "",
        "Blob entries:",
        "",
        _table(("key", "meaning"), rows(BLOB_KEYS, BLOB_DOC, "BLOB_DOC in "
                                        "purine_mpi/graph/seed_yaml.py")),
        "",
        "Op entries:",
        "",
        _table(("key", "meaning"), rows(OP_KEYS, OP_DOC, "OP_DOC in "
                                        "purine_mpi/graph/seed_yaml.py")),
    ]


def _section_rows(section):
    from ..job.schema import SECTION_KEYS
    rows = _key_rows(SECTION_KEYS[section], f"{section.upper()} in purine_mpi/job/schema.py")
    return _table(("key", "type", "default", "meaning"), rows)


def _kind_of(default):
    if isinstance(default, bool):
        return "true/false"
    if isinstance(default, int):
        return "integer"
    if isinstance(default, float):
        return "number"
    if isinstance(default, str):
        return "string"
    if isinstance(default, list):
        return "list"
    if isinstance(default, dict):
        return "mapping"
    return "any"


def _solver():
    from ..graph.solver_graph import UPDATE_KEYS
    from ..ops.updates import SOLVER_UPDATES
    rows = []
    for kind, update in _choices("solver_type"):
        op_type, states = SOLVER_UPDATES[kind]
        keys = ", ".join(_code(k) for k in UPDATE_KEYS[kind])
        rows.append((_code(kind), update, keys, ", ".join(_code(s) for s in states), op_type))
    policies = [(_code(p), formula) for p, formula in _choices("lr_policy")]
    return [
        "## solver",
        "",
        _section_rows("solver"),
        "",
        "### Solver types",
        "",
        "Each type is an update op per parameter, on the CPU and the GPU, with Caffe's "
        "key names. g is the gradient plus `weight_decay` · `decay_mult` · w (L2 "
        "regularisation; `adamw` alone decouples the decay), and rate = lr · `lr_mult`. "
        "Each parameter's state is the blobs `<param>.<state>`, saved in checkpoints "
        "under `/solver/<param>/<state>` and resumed bit-exact. Resuming with another type "
        "starts the new type's state from zero, and says so (Adam's step count, its bias "
        "correction, then counts from the resume, as a fresh torch optimizer's). The "
        "parameter-server modes "
        "(`parallel.mode: async | sync_ps`) take `sgd` only.",
        "",
        _table(("type", "update", "keys", "state", "op"), rows),
        "",
        "`adam` places ε as `torch.optim.Adam` does (Caffe's AdamSolver adds it before the "
        "bias correction of v: a difference of ε·√(1−β₂ᵗ)). Every type matches its "
        "`torch.optim` counterpart step by step: SGD (at a constant rate; v = lr · "
        "buffer), SGD(nesterov=True), Adagrad, RMSprop(alpha=rms_decay), "
        "Adadelta(rho=momentum), Adam, AdamW. Checkpoint k holds the weights and state "
        "after k updates, and the update from it to checkpoint k+1 is iteration k's, at "
        "iteration k's rate (Adam's step k+1): one torch step from checkpoint k, SGD's "
        "buffer taken as v / that rate. Where the rate changes, SGD's v keeps the steps "
        "made at the old rate, torch's buffer is rescaled by the new one (Caffe's and "
        "torch's SGD differ there).",
        "",
        "### lr policies",
        "",
        "`lr_policy` gives the rate at iteration `iter` (counted from 0), as Caffe's "
        "`SGDSolver::GetLearningRate`. poly and cosine hold `iter` at `max_iter` past the "
        "end. With `warmup_iters` W > 0 the first W iterations multiply the rate by "
        "(iter + 1) / W, which reaches the policy's rate at iteration W − 1.",
        "",
        _table(("lr_policy", "rate"), policies),
        "",
        "A key that the solver type or the lr_policy does not read (`momentum2` with "
        "`sgd`, `stepvalues`, `power` or `min_lr` with `step`; the keys columns above) is "
        "accepted, as a Caffe-converted solver carries every key of its own, but when it is "
        "set to something else than its default `train` says at start-up, in a one-line "
        "note, that it is not used and which keys the type or policy reads.",
    ]


def _parallel():
    return [
        "## parallel",
        "",
        "Every scheme is a graph composition run by the same dispatcher: `python -m "
        "purine_mpi graph JOB.yaml --np N --rank R` prints rank R's slice (with `--np N`, "
        "the data-parallel bucket plan and deferred tail too). Start N ranks with `mpiexec -n N` or `srun`; "
        "on one rank every scheme trains plain single-process.",
        "",
        _section_rows("parallel"),
        "",
        "### Schemes",
        "",
        _table(("scheme", "what"), [(_code(v), m) for v, m in _choices("scheme")]),
        "",
        "### Modes",
        "",
        _table(("mode", "what"), [(_code(v), m) for v, m in _choices("mode")]),
        "",
        "### Schedules",
        "",
        "With `micro_batches: M` each rank's batch B is split into M micro-batches of B/M; "
        "the forward and backward ops are copied per micro-batch over shared weights, each "
        "parameter's M gradients are summed and the update scales them once by 1/M, so "
        "training equals the whole batch up to float summation order, also where a "
        "loss has an `ignore_label` (with `ignore_label_mean: global`, the default: "
        "\"Sample order\"). Under the parameter-server modes a worker sums its "
        "micro-batches' gradients and pushes the sum, and the servers scale their updates "
        "by 1/M too (the same steps as one batch of B, to float summation order); "
        "batch norm statistics are per micro-batch (with `sync: "
        "true` the replicas' micro-batch k together: PyTorch's `SyncBatchNorm` syncs per "
        "forward call), and its running "
        "statistics take the micro-batches' updates one after another, as that many "
        "iterations of batch B/M would (with `moving_average_fraction`, Caffe's "
        "`iter_size`).",
        "",
        _table(("schedule", "order on each stage"),
               [(_code(v), m) for v, m in _choices("schedule")]),
        "",
        "A pipeline example (2 stages, 2 ranks):",
        "",
        "```yaml",
        "parallel: {scheme: pipeline, micro_batches: 4, schedule: 1f1b,",
        "           stages: {conv1: 0, relu1: 0, pool1: 0, fc1: 1, loss: 1, accuracy: 1}}",
        "```",
    ]


def _checkpoint():
    return [
        "## checkpoint",
        "",
        _section_rows("checkpoint"),
        "",
        "A run writes `ckpt_<iter>.h5` and `latest.h5` in its folder at every `interval`, "
        "at the end, and when a signal stops it; `train --resume auto` continues the "
        "newest run of the job. The file layout is in [formats.md](formats.md#checkpoints).",
    ]


def _gpu():
    return [
        "## gpu",
        "",
        _section_rows("gpu"),
        "",
        "Read only on a GPU. Each cuDNN convolution's plan is the fastest whose workspace "
        "fits `workspace_limit`; the ops of one CUDA stream share one scratch slot, so the "
        "scratch is at most one slot per concurrent stream, each the largest workspace among "
        "its ops ([gpu.md](gpu.md#device-memory)).",
    ]


def _loss_scale():
    return [
        "## loss_scale",
        "",
        _section_rows("loss_scale"),
        "",
        "fp16's dynamic loss scaling (PyTorch GradScaler's names and defaults; "
        "[gpu.md](gpu.md#precision)); under another `precision` the keys have no effect and "
        "a note says so. A skipped step is one line of the log; `loss_scale` and "
        "`skipped_steps` are in metrics.jsonl ([formats.md](formats.md)); checkpoints hold "
        "the scale and its counters.",
    ]


def sections():
    """The parts of docs/config.md below its header, in order: each a list
    of lines."""
    return [_intro(), _top(), _data(), _layer_section(), _graph(), _solver(), _parallel(),
            _checkpoint(), _gpu(), _loss_scale()]
