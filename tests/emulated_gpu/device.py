"""The simulated device behind the emulated streams: streams are queues run
in a random interleaving that respects only the recorded events and waits;
stream capture, graphs and their replays as CUDA has them."""
import copy
import random
import sys
import threading
import time
from collections import deque

from purine_mpi.graph.core import Location
from purine_mpi.runtime.workspace import Workspace

from . import capture


class SimEvent:
    def __init__(self, stream):
        self.stream, self.done, self.time = stream, False, None
        #: recorded on a capturing stream: the capture and the nodes before it
        self.capture, self.nodes = None, frozenset()


class SimStream:
    """A stream with CuPy's capture API (``begin_capture``, ``end_capture``,
    ``is_capturing``)."""

    def __init__(self, key, runtime=None):
        self.key, self.queue, self.runtime = key, deque(), runtime
        self.capture = None     # the SimCapture it belongs to, while capturing
        self.frontier = set()   # capture nodes the next captured work follows
        self.recorder = None    # the device work of the launch being captured
        self.ptr = capture.register_stream(self)  # cudaStream_t

    def begin_capture(self, mode=None):
        self.runtime._begin_capture(self)

    def end_capture(self):
        return self.runtime._end_capture(self)

    def is_capturing(self):
        return self.capture is not None


class SimCapture:
    def __init__(self, origin):
        self.origin, self.streams = origin, {origin}
        self.nodes, self.deps = [], []  # (name, fn), set of node indices


class SimGraph:
    """A captured graph: nodes (kernel launches) and their dependencies;
    ``launch(stream)`` queues one replay, whose nodes then run in any order
    the dependencies allow (interleaved with the other streams)."""

    def __init__(self, runtime, capture):
        self.runtime = runtime
        self.nodes = list(capture.nodes)
        self.deps = [frozenset(d) for d in capture.deps]
        self.launches = 0

    def launch(self, stream=None):
        self.runtime._launch_graph(self, stream)

    def names(self):
        return [n for n, _ in self.nodes]

    def ancestors(self, i):
        seen, todo = set(), list(self.deps[i])
        while todo:
            j = todo.pop()
            if j not in seen:
                seen.add(j)
                todo.extend(self.deps[j])
        return seen

    def ordered(self, a, b):
        """Whether the nodes named ``a`` and ``b`` are ordered (a path joins them)."""
        ia, ib = self.names().index(a), self.names().index(b)
        return ia in self.ancestors(ib) or ib in self.ancestors(ia)


