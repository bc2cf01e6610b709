"""Training and evaluation loops around the dispatcher.

Every rank runs the same loop over its own slice of the composed graph. The
only collectives outside the graph are the scalar reductions for logging and
evaluation, the stop agreement after each iteration and the checkpoint
gathers, made by every rank at the same iterations, so their order is the
same everywhere; each is a non-blocking request polled under the stall
timeout (``World.wait``). Only rank 0 writes files.
"""
import json
import math
import os
import sys
import time
import uuid

import numpy as np

from . import logfile
from .gpu.placement import add_loss_watch, configure_device, prepare_for_device
from .io.checkpoint import remove_stale_temp_files
from .io.config import data_notes, dump_config
from .io.job import job_of
from .model import (build_test_graph, build_train_graph, check_data_labels, check_fits_memory,
                    loss_blobs, metric_blobs)
from .parallel.compose import (Scheme, compose_test, defer_update_applies, layout_of,
                               settings_without_effect)
from .runtime.factory import make_dispatcher, on_gpu
from .runtime.memory_plan import batch_blobs, plan_host_memory
from .runtime.stop import StopSignal, print_or_stop
from .runtime.trace import TraceFile
from .runtime.workspace import Workspace
from .train.checkpoints import CheckpointsMixin
from .train.collectives import _plain, get_world, world_gather, world_mean  # noqa: F401
from .train.divergence import DivergenceMixin
from .train.evaluation import EvaluationMixin
from .train.reporting import ReportingMixin
from .train.watch import BestCheckpoints, EarlyStopping


