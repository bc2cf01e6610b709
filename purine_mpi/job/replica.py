"""From a job (job/job.py) to the graphs one rank runs.

Train graph = data op + forward (layers) + generated backward + solver ops,
then the parallel composition (data-parallel buckets and allreduce, or the
parameter-server variant) rewrites it for this rank. The test graph is the
forward net of the ``test`` phase; it shares the train graph's parameter
arrays. The entry points take a ``Job`` (job/job.py).
"""
import json

from ..base.errors import ConfigError, InitMismatch, UserError, one_line
from ..graph import Graph, seed_yaml
from ..graph.core import reachable
from ..graph.grad import build_backward, trained
from ..graph.recompute import add_recompute
from ..graph.solver_graph import add_solver
from ..ops.data import count_labels
from ..ops.updates import UPDATE_OP_TYPES
from ..layers import build_net, layer_key
from .data_spec import data_error

DATA_THREAD = "io"


def data_attrs(spec, rank, world_size, seed, phase="train"):
    """Attributes of the DataReader op for one data split spec (a ``DataSpec``)."""
    return {"source": spec.source_dict(), "batch_size": spec.batch_size, "rank": rank,
            "world_size": world_size, "seed": seed, "train": phase == "train"}


def forward_graph(job, phase, spec, rank=0, world_size=1):
    """The data op and the net's forward ops of ``job`` for ``phase`` and its
    ``DataSpec`` (no loss pruning)."""
    return _add_net(job, phase, data_graph(job, phase, spec, rank, world_size))


def data_graph(job, phase, spec, rank=0, world_size=1):
    """The graph of the data op alone, its outputs' shapes read (the data
    file, or the spec's shape): a ConfigError naming ``data.<phase>``'s key
    where they cannot be."""
    g = Graph(job.name)
    g.add_op("data", "DataReader", [], ["data", "label"],
             data_attrs(spec, rank, world_size, job.seed, phase), thread=DATA_THREAD)
    try:
        g.infer_shapes()
    except UserError as exc:  # the data file, or a spec's key that does not fit it
        raise data_error(job.path, phase, exc) from None
    return g


def _add_net(job, phase, g):
    build_net(job.net or (), phase, (g, job.path, job.net_keys))
    limit_token_ids(g)
    return g


def limit_token_ids(graph):
    """Give each data op whose data an embedding reads as token ids (also
    through ops that hand it on unchanged) attr ``id_limit``: the fewest
    rows of those tables. The op checks every batch against it on the host
    (ops/data.py), so an id outside the table stops the run on a GPU as on
    the CPU, where the embedding op checks too."""
    for reader in [op for op in graph.ops.values() if op.op_type == "DataReader"]:
        rows = [n for _, n in token_tables(graph, reader.outputs[0])]
        if rows:
            reader.attrs["id_limit"] = min(rows)


def token_tables(graph, blob):
    """[(op, rows)]: the Embedding ops that read ``blob`` as token ids (also
    through ops that hand it on unchanged) and their tables' rows (shapes
    inferred)."""
    data = _passed_on(graph, blob)
    found = [(op, graph.blobs[op.inputs[1]].shape) for op in graph.ops.values()
             if op.op_type == "Embedding" and op.inputs[0] in data]
    return [(op, int(shape[0])) for op, shape in found if shape is not None]


def layer_where(job, op):
    """The config key of the layer that built ``op`` (``net[i]``, a repeat
    block's key in the file) and the layer's name."""
    layer = op.name.split(".")[0]
    index = {spec["name"]: i for i, spec in enumerate(job.net or ())}
    return (layer_key(job.net_keys, index[layer]) if layer in index else "net"), layer


