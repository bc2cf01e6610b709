"""The simulated device behind the stand-in ``cupy.cuda``: ``Stream``,
``Event`` and ``Graph`` with CuPy's API, on a device whose streams are
queues run in a random interleaving that respects only the recorded events
and waits.

Stream capture as CUDA (and CuPy 14.2) has it: work queued on a capturing
stream is recorded, not run; an event recorded there marks a point of the
capture, and a stream that waits on it joins the capture; every joined
stream must be joined back into the origin before ``end_capture``; a
capturing stream cannot wait on an event recorded outside the capture.
An error inside a capture *invalidates* it (``cudaErrorStreamCaptureInvalidated``):
from then on ``is_capturing`` raises, as ``cudaStreamIsCapturing`` does in
CuPy's ``streamIsCapturing``, and so does every further capture call, but
the capture stays open on its streams until ``end_capture`` ends it (which
raises too). Synchronising a captured event, a capturing stream or the
device is such an error; ``Event.done`` on a captured event returns False
and invalidates the capture (CuPy 14.2 turns the query's error into
"not done"). ``Graph.launch`` replays the recorded launches.

A launch is what one ``with stream:`` block of one host thread queues
(several threads may launch onto one stream at once: each thread records
its own launch, queued when it records or waits on an event or ends, as
CUDA queues each thread's kernels in the order they come; the op's host
code runs at once, as CUDA's does; its device work is recorded and runs when the
stream gets to it, or at each replay of the graph it was captured into).
"""
import copy
import random
import threading
import time
from collections import deque

from purine_mpi.graph.core import Location
from purine_mpi.runtime.workspace import Workspace

from . import capture

INVALIDATED = ("cudaErrorStreamCaptureInvalidated: operation failed due to a previous error "
               "during capture")
ISOLATION = ("cudaErrorStreamCaptureIsolation: a capturing stream waits on an event recorded "
             "outside the capture")
UNJOINED = "cudaErrorStreamCaptureUnjoined: stream {} was not joined back into the origin"
#: two replays in flight at once whose cuBLAS calls share one workspace
SHARED_WORKSPACE = ("two CUDA graphs replay concurrently on streams {} and {} and share the "
                    "cuBLAS workspace at {:#x}: their products would overwrite each other's "
                    "scratch (cuBLAS, 'Results reproducibility')")

_active = {"device": None}
_local = threading.local()


def active_device():
    """The device that ``cupy.cuda.Stream()`` and friends act on (made on first use)."""
    if _active["device"] is None:
        _active["device"] = EmulatedDevice()
    return _active["device"]


def set_active_device(device):
    _active["device"] = device


