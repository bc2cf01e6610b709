"""Trust audit 65: the scaling predictor (``predict TRACE_DIR --np N``) and
the link figures ``plan --choose`` shares with it.

Found (each test says what failed on the code before):

- a trace whose op event lacks ``dur`` (or holds a string there) ended in a
  Python traceback (``KeyError: 'dur'``, ``TypeError``: exit 1); a NaN
  ``dur`` (``json`` reads ``NaN``) hung the simulation for ever (an event
  time that is NaN never equals itself, so the loop popping the events of
  that time popped none); a trace file that is not UTF-8 ended in a
  ``UnicodeDecodeError`` traceback. Now each exits 2 naming the file and
  the event (trace_reader.load_events; a negative ``dur``, which ended in a
  ``SimulationStalled`` traceback, and an ``args.iter`` that is a string,
  accepted with exit 0, too), and the simulation refuses a time
  that is not finite (simulate.simulate) instead of spinning.
- ``--latency 1e999s`` (past float's range: infinite) was accepted and
  hung ``predict`` and ``plan --choose``; ``--bandwidth 1e999gbit`` was
  accepted as an infinite rate; a ``--link`` file with ``"alpha_s":
  Infinity`` likewise. Now exit 2 naming the option or file.
- the traces of one job beside another job's ``config.yaml`` were read as
  if they were its own: ``predict`` printed a table (exit 0) in which 33 of
  LeNet's 39 ops, absent from a GPT's trace, counted 0 s and the traced
  iteration time was spread over them as dispatch overhead. Now exit 2
  naming the job and the ops the traces lack (model.check_traces_match).
"""
import json
import shutil

import pytest

from purine_mpi.base.errors import UserError
from purine_mpi.tools.scaling.link import load_link, parse_rate, parse_time
from purine_mpi.tools.scaling.simulate import RankGraph, SimOp, SimulationStalled, simulate
from tests.conftest import run_cli_args, small_net_config, write_config_file


@pytest.fixture(scope="module")
def traced(digits_h5, tmp_path_factory):
    """A run folder of the small LeNet with its trace of iterations 2..5."""
    folder = tmp_path_factory.mktemp("a65")
    cfg = write_config_file(folder, small_net_config(digits_h5, solver={
        "base_lr": 0.05, "max_iter": 6, "display": 0, "test_interval": 0}))
    run = folder / "run"
    res = run_cli_args("train", cfg, "--out", run, "--profile-iters", "2:6")
    assert res.returncode == 0, res.stderr
    assert (run / "trace.rank0.json").is_file()
    return run


def _copy_run(traced, dest):
    dest.mkdir()
    for name in ("config.yaml", "trace.rank0.json"):
        shutil.copy(traced / name, dest / name)
    return dest


def _mutate_ops(path, change):
    with open(path) as f:
        data = json.load(f)
    for e in data["traceEvents"]:
        if e.get("ph") == "X":
            change(e)
    with open(path, "w") as f:
        json.dump(data, f)


def test_the_run_folder_itself_predicts(traced):
    res = run_cli_args("predict", traced, "--np", "2", "--json", timeout=120)
    assert res.returncode == 0, res.stderr
    row = json.loads(res.stdout)["rows"][0]
    assert row["np"] == 2 and row["iter_ms"] > 0


def _drop_dur(e):
    del e["dur"]


def _text_dur(e):
    e["dur"] = "12"


def _nan_dur(e):
    e["dur"] = float("nan")


def _negative_dur(e):
    e["dur"] = -5.0


def _text_iter(e):
    e["args"] = {"iter": "3"}


@pytest.mark.parametrize("change,lacks", [
    (_drop_dur, "'dur'"),       # before: KeyError: 'dur' traceback, exit 1
    (_text_dur, "'dur'"),       # before: TypeError traceback, exit 1
    (_nan_dur, "'dur'"),        # before: the simulation never ended (TimeoutExpired)
    (_negative_dur, "'dur'"),   # before: SimulationStalled traceback, exit 1
    (_text_iter, "'args.iter'"),  # before: exit 0, a prediction read with no iterations
])
def test_a_bad_op_event_exits_2_naming_it(traced, tmp_path, change, lacks):
    run = _copy_run(traced, tmp_path / "run")
    _mutate_ops(run / "trace.rank0.json", change)
    res = run_cli_args("predict", run, "--np", "2", timeout=60)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert "trace.rank0.json: op event 0" in res.stderr and lacks in res.stderr


