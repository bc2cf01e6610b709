"""``plan JOB --np N`` and train's start-up memory check (tools/plan.py,
runtime/footprint.py): the figures are the workspaces' own bytes, a job
whose numbers are known by hand gives them, and a job that cannot fit is
refused before its first iteration with a setting that fits."""
import json
import os
import re
import resource
import subprocess
import sys

import numpy as np
import pytest
import yaml

from purine_mpi.job.config import load_job
from purine_mpi.runtime.factory import planned_workspace
from purine_mpi.runtime.footprint import footprint, shared_params, workspace_plans
from purine_mpi.runtime.workspace import window_blobs
from purine_mpi.base.progress_bar import human_bytes
from purine_mpi.tools.plan import parse_bytes
from tests.conftest import run_cli_args, run_cli_here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = os.path.join(ROOT, "jobs")
PY = [sys.executable, "-m", "purine_mpi"]


@pytest.fixture(scope="module")
def email(email_h5):
    """gpt_tiny's text data, made from the standard library's email package
    (conftest's session file: the same ``data text`` command; read only)."""
    return email_h5


def _job(name, email=None, *sets):
    over = list(sets)
    if email:
        over += [f"data.train.path={email}", f"data.test.path={email}"]
    return load_job(os.path.join(JOBS, f"{name}.yaml"), over, None, check_files=False)


def _workspaces_bytes(job, size, rank):
    """The bytes the trainer's two workspaces allocate for ``rank`` of
    ``size`` (laid out as train/trainer.py's _dispatchers does), and the
    footprint of the same graphs."""
    import dataclasses
    from purine_mpi.parallel.rank_graphs import build_rank_graphs
    from purine_mpi.tools.graph import _OfflineWorld
    job = job.replace(parallel=dataclasses.replace(job.parallel, check_collectives=False))
    graphs = build_rank_graphs(job, _OfflineWorld(rank, size))
    plans = workspace_plans(graphs, job.memory_plan)
    fp = footprint(graphs, plans, rank)
    # offline no window is allocated: the blobs a run's windows hold
    # (window_blobs) are given arrays of their own, as train's windows give them
    windowed = lambda g: {b: np.zeros(g.blobs[b].shape, g.blobs[b].dtype)  # noqa: E731
                          for b in window_blobs(g)}
    ws = planned_workspace(graphs.graph, job.memory_plan, keep=plans.keep,
                           plans=(plans.host, plans.devices), shared=windowed(graphs.graph))
    total = ws.allocated_bytes
    if graphs.test_graph is not None:
        tws = planned_workspace(graphs.test_graph, job.memory_plan, keep=plans.test_keep,
                                shared={**windowed(graphs.test_graph),
                                        **{p: ws[p] for p in shared_params(graphs)}}, arena=ws,
                                plans=(plans.test_host, plans.test_devices))
        total += tws.allocated_bytes
    return fp, total, plans


@pytest.mark.parametrize("name,size,sets", [
    ("cifar10_quick", 1, ()),
    ("cifar10_quick", 2, ()),                                   # data parallel
    ("cifar10_quick", 2, ("parallel.scheme=pipeline",
                          "parallel.stages={conv1: 0, pool1: 0, relu1: 0, conv2: 0, relu2: 0, "
                          "pool2: 0, conv3: 1, relu3: 1, pool3: 1, ip1: 1, ip2: 1, loss: 1, "
                          "accuracy: 1}")),
    ("cifar10_quick", 2, ("memory_plan=false",)),
    ("gpt_tiny", 1, ()),
    ("gpt_tiny", 2, ()),
    ("gpt_tiny", 2, ("parallel.scheme=tensor",)),
    ("nin_cifar10", 2, ()),
])
def test_footprint_is_what_the_workspaces_allocate(name, size, sets, email):
    """The estimate is the trainer's workspaces to the byte, on every rank
    of each scheme (the arena by the same plan, every other root its array)."""
    job = _job(name, email if name.startswith("gpt") else None, *sets)
    for rank in range(size):
        fp, allocated, plans = _workspaces_bytes(job, size, rank)
        kernels = fp.host["host_scratch"] + fp.host["kernel_temporaries"]
        assert fp.host_total - fp.host["windows"] - fp.host["data_pool"] - kernels \
            == allocated, \
            (name, sets, rank)
        if plans.host is not None:
            assert fp.peak["arena_bytes"] == plans.host.total_bytes
            assert 0 < fp.peak["live_bytes"] <= fp.peak["arena_bytes"]
            assert fp.peak["op"] in plans.host.order


