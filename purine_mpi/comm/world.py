"""The MPI world: who we are, where every rank lives, and how failures end
the job on every rank.

``get_world()`` returns the process-wide ``World`` (mpi4py is imported on first
use, so a program that never communicates never initialises MPI). Without a
launcher the world is one rank (MPI's singleton start).

Locations map to ranks through the host table gathered at start-up::

    {rank: R}                  -> rank R
    {ip: A, device: d >= 0}    -> the d-th rank (in rank order) on the host
                                  that owns address A (one rank per device)
    {ip: A, device: -1}        -> the first rank on that host

A host is identified by its hostname together with its non-loopback
addresses, so two network namespaces on one machine count as two hosts.
"""
import hashlib
import os
import sys
import threading
import time
import traceback

import numpy as np

from ..base import env
from ..base.cancel import Cancel, stopped_while_stalled
from ..base.errors import StallError, StoppedWhileStalled, UserError
from .hosts import HostTable, local_host_info  # noqa: F401  (HostTable: where it was)
from .launcher import check_launcher, check_world_size, leave_hydra
from .mpi_init import _flush, import_mpi, libmpi_function, watch_notices
from .mpi_init import _abort_job, remove_mpi_shm
from ..base.errors import write_line

_WORLD = None
_LOCK = threading.Lock()
#: COMM_WORLD's duplicate on which ranks that hit a user error agree who
#: prints it (report_user_error); made first, so every rank's is the same
_ERROR_COMM = None

#: Held around every MPI call the dispatchers make: comm ops are posted and
#: tested by whichever thread gets there first (a worker that just wrote a
#: bucket's last gradient, or the progress thread while the workers are
#: idle), so under MPI_THREAD_SERIALIZED this lock is what keeps two threads
#: out of MPI at once; under MPI_THREAD_MULTIPLE it still keeps the posts in
#: ``seq`` order. Reentrant: completing an op may post the next one.
MPI_LOCK = threading.RLock()


#: Called (no arguments) while a collective outside the graph waits
#: (``World.wait``): a dispatcher whose last iteration's tail is still in
#: flight (parallel.defer_update) registers one that tests those transfers,
#: so they complete -- and the updates behind them run -- during the stop
#: agreement and the other waits between iterations. A hook must not block;
#: it returns whether transfers of its own are still in flight (the wait
#: then polls without backing off: MPI moves data only inside MPI calls,
#: and the collective waited for may be queued behind those transfers).
WAIT_HOOKS = []

#: Called (no arguments) before this module's own MPI_Finalize, on every
#: rank alike: comm/windows.py frees its windows there (a collective).
FINALIZE_HOOKS = []


def _call(fn, *args, **kw):
    """One MPI call under MPI_LOCK: the collectives outside the graph (the
    stop agreement, metric means) run between iterations while a deferred
    tail's transfers may still be tested by a worker thread."""
    with MPI_LOCK:
        return fn(*args, **kw)


#: the tag of a rank's "I wait too" at a stall, on COMM_WORLD itself (whose
#: point-to-point traffic is only cli.py's status exchange, tag 36: never a
#: graph transfer's, which go over the world's duplicate)
HERE_TAG = 24081
#: seconds a stalled rank listens for its peers' "I wait too"
HERE_LISTEN_S = 1.0


def announce_waiting():
    """Tell every other rank of COMM_WORLD that this one is stalled too (a
    rank about to end on a stall or a cancel; ``World.heard_waiting``
    listens): a peer that says nothing is the one that stopped responding.
    Best effort: nothing where MPI is not up or the job has one rank."""
    MPI = sys.modules.get("mpi4py.MPI")
    try:
        if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
            return
        world = MPI.COMM_WORLD
        me = world.Get_rank()
        _drain_here_at_exit()
        for r in range(world.Get_size()):
            if r != me:
                _HERE_SENDS.append(_call(world.isend, me, dest=r, tag=HERE_TAG))
    except Exception:
        pass


#: this process's "I wait too" sends (``announce_waiting``), ended before
#: MPI_Finalize by ``_drain_here``
_HERE_SENDS = []


def _drain_here_at_exit():
    """Register ``_drain_here`` once, after mpi4py's MPI import (atexit runs
    its handlers last first: this one before mpi4py's MPI_Finalize)."""
    if not _HERE_DRAIN:
        import atexit
        atexit.register(_drain_here)
        _HERE_DRAIN.append(True)


_HERE_DRAIN = []


