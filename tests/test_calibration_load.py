"""``plan --choose``'s calibration read as CPU time (tools/choose.py
``_traced_run``: ``scaling/trace_reader.read_traces(cpu=True)``).

A traced op records its thread's CPU time (``args.cpu_us``, runtime/
executors.py). On a machine shared with other processes an op's wall time
is its CPU time stretched by the time its thread waited for a core; the one
trace of the calibration then priced every setting at the load of the
moment it ran. By construction, a run slowed uniformly by other processes
(every op, gap and iteration three times as long, the ops' CPU time the
same) must calibrate to the same op times and predict the same settings
as the run alone; read as wall time it predicts each about three times as
slow."""
import json

import pytest

from tests.conftest import REPO, PYTHON, cli_env, run_cli_args, write_config_file

NET = """name: load_net
seed: 3
data:
  train: {source: synthetic, shape: [1, 8, 8], classes: 10, num_samples: 256, batch_size: 16}
net:
  - {type: fc, name: fc1, bottom: data, top: fc1, num_output: 256}
  - {type: relu, name: relu1, bottom: fc1, top: fc1}
  - {type: fc, name: fc2, bottom: fc1, top: fc2, num_output: 256}
  - {type: relu, name: relu2, bottom: fc2, top: fc2}
  - {type: fc, name: fc3, bottom: fc2, top: fc3, num_output: 10}
  - {type: softmax_loss, name: loss, bottom: [fc3, label], top: loss}
solver: {type: sgd, base_lr: 0.01, momentum: 0.9, max_iter: 100, display: 1}
"""

#: how much longer than alone every op, gap and iteration of the "loaded" copy takes
LOAD = 3.0


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """(the job file, the run folder of one rank traced at one thread)."""
    folder = tmp_path_factory.mktemp("load")
    cfg = write_config_file(folder, NET)
    run = folder / "run"
    res = run_cli_args("train", cfg, "--out", run, "--iters", 8, "--profile-iters", "3:8")
    assert res.returncode == 0, res.stderr
    return cfg, run


def _events(run):
    with open(run / "trace.rank0.json") as f:
        return json.load(f)["traceEvents"]


def _copy(run, dest, events):
    dest.mkdir()
    (dest / "config.yaml").write_text((run / "config.yaml").read_text())
    (dest / "trace.rank0.json").write_text(json.dumps({"traceEvents": events}))
    return dest


