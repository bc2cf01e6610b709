"""The stand-in for ``cupy.cuda.nccl`` on the emulated device: a
communicator whose ``allReduce``, ``reduceScatter`` and ``allGather``
really sum and gather across the MPI ranks (each
rank a process with its own emulated GPU), through MPI underneath, as
device work of the stream it is queued on -- so a CUDA-graph capture
records it, and every replay reduces again.

It refuses what NCCL refuses, with CuPy's ``NcclError`` text:

- two ranks of one communicator on one GPU (``ncclCommInitRank``:
  "Duplicate GPU detected", ncclInvalidUsage). A rank's GPU is
  ``DEVICE[0]`` (``use_emulated_nccl`` sets it per rank; the emulated CuPy has one device);
- ranks that do not agree on the unique id, or a rank out of range;
- a call on an aborted or destroyed communicator.

And where a real NCCL would hang or mix up buffers -- the ranks calling
their collectives in different orders or with different counts -- it
raises (every call first checks with the other ranks what they call).
``CALLS`` logs (rank, count, dtype, stream key, call) of each collective as
it runs (``allReduce``, ``reduceScatter`` (count: the block each rank
receives), ``allGather`` (count: each rank's block)).
"""
import ctypes
import os
import socket

import numpy as np

from . import capture

NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 7, 8, 9
#: bfloat16 travels as its uint16 bits, summed as NCCL does (each step in
#: float32, rounded back: comm/ops.bf16_sum_op, the project's MPI op)
_NUMPY = {NCCL_FLOAT32: np.float32, NCCL_FLOAT64: np.float64, NCCL_BFLOAT16: np.uint16}
INVALID_USAGE = "NCCL_ERROR_INVALID_USAGE: invalid usage (run with NCCL_DEBUG=WARN for details)"
available = True
#: this process's GPU, as NCCL identifies it (bus id); tests set one per rank
DEVICE = {0: 0}
#: (rank, count, dtype name, stream key, call) of every collective run, in order
CALLS = []


class NcclError(RuntimeError):
    """Stands for ``cupy_backends.cuda.libs.nccl.NcclError``."""


def bus_id(device):
    """The PCI bus id of emulated GPU ``device`` (``cupy.cuda.Device.pci_bus_id``)."""
    return f"0000:{0x18 + int(device):02X}:00.0"


def get_version():
    """``ncclGetVersion``: the NCCL this stands for (2.27.0)."""
    return 22700


def get_unique_id():
    """128 bytes, as CuPy returns them (a tuple of ints)."""
    return tuple(int(b) for b in os.urandom(128))


def _mpi():
    from mpi4py import MPI
    return MPI


def _sum(datatype):
    if datatype == NCCL_BFLOAT16:
        from purine_mpi.comm.ops import bf16_sum_op
        return bf16_sum_op()
    return _mpi().SUM


