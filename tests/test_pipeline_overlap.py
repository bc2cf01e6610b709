"""Pipelining is real: with M micro-batches the stages compute at the same
time (seen in the ranks' ``--profile`` traces, which share one time axis),
the measured live activations follow the schedule (1F1B: at most p - s
micro-batches on stage s; GPipe: M), and benchmarks/pipeline.py reports it.
The trace statistics themselves are checked on hand-made timelines."""
import json
import os
import subprocess
import sys

import pytest

from purine_mpi.parallel.micro_batch import stage_order
from purine_mpi.tools.pipeline_stats import (bubble_fraction, busy_us, cross_stage_overlap_us,
                                             live_micro_batches, micro_batch_of, theory_bubble)
from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env, write_config_file

sys.path.insert(0, os.path.join(REPO, "benchmarks"))


def _ev(name, ts, dur, cat="compute", it=0):
    return {"name": name, "ph": "X", "ts": ts, "dur": dur, "cat": cat, "args": {"iter": it}}


def _timeline(stage, stages, m, schedule, t_step=10.0):
    """Events of one stage running ``stage_order`` back to back."""
    out, t = [], 0.0
    for kind, k in stage_order(stage, stages, m, schedule):
        name = f"fc{stage}.fwd@mb{k}" if kind == "F" else f"fc{stage}.bwd.grad_data@mb{k}"
        out.append(_ev(name, t, t_step))
        t += t_step
    return out


def test_stats_on_hand_made_timelines():
    assert micro_batch_of("fc1.fwd@mb12") == 12 and micro_batch_of("fc1.fwd") is None
    assert micro_batch_of("fc2@relu2.grad@mb3.send@r1") == 3
    assert theory_bubble(2, 4) == pytest.approx(0.2) and theory_bubble(4, 1) == pytest.approx(0.75)
    # busy time is a union: overlapping ops count once, comm never
    ev = [_ev("a", 0, 10), _ev("b", 5, 10), _ev("c", 30, 5, "comm"), _ev("d", 40, 2, "update")]
    assert busy_us(ev) == 17
    assert bubble_fraction([15, 5], 20) == pytest.approx(0.5)
    # 1F1B on stage 0 of 2 holds 2 micro-batches at once, GPipe all 4
    for schedule, peaks in (("1f1b", (2, 1)), ("gpipe", (4, 4))):
        for stage in (0, 1):
            assert live_micro_batches(_timeline(stage, 2, 4, schedule))[0] == peaks[stage]
    # two ranks on different micro-batches at once: counted; the same one: not
    a = [_ev("x.fwd@mb1", 0, 10)]
    assert cross_stage_overlap_us(a, [_ev("y.fwd@mb0", 5, 10)]) == 5
    assert cross_stage_overlap_us(a, [_ev("y.fwd@mb1", 5, 10)]) == 0


def _bench_config(micro, schedule, iters):
    import pipeline as bench
    return bench.net_config(micro, schedule, batch=64, width=256, iters=iters)


def _traces(tmp_path, micro, schedule="1f1b", iters=6):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    cfg = write_config_file(tmp_path, _bench_config(micro, schedule, iters), f"m{micro}.yaml")
    out = tmp_path / f"run{micro}"
    res = subprocess.run([MPIEXEC, "-n", "2", PYTHON, "-m", "purine_mpi", "train", cfg,
                          "--out", out, "--profile-iters", f"2:{iters}"], cwd=REPO,
                         env=cli_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return [[e for e in json.load(open(out / f"trace.rank{r}.json"))["traceEvents"]
             if e.get("ph") == "X"] for r in (0, 1)]


@pytest.mark.mpi
def test_trace_shows_the_stages_computing_at_once(tmp_path):
    """2 stages, M = 4 (1F1B): in the ranks' traces, on one time axis, rank 0
    computes one micro-batch while rank 1 computes another; and the axis is
    shared: rank 1 never starts a micro-batch before rank 0 has finished
    computing what it receives."""
    r0, r1 = _traces(tmp_path, 4)
    overlap = cross_stage_overlap_us(r0, r1)
    assert overlap > 0, "the stages never computed at the same time"
    for it in range(2, 6):
        for k in range(4):
            sent = [e["ts"] + e["dur"] for e in r0 if e["name"] == f"relu2.fwd@mb{k}"
                    and e["args"]["iter"] == it]
            used = [e["ts"] for e in r1 if e["name"] == f"fc3.fwd@mb{k}"
                    and e["args"]["iter"] == it]
            assert len(sent) == len(used) == 1
            assert used[0] >= sent[0], (it, k, used[0] - sent[0])
    # each stage's live activations follow 1F1B: 2 on stage 0, 1 on stage 1
    for r, (events, bound) in enumerate(((r0, 2), (r1, 1))):
        for it in range(2, 6):
            peak, _ = live_micro_batches([e for e in events if e["args"]["iter"] == it])
            assert peak == bound, (r, it, peak)


@pytest.mark.mpi
def test_pipeline_benchmark_prints_one_json(tmp_path):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    res = subprocess.run([PYTHON, os.path.join(REPO, "benchmarks", "pipeline.py"), "--iters", "3",
                          "--warmup", "1", "--batch", "32", "--width", "64"], cwd=REPO,
                         env=cli_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["bubble"]["m1"]["theory"] == 0.5 and out["bubble"]["m4_1f1b"]["theory"] == 0.2
    for run in ("m1", "m4_1f1b", "m4_gpipe"):
        assert 0 <= out["bubble"][run]["measured"] < 1
        assert out["images_per_s"][run] > 0
    assert out["peak_live_micro_batches"]["1f1b"] == [2, 1]
    assert out["peak_live_micro_batches"]["gpipe"] == [4, 4]
    one, gp = out["peak_activation_bytes"]["1f1b"], out["peak_activation_bytes"]["gpipe"]
    assert one[0] * 2 == gp[0] and one[1] * 4 == gp[1]
    # real allocation: the memory plan keeps 2 copies on stage 0, 1 on stage 1
    alloc = out["allocated_activation_bytes"]
    assert alloc["slots"] == {"1f1b": [2, 1], "gpipe": [4, 4]}
    one, gp = alloc["1f1b"], alloc["gpipe"]
    assert one[0] * 2 == gp[0] and one[1] * 4 == gp[1] and one[1] > 0
    ws = out["workspace_bytes"]
    assert [g - o for g, o in zip(ws["m4_gpipe"], ws["m4_1f1b"])] == [g - o for g, o in
                                                                     zip(gp, one)]
    assert out["runs"]["m1"]["allocated_activation_bytes"] == [None, None]
    assert out["speedup_m4_over_m1"] > 0
