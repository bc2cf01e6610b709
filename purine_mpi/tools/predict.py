"""``predict CONFIG --weights W --out preds.h5``: per-sample outputs of a
data split, as Caffe's ``extract_features`` and Lightning's ``predict``.

The test-phase graph (center crops, no dropout) runs once over the whole
split, in file order (the split's shuffle is off here), sharded over the
ranks as evaluation is; rank 0 gathers every batch and writes, atomically:

    /outputs/<blob>   (N, ...) float: each requested blob, per sample
    /label            (N,) int64: the split's labels
    /index            (N,) int64: each row's sample index in the split
    attrs: config (YAML), weights, split, blobs

The default blob is the net's last output: the scores the loss layer reads.
A blob must be computed in the test phase (an input of the loss or a
metric, or of what they read); ``--blob`` names others: a blob written in
place is its newest version (``newest_version``), and each requested blob
keeps memory of its own in the test graph's memory plan.
"""
import dataclasses

import numpy as np

from ..base.errors import ConfigError, UserError
from ..base.runfiles import make_parent, stop_if_write_failed, write_hdf5_replacing
from ..job.config import dump_config
from ..data.sources import pass_batches, source_info
from ..parallel.tensor_split import join_shards


def default_blob(graph):
    """The scores the first loss op reads (its first input)."""
    for op in graph.ops.values():
        if op.op_type.endswith("Loss"):
            return op.inputs[0]
    raise UserError("predict: the test phase has no loss layer, so there is no default "
                    "output; name a blob with --blob")


def _default_reads(graph):
    """[the default blob], or none where this rank's test graph has no loss
    (a pipeline's first stage: ``predict`` then says it runs no pipeline)."""
    if any(op.op_type.endswith("Loss") for op in graph.ops.values()):
        return [default_blob(graph)]
    return []


def newest_version(graph, name):
    """The blob a layer reading ``name`` after the whole net would read: a
    top written in place (equal to its bottom) is a new version of the blob,
    ``name@<layer>`` (layers/build.py), the last written the newest -- what
    Caffe's blob of that name holds after the forward pass."""
    writes = [o for op in graph.ops.values() for o in op.outputs
              if o == name or o.startswith(name + "@")]
    return writes[-1] if writes else name


def predict_split(job, out_path, weights, blobs=None, split="test", log=print):
    """``predict``: ``job``'s ``split`` through its test phase, in file order
    (the test-phase transform), with ``weights``; see ``predict``."""
    from ..train.trainer import Trainer
    spec = job.data.get(split)
    if spec is None:
        raise ConfigError(job.path, f"data.{split}", f"predict --split {split} "
                          "needs that data")
    order = job.data.order + (() if "test" in job.data.order else ("test",))
    job = job.replace(data=dataclasses.replace(
        job.data, test=dataclasses.replace(spec, shuffle=False), order=order))
    # the blobs read after each iteration keep their own memory: with the
    # memory plan a transient blob's is another blob's by the iteration's end
    t = Trainer(job, "/nonexistent-predict-output", init=weights, log=log,
                test_reads=lambda graph: [newest_version(graph, b)
                                          for b in blobs or _default_reads(graph)])
    try:
        return predict(t, out_path, weights, blobs, split)
    finally:
        t.close()


def predict(trainer, out_path, weights, blobs=None, split="test"):
    """Run the trainer's test graph over the whole split and write the
    outputs (see the module docstring); returns {"samples", "blobs", "out"}."""
    from ..train.evaluation import give_test_weights
    if trainer.test is None:
        raise UserError(f"{trainer.job.path}: key 'data.{split}': predict needs "
                        "that data and a loss layer in the test phase")
    if trainer.graphs.pipeline:
        raise UserError("predict runs the whole net on each rank: not a pipeline or hybrid "
                        "scheme (run it with one rank, or parallel.scheme: data)")
    graph, dispatcher = trainer.graphs.test_graph, trainer.test
    ws = dispatcher.workspace
    blobs = list(blobs or [default_blob(graph)])
    reads = {b: newest_version(graph, b) for b in blobs}
    missing = [b for b in blobs if reads[b] not in graph.blobs]
    if missing:
        raise UserError(f"predict: blob(s) {', '.join(missing)} are not computed in the test "
                        f"phase; choose among {', '.join(sorted(_outputs(graph))[:20])}")
    per_sample = sorted(b for b in _outputs(graph) if _per_sample(graph, b, trainer))
    figures = [b for b in blobs if not _per_sample(graph, reads[b], trainer)]
    if figures:  # a loss or accuracy: one figure per batch, no row per sample
        shapes = ", ".join(f"{b} {list(graph.blobs[reads[b]].shape)}" for b in figures)
        raise UserError(f"predict: blob(s) {shapes} hold no row per sample (their first axis "
                        f"is not the batch's, {trainer.job.data.test.batch_size}): predict "
                        f"writes per-sample outputs; choose among {', '.join(per_sample[:20])}")
    splits = tensor_splits(trainer, graph, [reads[b] for b in blobs])
    readers = [k for k in dispatcher.kernels.values() if k.op.op_type == "DataReader"]
    label_blob = readers[0].op.outputs[1] if readers else None
    spec = trainer.job.data.test
    n, _ = source_info(spec.source_dict())
    # the test graph's shard of the split: its replica's, or (scheme none's
    # replicas apart) the whole split on every rank, rank 0's rows written
    batch, (_, ranks) = spec.batch_size, trainer.graphs.test_data
    iters = pass_batches(n, batch, ranks)  # one pass, as a test pass without test_iter
    for k in readers:
        k.reset_position(0)
        k.pad_from(None)  # the rows past the split are dropped below
    trainer.train.drain()
    give_test_weights(trainer)  # ZeRO-3: the weight shards gathered, as a test pass does
    parts = {b: [] for b in blobs + ["label"]}
    for i in range(iters):
        dispatcher.run(i)
        mine = {b: read_blob(graph, ws, reads[b]) for b in blobs}
        mine["label"] = _host(ws[label_blob]) if label_blob else np.zeros(batch, np.int64)
        every = trainer.world.gather_object(mine, 0, "the predictions (gather)") \
            if trainer.world.size > 1 else [mine]
        if trainer.world.rank == 0:
            for group in ([every[:1]] if trainer.graphs.apart else
                          replica_parts(every, trainer.graphs.layout)):
                for b in parts:
                    joined = splits.get(reads.get(b))
                    parts[b].append(join_shards(joined, [p[b] for p in group]) if joined
                                    else group[0][b])
    if trainer.world.rank != 0:
        return None
    rows = {b: np.concatenate(v)[:n] for b, v in parts.items()}
    _write(out_path, rows, blobs, trainer, weights, split, n)
    return {"samples": int(n), "blobs": blobs, "out": out_path}