class NcclCommunicator:
    """``NcclCommunicator(ndev, commId, rank)``: a collective over every
    process that makes one with the same id (here: MPI's world)."""

    def __init__(self, ndev, commId, rank):
        MPI = _mpi()
        if len(commId) != 128:
            raise NcclError(INVALID_USAGE)
        self._comm = MPI.COMM_WORLD.Dup()   # collective: every rank makes its communicator
        facts = self._comm.allgather((tuple(commId), int(rank), int(ndev),
                                      socket.gethostname(), bus_id(DEVICE[0])))
        ids = {f[0] for f in facts}
        ranks = sorted(f[1] for f in facts)
        if len(ids) != 1 or ranks != list(range(ndev)) or ndev != self._comm.Get_size():
            self._comm.Free()
            raise NcclError(INVALID_USAGE)
        seen = {}
        for f in facts:
            if (f[3], f[4]) in seen:   # NCCL: "Duplicate GPU detected"
                self._comm.Free()
                raise NcclError(INVALID_USAGE + f" [Duplicate GPU detected: rank {f[1]} and "
                                f"rank {seen[(f[3], f[4])]} both on CUDA device {f[4]}]")
            seen[(f[3], f[4])] = f[1]
        self._rank, self._size, self._state = int(rank), int(ndev), "live"

    def rank_id(self):
        return self._rank

    def size(self):
        return self._size

    def _check(self):
        if self._state != "live":
            raise NcclError(f"NCCL_ERROR_INVALID_ARGUMENT: the communicator is {self._state}")

    def _queue(self, call, sendbuf, recvbuf, count, datatype, op, stream, exchange):
        """Queue collective ``call`` on ``stream`` (a cudaStream_t): device
        work that runs when the stream gets to it (recorded into a capture).
        ``exchange(comm, send array, recv array)`` moves the data; the send
        side is read (copied) first, so in-place calls are exact."""
        self._check()
        if op != NCCL_SUM or datatype not in _NUMPY:
            raise NcclError("NCCL_ERROR_INVALID_ARGUMENT: the emulated NCCL sums float32, "
                            "float64 and bfloat16")
        dtype = np.dtype(_NUMPY[datatype])
        count, sendbuf, recvbuf = int(count), int(sendbuf), int(recvbuf)
        send_n, recv_n = {"allReduce": (count, count),
                          "reduceScatter": (count * self._size, count),
                          "allGather": (count, count * self._size)}[call]
        # NCCL's in-place rule: buffers that overlap must be exactly in place
        # (recvbuff = sendbuff + rank * recvcount for a reduce-scatter,
        # sendbuff = recvbuff + rank * sendcount for an all-gather); any other
        # overlap gives a real NCCL undefined results
        item = dtype.itemsize
        in_place = {"allReduce": recvbuf == sendbuf,
                    "reduceScatter": recvbuf == sendbuf + self._rank * count * item,
                    "allGather": sendbuf == recvbuf + self._rank * count * item}[call]
        if not in_place and sendbuf < recvbuf + recv_n * item and \
                recvbuf < sendbuf + send_n * item:
            raise NcclError(f"NCCL_ERROR_INVALID_USAGE: {call}'s buffers overlap other than "
                            "in place (undefined in a real NCCL)")
        target = capture.stream_of(stream) or capture.DEFAULT_STREAM

        def run():
            self._check()
            # what every rank calls now: NCCL matches calls by order alone
            calls = self._comm.allgather((call, count, dtype.str))
            if len(set(calls)) != 1:
                raise NcclError("NCCL_ERROR_INVALID_USAGE: the ranks called their "
                                f"collectives in different orders or sizes: {calls} (a real "
                                "NCCL hangs or mixes the buffers)")
            send = np.frombuffer((ctypes.c_char * (send_n * dtype.itemsize)).from_address(
                sendbuf), dtype).copy()
            recv = np.frombuffer((ctypes.c_char * (recv_n * dtype.itemsize)).from_address(
                recvbuf), dtype)
            exchange(self._comm, send, recv)
            CALLS.append((self._rank, count, dtype.name, getattr(target, "key", "default"),
                          call))

        capture.device_work(run, target)

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        """``ncclAllReduce``: recvbuf (count) = the sum of every rank's sendbuf."""
        self._queue("allReduce", sendbuf, recvbuf, count, datatype, op, stream,
                    lambda comm, send, recv: comm.Allreduce(send, recv, op=_sum(datatype)))

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        """``ncclReduceScatter``: recvbuf (recvcount) = block ``rank`` of the
        sum of every rank's sendbuf (recvcount x nranks)."""
        self._queue("reduceScatter", sendbuf, recvbuf, recvcount, datatype, op, stream,
                    lambda comm, send, recv: comm.Reduce_scatter_block(
                        send, recv, op=_sum(datatype)))

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        """``ncclAllGather``: recvbuf (count x nranks) = every rank's sendbuf
        (count), rank by rank; in place when sendbuf is recvbuf's block ``rank``."""
        self._queue("allGather", sendbuf, recvbuf, count, datatype, NCCL_SUM, stream,
                    lambda comm, send, recv: comm.Allgather(send, recv))

    def abort(self):
        """``ncclCommAbort``."""
        self._state = "aborted"

    def destroy(self):
        self._state = "destroyed"


def use_emulated_nccl(monkeypatch, fake_cupy, device=0):
    """Make this module ``cupy.cuda.nccl`` of the emulated ``fake_cupy``, this
    process's GPU ``device`` (NCCL's identity of it); clears ``CALLS``."""
    import sys
    from purine_mpi.comm import nccl as project_nccl
    module = sys.modules[__name__]
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", module)
    monkeypatch.setattr(fake_cupy.cuda, "nccl", module, raising=False)
    monkeypatch.setitem(DEVICE, 0, device)

    class Device(fake_cupy.cuda.Device):   # what CuPy says of this process's GPU
        pci_bus_id = bus_id(device)

    monkeypatch.setattr(fake_cupy.cuda, "Device", Device)
    CALLS.clear()
    project_nccl.reset()
    return module