def check_data_labels(graph, job=None):
    """At load time, before any iteration: every label a loss or accuracy
    op reads straight from the data op must lie in [0, C), C being the
    class count of its predictions. The data file and dataset are named.
    With ``job``, token data with a vocabulary also needs an embedding and
    scores as large as it (``check_vocabulary``)."""
    from ..data.sources import check_labels, check_token_ids
    if job is not None:
        check_vocabulary(graph, job)
    for reader in [op for op in graph.ops.values() if op.op_type == "DataReader"]:
        rows = reader.attrs.get("id_limit")  # the embeddings' (limit_token_ids)
        if rows is None:
            continue
        table = min(token_tables(graph, reader.outputs[0]), key=lambda t: t[1])[0]
        layer, key = table.name.split(".")[0], None
        if job is not None:
            where, layer = layer_where(job, table)
            key = f"{where}.input_dim"
        check_token_ids(reader.attrs["source"], int(rows), layer, key)
    checked = set()
    for op, reader, classes in label_classes(graph):
        # a loss and an accuracy on one reader: its labels checked once (a
        # just-written file is hashed at each check: data/filecache.py)
        spec = reader.attrs["source"]
        key = (json.dumps(spec, sort_keys=True, default=str), classes,
               op.attrs.get("ignore_label"))
        if key in checked:
            continue
        checked.add(key)
        check_labels(spec, classes, op.attrs.get("ignore_label"),
                     layer=op.name[:-len(".fwd")] if op.name.endswith(".fwd") else op.name)


def label_classes(graph):
    """[(op, data op, C)] of the loss and accuracy ops of ``graph`` that read
    their label straight from a data op, C the class count of their
    predictions: its labels must lie in [0, C)."""
    from ..ops.softmax import _axis
    producers = graph.producers()
    out = []
    for op in graph.ops.values():
        if op.op_type not in ("SoftmaxLoss", "Accuracy") or len(op.inputs) < 2:
            continue
        readers = [p for p in producers.get(op.inputs[1], []) if p.op_type == "DataReader"]
        x = graph.blobs[op.inputs[0]]
        if readers and x.shape is not None:
            out.append((op, readers[0], int(x.shape[_axis(op.attrs, len(x.shape))])))
    return out


def check_graphs(job):
    """The single-replica train and test graphs of ``job`` built (rank 0 of
    one) and their labels checked: the data files read and checked (NaN or
    inf, labels out of range), every layer's shape inferred, the test
    phase's parameters of the train phase's shapes: what the run's start-up
    finds first, asked before ``--force`` deletes a run (job/rundir.py), so
    a bad data file or layer loses nothing."""
    graph, _ = build_train_graph(job)
    check_data_labels(graph, job)
    test = build_test_graph(job)
    if test is not None:
        check_test_params(job, param_shapes(graph), test)
        check_data_labels(test, job)


def param_shapes(graph):
    """{parameter: shape} of ``graph`` (``check_test_params`` compares them)."""
    return {b.name: b.shape for b in graph.params()}


def check_test_params(job, shapes, test):
    """The test graph ``test`` runs on the train graph's parameter arrays
    (``shapes``: theirs, ``param_shapes``): each parameter of it must have
    that shape. A test set whose samples have other shapes than the train
    data's (another image size) reaching a layer whose parameters depend
    on them (an fc layer after convolutions) is a ConfigError naming
    ``data.test`` and the layer at start-up, not a failed first test pass.
    Shapes that leave every parameter alone (another sequence length of a
    GPT) are the test set's own business."""
    for blob in test.params():
        want = shapes.get(blob.name)
        if want is None or blob.shape is None or tuple(want) == tuple(blob.shape):
            continue
        samples = next((list(test.blobs[op.outputs[0]].shape[1:]) for op in test.ops.values()
                        if op.op_type == "DataReader"), "?")
        raise ConfigError(job.path, "data.test",
                          f"its samples of shape {samples} give layer "
                          f"'{param_layer(blob.name)}' the parameter '{blob.name}' of shape "
                          f"{list(blob.shape)}, but the train phase's is {list(want)}: the "
                          "test phase runs on the train phase's parameters; give the test "
                          "samples the shape they have in training (e.g. crop_size)")


