"""The bi-graph and the passes over it."""
from .core import CPU, Blob, Graph, Location, Op  # noqa: F401
