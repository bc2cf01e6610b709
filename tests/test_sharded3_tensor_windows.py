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


def _one_sided(tokens, iters=10, **par):  # noqa: F811
    return _gpt(tokens, "sharded", "adamw", iters=iters, shard=3, transport="one_sided",
                **par)


@pytest.mark.parametrize("per_host", [None, "1"])
def test_tensor_shards_in_windows_over_their_replicas(tokens, monkeypatch, per_host):  # noqa: F811
    """Offline, 2 replicas x 2-way at stage 3 with ``one_sided``: no
    Allgather is left; each bucket's two WindowSyncs barrier on the rank's
    tensor shard's replicas. One node: each bucket's weights are one shared
    region owned by the shard's first replica (the weight shard a view of
    it), the node's windows hold scheme tensor's weights once (each tensor
    shard's whole; up to a cache line per bucket), not R times, and only
    the owners hold weights. A host per rank: each rank's shard is its own
    RMA region, the gathers GetShards of the replicas' regions. Both: the
    ranks' collectives agree (check_collectives' signature) and the
    transport row names the groups. (Before: exit 2, 'transport one_sided
    with parallel.tensor_parallel is refused'.)"""
    from purine_mpi.runtime.footprint import model_state_bytes, window_bytes
    from tests.test_sharded_stages import _bytes, check_stage3_windows
    if per_host:
        monkeypatch.setenv("PURINE_RANKS_PER_HOST", per_host)
    job = make_job(_one_sided(tokens))
    signatures, windows, buckets = [], 0, 0
    for rank in range(4):
        g, comp = composed(job, 4, rank)
        group = [rank % 2, rank % 2 + 2]
        check_stage3_windows(g, comp, group, rank, per_host)
        (what, how, why), = comp.transport
        assert what == "weights" and f"tensor shard ranks {group} on" in why
        assert ("RMA Get" in how) == bool(per_host)
        if not per_host:
            assert "one shared window of its tensor shard" in how
            held = model_state_bytes(g)["weights"]
            whole = _bytes(_gpt(tokens, "tensor", "adamw"), 4, rank)["weights"]
            assert held == (whole if rank == group[0] else 0), rank
            windows += window_bytes(comp, rank)
            buckets += len(comp.shard_plan) * (rank == group[0])
        signatures.append(comm_signature(g))
    assert compare_signatures(signatures) == []
    if not per_host:  # one replica's weights: tensor's ranks 0 and 1
        tensor = sum(_bytes(_gpt(tokens, "tensor", "adamw"), 4, r)["weights"] for r in (0, 1))
        assert tensor <= windows <= tensor + 64 * buckets, (windows, tensor)


def test_3d_windows_numbered_with_the_allreduces_and_transfers():
    """Offline, 2 replicas x 2 stages x 2-way (8 ranks, the residual MLP
    cut inside a split pair, 2 micro-batches under 1F1B) at stage 3 with
    ``one_sided``: each (stage, tensor shard) position's buckets in shared
    regions over its replicas, the WindowSyncs on that position's ranks,
    beside the stage transfers' windows; every rank's collectives and
    transfers agree (check_collectives' signature, the tensor allreduces,
    the barriers and the Puts in one order). (Before: exit 2.)"""
    from tests.test_sharded_stages import STAGES
    from tests.test_tensor_pipeline import _mlp, _zero3d
    job = make_job(_mlp(_zero3d(dict(STAGES), 3, transport="one_sided", micro_batches=2,
                                schedule="1f1b")))
    signatures = []
    for rank in range(8):
        g, comp = composed(job, 8, rank)
        group = [rank % 4, rank % 4 + 4]
        syncs = [op for op in g.ops.values() if op.op_type == "WindowSync"]
        assert syncs and len(syncs) == 2 * len(comp.shard_plan)
        assert all(op.attrs["group"] == group for op in syncs), rank
        assert not any(op.op_type == "Allgather" for op in g.ops.values())
        assert [row[0] for row in comp.transport] == ["activations and gradients", "weights"]
        assert f"stage and tensor shard ranks {group} on one node" in comp.transport[1][2]
        signatures.append(comm_signature(g))
    assert compare_signatures(signatures) == []


def test_transport_notes(tokens):  # noqa: F811
    """``transport`` has an effect at stage 3 on 2 replicas (no note); on
    one replica (2 ranks) the run is scheme tensor's, whose allreduces are
    two-sided: the note says so."""
    from purine_mpi.parallel.compose import settings_without_effect
    job = make_job(_one_sided(tokens))
    assert not any("parallel.transport" in n for n in settings_without_effect(job, 4))
    assert any(n.startswith("note: parallel.transport") and "scheme tensor's allreduces" in n
               for n in settings_without_effect(job, 2))


@pytest.mark.mpi
def test_trains_as_the_two_sided_gathers(tmp_path, monkeypatch, train_once, tokens):  # noqa: F811
    """4 ranks (2 replicas x 2-way), 3 steps of AdamW with
    ``check_collectives``: the weights and the optimizer state equal those
    of the two-sided gathers bit for bit (the same arithmetic: only the
    copies are gone), with the comm ops shaken by PURINE_COMM_DELAY; the
    start-up block names both tensor shards' windows; every rank frees its
    shared window. (Before: exit 2.)"""
    ref, _ = train_once(4, _gpt(tokens, "sharded", "adamw", iters=3, shard=3,
                                transport="two_sided"))
    monkeypatch.setenv("PURINE_DEBUG_WINDOWS", "1")
    monkeypatch.setenv("PURINE_COMM_DELAY", "3:7")
    out, text = _train(tmp_path, "one", 4, _one_sided(tokens, 3, check_collectives=True))
    a, b = _params(ref / "latest.h5"), _params(out / "latest.h5")
    assert sorted(a) == sorted(b) and any(k.startswith("solver/") for k in a)
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    row = re.search(r"^\s*transport\s+(.*)$", text, re.M).group(1)
    assert row.startswith("weights: one shared copy per node") and \
        "tensor shard ranks [0, 2] on one node, tensor shard ranks [1, 3] on one node" in row
    freed = re.findall(r"^rank (\d+): windows freed \(shared\)$", text, re.M)
    assert sorted(map(int, freed)) == [0, 1, 2, 3], text[-3000:]
