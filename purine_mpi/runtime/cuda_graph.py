"""CUDA graphs: the stream executor, with each run of GPU-only ops
captured once and replayed as one graph launch every later iteration
(``GraphExecutor``; ``GraphDispatcher`` is the scheduling core with it).

A static bi-graph runs the same ops on the same buffers with the same shapes
every iteration, which is what a CUDA graph wants. What cannot go into a
graph cuts the iteration into *segments*:

- host ops (the learning rate on the host), the data reader (on a GPU it
  queues the copy of whichever of its two page-locked staging buffers holds
  the batch, a different host address every other iteration: a captured copy
  would keep reading the one it was captured with; see ``ops/data.py``), and
  ops that cannot be captured: an op that draws random numbers on the host, keeps
  host-side state, reads a host blob as a kernel argument (a replay would
  keep the value it had when captured), accumulates into a shared blob, or
  whose kernel says ``capturable = False``;
- communication ops (allreduce buckets, parameter-server push/pull,
  pipeline Send/Recv): MPI cannot be captured;
- gradient buckets: a segment holds no op that only later buckets need, so
  the segment that writes a bucket ends with it and the bucket's allreduce
  is posted (by the ``CommPoster``, once the segment's CUDA event reports it
  done) while the next segments keep the GPU busy. The same holds for any
  comm op, in the order they can be posted (``stage_order``): collectives
  in ``seq`` order, point-to-point ops (pipeline Send/Recv, parameter-server
  push/pull) as soon as their inputs are complete.

``plan_segments`` makes the cut (see its docstring); each segment is one
scheduling unit of the event-driven engine, launched on a stream of its own
(``gpu<d>:graph<i>``) by the host worker ``gpu<d>:graph``, with the usual
device-side waits on the events of what it reads. Its ops keep their streams
inside the graph: at capture a fork event on the segment's origin stream
brings every stream the segment uses into the capture, cross-stream edges
inside it become event waits, and every stream joins back into the origin
before the capture ends -- so concurrent branches (the four of an inception
block) stay concurrent branches of the graph.

When: an iteration runs a segment eagerly (its ops launched one by one on
their streams, in the same fork/join structure) until it has been captured
for the arrays its ops see; the capture happens at the end of that iteration,
once every stream is idle, on streams reserved for captures, under a memory
pool of its own (what kernels allocate while captured stays the graph's).
So the first iteration is an eager warm-up (kernels compiled, library handles
created), every later one replays. Captures are keyed by the identity and
shape of the segment's arrays: a graph with another shape (a dispatcher
whose kernels were given other arrays) gets a capture of its own, up to
``MAX_CAPTURES`` per segment, then runs eagerly. The test graph's dispatcher
has its own segments and captures. A segment whose capture fails runs
eagerly from then on, and the dispatcher says so once; so does it, when it
is built, for the GPU ops that cannot be captured.

With a profiler, each segment is one trace event (category ``cuda_graph``,
on the trace row ``gpu<d>:graph``) spanning its device time, with its ops in
``args.ops`` and ``args.mode`` (``replay`` or ``eager``).
``cuda_graph: false`` in the config gives the plain stream dispatcher, with
per-op events.

All CUDA calls go through the dispatcher's ``runtime``
(``cuda_runtime.CudaRuntime``), so the capture logic is tested against
a simulated device with a stream-capture API like CuPy's
(tests/test_cuda_graph.py).
"""
import sys
import time
from collections import defaultdict

from ..base.errors import OpError
from .cuda_runtime import stream_keys
from .segments import MAX_CAPTURES, Segment, _Capture, capture_blocker, plan_segments, stage_order
from .streams_dispatcher import StreamDispatcher, StreamExecutor

#: the stream name prefix of the streams captures are recorded on
CAPTURE_STREAM = "capture"


