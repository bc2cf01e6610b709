"""The asynchronous parameter server's loop (``parallel.mode: async``), run
by each server rank instead of a graph; see parallel/param_server.py for the protocol
the workers' graphs follow (push tag 2i, pull tag 2i+1 for param i).

Over windows (parallel/ps_windows.py) the loop serves no pulls: it polls
the written words of its gradient slots, applies each gradient to the
weights region in place under the version's sequence lock (odd while it
writes), raises the worker's ``applied`` word and releases the slot; the
workers' Gets wait for the staleness bound themselves.
"""
import time

import numpy as np

from ..base.errors import StallError
from ..graph.core import Op

STATE_TAG = 1 << 20  # server -> rank 0: its state (above every push/pull tag)
STOP_TAG = (1 << 20) + 1  # rank 0 -> server: the workers' stop code
STOP_REQUEST_TAG = (1 << 20) + 2  # server -> rank 0: a signal reached a server
STATE_REQUEST_TAG = (1 << 20) + 3  # rank 0 -> server: its state now (a test pass, a checkpoint)
MEMORY_TAG = (1 << 20) + 4  # server -> rank 0: its resident bytes, at the end (memory.json)


def send_state(world, momenta, weights=None):
    """To rank 0 (STATE_TAG): a server's momenta and, from an async server
    (at its end, a stop, or asked), its weights."""
    from ..base.backend import to_numpy
    world.send_object({"momenta": {p: to_numpy(m) for p, m in momenta.items()},
                       "weights": {p: to_numpy(w) for p, w in (weights or {}).items()}},
                      0, STATE_TAG, "sending the server state (momenta)")


