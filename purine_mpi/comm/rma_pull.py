"""One-sided pulls: a rank reads a region another rank publishes, with no
participation by the owner (the parameter servers' weights over windows,
parallel/ps_windows.py). Beside comm/rma_ops.py's Put and WaitWrite, with
the same rules: ``seq`` fixed at build time, posted and tested only by
``runtime/comm_progress.CommPoster``, a ``Pending`` the stall watchdog
describes.

Publish  ins [x]  outs []   attrs seq, region, version
    (the region's owner) copies x into its region, unless x is the region,
    then adds 1 to its own notify word ``version``: the k-th Publish makes
    version k.
Get      ins []   outs [y]  attrs seq, peer, region, version, shape, dtype,
                            (applied, applied_all, staleness)
    waits until the owner's word ``version`` reaches the count of this Get's
    runs (``version: null``: no wait), then reads the region into y
    (``MPI_Get`` + ``Win_flush`` from an RMA window, a load from a shared
    one; nothing when y *is* the region: sync_ps on one node). With ``applied`` (the async server): the k-th Get waits until the
    owner counts this worker's k-th gradient applied (word ``applied``) and
    every worker's (words ``applied_all``) at least k - ``staleness``; the
    owner changes the region while it updates, so the read is retried until
    ``version`` is even and the same before and after it (a sequence lock:
    the owner makes it odd while it writes).
GetShards  ins [x]  outs [w]  attrs seq, region, regions, shards, shard, shapes, dtype,
                              (bucket), peer (-1: every owner)
    stage 3's gather across hosts (parallel/zero3_windows.py): w, the whole
    flat bucket, gets every rank r's shard, region ``regions[r]`` of r's
    RMA window, at ``shard_range(total, shards, r)``: one ``MPI_Rget`` per
    other owner, posted at once, tested by the poller (``MPI_Testsome``: a
    Get's request is complete once the data is in w, no flush; the stall
    watchdog names the owners whose shard has not arrived); this rank's own shard x
    (its region ``region``) is copied. What the owners hold then is ordered
    by the WindowSync barriers around it (comm/window_sync.py): it reads no
    notify word.

Their parts show in the trace as rma events (comm/rma_ops.py's kinds):
``<op>:notify`` for a Publish, ``<op>:wait_write`` (the wait for fresh
weights) and ``<op>:get`` for a Get.
"""
import time

import numpy as np

from ..ops.registry import register
from .ops import _mb
from .rma_ops import RMAPending, _WindowKernel


@register
class Publish(_WindowKernel):
    """x -> this rank's own region, then version += 1. A sink."""

    op_type = "Publish"
    sink = True

    def prepare(self, ins, outs):
        self.local = self.win.local(self.attrs["region"])
        self.zero_copy = np.shares_memory(self.local, ins[0])

    def run(self, ins, outs):
        self._begin(ins, outs)
        copied = 0
        if not self.zero_copy:
            np.copyto(self.local, ins[0])
            copied = self.local.nbytes
            self.bytes_copied += copied
        t1 = time.perf_counter()
        self.win.notify(self.attrs["version"])
        k = self.runs
        spans = [("notify", t1, time.perf_counter(), {"word": self.attrs["version"],
                                                      "bytes_copied": copied})]
        return RMAPending(lambda: True, lambda: (
            f"Publish {self.op.inputs[0]} {_mb(self.local.nbytes)} (version {k}) "
            f"{self._what()}"), spans)


