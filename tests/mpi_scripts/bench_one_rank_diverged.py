"""``bench`` with one rank's weights diverged and no other's: a rank-local
NaN (the ranks named in PURINE_TEST_DIVERGED_RANKS find a NaN in their own
weights, ``DivergenceWatch.params_finite`` False and ``first_nonfinite``
'injected_on_rank_R'), every other rank finite.

    mpiexec -n N python tests/mpi_scripts/bench_one_rank_diverged.py bench CONFIG ...

bench's divergence check (tools/bench._diverged) gathers the blobs' names
only once the allreduce said some rank diverged: every rank must take that
gather, the finite ones too, or the job hangs; the line names the rank.
"""
import os
import runpy
import sys

rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
diverged = {int(r) for r in os.environ["PURINE_TEST_DIVERGED_RANKS"].split(",")}
if rank in diverged:
    from purine_mpi.train.divergence import DivergenceWatch
    DivergenceWatch.params_finite = staticmethod(lambda loop: False)
    DivergenceWatch.first_nonfinite = staticmethod(lambda loop: f"injected_on_rank_{rank}")
sys.argv = ["purine_mpi"] + sys.argv[1:]
runpy.run_module("purine_mpi", run_name="__main__")
