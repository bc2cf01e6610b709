"""The test pass (a loop service): the mean loss and metrics over the test
split, sharded over the ranks, its metrics row and log line; at the test
interval, once at the end, and before training with
``solver.test_initialization`` (Caffe's). ``loop.result`` holds its
figures for the services after it (watch.py) and the run's result.

May import: the data layer (io/data.py) and the foundation.
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
        spec = loop.config["data"]["test"]
        n_samples, _ = source_info({k: v for k, v in spec.items() if k != "batch_size"})
        per_batch = spec["batch_size"] * loop.data_size
        n = test_iter or loop.solver.get("test_iter") or max(1, math.ceil(n_samples / per_batch))
        extra = n * per_batch - n_samples
        if extra > 0 and not self._wrap_noted:
            self._wrap_noted = True
            loop.say(f"note: the test split has {n_samples} samples, not a multiple of the "
                     f"global test batch ({spec['batch_size']} x {loop.data_size}); as in "
                     f"Caffe the last batch wraps around and {extra} samples count twice "
                     "(choose data.test.batch_size to divide the split for exact figures)")
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