def check_vocabulary(graph, job):
    """A text data file whose tokens are a vocabulary's ids
    (data/tokenizer.py: V = its ``vocab_size``): the embedding reading the
    tokens needs V rows and the scores a loss or accuracy compares with
    its labels V classes; fewer is a ConfigError naming the layer's key
    (``net[i].input_dim``, ``net[i].num_output``) and V. Byte-level files
    keep the label check alone (a net for ASCII text may have 128 rows)."""
    from ..data.text import text_vocabulary
    from ..ops.softmax import _axis
    producers = graph.producers()
    for reader in [op for op in graph.ops.values() if op.op_type == "DataReader"]:
        spec = reader.attrs.get("source") or {}
        if spec.get("source") != "text":
            continue
        size, text = text_vocabulary(spec["path"])
        if text is None or not size:
            continue
        data, label = _passed_on(graph, reader.outputs[0]), _passed_on(graph, reader.outputs[1])
        for op in graph.ops.values():
            if op.op_type == "Embedding" and op.inputs[0] in data:
                have, key = graph.blobs[op.inputs[1]].shape, "input_dim"
                have = None if have is None else int(have[0])
            elif op.op_type in ("SoftmaxLoss", "Accuracy") and len(op.inputs) > 1 and \
                    op.inputs[1] in label and graph.blobs[op.inputs[0]].shape is not None:
                x = graph.blobs[op.inputs[0]]
                have = int(x.shape[_axis(op.attrs, len(x.shape))])
                op = next(iter(producers.get(op.inputs[0], [])), op)  # the scores' layer
                key = "num_output" if op.op_type == "InnerProduct" else None
            else:
                continue
            if have is None or have >= size:
                continue
            where, layer = layer_where(job, op)
            what = "rows" if key == "input_dim" else "classes"
            raise ConfigError(job.path, f"{where}.{key}" if key else where,
                              f"layer '{layer}' has {have} {what}, but text data file "
                              f"'{spec['path']}' holds ids of a vocabulary of {size} tokens "
                              f"(its /tokenizer): set it to at least {size}")


def job_vocabulary(job):
    """The vocabulary JSON of the job's text data (None: byte-level, or no
    text data); its train and test files must agree (UserError)."""
    from ..data.text import shared_vocabulary
    return shared_vocabulary([(f"data.{phase}.path", spec.path)
                              for phase, spec in (("train", job.data.train),
                                                  ("test", job.data.test))
                              if spec is not None and spec.source == "text"])


def _passed_on(graph, blob):
    """``blob`` and the blobs ops that hand it on unchanged make of it."""
    found, todo = {blob}, [blob]
    while todo:
        b = todo.pop()
        for op in graph.ops.values():
            if op.op_type in _LABEL_PASSING and b in op.inputs:
                todo.extend(o for o in op.outputs if o not in found)
                found.update(op.outputs)
    return found


#: the label of a padding position: never a class (the labels are checked to
#: lie in [0, C) at load time) nor a layer's ignore_label (those are >= 0)
PAD_LABEL = -1
#: ops that hand their input on unchanged (a label may pass them on its way)
_LABEL_PASSING = ("Split", "Copy", "Reshape", "Flatten")


