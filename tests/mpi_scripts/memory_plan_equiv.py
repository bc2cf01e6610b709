"""The micro-batch memory plan changes memory, not results: every rank
trains the same config twice, with the plan (copies share activation
buffers, parallel/micro_memory.py) and without it (a Scheme whose
plan_memory does nothing), and the losses, parameters and momenta must be
bitwise identical after every iteration.

    mpiexec -n K python tests/mpi_scripts/memory_plan_equiv.py SCHEME M SCHEDULE [ITERS]

SCHEME is data, pipeline (2 stages), pipeline3 (3 stages) or hybrid (2
stages, K / 2 replicas),
on the dropout-free net of tests/test_micro_batches.py. Each rank prints
``OK memory_plan shared S act A/U alloc X/Y rank R``: S blobs planned,
A / U activation bytes with / without the plan, X / Y all bytes the
workspace allocated with / without it.
"""
import sys

import numpy as np

from common import ok, world

from purine_mpi.parallel.compose import Scheme
from purine_mpi.parallel.micro_memory import activation_bytes
from purine_mpi.train.trainer import Trainer
from tests.conftest import make_job
from tests.test_micro_batches import STAGES, _config


class Unshared(Scheme):
    def plan_memory(self, graph, config, world):
        return None


scheme, micro, schedule = sys.argv[1], int(sys.argv[2]), sys.argv[3]
iters = int(sys.argv[4]) if len(sys.argv) > 4 else 4
w = world()
par = {"scheme": scheme, "micro_batches": micro, "schedule": schedule}
if scheme == "pipeline3":  # three stages: 1F1B keeps 3, 2, 1 micro-batches
    par.update(scheme="pipeline", stages=dict(STAGES, pool1=1, fc1=1, relu3=1, fc2=2, loss=2))
elif scheme != "data":
    par["stages"] = STAGES
raw = _config(**par)
raw["data"]["train"]["batch_size"] = 8
# the micro-batch plan alone: the host arena (runtime/memory_plan.py, tested
# in tests/test_memory_plan.py) would change the bytes compared below
raw["memory_plan"] = False


def train(plan):
    t = Trainer(make_job(raw), "/nonexistent-unused", world=w, log=lambda m: None,
                scheme=None if plan else Unshared())
    try:
        seen = []
        for it in range(iters):
            t.step(it)
            # the deferred update of data parallelism may still be running:
            # read the step's values once it is done, as a checkpoint does
            t.train.drain()
            losses = [t.ws[b].copy() for b in t.graphs.losses]
            state = {n: t.ws[n].copy() for n, b in t.graphs.graph.blobs.items()
                     if b.kind in ("param", "state") and b.alias_of is None}
            seen.append((losses, state))
        return seen, t.graphs.memory_plan, activation_bytes(t.graphs.graph), t.ws.allocated_bytes
    finally:
        t.close()


got, plan, act, alloc = train(True)
ref, none, act_ref, alloc_ref = train(False)
assert none is None
for it, ((la, sa), (lb, sb)) in enumerate(zip(got, ref)):
    assert len(la) == len(lb)
    for a, b in zip(la, lb):
        assert np.array_equal(a, b), f"iteration {it}: loss {a} != {b} without the plan"
    assert sorted(sa) == sorted(sb) and sa
    for n in sa:
        assert np.array_equal(sa[n], sb[n]), f"iteration {it}: {n} differs without the plan"
shared = len(plan["shared"]) if plan else 0
assert alloc_ref - alloc == act_ref - act == (plan["saved_bytes"] if plan else 0), \
    (alloc, alloc_ref, act, act_ref, plan and plan["saved_bytes"])
ok(f"memory_plan shared {shared} act {act}/{act_ref} alloc {alloc}/{alloc_ref}")
