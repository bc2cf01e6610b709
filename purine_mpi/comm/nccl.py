"""NCCL collectives where each rank has its own GPU (``parallel.backend``).

``choose_backend(requested, world, device)`` decides, the same on every rank:
``mpi`` (the comm ops of comm/ops.py), or ``nccl``: each data-parallel
bucket's ``Allreduce`` becomes an ``NcclAllreduce`` op, a GPU op like any
other (parallel/nccl_backend.py). ``auto`` picks nccl only with CuPy, its
NCCL binding (``cupy.cuda.nccl``), a GPU for the model and one GPU per rank
(the ranks' (host, PCI bus id) pairs all differ: NCCL refuses two ranks on
one GPU), else mpi; the reason goes into the start-up block. Every rank
joins the one allgather that decides, whatever its own answer.

The communicator is created from MPI (``NcclComm``): rank 0 makes the
unique id (``nccl.get_unique_id()``), MPI broadcasts it, and each rank calls
``NcclCommunicator(size, id, rank)`` on its device.

``NcclAllreduce`` queues ``ncclAllReduce`` (sum, in place) on CuPy's
current stream: the stream dispatcher gives every NCCL op of a device one
stream (thread ``nccl``) and the ops a chain of control edges in ``seq``
order, so every rank launches its collectives in the same order, each right
after its bucket's gradients (cross-stream events). Nothing in it
synchronises, allocates or reads back, so a CUDA-graph capture takes it
with the rest of the iteration.

``parallel.grad_dtype: bf16`` (attr ``wire_dtype``): ``NcclAllreduce``
and ``NcclReduceScatter`` round their float32 buffers into uint16 copies
made at set-up (``gpu.kernels.to_bf16_bits_device``: one kernel over the
bucket, no scratch, on the stream, captured; the bits of
``base/precision.to_bf16_bits``), reduce them as ``ncclBfloat16`` (NCCL
adds in float32 and rounds each step) and widen the result back into the
float32 buffer (``from_bf16_bits_device``, one kernel): half the bytes.

The watchdog: after each allreduce the op adds one to its slot of a device
counter and copies it to page-locked host memory (both captured with it);
``before_iteration`` counts the launches on the host. A thread
(``NcclWatchdog``) compares them: an op launched and not complete for
``stall_timeout`` seconds is named on standard error (bucket, size, seq),
every communicator is ended with ``ncclCommAbort`` (which frees the device
work blocked in NCCL) and the job ends with exit status 1 (World.abort).

Layer: comm (imports: NumPy, base, gpu, ops.registry; CuPy on first use).
"""
import importlib
import socket
import threading
import time

import numpy as np

from ..base.errors import GraphError, UserError
from ..gpu import kernels
from ..ops.registry import OpKernel, register
from .device import is_device_array
from .ops import Allgather, ReduceScatter, _Concat, _mb, _storage_of
from ..base.errors import write_line

#: the stream (thread) of a device's NCCL ops: one stream runs them in launch order
NCCL_STREAM = "nccl"
BACKENDS = ("mpi", "nccl", "auto")

_lock = threading.Lock()
_comms = {}   # (device, world id) -> NcclComm


def nccl_module():
    """(``cupy.cuda.nccl``, None) or (None, why not)."""
    try:
        from ..gpu import import_cupy
        import_cupy()
        nccl = importlib.import_module("cupy.cuda.nccl")
    except Exception as exc:
        return None, f"CuPy's NCCL binding does not import ({type(exc).__name__}: {exc})"
    if not getattr(nccl, "available", True):
        return None, "CuPy was built without NCCL (cupy.cuda.nccl.available is False)"
    return nccl, None


def _local_facts(device):
    """(usable here, why not, (host, GPU identity)) for this rank."""
    host = socket.gethostname()
    if device < 0:
        return False, "the model runs on the CPU", (host, None)
    nccl, why = nccl_module()
    if nccl is None:
        return False, why, (host, None)
    import cupy
    try:
        ident = cupy.cuda.Device(device).pci_bus_id
    except Exception:   # no PCI bus id: the device number stands for it
        ident = f"device {device}"
    return True, None, (host, ident)


