"""Remote memory as a device: MPI-3 windows allocated once, with named
regions, notify words and one-sided put/get/accumulate (the memory
interface of the RDMA paper, Xue et al., EuroSys 2019).

- every rank declares the same layout (comm/window_layout.py: regions and
  int64 notify words, each with its owner and the ranks that access it);
- ``Windows.allocate(world, layout)`` allocates, collectively and once, a
  *shared* window (``MPI.Win.Allocate_shared`` on the ranks of one node:
  load/store access to each other's memory) for the regions whose owner
  and peers share a node, an *RMA* window (``MPI.Win.Allocate``: memory the
  library registers for RDMA) for the others, and opens one passive-target
  epoch on each (``Lock_all``, closed only by ``free``); ``pair_transport``
  says which pairs of ranks get windows at all;
- ``put`` / ``rput`` / ``get`` / ``rget`` / ``accumulate`` move data into or out of a
  region of any rank; ``view(name)`` is the owner's memory itself where this
  rank can address it (one node: a producer may compute straight into it),
  else None;
- ``notify(word, value)`` adds to a word after the data it announces is
  complete at its target (``Win_flush``, ``Win_sync``: a memory barrier);
  ``notified(word)`` reads a word (then what was notified before is
  visible); ``wait_notified(word, count)`` polls under a stall timeout,
  driving MPI's progress on an RMA word. Words only grow;
- ``free()`` closes the epochs, frees the windows (collective; says so with
  ``PURINE_DEBUG_WINDOWS=1``); ``free_all()`` every live ``Windows``, at exit
  and before any MPI_Finalize. An aborting rank frees nothing.

Counters: ``bytes_put``, ``bytes_got``, ``bytes_accumulated`` (moved by MPI),
``bytes_copied`` (by the CPU). MPI calls hold ``comm.world.MPI_LOCK``. All is
MPI-3.0 (windows, ``Lock_all``, ``Flush``, ``Fetch_and_op``, ``Win_sync``), not
MPICH's own; a library that cannot allocate a window gives
``WindowsUnavailable`` on every rank (``auto`` then keeps two-sided):
``allocate_or_fall_back`` is that choice, for every transport pass.
"""
import atexit
import os
import threading
import time

import numpy as np

from ..base import env
from ..base.errors import StallError, UserError
from .window_layout import ALIGN, MemoryDevice, WindowLayout
from .world import FINALIZE_HOOKS, MPI_LOCK

TRANSPORTS = ("auto", "one_sided", "two_sided")


class WindowsUnavailable(RuntimeError):
    """The MPI library could not allocate a window (no RMA support)."""


def allocate_or_fall_back(world, layout, node_of, fallback, refuse=None):
    """A transport pass's windows (parallel/one_sided.py, dp_windows.py,
    ps_windows.py): ``(Windows, None)`` once ``layout``'s windows are
    allocated (collective); where the MPI library cannot allocate them,
    ``(None, fallback(exc))`` on every rank: the pass keeps its two-sided
    ops and says why. ``refuse``: the config's path where windows were asked
    for and nothing may stand in for them (``parallel.transport: one_sided``
    on pairs of ranks): a UserError (exit 2) naming the key instead."""
    try:
        return Windows.allocate(world, layout, node_of), None
    except WindowsUnavailable as exc:
        if refuse is not None:
            raise UserError(f"{refuse}: key 'parallel.transport': one_sided, but {exc}; "
                            "use auto or two_sided") from None
        return None, fallback(exc)


# ------------------------------------------------------------------ transport
def fake_host_of(rank):
    """The emulated host of ``rank`` under ``PURINE_RANKS_PER_HOST=N``
    (ranks r with equal r // N), else None."""
    per = env.get("PURINE_RANKS_PER_HOST")
    return None if per is None else int(rank) // per