class Trainer(CheckpointsMixin, EvaluationMixin, DivergenceMixin, ReportingMixin):
    """Builds this rank's graphs, initialises or restores state, runs."""

    def __init__(self, *args, **kw):
        try:
            self._build(*args, **kw)
        except BaseException:  # a refused checkpoint, bad test data, ...
            self._settle_readers()
            raise

    def _settle_readers(self, timeout=30.0):
        """Wait for the data readers' in-flight prefetch: their daemon threads
        read HDF5 files, and one left mid-read (holding h5py's lock) when an
        error ends the process would hang the interpreter's exit."""
        for d in (getattr(self, "train", None), getattr(self, "test", None)):
            for k in getattr(d, "kernels", {}).values():
                pending = getattr(k, "_pending", None)
                if pending is not None:
                    pending[1]["done"].wait(timeout)

    def _build(self, config, out_dir, world=None, resume=None, init=None, profile=False,
               log=None, dispatcher=None, init_skip=(), scheme=None, tensorboard=False):
        self._t_created = time.perf_counter()  # the start-up block reports the set-up time
        # the job (io/job.py); ``config`` is the same object, for older readers
        self.job = self.config = job = job_of(config)
        self.tensorboard = tensorboard  # rank 0 also writes TensorBoard events to OUT/tb
        self.scheme = scheme or Scheme()
        self.out_dir = out_dir
        self.world = world or get_world()
        self.rank, self.size = self.world.rank, self.world.size
        self.seed = job.seed
        self.solver = job.solver
        self.log = log or print_or_stop  # a closed stdout stops the run like SIGTERM
        par = job.parallel
        # collectives outside the graph wait no longer than graph ops do
        self.world.stall_timeout = float(par.stall_timeout)
        # replicas x stages (parallel/compose.py): the data is sharded over
        # the replicas (a pipeline is one replica; its stage 0 reads the data)
        self.layout = layout_of(job, self.world)
        self.pipeline = self.layout.staged
        data_rank, data_size = self.layout.replica, self.layout.replicas
        graph, self.grads = build_train_graph(job, data_rank, data_size)
        check_fits_memory(graph)  # a layer too big is named, not a MemoryError
        check_data_labels(graph)
        self.param_summary = param_summary(graph)  # the whole net's, before any split
        self.net_params = [b.name for b in graph.params()]
        self.graph = self.compose(graph)
        # device: -1 leaves the graph on the CPU; N >= 0 places it on a GPU
        # (the node-local rank picks among several) and the stream dispatcher runs it
        self.device = configure_device(job, self.graph)
        # micro-batch copies never live at once share their activation
        # buffers (after the device's fusions, which the plan must not block)
        self.losses = list(loss_blobs(self.graph))
        # with micro-batches each copy's loss is its micro-batch's mean
        self.loss_shares = [self.graph.blobs[b].attrs.get("micro_batch_share", 1.0)
                            for b in self.losses]
        # on a GPU the loss stays on the device between the display, test and
        # checkpoint intervals (ops/watch.py): the host reads it back only there
        self.deferred = self.device >= 0 and getattr(self.scheme, "defer_loss_readback", True)
        self.watch = add_loss_watch(self.graph, self.losses, self.loss_shares, self.device) \
            if self.deferred and self.losses else None
        self.memory_plan = self.scheme.plan_memory(self.graph, job, self.world)
        self.params = [b.name for b in self.graph.params()]
        # --profile: a Chrome trace streamed to OUT/trace.rank<R>.json; a
        # (start, stop) window (--profile-iters A:B) keeps those iterations
        self.profiler = None
        if profile:
            self.profiler = TraceFile(os.path.join(out_dir, f"trace.rank{self.rank}.json"),
                                      self.rank, profile if isinstance(profile, tuple) else None,
                                      epoch=self._trace_epoch())
        # on a GPU, each iteration is replayed as captured CUDA graphs unless
        # cuda_graph: false (eager stream dispatch); the notes go to rank 0's log
        self.cuda_graph = job.cuda_graph
        # parallel.defer_update: the last buckets' allreduce and update finish
        # while the next iteration's forward runs (runtime/tail.py; the CPU
        # event dispatcher, synchronous data parallelism)
        self.defer_update = getattr(self.scheme, "defers_update", True) and \
            defer_update_applies(job, self.layout.replicas, self.pipeline)
        # memory_plan: the transient host blobs share one arena, laid out
        # from the static graph (runtime/memory_plan.py); what the host reads
        # between iterations keeps its own memory
        self.plan_memory = job.memory_plan
        keep = ([self.watch] if self.watch else []) + batch_blobs(self.graph)
        self.train = make_dispatcher(self.graph, dispatcher, rank=self.rank,
                                     cuda_graph=self.cuda_graph, log=self._say,
                                     defer_tail=self.defer_update,
                                     workspace=self._workspace(self.graph, keep),
                                     profiler=self.profiler,
                                     stall_timeout=float(par.stall_timeout),
                                     seed=self._op_seed())
        self.ws = self.train.workspace
        self._order_adopted = False
        self.data_size = data_size
        self.test_graph = build_test_graph(job, data_rank, data_size)
        if self.test_graph is not None:
            check_data_labels(self.test_graph)
        if self.test_graph is not None:
            # names from the whole test graph: in a pipeline one rank holds
            # them, yet every rank reduces the same vector
            g = self.test_graph
            self.test_losses = list(loss_blobs(g))
            accuracy = [op.outputs[0] for op in g.ops.values() if op.op_type == "Accuracy"]
            # metrics.jsonl (docs/formats.md) names the accuracy "accuracy", whatever the
            # layer's top is called; further metrics keep their blob names
            self.test_keys = ["loss"] * len(self.test_losses) + [
                "accuracy" if accuracy == [b] else b for b in metric_blobs(g)]
            self.test_names = self.test_losses + metric_blobs(g)
        self.test_graph = compose_test(self.test_graph, self.job, self.world)
        self.test = None
        if self.test_graph is not None:
            prepare_for_device(self.test_graph, self.device, train=False)
            shared = {p: self.ws[p] for p in self.test_graph.blobs if p in self.ws.arrays
                      and self.graph.blobs[p].kind == "param"}
            self.test = make_dispatcher(self.test_graph, dispatcher, rank=self.rank,
                                        cuda_graph=self.cuda_graph, log=self._say,
                                        workspace=self._workspace(
                                            self.test_graph,
                                            self.test_names + batch_blobs(self.test_graph),
                                            shared,
                                            arena=self.ws),
                                        seed=self._op_seed())
        self.start_iter = 0
        # training time (s) spent before this process: metrics' "time" goes on from it
        self.elapsed0 = 0.0
        self._t_start = None
        # checkpoints carry it; rotation deletes only this run's (and its resumes')
        self.run_id = uuid.uuid4().hex
        self._last_saved = None  # iteration of the newest checkpoint this run wrote
        self.stop = StopSignal()
        # the loop's services after each test pass (train/watch.py)
        best, early = self.job.checkpoint.best, self.solver.early_stop
        self.best = BestCheckpoints(best, out_dir, lambda path, it: self.save(it, path),
                                    self._say) if best else None
        self.early_stop = EarlyStopping(early, self._say) if early else None
        if self.rank == 0:
            for path in remove_stale_temp_files(out_dir):
                self.log(f"removed {path}, left by a writer that was killed mid-write")
        self._init_params(init, init_skip)
        if resume:
            self._resume(resume)

    def _workspace(self, graph, keep=(), shared=None, arena=None):
        """The workspace of ``graph``: with ``memory_plan`` (the default) its
        transient host blobs planned into one arena, ``keep`` (blobs the
        host reads) and the ``shared`` arrays left out of it; the test graph
        reuses the train graph's arena (``arena``) when it fits, since the
        two never run at once."""
        plan = None
        if self.plan_memory:
            # control edges only where the CPU dispatchers run the graph (a
            # GPU graph's host blobs are few; its schedule stays as it is)
            plan = plan_host_memory(graph, keep=keep, skip=shared or (),
                                    order_ops=not on_gpu(graph))
        return Workspace(graph, shared=shared, plan=plan, arena=arena)

    def compose(self, graph):
        """This rank's training graph from the single-replica one."""
        return self.scheme.compose(graph, self.grads, self.job, self.world)

    def step(self, it):
        """One training iteration. After this process's first one, the
        buckets are posted in the observed gradient-ready order
        (``adopt_ready_order``: decided on rank 0, the same on every rank)."""
        self.ws["iter"][...] = it
        if self.deferred and hasattr(self.train, "synchronize"):
            # on a GPU the iteration returns once its device work is queued
            # (one graph launch when captured); the host synchronises only
            # where it reads back (_read_losses, drain: display, test,
            # checkpoint, a stop signal)
            self.train.run(it, sync=False)
        else:
            self.train.run(it)
        if not self._order_adopted and not self.pipeline:
            self._order_adopted = True
            from .parallel.data_parallel import adopt_ready_order
            self.train.drain()
            adopt_ready_order(self.train, self.world)

    def _reduce(self, values):
        """Across ranks: the sum over a replica's stages (the last stage
        holds the loss), the mean over the replicas (each its own shard)."""
        return world_mean(self.world, values) * self.layout.stages

    def _op_seed(self):
        return self.seed * 1000003 + self.rank

    def agree_to_stop(self, done, diverged):
        """The stop code every rank agrees on after iteration ``done``
        (StopSignal.agree); a parameter-server worker adds its servers."""
        return self.scheme.agree_to_stop(self, done, diverged)

    # -------------------------------------------------------------- loops
    def run(self):
        max_iter = self.solver.max_iter
        display = self.solver.display
        test_interval = self.solver.test_interval
        ck_interval = self.job.checkpoint.interval
        batch = self.job.train_batch if self.job.data.train is not None \
            else sum(int(op.attrs.get("batch_size", 0)) for op in self.graph.ops.values()
                     if op.op_type == "DataReader")  # a graph: config: its readers say
        if self.start_iter >= max_iter and self._finished():
            self._say(f"already finished at iteration {self.start_iter}: nothing to do"
                      + (f" (solver.max_iter is {max_iter}; raise it, or give --iters, to "
                         "train on)" if self.start_iter == max_iter else
                         f" (past solver.max_iter {max_iter})"))
            self.write_trace()
            return {}
        self.report_startup()
        metrics = self._open_metrics()
        self._early_stopped = None
        if self.solver.test_initialization and self.start_iter == 0:
            self._evaluate(0, metrics)  # a test pass before training (Caffe's test_initialization)
        window_loss, window_n = 0.0, 0  # running sum: nothing grows per iteration
        t_start = t_window = self._t_start = time.perf_counter()
        it0 = self.start_iter
        window_start = it0
        result = {}
        try:
            for it in range(self.start_iter, max_iter):
                self.step(it)
                if it == it0:
                    self._report_first_iteration(time.perf_counter() - t_start)
                done = it + 1
                window_n += 1
                display_due = bool(display) and (done % display == 0 or done == max_iter)
                # on a GPU the loss is read back only where it is shown or a
                # checkpoint may follow (the same iterations on every rank)
                checked = not self.deferred or display_due or done == max_iter or bool(
                    ck_interval and done % ck_interval == 0) or bool(
                    test_interval and done % test_interval == 0)
                first_bad = None  # the first iteration with a non-finite loss
                if not self.deferred:
                    loss_now = sum(float(self.ws[b]) * share
                                   for b, share in zip(self.losses, self.loss_shares))
                    window_loss += loss_now
                    first_bad = None if math.isfinite(loss_now) else done
                elif checked:
                    window_loss, first_bad = self._read_losses()
                # a window that diverged before this iteration is not shown:
                # the run ended there (as it does when the loss is read every iteration)
                if display_due and (first_bad is None or first_bad == done):
                    now = time.perf_counter()
                    loss = self._reduce(window_loss / window_n if window_n else 0.0)
                    ips = (done - window_start) * batch * self.data_size / max(
                        now - t_window, 1e-9)
                    lr = float(self.ws["lr"])
                    rec = {"phase": "train", "iter": done, "loss": loss, "lr": lr,
                           "images_per_s": round(ips, 1), "time": round(self.elapsed(now), 3)}
                    self._write(metrics, rec)
                    eta = (max_iter - done) * (now - t_start) / max(done - it0, 1)
                    self._say(f"iter {done:>{len(str(max_iter))}}/{max_iter}  loss {loss:.4f}  "
                              f"lr {lr:.3g}  {ips:,.0f} img/s  elapsed {_hms(now - t_start)}  "
                              f"eta {_hms(eta)}")
                    window_loss, window_n, t_window, window_start = 0.0, 0, now, done
                    self._reset_loss_window()
                # a checkpoint is never written with non-finite weights: where
                # one may follow, the parameters are checked too
                save_due = done == max_iter or self.stop.name is not None or (
                    ck_interval and done % ck_interval == 0)
                diverged = first_bad is not None or (save_due and not self._params_finite())
                code = self.agree_to_stop(done, diverged)
                if self.deferred and not checked and code and code != StopSignal.DIVERGED:
                    # a signal asks for a checkpoint between the intervals: the
                    # loss and the weights are checked first, on every rank
                    _, first_bad = self._read_losses()
                    diverged = first_bad is not None or not self._params_finite()
                    if self.size > 1:
                        diverged = bool(self.world.allreduce(
                            np.array([int(diverged)], np.int64), "max",
                            "the divergence check before a checkpoint (allreduce)")[0])
                    code = StopSignal.DIVERGED if diverged else code
                if code == StopSignal.DIVERGED:
                    self.train.drain()
                    return {"diverged_at": first_bad or done,
                            "last_checkpoint": self._last_saved}
                result = {}
                if test_interval and done % test_interval == 0 and done != max_iter:
                    result = self._evaluate(done, metrics)
                early = done != max_iter and self._early_stopped is not None
                if done != max_iter and (code or early or ck_interval and
                                         done % ck_interval == 0):
                    self.save(done)  # one checkpoint, also when a stop meets the interval
                if early:  # solver.early_stop: the figures of this test pass are the result
                    return dict(result, early_stop=done)
                if done != max_iter and code:
                    self._say(f"stopping at iter {done} on {self.stop.name}: checkpoint "
                              f"written; continue with --resume auto")
                    return {"stopped_by": self.stop.name, "iter": done}
            # the last evaluation and checkpoint (also after a resume past max_iter
            # into a folder without that run's latest.h5)
            result = self._evaluate(max_iter, metrics) or {}
            self.save(max_iter)
        finally:
            if metrics:
                metrics.close()
            self.write_trace()
        return result

    def close(self):
        self.train.close()
        if self.test is not None:
            self.test.close()


