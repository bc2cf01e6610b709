"""Communication ops: ordinary graph kernels that post non-blocking MPI.

Every comm op carries ``seq`` (int), assigned at graph build time in the same
order on every rank. The dispatcher (``runtime/comm_progress.CommPoster``)
calls ``run`` as soon as the op's inputs are ready, from whichever thread
readied them: collectives in ascending ``seq`` (MPI matches them by call
order), point-to-point ops (``seq_ordered = False``, matched by peer and
tag) at once. ``run`` posts the request(s) and returns a ``Pending`` that is
polled (``test()``) and completed (``finish()``) between ops. Comm ops have
no gradient: they are inserted after the backward pass.

Allreduce   ins [g_0 .. g_k]  outs [s_0 .. s_k]   attrs seq, (average), (group)
    s_i = sum over ranks of g_i  (or the mean, with ``average: true``);
    with ``group`` (a list of ranks) over those ranks only, on the
    sub-communicator made at start-up (``World.split_groups``).
    When the outputs are alias blobs of one flat bucket (data_parallel), the
    whole bucket is reduced in place: one Iallreduce, no packing copy.
WindowAllreduce  as Allreduce, attrs seq, window, window_ranks, (average)
    the same sum through a shared window (comm/rma_reduce.py; one node,
    parallel/dp_windows.py turns a bucket's Allreduce into one).
Send        ins [x]  outs []      attrs seq, peer, tag
    posts Isend(x) to rank ``peer``; done when MPI may reuse x.
Recv        ins []   outs [y]     attrs seq, peer, tag, shape, dtype
    posts Irecv(y) from rank ``peer`` with tag ``tag``.

For developers: ``PURINE_COMM_DELAY=MAX_MS[:SEED]`` makes every comm op
sleep a random 0..MAX_MS milliseconds before it posts and again before its
epilogue, drawn from a generator seeded by (SEED, rank) -- a reproducible
way to shake the timing of posts and completions (tests run with it: results
and completion must not change).
"""
import os
import threading
import time

import numpy as np

from ..base import env
from ..base.errors import ShapeError
from ..ops.registry import OpKernel, Pending, register
from .device import HostStage
from .world import get_world

#: comm/rma_reduce.py registers WindowAllreduce (ops/catalog.py imports it)
_COLLECTIVES = {"Allreduce", "WindowAllreduce"}
_POINT_TO_POINT = {"Send", "Recv",  # and comm/rma_ops.py's, comm/rma_pull.py's:
                   "Put", "WaitWrite", "Release", "WaitFree", "Get", "Publish"}


def is_comm_op(op):
    """True for the op types this module defines (graph passes use it)."""
    return op.op_type in _COLLECTIVES or op.op_type in _POINT_TO_POINT


def is_collective(op):
    return op.op_type in _COLLECTIVES


class _CommDelay:
    """Seeded random sleeps in comm ops (``PURINE_COMM_DELAY``, see above)."""

    def __init__(self, spec):
        self.max_s = 0.0
        self.spec = spec
        self._rng = None
        self._lock = threading.Lock()
        parsed = env.parse("PURINE_COMM_DELAY", spec)  # EnvError (a ValueError): not one
        if parsed is not None:
            self.max_s, self.seed = parsed

    def __call__(self):
        if self.max_s <= 0:
            return
        with self._lock:
            if self._rng is None:
                self._rng = np.random.default_rng([self.seed, get_world().rank])
            pause = self._rng.uniform(0.0, self.max_s)
        time.sleep(pause)


def comm_delay():
    """The process's comm-delay injector (read from the environment once)."""
    global _DELAY
    if _DELAY is None or _DELAY.spec != os.environ.get("PURINE_COMM_DELAY", ""):
        _DELAY = _CommDelay(os.environ.get("PURINE_COMM_DELAY", ""))
    return _DELAY


_DELAY = None


class MPIPending(Pending):
    """MPI requests in flight for one op; ``finish`` runs the op's epilogue
    (copy back from a host stage, scale for a mean)."""

    def __init__(self, requests, description, on_finish=None):
        self.requests = list(requests)
        self.description = description
        self._on_finish = on_finish

    def test(self):
        from mpi4py import MPI
        return MPI.Request.Testall(self.requests)

    def finish(self):
        comm_delay()()
        if self._on_finish is not None:
            self._on_finish()

    def describe(self):
        return self.description


class CommKernel(OpKernel):
    category = "comm"
    #: set by the runtime before setup(); gives flat storage of bucket blobs
    workspace = None

    #: set by the GPU dispatcher: host stages are filled by
    #: ``copy_out()``, queued on a copy stream before the post, and copied
    #: back asynchronously on the comm stream (comm/device.HostStage)
    async_staging = False

    def __init__(self, op):
        super().__init__(op)
        self.world = None

    def stages_out(self):
        """The host stages MPI reads when this op posts (device-to-host
        copies that must be done first); set up on first use."""
        if not getattr(self, "_setup_done", False):
            self.setup(self.ins, self.outs)
        return [st for st in self._stages_read() if st.staged]

    def _stages_read(self):
        return []

    def copy_out(self):
        """Queue the device-to-host copies of ``stages_out`` on the current stream."""
        for st in self.stages_out():
            st.copy_out_async()

    def _copy_back(self, stage):
        if self.async_staging:
            stage.copy_back_async()
        else:
            stage.copy_back()

    def comm(self):
        """The communicator: the world's, or for a collective with attr
        ``group`` (a list of ranks) that group's sub-communicator."""
        if self.world is None:
            self.world = get_world()
        group = self.attrs.get("group")
        if group is not None:
            return self.world.group_comm(group)
        return self.world.comm

    def _what(self):
        return f"seq {self.attrs.get('seq', '?')}"


