"""ZeRO stage 3 across hosts with RMA (issue 43; ``parallel.shard: 3``,
``parallel.transport: one_sided``, or ``auto`` where the network does
RDMA; parallel/zero3_windows.py): each rank's weight shard of every bucket
lies in its own RMA window, each gather is a ``GetShards`` (an MPI_Rget of
every owner's shard) between the bucket's acquire and release WindowSyncs;
the training is two-sided stage 3's bit for bit, the windows are freed;
``auto`` without RDMA keeps the two-sided gathers and says why; a stopped
rank ends the job within the stall timeout, the others naming the Get (and
the owner) or the barrier they wait in. Separate hosts are emulated:
``PURINE_RANKS_PER_HOST=1``, and ``PURINE_RMA_ACROSS_HOSTS`` says whether
the network does RDMA."""
import re

import numpy as np
import pytest

from purine_mpi.comm.ops import shard_range
from purine_mpi.comm.verify import comm_signature, compare_signatures
from purine_mpi.graph.core import reachable
from purine_mpi.ops.updates import UPDATE_OP_TYPES
from purine_mpi.runtime.memory_plan import check_plan, plan_memory
from purine_mpi.tools.graph import composed
from tests.conftest import make_job
from tests.test_micro_batches import _params
from tests.test_sharded import _job, _losses, _train

GOT = "RMA Get of the owners' shards"


def _hosts(n, rank, transport="one_sided"):
    return composed(make_job(_job("sharded", "adamw", shard=3, transport=transport)), n, rank)


@pytest.mark.parametrize("n", [2, 3])
def test_gathers_become_gets_between_the_barriers(monkeypatch, n):
    """From the composed graphs (no MPI), ranks on n (emulated) hosts: no
    Allgather is left; per bucket a GetShards per pass (forward, backward
    where the backward reads the weights) reading
    every rank's region, each after the bucket's acquire and before its
    release, every reader after its GetShards, every update of the shard
    after the release; the shard lives in the rank's own region (as big as
    its shard); the ranks' collectives agree; the memory plan is sound."""
    monkeypatch.setenv("PURINE_RANKS_PER_HOST", "1")
    signatures, seqs = [], []
    for rank in range(n):
        g, comp = _hosts(n, rank)
        assert check_plan(g, plan_memory(g)) == []
        (what, how, why), = comp.transport
        assert what == "weights" and how.startswith(GOT) and f"{n} nodes" in why
        assert not [op for op in g.ops.values() if op.op_type == "Allgather"]
        layout, _ = comp.window_placement
        deps = g.dependencies()
        for entry in comp.shard_plan:
            w, own = entry["weights"], entry["weight_shard"]
            regions = entry["windows"]
            assert g.blobs[own].attrs["window"] == regions[rank]
            for r, region in enumerate(regions):
                lo, hi = shard_range(g.blobs[w].size, n, r)
                assert layout.regions[region].owner == r
                assert layout.regions[region].shape == (hi - lo,)
            acquire, release = entry["gathers"]["acquire"], entry["gathers"]["release"]
            gets = list(entry["gets"].values())
            assert "forward" in entry["gets"] and all(g.ops[x].op_type == "GetShards" for x in gets)
            before_release = reachable(release, deps)
            for x in gets:
                assert g.ops[x].attrs["regions"] == regions
                assert acquire in reachable(x, deps) and x in before_release
            rooted = {b for b in g.blobs if g.storage_root(b) == own}
            updates = [op.name for op in g.ops.values() if rooted.intersection(op.outputs)]
            assert updates and all(g.ops[u].op_type in UPDATE_OP_TYPES for u in updates)
            for u in updates:
                assert release in reachable(u, deps), u
            for x in gets:
                out = g.ops[x].outputs[0]
                readers = [op.name for op in g.ops.values() if op.name not in gets and
                           {b for b in g.blobs if g.storage_root(b) == out} & set(op.inputs)]
                assert readers and all(x in reachable(r, deps) for r in readers)
        signatures.append(comm_signature(g))
        seqs.append(sorted((op.attrs["seq"], op.name) for op in g.ops.values()
                           if op.op_type in ("WindowSync", "ReduceScatter")))
    assert all(s == seqs[0] for s in seqs) and compare_signatures(signatures) == []


