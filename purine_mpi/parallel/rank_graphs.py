"""This rank's graphs, built once before the training loop exists.

``build_rank_graphs(job, world, scheme)`` is the one function that turns
a job into what a rank runs: the single-replica training graph (job/replica.py),
composed by the parallel scheme (``Scheme.compose``, parallel/schemes/:
data parallel, pipeline, hybrid, tensor, a parameter-server worker), placed on this rank's device
and fused for it (parallel/placement.py), with the device loss watch on a GPU
and the micro-batch memory plan; and the test graph, composed and placed
the same way. The loop (train/loop.py) receives the result; it builds
nothing.
"""
import dataclasses

import numpy as np

from .nccl_backend import apply_backend
from .placement import add_loss_watch, configure_device, prepare_for_device
from ..job.replica import (build_test_graph, build_train_graph, check_data_labels,
                           check_test_params, job_vocabulary, param_shapes,
                           check_fits_memory, loss_blobs, mark_padding, metric_blobs)
from .schemes import scheme_of


@dataclasses.dataclass
class RankGraphs:
    """What a rank runs and the facts about it the loop and its services read."""

    layout: object            # parallel.schemes.Layout: replicas x stages, this rank's place
    graph: object             # the composed, placed training graph of this rank
    grads: dict               # parameter -> gradient blob (of the single-replica graph)
    device: int               # -1: the CPU; N >= 0: GPU N
    losses: list              # the loss blobs of the training graph
    loss_shares: list         # each loss's factor: its loss_weight (x a micro-batch copy's 1/m)
    watch: object             # the device loss watch's blob (GPU), else None
    deferred: bool            # the loss is read back only at the intervals (GPU)
    defer_update: bool        # the last updates finish during the next forward (CPU)
    memory_plan: object       # the micro-batch copies' shared buffers (or None)
    params: list              # this rank's parameter blobs
    net_params: list          # the whole net's parameter blobs (before any split)
    # (the trained parameters' (count, bytes, blobs, dtypes), the rest's
    # (count, bytes, blobs, kinds)) of the whole net: param_counts
    param_counts: tuple
    test_graph: object = None  # the composed, placed test graph (or None)
    test_losses: list = dataclasses.field(default_factory=list)
    test_names: list = dataclasses.field(default_factory=list)  # blobs a test pass reduces
    test_keys: list = dataclasses.field(default_factory=list)   # their metrics.jsonl keys
    test_scales: list = dataclasses.field(default_factory=list)  # their factors (loss_weight)
    test_pad: object = None   # the test data op's pad_label (job/replica.mark_padding), or None
    # per test_names entry: False (a mean over the batch's samples), or, for a
    # SoftmaxLoss/Accuracy with an ignore_label (a mean over its counted
    # positions), (the blob of its CountedPositions op, None where this
    # rank's graph lacks it,)
    test_counts: list = dataclasses.field(default_factory=list)
    comm_backend: object = None       # "mpi" or "nccl" (parallel.backend), None: not chosen
    comm_backend_note: object = None  # why, for the start-up block
    composition: object = None        # the scheme's Composition (parallel/schemes/base.py)
    test_composition: object = None   # the test graph's (its one-sided windows, held too)
    vocabulary: object = None  # the token data's vocabulary JSON (data/tokenizer.py), None: bytes
    #: the replicas train apart (a scheme that exchanges no gradients, scheme
    #: none, on several ranks): each keeps its own running statistics, and a
    #: test pass evaluates rank 0's replica, the model a save writes, over
    #: the whole split (``test_data``), the other ranks adding nothing
    apart: bool = False

    @property
    def pipeline(self):
        return self.layout.staged

    @property
    def test_data(self):
        """(replica, replicas): the test split's shard this rank's test
        graph reads (``Layout.test_shard``)."""
        return self.layout.test_shard(self.apart)

    @property
    def counts_test_figures(self):
        """Whether this rank's test figures enter the pass's sums: shard 0
        of a tensor group (its ranks hold the same figures); where the
        replicas train ``apart``, rank 0 alone (its replica is saved)."""
        lay = self.layout
        return lay.shard == 0 and (not self.apart or lay.rank(lay.replica, lay.stage) == 0)

    @property
    def data_size(self):
        """The data replicas: the data is sharded over them."""
        return self.layout.replicas