class GraphExecutor(StreamExecutor):
    """The stream executor with CUDA-graph capture and replay (see the
    module docstring). ``log``: where the one-time notes go (default:
    standard error)."""

    def __init__(self, runtime=None, log=None):
        super().__init__(runtime)
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        #: {segment name: its Segment} (runtime/segments.py: its ops, its
        #: captures, why its capture failed), in launch order
        self.segment_plan = {}
        self._mode = {}
        self._pending_captures = []
        self._said = set()
        #: graph launches and GPU ops launched one by one, in the current and
        #: in the last complete iteration
        self._launches = self._eager_ops = 0
        self._last_counts = (0, 0)

    # ------------------------------------------------------------ planning
    def _blockers(self):
        """{GPU op: why it is not captured}."""
        core = self.core
        comm = set(core.comm_order())
        return {op.name: reason for op in core.order
                if self.streams.get(op.name) is not None and op.name not in comm
                and (reason := capture_blocker(core.graph, op, core.kernels[op.name],
                                               self.device_arrays)) is not None}

    @property
    def device_arrays(self):
        """Whether the kernels hold device arrays (``CudaRuntime.device_arrays``)."""
        return getattr(self.runtime, "device_arrays", True)

    def units(self, ops, deps):
        """Segments replace their ops as scheduling units."""
        core = self.core
        for name in list(self.streams):  # units of an earlier plan
            if name not in core.graph.ops:
                del self.streams[name]
        self.segment_plan = {}
        if self.runtime is None or not self.devices:
            return ops, deps
        order = [op.name for op in ops]
        comm_order = core.comm_order()
        unordered = [c for c in comm_order
                     if not getattr(core.kernels[c], "seq_ordered", True)]
        groups, unit = plan_segments(order, deps, self.streams,
                                     stage_order(order, deps, comm_order, unordered),
                                     self._blockers())
        segs = []
        for i, names in enumerate(groups):
            device = self.streams[names[0]][0]
            inside = set(names)
            seg = Segment(f"graph{i}", device, names,
                          [b for n in names for b in core.graph.ops[n].outputs])
            for n in names:
                seg.inner_waits[n] = sorted(p for p in deps[n] if p in inside
                                            and self.streams[p] != self.streams[n])
            for n in names:
                seg.inner_event[n] = False
            for n in names:
                for p in seg.inner_waits[n]:
                    seg.inner_event[p] = True
            seg.arg_lists = [lst for n in names for lst in (core.kernels[n].ins,
                                                             core.kernels[n].outs)]
            self.streams[seg.name] = seg.key
            self.segment_plan[seg.name] = seg
            segs.append(seg)
        unit_name = {n: segs[i].name for n, i in unit.items()}
        node_deps = defaultdict(set)
        for n in order:
            u = unit_name.get(n, n)
            node_deps[u] |= {unit_name.get(p, p) for p in deps[n]} - {u}
        nodes, placed = [], set()
        for op in ops:  # first appearance; the engine needs no stricter order
            u = unit_name.get(op.name)
            if u is None:
                nodes.append(op)
            elif u not in placed:
                placed.add(u)
                nodes.append(self.segment_plan[u])
        return nodes, {n.name: node_deps[n.name] for n in nodes}

    def planned(self):
        super().planned()
        self._note_blocked()

    def scratch_lanes(self):
        """Each GPU op's stream; a captured op's names its segment's, since
        segments not ordered by the graph replay at once on streams of their
        own (inside a graph, the ops of one capture stream stay in order)."""
        lanes = super().scratch_lanes()
        for seg in self.segment_plan.values():
            for n in seg.members:
                lanes[n] = (seg.device, seg.name, self.streams[n][1])
        return lanes

    def replans(self):
        """A new posting order changes the stages: plan (and capture) again."""
        return bool(self.segment_plan)

    def _note_blocked(self):
        blocked = self._blockers()
        if not self.segment_plan or not blocked:
            return
        parts = [f"'{n}' ({self.core.graph.ops[n].op_type}: {why})" for n, why in blocked.items()]
        more = f", and {len(parts) - 6} more" if len(parts) > 6 else ""
        self._say_once("blocked", f"cuda_graph: {len(blocked)} GPU op(s) run eagerly between "
                                  f"the captured segments: {', '.join(parts[:6])}{more}")

    def _say_once(self, key, message):
        if key not in self._said:
            self._said.add(key)
            self._log(message)

    def segments(self):
        """The current segments: [(name, [op names])], in launch order."""
        return [(s.name, list(s.members)) for s in self.segment_plan.values()]

    def report(self):
        """What is captured: the number of segments and of their ops, the
        segments captured so far, those whose capture failed ({name:
        reason}) and the GPU ops that run eagerly ({name: reason}), and
        what the captures' private memory pools hold ({device: bytes}: kept
        for the graphs' replays, outside CuPy's default pool)."""
        segs = list(self.segment_plan.values())
        launches, eager = self._last_counts
        pools = {}
        for s in segs:
            for entry in s.captures.values():
                if entry.pool is not None:   # None: a runtime without private pools
                    pools[s.device] = pools.get(s.device, 0) + int(entry.pool.total_bytes())
        return {"segments": len(segs), "captured_ops": sum(len(s.members) for s in segs),
                "captured": sum(1 for s in segs if s.captures),
                "failed": {s.name: s.failed for s in segs if s.failed is not None},
                "eager_gpu_ops": self._blockers() if segs else {},
                "launches_per_iter": launches, "eager_ops_per_iter": eager,
                "capture_pool_bytes": {str(d): n for d, n in sorted(pools.items())}}

    # ---------------------------------------------------------- iterations
    def finish(self, iteration, sync):
        """After one iteration (``sync`` as for the stream executor; an
        iteration followed by a capture ends synced): capture the segments
        that ran eagerly for arrays not captured yet, now that every stream
        is idle."""
        super().finish(iteration, sync)
        self._last_counts = (self._launches, self._eager_ops)
        for seg, sig in self._pending_captures:  # every stream is idle
            self._capture(seg, sig)
        self._pending_captures = []

    def _must_sync(self):
        return bool(self._pending_captures)

    def start(self, iteration):
        """Replay the segments captured for their current arrays (and the
        keys of their ops' ``before_iteration``), run the others eagerly."""
        super().start(iteration)  # the ops' before_iteration: their keys
        self._pending_captures = []
        self._mode = {}
        self._launches = self._eager_ops = 0
        keys = self._iteration_keys
        for seg in self.segment_plan.values():
            if seg.failed is not None:
                continue
            sig = _signature(seg) + (tuple(keys.get(m) for m in seg.members),)
            entry = seg.captures.get(sig)
            if entry is not None:
                self._mode[seg.name] = entry
            elif len(seg.captures) < MAX_CAPTURES:
                self._pending_captures.append((seg, sig))
            else:
                self._say_once(("many", seg.name),
                               f"cuda_graph: {seg.describe()} met more than {MAX_CAPTURES} "
                               "different sets of arrays; new ones run eagerly")

    def _capture(self, seg, sig):
        rt, device = self.runtime, seg.device
        origin = rt.stream(device, CAPTURE_STREAM)
        allocator, pool = rt.capture_memory(device)
        try:
            # cuBLAS handles and workspaces exist before the capture begins,
            # one per capture stream whose ops run products (``_launch_members``;
            # the origin only forks and joins them, and a stream of copies or
            # element-wise kernels alone -- the batch's upload on h2d -- calls
            # no cuBLAS: neither gets a workspace) ...
            kernels = self.core.kernels
            threads = dict.fromkeys(self.streams[n][1] for n in seg.members
                                    if kernels[n].runs_products(kernels[n].ins, kernels[n].outs))
            # ... those of the stream the graph replays on (seg.key): graphs
            # replaying at once never share a cuBLAS workspace
            rt.prepare_capture(device, [
                self._stream((device, f"{CAPTURE_STREAM}:{t}")) for t in threads],
                scope=seg.key)
            with allocator, rt.capture_scope(seg.key):
                rt.begin_capture(device, origin)
                try:
                    self._launch_members(seg, origin, capture=True)
                    graph = rt.end_capture(device, origin)
                except BaseException:
                    rt.abort_capture(device, origin)
                    raise
        except Exception as exc:
            cause = exc.cause if isinstance(exc, OpError) else exc
            seg.failed = f"{type(cause).__name__}: {cause}"
            if isinstance(exc, OpError):  # say which op refused, so it can be fixed
                seg.failed = f"op '{exc.op.name}' ({exc.op.op_type}): {seg.failed}"
            self._say_once(("failed", seg.name),
                           f"cuda_graph: could not capture {seg.describe()} ({seg.failed}); "
                           "it runs eagerly")
            return
        arrays = [a for lst in seg.arg_lists for a in lst]
        seg.captures[sig] = _Capture(graph, pool, arrays)

    # ----------------------------------------------------------- launching
    def execute(self, op, tid):
        seg = self.segment_plan.get(op.name)
        if seg is None:
            if self.streams.get(op.name) is not None:
                self._eager_ops += 1
            return super().execute(op, tid)
        rt, device = self.runtime, seg.device
        origin = self._stream(seg.key)
        self._fence(seg.key, origin)
        for p in self._waits[seg.name]:
            rt.wait(origin, self.events[p])
        t0 = time.perf_counter()
        start = rt.record(device, origin, timing=True) if self.core.profiler is not None else None
        entry = self._mode.get(seg.name)
        if entry is not None:
            try:
                rt.launch_graph(device, entry.graph, origin)
            except Exception as exc:
                raise OpError(seg, exc, self.core.rank) from exc
            self._launches += 1
            for name in seg.members:  # its ops' device work is done with the graph's
                self._launched(name, device, origin)
        else:
            self._launch_members(seg, origin, capture=False)
            self._eager_ops += len(seg.members)
        if start is not None:
            end = rt.record(device, origin, timing=True)
            self._timed.append((seg, "cuda_graph", tid, device, start, end,
                                {"ops": list(seg.members),
                                 "mode": "replay" if entry is not None else "eager"}))
        if self._needs_event[seg.name]:
            self.events[seg.name] = rt.record(device, origin)
        return None, t0

    def _launch_members(self, seg, origin, capture):
        """Launch the segment's ops on their streams, forked from ``origin``
        and joined back into it (under capture: on the capture streams)."""
        rt, device = self.runtime, seg.device
        fork = rt.record(device, origin)
        streams, events = {}, {}
        for name in seg.members:
            thread = self.streams[name][1]
            key = (device, f"{CAPTURE_STREAM}:{thread}") if capture else (device, thread)
            stream = streams.get(key)
            if stream is None:
                stream = streams[key] = self._stream(key)
                rt.wait(stream, fork)
            for p in seg.inner_waits[name]:
                rt.wait(stream, events[p])
            k = self.core.kernels[name]
            try:
                rt.launch(device, stream, lambda k=k: k.run(k.ins, k.outs), name)
            except Exception as exc:
                raise OpError(self.core.graph.ops[name], exc, self.core.rank) from exc
            if not capture:
                self._launched(name, device, stream)
            if seg.inner_event[name]:
                events[name] = rt.record(device, stream)
        for stream in streams.values():
            rt.wait(origin, rt.record(device, stream))


