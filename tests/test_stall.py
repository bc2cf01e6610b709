"""A stopped peer never hangs the job (issue 12): one rank is frozen with
SIGSTOP at a random moment -- inside graph communication, the stop
agreement, a metric mean, an evaluation, a checkpoint gather -- and the job
ends within ``parallel.stall_timeout`` + 5 s, 7 trials on 2 ranks and 7
on 3.

The trials were 20 and 20 (213 s of CI; a trial is a start-up plus the
3 s stall timeout), then 10 and 10, now 7 and 7 (CI time again). 14 stops
are checked, each drawn from its own seventh of the 0.5 s window after
the first metrics line (trial 0 at 0-71 ms, trial 6 at 429-500 ms), so
the stops still span the whole window -- the early iterations, the
checkpoints every 5, the test passes every 7, the display means -- where
random draws over the window could bunch. What is checked less: a hang
that strikes one stop in 40 was caught with probability 0.64 with 40
stops, 0.40 with 20, now 0.30; one that strikes one stop in 10, 0.77
(0.88 with 20).

The stall timeout is 2 s (it was 3 s: each trial waits it out, 20 s of the
file's ~85), as test_rma_faults.py, test_rma_pipeline.py and the trust5
SIGSTOP cases have run on the 2-core CI machine: a stall detected early
would still end the job with "stalled", and the wait for it stays
``stall_timeout`` + 5 s.

Each trial's job starts while the previous one, stopped, waits out its
stall timeout (two jobs at a time, each its own run folder, ranks and
launcher): the stop still comes at the drawn moment after the job's own
first metrics line, and each end is timed from its own stop; what the
trials check is unchanged (the file alone: 93.8 -> 63.6 s and 70.7 ->
41.6 s in two interleaved pairs on the shared 2-core machine). The 2- and
3-rank trials are one such pipeline (the module fixture stall_times): the
first 3-rank trial starts while the last 2-rank one waits, and each test
asserts on its own rank count's trials."""
import random
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import PYTHON, REPO, cli_env, small_net_config, write_config_file
from tests.test_signals import MPIEXEC, _rank_pids, _wait_for_metrics, kill_ranks, sigstop_and_wait

STALL_TIMEOUT = 2.0
TRIALS = 7


@pytest.fixture(scope="module")
def stall_times(tmp_path_factory, digits_h5):
    """{ranks: [seconds from the stop to the end of each trial]}: the
    TRIALS trials on 2 ranks, then those on 3, one pipeline of trials two
    jobs at a time (the first 3-rank trial starts while the last 2-rank
    one waits out its stall timeout, as every trial after the first does);
    a trial that does not end in a stall within the stall timeout + 5 s
    fails the test of its rank count (its figure: the failure, raised
    there)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    tmp = tmp_path_factory.mktemp("stall")
    times = {2: [], 3: []}
    running = []  # (ranks, proc, pids, future of sigstop_and_wait)
    with ThreadPoolExecutor(max_workers=2) as waiters:  # this trial's wait and the last one's
        try:
            for ranks in (2, 3):
                rng = random.Random(1200 + ranks)
                cfg = small_net_config(digits_h5)
                cfg["solver"].update(max_iter=100000, display=3, test_interval=7)
                cfg["checkpoint"] = {"interval": 5, "keep": 2}
                cfg["parallel"] = {"stall_timeout": STALL_TIMEOUT}
                path = write_config_file(tmp, cfg, f"r{ranks}.yaml")
                for trial in range(TRIALS):
                    out = str(tmp / f"r{ranks}t{trial}")
                    proc = subprocess.Popen([MPIEXEC, "-n", str(ranks), PYTHON, "-m",
                                             "purine_mpi", "train", path, "--out", out],
                                            cwd=REPO, env=cli_env(),
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                            text=True)
                    running.append((ranks, proc, [], None))
                    _wait_for_metrics(out, time.time() + 60)
                    pids = sorted(_rank_pids(out))
                    running[-1] = (ranks, proc, pids, None)
                    assert len(pids) == ranks, pids
                    time.sleep(rng.uniform(trial, trial + 1) * 0.5 / TRIALS)
                    victim = rng.choice(pids)
                    running[-1] = (ranks, proc, pids, waiters.submit(
                        sigstop_and_wait, proc, victim, STALL_TIMEOUT + 5, trial,
                        f"rank pid {victim}"))
                    while len(running) > 1:
                        n, *job = running.pop(0)
                        times[n].append(_outcome(*job))
            while running:
                n, *job = running.pop(0)
                times[n].append(_outcome(*job))
        finally:
            for _, proc, pids, _ in running:
                kill_ranks(proc, pids)
    return times


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_sigstop_of_one_rank_ends_the_job_within_the_stall_timeout(stall_times, ranks):
    times = stall_times[ranks]
    assert len(times) == TRIALS
    for took in times:
        if isinstance(took, BaseException):
            raise took
    print(f"{ranks} ranks: SIGSTOP -> exit in {min(times):.2f}..{max(times):.2f} s "
          f"(stall_timeout {STALL_TIMEOUT} s, {TRIALS} trials)")


def _outcome(proc, pids, stopped):
    """_stalled's seconds, or the failure it raised."""
    try:
        return _stalled(proc, pids, stopped)
    except (AssertionError, pytest.fail.Exception) as exc:
        return exc


def _stalled(proc, pids, stopped):
    """Seconds from the stop to the end of the job ``proc`` (``stopped``: the
    future of its ``sigstop_and_wait``), which must have ended in a stall;
    its ranks are killed afterwards, however it ended."""
    try:
        _, stderr, took = stopped.result()
    finally:
        kill_ranks(proc, pids)
    assert proc.returncode != 0, stderr
    assert "stalled" in stderr, stderr[-2000:]
    return took