class AsyncServer:
    """The asynchronous server loop of one server rank.

    ``params`` / ``momenta``: {param: array} of the owned shard (updated in
    place); ``updates``: {param: SGDUpdate op} (attrs: momentum, weight
    decay, multipliers); ``lr_attrs``: the LearningRate op's attrs;
    ``iters``: pushes each worker makes per param (max_iter - start).

    Stops: a signal to this rank is sent to rank 0 (STOP_REQUEST_TAG), which
    makes it part of the workers' stop agreement; the workers' decision comes
    back (STOP_TAG) and ends the loop, ``stats["stop_code"]`` saying why.
    Rank 0 may ask for the state between two pushes (STATE_REQUEST_TAG, a
    test pass or a checkpoint): the weights and momenta go to it then. A
    loop that gets no push and completes no reply for ``world.stall_timeout``
    seconds raises StallError naming the workers it waits for."""

    def __init__(self, world, plan, params, momenta, updates, lr_attrs, max_staleness,
                 start_iter, iters, poll_interval=2e-4, stop=None, windows=None):
        from ..ops.catalog import make_kernel
        self.world, self.plan = world, plan
        self.params, self.momenta = params, momenta
        self.lr_attrs = dict(lr_attrs)
        self.staleness = int(max_staleness)
        self.start, self.iters = int(start_iter), int(iters)
        self.workers = list(plan["workers"])
        self.owned = [p for p in plan["order"] if p in params]
        self.poll = poll_interval
        self.stop = stop  # a StopSignal: a signal here is passed on to rank 0
        self.win = windows  # the PS windows (parallel/ps_windows.py), or None: Send/Recv
        nw = len(self.workers)
        self.kernels = {}
        for p in self.owned:
            attrs = dict(updates[p].attrs)
            attrs["grad_scale"] = float(attrs.get("grad_scale", 1.0)) / nw
            attrs["decay_mult"] = float(attrs.get("decay_mult", 1.0)) / nw
            self.kernels[p] = make_kernel(Op(f"{p}.update", "SGDUpdate", [], [], attrs))
        self.count = {(w, p): 0 for w in self.workers for p in self.owned}
        self.stats = {"pushes": 0, "max_lead": 0}

    def serve(self):
        """Run until every worker pushed every owned param ``iters`` times
        and every reply has been delivered. Returns stats."""
        from mpi4py import MPI
        from ..ops.lr_policy import learning_rate
        comm = self.world.comm
        if not self.owned or self.iters <= 0:
            return self.stats
        if self.win is not None:
            return self._serve_windows()
        grad_buf = {(w, p): np.empty_like(self.params[p]) for w in self.workers
                    for p in self.owned}
        # a reply's snapshot of the weights (later pushes change them), one per
        # (worker, param): a worker pushes p again only once it received the
        # last reply of p (ServerRank counts both sets of buffers)
        reply = {k: np.empty_like(self.params[k[1]]) for k in grad_buf}
        keys = list(grad_buf)
        recv = [comm.Irecv(grad_buf[k], source=k[0], tag=self.plan["tags"][k[1]][0])
                for k in keys]
        waiting = []   # (w, p) pushes whose reply is held back by the staleness bound
        sends = {}     # (w, p): the Isend of its reply in flight
        lr = np.zeros((), np.float32)
        done_pushes = 0
        total = len(keys) * self.iters
        requested = False
        last_progress = time.monotonic()
        timeout = float(getattr(self.world, "stall_timeout", 300.0))
        while done_pushes < total or waiting or sends:
            if self.stop is not None and self.stop.name and not requested:
                self.world.send_object(self.stop.name, 0, STOP_REQUEST_TAG, "a stop request")
                requested = True
            if comm.Iprobe(source=0, tag=STOP_TAG):  # the workers stopped: so do we
                self.stats["stop_code"] = comm.recv(source=0, tag=STOP_TAG)
                for r in recv:
                    if r != MPI.REQUEST_NULL:
                        r.Cancel()
                return self.stats
            self._state_asked(self.params)
            idx = MPI.Request.Testsome(recv) if done_pushes < total else None
            progressed = False
            for i in idx or ():
                w, p = keys[i]
                it = self.start + self.count[(w, p)]
                lr.fill(learning_rate(self.lr_attrs, it))
                arr, mom = self.params[p], self.momenta[p]
                self.kernels[p].run([arr, grad_buf[(w, p)], mom, lr], [arr, mom])
                self.count[(w, p)] += 1
                done_pushes += 1
                self.stats["pushes"] += 1
                waiting.append((w, p))
                if self.count[(w, p)] < self.iters:
                    recv[i] = comm.Irecv(grad_buf[(w, p)], source=w,
                                         tag=self.plan["tags"][p][0])
                progressed = True
            still = []
            for w, p in waiting:
                slowest = min(self.count[(v, p)] for v in self.workers)
                lead = self.count[(w, p)] - slowest
                if lead <= self.staleness:
                    self.stats["max_lead"] = max(self.stats["max_lead"], lead)
                    if (w, p) in sends:  # received by w (it pushed again): done here too
                        sends.pop((w, p)).Wait()
                    np.copyto(reply[(w, p)], self.params[p])
                    sends[(w, p)] = comm.Isend(reply[(w, p)], dest=w,
                                               tag=self.plan["tags"][p][1])
                    progressed = True
                else:
                    still.append((w, p))
            waiting = still
            before = len(sends)
            sends = {k: r for k, r in sends.items() if not r.Test()}
            if progressed or len(sends) < before:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > timeout:
                behind = sorted({w for (w, p), n in self.count.items() if n < self.iters})
                raise StallError(f"rank {self.world.rank}: async parameter server: no push "
                                 f"from worker rank(s) {behind} and no reply delivered for "
                                 f"more than {timeout:g} s (parallel.stall_timeout)")
            if not progressed:
                time.sleep(self.poll)
        return self.stats

    def _state_asked(self, weights):
        """Rank 0 asked for the state (STATE_REQUEST_TAG): send it, between
        two pushes (``weights``: where the owned weights live now)."""
        comm = self.world.comm
        if comm.Iprobe(source=0, tag=STATE_REQUEST_TAG):
            comm.recv(source=0, tag=STATE_REQUEST_TAG)
            send_state(self.world, self.momenta, {p: weights[p] for p in self.owned})

    def _stop_requested(self, state):
        """Pass a signal here on to rank 0 once; True when the workers'
        stop decision came (``stats["stop_code"]``)."""
        if self.stop is not None and self.stop.name and not state.get("requested"):
            self.world.send_object(self.stop.name, 0, STOP_REQUEST_TAG, "a stop request")
            state["requested"] = True
        if self.world.comm.Iprobe(source=0, tag=STOP_TAG):
            self.stats["stop_code"] = self.world.comm.recv(source=0, tag=STOP_TAG)
            return True
        return False

    def _serve_windows(self):
        """The loop over windows (see the module docstring)."""
        from ..comm.world import MPI_LOCK
        from ..ops.lr_policy import learning_rate
        from ..parallel.ps_windows import applied, slot, weights
        win, plan = self.win, self.plan
        region = {p: win.local(weights(p)) for p in self.owned}
        for p in self.owned:  # the weights live in the region from now on
            np.copyto(region[p], self.params[p])
            win.notify(weights(p) + ".version", 2)  # even: readable
        keys = [(w, p) for w in self.workers for p in self.owned]
        lr = np.zeros((), np.float32)
        total, done, state = len(keys) * self.iters, 0, {}
        last_progress = time.monotonic()
        timeout = float(getattr(self.world, "stall_timeout", 300.0))
        try:
            while done < total:
                if self._stop_requested(state):
                    return self.stats
                self._state_asked(region)
                progressed = False
                for w, p in keys:
                    n = self.count[(w, p)]
                    name = slot(plan, p, w)
                    if n >= self.iters or win.notified(name + ".written") <= n:
                        continue
                    slowest = min(self.count[(v, p)] for v in self.workers)
                    self.stats["max_lead"] = max(self.stats["max_lead"], n - slowest)
                    lr.fill(learning_rate(self.lr_attrs, self.start + n))
                    version = weights(p) + ".version"
                    win.notify(version)  # odd: a write in progress
                    self.kernels[p].run([region[p], win.local(name), self.momenta[p], lr],
                                        [region[p], self.momenta[p]])
                    with MPI_LOCK:
                        for w_ in win.wins.values():
                            w_.Sync()  # the stores visible before the version is even
                    win.notify(version)
                    self.count[(w, p)] = n + 1
                    done += 1
                    self.stats["pushes"] += 1
                    win.notify(applied(p, w))
                    if n + 1 < self.iters:  # the slot may take the next push
                        win.notify(name + ".free")
                    progressed = True
                if progressed:
                    last_progress = time.monotonic()
                else:
                    if time.monotonic() - last_progress > timeout:
                        behind = sorted({w for (w, p), n in self.count.items()
                                         if n < self.iters})
                        raise StallError(f"rank {self.world.rank}: async parameter server "
                                         f"(windows): no gradient put by worker rank(s) "
                                         f"{behind} for more than {timeout:g} s "
                                         "(parallel.stall_timeout)")
                    time.sleep(self.poll)
        finally:
            for p in self.owned:  # the final weights, out of the window memory
                self.params[p] = region[p].copy()
        return self.stats
