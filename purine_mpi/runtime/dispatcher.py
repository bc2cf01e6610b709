"""Dispatchers: run one iteration of a graph from its sources to its sinks.

``EventDispatcher`` is Purine's event-driven engine: an op fires as soon as
every op it depends on has finished. Compute ops run on worker threads named
by their ``thread`` attribute (NumPy and BLAS release the GIL, so independent
branches really run at once). Communication ops (kernel category ``comm``)
are posted the moment their inputs exist, by the worker thread that wrote
the last of them -- collectives strictly in their ``seq`` order (assigned at
graph build time, the same on every rank), point-to-point ops at once;
workers test the requests in flight between ops, and the calling thread --
the *progress thread* -- while every worker is idle, or when a long op has
kept every worker from testing for ``busy_poll`` seconds
(``runtime/comm_progress.py``, the one place that calls MPI), so a bucket's
transfer starts, and keeps moving, while the layers below still
back-propagate.

With ``defer_tail`` (``parallel.defer_update``) an iteration's ``run``
returns once its ops are done but for its *tail* -- the last allreduces and
the updates behind them (``runtime/tail.py``) -- and its collectives are all
posted; the tail finishes during the next ``run``, whose ops wait only for
the tail ops that touch their memory; ``drain()`` waits for it.

``SerialDispatcher`` (runtime/serial.py, with what every dispatcher shares)
runs the same graph one op at a time in a fixed topological order: the
debugging reference (``PURINE_DISPATCHER=serial``). Both give bit-identical
results, since every blob has one writer.

Which dispatcher runs a graph is decided in ``runtime/factory.py``
(``make_dispatcher``), above this module and the GPU dispatchers.

Layer: dispatch (docs/DESIGN.md); may import the foundation, devices, data,
ops, graph, job and composition layers below it, and its own.
"""
import threading
import time

from ..comm.world import WAIT_HOOKS
from ..errors import StallError
from .comm_progress import CommPoster
from .scheduler import Schedule, feeds_comm, ready_priority
from .serial import Profiler, SerialDispatcher, _Base, _stall_message  # noqa: F401
from .tail import deferred_tail


