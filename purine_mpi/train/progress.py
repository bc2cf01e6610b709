"""The metrics log, TensorBoard and the progress lines (a loop service):
rank 0 writes config.yaml and metrics.jsonl (job/metrics.py; on a resume it
goes on from the checkpoint's rows and time), one ``train`` row and one
progress line per display interval (loss averaged over the window and the
ranks, learning rate, images/s, elapsed time and ETA), and closes the log
at the end. Between two display lines, rank 0 alone prints a line (no
collective: iteration, the newest loss it knows, images/s, elapsed, ETA)
whenever ``solver.display_seconds`` have passed since the last line, so a
slow net's batch log never goes silent; it writes no metrics row. Its loss
is rank 0's loss of that iteration on the CPU (nanoGPT's per-iteration
line); where the loss is read back only at the display lines (a GPU), or
rank 0 is a pipeline's first stage (it holds no loss, or a part), the
last display line's, with its iteration, and none before the first
display line. The elapsed time goes on across resumes (the checkpoint's
``elapsed``).
"""
import os
import time

import numpy as np

from ..base.progress_bar import hms
from ..job.config import dump_config
from ..job.metrics import MetricsLog
from ..graph.solver_graph import lr_attrs
from ..ops.lr_policy import learning_rate
from ..base.runfiles import disk_error, open_run_fd, write_all
from .loop import Service
from .loss_scale import scale_values


def write_config(loop):
    """The run folder's config.yaml (rank 0), never through a link."""
    path = os.path.join(loop.out_dir, "config.yaml")
    try:
        fd = open_run_fd(path)
    except OSError as exc:
        raise disk_error(path, exc) or exc
    try:
        write_all(fd, dump_config(loop.job).encode("utf-8"), path)
    except BaseException:
        # a full disk: the empty file this made goes, so the refused run leaves
        # its folder as any start-up refusal does (removed where it made it;
        # before, an empty config.yaml stayed and a retry there was refused as
        # "holds another run's files")
        os.close(fd)
        fd = None
        os.remove(path)
        raise
    finally:
        if fd is not None:
            os.close(fd)


def throughput_unit(loop):
    """(unit, tokens per sample) of the progress lines: a text source's
    samples are sequences of ``sequence_length`` tokens, counted as tokens
    (``tok/s``); images otherwise (``img/s``)."""
    spec = loop.job.data.train
    if spec is not None and spec.source == "text":
        return "tok/s", int(spec.sequence_length)
    return "img/s", 1


def global_batch(loop):
    """Images per iteration over all the replicas."""
    if loop.job.data.train is not None:
        return loop.job.global_batch(loop.graphs.data_size)
    # a graph: job: its readers say
    g = loop.graphs
    return g.data_size * sum(int(op.attrs.get("batch_size", 0))
                             for op in g.graph.ops.values() if op.op_type == "DataReader")


class Progress(Service):
    def __init__(self, tensorboard=False):
        self.tensorboard = tensorboard  # rank 0 also writes TensorBoard events to OUT/tb
        self.tick = None  # (iteration, perf_counter) of rank 0's last progress line

    def on_start(self, loop):
        """Rank 0: config.yaml, and the metrics log. A resumed run replaces
        the folder's config.yaml with its first checkpoint (checkpoints.py)."""
        self.batch = global_batch(loop)
        self.unit, self.per_sample = throughput_unit(loop)
        if loop.world.rank != 0:
            return
        os.makedirs(loop.out_dir, exist_ok=True)
        if not loop.state.start_iter:
            write_config(loop)
        st = loop.state
        log = MetricsLog(loop.out_dir, st.start_iter, st.elapsed0, self.tensorboard)
        st.elapsed0 = log.elapsed0  # never below a kept row's time
        st.metrics = log

    def after_step(self, loop, done):
        """Rank 0: the time-based line, when display_seconds passed since the last."""
        every = loop.job.solver.display_seconds
        if loop.world.rank != 0 or not every or loop.display_due(done):
            return
        now = time.perf_counter()
        start, t = self.tick or (loop.state.start_iter, loop.state.t_start)
        if now - t >= every:
            loop.say(alive_line(loop, done, self.per_sample * self.batch * (done - start)
                                / max(now - t, 1e-9), now, self.unit))
            self.tick = (done, now)

    def on_display(self, loop, done):
        now, w = time.perf_counter(), loop.state.window
        self.tick = (done, now)
        loss = loop.reduce(w.total() / w.n if w.n else 0.0)
        loop.state.last_loss = (done, loss)
        ips = (done - w.start) * self.batch / max(now - w.t, 1e-9)
        lr = shown_lr(loop, done)
        row = {"phase": "train", "iter": done, "loss": loss, "lr": lr,
               "images_per_s": round(ips, 1), "time": round(loop.elapsed(now), 3)}
        if self.per_sample > 1:  # a text source: its samples are sequences of tokens
            row["tokens_per_s"] = round(ips * self.per_sample, 1)
        scale = scale_values(loop)  # fp16's loss scaling (train/loss_scale.py)
        if scale is not None:
            row["loss_scale"], row["skipped_steps"] = scale[0], scale[2]
        loop.record(row)
        max_iter = loop.job.solver.max_iter
        loop.say(f"iter {done:>{len(str(max_iter))}}/{max_iter}  loss {loss:.4f}  "
                 f"lr {lr:.3g}  {ips * self.per_sample:,.0f} {self.unit}  "
                 f"{_times(loop, done, now)}")
        w.reset(done, now)

    def on_close(self, loop):
        if loop.state.metrics is not None:
            loop.state.metrics.close()
            loop.state.metrics = None


def _times(loop, done, now):
    """``elapsed H:MM:SS  eta M:SS``: the training time over this run and
    those it resumed; the ETA from this process's pace."""
    st = loop.state
    eta = (loop.job.solver.max_iter - done) * (now - st.t_start) / max(done - st.start_iter, 1)
    return f"elapsed {hms(loop.elapsed(now))}  eta {hms(eta)}"


def shown_lr(loop, done):
    """The rate iteration ``done`` (1-based) trained at: the solver's
    ``lr`` blob, or on a rank that holds no update (a pipeline stage
    without parameters: the loss alone) the same policy at its iteration,
    in the blob's float32."""
    if "lr" in loop.ws.arrays:
        return float(loop.ws["lr"])
    return float(np.float32(learning_rate(lr_attrs(loop.job.solver), done - 1)))


def alive_line(loop, done, ips, now, unit="img/s"):
    """The time-based line: ``iter  37/900  loss 2.3026  212 img/s  elapsed
    0:31  eta 6:40``; the loss of an earlier iteration says which (``loss
    2.3026 (iter 30)``), and none is said before one is known."""
    max_iter = loop.job.solver.max_iter
    loss = ""
    if loop.state.last_loss is not None:
        it, value = loop.state.last_loss
        loss = f"loss {value:.4f}  " if it == done else f"loss {value:.4f} (iter {it})  "
    return (f"iter {done:>{len(str(max_iter))}}/{max_iter}  {loss}{ips:,.0f} {unit}  "
            f"{_times(loop, done, now)}")
