"""The plan's windows row (runtime/footprint.py) against the windows this
rank has allocated (comm/windows.live_windows: the segments MPI gave it,
``Shared_query``'s / the RMA window's memory), for a pipeline's rank graphs
built as ``train`` builds them: the training graph's windows and the test
graph's (before, the test graph's were in no row: its windowed blobs are
out of the test arena and its composition was dropped).

argv[1]: the job's config, argv[2:]: --set values."""
import sys

from common import ok, world  # noqa: F401  (sys.path: the repository)
from purine_mpi.comm.window_layout import ALIGN
from purine_mpi.comm.windows import live_windows
from purine_mpi.job.config import load_job
from purine_mpi.parallel.rank_graphs import build_rank_graphs
from purine_mpi.runtime.footprint import footprint, workspace_plans

w = world()
job = load_job(sys.argv[1], sys.argv[2:])
graphs = build_rank_graphs(job, w, check_memory=False)
fp = footprint(graphs, workspace_plans(graphs, job.memory_plan), w.rank)
# each window's segment of this rank: the bytes its regions and words need,
# at least ALIGN (a rank that owns nothing in a window still gets ALIGN)
segments = [win._bases[(where, w.rank)].nbytes for win in live_windows()
            for where in win.wins if (where, w.rank) in win._bases]
assert len(live_windows()) == 2, live_windows()  # the training graph's and the test graph's
planned = fp.host["windows"]
allocated = sum(n for n in segments if n > ALIGN)
assert planned == allocated, (w.rank, planned, segments)
ok("plan_windows")
