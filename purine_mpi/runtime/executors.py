"""Executors: what runs a unit the scheduling core found ready.

The core (``runtime/dispatcher.Dispatcher``) decides *when* a unit (an op,
or a captured segment of ops) runs: ready counts, the comm poster, the
deferred tail, stop and stall handling. An executor decides *how*; it
answers one small interface, every method of which has a default here:

- ``view(graph)``: the graph the core runs (the stream executor names each
  GPU op's stream as its ``thread``); ``attach(core)``: the core is built
  (kernels made, set up);
- ``units(ops, deps)``: the scheduling units and their dependencies (the
  CUDA-graph executor groups ops into segments); ``lane(unit)``: which
  worker takes it; ``priority(names, feeds_comm)``: the ready order;
  ``planned()``: the core's schedule is (re)built; ``replans()``: whether a
  new comm posting order changes the units;
- ``start(iteration)``, ``zeroed()``, ``finish(iteration, sync)``: around
  one iteration (before anything, after the accumulators are zeroed, after
  the core's run returned); ``synchronize()``: wait for the device;
- ``execute(unit, tid)``: run a compute unit, ``(Pending or None, t0)``;
  ``post(op)``: post a comm op, the same; ``ready(name)``: a comm op's
  inputs are written (under the core's lock); ``gate``: None, or
  name -> whether its device work has finished (``CommPoster``'s hook);
- ``report()``: what ``capture_report()`` says (None but for CUDA graphs).

``threaded``: whether the core runs one worker thread per lane (the CPU
thread pool, the streams' host workers) or runs every unit on the thread
that called ``run`` (``Inline``).

Here: ``Executor``, the CPU thread pool (kernels run on worker threads,
one per ``thread`` value of the ops), and ``Inline``, the serial twin: one
unit at a time on the calling thread, in a fixed topological order (comm
ops constrained to their posting order), the debugging reference
(``PURINE_DISPATCHER=serial``) every concurrent executor is held to, bit
for bit. On GPUs: ``streams_dispatcher.StreamExecutor`` and
``cuda_graph.GraphExecutor``; in simulated time:
``tools/scaling/simulate.VirtualClock``.
"""
import time

from ..base.errors import OpError
from ..ops import hostgemm
from .scheduler import ready_priority, twin_order


class Executor:
    """The CPU thread pool: one worker thread per ``thread`` value; a unit
    is its op's kernel, run on the host. The base of every executor."""

    threaded = True
    #: CommPoster's device hook (see the module docstring); None: none
    gate = None

    def view(self, graph):
        return graph

    def attach(self, core):
        self.core = core

    def close(self, release=True):
        """Release what the executor holds beyond its dispatcher (the
        dispatcher's ``close``, after its workers ended; ``release`` False
        after a failed run: give up its share, touch no device). Nothing
        here."""

    def units(self, ops, deps):
        return ops, deps

    def lane(self, unit):
        return str(unit.thread)

    def priority(self, names, feeds_comm):
        return ready_priority(names, feeds_comm)

    def planned(self):
        pass

    def scratch_lanes(self):
        """{op: the stream it runs on}, for the workspace's scratch slots
        (``Workspace.set_scratch_lanes``); None: host threads, no streams."""
        return None

    def replans(self):
        return False

    def start(self, iteration):
        pass

    def zeroed(self):
        pass

    def finish(self, iteration, sync):
        pass

    def synchronize(self):
        pass

    def ready(self, name):
        pass

    def report(self):
        return None

    def post(self, op):
        return self.execute(op, "comm")

    def execute(self, op, tid):
        """Run one op's kernel on the host; (its Pending or None, start time)."""
        core = self.core
        k = core.kernels[op.name]
        c0 = time.thread_time() if core.profiler is not None else 0.0
        t0 = time.perf_counter()
        try:
            if op.accumulate:
                tmp = [o.copy() for o in k.outs]
                for t in tmp:
                    t.fill(0)
                result = k.run(k.ins, tmp)
                with core.accum_lock:
                    for o, t in zip(k.outs, tmp):
                        o += t
            else:
                result = k.run(k.ins, k.outs)
        except Exception as exc:
            raise OpError(op, exc, core.rank) from exc
        if result is None and core.profiler is not None:
            # the op's CPU time on this thread beside its wall time: the
            # calibration's op costs undisturbed by other processes sharing
            # the cores (docs/formats.md, "Traces": ``args.cpu_us``)
            # (not where host products run on a pool of threads as well, ours
            # or BLAS's: this thread's CPU time would be a part of the op's)
            t1, c1 = time.perf_counter(), time.thread_time()
            core.profiler.record(op, k.category, t0, t1, core.label(op.name), tid,
                                 {"cpu_us": round((c1 - c0) * 1e6, 1)}
                                 if hostgemm.one_thread() else None)
        return result, t0


#: the lane (and trace row) of everything the serial twin runs
INLINE_LANE = "main"


class Inline(Executor):
    """The serial twin: every unit on the thread that calls ``run``, one
    at a time, strictly in one fixed topological order in which the comm
    ops keep their posting order where the graph allows it (its
    ``priority``: ``scheduler.twin_order``); a unit that waits for a
    transfer is overtaken by none (``Dispatcher._run_inline``)."""

    threaded = False

    def lane(self, unit):
        return INLINE_LANE

    def priority(self, names, feeds_comm):
        """The fixed order: ``scheduler.twin_order``."""
        core = self.core
        comm = core.comm_order()
        ordered = [n for n in comm if core.kernels[n].seq_ordered]
        position = {n: i for i, n in enumerate(twin_order(core.graph, comm, ordered))}
        return {n: position[n] for n in names}