def mark_padding(graph):
    """Let a test graph's data op pad the last batch of a one-pass test
    (data/sources.py, ``pass_counts``): when its label reaches only the label
    inputs of SoftmaxLoss and Accuracy ops (through copies and reshapes),
    PAD_LABEL becomes the data op's attr ``pad_label`` and every such op's
    attr ``pad_label`` too (apart from its own ``ignore_label``, which still
    means what the layer says: an accuracy without one counts every real
    sample of every class). Then a padding sample counts in neither the
    loss mean nor the accuracy, and nothing else of the test graph mixes the
    samples of a batch (dropout is off and batch norm uses its running
    statistics in the test phase). Returns the label, or None when the graph
    does not allow it (its one-pass test then wraps around, and says so)."""
    readers = [op for op in graph.ops.values() if op.op_type == "DataReader"]
    if len(readers) != 1:
        return None
    consumers, labels, seen = [], [readers[0].outputs[1]], set()
    while labels:
        blob = labels.pop()
        for op in graph.ops.values():
            if blob not in op.inputs or op.name in seen:
                continue
            seen.add(op.name)
            if op.op_type in _LABEL_PASSING:
                labels.extend(op.outputs)
            elif op.op_type in ("SoftmaxLoss", "Accuracy") and op.inputs.index(blob) == 1 \
                    and op.inputs.count(blob) == 1:
                consumers.append(op)
            else:
                return None
    for op in consumers:
        op.attrs["pad_label"] = PAD_LABEL
    readers[0].attrs["pad_label"] = PAD_LABEL
    return PAD_LABEL


def loss_blobs(graph):
    return {b.name: b.attrs["loss_weight"] for b in graph.blobs.values()
            if "loss_weight" in b.attrs}


def metric_blobs(graph):
    return [b.name for b in graph.blobs.values() if b.attrs.get("metric")]


def build_train_graph(job, rank=0, world_size=1, exchanged=True):
    """The single-replica training graph for ``rank`` of ``world_size``
    (data sharded as in docs/config.md, "Sample order"), before any parallel composition.
    Returns (graph, grads) where grads maps param -> gradient blob. With
    ``parallel.micro_batches: M`` the graph is built for one micro-batch
    (B/M samples); the composition copies it M times. Over several shards
    whose gradients make one update (``world_size`` replicas x M
    micro-batches; with ``exchanged`` false, a scheme whose replicas
    exchange no gradients, the M micro-batches of this replica; never the
    parameter servers', whose workers update on their own) and with
    ``parallel.ignore_label_mean: global``, a loss with an ``ignore_label``
    is normalised by their batch's count (``global_label_counts``)."""
    path = job.path
    if job.graph is not None:
        return graph_from_seed(job, rank, world_size, exchanged)
    if job.data.train is None:
        raise ConfigError(path, "data.train", "training needs a data.train section")
    spec = job.data.train.with_batch(job.micro_batch)
    g = forward_graph(job, "train", spec, rank, world_size)
    _count_labels_over_shards(g, job, world_size, exchanged)
    losses = loss_blobs(g)
    if not losses:
        raise ConfigError(path, "net", "the net has no loss layer (e.g. type: softmax_loss) "
                                       "in the train phase")
    grads = build_backward(g, losses)
    if not grads:
        frozen = [b.name for b in g.params() if b.attrs.get("learnable", True)]
        raise ConfigError(path, "net", "no learnable parameter receives a gradient from the loss"
                          + (f" (every one is frozen, lr_mult 0: {', '.join(frozen[:4])}"
                             f"{' ...' if len(frozen) > 4 else ''})"
                             if frozen and not any(trained(g.blobs[p]) for p in frozen) else ""))
    summary = add_recompute(g, job.recompute, net_layers(job), job.recompute_layers)
    sinks = add_solver(g, grads, job.solver)
    g = g.prune(sinks + list(losses) + metric_blobs(g))
    g.infer_shapes().validate()
    g.recompute = summary
    return g, grads


def _count_labels_over_shards(graph, job, world_size, exchanged):
    """``global_label_counts`` where a loss is split over several shards
    of one update (``build_train_graph``) under ``ignore_label_mean: global``."""
    if job.parallel.servers:   # a worker's push updates the servers on its own:
        exchanged = False      # its own batch's mean (over its micro-batches)
    if (world_size if exchanged else 1) * job.parallel.micro_batches > 1 and \
            job.parallel.ignore_label_mean == "global":
        global_label_counts(graph, "global" if exchanged else "replica", job)


