"""Op kernels, one family per module, registered by op_type.

Layer: ops (docs/DESIGN.md); may import the foundation, devices and data
layers below it, and its own.
"""