class EventDispatcher(_Base):
    """Event-driven: ops fire when their predecessors finish; one worker
    thread per ``thread`` value; comm ops posted as soon as they are ready
    (in ``seq`` order) by whichever thread readied them (``CommPoster``).

    ``defer_tail``: ``run`` returns once this iteration's other ops are done
    and its collectives are posted; the rest -- the tail of
    ``runtime/tail.py``: the last allreduces and the updates behind them --
    finishes while the next ``run`` starts, whose ops wait only for the
    tail ops that touch what they touch. Call ``drain()`` before reading
    or writing the parameters from outside (a checkpoint, a test pass)."""

    def __init__(self, graph, defer_tail=False, **kw):
        super().__init__(graph, **kw)
        self._defer_tail = defer_tail
        self._error = self._raised = None  # the first op error; the one run() raised
        #: the scheduling core (runtime/scheduler.Schedule): ready counts,
        #: ready queues, the deferred tail; set by _build_schedule
        self.schedule = None
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._worker_cv, self._workers = {}, []
        self._stop = False
        self._busy = 0  # workers running an op
        self._comm_order = [op.name for op in self._comm_in_posting_order()]
        self._comm = CommPoster(
            self._comm_order, self._post_by_name, self._complete, self._record_comm,
            rank=self.rank, gate=self._comm_gate,
            # point-to-point ops match by tag: posted as soon as ready
            unordered=[n for n in self._comm_order if not self.kernels[n].seq_ordered])
        self._build_schedule()
        if self.schedule.tail:
            WAIT_HOOKS.append(self._between_runs)

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
    def _schedule(self):
        """The units the workers run, in a topological order, and their
        dependencies ({name: set of predecessor names}): here the graph's
        ops. A subclass may group ops into units of its own (each with a
        ``name``, ``thread`` and ``outputs``, run by its ``_execute``)."""
        return list(self.order), self.graph.dependencies()

    def _build_schedule(self):
        """(Re)build the scheduling core from ``_schedule()``; between
        iterations only. Starts a worker for each new thread."""
        nodes, deps = self._schedule()
        tail, cross = frozenset(), {}
        if self._defer_tail:  # ops, not units: only the event dispatcher defers
            tail, cross = deferred_tail(self.graph, self.kernels, deps)
        names = [n.name for n in nodes]
        comm = set(self._comm_order)
        self._ops = {n.name: n for n in nodes}
        self._deps = deps
        self.schedule = Schedule(
            names, deps, {n.name: str(n.thread) for n in nodes},
            ready_priority(names, feeds_comm(self.graph, nodes, comm)), comm, tail, cross)
        self._is_comm = self.schedule.is_comm
        for t in self.schedule.ready:
            if t in self._worker_cv:
                continue
            self._worker_cv[t] = threading.Condition(self._lock)
            w = threading.Thread(target=self._worker, args=(t,), daemon=True,
                                 name=f"purine-worker-{t}")
            self._workers.append(w)
            w.start()

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
                op = self._ops[name]
                try:
                    self._execute(op, tid)
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
        """Queue a ready op (lock held)."""
        if self._is_comm[name]:
            self._comm.mark_ready(name)
            self._cv.notify()
            return
        self._worker_cv[self.schedule.push(name)].notify()

    def _complete(self, name, tid=None):
        """Mark ``name`` done and queue its ready successors; on a worker,
        also take that thread's next op in the same critical section."""
        with self._lock:
            self._last_progress = time.monotonic()
            ready, milestone = self.schedule.complete(name)
            for s in ready:
                self._push_ready(s)
            if milestone:
                self._cv.notify()  # run() or drain() may wait for it
            if tid is not None and self._error is None:
                return self.schedule.pop(tid)
        return None

    def _label(self, name):
        return self.schedule.label(name)

    # ------------------------------------------------------------ comm ops
    #: CommPoster's device hook: None, or name -> whether the device work
    #: that wrote the op's inputs has finished (the stream dispatcher's)
    _comm_gate = None

    def _post_by_name(self, name):
        """Post one comm op (under MPI_LOCK): its Pending, or None when done."""
        result, _ = self._execute(self._ops[name], "comm")
        return result

    def _record_comm(self, op, t_post, t_done, extra):
        if self.profiler is not None:
            self.profiler.record(op, "comm", t_post, t_done, self._label(op.name), "comm", extra)

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
        self._comm.set_order(order)
        self._comm_order = list(order)

    def comm_post_latency(self):
        """{op name: seconds from its inputs being ready to its post} for
        the last iteration."""
        c = self._comm
        return {n: c.posted_at[n] - c.ready_at[n] for n in c.order
                if n in c.posted_at and n in c.ready_at}

    # ------------------------------------------------------- progress loop
    def run(self, iteration=None):
        """Run every op once. Blocks until done (with ``defer_tail``: until
        every op but the tail is done and every collective is posted);
        raises the first op error."""
        if iteration is not None:
            self.iteration = iteration
        self._raise_unreported()  # a deferred tail op failed after the last run returned
        self._error = None
        self._comm.reset()  # keeps the transfers of the last iteration's tail
        self._zero_accumulators()  # a tail op never touches an accumulated blob
        with self._lock:
            # what is left of the last iteration's tail runs on; this
            # iteration's ops that touch what it touches wait for it
            self._last_progress = time.monotonic()
            for n in self.schedule.start(self.iteration):
                self._push_ready(n)
        self._progress_until(self._run_done)
        self.iteration += 1

    def _run_done(self):
        """(lock held) This iteration's non-tail ops are done, the last one's
        tail too, and every collective of this one is posted."""
        return self.schedule.head_done() and self._comm.all_posted()

    def drain(self):
        """Wait until the deferred tail of the last ``run`` has finished:
        then every blob holds its value of that iteration."""
        if self.schedule.tail_todo:
            self._progress_until(self.schedule.tail_done)
        self._raise_unreported()

    def _raise_unreported(self):
        """Raise the first op error unless run() or drain() raised it already."""
        if self._error is not None and self._error is not self._raised:
            self._raised = self._error
            raise self._error

    def _progress_until(self, finished):
        """The progress thread: wait (driving the transfers while the workers
        are idle or busy too long) until ``finished()`` (called with the lock
        held), or raise the first op error or a stall."""
        while True:
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
                if idle and comm.has_work():
                    oldest = comm.oldest_post()
                    if stalled_for > self.stall_timeout and (
                            oldest is None or time.perf_counter() - oldest > self.stall_timeout):
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
        for w in self._workers:
            w.join(timeout=5)


