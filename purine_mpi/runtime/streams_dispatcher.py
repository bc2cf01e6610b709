"""The CUDA-stream dispatcher: Purine's event-driven engine on GPUs.

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
  the poster's device hook ``_comm_gate``, which queries the producers'
  events (never blocking, so the transfers in flight keep moving); the MPI
  call is posted only once its input is complete on the device, collectives
  still in ``seq`` order. With a non-CUDA-aware MPI its buffers are staged
  through page-locked mirrors planned once (``comm/device.HostStage``),
  asynchronously: the device-to-host copies are queued on the device's
  ``stage_d2h`` stream after the producers' events, and the post waits
  (polled) for the event after them; the epilogue (the host-to-device copy
  back, the 1/N scale) is queued on the device's ``comm`` stream, and GPU
  consumers wait on an event recorded after it. No synchronous
  ``get``/``set``.

The host synchronises with the devices only where it must: before a comm or
host op reads device memory, at the start of an iteration (host writes made
outside the dispatcher -- the iteration counter, a loaded checkpoint -- went
to CuPy's default stream, which these non-blocking streams do not wait for)
and at its end (the caller reads the sinks: the loss, the weights).

Host<->device ``Copy`` ops (inserted by ``purine_mpi.gpu.placement``) run on
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
device (tests/test_gpu_backend.py).

Layer: dispatch (docs/DESIGN.md); may import the foundation, devices, data,
ops, graph, job and composition layers below it, and its own.
"""
import dataclasses
import time

import numpy as np

from ..backend import get_xp
from ..errors import GraphError, OpError
from ..graph.core import Graph
from ..kernels import get_kernel_class
from ..ops.registry import Pending
from .cuda_runtime import CudaRuntime, HostDeviceCopy
from .dispatcher import EventDispatcher
from .staging import HostStaging

#: the stream a device's communication ops queue their device work on
COMM_STREAM = "comm"
#: the stream the per-iteration timing origin is recorded on (profiling)
ORIGIN_STREAM = "origin"


def op_device(graph, op):
    """The GPU an op runs on: its location's device, else the device its
    blobs live on (-1: a host op). An op touching two GPUs is an error."""
    if op.location.device is not None and op.location.device >= 0:
        return op.location.device
    devices = {graph.blobs[graph.storage_root(b)].location.device for b in op.inputs + op.outputs}
    devices = sorted(d for d in devices if d is not None and d >= 0)
    if len(devices) > 1:
        raise GraphError(f"op '{op.name}' ({op.op_type}) reads or writes blobs on GPUs "
                         f"{devices}; an op runs on one device: insert a Copy between them")
    return devices[0] if devices else -1


def stream_thread_name(device, thread):
    """The worker-thread (and trace ``tid``) name of a GPU stream."""
    return f"gpu{device}:{thread}"


