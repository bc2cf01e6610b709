"""The MPI library's own buffers a rank makes resident as it communicates
(``plan``'s "MPI transport buffers" row, runtime/footprint.py).

MPICH's shared-memory transport between the ranks of a node (ch4 shm
posix, its eager "iqueue") maps one segment (/dev/shm/mpich_shm_*) that
holds every local rank's pool of cells: ``NUM_CELLS`` cells of
``CELL_SIZE`` bytes a rank sends its small messages and the headers of its
large ones in (mpid/common/genq: the cells come from the sender's pool).
Each rank writes its own pool at MPI_Init (first touch: in memory.json's
baseline); the pages of a peer's pool join its resident bytes as it reads
the messages that peer sent it. So a rank that receives from P ranks of
its node holds up to P x NUM_CELLS x CELL_SIZE above the baseline
(measured with /proc/self/smaps in bare mpi4py processes exchanging
Isend/Irecv and Allreduce, the growth levels off at 0.80-0.95 of it,
and it follows both settings: half with 32 cells or 4 KiB cells, twice
with 16 KiB cells; docs/running.md).

The two settings are the library's: ``MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS``
and ``..._CELL_SIZE``, read through the MPI tool interface (MPI_T, which
needs no MPI_Init and sees the environment's overrides), else from the
environment. Where neither says (another MPI library: Open MPI's shared
memory transport has other settings), the row is 0 and ``transport_note``
says the buffers are not counted. With ``MPIR_CVAR_NOLOCAL`` set (MPICH's
own switch: the ranks of a node talk through the network module as if on
different nodes) the cells are never read: the row is 0 and the note says
why (before, it counted them: 1 MiB a rank on 3 ranks, none grew). Not
counted either: UCX's shared-memory
segment (/dev/shm/ucx_shm_posix_*, resident at MPI_Init, in the
baseline) and an inter-node network transport's buffers.
"""
import ctypes
import functools
import os

#: the iqueue's settings: (number of cells a rank's pool has, bytes a cell)
CELL_CVARS = ("MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS",
              "MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_CELL_SIZE")

#: MPICH's switch that keeps the ranks of a node off the shared memory
NOLOCAL_CVAR = "MPIR_CVAR_NOLOCAL"


def _loaded_libmpi():
    """The path of the libmpi this process has loaded already (mpi4py's,
    once ``mpi4py.MPI`` is imported: /proc/self/maps), else None: dlopen of
    that path gives the same library, never a second one."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if os.path.basename(path).startswith("libmpi.so"):
                    return path
    except OSError:
        pass
    return None


def _libmpi():
    """The MPI library this process has loaded (mpi4py's), else the one
    mpi4py would load (its own search: the environment's prefix,
    MPI4PY_LIBMPI), else the system's libmpi, else None."""
    loaded = _loaded_libmpi()
    if loaded is not None:
        try:
            return ctypes.CDLL(loaded)
        except OSError:
            pass
    try:
        from mpi4py._mpiabi import _dlopen_libmpi
        return _dlopen_libmpi()
    except Exception:  # another mpi4py, or no library found there
        pass
    from ctypes.util import find_library
    name = find_library("mpi")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def _read_cvars(names):
    """{name: int} of the control variables ``names`` the MPI library has
    (MPI_T: initialised and finalised here, before or after MPI_Init)."""
    lib = _libmpi()
    if lib is None or not hasattr(lib, "MPI_T_cvar_get_index"):
        return {}
    provided = ctypes.c_int()
    if lib.MPI_T_init_thread(0, ctypes.byref(provided)) != 0:  # MPI_THREAD_SINGLE
        return {}
    out = {}
    try:
        for name in names:
            index = ctypes.c_int()
            if lib.MPI_T_cvar_get_index(name.encode(), ctypes.byref(index)) != 0:
                continue
            handle, count = ctypes.c_void_p(), ctypes.c_int()
            if lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle),
                                           ctypes.byref(count)) != 0:
                continue
            value = (ctypes.c_int64 * max(1, count.value))()  # zeroed: an int's 4 bytes read
            if lib.MPI_T_cvar_read(handle, value) == 0:
                out[name] = ctypes.c_int.from_buffer(value).value
            lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
    finally:
        lib.MPI_T_finalize()
    return out


@functools.lru_cache(maxsize=None)
def _settings():
    """{name: int} of ``CELL_CVARS`` and ``NOLOCAL_CVAR`` from MPI_T (one session)."""
    return _read_cvars(CELL_CVARS + (NOLOCAL_CVAR,))


@functools.lru_cache(maxsize=None)
def shm_cells():
    """(cells a rank's pool has, bytes a cell, where from: "MPI_T" or
    "environment"), or None where unknown."""
    got = _settings()
    if all(got.get(n, 0) > 0 for n in CELL_CVARS):
        return got[CELL_CVARS[0]], got[CELL_CVARS[1]], "MPI_T"
    try:
        env = [int(os.environ[n]) for n in CELL_CVARS]
    except (KeyError, ValueError):
        return None
    return env[0], env[1], "environment"


def no_local_shm():
    """Whether MPICH keeps the node's ranks off its shared memory
    (``MPIR_CVAR_NOLOCAL``: from MPI_T, else the environment)."""
    got = _settings()
    if NOLOCAL_CVAR in got:
        return got[NOLOCAL_CVAR] != 0
    value = os.environ.get(NOLOCAL_CVAR, "0").strip().lower()
    return value not in ("", "0", "no", "false")


def transport_bytes(local_ranks):
    """The bytes of MPI's shared-memory transport a rank among
    ``local_ranks`` ranks of its node holds above its baseline: every other
    local rank's pool of cells (the module docstring); 0 alone on its node,
    under ``MPIR_CVAR_NOLOCAL`` or where the settings are unknown."""
    cells = shm_cells()
    if local_ranks <= 1 or cells is None or no_local_shm():
        return 0
    return (local_ranks - 1) * cells[0] * cells[1]


def transport_note(local_ranks):
    """What the "MPI transport buffers" row stands on, in words (None alone on a node)."""
    if local_ranks <= 1:
        return None
    if no_local_shm():
        return (f"MPI transport buffers: 0 ({NOLOCAL_CVAR} is set: the node's ranks talk "
                "through MPI's network module, not its shared-memory cells)")
    cells = shm_cells()
    if cells is None:
        return ("MPI transport buffers: not counted (the MPI library reports no "
                f"{CELL_CVARS[0]} / {CELL_CVARS[1]}: not MPICH's shared-memory transport)")
    return (f"MPI transport buffers: {local_ranks - 1} local peer(s) x {cells[0]} cells x "
            f"{cells[1]} bytes (MPICH's shared-memory cells, from {cells[2]})")
