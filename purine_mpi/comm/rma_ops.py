"""One-sided comm ops: a producer puts a blob into its consumer's window
region (comm/windows.py) and notifies it; the consumer waits for the write.
They replace a Send/Recv pair where ``parallel.transport`` gives a pair of
ranks a window (parallel/one_sided.py), and follow the rules of the other
comm ops (comm/ops.py): ``seq`` fixed at build time, posted and tested only
by ``runtime/comm_progress.CommPoster`` (the one place that drives MPI),
a ``Pending`` whose ``describe()`` the stall watchdog prints.

Who releases the region (attr ``released_by``, the same on both sides):

- ``"release"`` (the default; parallel/one_sided.py, the parameter
  servers): a Release op after every use of y (or the server loop) adds 1
  to the producer's word ``free``; the k-th Put waits for ``free`` to
  reach k - 1 (the consumer is done with write k - 1), so a producer never
  waits for the consumer's next iteration to begin;
- ``"wait"``: the consumer's k-th WaitWrite, when it runs (y may be
  written then), adds 1 to ``free``; the k-th Put waits for k (no Release
  op needed, but the producer waits for the consumer's next run).

Put        ins [x]  outs []    attrs seq, peer, region, written, free, (released_by)
    waits until the consumer has released the region (above), then writes
    x into ``region`` of rank ``peer`` (a store into shared memory, or
    ``MPI_Rput`` into an RMA window, tested, then ``Win_flush``) and adds 1
    to the consumer's word ``written``. Nothing is written when x already
    *is* the consumer's memory (zero copy).
WaitWrite  ins []   outs [y]   attrs seq, peer, region, written, free, shape, dtype, (released_by)
    its k-th run (released by ``"wait"``: releases the region, then) waits
    until ``written`` reaches k. y *is* the region (the workspace places
    it there), so nothing is copied, unless a layout demands it (y views a
    micro-batch buffer, or lives on a GPU without CUDA IPC): then one
    copy, counted.
Release    ins [y]  outs []    attrs seq, peer, region, free
    runs once every op that reads or writes y this iteration is done
    (control edges from them): adds 1 to the producer's word ``free``, so
    the next Put may write the region. The producer waits only for the
    consumer's real use of the region, not for the consumer's iteration.
WaitFree   ins []   outs []    attrs seq, peer, region, free
    on the producer, before the op that computes x straight into the
    consumer's region (one node, zero copy): its k-th run waits until
    ``free`` reaches k - 1 (released by ``"release"``; k by ``"wait"``).

Passive-target epochs never deadlock with the rest of the graph's
communication: the windows are locked once (``Lock_all``) at start-up, so
a Put or a WaitWrite only ever waits for its peer's notify, which the peer
posts without waiting for anything but its own dependencies -- the same
waits a Send/Recv pair has. Counters per op: ``bytes_put`` (moved by MPI
one-sided), ``bytes_copied`` (copied by the CPU), for reports.
"""
import time

import numpy as np

from ..base.errors import ShapeError
from ..ops.registry import Pending, register
from .ops import CommKernel, _mb, comm_delay
from .windows import find_windows

_ONE_SIDED = {"Put", "WaitWrite", "Release", "WaitFree"}


def is_one_sided(op):
    return op.op_type in _ONE_SIDED


class RMAPending(Pending):
    """A one-sided op in flight: ``step()`` advances it (returns True when
    done); ``describe`` says what it waits for. ``spans``: its parts, as
    ``(kind, t_start, t_end, args)`` on ``time.perf_counter``'s clock --
    kinds ``put``, ``get``, ``notify``, ``wait_free``, ``wait_write`` --
    which the trace shows as events ``<op>:<kind>`` of category ``rma``."""

    def __init__(self, step, describe, spans=None):
        self._step = step
        self._describe = describe
        self.spans = spans if spans is not None else []

    def test(self):
        return self._step()

    def finish(self):
        comm_delay()()

    def describe(self):
        return self._describe()


def _ahead(attrs):
    """Writes a producer may be ahead of the releases: 1 when Release ops
    release (``released_by: release``, the default), 0 when the WaitWrite
    does (``wait``)."""
    by = attrs.get("released_by", "release")
    if by not in ("wait", "release"):
        raise ValueError(f"released_by must be 'wait' or 'release', got {by!r}")
    return 1 if by == "release" else 0


def _started(step, describe, spans):
    """The Pending of a one-sided op, advanced once at its post (a Put whose
    region is free writes at once, as an Isend would send)."""
    done = step()
    return RMAPending((lambda: True) if done else step, describe, spans)


class _WindowKernel(CommKernel):
    seq_ordered = False  # matched by region and notify words, posted as soon as ready
    #: a sink (Put, Publish) takes one input blob; a source (WaitWrite, Get)
    #: takes none and makes one blob of the attrs' shape and dtype
    sink = source = False

    @classmethod
    def infer(cls, attrs, ins):
        if cls.sink and len(ins) != 1:
            raise ShapeError(f"{cls.op_type} takes exactly one input blob")
        if cls.source and ins:
            raise ShapeError(f"{cls.op_type} takes no input blobs")
        if cls.source:
            return [(tuple(attrs["shape"]), str(np.dtype(attrs.get("dtype", "float32"))))]
        return []

    def _windows(self):
        win = find_windows(self.attrs["region"])
        if win is None:
            raise RuntimeError(f"window region '{self.attrs['region']}' is not allocated "
                               "(parallel/one_sided.py allocates the windows at start-up)")
        return win

    def _what(self):
        return (f"window {self.win.where(self.attrs['region'])} region "
                f"{self.attrs['region']} seq {self.attrs.get('seq', '?')}")

    def setup(self, ins, outs):
        """What every window op holds: its windows, its run count and byte
        counters; then the kernel's own ``prepare``."""
        self.win = self._windows()
        self.runs = 0
        self.bytes_put = self.bytes_copied = self.bytes_got = 0
        self.prepare(ins, outs)
        self._setup_done = True

    def prepare(self, ins, outs):
        """A kernel's own set-up, after the windows are found."""

    def _begin(self, ins, outs):
        """The head of every ``run``: the set-up if nothing ran it, the
        ``PURINE_COMM_DELAY`` jitter, one more run. Returns the run's number."""
        if not getattr(self, "_setup_done", False):
            self.setup(ins, outs)
        comm_delay()()
        self.runs += 1
        return self.runs