def global_label_counts(graph, over="global", job=None):
    """Normalise each SoftmaxLoss with an ``ignore_label`` that reads the
    data op's label (also through ops that hand it on unchanged) by the
    global batch's count of labels other than its ``ignore_label``, divided
    by the shards: the data op's attrs ``count_label`` (its losses'
    ignore_labels, each counted once) and ``count_over`` (``over``:
    ``global``, every replica's shards; ``replica``, this replica's
    micro-batches) and its outputs after the label, ``label.normaliser``
    (one per ignore_label, ops/data.py), the loss op's third input
    (ops/softmax.py; and its SoftmaxLossGrad's fourth, where a complete
    ``graph:`` has one). A shard's loss is then its sum over its counted
    positions over that, and the shards' mean (the reported loss, the
    gradient the 1/shards of the update makes) is the global batch's mean
    over its counted positions, as on 1 rank without micro-batches. A loss
    whose label is not the one data op's (an op other than a copy or
    reshape makes it, or the graph has several data ops) has no count the
    data op could make without its shards' labels: a ConfigError naming
    ``parallel.ignore_label_mean`` (``job``'s file and the layer), since
    its shard's own mean is not what ``global`` promises."""
    losses = [op for op in graph.ops.values() if op.op_type == "SoftmaxLoss" and
              op.attrs.get("ignore_label") is not None and len(op.inputs) == 2]
    if not losses:
        return
    readers = [op for op in graph.ops.values() if op.op_type == "DataReader"]
    labels = _passed_on(graph, readers[0].outputs[1]) if len(readers) == 1 else set()
    for op in losses:
        if op.inputs[1] not in labels:
            raise _uncounted(job, op, len(readers))
    reader = readers[0]
    counted = count_labels(reader.attrs)
    for op in losses:
        ignore = int(op.attrs["ignore_label"])
        if ignore not in counted:
            counted.append(ignore)
            norm = graph.free_name(f"{reader.outputs[1]}.normaliser")
            graph.add_blob(norm, (), "float64", reader.location)
            reader.outputs.append(norm)
        norm = reader.outputs[2 + counted.index(ignore)]
        op.inputs.append(norm)
        for grad in graph.ops.values():  # a complete graph's backward of the loss
            if grad.op_type == "SoftmaxLossGrad" and len(grad.inputs) == 3 and \
                    grad.inputs[1] == op.outputs[1]:
                grad.inputs.append(norm)
    reader.attrs["count_label"] = counted[0] if len(counted) == 1 else counted
    reader.attrs["count_over"] = over


def _uncounted(job, op, data_ops):
    """The ConfigError of a loss ``global_label_counts`` cannot normalise
    (``data_ops``: how many the graph has)."""
    path = job.path if job is not None else None
    if job is not None and job.graph is None:
        where, layer = layer_where(job, op)
        who = f"layer '{layer}' ({where})"
    else:
        who = f"op '{op.name}' of the graph"
    why = (f"the graph has {data_ops} data ops" if data_ops != 1 else
           f"its label '{op.inputs[1]}' is not the data op's (an op other than a copy or "
           "reshape makes it)")
    return ConfigError(path, "parallel.ignore_label_mean",
                       f"'global' (the default) normalises a loss with an ignore_label by the "
                       f"global batch's count of its labels, which the data op makes; {who} "
                       f"has ignore_label {op.attrs['ignore_label']}, but {why}: set "
                       "parallel.ignore_label_mean: shard (each shard's own mean) or feed it "
                       "the data op's label")


def net_layers(job):
    """(name, canonical type, bottoms) of the net's layers, in order."""
    from ..layers.registry import layer_spec
    out = []
    for layer in job.net or ():
        bottoms = layer.get("bottom") or []
        out.append((layer["name"], layer_spec(layer["type"]).type,
                    [bottoms] if isinstance(bottoms, str) else list(bottoms)))
    return out