def _mb(nbytes):
    if nbytes < 2 ** 17:
        return f"{nbytes / 2 ** 10:.1f} KB"
    return f"{nbytes / 2 ** 20:.1f} MB"


def _flat(array):
    if not array.flags.c_contiguous:
        raise ValueError("a communication buffer must be contiguous")
    return array.reshape(-1)


@register
class Allreduce(CommKernel):
    """s_i = sum over ranks of g_i (mean with ``average``). Shapes pass through."""

    op_type = "Allreduce"

    @classmethod
    def infer(cls, attrs, ins):
        return list(ins)

    def setup(self, ins, outs):
        if len(ins) != len(outs):
            raise ShapeError(f"Allreduce '{self.op.name}' needs one output per input")
        self.buffers = None
        storage = getattr(self.workspace, "storage", None)
        if storage is not None and outs:
            flat = storage(self.op.outputs[0])
            if all(_shares(flat, a) for a in list(ins) + list(outs)):
                self.buffers = [flat]  # the bucket: reduce it whole, in place
        self.in_place = [_shares(i, o) for i, o in zip(ins, outs)]
        if self.buffers is None:
            self.buffers = [_flat(o) for o in outs]
        self.stages = [HostStage(b) for b in self.buffers]
        self.nbytes = sum(b.nbytes for b in self.buffers)
        self._setup_done = True

    def _stages_read(self):
        return self.stages

    def _prepare(self, ins, outs):
        """Set up once, then the inputs into the buffers the sum runs in."""
        if not hasattr(self, "buffers"):
            self.setup(ins, outs)
        comm_delay()()
        for i, o, same in zip(ins, outs, self.in_place):
            if not same:
                o[...] = i

    def run(self, ins, outs):
        from mpi4py import MPI
        self._prepare(ins, outs)
        comm = self.comm()
        if comm.Get_size() == 1 and not self.attrs.get("always_post", False):
            return None
        requests = [comm.Iallreduce(MPI.IN_PLACE, st.buffer(copy_in=True), op=MPI.SUM)
                    for st in self.stages]
        bucket = self.attrs.get("bucket", self.op.name)
        return MPIPending(requests, f"Iallreduce {bucket} {_mb(self.nbytes)} {self._what()}",
                          self._finish)

    def _finish(self):
        for st in self.stages:
            self._copy_back(st)
        if self.attrs.get("average", False):
            size = self.comm().Get_size()
            for b in self.buffers:
                b *= 1.0 / size


def _shares(a, b):
    """Cheap same-storage test for views of one buffer (bounds overlap)."""
    try:
        return np.may_share_memory(a, b) if isinstance(a, np.ndarray) else _dev_overlap(a, b)
    except Exception:
        return False


def _dev_overlap(a, b):
    a0, b0 = a.data.ptr, b.data.ptr
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


@register
class Send(CommKernel):
    """Isend(x) to rank ``peer`` with ``tag``. A sink: no outputs."""

    op_type = "Send"
    seq_ordered = False  # matched by (peer, tag): posted as soon as x is written

    @classmethod
    def infer(cls, attrs, ins):
        if len(ins) != 1:
            raise ShapeError("Send takes exactly one input blob")
        return []

    def setup(self, ins, outs):
        self.stage = HostStage(ins[0])
        self._check_tag()
        self._setup_done = True

    def _stages_read(self):
        return [self.stage]

    def _check_tag(self):
        ub = getattr(get_world(), "tag_ub", 32767)
        if not 0 <= int(self.attrs["tag"]) <= ub:
            raise ValueError(f"tag {self.attrs['tag']} outside MPI's range 0..{ub}")

    def run(self, ins, outs):
        if not hasattr(self, "stage"):
            self.setup(ins, outs)
        comm_delay()()
        peer, tag = int(self.attrs["peer"]), int(self.attrs["tag"])
        buf = _flat(self.stage.buffer(copy_in=True))
        req = self.comm().Isend(buf, dest=peer, tag=tag)
        return MPIPending([req], f"Isend {self.op.inputs[0]} {_mb(buf.nbytes)} to rank "
                                 f"{peer} tag {tag} {self._what()}")


@register
class Recv(CommKernel):
    """Irecv(y) from rank ``peer`` with ``tag``; y's shape/dtype come from attrs."""

    op_type = "Recv"
    seq_ordered = False  # matched by (peer, tag): posted as soon as y may be written

    @classmethod
    def infer(cls, attrs, ins):
        if ins:
            raise ShapeError("Recv takes no input blobs")
        return [(tuple(attrs["shape"]), str(np.dtype(attrs.get("dtype", "float32"))))]

    def setup(self, ins, outs):
        self.stage = HostStage(outs[0])
        Send._check_tag(self)
        self._setup_done = True

    def run(self, ins, outs):
        if not hasattr(self, "stage"):
            self.setup(ins, outs)
        comm_delay()()
        peer, tag = int(self.attrs["peer"]), int(self.attrs["tag"])
        buf = _flat(self.stage.buffer(copy_in=False))
        req = self.comm().Irecv(buf, source=peer, tag=tag)
        return MPIPending([req], f"Irecv {self.op.outputs[0]} {_mb(buf.nbytes)} from rank "
                                 f"{peer} tag {tag} {self._what()}",
                          lambda: self._copy_back(self.stage))