def choose_backend(requested, world, device):
    """("mpi" or "nccl", the reason in words), the same on every rank.
    ``requested``: parallel.backend. nccl that cannot run is a UserError."""
    if requested not in BACKENDS:
        raise UserError(f"parallel.backend: expected one of {', '.join(BACKENDS)}, "
                        f"got {requested!r}")
    if requested == "mpi":
        return "mpi", "parallel.backend: mpi"
    facts = world.allgather_object(_local_facts(device), "the NCCL check")
    why = next((f"rank {r}: {w}" for r, (ok, w, _) in enumerate(facts) if not ok), None)
    if why is None:
        seen = {}
        for r, (_, _, ident) in enumerate(facts):
            if ident in seen:
                why = (f"ranks {seen[ident]} and {r} share one GPU ({ident[1]} on "
                       f"{ident[0]}): NCCL needs a GPU per rank")
                break
            seen[ident] = r
    if requested == "nccl":
        if why is not None:
            raise UserError(f"parallel.backend: nccl cannot run here: {why}; use "
                            "parallel.backend: mpi (or auto)")
        return "nccl", "parallel.backend: nccl"
    if why is None:
        return "nccl", f"auto: CuPy with NCCL and a GPU per rank ({world.size} ranks)"
    return "mpi", f"auto: {why}"


class NcclComm:
    """One NCCL communicator over ``world`` on GPU ``device``, made from MPI:
    rank 0's unique id, broadcast. ``abort()`` is ``ncclCommAbort``."""

    def __init__(self, world, device):
        nccl, why = nccl_module()
        if nccl is None:
            raise UserError(f"parallel.backend: nccl: {why}")
        import cupy
        self.nccl, self.world, self.device = nccl, world, int(device)
        uid = nccl.get_unique_id() if world.rank == 0 else None
        uid = world.comm.bcast(uid, root=0)
        with cupy.cuda.Device(self.device):
            self.comm = nccl.NcclCommunicator(world.size, uid, world.rank)
        self.size = world.size
        self.aborted = False

    def abort(self):
        if not self.aborted:
            self.aborted = True
            self.comm.abort()


def get_comm(world, device):
    """This process's communicator for (world, device), made on first use
    (every rank gets here at the same point: the first NcclAllreduce's setup)."""
    key = (int(device), id(world))
    with _lock:
        comm = _comms.get(key)
    if comm is None:
        comm = NcclComm(world, device)
        with _lock:
            _comms[key] = comm
        NcclWatchdog.get(world).start()
    return comm


def abort_all():
    """``ncclCommAbort`` on every communicator of this process (the job ends)."""
    with _lock:
        comms = list(_comms.values())
    for comm in comms:
        try:
            comm.abort()
        except Exception:
            pass


def reset():
    """Forget the communicators and the watchdog (tests)."""
    with _lock:
        _comms.clear()
        _ops.clear()
    NcclWatchdog.instance = None


_NCCL_DTYPES = {np.dtype(np.float32): "NCCL_FLOAT32", np.dtype(np.float64): "NCCL_FLOAT64"}
#: ``ncclBfloat16`` (NCCL 2.10 on), where CuPy's binding does not name it
NCCL_BFLOAT16 = 9
_ops = []   # the NCCL kernels of this process (any collective), in seq order


class NcclWatchdog:
    """Names the first NCCL op launched and not complete for ``stall_timeout``
    seconds and ends the job (``ncclCommAbort``, then World.abort)."""

    instance = None
    poll = 0.05

    def __init__(self, world):
        self.world = world
        self.thread = None
        self.fired = None   # the message, once it fired

    @classmethod
    def get(cls, world):
        with _lock:
            if cls.instance is None:
                cls.instance = cls(world)
            return cls.instance

    def start(self):
        with _lock:
            if self.thread is not None:
                return
            self.thread = threading.Thread(target=self._watch, name="nccl-watchdog",
                                           daemon=True)
            self.thread.start()

    def stalled(self, now=None):
        """The first op (in seq order) launched and not done for longer than
        the stall timeout, with how long; else None."""
        now = time.monotonic() if now is None else now
        timeout = float(getattr(self.world, "stall_timeout", 300.0))
        with _lock:
            ops = sorted(_ops, key=lambda k: k.attrs.get("seq", 0))
        for k in ops:
            waited = k.waiting_since(now)
            if waited is not None and waited > timeout:
                return k, waited
        return None

    def _watch(self):
        while self.fired is None:
            time.sleep(self.poll)
            found = self.stalled()
            if found is not None:
                self.fire(*found)

    def fire(self, kernel, waited):
        timeout = float(getattr(self.world, "stall_timeout", 300.0))
        self.fired = (f"rank {self.world.rank}: NCCL {getattr(kernel, 'nccl_call', 'allreduce')} "
                      f"'{kernel.op.name}' "
                      f"({kernel.describe()}) stalled for more than {timeout:g} s "
                      f"(parallel.stall_timeout; waited {waited:.1f} s): a peer is slow, "
                      "dead or launched its collectives in another order; ending the job "
                      "with ncclCommAbort")
        write_line(self.fired)  # one write: the ranks' lines never mix
        abort_all()
        self.world.abort(1)


class _NcclKernel(OpKernel):
    """What the NCCL collectives share: the communicator of the op's GPU,
    the dtype, and the watchdog's view (launches counted on the host in
    ``before_iteration``, completions by a device counter copied to
    page-locked memory after the collective, both captured with it)."""

    capturable = True   # the host work of each iteration is before_iteration's
    #: the collective's name in the watchdog's line
    nccl_call = None

    def _setup_comm(self, outs):
        from ..gpu import import_cupy
        from ..gpu.streams import pinned_empty
        from .world import get_world
        cupy = import_cupy()
        device = int(self.op.location.device)
        self.nccl_comm = get_comm(get_world(), device)
        nccl = self.nccl_comm.nccl
        dtype = np.dtype(outs[0].dtype) if outs else None
        if dtype not in _NCCL_DTYPES or any(np.dtype(o.dtype) != dtype for o in outs):
            raise ValueError(f"{self.op_type} '{self.op.name}': float32 or float64 "
                             f"buffers of one dtype, got {sorted({str(o.dtype) for o in outs})}")
        self.nccl_dtype, self.op_sum = getattr(nccl, _NCCL_DTYPES[dtype]), nccl.NCCL_SUM
        self.dtype = dtype
        # attr wire_dtype (parallel.grad_dtype: bf16): float32 buckets rounded
        # into bfloat16 copies, reduced by ncclBfloat16 and widened back
        self.wire = self.attrs.get("wire_dtype")
        if self.wire is not None:
            if self.wire != "bfloat16" or dtype != np.float32:
                raise ValueError(f"{self.op_type} '{self.op.name}': wire_dtype bfloat16 of "
                                 f"float32 buffers, got {self.wire} of {dtype}")
            self.nccl_dtype = getattr(nccl, "NCCL_BFLOAT16", NCCL_BFLOAT16)
        with cupy.cuda.Device(device):
            self.done_device = cupy.zeros((1,), dtype=np.int64)
        self.done_host = pinned_empty((1,), np.int64)
        self.done_host[...] = 0
        self.launched, self.launched_at = 0, None
        with _lock:
            _ops.append(self)
        return cupy

    def before_iteration(self, iteration, host_write):
        """Every iteration, also a replayed one: one more launch to complete."""
        self.launched += 1
        self.launched_at = time.monotonic()
        return None

    def waiting_since(self, now):
        """Seconds the latest launch has waited, or None when all completed."""
        if self.launched_at is None or int(self.done_host[0]) >= self.launched:
            return None
        return now - self.launched_at

    def describe(self):
        bucket = self.attrs.get("bucket", self.op.name)
        return f"bucket {bucket}, {_mb(self.nbytes)}, seq {self.attrs.get('seq', '?')}"

    def _stream(self):
        from ..gpu import import_cupy
        return import_cupy().cuda.get_current_stream().ptr

    def _done(self):
        from ..gpu.streams import copy_to_host_async
        self.done_device += 1   # the watchdog: this launch is complete on the device
        copy_to_host_async(self.done_host, self.done_device)

    def _wire_buffers(self, cupy, *sizes):
        """The uint16 device buffers of ``sizes`` elements the bfloat16
        collective moves (made at set-up; the conversions need no scratch)."""
        device = int(self.op.location.device)
        with cupy.cuda.Device(device):
            return [cupy.zeros((n,), dtype=np.uint16) for n in sizes]

    def _shards(self):
        """(shards, shard) of the attrs, checked against the communicator (a
        graph built for another number of ranks would exchange wrong counts)."""
        comm = self.nccl_comm
        shards, shard = int(self.attrs["shards"]), int(self.attrs["shard"])
        if (shards, shard) != (comm.size, comm.world.rank):
            raise GraphError(f"{self.op_type} '{self.op.name}' was built as shard {shard} of "
                             f"{shards}, but runs as rank {comm.world.rank} of {comm.size}")
        return shards, shard


