"""``plan`` under ZeRO (scheme sharded) above ``plan.ALL_RANKS`` ranks
(issue 44): a shard is ``comm.ops.shard_range``'s ``[r*c, min(n, (r+1)*c))``,
``c = ceil(n/N)``, so where a bucket's n does not divide by N the last
ranks hold less of it (or none), and their rows differ from rank 1's:
optimizer state, weights (stage 3), gradients, kept blobs, activations
(the memory plan's colouring of other blobs). ``plan`` builds every rank
there (``plan._alike``); each rank's row of ``plan --json`` must be that
rank built alone (``offline_footprints`` of that rank). Before, ranks 2..N-1
were taken as like rank 1: on 9 ranks ranks 6, 7 and 8 differed (stage 1:
rank 8's optimizer state 256 bytes, plan said rank 1's 408; rank 7's kept
blobs 32, plan said 16: a row plan understated)."""
import json

import pytest

from purine_mpi.job.config import load_job
from purine_mpi.tools.plan import (ALL_RANKS, MemoryLimits, offline_footprints, run_plan,
                                   set_transports)

#: parameter counts 65, 13, 91 and 7 (fc1's weight and bias, fc2's): none
#: divides by 9, and fc1's bias and fc2's have fewer elements than ranks
NET = """name: zero_uneven
seed: 3
data:
  train: {source: synthetic, shape: [1, 1, 5], classes: 7, num_samples: 64, batch_size: 4}
net:
  - {type: fc, name: fc1, bottom: data, top: fc1, num_output: 13}
  - {type: relu, name: relu1, bottom: fc1, top: fc1}
  - {type: fc, name: fc2, bottom: fc1, top: fc2, num_output: 7}
  - {type: softmax_loss, name: loss, bottom: [fc2, label], top: loss}
solver: {type: adamw, base_lr: 0.01, max_iter: 100, display: 1}
parallel: {scheme: sharded, shard: SHARD}
"""


@pytest.mark.parametrize("shard", [1, 3])
def test_plan_rows_under_zero_are_each_rank_built_alone(tmp_path, shard):
    n = ALL_RANKS + 1
    path = tmp_path / "job.yaml"
    path.write_text(NET.replace("SHARD", str(shard)))
    job = load_job(str(path), (), check_files=False)
    limits = MemoryLimits(check=False, ranks_per_node=n)  # one node: every rank alike there
    out, _ = run_plan(job, n, limits, as_json=True)
    rows = {r: k for k in json.loads(out)["ranks"] for r in k["ranks"]}
    assert sorted(rows) == list(range(n))
    alone, _ = offline_footprints(job, n, list(range(n)), limits=limits)
    set_transports(alone, n, limits)
    for r in range(n):
        own = alone[r].as_dict()
        for where in ("host", "devices"):
            assert rows[r].get(where) == own.get(where), (r, where, rows[r].get(where),
                                                          own.get(where))
    # the shards do differ: the last rank holds less optimizer state than rank 1
    assert alone[n - 1].host["optimizer_state"] < alone[1].host["optimizer_state"]
