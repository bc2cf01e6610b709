"""The sum of the data-parallel gradient buckets through a shared window
(``parallel.transport: one_sided`` on one node; parallel/dp_windows.py
places it): a ``WindowAllreduce`` op, whose ``attrs['window']`` names its
regions, runs here instead of ``MPI_Iallreduce``. It is an ``Allreduce``
of its own type (as NCCL's is): the same inputs, outputs and ``seq``, so
the posting order, the deferred tail and the reports are those of the
allreduce.

Its k-th run on rank r of P (regions ``<w>@r<q>`` of every rank q, the
result ``<w>.sum`` of rank 0, words ``<w>.arrived@r<q>`` and
``<w>.reduced@r<q>`` written by q only):

1. copies the bucket into its own region and raises ``arrived@r``;
2. once every rank's ``arrived`` is k: adds chunk r (elements
   [r·n/P, (r+1)·n/P)) of every rank's region, in rank order, into the same
   chunk of ``.sum``, and raises ``reduced@r``;
3. once every rank's ``reduced`` is k: copies ``.sum`` into the bucket
   (and scales it for ``average``).

A rank's region is written again (run k+1) only after its own run k saw
every rank's step 2 done, and ``.sum`` only after every rank started run
k+1, so after its copy-out of run k: nothing is overwritten while read.
With 2 ranks each element is a0 + a1, bitwise what MPI's sum gives.
"""
import time

import numpy as np

from ..ops.registry import register
from .ops import Allreduce, _mb
from .rma_ops import RMAPending
from .windows import find_windows


@register
class WindowAllreduce(Allreduce):
    """s_i = sum over the ``window_ranks`` ranks of g_i through the shared
    window ``window`` (mean with ``average``). Shapes pass through."""

    op_type = "WindowAllreduce"

    def run(self, ins, outs):
        self._prepare(ins, outs)
        return post_window_allreduce(self)


def post_window_allreduce(kernel):
    """Start the windowed sum of ``kernel``'s buffers (a WindowAllreduce
    kernel after its setup): an RMAPending (comm/rma_ops.py)."""
    attrs = kernel.attrs
    base = attrs["window"]
    win = find_windows(base + ".sum")
    if win is None:
        raise RuntimeError(f"window region '{base}.sum' is not allocated "
                           "(parallel/dp_windows.py allocates it at start-up)")
    size, me = int(attrs["window_ranks"]), win.rank
    state = getattr(kernel, "_window_state", None)
    if state is None:
        state = kernel._window_state = {
            "runs": 0, "own": win.local(f"{base}@r{me}"),
            "segs": [win.view(f"{base}@r{q}") for q in range(size)],
            "sum": win.view(base + ".sum")}
        n = state["own"].size
        state["chunk"] = slice(n * me // size, n * (me + 1) // size)
    state["runs"] += 1
    k, own, chunk = state["runs"], state["own"], state["chunk"]
    t0 = time.perf_counter()
    offset = 0
    for b in kernel.buffers:  # the bucket (or the outputs one after another)
        flat = b.reshape(-1)
        own[offset:offset + flat.size] = flat
        offset += flat.size
    win.notify(f"{base}.arrived@r{me}")
    stage = {"at": "arrived", "t": t0}
    spans = []

    def all_reached(word):
        return all(win.notified(f"{base}.{word}@r{q}") >= k for q in range(size))

    def step():
        if stage["at"] == "arrived":
            if not all_reached("arrived"):
                return False
            segs, out = state["segs"], state["sum"]
            np.add(segs[0][chunk], segs[1][chunk], out=out[chunk])
            for q in range(2, size):
                out[chunk] += segs[q][chunk]
            win.notify(f"{base}.reduced@r{me}")
            now = time.perf_counter()
            spans.append(("put", stage["t"], now, {"bytes_copied": int(own.nbytes)}))
            stage.update(at="reduced", t=now)
        if stage["at"] == "reduced":
            if not all_reached("reduced"):
                return False
            out, pos = state["sum"], 0
            scale = 1.0 / size if attrs.get("average", False) else None
            for b in kernel.buffers:
                flat = b.reshape(-1)
                flat[...] = out[pos:pos + flat.size]
                if scale is not None:
                    flat *= scale
                pos += flat.size
            spans.append(("get", stage["t"], time.perf_counter(),
                          {"bytes_copied": int(own.nbytes)}))
            kernel.bytes_copied = getattr(kernel, "bytes_copied", 0) + 2 * own.nbytes
            stage["at"] = "done"
        return True

    def describe():
        return (f"Allreduce {attrs.get('bucket', kernel.op.name)} {_mb(own.nbytes)} through "
                f"the shared window {base} (run {k}, waiting for every rank's "
                f"{stage['at']} word) seq {attrs.get('seq', '?')}")

    return RMAPending(step, describe, spans)

