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
from .backend import get_xp, to_numpy
from .errors import GraphError, UserError
from .gpu.placement import add_loss_watch, configure_device, prepare_for_device
from .graph.solver import solver_states, state_name
from .io.checkpoint import (find_resumable, load_checkpoint, load_params,
                            remove_stale_temp_files, save_checkpoint, save_run_checkpoint)
from .io.checkpoint_check import check_finite, check_for_net, unused_note
from .io.config import data_notes, dump_config
from .io.data import source_info
from .io.metrics import MetricsLog
from .layers.fillers import fill
from .model import (build_test_graph, build_train_graph, check_data_labels, check_fits_memory,
                    init_params, kept_constant, loss_blobs, metric_blobs)
from .parallel.compose import (Layout, Scheme, compose_test, defer_update_applies, layout_of,
                               settings_without_effect)
from .progress import progress
from .runtime.factory import make_dispatcher, on_gpu
from .runtime.memory_plan import batch_blobs, plan_host_memory
from .runtime.stop import StopSignal, print_or_stop
from .runtime.trace import TraceFile
from .runtime.workspace import Workspace
from .train.watch import BestCheckpoints, EarlyStopping


def get_world():
    """The MPI world (rank, size, comm); works without a launcher too."""
    from .comm.world import get_world as _get
    return _get()


def world_gather(world, obj, what="a checkpoint gather"):
    """Gather picklable ``obj`` from every rank to rank 0 (None elsewhere),
    under the stall watchdog."""
    return world.gather_object(obj, 0, what) if world.size > 1 else [obj]


def world_mean(world, values, what="a metric mean"):
    """Mean over ranks of a float or a float array (same order on all ranks,
    under the stall watchdog)."""
    arr = np.atleast_1d(np.asarray(values, dtype=np.float64))
    if world.size > 1:
        arr = world.allreduce(arr, "sum", what) / world.size
    return float(arr[0]) if np.ndim(values) == 0 else arr


