"""Op kernels, one family per module, registered by op_type."""