def test_auto_follows_rdma(monkeypatch):
    """``auto`` across (emulated) hosts: RMA Gets where the network does
    RDMA, the two-sided gathers (said why) where it does not; on one node
    ``auto`` keeps the gathers, as before."""
    monkeypatch.setenv("PURINE_RANKS_PER_HOST", "1")
    monkeypatch.setenv("PURINE_RMA_ACROSS_HOSTS", "1")
    g, comp = _hosts(2, 0, "auto")
    assert [op for op in g.ops.values() if op.op_type == "GetShards"]
    (_, how, why), = comp.transport
    assert how.startswith(GOT) and "PURINE_RMA_ACROSS_HOSTS=1" in why
    monkeypatch.setenv("PURINE_RMA_ACROSS_HOSTS", "0")
    g, comp = _hosts(2, 0, "auto")
    assert [op for op in g.ops.values() if op.op_type == "Allgather"]
    assert not [op for op in g.ops.values() if op.op_type in ("GetShards", "WindowSync")]
    assert comp.window_placement is None and comp.windows is None
    (_, how, why), = comp.transport
    assert "allgathered" in how and "PURINE_RMA_ACROSS_HOSTS=0" in why and "2 nodes" in why
    monkeypatch.delenv("PURINE_RANKS_PER_HOST")
    g, comp = _hosts(2, 0, "auto")
    assert [op for op in g.ops.values() if op.op_type == "Allgather"] and comp.transport is None


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_trains_as_two_sided_stage_3(tmp_path, monkeypatch, train_once, n):
    """10 AdamW steps (a test pass at 10) on n emulated hosts with RDMA:
    the weights, the moments and the losses equal two-sided stage 3's bit
    for bit (the Gets copy the same bytes), with comm ops shaken by
    PURINE_COMM_DELAY; the transport row names the Gets once; every rank
    frees its RMA window on exit. With ``auto`` and no RDMA the gathers
    stay, said once, and no window is allocated."""
    monkeypatch.setenv("PURINE_DEBUG_WINDOWS", "1")
    cfg = _job("sharded", "adamw", iters=10, shard=3)
    cfg["solver"]["test_interval"] = 10
    two, two_text = train_once(n, cfg)  # test_sharded3_onenode's too
    monkeypatch.setenv("PURINE_RANKS_PER_HOST", "1")
    monkeypatch.setenv("PURINE_RMA_ACROSS_HOSTS", "1")
    monkeypatch.setenv("PURINE_COMM_DELAY", "3:7")
    cfg["parallel"].update(transport="auto", check_collectives=True)
    rma, text = _train(tmp_path, "rma", n, cfg)
    monkeypatch.delenv("PURINE_COMM_DELAY")
    a, b = _params(two / "latest.h5"), _params(rma / "latest.h5")
    assert sorted(a) == sorted(b) and any(k.startswith("solver/") for k in a)
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    assert _losses(two) == _losses(rma)
    tests = [re.findall(r"test @ iter \d+: loss (\S+)", t) for t in (two_text, text)]
    assert len(tests[0]) == 1 and tests[0] == tests[1]
    lines = re.findall(r"^\s*transport\s+(.*)$", text, re.M)
    assert len(lines) == 1 and lines[0].startswith("weights: " + GOT) and \
        f"{n} nodes, PURINE_RMA_ACROSS_HOSTS=1" in lines[0], text
    assert "MPI_Rget of every owner's shard" in text
    freed = re.findall(r"^rank (\d+): windows freed \(rma\)$", text, re.M)
    assert sorted(map(int, freed)) == list(range(n)), text[-3000:]
    assert "windows freed" not in two_text
    if n == 2:
        monkeypatch.setenv("PURINE_RMA_ACROSS_HOSTS", "0")
        out, text = _train(tmp_path, "tcp", n, cfg)
        lines = re.findall(r"^\s*transport\s+(.*)$", text, re.M)
        assert len(lines) == 1 and "allgathered" in lines[0] and \
            "PURINE_RMA_ACROSS_HOSTS=0" in lines[0], text
        assert "windows freed" not in text
        c = _params(out / "latest.h5")
        assert all(np.array_equal(a[k], c[k]) for k in a)


