"""When MPICH allocates a block of its objects: glibc's mapped bytes
(``mallinfo2``'s ``hblkhd``) on each rank as a bare mpi4py process makes
communicators (``Dup``, kept) one after another, and as it posts N
nonblocking collectives at once (``Iallreduce``, ``Iallgatherv``,
``Ireduce_scatter``: scheme sharded's and the data-parallel buckets'),
waited together, for N = 1, 2, 4, ... 64. The blocks are MPICH's, made when
a kind of object outgrows what it preallocated (no MPI_T variable gives
their sizes); docs/running.md ("Will it fit?") names those a run holds
above its baseline (benchmarks/big_mallocs.py):

    mpiexec -n 2 python benchmarks/mpi_object_blocks.py

Prints one line a rank and kind: KiB mapped after each step. Linux and
glibc only.
"""
import ctypes

import numpy as np
from mpi4py import MPI

FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
          "uordblks", "fordblks", "keepcost")


class _Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _Info


def mapped_kib():
    """glibc's mapped chunks now, KiB."""
    return _LIBC.mallinfo2().hblkhd >> 10


def communicators(world, count=8):
    """[(communicators made, KiB mapped)] as ``count`` Dups are kept."""
    kept, out = [], []
    for i in range(count):
        kept.append(world.Dup())
        out.append((i + 1, mapped_kib()))
    for c in kept:
        c.Free()
    return out


def collectives(comm, kind, counts=(1, 2, 4, 8, 16, 32, 64)):
    """[(N posted at once, KiB mapped after they completed)] of ``kind``."""
    size, out = comm.Get_size(), []
    for n in counts:
        bufs = [np.ones(256 * size, np.float32) for _ in range(n)]
        recv = [np.empty(256 * size, np.float32) for _ in range(n)]
        if kind == "Iallreduce":
            reqs = [comm.Iallreduce(MPI.IN_PLACE, b, op=MPI.SUM) for b in bufs]
        elif kind == "Iallgatherv":
            reqs = [comm.Iallgatherv(b[:256], [r, [256] * size, [256 * i for i in range(size)],
                                               MPI.FLOAT]) for b, r in zip(bufs, recv)]
        else:
            reqs = [comm.Ireduce_scatter(MPI.IN_PLACE, [b, MPI.FLOAT],
                                         recvcounts=[256] * size) for b in bufs]
        MPI.Request.Waitall(reqs)
        out.append((n, mapped_kib()))
    return out


def main():
    world = MPI.COMM_WORLD
    lines = [f"rank {world.rank} communicators (made, KiB): {communicators(world)}"]
    comm = world.Dup()
    for kind in ("Iallreduce", "Iallgatherv", "Ireduce_scatter"):
        lines.append(f"rank {world.rank} {kind} (at once, KiB): {collectives(comm, kind)}")
    comm.Free()
    every = world.gather("\n".join(lines))
    if world.rank == 0:
        print("\n".join(every))


if __name__ == "__main__":
    main()
