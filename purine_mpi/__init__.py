"""purine_mpi: a bi-graph deep-learning framework for MPI clusters (after Purine, ICLR 2015)."""
import sys as _sys

# first, for the command line (``python -m purine_mpi``: "-m" while this
# package is imported; the ``purine-mpi`` script): a rank that fails or is
# interrupted before MPI is up must still end the job (comm/early_abort.py).
# cli.py installs the hook too, but only after this package's import, whose
# load sample below alone takes 0.1 s: a Ctrl-C there was a traceback on
# every rank it reached and the job's status 2 or 11 (ranks killed by the
# signal), not one line and 130. A library user's own script keeps its
# excepthook
_argv0 = (getattr(_sys, "argv", None) or [""])[0]
if _argv0 == "-m" or _argv0.endswith("purine-mpi"):
    from .comm import early_abort as _early_abort
    _early_abort.install()

from .base import rss as _rss  # noqa: E402
from .base import threads as _threads  # noqa: E402

__version__ = "0.1.0"

# every entry point passes here first, before NumPy loads its BLAS
_threads.apply()
# freed large arrays go back to the system (base/rss.fix_mmap_threshold)
_rss.fix_mmap_threshold()
# one malloc arena: worker threads' freed temporaries serve every thread
# (base/rss.limit_malloc_arenas), before any worker thread starts
_rss.limit_malloc_arenas()
