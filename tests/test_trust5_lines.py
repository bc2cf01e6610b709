"""Issue 42, defect 7: ranks that end the job at the same moment (the stall
watchdog of both workers of a sync_ps run whose server is stopped) write
each message as one whole line: one ``os.write`` of the line and its
newline (runtime/stop.py, ``write_line``), so lines sharing the launcher's
pipe mix only at line boundaries. ``print`` wrote the text and the newline
apart when stderr is unbuffered (``python -u``, PYTHONUNBUFFERED), and two
ranks' messages came out glued on one line."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import PYTHON, REPO, cli_env, small_net_config, write_config_file
from tests.test_signals import MPIEXEC, _rank_pids, _wait_for_metrics, finish_ranks

PAD = "x" * 1500  # a stall message names the ops in flight: about this long
WRITER = f"""
import sys
from purine_mpi.base.errors import StallError
from purine_mpi.comm.world import install_abort_handler

class World:
    rank, size = int(sys.argv[1]), 2

    def abort(self, code):  # the test goes on writing instead
        pass

handle = install_abort_handler(World())
for i in range(int(sys.argv[2])):
    handle(StallError, StallError(f"rank {{World.rank}}: stalled #{{i}} {PAD}"), None)
"""
LINE = re.compile(rf"rank [01]: stalled #\d+ {PAD}")


def test_two_ranks_abort_messages_never_share_a_line():
    """Deterministic in what it checks: two processes write 1500 messages
    each through the abort handler into one pipe at the same time, with
    stderr unbuffered (the widest window); every line is one whole
    message."""
    n = 1500
    env = dict(cli_env(), PYTHONUNBUFFERED="1")
    read, write = os.pipe()
    procs = [subprocess.Popen([PYTHON, "-c", WRITER, str(rank), str(n)], cwd=REPO, env=env,
                              stdout=subprocess.DEVNULL, stderr=write) for rank in (0, 1)]
    os.close(write)
    with os.fdopen(read, "r") as f:
        text = f.read()
    for p in procs:
        assert p.wait(timeout=120) == 0
    lines = text.split("\n")
    assert lines[-1] == ""
    bad = [line[:80] + "..." + line[-40:] for line in lines[:-1] if not LINE.fullmatch(line)]
    assert not bad, f"{len(bad)} of {len(lines) - 1} lines are not one whole message: {bad[:3]}"
    assert len(lines) - 1 == 2 * n


def _rank_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env.get(b"PMI_RANK", b"-1"))


@pytest.mark.mpi
@pytest.mark.slow
def test_sync_ps_workers_stall_messages_are_whole_lines(tmp_path, digits_h5):
    """The issue's case: mpiexec -n 3, sync_ps, the server (rank 2) stopped
    with SIGSTOP; both workers' watchdogs fire at about the same time. Each
    stderr line is one worker's whole message (3 runs, stderr unbuffered)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=100000, display=5, test_interval=0)
    cfg["checkpoint"] = {"interval": 0, "keep": 2}
    cfg["parallel"] = {"scheme": "data", "mode": "sync_ps", "ps_ranks": 1, "max_staleness": 1,
                       "stall_timeout": 2}
    path = write_config_file(tmp_path, cfg)
    env = dict(cli_env(), PYTHONUNBUFFERED="1")
    for trial in range(3):
        out = str(tmp_path / f"run{trial}")
        proc = subprocess.Popen([MPIEXEC, "-n", "3", PYTHON, "-m", "purine_mpi", "train", path,
                                 "--out", out], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        ranks = {}
        try:
            _wait_for_metrics(out, time.time() + 90)
            ranks = {_rank_of(pid): pid for pid in _rank_pids(out)}
            assert sorted(ranks) == [0, 1, 2], ranks
            os.kill(ranks[2], signal.SIGSTOP)
        finally:
            _, stderr = finish_ranks(proc, ranks.values(), 30)
        assert proc.returncode not in (0, None), stderr[-2000:]
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert lines, stderr
        for line in lines:
            assert re.match(r"rank [01]: ", line), stderr[-3000:]
            assert line.count("stalled for more than") == 1, stderr[-3000:]
            assert len(re.findall(r"(?:^|\W)rank [01]: ", line)) == 1, stderr[-3000:]