def replica_parts(every, layout):
    """Each data replica's parts of ``every`` (one per rank, in rank
    order), in replica order, which is sample order (docs/config.md,
    "Sample order"): the parts of the ranks of the replica's tensor group,
    in shard order (they read the same batch; a blob outside the split
    pairs is the same on each, shard 0's is written; parameter servers,
    the last ranks, read none)."""
    return [[every[k] for k in layout.tensor_ranks(r, 0)] for r in range(layout.replicas)]


def tensor_splits(trainer, graph, names):
    """{blob: its split (``axis``, ``blocks``, tensor_split.join_shards')}
    for each of ``names`` that ``scheme: tensor`` splits in this rank's
    test graph ``graph`` (an activation between a split pair's fc layers:
    the column fc's output and the element-wise ops' after it, or an
    attention layer's heads): its whole is the shards joined along the one
    axis where its shape differs from the unsplit test graph's. A blob
    whose shards cannot be joined so is refused (exit 2)."""
    from ..job.replica import build_test_graph
    from ..parallel.tensor_parallel import ELEMENTWISE
    from ..parallel.tensor_split import split_of
    degree = trainer.graphs.layout.tensor
    if degree == 1 or trainer.graphs.apart:
        return {}
    whole = build_test_graph(trainer.job, *trainer.graphs.test_data)
    producer = graph.producers()
    out = {}
    for name in names:
        mine = tuple(graph.blobs[name].shape)
        full = tuple(whole.blobs[name].shape) if name in whole.blobs else None
        if full == mine:
            continue
        if full is None:
            raise UserError(f"predict: blob {name} is not the net's: the tensor-parallel split "
                            f"(parallel.tensor_parallel {degree}) made it; name a blob of the "
                            "net, or run predict with parallel.scheme: data")
        axes = [] if len(full) != len(mine) else \
            [a for a, (m, f) in enumerate(zip(mine, full)) if m != f]
        if len(axes) != 1 or mine[axes[0]] * degree != full[axes[0]]:
            raise UserError(f"predict: blob {name} is split over the {degree} tensor shards "
                            f"(shape {list(mine)} on a shard, {list(full)} whole) "
                            "in a way predict cannot join; run it with parallel.scheme: data")
        blocks, cur = 1, name  # the q, k, v blocks of an attention's projection
        while cur in producer:
            op = producer[cur][-1]
            if op.op_type == "InnerProduct":
                split = split_of(graph.blobs[op.inputs[1]]) or {}
                blocks = int(split.get("blocks", 1)) if split.get("axis") == 0 else 1
                break
            if op.op_type not in ELEMENTWISE:
                break
            cur = op.inputs[0]
        out[name] = {"axis": axes[0], "blocks": blocks}
    return out


def _outputs(graph):
    return {b for op in graph.ops.values() for b in op.outputs}


def _per_sample(graph, name, trainer):
    """Whether blob ``name`` holds a row per sample of the test batch (its
    first axis the batch's), not a figure of the batch (a loss, an accuracy)."""
    shape = tuple(graph.blobs[name].shape)
    return bool(shape) and shape[0] == trainer.job.data.test.batch_size


def read_blob(graph, ws, name):
    """Blob ``name`` of ``graph`` read from workspace ``ws`` onto the host:
    a blob of bfloat16 values stored as bits (parallel/precision.store_bits:
    on a GPU in bf16 the layers' copies that ``newest_version`` finds,
    ``<top>@bf16``) widened to those values in float32, not its uint16 bits."""
    from ..base.precision import from_bf16_bits, is_bits
    value = _host(ws[name])
    blob = graph.blobs[name]
    if blob.attrs.get("precision") == "bfloat16" and is_bits(blob.dtype):
        return from_bf16_bits(value, np.empty(value.shape, np.float32))
    return value


def _host(array):
    from ..base.backend import to_numpy
    return np.array(to_numpy(array), copy=True)


def _write(path, rows, blobs, trainer, weights, split, n):
    make_parent(path)

    def fill(f):
        group = f.create_group("outputs")
        for b in blobs:
            group.create_dataset(b.replace("/", "|"), data=rows[b], fletcher32=True)
            stop_if_write_failed()  # a full disk: the other outputs are not written
        f.create_dataset("label", data=rows["label"].astype(np.int64))
        f.create_dataset("index", data=np.arange(n, dtype=np.int64))
        f.attrs["format"] = "purine_mpi.predictions"
        f.attrs["config"] = dump_config(trainer.job)
        f.attrs["weights"] = str(weights)
        f.attrs["split"] = split
        f.attrs["blobs"] = ",".join(blobs)
    write_hdf5_replacing(path, fill)  # a full disk is one line
