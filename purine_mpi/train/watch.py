"""Services the loop calls after each test pass: the best-k checkpoints by a
monitored metric (``checkpoint.best``, Lightning's ``ModelCheckpoint``) and
early stopping (``solver.early_stop``, Lightning's ``EarlyStopping``).

Both read the figures of the pass (``loop.state.result``, the mean over the
ranks, the same on every rank), so every rank takes the same decision with
no collective. A non-finite figure never counts as an improvement. They
follow the evaluation (evaluation.py) in the list of services.

What they decided so far (the best passes kept; early stopping's best
figure and patience) is in ``loop.state.watch``, which the checkpoints
carry (checkpoints.py): a resumed run goes on deciding as the uninterrupted
one, unless the metric or its direction changed (then it starts afresh).
The best files are those of the run folder: a resume from another folder's
checkpoint keeps early stopping's state, not its best list.
"""
import math
import os

from .loop import Service


def _better(a, b, mode, delta=0.0):
    """Whether figure ``a`` beats ``b`` by more than ``delta``."""
    if a is None or not math.isfinite(a):
        return False
    if b is None:
        return True
    return a > b + delta if mode == "max" else a < b - delta


def _figure(results, metric, where):
    if metric not in results:
        from ..base.errors import UserError
        raise UserError(f"{where}: metric '{metric}' is not a test figure of this net; it has "
                        f"{', '.join(k for k in results if k != 'samples')}")
    return float(results[metric])