def test_a_trace_that_is_not_utf8_exits_2(traced, tmp_path):
    run = _copy_run(traced, tmp_path / "run")
    (run / "trace.rank0.json").write_bytes(b"\xff\xfe\x00{")
    res = run_cli_args("predict", run, "--np", "2", timeout=60)
    # before: UnicodeDecodeError traceback, exit 1
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "not UTF-8" in res.stderr


def test_traces_of_another_job_are_refused(traced, digits_h5, tmp_path):
    """The trace beside the config of a net whose layers it never ran (the
    same shapes, other names, as a folder where a user copied one run's
    trace next to another run's config.yaml)."""
    run = _copy_run(traced, tmp_path / "run")
    other = small_net_config(digits_h5)
    for layer in other["net"]:
        layer["name"] = "other_" + layer["name"]
    other["name"] = "other_job"
    write_config_file(run, other, name="config.yaml")
    res = run_cli_args("predict", run, "--np", "2", timeout=60)
    # before: exit 0 and a table priced from ops counted at 0 s
    assert res.returncode == 2, res.stdout + res.stderr
    assert "not of job 'other_job'" in res.stderr and "other_conv1.fwd" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("text", ["1e999s", "1e400us", "inf", "nan"])
def test_a_latency_past_float_range_is_refused(text):
    with pytest.raises(UserError, match="--latency"):  # before: DID NOT RAISE (inf)
        parse_time(text)


@pytest.mark.parametrize("text", ["1e999gbit", "1e400bps"])
def test_a_bandwidth_past_float_range_is_refused(text):
    with pytest.raises(UserError, match="--bandwidth"):  # before: DID NOT RAISE (inf)
        parse_rate(text)


def test_finite_figures_still_read():
    assert parse_time("20us") == pytest.approx(2e-5)
    assert parse_time("0") == 0.0
    assert parse_rate("8gbit") == pytest.approx(1e9)


def test_plan_choose_refuses_an_infinite_latency(digits_h5, tmp_path):
    cfg = write_config_file(tmp_path, small_net_config(digits_h5))
    res = run_cli_args("plan", cfg, "--np", "2", "--choose", "--latency", "1e999s",
                       "--calibration", tmp_path / "cal.json", timeout=60)
    # before: the choice's simulations never ended (TimeoutExpired)
    assert res.returncode == 2, res.stderr
    assert "--latency" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("key", ["alpha_s", "beta_bytes_per_s", "gamma_s_per_byte"])
def test_a_link_file_with_infinity_is_refused(tmp_path, key):
    data = {"format": "purine_mpi.link", "alpha_s": 1e-6, "beta_bytes_per_s": 1e9,
            "gamma_s_per_byte": 0.0}
    data[key] = float("inf")
    path = tmp_path / "link.json"
    path.write_text(json.dumps(data))  # writes Infinity, which json reads back
    with pytest.raises(UserError, match="finite"):  # before: DID NOT RAISE
        load_link(path)


def test_the_simulation_refuses_a_time_that_is_not_finite():
    g = RankGraph(0, {"a": SimOp("a", float("nan")), "b": SimOp("b", 1e-3, ("a",))})
    # before: simulate never returned
    with pytest.raises(SimulationStalled, match="not finite"):
        simulate([g], 3)


# --- sizes (plan --host-memory/--device-memory/--node-memory, gpu.workspace_limit) ---

@pytest.mark.parametrize("text", ["0.5B", "0.0001K", "0.9"])
def test_a_size_under_one_byte_is_no_size(text):
    from purine_mpi.base.progress_bar import parse_size
    assert parse_size(text) is None  # before: 0, "a positive byte count" of 0 bytes


@pytest.mark.parametrize("text,nbytes", [("1", 1), ("80gib", 80 << 30), ("1.5TB", 1_500_000_000_000),
                                         ("512MiB", 512 << 20), (" 5GiB", 5 << 30)])
