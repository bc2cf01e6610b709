"""Running a graph: dispatchers, workspace, traces, stop signals.

Layer: dispatch (docs/DESIGN.md); may import the foundation, devices, data,
ops, graph, job and composition layers below it, and its own.
"""
