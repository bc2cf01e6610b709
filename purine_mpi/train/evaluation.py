"""The test pass (a loop service): the mean loss and metrics over the test
split, sharded over the ranks, its metrics row and log line; at the test
interval, once at the end, and before training with
``solver.test_initialization`` (Caffe's). ``loop.result`` holds its
figures for the services after it (watch.py) and the run's result.

Layer: services (docs/DESIGN.md); may import the foundation, devices, data,
ops, graph, job, composition and dispatch layers below it, and its own.
"""
import math

import numpy as np

from ..io.data import source_info
from ..progress import progress
from .loop import Service


class Evaluation(Service):
    def __init__(self):
        self._wrap_noted = False

    def on_test(self, loop, done):
        res = self.evaluate(loop)
        loop.result = res
        if not res:
            return
        row = {"phase": "test", "iter": done}
        row.update(res)
        row["time"] = round(loop.elapsed(), 3)
        loop.record(row)
        extra = "  ".join(f"{k} {v:.4f}" for k, v in res.items() if k not in ("loss", "samples"))
        loop.say(f"test @ iter {done}: loss {res['loss']:.4f}  {extra}  "
                 f"({res['samples']} samples)")

    def evaluate(self, loop, test_iter=None):
        """Mean loss and metrics over the test split (sharded over ranks)."""
        if loop.test is None:
            return {}
        loop.train.drain()  # the test graph reads the weights the train graph updates
        for k in loop.test.kernels.values():
            if k.op.op_type == "DataReader":
                k.reset_position(0)
        spec = loop.job.data.test
        n_samples, _ = source_info(spec.source_dict())
        per_batch = spec.batch_size * loop.data_size
        n = test_iter or loop.solver.test_iter or max(1, math.ceil(n_samples / per_batch))
        note = repeat_note(n, spec.batch_size, loop.data_size, n_samples)
        if note and not self._wrap_noted:
            self._wrap_noted = True
            loop.say(note)
        ws, names = loop.test.workspace, loop.graphs.test_names
        sums = np.zeros(len(names))
        with progress(n * per_batch, "test", "samples", log=loop.log,
                      enabled=loop.rank == 0) as bar:
            for i in range(n):
                loop.test.run(i)
                sums += [float(ws[b]) if b in ws.arrays else 0.0 for b in names]
                bar.update(per_batch)
        out = {}
        for key, v in zip(loop.graphs.test_keys, loop.reduce(sums / n)):
            out[key] = out.get(key, 0.0) + float(v)
        out["samples"] = int(n * per_batch)
        return out


def repeat_note(batches, batch_size, ranks, n_samples):
    """The note on a test pass of ``batches`` global batches of ``batch_size``
    x ``ranks`` that is longer than the split's ``n_samples`` (None when it
    is not): the test reader wraps around (as Caffe's), so sample i counts
    q + 1 times for the first r samples and q times for the others, where
    q, r = divmod(total, n_samples)."""
    total = batches * batch_size * ranks
    if total <= n_samples:
        return None
    q, r = divmod(total, n_samples)
    how = f"{total} samples of a {n_samples}-sample test split: "
    first = "the first sample counts" if r == 1 else f"the first {r} samples count"
    if r == 0:
        how += f"{q} full passes, each sample counts {q} times"
    elif q == 1:
        how += f"a full pass, and {first} twice"
    else:
        how += (f"{q} full passes and a part: {first} {q + 1} times, the other "
                f"{n_samples - r} count {q} times")
    return (f"note: a test pass of {batches} batches of {batch_size} x {ranks} rank(s) reads "
            f"{how} (the reader wraps around, as in Caffe); for exact figures make test_iter x "
            f"the global batch equal the split (null test_iter: one pass)")
