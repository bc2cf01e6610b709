"""``train --profile-iters`` in a sync_ps run traces the server ranks too:
each writes ``trace.rank<R>.json`` (its server graph's ops: WaitWrite, the
update, Publish, Release) on the workers' time axis (rank 0's start,
agreed over every rank), marked as a parameter server's
(``process_labels``), which ``predict`` leaves out (it prices replicas of
the net). On the code before, a server wrote no trace (FileNotFoundError
on ``trace.rank1.json``)."""
import json

import pytest

from purine_mpi.job.config import dump_config
from purine_mpi.tools.scaling.trace_reader import read_traces
from tests.mpi_scripts.common import mlp_config
from tests.mpi_scripts.launch import run_python


@pytest.mark.mpi
def test_sync_ps_server_is_traced_on_the_workers_time_axis(tmp_path):
    cfg = mlp_config(solver={"max_iter": 6, "display": 3},
                     parallel={"mode": "sync_ps", "ps_ranks": 1})
    path, out = tmp_path / "mlp.yaml", tmp_path / "run"
    path.write_text(dump_config(cfg))
    proc, _ = run_python(2, ["-m", "purine_mpi", "train", str(path), "--out", str(out),
                             "--profile-iters", "2:5"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "one-sided, shared windows" in proc.stdout, proc.stdout
    traces = {}
    for r in (0, 1):
        with open(out / f"trace.rank{r}.json") as f:
            traces[r] = json.load(f)["traceEvents"]  # complete JSON: Perfetto opens it
    meta = {e["name"]: e["args"] for e in traces[1] if e["ph"] == "M" and e["pid"] == 1}
    assert meta["process_labels"] == {"labels": "parameter server"}, meta
    assert meta["process_name"]["name"].startswith("rank 1, parameter server"), meta
    assert not any(e["name"] == "process_labels" for e in traces[0])
    ops = {r: [e for e in ev if e["ph"] == "X"] for r, ev in traces.items()}
    assert {e["args"]["iter"] for e in ops[1]} == {2, 3, 4}
    assert {"WaitWrite", "SGDUpdate", "Publish", "Release"} <= \
        {e["args"]["op_type"] for e in ops[1]}

    def spans(r, suffix):
        return {(e["name"][:-len(suffix)], e["args"]["iter"]): (e["ts"], e["ts"] + e["dur"])
                for e in ops[r] if e["cat"] == "comm" and e["name"].endswith(suffix)}
    pushes, pulls = spans(0, ".push"), spans(0, ".pull")
    waits = {(k[0].replace(".grad@w0", ""), k[1]): v for k, v in spans(1, ".wait").items()}
    publishes = spans(1, ".publish")
    assert waits and sorted(waits) == sorted(pushes) == sorted(publishes) == sorted(pulls)
    for key in waits:
        # causality on one clock: the server sees gradient k only after the
        # worker's Put of it began; the worker's Get of the weights of
        # iteration k ends only after the server's Publish of them began
        assert waits[key][1] >= pushes[key][0], (key, waits[key], pushes[key])
        assert pulls[key][1] >= publishes[key][0], (key, pulls[key], publishes[key])
    durations, _job = read_traces(str(out))
    assert sorted(durations.per_rank) == [0]  # the server's graph is not a replica's