@register
class Get(_WindowKernel):
    """y <- rank ``peer``'s region once it is fresh enough. A source."""

    op_type = "Get"
    source = True

    def prepare(self, ins, outs):
        view = self.win.view(self.attrs["region"])
        #: y is the owner's region itself (sync_ps on one node): nothing to read
        self.zero_copy = (view is not None and not self.attrs.get("applied")
                          and np.shares_memory(view, outs[0]))

    def _ready(self, k, state):
        a = self.attrs
        if a.get("applied"):
            mine = self.win.notified(a["applied"])
            slowest = min(self.win.notified(w) for w in a["applied_all"])
            state["seen"] = (mine, slowest)
            return mine >= k and slowest >= k - int(a.get("staleness", 0))
        if a.get("version"):
            state["seen"] = self.win.notified(a["version"])
            return state["seen"] >= k
        return True

    def _read(self, y):
        a, win = self.attrs, self.win
        before = (win.bytes_copied, win.bytes_got)
        if self.zero_copy:
            pass  # notified() made the owner's writes visible
        elif not a.get("applied"):
            win.get(a["region"], y)
        else:  # the sequence lock: an even version, the same after the read
            while True:
                v1 = win.notified(a["version"])
                if v1 % 2:
                    return False
                win.get(a["region"], y)
                if win.notified(a["version"]) == v1:
                    break
        self.bytes_copied += win.bytes_copied - before[0]
        self.bytes_got += win.bytes_got - before[1]
        return True

    def run(self, ins, outs):
        k, y = self._begin(ins, outs), outs[0]
        state = {"stage": "wait", "seen": None, "t": time.perf_counter()}
        spans = []

        def step():
            if state["stage"] == "wait":
                if not self._ready(k, state):
                    return False
                now = time.perf_counter()
                spans.append(("wait_write", state["t"], now, {"get": k}))
                state["stage"], state["t"] = "read", now
            if state["stage"] == "read":
                before = (self.bytes_got, self.bytes_copied)
                if not self._read(y):
                    return False
                spans.append(("get", state["t"], time.perf_counter(),
                              {"bytes_got": self.bytes_got - before[0],
                               "bytes_copied": self.bytes_copied - before[1]}))
                state["stage"] = "done"
            return True

        def describe():
            doing = {"wait": f"waiting for fresh weights, seen {state['seen']}",
                     "read": "reading", "done": "done"}[state["stage"]]
            return (f"Get {self.op.outputs[0]} {_mb(y.nbytes)} from rank {self.attrs['peer']} "
                    f"({doing}, get #{k}) {self._what()}")

        return RMAPending(step, describe, spans)


@register
class GetShards(_WindowKernel):
    """w <- every owner's shard of a bucket, read from its RMA window (see
    the module docstring)."""

    op_type = "GetShards"

    @classmethod
    def infer(cls, attrs, ins):
        from .ops import Allgather
        return Allgather.infer(attrs, ins)

    def prepare(self, ins, outs):
        from .ops import shard_range
        a = self.attrs
        regions, shards, shard = list(a["regions"]), int(a["shards"]), int(a["shard"])
        if len(regions) != shards or regions[shard] != a["region"] or len(outs) != 1 or \
                not outs[0].flags.c_contiguous:
            raise ValueError(f"GetShards '{self.op.name}': one contiguous output and one "
                             f"region per shard ({shards}), this rank's ({shard}) its own")
        total = outs[0].size
        self.parts = [(r, regions[r], slice(*shard_range(total, shards, r)))
                      for r in range(shards)]

    def run(self, ins, outs):
        from mpi4py import MPI
        k, w, win = self._begin(ins, outs), outs[0].reshape(-1), self.win
        shard = int(self.attrs["shard"])
        t0 = time.perf_counter()
        reqs, before = [], (win.bytes_got, win.bytes_copied)
        for r, region, cut in self.parts:
            if cut.stop == cut.start:
                continue
            if r == shard:
                np.copyto(w[cut], np.asarray(ins[0]).reshape(-1))
                self.bytes_copied += w[cut].nbytes
                continue
            req = win.rget(region, w[cut])
            if req is not None:
                reqs.append((r, req))
        self.bytes_got += win.bytes_got - before[0]
        self.bytes_copied += win.bytes_copied - before[1]
        spans, owners = [], [r for r, _ in reqs]
        requests = [q for _, q in reqs]
        #: the owners whose shard has not arrived (replaced whole: the
        #: watchdog's describe() reads it from another thread)
        state = {"waiting": owners}

        def step():
            if state["waiting"]:
                done = set(MPI.Request.Testsome(requests) or ())  # completed now
                state["waiting"] = [r for i, r in enumerate(owners)
                                    if r in state["waiting"] and i not in done]
                if state["waiting"]:
                    return False
            spans.append(("get", t0, time.perf_counter(),
                          {"bytes_got": win.bytes_got - before[0]}))
            return True

        def describe():
            return (f"GetShards {self.op.outputs[0]} {_mb(w.nbytes)} (get #{k}: waiting for "
                    f"the shards of ranks {state['waiting']} of {owners}) {self._what()}")

        return RMAPending(step, describe, spans)
