"""A resumed ``--profile`` run keeps the traces of the run it resumes
(docs/running.md, "Traces of a resumed run").

Before: the resume opened ``trace.rank<R>.json`` afresh, truncating the
killed (or stopped) run's trace without a word: the iterations it traced
were lost. Now the earlier file is renamed to
``trace.rank<R>.before<I>.json`` (I: the iteration the resume starts at)
and train.log says so; ``trace.rank<R>.json`` is the new run's, the one
``predict TRACE_DIR`` reads."""
import json
import os

from tests.conftest import run_cli_args, small_net_config, write_config_file


def _iters(path):
    """The iterations whose ops a trace file holds (a killed run's lacks ``]}``)."""
    text = open(path).read().rstrip().rstrip(",")
    if not text.endswith("]}"):
        text += "]}"
    events = json.loads(text)["traceEvents"]
    return sorted({e["args"]["iter"] for e in events
                   if e.get("ph") == "X" and "iter" in e.get("args", {})})


def test_a_resumed_profile_run_keeps_the_earlier_traces(digits_h5, tmp_path):
    cfg = small_net_config(digits_h5, solver={
        "base_lr": 0.05, "max_iter": 4, "display": 2, "test_interval": 0})
    cfg["checkpoint"] = {"interval": 2, "keep": 3}
    cfg = write_config_file(tmp_path, cfg)
    run = tmp_path / "run"
    res = run_cli_args("train", cfg, "--out", run, "--profile")
    assert res.returncode == 0, res.stderr
    first = (run / "trace.rank0.json").read_bytes()
    assert _iters(run / "trace.rank0.json") == [0, 1, 2, 3]
    res = run_cli_args("train", cfg, "--out", run, "--resume", "auto", "--iters", "6",
                       "--profile")
    assert res.returncode == 0, res.stderr
    kept = run / "trace.rank0.before4.json"
    assert kept.read_bytes() == first  # before: no such file, the trace overwritten
    assert _iters(run / "trace.rank0.json") == [4, 5]
    note = ("note: the earlier trace trace.rank0.json is kept as trace.rank0.before4.json; "
            "this run's trace is trace.rank0.json")
    assert note in (run / "train.log").read_text()
    assert note in res.stdout
    # a second resume from the same checkpoint (iteration 4 again): a name of its own
    second = (run / "trace.rank0.json").read_bytes()
    os.remove(run / "latest.h5")
    os.remove(run / "ckpt_6.h5")
    res = run_cli_args("train", cfg, "--out", run, "--resume", str(run / "ckpt_4.h5"),
                       "--iters", "5", "--profile")
    assert res.returncode == 0, res.stderr
    assert (run / "trace.rank0.before4-2.json").read_bytes() == second
    assert kept.read_bytes() == first
    assert _iters(run / "trace.rank0.json") == [4]