@pytest.mark.mpi
def test_bench_counts_the_gets_as_one_sided(tmp_path, monkeypatch):
    """``bench --json`` on 2 emulated hosts with RDMA: the weights' Gets are
    one-sided transfers (``transport`` mixed: the gradients' reduce-scatters
    stay two-sided), and ``bytes_one_sided_per_iter`` is what rank 0's
    GetShards read of the other owner's shards each iteration, counted from
    its composed graph; ``bytes_copied_per_iter`` its own shards copied in
    (they said two_sided, 0 and 0)."""
    import json

    from tests.conftest import run_mpi_cli, write_config_file
    monkeypatch.setenv("PURINE_RANKS_PER_HOST", "1")
    monkeypatch.setenv("PURINE_RMA_ACROSS_HOSTS", "1")
    g, _ = _hosts(2, 0)
    got = copied = 0
    for op in g.ops.values():
        if op.op_type == "GetShards":
            whole = g.blobs[op.outputs[0]]
            lo, hi = shard_range(whole.size, 2, 0)
            own = (hi - lo) * np.dtype(whole.dtype).itemsize
            copied, got = copied + own, got + whole.nbytes - own
    assert got > 0 and copied > 0
    path = write_config_file(tmp_path, _job("sharded", "adamw", shard=3, transport="one_sided"))
    res = run_mpi_cli(2, "bench", path, "--iters", "2", "--warmup", "1", "--json", timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["transport"] == "mixed" and out["transport_lines"][0].startswith("weights: " + GOT)
    assert (out["bytes_one_sided_per_iter"], out["bytes_copied_per_iter"]) == (got, copied)
    assert out["bytes_allgathered_per_iter"] == 0 and out["bytes_reduce_scattered_per_iter"] > 0


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["rma", "shared"])
def test_sigterm_frees_the_rma_windows_on_every_rank(tmp_path, kind):
    """SIGTERM to rank 1 mid-run (``rma``: 2 emulated hosts, RMA Gets;
    ``shared``: one node, the one shared copy of tests/test_sharded3_onenode.py):
    every rank stops with a checkpoint (exit 143) and frees its windows on
    the way out, and the MPI library says nothing."""
    import os
    import signal
    import subprocess
    import time

    from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env, write_config_file
    from tests.test_ps_stop import _rank_of
    from tests.test_signals import _rank_pids, _wait_for_metrics, finish_ranks
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    cfg = _job("sharded", "adamw", iters=100000, shard=3, transport="one_sided")
    cfg["solver"].update(display=5, test_interval=0)
    out = str(tmp_path / "run")
    env = {**cli_env(), "PURINE_DEBUG_WINDOWS": "1"}
    if kind == "rma":
        env["PURINE_RANKS_PER_HOST"] = "1"
    proc = subprocess.Popen([MPIEXEC, "-n", "2", PYTHON, "-m", "purine_mpi", "train",
                             write_config_file(tmp_path, cfg, "run.yaml"), "--out", out],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    ranks = {}
    try:
        _wait_for_metrics(out, time.time() + 120)
        time.sleep(0.2)  # mid-run: gets and barriers in flight
        ranks = {_rank_of(pid): pid for pid in _rank_pids(out)}
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGTERM)
    finally:
        stdout, stderr = finish_ranks(proc, ranks.values(), 120)
    assert proc.returncode == 143, stderr[-3000:]
    assert "stopping at iter" in stdout and os.path.exists(os.path.join(out, "latest.h5"))
    got = GOT if kind == "rma" else "one shared copy per node"
    assert re.search(r"^\s*transport\s+weights: " + got, stdout, re.M), stdout[-3000:]
    freed = re.findall(r"^rank (\d+): windows freed \((\w+)\)$", stderr, re.M)
    assert sorted(set(int(r) for r, k in freed if k == kind)) == [0, 1], stderr[-3000:]
    assert "warning" not in stderr.lower() and "leak" not in stderr.lower(), stderr[-3000:]


