"""MPI's functions not found through ctypes in mpi4py's extension (MPI
linked into it with hidden symbols, another mpi4py build): ctypes.CDLL is
patched so that every ``MPI_*`` symbol lookup in mpi4py's extension fails
(mpi4py's own search for the library, by name, is left alone). MPI must still start
(mpi4py's MPI.Init_thread, at the level mpi4py asks for) and ``train``'s end
must still finalize it (comm/world.py, ``finalize_mpi``: mpi4py's
MPI.Finalize). Prints one line per rank; exits 0."""
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_CDLL = ctypes.CDLL


class HiddenMPI(_CDLL):
    def _hidden(self, name):
        return isinstance(name, str) and name.startswith("MPI_") and \
            os.path.basename(str(self._name)).startswith("MPI.")

    def __getattr__(self, name):
        if self._hidden(name):
            raise AttributeError(f"{self._name}: undefined symbol: {name}")
        return super().__getattr__(name)

    def __getitem__(self, name):
        if self._hidden(name):
            raise AttributeError(f"{self._name}: undefined symbol: {name}")
        return super().__getitem__(name)


ctypes.CDLL = HiddenMPI

from purine_mpi.comm.mpi_init import import_mpi  # noqa: E402
from purine_mpi.comm.world import finalize_mpi  # noqa: E402

MPI = import_mpi()
assert not hasattr(ctypes.CDLL(MPI.__file__), "MPI_Finalize")
assert MPI.Is_initialized() and MPI.Query_thread() == MPI.THREAD_MULTIPLE, MPI.Query_thread()
assert MPI.COMM_WORLD.Get_errhandler() == MPI.ERRORS_RETURN
rank = MPI.COMM_WORLD.Get_rank()
MPI.COMM_WORLD.Barrier()
assert finalize_mpi(0) is True
assert MPI.Is_finalized()
print(f"rank {rank}: finalized without ctypes", flush=True)