def test_known_by_hand(tmp_path):
    """One fc layer 100 -> 10 with AdamW on 2 data-parallel ranks: weights
    (100x10 + 10) x 4 bytes, their gradients in the allreduce buckets, Adam's
    two moments twice the weights, the batch 8 x 100 floats and 8 labels."""
    cfg = {"name": "one_fc", "seed": 1,
           "data": {"train": {"source": "synthetic", "shape": [100], "classes": 10,
                              "num_samples": 64, "batch_size": 8}},
           "net": [{"type": "fc", "name": "fc", "bottom": "data", "top": "fc",
                    "num_output": 10},
                   {"type": "softmax_loss", "name": "loss", "bottom": ["fc", "label"],
                    "top": "loss"}],
           "solver": {"type": "adamw", "base_lr": 0.001, "max_iter": 2},
           "parallel": {"scheme": "data"}}
    path = tmp_path / "one_fc.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = run_cli_here("plan", path, "--np", "2", "--json")  # offline: in this process
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["fits"] is True and res["world_size"] == 2
    (kind,) = res["ranks"]   # both ranks alike
    assert kind["ranks"] == [0, 1]
    host = kind["host"]
    weights = (100 * 10 + 10) * 4
    assert host["weights"] == weights
    assert host["gradients"] == weights + 4  # + the loss's seed gradient, one float32
    assert host["optimizer_state"] == 2 * weights
    assert host["data_batch"] == 8 * 100 * 4 + 8 * 8  # float32 samples, int64 labels
    totals = ("total", "loop_total", "save_total", "checkpoint_save", "load_total",
              "startup_load")
    assert host["loop_total"] == sum(v for k, v in host.items() if k not in totals)
    assert host["checkpoint_save"] == 0  # data parallel: rank 0 writes its own arrays
    # the first fill: the 100 x 10 weight drawn in float64, then cast to float32
    assert host["startup_load"] == 100 * 10 * (8 + 4)
    assert host["total"] == host["loop_total"]
    # the host per node: both ranks on one node, their needs summed
    assert [(c["ranks"], c["need_bytes"]) for c in res["nodes"]] == [([0, 1], 2 * host["total"])]


def test_kernel_temporaries_count_the_dropout_draw(tmp_path):
    """A net whose largest host op is a Dropout (64 x 4096 units): plan's
    kernel temporaries row is that op's host Philox draw, the bool mask and
    a chunk's buffers (base/philox.keep_mask_temporaries), not the loss's
    small arrays nor fc1's SGD update (16 x 4096 weights: its scaled
    gradient, 256 KiB; with 100 inputs, 1.6 MiB, it was the largest)."""
    from purine_mpi.base.philox import keep_mask_temporaries
    from purine_mpi.ops.registry import specs_nbytes
    from purine_mpi.tools.plan import offline_footprint
    cfg = {"name": "drop_fc", "seed": 1,
           "data": {"train": {"source": "synthetic", "shape": [16], "classes": 10,
                              "num_samples": 64, "batch_size": 64}},
           "net": [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1",
                    "num_output": 4096},
                   {"type": "dropout", "name": "drop", "bottom": "fc1", "top": "fc1",
                    "ratio": 0.5},
                   {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2",
                    "num_output": 10},
                   {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"],
                    "top": "loss"}],
           "solver": {"type": "sgd", "base_lr": 0.01, "max_iter": 2}}
    path = tmp_path / "drop_fc.yaml"
    path.write_text(yaml.safe_dump(cfg))
    host = offline_footprint(load_job(str(path), [], None, check_files=False), 1, 0).host
    assert host["kernel_temporaries"] == specs_nbytes(keep_mask_temporaries((64, 4096))) \
        > 64 * 4096


def test_parse_bytes():
    assert parse_bytes("80GiB", "--x") == 80 << 30
    assert parse_bytes("10MiB", "--x") == 10 << 20
    assert parse_bytes("16GB", "--x") == 16 * 10 ** 9
    assert parse_bytes("24G", "--x") == 24 << 30
    assert parse_bytes("4096", "--x") == 4096
    for bad in ("ten", "10XB", "-1G", "0"):
        with pytest.raises(Exception, match="--x"):
            parse_bytes(bad, "--x")