def graph_from_seed(job, rank=0, world_size=1, exchanged=True):
    """A training graph given in the seed's low-level format. A complete one
    (with SGDUpdate ops, e.g. from ``graph --format yaml``) runs as is; a
    forward-only one gets backward and solver ops generated. A loss with an
    ``ignore_label`` over several shards is normalised as a net's
    (``global_label_counts``), its backward too where the graph has it."""
    path = job.path
    g = seed_yaml.load([entry.to_dict() for entry in job.graph], path, job.name)
    for op in g.ops.values():
        if op.op_type == "DataReader":
            # the reader's own shard within the replica (copy k of M of a job with
            # parallel.micro_batches that graph --format yaml wrote: its attrs
            # micro_batch k and micro_batches M), as the micro-batch composition
            # numbers it: r·M + k of W·M. Set to the replica's alone, every copy read
            # the same rows (and the run half the data); not from the printed rank
            # and world size, which are the printed composition's (--np 2 --rank 1:
            # shard 1 of 2, half the data again on one rank)
            own = int(op.attrs.get("micro_batch", 0) or 0)
            of = int(op.attrs.get("micro_batches", 1) or 1)
            op.attrs["rank"], op.attrs["world_size"] = rank * of + own, world_size * of
    _count_labels_over_shards(g, job, world_size, exchanged)
    g.infer_shapes()
    limit_token_ids(g)
    if any(op.op_type in UPDATE_OP_TYPES for op in g.ops.values()):
        # its own clip ops go: the composition clips as the config says
        # (solver.clip_gradients, their threshold: job/config.py), after the
        # gradients' reduction
        from ..graph.clip import remove_clip
        remove_clip(g)
        grads = {op.inputs[0]: op.inputs[1] for op in g.ops.values()
                 if op.op_type in UPDATE_OP_TYPES}
        g.validate()
        return g, grads
    losses = loss_blobs(g)
    if not losses:
        raise ConfigError(path, "graph", "a forward-only graph needs a loss blob: mark one "
                                         "with attrs: {loss_weight: 1.0}")
    grads = build_backward(g, losses)
    sinks = add_solver(g, grads, job.solver)
    g = g.prune(sinks + list(losses) + metric_blobs(g))
    g.infer_shapes().validate()
    return g, grads


def check_test_phase(job, rank=0, world_size=1, shapes=None):
    """A net with layers of one phase (``phase: test`` or ``train``) has its
    test phase built once, so that a layer of it that cannot work is a
    ConfigError naming its key also where no test graph is built (no
    ``data.test``; ``graph`` of the train phase) rather than never
    reported: on the test data's shapes (``data.test``), else on the train
    data's (no ``data.test``, or a test file ``graph`` cannot read: it
    needs none, ``train`` names it). With ``shapes`` (the train graph's
    ``param_shapes``), a test set of given shapes is built also without
    such layers, for ``check_test_params``."""
    if job.graph is not None or job.data.train is None:
        return
    phased = any(layer.get("phase") for layer in job.net or ())
    g = None
    if job.data.test is not None and (phased or shapes is not None):
        try:
            g = data_graph(job, "test", job.data.test, rank, world_size)
        except UserError:
            g = None  # an unreadable test file: train's start-up names it
    if g is None and phased:
        g = data_graph(job, "test", job.data.train, rank, world_size)
    if g is None:
        return
    _add_net(job, "test", g)
    if shapes is not None:
        check_test_params(job, shapes, g)


def build_test_graph(job, rank=0, world_size=1):
    """The evaluation graph (test phase), or None when no test data is set
    (then ``check_test_phase``)."""
    if job.graph is not None:
        return None
    if job.data.test is None:
        check_test_phase(job, rank, world_size)
        return None
    g = forward_graph(job, "test", job.data.test, rank, world_size)
    sinks = list(loss_blobs(g)) + metric_blobs(g)
    if not sinks:
        return None
    g = g.prune(sinks)
    _in_place_after_sinks(g)
    g.infer_shapes().validate()
    return g