def param_summary(graph):
    """(parameter count, bytes, parameter blobs, dtypes) of a graph."""
    params = graph.params()
    return (sum(int(np.prod(b.shape)) for b in params), sum(int(b.nbytes) for b in params),
            len(params), sorted({str(np.dtype(b.dtype)) for b in params}))


def _hms(seconds):
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def run_training(config, out_dir, resume=None, init=None, profile=False, dispatcher=None,
                 init_skip=(), tensorboard=False):
    """Entry point of ``train``: set up the world, check that every rank has
    the same config, and run the scheme the config asks for. ``config``: a
    job (io/job.py) or a validated config dict."""
    from .comm.world import install_abort_handler
    job = job_of(config)  # once: everything below reads the job
    world = get_world()
    install_abort_handler(world)
    world.stall_timeout = float(job.parallel.stall_timeout)
    world.check_consistent(dump_config(job), "resolved configuration")
    # rank 0's lines, and any rank's errors, go to OUT/train.log too (logfile.py)
    logfile.open_run_log(out_dir, world.rank)
    say = logfile.tee(print_or_stop)
    if world.rank == 0:  # parallel settings that do nothing at this world size
        for note in settings_without_effect(job, world.size) + data_notes(job):
            say(note)
    if world.size > 1 and job.parallel.servers:
        return run_param_server(job, out_dir, world, resume=resume, init=init,
                                profile=profile, init_skip=init_skip, tensorboard=tensorboard)
    return run_and_report(Trainer(job, out_dir, world, resume=resume, init=init,
                                  profile=profile, dispatcher=dispatcher, init_skip=init_skip,
                                  tensorboard=tensorboard, log=say),
                          world)