class Trainer:
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
        self.config = config
        self.tensorboard = tensorboard  # rank 0 also writes TensorBoard events to OUT/tb
        self.scheme = scheme or Scheme()
        self.out_dir = out_dir
        self.world = world or get_world()
        self.rank, self.size = self.world.rank, self.world.size
        self.seed = int(config.get("seed", 0))
        self.solver = config["solver"]
        self.log = log or print_or_stop  # a closed stdout stops the run like SIGTERM
        par = config.get("parallel", {})
        # collectives outside the graph wait no longer than graph ops do
        self.world.stall_timeout = float(par.get("stall_timeout", 300))
        # replicas x stages (parallel/compose.py): the data is sharded over
        # the replicas (a pipeline is one replica; its stage 0 reads the data)
        self.layout = layout_of(config, self.world)
        self.pipeline = self.layout.staged
        data_rank, data_size = self.layout.replica, self.layout.replicas
        graph, self.grads = build_train_graph(config, data_rank, data_size)
        check_fits_memory(graph)  # a layer too big is named, not a MemoryError
        check_data_labels(graph)
        self.param_summary = param_summary(graph)  # the whole net's, before any split
        self.net_params = [b.name for b in graph.params()]
        self.graph = self.compose(graph)
        # device: -1 leaves the graph on the CPU; N >= 0 places it on a GPU
        # (the node-local rank picks among several) and the stream dispatcher runs it
        self.device = configure_device(config, self.graph)
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
        self.memory_plan = self.scheme.plan_memory(self.graph, config, self.world)
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
        self.cuda_graph = bool(config.get("cuda_graph", True))
        # parallel.defer_update: the last buckets' allreduce and update finish
        # while the next iteration's forward runs (runtime/tail.py; the CPU
        # event dispatcher, synchronous data parallelism)
        self.defer_update = getattr(self.scheme, "defers_update", True) and \
            defer_update_applies(config, self.layout.replicas, self.pipeline)
        # memory_plan: the transient host blobs share one arena, laid out
        # from the static graph (runtime/memory_plan.py); what the host reads
        # between iterations keeps its own memory
        self.plan_memory = bool(config.get("memory_plan", True))
        keep = ([self.watch] if self.watch else []) + batch_blobs(self.graph)
        self.train = make_dispatcher(self.graph, dispatcher, rank=self.rank,
                                     cuda_graph=self.cuda_graph, log=self._say,
                                     defer_tail=self.defer_update,
                                     workspace=self._workspace(self.graph, keep),
                                     profiler=self.profiler,
                                     stall_timeout=float(par.get("stall_timeout", 300)),
                                     seed=self._op_seed())
        self.ws = self.train.workspace
        self._order_adopted = False
        self.data_size = data_size
        self.test_graph = build_test_graph(config, data_rank, data_size)
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
        self.test_graph = compose_test(self.test_graph, config, self.world)
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
        best, early = self.config["checkpoint"].get("best"), self.solver.get("early_stop")
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

    def _trace_epoch(self):
        """Rank 0's clock at start (seconds since the Unix epoch), so every
        rank's trace counts time from the same instant and the ranks' traces
        line up (the stages of a pipeline are seen computing at once)."""
        t = np.array([time.time() if self.rank == 0 else 0.0])
        return float(self.world.allreduce(t, "sum", "the trace clock")[0]) \
            if self.size > 1 else float(t[0])

    def compose(self, graph):
        """This rank's training graph from the single-replica one."""
        return self.scheme.compose(graph, self.grads, self.config, self.world)

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

    # ------------------------------------------------------------- state
    def _init_params(self, init, init_skip=()):
        for p in self.params:
            self.ws.set(p, fill(self.graph.blobs[p], self.seed))
        if init and str(init).endswith(".caffemodel"):
            self._init_from_caffemodel(init, init_skip)
        elif init:
            params = load_params(init)
            wanted = init_params(params, self.params, self.config, init, init_skip)
            check_finite({p: params[p] for p in wanted}, init)
            note = unused_note(params, self.net_params, init)
            if note:
                self._say(note)
            for p in wanted:
                self._load_blob(p, params[p], init, skip_hint=True)
            skipped = f" ({', '.join(init_skip)} kept fresh: --init-skip)" if init_skip else ""
            self._say(f"loaded {len(wanted)} blob{'s' if len(wanted) != 1 else ''} from "
                      f"{init}{skipped}")

    def _init_from_caffemodel(self, path, init_skip=()):
        """Caffe weights by layer name. As with our own files every parameter
        must be found, except those of the --init-skip layers and the
        learnable ones the net keeps at a constant (lr_mult 0 and a constant
        filler: the gamma and beta of a BatchNorm without a Scale, which
        Caffe files do not hold)."""
        from .interop.caffemodel import caffe_params
        skip = set(init_skip)
        shapes = {p: self.graph.blobs[p].shape for p in self.params
                  if p.split("/")[0] not in skip}
        values, report, factors = caffe_params(path, shapes)
        check_finite(values, path)
        if self.rank == 0:
            for line in report:
                self.log(f"{path}: {line}")
        fixed = {p for p in self.params if kept_constant(self.graph.blobs[p])}
        for p in init_params(dict.fromkeys(set(values) | fixed), self.params, self.config, path,
                             init_skip):
            if p in values:
                self._load_blob(p, values[p], path)
        for k in self.train.kernels.values():  # Caffe's running averages go on
            layer = k.op.inputs[3].split("/")[0] if k.op.op_type == "BatchNorm" else None
            if layer in factors and getattr(k, "caffe_average", False):
                k.factor = factors[layer]

    def _load_blob(self, name, value, path, skip_hint=False):
        try:
            self.ws.set(name, value)
        except GraphError as e:  # a file from another net: name the file too
            hint = (f"; to start layer '{name.split('/')[0]}' afresh instead (fine-tuning a "
                    f"changed layer), give --init-skip {name.split('/')[0]}") if skip_hint else ""
            raise UserError(f"{path}: {e}{hint}") from None

    def state_dict(self):
        """Everything beyond params and momenta that a resume needs: each
        stateful kernel's state and each random stream, per rank."""
        local = {}
        for name, k in self.train.kernels.items():
            s = {}
            if k.stateful:
                s["state"] = k.state_dict()
            if k.rng is not None:
                s["rng"] = k.rng.bit_generator.state
            if s:
                local[name] = s
        states = world_gather(self.world, local)
        return {"ranks": {str(r): s for r, s in enumerate(states)},
                "layout": self.layout.as_dict()} if states else None

    def load_state_dict(self, state):
        """Per-rank state of a checkpoint. On the layout it was written on
        (ranks, scheme, replicas x stages, micro-batches) each rank takes its
        own, random streams included: the resume is bit-exact. On another
        layout (a job requeued on other nodes, a hybrid run continued on one
        rank) each kernel takes the state of the first kernel of the same
        name, micro-batch copies ``<op>@mb<k>`` counting as ``<op>``: the
        data position carries over (readers convert it to the new global
        batch), but per-rank random streams cannot: they restart from the seed."""
        ranks = state.get("ranks", {})
        saved = state.get("layout")
        same_world = len(ranks) == self.size and (saved is None or
                                                  self.layout.same_shape(saved))
        if not ranks or (same_world and str(self.rank) not in ranks):
            raise UserError("the checkpoint holds no per-rank state (ranks: "
                            f"{sorted(ranks) or 'none'})")
        if same_world:
            mine = ranks[str(self.rank)]
        else:
            mine = {}
            for r in sorted(ranks, key=int):
                for name, s in ranks[r].items():
                    mine.setdefault(name.split("@mb")[0], s)
            if self.rank == 0:
                was = Layout(**saved).describe() if saved else f"[{len(ranks)} rank(s)]"
                self.log(f"note: resuming a {len(ranks)}-rank checkpoint on {self.size} "
                         f"rank(s), layout {was} -> {self.layout.describe()}: the weights and "
                         "solver state load by name, each stage taking its layers'; the data "
                         "order continues at the same sample count; random streams (dropout) "
                         "restart from the seed, so the run is not bit-identical to an "
                         "uninterrupted one")
        for name, k in self.train.kernels.items():
            s = mine.get(name if same_world else name.split("@mb")[0])
            if s is None:
                continue
            if "state" in s and k.stateful:
                k.load_state_dict(s["state"])
            if same_world and "rng" in s and k.rng is not None:
                k.rng.bit_generator.state = _plain(s["rng"])

    def _resume(self, path):
        if path == "auto":  # latest.h5, else the newest ckpt_<iter>.h5 that loads
            path, ck = find_resumable(self.out_dir, self._say)
            if path is None:
                self._say(f"no checkpoint in {self.out_dir}; starting from scratch")
                return
        else:
            ck = load_checkpoint(path)
        # the whole checkpoint is checked against the net before any of it is loaded
        check_for_net(ck, path, self.net_params, {p: self.ws[p] for p in self.params},
                      {(p, s): self.ws[state_name(p, s)] for p in self.params
                       for s in solver_states(self.solver.get("type"))
                       if state_name(p, s) in self.ws.arrays})
        fresh = set()
        for p in self.params:
            self._load_blob(p, ck.params[p], path)
            for s in solver_states(self.solver.get("type")):
                m = state_name(p, s)
                if m not in self.ws.arrays:
                    continue
                if s in ck.solver.get(p, {}):
                    self._load_blob(m, ck.solver[p][s], path)
                else:
                    fresh.add(s)
        if fresh:
            self._say(f"note: {path} holds no '{', '.join(sorted(fresh))}' solver state for "
                      f"solver type {self.solver.get('type')!r}; that state starts from zero")
        if ck.state:
            self.load_state_dict(ck.state)
        self.start_iter = int(ck.attrs["iteration"])
        self.elapsed0 = float(ck.attrs.get("elapsed", 0.0))
        self.run_id = str(ck.attrs.get("run_id") or "") or self.run_id
        self._last_saved = self.start_iter
        self._say(f"resumed from {path} at iteration {self.start_iter}")
        saved_world = int(ck.attrs.get("world_size", self.size) or self.size)
        if saved_world != self.size and self.config.get("data"):
            b = int(self.config["data"]["train"]["batch_size"])
            self._say(f"note: {path} was written by {saved_world} rank(s), this run has "
                      f"{self.size}: the global batch is now {b * self.data_size} "
                      f"({b} per rank x {self.data_size}); the data order goes on at the same "
                      "sample, but the learning-rate schedule counts iterations, not samples "
                      "(keep the global batch with --set data.train.batch_size=G/N)")

    def agree_to_stop(self, done, diverged):
        """The stop code every rank agrees on after iteration ``done``
        (StopSignal.agree); a parameter-server worker adds its servers."""
        return self.scheme.agree_to_stop(self, done, diverged)

    def _read_losses(self):
        """(sum of the losses since the last reset, first non-finite
        iteration or None) from the device loss watch: one read-back; then
        the first non-finite iteration of any rank (collective, at the same
        iterations on every rank)."""
        total, first = 0.0, 0
        self.train.drain()  # the device work queued so far is done: the blobs hold it
        if self.watch is not None:
            total, first = (float(v) for v in to_numpy(self.ws[self.watch]))
        first = int(first) or None
        if self.size > 1:  # the earliest over the ranks: MAX of the negated iteration
            worst = self.world.allreduce(np.array([-(first or 2 ** 62)], np.int64), "max",
                                         "the first diverged iteration (allreduce)")
            first = None if -int(worst[0]) == 2 ** 62 else -int(worst[0])
        return total, first

    def _reset_loss_window(self):
        if self.watch is not None:
            self.ws[self.watch][0] = 0.0

    def _params_finite(self):
        """Whether every parameter of this rank is finite (no NaN or inf)."""
        self.train.drain()
        return all(bool(get_xp(self.ws[p]).isfinite(self.ws[p]).all()) for p in self.params)

    def save(self, iteration, path=None):
        """The run's checkpoint of ``iteration`` (ckpt_<iter>.h5, latest.h5,
        rotation), or with ``path`` a checkpoint file of its own. Collective."""
        self.train.drain()  # the weights of this iteration, updated
        self.scheme.before_save(self, iteration)
        if path is None:
            self._last_saved = iteration
        state = self.state_dict()
        params = {p: to_numpy(self.ws[p]) for p in self.params}
        states = solver_states(self.solver.get("type"))
        solver = {p: {s: to_numpy(self.ws[state_name(p, s)]) for s in states
                      if state_name(p, s) in self.ws.arrays} for p in self.params}
        solver = {p: s for p, s in solver.items() if s}
        if self.pipeline:  # each stage holds its own layers' parameters
            parts = world_gather(self.world, (params, solver))
            if self.rank == 0:  # replica 0's stages (the replicas hold the same values)
                for r in self.layout.replica_ranks(0):
                    params.update(parts[r][0])
                    solver.update(parts[r][1])
        if self.rank != 0:
            return
        payload = dict(params=params, solver=solver, state=state, world_size=self.size,
                       seed=self.seed, config_text=dump_config(self.config),
                       run_id=self.run_id, elapsed=self.elapsed())
        if path is not None:  # a checkpoint of its own (checkpoint.best): no rotation
            save_checkpoint(path, iteration=iteration, **payload)
            return
        save_run_checkpoint(self.out_dir, iteration, int(self.config["checkpoint"]["keep"]),
                            **payload)
        if getattr(self, "_metrics", None) is not None and self.start_iter:
            self._metrics.commit()  # the resumed run's rows and config replace the old ones
            self._write_config()

    # -------------------------------------------------------------- loops
    def run(self):
        max_iter = int(self.solver["max_iter"])
        display = int(self.solver.get("display") or 0)
        test_interval = int(self.solver.get("test_interval") or 0)
        ck_interval = int(self.config["checkpoint"].get("interval") or 0)
        batch = int(self.config["data"]["train"]["batch_size"]) if self.config.get("data") \
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
        if self.solver.get("test_initialization") and self.start_iter == 0:
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
        extra = n * spec["batch_size"] * self.data_size - n_samples
        if extra > 0 and not getattr(self, "_wrap_noted", False):
            self._wrap_noted = True
            self._say(f"note: the test split has {n_samples} samples, not a multiple of the "
                      f"global test batch ({spec['batch_size']} x {self.data_size}); as in "
                      f"Caffe the last batch wraps around and {extra} samples count twice "
                      "(choose data.test.batch_size to divide the split for exact figures)")
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

    # ------------------------------------------------------------ output
    def _finished(self):
        """Whether the run folder holds the finished run (its latest.h5), as
        rank 0 sees it (it writes the checkpoints), on every rank alike."""
        done = os.path.exists(os.path.join(self.out_dir, "latest.h5"))
        return self.world.allgather_object(done, "the finished-run check")[0] \
            if self.size > 1 else done

    def report_startup(self):
        """The start-up block on rank 0 (runlog.py). Collective over the
        trainer's world: every rank's host and device are gathered."""
        from .runlog import rank_info, startup_lines
        infos = world_gather(self.world, rank_info(self), "the start-up report")
        if self.rank == 0:
            for line in startup_lines(self, dict(enumerate(infos)),
                                      time.perf_counter() - self._t_created):
                self.log(line)

    def _report_first_iteration(self, seconds):
        """One line after this process's first iteration: it is slow, and
        the first display line may be far away."""
        gpu = ", CUDA kernel compilation" if self.device >= 0 else ""
        self._say(f"first iteration done in {seconds:.2f} s (includes one-time start-up: "
                  f"first memory allocations, the first data batch{gpu})")

    def _open_metrics(self):
        """Rank 0: config.yaml, and the metrics log (io/metrics.py) that goes
        on from the checkpoint's rows and time when resuming. A resumed run
        replaces the folder's config.yaml with its first checkpoint (save)."""
        if self.rank != 0:
            return None
        os.makedirs(self.out_dir, exist_ok=True)
        if not self.start_iter:
            self._write_config()
        log = MetricsLog(self.out_dir, self.start_iter, self.elapsed0, self.tensorboard)
        self.elapsed0 = log.elapsed0  # never below a kept row's time
        self._metrics = log  # save() makes a resumed run's rows the file (MetricsLog.commit)
        return log

    def _write_config(self):
        with open(os.path.join(self.out_dir, "config.yaml"), "w") as f:
            f.write(dump_config(self.config))

    def elapsed(self, now=None):
        """Training time in seconds, over this run and those it resumed."""
        if self._t_start is None:
            return self.elapsed0
        return self.elapsed0 + (time.perf_counter() if now is None else now) - self._t_start

    @staticmethod
    def _write(metrics, rec):
        if metrics is not None:
            metrics.write(rec)

    def _say(self, msg):
        if self.rank == 0:
            self.log(msg)

    def write_trace(self):
        if self.profiler is None:
            return None
        return self.profiler.close()

    def close(self):
        self.train.close()
        if self.test is not None:
            self.test.close()


