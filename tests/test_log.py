"""A log that says what runs (issue 14, item 3).

- the start-up block on rank 0: version, ranks and devices, the scheme and
  which ranks are workers, servers or stages, the global batch, the
  parameter count, the sample counts, the output folder (1 rank, and under
  mpiexec: data parallel, parameter servers, pipeline);
- "first iteration done in X s";
- "resumed from FILE at iteration N"; "already finished at iteration N:
  nothing to do" with exit 0 and no file touched;
- a note for each parallel setting that does nothing at this world size;
- progress of test passes and data conversion: plain lines in a batch log
  (not a terminal), a tqdm bar on a terminal;
- ``bench`` without ``--json`` in human units.

Figures the block shows are checked against independent counts: parameter
counts from the layer shapes by hand, sample counts read with h5py,
bucket counts from ``graph --np 2``.
"""
import os
import re
import subprocess
import sys

import h5py
import pytest
import yaml

from purine_mpi import __version__
from purine_mpi.tools.bench import format_bench
from purine_mpi.job.config import resolve_config
from purine_mpi.parallel.compose import settings_without_effect
from purine_mpi.base.progress_bar import Lines, human_bytes, progress
from tests.conftest import (PYTHON, REPO, cli_env, make_job, run_cli_args, run_cli_here, run_mpi_cli,
                            small_net_config)

# the tiny net: conv1 4x1x3x3 + 4, fc1 10 x (4x4x4) + 10
TINY_PARAMS = 4 * 1 * 3 * 3 + 4 + 10 * 64 + 10