def test_a_traced_host_op_records_its_threads_cpu_time(traced, tmp_path):
    """Every host op of a run at one thread carries ``cpu_us`` (at most its
    wall time, with the clocks' rounding); a run whose host products use a
    pool of threads records none (the calling thread's CPU time would be a
    part of the op's), and the reader then keeps the wall times."""
    from purine_mpi.tools.scaling.trace_reader import load_factor, read_traces
    _, run = traced
    ops = [e for e in _events(run) if e.get("ph") == "X"]
    assert ops and all("cpu_us" in e["args"] for e in ops)
    assert all(0 <= e["args"]["cpu_us"] <= e["dur"] + 50 for e in ops)
    assert load_factor(ops) >= 1.0
    env = dict(cli_env(), OMP_NUM_THREADS="2")
    cfg = traced[0]
    pooled = tmp_path / "pooled"
    import subprocess
    res = subprocess.run([PYTHON, "-m", "purine_mpi", "train", str(cfg), "--out", str(pooled),
                          "--iters", "4", "--profile-iters", "2:4"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    ops = [e for e in _events(pooled) if e.get("ph") == "X"]
    assert ops and not any("cpu_us" in e["args"] for e in ops)
    wall, _ = read_traces(str(pooled))
    cpu, _ = read_traces(str(pooled), cpu=True)
    assert cpu.per_rank == wall.per_rank and cpu.load == {}


def test_cpu_time_keeps_the_waits_and_scales_an_op_without_it():
    """``cpu_time``: a host op takes its ``cpu_us``; one without it its wall
    time over the load factor; a comm op (a wait on other ranks) its wall."""
    from purine_mpi.tools.scaling.trace_reader import cpu_time, load_factor
    events = [{"name": "a", "cat": "compute", "dur": 300.0, "args": {"cpu_us": 100.0}},
              {"name": "b", "cat": "compute", "dur": 600.0, "args": {"cpu_us": 200.0}},
              {"name": "c", "cat": "update", "dur": 90.0, "args": {}},
              {"name": "x", "cat": "comm", "dur": 1000.0, "args": {"cpu_us": 1.0}}]
    assert load_factor(events) == pytest.approx(3.0)
    got = {e["name"]: e["dur"] for e in cpu_time(events, 3.0)}
    assert got == pytest.approx({"a": 100.0, "b": 200.0, "c": 30.0, "x": 1000.0})
    # no op timed on its thread: no factor (the reader keeps wall times)
    assert load_factor([{"name": "a", "cat": "compute", "dur": 5.0, "args": {}}]) is None


def _stretched(events, factor):
    """The events of a run in which every op, every gap and every
    iteration took ``factor`` times as long, each op's CPU time the same:
    the "alone" copy's ``cpu_us`` is its wall time (``factor`` 1)."""
    out = []
    for e in events:
        if e.get("ph") == "X":
            args = dict(e["args"], cpu_us=e["dur"])
            e = dict(e, ts=e["ts"] * factor, dur=e["dur"] * factor, args=args)
        out.append(e)
    return out


def test_a_calibration_slowed_by_other_processes_predicts_as_one_alone(traced, tmp_path):
    from purine_mpi.job.config import load_job
    from purine_mpi.tools.choose import Predictor
    from purine_mpi.tools.scaling.link import make_link
    from purine_mpi.tools.scaling.trace_reader import read_traces
    cfg, run = traced
    events = _events(run)
    alone = _copy(run, tmp_path / "alone", _stretched(events, 1.0))
    loaded = _copy(run, tmp_path / "loaded", _stretched(events, LOAD))
    a, job = read_traces(str(alone), cpu=True)
    b, _ = read_traces(str(loaded), cpu=True)
    assert a.load == {0: pytest.approx(1.0)} and b.load == {0: pytest.approx(LOAD)}
    assert b.per_rank[0] == pytest.approx(a.per_rank[0], rel=1e-9)
    assert b.iter_seconds[0] == pytest.approx(a.iter_seconds[0], rel=1e-9)
    assert b.gaps[0] == pytest.approx(a.gaps[0], rel=1e-9)
    # the settings, priced from either: the same seconds per iteration
    link = make_link(None, None, None, gamma=1e-10)
    stages = "{fc1: 0, relu1: 0, fc2: 0, relu2: 1, fc3: 1, loss: 1}"
    settings = [("parallel.scheme=data",),
                ("parallel.scheme=sharded", "parallel.shard=1"),
                ("parallel.scheme=data", "parallel.micro_batches=2"),
                ("parallel.scheme=pipeline", f"parallel.stages={stages}",
                 "parallel.micro_batches=2")]
    old_wall, _ = read_traces(str(loaded))
    for sets in settings:
        cand = load_job(str(cfg), sets, check_files=False)
        got = [Predictor(job, d, link, add=1e-10).predict(cand, 2)[0] for d in (a, b, old_wall)]
        assert got[1] == pytest.approx(got[0], rel=1e-6), sets
        # read as wall time (the rule before): the load of the trace's moment
        # in every setting's figure
        assert got[2] > 0.8 * LOAD * got[0], sets


def _halved(small, big):
    """The small trace's events with each op's time half the least time of
    that op in the big trace: its time at the small batch below its time at
    the job's batch, above the proportional rule's quarter, in every
    iteration. The measured small trace's times are not that, under load:
    on a loaded machine its ops took as long as the big trace's or longer,
    every op's fixed part then clamped to its whole time (``affine_fit``),
    read as CPU time or as wall time alike -- the check that the two
    readings differ failed (once, under ``-n 2``)."""
    least = {}
    for e in big:
        if e.get("ph") == "X":
            least[e["name"]] = min(least.get(e["name"], e["dur"]), e["dur"])
    return [dict(e, dur=0.5 * least[e["name"]])
            if e.get("ph") == "X" and e["name"] in least else e for e in small]


def test_two_calibration_traces_under_different_loads_fit_the_law_of_both_alone(
        traced, tmp_path):
    """The calibration's two traces (the job's batch and the small one,
    ``choose.affine_costs``: each op's cost per call and per unit of work)
    run one after the other, at whatever load each meets. The small trace
    slowed three times over, the big one not: read as CPU time, the fitted
    law and every setting's prediction are those of both traces alone (read
    as wall time, the slowed small trace reads as ops costing more per call
    than per work: a micro-batch setting priced otherwise)."""
    from purine_mpi.job.config import load_job
    from purine_mpi.tools.choose import Predictor, _calibration_job, small_batch
    from purine_mpi.tools.scaling.link import make_link
    from purine_mpi.tools.scaling.trace_reader import read_traces
    cfg, run = traced
    small_sets = (f"data.train.batch_size={small_batch(16)}",)
    small_run = tmp_path / "small_run"
    res = run_cli_args("train", cfg, "--out", small_run, "--iters", 8, "--profile-iters", "3:8",
                       *[a for s in small_sets for a in ("--set", s)])
    assert res.returncode == 0, res.stderr
    big_events = _events(run)
    small_events = _halved(_events(small_run), big_events)
    big = _copy(run, tmp_path / "big", _stretched(big_events, 1.0))
    alone = _copy(small_run, tmp_path / "alone", _stretched(small_events, 1.0))
    loaded = _copy(small_run, tmp_path / "loaded", _stretched(small_events, LOAD))
    d, job = read_traces(str(big), cpu=True)
    small_job = _calibration_job(str(cfg), (), small_sets)
    link = make_link(None, None, None, gamma=1e-10)
    preds = {}
    for name, folder, cpu in (("alone", alone, True), ("loaded", loaded, True),
                              ("wall", loaded, False)):
        s, _ = read_traces(str(folder), cpu=cpu)
        preds[name] = Predictor(job, d, link, small=(s, small_job), add=1e-10)
    assert preds["alone"].fit and preds["loaded"].fit.keys() == preds["alone"].fit.keys()
    def numbers(p):  # {op: (unit, fixed, rate)} -> [fixed, rate, ...] in one order
        return [v for name in sorted(preds["alone"].fit) for v in p.fit[name][1:]]
    for name, law in preds["alone"].fit.items():
        got = preds["loaded"].fit[name]
        assert got[0] == law[0] and got[1:] == pytest.approx(law[1:], rel=1e-6), name
    assert numbers(preds["wall"]) != pytest.approx(numbers(preds["alone"]), rel=0.05)
    for sets in [("parallel.scheme=data", "parallel.micro_batches=2"),
                 ("parallel.scheme=data", "parallel.micro_batches=4")]:
        cand = load_job(str(cfg), sets, check_files=False)
        want = preds["alone"].predict(cand, 2)[0]
        assert preds["loaded"].predict(cand, 2)[0] == pytest.approx(want, rel=1e-6), sets
        # the rule before: the slowed small trace's law, a prediction apart
        assert preds["wall"].predict(cand, 2)[0] != pytest.approx(want, rel=0.02), sets


def test_a_gpu_trace_is_not_divided_by_its_host_ops_load_factor(traced, tmp_path):
    """A GPU run's trace holds device ops (rows ``gpu<d>:<stream>``, the
    copy streams ``h2d``/``d2h``), timed by CUDA events, with no CPU time,
    beside the host ops (runtime/streams_dispatcher.py: an op on no stream
    runs through ``Executor.execute``, which records ``cpu_us``). The host
    ops' load factor says nothing about the device's times: read as CPU
    time, such a trace keeps every time as traced (no load factor)."""
    from purine_mpi.tools.scaling.trace_reader import read_traces
    _, run = traced
    out, kept = [], 0
    for e in _events(run):
        if e.get("ph") == "X":
            if kept < 2:  # two host ops that waited for a core: wall 4x their CPU time
                kept += 1
                e = dict(e, args=dict(e["args"], cpu_us=e["dur"] / 4))
            else:  # a device op: its stream's row, no CPU time
                args = {k: v for k, v in e["args"].items() if k != "cpu_us"}
                e = dict(e, tid="gpu0:0" if kept % 2 else "h2d", args=args)
                kept += 1
        out.append(e)
    gpu = _copy(run, tmp_path / "gpu", out)
    wall, _ = read_traces(str(gpu))
    cpu, _ = read_traces(str(gpu), cpu=True)
    assert cpu.load == {}
    assert cpu.iter_seconds == wall.iter_seconds and cpu.gaps == wall.gaps
    assert cpu.per_rank == wall.per_rank


def test_blas_threads_of_the_users_record_no_cpu_time(traced, tmp_path):
    """``OPENBLAS_NUM_THREADS`` (or ``MKL_NUM_THREADS``) above 1, set by the
    user (base/threads.py keeps it): BLAS splits a product over its own
    threads, whose CPU time the op's thread does not see, at any
    ``PURINE_THREADS``. No ``cpu_us`` then (the op would be priced at a
    part of its cost), as with a pool of host-product threads."""
    import subprocess
    cfg = traced[0]
    env = dict(cli_env(), PURINE_THREADS="1", OPENBLAS_NUM_THREADS="2")
    env.pop("OMP_NUM_THREADS", None)
    out = tmp_path / "blas"
    res = subprocess.run([PYTHON, "-m", "purine_mpi", "train", str(cfg), "--out", str(out),
                          "--iters", "4", "--profile-iters", "2:4"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    ops = [e for e in _events(out) if e.get("ph") == "X"]
    assert ops and not any("cpu_us" in e["args"] for e in ops)


def test_the_data_ops_wait_for_its_prefetch_thread_is_no_load(traced, tmp_path):
    """The data op (``DataReader``, category ``io``) waits for the batch its
    prefetch thread reads (ops/data.py ``_take``): a slow source makes its
    wall time far above its thread's CPU time on a machine to itself. That
    wait is no core taken by other processes: the load factor leaves it out
    (else it divides every op without CPU time, the iteration and the gaps
    of an unloaded run: 29.6 here), and the op is priced at its wall time
    over the factor, not at its thread's CPU time (its work is on another
    thread)."""
    from purine_mpi.tools.scaling.trace_reader import read_traces
    _, run = traced
    out, io = [], 0
    for e in _events(run):
        if e.get("ph") == "X":
            if e["cat"] == "io":  # waited 20 ms for its batch, 50 us of its own work
                io += 1
                e = dict(e, dur=20000.0, args=dict(e["args"], cpu_us=50.0))
            else:  # alone on its cores
                e = dict(e, args=dict(e["args"], cpu_us=e["dur"]))
        out.append(e)
    assert io
    slow = _copy(run, tmp_path / "slow_data", out)
    wall, _ = read_traces(str(slow))
    cpu, _ = read_traces(str(slow), cpu=True)
    assert cpu.load == {0: pytest.approx(1.0)}
    assert cpu.iter_seconds[0] == pytest.approx(wall.iter_seconds[0], rel=1e-9)
    assert cpu.per_rank[0]["data"] == pytest.approx(wall.per_rank[0]["data"], rel=1e-9)
