"""What the tools report of the sharded scheme (issue 43): ``bench
--json``'s model-state bytes and collective bytes, ``graph --np N``'s gather
and free points, and ``benchmarks/sharded.py`` run tiny (data against
sharded at each accepted ``parallel.shard``, the parameters after AdamW
steps compared). The predictor's cost of the collectives is in
test_scaling.py."""
import json
import os
import re
import subprocess
import sys

import pytest

from purine_mpi.comm.ops import shard_range
from purine_mpi.runtime.factory import memory_plans
from purine_mpi.runtime.footprint import MODEL_STATE_ROWS, model_state_bytes, model_state_peak
from purine_mpi.runtime.memory_plan import batch_blobs
from purine_mpi.tools.graph import compose_for
from tests.conftest import MPIEXEC, REPO, cli_env, make_job, run_cli_here, run_mpi_cli, \
    write_config_file
from tests.test_sharded import _job

sys.path.insert(0, os.path.join(REPO, "benchmarks"))


def _bench(tmp_path, cfg, name):
    path = write_config_file(tmp_path, cfg, f"{name}.yaml")
    res = run_mpi_cli(2, "bench", path, "--iters", "2", "--warmup", "1", "--json", timeout=300)
    assert res.returncode == 0, res.stderr
    text = run_mpi_cli(2, "bench", path, "--iters", "1", "--warmup", "1", timeout=300)
    assert text.returncode == 0, text.stderr
    return json.loads(res.stdout.strip().splitlines()[-1]), text.stdout


@pytest.mark.mpi
def test_bench_reports_model_state_and_collective_bytes(tmp_path):
    """Held bytes are the graph's (runtime/footprint.model_state_bytes of
    the rank's composed graph); sharded holds half of data parallelism's
    AdamW state on 2 ranks (even buckets here, or one element more) and
    reduce-scatters and allgathers the bytes data parallelism allreduces."""
    data, _ = _bench(tmp_path, _job("data"), "data")
    shard, text = _bench(tmp_path, _job("sharded"), "sharded")
    for res, scheme in ((data, "data"), (shard, "sharded")):
        want = model_state_bytes(compose_for(make_job(_job(scheme)), 2, 0))
        want = {k: want[k] for k in MODEL_STATE_ROWS}
        held, peak = res["model_state_bytes"], res["model_state_peak_bytes"]
        assert {k: held[k] for k in MODEL_STATE_ROWS} == want, scheme
        assert held["total"] == sum(want.values())
        assert 0 < peak["total"] <= held["total"]
        assert peak["total"] == sum(peak[k] for k in MODEL_STATE_ROWS)
        assert res["model_state_bytes_per_rank"]["held"][0] == held["total"]
        assert res["model_state_bytes_per_rank"]["peak"][0] == peak["total"]
        assert len(res["max_rss_bytes_per_rank"]) == 2
        assert res["max_rss_bytes_per_rank"][0] == res["max_rss_bytes"]
    grads = data["bytes_allreduced_per_iter"]
    assert grads == data["model_state_bytes"]["weights"] > 0
    assert data["bytes_reduce_scattered_per_iter"] == data["bytes_allgathered_per_iter"] == 0
    assert shard["bytes_reduce_scattered_per_iter"] == shard["bytes_allgathered_per_iter"] == grads
    assert shard["bytes_allreduced_per_iter"] == 0
    assert shard["bytes_two_sided_per_iter"] == 2 * grads
    state = data["model_state_bytes"]["optimizer_state"]
    assert state / 2 <= shard["model_state_bytes"]["optimizer_state"] < state / 2 + 64
    for row in ("weights", "gradients"):  # stage 1's gradient shard: the bucket's range
        assert shard["model_state_bytes"][row] == data["model_state_bytes"][row], row
    assert re.search(r"model state +weights .* held \(rank 0\)", text), text
    assert re.search(r"collectives +[\d.,]+ \w+ reduce-scattered, [\d.,]+ \w+ allgathered", text)



def test_max_rss_is_one_reading_of_the_peak(monkeypatch):
    """``max_rss_bytes`` is this rank's entry of ``max_rss_bytes_per_rank``,
    not a second reading: the peak grows between two readings (seen once
    under load: 66,723,840 against 66,916,352 bytes on rank 0)."""
    from purine_mpi.tools import bench
    readings = iter(range(1000, 10 ** 6, 1000))  # a peak that grows at every reading
    monkeypatch.setattr(bench, "peak_rss_bytes", lambda: next(readings))
    res = bench.run_bench(make_job(_job("data")), iters=1, warmup=0)
    assert res["max_rss_bytes"] == res["max_rss_bytes_per_rank"][0] > 0