def _in_place_after_sinks(g):
    """In the forward-only test graph, an op that may write an output over
    an input (its kernel's ``in_place``: the softmax loss's probabilities
    over the logits) waits for the other readers of that input that end
    there (a metric: nothing reads their outputs), so the memory plan may
    put the output on the input's bytes, it being the last to touch them
    (runtime/memory_plan.py): GPT-2 124M's test logits and probabilities,
    read by the accuracy too, take one buffer instead of two (6.1 GiB at
    32 x 1024 positions of 50,304 classes)."""
    from ..ops.catalog import get_kernel_class
    cons = g.consumers()
    for op in list(g.ops.values()):
        cls = get_kernel_class(op.op_type, op.name)
        of = getattr(cls, "in_place_of", None)
        for i, _ in (of(op.attrs) if of is not None else getattr(cls, "in_place", ())):
            if i >= len(op.inputs):
                continue
            for r in cons.get(op.inputs[i], ()):
                if r.name != op.name and r.name not in op.control_inputs and \
                        not any(cons.get(b) for b in r.outputs) and \
                        op.name not in reachable(r.name, g.dependencies()):
                    op.control_inputs.append(r.name)


def kept_constant(blob):
    """A learnable parameter that never moves from its constant filler."""
    attrs = blob.attrs
    return (attrs.get("learnable", True) and attrs.get("lr_mult", 1.0) == 0
            and attrs.get("decay_mult", 1.0) == 0
            and attrs.get("filler", {}).get("type") == "constant")


def param_layer(name):
    """The layer of the parameter ``name`` (``<layer>/<suffix>``, layers/build.py):
    all but its last part, since a layer's name may hold a '/' itself (Caffe's
    ``loss3/classifier``, ``conv1/bn``)."""
    return name.rsplit("/", 1)[0]


def init_params(loaded, params, job, path, skip=()):
    """The names of ``params`` to take from a weights file's ``loaded``
    params (``--init`` / ``test --weights``): all of them, except those of
    the layers in ``skip`` (``--init-skip``: fine-tuning a changed layer keeps
    its fresh initialisation). A parameter the file lacks is a user error
    that lists what is missing, never a silent random weight; a layer the
    file's own config built otherwise (another num_heads: same shapes,
    other meaning) is one too (checkpoint_check.check_same_meaning)."""
    layers = set(job.layer_names)
    unknown = sorted(set(skip) - layers)
    if unknown:
        raise UserError(f"--init-skip: no layer named {', '.join(unknown)} in the net "
                        f"(layers: {', '.join(sorted(n for n in layers if n))})")
    wanted = [p for p in params if param_layer(p) not in set(skip)]
    missing = [p for p in wanted if p not in loaded]
    if missing:
        raise InitMismatch(f"weights file '{path}' lacks {len(missing)} parameter(s) of this "
                           f"net: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} "
                           f"(the file holds {', '.join(sorted(loaded)[:8]) or 'none'}"
                           f"{' ...' if len(loaded) > 8 else ''})", "; to leave a layer at its "
                           "fresh initialisation (fine-tuning), name it with --init-skip LAYER")
    for p in wanted:  # strings or records would reach the workspace as a traceback
        kind = getattr(getattr(loaded[p], "dtype", None), "kind", "f")
        if kind not in "fiu":
            raise UserError(f"weights file '{path}': dataset '/params/{p}' holds "
                            f"non-numeric values (dtype {loaded[p].dtype}), expected numbers "
                            "(float32, as a checkpoint writes them); it was written by another "
                            "tool or edited")
        if kind in "iu":  # every parameter is a float blob: cast, they trained as integers
            raise UserError(f"weights file '{path}': dataset '/params/{p}' holds integers "
                            f"(dtype {loaded[p].dtype}), but the parameter is a float blob: "
                            "trained weights are floating-point (float32, as a checkpoint "
                            "writes them), so this is not a file of trained weights (quantized "
                            "weights, indices, or a file edited by another tool?); convert it "
                            "to float yourself if you mean those values")
    if not str(path).endswith((".caffemodel", ".safetensors")):  # ours: saved with its config
        from .checkpoint_check import check_same_meaning
        from .checkpoint_file import saved_config_text
        check_same_meaning(saved_config_text(path), job.net, path,
                           {param_layer(p) for p in wanted})
    return wanted


