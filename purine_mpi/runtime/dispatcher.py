"""Dispatchers: run one iteration of a graph from its sources to its sinks.

``Dispatcher`` is the scheduling core every dispatcher is: Purine's
event-driven engine. A unit (an op, or a captured segment of ops) fires as
soon as every unit it depends on has finished (``runtime/scheduler.Schedule``:
the ready counts, one ready queue per worker lane, the deferred tail); what
runs it is the dispatcher's *executor* (``runtime/executors.py``: the CPU
thread pool, the serial twin; ``streams_dispatcher.py``: CUDA streams;
``cuda_graph.py``: captured CUDA-graph segments). Compute units run on
worker threads, one per lane (NumPy and BLAS release the GIL, so
independent branches really run at once), or, for the serial twin, on the
thread that calls ``run``. Communication ops (kernel category ``comm``) are
posted the moment their inputs exist, by the thread that wrote the last of
them -- collectives strictly in their ``seq`` order (assigned at graph
build time, the same on every rank), point-to-point ops at once; workers
test the requests in flight between ops, and the calling thread -- the
*progress thread* -- while every worker is idle, or when a long op has kept
every worker from testing for ``busy_poll`` seconds
(``runtime/comm_progress.py``, the one place that calls MPI), so a bucket's
transfer starts, and keeps moving, while the layers below still
back-propagate. The progress thread raises the first op error, and a
``StallError`` when nothing moved for ``stall_timeout`` seconds.

With ``defer_tail`` (``parallel.defer_update``) an iteration's ``run``
returns once its ops are done but for its *tail* -- the last allreduces and
the updates behind them (``runtime/tail.py``) -- and its collectives are all
posted; the tail finishes during the next ``run``, whose ops wait only for
the tail ops that touch their memory; ``drain()`` waits for it.

``EventDispatcher`` (the CPU thread pool) and ``SerialDispatcher`` (the
serial twin, ``PURINE_DISPATCHER=serial``: the debugging reference) are the
core with their executor. Both give bit-identical results, since every
blob has one writer. Which dispatcher runs a graph is decided in
``runtime/factory.py`` (``make_dispatcher``).
"""
import threading
import time
import zlib

import numpy as np

from ..comm.world import WAIT_HOOKS, announce_waiting
from ..base.cancel import Cancel, stopped_while_stalled
from ..base.errors import StallError
from ..ops.catalog import make_kernel
from .comm_progress import CommPoster
from .executors import INLINE_LANE, Executor, Inline
from .scheduler import Schedule, feeds_comm
from .tail import deferred_tail
from .workspace import Workspace


