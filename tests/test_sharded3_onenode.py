"""ZeRO stage 3 with one shared copy of the weights per node (issue 43;
``parallel.shard: 3``, ``parallel.transport: one_sided``,
parallel/zero3_windows.py): each bucket's weights are one region of a
shared window every rank reads in place, the gathers are WindowSync
barriers (before the readers; after the readers and before the updates),
the node holds the weights once, the training is stage 3's two-sided one
bit for bit, the windows are freed; across hosts no shared copy (RMA Gets instead:
tests/test_sharded3_rma.py)."""
import re

import numpy as np
import pytest

from purine_mpi.comm.verify import comm_signature, compare_signatures
from purine_mpi.graph.core import reachable
from purine_mpi.ops.updates import UPDATE_OP_TYPES
from purine_mpi.runtime.footprint import model_state_bytes, window_bytes
from purine_mpi.runtime.memory_plan import check_plan, plan_memory
from purine_mpi.tools.graph import composed
from tests.conftest import make_job, run_cli_here, write_config_file
from tests.test_cli import assert_user_error
from tests.test_micro_batches import _params
from tests.test_sharded import _job, _losses, _train
from tests.test_sharded23 import _psi


def _one_node(n, rank, solver="adamw", **par):
    return composed(make_job(_job("sharded", solver, shard=3, transport="one_sided", **par)),
                    n, rank)


@pytest.mark.parametrize("n", [2, 3])
def test_one_copy_of_the_weights_per_node(n):
    """From the composed graphs (no MPI): summed over the node's ranks,
    the weights held and the windows' bytes are the model's weights once
    (the windows up to a cache line per bucket), not N times; no Allgather
    is left, two WindowSyncs per bucket; every reader of a bucket comes
    before its release and after its acquire, every update of its slice
    after its release; the ranks' collectives agree (seq, signature); the
    memory plan is sound."""
    psi = _psi(composed(make_job(_job("none")), 1, 0)[0])
    held = windows = 0
    signatures, seqs = [], []
    for rank in range(n):
        g, comp = _one_node(n, rank)
        assert check_plan(g, plan_memory(g)) == []
        plan = comp.shard_plan
        held += model_state_bytes(g)["weights"]
        windows += window_bytes(comp, rank)
        assert not [op for op in g.ops.values() if op.op_type == "Allgather"]
        syncs = [op for op in g.ops.values() if op.op_type == "WindowSync"]
        assert len(syncs) == 2 * len(plan)
        deps = g.dependencies()
        for entry in plan:
            w = entry["weights"]
            assert g.blobs[w].attrs["window"] == entry["window"]
            assert g.storage_root(entry["weight_shard"]) == w
            rooted = {b for b in g.blobs if g.storage_root(b) == w}
            updates = [op.name for op in g.ops.values() if rooted.intersection(op.outputs)]
            readers = [op.name for op in g.ops.values() if op.name not in updates
                       and rooted.intersection(op.inputs)]
            assert readers and all(g.ops[u].op_type in UPDATE_OP_TYPES for u in updates)
            acquire, release = entry["gathers"]["acquire"], entry["gathers"]["release"]
            before_release = reachable(release, deps)
            assert set(readers) <= before_release and acquire in before_release
            for r in readers:
                assert acquire in reachable(r, deps), r
            for u in updates:
                assert release in reachable(u, deps), u
        signatures.append(comm_signature(g))
        seqs.append(sorted((op.attrs["seq"], op.name) for op in g.ops.values()
                           if op.op_type in ("WindowSync", "ReduceScatter")))
    assert held == 4 * psi
    assert 4 * psi <= windows <= 4 * psi + 64 * len(plan)
    assert all(s == seqs[0] for s in seqs) and compare_signatures(signatures) == []


