"""The test pass (a loop service): the mean loss and metrics over the test
split, sharded over the ranks (each sample of a one-pass test counted
exactly once, whatever the number of ranks), its metrics row and log line; at the test
interval, once at the end, and before training with
``solver.test_initialization`` (Caffe's; by default for token data, as
nanoGPT). For token data (a ``text`` source) the line names the split
(``val @ iter 100: ...``) and counts tokens, and the row adds ``tokens``. ``loop.state.result`` holds its
figures for the services after it (watch.py) and the run's result.
"""

import numpy as np

from ..data.sources import pass_batches, pass_counts, repeat_note, source_info
from ..parallel.schemes import scheme_of
from ..base.logfile import non_finite_figures
from ..base.progress_bar import progress
from ..base.cancel import Cancel
from .collectives import share_running_stats, world_sum
from .loop import Service


def give_test_weights(loop):
    """The weights the test graph reads, where it does not share the
    training workspace's (the scheme's ``give_test_weights``; ZeRO-3: every
    rank's shards gathered into the test graph's arrays). Collective on
    every rank; for a test pass and ``predict`` (tools/predict.py)."""
    scheme_of(loop.job).give_test_weights(loop.graphs, loop.train.workspace, loop.world,
                                          loop.test.workspace)


class Evaluation(Service):
    def __init__(self):
        self._wrap_noted = False
        self._empty_noted = False

    def on_test(self, loop, done):
        res = self.evaluate(loop)
        # a pass with a non-finite figure (the weights are finite, checked
        # before it: the forward pass overflowed on the test data) measured
        # nothing: none of its figures is a result -- an accuracy beside a
        # NaN loss comes of the same overflowed scores -- so none is shown
        # (the row holds nulls), kept as the best or counted as an
        # improvement (watch.py),
        # and a run that ends on one exits 3 (trainer.py), as ``test`` does.
        # The figures are the world's sums: every rank decides alike
        bad = non_finite_figures(res)
        if bad:
            res = {k: (float("nan") if k != "samples" else v) for k, v in res.items()}
        loop.state.result = res
        if not res:
            return
        row = {"phase": "test", "iter": done}
        row.update(res)
        spec = loop.job.data.test
        text = spec.source == "text"  # token data: its split's name, tokens counted
        if text:
            row["tokens"] = res["samples"] * int(spec.sequence_length)
        row["time"] = round(loop.elapsed(), 3)
        loop.record(row)
        count = f"{row['tokens']:,} tokens" if text else f"{res['samples']} samples"
        if bad:
            loop.say(f"{spec.split if text else 'test'} @ iter {done}: non-finite "
                     f"{', '.join(bad)} (NaN or inf) on finite weights: the forward pass "
                     f"overflowed on the test data; no figure of this pass is a result "
                     f"({count})")
            return
        figures = "  ".join([f"loss {res['loss']:.4f}"] + [
            f"{k} {v:.4f}" for k, v in res.items() if k not in ("loss", "samples")])
        loop.say(f"{spec.split if text else 'test'} @ iter {done}: {figures}  ({count})")

    def evaluate(self, loop, test_iter=None):
        """Loss and metrics over the test split, sharded over the replicas.

        With ``test_iter`` (the argument or ``solver.test_iter``) the pass is
        that many global batches and every sample read counts, wrapping
        around the split (``repeat_note``). Without, it is one pass
        (data/sources.py, ``pass_batches``): the last batch is padded and its
        padding counts in no figure (job/replica.py, ``mark_padding``), so every
        sample counts exactly once on any number of ranks. Each figure is
        the mean over what it counts in the whole pass: the sum over ranks
        and batches of a batch's figure times its count, over the counts'
        sum. A batch's figure is a mean over its counted samples, or, for a
        SoftmaxLoss or Accuracy with an ``ignore_label``, over its counted
        positions (counted in the graph by a ``CountedPositions`` op on the
        label the figure's op reads: a pipeline stage's label is a transfer
        window the stage before refills with the next batch's as soon as
        its readers are done): so the loss is the sum of the positions' losses over
        their number (PyTorch's ``ignore_index``, Caffe's VALID over the
        whole pass), the accuracy the right positions over the counted."""
        if loop.test is None:
            return {}
        # the test graph reads the weights the train graph updates, and its
        # transient blobs take the bytes of the train graph's (the arena a
        # test workspace reuses, host and GPU: runtime/workspace.py): every
        # device stream of the training iteration (its CUDA-graph replays,
        # the deferred tail) has finished before the pass writes
        loop.train.drain()
        share_running_stats(loop)  # scheme none: each replica keeps its own
        give_test_weights(loop)
        spec = loop.job.data.test
        n_samples, _ = source_info(spec.source_dict())
        # the replicas shard the split; where they train apart (scheme
        # none) rank 0 reads all of it with the saved model, alone
        (replica, replicas), here = loop.graphs.test_data, loop.graphs.counts_test_figures
        batch = spec.batch_size
        given = test_iter or loop.job.solver.test_iter
        n = given or pass_batches(n_samples, batch, replicas)
        padded = not given and loop.graphs.test_pad is not None
        # positions below ``limit`` are samples; those past it are padding
        limit = n_samples if padded else n * batch * replicas
        for k in loop.test.kernels.values():
            if k.op.op_type == "DataReader":
                k.reset_position(0)
                k.pad_from(limit if padded else None)
        note = None if padded else repeat_note(n, batch, replicas, n_samples,
                                               unpadded=not given)
        if note and not self._wrap_noted:
            self._wrap_noted = True
            loop.say(note)
        ws, names = loop.test.workspace, loop.graphs.test_names
        counted = min(limit, n * batch * replicas)
        # per figure: the weighted sum, and for those counting positions their count
        sums, positions = np.zeros(len(names)), np.zeros(len(names))
        by_position = [bool(c) for c in loop.graphs.test_counts] or [False] * len(names)
        with progress(counted, "test", "samples", log=loop.log,
                      enabled=loop.world.rank == 0) as bar:
            for i in range(n if here or not loop.graphs.apart else 0):
                loop.test.run(i)
                counts = pass_counts(i, replicas, batch, limit)
                # a tensor-parallel group's ranks hold the same figures: shard 0 counts
                mine = float(counts[replica]) if here else 0.0
                for j, (b, scale) in enumerate(zip(names, loop.graphs.test_scales)):
                    if b not in ws.arrays:
                        continue
                    weight = mine
                    if by_position[j] and mine:  # counted in the graph, beside the figure
                        weight = float(ws[loop.graphs.test_counts[j][0]])
                        positions[j] += weight
                    sums[j] += weight * scale * float(ws[b])
                bar.update(int(counts.sum()))
        # each run above ends synchronised (sync=True); said once more, as
        # training resumes in the arena the pass used (no-op when idle)
        loop.test.synchronize()
        out = {}
        # every replica holds each figure on one of its ranks (a pipeline's
        # last stage), the others add 0: the world's sum is the replicas'
        # sum; one collective, the same on every rank
        figures = np.concatenate([sums, positions])
        if loop.graphs.apart and loop.world.rank != 0:  # rank 0's pass alone: not a stall
            with Cancel.waiting_for_rank0():
                total = world_sum(loop.world, figures, "the test figures")
        else:
            total = world_sum(loop.world, figures, "the test figures")
        # nothing counted (every position ignored): 0, as a batch's loss (Caffe's)
        over = [max(c, 1.0) if p else counted
                for c, p in zip(total[len(names):], by_position)]
        for key, v in zip(loop.graphs.test_keys, total[:len(names)] / np.array(over)):
            out[key] = out.get(key, 0.0) + float(v)
        # that 0 measures nothing: said (once a run), not passed off as a result
        empty = sorted({key for key, c, p in zip(loop.graphs.test_keys, total[len(names):],
                                                 by_position) if p and c == 0})
        if empty and not self._empty_noted:
            self._empty_noted = True
            loop.say(f"note: the test pass counted no position for {', '.join(empty)}: every "
                     "label is the layer's ignore_label; its figure 0 is Caffe's for nothing "
                     "counted, not a measurement")
        out["samples"] = int(counted)
        return out
