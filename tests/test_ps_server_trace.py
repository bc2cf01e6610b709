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


@pytest.mark.mpi
def test_resumed_sync_ps_run_keeps_its_traces_when_it_trains_nothing(tmp_path):
    """A resume of a finished sync_ps run with ``--profile-iters``: the
    workers say "already finished" and exit 0 (as data parallelism does),
    so the server must too, leaving every earlier trace as it was (before,
    the server alone checked its window against no iteration to train:
    exit 2, "rank 1: --profile-iters ... (none)"). A window outside the
    iterations a resume trains is refused on every rank (exit 2), the
    earlier traces untouched."""
    cfg = mlp_config(solver={"max_iter": 4, "display": 2},
                     parallel={"mode": "sync_ps", "ps_ranks": 1})
    path, out = tmp_path / "mlp.yaml", tmp_path / "run"
    path.write_text(dump_config(cfg))
    train = ["-m", "purine_mpi", "train", str(path), "--out", str(out), "--profile-iters", "1:3"]
    proc, _ = run_python(2, train, timeout=300)
    assert proc.returncode == 0, proc.stderr
    before = {r: (out / f"trace.rank{r}.json").read_bytes() for r in (0, 1)}
    proc, _ = run_python(2, train + ["--resume", "auto"], timeout=300, expect_ok=False)
    assert proc.returncode == 0, proc.stderr
    assert "already finished at iteration 4" in proc.stdout, proc.stdout
    assert {r: (out / f"trace.rank{r}.json").read_bytes() for r in (0, 1)} == before
    proc, _ = run_python(2, train + ["--resume", "auto", "--iters", "6"], timeout=300,
                         expect_ok=False)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "--profile-iters 1:3 traces none of the iterations this run trains (4 to 5)" \
        in proc.stderr, proc.stderr
    assert {r: (out / f"trace.rank{r}.json").read_bytes() for r in (0, 1)} == before