@register
class NcclAllreduce(_NcclKernel):
    """s_i = sum over ranks of g_i through ncclAllReduce on the current
    stream (in place on a data-parallel bucket: one call). Shapes pass through."""

    op_type = "NcclAllreduce"
    nccl_call = "allreduce"

    @classmethod
    def infer(cls, attrs, ins):
        return list(ins)

    def setup(self, ins, outs):
        from ..gpu import import_cupy
        from ..gpu.raw import data_ptr
        if len(ins) != len(outs):
            raise ValueError(f"NcclAllreduce '{self.op.name}' needs one output per input")
        self._setup_comm(outs)
        for o in outs:
            if not o.flags.c_contiguous:
                raise ValueError(f"NcclAllreduce '{self.op.name}': a buffer is not contiguous")
        self.copies = [(i, o) for i, o in zip(ins, outs) if data_ptr(i) != data_ptr(o)]
        # the outputs side by side in one buffer (a bucket's alias blobs): one call
        spans, ptr = [], None
        for o in outs:
            p = data_ptr(o)
            if spans and p == ptr:
                spans[-1][1] += int(o.size)
            else:
                spans.append([p, int(o.size)])
            ptr = p + o.nbytes
        self.spans = [tuple(s) for s in spans]
        self.nbytes = sum(o.nbytes for o in outs)
        if self.wire is not None:   # the outputs rounded side by side into one copy
            total = sum(int(o.size) for o in outs)
            (self.wire_buf,) = self._wire_buffers(import_cupy(), total)
            self.spans = [(data_ptr(self.wire_buf), total)] if total else []
            self.nbytes = int(self.wire_buf.nbytes)
        self.average = bool(self.attrs.get("average", False))
        self.outs = outs

    def _wire_parts(self, outs):
        pos = 0
        for o in outs:
            yield o, self.wire_buf[pos:pos + o.size]
            pos += int(o.size)

    def run(self, ins, outs):
        for i, o in self.copies:
            o[...] = i
        stream = self._stream()
        comm = self.nccl_comm
        if self.wire is not None:
            for o, part in self._wire_parts(outs):
                kernels.to_bf16_bits_device(o, part)
        for ptr, count in self.spans:
            comm.comm.allReduce(ptr, ptr, count, self.nccl_dtype, self.op_sum, stream)
        if self.wire is not None:
            for o, part in self._wire_parts(outs):
                kernels.from_bf16_bits_device(part, o)
        if self.average:
            for o in outs:
                o *= 1.0 / comm.size
        self._done()


def _padded(cupy, buffer, size, dtype):
    """``buffer`` itself when it is a device array of ``size`` elements,
    else a zeroed buffer of ``size`` made now (at set-up): NCCL's
    reduce-scatter and all-gather take equal counts per rank,
    ``shard_range``'s chunks padded (the padding is zeros: it adds nothing
    to any sum and is never read)."""
    if buffer.size == size and is_device_array(buffer):
        return buffer, False
    return cupy.zeros((size,), dtype=dtype), True