def _drain_here():
    """End what ``announce_waiting`` left where the process goes on after a
    stall it caught (a test's own StallError; a rank that aborts never gets
    here): its sends no peer received are cancelled, and the peers' that
    reached it are received, on every rank (a peer that never listened
    held them unreceived: its MPI_Finalize failed and Hydra killed the job,
    exit 9, after it had printed its results)."""
    MPI = sys.modules.get("mpi4py.MPI")
    try:
        if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
            return
        for request in _HERE_SENDS:
            if not request.Test():
                request.Cancel()
                request.Wait()
        _HERE_SENDS.clear()
        status = MPI.Status()
        while MPI.COMM_WORLD.Iprobe(source=MPI.ANY_SOURCE, tag=HERE_TAG, status=status):
            MPI.COMM_WORLD.recv(source=status.Get_source(), tag=HERE_TAG)
    except Exception:
        pass


def _note_wait(seconds):
    """A wait on peers of ``seconds`` ended: the longest lengthens a cancel's
    grace (base/cancel.py, ``Cancel.cancel_grace``)."""
    Cancel.note_wait(seconds)


def get_world():
    """The process-wide World (created, and MPI initialised, on first call)."""
    global _WORLD
    with _LOCK:
        if _WORLD is None:
            _WORLD = World()
        return _WORLD


def set_world(world):
    """Install ``world`` as the process-wide World (tests, sub-communicators)."""
    global _WORLD
    _WORLD = world
    return world


def rank0_decides(world, decide, what, wait=None):
    """A decision rank 0 alone makes, taken by every rank: rank 0 calls
    ``decide()``, which returns the value or raises a UserError (its exit
    status kept: a stop by a signal's 128 + its number, not 2);
    with more than one rank, one ``allgather_object`` (named ``what``, under
    ``wait`` seconds of stall timeout where given, else the world's) brings
    rank 0's answer to all. Every rank then returns the same value or raises
    the same UserError (exit 2 on every rank, one line, not rank 0's error
    and the others waiting). Collective: every rank calls it at the same
    point; ``world`` is anything with ``rank``, ``size`` and
    ``allgather_object`` (a World, a one-rank stand-in)."""
    answer = None
    if world.rank == 0:
        try:
            answer = decide(), None
        except UserError as exc:
            answer = None, (str(exc), exc.exit_code)
    if world.size > 1:
        saved = world.stall_timeout
        if wait is not None:
            world.stall_timeout = wait
        try:
            answer = world.allgather_object(answer, what)[0]
        finally:
            world.stall_timeout = saved
    value, error = answer
    if error is not None:
        message, code = error
        exc = UserError(message)
        exc.exit_code = code
        raise exc
    return value


