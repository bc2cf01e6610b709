"""purine_mpi: a bi-graph deep-learning framework for MPI clusters (after Purine, ICLR 2015)."""
from .base import rss as _rss
from .base import threads as _threads

__version__ = "0.1.0"

# every entry point passes here first, before NumPy loads its BLAS
_threads.apply()
# freed large arrays go back to the system (base/rss.fix_mmap_threshold)
_rss.fix_mmap_threshold()
# one malloc arena: worker threads' freed temporaries serve every thread
# (base/rss.limit_malloc_arenas), before any worker thread starts
_rss.limit_malloc_arenas()