@register
class Put(_WindowKernel):
    """x -> rank ``peer``'s window region, then a notify. A sink."""

    op_type = "Put"
    sink = True

    def prepare(self, ins, outs):
        view = self.win.view(self.attrs["region"])
        #: x is the consumer's memory itself: nothing to write
        self.zero_copy = view is not None and np.shares_memory(view, ins[0])

    def run(self, ins, outs):
        k, x = self._begin(ins, outs), ins[0]
        t_post = time.perf_counter()
        state = {"stage": "free", "req": None, "t": t_post}
        region, win = self.attrs["region"], self.win
        spans = []

        def step():
            if state["stage"] == "free":
                if win.notified(self.attrs["free"]) < k - _ahead(self.attrs):
                    return False
                now = time.perf_counter()
                spans.append(("wait_free", t_post, now, {"put": k}))
                state["t"] = now
                copied = moved = 0
                if not self.zero_copy:
                    before = win.bytes_copied
                    state["req"] = win.rput(region, np.asarray(x))
                    copied = win.bytes_copied - before
                    moved = x.nbytes if state["req"] is not None else 0
                    self.bytes_copied += copied
                    self.bytes_put += moved
                state["bytes"] = {"bytes_put": moved, "bytes_copied": copied}
                state["stage"] = "write"
            if state["stage"] == "write":
                req = state["req"]
                if req is not None and not req.Test():
                    return False
                t0 = time.perf_counter()
                win.notify(self.attrs["written"])  # flushes the data first
                t1 = time.perf_counter()
                spans.append(("put", state["t"], t0, state["bytes"]))
                spans.append(("notify", t0, t1, {"word": self.attrs["written"]}))
                state["stage"] = "done"
            return True

        def describe():
            doing = {"free": "waiting for the consumer to release its region",
                     "write": "writing", "done": "done"}[state["stage"]]
            return (f"Put {self.op.inputs[0]} {_mb(x.nbytes)} to rank {self.attrs['peer']} "
                    f"({doing}, put #{k}) {self._what()}")

        return _started(step, describe, spans)


@register
class WaitWrite(_WindowKernel):
    """y <- what rank ``peer`` put into this rank's region. A source."""

    op_type = "WaitWrite"
    source = True

    def prepare(self, ins, outs):
        self.local = self.win.local(self.attrs["region"])
        #: y lies elsewhere (a layout that demands it): one copy per write
        self.copy = not np.shares_memory(self.local, outs[0])

    def run(self, ins, outs):
        k, y, win = self._begin(ins, outs), outs[0], self.win
        spans = []
        if not _ahead(self.attrs):  # released by this op: the producer may write now
            t0 = time.perf_counter()
            win.notify(self.attrs["free"])
            spans.append(("notify", t0, time.perf_counter(), {"word": self.attrs["free"]}))
        t1 = time.perf_counter()
        state = {"seen": 0}

        def step():
            state["seen"] = win.notified(self.attrs["written"])
            if state["seen"] < k:
                return False
            copied = 0
            if self.copy:
                y[...] = self.local
                copied = self.local.nbytes
                self.bytes_copied += copied
            spans.append(("wait_write", t1, time.perf_counter(), {"write": k,
                                                                  "bytes_copied": copied}))
            return True

        def describe():
            return (f"WaitWrite {self.op.outputs[0]} {_mb(self.local.nbytes)} from rank "
                    f"{self.attrs['peer']} (write #{k}, {state['seen']} seen) {self._what()}")

        return _started(step, describe, spans)


@register
class Release(_WindowKernel):
    """Tell rank ``peer`` that this rank is done with region ``region``
    (its readers ran): the next Put may write it. Done at once."""

    op_type = "Release"

    def run(self, ins, outs):
        self._begin(ins, outs)
        t0 = time.perf_counter()
        self.win.notify(self.attrs["free"])
        done = RMAPending(lambda: True, lambda: f"Release {self._what()}",
                          [("notify", t0, time.perf_counter(), {"word": self.attrs["free"]})])
        return done


@register
class WaitFree(_WindowKernel):
    """Wait until rank ``peer`` released region ``region`` after the last
    write: the op that computes into it may run."""

    op_type = "WaitFree"

    def run(self, ins, outs):
        k, win, t0 = self._begin(ins, outs), self.win, time.perf_counter()
        spans, state = [], {"seen": 0}

        def step():
            state["seen"] = win.notified(self.attrs["free"])
            if state["seen"] < k - _ahead(self.attrs):
                return False
            spans.append(("wait_free", t0, time.perf_counter(), {"put": k}))
            return True

        def describe():
            return (f"WaitFree before computing into rank {self.attrs['peer']}'s region "
                    f"(release #{k - _ahead(self.attrs)}, {state['seen']} seen) "
                    f"{self._what()}")

        return _started(step, describe, spans)
