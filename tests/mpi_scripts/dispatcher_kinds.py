"""Which dispatcher classes a ``train`` run builds on each rank.

    mpiexec -n N python tests/mpi_scripts/dispatcher_kinds.py train CONFIG ...

Runs the CLI (``purine_mpi.cli.main`` with the arguments given) with every
dispatcher's constructor noting its class, then prints one line per rank:
``DISPATCHERS rank R: <class names, sorted, comma-separated>`` -- a
parameter server's graph and the workers' train and test graphs alike.
"""
import sys

from purine_mpi.comm.launcher import launched_rank
from purine_mpi.runtime.dispatcher import Dispatcher

built = set()
init = Dispatcher.__init__


def noting(self, *args, **kw):
    built.add(type(self).__name__)
    init(self, *args, **kw)


Dispatcher.__init__ = noting

from purine_mpi.cli import main  # noqa: E402

status = main(sys.argv[1:])
# one write, newline included: print writes its end apart, and with
# PYTHONUNBUFFERED (set where CI runs) each is its own write to the pipe, so
# another rank's output came between the two (mpiexec forwards each rank's
# chunks as they come: "DISPATCHERS rank 1: SerialDispatcherfinal {...")
sys.stdout.write(f"DISPATCHERS rank {launched_rank()}: {','.join(sorted(built))}\n")
sys.stdout.flush()
sys.exit(status)
