"""``train --profile-iters`` in a sync_ps run traces the server ranks too:
each writes ``trace.rank<R>.json`` (its server graph's ops: WaitWrite, the
update, Publish, Release) on the workers' time axis (rank 0's start,
agreed over every rank), marked as a parameter server's
(``process_labels``). On the code before, a server wrote no trace
(FileNotFoundError on ``trace.rank1.json``).

``predict TRACE_DIR --np`` refuses a run traced under parameter servers
(sync_ps, async: exit 2, one line naming the folder, the mode and what to
do), by a server's label or, where no server wrote one (async; an older
version), by the run's config.yaml: the scaling model does not price
parameter servers (docs/scaling.md, "Parameter servers"). On the code
before it left the servers out and priced the workers' traces as a run of
that many ranks, exit 0: a 3-rank sync_ps run predicted 2.53 ms/iter at 2
ranks against a traced 61 ms (162 % efficiency)."""
import json

import pytest

from purine_mpi.job.config import dump_config
from purine_mpi.tools.scaling.trace_reader import load_trace
from tests.conftest import run_cli_args
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
    assert [load_trace(str(out / f"trace.rank{r}.json"))[1] for r in (0, 1)] == [False, True]
    _assert_predict_refuses(out, ["parallel.mode: sync_ps, parallel.ps_ranks 1 in its "
                                  "config.yaml", "trace.rank1.json is a server's"])
    # a trace copied beside a config of mode sync: the server's label refuses it
    config = (out / "config.yaml").read_text()
    assert "mode: sync_ps\n" in config
    (out / "config.yaml").write_text(config.replace("mode: sync_ps\n", "mode: sync\n"))
    text = _assert_predict_refuses(out, ["(trace.rank1.json is a server's)"])
    assert "in its config.yaml" not in text, text
    # an older version's run: its server wrote no trace; the config tells
    (out / "config.yaml").write_text(config)
    (out / "trace.rank1.json").unlink()
    text = _assert_predict_refuses(out, ["(parallel.mode: sync_ps, parallel.ps_ranks 1 in "
                                         "its config.yaml)"])
    assert "server's" not in text, text


def _assert_predict_refuses(out, says):
    """``predict OUT --np 1,2,3`` exits 2 with one line that names the run
    folder, what marks it a parameter-server run (``says``) and what to do;
    no table. Returns the line."""
    res = run_cli_args("predict", out, "--np", "1,2,3")
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert res.stdout == "", res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for part in [f"predict {out}: the run was traced under parameter servers", *says,
                 "trace the same job under parallel.mode: sync", "docs/scaling.md"]:
        assert part in lines[0], (part, lines[0])
    return lines[0]


@pytest.mark.mpi
def test_predict_refuses_an_async_run_whose_server_wrote_no_trace(tmp_path):
    """An async run (``max_staleness`` 1: a worker runs ahead) traced with
    ``--profile-iters``: its server writes no trace, and the saved
    config.yaml's mode refuses the prediction (before: exit 0, the worker
    priced as a one-rank run)."""
    cfg = mlp_config(solver={"max_iter": 6, "display": 3},
                     parallel={"mode": "async", "ps_ranks": 1, "max_staleness": 1})
    path, out = tmp_path / "mlp.yaml", tmp_path / "run"
    path.write_text(dump_config(cfg))
    proc, _ = run_python(2, ["-m", "purine_mpi", "train", str(path), "--out", str(out),
                             "--profile-iters", "2:5"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.glob("trace.rank*.json")) == ["trace.rank0.json"]
    _assert_predict_refuses(out, ["(parallel.mode: async, parallel.ps_ranks 1 in its "
                                  "config.yaml)"])


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
