"""How many BLAS/OpenMP threads one rank uses, decided once for every entry
point (``python -m purine_mpi``, the ``purine-mpi`` script, ``import
purine_mpi``), before NumPy loads its BLAS.

Several ranks on one node must not each start a BLAS pool of every core:
oversubscribed, they all crawl (a 2-rank job ran 7x slower through the
script than through ``python -m`` when only one of them limited its
threads). The default is the cores this rank may run on (its CPU affinity
mask: SLURM's ``--cpus-per-task``, ``taskset``, a cgroup) divided among the
ranks of this host, and at least 1. ``PURINE_THREADS`` overrides it; so does
``OMP_NUM_THREADS`` when the user set it. The decision is exported as
``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` and ``MKL_NUM_THREADS`` (a
variable the user set keeps its value) and reported in the start-up block
as ``threads N per rank (why)``.

Imports nothing but the standard library: it must run before NumPy.

Layer: foundation (docs/DESIGN.md); may import only its own layer (the bottom
one), the standard library and third-party packages.
"""
import os
import sys

from . import env

#: variables that limit the BLAS and OpenMP pools
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
#: how launchers tell a rank how many ranks share its host
LOCAL_SIZE_VARS = ("PURINE_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                   "PMI_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")

#: (threads, why) as decided at import
DECISION = None
#: the thread variables the user had set before purine_mpi was imported
_set_before = {v for v in THREAD_VARS if v in os.environ}


def _positive(value):
    try:
        number = int(str(value).strip().split("(")[0])
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


def usable_cores():
    """The cores this process may run on (its affinity mask), else the count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def ranks_on_this_host(environ=os.environ):
    """(ranks sharing this host, the variable that said so), else (1, None)."""
    for var in LOCAL_SIZE_VARS:
        n = _positive(environ.get(var))
        if n is not None:
            return n, var
    return 1, None


def decide(environ=os.environ, cores=None):
    """(threads per rank, why) from the environment (see the module docstring)."""
    own = env.get("PURINE_THREADS", environ)  # EnvError (a ValueError) when not one
    if own is not None:
        return own, "PURINE_THREADS"
    user = _positive(environ.get("OMP_NUM_THREADS"))
    if user is not None:
        return user, "OMP_NUM_THREADS"
    cores = usable_cores() if cores is None else cores
    ranks, var = ranks_on_this_host(environ)
    threads = max(1, cores // ranks)
    if var is None:
        return threads, f"{cores} usable core{'s' if cores != 1 else ''}"
    return threads, f"{cores} usable cores / {ranks} ranks on this host ({var})"


def apply(environ=os.environ):
    """Decide and export the thread count (once per process); returns
    (threads, why). Called by ``purine_mpi/__init__.py``."""
    global DECISION
    if DECISION is not None:
        return DECISION
    try:
        threads, why = decide(environ)
    except ValueError as exc:
        threads, why = 1, f"{exc}; using 1"
    for var in THREAD_VARS:
        environ.setdefault(var, str(threads))
    if "numpy" in sys.modules and "OMP_NUM_THREADS" not in _set_before:
        why += "; NumPy was loaded first, so its BLAS may use other counts"
    DECISION = (threads, why)
    return DECISION



def describe():
    """The start-up block's line: ``N per rank (why)``."""
    threads, why = DECISION or apply()
    return f"{threads} per rank ({why})"