def trained_values(graph, job, path):
    """{param: float32 array} of every parameter of ``graph`` from the weights
    file ``path`` (export onnx, export hf): a missing one is init_params'
    InitMismatch, a shape that differs a UserError naming both; the file's
    blobs ``graph`` has no parameter for are named in a note on stderr,
    except those of this net's layers the test phase has not."""
    import numpy as np
    from .checkpoint_file import load_params
    import sys
    from .checkpoint_check import unused_blobs
    loaded = load_params(path)
    params = [b.name for b in graph.params()]
    init_params(loaded, params, job, path)
    # a layer of this net the test phase leaves out (a phase: train auxiliary
    # head) is no sign of another net: its blobs are left out without a word
    layers = set(job.layer_names)
    extra = [b for b in unused_blobs(loaded, params) if param_layer(b) not in layers]
    if extra:  # not silently: a file of another net (a head more) gives another model
        shown = ", ".join(map(one_line, extra[:8])) + (" ..." if len(extra) > 8 else "")
        print(f"note: {path}: {len(extra)} blob(s) of the file are not in the exported "
              f"test-phase graph: {shown}; "
              "they are left out (a file of another net?)", file=sys.stderr)
    values = {}
    for p in params:
        value = np.asarray(loaded[p], dtype=np.float32)
        if value.shape != tuple(graph.blobs[p].shape):
            raise UserError(f"weights file '{path}': '{p}' has shape {list(value.shape)}, "
                            f"the net expects {list(graph.blobs[p].shape)}")
        values[p] = value
    return values


def check_fits_memory(graph, memory=None):
    """Raise a UserError naming the layer whose blobs (activations, weights,
    gradients) take the most memory when the graph's blobs would not fit in
    this machine's memory (``memory`` bytes; default: physical memory), so a
    mistyped num_output or batch size is named instead of ending in a
    MemoryError."""
    import os
    if memory is None:
        try:
            memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return
    layer_of = {}
    for op in graph.ops.values():
        for b in op.outputs:
            layer_of.setdefault(b, op.name.split(".")[0])
    need, biggest = {}, {}
    for b in graph.blobs.values():
        if b.alias_of is not None or b.shape is None:
            continue
        # an in-place copy (conv1@relu1), a gradient or state (conv1.grad) counts for
        # the layer whose output it is: the one whose num_output sets its size
        base = b.name.split("@")[0].split(".")[0]
        param = base in graph.blobs and graph.blobs[base].kind == "param"
        layer = param_layer(base) if param else layer_of.get(base, base)
        need[layer] = need.get(layer, 0) + b.nbytes
        if b.nbytes > biggest.get(layer, (0, None))[0]:
            biggest[layer] = (b.nbytes, b)
    total = sum(need.values())
    if total <= memory:
        return
    layer = max(need, key=need.get)
    blob = biggest[layer][1]
    gib = 1 << 30
    raise UserError(f"layer '{layer}' needs {need[layer] / gib:,.1f} GiB (blob '{blob.name}' "
                    f"{list(blob.shape)} {blob.dtype}; the net {total / gib:,.1f} GiB), more "
                    f"than this machine's {memory / gib:,.1f} GiB of memory: check its "
                    "num_output and the batch size")
