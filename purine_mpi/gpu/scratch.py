"""Scratch memory of one stream on one device, planned once and kept (see
``Scratch``). The dispatcher's workspace (runtime/workspace.py) hands each
op the scratch of its stream; an op running alone gets its own
(``gpu/raw.op_scratch``). Imports NumPy and ``backend`` (CuPy on first use).
"""
import numpy as np

from ..base.backend import xp_for_device

#: byte alignment of device allocations (CuPy's, and the arena's blobs)
ARENA_ALIGN = 256


class Scratch:
    """Scratch memory of one stream on one device (im2col columns, GEMM
    partials, library workspaces). The ops of a stream run one after the
    other, so they share it; each op reserves what it needs in its
    ``setup`` and ``take``s it when it runs. The buffer is allocated at the
    first ``take`` (in the first iteration) at the largest reservation and
    kept, so a steady-state iteration allocates nothing and a captured CUDA
    graph's addresses stay valid (a request beyond the reservation gets a
    new, larger buffer; the old one stays alive for what captured it)."""

    def __init__(self, device):
        self.device = int(device)
        self.reserved = 0
        self._buffers = []

    @staticmethod
    def _layout(specs):
        offsets, total = [], 0
        for shape, dtype in specs:
            offsets.append(total)
            count = int(np.prod(shape, dtype=np.int64))
            nbytes = count * np.dtype(dtype).itemsize
            total += -(-max(nbytes, 1) // ARENA_ALIGN) * ARENA_ALIGN
        return offsets, total

    def reserve(self, *specs):
        """Reserve room for arrays of the given (shape, dtype) at once."""
        self.reserved = max(self.reserved, self._layout(specs)[1])

    @property
    def nbytes(self):
        return self._buffers[-1].nbytes if self._buffers else 0

    def take(self, *specs):
        """C-contiguous device arrays of the given (shape, dtype), disjoint,
        256-byte aligned, views of this stream's buffer (contents undefined)."""
        offsets, total = self._layout(specs)
        if not self._buffers or self._buffers[-1].nbytes < total:
            cupy = xp_for_device(self.device)
            with cupy.cuda.Device(self.device):
                self._buffers.append(cupy.empty(max(total, self.reserved), dtype=np.uint8))
        buf = self._buffers[-1]
        arrays = []
        for (shape, dtype), off in zip(specs, offsets):
            dtype = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            raw = buf[off:off + count * dtype.itemsize]
            arrays.append(raw.view(dtype).reshape(tuple(int(s) for s in shape)))
        return arrays
