"""ZeRO stage 3's weights in windows (``parallel.transport: one_sided``,
parallel/zero3_windows.py) with tensor parallelism (issue 43): R replicas
x t shards (with ``parallel.stages`` too: each (stage, tensor shard)
position's R replicas) put each tensor shard's buckets in windows over its
replicas -- one shared region per bucket on one node, each replica's shard
in its RMA window across hosts -- and the buckets' WindowSyncs are numbered
with the tensor groups' allreduces (and beside the stage transfers) in one
order, the same on every rank (``sharding.sequence_collectives``). A
bucket's ``release`` is placed after its readers, never before this rank's
updates of its shard (which differ between the replicas: with stages a
GPT's release and reduce-scatter were posted in another order on each
replica). On 2 replicas x 2-way (4 ranks) the tiny GPT trains as with the
two-sided gathers bit for bit, the node holding each tensor shard's
weights once."""
import re

import numpy as np
import pytest

from purine_mpi.comm.verify import comm_signature, compare_signatures
from purine_mpi.tools.graph import composed
from tests.conftest import make_job
from tests.gpt_nets import block_stages, gpt_config
from tests.test_micro_batches import _params
from tests.test_sharded import _train
from tests.test_sharded_tensor import _gpt, tokens  # noqa: F401  (the fixture)


def _signatures(job, n):
    return [comm_signature(composed(job, n, rank)[0]) for rank in range(n)]


def test_stages_release_in_one_order(tokens):  # noqa: F811
    """2 replicas x 2 stages of a GPT at stage 3 with ``one_sided`` (one
    node, shared regions), 2 micro-batches: each stage's replicas post
    their collectives in one order (check_collectives' signature). Before:
    'collective #7 among ranks [1, 3] differs: rank 1 posts WindowSync ...
    weight_bucket0.release, rank 3 posts ReduceScatter' (the release placed
    before the rank's first update of its shard)."""
    job = make_job(gpt_config(tokens, layers=1, iters=3, parallel={
        "scheme": "sharded", "stages": block_stages(1), "shard": 3,
        "transport": "one_sided", "micro_batches": 2}))
    signatures = _signatures(job, 4)
    assert sum(e["kind"] == "WindowSync" for e in signatures[1]) > 0
    assert compare_signatures(signatures) == []