def check_watched_figure(loop, where, metric):
    """Exit 2 at the start of training (a watch's ``on_start``) when the
    metric ``where`` (``solver.early_stop`` or ``checkpoint.best``) watches
    is none of the net's test figures (RankGraphs.test_keys): found only at
    the first test pass, it cost that many iterations. The same on every
    rank (the figures are the whole test graph's)."""
    import difflib
    from ..base.errors import ConfigError
    names = list(dict.fromkeys(loop.graphs.test_keys))
    if metric not in names:
        close = difflib.get_close_matches(metric, names, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        blobs = dict(zip(loop.graphs.test_names, loop.graphs.test_keys))
        if metric in blobs:  # a layer's top: the one accuracy (a loss) has a figure name
            hint = (f" (the test figure of blob '{metric}' is named '{blobs[metric]}', as in "
                    "metrics.jsonl: watch that)")
        has = f"it has {', '.join(names)}" if names else "it has no test pass"
        raise ConfigError(loop.job.path, f"{where}.metric", f"metric '{metric}' is not a "
                          f"test figure of this net{hint}; {has}")


def _restored(loop, key, metric, mode):
    """The state ``key`` of ``loop.state.watch`` a resume gave back, when it
    was decided on the same metric in the same direction; else None."""
    saved = loop.state.watch.get(key)
    if isinstance(saved, dict) and saved.get("metric") == metric and saved.get("mode") == mode:
        return saved
    return None


class BestCheckpoints(Service):
    """``best_<iter>.h5`` for the ``keep`` best test passes by ``metric``
    (every rank calls ``write(path, iteration)``, a collective checkpoint
    that rank 0 writes); the others are deleted as better ones come. The
    newest checkpoints (``ckpt_<iter>.h5``, ``latest.h5``) rotate on their
    own, whatever the best ones are."""

    def __init__(self, spec, out_dir, write, say):
        # spec: job/job.py's BestSpec; direction: max or min (given, else by the metric)
        self.metric, self.mode, self.keep = spec.metric, spec.direction, spec.keep
        self.out_dir, self.write, self.say = out_dir, write, say
        self.kept = []  # [(figure, iteration, path)], best first

    def check_start(self, loop):
        check_watched_figure(loop, "checkpoint.best", self.metric)

    def on_start(self, loop):
        saved = _restored(loop, "best", self.metric, self.mode)
        if saved is not None:  # [figure, iteration, file name in the run folder]
            self.kept = [(float(v), int(it), os.path.join(self.out_dir, name))
                         for v, it, name in saved["kept"]][:self.keep]
            gone = [os.path.basename(path) for _, _, path in self.kept if not os.path.exists(path)]
            if gone:  # the list decides as the uninterrupted run; the files are what they are
                self.say(f"note: the best list of the checkpoint resumed from names "
                         f"{', '.join(gone)}, not in {self.out_dir} (deleted after that "
                         f"checkpoint, as a better pass came); the list keeps their figures, so "
                         f"fewer than "
                         f"{self.keep} best files may be on disk until better passes replace them")

    def on_test(self, loop, done):
        if loop.state.result:
            self.after_test(done, loop.state.result, loop.state.watch)
        loop.state.watch["best"] = self.state()

    def state(self):
        """What a checkpoint keeps of the best list (file names: the run folder's)."""
        return {"metric": self.metric, "mode": self.mode,
                "kept": [[v, it, os.path.basename(path)] for v, it, path in self.kept]}

    def after_test(self, iteration, results, watch=None):
        value = _figure(results, self.metric, "checkpoint.best.metric")
        if not math.isfinite(value):
            return
        worst = self.kept[-1][0] if len(self.kept) >= self.keep else None
        if worst is not None and not _better(value, worst, self.mode):
            return
        path = os.path.join(self.out_dir, f"best_{int(iteration)}.h5")
        self.kept.append((value, iteration, path))
        self.kept.sort(key=lambda t: (-t[0] if self.mode == "max" else t[0], t[1]))
        dropped, self.kept = self.kept[self.keep:], self.kept[:self.keep]
        if watch is not None:  # the file holds the list with itself in it
            watch["best"] = self.state()
        self.write(path, iteration)
        for _, _, old in dropped:
            try:
                os.remove(old)
            except OSError:
                pass
        best = self.kept[0]
        self.say(f"best {self.metric} {best[0]:.4f} at iteration {best[1]} "
                 f"({os.path.basename(best[2])}; keeping the {self.keep} best)")


class EarlyStopping(Service):
    """Stop when ``metric`` has not improved by more than ``min_delta`` over
    ``patience`` test passes in a row (``loop.state.early_stopped``: the loop
    writes a checkpoint and returns this pass's figures)."""

    def __init__(self, spec, say):
        # spec: job/job.py's EarlyStopSpec; direction: max or min (given, else by the metric)
        self.metric, self.mode = spec.metric, spec.direction
        self.patience, self.min_delta = spec.patience, float(spec.min_delta)
        self.say = say
        self.best, self.best_iter, self.waited = None, None, 0

    def check_start(self, loop):
        check_watched_figure(loop, "solver.early_stop", self.metric)

    def on_start(self, loop):
        saved = _restored(loop, "early_stop", self.metric, self.mode)
        if saved is not None:
            self.best, self.best_iter, self.waited = saved["best"], saved["best_iter"], \
                int(saved["waited"])

    def on_test(self, loop, done):
        if loop.state.result and self.after_test(done, loop.state.result):
            loop.state.early_stopped = done
        loop.state.watch["early_stop"] = self.state()

    def state(self):
        """What a checkpoint keeps: the best figure, its iteration, the passes waited."""
        return {"metric": self.metric, "mode": self.mode, "best": self.best,
                "best_iter": self.best_iter, "waited": self.waited}

    def after_test(self, iteration, results):
        """True when the run should stop here."""
        value = _figure(results, self.metric, "solver.early_stop.metric")
        if _better(value, self.best, self.mode, self.min_delta if self.best is not None else 0):
            self.best, self.best_iter, self.waited = value, iteration, 0
            return False
        self.waited += 1
        if self.waited < self.patience:
            return False
        best = (f"best {self.best:.4f} at iteration {self.best_iter}" if self.best is not None
                else "no pass gave a finite figure")
        self.say(f"early stop at iteration {iteration}: {self.metric} has not improved by more "
                 f"than {self.min_delta:g} in {self.patience} test pass(es) ({best})")
        return True
