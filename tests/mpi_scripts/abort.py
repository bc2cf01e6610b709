"""An exception on one rank ends every rank promptly, non-zero.

    mpiexec -n K python tests/mpi_scripts/abort.py [op|plain]

Every rank runs a graph whose Allreduce needs all ranks. On rank 1 an op
("Boom") raises before that Allreduce can start, so the others wait in the
Allreduce: without the abort handler they would hang until the stall
timeout (set to 10 minutes here). The handler prints "rank 1: op 'boom'
(Boom) failed: ..." and calls MPI Abort, which ends the whole job at once.
With ``plain`` rank 1 raises outside any graph instead.
"""
import sys
import time

from common import world

from purine_mpi.graph import Graph
from purine_mpi.ops.registry import OpKernel, register
from purine_mpi.parallel.data_parallel import compose_data_parallel
from purine_mpi.runtime.factory import make_dispatcher

mode = sys.argv[1] if len(sys.argv) > 1 else "op"
w = world()


@register
class Boom(OpKernel):
    """Copies its input, or raises on the rank named by attrs ``rank``."""
    op_type = "Boom"

    @classmethod
    def infer(cls, attrs, ins):
        return [ins[0]]

    def run(self, ins, outs):
        if w.rank == self.attrs["rank"]:
            time.sleep(0.3)
            raise ValueError("boom on purpose")
        outs[0][...] = ins[0]


if mode == "plain" and w.rank == 1:
    time.sleep(0.3)
    raise RuntimeError("plain failure on purpose")
g = Graph("abort")
g.add_op("make", "Constant", [], ["x"], {"value": 1.0, "shape": [1000]})
g.add_op("boom", "Boom", ["x"], ["y"], {"rank": 1})
g.infer_shapes()
compose_data_parallel(g, {"p": "y"}, w.size, w.rank)
g.infer_shapes()
d = make_dispatcher(g, "event", rank=w.rank, stall_timeout=600)
d.run(0)
print(f"rank {w.rank} finished, which it should not", flush=True)
