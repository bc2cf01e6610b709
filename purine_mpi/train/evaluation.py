"""The test pass: the mean loss and metrics over the test split, sharded
over the ranks, its metrics row and log line, and the services called
after it (``train/watch.py``). A part of ``Trainer`` (mixed in)."""
import math

import numpy as np

from ..io.data import source_info
from ..progress import progress


class EvaluationMixin:
    def evaluate(self, test_iter=None):
        """Mean loss and metrics over the test split (sharded over ranks)."""
        if self.test is None:
            return {}
        self.train.drain()  # the test graph reads the weights the train graph updates
        for k in self.test.kernels.values():
            if k.op.op_type == "DataReader":
                k.reset_position(0)
        spec = self.config["data"]["test"]
        n_samples, _ = source_info({k: v for k, v in spec.items() if k != "batch_size"})
        n = test_iter or self.solver.get("test_iter") or max(
            1, math.ceil(n_samples / (spec["batch_size"] * self.data_size)))
        note = repeat_note(n, spec["batch_size"], self.data_size, n_samples)
        if note and not getattr(self, "_wrap_noted", False):
            self._wrap_noted = True
            self._say(note)
        ws = self.test.workspace
        sums = np.zeros(len(self.test_names))
        per_batch = spec["batch_size"] * self.data_size
        with progress(n * per_batch, "test", "samples", log=self.log,
                      enabled=self.rank == 0) as bar:
            for i in range(n):
                self.test.run(i)
                sums += [float(ws[b]) if b in ws.arrays else 0.0 for b in self.test_names]
                bar.update(per_batch)
        out = {}
        for key, v in zip(self.test_keys, self._reduce(sums / n)):
            out[key] = out.get(key, 0.0) + float(v)
        out["samples"] = int(n * spec["batch_size"] * self.data_size)
        return out

    def _evaluate(self, iteration, metrics):
        res = self.evaluate()
        if not res:
            return res
        rec = {"phase": "test", "iter": iteration}
        rec.update(res)
        rec["time"] = round(self.elapsed(), 3)
        self._write(metrics, rec)
        extra = "  ".join(f"{k} {v:.4f}" for k, v in res.items() if k not in ("loss", "samples"))
        self._say(f"test @ iter {iteration}: loss {res['loss']:.4f}  {extra}  "
                  f"({res['samples']} samples)")
        if self.best is not None:
            self.best.after_test(iteration, res)
        if self.early_stop is not None and self.early_stop.after_test(iteration, res):
            self._early_stopped = iteration
        return res


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
