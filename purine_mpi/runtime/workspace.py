"""Static memory for a graph: every blob gets its array once, before the first
iteration, and keeps it. Alias blobs are views into their storage root, so a
gradient bucket is one flat allocation whose per-parameter views the gradient
ops write in place (no packing copy for communication)."""
import numpy as np

from ..backend import xp_for_device
from ..errors import GraphError


class Workspace:
    """Arrays for all blobs of a graph, plus kernel instances."""

    def __init__(self, graph, shared=None):
        """``shared`` maps blob names to arrays owned elsewhere (the test
        graph reads the train graph's parameters without copying them)."""
        self.graph = graph
        self.arrays = dict(shared or {})
        self._flat = {}
        self.allocated_bytes = 0
        for name in graph.blobs:
            self._ensure(name)

    def _ensure(self, name):
        if name in self.arrays:
            return self.arrays[name]
        blob = self.graph.blobs[name]
        if blob.shape is None:
            raise GraphError(f"blob '{name}' has no shape; run shape inference first")
        if blob.alias_of is None:
            xp = xp_for_device(blob.location.device)
            flat = xp.zeros(max(blob.size, 1) if blob.shape else 1, dtype=blob.dtype)
            self._flat[name] = flat
            self.allocated_bytes += flat.nbytes
            arr = flat[:blob.size].reshape(blob.shape)
        else:
            root = self.graph.storage_root(name)
            self._ensure(root)
            flat = self._flat[root]
            off = self.graph._abs_offset(name)
            if np.dtype(blob.dtype) != flat.dtype:
                raise GraphError(f"alias blob '{name}' ({blob.dtype}) views '{root}' ({flat.dtype})")
            if off + blob.size > flat.size:
                raise GraphError(f"alias blob '{name}' (offset {off}, size {blob.size}) runs past "
                                 f"the end of '{root}' (size {flat.size})")
            arr = flat[off:off + blob.size].reshape(blob.shape)
        self.arrays[name] = arr
        return arr

    def __getitem__(self, name):
        return self.arrays[name]

    def storage(self, name):
        """The flat 1-D array that holds ``name``'s storage root."""
        return self._flat[self.graph.storage_root(name)]

    def set(self, name, value):
        """Copy ``value`` into blob ``name`` (shape-checked)."""
        arr = self.arrays[name]
        value = np.asarray(value) if not hasattr(value, "__cuda_array_interface__") else value
        if tuple(value.shape) != tuple(arr.shape):
            raise GraphError(f"cannot load blob '{name}': shape {list(value.shape)} given, "
                             f"the graph has {list(arr.shape)}")
        arr[...] = value
