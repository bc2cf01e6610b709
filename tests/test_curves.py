"""Curves: metrics.jsonl rows (timestamp, time continuous across a resume,
test rows timed, float32 figures at float32 precision), ``plot`` (a PNG of
the runs' curves; bad inputs exit 2) and ``train --tensorboard`` (event files
read back with our own TFRecord reader hold the very figures of
metrics.jsonl)."""
import copy
import glob
import json
import os
import shutil
import struct
import subprocess

import h5py
import numpy as np
import pytest

from purine_mpi.job.checkpoint_file import load_checkpoint
from purine_mpi.job.metrics import float32_value, row_text

from .conftest import (PYTHON, REPO, cli_env, run_cli_args, run_cli_here, small_net_config,
                       write_config_file)


def read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def curves_config(digits_h5):
    cfg = small_net_config(digits_h5)
    cfg["name"] = "curves"
    cfg["solver"].update(max_iter=20, display=5, test_interval=10, base_lr=0.05)
    cfg["checkpoint"] = {"interval": 10, "keep": 3}
    return cfg


def train(*args, expect=0):
    res = run_cli_args("train", *args)
    assert res.returncode == expect, res.stderr
    return res


@pytest.fixture(scope="module")
def runs(digits_h5, tmp_path_factory):
    """One run straight to 20 iterations, one stopped at 10 and resumed to
    20, both with --tensorboard; and a copy of the stopped run whose
    checkpoint lacks 'elapsed' (written before it existed), resumed too."""
    pytest.importorskip("tensorboardX")
    base = tmp_path_factory.mktemp("curves")
    cfg = write_config_file(base, curves_config(digits_h5))
    straight, split, old = base / "straight", base / "split", base / "old"
    train(cfg, "--out", straight, "--tensorboard")
    train(cfg, "--out", split, "--iters", 10, "--tensorboard")
    before = read_rows(split / "metrics.jsonl")
    shutil.copytree(split, old)
    os.remove(old / ".purine.lock")
    for name in ("latest.h5", "ckpt_10.h5"):
        with h5py.File(old / name, "r+") as f:
            del f.attrs["elapsed"]
    ck_elapsed = load_checkpoint(split / "latest.h5").attrs["elapsed"]
    train(cfg, "--out", split, "--resume", "auto", "--tensorboard")
    train(cfg, "--out", old, "--resume", "auto")
    return {"cfg": cfg, "straight": straight, "split": split, "old": old, "before": before,
            "ck_elapsed": ck_elapsed, "base": base}


# ------------------------------------------------------------ metrics.jsonl
def test_float32_figures_are_written_at_float32_precision():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(500).astype(np.float32) * 10.0 ** rng.integers(
        -8, 8, 500), np.float32([0.05, 0.1, 1e-3, 0.9805556, 3.4e38, 1e-45])]).astype(np.float32)
    for v in values:
        text = row_text({"phase": "train", "iter": 1, "lr": float(v)})
        written = json.loads(text)["lr"]
        assert np.float32(written) == v  # reads back as the same float32
        # and is numpy's shortest round-tripping decimal of that float32
        assert float(written) == float(np.format_float_scientific(v, unique=True)), (v, text)
    assert row_text({"lr": float(np.float32(0.05))}) == '{"lr": 0.05}'
    # time, timestamp and images/s keep their own rounding; non-finite is null
    assert json.loads(row_text({"time": 1234567.125, "timestamp": 1795423871.371,
                                "images_per_s": 12345.6, "loss": float("nan")})) == \
        {"time": 1234567.125, "timestamp": 1795423871.371, "images_per_s": 12345.6,
         "loss": None}


def test_lr_is_written_as_0_05_in_the_raw_text(runs):
    text = (runs["straight"] / "metrics.jsonl").read_text()
    assert text.count('"lr": 0.05,') == 4, text  # one per train row (iters 5..20)
    assert "0.0500000" not in text