class SimulatedRuntime:
    """A device with asynchronous streams, for the stream dispatcher.

    ``launch`` queues work on a stream; nothing runs until the host
    synchronises (``sync_event``, ``sync_streams``, ``sync_devices``) or polls
    (``query``, which runs a few random steps). Each step runs the head of a
    randomly chosen stream whose head is not a wait on an unrecorded event,
    or a ready node of a graph being replayed, so streams interleave in any
    order the events allow. ``calls`` logs what the dispatcher asked for.

    Stream capture as CUDA (and CuPy) has it: work queued on a capturing
    stream is recorded, not run; an event recorded there marks a point of
    the capture, and a stream that waits on it joins the capture; every
    joined stream must be joined back into the origin before
    ``end_capture``; a capturing stream cannot wait on an event recorded
    outside the capture, and nobody may query or synchronise a captured
    event or synchronise while a capture is open. ``SimGraph.launch``
    replays the recorded launches (the kernels run again)."""

    def __init__(self, seed=0, poll_steps=(0, 3), stalled_polls=0, faithful=None):
        self.rng = random.Random(seed)
        #: capture as CUDA does: an op's host code runs once, at capture, and
        #: only its device work (tests/capture.py) becomes the graph node;
        #: on by default with the emulated CuPy, whose arrays record that work
        #: (plain host arrays cannot: their kernels are recorded whole instead)
        self.faithful = getattr(sys.modules.get("cupy"), "_emulated", False) \
            if faithful is None else faithful
        self.poll_steps = poll_steps
        self.stalled_polls = stalled_polls  # the first polls see no progress
        self.lock = threading.RLock()
        self.streams = {}
        self.calls = []
        self.log = []  # ("device"|"host", op name) in execution order
        self.graphs = []  # every SimGraph captured
        self._running = []  # [stream, graph, done node set] of replays in progress

    def stream(self, device, thread):
        with self.lock:
            return self.streams.setdefault((device, thread),
                                           SimStream((device, thread), self))

    def launch(self, device, stream, fn, name=None):
        if self.faithful:  # the host code runs now; its device work runs later
            stream.recorder = []
            try:
                with capture.current(stream):
                    fn()
                work = stream.recorder
            finally:
                stream.recorder = None
            fn = replay_of(work, name, self.log)
        with self.lock:
            if stream.capture is not None:
                cap = stream.capture
                cap.nodes.append((name, fn))
                cap.deps.append(set(stream.frontier))
                stream.frontier = {len(cap.nodes) - 1}
                self.calls.append(("capture_launch", stream.key, name))
                return
            stream.queue.append(("run", on_stream(stream, fn)))
            self.calls.append(("launch", stream.key))

    def call(self, device, stream, fn):
        with self.lock:
            if stream.capture is not None:
                raise RuntimeError("host work on a capturing stream")
            self.calls.append(("call", stream.key))
        with capture.current(stream):
            return fn()  # host work: now, with the stream current

    def record(self, device, stream, timing=False):
        event = SimEvent(stream)
        with self.lock:
            if stream.capture is not None:
                if timing:
                    raise RuntimeError("a timing event inside a capture")
                event.capture, event.nodes = stream.capture, frozenset(stream.frontier)
                self.calls.append(("capture_record", stream.key, event))
                return event
            stream.queue.append(("record", event))
            self.calls.append(("record", stream.key, event))
        return event

    def wait(self, stream, event):
        with self.lock:
            if event.capture is not None:
                if stream.capture is None:  # joins the capture
                    stream.capture = event.capture
                    event.capture.streams.add(stream)
                    stream.frontier = set(event.nodes)
                elif stream.capture is event.capture:
                    stream.frontier |= event.nodes
                else:
                    raise RuntimeError("waits on an event of another capture")
                self.calls.append(("capture_wait", stream.key, event))
                return
            if stream.capture is not None:
                raise RuntimeError("cudaErrorStreamCaptureIsolation: a capturing stream "
                                   "waits on an event recorded outside the capture")
            stream.queue.append(("wait", event))
            self.calls.append(("wait", stream.key, event))

    def query(self, event):
        self._not_captured(event)
        steps = self.rng.randint(*self.poll_steps)
        with self.lock:
            if self.stalled_polls > 0:
                self.stalled_polls -= 1
                steps = 0
        for _ in range(steps):
            if not self._step(strict=False):
                break
        with self.lock:
            self.calls.append(("query", event, event.done))
        return event.done

    def sync_event(self, event):
        self._not_captured(event)
        with self.lock:
            self.calls.append(("sync_event", event))
        while not event.done:
            self._step()

    def sync_devices(self, devices):
        self._no_capture_open()
        with self.lock:
            self.calls.append(("sync_devices",))
        self._drain()

    def sync_stream(self, stream):
        """``stream.synchronize()``: until its queued work has run."""
        capture.refuse_if_capturing(capture.CUDARuntimeError,
                                        capture.SYNC_REFUSED, stream)
        while stream.queue:
            self._step()

    def sync_streams(self):
        self._no_capture_open()
        with self.lock:
            self.calls.append(("sync_streams",))
        self._drain()

    def elapsed_ms(self, start, end):
        return (end.time - start.time) * 1e3

    def swaps_copies(self):
        return False

    def host_write(self, devices, fn):
        self._no_capture_open()
        with self.lock:
            self.calls.append(("host_write",))
        self._drain()
        fn()

    def prepare_capture(self, device, streams):
        if self.faithful:  # the emulated CuPy: what CudaRuntime does
            from purine_mpi.gpu import blas
            for stream in streams:
                blas.reserve(stream)

    # ----------------------------------------------------- stream capture
    def begin_capture(self, device, stream):
        stream.begin_capture()

    def end_capture(self, device, stream):
        return stream.end_capture()

    def abort_capture(self, device, stream):
        with self.lock:
            cap = stream.capture
            if cap is not None:
                for s in cap.streams:
                    s.capture, s.frontier = None, set()

    def launch_graph(self, device, graph, stream):
        graph.launch(stream)

    def capture_memory(self, device):
        import contextlib
        return contextlib.nullcontext(), None

    def _begin_capture(self, stream):
        with self.lock:
            if stream.capture is not None:
                raise RuntimeError("the stream is capturing already")
            stream.capture, stream.frontier = SimCapture(stream), set()
            self.calls.append(("begin_capture", stream.key))

    def _end_capture(self, stream):
        with self.lock:
            cap = stream.capture
            if cap is None or cap.origin is not stream:
                raise RuntimeError("end_capture on a stream that did not begin the capture")
            probe = SimGraph(self, cap)
            joined = set(stream.frontier)
            for i in list(joined):
                joined |= probe.ancestors(i)
            for s in cap.streams:
                if s is not stream and not s.frontier <= joined:
                    raise RuntimeError(f"cudaErrorStreamCaptureUnjoined: stream {s.key} "
                                       "was not joined back into the origin")
            for s in cap.streams:
                s.capture, s.frontier = None, set()
            self.graphs.append(probe)
            self.calls.append(("end_capture", stream.key, probe))
            return probe

    def _launch_graph(self, graph, stream):
        with self.lock:
            if stream.capture is not None:
                raise RuntimeError("a graph launched into a capture")
            stream.queue.append(("graph", graph))
            graph.launches += 1
            self.calls.append(("launch_graph", stream.key, graph))

    def _not_captured(self, event):
        if event.capture is not None:
            raise capture.CUDARuntimeError(capture.SYNC_REFUSED)

    def _no_capture_open(self):
        if any(s.capture is not None for s in self.streams.values()):
            raise capture.CUDARuntimeError(capture.SYNC_REFUSED)

    # -------------------------------------------------------- the device
    def _step(self, strict=True):
        with self.lock:
            running = {id(r[0]) for r in self._running}
            actions = []
            for s in sorted(self.streams.values(), key=lambda s: str(s.key)):
                if not s.queue or id(s) in running:
                    continue
                kind, item = s.queue[0]
                if kind != "wait" or item.done:
                    actions.append(("stream", s))
            for r in self._running:
                stream, graph, done, started = r
                for i, d in enumerate(graph.deps):
                    if i not in done and i not in started and d <= done:
                        actions.append(("node", r, i))
            if not actions:
                if strict and any(s.queue for s in self.streams.values()):
                    raise RuntimeError("simulated device deadlock: every stream waits")
                return False
            action = self.rng.choice(actions)
            if action[0] == "node":
                r, i = action[1], action[2]
                r[3].add(i)
                r[1].nodes[i][1]()
                r[2].add(i)
                if len(r[2]) == len(r[1].nodes):  # the replay is over
                    self._running.remove(r)
                    r[0].queue.popleft()
                    self.calls.append(("graph_done", r[0].key, r[1]))
                return True
            s = action[1]
            kind, item = s.queue[0]
            if kind == "graph":
                if item.nodes:
                    self._running.append([s, item, set(), set()])
                else:
                    s.queue.popleft()
                return True
            s.queue.popleft()
            if kind == "run":
                item()
            elif kind == "record":
                item.done, item.time = True, time.perf_counter()
            return True

    def _drain(self):
        while self._step():
            pass