def build_rank_graphs(job, world, scheme=None, check_memory=True):
    """This rank's training and test graphs for ``job`` (job/job.py) in
    ``world`` under ``scheme`` (default: the job's own, ``scheme_of(job)``).
    ``check_memory``: refuse a net whose blobs outgrow this host's memory
    (false for ``plan``, which accounts every byte itself, for the device
    the job names: a GPU job planned on a small host)."""
    scheme = scheme or scheme_of(job)
    # the capabilities are those of the scheme the job runs: a bare
    # ``Scheme()`` (or a test's unregistered subclass) stands for it and
    # has none of its own (reading one raises: schemes/base.Capability)
    own = scheme.job_scheme(job)
    # replicas x stages (parallel/compose.py): the data is sharded over the
    # replicas (a pipeline is one replica; its stage 0 reads the data)
    layout = scheme.layout(job, world)
    # a loss with an ignore_label is normalised over the shards of one
    # update: every replica's where the scheme exchanges gradients
    graph, grads = build_train_graph(job, layout.replica, layout.replicas,
                                     own.exchanges_gradients)
    if check_memory:
        check_fits_memory(graph)  # a layer too big is named, not a MemoryError
    check_data_labels(graph, job)
    vocabulary = job_vocabulary(job)  # train and test agree; checkpoints keep it
    counts = param_counts(graph)  # the whole net's, before any split
    shapes = param_shapes(graph)  # the test graph runs on these arrays
    net_params = [b.name for b in graph.params()]
    composition = scheme.compose(graph, grads, job, world)
    graph = composition.graph
    # device: -1 leaves the graph on the CPU; N >= 0 places it on a GPU
    # (the node-local rank picks among several) and the stream dispatcher runs it
    device = configure_device(job, graph)
    # parallel.backend: the buckets through MPI or NCCL (the same choice on every rank)
    backend, backend_note = apply_backend(graph, job, world, device)
    losses = loss_blobs(graph)
    # the reported loss is the objective: each loss blob times its
    # loss_weight (docs/formats.md); with micro-batches each copy's loss is
    # its micro-batch's mean (with an ignore_label, the global batch's
    # normaliser: the copies' mean is the global mean, job/replica.py)
    shares = [float(w) * graph.blobs[b].attrs.get("micro_batch_share", 1.0)
              for b, w in losses.items()]
    losses = list(losses)
    # on a GPU the loss stays on the device between the display, test and
    # checkpoint intervals (ops/watch.py): the host reads it back only there
    deferred = device >= 0 and own.defer_loss_readback
    watch = add_loss_watch(graph, losses, shares, device) if deferred and losses else None
    # micro-batch copies never live at once share their activation buffers
    # (after the device's fusions, which the plan must not block)
    plan = scheme.plan_memory(graph, job, world)
    # parallel.defer_update: the last buckets' allreduce and update finish
    # while the next iteration's forward runs (runtime/tail.py; the CPU
    # event dispatcher, synchronous data parallelism)
    defer_update = scheme.update_deferred(job, layout)
    out = RankGraphs(layout=layout, graph=graph, grads=grads, device=device, losses=losses,
                     loss_shares=shares, watch=watch, deferred=deferred,
                     defer_update=defer_update, memory_plan=plan,
                     params=[b.name for b in graph.params()], net_params=net_params,
                     param_counts=counts, comm_backend=backend,
                     comm_backend_note=backend_note, composition=composition,
                     vocabulary=vocabulary,
                     apart=scheme.trains_apart(job, layout))
    _add_test_graph(out, job, world, scheme, shapes)
    return out


