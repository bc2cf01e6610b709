"""What a remote-memory device holds (comm/windows.py): the interface a
memory device implements (``MemoryDevice``), and the layout every rank
declares alike before the windows are allocated (``WindowLayout``: named
regions and notify words, each with its owner and the ranks that access
it; ``place`` puts each in a shared or an RMA window at an aligned
offset). Standard library and NumPy only.

The same interface for device memory (the paper's "remote machine as a
device" on GPUs), not built here: a ``MemoryDevice`` whose regions are CUDA
buffers of the ranks of one node -- each owner exports
``cudaIpcGetMemHandle`` of its allocation once (an allgather at start-up),
the others open it (``cudaIpcOpenMemHandle``), so ``view`` is a CuPy array
on the peer's memory and ``put`` a ``cudaMemcpyAsync`` into it -- keeps its
notify words in the host windows (after a stream synchronise).
"""
import numpy as np

ALIGN = 64  # bytes: every region starts on a cache line


class MemoryDevice:
    """The memory interface of a remote-memory device (the paper's "remote
    machine as a device"). Regions and notify words are named; a region is
    owned by one rank and reached by others through this interface.

    ``owner(name)``, ``local(name)`` (the owner's own array),
    ``view(name)`` (a directly addressable array of the owner's memory, or
    None), ``put(name, src)`` / ``rput`` / ``get(name, out)`` /
    ``accumulate(name, src)``, ``flush(name)``, ``notify(word, value)``,
    ``notified(word)``, ``wait_notified(word, count, timeout, what)``,
    ``free()``. Host windows implement it (``Windows``); a CUDA-IPC device
    would too (see the module docstring)."""

    kind = "abstract"

    def owner(self, name):
        raise NotImplementedError

    def local(self, name):
        raise NotImplementedError

    def view(self, name):
        raise NotImplementedError

    def put(self, name, src, offset=0):
        raise NotImplementedError

    def get(self, name, out, offset=0):
        raise NotImplementedError

    def accumulate(self, name, src, offset=0):
        raise NotImplementedError

    def notify(self, word, value=1):
        raise NotImplementedError

    def notified(self, word):
        raise NotImplementedError

    def free(self):
        raise NotImplementedError


# ------------------------------------------------------------------ layout
class Region:
    """One named buffer: its owner, shape, dtype, the ranks that access it,
    and where it lies (window ``where`` in {"shared", "rma"}, ``offset``
    bytes into its owner's segment); set by ``WindowLayout.place``."""

    def __init__(self, name, owner, shape, dtype, peers):
        self.name = name
        self.owner = int(owner)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.peers = tuple(sorted({int(p) for p in peers} - {self.owner}))
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.where = None
        self.offset = None

    def __repr__(self):
        return (f"Region({self.name!r}, owner {self.owner}, {self.shape} {self.dtype}, "
                f"peers {list(self.peers)}, {self.where} @ {self.offset})")


class WindowLayout:
    """What every rank declares, identically, before ``Windows.allocate``:
    ``add(name, owner, shape, dtype, peers)`` a region;
    ``add_word(name, owner, peers)`` a notify word (int64, starts at 0)."""

    def __init__(self):
        self.regions = {}
        self.words = {}

    def add(self, name, owner, shape, dtype, peers=()):
        if name in self.regions or name in self.words:
            raise ValueError(f"window region '{name}' declared twice")
        self.regions[name] = Region(name, owner, shape, dtype, peers)
        return self.regions[name]

    def add_word(self, name, owner, peers=(), writer=None):
        """A notify word of ``owner``; ``writer``: the one rank that ever
        notifies it, if only one does (its notify into a shared window is
        then a memory barrier and a store: no atomic operation)."""
        if name in self.regions or name in self.words:
            raise ValueError(f"notify word '{name}' declared twice")
        word = Region(name, owner, (1,), np.int64, list(peers) + ([writer] if writer is not None
                                                                  else []))
        word.writer = None if writer is None else int(writer)
        self.words[name] = word
        return word

    def describe(self):
        """A canonical text of the layout (for the ranks' consistency check)."""
        items = sorted(self.regions.values(), key=lambda r: r.name)
        items += sorted(self.words.values(), key=lambda r: r.name)
        return "\n".join(f"{r.name} {r.owner} {r.shape} {r.dtype} {r.peers}" for r in items)

    def place(self, node_of):
        """Choose each region's window and offset: "shared" when its owner
        and peers share one node (``node_of[rank]``), else "rma". Words go
        first in each segment, then regions, each aligned to ``ALIGN``."""
        sizes = {}
        for group in (self.words, self.regions):  # words first, each in name order
            for name in sorted(group):
                r = group[name]
                nodes = {node_of[r.owner]} | {node_of[p] for p in r.peers}
                r.where = "shared" if len(nodes) == 1 else "rma"
                key = (r.where, r.owner)
                r.offset = sizes.get(key, 0)
                sizes[key] = _aligned(r.offset + r.nbytes)
        return sizes


def _aligned(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN
