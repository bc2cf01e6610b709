"""The synchronisation of weights that every rank of one node reads in
place from one shared window (ZeRO stage 3 with ``parallel.transport:
one_sided``; parallel/zero3_windows.py places it): a ``WindowSync`` op
stands where a stage-3 ``Allgather`` stood. The gathered buffer *is* the
window, so nothing is copied: the op only orders the ranks' accesses.

WindowSync  ins []  outs []  attrs seq, window, (phase), (bucket)
    a memory barrier on the shared window (``Win_sync``: this rank's
    stores into it are visible), an ``MPI_Ibarrier`` posted in ``seq``
    order as the other collectives are, and, once every rank reached it,
    another ``Win_sync`` (the others' stores are visible to this rank's
    loads): MPI's sync-barrier-sync of a shared window (MPI-3.0 §11.7).
    Where it stands decides what it orders (``phase``): before a bucket's
    readers (``acquire``), every rank's update of its slice is complete;
    after them and before the updates (``release``), no rank still reads
    the old weights.

The same op orders stage 3's gathers across hosts (each rank's weight
shard in its own RMA window, read by the others' ``GetShards``,
comm/rma_pull.py): ``Win_sync`` there makes the owner's stores into its
shard the window's public copy before the barrier lets the others read it.
"""
from ..ops.registry import register
from .ops import CollectiveKernel, comm_delay
from .windows import find_windows
from .world import MPI_LOCK


@register
class WindowSync(CollectiveKernel):
    """Every rank reached this op, and the shared window's stores made
    before it are visible after it (see the module docstring)."""

    op_type = "WindowSync"
    mpi_call = "Ibarrier"

    @classmethod
    def infer(cls, attrs, ins):
        return []

    def setup(self, ins, outs):
        self.win = find_windows(self.attrs["window"])
        if self.win is None:
            raise RuntimeError(f"window region '{self.attrs['window']}' is not allocated "
                               "(parallel/zero3_windows.py allocates it at start-up)")
        self.nbytes = 0
        self._setup_done = True

    def _sync(self):
        with MPI_LOCK:
            for win in self.win.wins.values():  # shared, and RMA (its public copy)
                win.Sync()

    def run(self, ins, outs):
        if not getattr(self, "_setup_done", False):
            self.setup(ins, outs)
        comm_delay()()
        self._sync()  # this rank's stores into the window, before the others pass
        if self._alone():
            return None
        return self._posted([self.comm().Ibarrier()])

    def _what(self):
        return f"({self.attrs.get('phase', 'sync')}) seq {self.attrs.get('seq', '?')}"

    def _finish(self):
        self._sync()  # the others' stores, before this rank's next loads