class SimEvent:
    """``cupy.cuda.Event``."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.stream, self.recorded, self._done, self.time = None, False, False, None
        self.timing = not disable_timing
        #: recorded on a capturing stream: the capture and the nodes before it
        self.capture, self.nodes = None, frozenset()

    def record(self, stream=None):
        stream = stream or capture.current_stream() or active_device().null_stream()
        stream.device.record(self, stream)

    @property
    def done(self):
        """``cudaEventQuery``: whether the work before it has run (no
        progress is made here). On a captured event: False, and the capture
        is invalidated."""
        if self.capture is not None:
            self.capture.invalidate("cudaEventQuery on an event recorded in the capture")
            return False
        return self._done or not self.recorded

    def synchronize(self):
        if self.capture is not None:
            self.capture.invalidate("cudaEventSynchronize on a captured event")
            raise capture.CUDARuntimeError(capture.SYNC_REFUSED)
        if self.stream is not None:
            while not self._done:
                self.stream.device.step()


class SimStream:
    """``cupy.cuda.Stream`` on the simulated device."""

    def __init__(self, null=False, non_blocking=False, ptds=False, device=None, key=None):
        self.device = device or active_device()
        self.key = key
        self.queue = deque()
        self.capture = None     # the SimCapture it belongs to, while capturing
        self.frontier = set()   # capture nodes the next captured work follows
        # recorder, _named, launch_name: the launch this host thread is making
        # on this stream (``_Launch``); per thread, as several host threads may
        # launch onto one stream at once (CUDA orders their launches as they
        # come, each whole)
        self.ptr = capture.register_stream(self)  # cudaStream_t
        if key is None:
            self.key = f"stream{self.ptr:#x}"
        self.device.add_stream(self)

    # ------------------------------------------- this thread's launch
    def _launch(self):
        launches = getattr(_local, "launches", None)
        if launches is None:
            launches = _local.launches = {}
        state = launches.get(id(self))
        if state is None:
            state = launches[id(self)] = _Launch()
        return state

    recorder = property(lambda self: self._launch().recorder,
                        lambda self, v: setattr(self._launch(), "recorder", v),
                        doc="the device work of the launch this host thread is recording "
                            "on this stream (None: none)")
    _named = property(lambda self: self._launch().named,
                      lambda self, v: setattr(self._launch(), "named", v),
                      doc="its op's name went with a part of it already")
    launch_name = property(lambda self: self._launch().name,
                           lambda self, v: setattr(self._launch(), "name", v),
                           doc="the op this host thread's launch is for (the runtime says)")

    # ------------------------------------------------------- capture
    def begin_capture(self, mode=None):
        self.flush()   # work launched earlier in this ``with stream:`` runs before the capture
        self.device.begin_capture(self)

    def end_capture(self):
        self.flush()   # work launched in this ``with stream:`` so far belongs to the capture
        return self.device.end_capture(self)

    def is_capturing(self):
        cap = self.capture
        if cap is not None and cap.invalid is not None:
            raise capture.CUDARuntimeError(INVALIDATED)
        return cap is not None

    # ----------------------------------------------------- ordering
    def wait_event(self, event):
        self.device.wait(self, event)

    def record(self, event=None):
        event = event or SimEvent(disable_timing=True)
        event.record(self)
        return event

    def synchronize(self):
        if self.capture is not None:
            self.capture.invalidate("cudaStreamSynchronize on a capturing stream")
            raise capture.CUDARuntimeError(capture.SYNC_REFUSED)
        self.flush()
        while self.queue:
            self.device.step()

    # ------------------------------------------------ launches (with)
    def __enter__(self):
        depth = getattr(_local, "depth", None)
        if depth is None:
            depth = _local.depth = {}
        depth[id(self)] = depth.get(id(self), 0) + 1
        before = capture.current_stream()
        _local.before = getattr(_local, "before", []) + [before]
        capture.set_current(self)
        if depth[id(self)] == 1 and self.recorder is None and self.device.faithful:
            self.recorder, self._named = [], False
        return self

    def __exit__(self, exc_type, exc, tb):
        depth = _local.depth
        depth[id(self)] -= 1
        capture.set_current(_local.before.pop())
        if depth[id(self)] == 0 and self.device.faithful:
            if exc_type is None:
                self.flush()
            self.recorder = None
        return False

    def flush(self):
        """Queue the device work recorded so far in this launch (before an
        event is recorded or waited on, or the stream synchronised, within
        the launch: the order CUDA keeps)."""
        work = self.recorder
        if work:
            self.recorder = []
            name = None if self._named else self.launch_name   # logged once per launch
            self._named = True
            self.device.submit(self, replay_of(work, name, self.device.log))

    def submit(self, fn, name=None):
        """Queue host function ``fn`` as one launch (the emulator's own
        call, for runtimes on plain host arrays)."""
        self.device.submit(self, replay_of([fn], None, self.device.log), name)


class _Launch:
    """One host thread's launch in progress on one stream."""

    def __init__(self):
        self.recorder, self.named, self.name = None, False, None