def replay_of(work, name, log):
    """The device work recorded for a launch (run by the stream, or by each
    replay of the graph it was captured into); logs ``name`` when it runs."""
    def replay():
        if name is not None:
            log.append(name)
        for piece in work:
            piece()
    return replay


def on_stream(stream, fn):
    """Queued work that runs with its stream current (as CuPy's ``with stream``)."""
    def run():
        with capture.current(stream):
            fn()
    return run


def log_kernels(dispatcher, runtime):
    """Make every kernel append its op name to ``runtime.log`` when it runs
    (a faithful runtime logs a launch when its recorded device work runs)."""
    for name, k in dispatcher.kernels.items():
        def logged(ins, outs, _run=k.run, _name=name):
            if not capture.recording():
                runtime.log.append(_name)
            return _run(ins, outs)
        k.run = logged


def check_order(log, graph, skip=()):
    """Every op ran once, after every op it depends on."""
    deps = graph.dependencies()
    pos = {}
    for i, name in enumerate(log):
        assert name not in pos, f"op {name} ran twice in one iteration"
        pos[name] = i
    assert set(pos) == set(graph.ops) - set(skip)
    for n, preds in deps.items():
        for p in preds:
            assert pos[p] < pos[n], f"op {n} ran before its producer {p}"


def cpu_workspace(graph, **kw):
    """A workspace of host arrays for a graph placed on a (simulated) GPU."""
    cpu = copy.deepcopy(graph)
    for b in cpu.blobs.values():
        b.location = Location(b.location.rank, -1, b.location.ip)
    return Workspace(cpu, **kw)
