"""The bi-graph and the passes over it.

Layer: graph (docs/DESIGN.md); may import the foundation, devices, data and
ops layers below it, and its own.
"""
from .core import CPU, Blob, Graph, Location, Op  # noqa: F401