def run_param_server(job, out_dir, world, resume=None, init=None, profile=False,
                     dispatcher=None, log=None, init_skip=(), tensorboard=False):
    """``train`` on every rank of a parameter-server run: servers serve
    (parallel.param_server.run_server_rank), workers train a Trainer over the
    workers' World (metrics and checkpoints from rank 0, a worker). Returns
    the exit status."""
    from .parallel.param_server import WorkerScheme, run_server_rank, split_workers
    job, sub = split_workers(job, world)
    if sub is None:
        return run_server_rank(job, out_dir, world, resume=resume, init=init,
                               init_skip=init_skip)
    return run_and_report(Trainer(job, out_dir, world=sub, resume=resume, init=init,
                                  profile=profile, log=log, dispatcher=dispatcher,
                                  init_skip=init_skip, scheme=WorkerScheme(job, world),
                                  tensorboard=tensorboard),
                          world)


def run_and_report(trainer, world):
    """Run ``trainer`` to the end, print the final figures on global rank 0,
    and return the exit status."""
    try:
        result = trainer.run()
    finally:
        trainer.close()
    if "diverged_at" in result:
        if world.rank == 0:
            last = result.get("last_checkpoint")
            kept = (f"latest.h5 stays the last finite checkpoint (iteration {last})"
                    if last is not None else "no checkpoint was written")
            print(f"error: the training diverged: a non-finite loss or weight (NaN or inf) at "
                  f"iteration {result['diverged_at']}; {kept}. Lower solver.base_lr or check "
                  "the data.", file=sys.stderr, flush=True)
        return 3
    if world.rank == 0 and result:
        logfile.tee(print_or_stop)("final " + json.dumps({k: (round(v, 6) if math.isfinite(v) else None)
                                             if isinstance(v, float) else v
                                             for k, v in result.items()}))
    # a stop on SIGTERM, Ctrl-C or a closed stdout still ends non-zero (143,
    # 130, 141); SIGUSR1 is a request to checkpoint and finish: 0
    stopped = result.get("stopped_by")
    if stopped in ("SIGPIPE", "SIGINT") and world.rank == 0:
        why = "error: stdout was closed (broken pipe)" if stopped == "SIGPIPE" else \
            "interrupted (Ctrl-C)"
        print(f"{why}: stopped at iteration {result.get('iter')} with a checkpoint; continue "
              "with --resume auto", file=sys.stderr, flush=True)
    return StopSignal.exit_status(stopped)
