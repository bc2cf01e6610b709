"""What every dispatcher shares (``_Base``: kernels made once over a
workspace, accumulated blobs, the comm posting order, the stall message),
the ``Profiler`` that records trace events, and ``SerialDispatcher``: the
graph one op at a time in a fixed topological order, the debugging
reference (``PURINE_DISPATCHER=serial``) every concurrent dispatcher is held
to, bit for bit. The event-driven engine is ``runtime/dispatcher.py``.

Layer: dispatch (docs/DESIGN.md); may import the foundation, devices, data,
ops, graph, job and composition layers below it, and its own.
"""
import threading
import time
import zlib

import numpy as np

from ..errors import OpError, StallError
from ..kernels import make_kernel
from .workspace import Workspace


class Profiler:
    """Collects Chrome trace events (docs/formats.md, "Traces")."""

    def __init__(self, rank=0, epoch=None):
        """``epoch``: the instant (seconds since the Unix epoch) that trace
        time 0 stands for; several ranks given the same one (the trainer
        passes rank 0's start) get traces on one time axis. Default: now."""
        self.rank = rank
        self.events = []
        self.t0 = time.perf_counter()
        if epoch is not None:
            self.t0 -= time.time() - float(epoch)
        self._lock = threading.Lock()

    def record(self, op, category, t_start, t_end, iteration, tid, extra=None):
        args = {"iter": iteration, "op_type": op.op_type}
        for key, value in (extra or {}).items():
            if key == "ready_s":  # a perf_counter time: on the trace's clock
                args["ready_ts"] = round((value - self.t0) * 1e6, 1)
            else:
                args[key] = value
        ev = {"name": op.name, "cat": category, "ph": "X",
              "ts": (t_start - self.t0) * 1e6, "dur": (t_end - t_start) * 1e6,
              "pid": self.rank, "tid": str(tid), "args": args}
        with self._lock:
            self.events.append(ev)


class _Base:
    def __init__(self, graph, workspace=None, rank=0, profiler=None, stall_timeout=300.0,
                 poll_interval=2e-4, seed=0, busy_poll=1e-3):
        self.graph = graph
        self.workspace = workspace or Workspace(graph)
        self.rank = rank
        self.profiler = profiler
        self.stall_timeout = stall_timeout
        self.poll_interval = poll_interval  # progress-thread polls while workers idle
        #: while a worker runs an op, the progress thread tests the transfers
        #: in flight when no thread has for this long (seconds; 0: never)
        self.busy_poll = busy_poll
        self.iteration = 0
        self.order = graph.topo_order()
        self.kernels = {}
        ws = self.workspace
        for op in self.order:
            k = make_kernel(op)
            k.workspace = ws
            k.ins = [ws[b] for b in op.inputs]
            k.outs = [ws[b] for b in op.outputs]
            if k.needs_rng:
                # per-op stream: independent of scheduling order and thread
                k.rng = np.random.default_rng([seed, zlib.crc32(op.name.encode())])
            self.kernels[op.name] = k
        self._accum = self._accumulated_blobs()
        self._accum_lock = threading.Lock()  # accumulating writers add under it
        for op in self.order:
            k = self.kernels[op.name]
            k.setup(k.ins, k.outs)

    def _comm_in_posting_order(self):
        """Comm ops in the order they are posted: by ``seq`` (fixed at graph
        build time, the same on every rank), then topological position."""
        position = {op.name: i for i, op in enumerate(self.order)}
        comm = [op for op in self.order if self.kernels[op.name].category == "comm"]
        return sorted(comm, key=lambda o: (o.attrs.get("seq", 1 << 30), position[o.name]))

    def _accumulated_blobs(self):
        return sorted({b for op in self.order if op.accumulate for b in op.outputs})

    def _zero_accumulators(self):
        for b in self._accum:
            self.workspace[b].fill(0)

    def _execute(self, op, tid):
        """Run one op's kernel; returns its Pending (async) or None."""
        k = self.kernels[op.name]
        t0 = time.perf_counter()
        try:
            if op.accumulate:
                tmp = [o.copy() for o in k.outs]
                for t in tmp:
                    t.fill(0)
                result = k.run(k.ins, tmp)
                with self._accum_lock:
                    for o, t in zip(k.outs, tmp):
                        o += t
            else:
                result = k.run(k.ins, k.outs)
        except Exception as exc:
            raise OpError(op, exc, self.rank) from exc
        if result is None and self.profiler is not None:
            self.profiler.record(op, k.category, t0, time.perf_counter(),
                                 self._label(op.name), tid)
        return result, t0

    def _label(self, name):
        """The iteration an op's trace event belongs to."""
        return self.iteration

    def drain(self):
        """Wait for whatever of the last iteration still runs (nothing here:
        ``run`` returns with every op done)."""

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SerialDispatcher(_Base):
    """Runs ops one by one in a fixed topological order on the calling
    thread. Communication ops are posted (non-blocking) in ``seq`` order,
    like the event dispatcher does, and waited for only when an op needs
    their result, so matched Send/Recv pairs and collectives never deadlock."""

    def __init__(self, graph, **kw):
        super().__init__(graph, **kw)
        self._deps = graph.dependencies()
        comm = self._comm_in_posting_order()
        posting = {n: set(d) for n, d in self._deps.items()}
        for before, after in zip(comm, comm[1:]):
            posting[after.name].add(before.name)
        self.order = graph.topo_order(posting)

    def run(self, iteration=None):
        if iteration is not None:
            self.iteration = iteration
        self._zero_accumulators()
        pending = {}
        for op in self.order:
            for dep in self._deps[op.name]:
                if dep in pending:
                    self._wait(*pending.pop(dep))
            result, t0 = self._execute(op, "main")
            if result is not None:
                pending[op.name] = (op, result, t0)
        for args in list(pending.values()):
            self._wait(*args)
        self.iteration += 1

    def _wait(self, op, pending, t0):
        start = time.monotonic()
        while not pending.test():
            if time.monotonic() - start > self.stall_timeout:
                raise StallError(_stall_message(self.rank, [(op, pending)], self.stall_timeout))
            time.sleep(self.poll_interval)
        pending.finish()
        if self.profiler is not None:
            self.profiler.record(op, self.kernels[op.name].category, t0, time.perf_counter(),
                                 self.iteration, "comm")


def _stall_message(rank, pending, timeout, held=()):
    parts = []
    for op, p in pending:
        desc = p.describe() if hasattr(p, "describe") else ""
        parts.append(f"op '{op.name}' ({op.op_type}{', ' + desc if desc else ''})")
    parts += [f"op '{name}' (not posted: {why})" for name, why in held]
    return (f"rank {rank}: communication stalled for more than {timeout:.0f} s; "
            f"still waiting on: " + "; ".join(parts))
