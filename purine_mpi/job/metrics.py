"""``metrics.jsonl``: one JSON object per line, written by rank 0.

    {"phase": "train", "iter": 100, "loss": 0.8192, "lr": 0.05,
     "images_per_s": 6074.2, "time": 1.234, "timestamp": 1767225600.123}
    {"phase": "test", "iter": 300, "loss": 0.0601, "accuracy": 0.9806,
     "samples": 360, "time": 3.456, "timestamp": 1767225602.345}

- ``time``: seconds of training (elapsed wall time of the training loop,
  evaluations and checkpoints included, start-up excluded) when the row was
  written. It is stored in each checkpoint (root attribute ``elapsed``) and
  continues after ``--resume``, so it never goes back within a file.
- ``timestamp``: the wall-clock time the row was written, Unix seconds (UTC,
  millisecond resolution) -- what TensorBoard stores as ``wall_time``.
- Figures computed from float32 blobs (loss, lr, accuracy, other metrics) are
  written at float32 precision: the shortest decimal that reads back as the
  same float32 (``lr`` 0.05 is ``0.05``, not ``0.05000000074505806``).
  ``images_per_s`` is rounded to 0.1, ``time`` and ``timestamp`` to 1 ms.
- A non-finite figure (NaN, inf) is written as ``null``: every line is
  strict JSON.

On resume the rows a killed run wrote after its checkpoint are dropped (they
are written again), so each (phase, iter) appears once. The file itself is
replaced only when the resumed run writes its first checkpoint: until then
the resumed run writes to ``metrics.jsonl.resumed.<pid>`` and
``metrics.jsonl`` stays as it was, matching the checkpoints in the folder
(a resumed run that ends before a checkpoint leaves it untouched).
"""
import json
import math
import os
import time

import numpy as np

from ..base.runfiles import disk_error, open_run_file, open_run_fd, write_all, write_text_replacing

FILE = "metrics.jsonl"
# written as they are computed (already rounded), not at float32 precision
_NOT_FLOAT32 = ("time", "timestamp", "images_per_s", "tokens_per_s")


def float32_value(x):
    """``x`` as the shortest decimal that reads back as float32(x), as a
    Python float (so ``json.dumps`` writes that decimal): 0.05 -> 0.05."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def row_text(rec):
    """One strict-JSON line (no newline): floats at float32 precision (except
    ``_NOT_FLOAT32``), non-finite ones as null."""
    out = {}
    for k, v in rec.items():
        if isinstance(v, (float, np.floating)):
            v = float(v)
            if not math.isfinite(v):
                v = None
            elif k not in _NOT_FLOAT32:
                v = float32_value(v)
        elif isinstance(v, np.integer):
            v = int(v)
        out[k] = v
    return json.dumps(out, allow_nan=False)


def write_row(f, rec):
    """Append ``rec`` to the open file ``f`` as one line and flush."""
    f.write(row_text(rec) + "\n")
    f.flush()


def keep_rows_up_to(path, iteration, out=None):
    """Write to ``out`` (default: rewrite ``path``) the rows of ``path`` with
    ``iter <= iteration`` (a line cut short by a kill is dropped). Returns
    the kept rows (dicts).

    ``path`` is never half-written: rewritten through a temporary name
    renamed over it, and only when a line is dropped (before, it was
    truncated and written again in place, where a full disk could leave it
    short of rows). A full disk (or ``ulimit -f``) writing ``out`` is
    ``disk_error``'s one line (exit 2), ``out`` removed; before, it was
    ``rank 0: OSError: [Errno 28] No space left on device`` (exit 1) and an
    empty ``out`` left in the run folder."""
    kept, rows, whole = [], [], ""
    if os.path.exists(path):
        with open(path) as f:
            whole = f.read()
        for line in whole.splitlines(keepends=True):
            try:
                rec = json.loads(line)
                if int(rec["iter"]) <= iteration:
                    kept.append(line if line.endswith("\n") else line + "\n")
                    rows.append(rec)
            except (ValueError, KeyError, TypeError):
                pass  # a line cut short by the kill
    text = "".join(kept)
    if out is None:
        if text != whole:  # never through a link, never half-written (base/runfiles.py)
            write_text_replacing(path, text)
        return rows
    try:
        with open_run_file(out, "w") as f:  # never through a link (base/runfiles.py)
            f.write(text)
    except OSError as exc:
        if os.path.lexists(out):
            os.remove(out)
        raise disk_error(out, exc) or exc
    return rows


def _rows_after(path, iteration):
    """Whether ``path`` holds a whole row with ``iter > iteration``."""
    if not os.path.exists(path):
        return False
    with open(path) as f:
        for line in f:
            try:
                if int(json.loads(line)["iter"]) > iteration:
                    return True
            except (ValueError, KeyError, TypeError):
                pass
    return False


class MetricsLog:
    """Rank 0's metrics output: ``metrics.jsonl`` in ``out_dir`` and, with
    ``tensorboard``, TensorBoard event files in ``out_dir/tb``.

    ``start_iter`` > 0 (a resume) keeps the rows up to it and appends;
    ``elapsed`` is the training time already spent (the checkpoint's), from
    which ``time`` continues -- never below the last kept row's time."""

    def __init__(self, out_dir, start_iter=0, elapsed=0.0, tensorboard=False):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, FILE)
        self.elapsed0 = float(elapsed or 0.0)
        self.pending = None  # the resumed run's file until its first checkpoint
        if start_iter:
            if _rows_after(self.path, start_iter):  # rows beyond the checkpoint: kept for now
                self.pending = f"{self.path}.resumed.{os.getpid()}"
            rows = keep_rows_up_to(self.path, start_iter, self.pending)
            times = [r["time"] for r in rows if isinstance(r.get("time"), (int, float))]
            self.elapsed0 = max([self.elapsed0] + times)
        # never through a link (base/runfiles.py); rows go in one write each (``write``)
        try:
            self.fd = open_run_fd(self.pending or self.path, append=True)
            if not start_iter:
                os.ftruncate(self.fd, 0)
        except OSError as exc:
            raise disk_error(self.pending or self.path, exc) or exc
        self.tb = None
        if tensorboard:
            from .tensorboard import TensorBoardLog
            self.tb = TensorBoardLog(os.path.join(out_dir, "tb"),
                                     purge_step=start_iter + 1 if start_iter else None)

    def write(self, rec):
        """Write one row (``timestamp`` added) to every output."""
        rec = dict(rec, timestamp=round(time.time(), 3))
        # the whole line in one write, or the file cut back: never a row cut short
        write_all(self.fd, (row_text(rec) + "\n").encode("utf-8"), self.pending or self.path)
        if self.tb is not None:
            self.tb.write(json.loads(row_text(rec)))  # the very figures of the JSON row

    def commit(self):
        """The run wrote a checkpoint: its rows become ``metrics.jsonl``."""
        if self.pending is not None:
            os.replace(self.pending, self.path)  # the open file goes on appending
            self.pending = None

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.pending is not None:  # no checkpoint of the resumed run: the old rows stay
            os.remove(self.pending)
            self.pending = None
        if self.tb is not None:
            self.tb.close()