def _add_test_graph(out, job, world, scheme, shapes):
    test = build_test_graph(job, *out.test_data)
    if test is not None:
        check_test_params(job, shapes, test)  # a test set of other sample shapes
        check_data_labels(test, job)
        # a one-pass test pads its last batch: the padding counts in no figure
        out.test_pad = mark_padding(test)
        # names from the whole test graph: in a pipeline one rank holds
        # them, yet every rank reduces the same vector
        weights = loss_blobs(test)
        out.test_losses = list(weights)
        accuracy = [op.outputs[0] for op in test.ops.values() if op.op_type == "Accuracy"]
        # metrics.jsonl (docs/formats.md) names the accuracy "accuracy", whatever the
        # layer's top is called; further metrics keep their blob names
        out.test_keys = ["loss"] * len(out.test_losses) + [
            "accuracy" if accuracy == [b] else b for b in metric_blobs(test)]
        out.test_names = out.test_losses + metric_blobs(test)
        # the test "loss" is the objective, as the train rows': the sum of
        # the loss blobs times their loss_weight
        out.test_scales = [float(weights[b]) for b in out.test_losses] + \
            [1.0] * (len(out.test_names) - len(out.test_losses))
        # a figure with an ignore_label is weighted by its counted positions,
        # counted in the graph beside it (ops/softmax.py CountedPositions)
        counts = [_add_count(test, b) for b in out.test_names]
    if test is not None:
        # a pipeline's test graph has one-sided windows of its own, allocated
        # now and held to the end beside the training graph's (footprint.py)
        out.test_composition = scheme.compose_test(test, job, world)
        out.test_graph = out.test_composition.graph
    if out.test_graph is not None:
        prepare_for_device(out.test_graph, out.device, train=False,
                           precision=job.precision)
    if out.test_graph is not None:
        # per figure: False, or (its count blob, None where this rank's
        # graph lacks it: a pipeline's other stages)
        out.test_counts = [c is not None and (c if c in out.test_graph.blobs else None,)
                           for c in counts]


def _add_count(graph, blob):
    """When ``blob`` is the output of a SoftmaxLoss or Accuracy of
    ``graph`` with an ``ignore_label`` (its batch figure is the mean over
    the positions it counts): a
    ``CountedPositions`` op beside it, of its label and attrs, added to
    ``graph``; returns its output blob (``<blob>.counted``), else None.
    Named after the op's layer, so a pipeline puts it on that op's stage,
    and a reader of the label, so a stage transfer's release of the label
    waits for it."""
    for op in list(graph.ops.values()):
        if op.op_type in ("SoftmaxLoss", "Accuracy") and op.outputs[0] == blob:
            if op.attrs.get("ignore_label") is None:
                return None
            count = f"{blob}.counted"
            graph.infer_shapes([graph.add_op(
                f"{op.name}.counted", "CountedPositions", [op.inputs[1]], [count],
                {k: op.attrs[k] for k in ("ignore_label", "pad_label")
                 if op.attrs.get(k) is not None}, op.location, op.thread)])
            return count
    return None


def param_counts(graph):
    """``(trained, rest)`` of a graph's parameter blobs: ``trained`` the
    (count, bytes, blobs, dtypes) of those that take a gradient
    (graph/grad.py's ``trained``), ``rest`` the (count, bytes, blobs,
    kinds) of the others: running statistics (batch norm's mean and
    variance, ``learnable: false``) and frozen parameters (``lr_mult: 0``),
    state a checkpoint holds but no solver trains."""
    from ..graph.grad import trained
    params = graph.params()
    used = [b for b in params if trained(b)]
    rest = [b for b in params if not trained(b)]
    kinds = []
    if any(not b.attrs.get("learnable", True) for b in rest):
        kinds.append("running statistics")
    if any(b.attrs.get("learnable", True) for b in rest):
        kinds.append("frozen")
    return _summary(used), _summary(rest)[:3] + (kinds,)


def _summary(blobs):
    """(parameter count, bytes, blobs, dtypes) of parameter blobs."""
    return (sum(int(np.prod(b.shape)) for b in blobs), sum(int(b.nbytes) for b in blobs),
            len(blobs), sorted({str(np.dtype(b.dtype)) for b in blobs}))
