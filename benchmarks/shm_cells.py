"""What MPICH's shared-memory cells make resident, against plan's "MPI
transport buffers" row (comm/mpi_transport.py): tests/test_mpi_transport.py's
probe (bare mpi4py processes, each sending 64 messages at once to every
other, 20 rounds, then an Allreduce and a 4 MiB Isend/Irecv; each rank's
growth of /dev/shm/mpich_shm_*'s resident pages since MPI_Init, from
/proc/self/smaps) on 2, 3 and 4 ranks, with the library's cells and with
32 cells, 4 KiB cells and 16 KiB cells (MPICH's CVARs). The figures of
docs/running.md's "MPI transport buffers" paragraph:

    python benchmarks/shm_cells.py [--ranks 2 3 4] [--variants default cells32 cell4k cell16k]

Prints one JSON object: per variant and rank count, each rank's growth and
the row's bytes (``transport_bytes``, the settings read through MPI_T
under that environment), in KiB.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from tests.test_mpi_transport import _PROBE  # noqa: E402

VARIANTS = {"default": {}, "cells32": {"MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS": "32"},
            "cell4k": {"MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_CELL_SIZE": "4096"},
            "cell16k": {"MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_CELL_SIZE": "16384"}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args()
    out = {}
    for v in args.variants:
        for n in args.ranks:
            env = {**os.environ, **VARIANTS[v],
                   "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
            p = subprocess.run(["mpiexec", "-n", str(n), sys.executable, "-c", _PROBE],
                               capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
            if p.returncode:
                out[f"{v}/{n}"] = {"error": (p.stderr.strip().splitlines() or ["?"])[-1]}
                continue
            got = json.loads(p.stdout.strip().splitlines()[-1])
            out[f"{v}/{n}"] = {"grown_kib": [g / 1024 for g in got["grown"]],
                               "planned_kib": got["planned"] / 1024}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
