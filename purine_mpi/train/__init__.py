"""The training loop's services: habits the loop calls at fixed points of
a run (after a test pass, at a checkpoint), each a small class of its own,
so a new habit is a new service, not an edit of the iteration.

Layer: services (docs/DESIGN.md); may import the foundation, devices, data,
ops, graph, job, composition and dispatch layers below it, and its own.
"""