def node_groups(world):
    """{rank: node index}: ranks that share memory (``MPI_COMM_TYPE_SHARED``)
    and one host of the world's host table (two network namespaces count as
    two hosts; ``PURINE_RANKS_PER_HOST`` splits further). One allgather."""
    from mpi4py import MPI
    with MPI_LOCK:
        node = world.comm.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
        try:
            leader = node.allreduce(world.rank, op=MPI.MIN)
        finally:
            node.Free()
    fake = fake_host_of(world.rank)
    host = world.hosts.host_of[world.rank] if getattr(world, "hosts", None) else 0
    keys = world.allgather_object((leader, host, fake), "the node table exchange")
    index = {}
    return {r: index.setdefault(k, len(index)) for r, k in enumerate(keys)}


def rma_across_hosts():
    """(bool, why): whether ``auto`` uses RMA windows between hosts, as this
    rank sees it (a job's ranks agree on it first): ``PURINE_RMA_ACROSS_HOSTS``
    when set, else where the network does RDMA (libfabric verbs, psm2/3,
    cxi, efa; UCX InfiniBand transports; else /sys/class/infiniband)."""
    given = env.get("PURINE_RMA_ACROSS_HOSTS")
    if given is not None:
        return given, f"PURINE_RMA_ACROSS_HOSTS={int(given)}"
    provider = os.environ.get("FI_PROVIDER", "").lower()
    if any(p in provider for p in ("verbs", "psm", "cxi", "efa", "opx")):
        return True, f"libfabric provider {provider} does RDMA"
    tls = os.environ.get("UCX_TLS", "").lower()
    if any(t in tls for t in ("rc", "dc", "ud", "ib")):
        return True, f"UCX transports {tls} do RDMA"
    if not provider and not tls:
        ib = "/sys/class/infiniband"
        devices = sorted(os.listdir(ib)) if os.path.isdir(ib) else []
        if devices:
            return True, f"RDMA devices {', '.join(devices[:3])}"
    return False, ("no RDMA network detected (FI_PROVIDER, UCX_TLS, /sys/class/infiniband): "
                   "the library would emulate RMA over TCP")


def pair_transport(transport, node_of, a, b, rma_ok=True, across=None):
    """(kind, why) for transfers between ranks ``a`` and ``b``: kind is
    "shared", "rma" or "two_sided". The same on every rank (a function of
    the config, the node table and the library); ``across``: the (bool,
    why) of ``rma_across_hosts`` the ranks agreed on (default: this rank's)."""
    if transport not in TRANSPORTS:
        raise UserError(f"parallel.transport must be one of {', '.join(TRANSPORTS)}, "
                        f"got {transport!r}")
    same = node_of[a] == node_of[b]
    if transport == "two_sided":
        return "two_sided", "parallel.transport: two_sided"
    if same:
        return "shared", "ranks of one node: load/store into each other's memory"
    if transport == "one_sided":
        return "rma", "parallel.transport: one_sided, ranks on two hosts: an RMA window"
    if not rma_ok:
        return "two_sided", "the MPI library allocates no RMA window"
    ok, why = across if across is not None else rma_across_hosts()
    return ("rma" if ok else "two_sided"), f"ranks on two hosts, {why}"


# ------------------------------------------------------------------ windows
_LIVE = []


