"""Traces that scale: events stream to the file in chunks (bounded memory),
``--profile-iters A:B`` keeps a window, metadata names rank and threads."""
import json

import pytest

from purine_mpi.base.errors import UserError
from purine_mpi.graph.core import Op
from purine_mpi.runtime.trace import TraceFile, parse_window
from tests.conftest import run_cli_args, write_config_file
from tests.test_train import small_net_config


def test_trace_file_streams_in_chunks_and_keeps_a_window(tmp_path):
    path = tmp_path / "t.json"
    tf = TraceFile(str(path), rank=3, window=(5, 8), chunk=10)
    op = Op("conv1.fwd", "Conv", [], [])
    for it in range(100):
        for k in range(4):
            tf.record(op, "compute", 1.0 + it, 1.5 + it, it, k % 2)
        # memory stays bounded by the chunk, whatever the number of iterations
        assert len(tf.events) < 10
    assert tf.close() == str(path)
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert sorted({e["args"]["iter"] for e in spans}) == [5, 6, 7]
    assert len(spans) == 12 and all(e["pid"] == 3 for e in events)
    names = {(e["name"], e["tid"]) for e in events if e["ph"] == "M"}
    assert {("process_name", "0"), ("thread_name", "0"), ("thread_name", "1")} <= names


def test_unbounded_trace_is_written_while_running(tmp_path):
    path = tmp_path / "t.json"
    tf = TraceFile(str(path), chunk=5)
    for it in range(20):
        tf.record(Op("a", "Relu", [], []), "compute", 0.0, 1.0, it, "comm")
    assert tf.written >= 15 and path.stat().st_size > 0  # already on disk
    tf.close()
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 20


@pytest.mark.parametrize("text,expect", [("3:7", (3, 7)), (":4", (0, 4)), ("10:", (10, None))])
def test_parse_window(text, expect):
    assert parse_window(text) == expect


@pytest.mark.parametrize("text", ["5", "7:3", "a:b", "-1:4", "1:2:3"])
def test_parse_window_errors(text):
    with pytest.raises(UserError, match="--profile-iters"):
        parse_window(text)


def test_train_profile_iters(tmp_path, digits_h5):
    cfg = small_net_config(digits_h5)
    cfg["solver"].update({"max_iter": 12, "display": 0, "test_interval": 0})
    path = write_config_file(tmp_path, cfg)
    res = run_cli_args("train", path, "--out", tmp_path / "run", "--profile-iters", "4:6")
    assert res.returncode == 0, res.stderr
    events = json.loads((tmp_path / "run" / "trace.rank0.json").read_text())["traceEvents"]
    assert {e["args"]["iter"] for e in events if e["ph"] == "X"} == {4, 5}
    bad = run_cli_args("train", path, "--out", tmp_path / "bad", "--profile-iters", "9:2")
    assert bad.returncode == 2 and "--profile-iters" in bad.stderr
    assert "Traceback" not in bad.stderr
