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
        spec = self.job.data.test
        n_samples, _ = source_info(spec.source_dict())
        n = test_iter or self.solver.test_iter or max(
            1, math.ceil(n_samples / (spec.batch_size * self.data_size)))
        extra = n * spec.batch_size * self.data_size - n_samples
        if extra > 0 and not getattr(self, "_wrap_noted", False):
            self._wrap_noted = True
            self._say(f"note: the test split has {n_samples} samples, not a multiple of the "
                      f"global test batch ({spec.batch_size} x {self.data_size}); as in "
                      f"Caffe the last batch wraps around and {extra} samples count twice "
                      "(choose data.test.batch_size to divide the split for exact figures)")
        ws = self.test.workspace
        sums = np.zeros(len(self.test_names))
        per_batch = spec.batch_size * self.data_size
        with progress(n * per_batch, "test", "samples", log=self.log,
                      enabled=self.rank == 0) as bar:
            for i in range(n):
                self.test.run(i)
                sums += [float(ws[b]) if b in ws.arrays else 0.0 for b in self.test_names]
                bar.update(per_batch)
        out = {}
        for key, v in zip(self.test_keys, self._reduce(sums / n)):
            out[key] = out.get(key, 0.0) + float(v)
        out["samples"] = int(n * spec.batch_size * self.data_size)
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