class Dispatcher:
    """The scheduling core with an ``executor`` (default: the CPU thread
    pool). Every dispatcher has this interface: ``run(iteration, sync)``,
    ``drain()``, ``synchronize()``, ``close()``, the comm posting order
    (``comm_order``, ``comm_ready_order``, ``set_comm_order``,
    ``comm_post_latency``), ``capture_report()`` and ``workers`` (its
    worker threads).

    ``defer_tail``: ``run`` returns once this iteration's other ops are done
    and its collectives are posted; the rest -- the tail of
    ``runtime/tail.py``: the last allreduces and the updates behind them --
    finishes while the next ``run`` starts, whose ops wait only for the
    tail ops that touch what they touch. Call ``drain()`` before reading
    or writing the parameters from outside (a checkpoint, a test pass)."""

    def __init__(self, graph, executor=None, workspace=None, rank=0, profiler=None,
                 stall_timeout=300.0, poll_interval=2e-4, seed=0, busy_poll=1e-3,
                 defer_tail=False):
        self.executor = executor = executor or Executor()
        graph = executor.view(graph)
        self.graph = graph
        self.workspace = workspace or Workspace(graph)
        self.rank = rank
        self.profiler = profiler
        self.stall_timeout = stall_timeout
        self.poll_interval = poll_interval  # progress-thread polls while workers idle
        #: while a worker runs an op, the progress thread tests the transfers
        #: in flight when no thread has for this long (seconds; 0: never)
        self.busy_poll = busy_poll
        self.iteration = 0
        self.order = graph.topo_order()
        self.kernels = {}
        ws = self.workspace
        for op in self.order:
            k = make_kernel(op)
            k.workspace = ws
            k.ins = [ws[b] for b in op.inputs]
            k.outs = [ws[b] for b in op.outputs]
            if k.needs_rng:
                # per-op stream: independent of scheduling order and thread
                k.rng = np.random.default_rng([seed, zlib.crc32(op.name.encode())])
            self.kernels[op.name] = k
        #: the blobs several ops add into (zeroed at the start of an iteration)
        self.accumulated = sorted({b for op in self.order if op.accumulate for b in op.outputs})
        self.accum_lock = threading.Lock()  # accumulating writers add under it
        for op in self.order:
            k = self.kernels[op.name]
            k.setup(k.ins, k.outs)
        from ..parallel.precision import weight_copies
        #: the low-precision weight copies the updates write
        #: (parallel/precision.fold_weight_casts) and the workspace's
        #: ``weights_version`` they were last made from their weights at
        self.weight_copies = weight_copies(graph)
        self._copies_at = None
        #: False from a ``run``/``drain`` that raised (an op's fault, a
        #: stall): ``close`` then leaves the device alone (``_failed``)
        self._clean = True
        self._defer_tail = defer_tail
        self._error = self._raised = None  # the first op error; the one run() raised
        #: the scheduling core (runtime/scheduler.Schedule): ready counts,
        #: ready queues, the deferred tail; set by _build_schedule
        self.schedule = None
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        #: the worker threads (none for an executor that is not threaded)
        self.workers = []
        self._worker_cv = {}
        self._stop = False
        self._busy = 0  # workers running an op
        self._comm_order = [op.name for op in self._comm_in_posting_order()]
        self._comm = CommPoster(
            self._comm_order, self._post_by_name, self._complete, self._record_comm,
            rank=self.rank, gate=executor.gate,
            # point-to-point ops match by tag: posted as soon as ready
            unordered=[n for n in self._comm_order if not self.kernels[n].seq_ordered])
        executor.attach(self)
        self._build_schedule()
        if self.schedule.tail:
            WAIT_HOOKS.append(self._between_runs)

    def _comm_in_posting_order(self):
        """Comm ops in the order they are posted: by ``seq`` (fixed at graph
        build time, the same on every rank), then topological position."""
        position = {op.name: i for i, op in enumerate(self.order)}
        comm = [op for op in self.order if self.kernels[op.name].category == "comm"]
        return sorted(comm, key=lambda o: (o.attrs.get("seq", 1 << 30), position[o.name]))

    def _between_runs(self):
        """While a collective outside the graph waits between iterations:
        test this dispatcher's tail transfers still in flight (their updates
        then run on the workers); an error waits for the next run or drain.
        Returns whether transfers are still in flight."""
        if self._error is None and self.schedule.tail_todo and self._comm.pending:
            try:
                self._comm.progress(self._ops)
            except BaseException as exc:
                with self._lock:
                    self._error = exc
        return bool(self._comm.pending)

    # ----------------------------------------------------------- schedule
    def _build_schedule(self):
        """(Re)build the scheduling core from the executor's units; between
        iterations only. Starts a worker for each new lane."""
        ex = self.executor
        nodes, deps = ex.units(list(self.order), self.graph.dependencies())
        tail, cross = frozenset(), {}
        if self._defer_tail:  # ops, not units: only the event dispatcher defers
            tail, cross = deferred_tail(self.graph, self.kernels, deps)
        names = [n.name for n in nodes]
        comm = set(self._comm_order)
        self._ops = {n.name: n for n in nodes}
        self.schedule = Schedule(
            names, deps, {n.name: ex.lane(n) for n in nodes},
            ex.priority(names, feeds_comm(self.graph, nodes, comm)), comm, tail, cross)
        self._is_comm = self.schedule.is_comm
        #: without worker threads: the compute units in the order they run
        self._inline_order = [] if ex.threaded else sorted(
            (n for n in names if not self._is_comm[n]), key=self.schedule.priority.__getitem__)
        self._inline_next = 0
        for t in self.schedule.ready:
            if t in self._worker_cv:
                continue
            self._worker_cv[t] = threading.Condition(self._lock)
            if ex.threaded:
                w = threading.Thread(target=self._worker, args=(t,), daemon=True,
                                     name=f"purine-worker-{t}")
                self.workers.append(w)
                w.start()
        ex.planned()

    def label(self, name):
        """The iteration a running unit belongs to (its trace events')."""
        return self.schedule.label(name)

    # ------------------------------------------------------------- workers
    def _worker(self, tid):
        cv = self._worker_cv[tid]
        while True:
            with cv:
                while not self.schedule.ready[tid] and not self._stop:
                    cv.wait()
                if self._stop:
                    return
                name = self.schedule.pop(tid)
                self._busy += 1
            while name is not None:
                try:
                    self.executor.execute(self._ops[name], tid)
                    name = self._complete(name, tid)
                    # post what this op made ready, test what is in flight
                    self._comm.progress(self._ops)
                except BaseException as exc:  # surfaced by run() on the caller
                    with self._lock:
                        self._error = exc
                        self._busy -= 1
                        self._cv.notify()
                    break
                if name is None:
                    with self._lock:
                        if self._error is None:
                            name = self.schedule.pop(tid)
                        if name is None:
                            self._busy -= 1
                            if self._busy == 0:
                                self._cv.notify()  # the progress thread may poll now

    def _push_ready(self, name):
        """Queue a ready unit (lock held)."""
        if self._is_comm[name]:
            self.executor.ready(name)
            self._comm.mark_ready(name)
            self._cv.notify()
            return
        self._worker_cv[self.schedule.push(name)].notify()

    def _complete(self, name, tid=None):
        """Mark ``name`` done and queue its ready successors; on a worker,
        also take that thread's next op in the same critical section."""
        with self._lock:
            now = time.monotonic()
            if now - self._last_progress > Cancel.longest_wait:  # a cancel's grace
                Cancel.note_wait(now - self._last_progress)
            self._last_progress = now
            ready, milestone = self.schedule.complete(name)
            for s in ready:
                self._push_ready(s)
            if milestone:
                self._cv.notify()  # run() or drain() may wait for it
            if tid is not None and self._error is None:
                return self.schedule.pop(tid)
        return None

    # ------------------------------------------------------------ comm ops
    def _post_by_name(self, name):
        """Post one comm op (under MPI_LOCK): its Pending, or None when done."""
        result, _ = self.executor.post(self._ops[name])
        return result

    def _record_comm(self, op, t_post, t_done, extra):
        if self.profiler is not None:
            extra = dict(extra or {})
            spans = extra.pop("spans", ())
            self.profiler.record(op, "comm", t_post, t_done, self.label(op.name), "comm", extra)
            for kind, t0, t1, args in spans:  # a one-sided op's put, get, notify, waits
                self.profiler.record(_Span(f"{op.name}:{kind}", op.op_type), "rma", t0, t1,
                                     self.label(op.name), "comm", args)

    def comm_order(self):
        """The comm ops' posting order (build-time ``seq`` unless changed)."""
        return list(self._comm.order)

    def comm_ready_order(self):
        """The comm ops of the last iteration, ordered by when their inputs
        were ready (the observed gradient-ready order)."""
        ready = self._comm.ready_at
        return sorted(self._comm.order, key=lambda n: (ready.get(n, float("inf")),
                                                         self._comm.order.index(n)))

    def set_comm_order(self, order):
        """Post the comm ops in ``order`` from the next iteration on (the same
        order on every rank: decide it on one rank and broadcast it)."""
        changed = list(order) != self.comm_order()
        self._comm.set_order(order)
        self._comm_order = list(order)
        if changed and self.executor.replans():
            self._build_schedule()

    def comm_post_latency(self):
        """{op name: seconds from its inputs being ready to its post} for
        the last iteration."""
        c = self._comm
        return {n: c.posted_at[n] - c.ready_at[n] for n in c.order
                if n in c.posted_at and n in c.ready_at}

    def capture_report(self):
        """What is captured into CUDA graphs (``cuda_graph.GraphExecutor``);
        None for every other executor."""
        return self.executor.report()

    # ------------------------------------------------------- progress loop
    def run(self, iteration=None, sync=True):
        """Run every op once. Blocks until done (with ``defer_tail``: until
        every op but the tail is done and every collective is posted);
        raises the first op error. ``sync=False``: an iteration of device
        work alone may return once it is queued (the stream executors;
        call ``synchronize`` before reading a blob on the host)."""
        self._clean = False   # until this run returns
        it = self.iteration if iteration is None else iteration
        version = getattr(self.workspace, "weights_version", 0)
        if self.weight_copies and self._copies_at != version:
            # the first run, or weights set from outside since (fillers,
            # --init, a resume): each copy from its weight, as a Cast would
            from ..parallel.precision import refresh_weight_copies
            refresh_weight_copies(self.weight_copies, self.workspace)
            self._copies_at = version
        self.executor.start(it)
        self.iteration = it
        self._raise_unreported()  # a deferred tail op failed after the last run returned
        self._error = None
        self._comm.reset()  # keeps the transfers of the last iteration's tail
        for b in self.accumulated:  # a tail op never touches an accumulated blob
            self.workspace[b].fill(0)
        self.executor.zeroed()
        self._inline_next = 0
        with self._lock:
            # what is left of the last iteration's tail runs on; this
            # iteration's ops that touch what it touches wait for it
            self._last_progress = time.monotonic()
            Cancel.measuring = True  # the run's iterations began (a cancel's grace)
            for n in self.schedule.start(self.iteration):
                self._push_ready(n)
        self._progress_until(self._run_done)
        self.iteration += 1
        self.executor.finish(it, sync)
        self._clean = True

    def _run_done(self):
        """(lock held) This iteration's non-tail ops are done, the last one's
        tail too, and every collective of this one is posted."""
        return self.schedule.head_done() and self._comm.all_posted()

    def synchronize(self):
        """Wait until the device work queued so far has finished: then every
        blob holds its value of the last iteration, and the host may write."""
        self.executor.synchronize()

    def drain(self):
        """Wait until the deferred tail of the last ``run`` has finished, and
        the devices: then every blob holds its value of that iteration."""
        self._clean = False   # until this drain returns
        if self.schedule.tail_todo:
            self._progress_until(self.schedule.tail_done)
        self._raise_unreported()
        self.executor.synchronize()
        self._clean = True

    def _raise_unreported(self):
        """Raise the first op error unless run() or drain() raised it already."""
        if self._error is not None and self._error is not self._raised:
            self._raised = self._error
            raise self._error

    def _run_inline(self):
        """Without worker threads: run on this thread the compute units, in
        the executor's fixed order (its ``priority``), while the next one is
        ready (one waiting for a transfer waits; nothing overtakes it).
        Returns whether it ran any."""
        heap, ran = self.schedule.ready[INLINE_LANE], False
        while self._inline_due():
            name = self.schedule.pop(INLINE_LANE)
            self._inline_next += 1
            try:
                self.executor.execute(self._ops[name], INLINE_LANE)
                self._complete(name)
                self._comm.progress(self._ops)  # post what it made ready
            except BaseException:
                heap.clear()  # the iteration is over
                raise
            ran = True
        return ran

    def _inline_due(self):
        """The next unit of the fixed order is ready."""
        heap, order = self.schedule.ready.get(INLINE_LANE), self._inline_order
        return bool(heap) and self._inline_next < len(order) and \
            heap[0][-1] == order[self._inline_next]

    def _progress_until(self, finished):
        """The progress thread: wait (driving the transfers while the workers
        are idle or busy too long) until ``finished()`` (called with the lock
        held), or raise the first op error or a stall."""
        inline = not self.executor.threaded
        while True:
            if inline and self._run_inline():
                continue
            with self._lock:
                if self._error is None and not finished() and \
                        (self._busy or not self._comm.has_work()):
                    self._cv.wait(timeout=self._fallback_wait())
                if self._error is not None:
                    self._raised = self._error
                    raise self._error
                if finished():
                    break
                stalled_for = time.monotonic() - self._last_progress
                idle = self._busy == 0
            comm = self._comm
            if (idle or self._fallback_due()) and comm.has_work():
                # every worker waits, or none has tested for busy_poll
                # seconds (a long op): drive the transfers from here
                comm.progress(self._ops)
                if inline and self._inline_due():
                    continue  # a transfer's completion readied the next unit
                if idle and comm.has_work():
                    self._check_cancel(comm)
                    oldest = comm.oldest_post()
                    if stalled_for > self.stall_timeout and (
                            oldest is None or time.perf_counter() - oldest > self.stall_timeout):
                        announce_waiting()
                        raise StallError(_stall_message(self.rank, comm.in_flight(),
                                                        self.stall_timeout, comm.held()))
                    time.sleep(self.poll_interval)
            elif stalled_for > self.stall_timeout:
                if comm.in_flight() or comm.held():
                    raise StallError(_stall_message(self.rank, comm.in_flight(),
                                                    self.stall_timeout, comm.held()))
                raise StallError(f"rank {self.rank}: no op completed for "
                                 f"{self.stall_timeout:.0f} s; waiting: " +
                                 ", ".join(self.schedule.waiting()[:10]))

    def _check_cancel(self, comm):
        """A cancel (SIGTERM, Ctrl-C...; runtime/stop.py) while every worker
        waits on transfers that have not moved for ``Cancel.cancel_grace()``
        seconds: StoppedWhileStalled naming them (exit 128 + the signal),
        instead of waiting out the stall timeout for a stopped peer."""
        name = Cancel.cancelled_wait(self._last_progress)
        if name is None:
            return
        announce_waiting()  # the peers' waits outside the graph name the one that is not
        pending = _stall_message(self.rank, comm.in_flight(), 0, comm.held())
        pending = pending.split("still waiting on: ", 1)[-1]
        raise stopped_while_stalled(self.rank, name, "the iteration's communication",
                                    time.monotonic() - self._last_progress,
                                    f"still waiting on: {pending}")

    def _fallback_wait(self):
        """How long the progress thread may sleep (lock held): until the
        transfers in flight are due a test, when a worker is busy."""
        if self._busy and self.busy_poll > 0 and self._comm.has_work():
            return max(1e-5, self.busy_poll - (time.perf_counter() - self._comm.last_test))
        return 1.0

    def _fallback_due(self):
        return self.busy_poll > 0 and self._comm.has_work() and \
            time.perf_counter() - self._comm.last_test >= self.busy_poll

    def close(self):
        if self._between_runs in WAIT_HOOKS:
            WAIT_HOOKS.remove(self._between_runs)
        with self._lock:
            self._stop = True
            for cv in self._worker_cv.values():
                cv.notify_all()
        for w in self.workers:
            w.join(timeout=5)
        self._stop_prefetch()
        # a GPU's: its streams' cuBLAS handles and workspaces -- unless a run
        # failed (``_failed``)
        self.executor.close(release=not self._failed())

    def _failed(self):
        """Whether the last ``run``/``drain`` raised, or an op failed since
        (a deferred tail op): the streams may hold work that never finishes
        (a collective a stall left posted) or a device whose every call now
        fails (a kernel's fault). A close then neither waits for the streams
        nor destroys their cuBLAS handles (cublasDestroy synchronizes the
        device): it would hang, or raise in place of the run's error, in
        the ``finally`` that closes the run before the error is reported."""
        return not self._clean or self._error is not None

    def _stop_prefetch(self):
        """End the data readers' prefetch threads (ops/data.py), letting the
        batch each gathers finish. A prefetch thread holds its reader, and
        the reader its workspace (``k.workspace``, ``k.ins``/``k.outs``):
        left to end on its own (``IDLE_S`` after its last request) it kept
        every blob and scratch of a closed run in use -- on a GPU the whole
        device arena, which the next run in the process counted in its peak
        (benchmarks/gpt_gpu.py's second side of ours read about twice the
        first's, issue 45)."""
        from ..ops import data
        # EXIT_WAIT_S in all, each reader's thread asked to end first: a
        # close with several batches in flight (micro-batch copies of a
        # reader, several sources) waits no longer than one
        data.stop_readers([k for k in self.kernels.values()
                           if getattr(k, "ask_stop_prefetch", None) is not None],
                          data.EXIT_WAIT_S)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class EventDispatcher(Dispatcher):
    """The scheduling core with the CPU thread pool (``executors.Executor``):
    one worker thread per ``thread`` value of the ops."""

    def __init__(self, graph, defer_tail=False, **kw):
        super().__init__(graph, Executor(), defer_tail=defer_tail, **kw)