def test_model_state_peak_follows_the_memory_plan():
    """No plan: the peak is every model-state root, whole (the held bytes).
    With the trainer's plan: roots in the arena count only while live, so
    the peak lies between the roots of their own and the held bytes."""
    g = compose_for(make_job(_job("sharded")), 2, 0)
    held = model_state_bytes(g)
    held = {k: held[k] for k in MODEL_STATE_ROWS}
    bare = model_state_peak(g, [None])
    assert {k: bare[k] for k in MODEL_STATE_ROWS} == held and bare["op"] is None
    host, devices = memory_plans(g.copy(), keep=batch_blobs(g))
    peak = model_state_peak(g, [host, *devices.values()])
    assert peak["total"] <= sum(held.values())
    assert peak["weights"] == held["weights"]  # the flat weight buffers have memory of their own
    assert peak["op"] is None or peak["op"] in host.order


def test_graph_np_shows_the_gather_and_free_points(tmp_path):
    cfg = _job("sharded")
    path = write_config_file(tmp_path, cfg, "s.yaml")
    res = run_cli_here("graph", path, "--np", "2", "--rank", "1")
    assert res.returncode == 0, res.stderr
    g = compose_for(make_job(cfg), 2, 1)
    scatters = [op for op in g.ops.values() if op.op_type == "ReduceScatter"]
    gathers = [op for op in g.ops.values() if op.op_type == "Allgather"]
    assert scatters and len(scatters) == len(gathers)
    out = res.stdout
    assert "sharded buckets (rank 1's shard of 2" in out
    for op in scatters + gathers:
        n = sum(g.blobs[b].size for b in (op.outputs if op.op_type == "Allgather"
                                          else op.inputs))
        lo, hi = shard_range(n, 2, 1)
        assert f"  {op.attrs['bucket']}: " in out and f"shard [{lo}:{hi}) of {n:,}" in out
        verb = "gathered" if op.op_type == "Allgather" else "reduce-scattered"
        line = next(x for x in out.splitlines() if f"{verb} by {op.name} " in x)
        # a gather posts after the last shard update that writes its inputs
        writers = [w.name for w in g.ops.values() if set(w.outputs) & set(op.inputs)]
        assert any(f"after {w};" in line for w in writers), line
        assert "held between iterations (own memory)" in line, line
    off = run_cli_here("graph", path, "--np", "2", "--set", "memory_plan=false")
    assert off.returncode == 0 and "held between iterations (memory_plan: false)" in off.stdout
    plain = run_cli_here("graph", write_config_file(tmp_path, _job("data"), "d.yaml"),
                         "--np", "2")
    assert plain.returncode == 0 and "sharded buckets" not in plain.stdout


def test_the_benchmark_reads_the_accepted_shard_values_from_the_config():
    import sharded
    cifar = os.path.join(REPO, "jobs", "cifar10_quick.yaml")
    values = sharded.shard_values(cifar)
    assert 1 in values and values == sorted(values)
    for k in range(0, values[-1] + 2):
        ok = sharded._loads(cifar, ["parallel.scheme=sharded", f"parallel.shard={k}"])
        assert ok == (k in values), k
    assert list(sharded.settings_of(cifar)) == ["data"] + [f"sharded_shard{k}" for k in values]


@pytest.mark.parametrize("solver,want", [("adamw", ["solver.type=adamw"]),
                                         ("sgd", ["solver.type=sgd", "solver.momentum=0.9"])])
