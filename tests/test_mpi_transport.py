"""plan's "MPI transport buffers" row (comm/mpi_transport.py) against what
MPI's shared-memory transport makes resident in bare mpi4py processes."""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: under mpiexec: every rank sends 64 messages at once to every other
#: (100 and 4000 bytes: eager, in the cells), 20 rounds, then an Allreduce
#: and an Isend/Irecv of 4 MiB; each rank's growth of the resident pages of
#: /dev/shm/mpich_shm_* since just after MPI_Init (memory.json's baseline
#: is read after it), against ``transport_bytes`` of the node's ranks
_PROBE = """
import json, sys
import numpy as np
from mpi4py import MPI
from purine_mpi.comm.mpi_transport import transport_bytes
def shm():
    cur, out = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            p = line.split()
            if "-" in p[0] and not p[0].endswith(":"):
                cur = len(p) > 5 and "/dev/shm/mpich_shm" in p[5]
            elif p[0] == "Rss:" and cur:
                out += int(p[1]) * 1024
    return out
comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
base = shm()
for n in (100, 4000):
    a = np.ones(n // 4, np.float32)
    b = [np.empty_like(a) for _ in range(64)]
    for _ in range(20):
        reqs = []
        for peer in range(size):
            if peer != rank:
                reqs += [comm.Irecv(b[i], source=peer, tag=i) for i in range(64)]
                reqs += [comm.Isend(a, dest=peer, tag=i) for i in range(64)]
        MPI.Request.Waitall(reqs)
big = np.ones(1 << 20, np.float32)
comm.Allreduce(MPI.IN_PLACE, big)
peer = (rank + 1) % size
MPI.Request.Waitall([comm.Isend(big, dest=peer), comm.Irecv(np.empty_like(big),
                                                            source=(rank - 1) % size)])
comm.Barrier()
got = comm.gather(shm() - base, 0)
if rank == 0:
    print(json.dumps({"grown": got, "planned": transport_bytes(size)}))
"""


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found")
def test_transport_row_is_what_mpi_s_cells_hold():
    """3 ranks on this node, each receiving from both others: the resident
    bytes MPICH's shared-memory segment gains on every rank are at most the
    row (2 peers x NUM_CELLS x CELL_SIZE, from MPI_T), and the rank that
    gains most reaches at least 70% of it (measured 0.80-0.95 on 2-4 ranks:
    a cell's pages a message does not reach stay out). How many cells a
    rank's messages reach depends on the timing: a receiver that keeps up
    frees each cell at once and the sender reuses it (CI under load measured
    0.87, 0.81 and 0.50 on the three ranks of one run), so a run whose
    largest growth stays under 70% is tried again, up to 3 times; the upper
    bound -- what plan relies on -- holds in every run. Before, plan counted
    nothing for them (test_plan_rss.py's parameter-server ranks measured
    4.0-5.9% above plan, 2.8-4.8% with the row in two runs under load; the
    sync_ps workers 5.3-5.6% in quiet runs, the 10-13 MiB every process
    holds unplanned: docs/running.md)."""
    from purine_mpi.comm.mpi_transport import shm_cells
    if shm_cells() is None:
        pytest.skip("the MPI library has no MPICH shared-memory cells")
    runs = []
    for _ in range(3):
        p = subprocess.run(["mpiexec", "-n", "3", sys.executable, "-c", _PROBE],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert p.returncode == 0, p.stderr
        got = json.loads(p.stdout.strip().splitlines()[-1])
        if not any(got["grown"]):
            pytest.skip("no /dev/shm/mpich_shm segment: another shared-memory transport")
        runs.append(got)
        for grown in got["grown"]:
            assert grown <= got["planned"], runs
        if max(got["grown"]) >= 0.7 * got["planned"]:
            break
    assert max(got["grown"]) >= 0.7 * got["planned"], runs


def test_transport_settings_are_the_library_s():
    """The cells' settings come from MPI_T, the environment's overrides
    included (MPICH reads them there): 32 cells halve the row; one rank
    alone on its node holds none."""
    from purine_mpi.comm.mpi_transport import shm_cells, transport_bytes
    if shm_cells() is None:
        pytest.skip("the MPI library has no MPICH shared-memory cells")
    code = ("from purine_mpi.comm.mpi_transport import shm_cells, transport_bytes;"
            "print(list(shm_cells()), transport_bytes(3))")
    env = dict(os.environ, MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS="32")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    cells, size, where = shm_cells()
    assert p.stdout.split() == ["[32,", f"{size},", "'MPI_T']", str(2 * 32 * size)]
    # MPIR_CVAR_NOLOCAL, as MPICH reads it (MPI_T): no cells are read, none counted
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, MPIR_CVAR_NOLOCAL="1"), cwd=ROOT, timeout=60)
    assert p.returncode == 0 and p.stdout.split()[-1] == "0", (p.stdout, p.stderr)
    assert transport_bytes(3) == 2 * cells * size and transport_bytes(1) == 0


