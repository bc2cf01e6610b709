"""The stall watchdog names the communication op that does not complete.

    mpiexec -n 2 python tests/mpi_scripts/stall.py

Rank 0 runs a graph with one bucket Allreduce (stall timeout 1 s); rank 1
never joins it (it sleeps). Rank 0's dispatcher raises StallError naming the
op and what it waits for ("Iallreduce grad_bucket0 ... seq 0"); the abort
handler prints it and ends the job, rank 1 included.
"""
import time

from common import world

from purine_mpi.graph import Graph
from purine_mpi.parallel.data_parallel import compose_data_parallel
from purine_mpi.runtime.factory import make_dispatcher

w = world()
if w.rank != 0:
    time.sleep(30)
    raise SystemExit(0)
g = Graph("stall")
g.add_op("make", "Constant", [], ["g"], {"value": 1.0, "shape": [1000]})
g.infer_shapes()
compose_data_parallel(g, {"p": "g"}, w.size, w.rank)
g.infer_shapes()
d = make_dispatcher(g, "event", rank=w.rank, stall_timeout=1.0)
d.run(0)
print("rank 0 finished, which it should not", flush=True)