class SerialDispatcher(Dispatcher):
    """The serial twin (``executors.Inline``): ops one by one on the calling
    thread, in a fixed topological order. Communication ops are posted
    (non-blocking) in ``seq`` order, like the event dispatcher does, and
    waited for only when the next op needs their result, so matched
    Send/Recv pairs and collectives never deadlock."""

    def __init__(self, graph, **kw):
        super().__init__(graph, Inline(), **kw)


#: ops a stall message names (the rest counted), as the waiting list of the
#: no-progress message
STALL_OPS_SHOWN = 10


def _stall_message(rank, pending, timeout, held=()):
    parts = []
    for op, p in pending:
        desc = p.describe() if hasattr(p, "describe") else ""
        parts.append(f"op '{op.name}' ({op.op_type}{', ' + desc if desc else ''})")
    parts += [f"op '{name}' (not posted: {why})" for name, why in held]
    if len(parts) > STALL_OPS_SHOWN:  # one line under PIPE_BUF: written whole (write_line)
        parts[STALL_OPS_SHOWN:] = [f"and {len(parts) - STALL_OPS_SHOWN} more"]
    return (f"rank {rank}: communication stalled for more than {timeout:.0f} s; "
            f"still waiting on: " + "; ".join(parts))


class _Span:
    """What ``Profiler.record`` reads of an op, for a part of a one-sided op."""

    def __init__(self, name, op_type):
        self.name, self.op_type = name, op_type
