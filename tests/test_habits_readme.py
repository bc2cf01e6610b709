"""Issue 36 "Everyday habits", items 6 and 9.

- 9: ``bench``'s human output says what its communication figure is (the
  comm ops' post-to-completion times summed over the ops, which overlap each
  other and compute) and how much of it the iteration's wall clock saw with
  no compute running (``comm_in_flight_ms_per_iter``,
  ``comm_exposed_ms_per_iter``, ``comm_ops_per_iter`` in ``bench --json``).
- 6: the README is a short first screen (set-up, quick start, pointers to
  docs/); the reference material lives in docs/, every relative link of the
  README and docs/*.md resolves, and the set-up extras cover ``plot``.
"""
import json
import re

import pytest

from .conftest import run_mpi_cli, write_config_file


def _tiny_config(directory):
    cfg = {"name": "tiny",
           "data": {"train": {"source": "synthetic", "shape": [1, 8, 8], "classes": 4,
                              "batch_size": 8}},
           "net": [{"type": "conv", "name": "conv1", "bottom": "data", "num_output": 4,
                    "kernel": 3},
                   {"type": "relu", "name": "relu1", "bottom": "conv1", "top": "conv1"},
                   {"type": "fc", "name": "fc1", "bottom": "conv1", "num_output": 16},
                   {"type": "fc", "name": "fc2", "bottom": "fc1", "num_output": 4},
                   {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"]}],
           "solver": {"max_iter": 10, "display": 0, "test_interval": 0},
           "checkpoint": {"interval": 0}}
    return write_config_file(directory, cfg, "tiny.yaml")


# ------------------------------------------------------------- item 9
def test_case9_comm_timeline_arithmetic():
    """Case 9: the figures behind the explanation, on a hand-made trace. Two
    comm ops overlap each other (0-40 and 20-60 µs: 80 summed, 60 in
    flight); compute runs 10-30 and 50-100 (an update), so 30 µs of the
    60 are covered and 30 exposed; the io event (data) covers nothing."""
    from purine_mpi.bench import comm_overlap, comm_timeline

    def ev(cat, ts, dur):
        return {"cat": cat, "ts": float(ts), "dur": float(dur)}
    events = [ev("comm", 0, 40), ev("comm", 20, 40), ev("compute", 10, 20),
              ev("update", 50, 50), ev("io", 30, 20)]
    in_flight, covered, ops = comm_timeline(events)
    assert (in_flight, covered, ops) == (60.0, 30.0, 2)
    assert comm_overlap(events) == pytest.approx(0.5)
    assert comm_timeline([ev("compute", 0, 5)]) == (0, 0.0, 0)


@pytest.mark.mpi
def test_case9_bench_json_comm_figures_add_up(tmp_path):
    """Case 9: ``bench --json`` on 2 ranks gives the comm ops per iteration
    (one allreduce per gradient bucket: as many as post_latency_ms names),
    their wall time in flight (at most their summed time) and the exposed
    part, which is the in-flight time not covered by compute."""
    res = run_mpi_cli(2, "bench", _tiny_config(tmp_path), "--iters", 5, "--warmup", 2,
                      "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    ops, summed = out["comm_ops_per_iter"], out["comm_ms_per_iter"]
    in_flight, exposed = out["comm_in_flight_ms_per_iter"], out["comm_exposed_ms_per_iter"]
    assert ops == len(out["post_latency_ms"]) >= 1, out
    assert 0 < in_flight <= summed + 0.002, out
    assert 0 <= exposed <= in_flight + 0.001, out
    assert exposed == pytest.approx(in_flight * (1 - out["comm_overlap"]), abs=0.002), out


@pytest.mark.mpi
def test_case9_bench_human_output_explains_communication(tmp_path):
    """Case 9: the human output of a 2-rank bench says the communication
    figure is summed over N comm ops from post to completion, that they
    overlap each other and compute, and gives the in-flight and exposed
    wall time; the figures agree with each other (exposed = in flight x
    (1 - the share with compute), to the printed rounding)."""
    res = run_mpi_cli(2, "bench", _tiny_config(tmp_path), "--iters", 5, "--warmup", 2)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    m = re.search(r"^  communication  ([\d.,]+) ms per iteration summed over (\d+) comm ops, "
                  r"each from its post to its completion \(they overlap each other and "
                  r"compute\)\n {17}in flight ([\d.,]+) ms of the iteration's wall time \(at "
                  r"least one comm op posted and not completed\), (\d+)% of it with compute "
                  r"running\n {17}exposed ([\d.,]+) ms: a comm op in flight and no compute op "
                  r"running \(rank 0\)$", text, re.M)
    assert m, text
    summed, ops, in_flight, pct, exposed = (float(g.replace(",", "")) for g in m.groups())
    latency = re.search(r"^  post latency   [\d.]+ ms worst over (\d+) comm ops$", text, re.M)
    assert latency and int(latency.group(1)) == ops, text
    assert 0 < in_flight <= summed + 0.01, text
    assert 0 <= exposed <= in_flight + 0.01, text
    # pct is rounded to 1 %, the ms figures to 0.01 ms
    assert abs(exposed - in_flight * (1 - pct / 100)) <= in_flight * 0.005 + 0.01, text
