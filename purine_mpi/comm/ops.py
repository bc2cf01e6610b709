"""Communication ops: ordinary graph kernels that post non-blocking MPI.

Every comm op carries ``seq`` (int), assigned at graph build time in the same
order on every rank. The dispatcher (``runtime/comm_progress.CommPoster``)
calls ``run`` as soon as the op's inputs are ready, from whichever thread
readied them: collectives in ascending ``seq`` (MPI matches them by call
order), point-to-point ops (``seq_ordered = False``, matched by peer and
tag) at once. ``run`` posts the request(s) and returns a ``Pending`` that is
polled (``test()``) and completed (``finish()``) between ops. Comm ops have
no gradient: they are inserted after the backward pass.

Allreduce   ins [g_0 .. g_k]  outs [s_0 .. s_k]   attrs seq, (average), (group), (reduce)
    s_i = sum over ranks of g_i  (or the mean, with ``average: true``; the
    maximum with ``reduce: max``);
    with ``group`` (a list of ranks) over those ranks only, on the
    sub-communicator made at start-up (``World.split_groups``).
    When the outputs are alias blobs of one flat bucket (data_parallel), the
    whole bucket is reduced in place: one Iallreduce, no packing copy.
    With ``wire_dtype: bfloat16`` (``parallel.grad_dtype: bf16``) the
    buffers cross the ranks as bfloat16: each float32 is rounded (to
    nearest, ties to even) into a uint16 copy, summed by ``bf16_sum_op``
    (every reduction step widens, adds in float32 and rounds back, as
    NCCL's bfloat16 sum), and widened back into the float32 buffer before
    the mean and the update -- half the bytes.
ReduceScatter  ins [g_0 .. g_k]  outs [s_0 .. s_m]
               attrs seq, shards, shard, (shapes), (average), (group)
    the concatenation s_0 .. s_m is this rank's shard (``shard_range``) of
    the sum over ranks of the concatenation g_0 .. g_k (the mean with
    ``average: true``); ``shards`` is the number of ranks and ``shard`` this
    rank's index in the communicator (checked when the op is set up).
    ``shapes``: the outputs' shapes (default: one output of the shard's
    length; none where the shard is empty) -- so the readers of each part
    of the shard (a weight's update) depend on the op that writes it. When
    the inputs are consecutive views of one flat bucket, the bucket itself
    is the send buffer (no packing copy); so is the receive side. When the
    outputs are this rank's range of that bucket (ZeRO stage 1), it reduces
    in place: MPI_IN_PLACE (MPI puts the rank's result at the start of the
    bucket, copied to its range after); with ``wire_dtype`` (as Allreduce's)
    the bfloat16 copies are MPI's buffers instead. One MPI_Ireduce_scatter
    with counts. With attr ``allreduce: true`` (``parallel.reduce_scatter:
    false``, DeepSpeed's ``zero_optimization.reduce_scatter: false``) the
    bucket is instead summed whole by the call data parallelism's
    Allreduce posts for it (``MPI_Iallreduce``, in place on the bucket, at
    the same wire dtype) and the rank's range of the sum is its shard: the
    same additions in the same order as data parallelism's, at an
    allreduce's bytes (``posted_type``).
Allgather   ins [x_0 .. x_m]  outs [w_0 .. w_k]   attrs seq, shards, shard, shapes, (group)
    the concatenation w_0 .. w_k (shapes ``shapes``) on every rank is the
    concatenation of every rank's x's, rank by rank: rank r's x's fill
    ``shard_range(total, shards, r)``. When the inputs are already that
    range of the flat buffer the outputs view, it is gathered in place
    (MPI_IN_PLACE). One MPI_Iallgatherv.
WindowAllreduce  as Allreduce, attrs seq, window, window_ranks, (average)
    the same sum through a shared window (comm/rma_reduce.py; one node,
    parallel/dp_windows.py turns a bucket's Allreduce into one).
WindowSync  ins []  outs []  attrs seq, window, (phase)
    stage 3's gather on one node, where the gathered buffer is a shared
    window (comm/window_sync.py; parallel/zero3_windows.py): a barrier.
GetShards   ins [x]  outs [w]     attrs seq, region, regions, shards, shard, shapes
    stage 3's gather across hosts: an MPI_Rget of every owner's shard from
    its RMA window (comm/rma_pull.py; parallel/zero3_windows.py).
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
import atexit
import os
import threading
import time

import numpy as np

from ..base import env
from ..base.errors import GraphError, ShapeError
from ..base.backend import get_xp
from ..base.precision import (WIRE_ITEMSIZE, add_bf16_bits, from_bf16_bits, to_bf16_bits,
                              wire_scratch)
from ..ops.registry import OpKernel, Pending, register
from .device import HostStage, is_device_array
from .world import get_world

#: comm/rma_reduce.py registers WindowAllreduce, comm/window_sync.py WindowSync
#: (ops/catalog.py imports them)
_COLLECTIVES = {"Allreduce", "ReduceScatter", "Allgather", "WindowAllreduce", "WindowSync"}
_POINT_TO_POINT = {"Send", "Recv",  # and comm/rma_ops.py's, comm/rma_pull.py's:
                   "Put", "WaitWrite", "Release", "WaitFree", "Get", "Publish",
                   "GetShards"}


#: the attr of a collective within the forward or backward pass (a
#: synchronised batch norm's sums, parallel/data_parallel.sum_over_replicas):
#: the pass goes on after it, so it starts no deferred tail (runtime/tail.py)
IN_PASS = "in_pass"


def posted_type(op):
    """The collective ``op`` posts, for the bytes and costs reported: a
    ReduceScatter (or NcclReduceScatter) with attr ``allreduce`` sums its
    bucket whole by an allreduce (Allreduce, NcclAllreduce); any other op
    its own type."""
    if op.attrs.get("allreduce") and op.op_type in ("ReduceScatter", "NcclReduceScatter"):
        return op.op_type.replace("ReduceScatter", "Allreduce")
    return op.op_type


def is_comm_op(op):
    """True for the op types this module defines (graph passes use it)."""
    return op.op_type in _COLLECTIVES or op.op_type in _POINT_TO_POINT


def is_collective(op):
    return op.op_type in _COLLECTIVES


def is_point_to_point(op):
    """A transfer with one peer (Send/Recv, the window ops): what it waits
    for is another rank's graph, which no pass on this rank's sees."""
    return op.op_type in _POINT_TO_POINT


#: ops whose data are their outputs (what they receive), not their inputs
_RECEIVING = ("Recv", "WaitWrite", "Allgather")


def data_blobs(op):
    """The blobs a comm op carries: what it receives for a Recv, a
    WaitWrite and an Allgather (whose inputs are only this rank's shard),
    what it sends or reduces otherwise -- the same count on every rank of a
    collective (a ReduceScatter's and an Allgather's whole bucket)."""
    return op.outputs if op.op_type in _RECEIVING else op.inputs


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


_OP_LOCK = threading.Lock()
_BF16_SUM = []


def bf16_sum_op():
    """The MPI op that sums bfloat16 values sent as their uint16 bits (MPI
    has no bfloat16 type): commutative, each step widening both operands to
    float32, adding and rounding back (``add_bf16_bits``). Made once per
    process, freed at exit (before mpi4py finalizes MPI)."""
    with _OP_LOCK:
        if not _BF16_SUM:
            from mpi4py import MPI

            def add(invec, inoutvec, datatype):
                add_bf16_bits(np.frombuffer(invec, np.uint16), np.frombuffer(inoutvec, np.uint16))

            _BF16_SUM.append(MPI.Op.Create(add, commute=True))
            atexit.register(_free_ops)
        return _BF16_SUM[0]


def _free_ops():
    from mpi4py import MPI
    while _BF16_SUM:
        op = _BF16_SUM.pop()
        if not MPI.Is_finalized():
            op.Free()


def _wire(kernel, buffers):
    """Attr ``wire_dtype`` (None or ``bfloat16``) of a reducing collective,
    with the uint16 copies of ``buffers`` it moves and the rounding's
    scratch, made once at set-up (host buffers: a device bucket reduces in
    bfloat16 through NCCL only)."""
    wire = kernel.attrs.get("wire_dtype")
    if wire is None:
        return None, None, None
    if wire not in WIRE_ITEMSIZE or kernel.attrs.get("reduce", "sum") != "sum":
        raise GraphError(f"{kernel.op_type} '{kernel.op.name}': wire_dtype {wire!r} sums in "
                         f"{', '.join(WIRE_ITEMSIZE)} only")
    if any(is_device_array(b) for b in buffers):
        raise GraphError(f"{kernel.op_type} '{kernel.op.name}': a bfloat16 reduction of GPU "
                         "buffers runs through NCCL (parallel.backend: nccl), not MPI")
    copies = [np.empty(int(b.size), dtype=np.uint16) for b in buffers]
    return wire, copies, wire_scratch(max([int(b.size) for b in buffers] or [1]))


def _mb(nbytes):
    if nbytes < 2 ** 17:
        return f"{nbytes / 2 ** 10:.1f} KB"
    return f"{nbytes / 2 ** 20:.1f} MB"


def _flat(array):
    if not array.flags.c_contiguous:
        raise ValueError("a communication buffer must be contiguous")
    return array.reshape(-1)


def shard_range(total, shards, shard):
    """The elements ``[start, stop)`` of a flat buffer of ``total`` elements
    that rank ``shard`` of ``shards`` holds (ReduceScatter's output,
    Allgather's contribution): equal contiguous chunks of
    ``ceil(total / shards)`` elements in rank order, the last ones shorter
    or empty, ``[r*c, min(total, (r+1)*c))`` with ``c = ceil(total/shards)``
    -- the chunks of a buffer padded to a multiple of ``shards`` (as FSDP
    and DeepSpeed pad), without the padding."""
    chunk = -(-int(total) // int(shards))
    return min(total, shard * chunk), min(total, (shard + 1) * chunk)


def shard_counts(total, shards):
    """(counts, displacements) of ``shard_range`` over every rank."""
    ranges = [shard_range(total, shards, r) for r in range(shards)]
    return [b - a for a, b in ranges], [a for a, _ in ranges]


class CollectiveKernel(CommKernel):
    """What the collectives (Allreduce, ReduceScatter, Allgather) share: the
    description the stall watchdog prints (``<mpi call> <bucket> <size>
    seq <n>``), the one-rank shortcut, the mean's scaling, and ``nbytes``
    (the bytes of the whole buffer the collective reduces or gathers, the
    same on every rank; set in ``setup``)."""

    #: the MPI call named in descriptions ("Iallreduce", ...)
    mpi_call = None
    nbytes = 0

    def _alone(self):
        """One rank and no ``always_post``: nothing to exchange."""
        return self.comm().Get_size() == 1 and not self.attrs.get("always_post", False)

    def _posted(self, requests):
        bucket = self.attrs.get("bucket", self.op.name)
        return MPIPending(requests, f"{self.mpi_call} {bucket} {_mb(self.nbytes)} {self._what()}",
                          self._finish)

    def _finish(self):
        pass

    def _scale_mean(self, buffers):
        """``average: true``: the sum becomes the mean, ``b *= 1/size`` (one
        rounding more than folding 1/N into the update's ``grad_scale``, as
        data parallelism does; docs/parallel.md, "Sharding building blocks")."""
        if self.attrs.get("average", False):
            size = self.comm().Get_size()
            for b in buffers:
                b *= 1.0 / size

    def _shards(self):
        """(shards, shard) of the attrs, checked against the communicator:
        a graph built for another number of ranks would exchange the wrong
        counts."""
        comm = self.comm()
        shards, shard = int(self.attrs["shards"]), int(self.attrs["shard"])
        if (shards, shard) != (comm.Get_size(), comm.Get_rank()):
            raise GraphError(f"{self.op_type} '{self.op.name}' was built as shard {shard} of "
                             f"{shards}, but runs as rank {comm.Get_rank()} of "
                             f"{comm.Get_size()}")
        return shards, shard


def _flat_shapes(attrs, ins, what):
    """The dtype and element count of the concatenation of ``ins``."""
    dtypes = {str(np.dtype(d)) for _, d in ins}
    if len(dtypes) > 1:
        raise ShapeError(f"{what} needs blobs of one dtype, got {', '.join(sorted(dtypes))}")
    shards, shard = int(attrs["shards"]), int(attrs["shard"])
    if not 0 <= shard < shards:
        raise ShapeError(f"{what}: shard {shard} is not one of 0..{shards - 1}")
    return dtypes.pop() if dtypes else None, sum(int(np.prod(s, dtype=np.int64)) for s, _ in ins)


@register
class Allreduce(CollectiveKernel):
    """s_i = sum over ranks of g_i (mean with ``average``; the maximum with
    ``reduce: max``, fp16's overflow flag). Shapes pass through."""

    op_type = "Allreduce"
    mpi_call = "Iallreduce"

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
        self.wire, self.wires, self.scratch = _wire(self, self.buffers)
        self.stages = [HostStage(b) for b in (self.wires or self.buffers)]
        self.nbytes = sum(st.array.nbytes for st in self.stages)
        self._setup_done = True

    def _stages_read(self):
        return self.stages

    def copy_out(self):
        """With asynchronous host staging the stages are copied before
        ``run``: an input that is not its output goes into the buffer first
        (on the copy stream, after its writer), or MPI reduced the buffer's
        last value (fp16's overflow flag, read one iteration late)."""
        for i, o, same in zip(self.ins, self.outs, self.in_place):
            if not same:
                o[...] = i
        super().copy_out()

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
        if self._alone():
            return None
        comm = self.comm()
        op = MPI.MAX if self.attrs.get("reduce", "sum") == "max" else MPI.SUM
        if self.wire:
            for b, w in zip(self.buffers, self.wires):
                to_bf16_bits(b, w, self.scratch)
            op = bf16_sum_op()
        return self._posted([comm.Iallreduce(MPI.IN_PLACE, st.buffer(copy_in=True), op=op)
                              for st in self.stages])

    def _finish(self):
        for st in self.stages:
            self._copy_back(st)
        for w, b in zip(self.wires or (), self.buffers):
            from_bf16_bits(w, b)
        self._scale_mean(self.buffers)


class _Concat:
    """The flat concatenation of ``arrays`` that MPI reads or writes: the
    run of the flat buffer ``flat`` they tile, in order (no copy), or else a
    buffer of its own that ``pack`` fills from them and ``unpack`` copies
    back to them."""

    def __init__(self, arrays, flat, dtype):
        self.arrays = list(arrays)
        self.buffer = _tiled_run(flat, self.arrays)
        self.copies = self.buffer is None
        if self.copies:
            total = sum(int(a.size) for a in self.arrays)
            xp = get_xp(self.arrays[0]) if self.arrays else np
            self.buffer = xp.zeros(total, dtype=dtype)

    def pack(self):
        if self.copies:
            pos = 0
            for a in self.arrays:
                self.buffer[pos:pos + a.size] = a.reshape(-1)
                pos += a.size

    def unpack(self):
        if self.copies:
            pos = 0
            for a in self.arrays:
                a[...] = self.buffer[pos:pos + a.size].reshape(a.shape)
                pos += a.size


def _address(a):
    return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr


def _is_range(part, whole, start):
    """True when ``part`` is ``whole[start:start + part.size]`` (same memory)."""
    return type(part) is type(whole) and part.dtype == whole.dtype and \
        start + part.size <= whole.size and \
        _address(part) == _address(whole) + start * whole.itemsize


def _tiled_run(flat, arrays):
    """``flat[i:j]`` when ``arrays`` are C-contiguous views of the 1-D
    ``flat`` lying one after the other from element i to j, else None."""
    if flat is None or not arrays or any(
            not a.flags.c_contiguous or a.dtype != flat.dtype or type(a) is not type(flat)
            for a in arrays):
        return None
    arrays = [a for a in arrays if a.size]  # an empty view may point anywhere
    if not arrays:
        return None
    base, item = _address(flat), flat.itemsize
    start = pos = _address(arrays[0]) - base
    for a in arrays:
        if _address(a) - base != pos:
            return None
        pos += a.nbytes
    if start < 0 or start % item or pos > flat.nbytes:
        return None
    return flat[start // item:pos // item]


def _storage_of(kernel, name):
    storage = getattr(kernel.workspace, "storage", None)
    try:
        return storage(name) if storage is not None else None
    except (KeyError, GraphError):
        return None


@register
class ReduceScatter(CollectiveKernel):
    """concat(s_0 .. s_m) = this rank's shard of the sum over ranks of
    concat(g_0 .. g_k) (``shard_range``; the mean with ``average``)."""

    op_type = "ReduceScatter"
    mpi_call = "Ireduce_scatter"

    @property
    def allreduce(self):
        """Attr ``allreduce``: the bucket summed whole by data parallelism's
        in-place Iallreduce, the shard read from its range."""
        return bool(self.attrs.get("allreduce", False))

    @classmethod
    def infer(cls, attrs, ins):
        dtype, total = _flat_shapes(attrs, ins, "ReduceScatter")
        if dtype is None:
            raise ShapeError("ReduceScatter needs at least one input blob")
        a, b = shard_range(total, int(attrs["shards"]), int(attrs["shard"]))
        if "shapes" not in attrs:
            return [((b - a,), dtype)]
        shapes = [tuple(int(d) for d in s) for s in attrs["shapes"]]
        if sum(int(np.prod(s, dtype=np.int64)) for s in shapes) != b - a:
            raise ShapeError(f"ReduceScatter: shard {attrs['shard']} of {attrs['shards']} of "
                             f"{total} elements holds {b - a}, the output shapes "
                             f"{[list(s) for s in shapes]} do not")
        return [(s, dtype) for s in shapes]

    def setup(self, ins, outs):
        shards, shard = self._shards()
        dtype = ins[0].dtype
        self.send = _Concat(ins, _storage_of(self, self.op.inputs[0]), dtype)
        self.counts, self.displs = shard_counts(self.send.buffer.size, shards)
        self.recv = _Concat(outs, _storage_of(self, self.op.outputs[0]) if outs else None, dtype)
        self.lo = self.displs[shard]
        self.wire, wires, self.scratch = _wire(self, [self.send.buffer, self.recv.buffer])
        # in bfloat16 MPI reduces the separate wire copies: nothing aliases
        self.in_place = _is_range(self.recv.buffer, self.send.buffer, self.lo) \
            if outs and not (self.wire or self.send.copies or self.recv.copies) else False
        if not (self.in_place or self.wire) and outs and \
                _shares(self.send.buffer, self.recv.buffer):
            raise GraphError(f"ReduceScatter '{self.op.name}': its outputs overlap its "
                             "inputs other than as this rank's range of the bucket (MPI "
                             "forbids aliased send and receive buffers)")
        send, recv = wires or (self.send.buffer, self.recv.buffer)
        self.send_stage, self.recv_stage = HostStage(send), HostStage(recv)
        self.nbytes = int(send.nbytes)
        if self.allreduce:
            self.mpi_call = "Iallreduce"
        self._setup_done = True

    def _stages_read(self):
        return [self.send_stage]

    def run(self, ins, outs):
        if not hasattr(self, "send"):
            self.setup(ins, outs)
        from mpi4py import MPI
        comm_delay()()
        self.send.pack()
        if self._alone():  # the one shard is the whole sum
            if not self.in_place:  # in place it is the bucket already
                self.recv.buffer[...] = self.send.buffer
                self.recv.unpack()
            return None
        op = MPI.SUM
        if self.wire:
            to_bf16_bits(self.send.buffer, self.send_stage.array, self.scratch)
            op = bf16_sum_op()
        if self.allreduce:  # data parallelism's call on the bucket: its sum, bit for bit
            self._sum = self.send_stage.buffer(copy_in=True)
            req = self.comm().Iallreduce(MPI.IN_PLACE, self._sum, op=op)
        elif self.in_place:
            self._sum = self.send_stage.buffer(copy_in=True)
            req = self.comm().Ireduce_scatter(MPI.IN_PLACE, self._sum, recvcounts=self.counts,
                                              op=op)
        else:
            req = self.comm().Ireduce_scatter(self.send_stage.buffer(copy_in=True),
                                              self.recv_stage.buffer(copy_in=False),
                                              recvcounts=self.counts, op=op)
        return self._posted([req])

    def _finish(self):
        if self.allreduce:
            # the whole sum is in the buffer reduced (the bucket, its host
            # mirror or its bfloat16 copy): the shard is its range [lo, lo + count)
            count = self.recv.buffer.size
            part = self._sum[self.lo:self.lo + count]
            if self.recv_stage.staged:
                self.recv_stage.host[...] = part
            elif not self.in_place:
                self.recv_stage.array[...] = part
        elif self.in_place:
            # MPI left the shard at the start of the buffer it reduced (the
            # bucket, or its host mirror): move it to the shard's range. The
            # two do not overlap: lo = r*c >= c >= the shard's count for r >= 1
            count = self.recv.buffer.size
            if self.recv_stage.staged:
                self.recv_stage.host[...] = self._sum[:count]
            elif self.lo:
                self._sum[self.lo:self.lo + count] = self._sum[:count]
        self._copy_back(self.recv_stage)
        if self.wire:
            from_bf16_bits(self.recv_stage.array, self.recv.buffer)
        self._scale_mean([self.recv.buffer])
        self.recv.unpack()


@register
class Allgather(CollectiveKernel):
    """concat(w_0 .. w_k) = every rank's concat(x_0 .. x_m), rank r's at
    ``shard_range(total, shards, r)``; the outputs' shapes are attr ``shapes``."""

    op_type = "Allgather"
    mpi_call = "Iallgatherv"

    @classmethod
    def infer(cls, attrs, ins):
        shapes = [tuple(int(d) for d in s) for s in attrs["shapes"]]
        dtype, count = _flat_shapes(attrs, ins, "Allgather")
        total = sum(int(np.prod(s, dtype=np.int64)) for s in shapes)
        a, b = shard_range(total, int(attrs["shards"]), int(attrs["shard"]))
        if count != b - a:
            raise ShapeError(f"Allgather: shard {attrs['shard']} of {attrs['shards']} of "
                             f"{total} elements holds {b - a}, the inputs hold {count}")
        if dtype is None:
            dtype = str(np.dtype(attrs.get("dtype", "float32")))
        return [(s, dtype) for s in shapes]

    def setup(self, ins, outs):
        shards, shard = self._shards()
        flat = _storage_of(self, self.op.outputs[0]) if outs else None
        self.recv = _Concat(outs, flat, outs[0].dtype)
        total = self.recv.buffer.size
        self.counts, self.displs = shard_counts(total, shards)
        a, b = shard_range(total, shards, shard)
        mine = self.recv.buffer[a:b]
        run = _tiled_run(flat, list(ins)) if not self.recv.copies else None
        # in place: the inputs are this rank's range of the gathered buffer
        self.in_place = b == a or (run is not None and _address(run) == _address(mine)
                                   and run.size == mine.size)
        # the send buffer is the inputs' own storage where they tile a run of
        # it (stage 3's weight shard, one blob): no copy held per gather
        self.send = None if self.in_place else _Concat(
            ins, _storage_of(self, self.op.inputs[0]) if ins else None, outs[0].dtype)
        self.mine = mine
        self.recv_stage = HostStage(self.recv.buffer)
        self.send_stage = None if self.in_place else HostStage(self.send.buffer)
        self.nbytes = int(self.recv.buffer.nbytes)
        self._setup_done = True

    def _stages_read(self):
        return [self.recv_stage] if self.in_place else [self.send_stage]

    def run(self, ins, outs):
        if not hasattr(self, "recv"):
            self.setup(ins, outs)
        from mpi4py import MPI
        comm_delay()()
        if not self.in_place:
            self.send.pack()
        if self._alone():  # the one shard is the whole buffer
            if not self.in_place:
                self.mine[...] = self.send.buffer
            self.recv.unpack()
            return None
        recv = [self.recv_stage.buffer(copy_in=self.in_place), (self.counts, self.displs)]
        send = MPI.IN_PLACE if self.in_place else self.send_stage.buffer(copy_in=True)
        return self._posted([self.comm().Iallgatherv(send, recv)])

    def _finish(self):
        self._copy_back(self.recv_stage)
        self.recv.unpack()


def collective_bytes(graph):
    """{op type posted (``posted_type``): bytes} of the collectives of
    ``graph`` per iteration: each
    op counts the whole buffer it reduces or gathers (the bucket), the same
    figure on every rank -- what the kernels' ``nbytes`` holds once set up
    (a bucket reduced in bfloat16, attr ``wire_dtype``: 2 bytes an element)."""
    out = {}
    for op in graph.ops.values():
        if is_collective(op):
            kind = posted_type(op)  # a ReduceScatter posted as an allreduce counts as one
            out[kind] = out.get(kind, 0) + moved_bytes(graph, op)
    return out


#: the collectives that reduce gradient buckets (attr ``bucket``), MPI's and NCCL's
_BUCKET_REDUCTIONS = ("Allreduce", "ReduceScatter", "WindowAllreduce", "NcclAllreduce",
                      "NcclReduceScatter")


def bucket_reductions(graph):
    """The ops of ``graph`` that reduce a gradient bucket (their inputs: the
    bucket's gradients)."""
    return [op for op in graph.ops.values()
            if op.op_type in _BUCKET_REDUCTIONS and "bucket" in op.attrs]


def moved_bytes(graph, op):
    """The bytes comm ``op`` of ``graph`` carries: those of its data blobs
    (``data_blobs``), each at the op's wire dtype (``wire_bytes``) -- what
    bench, the start-up block and the scaling predictor count."""
    return sum(wire_bytes(op, graph.blobs[b]) for b in data_blobs(op))


def wire_bytes(op, blob):
    """The bytes collective ``op`` moves for ``blob``: its own, or 2 an
    element where the op reduces in bfloat16 (attr ``wire_dtype``)."""
    wire = op.attrs.get("wire_dtype")
    return blob.nbytes if wire is None else int(blob.size) * WIRE_ITEMSIZE[wire]


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