class SimCapture:
    def __init__(self, origin):
        self.origin, self.streams = origin, {origin}
        self.nodes, self.deps = [], []  # (name, fn), set of node indices
        self.invalid = None  # why it was invalidated

    def invalidate(self, why):
        if self.invalid is None:
            self.invalid = why


class SimGraph:
    """``cupy.cuda.Graph``: the captured nodes (launches) and their
    dependencies; ``launch(stream)`` queues one replay, whose nodes then run
    in any order the dependencies allow (interleaved with the other streams)."""

    def __init__(self, device, capture):
        self.device = device
        self.nodes = list(capture.nodes)
        self.deps = [frozenset(d) for d in capture.deps]
        self.launches = 0
        #: the cuBLAS workspaces its products use (emulated nvmath tags them)
        self.workspaces = {getattr(p, "cublas_workspace") for _, fn in self.nodes
                           for p in getattr(fn, "pieces", ()) if hasattr(p, "cublas_workspace")}

    def launch(self, stream=None):
        self.device.launch_graph(self, stream or capture.current_stream())

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


class EmulatedDevice:
    """The GPU: streams, their queues, captures and replays in progress.
    Nothing runs until the host synchronises or polls; each ``step`` runs
    the head of a randomly chosen stream whose head is not a wait on an
    unrecorded event, or a ready node of a graph being replayed.

    ``faithful``: launches record their device work (the emulated CuPy's
    arrays do); otherwise the runtime queues whole host functions."""

    def __init__(self, seed=0, faithful=True):
        self.rng = random.Random(seed)
        self.faithful = faithful
        self.lock = threading.RLock()
        self.streams = []
        self.calls = []   # what the device did that the tests look at
        self.log = []     # op names, as their device work runs
        self.graphs = []  # every SimGraph captured
        self._running = []  # [stream, graph, done node set, started] of replays
        #: device time the emulated libraries' work took (ms): events read it
        self.busy_ms = 0.0
        self._null = None

    def null_stream(self):
        if self._null is None:
            self._null = SimStream(device=self, key="default")   # the legacy NULL stream
        return self._null

    def add_stream(self, stream):
        with self.lock:
            self.streams.append(stream)

    def submit(self, stream, fn, name=None):
        with self.lock:
            cap = stream.capture
            if cap is not None:
                if cap.invalid is not None:
                    raise capture.CUDARuntimeError(INVALIDATED)
                cap.nodes.append((name or stream.launch_name, fn))
                cap.deps.append(set(stream.frontier))
                stream.frontier = {len(cap.nodes) - 1}
                return
            stream.queue.append(("run", on_stream(stream, fn)))

    def record(self, event, stream):
        stream.flush()
        with self.lock:
            event.stream, event.recorded, event._done = stream, True, False
            event.capture, event.nodes = None, frozenset()
            if stream.capture is not None:
                if stream.capture.invalid is not None:
                    raise capture.CUDARuntimeError(INVALIDATED)
                if event.timing:
                    stream.capture.invalidate("a timing event recorded in a capture")
                    raise capture.CUDARuntimeError(
                        "cudaErrorStreamCaptureUnsupported: a timing event inside a capture")
                event.capture, event.nodes = stream.capture, frozenset(stream.frontier)
                return
            stream.queue.append(("record", event))

    def wait(self, stream, event):
        stream.flush()
        with self.lock:
            cap = stream.capture
            if cap is not None and cap.invalid is not None:
                raise capture.CUDARuntimeError(INVALIDATED)
            if event.capture is not None:
                if cap is None:  # joins the capture
                    stream.capture = event.capture
                    event.capture.streams.add(stream)
                    stream.frontier = set(event.nodes)
                elif cap is event.capture:
                    stream.frontier |= event.nodes
                else:
                    cap.invalidate("a wait on an event of another capture")
                    raise capture.CUDARuntimeError(ISOLATION)
                return
            if cap is not None:
                cap.invalidate("a wait on an event recorded outside the capture")
                raise capture.CUDARuntimeError(ISOLATION)
            stream.queue.append(("wait", event))

    def begin_capture(self, stream):
        with self.lock:
            if stream.capture is not None:
                raise capture.CUDARuntimeError(
                    "cudaErrorIllegalState: the stream is capturing already")
            stream.capture, stream.frontier = SimCapture(stream), set()
            self.calls.append(("begin_capture", stream.key))

    def end_capture(self, stream):
        with self.lock:
            cap = stream.capture
            if cap is None or cap.origin is not stream:
                raise capture.CUDARuntimeError(
                    "cudaErrorIllegalState: end_capture on a stream that did not begin the "
                    "capture")
            if cap.invalid is not None:  # ended, and the error said
                self._close(cap)
                raise capture.CUDARuntimeError(INVALIDATED)
            probe = SimGraph(self, cap)
            joined = set(stream.frontier)
            for i in list(joined):
                joined |= probe.ancestors(i)
            unjoined = [s for s in cap.streams if s is not stream and not s.frontier <= joined]
            self._close(cap)
            if unjoined:
                raise capture.CUDARuntimeError(UNJOINED.format(unjoined[0].key))
            self.graphs.append(probe)
            self.calls.append(("end_capture", stream.key, probe))
            return probe

    def _close(self, cap):
        for s in cap.streams:
            s.capture, s.frontier = None, set()

    def launch_graph(self, graph, stream):
        with self.lock:
            if stream.capture is not None:
                stream.capture.invalidate("a graph launched into a capture")
                raise capture.CUDARuntimeError(
                    "cudaErrorStreamCaptureUnsupported: a graph launched into a capture")
            stream.queue.append(("graph", graph))
            graph.launches += 1

    def capture_open(self):
        with self.lock:
            return any(s.capture is not None for s in self.streams)

    def synchronize(self):
        """``cudaDeviceSynchronize``: refused while a capture is open."""
        with self.lock:
            caps = {id(s.capture): s.capture for s in self.streams if s.capture is not None}
        if caps:
            for cap in caps.values():
                cap.invalidate("cudaDeviceSynchronize during the capture")
            raise capture.CUDARuntimeError(capture.SYNC_REFUSED)
        self.drain()

    # -------------------------------------------------------- running
    def step(self, strict=True):
        with self.lock:
            running = {id(r[0]) for r in self._running}
            actions = []
            for s in sorted(self.streams, key=lambda s: str(s.key)):
                if not s.queue or id(s) in running:
                    continue
                kind, item = s.queue[0]
                if kind != "wait" or item._done:
                    actions.append(("stream", s))
            for r in self._running:
                stream, graph, done, started = r
                for i, d in enumerate(graph.deps):
                    if i not in done and i not in started and d <= done:
                        actions.append(("node", r, i))
            if not actions:
                if strict and any(s.queue for s in self.streams):
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
                    self._check_workspaces(s, item)
                    self._running.append([s, item, set(), set()])
                else:
                    s.queue.popleft()
                return True
            s.queue.popleft()
            if kind == "run":
                item()
            elif kind == "record":
                item._done, item.time = True, time.perf_counter() + self.busy_ms / 1e3
            return True

    def _check_workspaces(self, stream, graph):
        for other, g, _, _ in self._running:
            if other is stream:
                continue
            self.calls.append(("concurrent_replays", other.key, stream.key))
            shared = graph.workspaces & g.workspaces
            if shared:
                raise RuntimeError(SHARED_WORKSPACE.format(other.key, stream.key, min(shared)))

    def drain(self):
        while self.step():
            pass


def replay_of(work, name, log):
    """The device work recorded for a launch (run by the stream, or by each
    replay of the graph it was captured into); logs ``name`` when it runs."""
    def replay():
        if name is not None:
            log.append(name)
        for piece in work:
            piece()
    replay.pieces = work
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