def test_the_check_trains_the_solver_asked(monkeypatch, tmp_path, solver, want):
    """``--check-solver``: the parameter check's runs train with that
    solver's settings (SGD with momentum: issue 43's 2e-6 tolerance), after
    the config's shortening, and the check names the solver."""
    import numpy as np
    import sharded
    from purine_mpi.job import checkpoint_file
    runs = []
    monkeypatch.setattr(sharded, "run", lambda ranks, args, what: runs.append(args))
    monkeypatch.setattr(checkpoint_file, "load_params",
                        lambda path: {"w": np.arange(3.0) * (1 + len(runs)), "solver/m": 0})
    got = sharded.trained_params("c.yaml", ["parallel.scheme=data"], 2, 7, str(tmp_path),
                                 solver)
    assert list(got) == ["w"]
    sets = [runs[0][i + 1] for i, a in enumerate(runs[0]) if a == "--set"]
    assert sets[:len(want)] == want and "solver.max_iter=7" in sets
    assert sets[-1] == "parallel.scheme=data"  # the setting's own keys come last
    monkeypatch.setattr(sharded, "bench_once", lambda *a: {
        "images_per_s": 1.0, "batch_per_rank": 1, "iter_ms_median": 1.0,
        "model_state_bytes": {}, "model_state_peak_bytes": {},
        "model_state_bytes_per_rank": [], "max_rss_bytes_per_rank": [1],
        "comm_in_flight_ms_per_iter": 0.0, "comm_exposed_ms_per_iter": 0.0,
        "comm_overlap": None, "bytes_reduce_scattered_per_iter": 0,
        "bytes_allgathered_per_iter": 0, "bytes_allreduced_per_iter": 0})
    monkeypatch.setattr(sharded, "settings_of", lambda config, sets: {
        "data": ["parallel.scheme=data"], "sharded_shard1": ["parallel.shard=1"]})
    monkeypatch.setattr(sharded, "base_sets", lambda config, extra, folder: [])
    args = sharded.argparse.Namespace(sets=[], ranks=2, pairs=1, iters=1, warmup=1,
                                      check_steps=7, check_solver=solver)
    check = sharded.bench_config("c.yaml", args, str(tmp_path))["settings"][
        "sharded_shard1"]["check"]
    assert check["solver"] == solver and check[f"{solver}_steps"] == 7
    # data's run gave 3 * [0, 1, 2], the sharded one's 4 * [0, 1, 2]: 2 / 6
    assert check["max_rel_diff"] == pytest.approx(1 / 3) and check["worst_param"] == "w"


def test_the_benchmark_reports_which_reduction_it_ran():
    """``--set parallel.reduce_scatter=false`` reaches every run's config
    (``--set`` goes to each setting) and the JSON's ``reduce_scatter`` says
    so, as YAML reads the value; the last ``--set`` of the key wins."""
    import sharded
    assert sharded.reduce_scatter_of([]) is True
    assert sharded.reduce_scatter_of(["parallel.reduce_scatter=false"]) is False
    assert sharded.reduce_scatter_of(["parallel.reduce_scatter=False", "x=1"]) is False
    assert sharded.reduce_scatter_of(["parallel.reduce_scatter=false",
                                      "parallel.reduce_scatter=true"]) is True
    cifar = os.path.join(REPO, "jobs", "cifar10_quick.yaml")
    assert sharded._loads(cifar, ["parallel.reduce_scatter=false", "parallel.scheme=sharded"])
    # stage 3 over one-sided windows takes reduce_scatter false (the windows
    # carry its weights, never the gradient sums); stage 1 without pipeline
    # stages takes no one-sided transport at all
    assert sharded._loads(cifar, ["parallel.reduce_scatter=false", "parallel.scheme=sharded",
                                  "parallel.shard=3", "parallel.transport=one_sided"])
    assert not sharded._loads(cifar, ["parallel.reduce_scatter=false", "parallel.scheme=sharded",
                                      "parallel.shard=1", "parallel.transport=one_sided"])


@pytest.mark.mpi
def test_the_sharded_benchmark_runs_tiny(tmp_path):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    res = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "sharded.py"),
                          "--configs", "jobs/cifar10_quick.yaml", "--pairs", "1", "--iters", "1",
                          "--warmup", "1", "--check-steps", "2",
                          "--set", "data.train.batch_size=4"],
                         cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])["configs"]["jobs/cifar10_quick.yaml"]
    import sharded
    settings = out["settings"]
    assert list(settings) == list(sharded.settings_of("jobs/cifar10_quick.yaml"))
    data = settings["data"]
    for name, s in settings.items():
        assert s["images_per_s"] > 0 and len(s["max_rss_mib_per_rank"]) == 2
        assert all(30 < m < 4096 for m in s["max_rss_mib_per_rank"]), s
        assert 0 <= s["comm_hidden_ms_per_iter"] <= s["comm_in_flight_ms_per_iter"] + 1e-3
        held = s["model_state_bytes"]
        assert s["model_state_peak_bytes"]["total"] <= held["total"] + held["working"]
        if name == "data":
            continue
        assert s["ratio_to_data"] == pytest.approx(s["images_per_s"] / data["images_per_s"],
                                                   rel=1e-3)
        assert s["bytes_reduce_scattered_per_iter"] == data["bytes_allreduced_per_iter"]
        # 2 ranks: the reduce-scatter's sums are the allreduce's (a + b): bitwise
        assert s["check"]["max_rel_diff"] == 0.0 and s["check"]["params"] == 10
        assert s["check"]["solver"] == "adamw" and s["check"]["adamw_steps"] == 2
