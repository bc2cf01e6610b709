"""Communication: the MPI world and its host table (``world``), the graph's
communication kernels Allreduce / Send / Recv (``ops``), the cross-rank
consistency check (``verify``) and device-buffer staging (``device``).
mpi4py is imported only when a World is first created.
"""