@register
class NcclReduceScatter(_NcclKernel):
    """ReduceScatter (comm/ops.py) through ncclReduceScatter on the current
    stream: concat(s_0 .. s_m) = this rank's ``shard_range`` of the sum over
    ranks of concat(g_0 .. g_k). NCCL cuts the buffer into equal chunks of
    ``ceil(total / N)``: a bucket that N does not divide is sent from a
    zero-padded copy and the last shards received into a chunk-sized one
    (both made at set-up: the iteration allocates nothing). Where the
    outputs are this rank's range of the unpadded bucket (stage 1's
    gradient shard), the receive buffer is the send buffer plus rank times
    the chunk: NCCL's in-place reduce-scatter (``in_place``); any other
    overlap of the two is refused at set-up. With attr ``allreduce``
    (``parallel.reduce_scatter: false``): the bucket summed whole in place
    by the ncclAllReduce NcclAllreduce posts for it (bfloat16: its whole
    rounded copy), this rank's range of the sum copied to the shard (no
    padded buffers): data parallelism's sum, bit for bit."""

    op_type = "NcclReduceScatter"
    nccl_call = "reduce-scatter"

    @classmethod
    def infer(cls, attrs, ins):
        return ReduceScatter.infer(attrs, ins)

    def setup(self, ins, outs):
        cupy = self._setup_comm(ins)
        shards, shard = self._shards()
        dtype = self.dtype
        self.send = _Concat(ins, _storage_of(self, self.op.inputs[0]), dtype)
        total = int(self.send.buffer.size)
        self.chunk = -(-total // shards)
        self.recv = _Concat(outs, _storage_of(self, self.op.outputs[0]) if outs else None, dtype)
        self.allreduce = bool(self.attrs.get("allreduce", False))
        if self.allreduce:
            self._setup_allreduce(cupy, shards, shard, total)
            return
        self.send_buf, self.send_pad = _padded(cupy, self.send.buffer, self.chunk * shards,
                                               dtype)
        self.recv_buf, self.recv_pad = _padded(cupy, self.recv.buffer, self.chunk, dtype)
        self.total, self.mine = total, int(self.recv.buffer.size)
        self.nbytes = int(self.send.buffer.nbytes)
        self.average = bool(self.attrs.get("average", False))
        # NCCL reduces in place only with recvbuff == sendbuff + rank * recvcount
        from ..gpu.raw import data_ptr
        item = np.dtype(dtype).itemsize
        send_at, recv_at = data_ptr(self.send_buf), data_ptr(self.recv_buf)
        self.in_place = recv_at == send_at + shard * self.chunk * item
        if self.wire is not None:   # the padded send and the chunk, as bfloat16
            # (NCCL reads and writes these: the float32 buffers may overlap)
            self.wire_send, self.wire_recv = self._wire_buffers(cupy, self.chunk * shards,
                                                                self.chunk)
            self.nbytes //= 2
        elif not self.in_place and send_at < recv_at + self.chunk * item and \
                recv_at < send_at + self.chunk * shards * item:
            raise GraphError(f"NcclReduceScatter '{self.op.name}': its receive buffer "
                             "overlaps its send buffer other than at this rank's chunk "
                             "(NCCL's in-place rule: recvbuff = sendbuff + rank * recvcount)")

    def _setup_allreduce(self, cupy, shards, shard, total):
        """Attr ``allreduce``: the send buffer (the bucket) is summed in
        place; the shard is its range ``[lo, lo + mine)``."""
        from ..gpu.raw import data_ptr
        self.nccl_call = "allreduce"
        self.total, self.mine = total, int(self.recv.buffer.size)
        self.lo = min(shard * self.chunk, total)
        self.average = bool(self.attrs.get("average", False))
        self.nbytes = int(self.send.buffer.nbytes)
        item = np.dtype(self.dtype).itemsize
        send_at, recv_at = data_ptr(self.send.buffer), data_ptr(self.recv.buffer)
        self.in_place = self.mine == 0 or recv_at == send_at + self.lo * item
        if self.wire is not None:   # the whole bucket as bfloat16, as NcclAllreduce's
            (self.wire_send,) = self._wire_buffers(cupy, total)
            self.nbytes //= 2
        elif not self.in_place and send_at < recv_at + self.mine * item and \
                recv_at < send_at + total * item:
            raise GraphError(f"NcclReduceScatter '{self.op.name}': its receive buffer "
                             "overlaps the bucket other than as this rank's range")

    def _run_allreduce(self):
        from ..gpu.raw import data_ptr
        comm = self.nccl_comm
        buf = self.send.buffer
        if self.wire is not None:
            kernels.to_bf16_bits_device(buf, self.wire_send)
            buf = self.wire_send
        if self.total:
            comm.comm.allReduce(data_ptr(buf), data_ptr(buf), self.total, self.nccl_dtype,
                                self.op_sum, self._stream())
        part = buf[self.lo:self.lo + self.mine]
        if self.mine:
            if self.wire is not None:
                kernels.from_bf16_bits_device(part, self.recv.buffer)
            elif not self.in_place:
                self.recv.buffer[...] = part
        if self.average and self.mine:
            self.recv.buffer *= 1.0 / comm.size
        self.recv.unpack()
        self._done()

    def run(self, ins, outs):
        from ..gpu.raw import data_ptr
        self.send.pack()
        if self.allreduce:
            self._run_allreduce()
            return
        if self.send_pad:
            self.send_buf[:self.total] = self.send.buffer
        comm = self.nccl_comm
        send, recv = self.send_buf, self.recv_buf
        if self.wire is not None:
            send, recv = self.wire_send, self.wire_recv
            kernels.to_bf16_bits_device(self.send_buf, send)
        comm.comm.reduceScatter(data_ptr(send), data_ptr(recv), self.chunk,
                                self.nccl_dtype, self.op_sum, self._stream())
        if self.wire is not None:
            if self.mine:
                kernels.from_bf16_bits_device(recv[:self.mine], self.recv.buffer)
        elif self.recv_pad and self.mine:
            self.recv.buffer[...] = self.recv_buf[:self.mine]
        if self.average and self.mine:
            self.recv.buffer *= 1.0 / comm.size
        self.recv.unpack()
        self._done()


@register
class NcclAllgather(_NcclKernel):
    """Allgather (comm/ops.py) through ncclAllGather on the current stream:
    concat(w_0 .. w_k) on every rank is every rank's concat(x_0 .. x_m),
    rank r's at ``shard_range(total, N, r)``. Equal chunks of
    ``ceil(total / N)``, as NcclReduceScatter: a zero-padded send copy for
    a short shard, a chunk-multiple receive buffer where N does not divide
    the total (made at set-up)."""

    op_type = "NcclAllgather"
    nccl_call = "all-gather"

    @classmethod
    def infer(cls, attrs, ins):
        return Allgather.infer(attrs, ins)

    def setup(self, ins, outs):
        cupy = self._setup_comm(outs)
        shards, shard = self._shards()
        dtype = self.dtype
        self.recv = _Concat(outs, _storage_of(self, self.op.outputs[0]), dtype)
        total = int(self.recv.buffer.size)
        self.chunk = -(-total // shards)
        self.send = _Concat(ins, _storage_of(self, self.op.inputs[0]) if ins else None, dtype)
        self.send_buf, self.send_pad = _padded(cupy, self.send.buffer, self.chunk, dtype)
        self.recv_buf, self.recv_pad = _padded(cupy, self.recv.buffer, self.chunk * shards,
                                               dtype)
        self.total, self.count = total, int(self.send.buffer.size)
        self.nbytes = int(self.recv.buffer.nbytes)

    def run(self, ins, outs):
        from ..gpu.raw import data_ptr
        self.send.pack()
        if self.send_pad and self.count:
            self.send_buf[:self.count] = self.send.buffer
        self.nccl_comm.comm.allGather(data_ptr(self.send_buf), data_ptr(self.recv_buf),
                                      self.chunk, self.nccl_dtype, self._stream())
        if self.recv_pad:
            self.recv.buffer[...] = self.recv_buf[:self.total]
        self.recv.unpack()
        self._done()
