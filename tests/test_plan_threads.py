"""``plan --np N`` run outside mpiexec counts the host products' K-cut
scratch (ops/hostgemm.scratch_shape, at ``planned_threads``) at the
threads each of the N ranks gets on this host (base/threads.decide over
the ranks of its node, as a run under mpiexec computes them), not at those
of one process alone on the host. The case: one fc of 512 inputs into 32
outputs at 4096 samples a rank, whose weight gradient dy^T @ x, (32,
4096) @ (4096, 512), is cut along K into 8 pieces: 1 thread keeps one (32,
512) matrix (64 KiB), 2 threads one per piece after the first (7, 448
KiB). Its host scratch row holds nothing else."""
import json
import os
import shutil
import subprocess
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from purine_mpi.base import threads
from purine_mpi.job.config import load_job
from purine_mpi.ops import hostgemm
from purine_mpi.ops.catalog import get_kernel_class
from purine_mpi.tools.plan import MemoryLimits, offline_footprints, run_plan
from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env

BATCH, IN, OUT = 4096, 512, 32


def _config(tmp_path):
    cfg = {"name": "wide_k", "seed": 1,
           "data": {"train": {"source": "synthetic", "shape": [IN], "classes": OUT,
                              "num_samples": 2 * BATCH, "batch_size": BATCH}},
           "net": [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1",
                    "num_output": OUT},
                   {"type": "softmax_loss", "name": "loss", "bottom": ["fc1", "label"],
                    "top": "loss"}],
           "solver": {"type": "sgd", "base_lr": 0.01, "max_iter": 2},
           "checkpoint": {"interval": 0}}
    path = tmp_path / "wide_k.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _kept_by_the_kernel(count):
    """The bytes a fresh thread keeps after fc1's weight-gradient kernel
    ran on ``count`` threads (hostgemm's scratch)."""
    rng = np.random.default_rng(0)
    dy = rng.standard_normal((BATCH, OUT), dtype=np.float32)
    x = rng.standard_normal((BATCH, IN), dtype=np.float32)
    out = np.empty((OUT, IN), np.float32)
    k = get_kernel_class("InnerProductGradWeight")(SimpleNamespace(attrs={}, name="g"))
    k.setup([dy, x], [out])
    got = []

    def work():
        k.run([dy, x], [out])
        got.append(sum(a.nbytes for a in getattr(hostgemm._LOCAL, "flat", {}).values()))
    before = hostgemm.THREADS
    hostgemm.THREADS = count
    try:
        t = threading.Thread(target=work)
        t.start()
        t.join()
    finally:
        hostgemm.THREADS = before
    np.testing.assert_allclose(out, dy.T @ x, rtol=1e-4, atol=1e-2)
    return got[0]


@pytest.fixture
def host_of(monkeypatch):
    """A host of ``cores`` usable cores, no launcher, no thread count set."""
    def make(cores):
        monkeypatch.setattr(threads, "usable_cores", lambda: cores)
        monkeypatch.setattr(threads, "_set_before", set())
        monkeypatch.setattr(hostgemm, "THREADS", None)
        for var in threads.LOCAL_SIZE_VARS + ("PURINE_THREADS", "OMP_NUM_THREADS"):
            monkeypatch.delenv(var, raising=False)
    return make


