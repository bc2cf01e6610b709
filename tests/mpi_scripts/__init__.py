"""Programs the MPI tests launch with ``mpiexec -n K`` (see launch.py)."""