def test_sizes_still_read(text, nbytes):
    from purine_mpi.base.progress_bar import parse_size
    assert parse_size(text) == nbytes


def test_plan_refuses_a_memory_of_half_a_byte(digits_h5, tmp_path):
    cfg = write_config_file(tmp_path, small_net_config(digits_h5))
    res = run_cli_args("plan", cfg, "--host-memory", "0.5B", timeout=60)
    # before: the plan checked every rank against 0 B ("DOES NOT FIT: ... of 0 B")
    assert res.returncode == 2
    assert "--host-memory 0.5B: expected a size of at least one byte" in res.stderr
    assert "DOES NOT FIT" not in res.stdout


def test_config_refuses_a_workspace_limit_of_half_a_byte(digits_h5, tmp_path):
    from purine_mpi.base.errors import ConfigError
    from tests.conftest import make_job
    cfg = small_net_config(digits_h5, gpu={"workspace_limit": "0.5B"})
    with pytest.raises(ConfigError, match="workspace_limit"):  # before: DID NOT RAISE (0 bytes)
        make_job(cfg)


# --- a 1-rank trace priced at 2 ranks: the clipping ops' names differ ---

def test_clipping_ops_are_priced_at_another_rank_count(digits_h5, tmp_path):
    """On 2 ranks gradient clipping reads the summed gradients (``w.grad.sum.
    clip``), on the traced rank ``w.grad.clip``. Before: those ops were
    untraced at N = 2, priced 0 s, and the prediction ran faster on 2 ranks
    than on 1 (``untraced_ops`` 4 and an efficiency above 1: GPT-tiny's
    trace read 100.8 %)."""
    cfg = write_config_file(tmp_path, small_net_config(digits_h5, solver={
        "base_lr": 0.05, "max_iter": 6, "display": 0, "test_interval": 0,
        "clip_gradients": 1.0}))
    run = tmp_path / "run"
    res = run_cli_args("train", cfg, "--out", run, "--profile-iters", "2:6")
    assert res.returncode == 0, res.stderr
    res = run_cli_args("predict", run, "--np", "2", "--json", timeout=120)
    assert res.returncode == 0, res.stderr
    row = json.loads(res.stdout)["rows"][0]
    assert row["untraced_ops"] == 0
    # the same ops and the same data-parallel communication on top: no faster
    assert row["efficiency"] <= 1.0


def test_a_cuda_graph_trace_is_refused_as_such(traced, tmp_path):
    """A GPU run's trace with CUDA graphs (``cuda_graph: true``, the
    default) holds one ``CudaGraph`` event per replay, its ops in
    ``args.ops`` (runtime/cuda_graph.py; as the emulated device writes it
    for this job, tests/emulated_gpu): the job's own trace, with no op
    times. Before: exit 2 saying the traces were not of job 'tiny'. Now the
    refusal names the replays and ``cuda_graph=false``; eager GPU traces
    (per-op events) predict as the CPU's do."""
    run = _copy_run(traced, tmp_path / "graphed")
    path = run / "trace.rank0.json"
    with open(path) as f:
        data = json.load(f)
    ops = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    by_iter = {}
    for e in ops:
        by_iter.setdefault(e["args"]["iter"], []).append(e)
    replays = [{"name": "graph0", "cat": "cuda_graph", "ph": "X",
                "ts": min(e["ts"] for e in es),
                "dur": max(e["ts"] + e["dur"] for e in es) - min(e["ts"] for e in es),
                "pid": 0, "tid": "gpu0:graph",
                "args": {"iter": it, "op_type": "CudaGraph",
                         "ops": [e["name"] for e in es]}}
               for it, es in sorted(by_iter.items())]
    data["traceEvents"] = [e for e in data["traceEvents"] if e.get("ph") != "X"] + replays
    with open(path, "w") as f:
        json.dump(data, f)
    res = run_cli_args("predict", run, "--np", "2", timeout=120)
    assert res.returncode == 2, res.stderr
    assert "CUDA graph replays" in res.stderr and "cuda_graph=false" in res.stderr, res.stderr
    assert "not of job" not in res.stderr and "Traceback" not in res.stderr
