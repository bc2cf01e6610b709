"""The CUDA-stream executor (``StreamExecutor``; ``StreamDispatcher`` is the
scheduling core with it): Purine's event-driven engine on GPUs.

Each (device, thread) pair of a GPU op is a CUDA stream. An op on a GPU is
*launched* asynchronously on its stream by a host worker thread (one per
stream, as the CPU dispatcher has one per thread); its successors may be
launched as soon as it is, because the dependencies are kept on the device:

- same stream: nothing to do, a stream runs its work in launch order;
- another stream: the consumer's stream waits on a CUDA event recorded
  after the producer (``stream.wait_event``), the host never blocks;
- a host op (CPU compute) after GPU work: the worker synchronises on the
  producer's event first, since the host reads the memory itself;
- a communication op after GPU work: whichever thread drives the comm
  ops (``runtime/comm_progress.CommPoster``: the worker that launched its
  last producer, another worker between ops, or the progress thread) asks
  the poster's device hook (the executor's ``gate``), which queries the producers'
  events (never blocking, so the transfers in flight keep moving); the MPI
  call is posted only once its input is complete on the device, collectives
  still in ``seq`` order. With a non-CUDA-aware MPI its buffers are staged
  through page-locked mirrors planned once (``comm/device.HostStage``),
  asynchronously: the device-to-host copies are queued on the device's
  ``stage_d2h`` stream after the producers' events, and the post waits
  (polled) for the event after them; the epilogue (the host-to-device copy
  back, the 1/N scale) is queued on the device's ``comm`` stream, and GPU
  consumers wait on an event recorded after it. No synchronous
  ``get``/``set``. With a profiler each staging copy is a trace event of
  category ``staging``: ``<op>:d2h`` on the ``stage_d2h`` row, ``<op>:h2d``
  (with the scale) on the ``comm`` row.

The host synchronises with the devices only where it must: before a comm or
host op reads device memory, at the start of an iteration (host writes made
outside the dispatcher -- the iteration counter, a loaded checkpoint -- went
to CuPy's default stream, which these non-blocking streams do not wait for)
and at its end (the caller reads the sinks: the loss, the weights).

Host<->device ``Copy`` ops (inserted by ``purine_mpi.parallel.placement``) run on
their own ``h2d``/``d2h`` streams, from page-locked host blobs, as
asynchronous ``cudaMemcpyAsync``.
A kernel with host work of its own every iteration (``before_iteration``,
``ops/registry.OpKernel``: the data reader picks its ready page-locked
staging buffer, the device iteration counter is set where the trainer's
iteration jumps) has it called at the start of ``run``, before any device
work of the iteration is queued, also when a CUDA graph replays the op; its
device work is an ordinary launch (the reader's ``cudaMemcpyAsync`` from
the staging buffer), and ``after_launch`` hands it the event recorded after
that work (the reader's prefetch thread waits on it before refilling the
buffer).

``run(iteration, sync=False)`` (the trainer's steps on a single GPU) ends
without synchronising when the iteration is device work alone (no host or
comm op): the next iteration's streams wait on the events recorded at the
end of this one, on the device, and the host synchronises only where it
reads something back (``synchronize``/``drain``: display, test,
checkpoint, a stop signal).

With ``--profile`` a GPU op's trace event spans its execution on the device
(CUDA timing events, read after the iteration's final synchronisation), not
the microseconds the host took to launch it.

All CUDA calls go through a ``runtime`` object (``CudaRuntime``), so the
event bookkeeping is tested on machines without a GPU against a simulated
device (tests/emulated_gpu). What the tests look at is public on the
executor (``dispatcher.executor``): ``streams`` ({unit: its stream
(device, thread), None on the host}), ``events`` ({unit: the CUDA event
recorded after it this iteration, for whoever outside its stream waits}),
``staged_out`` ({comm op: the event after its device-to-host copies this
iteration}) and ``copied_back`` ({comm op: the event after its last copy
back}).
"""
import dataclasses
import threading
import time

import numpy as np

from ..base.backend import get_xp
from ..base.errors import OpError
from ..ops.registry import Pending
from .cuda_runtime import (CudaRuntime, HostDeviceCopy, stream_keys, stream_thread_name,
                           with_stream_threads)
from .dispatcher import Dispatcher
from .executors import Executor