class World:
    """An MPI communicator plus the host table of its ranks.

    ``comm`` is a private duplicate of COMM_WORLD used by graph communication
    ops, so their messages never match a user's or a library's."""

    def __init__(self, comm=None):
        if comm is None:  # a launcher the MPI library cannot join: say so before MPI_Init
            check_launcher()
        MPI = import_mpi()  # lazily: importing initialises MPI (a failure: exit 70)
        self.MPI = MPI
        _drain_here_at_exit()  # after the import: runs before mpi4py's MPI_Finalize
        base = comm if comm is not None else MPI.COMM_WORLD
        #: seconds a collective outside the graph may wait for its peers
        #: (the trainer sets it from parallel.stall_timeout)
        self.stall_timeout = 300.0
        # the duplicates are collectives, polled (MPI_Comm_idup) as every
        # other one here: a peer slow to come (still importing, or
        # stopped) no longer holds this rank in a blocking MPI_Comm_dup,
        # where a Ctrl-C was never answered (cli.py, early_abort.interrupted)
        # and no timeout named the op
        rank = base.Get_rank()
        if comm is None and _error_comm(MPI, self.stall_timeout) is None:  # before any
            # other collective: see report_user_error
            raise _dup_stalled(rank, "MPI_COMM_WORLD", self.stall_timeout)
        self.world_comm = base
        self.comm = _dup_polled(base, self.stall_timeout)
        if self.comm is None:
            raise _dup_stalled(rank, "the world's communicator", self.stall_timeout)
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        if comm is None:
            check_world_size(self.size)
        self.hosts = HostTable(self.allgather_object(local_host_info(), "the host table "
                                                                         "exchange"))
        if comm is None and self.size > 1:
            # every rank has passed MPI_Init and a collective: each has mapped
            # its node's MPICH segment, whose name can go now (as the shared
            # windows' go once mapped), so a rank killed with kill -9 (or the
            # OOM killer), whose job Hydra then kills with SIGKILL, leaves
            # nothing in /dev/shm; MPI_Finalize does without the name
            remove_mpi_shm()
        self.tag_ub = int(self.comm.Get_attr(MPI.TAG_UB) or 32767)
        self.thread_level = check_thread_level(MPI)
        #: sub-communicators by their ranks (``split_groups``), for collectives
        #: among some ranks (a hybrid run's stage groups)
        self.groups = {}
        self._splits = set()

    # ---------------------------------------------------- sub-communicators
    def split_groups(self, groups):
        """Make the sub-communicator of this rank's group, once: ``groups`` is
        a list of disjoint rank lists that covers the world (e.g. one list per
        pipeline stage). Collective (``Comm.Split``): every rank calls it with
        the same ``groups`` at the same point; a repeated call is a no-op.
        Ranks keep their world order inside a group. One group of every
        rank makes nothing: ``group_comm`` gives the world's own (a split
        would be a communicator never used, and MPICH's object blocks grow
        with each: 1.79 MiB on gpt_tiny's tensor rank 0, the node leader,
        whose communicators' node-roots sub-communicators outgrew its
        preallocated ones)."""
        key = tuple(tuple(int(r) for r in g) for g in groups)
        if key in self._splits:
            return self.groups
        members = sorted(r for g in key for r in g)
        if members != list(range(self.size)):
            raise ValueError(f"groups {key} do not cover the {self.size} ranks once each")
        if len(key) == 1:
            self._splits.add(key)
            return self.groups
        color = next(i for i, g in enumerate(key) if self.rank in g)
        sub = self.comm.Split(color, self.rank)
        self.groups[tuple(sorted(key[color]))] = sub
        self._splits.add(key)
        return self.groups

    def group_comm(self, ranks):
        """The communicator of the ranks ``ranks`` (this rank among them):
        the world's own when they are all ranks, else one ``split_groups``
        made."""
        ranks = tuple(sorted(int(r) for r in ranks))
        if ranks == tuple(range(self.size)):
            return self.comm
        comm = self.groups.get(ranks)
        if comm is None:
            raise UserError(f"rank {self.rank}: no sub-communicator for ranks {list(ranks)} "
                            "was made at start-up (World.split_groups); the graph was "
                            "composed for another world")
        return comm

    # ---------------------------------------------------------- locations
    def rank_of(self, location, what="a node"):
        """The rank that runs ``location`` (a graph Location or a dict)."""
        return self.hosts.rank_of(location, what, size=self.size)

    @property
    def local_rank(self):
        """This rank's index among the ranks on its host (its GPU, if any)."""
        return self.hosts.local_rank(self.rank)

    # ---------------------------------------------------------- checks
    def check_consistent(self, text, what="configuration"):
        """Raise UserError on every rank when ``text`` differs between ranks.

        Every rank must build the same graph from the same config; a rank that
        read another file or got other ``--set`` overrides would otherwise
        deadlock in mismatched communication."""
        digest = hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()
        self.check_agreed([(what, digest, f"sha256 {digest[:12]}")])
        return digest

    def check_agreed(self, inputs, what="the start-up agreement"):
        """Raise UserError on every rank when an input differs between ranks.

        ``inputs``: this rank's ``[(name, key, description)]`` (job/inputs.py:
        the config, --init, --resume, the data files), compared by ``key``
        (a digest), named by ``name`` and shown by ``description``. One
        allgather at one place of every rank's start, so a rank that differs
        can never leave the others waiting; rank 0's inputs are the
        reference, the message names the first input (in rank 0's order)
        that differs and the ranks that differ in it."""
        every = self.allgather_object([tuple(i) for i in inputs], f"{what} (allgather)")
        tables = [{name: (key, text) for name, key, text in rank} for rank in every]
        names = [name for name, _, _ in every[0]]
        names += [n for table in tables[1:] for n in table if n not in names]
        absent = (None, "none")
        differ = [(n, [r for r, t in enumerate(tables) if t.get(n, absent)[0] !=
                       tables[0].get(n, absent)[0]]) for n in names]
        differ = [(n, odd) for n, odd in differ if odd]
        if not differ:
            return
        name, odd = differ[0]
        whose = f"rank {odd[0]}'s" if len(odd) == 1 else f"ranks {_fmt_ranks(odd)}'"
        shown = "; ".join(f"rank {r}: {tables[r].get(name, absent)[1]}" for r in [0] + odd[:4])
        more = f"; and {len(odd) - 4} more rank(s)" if len(odd) > 4 else ""
        also = f" (also differ: {', '.join(n for n, _ in differ[1:])})" if differ[1:] else ""
        raise UserError(f"{whose} {name} differs from rank 0's: {shown}{more}{also}. Every "
                        "rank must start from the same inputs: the same config files and --set "
                        "overrides, --init file and --init-skip, --resume checkpoint and data "
                        "files (docs/failures.md, \"The start-up agreement\")")

    def barrier(self, what="a barrier", why=None, cancellable=True):
        self.wait(_call(self.comm.Ibarrier), what, why, cancellable=cancellable)

    # ------------------------------------------- collectives under a watchdog
    # Collectives outside the graph (the stop agreement, metric means,
    # checkpoint gathers, the consistency check) are non-blocking requests
    # polled here under the same stall timeout as graph communication: a
    # stopped or dead peer ends the job within the timeout, never a hang.
    def wait(self, request, what, why=None, comm=None, cancellable=True):
        """Poll ``request`` until it completes; StallError naming ``what``
        after ``stall_timeout`` seconds (``why``: what the wait is likely
        for, instead of a stopped peer; ``comm``: the communicator of the
        collective, the world's by default). A cancel (SIGTERM, Ctrl-C...)
        ends the wait ``Cancel.cancel_grace()`` seconds on instead
        (5 s, or twice the longest wait this rank saw end)
        (StoppedWhileStalled, exit 128 + the signal), unless
        ``cancellable`` is False (the wait for rank 0's checkpoint write,
        which the cancel's own stop makes)."""
        start = time.monotonic()
        pause = 20e-6
        while not _call(request.Test):
            busy = False
            for hook in WAIT_HOOKS:
                busy = hook() or busy
            waited = time.monotonic() - start
            if waited > self.stall_timeout:
                raise StallError(f"rank {self.rank}: {what} stalled for more than "
                                 f"{self.stall_timeout:g} s (parallel.stall_timeout): "
                                 f"{why or self.missing_peer(comm, listen=True)}")
            if cancellable:
                name = Cancel.cancelled_wait(start)
                if name is not None:
                    raise stopped_while_stalled(self.rank, name, what, waited, why or
                                                self.missing_peer(comm, "waiting for", True))
            time.sleep(pause)
            pause = 20e-6 if busy else min(pause * 2, 1e-3)
        _note_wait(time.monotonic() - start)

    def missing_peer(self, comm=None, verb="stopped responding", listen=False):
        """Who a collective over ``comm`` (default the world's) waits for,
        as far as MPI can tell: its one other rank by number; with more,
        a nonblocking collective's request does not say which peer has not
        come, so with ``listen`` (a rank about to end) the stalled ranks
        tell each other that they wait (``heard_waiting``, one second):
        where all but one peer said so, that one is named; else "one of
        ranks ..." (world ranks)."""
        peers = [r for r in self._world_ranks(comm) if r != self.rank]
        said = ""
        if len(peers) > 1 and listen:
            heard = self.heard_waiting(peers)
            if heard is not None and len(set(peers) - heard) == 1:
                peers, said = sorted(set(peers) - heard), (
                    f" (rank {min(heard)} said it waits too)" if len(heard) == 1 else
                    f" (ranks {_fmt_ranks(sorted(heard))} said they wait too)")
        if len(peers) == 1:
            return (f"rank {peers[0]} stopped responding{said}" if verb == "stopped responding"
                    else f"waiting for rank {peers[0]}{said}")
        named = _fmt_ranks(peers[:8]) + (f",... ({len(peers)} ranks)" if len(peers) > 8 else "")
        head = "a peer rank" if verb == "stopped responding" else "waiting for a peer"
        return (f"{head} (one of ranks {named}; MPI's nonblocking collective does not say "
                f"which){' stopped responding' if verb == 'stopped responding' else ''}")

    def heard_waiting(self, peers, seconds=HERE_LISTEN_S):
        """The ranks among ``peers`` (world ranks) that said within
        ``seconds`` that they are stalled too (``announce_waiting``), after
        this rank said so to every peer; None where this world is not
        COMM_WORLD's whole (a sub-world's ranks are numbered otherwise)."""
        MPI = self.MPI
        if self.comm is None or MPI.COMM_WORLD.Get_size() != self.size or \
                MPI.COMM_WORLD.Get_rank() != self.rank:
            return None
        announce_waiting()
        heard, deadline = set(), time.monotonic() + seconds
        status = MPI.Status()
        while not set(peers) <= heard and time.monotonic() < deadline:
            while _call(MPI.COMM_WORLD.Iprobe, source=MPI.ANY_SOURCE, tag=HERE_TAG,
                        status=status):
                source = status.Get_source()
                _call(MPI.COMM_WORLD.recv, source=source, tag=HERE_TAG)
                heard.add(int(source))
            time.sleep(0.01)
        return heard & set(peers)

    def _world_ranks(self, comm=None):
        """The world ranks of ``comm``'s members, in its order."""
        if comm is None or comm is self.comm:
            return list(range(self.size))
        try:
            return [int(r) for r in self.MPI.Group.Translate_ranks(
                comm.Get_group(), list(range(comm.Get_size())), self.comm.Get_group())]
        except Exception:  # a stand-in communicator (tests): its own numbering
            return list(range(comm.Get_size()))

    def allreduce(self, values, op="sum", what="an allreduce"):
        """Element-wise SUM or MAX over ranks of a numeric array (a copy)."""
        send = np.ascontiguousarray(values)
        out = np.empty_like(send)
        op = {"sum": self.MPI.SUM, "max": self.MPI.MAX}[op]
        self.wait(_call(self.comm.Iallreduce, send, out, op=op), what)
        return out

    def recv_object(self, source, tag, what="a receive"):
        """A picklable object from ``source`` (probed, then received), under
        the stall timeout."""
        start = time.monotonic()
        while not _call(self.comm.Iprobe, source=source, tag=tag):
            if time.monotonic() - start > self.stall_timeout:
                raise StallError(f"rank {self.rank}: {what} from rank {source} stalled for "
                                 f"more than {self.stall_timeout:g} s (parallel.stall_timeout)")
            name = Cancel.cancelled_wait(start)
            if name is not None:  # as in ``wait``
                raise stopped_while_stalled(self.rank, name, f"{what} from rank {source}",
                                            time.monotonic() - start, f"waiting for rank {source}")
            time.sleep(1e-3)
        _note_wait(time.monotonic() - start)
        return _call(self.comm.recv, source=source, tag=tag)

    def send_object(self, obj, dest, tag, what="a send"):
        """Send a picklable object to ``dest`` under the stall timeout."""
        self.wait(_call(self.comm.isend, obj, dest=dest, tag=tag), f"{what} to rank {dest}",
                  f"rank {dest} stopped responding")

    def gather_object(self, obj, root=0, what="a gather"):
        """``[obj of rank 0, obj of rank 1, ...]`` on ``root`` (None elsewhere),
        for picklable objects: sizes, then bytes, both non-blocking."""
        return self._gather_objects(obj, root, what)

    def allgather_object(self, obj, what="an allgather"):
        """``[obj of rank 0, obj of rank 1, ...]`` on every rank."""
        return self._gather_objects(obj, None, what)

    def _gather_objects(self, obj, root, what):
        import pickle
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        sizes = self.allreduce(np.eye(self.size, dtype=np.int64)[self.rank] * data.size,
                               what=f"{what} (sizes)")
        counts = [int(c) for c in sizes]
        offsets = np.cumsum([0] + counts)
        receives = root is None or self.rank == root
        out = np.empty(int(offsets[-1]) if receives else 0, dtype=np.uint8)
        if root is None:
            recv = [out, (counts, [int(o) for o in offsets[:-1]]), self.MPI.BYTE]
            self.wait(_call(self.comm.Iallgatherv, data, recv), what)
        else:
            self.gatherv(data, out if receives else None, counts, root, what)
        if not receives:
            return None
        return [pickle.loads(out[offsets[r]:offsets[r + 1]].tobytes())
                for r in range(self.size)]

    def gatherv(self, send, recv, counts, root=0, what="a gather"):
        """Every rank's contiguous array ``send`` into ``recv`` on ``root``,
        in rank order, as bytes (no pickling): ``counts[r]`` is rank r's
        number of bytes (``recv`` None off the root); one Igatherv under
        the stall watchdog."""
        data = np.ascontiguousarray(send).reshape(-1).view(np.uint8)
        if recv is not None:
            if not recv.flags.c_contiguous:  # the bytes must land in the caller's buffer
                raise ValueError("gatherv: the receive buffer must be C-contiguous")
            offsets = np.cumsum([0] + [int(c) for c in counts[:-1]])
            recv = [recv.reshape(-1).view(np.uint8),
                    ([int(c) for c in counts], [int(o) for o in offsets]), self.MPI.BYTE]
        self.wait(_call(self.comm.Igatherv, data, recv, root=root), what)

    def allgatherv(self, send, recv, counts, displs, what="an allgather", comm=None):
        """Every rank's contiguous array ``send`` into ``recv`` (C-contiguous,
        on every rank) as bytes, no pickling: rank r's ``counts[r]`` bytes
        at byte ``displs[r]`` (a count may be 0); over ``comm`` (a
        sub-communicator, ``group_comm``; default the world's). One
        Iallgatherv under the stall watchdog naming ``what``."""
        data = np.ascontiguousarray(send).reshape(-1).view(np.uint8)
        if not recv.flags.c_contiguous:  # the bytes must land in the caller's buffer
            raise ValueError("allgatherv: the receive buffer must be C-contiguous")
        recv = [recv.reshape(-1).view(np.uint8), ([int(c) for c in counts],
                                                  [int(d) for d in displs]), self.MPI.BYTE]
        self.wait(_call((comm or self.comm).Iallgatherv, data, recv), what, comm=comm)

    def bcast(self, buf, root=0, what="a broadcast", comm=None):
        """``root``'s C-contiguous array ``buf`` into every rank's ``buf``,
        in place, as bytes; over ``comm`` (default the world's). One Ibcast
        under the stall watchdog naming ``what``."""
        if not buf.flags.c_contiguous:
            raise ValueError("bcast: the buffer must be C-contiguous")
        self.wait(_call((comm or self.comm).Ibcast, buf.reshape(-1).view(np.uint8),
                        root=root), what, comm=comm)

    def abort(self, code=1):
        """End the whole job: every rank exits with a non-zero status."""
        _flush()
        if self.MPI.COMM_WORLD.Get_size() > 1:
            # the launcher forwards our output through a pipe and stops doing
            # so once the job aborts: give it a moment to pass the message on
            time.sleep(0.3)
            _abort_job(self.MPI, code)  # the whole job, also from a sub-world
        os._exit(code)