#: separate hosts as MPICH sees them: no shared memory between the ranks
#: (``MPIR_CVAR_NOLOCAL``), the network's RMA over TCP (libfabric's tcp
#: provider), so an owner's own progress engine serves the Gets of its
#: shard, as on two hosts without RDMA offload (through shared memory a
#: stopped owner's shard is read anyway: no Get would ever wait)
ACROSS_HOSTS = {"PURINE_RANKS_PER_HOST": "1", "MPIR_CVAR_NOLOCAL": "1",
                "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
STALL = 2
#: a line of the graph's watchdog, and one of a wait outside the graph
GRAPH_STALL = re.compile(rf"^rank (\d+): communication stalled for more than {STALL} s; "
                         r"still waiting on: (.+)$")
OTHER_STALL = re.compile(rf"^rank (\d+): (.+?) stalled for more than {STALL} s "
                         r"\(parallel\.stall_timeout\)(: (rank \d+|a peer rank \(one of ranks [\d,]+; "
                         r"MPI's nonblocking collective does not say which\)) stopped responding"
                         r"( \((rank \d+ said it waits|ranks [\d,]+ said they wait) too\))?)?$")
#: what a waiting op of this graph says (comm/rma_pull.py, window_sync.py, ops.py)
WAITING = {
    "GetShards": re.compile(r"^op '([^']+)' \(GetShards, GetShards \S+ [\d.]+ [KMG]?B \(get #\d+: "
                            r"waiting for the shards of ranks \[([\d, ]*)\] of \[([\d, ]+)\]\) "
                            r"window rma region z3/\S+ seq \d+\)$"),
    "WindowSync": re.compile(r"^op '([^']+)' \(WindowSync, Ibarrier \S+ [\d.]+ [KMG]?B "
                             r"\((acquire|release)\) seq \d+\)$"),
    "ReduceScatter": re.compile(r"^op '([^']+)' \(ReduceScatter, Ireduce_scatter \S+ [\d.]+ "
                                r"[KMG]?B seq \d+\)$"),
    "not posted": re.compile(r"^op '([^']+)' \(not posted: [^()]*(\([^()]*\))?[^()]*\)$"),
    "more": re.compile(r"^and \d+ more$"),
}


def _landing(stderr, victim, n):
    """Where each rank's watchdog found itself waiting, from its one whole
    line (checked): {rank: set of op types, or the wait outside the graph}.
    A GetShards names the victim, and only it, as the owner not read yet."""
    found = {}
    for line in stderr.splitlines():
        if "stalled" not in line:
            continue
        m = GRAPH_STALL.match(line)
        if m:
            kinds = set()
            for part in m.group(2).split("; "):
                kind = [k for k, rx in WAITING.items() if rx.match(part)]
                assert kind, f"rank {m.group(1)}: {part!r} in\n{line}"
                kinds.add(kind[0])
                if kind == ["GetShards"]:
                    _, waiting, owners = WAITING["GetShards"].match(part).groups()
                    assert waiting == str(victim), f"victim {victim}: {part}"
                    others = set(range(n)) - {int(m.group(1))}
                    assert set(map(int, owners.split(", "))) <= others, part
        else:
            m = OTHER_STALL.match(line)
            assert m, f"not one whole line: {line!r}"
            kinds = {m.group(2)}
        rank = int(m.group(1))
        assert rank != victim and rank not in found, stderr[-3000:]
        found[rank] = kinds
    assert found, stderr[-3000:]
    return found


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_a_stopped_owner_ends_the_job_naming_the_get(tmp_path, n):
    """SIGSTOP of one rank at a random moment of a stage-3 run on n
    emulated hosts (RMA Gets over the network, ``parallel.stall_timeout``
    2 s): every rank ends within the timeout + 5 s, exit non-zero, no rank
    process left; each other rank says where it waited in one whole line
    -- a GetShards naming the stopped rank as the one owner whose shard
    has not arrived, a WindowSync (acquire or release), a ReduceScatter, or
    a wait outside the graph (the stop agreement, a metric mean). At least
    2 trials, and until one lands in a GetShards (up to 8). The job's
    /dev/shm segments are removed afterwards: MPICH keeps a killed rank's
    node segment, and here every rank is a node of its own."""
    import os
    import random
    import subprocess
    import time

    from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env, write_config_file
    from tests.test_ps_stop import _rank_of
    from tests.test_signals import _rank_pids, _wait_for_metrics, kill_ranks, sigstop_and_wait
    from tests.test_trust5_shm import _left, _mapped
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    rng = random.Random(4300 + n)
    cfg = _job("sharded", "adamw", iters=100000, shard=3, transport="one_sided",
               stall_timeout=STALL)
    cfg["solver"].update(display=5, test_interval=0)
    path = write_config_file(tmp_path, cfg, "run.yaml")
    env = {**cli_env(), **ACROSS_HOSTS, "PURINE_DEBUG_WINDOWS": "1"}
    landed, took = [], []
    for trial in range(8):
        out = str(tmp_path / f"t{trial}")
        proc = subprocess.Popen([MPIEXEC, "-n", str(n), PYTHON, "-m", "purine_mpi", "train",
                                 path, "--out", out], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ranks, names = {}, set()
        try:
            _wait_for_metrics(out, time.time() + 120)
            ranks = {_rank_of(pid): pid for pid in _rank_pids(out)}
            assert sorted(ranks) == list(range(n)), ranks
            names = _mapped(ranks.values())
            time.sleep(rng.uniform(0, 0.5))
            victim = rng.randrange(n)
            stdout, stderr, seconds = sigstop_and_wait(proc, ranks[victim], STALL + 5, trial,
                                                       f"rank {victim}")
            took.append(seconds)
            deadline = time.monotonic() + 2
            while _rank_pids(out) and time.monotonic() < deadline:
                time.sleep(0.05)  # the launcher reaps what it killed
            assert not _rank_pids(out), f"trial {trial}: a rank outlived the job"
        finally:
            kill_ranks(proc, ranks.values())
            for name in _left(names):
                os.unlink(os.path.join("/dev/shm", name))
        assert proc.returncode not in (0, None), stderr[-3000:]
        assert re.search(r"^\s*transport\s+weights: " + GOT, stdout, re.M), stdout[-3000:]
        assert "windows freed" not in stderr  # no collective free with a stopped rank
        found = _landing(stderr, victim, n)
        landed.append(sorted(set().union(*found.values())))
        if trial >= 1 and any("GetShards" in k for k in landed):
            break
    print(f"{n} ranks: SIGSTOP -> exit in {min(took):.2f}..{max(took):.2f} s; waited in "
          f"{landed}")
    assert any("GetShards" in k for k in landed), landed
