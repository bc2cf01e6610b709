"""One-sided comm ops: a producer puts a blob into its consumer's window
region (comm/windows.py) and notifies it; the consumer waits for the write.
They replace a Send/Recv pair where ``parallel.transport`` gives a pair of
ranks a window (parallel/one_sided.py), and follow the rules of the other
comm ops (comm/ops.py): ``seq`` fixed at build time, posted and tested only
by ``runtime/comm_progress.CommPoster`` (the one place that drives MPI),
a ``Pending`` whose ``describe()`` the stall watchdog prints.

Put        ins [x]  outs []    attrs seq, peer, region, written, free
    waits until the consumer has released its region for this iteration
    (notify word ``free``, owned by this rank, reaches the count of this
    Put's runs), then writes x into ``region`` of rank ``peer`` (a store
    into shared memory, or ``MPI_Rput`` into an RMA window, tested, then
    ``Win_flush``) and adds 1 to the consumer's word ``written``. Nothing
    is written when x already *is* the consumer's memory (zero copy).
WaitWrite  ins []   outs [y]   attrs seq, peer, region, written, free, shape, dtype
    run when y may be written (at the start of an iteration, or when the
    micro-batch buffer it writes is free): releases the region to the
    producer (adds 1 to the producer's word ``free``), then waits until
    ``written`` reaches the count of its runs. y *is* the region (the
    workspace places it there), so nothing is copied, unless a layout
    demands it (a device blob without CUDA IPC): then one copy.

Passive-target epochs never deadlock with the rest of the graph's
communication: the windows are locked once (``Lock_all``) at start-up, so
a Put or a WaitWrite only ever waits for its peer's notify, which the peer
posts without waiting for anything but its own dependencies -- the same
waits a Send/Recv pair has. Counters per op: ``bytes_put`` (moved by MPI
one-sided), ``bytes_copied`` (copied by the CPU), for reports.
"""
import numpy as np

from ..base.errors import ShapeError
from ..ops.registry import Pending, register
from .ops import CommKernel, _mb, comm_delay
from .windows import find_windows

_ONE_SIDED = {"Put", "WaitWrite"}


def is_one_sided(op):
    return op.op_type in _ONE_SIDED


class RMAPending(Pending):
    """A one-sided op in flight: ``step()`` advances it (returns True when
    done); ``describe`` says what it waits for."""

    def __init__(self, step, describe):
        self._step = step
        self._describe = describe

    def test(self):
        return self._step()

    def finish(self):
        comm_delay()()

    def describe(self):
        return self._describe()


class _WindowKernel(CommKernel):
    seq_ordered = False  # matched by region and notify words, posted as soon as ready

    def _windows(self):
        win = find_windows(self.attrs["region"])
        if win is None:
            raise RuntimeError(f"window region '{self.attrs['region']}' is not allocated "
                               "(parallel/one_sided.py allocates the windows at start-up)")
        return win

    def _what(self):
        return (f"window {self.win.where(self.attrs['region'])} region "
                f"{self.attrs['region']} seq {self.attrs.get('seq', '?')}")


@register
class Put(_WindowKernel):
    """x -> rank ``peer``'s window region, then a notify. A sink."""

    op_type = "Put"

    @classmethod
    def infer(cls, attrs, ins):
        if len(ins) != 1:
            raise ShapeError("Put takes exactly one input blob")
        return []

    def setup(self, ins, outs):
        self.win = self._windows()
        self.runs = 0
        self.bytes_put = self.bytes_copied = 0
        view = self.win.view(self.attrs["region"])
        #: x is the consumer's memory itself: nothing to write
        self.zero_copy = view is not None and np.shares_memory(view, ins[0])
        self._setup_done = True

    def run(self, ins, outs):
        if not getattr(self, "_setup_done", False):
            self.setup(ins, outs)
        comm_delay()()
        self.runs += 1
        k, x = self.runs, ins[0]
        state = {"stage": "free", "req": None}
        region, win = self.attrs["region"], self.win

        def step():
            if state["stage"] == "free":
                if win.notified(self.attrs["free"]) < k:
                    return False
                if not self.zero_copy:
                    before = win.bytes_copied
                    state["req"] = win.rput(region, np.asarray(x))
                    self.bytes_copied += win.bytes_copied - before
                    if state["req"] is not None:
                        self.bytes_put += x.nbytes
                state["stage"] = "write"
            if state["stage"] == "write":
                req = state["req"]
                if req is not None and not req.Test():
                    return False
                win.notify(self.attrs["written"])  # flushes the data first
                state["stage"] = "done"
            return True

        def describe():
            doing = {"free": "waiting for the consumer to release its region",
                     "write": "writing", "done": "done"}[state["stage"]]
            return (f"Put {self.op.inputs[0]} {_mb(x.nbytes)} to rank {self.attrs['peer']} "
                    f"({doing}, put #{k}) {self._what()}")

        return RMAPending(step, describe)


@register
class WaitWrite(_WindowKernel):
    """y <- what rank ``peer`` put into this rank's region. A source."""

    op_type = "WaitWrite"

    @classmethod
    def infer(cls, attrs, ins):
        if ins:
            raise ShapeError("WaitWrite takes no input blobs")
        return [(tuple(attrs["shape"]), str(np.dtype(attrs.get("dtype", "float32"))))]

    def setup(self, ins, outs):
        self.win = self._windows()
        self.runs = 0
        self.bytes_put = self.bytes_copied = 0
        self.local = self.win.local(self.attrs["region"])
        #: y lies elsewhere (a layout that demands it): one copy per write
        self.copy = not np.shares_memory(self.local, outs[0])
        self._setup_done = True

    def run(self, ins, outs):
        if not getattr(self, "_setup_done", False):
            self.setup(ins, outs)
        comm_delay()()
        self.runs += 1
        k, y, win = self.runs, outs[0], self.win
        win.notify(self.attrs["free"])  # the producer may write the region now
        state = {"seen": 0}

        def step():
            state["seen"] = win.notified(self.attrs["written"])
            if state["seen"] < k:
                return False
            if self.copy:
                y[...] = self.local
                self.bytes_copied += self.local.nbytes
            return True

        def describe():
            return (f"WaitWrite {self.op.outputs[0]} {_mb(self.local.nbytes)} from rank "
                    f"{self.attrs['peer']} (write #{k}, {state['seen']} seen) {self._what()}")

        return RMAPending(step, describe)