def test_refused_before_launch_with_a_setting_that_fits(tmp_path):
    """train with too little host memory: exit 2 in under 5 s of the
    process's CPU time (its wall time on a loaded machine measures the load:
    6.3 s seen with 12 runnable processes on 2 cores), one line naming the
    peak op and a batch size; that batch size passes the check (and
    trains)."""
    job = os.path.join(JOBS, "cifar10_quick.yaml")
    small = ["--set", "data.train.num_samples=200"]  # a 2.3 MiB data pool, not 59 MiB
    # 20 MiB: the conv/pool kernels' host scratch alone is about 10 MiB at any
    # batch above 10 (their chunks are capped), so a smaller batch fits 20
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(PY + ["train", job, "--iters", "1", "--out", str(tmp_path / "a"),
                               "--host-memory", "20MiB"] + small,
                         capture_output=True, text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    took = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 0 needs"), out.stderr
    assert "at op '" in lines[0] and "--no-memory-check" in lines[0]
    assert "iter " not in out.stdout  # no iteration ran
    assert took < 5.0, took
    batch = int(re.search(r"--set data\.train\.batch_size=(\d+)", lines[0]).group(1))
    assert 0 < batch < 100
    ok = subprocess.run(PY + ["train", job, "--iters", "1", "--out", str(tmp_path / "b"),
                              "--host-memory", "20MiB", "--set",
                              f"data.train.batch_size={batch}"] + small,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    skip = subprocess.run(PY + ["train", job, "--iters", "1", "--out", str(tmp_path / "c"),
                                "--host-memory", "20MiB", "--no-memory-check"] + small,
                          capture_output=True, text=True, timeout=120)
    assert skip.returncode == 0, skip.stderr


def test_plan_says_it_does_not_fit():
    """plan exits 2 when a rank does not fit, and says what would."""
    out = run_cli_here("plan", os.path.join(JOBS, "cifar10_quick.yaml"), "--np", "2",
                       "--host-memory", "10MiB")
    assert out.returncode == 2
    assert "DOES NOT FIT" in out.stdout and "data.train.batch_size" in out.stdout
    bad = run_cli_here("plan", os.path.join(JOBS, "cifar10_quick.yaml"), "--host-memory", "lots")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def test_no_smaller_batch_says_what_does_not_shrink(tmp_path):
    """cifar10_quick's synthetic data pool (59.8 MiB) does not shrink with the
    batch: over 10 MiB no batch fits, and the line says what the rank still
    needs at the smaller batch tried, naming that pool, rather than blaming the
    weights, gradients and optimizer state (1.1 MiB together: they fit)."""
    out = run_cli_args("train", os.path.join(JOBS, "cifar10_quick.yaml"), "--iters", "1",
                       "--out", tmp_path / "r", "--host-memory", "10MiB")
    assert out.returncode == 2, out.stderr
    assert "alone are too many" not in out.stderr, out.stderr
    found = re.search(r"no smaller data\.train\.batch_size fits: at batch (\d+) it still "
                      r"needs ([\d.]+ [KMG]iB) \(data pool ", out.stderr)
    assert found, out.stderr
    assert 0 < int(found.group(1)) < 100
    assert parse_bytes(found.group(2).replace(" ", ""), "need") > 10 << 20


def _held_by_kind(graph):
    """Trainer-free: bytes of the storage a composed graph's blobs own, per
    model-state kind (weights: params and flat weight buffers; gradients:
    the gradient buckets and the ReduceScatter's shards of them; optimizer
    state: the solver's state blobs)."""
    owned = [b for b in graph.blobs.values() if b.alias_of is None and b.shape is not None]
    shards = {graph.storage_root(x) for op in graph.ops.values()
              if op.op_type == "ReduceScatter" for x in op.outputs}
    return {"weights": sum(b.nbytes for b in owned if b.kind in ("param", "param_buffer")),
            "gradients": sum(b.nbytes for b in owned if b.kind == "bucket" or b.name in shards),
            "optimizer_state": sum(b.nbytes for b in owned if b.kind == "state")}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("solver", ["sgd", "adamw"])
def test_plan_of_sharded_is_the_start_up_model_state(n, solver):
    """ZeRO stage 1: plan's model state of every rank is the start-up line's
    (the composed graph's own bytes: 1/N of the optimizer state), and its
    rows count each bucket's shard of the gradients in the arena, not as
    memory of its own (the scheme defers nothing), so the rank holds less
    than under data parallelism by about the state it does not keep."""
    from purine_mpi.tools.graph import compose_for
    from purine_mpi.tools.plan import MemoryLimits, run_plan
    from tests.conftest import make_job
    from tests.test_sharded import _job as sharded_job
    limits = MemoryLimits(host=1 << 40)
    plans = {}
    for scheme in ("data", "sharded"):
        job = make_job(sharded_job(scheme, solver))
        text, status = run_plan(job, n, limits, as_json=True)
        assert status == 0
        ranks = {r: entry for entry in json.loads(text)["ranks"] for r in entry["ranks"]}
        assert sorted(ranks) == list(range(n))
        plans[scheme] = (job, ranks)
    job, ranks = plans["sharded"]
    data_job, data_ranks = plans["data"]
    whole = _held_by_kind(compose_for(data_job, n, 0))
    for r in range(n):
        held = _held_by_kind(compose_for(job, n, r))
        entry, plain = ranks[r], data_ranks[r]
        assert {k: entry["model_state"][k] for k in held} == held, r
        assert entry["model_state"]["held"] == sum(held.values())
        assert held["weights"] == whole["weights"]
        assert whole["optimizer_state"] / n - 64 <= held["optimizer_state"] <= \
            whole["optimizer_state"] / n + 64
        assert entry["host"]["weights"] == held["weights"]
        assert entry["host"]["optimizer_state"] == held["optimizer_state"]
        # the shards are transient: the gradients row is the buckets, as data's
        assert entry["host"]["gradients"] == plain["host"]["gradients"], r
        saved = whole["optimizer_state"] - held["optimizer_state"]
        assert entry["host"]["total"] <= plain["host"]["total"] - saved // 2, r


def test_plan_of_a_pipeline_is_train_s_check_to_the_byte(digits_h5, tmp_path):
    """plan's figure for each rank is the one train's start-up check
    compares: train passes at plan's need and refuses one byte below it.
    Before, plan's offline build kept the blobs a pipeline's peers put into
    one-sided windows (pool1, label, lr, pool1.grad) in the arena too, and
    counted only the window words of its own regions: it said rank 0 needs
    2,252,828 bytes where train counts 2,125,304 (a limit in between: plan
    'DOES NOT FIT', train ran).

    The run that starts prints rank 0's figure in its start-up block
    (``planned``: the total, the MPI transport buffers row) and writes each
    rank's rows to memory.json (``planned``): every row is plan's, the MPI
    transport buffers too (before, the start-up block had no planned
    figure and memory.json only the model state: a user saw plan's total
    nowhere in the run's log)."""
    from tests.conftest import run_mpi_cli
    sets = ["--set", f"data.train.path={digits_h5}", "--set", f"data.test.path={digits_h5}"]
    cfg = os.path.join(JOBS, "digits_pipeline.yaml")
    out = run_cli_here("plan", cfg, "--np", "2", "--json", *sets)  # both ranks on this node
    assert out.returncode == 0, out.stderr
    planned = {r: k["host"] for k in json.loads(out.stdout)["ranks"] for r in k["ranks"]}
    assert sorted(planned) == [0, 1] and planned[0]["mpi_transport"] > 0, planned
    need = max(h["total"] for h in planned.values())
    runs = {}
    for limit, status in ((need, 0), (need - 1, 2)):
        runs[limit] = res = run_mpi_cli(2, "train", cfg, "--iters", "1", "--out",
                                        str(tmp_path / str(limit)), "--host-memory", str(limit),
                                        *sets)
        assert res.returncode == status, (limit, need, res.stderr[-600:])
    measured = json.load(open(tmp_path / str(need) / "memory.json"))["ranks"]
    assert {m["rank"]: m["planned"] for m in measured} == planned
    row = next(line for line in runs[need].stdout.splitlines() if line.startswith("  planned "))
    assert f"{human_bytes(planned[0]['total'])} of host memory on rank 0 " \
        f"({planned[0]['total']:,} bytes: " in row, row
    assert f"MPI transport buffers {human_bytes(planned[0]['mpi_transport'])}" in row, row



@pytest.mark.mpi
def test_windows_row_is_every_window_the_rank_allocates(digits_h5):
    """A pipeline's test graph has one-sided windows of its own (its stage
    transfers: pool1 and the labels into rank 1's memory), allocated at
    start-up beside the training graph's and held to the end. The windows
    row is this rank's segments of both, as MPI allocated them (2 ranks,
    the rank graphs train builds; tests/mpi_scripts/plan_windows.py).
    Before, the test graph's composition was dropped and its windowed blobs
    are out of the test arena, so they were in no row: rank 1 planned
    33,344 bytes where it holds 95,424 (gpt_tiny's tppp, 2 stages x 2
    shards: 4.1 MiB a stage-1 rank, resident in /proc/self/smaps)."""
    from tests.mpi_scripts.launch import run_mpi
    proc, _ = run_mpi("plan_windows.py", 2, os.path.join(JOBS, "digits_pipeline.yaml"),
                      f"data.train.path={digits_h5}", f"data.test.path={digits_h5}",
                      timeout=120)
    assert proc.stdout.count("OK plan_windows") == 2, proc.stdout + proc.stderr

def _digits_ps(digits_h5, tmp_path, mode, wide=False):
    """digits_lenet as a parameter-server job (async with max_staleness 1:
    0 runs as sync_ps), written to a file (``wide``: fc1 4096 wide, 2 MiB of
    weights, so that the server needs more than a worker)."""
    cfg = yaml.safe_load(open(os.path.join(JOBS, "digits_lenet.yaml")))
    cfg["data"]["train"]["path"] = cfg["data"]["test"]["path"] = digits_h5
    cfg["parallel"] = {"scheme": "data", "mode": mode, "ps_ranks": 1, "max_staleness": 1}
    if wide:
        cfg["net"] = [dict(layer, num_output=4096) if layer["name"] == "fc1" else layer
                      for layer in cfg["net"]]
    path = tmp_path / f"digits_{mode}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.parametrize("mode", ["sync_ps", "async"])
def test_parameter_server_ranks_are_what_they_allocate(mode, digits_h5, tmp_path):
    """plan --np 3 of a parameter-server job (it refused with exit 2, and
    before that died in a traceback and, patched, said 2.0 MiB fits where
    train needs 3.9 MiB): a row per rank, each worker's workspaces to the
    byte (as train's WorkerScheme builds them over the workers' world), a
    sync_ps server's workspace (its server graph) to the byte; the server
    holds the weights, their momenta and a receive buffer per worker
    (async: and a reply's snapshot per worker), rank 0's save the servers'
    momenta (async: and weights); an async server's save holds its loop's
    buffers only when rank 0 asks for its state mid-run (a test pass or a
    checkpoint before the last iteration: planned at every save before, 8x
    the weights where 6x were measured, tests/test_plan_rss.py)."""
    from purine_mpi.runtime.workspace import Workspace
    from purine_mpi.tools.plan import _offline_graphs, offline_footprints
    job = _job("digits_lenet", None, f"data.train.path={digits_h5}",
               f"data.test.path={digits_h5}", f"parallel.mode={mode}",
               "parallel.max_staleness=1", "parallel.ps_ranks=1",
               "parallel.transport=two_sided")
    fps, _ = offline_footprints(job, 3, [0, 1, 2])
    from purine_mpi.job.replica import build_train_graph
    graph, _ = build_train_graph(job, 0, 2)
    weights = sum(b.nbytes for b in graph.params())
    for rank in (0, 1):
        graphs = _offline_graphs(job, 3, rank)
        fp = fps[rank]
        plans = workspace_plans(graphs, job.memory_plan)
        ws = planned_workspace(graphs.graph, job.memory_plan, keep=plans.keep,
                               plans=(plans.host, plans.devices))
        tws = planned_workspace(graphs.test_graph, job.memory_plan, keep=plans.test_keep,
                                shared={p: ws[p] for p in shared_params(graphs)}, arena=ws,
                                plans=(plans.test_host, plans.test_devices))
        held = weights if mode == "async" and rank == 0 else 0  # the last sync's momenta
        h = fp.host
        assert fp.loop_total - h["data_pool"] - h["host_scratch"] - h["kernel_temporaries"] \
            - held == ws.allocated_bytes + tws.allocated_bytes, (mode, rank)
        assert h["weights"] == weights and not h.get("optimizer_state")
    server = fps[2].host
    assert server["weights"] == server["optimizer_state"] == weights
    assert fps[2].save == 2 * weights  # send_state's pickle, the end's copies
    if mode == "sync_ps":
        sg = _offline_graphs(job, 3, 2).server_graph
        assert fps[2].loop_total - server["kernel_temporaries"] == \
            Workspace(sg).allocated_bytes
        assert server["gradients"] == 3 * weights  # a receive buffer per worker, their sum
        assert fps[0].save == 2 * weights  # the momenta's message, then its arrays
        assert fps[1].save == 0
    else:
        assert server["comm_buffers"] == 4 * weights  # 2 workers: gradients, replies
        assert fps[0].save == 5 * weights  # the weights received, sent on, the copies
        assert fps[1].save == 3 * weights  # the allgather's buffer, bytes, arrays
        # a state rank 0 asks for mid-run (digits_lenet: a test pass and a
        # checkpoint every 300 iterations of 900) is sent beside the loop's
        # receive and reply buffers; without one, the end's once serve()
        # returned and they are freed (planned beside them before)
        from purine_mpi.tools.graph import _OfflineWorld
        from purine_mpi.train.ps_server import ServerRank, state_asked
        assert state_asked(job) and fps[2].save_total == \
            fps[2].loop_total - server["kernel_temporaries"] + 2 * weights
        for sets in (["checkpoint.interval=0", "solver.test_interval=0"],
                     ["checkpoint.interval=900", "solver.test_interval=900"]):
            end = _job("digits_lenet", None, f"data.train.path={digits_h5}",
                       f"data.test.path={digits_h5}", "parallel.mode=async",
                       "parallel.max_staleness=1", "parallel.ps_ranks=1",
                       "parallel.transport=two_sided", *sets)
            assert not state_asked(end)
            fp = ServerRank(end, _OfflineWorld(2, 3)).footprint()
            assert fp.host == server and fp.save_total == 4 * weights


@pytest.mark.parametrize("mode,biggest", [("sync_ps", 2), ("async", 0)])
def test_plan_of_a_parameter_server_mode_is_train_s_check_to_the_byte(mode, biggest, digits_h5,
                                                                     tmp_path):
    """plan's figure of the rank that needs the most (sync_ps: the server,
    with a 4096-wide fc1; async: rank 0, whose saves take the servers'
    state and send the weights on) is what train's start-up check compares:
    train starts at it and refuses one byte below, naming that rank (a
    server's check is new: it had none); the node's check, the three ranks'
    needs summed, passes at plan's sum and refuses one byte below; the run
    that starts writes each rank's planned rows, the server's too, to
    memory.json: plan's, the MPI transport buffers included."""
    from tests.conftest import run_mpi_cli
    cfg = _digits_ps(digits_h5, tmp_path, mode, wide=True)
    out = run_cli_here("plan", cfg, "--np", "3", "--json")  # offline: in this process
    assert out.returncode == 0, out.stderr
    planned = {r: k["host"] for k in json.loads(out.stdout)["ranks"] for r in k["ranks"]}
    need = {r: h["total"] for r, h in planned.items()}
    assert sorted(need) == [0, 1, 2] and max(need, key=need.get) == biggest, need
    # the node's check (servers and workers in one allgather) at plan's sum
    node = sum(need.values())
    for limit, status in ((need[biggest], 0), (need[biggest] - 1, 2)):
        res = run_mpi_cli(3, "train", cfg, "--iters", "2", "--out", str(tmp_path / str(limit)),
                          "--host-memory", str(limit), "--node-memory", str(node))
        assert res.returncode == status, (limit, need, res.stderr[-600:])
        if status:
            assert f"rank {biggest} needs {human_bytes(need[biggest])}" in res.stderr, \
                res.stderr[-600:]
        else:
            measured = json.load(open(tmp_path / str(limit) / "memory.json"))["ranks"]
            assert {m["rank"]: m["planned"] for m in measured} == planned
    res = run_mpi_cli(3, "train", cfg, "--iters", "2", "--out", str(tmp_path / "node"),
                      "--node-memory", str(node - 1))
    assert res.returncode == 2 and f"its ranks 0-2 need {human_bytes(node)}" in res.stderr, \
        res.stderr[-600:]


def test_ranks_share_their_node_s_memory(monkeypatch):
    """Without --host-memory the ranks of a node, K at a time in rank
    order, are checked together against its MemAvailable, K:
    --ranks-per-node, else the launcher's count of the ranks on this node
    (SLURM_NTASKS_PER_NODE in an allocation), else all N (one node). A
    4-rank job on 2 nodes of 2 fits a node with 2.5 ranks' bytes."""
    from purine_mpi.base.threads import LOCAL_SIZE_VARS
    from purine_mpi.tools import plan
    for var in LOCAL_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    job = _job("cifar10_quick")
    need = plan.offline_footprint(job, 4, 0).host_total
    monkeypatch.setattr(plan, "mem_available", lambda: 5 * need // 2)

    def host(**limits):
        out, code = plan.run_plan(job, 4, plan.MemoryLimits(**limits), as_json=True)
        nodes = json.loads(out)["nodes"]
        return code, [(c["ranks"], c["need_bytes"], c["limit_bytes"]) for c in nodes], \
            nodes[0]["limit_from"] if nodes else None
    mem = 5 * need // 2
    # each rank's MPI transport buffers: its node's other ranks' cells
    from purine_mpi.comm.mpi_transport import transport_bytes
    on = {k: need + transport_bytes(k) for k in (1, 2, 3, 4)}
    assert host() == (2, [([0, 1, 2, 3], 4 * on[4], mem)],
                      "MemAvailable, all 4 ranks on one node")
    assert host(ranks_per_node=2) == (0, [([0, 1], 2 * on[2], mem), ([2, 3], 2 * on[2], mem)],
                                      "MemAvailable, 2 ranks a node, from --ranks-per-node")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    assert host()[0] == 0 and host()[2] == ("MemAvailable, 2 ranks a node, from "
                                            "SLURM_NTASKS_PER_NODE")
    assert host(ranks_per_node=3)[:2] == (2, [([0, 1, 2], 3 * on[3], mem), ([3], on[1], mem)])
    assert host(ranks_per_node=8)[:2] == (2, [([0, 1, 2, 3], 4 * on[4], mem)])  # at most N
    # --host-memory: per rank, as given (no node figure without --node-memory)
    out, code = plan.run_plan(job, 4, plan.MemoryLimits(host=need - 1), as_json=True)
    assert code == 2 and json.loads(out)["ranks"][0]["fits"]["host"]["limit_bytes"] == need - 1
    bad = run_cli_here("plan", os.path.join(JOBS, "cifar10_quick.yaml"), "--np", "4",
                       "--ranks-per-node", "0")
    assert bad.returncode == 2 and "--ranks-per-node 0" in bad.stderr


def _lopsided_pipeline(tmp_path):
    """A 2-stage pipeline whose stage 0 holds a 256 x 4096 fc (4.2 MB of
    weights, their gradient and momentum) and stage 1 a 4096 x 10 one."""
    cfg = {"name": "lopsided", "seed": 1,
           "data": {"train": {"source": "synthetic", "shape": [256], "classes": 10,
                              "num_samples": 64, "batch_size": 8}},
           "net": [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1",
                    "num_output": 4096},
                   {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2",
                    "num_output": 10},
                   {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"],
                    "top": "loss"}],
           "solver": {"base_lr": 0.01, "momentum": 0.9, "max_iter": 2},
           "parallel": {"scheme": "pipeline", "stages": {"fc1": 0, "fc2": 1, "loss": 1}}}
    path = tmp_path / "lopsided.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_the_host_is_checked_per_node(tmp_path, monkeypatch):
    """The ranks of a node are checked together: their host needs summed
    against the node's MemAvailable (or --node-memory), the ranks placed in
    blocks of K. A 2-stage pipeline whose stage 0 holds 100 times stage 1's
    weights, on one node with memory for the two stages' sum, fits (before:
    each rank was checked against MemAvailable / 2, and stage 0's need is
    more than half the sum: 'DOES NOT FIT', exit 2); one byte less is
    refused naming node 0, its ranks 0-1 and the sum; with --ranks-per-node
    1 each stage is its own node."""
    from purine_mpi.base.threads import LOCAL_SIZE_VARS
    from purine_mpi.tools import plan
    for var in LOCAL_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    job = load_job(_lopsided_pipeline(tmp_path), (), None, check_files=False)
    fps, _ = plan.offline_footprints(job, 2, [0, 1])
    # closed form: stage 0's fc1 weights and bias, stage 1's fc2
    assert fps[0].host["weights"] == (256 * 4096 + 4096) * 4
    assert fps[1].host["weights"] == (4096 * 10 + 10) * 4
    plan.set_transports(fps, 2, None)  # both ranks on one node: each reads the other's cells
    alone = plan.transport_bytes(2)  # the cells a rank on a node of its own does not read
    need = {r: fps[r].host_total for r in (0, 1)}
    total = need[0] + need[1]
    assert need[0] > total // 2 + need[1]  # lopsided: stage 0 is most of the node's need

    def node(mem, **limits):
        monkeypatch.setattr(plan, "mem_available", lambda: mem)
        out, code = plan.run_plan(job, 2, plan.MemoryLimits(**limits), as_json=True)
        res = json.loads(out)
        return code, [(c["ranks"], c["need_bytes"], c["limit_bytes"]) for c in res["nodes"]]
    assert node(total) == (0, [([0, 1], total, total)])
    assert node(total - 1) == (2, [([0, 1], total, total - 1)])
    need = {r: need[r] - alone for r in need}
    assert node(need[0], ranks_per_node=1) == (0, [([0], need[0], need[0]),
                                                   ([1], need[1], need[0])])
    assert node(need[0] - 1, ranks_per_node=1)[0] == 2
    # --node-memory: the node's, whatever MemAvailable says; --host-memory: each rank's
    assert node(1, node=total)[0] == 0 and node(10 * total, node=total - 1)[0] == 2
    assert node(1, host=need[0] + alone) == (0, [])
    text, code = plan.run_plan(job, 2, plan.MemoryLimits(node=total - 1))
    assert code == 2 and f"node 0 (ranks 0-1): host: DOES NOT FIT: {human_bytes(total)}" in text


def test_train_refuses_a_node_whose_ranks_outgrow_it(tmp_path):
    """train's start-up check sums the host needs of the ranks on a node
    (its world's host table) and compares the same figure on every rank:
    --node-memory at plan's sum starts, one byte below exits 2 naming the
    node, its ranks and the sum (before: no per-node check, --node-memory
    unknown: exit 2 from the argument parser either way)."""
    from tests.conftest import run_mpi_cli
    from purine_mpi.tools.plan import offline_footprints, set_transports
    cfg = _lopsided_pipeline(tmp_path)
    job = load_job(cfg, (), None, check_files=False)
    fps, _ = offline_footprints(job, 2, [0, 1])
    set_transports(fps, 2, None)
    total = fps[0].host_total + fps[1].host_total
    for limit, status in ((total, 0), (total - 1, 2)):
        res = run_mpi_cli(2, "train", cfg, "--iters", "1", "--out", str(tmp_path / str(limit)),
                          "--node-memory", str(limit))
        assert res.returncode == status, (limit, total, res.stderr[-600:])
        if status:
            assert f"its ranks 0-1 need {human_bytes(total)} of host memory together" in \
                res.stderr and "node 0 (" in res.stderr, res.stderr[-600:]


def test_the_batch_advice_counts_the_mpi_transport_row():
    """--np 2: the footprints the advice builds at other batches lacked the
    rank's MPI transport buffers row (another rank's shared-memory cells),
    which the footprint checked has: the batch said to fit needed up to
    that row more than the limit (a limit 256 KiB under the need at batch
    94: "batch_size 93 would fit", whose ``plan --json`` said fits: false),
    and "at batch 50 it still needs" was that row short of ``plan --json``
    at batch 50."""
    cfg = os.path.join(JOBS, "cifar10_quick.yaml")

    def total(batch, *more):
        out = run_cli_here("plan", cfg, "--np", "2", "--json",
                           "--set", f"data.train.batch_size={batch}", *more)
        (rank,) = json.loads(out.stdout)["ranks"]
        assert rank["host"]["mpi_transport"] > 0, rank  # the row this is about
        return rank["host"]["total"], json.loads(out.stdout)["fits"]
    limit = total(94)[0] - (256 << 10)
    out = run_cli_here("plan", cfg, "--np", "2", "--host-memory", f"{limit}B")
    assert out.returncode == 2, out.stdout + out.stderr
    batch = int(re.search(r"data\.train\.batch_size (\d+) would fit", out.stdout).group(1))
    assert total(batch, "--host-memory", f"{limit}B") == (total(batch)[0], True), batch
    small = run_cli_here("plan", cfg, "--np", "2", "--host-memory", "10MiB")
    said = re.search(r"at batch (\d+) it still needs ([\d.]+ [KMG]iB)", small.stdout)
    assert said, small.stdout
    assert said.group(2) == human_bytes(total(int(said.group(1)))[0]), small.stdout


def test_the_batch_advice_never_passes_over_the_smaller_batch_that_fits(monkeypatch):
    """fitting_batch builds batch 50 first (half of 100); where it fits but
    the bytes jump above it (a step the straight line through 50 and 100
    does not see: 1 byte a sample plus 100, 1000 past 50), the tries from
    the line's guess (53: too many) went on down to 39, "the largest" that
    fits, where 50 does; and where the three tries stay above 50 (a limit
    the line puts at 96: 96, 72, 54), None: "no smaller
    data.train.batch_size fits: at batch 50 it still needs" fewer bytes than
    the limit. Now 50 both times."""
    import types
    from purine_mpi.job.config import load_config
    from purine_mpi.tools import plan
    from tests.conftest import make_job
    job = make_job(load_config(os.path.join(JOBS, "cifar10_quick.yaml"), check_files=False))
    assert job.train_batch == 100 and job.parallel.micro_batches == 1
    built = []

    def fake(job, *args):
        b = job.train_batch
        built.append(b)
        return types.SimpleNamespace(host={}, host_total=b + 100 if b <= 50 else 1000)
    monkeypatch.setattr(plan, "offline_footprint", fake)
    assert plan.fitting_batch(job, 1, 0, -1, 160, 300) == 50 and built == [50, 53]
    built.clear()
    assert plan.fitting_batch(job, 1, 0, -1, 290, 300) == 50 and built == [50, 96, 72, 54]
    built.clear()  # 50 too many: the line's guess below it, built and taken
    assert plan.fitting_batch(job, 1, 0, -1, 149, 300) == 49 and built == [50, 49]