#: the stream the per-iteration timing origin is recorded on (profiling)
ORIGIN_STREAM = "origin"
#: the stream thread of each device's device-to-host staging copies
COPY_OUT_STREAM = "stage_d2h"


@dataclasses.dataclass(frozen=True)
class StageCopy:
    """What a staging copy's trace event names (category ``staging``)."""

    name: str
    op_type: str = "HostStage"


class StreamExecutor(Executor):
    """GPU units launched on CUDA streams by one host worker per stream
    (see the module docstring); host ops run as in the thread pool. A graph
    without GPU ops runs exactly as there."""

    def __init__(self, runtime=None):
        self.runtime = runtime

    def view(self, graph):
        keys = stream_keys(graph)
        self.source_graph = graph
        #: unit -> its stream (device, thread); None: the host
        self.streams = keys
        self.devices = sorted({k[0] for k in keys.values() if k is not None})
        if self.runtime is None and self.devices:
            self.runtime = CudaRuntime()
        if self.runtime is not None and not getattr(self, "_counted", False):
            # the executors using the runtime: the last to close releases
            # its streams' cuBLAS handles (``close``)
            self.runtime.users = getattr(self.runtime, "users", 0) + 1
            self._counted = True
        return with_stream_threads(graph, keys)

    def close(self, release=True):
        """The last executor of its runtime to close destroys the cuBLAS
        handles bound to the runtime's streams and drops their workspaces
        (``gpu/blas.release_streams``; ``PURINE_CUBLAS_WORKSPACE_MB``, 32
        MiB, each: a closed trainer's two used to stay in the process's
        ``blas._handles`` for good), after the streams are idle. A runtime
        another live executor shares keeps them (its captured graphs baked
        those workspaces in). ``release`` False (the dispatcher's run
        failed: a stuck collective or a faulted device): nothing is waited
        for or destroyed, the handles stay (the process is ending)."""
        rt = self.runtime
        if rt is None or not getattr(self, "_counted", False):
            return
        self._counted = False
        rt.users = getattr(rt, "users", 1) - 1
        if rt.users > 0 or not release:
            return
        pool = getattr(rt, "pool", None)
        streams = [s for _, s in pool.items()] if pool is not None else []
        if not streams:
            return
        from ..gpu import blas
        try:
            rt.sync_streams()
        finally:
            blas.release_streams(int(s.ptr) for s in streams if hasattr(s, "ptr"))

    def attach(self, core):
        super().attach(core)
        keys, kernels, graph = self.streams, core.kernels, core.graph
        self._accum_roots = {op.name: sorted({graph.storage_root(b) for b in op.outputs})
                             for op in core.order if op.accumulate}
        self.events = {}
        self._acc_events = {}
        self._timed = []
        self._origin = {}
        #: (device, stream) -> event recorded at the end of an iteration that
        #: returned unsynchronised; the next iteration's streams wait on them
        self._tail_events = {}
        self._fenced = set()  # streams that waited on them in this iteration
        self._synced = True   # no device work queued since the host last waited
        #: ops with host work every iteration (OpKernel.before_iteration)
        self._iteration_hooks = [n for n in graph.ops if keys[n] is not None
                                 and kernels[n].before_iteration is not None]
        self._iteration_keys = {}
        # host or comm ops read or write host memory the device may still use:
        # an iteration with any ends synchronised
        self._device_only = bool(self.devices) and not core.accumulated and all(
            keys[n] is not None and kernels[n].category != "comm" for n in graph.ops)
        #: comm op -> the event after its device-to-host copies (this
        #: iteration), and the event after its last copy back
        self.staged_out, self.copied_back = {}, {}
        self._async_staged = {}
        self._stage_lock = threading.Lock()
        for name, k in kernels.items():
            if keys.get(name) is not None and k.category == "comm" and hasattr(k, "copy_out"):
                k.async_staging = True
        if self.runtime is not None and self.runtime.swaps_copies():
            self._swap_copy_kernels()

    def planned(self):
        """The device-side waits, host synchronisations and comm gates
        between the scheduling units (after the core built its schedule)."""
        keys, deps = self.streams, self.core.schedule.deps
        is_comm = self.core.schedule.is_comm
        succ = {n: [] for n in deps}
        for n, d in deps.items():
            for p in d:
                succ[p].append(n)
        on_gpu = {n for n in deps if keys[n] is not None}
        #: GPU unit -> GPU predecessors on other streams (device-side waits)
        self._waits = {}
        #: host compute op -> GPU predecessors (host synchronisation)
        self._host_waits = {}
        #: comm op -> GPU predecessors on other streams (polled before posting)
        self._gates = {}
        for n, d in deps.items():
            gpu_preds = sorted(p for p in d if p in on_gpu)
            other = [p for p in gpu_preds if keys[p] != keys[n]]
            if is_comm[n]:
                self._gates[n] = other
            elif keys[n] is None:
                self._host_waits[n] = gpu_preds
            else:
                self._waits[n] = other
        #: units whose completion someone outside their stream waits for
        self._needs_event = {n: keys[n] is not None and any(keys[s] != keys[n] for s in succ[n])
                             for n in deps}
        ws = getattr(self.core, "workspace", None)
        if hasattr(ws, "set_scratch_lanes"):
            ws.set_scratch_lanes(self.scratch_lanes())

    def scratch_lanes(self):
        """Each GPU op's stream (device, thread): the ops of one stream run
        one after the other, so they share one scratch slot."""
        return {n: key for n, key in self.streams.items()
                if key is not None and n in self.core.graph.ops}

    # ------------------------------------------------------------ set-up
    def _swap_copy_kernels(self):
        """Copy ops between host and device memory: asynchronous copies."""
        kernels = self.core.kernels
        for op in self.core.order:
            k = kernels[op.name]
            if op.op_type != "Copy" or op.accumulate or len(k.ins) != 1:
                continue
            src_dev = get_xp(k.ins[0]) is not np
            dst_dev = get_xp(k.outs[0]) is not np
            if src_dev != dst_dev:
                swapped = HostDeviceCopy(op)
                swapped.workspace, swapped.ins, swapped.outs = k.workspace, k.ins, k.outs
                kernels[op.name] = swapped

    def _stream(self, key):
        return self.runtime.stream(key[0], key[1])

    # ------------------------------------------------------- iterations
    def zeroed(self):
        """Start of an iteration (the accumulators are zeroed): let the
        host's own device writes land."""
        self.events = {}
        self._acc_events = {}
        self._timed = []
        self._origin = {}
        if self.runtime is None or not self.devices:
            return
        if self._synced or self.core.profiler is not None:
            # host writes made outside the dispatcher (a loaded checkpoint, the
            # loss window's reset) went to CuPy's default stream
            self.runtime.sync_devices(self.devices)
            self._tail_events = {}
        if self.core.profiler is not None:
            for d in self.devices:
                event = self.runtime.record(d, self.runtime.stream(d, ORIGIN_STREAM), timing=True)
                self.runtime.sync_event(event)
                self._origin[d] = (event, time.perf_counter())

    def finish(self, iteration, sync):
        """Every op is launched: wait for the devices, so that every blob
        holds its value of this iteration -- or, with ``sync=False``, for an
        iteration of device work alone, return once it is queued."""
        if self.runtime is None or not self.devices:
            return
        if sync or not self._device_only or self.core.profiler is not None or self._must_sync():
            self.runtime.sync_streams()
            self._mark_synced()
            self._trace_device_times(iteration)
            return
        self._synced = False
        tail = dict(self._tail_events)
        for key in self._fenced:
            tail[key] = self.runtime.record(key[0], self._stream(key))
        self._tail_events = tail

    def synchronize(self):
        if self.runtime is not None and self.devices and not self._synced:
            self.runtime.sync_streams()
        self._mark_synced()

    def _mark_synced(self):
        """The devices are idle: the next iteration starts afresh (no tail)."""
        self._synced, self._tail_events = True, {}

    def _must_sync(self):
        """Whether this iteration must end synchronised anyway."""
        return False

    def start(self, iteration):
        """Before any device work of ``iteration`` is queued: the ops' host
        work of this iteration (OpKernel.before_iteration)."""
        self._fenced = set()
        kernels, keys = self.core.kernels, {}
        for name in self._iteration_hooks:
            try:
                keys[name] = kernels[name].before_iteration(iteration, self._host_write)
            except Exception as exc:  # e.g. a batch the data op refused: its op named
                raise OpError(self.core.graph.ops[name], exc, self.core.rank) from exc
        self._iteration_keys = keys

    def _host_write(self, fn):
        """Run ``fn`` (host writes into device blobs) with the devices idle."""
        self.runtime.host_write(self.devices, fn)
        self._mark_synced()

    def _fence(self, key, stream):
        """Before a stream's first work of an iteration that follows an
        unsynchronised one: wait (on the device) for the work the other
        streams queued in that one."""
        if key in self._fenced:
            return
        self._fenced.add(key)
        for other, event in self._tail_events.items():
            if other != key:
                self.runtime.wait(stream, event)

    def _launched(self, name, device, stream):
        """Hand an op with ``after_launch`` the event after its device work."""
        k = self.core.kernels[name]
        if k.after_launch is not None:
            k.after_launch(self.runtime.record(device, stream), self.runtime)

    def _trace_device_times(self, iteration):
        if self.core.profiler is None or not self._origin:
            return
        for op, category, tid, device, start, end, extra in self._timed:
            origin, t_host = self._origin[device]
            t0 = t_host + self.runtime.elapsed_ms(origin, start) / 1e3
            t1 = t_host + self.runtime.elapsed_ms(origin, end) / 1e3
            self.core.profiler.record(op, category, t0, t1, iteration, tid, extra)

    # --------------------------------------------------------------- ops
    def execute(self, op, tid):
        key = self.streams[op.name]
        if key is None:
            for p in self._host_waits[op.name]:
                self.runtime.sync_event(self.events[p])
            return super().execute(op, tid)
        return self._execute_gpu(op, key, tid)

    def _execute_gpu(self, op, key, tid):
        name, device = op.name, key[0]
        rt, core = self.runtime, self.core
        stream = self._stream(key)
        self._fence(key, stream)
        for p in self._waits[name]:
            rt.wait(stream, self.events[p])
        k = core.kernels[name]
        t0 = time.perf_counter()
        start = rt.record(device, stream, timing=True) if core.profiler is not None else None
        try:
            if op.accumulate:
                self._accumulate(op, k, key, stream)
            else:
                rt.launch(device, stream, lambda: k.run(k.ins, k.outs), name)
        except Exception as exc:
            raise OpError(op, exc, core.rank) from exc
        self._launched(name, device, stream)
        if start is not None:
            end = rt.record(device, stream, timing=True)
            self._timed.append((op, k.category, tid, device, start, end, None))
        if self._needs_event[name]:
            self.events[name] = rt.record(device, stream)
        return None, t0

    def _accumulate(self, op, k, key, stream):
        """Writers adding into one blob from several streams: each computes
        into temporaries on its stream, then the adds are chained across
        streams by events, in the order the host reaches them."""
        device, rt = key[0], self.runtime
        tmp = []

        def compute():
            tmp.extend(get_xp(o).zeros_like(o) for o in k.outs)
            k.run(k.ins, tmp)

        def add():
            for o, t in zip(k.outs, tmp):
                o += t

        rt.launch(device, stream, compute)
        with self.core.accum_lock:
            roots = self._accum_roots[op.name]
            for r in roots:
                prev = self._acc_events.get(r)
                if prev is not None and prev[0] != key:
                    rt.wait(stream, prev[1])
            rt.launch(device, stream, add)
            event = rt.record(device, stream)
            for r in roots:
                self._acc_events[r] = (key, event)

    # ------------------------------------------------------- comm ops
    def gate(self, name):
        """CommPoster's device hook: whether the GPU work a comm op reads
        has finished (its producers' events queried, never waited on). Until
        it has, the poster holds the op -- and the ordered ops after it, so
        MPI sees the posts in seq order -- and asks again at its next
        progress call, while the transfers in flight keep moving.

        An op whose MPI buffers are host stages of device memory opens
        when the event after its copies to them has fired."""
        rt = self.runtime
        if not self._needs_staging(name):
            return all(rt.query(self.events[p]) for p in self._gates[name])
        return rt.query(self._stage_out(name))

    def post(self, op):
        """Post a comm op (the poster calls it once ``gate`` is open)."""
        core = self.core
        t0 = time.perf_counter()
        try:
            result = self._post_comm(op)
        except Exception as exc:
            raise OpError(op, exc, core.rank) from exc
        finally:
            self.staged_out.pop(op.name, None)  # the next iteration copies again
        if result is None and core.profiler is not None:
            core.profiler.record(op, core.kernels[op.name].category, t0, time.perf_counter(),
                                 core.iteration, "comm")
        return result, t0

    def _post_comm(self, op):
        """Run the comm kernel (posting MPI); its Pending, or None when done."""
        k = self.core.kernels[op.name]
        key = self.streams[op.name]
        if key is None:
            return k.run(k.ins, k.outs)
        result = self.runtime.call(key[0], self._stream(key), lambda: k.run(k.ins, k.outs))
        if result is None:
            self._comm_done(op)
            return None
        return _StreamPending(self, op, result)

    def _finish_comm(self, op, inner):
        """A posted comm op's transfer is done: its epilogue (the copy back
        from a host stage, the scale) on its device's comm stream."""
        key = self.streams[op.name]
        rt, stream = self.runtime, self._stream(key)
        timed = self.core.profiler is not None and self._async_staged.get(op.name)
        start = rt.record(key[0], stream, timing=True) if timed else None
        rt.call(key[0], stream, inner.finish)
        if start is not None:
            self._timed.append((StageCopy(f"{op.name}:h2d"), "staging",
                                stream_thread_name(*key), key[0], start,
                                rt.record(key[0], stream, timing=True),
                                {"stage": "host_to_device"}))
        self._comm_done(op)

    def _comm_done(self, op):
        key = self.streams[op.name]
        if key is None:
            return
        staged = self._async_staged.get(op.name)
        if self._needs_event[op.name] or staged:
            event = self.runtime.record(key[0], self._stream(key))
            if self._needs_event[op.name]:
                self.events[op.name] = event
            if staged:
                self.copied_back[op.name] = event  # the mirror is free again

    # ---------------------------------------------------- host staging
    def _needs_staging(self, name):
        staged = self._async_staged.get(name)
        if staged is None:
            k = self.core.kernels[name]
            staged = self._async_staged[name] = bool(
                self.streams[name] is not None and getattr(k, "async_staging", False)
                and k.stages_out())
        return staged

    def ready(self, name):
        """A staged comm op's copies to its mirrors are queued as soon as
        its inputs' writers are launched, also while ordered ops before it
        still hold it back from the MPI post."""
        if self._needs_staging(name):
            self._stage_out(name)

    def _stage_out(self, name):
        """Queue (once per iteration) the device-to-host copies of comm op
        ``name``'s host stages on the device's ``stage_d2h`` stream, after
        its writers and its previous copy back; returns the event after them."""
        with self._stage_lock:
            event = self.staged_out.get(name)
            if event is not None:
                return event
            rt, key = self.runtime, self.streams[name]
            device = key[0]
            copy = self._stream((device, COPY_OUT_STREAM))
            for p in self._gates[name]:
                rt.wait(copy, self.events[p])
            if any(self.streams[p] == key for p in self.core.schedule.deps[name]):
                rt.wait(copy, rt.record(device, self._stream(key)))
            back = self.copied_back.get(name)
            if back is not None:  # MPI's buffer is free once copied back
                rt.wait(copy, back)
            k = self.core.kernels[name]
            timed = self.core.profiler is not None
            start = rt.record(device, copy, timing=True) if timed else None
            rt.launch(device, copy, k.copy_out, f"{name}:d2h")
            event = self.staged_out[name] = rt.record(device, copy, timing=timed)
            if timed:
                self._timed.append((StageCopy(f"{name}:d2h"), "staging",
                                    stream_thread_name(device, COPY_OUT_STREAM), device, start,
                                    event, {"stage": "device_to_host"}))
            return event


class _StreamPending(Pending):
    """A comm op's Pending whose epilogue runs on its device's comm stream;
    GPU consumers wait on the event recorded after it."""

    def __init__(self, executor, op, inner):
        self.executor, self.op, self.inner = executor, op, inner
        self.requests = getattr(inner, "requests", ())

    def test(self):
        return self.inner.test()

    def finish(self):
        self.executor._finish_comm(self.op, self.inner)

    def describe(self):
        return self.inner.describe() if hasattr(self.inner, "describe") else ""


class StreamDispatcher(Dispatcher):
    """The scheduling core with the CUDA-stream executor. Every iteration
    ends with each stream idle: no deferred tail (``parallel.defer_update``
    is the CPU event dispatcher's)."""

    def __init__(self, graph, runtime=None, executor=None, **kw):
        kw["defer_tail"] = False
        super().__init__(graph, executor or StreamExecutor(runtime), **kw)