def _dup_stalled(rank, what, seconds):
    """The StallError of a start-up duplicate of ``what`` that a peer never
    came to within ``seconds`` (``_dup_polled``'s None)."""
    return StallError(f"rank {rank}: the duplicate (MPI_Comm_idup) of {what} stalled for more "
                      f"than {seconds:g} s at start-up: a peer rank never came (hung or slow "
                      "before it)")


def _dup_polled(comm, seconds):
    """``comm``'s duplicate (a collective), its request polled so that a
    Ctrl-C is answered meanwhile; None where it did not complete within
    ``seconds`` (a peer that never came). mpi4py without ``Idup``: the
    blocking ``Dup``."""
    idup = getattr(comm, "Idup", None)
    if idup is None:
        return comm.Dup()
    made = idup()
    new, request = made if isinstance(made, tuple) else (made, None)
    if request is not None and not _wait_for(request, seconds):
        return None
    return new


def _error_comm(MPI, seconds=300.0):
    """COMM_WORLD's duplicate for ``report_user_error``, made once; None
    where a peer did not come within ``seconds``."""
    global _ERROR_COMM
    if _ERROR_COMM is None:
        _ERROR_COMM = _dup_polled(MPI.COMM_WORLD, seconds)
    return _ERROR_COMM


def report_user_error(exc, agree_s=3.0):
    """A user error under a launcher with several ranks: print it exactly
    once and end the job with ``exc.exit_code`` (2; 3 for non-finite
    weights). Returns only when there is a single rank (the caller prints).

    The ranks that hit it wait up to ``agree_s`` seconds on a barrier of
    their own communicator. When every rank comes (a config, data or
    environment error that all ranks find alike), rank 0 prints the message
    and every rank exits with the status once it is written: no abort, so
    the launcher passes the whole message on and adds nothing. When some rank
    does not come (an error of this rank only, e.g. a file missing on its
    node), this rank prints ``error: rank R: ...``, gives the launcher a
    moment to pass it on, and aborts the job (MPICH's own abort line is
    silenced: the message says it all). Each message is one write, so two
    ranks' lines never run together."""
    MPI = import_mpi()  # initialises MPI if the error came before it
    if MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() < 2:
        return
    rank, code = MPI.COMM_WORLD.Get_rank(), getattr(exc, "exit_code", 2)
    _flush()
    comm = _error_comm(MPI, agree_s)  # None: a peer not there (its own error, slow, hung)
    from ..base import logfile  # the run folder's train.log, where a run has one
    if comm is not None and _wait_for(comm.Ibarrier(), agree_s):
        if rank == 0:
            write_line(f"error: {exc}")
            logfile.note_error(f"error: {exc}")
            logfile.end_run(code)
        # rank 0 has written before anyone ends; and every rank ends the same
        # way: MPI_Finalize where none has threads of ours running, else none
        # finalizes. A rank in MPI_Finalize waits for the others, and Hydra
        # takes one that ended by os._exit for a dead one and kills the rest
        # with SIGKILL: a parameter-server run's server (no threads) was
        # killed in its MPI_Finalize by its workers' os._exit, the job
        # ending 9 where its status was 2, in about half of the runs
        alone = np.array([threading.active_count() == 1], dtype=np.int32)
        every = np.zeros(1, dtype=np.int32)
        if _wait_for(comm.Iallreduce(alone, every, op=MPI.MIN), agree_s) and every[0]:
            _finalize_and_exit(MPI, code)
        # without MPI_Finalize, every rank ends by os._exit: Hydra's proxy
        # took the first to go for a dead rank and SIGKILLed the others
        # still running (the job's status 9 for 2 whenever a rank lagged:
        # every run of 10 with the ranks leaving 0.3 s apart); every rank
        # came through the barrier and ends now with this status, so each
        # tells the launcher first (comm/launcher.py, leave_hydra)
        _flush()
        leave_hydra()
        _exit_unfinalized(code)
    write_line(f"error: rank {rank}: {exc}")
    logfile.note_error(f"error: rank {rank}: {exc}")
    logfile.end_run(code, rank)
    time.sleep(0.5)  # the launcher forwards our output through a pipe: let it pass
    _abort_job(MPI, code)


