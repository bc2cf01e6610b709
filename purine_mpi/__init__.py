"""purine_mpi: a bi-graph deep-learning framework for MPI clusters (after Purine, ICLR 2015)."""
__version__ = "0.1.0"