def _signature(seg):
    """What a capture is valid for: the identity and shape of every array
    the segment's kernels read and write."""
    arrays = [a for lst in seg.arg_lists for a in lst]
    return tuple(map(id, arrays)), tuple(a.shape for a in arrays)


class GraphDispatcher(StreamDispatcher):
    """The scheduling core with the CUDA-graph executor (a stream
    dispatcher whose GPU units are captured segments)."""

    def __init__(self, graph, runtime=None, log=None, **kw):
        super().__init__(graph, executor=GraphExecutor(runtime, log), **kw)

    def segments(self):
        """The current segments: [(name, [op names])], in launch order."""
        return self.executor.segments()


def planned_lanes(graph, cuda_graph=True, deps=None):
    """Before a dispatcher is built (``plan``): ({op: a kernel instance, not
    set up}, {op: (device, stream): its scratch lane (a captured op's names
    its segment, as ``GraphExecutor.scratch_lanes``)}, [(segment name,
    [ops])]), by the functions the executors use: ``stream_keys``, and with
    ``cuda_graph`` ``plan_segments`` on a topological order (comm ops in
    it, posted as ready; a kernel that draws random numbers counts as one
    with a generator). Host ops are left out."""
    from ..ops.catalog import get_kernel_class
    deps = deps or graph.dependencies()
    keys = stream_keys(graph)
    kernels = {}
    for name, op in graph.ops.items():
        if keys[name] is None:
            continue
        k = kernels[name] = get_kernel_class(op.op_type, name)(op)
        if k.needs_rng:
            k.rng = True
    lanes = {n: keys[n] for n in kernels}
    segments = []
    if cuda_graph and kernels:
        order = [op.name for op in graph.topo_order(deps)]
        comm = [n for n in order if n in kernels and kernels[n].category == "comm"]
        blockers = {n: why for n in order if n in kernels and n not in comm
                    and (why := capture_blocker(graph, graph.ops[n], kernels[n])) is not None}
        unordered = [c for c in comm if not getattr(kernels[c], "seq_ordered", True)]
        groups, _ = plan_segments(order, deps, keys, stage_order(order, deps, comm, unordered),
                                  blockers)
        for i, names in enumerate(groups):
            segments.append((f"graph{i}", names))
            for n in names:
                lanes[n] = (keys[n][0], f"graph{i}", keys[n][1])
    return kernels, lanes, segments