def _finalize_and_exit(MPI, code):
    """End this rank with ``code`` the way Hydra counts as a clean end:
    MPI_Finalize, then the C library's exit (its exit handlers close the PMI
    connection in order). A rank that ends by ``os._exit`` -- even after
    MPI_Finalize -- looks to Hydra's proxy like one that died, and it kills
    the ranks still running with SIGKILL: the job then ended 9, with MPICH's
    "BAD TERMINATION" banner, in 17 runs of 100. With threads of ours
    running (an error found mid-run) the rank still ends by ``os._exit``."""
    _flush()
    if threading.active_count() == 1:  # no thread of ours may be inside MPI or C++ code
        # MPI_Finalize waits for the other ranks, which all came to this point
        # (the barriers before): a rank that died since must not hang it
        watchdog = threading.Timer(10.0, _exit_unfinalized, (code,))
        watchdog.daemon = True
        watchdog.start()
        try:
            for hook in FINALIZE_HOOKS:  # collective: every rank came here (the barriers before)
                hook()
            MPI.Finalize()
            import ctypes
            ctypes.CDLL(None).exit(code)
        except Exception:
            pass
    _exit_unfinalized(code)


#: the stop notices a rank in ``finalize_mpi`` answers by ending with its
#: status (SIGINT keeps its default action: Ctrl-C ends a rank anywhere)
FINALIZE_NOTICES = ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT")
#: seconds ``finalize_mpi`` lets MPI_Finalize go on after a notice (a
#: finalize of ranks that all came takes milliseconds): a notice repeated
#: to every rank of a job ending normally (scancel after --signal) leaves
#: the ends clean; a rank whose peer never finalizes ends this long after
FINALIZE_GRACE_S = 2.0