class StreamDispatcher(HostStaging, EventDispatcher):
    """Event-driven dispatcher whose GPU ops run on CUDA streams (see the
    module docstring). Ops on the CPU behave as in ``EventDispatcher``; a
    graph without GPU ops runs exactly as there."""

    def __init__(self, graph, runtime=None, **kw):
        keys = {}
        for op in graph.ops.values():
            device = op_device(graph, op)
            if device < 0:
                keys[op.name] = None
            elif get_kernel_class(op.op_type, op.name).category == "comm":
                keys[op.name] = (device, COMM_STREAM)
            else:
                keys[op.name] = (device, op.thread)
        self.source_graph = graph
        #: op (or scheduling unit) -> its stream (device, thread); None: the host
        self._key = keys
        self._devices = sorted({k[0] for k in keys.values() if k is not None})
        self.runtime = runtime if runtime is not None else \
            (CudaRuntime() if self._devices else None)
        # every iteration ends with each stream idle: no tail runs on
        # (parallel.defer_update is the CPU event dispatcher's)
        kw["defer_tail"] = False
        super().__init__(_with_stream_threads(graph, keys), **kw)
        self._accum_roots = {op.name: sorted({self.graph.storage_root(b) for b in op.outputs})
                             for op in self.order if op.accumulate}
        self._events = {}
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
                                 and self.kernels[n].before_iteration is not None]
        self._iteration_keys = {}
        # host or comm ops read or write host memory the device may still use:
        # an iteration with any ends synchronised
        self._device_only = bool(self._devices) and not self._accum and all(
            keys[n] is not None and self.kernels[n].category != "comm" for n in graph.ops)
        self._init_staging(keys)
        self._plan_streams()
        if self.runtime is not None and self.runtime.swaps_copies():
            self._swap_copy_kernels()

    def _plan_streams(self):
        """The device-side waits, host synchronisations and comm gates
        between the scheduling units (``_deps``, after ``_build_schedule``)."""
        keys, deps = self._key, self._deps
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
            if self._is_comm[n]:
                self._gates[n] = other
            elif keys[n] is None:
                self._host_waits[n] = gpu_preds
            else:
                self._waits[n] = other
        #: units whose completion someone outside their stream waits for
        self._needs_event = {n: keys[n] is not None and any(keys[s] != keys[n] for s in succ[n])
                             for n in deps}

    # ------------------------------------------------------------ set-up
    def _swap_copy_kernels(self):
        """Copy ops between host and device memory: asynchronous copies."""
        for op in self.order:
            k = self.kernels[op.name]
            if op.op_type != "Copy" or op.accumulate or len(k.ins) != 1:
                continue
            src_dev = get_xp(k.ins[0]) is not np
            dst_dev = get_xp(k.outs[0]) is not np
            if src_dev != dst_dev:
                swapped = HostDeviceCopy(op)
                swapped.workspace, swapped.ins, swapped.outs = k.workspace, k.ins, k.outs
                self.kernels[op.name] = swapped

    def _stream(self, key):
        return self.runtime.stream(key[0], key[1])

    _thread_row = staticmethod(stream_thread_name)  # for runtime/staging

    # ------------------------------------------------------- iterations
    def _zero_accumulators(self):
        """Start of an iteration (called first by ``run``): zero the
        accumulated blobs, then let the host's own device writes land."""
        super()._zero_accumulators()
        self._events = {}
        self._acc_events = {}
        self._timed = []
        self._origin = {}
        if self.runtime is None or not self._devices:
            return
        if self._synced or self.profiler is not None:
            # host writes made outside the dispatcher (a loaded checkpoint, the
            # loss window's reset) went to CuPy's default stream
            self.runtime.sync_devices(self._devices)
            self._tail_events = {}
        if self.profiler is not None:
            for d in self._devices:
                event = self.runtime.record(d, self.runtime.stream(d, ORIGIN_STREAM), timing=True)
                self.runtime.sync_event(event)
                self._origin[d] = (event, time.perf_counter())

    def run(self, iteration=None, sync=True):
        """Launch every op once, then wait for the devices: when this
        returns, every blob holds its value of this iteration. With
        ``sync=False`` an iteration of device work alone returns once it is
        queued (call ``synchronize`` before reading a blob on the host)."""
        it = self.iteration if iteration is None else iteration
        self._start_iteration(it)
        super().run(iteration)
        if self.runtime is None or not self._devices:
            return
        if sync or not self._device_only or self.profiler is not None or self._must_sync():
            self.runtime.sync_streams()
            self._mark_synced()
            self._trace_device_times(it)
            return
        self._synced = False
        tail = dict(self._tail_events)
        for key in self._fenced:
            tail[key] = self.runtime.record(key[0], self._stream(key))
        self._tail_events = tail

    def synchronize(self):
        """Wait until the device work queued so far has finished: then every
        blob holds its value of the last iteration, and the host may write."""
        if self.runtime is not None and self._devices and not self._synced:
            self.runtime.sync_streams()
        self._mark_synced()

    def drain(self):
        super().drain()
        self.synchronize()

    def _mark_synced(self):
        """The devices are idle: the next iteration starts afresh (no tail)."""
        self._synced, self._tail_events = True, {}

    def _must_sync(self):
        """Whether this iteration must end synchronised anyway."""
        return False

    def _start_iteration(self, iteration):
        """Before any device work of ``iteration`` is queued."""
        self._fenced = set()
        self._before_iteration(iteration)

    def _before_iteration(self, iteration):
        """The ops' host work of this iteration (OpKernel.before_iteration)."""
        keys = {}
        for name in self._iteration_hooks:
            keys[name] = self.kernels[name].before_iteration(iteration, self._host_write)
        self._iteration_keys = keys

    def _host_write(self, fn):
        """Run ``fn`` (host writes into device blobs) with the devices idle."""
        self.runtime.host_write(self._devices, fn)
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
        k = self.kernels[name]
        if k.after_launch is not None:
            k.after_launch(self.runtime.record(device, stream), self.runtime)

    def _trace_device_times(self, iteration):
        if self.profiler is None or not self._origin:
            return
        for op, category, tid, device, start, end, extra in self._timed:
            origin, t_host = self._origin[device]
            t0 = t_host + self.runtime.elapsed_ms(origin, start) / 1e3
            t1 = t_host + self.runtime.elapsed_ms(origin, end) / 1e3
            self.profiler.record(op, category, t0, t1, iteration, tid, extra)

    # --------------------------------------------------------------- ops
    def _execute(self, op, tid):
        name = op.name
        if self._is_comm[name]:
            return self._execute_comm(op)
        key = self._key[name]
        if key is None:
            for p in self._host_waits[name]:
                self.runtime.sync_event(self._events[p])
            return super()._execute(op, tid)
        return self._execute_gpu(op, key, tid)

    def _execute_gpu(self, op, key, tid):
        name, device = op.name, key[0]
        rt = self.runtime
        stream = self._stream(key)
        self._fence(key, stream)
        for p in self._waits[name]:
            rt.wait(stream, self._events[p])
        k = self.kernels[name]
        t0 = time.perf_counter()
        start = rt.record(device, stream, timing=True) if self.profiler is not None else None
        try:
            if op.accumulate:
                self._accumulate(op, k, key, stream)
            else:
                rt.launch(device, stream, lambda: k.run(k.ins, k.outs), name)
        except Exception as exc:
            raise OpError(op, exc, self.rank) from exc
        self._launched(name, device, stream)
        if start is not None:
            end = rt.record(device, stream, timing=True)
            self._timed.append((op, k.category, tid, device, start, end, None))
        if self._needs_event[name]:
            self._events[name] = rt.record(device, stream)
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
        with self._accum_lock:
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
    def _comm_gate(self, name):
        """CommPoster's device hook: whether the GPU work a comm op reads
        has finished (its producers' events queried, never waited on). Until
        it has, the poster holds the op -- and the ordered ops after it, so
        MPI sees the posts in seq order -- and asks again at its next
        progress call, while the transfers in flight keep moving.

        An op whose MPI buffers are host stages of device memory opens
        when the event after its copies to them has fired
        (``runtime/staging.HostStaging``)."""
        rt = self.runtime
        if not self._needs_staging(name):
            return all(rt.query(self._events[p]) for p in self._gates[name])
        return rt.query(self._stage_out(name))

    def _execute_comm(self, op):
        """Post a comm op (the poster calls it once ``_comm_gate`` is open)."""
        t0 = time.perf_counter()
        try:
            result = self._post_comm(op)
        except Exception as exc:
            raise OpError(op, exc, self.rank) from exc
        finally:
            self._staged_out.pop(op.name, None)  # the next iteration copies again
        if result is None and self.profiler is not None:
            self.profiler.record(op, self.kernels[op.name].category, t0, time.perf_counter(),
                                 self.iteration, "comm")
        return result, t0

    def _post_comm(self, op):
        """Run the comm kernel (posting MPI); its Pending, or None when done."""
        k = self.kernels[op.name]
        key = self._key[op.name]
        if key is None:
            return k.run(k.ins, k.outs)
        result = self.runtime.call(key[0], self._stream(key), lambda: k.run(k.ins, k.outs))
        if result is None:
            self._comm_done(op)
            return None
        return _StreamPending(self, op, result)

    def _comm_done(self, op):
        key = self._key[op.name]
        if key is None:
            return
        staged = self._async_staged.get(op.name)
        if self._needs_event[op.name] or staged:
            event = self.runtime.record(key[0], self._stream(key))
            if self._needs_event[op.name]:
                self._events[op.name] = event
            if staged:
                self._copied_back[op.name] = event  # the mirror is free again


class _StreamPending(Pending):
    """A comm op's Pending whose epilogue runs on its device's comm stream;
    GPU consumers wait on the event recorded after it."""

    def __init__(self, dispatcher, op, inner):
        self.dispatcher, self.op, self.inner = dispatcher, op, inner
        self.requests = getattr(inner, "requests", ())

    def test(self):
        return self.inner.test()

    def finish(self):
        d = self.dispatcher
        key = d._key[self.op.name]
        rt, stream = d.runtime, d._stream(key)
        with d._timed_copy_back(self.op.name, key, stream):
            rt.call(key[0], stream, self.inner.finish)
        d._comm_done(self.op)

    def describe(self):
        return self.inner.describe() if hasattr(self.inner, "describe") else ""


def _with_stream_threads(graph, keys):
    """A view of ``graph`` whose GPU compute ops carry their stream's name
    as ``thread`` (one host worker per stream); blobs are shared."""
    g = Graph(graph.name)
    g.blobs = graph.blobs
    for name, op in graph.ops.items():
        key = keys[name]
        if key is not None and key[1] != COMM_STREAM:
            op = dataclasses.replace(op, thread=stream_thread_name(*key))
        g.ops[name] = op
    return g