class _FakeMPIT:
    """An MPI library's tool interface (comm/mpi_transport._read_cvars's
    ctypes calls): ``cvars`` {name: value} it knows (none: Open MPI, whose
    shared-memory transport has other settings), ``broken`` the names whose
    read fails; it records the sessions and handles left open."""

    def __init__(self, cvars, broken=(), init_fails=False):
        self.names, self.cvars, self.broken = list(cvars), cvars, broken
        self.init_fails, self.sessions, self.handles = init_fails, 0, set()

    def MPI_T_init_thread(self, required, provided):
        if self.init_fails:
            return 1
        self.sessions += 1
        return 0

    def MPI_T_finalize(self):
        self.sessions -= 1
        return 0

    def MPI_T_cvar_get_index(self, name, index):
        if name.decode() not in self.cvars:
            return 1  # MPI_T_ERR_INVALID_NAME
        index._obj.value = self.names.index(name.decode())
        return 0

    def MPI_T_cvar_handle_alloc(self, index, obj, handle, count):
        handle._obj.value, count._obj.value = 1000 + index.value, 1
        self.handles.add(handle._obj.value)
        return 0

    def MPI_T_cvar_read(self, handle, buf):
        name = self.names[handle.value - 1000]
        if name in self.broken:
            return 1
        buf[0] = self.cvars[name]
        return 0

    def MPI_T_cvar_handle_free(self, handle):
        self.handles.remove(handle._obj.value)
        return 0


@pytest.fixture
def fake_library(monkeypatch):
    """Put a library of one's own under ``shm_cells`` (its cache cleared
    before and after, so no other test sees it)."""
    from purine_mpi.comm import mpi_transport as mt
    for n in mt.CELL_CVARS:
        monkeypatch.delenv(n, raising=False)
    monkeypatch.delenv(mt.NOLOCAL_CVAR, raising=False)
    mt.shm_cells.cache_clear()
    mt._settings.cache_clear()

    def use(lib):
        monkeypatch.setattr(mt, "_libmpi", lambda: lib)
        mt.shm_cells.cache_clear()
        mt._settings.cache_clear()
        return mt
    yield use
    mt.shm_cells.cache_clear()
    mt._settings.cache_clear()


def test_another_library_counts_no_cells_and_leaves_nothing_open(fake_library, monkeypatch):
    """Without MPICH's settings the row is 0 and the note says so: a library
    whose MPI_T lacks the names (Open MPI), one without MPI_T, one whose
    MPI_T will not start, one whose read fails; every handle freed, every
    MPI_T session finalized. The environment's values stand in where MPI_T
    does not say."""
    from types import SimpleNamespace
    num, size = 96, 4096
    mpich = _FakeMPIT({"MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS": num,
                       "MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_CELL_SIZE": size})
    mt = fake_library(mpich)
    assert mt.shm_cells() == (num, size, "MPI_T") and mt.transport_bytes(4) == 3 * num * size
    assert "3 local peer(s) x 96 cells x 4096 bytes" in mt.transport_note(4)
    assert mpich.sessions == 0 and not mpich.handles
    half = _FakeMPIT(dict(mpich.cvars), broken=("MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_CELL_SIZE",))
    for lib in (_FakeMPIT({}), SimpleNamespace(), _FakeMPIT(mpich.cvars, init_fails=True), half):
        mt = fake_library(lib)
        assert mt.shm_cells() is None and mt.transport_bytes(3) == 0, lib
        assert "not counted" in mt.transport_note(3) and mt.transport_note(1) is None
        assert getattr(lib, "sessions", 0) == 0 and not getattr(lib, "handles", ()), lib
    monkeypatch.setenv("MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS", "32")
    monkeypatch.setenv("MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_CELL_SIZE", "8192")
    mt = fake_library(_FakeMPIT({}))
    assert mt.shm_cells() == (32, 8192, "environment") and mt.transport_bytes(2) == 32 * 8192


def test_nolocal_counts_no_cells(fake_library, monkeypatch):
    """MPICH's ``MPIR_CVAR_NOLOCAL`` keeps a node's ranks off the shared
    memory: the row is 0 and the note says why, from MPI_T or else the
    environment. Before, the row counted the cells: 1 MiB a rank on 3
    ranks, where the segment grew by 0 (tests/test_mpi_transport.py's probe
    under MPIR_CVAR_NOLOCAL=1: 'grown': [0, 0, 0], 'planned': 1048576)."""
    cells = {"MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS": 64,
             "MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_CELL_SIZE": 8192}
    mt = fake_library(_FakeMPIT({**cells, "MPIR_CVAR_NOLOCAL": 1}))
    assert mt.transport_bytes(3) == 0 and "MPIR_CVAR_NOLOCAL" in mt.transport_note(3)
    mt = fake_library(_FakeMPIT({**cells, "MPIR_CVAR_NOLOCAL": 0}))
    assert mt.transport_bytes(3) == 2 * 64 * 8192
    monkeypatch.setenv("MPIR_CVAR_NOLOCAL", "1")
    mt = fake_library(_FakeMPIT(cells))  # a library whose MPI_T does not say
    assert mt.transport_bytes(3) == 0


def test_the_settings_come_from_the_library_mpi4py_loaded():
    """Once mpi4py has loaded its libmpi, MPI_T is asked of that library
    (/proc/self/maps), never of a second one found on the system; before,
    the reader went through mpi4py's private loader (``_mpiabi``), which
    may pick another file. A subprocess: this one's mpi4py may be loaded."""
    code = ("from mpi4py import MPI\n"
            "from purine_mpi.comm import mpi_transport as t\n"
            "import os\n"
            "path = t._loaded_libmpi()\n"
            "assert path and os.path.basename(path).startswith('libmpi.so'), path\n"
            "lib = t._libmpi()\n"
            "assert lib._name == path, (lib._name, path)\n"
            "print(t.shm_cells())\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