def finalize_mpi(code, grace_s=None):
    """MPI_Finalize now, while Python still runs, with the stop notices
    (``FINALIZE_NOTICES``: SIGTERM, as Slurm sends before its SIGKILL, or a
    user's ``kill PID``) ending this rank with ``code`` -- its status, its
    files written -- when MPI_Finalize (or the ``FINALIZE_HOOKS`` before it:
    the RMA windows' collective free) has not returned ``grace_s`` seconds
    after one (default ``FINALIZE_GRACE_S``). Returns whether MPI
    was finalized here (False: never initialised, finalized already, or a
    single rank, whose finalize waits for nobody: mpi4py's at exit).

    Why: MPI_Finalize waits for every rank (MPICH: a PMI barrier, a read
    on the rank's PMI socket), so a rank whose peer never comes (stopped,
    wedged in a driver, gone without the launcher noticing) waits for
    ever. mpi4py's own MPI_Finalize runs at the very end of the
    interpreter's shutdown, where no Python code runs any more: the
    notices, ignored there (``StopSignal.ignore_late_notices``: a default
    action killed a rank of a job ending well), left such a rank to
    SIGKILL. Here MPI_Finalize is called through ctypes, which lets go of
    the GIL (mpi4py's ``MPI.Finalize`` holds it), so a thread of ours,
    woken by the signal's byte on Python's wakeup fd, can end the rank.
    It ends by ``os._exit(code)`` without a word to the launcher: the
    proxy then takes it for a dead rank and kills the peers that never
    came with SIGKILL, which ends the job."""
    import signal
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return False
    if MPI.COMM_WORLD.Get_size() < 2 or threading.current_thread() is not \
            threading.main_thread():
        return False
    grace_s = FINALIZE_GRACE_S if grace_s is None else grace_s
    numbers = {int(getattr(signal, name)) for name in FINALIZE_NOTICES}
    # Ctrl-C ends a rank in MPI_Finalize at once, as it did in mpi4py's
    # (after Python's shutdown had put its default action back)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

    def end(signum):  # MPI_Finalize did not return within the grace
        _flush()
        remove_mpi_shm()
        os._exit(code)

    def ignore():  # finalized: a notice from now on has nothing to stop (the stop
        for n in numbers:  # notices ignored, as before; Python's shutdown keeps SIG_IGN)
            signal.signal(n, signal.SIG_IGN)

    # the wakeup fd first, the handlers after: a notice caught from the
    # moment its handler is in place has its byte on the watched pipe.
    # Before, the handlers came first, and one that came in the few
    # microseconds until the wakeup fd was set ran the no-op alone: lost,
    # and the rank waited on in MPI_Finalize (until then the notices are
    # ignored, ``ignore_late_notices``: nothing is lost that was kept before)
    stop = watch_notices(numbers, grace_s, end, lambda signum: code, "finalize-notices")
    for n in numbers:  # Python's C handler (the Python one runs after MPI_Finalize only):
        signal.signal(n, lambda *_: None)
    try:
        # the hooks free the RMA windows: MPI_Win_free is collective, and
        # waits as MPI_Finalize does for a peer that never comes (a notice
        # was ignored there, before: such a rank of a pipeline or
        # parameter-server run ended only by SIGKILL)
        for hook in FINALIZE_HOOKS:  # collective: every rank ends its train here alike
            hook()
        # libmpi's, as mpi4py's extension links it; where it cannot be found
        # so (MPI linked in with hidden symbols), mpi4py's, which holds the
        # interpreter: the rank then waits as it did before for a peer
        finalize = libmpi_function(MPI, "MPI_Finalize") or MPI.Finalize
        # no thread of ours in MPI meanwhile (a thread that keeps the lock
        # longer than a deferred transfer's test is wedged: go on without)
        locked = MPI_LOCK.acquire(timeout=10.0)
        try:
            finalize()
        finally:
            if locked:
                MPI_LOCK.release()
    finally:
        if stop is not None:
            stop(ignore)
        else:
            ignore()
    return True


