"""The job: its config, data, checkpoints and metrics files.

Layer: job (docs/DESIGN.md); may import the foundation, devices, data, ops and
graph layers below it, and its own.
"""