def test_every_row_has_time_and_a_monotone_timestamp(runs):
    rows = read_rows(runs["straight"] / "metrics.jsonl")
    assert [(r["phase"], r["iter"]) for r in rows] == [
        ("train", 5), ("train", 10), ("test", 10), ("train", 15), ("train", 20), ("test", 20)]
    for r in rows:
        assert isinstance(r["time"], float) and r["time"] > 0, r
        assert isinstance(r["timestamp"], float), r
    stamps = [r["timestamp"] for r in rows]
    times = [r["time"] for r in rows]
    assert stamps == sorted(stamps) and times == sorted(times)
    # Unix seconds: the rows were written in the last hour
    import time
    assert time.time() - 3600 < stamps[0] <= stamps[-1] <= time.time()
    # time and timestamp advance together (both wall time, within this run)
    assert abs((stamps[-1] - stamps[0]) - (times[-1] - times[0])) < 0.25
    # the test row is timed after the train row of the same iteration
    assert rows[2]["time"] >= rows[1]["time"]


def test_time_is_continuous_across_a_resume(runs):
    rows = read_rows(runs["split"] / "metrics.jsonl")
    before = runs["before"]
    assert rows[:len(before)] == before  # the first run's rows are kept as they were
    after = rows[len(before):]
    assert [(r["phase"], r["iter"]) for r in after] == [("train", 15), ("train", 20),
                                                       ("test", 20)]
    last_before = max(r["time"] for r in before)
    assert runs["ck_elapsed"] >= last_before  # the checkpoint holds the time so far
    assert after[0]["time"] >= runs["ck_elapsed"] >= last_before
    times = [r["time"] for r in rows]
    assert times == sorted(times)
    assert after[0]["timestamp"] >= before[-1]["timestamp"]
    assert load_checkpoint(runs["split"] / "latest.h5").attrs["elapsed"] >= times[-1]


def test_a_checkpoint_without_elapsed_continues_from_the_kept_rows(runs):
    rows = read_rows(runs["old"] / "metrics.jsonl")
    n = len(runs["before"])
    assert rows[n]["iter"] == 15 and rows[n]["time"] >= rows[n - 1]["time"]
    assert [r["time"] for r in rows] == sorted(r["time"] for r in rows)


# ---------------------------------------------------------------- TensorBoard
def _crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def _masked_crc(data):
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_events(path):
    """The Event protos of a TFRecord file: uint64 length, masked CRC-32C of
    the length, the record, masked CRC-32C of the record."""
    from tensorboardX.proto import event_pb2
    events = []
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == _masked_crc(header)
        record = data[pos + 12:pos + 12 + length]
        assert struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] == \
            _masked_crc(record)
        events.append(event_pb2.Event.FromString(record))
        pos += 16 + length
    return events


def tb_scalars(folder):
    """{(tag, step): (value, wall_time)} of every event file (oldest first;
    later files override purged steps) and the purge steps seen."""
    out, purges = {}, []
    for path in sorted(glob.glob(os.path.join(folder, "events.out.tfevents.*")),
                       key=os.path.getmtime):
        for e in read_events(path):
            if e.HasField("session_log"):
                purges.append(e.step)
            for v in e.summary.value:
                out[(v.tag, e.step)] = (v.simple_value, e.wall_time)
    return out, purges


def _expected_scalars(rows):
    want = {}
    for r in rows:
        for k, v in r.items():
            if k not in ("phase", "iter", "time", "timestamp", "samples"):
                want[(f"{r['phase']}/{k}", r["iter"])] = (v, r["timestamp"])
    return want


@pytest.mark.parametrize("run", ["straight", "split"])
def test_tensorboard_scalars_equal_metrics_jsonl(runs, run):
    got, purges = tb_scalars(runs[run] / "tb")
    rows = read_rows(runs[run] / "metrics.jsonl")
    want = _expected_scalars(rows)
    assert {"train/loss", "train/lr", "train/images_per_s", "test/loss",
            "test/accuracy"} == {tag for tag, _ in want}
    assert set(got) == set(want)
    for key, (value, stamp) in want.items():
        assert got[key][0] == np.float32(value), key  # TensorBoard keeps float32
        assert got[key][1] == pytest.approx(stamp, abs=1e-3), key
    assert got[("train/lr", 20)][0] == np.float32(0.05)
    # the resumed run's event file tells TensorBoard to drop steps after 10
    assert purges == ([11] if run == "split" else [])