def _exit_unfinalized(code):
    """End this rank at once without MPI_Finalize (threads of ours may be
    inside MPI), leaving nothing of the MPI library's in /dev/shm."""
    _flush()
    remove_mpi_shm()
    os._exit(code)


def _wait_for(request, seconds):
    """Whether a non-blocking request completed within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def check_thread_level(MPI):
    """The thread support MPI granted, checked once at start: comm ops are
    posted from worker threads as well as the progress thread, one at a time
    under ``MPI_LOCK``, which needs at least MPI_THREAD_SERIALIZED."""
    level = MPI.Query_thread()
    if level < MPI.THREAD_SERIALIZED:
        names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED"}
        raise UserError(
            f"MPI granted {names.get(level, level)}, but purine_mpi calls MPI from several "
            "threads (one at a time) and needs at least MPI_THREAD_SERIALIZED; use an MPI "
            "library built with thread support and do not lower mpi4py's requested level "
            "(MPI4PY_RC_THREAD_LEVEL / mpi4py.rc.thread_level must be 'serialized' or "
            "'multiple')")
    return level


def _fmt_ranks(ranks):
    return ",".join(str(r) for r in ranks)


# ------------------------------------------------------------------ abort
def describe_exception(exc, rank):
    """One line: ``rank R: <what failed>`` (no double prefix for OpError)."""
    text = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
    if text.startswith(f"rank {rank}:") or str(exc).startswith(f"rank {rank}:"):
        return str(exc)
    return f"rank {rank}: {text}"


def _debug():
    """PURINE_DEBUG, on when set to anything but a false flag (here, in an
    error handler, a bad value is no reason to fail: the CLI checked it)."""
    try:
        return bool(env.get("PURINE_DEBUG"))
    except env.EnvError:
        return True


def install_abort_handler(world=None):
    """Make an uncaught exception on any rank (main or worker thread) end the
    whole job promptly: print ``rank R: <op/exception>`` and call
    ``MPI.COMM_WORLD.Abort`` (exit code 2 for a UserError, else 1), so no rank
    hangs in communication waiting for a dead peer. The traceback is printed
    only with ``--debug`` (environment PURINE_DEBUG=1): one line per failing
    rank otherwise."""
    world = world or get_world()

    def handle(exc_type, exc, tb):
        if issubclass(exc_type, (KeyboardInterrupt, SystemExit)) and world.size == 1:
            return sys.__excepthook__(exc_type, exc, tb)
        if issubclass(exc_type, KeyboardInterrupt):  # a Ctrl-C outside cli._run's own
            # handling: the second of one press (mpiexec passes the terminal's
            # on) that came while _run took the first, before the run's handler
            # (runtime/stop.py) existed. 130 and the job's end, as for the
            # first (early_abort.interrupted), not "KeyboardInterrupt" and 1
            from .early_abort import interrupted
            interrupted()
        text = describe_exception(exc, world.rank)
        trace = "".join(traceback.format_exception(exc_type, exc, tb)) \
            if not isinstance(exc, UserError) and _debug() else ""
        write_line(trace + text)  # one write: the ranks' lines never mix
        from ..base import logfile
        # a UserError's own (2, 3); a cancel that ended a stalled wait: 128 + the signal
        code = getattr(exc, "exit_code", 1) if isinstance(exc, (UserError, StoppedWhileStalled)) \
            else 1
        logfile.note_error(text, world.rank)  # the run folder's train.log, from any rank
        logfile.end_run(code, world.rank)
        world.abort(code)

    sys.excepthook = handle
    threading.excepthook = lambda args: handle(args.exc_type, args.exc_value,
                                               args.exc_traceback)
    return handle