def _plain(obj):
    """Checkpointed RNG states come back with numpy scalars; make them ints."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, np.ndarray) and obj.ndim == 0:
        return obj.item()
    return obj


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
    the same config, and run the scheme the config asks for."""
    from .comm.world import install_abort_handler
    world = get_world()
    install_abort_handler(world)
    world.stall_timeout = float(config.get("parallel", {}).get("stall_timeout", 300))
    world.check_consistent(dump_config(config), "resolved configuration")
    # rank 0's lines, and any rank's errors, go to OUT/train.log too (logfile.py)
    logfile.open_run_log(out_dir, world.rank)
    say = logfile.tee(print_or_stop)
    if world.rank == 0:  # parallel settings that do nothing at this world size
        for note in settings_without_effect(config, world.size) + data_notes(config):
            say(note)
    mode = config.get("parallel", {}).get("mode", "sync")
    if world.size > 1 and mode in ("async", "sync_ps"):
        return run_param_server(config, out_dir, world, resume=resume, init=init,
                                profile=profile, init_skip=init_skip, tensorboard=tensorboard)
    return run_and_report(Trainer(config, out_dir, world, resume=resume, init=init,
                                  profile=profile, dispatcher=dispatcher, init_skip=init_skip,
                                  tensorboard=tensorboard, log=say),
                          world)


def run_param_server(config, out_dir, world, resume=None, init=None, profile=False,
                     dispatcher=None, log=None, init_skip=(), tensorboard=False):
    """``train`` on every rank of a parameter-server run: servers serve
    (parallel.param_server.run_server_rank), workers train a Trainer over the
    workers' World (metrics and checkpoints from rank 0, a worker). Returns
    the exit status."""
    from .parallel.param_server import WorkerScheme, run_server_rank, split_workers
    config, sub = split_workers(config, world)
    if sub is None:
        return run_server_rank(config, out_dir, world, resume=resume, init=init,
                               init_skip=init_skip)
    return run_and_report(Trainer(config, out_dir, world=sub, resume=resume, init=init,
                                  profile=profile, log=log, dispatcher=dispatcher,
                                  init_skip=init_skip, scheme=WorkerScheme(config, world),
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