class Windows(MemoryDevice):
    """The windows of one layout (see the module docstring). Make it with
    ``Windows.allocate``; every rank of ``world`` calls it alike."""

    kind = "host"

    def __init__(self, world, layout, node_of):
        self.world = world
        self.layout = layout
        self.node_of = dict(node_of)
        self.rank = world.rank
        self.wins = {}       # "shared" / "rma" -> MPI.Win
        self.node_comm = None
        self.node_rank = {}  # world rank -> rank in node_comm (same node only)
        self._bases = {}     # (where, owner) -> np.uint8 array of the owner's segment
        self.bytes_put = self.bytes_got = self.bytes_accumulated = self.bytes_copied = 0
        self.unified = False  # the RMA window's memory model is MPI_WIN_UNIFIED
        self._words = {}     # word name -> loadable int64 array, or None
        self._counts = {}    # single-writer words this rank notifies: their counts
        self.freed, self._lock = False, threading.Lock()

    # ---------------------------------------------------------- allocation
    @classmethod
    def allocate(cls, world, layout, node_of=None):
        """Allocate the layout's windows once (collective on ``world.comm``,
        the same calls in the same order on every rank). ``node_of``: the
        node table (``node_groups(world)`` when None). Raises
        ``WindowsUnavailable`` on every rank when any rank's library could
        not allocate a window."""
        if not isinstance(layout, WindowLayout):
            raise TypeError(f"Windows.allocate takes a WindowLayout, got {type(layout).__name__}")
        if node_of is None:
            node_of = node_groups(world)
        self = cls(world, layout, node_of)
        sizes = layout.place(node_of)
        wheres = {w for (w, _o) in sizes}
        try:
            if "shared" in wheres:
                self._allocate_shared(sizes)
            if "rma" in wheres:
                self._allocate_rma(sizes)
        except WindowsUnavailable:
            self._release()
            raise
        _LIVE.append(self)
        return self

    def _agree(self, ok, what):
        """Every rank learns whether every rank succeeded (one allreduce)."""
        bad = self.world.allreduce(np.array([0 if ok else 1], np.int64), "max",
                                   what=f"the {what} check")
        if int(bad[0]):
            raise WindowsUnavailable(f"the MPI library could not allocate the {what} "
                                     "on some rank")

    def _allocate_shared(self, sizes):
        from mpi4py import MPI
        with MPI_LOCK:
            me = self.node_of[self.rank]
            self.node_comm = self.world.comm.Split(me, self.rank)
            ranks = [r for r in range(self.world.size) if self.node_of[r] == me]
            self.node_rank = {r: i for i, r in enumerate(ranks)}
            info = MPI.Info.Create()
            info.Set("alloc_shared_noncontig", "true")
            win, err = None, None
            try:
                win = MPI.Win.Allocate_shared(max(sizes.get(("shared", self.rank), 0), ALIGN),
                                              1, info, comm=self.node_comm)
            except Exception as exc:  # noqa: BLE001  (any library failure: fall back)
                err = exc
            finally:
                info.Free()
        self._agree(err is None, "shared window")
        self.wins["shared"] = win
        with MPI_LOCK:
            for r in ranks:
                mem, _unit = win.Shared_query(self.node_rank[r])
                self._bases[("shared", r)] = np.frombuffer(mem, dtype=np.uint8)
            win.Lock_all(MPI.MODE_NOCHECK)

    def _allocate_rma(self, sizes):
        from mpi4py import MPI
        win, err = None, None
        with MPI_LOCK:
            try:
                win = MPI.Win.Allocate(max(sizes.get(("rma", self.rank), 0), ALIGN), 1,
                                       comm=self.world.comm)
            except Exception as exc:  # noqa: BLE001
                err = exc
        self._agree(err is None, "RMA window")
        self.wins["rma"] = win
        with MPI_LOCK:
            self._bases[("rma", self.rank)] = np.frombuffer(win.tomemory(), dtype=np.uint8)
            self.unified = win.Get_attr(MPI.WIN_MODEL) == MPI.WIN_UNIFIED
            win.Lock_all(MPI.MODE_NOCHECK)

    # ---------------------------------------------------------- addressing
    def region(self, name):
        r = self.layout.regions.get(name) or self.layout.words.get(name)
        if r is None:
            raise KeyError(f"no window region or notify word '{name}'")
        return r

    def owner(self, name):
        return self.region(name).owner

    def where(self, name):
        """"shared" or "rma": the window that holds ``name``."""
        return self.region(name).where

    def _array(self, r, base):
        return base[r.offset:r.offset + r.nbytes].view(r.dtype).reshape(r.shape)

    def local(self, name):
        """The owner's own array of region ``name`` (only on its owner)."""
        r = self.region(name)
        if r.owner != self.rank:
            raise ValueError(f"rank {self.rank} does not own window region '{name}' "
                             f"(rank {r.owner} does)")
        return self._array(r, self._bases[(r.where, r.owner)])

    def view(self, name):
        """The owner's memory of region ``name`` as an array this rank may
        load from and store into (a shared window on one node), else None."""
        r = self.region(name)
        base = self._bases.get((r.where, r.owner))
        return None if base is None else self._array(r, base)

    def _target(self, r, offset, count):
        """(window, target rank, target spec in bytes) for an RMA call."""
        from mpi4py import MPI
        win = self.wins[r.where]
        rank = self.node_rank[r.owner] if r.where == "shared" else r.owner
        disp = r.offset + offset * r.dtype.itemsize
        return win, rank, (disp, count * r.dtype.itemsize, MPI.BYTE)

    @staticmethod
    def _flat(src, r):
        a = np.ascontiguousarray(src)
        if a.dtype != r.dtype:
            raise ValueError(f"window region '{r.name}' holds {r.dtype}, got {a.dtype}")
        return a.reshape(-1)

    # ---------------------------------------------------------- data
    def put(self, name, src, offset=0):
        """Write ``src`` into region ``name`` at element ``offset``, complete
        at its target on return (a copy into shared memory, or Put+Flush)."""
        req = self.rput(name, src, offset)
        if req is not None:
            with MPI_LOCK:
                req.Wait()
            self.flush(name)

    def rput(self, name, src, offset=0):
        """Start writing ``src`` into region ``name``: a request (``MPI_Rput``,
        local completion) to test, then ``flush(name)`` for completion at the
        target; None when it was a store into shared memory (done)."""
        r = self.region(name)
        a = self._flat(src, r)
        view = self.view(name)
        if view is not None and r.where == "shared":
            flat = view.reshape(-1)[offset:offset + a.size]
            if not np.may_share_memory(flat, a):
                np.copyto(flat, a)
                self.bytes_copied += a.nbytes
            return None
        win, rank, target = self._target(r, offset, a.size)
        with MPI_LOCK:
            req = win.Rput(_bytes(a), rank, target)
        self.bytes_put += a.nbytes
        return req

    def _read_here(self, what, name, out, offset, own=False):
        """(region ``name``, whether it was read into ``out`` here): a load
        where the region is in shared memory (or, with ``own``, this rank's
        own RMA region), after a ``Win_sync``; ``out`` checked first."""
        r = self.region(name)
        if not out.flags.c_contiguous or out.dtype != r.dtype:
            raise ValueError(f"{what} '{name}': out must be a contiguous {r.dtype} array")
        view = self.view(name)
        if view is None or not (r.where == "shared" or (own and r.owner == self.rank)):
            return r, False
        with MPI_LOCK:
            self.wins[r.where].Sync()
        np.copyto(out.reshape(-1), view.reshape(-1)[offset:offset + out.size])
        self.bytes_copied += out.nbytes
        return r, True

    def get(self, name, out, offset=0):
        """Read region ``name`` (from element ``offset``) into ``out``."""
        r, done = self._read_here("get", name, out, offset)
        if done:
            return out
        win, rank, target = self._target(r, offset, out.size)
        with MPI_LOCK:
            win.Get(_bytes(out), rank, target)
            win.Flush(rank)
        self.bytes_got += out.nbytes
        return out

    def rget(self, name, out, offset=0):
        """Start reading region ``name`` (from element ``offset``) into
        ``out``: a request (``MPI_Rget``; the data is in ``out`` once it
        completes, no flush needed) to test; None when it was a load from
        shared memory (done)."""
        r, done = self._read_here("rget", name, out, offset, own=True)
        if done:
            return None
        win, rank, target = self._target(r, offset, out.size)
        with MPI_LOCK:
            req = win.Rget(_bytes(out), rank, target)
        self.bytes_got += out.nbytes
        return req

    def accumulate(self, name, src, offset=0):
        """Region ``name`` += ``src`` element-wise, atomically per element
        against other accumulates (``MPI_Accumulate`` SUM); complete at the
        target on return."""
        from mpi4py import MPI
        from mpi4py.util.dtlib import from_numpy_dtype
        r = self.region(name)
        a = self._flat(src, r)
        win, rank, (disp, _n, _t) = self._target(r, offset, a.size)
        mtype = from_numpy_dtype(r.dtype)
        with MPI_LOCK:
            win.Accumulate([a, mtype], rank, (disp, a.size, mtype), op=MPI.SUM)
            win.Flush(rank)
        self.bytes_accumulated += a.nbytes

    def flush(self, name):
        """Complete, at the target, every put this rank issued to ``name``'s
        owner (``Win_flush``; a memory barrier for shared memory)."""
        r = self.region(name)
        win, rank, _ = self._target(r, 0, 0)
        with MPI_LOCK:
            if r.where == "shared":
                win.Sync()
            else:
                win.Flush(rank)

    # ---------------------------------------------------------- notify words
    def notify(self, word, value=1):
        """Add ``value`` to notify word ``word`` (at its owner), after every
        earlier write of this rank to that owner is complete there."""
        from mpi4py import MPI
        r = self.region(word)
        win, rank, (disp, _n, _t) = self._target(r, 0, 1)
        writer = getattr(r, "writer", None)
        if writer is not None and writer != self.rank:
            raise ValueError(f"rank {self.rank} notifies word '{word}', whose one writer is "
                             f"rank {writer}")
        if writer is not None and r.where == "shared":  # the one writer: barrier, store
            count = self._counts[word] = self._counts.get(word, 0) + value
            local = self._loadable(r)
            with MPI_LOCK:
                self._complete_all()  # the data before the count
                local[0] = count
                win.Sync()
            return
        one = np.array([value], np.int64)
        old = np.zeros(1, np.int64)
        with MPI_LOCK:
            self._complete_all()  # the data may lie in the other window
            win.Fetch_and_op([one, MPI.INT64_T], [old, MPI.INT64_T], rank, disp, op=MPI.SUM)
            win.Flush(rank)

    def notified(self, word):
        """The current count of notify word ``word`` (of any rank; the writes
        notified before it are visible to this rank once it is read). A word
        in memory this rank can load (a shared window, or its own word of
        an RMA window under MPI's unified memory model) is read by a load,
        then ``Win_sync`` (a memory barrier); another rank's by
        ``MPI_Fetch_and_op`` NO_OP."""
        from mpi4py import MPI
        r = self.region(word)
        win, rank, (disp, _n, _t) = self._target(r, 0, 1)
        local = self._loadable(r)
        if local is not None:
            with MPI_LOCK:
                value = int(local[0])  # an aligned int64: read whole
                for other in self.wins.values():  # later loads see what was notified
                    other.Sync()
            return value
        old = np.zeros(1, np.int64)
        with MPI_LOCK:
            win.Fetch_and_op([old, MPI.INT64_T], [old, MPI.INT64_T], rank, disp, op=MPI.NO_OP)
            win.Flush(rank)
            for other in self.wins.values():
                other.Sync()
        return int(old[0])

    def _loadable(self, r):
        """The int64 array of word ``r`` where this rank may load it, else None."""
        cached = self._words.get(r.name, False)
        if cached is not False:
            return cached
        view = None
        if r.where == "shared" or (r.owner == self.rank and self.unified):
            view = self.view(r.name)
        self._words[r.name] = view
        return view

    def _complete_all(self):
        """Every earlier write of this rank complete at its target: a memory
        barrier on the shared window, ``Win_flush_all`` on the RMA one."""
        for where, win in self.wins.items():
            if where == "shared":
                win.Sync()
            else:
                win.Flush_all()

    def wait_notified(self, word, count, timeout=300.0, what=None):
        """Poll word ``word`` until ``count``; StallError naming ``what`` after ``timeout`` s."""
        start, pause = time.monotonic(), 20e-6
        rma = self.region(word).where == "rma"
        while True:
            value = self.notified(word)
            if value >= count:
                return value
            if rma:  # MPI progress: software RMA (over TCP) applies a Put in an MPI call
                with MPI_LOCK:
                    self.world.comm.Iprobe()
            if time.monotonic() - start > timeout:
                raise StallError(f"rank {self.rank}: {what or f'a wait for notify word {word}'} "
                                 f"stalled for more than {timeout:g} s (count {value} of "
                                 f"{count}): a peer rank stopped responding")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)  # back off to 1 ms: pollers share the cores

    # ---------------------------------------------------------- freeing
    def free(self):
        """Close the epochs and free the windows (collective: every rank of
        the world calls it; a second call is a no-op)."""
        with self._lock:
            if self.freed:
                return
            self.freed = True
        self._release()
        if self in _LIVE:
            _LIVE.remove(self)

    def _release(self):
        from mpi4py import MPI
        if MPI.Is_finalized():
            return
        self._bases.clear()
        self._words.clear()
        freed = []
        with MPI_LOCK:
            for where in ("rma", "shared"):  # reverse of allocation, on every rank
                win = self.wins.pop(where, None)
                if win is None:
                    continue
                try:
                    win.Unlock_all()
                except MPI.Exception:
                    pass  # the epoch was never opened (a failed allocation)
                win.Free()
                freed.append(where)
            if self.node_comm is not None:
                self.node_comm.Free()
                self.node_comm = None
        if freed and env.get("PURINE_DEBUG_WINDOWS"):  # tests: every exit path frees them
            os.write(2, f"rank {self.rank}: windows freed ({', '.join(freed)})\n".encode())

    def peer_resident_bytes(self):
        """The pages of the other ranks' regions of this shared window that
        are resident in this process (base/rss.mapped_resident_bytes): a
        page of a peer's region that this rank stored into or loaded from
        counts in its resident bytes as well as in its owner's, while
        ``plan`` counts each region once, on its owner (the node holds it
        once). 0 without a shared window; None where /proc is missing."""
        from ..base.rss import mapped_resident_bytes
        total = 0
        for (where, r), base in list(self._bases.items()):
            if where != "shared" or r == self.rank:
                continue
            got = mapped_resident_bytes(base)
            if got is None:
                return None
            total += got
        return total

    def counters(self):
        return {"bytes_put": self.bytes_put, "bytes_got": self.bytes_got,
                "bytes_accumulated": self.bytes_accumulated, "bytes_copied": self.bytes_copied}


def _bytes(a):
    from mpi4py import MPI
    return [a.view(np.uint8) if a.ndim else a.reshape(1).view(np.uint8), MPI.BYTE]


def live_windows():
    """The windows of this process not freed yet."""
    return list(_LIVE)


def peer_window_resident_bytes():
    """``Windows.peer_resident_bytes`` summed over this process's live
    windows (memory.json's ``peer_window_bytes``); None where /proc is
    missing."""
    got = [w.peer_resident_bytes() for w in live_windows()]
    return None if None in got else sum(got)


def find_windows(name):
    """The live ``Windows`` that holds region or notify word ``name``, or None."""
    for w in reversed(_LIVE):
        if name in w.layout.regions or name in w.layout.words:
            return w
    return None


def free_all():
    """Free every live ``Windows`` (latest first, the same order on every
    rank). Called at a normal exit (atexit, before mpi4py's MPI_Finalize) and
    by ``comm.world`` before its own MPI_Finalize."""
    while _LIVE:
        _LIVE[-1].free()


atexit.register(free_all)
FINALIZE_HOOKS.append(free_all)
