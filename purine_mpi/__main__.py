"""``python -m purine_mpi``: see purine_mpi/cli.py."""
import os
import sys


def _limit_threads():
    # Several ranks on one node must not each start a BLAS pool of every core
    # (oversubscription slows all of them). Set before NumPy is imported;
    # an explicit setting by the user wins.
    ranks = next((os.environ[k] for k in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                                          "SLURM_NTASKS") if k in os.environ), "1")
    local = os.environ.get("MPI_LOCALNRANKS", os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", ranks))
    try:
        per_rank = max(1, (os.cpu_count() or 1) // max(1, int(local)))
    except ValueError:
        per_rank = 1
    threads = os.environ.get("PURINE_THREADS", str(per_rank))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, threads)


if __name__ == "__main__":
    _limit_threads()
    from .cli import main
    sys.exit(main())