def test_tensorboard_without_tensorboardx_exits_2_before_training(runs, tmp_path):
    code = ("import sys; sys.modules['tensorboardX'] = None; from purine_mpi.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    res = subprocess.run([PYTHON, "-c", code, "train", str(runs["cfg"]), "--tensorboard"],
                         cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        "error: --tensorboard needs the tensorboardX package: "
        "pip install 'purine_mpi[tensorboard]'"]
    assert not os.path.exists(tmp_path / "runs")  # no run folder made, nothing trained


def test_tensorboardx_loads_without_torch():
    """``require_tensorboard`` leaves torch unimported (tensorboardX's writer
    imports it where it is installed: 2.5-5 s of a --tensorboard run's
    start-up, torch's libraries in rank 0's resident bytes) and a later
    ``import torch`` unblocked: the spec is found where torch is installed."""
    pytest.importorskip("tensorboardX")
    import importlib.util
    code = ("import importlib.util, sys; from purine_mpi.job.tensorboard import "
            "require_tensorboard; require_tensorboard(); "
            "print(sum(m.split('.')[0] == 'torch' for m in sys.modules), "
            "importlib.util.find_spec('torch') is not None)")
    res = subprocess.run([PYTHON, "-c", code], cwd=REPO, env=cli_env(), capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    installed = importlib.util.find_spec("torch") is not None
    assert res.stdout.split() == ["0", str(installed)], res.stdout  # torch modules loaded


def test_two_runs_in_one_second_keep_both_event_files(tmp_path):
    """tensorboardX names an event file by the whole second and the host and
    opens it for writing: a run resumed within the second the previous one
    started wiped that run's events (the split run of the test above lost
    steps 5 and 10 once the start-up got faster). Two logs opened at once in
    one folder keep both files and both scalars."""
    pytest.importorskip("tensorboardX")
    from purine_mpi.job.tensorboard import TensorBoardLog
    folder = tmp_path / "tb"
    for it, purge in ((5, None), (10, 6)):
        log = TensorBoardLog(str(folder), purge_step=purge)
        log.write({"phase": "train", "iter": it, "loss": float(it), "timestamp": 1.0})
        log.close()
    got, purges = tb_scalars(folder)
    assert len(glob.glob(str(folder / "events.out.tfevents.*"))) == 2
    assert {key: value for key, (value, _) in got.items()} == \
        {("train/loss", 5): 5.0, ("train/loss", 10): 10.0}


def test_force_deletes_the_tensorboard_folder(runs, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(runs["straight"] / "tb", out / "tb")
    res = run_cli_args("train", runs["cfg"], "--out", out, "--iters", 5)
    assert res.returncode == 2 and "files (tb)" in res.stderr  # tb/ counts as a run's
    train(runs["cfg"], "--out", out, "--iters", 5, "--force")
    assert not (out / "tb").exists()


# ----------------------------------------------------------------------- plot
def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", head
    return struct.unpack(">II", head[16:24])


def test_plot_draws_every_run_and_phase(runs, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "figs" / "curves.png"
    res = run_cli_here("plot", runs["straight"], runs["split"] / "metrics.jsonl",
                       "--out", out)
    assert res.returncode == 0, res.stderr
    width, height = _png_size(out)
    assert 600 <= width <= 4000 and 400 <= height <= 4000
    assert out.stat().st_size > 20000
    # the image holds both runs' colours (C0, C1) in quantity: lines were drawn
    # (C1's resumed run is drawn over C0's identical loss and lr curves, so
    # C0 shows in the legend's one sample and where the runs differ, the
    # throughput panel, which follows the machine's load: 641 pixels alone,
    # 498 in a loaded full run against a bound of 500 before; C1 2,307)
    import matplotlib.image
    import matplotlib.colors
    pixels = (matplotlib.image.imread(str(out))[..., :3] * 255).round()
    for colour in ("C0", "C1"):
        rgb = np.array(matplotlib.colors.to_rgb(colour)) * 255
        assert (np.abs(pixels - rgb).max(axis=-1) < 2).sum() > 300, colour


def test_plot_lines_hold_the_metrics(runs):
    pytest.importorskip("matplotlib")
    from purine_mpi.tools.plot import draw, read_rows as plot_rows
    rows = {r: read_rows(runs[r] / "metrics.jsonl") for r in ("straight", "split")}
    fig = draw([(r, plot_rows(runs[r] / "metrics.jsonl")) for r in ("straight", "split")])
    loss, acc, lr, ips = fig.axes[:4]
    for ax, key, phases in ((loss, "loss", ("train", "test")), (acc, "accuracy", ("test",)),
                            (lr, "lr", ("train",)), (ips, "images_per_s", ("train",))):
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert set(lines) == {f"{r} {p}" for r in rows for p in phases}, (key, set(lines))
        for r in rows:
            for p in phases:
                line = lines[f"{r} {p}"]
                want = [(x["iter"], x[key]) for x in rows[r] if x["phase"] == p]
                assert list(zip(line.get_xdata(), line.get_ydata())) == want
                assert line.get_linestyle() == ("-" if p == "train" else "--")
        colours = {r: {lines[f"{r} {p}"].get_color() for p in phases} for r in rows}
        assert all(len(c) == 1 for c in colours.values())
        assert colours["straight"] != colours["split"]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["straight", "split", "train", "test"]


def test_plot_of_a_job_folder_takes_its_newest_run(runs, tmp_path):
    pytest.importorskip("matplotlib")
    from purine_mpi.tools.plot import resolve_run
    job = tmp_path / "runs" / "curves"
    shutil.copytree(runs["straight"], job / "1")
    shutil.copytree(runs["split"], job / "2")
    (job / "3").mkdir()  # a run that has not written metrics yet
    assert resolve_run(job) == (str(job / "2"), str(job / "2" / "metrics.jsonl"))
    res = run_cli_here("plot", job, "--out", tmp_path / "c.png")
    assert res.returncode == 0, res.stderr
    _png_size(tmp_path / "c.png")


def assert_exit_2(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])


def test_plot_bad_inputs_exit_2(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "c.png"
    assert_exit_2(run_cli_here("plot", tmp_path / "nowhere", "--out", out),
                  "nowhere", "not found")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    assert_exit_2(run_cli_here("plot", empty, "--out", out), "metrics.jsonl", "no metrics rows")
    assert_exit_2(run_cli_here("plot", tmp_path, "--out", out), "holds no metrics.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"phase": "train", "iter": 5, "loss": 1.0}\nhello\n')
    assert_exit_2(run_cli_here("plot", bad, "--out", out), "bad.jsonl", "line 2")
    binary = tmp_path / "w.h5"
    binary.write_bytes(b"\x89HDF\r\n\x1a\n\xff\xfe" * 10)
    assert_exit_2(run_cli_here("plot", binary, "--out", out), "w.h5")
    assert not out.exists()
    # a last line cut short by a kill is ignored
    cut = tmp_path / "cut.jsonl"
    cut.write_text('{"phase": "train", "iter": 5, "loss": 1.0, "lr": 0.1}\n{"phase": "tr')
    res = run_cli_here("plot", cut, "--out", out)
    assert res.returncode == 0, res.stderr
    assert_exit_2(run_cli_here("plot", cut, "--out", tmp_path / "c.nosuchformat"),
                  "c.nosuchformat")


def test_plot_without_matplotlib_exits_2_with_the_install_line(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from purine_mpi.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    res = subprocess.run([PYTHON, "-c", code, "plot", str(tmp_path), "--out",
                          str(tmp_path / "c.png")], cwd=REPO, env=cli_env(),
                         capture_output=True, text=True, timeout=60)
    assert_exit_2(res, "pip install 'purine_mpi[plot]'")