def _write(tmp_path, cfg, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


def _run(*args, env=None, timeout=120):
    e = cli_env()
    e.update(env or {})
    return subprocess.run([PYTHON, "-m", "purine_mpi", *map(str, args)], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=timeout)


def _block(stdout):
    """{label: text} of the start-up block, and the block's lines."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("purine_mpi "))
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        block.append(line)
    rows = {}
    for line in block[1:]:
        label, text = re.match(r"  (\S+(?: \d+)?)\s{2,}(.*)$", line).groups()
        rows[label] = text
    return rows, block


def _counts(path):
    with h5py.File(path, "r") as f:
        return len(f["train/label"]), len(f["test/label"])


# ------------------------------------------------------------ one rank
def test_startup_block_and_first_iteration_on_one_rank(tmp_path, digits_h5):
    out = tmp_path / "run"
    cfg = small_net_config(digits_h5)
    res = run_cli_args("train", _write(tmp_path, cfg), "--out", out)
    assert res.returncode == 0, res.stderr
    rows, block = _block(res.stdout)
    assert block[0] == f"purine_mpi {__version__}: train tiny ({tmp_path / 'cfg.yaml'})"
    assert rows["ranks"] == "1 on 1 host"
    assert re.fullmatch(r"\S+: rank 0 on the CPU", rows["devices"])
    assert rows["scheme"] == "one rank, no parallel scheme"
    assert rows["batch"] == "16 per rank; test 60 per rank"
    nbytes = human_bytes(4 * TINY_PARAMS)
    assert rows["parameters"] == f"{TINY_PARAMS:,} in 4 blobs ({nbytes}, float32)"
    n_train, n_test = _counts(digits_h5)
    assert rows["data"] == f"train {n_train:,} and test {n_test:,} samples of 1x8x8 ({digits_h5})"
    assert rows["solver"] == "sgd, base_lr 0.05, lr_policy fixed; iterations 0 -> 20"
    assert rows["output"] == f"{out} (checkpoints at the end, keep 3)"
    assert re.fullmatch(r"\d+\.\d\d s \(graphs, data, initial weights\)", rows["set-up"])
    # plain lines: no colours or cursor control anywhere in the log
    assert "\x1b" not in res.stdout + res.stderr and "\r" not in res.stdout + res.stderr
    lines = res.stdout.splitlines()
    first = [i for i, line in enumerate(lines) if line.startswith("first iteration done in ")]
    assert len(first) == 1
    assert re.match(r"first iteration done in \d+\.\d\d s \(includes one-time start-up",
                    lines[first[0]])
    # after the block, before the first display line
    assert lines.index(block[-1]) < first[0] < next(
        i for i, line in enumerate(lines) if line.startswith("iter "))
    assert "note:" not in res.stdout  # nothing in this config is without effect


def test_resumed_and_already_finished(tmp_path, digits_h5):
    out = tmp_path / "run"
    cfg = _write(tmp_path, small_net_config(digits_h5))
    assert run_cli_args("train", cfg, "--out", out).returncode == 0
    before = {n: (out / n).read_bytes() for n in ("metrics.jsonl", "config.yaml", "latest.h5")}
    done = run_cli_args("train", cfg, "--out", out, "--resume", "auto")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"resumed from {out / 'latest.h5'} at iteration 20",
        "already finished at iteration 20: nothing to do (solver.max_iter is 20; raise it, or "
        "give --iters, to train on)"]
    assert {n: (out / n).read_bytes() for n in before} == before  # nothing was touched
    # an explicit checkpoint past max_iter says so too
    past = run_cli_args("train", cfg, "--out", out, "--resume", out / "latest.h5",
                        "--iters", "10")
    assert past.returncode == 0, past.stderr
    assert past.stdout.splitlines()[-1] == ("already finished at iteration 20: nothing to do "
                                            "(past solver.max_iter 10)")
    more = run_cli_args("train", cfg, "--out", out, "--resume", "auto", "--iters", "30")
    assert more.returncode == 0, more.stderr
    assert more.stdout.splitlines()[0] == f"resumed from {out / 'latest.h5'} at iteration 20"
    rows, _ = _block(more.stdout)
    assert rows["solver"].endswith("iterations 20 -> 30")
    assert "first iteration done in" in more.stdout and "iter 30/30" in more.stdout


# ------------------------------------------------- settings without effect
def test_async_on_one_rank_says_it_trains_plain_sgd(tmp_path, digits_h5):
    cfg = small_net_config(digits_h5, parallel={"mode": "async"})
    res = run_cli_args("train", _write(tmp_path, cfg), "--out", tmp_path / "run", "--iters", 2)
    assert res.returncode == 0, res.stderr
    notes = [line for line in res.stdout.splitlines() if line.startswith("note:")]
    assert notes == ["note: parallel.mode async has no effect on 1 rank: parameter servers "
                     "need at least 2 ranks (ps_ranks 1 and a worker), so this rank trains "
                     "alone with the plain sgd solver (start mpiexec -n 2 or more for "
                     "servers)"]
    assert res.stdout.index(notes[0]) < res.stdout.index("purine_mpi ")


def test_pipeline_job_on_one_rank_says_it_runs_unsplit(tmp_path, digits_h5):
    res = run_cli_args("train", os.path.join(REPO, "jobs", "digits_pipeline.yaml"),
                       "--set", f"data.train.path={digits_h5}",
                       "--set", f"data.test.path={digits_h5}",
                       "--out", tmp_path / "run", "--iters", 2)
    assert res.returncode == 0, res.stderr
    notes = [line for line in res.stdout.splitlines() if line.startswith("note:")]
    assert notes == ["note: parallel.scheme pipeline has no effect on 1 rank: the 2 stages of "
                     "parallel.stages need 2 ranks, so the net runs unsplit on this rank "
                     "(start mpiexec -n 2 to split it)"]
    assert _block(res.stdout)[0]["scheme"] == "one rank, no parallel scheme"


def _cfg(parallel):
    return resolve_config({"name": "t", "net": [
        {"type": "fc", "name": "fc", "bottom": "data", "top": "fc", "num_output": 2},
        {"type": "softmax_loss", "name": "loss", "bottom": ["fc", "label"], "top": "loss"}],
        "data": {"train": {"source": "synthetic", "shape": [3], "classes": 2,
                           "batch_size": 4}},
        "parallel": parallel}, check_files=False)


@pytest.mark.parametrize("parallel,size,expected", [
    ({}, 1, []),
    ({}, 4, []),
    ({"scheme": "data", "mode": "sync", "bucket_mb": 4}, 1, []),  # defaults say nothing
    ({"mode": "sync_ps"}, 1, ["parallel.mode sync_ps has no effect on 1 rank"]),
    ({"mode": "async", "max_staleness": 2}, 3, []),
    ({"mode": "async"}, 3, ["parallel.mode async with max_staleness 0 lets no worker run "
                            "ahead, so it runs as mode sync_ps"]),
    ({"bucket_mb": 2, "check_collectives": True}, 1,
     ["parallel.bucket_mb, parallel.check_collectives have no effect on 1 rank"]),
    ({"bucket_mb": 2}, 2, []),
    ({"mode": "sync_ps", "min_buckets": 2, "max_staleness": 3}, 3,
     ["parallel.min_buckets shapes allreduce buckets",
      "parallel.max_staleness applies to mode async only"]),
    ({"ps_ranks": 2, "max_staleness": 1}, 4,
     ["parallel.ps_ranks, parallel.max_staleness apply to parameter servers"]),
    ({"schedule": "gpipe"}, 2, ["parallel.schedule orders the micro-batches"]),
    ({"schedule": "gpipe", "micro_batches": 2}, 1, []),
    ({"scheme": "pipeline", "stages": {"fc": 0, "loss": 1}}, 2, []),
    ({"scheme": "pipeline", "stages": {"fc": 0, "loss": 1}, "bucket_mb": 1}, 2,
     ["parallel.bucket_mb shapes allreduce buckets (scheme data with mode sync, or hybrid); "
      "scheme pipeline has no allreduce"]),
    ({"scheme": "hybrid", "stages": {"fc": 0, "loss": 1}}, 1,
     ["parallel.scheme hybrid has no effect on 1 rank: the 2 stages of parallel.stages need a "
      "multiple of 2 ranks"]),
])
def test_settings_without_effect(parallel, size, expected):
    notes = settings_without_effect(make_job(_cfg(parallel)), size)
    assert len(notes) == len(expected), notes
    for note, want in zip(notes, expected):
        assert note.startswith("note: " + want), note


def test_the_jobs_say_nothing_at_their_world_size():
    from purine_mpi.job.config import load_config
    for job, sizes in [("digits_lenet", (1, 2, 4)), ("digits_pipeline", (2,)),
                       ("cifar10_quick", (1, 8)), ("googlenet", (16,))]:
        cfg = load_config(os.path.join(REPO, "jobs", f"{job}.yaml"), check_files=False)
        for size in sizes:
            assert settings_without_effect(make_job(cfg), size) == [], (job, size)


def test_devices_line():
    from purine_mpi.train.runlog import devices_line, ranges
    assert ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    infos = {0: ("a", 0), 1: ("a", 1), 2: ("b", 0), 3: ("b", 1), 4: ("b", -1)}
    assert devices_line(infos) == ("a: ranks 0-1 on GPUs 0, 1; b: rank 4 on the CPU, "
                                   "ranks 2-3 on GPUs 0, 1")
    assert devices_line({0: ("a", -1)}, servers={1: "a", 2: "c"}) == (
        "a: rank 0 on the CPU, rank 1 (server) on the CPU; c: rank 2 (server) on the CPU")
    many = {r: (f"n{r:02d}", -1) for r in range(20)}
    line = devices_line(many)
    assert line.count(" on the CPU") == 8 and line.endswith("; and 12 more hosts")


# ------------------------------------------------------------ progress
def test_test_pass_progress_lines_in_a_batch_log(tmp_path, digits_h5):
    """Not a terminal: plain lines through the log, none when the pass is
    shorter than PURINE_PROGRESS_SECONDS (default 10 s)."""
    cfg = _write(tmp_path, small_net_config(digits_h5))
    fast = _run("train", cfg, "--out", tmp_path / "a", env={"PURINE_PROGRESS_SECONDS": "0"})
    assert fast.returncode == 0, fast.stderr
    n_test = _counts(digits_h5)[1]  # 360: 6 batches of 60
    lines = [line for line in fast.stdout.splitlines() if line.startswith("test ")
             and "samples (" in line]
    assert [line.split(" (")[0] for line in lines] == [
        f"test {k * 60}/{n_test} samples" for k in range(1, 7)]
    assert re.fullmatch(r"test 360/360 samples \(100%, [\d,]+ samples/s, eta 0:00\)", lines[-1])
    # the lines come before the result line of that pass
    out = fast.stdout.splitlines()
    assert out.index(lines[-1]) < next(i for i, s in enumerate(out) if s.startswith("test @"))
    quiet = _run("train", cfg, "--out", tmp_path / "b")
    assert quiet.returncode == 0, quiet.stderr
    assert not [s for s in quiet.stdout.splitlines() if "samples (" in s]
    # the test command: stdout stays one JSON object, progress goes to stderr
    test = _run("test", cfg, "--weights", tmp_path / "a" / "latest.h5",
                env={"PURINE_PROGRESS_SECONDS": "0"})
    assert test.returncode == 0, test.stderr
    assert list(yaml.safe_load(test.stdout)) == ["loss", "accuracy", "samples"]
    assert "test 360/360 samples" in test.stderr


def test_plain_lines_are_throttled():
    now = [0.0]
    lines = []
    rep = Lines(10_000, "test", "samples", lines.append, interval=10, clock=lambda: now[0])
    for _ in range(100):  # 100 batches of 100 samples, 0.5 s each: 50 s
        now[0] += 0.5
        rep.update(100)
    rep.close()
    assert lines == [f"test {k * 2000:,}/10,000 samples ({k * 20}%, 200 samples/s, eta "
                     f"0:{50 - 10 * k:02d})" for k in range(1, 6)]


class _Terminal:
    """A stream that says it is a terminal."""

    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s

    def flush(self):
        pass

    def isatty(self):
        return True


def test_a_terminal_gets_a_bar_and_no_lines(monkeypatch):
    pytest.importorskip("tqdm")
    term, logged = _Terminal(), []
    with progress(300, "test", "samples", log=logged.append, stream=term) as bar:
        for _ in range(3):
            bar.update(100)
    # tqdm draws at most every 0.1 s: the bar shows at its start at least, and is
    # cleared at the end (leave=False)
    assert "test:" in term.text and "/300" in term.text and "samples/s" in term.text
    assert term.text.endswith("\r") and logged == []
    # rank > 0 reports nothing
    with progress(300, "test", log=logged.append, stream=term, enabled=False) as bar:
        bar.update(300)
    assert logged == []


def test_a_terminal_without_tqdm_gets_lines(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm fails
    term, logged = _Terminal(), []
    monkeypatch.setenv("PURINE_PROGRESS_SECONDS", "0")
    with progress(200, "write train", "samples", log=logged.append, stream=term) as bar:
        bar.update(100)
        bar.update(100)
    assert term.text == ""
    assert [s.split(" (")[0] for s in logged] == ["write train 100/200 samples",
                                                  "write train 200/200 samples"]


def test_train_on_a_terminal_shows_a_bar(tmp_path, digits_h5):
    """stderr a terminal (a pty): the test pass shows a tqdm bar there, and
    stdout has no progress lines."""
    pytest.importorskip("tqdm")
    import pty
    import threading
    import fcntl
    import struct
    import termios
    master, slave = pty.openpty()
    # a terminal of 24 x 100 (a new pty has 0 columns: tqdm would draw nothing)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    cfg = _write(tmp_path, small_net_config(digits_h5))
    chunks = []

    def read():  # while the run goes: a closed pty may drop what was not read
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the pty closed
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc = subprocess.Popen([PYTHON, "-m", "purine_mpi", "train", cfg, "--out",
                                 tmp_path / "run"], cwd=REPO, env=cli_env(),
                                stdout=subprocess.PIPE, stderr=slave, text=True)
        os.close(slave)
        out, _ = proc.communicate(timeout=120)
        reader.join(timeout=10)
    finally:
        os.close(master)
    err = b"".join(chunks)
    assert proc.returncode == 0, err
    assert b"test:" in err and b"/360" in err
    assert "samples (" not in out and "test @ iter 20" in out


def test_data_cifar10_progress(tmp_path):
    from tests.test_data import fake_cifar
    src = tmp_path / "cifar-10-batches-py"
    src.mkdir()
    fake_cifar(src, n=8)
    out = tmp_path / "c.h5"
    res = _run("data", "cifar10", "--from", src, "--out", out,
               env={"PURINE_PROGRESS_SECONDS": "0"})
    assert res.returncode == 0, res.stderr
    lines = [s.split(" (")[0] for s in res.stderr.splitlines()]
    assert lines == [f"read {k}/6 files" for k in range(1, 7)] + [
        f"read 40 training and 8 test images from {src}",
        *[f"write train {8 * k}/40 samples" for k in range(1, 6)], "wrote 40 train samples",
        "write test 8/8 samples", "wrote 8 test samples"]
    assert res.stdout == f"wrote {out}\n"
    quiet = _run("data", "cifar10", "--from", src, "--out", tmp_path / "d.h5")
    assert [s.split(" (")[0] for s in quiet.stderr.splitlines()] == [
        f"read 40 training and 8 test images from {src}", "wrote 40 train samples",
        "wrote 8 test samples"]


# --------------------------------------------------------------- bench
def test_bench_human_output():
    res = {"config": "tiny", "world_size": 2, "iters": 5, "batch_per_rank": 8,
           "images_per_s": 31180.98, "iter_ms_median": 5.03, "iter_ms_mean": 5.777,
           "compute_ms_per_iter": 1.005, "comm_ms_per_iter": 8.525, "comm_overlap": 0.1121,
           "post_latency_ms": {"a": 0.0038, "b": 0.003}, "post_latency_ms_worst": 0.0038,
           "peak_mem_bytes": 23732, "max_rss_bytes": 61091840, "backend": "numpy",
           "dispatcher": "EventDispatcher"}
    assert format_bench(res, 3).splitlines() == [
        "bench tiny: 2 ranks, batch 8 per rank, 5 timed iterations after 3 warm-up, backend "
        "numpy, EventDispatcher",
        "  throughput     31,181 images/s",
        "  model FLOPs    n/a",
        "  iteration      5.03 ms median, 5.78 ms mean",
        "  compute        1.00 ms per iteration (rank 0's ops, summed over its threads)",
        "  communication  8.53 ms per iteration, 11% overlapped with compute",
        "  post latency   0.00 ms worst over 2 comm ops",
        "  memory         23.2 KiB in blobs (rank 0), 58.3 MiB peak resident"]
    one = dict(res, world_size=1, comm_overlap=None, post_latency_ms={},
               post_latency_ms_worst=None, comm_ms_per_iter=0.0)
    text = format_bench(one)
    assert "None" not in text and "communication  none" in text
    assert "post latency   n/a (no communication)" in text


def test_bench_cli_prints_human_units(tmp_path, digits_h5):
    res = run_cli_args("bench", _write(tmp_path, small_net_config(digits_h5)), "--iters", 2,
                       "--warmup", 1)
    assert res.returncode == 0, res.stderr
    assert "None" not in res.stdout and "bytes" not in res.stdout
    assert re.search(r"^  throughput     \d{1,3}(,\d{3})* images/s$", res.stdout, re.M)
    assert re.search(r"^  iteration      [\d.]+ ms median, [\d.]+ ms mean$", res.stdout, re.M)
    assert re.search(r"^  memory         [\d.,]+ KiB in blobs \(rank 0\), [\d.,]+ [KMG]iB peak "
                     r"resident$", res.stdout, re.M)


def test_human_bytes():
    assert [human_bytes(n) for n in (None, 0, 1023, 1024, 1536 * 1024, 3 * 1024 ** 3)] == [
        "n/a", "0 B", "1,023 B", "1.0 KiB", "1.5 MiB", "3.0 GiB"]


# ----------------------------------------------------------- under MPI
@pytest.mark.mpi
def test_startup_block_under_mpiexec(tmp_path, digits_h5):
    cfg = small_net_config(digits_h5)
    cfg["solver"]["max_iter"] = 4
    path = _write(tmp_path, cfg)
    res = run_mpi_cli(2, "train", path, "--out", tmp_path / "data")
    assert res.returncode == 0, res.stderr
    rows, block = _block(res.stdout)
    assert res.stdout.count("purine_mpi ") == 1  # rank 0 only
    assert res.stdout.count("first iteration done in") == 1
    assert rows["ranks"] == "2 on 1 host"
    assert re.fullmatch(r"\S+: ranks 0-1 on the CPU", rows["devices"])
    plan = run_cli_here("graph", path, "--np", "2").stdout
    buckets = int(re.search(r"^bucket plan: (\d+) allreduce", plan, re.M).group(1))
    assert rows["scheme"] == (f"data parallel (mode sync): ranks 0-1 are workers, gradients "
                              f"allreduced in {buckets} buckets")
    assert rows["batch"] == "16 per rank x 2 ranks = 32 global; test 60 per rank"
    assert rows["parameters"].startswith(f"{TINY_PARAMS:,} in 4 blobs")
    assert "note:" not in res.stdout
    # every rank agrees that the run is finished (rank 0's folder decides)
    done = run_mpi_cli(2, "train", path, "--out", tmp_path / "data", "--resume", "auto")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("already finished at iteration 4: nothing "
                                                   "to do")

    ps = dict(cfg, parallel={"mode": "async", "max_staleness": 1})
    res = run_mpi_cli(3, "train", _write(tmp_path, ps, "ps.yaml"), "--out", tmp_path / "ps")
    assert res.returncode == 0, res.stderr
    rows, _ = _block(res.stdout)
    assert rows["ranks"] == "3 on 1 host"
    assert re.fullmatch(r"\S+: ranks 0-1 on the CPU, rank 2 \(server\) on the CPU",
                        rows["devices"])
    assert rows["scheme"] == ("parameter servers (mode async, max_staleness 1): ranks 0-1 are "
                              "workers, rank 2 is the server holding the parameters (sharded)")
    assert rows["batch"] == "16 per worker x 2 workers = 32 global; test 60 per worker"

    pipe = dict(cfg, parallel={"scheme": "pipeline", "micro_batches": 2, "stages": {
        "conv1": 0, "relu1": 0, "pool1": 0, "fc1": 1, "loss": 1, "acc": 1}})
    res = run_mpi_cli(2, "train", _write(tmp_path, pipe, "pipe.yaml"), "--out", tmp_path / "pipe")
    assert res.returncode == 0, res.stderr
    rows, _ = _block(res.stdout)
    assert rows["scheme"].startswith("pipeline: 2 stages, rank s runs stage s")
    # first..last layer and the stage's share of the FLOPs (conv1 against fc1)
    assert re.fullmatch(r"rank 0: 3 layers \(conv1\.\.pool1\), \d+\.\d% of the FLOPs",
                        rows["stage 0"]), rows["stage 0"]
    assert re.fullmatch(r"rank 1: 3 layers \(fc1\.\.acc\), \d+\.\d% of the FLOPs",
                        rows["stage 1"]), rows["stage 1"]
    shares = [float(rows[f"stage {s}"].split(", ")[-1].split("%")[0]) for s in (0, 1)]
    assert abs(sum(shares) - 100) < 0.11
    assert rows["micro-batches"] == "2 of 8 samples, schedule 1f1b (per stage, overlapped " \
                                    "across stages)"
    assert rows["batch"] == "16 per pipeline; test 60 per pipeline"
    assert rows["parameters"].startswith(f"{TINY_PARAMS:,} in 4 blobs")
    assert "note:" not in res.stdout