def test_across_hosts_no_shared_copy(monkeypatch):
    """Ranks on two (emulated) hosts: no shared copy; the gathers are RMA
    Gets of the owners' shards (tests/test_sharded3_rma.py), each rank's
    region its shard alone, and the transport line says so."""
    monkeypatch.setenv("PURINE_RANKS_PER_HOST", "1")
    g, comp = _one_node(2, 0)
    assert not [op for op in g.ops.values() if op.op_type == "Allgather"]
    assert [op for op in g.ops.values() if op.op_type == "GetShards"]
    assert not [e for e in comp.shard_plan if "window" in e]
    layout, node_of = comp.window_placement
    layout.place(node_of)
    assert {r.where for r in layout.regions.values()} == {"rma"}
    (what, how, why), = comp.transport
    assert what == "weights" and "RMA Get" in how and "2 nodes" in why


@pytest.mark.parametrize("shard", [1, 2])
def test_one_sided_below_stage_3_exits_2(tmp_path, shard):
    cfg = _job("sharded", "sgd", shard=shard, transport="one_sided")
    res = run_cli_here("train", write_config_file(tmp_path, cfg), "--out", tmp_path / "r")
    assert_user_error(res, "parallel.transport", f"shard {shard}", "shard 3")


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_trains_as_two_sided_stage_3(tmp_path, monkeypatch, train_once, n):
    """10 steps (a test pass at 10): the weights, the optimizer state and
    the losses equal two-sided stage 3's bit for bit (the same arithmetic:
    only the gathers' copies are gone), with comm ops shaken by
    PURINE_COMM_DELAY; the start-up block names the transport and holds
    the weights on rank 0 alone (the window's owner); every rank frees its
    shared window on exit. On 2 (emulated) hosts the gathers are RMA Gets
    (tests/test_sharded3_rma.py), said once, the same weights."""
    monkeypatch.setenv("PURINE_DEBUG_WINDOWS", "1")
    runs, texts = [], []
    for name, par in (("two", {}), ("one", {"transport": "one_sided",
                                              "check_collectives": True})):
        if name == "one":
            monkeypatch.setenv("PURINE_COMM_DELAY", "3:7")
        cfg = _job("sharded", "adamw", iters=10, shard=3, **par)
        cfg["solver"]["test_interval"] = 10
        # two-sided: test_sharded3_rma's run too
        out, text = train_once(n, cfg) if name == "two" else _train(tmp_path, name, n, cfg)
        runs.append(out)
        texts.append(text)
    monkeypatch.delenv("PURINE_COMM_DELAY")
    a, b = _params(runs[0] / "latest.h5"), _params(runs[1] / "latest.h5")
    assert sorted(a) == sorted(b) and any(k.startswith("solver/") for k in a)
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    assert _losses(runs[0]) == _losses(runs[1])
    tests = [re.findall(r"test @ iter \d+: loss (\S+)", t) for t in texts]
    assert len(tests[0]) == 1 and tests[0] == tests[1]
    one = texts[1]
    assert re.search(r"^\s*transport\s+weights: one shared copy per node.*ranks of one node\)$",
                     one, re.M), one
    assert "one shared window of the node" in one
    psi = _psi(composed(make_job(_job("none")), 1, 0)[0])
    assert re.search(r"model state .*\((\d+) \+", one).group(1) == str(4 * psi)
    freed = re.findall(r"^rank (\d+): windows freed \(shared\)$", one, re.M)
    assert sorted(map(int, freed)) == list(range(n)), one[-3000:]
    assert "windows freed" not in texts[0]
    if n == 2:
        monkeypatch.setenv("PURINE_RANKS_PER_HOST", "1")
        cfg = _job("sharded", "adamw", iters=10, shard=3, transport="one_sided")
        cfg["solver"]["test_interval"] = 10
        out, text = _train(tmp_path, "hosts", n, cfg)
        lines = re.findall(r"^\s*transport\s+(.*)$", text, re.M)
        assert len(lines) == 1 and "RMA Get" in lines[0] and "2 nodes" in lines[0], text
        assert "windows freed (rma)" in text
        c = _params(out / "latest.h5")
        assert all(np.array_equal(a[k], c[k]) for k in a)
