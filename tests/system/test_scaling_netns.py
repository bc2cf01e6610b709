"""System test: the scaling predictor against a measured run on emulated
links, a small version of benchmarks/scaling_validate.py (overlap_netns.py's
default net, 1 Gbit/s, one round).

Slow (network namespaces, three MPI launches); skipped unless root with
``ip`` and ``tc`` and a working ``ip netns``. The machine running it is
shared, so one round's error is bounded loosely here (docs/performance.md's table
takes medians over interleaved rounds)."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.mpi]
REPO = Path(__file__).resolve().parents[2]


def _netns_usable():
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "mpiexec")):
        return False
    name = f"pmprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


def test_prediction_is_near_the_emulated_link(tmp_path):
    if not _netns_usable():
        pytest.skip("needs root, ip, tc, network namespaces and the venv's mpiexec")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # another round only when this one's whole-iteration error is over the
    # bound: its compute part is timed on a shared machine (one suite run of
    # stop 56 traced it while the other worker started: predicted 469.8 ms
    # against 295.6 real; stop 62's CI run twice in a row, 433 / 425 against
    # 304 / 289, a burst of the other worker's lasting both rounds; alone
    # -2.4 %, beside a process spinning on one of the 2 cores -11.6 %), so
    # up to four rounds 10 s apart; a predictor off by the bound fails all
    # four. The communication part, the link model's, is a round's too: its
    # calibration (alpha, beta and a byte's CPU cost, predict --calibrate) and
    # the measured run are timed at different moments of the same load (3
    # CPU hogs beside MPI test loops, load average 18 on the 2 cores: round 1
    # predicted 311.0 ms of communication against 218.6 measured, 1 of 2
    # runs; three more runs' first rounds 6%, 21% and 1% off), so a round
    # off on either part is tried again; the last round meets both bounds
    rows = []
    for attempt in range(4):
        if attempt:
            time.sleep(10)
        out = tmp_path / f"round{attempt}"
        proc = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "scaling_validate.py"), "--nets",
             "default", "--rates", "1gbit", "--rounds", "1", "--iters", "4", "--warmup", "1",
             "--out", str(out)],
            capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        (row,) = result["summary"]
        assert row["net"] == "default" and row["rate"] == "1gbit"
        assert row["real_ms"] > 0 and row["predicted_ms"] > 0
        # the communication part alone is the link model's: 24 MB at ~1 Gbit/s
        (r,) = result["rounds"]
        rows.append(dict({k: row[k] for k in ("real_ms", "predicted_ms", "measured_compute_ms",
                                              "predicted_compute_ms", "error")},
                         measured_comm_ms=r["measured_comm_ms"],
                         predicted_comm_ms=r["predicted_comm_ms"]))
        comm_ok = r["predicted_comm_ms"] == pytest.approx(r["measured_comm_ms"], rel=0.25)
        if abs(row["error"]) < 0.4 and comm_ok:
            break
    print(json.dumps(rows))
    last = rows[-1]
    assert last["predicted_comm_ms"] == pytest.approx(last["measured_comm_ms"], rel=0.25), rows
    assert abs(last["error"]) < 0.4, rows