@pytest.mark.parametrize("cores,size,per_node,rank_threads", [
    (2, 2, None, 1),   # 2 ranks on 2 cores: 1 thread each (before: planned at 2)
    (2, 2, 1, 2),      # one rank a node (--ranks-per-node 1): the node's 2 cores
    (4, 2, None, 2),   # 2 ranks on 4 cores: 2 each
    (4, 3, 2, None),   # nodes of 2 ranks and of 1: 2 threads, then 4
    (2, 1, None, 2),   # one rank: the host's
])
def test_plan_counts_the_threads_each_rank_gets(tmp_path, host_of, cores, size, per_node,
                                                rank_threads):
    """plan's host scratch row of each rank is what its weight-gradient
    kernel keeps at the threads ``threads.decide`` gives it under
    mpiexec (the launcher's count of the ranks on its node, none busy).
    Before, 2 ranks on 2 cores were planned at 2 threads each: 458752
    bytes against the 65536 a rank keeps ('assert 458752 == 65536')."""
    host_of(cores)
    job = load_job(str(_config(tmp_path)), (), None, check_files=False)
    limits = MemoryLimits(ranks_per_node=per_node)
    fps, _ = offline_footprints(job, size, list(range(size)), limits=limits)
    per = per_node or size
    for r in range(size):
        local = min(per, size - r // per * per)
        count = threads.decide({"MPI_LOCALNRANKS": str(local)})[0]
        if rank_threads is not None:
            assert count == rank_threads
        assert fps[r].host["host_scratch"] == _kept_by_the_kernel(count), (r, count)
    # plan's own JSON says the same
    out, status = run_plan(job, size, limits, as_json=True)
    rows = {r: k["host"]["host_scratch"] for k in json.loads(out)["ranks"] for r in k["ranks"]}
    assert rows == {r: fps[r].host["host_scratch"] for r in range(size)}


#: a 2-rank run's ranks write their hostgemm scratch after the last iteration
_HELD_AT_LOOP_END = """
import json, sys
sys.path.insert(0, "benchmarks")
import rss_vs_plan
out = sys.argv[1]
def at_end(rank):
    from purine_mpi.ops import hostgemm
    with open(f"{out}.{rank}", "w") as f:
        json.dump([hostgemm.held_bytes(), hostgemm.threads()], f)
sys.argv = ["purine_mpi"] + sys.argv[2:]
rss_vs_plan.run_hooked(lambda: None, at_end)
"""


@pytest.mark.skipif(shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2,
                    reason="needs taskset and 2 cores")
def test_plan_is_what_two_ranks_on_two_cores_keep(tmp_path):
    """``plan --np 2`` and ``mpiexec -n 2 train`` on the same 2 cores
    (taskset), no thread count set: each rank keeps the 64 KiB of one
    K-cut matrix at its 1 thread, and plan says so (before, it planned
    448 KiB: 2 threads, one matrix a piece after the first)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    path = _config(tmp_path)
    env = cli_env()
    for var in threads.LOCAL_SIZE_VARS + ("PURINE_THREADS", "OMP_NUM_THREADS"):
        env.pop(var, None)
    cores = ["taskset", "-c", ",".join(map(str, sorted(os.sched_getaffinity(0))[:2]))]
    p = subprocess.run(cores + [PYTHON, "-m", "purine_mpi", "plan", str(path), "--np", "2",
                                "--json"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    planned = {r: k["host"]["host_scratch"] for k in json.loads(p.stdout)["ranks"]
               for r in k["ranks"]}
    out = tmp_path / "held"
    t = subprocess.run(cores + [MPIEXEC, "-n", "2", PYTHON, "-c", _HELD_AT_LOOP_END, str(out),
                                "train", str(path), "--out", str(tmp_path / "run"),
                                "--iters", "1"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert t.returncode == 0, t.stderr[-3000:]
    for r in range(2):
        held, used = json.loads((tmp_path / f"held.{r}").read_text())
        assert used == 1, used
        assert held == planned[r] == OUT * IN * 4, (r, held, planned)


def test_a_rank_alone_on_the_last_node_is_planned_at_its_own_threads(tmp_path, host_of):
    """plan builds two ranks of data parallelism and takes the others
    as like them; ``--np 9 --ranks-per-node 2`` on nodes of 2 cores puts
    rank 8 alone on the last node, where the run gives it both cores (2
    threads: a K-cut matrix a piece after the first, 448 KiB) and no
    local peer's MPI cells. plan builds it for that node (rank 8 in a row
    of its own); before, it took rank 1's figures, planned at 1 thread
    beside a peer ('assert 65536 == 458752')."""
    from purine_mpi.base.threads import decide
    from purine_mpi.comm.mpi_transport import transport_bytes
    host_of(2)
    job = load_job(str(_config(tmp_path)), (), None, check_files=False)
    limits = MemoryLimits(ranks_per_node=2)
    out, status = run_plan(job, 9, limits, as_json=True)
    plan = json.loads(out)
    rows = {r: k["host"] for k in plan["ranks"] for r in k["ranks"]}
    assert sorted(rows) == list(range(9))
    for r in range(9):
        local = 1 if r == 8 else 2
        count = decide({"MPI_LOCALNRANKS": str(local)})[0]
        assert rows[r]["host_scratch"] == _kept_by_the_kernel(count), (r, count)
        assert rows[r]["mpi_transport"] == transport_bytes(local), r
    assert [r for k in plan["ranks"] if len(k["ranks"]) == 1 for r in k["ranks"]] == [8]
    node = {tuple(n["ranks"]): n["need_bytes"] for n in plan["nodes"]}
    assert node[(8,)] == rows[8]["total"]
    # the text says which ranks stand for others
    text, _ = run_plan(job, 9, limits)
    assert "ranks 2-7 were not built" in text and "rank 8:" in text, text


def test_ranks_alike_on_the_last_node_are_built_once(tmp_path, host_of):
    """``--np 11 --ranks-per-node 4``: ranks 8-10 share the last node, 3
    ranks (on 2 cores 1 thread each, as on the nodes of 4, but 2 local
    peers' MPI cells, not 3); rank 8 is built for them, ranks 9 and 10 are
    taken as like it, ranks 2-7 as like rank 1. With 12 ranks every node
    holds 4: ranks 0 and 1 stand for all."""
    from purine_mpi.tools.plan import ranks_to_build
    host_of(2)
    job = load_job(str(_config(tmp_path)), (), None, check_files=False)
    built, like = ranks_to_build(job, 11, MemoryLimits(ranks_per_node=4))
    assert built == [0, 1, 8]
    assert like == {**{r: 1 for r in range(2, 8)}, 9: 8, 10: 8}
    built, like = ranks_to_build(job, 12, MemoryLimits(ranks_per_node=4))
    assert built == [0, 1] and like == {r: 1 for r in range(2, 12)}


def test_many_alike_ranks_are_read_once_per_built_rank(tmp_path, host_of, monkeypatch):
    """``--np 20000`` on nodes of 8 (the launcher's SLURM_NTASKS_PER_NODE):
    plan builds ranks 0 and 1, every other rank is like rank 1; the
    figures of a rank not built are its built rank's, read once per built
    rank (its ``as_dict``, ``host_total``) and the placement once, not once
    per rank: each rank's row, each node's need (8 ranks' totals) as
    before. Before, each was read for every rank ('assert 40000 <= 20':
    --np 100000 took 3.8 s of CPU, 0.4 s after, 0.26 s of it imports)."""
    from purine_mpi.runtime.footprint import Footprint
    host_of(2)
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8")
    calls = {"as_dict": 0, "host_total": 0, "ranks_on_this_host": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(Footprint, "as_dict", counted("as_dict", Footprint.as_dict))
    monkeypatch.setattr(Footprint, "host_total",
                        property(counted("host_total", Footprint.host_total.fget)))
    monkeypatch.setattr(threads, "ranks_on_this_host",
                        counted("ranks_on_this_host", threads.ranks_on_this_host))
    job = load_job(str(_config(tmp_path)), (), None, check_files=False)
    size = 20000
    out, _ = run_plan(job, size, MemoryLimits(node=1 << 40), as_json=True)
    plan = json.loads(out)
    rows = {r: k["host"]["total"] for k in plan["ranks"] for r in k["ranks"]}
    assert sorted(rows) == list(range(size))
    assert len(plan["ranks"]) <= 2   # ranks 0 and 1 built, alike here: one row
    assert [n["ranks"] for n in plan["nodes"]] == [list(range(s, s + 8))
                                                   for s in range(0, size, 8)]
    for n in plan["nodes"]:
        assert n["need_bytes"] == sum(rows[r] for r in n["ranks"])
    assert max(calls.values()) <= 20, calls


@pytest.mark.parametrize("choose", [False, True])
def test_np_past_the_bound_is_refused_with_one_line(choose):
    """``plan --np N`` names every rank and node in its answer (the JSON's
    rank and node lists, a line per node), so its time and memory grow
    with N however alike the ranks are: --np 10000000 took 41.6 s and
    2.2 GB, 1e8 ran past 60 s. Past ``MAX_PLAN_RANKS`` (2**20) it is
    refused, before the job is read (a job file that does not exist: the
    same line), with one line and exit 2, --choose too. Before, it ran
    ('assert 2 == ... and out.stdout == ""' failed: the table printed,
    exit 2 only as the node did not fit; the job named here does not
    exist, so before it said that instead of the bound)."""
    from purine_mpi.tools.plan import MAX_PLAN_RANKS
    from tests.conftest import run_cli_here
    assert MAX_PLAN_RANKS == 1 << 20
    for job in ("digits_lenet.yaml", "no_such_job.yaml"):
        out = run_cli_here("plan", os.path.join(REPO, "jobs", job), "--np",
                           str(MAX_PLAN_RANKS + 1), *(["--choose"] if choose else []))
        assert out.returncode == 2 and out.stdout == "", (out.returncode, out.stdout[:300])
        assert out.stderr.strip().splitlines() == [
            f"error: --np {MAX_PLAN_RANKS + 1}: plan takes at most 1,048,576 ranks (it names "
            "every rank and node, so its time and memory grow with --np)"], out.stderr
